"""Per-point metrics and tolerances.

Metrics are computed in float64 after upcasting both sides. Tolerances are on rel_l2 (scale-aware:
the residual stream grows with depth, so an absolute tolerance that suits layer 0 means nothing at
layer 40) with a cosine floor; defaults depend on the dtype, globs override them per point, and
``--calibrate`` replaces them with a multiple of each point's own precision noise.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import torch

from .errors import ParityError
from .report import PointResult, Tolerance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Defaults per dtype: what an honest port reaches against a float32 reference (rel_l2, cosine floor).
DEFAULTS = {
    "float32": Tolerance(1e-4, 0.99999),
    "float16": Tolerance(1e-2, 0.9995),
    "bfloat16": Tolerance(5e-2, 0.998),
}
# --calibrate: tolerance = CALIBRATION_MULTIPLE x the point's noise, never below the dtype's rounding floor
CALIBRATION_MULTIPLE = 10.0
NOISE_FLOOR = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}
# a reference stored in low precision (a float16 golden) cannot resolve errors below a few times its rounding
ROUNDING_MARGIN = 3.0


def metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict:
    """max_abs, mean_abs, rel_l2 = ||c - r|| / ||r||, cosine, and any NaN/Inf, in float64."""
    c, r = candidate.detach().double(), reference.detach().double()
    nonfinite = None
    for side, t in (("reference", r), ("candidate", c)):
        if not torch.isfinite(t).all():
            kind = "NaN" if torch.isnan(t).any() else "Inf"
            nonfinite = nonfinite or f"{kind} in {side}"
    if c.shape != r.shape:
        return {"max_abs": float("inf"), "mean_abs": float("inf"), "rel_l2": float("inf"), "cosine": 0.0,
                "nonfinite": f"shape {list(c.shape)} vs reference {list(r.shape)}", "reference_norm": 0.0}
    if nonfinite:
        return {"max_abs": float("inf"), "mean_abs": float("inf"), "rel_l2": float("inf"), "cosine": 0.0,
                "nonfinite": nonfinite, "reference_norm": float("nan")}
    diff = c - r
    r_norm, c_norm = r.norm().item(), c.norm().item()
    rel = diff.norm().item() / r_norm if r_norm > 0 else (0.0 if c_norm == 0 else float("inf"))
    cosine = 1.0 if r_norm == 0 and c_norm == 0 else (
        0.0 if r_norm == 0 or c_norm == 0 else (c.flatten() @ r.flatten()).item() / (c_norm * r_norm))
    return {"max_abs": diff.abs().max().item() if diff.numel() else 0.0,
            "mean_abs": diff.abs().mean().item() if diff.numel() else 0.0,
            "rel_l2": rel, "cosine": cosine, "nonfinite": None, "reference_norm": r_norm}


def logit_metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict:
    """KL(reference || candidate) per position, top-1 agreement, top-5 overlap, max logit difference."""
    c, r = candidate.double().reshape(-1, candidate.shape[-1]), reference.double().reshape(-1, reference.shape[-1])
    log_p, log_q = torch.log_softmax(r, -1), torch.log_softmax(c, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)                                  # [positions]
    k = min(5, r.shape[-1])
    top_r, top_c = r.topk(k, -1).indices, c.topk(k, -1).indices
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(top_r, top_c)])
    return {
        "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
        "top1_agreement": (top_r[:, 0] == top_c[:, 0]).double().mean().item(),
        "top5_overlap": overlap.mean().item(),
        "max_logit_diff": (c - r).abs().max().item(),
        "positions": r.shape[0],
        # what a final-output-only gate would have said: np.allclose(atol=1e-5), and the next token
        "allclose_1e-5": bool(torch.allclose(c, r, rtol=1e-5, atol=1e-5)),
        "next_token_agrees": bool(top_r[-1, 0] == top_c[-1, 0]),
    }


class Tolerances:
    """Default per dtype, then ``--tolerance`` globs in order (the last match wins), then calibration."""

    def __init__(self, dtype: str, specs: list[str] = ()):
        self.default = DEFAULTS[dtype]
        self.dtype = dtype
        self.rules: list[tuple[str, dict, str]] = []
        for spec in specs:
            self.rules += _parse(spec)

    def for_point(self, name: str, noise: float | None = None, rounding: float = 0.0) -> Tolerance:
        """``rounding``: the reference's own storage rounding (a golden stored in float16), which no tolerance
        goes below ROUNDING_MARGIN times."""
        tol = Tolerance(self.default.rel_l2, self.default.cosine, "default")
        if noise is not None:
            tol = Tolerance(max(CALIBRATION_MULTIPLE * noise, NOISE_FLOOR[self.dtype]),
                            min(self.default.cosine, 1 - 0.5 * max(CALIBRATION_MULTIPLE * noise, NOISE_FLOOR[self.dtype]) ** 2),
                            f"calibrated ({CALIBRATION_MULTIPLE:g}x noise)")
        floor = ROUNDING_MARGIN * rounding
        if floor > tol.rel_l2:
            tol = Tolerance(floor, min(tol.cosine, 1 - 0.5 * floor ** 2), f"{tol.source}, raised to {ROUNDING_MARGIN:g}x the reference's storage rounding")
        for pattern, values, label in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                tol = Tolerance(values.get("rel_l2", tol.rel_l2), values.get("cosine", tol.cosine), label)
        return tol


def _parse(spec: str) -> list[tuple[str, dict, str]]:
    """'GLOB:rel_l2=1e-3,cosine=0.999' or a TOML file with [default] and [points."GLOB"] tables."""
    path = Path(spec)
    if spec.endswith(".toml"):
        if not path.exists():
            raise ParityError(f"--tolerance {spec}: no such file")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ParityError(f"{spec}: not valid TOML ({exc})") from None
        rules = [("*", _values(spec, data.get("default", {})), f"{spec} [default]")] if "default" in data else []
        for pattern, values in data.get("points", {}).items():
            rules.append((pattern, _values(spec, values), f"{spec} {pattern}"))
        unknown = set(data) - {"default", "points"}
        if unknown:
            raise ParityError(f"{spec}: unknown table(s) {', '.join(sorted(unknown))}; use [default] and [points.\"GLOB\"]")
        return rules
    pattern, sep, rest = spec.rpartition(":")
    if not sep or not pattern:
        raise ParityError(f"--tolerance {spec!r}: expected 'GLOB:rel_l2=1e-3[,cosine=0.999]' or a .toml file")
    values = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ParityError(f"--tolerance {spec!r}: {item!r} is not KEY=VALUE")
        values[key.strip()] = value.strip()
    return [(pattern, _values(f"--tolerance {spec!r}", values), spec)]


def _values(where: str, values: dict) -> dict:
    out = {}
    for key, value in values.items():
        if key not in ("rel_l2", "cosine"):
            raise ParityError(f"{where}: unknown tolerance {key!r}; use rel_l2 and cosine")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise ParityError(f"{where}: {key}={value!r} is not a number") from None
    return out


def judge(name: str, m: dict, tol: Tolerance, noise: float | None) -> PointResult:
    passed = m["nonfinite"] is None and m["rel_l2"] <= tol.rel_l2 and m["cosine"] >= tol.cosine
    return PointResult(name=name, max_abs=m["max_abs"], mean_abs=m["mean_abs"], rel_l2=m["rel_l2"],
                       cosine=m["cosine"], tolerance=tol, passed=passed, noise=noise, nonfinite=m["nonfinite"],
                       reference_norm=m["reference_norm"])
