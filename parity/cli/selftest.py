"""``parity selftest``: every applicable (family, bug) pair on tiny checkpoints, plus clean conversions.

For each pair the bug is injected into the family's converted tiny checkpoint and checked layer by
layer with calibrated tolerances; the matrix records whether parity caught it, where, what the
diagnosis named, and whether the checks ports usually rely on — the final output compared with
np.allclose(atol=1e-5), or the next token — would have caught it at all.

KV-cache bugs (and a clean run, for every family that decodes) are checked with ``--decode DECODE_STEPS``; the
prefill-only check of the same candidate runs beside it, and the matrix shows both.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from parity.adapter import load_all
from parity.checker.run import check
from parity.checkpoint import open_checkpoint
from parity.checkpoint.lengths import thresholds
from parity.diagnosis import bugs
from parity.diagnosis.diagnose import consistent
from parity.errors import ParityError
from parity.neutral.converter import convert
from parity.neutral.manifest import read_manifest
from parity.reference.tiny import make_tiny

DECODE_STEPS = 32
FITTED = 0.05  # how close a fitted value must come to the injected one (relative)


@dataclass
class Row:
    family: str
    bug: str                     # "clean" for an uninjected conversion; ID=VALUE: a mistake with a size at VALUE
    dtype: str
    detected: bool
    first_divergence: str | None
    diagnosed: str | None
    allclose_caught: bool        # np.allclose(final output, atol=1e-5) would have failed
    top1_caught: bool            # the next token would have differed
    check: str = "prefill"       # "prefill", or "decode N" (the KV-cache path, N steps)
    prefill_caught: bool | None = None  # a decode row: whether the prefill-only check caught it too
    first_op: str | None = None  # where the drill-down found the first divergence inside its layer (docs/ops.md)
    # whether that fits where the catalog says the mistake first shows (parity.diagnosis.diagnose.consistent: its op,
    # or one the candidate did not give before the first that diverged); None: a clean run, a decode row, a mistake
    # outside the layers, or one that first showed outside them (BERT's embedding LayerNorm)
    op_right: bool | None = None
    value: float | None = None   # the value the diagnosis fitted (a mistake with a size)

    @property
    def diagnosis_right(self) -> bool:
        """The mistake named, and one injected at a value (ID=VALUE) named with its value within FITTED."""
        bug_id, _, given = self.bug.partition("=")
        if self.diagnosed != bug_id:
            return False
        return not given or (self.value is not None and abs(self.value / float(given) - 1) <= FITTED)

    def to_json(self) -> dict:
        return {**asdict(self), "diagnosis_right": self.diagnosis_right}


def run(families: list[str] | None = None, dtype: str | None = None,
        progress: Callable[[str], None] | None = None) -> list[Row]:
    adapters = load_all()
    chosen = families or list(adapters)
    unknown = [f for f in chosen if f not in adapters]
    if unknown:
        raise ParityError(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                          f"choose from {', '.join(adapters)}")
    say = progress or (lambda message: None)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="parity-selftest-") as tmp:
        built: dict[tuple[str, int | None], tuple[Path, Path]] = {}

        def tiny(family: str, width: int | None) -> tuple[Path, Path]:
            if (family, width) not in built:
                src = make_tiny(adapters[family], Path(tmp) / f"{family}-{width}", width=width)
                built[family, width] = src, convert(src, Path(tmp) / f"{family}-{width}.neutral") and \
                    Path(tmp) / f"{family}-{width}.neutral"
            return built[family, width]

        # each mistake with a size is injected at its trial values on the first family (the adapters' order) it
        # applies to, whichever families this run covers, so that a run of some families gives their full run's rows
        home = {bug_id: where[0] for bug_id, where in bugs.families().items() if where}
        for family in chosen:
            src, neutral = tiny(family, None)
            manifest = read_manifest(neutral)
            at_width = lambda width: manifest if width is None else read_manifest(tiny(family, width)[1])  # noqa: E731
            applicable = bugs.applicable_at_width(at_width)
            cases = [(None, dtype or "float32", None, False)] + [
                (b.id, dtype or b.dtype, b.width, False) for b in applicable if not b.decode]
            # each mistake with a size at two values besides the catalog's
            cases += [(f"{b.id}={value:g}", dtype or b.dtype, b.width, False) for b in applicable
                      if b.size is not None and home.get(b.id) == family for value in bugs.trials(b, at_width(b.width))]
            short = {b.id: _first_threshold(src) for b in applicable if b.short}
            if bugs.decodes(manifest):
                cases += [(None, dtype or "float32", None, True)] + [
                    (b.id, dtype or b.dtype, b.width, True) for b in applicable if b.decode]
            for bug_id, case_dtype, width, decoding in cases:
                say(f"{family}: {bug_id or 'clean'}{' (decode)' if decoding else ''}")
                src, neutral = tiny(family, width)
                prefill = check(src, neutral, dtype=case_dtype, layerwise=True, calibrate=True, inject=bug_id,
                                length=short.get(bug_id))
                report = prefill if not decoding else check(src, neutral, dtype=case_dtype, layerwise=True,
                                                            calibrate=True, inject=bug_id, decode=DECODE_STEPS,
                                                            length=short.get(bug_id))
                logits = prefill.logits or {}  # what a port's usual final-output checks see: one forward
                first = report.first_divergence
                rows.append(Row(
                    family=family, bug=bug_id or "clean", dtype=case_dtype, detected=not report,
                    first_divergence=None if first is None else
                    first.name if first.step is None else f"step {first.step} {first.name}",
                    diagnosed=report.diagnosis[0]["bug"] if report.diagnosis else None,
                    allclose_caught=not logits.get("allclose_1e-5", True),
                    top1_caught=not logits.get("next_token_agrees", True),
                    check=f"decode {DECODE_STEPS}" if decoding else "prefill",
                    prefill_caught=not prefill if decoding else None,
                    first_op=(report.drilldown or {}).get("first") if not decoding else None,
                    op_right=_op_right(bug_id, report.drilldown) if not decoding else None,
                    value=report.diagnosis[0].get("value") if report.diagnosis else None,
                ))
    return rows


def _first_threshold(src: Path) -> int:
    """The first length at which the model's arithmetic changes (a window, a RoPE scaling's threshold): a prompt
    that long has crossed none."""
    return min(thresholds(open_checkpoint(src)).values())


def _op_right(bug_id: str | None, drilldown: dict | None) -> bool | None:
    bug = None if bug_id is None else bugs.parse(bug_id)[0]
    if bug is None or bug.op is None or drilldown is None:  # nothing drilled: it first showed outside the layers
        return None
    return drilldown.get("first") is not None and any(
        consistent(op, drilldown) for op in (bug.op, *bug.also))


@dataclass(frozen=True)
class Totals:
    pairs: int                     # (family, bug) pairs injected
    detected: int
    detection_rate: float
    diagnosed_right: int
    diagnosis_accuracy: float
    diagnosed_unknown: int
    diagnosed_wrong: int
    clean_conversions: int
    false_alarms: int              # clean conversions that failed
    allclose_would_catch: int
    top1_would_catch: int
    decode_pairs: int
    prefill_only_would_catch: int  # of the decode pairs
    ops_declared: int              # pairs whose mistake shows inside a layer, at an op the catalog declares
    op_right: int                  # ... which the drill-down found there


def totals(rows: list[Row]) -> Totals:
    injected = [r for r in rows if r.bug != "clean"]
    clean = [r for r in rows if r.bug == "clean"]
    detected = [r for r in injected if r.detected]
    return Totals(
        pairs=len(injected),
        detected=len(detected),
        detection_rate=len(detected) / len(injected) if injected else 1.0,
        diagnosed_right=sum(r.diagnosis_right for r in injected),
        diagnosis_accuracy=sum(r.diagnosis_right for r in injected) / len(injected) if injected else 1.0,
        diagnosed_unknown=sum(r.diagnosed == "unknown" for r in injected),
        diagnosed_wrong=sum(not r.diagnosis_right and r.diagnosed != "unknown" for r in injected),
        clean_conversions=len(clean),
        false_alarms=sum(r.detected for r in clean),
        allclose_would_catch=sum(r.allclose_caught for r in injected),
        top1_would_catch=sum(r.top1_caught for r in injected),
        decode_pairs=sum(r.check != "prefill" for r in injected),
        prefill_only_would_catch=sum(bool(r.prefill_caught) for r in injected if r.check != "prefill"),
        ops_declared=sum(r.op_right is not None for r in injected),
        op_right=sum(bool(r.op_right) for r in injected),
    )


def summary(rows: list[Row]) -> str:
    """The totals in one line: what `parity selftest` ends with."""
    t = totals(rows)
    return (f"{t.detected}/{t.pairs} pairs detected ({t.detection_rate:.0%}); diagnosis right for "
            f"{t.diagnosed_right}/{t.pairs} ({t.diagnosis_accuracy:.0%}), unknown for "
            f"{t.diagnosed_unknown}, wrong for {t.diagnosed_wrong}; {t.false_alarms} false alarms on "
            f"{t.clean_conversions} clean conversions. A final-output np.allclose(atol=1e-5) would have "
            f"caught {t.allclose_would_catch}/{t.pairs}, a next-token check "
            f"{t.top1_would_catch}/{t.pairs}. A prefill-only check caught {t.prefill_only_would_catch} of the "
            f"{t.decode_pairs} KV-cache pairs. The drill-down found {t.op_right} of the "
            f"{t.ops_declared} mistakes that show inside a layer at the op the catalog declares.")


def markdown(rows: list[Row]) -> str:
    """The matrix, folded (a hundred rows would bury the totals), then the summary line last.

    This is what docs/bugs.md shows, pasted as written by `parity selftest --markdown FILE`.
    """
    lines = ["<details><summary>The full matrix</summary>", "",
             "| family | bug | dtype | check | detected | first divergence | first op | diagnosis | prefill-only "
             "| allclose(1e-5) | top-1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    mark = {True: "yes", False: "no"}
    for r in rows:
        fitted = "" if r.value is None else f" = {r.value:g}"
        diag = "-" if r.diagnosed is None else (r.diagnosed + fitted + ("" if r.diagnosis_right or r.bug == "clean"
                                                                        else " ✗"))
        prefill = "-" if r.prefill_caught is None else "caught" if r.prefill_caught else "passed"
        op = (r.first_op or "-") + (" ✗" if r.op_right is False else "")
        lines.append(f"| {r.family} | {r.bug} | {r.dtype} | {r.check} | {mark[r.detected]} | "
                     f"{r.first_divergence or '-'} | {op} | {diag} | {prefill} | {mark[r.allclose_caught]} | "
                     f"{mark[r.top1_caught]} |")
    return "\n".join(lines + ["", "</details>", "", summary(rows)])
