"""What every rendering of a parity Report says, as text: numbers with 3 significant digits, a point's status and why
it failed, the verdict, the mode in words, the sections after the table, the drill-down into the failing layer.

The formats (parity.render: console, markdown, JUnit; parity.render.page: the HTML page) lay these out; they word
nothing themselves, so that every format says the same thing in the same words.
"""

from __future__ import annotations

import math

from parity import names
from parity.report import PointResult, Report

LOGIT_KEYS = ("kl_mean", "kl_max", "top1_agreement", "top5_overlap", "max_logit_diff")
HEADERS = ("point", "rel_l2", "tolerance", "noise floor", "cosine", "max_abs", "vs tol", "status")
RED, GREEN, GREY = "#d62728", "#2ca02c", "#888888"

# --- numbers ----------------------------------------------------------------------------------


def sci(x: float | None) -> str:
    """An error-like number with 3 significant digits: 3.10e-01 (nan, inf as such)."""
    return "-" if x is None else f"{x:.2e}"


def sci_up(x: float) -> str:
    """Like sci, but never below x: a tolerance printed this way still passes."""
    s = f"{x:.2e}"
    if math.isfinite(x) and float(s) < x:
        mantissa, exp = s.split("e")
        s = f"{float(f'{float(mantissa) + 0.01:.2f}e{exp}'):.2e}"
    return s


def cos_text(c: float) -> str:
    """A cosine: near 1 as its distance from 1 (rounded so the cosine is never overstated)."""
    if not math.isfinite(c):
        return f"{c}"
    if c >= 1:
        return "1"
    if c > 0.999:
        return f"1-{sci_up(1 - c)}"
    return f"{math.floor(c * 1000) / 1000:.3f}"


def num(x) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int) or x == 0 or not math.isfinite(x) or 1e-3 <= abs(x) < 1e4:
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    return f"{x:.2e}"


def times(r: float | None) -> str:
    """A noise ratio: 3.1x, 42.5x, 3100x, 3.10e+07x."""
    if r is None:
        return ""
    if not math.isfinite(r) or r < 100:
        return f"{r:.3g}x"
    return f"{float(f'{r:.3g}'):.0f}x" if r < 1e6 else f"{r:.2e}x"


# --- per-point facts shared by every format ---------------------------------------------------


def ratio(p: PointResult) -> float:
    """rel_l2 / tolerance: 1.0 is the threshold; non-finite errors count as infinitely bad."""
    if p.nonfinite or not math.isfinite(p.rel_l2):
        return math.inf
    tol = p.tolerance.rel_l2
    return p.rel_l2 / tol if tol > 0 else (math.inf if p.rel_l2 > 0 else 0.0)


def status(p: PointResult) -> str:
    return "not compared" if not p.compared else "pass" if p.passed else "FAIL"


def noise_text(p: PointResult) -> str:
    return sci(p.noise) + noise_times(p)


def noise_times(p: PointResult) -> str:
    r = p.noise_ratio
    return f" ({times(r)} the noise)" if r is not None and math.isfinite(r) and not p.nonfinite else ""


def why(p: PointResult, *, tol_word: str = "") -> str:
    """Why a point failed: 'rel_l2 3.10e-01 > 1.00e-05 (3100x the noise)', or the NaN/shape reason."""
    if p.nonfinite:
        return p.nonfinite
    if p.name == names.INPUT_IDS:  # max_abs: the positions holding another token (parity.checker.run)
        return (f"the candidate ran other token ids than the reference ({p.max_abs:.0f} positions differ); the "
                f"activations were not compared")
    if not p.rel_l2 <= p.tolerance.rel_l2:
        return f"rel_l2 {sci(p.rel_l2)} > {tol_word}{sci(p.tolerance.rel_l2)}{noise_times(p)}"
    return "marked as failed"


