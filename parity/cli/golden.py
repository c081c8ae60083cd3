"""``parity report`` (merge slices' reports), ``parity golden`` (record, verify) and ``parity inputs``: the commands
around a check's reference and its reports."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from parity import render
from parity.cli.common import CONTEXT, Group, Outputs, adapters_option, console, input_options, run_check
from parity.report import Report, merge_slices
from parity.storage.jsonfile import read_json


@click.group("report", cls=Group, context_settings=CONTEXT)
def report_group():
    """Reports written by `parity check --report FILE.json`.

    \b
    Example (a model checked as slices, on as many machines):
      parity check --reference golden/dsv3 --checkpoint ./dsv3 --candidate ./port --layerwise --layers 0:31 --report a.json
      parity check --reference golden/dsv3 --checkpoint ./dsv3 --candidate ./port --layerwise --layers 31:61 --report b.json
      parity report merge a.json b.json -o parity.json --junit parity.xml
    """


@report_group.command("merge", context_settings=CONTEXT)
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", "report_paths", multiple=True, type=click.Path(path_type=Path),
              help="Write the merged report (.json, .md or .html by suffix); may be repeated.")
@click.option("--junit", type=click.Path(path_type=Path), default=None, help="Write JUnit XML, one case per point.")
@click.option("--per-layer", is_flag=True, help="Show one row per layer instead of one per point.")
def report_merge_cmd(files, report_paths, junit, per_layer):
    """Join the JSON reports of `check --layers` slices into one verdict; exit 0 pass, 1 fail, 2 no verdict
    (a layer no slice covers, slices that overlap or come from different checks)."""
    outputs = [*((p, None) for p in report_paths), *([(junit, ".xml")] if junit else [])]
    for path, fmt in outputs:
        render.check_output(path, fmt)
    reports = []
    for file in files:
        data = read_json(file, "give the JSON reports `parity check --layers ... --report r.json` wrote")
        reports.append((str(file), Report.from_json(data, str(file))))
    report = merge_slices(reports)
    render.console(report, console(), per_layer=per_layer)
    for path, fmt in outputs:
        render.write(report, path, fmt)
        click.echo(f"wrote {path}", err=True)
    sys.exit(report.exit_code)


@click.group("golden", cls=Group, context_settings=CONTEXT)
def golden_group():
    """Goldens: reference activations recorded once, so that a port is checked without transformers.

    \b
    Examples:
      parity golden record ./llama -o golden/llama --points layers --storage float16 --calibrate
      parity check --reference golden/llama --candidate engine-dump.safetensors --layerwise
      parity golden verify golden/llama --reference ./llama    # does this transformers still reproduce it?
    """


@golden_group.command("record", context_settings=CONTEXT)
@click.argument("reference", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path), help="Directory to write.")
@input_options
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="The candidates' dtype, which --calibrate measures the noise for; the reference runs in float32.")
@click.option("--points", type=click.Choice(["all", "layers", "final"]), default="all", show_default=True,
              help="Every capture point; the stream between layers (embed, layers.N.out, final_norm, logits); "
                   "or the final output only.")
@click.option("--calibrate", is_flag=True, help="Also store each point's precision noise and calibrated tolerance.")
@click.option("--storage", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="float16 halves the size; its rounding (rel_l2 ~3e-4) becomes a floor on tolerances.")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
@click.option("--decode", type=click.IntRange(min=0), default=0, metavar="N",
              help="Also store the first input's greedy continuation (N tokens) and each decode step's points, "
                   "for `check --decode N` against the golden.")
@adapters_option
def golden_record_cmd(reference, out, prompts, dtype, points, calibrate, storage, force, decode, adapter_dirs):
    """Run REFERENCE with transformers and store its activations, inputs and sha256s as a golden.

    \b
    Example:
      parity golden record ./gemma-2-9b -o golden/gemma-2-9b --points layers --storage float16 --calibrate
    """
    from parity.checker.record import record  # torch: loaded when a command runs, not for --help
    from parity.reference.golden import size

    with Console(stderr=True).status("recording") as status:
        golden = record(reference, out, prompts=prompts, dtype=dtype, points=points, calibrate=calibrate,
                        storage=storage, force=force, adapter_dirs=adapter_dirs, decode=decode,
                        progress=lambda message: status.update(message))
    tokens = ", ".join(str(len(r.ids)) for r in golden.runs)
    click.echo(f"wrote {out}: {golden.description.family}, {len(golden.points)} points, {tokens} tokens"
               f"{f' and {decode} decode steps' if decode else ''}, {storage}"
               f"{', calibrated for ' + dtype if calibrate else ''}; {_size(size(out))}")


@golden_group.command("verify", context_settings=CONTEXT)
@click.argument("golden", type=click.Path(path_type=Path))
@click.option("--reference", required=True, type=click.Path(path_type=Path),
              help="The checkpoint the golden was recorded from, run again with the installed transformers.")
@click.option("--report", "report_paths", multiple=True, type=click.Path(path_type=Path),
              help="Write the drift report: .json, .md or .html (repeatable).")
@adapters_option
def golden_verify_cmd(golden, reference, report_paths, adapter_dirs):
    """Re-run the live reference and report drift from GOLDEN, point by point; exit 1 on drift.

    \b
    Example:
      parity golden verify golden/gemma-2-9b --reference ./gemma-2-9b
    """
    from parity.checker.run import verify_golden  # torch: loaded when a command runs, not for --help

    report = run_check(golden, reference, verify_golden, Outputs(tuple(report_paths)), adapter_dirs=adapter_dirs)
    then = report.reference["recorded_with"]
    versions = f"recorded with transformers {then['transformers']}, torch {then['torch']}"
    if report:
        click.echo(f"no drift: the live reference reproduces {golden} ({versions})")
    else:
        click.echo(f"drift at {report.first_divergence.name}: the live reference no longer reproduces {golden} "
                   f"({versions})")
    sys.exit(report.exit_code)


@click.command("inputs", context_settings=CONTEXT)
@click.argument("reference", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="The JSON file to write: a list of token-id lists (replaced if it exists).")
@input_options
@click.option("--decode", type=click.IntRange(min=0), default=0, metavar="N",
              help="Also write the N tokens to feed one step at a time after the first prompt (the reference's "
                   "greedy continuation), for `check --decode N`.")
@adapters_option
def inputs_cmd(reference, out, prompts, decode, adapter_dirs):
    """Write the exact token ids an engine must run to be checked against REFERENCE (a checkpoint or a golden).

    The file is what `parity check --inputs` reads, so both sides run the same ids.

    \b
    Example:
      parity inputs golden/llama -o inputs.json
      parity inputs golden/llama --decode 32 -o inputs.json
    """
    from parity.checker.sides import inputs_for  # torch: loaded when a command runs, not for --help
    from parity.dumps import write_inputs

    rows, tokens = inputs_for(reference, prompts, adapter_dirs=adapter_dirs, decode=decode)
    write_inputs(out, rows, tokens)
    click.echo(f"wrote {out}: {len(rows)} input(s) of {', '.join(str(len(r)) for r in rows)} tokens"
               f"{f', then {len(tokens)} decode tokens' if tokens else ''}")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
