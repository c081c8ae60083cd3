"""The reference executor's MoE (parity/neutral/executor/moe.py) and MLA (parity/neutral/executor/mla.py) against transformers' own
modules: DeepSeek-V3's self_attn and MoE mlp, Gemma 4's router + experts, in float32 and bfloat16.

Weights reach the executor the way an engine would get them: the model is saved, read back through the adapter's
tensor map (parity.checkpoint.open_checkpoint) and turned into neutral tensors (parity.neutral.converter.to_neutral); the
executor's spec is the layer of the neutral model, filled from the adapter's resolved settings.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from parity.neutral.declared import Source, fill
from parity.checkpoint import open_checkpoint
from parity.neutral.converter import to_neutral
from parity.neutral.executor import mla
from parity.neutral.executor.mla import mla_attention
from parity.neutral.executor.moe import moe, route
from parity.neutral.model import Attention, Layer, Moe
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS

# rel_l2 bounds. float32: both sides run the same ops in the same order; only kernel summation order differs
# (measured: 0 for MLA, <= 7e-8 for the MoE, where transformers' grouped_mm kernel sums differently from F.linear).
# bfloat16: the executor reproduces transformers op for op and dtype for dtype, so both make the same roundings and
# the same expert choices (measured: bit-identical, rel_l2 0, for every case below). The bound, 1e-3 (a quarter of
# one bf16 unit roundoff, 2 ** -8), leaves room for the occasional 1-ulp flip where another machine's kernels sum in
# another order, yet sits below what each dtype mistake costs here (measured rel_l2): the MLA norms in bf16
# 5.7e-3..7.3e-3, RoPE in float32 3.3e-3..3.7e-3 (test_mla_mistakes_exceed_the_bound), the expert sum in bf16
# (transformers' own "eager" experts implementation) 2.6e-3..2.8e-3, DeepSeek's router in bf16 1.5e-3..0.13
# (test_moe_bf16_mistakes_exceed_the_bound).
BOUND = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over the whole tensor, computed in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _load(tmp_path, family: str, dtype: torch.dtype, overrides: dict | None = None, **load_options):
    """(transformers model in dtype with eager attention, float32 twin, resolved adapter, neutral tensors)."""
    model = build_model(ADAPTERS[family], overrides=overrides)
    model.save_pretrained(tmp_path / "f32")
    ref = type(model).from_pretrained(tmp_path / "f32", dtype=dtype, attn_implementation="eager", **load_options)
    ref.eval()
    # saved again as loaded: the tensors exactly as the module holds them (DeepSeek keeps its router in float32)
    ref.save_pretrained(tmp_path / "ref")
    ckpt = open_checkpoint(tmp_path / "ref")
    stored = {k: v for f in ckpt.files for k, v in load_file(f).items()}
    neutral = {}
    for hf, t in ckpt.resolved.tensor_map(ckpt.variant.tensor_prefix[0]).items():
        neutral.update(to_neutral(t, stored[hf]))
    return ref, model, ckpt.resolved, neutral


def _layer(neutral: dict, i: int) -> dict:
    prefix = f"layers.{i}."
    return {k[len(prefix):]: v for k, v in neutral.items() if k.startswith(prefix)}


def _spec(r, i: int) -> Layer:
    return fill(Layer, Source(r, i, {"rope_style": r["positions.rope_style"]}))


def _mla_spec(r, i: int) -> Attention:
    return _spec(r, i).attention


def _moe_spec(r, i: int) -> Moe:
    return _spec(r, i).mlp.moe


def _rope_style(att: Attention, style: str) -> Attention:
    return att.model_copy(update={"rope": att.rope.model_copy(update={"style": style})})


def _causal_mask(S: int) -> torch.Tensor:
    return torch.full((S, S), float("-inf")).triu(1)[None, None]  # [1, 1, S, S]


@DTYPES
@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"rope_interleave": False}],
                         ids=["default", "no-q-lora", "half-rope"])
def test_mla_matches_deepseek_v3_attention(tmp_path, dtype, overrides):
    ref, f32, r, neutral = _load(tmp_path, "deepseek_v3", dtype, overrides)
    B, S, H = 2, 12, ref.config.hidden_size
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(S)[None]
    cos, sin = f32.model.rotary_emb(x, positions)                 # float32 [1, S, rope], yarn factor folded in
    mask = _causal_mask(S)
    for i, layer in enumerate(ref.model.layers):
        attn = layer.self_attn
        assert (attn.q_lora_rank is None) == (overrides.get("q_lora_rank", 32) is None)
        with torch.no_grad():
            # transformers hands the layer cos/sin and the mask in the model dtype
            want, _ = attn(x.to(dtype), position_embeddings=(cos.to(dtype), sin.to(dtype)),
                           attention_mask=mask.to(dtype))
            got = mla_attention(x.to(dtype), _layer(neutral, i), _mla_spec(r, i), cos[0], sin[0], mask)
        assert got.dtype == dtype and got.shape == (B, S, H)
        assert rel_l2(got, want) <= BOUND[dtype], f"layer {i}: rel_l2 {rel_l2(got, want):.3g}"


_apply_rope = mla.apply_rope


def _rope_in_float32(x, cos, sin, style):
    """q/k rotated in float32 and rounded once (transformers rotates in the model dtype)."""
    return _apply_rope(x.float(), cos, sin, style).to(x.dtype)


def _norm_in_low_precision(x, weight, norm):
    """The q_a/kv_a RMSNorm computed in the model dtype instead of float32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


