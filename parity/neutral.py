"""The neutral layout: ``manifest.json`` (every convention as an explicit value) + safetensors.

``convert`` streams a Hugging Face checkpoint into it one tensor at a time: tensors get neutral
names (parity/names.py), GPT-2's Conv1D weights are transposed, fused q/k/v split, stacked experts
unstacked, ``1 + w`` norm weights folded to their effective weight (added in float32 before any
cast), and with ``rope_style`` q/k rows are permuted for engines that rotate adjacent pairs.
The manifest needs no family knowledge to read: an engine author reads it with the executor
(parity/executor) beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from . import __version__, atomic, names
from .adapter import Resolved, ResolvedNorm, ResolvedTensor
from .checkpoint import Checkpoint, check_tensors, open_checkpoint
from .errors import ParityError
from .shards import PlannedTensor, ShardWriter, plan, sha256_file

FORMAT = "parity-neutral"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SOURCE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30

# Block norms by where they sit (see parity/names.py): the executor applies whichever are present.
BLOCK_NORMS = ("attn_norm", "attn_post_norm", "attn_res_norm", "mlp_norm", "mlp_post_norm", "mlp_res_norm")
EXTRA_NORMS = ("attn.q_norm", "attn.k_norm", "attn.v_norm", "attn.q_a_norm", "attn.kv_a_norm", "moe.router_norm",
               "moe_norm", "moe_post_norm", "mlp_dense_post_norm", "pli_post_norm")


# --------------------------------------------------------------------------------------------
# Manifest


def _norm(r: Resolved, n: ResolvedNorm | None) -> dict | None:
    if n is None:
        return None
    return {
        "kind": r["norm.kind"],
        "eps": n.eps,
        "weight": n.has_weight,
        "bias": n.has_bias,
        "upcast": r["norm.upcast"],
        "weight_dtype": r["norm.weight_dtype"],  # "float32": y * w in float32, then cast; "model": cast, then * w
        "folded_offset": n.weight == "one_plus_weight",  # stored as 1 + w: apply as a plain weight
    }


def _rope(r: Resolved, i: int, style: str) -> dict | None:
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


def layer_manifest(r: Resolved, i: int, rope_style: str) -> dict:
    """Layer i's conventions as the manifest states them."""
    norms = {n.neutral: n for n in r.norms if n.layer == i}

    def norm(slot: str) -> dict | None:
        return _norm(r, norms.get(f"layers.{i}.{slot}"))

    at = lambda key: r.layer(key, i)  # noqa: E731 - a setting's value at this layer
    attention = {
        "kind": at("attention.kind"),
        "heads": at("attention.heads"),
        "kv_heads": at("attention.kv_heads"),
        "head_dim": at("attention.head_dim"),
        "scale": float(at("attention.scale")),
        "softcap": at("attention.softcap"),
        "causal": bool(at("attention.causal")),
        "sliding_window": at("attention.sliding_window"),
        "qk_norm": at("attention.qk_norm"),
        "q_norm": norm("attn.q_norm"),
        "k_norm": norm("attn.k_norm"),
        "v_norm": norm("attn.v_norm"),
        "k_eq_v": bool(at("attention.k_eq_v")),
        "kv_shared_from": at("attention.kv_shared_from"),
        "rope": _rope(r, i, rope_style),
        "mla": None,
    }
    if attention["kind"] == "mla":
        attention["mla"] = {
            "q_lora_rank": at("attention.q_lora_rank"),
            "kv_lora_rank": at("attention.kv_lora_rank"),
            "qk_nope_head_dim": at("attention.qk_nope_head_dim"),
            "qk_rope_head_dim": at("attention.qk_rope_head_dim"),
            "v_head_dim": at("attention.v_head_dim"),
            "q_a_norm": norm("attn.q_a_norm"),
            "kv_a_norm": norm("attn.kv_a_norm"),
        }
    mlp = {
        "gated": bool(at("mlp.gated")),
        "activation": at("mlp.activation"),
        "intermediate_size": at("mlp.intermediate_size"),
        "moe": None,
    }
    if at("mlp.moe"):
        mlp["moe"] = {
            "routing": at("mlp.moe_routing"),
            "experts": at("mlp.experts"),
            "top_k": at("mlp.experts_per_token"),
            "groups": at("mlp.moe_groups"),
            "groups_kept": at("mlp.moe_groups_kept"),
            "renormalise": bool(at("mlp.moe_renormalise")),
            "scale": at("mlp.moe_scale"),
            "shared_experts": at("mlp.shared_experts"),
            "intermediate_size": at("mlp.moe_intermediate_size"),
            "activation": at("mlp.activation"),
            "router_norm": norm("moe.router_norm"),
            "router_input_scale": at("mlp.moe_router_input_scale"),
            "router_dtype": at("mlp.moe_router_dtype"),
            "expert_norm": norm("moe_norm"),
            "expert_post_norm": norm("moe_post_norm"),
            "dense_post_norm": norm("mlp_dense_post_norm"),
        }
    return {
        "norms": {slot: norm(slot) for slot in BLOCK_NORMS},
        "attention": attention,
        "mlp": mlp,
        "per_layer_input": {"post_norm": norm("pli_post_norm")} if norms.get(f"layers.{i}.pli_post_norm") else None,
    }