def needed(p: PointResult) -> str:
    """The smallest tolerance that would have passed the point ('' if none would)."""
    if p.nonfinite or not math.isfinite(p.rel_l2) or p.rel_l2 <= p.tolerance.rel_l2:
        return ""
    return f"rel_l2={sci_up(p.rel_l2)}"


def verdict(report: Report) -> str:
    """The verdict sentence: 'PASS: 37 points within tolerance' or 'FAIL at <point>: <why>; ...', and the gate on
    the quantization's cost where one is set."""
    compared = [p for p in report.points if p.compared]
    gate = report.gate_failed
    gated = f"the quantization costs more than the gate allows ({'; '.join(gate)})" if gate else ""
    if not report.failing and compared:
        if gate:
            return f"FAIL: {len(compared)} point{'s' * (len(compared) != 1)} within tolerance, but {gated}"
        return f"PASS: {len(compared)} point{'s' * (len(compared) != 1)} within tolerance"
    first = report.first_divergence
    if first is None:
        return "FAIL: no capture point was compared"
    smallest = needed(first)
    return (f"FAIL at {label(first)}: {why(first)}" + (f"; smallest passing tolerance {smallest}" if smallest else "")
            + (f"; and {gated}" if gate else ""))


def judged(report: Report) -> str | None:
    """What the candidate's weights are and how they were judged, for the line under the title; None for a float
    candidate judged as always."""
    j = report.judging or {}
    w = j.get("weights")
    if not j or (not (w or {}).get("quantized") and j.get("chosen") == "default"):
        return None
    return f"candidate {w['words'] if w else 'weights unknown'}; {j.get('how')}"


def label(p: PointResult) -> str:
    """A point's name, with its decode step when it is one."""
    return p.name if p.step is None else f"step {p.step} {p.name}"


