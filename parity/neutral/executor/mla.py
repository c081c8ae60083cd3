"""Multi-head latent attention (MLA, DeepSeek-V2/V3), as ``DeepseekV3Attention`` computes it with eager attention.

Queries: ``q = q_b(q_a_norm(q_a(x)))``, or ``q = q(x)`` without ``q_lora_rank``; per head
``[nope (qk_nope_head_dim) | rope (qk_rope_head_dim)]``.
Keys and values come from one compressed vector per token:
``kv_a(x) = [c (kv_lora_rank) | k_rope (qk_rope_head_dim)]``; ``kv_b(kv_a_norm(c))`` gives per head
``[k_nope (qk_nope_head_dim) | v (v_head_dim)]``; ``k_rope`` is one head shared by all heads.
Only the rope parts are rotated; ``k = [k_nope | rope(k_rope)]``, ``q = [q_nope | rope(q_rope)]``.
``out = o(softmax(softcap(q k^T * scale) + mask) v)`` (no MLA model caps its scores; a manifest's cap is honoured
as the other attention honours it, so an injected one is not silently dropped).

Dtypes (the model dtype is x's): every projection and the attention matmuls run in the model dtype;
the q_a / kv_a RMSNorms normalise in float32, cast to the model dtype, then multiply by the weight
(DeepseekV3RMSNorm); cos/sin are cast to the model dtype before rotating (as transformers' rotary
module returns them); the softmax runs in float32 and its probabilities are cast to the model dtype.

Weights (neutral names relative to the layer): ``attn.q_a.weight`` [q_lora_rank, H] (+ ``.bias``),
``attn.q_a_norm.weight``, ``attn.q_b.weight`` [n * (nope + rope), q_lora_rank] or ``attn.q.weight``
[n * (nope + rope), H]; ``attn.kv_a.weight`` [kv_lora_rank + rope, H] (+ ``.bias``),
``attn.kv_a_norm.weight``, ``attn.kv_b.weight`` [n * (nope + v), kv_lora_rank];
``attn.o.weight`` [H, n * v] (+ ``.bias``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from parity.neutral.executor.ops import norm, softcap
from parity.neutral.model import Attention, Mla, Norm


def mla_attention(x: Tensor, w: dict, att: Attention, cos: Tensor, sin: Tensor, mask: Tensor | None,
                  cache_kv: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None, op=None) -> Tensor:
    """MLA output [B, S, H] (what o_proj returns) in x's dtype.

    Args:
        x: [B, S, H] the attention input (after the block's pre-norm).
        w: the layer's tensors by neutral name (see the module docstring).
        att: the layer's attention (parity.neutral.model.Attention): its ``mla`` latents (``q_lora_rank``, None: a
            plain q projection; ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
            ``q_a_norm``, ``kv_a_norm``), ``heads``, ``scale``, ``softcap`` (None: none) and ``rope.style`` ("half" |
            "interleaved").
        cos, sin: [S, rope] or [B, S, rope] in the half layout ``cat(freqs, freqs)`` whatever
            ``rope.style`` is (as transformers' rotary module gives them; rope.cos_sin with style
            "half"), any yarn attention factor already multiplied in.
        mask: additive [B or 1, 1, S, S] (0 where attending, -inf where not), or None.
        cache_kv: the KV cache's hook: given this call's per-head keys and values [B, n, S, *], the ones to attend to
            (a decode step: every cached one, this step's included).
        op: where the operation-level points go (parity.neutral.executor.ops.LayerOps; None: not emitted): attn.q (the
            query projection's output), attn.kv_compressed (kv_a's), attn.kv_norm (its latent part normed),
            attn.scores, attn.probs, attn.context (no q_rope, k_rope: only part of each head rotates).
    """
    B, S, _ = x.shape
    mla = att.mla
    n, nope, rope, v_dim = att.heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim

    q = _queries(x, w, mla)                                        # [B, S, n * (nope + rope)]
    kv_a = F.linear(x, w["attn.kv_a.weight"], w.get("attn.kv_a.bias"))  # [B, S, kv_lora_rank + rope]
    if op is not None:
        op("attn.q", q)
        op("attn.kv_compressed", kv_a)
    q = q.view(B, S, n, nope + rope).transpose(1, 2)                # [B, n, S, nope + rope]
    q_nope, q_rope = q.split([nope, rope], dim=-1)

    c, k_rope = kv_a.split([mla.kv_lora_rank, rope], dim=-1)
    if mla.kv_a_norm is not None:
        c = rms_norm(c, w["attn.kv_a_norm.weight"], mla.kv_a_norm)  # [B, S, kv_lora_rank]
    if op is not None:
        op("attn.kv_norm", c)
    k_rope = k_rope.view(B, 1, S, rope)                             # one rope head shared by all heads

    q_rope = apply_rope(q_rope, cos, sin, att.rope.style)
    k_rope = apply_rope(k_rope, cos, sin, att.rope.style)

    kv = F.linear(c, w["attn.kv_b.weight"])                         # [B, S, n * (nope + v)]
    kv = kv.view(B, S, n, nope + v_dim).transpose(1, 2)             # [B, n, S, nope + v]
    k_nope, v = kv.split([nope, v_dim], dim=-1)

    q = torch.cat([q_nope, q_rope], dim=-1)                         # [B, n, S, nope + rope]
    k = torch.cat([k_nope, k_rope.expand(B, n, S, rope)], dim=-1)   # [B, n, S, nope + rope]
    if cache_kv is not None:
        k, v = cache_kv(k, v)                                             # [B, n, T, *]

    scores = softcap(torch.matmul(q, k.transpose(2, 3)) * att.scale, att.softcap)  # [B, n, S, T]
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)                                    # [B, n, S, v]
    out = out.transpose(1, 2).reshape(B, S, n * v_dim)              # [B, S, n * v]
    if op is not None:
        op.scores(scores)
        op.heads("attn.probs", probs)
        op("attn.context", out)
    return F.linear(out, w["attn.o.weight"], w.get("attn.o.bias"))  # [B, S, H]


def _queries(x: Tensor, w: dict, mla: Mla) -> Tensor:
    """q_b(q_a_norm(q_a(x))), or q(x) without a q low-rank path; [B, S, n * (nope + rope)]."""
    if mla.q_lora_rank is None:
        return F.linear(x, w["attn.q.weight"], w.get("attn.q.bias"))
    q_a = F.linear(x, w["attn.q_a.weight"], w.get("attn.q_a.bias"))  # [B, S, q_lora_rank]
    if mla.q_a_norm is not None:
        q_a = rms_norm(q_a, w["attn.q_a_norm.weight"], mla.q_a_norm)
    return F.linear(q_a, w["attn.q_b.weight"])


def rms_norm(x: Tensor, weight: Tensor, spec: Norm) -> Tensor:
    """x / sqrt(mean(x^2) + eps) in float32, cast to x.dtype, times the weight as stored (DeepseekV3RMSNorm; the
    latent's norm as the manifest states it, ``weight_dtype`` "float32" included)."""
    return norm(x, spec, weight, None)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    """Rotate x [B, heads, S, rope] by the half-layout cos/sin.

    "half": x * cos + rotate_half(x) * sin, pairing dims (j, j + rope/2).
    "interleaved": dims are stored as adjacent pairs (x0, x1), (x2, x3), ...; they are first reordered
    to [x0, x2, x4, ... | x1, x3, x5, ...] and then rotated as "half". The result stays in that
    de-interleaved order (as in transformers; q and k get the same order, so q.k is unchanged). Unlike
    rope.apply, which puts pairs back in place, this keeps transformers' order, so q.k sums in the same order.
    """
    if style == "interleaved":
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    elif style != "half":
        raise ValueError(f"unknown rope_style {style!r} (half or interleaved)")
    if cos.dim() == 3:                                              # [B, S, rope] -> [B, 1, S, rope]
        cos, sin = cos[:, None], sin[:, None]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
