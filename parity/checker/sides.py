"""The sides of a check. Every side, reference or candidate, answers one protocol:

    run(models, k, ids, points, feed=None, on_layer=None, last=None) -> run(emit)
        input k's forward, emit(point, tensor [1, S, width]) for each wanted point as it is produced; ``feed(i, x)``
        replaces layer i's input (--isolate, a slice's first layer), ``last`` ends the forward after that layer
    decode(models, k, ids, tokens, points) -> run(emit)
        each token as one decode step after the prompt, emit(step, point, tensor [1, 1, width]) for steps 1..N
    describe() -> dict          the report's entry
    notes                       what it reported while running: warnings, how its points were matched

A reference side (the truth) also has a checkpoint (config and adapter: the capture points), the inputs it
accepts, the options it refuses, the continuation a decode check feeds, and, when ``stored``, the noise it
recorded. Transformers and goldens are reference sides; every candidate kind (parity.candidates) is a
candidate side through CandidateSide, which is all the check knows of kinds.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from parity import candidates
from parity.candidates import Candidate, Kind, Notes, Options
from parity.checkpoint import Checkpoint, open_checkpoint, refuse_mismatched
from parity.checkpoint.inputs import Inputs, select_inputs
from parity.errors import ParityError
from parity.reference.decode import decodes, greedy, prompt_length, uncached_steps
from parity.reference.golden import is_golden, open_golden
from parity.reference.models import Emit, Models, hf_runner, replay_steps
from parity.reference.structure import discover


class TransformersSide:
    """A Hugging Face checkpoint run by transformers (eager attention, float32) each time it is asked."""

    kind = "transformers"
    stored = False
    points = None  # every capture point of the adapter

    def __init__(self, path: Path, adapter_dirs=(), arithmetic=None):
        """``arithmetic`` (parity.engines.arithmetic): run as that engine computes (a same-weights reference)."""
        self.path = Path(path)
        self.checkpoint: Checkpoint = open_checkpoint(self.path, adapter_dirs, discover=discover)
        self.arithmetic = arithmetic
        self.notes = Notes()

    def describe(self) -> dict:
        out = {"kind": self.kind, "path": str(self.path)}
        if self.arithmetic is not None:
            out["arithmetic"] = self.arithmetic.to_json()
        return out

    def inputs(self, **asked) -> list[Inputs]:
        return select_inputs(self.checkpoint, **asked)

    def check_options(self, *, checkpoint: Path | None = None, **_) -> None:
        if checkpoint is not None:
            raise ParityError("--checkpoint goes with a golden --reference: it checks the golden was recorded from it")
        if not self.checkpoint.has_weights:
            raise ParityError(f"--reference {self.path}: no weights; give a Hugging Face checkpoint directory")
        refuse_mismatched(self.checkpoint, "--reference")

    def run(self, models: Models, k: int, ids: torch.Tensor, points: set[str] | None = None, feed=None,
            on_layer: Callable[[int], None] | None = None, last: int | None = None) -> Callable[[Emit], None]:
        return hf_runner(models, self.checkpoint, torch.float32, ids, feed, points=points, on_layer=on_layer,
                         last=last, arithmetic=self.arithmetic)

    def continuation(self, models: Models, k: int, ids: torch.Tensor, n: int) -> list[int]:
        """The n tokens a decode check feeds: the reference's greedy continuation."""
        return greedy(models, self.checkpoint, ids, n)

    def decode(self, models: Models, k: int, ids: torch.Tensor, tokens: list[int], points: set[str]):
        """The truth for each step: one forward over the prompt and the tokens, without a cache (where no cache
        can be wrong)."""
        steps = uncached_steps(models, self.checkpoint, ids, tokens, points, self.arithmetic) if points else {}
        return replay_steps(steps, len(tokens))

    def step_rounding(self, k: int, n: int) -> dict[str, float]:
        return {}


class GoldenSide:
    """A golden (parity.reference.golden): the activations transformers produced once, replayed."""

    kind = "golden"
    stored = True

    def __init__(self, golden):
        self.golden = golden
        self.path = golden.path
        self.checkpoint: Checkpoint = golden.checkpoint  # recognised from the stored config; no weights
        self.points = golden.points
        self.notes = Notes()

    def describe(self) -> dict:
        return self.golden.describe()

    def inputs(self, **asked) -> list[Inputs]:
        return self.golden.inputs(**asked)

    def check_options(self, **options) -> None:
        self.golden.check_options(**options)

    def calibrated_for(self, dtype: str, isolated: bool = False) -> bool:
        return self.golden.calibrated_for(dtype, isolated)

    def run(self, models: Models, k: int, ids: torch.Tensor, points: set[str] | None = None, feed=None,
            on_layer=None, last=None) -> Callable[[Emit], None]:
        return self.golden.runner(k, points)

    def continuation(self, models: Models, k: int, ids: torch.Tensor, n: int) -> list[int]:
        return self.golden.decode_steps(n, k).tokens[:n]

    def decode(self, models: Models, k: int, ids: torch.Tensor, tokens: list[int], points: set[str]):
        return self.golden.step_runner(k, len(tokens), points)

    def step_rounding(self, k: int, n: int) -> dict[str, float]:
        held = self.golden.decode_steps(n, k)
        return {p: info.storage_rel_l2 for p, info in held.points.items()}


