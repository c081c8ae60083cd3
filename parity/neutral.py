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
import math
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Callable, Container, Iterator, Literal, Optional

import torch
from pydantic import Field, model_validator
from safetensors import safe_open

from . import __version__, atomic, names
from .adapter import Resolved, ResolvedNorm, ResolvedTensor, rope_settings
from .checkpoint import Checkpoint, open_checkpoint, plain_file_name, stored_tensor_map
from .errors import ParityError
from .jsonfile import StrictSpec, check_schema, read_json
from .lazy import Dequantizer
from .quantization import dequantize, quantized_weights, rounding_error
from .shards import (HASH, ContentHash, Hashing, Header, Pieces, PlannedTensor, ShardWriter, hash_file, plan,
                     read_header)

FORMAT = "parity-neutral"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SOURCE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
READ_DTYPES = {**SOURCE_DTYPES, "F8_E4M3": torch.float8_e4m3fn}  # FP8 only with block scales (parity.quantization)
DEFAULT_SHARD_BYTES = 5 * 2**30
READ_CHUNK = 2**20  # source bytes read, and hashed, at a time
RING = 4  # buffers of READ_CHUNK that a streamed tensor's pieces cycle through, while earlier ones are hashed

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
        "rope": rope_settings(r, i, rope_style),
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
            "weights_dtype": at("mlp.moe_weights_dtype"),  # where the routing weights multiply the experts' outputs
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


def build_manifest(ckpt: Checkpoint, dtype: torch.dtype, rope_style: str, prefix: str | None = None,
                   hashes: bool = True) -> dict:
    """Every convention of the checkpoint as explicit values, and the tensors it becomes (files: by convert).
    ``hashes=False`` leaves the source files' hashes (``HASH``) out: a manifest for running, or one whose writer
    hashes the files as it reads them (convert, in its one pass)."""
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
            "hash": HASH,  # of files (absent from manifests written before BLAKE3: sha256)
            "files": {f.name: hash_file(f) for f in ckpt.files} if hashes else {},
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


