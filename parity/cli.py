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


@cli.command("convert", context_settings=CONTEXT)
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--to", "target", type=click.Choice(["neutral"]), required=True, help="Output format.")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Dtype of the written tensors (default: the checkpoint's).")
@click.option("--rope-style", type=click.Choice(["half", "interleaved"]), default=None,
              help="Lay q/k rows out for engines that rotate half-split or adjacent pairs (default: as stored).")
@click.option("--force", is_flag=True, help="Replace the output if it exists.")
@adapters_option
def convert_cmd(model_dir, target, out, dtype, rope_style, force, adapter_dirs):
    """Rewrite a checkpoint into the neutral layout: manifest.json + model.safetensors.

    The manifest states every convention as an explicit value (norm kind, eps, placement,
    attention scale, softcaps, RoPE per layer, windows per layer, ...); `1 + w` norm weights are
    folded, Conv1D weights transposed, fused q/k/v split. Tensors are streamed one at a time.

    \b
    Example:
      parity convert ./gemma-2-9b --to neutral -o ./gemma-2-9b.neutral --dtype bfloat16
    """
    from .neutral import convert

    manifest = convert(model_dir, out, dtype=dtype, rope_style=rope_style, force=force, adapter_dirs=adapter_dirs)
    click.echo(f"wrote {out}: {len(manifest['tensors'])} tensors in {len(manifest['files'])} file(s), "
               f"{manifest['dtype']}, {manifest['source']['family']}")


