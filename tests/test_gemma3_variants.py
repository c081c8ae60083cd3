"""Gemma 3 adapter against transformers: local/global RoPE, linear scaling on global layers, the multimodal
wrapper (sparse text_config, both on-disk prefixes, vision tensors ignored), and bidirectional attention."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from parity.adapter import recognise, resolve
from parity.checkpoint import check_tensors, open_checkpoint
from parity.reference.capture import run_and_capture
from parity.reference.tiny import randomise, tiny_config
from tests.conftest import ADAPTERS, FIXTURES
from tests.test_gemma_variants import mismatches, real_model

PROMPT = torch.tensor([[(7 * k + 3) % 250 + 3 for k in range(40)]])

# google/gemma-3-4b-it's config.json: a sparse text_config that relies on Gemma3TextConfig's defaults
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}


def _resolved(model):
    config = model.config.to_dict()
    adapter, variant = recognise(config, ADAPTERS)
    return resolve(adapter, variant, config), variant


@pytest.mark.parametrize("overrides", [{}, {"use_bidirectional_attention": True}], ids=["causal", "bidirectional"])
def test_tiny_gemma3_agrees_with_transformers(overrides):
    adapter = ADAPTERS["gemma3"]
    architecture, kwargs = tiny_config(adapter)
    model = getattr(transformers, architecture)(transformers.Gemma3TextConfig(**kwargs, **overrides))
    config = model.config.to_dict()  # to_dict undoes the bidirectional window halving, as a saved config would
    adapter, variant = recognise({**config, "architectures": [architecture]}, ADAPTERS)
    r = resolve(adapter, variant, config)
    assert mismatches(model, r, variant.module_prefix) == []
    assert r["embedding.final_softcap"] == model.config.final_logit_softcapping


def test_real_gemma3_1b_config_agrees_with_transformers():
    model, r, variant = real_model(json.loads((FIXTURES / "configs" / "gemma-3-1b-it.json").read_text()))
    assert mismatches(model, r, variant.module_prefix) == []
    assert r["positions.rope_theta"][4:7] == [10000, 1000000, 10000]
    assert r["attention.softcap"] is None and r["embedding.final_softcap"] is None


def test_sparse_multimodal_text_config_takes_class_defaults():
    model, r, variant = real_model(GEMMA3_4B)
    assert variant.architectures == ["Gemma3ForConditionalGeneration"]
    assert mismatches(model, r, variant.module_prefix) == []
    assert (r["attention.heads"], r["attention.kv_heads"], r.layer("attention.head_dim", 0)) == (8, 4, 256)
    assert r["positions.rope_scaling"][5] == {"rope_type": "linear", "factor": 8.0}
    assert r["positions.rope_scaling"][4] is None
    keep = lambda n: n.startswith(variant.module_prefix)  # noqa: E731
    assert sum(t.numel for t in r.tensors) == sum(p.numel() for n, p in model.named_parameters() if keep(n))
    assert len(r.norms) == sum(1 for n, m in model.named_modules() if keep(n) and "norm" in type(m).__name__.lower())


@pytest.mark.parametrize("layout", ["as saved", "model.language_model"])
def test_multimodal_checkpoint(tmp_path, layout):
    architecture, kwargs = tiny_config(ADAPTERS["gemma3"])
    text = transformers.Gemma3TextConfig(**kwargs).to_dict()
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_hidden_layers=1, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomise(model, 0)
    model.save_pretrained(tmp_path)
    if layout != "as saved":  # transformers 5 names, as other tools write them
        path = tmp_path / "model.safetensors"
        tensors = load_file(path)
        renamed = {("model." + k[len("language_model."):].replace("model.", "language_model.", 1)
                    if k.startswith("language_model.model.") else
                    "model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else k): v
                   for k, v in tensors.items()}
        assert any(k.startswith("model.language_model.") for k in renamed)
        save_file(renamed, path, metadata={"format": "pt"})
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.variant.architectures == ["Gemma3ForConditionalGeneration"]
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    assert check.prefix == ("language_model.model." if layout == "as saved" else "model.language_model.")
    assert check.ignored and all("vision_tower" in n or "multi_modal_projector" in n for n in check.ignored)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prefix = ckpt.variant.module_prefix
    assert sorted(n.hf.replace("{prefix}", prefix) for n in ckpt.resolved.norms) == sorted(
        n for n, m in model.named_modules() if n.startswith(prefix) and "norm" in type(m).__name__.lower())
    got = run_and_capture(model, ckpt.resolved.capture, input_ids=PROMPT)
    prev = got["embed"]
    for i in range(ckpt.resolved.num_layers):
        torch.testing.assert_close(got[f"layers.{i}.mid"], prev + got[f"layers.{i}.attn_out"])
        torch.testing.assert_close(got[f"layers.{i}.out"], got[f"layers.{i}.mid"] + got[f"layers.{i}.mlp_out"])
        prev = got[f"layers.{i}.out"]
    assert got["logits"].shape == (1, 40, 256)
