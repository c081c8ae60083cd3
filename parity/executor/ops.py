"""The executor's elementary operations, shared by the dense layer (model.py) and its MoE and MLA variants:
activations, norms with their precision conventions, softcaps."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_exact": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def norm(x: torch.Tensor, spec: dict, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dim, statistics in float32 (``upcast``; "none": the model dtype).

    ``weight_dtype`` says where the weight multiplies: "float32" multiplies the float32
    normalised value and casts once; "model" casts to the model dtype first (Llama's order).
    """
    dtype = x.dtype
    if spec["upcast"] == "none" and dtype != torch.float32:
        y = _low_precision_norm(x, spec)
    elif spec["kind"] == "layernorm":
        y = F.layer_norm(x.float(), x.shape[-1:], None, None, spec["eps"])
    else:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec["eps"])
    if weight is None:
        return y.to(dtype)
    if spec["weight_dtype"] == "float32":
        y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(dtype)
    y = weight * y.to(dtype)
    return y + bias if bias is not None else y


def _mean_in(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim accumulated in x's own dtype, one addition at a time, as a naive
    low-precision kernel does (torch's reductions would quietly accumulate in float32)."""
    acc = torch.zeros_like(x[..., :1])
    for j in range(x.shape[-1]):
        acc = acc + x[..., j:j + 1]
    return acc / x.shape[-1]


def _low_precision_norm(x: torch.Tensor, spec: dict) -> torch.Tensor:
    """The normalisation computed entirely in the model dtype (``upcast`` "none")."""
    if spec["kind"] == "layernorm":
        x = x - _mean_in(x)
    return x * torch.rsqrt(_mean_in(x * x) + spec["eps"])


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): 10 -> 9.6, 30 -> 22.8, 60 -> 28.9 for cap 30."""
    return x if not cap else torch.tanh(x / cap) * cap
