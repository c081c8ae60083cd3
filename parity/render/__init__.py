"""Render a parity Report: console table, GitHub markdown, one self-contained HTML page (parity.render.page), JUnit
XML, and the files they are written to.

Every format says the same things, in parity.render.facts' words: one row per capture point (rel_l2, tolerance,
noise floor, cosine, max_abs, a bar of rel_l2 / tolerance on a log scale, pass/FAIL), the verdict sentence, the
first diverging op and the drill-down into its layer, the logit metrics, the diagnosis and the warnings. Numbers
are shown with 3 significant digits.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from parity import signals
from parity.errors import ParityError
from parity.render import facts
from parity.render.facts import verdict
from parity.render.page import html
from parity.report import Report

# --- console ----------------------------------------------------------------------------------


def console(report: Report, console: Console, *, per_layer: bool = False) -> None:
    """Print the report as a rich table, then the verdict, the first diverging op and its layer's ops, the logit
    metrics, diagnosis and warnings."""
    # narrower than the reports (which also hold max_abs and the noise value): fits 80 columns
    calibrated = facts.calibrated(report)
    plain = any(p.plain_rel_l2 is not None for p in report.points)  # the reference emulates the engine
    rows = facts.rows(report, per_layer)
    table = Table(title=Text(facts.title(report)), box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False,
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
            s, threshold = facts.bar(facts.ratio(p), width=8)
            bar.append(s[:threshold], style="green")
            bar.append(s[threshold:], style="red" if facts.ratio(p) > 1 else "dim")
        cells = ["-"] * (3 + calibrated + plain) if not p.compared else [
            facts.sci(p.rel_l2), *([facts.sci(p.plain_rel_l2) if p.plain_rel_l2 is not None else "-"] if plain
                                   else []),
            facts.sci(p.tolerance.rel_l2), *([facts.times(p.noise_ratio) if p.noise else "-"] if calibrated else []),
            facts.cos_text(p.cosine)]
        table.add_row(Text(label), *(Text(c) for c in cells), bar, Text(status, style=_style(status)))
    line = facts.judged(report)
    if line:  # the first line: what the candidate's weights are and how they were judged
        console.print(Text(line, style="bold"), soft_wrap=True)
    console.print(table)
    console.print(Text(verdict(report), style="bold green" if report else "bold red"), soft_wrap=True)
    sentence = facts.drill_sentence(report)
    if sentence:
        console.print(Text(sentence, style="bold"), soft_wrap=True)
        _console_drilldown(report, console)
    for heading, lines in facts.extras(report):
        for line in lines:
            console.print(Text(f"{heading}: {line}"), soft_wrap=True)


def _style(status: str) -> str:
    return "bold red" if status.startswith("FAIL") else "green" if status == "pass" else "dim"


def _console_drilldown(report: Report, console: Console) -> None:
    """The first diverging layer's ops, compactly: op, rel_l2, tolerance, x tolerance, status, role."""
    rows = facts.drill_rows(report)
    if not rows:
        return
    table = Table(title=Text(f"drill-down: {facts.drill_heading(report)}"), box=box.SIMPLE_HEAD,
                  title_justify="left", pad_edge=False, collapse_padding=True)
    table.add_column("op", no_wrap=True)
    for h in ("rel_l2", "tolerance", "x tol"):
        table.add_column(h, no_wrap=True, justify="right")
    table.add_column("status", no_wrap=True)
    table.add_column("", no_wrap=True)
    for p, role in rows:
        cells = facts.drill_cells(p)
        table.add_row(Text(facts.op_label(p.name)), *(Text(c) for c in cells),
                      Text(facts.status(p), style=_style(facts.status(p))),
                      Text(facts.DRILL_ROLES.get(role, ""), style="bold red" if role == "first" else ""))
    console.print(table)


# --- markdown ---------------------------------------------------------------------------------


def _md(s: str) -> str:
    return s.replace("|", "\\|")


def markdown(report: Report) -> str:
    """GitHub markdown: title, mode, verdict, the first diverging op, one table row per point, the drill-down's
    table, then the other sections."""
    calibrated = facts.calibrated(report)
    headers = facts.headers(report)
    sentence = facts.drill_sentence(report)
    judged = facts.judged(report)
    lines = [f"## {_md(facts.title(report))}", "", *([f"*Weights:* {_md(judged)}.", ""] if judged else []),
             f"*How the two sides ran:* {_md(facts.mode_words(report)[1])}.", "", f"**{_md(verdict(report))}**", "", *([_md(sentence), ""] if sentence else []),
             "| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if h in ("rel_l2", "tolerance", "max_abs") else "---" for h in headers) + "|"]
    for p, label, status in facts.rows(report):
        bar = facts.bar(facts.ratio(p))[0].rstrip() if p.compared else ""
        status = f"**{status}**" if status == "FAIL" else status
        lines.append("| " + " | ".join([f"`{label}`", *map(_md, facts.cells(p, calibrated)), bar, status]) + " |")
    drill = facts.drill_rows(report)
    if drill:
        lines += ["", f"**drill-down: {_md(facts.drill_heading(report))}**", "",
                  "| op | rel_l2 | tolerance | x tolerance | status | |", "|---|---:|---:|---:|---|---|"]
        for p, role in drill:
            status = facts.status(p)
            lines.append("| " + " | ".join([f"`{facts.op_label(p.name)}`", *facts.drill_cells(p),
                                             f"**{status}**" if status == "FAIL" else status,
                                             facts.DRILL_ROLES.get(role, "")]) + " |")
    for heading, items in facts.extras(report):
        lines += ["", f"**{heading}**", ""] + [f"- {_md(item)}" for item in items]
    return "\n".join(lines) + "\n"


# --- junit ------------------------------------------------------------------------------------


def junit(report: Report) -> str:
    """JUnit XML: one testcase per point; failing points carry <failure>, uncompared ones <skipped/>."""
    classname = f"parity.{report.family}"
    gate = (report.quantization or {}).get("gate")
    failures = sum(p.compared and not p.passed for p in report.points) + bool(report.gate_failed)
    skipped = sum(not p.compared for p in report.points)
    counts = {"tests": str(len(report.points) + bool(gate)), "failures": str(failures), "errors": "0",
              "skipped": str(skipped)}
    root = ET.Element("testsuites", name="parity", **counts)
    suite = ET.SubElement(root, "testsuite", name=classname, **counts)
    for p in report.points:
        case = ET.SubElement(suite, "testcase", classname=classname, name=facts.label(p), time="0")
        if not p.compared:
            ET.SubElement(case, "skipped", message="not compared: the candidate did not provide this point")
        elif not p.passed:
            failure = ET.SubElement(case, "failure", message=facts.why(p, tol_word="tolerance "),
                                    type="ParityMismatch")
            failure.text = (f"rel_l2 {facts.sci(p.rel_l2)} (tolerance {facts.sci(p.tolerance.rel_l2)}, "
                            f"{p.tolerance.source}), cosine {facts.cos_text(p.cosine)}, "
                            f"max_abs {facts.sci(p.max_abs)}, noise {facts.sci(p.noise)}")
    if gate:  # --max-kl / --min-top1: what the quantization costs against the float reference
        case = ET.SubElement(suite, "testcase", classname=classname, name="quantization gate", time="0")
        if report.gate_failed:
            ET.SubElement(case, "failure", message="; ".join(report.gate_failed), type="QuantizationCost")
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
        signals.stop_if_received()  # a signal whose interrupt was caught on the way: never put in place
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
