"""The parity report: per-point results, the verdict, and its JSON form (its keys are fixed by docs/design.md,
"Report keys")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from parity import names
from parity.errors import ParityError

REPORT_VERSION = 1


@dataclass
class Tolerance:
    """A point passes when its rel_l2 <= rel_l2 (cosine is information: parity.compare says why)."""

    rel_l2: float
    source: str = "default"  # which step of parity.compare's precedence set it


@dataclass
class PointResult:
    name: str
    max_abs: float
    mean_abs: float
    rel_l2: float
    cosine: float
    tolerance: Tolerance
    passed: bool
    noise: float | None = None           # the reference's own precision noise (rel_l2), with --calibrate
    nonfinite: str | None = None         # "NaN in candidate", ... (fails the point)
    compared: bool = True                # False: the candidate did not provide this point
    reference_norm: float = 0.0
    run: int = 0                         # which input (--inputs) this result comes from: each point keeps its worst
    step: int | None = None              # --decode: the decode step (1..N) this result is for; None: the prefill
    plain_rel_l2: float | None = None    # against the plain reference, where the reference emulates the engine

    @property
    def needed(self) -> dict:
        """The smallest tolerance that would have passed this point."""
        return {"rel_l2": self.rel_l2}

    @property
    def noise_ratio(self) -> float | None:
        return None if not self.noise else self.rel_l2 / self.noise

    @classmethod
    def from_json(cls, data: dict) -> PointResult:
        """A point result read back from its JSON (NaN and Inf were written as null); raises on a malformed one."""
        return _point(data)

    def to_json(self) -> dict:
        out = {
            "name": self.name, "max_abs": self.max_abs, "mean_abs": self.mean_abs, "rel_l2": self.rel_l2,
            "cosine": self.cosine, "tolerance": asdict(self.tolerance), "passed": self.passed,
            "noise": self.noise, "noise_ratio": self.noise_ratio, "nonfinite": self.nonfinite,
            "compared": self.compared, "needed": self.needed, "run": self.run, "step": self.step,
        }
        return out if self.plain_rel_l2 is None else {**out, "rel_l2_plain": self.plain_rel_l2}


class Span(NamedTuple):
    """The layers [start, stop) of ``of`` a --layers report checked."""

    start: int
    stop: int
    of: int


class Head(NamedTuple):
    """The head that carries most of the first diverging op's error."""

    axis: str | None     # "head", "kv head"
    index: int
    share: float | None  # of the error (null in JSON for NaN)


class DrillKeys(NamedTuple):
    """What first_divergence says of the drill-down."""

    op: str | None
    op_before: str | None
    head: Head | None
    where: str | None

    def to_json(self) -> dict:
        return {**self._asdict(), "head": None if self.head is None else self.head._asdict()}


