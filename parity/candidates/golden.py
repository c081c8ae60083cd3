"""Goldens as candidates: the activations a reference produced once (parity.reference.golden), judged against a
reference like any engine's output, so a golden stands on either side of a check. Against the live checkpoint it was
recorded from, this is drift seen from the other side (``parity golden verify`` puts the golden on the reference
side, with its recorded noise); against another checkpoint (a re-save, a merge, a newer transformers' save), it
says whether that checkpoint still computes what the golden holds."""

from __future__ import annotations

from pathlib import Path

import torch

from parity.errors import ParityError
from parity.reference.golden import is_golden, open_golden

KIND = "golden"
TAKES = "a golden (golden.json)"
GENERIC = True      # reads points by module path or name: checks a model no adapter knows


def detect(path: Path) -> bool:
    return is_golden(Path(path))


def validate(path: Path, adapter_dirs=()) -> None:
    open_golden(Path(path), adapter_dirs)  # its description, config and every run's files, checked now


def _run_of(golden, ids: torch.Tensor) -> int:
    """The golden's run recorded on these ids: a golden holds what it was run on, nothing else."""
    row = ids[0].tolist()
    k = next((k for k, run in enumerate(golden.runs) if run.ids == row), None)
    if k is None:
        held = "; ".join(f"{len(r.ids)} tokens ({r.source})" for r in golden.runs)
        raise ParityError(f"--candidate {golden.path}: the golden holds no run on these {len(row)} ids (it holds "
                          f"{held}); check with the inputs it was recorded on (`parity inputs {golden.path} -o "
                          f"inputs.json`, then --inputs inputs.json)")
    return k


def make_runner(candidate, ids: torch.Tensor, feed):
    if feed is not None:
        raise ParityError(f"--candidate {candidate.path}: a golden holds one free run and cannot be fed the "
                          f"reference's layer inputs; drop --isolate")
    golden = open_golden(Path(candidate.path), candidate.models.adapter_dirs)
    return golden.runner(_run_of(golden, ids))


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """The golden's stored decode steps, after checking it was fed these tokens."""
    golden = open_golden(Path(candidate.path), candidate.models.adapter_dirs)
    k = _run_of(golden, ids)
    held = golden.decode_steps(len(tokens), k)
    if held.tokens[:len(tokens)] != tokens:
        raise ParityError(f"--candidate {candidate.path}: the golden was decoded on other tokens than the "
                          f"reference's continuation; record both from one checkpoint")
    return golden.step_runner(k, len(tokens), set(golden.points))
