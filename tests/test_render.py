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
from parity.render import facts as render_facts
from parity.render import page as render_html
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
    assert [m[1] for m in found if m[2] == render_facts.RED] == failing_names(report)  # red exactly where failing
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
    facts = render_facts
    assert facts.sci(0.31) == "3.10e-01" and facts.times(3100.0) == "3100x" and facts.times(3.14159) == "3.14x"
    assert float(facts.sci_up(0.31049)) >= 0.31049 and facts.sci_up(0.31049) == "3.11e-01"
    # cosine is information: a low cosine within the rel_l2 tolerance passes (rel_l2 bounds it anyway)
    p = point("layers.0.out", 2e-6, cos=0.99, tol=1e-5)
    assert p.passed and render_facts.needed(p) == ""
    both = point("layers.0.out", 0.2, cos=0.95, noise=1e-3)
    assert render_facts.why(both) == "rel_l2 2.00e-01 > 1.00e-05 (200x the noise)"
    assert render_facts.needed(both) == "rel_l2=2.00e-01"


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


# --- the drill-down (docs/ops.md) -------------------------------------------------------------

KV_SHARES = [0.004, 0.99, 0.003, 0.003]
WHERE = "kv head 1 carries 99% of the error; at every position (the first carries 13%)"
SUMMARY = f"layers.1.attn.k diverges first; {WHERE}"


def drilldown(layer=1, first="attn.k", before="attn.q", ops=None):
    ops = ops or {"attn.q": 3.1e-7, "attn.k": 2.1e-2, "attn.v": 2.9e-7, "attn.k_rope": 2.1e-2, "attn.scores": 8e-3,
                  "attn.context": 4e-3, "mlp.up": 3e-7}
    return {"layer": layer, "how": "re-run", "fed": "reference",
            "ops": [point(f"layers.{layer}.{k}", v, tol=4.4e-6).to_json() for k, v in ops.items()],
            "first": first and f"layers.{layer}.{first}", "op_before": before and f"layers.{layer}.{before}",
            "concentration": None if first is None else {
                "heads": {"axis": "kv head", "shares": KV_SHARES, "carrier": 1},
                "positions": {"shares": [0.13] * 7 + [0.09], "carrier": None, "first": 0}, "summary": WHERE},
            "summary": f"layer {layer} agrees at every op when run from the reference input: its divergence comes "
                       f"from the layers before it" if first is None else SUMMARY}


@pytest.fixture
def drilled(failing):
    failing.drilldown = drilldown()
    return failing


def test_drilldown_json_round_trip(tmp_path, drilled):
    path = tmp_path / "r.json"
    render.write(drilled, path)
    data = json.loads(path.read_text())
    first = data["first_divergence"]
    assert first["point"] == "layers.1.attn_out"
    assert (first["op"], first["op_before"]) == ("layers.1.attn.k", "layers.1.attn.q")
    assert first["head"] == {"axis": "kv head", "index": 1, "share": 0.99} and first["where"] == SUMMARY
    assert data["drilldown"] == drilled.drilldown
    back = Report.from_json(data)
    assert back.drilldown == drilled.drilldown and back.to_json() == drilled.to_json()
    assert [p.name for p in back.drill_ops()][:2] == ["layers.1.attn.q", "layers.1.attn.k"]
    # ops held as PointResults (as a check may build them) are written as their JSON
    drilled.drilldown = {**drilled.drilldown, "ops": back.drill_ops()}
    assert drilled.to_json()["drilldown"] == data["drilldown"]


def test_reports_without_a_drilldown_read_back(failing, passing):
    data = json.loads(render.WRITERS[".json"](failing))
    assert data["drilldown"] is None
    assert {k: data["first_divergence"][k] for k in ("op", "op_before", "head", "where")} == dict.fromkeys(
        ("op", "op_before", "head", "where"))
    for key in ("op", "op_before", "head", "where"):  # a report written before the drill-down existed
        del data["first_divergence"][key]
    del data["drilldown"]
    back = Report.from_json(data)
    assert back.drilldown is None and back.drill_ops() == [] and render_facts.drill_sentence(back) is None
    assert "first diverging op" not in render.markdown(back) + console_text(back) + render.html(back)
    assert render.html(back).count("<svg") == 1
    assert json.loads(render.WRITERS[".json"](passing))["first_divergence"] is None


@pytest.mark.parametrize("change, message", [
    ({"layer": "1"}, "drilldown.layer"), ({"ops": {}}, "drilldown.ops"), ({"first": 3}, "drilldown.first"),
    ({"how": None}, "drilldown.how"), ({"ops": [{"name": "layers.1.attn.k"}]}, "tolerance"),
    ({"concentration": {"heads": {"axis": "kv head", "shares": KV_SHARES, "carrier": 4}}}, "carrier 4")])
