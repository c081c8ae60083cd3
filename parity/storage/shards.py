"""The safetensors format: a strict header reader, and a streaming writer.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets; optional ``__metadata__`` of str -> str), then raw bytes. ``read_header`` checks every
file parity is given before safetensors maps it, so a damaged or hostile file ends as one line
naming it. safetensors' own ``save_file`` wants every tensor in memory at once; a converter that
must stay near the size of its largest tensor writes the format itself (``ShardWriter``).

Content hashes (``HASH``: BLAKE3 of a file's parts; manifests written before it record a whole file's BLAKE3 or
sha256, ``HASHES``) run on threads of their own (``Hashing``) while files are read and written (a conversion
writes on another).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from parity.errors import ParityError

if TYPE_CHECKING:
    import torch

# torch dtype names -> safetensors' codes. Dtypes are handled by name here, so that a conversion that copies every
# tensor as stored never imports torch (its import and teardown cost more than hashing the bytes).
CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
         "int8": "I8", "uint8": "U8", "bool": "BOOL"}

# Every dtype safetensors defines, in bits per element (F4 and F6 pack several elements per byte).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit: a longer header is damage, not a model
METADATA = "__metadata__"
# The content hash written into manifests (HASH): BLAKE3 over the BLAKE3 digests of a safetensors file's parts,
# in file order: its header (length and JSON), then each tensor's bytes. A conversion writes most tensors as the
# bytes it read, so one digest of them serves the source file's hash and the output file's (a hash of the whole
# file must see every byte twice, once in each file: that was most of a conversion's CPU), and the parts of a
# file hash on two threads. Manifests written before record a whole file's BLAKE3 ("blake3") or sha256: HASHES
# still computes both, to verify them. BLAKE3 ran at 3.3 GB/s on one core of the VM of docs/big-models.md, sha256 at
# 0.85.
HASH = "blake3_tensors"
HASHES: dict[str, Callable[[], Any]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}  # of a whole file
ALGORITHMS = (HASH, *HASHES)
# Bytes per write(). Writes into the page cache cost more system time per byte in large calls than in small
# ones: on the VM of docs/big-models.md, 1 MiB writes took about 3x the system time of 64 KiB ones (32 KiB: no better).
WRITE_CHUNK = 64 * 2**10


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


def plain_file_name(name: str) -> bool:
    """A bare file name: no directory part, no parent reference, nothing absolute."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def file_order(header: Header) -> list[str]:
    """A safetensors file's tensor names in the order their bytes lie in it."""
    return sorted(header.tensors, key=lambda name: (header.tensors[name].begin, header.tensors[name].end))


def dtype_code(dtype: Any) -> str:
    """safetensors' code for a torch dtype, its name ("bfloat16") or a code itself ("BF16")."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name in DTYPE_BITS:
        return name
    if name not in CODES:
        raise ValueError(f"no safetensors dtype for {dtype!r}")
    return CODES[name]


def __getattr__(name: str) -> Any:
    """DTYPE_NAMES (torch dtype -> code), made when first asked for: it needs torch."""
    if name == "DTYPE_NAMES":
        import torch  # torch: parity.neutral.converter imports this module

        return {getattr(torch, n): code for n, code in CODES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    dtype: Any  # a torch dtype, its name or its safetensors code

    @property
    def nbytes(self) -> int:
        n = DTYPE_BITS[dtype_code(self.dtype)] // 8
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


@dataclass
class Pieces:
    """A tensor's bytes as they are read, a piece at a time, for one written exactly as it is stored (it needs no
    buffer of its size). A piece is valid until the next is asked for: its reader reuses the buffer once what
    was fed to their shared Hashing by then is done (``Hashing.fence``), so the writer must write on it too.
    ``digest``: the reader's hash of these bytes, which the writer then need not compute again."""

    shape: tuple[int, ...]
    dtype: Any  # as PlannedTensor's
    pieces: Iterable[memoryview]
    digest: ContentHash | None = None