@dataclass
class Report:
    family: str
    reference: dict                      # {"kind": "transformers", "path": ...}
    candidate: dict                      # {"kind": "neutral" | "transformers" | ..., "path": ...}
    dtype: str
    mode: str                            # "free" | "isolated"
    layerwise: bool
    points: list[PointResult] = field(default_factory=list)
    logits: dict | None = None           # kl_mean, kl_max, top1_agreement, top5_overlap, max_logit_diff
    inputs: dict = field(default_factory=dict)       # token ids, exercised conventions, warnings
    diagnosis: list[dict] = field(default_factory=list)
    calibrated: bool = False
    warnings: list[str] = field(default_factory=list)
    # where a candidate's points were read from, for candidates that must find them (ONNX graphs):
    # {"points": {name: {"value", "how"}}, "unmatched": {name: why}}
    matching: dict | None = None
    # --generate: greedy tokens of both models and the first position where they differ
    generation: dict | None = None
    # --layers A:B: the slice checked, {"start", "stop", "of"}; None for the whole model
    layers: dict | None = None
    # --decode N: the prompt, the tokens fed, what decoding crossed, each step's worst point (parity.reference.decode)
    decode: dict | None = None
    # the first diverging layer op by op (docs/ops.md, "Report keys"): {"layer", "how", "fed", "ops" (point results,
    # PointResult.to_json() dicts, in forward order), "first", "op_before", "concentration", "summary"}; None: none
    drilldown: dict | None = None
    # a model no adapter knows (docs/generic.md): {"family_known": false, "model_type", "discovered" (where its
    # structure was found), "unchecked" (the conventions no check covers)}; None: the family's adapter was read
    generic: dict | None = None
    # how the candidate's weights were judged (parity.checker.judging): {"same_weights", "chosen", "how", "weights"
    # (what the candidate's kind says of them: quantized, scheme, bits per weight, types)}
    judging: dict | None = None
    # a quantized candidate (or a gate given): {"cost": its logit metrics and each point's rel_l2 against the float
    # reference, "gate": {"max_kl", "min_top1", "failed", "passed"} or None}
    quantization: dict | None = None

    @property
    def span(self) -> Span | None:
        """The --layers slice checked (``layers``); None for the whole model."""
        return None if self.layers is None else Span(*(self.layers[key] for key in Span._fields))

    @property
    def failing(self) -> list[PointResult]:
        return [p for p in self.points if p.compared and not p.passed]

    @property
    def gate_failed(self) -> list[str]:
        """Why the gate on the quantization's cost (--max-kl, --min-top1) fails; [] where it holds or none is set."""
        return list(((self.quantization or {}).get("gate") or {}).get("failed") or [])

    @property
    def verdict(self) -> str:
        compared = [p for p in self.points if p.compared]
        return "pass" if compared and not self.failing and not self.gate_failed else "fail"

    @property
    def first_divergence(self) -> PointResult | None:
        return next(iter(self.failing), None)

    def __bool__(self) -> bool:
        return self.verdict == "pass"

    def drill_ops(self) -> list[PointResult]:
        """The drill-down's op results in forward order ([] without one); its JSON holds them as dicts."""
        ops = (self.drilldown or {}).get("ops") or []
        return [op if isinstance(op, PointResult) else PointResult.from_json(op) for op in ops]

    def drill_keys(self) -> DrillKeys:
        """first_divergence's op, op_before, head and where (the drill-down's summary, which names the op, the heads
        and the positions), read from the drill-down; null without one."""
        d = self.drilldown or {}
        concentration = d.get("concentration") or {}
        heads = concentration.get("heads") or {}
        carrier = heads.get("carrier")
        head = None if carrier is None else Head(heads.get("axis"), carrier, heads.get("shares", [])[carrier])
        return DrillKeys(op=d.get("first"), op_before=d.get("op_before"), head=head,
                         where=d.get("summary") or concentration.get("summary") or None)

    @property
    def exit_code(self) -> int:
        return 0 if self else 1

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "parity_report_version": REPORT_VERSION,
            "verdict": self.verdict,
            "family": self.family,
            "family_known": self.generic is None,
            "reference": self.reference,
            "candidate": self.candidate,
            "dtype": self.dtype,
            "mode": self.mode,
            "layerwise": self.layerwise,
            "calibrated": self.calibrated,
            "points": [p.to_json() for p in self.points],
            "first_divergence": None if first is None else {
                "point": first.name, "rel_l2": first.rel_l2, "cosine": first.cosine, "max_abs": first.max_abs,
                "tolerance": asdict(first.tolerance), "noise": first.noise, "noise_ratio": first.noise_ratio,
                "nonfinite": first.nonfinite, "run": first.run, "step": first.step, **self.drill_keys().to_json(),
            },
            "diagnosis": self.diagnosis,
            "logits": self.logits,
            "inputs": self.inputs,
            "warnings": self.warnings,
            "matching": self.matching,
            "generation": self.generation,
            "layers": self.layers,
            "decode": self.decode,
            "drilldown": None if self.drilldown is None else {**self.drilldown, "ops": [
                op.to_json() if isinstance(op, PointResult) else op for op in self.drilldown.get("ops") or []]},
            "generic": self.generic,
            "judging": self.judging,
            "quantization": self.quantization,
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "report") -> Report:
        """A report read back from its JSON (``parity report merge``), every field it relies on checked; NaN and
        Inf were written as null."""
        fix = "give the JSON that `parity check --report FILE.json` wrote"
        if not isinstance(data, dict) or data.get("parity_report_version") != REPORT_VERSION:
            raise ParityError(f"{source}: not a parity report (parity_report_version {REPORT_VERSION}); {fix}")
        try:
            points = [_point(p) for p in _required(data, "points", list)]
            runs = _typed(_typed(data.get("inputs") or {}, dict, "inputs").get("runs", []), list, "inputs.runs")
            for run in runs:
                _typed(run, dict, "a run")
                _typed(run.get("ids"), list, "a run's ids")
                _typed(run.get("verdict"), str, "a run's verdict")
                _typed(run.get("first_divergence"), (str, type(None)), "a run's first_divergence")
            layers = _typed(data.get("layers"), (dict, type(None)), "layers")
            if layers is not None:
                start, stop, of = (layers.get(k) for k in ("start", "stop", "of"))
                if not all(type(x) is int for x in (start, stop, of)) or not 0 <= start < stop <= of:
                    raise ValueError(f"layers {layers!r} is not a slice 0 <= start < stop <= of")
            return cls(family=_required(data, "family", str), reference=_required(data, "reference", dict),
                       candidate=_required(data, "candidate", dict), dtype=_required(data, "dtype", str),
                       mode=_required(data, "mode", str), layerwise=_required(data, "layerwise", bool), points=points,
                       logits=_typed(data.get("logits"), (dict, type(None)), "logits"), inputs=data.get("inputs") or {},
                       diagnosis=_typed(data.get("diagnosis") or [], list, "diagnosis"),
                       calibrated=_typed(data.get("calibrated", False), bool, "calibrated"),
                       warnings=[_typed(w, str, "a warning") for w in _typed(data.get("warnings") or [], list,
                                                                             "warnings")],
                       matching=_typed(data.get("matching"), (dict, type(None)), "matching"),
                       generation=_typed(data.get("generation"), (dict, type(None)), "generation"), layers=layers,
                       decode=_typed(data.get("decode"), (dict, type(None)), "decode"),
                       drilldown=_drilldown(data.get("drilldown")),
                       generic=_typed(data.get("generic"), (dict, type(None)), "generic"),
                       judging=_typed(data.get("judging"), (dict, type(None)), "judging"),
                       quantization=_quantization(data.get("quantization")))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ParityError(f"{source}: a parity report with a missing or malformed field "
                              f"({str(exc)[:120]!r}); {fix}") from None


