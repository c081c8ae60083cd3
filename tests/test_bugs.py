"""The porting-bug catalog: every id injectable where it applies, detected, and named by the diagnosis."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import parity
from parity.adapter import load_all
from parity.cli import cli, selftest
from parity.diagnosis import bugs
from parity.neutral.converter import convert
from parity.neutral.manifest import load
from tests.design_doc import plain, table

# docs/design.md's "Porting-bug ids" table: `id` | the mistake | families
DESIGN = [(plain(bug_id), mistake, families) for bug_id, mistake, families in table("Porting-bug ids")]
DESIGN_IDS = [bug_id for bug_id, _, _ in DESIGN]
# what the families column's group names mean; listed families are taken as they are
EVERY = list(load_all())
GEMMA = ["gemma", "gemma2", "gemma3", "gemma4"]
ROPE = [f for f in EVERY if f not in ("bert", "gpt2")]
# GPT-NeoX and Phi: LayerNorm and a plain GELU MLP; StableLM, Cohere: LayerNorm and SwiGLU
RMS = [f for f in ROPE if f not in ("gpt_neox", "phi", "stablelm", "cohere", "cohere2")]
GATED = [f for f in ROPE if f not in ("gpt_neox", "phi")]
GROUPS = {"all": EVERY, "all (low-precision runs)": EVERY, "every RMSNorm family": RMS, "all RoPE families": ROPE,
          "all gated-MLP families": GATED, "gemma family": GEMMA, "tied families": ["bert", "gpt2", *GEMMA],
          "families with sliding layers": ["mistral", "gemma2", "gemma3", "gemma4"],
          "all causal LMs": [f for f in EVERY if f != "bert"]}


def _families(column: str) -> list[str]:
    """A families column: families and group names, a group possibly less one family ("all causal LMs but x")."""
    out = []
    for part in column.split(", "):
        group, _, but = part.partition(" but ")
        out += [f for f in GROUPS.get(group, [group]) if f != but]
    return out


# docs/design.md's families column: each bug must apply at least there
DESIGN_FAMILIES = {bug_id: _families(families) for bug_id, _, families in DESIGN}


def test_the_catalog_is_designs_list():
    """docs/design.md's table, in the catalog's order: the 62 prefill mistakes, then the KV-cache ones that only
    decode steps show (issue 14's list)."""
    assert [(b.id, b.mistake) for b in bugs.CATALOG] == [(bug_id, mistake) for bug_id, mistake, _ in DESIGN]
    assert len([b for b in bugs.CATALOG if not b.decode]) == 62
    assert [b.id for b in bugs.CATALOG if b.decode] == ["decode-position-offset", "sliding-window-cache-off-by-one",
                                                        "kv-cache-wrong-layer", "decode-softcap-dropped",
                                                        "longrope-switch-keeps-cache", "kv-heads-order-swapped"]


def test_every_bug_applies_at_least_where_design_says():
    families = bugs.families()
    assert set(DESIGN_FAMILIES) == set(families)
    for bug_id, expected in DESIGN_FAMILIES.items():
        assert set(expected) <= set(EVERY) and set(expected) <= set(families[bug_id]), bug_id
    assert all(families[b.id] for b in bugs.CATALOG)


def test_bugs_command_lists_the_catalog():
    rows = json.loads(CliRunner().invoke(cli, ["bugs", "--json"]).stdout)  # transformers may warn on stderr
    assert [r["id"] for r in rows if r["kind"] == "convention"] == [b.id for b in bugs.CATALOG] == DESIGN_IDS
    assert all(r["mistake"] and r["families"] and r["shows"] for r in rows)


def test_an_inapplicable_bug_exits_2_naming_its_families(tiny_dir, tmp_path):
    convert(tiny_dir("llama"), tmp_path / "n")
    result = CliRunner().invoke(cli, ["check", "--reference", str(tiny_dir("llama")), "--candidate",
                                      str(tmp_path / "n"), "--inject", "norm-offset-dropped"])
    assert result.exit_code == 2
    assert "does not apply" in result.stderr and "gemma, gemma2, gemma3" in result.stderr
    unknown = CliRunner().invoke(cli, ["check", "--reference", str(tiny_dir("llama")), "--candidate",
                                       str(tmp_path / "n"), "--inject", "no-such-bug"])
    assert unknown.exit_code == 2 and "unknown bug id" in unknown.stderr


def test_injection_changes_conventions_not_code(tiny_dir, tmp_path):
    convert(tiny_dir("gemma2"), tmp_path / "n")
    manifest, tensors = load(tmp_path / "n")
    m, t = bugs.inject("attn-softcap-dropped", manifest, tensors)
    assert [att.softcap for _, att in m.attentions()] == [None, None] and m.injected == "attn-softcap-dropped"
    assert manifest.layers[0].attention.softcap == 0.5 and manifest.injected is None  # the original is untouched
    m, t = bugs.inject("norm-offset-dropped", manifest, tensors)
    assert (t["layers.0.attn_norm.weight"] - (tensors["layers.0.attn_norm.weight"] - 1)).abs().max() == 0


@pytest.mark.parametrize("family,bug,first", [
    ("gemma2", "norm-offset-dropped", "layers.0.attn_in"),
    ("gemma2", "attn-softcap-dropped", "layers.0.attn_out"),
    ("gemma2", "final-softcap-dropped", "logits"),
    ("gemma2", "embed-scale-dropped", "embed"),
    ("bert", "post-norm-as-pre-norm", "layers.0.attn_in"),
    ("gpt2", "conv1d-not-transposed", "layers.0.attn_out"),
    ("olmo2", "qk-norm-per-head", "layers.0.attn_out"),
    ("deepseek_v3", "mla-norm-dropped", "layers.0.attn_out"),
    ("qwen2", "sliding-window-ignored", "layers.1.attn_out"),
    ("llama", "rope-permuted", "layers.0.attn_out"),
    ("gpt_neox", "parallel-residual-sequential", "layers.0.mlp_in"),
    ("gpt_neox", "fused-qkv-split-wrong", "layers.0.attn_out"),
    ("phi", "parallel-residual-sequential", "layers.0.mlp_in"),
    ("qwen2_moe", "shared-expert-gate-dropped", "layers.0.mlp_out"),
])
def test_representative_pairs_fail_at_the_right_point_with_the_right_name(family, bug, first, tiny_dir, tmp_path):
    convert(tiny_dir(family), tmp_path / "n")
    report = parity.check(tiny_dir(family), tmp_path / "n", layerwise=True, calibrate=True, inject=bug)
    assert report.verdict == "fail" and report.first_divergence.name == first
    top = report.diagnosis[0]
    assert top["bug"] == bug and top["confidence"] > 0.9
    assert f"({bug})" in top["evidence"] and "the candidate matches" in top["evidence"]


def test_an_uncatalogued_mistake_is_unknown_not_a_wrong_name(tiny_dir, tmp_path):
    convert(tiny_dir("llama"), tmp_path / "n")
    tensors = load_file(tmp_path / "n" / "model.safetensors")
    tensors["layers.0.attn.v.weight"] = tensors["layers.0.attn.v.weight"].flip(0)  # no catalogued bug does this
    save_file(tensors, tmp_path / "n" / "model.safetensors", metadata={"format": "pt"})
    report = parity.check(tiny_dir("llama"), tmp_path / "n", layerwise=True, calibrate=True)
    assert report.verdict == "fail"
    (entry,) = report.diagnosis
    assert entry["bug"] == "unknown" and entry["confidence"] == 0.0
    # the v rows reversed: no hypothesis explains even half of the error, so none is listed as closest
    assert "closest" not in entry["evidence"] and "none of those that apply explains any real share of it" in \
        entry["evidence"]


def test_window_mistake_evidence_points_past_the_window(tiny_dir, tmp_path):
    convert(tiny_dir("gemma2"), tmp_path / "n")
    report = parity.check(tiny_dir("gemma2"), tmp_path / "n", layerwise=True, calibrate=True,
                          inject="sliding-window-ignored")
    assert report.diagnosis[0]["bug"] == "sliding-window-ignored"
    assert "the error starts at position 8" in report.diagnosis[0]["evidence"]  # the window is 8


def test_selftest_matrix_totals():
    """Every applicable (family, bug) pair: all detected, diagnosis right for >= 90% (the rest `unknown`), each
    located at the op it declares, no false alarm on a clean conversion. About a minute on two cores."""
    rows = selftest.run()
    t = selftest.totals(rows)
    assert t.pairs >= 100 and sum(r.bug == "clean" and r.check == "prefill" for r in rows) == len(EVERY)
    assert {r.family for r in rows if r.bug == "clean" and r.check != "prefill"} == set(EVERY) - {"bert"}
    assert t.decode_pairs >= 40 and t.prefill_only_would_catch == 0
    assert t.detected == t.pairs
    assert t.false_alarms == 0
    assert t.diagnosis_accuracy >= 0.9 and t.diagnosed_wrong == 0
    # the drill-down finds every mistake that shows inside a layer where the catalog says it first shows
    assert t.ops_declared >= 100 and t.op_right == t.ops_declared, [
        (r.family, r.bug, r.first_op) for r in rows if r.op_right is False]
    assert {r.bug.partition("=")[0] for r in rows} == {b.id for b in bugs.CATALOG} | {"clean"}
    # a mistake with a size, injected at values besides the catalog's, is named with the value within 5%
    sized = [r for r in rows if "=" in r.bug]
    assert len(sized) == 2 * sum(b.size is not None for b in bugs.CATALOG)
    assert all(r.diagnosis_right for r in sized), [(r.family, r.bug, r.diagnosed, r.value) for r in sized]
    low = [r for r in rows if r.bug == "norm-in-low-precision"]
    assert low and all(r.dtype == "bfloat16" and r.detected for r in low)


def test_a_broken_onnx_export_is_caught_and_named(tiny_dir, tmp_path):
    out = tmp_path / "broken.onnx"
    result = CliRunner().invoke(cli, ["convert", str(tiny_dir("gemma")), "--to", "onnx", "-o", str(out),
                                      "--debug-outputs", "--inject", "embed-scale-dropped"])
    assert result.exit_code == 0, result.output
    report = parity.check(tiny_dir("gemma"), out, layerwise=True, calibrate=True)
    assert report.verdict == "fail" and report.first_divergence.name == "embed"
    assert report.diagnosis[0]["bug"] == "embed-scale-dropped"
    wrong = CliRunner().invoke(cli, ["convert", str(tiny_dir("llama")), "--to", "onnx", "-o", str(tmp_path / "x.onnx"),
                                     "--inject", "embed-scale-dropped"])
    assert wrong.exit_code == 2 and "does not apply" in wrong.stderr and not (tmp_path / "x.onnx").exists()
