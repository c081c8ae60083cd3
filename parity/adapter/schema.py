"""The adapter schema: what one adapter file may say, as pydantic models (unknown keys are refused).

Convention fields that only describe a feature a family may lack (MoE, MLA, softcaps, windows, extra norms,
KV sharing, embedding extras) default to "absent" (``false``, ``"none"``, ``0``), so a dense family does not
spell them; ``parity adapters --resolved NAME`` prints every field as resolved. Loading (and ``extends``) is in
``parity.adapter.files``; applying an adapter to a config is in ``parity.adapter``.
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib.util import find_spec
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, create_model, model_validator

from parity.neutral.declared import settings
from parity.adapter.expr import compile_expr
from parity.neutral.model import Manifest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Param(_Strict):
    """A value read from the config (``key`` with a ``default``) or computed (``expr``)."""

    key: Union[str, list[str], None] = None
    default: Any = None
    null: Literal["default", "none"] = "default"  # what a key present in the config as null means
    default_expr: Union[str, None] = None
    expr: Union[str, None] = None
    map: Union[dict[str, Any], None] = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.key is None) == (self.expr is None):
            raise ValueError("give exactly one of 'key' (a config key) or 'expr' (an expression)")
        if self.expr is not None and (self.default is not None or self.default_expr is not None):
            raise ValueError("'default' only applies to 'key'")
        for source in (self.expr, self.default_expr):
            if source is not None:
                compile_expr(source)
        return self

    @property
    def keys(self) -> list[str]:
        return [self.key] if isinstance(self.key, str) else list(self.key or [])


Value = Union[Param, bool, int, float, str, list, None]

# Allowed values of convention fields that are enumerations; checked on literals at load time
# and on every resolved value.
CHOICES: dict[str, tuple] = {
    "norm.kind": ("rmsnorm", "layernorm"),
    "norm.weight": ("weight", "one_plus_weight"),
    "norm.upcast": ("float32", "none"),
    "norm.weight_dtype": ("float32", "model"),
    "norm.placement": ("pre", "post", "sandwich", "sublayer_output"),
    "attention.qk_norm": ("none", "per_head", "full_width"),
    "attention.qk_norm_weight": ("weight", "one_plus_weight"),
    "attention.v_norm": ("none", "weighted", "weightless"),
    "attention.kind": ("mha", "mla"),
    "positions.kind": ("rope", "learned"),
    "positions.rope_style": ("half", "interleaved", "none"),
    "positions.rope_dtype": ("model", "float32"),
    "mlp.activation": ("gelu_exact", "gelu_tanh", "silu", "relu"),
    "mlp.moe_routing": ("none", "softmax", "sigmoid", "topk_softmax", "topk_sigmoid"),
    "mlp.moe_router_dtype": ("float32", "model"),
    "mlp.moe_weights_dtype": ("float32", "model"),
    "embedding.scale_dtype": ("model", "float32"),
}


# Optional numbers (a softcap, a window, an MLA rank): ``false`` in an adapter, or null/absent in
# a config, means the model does not have the feature; resolved as None.
OPTIONAL = frozenset({
    "attention.softcap", "attention.sliding_window", "attention.chunk_size", "attention.temperature_floor",
    "attention.kv_shared_from", "attention.q_lora_rank",
    "attention.kv_lora_rank", "attention.qk_nope_head_dim", "attention.qk_rope_head_dim", "attention.v_head_dim",
    "mlp.experts", "mlp.experts_per_token", "mlp.shared_experts", "mlp.moe_intermediate_size",
    "mlp.moe_shared_intermediate_size",
    "mlp.moe_groups", "mlp.moe_groups_kept", "mlp.moe_scale", "mlp.moe_router_input_scale", "mlp.glu_limit",
    "embedding.final_softcap", "embedding.per_layer_input_size",
    "positions.rope_theta", "positions.rope_scaling", "positions.rotary_dim",
})

# transformers' activation names (ACT2FN keys) and the exact function each one computes.
ACTIVATIONS = {
    "gelu": "gelu_exact",
    "gelu_python": "gelu_exact",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}


class Variant(_Strict):
    """One way the family appears on disk: architecture names, model_type, tensor prefix."""

    architectures: list[str]
    model_type: str
    text_config: Union[str, None] = None
    tensor_prefix: list[str]
    module_prefix: str
    lm_head: bool = True
    ignore: list[str] = []


class NormConvention(_Strict):
    kind: Value
    eps: Value
    bias: Value = False
    weight: Value
    upcast: Value
    weight_dtype: Value
    placement: Value
    final: Value
    embedding: Value = False


class AttentionConvention(_Strict):
    kind: Value = "mha"
    causal: Value
    heads: Value
    kv_heads: Value
    head_dim: Value
    q_bias: Value
    k_bias: Value
    v_bias: Value
    o_bias: Value
    fused_qkv: Value = False
    qk_norm: Value = "none"
    qk_norm_weight: Value = "weight"
    v_norm: Value = "none"
    scale: Value
    softcap: Value = False
    sliding_window: Value = False
    # per layer: key j is visible from query i only within i's chunk (i // chunk_size == j // chunk_size), besides
    # causality (Llama 4's chunked attention); none: no chunks
    chunk_size: Value = False
    # per layer: the queries are multiplied by log1p(floor((position + 1) / temperature_floor)) * temperature_scale
    # + 1, in float32, before attention (Llama 4's attention temperature tuning on its NoPE layers); none: not scaled
    temperature_floor: Value = False
    temperature_scale: Value = 0.1
    k_eq_v: Value = False
    kv_shared_from: Value = False
    q_lora_rank: Value = False
    kv_lora_rank: Value = False
    qk_nope_head_dim: Value = False
    qk_rope_head_dim: Value = False
    v_head_dim: Value = False


class PositionConvention(_Strict):
    kind: Value
    max_positions: Value
    token_types: Value = 0
    rope_theta: Value
    rope_style: Value
    rotary_dim: Value
    rope_scaling: Value
    rope_dtype: Value    # "model": q/k rotated in the model dtype; "float32": upcast, rotated, cast back (OLMo 2)
    nope: Value = False  # per layer: this layer applies no RoPE at all (SmolLM3, Cohere 2's and Llama 4's NoPE layers)
    scaling_types: list[str] = []   # the rope_scaling types the family accepts (none: learned positions)


class MLPConvention(_Strict):
    gated: Value
    activation: Value
    intermediate_size: Value
    bias: Value = False
    moe: Value = False
    moe_routing: Value = "none"
    experts: Value = False
    experts_per_token: Value = False
    shared_experts: Value = False
    moe_intermediate_size: Value = False
    # the shared experts' MLP width where it is not moe_intermediate_size * shared_experts (Qwen2-MoE's one shared
    # expert of shared_expert_intermediate_size); none: that product
    moe_shared_intermediate_size: Value = False
    moe_groups: Value = False            # experts are chosen within groups (DeepSeek-V3 n_group); none = one group
    moe_groups_kept: Value = False       # groups kept per token (topk_group)
    moe_scale: Value = False             # routed output multiplier (routed_scaling_factor); none = 1
    moe_router_input_scale: Value = False  # the router's input is multiplied by this (Gemma 4: hidden ** -0.5)
    moe_router_dtype: Value = "model"      # "float32": router weights kept and applied in float32 (DeepSeek-V3); "model"
    # GPT-OSS's clamped SwiGLU (dense MLP and experts alike): gate clamped to at most glu_limit and up to
    # [-glu_limit, glu_limit]; none: no clamp
    glu_limit: Value = False


class EmbeddingConvention(_Strict):
    scale: Value = 1.0
    scale_dtype: Value = "model"
    tied: Value
    final_softcap: Value = False
    head_transform: Value = False
    per_layer_input_size: Value = False


def _declared(section: type[_Strict], name: str) -> type[_Strict]:
    """``section`` with a field for every setting ``[name].KEY`` the neutral model declares with a default
    (parity.neutral.model: ``setting("attention.sinks", meaning, False)``): a convention is declared once, there,
    with its meaning and its default, and an adapter file may set it. The fields above are the settings the model
    reads with another default (an adapter's ``false`` for absent, the manifest's ``null``) or not at all."""
    added = {key.partition(".")[2]: (Value, info.get_default()) for key, info in settings(Manifest).items()
             if key.partition(".")[0] == name and not info.is_required()
             and key.partition(".")[2] not in section.model_fields}
    return create_model(section.__name__, __base__=section, __module__=__name__, **added)


NormConvention = _declared(NormConvention, "norm")
AttentionConvention = _declared(AttentionConvention, "attention")
PositionConvention = _declared(PositionConvention, "positions")
MLPConvention = _declared(MLPConvention, "mlp")
EmbeddingConvention = _declared(EmbeddingConvention, "embedding")


class NormModule(_Strict):
    """A norm module in the transformers model; its tensors are ``{hf}.weight`` / ``{hf}.bias``."""

    hf: str
    neutral: str
    group: Literal["block", "attention", "mla", "moe", "embedding", "final", "per_layer_input", "head"]
    dim: str
    when: Union[str, None] = None
    has_weight: bool = True
    convention: Literal["norm", "qk_norm"] = "norm"
    eps: Union[str, None] = None  # an expression, where this norm's eps is not the family's norm.eps


class Split(_Strict):
    """``sizes``: each part's total along ``dim``, in order. ``groups`` (an expression): the parts are interleaved
    in that many consecutive blocks along ``dim``, each holding its share (size / groups) of every part in order
    (GPT-NeoX's query_key_value: [heads, 3, head_dim], q|k|v per head); absent: the parts lie one after another."""

    dim: int
    sizes: list[str]
    # the parts alternate along ``dim`` (part k: entries k, k + n, k + 2n, ... of n parts; GPT-OSS's gate_up_proj
    # holds gate at [..., ::2] and up at [..., 1::2]), instead of following one another; the sizes must be equal
    interleaved: bool = False
    groups: Union[str, None] = None


class TensorEntry(_Strict):
    """A checkpoint tensor (shape as stored) and where it goes in the neutral layout.

    Transforms apply in this order: ``transpose`` (GPT-2's Conv1D ``[in, out]``; of a stacked ``[E, in, out]``
    tensor, each expert's last two dims), ``unstack`` (a stacked ``[E, ...]`` expert tensor into one tensor per
    expert, names with ``{e}``), then ``split`` along ``dim`` of each (unstacked) tensor into the neutral names,
    in order (or alternating, ``interleaved``).
    """

    hf: str
    neutral: Union[str, list[str]]
    shape: list[str]
    when: Union[str, None] = None
    experts: Union[str, None] = None
    transpose: bool = False
    unstack: bool = False
    split: Union[Split, None] = None


# What a saved buffer holds, and so how ``inspect`` checks it against the config.
BUFFER_KINDS = ("rope_inv_freq", "position_ids", "token_type_ids", "causal_mask", "mask_value", "tied_copy")


class Buffer(_Strict):
    """A buffer some checkpoints carry beside the weights (persistent in older transformers, or kept by merge
    and re-save tools): recognised, listed apart, checked where it encodes a convention, never converted.

    ``kind``: ``rope_inv_freq`` (RoPE inverse frequencies: must agree with rope_theta / rope_scaling),
    ``position_ids`` (``arange``), ``token_type_ids`` (zeros), ``causal_mask`` (a lower-triangular mask),
    ``mask_value`` (the fill value of masked scores), ``tied_copy`` (a tied head saved anyway: it must equal
    ``same_as``, or transformers unties the two and uses it).
    """

    hf: str
    kind: Literal[BUFFER_KINDS]
    when: Union[str, None] = None
    same_as: Union[str, None] = None

    @model_validator(mode="after")
    def _same_as(self):
        if (self.kind == "tied_copy") != (self.same_as is not None):
            raise ValueError("give 'same_as' (the tensor it copies) exactly for kind 'tied_copy'")
        return self


class CapturePoint(_Strict):
    """Where a capture point is read: a module's input (``arg``) or output (``field``)."""

    module: str
    io: Literal["input", "output"]
    arg: Union[str, int, None] = None
    field: Union[str, int, None] = None
    when: Union[str, None] = None


# What an ``io = "attention"`` op reads from the attention function of its module (parity.reference.capture)
ATTENTION_FIELDS = ("query", "key", "scores", "probs")


class OpPoint(_Strict):
    """Where an operation-level point (docs/ops.md) is read: as a capture point (a module's ``input`` or
    ``output``), where ``slice`` = [start, stop] (expressions) keeps part of the last dimension (a fused
    projection's q, k or v) and ``heads_first`` says the value is held [B, H, S, D] (a per-head norm applied after
    the heads are moved before the positions), not [B, S, ...]; or ``io = "attention"``: what the module hands its
    attention function, ``field`` one of ATTENTION_FIELDS (query and key as passed, after RoPE; the softmax's
    input and output)."""

    module: str
    io: Literal["input", "output", "attention"]
    arg: Union[str, int, None] = None
    field: Union[str, int, None] = None
    slice: Union[list[str], None] = None
    # the last dimension is that many consecutive blocks, and ``slice`` is taken within each (a fused projection
    # laid out per head: GPT-NeoX's query_key_value output is [heads, 3 * head_dim])
    groups: Union[str, None] = None
    heads_first: bool = False
    when: Union[str, None] = None

    @model_validator(mode="after")
    def _fields(self):
        if self.groups is not None and self.slice is None:
            raise ValueError("'groups' says where 'slice' is taken: give a 'slice' too")
        if self.io == "attention" and (self.field not in ATTENTION_FIELDS or self.arg is not None
                                       or self.slice is not None or self.heads_first):
            raise ValueError(f"io = \"attention\" reads one 'field' of {', '.join(ATTENTION_FIELDS)} (no arg, "
                             f"slice or heads_first: its layout is known)")
        if self.slice is not None and len(self.slice) != 2:
            raise ValueError("'slice' is [start, stop] of the last dimension")
        return self


class Tiny(_Strict):
    """How ``parity make-tiny`` builds a test checkpoint of the family (config overrides)."""

    architecture: str
    layers: int
    config: dict[str, Any]
    expr: dict[str, str] = {}  # config values computed from ``num_layers``


class AdapterFile(_Strict):
    family: str
    description: str
    variants: list[Variant]
    derive: dict[str, Param] = {}
    norm: NormConvention
    attention: AttentionConvention
    positions: PositionConvention
    mlp: MLPConvention
    embedding: EmbeddingConvention
    norms: list[NormModule]
    tensors: list[TensorEntry]
    buffers: list[Buffer] = []
    # Legacy tensor-name endings some checkpoints still use -> today's (BERT's TF-era ``LayerNorm.gamma``);
    # transformers renames them on load, and so does the tensor check.
    legacy_names: dict[str, str] = {}
    capture: dict[str, CapturePoint]
    # operation-level points (docs/ops.md): an entry, or alternatives of which the first whose `when` holds is read
    ops: dict[str, Union[OpPoint, list[OpPoint]]] = {}
    tiny: Tiny


def _engine_sections() -> dict[str, Any]:
    """Each engine's section of an adapter file, named after its folder: the ``SECTION`` its
    ``parity/engines/<engine>/adapter.py`` declares (an engine in one folder: no line here names it); absent from
    a file, the family is not exported to that engine."""
    engines = find_spec("parity.engines")
    found = {}
    for engine in pkgutil.iter_modules(engines.submodule_search_locations):
        module = f"parity.engines.{engine.name}.adapter"
        if engine.ispkg and find_spec(module) is not None:
            found[engine.name] = (Union[importlib.import_module(module).SECTION, None], None)
    return found


AdapterFile = create_model("AdapterFile", __base__=AdapterFile, __module__=__name__, **_engine_sections())


SECTIONS = ("norm", "attention", "positions", "mlp", "embedding")
