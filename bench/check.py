"""Benchmark `parity check --layerwise` at real sizes; prints ratios, not times.

    python bench/check.py [--dir /tmp/parity-bench-check] [--length N] [--layers 32] [--rounds 5]
                          [--skip-8b] [--skip-1b] [--skip-gemma] [--only llama-1b|llama-8b|gemma3-270m]

Three models with seeded random weights, written a tensor at a time (so that making them needs little memory):

- Llama-3.1-8B-shaped (32 layers, vocabulary 128,256, about 16 GB): too big for this machine's memory as a
  float32 reference (32 GB), so the check streams its weights a layer at a time. It is converted with
  `parity convert` (against `cp -r` of the same files) and checked `--layerwise`; printed: peak RSS / checkpoint
  size, and check time / (one streamed transformers forward + one streamed executor forward); then it is
  exported with `parity convert --to onnx --dtype float16` (weights streamed into external data).
- Llama-3.2-1B-shaped (16 layers, about 2.5 GB), which fits: check time / (plain transformers forward + plain
  executor forward), once `--stream` and once `--no-stream`.
- Gemma-3-270M-shaped (google/gemma-3-270m's config: hidden 640, 18 layers, 4 heads, 1 KV head, head_dim 256,
  vocabulary 262,144, sliding window 512, 5 sliding : 1 global, tied embeddings) in float32, 1.07 GB, which
  fits, with a tokenizer of Gemma 3's kind and size (BPE with byte fallback, 262,144 seeded random pieces,
  harness.write_tokenizer); checked `--layerwise` on a text prompt of 528 tokens, which the check tokenizes
  (the forwards run 528 ids). Its logits ([528, 262144], 553 MB a side) are half the checkpoint, so holding a
  side's twice, or both sides' beside a model, shows at once. Printed: the check's peak RSS / checkpoint size,
  (start-up + check) / (start-up + transformers forward + executor forward), where start-up is the time from
  spawning a child to the end of its imports (python, torch, transformers, parity), as every child reports it,
  the median over all; each of the three is run `--rounds` times, alternated, and its median taken; and where
  the median check's time goes, phase by phase (bench/phases.py: tokenizer, plan, loading, each side's
  forward, metrics, drill-down, report, and what no phase took), beside the median bare forwards' loading
  and forwards.

Every measured command runs in its own child process (bench/harness.py): peak RSS is the child's own (VmHWM);
the check and the forwards time themselves from after their imports (and report their start-up before that);
convert and cp are timed whole.
The forwards are `parity.checker.run.plain_forward`: load the model, run the prompt, no capture, no comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
from harness import STARTUP_LINE, cli, gemma3_config, llama_config, make_checkpoint, prompt_of, run, write_tokenizer

LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False}
LLAMA_32_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True}
GEMMA_3_270M = {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
                "query_pre_attn_scalar": 256, "tie_word_embeddings": True}
CASES = ("llama-1b", "llama-8b", "gemma3-270m")

# both import what a check imports (torch, transformers, parity) before their clocks start, and say how long
# that took them since they were spawned; then each times its phases (bench/phases.py) and prints them
IMPORTS = ("import os, time, torch, transformers, parity.cli, parity.checker.run\n" + STARTUP_LINE
           + "sys.path.insert(0, 'bench'); import phases\n")
FORWARD = (IMPORTS + "from pathlib import Path; from parity.checker.run import plain_forward\n"
           "path, length, stream = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == 'stream'\n"
           "t = time.perf_counter(); phases.install_loading()\n"
           "plain_forward(path, torch.arange(3, length + 3)[None], stream=stream)\n"
           "print('seconds', time.perf_counter() - t); print(phases.line())")
CHECK = (IMPORTS + "from parity.cli import cli; t = time.perf_counter(); phases.install()\n"
         "try:\n"
         "    cli(sys.argv[1:], prog_name='parity')\n"
         "finally:\n"
         "    print('seconds', time.perf_counter() - t); print(phases.line())")


def forward(path: Path, length: int, stream: bool) -> float:
    """One plain forward in a child: seconds from loading the model to the logits (imports excluded)."""
    return forward_run(path, length, stream).seconds


def forward_run(path: Path, length: int, stream: bool):
    result = run(FORWARD, f"forward {path.name} ({'streamed' if stream else 'whole'})", str(path), str(length),
                 "stream" if stream else "whole")
    if result.exit != 0:
        raise SystemExit(f"the forward of {path} failed")
    return result


def check(reference: Path, candidate: Path, length: int, *flags: str, prompt: str | None = None):
    """`parity check --layerwise` in a child, timed from after its imports as the forwards are, on ``prompt`` (a
    text the reference's tokenizer encodes) or else on ``length`` ids; it must pass."""
    inputs = ("--prompt", prompt) if prompt is not None else ("--length", str(length))
    result = run(CHECK, " ".join(["parity check --layerwise", *flags, *(["--prompt TEXT"] if prompt else [])]),
                 "check", "--reference", str(reference), "--candidate", str(candidate), "--layerwise", *inputs,
                 *flags)
    if result.exit != 0:
        raise SystemExit(f"the check did not pass (exit {result.exit})")
    return result


def copy(source: Path, out: Path) -> float:
    os.sync()
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    return time.perf_counter() - start


def big(root: Path, length: int, layers: int) -> None:
    ckpt, neutral = root / "llama-8b", root / "llama-8b.neutral"
    start = time.perf_counter()
    nbytes, _ = make_checkpoint(ckpt, llama_config({**LLAMA_31_8B, "num_hidden_layers": layers}, torch.bfloat16),
                                torch.bfloat16)
    print(f"Llama-3.1-8B-shaped, {layers} layers, bfloat16: {nbytes / 1e9:.2f} GB written in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    cps, converts = [], []
    for k in range(2):  # alternated, so that other load on the machine falls on both alike
        cps.append(copy(ckpt, root / "copy"))
        print(f"  cp -r: {cps[-1]:.1f} s", flush=True)
        shutil.rmtree(root / "copy")
        if k:
            shutil.rmtree(neutral)
        converts.append(cli("parity convert --to neutral", "convert", str(ckpt), "--to", "neutral", "-o",
                            str(neutral)))
    cp, conv = statistics.median(cps), min(converts, key=lambda r: r.wall)
    ref, cand = forward(ckpt, length, True), forward(neutral, length, True)
    run = check(ckpt, neutral, length)
    print(f"  convert time / cp time:                 {conv.wall / cp:.2f}")
    print(f"  convert peak RSS / checkpoint size:     {conv.peak / nbytes:.3f}")
    print(f"  check peak RSS:                         {run.peak / 2**30:.2f} GiB")
    print(f"  check peak RSS / checkpoint size:       {run.peak / nbytes:.3f}")
    print(f"  check time / (streamed transformers forward + streamed executor forward): "
          f"{run.seconds / (ref + cand):.2f}", flush=True)
    shutil.rmtree(neutral)
    onnx = cli("parity convert --to onnx --dtype float16", "convert", str(ckpt), "--to", "onnx", "--dtype", "float16",
               "-o", str(root / "llama-8b.onnx"))
    if onnx.exit != 0:
        raise SystemExit(f"the ONNX export failed (exit {onnx.exit})")
    print(f"  ONNX export peak RSS / checkpoint size: {onnx.peak / nbytes:.3f}   "
          f"({(root / 'llama-8b.onnx.data').stat().st_size / 1e9:.2f} GB of external data)", flush=True)


def fits(root: Path, length: int) -> None:
    ckpt, neutral = root / "llama-1b", root / "llama-1b.neutral"
    nbytes, _ = make_checkpoint(ckpt, llama_config(LLAMA_32_1B, torch.bfloat16), torch.bfloat16)
    print(f"Llama-3.2-1B-shaped, bfloat16: {nbytes / 1e9:.2f} GB", flush=True)
    cli("parity convert --to neutral", "convert", str(ckpt), "--to", "neutral", "-o", str(neutral))
    plain = forward(ckpt, length, False) + forward(neutral, length, False)
    streamed = forward(ckpt, length, True) + forward(neutral, length, True)
    for flag in ("--stream", "--no-stream"):
        run = check(ckpt, neutral, length, flag)
        print(f"  check {flag} time / (plain transformers forward + plain executor forward): "
              f"{run.seconds / plain:.2f}   (peak RSS / checkpoint size {run.peak / nbytes:.2f})")
    print(f"  (streamed forwards / plain forwards: {streamed / plain:.2f})", flush=True)


def gemma(root: Path, length: int, rounds: int) -> None:
    ckpt, neutral = root / "gemma3-270m", root / "gemma3-270m.neutral"
    nbytes, _ = make_checkpoint(ckpt, gemma3_config(GEMMA_3_270M, torch.float32), torch.float32)
    size = write_tokenizer(ckpt, GEMMA_3_270M["vocab_size"])
    prompt = prompt_of(ckpt, length)
    print(f"Gemma-3-270M-shaped, float32: {nbytes / 1e9:.2f} GB; tokenizer of {GEMMA_3_270M['vocab_size']:,} "
          f"pieces ({size / 1e6:.0f} MB); a text prompt of {length} tokens", flush=True)
    cli("parity convert --to neutral", "convert", str(ckpt), "--to", "neutral", "-o", str(neutral))
    refs, cands, checks = [], [], []
    for _ in range(rounds):  # alternated, so that other load on the machine falls on all three alike
        refs.append(forward_run(ckpt, length, False))
        cands.append(forward_run(neutral, length, False))
        checks.append(check(ckpt, neutral, length, prompt=prompt))
    startup = statistics.median(r.startup for r in refs + cands + checks)
    ref, cand, chk = (statistics.median(r.seconds for r in runs) for runs in (refs, cands, checks))
    peak = max(r.peak for r in checks)
    print(f"  start-up (spawn to imports done, median of {3 * rounds} children): {startup:.1f} s; medians of "
          f"{rounds} rounds: transformers forward {ref:.1f} s, executor forward {cand:.1f} s, check {chk:.1f} s")
    breakdown(*(median_run(runs) for runs in (checks, refs, cands)))
    print(f"  (forwards' peak RSS / checkpoint size: transformers {max(r.peak for r in refs) / nbytes:.2f}, "
          f"executor {max(r.peak for r in cands) / nbytes:.2f})")
    print(f"  check peak RSS:                         {peak / 2**30:.2f} GiB")
    print(f"  check peak RSS / checkpoint size:       {peak / nbytes:.2f}")
    print(f"  (start-up + check) / (start-up + transformers forward + executor forward): "
          f"{(startup + chk) / (startup + ref + cand):.2f}", flush=True)


def median_run(runs: list):
    """The run whose time is the median (the lower middle one of an even number)."""
    return sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]


def phases_of(result) -> dict[str, float]:
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("phases "))[7:])


