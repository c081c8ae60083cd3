"""``--decode N`` as a check (parity.reference.decode explains the choice of prompt and what is crossed): the
reference's steps are computed first, so that the reference can be dropped before the candidate loads (the steps are
small, the models are not); then the candidate runs the prompt and N single-token steps with its own cache, fed the
reference's continuation, and each step's points are judged against the reference's at that position."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import torch

from parity.checker.judge import Judge
from parity.checker.noise import Rounding
from parity.checker.plan import Plan
from parity.checkpoint.inputs import check_length
from parity.compare import logit_metrics
from parity.errors import ParityError
from parity.reference.decode import crossings
from parity.reference.models import Models
from parity.report import PointResult


@dataclass
class ReferenceSteps:
    tokens: list[int]                                   # the continuation both sides are fed
    points: dict[tuple[int, str], torch.Tensor]         # (step, point) -> [1, 1, width]
    noise: Rounding                                     # a golden's storage rounding per point


@dataclass
class Step:
    """One decode step's verdict: its worst point, and at the logits how far the next-token distributions are."""

    step: int
    position: int
    token: int                    # the token fed at this step
    passed: bool = True
    worst: str | None = None
    worst_rel_l2: float = 0.0
    logits_compared: bool = False
    kl: float | None = None       # None with the logits compared: they could not be (parity.compare.logit_metrics)
    top1: float | None = None

    def to_json(self) -> dict:
        out = {"step": self.step, "position": self.position, "token": self.token, "passed": self.passed,
               "worst": self.worst, "worst_rel_l2": self.worst_rel_l2}
        return {**out, "kl": self.kl, "top1": self.top1} if self.logits_compared else out


@dataclass(frozen=True)
class DecodeSummary:
    """The report's ``decode`` section."""

    steps: int
    prompt_length: int
    tokens: list[int]
    crossed: list[dict]                 # parity.reference.decode.crossings
    per_step: list[Step]
    first_divergence: dict | None       # {"step", "point", "position", "rel_l2"}
    kl_max: float | None
    top1_agreement: float | None

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "per_step": [s.to_json() for s in self.per_step]}


@dataclass
class Decoded:
    """A decode comparison: each step's point results, the report's ``decode`` section, and what a diagnosis
    needs at the first failing step."""

    points: list[PointResult] = field(default_factory=list)
    summary: DecodeSummary | None = None
    kept: dict = field(default_factory=dict)


def reference_steps(plan: Plan, models: Models, ids: torch.Tensor, say: Callable[[str], None]) -> ReferenceSteps:
    """What the reference gives a decode check of its first input: the n tokens to feed and each wanted point at
    every step."""
    n, truth = plan.decode, plan.reference
    check_length(truth.checkpoint, ids.shape[1] + n)
    say(f"decoding {n} tokens with the reference")
    tokens = truth.continuation(models, 0, ids, n)
    held: dict[tuple[int, str], torch.Tensor] = {}
    truth.decode(models, 0, ids, tokens, set(plan.step_points()))(lambda step, name, t: held.__setitem__((step, name), t))
    return ReferenceSteps(tokens, held, Rounding(truth.step_rounding(0, n)))


class _Steps:
    """The candidate's decode steps, judged as they come."""

    def __init__(self, plan: Plan, reference: ReferenceSteps, s: int, wanted: list[str]):
        self.plan, self.reference, self.s, self.n = plan, reference, s, plan.decode
        self.order = {name: k for k, name in enumerate(wanted)}
        self.judge = Judge(plan.tolerances)
        self.out = Decoded()
        self.steps: dict[int, Step] = {}

    def __call__(self, step: int, name: str, got: torch.Tensor) -> None:
        if step < 1 or name not in self.order:  # the prefill is the prefill check's
            return
        if not 1 <= step <= self.n:
            raise ParityError(f"the {self.plan.kind.name} candidate's decoder emitted step {step}; expected "
                              f"1..{self.n}")
        ref, got = self.reference.points[(step, name)], got[:, -1:]
        result = self.judge(name, got, ref, *self.reference.noise.of(0, name, ref), step=step)
        self.out.points.append(result)
        entry = self.steps.setdefault(step, Step(step, self.s + step - 1, self.reference.tokens[step - 1]))
        if result.rel_l2 > entry.worst_rel_l2 or not result.passed and entry.passed:
            entry.worst, entry.worst_rel_l2 = name, result.rel_l2
        entry.passed &= result.passed
        kept = self.out.kept
        if name == "logits":
            lm = logit_metrics(got, ref.to(got.device))
            entry.logits_compared = True
            entry.kl, entry.top1 = (None, None) if lm is None else (lm["kl_mean"], lm["top1_agreement"])
            if kept.get("step", step) == step:  # only the failing step's logits are kept (or the latest)
                kept["logits"] = {step: (got.detach().cpu(), ref.detach().cpu())}
        if not result.passed and "step" not in kept:
            kept.update(step=step, point=name, candidate=got.detach().cpu(), reference=ref.detach().cpu(),
                        tolerance=result.tolerance.rel_l2)

    def summary(self) -> DecodeSummary:
        failing = [p for p in self.out.points if p.compared and not p.passed]
        per_step = [self.steps[k] for k in sorted(self.steps)]
        top1 = [e.top1 for e in per_step if e.top1 is not None]
        return DecodeSummary(
            steps=self.n, prompt_length=self.s, tokens=self.reference.tokens,
            crossed=crossings(self.plan.checkpoint, self.s, self.n), per_step=per_step,
            first_divergence=None if not failing else {"step": failing[0].step, "point": failing[0].name,
                                                       "position": self.s + failing[0].step - 1,
                                                       "rel_l2": failing[0].rel_l2},
            kl_max=max((e.kl for e in per_step if e.kl is not None), default=None),
            top1_agreement=(sum(top1) / max(1, len(top1))) if per_step else None,
        )


def compare_steps(plan: Plan, models: Models, reference: ReferenceSteps, ids: torch.Tensor,
                  say: Callable[[str], None]) -> Decoded:
    """Run the candidate's prompt and decode steps and judge every step's points against ``reference``'s."""
    held = {name for _, name in reference.points}
    wanted = [p for p in plan.step_points() if p in held]
    steps = _Steps(plan, reference, ids.shape[1], wanted)
    say(f"decoding {plan.decode} tokens with the candidate, its own cache")
    plan.candidate.decode(models, 0, ids, reference.tokens, set(wanted))(steps)
    out = steps.out
    produced = {(p.step, p.name) for p in out.points}
    out.points += [steps.judge.missing(name, step) for step in range(1, plan.decode + 1) for name in wanted
                   if (step, name) not in produced]
    out.points.sort(key=lambda p: (p.step, steps.order[p.name]))
    out.summary = steps.summary()
    return out
