"""Operation-level points: the one layout every side emits them in, and where in that layout an error sits.

Every side (transformers, the executor, llama.cpp, ONNX, an engine, a dump) emits an op as ``[1, S, width]``, S the
positions of the forward, with heads kept as contiguous blocks of the width (docs/ops.md):

    attn.q, attn.q_norm, attn.q_rope            H blocks of head_dim: query head h at [h*Dh, (h+1)*Dh)
    attn.k, attn.v, attn.k_norm, attn.k_rope    K blocks of head_dim (the KV heads, before GQA repeats them)
    attn.scores, attn.probs                     H blocks of T (the keys attended): query head h's row at one
                                                position; scores after scale, softcap and mask, masked entries 0
    attn.context                                H blocks of head_dim: the heads merged, the output projection's input
    attn.kv_compressed, attn.kv_norm            MLA's compressed KV (kv_a output, then its norm): no heads
    mlp.router                                  one logit per expert
    mlp.gate, mlp.up, mlp.act                   intermediate width (act: the down projection's input)

Within a head, q and k rows are in the reference checkpoint's own order (a side that permutes them for its RoPE
kernel, as llama.cpp's "llama" architecture does, restores that order before it emits).
"""

from __future__ import annotations

import torch

# Scores at or below this (or half their dtype's minimum, for float16) are masked (transformers adds the dtype's
# minimum, others -inf): they are emitted as 0, so that a masked entry compares equal, and one that a side failed
# to mask (or masked wrongly) does not.
MASKED = -1e30
# A head or position "carries" the error when it holds at least this share of the squared error.
CARRIES = 0.9


def from_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] (heads first, as attention kernels hold them) -> [B, S, H*D]."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def flat(x: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> [B, S, width] (a per-head [B, S, H, D] keeps its head blocks)."""
    return x.reshape(x.shape[0], x.shape[1], -1)


def part(x: torch.Tensor, span: tuple[int, int], groups: int | None = None) -> torch.Tensor:
    """The [start, stop) part of x's last dimension; with ``groups``, that part of each of ``groups`` consecutive
    blocks of it, concatenated (a fused projection laid out per head: GPT-NeoX's q | k | v within each head)."""
    if not groups:
        return x[..., span[0]:span[1]]
    blocks = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
    return blocks[..., span[0]:span[1]].reshape(*x.shape[:-1], groups * (span[1] - span[0]))


def scores(x: torch.Tensor) -> torch.Tensor:
    """Attention scores [B, H, S, T] -> [B, S, H*T], masked entries 0 (MASKED)."""
    x = from_heads(x)
    limit = max(MASKED, torch.finfo(x.dtype).min / 2) if x.dtype.is_floating_point else MASKED
    return x.masked_fill(x <= limit, 0.0)


def probs(x: torch.Tensor) -> torch.Tensor:
    """Attention probabilities [B, H, S, T] -> [B, S, H*T]."""
    return from_heads(x)


def head_blocks(op: str, width: int, heads: int, kv_heads: int) -> tuple[str, int] | None:
    """How op ``op`` (``attn.q``, ... without the layer) splits its width into heads: ("head" | "kv head", count);
    None where it has no heads (MLP ops, MLA's compressed KV) or the width does not split evenly."""
    if op in ("attn.k", "attn.v", "attn.k_norm", "attn.k_rope"):
        axis, n = "kv head", kv_heads
    elif op in ("attn.q", "attn.q_norm", "attn.q_rope", "attn.scores", "attn.probs", "attn.context"):
        axis, n = "head", heads
    else:
        return None
    return (axis, n) if n > 0 and width % n == 0 else None


def concentration(candidate: torch.Tensor, reference: torch.Tensor, blocks: tuple[str, int] | None,
                  window: int | None = None) -> dict:
    """Where the error of one point sits: each head's and each position's share of the squared error, the head or
    position carrying most of it (over CARRIES), and a sentence saying so. ``window``: the sliding window of the
    layer, so that an error confined to positions past it is named that way."""
    d = (candidate.double() - reference.double())[0]  # [S, width]
    err = d.pow(2)
    total = float(err.sum())
    out: dict = {"heads": None, "positions": None, "summary": ""}
    if total == 0.0 or not torch.isfinite(err).all():
        return out
    words = []
    if blocks is not None:
        axis, n = blocks
        share = (err.sum(0).view(n, -1).sum(1) / total).tolist()
        top = max(range(n), key=lambda h: share[h])
        carrier = top if share[top] >= CARRIES else None
        out["heads"] = {"axis": axis, "shares": share, "carrier": carrier}
        words.append(f"{axis} {top} carries {share[top]:.0%} of the error" if carrier is not None
                     else f"spread over the {axis}s (largest share {share[top]:.0%}, {axis} {top})")
    per = (err.sum(1) / total)
    s = per.shape[0]
    first_bad = int((per > 0.01 / s).nonzero()[0]) if (per > 0.01 / s).any() else 0
    top = int(per.argmax())
    positions = {"shares": per.tolist(), "carrier": top if float(per[top]) >= CARRIES else None,
                 "first": first_bad}
    if positions["carrier"] is not None:
        words.append(f"position {top} of {s} carries {float(per[top]):.0%}")
    elif window and s > window and float(per[window:].sum()) >= CARRIES and first_bad >= window:
        words.append(f"positions past the window ({window}) carry {float(per[window:].sum()):.0%}")
    elif first_bad > 0:
        words.append(f"from position {first_bad} of {s} on (earlier positions agree)")
    else:
        words.append(f"at every position (the first carries {float(per[0]):.0%})")
    out["positions"] = positions
    out["summary"] = "; ".join(words)
    return out

