"""A check's options: one typed object from the command line (``parity check``) or the library (``parity.check``)
to the plan (parity.checker.plan), which refuses what cannot be honoured before any model loads.

Each field carries the flag, help and kind of its command-line option, so that the option is written once: the CLI
builds its click options from these fields (parity.cli.common.check_options). The input options (--prompt, --ids,
--inputs, --length) and --adapters are shared with other commands and declared there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from parity.errors import ParityError

DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def _option(default, flag: str | None = None, help: str = "", **cli):
    """A field with its command-line option: ``flag`` (None: not on the command line), its help, and click's
    ``is_flag``, ``multiple``, ``choices``, ``metavar``, ``count`` (an int >= 0), ``path``, ``show_default``,
    ``secondary`` (the off switch of a --x/--no-x flag), ``number`` (a float in the range (min, max); None: open)."""
    metadata = {"flag": flag, "help": help, **cli}
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CheckOptions:
    """Every option of a check; parity.checker.run.check documents what each does."""

    layerwise: bool = _option(False, "--layerwise", "Compare every capture point, not only the final output.",
                              is_flag=True)
    points: str = _option("layers", "--points", "ops: compare every operation inside each layer too (q, k, v, RoPE, "
                          "scores, probs, context, the MLP's gate, up and activation; docs/ops.md). Without it a "
                          "failing check re-runs only its first diverging layer at op granularity.",
                          choices=("layers", "ops"), show_default=True)
    dtype: str = _option("float32", "--dtype", "The candidate's dtype; the reference runs in float32.",
                         choices=DTYPE_CHOICES, show_default=True)
    prompt: str | None = _option(None)             # the inputs: parity.cli.common.input_options
    ids: tuple[int, ...] | None = _option(None)
    inputs_file: Path | None = _option(None)
    length: int | None = _option(None)
    isolate: bool = _option(False, "--isolate", "Feed each candidate layer the reference's input for that layer (a "
                            "candidate that cannot be fed, a graph run whole or a dump: each reference layer the "
                            "candidate's input).", is_flag=True)
    calibrate: bool = _option(False, "--calibrate", "Set tolerances to a multiple of each point's own precision "
                              "noise.", is_flag=True)
    tolerance: tuple[str, ...] = _option((), "--tolerance", "'GLOB:rel_l2=1e-3' or a TOML file ([default], "
                                         "[points.\"GLOB\"]); repeatable, the last match wins.", multiple=True,
                                         metavar="SPEC")
    generate: int = _option(0, "--generate", "Also greedy-decode N tokens with both and report the first position "
                            "where they differ.", count=True, metavar="N")
    decode: int = _option(0, "--decode", "Check the KV-cache path: the candidate runs the prompt, then N "
                          "single-token steps with its own cache, each compared with the reference's uncached "
                          "forward at that position.", count=True, metavar="N")
    inject: str | None = _option(None, "--inject", "Run a neutral candidate with a catalogued porting mistake "
                                 "applied (see `parity bugs`); BUG=VALUE: one with a size, at the port's value "
                                 "(final-softcap-added=3.0).", metavar="BUG")
    checkpoint: Path | None = _option(None, "--checkpoint", "With a golden --reference: the checkpoint it must have "
                                      "been recorded from (sha256 checked).", path=True)
    provider: str | None = _option(None, "--provider", "Graph candidates: the runtime's execution provider (default "
                                   "CPUExecutionProvider).", metavar="NAME")
    maps: tuple[str, ...] = _option((), "--map", "Graph candidates: read capture point POINT from graph value VALUE "
                                    "(repeatable).", multiple=True, metavar="POINT=VALUE")
    attn: str | None = _option(None, "--candidate-attn", "Hugging Face candidates: transformers' attention "
                               "implementation (eager, sdpa, flex_attention).", metavar="IMPL")
    compile: bool = _option(False, "--compile", "Hugging Face candidates: run the candidate under torch.compile.",
                            is_flag=True)
    engine_options: tuple[str, ...] = _option((), "--engine-option", "Engine candidates (KIND:PATH): one of the "
                                              "engine's options, e.g. bits=4 (repeatable; `parity engines` lists "
                                              "them).", multiple=True, metavar="KEY=VALUE")
    stream: bool | None = _option(None, "--stream", "Read the models' weights a layer at a time (default: only when "
                                  "they would not fit in memory).", secondary="--no-stream")
    device: str = _option("cpu", "--device", "Where the reference runs: cpu, cuda, cuda:N, mps, or auto (every GPU, "
                          "else the CPU).", metavar="DEVICE", show_default=True)
    candidate_device: str | None = _option(None, "--candidate-device", "Where the candidate runs (parity's "
                                           "executor, a Hugging Face candidate); default: --device.",
                                           metavar="DEVICE")
    layers: str | None = _option(None, "--layers", "Check only layers [A, B), fed the reference's (a golden's) input "
                                 "to layer A; join the slices' JSON reports with `parity report merge`.",
                                 metavar="A:B")
    same_weights: bool | None = _option(None, "--same-weights", "How a quantized candidate is judged. "
                                        "--same-weights: the reference runs the candidate's own (dequantized) weights "
                                        "as its engine computes, so that quantization is not taken for a porting "
                                        "mistake (the default for a quantized candidate, with --calibrate; the "
                                        "quantization's cost against the float reference is reported beside). "
                                        "--float-reference: the reference runs the checkpoint's float weights, and "
                                        "the quantization's error counts as the port's (the default for a float "
                                        "candidate).", secondary="--float-reference")
    max_kl: float | None = _option(None, "--max-kl", "Also fail when the candidate's logits are further from the "
                                   "float reference than this mean KL divergence (nats per position): a gate on "
                                   "what the quantization costs.", number=(0.0, None), metavar="NATS")
    min_top1: float | None = _option(None, "--min-top1", "Also fail when fewer than this share of positions "
                                     "(0-1) have the float reference's top token as the candidate's: a gate on "
                                     "what the quantization costs.", number=(0.0, 1.0), metavar="SHARE")
    diagnose: bool = _option(True)                 # name the likely mistake at the first divergence
    adapter_dirs: tuple[Path, ...] = _option(())   # --adapters: parity.cli.common.adapters_option

    def __post_init__(self):
        # lists from the command line or a caller become tuples: the options are frozen, and hashable
        for name in ("tolerance", "maps", "engine_options", "adapter_dirs", "ids"):
            value = getattr(self, name)
            if isinstance(value, dict):  # --map given as {point: value}
                value = [f"{k}={v}" for k, v in value.items()]
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))

    @classmethod
    def of(cls, base: CheckOptions | None = None, **given) -> CheckOptions:
        """The options from keyword arguments (``parity.check``'s), over ``base`` where one is given, each name
        checked: an unknown one is refused with the names that exist, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ParityError(f"unknown check option(s) {', '.join(unknown)}; the options are "
                              f"{', '.join(sorted(known))}")
        return cls(**given) if base is None else replace(base, **given)


def command_line() -> list:
    """The fields the command line sets, with their flags, in the order ``parity check --help`` lists them."""
    return [f for f in fields(CheckOptions) if f.metadata.get("flag")]

