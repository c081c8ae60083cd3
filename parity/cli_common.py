"""What every ``parity`` command shares: the error contract (one line, exit code 2; 130 when interrupted), the
options several commands take, and a check's progress display and outputs."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import click
from rich.console import Console

from .errors import ParityError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Failure(click.ClickException):
    """No verdict could be reached: one line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"parity: error: {self.format_message()}", err=True)


class Interrupted(click.ClickException):
    """Ctrl-C or SIGTERM: outputs are atomic, so nothing is left half-written; exit code 130 (128 + SIGINT)."""

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
            raise Interrupted("interrupted") from None
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


def input_options(fn):
    """``--prompt`` / ``--ids`` / ``--inputs`` / ``--length``: the token ids a command runs."""
    options = [
        click.option("--prompt", default=None, help="Text, tokenized with the reference's tokenizer."),
        click.option("--ids", default=None, help="Comma-separated token ids."),
        click.option("--inputs", "inputs_file", type=click.Path(path_type=Path), default=None,
                     help="A JSON list of prompts (strings or id lists); each point keeps its worst result."),
        click.option("--length", type=int, default=None,
                     help="A deterministic prompt of N tokens (default: long enough to cross every sliding window)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def console() -> Console:
    """The terminal's width, or 120 columns in a CI log (rich would assume 80 and squeeze the table)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


class Progress:
    """What a check is doing (a status line) and, per model, a bar of layers done with the time left."""

    def __init__(self):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
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


def run_check(reference, candidate, *, per_layer, report_paths, junit, run, layers_progress=False, **kwargs):
    from . import render

    outputs = [*((p, None) for p in report_paths), *([(junit, ".xml")] if junit else [])]
    for path, fmt in outputs:  # before any model is loaded: a check must not run for an hour and then fail to write
        render.check_output(path, fmt)
    out = console()
    progress = Progress()
    if layers_progress:
        kwargs["on_layer"] = progress.layer
    with progress.bars:
        report = run(reference, candidate, progress=progress.message, **kwargs)
    render.console(report, out, per_layer=per_layer)
    for path, fmt in outputs:
        render.write(report, path, fmt)
        click.echo(f"wrote {path}", err=True)
    return report


def parse_id_list(ids: str | None) -> list[int] | None:
    if ids is None:
        return None
    try:
        return [int(x) for x in ids.split(",") if x.strip()]
    except ValueError:
        raise ParityError(f"--ids {ids!r}: expected comma-separated integers like 1,2,3") from None
