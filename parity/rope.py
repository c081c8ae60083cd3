"""RoPE math, with no model to run: the inverse frequencies a layer's RoPE implies and the row permutations
between its two pair layouts. The layout code (saved buffers, converters, exporters, prompt lengths) and the
executor (parity/neutral/executor/rope.py, which applies RoPE at run time) both read it from here.

One layer's RoPE is a ``Rope``: parity.neutral.model.Rope, the neutral model's ``layers[i].attention.rope`` (this
floor reads its fields, and imports nothing of parity). ``scaling`` stays the config's own
``rope_scaling`` mapping, ``{"rope_type": "linear" | "dynamic" | "yarn" | "llama3" | ..., **params}``: its
parameters differ by type (parity.neutral.model checks them).

Position p rotates pair k by the angle p * inv_freq[k]. Unscaled, inv_freq[k] = theta ** (-2k / r); each
scaling type below reshapes that vector (and yarn/longrope also scale cos and sin by an attention factor).
Every number here is computed with the same float32 torch operations, in the same order, as transformers'
``modeling_rope_utils``: at position 100 000 one ulp of inv_freq moves the angle by ~0.01 rad, so anything
less than bit-exact inverse frequencies is visibly wrong on long prompts.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch


class Rope(Protocol):
    """What this module reads of one layer's RoPE (parity.neutral.model.Rope says what each field means)."""

    theta: float
    rotary_dim: int
    head_dim: int
    scaling: dict[str, Any] | None
    max_positions: int | None


# --------------------------------------------------------------------------------------------
# Inverse frequencies, one function per scaling type: (rope, scaling, seq_len) -> (inv_freq [r/2], attention factor)


def _powers(theta: float, count: int, dim: int) -> torch.Tensor:
    """theta ** (2k / dim) for k < count, in float32: [count]."""
    return theta ** (torch.arange(0, 2 * count, 2, dtype=torch.int64).float() / dim)


