"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1, Qwen3-FP8, and others saved the same way).

A quantized linear stores ``X.weight`` as float8_e4m3 [rows, cols] and ``X.weight_scale_inv`` as float32
[ceil(rows / b0), ceil(cols / b1)], one scale per b0 x b1 block (``quantization_config.weight_block_size``,
128 x 128 in the released models). The real weight is ``weight * scale`` of its block; the last block of a
dimension that is not a multiple of the block is partial (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows). Norms,
embeddings, routers and the LM head stay in bf16.

parity dequantizes tensor by tensor, in float32, and casts to the dtype asked for: convert writes the result
into the neutral layout, and a streamed reference loads it into transformers' model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parity.errors import ParityError

if TYPE_CHECKING:  # imported where used: reading a config, or converting an unquantized checkpoint, needs no torch
    import torch

SCALE_SUFFIX = "_scale_inv"            # X.weight -> X.weight_scale_inv
FP8_DTYPES = ("F8_E4M3",)             # stored weight dtypes that need their scale (fmt e4m3, all parity reads)
ROWS_AT_A_TIME = 4096                  # the rounding of a dequantized weight is measured this many rows at a time


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's FP8 block quantization, from its config's ``quantization_config``."""

    block: tuple[int, int]
    fmt: str
    activation_scheme: str

    def describe(self) -> str:
        return f"fp8 {self.fmt}, {self.block[0]}x{self.block[1]} blocks"

    def to_json(self) -> dict:
        return {"method": "fp8", "format": self.fmt, "block": list(self.block),
                "activation_scheme": self.activation_scheme}


def read_quantization(config: dict, source: str = "config.json") -> BlockFP8 | None:
    """The checkpoint's FP8 block quantization; None for an unquantized checkpoint; refused for others."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ParityError(f"{source}: quantization_config must be a JSON object; fix the config")
    method = q.get("quant_method")
    if method != "fp8":
        raise ParityError(f"{source}: quantization {method!r} is not one parity reads (it reads FP8 block-scaled "
                          f"checkpoints, quant_method \"fp8\"); dequantize it with its own tools first and point "
                          f"parity at the result")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ParityError(f"{source}: quantization_config.weight_block_size must be two positive integers "
                          f"(got {block!r}); parity reads block-scaled FP8 (per-tensor FP8 has no block)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ParityError(f"{source}: FP8 format {fmt!r} is not one parity reads (e4m3)")
    return BlockFP8((block[0], block[1]), fmt, str(q.get("activation_scheme", "dynamic")))


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight: one per block of its last two dimensions (partial blocks count)."""
    return (*shape[:-2], *(math.ceil(s / b) for s, b in zip(shape[-2:], block)))


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """``weight * scale`` of each block, computed in float32 (float64 if asked) and cast to ``dtype`` (float32 if
    None) once."""
    import torch  # torch: parity.neutral.converter imports this module

    dtype = torch.float32 if dtype is None else dtype
    rows, cols = weight.shape[-2:]
    b0, b1 = block
    if tuple(scale.shape) != scale_shape(tuple(weight.shape), block):
        raise ParityError(f"a scale of shape {list(scale.shape)} does not fit a weight of shape {list(weight.shape)} "
                          f"in {b0}x{b1} blocks (expected {list(scale_shape(tuple(weight.shape), block))})")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale.to(compute)
    grid_r, grid_c = s.shape[-2:]
    w = weight.to(compute)
    if grid_r * b0 != rows or grid_c * b1 != cols:  # partial last blocks: pad, scale, cut back
        w = torch.nn.functional.pad(w, (0, grid_c * b1 - cols, 0, grid_r * b0 - rows))
    lead = w.shape[:-2]
    w = w.reshape(*lead, grid_r, b0, grid_c, b1) * s.reshape(*lead, grid_r, 1, grid_c, 1)
    return w.reshape(*lead, grid_r * b0, grid_c * b1)[..., :rows, :cols].to(dtype).contiguous()


def rounding_error(x: torch.Tensor, dtype: torch.dtype) -> float:
    """rel_l2 of the float32 dequantization ``x`` written at ``dtype`` (0 for float32: x is fp8 * scale correctly
    rounded, within 2 ** -24 of the exact product), a few thousand rows at a time in float32, summed in float64."""
    import torch  # torch: parity.neutral.converter imports this module

    if dtype == torch.float32:
        return 0.0
    num = den = 0.0
    for rows in x.reshape(-1, x.shape[-1]).split(ROWS_AT_A_TIME):
        num += float(torch.linalg.vector_norm(rows.to(dtype).float().sub_(rows), dtype=torch.float64)) ** 2
        den += float(torch.linalg.vector_norm(rows, dtype=torch.float64)) ** 2
    return math.sqrt(num / den) if den else 0.0


def quantized_weights(tensors: dict[str, Any]) -> dict[str, str]:
    """{weight name: its scale's name} for every FP8 weight (TensorInfo.dtype) stored with a block scale beside it."""
    return {name: scale_name(name) for name, info in tensors.items()
            if info.dtype in FP8_DTYPES and scale_name(name) in tensors}
