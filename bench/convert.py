"""Benchmark `parity convert --to neutral` on a checkpoint of at least 1 GB; prints ratios, not times.

    python bench/convert.py [--gb 1.3] [--dir /tmp/parity-bench] [--keep]

It writes a Llama-shaped float32 checkpoint (random weights, streamed to disk so that making it
needs little memory), copies it with `cp -r` (the floor for any converter that reads and writes
every byte), converts it in a child process, and prints:

  convert time / cp time        how much slower than copying the same bytes the converter is
  peak RSS / largest tensor     how much memory conversion needs relative to the one tensor it must
                                hold; also with the child's baseline (python + torch imported) removed
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from parity.shards import PlannedTensor, ShardWriter, plan


def llama_config(target_gb: float) -> dict:
    hidden, inter, vocab = 2048, 5632, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((target_gb * 2**30 / 4 - fixed) / per_layer))
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": vocab, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "torch_dtype": "float32"}


def make_checkpoint(directory: Path, config: dict) -> int:
    """Stream random float32 tensors into model.safetensors; returns the largest tensor's bytes."""
    h, f, v, n = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        for m in ("q", "k", "v", "o"):
            shapes[p + f"self_attn.{m}_proj.weight"] = (h, h)
        shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    planned = [PlannedTensor(name, shape, torch.float32) for name, shape in shapes.items()]
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (shard,) = plan(planned, directory, max_shard_bytes=2**62)
    writer = ShardWriter(shard)
    gen = torch.Generator().manual_seed(0)
    for t in planned:
        writer.write(t.name, torch.randn(t.shape, generator=gen) * 0.02)
    writer.close()
    return max(t.nbytes for t in planned)


# The child reports its own high-water mark: VmHWM belongs to the process image after exec, while
# getrusage's maxrss would also count the pages a forked child shared with this (large) parent.
PEAK = "import atexit, runpy, sys; atexit.register(lambda: print('VmHWM', next(l.split()[1] for l in " \
       "open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr)); sys.argv = sys.argv[1:]; " \
       "runpy.run_module(sys.argv[0], run_name='__main__')"


def timed(module_and_args: list[str]) -> tuple[float, int]:
    """Wall time of ``python -m module args...`` in a child process, and the child's peak RSS in bytes."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, *module_and_args], check=True, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    kib = next(int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("VmHWM"))
    return elapsed, kib * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.3, help="checkpoint size to make (at least 1)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/parity-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    src, copy, out = args.dir / "src", args.dir / "copy", args.dir / "neutral"
    largest = make_checkpoint(src, llama_config(max(args.gb, 1.0)))
    size = sum(p.stat().st_size for p in src.iterdir())
    try:
        start = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
        cp_time = time.perf_counter() - start
        shutil.rmtree(copy)
        # the child's memory floor: python with parity's converter and torch imported, nothing converted
        _, baseline = timed(["parity.neutral"])
        convert_time, peak = timed(["parity.cli", "convert", str(src), "--to", "neutral", "-o", str(out)])
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(f"checkpoint {size / 2**30:.2f} GiB, largest tensor {largest / 2**20:.0f} MiB")
    print(f"convert time / cp time          {convert_time / cp_time:.2f}   ({convert_time:.1f} s / {cp_time:.1f} s)")
    print(f"peak RSS / largest tensor       {peak / largest:.2f}   ({peak / 2**20:.0f} MiB)")
    print(f"(peak RSS - baseline) / largest {(peak - baseline) / largest:.2f}   (baseline {baseline / 2**20:.0f} MiB)")
    print(f"peak RSS / checkpoint size      {peak / size:.2f}")


if __name__ == "__main__":
    main()
