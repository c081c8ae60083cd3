"""Every way a check can be run is a gate: an injected porting bug fails each of them, at the same place.

The matrix runs three catalogued bugs (one in attention, one in the norms, one in the head) through every
mode: final-only, --layerwise, --isolate with and without --layerwise, --calibrate, several prompts (the bug
visible in only one of them), --generate, a golden reference, an engine dump, an ONNX graph, a Hugging Face
checkpoint carrying the same mistake in its weights or config, the Python API and assert_parity. Every cell
must exit 1 and name the same first divergence: the bug's own point, or, where a mode compares fewer
points, the first of its points downstream of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import parity
from parity import names
from parity.checker.judge import merge
from parity.checker.record import record
from parity.checkpoint import open_checkpoint
from parity.checkpoint.inputs import select_inputs
from parity.cli import cli
from parity.compare import Tolerance
from parity.diagnosis import bugs
from parity.dumps import write_dump
from parity.engines.onnx.export import export
from parity.neutral.converter import convert
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load
from parity.report import PointResult, Report
from parity.rope import half_permutation
from parity.testing import assert_parity

FAMILY = "gemma2"  # all three bugs apply: RoPE, `1 + w` norms, a final softcap
BUGS = {"rope-permuted": "layers.0.attn_out", "norm-offset-dropped": "layers.0.attn_in",
        "final-softcap-dropped": "logits"}
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def world(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    src = tiny_dir(FAMILY)
    neutral = convert(src, root / "neutral") and root / "neutral"
    golden = record(src, root / "golden", points="all", calibrate=True).path
    ids = select_inputs(open_checkpoint(src))[0].ids
    return {"root": root, "src": src, "neutral": neutral, "golden": golden, "ids": ids, "made": {}}


def _candidate(world, bug: str, how: str) -> Path:
    """The port with ``bug``, as an engine dump, an ONNX graph or a Hugging Face checkpoint (built once)."""
    key = (bug, how)
    if key in world["made"]:
        return world["made"][key]
    out = world["root"] / f"{bug}-{how}"
    if how == "dump":  # what an engine with this bug would dump: the injected executor's every point
        manifest, tensors = load(world["neutral"])
        manifest, tensors = bugs.inject(bug, manifest, tensors)
        points: dict[str, torch.Tensor] = {}
        NeutralModel(manifest, tensors, torch.float32)(world["ids"], on_point=lambda n, t: points.setdefault(n, t.clone()))
        out = write_dump(out.with_suffix(".safetensors"), points, world["ids"])
    elif how == "onnx":
        out = out.with_suffix(".onnx")
        export(world["src"], out, debug_outputs=True, inject=bug)
    elif how == "hf":
        out = _broken_checkpoint(world["src"], out, bug)
    world["made"][key] = out
    return out


def _broken_checkpoint(src: Path, out: Path, bug: str) -> Path:
    """A Hugging Face checkpoint that transformers runs with the mistake: the same function a port computes."""
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    if bug == "final-softcap-dropped":
        config["final_logit_softcapping"] = None
    elif bug == "norm-offset-dropped":  # Gemma computes 1 + w: storing w - 1 makes it compute w
        tensors = {k: v - 1 if "norm" in k else v for k, v in tensors.items()}
    elif bug == "rope-permuted":  # rows reordered so that the half-split rotation pairs adjacent dims
        head_dim = config["head_dim"]
        perm = half_permutation(head_dim, head_dim)
        for k in list(tensors):
            if k.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
                w = tensors[k]
                heads = w.reshape(-1, head_dim, *w.shape[1:])
                tensors[k] = heads[:, perm].reshape(w.shape).contiguous()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _expected(first: str, compared: list[str]) -> str:
    """The first point a mode compares at or after the bug's own first divergence."""
    order = names.point_order(first)
    return next(p for p in compared if names.point_order(p) >= order)


def _cli(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["check", *args, "--report", str(out)])
    assert result.exit_code == 1, (result.exit_code, result.output, getattr(result, "stderr", ""))
    report = json.loads(out.read_text())
    assert report["verdict"] == "fail"
    return report


