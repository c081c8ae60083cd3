"""The neutral layout: ``manifest.json`` (every convention as an explicit value) + safetensors, written
(parity.neutral.manifest reads it back).

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
from typing import Any, BinaryIO, Callable, Container, Iterator

from parity import __version__, names
from parity.adapter import ResolvedTensor
from parity.neutral.declared import Source, fill
from parity.checkpoint import Checkpoint, open_checkpoint, stored_tensor_map
from parity.errors import ParityError
from parity.neutral.model import DTYPE_NAMES, FORMAT, MANIFEST, File, Layer, Manifest, SourceInfo, Tensor
from parity.storage import atomic
from parity.storage.quantization import dequantize, quantized_weights, rounding_error
from parity.storage.shards import (
    HASH,
    ContentHash,
    Hashing,
    Header,
    Parts,
    Pieces,
    PlannedTensor,
    ShardWriter,
    dtype_code,
    file_order,
    hash_file,
    plan,
    read_header,
)


class _Torch:
    """torch, imported at its first use: a conversion that copies every tensor as it is stored never uses it
    (importing torch, and tearing it down at exit, took longer than hashing a 5 GB checkpoint)."""

    def __getattr__(self, name: str) -> Any:
        import torch  # torch: this module must not load it

        return getattr(torch, name)  # not kept: what a test patches in torch is seen here too


torch = _Torch()

# safetensors' codes -> torch dtype names
SOURCE_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
READ_DTYPES = {**SOURCE_DTYPES, "F8_E4M3": "float8_e4m3fn"}  # FP8 only with block scales (parity.storage.quantization)
DEFAULT_SHARD_BYTES = 5 * 2**30
READ_CHUNK = 2**22  # source bytes read, and hashed, at a time (4 MiB: 1 MiB took ~25% more CPU)
RING = 4  # buffers of READ_CHUNK that a streamed tensor's pieces cycle through, while earlier ones are hashed
# and written



# --------------------------------------------------------------------------------------------
# Manifest


def build_manifest(ckpt: Checkpoint, dtype: torch.dtype | str, rope_style: str, prefix: str | None = None,
                   hashes: bool = True) -> Manifest:
    """Every convention of the checkpoint as explicit values, read off the adapter's resolved settings by the
    neutral model's declarations (parity.neutral.model), and the tensors it becomes (files: by convert).
    ``hashes=False`` leaves the source files' hashes (``HASH``) out: a manifest for running, or one whose writer
    hashes the files as it reads them (convert, in its one pass). ``dtype``: a torch dtype or its name."""
    target = str(dtype).removeprefix("torch.")
    r = ckpt.resolved
    prefix = prefix if prefix is not None else ckpt.variant.tensor_prefix[0]
    vocab, hidden = next(t.shape for t in r.tensors if t.neutral == ("embed.tokens.weight",))
    has_logits = any(c.name == "logits" for c in r.capture)
    rope = r["positions.kind"] == "rope"
    given = {"rope_style": rope_style, "hidden_size": hidden, "logits": has_logits}
    layers = [fill(Layer, Source(r, i, given)) for i in range(r.num_layers)]
    tensors = {name: Tensor(shape=list(shape), dtype=_stored_dtype(name, layers, target), transposed=t.transpose,
                            interleaved=t.groups or 0)
               for t in r.tensor_map(prefix).values() for name, shape in _neutral_shapes(t)}
    source = SourceInfo(
        family=r.family, architecture=ckpt.variant.architectures[0], model_type=ckpt.config.get("model_type"),
        path=str(ckpt.path),
        # the checkpoint's own q/k row order: the executor's ops are emitted in it (docs/ops.md)
        rope_style=r["positions.rope_style"] if rope else None,
        hash=HASH, files={f.name: hash_file(f) for f in ckpt.files} if hashes else {})
    return fill(Manifest, Source(r, None, given), written_by=f"parity {__version__}", dtype=target, source=source,
                vocab_size=vocab, hidden_size=hidden, num_layers=r.num_layers,
                rope_style=rope_style if rope else None, layers=layers,
                # a parallel layer (its MLP beside attention) has no stream between the two adds: no `mid`
                capture_points=[p for p in names.capture_names(r.num_layers, final_norm=r["norm.final"],
                                                               logits=has_logits)
                                if not (p.endswith(".mid") and layers[names.layer_of(p)].mlp.parallel)],
                tensors=tensors)


# --------------------------------------------------------------------------------------------
# Tensors: the transforms to the neutral layout, in one place


def to_neutral(t: ResolvedTensor, x: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The neutral tensors one checkpoint tensor becomes (before the dtype cast)."""
    if t.norm_offset:
        x = x.float() + 1.0  # fold `1 + w` in float32, before any cast
    if t.transpose:
        x = x.transpose(-2, -1)  # a stacked [E, in, out] tensor: each expert's
    parts = list(x.unbind(0)) if t.unstack else [x]
    if t.split is not None:
        dim, sizes = t.split
        if t.interleaved:  # part k: entries k, k + n, ... along dim (GPT-OSS: gate [..., ::2], up [..., 1::2])
            n = len(sizes)
            parts = [p.index_select(dim, torch.arange(k, p.shape[dim], n, device=p.device))
                     for p in parts for k in range(n)]
        else:
            parts = [piece for p in parts for piece in _split(p, dim, sizes, t.groups)]
    if len(parts) != len(t.neutral):
        raise ParityError(f"{t.hf}: makes {len(parts)} tensors for {len(t.neutral)} neutral names; fix the adapter")
    yield from zip(t.neutral, (p.contiguous() for p in parts))


