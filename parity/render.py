"""Render a parity Report: console table, GitHub markdown, one self-contained HTML page, JUnit XML.

Every format says the same things: one row per capture point (rel_l2, tolerance, noise floor,
cosine, max_abs, a bar of rel_l2 / tolerance on a log scale, pass/FAIL), the verdict sentence,
the logit metrics, the diagnosis and the warnings. Numbers are shown with 3 significant digits.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import xml.etree.ElementTree as ET
from html import escape
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .errors import ParityError
from .report import PointResult, Report

LOGIT_KEYS = ("kl_mean", "kl_max", "top1_agreement", "top5_overlap", "max_logit_diff")
HEADERS = ("point", "rel_l2", "tolerance", "noise floor", "cosine", "max_abs", "vs tol", "status")
RED, GREEN, GREY = "#d62728", "#2ca02c", "#888888"

# --- numbers ----------------------------------------------------------------------------------


def _e(x: float | None) -> str:
    """An error-like number with 3 significant digits: 3.10e-01 (nan, inf as such)."""
    return "-" if x is None else f"{x:.2e}"


def _up(x: float) -> str:
    """Like _e, but never below x: a tolerance printed this way still passes."""
    s = f"{x:.2e}"
    if math.isfinite(x) and float(s) < x:
        mantissa, exp = s.split("e")
        s = f"{float(f'{float(mantissa) + 0.01:.2f}e{exp}'):.2e}"
    return s


def _cos(c: float) -> str:
    """A cosine: near 1 as its distance from 1 (rounded so the cosine is never overstated)."""
    if not math.isfinite(c):
        return f"{c}"
    if c >= 1:
        return "1"
    if c > 0.999:
        return f"1-{_up(1 - c)}"
    return f"{math.floor(c * 1000) / 1000:.3f}"


def _num(x) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int) or x == 0 or not math.isfinite(x) or 1e-3 <= abs(x) < 1e4:
        return f"{x:.3g}" if isinstance(x, float) else str(x)
    return f"{x:.2e}"


def _times(r: float | None) -> str:
    """A noise ratio: 3.1x, 42.5x, 3100x, 3.10e+07x."""
    if r is None:
        return ""
    if not math.isfinite(r) or r < 100:
        return f"{r:.3g}x"
    return f"{float(f'{r:.3g}'):.0f}x" if r < 1e6 else f"{r:.2e}x"


# --- per-point facts shared by every format ---------------------------------------------------


def _ratio(p: PointResult) -> float:
    """rel_l2 / tolerance: 1.0 is the threshold; non-finite errors count as infinitely bad."""
    if p.nonfinite or not math.isfinite(p.rel_l2):
        return math.inf
    tol = p.tolerance.rel_l2
    return p.rel_l2 / tol if tol > 0 else (math.inf if p.rel_l2 > 0 else 0.0)


def _status(p: PointResult) -> str:
    return "not compared" if not p.compared else "pass" if p.passed else "FAIL"


def _noise(p: PointResult) -> str:
    return _e(p.noise) + _noise_times(p)


def _noise_times(p: PointResult) -> str:
    r = p.noise_ratio
    return f" ({_times(r)} the noise)" if r is not None and math.isfinite(r) and not p.nonfinite else ""


def _why(p: PointResult, *, tol_word: str = "") -> str:
    """Why a point failed: 'rel_l2 3.10e-01 > 1.00e-05 (3100x the noise)', or the NaN/shape reason."""
    if p.nonfinite:
        return p.nonfinite
    if not p.rel_l2 <= p.tolerance.rel_l2:
        return f"rel_l2 {_e(p.rel_l2)} > {tol_word}{_e(p.tolerance.rel_l2)}{_noise_times(p)}"
    return "marked as failed"


def _needed(p: PointResult) -> str:
    """The smallest tolerance that would have passed the point ('' if none would)."""
    if p.nonfinite or p.rel_l2 <= p.tolerance.rel_l2:
        return ""
    return f"rel_l2={_up(p.rel_l2)}"


def verdict(report: Report) -> str:
    """The verdict sentence: 'PASS: 37 points within tolerance' or 'FAIL at <point>: <why>; ...'."""
    compared = [p for p in report.points if p.compared]
    if report.verdict == "pass":
        return f"PASS: {len(compared)} point{'s' * (len(compared) != 1)} within tolerance"
    first = report.first_divergence
    if first is None:
        return "FAIL: no capture point was compared"
    needed = _needed(first)
    return f"FAIL at {_label(first)}: {_why(first)}" + (f"; smallest passing tolerance {needed}" if needed else "")


def _label(p: PointResult) -> str:
    """A point's name, with its decode step when it is one."""
    return p.name if p.step is None else f"step {p.step} {p.name}"


