"""Streaming safetensors writer: the header is planned from shapes, tensors are appended one by one.

safetensors' own ``save_file`` wants every tensor in memory at once; a converter that must stay
near the size of its largest tensor writes the format itself. The format is an 8-byte
little-endian header length, a JSON header (name -> dtype, shape, byte offsets), then raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


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
        self.sha = hashlib.sha256()
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
        self.file.write(data)
        self.sha.update(data)

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
        if leftover is not None:
            raise RuntimeError(f"shard writer: {leftover.name} was planned but never written")
        return self.sha.hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
    return sha.hexdigest()
