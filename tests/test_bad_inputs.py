"""The bad-input catalog (tests/bad_inputs.py), end to end through the CLI: exit 2 (1 for a verdict), one line
on stderr, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests.bad_inputs import BAD_INPUTS, ROOT, build, markdown_table, outputs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(tmp_path_factory.mktemp("bad-inputs"))


def _cases():
    for case in BAD_INPUTS:
        marks = [pytest.mark.xfail(reason=f"needs lead: {case.lead}", strict=False)] if case.lead else []
        yield pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", _cases())
def test_a_bad_input_gets_one_line_and_leaves_nothing(case, built, tmp_path):
    argv = case.setup(tmp_path, built)
    result = CliRunner().invoke(cli, argv)
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == case.exit, result.output
    if case.exit == 1:  # a verdict: the table says why, and reports may be written
        assert case.says in result.stdout, result.stdout
        return
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parity: error: "), result.stderr
    assert case.says in lines[0], lines[0]
    for out in outputs(argv):
        assert not out.exists(), f"{out} was written"
        left = [p.name for p in out.parent.glob(f".{out.name}*")] if out.parent.is_dir() else []
        assert not left, f"temporary files left beside {out}: {left}"


def test_the_catalog_is_large_and_distinct():
    assert len(BAD_INPUTS) >= 40
    assert len({c.input for c in BAD_INPUTS}) == len({c.id for c in BAD_INPUTS}) == len(BAD_INPUTS)
    table = markdown_table().splitlines()
    assert table[0] == "| input | exit | what parity says |" and len(table) == len(BAD_INPUTS) + 2


def test_readme_lists_the_catalog():
    readme = (ROOT / "docs" / "commands.md").read_text()
    start, end = "<!-- bad-inputs:start -->", "<!-- bad-inputs:end -->"
    assert start in readme and end in readme
    between = readme.split(start, 1)[1].split(end, 1)[0]
    assert between.strip() == markdown_table()


def test_outputs_are_read_from_the_command_line():
    assert outputs(["check", "--report", "r.json", "--junit", "j.xml", "-o", "x"]) == \
        [Path("r.json"), Path("j.xml"), Path("x")]
