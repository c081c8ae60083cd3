"""A Hugging Face checkpoint's (or neutral directory's) weights as its headers state them (parity.weights)."""

from __future__ import annotations

import math
from pathlib import Path

from parity.checkpoint import inventory, read_config, weight_files
from parity.storage.shards import CODES, DTYPE_BITS, FLOAT_DTYPES
from parity.weights import Tally, Weights


def checkpoint(path, dtype: str | None = None) -> Weights:
    """A Hugging Face checkpoint's (or neutral directory's) weights as its safetensors headers state them, or as a
    conversion to ``dtype`` ("float16") would store them: its float tensors cast, the rest as they are. The
    config's quantization_config names its scheme, where it has one; its packed tensors' bits are then unknown."""
    cast = CODES[dtype] if dtype is not None else None
    tally = Tally()
    for info in inventory(weight_files(Path(path))).values():
        code = cast if cast is not None and info.dtype in FLOAT_DTYPES else info.dtype
        elements = math.prod(info.shape)
        tally.add(code, elements, elements * DTYPE_BITS[code] // 8)
    config = read_config(Path(path))[0] if cast is None and (Path(path) / "config.json").is_file() else {}
    method = (config.get("quantization_config") or {}).get("quant_method")
    return Weights(tally.types, str(method)) if method else tally.weights()