def neutral_tensors(ckpt: Checkpoint, manifest: dict, keep: Callable[[str], bool] = lambda name: True
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The neutral tensors ``keep`` selects, one at a time, converted from the checkpoint's files without
    reading the rest: at the manifest's dtype, q/k rows in its RoPE style."""
    r = ckpt.resolved
    files = Dequantizer.of(ckpt)  # FP8 weights read dequantized, in float32
    source_style = r["positions.rope_style"]
    for hf_name, t in stored_tensor_map(r, ckpt.check()).items():
        if not any(keep(name) for name, _ in _neutral_shapes(t)):
            continue
        for name, y in to_neutral(t, files.read(hf_name)):
            if keep(name):
                if name.startswith("layers."):
                    y = restyle_rope(name, y, manifest["layers"][int(name.split(".")[1])], source_style,
                                     manifest["rope_style"] or source_style)
                yield name, y.to(getattr(torch, manifest["tensors"][name]["dtype"]))


def neutral_subset(ckpt: Checkpoint, manifest: dict, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The neutral tensors ``keep`` selects (the diagnosis re-runs one layer of a model too big to convert whole)."""
    return dict(neutral_tensors(ckpt, manifest, keep))


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
    from .rope import half_permutation, interleave_permutation

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
    """A checkpoint's safetensors files, each read once from front to back, READ_CHUNK bytes at a time.

    Every byte read (the header, and tensors the adapter does not map) goes to the file's hash (``HASH``), so the
    manifest's source hashes cost no second pass; hashing runs on a thread of its own (``hashing``) while the
    next piece is read and the tensor is converted and written. Tensors in ``streamed`` (written exactly as
    they are stored) and those not wanted pass through a ring of RING small buffers, a piece at a time, each
    reused once its hashes are done; the others are read whole into one buffer, reused: memory stays at the
    largest of those (``largest``), not at the largest tensor.
    """

    def __init__(self, largest: int, hashing: Hashing) -> None:
        self.largest = largest
        self.hashing = hashing
        self.buffer = torch.empty(0, dtype=torch.uint8)  # allocated at the first tensor read whole
        self.ring: list[torch.Tensor | None] = [None] * RING
        self.fences: list = [None] * RING  # per ring buffer: the hashing work to finish before it is reused
        self.next = 0
        self.digests: dict[str, str] = {}  # file name -> hex digest (HASH), once the file was read to its end

    def tensors(self, file: Path, header: Header, wanted: Container[str], streamed: Container[str] = ()
                ) -> Iterator[tuple[str, torch.Tensor | Pieces]]:
        """The tensors of ``file`` in ``wanted``, in file order: those in ``streamed`` as Pieces (to be written
        before the next is asked for), the others whole, each overwritten by the next (copy to keep)."""
        src = ContentHash(HASH, self.hashing)
        try:
            with open(file, "rb", buffering=0) as f:
                head = self._read(f, file, header.data_start, src)
                if int.from_bytes(head[:8].numpy().tobytes(), "little") != header.data_start - 8:
                    raise ParityError(f"{file}: changed while it was read; convert again once nothing writes to it")
                for name in file_order(header):
                    entry = header.tensors[name]
                    if name in wanted and name in streamed:
                        pieces = self._pieces(f, file, entry.end - entry.begin, src)
                        yield name, Pieces(entry.shape, READ_DTYPES[entry.dtype], pieces)
                        for _ in pieces:  # whatever the consumer left is still read (and hashed)
                            pass
                    elif name in wanted:
                        raw = self._read(f, file, entry.end - entry.begin, src)
                        yield name, raw.view(READ_DTYPES[entry.dtype]).reshape(entry.shape)
                    else:  # hashed, not kept
                        for _ in self._pieces(f, file, entry.end - entry.begin, src):
                            pass
                if f.read(1):
                    raise ParityError(f"{file}: grew while it was read; convert again once nothing writes to it")
            self.digests[file.name] = src.hexdigest()
        except OSError as exc:
            raise ParityError(f"{file}: cannot be read ({exc.strerror or exc})") from None
        finally:
            src.close()

    def _read(self, f: BinaryIO, file: Path, nbytes: int, src: ContentHash) -> torch.Tensor:
        """The next ``nbytes`` of ``f``, in the buffer; each piece goes to ``src`` as soon as it is in."""
        src.wait()  # the buffer is about to be overwritten (its output hash, if any, was waited for by the writer)
        if nbytes > len(self.buffer):
            self.buffer = torch.empty(max(nbytes, self.largest), dtype=torch.uint8)  # pages count once touched
        out = self.buffer[:nbytes]
        view = memoryview(out.numpy())
        for start in range(0, nbytes, READ_CHUNK):
            piece = view[start:start + READ_CHUNK]
            _fill(f, file, piece)
            src.update(piece)
        return out

    def _pieces(self, f: BinaryIO, file: Path, nbytes: int, src: ContentHash) -> Iterator[memoryview]:
        """The next ``nbytes`` of ``f``, READ_CHUNK at a time, each in the next buffer of the ring and fed to
        ``src``; a piece is valid until the next is asked for, and its buffer is reused only once everything
        fed to the hashing thread by then (its source and output hashes) is done."""
        for start in range(0, nbytes, READ_CHUNK):
            k, self.next = self.next, (self.next + 1) % RING
            if self.fences[k] is not None:
                self.fences[k].result()
                self.fences[k] = None
            size = min(READ_CHUNK, nbytes - start)
            if self.ring[k] is None or len(self.ring[k]) < size:
                self.ring[k] = torch.empty(READ_CHUNK, dtype=torch.uint8)
            piece = memoryview(self.ring[k].numpy())[:size]
            _fill(f, file, piece)
            src.update(piece)
            yield piece
            self.fences[k] = self.hashing.last


def _fill(f: BinaryIO, file: Path, piece: memoryview) -> None:
    """Read exactly ``len(piece)`` bytes of ``f`` into ``piece``."""
    done = 0
    while done < len(piece):
        n = f.readinto(piece[done:])
        if not n:
            raise ParityError(f"{file}: ends before the tensor data its header promises; it was truncated "
                              f"while it was read")
        done += n


def _as_stored(t: ResolvedTensor, shape: tuple[int, ...], dtype: torch.dtype,
               finish: Callable[[str, torch.Tensor], torch.Tensor]) -> bool:
    """Whether checkpoint tensor ``t`` becomes one neutral tensor of exactly its stored bytes (no fold, transpose,
    split, RoPE permutation or cast by to_neutral, then ``finish``), so that it can be copied a piece at a time:
    found by converting a tensor of its shape on the meta device, which changed nothing if it is returned."""
    x = torch.empty(shape, dtype=dtype, device="meta")
    out = list(to_neutral(t, x))
    return len(out) == 1 and finish(*out[0]) is x


def file_order(header: Header) -> list[str]:
    """A safetensors file's tensor names in the order their bytes lie in it."""
    return sorted(header.tensors, key=lambda name: (header.tensors[name].begin, header.tensors[name].end))


def check_convertible(ckpt: Checkpoint) -> None:
    """Refuse a checkpoint that cannot be converted: no weights, tensors its adapter does not expect or of a dtype
    parity does not convert, or a saved head that disagrees with the tied one the neutral model would use."""
    if not ckpt.has_weights:
        raise ParityError(f"{ckpt.path}: no weights (a config alone cannot be converted); give a checkpoint directory")
    check = ckpt.check()
    scaled = set(quantized_weights(ckpt.tensors)) if ckpt.quantization else set()
    wrong_dtype = sorted(f"{n} ({ckpt.tensors[n].dtype}, expected F32, BF16 or F16"
                         f"{'' if ckpt.quantization else '; FP8 weights need the quantization_config that says how they are scaled'})"
                         for n in stored_tensor_map(ckpt.resolved, check)
                         if n in ckpt.tensors and ckpt.tensors[n].dtype not in SOURCE_DTYPES and n not in scaled)
    if not check.ok or wrong_dtype:
        problems = check.problems() + (f"; wrong dtype ({len(wrong_dtype)}): {', '.join(wrong_dtype)}"
                                       if wrong_dtype else "")
        raise ParityError(f"{ckpt.path}: tensors do not match the {ckpt.resolved.family} adapter: "
                          f"{problems.lstrip('; ')}")
    from .buffers import check_buffers

    for b in check_buffers(ckpt, check):  # a head transformers unties would be tied in the neutral model
        if b["kind"] == "tied_copy" and not b["agrees"]:
            raise ParityError(f"{ckpt.path}: {b['name']} {b['note']}")


def source_dtype(ckpt: Checkpoint, check) -> torch.dtype:
    """The checkpoint's one weight dtype (float32 when it mixes several). FP8 weights count as the dtype of the
    checkpoint's other tensors (bf16 in the released FP8 models)."""
    scaled = set(quantized_weights(ckpt.tensors)) if ckpt.quantization else set()
    found = {ckpt.tensors[n].dtype for n in stored_tensor_map(ckpt.resolved, check) if n not in scaled}
    return SOURCE_DTYPES[found.pop()] if len(found) == 1 else torch.float32


def convert(path: Path, out: Path, *, dtype: str | None = None, rope_style: str | None = None, force: bool = False,
            adapter_dirs=(), max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Convert a checkpoint directory into the neutral layout at ``out``; returns the manifest."""
    ckpt = open_checkpoint(Path(path), adapter_dirs)
    check_convertible(ckpt)
    r = ckpt.resolved
    check = ckpt.check()
    if dtype is not None and dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    tensor_map = stored_tensor_map(r, check)
    deq = Dequantizer.of(ckpt)
    target = DTYPES[dtype] if dtype else source_dtype(ckpt, check)
    errors: dict[str, float] = {}  # FP8 weight -> rel_l2 of its dequantization at the target dtype
    source_style = r["positions.rope_style"]
    style = rope_style or source_style
    if rope_style not in (None, "half", "interleaved"):
        raise ParityError(f"--rope-style {rope_style!r} is not one of half, interleaved")
    if r["positions.kind"] != "rope" and rope_style:
        raise ParityError(f"{ckpt.path}: --rope-style applies to RoPE models; {r.family} uses learned positions")

    # source hashes come from the conversion's own reads (_Reader), filled in before the manifest is written
    manifest = build_manifest(ckpt, target, style, check.prefix, hashes=False)
    headers = {f: read_header(f) for f in ckpt.files}
    # planned in source order, so that each tensor is written as soon as the one pass has read it
    order = [n for f in ckpt.files for hf_name in file_order(headers[f]) if hf_name in tensor_map
             for n in tensor_map[hf_name].neutral]
    outputs = [PlannedTensor(n, tuple(manifest["tensors"][n]["shape"]), getattr(torch, manifest["tensors"][n]["dtype"]))
               for n in order]
    layer_of = lambda name: manifest["layers"][int(name.split(".")[1])] if name.startswith("layers.") else None  # noqa: E731

    def finish(name: str, y: torch.Tensor) -> torch.Tensor:
        """A neutral tensor as it is written: q/k rows in the target RoPE style, at the manifest's dtype."""
        layer = layer_of(name)
        if layer is not None:
            y = restyle_rope(name, y, layer, source_style, style)
        return y.to(getattr(torch, manifest["tensors"][name]["dtype"]))

    # tensors written exactly as stored are copied a piece at a time as they are read; the rest are read whole
    entries = {n: h.tensors[n] for h in headers.values() for n in h.tensors if n in tensor_map}
    streamed = {n for n, e in entries.items() if not deq.quantized(n)
                and _as_stored(tensor_map[n], e.shape, READ_DTYPES[e.dtype], finish)}
    largest = max((e.end - e.begin for n, e in entries.items() if n not in streamed), default=0)
    with atomic.output_dir(Path(out), force=force) as tmp, Hashing() as hashing:
        reader = _Reader(largest, hashing)
        shards = plan(outputs, tmp, max_shard_bytes)
        where = {t.name: s.path.name for s in shards for t in s.tensors}
        writers = iter(shards)
        shard = next(writers)
        writer = ShardWriter(shard, {"format": "pt", "parity": FORMAT}, hashing)
        written = 0
        files: dict[str, dict] = {}
        for f in ckpt.files:
            for hf_name, x in reader.tensors(f, headers[f], tensor_map, streamed):
                if isinstance(x, Pieces):  # written as stored, each piece as soon as it is read
                    neutral = [(tensor_map[hf_name].neutral[0], x)]
                else:
                    if deq.quantized(hf_name):  # in float32; written at the target dtype, whose rounding is measured
                        x = dequantize(x, deq.scale(hf_name), ckpt.quantization.block)
                        errors[hf_name] = rounding_error(x, target)
                    neutral = ((name, finish(name, y)) for name, y in to_neutral(tensor_map[hf_name], x))
                for name, y in neutral:
                    if written == len(shard.tensors):
                        files[shard.path.name] = {HASH: writer.close(), "bytes": shard.path.stat().st_size}
                        shard = next(writers)
                        writer = ShardWriter(shard, {"format": "pt", "parity": FORMAT}, hashing)
                        written = 0
                    writer.write(name, y)
                    written += 1
        files[shard.path.name] = {HASH: writer.close(), "bytes": shard.path.stat().st_size}
        manifest["source"]["files"] = reader.digests
        if ckpt.quantization is not None:
            manifest["source"]["quantization"] = dequantization_summary(ckpt.quantization, errors, target)
        for name, info in manifest["tensors"].items():
            info["file"] = where[name]
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in outputs)}, "weight_map": where}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        manifest["files"] = files
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _copy_tokenizer(ckpt.path, tmp)
    return manifest


