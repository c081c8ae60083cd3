"""A check's plan: the options, checked and fixed once, before any model loads.

Every refusal is made here (a check must not run for an hour and then find an option it cannot honour), and
everything the run decides from the options is decided here too: the sides, the inputs, the devices, whether
the models are streamed a layer at a time, which layers are checked, the candidate's own options (typed: a kind
gets only the options it reads, and an option it does not read is refused), and where each point's noise comes
from. The plan is frozen: nothing downstream changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from parity import candidates, names
from parity.adapter import needs_family
from parity.candidates import Kind, Options
from parity.checker.options import CheckOptions
from parity.checker.sides import CandidateSide, candidate_kind, open_reference
from parity.checkpoint.inputs import Inputs
from parity.compare import Tolerances
from parity.diagnosis import bugs
from parity.errors import ParityError
from parity.reference.decode import decodes, prompt_length
from parity.reference.models import DTYPES, device_count, resolve_device, would_not_fit


@dataclass(frozen=True)
class Span:
    """The layers [start, stop) of ``of`` that a check covers (--layers A:B); a slice starts from the
    reference's input to layer ``start`` and compares only its own points (embed with the first layer, the
    final points with the last)."""

    start: int
    stop: int
    of: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.of

    def holds(self, point: str) -> bool:
        layer = names.layer_of(point)
        if layer is not None:
            return self.start <= layer < self.stop
        return self.start == 0 if point == "embed" else self.stop == self.of

    def to_json(self) -> dict:
        return {"start": self.start, "stop": self.stop, "of": self.of}


def parse_layers(spec: str | None, num_layers: int) -> Span:
    """'A:B' (either side may be left out), checked against the model's layer count."""
    if spec is None:
        return Span(0, num_layers, num_layers)
    first, sep, last = str(spec).partition(":")
    try:
        start = int(first) if first.strip() else 0
        stop = int(last) if last.strip() else num_layers
    except ValueError:
        start = stop = -1
    if not sep or not 0 <= start < stop <= num_layers:
        raise ParityError(f"--layers {spec!r}: expected A:B with 0 <= A < B <= {num_layers} (the model's layers), "
                          f"e.g. --layers 0:{max(1, num_layers // 2)}")
    return Span(start, stop, num_layers)


@dataclass(frozen=True)
class Placement:
    """Where the sides run, and whether their weights are read a layer at a time."""

    device: str
    candidate_device: str
    stream: bool                 # weights read a layer at a time
    chosen: bool                 # ... because the models would not fit (not asked for)


