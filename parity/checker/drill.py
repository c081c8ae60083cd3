"""The drill-down (docs/ops.md): the first diverging layer at op granularity, on both sides, and where its error
first shows: the op, the op before it that agreed, the heads and positions the error concentrates in.

With ``--points ops`` the check captured every op already; otherwise the failing layer is re-run alone
(Plan.drill): the candidate fed the reference's input to it where it can be fed, else each side on its own
input (the layers before agreed), or the reference following the candidate (--isolate on an engine run whole).
"""

from __future__ import annotations

from typing import Callable

from parity import names, ops
from parity.checker.plan import Plan, op_points
from parity.checker.prefill import PromptCheck
from parity.reference.models import Models
from parity.report import PointResult, Report

# What a layer point stands for when it is the first to diverge in a drilled layer (every op before it agreed).
CLOSES = {
    "attn_in": "the attention's input (its norm)",
    "attn_out": "the output projection (or what follows it: a post-norm)",
    "mid": "the residual add after the attention",
    "mlp_in": "the MLP's input (its norm)",
    "mlp_out": "the down projection (or what follows it: a post-norm, the experts' weighted sum)",
    "out": "the residual add after the MLP (or a per-layer input, a layer scalar)",
}


def drill(plan: Plan, models: Models, report: Report, kept_by_run: dict[int, dict], quantized,
          say: Callable[[str], None]) -> None:
    """Fill ``report.drilldown`` for the first divergence, where it is a prefill point inside a layer."""
    first = report.first_divergence
    layer = None if first is None or first.step is not None else names.layer_of(first.name)
    if layer is None or not op_points(plan.checkpoint):
        return
    if plan.ops:  # captured by the check itself, every op of every layer
        results = [p for p in report.points if names.layer_of(p.name) == layer and p.step is None]
        kept, how = kept_by_run.get(first.run, {}), "captured"
    else:
        say(f"drilling down: layer {layer} again, at op granularity")
        drilled = plan.drill(layer)
        prompt = PromptCheck(drilled, models, first.run, plan.inputs[first.run].ids, say, None, quantized,
                             keep_layer=layer)(done_with_reference=True)
        results = [p for p in prompt.results if names.layer_of(p.name) == layer]
        kept, how = prompt.kept, "re-run"
    report.drilldown = summarize(plan, layer, results, kept, how)
    if not any(names.is_op(p.name) and p.compared for p in results):
        report.warnings.append(f"drill-down: the {plan.kind.name} candidate gave no operation-level point of layer "
                               f"{layer}; only its layer points were compared")


def fed(plan: Plan, layer: int) -> str:
    """Whose input the drilled layer ran from on the candidate's side."""
    if plan.follows:
        return "candidate"
    return "reference" if plan.kind.isolates or layer == 0 else "own"


def summarize(plan: Plan, layer: int, results: list[PointResult], kept: dict, how: str) -> dict:
    """The drill-down's report entry: the layer's points and ops in forward order, the first that diverged, the last
    before it that agreed, and where the error sits in the first (heads, positions)."""
    ordered = sorted(results, key=lambda p: names.point_order(p.name))
    first = next((p for p in ordered if p.compared and not p.passed), None)
    before = None
    if first is not None:
        before = next((p for p in reversed(ordered[:ordered.index(first)]) if p.compared and p.passed), None)
    origin = fed(plan, layer)
    concentration = None
    if first is None:
        summary = (f"layer {layer} agrees at every op when run from "
                   f"{'the reference' if origin == 'reference' else 'its own'} input: its divergence "
                   f"comes from the layers before it")
    else:
        c, r = kept.get("candidate", {}).get(first.name), kept.get("reference", {}).get(first.name)
        where = ""
        if c is not None and r is not None and c.shape == r.shape:
            concentration = where_it_sits(plan, layer, first.name, c, r)
            where = concentration["summary"]
        what = CLOSES.get(first.name.split(".", 2)[2])
        if what is None:
            lead = f"{first.name} diverges first"
        elif before is None:  # nothing in the layer came before it
            lead = f"{first.name} diverges first: {what}"
        else:
            lead = f"every op before {first.name} agrees: {what} diverges"
        summary = "; ".join(s for s in (lead, where) if s)
    return {"layer": layer, "how": how, "fed": origin, "ops": [p.to_json() for p in ordered],
            "first": None if first is None else first.name, "op_before": None if before is None else before.name,
            "concentration": concentration, "summary": summary}


def where_it_sits(plan: Plan, layer: int, name: str, candidate, reference) -> dict:
    """ops.concentration for point ``name`` of layer ``layer``: heads from the layer's attention settings."""
    r = plan.checkpoint.resolved
    heads, kv_heads = r.layer("attention.heads", layer), r.layer("attention.kv_heads", layer)
    window = _window(r, layer)
    suffix = name.split(".", 2)[2]
    blocks = ops.head_blocks(suffix, candidate.shape[-1], int(heads or 0), int(kv_heads or heads or 0))
    return ops.concentration(candidate, reference, blocks, window)


def _window(r, layer: int) -> int | None:
    if "attention.sliding_window" not in r.settings:  # a family without windows has no such setting
        return None
    window = r.layer("attention.sliding_window", layer)
    return int(window) if window else None
