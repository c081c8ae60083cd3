"""Engine dumps: an engine's activations handed to parity as one safetensors file (docs/dumps.md).

    write_dump("dump.safetensors", {"embed": x0, "layers.0.out": x1, "logits": logits}, input_ids=[1, 2, 3])
    parity check --reference golden/llama --candidate dump.safetensors --layerwise

Tensors are named by capture point and shaped [batch, seq, hidden] (logits [batch, seq, vocab]), in any
float dtype; the token ids the engine ran are JSON under the metadata key ``input_ids``. Every point is
optional: those a dump lacks are listed as not compared. A dump whose ids differ from the reference's in
one of the ways ports do (a BOS doubled or dropped, the prompt shifted: parity.dumps.mistakes) fails at the
pseudo-point ``input_ids``, named; any other difference is refused (exit 2): its numbers would be compared
against another input.

Decode steps (``check --decode N``): the tokens the engine was fed one at a time after the prompt, from its own
KV cache, are JSON under ``decode_tokens`` (and their count under ``steps``), and each point's steps are one
stacked tensor ``decode.{point}`` of shape [1, steps, width], step k at index k - 1.

A tensor-parallel run writes one dump per rank into a directory, with its shard layout in each file's metadata:
parity.dumps.tensor_parallel merges them point by point, and the directory is checked like one file.

parity.candidates.dump makes these files (and directories of rank dumps) a candidate kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parity import names
from parity.dumps.mistakes import Found, bos_id, classify
from parity.errors import ParityError
from parity.storage import atomic
from parity.storage.jsonfile import NOT_JSON
from parity.storage.shards import FLOAT_DTYPES, read_header

SUFFIX = ".safetensors"
INPUT_IDS = "input_ids"
DECODE_TOKENS = "decode_tokens"
STEPS = "steps"
DECODE = "decode."  # decode.{point}: a point's decode steps, stacked
FIX = "write it again (docs/dumps.md)"


def _rows(input_ids) -> list[list[int]]:
    """Token ids as one list per batch row: from [S], [[...]] or a tensor of shape [S] or [B, S]."""
    ids = input_ids.tolist() if torch.is_tensor(input_ids) else list(input_ids)
    rows = ids if ids and isinstance(ids[0], (list, tuple)) else [ids]
    return [[int(i) for i in row] for row in rows]


def write_dump(path: Path, points: dict[str, torch.Tensor], input_ids, decode_tokens: list[int] | None = None
               ) -> Path:
    """Write ``points`` (capture-point name -> [batch, seq, ...] float tensor) and the ids the engine ran.

    Args:
        path: the ``.safetensors`` file to write (replaced atomically if it exists).
        points: activations by capture-point name (``embed``, ``layers.0.out``, ``logits``, ...), and with
            ``decode_tokens`` each point's decode steps as ``decode.{point}`` [1, steps, width].
        input_ids: the token ids, as a list, a list of rows, or a tensor of shape [S] or [B, S].
        decode_tokens: the tokens fed one step at a time after the prompt, if the engine decoded.
    Returns:
        ``path``.
    """
    path = Path(path)
    rows = _rows(input_ids)
    if not rows or not rows[0]:
        raise ParityError(f"{path}: no input ids; pass the token ids the engine ran")
    batch, seq = len(rows), len(rows[0])
    steps = len(decode_tokens) if decode_tokens else 0

    def fits(name: str, t: torch.Tensor) -> bool:
        length = steps if name.startswith(DECODE) else seq
        return t.is_floating_point() and t.dim() >= 3 and tuple(t.shape[:2]) == (batch, length) and length > 0

    bad = [f"{name} {list(t.shape)} {t.dtype}" for name, t in points.items() if not fits(name, t)]
    if bad:
        steps_rule = f" (decode.* [batch, steps={steps}, width])" if steps else ""
        raise ParityError(f"{path}: tensors must be float, shaped [batch={batch}, seq={seq}, width]{steps_rule}: "
                          f"{', '.join(bad)}")
    tensors, storages = {}, set()
    for name, t in points.items():
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:  # one tensor at two points (BERT: embed is attn_in)
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    with atomic.output_file(path, force=True, companions=()) as tmp:
        metadata = {INPUT_IDS: json.dumps(rows[0] if batch == 1 else rows)}
        if steps:
            metadata.update({DECODE_TOKENS: json.dumps([int(i) for i in decode_tokens]), STEPS: str(steps)})
        save_file(tensors, str(tmp / path.name), metadata=metadata)
    return path


def parse_ids(raw: str, path: Path) -> list[list[int]]:
    """The ``input_ids`` metadata of a dump: a JSON list of token ids, or a list of equally long rows of them."""
    def refuse(problem: str) -> ParityError:
        return ParityError(f"{path}: metadata {INPUT_IDS!r} {problem}: {raw[:60]!r}; store the token ids the engine "
                           f"ran as a JSON list such as [1, 2, 3] (docs/dumps.md)")

    try:
        ids = json.loads(raw)
    except NOT_JSON:
        raise refuse("is not a JSON list of token ids") from None
    if not isinstance(ids, list) or not ids:
        raise refuse("is not a JSON list of token ids")
    rows = ids if isinstance(ids[0], list) else [ids]
    for row in rows:
        if not isinstance(row, list) or not row:
            raise refuse("mixes ids and rows, or has an empty row")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in row):
            raise refuse("holds something other than integer token ids")
        if any(i < 0 for i in row):
            raise refuse("holds negative token ids")
    if len({len(row) for row in rows}) != 1:
        raise refuse("has rows of different lengths")
    return rows


def read_ids(path: Path) -> list[list[int]]:
    """The ids stored in a dump's metadata, one list per batch row."""
    return _ids_of(FileDump(path))


