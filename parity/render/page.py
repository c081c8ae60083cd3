"""A parity Report as one self-contained HTML page (no script, no network): the title, the mode in words, the
verdict, the error-versus-depth plot, the drill-down into the first diverging layer (its ops' table, their errors
against their tolerances, the heads' shares of the first diverging op's error), the table of points, the sections
after it. The words are parity.render.facts', so that the page says what the console says."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from parity.render import facts as facts
from parity.render.facts import GREEN, GREY, RED
from parity.report import PointResult, Report

BLUE, ORANGE = "#1f77b4", "#ff7f0e"
# Axis labels are drawn at -45 degrees: two of them LABEL_GAP pixels apart along the axis sit 18 px apart
# across their text, more than a line of the 11 px font, so they never overprint each other.
LABEL_GAP = 26
LABEL_ANGLE = -45

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.3em; } .verdict { font-weight: bold; font-size: 1.1em; } p.mode { color: #444; max-width: 60em; }
.pass { color: #2ca02c; } .fail { color: #d62728; }
table { border-collapse: collapse; margin-top: 1em; } th, td { padding: 2px 10px; text-align: left; }
th { border-bottom: 1px solid #888; } td.num { text-align: right; font-family: monospace; }
tr.fail td { background: #fdecea; } tr.skip td { color: #888; } .bar { font-family: monospace; }
tr.first td { background: #f9c6c0; font-weight: bold; } tr.before td { background: #e3f3e3; }
svg { display: block; margin-top: 1em; } svg text { font: 11px sans-serif; fill: #333; }
"""


# --- plot frames ------------------------------------------------------------------------------


@dataclass
class Frame:
    """A plot's box inside its SVG, and its log10 y axis over [10**lo, 10**hi]."""

    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    lo: int = -8
    hi: int = 0

    @property
    def pw(self) -> int:
        return self.width - self.left - self.right

    @property
    def ph(self) -> int:
        return self.height - self.top - self.bottom

    @property
    def floor(self) -> int:
        return self.top + self.ph

    def fit(self, values: list[float | None]) -> Frame:
        """The y axis spans the positive finite values, with a decade of room either side."""
        ok = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        if ok:
            self.lo, self.hi = math.ceil(math.log10(min(ok))) - 1, math.floor(math.log10(max(ok))) + 1
        return self

    def y(self, v: float | None) -> float:
        """Zero and missing values sit on the floor, NaN and Inf on the ceiling."""
        if v is None or v <= 0:
            return self.floor
        if not math.isfinite(v):
            return self.top
        return self.top + (self.hi - min(max(math.log10(v), self.lo), self.hi)) / (self.hi - self.lo) * self.ph

    def open(self, label: str, y_title: str = "rel_l2 (log scale)") -> list[str]:
        """The <svg> tag, the frame, a grid line per decade (at most ten) and the y axis' title."""
        out = [f'<svg width="{self.width}" height="{self.height}" viewBox="0 0 {self.width} {self.height}" '
               f'role="img" aria-label="{escape(label)}">',
               f'<rect x="{self.left}" y="{self.top}" width="{self.pw}" height="{self.ph}" fill="none" stroke="#ccc"/>']
        for k in range(self.lo, self.hi + 1, math.ceil((self.hi - self.lo) / 10)):
            yk = self.y(10.0 ** k)
            out += [f'<line x1="{self.left}" x2="{self.left + self.pw}" y1="{yk:.1f}" y2="{yk:.1f}" stroke="#eee"/>',
                    f'<text x="{self.left - 6}" y="{yk + 4:.1f}" text-anchor="end">10<tspan dy="-6" '
                    f'font-size="9">{k}</tspan></text>']
        mid = self.top + self.ph / 2
        out.append(f'<text x="14" y="{mid:.1f}" text-anchor="middle" transform="rotate(-90 14 {mid:.1f})">'
                   f'{escape(y_title)}</text>')
        return out


