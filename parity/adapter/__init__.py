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

Expressions (``parity.adapter.expr``) may use config keys, ``[derive]`` names and, for per-layer
values, the layer index ``i``.

This module applies an adapter to a checkpoint's config (``recognise``, ``resolve``). The schema is in
``parity.adapter.schema`` and reading files (with ``extends``: an adapter that states only how it differs
from another) in ``parity.adapter.files``; both are re-exported here.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from parity import names
from parity.adapter.expr import ExprError, evaluate, free_names
from parity.adapter.files import (
    ENV_VAR,
    Adapter,
    builtin_dir,
    derive_order,
    load_adapter,
    load_all,
    resolved_data,
    search_path,
)
from parity.adapter.schema import (
    ACTIVATIONS,
    ATTENTION_FIELDS,
    BUFFER_KINDS,
    CHOICES,
    OPTIONAL,
    SECTIONS,
    AdapterFile,
    AttentionConvention,
    Buffer,
    CapturePoint,
    EmbeddingConvention,
    MLPConvention,
    NormConvention,
    NormModule,
    OpPoint,
    Param,
    PositionConvention,
    Split,
    TensorEntry,
    Tiny,
    Value,
    Variant,
)
from parity.errors import ParityError

__all__ = [
    "ACTIVATIONS", "ATTENTION_FIELDS", "BUFFER_KINDS", "CHOICES", "ENV_VAR", "OPTIONAL", "SECTIONS", "Adapter",
    "AdapterFile", "AttentionConvention", "Buffer", "CapturePoint", "EmbeddingConvention",
    "MLPConvention", "NormConvention", "NormModule", "OpPoint", "Param", "PositionConvention", "Resolved",
    "ResolvedBuffer", "ResolvedCapture", "ResolvedNorm", "ResolvedTensor", "Setting", "Split", "TensorEntry", "Tiny",
    "Value", "Variant", "builtin_dir", "ignored", "load_adapter", "load_all", "needs_family", "recognise", "resolve",
    "resolved_data", "search_path", "text_config",
]


# --------------------------------------------------------------------------------------------
# Recognising a checkpoint's family


def recognise(config: dict, adapters: dict[str, Adapter], source: str = "config.json") -> tuple[Adapter, Variant]:
    """Find the adapter and variant for a config: by its model_type (what transformers builds it by), the
    architecture name telling apart the variants of one model_type; by the architecture name alone only where no
    adapter claims the model_type. That is a hint: a checkpoint saved with a borrowed class (EXAONE's
    LlamaForCausalLM) may store its tensors otherwise, and open_checkpoint checks them against the tensor map."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")

    def named(v: Variant) -> bool:
        return any(a in v.architectures for a in archs)

    for match in (lambda v: v.model_type == model_type and named(v), lambda v: v.model_type == model_type, named):
        for adapter in adapters.values():
            for variant in adapter.spec.variants:
                if match(variant):
                    return adapter, variant
    what = ", ".join(archs) or f"model_type {model_type!r}"
    raise ParityError(
        f"{source}: unsupported architecture {what}: this needs its family's conventions (an adapter); supported "
        f"families: {', '.join(adapters)} (add one with --adapters DIR; `parity check` compares a model of "
        f"transformers' own classes layer by layer without one)"
    )


def needs_family(resolved: Resolved, what: str) -> None:
    """Refuse ``what`` for a model whose adapter was generated (its structure discovered from transformers): it
    needs the family's conventions, which only an adapter file states."""
    if resolved.generic:
        raise ParityError(f"{what} needs the family's conventions (norms, RoPE, the tensor map of the neutral "
                          f"layout), and {resolved.family} has no adapter: parity only compares it layer by layer "
                          f"(add an adapter with --adapters DIR)")


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

    @property
    def folded(self) -> bool:
        """The family computes ``1 + w``: the neutral layout stores that sum, applied as a plain weight."""
        return self.weight == "one_plus_weight"