def _typed(value, kind, what: str):
    if not isinstance(value, kind):
        raise TypeError(f"{what} is {type(value).__name__}")
    return value


def _required(data: dict, key: str, kind, what: str | None = None):
    """``data[key]`` (KeyError where it is missing), checked to be a ``kind``; ``what`` names it (default: the key)."""
    return _typed(data[key], kind, key if what is None else what)


def _metric(data: dict, key: str) -> float:
    """A metric the JSON must hold (KeyError where it is missing)."""
    return _float(data[key])


def _float(x) -> float:
    """A metric as JSON holds it: a number, or null for NaN and Inf."""
    if x is None:
        return float("nan")
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{x!r} is not a number")
    return float(x)


def _point(p: dict) -> PointResult:
    name = _required(_typed(p, dict, "a point"), "name", str, "a point's name")
    names.point_order(name)  # a name parity can place in forward order
    tolerance = _required(p, "tolerance", dict, "a point's tolerance")
    noise, plain = p.get("noise"), p.get("rel_l2_plain")  # null, or not written: none measured
    return PointResult(name=name, max_abs=_metric(p, "max_abs"), mean_abs=_metric(p, "mean_abs"),
                       rel_l2=_metric(p, "rel_l2"), cosine=_metric(p, "cosine"),
                       tolerance=Tolerance(_metric(tolerance, "rel_l2"),
                                           _typed(tolerance.get("source", "default"), str, "a tolerance's source")),
                       passed=_required(p, "passed", bool),
                       noise=None if noise is None else _float(noise),
                       nonfinite=_typed(p.get("nonfinite"), (str, type(None)), "nonfinite"),
                       compared=_typed(p.get("compared", True), bool, "compared"),
                       run=_typed(p.get("run", 0), int, "run"),
                       step=_typed(p.get("step"), (int, type(None)), "step"),
                       plain_rel_l2=None if plain is None else _float(plain))


def _quantization(q) -> dict | None:
    """The quantization's cost and gate as the JSON holds them: a gate's reasons are what the verdict reads."""
    if _typed(q, (dict, type(None)), "quantization") is None:
        return None
    gate = _typed(q.get("gate"), (dict, type(None)), "quantization.gate")
    if gate is not None:
        for why in _typed(gate.get("failed") or [], list, "quantization.gate.failed"):
            _typed(why, str, "a gate's failure")
    return q


def _drilldown(d) -> dict | None:
    """The drill-down as its JSON holds it, every field it relies on checked (docs/ops.md)."""
    if _typed(d, (dict, type(None)), "drilldown") is None:
        return None
    layer = d["layer"]
    if type(layer) is not int or layer < 0:
        raise ValueError(f"drilldown.layer {layer!r} is not a layer index")
    _required(d, "how", str, "drilldown.how")
    _required(d, "fed", str, "drilldown.fed")
    for op in _required(d, "ops", list, "drilldown.ops"):
        _point(op)
    for key in ("first", "op_before"):
        _typed(d.get(key), (str, type(None)), f"drilldown.{key}")
    concentration = _typed(d.get("concentration"), (dict, type(None)), "drilldown.concentration") or {}
    for part in ("heads", "positions"):
        shares = _typed(concentration.get(part), (dict, type(None)), f"drilldown.concentration.{part}")
        if shares is not None:
            values = [_float(x) for x in _required(shares, "shares", list, f"drilldown.concentration.{part}.shares")]
            carrier = _typed(shares.get("carrier"), (int, type(None)), f"drilldown.concentration.{part}.carrier")
            if carrier is not None and not 0 <= carrier < len(values):
                raise ValueError(f"drilldown.concentration.{part}.carrier {carrier} is not one of {len(values)}")
    _typed(concentration.get("summary", ""), str, "drilldown.concentration.summary")
    _typed(d.get("summary", ""), str, "drilldown.summary")
    return d


