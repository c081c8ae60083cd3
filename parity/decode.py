"""``parity check --decode N``: the KV-cache path, checked step by step.

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

from dataclasses import dataclass, field
from typing import Callable

import torch

from .checkpoint import Checkpoint
from .compare import Tolerances, judge, logit_metrics, metrics
from .errors import ParityError
from .inputs import check_length
from .lengths import MIN_LENGTH, thresholds
from .models import Models, _first_device, cached_forward, hf_runner
from .report import PointResult

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
                   points: set[str]) -> dict[str, torch.Tensor]:
    """The reference's truth for each decode step: one forward over the prompt and the tokens, without a cache;
    point -> [1, N, width], step k at index k - 1 (position S + k - 1)."""
    full = torch.cat([ids, torch.tensor([tokens])], dim=1)
    captured: dict[str, torch.Tensor] = {}
    hf_runner(models, ckpt, torch.float32, full, points=points)(lambda name, t: captured.setdefault(name, t))
    missing = sorted(points - set(captured))
    if missing:
        raise ParityError(f"{ckpt.path}: the reference never produced {', '.join(missing)}; fix the adapter's "
                          f"capture map")
    return {name: t[:, ids.shape[1]:] for name, t in captured.items()}


def greedy(models: Models, ckpt: Checkpoint, ids: torch.Tensor, n: int) -> list[int]:
    """The reference's greedy continuation (n tokens), decoded with transformers' cache: only the tokens are
    used, as the inputs both sides are fed."""
    model = models.hf(ckpt, torch.float32)
    tokens: list[int] = []
    with torch.no_grad():
        device = _first_device(model, models.device["reference"])
        out, cache = cached_forward(model, ids.to(device))
        while True:
            tokens.append(int(out.logits[0, -1].float().argmax()))
            if len(tokens) == n:
                return tokens
            out, cache = cached_forward(model, torch.tensor([[tokens[-1]]], device=device), cache)


@dataclass
class Decoded:
    """A decode comparison: each step's point results, the report's ``decode`` section, and what a diagnosis
    needs at the first failing step."""

    points: list[PointResult] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)


def reference_steps(models: Models, truth, ids: torch.Tensor, n: int, wanted: list[str],
                    progress: Callable[[str], None] | None = None) -> tuple[list[int], dict, dict]:
    """What the reference (``truth``, parity.references) gives a decode check: the n tokens to feed, each wanted
    point at every step [1, n, width], and their storage rounding. Computed before the candidate is loaded, so
    that the reference model can be dropped first: the steps are small, the models are not."""
    check_length(truth.checkpoint, ids.shape[1] + n)
    if progress:
        progress(f"decoding {n} tokens with the reference")
    return truth.decode_reference(models, 0, ids, n, set(wanted))


def compare(models: Models, truth, stepped: tuple[list[int], dict, dict], make_decoder: Callable, candidate,
            ids: torch.Tensor, n: int, dtype: torch.dtype, tolerances: Tolerances, wanted: list[str],
            progress: Callable[[str], None] | None = None) -> Decoded:
    """Run the candidate's prompt and ``n`` decode steps (``make_decoder``: its kind's) and compare every step's
    ``wanted`` points with the reference's (``stepped``: from ``reference_steps``) at the step's position."""
    say = progress or (lambda message: None)
    ckpt = truth.checkpoint
    s = ids.shape[1]
    tokens, reference, rounding = stepped
    wanted = [p for p in wanted if p in reference]

    out = Decoded()
    steps: dict[int, dict] = {}
    order = {name: k for k, name in enumerate(wanted)}

    def on_point(step: int, name: str, got: torch.Tensor) -> None:
        if step < 1 or name not in order:  # the prefill is the prefill check's
            return
        if not 1 <= step <= n:
            raise ParityError(f"the {make_decoder.__module__} decoder emitted step {step}; expected 1..{n}")
        ref = reference[name][:, step - 1:step]
        got = got[:, -1:]
        if ref.device != got.device:
            ref = ref.to(got.device)
        noise = rounding.get(name, 0.0)  # a golden's storage rounding is this comparison's noise
        result = judge(name, metrics(got, ref), tolerances.for_point(name, None, noise), noise or None)
        result.step = step
        out.points.append(result)
        entry = steps.setdefault(step, {"step": step, "position": s + step - 1, "token": tokens[step - 1],
                                        "passed": True, "worst": None, "worst_rel_l2": 0.0})
        if result.rel_l2 > entry["worst_rel_l2"] or not result.passed and entry["passed"]:
            entry["worst"], entry["worst_rel_l2"] = name, result.rel_l2
        entry["passed"] &= result.passed
        if name == "logits":
            lm = logit_metrics(got, ref)
            entry.update(kl=None if lm is None else lm["kl_mean"], top1=None if lm is None else lm["top1_agreement"])
            if out.kept.get("step", step) == step:  # only the failing step's logits are kept (or the latest)
                out.kept["logits"] = {step: (got.detach().cpu(), ref.detach().cpu())}
        if not result.passed and "step" not in out.kept:
            out.kept.update(step=step, point=name, candidate=got.detach().cpu(), reference=ref.detach().cpu(),
                            tolerance=result.tolerance.rel_l2)

    say(f"decoding {n} tokens with the candidate, its own cache")
    make_decoder(models, candidate, dtype, ids, tokens, ckpt)(on_point)
    produced = {(p.step, p.name) for p in out.points}
    for step in range(1, n + 1):
        for name in wanted:
            if (step, name) not in produced:
                out.points.append(PointResult(name=name, max_abs=float("nan"), mean_abs=float("nan"),
                                              rel_l2=float("nan"), cosine=float("nan"),
                                              tolerance=tolerances.for_point(name), passed=False, compared=False,
                                              step=step))
    out.points.sort(key=lambda p: (p.step, order[p.name]))
    failing = [p for p in out.points if p.compared and not p.passed]
    per_step = [steps[k] for k in sorted(steps)]
    out.summary = {
        "steps": n, "prompt_length": s, "tokens": tokens, "crossed": crossings(ckpt, s, n),
        "per_step": per_step,
        "first_divergence": None if not failing else {"step": failing[0].step, "point": failing[0].name,
                                                      "position": s + failing[0].step - 1,
                                                      "rel_l2": failing[0].rel_l2},
        "kl_max": max((e["kl"] for e in per_step if e.get("kl") is not None), default=None),
        "top1_agreement": (sum(e["top1"] for e in per_step if e.get("top1") is not None) /
                           max(1, sum(e.get("top1") is not None for e in per_step))) if per_step else None,
    }
    return out
