"""Benchmark `parity check --layerwise --decode N` against the prefill-only check; prints ratios, not times.

    python bench/decode.py [--dir /tmp/parity-bench-decode] [--length 64] [--steps 32]

A Llama-3.2-1B-shaped checkpoint (16 layers, vocabulary 128,256, seeded random bfloat16 weights, about 2.5 GB) is
converted to the neutral layout and checked twice, each in its own child process (bench/harness.py): the
prefill-only check of a prompt of --length tokens, and the same check with --decode --steps. What decoding adds:
the reference's greedy continuation (transformers with its cache), one uncached reference forward over the prompt
and the continuation (the truth for every step), and the candidate's steps through the executor's cache; both
models stay loaded meanwhile. Printed: decode check time / prefill check time, and each check's peak RSS /
checkpoint size.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
from check import LLAMA_32_1B, check
from harness import cli, llama_config, make_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/parity-bench-decode"))
    parser.add_argument("--length", type=int, default=64, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="decode steps")
    args = parser.parse_args()
    if args.dir.exists():
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    print(f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB "
          f"memory; prompt of {args.length} tokens, {args.steps} decode steps; float32 reference and candidate",
          flush=True)
    try:
        ckpt, neutral = args.dir / "llama-1b", args.dir / "llama-1b.neutral"
        nbytes, _ = make_checkpoint(ckpt, llama_config(LLAMA_32_1B, torch.bfloat16), torch.bfloat16)
        print(f"Llama-3.2-1B-shaped, bfloat16: {nbytes / 1e9:.2f} GB", flush=True)
        cli("parity convert --to neutral", "convert", str(ckpt), "--to", "neutral", "-o", str(neutral))
        prefill = check(ckpt, neutral, args.length, "--no-stream")
        decode = check(ckpt, neutral, args.length, "--no-stream", "--decode", str(args.steps))
        print(f"  decode check time / prefill check time:  {decode.seconds / prefill.seconds:.2f}")
        print(f"  prefill check peak RSS / checkpoint size: {prefill.peak / nbytes:.2f}")
        print(f"  decode check peak RSS / checkpoint size:  {decode.peak / nbytes:.2f}", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
