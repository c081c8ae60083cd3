"""DeepSeek-V3 adapter beyond the default tiny checkpoint: MLA without q_lora_rank, half-split RoPE, the attention
scale under yarn, and the multi-token-prediction layer that released checkpoints carry but transformers ignores."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity.adapter import resolve
from parity.checkpoint import check_tensors, open_checkpoint
from parity.reference.capture import run_and_capture
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS, FIXTURES

PROMPT = torch.tensor([[(5 * k + 1) % 256 for k in range(40)]])


def _build(tmp_path, **overrides):
    model = build_model(ADAPTERS["deepseek_v3"], overrides=overrides)
    model.save_pretrained(tmp_path)
    return type(model).from_pretrained(tmp_path, attn_implementation="eager").eval()


@pytest.mark.parametrize("overrides", [
    {},
    {"q_lora_rank": None},
    {"rope_interleave": False},
    {"rope_scaling": None},
    {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                      "mscale_all_dim": 0.707}},
    {"first_k_dense_replace": 0, "n_shared_experts": 1},
], ids=["default", "no-q-lora", "half-rope", "no-rope-scaling", "mscale-0.707", "all-moe"])
def test_variant_matches_transformers(tmp_path, overrides):
    model = _build(tmp_path, **overrides)
    ckpt = open_checkpoint(tmp_path)
    r = ckpt.resolved
    check = check_tensors(r, ckpt.tensors)
    assert check.ok, check.problems()
    norms = sorted(n.hf.replace("{prefix}", "model.") for n in r.norms)
    assert norms == sorted(n for n, m in model.named_modules() if "norm" in type(m).__name__.lower())
    for i, layer in enumerate(model.model.layers):
        assert r.layer("attention.scale", i) == pytest.approx(layer.self_attn.scaling, rel=1e-12)
        assert bool(r.layer("mlp.moe", i)) == hasattr(layer.mlp, "experts")
    assert r["positions.rope_style"] == ("interleaved" if model.config.rope_interleave else "half")
    assert r["attention.q_lora_rank"] == model.config.q_lora_rank
    got = run_and_capture(model, r.capture, input_ids=PROMPT)
    prev = got["embed"]
    for i in range(r.num_layers):
        torch.testing.assert_close(got[f"layers.{i}.mid"], prev + got[f"layers.{i}.attn_out"])
        torch.testing.assert_close(got[f"layers.{i}.out"], got[f"layers.{i}.mid"] + got[f"layers.{i}.mlp_out"])
        prev = got[f"layers.{i}.out"]


def test_mtp_layer_is_ignored_not_unexpected(tmp_path):
    _build(tmp_path)
    n = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
    weights = load_file(tmp_path / "model.safetensors")
    # the shape of DeepSeek-V3's MTP layer: a full decoder layer plus its own projections and norms
    weights[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    weights[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    weights[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.zeros(160, 32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ckpt = open_checkpoint(tmp_path)
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    assert len(check.ignored) == 3


def test_real_config_attention_scale_and_rope():
    config = json.loads((FIXTURES / "configs" / "deepseek-v3.json").read_text())
    ckpt = open_checkpoint(FIXTURES / "configs" / "deepseek-v3.json")
    r = resolve(ckpt.adapter, ckpt.variant, config)
    mscale = 0.1 * 1.0 * __import__("math").log(40) + 1.0
    assert r["attention.scale"] == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-13)
    assert r["positions.rope_style"] == "interleaved"
    assert r["positions.rotary_dim"] == 64
    assert r["positions.rope_scaling"]["rope_type"] == "yarn"
    assert [bool(m) for m in r["mlp.moe"]] == [False] * 3 + [True] * 58
