"""Per-point metrics and tolerances.

Metrics are computed in float64 after upcasting both sides. A point passes when its rel_l2 is within
its tolerance (scale-aware: the residual stream grows with depth, so an absolute tolerance that suits
layer 0 means nothing at layer 40); NaN, Inf or a shape mismatch fail it. Cosine similarity is
reported as information only: rel_l2 <= t already implies 1 - cosine <= t**2 / 2, so a cosine floor
could never decide a verdict that rel_l2 had not.

A point's tolerance, in order of precedence (each step overrides the one before it):

1. the dtype's default (DEFAULTS);
2. a TOML file's ``[default]`` (it replaces the dtype default, so it does not discard calibration);
3. ``--calibrate``: CALIBRATION_MULTIPLE x the point's measured noise, never below the dtype's NOISE_FLOOR;
4. a TOML file's ``[points."GLOB"]``, then ``--tolerance GLOB:rel_l2=X``, in the order given (the last
   match wins): a point named explicitly gets what was asked for;
5. floors: no tolerance goes below what the reference can resolve, i.e. ROUNDING_MARGIN x a golden's
   storage rounding, and, when calibrated, the point's measured noise itself.

Each tolerance carries its source, so a report says which step set it.
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

# Defaults per dtype: what an honest port reaches against a float32 reference (rel_l2).
DEFAULTS = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
# --calibrate: tolerance = CALIBRATION_MULTIPLE x the point's noise, never below the dtype's rounding floor
CALIBRATION_MULTIPLE = 10.0
NOISE_FLOOR = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}
# a reference stored in low precision (a float16 golden) cannot resolve errors below a few times its rounding
ROUNDING_MARGIN = 3.0
COSINE_REFUSED = ("cosine is not a tolerance: rel_l2 <= t already implies cosine >= 1 - t**2/2, so a cosine floor "
                  "never decides a verdict; set rel_l2 only")


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


def logit_metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict | None:
    """KL(reference || candidate) per position, top-1 agreement, top-5 overlap, max logit difference; None when
    the two cannot be compared (shapes differ, or NaN/Inf: the logits point itself fails and says why)."""
    if candidate.shape != reference.shape or not (torch.isfinite(candidate).all() and torch.isfinite(reference).all()):
        return None
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
    """Each point's tolerance, by the precedence in this module's docstring."""

    def __init__(self, dtype: str, specs: list[str] = ()):
        if dtype not in DEFAULTS:
            raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DEFAULTS)}")
        self.dtype = dtype
        self.default = Tolerance(DEFAULTS[dtype], f"{dtype} default")
        self.rules: list[tuple[str, float, str]] = []   # (glob, rel_l2, label), in the order given
        for spec in specs:
            default, rules = _parse(spec)
            if default is not None:
                self.default = default
            self.rules += rules

    def for_point(self, name: str, noise: float | None = None, rounding: float = 0.0) -> Tolerance:
        """``noise``: the point's measured precision noise (with --calibrate); ``rounding``: the reference's own
        storage rounding (a golden stored in float16)."""
        tol = self.default
        if noise is not None:
            tol = Tolerance(max(CALIBRATION_MULTIPLE * noise, NOISE_FLOOR[self.dtype]),
                            f"calibrated ({CALIBRATION_MULTIPLE:g}x noise)")
        for pattern, rel_l2, label in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                tol = Tolerance(rel_l2, label)
        for floor, why in ((ROUNDING_MARGIN * rounding, f"{ROUNDING_MARGIN:g}x the reference's storage rounding"),
                           (noise or 0.0, "the point's measured noise")):
            if floor > tol.rel_l2:
                tol = Tolerance(floor, f"{tol.source}, raised to {why}")
        return tol


def _parse(spec: str) -> tuple[Tolerance | None, list[tuple[str, float, str]]]:
    """'GLOB:rel_l2=1e-3' or a TOML file with [default] and [points."GLOB"] tables: (its default, its globs)."""
    path = Path(spec)
    if spec.endswith(".toml"):
        if not path.is_file():
            raise ParityError(f"--tolerance {spec}: no such file; give a TOML file or 'GLOB:rel_l2=1e-3'")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
            raise ParityError(f"{spec}: not valid TOML ({str(exc).splitlines()[0] if str(exc) else exc}); "
                              f"fix the file") from None
        unknown = set(data) - {"default", "points"}
        if unknown:
            raise ParityError(f"{spec}: unknown table(s) {', '.join(sorted(unknown))}; use [default] and [points.\"GLOB\"]")
        default = data.get("default")
        points = data.get("points", {})
        if default is not None and not isinstance(default, dict) or not isinstance(points, dict):
            raise ParityError(f"{spec}: [default] and [points.\"GLOB\"] must be tables of rel_l2 = NUMBER")
        rules = []
        for pattern, values in points.items():
            if not isinstance(values, dict):
                raise ParityError(f"{spec}: points.{pattern!r} must be a table like {{ rel_l2 = 1e-3 }}")
            rules.append((pattern, _rel_l2(f"{spec} [points.{pattern!r}]", values), f"{spec} {pattern}"))
        return (None if default is None else Tolerance(_rel_l2(f"{spec} [default]", default), f"{spec} [default]"),
                rules)
    pattern, sep, rest = spec.rpartition(":")
    if not sep or not pattern:
        raise ParityError(f"--tolerance {spec!r}: expected 'GLOB:rel_l2=1e-3' or a .toml file")
    values = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ParityError(f"--tolerance {spec!r}: {item!r} is not KEY=VALUE; expected 'GLOB:rel_l2=1e-3'")
        values[key.strip()] = value.strip()
    return None, [(pattern, _rel_l2(f"--tolerance {spec!r}", values), spec)]


def _rel_l2(where: str, values: dict) -> float:
    """The rel_l2 of a tolerance table: a finite, non-negative number, and nothing else."""
    if "cosine" in values:
        raise ParityError(f"{where}: {COSINE_REFUSED}")
    unknown = set(values) - {"rel_l2"}
    if unknown or "rel_l2" not in values:
        raise ParityError(f"{where}: expected rel_l2 = NUMBER, got {', '.join(sorted(values)) or 'nothing'}")
    value = values["rel_l2"]
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not number >= 0 or number == float("inf"):
        raise ParityError(f"{where}: rel_l2={value!r} is not a finite number >= 0")
    return number


def judge(name: str, m: dict, tol: Tolerance, noise: float | None) -> PointResult:
    passed = m["nonfinite"] is None and m["rel_l2"] <= tol.rel_l2
    return PointResult(name=name, max_abs=m["max_abs"], mean_abs=m["mean_abs"], rel_l2=m["rel_l2"],
                       cosine=m["cosine"], tolerance=tol, passed=passed, noise=noise, nonfinite=m["nonfinite"],
                       reference_norm=m["reference_norm"])