def _bar(ratio: float, width: int = 10, lo: float = -3.0, hi: float = 2.0) -> tuple[str, int]:
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


def _group(name: str) -> str:
    """The layer a point belongs to: 'layers.3' for 'layers.3.attn_out', else the first name part."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def _rows(report: Report, per_layer: bool = False) -> list[tuple[PointResult, str, str]]:
    """(point, label, status) per row: every point, or per layer its worst point by rel_l2 / tolerance
    (uncompared points are listed apart, under "not compared")."""
    prefill = [p for p in report.points if p.step is None]
    rows = _worst_of(_grouped(prefill, _group)) if per_layer else [(p, p.name, _status(p)) for p in prefill]
    # decode steps: one row per step, its worst point
    return rows + _worst_of(_grouped([p for p in report.points if p.step is not None], None))


def _grouped(points: list[PointResult], key) -> dict[str, list[PointResult]]:
    """Points by group: ``key(name)`` for the prompt's points, "step k" for decode steps (key unused there)."""
    groups: dict[str, list[PointResult]] = {}
    for p in points:
        label = key(p.name) if p.step is None else f"step {p.step}"
        groups.setdefault(label, []).append(p)
    return groups


def _worst_of(groups: dict[str, list[PointResult]]) -> list[tuple[PointResult, str, str]]:
    """Per group, its worst point by rel_l2 / tolerance, and how many of its points fail."""
    rows = []
    for name, points in groups.items():
        compared = [p for p in points if p.compared]
        if not compared:
            rows.append((points[0], name, "not compared"))
            continue
        worst = max(compared, key=lambda p: (not p.passed, _ratio(p)))
        fails = sum(not p.passed for p in compared)
        label = name if worst.name == name else f"{name} ({worst.name.removeprefix(name + '.')})"  # layers.3 (mid)
        rows.append((worst, label, f"FAIL {fails}/{len(compared)}" if fails else "pass"))
    return rows


def _cells(p: PointResult, calibrated: bool) -> list[str]:
    """rel_l2, tolerance, [noise floor], cosine, max_abs as text ('-' where not compared)."""
    if not p.compared:
        return ["-"] * (5 if calibrated else 4)
    noise = [_noise(p)] if calibrated else []
    return [_e(p.rel_l2), _e(p.tolerance.rel_l2), *noise, _cos(p.cosine), _e(p.max_abs)]


def _calibrated(report: Report) -> bool:
    return report.calibrated or any(p.noise is not None for p in report.points)


def _headers(report: Report) -> list[str]:
    return [h for h in HEADERS if h != "noise floor" or _calibrated(report)]


def _title(report: Report) -> str:
    ref, cand = report.reference, report.candidate
    return (f"parity {report.family}: {cand.get('kind', '?')} {cand.get('path', '')} vs "
            f"{ref.get('kind', '?')} {ref.get('path', '')} ({report.dtype}, {_mode(report)})")


def _mode(report: Report) -> str:
    """The mode in words: a newcomer does not know what "free" means."""
    if report.mode != "isolated":
        return "each side runs on its own outputs"
    if report.reference.get("fed"):
        return "isolated: each reference layer takes the candidate's input to it"
    return "isolated: each candidate layer takes the reference's input to it"


