"""parity.rope (the frequencies, the permutations) and parity.neutral.executor.rope (the rotation) against transformers' own
rotary embeddings, layer by layer.

For every RoPE family's tiny config, every real config in fixtures/configs and a set of scaling variants, the
rope dict is built from the adapter's resolved settings and its cos/sin tables are compared with what the
transformers model's rotary embedding module returns, at positions up to and past every scaling threshold.
The rotation itself is compared with each family's apply_rotary_pos_emb, and the half <-> interleaved
checkpoint permutations are checked to leave attention scores unchanged.
"""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import transformers

from parity import rope as M
from parity.adapter import recognise, resolve, text_config
from parity.neutral.executor import rope as R
from parity.neutral.model import Rope
from parity.reference.tiny import tiny_config
from tests.conftest import ADAPTERS, FIXTURES

CONFIGS = sorted(p.name for p in (FIXTURES / "configs").glob("*.json"))


def _resolved(config: dict):
    adapter, variant = recognise(config, ADAPTERS)
    return resolve(adapter, variant, text_config(config, variant)), variant


def _tiny_config(family: str) -> dict:
    architecture, kwargs = tiny_config(ADAPTERS[family])
    return {**kwargs, "architectures": [architecture]}


def _real_config(name: str) -> dict:
    return json.loads((FIXTURES / "configs" / name).read_text())


ROPE_FAMILIES = [f for f in ADAPTERS if _resolved(_tiny_config(f))[0]["positions.kind"] == "rope"]
ROPE_CONFIGS = [n for n in CONFIGS if _resolved(_real_config(n))[0]["positions.kind"] == "rope"]


def as_rope(rope: dict) -> Rope:
    """A layer's RoPE as the neutral model holds it, from the dict these tests write."""
    return Rope.model_validate({"scaling": None, "max_positions": None, **rope})


def inv_freq(rope: dict, *args, **kwargs):
    return M.inv_freq(as_rope(rope), *args, **kwargs)


def cos_sin(rope: dict, *args, **kwargs):
    return R.cos_sin(as_rope(rope), *args, **kwargs)


def apply(x, cos, sin, rope: dict):
    return R.apply(x, cos, sin, as_rope(rope))


def rope_of(r, i: int) -> dict:
    """Layer i's rope dict (the manifest format), from parity's resolved settings only."""
    return {
        "theta": r.layer("positions.rope_theta", i),
        "style": r.layer("positions.rope_style", i),
        "rotary_dim": r.layer("positions.rotary_dim", i),
        "head_dim": r.layer("attention.qk_rope_head_dim", i) or r.layer("attention.head_dim", i),
        "scaling": r.layer("positions.rope_scaling", i),
        "max_positions": r["positions.max_positions"],
    }


def positions_for(rope: dict) -> torch.Tensor:
    """0..63 and each side of every length where a scaling changes regime, up to twice max_positions."""
    scaling = rope["scaling"] or {}
    edges = [rope["max_positions"], 2 * rope["max_positions"]]
    old = scaling.get("original_max_position_embeddings")
    if old:
        edges += [old, 2 * old]
        for key in ("low_freq_factor", "high_freq_factor"):
            if scaling.get(key):
                edges.append(int(old / scaling[key]))
    picked = set(range(64)) | {e + d for e in edges for d in (-1, 0, 1)}
    return torch.tensor(sorted(picked), dtype=torch.int64)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude (absolute if the reference is all 0)."""
    diff = (ours.double() - ref.double()).abs().max()
    return float(diff / ref.double().abs().max() if ref.any() else diff)


def to_half_layout(t: torch.Tensor, rope: dict) -> torch.Tensor:
    """An interleaved table or tensor in transformers' half layout (its tables are always cat(freqs, freqs))."""
    if rope["style"] == "half":
        return t
    r = rope["rotary_dim"]
    return t[..., M.half_permutation(t.shape[-1], r)]


def reference_cos_sin(module, positions: torch.Tensor, layer_type: str | None):
    """The transformers rotary module's float32 cos/sin for one sequence of positions: [S, r] each."""
    x = torch.zeros(1, dtype=torch.float32)
    kwargs = {"layer_type": layer_type} if "layer_type" in inspect.signature(module.forward).parameters else {}
    out = module(x, positions[None], **kwargs)
    if isinstance(out, torch.Tensor) and out.is_complex():  # Llama 4: freqs_cis, cos + i sin, one per pair [S, r/2]
        return out[0].real.float(), out[0].imag.float()
    cos, sin = out
    return cos[0], sin[0]


