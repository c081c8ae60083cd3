"""transformers' own kernels as candidates: the same checkpoint run with --candidate-attn sdpa / flex_attention
and --compile against the eager reference; a kernel that cannot express a convention is refused with the
reason, and one that drops it silently fails where it first acts, diagnosed."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from parity.checkpoint import open_checkpoint
from parity.cli import cli
from parity.reference.models import Models, compile_between_points
from tests.conftest import FAMILIES

# float32, measured on the tiny checkpoints (parity check --candidate-attn sdpa): every family's worst point is
# below 2e-6 (gemma4: 1.1e-6 at the logits); the bound leaves room for other CPUs' summation orders
KERNEL_NOISE = 1e-5


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _check(tmp_path, reference, *extra, candidate=None):
    report = tmp_path / "r.json"
    result = _cli("check", "--reference", reference, "--candidate", candidate or reference, "--layerwise",
                  "--report", report, *extra)
    return result, (json.loads(report.read_text()) if report.exists() else None)


def _worst(report) -> float:
    return max(p["rel_l2"] for p in report["points"] if p["compared"])


def _softcapped(path) -> bool:
    r = open_checkpoint(path).resolved
    return any(r.layer("attention.softcap", i) for i in range(r.num_layers))


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_matches_eager(family, tiny_dir, tmp_path):
    result, report = _check(tmp_path, tiny_dir(family), "--candidate-attn", "sdpa")
    if _softcapped(tiny_dir(family)):  # gemma2: SDPA has no logit softcap; refused, naming the setting
        assert result.exit_code == 2, result.output
        assert "attention.softcap" in result.output and "attn_logit_softcapping" in result.output
        assert report is None
        return
    if "does not support an attention implementation" in result.output:  # GPT-OSS: transformers has no SDPA path
        assert result.exit_code == 2 and report is None, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        return
    assert result.exit_code == 0, result.output
    # a different kernel ran (eager against eager is bit-identical), within float32 summation noise
    assert 0 < _worst(report) < KERNEL_NOISE
    assert report["candidate"]["attn"] == "sdpa" and report["candidate"]["compile"] is False  # what ran, said


@pytest.mark.parametrize("family", ["gemma2", "llama", "qwen3"])
def test_flex_attention_matches_eager(family, tiny_dir, tmp_path):
    # gemma2: flex applies the softcap in its score_mod, and the sliding window in its block mask
    result, report = _check(tmp_path, tiny_dir(family), "--candidate-attn", "flex_attention")
    assert result.exit_code == 0, result.output
    assert _worst(report) < KERNEL_NOISE


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_sdpa_decode_matches_eager(family, tiny_dir, tmp_path):
    """The KV-cache path under SDPA (gemma3's prompt crosses its sliding window while decoding)."""
    result, report = _check(tmp_path, tiny_dir(family), "--candidate-attn", "sdpa", "--decode", 3)
    assert result.exit_code == 0, result.output
    steps = [p for p in report["points"] if p.get("step")]
    assert {p["step"] for p in steps} == {1, 2, 3} and all(p["passed"] for p in steps)


def test_compile_runs_compiled_code_with_hooks(tiny_dir, tmp_path):
    """--compile: hooks stay outside the compiled regions, so every point is still read, and what ran is inductor's
    code (eager against eager would be bit-identical)."""
    result, report = _check(tmp_path, tiny_dir("gemma2"), "--compile")
    assert result.exit_code == 0, result.output
    assert all(p["compared"] for p in report["points"]) and 0 < _worst(report) < KERNEL_NOISE


def test_compile_with_sdpa(tiny_dir, tmp_path):
    result, report = _check(tmp_path, tiny_dir("llama"), "--candidate-attn", "sdpa", "--compile")
    assert result.exit_code == 0, result.output
    assert all(p["compared"] for p in report["points"]) and 0 < _worst(report) < KERNEL_NOISE


def test_compiled_regions_hold_no_capture_point(tiny_dir):
    ckpt = open_checkpoint(tiny_dir("llama"))
    model = Models().hf(ckpt, torch.float32)
    hooked = {c.module for c in ckpt.resolved.capture}
    compiled = compile_between_points(model, hooked, ckpt.resolved.num_layers)
    assert {"model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1.input_layernorm", "model.norm",
            "lm_head"} <= set(compiled)
    assert not any(h.startswith(c + ".") for c in compiled for h in hooked)  # no hook inside a compiled region
    assert not any(c.startswith(p + ".") for c in compiled for p in compiled)  # the largest regions only


def test_the_reference_stays_eager(tiny_dir):
    ckpt, models = open_checkpoint(tiny_dir("llama")), Models()
    candidate = models.hf(ckpt, torch.float32, "candidate", "sdpa")
    assert candidate.config._attn_implementation == "sdpa"
    assert models.hf(ckpt, torch.float32).config._attn_implementation == "eager"


@pytest.fixture
def softcap_dropping_kernel():
    """A kernel registered with transformers that takes SDPA's path and drops the softcap it is given, as
    transformers' own Gemma 2 SDPA path once did: nothing refuses it, only the numbers can."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, softcap=None, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fused_no_softcap", attention)
    AttentionMaskInterface.register("fused_no_softcap", sdpa_mask)
    yield "fused_no_softcap"
    AttentionInterface._global_mapping.pop("fused_no_softcap")
    AttentionMaskInterface._global_mapping.pop("fused_no_softcap")


def test_a_kernel_dropping_the_softcap_fails_at_the_first_attention(softcap_dropping_kernel, tiny_dir, tmp_path):
    result, report = _check(tmp_path, tiny_dir("gemma2"), "--candidate-attn", softcap_dropping_kernel)
    assert result.exit_code == 1, result.output
    assert report["first_divergence"]["point"] == "layers.0.attn_out"
    assert report["first_divergence"]["rel_l2"] > 0.1
    assert report["diagnosis"][0]["bug"] == "attn-softcap-dropped"


def test_unknown_kernel_is_refused_with_the_valid_ones(tiny_dir, tmp_path):
    result, report = _check(tmp_path, tiny_dir("llama"), "--candidate-attn", "fast")
    assert result.exit_code == 2 and report is None
    line = result.output.strip()
    assert "\n" not in line and "'fast'" in line
    assert all(name in line for name in ("eager", "sdpa", "flex_attention"))


def test_hub_kernels_are_refused(tiny_dir, tmp_path):
    result, _ = _check(tmp_path, tiny_dir("llama"), "--candidate-attn", "kernels-community/flash-attn")
    assert result.exit_code == 2 and "downloaded code" in result.output


def test_a_kernel_the_architecture_lacks_is_one_line(tiny_dir, tmp_path):
    # transformers has no flex_attention for GPT-2
    result, _ = _check(tmp_path, tiny_dir("gpt2"), "--candidate-attn", "flex_attention")
    assert result.exit_code == 2
    assert "GPT2LMHeadModel" in result.output and "flex_attention" in result.output
    assert "Traceback" not in result.output


def test_kernel_options_need_a_transformers_candidate(tiny_dir, neutral_dir, tmp_path):
    for option in (("--candidate-attn", "sdpa"), ("--compile",)):
        result, _ = _check(tmp_path, tiny_dir("llama"), *option, candidate=neutral_dir("llama"))
        assert result.exit_code == 2 and "Hugging Face candidates" in result.output
