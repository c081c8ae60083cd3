"""Gemma 4 adapter against transformers: per-layer head_dim and kv heads (from global_head_dim or from a saved
per_layer_config), k_eq_v, KV sharing, double-wide MLPs, per-layer inputs, MoE, proportional RoPE, the
multimodal wrapper, and checkpoints of every depth."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from parity.adapter import recognise, resolve, text_config
from parity.checkpoint import check_tensors, open_checkpoint
from parity.reference.capture import run_and_capture
from parity.reference.tiny import build_model, make_tiny, randomise, tiny_config
from tests.conftest import ADAPTERS, FIXTURES
from tests.test_gemma_variants import mismatches, real_model

PROMPT = torch.tensor([[(7 * k + 3) % 250 + 3 for k in range(40)]])

# A dense Gemma 4 with per-layer inputs and 20 KV-shared layers of 35 (E2B-like geometry)
E2B_LIKE = {
    "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "audio_config": None,
    "vision_config": None, "tie_word_embeddings": True,
    "text_config": {
        "model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
        "hidden_size_per_layer_input": 256, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
        "num_kv_shared_layers": 20, "sliding_window": 512, "use_double_wide_mlp": True, "enable_moe_block": False,
        "attention_k_eq_v": False, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
        "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(35)],
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    },
}


def _resolved(config: dict):
    adapter, variant = recognise(config, ADAPTERS)
    return resolve(adapter, variant, text_config(config, variant)), variant


def test_tiny_gemma4_exercises_every_feature_and_agrees_with_transformers():
    model = build_model(ADAPTERS["gemma4"])
    r, variant = _resolved(model.config.to_dict())
    assert mismatches(model, r, variant.module_prefix) == []
    assert r["attention.head_dim"] == [16, 32, 16, 32]
    assert r["attention.kv_heads"] == [2, 1, 2, 1]
    assert r["attention.k_eq_v"] == [False, True, False, True]
    assert r["attention.kv_shared_from"] == [None, None, 0, 1]
    assert r["mlp.intermediate_size"] == [96, 96, 192, 192]
    assert r["mlp.moe"] and r["mlp.experts"] == 4 and r["embedding.per_layer_input_size"] == 8
    assert r["positions.rope_scaling"][1] == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert r["attention.scale"] == 1.0 and r["norm.weight"] == "weight"


def test_saved_per_layer_config_and_global_head_dim_resolve_alike():
    """A saved config carries per_layer_config (and no global_head_dim); a released one the reverse."""
    saved = build_model(ADAPTERS["gemma4"]).config.to_dict()
    assert "per_layer_config" in saved and "global_head_dim" not in saved
    _, kwargs = tiny_config(ADAPTERS["gemma4"])
    released = {**kwargs, "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"]}
    a, b = _resolved(saved)[0], _resolved(released)[0]
    assert a.settings == b.settings


@pytest.mark.parametrize("layers", [1, 2, 3, 5, 6])
def test_checkpoints_of_every_depth(tmp_path, layers):
    make_tiny(ADAPTERS["gemma4"], tmp_path / "m", layers=layers)
    ckpt = open_checkpoint(tmp_path / "m")
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    model = transformers.Gemma4ForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    assert mismatches(model, ckpt.resolved, "model.") == []
    got = run_and_capture(model, ckpt.resolved.capture, input_ids=PROMPT)
    prev = got["embed"]
    for i in range(layers):
        torch.testing.assert_close(got[f"layers.{i}.mid"], prev + got[f"layers.{i}.attn_out"])
        prev = got[f"layers.{i}.out"]


@pytest.mark.parametrize("config", ["gemma-4-26b-a4b.json", "e2b-like"])
def test_real_configs_agree_with_transformers(config):
    data = E2B_LIKE if config == "e2b-like" else json.loads((FIXTURES / "configs" / config).read_text())
    model, r, variant = real_model(data)
    assert mismatches(model, r, variant.module_prefix) == []
    assert r["embedding.final_softcap"] == 30.0
    if config == "e2b-like":
        assert r["attention.kv_shared_from"][15:20] == [13, 13, 13, 13, 14]
        assert r["mlp.intermediate_size"][14:16] == [6144, 12288]
    else:
        assert r["attention.kv_heads"][4:6] == [8, 2] and r["attention.head_dim"][4:6] == [256, 512]
        assert (r["mlp.experts"], r["mlp.experts_per_token"], r["mlp.moe_intermediate_size"]) == (128, 8, 704)
        assert r["embedding.per_layer_input_size"] is None


def test_multimodal_checkpoint(tmp_path):
    _, kwargs = tiny_config(ADAPTERS["gemma4"])
    text = transformers.Gemma4TextConfig(**kwargs).to_dict()
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, global_head_dim=16, num_hidden_layers=1)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    randomise(model, 0)
    model.save_pretrained(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.variant.architectures == ["Gemma4ForConditionalGeneration"]
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    assert check.ignored and all(n.startswith(("model.vision_tower.", "model.embed_vision.")) for n in check.ignored)
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prefix = ckpt.variant.module_prefix
    assert mismatches(model, ckpt.resolved, prefix) == []
    assert sorted(n.hf.replace("{prefix}", prefix) for n in ckpt.resolved.norms) == sorted(
        n for n, m in model.named_modules() if n.startswith(prefix) and "norm" in type(m).__name__.lower())
    got = run_and_capture(model, ckpt.resolved.capture, input_ids=PROMPT)
    cap = ckpt.resolved["embedding.final_softcap"]
    assert got["logits"].abs().max() <= cap  # the wrapper caps its logits too
