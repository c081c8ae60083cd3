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

``CachePolicy()`` (parity.neutral.model) is what a correct cache does. A decode bug of the catalog
(parity.diagnosis.bugs) changes one entry, through the manifest's ``kv_cache``, so the executor runs the mistake an
engine's cache would make; the code below has no special case for any bug. Each one touches only what the cache
hands back, so the prompt, which reads nothing from the cache, is computed right.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parity.neutral.model import CachePolicy


class KVCache:
    """Keys and values per layer slot, [B, K, T, Dh] each, and the number of tokens seen."""

    def __init__(self, num_layers: int, policy: CachePolicy | None = None, evict: bool = True):
        self.policy = policy or CachePolicy()
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
        if self.policy.position_offset and self.decoding:
            positions = positions + self.policy.position_offset
        return positions

    def extend(self, i: int, k: Tensor, v: Tensor, window: int | None) -> tuple[Tensor, Tensor]:
        """Layer i's keys and values to attend to (its slot's, then this call's ``k``, ``v``); the slot then keeps
        what later calls need."""
        past = self.slots.get(i)
        keys = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        if self.policy.kv_head_order == "reversed":
            k, v = k.flip(1), v.flip(1)
        slot = (i + self.policy.layer_shift) % self.num_layers
        kept = self.slots.get(slot)
        if kept is not None:
            k, v = torch.cat([kept[0], k], dim=2), torch.cat([kept[1], v], dim=2)
        if window and self.evict:  # the ring: the next token and the window - 1 before it
            start = max(0, k.shape[2] - (window + self.policy.window_slack - 1))
            k, v = k[:, :, start:], v[:, :, start:]
        self.slots[slot] = (k, v)
        return keys

    def advance(self, s: int) -> None:
        """The forward of ``s`` tokens is done."""
        self.length += s
