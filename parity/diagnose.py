"""Naming the cause of a failed check.

At the first divergence, the reference computation is re-run under each hypothesis the bug
catalog holds for the model (the reference converted to the neutral layout, each applicable bug
injected, run by the executor) and compared with the candidate's own activation there and at the
final output. A hypothesis that reproduces the candidate — residual far below the candidate's
distance from the correct reference — names the bug; when none does, the diagnosis is `unknown`
and lists the closest, never a confident wrong name.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from . import bugs
from .compare import metrics

# A hypothesis explains the candidate when its residual is below this share of the candidate's error.
EXPLAINS = 0.05


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return metrics(a, b)["rel_l2"]


def _run(manifest: dict, tensors: dict, dtype: torch.dtype, ids: torch.Tensor, wanted: set[str]) -> dict:
    from .executor.model import NeutralModel

    got: dict[str, torch.Tensor] = {}
    NeutralModel(manifest, tensors, dtype)(ids, on_point=lambda n, t: got.setdefault(n, t.clone()) if n in wanted
                                           else None)
    return got


def position_evidence(candidate: torch.Tensor, reference: torch.Tensor, tolerance: float) -> str:
    """Where along the sequence the error starts (windows and RoPE mistakes start late)."""
    c, r = candidate.double()[0], reference.double()[0]                   # [S, ...]
    per = (c - r).flatten(1).norm(dim=1) / r.flatten(1).norm(dim=1).clamp_min(1e-30)
    bad = (per > tolerance).nonzero()
    if len(bad) == 0 or c.shape[0] < 4:
        return ""
    first = int(bad[0])
    if first == 0:
        return ""
    return f"; the error starts at position {first} of {c.shape[0]} (earlier positions agree)"


def diagnose(reference_dir: Path, point: str, tolerance: float, candidate: dict[str, torch.Tensor],
             reference: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype,
             families: dict[str, list[str]] | None = None, adapter_dirs=()) -> list[dict]:
    """Diagnosis entries, most likely first: {"bug", "confidence", "evidence", "residual"}. ``adapter_dirs``: the
    check's --adapters, so that a family they add is diagnosed too."""
    from .neutral import convert, load

    final = next((n for n in ("logits", "final_norm") if n in candidate), None)
    wanted = {point} | ({final} if final else set())
    with tempfile.TemporaryDirectory(prefix="parity-diagnose-") as tmp:
        convert(reference_dir, Path(tmp) / "reference", adapter_dirs=adapter_dirs)
        manifest, tensors = load(Path(tmp) / "reference")
    baseline = _rel(candidate[point], reference[point])
    where = point.replace("layers.", "layer ").replace(".", " ")
    scored = []
    for bug in bugs.applicable(manifest):
        m, t = bugs.inject(bug.id, manifest, tensors)
        got = _run(m, t, dtype, ids, wanted)
        if point not in got:
            continue
        residual = max([_rel(candidate[point], got[point])] + ([_rel(candidate[final], got[final])] if final in got else []))
        scored.append((residual, bug))
    scored.sort(key=lambda x: x[0])
    evidence_tail = position_evidence(candidate[point], reference[point], tolerance)
    if scored and scored[0][0] < EXPLAINS * baseline:
        best = scored[0][0]
        out = []
        for residual, bug in scored:
            if residual >= EXPLAINS * baseline or residual > 10 * best + 1e-12 * baseline:
                break
            confidence = max(0.0, 1.0 - residual / baseline) / (1 + sum(r < EXPLAINS * baseline for r, _ in scored[1:]))
            out.append({"bug": bug.id, "confidence": round(confidence, 4), "residual": residual,
                        "evidence": f"{where}: the candidate matches {bug.explains} ({bug.id}), residual "
                                    f"{residual:.1e} vs {baseline:.2g}{evidence_tail}."})
        return out
    closest = ", ".join(f"{bug.id} (residual {r:.2g})" for r, bug in scored[:3])
    return [{"bug": "unknown", "confidence": 0.0, "residual": scored[0][0] if scored else None,
             "evidence": f"{where}: no catalogued mistake reproduces the candidate (its error {baseline:.2g}); "
                         f"closest: {closest or 'none applicable'}{evidence_tail}."}]
