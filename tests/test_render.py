"""Rendering a Report: JSON keys, JUnit counts, the HTML plot, markdown rows, the console verdict."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

from parity import render
from parity.errors import ParityError
from parity.names import capture_names
from parity.report import PointResult, Report, Tolerance

DESIGN_KEYS = {"parity_report_version", "verdict", "family", "reference", "candidate", "dtype", "mode",
               "points", "first_divergence", "diagnosis", "logits"}
POINT_KEYS = {"name", "max_abs", "rel_l2", "cosine", "tolerance", "passed"}


def point(name, rel_l2=1e-7, *, tol=1e-5, cos=1.0, noise=None, compared=True, nonfinite=None):
    tolerance = Tolerance(rel_l2=tol)
    passed = compared and nonfinite is None and rel_l2 <= tol
    return PointResult(name=name, max_abs=rel_l2 * 10, mean_abs=rel_l2, rel_l2=rel_l2, cosine=cos,
                       tolerance=tolerance, passed=passed, noise=noise, nonfinite=nonfinite, compared=compared)


def make(points, **kw):
    base = dict(family="gemma2", reference={"kind": "transformers", "path": "/m/ref"},
                candidate={"kind": "neutral", "path": "/m/out"}, dtype="float32", mode="free", layerwise=True)
    return Report(points=points, **{**base, **kw})


@pytest.fixture
def passing():
    names = capture_names(6, final_norm=True, logits=True)  # 1 + 36 + 2 = 39 points
    return make([point(n, 1e-7 * (i + 1)) for i, n in enumerate(names)],
                logits={"kl_mean": 1.5e-9, "kl_max": 2.25e-8, "top1_agreement": 1.0, "top5_overlap": 1.0})


@pytest.fixture
def failing():
    names = capture_names(2, final_norm=True, logits=True)
    bad = {"layers.1.attn_out": 0.31, "layers.1.mid": 0.2, "logits": 0.5}
    points = []
    for n in names:
        if n == "layers.0.mlp_out":
            points.append(point(n, compared=False))
        else:
            points.append(point(n, bad.get(n, 2e-6), noise=1e-4 if n == "layers.1.attn_out" else 1e-6))
    return make(points, calibrated=True,
                logits={"kl_mean": 0.0123, "kl_max": 0.5, "top1_agreement": 0.75, "top5_overlap": 0.9,
                        "max_logit_diff": 3.25},
                diagnosis=[{"bug": "sandwich-post-norm-dropped", "confidence": 0.9,
                            "evidence": "attn_out off by <31%> & the norm | is missing"}],
                warnings=["prompt shorter than the sliding window"])


@pytest.fixture
def nonfinite():
    return make([point("embed"), point("layers.0.attn_in", math.nan, cos=math.nan, nonfinite="NaN in candidate"),
                 point("layers.0.attn_out", math.inf, nonfinite="Inf in candidate")])


def failing_names(report):
    return [p.name for p in report.points if p.compared and not p.passed]


# --- JSON and write ---------------------------------------------------------------------------


def test_json_has_design_keys(tmp_path, passing, failing, nonfinite):
    for report, verdict, first in [(passing, "pass", None), (failing, "fail", "layers.1.attn_out"),
                                   (nonfinite, "fail", "layers.0.attn_in")]:
        path = tmp_path / "r.json"
        render.write(report, path)
        data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
        assert DESIGN_KEYS <= data.keys()
        assert data["parity_report_version"] == 1 and data["verdict"] == verdict and data["family"] == "gemma2"
        assert data["reference"] == {"kind": "transformers", "path": "/m/ref"}
        assert data["candidate"]["kind"] == "neutral" and data["dtype"] == "float32" and data["mode"] == "free"
        assert [p["name"] for p in data["points"]] == [p.name for p in report.points]
        assert all(POINT_KEYS <= p.keys() for p in data["points"])
        assert [p["passed"] for p in data["points"]] == [p.passed for p in report.points]
        assert (data["first_divergence"] or {}).get("point") == first
        assert data["logits"] == report.logits and data["diagnosis"] == report.diagnosis
    assert data["points"][1]["rel_l2"] is None and data["points"][1]["nonfinite"] == "NaN in candidate"


def test_write_every_suffix_atomically(tmp_path, failing):
    for suffix, check in [(".json", lambda t: json.loads(t)["verdict"] == "fail"), (".md", lambda t: "| point" in t),
                          (".html", lambda t: t.startswith("<!DOCTYPE html>")),
                          (".xml", lambda t: ET.fromstring(t).tag == "testsuites")]:
        path = tmp_path / "sub" / f"report{suffix}"
        path.parent.mkdir(exist_ok=True)
        path.write_text("old")
        render.write(failing, path)
        assert check(path.read_text())
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == [
        "report.html", "report.json", "report.md", "report.xml"]  # no temporary files left behind


def test_write_unknown_suffix(tmp_path, passing):
    with pytest.raises(ParityError, match=r"use \.json, \.md, \.html or \.xml"):
        render.write(passing, tmp_path / "report.txt")
    assert list(tmp_path.iterdir()) == []


# --- JUnit ------------------------------------------------------------------------------------


def test_junit_counts_and_messages(passing, failing, nonfinite):
    root = ET.fromstring(render.junit(failing))
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [p.name for p in failing.points]
    assert {c.get("classname") for c in cases} == {"parity.gemma2"}
    for node in (root, suite):
        assert (node.get("tests"), node.get("failures"), node.get("skipped")) == (str(len(cases)), "3", "1")
    failed = {c.get("name"): c.find("failure").get("message") for c in cases if c.find("failure") is not None}
    assert list(failed) == failing_names(failing)
    assert failed["layers.1.attn_out"] == "rel_l2 3.10e-01 > tolerance 1.00e-05 (3100x the noise)"
    assert [c.get("name") for c in cases if c.find("skipped") is not None] == ["layers.0.mlp_out"]

    root = ET.fromstring(render.junit(passing))
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("39", "0", "0")

    failed = [c.find("failure").get("message") for c in ET.fromstring(render.junit(nonfinite)).iter("testcase")
              if c.find("failure") is not None]
    assert failed == ["NaN in candidate", "Inf in candidate"]


# --- HTML -------------------------------------------------------------------------------------


def markers(page):
    svg = re.search(r"<svg.*?</svg>", page, re.S).group(0)
    return re.findall(r'<circle class="marker (\w+)" data-point="([^"]+)"[^>]*fill="([^"]+)"', svg)


@pytest.mark.parametrize("name", ["passing", "failing", "nonfinite"])
def test_html_plot(name, request):
    report = request.getfixturevalue(name)
    page = render.html(report)
    found = markers(page)
    assert [m[1] for m in found] == [p.name for p in report.points]  # one marker per point, in order
    assert [m[1] for m in found if m[2] == render.RED] == failing_names(report)  # red exactly where failing
    assert "<script" not in page and "http" not in page and "src=" not in page  # self-contained
    assert page.count("<svg") == 1 and "10<tspan" in page  # powers-of-ten ticks
    first = report.first_divergence
    if first:
        assert f"first divergence: {first.name}" in page
    else:
        assert "first divergence" not in page
    assert ("noise floor" in page) == report.calibrated


def test_html_escapes_text(failing):
    page = render.html(failing)
    assert "attn_out off by &lt;31%&gt; &amp; the norm | is missing" in page
    assert "<31%>" not in page
    assert "FAIL at layers.1.attn_out: rel_l2 3.10e-01 &gt; 1.00e-05 (3100x the noise)" in page


# --- markdown ---------------------------------------------------------------------------------


def test_markdown(failing, passing):
    md = render.markdown(failing)
    row = next(line for line in md.splitlines() if line.startswith("| `layers.1.attn_out`"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1:4] == ["3.10e-01", "1.00e-05", "1.00e-04 (3100x the noise)"]
    assert cells[-1] == "**FAIL**" and "█" in cells[-2]
    assert "| `layers.0.mlp_out` | - |" in md and "not compared" in md
    assert "**FAIL at layers.1.attn_out:" in md
    assert "the norm \\| is missing" in md  # pipes escaped in text
    assert "kl_mean 0.0123" in md and "sandwich-post-norm-dropped (confidence 0.9)" in md
    assert "**PASS: 39 points within tolerance**" in render.markdown(passing)


# --- console ----------------------------------------------------------------------------------


def console_text(report, **kw):
    out = Console(record=True, width=120)
    render.console(report, out, **kw)
    return out.export_text()


def test_console_verdicts(passing, failing, nonfinite):
    assert "PASS: 39 points within tolerance" in console_text(passing)
    text = console_text(failing)
    assert ("FAIL at layers.1.attn_out: rel_l2 3.10e-01 > 1.00e-05 (3100x the noise); "
            "smallest passing tolerance rel_l2=3.10e-01") in text
    assert "not compared" in text and "layers.0.mlp_out" in text
    for expected in ("kl_mean 0.0123", "kl_max 0.5", "top1_agreement 0.75", "top5_overlap 0.9",
                     "max_logit_diff 3.25", "sandwich-post-norm-dropped", "prompt shorter than the sliding window"):
        assert expected in text
    assert "FAIL at layers.0.attn_in: NaN in candidate" in console_text(nonfinite)


def test_console_per_layer(failing):
    text = console_text(failing, per_layer=True)
    table = text.split("FAIL at")[0]
    rows = [line.strip() for line in table.splitlines()
            if line.lstrip().startswith(("embed", "layers.", "final", "logits"))]
    assert [r.split()[0] for r in rows] == ["embed", "layers.0", "layers.1", "final_norm", "logits"]
    layer1 = next(r for r in rows if r.startswith("layers.1"))
    assert "layers.1 (attn_out)" in layer1 and "3.10e-01" in layer1 and "FAIL 2/6" in layer1
    assert next(r for r in rows if r.startswith("layers.0")).split()[-1] == "pass"
    assert "not compared: layers.0.mlp_out" in text


def test_numbers_and_needed_tolerance():
    assert render._e(0.31) == "3.10e-01" and render._times(3100.0) == "3100x" and render._times(3.14159) == "3.14x"
    assert float(render._up(0.31049)) >= 0.31049 and render._up(0.31049) == "3.11e-01"
    # cosine is information: a low cosine within the rel_l2 tolerance passes (rel_l2 bounds it anyway)
    p = point("layers.0.out", 2e-6, cos=0.99, tol=1e-5)
    assert p.passed and render._needed(p) == ""
    both = point("layers.0.out", 0.2, cos=0.95, noise=1e-3)
    assert render._why(both) == "rel_l2 2.00e-01 > 1.00e-05 (200x the noise)"
    assert render._needed(both) == "rel_l2=2.00e-01"


def test_failed_write_leaves_the_old_file(tmp_path, failing, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("old")

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr(render.os, "replace", boom)
    with pytest.raises(OSError):
        render.write(failing, path)
    assert path.read_text() == "old" and list(tmp_path.iterdir()) == [path]


def test_nothing_compared():
    report = make([point("embed", compared=False), point("logits", compared=False)])
    assert report.verdict == "fail" and render.verdict(report) == "FAIL: no capture point was compared"
    assert [m[0] for m in markers(render.html(report))] == ["skip", "skip"]
    assert ET.fromstring(render.junit(report)).get("skipped") == "2"
    assert "FAIL: no capture point was compared" in console_text(report) + render.markdown(report)
    assert "FAIL: no capture point" in console_text(make([]))
