"""The ``parity`` command line: a thin layer over the library; errors become exit code 2."""

from __future__ import annotations

import sys

from parity import signals

# the console script (parity/__main__.py) installed them before importing this module; for a caller who imports it
# otherwise, they are installed here, before the imports below, which take seconds
signals.install()
try:  # an interrupt while the imports run ends like one during a command
    import json
    import tempfile
    from dataclasses import asdict, dataclass
    from pathlib import Path

    import click
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text
    from tokenizers import Tokenizer

    from parity import __version__, render
    from parity.adapter import load_all, resolved_data
    from parity.cli.common import CONTEXT, Group, Outputs, adapters_option, check_options, run_check
    from parity.cli.common import console as console_for_output
    from parity.cli.golden import golden_group, inputs_cmd, report_group
    from parity.errors import ParityError
except KeyboardInterrupt:
    sys.stderr.write("parity: interrupted; nothing was written\n")
    raise SystemExit(signals.exit_code()) from None

@click.group(cls=Group, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="parity")
@click.option("--debug", is_flag=True, help="Show the traceback of an error (also PARITY_DEBUG=1).")
def cli(debug):
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
@click.option("--resolved", "resolved", metavar="NAME", default=None,
              help="Print everything adapter NAME says, as JSON, once `extends` is merged and defaults filled in.")
def adapters_cmd(adapter_dirs, as_json, resolved):
    """List the model families parity knows, with their conventions in one line each.

    \b
    Examples:
      parity adapters
      parity adapters --resolved mistral     # llama's data with mistral's differences merged in
    """
    from parity.checkpoint.inspection import describe_family  # torch: loaded when a command runs, not for --help

    adapters = load_all(adapter_dirs)
    if resolved is not None:
        if resolved not in adapters:
            raise ParityError(f"no adapter named {resolved!r}; name one of: {', '.join(adapters)} "
                              f"(or add one with --adapters DIR)")
        click.echo(json.dumps(resolved_data(adapters[resolved]), indent=2))
        return
    rows = [dict(describe_family(a.spec), adapter=str(a.path)) for a in adapters.values()]
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
    from parity.checkpoint import inspection, open_checkpoint  # torch: loaded when a command runs, not for --help

    ckpt = open_checkpoint(path, adapter_dirs)
    found = inspection.report(ckpt)
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2, default=str))
    else:
        inspection.render(found, ckpt, Console())
    w = found.weights
    if w is not None and not w.accounted_for:  # the report is shown, and a gate on inspect sees damage
        wrong = ((len(names), kind) for kind, names in (("missing", w.missing), ("unexpected", w.unexpected),
                                                        ("wrong shape", w.wrong_shape)) if names)
        raise ParityError(f"{path}: its tensors do not match the {found.family} adapter "
                          f"({', '.join(f'{n} {kind}' for n, kind in wrong)}); "
                          f"check that config.json belongs to these weights")


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
    from parity.reference.tiny import make_tiny  # torch: loaded when a command runs, not for --help

    adapters = load_all(adapter_dirs)
    if family not in adapters:
        raise ParityError(f"unknown family {family!r}; choose one of {', '.join(adapters)}")
    make_tiny(adapters[family], out, layers=layers, seed=seed, dtype=dtype, force=force)
    click.echo(f"wrote {out} ({family}, seed {seed}, {dtype})")


@cli.command("convert", context_settings=CONTEXT)
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--to", "target", type=click.Choice(["neutral", "onnx", "gguf"]), required=True, help="Output format.")
@click.option("-o", "--output", "out", required=True, type=click.Path(path_type=Path),
              help="Directory to write (neutral), or the .onnx / .gguf file.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Dtype of the written tensors (default: the checkpoint's; float32 for onnx, which takes "
                   "float32 or float16).")
@click.option("--rope-style", type=click.Choice(["half", "interleaved"]), default=None,
              help="Lay q/k rows out for engines that rotate half-split or adjacent pairs (default: as stored).")
@click.option("--debug-outputs", is_flag=True,
              help="onnx: add every capture point (embed, layers.0.attn_in, ...) as a graph output of that name.")
@click.option("--op-outputs", is_flag=True,
              help="onnx: add every operation-level point (layers.0.attn.q, ... layers.0.mlp.act; docs/ops.md) as a "
                   "graph output of that name, so that --points ops and a failing check's drill-down can read them.")