def test_a_malformed_drilldown_is_refused(drilled, change, message):
    data = json.loads(render.WRITERS[".json"](drilled))
    data["drilldown"].update(change)
    with pytest.raises(ParityError, match="malformed field") as info:
        Report.from_json(data, "r.json")
    assert message in str(info.value)


def test_merge_keeps_the_drilldown_of_the_first_divergence():
    from parity.report import merge_slices

    names = capture_names(2, final_norm=True, logits=True)
    bad = {"layers.0.mlp_out", "layers.1.attn_out"}
    points = [point(n, 0.1 if n in bad else 1e-7) for n in names]
    low = make(points[:7], layers={"start": 0, "stop": 1, "of": 2}, drilldown=drilldown(0, "mlp.up", None))
    high = make(points[7:], layers={"start": 1, "stop": 2, "of": 2}, drilldown=drilldown(1))
    for order in ([("a", low), ("b", high)], [("b", high), ("a", low)]):
        merged = merge_slices(order)
        assert merged.first_divergence.name == "layers.0.mlp_out" and merged.drilldown["layer"] == 0
        assert merged.to_json()["first_divergence"]["op"] == "layers.0.mlp.up"
    # the slice that holds the first divergence has no drill-down: none is borrowed from a later one
    low.drilldown = None
    assert merge_slices([("a", low), ("b", high)]).drilldown is None


def test_the_first_diverging_op_in_text(drilled):
    sentence = ("first diverging op: layers.1.attn.k (rel_l2 2.10e-02, 4770x its tolerance); the op before it, "
                f"layers.1.attn.q, agreed (3.10e-07); {WHERE}")
    assert render_facts.drill_sentence(drilled) == sentence
    text = console_text(drilled, per_layer=True)
    assert sentence in " ".join(text.split())
    after = text.split("FAIL at layers.1.attn_out")[1]
    assert after.index("first diverging op") < after.index("drill-down: layers.1, re-run op by op")
    rows = {line.split()[0]: line.split()[1:] for line in after.splitlines()
            if line.strip().startswith(("attn.", "mlp."))}
    assert list(rows) == ["attn.q", "attn.k", "attn.v", "attn.k_rope", "attn.scores", "attn.context", "mlp.up"]
    assert rows["attn.k"] == ["2.10e-02", "4.40e-06", "4770x", "FAIL", "first", "to", "diverge"]
    assert rows["attn.q"][3:5] == ["pass", "the"] and rows["attn.v"][3:] == ["pass"]

    md = render.markdown(drilled)
    assert sentence in md and "**drill-down: layers.1, re-run op by op" in md
    assert "| `attn.k` | 2.10e-02 | 4.40e-06 | 4770x | **FAIL** | first to diverge |" in md
    assert "| `attn.q` | 3.10e-07 | 4.40e-06 | 0.0705x | pass | the last before it: agreed |" in md
    assert md.index(sentence) < md.index("| point |") < md.index("drill-down:")


def test_a_drilldown_where_no_op_diverges(failing):
    failing.drilldown = drilldown(first=None, before=None)
    assert render_facts.drill_sentence(failing) == ("drill-down: layer 1 agrees at every op when run from the "
                                                    "reference input: its divergence comes from the layers before it")
    assert failing.to_json()["first_divergence"]["op"] is None and "<rect class=\"head\"" not in render.html(failing)
    failing.drilldown = {**drilldown(first=None, before=None), "ops": []}
    assert render_facts.drill_sentence(failing) == "drill-down: no op of layers.1 could be read"
    assert '<rect class="op' not in render.html(failing)


def test_a_layer_point_diverges_before_any_op(failing):
    """Every op up to attn.context agrees, attn_out diverges: the output projection (docs/ops.md)."""
    d = drilldown(first="attn_out", before="attn.context",
                  ops={"attn_in": 1e-7, "attn.q": 1e-7, "attn.context": 2e-7, "attn_out": 3e-2, "mlp.up": 1e-2})
    d.update(fed="own", concentration={"heads": None, "positions": {"shares": [0.95, 0.05], "carrier": 0, "first": 0},
                                       "summary": "position 0 of 2 carries 95%"},
             summary="every op before layers.1.attn_out agrees: the output projection diverges")
    failing.drilldown = d
    assert render_facts.drill_sentence(failing) == (
        "layers.1.attn_out diverges before any op of layers.1 does (rel_l2 3.00e-02, 6820x its tolerance); the op "
        "before it, layers.1.attn.context, agreed (2.00e-07); position 0 of 2 carries 95%")
    first = failing.to_json()["first_divergence"]
    assert (first["op"], first["op_before"], first["head"]) == ("layers.1.attn_out", "layers.1.attn.context", None)
    page = render.html(failing)
    assert "each side from its own input to the layer" in page and '<rect class="head"' not in page
    assert re.findall(r'<tr class="([\w ]+)"><td><code>attn_out</code>', page) == ["fail first"]


