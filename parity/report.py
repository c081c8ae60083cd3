"""The parity report: per-point results, the verdict, and its JSON form (keys fixed by DESIGN.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_VERSION = 1


@dataclass
class Tolerance:
    """A point passes when its rel_l2 <= rel_l2 (cosine is information: parity.compare says why)."""

    rel_l2: float
    source: str = "default"  # which step of parity.compare's precedence set it


@dataclass
class PointResult:
    name: str
    max_abs: float
    mean_abs: float
    rel_l2: float
    cosine: float
    tolerance: Tolerance
    passed: bool
    noise: float | None = None           # the reference's own precision noise (rel_l2), with --calibrate
    nonfinite: str | None = None         # "NaN in candidate", ... (fails the point)
    compared: bool = True                # False: the candidate did not provide this point
    reference_norm: float = 0.0
    run: int = 0                         # which input (--inputs) this result comes from: each point keeps its worst

    @property
    def needed(self) -> dict:
        """The smallest tolerance that would have passed this point."""
        return {"rel_l2": self.rel_l2}

    @property
    def noise_ratio(self) -> float | None:
        return None if not self.noise else self.rel_l2 / self.noise

    def to_json(self) -> dict:
        out = {
            "name": self.name, "max_abs": self.max_abs, "mean_abs": self.mean_abs, "rel_l2": self.rel_l2,
            "cosine": self.cosine, "tolerance": asdict(self.tolerance), "passed": self.passed,
            "noise": self.noise, "noise_ratio": self.noise_ratio, "nonfinite": self.nonfinite,
            "compared": self.compared, "needed": self.needed, "run": self.run,
        }
        return out


@dataclass
class Report:
    family: str
    reference: dict                      # {"kind": "transformers", "path": ...}
    candidate: dict                      # {"kind": "neutral" | "transformers" | ..., "path": ...}
    dtype: str
    mode: str                            # "free" | "isolated"
    layerwise: bool
    points: list[PointResult] = field(default_factory=list)
    logits: dict | None = None           # kl_mean, kl_max, top1_agreement, top5_overlap, max_logit_diff
    inputs: dict = field(default_factory=dict)       # token ids, exercised conventions, warnings
    diagnosis: list[dict] = field(default_factory=list)
    calibrated: bool = False
    warnings: list[str] = field(default_factory=list)
    # where a candidate's points were read from, for candidates that must find them (ONNX graphs):
    # {"points": {name: {"value", "how"}}, "unmatched": {name: why}}
    matching: dict | None = None
    # --generate: greedy tokens of both models and the first position where they differ
    generation: dict | None = None

    @property
    def failing(self) -> list[PointResult]:
        return [p for p in self.points if p.compared and not p.passed]

    @property
    def verdict(self) -> str:
        compared = [p for p in self.points if p.compared]
        return "pass" if compared and not self.failing else "fail"

    @property
    def first_divergence(self) -> PointResult | None:
        return next(iter(self.failing), None)

    def __bool__(self) -> bool:
        return self.verdict == "pass"

    @property
    def exit_code(self) -> int:
        return 0 if self else 1

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "parity_report_version": REPORT_VERSION,
            "verdict": self.verdict,
            "family": self.family,
            "reference": self.reference,
            "candidate": self.candidate,
            "dtype": self.dtype,
            "mode": self.mode,
            "layerwise": self.layerwise,
            "calibrated": self.calibrated,
            "points": [p.to_json() for p in self.points],
            "first_divergence": None if first is None else {
                "point": first.name, "rel_l2": first.rel_l2, "cosine": first.cosine, "max_abs": first.max_abs,
                "tolerance": asdict(first.tolerance), "noise": first.noise, "noise_ratio": first.noise_ratio,
                "nonfinite": first.nonfinite, "run": first.run,
            },
            "diagnosis": self.diagnosis,
            "logits": self.logits,
            "inputs": self.inputs,
            "warnings": self.warnings,
            "matching": self.matching,
            "generation": self.generation,
        }
