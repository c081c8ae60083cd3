"""A check's inputs: the prompt (text, token ids, or a deterministic spread of ids of a given length), checked
against what the model can take and this machine can hold.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from parity.checkpoint import Checkpoint
from parity.checkpoint.lengths import default_length
from parity.errors import ParityError
from parity.storage.jsonfile import read_json


@dataclass
class Inputs:
    ids: torch.Tensor          # [1, S]
    source: str


def make_inputs(ckpt: Checkpoint, *, prompt: str | None = None, ids: list[int] | None = None,
                length: int | None = None) -> Inputs:
    vocab = ckpt.resolved.embedding_shape[0]
    given = [x is not None for x in (prompt, ids, length)]
    if sum(given) > 1:
        raise ParityError("give at most one of --prompt, --ids, --inputs, --length")
    if prompt is not None:
        token_ids = _tokenize(ckpt, prompt)
        source = f"prompt {prompt!r}"
    elif ids is not None:
        token_ids, source = list(ids), "ids"
    else:
        n = default_length(ckpt) if length is None else length
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParityError(f"--length must be at least 1 (got {n}); leave it out for the default prompt")
        check_length(ckpt, n)
        # a deterministic spread of ids, away from the few special tokens at the start of most vocabularies
        token_ids = [3 + (7919 * k + 17) % max(vocab - 3, 1) for k in range(n)]
        source = f"deterministic prompt of {n} tokens"
    bad = [i for i in token_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
    if not token_ids or bad:
        raise ParityError(f"token ids must be integers in [0, {vocab}); got {bad[:5] or 'none'}")
    check_length(ckpt, len(token_ids))
    return Inputs(torch.tensor([token_ids]), source)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def trim_heap() -> None:
    """Hand the heap memory freed so far back to the system: glibc keeps it for reuse, each thread that ran a
    forward in an arena of its own. Nothing where the C library has no malloc_trim."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def check_length(ckpt: Checkpoint, n: int) -> None:
    """Refuse a prompt the model cannot take (past its positions) or this machine cannot hold: eager attention
    materialises [heads, n, n] scores, and a check runs it in float32 (float64 to calibrate)."""
    r = ckpt.resolved
    limit = r["positions.max_positions"]
    if limit and n > limit and r["positions.kind"] != "rope":  # a learned position table has no row past its end
        raise ParityError(f"a prompt of {n} tokens exceeds the model's {limit} learned positions "
                          f"(max_position_embeddings); use --length {limit} or less")
    heads = max(r.layer("attention.heads", i) for i in range(r.num_layers)) if r.num_layers else 1
    need = heads * n * n * 8 * 2  # scores and their softmax, in float64 when calibrating
    available = available_memory()
    if available is not None and need > available:
        raise ParityError(f"a prompt of {n} tokens needs about {need / 2**30:.0f} GiB for eager attention's "
                          f"[{heads}, {n}, {n}] scores and this machine has {available / 2**30:.0f} GiB available; "
                          f"use a shorter --length")


def leading_bos(tokenizer) -> int | None:
    """The token id a ``tokenizers.Tokenizer`` puts before every text (its post-processor's BOS), or None where it
    adds none: what an engine must add itself to run a text as the reference does."""
    plain, full = tokenizer.encode("a", add_special_tokens=False).ids, tokenizer.encode("a").ids
    return full[0] if len(full) == len(plain) + 1 and full[1:] == plain else None


def _tokenize(ckpt: Checkpoint, prompt: str) -> list[int]:
    file = ckpt.path / "tokenizer.json"
    if not file.exists():
        raise ParityError(f"{ckpt.path}: no tokenizer.json to tokenize --prompt; give --ids or --length")
    ids = Tokenizer.from_file(str(file)).encode(prompt).ids
    trim_heap()  # a large vocabulary's tokenizer (Gemma 3's: 262,144 pieces) leaves ~0.1 GB of heap behind it
    return ids


def read_inputs_file(path: Path) -> list[dict]:
    """A JSON list of prompts: strings, or lists of token ids."""
    data = read_json(path, "give a JSON list of prompts (strings or lists of token ids)", where=f"--inputs {path}")
    if not isinstance(data, list) or not data:
        raise ParityError(f"--inputs {path}: expected a non-empty JSON list of strings or id lists")
    out = []
    for k, item in enumerate(data):
        if isinstance(item, str):
            out.append({"prompt": item})
        elif isinstance(item, list) and all(isinstance(i, int) for i in item):
            out.append({"ids": item})
        elif isinstance(item, dict) and isinstance(item.get("ids"), list) and \
                all(isinstance(i, int) for i in item["ids"]):  # {"ids", "decode"}: the decode tokens are for the engine
            out.append({"ids": item["ids"]})
        else:
            raise ParityError(f"--inputs {path}: item {k} is neither a string, a list of token ids, nor "
                              f"{{\"ids\": [...], \"decode\": [...]}}")
    return out


@dataclass(frozen=True)
class Prompts:
    """What a command's --prompt, --ids, --inputs and --length ask for (at most one is usually given; none: the
    default prompt)."""

    prompt: str | None = None
    ids: tuple[int, ...] | None = None
    length: int | None = None
    inputs_file: Path | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.prompt, self.ids, self.length, self.inputs_file))

    def select(self, ckpt: Checkpoint, length: int | None = None) -> list[Inputs]:
        """The inputs for ``ckpt``; ``length`` stands for this object's where it has none."""
        return select_inputs(ckpt, prompt=self.prompt, ids=None if self.ids is None else list(self.ids),
                             length=self.length if self.length is not None else length, inputs_file=self.inputs_file)


def select_inputs(ckpt: Checkpoint, *, prompt: str | None = None, ids: list[int] | None = None,
                  length: int | None = None, inputs_file: Path | None = None) -> list[Inputs]:
    """A check's inputs: each prompt of ``inputs_file``, or the one given (or the default prompt)."""
    prompts = read_inputs_file(inputs_file) if inputs_file else [{"prompt": prompt, "ids": ids, "length": length}]
    return [make_inputs(ckpt, prompt=p.get("prompt"), ids=p.get("ids"), length=p.get("length")) for p in prompts]
