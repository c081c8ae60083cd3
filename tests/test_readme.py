"""README.md's figures against their sources: the bug catalog and its citations, the selftest, the goldens.

Blocks that are generated are fenced by `<!-- begin NAME ... -->` / `<!-- end NAME -->`; after changing a
source, `python tests/test_readme.py [--selftest FILE]` rewrites them (FILE from `parity selftest --markdown FILE`).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.diagnosis import bugs
from parity.cli import selftest
from parity.cli import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FIXTURES = Path(__file__).parent / "fixtures"
NONE_FOUND = "no public instance found"
# the selftest families a test run repeats (about 15 s on two cores, the whole matrix 90 s): between them
# Conv1D, Post-Norm, biases, tied heads, both GELUs, and Gemma 2's offset norms, softcaps, scales and window
FAST_FAMILIES = ["gpt2", "bert", "gemma2"]


def block(text: str, name: str) -> str:
    """The lines between `<!-- begin NAME ... -->` and `<!-- end NAME -->`."""
    found = re.search(rf"^<!-- begin {name}\b.*?-->\n(.*?)\n<!-- end {name} -->$", text, re.S | re.M)
    assert found, f"README.md has no generated block {name!r}"
    return found[1]


def replace_block(text: str, name: str, content: str) -> str:
    block(text, name)
    return re.sub(rf"(^<!-- begin {name}\b.*?-->\n).*?(\n<!-- end {name} -->$)",
                  lambda m: m[1] + content + m[2], text, flags=re.S | re.M)


# --------------------------------------------------------------------------------------------
# The bug catalog


def bug_table() -> str:
    """The catalog as README.md shows it: parity/diagnosis/bugs.py is the one source."""
    return "\n".join(["| id | the mistake | shows | where it happened |", "|---|---|---|---|"] +
                     [f"| `{b.id}` | {b.mistake} | {b.shows} | {b.seen_in} |" for b in bugs.CATALOG])


def cells(table: str) -> list[list[str]]:
    """A markdown table's body rows, split into stripped cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def test_readme_bug_table_is_the_catalog():
    rows = {row[0].strip("`"): row for row in cells(block(README.read_text(), "bugs"))}
    assert list(rows) == [b.id for b in bugs.CATALOG]
    for b in bugs.CATALOG:
        assert rows[b.id] == [f"`{b.id}`", b.mistake, b.shows, b.seen_in], b.id
    assert block(README.read_text(), "bugs") == bug_table()


