"""Reference kinds: what a check takes as the truth. A Hugging Face checkpoint run by transformers, or a golden
(parity.golden): the activations transformers produced once, stored, so an engine's CI runs without it.

Both answer the same questions: the checkpoint they stand for (its config and adapter), the report's entry, the
inputs a check may use, the options it can honour, and a run emitting the float32 capture points of input k.
A reference that is ``stored`` also holds each point's calibrated noise and storage rounding; a live one
measures noise by running again at another dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from .checkpoint import Checkpoint, open_checkpoint, refuse_mismatched
from .errors import ParityError
from .inputs import Inputs, select_inputs
from .models import Emit, Models, hf_runner


class TransformersReference:
    """A Hugging Face checkpoint, run by transformers (eager attention, float32) each time it is asked."""

    kind = "transformers"
    stored = False
    points = None  # every capture point of the adapter

    def __init__(self, path: Path, adapter_dirs=()):
        self.path = Path(path)
        self.checkpoint: Checkpoint = open_checkpoint(self.path, adapter_dirs)

    def describe(self) -> dict:
        return {"kind": self.kind, "path": str(self.path)}

    def inputs(self, **asked) -> list[Inputs]:
        return select_inputs(self.checkpoint, **asked)

    def check_options(self, *, checkpoint: Path | None = None, **_) -> None:
        if checkpoint is not None:
            raise ParityError("--checkpoint goes with a golden --reference: it checks the golden was recorded from it")
        if not self.checkpoint.has_weights:
            raise ParityError(f"--reference {self.path}: no weights; give a Hugging Face checkpoint directory")
        refuse_mismatched(self.checkpoint, "--reference")

    def decode_reference(self, models: Models, k: int, ids: torch.Tensor, n: int, points: set[str]):
        """(the n tokens to feed: the greedy continuation, each step's points [1, n, width], their storage
        rounding: none)."""
        from .decode import greedy, uncached_steps

        tokens = greedy(models, self.checkpoint, ids, n)
        return tokens, uncached_steps(models, self.checkpoint, ids, tokens, points) if points else {}, {}

    def runner(self, models: Models, k: int, ids: torch.Tensor, points: set[str] | None = None,
               on_layer: Callable[[int], None] | None = None, last: int | None = None) -> Callable[[Emit], None]:
        return hf_runner(models, self.checkpoint, torch.float32, ids, points=points, on_layer=on_layer, last=last)


def open_reference(path: Path, adapter_dirs=()):
    """The reference at ``path``: a golden directory, else a Hugging Face checkpoint."""
    from .golden import is_golden, open_golden

    return open_golden(Path(path), adapter_dirs) if is_golden(Path(path)) else TransformersReference(path, adapter_dirs)


def inputs_for(reference: Path, *, prompt: str | None = None, ids: list[int] | None = None,
               length: int | None = None, inputs_file: Path | None = None, adapter_dirs=(), decode: int = 0
               ) -> tuple[list[list[int]], list[int] | None]:
    """The token ids an engine must run to be checked against ``reference`` (a checkpoint or a golden), and with
    ``decode`` N the N tokens it must then be fed one step at a time after the first prompt (the reference's
    greedy continuation: a golden's stored one, or computed by transformers)."""
    from .decode import decodes, prompt_length

    truth = open_reference(Path(reference), adapter_dirs)
    if decode and not decodes(truth.checkpoint):
        raise ParityError(f"--decode: a {truth.checkpoint.resolved.family} model is not a causal language model; "
                          f"drop --decode")
    if decode and not truth.stored and prompt is None and ids is None and length is None and inputs_file is None:
        length = prompt_length(truth.checkpoint, decode)  # the prompt `check --decode N` would choose
    chosen = truth.inputs(prompt=prompt, ids=ids, length=length, inputs_file=inputs_file)
    tokens = None
    if decode:
        tokens = truth.decode_reference(Models(adapter_dirs), 0, chosen[0].ids, decode, set())[0]
    return [inputs.ids[0].tolist() for inputs in chosen], tokens
