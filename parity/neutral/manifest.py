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
from parity.neutral.model import (DTYPE_NAMES, FORMAT, FORMAT_VERSION, MANIFEST, Manifest, executor_tensors,
                                  scaling_problems)
from parity.storage.jsonfile import check_schema, read_json
from parity.storage.lazy import NeutralSource
from parity.storage.shards import hash_file, plain_file_name, read_header

STORED_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}  # name -> safetensors'
DTYPES = {n: getattr(torch, n) for n in DTYPE_NAMES}  # the model dtypes a manifest may state, as torch's
FIX = "re-convert with `parity convert --to neutral`"


def problems(m: Manifest) -> list[str]:
    """What the schema cannot say alone: counts that must agree, sizes that must divide, layers that must exist."""
    found = []
    if len(m.layers) != m.num_layers:
        found.append(f"layers: {len(m.layers)} entries for num_layers {m.num_layers}")
    for i, layer in enumerate(m.layers):
        where = f"layers.{i}.attention"
        att = layer.attention
        rope, mla = att.rope, att.mla
        if (att.kind == "mla") != (mla is not None):
            found.append(f"{where}: kind {att.kind!r} but mla is {'set' if mla else 'null'}")
        if mla is None and att.heads % att.kv_heads:
            found.append(f"{where}: heads {att.heads} is not a multiple of kv_heads {att.kv_heads}")
        if att.kv_shared_from is not None and att.kv_shared_from >= i:
            found.append(f"{where}.kv_shared_from: {att.kv_shared_from} is not an earlier layer")
        if mla is not None and rope is None:
            found.append(f"{where}: MLA needs rope")
        if rope is not None:
            width = mla.qk_rope_head_dim if mla is not None else att.head_dim
            if rope.rotary_dim % 2 or rope.rotary_dim > width:
                found.append(f"{where}.rope.rotary_dim: {rope.rotary_dim} must be even and at most {width}")
            found += scaling_problems(rope, f"{where}.rope.scaling")
        moe = layer.mlp.moe
        if moe is not None:
            where = f"layers.{i}.mlp.moe"
            groups = moe.groups or 1
            if moe.top_k > moe.experts:
                found.append(f"{where}: top_k {moe.top_k} exceeds experts {moe.experts}")
            if groups > 1 and (moe.experts % groups or moe.experts // groups < 2
                               or not 1 <= (moe.groups_kept or 0) <= groups):
                found.append(f"{where}: {moe.experts} experts in {groups} groups (keeping {moe.groups_kept}) do not "
                             f"divide into groups of 2 or more")
    for name, shape in executor_tensors(m).items():
        if name not in m.tensors:
            found.append(f"tensors: {name} is missing (the executor reads it)")
        elif tuple(m.tensors[name].shape) != shape:
            found.append(f"tensors.{name}: shape {m.tensors[name].shape} does not match the sizes the manifest "
                         f"states ({list(shape)})")
    if not m.files:
        found.append("files: lists no file")
    odd = [f for f in m.files if not plain_file_name(f)]
    if odd:
        found.append(f"files: {odd[0]!r} is not a file name in the directory")
    unknown = sorted({t.file for t in m.tensors.values() if t.file is not None} - set(m.files))
    if unknown:
        found.append(f"tensors: name file {unknown[0]!r}, which files does not list")
    return found


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