def test_html_drilldown_section(drilled):
    page = render.html(drilled)
    section = page[page.index("<h2>drill-down: layers.1</h2>"):page.index("<h2>every point</h2>")]
    table = re.search(r'<table class="drill">.*?</table>', section, re.S).group(0)
    ops = re.findall(r'<tr class="([\w ]+)"><td><code>([\w.]+)</code></td>', table)
    assert ops == [("pass before", "attn.q"), ("fail first", "attn.k"), ("pass", "attn.v"), ("fail", "attn.k_rope"),
                   ("fail", "attn.scores"), ("fail", "attn.context"), ("pass", "mlp.up")]
    assert "first to diverge</td>" in table and "4770x" in table and "4.40e-06" in table
    # the ops' plot: a bar per op in forward order, red where it fails, the first one outlined
    bars = re.findall(r'<rect class="op (\w+)" data-op="([\w.]+)"[^>]*fill="([^"]+)"([^>]*)>', section)
    assert [b[1] for b in bars] == [f"layers.1.{name}" for _, name in ops]
    assert [b[2] for b in bars] == [render_facts.RED if "fail" in cls else render_facts.GREEN for cls, _ in ops]
    assert "stroke-width" in bars[1][3] and "first diverging</text>" in section and "agreed</text>" in section
    # the heads' shares, the carrier red, and where the error sits
    heads = re.findall(r'<rect class="head" data-head="(\d+)"[^>]*fill="([^"]+)"', section)
    assert [int(h) for h, _ in heads] == [0, 1, 2, 3]
    assert [h for h, fill in heads if fill == render_facts.RED] == ["1"]
    assert f"sits:</b> {SUMMARY}" in section and "by kv head" in section
    assert page.count("<svg") == 3 and "<script" not in page and "http" not in page
    # the first diverging op under the verdict, before the plots
    assert page.index("first diverging op: layers.1.attn.k") < page.index("<svg")


@pytest.mark.parametrize("mode, fed, words", [
    ("free", None, "each side runs the whole model on its own outputs"),
    ("isolated", None, "each candidate layer is fed the reference&#x27;s input to that layer"),
    ("isolated", True, "each reference layer is fed the candidate&#x27;s input")])
def test_the_mode_in_words(failing, mode, fed, words):
    failing.mode = mode
    if fed:
        failing.reference = {**failing.reference, "fed": True}
    page = render.html(failing)
    short = render_facts.mode_words(failing)[0].replace("'", "&#x27;")
    assert f"<h1>parity gemma2: neutral /m/out vs transformers /m/ref (float32, {short})</h1>" in page
    assert words in re.search(r'<p class="mode"><b>How the two sides ran:</b> (.*?)</p>', page).group(1)
    assert not re.search(r"\bfree\b", page) and "(float32, isolated)" not in page
    assert short.replace("&#x27;", "'") in " ".join(console_text(failing).split())  # the title may wrap
    assert words.replace("&#x27;", "'") in render.markdown(failing)


def x_labels(page):
    svg = re.search(r"<svg.*?</svg>", page, re.S).group(0)
    return [(float(x), name, angle) for x, angle, name in re.findall(
        r'<text class="x-label" x="([\d.]+)" [^>]*transform="rotate\((-?\d+) [^"]*"[^>]*>([^<]+)</text>', svg)]


@pytest.mark.parametrize("layers", [1, 2, 12, 32, 80])
def test_axis_labels_do_not_overlap(layers):
    """Rotated -45 degrees, labels LABEL_GAP px apart along the axis are apart across their text too."""
    report = make([point(n) for n in capture_names(layers, final_norm=True, logits=True)])
    labels = x_labels(render.html(report))
    xs = [x for x, _, _ in labels]
    assert all(b - a >= render_html.LABEL_GAP for a, b in zip(xs, xs[1:])), labels
    assert {angle for _, _, angle in labels} == {str(render_html.LABEL_ANGLE)}
    assert render_html.LABEL_GAP * math.sin(math.radians(-render_html.LABEL_ANGLE)) > 14  # over a line of 11 px
    assert labels[0][1] == "embed" and labels[-1][1] == "logits"
    assert layers > 12 or [n for _, n, _ in labels if n.startswith("layers.")][-1] == f"layers.{layers - 1}"


def test_spaced_keeps_the_last_label():
    ticks = [(0, "embed"), (10, "layers.0"), (40, "layers.1"), (70, "final_norm"), (80, "logits")]
    assert render_html.spaced(ticks, gap=26) == [(0, "embed"), (40, "layers.1"), (80, "logits")]
    assert render_html.spaced([(0, "a"), (5, "b")], gap=26) == [(5, "b")]
    assert render_html.spaced([]) == []
