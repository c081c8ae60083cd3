"""Rotary position embeddings (RoPE) applied at run time, in plain torch: the cos/sin tables of a prompt's
positions and the rotation of q and k.

A layer's RoPE (parity.neutral.model.Rope), its scaling types and their inverse frequencies are described in
parity/rope.py, which this module reads them from.

Shapes: B batch, H heads, S sequence, Dh head_dim, r rotary_dim.
"""

from __future__ import annotations

import torch

from parity.neutral.model import Rope
from parity.rope import LENGTH_DEPENDENT, inv_freq

# --------------------------------------------------------------------------------------------
# Tables and rotation


def by_length(rope: Rope | None) -> bool:
    """Whether this rope's frequencies depend on the sequence's length ("dynamic", "longrope")."""
    return rope is not None and (rope.scaling or {}).get("rope_type") in LENGTH_DEPENDENT


def cos_sin(rope: Rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, float32 [S, r], already times the attention factor.

    Laid out for ``style``: "half" repeats the r/2 angles as a block (a0 .. a_{r/2-1}, a0 .. a_{r/2-1});
    "interleaved" repeats each one for its adjacent pair (a0, a0, a1, a1, ...).
    """
    # only "dynamic" and "longrope" read the length (from the data: an exported graph cannot, see engines/onnx/export.py)
    scaling = rope.scaling or {}
    if scaling.get("rope_type") == "longrope" and positions.numel():
        # the factor set by the length, chosen with tensor ops (an exported graph keeps the choice, not its result)
        old_len = scaling.get("original_max_position_embeddings", rope.max_positions)
        short, attention = inv_freq(rope, None)
        long, _ = inv_freq(rope, old_len + 1)
        inv = torch.where(positions.max() + 1 > old_len, long.to(positions.device), short.to(positions.device))
    else:
        seq_len = int(positions.max()) + 1 if by_length(rope) and positions.numel() else None
        inv, attention = inv_freq(rope, seq_len)
    angles = positions[:, None].float() * inv[None, :].to(positions.device)     # [S, r/2]
    if rope.style == "half":
        angles = torch.cat((angles, angles), dim=-1)                             # [S, r]
    else:
        angles = angles.repeat_interleave(2, dim=-1)                             # [S, r]
    return angles.cos() * attention, angles.sin() * attention


def _turn(a: torch.Tensor, b: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the 2-vectors (a, b) by the angle whose cos and sin are given."""
    return a * cos - b * sin, b * cos + a * sin


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x [B, H, S, Dh] by cos/sin [S, r]; the rest pass through.

    The rotation runs in x's dtype with cos/sin cast to it first, as transformers does (so a bf16 model rotates
    in bf16), unless the rope's ``compute_dtype`` is "float32". x may also be just the rotated part (MLA's
    q_rot / k_rot, Dh = r). The result keeps x's layout: an interleaved pair stays in dims (2j, 2j+1).
    """
    r = rope.rotary_dim
    dtype = torch.float32 if rope.compute_dtype == "float32" else x.dtype
    rot, rest = x[..., :r].to(dtype), x[..., r:]                                 # [B, H, S, r], [B, H, S, Dh-r]
    cos, sin = cos.to(dtype), sin.to(dtype)
    if rope.style == "half":
        half = r // 2
        a, b = _turn(rot[..., :half], rot[..., half:], cos[:, :half], sin[:, :half])   # [B, H, S, r/2] each
        rot = torch.cat((a, b), dim=-1)
    else:
        a, b = _turn(rot[..., 0::2], rot[..., 1::2], cos[:, 0::2], sin[:, 0::2])       # [B, H, S, r/2] each
        rot = torch.stack((a, b), dim=-1).flatten(-2)                                   # pairs back in place
    return torch.cat((rot.to(x.dtype), rest), dim=-1)
