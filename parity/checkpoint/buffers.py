"""Saved buffers: tensors some checkpoints carry beside the weights (RoPE inv_freq, position ids, causal masks,
a tied head saved anyway), each checked against what the config says it must hold.

A saved buffer is never converted: transformers rebuilds it from the config. But a port may read it, and a buffer
that disagrees with the config (an inv_freq of another rope_theta) is a mistake the port inherits.
"""

from __future__ import annotations

import torch

from parity.adapter import Resolved, ResolvedBuffer
from parity.neutral.declared import Source, fill
from parity.checkpoint import Checkpoint, TensorCheck
from parity.neutral.model import Rope
from parity.rope import inv_freq
from parity.storage.lazy import TensorFiles

# How far a saved inv_freq may sit from the one the config implies: float32 buffers were computed as parity
# computes them (a few ulps apart); 16-bit ones were rounded once (bf16 keeps 8 bits: 2 ** -8 relative).
INV_FREQ_TOLERANCE = {"F32": 1e-4, "F64": 1e-4}
INV_FREQ_TOLERANCE_16BIT = 1e-2


def _inv_freq_verdict(r: Resolved, buffer: ResolvedBuffer, saved, dtype: str) -> tuple[bool, str]:
    """Whether a saved RoPE inv_freq agrees with the RoPE the config gives its layer (any layer, for a
    model-level buffer), and what it says otherwise."""
    layers = [buffer.layer] if buffer.layer is not None else range(r.num_layers)
    ropes = [rope for rope in (fill(Rope, Source(r, i, {"rope_style": "half"})) for i in layers)
             if rope is not None]
    saved = saved.double().flatten()
    tolerance = INV_FREQ_TOLERANCE.get(dtype, INV_FREQ_TOLERANCE_16BIT)
    closest: tuple[float, Rope] | None = None
    for rope in ropes:
        for scaled in (True, False):  # buffers saved before rope_scaling existed hold the unscaled frequencies
            want, _ = inv_freq(rope if scaled else rope.model_copy(update={"scaling": None}))
            if want.numel() != saved.numel():
                continue
            error = float(((saved - want.double()).abs() / want.double().abs().clamp_min(1e-30)).max())
            if error <= tolerance:
                how = "" if scaled or not rope.scaling else " (unscaled: rope_scaling is applied on top)"
                return True, f"agrees with rope_theta {rope.theta:g}{how}"
            if closest is None or error < closest[0]:
                closest = (error, rope)
    if not ropes:
        return False, "the config gives this model no RoPE"
    if closest is None:
        dims = sorted({rope.rotary_dim // 2 for rope in ropes})
        return False, (f"holds {saved.numel()} frequencies; the config implies {' or '.join(map(str, dims))} "
                       f"(rotary_dim / 2): a head_dim or partial_rotary_factor mismatch")
    error, rope = closest
    implied = ""
    if saved.numel() > 1 and float(saved[1]) > 0:  # inv_freq[1] = theta ** (-2 / rotary_dim)
        implied = f"implies rope_theta ~ {float(saved[1]) ** (-rope.rotary_dim / 2):.6g}, "
    return False, (f"disagrees with the config: {implied}config rope_theta {rope.theta:g}"
                   f"{', scaling ' + str(rope.scaling.get('rope_type')) if rope.scaling else ''} "
                   f"(max relative difference {error:.3g}); a port that reads this buffer computes other positions")


def _buffer_verdict(r: Resolved, buffer: ResolvedBuffer, x, dtype: str) -> tuple[bool, str]:
    if buffer.kind == "rope_inv_freq":
        return _inv_freq_verdict(r, buffer, x, dtype)
    if buffer.kind == "position_ids":
        flat = x.flatten().long()
        if not torch.equal(flat, torch.arange(flat.numel())):
            k = int((flat != torch.arange(flat.numel())).nonzero()[0])
            return False, f"not 0, 1, 2, ...: position {k} holds {int(flat[k])}"
        n = r["positions.max_positions"]
        if n is not None and flat.numel() != n:
            return False, f"{flat.numel()} positions; the config's max_position_embeddings is {n}"
        return True, f"0..{flat.numel() - 1}"
    if buffer.kind == "token_type_ids":
        return (True, "zeros") if not x.any() else (False, "not all zeros")
    if buffer.kind == "causal_mask":
        square = x.reshape(-1, *x.shape[-2:])[0].bool() if x.dim() >= 2 else None
        if square is None or square.shape[0] != square.shape[1]:
            return False, f"shape {list(x.shape)} is not a square mask"
        if not torch.equal(square, torch.ones_like(square).tril()):
            return False, "not lower-triangular: attention would see later tokens, or miss earlier ones"
        n = r["positions.max_positions"]
        if n is not None and square.shape[0] != n:
            return False, f"{square.shape[0]} positions; the config's n_positions is {n}"
        return True, f"lower-triangular, {square.shape[0]} positions"
    return True, f"{float(x.float().flatten()[0]):g}" if x.numel() else "empty"  # mask_value: informative only


def _tied_copy_verdict(x: torch.Tensor, same: torch.Tensor, same_name: str) -> tuple[bool, str]:
    if tuple(x.shape) == tuple(same.shape) and torch.equal(x.float(), same.float()):
        return True, f"the same values as {same_name}: tied, as the config says"
    diff = f"max difference {float((x.float() - same.float()).abs().max()):.3g}" if x.shape == same.shape \
        else f"shape {list(x.shape)} vs {list(same.shape)}"
    return False, (f"differs from {same_name} ({diff}), yet the config ties them: transformers unties the head and "
                   f"uses this tensor; set tie_word_embeddings to false in config.json")


def check_buffers(ckpt: Checkpoint, check: TensorCheck) -> list[dict]:
    """Every saved buffer the checkpoint holds: what it is, and whether it agrees with the config."""
    buffers = ckpt.resolved.buffer_map(check.prefix)
    files = TensorFiles({name: info.file for name, info in ckpt.tensors.items()})
    out = []
    for name in check.buffers:
        info = ckpt.tensors[name]
        buffer = buffers[ckpt.resolved.canonical_name(name)]
        if buffer.kind == "tied_copy":
            same = check.stored.get(buffer.same_as.replace("{prefix}", check.prefix))
            agrees, note = _tied_copy_verdict(files.read(name), files.read(same), same) \
                if same in files else (False, f"{buffer.same_as} is not in the checkpoint")
        else:
            agrees, note = _buffer_verdict(ckpt.resolved, buffer, files.read(name), info.dtype)
        out.append({"name": name, "kind": buffer.kind, "shape": list(info.shape), "dtype": info.dtype,
                    "agrees": agrees, "note": note})
    return out
