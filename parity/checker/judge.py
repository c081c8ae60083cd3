"""One judge for every comparison a check makes (a prompt's points, each decode step's, a golden's drift): a
point's tolerance follows from the tolerances asked for and the point's noise (parity.checker.noise), and its
result from the metrics of the two tensors. Several prompts are merged here too: each point keeps its worst."""

from __future__ import annotations

import torch

from parity import names
from parity.compare import Tolerances, judge, metrics
from parity.report import PointResult, Report


class Judge:
    def __init__(self, tolerances: Tolerances):
        self.tolerances = tolerances

    def __call__(self, name: str, got: torch.Tensor, ref: torch.Tensor, noise: float | None = None,
                 rounding: float = 0.0, step: int | None = None, scale=None,
                 measured: dict | None = None) -> PointResult:
        """``noise``: the point's measured noise (None: not measured); ``rounding``: the reference's storage
        rounding, part of this comparison's noise (a golden stored in float16); ``scale``: (multiple, what) of the
        noise the tolerance is (None: the calibration's); ``measured``: metrics(got, ref), where the caller has them
        already (parity.compare.logits_compared)."""
        if ref.device != got.device:  # sides on different devices are compared where the candidate is
            ref = ref.to(got.device)
        # the noise shown beside the result: measured noise, and the rounding it cannot resolve below
        shown = noise if noise is None else max(noise, rounding)
        tolerance = self.tolerances.for_point(name, noise, rounding, *(scale or ()))
        result = judge(name, metrics(got, ref) if measured is None else measured, tolerance, shown)
        result.step = step
        return result

    def missing(self, name: str, step: int | None = None) -> PointResult:
        """A point the candidate never produced: not compared, and so not passed."""
        return PointResult(name=name, max_abs=float("nan"), mean_abs=float("nan"), rel_l2=float("nan"),
                           cosine=float("nan"), tolerance=self.tolerances.for_point(name), passed=False,
                           compared=False, step=step)


def severity(p: PointResult) -> tuple[int, float]:
    """How bad a point's result is: failing beats passing beats not compared; then rel_l2 / tolerance."""
    if not p.compared:
        return (0, 0.0)
    ratio = p.rel_l2 / p.tolerance.rel_l2 if p.tolerance.rel_l2 > 0 else float("inf")
    if p.nonfinite or ratio != ratio:  # NaN, Inf, shape: as bad as it gets
        ratio = float("inf")
    return (1 if p.passed else 2, ratio)


# several inputs: the worst of each logit metric
_WORST_LOGITS = {"kl_mean": max, "kl_max": max, "max_logit_diff": max, "top1_agreement": min, "top5_overlap": min,
                 "allclose_1e-5": min, "next_token_agrees": min, "positions": lambda a, b: a + b}


def merge(report: Report, results: list[PointResult], logits: dict | None) -> None:
    """Several inputs: each point keeps its worst result (a failure is never replaced by a pass)."""
    if not report.points:
        report.points, report.logits = results, logits
        return
    worst = {p.name: p for p in report.points}
    for p in results:
        if p.name not in worst or severity(p) > severity(worst[p.name]):
            worst[p.name] = p
    report.points = sorted(worst.values(), key=lambda p: names.point_order(p.name))
    if logits and report.logits:
        report.logits = {k: _WORST_LOGITS[k](report.logits[k], logits[k]) if k in _WORST_LOGITS else report.logits[k]
                         for k in report.logits}
    elif logits or report.logits:  # one input's logits could not be compared: no summary stands for all
        report.logits = None