def check_every_layer(r, module_factory, layer_types) -> int:
    """Compare every layer's cos/sin with transformers; returns the number of layers compared."""
    for i in range(r.num_layers):
        rope = rope_of(r, i)
        positions = positions_for(rope)
        ref_cos, ref_sin = reference_cos_sin(module_factory(), positions, layer_types[i] if layer_types else None)
        cos, sin = cos_sin(rope, positions)
        assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (len(positions), rope["rotary_dim"])
        # transformers' tables are cat(freqs, freqs), except where the model rotates adjacent pairs itself
        # (Cohere: repeat_interleave), each frequency then repeated for its pair
        pairs = torch.equal(ref_cos[..., 0::2], ref_cos[..., 1::2])
        if ref_cos.shape[-1] == rope["rotary_dim"] // 2:  # GPT-OSS, Llama 4: one angle per pair, [S, r/2]
            one = slice(0, None, 2) if rope["style"] == "interleaved" else slice(0, rope["rotary_dim"] // 2)
            cos, sin, pairs = cos[..., one], sin[..., one], True
        assert rel_err(cos if pairs else to_half_layout(cos, rope), ref_cos) <= 1e-6, f"layer {i}: cos"
        assert rel_err(sin if pairs else to_half_layout(sin, rope), ref_sin) <= 1e-6, f"layer {i}: sin"
    return r.num_layers


# --------------------------------------------------------------------------------------------
# cos/sin tables against transformers


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_tiny_config_tables_match_transformers(family):
    config = _tiny_config(family)
    r, variant = _resolved(config)
    model_cls = getattr(transformers, config["architectures"][0])
    kwargs = {k: v for k, v in config.items() if k != "architectures"}
    model = model_cls(model_cls.config_class(**kwargs))  # on the CPU: the model's own rotary tables
    base = model.get_submodule(variant.module_prefix.rstrip("."))
    text = model.config.get_text_config()
    assert check_every_layer(r, lambda: base.rotary_emb, getattr(text, "layer_types", None)) >= 1


@pytest.mark.parametrize("name", ROPE_CONFIGS)
def test_real_config_tables_match_transformers(name):
    config = _real_config(name)
    r, variant = _resolved(config)
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = getattr(transformers, variant.architectures[0])(cfg)
    rotary_cls = type(model.get_submodule(variant.module_prefix.rstrip(".")).rotary_emb)
    text = cfg.get_text_config()
    check_every_layer(r, lambda: rotary_cls(text), getattr(text, "layer_types", None))


TINY_LLAMA = _tiny_config("llama")
SCALING_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-no-original": {"rope_type": "yarn", "factor": 8.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                          "attention_factor": 1.25, "truncate": False},
    "llama3-no-original": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                 "long_factor": [1.0, 1.5, 2.2, 3.1, 4.2, 5.5, 7.0, 8.0]},
}


@pytest.mark.parametrize("kind", SCALING_VARIANTS)
def test_scaling_variants_match_transformers(kind):
    """Each scaling type on a tiny Llama, a fresh module per call (dynamic and longrope keep state)."""
    config = {**TINY_LLAMA, "rope_scaling": SCALING_VARIANTS[kind]}
    r, _ = _resolved(config)
    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    check_every_layer(r, lambda: transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg), None)
    rope = rope_of(r, 0)
    for length in (1, 100, 256, 257, 300, 1000):  # short, long, and around max_positions 256 / original 64
        positions = torch.arange(length)
        module = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
        ref_cos, ref_sin = reference_cos_sin(module, positions, None)
        cos, sin = cos_sin(rope, positions)
        assert rel_err(cos, ref_cos) <= 1e-6 and rel_err(sin, ref_sin) <= 1e-6, length


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_gemma3_global_layer_scaling_matches_transformers(scaling):
    """Gemma 3 scales only its full-attention layers; the sliding ones keep their own base, unscaled."""
    config = {**_tiny_config("gemma3"), "rope_scaling": scaling}
    r, _ = _resolved(config)
    cfg = transformers.Gemma3TextConfig(**{k: v for k, v in config.items() if k != "architectures"})
    make = lambda: transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(cfg)  # noqa: E731
    check_every_layer(r, make, cfg.layer_types)
    assert rope_of(r, 0)["scaling"] is None and rope_of(r, 1)["scaling"]["rope_type"] == scaling["rope_type"]


# --------------------------------------------------------------------------------------------
# Inverse frequencies and attention factors, as numbers


def test_unscaled_tables_by_hand():
    rope = {"theta": 100.0, "style": "half", "rotary_dim": 4, "head_dim": 6, "scaling": None, "max_positions": 8}
    inv, attention = inv_freq(rope)
    assert inv.tolist() == pytest.approx([1.0, 0.1]) and attention == 1.0
    cos, sin = cos_sin(rope, torch.tensor([0, 2]))
    assert cos[0].tolist() == [1.0] * 4 and sin[0].tolist() == [0.0] * 4
    assert cos[1].tolist() == pytest.approx([math.cos(2), math.cos(0.2)] * 2, rel=1e-6)
    cos, sin = cos_sin({**rope, "style": "interleaved"}, torch.tensor([2]))
    assert sin[0].tolist() == pytest.approx([math.sin(2), math.sin(2), math.sin(0.2), math.sin(0.2)], rel=1e-6)


