"""Candidate kinds: the things parity checks against a reference.

A kind is one module (here, or an engine's ``parity/engines/<engine>/kind.py``) that defines::

    KIND = "gguf"                                   # its name in reports
    def detect(path) -> bool                        # is this path one of mine?
    def make_runner(candidate, ids, feed) -> run(emit)
                                                    # run(emit) calls emit(point, tensor [1, S, width]) per capture
                                                    # point; candidate: a Candidate (below): the check's models,
                                                    # the path, dtype, reference checkpoint, options, notes

and optionally::

    TAKES = "a GGUF file (.gguf)"                  # what a path of this kind is (for the error no kind takes it)
    ISOLATES = False                                # can be fed the reference's layer inputs (feed)
    EXPLICIT = False                                # taken only when named: --candidate KIND:PATH (an engine that
                                                    # runs a Hugging Face directory its own way)
    ALIASES = ()                                    # other names for KIND: in --candidate KIND:PATH
    ENGINE_OPTIONS = {}                             # --engine-option KEY=VALUE keys this kind reads, with their help
    REQUIRES = ("mlx_lm", "mlx")                    # the engine's Python module, and parity's extra installing it
    OPTIONS = ()                                    # the fields of Options this kind reads; a user option outside
                                                    # them (e.g. --provider for a GGUF) is refused by the plan
    def validate(path, adapter_dirs)                # refuse a bad candidate before any model is loaded
    def shapes(path, adapter_dirs) -> [shape]       # the weights parity holds to run it (to decide on streaming)
    def describe(path, engine) -> dict              # what the report's candidate entry adds; engine: the checked
                                                    # --engine-option values, {key: value} ({} when none), so
                                                    # that a conversion they ask for is the one described
    def check_span(path, start, stop)               # refuse a --layers slice it cannot run
    def make_decoder(candidate, ids, tokens) -> run(emit)
                                                    # --decode: the prompt, then one step per token with its own
                                                    # cache; emit(step, point, tensor [1, 1, width]) for steps 1..
    GENERIC = False                                 # reads the points by module path or by name, nothing of the
                                                    # family's conventions: it checks a model no adapter knows
                                                    # (its structure discovered from transformers)
    def check_options(options, ckpt, stream)     # refuse, when the plan is made, options this path cannot run
    def same_weights(ckpt, path, out, engine) -> dict
                                                    # write a reference holding its own weights (--same-weights;
                                                    # --calibrate of a quantized candidate): those of the
                                                    # conversion the engine options ask for, as the runner's
    def arithmetic(out) -> object | None            # how its engine computes, as same_weights saved it in out
                                                    # (parity.engines.arithmetic); None: float32 as transformers
    def weights(path, engine) -> Weights | None     # how it stores its weights (parity.weights.Weights): a
                                                    # quantized one is judged at its own weights by default; None:
                                                    # it cannot tell
    def check_ids(path, ids, ckpt) -> Found | None  # a candidate that records the token ids it ran (a dump): None
                                                    # where they are the reference's ``ids``, the input mistake it
                                                    # made (parity.dumps.mistakes.Found: a BOS doubled, ...), else
                                                    # ParityError; asked before any side runs

and one line in KINDS below naming its module (ENGINES: the kinds taken only when named). The check
(parity.checker) depends only on this protocol: it never imports a kind's module, which is loaded on first use (an
engine's Python bindings are imported only when its files are checked).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# One line per kind, naming its module. Detection order: the first kind whose detect() accepts a path runs it.
# Engines come last: taken only when named.
KINDS = (
    "parity.candidates.dump",
    "parity.engines.onnx.kind",
    "parity.engines.gguf.kind",
    "parity.candidates.golden",
    "parity.candidates.neutral",
    "parity.candidates.huggingface",
)
ENGINES: tuple[str, ...] = (
    "parity.engines.mlx.kind",
    "parity.engines.ctranslate2.kind",
    "parity.engines.openvino.kind",
    "parity.candidates.python_engine",
)


@dataclass(frozen=True)
class Options:
    """A candidate's options, fixed by the check's plan before anything runs. A kind reads only the fields its
    OPTIONS names; the rest keep their defaults."""

    layerwise: bool = True                     # every capture point is compared, not only the final output
    provider: str | None = None                # ONNX: the onnxruntime execution provider (--provider)
    map: tuple[tuple[str, str], ...] = ()      # ONNX: (point, graph value) pairs (--map)
    inject: str | None = None                  # neutral: the catalogued mistake the executor runs (--inject)
    layers: range | None = None                # the layers a slice runs (--layers)
    attn: str | None = None                    # transformers: the attention implementation (--candidate-attn)
    compile: bool = False                      # transformers: run the candidate under torch.compile (--compile)
    engine: tuple[tuple[str, str], ...] = ()   # an engine kind's ENGINE_OPTIONS, (key, value) (--engine-option)
    last: int | None = None                    # the last layer a slice needs (None: run to the end)
    ops: bool = False                          # emit operation-level points too (--points ops, a drill-down)


class Notes:
    """What a side reports back while it runs: warnings for the report (each once) and, for a graph, how its
    values were matched to capture points."""

    def __init__(self):
        self.warnings: list[str] = []
        self.matching: dict | None = None

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)


@dataclass
class Candidate:
    """A candidate as its kind's runner sees it."""

    models: Any                 # parity.reference.models.Models: loaded models, devices, streaming
    path: Path
    dtype: Any                  # torch.dtype the side computes in
    ckpt: Any                   # the reference's parity.checkpoint.Checkpoint (config, adapter)
    options: Options = field(default_factory=Options)
    notes: Notes = field(default_factory=Notes)


