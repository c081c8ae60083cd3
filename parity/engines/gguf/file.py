"""Opening a GGUF file safely: its header walked and checked before gguf-py's reader sees it.

gguf-py's ``GGUFReader`` trusts every count, length and offset in the header: a truncated or garbled file ends in
numpy's or enum's own words (``When changing to a larger dtype...``, ``index 0 is out of bounds``, ``4294967295 is
not a valid GGUFValueType``). ``read_header`` walks the header once with each count, length, type and offset checked
against the file's size and gguf-py's tables, and refuses what is wrong with one line naming the file, the problem
and the fix (exit code 2); ``open_gguf`` hands gguf-py only a file that passed it. Only the header is read; no tensor
is dequantized or even touched.

Layout (GGUF v2/v3, gguf-py's gguf_reader.py): magic "GGUF", uint32 version, uint64 tensor count, uint64 key
count; the keys (string key, uint32 value type, value); the tensor infos (string name, uint32 dimension count,
uint64 dimensions, uint32 GGML type, uint64 offset into the data); padding to the alignment; the data. A string
is a uint64 length and its bytes; an array a uint32 item type, a uint64 length and its items.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.adapter import load_all
from parity.errors import ParityError

FIX = "re-download it, or convert it again (parity convert --to gguf, or llama.cpp's convert_hf_to_gguf.py)"
VERSIONS = (2, 3)                    # what gguf-py's reader handles (READER_SUPPORTED_VERSIONS)
MAX_DIMS = 4                         # GGML_MAX_DIMS: llama.cpp refuses a tensor with more
MAX_NESTING = 8                      # arrays of arrays: gguf-py recurses; a garbled file must not recurse forever
ALIGNMENT = 32                       # GGUF_DEFAULT_ALIGNMENT, unless general.alignment says otherwise
# GGUFValueType -> struct format of a scalar (8: string, 9: array are read by hand)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY, UINT32 = 8, 9, 4
# the fewest bytes one key (8-byte length, 4-byte type, a 1-byte value) and one tensor info take (8-byte name
# length, 4-byte dimension count, 4-byte type, 8-byte offset): a count beyond size / these cannot be true
MIN_KEY_BYTES, MIN_TENSOR_BYTES = 13, 24


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int
    shape: tuple[int, ...]   # GGML order: the fastest-varying dimension first
    offset: int              # into the data region
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A checked GGUF header: its version, its scalar and string metadata (arrays skipped), its tensors, and where
    the data region starts."""

    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    size: int


def refusal(path: Path, problem: str) -> ParityError:
    """The one line that refuses a malformed GGUF file: the file, what is wrong, the fix."""
    return ParityError(f"{path}: not a readable GGUF file ({problem}); {FIX}")


