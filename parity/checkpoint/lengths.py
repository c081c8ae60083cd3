"""Prompt lengths: which conventions change the computation with the prompt's length, the default prompt that
crosses them, and what a given prompt exercises.

The conventions that act past a length: a sliding window (positions further apart than the window stop
attending to each other), chunked attention and attention temperature tuning (Llama 4), and a RoPE scaling
whose frequencies depend on the sequence length (``dynamic`` NTK past max_position_embeddings, ``longrope``'s
long factors past original_max_position_embeddings). Other scalings (``linear``, ``llama3``, ``yarn``, ...)
rescale the frequencies the same way at every length: a prompt of any length exercises them, and their
``original_max_position_embeddings`` is no threshold.
"""

from __future__ import annotations

from parity.checkpoint import Checkpoint
from parity.rope import LENGTH_DEPENDENT

MIN_LENGTH = 64   # the default prompt's floor: long enough for a meaningful rel_l2 per point
PAST = 16         # how far past a threshold the default prompt goes


def thresholds(ckpt: Checkpoint) -> dict[str, int]:
    """Length-dependent conventions and the prompt length past which each acts: label -> length."""
    r = ckpt.resolved
    out: dict[str, int] = {}
    for i in range(r.num_layers):
        if window := r.layer("attention.sliding_window", i):
            out[f"sliding window {window}"] = window
        if chunk := r.layer("attention.chunk_size", i):  # Llama 4: attention stops at the chunk's edge
            out[f"attention chunk {chunk}"] = chunk
        if floor := r.layer("attention.temperature_floor", i):  # Llama 4: the queries' scale first grows there
            out[f"attention temperature floor {floor}"] = floor
        if r["positions.kind"] == "rope":
            scaling = r.layer("positions.rope_scaling", i) or {}
            kind = scaling.get("rope_type")
            if kind in LENGTH_DEPENDENT:  # where parity.rope switches, as transformers does
                threshold = (r["positions.max_positions"] if kind == "dynamic" else
                             scaling.get("original_max_position_embeddings") or r["positions.max_positions"])
                if threshold:
                    out[f"rope {kind} scaling threshold {threshold}"] = threshold
    return out


def length_independent(ckpt: Checkpoint) -> list[str]:
    """The RoPE scalings that every prompt exercises, labelled as ``exercised`` reports them."""
    r = ckpt.resolved
    if r["positions.kind"] != "rope":
        return []
    kinds = {(r.layer("positions.rope_scaling", i) or {}).get("rope_type") for i in range(r.num_layers)}
    return [f"rope {kind} scaling" for kind in sorted(k for k in kinds if k and k != "default"
                                                      and k not in LENGTH_DEPENDENT)]


def default_length(ckpt: Checkpoint) -> int:
    """Long enough to cross every sliding window and length-dependent RoPE threshold (by PAST), at least
    MIN_LENGTH, and no longer than the model's positions."""
    length = max([MIN_LENGTH] + [t + PAST for t in thresholds(ckpt).values()])
    limit = ckpt.resolved["positions.max_positions"]
    return min(length, limit) if limit else length


def exercised(ckpt: Checkpoint, n: int) -> tuple[dict[str, bool], list[str]]:
    """Which length-dependent conventions a prompt of n tokens reaches (length-independent scalings always), and
    a warning for each one it does not."""
    seen: dict[str, bool] = {label: True for label in length_independent(ckpt)}
    warnings: list[str] = []
    for label, length in thresholds(ckpt).items():
        seen[label] = n > length
        if n > length:
            continue
        if label.startswith("sliding window"):
            warnings.append(f"the prompt ({n} tokens) is not longer than the sliding window ({length}): "
                            f"window handling is not exercised; use --length {length + PAST}")
        else:
            warnings.append(f"the prompt ({n} tokens) does not pass the {label.rsplit(' threshold', 1)[0]} "
                            f"threshold ({length}): its long-context frequencies are not exercised; "
                            f"use --length {length + PAST}")
    return seen, warnings
