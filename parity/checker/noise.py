"""Where a point's noise comes from: what the reference itself cannot resolve, so that a tolerance is a multiple
of it and not a guess.

- A live twin: the reference run again beside it at another dtype (float64 for a float32 check, else the
  candidate's dtype); their distance at each point is that point's precision noise.
- An isolated twin: the same, each of its layers fed the float32 reference's input to that layer (as an isolated
  check feeds the candidate), so that the noise is one layer's, not the accumulation of those before it.
- Quantization: the twin runs the candidate's own dequantized weights (a quantized GGUF) in float32; its
  distance is what the file's quantization costs.
- A golden: each point's noise as recorded, and the storage rounding of its stored activations.

Every source answers ``of(run, name, ref) -> (noise or None, rounding)``; parity.compare.Tolerances turns the
two into a tolerance.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from ..checkpoint import Checkpoint
from ..compare import metrics
from ..models import Models, Stream, hf_runner


class LayerInputs:
    """The reference's input to each layer, handed from the comparing thread to an isolated twin running in its
    own thread (which waits for each one). ``close`` releases a waiting twin when the check stops early."""

    def __init__(self):
        self.values: dict[int, torch.Tensor] = {}
        self.closed = False
        self.ready = threading.Condition()

    def put(self, i: int, x: torch.Tensor) -> None:
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
