"""Goldens: a reference's activations recorded once, so that a port can be checked without transformers.

    parity golden record ./gemma-2-9b -o golden/gemma-2-9b --points layers --storage float16 --calibrate
    parity check --reference golden/gemma-2-9b --candidate engine-dump.safetensors --layerwise

A golden is a directory:

    golden.json                 what was run: the token ids, the checkpoint's config and sha256s, family,
                                dtype, torch/transformers versions, the capture points, and with --calibrate
                                each point's noise floor and tolerance
    activations.safetensors     the reference's capture points ([1, S, H]) for the first input, in the
                                engine-dump format (docs/dumps.md): tensors by capture point, ids in the metadata
    activations.1.safetensors   ... one more file per further input (--inputs)

A check against a golden replays the stored activations where the transformers run would be: the
report, verdict and exit codes are a live check's. Calibration is measured as a live check measures
it (the reference again at float64 for a float32 golden, or at the golden's low dtype) and replayed
when the check's dtype is the golden's. A golden stored in float16 carries its own rounding (rel_l2
about 3e-4); no point's tolerance is set below parity.compare.ROUNDING_MARGIN times it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

import torch
from pydantic import Field, ValidationError
from safetensors import safe_open

from parity import dumps, names
from parity.adapter import load_all
from parity.checkpoint import Checkpoint, check_config, inside, open_checkpoint, resolve_config
from parity.checkpoint.inputs import Inputs, make_inputs, read_inputs_file
from parity.errors import ParityError
from parity.reference.models import Emit, replay_steps
from parity.reference.structure import discover
from parity.storage.jsonfile import StrictSpec, read_json, validation_problem
from parity.storage.shards import FLOAT_DTYPES, plain_file_name, read_header, sha256_file

FORMAT = "parity-golden"
FORMAT_VERSION = 1
DESCRIPTION = "golden.json"
SELECTIONS = ("all", "layers", "final")
STORAGE = {"float32": torch.float32, "float16": torch.float16}


def is_golden(path: Path) -> bool:
    return (Path(path) / DESCRIPTION).is_file()


def config_sha256(config: dict) -> str:
    """sha256 of the config as canonical JSON, without the transformers version that happened to save it."""
    body = {k: v for k, v in config.items() if k != "transformers_version"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoint_sha256(ckpt: Checkpoint) -> dict[str, str]:
    """The config's (canonical) and every weight file's sha256."""
    return {ckpt.config_path.name: config_sha256(ckpt.config), **{f.name: sha256_file(f) for f in ckpt.files}}


def select_points(ckpt: Checkpoint, which: str) -> list[str]:
    """``all`` capture points, the residual stream between ``layers`` (and what the model ends with), or the
    ``final`` output only."""
    if which not in SELECTIONS:
        raise ParityError(f"--points {which!r} is not one of {', '.join(SELECTIONS)}")
    points = [c.name for c in ckpt.resolved.capture]
    final = names.compared_points(ckpt, layerwise=False)
    if which == "all":
        return points
    if which == "final":
        return final
    keep = {"embed", "final_norm", *final, *(f"layers.{i}.out" for i in range(ckpt.resolved.num_layers))}
    return [p for p in points if p in keep]


def _diff_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k != "transformers_version" and a.get(k) != b.get(k))


class PointRecord(StrictSpec):
    """A point as golden.json describes it: its shape, its storage's rounding, and with --calibrate its noise."""

    shape: list[Annotated[int, Field(ge=0)]]
    storage_rel_l2: Annotated[float, Field(allow_inf_nan=False, ge=0)]
    noise: Optional[Annotated[float, Field(allow_inf_nan=False, ge=0)]] = None
    noise_isolated: Optional[Annotated[float, Field(allow_inf_nan=False, ge=0)]] = None
    tolerance: Optional[dict[str, Any]] = None


class DecodeRecord(StrictSpec):
    """--decode N: the tokens fed and each step's points (decode.{point} in the run's file)."""

    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    points: dict[str, PointRecord]


class Run(StrictSpec):
    """One input: its ids, its activations file, and each point's description."""

    source: str
    ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    file: str
    points: dict[str, PointRecord]
    decode: Optional[DecodeRecord] = None


