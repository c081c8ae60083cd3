"""A neutral directory as the executor reads it: ``manifest.json`` read into the neutral model
(parity.neutral.model: its schema and cross-checks, so that a damaged or hand-edited manifest is refused before
anything runs), its content hashes, and loading its tensors (whole, or a layer at a time). parity.neutral.converter
writes the layout; this module reads it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from parity.errors import ParityError
from parity.neutral.model import DTYPE_NAMES, FORMAT, FORMAT_VERSION, MANIFEST, Manifest, problems
from parity.storage.jsonfile import check_schema, read_json
from parity.storage.lazy import NeutralSource
from parity.storage.shards import hash_file, read_header

STORED_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}  # name -> safetensors'
DTYPES = {n: getattr(torch, n) for n in DTYPE_NAMES}  # the model dtypes a manifest may state, as torch's
FIX = "re-convert with `parity convert --to neutral`"


def validate_manifest(data: Any, file: Path) -> Manifest:
    """The neutral model ``data`` (manifest.json's JSON) states, or one line naming its first problem and place."""
    if not isinstance(data, dict):
        raise ParityError(f"{file}: expected a JSON object, found {type(data).__name__}; {FIX}")
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise ParityError(f"{file}: not a {FORMAT} v{FORMAT_VERSION} manifest; {FIX}")
    manifest = check_schema(Manifest, data, file, FIX)
    found = problems(manifest)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ParityError(f"{file}: {found[0]}{more}; {FIX}")
    return manifest


def read_manifest(path: Path) -> Manifest:
    """A neutral directory's (or a manifest file's) neutral model, validated."""
    path = Path(path)
    file = path / MANIFEST if path.is_dir() else path
    if not file.is_file():
        raise ParityError(f"{path}: no {MANIFEST}; give a directory written by `parity convert --to neutral`")
    return validate_manifest(read_json(file, "re-convert with `parity convert`"), file)


def load(path: Path, *, verify: bool = False, lazy: bool = False) -> tuple[Manifest, Any]:
    """Read a neutral directory: (manifest, tensors by neutral name). Every file's header is checked, and every
    tensor the manifest lists must be there with the shape and dtype it states, before any tensor is read.
    ``lazy``: the tensors are a parity.storage.lazy.NeutralSource, read a layer at a time as the executor reaches
    them."""
    path = Path(path)
    manifest = read_manifest(path)
    directory = path if path.is_dir() else path.parent
    found: dict[str, str] = {}
    for file in manifest.files:
        header = read_header(directory / file, FIX)
        for name, entry in header.tensors.items():
            if name in found:
                raise ParityError(f"{directory / file}: {name} is also in {found[name]}; {FIX}")
            found[name] = file
            info = manifest.tensors.get(name)
            if info is None:
                continue
            if list(entry.shape) != info.shape or entry.dtype != STORED_DTYPES[info.dtype]:
                raise ParityError(f"{directory / file}: {name} is {entry.dtype} {list(entry.shape)} but the manifest "
                                  f"says {STORED_DTYPES[info.dtype]} {info.shape}; {FIX}")
            if info.file not in (None, file):
                raise ParityError(f"{directory / file}: holds {name}, which the manifest places in {info.file}; "
                                  f"{FIX}")
    missing = sorted(set(manifest.tensors) - set(found))
    if missing:
        raise ParityError(f"{path}: tensors listed in the manifest are missing: {', '.join(missing[:8])}"
                          f"{' ...' if len(missing) > 8 else ''}; {FIX}")
    if lazy:
        return manifest, NeutralSource({name: info.file or found[name] for name, info in manifest.tensors.items()},
                                       directory)
    tensors: dict[str, torch.Tensor] = {}
    for file, info in manifest.files.items():
        algorithm, digest = info.hash
        if verify and hash_file(directory / file, algorithm) != digest:
            raise ParityError(f"{directory / file}: its {algorithm} differs from the manifest's; the file changed "
                              f"after conversion")
        try:
            with safe_open(directory / file, framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - the header is checked; a dtype torch lacks, or an I/O error
            raise ParityError(f"{directory / file}: not a readable safetensors file ({str(exc)[:160]}); "
                              f"{FIX}") from None
    return manifest, tensors
