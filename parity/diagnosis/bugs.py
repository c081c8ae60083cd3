"""The porting-bug catalog: the convention mistakes ports make, each injectable into a neutral model.

An injection is a typed edit of a neutral model (parity.neutral.model: a field set to the wrong value, a field's
value fitted) or of its tensors — never a special case in the executor — so that the executor runs the mistake
exactly as a port would. Whether a bug applies is read off the model too (a model with no sliding window cannot
ignore one), so the catalog holds no family names; ``families`` is computed from the adapters' tiny checkpoints for
display.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from parity import rope as rope_math
from parity.adapter import load_all
from parity.errors import ParityError
from parity.neutral.model import (Attention, BlockNorms, CachePolicy, Embedding, Glu, Head, Layer, Manifest, Mla, Moe,
                                  Norm, Part, Rope)

Tensors = dict[str, torch.Tensor]
Inject = Callable[[Manifest, Tensors], None]

ADDED_FINAL_SOFTCAP = 30.0  # the cap ports add where a family has none: Gemma 2's (ollama/ollama PR #9692, Gemma 3)
ADDED_ATTN_SOFTCAP = 50.0   # Gemma 2's attention cap, the one a port copies onto a family that has none
# the window a port adds where a family has none: a hypothesis must bite on the selftest's short prompt, so it is
# small; a real port's window (Mistral's 4096, the sliding_window Qwen2 configs carry switched off) shows only on a
# prompt that long, where the diagnosis names its nearest hypothesis
ADDED_SLIDING_WINDOW = 8
# where a mistake in every norm first shows: the attention's input norm, or, in a family without one (OLMo 2's
# norms follow the sublayers), the query's full-width norm
NORM_FIRST = ("attn.q_norm",)


@dataclass(frozen=True)
class Size:
    """A mistake with a size: the value the port used (a softcap of 3 where the model has none, a RoPE base of
    5e5 for 1e6). A diagnosis fits the value that reproduces the candidate (a 1-D search over ``low`` to ``high``
    times ``around``, in log scale) and says it; the selftest injects ``trials`` (factors of ``around``) besides
    the catalog's own value; ``--inject ID=VALUE`` runs any."""

    put: Callable[[Manifest, float], None]   # the model computed with the port's value
    around: Callable[[Manifest], float]      # the value the search and the trials are scaled by
    says: str                                # the value as the diagnosis words it: "a final softcap of {value}"
    has: Callable[[Manifest], str]           # what the model has there: "none", "30"
    low: float = 0.01
    high: float = 100.0
    trials: tuple[float, float] = (0.5, 2.0)


@dataclass(frozen=True)
class Bug:
    id: str
    mistake: str                 # one line, for `parity bugs`
    explains: str                # "the candidate matches {explains}" in a diagnosis
    shows: str                   # "garbage at once" | "degrades on long prompts" | "low precision only" | "subtle"
    seen_in: str                 # where it happened in public ports
    applies: Callable[[Manifest], bool]
    inject: Inject               # changes (manifest, tensors) in place
    dtype: str = "float32"       # the dtype its selftest runs in
    width: int | None = None     # its selftest's hidden size, where 64 is too narrow for the mistake to show
    decode: bool = False         # a KV-cache mistake: only decode steps show it (check --decode), the prefill passes
    short: bool = False          # shows only on sequences shorter than a length threshold: its selftest's prompt
                                 # stops at the first one (the default prompt crosses them all)
    op: str | None = None        # where inside a layer it first shows (docs/ops.md: attn.q_rope, attn_in, ...); None:
                                 # outside the layers (the embedding, the head) or only in decode steps
    also: tuple[str, ...] = ()   # other ops it may first show at, on some sides (below, where one is given)
    # sizes the mistake from the position where a candidate's error starts (a window added: its width), where a
    # diagnosis knows it; the selftest injects the catalog's size
    sized: Callable[[Manifest, int], None] | None = None
    size: Size | None = None     # a mistake with a value, fitted by a diagnosis (Size)


# --------------------------------------------------------------------------------------------
# Typed edits: most mistakes set fields of every part of one kind


def _each(parts: Callable[[Manifest], Iterable[Part]], **fields: Any) -> Inject:
    """The mistake "every part ``parts(m)`` has these field values": a value, or a function of the part as it was
    (a value fitted to it); every field is computed before any is set."""
    def inject(m: Manifest, t: Tensors) -> None:
        for part in list(parts(m)):
            values = {f: v(part) if callable(v) else v for f, v in fields.items()}
            for f, v in values.items():
                setattr(part, f, v)
    return inject


def _rescaled(ropes: Callable[[Manifest], Iterable[Rope]], **params: Any) -> Inject:
    """``_each`` for the parameters of a RoPE scaling (the config's own mapping): a value, or a function of the
    RoPE as it was."""
    return _each(ropes, scaling=lambda r: {**r.scaling, **{k: v(r) if callable(v) else v for k, v in params.items()}})


# the parts of one kind: what an edit sets, what a test of applicability reads


def _attention(m: Manifest) -> list[Attention]:
    return [att for _, att in m.attentions()]


def _has(m: Manifest, test: Callable[[Attention], bool]) -> bool:
    return any(test(att) for att in _attention(m))


def _norms(m: Manifest) -> list[Norm]:
    return [norm for _, norm, _, _ in m.norms()]


def _block_norms(m: Manifest) -> list[BlockNorms]:
    return [layer.norms for layer in m.layers]


def _layers(m: Manifest) -> list[Layer]:
    return m.layers


def _head(m: Manifest) -> list[Head]:
    return [m.head]


def _embedding(m: Manifest) -> list[Embedding]:
    return [m.embedding]


def _put(parts: Callable[[Manifest], Iterable[Part]], field: str) -> Callable[[Manifest, float], None]:
    """A size's ``put``: every part ``parts(m)`` holds the port's value in ``field``."""
    return lambda m, value: _each(parts, **{field: value})(m, {})


def _value(x: float | None) -> str:
    """A value as a diagnosis says it: "none" where the model has none."""
    return "none" if not x else f"{x:.3g}"


def _first(parts: Callable[[Manifest], Iterable[Part]], field: str) -> Callable[[Manifest], float | None]:
    """The model's own value of ``field``: the first part of ``parts(m)`` that sets one."""
    return lambda m: next((getattr(p, field) for p in parts(m) if getattr(p, field)), None)