class ShardWriter:
    """Writes one planned shard; ``write`` must be called in plan order. Hashes (``HASH``) as it goes, on
    ``hashing``'s threads (one of its own if none is given), and writes on its writing thread if it has one."""

    def __init__(self, shard: Shard, metadata: dict[str, str] | None = None, hashing: Hashing | None = None):
        self.shard = shard
        self.expected = iter(shard.tensors)
        self._own = hashing is None
        self._hashing = Hashing() if hashing is None else hashing
        self.parts = Parts()
        self._writes: deque[Future] = deque()  # on the writing thread, not yet seen to finish
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for t in shard.tensors:
            header[t.name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        head = struct.pack("<Q", len(raw)) + raw
        self.parts.add(blake3.blake3(head).digest())
        self.file = open(shard.path, "wb", buffering=0)
        self._put(memoryview(head))  # bytes: nothing reuses them

    def _put(self, data: memoryview) -> None:
        """Write ``data`` (on the writing thread, if there is one)."""
        if not self._hashing.writes:
            self._write(data)
            return
        while self._writes and self._writes[0].done():
            self._writes.popleft().result()  # a failed write raises here
        self._writes.append(self._hashing.write(self._write, data))

    def _drain(self) -> None:
        """Wait for the writes handed to the writing thread."""
        while self._writes:
            self._writes.popleft().result()

    def _write(self, data: memoryview) -> None:
        """Write ``data``, WRITE_CHUNK bytes per call (perhaps on the writing thread: an error names the file,
        wherever it is raised)."""
        write = self.file.write
        try:
            for start in range(0, len(data), WRITE_CHUNK):
                piece = data[start:start + WRITE_CHUNK]
                done = write(piece)
                while done < len(piece):  # a raw write may be short
                    done += write(piece[done:])
        except OSError as exc:
            raise ParityError(f"{self.shard.path}: cannot be written ({exc.strerror or exc})") from None

    def _part(self) -> ContentHash:
        """A hash for the next tensor's bytes (the next part: one per part added so far, the header first)."""
        return self._hashing.part(len(self.parts.digests))

    def write(self, name: str, tensor: torch.Tensor | Pieces) -> None:
        planned = next(self.expected)
        if (planned.name, planned.shape, dtype_code(planned.dtype)) != (name, tuple(tensor.shape),
                                                                        dtype_code(tensor.dtype)):
            raise RuntimeError(f"shard writer: got {name} {tuple(tensor.shape)} {tensor.dtype}, planned "
                               f"{planned.name} {planned.shape} {planned.dtype}")
        if isinstance(tensor, Pieces):  # the reader waits for the writes before it reuses a piece's buffer
            part = tensor.digest or self._part()
            total = 0
            for piece in tensor.pieces:
                if tensor.digest is None:
                    part.update(piece)
                self._put(piece)
                total += len(piece)
            if total != planned.nbytes:
                raise RuntimeError(f"shard writer: {name} came as {total} bytes, planned {planned.nbytes}")
            self.parts.add(part.finish())
            return
        import torch  # torch: parity.neutral.converter imports this module (a tensor was given: it is loaded)

        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        part = self._part()
        part.update(memoryview(flat.numpy()))
        self._put(memoryview(flat.numpy()))
        self.parts.add(part.finish())
        part.wait()  # the caller may reuse the tensor's memory once write returns
        self._drain()

    def close(self) -> str:
        """Finish the file; returns its hash (``HASH``, hex)."""
        leftover = next(self.expected, None)
        try:
            self._drain()
        finally:
            self.file.close()
        try:
            digest = self.parts.hexdigest()
        finally:
            if self._own:
                self._hashing.close()
        if leftover is not None:
            raise RuntimeError(f"shard writer: {leftover.name} was planned but never written")
        return digest


class Hashing:
    """Threads on which hashes run, in the order they are fed, while the caller reads (blake3 and hashlib, and
    writes, release the GIL): one per lane (the parts of a file are hashed on the lanes in turn, so that two
    take a core each where there are several); with ``writes``, one more on which ShardWriters write, in order.
    One for all of a conversion's work, so that ``fence`` tells when everything fed so far is done: a buffer
    fed to it before may then be reused."""

    def __init__(self, writes: bool = False, lanes: int = 1) -> None:
        self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"parity-hash{k}") for k in range(lanes)]
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity-write") if writes else None
        self._last: list[Future | None] = [None] * lanes  # per lane, the latest hash submitted
        self._last_write: Future | None = None

    @property
    def writes(self) -> bool:
        return self._writer is not None

    def part(self, k: int) -> ContentHash:
        """A hash for part ``k`` of a file (HASH's parts: its header is 0, then each tensor), on the lanes in turn."""
        return ContentHash("blake3", self, lane=k % len(self._pools))

    def submit(self, fn: Callable, data, lane: int = 0) -> Future:
        """Run ``fn(data)`` on ``lane``'s thread (the last lane if there are fewer)."""
        lane = min(lane, len(self._pools) - 1)
        self._last[lane] = self._pools[lane].submit(fn, data)
        return self._last[lane]

    def write(self, fn: Callable, data) -> Future:
        """Run ``fn(data)`` on the writing thread (``writes`` only)."""
        self._last_write = self._writer.submit(fn, data)
        return self._last_write

    def fence(self) -> tuple[Future, ...]:
        """The latest hash of each lane and the latest write: once all are done, so is everything fed before."""
        return tuple(f for f in (*self._last, self._last_write) if f is not None)

    def close(self) -> None:
        """End the threads (after an error too: what is queued is dropped; closing twice is harmless)."""
        for pool in (*self._pools, self._writer):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Hashing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ContentHash:
    """A hash (``algorithm``, one of HASHES) computed on ``hashing``'s thread (one of its own if none is given), in
    the order it is fed. What ``update`` is given must stay unchanged until ``wait`` (or ``hexdigest``) returns."""

    def __init__(self, algorithm: str = "blake3", hashing: Hashing | None = None, lane: int = 0) -> None:
        self.algorithm = algorithm
        self._lane = lane
        self._hash = HASHES[algorithm]()
        self._own = hashing is None
        self._hashing = Hashing() if hashing is None else hashing
        self._pending: deque[Future] = deque()
        self._digest: Future | None = None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()
        self._pending.append(self._hashing.submit(self._hash.update, data, self._lane))

    def finish(self) -> Future:
        """The digest (bytes) once what was fed is hashed, as a Future: nothing waits for it here. Feed nothing
        after; asking again gives the same Future."""
        if self._digest is None:
            earlier = list(self._pending)

            def digest(_) -> bytes:
                for update in earlier:  # done: one lane runs in order. A failed update fails the digest
                    update.result()
                return self._hash.digest()

            self._digest = self._hashing.submit(digest, None, self._lane)
            self._pending.append(self._digest)
        return self._digest

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        try:
            self.wait()
        finally:
            self.close()
        return self._hash.hexdigest()

    def close(self) -> None:
        """Drop what was fed and not yet hashed, and end the thread if it is this hash's own (after an error;
        closing twice is harmless). Errors of what it drops are not raised again."""
        for future in self._pending:
            future.cancel()
        futures.wait(self._pending)
        self._pending.clear()
        if self._own:
            self._hashing.close()