# porting mistakes in MLA: (the RoPE style rotated with, a replacement for one of mla.py's functions, dtypes where it
# is a mistake)
MLA_MISTAKES = {
    "rope-permuted": ("half", None, (torch.float32, torch.bfloat16)),
    "mla-norm-dropped": (None, ("rms_norm", lambda x, weight, norm: x), (torch.float32, torch.bfloat16)),
    "norm-in-low-precision": (None, ("rms_norm", _norm_in_low_precision), (torch.bfloat16,)),
    "rope-in-float32": (None, ("apply_rope", _rope_in_float32), (torch.bfloat16,)),
}


@pytest.mark.parametrize("mistake, dtype", [(m, d) for m, (_, _, ds) in MLA_MISTAKES.items() for d in ds],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_mla_mistakes_exceed_the_bound(tmp_path, monkeypatch, mistake, dtype):
    """The comparison above can fail: each porting mistake lands above the bound on every layer."""
    style, patch, _ = MLA_MISTAKES[mistake]
    ref, f32, r, neutral = _load(tmp_path, "deepseek_v3", dtype)
    x = torch.randn(2, 12, ref.config.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = f32.model.rotary_emb(x, torch.arange(12)[None])
    mask = _causal_mask(12)
    if patch is not None:
        monkeypatch.setattr(mla, *patch)
    for i, layer in enumerate(ref.model.layers):
        with torch.no_grad():
            want, _ = layer.self_attn(x.to(dtype), position_embeddings=(cos.to(dtype), sin.to(dtype)),
                                      attention_mask=mask.to(dtype))
            att = _mla_spec(r, i)
            got = mla_attention(x.to(dtype), _layer(neutral, i), _rope_style(att, style) if style else att,
                                cos[0], sin[0], mask)
        assert rel_l2(got, want) > BOUND[dtype], f"layer {i}: {mistake} unseen"


def _deinterleave_rows(x: torch.Tensor, block: int, offset: int, rope: int) -> torch.Tensor:
    """Within every ``block`` rows, reorder rows offset..offset+rope from pairs (0, 1), (2, 3), ... to evens | odds."""
    index = torch.arange(x.shape[0])
    perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    for start in range(offset, x.shape[0], block):
        index[start:start + rope] = start + perm
    return x[index]


@DTYPES
def test_interleaved_is_half_on_deinterleaved_rows(tmp_path, dtype):
    """An engine that rotates half-split may instead reorder the rope rows of q_b and kv_a: bit-identical output."""
    ref, f32, r, neutral = _load(tmp_path, "deepseek_v3", dtype)
    x = torch.randn(2, 12, ref.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    cos, sin = f32.model.rotary_emb(x, torch.arange(12)[None])
    w, spec = _layer(neutral, 0), _mla_spec(r, 0)
    nope, rope, kv_rank = spec.mla.qk_nope_head_dim, spec.mla.qk_rope_head_dim, spec.mla.kv_lora_rank
    permuted = {**w, "attn.q_b.weight": _deinterleave_rows(w["attn.q_b.weight"], nope + rope, nope, rope),
                "attn.kv_a.weight": _deinterleave_rows(w["attn.kv_a.weight"], kv_rank + rope, kv_rank, rope),
                "attn.kv_a.bias": _deinterleave_rows(w["attn.kv_a.bias"], kv_rank + rope, kv_rank, rope)}
    with torch.no_grad():
        interleaved = mla_attention(x, w, spec, cos[0], sin[0], _causal_mask(12))
        half = mla_attention(x, permuted, _rope_style(spec, "half"), cos[0], sin[0], _causal_mask(12))
    assert spec.rope.style == "interleaved"
    assert torch.equal(half, interleaved)


@DTYPES
def test_moe_matches_deepseek_v3_moe(tmp_path, dtype):
    ref, _, r, neutral = _load(tmp_path, "deepseek_v3", dtype)
    H = ref.config.hidden_size
    x = torch.randn(2, 20, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    moe_layers = [i for i in range(r.num_layers) if r.layer("mlp.moe", i)]
    assert moe_layers == [1, 2]
    for i in moe_layers:
        mlp, w, spec = ref.model.layers[i].mlp, _layer(neutral, i), _moe_spec(r, i)
        assert spec.routing == "sigmoid" and spec.groups == 2 and spec.shared_experts == 2
        assert spec.router_norm is None and spec.router_input_scale is None
        with torch.no_grad():
            _, want_weights, want_index = mlp.gate(x)
            weights, index = route(x.view(-1, H), w, spec)
            want = mlp(x)
            got = moe(x.view(-1, H), x.view(-1, H), w, spec).view(x.shape)
        # the same experts with the same float32 weights (order within a token does not matter)
        order, want_order = index.argsort(-1), want_index.argsort(-1)
        assert torch.equal(index.gather(1, order), want_index.gather(1, want_order))
        assert weights.dtype == torch.float32
        torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), rtol=1e-6, atol=0)
        assert got.dtype == dtype
        assert rel_l2(got, want) <= BOUND[dtype], f"layer {i}: rel_l2 {rel_l2(got, want):.3g}"


def test_moe_bf16_mistakes_exceed_the_bound(tmp_path):
    """The bfloat16 bound is tight enough to see an expert sum in bf16 and a router in bf16."""
    ref, _, r, neutral = _load(tmp_path, "deepseek_v3", torch.bfloat16, experts_implementation="eager")
    x = torch.randn(40, ref.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    router_in_bf16 = []
    for i in (1, 2):
        w, spec = _layer(neutral, i), _moe_spec(r, i)
        with torch.no_grad():
            right = moe(x, x, w, spec)  # equals transformers' default (grouped_mm) experts: test above
            eager = ref.model.layers[i].mlp(x)  # transformers' "eager" experts: index_add_ of bf16 products
            assert rel_l2(right, eager) > BOUND[torch.bfloat16]
            router_in_bf16.append(rel_l2(moe(x, x, w, spec.model_copy(update={"router_dtype": "model"})), right))
    assert max(router_in_bf16) > BOUND[torch.bfloat16]


def test_deepseek_v3_routing_exercises_bias_and_groups(tmp_path):
    """The tiny model's routing depends on the selection bias and on the group step (so both are tested above)."""
    ref, _, r, neutral = _load(tmp_path, "deepseek_v3", torch.float32)
    x = torch.randn(40, ref.config.hidden_size, generator=torch.Generator().manual_seed(3))
    w, spec = _layer(neutral, 1), _moe_spec(r, 1)
    with torch.no_grad():
        _, index = route(x, w, spec)
        _, no_bias = route(x, {k: v for k, v in w.items() if k != "moe.router.score_bias"}, spec)
        _, no_groups = route(x, w, spec.model_copy(update={"groups": None}))
    chosen = lambda idx: idx.sort(-1).values  # noqa: E731
    assert (chosen(index) != chosen(no_bias)).any(-1).sum() >= 5
    assert (chosen(index) != chosen(no_groups)).any(-1).sum() >= 5
    # grouped: every token's experts lie in one group of 4
    assert torch.equal(index.max(-1).values // 4, index.min(-1).values // 4)


@DTYPES
def test_moe_matches_gemma4_router_and_experts(tmp_path, dtype):
    ref, _, r, neutral = _load(tmp_path, "gemma4", dtype)
    H = ref.config.hidden_size
    mid = (3.0 * torch.randn(40, H, generator=torch.Generator().manual_seed(4))).to(dtype)
    for i, layer in enumerate(ref.model.layers):
        assert r.layer("mlp.moe", i)
        w, spec = _layer(neutral, i), _moe_spec(r, i)
        assert spec.routing == "softmax" and spec.router_norm.weight is False
        assert spec.router_input_scale == pytest.approx(H ** -0.5, rel=1e-15)
        with torch.no_grad():
            _, want_weights, want_index = layer.router(mid)
            expert_input = layer.pre_feedforward_layernorm_2(mid)
            want = layer.experts(expert_input, want_index, want_weights)
            weights, index = route(mid, w, spec)
            got = moe(mid, expert_input, w, spec)
            unscaled = moe(mid, expert_input, w, spec.model_copy(update={"router_input_scale": None}))
        assert torch.equal(index, want_index)
        torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)
        assert got.dtype == dtype
        assert rel_l2(got, want) <= BOUND[dtype], f"layer {i}: rel_l2 {rel_l2(got, want):.3g}"
        assert rel_l2(unscaled, want) > 10 * BOUND[dtype]  # the hidden ** -0.5 matters
