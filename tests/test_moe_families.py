"""Qwen3-MoE and Mixtral: softmax-routed top-k experts, against transformers' own modules.

What the shared family tests do not pin down: that the adapters map the on-disk per-expert layouts
(`mlp.experts.{e}.gate_proj` / `block_sparse_moe.experts.{e}.w1`) tensor for tensor, that the MoE layers are
the ones transformers builds (Qwen3-MoE's `decoder_sparse_step` and `mlp_only_layers`), that the executor
matches transformers at every capture point in float32 and its MoE block bit for bit in bfloat16 (where
the routing weights multiply the experts' outputs: Qwen3-MoE casts them to the model dtype, Mixtral keeps
them float32), and that a router normalisation mistake is caught where it happens.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import parity
from parity.adapter import recognise, resolve
from parity.checkpoint import check_tensors, open_checkpoint
from parity.neutral.converter import convert
from parity.neutral.executor.model import NeutralModel
from parity.neutral.executor.moe import moe, route
from parity.neutral.manifest import load
from parity.reference.capture import run_and_capture
from tests.conftest import ADAPTERS, FIXTURES, real_config

MOE_FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "olmoe", "glm4_moe", "llama4"]
# the families whose checkpoints store each expert's gate, up and down apart (gpt_oss stores them stacked, gate and
# up interleaved in one gate_up_proj)
PER_EXPERT = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "glm4_moe"]
PROMPT = torch.tensor([[(11 * k + 5) % 256 for k in range(48)]])
# the MoE block as transformers names it in memory, and the first MoE layer of each tiny checkpoint
BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock",
          "qwen2_moe": "Qwen2MoeSparseMoeBlock", "glm4_moe": "Glm4MoeMoE"}
# per-expert tensor names on disk (what the released checkpoints hold), by neutral expert tensor
ON_DISK = {
    "qwen3_moe": {"gate": "mlp.experts.{e}.gate_proj.weight", "up": "mlp.experts.{e}.up_proj.weight",
                  "down": "mlp.experts.{e}.down_proj.weight", "router": "mlp.gate.weight"},
    "mixtral": {"gate": "block_sparse_moe.experts.{e}.w1.weight", "up": "block_sparse_moe.experts.{e}.w3.weight",
                "down": "block_sparse_moe.experts.{e}.w2.weight", "router": "block_sparse_moe.gate.weight"},
    "gpt_oss": {"router": "mlp.router.weight"},
    "llama4": {"router": "feed_forward.router.weight"},
    "qwen2_moe": {"gate": "mlp.experts.{e}.gate_proj.weight", "up": "mlp.experts.{e}.up_proj.weight",
                  "down": "mlp.experts.{e}.down_proj.weight", "router": "mlp.gate.weight"},
    "olmoe": {"gate": "mlp.experts.{e}.gate_proj.weight", "up": "mlp.experts.{e}.up_proj.weight",
              "down": "mlp.experts.{e}.down_proj.weight", "router": "mlp.gate.weight"},
    "glm4_moe": {"gate": "mlp.experts.{e}.gate_proj.weight", "up": "mlp.experts.{e}.up_proj.weight",
                 "down": "mlp.experts.{e}.down_proj.weight", "router": "mlp.gate.weight"},
}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _moe_layers(r) -> list[int]:
    return [i for i in range(r.num_layers) if r.layer("mlp.moe", i)]


# --------------------------------------------------------------------------------------------
# The tensor map


@pytest.mark.parametrize("family", PER_EXPERT)
def test_every_tensor_of_the_tiny_checkpoint_is_mapped_expert_by_expert(family, tiny_dir):
    ckpt = open_checkpoint(tiny_dir(family))
    r = ckpt.resolved
    check = check_tensors(r, ckpt.tensors)
    assert check.ok, check.problems()
    assert check.matched == len(ckpt.tensors)
    with safe_open(tiny_dir(family) / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    mapped = set(r.tensor_map("model.").keys())
    assert mapped == stored
    # transformers 5 fuses the experts in memory but writes them back one by one, as the released checkpoints hold them
    assert not any("gate_up_proj" in name for name in stored)
    experts = r.layer("mlp.experts", _moe_layers(r)[0])
    for i in _moe_layers(r):
        for part, template in ON_DISK[family].items():
            names = [f"model.layers.{i}.{template.format(e=e)}" for e in range(experts)] if "{e}" in template \
                else [f"model.layers.{i}.{template}"]
            for name in names:
                target = r.tensor_map("model.")[name].neutral
                expected = f"layers.{i}.moe.router.weight" if part == "router" else \
                    f"layers.{i}.moe.experts.{name.split('.experts.')[1].split('.')[0]}.{part}.weight"
                assert target == (expected,), name
    # the dense MLP exists exactly on the layers that are not MoE
    dense = {i for i in range(r.num_layers) if f"model.layers.{i}.mlp.gate_proj.weight" in stored}
    assert dense == set(range(r.num_layers)) - set(_moe_layers(r))


def test_gpt_oss_stacked_experts_become_each_experts_gate_up_and_down(tiny_dir, neutral_dir):
    """GptOssExperts computes ``x @ gate_up_proj[e] + gate_up_proj_bias[e]`` ([E, in, out]), gate the even outputs,
    up the odd ones: each expert's neutral gate/up/down are those columns, transposed to [out, in], with their
    biases."""
    ckpt = open_checkpoint(tiny_dir("gpt_oss"))
    r = ckpt.resolved
    check = check_tensors(r, ckpt.tensors)
    assert check.ok and check.matched == len(ckpt.tensors), check.problems()
    stored = load_file(tiny_dir("gpt_oss") / "model.safetensors")
    assert set(r.tensor_map("model.")) == set(stored)
    _, tensors = load(neutral_dir("gpt_oss"))
    assert _moe_layers(r) == list(range(r.num_layers))
    for i in _moe_layers(r):
        p = f"model.layers.{i}.mlp."
        gate_up, bias = stored[p + "experts.gate_up_proj"], stored[p + "experts.gate_up_proj_bias"]
        for e in range(r.layer("mlp.experts", i)):
            n = f"layers.{i}.moe.experts.{e}."
            assert torch.equal(tensors[n + "gate.weight"], gate_up[e][:, ::2].t())
            assert torch.equal(tensors[n + "up.weight"], gate_up[e][:, 1::2].t())
            assert torch.equal(tensors[n + "gate.bias"], bias[e][::2])
            assert torch.equal(tensors[n + "up.bias"], bias[e][1::2])
            assert torch.equal(tensors[n + "down.weight"], stored[p + "experts.down_proj"][e].t())
            assert torch.equal(tensors[n + "down.bias"], stored[p + "experts.down_proj_bias"][e])
        assert torch.equal(tensors[f"layers.{i}.moe.router.bias"], stored[p + "router.bias"])
        assert torch.equal(tensors[f"layers.{i}.attn.sinks"], stored[f"model.layers.{i}.self_attn.sinks"])


def test_gpt_oss_conventions_resolve_from_transformers_defaults():
    """No verbatim released config is vendored: GptOssConfig's own defaults (gpt-oss-120b's shape) resolve to its
    conventions, and the tensors the adapter expects are exactly the parameters transformers builds."""
    a = ADAPTERS["gpt_oss"]
    config = {**transformers.GptOssConfig(num_hidden_layers=4).to_dict(), "architectures": ["GptOssForCausalLM"]}
    r = resolve(a, a.spec.variants[0], config)
    assert [r.layer("attention.sliding_window", i) for i in range(4)] == [128, None, 128, None]
    assert r["attention.sinks"] is True and r["mlp.moe_routing"] == "topk_softmax"
    assert (r["mlp.glu_limit"], r["mlp.glu_alpha"], r["mlp.glu_up_offset"]) == (7.0, 1.702, 1.0)
    assert (r.layer("mlp.experts", 0), r.layer("mlp.experts_per_token", 0)) == (128, 4)
    scaling = r.layer("positions.rope_scaling", 0)
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 32.0 and scaling["truncate"] is False
    assert r.layer("positions.rope_theta", 0) == 150000.0
    cfg = transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(cfg)
    assert sum(t.numel for t in r.tensors) == sum(p.numel() for p in model.parameters())


def test_the_tiny_qwen3_moe_has_both_kinds_of_layer(tiny_dir):
    r = open_checkpoint(tiny_dir("qwen3_moe")).resolved
    assert _moe_layers(r) == [0, 2]  # layer 1 in mlp_only_layers: the dense Qwen3MoeMLP
    assert r["mlp.moe_renormalise"] is True and r["mlp.moe_weights_dtype"] == "model"
    assert r.layer("mlp.experts", 0) == 8 and r.layer("mlp.experts_per_token", 0) == 2


@pytest.mark.parametrize("overrides", [
    {},
    {"decoder_sparse_step": 2},
    {"decoder_sparse_step": 2, "mlp_only_layers": [3]},
    {"mlp_only_layers": [0, 2]},
    {"decoder_sparse_step": 3, "mlp_only_layers": [1]},
])
def test_qwen3_moe_layers_are_where_transformers_builds_them(overrides):
    config = {**real_config("qwen3-30b-a3b.json"), "num_hidden_layers": 6, **overrides}
    adapter, variant = recognise(config, ADAPTERS)
    r = resolve(adapter, variant, config)
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(cfg)
    built = [i for i, layer in enumerate(model.model.layers) if type(layer.mlp).__name__ == BLOCKS["qwen3_moe"]]
    assert _moe_layers(r) == built
    assert sum(t.numel for t in r.tensors) == sum(p.numel() for p in model.parameters())


def test_real_configs_resolve_to_their_routing():
    q = ADAPTERS["qwen3_moe"]
    config = real_config("qwen3-30b-a3b.json")
    r = resolve(q, q.spec.variants[0], config)
    assert _moe_layers(r) == list(range(48))
    assert (r.layer("mlp.experts", 0), r.layer("mlp.experts_per_token", 0), r.layer("mlp.moe_intermediate_size", 0)) \
        == (128, 8, 768)
    assert r["mlp.moe_routing"] == "softmax" and r["mlp.moe_renormalise"] is True
    assert r["mlp.moe_weights_dtype"] == "model" and r["mlp.moe_router_dtype"] == "model"
    assert r["attention.qk_norm"] == "per_head" and r["attention.sliding_window"] is None
    # a config saved by transformers 5 spells the expert count num_local_experts
    saved = {k: v for k, v in config.items() if k != "num_experts"} | {"num_local_experts": 64}
    assert resolve(q, q.spec.variants[0], saved).layer("mlp.experts", 0) == 64
    assert resolve(q, q.spec.variants[0], {**config, "norm_topk_prob": False})["mlp.moe_renormalise"] is False

    m = ADAPTERS["mixtral"]
    r = resolve(m, m.spec.variants[0], real_config("mixtral-8x7b-v0.1.json"))
    assert _moe_layers(r) == list(range(32))
    assert (r.layer("mlp.experts", 0), r.layer("mlp.experts_per_token", 0), r.layer("mlp.moe_intermediate_size", 0)) \
        == (8, 2, 14336)
    assert r["mlp.moe_renormalise"] is True and r["mlp.moe_weights_dtype"] == "float32"
    assert r["attention.sliding_window"] is None and r["positions.rope_theta"] == 1e6


# --------------------------------------------------------------------------------------------
# The executor against transformers


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_executor_matches_transformers_at_every_capture_point_in_float32(family, tiny_dir, neutral_dir):
    ckpt = open_checkpoint(tiny_dir(family))
    model = getattr(transformers, ckpt.variant.architectures[0]).from_pretrained(
        tiny_dir(family), attn_implementation="eager").eval()
    ref = run_and_capture(model, ckpt.resolved.capture, input_ids=PROMPT)
    manifest, tensors = load(neutral_dir(family))
    ours: dict[str, torch.Tensor] = {}
    NeutralModel(manifest, tensors)(PROMPT, on_point=lambda name, t: ours.setdefault(name, t.clone()))
    assert list(ours) == list(ref)
    for name in ref:
        assert rel_l2(ours[name], ref[name]) < 1e-5, name
    # every MoE layer's block changes the stream (an MoE output that vanished would match trivially)
    for i in _moe_layers(ckpt.resolved):
        assert ref[f"layers.{i}.mlp_out"].abs().mean() > 0.1 * ref[f"layers.{i}.mid"].abs().mean()


@pytest.mark.parametrize("family", PER_EXPERT)
def test_the_moe_block_matches_transformers_bit_for_bit_in_bfloat16(family, tiny_dir, neutral_dir):
    """Where the routing weights multiply the experts' outputs (weights_dtype) is the only rounding a bf16 MoE adds:
    with the family's choice the block is transformers' to the bit; with the other one it is not. A float32 router
    (router_dtype: GLM-4.5's, kept so by _keep_in_fp32_modules_strict) stays float32 on both sides."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir(family), dtype=torch.bfloat16).eval()
    manifest, tensors = load(neutral_dir(family))
    torch.manual_seed(0)
    x = torch.randn(256, manifest.hidden_size).to(torch.bfloat16)
    for i, layer in enumerate(manifest.layers):
        spec = layer.mlp.moe
        if spec is None:
            continue
        w = {}
        for name, v in tensors.items():
            k = name.removeprefix(f"layers.{i}.")
            if k != name:
                w[k] = v if spec.router_dtype == "float32" and k.startswith("moe.router.") else v.to(torch.bfloat16)
        with torch.no_grad():
            ref = model.model.layers[i].mlp(x[None])[0]
            ours = moe(x, x, w, spec)
            other = moe(x, x, w, spec.model_copy(
                update={"weights_dtype": "float32" if spec.weights_dtype == "model" else "model"}))
        assert ours.dtype == torch.bfloat16
        assert torch.equal(ours, ref) or rel_l2(ours, ref) < 1e-4, (i, rel_l2(ours, ref))
        assert not torch.equal(other, ref)
        assert route(x, w, spec)[1].unique().numel() == spec.experts  # every expert is chosen by some token


def test_the_gpt_oss_moe_block_matches_transformers_in_bfloat16(tiny_dir, neutral_dir):
    """Routing and gated units as transformers computes them in bf16. Not to the bit: transformers multiplies by the
    fused, interleaved gate_up_proj, whose bf16 products round differently now and then from the split ones."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir("gpt_oss"), dtype=torch.bfloat16).eval()
    manifest, tensors = load(neutral_dir("gpt_oss"))
    torch.manual_seed(0)
    x = torch.randn(256, manifest.hidden_size).to(torch.bfloat16)
    for i, layer in enumerate(manifest.layers):
        spec = layer.mlp.moe
        w = {k.removeprefix(f"layers.{i}."): v.to(torch.bfloat16) for k, v in tensors.items()
             if k.startswith(f"layers.{i}.")}
        with torch.no_grad():
            _, scores, index = model.model.layers[i].mlp.router(x)
            weights, chosen = route(x, w, spec)
            ref = model.model.layers[i].mlp(x[None])[0][0]
            ours = moe(x, x, w, spec)
        assert torch.equal(chosen, index) and torch.equal(weights.to(torch.bfloat16), scores)
        assert ours.dtype == torch.bfloat16 and rel_l2(ours, ref) < 1e-4, (i, rel_l2(ours, ref))
        for broken in ({"glu_limit": None}, {"glu_up_offset": 0.0}, {"routing": "softmax"}):
            with torch.no_grad():
                assert rel_l2(moe(x, x, w, spec.model_copy(update=broken)), ref) > 1e-2, broken


def test_the_llama4_moe_block_matches_transformers_bit_for_bit_in_bfloat16(tiny_dir, neutral_dir):
    """Llama 4's top-1 sigmoid router scales each chosen expert's input (experts(x * w)), and its shared expert is
    added: bit for bit in bf16 on x86 with AVX-512 BF16; on AVX2 alone a few values are one bf16 step apart (rel_l2
    2.3e-5: transformers runs every expert as one bmm over all tokens, the executor each expert over its own, and
    the CPU's bf16 GEMM sums them in another order). Weighting the experts' outputs instead (as every other MoE
    family does) is 0.05 and more away."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir("llama4"), dtype=torch.bfloat16).eval()
    manifest, tensors = load(neutral_dir("llama4"))
    torch.manual_seed(0)
    x = torch.randn(256, manifest.hidden_size).to(torch.bfloat16)
    moe_layers = [i for i, layer in enumerate(manifest.layers) if layer.mlp.moe is not None]
    assert moe_layers == [1, 3]  # interleave_moe_layer_step 2
    for i in moe_layers:
        spec = manifest.layers[i].mlp.moe
        w = {k.removeprefix(f"layers.{i}."): v.to(torch.bfloat16) for k, v in tensors.items()
             if k.startswith(f"layers.{i}.")}
        with torch.no_grad():
            ref = model.model.layers[i].feed_forward(x[None])[0]        # [T, D]: the block flattens the tokens
            ours = moe(x, x, w, spec)
            on_output = moe(x, x, w, spec.model_copy(update={"weights_input": False}))
        assert spec.routing == "topk_sigmoid" and spec.top_k == 1 and spec.shared_experts == 1
        assert torch.equal(ours, ref) or rel_l2(ours, ref) < 1e-4, (i, rel_l2(ours, ref))
        assert rel_l2(on_output, ref) > 0.05
        assert route(x, w, spec)[1].unique().numel() == spec.experts


# --------------------------------------------------------------------------------------------
# A router mistake is caught where it happens


def _first_moe_mlp_out(family: str, tiny_dir) -> str:
    return f"layers.{_moe_layers(open_checkpoint(tiny_dir(family)).resolved)[0]}.mlp_out"


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_flipped_router_normalisation_in_the_manifest_fails_at_the_first_moe_mlp_out(family, tiny_dir, neutral_dir,
                                                                                       tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(neutral_dir(family), broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    for layer in manifest["layers"]:
        moe_spec = layer["mlp"]["moe"]
        if moe_spec is not None and moe_spec["routing"] == "topk_softmax":  # its k weights sum to 1 already
            moe_spec["routing"] = "softmax"  # softmax over every expert's logit, then top-k: not renormalised
        elif moe_spec is not None:
            moe_spec["renormalise"] = not moe_spec["renormalise"]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    report = parity.check(tiny_dir(family), broken, layerwise=True, calibrate=True)
    first = _first_moe_mlp_out(family, tiny_dir)
    assert report.verdict == "fail" and report.exit_code == 1
    assert report.first_divergence.name == first
    names = [p.name for p in report.points]
    assert all(p.passed for p in report.points[: names.index(first)])
    assert parity.check(tiny_dir(family), neutral_dir(family), layerwise=True, calibrate=True).verdict == "pass"


def test_a_qwen3_moe_checkpoint_with_norm_topk_prob_flipped_fails_at_the_first_moe_mlp_out(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir("qwen3_moe"), broken)
    config = json.loads((broken / "config.json").read_text())
    assert config["norm_topk_prob"] is True
    config["norm_topk_prob"] = False
    (broken / "config.json").write_text(json.dumps(config))
    report = parity.check(tiny_dir("qwen3_moe"), broken, layerwise=True)
    assert report.verdict == "fail" and report.first_divergence.name == _first_moe_mlp_out("qwen3_moe", tiny_dir)
    # converted, the flipped checkpoint states its (wrong) normalisation in the manifest, and fails the same way
    convert(broken, tmp_path / "broken.neutral")
    manifest, _ = load(tmp_path / "broken.neutral")
    assert [moe.renormalise for moe in manifest.moes()] == [False, False]
    again = parity.check(tiny_dir("qwen3_moe"), tmp_path / "broken.neutral", layerwise=True)
    assert again.first_divergence.name == report.first_divergence.name


# llama4: not loadable so (Llama4ForCausalLM's base_model_prefix is "language_model"); its adapter declares no "" prefix
@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if f != "llama4"])
def test_saved_without_the_model_prefix_and_streamed(family, tiny_dir, tmp_path):
    """Saved from the base model (``layers.0.block_sparse_moe.experts.0.w1.weight``, no ``model.``): recognised,
    converted and checked a layer at a time, transformers' loader renaming and fusing each layer's experts."""
    path = tmp_path / family
    shutil.copytree(tiny_dir(family), path)
    tensors = load_file(path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    ckpt = open_checkpoint(path)
    first = _moe_layers(ckpt.resolved)[0]  # GLM-4.5's layer 0 is dense
    assert ckpt.check().ok and f"layers.{first}.{ON_DISK[family]['router']}" in ckpt.tensors
    convert(path, tmp_path / "n")
    report = parity.check(path, tmp_path / "n", layerwise=True, stream=True)
    assert report.verdict == "pass" and max(p.rel_l2 for p in report.points) < 1e-5


def test_the_real_configs_are_vendored_with_their_sources():
    sources = (FIXTURES / "configs" / "SOURCES.md").read_text()
    for name in ("qwen3-30b-a3b.json", "mixtral-8x7b-v0.1.json"):
        assert f"| {name} |" in sources


# --------------------------------------------------------------------------------------------
# Qwen2-MoE's gated shared expert and layer rules, OLMoE's defaults


@pytest.mark.parametrize("overrides", [
    {},
    {"decoder_sparse_step": 2, "mlp_only_layers": [3]},
    {"use_sliding_window": True, "max_window_layers": 4, "sliding_window": 32},
    {"qkv_bias": False, "shared_expert_intermediate_size": 96},
])
def test_qwen2_moe_conventions_are_what_transformers_builds(overrides):
    """No verbatim released config is vendored: Qwen2MoeConfig's own defaults (Qwen1.5-MoE-A2.7B's shape) resolve
    to the MoE layers, windows and tensors transformers builds, the shared expert gated."""
    a = ADAPTERS["qwen2_moe"]
    cfg = transformers.Qwen2MoeConfig(num_hidden_layers=6, hidden_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
                                      vocab_size=256, **overrides)
    config = {**cfg.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]}
    config.pop("layer_types")  # as the released configs hold it: derived from use_sliding_window / max_window_layers
    r = resolve(a, a.spec.variants[0], config)
    with torch.device("meta"):
        model = transformers.Qwen2MoeForCausalLM(cfg)
    built = [i for i, layer in enumerate(model.model.layers) if type(layer.mlp).__name__ == BLOCKS["qwen2_moe"]]
    assert _moe_layers(r) == built
    windows = [r.layer("attention.sliding_window", i) for i in range(6)]
    assert windows == [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
    assert sum(t.numel for t in r.tensors) == sum(p.numel() for p in model.parameters())
    assert r["mlp.moe_shared_gate"] is True and r["mlp.moe_renormalise"] is False
    assert r["mlp.moe_shared_intermediate_size"] == cfg.shared_expert_intermediate_size
    assert r["attention.q_bias"] is cfg.qkv_bias


def test_the_qwen2_moe_shared_expert_and_its_gate_are_mapped_and_gate_the_output(tiny_dir, neutral_dir):
    r = open_checkpoint(tiny_dir("qwen2_moe")).resolved
    assert _moe_layers(r) == [0, 2]
    tmap = r.tensor_map("model.")
    for i in _moe_layers(r):
        gate = tmap[f"model.layers.{i}.mlp.shared_expert_gate.weight"]
        assert gate.neutral == (f"layers.{i}.moe.shared_gate.weight",)
        for part in ("gate", "up", "down"):
            assert tmap[f"model.layers.{i}.mlp.shared_expert.{part}_proj.weight"].neutral == \
                (f"layers.{i}.moe.shared.{part}.weight",)
    manifest, tensors = load(neutral_dir("qwen2_moe"))
    spec = manifest.layers[0].mlp.moe
    assert spec.shared_gate is True and spec.shared_experts == 1 and spec.shared_intermediate_size == 48
    w = {k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")}
    x = torch.randn(16, manifest.hidden_size)
    assert rel_l2(moe(x, x, w, spec.model_copy(update={"shared_gate": False})), moe(x, x, w, spec)) > 1e-2


def test_olmoe_conventions_resolve_from_transformers_defaults():
    a = ADAPTERS["olmoe"]
    cfg = transformers.OlmoeConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=32, num_experts=8, vocab_size=256)
    config = {**cfg.to_dict(), "architectures": ["OlmoeForCausalLM"]}
    r = resolve(a, a.spec.variants[0], config)
    assert _moe_layers(r) == [0, 1] and r["attention.qk_norm"] == "full_width"
    assert r["mlp.moe_renormalise"] is False and r["mlp.moe_weights_dtype"] == "model" and r["norm.eps"] == 1e-5
    with torch.device("meta"):
        model = transformers.OlmoeForCausalLM(cfg)
    assert sum(t.numel for t in r.tensors) == sum(p.numel() for p in model.parameters())
    with pytest.raises(parity.ParityError, match="clip_qkv"):  # the neutral layout has no q/k/v clamp
        resolve(a, a.spec.variants[0], {**config, "clip_qkv": 8.0})
