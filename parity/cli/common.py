"""What every ``parity`` command shares: the error contract (one line, exit code 2; 130 / 143 when interrupted), the
options several commands take, and a check's progress display and outputs."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.progress import Progress as Bars  # rich's; Progress below is a check's display around them

from parity import render, signals
from parity.checker.options import CheckOptions, command_line
from parity.errors import ParityError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Failure(click.ClickException):
    """No verdict could be reached: one line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"parity: error: {self.format_message()}", err=True)


class Interrupted(click.ClickException):
    """Ctrl-C or SIGTERM: outputs are atomic, so nothing is left half-written; exit code 128 + the signal (130 for
    SIGINT, 143 for SIGTERM: parity.signals)."""

    exit_code = 130

    def show(self, file=None) -> None:
        click.echo("parity: interrupted; nothing was written", err=True)


def debugging(ctx: click.Context) -> bool:
    return bool(ctx.find_root().params.get("debug")) or os.environ.get("PARITY_DEBUG", "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """An unexpected error as one line: its type, its first line, and how to see more."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if isinstance(exc, MemoryError) or "can't allocate memory" in text or type(exc).__name__ == "OutOfMemoryError":
        return (f"out of memory ({type(exc).__name__}{': ' + text[:200] if text else ''}); use a shorter prompt "
                f"(--length), fewer points (drop --layerwise/--calibrate) or a machine with more memory")
    return (f"{type(exc).__name__}: {text[:300] or 'no message'} (parity could not reach a verdict; rerun with "
            f"--debug or PARITY_DEBUG=1 for the traceback, and report it if the inputs are valid)")


class Group(click.Group):
    """Every error becomes one line and exit code 2 (no verdict): CI must never read a crash as "parity fails"."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # one line too, like every other error (exit 2)
            raise Failure(exc.format_message()) from None
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: --help/--version exit 0
        except KeyboardInterrupt:
            interrupted = Interrupted("interrupted")
            interrupted.exit_code = signals.exit_code()  # 130 for Ctrl-C, 143 for SIGTERM
            raise interrupted from None
        except ParityError as exc:
            if debugging(ctx):
                traceback.print_exc()
            raise Failure(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the exit-code contract covers every error
            if debugging(ctx):
                traceback.print_exc()
            raise Failure(one_line(exc)) from None


def adapters_option(fn):
    """``--adapters DIR``: extra adapter directories, overriding built-ins by family name."""
    return click.option(
        "--adapters", "adapter_dirs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
        help="Directory of extra adapter TOML files (repeatable; also $PARITY_ADAPTERS). Overrides built-ins.",
    )(fn)


def _input_flags(fn):
    for option in reversed([
        click.option("--prompt", default=None, help="Text, tokenized with the reference's tokenizer."),
        click.option("--ids", default=None, help="Comma-separated token ids."),
        click.option("--inputs", "inputs_file", type=click.Path(path_type=Path), default=None,
                     help="A JSON list of prompts (strings or id lists); each point keeps its worst result."),
        click.option("--length", type=int, default=None,
                     help="A deterministic prompt of N tokens (default: long enough to cross every sliding window)."),
    ]):
        fn = option(fn)
    return fn


def _prompts(kwargs: dict):
    """The four input options taken out of a command's arguments, as one parity.checkpoint.inputs.Prompts."""
    from parity.checkpoint.inputs import Prompts  # torch: loaded when a command runs, not for --help

    ids = parse_id_list(kwargs.pop("ids"))
    return Prompts(kwargs.pop("prompt"), None if ids is None else tuple(ids), kwargs.pop("length"),
                   kwargs.pop("inputs_file"))


def input_options(fn):
    """``--prompt`` / ``--ids`` / ``--inputs`` / ``--length``: the token ids a command runs, given to it as one
    ``prompts`` argument (parity.checkpoint.inputs.Prompts)."""
    @functools.wraps(fn)
    def command(*args, **kwargs):
        return fn(*args, prompts=_prompts(kwargs), **kwargs)

    return _input_flags(command)


def check_options(fn):
    """Every option of ``parity check``, given to the command as one ``options`` argument: the click options are
    built from CheckOptions' fields (parity.checker.options), with the input options and --adapters."""
    flagged = command_line()

    @functools.wraps(fn)
    def command(*args, **kwargs):
        prompts = _prompts(kwargs)
        given = {f.name: kwargs.pop(f.name) for f in flagged}
        options = CheckOptions(prompt=prompts.prompt, ids=prompts.ids, length=prompts.length,
                               inputs_file=prompts.inputs_file, adapter_dirs=kwargs.pop("adapter_dirs"), **given)
        return fn(*args, options=options, **kwargs)

    command = adapters_option(command)
    for f in reversed(flagged):
        command = _click_option(f)(command)
    return _input_flags(command)


def _click_option(f):
    """The click option a CheckOptions field declares in its metadata."""
    m = f.metadata
    flag = f"{m['flag']}/{m['secondary']}" if m.get("secondary") else m["flag"]
    kind = _click_type(m)
    return click.option(flag, f.name, help=m["help"], default=f.default,
                        **{key: True for key in ("is_flag", "multiple") if m.get(key)},
                        **({} if kind is None else {"type": kind}),
                        **{key: m[key] for key in ("metavar", "show_default") if key in m})


def _click_type(m) -> click.ParamType | None:
    """The value type an option's metadata asks for (None: click's, from the default)."""
    if m.get("path"):
        return click.Path(path_type=Path)
    if m.get("number"):
        return click.FloatRange(*m["number"])
    if m.get("count"):
        return click.IntRange(min=0)
    if m.get("choices"):
        return click.Choice(list(m["choices"]))
    return None


def console() -> Console:
    """The terminal's width, or 120 columns in a CI log (rich would assume 80 and squeeze the table)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


class Progress:
    """What a check is doing (a status line) and, per model, a bar of layers done with the time left."""

    def __init__(self):
        self.bars = Bars(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("layers"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                         # off a terminal a transient display leaves only a blank line before the report
                         console=Console(stderr=True, quiet=not sys.stderr.isatty()), transient=True)
        self.status = self.bars.add_task("checking", total=None)
        self.models: dict[str, int] = {}

    def message(self, text: str) -> None:
        self.bars.update(self.status, description=text)

    def layer(self, model: str, done: int, total: int) -> None:
        if model not in self.models or done == 1:  # a new prompt starts the model's bar again
            if model in self.models:
                self.bars.remove_task(self.models[model])
            self.models[model] = self.bars.add_task(f"{model:<12}", total=total)
        self.bars.update(self.models[model], completed=done)


def run_check(reference, candidate, run, outputs: Outputs, **kwargs):
    """``run(reference, candidate, progress=..., on_layer=..., **kwargs)`` with a progress display, its report
    shown and written to ``outputs`` (checked writable before anything runs)."""
    files = [*((p, None) for p in outputs.reports), *([(outputs.junit, ".xml")] if outputs.junit else [])]
    for path, fmt in files:  # before any model is loaded: a check must not run for an hour and then fail to write
        render.check_output(path, fmt)
    out = console()
    progress = Progress()
    with progress.bars:
        report = run(reference, candidate, progress=progress.message, on_layer=progress.layer, **kwargs)
    render.console(report, out, per_layer=outputs.per_layer)
    for path, fmt in files:
        render.write(report, path, fmt)
        click.echo(f"wrote {path}", err=True)
    return report


@dataclass(frozen=True)
class Outputs:
    """Where a check's report goes besides the console: --report files (by suffix), --junit, --per-layer rows."""

    reports: tuple[Path, ...] = ()
    junit: Path | None = None
    per_layer: bool = False


def parse_id_list(ids: str | None) -> list[int] | None:
    if ids is None:
        return None
    try:
        return [int(x) for x in ids.split(",") if x.strip()]
    except ValueError:
        raise ParityError(f"--ids {ids!r}: expected comma-separated integers like 1,2,3") from None
