"""Every `parity ...` command the README and the docs show parses as written: its command exists, each option is one
the command takes, each choice is one it accepts, and nothing it requires is left out. (What the commands print is
checked where the docs quote it: tests/test_readme.py.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from parity.cli import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown_commands(text: str) -> list[str]:
    """The `parity ...` invocations inside the fenced blocks of a page: continuation lines joined, prompts ($)
    dropped, chains (&&, ;, |) split, comments and redirections cut."""
    found = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"^\s*\$\s*", "", line)
            for part in re.split(r"&&|;|\|", line):
                part = re.split(r"\s#\s|\s#$|\s[12]?>", part)[0].strip()
                part = re.sub(r"^[A-Z_]+=\S+\s+", "", part)  # an environment variable set for the command
                part = part.replace("[", "").replace("]", "")  # optional parts, as a usage line shows them
                # a benchmark's output line names the command it timed ("parity convert --to neutral: 7.7 s")
                if part.startswith("parity ") and "..." not in part and not re.search(r":\s+[\d.]+ s\b", part):
                    found.append(part)
    return found


def named_in_text(text: str) -> list[str]:
    """The commands written inline in the text (`parity check --isolate`, `parity golden record REF -o DIR`): often a
    fragment or a usage line, with placeholders for values."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    spans = re.findall(r"`(parity [a-z][^`]*)`", prose)
    return [part.strip() for c in spans for part in c.split("&&") if "..." not in part and part.strip()]


CASES = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in shown_commands(page.read_text())]
INLINE = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in named_in_text(page.read_text())]


def parse(args: list[str]) -> None:
    """Parse as `parity` would, without running anything."""
    ctx, command = cli.make_context("parity", list(args)), cli
    while isinstance(command, click.Group):  # a group keeps its subcommand's name and arguments apart
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)


def test_the_docs_show_commands():
    assert len(CASES) > 40 and len(INLINE) > 80, (len(CASES), len(INLINE))
    assert {page for page, _ in CASES + INLINE} >= {"README.md", "docs/checking.md", "docs/gguf.md", "docs/commands.md"}


@pytest.mark.parametrize("page,command", CASES, ids=[f"{p}:{c[:60]}" for p, c in CASES])
def test_every_command_shown_parses(page, command):
    args = shlex.split(command)[1:]
    if "-h" in args or "--help" in args or "--version" in args:
        return  # click answers these before parsing the rest
    try:
        parse(args)
    except click.ClickException as exc:
        pytest.fail(f"{page}: `{command}`: {exc.format_message()}")


def command_of(words: list[str]) -> tuple[click.Command, list[str]]:
    """The (sub)command the leading words name, and the words after them."""
    command, ctx = cli, click.Context(cli)
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        found = command.get_command(ctx, words[0])
        assert found is not None, f"no command {words[0]!r}"
        command, words = found, words[1:]
    return command, words


@pytest.mark.parametrize("page,command", INLINE, ids=[f"{p}:{c[:60]}" for p, c in INLINE])
def test_every_command_named_in_the_text_exists_with_its_options(page, command):
    """A fragment or a usage line need not be complete, but its command and every option it names must exist."""
    command_obj, words = command_of(shlex.split(command.replace("\\|", "|"))[1:])
    known = {name for param in command_obj.params for name in (*param.opts, *param.secondary_opts)} | {"-h", "--help"}
    for word in words:
        for option in re.findall(r"(?:^|[\[|\s])(--?[a-z][\w-]*)", word):
            assert option in known, f"{page}: `{command}`: {command_obj.name} has no option {option}"
