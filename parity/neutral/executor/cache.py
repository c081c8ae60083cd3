"""The executor's KV cache: what an engine keeps between decode steps, written as plainly as it can be.

This is the reference an engine author reads for cache semantics. Every forward with a cache (the prompt, then
each decode step of one token) runs at the positions after everything the model has seen (``length``). Each
layer computes this call's keys and values (after RoPE, after k/v norms) and attends to the keys its slot holds
followed by this call's, masked by absolute position as the prefill is (causal; a sliding window of W lets
position i see keys i - W + 1 .. i). Keys are cached rotated: they are never rotated again. A layer that reuses
another layer's keys and values (Gemma 4's KV sharing) attends to that layer's.

Then the slot keeps what later calls need. A sliding-window layer's slot is a ring: it keeps the last W - 1
keys, so that the next token sees itself and the W - 1 before it, and no slot ever grows past the window (an
engine's ring of W entries, written before it is read). Other slots keep every key. ``evict=False`` keeps every
key everywhere and lets the mask do the windowing, as an exported ONNX graph does (its present.* outputs grow);
both attend to exactly the same keys.

``POLICY`` is what a correct cache does. A decode bug of the catalog (parity.diagnosis.bugs) changes one entry, through
the manifest's ``kv_cache`` section, so the executor runs the mistake an engine's cache would make; the code
below has no special case for any bug. Each one touches only what the cache hands back, so the prompt, which
reads nothing from the cache, is computed right.
"""

from __future__ import annotations

import torch
from torch import Tensor

POLICY = {
    "position_offset": 0,     # added to each decode step's position (a port that counts the new token twice: 1)
    "window_slack": 0,        # a sliding-window ring holds window + slack entries (-1: wraps one slot early)
    "layer_shift": 0,         # layer i writes its keys to slot (i + shift) mod layers; it always reads slot i
    "decode_softcap": True,   # the attention softcap applied in decode steps, as the prefill applies it
    "kv_head_order": "kept",  # "reversed": kv heads written in reverse order, so each GQA group reads another's
    # a decode step whose length changes the RoPE tables (LongRoPE past its original length) computes the prefix
    # again, as transformers' Phi-3 does; False: the cached keys stay rotated with the old tables
    "refill_on_rope_change": True,
}


class KVCache:
    """Keys and values per layer slot, [B, K, T, Dh] each, and the number of tokens seen."""

    def __init__(self, num_layers: int, policy: dict | None = None, evict: bool = True):
        unknown = set(policy or {}) - set(POLICY)
        if unknown:
            raise ValueError(f"unknown kv_cache policy keys {sorted(unknown)}; known: {sorted(POLICY)}")
        self.policy = {**POLICY, **(policy or {})}
        self.num_layers, self.evict = num_layers, evict
        self.slots: dict[int, tuple[Tensor, Tensor]] = {}
        self.length = 0
        # where RoPE follows the length: the ids seen and the tables the cached keys were rotated with
        self.ids: Tensor | None = None
        self.tables: list[Tensor] | None = None

    def reset(self) -> None:
        """Forget everything seen (a prefix run again from its start)."""
        self.slots, self.length, self.ids, self.tables = {}, 0, None, None

    @property
    def decoding(self) -> bool:
        """Whether a forward now is a decode step (the prompt has been seen), not the prefill."""
        return self.length > 0

    def positions(self, s: int, device) -> Tensor:
        """The positions of the next ``s`` tokens."""
        positions = torch.arange(self.length, self.length + s, device=device)
        if self.policy["position_offset"] and self.decoding:
            positions = positions + self.policy["position_offset"]
        return positions

    def extend(self, i: int, k: Tensor, v: Tensor, window: int | None) -> tuple[Tensor, Tensor]:
        """Layer i's keys and values to attend to (its slot's, then this call's ``k``, ``v``); the slot then keeps
        what later calls need."""
        past = self.slots.get(i)
        keys = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        if self.policy["kv_head_order"] == "reversed":
            k, v = k.flip(1), v.flip(1)
        slot = (i + self.policy["layer_shift"]) % self.num_layers
        kept = self.slots.get(slot)
        if kept is not None:
            k, v = torch.cat([kept[0], k], dim=2), torch.cat([kept[1], v], dim=2)
        if window and self.evict:  # the ring: the next token and the window - 1 before it
            start = max(0, k.shape[2] - (window + self.policy["window_slack"] - 1))
            k, v = k[:, :, start:], v[:, :, start:]
        self.slots[slot] = (k, v)
        return keys

    def advance(self, s: int) -> None:
        """The forward of ``s`` tokens is done."""
        self.length += s
