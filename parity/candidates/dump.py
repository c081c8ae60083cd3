"""Engine dumps: a safetensors file of capture points an engine wrote, or a directory of a tensor-parallel run's
rank dumps merged by their declared shard layout (docs/dumps.md; the format is parity.dumps, the merge
parity.dumps.tensor_parallel)."""

from __future__ import annotations

from pathlib import Path

from parity.dumps import FileDump, dump_decoder, dump_runner, ids_mistake, is_dump
from parity.dumps.tensor_parallel import RankDumps, is_rank_dir

KIND = "dump"
TAKES = "an engine dump (.safetensors, or a directory of rank*.safetensors)"
GENERIC = True      # reads points by module path or name: checks a model no adapter knows


def detect(path: Path) -> bool:
    return is_dump(path) or is_rank_dir(path)


def _dump(path: Path):
    return RankDumps(Path(path)) if Path(path).is_dir() else FileDump(path)


def make_runner(candidate, ids, feed):
    return dump_runner(candidate, ids, feed, _dump(candidate.path))


def make_decoder(candidate, ids, tokens):
    return dump_decoder(candidate, ids, tokens, _dump(candidate.path))


def check_ids(path, ids, ckpt):
    return ids_mistake(Path(path), ids, ckpt, _dump(path))
