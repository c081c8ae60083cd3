"""Quantized files of llama.cpp and mlx-lm checked with no flag (parity/checker/judging.py): a correct Q4_K_M GGUF
and a 4-bit MLX conversion pass at their own weights with the quantization's cost reported; each broken twin of
the GGUF (tests/gguf_twins.py) fails and is named."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests.conftest import ADAPTERS
from tests.gguf_twins import write_twin

# rows of 256 and 512 columns: every matrix fits the K-quants' 256-column block; qwen2 for its q/k/v biases
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "use_sliding_window": False, "rope_scaling": None}  # as Qwen2.5 ships: llama.cpp's qwen2 has no window


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _check(reference, candidate, report, *extra):
    result = _cli("check", "--reference", reference, "--candidate", candidate, "--layerwise", "--report", report,
                  *extra)
    return result, json.loads(report.read_text())


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from parity.reference.tiny import build_model

    root = tmp_path_factory.mktemp("q4km")
    build_model(ADAPTERS["qwen2"], overrides=WIDE).save_pretrained(root / "qwen2")
    result = _cli("convert", root / "qwen2", "--to", "gguf", "-o", root / "q4_k_m.gguf", "--gguf-type", "Q4_K_M")
    assert result.exit_code == 0, result.output
    return root / "qwen2", root / "q4_k_m.gguf"


def test_a_correct_q4_k_m_file_passes_with_no_flag(q4_k_m, tmp_path):
    reference, gguf_file = q4_k_m
    result, report = _check(reference, gguf_file, tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith("candidate quantized: Q4_K_M") and "bits per weight" in first, first
    weights = report["judging"]["weights"]
    assert weights["scheme"] == "Q4_K_M" and 4.5 < weights["bits_per_weight"] < 8
    assert report["judging"]["same_weights"] and report["reference"]["arithmetic"]["engine"].startswith("llama.cpp")
    cost = report["quantization"]["cost"]
    assert cost["kl_mean"] > 1e-5 and cost["top1_agreement"] > 0.5 and cost["points"]["layers.0.attn_out"] > 1e-3
    assert report["points"][-1]["rel_l2"] < 0.1 * cost["points"]["logits"]


# twin -> (the first failing point, the mistake named)
TWINS = {"norms-shifted": ("layers.0.attn_in", "norm-offset-added"),
         "qk-permuted": ("layers.0.attn_out", "rope-permuted"),
         "qkv-bias-dropped": ("layers.0.attn_out", "qkv-bias-dropped"),
         "freq-base-wrong": ("layers.0.attn_out", "rope-theta-wrong")}


@pytest.mark.parametrize("mistake", sorted(TWINS))
def test_a_broken_twin_fails_with_no_flag_and_is_named(q4_k_m, tmp_path, mistake):
    reference, gguf_file = q4_k_m
    twin = write_twin(gguf_file, tmp_path / "twin.gguf", mistake)
    result, report = _check(reference, twin, tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    where, bug = TWINS[mistake]
    assert report["judging"]["same_weights"] and report["first_divergence"]["point"] == where
    assert report["diagnosis"][0]["bug"] == bug, report["diagnosis"]


def test_a_4_bit_mlx_conversion_passes_with_no_flag(tmp_path):
    pytest.importorskip("mlx_lm")
    from parity.reference.tiny import build_model

    # as Qwen2.5 ships (mlx-lm's qwen2 reads no window, and drops the tiny config's yarn: rope-scaling-dropped)
    build_model(ADAPTERS["qwen2"], overrides={"use_sliding_window": False, "rope_scaling": None}).save_pretrained(
        tmp_path / "qwen2")
    result, report = _check(tmp_path / "qwen2", f"mlx:{tmp_path / 'qwen2'}", tmp_path / "r.json",
                            "--engine-option", "bits=4")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("candidate quantized: affine 4-bit"), result.output[:300]
    assert report["judging"]["same_weights"] and report["quantization"]["cost"]["kl_mean"] > 0