def spaced(ticks: list[tuple[float, str]], gap: float = LABEL_GAP) -> list[tuple[float, str]]:
    """The ticks whose labels are drawn: left to right, each at least ``gap`` px past the one before, and the last
    tick's label always (it replaces those it would crowd): a long model's 'logits' stays named."""
    kept: list[tuple[float, str]] = []
    for x, name in ticks:
        if not kept or x - kept[-1][0] >= gap:
            kept.append((x, name))
    if ticks and kept[-1] != ticks[-1]:
        while kept and ticks[-1][0] - kept[-1][0] < gap:
            kept.pop()
        kept.append(ticks[-1])
    return kept


def x_labels(frame: Frame, ticks: list[tuple[float, str]]) -> list[str]:
    """A tick mark per tick (its name on hover), and rotated labels for the ticks ``spaced`` keeps."""
    out = [f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.floor}" y2="{frame.floor + 4}" stroke="#888">'
           f'<title>{escape(name)}</title></line>' for x, name in ticks]
    y = frame.floor + 14
    out += [f'<text class="x-label" x="{x:.1f}" y="{y}" text-anchor="end" '
            f'transform="rotate({LABEL_ANGLE} {x:.1f} {y})">{escape(name)}</text>' for x, name in spaced(ticks)]
    return out


def legend(right_edge: float, items: list[tuple[str, str, str]]) -> list[str]:
    """A legend along the plot's top right: (label, color, dash) per line."""
    out = []
    for k, (label, color, dash) in enumerate(items):
        lx = right_edge - 110 * (len(items) - k)
        out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="14" y2="14" stroke="{color}" '
                   f'stroke-width="2" stroke-dasharray="{dash or "none"}"/>')
        out.append(f'<text x="{lx + 28}" y="18">{label}</text>')
    return out


# --- error versus depth -----------------------------------------------------------------------


def _depth_points(report: Report, steps: bool) -> tuple[list[PointResult], list[str]]:
    """The plotted points and the group (layer, or decode step) each belongs to."""
    if steps:
        points = [p for p, _, _ in facts.worst_of(facts.grouped([p for p in report.points if p.step is not None],
                                                               None))]
        return points, [f"step {p.step}" for p in points]
    points = [p for p in report.points if p.step is None]
    return points, [facts.group_of(p.name) for p in points]


def svg(report: Report, width: int = 960, height: int = 380, steps: bool = False) -> str:
    """Error versus depth (the prefill's points), or with ``steps`` error versus decode step (each step's worst
    point): rel_l2, tolerance and noise floor on a log10 axis, a marker per point, red where it fails."""
    points, groups = _depth_points(report, steps)
    calibrated = facts.calibrated(report)
    frame = Frame(width, height, left=60, right=20, top=48, bottom=90).fit(
        [v for p in points if p.compared for v in (p.rel_l2, p.tolerance.rel_l2, p.noise)])
    n = max(len(points), 1)

    def x(i: int) -> float:
        return frame.left + (i + 0.5) * frame.pw / n

    out = frame.open(f"error versus {'decode step' if steps else 'depth'}")
    out += x_labels(frame, [(x(i), g) for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]])
    out.append(f'<text x="{frame.left + frame.pw / 2}" y="{height - 6}" text-anchor="middle">'
               f'{"decode step (its worst point)" if steps else "capture point (forward order)"}</text>')

    def line(values: list[tuple[int, float | None]], color: str, dash: str = "") -> None:
        coords = " ".join(f"{x(i):.1f},{frame.y(v):.1f}" for i, v in values if v is not None)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        if coords:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dashes} points="{coords}"/>')

    compared = [(i, p) for i, p in enumerate(points) if p.compared]
    line([(i, p.tolerance.rel_l2) for i, p in compared], ORANGE, "6 3")
    if calibrated:
        line([(i, p.noise) for i, p in compared], GREY, "2 3")
    line([(i, p.rel_l2) for i, p in compared if math.isfinite(p.rel_l2)], BLUE)
    out += _markers(report, points, frame, x, steps)
    out += legend(frame.left + frame.pw, [("rel_l2", BLUE, ""), ("tolerance", ORANGE, "6 3")] +
                  ([("noise floor", GREY, "2 3")] if calibrated else []))
    out.append("</svg>")
    return "\n".join(out)