def _scale_weight(t: Tensors, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    if f"{name}.weight" in t:
        t[f"{name}.weight"] = change(t[f"{name}.weight"].float()).to(t[f"{name}.weight"].dtype)


# --------------------------------------------------------------------------------------------
# What the mistakes apply to, and the ones an edit of fields cannot say


def _offset_dropped(m: Manifest, t: Tensors) -> None:
    for name, norm, _, _ in m.norms():
        if norm.folded_offset:
            _scale_weight(t, name, lambda w: w - 1.0)  # stored 1 + w: the port uses w


def _offset_added(m: Manifest, t: Tensors) -> None:
    for name, norm, _, _ in m.norms():
        if norm.kind == "rmsnorm" and norm.weight:
            _scale_weight(t, name, lambda w: w + 1.0)  # 1 + w where the family computes w (or +1 twice)


def _post_as_pre(m: Manifest, t: Tensors) -> None:
    for i, layer in enumerate(m.layers):
        norms = layer.norms
        for sub in ("attn", "mlp"):
            post = getattr(norms, f"{sub}_res_norm")
            if post is not None:
                setattr(norms, f"{sub}_norm", post)
                setattr(norms, f"{sub}_res_norm", None)
                for part in ("weight", "bias"):
                    old = f"layers.{i}.{sub}_res_norm.{part}"
                    if old in t:
                        t[f"layers.{i}.{sub}_norm.{part}"] = t.pop(old)


def _qk_per_head(m: Manifest, t: Tensors) -> None:
    for i, att in m.attentions():
        if att.qk_norm == "full_width":
            att.qk_norm = "per_head"  # statistics per head; the full-width weight laid out per head
            for key, heads in (("q_norm", att.heads), ("k_norm", att.kv_heads)):
                name = f"layers.{i}.attn.{key}.weight"
                if name in t:
                    t[name] = t[name].reshape(heads, att.head_dim)


def _qk_across_heads(m: Manifest, t: Tensors) -> None:
    for i, att in m.attentions():
        if att.qk_norm == "per_head":
            att.qk_norm = "full_width"  # statistics over every head at once; per-head weights repeated per head
            for key, heads in (("q_norm", att.heads), ("k_norm", att.kv_heads)):
                for name in (f"layers.{i}.attn.{key}.weight", f"layers.{i}.attn.{key}.bias"):
                    if name in t:
                        t[name] = t[name].repeat(heads)


def _plain_scale(att: Attention) -> float:
    width = att.mla.qk_nope_head_dim + att.mla.qk_rope_head_dim if att.mla is not None else att.head_dim
    return width ** -0.5


def _has_nope(m: Manifest) -> bool:
    """Some layers of a RoPE model go without RoPE, and some rotate."""
    ropes = [att.rope is not None for att in _attention(m)]
    return m.rope_style is not None and any(ropes) and not all(ropes)


def _nope_given_rope(m: Manifest, t: Tensors) -> None:
    rope = m.ropes()[0]
    for att in _attention(m):
        if att.rope is None:
            att.rope = rope.model_copy(deep=True)  # the port rotates every layer alike


def _glus(m: Manifest) -> Iterator[Glu]:
    """Every gated unit: each layer's MLP, and its experts."""
    for layer in m.layers:
        if layer.mlp.gated:
            yield layer.mlp
        if layer.mlp.moe is not None:
            yield layer.mlp.moe


def _sequential(m: Manifest, t: Tensors) -> None:
    for i, layer in enumerate(m.layers):
        mlp = layer.mlp
        if mlp.shared_norm:  # Phi's one norm: the port applies it again, to the stream after attention
            layer.norms.mlp_norm = layer.norms.attn_norm.model_copy(deep=True)
            for part in ("weight", "bias"):
                if f"layers.{i}.attn_norm.{part}" in t:
                    t[f"layers.{i}.mlp_norm.{part}"] = t[f"layers.{i}.attn_norm.{part}"]
        mlp.parallel = mlp.shared_norm = False  # the MLP reads the stream after the attention add, as Llama's


def _shared_gated(m: Manifest) -> list[Moe]:
    """The MoE blocks whose shared experts' output is gated by sigmoid(shared_gate(x)) (Qwen2-MoE)."""
    return [moe for moe in m.moes() if moe.shared_gate]


def _interleaved(m: Manifest) -> list[str]:
    """The q/k/v tensors split from a fused tensor whose parts were interleaved per head (GPT-NeoX)."""
    return [n for n, info in m.tensors.items() if info.interleaved > 1]


def _fused_split_wrong(m: Manifest, t: Tensors) -> None:
    """q, k and v cut from the fused tensor as three blocks [3, heads, head_dim] where it holds [heads, 3, head_dim]:
    the fused tensor is rebuilt from the right parts, then split the wrong way."""
    groups: dict[str, list[str]] = {}
    for name in _interleaved(m):
        i, short = name.split(".", 2)[1:]
        groups.setdefault(f"{i}.{short.rsplit('.', 1)[-1]}", []).append(name)
    for names in groups.values():
        if not all(n in t for n in names):  # (the diagnosis may hold one layer's tensors only)
            continue
        blocks = m.tensors[names[0]].interleaved
        parts = [t[n] for n in names]
        fused = torch.cat([p.reshape(blocks, p.shape[0] // blocks, *p.shape[1:]) for p in parts], dim=1)
        fused = fused.reshape(-1, *parts[0].shape[1:])
        for n, wrong in zip(names, torch.split(fused, [p.shape[0] for p in parts])):
            t[n] = wrong.contiguous()


GELU_SWAP = {"gelu_exact": "gelu_tanh", "gelu_tanh": "gelu_exact"}
ACT_SWAP = {"silu": "gelu_tanh", "gelu_tanh": "silu", "gelu_exact": "silu"}


def _activations(m: Manifest) -> Iterator[Part]:
    """Every part with an activation: each layer's MLP, its experts, the head's transform."""
    for layer in m.layers:
        yield layer.mlp
        if layer.mlp.moe is not None:
            yield layer.mlp.moe
    if m.head is not None and m.head.transform is not None:
        yield m.head.transform


def _swap(table: dict[str, str]) -> Inject:
    return _each(_activations, activation=lambda part: table.get(part.activation, part.activation))


def _scaling_type(rope: Rope) -> str | None:
    return (rope.scaling or {}).get("rope_type")


def _longropes(m: Manifest) -> list[Rope]:
    """The LongRoPE layers whose two factor sets differ (picking the wrong one changes the rotation)."""
    return [r for r in m.ropes() if _scaling_type(r) == "longrope"
            and r.scaling.get("long_factor") != r.scaling.get("short_factor")]


def _scaled(m: Manifest) -> list[Rope]:
    """The layers' RoPE that carry a scaling."""
    return [r for r in m.ropes() if r.scaling]


def _scaling_on_other_layers(m: Manifest) -> bool:
    """Some rotating layers scale their RoPE and others do not (Gemma 3: the global layers only)."""
    ropes = m.ropes()
    return any(r.scaling for r in ropes) and not all(r.scaling for r in ropes)


def _rope_scaling_swapped(m: Manifest, t: Tensors) -> None:
    scaling = _scaled(m)[0].scaling
    for rope in m.ropes():
        rope.scaling = None if rope.scaling else copy.deepcopy(scaling)


def _partial(m: Manifest) -> list[Rope]:
    """RoPE over part of each head, whose frequencies do not hang on the rotated width (a scaling with one factor
    per rotated pair, LongRoPE's, cannot be stretched to the full head)."""
    return [r for r in m.ropes() if r.rotary_dim < r.head_dim and _scaling_type(r) != "longrope"]


def _capped(m: Manifest) -> list[Attention]:
    """The attentions whose logits the model caps."""
    return [att for att in _attention(m) if att.softcap]


FACTORED = ("linear", "llama3", "yarn")  # the RoPE scalings whose factor changes a short prompt's rotation


def _factored(m: Manifest) -> list[Rope]:
    """The layers' RoPE scaled by a factor that shows from the first positions on."""
    return [r for r in m.ropes() if _scaling_type(r) in FACTORED and r.scaling.get("factor")]


def _factor(rope: Rope) -> float:
    return rope.scaling.get("factor")


def _routed_scaled(m: Manifest) -> list[Moe]:
    """The MoE blocks whose routed experts' sum is multiplied by a scale other than 1 (routed_scaling_factor)."""
    return [moe for moe in m.moes() if moe.scale not in (None, 1.0)]


def _causal(m: Manifest) -> list[Attention]:
    return [att for att in _attention(m) if att.causal]


def _window_sized(m: Manifest, width: int) -> None:
    """A window of ``width`` keys: position ``width`` is the first that loses one, where the error starts."""
    for att in _causal(m):
        att.sliding_window = width


def _yarns(m: Manifest) -> list[Rope]:
    """The layers' RoPE scaled by YaRN."""
    return [r for r in m.ropes() if _scaling_type(r) == "yarn"]


YARN_ATTENTION_KEYS = ("attention_factor", "mscale", "mscale_all_dim")  # what sets YaRN's cos/sin factor


def _yarn_attention(rope: Rope, plain: bool = False) -> float:
    """The factor YaRN scales cos and sin by; ``plain``: the default 0.1 ln(factor) + 1, as if the config set none
    of YARN_ATTENTION_KEYS."""
    if plain:
        rope = rope.model_copy(
            update={"scaling": {k: v for k, v in rope.scaling.items() if k not in YARN_ATTENTION_KEYS}})
    return rope_math.inv_freq(rope)[1]


def _mla_mscale(att: Attention) -> float:
    """The mscale ** 2 that MLA's softmax scale carries under YaRN with ``mscale_all_dim`` (DeepSeek: 0.1 *
    mscale_all_dim * ln(factor) + 1, squared); 1 where it carries none."""
    scaling = (att.rope.scaling if att.rope is not None else None) or {}
    if att.mla is None or not scaling.get("mscale_all_dim") or scaling.get("rope_type", "default") == "default":
        return 1.0
    return rope_math.yarn_mscale(scaling.get("factor") or 1.0, scaling.get("mscale_all_dim")) ** 2


def _head_width_rotary(m: Manifest) -> list[Rope]:
    """Unscaled RoPE over part of each head: the frequencies a port spaces by the head's width stay expressible."""
    return [r for r in m.ropes() if r.rotary_dim < r.head_dim and not r.scaling]


def _proportional(m: Manifest) -> list[Rope]:
    """Proportional RoPE whose turning pairs are fewer than the head's (Gemma 4's global layers)."""
    return [r for r in m.ropes() if _scaling_type(r) == "proportional"
            and r.scaling.get("partial_rotary_factor", 1.0) < 1.0]


def _proportional_contiguous(m: Manifest, t: Tensors) -> None:
    for rope in _proportional(m):
        scaling = rope.scaling
        turning = int(scaling.get("partial_rotary_factor") * rope.head_dim // 2)
        # the same frequencies, theta ** (-2j / head_dim), but pairs (j, j + turning) inside the first 2 * turning
        # dims: plain RoPE over 2 * turning dims with its base raised to 2 * turning / head_dim
        rope.theta = rope.theta ** (2 * turning / rope.head_dim)
        rope.rotary_dim = 2 * turning
        factor = scaling.get("factor", 1.0)
        rope.scaling = {"rope_type": "linear", "factor": factor} if factor != 1.0 else None


def _embed_scale_added(m: Manifest, t: Tensors) -> None:
    m.embedding.scale = float(m.hidden_size) ** 0.5


def _bf16_inexact(x: float) -> bool:
    return float(torch.tensor(x, dtype=torch.bfloat16)) != x


def _routed(m: Manifest) -> list[Moe]:
    """MoE blocks whose top-k weights come from a softmax or sigmoid over every expert: renormalising them is a
    choice (the top-k softmax and sigmoid routings make none)."""
    return [moe for moe in m.moes() if moe.routing in ("softmax", "sigmoid")]


def _renormalisable(m: Manifest, renormalised: bool) -> list[Moe]:
    """MoE blocks whose top-k weights come from a softmax or sigmoid over every expert, renormalised or not
    (norm_topk_prob): where the choice is the model's."""
    return [moe for moe in _routed(m) if moe.renormalise == renormalised
            # a norm over the weighted sum (Gemma 4's) cancels the per-token factor renormalising is
            and moe.expert_post_norm is None]


_weights_moved = _each(Manifest.moes, weights_input=lambda moe: not moe.weights_input)
_renormalisation_flipped = _each(_routed, renormalise=lambda moe: not moe.renormalise)


QKV_BIASES = ("attn.q.bias", "attn.k.bias", "attn.v.bias", "attn.q_a.bias", "attn.kv_a.bias")


def _qkv_biases(names: Iterable[str]) -> list[str]:
    return [n for n in names if n.startswith("layers.") and n.split(".", 2)[2] in QKV_BIASES]


def _qkv_bias_dropped(m: Manifest, t: Tensors) -> None:
    for name in _qkv_biases(t):
        del t[name]


def _conv1d(m: Manifest) -> list[str]:
    return [n for n, info in m.tensors.items() if info.transposed and len(info.shape) == 2
            and info.shape[0] == info.shape[1]]


def _conv1d_not_transposed(m: Manifest, t: Tensors) -> None:
    for name in _conv1d(m):  # square Conv1D weights used as stored: W^T (the others would not even load)
        if name in t:  # (the diagnosis may hold one layer's tensors only)
            t[name] = t[name].t().contiguous()


def _untied(m: Manifest, t: Tensors) -> None:
    m.head.tied = False
    embed = t["embed.tokens.weight"]
    gen = torch.Generator().manual_seed(0)
    t["lm_head.weight"] = (torch.randn(embed.shape, generator=gen) * 0.02).to(embed.dtype)  # a fresh init


def _mlas(m: Manifest) -> list[Mla]:
    return [att.mla for att in _attention(m) if att.mla is not None]


def _cache_policy(**policy: Any) -> Inject:
    """A decode bug: the executor's cache (parity.neutral.executor.cache) follows this policy instead of the correct
    one."""
    def inject(m: Manifest, t: Tensors) -> None:
        m.kv_cache = (m.kv_cache or CachePolicy()).model_copy(update=policy)
    return inject


def decodes(m: Manifest) -> bool:
    """A causal language model: it has decode steps."""
    return m.head is not None and all(layer.attention.causal for layer in m.layers)


def _uniform_kv(m: Manifest) -> bool:
    """Every layer caches keys and values of one shape, and none reuses another's: a cache whose slots any layer
    could write (where shapes differ, a port that mixes up slots fails loudly instead)."""
    shapes = {(a.kv_heads, a.head_dim, a.mla is not None) for a in _attention(m)}
    return len(shapes) == 1 and not _has(m, lambda a: a.kv_shared_from is not None)


def _rms(m: Manifest) -> bool:
    return any(norm.kind == "rmsnorm" for norm in _norms(m))


CATALOG: list[Bug] = [
    Bug("norm-offset-dropped", "`w` used where the family computes `1 + w`",
        "the norm computed with `weight` instead of `1 + weight`", "garbage at once",
        "ggml-org/llama.cpp PR #5631; linkedin/Liger-Kernel #74",
        lambda m: any(n.folded_offset for n in _norms(m)), _offset_dropped, op="attn_in", also=NORM_FIRST),
    Bug("norm-offset-added", "`1 + w` used where the family computes `w` (or +1 applied twice)",
        "the norm computed with `1 + weight` instead of `weight`", "garbage at once",
        "utensils/mold #1078",
        _rms, _offset_added, op="attn_in", also=NORM_FIRST),
    Bug("norm-eps-wrong", "eps differs from the config (e.g. 1e-6 for 1e-5)",
        "the norms computed with a different eps", "subtle",
        "ggml-org/llama.cpp #2373, PR #2374; apache/tvm #15856; mlc-ai/mlc-llm #923; intel/ipex-llm #9529",
        lambda m: bool(_norms(m)), _each(_norms, eps=lambda n: 1e-6 if n.eps != 1e-6 else 1e-5), op="attn_in",
        also=NORM_FIRST,
        # an eps far below the activations' mean square changes nothing a check sees (BERT's 1e-12): the trials are
        # above it, from 1e-5 up
        size=Size(_put(_norms, "eps"), lambda m: max(_first(_norms, "eps")(m) or 0.0, 1e-5),
                  "norms with an eps of {value}", lambda m: _value(_first(_norms, "eps")(m)), low=1e-4, high=1e4,
                  trials=(300.0, 3000.0))),
    Bug("norm-in-low-precision", "norm computed in bf16/fp16 instead of float32",
        "the norms computed in the model's low precision", "low precision only",
        "huggingface/transformers PR #29402; meta-llama/llama #1048; pytorch/pytorch #133085",
        # accumulating mean(x^2) in bf16 loses the small terms once the sum is 256x larger: it takes a
        # realistic width to show (at hidden 64 it stays within bf16's own noise)
        lambda m: bool(_norms(m)), _each(_norms, upcast="none", weight_dtype="model"), dtype="bfloat16", width=1024,
        op="attn_in", also=NORM_FIRST),
    Bug("post-norm-as-pre-norm", "Post-Norm block ported as Pre-Norm",
        "a Pre-Norm block where the family uses Post-Norm", "garbage at once",
        "TransformerLensOrg/TransformerLens #509",
        lambda m: any(n.attn_res_norm is not None or n.mlp_res_norm is not None for n in _block_norms(m)),
        _post_as_pre, op="attn_in"),
    Bug("sandwich-post-norm-dropped", "the post-attention / post-feedforward norms skipped",
        "the block without its post-sublayer norms", "garbage at once",
        "google/flax #4567",
        lambda m: any(n.attn_post_norm is not None or n.mlp_post_norm is not None for n in _block_norms(m)),
        _each(_block_norms, attn_post_norm=None, mlp_post_norm=None), op="attn_out"),
    Bug("qk-norm-dropped", "q/k norms skipped", "attention without its q/k norms", "garbage at once",
        "arcee-ai/mergekit #602, PR #699; lmstudio-ai/mlx-engine #283",
        lambda m: _has(m, lambda a: a.qk_norm != "none"), _each(_attention, qk_norm="none", q_norm=None, k_norm=None),
        op="attn.q_norm"),
    Bug("qk-norm-per-head", "full-width QK-Norm applied per head",
        "the q/k norms taken per head instead of over the full projection width", "subtle",
        "ggml-org/llama.cpp PR #12400; vllm-project/vllm-metal #692",
        lambda m: _has(m, lambda a: a.qk_norm == "full_width"), _qk_per_head, op="attn.q_norm"),
    Bug("qk-norm-across-heads", "a per-head QK-norm taken over all heads at once (the full q/k width)",
        "the q/k norms taken over all heads instead of per head", "subtle",
        "vllm-project/vllm PR #16311",
        lambda m: _has(m, lambda a: a.qk_norm == "per_head"), _qk_across_heads, op="attn.q_norm",
        # a norm after RoPE (Llama 4) first shows in the rotated queries, where a side reads no norm of its own
        also=("attn.q_rope",)),
    Bug("v-norm-dropped", "v norm skipped", "attention without its v-norm", "subtle",
        "no public instance found",
        lambda m: _has(m, lambda a: a.v_norm is not None), _each(_attention, v_norm=None), op="attn.context"),
    Bug("attn-softcap-dropped", "attention logit softcap skipped", "attention without its logit softcap",
        "degrades on long prompts",
        "vllm-project/vllm PR #5908, #6051, #7022; huggingface/transformers #31887, #32877; "
        "EricLBuehler/candle-vllm #84",
        lambda m: _has(m, lambda a: bool(a.softcap)), _each(_attention, softcap=None), op="attn.scores"),
    Bug("attn-softcap-wrong", "an attention logit softcap of another value than the config's (e.g. Gemma 2's 50 "
        "kept for a family that caps at another)", "attention scores capped at another value", "subtle",
        "no public instance found",
        lambda m: bool(_capped(m)), _each(_capped, softcap=lambda a: a.softcap * 0.2), op="attn.scores",
        size=Size(_put(_capped, "softcap"), _first(_capped, "softcap"), "an attention logit softcap of {value}",
                  lambda m: _value(_first(_capped, "softcap")(m)), trials=(0.1, 0.3))),
    Bug("final-softcap-dropped", "final logit softcap skipped", "logits without their final softcap", "subtle",
        "ggml-org/llama.cpp PR #8197, PR #8156; ollama/ollama #5341",
        lambda m: m.head is not None and bool(m.head.softcap), _each(_head, softcap=None)),
    Bug("final-softcap-wrong", "a final logit softcap of another value than the config's",
        "logits capped at another value", "subtle", "no public instance found",
        lambda m: m.head is not None and bool(m.head.softcap), _each(_head, softcap=lambda h: h.softcap * 0.1),
        size=Size(_put(_head, "softcap"), lambda m: m.head.softcap, "a final logit softcap of {value}",
                  lambda m: _value(m.head.softcap), trials=(0.05, 0.2))),
    Bug("attn-scale-wrong", "1/sqrt(head_dim) used where `query_pre_attn_scalar` rules, or the reverse",
        "attention scaled by 1/sqrt(head_dim)", "subtle",
        "ggml-org/llama.cpp PR #8197, #8444, #13951; google/gemma_pytorch #71",
        # MLA's scale under YaRN carries mscale ** 2 by design: that factor dropped is mla-softmax-mscale-dropped
        lambda m: _has(m, lambda a: abs(a.scale / _mla_mscale(a) - _plain_scale(a)) > 1e-9 * a.scale),
        _each(_attention, scale=_plain_scale), op="attn.scores",
        size=Size(_put(_attention, "scale"), _first(_attention, "scale"), "attention scores scaled by {value}",
                  lambda m: _value(_first(_attention, "scale")(m)))),
    Bug("mla-softmax-mscale-dropped", "MLA's softmax scale without the YaRN mscale ** 2 (0.1 * mscale_all_dim * "
        "ln(factor) + 1, squared) that DeepSeek multiplies into it", "MLA's softmax scale without YaRN's mscale ** 2",
        "subtle", "onnxruntime/mobius PR #548; huggingface/transformers PR #47435",
        lambda m: _has(m, lambda a: _mla_mscale(a) != 1.0), _each(_attention, scale=lambda a: a.scale / _mla_mscale(a)),
        op="attn.scores"),
    Bug("attn-softcap-added", f"an attention logit softcap ({ADDED_ATTN_SOFTCAP:g}, Gemma 2's) where the family has "
        "none", "attention scores capped where the model caps none", "subtle", "no public instance found",
        lambda m: bool(m.layers) and not _has(m, lambda a: bool(a.softcap)),
        _each(_attention, softcap=ADDED_ATTN_SOFTCAP), op="attn.scores",
        size=Size(_put(_attention, "softcap"), lambda m: ADDED_ATTN_SOFTCAP, "an attention logit softcap of {value}",
                  lambda m: "none", trials=(0.1, 0.3))),
    Bug("final-softcap-added", f"a final logit softcap ({ADDED_FINAL_SOFTCAP:g}) where the family has none",
        "logits capped where the model caps none", "subtle", "ollama/ollama PR #9692",
        # where the logits are scaled down (Cohere's 0.0625, Granite's 1/8) a tiny model's logits sit far below the
        # cap, which then changes nothing a check can tell from float32 noise: not catalogued there
        lambda m: m.head is not None and not m.head.softcap and m.head.scale >= 1.0,
        _each(_head, softcap=ADDED_FINAL_SOFTCAP),
        size=Size(_put(_head, "softcap"), lambda m: ADDED_FINAL_SOFTCAP, "a final logit softcap of {value}",
                  lambda m: "none", trials=(0.1, 0.3))),
    Bug("embed-scale-added", "embeddings multiplied by sqrt(hidden) where the family does not scale them",
        "embeddings scaled where the model scales none", "garbage at once", "no public instance found",
        lambda m: m.embedding.scale == 1.0 and m.embedding.positions == "rope", _embed_scale_added,
        size=Size(_put(_embedding, "scale"), lambda m: float(m.hidden_size) ** 0.5, "embeddings multiplied by {value}",
                  lambda m: "1")),
    Bug("embed-scale-rounded", "the embedding scale rounded to bfloat16 in a float32 run (sqrt(hidden) as bf16)",
        "an embedding scale rounded to bfloat16", "subtle", "no public instance found",
        lambda m: m.embedding.scale != 1.0 and _bf16_inexact(m.embedding.scale),
        _each(_embedding, scale_dtype="bfloat16"), width=96),
    Bug("embed-scale-dropped", "embeddings not multiplied by their scale (sqrt(hidden); Granite's multiplier)",
        "embeddings without their scale", "garbage at once",
        "vllm-project/vllm PR #48010",
        lambda m: m.embedding.scale != 1.0, _each(_embedding, scale=1.0)),
    Bug("embed-scale-wrong", "embeddings multiplied by another scale than the model's (sqrt of another width, a "
        "multiplier misread)", "embeddings scaled by another value", "garbage at once", "no public instance found",
        lambda m: m.embedding.scale != 1.0, _each(_embedding, scale=lambda e: e.scale * 2.0),
        size=Size(_put(_embedding, "scale"), lambda m: m.embedding.scale, "embeddings multiplied by {value}",
                  lambda m: _value(m.embedding.scale), trials=(0.3, 3.0))),
    Bug("gelu-variant-swapped", "exact GELU where tanh GELU is meant, or the reverse",
        "the MLP with the other GELU variant", "subtle",
        "huggingface/transformers PR #29402; vllm-project/vllm #3337; ml-explore/mlx-examples #579",
        lambda m: any(s.activation in GELU_SWAP for s in _activations(m)), _swap(GELU_SWAP), op="mlp.act"),
    Bug("activation-swapped", "silu where gelu is meant, or the reverse", "the MLP with the wrong activation",
        "garbage at once", "huggingface/candle #3745",
        lambda m: any(layer.mlp.gated for layer in m.layers), _swap(ACT_SWAP), op="mlp.act"),
    Bug("rope-permuted", "q/k rotated as interleaved pairs where the checkpoint is half-split, or the reverse",
        "RoPE applied in the other pairing (half-split vs interleaved)", "garbage at once",
        "ggml-org/llama.cpp #2376, PR #3364; ml-explore/mlx-examples #170; karpathy/llama2.c #286",
        lambda m: bool(m.ropes()),
        _each(Manifest.ropes, style=lambda r: "interleaved" if r.style == "half" else "half"), op="attn.q_rope",
        # a side that restores permuted q/k rows to the checkpoint's order (as llama.cpp's reader does) shows
        # rows written in the other layout at the projection already
        also=("attn.q",)),
    Bug("rope-theta-wrong", "RoPE base not taken from the config (e.g. 10000)",
        "RoPE with a different base", "degrades on long prompts",
        "ggml-org/llama.cpp PR #2768, #2773; vllm-project/vllm PR #29111; stanford-crfm/levanter #649",
        lambda m: bool(m.ropes()), _each(Manifest.ropes, theta=lambda r: 10000.0 if r.theta != 10000.0 else 1000000.0),
        op="attn.q_rope",
        size=Size(_put(Manifest.ropes, "theta"), _first(Manifest.ropes, "theta"), "a RoPE base of {value}",
                  lambda m: _value(_first(Manifest.ropes, "theta")(m)), low=1e-3, high=1e3, trials=(0.3, 3.0))),
    Bug("rope-scaling-dropped", "the config's RoPE scaling (linear, llama3, yarn, longrope, dynamic) not applied: "
        "the plain frequencies", "RoPE without its scaling", "degrades on long prompts",
        "lablup/mlxcel #1355, #1340; Blaizzy/mlx-vlm PR #1709",
        lambda m: bool(_scaled(m)), _each(_scaled, scaling=None), op="attn.q_rope"),
    Bug("rope-scaling-factor-wrong", "the RoPE scaling's factor (linear, llama3, yarn) of another value than the "
        "config's", "RoPE scaled by another factor", "degrades on long prompts", "no public instance found",
        lambda m: bool(_factored(m)), _rescaled(_factored, factor=lambda r: _factor(r) * 2.0),
        op="attn.q_rope",
        size=Size(lambda m, value: _rescaled(_factored, factor=value)(m, {}),
                  lambda m: _factor(_factored(m)[0]), "a RoPE scaling factor of {value}",
                  lambda m: _value(_factor(_factored(m)[0])), trials=(0.3, 3.0))),
    Bug("rope-scaling-wrong-layers", "the RoPE scaling applied on the layer types that go without it, and not on "
        "those that have it (Gemma 3: the global layers)", "RoPE scaled on the other layer type",
        "degrades on long prompts", "ollama/ollama PR #13452",
        _scaling_on_other_layers, _rope_scaling_swapped, op="attn.q_rope"),
    Bug("partial-rotary-as-full", "RoPE over the whole head where the family rotates part of it "
        "(partial_rotary_factor, rotary_dim)", "RoPE rotating every dimension of the head", "garbage at once",
        "AI-Hypercomputer/maxtext PR #4742",
        lambda m: bool(_partial(m)), _each(_partial, rotary_dim=lambda r: r.head_dim), op="attn.q_rope"),
    Bug("partial-rotary-over-head-width", "partial RoPE with its frequencies and pairs spaced by the head's width: "
        "theta ** (-2j / head_dim), pairs (j, j + head_dim / 2), where the family uses rotary_dim",
        "partial RoPE spaced by the head's width instead of the rotated width", "degrades on long prompts",
        "pie-project/pie #602, PR #603",
        lambda m: bool(_head_width_rotary(m)),
        # the first rotary_dim / 2 pairs turn, each (j, j + head_dim / 2) at theta ** (-2j / head_dim): Gemma 4's
        # proportional RoPE at the family's partial factor
        _each(_head_width_rotary, rotary_dim=lambda r: r.head_dim, scaling=lambda r: {
            "rope_type": "proportional", "partial_rotary_factor": r.rotary_dim / r.head_dim}), op="attn.q_rope"),
    Bug("proportional-rotary-as-contiguous", "proportional RoPE (pairs across the whole head, the tail's frequencies "
        "0) rotated as a contiguous block: pairs (j, j + turning) inside the first 2 * turning dims",
        "proportional RoPE paired inside its rotated block instead of across the head", "garbage at once",
        "apple/coreai-models #66",
        lambda m: bool(_proportional(m)), _proportional_contiguous, op="attn.q_rope"),
    Bug("yarn-attention-factor-dropped", "YaRN's cos/sin factor (attention_factor, by default 0.1 ln(factor) + 1) "
        "not applied", "YaRN without its attention factor on cos and sin", "subtle",
        "turboderp-org/exllamav3 #259",
        lambda m: any(_yarn_attention(r) != 1.0 for r in _yarns(m)), _rescaled(_yarns, attention_factor=1.0),
        op="attn.q_rope"),
    Bug("yarn-attention-factor-wrong", "YaRN's cos/sin factor computed as 0.1 ln(factor) + 1 where the config sets "
        "it (attention_factor, or mscale / mscale_all_dim)", "YaRN with the default attention factor instead of "
        "the config's", "subtle", "sgl-project/sglang PR #22711; vllm-project/vllm PR #46280",
        lambda m: any(_yarn_attention(r) != _yarn_attention(r, plain=True) for r in _yarns(m)),
        _rescaled(_yarns, attention_factor=lambda r: _yarn_attention(r, plain=True)), op="attn.q_rope",
        size=Size(lambda m, value: _rescaled(_yarns, attention_factor=value)(m, {}),
                  lambda m: _yarn_attention(_yarns(m)[0]), "a YaRN attention factor of {value}",
                  lambda m: _value(_yarn_attention(_yarns(m)[0])), low=0.1, high=10.0, trials=(0.8, 1.25))),
    Bug("longrope-long-factors-early", "LongRoPE's long factors applied to a sequence within "
        "original_max_position_embeddings (the set picked by the context allocated, not the sequence's length)",
        "LongRoPE rotating a short sequence with its long factors", "subtle",
        "ggml-org/llama.cpp #24823; lablup/mlxcel #1358",
        lambda m: bool(_longropes(m)), _rescaled(_longropes, short_factor=lambda r: list(r.scaling.get("long_factor"))),
        short=True, op="attn.q_rope"),
    Bug("longrope-short-factors-late", "LongRoPE's short factors kept past original_max_position_embeddings (the set "
        "never switched, or picked by a context no longer than the original)",
        "LongRoPE rotating a long sequence with its short factors", "degrades on long prompts",
        "no public instance found",
        lambda m: bool(_longropes(m)), _rescaled(_longropes, long_factor=lambda r: list(r.scaling.get("short_factor"))),
        op="attn.q_rope"),
    Bug("sliding-window-ignored", "sliding-window layers attend globally",
        "sliding-window layers attending globally", "degrades on long prompts",
        "vllm-project/vllm PR #5908, #2064; ggml-org/llama.cpp #3371, #3377, PR #8227, #7709, PR #13676; "
        "sgl-project/sglang PR #4823",
        lambda m: _has(m, lambda a: bool(a.sliding_window)), _each(_attention, sliding_window=None), op="attn.scores"),
    Bug("sliding-window-added", f"a sliding window (here {ADDED_SLIDING_WINDOW}) on layers that attend globally, "
        "in a family with no windowed layer", "a sliding window where the model attends globally",
        "degrades on long prompts", "ggml-org/llama.cpp PR #13676",
        lambda m: not _has(m, lambda a: bool(a.sliding_window)) and bool(_causal(m)),
        _each(_causal, sliding_window=ADDED_SLIDING_WINDOW), op="attn.scores", sized=_window_sized),
    Bug("chunked-attention-as-full", "chunked-attention layers attend to every earlier key, across chunks",
        "chunked-attention layers attending across their chunks", "degrades on long prompts",
        "no public instance found",
        lambda m: _has(m, lambda a: bool(a.chunk_size)), _each(_attention, chunk_size=None), op="attn.scores"),
    Bug("attention-temperature-dropped", "the queries of the tuned layers not scaled by log1p(floor((position + 1) "
        "/ floor_scale)) * attn_scale + 1", "attention without its temperature tuning", "degrades on long prompts",
        "no public instance found",
        lambda m: _has(m, lambda a: a.temperature is not None), _each(_attention, temperature=None), op="attn.q_rope"),
    Bug("qkv-bias-dropped", "q/k/v biases skipped", "attention without its q/k/v biases", "garbage at once",
        "EricLBuehler/candle-vllm #167",
        lambda m: bool(_qkv_biases(m.tensors)), _qkv_bias_dropped, op="attn.q"),
    Bug("conv1d-not-transposed", "GPT-2 Conv1D weights used as `[out, in]` without transposing",
        "the Conv1D weights used untransposed", "garbage at once",
        "AutoGPTQ/AutoGPTQ PR #139; karpathy/nanoGPT model.py (its explicit Conv1D transpose list)",
        lambda m: bool(_conv1d(m)), _conv1d_not_transposed, op="attn.q"),
    Bug("tied-embeddings-broken", "lm_head not tied to the embeddings where the config ties them",
        "an LM head that is not the embedding matrix", "garbage at once",
        "NVIDIA/TensorRT-LLM PR #1799, #1733, #2585; arcee-ai/mergekit #350, #615; sgl-project/sglang #630",
        lambda m: m.head is not None and m.head.tied, _untied),
    Bug("mla-norm-dropped", "`q_a_layernorm` / `kv_a_layernorm` skipped", "MLA without its two latent norms",
        "garbage at once", "no public instance found",
        lambda m: bool(_mlas(m)), _each(_mlas, q_a_norm=None, kv_a_norm=None), op="attn.q"),
    Bug("nope-given-rope", "RoPE applied on the layers that go without (NoPE)", "NoPE layers rotated like the others",
        "garbage at once", "no public instance found",
        _has_nope, _nope_given_rope, op="attn.q_rope"),
    Bug("logit-scale-dropped", "logits not multiplied by the logit scale (Cohere's logit_scale, Granite's "
        "1 / logits_scaling)", "logits without their scale", "subtle", "no public instance found",
        lambda m: m.head is not None and m.head.scale != 1.0, _each(_head, scale=1.0)),
    Bug("logit-scale-wrong", "logits multiplied by another scale than the config's (logits_scaling multiplied where "
        "Granite divides)", "logits scaled by another value", "subtle", "no public instance found",
        lambda m: m.head is not None and m.head.scale != 1.0, _each(_head, scale=lambda h: 1.0 / h.scale),
        size=Size(_put(_head, "scale"), lambda m: m.head.scale, "logits multiplied by {value}",
                  lambda m: _value(m.head.scale), trials=(0.3, 3.0))),
    Bug("residual-scale-dropped", "sublayer outputs added to the residual stream without the residual multiplier",
        "a residual stream without its multiplier", "garbage at once", "no public instance found",
        lambda m: any(layer.residual_scale != 1.0 for layer in m.layers), _each(_layers, residual_scale=1.0), op="mid"),
    Bug("residual-scale-wrong", "sublayer outputs multiplied by another residual multiplier than the config's",
        "a residual stream with another multiplier", "garbage at once", "no public instance found",
        lambda m: any(layer.residual_scale != 1.0 for layer in m.layers),
        _each(_layers, residual_scale=lambda layer: layer.residual_scale * 2.0), op="mid",
        size=Size(_put(_layers, "residual_scale"), lambda m: m.layers[0].residual_scale,
                  "sublayer outputs multiplied by {value}", lambda m: _value(m.layers[0].residual_scale),
                  trials=(0.3, 3.0))),
    Bug("attention-sinks-dropped", "attention softmax without the learned per-head sink logit",
        "attention without its sinks (the weights over the keys summing to 1)", "garbage at once",
        "no public instance found",
        lambda m: _has(m, lambda a: a.sinks),
        # the softmax over the keys alone: each query's weights sum to 1
        _each(_attention, sinks=False), op="attn.probs"),
    Bug("clamp-dropped", "the clamped SwiGLU run without its clamps (gate to at most the limit, up to +-limit)",
        "the gated unit without its clamps", "subtle", "no public instance found",
        lambda m: any(s.glu_limit is not None for s in _glus(m)), _each(_glus, glu_limit=None), op="mlp.act"),
    Bug("glu-up-offset-dropped", "the `+ 1` on up dropped: act(gate) * up where the family computes "
        "act(gate) * (up + 1)", "the gated unit without the offset on up", "garbage at once",
        "no public instance found",
        lambda m: any(s.glu_up_offset for s in _glus(m)), _each(_glus, glu_up_offset=0.0), op="mlp.act"),
    Bug("parallel-residual-sequential", "a parallel-residual block (attention and MLP both on the layer's input) "
        "run sequentially", "the MLP reading the stream after attention instead of the layer's input",
        "garbage at once",
        "no public instance found",
        lambda m: any(layer.mlp.parallel for layer in m.layers), _sequential, op="mlp_in"),
    Bug("fused-qkv-split-wrong", "a fused QKV laid out per head [heads, 3, head_dim] split as three blocks "
        "[3, heads, head_dim]", "q, k and v cut from the fused projection as three blocks", "garbage at once",
        "no public instance found",
        lambda m: bool(_interleaved(m)), _fused_split_wrong, op="attn.q"),
    Bug("shared-expert-gate-dropped", "the shared expert's output added without its sigmoid gate "
        "(sigmoid(shared_expert_gate(x)))", "the MoE block with its shared expert ungated", "garbage at once",
        "no public instance found",
        lambda m: bool(_shared_gated(m)),
        _each(_shared_gated, shared_gate=False), op="mlp_out"),  # the shared experts' output added as it is
    Bug("moe-weights-on-output", "routing weights multiplied into the experts' outputs where the family scales "
        "their input (experts(x * w))", "the MoE block weighting its experts' outputs instead of their input",
        "subtle", "no public instance found",
        lambda m: any(moe.weights_input for moe in m.moes()), _weights_moved, op="mlp_out"),
    Bug("moe-weights-on-input", "routing weights multiplied into the experts' input where the family weighs "
        "their outputs", "the MoE block scaling its experts' input instead of weighting their outputs",
        "garbage at once", "no public instance found",
        lambda m: any(not moe.weights_input for moe in m.moes()), _weights_moved, op="mlp_out"),
    Bug("moe-topk-renormalised", "the top-k routing weights divided by their sum (or a softmax taken over the "
        "top-k logits only) where the family keeps them as they are (norm_topk_prob false)",
        "the MoE block renormalising its top-k weights", "subtle", "QwenLM/Qwen3 #687",
        lambda m: bool(_renormalisable(m, False)), _renormalisation_flipped, op="mlp_out"),
    Bug("moe-topk-not-renormalised", "the top-k routing weights kept as they are where the family divides them by "
        "their sum (norm_topk_prob true)", "the MoE block without its top-k renormalisation", "subtle",
        "pytorch/torchtitan #1448",
        lambda m: bool(_renormalisable(m, True)), _renormalisation_flipped, op="mlp_out"),
    Bug("moe-routed-scale-dropped", "the routed experts' sum not multiplied by routed_scaling_factor",
        "the MoE block without its routed scale", "garbage at once",
        "sgl-project/sglang PR #8511, PR #31449; flashinfer-ai/flashinfer PR #3499",
        lambda m: bool(_routed_scaled(m)), _each(_routed_scaled, scale=None), op="mlp_out"),
    Bug("moe-routed-scale-twice", "routed_scaling_factor applied twice (in the routing weights and again on the "
        "experts' sum)", "the MoE block with its routed scale squared", "garbage at once",
        "vllm-project/vllm PR #45037; kvcache-ai/sglang PR #86",
        lambda m: bool(_routed_scaled(m)), _each(_routed_scaled, scale=lambda moe: moe.scale ** 2), op="mlp_out"),
    Bug("moe-routed-scale-wrong", "the routed experts' sum multiplied by another value than routed_scaling_factor",
        "the MoE block with another routed scale", "garbage at once", "no public instance found",
        lambda m: bool(_routed_scaled(m)), _each(_routed_scaled, scale=lambda moe: moe.scale * 0.5), op="mlp_out",
        size=Size(_put(_routed_scaled, "scale"), lambda m: _routed_scaled(m)[0].scale, "a routed scale of {value}",
                  lambda m: _value(_routed_scaled(m)[0].scale), trials=(0.3, 3.0))),
    # KV-cache mistakes: the prefill is right, decode steps are not
    Bug("decode-position-offset", "decode steps placed one position late (the new token counted twice)",
        "decode steps at positions shifted by one", "decode only", "no public instance found",
        decodes, _cache_policy(position_offset=1), decode=True),
    Bug("sliding-window-cache-off-by-one", "a sliding-window cache that wraps one slot early",
        "a sliding-window cache holding one key fewer than the window", "decode only", "no public instance found",
        lambda m: decodes(m) and _has(m, lambda a: bool(a.sliding_window)), _cache_policy(window_slack=-1),
        decode=True),
    Bug("kv-cache-wrong-layer", "each layer's keys and values written to the next layer's cache slot",
        "layers reading another layer's cached keys and values", "decode only", "no public instance found",
        lambda m: decodes(m) and len(m.layers) > 1 and _uniform_kv(m), _cache_policy(layer_shift=1),
        decode=True),
    Bug("decode-softcap-dropped", "the decode kernel skips the attention softcap the prefill applies",
        "decode steps without the attention softcap", "decode only", "no public instance found",
        lambda m: decodes(m) and _has(m, lambda a: bool(a.softcap)), _cache_policy(decode_softcap=False),
        decode=True),
    Bug("longrope-switch-keeps-cache", "LongRoPE's factor set switched mid-sequence (a decode step past "
        "original_max_position_embeddings) while the cache keeps the keys rotated with the short factors, where "
        "the prefix is computed again", "decode steps past the LongRoPE switch attending to keys rotated with the "
        "short factors", "decode only",
        "huggingface/transformers PR #33129; microsoft/onnxruntime-genai PR #1161",
        lambda m: decodes(m) and bool(_longropes(m)), _cache_policy(refill_on_rope_change=False), decode=True,
        short=True),
    Bug("kv-heads-order-swapped", "cached kv heads stored in another order (GQA groups read the wrong head)",
        "cached keys and values with their kv heads reversed", "decode only", "no public instance found",
        lambda m: decodes(m) and _has(m, lambda a: a.mla is None and a.kv_shared_from is None and a.kv_heads > 1),
        _cache_policy(kv_head_order="reversed"),
        decode=True),
]

BY_ID = {b.id: b for b in CATALOG}


def get(bug_id: str) -> Bug:
    if bug_id not in BY_ID:
        raise ParityError(f"unknown bug id {bug_id!r}; `parity bugs` lists them: {', '.join(BY_ID)}")
    return BY_ID[bug_id]


def parse(spec: str) -> tuple[Bug, float | None]:
    """``ID``, or ``ID=VALUE``: a mistake with a size (Bug.size) made at the port's value."""
    bug_id, given, text = spec.partition("=")
    bug = get(bug_id.strip())
    if not given:
        return bug, None
    if bug.size is None:
        sized = ", ".join(b.id for b in CATALOG if b.size)
        raise ParityError(f"bug {bug.id} has no value to set ({spec!r}); these have one: {sized}")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ParityError(f"{spec!r}: the value must be a positive number (e.g. {bug.id}=3.0)")
    return bug, value


def trials(bug: Bug, manifest: Manifest) -> list[float]:
    """The values the selftest injects a sized mistake at, besides the catalog's."""
    return [] if bug.size is None else [float(f"{bug.size.around(manifest) * f:.4g}") for f in bug.size.trials]


def applicable(manifest: Manifest) -> list[Bug]:
    return [b for b in CATALOG if b.applies(manifest)]


def applicable_at_width(manifest_at: Callable[[int | None], Manifest]) -> list[Bug]:
    """The bugs that apply to a family, each judged at its selftest's width (``manifest_at(width)``: the family's
    manifest at that hidden size; None: the tiny one): a rounding that 64 leaves exact may show at 96."""
    held: dict[int | None, Manifest] = {}
    out = []
    for b in CATALOG:
        width = b.width
        if width not in held:
            held[width] = manifest_at(width)
        if b.applies(held[width]):
            out.append(b)
    return out


def inject(spec: str, manifest: Manifest, tensors: Tensors, families: dict[str, list[str]] | None = None,
           start: int | None = None, value: float | None = None) -> tuple[Manifest, Tensors]:
    """A copy of (manifest, tensors) with the mistake ``spec`` (``ID`` or ``ID=VALUE``, parse) applied; exit 2 if it
    does not apply. ``start``: the position where the candidate's error starts, which sizes a mistake sized by it
    (Bug.sized); ``value``: the port's value of a mistake with a size (Bug.size), as ``=VALUE`` gives it."""
    bug, given = parse(spec)
    value = given if value is None else value
    if not bug.applies(manifest):
        where = f" it applies to {', '.join(families[bug.id])}" if families else ""
        raise ParityError(f"bug {bug.id} does not apply to this {manifest.source.family} model;{where}")
    m, t = manifest.model_copy(deep=True), dict(tensors)
    if value is not None:
        bug.size.put(m, value)
    else:
        bug.inject(m, t)
        if start and bug.sized:
            bug.sized(m, start)
    m.injected = bug.id if value is None else f"{bug.id}={value:g}"
    return m, t


def families() -> dict[str, list[str]]:
    """Bug id -> the families (by their tiny checkpoints' manifests) it applies to."""
    from parity.reference.tiny import tiny_manifest  # heavy: transformers (parity.reference.tiny imports it)

    out: dict[str, list[str]] = {b.id: [] for b in CATALOG}
    for family, adapter in load_all().items():
        for b in applicable_at_width(lambda width: tiny_manifest(adapter, width)):
            out[b.id].append(family)
    return out