class CheckpointRecord(StrictSpec):
    path: str
    sha256: dict[str, str]
    config: dict[str, Any]


class RecordedWith(StrictSpec):
    parity: Optional[str] = None
    torch: str
    transformers: str
    python: Optional[str] = None


class Description(StrictSpec):
    """golden.json, as far as a check reads it."""

    family: str
    dtype: Literal["float32", "bfloat16", "float16"]
    storage: Literal["float32", "float16"]
    calibrated: bool
    checkpoint: CheckpointRecord
    recorded_with: RecordedWith
    capture_points: Annotated[list[str], Field(min_length=1)]
    runs: Annotated[list[Run], Field(min_length=1)]


@dataclass
class Golden:
    path: Path
    description: Description
    checkpoint: Checkpoint     # recognised from the stored config; no weights

    @property
    def points(self) -> list[str]:
        return self.description.capture_points

    @property
    def runs(self) -> list[Run]:
        return self.description.runs

    @property
    def dtype(self) -> str:
        return self.description.dtype

    def calibrated_for(self, dtype: str, isolated: bool = False) -> bool:
        """Whether the golden holds each point's noise for ``dtype`` candidates (measured in isolation too, when
        ``isolated``: an isolated check's noise is one layer's, not the accumulated noise of a free run)."""
        if not (self.description.calibrated and self.dtype == dtype):
            return False
        return not isolated or all("noise_isolated" in info.model_fields_set
                                   for run in self.runs for info in run.points.values())

    def describe(self) -> dict:
        """The report's ``reference`` entry."""
        return {"kind": "golden", "path": str(self.path),
                "recorded_with": self.description.recorded_with.model_dump(exclude_unset=True),
                "checkpoint": self.description.checkpoint.sha256}

    kind = "golden"
    stored = True  # activations and their calibrated noise are read, not computed

    def runner(self, k: int, points: set[str] | None = None) -> Callable[[Emit], None]:
        """Emits run k's stored points (``points``, else all) in forward order as float32, in place of a
        transformers run."""
        file = run_file(self.path, self.runs[k].file)
        _keys(file)  # checked again: it may have changed since the golden was opened

        def run(emit: Emit) -> None:
            with safe_open(file, framework="pt") as handle:
                for name in self.points:
                    if points is None or name in points:
                        emit(name, handle.get_tensor(name).float())

        return run

    def decode_steps(self, n: int, k: int = 0) -> DecodeRecord:
        """Run k's decode record, refused (exit 2) unless it holds at least n steps."""
        held = self.runs[k].decode
        if held is None or len(held.tokens) < n:
            has = "no decode steps" if held is None else f"{len(held.tokens)} decode steps"
            raise ParityError(f"--reference {self.path}: the golden holds {has}; record it with --decode {n} (or "
                              f"more), or decode fewer steps")
        return held

    def step_runner(self, k: int, n: int, points: set[str]):
        """Emits run k's first n decode steps as stored, emit(step, point, [1, 1, width]) for steps 1..n."""
        return replay_steps(self.stored_steps(k, n, points), n)

    def stored_steps(self, k: int, n: int, points: set[str]) -> dict[str, torch.Tensor]:
        """Run k's first n decode steps of ``points``, as stored: point -> [1, n, width] float32."""
        self.decode_steps(n, k)
        file = run_file(self.path, self.runs[k].file)
        with safe_open(file, framework="pt") as handle:
            return {p: handle.get_tensor(f"{dumps.DECODE}{p}")[:, :n].float() for p in self.points if p in points}

    def noise(self, k: int, name: str, dtype: str, isolated: bool = False) -> float | None:
        """Point ``name``'s calibrated noise in run k (measured in isolation when ``isolated``), when the golden was
        calibrated for ``dtype``."""
        if not self.calibrated_for(dtype, isolated):
            return None
        info = self.runs[k].points[name]
        return info.noise_isolated if isolated else info.noise

    def rounding(self, k: int, name: str) -> float:
        """rel_l2 between point ``name`` as stored and as the reference computed it (0 in float32)."""
        return self.runs[k].points[name].storage_rel_l2

    def inputs(self, *, prompt: str | None = None, ids: list[int] | None = None, length: int | None = None,
               inputs_file: Path | None = None) -> list[Inputs]:
        """The golden's inputs; inputs asked for on the command line must be the same ones."""
        stored = [Inputs(torch.tensor([r.ids]), f"{r.source} (golden)") for r in self.runs]
        if prompt is None and ids is None and length is None and inputs_file is None:
            return stored
        asked = (read_inputs_file(inputs_file) if inputs_file
                 else [{"prompt": prompt, "ids": ids, "length": length}])

        def same(item: dict, run: Run) -> bool:
            text = item.get("prompt")
            if text is not None:
                return run.source == f"prompt {text!r}"
            return make_inputs(self.checkpoint, ids=item.get("ids"), length=item.get("length")).ids[0].tolist() \
                == run.ids

        if len(asked) != len(self.runs) or not all(same(a, r) for a, r in zip(asked, self.runs)):
            held = "; ".join(f"{len(r.ids)} tokens ({r.source})" for r in self.runs)
            raise ParityError(f"--reference {self.path}: the golden fixes the inputs ({held}) and they differ from "
                              f"those asked for; drop --prompt/--ids/--inputs/--length, or record a golden for them")
        return stored

    def check_options(self, *, dtype: str, calibrate: bool, isolate: bool, generate: int,
                      checkpoint: Path | None = None, adapter_dirs=()) -> None:
        """Refuse what a golden cannot answer, each with its fix; ``checkpoint`` must be the one it was recorded
        from."""
        if calibrate and not self.calibrated_for(dtype):
            why = (f"was calibrated for {self.dtype} candidates" if self.description.calibrated
                   else "was recorded without --calibrate")
            raise ParityError(f"--reference {self.path}: the golden {why}; drop --calibrate, or record it with "
                              f"--dtype {dtype} --calibrate")
        needed = {"embed", *(f"layers.{i}.out" for i in range(self.checkpoint.resolved.num_layers))}
        if isolate and not needed <= set(self.points):
            raise ParityError(f"--reference {self.path}: --isolate feeds each layer the reference's layers.*.out, "
                              f"which this golden does not hold; record it with --points layers or all")
        if generate:
            raise ParityError(f"--reference {self.path}: --generate runs the reference model, and a golden holds one "
                              f"forward pass; generate against the checkpoint itself")
        if checkpoint is not None:
            self.match(Path(checkpoint), adapter_dirs)

    def match(self, directory: Path, adapter_dirs=()) -> None:
        """Raise unless ``directory`` is the checkpoint the golden was recorded from (by sha256)."""
        ckpt = open_checkpoint(Path(directory), adapter_dirs, discover=discover)
        want, got = self.description.checkpoint.sha256, checkpoint_sha256(ckpt)
        problems = []
        for name in sorted(want.keys() | got.keys()):
            if name not in got:
                problems.append(f"{name} missing")
            elif name not in want:
                problems.append(f"{name} not in the golden")
            elif want[name] != got[name]:
                keys = _diff_keys(self.checkpoint.config, ckpt.config) if name == ckpt.config_path.name else []
                problems.append(f"{name} differs" + (f" (keys {', '.join(keys[:6])})" if keys else ""))
        if problems:
            raise ParityError(f"--checkpoint {directory} is not the checkpoint golden {self.path} was recorded from: "
                              f"{'; '.join(problems)}; record the golden again from it (parity golden record)")


