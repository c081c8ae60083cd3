"""One prompt through both sides, each capture point judged as the candidate produces it.

The reference runs in a background thread (parity.reference.models.Stream) and hands each point over; the candidate runs
in this thread and each of its points is judged and dropped at once, so memory holds about one layer of
activations beyond the models. Held whole, the reference runs first (side by side, the two would share the same
cores, each op already spread over all of them): each of its points is written to an unnamed temporary file as
it comes (Spill), the model is dropped after the last prompt before the candidate loads, and each point is read
back when the candidate reaches it, the logits a block of positions at a time (parity.compare.OnDisk), so that
the check holds one model at a time and never both sides' logits whole beside it. Streamed, or with more points
than the temporary files' disk can take, the two run in step.

``--isolate`` feeds each candidate layer the reference's input to it (a slice of ``--layers`` its first layer):
the error a layer adds, apart from the error it inherits. A candidate that cannot be fed (an engine runs its
graph whole: a graph file, a dump) is isolated the other way round (Plan.follows): the reference runs in step with
it, and each of its layers, and its noise twin's, waits for the candidate's input to that layer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from parity import names
from parity.checker.judge import Judge
from parity.checker.noise import EngineTwin, LayerInputs, NoNoise, Recorded, Twin
from parity.checker.plan import Plan
from parity.checkpoint import Checkpoint
from parity.compare import CHUNK_BYTES, OnDisk, logits_compared
from parity.reference.models import Models, Stream, fed_points, layer_inputs
from parity.report import PointResult


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


def points_fit(plan: Plan, ids: torch.Tensor, points: set[str]) -> bool:
    """Whether the reference's float32 points (the logits [positions, vocabulary] included) take under a tenth of
    the free space where temporary files go (they wait there for the candidate, not in memory)."""
    vocab, hidden = plan.checkpoint.resolved.embedding_shape
    nbytes = ids.numel() * 4 * sum(vocab if p == "logits" else hidden for p in points)
    return nbytes < 0.1 * shutil.disk_usage(tempfile.gettempdir()).free


class Spill:
    """A reference's points, run ahead of the candidate, in an unnamed temporary file (gone when closed, or when
    the process ends): ``get`` and ``stop`` as a Stream's. A point is written as it comes and read back when
    asked for: whole when it is a layer's input (``whole``: a layer may be fed it) or at most CHUNK_BYTES, else
    as an OnDisk tensor, which the metrics read a block at a time, cut where the tensor itself would be. A point
    put ``later`` (the logits, the run's last) is written by a thread of its own while the caller goes on:
    ``written`` waits for it, and lets go of its tensor; ``get`` of it does too."""

    WRITE = 64 * 2**20  # bytes moved to the CPU and written at a time (a point on a GPU is not copied whole)

    def __init__(self, whole: set[str]):
        self.whole = whole
        self.file = tempfile.TemporaryFile(prefix="parity-points-")
        self.fd = self.file.fileno()
        self.held: dict[str, OnDisk] = {}
        self.end = 0
        self.writing: tuple[str, threading.Thread] | None = None
        self.error: BaseException | None = None

    def put(self, name: str, t: torch.Tensor, later: bool = False) -> None:
        self.written()  # one write at a time
        t = t.detach()
        at = self.end
        self.end += t.numel() * t.element_size()
        self.held[name] = OnDisk(self.fd, at, t.shape, t.dtype, t.device)
        if not later:
            self._write(t, at)
            return
        # the thread holds the file too: one that outlives a check stopped without waiting writes to it still
        thread = threading.Thread(target=self._write_later, args=(self.file, t, at), daemon=True)
        self.writing = (name, thread)
        thread.start()

    def _write(self, t: torch.Tensor, at: int) -> None:
        flat = t.reshape(-1)  # a view of a contiguous point
        step = max(1, self.WRITE // t.element_size())
        for a in range(0, flat.numel(), step):
            piece = flat[a:a + step].to("cpu").contiguous()
            view, done = memoryview(piece.view(torch.uint8).numpy()), 0
            while done < len(view):
                done += os.pwrite(self.fd, view[done:done + (1 << 30)], at + done)
            at += done

    def _write_later(self, file, t: torch.Tensor, at: int) -> None:
        try:
            self._write(t, at)
        except BaseException as exc:  # noqa: BLE001 - raised by written()
            self.error = exc

    def written(self) -> None:
        """Until the point put ``later`` is on disk, raising what stopped its write."""
        if self.writing is not None:
            self.writing[1].join()
            self.writing = None
        if self.error is not None:
            raise self.error

    def get(self, name: str) -> torch.Tensor | OnDisk | None:
        if self.writing is not None and self.writing[0] == name:
            self.written()
        held = self.held.pop(name, None)
        if held is None or (name not in self.whole and held.numel() * held.element_size() > CHUNK_BYTES):
            return held
        return held.load()

    def stop(self, wait: bool = True) -> None:
        """Close the file (once a write in progress is done; ``wait=False`` leaves that write to close it)."""
        self.held.clear()
        if self.writing is not None:
            if not wait:
                return
            self.writing[1].join()
        self.file.close()


def _held(t: torch.Tensor | OnDisk) -> torch.Tensor | OnDisk:
    """A point kept for a diagnosis, on the CPU: the tensor itself where it is there and the whole of its memory
    (a copy would hold it twice; no side writes into a point it has emitted), else a copy of it alone. One on disk
    stays there until the prompt ends (PromptCheck._settle)."""
    if isinstance(t, OnDisk):
        return t
    t = t.detach()
    if t.device.type == "cpu" and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.to("cpu", copy=True)


class PromptCheck:
    """Prompt ``k`` (token ids ``ids``) of a plan, run on ``models``."""

    def __init__(self, plan: Plan, models: Models, k: int, ids: torch.Tensor, say: Callable[[str], None],
                 on_layer: Callable[[str, int, int], None] | None, quantized: Checkpoint | None = None,
                 keep_layer: int | None = None):
        """``quantized``: the candidate's own dequantized weights, whose twin measures its quantization noise;
        ``keep_layer``: keep both sides of every failing point of that layer (a drill-down: parity.checker.drill),
        as a check that captures ops keeps those of its first failing layer."""
        self.keep_layer = keep_layer
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
        # following the candidate (Plan.follows): the reference is fed its layer inputs and MLP inputs, each keyed
        # by the layer's index or the point's name; ``pending`` are the points that give them, in forward order
        self.follow: LayerInputs | None = LayerInputs() if plan.follows else None
        self.keys: dict[str, int | str] = {}
        if self.follow is not None:
            self.keys = {**{p: i for p, i in self.input_of.items() if i in self.feeding},
                         **{p: p for p in fed_points(plan.checkpoint)}}
            self.feeding |= set(fed_points(plan.checkpoint))
        self.pending = sorted(self.keys, key=names.point_order)
        self.entry = next((p for p, i in self.input_of.items() if i == span.start), None) if span.start else None
        # each side emits only what is compared (and what feeds a layer): nothing else is held
        self.needed = set(self.wanted) | {p for p, i in self.input_of.items() if i in self.feeding} | set(self.keys)
        self.last = span.stop - 1 if span.stop < n_layers else None  # the models stop after the slice
        self.head_input = f"layers.{n_layers - 1}.out"
        self.wanted_set = set(self.wanted)
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
        if plan.arithmetic is not None:  # the plain reference beside the emulating one, calibrated or not
            self.say("loading the plain reference, beside the one that computes as the engine does")
            return EngineTwin(self.models, plan.checkpoint, self.ids, self.needed, calibrated=plan.calibrate,
                              on_layer=self._progress("plain reference"), last=self.last,
                              fed=self.feeding if self.follow else frozenset())
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
        if name == self.head_input and isinstance(self.reference, Spill):
            self.reference.written()  # the reference's logits are on disk before the candidate's are computed
        if name not in self.needed:
            return
        i = self.input_of.get(name)
        if self.follow is not None:
            self._hand_over(name, got)
        ref = self.reference.get(name)
        if ref is None:
            return
        if i in self.feeding and self.follow is None:
            self.reference_out[i] = ref
            self.noise.feed_layer(i, ref)
        if name not in self.wanted_set:
            return
        noise, rounding = self.noise.of(self.k, name, ref)
        measured = None
        if name == "logits":  # its metrics and the logit metrics in one pass over both sides' logits
            measured, self.out.logits = logits_compared(got, ref.to(got.device))
        result = self.judge(name, got, ref, noise, rounding, scale=self.noise.scale, measured=measured)
        result.plain_rel_l2 = self.noise.plain(name, got)
        self.out.results.append(result)
        self._keep(name, got, ref, result)
        if i is not None:  # only the latest layer input is held: the one both sides took
            self.layer_input = {i: got if self.follow is not None else ref}
        if name == "logits":
            if self.noise.logits is not None:  # beside a reference that emulates the engine: against the plain one
                self.out.logits["against_plain"] = self.noise.logits
        if name.endswith(".out"):
            self.say(f"compared {name}")

    def _hand_over(self, name: str, got: torch.Tensor) -> None:
        """Following the candidate: the input it gives (``name`` one of ``keys``) goes to the reference and its
        twin; before the reference is asked for a point, every input that comes earlier in forward order has been
        handed over (one the candidate does not give is released: the reference takes its own there), so neither
        thread waits on the other for ever."""
        order = names.point_order(name)
        while self.pending and names.point_order(self.pending[0]) < order:
            self._give(self.keys[self.pending.pop(0)], None)
        if self.pending and self.pending[0] == name:
            self._give(self.keys[self.pending.pop(0)], got.detach().to("cpu", copy=True))

    def _give(self, key: int | str, x: torch.Tensor | None) -> None:
        self.follow.put(key, x)
        self.noise.feed_layer(key, x)

    def _keep(self, name: str, got: torch.Tensor, ref: torch.Tensor, result: PointResult) -> None:
        """What the diagnosis needs: both sides at the first failure and the final output, and the reference's
        input to the failing layer (the diagnosis re-runs only that layer)."""
        first_failure = not result.passed and len(self.out.failing) == 1
        kept = self.out.kept
        layer = names.layer_of(name)
        if first_failure and self.keep_layer is None and self.plan.ops:
            self.keep_layer = layer  # ops captured: the drill-down looks at every failing op of this layer
        in_layer = not result.passed and layer is not None and layer == self.keep_layer
        if name in ("logits", "final_norm") or first_failure or in_layer:
            kept.setdefault("candidate", {})[name] = _held(got)
            kept.setdefault("reference", {})[name] = _held(ref)
        if first_failure and names.layer_of(name) in self.layer_input:
            kept["layer_input"] = _held(self.layer_input[names.layer_of(name)])

    def _settle(self) -> None:
        """At the prompt's end: what the diagnosis keeps is read back from disk if the prompt failed (its file is
        closed next), and let go of if it passed (only a failing prompt is diagnosed)."""
        kept = self.out.kept
        if not self.out.failing:
            self.out.kept = {"ids": kept["ids"]}
            return
        for side in ("candidate", "reference"):
            for name, t in kept.get(side, {}).items():
                if isinstance(t, OnDisk):
                    kept[side][name] = t.to("cpu").load()

    def _run_ahead(self, stream: Stream) -> Spill:
        """The reference's run to its end, each point written to disk as it comes: asked for in forward order,
        none waits in memory (one that comes out of order waits in the stream until asked for)."""
        spill = Spill(whole=set(self.input_of))
        try:
            for name in sorted(self.needed, key=names.point_order):
                t = stream.get(name)
                if t is not None:  # the logits are written while the candidate runs its layers
                    spill.put(name, t, later=name == "logits")
                del t
            stream.wait()
        except BaseException:
            spill.stop()
            raise
        return spill

    def __call__(self, done_with_reference: bool) -> Prompt:
        """``done_with_reference``: no later prompt runs the reference, so a whole one is dropped once it has
        run (the candidate loads into its memory)."""
        plan, models = self.plan, self.models
        # run ahead to disk, unless the reference follows the candidate: then the two run in step
        ahead = (not models.stream and not plan.reference.stored and self.follow is None
                 and points_fit(plan, self.ids, self.needed))
        self.say("loading the reference")
        follow = self.follow
        feed = (lambda i, x: follow.feed(i, x) if i in self.feeding else x) if follow is not None else None
        self.reference = Stream(plan.reference.run(models, self.k, self.ids, self.needed, feed=feed,
                                                   on_layer=self._progress("reference"), last=self.last),
                                plan.reference.kind)
        self.noise = NoNoise()
        try:
            if ahead:  # its points to disk, the model dropped: then the noise's and the candidate's models load
                self.reference = self._run_ahead(self.reference)
                if done_with_reference:
                    models.release("reference")
                if not plan.kind.isolates:  # a candidate not run layer by layer holds its logits before it emits
                    self.reference.written()
            self.noise = self._noise()
            self.say(f"running the candidate ({plan.kind.name})")
            fed = self.feed if self.feeding and follow is None else None
            plan.candidate.run(models, self.k, self.ids, feed=fed)(self.on_point)
        except BaseException:  # an error, Ctrl-C: the reference's threads are told to end, and not waited for
            if follow is not None:
                follow.close()
            self.noise.close(wait=False)
            self.reference.stop(wait=False)
            raise
        if follow is not None:  # layer inputs the candidate never gave: the reference takes its own
            follow.close()
        self.noise.close()
        self._settle()
        self.reference.stop()
        produced = {p.name for p in self.out.results}
        self.out.results += [self.judge.missing(name) for name in self.wanted if name not in produced]
        self.out.results.sort(key=lambda p: names.point_order(p.name))
        return self.out
