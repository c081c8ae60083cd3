"""Dumps from tensor-parallel runs: one dump per rank in a directory, merged by a declared shard layout.

    dump-dir/rank0.safetensors, rank1.safetensors, ..., rank{N-1}.safetensors
    parity check --reference golden/llama --candidate dump-dir --layerwise

Each rank file is an ordinary dump (parity.dumps: points by name, ``input_ids``, optional decode steps) whose
metadata adds:

    tp_rank    its rank, "0" .. tp_size - 1, the number in its file name
    tp_size    the number of ranks, the same in every file
    tp_layout  JSON object, point -> shard (the same in every file); a point it omits is "replicated":
               "replicated"  every rank holds the whole tensor (they must agree: rel_l2 <= REPLICA_TOLERANCE)
               "column"      each rank holds a slice of the last dimension, in rank order: concatenated
               "row"         each rank holds a partial sum of the whole tensor (before its all-reduce): added

A decode point ``decode.{point}`` takes ``{point}``'s shard unless the layout names it. The merged dump is checked
exactly like one file; points are merged one at a time while the check reads them (a rank's shards are read,
merged and dropped), so no rank's whole dump is held in memory.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from parity.dumps import DECODE, DECODE_TOKENS, FIX, INPUT_IDS, parse_ids
from parity.errors import ParityError
from parity.storage.jsonfile import NOT_JSON
from parity.storage.shards import Header, HeaderEntry, read_header

RANK_FILE = re.compile(r"rank(0|[1-9][0-9]*)\.safetensors")
TP_RANK, TP_SIZE, TP_LAYOUT = "tp_rank", "tp_size", "tp_layout"
SHARDS = ("replicated", "column", "row")
REPLICA_TOLERANCE = 1e-3   # rel_l2 between a replicated point's ranks: equal up to a reduction's rounding
LAYOUT_FIX = "see docs/dumps.md, 'Tensor-parallel runs'"


def is_rank_dir(path: Path) -> bool:
    """A directory of rank dumps (``rank{r}.safetensors``), and neither a checkpoint nor a golden."""
    path = Path(path)
    if not path.is_dir() or (path / "config.json").exists() or (path / "golden.json").exists():
        return False
    return any(RANK_FILE.fullmatch(p.name) for p in path.iterdir())


def _int(raw: str | None, key: str, file: str, prefix: str) -> int:
    if raw is None or not raw.isdigit():
        raise ParityError(f"{prefix}: {file} has {'no ' + repr(key) if raw is None else f'{key} {raw!r}'} in its "
                          f"metadata; each rank's dump stores its rank and the rank count as integers ({LAYOUT_FIX})")
    return int(raw)


def _layout(raw: str | None, file: str, prefix: str) -> dict[str, str]:
    try:
        layout = {} if raw is None else json.loads(raw)
    except NOT_JSON:
        layout = None
    if not isinstance(layout, dict) or any(v not in SHARDS for v in layout.values()):
        raise ParityError(f"{prefix}: {file}'s {TP_LAYOUT!r} must be a JSON object of point -> one of "
                          f"{', '.join(SHARDS)}, not {str(raw)[:60]!r} ({LAYOUT_FIX})")
    return layout


class RankDumps:
    """The ranks of one tensor-parallel run, checked against each other, read as one dump: ``header`` holds the
    merged shapes and rank 0's metadata; ``open()`` gives ``get_tensor(name)``, merged."""

    def __init__(self, path: Path):
        self.path = Path(path)
        prefix = self.prefix = f"--candidate {self.path}"
        files = {int(m[1]): p for p in sorted(self.path.iterdir()) if (m := RANK_FILE.fullmatch(p.name))}
        headers = {r: read_header(p, FIX) for r, p in sorted(files.items())}
        sizes = {r: _int(h.metadata.get(TP_SIZE), TP_SIZE, files[r].name, prefix) for r, h in headers.items()}
        if len(set(sizes.values())) > 1:
            said = ", ".join(f"rank{r} says {s}" for r, s in sizes.items())
            raise ParityError(f"{prefix}: the ranks disagree on {TP_SIZE} ({said}); write every rank of one run")
        size = next(iter(sizes.values()))
        for r, h in headers.items():
            if _int(h.metadata.get(TP_RANK), TP_RANK, files[r].name, prefix) != r:
                raise ParityError(f"{prefix}: {files[r].name} says {TP_RANK} {h.metadata[TP_RANK]}; a rank's file is "
                                  f"named by its rank ({LAYOUT_FIX})")
        missing = [f"rank{r}.safetensors" for r in range(size) if r not in files]
        extra = [files[r].name for r in files if r >= size]
        if missing or extra or size == 0:
            problem = f"missing {', '.join(missing)}" if missing else f"{', '.join(extra)} beyond it"
            raise ParityError(f"{prefix}: {TP_SIZE} is {size} but {problem if size else 'no rank can run'}; the "
                              f"directory holds one dump per rank, rank0.safetensors .. rank{size - 1}.safetensors")
        self.files = [files[r] for r in range(size)]
        self._agree(headers)
        self.layout = _layout(headers[0].metadata.get(TP_LAYOUT), self.files[0].name, prefix)
        self.header = Header(self._merged(headers), dict(headers[0].metadata), 0)

    def _agree(self, headers: dict[int, Header]) -> None:
        """Every rank ran the same ids, was fed the same decode tokens, declares one layout and holds one point set."""
        first = headers[0].metadata
        for r, h in headers.items():
            for key in (INPUT_IDS, DECODE_TOKENS, TP_LAYOUT):
                mine, theirs = h.metadata.get(key), first.get(key)
                if key != TP_LAYOUT and mine is not None and theirs is not None:
                    same = parse_ids(mine, self.files[r]) == parse_ids(theirs, self.files[0])
                else:
                    same = mine == theirs or (key == TP_LAYOUT and _layout(mine, self.files[r].name, self.prefix)
                                              == _layout(theirs, self.files[0].name, self.prefix))
                if not same:
                    raise ParityError(f"{self.prefix}: rank{r}.safetensors and rank0.safetensors differ in their "
                                      f"{key!r} metadata; every rank of one run stores the same")
            lacks = sorted(set(headers[0].tensors) ^ set(h.tensors))
            if lacks:
                raise ParityError(f"{self.prefix}: rank{r}.safetensors and rank0.safetensors hold different points "
                                  f"({', '.join(lacks[:4])}); every rank dumps the same points")

    def shard(self, name: str) -> str:
        """How a tensor is split over the ranks: its layout entry, a decode point its point's, else replicated."""
        point = name[len(DECODE):] if name.startswith(DECODE) else name
        return self.layout.get(name, self.layout.get(point, "replicated"))

    def _merged(self, headers: dict[int, Header]) -> dict[str, HeaderEntry]:
        """Each point's entry as one tensor: its dtype and merged shape, after checking the ranks' shards fit."""
        unknown = [k for k in self.layout if k not in headers[0].tensors]
        if unknown:
            raise ParityError(f"{self.prefix}: {TP_LAYOUT!r} names {', '.join(unknown[:4])}, which no rank holds; "
                              f"name the dumped points")
        merged, self.widths = {}, {}
        for name, entry in headers[0].tensors.items():
            shard, shapes = self.shard(name), [headers[r].tensors[name].shape for r in range(len(self.files))]
            dtypes = {headers[r].tensors[name].dtype for r in range(len(self.files))}
            fits = (all(s[:-1] == shapes[0][:-1] and len(s) >= 1 for s in shapes) if shard == "column"
                    else len(set(shapes)) == 1)
            if len(dtypes) > 1 or not fits:
                rule = ("equal but for the last dimension" if shard == "column" else "the whole tensor's shape")
                held = ", ".join(f"rank{r} {list(s)}" for r, s in enumerate(shapes))
                raise ParityError(f"{self.prefix}: {name} is declared {shard}, so each rank's shard is {rule} and of "
                                  f"one dtype; the ranks hold {held} ({', '.join(sorted(dtypes))})")
            shape = shapes[0][:-1] + (sum(s[-1] for s in shapes),) if shard == "column" else shapes[0]
            merged[name] = HeaderEntry(entry.dtype, tuple(shape), 0, 0)
            self.widths[name] = [s[-1] for s in shapes] if shard == "column" else []
        return merged

    def note(self, name: str) -> str:
        """Where a merged point's shape came from, for a shape error."""
        widths = self.widths.get(name)
        return f" (merged from {len(widths)} column shards, widths {'+'.join(map(str, widths))})" if widths else ""

    @contextmanager
    def open(self):
        with ExitStack() as stack:
            handles = [stack.enter_context(safe_open(f, framework="pt")) for f in self.files]
            yield _Merger(self, handles)


