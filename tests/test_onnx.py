"""ONNX: `parity convert --to onnx`, and ONNX files as `parity check` candidates.

Exports are made once per module, two at a time in worker processes (torch.onnx spends ~5-15 s
per tiny model tracing, on one core): every family's executor in float32 and float16 with debug
outputs, and torch.onnx exports made straight from the transformers models.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper as nh
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

import parity
from parity.checkpoint import open_checkpoint
from parity.cli import cli
from parity.engines.onnx import export as onnx_export
from parity.engines.onnx import graph as onnx_graph
from parity.neutral.converter import convert
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load
from tests import onnx_helpers
from tests.conftest import FAMILIES

FOREIGN = ["llama", "qwen3", "gemma2", "bert"]


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    """exported(family, dtype) -> our export with debug outputs; exported(family, "foreign") -> torch.onnx's."""
    root = tmp_path_factory.mktemp("onnx")
    jobs = [(f, d) for d in ("float32", "float16") for f in FAMILIES] + [(f, "foreign") for f in FOREIGN]
    sources = {f: str(tiny_dir(f)) for f in FAMILIES}  # built here, before the workers read them
    pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    futures = {}
    for family, kind in jobs:
        out = str(root / f"{family}-{kind}.onnx")
        futures[family, kind] = (pool.submit(onnx_helpers.export_foreign, sources[family], out) if kind == "foreign"
                                 else pool.submit(onnx_helpers.export_ours, sources[family], out, kind))
    yield lambda family, kind="float32": Path(futures[family, kind].result())
    pool.shutdown(cancel_futures=True)


def _check(reference, candidate, **kwargs):
    return parity.check(reference, candidate, layerwise=True, **kwargs)


# --------------------------------------------------------------------------------------------
# Our exports


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_exported_with_debug_outputs_passes_in_float32(family, tiny_dir, exported):
    report = _check(tiny_dir(family), exported(family))
    assert report.verdict == "pass", report.first_divergence
    assert report.candidate["kind"] == "onnx"
    assert all(p.compared for p in report.points) and len(report.points) >= 9
    worst = max(report.points, key=lambda p: p.rel_l2)
    assert worst.rel_l2 <= 1e-5, f"{family}: {worst.name} rel_l2 {worst.rel_l2:.3g}"
    assert {m["how"] for m in report.matching["points"].values()} == {"debug output"}
    assert report.matching["unmatched"] == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_exported_in_float16_passes_with_calibration(family, tiny_dir, exported):
    report = _check(tiny_dir(family), exported(family, "float16"), dtype="float16", calibrate=True)
    assert report.verdict == "pass", report.first_divergence
    assert all(p.compared and p.tolerance.source.startswith("calibrated") for p in report.points)
    # ONNX Runtime in float16 is as far from the float32 reference as transformers itself gets in float16
    assert max(p.rel_l2 / p.noise for p in report.points if p.noise) < 3
    assert not report.warnings


def test_the_exported_file(tiny_dir, exported, tmp_path):
    path = exported("bert")
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    meta = {p.key: p.value for p in model.metadata_props}
    manifest = json.loads(meta["parity.neutral.manifest"])
    assert meta["parity.format"] == "parity-onnx" and manifest["source"]["family"] == "bert"
    assert "model.safetensors" in manifest["source"]["files"]
    assert all(len(h) == 64 for h in manifest["source"]["files"].values())  # sha256 of every source file
    assert manifest["layers"][0]["norms"]["attn_res_norm"]["eps"] == 1e-12
    outputs = [o.name for o in model.graph.output]
    assert outputs == ["logits"] + [p for p in manifest["capture_points"] if p != "logits"]
    assert json.loads(meta["parity.capture_points"]) == outputs[1:]
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs == {"input_ids": ["batch", "sequence"], "token_type_ids": ["batch", "sequence"]}
    assert "layers.0.attn_res_norm.weight" in {i.name for i in model.graph.initializer}

    # dynamic batch and sequence: another shape than the one traced, against the executor
    ids = np.array([[5, 9, 2, 44, 7, 100, 3], [1, 2, 3, 4, 5, 6, 7]], dtype=np.int64)
    types = np.array([[0, 0, 0, 1, 1, 1, 1], [0] * 7], dtype=np.int64)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = dict(zip(outputs, session.run(None, {"input_ids": ids, "token_type_ids": types})))
    neutral = tmp_path / "bert.neutral"
    convert(tiny_dir("bert"), neutral)
    seen = {}
    want = NeutralModel(*load(neutral))(torch.tensor(ids), on_point=seen.setdefault, token_types=torch.tensor(types))
    assert got["logits"].shape == (2, 7, manifest["vocab_size"])
    np.testing.assert_allclose(got["logits"], want.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["layers.1.mid"], seen["layers.1.mid"].numpy(), rtol=1e-4, atol=1e-5)