@dataclass(frozen=True)
class Kind:
    name: str
    detect: Callable[[Path], bool]
    make_runner: Callable
    isolates: bool = False
    options: tuple[str, ...] = ()
    explicit: bool = False
    aliases: tuple[str, ...] = ()
    engine_options: tuple[tuple[str, str], ...] = ()
    requires: tuple[str, str] | None = None
    validate: Callable | None = None
    shapes: Callable | None = None
    describe: Callable | None = None
    check_span: Callable | None = None
    make_decoder: Callable | None = None
    same_weights: Callable | None = None
    check_options: Callable | None = None
    arithmetic: Callable | None = None
    takes: str = ""
    generic: bool = False
    check_ids: Callable | None = None
    weights: Callable | None = None

    @property
    def injects(self) -> bool:
        return "inject" in self.options


_loaded: dict[str, Kind] = {}


def kinds() -> dict[str, Kind]:
    """Every candidate kind, by name, in detection order (the engines last). A kind's module imports nothing of
    its engine at load: its Python bindings are imported when it runs."""
    hooks = ("validate", "shapes", "describe", "check_span", "make_decoder", "same_weights", "check_options",
             "arithmetic", "check_ids", "weights")  # the protocol's optional functions
    for module in KINDS + ENGINES:
        if module not in _loaded:
            m = importlib.import_module(module)
            options = tuple(getattr(m, "OPTIONS", ()))
            engine = tuple(sorted(getattr(m, "ENGINE_OPTIONS", {}).items()))
            _loaded[module] = Kind(name=m.KIND, detect=m.detect, make_runner=m.make_runner,
                                   isolates=getattr(m, "ISOLATES", False),
                                   options=options + (("engine",) if engine else ()),
                                   explicit=getattr(m, "EXPLICIT", False), aliases=tuple(getattr(m, "ALIASES", ())),
                                   engine_options=engine, requires=getattr(m, "REQUIRES", None),
                                   takes=getattr(m, "TAKES", ""), generic=getattr(m, "GENERIC", False),
                                   **{f: getattr(m, f, None) for f in hooks})
    return {k.name: k for k in (_loaded[m] for m in KINDS + ENGINES)}


def detect(path: Path) -> str | None:
    """The kind of a candidate path, or None when no kind here takes it (engine kinds are only taken by name)."""
    return next((name for name, kind in kinds().items() if not kind.explicit and kind.detect(Path(path))), None)


def named(spec: str) -> tuple[Kind | None, str]:
    """``KIND:PATH`` split into the kind it names (by name or alias) and the path; (None, spec) when the text
    before a colon names no kind (a path with a colon in it)."""
    prefix, sep, rest = str(spec).partition(":")
    if sep and rest:
        for kind in kinds().values():
            if prefix == kind.name or prefix in kind.aliases:
                return kind, rest
    return None, str(spec)


def get(name: str) -> Kind | None:
    return kinds().get(name)