def _split(x: torch.Tensor, dim: int, sizes: tuple[int, ...], groups: int | None) -> list[torch.Tensor]:
    """x cut along ``dim`` into parts of ``sizes``: one after another, or (``groups``) interleaved in that many
    blocks, each holding size / groups of every part in order (GPT-NeoX's [heads, 3, head_dim] q/k/v)."""
    if not groups:
        return list(torch.split(x, list(sizes), dim=dim))
    dim = dim % x.dim()
    if any(size % groups for size in sizes) or x.shape[dim] != sum(sizes):
        raise ParityError(f"parts {list(sizes)} do not interleave in {groups} blocks of {x.shape[dim]}; "
                          f"fix the adapter")
    blocks = x.reshape(*x.shape[:dim], groups, x.shape[dim] // groups, *x.shape[dim + 1:])
    return [p.reshape(*x.shape[:dim], size, *x.shape[dim + 1:])
            for p, size in zip(torch.split(blocks, [size // groups for size in sizes], dim=dim + 1), sizes)]


def neutral_tensors(ckpt: Checkpoint, manifest: Manifest, keep: Callable[[str], bool] = lambda name: True
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The neutral tensors ``keep`` selects, one at a time, converted from the checkpoint's files without
    reading the rest: at the manifest's dtype, q/k rows in its RoPE style."""
    from parity.storage.lazy import Dequantizer  # torch: this module must not load it

    r = ckpt.resolved
    files = Dequantizer.of(ckpt)  # FP8 weights read dequantized, in float32
    source_style = r["positions.rope_style"]
    for hf_name, t in stored_tensor_map(r, ckpt.check()).items():
        if not any(keep(name) for name, _ in _neutral_shapes(t)):
            continue
        for name, y in to_neutral(t, files.read(hf_name)):
            if keep(name):
                layer = manifest.layer_of(name)
                if layer is not None:
                    y = restyle_rope(name, y, layer, source_style, manifest.rope_style or source_style)
                yield name, y.to(getattr(torch, manifest.tensors[name].dtype))


def neutral_subset(ckpt: Checkpoint, manifest: Manifest, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The neutral tensors ``keep`` selects (the diagnosis re-runs one layer of a model too big to convert whole)."""
    return dict(neutral_tensors(ckpt, manifest, keep))


def _neutral_shapes(t: ResolvedTensor) -> list[tuple[str, tuple[int, ...]]]:
    if not (t.transpose or t.unstack or t.split is not None) and len(t.neutral) == 1:
        return [(t.neutral[0], tuple(t.shape))]  # nothing reshapes it (most tensors): no torch needed
    meta = torch.empty(t.shape, device="meta")
    return [(n, tuple(p.shape)) for n, p in to_neutral(t, meta)]


def _rope_rows(name: str, layer: Layer) -> tuple[int, int, int] | None:
    """For a tensor whose rows (or q/k-norm entries) RoPE rotates: (block, offset, rotary_dim) per head."""
    att = layer.attention
    rope = att.rope
    if rope is None:
        return None
    short = name.split(".", 2)[2]  # drop "layers.{i}."
    mla = att.mla
    if mla is not None:
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rot = mla.qk_rope_head_dim
        if short in ("attn.q_b.weight", "attn.q.weight"):
            return qk, mla.qk_nope_head_dim, rot
        if short in ("attn.kv_a.weight", "attn.kv_a.bias"):
            return mla.kv_lora_rank + rot, mla.kv_lora_rank, rot
        return None
    if short in ("attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.q_norm.weight",
                 "attn.k_norm.weight", "attn.q_norm.bias", "attn.k_norm.bias"):  # Phi's q/k LayerNorms: biased
        return att.head_dim, 0, rope.rotary_dim
    return None


def _permute_rows(x: torch.Tensor, block: int, offset: int, perm: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Reorder, within every ``block`` along ``dim``, the entries offset..offset+len(perm) by ``perm``."""
    index = torch.arange(x.shape[dim])
    heads = x.shape[dim] // block
    for h in range(heads):
        start = h * block + offset
        index[start:start + len(perm)] = start + perm
    return x.index_select(dim, index)


def restyles(name: str, layer: Layer, source: str, target: str) -> bool:
    """Whether restyle_rope permutes tensor ``name`` (of a layer)."""
    if source == target:
        return False
    att = layer.attention
    short = name.split(".", 2)[2] if name.startswith("layers.") else name
    return _rope_rows(name, layer) is not None or (short == "attn.o.weight" and att.k_eq_v and att.mla is None)


def restyle_rope(name: str, x: torch.Tensor, layer: Layer, source: str, target: str) -> torch.Tensor:
    """Permute q/k rows (and what shares their layout) from ``source`` to ``target`` RoPE style."""
    if not restyles(name, layer, source, target):
        return x
    from parity.rope import half_permutation, interleave_permutation  # torch: this module must not load it

    make = interleave_permutation if target == "interleaved" else half_permutation
    rows = _rope_rows(name, layer)
    short = name.split(".", 2)[2] if name.startswith("layers.") else name
    if rows is not None:
        block, offset, rot = rows
        return _permute_rows(x, block, offset, make(rot, rot))
    att = layer.attention
    if short == "attn.o.weight" and att.k_eq_v and att.mla is None:
        # values are the (permuted) key projection: o_proj's input columns follow them
        rot = att.rope.rotary_dim
        return _permute_rows(x, att.head_dim, 0, make(rot, rot), dim=1)
    return x


# --------------------------------------------------------------------------------------------
# Convert


def _stored_dtype(name: str, layers: list[Layer], target: str) -> str:
    """The model dtype, except for tensors the model keeps in float32 whatever it runs in (a float32 router)."""
    if name.startswith("layers.") and ".moe.router." in name:
        moe = layers[int(name.split(".")[1])].mlp.moe
        if moe and moe.router_dtype == "float32":
            return "float32"
    return target


class _Reader:
    """A checkpoint's safetensors files, each read once from front to back, READ_CHUNK bytes at a time.

    Every byte read (the header, and tensors the adapter does not map) goes to the file's hash (``HASH``: a
    digest per part, the parts on the hashing lanes in turn), so the manifest's source hashes cost no second
    pass, and a tensor written as it is stored takes its output digest from the same one. Hashing runs on
    threads of their own (``hashing``), and writing on another, while the next piece is read. Tensors in
    ``streamed`` (written exactly as they are stored) and those not wanted pass through a ring of RING small
    buffers, a piece at a time, each reused once its hashes and its write are done; the others are read whole
    into one buffer, reused: memory stays at the largest of those (``largest``), not at the largest tensor.
    """

    def __init__(self, largest: int, hashing: Hashing) -> None:
        self.largest = largest
        self.hashing = hashing
        self.buffer = bytearray()  # allocated at the first tensor read whole
        self.ring: list[memoryview | None] = [None] * RING
        self.fences: list = [()] * RING  # per ring buffer: the hashing and writing to finish before it is reused
        self.next = 0
        self.digests: dict[str, str] = {}  # file name -> hex digest (HASH), once the file was read to its end

    def tensors(self, file: Path, header: Header, wanted: Container[str], streamed: Container[str] = ()
                ) -> Iterator[tuple[str, torch.Tensor | Pieces]]:
        """The tensors of ``file`` in ``wanted``, in file order: those in ``streamed`` as Pieces (to be written
        before the next is asked for), the others whole, each overwritten by the next (copy to keep)."""
        parts = Parts()
        try:
            with open(file, "rb", buffering=0) as f:
                head = self._read(f, file, header.data_start, parts, 0)
                if int.from_bytes(head[:8], "little") != header.data_start - 8:
                    raise ParityError(f"{file}: changed while it was read; convert again once nothing writes to it")
                for k, name in enumerate(file_order(header), start=1):
                    entry = header.tensors[name]
                    if name in wanted and name in streamed:
                        part = self.hashing.part(k)
                        pieces = self._pieces(f, file, entry.end - entry.begin, part)
                        yield name, Pieces(entry.shape, entry.dtype, pieces, part)
                        for _ in pieces:  # whatever the consumer left is still read (and hashed)
                            pass
                        parts.add(part.finish())
                    elif name in wanted:
                        raw = self._read(f, file, entry.end - entry.begin, parts, k)
                        x = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
                        yield name, x.view(getattr(torch, READ_DTYPES[entry.dtype])).reshape(entry.shape)
                    else:  # hashed, not kept
                        part = self.hashing.part(k)
                        for _ in self._pieces(f, file, entry.end - entry.begin, part):
                            pass
                        parts.add(part.finish())
                if f.read(1):
                    raise ParityError(f"{file}: grew while it was read; convert again once nothing writes to it")
            self.digests[file.name] = parts.hexdigest()
        except OSError as exc:
            raise ParityError(f"{file}: cannot be read ({exc.strerror or exc})") from None

    def _read(self, f: BinaryIO, file: Path, nbytes: int, parts: Parts, k: int) -> memoryview:
        """The next ``nbytes`` of ``f``, in the buffer; each piece goes to the hash of part ``k`` of ``parts`` as
        soon as it is in."""
        for fence in self.hashing.fence():  # the buffer is about to be overwritten: its hashes and writes are done
            fence.result()
        if nbytes > len(self.buffer):
            self.buffer = bytearray(max(nbytes, self.largest))
        view = memoryview(self.buffer)[:nbytes]
        part = self.hashing.part(k)
        for start in range(0, nbytes, READ_CHUNK):
            piece = view[start:start + READ_CHUNK]
            _fill(f, file, piece)
            part.update(piece)
        parts.add(part.finish())
        return view

    def _pieces(self, f: BinaryIO, file: Path, nbytes: int, part: ContentHash) -> Iterator[memoryview]:
        """The next ``nbytes`` of ``f``, READ_CHUNK at a time, each in the next buffer of the ring and fed to
        ``part``; a piece is valid until the next is asked for, and its buffer is reused only once everything
        fed to the hashing and writing threads by then (its hash, its write) is done."""
        for start in range(0, nbytes, READ_CHUNK):
            k, self.next = self.next, (self.next + 1) % RING
            for fence in self.fences[k]:
                fence.result()
            self.fences[k] = ()
            size = min(READ_CHUNK, nbytes - start)
            if self.ring[k] is None or len(self.ring[k]) < size:
                self.ring[k] = memoryview(bytearray(READ_CHUNK))
            piece = self.ring[k][:size]
            _fill(f, file, piece)
            part.update(piece)
            yield piece
            self.fences[k] = self.hashing.fence()


def _fill(f: BinaryIO, file: Path, piece: memoryview) -> None:
    """Read exactly ``len(piece)`` bytes of ``f`` into ``piece``."""
    done = 0
    while done < len(piece):
        n = f.readinto(piece[done:])
        if not n:
            raise ParityError(f"{file}: ends before the tensor data its header promises; it was truncated "
                              f"while it was read")
        done += n


def _as_stored(t: ResolvedTensor, stored: str, manifest: Manifest, source_style: str, style: str) -> bool:
    """Whether checkpoint tensor ``t``, stored as ``stored`` (safetensors' code), becomes one neutral tensor of
    exactly its stored bytes (to_neutral folds, transposes, splits or unstacks nothing, restyle_rope permutes
    nothing, the manifest's dtype is its own), so that it can be copied a piece at a time."""
    if t.norm_offset or t.transpose or t.unstack or t.split is not None or len(t.neutral) != 1:
        return False
    name = t.neutral[0]
    if dtype_code(manifest.tensors[name].dtype) != stored:
        return False
    layer = manifest.layer_of(name)
    return layer is None or not restyles(name, layer, source_style, style)


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
    if not check.buffers:  # nothing to check (and torch, which the check needs, not imported)
        return
    from parity.checkpoint.buffers import check_buffers  # torch: this module must not load it

    for b in check_buffers(ckpt, check):  # a head transformers unties would be tied in the neutral model
        if b["kind"] == "tied_copy" and not b["agrees"]:
            raise ParityError(f"{ckpt.path}: {b['name']} {b['note']}")


def source_dtype(ckpt: Checkpoint, check) -> torch.dtype:
    """The checkpoint's one weight dtype (float32 when it mixes several). FP8 weights count as the dtype of the
    checkpoint's other tensors (bf16 in the released FP8 models)."""
    return getattr(torch, source_dtype_name(ckpt, check))


def source_dtype_name(ckpt: Checkpoint, check) -> str:
    """source_dtype's name ("bfloat16")."""
    scaled = set(quantized_weights(ckpt.tensors)) if ckpt.quantization else set()
    found = {ckpt.tensors[n].dtype for n in stored_tensor_map(ckpt.resolved, check) if n not in scaled}
    return SOURCE_DTYPES[found.pop()] if len(found) == 1 else "float32"


def _refuse(ckpt: Checkpoint, dtype: str | None, rope_style: str | None) -> None:
    """convert's options, checked before anything is written."""
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    if rope_style not in (None, "half", "interleaved"):
        raise ParityError(f"--rope-style {rope_style!r} is not one of half, interleaved")
    if ckpt.resolved["positions.kind"] != "rope" and rope_style:
        raise ParityError(f"{ckpt.path}: --rope-style applies to RoPE models; {ckpt.resolved.family} uses learned "
                          f"positions")


def convert(path: Path, out: Path, *, dtype: str | None = None, rope_style: str | None = None, force: bool = False,
            adapter_dirs=(), max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Manifest:
    """Convert a checkpoint directory into the neutral layout at ``out``; returns the manifest."""
    ckpt = open_checkpoint(Path(path), adapter_dirs)
    check_convertible(ckpt)
    r = ckpt.resolved
    check = ckpt.check()
    _refuse(ckpt, dtype, rope_style)
    tensor_map = stored_tensor_map(r, check)
    deq = _dequantizer(ckpt)
    target = dtype or source_dtype_name(ckpt, check)
    errors: dict[str, float] = {}  # FP8 weight -> rel_l2 of its dequantization at the target dtype
    source_style = r["positions.rope_style"]
    style = rope_style or source_style

    # source hashes come from the conversion's own reads (_Reader), filled in before the manifest is written
    manifest = build_manifest(ckpt, target, style, check.prefix, hashes=False)
    headers = {f: read_header(f) for f in ckpt.files}
    # planned in source order, so that each tensor is written as soon as the one pass has read it
    order = [n for f in ckpt.files for hf_name in file_order(headers[f]) if hf_name in tensor_map
             for n in tensor_map[hf_name].neutral]
    outputs = [PlannedTensor(n, tuple(manifest.tensors[n].shape), manifest.tensors[n].dtype) for n in order]

    def finish(name: str, y: torch.Tensor) -> torch.Tensor:
        """A neutral tensor as it is written: q/k rows in the target RoPE style, at the manifest's dtype."""
        layer = manifest.layer_of(name)
        if layer is not None:
            y = restyle_rope(name, y, layer, source_style, style)
        return y.to(getattr(torch, manifest.tensors[name].dtype))

    # tensors written exactly as stored are copied a piece at a time as they are read; the rest are read whole
    entries = {n: h.tensors[n] for h in headers.values() for n in h.tensors if n in tensor_map}
    streamed = {n for n, e in entries.items() if not (deq and deq.quantized(n))
                and _as_stored(tensor_map[n], e.dtype, manifest, source_style, style)}
    largest = max((e.end - e.begin for n, e in entries.items() if n not in streamed), default=0)
    with atomic.output_dir(Path(out), force=force) as tmp, Hashing(writes=True, lanes=2) as hashing:
        reader = _Reader(largest, hashing)
        shards = plan(outputs, tmp, max_shard_bytes)
        where = {t.name: s.path.name for s in shards for t in s.tensors}
        writers = iter(shards)
        shard = next(writers)
        writer = ShardWriter(shard, {"format": "pt", "parity": FORMAT}, hashing)
        written = 0
        files: dict[str, File] = {}
        for f in ckpt.files:
            for hf_name, x in reader.tensors(f, headers[f], tensor_map, streamed):
                if isinstance(x, Pieces):  # written as stored, each piece as soon as it is read
                    neutral = [(tensor_map[hf_name].neutral[0], x)]
                else:
                    if deq and deq.quantized(hf_name):  # in float32; written at the target dtype, its rounding measured
                        x = dequantize(x, deq.scale(hf_name), ckpt.quantization.block)
                        errors[hf_name] = rounding_error(x, getattr(torch, target))
                    neutral = ((name, finish(name, y)) for name, y in to_neutral(tensor_map[hf_name], x))
                for name, y in neutral:
                    if written == len(shard.tensors):
                        files[shard.path.name] = File(**{HASH: writer.close()}, bytes=shard.path.stat().st_size)
                        shard = next(writers)
                        writer = ShardWriter(shard, {"format": "pt", "parity": FORMAT}, hashing)
                        written = 0
                    writer.write(name, y)
                    written += 1
        files[shard.path.name] = File(**{HASH: writer.close()}, bytes=shard.path.stat().st_size)
        manifest.source.files = reader.digests
        if ckpt.quantization is not None:
            manifest.source.quantization = dequantization_summary(ckpt.quantization, errors, target)
        for name, info in manifest.tensors.items():
            info.file = where[name]
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in outputs)}, "weight_map": where}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        manifest.files = files
        (tmp / MANIFEST).write_text(manifest.dumps() + "\n")
        _copy_tokenizer(ckpt.path, tmp)
    return manifest


def _dequantizer(ckpt: Checkpoint):
    """A parity.storage.lazy.Dequantizer for a quantized checkpoint (it needs torch); None for the others."""
    if ckpt.quantization is None:
        return None
    from parity.storage.lazy import Dequantizer  # torch: this module must not load it

    return Dequantizer.of(ckpt)


def dequantization_summary(quantization, errors: dict[str, float], target: str) -> dict:
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
