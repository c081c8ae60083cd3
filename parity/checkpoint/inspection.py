"""``parity inspect``: a checkpoint's family, conventions and norm census, without loading weights."""

from __future__ import annotations

from collections import Counter
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


def _layer_norm_summary(r: Resolved, i: int) -> dict:
    mine = [n for n in r.norms if n.layer == i]
    counts = Counter(n.group for n in mine)
    attention = [n.neutral.rsplit(".", 1)[-1].removesuffix("_norm") for n in mine if n.group == "attention"]
    text = str(counts["block"])
    if attention:
        text += f" + {'/'.join(attention)} norm"
    if counts["mla"]:
        text += f" + {counts['mla']} inside MLA"
    extra = []  # reported apart from the block and attention norms (docs/design.md, "Conventions": its column)
    for group, label in (("moe", "MoE"), ("per_layer_input", "per-layer-input")):
        if counts[group]:
            weightless = sum(1 for n in mine if n.group == group and not n.has_weight)
            extra.append(f"{counts[group]} {label} norm{'s' if counts[group] > 1 else ''}"
                         + (f" ({weightless} weightless)" if weightless else ""))
    return {"block": counts["block"], "attention": attention, "mla": counts["mla"], "moe": counts["moe"],
            "per_layer_input": counts["per_layer_input"], "total": len(mine), "summary": text,
            "extra": ", ".join(extra)}


def report(ckpt: Checkpoint) -> dict:
    """Everything ``inspect`` shows, as plain JSON-able data."""
    r = ckpt.resolved
    total = sum(t.numel for t in r.tensors)
    norm_params = sum(n.params for n in r.norms)
    per_layer = [_layer_norm_summary(r, i) for i in range(r.num_layers)]
    patterns = [{"layers": _ranges(idx), **s} for s, idx in _by_value(per_layer)]
    kinds = {NORM_KINDS[r["norm.kind"]]}
    out: dict[str, Any] = {
        "path": str(ckpt.path),
        "family": r.family,
        "adapter": str(ckpt.adapter.path),
        "architecture": (ckpt.config.get("architectures") or [None])[0],
        "model_type": ckpt.config.get("model_type"),
        "text_config": ckpt.variant.text_config,
        "layers": r.num_layers,
        "conventions": {
            section: {key.split(".", 1)[1]: {"value": s.value, "source": s.source, "per_layer": s.per_layer}
                      for key, s in r.settings.items() if key.startswith(section + ".")}
            for section in SECTIONS
        },
        "summary": {
            "norm": NORM_KINDS[r["norm.kind"]],
            "eps": r["norm.eps"],
            "weight": WEIGHTS[r["norm.weight"]] + (", with bias" if r["norm.bias"] else ""),
            "placement": PLACEMENTS[r["norm.placement"]] + (", parallel" if _parallel(r) else ""),
            "norms_per_layer": " / ".join(p["summary"] for p in patterns),
        },
        "norms": {
            "count": len(r.norms),
            "kind": sorted(kinds),
            "parameters": norm_params,
            "share": norm_params / total if total else 0.0,
            "groups": dict(Counter(n.group for n in r.norms)),
            "weightless": sum(1 for n in r.norms if not n.has_weight),
            "per_layer": patterns,
        },
        "parameters": total,
        "capture_points": [c.name for c in r.capture],
        "weights": None,
        "quantization": None if ckpt.quantization is None else ckpt.quantization.to_json(),
    }
    if ckpt.has_weights:
        check = ckpt.check()
        out["weights"] = {
            "files": [f.name for f in ckpt.files],
            "tensors": len(ckpt.tensors),
            "dtypes": dict(Counter(t.dtype for t in ckpt.tensors.values())),
            "prefix": check.prefix,
            "accounted_for": check.ok,
            "missing": check.missing,
            "unexpected": check.unexpected,
            "wrong_shape": check.wrong_shape,
            "ignored": len(check.ignored),
            "scales": len(check.scales),
            "legacy_names": sorted(stored for name, stored in check.stored.items() if stored != name),
            "buffers": check_buffers(ckpt, check),
        }
    return out