def test_attention_factors():
    base = {"theta": 10000.0, "style": "half", "rotary_dim": 16, "head_dim": 16, "max_positions": 256}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert inv_freq({**base, "scaling": yarn})[1] == pytest.approx(0.1 * math.log(4) + 1)
    deepseek = {**yarn, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert inv_freq({**base, "scaling": deepseek})[1] == 1.0  # mscale / mscale_all_dim; softmax scale carries it
    cos, _ = cos_sin({**base, "scaling": {**yarn, "attention_factor": 2.0}}, torch.tensor([0]))
    assert cos.tolist() == [[2.0] * 16]
    for kind in ({"rope_type": "linear", "factor": 8.0}, {"rope_type": "dynamic", "factor": 2.0},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}):
        assert inv_freq({**base, "scaling": kind}, seq_len=1000)[1] == 1.0


def test_proportional_keeps_full_width_and_zeroes_the_rest():
    rope = {"theta": 1e6, "style": "half", "rotary_dim": 32, "head_dim": 32, "max_positions": 256,
            "scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25}}
    inv, _ = inv_freq(rope)
    assert inv.shape == (16,) and inv[4:].eq(0).all()
    assert inv[:4].tolist() == pytest.approx([1e6 ** (-2 * k / 32) for k in range(4)], rel=1e-6)  # spaced by head_dim
    x = torch.randn(1, 2, 5, 32)
    out = apply(x, *cos_sin(rope, torch.arange(5)), rope)
    still = torch.cat((torch.arange(4, 16), torch.arange(20, 32)))
    assert torch.equal(out[..., still], x[..., still])  # zero-frequency pairs do not move


def test_linear_and_llama3_scale_the_right_frequencies():
    base = {"theta": 500000.0, "style": "half", "rotary_dim": 128, "head_dim": 128, "max_positions": 131072}
    plain, _ = inv_freq({**base, "scaling": None})
    linear, _ = inv_freq({**base, "scaling": {"rope_type": "linear", "factor": 8.0}})
    assert torch.equal(linear, plain / 8.0)
    llama3, _ = inv_freq({**base, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    wavelen = 2 * math.pi / plain
    assert torch.equal(llama3[wavelen < 2048], plain[wavelen < 2048])          # fast: kept
    assert torch.equal(llama3[wavelen > 8192], plain[wavelen > 8192] / 8.0)    # slow: divided by factor
    medium = (wavelen > 2048) & (wavelen < 8192)
    assert medium.any() and ((llama3[medium] < plain[medium]) & (llama3[medium] > plain[medium] / 8)).all()


def test_dynamic_grows_only_past_max_positions():
    rope = {"theta": 10000.0, "style": "half", "rotary_dim": 16, "head_dim": 16, "max_positions": 256,
            "scaling": {"rope_type": "dynamic", "factor": 2.0}}
    plain, _ = inv_freq({**rope, "scaling": None})
    assert torch.equal(inv_freq(rope)[0], plain) and torch.equal(inv_freq(rope, 256)[0], plain)
    grown, _ = inv_freq(rope, 512)
    theta = 10000.0 * (2.0 * 512 / 256 - 1) ** (16 / 14)
    assert grown.tolist() == pytest.approx([theta ** (-2 * k / 16) for k in range(8)], rel=1e-6)


def test_unknown_scaling_type_is_named():
    rope = {"theta": 1.0, "style": "half", "rotary_dim": 4, "head_dim": 4, "max_positions": 8,
            "scaling": {"rope_type": "mrope"}}
    with pytest.raises(ValueError, match="'mrope' is not implemented"):
        inv_freq(rope)


# --------------------------------------------------------------------------------------------
# The rotation against each family's apply_rotary_pos_emb


def _module(name: str):
    return getattr(transformers.models, name).__dict__[f"modeling_{name}"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma4", "deepseek_v3", "olmo2"])
def test_rotation_matches_transformers_bit_for_bit(family, dtype):
    config = _tiny_config(family)
    r, variant = _resolved(config)
    model_cls = getattr(transformers, config["architectures"][0])
    model = model_cls(model_cls.config_class(**{k: v for k, v in config.items() if k != "architectures"}))
    rotary = model.get_submodule(variant.module_prefix.rstrip(".")).rotary_emb
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    modeling = _module(family)
    torch.manual_seed(0)
    for i in range(r.num_layers):
        rope = rope_of(r, i)
        if family == "olmo2":  # Olmo2RotaryEmbedding returns float32 tables and q/k rotate in float32
            rope["compute_dtype"] = "float32"
        positions = torch.arange(40)
        q = torch.randn(2, 3, 40, rope["rotary_dim"]).to(dtype)
        kwargs = {"layer_type": layer_types[i]} if layer_types and family == "gemma4" else {}
        ref_cos, ref_sin = rotary(q, positions[None], **kwargs)  # in q's dtype, except OLMo-2's
        ours = apply(q, *cos_sin(rope, positions), rope)
        if family == "gemma4":
            ref = modeling.apply_rotary_pos_emb(q, ref_cos, ref_sin)
        elif rope["style"] == "interleaved":  # DeepSeek returns the rotated pairs de-interleaved
            ref, _ = modeling.apply_rotary_pos_emb_interleave(q, q, ref_cos, ref_sin)
        else:
            ref, _ = modeling.apply_rotary_pos_emb(q, q, ref_cos, ref_sin)
        assert ours.dtype == dtype
        assert torch.equal(to_half_layout(ours, rope), ref), f"layer {i}"


def test_partial_rotary_passes_the_rest_through():
    rope = {"theta": 10000.0, "style": "half", "rotary_dim": 8, "head_dim": 24, "scaling": None, "max_positions": 64}
    x = torch.randn(1, 2, 6, 24)
    out = apply(x, *cos_sin(rope, torch.arange(6)), rope)
    assert torch.equal(out[..., 8:], x[..., 8:]) and not torch.equal(out[..., :8], x[..., :8])
    assert torch.allclose(out[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1), rtol=1e-5)  # a rotation


# --------------------------------------------------------------------------------------------
# Half-split <-> interleaved checkpoints


def test_permutations_are_inverse_and_match_the_documented_layout():
    assert M.interleave_permutation(6, 4).tolist() == [0, 2, 1, 3, 4, 5]
    assert M.half_permutation(6, 4).tolist() == [0, 2, 1, 3, 4, 5]
    assert M.interleave_permutation(8, 8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert M.half_permutation(8, 8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    for head_dim, rotary_dim in [(16, 16), (24, 8), (64, 32), (512, 512)]:
        p, q = M.interleave_permutation(head_dim, rotary_dim), M.half_permutation(head_dim, rotary_dim)
        assert p.dtype == torch.int64 and torch.equal(p[q], torch.arange(head_dim))
        assert torch.equal(q[p], torch.arange(head_dim))


ROTATIONS = {
    "full": {"rotary_dim": 16, "head_dim": 16, "scaling": None},
    "partial": {"rotary_dim": 8, "head_dim": 24, "scaling": None},
    "partial-yarn": {"rotary_dim": 16, "head_dim": 40,
                     "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    "proportional": {"rotary_dim": 32, "head_dim": 32,
                     "scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.25}},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ROTATIONS)
def test_interleaved_checkpoint_gives_the_same_scores(kind, dtype):
    """Permute each head's q/k projection rows with interleave_permutation, rotate interleaved: same q.k."""
    geometry = ROTATIONS[kind]
    half = {"theta": 10000.0, "style": "half", "max_positions": 64, **geometry}
    inter = {**half, "style": "interleaved"}
    heads, dh, r, hidden, seq = 3, geometry["head_dim"], geometry["rotary_dim"], 32, 50
    torch.manual_seed(1)
    x = torch.randn(1, seq, hidden)
    wq, wk = torch.randn(heads * dh, hidden) / hidden ** 0.5, torch.randn(heads * dh, hidden) / hidden ** 0.5
    rows = (torch.arange(heads)[:, None] * dh + M.interleave_permutation(dh, r)).flatten()  # within each head

    def rotated(w: torch.Tensor, rope: dict) -> torch.Tensor:
        q = (x @ w.T).view(1, seq, heads, dh).transpose(1, 2).to(dtype)          # [B, H, S, Dh]
        return apply(q, *cos_sin(rope, torch.arange(seq)), rope)

    q_half, k_half = rotated(wq, half), rotated(wk, half)
    q_inter, k_inter = rotated(wq[rows], inter), rotated(wk[rows], inter)
    # rotating then permuting is permuting then rotating, bit for bit
    assert torch.equal(q_inter[..., M.half_permutation(dh, r)], q_half)
    scores = lambda q, k: q.double() @ k.double().transpose(2, 3)               # noqa: E731  [B, H, S, S]
    assert rel_err(scores(q_inter, k_inter), scores(q_half, k_half)) <= 1e-6
    back = (torch.arange(heads)[:, None] * dh + M.half_permutation(dh, r)).flatten()
    assert torch.equal(wq[rows][back], wq)                                       # and half_permutation undoes it
