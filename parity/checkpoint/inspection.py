"""``parity inspect``: a checkpoint's family, conventions and norm census, without loading weights."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, fields
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from parity.adapter import SECTIONS, Param, Resolved, Setting
from parity.checkpoint import Checkpoint
from parity.checkpoint.buffers import check_buffers

NORM_KINDS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}
PLACEMENTS = {
    "pre": "Pre-Norm",
    "post": "Post-Norm",
    "sandwich": "sandwich",
    "sublayer_output": "norm on sublayer output",
}
WEIGHTS = {"weight": "w", "one_plus_weight": "1 + w"}
NORM_SETTINGS = ("norm.kind", "norm.eps", "norm.weight", "norm.bias", "norm.placement")  # the census's summary


def _parallel(r: Resolved) -> bool:
    """Whether some layer runs its MLP beside attention, on the layer's input (GPT-NeoX's parallel residual)."""
    return any(r.layer("mlp.parallel", i) for i in range(r.num_layers))


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)


def _by_value(values: list[Any]) -> list[tuple[Any, list[int]]]:
    groups: dict[str, tuple[Any, list[int]]] = {}
    for i, v in enumerate(values):
        groups.setdefault(repr(v), (v, []))[1].append(i)
    return list(groups.values())


def format_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_value(v)}" for k, v in value.items())
    return str(value)


def format_setting(setting: Setting) -> str:
    if not setting.per_layer:
        return format_value(setting.value)
    groups = _by_value(setting.value)
    if len(groups) == 1:
        return format_value(groups[0][0])
    return "; ".join(f"{format_value(v)} (layers {_ranges(idx)})" for v, idx in groups)


@dataclass(frozen=True)
class LayerNorms:
    """One layer's norms, as the census counts them."""

    block: int
    attention: list[str]  # the attention norms' names (q, k, ...)
    mla: int
    moe: int
    per_layer_input: int
    total: int
    summary: str
    extra: str            # reported apart from the block and attention norms (docs/design.md, "Conventions")


@dataclass(frozen=True)
class NormPattern:
    """Layers whose norms are alike."""

    layers: str           # '0-2, 5'
    norms: LayerNorms

    def to_json(self) -> dict:
        return {"layers": self.layers, **asdict(self.norms)}


@dataclass(frozen=True)
class Summary:
    norm: str
    eps: Any
    weight: str
    placement: str
    norms_per_layer: str


@dataclass(frozen=True)
class NormCensus:
    count: int
    kind: list[str]
    parameters: int
    share: float          # of the model's parameters
    groups: dict[str, int]
    weightless: int
    per_layer: list[NormPattern]

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "per_layer": [p.to_json() for p in self.per_layer]}


@dataclass(frozen=True)
class WeightsFound:
    """The checkpoint's tensors against the adapter's map."""

    files: list[str]
    tensors: int
    dtypes: dict[str, int]
    prefix: str
    accounted_for: bool
    missing: list[str]
    unexpected: list[str]
    wrong_shape: list[str]
    ignored: int
    scales: int
    legacy_names: list[str]
    buffers: list[dict]   # parity.checkpoint.buffers.check_buffers

    def problems(self) -> str:
        parts = []
        for key in ("missing", "unexpected", "wrong_shape"):
            names = getattr(self, key)
            if names:
                parts.append(f"{key.replace('_', ' ')} ({len(names)}): {', '.join(names[:20])}"
                             + (" ..." if len(names) > 20 else ""))
        return "; ".join(parts)


@dataclass(frozen=True)
class Inspection:
    """Everything ``inspect`` shows; ``to_json`` is ``inspect --json``."""

    path: str
    family: str
    adapter: str
    architecture: str | None
    model_type: str | None
    text_config: Any
    layers: int
    conventions: dict[str, dict[str, dict]]
    summary: Summary
    norms: NormCensus
    parameters: int
    capture_points: list[str]
    weights: WeightsFound | None  # None: a bare config
    quantization: dict | None

    def to_json(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "summary": asdict(self.summary),
                "norms": self.norms.to_json(), "weights": None if self.weights is None else asdict(self.weights)}