def merge_slices(reports: list[tuple[str, Report]]) -> Report:
    """Join the reports of ``--layers`` slices (source name, report) into the report of the whole model: the
    points in forward order, so that the first divergence is the first in the model. Slices that overlap, or
    come from different checks, are refused; a layer no slice covers leaves no verdict (ParityError)."""
    if not reports:
        raise ParityError("report merge: give the JSON reports of the slices to join")
    first_source, first = reports[0]
    for source, r in reports[1:]:
        for key in ("family", "dtype", "mode", "layerwise", "calibrated"):
            if getattr(r, key) != getattr(first, key):
                raise ParityError(f"{source}: {key} {getattr(r, key)!r} differs from {first_source}'s "
                                  f"{getattr(first, key)!r}; merge the slices of one check")
        if r.candidate.get("kind") != first.candidate.get("kind"):
            raise ParityError(f"{source}: a {r.candidate.get('kind')} candidate, {first_source} a "
                              f"{first.candidate.get('kind')} one; merge the slices of one check")
        if _run_ids(r) != _run_ids(first):
            raise ParityError(f"{source}: checked other inputs than {first_source}; give every slice the same "
                              f"--length, --prompt, --ids or --inputs")
    if len(reports) == 1 and first.layers is None:
        return first
    if any(r.layers is None for _, r in reports):
        whole = next(s for s, r in reports if r.layers is None)
        raise ParityError(f"{whole}: a check of the whole model overlaps every slice; merge only --layers reports")
    counts = {r.span.of for _, r in reports}
    if len(counts) > 1:
        raise ParityError(f"report merge: the slices are of models with {sorted(counts)} layers; merge one model's")
    (of,) = counts
    ordered = sorted(reports, key=lambda sr: sr[1].span.start)
    missing, covered = [], 0
    for (source, r), (prev, _) in zip(ordered, [(None, None)] + ordered[:-1]):
        start, stop, _ = r.span
        if start < covered:
            raise ParityError(f"{source}: layers {start}:{stop} overlap {prev}'s; give each layer to one slice")
        if start > covered:
            missing.append(f"{covered}:{start}")
        covered = stop
    if covered < of:
        missing.append(f"{covered}:{of}")
    if missing:
        raise ParityError(f"report merge: no report covers layers {', '.join(missing)} of {of}; check them "
                          f"(parity check ... --layers {missing[0]} --report FILE.json) and merge that too")
    points = sorted((p for _, r in ordered for p in r.points), key=lambda p: names.point_order(p.name))
    merged = Report(family=first.family, reference=first.reference, candidate=first.candidate, dtype=first.dtype,
                    mode=first.mode, layerwise=first.layerwise, points=points, calibrated=first.calibrated,
                    judging=first.judging, quantization=_merged_cost([r for _, r in ordered]),
                    layers={"start": 0, "stop": of, "of": of,
                            "slices": [[r.span.start, r.span.stop] for _, r in ordered]})
    last = ordered[-1][1]
    merged.logits = last.logits
    merged.warnings = list(dict.fromkeys(w for _, r in ordered for w in r.warnings))
    firsts = merged.first_divergence
    if firsts is not None:  # the diagnosis and drill-down of the slice where the model first diverges
        source = next(r for _, r in ordered if any(p is firsts for p in r.points))
        merged.diagnosis, merged.drilldown = source.diagnosis, source.drilldown
    runs = []
    for k, run in enumerate(first.inputs.get("runs", [])):
        mine = [r.inputs["runs"][k] for _, r in ordered]
        runs.append({**run, "verdict": "fail" if any(m["verdict"] == "fail" for m in mine) else "pass",
                     "first_divergence": next((m["first_divergence"] for m in mine if m["first_divergence"]), None)})
    merged.inputs = {**first.inputs, "runs": runs}
    return merged


def _merged_cost(ordered: list[Report]) -> dict | None:
    """The slices' quantization costs as one: every slice's points, the last slice's logits and gate (the
    logits are its own)."""
    costs = [r.quantization for r in ordered if r.quantization]
    if not costs:
        return None
    last = costs[-1]
    points = {name: e for q in costs for name, e in ((q.get("cost") or {}).get("points") or {}).items()}
    return {**last, "cost": {**(last.get("cost") or {}), "points": points}}


def _run_ids(report: Report) -> list:
    return [run.get("ids") for run in report.inputs.get("runs", [])]