@dataclass(frozen=True)
class ResolvedTensor:
    hf: str
    neutral: tuple[str, ...]
    shape: tuple[int, ...]
    transpose: bool = False
    unstack: bool = False
    split: tuple[int, tuple[int, ...]] | None = None
    norm_offset: bool = False  # stored w of a `1 + w` norm
    interleaved: bool = False  # the split's parts alternate along its dim (GPT-OSS's gate_up_proj)
    groups: int | None = None  # the split's parts interleaved in that many blocks (schema.Split)

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
    """Where a capture point (or an operation-level point) is read: io "input", "output" or, for an op,
    "attention" (``field``: what the module's attention function is given or computes, parity.reference.capture)."""

    name: str
    module: str
    io: str
    arg: str | int | None
    field: str | int | None
    slice: tuple[int, int] | None = None  # [start, stop) of the value's last dimension (a fused projection's part)
    heads_first: bool = False             # an op's value is held [B, H, S, D]
    groups: int | None = None             # the slice is taken within each of that many blocks of the last dimension


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
    # operation-level points (docs/ops.md), apart from ``capture``: hooked only when asked for
    ops: list[ResolvedCapture] = field(default_factory=list)

    @property
    def family(self) -> str:
        return self.adapter.family

    @property
    def generic(self) -> bool:
        """No adapter file: the structure discovered from transformers (parity.reference.structure), the family's
        conventions unknown."""
        return self.adapter.generic

    @property
    def embedding_shape(self) -> tuple[int, ...]:
        """The token embedding's [vocab, hidden]: its tensor's, else (a generated adapter, which maps no tensor) the
        ``embedding_shape`` it derives."""
        found = next((t.shape for t in self.tensors if t.neutral == ("embed.tokens.weight",)), None)
        return found if found is not None else tuple(self.env["embedding_shape"])

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
    for name in derive_order(spec.derive, adapter.path):
        r.env[name] = r.param(f"derive.{name}", spec.derive[name]).value
    if not isinstance(r.env.get("num_layers"), int):
        raise r.fail("derive.num_layers", "must resolve to the number of layers (an integer)")
    r.num_layers = r.env["num_layers"]

    settings = _settings(r, spec)
    norms, tensors = _norms(r, spec, settings)
    tensors += _tensors(r, spec)
    buffers = [ResolvedBuffer(_fill(b.hf, i=i), b.kind, i, b.same_as and _fill(b.same_as, i=i))
               for k, b in enumerate(spec.buffers) for i in r.each_layer(b.hf, b.when, f"buffers[{k}]")]
    capture: list[ResolvedCapture] = []
    for point, where in spec.capture.items():
        for i in r.each_layer(point, where.when, f"capture.{point}"):
            capture.append(ResolvedCapture(_fill(point, i=i), _fill(where.module, i=i, prefix=variant.module_prefix),
                                           where.io, where.arg, where.field))
    capture.sort(key=lambda c: names.point_order(c.name))
    return Resolved(adapter=adapter, variant=variant, config=config, num_layers=r.num_layers, settings=settings,
                    norms=norms, tensors=tensors, capture=capture, buffers=buffers, env=r.env,
                    ops=_ops(r, spec, variant.module_prefix))


def _ops(r: _Resolver, spec: AdapterFile, prefix: str) -> list[ResolvedCapture]:
    """Every ``[ops]`` entry expanded over the layers: at each, the first alternative whose ``when`` holds."""
    ops: list[ResolvedCapture] = []
    for point, entry in spec.ops.items():
        key = f"ops.{point}"
        alternatives = entry if isinstance(entry, list) else [entry]
        for i in r.each_layer(point, None, key):
            where = next((a for a in alternatives if a.when is None or r.eval(key, a.when, i)), None)
            if where is None:
                continue
            part = None if where.slice is None else tuple(int(r.eval(key + ".slice", s, i)) for s in where.slice)
            groups = None if where.groups is None else int(r.eval(key + ".groups", where.groups, i))
            ops.append(ResolvedCapture(_fill(point, i=i), _fill(where.module, i=i, prefix=prefix), where.io,
                                       where.arg, where.field, part, where.heads_first, groups))
    ops.sort(key=lambda c: names.point_order(c.name))
    return ops


def _settings(r: _Resolver, spec: AdapterFile) -> dict[str, Setting]:
    """Every convention, in schema order; each is a name (``section_key``) for the expressions after it."""
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
    return settings


def _norms(r: _Resolver, spec: AdapterFile, settings: dict[str, Setting]) -> tuple[list[ResolvedNorm],
                                                                                   list[ResolvedTensor]]:
    """Every norm module, and its weight and bias tensors."""
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
    return norms, tensors


def _tensors(r: _Resolver, spec: AdapterFile) -> list[ResolvedTensor]:
    """Every ``[[tensors]]`` template expanded over layers (``{i}``) and experts (``{e}``)."""
    tensors: list[ResolvedTensor] = []
    for k, t in enumerate(spec.tensors):
        key = f"tensors[{k}]"
        targets = [t.neutral] if isinstance(t.neutral, str) else list(t.neutral)
        for i in r.each_layer(t.hf, t.when, key):
            shape = tuple(int(r.eval(f"{key}.shape", s, i)) for s in t.shape)
            split, groups = None, None
            if t.split is not None:
                split = (t.split.dim, tuple(int(r.eval(f"{key}.split", s, i)) for s in t.split.sizes))
                if t.split.groups is not None:
                    groups = int(r.eval(f"{key}.split.groups", t.split.groups, i))
            n_experts = int(r.eval(f"{key}.experts", t.experts, i)) if t.experts else 0
            interleaved = t.split is not None and t.split.interleaved
            if t.unstack:  # one stacked tensor -> one neutral tensor (or split group) per expert
                outs = tuple(_fill(n, i=i, e=e) for e in range(n_experts) for n in targets)
                tensors.append(ResolvedTensor(_fill(t.hf, i=i), outs, shape, t.transpose, True, split,
                                              interleaved=interleaved, groups=groups))
            elif "{e}" in t.hf:
                for e in range(n_experts):
                    tensors.append(ResolvedTensor(_fill(t.hf, i=i, e=e), tuple(_fill(n, i=i, e=e) for n in targets),
                                                  shape, t.transpose, False, split, interleaved=interleaved,
                                                  groups=groups))
            else:
                tensors.append(ResolvedTensor(_fill(t.hf, i=i), tuple(_fill(n, i=i) for n in targets),
                                              shape, t.transpose, False, split, interleaved=interleaved,
                                              groups=groups))
    return tensors


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
