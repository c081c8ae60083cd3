"""Tiny FP8 block-scaled checkpoints, quantized as DeepSeek-V3 and Qwen3-FP8 were: every linear weight of the
decoder layers (not the router, norms, embeddings or head) in float8_e4m3fn with one float32
``weight_scale_inv`` per block, so that ``weight ~ fp8 * scale_inv``."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
QUANTIZED = re.compile(r".*layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-block amax / 448, the grid covering partial last blocks; written as plain loops (no reshapes)."""
    rows, cols = w.shape
    grid = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    for r in range(grid.shape[0]):
        for c in range(grid.shape[1]):
            part = w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]]
            grid[r, c] = max(float(part.abs().max()), 1e-12) / FP8_MAX
    return grid


def expand(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """The per-element scale: each block's entry repeated over the block, cut to the weight's shape."""
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def quantize(source: Path, out: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``out``: ``source`` with its decoder linears block-quantized to FP8. Returns the exact dequantized weights
    (fp8 * scale in float64, by name), for the dequantized twin and for error checks."""
    out.mkdir(parents=True)
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    sd = load_file(source / "model.safetensors")
    exact = {}
    stored = {}
    for name, w in sd.items():
        if QUANTIZED.match(name) and w.dim() == 2:
            scale = block_scales(w.float(), block)
            q = (w.float() / expand(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            stored[name], stored[name + "_scale_inv"] = q, scale
            exact[name] = q.double() * expand(scale.double(), w.shape, block)
        else:
            stored[name] = w
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return exact


def dequantized_twin(source: Path, out: Path, exact: dict[str, torch.Tensor]) -> Path:
    """The FP8 checkpoint's plain twin: same config without quantization, the exact dequantized weights."""
    shutil.copytree(source, out)
    sd = {k: v for k, v in load_file(source / "model.safetensors").items() if not k.endswith("_scale_inv")}
    sd.update({k: v.float() for k, v in exact.items()})
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


if __name__ == "__main__":  # python -m tests.fp8 SOURCE OUT [ROWSxCOLS]: docs/inspecting.md's FP8 example
    import sys

    rows, cols = (int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "128x128").split("x"))
    made = quantize(Path(sys.argv[1]), Path(sys.argv[2]), (rows, cols))
    print(f"wrote {sys.argv[2]}: {len(made)} weights in FP8 e4m3, {rows}x{cols} blocks")
