"""`--layers A:B` slices checked as independent jobs, joined by `parity report merge`: the same verdict and
first divergence as one whole check, against a checkpoint and against a golden."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from parity.checker import run as runner
from parity.checker.plan import Span, parse_layers
from parity.checker.record import record
from parity.cli import cli
from parity.errors import ParityError
from parity.neutral.converter import convert

# a mistake in layer 0 only: gemma2's tiny model alternates a sliding layer (0) with a global one (1)
BUG = "sliding-window-ignored"


@pytest.fixture(scope="module")
def gemma2(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("slices")
    convert(tiny_dir("gemma2"), root / "neutral")
    record(tiny_dir("gemma2"), root / "golden")
    return tiny_dir("gemma2"), root / "neutral", root / "golden"


@pytest.mark.parametrize("reference", ["checkpoint", "golden"])
@pytest.mark.parametrize("inject", [None, BUG])
def test_slices_merge_to_the_whole_verdict(gemma2, reference, inject, tmp_path):
    ckpt, neutral, golden = gemma2
    ref = ckpt if reference == "checkpoint" else golden
    whole = runner.check(ref, neutral, layerwise=True, inject=inject, checkpoint=ckpt if ref == golden else None)
    files = []
    for k, span in enumerate(("0:1", "1:2")):
        part = runner.check(ref, neutral, layerwise=True, inject=inject, layers=span,
                            checkpoint=ckpt if ref == golden else None)
        assert part.layers == {"start": k, "stop": k + 1, "of": 2}
        assert {p.name for p in part.points} == {p.name for p in whole.points if Span(k, k + 1, 2).holds(p.name)}
        files.append(tmp_path / f"slice{k}.json")
        files[-1].write_text(json.dumps(part.to_json()))
    result = CliRunner().invoke(cli, ["report", "merge", *map(str, files), "-o", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert result.exit_code == whole.exit_code
    assert merged["verdict"] == whole.verdict
    expected = whole.first_divergence and whole.first_divergence.name
    assert (merged["first_divergence"] or {}).get("point") == expected
    if inject:  # the mistake is in layer 0: its slice fails, the other, fed the reference's input, passes
        assert expected == "layers.0.attn_out"
        assert json.loads(files[1].read_text())["verdict"] == "pass"


def test_a_missing_slice_gives_no_verdict(gemma2, tmp_path):
    ckpt, neutral, _ = gemma2
    part = runner.check(ckpt, neutral, layerwise=True, layers="1:2")
    (tmp_path / "one.json").write_text(json.dumps(part.to_json()))
    result = CliRunner().invoke(cli, ["report", "merge", str(tmp_path / "one.json")])
    assert result.exit_code == 2


def test_bad_slices_are_refused(gemma2):
    ckpt, neutral, golden = gemma2
    for spec in ("2:1", "0:3", "x", "1:1", "-1:2"):
        with pytest.raises(ParityError, match="--layers"):
            runner.check(ckpt, neutral, layers=spec)
    with pytest.raises(ParityError, match="--generate"):
        runner.check(ckpt, neutral, layers="0:1", generate=2)
    assert parse_layers(":1", 2) == Span(0, 1, 2)
    assert parse_layers("1:", 2) == Span(1, 2, 2)


def test_a_slice_runs_only_its_layers(gemma2, monkeypatch):
    ckpt, neutral, _ = gemma2
    ran: list[int] = []
    from parity.neutral.executor.model import NeutralModel

    original = NeutralModel.layer

    def spy(self, x, i, *args):
        ran.append(i)
        return original(self, x, i, *args)

    monkeypatch.setattr(NeutralModel, "layer", spy)
    assert runner.check(ckpt, neutral, layerwise=True, layers="1:2")
    assert ran == [1]
