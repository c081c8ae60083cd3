"""How a check judges the candidate's weights, decided before anything runs, and what its quantization costs.

A quantized file asks two questions, and a check answers both by default: is the port right (the reference runs
the file's own dequantized weights as its engine computes: --same-weights, calibrated to the engine's rounding),
and what does the quantization cost (the candidate against the checkpoint's float weights at the logits: KL,
top-1 and top-5 agreement, each point's rel_l2 as information: what users of quantized files measure against
the float model). ``--max-kl`` / ``--min-top1`` gate that cost. A float candidate, or one
judged with ``--float-reference``, is compared with the float reference alone, as it always was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from parity.weights import Weights
from parity.checker.options import CheckOptions
from parity.checker.plan import engine_options, parse_layers
from parity.checker.sides import candidate_kind, open_reference
from parity.errors import ParityError

# the logit metrics a quantization's cost reports (parity.compare.logit_metrics' names)
COST_KEYS = ("kl_mean", "kl_max", "top1_agreement", "top5_overlap", "positions")


@dataclass(frozen=True)
class Judging:
    """``same_weights``: the reference runs the candidate's own weights; ``chosen``: what chose it ("default",
    "--same-weights", "--float-reference"); ``weights``: what the candidate's kind says of its weights (None: it
    cannot tell); ``cost``: the candidate is also compared with the float reference, for the quantization's cost;
    ``why``: the reason where the default could not judge a quantized candidate at its own weights."""

    same_weights: bool
    chosen: str
    weights: Weights | None
    cost: bool
    why: str = ""

    @property
    def quantized(self) -> bool:
        return self.weights is not None and self.weights.quantized

    def how(self) -> str:
        """How the candidate is judged, in words."""
        if self.same_weights:
            how = "the port judged at its own weights and arithmetic"
            how += (" (the default for a quantized candidate: --same-weights --calibrate)" if self.chosen == "default"
                    else f" ({self.chosen})")
        else:
            how = "judged against the checkpoint's float weights"
            how += f" ({self.chosen})" if self.chosen != "default" else ""
            if self.quantized and not (self.chosen == "default" and self.weights.unemulated):
                how += ": the quantization's error counts as the port's"
        if self.why:
            how += f"; {self.why}"
        if self.cost and self.same_weights:
            how += "; the quantization's cost against the float reference is reported beside it"
        return how

    def line(self) -> str | None:
        """The check's first line: what the candidate is and how it is judged; None for a float candidate judged
        as it always was (nothing to say)."""
        if not self.quantized and self.chosen == "default":
            return None
        what = "candidate " + (self.weights.words() if self.weights is not None else "weights unknown")
        return f"{what}; {self.how()}"

    def to_json(self) -> dict:
        return {"same_weights": self.same_weights, "chosen": self.chosen, "cost_measured": self.cost,
                "how": self.how(), "weights": None if self.weights is None else self.weights.to_json()}


def _gates(options: CheckOptions) -> dict[str, float]:
    gates = {}
    for name, flag, top in (("max_kl", "--max-kl", None), ("min_top1", "--min-top1", 1.0)):
        value = getattr(options, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (top is not None and value > top):
            bound = f"between 0 and {top:g}" if top is not None else ">= 0"
            raise ParityError(f"{flag} {value!r}: expected a number {bound}")
        gates[name] = float(value)
    return gates


def choose(reference: Path, candidate, options: CheckOptions) -> Judging:
    """How ``candidate`` is judged against ``reference`` under ``options`` (refusing a gate it cannot apply)."""
    gates = _gates(options)
    kind, path = candidate_kind(candidate)
    weights = kind.weights(Path(path), engine_options(kind, options.engine_options)) if kind.weights else None
    quantized = weights is not None and weights.quantized
    truth = open_reference(Path(reference), options.adapter_dirs) if quantized or gates else None
    if options.same_weights is not None:
        same = bool(options.same_weights)
        chosen, why = ("--same-weights" if same else "--float-reference"), ""
    else:
        chosen, why, same = "default", "", False
        if quantized:
            if kind.same_weights is None:
                why = f"a {kind.name} candidate cannot give its weights back"
            elif truth.stored:
                why = "a golden reference holds activations, not weights to run the file's own on"
            elif weights.unemulated:
                why = (f"the reference cannot compute as the engine does ({weights.unemulated}), so tolerances are "
                       f"10x what the file's quantization costs (--calibrate)")
            else:
                same = True
    if gates:  # the gate reads the logits: refuse now a model that has none
        ckpt = truth.checkpoint
        if "logits" not in {c.name for c in ckpt.resolved.capture}:
            raise ParityError(f"--max-kl / --min-top1 gate the logits; a {ckpt.resolved.family} model has none "
                              f"(no LM head): drop them")
        if options.layers is not None:
            span = parse_layers(options.layers, ckpt.resolved.num_layers)
            if span.stop < span.of:
                raise ParityError(f"--max-kl / --min-top1 gate the logits, which only a slice ending at the last layer "
                                  f"computes: give them to --layers {span.start}:{span.of}-style slices only")
    return Judging(same, chosen, weights, cost=bool(gates) or (quantized and same and chosen == "default"),
                   why=why)


def cost_options(options: CheckOptions) -> CheckOptions:
    """The options of the float comparison that measures a quantization's cost: the same inputs, points and
    slice, each side on its own outputs (the logits a user of the file gets); no calibration, diagnosis, decode or
    generation (its points are information, not a verdict)."""
    return replace(options, same_weights=False, calibrate=False, diagnose=False, decode=0, generate=0, tolerance=(),
                   points="layers", inject=None, isolate=False, max_kl=None, min_top1=None)


def cost_of(report) -> dict:
    """A quantization's cost, from the report of the candidate against the float reference: the logit metrics and
    each prefill point's rel_l2."""
    logits = report.logits or {}
    return {"against": "the checkpoint's float weights (transformers, float32)",
            **{k: logits.get(k) for k in COST_KEYS if logits.get(k) is not None},
            "points": {p.name: p.rel_l2 for p in report.points if p.compared and p.step is None}}


def gate(cost: dict, options: CheckOptions) -> dict | None:
    """The gate --max-kl / --min-top1 set on the cost: {"max_kl", "min_top1", "failed": [why], "passed"}; None
    without one. A gate on logits the check did not compare fails (it cannot be shown to hold)."""
    gates = _gates(options)
    if not gates:
        return None
    failed = []
    max_kl, min_top1 = gates.get("max_kl"), gates.get("min_top1")  # each where it is set
    if max_kl is not None:
        kl = cost.get("kl_mean")
        if kl is None or not kl <= max_kl:
            failed.append(f"kl_mean {'not measured' if kl is None else f'{kl:.3g}'} > --max-kl {max_kl:g}")
    if min_top1 is not None:
        top1 = cost.get("top1_agreement")
        if top1 is None or not top1 >= min_top1:
            failed.append(f"top1_agreement {'not measured' if top1 is None else f'{top1:.3g}'} < --min-top1 "
                          f"{min_top1:g}")
    return {**gates, "failed": failed, "passed": not failed}
