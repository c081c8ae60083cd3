"""The neutral model: every convention of a checkpoint as a typed value, one class per part.

What ``manifest.json`` holds, what the executor runs, what a catalogued mistake edits and what an exporter
writes are this one object (``Manifest``): read and validated once (parity.neutral.manifest), then passed as it
is. Each field declares, once, where its value comes from (the adapter setting it reads, parity.neutral.declared),
its default (what a manifest written before the field existed means) and its meaning; parity.neutral.converter
fills the model from those declarations, and docs/neutral-layout.md's field table is generated from them
(``field_table``).

Adding a convention: declare its field here, read it in the executor's op that uses it, set it in the adapters
that have it, and spell it in each engine that writes it (docs/adapters.md, "Adding a convention").
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from parity.neutral.declared import Source, declarations, derived, given, module, norm, setting

FORMAT = "parity-neutral"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the model dtypes a manifest may state

_Pos = Annotated[int, Field(gt=0)]
_Count = Annotated[int, Field(ge=0)]
_Num = Annotated[float, Field(allow_inf_nan=False)]
_PosNum = Annotated[float, Field(allow_inf_nan=False, gt=0)]
_NonNegNum = Annotated[float, Field(allow_inf_nan=False, ge=0)]
Activation = Literal["gelu_exact", "gelu_tanh", "silu", "relu"]  # executor.ops.ACTIVATIONS
DtypeName = Literal["float32", "bfloat16", "float16"]
RopeStyle = Literal["half", "interleaved"]


class Part(BaseModel):
    """A part of the neutral model: no coercion ("4" is not 4); keys it does not name are ignored (a newer
    manifest's); mutable, so that a catalogued mistake edits a copy in place."""

    model_config = ConfigDict(strict=True, extra="ignore")


# --------------------------------------------------------------------------------------------
# Norms


class Norm(Part):
    """One norm: ``y = norm(x) * weight (+ bias)``, statistics over the last dimension."""

    kind: Literal["rmsnorm", "layernorm"] = setting("norm.kind", "RMSNorm, or LayerNorm (mean subtracted)")
    eps: _NonNegNum = module("eps", "added to the variance inside the square root")
    weight: bool = module("has_weight", "it has a weight (a weightless norm: an L2 or plain RMS norm)")
    bias: bool = module("has_bias", "it has a bias")
    upcast: Literal["float32", "none"] = setting(
        "norm.upcast", "float32: the statistics computed in float32; none: in the model dtype")
    weight_dtype: Literal["float32", "model"] = setting(
        "norm.weight_dtype", "float32: the normalised x times the weight in float32, then cast; model: cast first")
    folded_offset: bool = module(
        "folded", "the family computes (1 + w); the weight is stored as that sum, applied as a plain weight")


class BlockNorms(Part):
    """A layer's norms by where they sit: on the sublayer's input, on its output, on the stream after the add."""

    attn_norm: Optional[Norm] = norm("attn_norm", "attention's input norm (Pre-Norm)")
    attn_post_norm: Optional[Norm] = norm("attn_post_norm", "on attention's output, before the add (sandwich)")
    attn_res_norm: Optional[Norm] = norm("attn_res_norm", "on the stream after attention's add (Post-Norm)")
    mlp_norm: Optional[Norm] = norm("mlp_norm", "the MLP's input norm")
    mlp_post_norm: Optional[Norm] = norm("mlp_post_norm", "on the MLP's output, before the add (sandwich)")
    mlp_res_norm: Optional[Norm] = norm("mlp_res_norm", "on the stream after the MLP's add (Post-Norm)")


BLOCK_NORMS = tuple(BlockNorms.model_fields)


# --------------------------------------------------------------------------------------------
# Attention


class Mla(Part):
    """Multi-head latent attention (DeepSeek): q and kv through low-rank latents."""

    q_lora_rank: Optional[_Pos] = setting("attention.q_lora_rank", "q's latent width; null: q projected directly")
    kv_lora_rank: _Pos = setting("attention.kv_lora_rank", "the kv latent's width")
    qk_nope_head_dim: _Count = setting("attention.qk_nope_head_dim", "the part of each q/k head RoPE leaves alone")
    qk_rope_head_dim: _Pos = setting("attention.qk_rope_head_dim", "the part of each q/k head RoPE rotates")
    v_head_dim: _Pos = setting("attention.v_head_dim", "each value head's width")
    q_a_norm: Optional[Norm] = norm("attn.q_a_norm", "the norm on q's latent")
    kv_a_norm: Optional[Norm] = norm("attn.kv_a_norm", "the norm on the kv latent")

    @classmethod
    def present(cls, source: Source) -> bool:
        return source.at("attention.kind") == "mla"


class Temperature(Part):
    """Queries scaled by position (Llama 4's attention temperature tuning on its NoPE layers)."""

    floor: _Pos = setting("attention.temperature_floor", "q times log1p(floor((position + 1) / floor)) * scale + 1")
    scale: _Num = setting("attention.temperature_scale", "see floor")

    @classmethod
    def present(cls, source: Source) -> bool:
        return source.at("attention.temperature_floor") is not None


class Rope(Part):
    """One layer's RoPE (parity/rope.py computes its frequencies). Absent (None) on a NoPE layer and in a model
    without RoPE."""

    theta: _PosNum = setting("positions.rope_theta", "base of the frequencies")
    style: RopeStyle = given(
        "rope_style", "which dims form a rotated pair: half (j, j + r/2) or interleaved (2j, 2j+1), as the weights "
        "are written")
    rotary_dim: _Pos = setting("positions.rotary_dim", "r: the first r dims of each head rotate, the rest pass through")
    head_dim: _Pos = setting(("attention.qk_rope_head_dim", "attention.head_dim"),
                             "the rotated head's width (proportional RoPE spaces its frequencies by it)")
    scaling: Optional[dict[str, Any]] = setting(
        "positions.rope_scaling", "the config's rope_scaling: rope_type and its parameters; null: unscaled", None)
    max_positions: Optional[_Pos] = setting("positions.max_positions", "the config's max_position_embeddings")
    compute_dtype: Literal["model", "float32"] = setting(
        "positions.rope_dtype", "float32: q/k upcast, rotated and cast back (OLMo 2); model: rotated as they are",
        "model")

    @classmethod
    def present(cls, source: Source) -> bool:
        return source.at("positions.kind") == "rope" and not source.at("positions.nope")


class Attention(Part):
    kind: Literal["mha", "mla"] = setting("attention.kind", "mha (incl. GQA, MQA) or mla")
    heads: _Pos = setting("attention.heads", "query heads")
    kv_heads: _Pos = setting("attention.kv_heads", "key/value heads (GQA: fewer than heads)")
    head_dim: _Pos = setting("attention.head_dim", "each head's width")
    scale: _PosNum = setting("attention.scale", "the scores' multiplier, as a number (not always 1/sqrt(head_dim))")
    softcap: Optional[_PosNum] = setting("attention.softcap", "scores become cap * tanh(scores / cap); null: none")
    causal: bool = setting("attention.causal", "a query sees no later key")
    sliding_window: Optional[_Count] = setting(
        "attention.sliding_window", "a query at i sees keys i - window + 1 .. i; null: every earlier key")
    chunk_size: Optional[_Pos] = setting(
        "attention.chunk_size", "keys visible only within the query's chunk of this many positions (Llama 4)", None)
    temperature: Optional[Temperature] = Field(None, description="queries scaled by position; null: not scaled")
    qk_norm: Literal["none", "per_head", "full_width"] = setting(
        "attention.qk_norm", "q and k normed per head, over the full projection width, or not")
    qk_norm_after_rope: bool = setting(
        "attention.qk_norm_after_rope", "the q/k norm reads the rotated q and k (Llama 4), not the projections",
        False)
    q_norm: Optional[Norm] = norm("attn.q_norm", "q's norm (qk_norm)")
    k_norm: Optional[Norm] = norm("attn.k_norm", "k's norm (qk_norm)")
    v_norm: Optional[Norm] = norm("attn.v_norm", "v's norm")
    k_eq_v: bool = setting("attention.k_eq_v", "the values are the keys' projection (no v weight)")
    kv_shared_from: Optional[_Count] = setting(
        "attention.kv_shared_from", "the earlier layer whose keys and values this one reuses (Gemma 4)")
    rope: Optional[Rope] = Field(description="the layer's RoPE; null: no RoPE (learned positions, a NoPE layer)")
    mla: Optional[Mla] = Field(description="MLA's latents; null: plain attention")
    sinks: bool = setting(
        "attention.sinks", "a learned logit per head (attn.sinks) joined to the softmax as one more column, its "
        "probability then dropped: the weights over the keys sum to less than 1 (GPT-OSS)", False)


# --------------------------------------------------------------------------------------------
# MLP and experts


class Glu(Part):
    """A gated unit's arithmetic beyond act(gate) * up (GPT-OSS's clamped SwiGLU), dense MLP and experts alike."""

    glu_limit: Optional[_PosNum] = setting(
        "mlp.glu_limit", "gate clamped to at most this, up to [-limit, limit]; null: no clamp", None)
    glu_alpha: _PosNum = setting(
        "mlp.glu_alpha", "the activation read at alpha * gate and divided by it (silu: gate * sigmoid(alpha * gate))",
        1.0)
    glu_up_offset: _Num = setting("mlp.glu_up_offset", "act(gate) * (up + offset)", 0.0)


class Moe(Glu):
    routing: Literal["softmax", "sigmoid", "topk_softmax", "topk_sigmoid"] = setting(
        "mlp.moe_routing", "the router's scores: over every expert, or over the top-k logits only")
    experts: _Pos = setting("mlp.experts", "routed experts")
    top_k: _Pos = setting("mlp.experts_per_token", "experts each token is sent to")
    groups: Optional[_Pos] = setting("mlp.moe_groups", "experts chosen within groups (DeepSeek-V3); null: one", None)
    groups_kept: Optional[_Pos] = setting("mlp.moe_groups_kept", "groups kept per token", None)
    renormalise: bool = setting("mlp.moe_renormalise", "the top-k weights divided by their sum", False)
    scale: Optional[_Num] = setting("mlp.moe_scale", "the routed output's multiplier; null: 1", None)
    shared_experts: Optional[_Count] = setting("mlp.shared_experts", "experts every token runs through", None)
    shared_intermediate_size: Optional[_Pos] = setting(
        "mlp.moe_shared_intermediate_size", "the shared experts' width; null: intermediate_size * shared_experts",
        None)
    shared_gate: bool = setting(
        "mlp.moe_shared_gate", "the shared experts' output times sigmoid(shared_gate(x)) (Qwen2-MoE)", False)
    intermediate_size: _Pos = setting("mlp.moe_intermediate_size", "each expert's width")
    activation: Activation = setting("mlp.activation", "the experts' activation")
    router_norm: Optional[Norm] = norm("moe.router_norm", "a norm on the router's input")
    router_input_scale: Optional[_Num] = setting(
        "mlp.moe_router_input_scale", "the router's input times this (Gemma 4)", None)
    router_dtype: Literal["float32", "model"] = setting(
        "mlp.moe_router_dtype", "float32: the router's weights kept and applied in float32 (DeepSeek-V3)")
    weights_dtype: Literal["float32", "model"] = setting(
        "mlp.moe_weights_dtype", "the dtype in which the routing weights multiply the experts' outputs: float32 "
        "(DeepSeek-V3, Gemma 4, Mixtral) or the model's (Qwen3-MoE); only a low-precision run tells", "float32")
    weights_input: bool = setting(
        "mlp.moe_weights_input", "the routing weights multiply each chosen expert's input instead (Llama 4)", False)
    expert_norm: Optional[Norm] = norm("moe_norm", "a norm on the experts' input")
    expert_post_norm: Optional[Norm] = norm("moe_post_norm", "a norm on the experts' weighted sum")
    dense_post_norm: Optional[Norm] = norm(
        "mlp_dense_post_norm", "the dense MLP that runs beside the experts, its output normed (Gemma 4)")

    @classmethod
    def present(cls, source: Source) -> bool:
        return bool(source.at("mlp.moe"))


class Mlp(Glu):
    gated: bool = setting("mlp.gated", "act(gate) * up, then down; not gated: act(up), then down")
    activation: Activation = setting("mlp.activation", "the exact activation (gelu_exact and gelu_tanh differ)")
    intermediate_size: _Pos = setting("mlp.intermediate_size", "the MLP's width")
    moe: Optional[Moe] = Field(description="the experts; null: a dense MLP")
    parallel: bool = setting(
        "mlp.parallel", "beside attention, on the layer's input: x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX)", False)
    shared_norm: bool = setting(
        "mlp.shared_norm", "parallel, reading attention's own normed input (Phi: one norm per layer)", False)


# --------------------------------------------------------------------------------------------
# Layers, embedding, head


class PerLayerInput(Part):
    post_norm: Optional[Norm] = norm("pli_post_norm", "the norm on the per-layer input's contribution (Gemma 4)")

    @classmethod
    def present(cls, source: Source) -> bool:
        return source.norm("pli_post_norm") is not None


class Layer(Part):
    norms: BlockNorms = Field(description="the block's norms, by where they sit")
    attention: Attention = Field(description="the layer's attention")
    mlp: Mlp = Field(description="the layer's MLP (or experts)")
    per_layer_input: Optional[PerLayerInput] = Field(description="Gemma 4's per-layer input; null: none")
    residual_scale: _PosNum = setting(
        "norm.residual_scale", "each sublayer's output times this, then added to the stream (Granite)", 1.0)


class PerLayerEmbedding(Part):
    size: _Pos = setting("embedding.per_layer_input_size", "the per-layer input's width, per layer")
    scale: _Num = derived("the per-layer token embedding times sqrt(size)")
    projection_scale: _Num = derived("the projected hidden state times hidden_size ** -0.5")
    combine_scale: _Num = derived("their sum times 2 ** -0.5")
    norm: Optional[Norm] = norm("embed.per_layer_norm", "the norm on the projection")

    @classmethod
    def present(cls, source: Source) -> bool:
        return bool(source.at("embedding.per_layer_input_size"))

    @classmethod
    def derive(cls, values: dict, source: Source) -> dict:
        size, hidden = values.get("size"), source.given.get("hidden_size")
        return {**values, "scale": float(size ** 0.5), "projection_scale": float(hidden ** -0.5),
                "combine_scale": float(2 ** -0.5)}


class Embedding(Part):
    scale: _Num = setting("embedding.scale", "the token embeddings times this (Gemma: sqrt(hidden))")
    scale_dtype: Literal["model", "float32", "bfloat16"] = setting(
        "embedding.scale_dtype", "the dtype the scale is rounded to first (Gemma: the model's); bfloat16: a port's "
        "mistake (embed-scale-rounded)")
    positions: Literal["rope", "learned"] = setting("positions.kind", "RoPE, or learned position embeddings")
    max_positions: Optional[_Pos] = setting("positions.max_positions", "the config's max_position_embeddings")
    token_types: _Count = setting("positions.token_types", "token type embeddings (BERT); 0: none")
    norm: Optional[Norm] = norm("embed.norm", "a norm on the embeddings (BERT)")
    per_layer_input: Optional[PerLayerEmbedding] = Field(description="Gemma 4's per-layer inputs; null: none")

    @classmethod
    def derive(cls, values: dict, source: Source) -> dict:
        return {**values, "token_types": values.get("token_types") or 0}


class HeadTransform(Part):
    activation: Activation = setting("mlp.activation", "dense, then this activation, then the norm (BERT)")
    norm: Optional[Norm] = norm("head.norm", "the transform's norm")

    @classmethod
    def present(cls, source: Source) -> bool:
        return bool(source.at("embedding.head_transform"))


class Head(Part):
    tied: bool = setting("embedding.tied", "the head is the token embedding matrix")
    softcap: Optional[_PosNum] = setting(
        "embedding.final_softcap", "logits become cap * tanh(logits / cap); null: none")
    transform: Optional[HeadTransform] = Field(description="a transform before the head (BERT); null: none")
    scale: _PosNum = setting(
        "embedding.logit_scale", "the logits times this (Cohere; Granite's 1 / logits_scaling), before any softcap",
        1.0)

    @classmethod
    def present(cls, source: Source) -> bool:
        return bool(source.given.get("logits"))


# --------------------------------------------------------------------------------------------
# The manifest: the model, its tensors and files


class Tensor(Part):
    shape: list[_Count]
    dtype: Literal["float32", "bfloat16", "float16", "float64"]
    transposed: bool = False  # the source stored it [in, out] (GPT-2's Conv1D)
    interleaved: _Count = 0  # a part of a fused tensor whose parts were interleaved in that many blocks (per head)
    file: Optional[str] = None


class File(Part):
    blake3_tensors: Optional[str] = None  # HASH; manifests written before it have blake3 or sha256 (of the file)
    blake3: Optional[str] = None
    sha256: Optional[str] = None
    bytes: _Count

    @model_validator(mode="after")
    def _one_hash(self) -> File:
        if sum(h is not None for h in (self.blake3_tensors, self.blake3, self.sha256)) != 1:
            raise ValueError("needs one hash: blake3_tensors (or blake3 or sha256, in manifests written before)")
        return self

    @property
    def hash(self) -> tuple[str, str]:
        """(algorithm, hex digest): HASH, or what manifests written before it record."""
        return next((a, v) for a in ("blake3_tensors", "blake3", "sha256") if (v := getattr(self, a)) is not None)


class SourceInfo(Part):
    """The checkpoint a neutral directory was converted from."""

    family: str
    architecture: Optional[str] = None
    model_type: Optional[str] = None
    path: Optional[str] = None
    rope_style: Optional[RopeStyle] = None  # the checkpoint's q/k row order; absent before ops (docs/ops.md)
    hash: Literal["blake3_tensors", "blake3", "sha256"] = "sha256"  # of files; absent before parity used BLAKE3
    files: dict[str, str] = {}
    quantization: Optional[dict[str, Any]] = None  # what dequantizing a quantized source cost (FP8)


class CachePolicy(Part):
    """What the executor's KV cache does (parity.neutral.executor.cache); a decode mistake of the catalog changes one
    entry, so that the executor runs the mistake an engine's cache would make."""

    position_offset: int = 0     # added to each decode step's position (a port that counts the new token twice: 1)
    window_slack: int = 0        # a sliding-window ring holds window + slack entries (-1: wraps one slot early)
    layer_shift: int = 0         # layer i writes its keys to slot (i + shift) mod layers; it always reads slot i
    decode_softcap: bool = True  # the attention softcap applied in decode steps, as the prefill applies it
    kv_head_order: Literal["kept", "reversed"] = "kept"  # reversed: each GQA group reads another's kv head
    # a decode step whose length changes the RoPE tables (LongRoPE past its original length) computes the prefix
    # again, as transformers' Phi-3 does; False: the cached keys stay rotated with the old tables
    refill_on_rope_change: bool = True


class Manifest(Part):
    """A neutral directory's ``manifest.json``: the model's conventions, its tensors and its files."""

    format: Literal["parity-neutral"] = FORMAT
    format_version: Literal[1] = FORMAT_VERSION
    written_by: Optional[str] = None
    dtype: DtypeName = Field(description="the dtype the model runs in and its tensors are stored in")
    source: SourceInfo
    vocab_size: _Pos = Field(description="the token embedding's rows")
    hidden_size: _Pos = Field(description="the residual stream's width")
    num_layers: _Pos = Field(description="the layers, each described in layers[]")
    rope_style: Optional[RopeStyle] = Field(description="the q/k row order the weights are written in")
    embedding: Embedding = Field(description="tokens (and positions) to the first hidden state")
    layers: list[Layer] = Field(description="one entry per layer")
    final_norm: Optional[Norm] = norm("final_norm", "the norm after the last layer")
    head: Optional[Head] = Field(description="the LM head; null: the model ends at its last hidden state")
    capture_points: list[str] = Field(description="the points the executor reports, in order (docs/design.md)")
    tensors: dict[str, Tensor]
    files: dict[str, File] = {}
    injected: Optional[str] = None  # the catalogued mistake applied (parity.diagnosis.bugs)
    kv_cache: Optional[CachePolicy] = None  # a decode mistake's cache; null: a correct cache

    def to_json(self) -> dict:
        """The manifest as ``manifest.json`` holds it."""
        return self.model_dump(mode="json", exclude_none=False, exclude=_unset(self))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def attentions(self):
        """(layer index, attention) for every layer."""
        return ((i, layer.attention) for i, layer in enumerate(self.layers))

    def ropes(self) -> list[Rope]:
        """Every layer's RoPE (NoPE layers have none)."""
        return [att.rope for _, att in self.attentions() if att.rope is not None]

    def moes(self) -> list[Moe]:
        return [layer.mlp.moe for layer in self.layers if layer.mlp.moe is not None]

    def norms(self):
        """Every norm: (its tensor name prefix, the norm, the part holding it, its field there)."""
        emb = self.embedding
        if emb.norm:
            yield "embed.norm", emb.norm, emb, "norm"
        if emb.per_layer_input and emb.per_layer_input.norm:
            yield "embed.per_layer_norm", emb.per_layer_input.norm, emb.per_layer_input, "norm"
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            for slot in BLOCK_NORMS:
                if getattr(layer.norms, slot):
                    yield p + slot, getattr(layer.norms, slot), layer.norms, slot
            att = layer.attention
            for key in ("q_norm", "k_norm", "v_norm"):
                if getattr(att, key):
                    yield p + f"attn.{key}", getattr(att, key), att, key
            if att.mla:
                for key in ("q_a_norm", "kv_a_norm"):
                    if getattr(att.mla, key):
                        yield p + f"attn.{key}", getattr(att.mla, key), att.mla, key
            moe = layer.mlp.moe
            if moe:
                for key, name in (("router_norm", "moe.router_norm"), ("expert_norm", "moe_norm"),
                                  ("expert_post_norm", "moe_post_norm"), ("dense_post_norm", "mlp_dense_post_norm")):
                    if getattr(moe, key):
                        yield p + name, getattr(moe, key), moe, key
            if layer.per_layer_input and layer.per_layer_input.post_norm:
                yield p + "pli_post_norm", layer.per_layer_input.post_norm, layer.per_layer_input, "post_norm"
        if self.final_norm:
            yield "final_norm", self.final_norm, self, "final_norm"
        if self.head and self.head.transform and self.head.transform.norm:
            yield "head.norm", self.head.transform.norm, self.head.transform, "norm"

    def layer_of(self, name: str) -> Layer | None:
        """The layer a neutral tensor name (``layers.{i}....``) belongs to; None outside the layers."""
        return self.layers[int(name.split(".")[1])] if name.startswith("layers.") else None

    def summary(self) -> dict[str, Any]:
        return {"family": self.source.family, "dtype": self.dtype, "layers": self.num_layers,
                "tensors": len(self.tensors), "files": list(self.files)}


def _unset(m: Manifest) -> dict:
    """What ``manifest.json`` leaves out when it is not set: the fields manifests written before it lack."""
    def left_out(part: BaseModel, fields: tuple[str, ...]) -> dict[str, bool]:
        return {k: True for k in fields if getattr(part, k) is None}

    tensors = {name: left_out(t, ("file",)) | ({} if t.interleaved else {"interleaved": True})
               for name, t in m.tensors.items()}
    files = {name: left_out(f, ("blake3_tensors", "blake3", "sha256")) for name, f in m.files.items()}
    return {**left_out(m, ("injected", "kv_cache")),
            "files": files or True,  # none: a model built to run, not written
            "source": left_out(m.source, ("quantization",)), "tensors": tensors}


# --------------------------------------------------------------------------------------------
# Cross-checks: what the schema cannot say alone


# RoPE scaling parameters per type, as parity/rope.py reads them: (required, optional) -> kind of value
SCALING_PARAMS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "default": ({}, {}),
    "linear": ({"factor": "positive"}, {}),
    "dynamic": ({"factor": "positive"}, {}),
    "proportional": ({}, {"factor": "positive", "partial_rotary_factor": "fraction"}),
    "llama3": ({"factor": "positive", "low_freq_factor": "positive", "high_freq_factor": "positive"},
               {"original_max_position_embeddings": "size"}),
    "yarn": ({}, {"factor": "positive", "original_max_position_embeddings": "size", "attention_factor": "positive",
                  "beta_fast": "positive", "beta_slow": "positive", "mscale": "number", "mscale_all_dim": "number",
                  "truncate": "bool"}),
    "longrope": ({"long_factor": "factors", "short_factor": "factors"},
                 {"factor": "positive", "original_max_position_embeddings": "size", "attention_factor": "positive"}),
}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_SCALING_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "positive": ("a positive number", lambda x: _finite(x) and x > 0),
    "number": ("a finite number", _finite),
    "fraction": ("a number in (0, 1]", lambda x: _finite(x) and 0 < x <= 1),
    "size": ("a positive integer", lambda x: isinstance(x, int) and not isinstance(x, bool) and x > 0),
    "bool": ("true or false", lambda x: isinstance(x, bool)),
    "factors": ("a list of positive numbers", lambda x: isinstance(x, list) and all(_finite(v) and v > 0 for v in x)),
}