@dataclass(frozen=True)
class Plan:
    reference: object            # a reference side (parity.checker.sides): transformers or a golden
    candidate: CandidateSide
    dtype: str                   # the candidate's; the reference runs in float32
    layerwise: bool
    isolate: bool
    calibrate: bool              # noise measured (a live twin) or recorded (a golden calibrated for dtype)
    quantized_noise: bool        # ... measured as the reference on the candidate's own dequantized weights
    arithmetic: object           # how the candidate's engine computes (parity.engines.arithmetic), emulated
                                 # by a same-weights reference; None: float32
    tolerances: Tolerances
    inputs: tuple[Inputs, ...]
    span: Span
    decode: int                  # --decode N steps (0: none)
    generate: int                # --generate N tokens (0: none)
    placement: Placement
    diagnose: bool
    weights: Path | None         # the checkpoint a diagnosis re-runs: the reference, or a golden's --checkpoint
    adapter_dirs: tuple
    ops: bool = False            # operation-level points compared too (--points ops, a drill-down: docs/ops.md)
    wrong_input: tuple | None = None  # (input k, parity.dumps.mistakes.Found): the candidate ran input k's ids in
                                      # one of the ways ports do (a BOS doubled, ...); the check fails at input_ids
                                      # and runs neither side

    @property
    def low(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def checkpoint(self):
        return self.reference.checkpoint

    @property
    def kind(self) -> Kind:
        return self.candidate.kind

    @property
    def follows(self) -> bool:
        """--isolate on a candidate that cannot be fed (an engine runs its graph whole): each layer of the reference
        (and of its noise twin) takes the candidate's input to it instead. Either way a point's error is the one
        its layer adds; this way round the reference restarts at every layer from where the candidate is."""
        return self.isolate and not self.kind.isolates

    def wanted(self) -> list[str]:
        """The points a prompt compares: a slice compares what each of its layers hands on, like an isolated
        check (its layers are all it tests); a golden compares what it holds."""
        wanted = [p for p in names.compared_points(self.checkpoint, self.layerwise, self.isolate or not self.span.whole)
                  if self.span.holds(p)]
        if self.ops:
            wanted = sorted(wanted + [p for p in op_points(self.checkpoint) if self.span.holds(p)],
                            key=names.point_order)
        held = self.reference.points
        return wanted if held is None else [p for p in wanted if p in held]

    def step_points(self) -> list[str]:
        return names.compared_points(self.checkpoint, self.layerwise)

    def drill(self, layer: int) -> Plan:
        """The plan that re-runs layer ``layer`` at op granularity (parity.checker.drill): every point of that layer
        and its ops, the candidate fed the reference's input to it where it can be, both sides stopping after it."""
        span = Span(layer, layer + 1, self.span.of)
        options = replace(self.candidate.options, ops=True, layerwise=True, layers=range(span.start, span.stop),
                          last=layer if span.stop < span.of else None)
        side = CandidateSide(self.kind, self.candidate.path, options, self.candidate.dtype, self.checkpoint)
        side.notes = self.candidate.notes  # what it warns of goes to the same report
        return replace(self, candidate=side, span=span, layerwise=True, ops=True, decode=0, generate=0)


def op_points(ckpt) -> list[str]:
    """The operation-level points the checkpoint's adapter maps (its [ops] table), in forward order."""
    return sorted((c.name for c in ckpt.resolved.ops), key=names.point_order)


def _count(name: str, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParityError(f"--{name} must be a number of {what} >= 0 (got {value!r})")


def make_plan(reference: Path, candidate: Path, options: CheckOptions, arithmetic=None) -> Plan:
    """The plan of ``parity check`` for these options (parity.checker.run.check documents them), or the
    ParityError of the first one that cannot be honoured. ``arithmetic``: how the candidate's engine computes,
    which a same-weights reference at ``reference`` emulates (parity.checker.run.check_same_weights)."""
    o = options
    dtype, points, tolerance, inject, adapter_dirs = o.dtype, o.points, o.tolerance, o.inject, o.adapter_dirs
    calibrate, isolate, generate, decode, layers = o.calibrate, o.isolate, o.generate, o.decode, o.layers
    prompt, ids, inputs_file, length = o.prompt, o.ids, o.inputs_file, o.length
    checkpoint, stream, device = o.checkpoint, o.stream, o.device
    if dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if points not in ("layers", "ops"):
        raise ParityError(f"--points {points!r}: expected layers (the capture points) or ops (every operation too)")
    _count("generate", generate, "tokens")
    _count("decode", decode, "steps")
    tolerances = Tolerances(dtype, list(tolerance))
    if inject:
        bugs.parse(inject)
    if arithmetic is not None and not arithmetic.rounds:
        arithmetic = None  # nothing rounded (an all-F32 file): the engine computes in float32, as the reference
    truth = open_reference(Path(reference), adapter_dirs, arithmetic)
    truth.check_options(dtype=dtype, calibrate=calibrate, isolate=isolate, generate=generate, checkpoint=checkpoint,
                        adapter_dirs=adapter_dirs)
    ckpt = truth.checkpoint
    if truth.stored:  # calibrated noise comes with the golden, or not at all
        calibrate = truth.calibrated_for(dtype, isolated=isolate)
    if decode:
        length = _decode_prompt(truth, isolate, layers, decode, prompt, ids, length, inputs_file)
    inputs = tuple(truth.inputs(prompt=prompt, ids=list(ids) if ids is not None else None, length=length,
                                inputs_file=inputs_file))
    kind, candidate = candidate_kind(candidate)
    if decode and kind.make_decoder is None:
        raise ParityError(f"--decode: a {kind.name} candidate ({candidate}) cannot be run step by step by parity yet "
                          f"(kinds that decode: {', '.join(k for k, c in candidates.kinds().items() if c.make_decoder)}"
                          f"); drop --decode")
    device = resolve_device(device)
    candidate_device = resolve_device(o.candidate_device) if o.candidate_device else device
    if candidate_device == "auto":  # spreading over GPUs is for transformers models; the executor takes one
        candidate_device = resolve_device("cuda") if device_count() else "cpu"
    if ckpt.resolved.generic:  # no adapter: only what reads the points by module path or name
        _check_generic(ckpt, kind, candidate, inject)
    if inject and not kind.injects:
        raise ParityError(f"--inject needs a neutral candidate (the executor runs the mistake); {candidate} is "
                          f"{kind.name}")
    if isolate and not kind.isolates and truth.stored:  # else the reference follows the candidate (Plan.follows)
        raise ParityError(f"--isolate: a {kind.name} candidate ({candidate}) cannot be fed the reference's layer "
                          f"inputs, and a golden cannot be fed the candidate's; drop --isolate")
    span = parse_layers(layers, ckpt.resolved.num_layers)
    if not span.whole:
        _check_span(span, truth, kind, generate, Path(candidate))
    if kind.validate is not None:  # e.g. a checkpoint of an unknown family, or with wrong tensors: refused now
        kind.validate(Path(candidate), adapter_dirs)
    ops = points == "ops"
    if ops and not truth.stored and not op_points(ckpt):
        what = ("has no adapter (its structure was discovered from transformers): no operation-level points"
                if ckpt.resolved.generic else "adapter maps no operation-level points (its [ops] table)")
        raise ParityError(f"--points ops: the {ckpt.resolved.family} {what}; drop --points ops")
    given = _candidate_options(kind, o, span, ops)
    side = CandidateSide(kind, Path(candidate), given, DTYPES[dtype], ckpt)
    chosen = stream is None
    if chosen:
        shapes = kind.shapes(Path(candidate), adapter_dirs) if kind.shapes is not None else ()
        stream = not truth.stored and would_not_fit(ckpt, dtype, calibrate, device, shapes, candidate_device)
    if kind.check_options is not None:  # e.g. an attention kernel that cannot express the model's softcap
        kind.check_options(given, ckpt, bool(stream))
    # a same-weights reference computes on the file's own weights: its noise is the engine's arithmetic, or, where
    # the engine computes in float32 (nothing to emulate), float32's own noise, as for an unquantized candidate
    quantized = (calibrate and not truth.stored and not o.same_weights
                 and _quantized(kind, Path(candidate), dict(given.engine), dtype))
    # against a golden, the diagnosis needs the checkpoint's weights: --checkpoint
    weights = (Path(checkpoint) if checkpoint else None) if truth.stored else Path(reference)
    placement = Placement(device=device, candidate_device=candidate_device, stream=bool(stream),
                          chosen=chosen and bool(stream))
    return Plan(reference=truth, candidate=side, dtype=dtype, layerwise=o.layerwise or ops, isolate=isolate,
                calibrate=calibrate, quantized_noise=quantized, arithmetic=arithmetic, tolerances=tolerances,
                inputs=inputs, span=span, decode=decode, generate=generate, placement=placement,
                diagnose=o.diagnose, weights=weights, adapter_dirs=tuple(adapter_dirs), ops=ops,
                wrong_input=_wrong_input(kind, Path(candidate), inputs, ckpt))


def _wrong_input(kind: Kind, path: Path, inputs: tuple[Inputs, ...], ckpt) -> tuple | None:
    """A candidate that records the ids it ran (a dump), against each input's: the first it ran in one of the ways
    of parity.dumps.mistakes, as (k, what was found); None where it ran them all; ParityError where it ran another
    input (no verdict)."""
    if kind.check_ids is None:
        return None
    for k, given in enumerate(inputs):
        found = kind.check_ids(path, given.ids, ckpt)
        if found is not None:
            return k, found
    return None


def _check_generic(ckpt, kind: Kind, candidate: Path, inject: str | None) -> None:
    """A model no adapter knows (its structure discovered from transformers) is compared layer by layer, and
    nothing more: refuse what needs its family's conventions."""
    if inject:
        needs_family(ckpt.resolved, "--inject (a neutral candidate running a catalogued mistake)")
    if not kind.generic:
        able = ", ".join(k for k, c in candidates.kinds().items() if c.generic)
        needs_family(ckpt.resolved, f"--candidate {candidate}: a {kind.name} candidate (kinds that check a model "
                                    f"without an adapter: {able})")


def _decode_prompt(truth, isolate: bool, layers: str | None, n: int, prompt, ids, length, inputs_file) -> int | None:
    """Refuse --decode where it cannot run, each with its fix; the prompt length it chooses when none is given
    (one that makes decoding cross each sliding window)."""
    if not decodes(truth.checkpoint):
        raise ParityError(f"--decode: a {truth.checkpoint.resolved.family} model is not a causal language model (it "
                          f"has no decode steps); drop --decode")
    if isolate or layers is not None:
        raise ParityError("--decode runs the whole model from its own cache: drop --isolate and --layers")
    if truth.stored:
        truth.golden.decode_steps(n)  # a golden holds the decode steps it was recorded with
    elif prompt is None and ids is None and length is None and inputs_file is None:
        return prompt_length(truth.checkpoint, n)
    return length


def _check_span(span: Span, truth, kind: Kind, generate: int, candidate: Path) -> None:
    """A slice runs from the reference's input to its first layer: refuse what cannot give one."""
    if generate:
        raise ParityError("--generate needs the whole model; drop --layers")
    entry = "embed" if span.start == 0 else f"layers.{span.start - 1}.out"
    if truth.points is not None and span.start > 0 and entry not in truth.points:
        raise ParityError(f"--layers {span.start}:{span.stop}: the golden does not hold {entry}, the input of layer "
                          f"{span.start}; record it with --points all or --points layers")
    if kind.check_span is not None:
        kind.check_span(candidate, span.start, span.stop)


def _candidate_options(kind: Kind, o: CheckOptions, span: Span, ops: bool) -> Options:
    """The candidate's options, of the fields its kind reads: --provider and --map parsed, --candidate-attn and
    --compile, --engine-option checked against its kind's keys; each refused for a kind that does not read it."""
    if (o.provider or o.maps) and "provider" not in kind.options:
        readers = ", ".join(k for k, c in candidates.kinds().items() if "provider" in c.options)
        raise ParityError(f"--provider and --map apply to graph candidates ({readers}); this candidate is {kind.name}")
    if (o.attn or o.compile) and "attn" not in kind.options:
        raise ParityError(f"--candidate-attn and --compile apply to Hugging Face candidates run by transformers; "
                          f"this candidate is {kind.name}")
    parsed = _pairs("--map", o.maps, "POINT=VALUE, e.g. layers.0.out=/model/layers.0/Add_1_output_0")
    given_engine = engine_options(kind, o.engine_options)
    given = {"layerwise": o.layerwise or ops, "provider": o.provider, "map": tuple(sorted(parsed.items())),
             "inject": o.inject, "layers": range(span.start, span.stop),
             "last": span.stop - 1 if span.stop < span.of else None, "attn": o.attn, "compile": o.compile,
             "engine": tuple(sorted(given_engine.items()))}
    return Options(ops=ops, **{name: value for name, value in given.items() if name in kind.options})


def engine_options(kind: Kind, items) -> dict[str, str]:
    """--engine-option KEY=VALUE items parsed into {key: value}, each key checked against its kind's
    ENGINE_OPTIONS (what the plan gives the runner, and --same-weights the kind before the plan exists)."""
    given = _pairs("--engine-option", items, "KEY=VALUE, e.g. bits=4")
    known = dict(kind.engine_options)
    for key in given:
        if key not in known:
            raise ParityError(f"--engine-option {key}: a {kind.name} candidate reads "
                              + (f"only {', '.join(f'{k} ({v})' for k, v in known.items())}" if known else "none"))
    return given


def _pairs(option: str, items, example: str) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ParityError(f"{option} {item!r}: expected {example}")
        parsed[key.strip()] = value.strip()
    return parsed


def _quantized(kind: Kind, path: Path, engine: dict[str, str], dtype: str) -> bool:
    """A candidate whose noise is its weights' rounding: one that can give its own weights back, unless its kind
    says (parity.weights, from its headers or the conversion its engine options ask for, nothing
    converted) that they are float32, or a narrower float the check runs at (--dtype float16: the usual precision
    noise). One whose kind cannot tell is read back."""
    if kind.same_weights is None:
        return False
    weights = kind.weights(path, engine) if kind.weights is not None else None
    return weights is None or weights.quantized or (weights.rounded and dtype == "float32")