@click.option("--opset", type=int, default=None, help="onnx: the ONNX opset (18-23; default: torch.onnx's).")
@click.option("--kv-cache", is_flag=True,
              help="onnx: add the KV cache (past_key_values.* inputs, present.* outputs), so that the graph decodes "
                   "step by step (parity check --decode N).")
@click.option("--inject", metavar="BUG", default=None,
              help="onnx, gguf: write a deliberately broken export with a catalogued porting mistake (see `parity bugs`).")
@click.option("--gguf-type", type=click.Choice(["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M",
                                               "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"]),
              default="F32", show_default=True,
              help="gguf: how matrices are stored (norms and other vectors stay F32). F32, F16, Q8_0 are written "
                   "by gguf-py; the others by llama.cpp's own quantizer (llama-cpp-python: pip install "
                   "'parity[llama]'), with its per-tensor mix and its fallbacks for rows that do not fit the "
                   "type's block (256 columns for the K-quants); the types each tensor got are printed.")
@click.option("--onnx-quant", type=click.Choice(["int8-dynamic", "qdq", "int4"]), default=None,
              help="onnx: quantize the float32 export with onnxruntime's own tools: int8-dynamic (quantize_dynamic), "
                   "qdq (quantize_static, QDQ, calibrated on the default prompt), int4 (MatMulNBits, blocks of 32); "
                   "check it with parity check --same-weights.")
@click.option("--force", is_flag=True, help="Replace the output if it exists.")
@adapters_option
def convert_cmd(model_dir, target, out, force, adapter_dirs, **formats):
    """Rewrite a checkpoint into the neutral layout (manifest.json + model.safetensors), or export it to ONNX.

    The manifest states every convention as an explicit value (norm kind, eps, placement,
    attention scale, softcaps, RoPE per layer, windows per layer, ...); `1 + w` norm weights are
    folded, Conv1D weights transposed, fused q/k/v split. Tensors are streamed one at a time.

    \b
    `--to onnx` exports the neutral executor with torch.onnx (dynamic batch and sequence; norms in
    float32 inside a float16 graph); the manifest is kept in the model's metadata_props.

    \b
    `--to gguf` writes a GGUF file llama.cpp runs (the families whose adapter has a [gguf] section;
    `pip install gguf`), with llama.cpp's tensor names and q/k layout; `parity check --candidate x.gguf`
    runs it in llama.cpp.

    \b
    Examples:
      parity convert ./gemma-2-9b --to neutral -o ./gemma-2-9b.neutral --dtype bfloat16
      parity convert ./gemma-2-9b --to onnx -o gemma-2-9b.onnx --dtype float16 --debug-outputs
    """
    _refuse_other_formats(target, formats)
    f = Formats(**formats)
    dtype, inject, onnx_quant = f.dtype, f.inject, f.onnx_quant
    if target == "gguf":
        from parity.engines.gguf.export import export as to_gguf  # torch: loaded when a command runs, not for --help

        done = to_gguf(model_dir, out, qtype=f.gguf_type, force=force, adapter_dirs=adapter_dirs, inject=inject)
        click.echo(f"wrote {out}: llama.cpp architecture {done['arch']}, {len(done['tensors'])} tensors, "
                   f"{done['family']}; {done['summary']}")
        return
    if target == "onnx":
        from parity.engines.onnx.export import export  # torch: loaded when a command runs, not for --help

        graph = dict(debug_outputs=f.debug_outputs, op_outputs=f.op_outputs, opset=f.opset, kv_cache=f.kv_cache)
        if onnx_quant:
            from parity.engines.onnx.quantize import quantize  # heavy: numpy, not for --help

            done = quantize(model_dir, out, onnx_quant, dtype=dtype, force=force, adapter_dirs=adapter_dirs,
                            inject=inject, **graph)
            ops = ", ".join(f"{n} {op}" for op, n in done["quantized"]["ops"].items())
            click.echo(f"wrote {out}: {onnx_quant} by onnxruntime, {done['manifest'].source.family}, "
                       f"{len(done['outputs'])} output(s); {ops}")
            return
        done = export(model_dir, out, dtype=dtype, force=force, adapter_dirs=adapter_dirs, inject=inject, **graph)
        click.echo(f"wrote {out}: {done['dtype']}, {done['manifest'].source.family}, "
                   f"{len(done['outputs'])} output(s){', external data ' + out.name + '.data' if done['external_data'] else ''}")
        return
    from parity.neutral.converter import convert  # heavy: the checkpoint readers, not for --help

    manifest = convert(model_dir, out, dtype=dtype, rope_style=f.rope_style, force=force,
                       adapter_dirs=adapter_dirs)
    click.echo(f"wrote {out}: {len(manifest.tensors)} tensors in {len(manifest.files)} file(s), "
               f"{manifest.dtype}, {manifest.source.family}")