def _read_description(file: Path) -> Description:
    """golden.json, read and checked against the schema (not yet against the model or the files)."""
    fix = "record the golden again with `parity golden record`"
    data = read_json(file, fix)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise ParityError(f"{file}: not a {FORMAT} v{FORMAT_VERSION} description; record the golden again with "
                          f"this parity")
    try:
        description = Description.model_validate(data)
    except ValidationError as exc:
        raise ParityError(f"{file}: {validation_problem(exc)}; {fix}") from None
    check_config(description.checkpoint.config, file, "checkpoint.config.")
    return description


def run_file(path: Path, name: str) -> Path:
    """A run's activations file: a file name inside the golden directory, also once symlinks are followed."""
    file = path / name
    if not plain_file_name(name) or not inside(file, path):
        raise ParityError(f"{path / DESCRIPTION}: run file {name[:80]!r} is not a file in the golden directory; "
                          f"record the golden again")
    return file


def _check_run(path: Path, run: Run, points: list[str], vocab: int, hidden: int) -> None:
    """A run's ids, its description of each point and its activations file agree."""
    fix = "record the golden again"
    file = run_file(path, run.file)
    ids = run.ids
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise ParityError(f"{path / DESCRIPTION}: run {run.file} holds token ids outside [0, {vocab}): "
                          f"{bad[:5]}; {fix}")
    undescribed = [p for p in points if p not in run.points]
    if undescribed:
        raise ParityError(f"{path / DESCRIPTION}: run {run.file} does not describe {', '.join(undescribed[:5])}; "
                          f"{fix}")
    header = read_header(file, fix)
    missing = [p for p in points if p not in header.tensors]
    if missing:
        raise ParityError(f"{file}: missing {', '.join(missing)}; {fix}")
    stored_ids = header.metadata.get(dumps.INPUT_IDS)
    if stored_ids is not None and dumps.parse_ids(stored_ids, file) != [ids]:
        raise ParityError(f"{file}: its input ids differ from those golden.json records for it; {fix}")
    decode = run.decode
    steps = [] if decode is None else [(f"{dumps.DECODE}{p}", p, len(decode.tokens), decode.points.get(p))
                                       for p in points]
    if decode is not None and [i for i in decode.tokens if i >= vocab]:
        raise ParityError(f"{path / DESCRIPTION}: run {run.file}'s decode tokens are outside [0, {vocab}); {fix}")
    for key, name, length, described in [(p, p, len(ids), run.points[p]) for p in points] + steps:
        entry = header.tensors.get(key)
        shape = [1, length, vocab if name == "logits" else hidden]
        if entry is None or described is None:
            raise ParityError(f"{file}: {key} is missing (from the file or golden.json); {fix}")
        if entry.dtype not in FLOAT_DTYPES or list(entry.shape) != shape or described.shape != shape:
            raise ParityError(f"{file}: {key} is {entry.dtype} {list(entry.shape)} (golden.json: "
                              f"{described.shape}), expected a float tensor of shape {shape}; {fix}")