def _markers(report: Report, points: list[PointResult], frame: Frame, x, steps: bool) -> list[str]:
    """A marker per point (its numbers on hover), the reason a non-finite run sits on the ceiling, and the first
    divergence's dashed line and name."""
    out = []
    first = report.first_divergence
    n = max(len(points), 1)
    radius = min(4.0, max(1.5, frame.pw / n / 3))
    for i, p in enumerate(points):
        cls, fill, stroke = (("skip", "white", GREY) if not p.compared else
                             ("pass", GREEN, GREEN) if p.passed else ("fail", RED, RED))
        tip = f"{facts.label(p)}: {facts.status(p)}" + (
            f", rel_l2 {facts.sci(p.rel_l2)}, tolerance {facts.sci(p.tolerance.rel_l2)}" if p.compared else "") + (
            f", {p.nonfinite}" if p.nonfinite else "")
        out.append(f'<circle class="marker {cls}" data-point="{escape(facts.label(p))}" cx="{x(i):.1f}" '
                   f'cy="{frame.y(p.rel_l2 if p.compared else None):.1f}" r="{radius:.1f}" fill="{fill}" '
                   f'stroke="{stroke}"><title>{escape(tip)}</title></circle>')
        if p.compared and not math.isfinite(p.rel_l2) and (i == 0 or math.isfinite(points[i - 1].rel_l2)):
            # drawn on the ceiling: say why, once per run
            word = (p.nonfinite or str(p.rel_l2)).split()[0]
            out.append(f'<text x="{x(i):.1f}" y="{frame.top - 4}" text-anchor="middle" style="fill: {RED}">'
                       f'{escape(word)}</text>')
        if first is not None and (p.step == first.step if steps else p is first):
            anchor, dx = ("start", 8) if i < n / 2 else ("end", -8)
            out.append(f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{frame.top}" y2="{frame.floor}" stroke="{RED}" '
                       f'stroke-dasharray="3 3"/>')
            out.append(f'<text class="first-divergence" x="{x(i) + dx:.1f}" y="{frame.top + 14}" '
                       f'text-anchor="{anchor}" style="fill: {RED}">first divergence: '
                       f'{escape(facts.label(first))}</text>')
    return out


# --- the drill-down ---------------------------------------------------------------------------