def _extras(report: Report) -> list[tuple[str, list[str]]]:
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
        items = [f"{k} {_num(report.logits[k])}" for k in LOGIT_KEYS if report.logits.get(k) is not None]
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
                f"{k} {_num(against[k])}" for k in LOGIT_KEYS if against.get(k) is not None))
        out.append(("engine arithmetic", lines))
    quantized = []
    for role, side in (("reference", report.reference), ("candidate", report.candidate)):
        q = side.get("quantization")
        if isinstance(q, dict):
            what = f"FP8 {q.get('format', '?')} in {'x'.join(map(str, q.get('block') or []))} blocks"
            if role == "reference":
                quantized.append(f"reference: {what}, dequantized to {q.get('dequantized_to')} by "
                                 f"{q.get('dequantized_by')}")
            elif "types" in q:  # a GGUF file's matrices, calibrated to what they cost
                types = ", ".join(f"{n} {k}" for k, n in q["types"].items())
                quantized.append(f"candidate: tensors {types}; noise: {q.get('noise', 'not measured')}")
            else:
                worst = f" ({q['worst']})" if q.get("worst") else ""
                quantized.append(f"candidate: {what}, {q.get('dequantized')} weights dequantized to {q.get('dtype')}: "
                                 f"rel_l2 max {_num(q.get('rel_l2_max', 0))}{worst}, "
                                 f"mean {_num(q.get('rel_l2_mean', 0))}")
    if quantized:
        out.append(("quantization", quantized))
    if report.decode:
        out.append(("decode", _decode_lines(report.decode)))
    if report.diagnosis:
        out.append(("diagnosis", [f"{d.get('bug', 'unknown')} (confidence {_num(d.get('confidence', 0))}): "
                                  f"{d.get('evidence', '')}" for d in report.diagnosis]))
    if report.warnings:
        out.append(("warnings", list(report.warnings)))
    return out


# --- console ----------------------------------------------------------------------------------


