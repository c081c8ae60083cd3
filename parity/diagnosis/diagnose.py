"""Naming the cause of a failed check.

At the first divergence, the reference computation is re-run under each hypothesis the bug
catalog holds for the model (the reference converted to the neutral layout, each applicable bug
injected, run by the executor) and compared with the candidate's own activation there and at the
final output. A hypothesis that reproduces the candidate — residual far below the candidate's
distance from the correct reference — names the bug; when none does, the diagnosis is `unknown`
and lists the closest, never a confident wrong name.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Callable

import torch

from parity.checkpoint import open_checkpoint
from parity.compare import metrics
from parity.diagnosis import bugs
from parity.names import layer_of, point_order
from parity.neutral.converter import build_manifest, convert, neutral_subset
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load
from parity.neutral.model import Manifest

# A hypothesis explains the candidate when its residual is below this share of the candidate's error.
EXPLAINS = 0.05
# ... and is listed as the closest of an unknown diagnosis only when its residual is below this share: one that
# leaves the error as it was explains none of it (a quantized file's error is no catalogued mistake's)
CLOSEST = 0.5
# A mistake with a size is fitted by a 1-D search: values STEP apart (a factor of sqrt(10)) over its range, then
# REFINE golden-section steps between the best one's neighbours (to about 0.3%): the true value may lie a step
# from the model's own, where the grid sees only the reference's residual
STEP, REFINE = math.log(10) / 2, 14
# no size is fitted where a fixed hypothesis already reproduces the candidate this closely (a share of EXPLAINS)
EXACT = 0.1
# a fitted hypothesis has one free value more than a fixed one, which fits noise too: where both reproduce the
# candidate, it is named first only if its residual is below the fixed one's by this factor
OCCAM = 1.5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return metrics(a, b)["rel_l2"]


def _run(manifest: Manifest, tensors: dict, dtype: torch.dtype, ids: torch.Tensor, wanted: set[str]) -> dict:
    got: dict[str, torch.Tensor] = {}
    NeutralModel(manifest, tensors, dtype)(ids, on_point=lambda n, t: got.setdefault(n, t.clone()) if n in wanted
                                           else None)
    return got


def error_start(candidate: torch.Tensor, reference: torch.Tensor, tolerance: float) -> int | None:
    """The first position whose error exceeds ``tolerance``; None where none does or the sequence is too short to
    tell (windows and RoPE mistakes start late)."""
    c, r = candidate.double()[0], reference.double()[0]                   # [S, ...]
    per = (c - r).flatten(1).norm(dim=1) / r.flatten(1).norm(dim=1).clamp_min(1e-30)
    bad = (per > tolerance).nonzero()
    return None if len(bad) == 0 or c.shape[0] < 4 else int(bad[0])


def position_evidence(first: int | None, length: int) -> str:
    """Where along the sequence the error starts (``error_start``'s), for the evidence ("" from position 0)."""
    if not first:
        return ""
    return f"; the error starts at position {first} of {length} (earlier positions agree)"


def _one_layer(reference_dir: Path, layer: int, adapter_dirs) -> tuple[Manifest, dict] | None:
    """The reference's manifest and only what layer ``layer`` reads (its tensors and the small ones outside the
    layers), converted without reading the rest; None where a layer needs more (another layer's keys and
    values, per-layer inputs computed from the embedding)."""
    ckpt = open_checkpoint(Path(reference_dir), adapter_dirs)
    style = ckpt.resolved["positions.rope_style"]
    manifest = build_manifest(ckpt, torch.float32, style, hashes=False)
    spec = manifest.layers[layer]
    if spec.attention.kv_shared_from is not None or spec.per_layer_input is not None:
        return None
    large = ("embed.tokens.weight", "embed.per_layer_tokens.weight", "lm_head.weight")
    own = f"layers.{layer}."
    tensors = neutral_subset(ckpt, manifest, lambda n: n.startswith(own) or
                             (not n.startswith("layers.") and n not in large))
    return manifest, tensors


def _run_layer(manifest: Manifest, tensors: dict, dtype: torch.dtype, layer: int, x: torch.Tensor,
               wanted: set[str]) -> dict:
    got: dict[str, torch.Tensor] = {}
    model = NeutralModel(manifest, tensors, dtype)
    positions = torch.arange(x.shape[1])
    model.layer(x.to(dtype), layer, positions, {}, None,
                lambda n, t: got.setdefault(n, t.clone()) if n in wanted else None)
    return got


def diagnose(reference_dir: Path, point: str, tolerance: float, candidate: dict[str, torch.Tensor],
             reference: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype,
             families: dict[str, list[str]] | None = None, adapter_dirs=(),
             layer_input: torch.Tensor | None = None, drilldown: dict | None = None) -> list[dict]:
    """Diagnosis entries, most likely first: {"bug", "confidence", "evidence", "residual"}. ``adapter_dirs``: the
    check's --adapters, so that a family they add is diagnosed too.

    With ``layer_input`` (the reference's input to the layer of ``point``), each hypothesis re-runs only that
    layer, reading only its weights: the diagnosis of a model of any size costs one layer per hypothesis.
    Otherwise (a point outside the layers) the whole reference is converted and run per hypothesis, and the
    final output must be reproduced too. With a ``drilldown`` (parity.checker.drill), a hypothesis whose mistake
    first shows at another op than the one that diverged first is dropped, and an ``unknown`` names that op."""
    final = next((n for n in ("logits", "final_norm") if n in candidate), None)
    layer = layer_of(point)
    local = _one_layer(reference_dir, layer, adapter_dirs) if layer is not None and layer_input is not None else None
    if local is not None:
        manifest, tensors = local
        wanted = {point}
        run = lambda m, t: _run_layer(m, t, dtype, layer, layer_input, wanted)  # noqa: E731
    else:
        wanted = {point} | ({final} if final else set())
        with tempfile.TemporaryDirectory(prefix="parity-diagnose-") as tmp:
            convert(reference_dir, Path(tmp) / "reference", adapter_dirs=adapter_dirs)
            manifest, tensors = load(Path(tmp) / "reference")
        run = lambda m, t: _run(m, t, dtype, ids, wanted)  # noqa: E731
    baseline = _rel(candidate[point], reference[point])
    where = point.replace("layers.", "layer ").replace(".", " ")
    start = error_start(candidate[point], reference[point], tolerance)

    def residual_of(m: Manifest, t: dict) -> float | None:
        got = run(m, t)
        if point not in got:
            return None
        return max([_rel(candidate[point], got[point])] + ([_rel(candidate[final], got[final])]
                                                          if final in got and final in wanted else []))

    scored = []
    clean = None  # the residual of the reference itself, as the executor runs it: a size that keeps it is not here
    # the fixed hypotheses first: where one reproduces the candidate outright, no size needs fitting
    for bug in sorted(bugs.applicable(manifest), key=lambda b: b.size is not None):
        if bug.decode:  # a cache mistake changes no prefill
            continue
        try:
            m, t = bugs.inject(bug.id, manifest, tensors, start=start)
        except KeyError:  # a mistake in tensors this layer does not read (the head, the embedding): not here
            continue
        if not any(consistent(op, drilldown) for op in (bug.op, *bug.also)):
            continue
        residual = residual_of(m, t)
        if residual is None:
            continue
        value = says = None
        if bug.size is not None and clean is None:
            clean = residual_of(manifest, tensors)
        if bug.size is not None and (clean is None or abs(residual - clean) > 1e-6 * clean) \
                and not any(r < EXACT * EXPLAINS * baseline for r, *_ in [*scored, (residual,)]):
            fitted = fit(bug, manifest, tensors, residual_of, baseline, start)
            if fitted is not None and fitted[0] <= residual:
                residual, value = fitted
        if value is not None:
            says = f"{bug.size.says.format(value=f'{value:.3g}')} where the model has {bug.size.has(manifest)}"
        scored.append((residual, bug, value, says))
    evidence_tail = position_evidence(start, candidate[point].shape[1])
    if drilldown is not None and drilldown.get("first"):
        evidence_tail += f"; drilled down: {drilldown['summary']}"
    return _named(scored, baseline, where, evidence_tail)


def fit(bug: bugs.Bug, manifest: Manifest, tensors: dict, residual_of: Callable[[Manifest, dict], float | None],
        beat: float, start: int | None) -> tuple[float, float] | None:
    """The value of a mistake with a size that best reproduces the candidate, and its residual: the best of
    log-spaced values STEP apart over the size's range, refined by golden section between its neighbours. A best
    value at an end of the range (the mistake is another, or beyond what the size can say), or none that beats
    ``beat`` (the reference's residual): None."""
    size = bug.size
    centre = size.around(manifest)
    low, high = math.log(centre * size.low), math.log(centre * size.high)

    def at(x: float) -> float:
        m, t = bugs.inject(bug.id, manifest, tensors, start=start, value=math.exp(x))
        r = residual_of(m, t)
        return math.inf if r is None or math.isnan(r) else r

    count = max(3, round((high - low) / STEP) + 1)
    xs = [low + (high - low) * k / (count - 1) for k in range(count)]
    rs = [at(x) for x in xs]
    k = min(range(count), key=rs.__getitem__)
    if k in (0, count - 1):
        return None
    a, b = xs[k - 1], xs[k + 1]
    ratio = (math.sqrt(5) - 1) / 2
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    rc, rd = at(c), at(d)
    for _ in range(REFINE):
        if rc <= rd:
            b, d, rd = d, c, rc
            c = b - ratio * (b - a)
            rc = at(c)
        else:
            a, c, rc = c, d, rd
            d = a + ratio * (b - a)
            rd = at(d)
    best, x = min((rs[k], xs[k]), (rc, c), (rd, d))
    return (best, float(f"{math.exp(x):.4g}")) if best < beat else None


def consistent(bug_op: str | None, drilldown: dict | None) -> bool:
    """Whether a catalogued mistake that first shows at ``bug_op`` (a point inside a layer: ``attn.q_rope``,
    ``attn_in``) fits the drill-down: not when that point was compared and agreed, nor when a point before it in
    forward order already diverged. A point the candidate did not give cannot rule it out."""
    if bug_op is None or drilldown is None or drilldown.get("first") is None:
        return True
    layer = drilldown["layer"]
    name = f"layers.{layer}.{bug_op}"
    seen = {p["name"]: p for p in drilldown["ops"]}
    if name in seen and seen[name]["compared"]:
        return name == drilldown["first"]
    return not _before(drilldown["first"], name)


def _before(a: str, b: str) -> bool:
    return point_order(a) < point_order(b)


def _named(scored: list, baseline: float, where: str, evidence_tail: str) -> list[dict]:
    """The diagnosis from each hypothesis' (residual, bug, fitted value, what it says of the value), value and
    words None where the mistake has no size: the ones that reproduce the candidate, or ``unknown``."""
    scored.sort(key=lambda x: x[0] * (OCCAM if x[2] is not None else 1.0))
    best = min((r for r, *_ in scored), default=math.inf)
    if best < EXPLAINS * baseline:
        out = []
        explaining = sum(r < EXPLAINS * baseline for r, *_ in scored)
        for residual, bug, value, says in scored:
            if residual >= EXPLAINS * baseline or residual > 10 * best + 1e-12 * baseline:
                continue
            confidence = max(0.0, 1.0 - residual / baseline) / explaining
            sized = "" if says is None else f": {says}"
            entry = {"bug": bug.id, "confidence": round(confidence, 4), "residual": residual,
                     "evidence": f"{where}: the candidate matches {bug.explains} ({bug.id}{sized}), residual "
                                 f"{residual:.1e} vs {baseline:.2g}{evidence_tail}."}
            if value is not None:
                entry["value"] = value
            out.append(entry)
        return out
    closest = ", ".join(f"{bug.id} (residual {r:.2g})" for r, bug, *_ in scored[:3] if r < CLOSEST * baseline)
    if closest:
        said = f"closest: {closest}"
    elif scored:
        said = ("none of those that apply explains any real share of it ("
                + (f"the best leaves a residual of {best:.2g})" if best <= baseline else
                   "each is further from the candidate than the reference is)"))
    else:
        said = "none applies here"
    return [{"bug": "unknown", "confidence": 0.0, "residual": best if scored else None,
             "evidence": f"{where}: no catalogued mistake reproduces the candidate (its error {baseline:.2g}); "
                         f"{said}{evidence_tail}."}]


def diagnose_decode(reference_dir: Path, kept: dict, ids: torch.Tensor, tokens: list[int], dtype: torch.dtype,
                    adapter_dirs=()) -> list[dict]:
    """The diagnosis of a check that first fails at a decode step (``kept``: parity.reference.decode's, the step, the
    point and both sides' tensors there and the step's logits). Each hypothesis of the catalog, the decode bugs (a
    cache policy) and the others alike (a sliding window ignored shows only once decoding passes the window),
    is run by the executor from the converted reference: the prompt, then the same tokens, one step at a time
    with its cache, to the failing step."""
    step, point = kept["step"], kept["point"]
    candidate, reference = kept["candidate"], kept["reference"]
    logits = kept.get("logits", {}).get(step)
    with tempfile.TemporaryDirectory(prefix="parity-diagnose-") as tmp:
        convert(reference_dir, Path(tmp) / "reference", adapter_dirs=adapter_dirs)
        manifest, tensors = load(Path(tmp) / "reference")

    def run(m: Manifest, t: dict) -> dict:
        model = NeutralModel(m, t, dtype)
        cache = model.new_cache()
        model(ids, cache=cache)
        got: dict[str, torch.Tensor] = {}
        for k, token in enumerate(tokens[:step], 1):
            model(torch.tensor([[token]]), cache=cache,
                  on_point=lambda n, x: got.setdefault(n, x.clone()) if k == step and n in (point, "logits") else None)
        return got

    baseline = _rel(candidate, reference)
    scored = []
    for bug in bugs.applicable(manifest):
        m, t = bugs.inject(bug.id, manifest, tensors)
        try:
            got = run(m, t)
        except RuntimeError:  # a mistake this model's shapes cannot even run: not what the candidate did
            continue
        residual = _rel(candidate, got[point])
        if logits is not None and "logits" in got and point != "logits":
            residual = max(residual, _rel(logits[0], got["logits"]))
        scored.append((residual, bug, None, None))
    where = f"decode step {step} (position {ids.shape[1] + step - 1}), " + point.replace("layers.", "layer ") \
        .replace(".", " ")
    first = "the first decode step" if step == 1 else f"step {step}; the steps before it agree"
    return _named(scored, baseline, where, f"; the error starts at {first}")