class Parts:
    """A file's HASH, from the digests of its parts in file order: bytes, or Futures of them (ContentHash.finish)."""

    def __init__(self) -> None:
        self.digests: list[bytes | Future] = []

    def add(self, digest: bytes | Future) -> None:
        self.digests.append(digest)

    def hexdigest(self) -> str:
        joined = b"".join(d if isinstance(d, bytes) else d.result() for d in self.digests)
        return blake3.blake3(joined).hexdigest()


def hash_file(path: Path, algorithm: str = HASH, chunk: int = 1 << 24) -> str:
    """A file's hash (hex, ``algorithm`` one of ALGORITHMS), read ``chunk`` bytes at a time; HASH reads its
    header first (``read_header``: it must be a readable safetensors file)."""
    buffer = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        if algorithm != HASH:
            h = HASHES[algorithm]() if algorithm == "sha256" else blake3.blake3(max_threads=blake3.blake3.AUTO)
            while n := f.readinto(buffer):
                h.update(buffer[:n])
            return h.hexdigest()
        header = read_header(path)
        parts = [header.data_start] + [header.tensors[n].end - header.tensors[n].begin for n in file_order(header)]
        digests = []
        for size in parts:
            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
            while size and (n := f.readinto(buffer[:min(chunk, size)])):
                h.update(buffer[:n])
                size -= n
            if size:
                raise ParityError(f"{path}: shorter than its header says; it changed while it was read")
            digests.append(h.digest())
    return blake3.blake3(b"".join(digests)).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """A file's sha256 (goldens record it; manifests written before BLAKE3 did)."""
    return hash_file(path, "sha256", chunk)