def ops_svg(report: Report, height: int = 340) -> str:
    """The drill-down's ops in forward order: a bar of rel_l2 per op on a log10 axis (red where it fails), its
    tolerance as a dashed orange mark across its slot, the first diverging op and the op before it named above."""
    rows = facts.drill_rows(report)
    n = max(len(rows), 1)
    frame = Frame(max(420, min(960, 100 + 60 * n)), height, left=60, right=20, top=48, bottom=96).fit(
        [v for p, _ in rows if p.compared for v in (p.rel_l2, p.tolerance.rel_l2)])
    slot = frame.pw / n

    def x(i: int) -> float:
        return frame.left + (i + 0.5) * slot

    layer = f"layers.{(report.drilldown or {}).get('layer')}"
    out = frame.open(f"rel_l2 per op of {layer}")
    out += x_labels(frame, [(x(i), facts.op_label(p.name)) for i, (p, _) in enumerate(rows)])
    out.append(f'<text x="{frame.left + frame.pw / 2:.1f}" y="{height - 6}" text-anchor="middle">'
               f'{escape(layer)}: its ops and layer points (forward order)</text>')
    for i, (p, role) in enumerate(rows):
        cls, fill = ("skip", "white") if not p.compared else ("pass", GREEN) if p.passed else ("fail", RED)
        top = frame.y(p.rel_l2) if p.compared else frame.floor - 2
        tip = f"{p.name}: {facts.status(p)}" + (
            f", rel_l2 {facts.sci(p.rel_l2)}, tolerance {facts.sci(p.tolerance.rel_l2)}" if p.compared else "")
        stroke = ' stroke="#222" stroke-width="2"' if role == "first" else f' stroke="{GREY}"' * (cls == "skip")
        out.append(f'<rect class="op {cls}" data-op="{escape(p.name)}" x="{x(i) - 0.3 * slot:.1f}" y="{top:.1f}" '
                   f'width="{0.6 * slot:.1f}" height="{max(frame.floor - top, 2):.1f}" fill="{fill}"{stroke}>'
                   f'<title>{escape(tip)}</title></rect>')
        if p.compared:
            ty = frame.y(p.tolerance.rel_l2)
            out.append(f'<line x1="{x(i) - 0.45 * slot:.1f}" x2="{x(i) + 0.45 * slot:.1f}" y1="{ty:.1f}" '
                       f'y2="{ty:.1f}" stroke="{ORANGE}" stroke-width="2" stroke-dasharray="4 2"/>')
        if role:
            word, color = ("first diverging", RED) if role == "first" else ("agreed", GREEN)
            out.append(f'<text class="role" x="{x(i):.1f}" y="{max(top - 6, frame.top - 4):.1f}" '
                       f'text-anchor="middle" style="fill: {color}">{word}</text>')
    out += legend(frame.left + frame.pw, [("tolerance", ORANGE, "4 2")])
    out.append("</svg>")
    return "\n".join(out)


def heads_svg(report: Report, height: int = 220) -> str:
    """Each head's share of the first diverging op's squared error, as bars (the carrier red); '' where the op
    has no heads."""
    d = report.drilldown or {}
    heads = (d.get("concentration") or {}).get("heads")
    if not d.get("first") or not heads or not heads.get("shares"):
        return ""
    shares = [s if isinstance(s, (int, float)) and math.isfinite(s) else 0.0 for s in heads["shares"]]
    n = len(shares)
    frame = Frame(max(360, min(960, 80 + 18 * n)), height, left=60, right=20, top=36, bottom=44)
    slot = frame.pw / n
    axis = escape(str(heads.get("axis", "head")))
    out = [f'<svg width="{frame.width}" height="{height}" viewBox="0 0 {frame.width} {height}" role="img" '
           f'aria-label="share of the error by {axis}">',
           f'<text x="{frame.left}" y="16">share of {escape(d["first"])}\'s '
           f'squared error by {axis}</text>']
    for share in (0.0, 0.5, 1.0):
        y = frame.floor - share * frame.ph
        out += [f'<line x1="{frame.left}" x2="{frame.left + frame.pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>',
                f'<text x="{frame.left - 6}" y="{y + 4:.1f}" text-anchor="end">{share:.0%}</text>']
    step = math.ceil(24 / slot)  # index labels at least 24 px apart
    wide = min(0.7 * slot, 36)
    for h, share in enumerate(shares):
        x, bar = frame.left + h * slot, share * frame.ph
        color = RED if h == heads.get("carrier") else BLUE
        out.append(f'<rect class="head" data-head="{h}" x="{x + (slot - wide) / 2:.1f}" y="{frame.floor - bar:.1f}" '
                   f'width="{wide:.1f}" height="{bar:.1f}" fill="{color}"><title>{axis} {h}: {share:.1%}'
                   f'</title></rect>')
        if h == heads.get("carrier"):
            out.append(f'<text x="{x + slot / 2:.1f}" y="{frame.floor - bar - 4:.1f}" text-anchor="middle" '
                       f'style="fill: {RED}">{share:.0%}</text>')
        if h % step == 0:
            out.append(f'<text x="{x + slot / 2:.1f}" y="{frame.floor + 14}" text-anchor="middle">{h}</text>')
    out.append(f'<text x="{frame.left + frame.pw / 2:.1f}" y="{height - 6}" text-anchor="middle">{axis}</text>')
    out.append("</svg>")
    return "\n".join(out)


