"""Gemma 1 adapter against transformers, and the per-layer cross-check the Gemma 2/3/4 tests share.

`mismatches(model, r, prefix)` reads what each transformers module holds (norm eps and weightless norms,
per-layer attention scale, head_dim, kv heads, sliding window and softcap, KV sharing, k_eq_v, activation,
intermediate size, RoPE inverse frequencies, embedding scale) and compares it with the resolved adapter.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from parity.adapter import recognise, resolve, text_config
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS, FIXTURES

ACTIVATION_CLASSES = {"gelu_tanh": ("PytorchGELUTanh", "GELUTanh"), "gelu_exact": ("GELUActivation",), "silu": ("SiLU",)}


def _inv_freq(theta: float, rotary_dim: int, head_dim: int, scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies from resolved settings, written out independently of transformers."""
    if scaling and scaling["rope_type"] == "proportional":
        angles = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        freq = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat([freq, torch.zeros(head_dim // 2 - angles)]) / scaling.get("factor", 1.0)
    freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling and scaling["rope_type"] == "linear":
        freq = freq / scaling["factor"]
    return freq


def mismatches(model: torch.nn.Module, r, prefix: str) -> list[str]:
    problems = []
    text = model.config.get_text_config()
    base = model.get_submodule(prefix.rstrip("."))
    ours = {n.hf.replace("{prefix}", prefix): n for n in r.norms}
    for name, module in model.named_modules():
        if name in ours:
            # transformers 5.25's Gemma4RMSNorm keeps it as variance_epsilon, the others as eps
            eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
            if eps != r["norm.eps"]:
                problems.append(f"{name}: eps {eps} != {r['norm.eps']}")
            if getattr(module, "with_scale", True) != ours[name].has_weight:
                problems.append(f"{name}: has_weight")
    for i, layer in enumerate(base.layers):
        attn = layer.self_attn
        got = dict(window=getattr(attn, "sliding_window", None), scale=attn.scaling, head_dim=attn.head_dim,
                   kv_heads=r.layer("attention.heads", i) // attn.num_key_value_groups,
                   softcap=getattr(attn, "attn_logit_softcapping", None), causal=attn.is_causal)
        want = dict(window=r.layer("attention.sliding_window", i), scale=r.layer("attention.scale", i),
                    head_dim=r.layer("attention.head_dim", i), kv_heads=r.layer("attention.kv_heads", i),
                    softcap=r.layer("attention.softcap", i), causal=r.layer("attention.causal", i))
        if got != want:
            problems.append(f"layer {i} attention: transformers {got}, adapter {want}")
        if hasattr(attn, "is_kv_shared_layer"):
            modes, types = text.kv_sharing_modes, text.layer_types
            source = r.layer("attention.kv_shared_from", i)
            if (modes[i] == "reuse") != (source is not None):
                problems.append(f"layer {i}: kv sharing {modes[i]} but kv_shared_from {source}")
            if source is not None and not (modes[source] == "store" and types[source] == types[i]):
                problems.append(f"layer {i}: reuses layer {source}, which does not store its type's k/v")
            if attn.use_alternative_attention != r.layer("attention.k_eq_v", i):
                problems.append(f"layer {i}: k_eq_v")
        act = type(layer.mlp.act_fn).__name__
        if act not in ACTIVATION_CLASSES[r.layer("mlp.activation", i)]:
            problems.append(f"layer {i}: activation {act} vs {r.layer('mlp.activation', i)}")
        if layer.mlp.intermediate_size != r.layer("mlp.intermediate_size", i):
            problems.append(f"layer {i}: intermediate size")
    rotary = base.rotary_emb
    for i in range(r.num_layers):
        kind = text.layer_types[i] if hasattr(rotary, "layer_types") else None
        table = getattr(rotary, f"{kind}_inv_freq") if kind else rotary.inv_freq
        want = _inv_freq(r.layer("positions.rope_theta", i), r.layer("positions.rotary_dim", i),
                         r.layer("attention.head_dim", i), r.layer("positions.rope_scaling", i))
        if table.shape != want.shape or not torch.allclose(table.float(), want):
            problems.append(f"layer {i}: RoPE inverse frequencies differ")
    if base.embed_tokens.scalar_embed_scale != pytest.approx(r["embedding.scale"], rel=1e-12):
        problems.append("embedding scale")
    return problems


def real_model(config: dict):
    """The real config's transformers model on the meta device, with its rotary tables computed on the CPU."""
    adapter, variant = recognise(config, ADAPTERS)
    r = resolve(adapter, variant, text_config(config, variant))
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = getattr(transformers, variant.architectures[0])(cfg)
    base = model.get_submodule(variant.module_prefix.rstrip("."))
    base.rotary_emb = type(base.rotary_emb)(cfg.get_text_config())
    return model, r, variant


def test_tiny_gemma_agrees_with_transformers():
    model = build_model(ADAPTERS["gemma"])
    config = model.config.to_dict()
    adapter, variant = recognise(config, ADAPTERS)
    assert mismatches(model, resolve(adapter, variant, config), variant.module_prefix) == []


def test_real_codegemma_config_agrees_with_transformers():
    model, r, variant = real_model(json.loads((FIXTURES / "configs" / "codegemma-7b-it-ft.json").read_text()))
    assert mismatches(model, r, variant.module_prefix) == []
    assert r["embedding.scale"] == pytest.approx(3072 ** 0.5)
    assert r["norm.weight"] == "one_plus_weight" and r["norm.weight_dtype"] == "float32"


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", None])
def test_legacy_gelu_means_tanh_for_gemma(hidden_act):
    """GemmaConfig rewrites the released configs' hidden_act "gelu" to gelu_pytorch_tanh; so does the adapter."""
    config = json.loads((FIXTURES / "configs" / "codegemma-7b-it-ft.json").read_text())
    config.pop("hidden_activation")
    if hidden_act is None:
        config.pop("hidden_act")
    else:
        config["hidden_act"] = hidden_act
    adapter, variant = recognise(config, ADAPTERS)
    assert resolve(adapter, variant, config)["mlp.activation"] == "gelu_tanh"
    assert transformers.GemmaConfig(**config).hidden_act == "gelu_pytorch_tanh"