def open_reference(path: Path, adapter_dirs=(), arithmetic=None):
    """The reference at ``path``: a golden directory, else a Hugging Face checkpoint (computing with
    ``arithmetic``, when given: a same-weights reference)."""
    if is_golden(Path(path)):
        return GoldenSide(open_golden(Path(path), adapter_dirs))
    return TransformersSide(path, adapter_dirs, arithmetic)


class CandidateSide:
    """A candidate of any kind in parity.candidates, run through its kind's protocol at ``dtype``, read with the
    reference's checkpoint ``ckpt`` (its capture points and shapes)."""

    def __init__(self, kind: Kind, path: Path, options: Options, dtype: torch.dtype, ckpt: Checkpoint):
        self.kind, self.path, self.options, self.dtype, self.checkpoint = kind, Path(path), options, dtype, ckpt
        self.notes = Notes()

    def describe(self) -> dict:
        out = {"kind": self.kind.name, "path": str(self.path)}
        if self.kind.describe is not None:
            out.update(self.kind.describe(self.path, dict(self.options.engine)))
        if self.options.attn is not None or self.options.compile:  # the kernel the candidate ran with
            out.update({"attn": self.options.attn or "eager", "compile": self.options.compile})
        return out

    def _candidate(self, models: Models) -> Candidate:
        return Candidate(models, self.path, self.dtype, self.checkpoint, self.options, self.notes)

    def run(self, models: Models, k: int, ids: torch.Tensor, points: set[str] | None = None, feed=None,
            on_layer=None, last=None) -> Callable[[Emit], None]:
        """A kind emits what it has (``points`` is the caller's to filter); a slice's end is in its options."""
        return self.kind.make_runner(self._candidate(models), ids, feed)

    def decode(self, models: Models, k: int, ids: torch.Tensor, tokens: list[int], points: set[str]):
        return self.kind.make_decoder(self._candidate(models), ids, tokens)


@dataclass(frozen=True)
class KindRow:
    """A candidate kind as `parity engines` lists it."""

    kind: str
    named_as: list[str] | None   # KIND:PATH names of a kind taken only when named; None: found by its files
    isolates: bool
    decodes: bool
    same_weights: bool
    options: dict[str, str]      # --engine-option keys, with their help
    installed: bool
    install: str | None          # the extra that installs its engine, where it is not installed


def kind_rows() -> list[KindRow]:
    """Every candidate kind as `parity engines` lists it: how it is taken, what it can do, its engine options, and
    whether its engine is installed here (and the extra that installs it where not)."""
    rows = []
    for kind in candidates.kinds().values():
        installed = kind.requires is None or importlib.util.find_spec(kind.requires[0]) is not None
        rows.append(KindRow(kind=kind.name, named_as=[kind.name, *kind.aliases] if kind.explicit else None,
                            isolates=kind.isolates, decodes=kind.make_decoder is not None,
                            same_weights=kind.same_weights is not None, options=dict(kind.engine_options),
                            installed=installed,
                            install=None if installed else f"pip install 'parity[{kind.requires[1]}]'"))
    return rows


def candidate_kind(spec) -> tuple[Kind, Path]:
    """A candidate's kind and path: the kind ``KIND:PATH`` names, else the first of parity.candidates' kinds that
    takes the path."""
    kind, path = candidates.named(str(spec))
    if kind is not None:
        if not Path(path).exists():
            raise ParityError(f"--candidate {spec}: {path}: no such file or directory")
        return kind, Path(path)
    found = candidates.detect(Path(path))
    if found is not None:
        return candidates.get(found), Path(path)
    if not Path(path).exists():
        raise ParityError(f"--candidate {path}: no such file or directory")
    engines = [k.name for k in candidates.kinds().values() if k.explicit]
    takes = [k.takes or k.name for k in candidates.kinds().values() if not k.explicit]
    raise ParityError(f"--candidate {path}: not {', '.join(takes[:-1])} or {takes[-1]} (the kinds: "
                      f"{', '.join(k for k in candidates.kinds() if k not in engines)}"
                      + (f"; an engine's directory is named as KIND:PATH, KIND one of {', '.join(engines)}"
                         if engines else "") + ")")


def inputs_for(reference: Path, prompts, *, adapter_dirs=(), decode: int = 0
               ) -> tuple[list[list[int]], list[int] | None]:
    """The token ids an engine must run to be checked against ``reference`` (a checkpoint or a golden), and with
    ``decode`` N the N tokens it must then be fed one step at a time after the first prompt (the reference's
    greedy continuation: a golden's stored one, or computed by transformers). ``prompts``: a
    parity.checkpoint.inputs.Prompts."""
    truth = open_reference(Path(reference), adapter_dirs)
    if decode and not decodes(truth.checkpoint):
        raise ParityError(f"--decode: a {truth.checkpoint.resolved.family} model is not a causal language model; "
                          f"drop --decode")
    length = prompts.length
    if decode and not truth.stored and not prompts.given:
        length = prompt_length(truth.checkpoint, decode)  # the prompt `check --decode N` would choose
    chosen = truth.inputs(prompt=prompts.prompt, ids=None if prompts.ids is None else list(prompts.ids), length=length,
                          inputs_file=prompts.inputs_file)
    tokens = truth.continuation(Models(adapter_dirs), 0, chosen[0].ids, decode) if decode else None
    return [inputs.ids[0].tolist() for inputs in chosen], tokens
