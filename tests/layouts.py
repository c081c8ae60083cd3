"""Real checkpoint layouts (``tests/fixtures/layouts/<name>/``) materialised as weightless checkpoint directories.

Each layout is a real ``config.json`` + ``model.safetensors.index.json`` pair (``SOURCES.md`` says where each
came from). ``materialise`` writes, for every shard the index names, a safetensors file whose header lists
that shard's tensors under their real names, with the shape transformers' own model class gives them and the
config's dtype, followed by a sparse all-zero data region: the file has its full size but holds no blocks
beyond its header, so a 27B layout takes kilobytes of disk.

Shapes come from transformers, not from parity: the config's architecture class is built on the meta device
and each checkpoint name is mapped to its in-memory name with transformers' own key renaming (the same
``get_model_conversion_mapping`` / ``rename_source_key`` that ``from_pretrained`` and ``parity.storage.lazy`` use;
e.g. medgemma's ``language_model.model.X`` is ``model.language_model.X`` in memory). A checkpoint tensor that
transformers would drop on load, or that a converter reshapes, is a ``LayoutError``: the layout cannot be
materialised faithfully, and saying so beats a shape guessed.
"""

from __future__ import annotations

import functools
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import transformers

from parity.storage.shards import DTYPE_BITS

LAYOUTS = Path(__file__).parent / "fixtures" / "layouts"
NAMES = sorted(p.name for p in LAYOUTS.iterdir() if (p / "config.json").is_file())
INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


class LayoutError(AssertionError):
    """A layout transformers cannot account for: a test failure, with the tensor names in the message."""


@dataclass(frozen=True)
class Layout:
    name: str
    directory: Path
    config: dict
    index: dict                       # the index file as stored (metadata + weight_map)
    dtype: str                        # safetensors dtype string of every tensor, from the config
    shapes: Mapping[str, tuple]       # checkpoint name -> shape, in index order
    in_memory: Mapping[str, str]      # checkpoint name -> transformers' in-memory name

    @property
    def weight_map(self) -> dict[str, str]:
        return self.index["weight_map"]

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]

    def nbytes(self, name: str) -> int:
        n = DTYPE_BITS[self.dtype]
        for d in self.shapes[name]:
            n *= d
        return n // 8

    @property
    def total_size(self) -> int:
        return sum(self.nbytes(n) for n in self.shapes)


def config_dtype(config: dict, name: str = "config.json") -> str:
    """The safetensors dtype string of the config's ``dtype`` / ``torch_dtype`` (a wrapper's, else its text config's)."""
    for table in (config, config.get("text_config") or {}):
        value = table.get("dtype") or table.get("torch_dtype")
        if value:
            if value not in SAFETENSORS_DTYPES:
                raise LayoutError(f"{name}: dtype {value!r} has no safetensors name here; add it to SAFETENSORS_DTYPES")
            return SAFETENSORS_DTYPES[value]
    raise LayoutError(f"{name}: no dtype / torch_dtype; the layout cannot say what its tensors are stored as")


def meta_model(directory: Path):
    """transformers' own model for the config's first architecture, on the meta device (no memory, seconds)."""
    config = transformers.AutoConfig.from_pretrained(directory)
    architecture = config.architectures[0]
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise LayoutError(f"{directory}: transformers {transformers.__version__} has no class {architecture}")
    with torch.device("meta"):
        return cls(config)


@functools.lru_cache(maxsize=None)
def load(name: str) -> Layout:
    """Layout ``name`` of ``tests/fixtures/layouts`` (built once per process)."""
    return load_dir(LAYOUTS / name)


def load_dir(directory: Path) -> Layout:
    """A layout with every checkpoint tensor's shape as transformers gives it; LayoutError when one has none."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    directory = Path(directory)
    name = directory.name
    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / INDEX).read_text())
    dtype = config_dtype(config, str(directory / "config.json"))
    model = meta_model(directory)
    meta = model.state_dict()
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = model.base_model_prefix

    shapes: dict[str, tuple] = {}
    in_memory: dict[str, str] = {}
    dropped, converted = [], []
    for key in index["weight_map"]:
        # as transformers renames on load (parity.storage.lazy._Loader.rename): renamings, at most one converter,
        # then the base-model prefix added or stripped as the model needs
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:
            renamed, pattern = rename_source_key(key, [], [], prefix, meta)
        if renamed not in meta:
            dropped.append(f"{key} (renamed {renamed})" if renamed != key else key)
        elif pattern is not None:
            converted.append(f"{key} -> {renamed} (converter {pattern})")
        else:
            shapes[key] = tuple(meta[renamed].shape)
            in_memory[key] = renamed
    problems = []
    if dropped:
        problems.append(f"{len(dropped)} tensor(s) transformers {transformers.__version__} has no place for in "
                        f"{model.__class__.__name__} (dropped on load): {', '.join(dropped[:10])}"
                        + (" ..." if len(dropped) > 10 else ""))
    if converted:
        problems.append(f"{len(converted)} tensor(s) a converter reshapes on load, so their stored shape is not "
                        f"the in-memory one: {', '.join(converted[:10])}" + (" ..." if len(converted) > 10 else ""))
    if problems:
        raise LayoutError(f"layout {name}: " + "; ".join(problems))
    return Layout(name, directory, config, index, dtype, shapes, in_memory)


def write_sparse_safetensors(path: Path, tensors: Mapping[str, tuple[str, tuple]], metadata: dict | None = None) -> int:
    """A safetensors file of ``{name: (dtype, shape)}`` in that order, offsets contiguous, data all zeros and
    sparse (header written, then the file truncated up to its full size). Returns the file's size."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        bits = DTYPE_BITS[dtype]
        for d in shape:
            bits *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + bits // 8]}
        offset += bits // 8
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    size = 8 + len(raw) + offset
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(size)
    return size


def materialise(name: str, dest: Path, *, drop: tuple[str, ...] = (), rename: Mapping[str, str] | None = None) -> Path:
    """Layout ``name`` as a checkpoint directory ``dest``: config.json, the index, and one sparse safetensors
    file per shard. ``drop`` leaves tensors out and ``rename`` ({old: new}) stores them under another name, in
    the index and the headers alike (a damaged checkpoint that is still self-consistent)."""
    layout = load(name)
    rename = dict(rename or {})
    unknown = [n for n in (*drop, *rename) if n not in layout.shapes]
    if unknown:
        raise LayoutError(f"layout {name} has no tensor(s) {', '.join(unknown)}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(layout.directory / "config.json", dest / "config.json")
    weight_map: dict[str, str] = {}
    shards: dict[str, dict[str, tuple[str, tuple]]] = {}
    for key, shard in layout.weight_map.items():
        if key in drop:
            continue
        stored = rename.get(key, key)
        weight_map[stored] = shard
        shards.setdefault(shard, {})[stored] = (layout.dtype, layout.shapes[key])
    for shard in sorted(set(layout.weight_map.values())):
        write_sparse_safetensors(dest / shard, shards.get(shard, {}))
    if drop or rename:
        index = dict(layout.index, weight_map=weight_map)
        (dest / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    else:
        shutil.copyfile(layout.directory / INDEX, dest / INDEX)  # byte for byte
    return dest
