"""Adapters: one declarative TOML file per model family, validated by one schema.

An adapter says how to recognise a family, which numerical conventions it follows (each with
the config key it comes from and a default), where every checkpoint tensor goes in the neutral
layout, and where each capture point is read in the transformers model. Code never branches on
a family name; it reads these files.

Values in an adapter are either literals (fixed by the family) or parameters read from the
checkpoint's config::

    eps = { key = "rms_norm_eps", default = 1e-6 }           # config key, default when absent
    scale = { expr = "query_pre_attn_scalar ** -0.5" }        # derived from other values
    weight = "one_plus_weight"                                # a literal: the family's convention

Expressions (``parity.expr``) may use config keys, ``[derive]`` names and, for per-layer
values, the layer index ``i``.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from . import names
from .errors import ParityError
from .expr import ExprError, compile_expr, evaluate, free_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_VAR = "PARITY_ADAPTERS"


# --------------------------------------------------------------------------------------------
# Schema


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
    "mlp.moe_routing": ("none", "softmax", "sigmoid"),
    "mlp.moe_router_dtype": ("float32", "model"),
    "mlp.moe_weights_dtype": ("float32", "model"),
    "embedding.scale_dtype": ("model", "float32"),
}


# Optional numbers (a softcap, a window, an MLA rank): ``false`` in an adapter, or null/absent in
# a config, means the model does not have the feature; resolved as None.
OPTIONAL = frozenset({
    "attention.softcap", "attention.sliding_window", "attention.kv_shared_from", "attention.q_lora_rank",
    "attention.kv_lora_rank", "attention.qk_nope_head_dim", "attention.qk_rope_head_dim", "attention.v_head_dim",
    "mlp.experts", "mlp.experts_per_token", "mlp.shared_experts", "mlp.moe_intermediate_size",
    "mlp.moe_groups", "mlp.moe_groups_kept", "mlp.moe_scale", "mlp.moe_router_input_scale",
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
    bias: Value
    weight: Value
    upcast: Value
    weight_dtype: Value
    placement: Value
    final: Value
    embedding: Value


class AttentionConvention(_Strict):
    kind: Value
    causal: Value
    heads: Value
    kv_heads: Value
    head_dim: Value
    q_bias: Value
    k_bias: Value
    v_bias: Value
    o_bias: Value
    fused_qkv: Value
    qk_norm: Value
    qk_norm_weight: Value
    v_norm: Value
    scale: Value
    softcap: Value
    sliding_window: Value
    k_eq_v: Value
    kv_shared_from: Value
    q_lora_rank: Value
    kv_lora_rank: Value
    qk_nope_head_dim: Value
    qk_rope_head_dim: Value
    v_head_dim: Value


class PositionConvention(_Strict):
    kind: Value
    max_positions: Value
    token_types: Value
    rope_theta: Value
    rope_style: Value
    rotary_dim: Value
    rope_scaling: Value
    rope_dtype: Value    # "model": q/k rotated in the model dtype; "float32": upcast, rotated, cast back (OLMo 2)
    scaling_types: list[str]


class MLPConvention(_Strict):
    gated: Value
    activation: Value
    intermediate_size: Value
    bias: Value
    moe: Value
    moe_routing: Value
    experts: Value
    experts_per_token: Value
    shared_experts: Value
    moe_intermediate_size: Value
    moe_groups: Value            # experts are chosen within groups (DeepSeek-V3 n_group); none = one group
    moe_groups_kept: Value       # groups kept per token (topk_group)
    moe_renormalise: Value       # top-k weights rescaled to sum to 1
    moe_scale: Value             # routed output multiplier (routed_scaling_factor); none = 1
    moe_router_input_scale: Value  # the router's input is multiplied by this (Gemma 4: hidden ** -0.5)
    moe_router_dtype: Value      # "float32": router weights kept and applied in float32 (DeepSeek-V3); "model"
    # The dtype in which the routing weights multiply the experts' outputs: "float32" (the weights stay float32,
    # as DeepSeek-V3, Gemma 4 and Mixtral leave them), or "model" (cast to the model dtype first, as
    # Qwen3MoeTopKRouter does). Only a low-precision run can tell; absent means "float32".
    moe_weights_dtype: Value = "float32"


class EmbeddingConvention(_Strict):
    scale: Value
    scale_dtype: Value
    tied: Value
    final_softcap: Value
    head_transform: Value
    per_layer_input_size: Value


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
    dim: int
    sizes: list[str]


class TensorEntry(_Strict):
    """A checkpoint tensor (shape as stored) and where it goes in the neutral layout.

    Transforms apply in this order: ``transpose`` (GPT-2's Conv1D ``[in, out]``), ``unstack``
    (a stacked ``[E, ...]`` expert tensor into one tensor per expert, names with ``{e}``), then
    ``split`` along ``dim`` of each (unstacked) tensor into the neutral names, in order.
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


class GGUFExport(_Strict):
    """How llama.cpp runs the family: its architecture name in GGUF metadata, and the q/k row layout its RoPE
    kernel for that architecture expects ("interleaved": LLAMA_ROPE_TYPE_NORM, adjacent pairs, so
    convert_hf_to_gguf.py permutes Llama's q/k; "half": NEOX, as Hugging Face stores them)."""

    arch: str
    rope_style: Literal["half", "interleaved"]
    windows: bool = False           # reads attention.sliding_window and a per-layer sliding_window_pattern
    softcaps: bool = False          # reads attn_logit_softcapping / final_logit_softcapping
    local_rope_base: bool = False   # sliding layers rotate with rope.freq_base_swa
    # llama.cpp graph tensors whose meaning in this architecture differs from parity/candidates/gguf.py's table:
    # {tensor name ({i}: the layer): capture point, or "" where it is none of them}; a name llama.cpp gives no
    # layer index may still map to "layers.{i}...": the layer of the indexed tensor computed before it
    points: dict[str, str] = {}


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
    gguf: Union[GGUFExport, None] = None   # absent: the family is not exported to GGUF
    tiny: Tiny


SECTIONS = ("norm", "attention", "positions", "mlp", "embedding")


# --------------------------------------------------------------------------------------------
# Loading and validation


@dataclass(frozen=True)
class Adapter:
    spec: AdapterFile
    path: Path

    @property
    def family(self) -> str:
        return self.spec.family


def _loc(loc: Iterable) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("Param", "bool", "int", "float", "str", "list", "none") or "[" in str(part):
            continue  # pydantic's union-branch labels say nothing to a reader
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _fail(path: Path, key: str, why: str) -> ParityError:
    return ParityError(f"{path}: {key}: {why}")


def load_adapter(path: Path) -> Adapter:
    """Read and validate one adapter file; errors name the file and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise _fail(path, "(syntax)", f"not valid TOML: {exc}") from None
    except OSError as exc:
        raise ParityError(f"{path}: cannot read adapter: {exc.strerror}") from None
    try:
        spec = AdapterFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        kind = err["type"]
        if kind == "extra_forbidden":
            why = "unknown key (check its spelling against the schema in parity/adapter.py)"
        elif kind == "missing":
            why = "required key is missing"
        else:
            why = err["msg"]
        more = f" (and {len(exc.errors()) - 1} more problem(s))" if len(exc.errors()) > 1 else ""
        raise _fail(path, _loc(err["loc"]), why + more) from None
    except ExprError as exc:  # pragma: no cover - pydantic wraps validator errors
        raise _fail(path, "(expression)", str(exc)) from None
    _check_semantics(spec, path)
    return Adapter(spec, path)


def _check_semantics(spec: AdapterFile, path: Path) -> None:
    if spec.family != path.stem:
        raise _fail(path, "family", f"{spec.family!r} must match the file name {path.stem!r}")
    for section in SECTIONS:
        for key, value in getattr(spec, section):
            choices = CHOICES.get(f"{section}.{key}")
            if choices is None:
                continue
            if isinstance(value, Param):
                for mapped in (value.map or {}).values():
                    if mapped not in choices:
                        raise _fail(path, f"{section}.{key}.map", f"{mapped!r} is not one of {', '.join(choices)}")
                if value.key is not None and value.default is not None and value.map is None and value.default not in choices:
                    raise _fail(path, f"{section}.{key}.default", f"{value.default!r} is not one of {', '.join(choices)}")
            elif value not in choices:
                raise _fail(path, f"{section}.{key}", f"{value!r} is not one of {', '.join(choices)}")
    for k, norm in enumerate(spec.norms):
        if norm.neutral not in names.NORMS:
            raise _fail(path, f"norms[{k}].neutral", f"{norm.neutral!r} is not a neutral norm name (parity/names.py)")
        for source in (norm.dim, norm.when, norm.eps):
            _check_expr(path, f"norms[{k}]", source)
    for k, t in enumerate(spec.tensors):
        targets = [t.neutral] if isinstance(t.neutral, str) else t.neutral
        for target in targets:
            if target not in names.TENSORS:
                raise _fail(path, f"tensors[{k}].neutral", f"{target!r} is not a neutral tensor name (parity/names.py)")
            if ("{e}" in target) != (t.experts is not None):
                raise _fail(path, f"tensors[{k}].experts", "give 'experts' exactly when the neutral name has {e}")
        if len(targets) > 1 and t.split is None and not t.unstack:
            raise _fail(path, f"tensors[{k}].neutral", "several neutral names need a 'split'")
        if t.split is not None and len(t.split.sizes) != len(targets):
            raise _fail(path, f"tensors[{k}].split.sizes", f"{len(t.split.sizes)} sizes for {len(targets)} neutral names")
        for source in [*t.shape, t.when, t.experts, *(t.split.sizes if t.split else [])]:
            _check_expr(path, f"tensors[{k}]", source)
    for k, b in enumerate(spec.buffers):
        _check_expr(path, f"buffers[{k}]", b.when)
    if not any(spec.tiny.architecture in v.architectures for v in spec.variants):
        raise _fail(path, "tiny.architecture", f"{spec.tiny.architecture!r} is not one of the variants' architectures")
    for key, source in spec.tiny.expr.items():
        _check_expr(path, f"tiny.expr.{key}", source)
    for point in names.CAPTURE_POINTS:
        if point not in spec.capture:
            raise _fail(path, f"capture.{point}", "required capture point is missing")
    for point, where in spec.capture.items():
        if point not in names.CAPTURE_POINTS and not any(point.startswith(p + ".") for p in names.CAPTURE_POINTS):
            raise _fail(path, f"capture.{point}", f"not a capture point; use one of {', '.join(names.CAPTURE_POINTS)}")
        _check_expr(path, f"capture.{point}", where.when)


def _check_expr(path: Path, key: str, source: str | None) -> None:
    if source is None:
        return
    try:
        compile_expr(source)
    except ExprError as exc:
        raise _fail(path, key, str(exc)) from None


def builtin_dir() -> Path:
    """The adapters shipped with parity: inside the wheel, or the repository's adapters/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "adapters", here.parent / "adapters"):
        if candidate.is_dir():
            return candidate
    raise ParityError(f"parity's built-in adapters are missing (looked in {here / 'adapters'}); reinstall parity")


def search_path(extra: Iterable[os.PathLike | str] = ()) -> list[Path]:
    """Directories searched for adapters, lowest priority first.

    Built-in adapters, then each directory in $PARITY_ADAPTERS (os.pathsep-separated), then
    ``--adapters`` directories: a later file with the same family name overrides an earlier one.
    """
    dirs = [builtin_dir()]
    env = os.environ.get(ENV_VAR, "")
    dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs += [Path(p) for p in extra]
    for d in dirs[1:]:
        if not d.is_dir():
            raise ParityError(f"adapter directory {d} does not exist; fix --adapters or ${ENV_VAR}")
    return dirs


def load_all(extra: Iterable[os.PathLike | str] = ()) -> dict[str, Adapter]:
    """Every adapter on the search path, by family name."""
    found: dict[str, Adapter] = {}
    for d in search_path(extra):
        for path in sorted(d.glob("*.toml")):
            adapter = load_adapter(path)
            found[adapter.family] = adapter
    return dict(sorted(found.items()))


# --------------------------------------------------------------------------------------------
# Recognising a checkpoint's family


def recognise(config: dict, adapters: dict[str, Adapter], source: str = "config.json") -> tuple[Adapter, Variant]:
    """Find the adapter and variant for a config: by architecture name first, then model_type."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    for match in (lambda v: any(a in v.architectures for a in archs), lambda v: v.model_type == model_type):
        for adapter in adapters.values():
            for variant in adapter.spec.variants:
                if match(variant):
                    return adapter, variant
    what = ", ".join(archs) or f"model_type {model_type!r}"
    raise ParityError(
        f"{source}: unsupported architecture {what}; supported families: {', '.join(adapters)} "
        f"(add one with --adapters DIR)"
    )


# --------------------------------------------------------------------------------------------
# Resolving an adapter against a config


@dataclass(frozen=True)
class Setting:
    """A resolved convention: its value (one per layer when it depends on ``i``) and its source."""

    value: Any
    source: str
    per_layer: bool = False

    def at(self, i: int) -> Any:
        return self.value[i] if self.per_layer else self.value


@dataclass(frozen=True)
class ResolvedNorm:
    hf: str
    neutral: str
    group: str
    layer: int | None
    dim: int
    has_weight: bool
    has_bias: bool
    weight: str  # "weight" or "one_plus_weight"
    eps: float

    @property
    def params(self) -> int:
        return self.dim * (int(self.has_weight) + int(self.has_bias))


@dataclass(frozen=True)
class ResolvedTensor:
    hf: str
    neutral: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    unstack: bool = False
    split: tuple[int, tuple[int, ...]] | None = None
    norm_offset: bool = False  # stored w of a `1 + w` norm

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class ResolvedBuffer:
    hf: str
    kind: str
    layer: int | None
    same_as: str | None = None


@dataclass(frozen=True)
class ResolvedCapture:
    name: str
    module: str
    io: str
    arg: str | int | None
    field: str | int | None


@dataclass
class Resolved:
    """An adapter applied to one config: every convention, norm, tensor and capture point."""

    adapter: Adapter
    variant: Variant
    config: dict
    num_layers: int
    settings: dict[str, Setting]
    norms: list[ResolvedNorm]
    tensors: list[ResolvedTensor]
    capture: list[ResolvedCapture]
    buffers: list[ResolvedBuffer] = field(default_factory=list)
    env: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def family(self) -> str:
        return self.adapter.family

    def __getitem__(self, key: str) -> Any:
        """Model-level value of ``section.name`` (per-layer settings return their list)."""
        return self.settings[key].value

    def layer(self, key: str, i: int) -> Any:
        return self.settings[key].at(i)

    def tensor_map(self, prefix: str) -> dict[str, ResolvedTensor]:
        return {t.hf.replace("{prefix}", prefix): t for t in self.tensors}

    def buffer_map(self, prefix: str) -> dict[str, ResolvedBuffer]:
        return {b.hf.replace("{prefix}", prefix): b for b in self.buffers}

    def canonical_name(self, name: str) -> str:
        """A checkpoint tensor's name with legacy endings (``LayerNorm.gamma``) renamed as transformers does."""
        for old, new in self.adapter.spec.legacy_names.items():
            if name.endswith(old):
                return name[: len(name) - len(old)] + new
        return name


_ABSENT = object()


def _lookup(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


class _Resolver:
    def __init__(self, adapter: Adapter, config: dict):
        self.path = adapter.path
        self.config = config
        # Every config key is a name in expressions; absent keys are simply not there.
        self.env: dict[str, Any] = {k: v for k, v in config.items() if isinstance(k, str) and k.isidentifier()}
        self.layered: dict[str, list] = {}  # per-layer settings, bound to their value at i
        self.num_layers = 0

    def fail(self, key: str, why: str) -> ParityError:
        return ParityError(f"{self.path}: {key}: {why}")

    def eval(self, key: str, source: str, i: int | None = None) -> Any:
        env = self.env
        if i is not None:
            env = {**env, **{k: v[i] for k, v in self.layered.items()}, "i": i}
        try:
            return evaluate(source, env)
        except ExprError as exc:
            raise self.fail(key, str(exc)) from None

    def expression(self, key: str, source: str, label: str) -> Setting:
        if "i" in free_names(source):
            return Setting([self.eval(key, source, i) for i in range(self.num_layers)], label, per_layer=True)
        return Setting(self.eval(key, source), label)

    def param(self, key: str, value: Any) -> Setting:
        if not isinstance(value, Param):
            return Setting(value, "family")
        if value.expr is not None:
            return self.expression(key, value.expr, "derived")
        for k in value.keys:
            raw = _lookup(self.config, k)
            if raw is None and value.null == "none":
                return Setting(None, f"config {k} (null)")
            if raw is not None and raw is not _ABSENT:
                return Setting(self._map(key, value, raw), f"config {k}")
        if value.default_expr is not None:
            return self.expression(key, value.default_expr, "default")
        return Setting(None if value.default is None else self._map(key, value, value.default), "default")

    def _map(self, key: str, value: Param, raw: Any) -> Any:
        if value.map is None:
            return raw
        if isinstance(raw, (str, int, float, bool)) and str(raw) in value.map:
            return value.map[str(raw)]
        raise self.fail(key, f"config value {raw!r} is not one this family knows ({', '.join(value.map)})")

    def bind(self, name: str, setting: Setting) -> None:
        if setting.per_layer:
            self.layered[name] = setting.value
        else:
            self.env[name] = setting.value

    def each_layer(self, template: str, when: str | None, key: str) -> list[int | None]:
        """Layer indices a template expands to (None for a model-level template)."""
        if "{i}" not in template:
            return [None] if when is None or self.eval(key, when) else []
        return [i for i in range(self.num_layers) if when is None or self.eval(key, when, i)]


def _fill(template: str, **values: Any) -> str:
    for k, v in values.items():
        template = template.replace("{" + k + "}", str(v))
    return template


def _normalise(r: _Resolver, key: str, setting: Setting) -> Setting:
    def one(v: Any) -> Any:
        # 0 means "none" for a window or a softcap, but layer 0 is a real source of shared KV
        if key in OPTIONAL and (v is False or (v == 0 and key != "attention.kv_shared_from")):
            return None
        if key == "mlp.activation" and v not in CHOICES[key]:
            if v not in ACTIVATIONS:
                raise r.fail(key, f"activation {v!r} is not one parity knows ({', '.join(ACTIVATIONS)})")
            return ACTIVATIONS[v]
        return v

    value = [one(v) for v in setting.value] if setting.per_layer else one(setting.value)
    return Setting(value, setting.source, setting.per_layer)


def resolve(adapter: Adapter, variant: Variant, config: dict, wrapper: dict | None = None) -> Resolved:
    """Apply an adapter to a (text) config: every value computed, every template expanded."""
    spec = adapter.spec
    r = _Resolver(adapter, config)
    r.env["variant_lm_head"] = variant.lm_head  # whether this on-disk form carries an LM head
    r.env["architecture"] = variant.architectures[0]
    r.env["wrapper"] = wrapper  # a multimodal wrapper's top-level config (None for a text model)
    for name, value in spec.derive.items():
        setting = r.param(f"derive.{name}", value)
        r.env[name] = setting.value
    if not isinstance(r.env.get("num_layers"), int):
        raise r.fail("derive.num_layers", "must resolve to the number of layers (an integer)")
    r.num_layers = r.env["num_layers"]

    settings: dict[str, Setting] = {}
    for section in SECTIONS:
        for key, value in getattr(spec, section):
            if key == "scaling_types":
                settings[f"{section}.{key}"] = Setting(value, "family")
                continue
            setting = r.param(f"{section}.{key}", value)
            setting = _normalise(r, f"{section}.{key}", setting)
            choices = CHOICES.get(f"{section}.{key}")
            for v in setting.value if setting.per_layer else [setting.value]:
                if choices and v not in choices:
                    raise r.fail(f"{section}.{key}", f"resolved to {v!r}, not one of {', '.join(choices)}")
            settings[f"{section}.{key}"] = setting
            r.bind(f"{section}_{key}", setting)

    norms: list[ResolvedNorm] = []
    tensors: list[ResolvedTensor] = []
    for k, norm in enumerate(spec.norms):
        key = f"norms[{k}]"
        convention = settings["attention.qk_norm_weight" if norm.convention == "qk_norm" else "norm.weight"]
        for i in r.each_layer(norm.hf, norm.when, key):
            weight = convention.at(i or 0)
            has_bias = bool(settings["norm.bias"].at(i or 0)) and norm.has_weight
            rn = ResolvedNorm(
                hf=_fill(norm.hf, i=i), neutral=_fill(norm.neutral, i=i), group=norm.group, layer=i,
                dim=int(r.eval(key + ".dim", norm.dim, i)), has_weight=norm.has_weight, has_bias=has_bias,
                weight=weight,
                eps=float(r.eval(key + ".eps", norm.eps, i) if norm.eps else settings["norm.eps"].at(i or 0)),
            )
            norms.append(rn)
            if rn.has_weight:
                tensors.append(ResolvedTensor(f"{rn.hf}.weight", (f"{rn.neutral}.weight",), (rn.dim,),
                                              norm_offset=weight == "one_plus_weight"))
            if rn.has_bias:
                tensors.append(ResolvedTensor(f"{rn.hf}.bias", (f"{rn.neutral}.bias",), (rn.dim,)))

    for k, t in enumerate(spec.tensors):
        key = f"tensors[{k}]"
        targets = [t.neutral] if isinstance(t.neutral, str) else list(t.neutral)
        for i in r.each_layer(t.hf, t.when, key):
            shape = tuple(int(r.eval(f"{key}.shape", s, i)) for s in t.shape)
            split = None
            if t.split is not None:
                split = (t.split.dim, tuple(int(r.eval(f"{key}.split", s, i)) for s in t.split.sizes))
            n_experts = int(r.eval(f"{key}.experts", t.experts, i)) if t.experts else 0
            if t.unstack:  # one stacked tensor -> one neutral tensor (or split group) per expert
                outs = tuple(_fill(n, i=i, e=e) for e in range(n_experts) for n in targets)
                tensors.append(ResolvedTensor(_fill(t.hf, i=i), outs, shape, t.transpose, True, split))
            elif "{e}" in t.hf:
                for e in range(n_experts):
                    tensors.append(ResolvedTensor(_fill(t.hf, i=i, e=e), tuple(_fill(n, i=i, e=e) for n in targets),
                                                  shape, t.transpose, False, split))
            else:
                tensors.append(ResolvedTensor(_fill(t.hf, i=i), tuple(_fill(n, i=i) for n in targets),
                                              shape, t.transpose, False, split))

    buffers = [ResolvedBuffer(_fill(b.hf, i=i), b.kind, i, b.same_as and _fill(b.same_as, i=i))
               for k, b in enumerate(spec.buffers) for i in r.each_layer(b.hf, b.when, f"buffers[{k}]")]

    capture: list[ResolvedCapture] = []
    for point, where in spec.capture.items():
        for i in r.each_layer(point, where.when, f"capture.{point}"):
            capture.append(ResolvedCapture(_fill(point, i=i), _fill(where.module, i=i, prefix=variant.module_prefix),
                                           where.io, where.arg, where.field))
    capture.sort(key=lambda c: names.point_order(c.name))

    return Resolved(adapter, variant, config, r.num_layers, settings, norms, tensors, capture, buffers, env=r.env)


def text_config(config: dict, variant: Variant, source: str = "config.json") -> dict:
    """The config that describes the text model (a multimodal wrapper's ``text_config``)."""
    if variant.text_config is None:
        return config
    inner = config.get(variant.text_config)
    if not isinstance(inner, dict):
        raise ParityError(f"{source}: {variant.architectures[0]} needs a {variant.text_config!r} table; the file has none")
    return inner


def ignored(name: str, variant: Variant, env: dict) -> bool:
    """Whether a checkpoint tensor belongs to something the adapter deliberately leaves out."""
    return any(fnmatch.fnmatchcase(name, _fill(p, **{k: v for k, v in env.items() if isinstance(v, (int, str))}))
               for p in variant.ignore)


def rope_settings(r: Resolved, i: int, style: str) -> dict | None:
    """Layer i's RoPE as the manifest states it (None without RoPE)."""
    if r["positions.kind"] != "rope":
        return None
    return {
        "theta": r.layer("positions.rope_theta", i),
        "style": style,
        "rotary_dim": r.layer("positions.rotary_dim", i),
        "head_dim": r.layer("attention.qk_rope_head_dim", i) or r.layer("attention.head_dim", i),
        "scaling": r.layer("positions.rope_scaling", i),
        "max_positions": r["positions.max_positions"],
        "compute_dtype": r["positions.rope_dtype"],  # "model", or "float32": rotate upcast, cast back
    }
