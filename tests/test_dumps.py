"""Engine dumps: the documented format, its Python and C writers, and how `parity check` reads a dump."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import parity
from parity.checker.record import record
from parity.cli import cli
from parity.dumps import write_dump
from parity.errors import ParityError
from parity.neutral.converter import convert
from parity.neutral.executor.model import NeutralModel

ROOT = Path(__file__).resolve().parent.parent


def executor_dump(neutral: Path, ids: list[int], out: Path, keep=None) -> Path:
    """Run parity's executor on ``ids`` and dump its capture points (those ``keep`` accepts) as an engine would."""
    points: dict[str, torch.Tensor] = {}
    NeutralModel.load(neutral)(torch.tensor([ids]), on_point=lambda name, t: points.__setitem__(name, t.clone()))
    return write_dump(out, {n: t for n, t in points.items() if keep is None or keep(n)}, ids)


@pytest.fixture(scope="module")
def llama(tiny_dir, tmp_path_factory):
    """The tiny llama checkpoint, its neutral conversion, a golden of it, and the golden's ids."""
    root = tmp_path_factory.mktemp("dumps")
    neutral = root / "llama.neutral"
    convert(tiny_dir("llama"), neutral)
    golden = record(tiny_dir("llama"), root / "golden", points="all", calibrate=True)
    return {"reference": tiny_dir("llama"), "neutral": neutral, "golden": root / "golden",
            "ids": golden.runs[0].ids}


def check(*args: str):
    return CliRunner().invoke(cli, ["check", *map(str, args)])


def test_a_python_dump_holds_the_documented_format(llama, tmp_path):
    dump = executor_dump(llama["neutral"], llama["ids"], tmp_path / "dump.safetensors")
    raw = dump.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    assert json.loads(header["__metadata__"]["input_ids"]) == llama["ids"]
    assert header["embed"]["shape"] == [1, len(llama["ids"]), 64] and header["embed"]["dtype"] == "F32"
    assert header["logits"]["shape"] == [1, len(llama["ids"]), 256]
    assert not list(tmp_path.glob(".*parity-tmp*"))  # written atomically, nothing left beside it


def test_a_dump_checks_against_the_live_reference_and_the_golden(llama, tmp_path):
    dump = executor_dump(llama["neutral"], llama["ids"], tmp_path / "dump.safetensors")
    live = parity.check(llama["reference"], dump, layerwise=True, calibrate=True)
    stored = parity.check(llama["golden"], dump, layerwise=True, calibrate=True)
    neutral = parity.check(llama["reference"], llama["neutral"], layerwise=True, calibrate=True)
    assert live.verdict == stored.verdict == "pass" and live.candidate["kind"] == "dump"
    # the dump carries the executor's float32 numbers exactly: the same report as checking the executor itself
    assert [p.to_json() for p in live.points] == [p.to_json() for p in neutral.points]
    assert [p.to_json() for p in stored.points] == [p.to_json() for p in neutral.points]
    assert len(live.points) == 15 and all(p.compared for p in live.points)


def test_points_a_dump_lacks_are_listed_as_not_compared(llama, tmp_path):
    kept = {"embed", "layers.1.out", "logits"}
    dump = executor_dump(llama["neutral"], llama["ids"], tmp_path / "some.safetensors", keep=kept.__contains__)
    report = parity.check(llama["golden"], dump, layerwise=True)
    assert report.verdict == "pass"
    assert {p.name for p in report.points if p.compared} == kept
    missing = [p for p in report.points if not p.compared]
    assert len(missing) == 12 and not any(p.passed for p in missing)
    assert report.to_json()["points"][1]["compared"] is False
    # a final-only check asks for the logits, and nothing else can stand in for them
    no_logits = executor_dump(llama["neutral"], llama["ids"], tmp_path / "nologits.safetensors",
                              keep=lambda n: n != "logits")
    final = parity.check(llama["golden"], no_logits)
    assert final.verdict == "fail" and [(p.name, p.compared) for p in final.points] == [("logits", False)]


def test_a_dump_of_other_input_ids_exits_2_saying_so(llama, tmp_path):
    dump = executor_dump(llama["neutral"], llama["ids"][:10], tmp_path / "short.safetensors")
    for reference in (llama["reference"], llama["golden"]):
        result = check("--reference", reference, "--candidate", dump, "--layerwise")
        assert result.exit_code == 2, result.output
        assert "input ids differ from the reference's" in result.stderr and "parity inputs" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    # the ids parity inputs writes are the ones the check runs: a dump of them passes
    inputs = tmp_path / "inputs.json"
    assert CliRunner().invoke(cli, ["inputs", str(llama["reference"]), "-o", str(inputs)]).exit_code == 0
    (ids,) = json.loads(inputs.read_text())
    assert ids == llama["ids"]
    good = executor_dump(llama["neutral"], ids, tmp_path / "good.safetensors")
    assert check("--reference", llama["reference"], "--candidate", good, "--inputs", inputs).exit_code == 0