MODES = ["final", "layerwise", "isolate", "isolate-layerwise", "calibrate", "calibrate-isolate", "inputs",
         "generate", "golden", "golden-isolate", "dump", "golden-dump", "onnx", "hf", "hf-isolate", "api",
         "assert_parity"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_every_mode_fails_a_broken_port_at_the_same_point(bug, mode, world, tmp_path):
    src, neutral, golden = str(world["src"]), str(world["neutral"]), str(world["golden"])
    inject = ["--candidate", neutral, "--inject", bug]
    all_points = [c.name for c in open_checkpoint(world["src"]).resolved.capture]
    stream = ["embed", *(p for p in all_points if p.endswith(".out")), "logits"]
    compared = all_points
    if mode == "final":
        report, compared = _cli(tmp_path, "--reference", src, *inject), ["logits"]
    elif mode == "layerwise":
        report = _cli(tmp_path, "--reference", src, *inject, "--layerwise")
    elif mode == "isolate":  # without --layerwise, isolation still compares what every layer hands on
        report, compared = _cli(tmp_path, "--reference", src, *inject, "--isolate"), stream
    elif mode == "isolate-layerwise":
        report = _cli(tmp_path, "--reference", src, *inject, "--isolate", "--layerwise")
    elif mode == "calibrate":
        report = _cli(tmp_path, "--reference", src, *inject, "--layerwise", "--calibrate")
    elif mode == "calibrate-isolate":
        report = _cli(tmp_path, "--reference", src, *inject, "--layerwise", "--calibrate", "--isolate")
    elif mode == "inputs":  # the bug fails the first prompt; the second (one token: no rotation) may pass
        prompts = tmp_path / "prompts.json"
        prompts.write_text(json.dumps([world["ids"][0].tolist(), [5]]))
        report = _cli(tmp_path, "--reference", src, *inject, "--layerwise", "--inputs", str(prompts))
        runs = report["inputs"]["runs"]
        assert runs[0]["verdict"] == "fail"
        if bug == "rope-permuted":  # position 0 is not rotated: invisible in the one-token prompt
            assert runs[1]["verdict"] == "pass" and report["first_divergence"]["run"] == 0
    elif mode == "generate":
        report, compared = _cli(tmp_path, "--reference", src, *inject, "--generate", "4"), ["logits"]
        gen = report["generation"]
        injected = _injected_greedy(world, bug, 4)
        assert gen["candidate"] == injected  # the tokens of the port that was checked, mistake included
    elif mode == "golden":
        report = _cli(tmp_path, "--reference", golden, *inject, "--layerwise")
    elif mode == "golden-isolate":
        report = _cli(tmp_path, "--reference", golden, *inject, "--layerwise", "--isolate")
        assert report["calibrated"]  # the golden's isolated noise is replayed
    elif mode == "dump":
        report = _cli(tmp_path, "--reference", src, "--candidate", str(_candidate(world, bug, "dump")), "--layerwise")
    elif mode == "golden-dump":
        report = _cli(tmp_path, "--reference", golden, "--candidate", str(_candidate(world, bug, "dump")),
                      "--layerwise", "--checkpoint", src)
    elif mode == "onnx":
        report = _cli(tmp_path, "--reference", src, "--candidate", str(_candidate(world, bug, "onnx")), "--layerwise")
    elif mode == "hf":
        report = _cli(tmp_path, "--reference", src, "--candidate", str(_candidate(world, bug, "hf")), "--layerwise")
    elif mode == "hf-isolate":
        report = _cli(tmp_path, "--reference", src, "--candidate", str(_candidate(world, bug, "hf")), "--layerwise",
                      "--isolate")
    elif mode == "api":
        got = parity.check(world["src"], world["neutral"], inject=bug, layerwise=True, diagnose=False)
        assert not got and got.exit_code == 1
        report = got.to_json()
    else:
        with pytest.raises(AssertionError, match=f"FAIL at {BUGS[bug]}"):
            assert_parity(world["src"], world["neutral"], inject=bug, layerwise=True, diagnose=False)
        return
    assert report["first_divergence"]["point"] == _expected(BUGS[bug], compared)
    if mode in ("layerwise", "golden-dump", "hf"):  # and the diagnosis names the mistake
        assert report["diagnosis"][0]["bug"] == bug, report["diagnosis"]


def _injected_greedy(world, bug: str, n: int) -> list[int]:
    manifest, tensors = load(world["neutral"])
    model = NeutralModel(*bugs.inject(bug, manifest, tensors), torch.float32)
    seq = world["ids"]
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
    return seq[0, world["ids"].shape[1]:].tolist()


def test_isolation_without_layerwise_tests_every_layer(world):
    """Fed the reference's inputs, the head alone would be tested: isolation compares each layer's output."""
    report = parity.check(world["src"], world["neutral"], inject="rope-permuted", isolate=True, diagnose=False)
    assert report.verdict == "fail" and report.first_divergence.name == "layers.0.out"
    assert [p.name for p in report.points][:2] == ["embed", "layers.0.out"]


def _point(name: str, rel_l2: float, tolerance: float) -> PointResult:
    return PointResult(name=name, max_abs=rel_l2, mean_abs=rel_l2, rel_l2=rel_l2, cosine=1.0,
                       tolerance=Tolerance(tolerance), passed=rel_l2 <= tolerance)


def test_a_later_passing_prompt_never_hides_an_earlier_failure():
    # calibrated tolerances differ per prompt: a pass can have the larger rel_l2
    report = Report(family="llama", reference={}, candidate={}, dtype="float32", mode="free", layerwise=True)
    merge(report, [_point("logits", 1e-3, 1e-4)], None)
    merge(report, [_point("logits", 2e-3, 1e-2)], None)
    assert report.verdict == "fail" and report.first_divergence.rel_l2 == 1e-3


def test_the_diagnosis_reads_the_prompt_that_failed(world, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5], world["ids"][0].tolist()]))  # the bug shows only in the second
    report = _cli(tmp_path, "--reference", str(world["src"]), "--candidate", str(world["neutral"]), "--inject",
                  "rope-permuted", "--layerwise", "--inputs", str(prompts))
    assert [r["verdict"] for r in report["inputs"]["runs"]] == ["pass", "fail"]
    assert report["first_divergence"]["run"] == 1
    assert report["diagnosis"][0]["bug"] == "rope-permuted"


def test_adapters_reach_a_hugging_face_candidate_and_the_diagnosis(tmp_path):
    from parity.adapter import load_all
    from parity.reference.tiny import make_tiny

    adapters = FIXTURES / "adapters"
    src = make_tiny(load_all([adapters])["helium"], tmp_path / "helium")
    same = parity.check(src, src, layerwise=True, adapter_dirs=[adapters])
    assert same.verdict == "pass" and same.candidate["kind"] == "transformers" and same.family == "helium"
    neutral = convert(src, tmp_path / "helium.neutral", adapter_dirs=[adapters]) and tmp_path / "helium.neutral"
    broken = parity.check(src, neutral, layerwise=True, inject="rope-permuted", adapter_dirs=[adapters])
    assert broken.first_divergence.name == "layers.0.attn_out"
    assert broken.diagnosis[0]["bug"] == "rope-permuted"
