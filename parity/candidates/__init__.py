"""Candidate kinds: the things parity checks against a reference.

A kind is one module of this package that defines::

    KIND = "gguf"                                   # its name in reports
    def detect(path) -> bool                        # is this path one of mine?
    def make_runner(models, path, dtype, ids, feed, ckpt) -> run(emit)
                                                    # run(emit) calls emit(point, tensor [1, S, width]) per capture point
                                                    # (models: parity.models.Models; models.options holds the check's
                                                    # options for candidates)

and optionally::

    ISOLATES = False                                # can be fed the reference's layer inputs (feed)
    INJECTS = False                                 # runs a catalogued mistake (--inject)
    def validate(path, adapter_dirs)                # refuse a bad candidate before any model is loaded
    def shapes(path, adapter_dirs) -> [shape]       # the weights parity holds to run it (to decide on streaming)
    def describe(path) -> dict                      # what the report's candidate entry adds
    def check_span(path, start, stop)               # refuse a --layers slice it cannot run
    def make_decoder(models, path, dtype, ids, tokens, ckpt) -> run(emit)
                                                    # --decode: the prompt, then one step per token with its own
                                                    # cache; emit(step, point, tensor [1, 1, width]) for steps 1..
    def same_weights(ckpt, path, out) -> dict       # write a reference holding its own weights (--same-weights)

and one line in KINDS below. The runner depends only on this protocol: it never imports a kind's module, which
is loaded on first use (an engine's Python bindings are imported only when its files are checked).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Detection order: the first kind whose detect() accepts a path runs it.
KINDS = ("dump", "onnx", "gguf", "neutral", "huggingface")


@dataclass(frozen=True)
class Kind:
    name: str
    detect: Callable[[Path], bool]
    make_runner: Callable
    isolates: bool = False
    injects: bool = False
    validate: Callable | None = None
    shapes: Callable | None = None
    describe: Callable | None = None
    check_span: Callable | None = None
    make_decoder: Callable | None = None
    same_weights: Callable | None = None


_loaded: dict[str, Kind] = {}


def kinds() -> dict[str, Kind]:
    """Every candidate kind, by name, in detection order."""
    for module in KINDS:
        if module not in _loaded:
            m = importlib.import_module(f"{__name__}.{module}")
            _loaded[module] = Kind(m.KIND, m.detect, m.make_runner, getattr(m, "ISOLATES", False),
                                   getattr(m, "INJECTS", False),
                                   *(getattr(m, f, None) for f in ("validate", "shapes", "describe", "check_span",
                                                                   "make_decoder", "same_weights")))
    return {k.name: k for k in (_loaded[m] for m in KINDS)}


def detect(path: Path) -> str | None:
    """The kind of a candidate path, or None when no kind here takes it."""
    return next((name for name, kind in kinds().items() if kind.detect(Path(path))), None)


def get(name: str) -> Kind | None:
    return kinds().get(name)
