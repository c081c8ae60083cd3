"""The README's and the manual's (docs/*.md) figures against their sources: the bug catalog and its citations,
the selftest, the goldens, `parity inspect`'s transcripts; the README's test command; every relative link.

Blocks that are generated are fenced by `<!-- begin NAME ... -->` / `<!-- end NAME -->` (the bad inputs by
`<!-- bad-inputs:start -->` / `<!-- bad-inputs:end -->`), each in the page PAGES names; after changing a source,
`python tests/test_readme.py [--selftest FILE]` rewrites them (FILE from `parity selftest --markdown FILE`).
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

from parity.cli import cli, selftest
from parity.diagnosis import bugs

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FIXTURES = Path(__file__).parent / "fixtures"
NONE_FOUND = "no public instance found"
# the page each generated block (and each text checked here) lives in
PAGES = {"bugs": DOCS / "bugs.md", "selftest": DOCS / "bugs.md", "golden-sizes": DOCS / "goldens-and-dumps.md",
         "bad-inputs": DOCS / "commands.md", "inspect": DOCS / "inspecting.md"}
# .ci/run evals the first line of README.md that this matches
CI_COMMAND = r'^(CMAKE_ARGS="[^"]*" )?pip install .*\[test\].*pytest'
FAST_TIER = 'python -m pytest -q -m "not engine and not family and not real and not slow"'
# the selftest families a test run repeats (about 15 s on two cores, the whole matrix 90 s): between them
# Conv1D, Post-Norm, biases, tied heads, both GELUs, and Gemma 2's offset norms, softcaps, scales and window
FAST_FAMILIES = ["gpt2", "bert", "gemma2"]


def block(text: str, name: str) -> str:
    """The lines between `<!-- begin NAME ... -->` and `<!-- end NAME -->`."""
    found = re.search(rf"^<!-- begin {name}\b.*?-->\n(.*?)\n<!-- end {name} -->$", text, re.S | re.M)
    assert found, f"{PAGES.get(name, README).relative_to(ROOT)} has no generated block {name!r}"
    return found[1]


def replace_block(text: str, name: str, content: str) -> str:
    block(text, name)
    return re.sub(rf"(^<!-- begin {name}\b.*?-->\n).*?(\n<!-- end {name} -->$)",
                  lambda m: m[1] + content + m[2], text, flags=re.S | re.M)


def shown(name: str) -> str:
    """Generated block NAME, as the page it lives in shows it."""
    return block(PAGES[name].read_text(), name)


# --------------------------------------------------------------------------------------------
# The bug catalog


def bug_table() -> str:
    """The catalog as docs/bugs.md shows it: parity/diagnosis/bugs.py is the one source."""
    return "\n".join(["| id | the mistake | shows | where it happened |", "|---|---|---|---|"] +
                     [f"| `{b.id}` | {b.mistake} | {b.shows} | {b.seen_in} |" for b in bugs.CATALOG])


def cells(table: str) -> list[list[str]]:
    """A markdown table's body rows, split into stripped cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def test_readme_bug_table_is_the_catalog():
    rows = {row[0].strip("`"): row for row in cells(shown("bugs"))}
    assert list(rows) == [b.id for b in bugs.CATALOG]
    for b in bugs.CATALOG:
        assert rows[b.id] == [f"`{b.id}`", b.mistake, b.shows, b.seen_in], b.id
    assert shown("bugs") == bug_table()


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


@pytest.mark.parametrize("source", ["parity/diagnosis/bugs.py", "docs/bugs.md"])
def test_where_it_happened_cites_only_verified_instances(source):
    seen = ({b.id: b.seen_in for b in bugs.CATALOG} if source == "parity/diagnosis/bugs.py"
            else {row[0].strip("`"): row[3] for row in cells(shown("bugs"))})
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
        diagnosed, _, value = ("-" if diagnosed == "-" else diagnosed.removesuffix(" ✗")).partition(" = ")
        rows.append(selftest.Row(family, bug, dtype, yes[detected], None if first == "-" else first,
                                 None if diagnosed == "-" else diagnosed, yes[allclose], yes[top1], check,
                                 prefill_only[prefill], None if op.removesuffix(" ✗") == "-" else op.removesuffix(" ✗"),
                                 False if op.endswith(" ✗") else _declared(bug, check, op),
                                 float(value) if value else None))
    return rows


def _declared(bug: str, check: str, op: str) -> bool | None:
    """A row's op_right where the matrix shows no ✗: True where the catalog declares an op for a prefill row."""
    if bug == "clean" or check != "prefill" or bugs.parse(bug)[0].op is None or op == "-":
        return None
    return True


def test_readme_selftest_summary_is_its_matrix_totals():
    matrix = shown("selftest")
    rows = parse_matrix(matrix)
    assert matrix.splitlines()[-1] == selftest.summary(rows)
    assert matrix == selftest.markdown(rows)  # nothing in the block but what `--markdown` writes
    assert {r.bug.partition("=")[0] for r in rows} == {b.id for b in bugs.CATALOG} | {"clean"}
    # each mistake with a size injected at two values besides the catalog's
    assert sorted(r.bug.partition("=")[0] for r in rows if "=" in r.bug) == sorted(
        2 * [b.id for b in bugs.CATALOG if b.size])
    assert len({r.family for r in rows if r.bug == "clean"}) == len({r.family for r in rows})