@cli.command("run", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Text to tokenize with the checkpoint's tokenizer.")
@click.option("--ids", default=None, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("--top", "top_k", default=5, show_default=True, help="How many next tokens to show.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Run in this dtype (default: the stored one).")
def run_cmd(path, prompt, ids, top_k, dtype):
    """Run a neutral model with the plain-torch executor and print the most likely next tokens.

    \b
    Example:
      parity run ./gemma-2-9b.neutral --prompt "The capital of France is"
    """
    import torch

    from .executor.model import NeutralModel
    from .neutral import load

    manifest, tensors = load(path)
    tokenizer = _tokenizer(path)
    token_ids = _parse_ids(ids, prompt, tokenizer, manifest["vocab_size"])
    model = NeutralModel(manifest, tensors, getattr(torch, dtype) if dtype else None)
    out = model(torch.tensor([token_ids]))
    if manifest["head"] is None:
        click.echo(f"last hidden state {tuple(out.shape)}; this model has no LM head")
        return
    probs = torch.softmax(out[0, -1].float(), dim=-1)
    values, indices = probs.topk(min(top_k, probs.numel()))
    for p, i in zip(values.tolist(), indices.tolist()):
        text = f" {tokenizer.decode([i])!r}" if tokenizer else ""
        click.echo(f"{i:>8}{text}  {p:.4f}")


def _tokenizer(path: Path):
    file = Path(path) / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def _parse_ids(ids: str | None, prompt: str | None, tokenizer, vocab: int) -> list[int]:
    if (ids is None) == (prompt is None):
        raise ParityError("give exactly one of --prompt TEXT or --ids 1,2,3")
    if ids is not None:
        try:
            out = [int(x) for x in ids.split(",") if x.strip()]
        except ValueError:
            raise ParityError(f"--ids {ids!r}: expected comma-separated integers like 1,2,3") from None
    else:
        if tokenizer is None:
            raise ParityError("this checkpoint has no tokenizer.json; give --ids instead of --prompt")
        out = tokenizer.encode(prompt).ids
    bad = [i for i in out if not 0 <= i < vocab]
    if not out or bad:
        raise ParityError(f"token ids must be in [0, {vocab}); got {bad or 'none'}")
    return out


@cli.command("check", context_settings=CONTEXT)
@click.option("--reference", required=True, type=click.Path(path_type=Path),
              help="The Hugging Face checkpoint directory the candidate must match (run with transformers).")
@click.option("--candidate", required=True, type=click.Path(path_type=Path),
              help="A neutral directory (parity convert) or another Hugging Face checkpoint directory.")
@click.option("--layerwise", is_flag=True, help="Compare every capture point, not only the final output.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="The candidate's dtype; the reference runs in float32.")
@click.option("--prompt", default=None, help="Text, tokenized with the reference's tokenizer.")
@click.option("--ids", default=None, help="Comma-separated token ids.")
@click.option("--inputs", "inputs_file", type=click.Path(path_type=Path), default=None,
              help="A JSON list of prompts (strings or id lists); each point keeps its worst result.")
@click.option("--length", type=int, default=None,
              help="A deterministic prompt of N tokens (default: long enough to cross every sliding window).")
@click.option("--isolate", is_flag=True, help="Feed each candidate layer the reference's input for that layer.")
@click.option("--calibrate", is_flag=True, help="Set tolerances to a multiple of each point's own precision noise.")
@click.option("--tolerance", multiple=True, metavar="SPEC",
              help="'GLOB:rel_l2=1e-3[,cosine=0.999]' or a TOML file; repeatable, the last match wins.")
@click.option("--report", "report_paths", multiple=True, type=click.Path(path_type=Path),
              help="Write the report: .json, .md or .html (repeatable).")
@click.option("--junit", type=click.Path(path_type=Path), default=None, help="Write JUnit XML, one case per point.")
@click.option("--generate", type=int, default=0, metavar="N",
              help="Also greedy-decode N tokens with both and report the first position where they differ.")
@click.option("--per-layer", is_flag=True, help="Show one row per layer instead of one per point.")
@adapters_option
def check_cmd(reference, candidate, layerwise, dtype, prompt, ids, inputs_file, length, isolate, calibrate,
              tolerance, report_paths, junit, generate, per_layer, adapter_dirs):
    """Compare a candidate against the reference, point by point; exit 0 pass, 1 fail, 2 no verdict.

    \b
    Examples:
      parity check --reference ./gemma-2-9b --candidate ./gemma-2-9b.neutral --layerwise
      parity check --reference ./llama --candidate ./llama.neutral --dtype bfloat16 --calibrate --report r.html
      parity check --reference ./qwen3 --candidate ./port --layerwise --isolate --junit parity.xml
    """
    from .runner import check

    report = _run_check(reference, candidate, dtype=dtype, layerwise=layerwise, isolate=isolate, calibrate=calibrate,
                        tolerance=list(tolerance), prompt=prompt, ids=_parse_id_list(ids), length=length,
                        inputs_file=inputs_file, generate=generate, adapter_dirs=adapter_dirs, per_layer=per_layer,
                        report_paths=report_paths, junit=junit, run=check)
    sys.exit(report.exit_code)


def _console() -> Console:
    """The terminal's width, or 120 columns in a CI log (rich would assume 80 and squeeze the table)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def _run_check(reference, candidate, *, per_layer, report_paths, junit, run, **kwargs):
    from . import render

    console = _console()
    with Console(stderr=True).status("checking") as status:
        report = run(reference, candidate, progress=lambda message: status.update(message), **kwargs)
    render.console(report, console, per_layer=per_layer)
    for path, fmt in [*((p, None) for p in report_paths), *([(junit, ".xml")] if junit else [])]:
        render.write(report, path, fmt)
        click.echo(f"wrote {path}", err=True)
    return report


def _parse_id_list(ids: str | None) -> list[int] | None:
    if ids is None:
        return None
    try:
        return [int(x) for x in ids.split(",") if x.strip()]
    except ValueError:
        raise ParityError(f"--ids {ids!r}: expected comma-separated integers like 1,2,3") from None


@cli.command("demo", context_settings=CONTEXT)
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=Path("demo-report.html"),
              show_default=True, help="Where to write the HTML report of the Gemma 2 check.")
def demo_cmd(report_path):
    """Make tiny checkpoints of a few families, convert them, check them layer by layer.

    Gemma 2 (sandwich norms, `1 + w`, softcaps, sliding windows), Llama and Qwen 3 are built with
    transformers' own classes, converted to the neutral layout, and checked against transformers in
    float32 with calibrated tolerances; the Gemma 2 report is written as HTML.
    """
    from . import render
    from .runner import check
    from .neutral import convert
    from .tiny import make_tiny

    adapters = load_all()
    console = _console()
    verdicts = {}
    with tempfile.TemporaryDirectory(prefix="parity-demo-") as tmp:
        for family in ("gemma2", "llama", "qwen3"):
            src = make_tiny(adapters[family], Path(tmp) / family)
            convert(src, Path(tmp) / f"{family}.neutral")
            console.rule(f"{family}: tiny checkpoint -> neutral layout -> parity check --layerwise --calibrate")
            report = check(src, Path(tmp) / f"{family}.neutral", layerwise=True, calibrate=True)
            render.console(report, console, per_layer=family != "gemma2")
            verdicts[family] = report.verdict
            if family == "gemma2":
                render.write(report, report_path)
    console.print(f"verdicts: {', '.join(f'{f} {v}' for f, v in verdicts.items())}; report written to {report_path}")
    sys.exit(0 if all(v == "pass" for v in verdicts.values()) else 1)


def main() -> None:
    cli(prog_name="parity")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
