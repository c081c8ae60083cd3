"""The drill-down (docs/ops.md): mistakes no catalog entry covers, located to the op and the head where they first
show, on a Hugging Face candidate, a neutral candidate and a GGUF candidate (llama.cpp).

Each mistake is made in layer 1 of a tiny Llama (4 query heads, 2 KV heads, head_dim 16), so that the drill-down
re-runs a layer that is not the first (fed the reference's input to it where the candidate can be fed):
- one KV head's k-projection rows scaled by 1.1: attn.k, kv head 1;
- two gate-projection rows swapped: mlp.gate;
- the attention scores multiplied by 1.05: attn.scores (the neutral manifest's scale; llama.cpp's
  attention.scale key; Gemma 2's query_pre_attn_scalar, by 1.044, for transformers);
- one head's columns of the output projection scaled by 1.1: every op up to attn.context agrees, attn_out
  diverges (the output projection is named).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity.cli import cli

LAYER = 1
DH = 16  # the tiny Llama's head_dim


def _edited(source: Path, out: Path, edit) -> Path:
    """A copy of checkpoint ``source`` with ``edit(tensors)`` applied to its weights."""
    shutil.copytree(source, out)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    edit(tensors)
    save_file(tensors, files[0], metadata={"format": "pt"})
    return out


def _scale_kv_head_k(t):
    w = t[f"model.layers.{LAYER}.self_attn.k_proj.weight"]
    w[DH:2 * DH] *= 1.1


def _swap_gate_rows(t):
    w = t[f"model.layers.{LAYER}.mlp.gate_proj.weight"]
    w[[3, 7]] = w[[7, 3]]


def _scale_o_head(t):
    w = t[f"model.layers.{LAYER}.self_attn.o_proj.weight"]
    w[:, 2 * DH:3 * DH] *= 1.1


MISTAKES = {  # name: (edit, first op, head)
    "k-head": (_scale_kv_head_k, "attn.k", ("kv head", 1)),
    "gate-rows": (_swap_gate_rows, "mlp.gate", None),
    "o-head": (_scale_o_head, "attn_out", None),
}


def _check(reference, candidate, report, *extra):
    result = CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(candidate),
                                      "--report", str(report), "--layerwise", *map(str, extra)],
                                catch_exceptions=False)
    return result, (json.loads(report.read_text()) if report.exists() else None)


def _located(result, report, op: str, head):
    assert result.exit_code == 1, result.output
    first = report["first_divergence"]
    assert first["point"].startswith(f"layers.{LAYER}.")
    assert first["op"] == f"layers.{LAYER}.{op}", (first, report["drilldown"]["summary"])
    drill = report["drilldown"]
    assert drill["layer"] == LAYER and drill["first"] == first["op"]
    ordered = [p["name"] for p in drill["ops"]]
    # every point before the first diverging op agrees, and the op before it is named
    for p in drill["ops"][:ordered.index(first["op"])]:
        assert not p["compared"] or p["passed"], p
    assert first["op_before"] is not None and ordered.index(first["op_before"]) < ordered.index(first["op"])
    if head is not None:
        assert first["head"] is not None and (first["head"]["axis"], first["head"]["index"]) == head, first
        assert first["head"]["share"] > 0.9
    else:
        assert first["head"] is None
    assert first["where"]


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return tiny_dir("llama")


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_located_on_a_transformers_candidate(mistake, llama, tmp_path):
    edit, op, head = MISTAKES[mistake]
    candidate = _edited(llama, tmp_path / "candidate", edit)
    result, report = _check(llama, candidate, tmp_path / "r.json")
    _located(result, report, op, head)
    assert report["drilldown"]["how"] == "re-run" and report["drilldown"]["fed"] == "reference"
    assert report["diagnosis"][0]["bug"] == "unknown"
    assert f"layers.{LAYER}.{op}" in report["diagnosis"][0]["evidence"]


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_located_on_a_neutral_candidate(mistake, llama, tmp_path):
    from parity.neutral.converter import convert

    edit, op, head = MISTAKES[mistake]
    candidate = tmp_path / "neutral"
    convert(_edited(llama, tmp_path / "candidate", edit), candidate)
    result, report = _check(llama, candidate, tmp_path / "r.json")
    _located(result, report, op, head)


def test_every_op_captured_with_points_ops(llama, tmp_path):
    """--points ops compares every op of every layer in the check itself; the drill-down reads them there."""
    candidate = _edited(llama, tmp_path / "candidate", _scale_kv_head_k)
    result, report = _check(llama, candidate, tmp_path / "r.json", "--points", "ops")
    _located(result, report, "attn.k", ("kv head", 1))
    assert report["drilldown"]["how"] == "captured"
    names = {p["name"] for p in report["points"]}
    assert {f"layers.0.attn.{op}" for op in ("q", "k", "v", "q_rope", "k_rope", "scores", "probs", "context")} <= names
    assert all(p["passed"] for p in report["points"] if p["name"].startswith("layers.0."))


def test_scores_scaled_on_a_neutral_candidate(llama, tmp_path):
    from parity.neutral.converter import convert

    candidate = tmp_path / "neutral"
    convert(llama, candidate)
    manifest = json.loads((candidate / "manifest.json").read_text())
    manifest["layers"][LAYER]["attention"]["scale"] *= 1.05
    (candidate / "manifest.json").write_text(json.dumps(manifest))
    result, report = _check(llama, candidate, tmp_path / "r.json")
    _located(result, report, "attn.scores", None)


def test_scores_scaled_on_a_transformers_candidate(tiny_dir, tmp_path):
    """Gemma 2 scales its scores by query_pre_attn_scalar ** -0.5 (an integer in its config): 22 for the tiny
    one's 24 multiplies every score by sqrt(24 / 22) = 1.044 before the softcap, and changes nothing before."""
    reference = tiny_dir("gemma2")
    candidate = tmp_path / "candidate"
    shutil.copytree(reference, candidate)
    config = json.loads((candidate / "config.json").read_text())
    assert config["query_pre_attn_scalar"] == 24
    config["query_pre_attn_scalar"] = 22
    (candidate / "config.json").write_text(json.dumps(config))
    result, report = _check(reference, candidate, tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    first = report["first_divergence"]
    assert first["op"] == "layers.0.attn.scores", report["drilldown"]["summary"]
    assert first["op_before"] == "layers.0.attn.k_rope"


def _gguf(checkpoint: Path, out: Path) -> Path:
    pytest.importorskip("llama_cpp")
    result = CliRunner().invoke(cli, ["convert", str(checkpoint), "--to", "gguf", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_located_on_a_gguf_candidate(mistake, llama, tmp_path):
    """llama.cpp runs its graph whole: the drilled layer runs from each side's own input (the layers before it
    agreed), its ops read from the graph's tensors (parity.engines.gguf.ops)."""
    edit, op, head = MISTAKES[mistake]
    candidate = _gguf(_edited(llama, tmp_path / "candidate", edit), tmp_path / "candidate.gguf")
    result, report = _check(llama, candidate, tmp_path / "r.json")
    _located(result, report, op, head)
    assert report["drilldown"]["fed"] == "own"


def test_scores_scaled_on_a_gguf_candidate(tmp_path):
    """llama.cpp's gemma2 scales scores by head_dim ** -0.5 whatever query_pre_attn_scalar says (Gemma 2 27B's
    144 for a head_dim of 128 was this mistake): against a reference whose query_pre_attn_scalar is 18 for a
    head_dim of 16, the file's scores are sqrt(18 / 16) = 1.06 times the reference's, and nothing before them
    differs. The catalog names it too (attn-scale-wrong, which first shows at attn.scores)."""
    from parity.adapter import load_all
    from parity.reference.tiny import build_model

    reference = tmp_path / "gemma2"
    build_model(load_all()["gemma2"], overrides={"attention_bias": False,
                                                 "query_pre_attn_scalar": 16}).save_pretrained(reference)
    candidate = _gguf(reference, tmp_path / "gemma2.gguf")
    config = json.loads((reference / "config.json").read_text())
    config["query_pre_attn_scalar"] = 18
    (reference / "config.json").write_text(json.dumps(config))
    result, report = _check(reference, candidate, tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    first = report["first_divergence"]
    assert first["op"] == "layers.0.attn.scores" and first["op_before"] == "layers.0.attn.k_rope", first
    assert report["diagnosis"][0]["bug"] == "attn-scale-wrong"


def test_located_in_an_engine_dump_that_stores_ops(llama, tmp_path):
    """A dump that stores operation-level points under their names (docs/dumps.md) is drilled down like any
    candidate: here parity's executor on the broken checkpoint, dumped as an engine would dump itself."""
    from parity.checkpoint import open_checkpoint
    from parity.checkpoint.inputs import select_inputs
    from parity.dumps import write_dump
    from parity.neutral.converter import convert
    from parity.neutral.executor.model import NeutralModel

    neutral = tmp_path / "neutral"
    convert(_edited(llama, tmp_path / "candidate", _scale_kv_head_k), neutral)
    ids = select_inputs(open_checkpoint(llama))[0].ids
    points: dict = {}
    NeutralModel.load(neutral)(ids, on_point=lambda name, t: points.__setitem__(name, t.clone()), ops=True)
    assert "layers.1.attn.k" in points
    dump = write_dump(tmp_path / "dump.safetensors", points, ids[0].tolist())
    result, report = _check(llama, dump, tmp_path / "r.json")
    _located(result, report, "attn.k", ("kv head", 1))
    assert report["drilldown"]["fed"] == "own"


def test_located_in_parity_onnx_export_with_op_outputs(llama, tmp_path):
    """`parity convert --to onnx --op-outputs` makes every op a graph output of its name: onnxruntime's run of
    the broken copy is drilled down to the op and the head."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "candidate.onnx"
    result = CliRunner().invoke(cli, ["convert", str(_edited(llama, tmp_path / "candidate", _scale_kv_head_k)),
                                      "--to", "onnx", "--op-outputs", "-o", str(out)])
    assert result.exit_code == 0, result.output
    result, report = _check(llama, out, tmp_path / "r.json")
    _located(result, report, "attn.k", ("kv head", 1))
    refused = CliRunner().invoke(cli, ["convert", str(llama), "--to", "neutral", "--op-outputs",
                                       "-o", str(tmp_path / "n")])
    assert refused.exit_code == 2 and "--op-outputs" in refused.output
