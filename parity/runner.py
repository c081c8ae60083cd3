"""``parity check``: run the reference and a candidate side by side and compare them point by point.

The reference (parity.references) is a Hugging Face checkpoint run with transformers (eager attention), its
capture points read by hooks that the adapter's capture map places, or a golden that stored them. The
candidate is any kind of parity.candidates: a neutral directory (run with parity's executor), another
Hugging Face checkpoint, an ONNX graph, a GGUF file run by llama.cpp, an engine's dump. The reference runs in a
background thread and hands each point over as it is produced; the candidate, in this thread,
compares each of its points as it comes and drops both, so memory holds about one layer of
activations beyond the models.

``--isolate`` feeds each candidate layer the reference's input for that layer, separating the
error a layer adds from the error it inherits. ``--calibrate`` runs the reference at the
candidate's dtype (and at float64 for float32 checks) to measure each point's own precision
noise, and sets tolerances to a multiple of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import candidates, names
from .checkpoint import Checkpoint, open_checkpoint
from .compare import Tolerances, judge, logit_metrics, metrics
from .errors import ParityError
from .inputs import check_length
from .lengths import exercised
from .models import (DTYPES, LayerInputs, Models, Stream, _first_device, _memory, device_count, hf_runner,
                     layer_inputs, resolve_device, would_not_fit)
from .references import open_reference
from .report import PointResult, Report



def candidate_kind(path: Path) -> str:
    """A candidate's kind: the first of parity.candidates' kinds that takes the path."""
    found = candidates.detect(Path(path))
    if found is not None:
        return found
    if not Path(path).exists():
        raise ParityError(f"--candidate {path}: no such file or directory")
    raise ParityError(f"--candidate {path}: not a neutral directory (manifest.json), a Hugging Face checkpoint "
                      f"(config.json), an ONNX graph, a GGUF file or an engine dump (the kinds: "
                      f"{', '.join(candidates.kinds())})")


def plain_forward(path: Path, ids: torch.Tensor, *, stream: bool, dtype: torch.dtype = torch.float32,
                  device: str = "cpu", adapter_dirs=()) -> torch.Tensor:
    """One forward of a Hugging Face checkpoint (transformers) or a neutral directory (parity's executor), with
    no comparison: the yardstick a check's cost is measured against (bench/check.py)."""
    models = Models(adapter_dirs, stream=stream, device=device, candidate_device=device)
    kind = candidate_kind(Path(path))
    with torch.no_grad():
        if kind == "transformers":  # no hooks at all
            model = models.hf(open_checkpoint(Path(path), adapter_dirs), dtype)
            out = model(input_ids=ids.to(_first_device(model, device)))
            return out.logits if getattr(out, "logits", None) is not None else out[0]
        last: dict[str, torch.Tensor] = {}

        def keep(name: str, t: torch.Tensor) -> None:  # the last point a model emits is its output
            last["out"] = t

        candidates.get(kind).make_runner(models, Path(path), dtype, ids, None, None)(keep)
    return last["out"]


# --------------------------------------------------------------------------------------------
# The check


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


def check(reference: Path, candidate: Path, *, dtype: str = "float32", layerwise: bool = False,
          isolate: bool = False, calibrate: bool = False, tolerance: list[str] = (), prompt: str | None = None,
          ids: list[int] | None = None, length: int | None = None, inputs_file: Path | None = None,
          generate: int = 0, inject: str | None = None, diagnose: bool = True, checkpoint: Path | None = None,
          adapter_dirs=(), progress: Callable[[str], None] | None = None, provider: str | None = None,
          maps: list[str] | dict[str, str] = (), stream: bool | None = None, device: str = "cpu",
          candidate_device: str | None = None, on_layer: Callable[[str, int, int], None] | None = None,
          layers: str | None = None, decode: int = 0) -> Report:
    """Compare ``candidate`` against ``reference``; returns the report (truthy when parity holds).

    ``inject`` runs a neutral candidate with a catalogued porting mistake applied (parity bugs);
    ``diagnose`` names the likely mistake when parity fails. ``reference`` may be a golden (parity.golden):
    its stored activations replace the transformers run, and ``checkpoint`` must match its sha256s.
    ``provider`` (an onnxruntime execution provider) and ``maps`` ("POINT=VALUE": the graph value a
    capture point is read from) apply to ONNX candidates. With several inputs (``inputs_file``), each
    point keeps its worst result and the diagnosis looks at the input where the first divergence was seen.
    ``stream`` reads the models' weights a layer at a time (None: when they would not fit in memory);
    ``device`` runs the reference there ("cpu", "cuda", "cuda:N", "mps", "auto"), ``candidate_device`` the
    candidate (default: the same); ``on_layer(model, done, total)`` reports each model's progress.
    ``layers`` "A:B" checks only layers [A, B), starting from the reference's input to layer A (a golden's
    ``layers.{A-1}.out``); ``parity report merge`` joins the slices' reports. ``decode`` N runs the candidate's
    prompt and then N single-token steps with its own KV cache, each compared with the reference's uncached
    forward at that position (parity.decode); without a prompt, one that makes decoding cross each sliding
    window is chosen.
    """
    from . import bugs

    # everything that can be refused is refused before a model is loaded
    if dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if isinstance(generate, bool) or not isinstance(generate, int) or generate < 0:
        raise ParityError(f"--generate must be a number of tokens >= 0 (got {generate!r})")
    if isinstance(decode, bool) or not isinstance(decode, int) or decode < 0:
        raise ParityError(f"--decode must be a number of steps >= 0 (got {decode!r})")
    tolerances = Tolerances(dtype, list(tolerance))
    if inject:
        bugs.get(inject)
    truth = open_reference(Path(reference), adapter_dirs)
    truth.check_options(dtype=dtype, calibrate=calibrate, isolate=isolate, generate=generate, checkpoint=checkpoint,
                        adapter_dirs=adapter_dirs)
    ckpt = truth.checkpoint
    if truth.stored:  # calibrated noise comes with the golden, or not at all
        calibrate = truth.calibrated_for(dtype, isolated=isolate)
    if decode:
        _can_decode(truth, isolate, layers, decode)
        if not truth.stored and prompt is None and ids is None and length is None and inputs_file is None:
            from .decode import prompt_length

            length = prompt_length(ckpt, decode)
    all_inputs = truth.inputs(prompt=prompt, ids=ids, length=length, inputs_file=inputs_file)
    kind = candidate_kind(Path(candidate))
    cand = candidates.get(kind)
    if decode and cand.make_decoder is None:
        raise ParityError(f"--decode: a {kind} candidate ({candidate}) cannot be run step by step by parity yet "
                          f"(kinds that decode: {', '.join(k for k, c in candidates.kinds().items() if c.make_decoder)}"
                          f"); drop --decode")
    device = resolve_device(device)
    candidate_device = resolve_device(candidate_device) if candidate_device else device
    if candidate_device == "auto":  # spreading over GPUs is for transformers models; the executor takes one
        candidate_device = resolve_device("cuda") if device_count() else "cpu"
    if inject and not cand.injects:
        raise ParityError(f"--inject needs a neutral candidate (the executor runs the mistake); {candidate} is {kind}")
    if isolate and not cand.isolates:
        raise ParityError(f"--isolate: a {kind} candidate ({candidate}) cannot be fed the reference's layer inputs; "
                          f"drop --isolate")
    span = parse_layers(layers, ckpt.resolved.num_layers)
    if not span.whole:
        _check_span(span, truth, cand, generate, Path(candidate))
    if cand.validate is not None:  # e.g. a checkpoint of an unknown family, or with wrong tensors: refused now
        cand.validate(Path(candidate), adapter_dirs)
    report = Report(family=ckpt.resolved.family, reference=truth.describe(),
                    candidate={"kind": kind, "path": str(candidate)}, dtype=dtype,
                    mode="isolated" if isolate else "free", layerwise=layerwise, calibrated=calibrate)
    if not span.whole:
        report.layers = span.to_json()
    runs = []
    if stream is None:
        shapes = cand.shapes(Path(candidate), adapter_dirs) if cand.shapes is not None else ()
        stream = not truth.stored and would_not_fit(ckpt, dtype, calibrate, device, shapes, candidate_device)
        if stream and progress:
            progress("the models do not fit in memory: streaming their weights a layer at a time")
    _describe_quantization(report, truth, stream)
    if cand.describe is not None:
        report.candidate.update(cand.describe(Path(candidate)))
    models = Models(adapter_dirs, stream=stream, device=device, candidate_device=candidate_device)
    models.options = {**_candidate_options(kind, provider, maps, layerwise), "inject": inject,
                      "layers": range(span.start, span.stop), "last": span.stop - 1 if span.stop < span.of else None}
    types = report.candidate.get("tensor_types")  # a GGUF's, from its header
    if calibrate and not truth.stored and cand.same_weights is not None and (types is None or set(types) - {"F32"}):
        _calibrate_to_quantization(models, report, ckpt, cand, Path(candidate), progress)
    kept_by_run: dict[int, dict] = {}  # the tensors a diagnosis needs, for each input that failed
    if decode:  # the reference's decode steps first: then it can be dropped before the candidate is loaded
        from . import decode as decoding

        stepped = decoding.reference_steps(models, truth, all_inputs[0].ids, decode,
                                           names.compared_points(ckpt, layerwise), progress)
    for k, inputs in enumerate(all_inputs):
        # the first input is also decoded: its decode steps reach further than its prompt
        seen, warnings = exercised(ckpt, inputs.ids.shape[1] + (decode if k == 0 else 0))
        report.warnings += [w for w in warnings if w not in report.warnings]
        kept: dict = {"ids": inputs.ids}
        results, logits = _check_once(models, ckpt, Path(candidate), kind, inputs.ids, dtype, layerwise, isolate,
                                      calibrate, tolerances, progress, kept, truth, k, on_layer, span,
                                      done_with_reference=k == len(all_inputs) - 1 and not generate)
        failing = [p for p in results if p.compared and not p.passed]
        for p in results:
            p.run = k
        runs.append({"source": inputs.source, "ids": inputs.ids[0].tolist(), "exercised": seen,
                     "verdict": "fail" if failing or not any(p.compared for p in results) else "pass",
                     "first_divergence": failing[0].name if failing else None})
        if failing:
            kept_by_run[k] = kept
        _merge(report, results, logits)
    report.inputs = {"runs": runs}
    decoded = None
    if decode:
        decoded = decoding.compare(models, truth, stepped, cand.make_decoder, Path(candidate), all_inputs[0].ids,
                                   decode, DTYPES[dtype], tolerances, names.compared_points(ckpt, layerwise),
                                   progress)
        report.points += decoded.points
        report.decode = decoded.summary
        report.warnings += [f"decoding does not reach the {c['what']} ({c['at']} tokens): use a larger --decode "
                            f"or a shorter prompt" for c in decoded.summary["crossed"] if c["crossed"] is None]
    report.matching = models.notes.get("matching")
    report.warnings += [w for w in models.notes.get("warnings", []) if w not in report.warnings]
    # against a golden, the diagnosis needs the checkpoint's weights: --checkpoint
    source = checkpoint and Path(checkpoint) if truth.stored else Path(reference)
    first = report.first_divergence
    kept = kept_by_run.get(first.run, {}) if first is not None else {}
    if diagnose and not source and not report:
        report.warnings.append("no diagnosis: naming the likely mistake needs the weights; pass --checkpoint DIR")
    if diagnose and source and first is not None and first.step is not None:
        from .diagnose import diagnose_decode

        if progress:
            progress("diagnosing")
        report.diagnosis = diagnose_decode(source, decoded.kept, all_inputs[0].ids, decoded.summary["tokens"],
                                           DTYPES[dtype], adapter_dirs=adapter_dirs)
    elif diagnose and source and first is not None and first.name in kept.get("candidate", {}):
        from .diagnose import diagnose as name_the_bug

        if progress:
            progress("diagnosing")
        report.diagnosis = name_the_bug(source, first.name, first.tolerance.rel_l2, kept["candidate"],
                                        kept["reference"], kept["ids"], DTYPES[dtype], adapter_dirs=adapter_dirs,
                                        layer_input=kept.get("layer_input"))
    if generate:
        if report.logits is None and "logits" not in {p.name for p in report.points}:
            raise ParityError("--generate needs a model with an LM head")
        gen = _compare_generation(models, ckpt, Path(candidate), kind, all_inputs[0].ids, DTYPES[dtype], generate)
        report.generation = gen
        if report.logits is not None:
            report.logits["generate"] = gen
        if gen["first_difference"] is not None:
            report.warnings.append(f"greedy generation differs from token {gen['first_difference']} of {generate}")
    return report


def check_same_weights(reference: Path, candidate: Path, *, adapter_dirs=(), **options) -> Report:
    """``check`` with the reference built from the candidate's own weights (dequantized; --same-weights), loaded
    into transformers' model of the reference's family: a quantized candidate is then judged on its compute and
    conventions, not on its quantization."""
    import tempfile

    kind = candidate_kind(Path(candidate))
    build = getattr(candidates.get(kind), "same_weights", None)
    if build is None:
        raise ParityError(f"--same-weights reads the candidate's weights back; a {kind} candidate ({candidate}) "
                          f"cannot give them (GGUF files can)")
    if open_reference(Path(reference), adapter_dirs).stored:
        raise ParityError("--same-weights needs a Hugging Face --reference (its config and model class); a golden "
                          "holds activations, not a model")
    ckpt = open_checkpoint(Path(reference), adapter_dirs)
    with tempfile.TemporaryDirectory(prefix="parity-same-weights-") as tmp:
        held = build(ckpt, Path(candidate), Path(tmp))
        report = check(Path(tmp), candidate, adapter_dirs=adapter_dirs, **options)
    report.reference = {"kind": "transformers", "path": str(reference), "same_weights": held}
    report.warnings += _not_quantizations(held)
    return report


def _not_quantizations(held: dict) -> list[str]:
    """The warning for a candidate's tensors that are not a quantization of the checkpoint's (read back, they
    differ by more than rounding): the reference kept the checkpoint's own, and the check judged them."""
    wrong = held.get("not_a_quantization") or {}
    if not wrong:
        return []
    listed = ", ".join(f"{name} (rel_l2 {error:.2g})" for name, error in list(wrong.items())[:4])
    return [f"{len(wrong)} of the candidate's tensors are not a quantization of the checkpoint's: {listed}"
            f"{' ...' if len(wrong) > 4 else ''}; the reference keeps the checkpoint's own there, so a port that "
            f"laid them out wrongly still fails"]


def _calibrate_to_quantization(models: Models, report: Report, ckpt: Checkpoint, cand, candidate: Path,
                               progress: Callable[[str], None] | None) -> None:
    """--calibrate with a quantized candidate (a GGUF of F16, Q8_0, ... matrices): each point's noise is what the
    file's quantization does to the reference, the reference run on the file's own dequantized weights against
    the reference itself, so that tolerances (10x that noise) are measured on this model and this file, not on
    other models. The same-weights reference is loaded whole, once. (An all-F32 file, known from its header, keeps
    the usual calibration.)"""
    import shutil
    import tempfile

    if models.stream:
        report.warnings.append("--calibrate: the models are streamed, so the quantization noise is not measured "
                               "(the same-weights reference would have to stay on disk); tolerances are the "
                               "reference's precision noise")
        return
    if progress:
        progress("reading the candidate's own weights back, to measure what its quantization costs")
    tmp = Path(tempfile.mkdtemp(prefix="parity-quantization-"))
    try:
        held = cand.same_weights(ckpt, candidate, tmp)
        report.warnings += _not_quantizations(held)
        noisy = open_checkpoint(tmp, models.adapter_dirs)
        models.hf(noisy, torch.float32, "calibration")  # loaded now: the directory is removed below
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    models.options["quantized_reference"] = (noisy, torch.float32)
    report.candidate["quantization"] = {"types": held["types"], "noise": "the reference run on the file's own "
                                        "dequantized weights: tolerances are 10x what its quantization costs"}


def _can_decode(truth, isolate: bool, layers: str | None, n: int) -> None:
    """Refuse --decode where it cannot run: each with its fix."""
    from .decode import decodes

    if not decodes(truth.checkpoint):
        raise ParityError(f"--decode: a {truth.checkpoint.resolved.family} model is not a causal language model (it "
                          f"has no decode steps); drop --decode")
    if isolate or layers is not None:
        raise ParityError("--decode runs the whole model from its own cache: drop --isolate and --layers")
    if truth.stored:
        truth.decode_steps(n)  # a golden holds the decode steps it was recorded with


def _check_span(span: Span, truth, cand, generate: int, candidate: Path) -> None:
    """A slice runs from the reference's input to its first layer: refuse what cannot give one."""
    if generate:
        raise ParityError("--generate needs the whole model; drop --layers")
    entry = "embed" if span.start == 0 else f"layers.{span.start - 1}.out"
    if truth.points is not None and span.start > 0 and entry not in truth.points:
        raise ParityError(f"--layers {span.start}:{span.stop}: the golden does not hold {entry}, the input of layer "
                          f"{span.start}; record it with --points all or --points layers")
    if cand.check_span is not None:
        cand.check_span(candidate, span.start, span.stop)


def _describe_quantization(report: Report, truth, stream: bool) -> None:
    """An FP8 block-quantized reference runs on its dequantized weights (float32): the report says so."""
    q = truth.checkpoint.quantization
    if not truth.stored and q is not None:
        report.reference["quantization"] = {**q.to_json(), "dequantized_to": "float32",
                                            "dequantized_by": "parity, a layer at a time" if stream else "transformers"}


def _candidate_options(kind: str, provider: str | None, maps, layerwise: bool) -> dict:
    """--provider and --map (ONNX candidates only), checked and parsed."""
    if isinstance(maps, dict):
        maps = [f"{k}={v}" for k, v in maps.items()]
    if (provider or maps) and kind != "onnx":
        raise ParityError(f"--provider and --map apply to ONNX candidates; this candidate is {kind}")
    parsed: dict[str, str] = {}
    for item in maps:
        point, sep, value = item.partition("=")
        if not sep or not point.strip() or not value.strip():
            raise ParityError(f"--map {item!r}: expected POINT=VALUE, e.g. layers.0.out=/model/layers.0/Add_1_output_0")
        parsed[point.strip()] = value.strip()
    return {"provider": provider, "map": parsed, "layerwise": layerwise}


def _compare_generation(models: Models, ckpt: Checkpoint, candidate: Path, kind: str, ids: torch.Tensor,
                        dtype: torch.dtype, n: int) -> dict:
    """Greedy-decode n tokens with both models (no cache: each step re-runs the whole sequence). The candidate
    is the one the check compared, injected mistake included."""
    def greedy(step: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
        seq = ids
        for _ in range(n):
            nxt = step(seq)[0, -1].float().argmax().item()
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        return seq[0, ids.shape[1]:].tolist()

    def logits(seq: torch.Tensor) -> torch.Tensor:
        got: list[torch.Tensor] = []
        run = candidates.get(kind).make_runner(models, candidate, dtype, seq, None, ckpt)
        run(lambda name, t: got.append(t) if name == "logits" else None)
        if not got:
            raise ParityError(f"--generate: the {kind} candidate {candidate} gives no logits")
        return got[0]

    check_length(ckpt, ids.shape[1] + n)
    reference_model = models.hf(ckpt, torch.float32)
    with torch.no_grad():
        reference = greedy(lambda seq: reference_model(input_ids=seq).logits)
        produced = greedy(logits)
    first = next((k for k, (a, b) in enumerate(zip(reference, produced)) if a != b), None)
    return {"tokens": n, "reference": reference, "candidate": produced, "first_difference": first}


def _severity(p: PointResult) -> tuple[int, float]:
    """How bad a point's result is: failing beats passing beats not compared; then rel_l2 / tolerance."""
    if not p.compared:
        return (0, 0.0)
    ratio = p.rel_l2 / p.tolerance.rel_l2 if p.tolerance.rel_l2 > 0 else float("inf")
    if p.nonfinite or ratio != ratio:  # NaN, Inf, shape: as bad as it gets
        ratio = float("inf")
    return (1 if p.passed else 2, ratio)


# several inputs: the worst of each logit metric
_WORST_LOGITS = {"kl_mean": max, "kl_max": max, "max_logit_diff": max, "top1_agreement": min, "top5_overlap": min,
                 "allclose_1e-5": min, "next_token_agrees": min, "positions": lambda a, b: a + b}


def _merge(report: Report, results: list[PointResult], logits: dict | None) -> None:
    """Several inputs: each point keeps its worst result (a failure is never replaced by a pass)."""
    if not report.points:
        report.points, report.logits = results, logits
        return
    worst = {p.name: p for p in report.points}
    for p in results:
        if p.name not in worst or _severity(p) > _severity(worst[p.name]):
            worst[p.name] = p
    report.points = sorted(worst.values(), key=lambda p: names.point_order(p.name))
    if logits and report.logits:
        report.logits = {k: _WORST_LOGITS[k](report.logits[k], logits[k]) if k in _WORST_LOGITS else report.logits[k]
                         for k in report.logits}
    elif logits or report.logits:  # one input's logits could not be compared: no summary stands for all
        report.logits = None


def _points_fit(ckpt: Checkpoint, ids: torch.Tensor, points: set[str], device: str) -> bool:
    """Whether the reference's float32 points (the logits [positions, vocabulary] included) take under a tenth of
    the memory free where it runs."""
    vocab, hidden = next(t.shape for t in ckpt.resolved.tensors if t.neutral == ("embed.tokens.weight",))
    nbytes = ids.numel() * 4 * sum(vocab if p == "logits" else hidden for p in points)
    free = _memory(device)
    return free is None or nbytes < 0.1 * free


def _check_once(models: Models, ckpt: Checkpoint, candidate: Path, kind: str, ids: torch.Tensor, dtype: str, layerwise: bool,
                isolate: bool, calibrate: bool, tolerances: Tolerances, progress: Callable[[str], None] | None,
                kept: dict | None = None, truth=None,
                run_index: int = 0, on_layer: Callable[[str, int, int], None] | None = None,
                span: Span | None = None, done_with_reference: bool = False) -> tuple[list[PointResult], dict | None]:
    """One prompt. ``kept`` (when given) receives the two sides' tensors at the first failing point and
    the final output, for the diagnosis. ``truth`` (parity.references) runs input ``run_index`` as the reference;
    a stored one (a golden) also gives each point's noise.
    ``done_with_reference``: no later prompt runs the reference, so a whole one is dropped once it has run."""
    say = progress or (lambda message: None)
    low = DTYPES[dtype]
    n_layers = ckpt.resolved.num_layers
    span = span or Span(0, n_layers, n_layers)
    # a slice compares what each of its layers hands on, like an isolated check: its layers are all it tests
    wanted = [p for p in names.compared_points(ckpt, layerwise, isolate or not span.whole) if span.holds(p)]
    input_of = layer_inputs(n_layers)
    # the layers fed the reference's input: every one when isolating, else a slice's first (when the candidate
    # can be fed: a dump or a graph runs from its own start)
    feedable = getattr(candidates.get(kind), "isolates", True)
    feeding = set(range(n_layers + 1)) if isolate else ({span.start} if span.start > 0 and feedable else set())
    entry = next((p for p, i in input_of.items() if i == span.start), None) if span.start > 0 else None
    noise_inputs = LayerInputs() if feeding else None
    # each stream emits only what is compared (and what feeds a layer): nothing else is held
    needed = set(wanted) | {p for p, i in input_of.items() if i in feeding}
    last = span.stop - 1 if span.stop < n_layers else None  # the models stop after the slice

    def layer_done(label: str) -> Callable[[int], None] | None:
        return None if on_layer is None else (lambda i: on_layer(label, i + 1, n_layers))
    # the reference at float32 is the truth; calibration adds the reference at the candidate's dtype
    # (or float64 for a float32 check): their distance is each point's own precision noise. An isolated
    # check calibrates in isolation too: the noisy reference's layers are fed the float32 reference's inputs,
    # so each point's noise is one layer's, not the noise accumulated over the layers before it.
    # held whole, the models run one after the other when the reference's points fit beside them: side by side
    # they would share the same cores, each op already spread over all of them, and pay for it; streamed (or
    # with points too many to hold), they run in step, so that few points are held at a time
    ahead = not models.stream and not truth.stored and _points_fit(ckpt, ids, needed, models.device["reference"])
    if truth.points is not None:  # a golden holds the points it was recorded with
        wanted = [n for n in wanted if n in truth.points]
    say("loading the reference")
    streams = {"reference": Stream(truth.runner(models, run_index, ids, points=needed,
                                                on_layer=layer_done("reference"), last=last), truth.kind,
                                   bound=0 if ahead else 4)}
    if calibrate and not truth.stored:
        # a quantized candidate's noise is its quantization: the reference run on the file's own weights
        noisy_ckpt, other = models.options.get("quantized_reference") or (ckpt, torch.float64 if low == torch.float32
                                                                          else low)
        say(f"loading the reference at {str(other).removeprefix('torch.')} for calibration")
        feed_noise = (lambda i, x: noise_inputs.feed(i, x) if i in feeding else x) if noise_inputs else None
        streams["noise"] = Stream(hf_runner(models, noisy_ckpt, other, ids, feed_noise, "calibration", points=needed,
                                            on_layer=layer_done("calibration"), last=last),
                                  "reference (calibration)")

    last_reference_out: dict[int, torch.Tensor] = {}
    results: list[PointResult] = []
    logits: dict | None = None
    wanted_set = set(wanted)

    def feed(i: int, x: torch.Tensor) -> torch.Tensor:
        if i not in feeding:
            return x
        ref = last_reference_out.pop(i, None)
        if ref is None and i == span.start and entry is not None:  # the candidate skipped the layers before
            ref = streams["reference"].get(entry)
            if noise_inputs is not None and ref is not None:
                noise_inputs.put(i, ref)
        return x if ref is None else ref.to(x.device, x.dtype)

    candidate_done = layer_done("candidate")
    reference_input: dict[int, torch.Tensor] = {}  # the reference's input to the layer being compared

    def on_point(name: str, got: torch.Tensor) -> None:
        nonlocal logits
        if candidate_done is not None and input_of.get(name, 0) > 0:  # layers.{i}.out: layer i is done
            candidate_done(input_of[name] - 1)
        if name not in needed:
            return
        ref = streams["reference"].get(name)
        noisy = streams["noise"].get(name) if "noise" in streams else None
        if ref is None:
            return
        if ref.device != got.device:  # models on different devices are compared where the candidate is
            ref = ref.to(got.device)
            noisy = None if noisy is None else noisy.to(got.device)
        if input_of.get(name) in feeding:
            last_reference_out[input_of[name]] = ref
            noise_inputs.put(input_of[name], ref)
        if name not in wanted_set:
            return
        if not truth.stored:
            noise, rounding = (metrics(noisy, ref)["rel_l2"] if noisy is not None else None), 0.0
        else:
            noise, rounding = truth.noise(run_index, name, dtype, isolated=isolate), truth.rounding(run_index, name)
        # a golden's storage rounding is part of this comparison's noise
        result = judge(name, metrics(got, ref), tolerances.for_point(name, noise, rounding),
                       noise if noise is None else max(noise, rounding))
        results.append(result)
        first_failure = not result.passed and not any(not p.passed for p in results[:-1])
        if kept is not None and (name in ("logits", "final_norm") or first_failure):
            kept.setdefault("candidate", {})[name] = got.detach().to("cpu", copy=True)
            kept.setdefault("reference", {})[name] = ref.detach().to("cpu", copy=True)
        if kept is not None and first_failure and names.layer_of(name) in reference_input:
            # the diagnosis re-runs only this layer, from the reference's input to it
            kept["layer_input"] = reference_input[names.layer_of(name)].detach().to("cpu", copy=True)
        if input_of.get(name) is not None:  # only the latest layer input is held
            reference_input.clear()
            reference_input[input_of[name]] = ref
        if name == "logits":
            logits = logit_metrics(got, ref)
        if name.endswith(".out"):
            say(f"compared {name}")

    if ahead:
        streams["reference"].thread.join()
        if done_with_reference:  # the candidate is loaded into the memory the reference held
            models.release("reference")
    say(f"running the candidate ({kind})")
    try:  # the reference streams are running: whatever happens, let them finish
        fed = feed if feeding else None
        run = candidates.get(kind).make_runner(models, candidate, low, ids, fed, ckpt)
        run(on_point)
    finally:
        if noise_inputs is not None:
            noise_inputs.close()
        for s in streams.values():
            s.drain()
    produced = {p.name for p in results}
    for name in wanted:
        if name not in produced:
            results.append(PointResult(name=name, max_abs=float("nan"), mean_abs=float("nan"), rel_l2=float("nan"),
                                       cosine=float("nan"), tolerance=tolerances.for_point(name), passed=False,
                                       compared=False))
    results.sort(key=lambda p: names.point_order(p.name))
    return results, logits


def verify_golden(path: Path, reference: Path, *, adapter_dirs=(), progress: Callable[[str], None] | None = None):
    """Re-run the live reference against the golden at ``path``: a report whose failing points are drift."""
    truth = open_reference(Path(path), adapter_dirs)
    if not truth.stored:
        raise ParityError(f"{path} is not a golden (no golden.json); record one with parity golden record")
    truth.match(Path(reference), adapter_dirs)  # drift against another checkpoint would mean nothing
    # the golden holds the float32 reference: the live one, run the same way, is the candidate
    return check(Path(path), Path(reference), dtype="float32", layerwise=True, adapter_dirs=adapter_dirs,
                 progress=progress)