@dataclass(frozen=True)
class Formats:
    """convert's options for one output format or another (FORMAT_OPTIONS: which)."""

    dtype: str | None
    rope_style: str | None
    debug_outputs: bool
    op_outputs: bool
    opset: int | None
    kv_cache: bool
    inject: str | None
    gguf_type: str
    onnx_quant: str | None


# The options each --to takes (the rest are refused with the reason): one line per output format
FORMAT_OPTIONS = {
    "neutral": ("dtype", "rope_style"),
    "onnx": ("dtype", "debug_outputs", "op_outputs", "opset", "kv_cache", "inject", "onnx_quant"),
    "gguf": ("gguf_type", "inject"),
}
WHY_NOT = {
    ("gguf", "rope_style"): "the q/k layout is the one llama.cpp's architecture expects",
    ("onnx", "rope_style"): "an ONNX graph rotates as the checkpoint stores",
    ("neutral", "inject"): "for a neutral candidate, inject at check time: parity check --inject BUG",
    ("gguf", "onnx_quant"): "it quantizes an ONNX export; llama.cpp's quantizer makes --gguf-type",
    ("neutral", "onnx_quant"): "it quantizes an ONNX export",
}


def _refuse_other_formats(target: str, formats: dict) -> None:
    unset = {"gguf_type": "F32"}  # the defaults that are not None or False
    for name, value in formats.items():
        if name not in FORMAT_OPTIONS[target] and not (value is None or value is False or value == unset.get(name)):
            takes = [t for t, names in FORMAT_OPTIONS.items() if name in names]
            why = WHY_NOT.get((target, name))
            raise ParityError(f"--{name.replace('_', '-')} applies to --to {' or --to '.join(takes)}, not --to "
                              f"{target}{f' ({why})' if why else ''}")


@cli.command("run", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Text to tokenize with the checkpoint's tokenizer.")
@click.option("--ids", default=None, help="Comma-separated token ids, e.g. 1,2,3.")
@click.option("--top", "top_k", type=click.IntRange(min=1), default=5, show_default=True,
              help="How many next tokens to show.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Run in this dtype (default: the stored one).")
def run_cmd(path, prompt, ids, top_k, dtype):
    """Run a neutral model with the plain-torch executor and print the most likely next tokens.

    \b
    Example:
      parity run ./gemma-2-9b.neutral --prompt "The capital of France is"
    """
    import torch  # torch: loaded when a command runs, not for --help

    from parity.neutral.executor.model import NeutralModel
    from parity.neutral.manifest import load

    manifest, tensors = load(path)
    tokenizer = _tokenizer(path)
    token_ids = _parse_ids(ids, prompt, tokenizer, manifest.vocab_size)
    model = NeutralModel(manifest, tensors, getattr(torch, dtype) if dtype else None)
    out = model(torch.tensor([token_ids]))
    if manifest.head is None:
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
              help="The Hugging Face checkpoint directory the candidate must match (run with transformers), "
                   "or a golden (parity golden record).")
@click.option("--candidate", required=True, type=click.Path(path_type=Path),
              help="A neutral directory (parity convert), another Hugging Face checkpoint directory, "
                   "an engine dump (.safetensors, or a directory of rank*.safetensors from a tensor-parallel run; "
                   "docs/dumps.md), an ONNX model (.onnx), a GGUF file, or "
                   "KIND:PATH for an engine that runs a checkpoint its own way (`parity engines` lists them).")
@check_options
@click.option("--report", "report_paths", multiple=True, type=click.Path(path_type=Path),
              help="Write the report: .json, .md or .html (repeatable).")