def dequantization_summary(quantization, errors: dict[str, float], target: torch.dtype) -> dict:
    """What a converted FP8 checkpoint's manifest says of it: the quantization, and the error of writing the
    float32 dequantized weights at the target dtype (rel_l2; 0 at float32)."""
    worst = max(errors, key=errors.get) if errors and max(errors.values()) > 0 else None
    return {**quantization.to_json(), "dequantized": len(errors), "dtype": str(target).removeprefix("torch."),
            "rel_l2_max": errors[worst] if worst else 0.0,  # worst None: every weight written exactly
            "rel_l2_mean": sum(errors.values()) / len(errors) if errors else 0.0, "worst": worst}


def _copy_tokenizer(source: Path, out: Path) -> None:
    """Carry a tokenizer along (plain data files), so that ``parity run`` can decode."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            (out / name).write_bytes((source / name).read_bytes())


# --------------------------------------------------------------------------------------------
# Load


# The manifest as the executor reads it (parity/executor): every field it indexes, with the values it knows.
# Checked at load time, so that a damaged or hand-edited manifest is refused before anything runs.

_Pos = Annotated[int, Field(gt=0)]
_Count = Annotated[int, Field(ge=0)]
_Num = Annotated[float, Field(allow_inf_nan=False)]
_PosNum = Annotated[float, Field(allow_inf_nan=False, gt=0)]
_NonNegNum = Annotated[float, Field(allow_inf_nan=False, ge=0)]
_Activation = Literal["gelu_exact", "gelu_tanh", "silu", "relu"]  # executor.ops.ACTIVATIONS
STORED_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}  # name -> safetensors'


class _NormSpec(StrictSpec):
    kind: Literal["rmsnorm", "layernorm"]
    eps: _NonNegNum
    upcast: Literal["float32", "none"]
    weight_dtype: Literal["float32", "model"]
    weight: bool
    bias: bool
    folded_offset: bool


_Norm = Optional[_NormSpec]


class _RopeSpec(StrictSpec):
    theta: _PosNum
    style: Literal["half", "interleaved"]
    rotary_dim: _Pos
    head_dim: _Pos
    scaling: Optional[dict[str, Any]] = None
    max_positions: Optional[_Pos]
    compute_dtype: Literal["model", "float32"] = "model"


class _MlaSpec(StrictSpec):
    q_lora_rank: Optional[_Pos]
    kv_lora_rank: _Pos
    qk_nope_head_dim: _Count
    qk_rope_head_dim: _Pos
    v_head_dim: _Pos
    q_a_norm: _Norm
    kv_a_norm: _Norm


class _AttentionSpec(StrictSpec):
    kind: Literal["mha", "mla"]
    heads: _Pos
    kv_heads: _Pos
    head_dim: _Pos
    scale: _PosNum
    softcap: Optional[_PosNum]
    causal: bool
    sliding_window: Optional[_Count]
    qk_norm: Literal["none", "per_head", "full_width"]
    q_norm: _Norm
    k_norm: _Norm
    v_norm: _Norm
    k_eq_v: bool
    kv_shared_from: Optional[_Count]
    rope: Optional[_RopeSpec]
    mla: Optional[_MlaSpec]


class _MoeSpec(StrictSpec):
    routing: Literal["softmax", "sigmoid"]
    experts: _Pos
    top_k: _Pos
    groups: Optional[_Pos] = None
    groups_kept: Optional[_Pos] = None
    renormalise: bool = False
    scale: Optional[_Num] = None
    shared_experts: Optional[_Count] = None
    intermediate_size: _Pos
    activation: _Activation
    router_norm: _Norm = None
    router_input_scale: Optional[_Num] = None
    router_dtype: Literal["float32", "model"]
    weights_dtype: Literal["float32", "model"] = "float32"
    expert_norm: _Norm
    expert_post_norm: _Norm
    dense_post_norm: _Norm


class _MlpSpec(StrictSpec):
    gated: bool
    activation: _Activation
    intermediate_size: _Pos
    moe: Optional[_MoeSpec]


class _BlockNorms(StrictSpec):
    attn_norm: _Norm
    attn_post_norm: _Norm
    attn_res_norm: _Norm
    mlp_norm: _Norm
    mlp_post_norm: _Norm
    mlp_res_norm: _Norm


class _PerLayerInput(StrictSpec):
    post_norm: _Norm


class _LayerSpec(StrictSpec):
    norms: _BlockNorms
    attention: _AttentionSpec
    mlp: _MlpSpec
    per_layer_input: Optional[_PerLayerInput]


class _PerLayerEmbedding(StrictSpec):
    size: _Pos
    scale: _Num
    projection_scale: _Num
    combine_scale: _Num
    norm: _Norm


class _EmbeddingSpec(StrictSpec):
    scale: _Num
    scale_dtype: Literal["model", "float32"]
    positions: Literal["rope", "learned"]
    max_positions: Optional[_Pos]
    token_types: _Count
    norm: _Norm
    per_layer_input: Optional[_PerLayerEmbedding]


class _HeadTransform(StrictSpec):
    activation: _Activation
    norm: _Norm


class _HeadSpec(StrictSpec):
    tied: bool
    softcap: Optional[_PosNum]
    transform: Optional[_HeadTransform]


class _TensorSpec(StrictSpec):
    shape: list[_Count]
    dtype: Literal["float32", "bfloat16", "float16", "float64"]
    transposed: bool = False
    file: Optional[str] = None


class _FileSpec(StrictSpec):
    blake3: Optional[str] = None  # HASH; manifests written before it have sha256
    sha256: Optional[str] = None
    bytes: _Count

    @model_validator(mode="after")
    def _one_hash(self) -> _FileSpec:
        if (self.blake3 is None) == (self.sha256 is None):
            raise ValueError("needs one hash: blake3 (or sha256, in manifests written before parity used BLAKE3)")
        return self


class _Source(StrictSpec):
    family: str
    hash: Literal["blake3", "sha256"] = "sha256"  # of files; absent before parity used BLAKE3


class _ManifestSpec(StrictSpec):
    dtype: Literal["float32", "bfloat16", "float16"]
    source: _Source
    vocab_size: _Pos
    hidden_size: _Pos
    num_layers: _Pos
    rope_style: Optional[Literal["half", "interleaved"]]
    embedding: _EmbeddingSpec
    layers: list[_LayerSpec]
    final_norm: _Norm
    head: Optional[_HeadSpec]
    capture_points: list[str]
    tensors: dict[str, _TensorSpec]
    files: Annotated[dict[str, _FileSpec], Field(min_length=1)]


# RoPE scaling parameters per type, as parity/rope.py reads them: (required, optional) -> kind of value
_SCALING_PARAMS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
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


def _check_scaling(rope: dict, where: str) -> list[str]:
    """Problems with one layer's RoPE scaling (parity/rope.py SCALINGS), as 'where: what' strings."""
    scaling = rope.get("scaling") or {}
    kind = scaling.get("rope_type", "default")
    if not isinstance(kind, str) or kind not in _SCALING_PARAMS:
        return [f"{where}.rope_type: unknown RoPE scaling type {str(kind)[:30]!r}; known: {', '.join(_SCALING_PARAMS)}"]
    required, optional = _SCALING_PARAMS[kind]
    problems = [f"{where}: {kind} scaling needs {key}" for key in required if scaling.get(key) is None]
    for key, need in {**required, **optional}.items():
        value = scaling.get(key)
        label, ok = _SCALING_KINDS[need]
        if value is not None and not ok(value):
            problems.append(f"{where}.{key}: must be {label} (got {json.dumps(value)[:40]})")
    if problems:
        return problems
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        problems.append(f"{where}: high_freq_factor must exceed low_freq_factor")
    pairs = rope["rotary_dim"] // 2
    if kind == "longrope" and not len(scaling["long_factor"]) == len(scaling["short_factor"]) == pairs:
        problems.append(f"{where}: long_factor and short_factor need rotary_dim / 2 = {rope['rotary_dim'] // 2} values")
    needs_length = kind == "dynamic" or (kind in ("llama3", "yarn", "longrope")
                                         and scaling.get("original_max_position_embeddings") is None)
    if needs_length and rope.get("max_positions") is None:
        problems.append(f"{where}: {kind} scaling needs max_positions")
    return problems