def _expected(name: str, capture: set[str], num_layers: int) -> bool:
    """A capture point of the model, or a finer point below one (``layers.{i}.<anything>``, ``logits.<x>``)."""
    if name in capture:
        return True
    head, _, rest = name.partition(".")
    if head == "layers":
        index, _, below = rest.partition(".")
        return index.isdigit() and int(index) < num_layers and bool(below)
    return head in capture and bool(rest)


def _widths(ckpt) -> tuple[int, int]:
    """(vocabulary, hidden size) of the reference: its embedding matrix."""
    return ckpt.resolved.embedding_shape


class FileDump:
    """One dump file: its header, and ``open()`` for its tensors (a directory of rank dumps:
    parity.dumps.tensor_parallel's RankDumps, read the same way)."""

    def __init__(self, path: Path):
        self.path, self.header = Path(path), read_header(path, FIX)

    def open(self):
        return safe_open(self.path, framework="pt")

    def note(self, name: str) -> str:
        return ""


def _ids_of(dump) -> list[list[int]]:
    raw = dump.header.metadata.get(INPUT_IDS)
    if raw is None:
        raise ParityError(f"{dump.path}: no {INPUT_IDS!r} in the metadata; store the token ids the engine ran as JSON "
                          f"(docs/dumps.md)")
    return parse_ids(raw, dump.path)


def ids_mistake(path: Path, ids: torch.Tensor, ckpt, dump=None) -> Found | None:
    """The dump's ``input_ids`` against the reference's ``ids``: None where they are the same; the input mistake
    (parity.dumps.mistakes) where it ran them in one of the ways ports do; else ParityError: it ran another input,
    and its numbers would be compared against something else (no verdict)."""
    dump = dump or FileDump(path)
    dumped, expected = _ids_of(dump), _rows(ids)
    if dumped == expected:
        return None
    got, want = dumped[0], expected[0]
    found = classify(got, want, bos_id(ckpt.config)) if len(dumped) == len(expected) == 1 else None
    if found is not None:
        return found
    where = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    raise ParityError(f"--candidate {path}: its input ids differ from the reference's (the dump ran {len(got)} "
                      f"tokens, the reference {len(want)}; first difference at position {where}); run the engine "
                      f"on the ids of `parity inputs REFERENCE -o inputs.json`")


def dump_runner(candidate, ids: torch.Tensor, feed, dump=None):
    """Replays a dump (``dump``, else the file at the candidate's path) as a candidate run: its points, in forward
    order, after checking its ids and shapes."""
    path, ckpt = candidate.path, candidate.ckpt
    if feed is not None:
        raise ParityError(f"--candidate {path}: a dump holds one free run and cannot be fed the reference's layer "
                          f"inputs; drop --isolate")
    dump = dump or FileDump(path)
    header = dump.header
    found = ids_mistake(candidate.path, ids, ckpt, dump)
    if found is not None:  # the check names it before running anything (parity.checker.plan): a direct caller
        raise ParityError(f"--candidate {path}: its input ids differ from the reference's: {found.evidence} "
                          f"({found.bug}); run the engine on the ids of `parity inputs REFERENCE -o inputs.json`")
    expected = _rows(ids)
    capture = {c.name for c in ckpt.resolved.capture}
    decoded = header.metadata.get(DECODE_TOKENS) is not None
    stored = [n for n in header.tensors if not (decoded and n.startswith(DECODE))]  # steps: dump_decoder's
    unknown = [n for n in stored if not _expected(n, capture, ckpt.resolved.num_layers)]
    if unknown:
        raise ParityError(f"--candidate {path}: tensors not named by a capture point of this {ckpt.resolved.family} "
                          f"model: {', '.join(unknown)} (names like embed, layers.0.out, logits; docs/dumps.md)")
    vocab, hidden = _widths(ckpt)
    batch, seq = len(expected), len(expected[0])
    padded = None
    for name in stored:
        entry = header.tensors[name]
        if entry.dtype not in FLOAT_DTYPES:
            raise ParityError(f"--candidate {path}: {name} is {entry.dtype}; activations must be a float dtype "
                              f"({', '.join(FLOAT_DTYPES)})")
        if name not in capture:
            continue  # a finer point: kept as the engine wrote it, never compared
        width = vocab if name == "logits" else hidden
        shape = list(entry.shape)
        fits = len(shape) == 3 and shape[:2] == [batch, seq] and (shape[2] >= width if name == "logits"
                                                                    else shape[2] == width)
        if not fits:
            raise ParityError(f"--candidate {path}: {name} has shape {shape}, expected [batch={batch}, seq={seq}, "
                              f"{'vocab' if name == 'logits' else 'hidden'}={width}] for these ids and this "
                              f"{ckpt.resolved.family} model{dump.note(name)} (docs/dumps.md)")
        if name == "logits" and shape[2] > width:
            padded = shape[2]
    if padded is not None:
        candidate.notes.warn(f"the dump's logits are {padded} wide for a vocabulary of {vocab} (a padded vocabulary): the "
                        f"first {vocab} are compared")
    stored.sort(key=names.point_order)

    def run(emit) -> None:
        with dump.open() as handle:
            for name in stored:
                t = handle.get_tensor(name)
                emit(name, t[..., :vocab] if name == "logits" else t)  # an engine's vocabulary padding is dropped

    return run