def render(data: dict, ckpt: Checkpoint, console: Console) -> None:
    r = ckpt.resolved
    s = data["summary"]
    console.print(f"[bold]{data['family']}[/bold]  {data['architecture']} (model_type {data['model_type']})")
    console.print(f"adapter {data['adapter']}", soft_wrap=True)
    console.print(f"{data['layers']} layers, {data['parameters']:,} parameters")
    console.print(f"norm: {s['norm']}, eps {format_value(s['eps'])}; weight {s['weight']}; {s['placement']}; "
                  f"norms per layer: {s['norms_per_layer']}")
    n = data["norms"]
    console.print(f"[bold]{n['count']:,} {'/'.join(n['kind'])}s[/bold] holding [bold]{n['parameters']:,}[/bold] "
                  f"parameters, [bold]{n['share'] * 100:.3f}%[/bold] of the model"
                  + (f" ({n['weightless']} weightless)" if n["weightless"] else ""))
    for p in n["per_layer"]:
        extra = f"; plus {p['extra']}" if p["extra"] else ""
        console.print(f"  layers {p['layers']}: {p['summary']}{extra}")
    for group, count in n["groups"].items():
        if group not in ("block", "attention"):
            console.print(f"  {group}: {count}")

    table = Table(title="conventions", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    table.add_column("setting")
    table.add_column("value", overflow="fold")
    table.add_column("from", style="dim")
    for key, setting in r.settings.items():
        table.add_row(key, format_setting(setting), setting.source)
    console.print(table)

    w = data["weights"]
    if w is None:
        console.print("weights: none (config only)")
        return
    notes = [f"{w['ignored']} deliberately ignored"] if w["ignored"] else []
    if w["buffers"]:
        notes.append(f"{len(w['buffers'])} saved buffers")
    if w["scales"]:
        notes.append(f"{w['scales']} FP8 block scales")
    if w["legacy_names"]:
        notes.append(f"{len(w['legacy_names'])} under legacy names")
    dtypes = ", ".join(f"{n} {d}" for d, n in w["dtypes"].items())
    if w["accounted_for"]:
        console.print(f"weights: {len(w['files'])} file(s), {w['tensors']} tensors ({dtypes}), every one accounted for"
                      + (f" ({'; '.join(notes)})" if notes else ""))
    else:
        console.print(f"[red]weights: {len(w['files'])} file(s), {w['tensors']} tensors do not match the "
                      f"adapter[/red]: {check_problems(w)}")
    if data["quantization"] is not None:
        console.print(f"quantization: {ckpt.quantization.describe()}; {w['scales']} weights stored in FP8 with block "
                      f"scales (convert and check dequantize them, in float32)")
    if w["legacy_names"]:
        console.print(f"legacy names (renamed as transformers does on load): {', '.join(w['legacy_names'][:6])}"
                      + (" ..." if len(w["legacy_names"]) > 6 else ""))
    render_buffers(w["buffers"], console)


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


def check_problems(w: dict) -> str:
    parts = []
    for key in ("missing", "unexpected", "wrong_shape"):
        if w[key]:
            parts.append(f"{key.replace('_', ' ')} ({len(w[key])}): {', '.join(w[key][:20])}"
                         + (" ..." if len(w[key]) > 20 else ""))
    return "; ".join(parts)


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

    row = {
        "family": spec.family,
        "architectures": ", ".join(a for v in spec.variants for a in v.architectures),
        "norm": label(spec.norm.kind, NORM_KINDS),
        "weight": label(spec.norm.weight, WEIGHTS),
        "placement": label(spec.norm.placement, PLACEMENTS),
    }
    other = []
    for label, value, absent in (
        ("qk-norm", spec.attention.qk_norm, "none"), ("v-norm", spec.attention.v_norm, "none"),
        ("attn softcap", spec.attention.softcap, False), ("final softcap", spec.embedding.final_softcap, False),
        ("sliding window", spec.attention.sliding_window, False), ("embed scale", spec.embedding.scale, 1.0),
        ("positions", spec.positions.kind, None), ("act", spec.mlp.activation, None),
        ("MoE", spec.mlp.moe, False), ("attention", spec.attention.kind, "mha"),
        ("parallel residual", spec.mlp.parallel, False),
    ):
        if value != absent:
            other.append(f"{label} {show(value)}")
    row["other"] = "; ".join(other)
    return row