def _layer_norms(r: Resolved, i: int) -> LayerNorms:
    mine = [n for n in r.norms if n.layer == i]
    block, mla, moe, per_layer_input = (sum(1 for n in mine if n.group == group)
                                        for group in ("block", "mla", "moe", "per_layer_input"))
    attention = [n.neutral.rsplit(".", 1)[-1].removesuffix("_norm") for n in mine if n.group == "attention"]
    text = str(block)
    if attention:
        text += f" + {'/'.join(attention)} norm"
    if mla:
        text += f" + {mla} inside MLA"
    extra = []
    for group, count, label in (("moe", moe, "MoE"), ("per_layer_input", per_layer_input, "per-layer-input")):
        if count:
            weightless = sum(1 for n in mine if n.group == group and not n.has_weight)
            extra.append(f"{count} {label} norm{'s' if count > 1 else ''}"
                         + (f" ({weightless} weightless)" if weightless else ""))
    return LayerNorms(block=block, attention=attention, mla=mla, moe=moe, per_layer_input=per_layer_input,
                      total=len(mine), summary=text, extra=", ".join(extra))


def report(ckpt: Checkpoint) -> Inspection:
    """Everything ``inspect`` shows."""
    r = ckpt.resolved
    total = sum(t.numel for t in r.tensors)
    norm_params = sum(n.params for n in r.norms)
    patterns = [NormPattern(_ranges(idx), norms)
                for norms, idx in _by_value([_layer_norms(r, i) for i in range(r.num_layers)])]
    norm_kind, eps, weight, bias, placement = (r[key] for key in NORM_SETTINGS)
    summary = Summary(norm=NORM_KINDS[norm_kind], eps=eps, weight=WEIGHTS[weight] + (", with bias" if bias else ""),
                      placement=PLACEMENTS[placement] + (", parallel" if _parallel(r) else ""),
                      norms_per_layer=" / ".join(p.norms.summary for p in patterns))
    census = NormCensus(count=len(r.norms), kind=[NORM_KINDS[norm_kind]], parameters=norm_params,
                        share=norm_params / total if total else 0.0, groups=dict(Counter(n.group for n in r.norms)),
                        weightless=sum(1 for n in r.norms if not n.has_weight), per_layer=patterns)
    return Inspection(
        path=str(ckpt.path), family=r.family, adapter=str(ckpt.adapter.path),
        architecture=(ckpt.config.get("architectures") or [None])[0], model_type=ckpt.config.get("model_type"),
        text_config=ckpt.variant.text_config, layers=r.num_layers,
        conventions={section: {key.split(".", 1)[1]: {"value": s.value, "source": s.source, "per_layer": s.per_layer}
                               for key, s in r.settings.items() if key.startswith(section + ".")}
                     for section in SECTIONS},
        summary=summary, norms=census, parameters=total, capture_points=[c.name for c in r.capture],
        weights=_weights(ckpt) if ckpt.has_weights else None,
        quantization=None if ckpt.quantization is None else ckpt.quantization.to_json())


def _weights(ckpt: Checkpoint) -> WeightsFound:
    check = ckpt.check()
    return WeightsFound(files=[f.name for f in ckpt.files], tensors=len(ckpt.tensors),
                        dtypes=dict(Counter(t.dtype for t in ckpt.tensors.values())), prefix=check.prefix,
                        accounted_for=check.ok, missing=check.missing, unexpected=check.unexpected,
                        wrong_shape=check.wrong_shape, ignored=len(check.ignored), scales=len(check.scales),
                        legacy_names=sorted(stored for name, stored in check.stored.items() if stored != name),
                        buffers=check_buffers(ckpt, check))


