"""Goldens: recorded once, checked against like the live reference, verified for drift; the committed ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import parity
from parity.checker.record import record
from parity.checker.run import verify_golden as verify
from parity.checkpoint.inputs import Prompts
from parity.cli import cli
from parity.errors import ParityError
from parity.neutral.converter import convert
from parity.reference.golden import open_golden
from parity.reference.tiny import make_tiny
from tests.conftest import ADAPTERS, FAMILIES
from tests.test_check import edited
from tests.test_dumps import executor_dump

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "golden"


@pytest.fixture(scope="module")
def built(tiny_dir, tmp_path_factory):
    """built(family) -> {"reference", "neutral", "golden"}: a float32 golden of every point, calibrated."""
    root = tmp_path_factory.mktemp("golden")
    made: dict = {}

    def get(family: str) -> dict:
        if family not in made:
            convert(tiny_dir(family), root / f"{family}.neutral")
            record(tiny_dir(family), root / f"{family}.golden", points="all", calibrate=True)
            made[family] = {"reference": tiny_dir(family), "neutral": root / f"{family}.neutral",
                            "golden": root / f"{family}.golden"}
        return made[family]

    return get


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_line(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr, result.stderr


def _first_layer1_norm(neutral: Path) -> str:
    """The first norm weight of layer 1, wherever the family places it."""
    manifest = json.loads((neutral / "manifest.json").read_text())
    return next(f"layers.1.{n}.weight" for n in ("attn_norm", "attn_post_norm", "attn_res_norm")
                if f"layers.1.{n}.weight" in manifest["tensors"])


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_golden_dump_check(family, built, tmp_path):
    b = built(family)
    ids = open_golden(b["golden"]).runs[0].ids
    good = executor_dump(b["neutral"], ids, tmp_path / "good.safetensors")
    report = parity.check(b["golden"], good, layerwise=True, calibrate=True)
    assert report.verdict == "pass", report.first_divergence
    assert report.reference["kind"] == "golden" and all(p.compared for p in report.points)

    # a deliberate bug: one norm weight of layer 1 scaled before dumping
    norm = _first_layer1_norm(b["neutral"])
    broken = edited(b["neutral"], tmp_path / "broken", lambda t: t.__setitem__(norm, t[norm] * 1.5))
    dumped = parity.check(b["golden"], executor_dump(broken, ids, tmp_path / "bad.safetensors"), layerwise=True,
                          calibrate=True)
    live = parity.check(b["reference"], broken, layerwise=True, calibrate=True)
    assert dumped.verdict == live.verdict == "fail"
    assert dumped.first_divergence.name == live.first_divergence.name
    assert dumped.first_divergence.name.startswith("layers.1.")


@pytest.mark.parametrize("mode", ["free", "isolated"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_golden_gives_the_live_checks_report(family, mode, built):
    b = built(family)
    options = {"layerwise": True, "calibrate": True, "isolate": mode == "isolated"}
    stored = parity.check(b["golden"], b["neutral"], **options)
    live = parity.check(b["reference"], b["neutral"], **options)
    # float32 storage holds the reference exactly: every number, tolerance and noise is the live check's
    assert [p.to_json() for p in stored.points] == [p.to_json() for p in live.points]
    assert stored.logits == live.logits and stored.verdict == live.verdict == "pass"
    assert stored.calibrated and stored.mode == live.mode and stored.inputs["runs"][0]["ids"] == \
        live.inputs["runs"][0]["ids"]


def test_isolation_against_a_golden_separates_inherited_error(built, tmp_path):
    b = built("llama")
    candidate = edited(b["neutral"], tmp_path / "edited",
                       lambda t: t.__setitem__("layers.0.attn.o.weight", t["layers.0.attn.o.weight"] * 1.05))
    free = {p.name: p for p in parity.check(b["golden"], candidate, layerwise=True).points}
    isolated = {p.name: p for p in parity.check(b["golden"], candidate, layerwise=True, isolate=True).points}
    assert not free["layers.0.attn_out"].passed and not isolated["layers.0.attn_out"].passed
    assert not free["layers.1.out"].passed and isolated["layers.1.out"].passed
    assert free["layers.1.out"].rel_l2 > 100 * isolated["layers.1.out"].rel_l2


def test_a_low_precision_golden_replays_its_calibration(built, tiny_dir, tmp_path):
    b = built("gemma2")
    golden = record(b["reference"], tmp_path / "bf16", dtype="bfloat16", calibrate=True, points="layers")
    neutral = tmp_path / "bf16.neutral"
    convert(b["reference"], neutral, dtype="bfloat16")
    stored = parity.check(golden.path, neutral, dtype="bfloat16", layerwise=True)
    live = parity.check(b["reference"], neutral, dtype="bfloat16", layerwise=True, calibrate=True)
    by_name = {p.name: p for p in live.points}
    assert [p.name for p in stored.points] == golden.points == \
        ["embed", "layers.0.out", "layers.1.out", "final_norm", "logits"]
    for p in stored.points:
        assert p.to_json() == by_name[p.name].to_json()
    # calibrated for bfloat16 only: a float32 check falls back to the default tolerances, --calibrate is refused
    assert all(p.tolerance.source == "float32 default" for p in parity.check(golden.path, b["neutral"]).points)
    with pytest.raises(ParityError, match="calibrated for bfloat16 candidates"):
        parity.check(golden.path, b["neutral"], calibrate=True)


def test_float16_storage_halves_the_golden_and_floors_its_tolerances(built, tmp_path):
    b = built("qwen3")
    small = record(b["reference"], tmp_path / "f16", points="layers", storage="float16", calibrate=True)
    full = record(b["reference"], tmp_path / "f32", points="layers", calibrate=True)
    size = lambda g: (g.path / "activations.safetensors").stat().st_size  # noqa: E731
    assert size(small) < 0.55 * size(full)
    report = parity.check(small.path, b["neutral"], layerwise=True)
    assert report.verdict == "pass" and report.calibrated
    for p in report.points:
        rounding = small.rounding(0, p.name)
        assert 1e-4 < rounding < 5e-4 and p.tolerance.rel_l2 == pytest.approx(3 * rounding)
        assert "storage rounding" in p.tolerance.source and p.noise == rounding
    # still sharp enough for a convention mistake
    norm = _first_layer1_norm(b["neutral"])
    broken = edited(b["neutral"], tmp_path / "broken", lambda t: t.__setitem__(norm, t[norm] * 1.5))
    assert parity.check(small.path, broken, layerwise=True).first_divergence.name == "layers.1.out"


def test_record_cli_writes_the_description_and_prints_the_size(built, tmp_path):
    b = built("gemma3")
    out = tmp_path / "g"
    result = invoke("golden", "record", b["reference"], "-o", out, "--points", "layers", "--storage", "float16",
                    "--length", "40")
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: gemma3, 7 points, 40 tokens, float16;" in result.output and "KiB" in result.output
    data = json.loads((out / "golden.json").read_text())
    assert data["family"] == "gemma3" and data["dtype"] == "float32" and data["storage"] == "float16"
    assert set(data["checkpoint"]["sha256"]) == {"config.json", "model.safetensors"}
    assert data["recorded_with"]["torch"] == torch.__version__
    assert data["recorded_with"]["transformers"] == transformers.__version__
    assert data["capture_points"] == ["embed", *(f"layers.{i}.out" for i in range(4)), "final_norm", "logits"]
    assert len(data["runs"][0]["ids"]) == 40 and not data["calibrated"]
    tensors = load_file(out / "activations.safetensors")
    assert {n: list(t.shape) for n, t in tensors.items()}["logits"] == [1, 40, 256]
    assert all(t.dtype == torch.float16 for t in tensors.values())
    # refused without --force, and a failed record leaves nothing behind
    _one_line(invoke("golden", "record", b["reference"], "-o", out), "already exists")
    _one_line(invoke("golden", "record", b["reference"], "-o", tmp_path / "bad", "--ids", "1,999"), "token ids")
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["g"]


def test_check_cli_against_a_golden(built, tmp_path):
    b = built("gemma2")
    golden, neutral = b["golden"], b["neutral"]
    ids = open_golden(golden).runs[0].ids
    ok = invoke("check", "--reference", golden, "--candidate", neutral, "--layerwise", "--checkpoint", b["reference"])
    assert ok.exit_code == 0, ok.output
    broken = edited(neutral, tmp_path / "bad",
                    lambda t: t.__setitem__("layers.1.mlp_norm.weight", t["layers.1.mlp_norm.weight"] * 1.5))
    report = tmp_path / "r.json"
    bad = invoke("check", "--reference", golden, "--candidate", broken, "--layerwise", "--calibrate",
                 "--checkpoint", b["reference"], "--report", report)
    assert bad.exit_code == 1 and "layers.1.mlp_in" in bad.output
    data = json.loads(report.read_text())
    assert data["reference"]["kind"] == "golden" and data["first_divergence"]["point"] == "layers.1.mlp_in"
    # with the checkpoint at hand, the diagnosis runs as in a live check
    live = parity.check(b["reference"], broken, layerwise=True, calibrate=True)
    assert data["diagnosis"] == json.loads(json.dumps(live.diagnosis))

    other = make_tiny(ADAPTERS["gemma2"], tmp_path / "seed1", seed=1)
    _one_line(invoke("check", "--reference", golden, "--candidate", neutral, "--checkpoint", other),
              "is not the checkpoint golden")
    assert "model.safetensors differs" in invoke("check", "--reference", golden, "--candidate", neutral,
                                                 "--checkpoint", other).stderr
    _one_line(invoke("check", "--reference", b["reference"], "--candidate", neutral, "--checkpoint", other),
              "--checkpoint goes with a golden --reference")
    _one_line(invoke("check", "--reference", golden, "--candidate", neutral, "--ids", "1,2,3"),
              "the golden fixes the inputs")
    _one_line(invoke("check", "--reference", golden, "--candidate", neutral, "--prompt", "hello"),
              "the golden fixes the inputs")
    assert invoke("check", "--reference", golden, "--candidate", neutral, "--ids", ",".join(map(str, ids))).exit_code == 0
    assert invoke("check", "--reference", golden, "--candidate", neutral, "--length", len(ids)).exit_code == 0
    _one_line(invoke("check", "--reference", golden, "--candidate", neutral, "--generate", "3"), "--generate")


def test_what_a_golden_cannot_answer_exits_2(built, tmp_path):
    b = built("llama")
    final = record(b["reference"], tmp_path / "final", points="final")
    assert final.points == ["logits"]
    assert parity.check(final.path, b["neutral"], layerwise=True).verdict == "pass"
    _one_line(invoke("check", "--reference", final.path, "--candidate", b["neutral"], "--isolate"),
              "record it with --points layers or all")
    _one_line(invoke("check", "--reference", final.path, "--candidate", b["neutral"], "--calibrate"),
              "was recorded without --calibrate")
    (final.path / "activations.safetensors").unlink()
    _one_line(invoke("check", "--reference", final.path, "--candidate", b["neutral"]), "not a readable safetensors")
    (final.path / "golden.json").write_text("{}")
    _one_line(invoke("check", "--reference", final.path, "--candidate", b["neutral"]), "not a parity-golden v1")


def test_verify_reports_drift_point_by_point(built, tmp_path):
    b = built("olmo2")
    golden = record(b["reference"], tmp_path / "g", points="layers", calibrate=True)
    same = invoke("golden", "verify", golden.path, "--reference", b["reference"])
    assert same.exit_code == 0 and "no drift" in same.output, same.output
    # what a transformers change that moved layer 1's numerics would look like
    file = golden.path / "activations.safetensors"
    tensors = load_file(file)
    tensors["layers.1.out"][0, -1] *= 1.01
    save_file(tensors, file, metadata={"input_ids": json.dumps(golden.runs[0].ids)})
    drift = invoke("golden", "verify", golden.path, "--reference", b["reference"], "--report", tmp_path / "d.json")
    assert drift.exit_code == 1 and "drift at layers.1.out" in drift.output, drift.output
    points = {p["name"]: p["passed"] for p in json.loads((tmp_path / "d.json").read_text())["points"]}
    assert points == {"embed": True, "layers.0.out": True, "layers.1.out": False, "final_norm": True, "logits": True}
    other = make_tiny(ADAPTERS["olmo2"], tmp_path / "other", layers=3)
    _one_line(invoke("golden", "verify", golden.path, "--reference", other), "config.json differs (keys ")
    assert "num_hidden_layers" in invoke("golden", "verify", golden.path, "--reference", other).stderr


def test_inputs_cli_for_a_checkpoint_and_a_golden(built, tmp_path):
    b = built("mistral")
    for source in (b["reference"], b["golden"]):
        out = tmp_path / f"{source.name}.json"
        result = invoke("inputs", source, "-o", out)
        assert result.exit_code == 0 and "1 input(s) of 64 tokens" in result.output, result.output
        assert json.loads(out.read_text()) == [open_golden(b["golden"]).runs[0].ids]
    both = tmp_path / "two.json"
    two = tmp_path / "prompts.json"
    two.write_text(json.dumps(["hello world", [5, 6, 7]]))
    assert invoke("inputs", b["reference"], "-o", both, "--inputs", two).exit_code == 0
    assert json.loads(both.read_text()) == [list(b"hello world"), [5, 6, 7]]
    # a golden of two inputs replays both; a dump is one run, so it matches only a one-input golden
    golden = record(b["reference"], tmp_path / "two", prompts=Prompts(inputs_file=two))
    assert [r.file for r in golden.runs] == ["activations.safetensors", "activations.1.safetensors"]
    assert parity.check(golden.path, b["neutral"], layerwise=True).verdict == "pass"
    assert parity.check(golden.path, b["neutral"], inputs_file=both).verdict == "pass"


# --------------------------------------------------------------------------------------------
# The committed goldens (golden/): does the installed transformers still reproduce them?


@pytest.mark.parametrize("family", FAMILIES)
def test_installed_transformers_reproduces_the_committed_golden(family, tiny_dir):
    path = COMMITTED / family
    assert (path / "golden.json").is_file(), f"golden/{family} is missing; record it as golden/README.md says"
    golden = open_golden(path)
    then = golden.description.recorded_with
    try:
        golden.match(tiny_dir(family))
    except ParityError as exc:
        pytest.fail(f"`parity make-tiny {family}` no longer builds the checkpoint golden/{family} was recorded from, "
                    f"so the golden cannot be verified (torch {torch.__version__}, transformers "
                    f"{transformers.__version__} here; recorded with torch {then.torch}, transformers "
                    f"{then.transformers}): {exc}")
    report = verify(path, tiny_dir(family))
    first = report.first_divergence
    assert report, (f"golden/{family}: transformers {transformers.__version__} (torch {torch.__version__}) no longer "
                    f"reproduces it (recorded with transformers {then.transformers}, torch {then.torch}): "
                    f"drift at {first.name}, rel_l2 {first.rel_l2:.3g} > {first.tolerance.rel_l2:.3g}")
    assert json.loads((path / "golden.json").read_text())["points"] == "layers"
    assert golden.description.storage == "float16"


def test_committed_goldens_are_small():
    sizes = [sum(f.stat().st_size for f in d.iterdir()) for d in COMMITTED.iterdir() if d.is_dir()]
    assert max(sizes) < 96 * 2**10  # each family's golden; the tiny checkpoints keep them small
    assert sorted(p.name for p in COMMITTED.iterdir() if p.is_dir()) == FAMILIES


def test_a_golden_stands_on_the_candidate_side(tiny_dir, tmp_path):
    """A golden judged like an engine's output: against the checkpoint it was recorded from it passes, prefill and
    decode; a checkpoint that no longer computes the same function fails where it starts to differ."""
    golden = record(tiny_dir("llama"), tmp_path / "g", points="all", decode=4)
    report = parity.check(tiny_dir("llama"), golden.path, layerwise=True, decode=4)
    assert report and report.candidate["kind"] == "golden"
    assert all(p.compared for p in report.points) and {p.step for p in report.points} == {None, 1, 2, 3, 4}
    assert max(p.rel_l2 for p in report.points) == 0.0  # the same float32 forward, stored in float32

    changed = tmp_path / "changed"
    changed.mkdir()
    for f in tiny_dir("llama").iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.1.input_layernorm.weight"] *= 1.5
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    report = parity.check(changed, golden.path, layerwise=True)
    assert not report and report.first_divergence.name == "layers.1.attn_in"

    with pytest.raises(ParityError, match="the golden holds no run on these 5 ids"):
        parity.check(tiny_dir("llama"), golden.path, length=5)
