"""Quantized ONNX files that parity did not write (issue 34): a tiny BERT and a tiny Llama exported by torch.onnx
inside a wrapper module and quantized by onnxruntime's own tools (tests/onnx_foreign.py), read back with
--same-weights by what the graph computes (parity/engines/onnx/weights.py: each weight placed by its name under the
wrapper's prefix, or by the module path of the node that reads it) and judged at onnxruntime's CPU arithmetic.

On this machine (x86 with AVX2, no VNNI: onnxruntime's u8 x s8 kernels add products in saturating int16 pairs,
which the reference emulates) every projection equals onnxruntime's bit for bit, and every layer output is within
float32 noise (1.4e-7 at worst) where the plain reference is 1e-2 away."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from parity.checkpoint import open_checkpoint
from parity.cli import cli
from tests import onnx_foreign

pytest.importorskip("onnxruntime.quantization")

FAMILIES = ("bert", "llama")


@pytest.fixture(scope="module")
def foreign(tiny_dir, tmp_path_factory):
    """foreign(family, mode) -> (checkpoint, the quantized third-party graph); the exports made once, in workers."""
    root = tmp_path_factory.mktemp("onnx-foreign")
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:  # fork: torch's threads
        floats = {f: pool.submit(onnx_foreign.export, str(tiny_dir(f)), str(root / f"{f}.onnx")) for f in FAMILIES}
        floats = {f: job.result() for f, job in floats.items()}
    made = {}

    def get(family: str, mode: str, only_matmuls: bool = True):
        key = (family, mode, only_matmuls)
        if key not in made:
            made[key] = onnx_foreign.quantize(floats[family], str(root / f"{family}-{mode}-{only_matmuls}.onnx"),
                                              mode, only_matmuls)
        return tiny_dir(family), made[key]
    return get


def _check(ckpt, candidate, report, *extra):
    result = CliRunner().invoke(cli, ["check", "--reference", str(ckpt), "--candidate", str(candidate),
                                      "--layerwise", "--same-weights", "--calibrate", "--report", str(report),
                                      *extra], catch_exceptions=False)
    return result, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.parametrize("mode", onnx_foreign.MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_third_party_quantized_export_passes(foreign, tmp_path, family, mode):
    ckpt, candidate = foreign(family, mode)
    names = [i.name for i in onnx.load(candidate).graph.initializer]
    assert any(n.startswith("inner.") for n in names) and any(n.startswith("onnx::MatMul_") for n in names)
    result, report = _check(ckpt, candidate, tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    points = {p["name"]: p for p in report["points"]}
    layers = open_checkpoint(ckpt).resolved.num_layers
    assert all(points[f"layers.{i}.{p}"]["compared"] for i in range(layers) for p in ("attn_out", "mid", "out"))
    held = report["reference"]["same_weights"]
    assert held["not_a_quantization"] == {}
    assert set(held["types"]) >= {"float", "int4" if mode == "int4" else "int8"}
    if family == "bert":  # the encoder's graph has no MLM head: the reference keeps the checkpoint's
        assert held["not_in_file"] and all(n.startswith("cls.") for n in held["not_in_file"])
        assert any("not in the candidate's file (cls." in w for w in report["warnings"])
    worst = max(p["rel_l2"] for p in report["points"] if p["compared"])
    last = points[f"layers.{layers - 1}.out"]
    plain = last.get("rel_l2_plain") or float("nan")  # int4: one reference
    print(f"\n| {family}, {mode} | {last['rel_l2']:.2e} / {plain:.2e} | {worst:.2e} |")
    assert worst < 2e-6, points
    if mode != "int4":  # onnxruntime rounds activations: the emulation is what makes it float32 noise
        assert last["rel_l2_plain"] > 1e-3 and last["rel_l2_plain"] > 1000 * max(last["rel_l2"], 1e-9)
        assert report["reference"]["arithmetic"]["engine"] == "onnxruntime (CPU)"


@pytest.mark.parametrize("family", FAMILIES)
def test_one_layers_int8_weights_taken_from_another_layer_fail_at_that_layer(foreign, tmp_path, family):
    """Layer 1's first projection computing with layer 0's int8 weights (its scale too): a plausible quantization,
    of the wrong tensor. Placed by the module path of the node that reads it, it is judged against layer 1's."""
    ckpt, candidate = foreign(family, "int8-dynamic")
    scope = "/layer.{}/attention/self/query/" if family == "bert" else "/layers.{}/self_attn/q_proj/"
    onnx_foreign.copy_weights(candidate, str(tmp_path / "swapped.onnx"), scope)
    result, report = _check(ckpt, tmp_path / "swapped.onnx", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert report["first_divergence"]["point"].startswith("layers.1."), report["first_divergence"]
    assert all(p["rel_l2"] < 2e-6 for p in report["points"] if p["name"].startswith("layers.0."))
    wrong = report["reference"]["same_weights"]["not_a_quantization"]
    assert list(wrong) == [f"{'bert.encoder.layer' if family == 'bert' else 'model.layers'}.1."
                           f"{'attention.self.query' if family == 'bert' else 'self_attn.q_proj'}.weight"]
    assert 0.5 < wrong[next(iter(wrong))] < 2  # another Gaussian tensor: rel_l2 about sqrt(2)


def test_a_graph_whose_rounding_the_reference_cannot_follow_is_refused(foreign, tmp_path):
    """quantize_static of every op it can quantize: the QOperator graph computes with QLinearAdd, QLinearMul...
    and the QDQ one rounds attention's own matmuls' inputs. Refused in one line (exit 2), not judged wrongly."""
    for mode, says in (("qoperator", "QLinear"), ("qdq", "Q/DQ pair")):
        ckpt, candidate = foreign("llama", mode, only_matmuls=False)
        result, _ = _check(ckpt, candidate, tmp_path / f"{mode}.json")
        assert result.exit_code == 2 and says in result.output, result.output


def test_weights_are_placed_by_name_under_a_prefix_or_by_their_readers_module_path(foreign):
    from parity.engines.onnx.weights import PROJECTIONS, _Graph, _matmul, _Places

    ckpt, candidate = foreign("bert", "qoperator")
    g = _Graph(candidate)
    places = _Places(open_checkpoint(ckpt))
    # by name: the wrapper's "inner." where the checkpoint has "bert."
    assert places.of("inner.encoder.layer.1.output.LayerNorm.weight").hf == \
        "bert.encoder.layer.1.output.LayerNorm.weight"
    # by the reading node: an anonymous initializer, and the quantizer's suffix, of a QLinearMatMul
    node = next(n for n in g.nodes if n.op_type == "QLinearMatMul" and "/layer.1/intermediate/dense/" in n.name)
    weight = _matmul(g, node).init
    assert weight.startswith("onnx::MatMul_") and "QLinearMatMul" in PROJECTIONS
    assert places.of(weight, node).hf == "bert.encoder.layer.1.intermediate.dense.weight"
    assert places.of("onnx::Mul_7") is None  # a constant of the graph, no tensor of the checkpoint
    assert np.array_equal(g.values[weight].shape, (64, 128))


def test_saturated_pairs_are_summed_as_vpmaddubsw_sums_them():
    """The sparse emulation against the kernel's arithmetic written out: every adjacent pair of u8 x s8 products
    saturated to int16, the pairs summed. Weights as large as int8 goes, so that many pairs saturate."""
    import torch

    from parity.engines.onnx.arithmetic import saturated_pairs

    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (3, 5, 33), generator=g).double()  # an odd K: the kernel pads it with a zero
    w = torch.randint(-128, 128, (7, 33), generator=g).double()
    padded_a, padded_w = torch.nn.functional.pad(a, (0, 1)), torch.nn.functional.pad(w, (0, 1))
    products = padded_a[..., None, :] * padded_w  # [3, 5, 7, 34]
    written_out = (products[..., 0::2] + products[..., 1::2]).clamp(-32768, 32767).sum(-1)
    assert torch.equal(saturated_pairs(a, w), written_out)
    assert not torch.equal(a @ w.T, written_out)  # some pairs did saturate
