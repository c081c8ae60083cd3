"""The ``parity`` command line: a thin layer over the library; errors become exit code 2."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from . import __version__
from .adapter import load_all
from .errors import ParityError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Failure(click.ClickException):
    """No verdict could be reached: one line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"parity: error: {self.format_message()}", err=True)


class Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ParityError as exc:
            raise Failure(str(exc)) from None


def adapters_option(fn):
    """``--adapters DIR``: extra adapter directories, overriding built-ins by family name."""
    return click.option(
        "--adapters", "adapter_dirs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
        help="Directory of extra adapter TOML files (repeatable; also $PARITY_ADAPTERS). Overrides built-ins.",
    )(fn)


@click.group(cls=Group, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="parity")
def cli():
    """Port Hugging Face checkpoints and check, layer by layer, that the port computes the same function.

    \b
    Examples:
      parity demo                                  # build a tiny Gemma 2 checkpoint and inspect it
      parity adapters                              # the families parity knows
      parity inspect path/to/checkpoint            # family, conventions, norm census
      parity make-tiny qwen3 -o /tmp/tiny-qwen3    # a deterministic tiny test checkpoint
    """


@cli.command("adapters", context_settings=CONTEXT)
@adapters_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def adapters_cmd(adapter_dirs, as_json):
    """List the model families parity knows, with their conventions in one line each."""
    from .inspection import describe_family

    rows = [dict(describe_family(a.spec), adapter=str(a.path)) for a in load_all(adapter_dirs).values()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(show_lines=False)
    for col in ("family", "norm", "weight", "placement", "other"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*(row[c] for c in ("family", "norm", "weight", "placement", "other")))
    Console().print(table)


@cli.command("inspect", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path))
@adapters_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect_cmd(path, adapter_dirs, as_json):
    """Show a checkpoint's family, every convention it follows, and its norms.

    PATH is a checkpoint directory or a bare config.json. No weights are loaded: conventions
    come from the config through the family's adapter, and tensors are listed from the
    safetensors headers and checked against the adapter's tensor map.

    \b
    Example:
      parity inspect ./Llama-3.1-8B      # ... 65 RMSNorms holding 266,240 parameters, 0.003% ...
    """
    _inspect(path, adapter_dirs, as_json)


def _inspect(path: Path, adapter_dirs, as_json: bool) -> None:
    from .checkpoint import open_checkpoint
    from .inspection import render, report

    ckpt = open_checkpoint(path, adapter_dirs)
    data = report(ckpt)
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        render(data, ckpt, Console())


@cli.command("make-tiny", context_settings=CONTEXT)
@click.argument("family")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@click.option("--layers", type=int, default=None, help="Number of layers (default: the adapter's tiny setting).")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed; the same seed gives the same bytes.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
@adapters_option
def make_tiny_cmd(family, out, layers, seed, dtype, force, adapter_dirs):
    """Write a deterministic tiny checkpoint of FAMILY, built with transformers' own model class.

    Norm weights and biases are moved away from their initial values, embeddings stay at a
    realistic scale, softcaps bite and sliding windows are shorter than a default prompt, so
    that every convention of the family changes the output.

    \b
    Example:
      parity make-tiny gemma2 -o /tmp/tiny-gemma2 --layers 4
    """
    from .tiny import make_tiny

    adapters = load_all(adapter_dirs)
    if family not in adapters:
        raise ParityError(f"unknown family {family!r}; choose one of {', '.join(adapters)}")
    make_tiny(adapters[family], out, layers=layers, seed=seed, dtype=dtype, force=force)
    click.echo(f"wrote {out} ({family}, seed {seed}, {dtype})")


@cli.command("demo", context_settings=CONTEXT)
@click.option("--family", default="gemma2", show_default=True, help="Family of the tiny checkpoint.")
def demo_cmd(family):
    """Build a tiny checkpoint in a temporary directory and run the main job on it."""
    from .tiny import make_tiny

    adapters = load_all()
    if family not in adapters:
        raise ParityError(f"unknown family {family!r}; choose one of {', '.join(adapters)}")
    with tempfile.TemporaryDirectory(prefix="parity-demo-") as tmp:
        path = make_tiny(adapters[family], Path(tmp) / f"tiny-{family}")
        click.echo(f"built a tiny {family} checkpoint at {path}\n")
        _inspect(path, (), False)


def main() -> None:
    cli(prog_name="parity")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
