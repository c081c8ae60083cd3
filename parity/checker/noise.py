"""Where a point's noise comes from: what the reference itself cannot resolve, so that a tolerance is a multiple
of it and not a guess.

- A live twin: the reference run again beside it at another dtype (float64 for a float32 check, else the
  candidate's dtype); their distance at each point is that point's precision noise.
- An isolated twin: the same, each of its layers fed the float32 reference's input to that layer (as an isolated
  check feeds the candidate), so that the noise is one layer's, not the accumulation of those before it.
- Quantization: the twin runs the candidate's own dequantized weights (a quantized file) in float32; its
  distance is what the file's quantization costs.
- A golden: each point's noise as recorded, and the storage rounding of its stored activations.
- An engine's arithmetic: beside a reference that computes as the engine does (--same-weights on a quantized
  file), the plain reference; their distance is what the engine's rounding costs.

Every source answers ``of(run, name, ref) -> (noise or None, rounding)``; parity.compare.Tolerances turns the
two into a tolerance.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from parity.checkpoint import Checkpoint
from parity.compare import ENGINE_MULTIPLE, logit_metrics, metrics
from parity.reference.models import Models, Stream, hf_runner


class LayerInputs:
    """The reference's input to each layer, handed from the comparing thread to an isolated twin running in its
    own thread (which waits for each one). ``close`` releases a waiting twin when the check stops early."""

    def __init__(self):
        self.values: dict[int, torch.Tensor] = {}
        self.closed = False
        self.ready = threading.Condition()

    def put(self, i: int, x: torch.Tensor | None) -> None:  # None: the layer takes its own input
        with self.ready:
            self.values[i] = x
            self.ready.notify_all()

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()

    def feed(self, i: int, x: torch.Tensor) -> torch.Tensor:
        with self.ready:
            self.ready.wait_for(lambda: i in self.values or self.closed)
            ref = self.values.pop(i, None)
        return x if ref is None else ref.to(x.device, x.dtype)


class NoNoise:
    """No measured noise: the dtype's default tolerances (or the user's)."""

    label = None
    scale = None  # (multiple, what) of the noise a tolerance is; None: CALIBRATION_MULTIPLE x the noise
    logits = None  # the candidate's logit metrics against a plain reference (EngineTwin)

    def plain(self, name: str, got: torch.Tensor) -> float | None:
        """The candidate's error against the plain reference, where the reference emulates an engine."""
        return None

    def of(self, run: int, name: str, ref: torch.Tensor) -> tuple[float | None, float]:
        return None, 0.0

    def feed_layer(self, i: int, x: torch.Tensor) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        pass


class Twin(NoNoise):
    """The reference run again, in its own thread, at ``dtype`` (or on other weights: ``ckpt``); ``fed`` are the
    layers it takes the float32 reference's input for (an isolated twin), handed over with ``feed_layer``."""

    def __init__(self, models: Models, ckpt: Checkpoint, dtype: torch.dtype, ids: torch.Tensor, points: set[str],
                 *, fed: set[int] = frozenset(), role: str = "calibration", label: str = "calibration",
                 on_layer: Callable[[int], None] | None = None, last: int | None = None):
        self.label = label
        self.fed = set(fed)
        self.inputs = LayerInputs() if fed else None
        feed = (lambda i, x: self.inputs.feed(i, x) if i in self.fed else x) if fed else None
        self.stream = Stream(hf_runner(models, ckpt, dtype, ids, feed, role, points=points, on_layer=on_layer,
                                       last=last), f"reference ({label})")

    def of(self, run: int, name: str, ref: torch.Tensor) -> tuple[float | None, float]:
        noisy = self.stream.get(name)
        return (None if noisy is None else metrics(noisy.to(ref.device), ref)["rel_l2"]), 0.0

    def feed_layer(self, i: int, x: torch.Tensor) -> None:
        if self.inputs is not None and i in self.fed:
            self.inputs.put(i, x)

    def close(self, wait: bool = True) -> None:
        if self.inputs is not None:
            self.inputs.close()
        self.stream.stop(wait)


class EngineTwin(Twin):
    """Beside a reference that computes as the candidate's engine does (parity.engines.arithmetic: a quantized
    file with --same-weights), the plain one, on the same weights in float32: their distance at each point is what the
    engine's arithmetic costs there, the noise of the check with --calibrate (the tolerance ENGINE_MULTIPLE times
    it); the candidate's distance to it is reported beside its distance to the emulating one, calibrated or not."""

    def __init__(self, models: Models, ckpt: Checkpoint, ids: torch.Tensor, points: set[str], *, calibrated: bool,
                 on_layer: Callable[[int], None] | None = None, last: int | None = None,
                 fed: set[int] = frozenset()):
        super().__init__(models, ckpt, torch.float32, ids, points, fed=fed, role="calibration",
                         label="engine arithmetic", on_layer=on_layer, last=last)
        self.calibrated = calibrated
        self.scale = (ENGINE_MULTIPLE, "the engine's rounding")
        self.seen: torch.Tensor | None = None
        self.logits: dict | None = None  # the candidate's logit metrics against the plain reference

    def of(self, run: int, name: str, ref: torch.Tensor) -> tuple[float | None, float]:
        self.seen = self.stream.get(name)
        if self.seen is None or not self.calibrated:
            return None, 0.0
        return metrics(self.seen.to(ref.device), ref)["rel_l2"], 0.0

    def plain(self, name: str, got: torch.Tensor) -> float | None:
        seen, self.seen = self.seen, None
        if seen is None:
            return None
        if name == "logits":
            self.logits = logit_metrics(got, seen.to(got.device))
        return metrics(got, seen.to(got.device))["rel_l2"]


class Recorded(NoNoise):
    """A golden's: each point's noise as recorded for this dtype (None when it was not calibrated for it, or not
    in isolation for an isolated check), and its storage rounding, which no tolerance may go below."""

    def __init__(self, golden, dtype: str, isolated: bool, calibrated: bool):
        self.golden, self.dtype, self.isolated, self.calibrated = golden, dtype, isolated, calibrated
        self.label = "golden" if calibrated else None

    def of(self, run: int, name: str, ref: torch.Tensor) -> tuple[float | None, float]:
        noise = self.golden.noise(run, name, self.dtype, isolated=self.isolated) if self.calibrated else None
        return noise, self.golden.rounding(run, name)


class Rounding(NoNoise):
    """Decode steps read from a golden: each point's storage rounding, no measured noise."""

    def __init__(self, rounding: dict[str, float]):
        self.rounding = rounding

    def of(self, run: int, name: str, ref: torch.Tensor) -> tuple[float | None, float]:
        return None, self.rounding.get(name, 0.0)
