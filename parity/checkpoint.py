"""Reading Hugging Face checkpoint directories: config, safetensors inventory, tensor-map checks.

Only safetensors are read, and only their headers until a tensor is asked for; pickle-based
weights (``*.bin``, ``*.pt``) are refused, never unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from .adapter import Adapter, Resolved, Variant, ignored, load_all, recognise, resolve, text_config
from .errors import ParityError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def read_config(path: Path) -> tuple[dict, Path]:
    """The config of a checkpoint directory or a bare config.json; returns (config, its path)."""
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.exists():
        if path.is_dir():
            raise ParityError(f"{path}: no config.json; give a Hugging Face checkpoint directory or a config.json")
        raise ParityError(f"{path}: no such file or directory")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ParityError(f"{cfg_path}: not valid JSON ({exc}); give the checkpoint's config.json") from None
    if not isinstance(config, dict):
        raise ParityError(f"{cfg_path}: expected a JSON object, found {type(config).__name__}")
    return config, cfg_path


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory ([] when it has no weights at all)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ParityError(f"{index}: not a valid safetensors index ({exc})") from None
        missing = [s for s in shards if not (directory / s).exists()]
        if missing:
            raise ParityError(f"{index}: names shard(s) that are not there: {', '.join(missing)}")
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ParityError(
            f"{directory}: holds only pickle weights ({', '.join(pickles)}); parity reads safetensors only and never "
            f"unpickles. Convert on a machine you trust, e.g. load with transformers and "
            f"save_pretrained(OUT, safe_serialization=True), then point parity at OUT"
        )
    return []


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    file: Path


def inventory(files: list[Path]) -> dict[str, TensorInfo]:
    """Name -> shape/dtype/file for every tensor, read from the headers only."""
    out: dict[str, TensorInfo] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as handle:
                for name in handle.keys():
                    sl = handle.get_slice(name)
                    out[name] = TensorInfo(tuple(sl.get_shape()), sl.get_dtype(), f)
        except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad header
            raise ParityError(f"{f}: not a readable safetensors file ({exc})") from None
    return out


@dataclass
class TensorCheck:
    """How a checkpoint's tensors line up with the adapter's tensor map."""

    prefix: str
    matched: int
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape)

    def problems(self) -> str:
        parts = []
        for label, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("wrong shape", self.wrong_shape)):
            if items:
                parts.append(f"{label} ({len(items)}): {', '.join(items)}")
        return "; ".join(parts)


def check_tensors(resolved: Resolved, tensors: dict[str, TensorInfo]) -> TensorCheck:
    """Every tensor accounted for, none missing, every shape as the config implies."""
    best: TensorCheck | None = None
    for prefix in resolved.variant.tensor_prefix:
        expected = resolved.tensor_map(prefix)
        check = TensorCheck(prefix, matched=len(expected.keys() & tensors.keys()))
        for name, t in expected.items():
            if name not in tensors:
                check.missing.append(name)
            elif tensors[name].shape != t.shape:
                check.wrong_shape.append(f"{name} {list(tensors[name].shape)} (expected {list(t.shape)})")
        for name in sorted(tensors.keys() - expected.keys()):
            (check.ignored if ignored(name, resolved.variant, resolved.env) else check.unexpected).append(name)
        if best is None or check.matched > best.matched:
            best = check
    assert best is not None  # a variant always has a prefix
    return best


@dataclass
class Checkpoint:
    """A checkpoint directory (or a bare config), recognised and resolved against its adapter."""

    path: Path
    config_path: Path
    config: dict
    adapter: Adapter
    variant: Variant
    resolved: Resolved
    files: list[Path]
    tensors: dict[str, TensorInfo]

    @property
    def has_weights(self) -> bool:
        return bool(self.files)


def open_checkpoint(path: Path, adapter_dirs=(), *, adapters: dict[str, Adapter] | None = None) -> Checkpoint:
    """Read a checkpoint's config, find its family, and list its tensors (no weights loaded)."""
    path = Path(path)
    config, cfg_path = read_config(path)
    adapters = adapters if adapters is not None else load_all(adapter_dirs)
    adapter, variant = recognise(config, adapters, str(cfg_path))
    inner = text_config(config, variant, str(cfg_path))
    resolved = resolve(adapter, variant, inner, wrapper=config if inner is not config else None)
    files = weight_files(path) if path.is_dir() else []
    return Checkpoint(path, cfg_path, config, adapter, variant, resolved, files, inventory(files))
