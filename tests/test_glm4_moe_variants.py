"""GLM-4.5 (glm4_moe) beyond the default tiny checkpoint: the switches its configs flip (use_qk_norm, attention_bias,
partial_rotary_factor, first_k_dense_replace, n_group), a hub config as the released models state it (RoPE at the top
level, head_dim apart from hidden_size // heads), and the multi-token-prediction layer transformers ignores."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import parity
from parity.adapter import resolve
from parity.checkpoint import check_tensors, open_checkpoint
from parity.neutral.converter import convert
from parity.neutral.executor.moe import moe
from parity.neutral.manifest import load
from parity.reference.capture import run_and_capture
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS

# A GLM-4.5-style hub config.json (the released spelling), cut to 4 layers and a small width: RoPE at the top level
# (rope_scaling null, partial_rotary_factor 0.5), head_dim 128 (not 4096 // 96), MTP layer count
HUB = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
       "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 256,
       "intermediate_size": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 64, "n_group": 1,
       "n_routed_experts": 16, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 12,
       "num_experts_per_tok": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_nextn_predict_layers": 1,
       "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 1000000,
       "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False,
       "vocab_size": 512}


@pytest.mark.parametrize("overrides", [
    {},
    {"use_qk_norm": True, "routed_scaling_factor": 2.5},
    {"attention_bias": False, "first_k_dense_replace": 3},
    {"partial_rotary_factor": 0.25, "n_group": 4, "topk_group": 2},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
], ids=["air", "qk-norm", "no-bias-3-dense", "quarter-rotary-groups", "nested-rope"])
def test_hub_config_resolves_to_what_transformers_builds(overrides):
    config = {**HUB, **overrides}
    if "rope_parameters" in overrides:
        config = {k: v for k, v in config.items() if k not in ("rope_theta", "partial_rotary_factor", "rope_scaling")}
    a = ADAPTERS["glm4_moe"]
    r = resolve(a, a.spec.variants[0], config)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.Glm4MoeForCausalLM(cfg)
    # the parameters and the saved buffer e_score_correction_bias
    assert sum(t.numel for t in r.tensors) == sum(t.numel() for t in model.state_dict().values())
    layers = model.model.layers
    assert [bool(r.layer("mlp.moe", i)) for i in range(len(layers))] == \
        [type(layer.mlp).__name__ == "Glm4MoeMoE" for layer in layers]
    attn = layers[0].self_attn
    assert r["attention.head_dim"] == attn.head_dim == 128 and r["attention.scale"] == attn.scaling
    assert r["positions.rotary_dim"] == 2 * model.model.rotary_emb.inv_freq.numel()
    assert r["positions.rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert r["attention.qk_norm"] == ("per_head" if attn.use_qk_norm else "none")
    assert (r["attention.q_bias"], r["attention.o_bias"]) == (attn.q_proj.bias is not None, False)
    router = next(layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate"))
    assert (r["mlp.moe_groups"], r["mlp.moe_groups_kept"]) == (router.num_group, router.topk_group)
    assert r["mlp.moe_scale"] == router.routed_scaling_factor and r["mlp.moe_routing"] == "sigmoid"
    assert r["mlp.moe_renormalise"] is True and r["mlp.moe_router_dtype"] == "float32"


@pytest.mark.parametrize("overrides", [
    {"use_qk_norm": False, "attention_bias": False},
    {"partial_rotary_factor": 0.25, "n_group": 1, "topk_group": 1, "norm_topk_prob": False},
], ids=["no-qk-norm-no-bias", "quarter-rotary-one-group"])
def test_variant_converted_matches_transformers(tmp_path, overrides):
    build_model(ADAPTERS["glm4_moe"], overrides=overrides).save_pretrained(tmp_path / "hf")
    ckpt = open_checkpoint(tmp_path / "hf")
    assert check_tensors(ckpt.resolved, ckpt.tensors).ok
    convert(tmp_path / "hf", tmp_path / "n")
    report = parity.check(tmp_path / "hf", tmp_path / "n", layerwise=True)
    assert report.verdict == "pass" and max(p.rel_l2 for p in report.points) < 1e-5


def test_mtp_layer_is_ignored_not_unexpected(tmp_path):
    build_model(ADAPTERS["glm4_moe"]).save_pretrained(tmp_path)
    n = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
    weights = load_file(tmp_path / "model.safetensors")
    # GLM-4.5's MTP layer (model.layers.92.* / Air's 46.*): a decoder layer plus its own projection and norms
    weights[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    weights[f"model.layers.{n}.enorm.weight"] = torch.ones(64)
    weights[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ckpt = open_checkpoint(tmp_path)
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    assert len(check.ignored) == 3


PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(40)]])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("mistake", ["score_bias", "groups", "scale", "renormalise", "shared_experts"])
def test_each_router_convention_bites_on_the_tiny_checkpoint(mistake, tiny_dir, neutral_dir):
    """Glm4MoeMoE on the prompt's own layer-1 MoE input: the executor's block is transformers', and dropping any
    one of the conventions (the selection bias, the group limit, routed_scaling_factor, the renormalisation,
    the shared experts) changes it well beyond float32 noise."""
    model = transformers.Glm4MoeForCausalLM.from_pretrained(tiny_dir("glm4_moe"), attn_implementation="eager").eval()
    r = open_checkpoint(tiny_dir("glm4_moe")).resolved
    x = run_and_capture(model, r.capture, input_ids=PROMPT)["layers.1.mlp_in"][0]
    manifest, tensors = load(neutral_dir("glm4_moe"))
    spec = manifest.layers[1].mlp.moe
    w = {k.removeprefix("layers.1."): v for k, v in tensors.items() if k.startswith("layers.1.")}
    with torch.no_grad():
        ref = model.model.layers[1].mlp(x[None])[0]
        assert _rel(moe(x, x, w, spec), ref) < 1e-6
        if mistake == "score_bias":
            broken = moe(x, x, {k: v for k, v in w.items() if k != "moe.router.score_bias"}, spec)
        else:
            broken = moe(x, x, w, spec.model_copy(update={mistake: {"groups": 1, "scale": 1.0, "renormalise": False,
                                                                    "shared_experts": None}[mistake]}))
    assert _rel(broken, ref) > 1e-3, mistake


def test_partial_rotary_bites(tiny_dir, neutral_dir, tmp_path):
    """Half of each head rotates (partial_rotary_factor 0.5): a port rotating the whole head fails at the first
    attention output."""
    shutil.copytree(neutral_dir("glm4_moe"), tmp_path / "n")
    manifest = json.loads((tmp_path / "n" / "manifest.json").read_text())
    for layer in manifest["layers"]:
        assert layer["attention"]["rope"]["rotary_dim"] == 16
        layer["attention"]["rope"]["rotary_dim"] = 32
    (tmp_path / "n" / "manifest.json").write_text(json.dumps(manifest))
    report = parity.check(tiny_dir("glm4_moe"), tmp_path / "n", layerwise=True)
    assert report.verdict == "fail" and report.first_divergence.name == "layers.0.attn_out"