def scaling_problems(rope: Rope, where: str) -> list[str]:
    """Problems with one layer's RoPE scaling (parity/rope.py SCALINGS), as 'where: what' strings."""
    scaling = rope.scaling or {}
    kind = scaling.get("rope_type", "default")
    if not isinstance(kind, str) or kind not in SCALING_PARAMS:
        return [f"{where}.rope_type: unknown RoPE scaling type {str(kind)[:30]!r}; known: {', '.join(SCALING_PARAMS)}"]
    required, optional = SCALING_PARAMS[kind]
    problems = [f"{where}: {kind} scaling needs {key}" for key in required if scaling.get(key) is None]
    for key, need in {**required, **optional}.items():
        value = scaling.get(key)
        label, ok = _SCALING_KINDS[need]
        if value is not None and not ok(value):
            problems.append(f"{where}.{key}: must be {label} (got {json.dumps(value)[:40]})")
    if problems:
        return problems
    if kind == "llama3" and scaling.get("high_freq_factor") <= scaling.get("low_freq_factor"):
        problems.append(f"{where}: high_freq_factor must exceed low_freq_factor")
    pairs = rope.rotary_dim // 2
    if kind == "longrope" and not len(scaling.get("long_factor")) == len(scaling.get("short_factor")) == pairs:
        problems.append(f"{where}: long_factor and short_factor need rotary_dim / 2 = {pairs} values")
    needs_length = kind == "dynamic" or (kind in ("llama3", "yarn", "longrope")
                                         and scaling.get("original_max_position_embeddings") is None)
    if needs_length and rope.max_positions is None:
        problems.append(f"{where}: {kind} scaling needs max_positions")
    return problems