def references(text: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The owner/repo names in text, and its (owner/repo, "#N" or "PR #N") references: a number belongs to the
    repository named last before it ("ggml-org/llama.cpp #2373 and PR #2374" are two)."""
    repos, refs, repo = set(), set(), None
    for m in re.finditer(r"\b([A-Za-z0-9][\w.-]+/[\w.-]+)|((?:PR )?#\d+)", text):
        if m[1]:
            repo = m[1]
            repos.add(repo)
        elif repo:
            refs.add((repo, m[2]))
    return repos, refs


def places(not_found: str) -> list[str]:
    """The projects a "not found" cell names: "early vLLM; TensorRT-LLM's first Gemma" -> vLLM, TensorRT-LLM."""
    items = [re.sub(r"\(.*?\)|\"|^early ", "", item.strip()).split() for item in not_found.split(";")]
    return [words[0].removesuffix("'s") for words in items if words]


CITATIONS = {row[0]: (row[1], row[2]) for row in cells(
    re.search(r"^\| bug id .*?(?=\n\n|\Z)", (FIXTURES / "citations.md").read_text(), re.S | re.M)[0])}


@pytest.mark.parametrize("source", ["parity/diagnosis/bugs.py", "README.md"])
def test_where_it_happened_cites_only_verified_instances(source):
    seen = ({b.id: b.seen_in for b in bugs.CATALOG} if source == "parity/diagnosis/bugs.py"
            else {row[0].strip("`"): row[3] for row in cells(block(README.read_text(), "bugs"))})
    assert set(seen) == set(CITATIONS) == set(bugs.BY_ID)
    for bug_id, text in seen.items():
        verified, not_found = CITATIONS[bug_id]
        if verified.startswith("—"):
            assert text == NONE_FOUND, bug_id
            continue
        repos, refs = references(text)
        verified_repos, verified_refs = references(verified)
        assert refs and refs <= verified_refs, (bug_id, refs - verified_refs)
        assert repos <= verified_repos, (bug_id, repos - verified_repos)
        assert not refs & references(not_found)[1], bug_id
        # whatever is said besides the verified references must not name a place that was not found
        prose = re.sub("|".join(map(re.escape, sorted(repos, key=len, reverse=True))) or "$^", "", text)
        assert not [p for p in places(not_found) if p.lower() in prose.lower()], (bug_id, prose)


def test_the_citation_check_would_catch_a_bad_entry():
    verified, not_found = CITATIONS["norm-offset-dropped"]
    assert ("ggml-org/llama.cpp", "PR #5631") in references(verified)[1]
    assert references("ggml-org/llama.cpp #2373, PR #2374")[1] == {("ggml-org/llama.cpp", "#2373"),
                                                                   ("ggml-org/llama.cpp", "PR #2374")}
    assert ("ml-explore/mlx-examples", "#1057") in references(not_found)[1]
    assert places(not_found) == ["candle", "mlx-lm"]
    assert places(CITATIONS["embed-scale-dropped"][1]) == ["candle", "TensorRT-LLM"]


# --------------------------------------------------------------------------------------------
# The selftest


def parse_matrix(markdown: str) -> list[selftest.Row]:
    """Rows back from `selftest.markdown` (its matrix lines), so that totals can be recomputed from them."""
    yes = {"yes": True, "no": False}
    rows = []
    prefill_only = {"-": None, "caught": True, "passed": False}
    for family, bug, dtype, check, detected, first, op, diagnosed, prefill, allclose, top1 in cells(
            "\n".join(line for line in markdown.splitlines() if line.startswith("|"))):
        diagnosed = None if diagnosed == "-" else diagnosed.removesuffix(" ✗")
        rows.append(selftest.Row(family, bug, dtype, yes[detected], None if first == "-" else first, diagnosed,
                                 yes[allclose], yes[top1], check, prefill_only[prefill],
                                 None if op.removesuffix(" ✗") == "-" else op.removesuffix(" ✗"),
                                 False if op.endswith(" ✗") else _declared(bug, check, op)))
    return rows


def _declared(bug: str, check: str, op: str) -> bool | None:
    """A row's op_right where the matrix shows no ✗: True where the catalog declares an op for a prefill row."""
    if bug == "clean" or check != "prefill" or bugs.get(bug).op is None or op == "-":
        return None
    return True


def test_readme_selftest_summary_is_its_matrix_totals():
    shown = block(README.read_text(), "selftest")
    rows = parse_matrix(shown)
    assert shown.splitlines()[-1] == selftest.summary(rows)
    assert shown == selftest.markdown(rows)  # nothing in the block but what `--markdown` writes
    assert {r.bug for r in rows} == {b.id for b in bugs.CATALOG} | {"clean"}
    assert len({r.family for r in rows if r.bug == "clean"}) == len({r.family for r in rows})


def test_readme_selftest_rows_are_what_a_run_produces(tmp_path):
    """Rerun a few families (the whole matrix takes minutes) and compare their rows with README.md's."""
    out = tmp_path / "selftest.md"
    result = CliRunner().invoke(cli, ["selftest", "--families", ",".join(FAST_FAMILIES), "--markdown", str(out)])
    assert result.exit_code == 0, result.output
    fresh = parse_matrix(out.read_text())
    shown = [r for r in parse_matrix(block(README.read_text(), "selftest")) if r.family in FAST_FAMILIES]
    assert {r.family for r in fresh} == set(FAST_FAMILIES)
    assert sorted(fresh, key=lambda r: (r.family, r.bug)) == sorted(shown, key=lambda r: (r.family, r.bug))


# --------------------------------------------------------------------------------------------
# The goldens and `parity inspect`


def test_readme_golden_figures_are_what_its_command_prints():
    _, command, output, _ = block(README.read_text(), "golden-sizes").splitlines()  # ```, $ command, output, ```
    argv = shlex.split(command.removeprefix("$ "))
    assert argv[0] == "python"
    printed = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == output


def test_readme_golden_rounding_is_what_the_goldens_record():
    assert "rounding (rel_l2 about 2e-4 in the goldens below" in " ".join(README.read_text().split())
    recorded = [point["storage_rel_l2"] for path in (ROOT / "golden").glob("*/golden.json")
                for run in json.loads(path.read_text())["runs"] for point in run["points"].values()]
    assert recorded and all(f"{r:.0e}" == "2e-04" for r in recorded)


@pytest.mark.parametrize("config", ["llama-3.1-8b.json", "gemma-4-26b-a4b.json"])
def test_readme_inspect_transcripts_are_its_output(config):
    """Each line README.md shows from `parity inspect` (but `...` and the header naming a local path) is printed."""
    transcripts = {m[1].lower(): m[2] for m in re.finditer(r"^\$ parity inspect ([^/\n]+)/config\.json\n(.*?)\n```",
                                                           README.read_text(), re.S | re.M)}
    result = CliRunner().invoke(cli, ["inspect", str(FIXTURES / "configs" / config)])
    assert result.exit_code == 0, result.output
    printed = {" ".join(line.split()) for line in result.output.splitlines()}
    shown = [" ".join(line.split()) for line in transcripts[config.removesuffix(".json")].splitlines()[1:]]
    assert shown and [line for line in shown if "..." not in line and line not in printed] == []


# --------------------------------------------------------------------------------------------


def main() -> None:
    """Rewrite README.md's generated blocks: the bug table, and the selftest from `--selftest FILE`."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--selftest", type=Path, help="a file written by `parity selftest --markdown FILE` (all families)")
    args = ap.parse_args()
    text = replace_block(README.read_text(), "bugs", bug_table())
    if args.selftest:
        text = replace_block(text, "selftest", args.selftest.read_text().rstrip("\n"))
    README.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
