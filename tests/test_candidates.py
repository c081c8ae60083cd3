"""The candidate protocol (parity/candidates): the runner depends on it alone, and a new engine is one module plus
one line in KINDS."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

from click.testing import CliRunner

from parity import candidates
from parity.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def test_the_check_imports_the_protocol_and_no_kind():
    """The check runs every kind through parity.candidates' protocol; no module of parity/checker imports a kind's
    module (tests/test_layers.py holds it to naming no engine at all)."""
    from tests.test_layers import package_imports

    graph = package_imports()
    checker = {m: ts for m, ts in graph.items() if m.startswith("parity.checker")}
    assert any("parity.candidates" in ts for ts in checker.values())
    kinds = set(candidates.KINDS + candidates.ENGINES)
    for m, ts in checker.items():
        assert not ts & kinds, (m, ts & kinds)


def test_every_kind_module_states_the_protocol():
    for name, kind in candidates.kinds().items():
        assert kind.name == name and callable(kind.detect) and callable(kind.make_runner)
    assert set(candidates.kinds()) == {"dump", "onnx", "gguf", "golden", "neutral", "transformers", "mlx",
                                       "ctranslate2", "openvino", "python"}
    engines = {k.name for k in candidates.kinds().values() if k.explicit}  # taken only as KIND:PATH
    assert engines == {"mlx", "ctranslate2", "openvino", "python"}
    needs = {k.name: k.requires[1] for k in candidates.kinds().values() if k.requires is not None}
    assert needs == {"mlx": "mlx", "ctranslate2": "ctranslate2", "openvino": "openvino"}  # the extra to install


def test_a_new_engine_is_one_module_and_one_line(tmp_path, tiny_dir, monkeypatch):
    """An "echo" engine (a file naming a neutral directory, run by parity's executor) checked end to end, added
    as a module of parity.candidates and one entry in KINDS, nothing else."""
    from parity.candidates import neutral as neutral_kind

    echo = types.ModuleType("parity.candidates.echo")
    echo.KIND = "echo"
    echo.detect = lambda path: Path(path).suffix == ".echo" and Path(path).is_file()

    echo.OPTIONS = neutral_kind.OPTIONS

    def pointed(candidate):  # the neutral directory the file names
        return dataclasses.replace(candidate, path=Path(Path(candidate.path).read_text().strip()))

    echo.make_runner = lambda candidate, ids, feed: neutral_kind.make_runner(pointed(candidate), ids, feed)
    echo.make_decoder = lambda candidate, ids, tokens: neutral_kind.make_decoder(pointed(candidate), ids, tokens)
    monkeypatch.setitem(sys.modules, "parity.candidates.echo", echo)
    monkeypatch.setattr(candidates, "KINDS", (*candidates.KINDS, "parity.candidates.echo"))
    monkeypatch.setattr(candidates, "_loaded", {})

    reference = tiny_dir("llama")
    neutral = tmp_path / "n"
    assert CliRunner().invoke(cli, ["convert", str(reference), "--to", "neutral", "-o", str(neutral)]).exit_code == 0
    file = tmp_path / "engine.echo"
    file.write_text(str(neutral))
    result = CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(file), "--layerwise",
                                      "--decode", "4", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["candidate"]["kind"] == "echo" and all(p["passed"] for p in report["points"])
    steps = {p["step"] for p in report["points"]}
    assert steps == {None, 1, 2, 3, 4} and report["decode"]["steps"] == 4  # prefill and each decode step
    # the options a kind reads are its own: an injected mistake reaches the echo's executor, and is caught
    result = CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(file), "--layerwise",
                                      "--inject", "norm-offset-added"])
    assert result.exit_code == 1, result.output