def executor_tensors(m: dict) -> dict[str, tuple[int, ...]]:
    """The tensors the executor indexes for this manifest, with the shapes its sizes imply."""
    v, d = m["vocab_size"], m["hidden_size"]
    e = m["embedding"]
    out: dict[str, tuple[int, ...]] = {"embed.tokens.weight": (v, d)}
    if e["positions"] == "learned":
        out["embed.positions.weight"] = (e["max_positions"] or 0, d)
    if e["token_types"]:
        out["embed.token_types.weight"] = (e["token_types"], d)
    pli = e["per_layer_input"]
    if pli is not None:
        out["embed.per_layer_tokens.weight"] = (v, m["num_layers"] * pli["size"])
        out["embed.per_layer_projection.weight"] = (m["num_layers"] * pli["size"], d)
    if m["head"] is not None and not m["head"]["tied"]:
        out["lm_head.weight"] = (v, d)
    for i, layer in enumerate(m["layers"]):
        p = f"layers.{i}."
        att, mlp = layer["attention"], layer["mlp"]
        h = att["heads"]
        if att["mla"] is not None:
            mla = att["mla"]
            nope, rot, vd = mla["qk_nope_head_dim"], mla["qk_rope_head_dim"], mla["v_head_dim"]
            if mla["q_lora_rank"] is None:
                out[p + "attn.q.weight"] = (h * (nope + rot), d)
            else:
                out[p + "attn.q_a.weight"] = (mla["q_lora_rank"], d)
                out[p + "attn.q_b.weight"] = (h * (nope + rot), mla["q_lora_rank"])
            out[p + "attn.kv_a.weight"] = (mla["kv_lora_rank"] + rot, d)
            out[p + "attn.kv_b.weight"] = (h * (nope + vd), mla["kv_lora_rank"])
            out[p + "attn.o.weight"] = (d, h * vd)
        else:
            dh = att["head_dim"]
            out[p + "attn.q.weight"] = (h * dh, d)
            if att["kv_shared_from"] is None:
                out[p + "attn.k.weight"] = (att["kv_heads"] * dh, d)
                if not att["k_eq_v"]:
                    out[p + "attn.v.weight"] = (att["kv_heads"] * dh, d)
            out[p + "attn.o.weight"] = (d, h * dh)
        moe = mlp["moe"]
        if moe is None or moe["dense_post_norm"] is not None:  # a dense MLP runs
            size = mlp["intermediate_size"]
            out[p + "mlp.up.weight"] = (size, d)
            out[p + "mlp.down.weight"] = (d, size)
            if mlp["gated"]:
                out[p + "mlp.gate.weight"] = (size, d)
        if moe is not None:
            out[p + "moe.router.weight"] = (moe["experts"], d)
            size = moe["intermediate_size"]
            for k in range(moe["experts"]):
                out.update({f"{p}moe.experts.{k}.gate.weight": (size, d), f"{p}moe.experts.{k}.up.weight": (size, d),
                            f"{p}moe.experts.{k}.down.weight": (d, size)})
        if layer["per_layer_input"] is not None and pli is not None:
            out[p + "pli.gate.weight"] = (pli["size"], d)
            out[p + "pli.proj.weight"] = (d, pli["size"])
    return out