def render(found: Inspection, ckpt: Checkpoint, console: Console) -> None:
    r = ckpt.resolved
    s, n = found.summary, found.norms
    console.print(f"[bold]{found.family}[/bold]  {found.architecture} (model_type {found.model_type})")
    console.print(f"adapter {found.adapter}", soft_wrap=True)
    console.print(f"{found.layers} layers, {found.parameters:,} parameters")
    console.print(f"norm: {s.norm}, eps {format_value(s.eps)}; weight {s.weight}; {s.placement}; "
                  f"norms per layer: {s.norms_per_layer}")
    console.print(f"[bold]{n.count:,} {'/'.join(n.kind)}s[/bold] holding [bold]{n.parameters:,}[/bold] "
                  f"parameters, [bold]{n.share * 100:.3f}%[/bold] of the model"
                  + (f" ({n.weightless} weightless)" if n.weightless else ""))
    for p in n.per_layer:
        extra = f"; plus {p.norms.extra}" if p.norms.extra else ""
        console.print(f"  layers {p.layers}: {p.norms.summary}{extra}")
    for group, count in n.groups.items():
        if group not in ("block", "attention"):
            console.print(f"  {group}: {count}")

    table = Table(title="conventions", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    table.add_column("setting")
    table.add_column("value", overflow="fold")
    table.add_column("from", style="dim")
    for key, setting in r.settings.items():
        table.add_row(key, format_setting(setting), setting.source)
    console.print(table)

    w = found.weights
    if w is None:
        console.print("weights: none (config only)")
        return
    notes = [f"{w.ignored} deliberately ignored"] if w.ignored else []
    if w.buffers:
        notes.append(f"{len(w.buffers)} saved buffers")
    if w.scales:
        notes.append(f"{w.scales} FP8 block scales")
    if w.legacy_names:
        notes.append(f"{len(w.legacy_names)} under legacy names")
    dtypes = ", ".join(f"{n} {d}" for d, n in w.dtypes.items())
    if w.accounted_for:
        console.print(f"weights: {len(w.files)} file(s), {w.tensors} tensors ({dtypes}), every one accounted for"
                      + (f" ({'; '.join(notes)})" if notes else ""))
    else:
        console.print(f"[red]weights: {len(w.files)} file(s), {w.tensors} tensors do not match the "
                      f"adapter[/red]: {w.problems()}")
    if found.quantization is not None:
        console.print(f"quantization: {ckpt.quantization.describe()}; {w.scales} weights stored in FP8 with block "
                      f"scales (convert and check dequantize them, in float32)")
    if w.legacy_names:
        console.print(f"legacy names (renamed as transformers does on load): {', '.join(w.legacy_names[:6])}"
                      + (" ..." if len(w.legacy_names) > 6 else ""))
    render_buffers(w.buffers, console)


def render_buffers(buffers: list[dict], console: Console) -> None:
    """Saved buffers, apart from the weights: grouped by kind and verdict, each disagreement by name."""
    if not buffers:
        return
    console.print(f"saved buffers, not weights ({len(buffers)}):")
    groups: dict[tuple[str, bool, str], list[str]] = {}
    for b in buffers:
        groups.setdefault((b["kind"], b["agrees"], b["note"] if b["agrees"] else b["name"]), []).append(b["name"])
    for (kind, agrees, note), members in groups.items():
        if agrees:
            console.print(f"  {kind} x{len(members)}: {note}  [dim]{members[0]}{' ...' if len(members) > 1 else ''}[/dim]")
    for b in buffers:
        if not b["agrees"]:
            console.print(f"  [red]{b['kind']} {b['name']}: {b['note']}[/red]", soft_wrap=True)


def describe_family(spec) -> dict:
    """A family's conventions as the adapter states them (no config): for ``parity adapters``."""

    def show(value: Any) -> str:
        if isinstance(value, Param):
            if value.expr is not None:
                return value.expr
            default = f" (default {format_value(value.default)})" if value.default is not None else ""
            return f"{'|'.join(value.keys)}{default}"
        return format_value(value)

    def label(value: Any, labels: dict) -> str:
        return labels.get(value, show(value)) if isinstance(value, str) else show(value)

    other = []
    for what, value, absent in (
        ("qk-norm", spec.attention.qk_norm, "none"), ("v-norm", spec.attention.v_norm, "none"),
        ("attn softcap", spec.attention.softcap, False), ("final softcap", spec.embedding.final_softcap, False),
        ("sliding window", spec.attention.sliding_window, False), ("embed scale", spec.embedding.scale, 1.0),
        ("positions", spec.positions.kind, None), ("act", spec.mlp.activation, None),
        ("MoE", spec.mlp.moe, False), ("attention", spec.attention.kind, "mha"),
        ("parallel residual", spec.mlp.parallel, False),
    ):
        if value != absent:
            other.append(f"{what} {show(value)}")
    return {
        "family": spec.family,
        "architectures": ", ".join(a for v in spec.variants for a in v.architectures),
        "norm": label(spec.norm.kind, NORM_KINDS),
        "weight": label(spec.norm.weight, WEIGHTS),
        "placement": label(spec.norm.placement, PLACEMENTS),
        "other": "; ".join(other),
    }