@click.option("--junit", type=click.Path(path_type=Path), default=None, help="Write JUnit XML, one case per point.")
@click.option("--per-layer", is_flag=True, help="Show one row per layer instead of one per point.")
def check_cmd(reference, candidate, options, report_paths, junit, per_layer):
    """Compare a candidate against the reference, point by point; exit 0 pass, 1 fail, 2 no verdict.

    \b
    Examples:
      parity check --reference ./gemma-2-9b --candidate ./gemma-2-9b.neutral --layerwise
      parity check --reference ./llama --candidate ./llama.neutral --dtype bfloat16 --calibrate --report r.html
      parity check --reference ./qwen3 --candidate ./port --layerwise --isolate --junit parity.xml
      parity check --reference golden/llama --candidate engine-dump.safetensors --layerwise
      parity check --reference ./llama --candidate llama.onnx --layerwise --map layers.0.out=/model/layers.0/Add_1_output_0
      parity check --reference ./gemma-3-1b --candidate ./gemma-3-1b.neutral --layerwise --decode 32
    """
    from parity.checker.run import check  # torch: loaded when a command runs, not for --help

    report = run_check(reference, candidate, check, Outputs(tuple(report_paths), junit, per_layer), options=options)
    sys.exit(report.exit_code)


@cli.command("demo", context_settings=CONTEXT)
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=Path("demo-report.html"),
              show_default=True, help="Where to write the HTML report of the Gemma 2 check.")
def demo_cmd(report_path):
    """Make tiny checkpoints of a few families, convert them, check them layer by layer.

    Gemma 2 (sandwich norms, `1 + w`, softcaps, sliding windows), Llama and Qwen 3 are built with
    transformers' own classes, converted to the neutral layout, and checked against transformers in
    float32 with calibrated tolerances; the Gemma 2 report is written as HTML. Then the Gemma 2
    candidate is run with `norm-offset-dropped` injected, to show a failing verdict and its diagnosis.
    """
    from parity.checker.run import check  # torch: loaded when a command runs, not for --help
    from parity.neutral.converter import convert  # heavy: the checkpoint readers, not for --help
    from parity.reference.tiny import make_tiny  # torch: loaded when a command runs, not for --help

    adapters = load_all()
    console = console_for_output()
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
        # a port that forgot Gemma's `1 + w`: the check must fail, and say so by name
        console.rule("gemma2 with a porting bug: parity check --inject norm-offset-dropped")
        broken = check(Path(tmp) / "gemma2", Path(tmp) / "gemma2.neutral", layerwise=True, calibrate=True,
                       inject="norm-offset-dropped")
        render.console(broken, console, per_layer=True)
    named = broken.diagnosis[0]["bug"] if broken.diagnosis else "nothing"
    console.print(f"verdicts: {', '.join(f'{f} {v}' for f, v in verdicts.items())}; the injected bug: "
                  f"{broken.verdict}, diagnosed as {named}; report written to {report_path}")
    caught = broken.verdict == "fail" and named == "norm-offset-dropped"
    sys.exit(0 if caught and all(v == "pass" for v in verdicts.values()) else 1)