def test_malformed_dumps_are_refused_with_one_line(llama, tmp_path):
    dump = executor_dump(llama["neutral"], llama["ids"], tmp_path / "dump.safetensors")
    tensors = load_file(dump)
    save_file(tensors, tmp_path / "noids.safetensors")
    save_file({"layer.0.out": tensors["layers.0.out"], "layers.7.out": tensors["layers.1.out"]},
              tmp_path / "names.safetensors", metadata={"input_ids": json.dumps(llama["ids"])})
    save_file(tensors, tmp_path / "badids.safetensors", metadata={"input_ids": "20, 96"})
    cases = [
        ("noids.safetensors", [], "no 'input_ids' in the metadata"),
        ("names.safetensors", [], "not named by a capture point of this llama model: layer.0.out, layers.7.out"),
        ("badids.safetensors", [], "is not a JSON list of token ids"),
        ("dump.safetensors", ["--isolate"], "a golden cannot be fed the candidate's; drop --isolate"),
    ]
    for name, extra, message in cases:
        result = check("--reference", llama["golden"], "--candidate", tmp_path / name, "--layerwise", *extra)
        assert result.exit_code == 2 and message in result.stderr, (name, result.output)
    with pytest.raises(ParityError, match=r"shaped \[batch=1, seq=3, width\]: embed \[3, 64\]"):
        write_dump(tmp_path / "x.safetensors", {"embed": torch.zeros(3, 64)}, [1, 2, 3])


def test_a_low_precision_dump_is_judged_at_its_dtype(llama, tmp_path):
    points: dict[str, torch.Tensor] = {}
    NeutralModel.load(llama["neutral"], torch.bfloat16)(torch.tensor([llama["ids"]]),
                                                        on_point=lambda n, t: points.__setitem__(n, t.clone()))
    dump = write_dump(tmp_path / "bf16.safetensors", points, llama["ids"])
    with safe_open(dump, "pt") as handle:
        assert handle.get_tensor("embed").dtype == torch.bfloat16
    strict = parity.check(llama["reference"], dump, layerwise=True)
    assert strict.verdict == "fail"  # bf16 rounding is far above the float32 tolerance
    report = parity.check(llama["reference"], dump, layerwise=True, dtype="bfloat16", calibrate=True)
    assert report.verdict == "pass", report.first_divergence


def _compiler() -> str | None:
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def test_the_c_writer_produces_a_dump_parity_check_reads(llama, tmp_path):
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH")
    exe = tmp_path / "dump_writer"
    build = subprocess.run([compiler, "-std=c99", "-Wall", "-Wextra", "-O2", "-o", str(exe),
                            str(ROOT / "docs" / "dump_writer.c")], capture_output=True, text=True)
    assert build.returncode == 0 and not build.stderr, build.stderr
    python_dump = executor_dump(llama["neutral"], llama["ids"], tmp_path / "python.safetensors")
    args = []
    for name, t in load_file(python_dump).items():
        t.numpy().tofile(tmp_path / f"{name}.f32")
        args.append(f"{name}={tmp_path / (name + '.f32')}:{'x'.join(map(str, t.shape))}")
    c_dump = tmp_path / "c.safetensors"
    run = subprocess.run([str(exe), str(c_dump), ",".join(map(str, llama["ids"])), *args],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ours, theirs = load_file(c_dump), load_file(python_dump)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs)
    with safe_open(c_dump, "pt") as handle:
        assert json.loads(handle.metadata()["input_ids"]) == llama["ids"]
    result = check("--reference", llama["golden"], "--candidate", c_dump, "--layerwise", "--report",
                   tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["candidate"]["kind"] == "dump" and data["reference"]["kind"] == "golden"
    assert len(data["points"]) == 15 and all(p["compared"] and p["passed"] for p in data["points"])
    torch.ones(1).numpy().tofile(tmp_path / "one.f32")
    bad = subprocess.run([str(exe), str(tmp_path / "x.safetensors"), "1", f'a"b={tmp_path / "one.f32"}:1x1x1'],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "use capture-point names" in bad.stderr
    assert not (tmp_path / "x.safetensors").exists()