def build_manifest(ckpt: Checkpoint, dtype: torch.dtype, rope_style: str, prefix: str | None = None) -> dict:
    """Every convention of the checkpoint as explicit values, and the tensors it becomes (files: by convert)."""
    r = ckpt.resolved
    prefix = prefix if prefix is not None else ckpt.variant.tensor_prefix[0]
    layers = [layer_manifest(r, i, rope_style) for i in range(r.num_layers)]
    norms = {n.neutral: n for n in r.norms}
    vocab, hidden = next(t.shape for t in r.tensors if t.neutral == ("embed.tokens.weight",))
    has_logits = any(c.name == "logits" for c in r.capture)
    pli = r["embedding.per_layer_input_size"]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "written_by": f"parity {__version__}",
        "dtype": str(dtype).removeprefix("torch."),
        "source": {
            "family": r.family,
            "architecture": ckpt.variant.architectures[0],
            "model_type": ckpt.config.get("model_type"),
            "path": str(ckpt.path),
            "files": {f.name: sha256_file(f) for f in ckpt.files},
        },
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_layers": r.num_layers,
        "rope_style": rope_style if r["positions.kind"] == "rope" else None,
        "embedding": {
            "scale": float(r["embedding.scale"]),
            "scale_dtype": r["embedding.scale_dtype"],
            "positions": r["positions.kind"],
            "max_positions": r["positions.max_positions"],
            "token_types": r["positions.token_types"] or 0,
            "norm": _norm(r, norms.get("embed.norm")),
            "per_layer_input": None if not pli else {
                "size": pli,
                "scale": float(pli ** 0.5),
                "projection_scale": float(hidden ** -0.5),
                "combine_scale": float(2 ** -0.5),
                "norm": _norm(r, norms.get("embed.per_layer_norm")),
            },
        },
        "layers": layers,
        "final_norm": _norm(r, norms.get("final_norm")),
        "head": None if not has_logits else {
            "tied": bool(r["embedding.tied"]),
            "softcap": r["embedding.final_softcap"],
            "transform": None if not r["embedding.head_transform"] else {
                "activation": r["mlp.activation"], "norm": _norm(r, norms.get("head.norm"))},
        },
        "capture_points": names.capture_names(r.num_layers, final_norm=r["norm.final"], logits=has_logits),
        # shapes and dtypes as written; "transposed": the source stored it [in, out] (GPT-2's Conv1D)
        "tensors": {name: {"shape": list(shape), "dtype": str(_stored_dtype(name, layers, dtype)).removeprefix("torch."),
                           "transposed": t.transpose}
                    for t in r.tensor_map(prefix).values() for name, shape in _neutral_shapes(t)},
    }


# --------------------------------------------------------------------------------------------
# Tensors: the transforms to the neutral layout, in one place