def breakdown(chk, ref, cand) -> None:
    """Where the median check's time goes (bench/phases.py), beside what the median bare forwards spend on the
    same: their loading, and the rest of them, each side's forward."""
    p, loads = phases_of(chk), phases_of(ref)["loading"] + phases_of(cand)["loading"]
    rows = [("tokenizer: reading tokenizer.json, encoding the text", p["tokenizer"], None),
            ("plan: opening both sides, the inputs", p["plan"], None),
            ("loading the models (and dropping the reference)", p["loading"], loads),
            ("reference forward, its capture hooks, its points to disk", p["reference forward"],
             ref.seconds - phases_of(ref)["loading"]),
            ("candidate forward, emitting its points", p["candidate forward"],
             cand.seconds - phases_of(cand)["loading"]),
            ("each candidate point: its reference read back, kept", p["on point"], None),
            ("metrics, float64", p["metrics"], None),
            ("drill-down, diagnosis", p["drill-down, diagnosis"], None),
            ("report", p["report"], None),
            ("other (unattributed)", chk.seconds - sum(p.values()), None)]
    print(f"  where the median check's {chk.seconds:.1f} s go (after start-up), beside the median bare forwards' "
          f"{ref.seconds + cand.seconds:.1f} s:")
    for what, seconds, bare in rows:
        print(f"    {what:<58} {seconds:5.2f} s" + ("" if bare is None else f"   (bare forwards: {bare:.2f} s)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/parity-bench-check"))
    parser.add_argument("--length", type=int, help="prompt tokens (default: 128 for the Llama shapes, 528 for Gemma)")
    parser.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model (32 is the real one)")
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--skip-gemma", action="store_true")
    parser.add_argument("--only", choices=CASES, help="run this model alone")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each Gemma measurement (medians)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args()
    run_case = {"llama-1b": not args.skip_1b, "llama-8b": not args.skip_8b, "gemma3-270m": not args.skip_gemma}
    if args.only:
        run_case = {case: case == args.only for case in CASES}
    if args.dir.exists():
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    llama = run_case["llama-1b"] or run_case["llama-8b"]
    print(f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB "
          f"memory; {f'prompt of {args.length or 128} tokens; ' if llama else ''}float32 reference and candidate",
          flush=True)
    try:
        if run_case["llama-1b"]:
            fits(args.dir, args.length or 128)
        if run_case["llama-8b"]:
            big(args.dir, args.length or 128, args.layers)
        if run_case["gemma3-270m"]:
            gemma(args.dir, args.length or 528, args.rounds)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