class _Merger:
    """Reads one point from every rank and merges it, holding at most the merged tensor and one shard."""

    def __init__(self, dumps: RankDumps, handles):
        self.dumps, self.handles = dumps, handles

    def get_tensor(self, name: str) -> torch.Tensor:
        shard, handles = self.dumps.shard(name), self.handles
        first = handles[0].get_tensor(name)
        if shard == "column":
            out = torch.empty(self.dumps.header.tensors[name].shape, dtype=first.dtype)
            start = 0
            for r, handle in enumerate(handles):
                part = first if r == 0 else handle.get_tensor(name)
                out[..., start:start + part.shape[-1]] = part
                start += part.shape[-1]
                first = part = None  # one shard at a time beside the merged tensor
            return out
        if shard == "row":  # partial sums, added in at least float32 as an all-reduce would
            total = first.to(torch.promote_types(first.dtype, torch.float32))
            for handle in handles[1:]:
                total += handle.get_tensor(name)
            return total.to(first.dtype)
        reference = first.double()
        scale = max(reference.norm().item(), 1e-30)
        for r, handle in enumerate(handles[1:], start=1):
            rel = (handle.get_tensor(name).double() - reference).norm().item() / scale
            if not rel <= REPLICA_TOLERANCE:
                raise ParityError(f"{self.dumps.prefix}: {name} is declared replicated but rank{r} differs from "
                                  f"rank0 (rel_l2 {rel:.2e} > {REPLICA_TOLERANCE:g}); declare its shard (column or "
                                  f"row) in {TP_LAYOUT!r}, or fix the rank")
        return first
