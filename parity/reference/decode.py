"""``parity check --decode N``: the KV-cache path, checked step by step (the reference's side of it; the check
itself is parity.checker.decoding).

A prefill check runs the whole prompt in one forward, and passes every bug that lives only in a cache: decode
positions that restart or shift, a sliding-window ring that wraps a slot early, keys written to another layer's
slot or in another head order, a decode kernel without the prefill's attention softcap. Here the candidate runs
the prompt, then N single-token steps with its own cache. The tokens it is fed are the reference's greedy
continuation (teacher forcing: one early difference does not change every later input). Step k feeds token k-1
of the continuation at position S + k - 1 (S: the prompt's length), and each of its capture points is compared
with the reference's forward over the whole sequence at that position: transformers without a cache, where no
cache can be wrong.

The prompt and N are chosen so that decoding crosses what acts with length: each sliding window (the cache must
wrap during decode, so the prompt stays shorter than the smallest window) and each length-dependent RoPE
threshold; the report says which were crossed, in the prefill, during decode, or not at all.
"""

from __future__ import annotations

import torch

from parity.checkpoint import Checkpoint
from parity.checkpoint.lengths import MIN_LENGTH, thresholds
from parity.errors import ParityError
from parity.reference.models import Models, cached_forward, first_device, hf_runner
from parity.rope import LENGTH_DEPENDENT

# the prompt's floor when decoding: enough positions for the prefill to mean something
MIN_PROMPT = 4


def decodes(ckpt: Checkpoint) -> bool:
    """A causal language model: it has an LM head and decode steps."""
    r = ckpt.resolved
    return "logits" in {c.name for c in r.capture} and all(r.layer("attention.causal", i) for i in range(r.num_layers))


def prompt_length(ckpt: Checkpoint, n: int) -> int:
    """A prompt for ``n`` decode steps: shorter than the smallest length threshold (a sliding window, a RoPE
    scaling threshold) by about half the steps, so decoding crosses it, and as many of the others as n reaches;
    MIN_LENGTH tokens for a model without any."""
    found = thresholds(ckpt)
    if not found:
        return MIN_LENGTH
    smallest = min(found.values())
    return max(1, min(smallest, max(MIN_PROMPT, smallest - n // 2)))


def crossings(ckpt: Checkpoint, s: int, n: int) -> list[dict]:
    """Each length threshold and where a prompt of ``s`` tokens followed by ``n`` decode steps crosses it:
    "prefill" (the prompt is already past it), "decode" (a decode step is the first past it: a window's ring
    wraps during decode), or None (never reached)."""
    out = [{"what": "prefill/decode boundary", "at": s, "crossed": "decode" if n else None}]
    for label, length in sorted(thresholds(ckpt).items(), key=lambda item: item[1]):
        where = "prefill" if s > length else "decode" if s + n > length else None
        out.append({"what": label, "at": length, "crossed": where})
    return out


def uncached_steps(models: Models, ckpt: Checkpoint, ids: torch.Tensor, tokens: list[int],
                   points: set[str], arithmetic=None) -> dict[str, torch.Tensor]:
    """The reference's truth for each decode step: one forward over the prompt and the tokens, without a cache;
    point -> [1, N, width], step k at index k - 1 (position S + k - 1). ``arithmetic``: as for hf_runner."""
    full = torch.cat([ids, torch.tensor([tokens])], dim=1)
    # RoPE whose frequencies follow the length (LongRoPE, dynamic): one forward over the whole sequence would
    # rotate the early steps with the final length's table, so each step gets the forward over its own prefix
    ends = [ids.shape[1] + k for k in range(1, len(tokens) + 1)] if by_length(ckpt) else [full.shape[1]]
    steps: dict[str, list[torch.Tensor]] = {}
    for end in ends:
        captured: dict[str, torch.Tensor] = {}
        run = hf_runner(models, ckpt, torch.float32, full[:, :end], points=points, arithmetic=arithmetic)
        run(lambda name, t: captured.setdefault(name, t))
        missing = sorted(points - set(captured))
        if missing:
            raise ParityError(f"{ckpt.path}: the reference never produced {', '.join(missing)}; fix the adapter's "
                              f"capture map")
        for name, t in captured.items():
            steps.setdefault(name, []).append(t[:, max(ids.shape[1], end - 1) if len(ends) > 1 else ids.shape[1]:])
    return {name: torch.cat(parts, dim=1) for name, parts in steps.items()}


def by_length(ckpt: Checkpoint) -> bool:
    """Whether a layer's RoPE frequencies depend on the sequence's length."""
    r = ckpt.resolved
    return r["positions.kind"] == "rope" and any(
        (r.layer("positions.rope_scaling", i) or {}).get("rope_type") in LENGTH_DEPENDENT for i in range(r.num_layers))


def greedy(models: Models, ckpt: Checkpoint, ids: torch.Tensor, n: int) -> list[int]:
    """The reference's greedy continuation (n tokens), decoded with transformers' cache: only the tokens are
    used, as the inputs both sides are fed."""
    model = models.hf(ckpt, torch.float32)
    tokens: list[int] = []
    with torch.no_grad():
        device = first_device(model, models.device["reference"])
        out, cache = cached_forward(model, ids.to(device))
        while True:
            tokens.append(int(out.logits[0, -1].float().argmax()))
            if len(tokens) == n:
                return tokens
            out, cache = cached_forward(model, torch.tensor([[tokens[-1]]], device=device), cache)
