"""The executor's KV cache: what an engine keeps between decode steps, written as plainly as it can be.

This is the reference an engine author reads for cache semantics. A decode step runs one new token at the
position after everything the model has seen (``length``). Each layer computes the new token's key and value
(after RoPE, after k/v norms), appends them to its slot, and its query attends to every key the slot holds:
no mask is needed, since a slot only ever holds the past and the present. A sliding-window layer's slot is a
ring of ``window`` entries: the key ``window`` positions back is evicted as the new one comes in, so the new
token sees itself and the ``window - 1`` tokens before it, exactly what the prefill's mask allows
(key j visible from i when i - j < window). A layer that reuses another layer's keys and values (Gemma 4's
KV sharing) reads that layer's slot. Keys are cached rotated: they are never rotated again.

The prefill runs the prompt with its mask as a plain forward does, then stores each layer's keys and values
(the last ``window`` of them for a sliding-window layer).

``POLICY`` is what a correct cache does. A decode bug of the catalog (parity.bugs) changes one entry, through
the manifest's ``kv_cache`` section, so the executor runs the mistake an engine's cache would make; the code
below has no special case for any bug.
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
}


class KVCache:
    """Keys and values per layer slot, [B, K, T, Dh] each, and the number of tokens seen."""

    def __init__(self, num_layers: int, policy: dict | None = None):
        unknown = set(policy or {}) - set(POLICY)
        if unknown:
            raise ValueError(f"unknown kv_cache policy keys {sorted(unknown)}; known: {sorted(POLICY)}")
        self.policy = {**POLICY, **(policy or {})}
        self.num_layers = num_layers
        self.slots: dict[int, tuple[Tensor, Tensor]] = {}
        self.length = 0

    @property
    def decoding(self) -> bool:
        """Whether a forward now is a decode step (the prompt has been seen), not the prefill."""
        return self.length > 0

    def positions(self, s: int, device) -> Tensor:
        """The positions of the next ``s`` tokens."""
        offset = self.policy["position_offset"] if self.decoding else 0
        return torch.arange(self.length, self.length + s, device=device) + offset

    def store(self, i: int, k: Tensor, v: Tensor, window: int | None) -> None:
        """Append layer i's new keys and values; a sliding-window layer keeps only its ring's entries."""
        if self.policy["kv_head_order"] == "reversed":
            k, v = k.flip(1), v.flip(1)
        slot = (i + self.policy["layer_shift"]) % self.num_layers
        if slot in self.slots:
            old_k, old_v = self.slots[slot]
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        if window:
            keep = max(1, window + self.policy["window_slack"])
            k, v = k[:, :, -keep:], v[:, :, -keep:]
        self.slots[slot] = (k, v)

    def attend(self, i: int, k: Tensor, v: Tensor, window: int | None) -> tuple[Tensor, Tensor]:
        """A decode step of layer i: store the new token's key and value, and return what layer i attends to."""
        self.store(i, k, v, window)
        # a slot no layer writes (only under a shifted layer map, with KV-sharing layers): just this step's key
        return self.slots.get(i, (k, v))

    def advance(self, s: int) -> None:
        """The forward of ``s`` tokens is done."""
        self.length += s
