"""One prompt through both sides, each capture point judged as the candidate produces it.

The reference runs in a background thread (parity.models.Stream) and hands each point over; the candidate runs
in this thread and each of its points is judged and dropped at once, so memory holds about one layer of
activations beyond the models. Held whole, the reference runs first when its points fit beside the models (side
by side, the two would share the same cores, each op already spread over all of them) and is dropped after the
last prompt before the candidate loads; streamed, or with too many points to hold, the two run in step.

``--isolate`` feeds each candidate layer the reference's input to it (a slice of ``--layers`` its first layer):
the error a layer adds, apart from the error it inherits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import names
from ..checkpoint import Checkpoint
from ..compare import logit_metrics
from ..models import Models, Stream, free_memory, layer_inputs
from ..report import PointResult
from .judge import Judge
from .noise import NoNoise, Recorded, Twin
from .plan import Plan


@dataclass
class Prompt:
    """What one prompt gave: each wanted point's result, the logit metrics, and what a diagnosis needs at the
    first failing point (both sides' tensors there and at the final output, the reference's input to its layer)."""

    results: list[PointResult] = field(default_factory=list)
    logits: dict | None = None
    kept: dict = field(default_factory=dict)

    @property
    def failing(self) -> list[PointResult]:
        return [p for p in self.results if p.compared and not p.passed]


def points_fit(plan: Plan, ids: torch.Tensor, points: set[str], device: str) -> bool:
    """Whether the reference's float32 points (the logits [positions, vocabulary] included) take under a tenth of
    the memory free where it runs."""
    vocab, hidden = next(t.shape for t in plan.checkpoint.resolved.tensors if t.neutral == ("embed.tokens.weight",))
    nbytes = ids.numel() * 4 * sum(vocab if p == "logits" else hidden for p in points)
    free = free_memory(device)
    return free is None or nbytes < 0.1 * free


class PromptCheck:
    """Prompt ``k`` (token ids ``ids``) of a plan, run on ``models``."""

    def __init__(self, plan: Plan, models: Models, k: int, ids: torch.Tensor, say: Callable[[str], None],
                 on_layer: Callable[[str, int, int], None] | None, quantized: Checkpoint | None = None):
        """``quantized``: the candidate's own dequantized weights, whose twin measures its quantization noise."""
        self.plan, self.models, self.k, self.ids, self.say, self.on_layer = plan, models, k, ids, say, on_layer
        self.quantized = quantized
        span, n_layers = plan.span, plan.checkpoint.resolved.num_layers
        self.n_layers = n_layers
        self.wanted = plan.wanted()
        self.input_of = layer_inputs(n_layers)
        # the layers fed the reference's input: every one when isolating, else a slice's first (when the
        # candidate can be fed: a dump or a graph runs from its own start)
        self.feeding = (set(range(n_layers + 1)) if plan.isolate
                        else {span.start} if span.start > 0 and plan.kind.isolates else set())
        self.entry = next((p for p, i in self.input_of.items() if i == span.start), None) if span.start else None
        # each side emits only what is compared (and what feeds a layer): nothing else is held
        self.needed = set(self.wanted) | {p for p, i in self.input_of.items() if i in self.feeding}
        self.last = span.stop - 1 if span.stop < n_layers else None  # the models stop after the slice
        self.judge = Judge(plan.tolerances)
        self.out = Prompt(kept={"ids": ids})
        self.reference_out: dict[int, torch.Tensor] = {}   # the reference's layer outputs a fed layer takes
        self.layer_input: dict[int, torch.Tensor] = {}     # the reference's input to the layer being compared

    def _progress(self, label: str) -> Callable[[int], None] | None:
        return None if self.on_layer is None else (lambda i: self.on_layer(label, i + 1, self.n_layers))

    def _noise(self):
        """The point's noise source: a golden's record, or a live twin of the reference (at another dtype, on the
        candidate's own weights for a quantized one, isolated when the check is)."""
        plan = self.plan
        if plan.reference.stored:
            return Recorded(plan.reference.golden, plan.dtype, plan.isolate, plan.calibrate)
        if not plan.calibrate:
            return NoNoise()
        ckpt, dtype = (self.quantized, torch.float32) if self.quantized is not None else (
            plan.checkpoint, torch.float64 if plan.low == torch.float32 else plan.low)
        self.say(f"loading the reference at {str(dtype).removeprefix('torch.')} for calibration")
        # an isolated check calibrates in isolation too: the twin's layers are fed the float32 reference's
        # inputs, so each point's noise is one layer's, not the noise accumulated over the layers before it
        return Twin(self.models, ckpt, dtype, self.ids, self.needed, fed=self.feeding,
                    on_layer=self._progress("calibration"), last=self.last)

    def feed(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The candidate's input to layer i: the reference's, where the check feeds that layer."""
        if i not in self.feeding:
            return x
        ref = self.reference_out.pop(i, None)
        if ref is None and i == self.plan.span.start and self.entry is not None:  # the layers before were skipped
            ref = self.reference.get(self.entry)
            if ref is not None:
                self.noise.feed_layer(i, ref)
        return x if ref is None else ref.to(x.device, x.dtype)

    def on_point(self, name: str, got: torch.Tensor) -> None:
        layer_done = self._progress("candidate")
        if layer_done is not None and self.input_of.get(name, 0) > 0:  # layers.{i}.out: layer i is done
            layer_done(self.input_of[name] - 1)
        if name not in self.needed:
            return
        ref = self.reference.get(name)
        if ref is None:
            return
        i = self.input_of.get(name)
        if i in self.feeding:
            self.reference_out[i] = ref
            self.noise.feed_layer(i, ref)
        if name not in self.wanted_set:
            return
        noise, rounding = self.noise.of(self.k, name, ref)
        result = self.judge(name, got, ref, noise, rounding)
        self.out.results.append(result)
        self._keep(name, got, ref, result)
        if i is not None:  # only the latest layer input is held
            self.layer_input = {i: ref}
        if name == "logits":
            self.out.logits = logit_metrics(got, ref.to(got.device))
        if name.endswith(".out"):
            self.say(f"compared {name}")

    def _keep(self, name: str, got: torch.Tensor, ref: torch.Tensor, result: PointResult) -> None:
        """What the diagnosis needs: both sides at the first failure and the final output, and the reference's
        input to the failing layer (the diagnosis re-runs only that layer)."""
        first_failure = not result.passed and len(self.out.failing) == 1
        kept = self.out.kept
        if name in ("logits", "final_norm") or first_failure:
            kept.setdefault("candidate", {})[name] = got.detach().to("cpu", copy=True)
            kept.setdefault("reference", {})[name] = ref.detach().to("cpu", copy=True)
        if first_failure and names.layer_of(name) in self.layer_input:
            kept["layer_input"] = self.layer_input[names.layer_of(name)].detach().to("cpu", copy=True)

    def __call__(self, done_with_reference: bool) -> Prompt:
        """``done_with_reference``: no later prompt runs the reference, so a whole one is dropped once it has
        run (the candidate loads into its memory)."""
        plan, models = self.plan, self.models
        self.wanted_set = set(self.wanted)
        ahead = not models.stream and not plan.reference.stored and points_fit(plan, self.ids, self.needed,
                                                                                models.device["reference"])
        self.say("loading the reference")
        self.reference = Stream(plan.reference.run(models, self.k, self.ids, self.needed,
                                                   on_layer=self._progress("reference"), last=self.last),
                                plan.reference.kind, bound=0 if ahead else 4)
        self.noise = NoNoise()
        try:
            self.noise = self._noise()
            if ahead:
                self.reference.wait()
                if done_with_reference:
                    models.release("reference")
            self.say(f"running the candidate ({plan.kind.name})")
            plan.candidate.run(models, self.k, self.ids, feed=self.feed if self.feeding else None)(self.on_point)
        except BaseException:  # an error, Ctrl-C: the reference's threads are told to end, and not waited for
            self.noise.close(wait=False)
            self.reference.stop(wait=False)
            raise
        self.noise.close()
        self.reference.stop()
        produced = {p.name for p in self.out.results}
        self.out.results += [self.judge.missing(name) for name in self.wanted if name not in produced]
        self.out.results.sort(key=lambda p: names.point_order(p.name))
        return self.out
