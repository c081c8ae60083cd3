"""The executor's elementary operations, shared by the dense layer (model.py) and its MoE and MLA variants:
activations, norms with their precision conventions, softcaps; and the emitting of operation-level points."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from parity import ops as layout
from parity.neutral.model import Attention, Mlp, Moe, Norm
from parity.rope import half_permutation, interleave_permutation

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_exact": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def norm(x: torch.Tensor, spec: Norm, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dim, statistics in float32 (``upcast``; "none": the model dtype).

    ``weight_dtype`` says where the weight multiplies: "float32" multiplies the float32
    normalised value and casts once; "model" casts to the model dtype first (Llama's order).
    """
    dtype = x.dtype
    if spec.upcast == "none" and dtype != torch.float32:
        y = _low_precision_norm(x, spec)
    elif spec.kind == "layernorm":
        y = F.layer_norm(x.float(), x.shape[-1:], None, None, spec.eps)
    else:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec.eps)
    if weight is None:
        return y.to(dtype)
    if spec.weight_dtype == "float32":
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


def _low_precision_norm(x: torch.Tensor, spec: Norm) -> torch.Tensor:
    """The normalisation computed entirely in the model dtype (``upcast`` "none")."""
    if spec.kind == "layernorm":
        x = x - _mean_in(x)
    return x * torch.rsqrt(_mean_in(x * x) + spec.eps)


def glu(gate: torch.Tensor, up: torch.Tensor, spec: Mlp | Moe) -> torch.Tensor:
    """The gated unit act(gate) * up, with the manifest's ``glu_*`` arithmetic where it states some (GPT-OSS):
    gate clamped to at most ``glu_limit`` and up to [-glu_limit, glu_limit]; the activation read at
    ``glu_alpha * gate`` and divided by it (silu: gate * sigmoid(alpha * gate), computed so); up + ``glu_up_offset``.
    """
    limit, alpha, offset = spec.glu_limit, spec.glu_alpha, spec.glu_up_offset
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if alpha == 1.0:
        hidden = ACTIVATIONS[spec.activation](gate)
    elif spec.activation == "silu":
        hidden = gate * torch.sigmoid(gate * alpha)
    else:
        hidden = ACTIVATIONS[spec.activation](gate * alpha) / alpha
    return hidden * (up + offset if offset else up)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): 10 -> 9.6, 30 -> 22.8, 60 -> 28.9 for cap 30."""
    return x if not cap else torch.tanh(x / cap) * cap


# ---------------------------------------------------------------- operation-level points (docs/ops.md)


class LayerOps:
    """One layer's operation-level points, emitted through ``emit`` as ``layers.{i}.<op>`` in docs/ops.md's layouts
    (parity.ops): [B, S, width], heads as contiguous blocks, q/k rows within a head in the source checkpoint's order
    (``restore``: op -> the width index that puts them back, from ``row_order``)."""

    def __init__(self, emit: Callable[[str, torch.Tensor], None], prefix: str, restore: dict[str, torch.Tensor]):
        self.emit, self.prefix, self.restore = emit, prefix, restore

    def __call__(self, op: str, x: torch.Tensor) -> None:
        """``x``: [B, S, ...] (a per-head [B, S, H, D] keeps its head blocks)."""
        x = layout.flat(x)
        index = self.restore.get(op)
        if index is not None:
            x = x.index_select(-1, index.to(x.device))
        self.emit(self.prefix + op, x)

    def heads(self, op: str, x: torch.Tensor) -> None:
        """``x``: heads first, [B, H, S, D] (as attention holds q, k and probabilities)."""
        self(op, layout.from_heads(x))

    def scores(self, x: torch.Tensor) -> None:
        """Scores [B, H, S, T] after scale, softcap and mask: masked entries emitted as 0."""
        self.emit(self.prefix + "attn.scores", layout.scores(x))


def _blocks(count: int, block: int, offset: int, perm: torch.Tensor) -> torch.Tensor:
    """A width index of ``count`` blocks of ``block`` that reorders entries offset..offset+len(perm) of each by perm."""
    index = torch.arange(count * block)
    for h in range(count):
        start = h * block + offset
        index[start:start + len(perm)] = start + perm
    return index


def row_order(att: Attention, stored: str | None, source: str | None) -> dict[str, torch.Tensor]:
    """For a layer's attention whose q/k rows are stored in RoPE style ``stored`` (the
    manifest's ``rope_style``: a conversion's --rope-style) where the source checkpoint has ``source``: per op, the
    width index restoring the source's row order within each head (parity/rope.py's permutations). Empty where the
    two agree. (MLA emits no q_rope, k_rope; its rotation would leave them in transformers' order either way.)"""
    rope = att.rope
    if rope is None or stored is None or source is None or stored == source:
        return {}
    make = interleave_permutation if source == "interleaved" else half_permutation
    mla = att.mla
    if mla is not None:
        nope, rot, latent = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        return {"attn.q": _blocks(att.heads, nope + rot, nope, make(rot, rot)),
                "attn.kv_compressed": _blocks(1, latent + rot, latent, make(rot, rot))}
    dh, rot = att.head_dim, rope.rotary_dim
    q = _blocks(att.heads, dh, 0, make(rot, rot))
    k = _blocks(att.kv_heads, dh, 0, make(rot, rot))
    order = {**{f"attn.{op}": q for op in ("q", "q_norm", "q_rope")},
             **{f"attn.{op}": k for op in ("k", "k_norm", "k_rope")}}
    if att.k_eq_v:  # values are the stored keys: they and the heads they merge into follow the keys' rows
        order.update({"attn.v": k, "attn.context": q})
    return order
