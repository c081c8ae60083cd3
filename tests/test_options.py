"""One options object (parity.checker.options.CheckOptions) carries a check's options from the command line or
parity.check to the plan: each option is declared once, the CLI builds its flags from the fields, and an unknown
name is refused rather than ignored."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from click.testing import CliRunner

import parity
from parity.checker import run as runner
from parity.checker.options import CheckOptions, command_line
from parity.cli import cli
from parity.errors import ParityError


def test_every_flagged_field_is_an_option_of_parity_check():
    help_text = CliRunner().invoke(cli, ["check", "--help"], terminal_width=200).output
    for f in command_line():
        assert f.metadata["flag"] in help_text, f.name
    # the shared ones come from their own decorators, into the same object
    for flag in ("--prompt", "--ids", "--inputs", "--length", "--adapters", "--report", "--junit", "--per-layer"):
        assert flag in help_text, flag


def test_the_command_line_builds_one_options_object(monkeypatch, tmp_path):
    seen = {}

    def fake(reference, candidate, options=None, *, progress=None, on_layer=None):
        seen["options"] = options
        raise ParityError("stop here")

    monkeypatch.setattr(runner, "check", fake)
    result = CliRunner().invoke(cli, [
        "check", "--reference", "ref", "--candidate", "cand", "--layerwise", "--dtype", "bfloat16", "--ids", "1,2,3",
        "--tolerance", "layers.*:rel_l2=1e-3", "--tolerance", "logits:rel_l2=1e-2", "--decode", "4", "--no-stream",
        "--map", "embed=x", "--engine-option", "bits=4", "--layers", "0:2", "--adapters", str(tmp_path),
        "--same-weights", "--points", "ops"])
    assert result.exit_code == 2 and "stop here" in result.stderr
    o = seen["options"]
    assert isinstance(o, CheckOptions)
    assert (o.layerwise, o.dtype, o.ids, o.decode, o.stream, o.layers, o.same_weights, o.points) == (
        True, "bfloat16", (1, 2, 3), 4, False, "0:2", True, "ops")
    assert o.tolerance == ("layers.*:rel_l2=1e-3", "logits:rel_l2=1e-2")
    assert o.maps == ("embed=x",) and o.engine_options == ("bits=4",) and o.adapter_dirs == (tmp_path,)
    # what was not given keeps the dataclass's default, not a second default written in the CLI
    assert (o.isolate, o.calibrate, o.generate, o.device, o.diagnose) == (False, False, 0, "cpu", True)


def test_defaults_are_the_same_from_the_cli_and_the_library(monkeypatch):
    seen = {}

    def fake(reference, candidate, options=None, **_):
        seen["options"] = options
        raise ParityError("stop")

    monkeypatch.setattr(runner, "check", fake)
    CliRunner().invoke(cli, ["check", "--reference", "r", "--candidate", "c"])
    assert seen["options"] == CheckOptions()


def test_an_unknown_option_is_refused_with_the_known_ones():
    with pytest.raises(ParityError, match=r"unknown check option\(s\) layer_wise; the options are .*layerwise"):
        parity.check("r", "c", layer_wise=True)
    with pytest.raises(ParityError, match="unknown check option"):
        CheckOptions.of(colour="red")
    with pytest.raises(ParityError, match="unknown check option"):  # over an options object too
        parity.check("r", "c", CheckOptions(layerwise=True), colour="red")
    assert CheckOptions.of(CheckOptions(layerwise=True), dtype="float16") == CheckOptions(layerwise=True,
                                                                                        dtype="float16")


def test_lists_become_tuples_so_that_options_stay_frozen():
    o = CheckOptions(tolerance=["a:rel_l2=1"], maps={"embed": "x"}, ids=[1, 2], adapter_dirs=[Path("a")])
    assert o.tolerance == ("a:rel_l2=1",) and o.maps == ("embed=x",) and o.ids == (1, 2)
    assert o.adapter_dirs == (Path("a"),)
    hash(o)
    with pytest.raises(Exception):
        o.dtype = "float16"  # type: ignore[misc]
    assert {f.name for f in fields(CheckOptions)} >= {"layerwise", "calibrate", "isolate", "decode", "same_weights"}