def drilldown(report: Report) -> str:
    """The drill-down section: how the layer was re-run, its ops' table and plot, where the first diverging op's
    error sits, its heads' shares."""
    if not report.drilldown:
        return ""
    header = "".join(f"<th>{h}</th>" for h in ("op", "rel_l2", "tolerance", "x tolerance", "status", ""))
    rows = []
    for p, role in facts.drill_rows(report):
        cls = ("skip" if not p.compared else "pass" if p.passed else "fail") + (f" {role}" if role else "")
        cells = facts.drill_cells(p)
        rows.append(f'<tr class="{cls}"><td><code>{escape(facts.op_label(p.name))}</code></td>' +
                    "".join(f'<td class="num">{escape(c)}</td>' for c in cells) +
                    f'<td>{escape(facts.status(p))}</td><td>{escape(facts.DRILL_ROLES.get(role, ""))}</td></tr>')
    where = report.drill_keys().where
    return (f'<h2>drill-down: layers.{escape(str(report.drilldown.get("layer")))}</h2>\n'
            f'<p class="how">{escape(facts.drill_heading(report))}</p>\n'
            f'<table class="drill"><thead><tr>{header}</tr></thead><tbody>\n' + "\n".join(rows) +
            "\n</tbody></table>\n" + (ops_svg(report) if rows else "") + "\n" +
            (f'<p class="where"><b>Where the error sits:</b> {escape(where)}</p>\n' if where else "") +
            f"{heads_svg(report)}\n")


# --- the page ---------------------------------------------------------------------------------


def html(report: Report) -> str:
    """One self-contained HTML page: title, mode, verdict, the error-versus-depth plot, the drill-down, the
    table, the sections after it."""
    calibrated = facts.calibrated(report)
    status_cls = "pass" if report else "fail"
    headers = "".join(f"<th>{escape(h)}</th>" for h in facts.headers(report))
    rows = []
    for p, label, status in facts.rows(report):
        cls = "skip" if not p.compared else "pass" if p.passed else "fail"
        cells = "".join(f'<td class="num">{escape(c)}</td>' for c in facts.cells(p, calibrated))
        bar = escape(facts.bar(facts.ratio(p))[0]) if p.compared else ""
        rows.append(f'<tr class="{cls}"><td><code>{escape(label)}</code></td>{cells}'
                    f'<td class="bar">{bar}</td><td class="{cls}">{escape(status)}</td></tr>')
    extras = "".join(f"<h2>{escape(heading)}</h2><ul>" + "".join(f"<li>{escape(i)}</li>" for i in items) + "</ul>"
                     for heading, items in facts.extras(report))
    title = escape(facts.title(report))
    judged = facts.judged(report)
    sentence = facts.drill_sentence(report)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head>\n<body>\n<h1>{title}</h1>\n" +
            (f'<p class="mode"><b>Weights:</b> {escape(judged)}.</p>\n' if judged else "") +
            f'<p class="mode"><b>How the two sides ran:</b> {escape(facts.mode_words(report)[1])}.</p>\n'
            f'<p class="verdict {status_cls}">{escape(facts.verdict(report))}</p>\n' +
            (f'<p class="drill">{escape(sentence)}</p>\n' if sentence else "") +
            f'{svg(report)}\n{svg(report, steps=True) if report.decode else ""}\n{drilldown(report)}'
            f"<h2>every point</h2>\n<table><thead><tr>{headers}</tr></thead><tbody>\n" + "\n".join(rows) +
            f"\n</tbody></table>\n{extras}\n</body></html>\n")
