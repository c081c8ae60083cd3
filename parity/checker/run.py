"""``parity check``: the run loop. A plan (parity.checker.plan) is made from the options before anything loads;
then each input is checked (parity.checker.prefill) and merged into the report, the first input is decoded
(parity.checker.decoding), the first divergence is diagnosed (parity.diagnosis.diagnose) and, with --generate, both
sides generate greedily.

The reference is a Hugging Face checkpoint run by transformers (eager attention, float32), its capture points
read by hooks that the adapter's capture map places, or a golden that stored them. The candidate is any kind of
parity.candidates. ``--calibrate`` measures each point's own precision noise (parity.checker.noise) and sets
tolerances to a multiple of it.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from parity import candidates, names
from parity.checker.decoding import compare_steps, reference_steps
from parity.checker.drill import drill
from parity.checker.judge import merge
from parity.checker.judging import Judging, choose, cost_of, cost_options, gate
from parity.checker.options import CheckOptions
from parity.checker.plan import Plan, engine_options, make_plan
from parity.checker.prefill import PromptCheck
from parity.checker.sides import candidate_kind, open_reference
from parity.checkpoint import Checkpoint, open_checkpoint
from parity.checkpoint.inputs import check_length
from parity.checkpoint.lengths import exercised
from parity.diagnosis.diagnose import diagnose, diagnose_decode
from parity.errors import ParityError
from parity.reference.models import Models, first_device
from parity.reference.structure import discover
from parity.report import PointResult, Report, Tolerance


def check(reference: Path, candidate: Path, options: CheckOptions | None = None, *,
          progress: Callable[[str], None] | None = None, on_layer: Callable[[str, int, int], None] | None = None,
          **given) -> Report:
    """Compare ``candidate`` against ``reference``; returns the report (truthy when parity holds).

    ``options`` (a CheckOptions), or the same as keyword arguments (those of ``parity check``): ``dtype``,
    ``layerwise``, ``isolate``, ``calibrate``, ``tolerance``, the inputs (``prompt``, ``ids``, ``length``,
    ``inputs_file``: with several, each point keeps its worst result and the diagnosis looks at the input where the
    first divergence was seen), ``generate`` N, ``decode`` N (the candidate's prompt and then N single-token steps
    with its own KV cache, each compared with the reference's uncached forward at that position), ``inject`` (a
    neutral candidate runs a catalogued porting mistake), ``diagnose``, ``checkpoint`` (a golden --reference's
    checkpoint, sha256-checked: the diagnosis needs its weights), ``adapter_dirs``, ``provider`` and ``maps`` (graph
    candidates), ``attn`` and ``compile`` (transformers candidates), ``engine_options``, ``stream`` (weights a layer
    at a time; None: when they would not fit), ``device`` and ``candidate_device``, ``layers`` "A:B" (a slice, from
    the reference's input to layer A; ``parity report merge`` joins slices), ``points`` ("ops": every operation too),
    ``same_weights`` (True: the reference runs the candidate's own weights, check_same_weights; False: the
    checkpoint's float weights; None: the candidate's own where they are quantized, parity.checker.judging),
    ``max_kl`` and ``min_top1`` (a gate on the candidate's logits against the float reference).
    ``progress(message)`` and ``on_layer(model, done, total)`` report what it is doing (first, how a quantized
    candidate is judged).
    """
    options = CheckOptions.of(options, **given)
    judging = choose(Path(reference), candidate, options)
    if progress is not None and judging.line():
        progress(judging.line())
    if judging.same_weights:
        if judging.chosen == "default":  # what --same-weights --calibrate does: tolerances from the engine's rounding
            options = replace(options, calibrate=True)
        report = check_same_weights(reference, candidate, options, progress=progress, on_layer=on_layer)
    else:
        if judging.quantized and judging.chosen == "default" and judging.weights.unemulated:
            options = replace(options, calibrate=True)  # tolerances 10x what the file's quantization costs
        report = run(make_plan(Path(reference), candidate, options), progress=progress, on_layer=on_layer)
    report.judging = judging.to_json()
    if judging.cost or judging.quantized:
        _quantization_cost(reference, candidate, options, judging, report, progress, on_layer)
    if judging.quantized and not judging.same_weights:
        _quantization_said(judging, report)
    return report


def _quantization_said(judging: Judging, report: Report) -> None:
    """A quantized candidate judged against the float weights whose error no catalogued mistake explains: the
    diagnosis says that its quantization accounts for an error of this size, measured where --calibrate ran the
    reference on the file's own weights."""
    unknown = next((d for d in report.diagnosis if d.get("bug") == "unknown"), None)
    first = report.first_divergence
    if unknown is None or first is None:
        return
    if first.noise:
        size = (f"its weights alone move {first.name} by rel_l2 {first.noise:.2g} (the reference run on them), "
                f"and the candidate is {first.rel_l2 / first.noise:.2g}x that")
    else:
        size = f"an error of this size ({first.rel_l2:.2g}) is what a quantization costs"
    fix = ("judge the port at its own weights: drop --float-reference" if not judging.why
           else f"it cannot be judged at its own weights here ({judging.why})")
    unknown["evidence"] += f" The candidate is {judging.weights.words()}: {size}; {fix}."


def _quantization_cost(reference: Path, candidate, options: CheckOptions, judging: Judging, report: Report,
                       progress, on_layer) -> None:
    """What the candidate's quantization costs against the float reference (a float check is that comparison
    itself; a check at the candidate's own weights runs it once more, without diagnosis), and the gate on it."""
    if judging.same_weights and not judging.cost:
        return
    if judging.same_weights:
        (progress or (lambda message: None))("measuring the quantization's cost against the float reference")
        against = run(make_plan(Path(reference), candidate, cost_options(options)), progress=progress,
                      on_layer=on_layer)
        report.warnings += [w for w in against.warnings if w not in report.warnings]
    else:
        against = report
    cost = cost_of(against)
    report.quantization = {"cost": cost, "gate": gate(cost, options)}


def run(plan: Plan, *, progress: Callable[[str], None] | None = None,
        on_layer: Callable[[str, int, int], None] | None = None) -> Report:
    say = progress or (lambda message: None)
    if plan.placement.chosen:
        say("the models do not fit in memory: streaming their weights a layer at a time")
    report = _new_report(plan)
    if plan.wrong_input is not None:
        return _wrong_input(plan, report)
    where = plan.placement
    models = Models(plan.adapter_dirs, stream=where.stream, device=where.device,
                    candidate_device=where.candidate_device)
    quantized = _quantization_weights(plan, models, report, say) if plan.quantized_noise else None
    stepped = None
    if plan.decode:  # the reference's decode steps first: then it can be dropped before the candidate is loaded
        stepped = reference_steps(plan, models, plan.inputs[0].ids, say)
    kept_by_run: dict[int, dict] = {}
    runs = []
    for k, inputs in enumerate(plan.inputs):
        # the first input is also decoded: its decode steps reach further than its prompt
        seen, warnings = exercised(plan.checkpoint, inputs.ids.shape[1] + (plan.decode if k == 0 else 0))
        report.warnings += [w for w in warnings if w not in report.warnings]
        prompt = PromptCheck(plan, models, k, inputs.ids, say, on_layer, quantized)(
            done_with_reference=k == len(plan.inputs) - 1 and not plan.generate)
        failing = prompt.failing
        for p in prompt.results:
            p.run = k
        runs.append({"source": inputs.source, "ids": inputs.ids[0].tolist(), "exercised": seen,
                     "verdict": "fail" if failing or not any(p.compared for p in prompt.results) else "pass",
                     "first_divergence": failing[0].name if failing else None})
        if failing:
            kept_by_run[k] = prompt.kept
        merge(report, prompt.results, prompt.logits)
    report.inputs = {"runs": runs}
    decoded = _decode(plan, models, stepped, report, say) if plan.decode else None
    if plan.diagnose:  # the first diverging layer at op granularity (docs/ops.md)
        drill(plan, models, report, kept_by_run, quantized, say)
    report.matching = plan.candidate.notes.matching
    report.warnings += [w for w in plan.candidate.notes.warnings if w not in report.warnings]
    _diagnose(plan, report, kept_by_run, decoded, say)
    if plan.generate:
        _generate(plan, models, report)
    return report


def _new_report(plan: Plan) -> Report:
    report = Report(family=plan.checkpoint.resolved.family, reference=_reference_entry(plan),
                    candidate=plan.candidate.describe(), dtype=plan.dtype,
                    mode="isolated" if plan.isolate else "free", layerwise=plan.layerwise, calibrated=plan.calibrate)
    if not plan.span.whole:
        report.layers = plan.span.to_json()
    r = plan.checkpoint.resolved
    if plan.checkpoint.unfit:
        report.warnings.append(f"adapter not used: {plan.checkpoint.unfit}")
    if r.generic:  # no adapter: the structure discovered from transformers, the conventions unknown
        found = r.adapter.discovered or {}
        report.generic = {"family_known": False, "model_type": r.family, "discovered": found,
                          "unchecked": list(r.adapter.unknown)}
        report.warnings.append(f"family unknown: {r.family} has no adapter, so its structure was discovered from "
                               f"{found.get('from', 'transformers')} and only its capture points are compared; not "
                               f"checked: {'; '.join(r.adapter.unknown)}; no diagnosis beyond the first divergence")
    return report


def _reference_entry(plan: Plan) -> dict:
    """The report's reference entry: the side's own, and how it was fed and its weights read where that differs."""
    entry = plan.reference.describe()
    if plan.follows:  # isolated the other way round: the candidate cannot be fed
        entry = {**entry, "fed": "the candidate's input to each layer"}
    q = plan.checkpoint.quantization
    if not plan.reference.stored and q is not None:  # an FP8 reference runs on its dequantized weights
        entry = {**entry, "quantization": {**q.to_json(), "dequantized_to": "float32",
                                           "dequantized_by": "parity, a layer at a time" if plan.placement.stream
                                           else "transformers"}}
    return entry


def _wrong_input(plan: Plan, report: Report) -> Report:
    """The candidate ran input k's ids in one of the ways ports do (parity.dumps.mistakes): the check fails at the
    pseudo-point input_ids, before embed, and names the mistake; no activation is compared (they came from another
    input). The point's max_abs is the number of positions holding another token; its other metrics are null."""
    k, found = plan.wrong_input
    nan = float("nan")
    report.points = [PointResult(name=names.INPUT_IDS, max_abs=float(found.differing), mean_abs=nan, rel_l2=nan,
                                 cosine=nan, tolerance=Tolerance(0.0, "the candidate runs the reference's token ids"),
                                 passed=False, run=k)]
    report.diagnosis = [found.diagnosis()]
    report.inputs = {"runs": [{"source": inputs.source, "ids": inputs.ids[0].tolist(), "exercised": {},
                               "verdict": "fail" if i == k else "not run",
                               "first_divergence": names.INPUT_IDS if i == k else None,
                               **({"candidate_ids": list(found.ran)} if i == k else {})}
                              for i, inputs in enumerate(plan.inputs)]}
    report.warnings.append(f"no activation was compared: the candidate ran other token ids than the reference "
                           f"({found.bug}), so position by position its activations would be compared against "
                           f"another input; run it on the ids of `parity inputs REFERENCE -o inputs.json`")
    return report


def _decode(plan: Plan, models: Models, stepped, report: Report, say: Callable[[str], None]):
    decoded = compare_steps(plan, models, stepped, plan.inputs[0].ids, say)
    report.points += decoded.points
    report.decode = decoded.summary.to_json()
    report.warnings += [f"decoding does not reach the {c['what']} ({c['at']} tokens): use a larger --decode or a "
                        f"shorter prompt" for c in decoded.summary.crossed if c["crossed"] is None]
    return decoded


def _diagnose(plan: Plan, report: Report, kept_by_run: dict[int, dict], decoded, say: Callable[[str], None]) -> None:
    """Name the likely mistake at the first divergence, re-running the executor on the checkpoint's weights."""
    first = report.first_divergence
    if not plan.diagnose or first is None or plan.checkpoint.resolved.generic:  # generic: said in the warnings
        return
    if plan.weights is None:
        report.warnings.append("no diagnosis: naming the likely mistake needs the weights; pass --checkpoint DIR")
        return
    kept = kept_by_run.get(first.run, {})
    if first.step is not None:
        say("diagnosing")
        report.diagnosis = diagnose_decode(plan.weights, decoded.kept, plan.inputs[0].ids,
                                           decoded.summary.tokens, plan.low, adapter_dirs=plan.adapter_dirs)
    elif first.name in kept.get("candidate", {}):
        say("diagnosing")
        report.diagnosis = diagnose(plan.weights, first.name, first.tolerance.rel_l2, kept["candidate"],
                                    kept["reference"], kept["ids"], plan.low, adapter_dirs=plan.adapter_dirs,
                                    layer_input=kept.get("layer_input"), drilldown=report.drilldown)


def _generate(plan: Plan, models: Models, report: Report) -> None:
    """Greedy-decode n tokens with both sides (no cache: each step re-runs the whole sequence). The candidate is
    the one the check compared, injected mistake included."""
    if report.logits is None and "logits" not in {p.name for p in report.points}:
        raise ParityError("--generate needs a model with an LM head")
    ids, n, ckpt = plan.inputs[0].ids, plan.generate, plan.checkpoint

    def greedy(step: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
        seq = ids
        for _ in range(n):
            nxt = step(seq)[0, -1].float().argmax().item()
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        return seq[0, ids.shape[1]:].tolist()

    def logits(seq: torch.Tensor) -> torch.Tensor:
        got: list[torch.Tensor] = []
        plan.candidate.run(models, 0, seq)(lambda name, t: got.append(t) if name == "logits" else None)
        if not got:
            raise ParityError(f"--generate: the {plan.kind.name} candidate {plan.candidate.path} gives no logits")
        return got[0]

    check_length(ckpt, ids.shape[1] + n)
    reference_model = models.hf(ckpt, torch.float32)
    with torch.no_grad():
        reference = greedy(lambda seq: reference_model(input_ids=seq.to(first_device(reference_model,
                                                                                    plan.placement.device))).logits)
        produced = greedy(logits)
    first = next((k for k, (a, b) in enumerate(zip(reference, produced)) if a != b), None)
    gen = {"tokens": n, "reference": reference, "candidate": produced, "first_difference": first}
    report.generation = gen
    if report.logits is not None:
        report.logits["generate"] = gen
    if first is not None:
        report.warnings.append(f"greedy generation differs from token {first} of {n}")


def _quantization_weights(plan: Plan, models: Models, report: Report,
                          say: Callable[[str], None]) -> Checkpoint | None:
    """--calibrate with a quantized candidate (a file of F16, Q8_0, ... matrices): each point's noise is what the
    file's quantization does to the reference, the reference run on the file's own dequantized weights against
    the reference itself, so that tolerances (10x that noise) are measured on this model and this file. The
    same-weights reference is loaded whole, once; the checkpoint it was read from is returned."""
    if plan.placement.stream:
        report.warnings.append("--calibrate: the models are streamed, so the quantization noise is not measured "
                               "(the same-weights reference would have to stay on disk); tolerances are the "
                               "reference's precision noise")
        return None
    say("reading the candidate's own weights back, to measure what its quantization costs")
    tmp = Path(tempfile.mkdtemp(prefix="parity-quantization-"))
    try:
        held = plan.kind.same_weights(plan.checkpoint, plan.candidate.path, tmp,
                                      dict(plan.candidate.options.engine))
        report.warnings += not_quantizations(held)
        noisy = open_checkpoint(tmp, plan.adapter_dirs)
        models.hf(noisy, torch.float32, "calibration")  # loaded now: the directory is removed below
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.candidate["quantization"] = {"types": held["types"], "noise": "the reference run on the file's own "
                                        "dequantized weights: tolerances are 10x what its quantization costs"}
    return noisy


def not_quantizations(held: dict) -> list[str]:
    """The warning for a candidate's tensors that are not a quantization of the checkpoint's (read back, they
    differ by more than rounding): the reference kept the checkpoint's own, and the check judged them."""
    wrong = held.get("not_a_quantization") or {}
    if not wrong:
        return []
    blocks = held.get("blocks_not_requantized") or {}
    listed = ", ".join(f"{name} (rel_l2 {error:.2g}" + (f"; {blocks[name]:.0%} of its blocks are not the "
                                                        f"checkpoint's quantized again" if name in blocks else "")
                       + ")" for name, error in list(wrong.items())[:4])
    return [f"{len(wrong)} of the candidate's tensors are not a quantization of the checkpoint's: {listed}"
            f"{' ...' if len(wrong) > 4 else ''}; the reference keeps the checkpoint's own there, so a port that "
            f"laid them out wrongly still fails"]


def not_in_file(held: dict) -> list[str]:
    """The warning for checkpoint tensors the candidate's file does not hold (a head or a pooler its graph leaves
    out): the reference keeps the checkpoint's own, and whatever reads them is compared as in a plain check."""
    absent = held.get("not_in_file") or []
    if not absent:
        return []
    return [f"{len(absent)} of the checkpoint's tensors are not in the candidate's file ({', '.join(absent[:3])}"
            f"{' ...' if len(absent) > 3 else ''}): the reference keeps the checkpoint's own there"]


def not_emulated(held: dict) -> list[str]:
    """The warning for the candidate's matmuls whose arithmetic the reference does not compute (MoE experts: no
    per-expert module to round the inputs of), so that their rounding is not mistaken for a porting mistake."""
    names = held.get("matmuls_not_emulated") or []
    if not names:
        return []
    return [f"{len(names)} of the candidate's weights ({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) "
            f"multiply rounded activations the reference does not round (transformers runs a layer's experts as one "
            f"fused module): that rounding is left in the comparison"]


def check_same_weights(reference: Path, candidate: Path, options: CheckOptions, *,
                       progress: Callable[[str], None] | None = None,
                       on_layer: Callable[[str, int, int], None] | None = None) -> Report:
    """``check`` with the reference built from the candidate's own weights (dequantized; --same-weights), loaded
    into transformers' model of the reference's family and computing as the candidate's engine does (the kind's
    arithmetic, e.g. the activations rounded before each matmul as the engine rounds them), so that a quantized
    candidate is judged on its compute and conventions, not on its quantization or its engine's arithmetic. The
    plain reference runs beside it: each point's error against it is reported too, and with --calibrate the
    distance between the two references is the points' noise."""
    kind, path = candidate_kind(candidate)
    if kind.same_weights is None:
        able = ", ".join(k for k, c in candidates.kinds().items() if c.same_weights is not None)
        raise ParityError(f"--same-weights reads the candidate's weights back; a {kind.name} candidate ({candidate}) "
                          f"cannot give them (kinds that can: {able})")
    if open_reference(Path(reference), options.adapter_dirs).stored:
        raise ParityError("--same-weights needs a Hugging Face --reference (its config and model class); a golden "
                          "holds activations, not a model")
    engine = engine_options(kind, options.engine_options)  # the conversion the runner will make
    ckpt = open_checkpoint(Path(reference), options.adapter_dirs)
    options = replace(options, same_weights=True)
    with tempfile.TemporaryDirectory(prefix="parity-same-weights-") as tmp:
        held = kind.same_weights(ckpt, path, Path(tmp), engine)
        arithmetic = kind.arithmetic(Path(tmp)) if kind.arithmetic is not None else None  # the engine's
        plan = make_plan(Path(tmp), candidate, options, arithmetic)
        report = run(plan, progress=progress, on_layer=on_layer)
    # the reference the user named, built from the candidate's weights (and computing as its engine does)
    report.reference = {**report.reference, "path": str(reference), "same_weights": held}
    report.warnings += not_quantizations(held) + not_in_file(held) + not_emulated(held)
    _reordered(held, report)
    return report


def _reordered(held: dict, report: Report) -> None:
    """A failing check of a file whose q/k tensors are the checkpoint's with their rows in the other RoPE order
    than its engine rotates (said by the kind's read-back): the mistake is named from the weights, before
    any hypothesis the executor re-runs (it keeps the checkpoint's own rows there, so none reproduces it)."""
    swapped = held.get("rope_order_swapped") or []
    if not swapped or report:
        return
    listed = ", ".join(swapped[:2]) + (f" and {len(swapped) - 2} more" if len(swapped) > 2 else "")
    bug = "rope-permuted"
    named = {"bug": bug, "confidence": 1.0, "residual": None,
             "evidence": f"{len(swapped)} q/k tensors of the file ({listed}) hold the checkpoint's rows in the other "
                         f"RoPE order than the engine rotates: the converter permuted q/k for the wrong pairing "
                         f"(interleaved pairs against half-split, or the reverse)"}
    report.diagnosis = [named] + [d for d in report.diagnosis if d.get("bug") not in ("unknown", bug)]


def verify_golden(path: Path, reference: Path, *, adapter_dirs=(), progress: Callable[[str], None] | None = None,
                  on_layer: Callable[[str, int, int], None] | None = None) -> Report:
    """Re-run the live reference against the golden at ``path``: a report whose failing points are drift. The
    golden stands on the reference side; the live reference, run the same way, is the candidate."""
    truth = open_reference(Path(path), adapter_dirs)
    if not truth.stored:
        raise ParityError(f"{path} is not a golden (no golden.json); record one with parity golden record")
    truth.golden.match(Path(reference), adapter_dirs)  # drift against another checkpoint would mean nothing
    options = CheckOptions(dtype="float32", layerwise=True, adapter_dirs=tuple(adapter_dirs))
    return check(Path(path), Path(reference), options, progress=progress, on_layer=on_layer)


def plain_forward(path: Path, ids: torch.Tensor, *, stream: bool, dtype: torch.dtype = torch.float32,
                  device: str = "cpu", adapter_dirs=()) -> torch.Tensor:
    """One forward of a Hugging Face checkpoint (transformers) or a neutral directory (parity's executor), with
    no comparison: the yardstick a check's cost is measured against (bench/check.py)."""
    models = Models(adapter_dirs, stream=stream, device=device, candidate_device=device)
    kind, path = candidate_kind(path)
    with torch.no_grad():
        if kind.name == "transformers":  # no hooks at all
            model = models.hf(open_checkpoint(Path(path), adapter_dirs, discover=discover), dtype)
            out = model(input_ids=ids.to(first_device(model, device)))
            return out.logits if getattr(out, "logits", None) is not None else out[0]
        emitted: list[torch.Tensor] = []

        def keep(name: str, t: torch.Tensor) -> None:  # the last point a model emits is its output
            emitted[:] = [t]

        kind.make_runner(candidates.Candidate(models, Path(path), dtype, None), ids, None)(keep)
    return emitted[0]