def open_golden(path: Path, adapter_dirs=()) -> Golden:
    """Read a golden directory; its family's adapter is recognised from the stored config. Everything a check
    reads from it is checked here: the description, its config, and every run's ids and activations."""
    path = Path(path)
    file = path / DESCRIPTION
    if not file.is_file():
        raise ParityError(f"{path}: no {DESCRIPTION}; give a directory written by `parity golden record`")
    description = _read_description(file)
    config = description.checkpoint.config
    adapter, variant, resolved = resolve_config(config, file, load_all(adapter_dirs), discover)
    if resolved.family != description.family and description.family == config.get("model_type"):
        # recorded as a model no adapter knows, the adapter its architecture names not fitting the checkpoint's
        # tensors (parity.checkpoint.open_checkpoint); a golden holds no tensors to try that adapter on again
        adapter, variant, resolved = resolve_config(config, file, {}, discover)
    if resolved.family != description.family:
        raise ParityError(f"{file}: recorded as {description.family} but its config reads as {resolved.family} "
                          f"with these adapters; check --adapters")
    points = description.capture_points
    known = [c.name for c in resolved.capture]
    strange = [p for p in points if p not in known]
    if strange or len(set(points)) != len(points):
        raise ParityError(f"{file}: capture_points must be distinct capture points of this {resolved.family} model; "
                          f"{', '.join(strange[:5]) or 'some appear twice'}; record the golden again")
    vocab, hidden = resolved.embedding_shape
    for run in description.runs:
        _check_run(path, run, points, vocab, hidden)
    ckpt = Checkpoint(path=path, config_path=file, config=config, adapter=adapter, variant=variant, resolved=resolved,
                      files=[], tensors={})
    return Golden(path, description, ckpt)


def _keys(file: Path) -> set[str]:
    """The tensor names of a golden's activations file (its header checked)."""
    return set(read_header(file, "record the golden again").tensors)


def size(path: Path) -> int:
    """Bytes on disk of a golden directory."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