class _Cursor:
    """Reads the header front to back; every read checks that its bytes are in the file."""

    def __init__(self, buf, order: str, path: Path):
        self.buf, self.order, self.path, self.at = buf, order, path, 0

    def refuse(self, problem: str) -> ParityError:
        return refusal(self.path, problem)

    def left(self) -> int:
        return len(self.buf) - self.at

    def take(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        if n > self.left():
            raise self.refuse(f"truncated inside its header: the file ends at byte {len(self.buf):,}, while "
                              f"reading {what}")
        value = struct.unpack_from(self.order + fmt, self.buf, self.at)[0]
        self.at += n
        return value

    def string(self, what: str) -> bytes:
        n = self.take("Q", what)
        if n > self.left():
            raise self.refuse(f"{what} is a string of {n:,} bytes, longer than the {self.left():,} bytes left in "
                              f"the file: truncated or garbled")
        raw = bytes(self.buf[self.at:self.at + n])
        self.at += n
        return raw

    def text(self, what: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} is not UTF-8 ({raw[:24]!r})") from None


def read_header(path: Path) -> Header:
    """Walk and check the header of the GGUF file ``path`` (see the module's docstring for what is refused)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:  # magic, version and the two counts; mmap cannot map an empty file
                raise refusal(path, f"truncated: {size} bytes, shorter than the 24-byte GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(path, buf, size)
    except ParityError:
        raise
    except FileNotFoundError:
        raise refusal(path, "no such file") from None
    except OSError as exc:
        raise refusal(path, f"cannot be read: {exc.strerror or exc}") from None


def _walk(path: Path, buf, size: int) -> Header:
    if bytes(buf[:4]) != b"GGUF":
        raise refusal(path, f"its first bytes are {bytes(buf[:4])!r}, not the magic b'GGUF'")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # as gguf-py decides: a file written on a machine of the other byte order
        order, (version,) = ">", struct.unpack_from(">I", buf, 4)
    if version not in VERSIONS:
        raise ParityError(f"{path}: GGUF version {version}; parity reads versions {VERSIONS[0]} and {VERSIONS[1]} "
                          f"(gguf-py): a damaged file, or one written by another tool; convert it again with "
                          f"parity convert --to gguf or a current llama.cpp (convert_hf_to_gguf.py)")
    cur = _Cursor(buf, order, path)
    cur.at = 8
    n_tensors, n_keys = cur.take("Q", "the tensor count"), cur.take("Q", "the metadata key count")
    if n_keys * MIN_KEY_BYTES > cur.left():
        raise cur.refuse(f"its header claims {n_keys:,} metadata keys, which cannot fit in its {size:,} bytes")
    if n_tensors * MIN_TENSOR_BYTES > cur.left():
        raise cur.refuse(f"its header claims {n_tensors:,} tensors, which cannot fit in its {size:,} bytes")
    metadata = _metadata(cur, n_keys)
    tensors = _tensor_infos(cur, n_tensors, size)
    alignment = _alignment(metadata, cur)
    data_start = -(-cur.at // alignment) * alignment
    for t in tensors:
        if t.offset % alignment:
            raise cur.refuse(f"tensor {t.name!r} starts at data offset {t.offset:,}, not a multiple of the file's "
                             f"alignment {alignment}")
    last = max(tensors, key=lambda t: t.offset + t.nbytes, default=None)
    if last is not None and data_start + last.offset + last.nbytes > size:
        raise cur.refuse(f"truncated: tensor {last.name!r} ends at byte {data_start + last.offset + last.nbytes:,} "
                         f"but the file holds {size:,}")
    return Header(version, {k: v for k, (_, v) in metadata.items()}, tuple(tensors), data_start, size)


def _metadata(cur: _Cursor, count: int) -> dict[str, tuple[int, Any]]:
    """key -> (value type, value) for every key; arrays are checked and skipped (value None)."""
    out: dict[str, tuple[int, Any]] = {}
    for k in range(count):
        key = cur.text(f"the name of metadata key {k}")
        if key in out:
            raise cur.refuse(f"metadata key {key!r} appears twice")
        kind = cur.take("I", f"the value type of metadata key {key!r}")
        out[key] = (kind, _value(cur, kind, f"metadata key {key!r}", 0))
    return out


def _value(cur: _Cursor, kind: int, what: str, depth: int) -> Any:
    """Read (a scalar, a string) or skip (an array) one value of GGUF value type ``kind``."""
    if kind in SCALARS:
        return cur.take(SCALARS[kind], what)
    if kind == STRING:
        return cur.string(what).decode("utf-8", errors="replace")
    if kind != ARRAY:
        raise cur.refuse(f"{what} has value type {kind}, not one of GGUF's value types 0-12: garbled")
    if depth >= MAX_NESTING:
        raise cur.refuse(f"{what} nests arrays more than {MAX_NESTING} deep: garbled")
    item = cur.take("I", f"the item type of {what}")
    n = cur.take("Q", f"the length of {what}")
    if item not in SCALARS and item not in (STRING, ARRAY):
        raise cur.refuse(f"{what} is an array of value type {item}, not one of GGUF's value types 0-12: garbled")
    least = struct.calcsize(SCALARS[item]) if item in SCALARS else 8 if item == STRING else 12
    if n * least > cur.left():
        raise cur.refuse(f"{what} is an array of {n:,} items, more than the {cur.left():,} bytes left in the file "
                         f"can hold: truncated or garbled")
    if item in SCALARS:  # fixed-size items: skipped in one step, however many
        cur.at += n * least
        return None
    if item == STRING:  # a vocabulary's tokens and merges: hundreds of thousands, skipped in a tight loop
        _skip_strings(cur, n, what)
        return None
    for k in range(n):
        _value(cur, item, f"item {k} of {what}", depth + 1)
    return None


def _skip_strings(cur: _Cursor, n: int, what: str) -> None:
    buf, at, end, fmt = cur.buf, cur.at, len(cur.buf), cur.order + "Q"
    for k in range(n):
        if at + 8 > end:
            raise cur.refuse(f"truncated inside its header: the file ends at byte {end:,}, while reading item "
                             f"{k} of {what}")
        at += 8 + struct.unpack_from(fmt, buf, at)[0]
        if at > end:
            raise cur.refuse(f"item {k} of {what} is a string running past the end of the file at byte {end:,}: "
                             f"truncated or garbled")
    cur.at = at


def _tensor_infos(cur: _Cursor, count: int, size: int) -> list[TensorInfo]:
    gguf = _gguf()
    sizes = gguf.GGML_QUANT_SIZES  # type -> (block size, bytes per block)
    known = {int(t): t for t in gguf.GGMLQuantizationType}
    infos: list[TensorInfo] = []
    names: set[str] = set()
    for k in range(count):
        name = cur.text(f"the name of tensor {k}")
        if name in names:
            raise cur.refuse(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = cur.take("I", f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise cur.refuse(f"tensor {name!r} has {n_dims:,} dimensions; GGML tensors have at most {MAX_DIMS}")
        shape = tuple(cur.take("Q", f"the shape of tensor {name!r}") for _ in range(n_dims))
        kind = cur.take("I", f"the type of tensor {name!r}")
        offset = cur.take("Q", f"the data offset of tensor {name!r}")
        if kind not in known or known[kind] not in sizes:
            raise ParityError(f"{cur.path}: tensor {name!r} has GGML type {kind}, which this gguf-py does not know: "
                              f"a type newer than this gguf-py (pip install -U gguf), or a damaged file (re-download "
                              f"it, or convert it again)")
        block, type_size = sizes[known[kind]]
        if shape and shape[0] % block:
            raise cur.refuse(f"tensor {name!r} of type {known[kind].name} has a first dimension of {shape[0]:,}, "
                             f"not a multiple of the type's block of {block}")
        elements = 1
        for d in shape:
            elements *= d
        nbytes = elements * type_size // block
        if nbytes > size:
            raise cur.refuse(f"tensor {name!r} ({known[kind].name} {list(shape)}) needs {nbytes:,} bytes, more than "
                             f"the file's {size:,}: a garbled shape")
        infos.append(TensorInfo(name, kind, shape, offset, nbytes))
    return infos


def _alignment(metadata: dict[str, tuple[int, Any]], cur: _Cursor) -> int:
    if "general.alignment" not in metadata:
        return ALIGNMENT
    kind, value = metadata["general.alignment"]
    if kind != UINT32 or value == 0 or value & (value - 1):
        raise cur.refuse(f"general.alignment must be a power of two stored as uint32, not {value!r} (type {kind})")
    return value


def _gguf():
    """gguf-py, whose tables say which tensor types exist (and whose reader open_gguf returns)."""
    try:
        import gguf  # optional: gguf
    except ImportError:
        raise ParityError("reading a GGUF file needs gguf-py: pip install 'parity[llama]' (or pip install gguf)") \
            from None
    return gguf


def ggml_types() -> dict[int, str]:
    """GGML's tensor types, number -> gguf-py's name (12 -> "Q4_K")."""
    return {int(t): t.name for t in _gguf().GGMLQuantizationType}


def file_type(header: Header) -> str | None:
    """llama.cpp's name of the file's mix, as its general.file_type states it (15 -> "Q4_K_M", 0 -> "F32"); None
    where the key is absent or names no type this gguf-py knows."""
    value = header.metadata.get("general.file_type")
    known = {int(t): t.name for t in _gguf().LlamaFileType if t.name.startswith(("MOSTLY_", "ALL_"))}
    if not isinstance(value, int) or value not in known:
        return None
    return known[value].removeprefix("MOSTLY_").removeprefix("ALL_")


def header_types(path: Path) -> dict[str, tuple[str, int, int]]:
    """{tensor name: (GGML type, row length, dimensions)} as the file's header states them, checked."""
    names = ggml_types()
    return {t.name: (names[t.type], t.shape[0], len(t.shape)) for t in read_header(path).tensors}


def open_gguf(path: Path):
    """gguf-py's ``GGUFReader`` on ``path``, once its header has been checked (``read_header``): a malformed file is
    refused with one line (ParityError) before gguf-py reads it."""
    read_header(Path(path))
    try:
        return _gguf().GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the checks above should leave nothing; this keeps any left to one line
        said = " ".join(str(exc).split())[:160]
        raise refusal(Path(path), f"gguf-py: {type(exc).__name__}: {said}") from None


def validate(path: Path, adapter_dirs=()) -> None:
    """Refuse a GGUF candidate parity cannot check, before anything runs: a malformed file (``read_header``), or one
    whose general.architecture no adapter's ``[gguf] arch`` names. The header walk alone: it checks all that
    gguf-py's reader would trip on, in a fraction of its time (which grows with the vocabulary)."""
    arch = read_header(Path(path)).metadata.get("general.architecture")
    known = sorted({a.spec.gguf.arch for a in load_all(adapter_dirs).values() if a.spec.gguf is not None})
    if not isinstance(arch, str):
        raise ParityError(f"{path}: the GGUF file has no general.architecture string, which llama.cpp needs to run it; "
                          f"{FIX}")
    if arch not in known:
        raise ParityError(f"{path}: a llama.cpp {arch[:40]!r} model, an architecture no adapter covers (the adapters' "
                          f"[gguf] arch: {', '.join(known)}); check a file of one of those, or add its family's "
                          f"adapter with a [gguf] section")