def executor_tensors(m: Manifest) -> dict[str, tuple[int, ...]]:
    """The tensors the executor indexes for this manifest, with the shapes its sizes imply."""
    v, d = m.vocab_size, m.hidden_size
    e = m.embedding
    out: dict[str, tuple[int, ...]] = {"embed.tokens.weight": (v, d)}
    if e.positions == "learned":
        out["embed.positions.weight"] = (e.max_positions or 0, d)
    if e.token_types:
        out["embed.token_types.weight"] = (e.token_types, d)
    pli = e.per_layer_input
    if pli is not None:
        out["embed.per_layer_tokens.weight"] = (v, m.num_layers * pli.size)
        out["embed.per_layer_projection.weight"] = (m.num_layers * pli.size, d)
    if m.head is not None and not m.head.tied:
        out["lm_head.weight"] = (v, d)
    for i, layer in enumerate(m.layers):
        p = f"layers.{i}."
        att, mlp = layer.attention, layer.mlp
        h = att.heads
        if att.mla is not None:
            mla = att.mla
            nope, rot, vd = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
            if mla.q_lora_rank is None:
                out[p + "attn.q.weight"] = (h * (nope + rot), d)
            else:
                out[p + "attn.q_a.weight"] = (mla.q_lora_rank, d)
                out[p + "attn.q_b.weight"] = (h * (nope + rot), mla.q_lora_rank)
            out[p + "attn.kv_a.weight"] = (mla.kv_lora_rank + rot, d)
            out[p + "attn.kv_b.weight"] = (h * (nope + vd), mla.kv_lora_rank)
            out[p + "attn.o.weight"] = (d, h * vd)
        else:
            dh = att.head_dim
            out[p + "attn.q.weight"] = (h * dh, d)
            if att.kv_shared_from is None:
                out[p + "attn.k.weight"] = (att.kv_heads * dh, d)
                if not att.k_eq_v:
                    out[p + "attn.v.weight"] = (att.kv_heads * dh, d)
            out[p + "attn.o.weight"] = (d, h * dh)
        moe = mlp.moe
        if moe is None or moe.dense_post_norm is not None:  # a dense MLP runs
            size = mlp.intermediate_size
            out[p + "mlp.up.weight"] = (size, d)
            out[p + "mlp.down.weight"] = (d, size)
            if mlp.gated:
                out[p + "mlp.gate.weight"] = (size, d)
        if moe is not None:
            out[p + "moe.router.weight"] = (moe.experts, d)
            size = moe.intermediate_size
            for k in range(moe.experts):
                out.update({f"{p}moe.experts.{k}.gate.weight": (size, d), f"{p}moe.experts.{k}.up.weight": (size, d),
                            f"{p}moe.experts.{k}.down.weight": (d, size)})
        if layer.per_layer_input is not None and pli is not None:
            out[p + "pli.gate.weight"] = (pli.size, d)
            out[p + "pli.proj.weight"] = (d, pli.size)
    return out


def field_table() -> str:
    """docs/neutral-layout.md's table of the model's fields, from their declarations."""
    rows = ["| field | adapter setting (or source) | default | meaning |", "|---|---|---|---|"]
    for path, source, default, meaning in declarations(Manifest):
        if path.startswith(("tensors", "files", "source", "kv_cache", "format", "written_by", "injected")):
            continue
        rows.append(f"| `{path}` | {source} | {f'`{default}`' if default else ''} | {meaning} |")
    rows += [f"| `{path}` | {source} | {f'`{default}`' if default else ''} | {meaning} |"
             for path, source, default, meaning in declarations(Norm, "Norm.")]
    return "\n".join(rows)