def _cross_checks(m: dict) -> list[str]:
    """What the schema cannot say alone: counts that must agree, sizes that must divide, layers that must exist."""
    problems = []
    if len(m["layers"]) != m["num_layers"]:
        problems.append(f"layers: {len(m['layers'])} entries for num_layers {m['num_layers']}")
    for i, layer in enumerate(m["layers"]):
        where = f"layers.{i}.attention"
        att = layer["attention"]
        rope, mla = att["rope"], att["mla"]
        if (att["kind"] == "mla") != (mla is not None):
            problems.append(f"{where}: kind {att['kind']!r} but mla is {'set' if mla else 'null'}")
        if mla is None and att["heads"] % att["kv_heads"]:
            problems.append(f"{where}: heads {att['heads']} is not a multiple of kv_heads {att['kv_heads']}")
        if att["kv_shared_from"] is not None and att["kv_shared_from"] >= i:
            problems.append(f"{where}.kv_shared_from: {att['kv_shared_from']} is not an earlier layer")
        if mla is not None and rope is None:
            problems.append(f"{where}: MLA needs rope")
        if rope is not None:
            width = mla["qk_rope_head_dim"] if mla is not None else att["head_dim"]
            if rope["rotary_dim"] % 2 or rope["rotary_dim"] > width:
                problems.append(f"{where}.rope.rotary_dim: {rope['rotary_dim']} must be even and at most {width}")
            problems += _check_scaling(rope, f"{where}.rope.scaling")
        moe = layer["mlp"]["moe"]
        if moe is not None:
            where = f"layers.{i}.mlp.moe"
            groups = moe.get("groups") or 1
            if moe["top_k"] > moe["experts"]:
                problems.append(f"{where}: top_k {moe['top_k']} exceeds experts {moe['experts']}")
            if groups > 1 and (moe["experts"] % groups or moe["experts"] // groups < 2
                               or not 1 <= (moe.get("groups_kept") or 0) <= groups):
                problems.append(f"{where}: {moe['experts']} experts in {groups} groups (keeping "
                                f"{moe.get('groups_kept')}) do not divide into groups of 2 or more")
    stated = m["tensors"]
    for name, shape in executor_tensors(m).items():
        if name not in stated:
            problems.append(f"tensors: {name} is missing (the executor reads it)")
        elif tuple(stated[name]["shape"]) != shape:
            problems.append(f"tensors.{name}: shape {stated[name]['shape']} does not match the sizes the manifest "
                            f"states ({list(shape)})")
    odd = [f for f in m["files"] if not plain_file_name(f)]
    if odd:
        problems.append(f"files: {odd[0]!r} is not a file name in the directory")
    unknown = sorted({t["file"] for t in stated.values() if t.get("file") is not None} - set(m["files"]))
    if unknown:
        problems.append(f"tensors: name file {unknown[0]!r}, which files does not list")
    return problems


