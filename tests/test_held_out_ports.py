"""Held-out ports that repeat porting bugs fixed in public engines (issue 33), as transformers candidates: the same
weights, a config that differs from the reference's the way the engine's port did. The catalog never built these
twins; the diagnosis has to name each from the candidate's numbers, in the mistake's direction (a softcap *added*
is never called dropped)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parity.checker.run import check
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS


def _pair(tmp_path: Path, family: str, reference: dict, candidate: dict) -> tuple[Path, Path]:
    """A tiny checkpoint of ``family`` (config overrides ``reference``) and a copy whose config.json differs by
    ``candidate`` (a key ending in "+" updates the dict at that key instead of replacing it)."""
    ref = tmp_path / "reference"
    build_model(ADAPTERS[family], overrides=reference).save_pretrained(ref)
    cand = tmp_path / "candidate"
    shutil.copytree(ref, cand)
    config = json.loads((cand / "config.json").read_text())
    for key, value in candidate.items():  # "key+": merged into the dict the config holds there
        if key.endswith("+"):
            config[key[:-1]] = {**config[key[:-1]], **value}
        else:
            config[key] = value
    (cand / "config.json").write_text(json.dumps(config))
    return ref, cand


# (family, the reference's config, the port's, the mistake it repeats)
PORTS = [
    # Llama 3.1's llama3 RoPE scaling not applied (lablup/mlxcel #1355): the tiny Llama scales with factor 8
    ("llama", {}, {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
     "rope-scaling-dropped"),
    # Qwen3-MoE's norm_topk_prob inverted (the top-k weights left unnormalised)
    ("qwen3_moe", {"norm_topk_prob": True}, {"norm_topk_prob": False}, "moe-topk-not-renormalised"),
    # OLMoE keeps its top-k weights as they are; a port that renormalises them (a softmax over the top-k only)
    ("olmoe", {"norm_topk_prob": False}, {"norm_topk_prob": True}, "moe-topk-renormalised"),
    # a Gemma 3 without a final softcap given one (ollama/ollama PR #9692)
    ("gemma3", {"final_logit_softcapping": None}, {"final_logit_softcapping": 30.0}, "final-softcap-added"),
    # Gemma 2's attention softcap on a Gemma 2 configured without one (transformers' Gemma 3 reads no such cap)
    ("gemma2", {"attn_logit_softcapping": None}, {"attn_logit_softcapping": 50.0}, "attn-softcap-added"),
    # a window on a model that attends globally (ggml-org/llama.cpp PR #13676: SWA on Phi-4), of a width the catalog
    # does not inject (8): the diagnosis sizes it from where the error starts
    ("mistral", {"sliding_window": None}, {"sliding_window": 12}, "sliding-window-added"),
    # YaRN's attention factor collapsed to 1 (turboderp-org/exllamav3 #259): the tiny Qwen2's YaRN factor is 4
    ("qwen2", {}, {"rope_parameters+": {"attention_factor": 1.0}}, "yarn-attention-factor-dropped"),
    # DeepSeek's mscale / mscale_all_dim ignored, the default 0.1 ln(factor) + 1 used (sgl-project/sglang PR #22711)
    ("deepseek_v3", {}, {"rope_parameters+": {"mscale": 0.0}}, "yarn-attention-factor-wrong"),
]


@pytest.mark.parametrize("family,reference,candidate,bug", PORTS, ids=[p[3] for p in PORTS])
def test_a_held_out_port_is_named(family, reference, candidate, bug, tmp_path):
    ref, cand = _pair(tmp_path, family, reference, candidate)
    report = check(ref, cand, layerwise=True, calibrate=True)
    assert not report  # exit 1
    assert report.diagnosis[0]["bug"] == bug, report.diagnosis[:2]


# ports whose value differs from the config's by one the catalog never injects: (family, the reference's config,
# the port's, the mistake, the value the port used, which the diagnosis must fit within 5%)
VALUED = [
    ("gemma3", {"final_logit_softcapping": None}, {"final_logit_softcapping": 3.0}, "final-softcap-added", 3.0),
    ("llama", {"rms_norm_eps": 1e-6}, {"rms_norm_eps": 2e-3}, "norm-eps-wrong", 2e-3),
    ("qwen3", {}, {"rope_parameters+": {"rope_theta": 20000.0}}, "rope-theta-wrong", 20000.0),
    ("granite", {}, {"embedding_multiplier": 3.0}, "embed-scale-wrong", 3.0),
    # the routed scale dropped (sgl-project/sglang PR #8511: GLM-4.5) or set to another value
    ("glm4_moe", {"routed_scaling_factor": 2.5}, {"routed_scaling_factor": 1.0}, "moe-routed-scale-dropped", None),
    ("deepseek_v3", {}, {"routed_scaling_factor": 1.0}, "moe-routed-scale-dropped", None),
    ("deepseek_v3", {}, {"routed_scaling_factor": 1.6}, "moe-routed-scale-wrong", 1.6),
]


@pytest.mark.parametrize("family,reference,candidate,bug,value", VALUED, ids=[f"{p[0]}-{p[3]}" for p in VALUED])
def test_a_port_with_another_value_is_named_with_its_value(family, reference, candidate, bug, value, tmp_path):
    ref, cand = _pair(tmp_path, family, reference, candidate)
    report = check(ref, cand, layerwise=True, calibrate=True)
    assert not report
    top = report.diagnosis[0]
    assert top["bug"] == bug, report.diagnosis[:2]
    if value is not None:
        assert abs(top["value"] / value - 1) < 0.05, top
        assert f"{value:.3g}" in top["evidence"], top["evidence"]


def test_the_same_config_is_clean(tmp_path):
    ref, cand = _pair(tmp_path, "gemma3", {"final_logit_softcapping": None}, {})
    assert check(ref, cand, layerwise=True, calibrate=True)


def test_scaled_logits_fail_though_every_next_token_agrees(tmp_path):
    """Granite's logits_scaling dropped (vllm-project/vllm #52158 in the issue): dividing the logits by 8 or not
    leaves every argmax where it was, and the check still fails at the logits and names the mistake."""
    ref, cand = _pair(tmp_path, "granite", {}, {"logits_scaling": 1.0})
    report = check(ref, cand, layerwise=True, calibrate=True)
    assert not report and report.first_divergence.name == "logits"
    assert report.logits["top1_agreement"] == 1.0
    assert report.diagnosis[0]["bug"] == "logit-scale-dropped"
