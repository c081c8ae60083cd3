"""Benchmark `parity convert --to neutral` on a checkpoint of at least 1 GB; prints ratios, not times.

    python bench/convert.py [--shape small|llama-8b] [--gb 1.3] [--dtype bfloat16] [--shard-gb 5] [--repeat 3]
                            [--dir DIR] [--keep]

It writes a Llama-shaped checkpoint (random weights, streamed to disk so that making it needs little
memory; bfloat16 by default, as 8B-class checkpoints ship; sharded with an index past --shard-gb, as
save_pretrained shards): hidden size 2048 (--shape small), or Llama-3.1-8B's sizes (--shape llama-8b:
hidden 4096, 8 kv heads, vocabulary 128,256; --gb 5.2 makes its first 8 layers, 5.59 GB). It reads the
files once so that they sit in the page cache, copies them with `cp -r` (the floor for any converter that
reads and writes every byte), converts them in a child process, and prints:

  convert time / cp time        how much slower than copying the same bytes the converter is
                                (the convert time includes starting python and its imports: torch only
                                where a tensor must be transformed, so not for this checkpoint)
  convert CPU / cp CPU          the same in CPU seconds (user + system, every thread): what the ratio
                                tends to when other work keeps the cores busy
  peak RSS / largest tensor     how much memory conversion needs relative to the one tensor it must
                                hold; also with the child's baseline (python + the converter imported)
                                removed

Copies and conversions alternate (--repeat times; medians are printed), and dirty pages are flushed
before each, so that neither pays for the other's writeback. The load average before and after is printed:
on a shared machine the times are only comparable when it is low.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
from harness import cli, cpu_seconds, llama_config, make_checkpoint, run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


SHAPES = {  # hidden, intermediate, vocabulary, heads, kv heads (head_dim 128)
    "small": (2048, 5632, 32000, 16, 16),
    "llama-8b": (4096, 14336, 128256, 32, 8),  # Llama-3.1-8B's
}


def shape(target_gb: float, dtype: torch.dtype, kind: str = "small") -> dict:
    """A Llama shape (``kind`` in SHAPES) with as many layers as make about ``target_gb`` GiB at ``dtype``."""
    hidden, inter, vocab, heads, kv_heads = SHAPES[kind]
    per_layer = (2 * heads + 2 * kv_heads) * 128 * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = max(1, round((target_gb * 2**30 / itemsize - fixed) / per_layer))
    return {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128, "vocab_size": vocab,
            "tie_word_embeddings": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="small", help="the checkpoint's sizes")
    ap.add_argument("--gb", type=float, default=1.3, help="checkpoint size to make, in GiB (at least 1)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="the checkpoint's dtype")
    ap.add_argument("--shard-gb", type=float, default=5.0, help="shard the checkpoint past this many GiB")
    ap.add_argument("--repeat", type=int, default=3, help="copies and conversions to take the median of")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/parity-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    src, copy, out = args.dir / "src", args.dir / "copy", args.dir / "neutral"
    dtype = DTYPES[args.dtype]
    config = llama_config(shape(max(args.gb, 1.0), dtype, args.shape), dtype)
    _, largest = make_checkpoint(src, config, dtype, int(args.shard_gb * 2**30))
    files = [p for p in src.iterdir() if p.suffix == ".safetensors"]
    size = sum(p.stat().st_size for p in src.iterdir())
    cp_times, cp_cpu, convert_times, convert_cpu, peak = [], [], [], [], 0
    load_before = os.getloadavg()[0]
    try:
        for p in files:  # into the page cache (making them wrote them there too, unless memory ran short)
            with open(p, "rb", buffering=0) as f:
                while f.read(2**24):
                    pass
        # the child's memory floor: python with parity's converter imported, nothing converted
        baseline = run("import parity.neutral.converter", "baseline", quiet=True).peak
        for _ in range(args.repeat):  # alternated, so that load from other processes falls on both alike
            os.sync()
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
            cp_times.append(time.perf_counter() - start)
            cp_cpu.append(cpu_seconds(before, resource.getrusage(resource.RUSAGE_CHILDREN)))
            shutil.rmtree(copy)
            converted = cli("convert", "convert", str(src), "--to", "neutral", "-o", str(out), quiet=True)
            if converted.exit:
                raise SystemExit(f"parity convert exited {converted.exit}")
            shutil.rmtree(out)
            convert_times.append(converted.wall)
            convert_cpu.append(converted.cpu)
            peak = max(peak, converted.peak)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    cp_time, convert_time = statistics.median(cp_times), statistics.median(convert_times)
    cp_c, convert_c = statistics.median(cp_cpu), statistics.median(convert_cpu)
    print(f"checkpoint {size / 2**30:.2f} GiB ({size / 1e9:.2f} GB) {args.dtype}, {args.shape} shape, "
          f"{config['num_hidden_layers']} layers, in {len(files)} file(s), largest tensor {largest / 2**20:.0f} MiB")
    print(f"{os.cpu_count()} cores; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"convert time / cp time          {convert_time / cp_time:.2f}   ({convert_time:.1f} s / {cp_time:.1f} s, "
          f"medians of {args.repeat}; each: {' '.join(f'{c:.1f}/{p:.1f}' for c, p in zip(convert_times, cp_times))})")
    print(f"convert CPU / cp CPU            {convert_c / cp_c:.2f}   ({convert_c:.1f} s / {cp_c:.1f} s)")
    print(f"peak RSS / largest tensor       {peak / largest:.2f}   ({peak / 2**20:.0f} MiB)")
    print(f"(peak RSS - baseline) / largest {(peak - baseline) / largest:.2f}   (baseline {baseline / 2**20:.0f} MiB)")
    print(f"peak RSS / checkpoint size      {peak / size:.2f}")


if __name__ == "__main__":
    main()