def test_norms_compute_in_float32_inside_a_float16_graph(exported):
    model = onnx.shape_inference.infer_shapes(onnx.load(str(exported("gemma2", "float16"))))
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    means = [n for n in model.graph.node if n.op_type == "ReduceMean"]
    assert means and all(types[n.input[0]] == onnx.TensorProto.FLOAT for n in means)
    assert types["layers.0.attn_in"] == onnx.TensorProto.FLOAT16 and types["logits"] == onnx.TensorProto.FLOAT16
    # gemma's `1 + w` is folded into the stored weight (in float32, then cast), and the softcaps are ops
    assert sum(n.op_type == "Tanh" for n in model.graph.node) >= 3  # two attention softcaps and the final one


def test_the_cli_convert_is_atomic_and_external_data_is_used_past_the_limit(tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "out" / "gpt2.onnx"
    # a tiny limit stands in for the 2 GB one: the weights go to external data beside the file
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    result = CliRunner().invoke(cli, ["convert", str(tiny_dir("gpt2")), "--to", "onnx", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpt2.onnx", "gpt2.onnx.data"]
    onnx.checker.check_model(str(out), full_check=True)
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])

    # without debug outputs the points are found by structure (the executor's LayerNorm ops), and the
    # matched values are added as outputs of a graph whose weights are external data
    report = _check(tiny_dir("gpt2"), out)
    assert report.verdict == "pass" and all(p.compared for p in report.points)
    assert report.matching["points"]["layers.1.attn_in"]["how"].startswith("structure: norm 3 of 5")

    again = CliRunner().invoke(cli, ["convert", str(tiny_dir("gpt2")), "--to", "onnx", "-o", str(out)])
    assert again.exit_code == 2 and "already exists" in again.stderr

    def broken(*args, **kwargs):
        raise RuntimeError("the exporter gave up")

    monkeypatch.setattr(onnx_export, "_torch_export", broken)
    failed = CliRunner().invoke(cli, ["convert", str(tiny_dir("gpt2")), "--to", "onnx", "-o", str(tmp_path / "x.onnx")])
    assert failed.exit_code != 0 and not any(p.name.startswith((".x.onnx", "x.onnx")) for p in tmp_path.iterdir())
    for args, message in [(["--dtype", "bfloat16"], "float32, float16"), (["--opset", "12"], "opsets 18 to 23"),
                          (["--rope-style", "interleaved"], "--rope-style applies to --to neutral")]:
        bad = CliRunner().invoke(cli, ["convert", str(tiny_dir("gpt2")), "--to", "onnx", "-o",
                                       str(tmp_path / "y.onnx"), *args])
        assert bad.exit_code == 2 and message in bad.stderr, bad.output
    assert not (tmp_path / "y.onnx").exists()


def test_a_broken_export_fails_at_the_right_point(tiny_dir, exported, tmp_path):
    for family, weight, first in [("llama", "layers.1.attn_norm.weight", "layers.1.attn_in"),
                                  ("gemma2", "layers.0.attn_post_norm.weight", "layers.0.attn_out")]:
        model = onnx.load(str(exported(family)))
        (init,) = [i for i in model.graph.initializer if i.name == weight]
        init.CopyFrom(nh.from_array(nh.to_array(init) * 1.5, weight))
        broken = tmp_path / f"{family}-broken.onnx"
        onnx.save(model, str(broken))
        report_path = tmp_path / f"{family}.json"
        result = CliRunner().invoke(cli, ["check", "--reference", str(tiny_dir(family)), "--candidate", str(broken),
                                          "--layerwise", "--report", str(report_path)])
        assert result.exit_code == 1, result.output
        data = json.loads(report_path.read_text())
        assert data["first_divergence"]["point"] == first and data["verdict"] == "fail"
        assert data["candidate"]["kind"] == "onnx" and data["matching"]["points"][first]["how"] == "debug output"
        assert all(p["passed"] for p in data["points"][: [p["name"] for p in data["points"]].index(first)])


def test_generation_and_a_final_only_check(tiny_dir, exported):
    report = parity.check(tiny_dir("qwen2"), exported("qwen2"), generate=4)
    assert [p.name for p in report.points] == ["logits"] and report.verdict == "pass"
    gen = report.logits["generate"]
    assert gen["first_difference"] is None and gen["reference"] == gen["candidate"]


def test_onnx_options_and_refusals(tiny_dir, exported, tmp_path):
    ref, cand = str(tiny_dir("llama")), str(exported("llama"))

    def run(*args):
        return CliRunner().invoke(cli, ["check", "--reference", ref, "--candidate", cand, *args])

    report = tmp_path / "iso.json"  # a graph cannot be fed: the reference follows it, layer by layer
    isolated = run("--layerwise", "--isolate", "--report", str(report))
    assert isolated.exit_code == 0, isolated.output
    assert json.loads(report.read_text())["reference"]["fed"] == "the candidate's input to each layer"
    provider = run("--provider", "NoSuchProvider")
    assert provider.exit_code == 2 and "CPUExecutionProvider" in provider.stderr
    assert run("--provider", "cpu", "--layerwise").exit_code == 0
    for spec, message in [("layers.0.out", "expected POINT=VALUE"), ("layers.9.out=x", "not a capture point"),
                          ("layers.0.out=no_such_value", "no value named 'no_such_value'")]:
        bad = run("--map", spec)
        assert bad.exit_code == 2 and message in bad.stderr, bad.stderr
    neutral = CliRunner().invoke(cli, ["check", "--reference", ref, "--candidate", ref, "--map", "embed=x"])
    assert neutral.exit_code == 2 and "apply to graph candidates (onnx" in neutral.stderr
    float16 = parity.check(ref, exported("llama", "float16"))
    assert any("computes in float16 but --dtype is float32" in w for w in float16.warnings)


# --------------------------------------------------------------------------------------------
# ONNX made elsewhere


def _strip_module_paths(src: Path, dst: Path) -> Path:
    """The same graph with no trace of the modules it came from: nodes named n0, n1, ..., no metadata."""
    model = onnx.load(str(src))
    for k, node in enumerate(model.graph.node):
        del node.metadata_props[:]
        node.name = f"n{k}"
    onnx.save(model, str(dst))
    return dst


@pytest.mark.parametrize("family", FOREIGN)
def test_a_torch_onnx_export_of_the_transformers_model_is_matched_by_module_path(family, tiny_dir, exported):
    report = _check(tiny_dir(family), exported(family, "foreign"))
    assert report.verdict == "pass", report.first_divergence
    layers = open_checkpoint(tiny_dir(family)).resolved.num_layers
    matched = report.matching["points"]
    outs = [f"layers.{i}.out" for i in range(layers)]
    assert all(matched[p]["how"].startswith("module path") for p in outs)
    assert sorted(matched) == sorted(p.name for p in report.points)  # every point found
    assert all(p.compared for p in report.points) and max(p.rel_l2 for p in report.points) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_without_module_paths_points_are_found_by_structure(family, tiny_dir, exported, tmp_path):
    bare = _strip_module_paths(exported(family, "foreign"), tmp_path / "bare.onnx")
    report = _check(tiny_dir(family), bare)
    assert report.verdict == "pass" and all(p.compared for p in report.points)
    how = {p: m["how"] for p, m in report.matching["points"].items()}
    assert how["logits"] == "final output"
    assert all(h.startswith("structure") for p, h in how.items() if p != "logits")
    if family == "bert":  # Post-Norm: the LayerNorm after each residual add
        assert how["layers.0.mid"] == "structure: norm 2 of 6 (LayerNormalization) is layers.0.attn_res_norm"
        assert how["layers.0.attn_in"] == "structure: the layer's input (embed), no attention pre-norm"
    else:
        assert how["layers.1.attn_out"] == "structure: the residual add layers.0.out + layers.1.attn_out"


def test_with_nothing_matched_the_final_output_is_still_compared_and_map_names_values(tiny_dir, exported,
                                                                                        tmp_path, monkeypatch):
    bare = _strip_module_paths(exported("llama", "foreign"), tmp_path / "bare.onnx")
    monkeypatch.setattr(onnx_graph, "find_norms", lambda g: [])  # a graph whose norms are not recognised
    report = _check(tiny_dir("llama"), bare)
    assert report.verdict == "pass"
    assert [p.name for p in report.points if p.compared] == ["logits"]
    assert any("no capture point of the ONNX graph could be matched beyond the final output" in w
               for w in report.warnings)
    assert "no norm op of hidden width found" in report.matching["unmatched"]["layers.0.out"]

    # --map names a value: the residual add leaving layer 0, as the module path found it in the full graph
    value = _check(tiny_dir("llama"), exported("llama", "foreign")).matching["points"]["layers.0.out"]["value"]
    path = tmp_path / "r.json"
    result = CliRunner().invoke(cli, ["check", "--reference", str(tiny_dir("llama")), "--candidate", str(bare),
                                      "--layerwise", "--map", f"layers.0.out={value}", "--report", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["matching"]["points"]["layers.0.out"] == {"value": value, "how": "--map"}
    assert [p["name"] for p in data["points"] if p["compared"]] == ["layers.0.out", "logits"]


def test_a_broken_torch_onnx_export_fails_at_the_right_point(tiny_dir, exported, tmp_path):
    model = onnx.load(str(exported("llama", "foreign")))
    name = "model.layers.1.post_attention_layernorm.weight"
    (init,) = [i for i in model.graph.initializer if i.name == name]
    init.CopyFrom(nh.from_array(nh.to_array(init) * 1.5, name))
    onnx.save(model, str(tmp_path / "broken.onnx"))
    report = _check(tiny_dir("llama"), tmp_path / "broken.onnx")
    assert report.exit_code == 1 and report.first_divergence.name == "layers.1.mlp_in"


def test_onnxruntime_genai_model_builder(tiny_dir, tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install onnxruntime-genai)")
    out = tmp_path / "genai"
    build = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", "tiny-llama", "-i",
                            str(tiny_dir("llama")), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c",
                            str(tmp_path / "cache")], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    # a directory with model.onnx (+ external data), inputs with an empty KV cache, fused norms and attention
    report = _check(tiny_dir("llama"), out)
    assert report.verdict == "pass", report.first_divergence
    matched = report.matching["points"]
    assert {"embed", "layers.0.attn_in", "layers.0.out", "layers.1.mid", "final_norm", "logits"} <= set(matched)
    assert "SkipSimplifiedLayerNormalization" in matched["layers.0.out"]["how"]
    assert all(p.rel_l2 <= 1e-5 for p in report.points if p.compared)
    # --decode: the prompt, then 32 steps, each fed the present.* the step before returned as past_key_values.*
    decoded = _check(tiny_dir("llama"), out, decode=32)
    steps = [p for p in decoded.points if p.step is not None]
    assert decoded.verdict == "pass", decoded.first_divergence
    assert {p.step for p in steps} == set(range(1, 33)) and sum(p.compared for p in steps) == 32 * len(matched)
    assert all(p.rel_l2 <= 1e-5 for p in steps if p.compared) and decoded.decode["top1_agreement"] == 1.0


OPTIMUM_PIP_ERROR = ("pip install optimum-onnx: ERROR: ResolutionImpossible: optimum-onnx 0.1.0 (the newest) depends "
                     "on transformers<4.58.0 and >=4.36, parity on transformers>=5")


def test_optimum_onnx_export(tiny_dir, tmp_path):
    try:
        from optimum.exporters.onnx import main_export
    except ImportError:
        pytest.skip(OPTIMUM_PIP_ERROR)
    main_export(str(tiny_dir("llama")), output=tmp_path / "optimum", task="text-generation", no_post_process=True)
    report = _check(tiny_dir("llama"), tmp_path / "optimum" / "model.onnx")
    assert report.verdict == "pass" and report.matching["points"]["layers.0.out"]
    shutil.rmtree(tmp_path / "optimum")
