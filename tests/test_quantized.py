"""A quantized candidate checked the way its user means it, with no flag (parity/checker/judging.py): the port judged
at its own weights and arithmetic, the quantization's cost against the float reference reported beside it and
gated on request (--max-kl, --min-top1), the choice said on the first line and in the report; a float candidate
checked as it always was; an unknown diagnosis that lists no "closest" mistake explaining none of the error."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests.conftest import ADAPTERS

pytest.importorskip("onnxruntime.quantization")


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _check(reference, candidate, report, *extra):
    result = _cli("check", "--reference", reference, "--candidate", candidate, "--layerwise", "--report", report,
                  *extra)
    return result, json.loads(report.read_text()) if report.is_file() else None


@pytest.fixture(scope="module")
def onnx_int8(tmp_path_factory):
    """made(inject=None): a tiny Llama and its export quantized by onnxruntime's quantize_dynamic (int8 weights,
    activations quantized at run time), correct or with a catalogued mistake in the export."""
    from parity.engines.onnx.quantize import _default_ids, quantize_graph
    from parity.reference.tiny import build_model

    root = tmp_path_factory.mktemp("quantized-onnx")
    build_model(ADAPTERS["llama"]).save_pretrained(root / "llama")
    made = {}

    def get(inject: str | None = None):
        if inject not in made:
            out = root / f"{inject or 'correct'}.onnx"
            if inject is None:
                result = _cli("convert", root / "llama", "--to", "onnx", "-o", out, "--onnx-quant", "int8-dynamic",
                              "--debug-outputs")
                assert result.exit_code == 0, result.output
            else:
                plain = root / f"{inject}-float.onnx"
                result = _cli("convert", root / "llama", "--to", "onnx", "-o", plain, "--debug-outputs", "--inject",
                              inject)
                assert result.exit_code == 0, result.output
                quantize_graph(plain, out, "int8-dynamic", _default_ids(root / "llama", ()))
            made[inject] = out
        return root / "llama", made[inject]

    return get


def test_a_correct_int8_export_passes_with_no_flag_and_its_cost_is_reported(onnx_int8, tmp_path):
    reference, candidate = onnx_int8()
    result, report = _check(reference, candidate, tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("candidate quantized: int8") and "judged at its own weights" in first, first
    judging = report["judging"]
    assert judging["same_weights"] and judging["chosen"] == "default" and judging["cost_measured"]
    assert judging["weights"]["quantized"] and "MatMulInteger" in judging["weights"]["scheme"]
    assert report["calibrated"]  # what --same-weights --calibrate does
    assert report["reference"]["same_weights"]["not_a_quantization"] == {}
    cost = report["quantization"]["cost"]
    # int8 on a tiny random Llama: far from the float reference, while the port is within the engine's rounding
    assert 1e-4 < cost["kl_mean"] <= cost["kl_max"] and 0.5 < cost["top1_agreement"] <= 1.0
    assert cost["points"]["logits"] > 1e3 * report["points"][-1]["rel_l2"]
    assert cost["points"]["layers.0.attn_out"] > 1e-3 and set(cost["points"]) == {p["name"] for p in report["points"]}
    assert report["quantization"]["gate"] is None
    assert "cost against the float reference: kl_mean" in result.output
    # the same file against the float weights, by name: the quantization's error is the port's, as before
    result, plain = _check(reference, candidate, tmp_path / "f.json", "--float-reference")
    assert result.exit_code == 1, result.output
    assert plain["judging"]["chosen"] == "--float-reference" and not plain["judging"]["same_weights"]
    assert "the quantization's error counts as the port's" in result.output.splitlines()[0]
    # its cost is the float comparison itself: the same logits as the default's extra pass
    assert plain["quantization"]["cost"]["kl_mean"] == pytest.approx(cost["kl_mean"], rel=1e-6)
    # the diagnosis says what explains the error: the quantization, not a catalogued mistake
    said = plain["diagnosis"][0]
    assert said["bug"] == "unknown" and "closest:" not in said["evidence"], said
    assert "The candidate is quantized: int8" in said["evidence"] and "drop --float-reference" in said["evidence"]


def test_a_broken_int8_export_fails_with_no_flag_and_is_named(onnx_int8, tmp_path):
    reference, candidate = onnx_int8("norm-offset-added")
    result, report = _check(reference, candidate, tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert report["judging"]["same_weights"]
    assert report["first_divergence"]["point"] == "layers.0.attn_in"
    assert report["diagnosis"][0]["bug"] == "norm-offset-added"
    assert report["quantization"]["cost"]["kl_mean"] > 0  # reported for a broken port too


def test_the_gate_on_the_quantizations_cost(onnx_int8, tmp_path):
    """--max-kl / --min-top1 fail a correct port whose quantization costs more than the user allows; the verdict,
    the JUnit file and the exit code say so; a bound it holds passes."""
    reference, candidate = onnx_int8()
    result, report = _check(reference, candidate, tmp_path / "r.json", "--max-kl", "1e-9", "--min-top1", "0",
                            "--junit", tmp_path / "j.xml")
    assert result.exit_code == 1, result.output
    gate = report["quantization"]["gate"]
    assert gate["max_kl"] == 1e-9 and not gate["passed"] and len(gate["failed"]) == 1
    assert report["verdict"] == "fail" and report["first_divergence"] is None  # every point within tolerance
    assert "but the quantization costs more than the gate allows (kl_mean" in result.output
    assert 'name="quantization gate"' in (tmp_path / "j.xml").read_text()
    result, report = _check(reference, candidate, tmp_path / "s.json", "--max-kl", "10", "--min-top1", "0.1")
    assert result.exit_code == 0 and report["quantization"]["gate"]["passed"], result.output
    for bad in (("--max-kl", "-1"), ("--min-top1", "1.5")):
        result = _cli("check", "--reference", reference, "--candidate", candidate, *bad)
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output


def test_a_float_candidate_is_checked_as_it_always_was(tmp_path):
    """A neutral candidate and an unquantized ONNX export: no judging line, no extra pass, no quantization entry."""
    from parity.reference.tiny import build_model

    build_model(ADAPTERS["llama"]).save_pretrained(tmp_path / "llama")
    assert _cli("convert", tmp_path / "llama", "--to", "onnx", "-o", tmp_path / "f.onnx",
                "--debug-outputs").exit_code == 0
    result, report = _check(tmp_path / "llama", tmp_path / "f.onnx", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("\n parity llama") or result.output.lstrip().startswith("parity llama"), \
        result.output[:200]
    assert not report["judging"]["same_weights"] and not report["judging"]["weights"]["quantized"]
    assert report["quantization"] is None and "same_weights" not in report["reference"]
    # a gate on a float candidate reads the check's own logits
    result, report = _check(tmp_path / "llama", tmp_path / "f.onnx", tmp_path / "g.json", "--max-kl", "1e-6")
    assert result.exit_code == 0 and report["quantization"]["cost"]["kl_mean"] < 1e-6, result.output


def test_closest_lists_only_mistakes_that_explain_a_share_of_the_error():
    """A hypothesis that leaves the error as it was (a quantized file's error) is not "closest"; one that explains
    half of it or more is."""
    from parity.diagnosis import bugs
    from parity.diagnosis.diagnose import _named

    a, b = bugs.get("final-softcap-added"), bugs.get("embed-scale-dropped")
    said = _named([(0.0032, a, None, None), (0.0032, b, None, None)], 0.0032, "layer 0 attn_out", "")[0]
    assert said["bug"] == "unknown" and "closest" not in said["evidence"]
    assert "none of those that apply explains any real share of it (the best leaves a residual of 0.0032)" in \
        said["evidence"]
    said = _named([(0.001, a, None, None), (0.0031, b, None, None)], 0.0032, "layer 0 attn_out", "")[0]
    assert "closest: final-softcap-added (residual 0.001)" in said["evidence"]
    assert "embed-scale-dropped" not in said["evidence"]


def test_weights_in_words():
    from parity.weights import Weights

    q = Weights(types={"Q4_K": 168, "Q6_K": 1, "F32": 121}, scheme="Q4_K_M", bits_per_weight=4.91,
                notes=("Q6_K output",))
    assert q.quantized and q.rounded and q.words() == "quantized: Q4_K_M (Q6_K output), 4.91 bits per weight"
    f16 = Weights(types={"F16": 10, "F32": 5})
    assert not f16.quantized and f16.rounded and f16.words() == "not quantized (F16/F32 weights)"
    assert not Weights(types={"F32": 3}).rounded