def to_neutral(t: ResolvedTensor, x: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The neutral tensors one checkpoint tensor becomes (before the dtype cast)."""
    if t.norm_offset:
        x = x.float() + 1.0  # fold `1 + w` in float32, before any cast
    if t.transpose:
        x = x.t()
    parts = list(x.unbind(0)) if t.unstack else [x]
    if t.split is not None:
        dim, sizes = t.split
        parts = [piece for p in parts for piece in torch.split(p, list(sizes), dim=dim)]
    if len(parts) != len(t.neutral):
        raise ParityError(f"{t.hf}: makes {len(parts)} tensors for {len(t.neutral)} neutral names; fix the adapter")
    yield from zip(t.neutral, (p.contiguous() for p in parts))


def _neutral_shapes(t: ResolvedTensor) -> list[tuple[str, tuple[int, ...]]]:
    meta = torch.empty(t.shape, device="meta")
    return [(n, tuple(p.shape)) for n, p in to_neutral(t, meta)]


def _rope_rows(name: str, layer: dict) -> tuple[int, int, int] | None:
    """For a tensor whose rows (or q/k-norm entries) RoPE rotates: (block, offset, rotary_dim) per head."""
    att = layer["attention"]
    rope = att["rope"]
    if rope is None:
        return None
    short = name.split(".", 2)[2]  # drop "layers.{i}."
    mla = att["mla"]
    if mla is not None:
        qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        rot = mla["qk_rope_head_dim"]
        if short in ("attn.q_b.weight", "attn.q.weight"):
            return qk, mla["qk_nope_head_dim"], rot
        if short in ("attn.kv_a.weight", "attn.kv_a.bias"):
            return mla["kv_lora_rank"] + rot, mla["kv_lora_rank"], rot
        return None
    if short in ("attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.q_norm.weight",
                 "attn.k_norm.weight"):
        return att["head_dim"], 0, rope["rotary_dim"]
    return None


def _permute_rows(x: torch.Tensor, block: int, offset: int, perm: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Reorder, within every ``block`` along ``dim``, the entries offset..offset+len(perm) by ``perm``."""
    index = torch.arange(x.shape[dim])
    heads = x.shape[dim] // block
    for h in range(heads):
        start = h * block + offset
        index[start:start + len(perm)] = start + perm
    return x.index_select(dim, index)


def restyle_rope(name: str, x: torch.Tensor, layer: dict, source: str, target: str) -> torch.Tensor:
    """Permute q/k rows (and what shares their layout) from ``source`` to ``target`` RoPE style."""
    if source == target:
        return x
    from .executor.rope import half_permutation, interleave_permutation

    make = interleave_permutation if target == "interleaved" else half_permutation
    rows = _rope_rows(name, layer)
    short = name.split(".", 2)[2] if name.startswith("layers.") else name
    if rows is not None:
        block, offset, rot = rows
        return _permute_rows(x, block, offset, make(rot, rot))
    att = layer["attention"]
    if short == "attn.o.weight" and att["k_eq_v"] and att["mla"] is None:
        # values are the (permuted) key projection: o_proj's input columns follow them
        rot = att["rope"]["rotary_dim"]
        return _permute_rows(x, att["head_dim"], 0, make(rot, rot), dim=1)
    return x


# --------------------------------------------------------------------------------------------
# Convert


def _stored_dtype(name: str, layers: list[dict], target: torch.dtype) -> torch.dtype:
    """The model dtype, except for tensors the model keeps in float32 whatever it runs in (a float32 router)."""
    if name.startswith("layers.") and ".moe.router." in name:
        moe = layers[int(name.split(".")[1])]["mlp"]["moe"]
        if moe and moe["router_dtype"] == "float32":
            return torch.float32
    return target


class _Reader:
    """safetensors' lazy reader, reopened now and then.

    safe_open maps the file: every page a tensor was copied from stays mapped, and counts as
    resident, until the handle closes. Reopening once more than ``budget`` bytes were read keeps
    the mapped, resident part of the source near the largest tensor instead of the checkpoint.
    """

    def __init__(self, budget: int):
        self.budget = max(budget, 64 * 2**20)
        self.handles: dict[Path, Any] = {}
        self.read = 0

    def get(self, file: Path, name: str) -> torch.Tensor:
        if self.read > self.budget:
            self.close()
        if file not in self.handles:
            self.handles[file] = safe_open(file, framework="pt")
        x = self.handles[file].get_tensor(name)
        self.read += x.numel() * x.element_size()
        return x

    def close(self) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()
        self.read = 0


def _check_for_conversion(ckpt: Checkpoint) -> None:
    if not ckpt.has_weights:
        raise ParityError(f"{ckpt.path}: no weights (a config alone cannot be converted); give a checkpoint directory")
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    wrong_dtype = sorted(f"{n} ({ckpt.tensors[n].dtype}, expected F32, BF16 or F16)"
                         for n in ckpt.resolved.tensor_map(check.prefix)
                         if n in ckpt.tensors and ckpt.tensors[n].dtype not in SOURCE_DTYPES)
    if not check.ok or wrong_dtype:
        problems = check.problems() + (f"; wrong dtype ({len(wrong_dtype)}): {', '.join(wrong_dtype)}"
                                       if wrong_dtype else "")
        raise ParityError(f"{ckpt.path}: tensors do not match the {ckpt.resolved.family} adapter: "
                          f"{problems.lstrip('; ')}")


def convert(path: Path, out: Path, *, dtype: str | None = None, rope_style: str | None = None, force: bool = False,
            adapter_dirs=(), max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Convert a checkpoint directory into the neutral layout at ``out``; returns the manifest."""
    ckpt = open_checkpoint(Path(path), adapter_dirs)
    _check_for_conversion(ckpt)
    r = ckpt.resolved
    check = check_tensors(r, ckpt.tensors)
    if dtype is not None and dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source_dtypes = {ckpt.tensors[n].dtype for n in r.tensor_map(check.prefix)}
    target = DTYPES[dtype] if dtype else (SOURCE_DTYPES[source_dtypes.pop()] if len(source_dtypes) == 1
                                          else torch.float32)
    source_style = r["positions.rope_style"]
    style = rope_style or source_style
    if rope_style not in (None, "half", "interleaved"):
        raise ParityError(f"--rope-style {rope_style!r} is not one of half, interleaved")
    if r["positions.kind"] != "rope" and rope_style:
        raise ParityError(f"{ckpt.path}: --rope-style applies to RoPE models; {r.family} uses learned positions")

    manifest = build_manifest(ckpt, target, style, check.prefix)
    tensor_map = r.tensor_map(check.prefix)
    outputs = [PlannedTensor(n, tuple(info["shape"]), getattr(torch, info["dtype"]))
               for n, info in manifest["tensors"].items()]
    layer_of = lambda name: manifest["layers"][int(name.split(".")[1])] if name.startswith("layers.") else None  # noqa: E731

    reader = _Reader(max(t.nbytes for t in outputs))
    with atomic.output_dir(Path(out), force=force) as tmp:
        shards = plan(outputs, tmp, max_shard_bytes)
        where = {t.name: s.path.name for s in shards for t in s.tensors}
        writers = iter(shards)
        shard = next(writers)
        writer = ShardWriter(shard, {"format": "pt", "parity": FORMAT})
        written = 0
        files: dict[str, dict] = {}
        for hf_name, t in tensor_map.items():
            x = reader.get(ckpt.tensors[hf_name].file, hf_name)
            for name, y in to_neutral(t, x):
                layer = layer_of(name)
                if layer is not None:
                    y = restyle_rope(name, y, layer, source_style, style)
                if written == len(shard.tensors):
                    files[shard.path.name] = {"sha256": writer.close(), "bytes": shard.path.stat().st_size}
                    shard = next(writers)
                    writer = ShardWriter(shard, {"format": "pt", "parity": FORMAT})
                    written = 0
                writer.write(name, y.to(getattr(torch, manifest["tensors"][name]["dtype"])))
                written += 1
            del x
        files[shard.path.name] = {"sha256": writer.close(), "bytes": shard.path.stat().st_size}
        reader.close()
        for name, info in manifest["tensors"].items():
            info["file"] = where[name]
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in outputs)}, "weight_map": where}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        manifest["files"] = files
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _copy_tokenizer(ckpt.path, tmp)
    return manifest


def _copy_tokenizer(source: Path, out: Path) -> None:
    """Carry a tokenizer along (plain data files), so that ``parity run`` can decode."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            (out / name).write_bytes((source / name).read_bytes())


# --------------------------------------------------------------------------------------------
# Load


def read_manifest(path: Path) -> dict:
    path = Path(path)
    file = path / MANIFEST if path.is_dir() else path
    if not file.exists():
        raise ParityError(f"{path}: no {MANIFEST}; give a directory written by `parity convert --to neutral`")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ParityError(f"{file}: not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ParityError(f"{file}: not a {FORMAT} v{FORMAT_VERSION} manifest; re-convert with this parity")
    return manifest


def load(path: Path, *, verify: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a neutral directory: (manifest, tensors by neutral name)."""
    path = Path(path)
    manifest = read_manifest(path)
    tensors: dict[str, torch.Tensor] = {}
    for file, info in manifest["files"].items():
        if verify and sha256_file(path / file) != info["sha256"]:
            raise ParityError(f"{path / file}: sha256 differs from the manifest; the file changed after conversion")
        try:
            with safe_open(path / file, framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - a truncated or damaged file
            raise ParityError(f"{path / file}: not a readable safetensors file ({exc})") from None
    missing = sorted(set(manifest["tensors"]) - set(tensors))
    if missing:
        raise ParityError(f"{path}: tensors listed in the manifest are missing: {', '.join(missing)}")
    return manifest, tensors


def summary(manifest: dict) -> dict[str, Any]:
    return {"family": manifest["source"]["family"], "dtype": manifest["dtype"], "layers": manifest["num_layers"],
            "tensors": len(manifest["tensors"]), "files": list(manifest["files"])}