def test_readme_selftest_rows_are_what_a_run_produces(tmp_path):
    """Rerun a few families (the whole matrix takes minutes) and compare their rows with docs/bugs.md's."""
    out = tmp_path / "selftest.md"
    result = CliRunner().invoke(cli, ["selftest", "--families", ",".join(FAST_FAMILIES), "--markdown", str(out)])
    assert result.exit_code == 0, result.output
    fresh = parse_matrix(out.read_text())
    rows = [r for r in parse_matrix(shown("selftest")) if r.family in FAST_FAMILIES]
    assert {r.family for r in fresh} == set(FAST_FAMILIES)
    assert sorted(fresh, key=lambda r: (r.family, r.bug)) == sorted(rows, key=lambda r: (r.family, r.bug))


# --------------------------------------------------------------------------------------------
# The goldens and `parity inspect`


def test_readme_golden_figures_are_what_its_command_prints():
    _, command, output, _ = shown("golden-sizes").splitlines()  # ```, $ command, output, ```
    argv = shlex.split(command.removeprefix("$ "))
    assert argv[0] == "python"
    printed = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == output


def test_readme_golden_rounding_is_what_the_goldens_record():
    text = " ".join(PAGES["golden-sizes"].read_text().split())
    assert "rounding (rel_l2 about 2e-4 in the goldens below" in text
    recorded = [point["storage_rel_l2"] for path in (ROOT / "golden").glob("*/golden.json")
                for run in json.loads(path.read_text())["runs"] for point in run["points"].values()]
    assert recorded and all(f"{r:.0e}" == "2e-04" for r in recorded)


@pytest.mark.parametrize("config", ["llama-3.1-8b.json", "gemma-4-26b-a4b.json"])
def test_readme_inspect_transcripts_are_its_output(config):
    """Each line docs/inspecting.md shows from `parity inspect` (but `...` and the header naming a local path) is
    printed."""
    transcripts = {m[1].lower(): m[2] for m in re.finditer(r"^\$ parity inspect ([^/\n]+)/config\.json\n(.*?)\n```",
                                                           PAGES["inspect"].read_text(), re.S | re.M)}
    result = CliRunner().invoke(cli, ["inspect", str(FIXTURES / "configs" / config)])
    assert result.exit_code == 0, result.output
    printed = {" ".join(line.split()) for line in result.output.splitlines()}
    shown = [" ".join(line.split()) for line in transcripts[config.removesuffix(".json")].splitlines()[1:]]
    assert shown and [line for line in shown if "..." not in line and line not in printed] == []


# --------------------------------------------------------------------------------------------
# The README: a front door whose test command CI runs, and links that resolve


def test_readme_test_command_is_the_one_ci_runs():
    """.ci/run evals the first README line matching its pattern: the full suite, never the fast tier."""
    assert re.search(re.escape(CI_COMMAND), (ROOT / ".ci" / "run").read_text()), "the pattern .ci/run greps changed"
    lines = README.read_text().splitlines()
    matching = [line for line in lines if re.match(CI_COMMAND, line)]
    assert matching and matching[0].endswith('pip install torch==2.13.0 -e ".[test]" && python -m pytest -q')
    assert matching[0] in (DOCS / "development.md").read_text().splitlines()  # the development page says the same
    assert [line for line in lines if FAST_TIER in line] and not [line for line in lines
                                                                  if FAST_TIER in line and re.match(CI_COMMAND, line)]
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: the manual belongs in docs/"


def prose(text: str) -> list[str]:
    """A markdown file's lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fence = [], None
    for line in text.splitlines():
        marker = re.match(r"^\s*(```|~~~)", line)
        if marker:
            fence = None if fence == marker[1] else fence or marker[1]
            continue
        if fence is None:
            lines.append(re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: "`code`" if "](" in m[0] else m[0], line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lowercased, punctuation but - and _ dropped,
    spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link: its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m[1])
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]


def links(path: Path) -> list[tuple[int, str]]:
    """Relative markdown links `[text](target)` in a file, with their line numbers (URLs left out)."""
    found = []
    for n, line in enumerate(prose(path.read_text()), 1):
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m[1]):   # http:, https:, mailto:
                found.append((n, m[1]))
    return found


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for n, target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_check_would_catch_a_bad_link(tmp_path):
    assert slug("Quantized files: `--gguf-type`") == "quantized-files---gguf-type"
    assert slug("The `[gguf]` table") == "the-gguf-table"
    assert slug('design.md, "Exit codes"') == "designmd-exit-codes"
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n## Same name\n\n## Same name\n\n[a](page.md#a-title) [b](#same-name-1) "
                    "`[not](a-link.md)` [c](https://example.com/x)\n\n```\n[d](inside-code.md)\n# not a heading\n```\n")
    assert anchors(page) == {"a-title", "same-name", "same-name-1"}
    assert [target for _, target in links(page)] == ["page.md#a-title", "#same-name-1"]


# --------------------------------------------------------------------------------------------


def main() -> None:
    """Rewrite the manual's generated blocks: the bug table and the bad inputs from their sources, the selftest
    from `--selftest FILE`."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--selftest", type=Path, help="a file written by `parity selftest --markdown FILE` (all families)")
    args = ap.parse_args()
    page = PAGES["bugs"]
    text = replace_block(page.read_text(), "bugs", bug_table())
    if args.selftest:
        text = replace_block(text, "selftest", args.selftest.read_text().rstrip("\n"))
    page.write_text(text)

    sys.path.insert(0, str(ROOT))  # run as a script: tests/ is not a package on the path yet
    from tests.bad_inputs import markdown_table

    page = PAGES["bad-inputs"]
    start, end = "<!-- bad-inputs:start -->", "<!-- bad-inputs:end -->"
    before, rest = page.read_text().split(start, 1)
    page.write_text(before + start + "\n" + markdown_table() + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    sys.exit(main())