@cli.command("bugs", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bugs_cmd(as_json):
    """The porting-bug catalog: each mistake, the families it applies to, and how it shows.

    Every convention mistake can be injected (`parity check --inject ID`) and is diagnosed by name when a check
    fails; the input mistakes after them (an engine dump that ran its ids with a BOS doubled, ...) are named from
    the dump's ids.
    """
    from parity.diagnosis import bugs  # torch: loaded when a command runs, not for --help
    from parity.dumps import mistakes

    families = bugs.families()
    rows = [CatalogEntry(id=b.id, kind="convention", mistake=b.mistake, families=families[b.id], shows=b.shows,
                         seen_in=b.seen_in, first_op=b.op, also_at=list(b.also)) for b in bugs.CATALOG]
    rows += [CatalogEntry(id=m.id, kind="input", mistake=m.mistake, families=["all"], shows=mistakes.SHOWS,
                          seen_in=m.seen_in, first_op=None, also_at=[]) for m in mistakes.MISTAKES]
    if as_json:
        click.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    table = Table(box=None, show_lines=False)
    for col in ("id", "mistake", "families", "shows", "first op"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.id, r.mistake, ", ".join(r.families), r.shows,
                      " or ".join([r.first_op, *r.also_at]) if r.first_op else "-")
    console_for_output().print(table)


@dataclass(frozen=True)
class CatalogEntry:
    """A row of `parity bugs`: a convention mistake (parity.diagnosis.bugs) or an input one (parity.dumps.mistakes)."""

    id: str
    kind: str               # "convention" or "input"
    mistake: str
    families: list[str]
    shows: str
    seen_in: str
    first_op: str | None    # the op a drill-down finds it at first (None: outside the layers, or an input mistake)
    also_at: list[str]


@cli.command("engines", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def engines_cmd(as_json):
    """The candidate kinds: how each is taken (found by its files, or named as KIND:PATH), what it can do, its
    --engine-option keys, and whether its engine is installed here."""
    from parity.checker.sides import kind_rows  # torch: loaded when a command runs, not for --help

    rows = kind_rows()
    if as_json:
        click.echo(json.dumps([asdict(r) for r in rows], indent=2))
        return
    table = Table(box=None, show_lines=False)
    for col in ("kind", "taken", "isolates", "decodes", "same weights", "options", "installed"):
        table.add_column(col, overflow="fold")
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    for r in rows:
        table.add_row(r.kind, f"{r.named_as[0]}:PATH" if r.named_as else "by its files", yes(r.isolates),
                      yes(r.decodes), yes(r.same_weights), ", ".join(f"{k}: {v}" for k, v in r.options.items()),
                      "yes" if r.installed else r.install)
    console_for_output().print(table)


@cli.command("selftest", context_settings=CONTEXT)
@click.option("--families", default=None, help="Comma-separated families (default: all).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Run every pair in this dtype (default: float32; bfloat16 for norm-in-low-precision).")
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), default=None,
              help="Also write the matrix as a markdown table.")
def selftest_cmd(families, dtype, md_path):
    """Inject every applicable bug into every family's tiny checkpoint; check, diagnose, tabulate.

    Ends with totals: detection rate, diagnosis accuracy, false alarms on clean conversions, and how
    many a final-output np.allclose(atol=1e-5) or a next-token check would have caught.
    Exit 0 when every pair is detected, no clean conversion fails and no diagnosis is wrong.
    """
    from parity.cli import selftest  # torch: loaded when a command runs, not for --help

    console = console_for_output()
    with Console(stderr=True).status("selftest") as status:
        rows = selftest.run(families.split(",") if families else None, dtype,
                            progress=lambda message: status.update(message))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("family", "bug", "dtype", "detected", "first divergence", "diagnosis", "allclose", "top-1"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        ok = r.detected != (r.bug == "clean")
        diag = "-" if r.diagnosed is None else r.diagnosed
        table.add_row(r.family, r.bug, r.dtype, Text("yes" if r.detected else "no", style="green" if ok else "bold red"),
                      r.first_divergence or "-", Text(diag, style="green" if r.diagnosis_right else "yellow"),
                      "yes" if r.allclose_caught else "no", "yes" if r.top1_caught else "no")
    console.print(table)
    t = selftest.totals(rows)
    console.print(selftest.markdown(rows).splitlines()[-1], soft_wrap=True)
    if md_path:
        md_path.write_text(selftest.markdown(rows) + "\n")
    good = t.detected == t.pairs and t.false_alarms == 0 and t.diagnosed_wrong == 0
    sys.exit(0 if good else 1)


for command in (report_group, golden_group, inputs_cmd):
    cli.add_command(command)


def main() -> None:
    signals.install()  # again, in case the module was imported from another thread (where nothing is installed)
    try:
        cli(prog_name="parity")
    except KeyboardInterrupt:  # outside a command (while click parses, or at exit): the same contract
        click.echo("parity: interrupted; nothing was written", err=True)
        if signals.received is None:  # raised by no signal
            sys.exit(signals.exit_code())
        signals.leave()
    except SystemExit as done:
        if signals.received is None:
            raise
        if done.code != signals.exit_code():  # a signal whose interrupt something caught on its way up
            click.echo("parity: interrupted; nothing was written", err=True)
        signals.leave()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