def console(report: Report, console: Console, *, per_layer: bool = False) -> None:
    """Print the report as a rich table, then the verdict, logit metrics, diagnosis and warnings."""
    # narrower than the reports (which also hold max_abs and the noise value): fits 80 columns
    calibrated = _calibrated(report)
    plain = any(p.plain_rel_l2 is not None for p in report.points)  # the reference emulates the engine
    rows = _rows(report, per_layer)
    table = Table(title=Text(_title(report)), box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False,
                  collapse_padding=True)
    table.add_column("layer (worst point)" if per_layer else "point", no_wrap=True,
                     min_width=max([len(label) for _, label, _ in rows] + [5]))
    for h in ("rel_l2", *(["vs plain"] if plain else []), "tolerance", *(["x noise"] if calibrated else []),
              "cosine"):
        table.add_column(h, no_wrap=True, justify="right")
    table.add_column("vs tol", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for p, label, status in rows:
        bar = Text()
        if p.compared:
            s, threshold = _bar(_ratio(p), width=8)
            bar.append(s[:threshold], style="green")
            bar.append(s[threshold:], style="red" if _ratio(p) > 1 else "dim")
        cells = ["-"] * (3 + calibrated + plain) if not p.compared else [
            _e(p.rel_l2), *([_e(p.plain_rel_l2) if p.plain_rel_l2 is not None else "-"] if plain else []),
            _e(p.tolerance.rel_l2), *([_times(p.noise_ratio) if p.noise else "-"] if calibrated else []),
            _cos(p.cosine)]
        style = "bold red" if status.startswith("FAIL") else "green" if status == "pass" else "dim"
        table.add_row(Text(label), *(Text(c) for c in cells), bar, Text(status, style=style))
    console.print(table)
    console.print(Text(verdict(report), style="bold green" if report else "bold red"), soft_wrap=True)
    for heading, lines in _extras(report):
        for line in lines:
            console.print(Text(f"{heading}: {line}"), soft_wrap=True)


# --- markdown ---------------------------------------------------------------------------------


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def markdown(report: Report) -> str:
    """GitHub markdown: title, verdict, one table row per point, then the other sections."""
    calibrated = _calibrated(report)
    headers = _headers(report)
    lines = [f"## {_md(_title(report))}", "", f"**{_md(verdict(report))}**", "",
             "| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if h in ("rel_l2", "tolerance", "max_abs") else "---" for h in headers) + "|"]
    for p, label, status in _rows(report):
        bar = _bar(_ratio(p))[0].rstrip() if p.compared else ""
        status = f"**{status}**" if status == "FAIL" else status
        lines.append("| " + " | ".join([f"`{label}`", *map(_md, _cells(p, calibrated)), bar, status]) + " |")
    for heading, items in _extras(report):
        lines += ["", f"**{heading}**", ""] + [f"- {_md(item)}" for item in items]
    return "\n".join(lines) + "\n"


# --- html -------------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.3em; } .verdict { font-weight: bold; font-size: 1.1em; }
.pass { color: #2ca02c; } .fail { color: #d62728; }
table { border-collapse: collapse; margin-top: 1em; } th, td { padding: 2px 10px; text-align: left; }
th { border-bottom: 1px solid #888; } td.num { text-align: right; font-family: monospace; }
tr.fail td { background: #fdecea; } tr.skip td { color: #888; } .bar { font-family: monospace; }
svg text { font: 11px sans-serif; fill: #333; }
"""


def _decode_lines(d: dict) -> list[str]:
    """The decode section: what was decoded, what it crossed, the logits over the steps, where it diverged."""
    crossed = [f"{c['what']} ({c['at']} tokens): {c['crossed'] or 'not reached'}" for c in d.get("crossed", [])]
    lines = [f"prompt of {d['prompt_length']} tokens, then {d['steps']} steps with the candidate's own cache, fed the "
             f"reference's greedy tokens", "crossed: " + "; ".join(crossed)]
    if d.get("kl_max") is not None:
        lines.append(f"logits over the steps: kl_max {_num(d['kl_max'])} · top1_agreement {_num(d['top1_agreement'])}")
    first = d.get("first_divergence")
    lines.append("every step within tolerance" if first is None else
                 f"first divergence at step {first['step']} (position {first['position']}): {first['point']}, "
                 f"rel_l2 {_e(first['rel_l2'])}")
    return lines


def _svg(report: Report, width: int = 960, height: int = 380, steps: bool = False) -> str:
    """Error versus depth (the prefill's points), or with ``steps`` error versus decode step (each step's worst
    point): rel_l2, tolerance and noise floor on a log10 axis."""
    left, right, top, bottom = 60, 20, 48, 90
    pw, ph = width - left - right, height - top - bottom
    if steps:
        points = [p for p, _, _ in _worst_of(_grouped([p for p in report.points if p.step is not None], None))]
        group = lambda p: f"step {p.step}"  # noqa: E731
    else:
        points = [p for p in report.points if p.step is None]
        group = lambda p: _group(p.name)  # noqa: E731
    n = max(len(points), 1)
    values = [v for p in points if p.compared for v in (p.rel_l2, p.tolerance.rel_l2, p.noise)
              if v is not None and math.isfinite(v) and v > 0]
    lo = math.ceil(math.log10(min(values))) - 1 if values else -8  # a decade of room either side
    hi = math.floor(math.log10(max(values))) + 1 if values else 0

    def x(i: int) -> float:
        return left + (i + 0.5) * pw / n

    def y(v: float | None) -> float:  # zero / missing sit on the floor, NaN / inf on the ceiling
        if v is None or v <= 0:
            return top + ph
        if not math.isfinite(v):
            return top
        return top + (hi - min(max(math.log10(v), lo), hi)) / (hi - lo) * ph

    out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="error versus {"decode step" if steps else "depth"}">',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>']
    for k in range(lo, hi + 1, math.ceil((hi - lo) / 10)):  # a grid line per decade, at most ten
        yk = y(10.0 ** k)
        out += [f'<line x1="{left}" x2="{left + pw}" y1="{yk:.1f}" y2="{yk:.1f}" stroke="#eee"/>',
                f'<text x="{left - 6}" y="{yk + 4:.1f}" text-anchor="end">10<tspan dy="-6" '
                f'font-size="9">{k}</tspan></text>']
    out.append(f'<text x="14" y="{top + ph / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + ph / 2:.1f})">rel_l2 (log scale)</text>')
    groups = [(i, group(p)) for i, p in enumerate(points) if i == 0 or group(p) != group(points[i - 1])]
    for i, name in groups[::math.ceil(len(groups) / 30) or 1]:  # a tick per layer, at most 30 labels
        out += [f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#888"/>',
                f'<text x="{x(i):.1f}" y="{top + ph + 14}" text-anchor="end" '
                f'transform="rotate(-45 {x(i):.1f} {top + ph + 14})">{escape(name)}</text>']
    out.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle">'
               f'{"decode step (its worst point)" if steps else "capture point (forward order)"}</text>')

    def line(values: list[tuple[int, float | None]], color: str, dash: str = "") -> None:
        coords = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in values if v is not None)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        if coords:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dashes} points="{coords}"/>')

    compared = [(i, p) for i, p in enumerate(points) if p.compared]
    line([(i, p.tolerance.rel_l2) for i, p in compared], "#ff7f0e", "6 3")
    if _calibrated(report):
        line([(i, p.noise) for i, p in compared], GREY, "2 3")
    line([(i, p.rel_l2) for i, p in compared if math.isfinite(p.rel_l2)], "#1f77b4")
    first = report.first_divergence
    radius = min(4.0, max(1.5, pw / n / 3))
    for i, p in enumerate(points):
        cls, fill, stroke = (("skip", "white", GREY) if not p.compared else
                             ("pass", GREEN, GREEN) if p.passed else ("fail", RED, RED))
        tip = f"{_label(p)}: {_status(p)}" + (f", rel_l2 {_e(p.rel_l2)}, tolerance {_e(p.tolerance.rel_l2)}"
                                           if p.compared else "") + (f", {p.nonfinite}" if p.nonfinite else "")
        out.append(f'<circle class="marker {cls}" data-point="{escape(_label(p))}" cx="{x(i):.1f}" '
                   f'cy="{y(p.rel_l2 if p.compared else None):.1f}" r="{radius:.1f}" fill="{fill}" stroke="{stroke}">'
                   f'<title>{escape(tip)}</title></circle>')
        if p.compared and not math.isfinite(p.rel_l2) and (i == 0 or math.isfinite(points[i - 1].rel_l2)):
            # drawn on the ceiling: say why, once per run
            word = (p.nonfinite or str(p.rel_l2)).split()[0]
            out.append(f'<text x="{x(i):.1f}" y="{top - 4}" text-anchor="middle" style="fill: {RED}">'
                       f'{escape(word)}</text>')
        if first is not None and (p.step == first.step if steps else p is first):
            anchor, dx = ("start", 8) if i < n / 2 else ("end", -8)
            out.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{top}" y2="{top + ph}" stroke="{RED}" '
                       f'stroke-dasharray="3 3"/>')
            out.append(f'<text class="first-divergence" x="{x(i) + dx:.1f}" y="{top + 14}" text-anchor="{anchor}" '
                       f'style="fill: {RED}">first divergence: {escape(_label(first))}</text>')
    out += _legend(left + pw, _calibrated(report))
    out.append("</svg>")
    return "\n".join(out)


def _legend(right_edge: float, calibrated: bool) -> list[str]:
    """The plot's legend, along its top right."""
    legend = [("rel_l2", "#1f77b4", ""), ("tolerance", "#ff7f0e", "6 3")]
    legend += [("noise floor", GREY, "2 3")] if calibrated else []
    out = []
    for k, (label, color, dash) in enumerate(legend):
        lx = right_edge - 110 * (len(legend) - k)
        out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="14" y2="14" stroke="{color}" '
                   f'stroke-width="2" stroke-dasharray="{dash or "none"}"/>')
        out.append(f'<text x="{lx + 28}" y="18">{label}</text>')
    return out


def html(report: Report) -> str:
    """One self-contained HTML page: title, verdict, the error-versus-depth plot, the table."""
    calibrated = _calibrated(report)
    status_cls = "pass" if report else "fail"
    headers = "".join(f"<th>{escape(h)}</th>" for h in _headers(report))
    rows = []
    for p, label, status in _rows(report):
        cls = "skip" if not p.compared else "pass" if p.passed else "fail"
        cells = "".join(f'<td class="num">{escape(c)}</td>' for c in _cells(p, calibrated))
        bar = escape(_bar(_ratio(p))[0]) if p.compared else ""
        rows.append(f'<tr class="{cls}"><td><code>{escape(label)}</code></td>{cells}'
                    f'<td class="bar">{bar}</td><td class="{cls}">{escape(status)}</td></tr>')
    extras = "".join(f"<h2>{escape(heading)}</h2><ul>" + "".join(f"<li>{escape(i)}</li>" for i in items) + "</ul>"
                     for heading, items in _extras(report))
    title = escape(_title(report))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head>\n<body>\n<h1>{title}</h1>\n"
            f'<p class="verdict {status_cls}">{escape(verdict(report))}</p>\n{_svg(report)}\n'
            f'{_svg(report, steps=True) if report.decode else ""}\n'
            f"<table><thead><tr>{headers}</tr></thead><tbody>\n" + "\n".join(rows) +
            f"\n</tbody></table>\n{extras}\n</body></html>\n")


# --- junit ------------------------------------------------------------------------------------


def junit(report: Report) -> str:
    """JUnit XML: one testcase per point; failing points carry <failure>, uncompared ones <skipped/>."""
    classname = f"parity.{report.family}"
    failures = sum(p.compared and not p.passed for p in report.points)
    skipped = sum(not p.compared for p in report.points)
    counts = {"tests": str(len(report.points)), "failures": str(failures), "errors": "0", "skipped": str(skipped)}
    root = ET.Element("testsuites", name="parity", **counts)
    suite = ET.SubElement(root, "testsuite", name=classname, **counts)
    for p in report.points:
        case = ET.SubElement(suite, "testcase", classname=classname, name=_label(p), time="0")
        if not p.compared:
            ET.SubElement(case, "skipped", message="not compared: the candidate did not provide this point")
        elif not p.passed:
            failure = ET.SubElement(case, "failure", message=_why(p, tol_word="tolerance "), type="ParityMismatch")
            failure.text = (f"rel_l2 {_e(p.rel_l2)} (tolerance {_e(p.tolerance.rel_l2)}, {p.tolerance.source}), "
                            f"cosine {_cos(p.cosine)}, max_abs {_e(p.max_abs)}, noise {_e(p.noise)}")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


# --- files ------------------------------------------------------------------------------------


def _finite(obj):
    """JSON has no NaN / Infinity: write them as null (the point's 'nonfinite' says which)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


WRITERS = {
    ".json": lambda r: json.dumps(_finite(r.to_json()), indent=2, allow_nan=False) + "\n",
    ".md": markdown,
    ".html": html,
    ".xml": junit,
}


def check_output(path: Path, fmt: str | None = None) -> None:
    """Refuse, before any model runs, a report path that could not be written: an unknown format, a directory,
    or a place where no file can be created."""
    path = Path(path)
    if (fmt or path.suffix.lower()) not in WRITERS:
        raise ParityError(f"{path}: unknown report format {path.suffix or '(no suffix)'!r}; "
                          "use .json, .md, .html or .xml")
    if path.is_dir():
        raise ParityError(f"{path} is a directory; give a file name such as {path / 'parity.json'}")
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ParityError(f"{path}: cannot create a file there ({ancestor} is not a writable directory); "
                          f"choose another path")


def write(report: Report, path: Path, fmt: str | None = None) -> None:
    """Write the report in the format ``fmt`` or its suffix names, atomically (temporary sibling, then rename)."""
    path = Path(path)
    check_output(path, fmt)
    text = WRITERS[fmt or path.suffix.lower()](report)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
