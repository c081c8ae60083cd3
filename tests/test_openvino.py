"""OpenVINO candidates (``--candidate openvino:PATH``): tiny checkpoints converted by OpenVINO's own converter
(openvino.convert_model on transformers' model, stateful KV cache), run by OpenVINO Runtime at f32 and compared
point by point with transformers; twins converted from a checkpoint carrying a catalogued mistake fail where it
first acts and are named; NNCF-compressed weights pass against a reference holding the IR's own weights.

Conversions are cached for the session (PARITY_CACHE in a temporary directory): a family's IR is converted once
and serves prefill and decode. Every family parity knows converts and passes, each checked here (14 families in
about 95 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from parity.cli import cli
from parity.engines.openvino.kind import conversions
from tests.conftest import FAMILIES

pytest.importorskip("openvino")



@pytest.fixture(scope="module", autouse=True)
def engine_cache(tmp_path_factory):
    """Conversions land in a cache of this module's own (made once per checkpoint and setting)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PARITY_CACHE", str(tmp_path_factory.mktemp("parity-cache")))
        yield


def _check(reference, candidate, report, *extra):
    result = CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(candidate),
                                      "--report", str(report), *map(str, extra)], catch_exceptions=False)
    return result, (json.loads(report.read_text()) if report.exists() else None)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_checkpoint_passes_layerwise_at_f32(family, tiny_dir, tmp_path):
    reference = tiny_dir(family)
    result, report = _check(reference, f"openvino:{reference}", tmp_path / "r.json", "--layerwise")
    assert result.exit_code == 0, result.output
    assert report["candidate"]["kind"] == "openvino" and report["candidate"]["source"] == "huggingface"
    points = report["points"]
    # every capture point is found among OpenVINO's ops (module paths, then structure) and compared
    assert all(p["compared"] for p in points), [p["name"] for p in points if not p["compared"]]
    assert len(points) == len(report["matching"]["points"])
    assert max(p["rel_l2"] for p in points) < 1e-5  # measured: 3.4e-7 (gpt2) .. 2.5e-6 (gemma4)
    if "logits" in {p["name"] for p in points}:
        assert report["logits"]["top1_agreement"] == 1.0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_runs_through_the_models_own_states(family, tiny_dir, tmp_path):
    """--decode: the prompt, then each token as one infer call of the stateful IR (its KV cache kept in OpenVINO's
    states); Gemma 3's sliding window is crossed during the steps."""
    reference = tiny_dir(family)
    result, report = _check(reference, f"openvino:{reference}", tmp_path / "r.json", "--layerwise", "--decode", "8")
    assert result.exit_code == 0, result.output
    steps = [p for p in report["points"] if p["step"] is not None]
    assert {p["step"] for p in steps} == set(range(1, 9)) and all(p["compared"] for p in steps)
    assert report["decode"]["top1_agreement"] == 1.0
    assert max(p["rel_l2"] for p in steps) < 1e-5


def _twin(source, out, bug):
    """The checkpoint with one catalogued mistake in its files (OpenVINO converts what it is given)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    if bug == "rope-theta-wrong":
        config = json.loads((out / "config.json").read_text())
        config["rope_parameters"]["rope_theta"] = 10000.0 if config["rope_parameters"]["rope_theta"] != 1e4 else 1e6
        (out / "config.json").write_text(json.dumps(config))
    elif bug == "qkv-bias-dropped":
        tensors = load_file(out / "model.safetensors")
        tensors = {k: v * 0 if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) else v
                   for k, v in tensors.items()}
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("family,bug", [("llama", "rope-theta-wrong"), ("qwen2", "qkv-bias-dropped")])
def test_broken_twin_fails_at_its_first_divergence_and_is_named(family, bug, tiny_dir, tmp_path):
    reference = tiny_dir(family)
    twin = _twin(reference, tmp_path / f"{family}-{bug}", bug)
    result, report = _check(reference, f"openvino:{twin}", tmp_path / "r.json", "--layerwise")
    assert result.exit_code == 1, result.output
    assert report["first_divergence"]["point"] == "layers.0.attn_out"
    assert report["diagnosis"][0]["bug"] == bug


def test_int8_weights_fail_plainly_and_pass_on_their_own_weights(tiny_dir, tmp_path):
    """NNCF's int8 weights differ from the checkpoint's (the embedding's rounding shows at once); read back and
    decompressed by OpenVINO as the reference (--same-weights on the IR), OpenVINO's f32 compute is exact."""
    reference = tiny_dir("llama")
    result, report = _check(reference, f"openvino:{reference}", tmp_path / "plain.json", "--layerwise",
                            "--engine-option", "weights=int8", "--float-reference")
    assert result.exit_code == 1
    assert report["first_divergence"]["point"] == "embed" and report["points"][0]["rel_l2"] > 1e-3
    ir = conversions(reference)["int8"]  # the IR the check converted, in the cache
    result, report = _check(reference, f"openvino:{os.path.dirname(ir)}", tmp_path / "same.json", "--layerwise",
                            "--same-weights")
    assert result.exit_code == 0, result.output
    held = report["reference"]["same_weights"]
    assert held["types"] == {"u8": 16} and not held["not_a_quantization"]
    assert max(p["rel_l2"] for p in report["points"]) < 1e-5
    # the checkpoint itself with weights=int8: --same-weights reads back that same IR (the cache's)
    result, report = _check(reference, f"openvino:{reference}", tmp_path / "hf.json", "--layerwise",
                            "--same-weights", "--engine-option", "weights=int8")
    assert result.exit_code == 0, result.output
    held = report["reference"]["same_weights"]
    assert held["types"] == {"u8": 16} and not held["not_a_quantization"]
    assert max(p["rel_l2"] for p in report["points"]) < 1e-5
    assert held["from"] == ir
    # with no flag, the int8 IR is judged on its own weights, and what int8 costs is reported beside
    result, report = _check(reference, f"openvino:{reference}", tmp_path / "default.json", "--layerwise",
                            "--engine-option", "weights=int8")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("candidate quantized: int8") and report["judging"]["same_weights"]
    assert report["quantization"]["cost"]["points"]["embed"] > 1e-3


def test_precision_other_than_dtype_is_warned_and_bad_options_refused(tiny_dir, tmp_path):
    reference = tiny_dir("llama")
    result, report = _check(reference, f"openvino:{reference}", tmp_path / "r.json",
                            "--engine-option", "precision=bf16")
    assert any("pass --dtype bfloat16" in w for w in report["warnings"])
    import openvino as ov

    if "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        assert report["logits"]["kl_max"] > 1e-8  # bf16 compute is not f32's
    else:  # a CPU without bf16 (x86 with AVX2 alone): OpenVINO computes in f32 whatever the hint says
        assert report["logits"]["kl_max"] < 1e-8
    result, _ = _check(reference, f"openvino:{reference}", tmp_path / "x.json", "--engine-option", "precision=int8")
    assert result.exit_code == 2 and "computes in f32, bf16 or f16" in result.output