def _default(rope: Rope, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Unscaled RoPE: inv_freq[k] = 1 / theta ** (2k / r)."""
    r = rope.rotary_dim
    return 1.0 / _powers(rope.theta, r // 2, r), 1.0


def _linear(rope: Rope, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Linear (position interpolation): every frequency divided by ``factor``, i.e. positions squeezed by it."""
    inv, _ = _default(rope, scaling, seq_len)
    return inv / scaling["factor"], 1.0


def _proportional(rope: Rope, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Gemma 4's proportional RoPE: the table spans the whole head, but only a fraction of it turns.

    The first ``int(partial_rotary_factor * head_dim // 2)`` frequencies are theta ** (-2k / head_dim), spaced by
    the full head_dim (not by the rotated width); the remaining ones are 0, so those pairs get cos 1, sin 0 and
    pass through unrotated. All are divided by ``factor`` (default 1).
    """
    head_dim = rope.head_dim
    turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
    still = rope.rotary_dim // 2 - turning
    inv = torch.cat((1.0 / _powers(rope.theta, turning, head_dim), torch.zeros(still)))
    return inv / scaling.get("factor", 1.0), 1.0


def _dynamic(rope: Rope, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Dynamic NTK: past ``max_positions`` the base grows with the sequence length L.

    theta' = theta * (factor * L / max_positions - (factor - 1)) ** (r / (r - 2)); up to max_positions theta' =
    theta. transformers computes the grown base with float32 tensors (L is a tensor at run time) and the initial one
    with Python floats; both are reproduced. (transformers also keeps the grown frequencies for later, shorter
    calls until L drops below max_positions; here they depend on this call's L only.)
    """
    r, max_pos, factor = rope.rotary_dim, rope.max_positions, scaling["factor"]
    length = max_pos if seq_len is None or seq_len <= max_pos else torch.tensor(seq_len)
    theta = rope.theta * ((factor * length / max_pos) - (factor - 1)) ** (r / (r - 2))
    return 1.0 / _powers(theta, r // 2, r), 1.0


def _llama3(rope: Rope, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """Llama 3.1: slow frequencies divided by ``factor``, fast ones kept, a linear blend in between.

    With L = original_max_position_embeddings and wavelength 2 pi / f: wavelengths above L / low_freq_factor are
    divided by factor; below L / high_freq_factor they are kept; between, f' = (1 - s) f / factor + s f with
    s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    """
    inv, _ = _default(rope, scaling, seq_len)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling.get("original_max_position_embeddings", rope.max_positions)
    wavelen = 2 * math.pi / inv
    slow = wavelen > old_len / low
    medium = ~(wavelen < old_len / high) & ~slow
    inv = torch.where(slow, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(medium, blended, inv), 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_ramp_bounds(scaling: dict, r: int, theta: float, old_len: int) -> tuple[float, float]:
    """Pair indices that turn beta_fast and beta_slow times in old_len positions (rounded out unless truncate=False)."""

    def dim_of(rotations: float) -> float:
        return (r * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, r - 1)


def _yarn(rope: Rope, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """YaRN: fast dims keep their frequency, slow dims are interpolated (divided by ``factor``), a ramp between.

    The ramp runs over pair indices [low, high] found from beta_fast / beta_slow (the dims that turn that many
    times within original_max_position_embeddings). cos and sin are scaled by ``attention_factor``: given, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek), else
    mscale(factor) = 0.1 ln(factor) + 1. A missing factor is max_positions / original_max_position_embeddings.
    """
    r, theta = rope.rotary_dim, rope.theta
    old_len = scaling.get("original_max_position_embeddings", rope.max_positions)
    factor = scaling.get("factor") or rope.max_positions / old_len
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention = yarn_mscale(factor)

    freqs = _powers(theta, r // 2, r)
    kept, interpolated = 1.0 / freqs, 1.0 / (factor * freqs)
    low, high = _yarn_ramp_bounds(scaling, r, theta, old_len)
    if low == high:
        high += 0.001  # a ramp of width 0 would divide by 0
    ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 for fast dims (below low), 0 for slow ones (above high)
    return interpolated * (1 - keep) + kept * keep, attention


def _longrope(rope: Rope, scaling: dict, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-pair divisors, ``long_factor`` once seq_len passes original_max_position_embeddings,
    ``short_factor`` before. cos/sin scale: attention_factor, or sqrt(1 + ln(factor) / ln(original)) for factor > 1,
    where a missing factor is max_positions / original_max_position_embeddings."""
    r = rope.rotary_dim
    old_len = scaling.get("original_max_position_embeddings", rope.max_positions)
    factor = scaling.get("factor") or rope.max_positions / old_len
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    long = seq_len is not None and seq_len > old_len
    divisors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (divisors * _powers(rope.theta, r // 2, r)), attention


SCALINGS = {
    "default": _default,
    "linear": _linear,
    "proportional": _proportional,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


LENGTH_DEPENDENT = ("dynamic", "longrope")  # scalings whose frequencies depend on the sequence length


def inv_freq(rope: Rope, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies after scaling, float32 [rotary_dim // 2], and the factor that multiplies cos and sin.

    ``seq_len`` (the longest position + 1) matters only to "dynamic" and "longrope".
    """
    scaling = rope.scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind not in SCALINGS:
        raise ValueError(f"RoPE scaling type {kind!r} is not implemented; known types: {', '.join(SCALINGS)}")
    inv, attention = SCALINGS[kind](rope, scaling, seq_len)
    if inv.shape != (rope.rotary_dim // 2,):
        raise ValueError(f"RoPE {kind!r} gave {inv.shape[0]} frequencies for rotary_dim {rope.rotary_dim}")
    return inv, attention


# --------------------------------------------------------------------------------------------
# Converting a checkpoint between the two styles


def interleave_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Index map p [head_dim]: rows_interleaved = rows_half[p] for one head's q or k projection rows.

    Half-split pair (j, j + r/2) lands in dims (2j, 2j+1); dims from rotary_dim on stay in place. Applied to both
    q and k rows, attention scores are unchanged when parity.neutral.executor.rope.apply() then runs with style
    "interleaved".
    """
    half = rotary_dim // 2
    pairs = torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()  # 0, r/2, 1, r/2+1, ...
    return torch.cat((pairs, torch.arange(rotary_dim, head_dim)))


def half_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Index map q [head_dim]: rows_half = rows_interleaved[q], the inverse of interleave_permutation."""
    pairs = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))    # 0, 2, 4, ..., 1, 3, ...
    return torch.cat((pairs, torch.arange(rotary_dim, head_dim)))