def is_dump(path: Path) -> bool:
    return Path(path).suffix == SUFFIX and Path(path).is_file()


def dump_decoder(candidate, ids: torch.Tensor, tokens: list[int], dump=None):
    """Replays a dump's decode steps (``decode.{point}``, stacked) as a candidate's: after checking that the
    engine ran these ids and was fed these tokens, and each stacked tensor's shape."""
    path, ckpt = candidate.path, candidate.ckpt
    dump = dump or FileDump(path)
    header = dump.header
    dump_runner(candidate, ids, None, dump)  # the prompt's ids and points, checked
    raw = header.metadata.get(DECODE_TOKENS)
    if raw is None:
        raise ParityError(f"--candidate {path}: the dump holds no decode steps (no {DECODE_TOKENS!r} metadata); run "
                          f"the engine on `parity inputs REFERENCE --decode {len(tokens)} -o inputs.json`, feeding "
                          f"the decode tokens one at a time (docs/dumps.md)")
    fed = parse_ids(raw, dump.path)[0]
    if header.metadata.get(STEPS) not in (None, str(len(fed))):
        raise ParityError(f"--candidate {path}: metadata {STEPS!r} is {header.metadata[STEPS]!r} for "
                          f"{len(fed)} decode tokens; {FIX}")
    if fed[:len(tokens)] != tokens:
        where = next((k for k, (a, b) in enumerate(zip(fed, tokens)) if a != b), min(len(fed), len(tokens)))
        raise ParityError(f"--candidate {path}: the engine was fed other decode tokens than the reference's ({len(fed)} "
                          f"steps for {len(tokens)}; first difference at step {where + 1}); feed it the tokens of "
                          f"`parity inputs REFERENCE --decode {len(tokens)} -o inputs.json`")
    capture = {c.name for c in ckpt.resolved.capture}
    vocab, hidden = _widths(ckpt)
    stacked = {}
    for key, entry in header.tensors.items():
        if not key.startswith(DECODE):
            continue
        name = key[len(DECODE):]
        if not _expected(name, capture, ckpt.resolved.num_layers):
            raise ParityError(f"--candidate {path}: {key} is not named by a capture point of this "
                              f"{ckpt.resolved.family} model (decode.embed, decode.layers.0.out, ...; docs/dumps.md)")
        if name not in capture:
            continue
        width = vocab if name == "logits" else hidden
        shape = list(entry.shape)
        if entry.dtype not in FLOAT_DTYPES or len(shape) != 3 or shape[:2] != [1, len(fed)] or \
                (shape[2] < width if name == "logits" else shape[2] != width):
            raise ParityError(f"--candidate {path}: {key} is {entry.dtype} {shape}, expected a float tensor of shape "
                              f"[1, steps={len(fed)}, {width}]{dump.note(key)} (docs/dumps.md)")
        stacked[name] = key

    def run(emit) -> None:
        with dump.open() as handle:
            steps = {name: handle.get_tensor(key)[..., :vocab] if name == "logits" else handle.get_tensor(key)
                     for name, key in stacked.items()}
        for step in range(1, len(tokens) + 1):
            for name in sorted(steps, key=names.point_order):
                emit(step, name, steps[name][:, step - 1:step])

    return run


def write_inputs(path: Path, rows: list[list[int]], decode: list[int] | None = None) -> Path:
    """A JSON list of token-id lists: what the engine runs, and what ``parity check --inputs`` reads back. With
    ``decode`` (the tokens to feed one step at a time after the first prompt), the first item is
    ``{"ids": [...], "decode": [...]}``."""
    items = [json.dumps(row) for row in rows]
    if decode:
        items[0] = json.dumps({"ids": rows[0], "decode": decode})
    with atomic.output_file(Path(path), force=True, companions=()) as tmp:
        (tmp / Path(path).name).write_text("[\n" + ",\n".join(items) + "\n]\n")
    return Path(path)
