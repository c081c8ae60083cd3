"""Python engines parity does not ship, as candidates: ``--candidate python:FILE.py``. A real third-party
implementation, TransformerLens's HookedTransformer (tests/fixtures/transformer_lens_engine.py: its hook points
mapped to parity's points), passes `check --layerwise` against transformers; the same engine with a config
mistake fails where it first acts, diagnosed; a runner that emits its own points; the user's mistakes refused in
one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests.conftest import FIXTURES

ENGINE = FIXTURES / "transformer_lens_engine.py"


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _check(reference, engine, report, *extra):
    result = _cli("check", "--reference", reference, "--candidate", f"python:{engine}", "--layerwise", "--report",
                  report, *extra)
    return result, (json.loads(report.read_text()) if report.exists() else None)


@pytest.fixture(scope="module")
def checkpoint(tiny_dir, tmp_path_factory):
    """The tiny Llama (GQA, llama3 RoPE scaling) under a name TransformerLens does not read as an architecture."""
    link = tmp_path_factory.mktemp("engine") / "checkpoint"
    link.symlink_to(tiny_dir("llama"), target_is_directory=True)
    return link


def test_transformer_lens_passes_layer_by_layer(checkpoint, tmp_path):
    pytest.importorskip("transformer_lens")
    result, report = _check(checkpoint, ENGINE, tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert report["candidate"]["kind"] == "python"
    points = report["points"]
    assert len(points) == 15 and all(p["compared"] and p["passed"] for p in points)  # every point mapped
    # its own kernels: not bit-identical to transformers (a hook on transformers' own modules would be)
    assert 0 < max(p["rel_l2"] for p in points) < 1e-5


def test_transformer_lens_with_a_config_mistake_fails_at_its_first_divergence(checkpoint, tmp_path):
    pytest.importorskip("transformer_lens")
    result, report = _check(checkpoint, ENGINE, tmp_path / "r.json", "--engine-option", "entry=build_theta_10000")
    assert result.exit_code == 1, result.output
    first = report["first_divergence"]
    assert first["point"] == "layers.0.attn_out" and first["rel_l2"] > 0.1
    assert next(p for p in report["points"] if p["name"] == "layers.0.attn_in")["passed"]
    assert report["diagnosis"][0]["bug"] == "rope-theta-wrong"


def test_isolated_the_mistake_is_in_every_attention_and_no_mlp(checkpoint, tmp_path):
    """--isolate: the reference follows the engine (fed its layer and MLP inputs), so each sublayer is judged on
    its own: the wrong RoPE base shows in every layer's attention, and in none of the MLPs."""
    pytest.importorskip("transformer_lens")
    result, report = _check(checkpoint, ENGINE, tmp_path / "r.json", "--engine-option", "entry=build_theta_10000",
                            "--isolate")
    assert result.exit_code == 1, result.output
    by_name = {p["name"]: p for p in report["points"]}
    for i in range(2):
        assert not by_name[f"layers.{i}.attn_out"]["passed"] and by_name[f"layers.{i}.mlp_out"]["passed"]


RUNNER = '''
import torch
from transformers import AutoModelForCausalLM

def run(checkpoint, dtype, ids, emit):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    out = model(input_ids=ids, output_hidden_states=True)
    emit("embed", out.hidden_states[0][0])            # [S, width]: a batch's tokens packed
    emit("logits", out.logits {scale})
'''


@pytest.mark.parametrize("scale, code", [("", 0), ("* 1.01", 1)])
def test_a_runner_emits_its_own_points(checkpoint, tmp_path, scale, code):
    engine = tmp_path / "engine.py"
    engine.write_text(RUNNER.replace("{scale}", scale))
    result, report = _check(checkpoint, engine, tmp_path / "r.json")
    assert result.exit_code == code, result.output
    compared = {p["name"]: p for p in report["points"] if p["compared"]}
    assert set(compared) == {"embed", "logits"}  # the others are reported as not compared
    assert compared["embed"]["passed"] and compared["logits"]["passed"] == (code == 0)


MISTAKES = {
    "import": ("import not_a_module_here\n", "importing it failed (ModuleNotFoundError"),
    "empty": ("X = 1\n", "defines neither POINTS"),
    "unknown point": ("import torch\nPOINTS = {'layers.{i}.attention': 'x'}\n"
                      "def build(c, d): return torch.nn.Linear(1, 1)\n", "not a capture point"),
    "no such module": ("import torch\nPOINTS = {'logits': 'head'}\ndef build(c, d): return torch.nn.Linear(1, 1)\n",
                       "has no such module"),
    "not a module": ("POINTS = {'logits': ''}\ndef build(c, d): return 3\n", "not a torch.nn.Module"),
    "build raises": ("POINTS = {'logits': ''}\ndef build(c, d): raise KeyError('lm_head')\n",
                     "build() raised KeyError"),
    "forward raises": ("import torch\nPOINTS = {'logits': ''}\ndef build(c, d): return torch.nn.Linear(1, 1)\n",
                       "the model raised RuntimeError"),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_users_mistakes_are_one_line(mistake, checkpoint, tmp_path):
    source, said = MISTAKES[mistake]
    engine = tmp_path / "engine.py"
    engine.write_text(source)
    result, report = _check(checkpoint, engine, tmp_path / "r.json")
    assert result.exit_code == 2 and report is None, result.output
    assert said in result.output and "Traceback" not in result.output


def test_not_a_python_file_and_an_unknown_entry(checkpoint, tmp_path):
    pytest.importorskip("transformer_lens")
    result, _ = _check(checkpoint, checkpoint / "config.json", tmp_path / "r.json")
    assert result.exit_code == 2 and "expected a Python file" in result.output
    result, _ = _check(checkpoint, ENGINE, tmp_path / "r.json", "--engine-option", "entry=nothing")
    assert result.exit_code == 2 and "no function 'nothing'" in result.output


def test_listed_among_the_engines():
    result = _cli("engines", "--json")
    row = next(r for r in json.loads(result.output) if r["kind"] == "python")
    assert row["named_as"][0] == "python" and "entry" in row["options"]
    assert Path(ENGINE).is_file()