def bar(ratio: float, width: int = 10, lo: float = -3.0, hi: float = 2.0) -> tuple[str, int]:
    """Unicode bar of log10(ratio) over [lo, hi] decades; returns (bar, cell index of the threshold)."""
    threshold = round(-lo / (hi - lo) * width)
    if ratio <= 0:
        eighths = 0
    else:
        x = (math.log10(ratio) - lo) / (hi - lo) if math.isfinite(ratio) else 1.0
        eighths = round(min(max(x, 0.0), 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + ("" if part == 0 else " ▏▎▍▌▋▊▉"[part])
    if len(bar) <= threshold:  # mark the threshold when the bar does not reach it
        bar = bar.ljust(threshold) + "│"
    return bar.ljust(width), threshold


def group_of(name: str) -> str:
    """The layer a point belongs to: 'layers.3' for 'layers.3.attn_out', else the first name part."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def rows(report: Report, per_layer: bool = False) -> list[tuple[PointResult, str, str]]:
    """(point, label, status) per row: every point, or per layer its worst point by rel_l2 / tolerance
    (uncompared points are listed apart, under "not compared")."""
    prefill = [p for p in report.points if p.step is None]
    rows = worst_of(grouped(prefill, group_of)) if per_layer else [(p, p.name, status(p)) for p in prefill]
    # decode steps: one row per step, its worst point
    return rows + worst_of(grouped([p for p in report.points if p.step is not None], None))


def grouped(points: list[PointResult], key) -> dict[str, list[PointResult]]:
    """Points by group: ``key(name)`` for the prompt's points, "step k" for decode steps (key unused there)."""
    groups: dict[str, list[PointResult]] = {}
    for p in points:
        label = key(p.name) if p.step is None else f"step {p.step}"
        groups.setdefault(label, []).append(p)
    return groups


def worst_of(groups: dict[str, list[PointResult]]) -> list[tuple[PointResult, str, str]]:
    """Per group, its worst point by rel_l2 / tolerance, and how many of its points fail."""
    rows = []
    for name, points in groups.items():
        compared = [p for p in points if p.compared]
        if not compared:
            rows.append((points[0], name, "not compared"))
            continue
        worst = max(compared, key=lambda p: (not p.passed, ratio(p)))
        fails = sum(not p.passed for p in compared)
        label = name if worst.name == name else f"{name} ({worst.name.removeprefix(name + '.')})"  # layers.3 (mid)
        rows.append((worst, label, f"FAIL {fails}/{len(compared)}" if fails else "pass"))
    return rows


def cells(p: PointResult, calibrated: bool) -> list[str]:
    """rel_l2, tolerance, [noise floor], cosine, max_abs as text ('-' where not compared)."""
    if not p.compared:
        return ["-"] * (5 if calibrated else 4)
    noise = [noise_text(p)] if calibrated else []
    return [sci(p.rel_l2), sci(p.tolerance.rel_l2), *noise, cos_text(p.cosine), sci(p.max_abs)]


def calibrated(report: Report) -> bool:
    return report.calibrated or any(p.noise is not None for p in report.points)


def headers(report: Report) -> list[str]:
    return [h for h in HEADERS if h != "noise floor" or calibrated(report)]


def title(report: Report) -> str:
    ref, cand = report.reference, report.candidate
    family = report.family if report.generic is None else f"{report.family} (family unknown: no adapter)"
    return (f"parity {family}: {cand.get('kind', '?')} {cand.get('path', '')} vs "
            f"{ref.get('kind', '?')} {ref.get('path', '')} ({report.dtype}, {mode_words(report)[0]})")


# The check's modes in words, (short, sentence), the one place they are worded: a newcomer does not know what
# "free" or "isolated" means
MODE_WORDS = {
    "free": ("each side runs on its own outputs",
             "each side runs the whole model on its own outputs, so a difference is carried from layer to layer and "
             "can grow: a point's error includes what every point before it got wrong"),
    "isolated": ("each candidate layer fed the reference's input",
                 "each candidate layer is fed the reference's input to that layer, so a point's error is that "
                 "layer's own, not carried from the layers before it"),
    "isolated, reference fed": ("each reference layer fed the candidate's input",
                                "the candidate cannot be fed, so each reference layer is fed the candidate's input "
                                "to that layer: a point's error is that layer's own, not carried from the layers "
                                "before it"),
}


def mode_words(report: Report) -> tuple[str, str]:
    """The mode in words, (short, sentence): for the title, and for the line that explains it."""
    key = "isolated, reference fed" if report.mode == "isolated" and report.reference.get("fed") else report.mode
    return MODE_WORDS.get(key, (f"mode {report.mode}", f"mode {report.mode}"))


def extras(report: Report) -> list[tuple[str, list[str]]]:
    """Sections after the table: (heading, lines)."""
    out = []
    skipped = [p.name for p in report.points if not p.compared and p.step is None]
    by_point: dict[str, list[int]] = {}
    for p in report.points:
        if not p.compared and p.step is not None:
            by_point.setdefault(p.name, []).append(p.step)
    steps = (report.decode or {}).get("steps")
    skipped += [f"{name} at {'every decode step' if len(s) == steps else 'decode steps ' + ', '.join(map(str, s))}"
                for name, s in by_point.items()]
    if skipped:
        out.append(("not compared", [", ".join(skipped)]))
    if report.logits:
        items = [f"{k} {num(report.logits[k])}" for k in LOGIT_KEYS if report.logits.get(k) is not None]
        if items:
            out.append(("logits", [" · ".join(items)]))
    arithmetic = report.reference.get("arithmetic")
    if isinstance(arithmetic, dict):  # the reference computed as the candidate's engine does
        matmuls = ", ".join(f"{n} {k}" for k, n in (arithmetic.get("matmuls") or {}).items())
        lines = [f"the reference computes as {arithmetic.get('engine')}: matmuls (weight x activation) {matmuls}; "
                 f"GELU {arithmetic.get('gelu')}; 'vs plain': each point against the plain reference"]
        against = (report.logits or {}).get("against_plain")
        if isinstance(against, dict):
            lines.append("logits against the plain reference: " + " · ".join(
                f"{k} {num(against[k])}" for k in LOGIT_KEYS if against.get(k) is not None))
        out.append(("engine arithmetic", lines))
    quantized = []
    for role, side in (("reference", report.reference), ("candidate", report.candidate)):
        q = side.get("quantization")
        if isinstance(q, dict):
            what = f"FP8 {q.get('format', '?')} in {'x'.join(map(str, q.get('block') or []))} blocks"
            if role == "reference":
                quantized.append(f"reference: {what}, dequantized to {q.get('dequantized_to')} by "
                                 f"{q.get('dequantized_by')}")
            elif "types" in q:  # an engine file's quantized matrices by type, calibrated to what they cost
                types = ", ".join(f"{n} {k}" for k, n in q["types"].items())
                quantized.append(f"candidate: tensors {types}; noise: {q.get('noise', 'not measured')}")
            else:
                worst = f" ({q['worst']})" if q.get("worst") else ""
                quantized.append(f"candidate: {what}, {q.get('dequantized')} weights dequantized to {q.get('dtype')}: "
                                 f"rel_l2 max {num(q.get('rel_l2_max', 0))}{worst}, "
                                 f"mean {num(q.get('rel_l2_mean', 0))}")
    cost = (report.quantization or {}).get("cost")
    if cost:
        quantized += cost_lines(report)
    if quantized:
        out.append(("quantization", quantized))
    if report.decode:
        out.append(("decode", decode_lines(report.decode)))
    if report.diagnosis:
        out.append(("diagnosis", [f"{d.get('bug', 'unknown')} (confidence {num(d.get('confidence', 0))}): "
                                  f"{d.get('evidence', '')}" for d in report.diagnosis]))
    if report.warnings:
        out.append(("warnings", list(report.warnings)))
    return out


def cost_lines(report: Report) -> list[str]:
    """The quantization's cost against the float reference: the logits, the points it moves most, the gate."""
    q = report.quantization or {}
    cost, gate = q.get("cost") or {}, q.get("gate")
    if not (report.judging or {}).get("same_weights"):  # the cost is the check itself: its table and logits
        cost = {}
    items = [f"{k} {num(cost[k])}" for k in ("kl_mean", "kl_max", "top1_agreement", "top5_overlap")
             if cost.get(k) is not None]
    lines = [f"cost against the float reference: {' · '.join(items) if items else 'no logits compared'}"] \
        if cost else []
    points = cost.get("points") or {}
    if len(points) > 1:
        worst = sorted(points.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0)[:3]
        lines.append("cost per point (information, not judged): rel_l2 " + ", ".join(
            f"{name} {sci(e)}" for name, e in worst) + f" (the largest of {len(points)})")
    if gate:
        bounds = " and ".join(f"{flag} {gate[k]:g}" for k, flag in (("max_kl", "--max-kl"), ("min_top1", "--min-top1"))
                              if k in gate)
        lines.append(f"gate {bounds}: " + ("holds" if gate.get("passed") else "FAILS: " + "; ".join(gate["failed"])))
    return lines


def decode_lines(d: dict) -> list[str]:
    """The decode section: what was decoded, what it crossed, the logits over the steps, where it diverged."""
    crossed = [f"{c['what']} ({c['at']} tokens): {c['crossed'] or 'not reached'}" for c in d.get("crossed", [])]
    lines = [f"prompt of {d['prompt_length']} tokens, then {d['steps']} steps with the candidate's own cache, fed the "
             f"reference's greedy tokens", "crossed: " + "; ".join(crossed)]
    if d.get("kl_max") is not None:
        lines.append(f"logits over the steps: kl_max {num(d['kl_max'])} · top1_agreement {num(d['top1_agreement'])}")
    first = d.get("first_divergence")
    lines.append("every step within tolerance" if first is None else
                 f"first divergence at step {first['step']} (position {first['position']}): {first['point']}, "
                 f"rel_l2 {sci(first['rel_l2'])}")
    return lines



# --- the drill-down into the first diverging layer (docs/ops.md) ------------------------------

# how its ops were obtained, and what the candidate's drilled layer ran from, in words (docs/ops.md)
DRILL_HOW = {"re-run": "re-run op by op after the check", "captured": "captured op by op in the check (--points ops)"}
DRILL_FED = {"reference": "the candidate fed the reference's input to the layer",
             "own": "each side from its own input to the layer (the layers before it agreed)",
             "candidate": "the reference fed the candidate's input to the layer"}
DRILL_ROLES = {"first": "first to diverge", "before": "the last before it: agreed"}


def drill_heading(report: Report) -> str:
    """'layers.3, re-run op by op after the check, the candidate fed the reference's input to the layer'."""
    d = report.drilldown or {}
    return (f"layers.{d.get('layer')}, {DRILL_HOW.get(d.get('how'), d.get('how'))}, "
            f"{DRILL_FED.get(d.get('fed'), d.get('fed'))}")


def op_label(name: str) -> str:
    """An op's name within its layer: 'attn.k' for 'layers.3.attn.k'."""
    parts = name.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "layers" else name


def drill_rows(report: Report) -> list[tuple[PointResult, str]]:
    """The drill-down's ops in forward order, each with its role: "first", "before" or ""."""
    d = report.drilldown or {}
    roles = {d.get("op_before"): "before", d.get("first"): "first"}
    return [(p, roles.get(p.name, "")) for p in report.drill_ops()]


def drill_cells(p: PointResult) -> list[str]:
    """An op's rel_l2, tolerance and rel_l2 / tolerance as its table shows them ('-' where not compared)."""
    if not p.compared:
        return ["-", "-", "-"]
    return [sci(p.rel_l2), sci(p.tolerance.rel_l2), times(ratio(p))]


def _op_numbers(p: PointResult) -> str:
    """'rel_l2 2.10e-02, 4800x its tolerance', or why it could not be compared."""
    if not p.compared:
        return "not compared"
    if p.nonfinite or not math.isfinite(p.rel_l2):
        return p.nonfinite or f"rel_l2 {p.rel_l2}"
    return f"rel_l2 {sci(p.rel_l2)}, {times(ratio(p))} its tolerance"


def drill_sentence(report: Report) -> str | None:
    """Where the first diverging layer's error first shows, the point before it that agreed, and where the error
    sits, as one line (None without a drill-down): 'first diverging op: layers.0.attn.k (rel_l2 2.10e-02, 4800x its
    tolerance); the op before it, layers.0.attn.q, agreed (3.10e-07); kv head 1 carries 99% of the error; ...'."""
    d = report.drilldown
    if not d:
        return None
    ops = {p.name: p for p in report.drill_ops()}
    layer = f"layers.{d.get('layer')}"
    first, before = d.get("first"), d.get("op_before")
    if first is None:
        if not any(p.compared for p in ops.values()):
            return f"drill-down: no op of {layer} could be read"
        return "drill-down: " + (d.get("summary") or f"every op of {layer} agrees")
    numbers = f" ({_op_numbers(ops[first])})" if first in ops else ""
    # a layer point (attn_in, attn_out, ...) is first where every op before it agreed
    words = [f"first diverging op: {first}{numbers}" if names.is_op(first) else
             f"{first} diverges before any op of {layer} does{numbers}"]
    kind = "op" if before is not None and names.is_op(before) else "point"
    if before is not None:
        agreed = f" ({sci(ops[before].rel_l2)})" if before in ops and ops[before].compared else ""
        words.append(f"the {kind} before it, {before}, agreed{agreed}")
    else:
        words.append(f"it is the first point of {layer} compared")
    concentration = d.get("concentration") or {}
    head, where = report.drill_keys().head, concentration.get("summary")
    if where:
        words.append(where)
    elif head and isinstance(head.share, (int, float)):
        words.append(f"{head.axis} {head.index} carries {head.share:.0%} of the error")
    return "; ".join(words)