def validate_manifest(manifest: Any, file: Path) -> None:
    """Refuse a manifest the executor could not run: one line naming the first problem and its place."""
    fix = "re-convert with `parity convert --to neutral`"
    if not isinstance(manifest, dict):
        raise ParityError(f"{file}: expected a JSON object, found {type(manifest).__name__}; {fix}")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ParityError(f"{file}: not a {FORMAT} v{FORMAT_VERSION} manifest; {fix}")
    check_schema(_ManifestSpec, manifest, file, fix)
    problems = _cross_checks(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ParityError(f"{file}: {problems[0]}{more}; {fix}")


def read_manifest(path: Path) -> dict:
    """A neutral directory's (or a manifest file's) manifest, validated."""
    path = Path(path)
    file = path / MANIFEST if path.is_dir() else path
    if not file.is_file():
        raise ParityError(f"{path}: no {MANIFEST}; give a directory written by `parity convert --to neutral`")
    manifest = read_json(file, "re-convert with `parity convert`")
    validate_manifest(manifest, file)
    return manifest


def file_hash(info: dict) -> tuple[str, str]:
    """A manifest ``files`` entry's (algorithm, hex digest): blake3, or sha256 in manifests written before."""
    return ("blake3", info["blake3"]) if info.get("blake3") is not None else ("sha256", info["sha256"])


def load(path: Path, *, verify: bool = False, lazy: bool = False) -> tuple[dict, Any]:
    """Read a neutral directory: (manifest, tensors by neutral name). Every file's header is checked, and every
    tensor the manifest lists must be there with the shape and dtype it states, before any tensor is read.
    ``lazy``: the tensors are a parity.lazy.NeutralSource, read a layer at a time as the executor reaches them."""
    path = Path(path)
    manifest = read_manifest(path)
    directory = path if path.is_dir() else path.parent
    fix = "re-convert with `parity convert --to neutral`"
    found: dict[str, str] = {}
    for file in manifest["files"]:
        header = read_header(directory / file, fix)
        for name, entry in header.tensors.items():
            if name in found:
                raise ParityError(f"{directory / file}: {name} is also in {found[name]}; {fix}")
            found[name] = file
            info = manifest["tensors"].get(name)
            if info is None:
                continue
            if list(entry.shape) != info["shape"] or entry.dtype != STORED_DTYPES[info["dtype"]]:
                raise ParityError(f"{directory / file}: {name} is {entry.dtype} {list(entry.shape)} but the manifest "
                                  f"says {STORED_DTYPES[info['dtype']]} {info['shape']}; {fix}")
            if info.get("file") not in (None, file):
                raise ParityError(f"{directory / file}: holds {name}, which the manifest places in {info['file']}; "
                                  f"{fix}")
    missing = sorted(set(manifest["tensors"]) - set(found))
    if missing:
        raise ParityError(f"{path}: tensors listed in the manifest are missing: {', '.join(missing[:8])}"
                          f"{' ...' if len(missing) > 8 else ''}; {fix}")
    if lazy:
        from .lazy import NeutralSource

        for name, info in manifest["tensors"].items():
            info.setdefault("file", found[name])
        return manifest, NeutralSource(manifest, directory)
    tensors: dict[str, torch.Tensor] = {}
    for file, info in manifest["files"].items():
        algorithm, digest = file_hash(info)
        if verify and hash_file(directory / file, algorithm) != digest:
            raise ParityError(f"{directory / file}: its {algorithm} differs from the manifest's; the file changed "
                              f"after conversion")
        try:
            with safe_open(directory / file, framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - the header is checked; a dtype torch lacks, or an I/O error
            raise ParityError(f"{directory / file}: not a readable safetensors file ({str(exc)[:160]}); "
                              f"{fix}") from None
    return manifest, tensors


def summary(manifest: dict) -> dict[str, Any]:
    return {"family": manifest["source"]["family"], "dtype": manifest["dtype"], "layers": manifest["num_layers"],
            "tensors": len(manifest["tensors"]), "files": list(manifest["files"])}
