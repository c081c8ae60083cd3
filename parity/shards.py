"""The safetensors format: a strict header reader, and a streaming writer.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets; optional ``__metadata__`` of str -> str), then raw bytes. ``read_header`` checks every
file parity is given before safetensors maps it, so a damaged or hostile file ends as one line
naming it. safetensors' own ``save_file`` wants every tensor in memory at once; a converter that
must stay near the size of its largest tensor writes the format itself (``ShardWriter``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ParityError

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}

# Every dtype safetensors defines, in bits per element (F4 and F6 pack several elements per byte).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit: a longer header is damage, not a model
METADATA = "__metadata__"


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int                  # byte offsets within the data region
    end: int


@dataclass(frozen=True)
class Header:
    """A validated safetensors header: tensors in file order, metadata, and where the data region starts."""

    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int


def read_header(path: Path, fix: str = "write it again with safetensors") -> Header:
    """Read and check a safetensors header without reading (or mapping) the tensors.

    Refuses, with a ParityError naming the file, the problem and ``fix``: a file under 8 bytes, a header
    length beyond the file or MAX_HEADER_BYTES (never allocated), a header that is not a UTF-8 JSON object,
    an entry without a known dtype, a shape of non-negative ints or data_offsets [begin, end] whose length
    is numel x itemsize, tensors that overlap or leave gaps, a data region that does not end with the file,
    and metadata values that are not strings.
    """
    path = Path(path)

    def refuse(problem: str) -> ParityError:
        return ParityError(f"{path}: not a readable safetensors file ({problem}); {fix}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise refuse(f"{size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\xff"))  # a file shrinking under us: absurd
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise refuse(f"header length {length} exceeds the file's {size - 8} remaining bytes"
                             if length > size - 8 else f"header length {length} exceeds {MAX_HEADER_BYTES} bytes")
            raw = f.read(length)
    except ParityError:
        raise
    except FileNotFoundError:
        raise refuse("no such file") from None
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError:
        raise refuse("header is not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise refuse(f"header is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise refuse(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop(METADATA, None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise refuse(f"{METADATA} must map names to strings")
    data_size = size - 8 - length
    tensors = {name: _entry(name, info, refuse, data_size) for name, info in header.items()}
    covered = 0
    for name, t in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if t.begin != covered:
            raise refuse(f"tensor {name!r} starts at byte {t.begin} of the data, expected {covered} "
                         f"({'overlapping' if t.begin < covered else 'a gap before it'})")
        covered = t.end
    if covered != data_size:
        raise refuse(f"the tensors cover {covered} bytes of data but the file holds {data_size}"
                     + (" (truncated)" if covered > data_size else ""))
    return Header(tensors, metadata, 8 + length)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r} appears twice")
    return out


def _entry(name: str, info: Any, refuse, data_size: int) -> HeaderEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise refuse(f"tensor {name!r} needs dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise refuse(f"tensor {name!r} has unknown dtype {str(dtype)[:20]!r}; known: {', '.join(DTYPE_BITS)}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise refuse(f"tensor {name!r} has shape {str(shape)[:40]}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise refuse(f"tensor {name!r} has data_offsets {str(offsets)[:40]}, not [begin, end] with begin <= end")
    numel = 0 if 0 in shape else 1
    for d in shape if numel else ():
        numel *= d
        if numel > 8 * data_size + 8:  # already more than the file holds: stop before the product grows huge
            raise refuse(f"tensor {name!r} ({dtype}, {len(shape)} dims) needs more bytes than the file's "
                         f"{data_size} of data")
    bits = numel * DTYPE_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        needs = bits // 8 if bits % 8 == 0 else bits / 8
        raise refuse(f"tensor {name!r} ({dtype} {str(shape)[:60]}) needs {needs} bytes but its data_offsets span "
                     f"{offsets[1] - offsets[0]}")
    return HeaderEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


@dataclass
class Shard:
    path: Path
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan(tensors: list[PlannedTensor], directory: Path, max_shard_bytes: int) -> list[Shard]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` (one tensor may exceed it)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    if len(shards) == 1:
        return [Shard(directory / "model.safetensors", shards[0])]
    n = len(shards)
    return [Shard(directory / f"model-{k + 1:05d}-of-{n:05d}.safetensors", s) for k, s in enumerate(shards)]


class ShardWriter:
    """Writes one planned shard; ``write`` must be called in plan order. Hashes as it goes."""

    def __init__(self, shard: Shard, metadata: dict[str, str] | None = None):
        self.shard = shard
        self.expected = iter(shard.tensors)
        self.sha = Sha256()
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for t in shard.tensors:
            header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.file = open(shard.path, "wb")
        self._put(struct.pack("<Q", len(raw)) + raw)

    def _put(self, data: bytes | memoryview) -> None:
        self.sha.update(data)  # hashed while it is written
        self.file.write(data)
        self.sha.wait()  # the caller may reuse the tensor's memory once write returns

    def write(self, name: str, tensor: torch.Tensor) -> None:
        planned = next(self.expected)
        if (planned.name, planned.shape, planned.dtype) != (name, tuple(tensor.shape), tensor.dtype):
            raise RuntimeError(f"shard writer: got {name} {tuple(tensor.shape)} {tensor.dtype}, planned "
                               f"{planned.name} {planned.shape} {planned.dtype}")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._put(memoryview(flat.numpy()))

    def close(self) -> str:
        """Finish the file; returns its sha256."""
        leftover = next(self.expected, None)
        self.file.close()
        digest = self.sha.hexdigest()
        if leftover is not None:
            raise RuntimeError(f"shard writer: {leftover.name} was planned but never written")
        return digest


class Sha256:
    """sha256 computed on a thread of its own, in the order it is fed: hashlib releases the GIL on large
    updates, so reading and writing go on meanwhile (a file read and a file written hash on two cores).
    What ``update`` is given must stay unchanged until ``wait`` (or ``hexdigest``) returns."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity-sha256")
        self._pending: deque[Future] = deque()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._pending.append(self._thread.submit(self._sha.update, data))

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        self.close()
        return self._sha.hexdigest()

    def close(self) -> None:
        """Finish what was fed and end the thread (after an error too; closing twice is harmless)."""
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True, cancel_futures=True)


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()
