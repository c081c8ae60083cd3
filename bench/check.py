"""Benchmark `parity check --layerwise` at real sizes; prints ratios, not times.

    python bench/check.py [--dir /tmp/parity-bench-check] [--length 128] [--layers 32] [--skip-8b] [--skip-1b]

Two models, both Llama-shaped with seeded random bfloat16 weights, written a tensor at a time (so that making
them needs little memory):

- Llama-3.1-8B-shaped (32 layers, vocabulary 128,256, about 16 GB): too big for this machine's memory as a
  float32 reference (32 GB), so the check streams its weights a layer at a time. It is converted with
  `parity convert` (against `cp -r` of the same files) and checked `--layerwise`; printed: peak RSS / checkpoint
  size, and check time / (one streamed transformers forward + one streamed executor forward); then it is
  exported with `parity convert --to onnx --dtype float16` (weights streamed into external data).
- Llama-3.2-1B-shaped (16 layers, about 2.5 GB), which fits: check time / (plain transformers forward + plain
  executor forward), once `--stream` and once `--no-stream`.

Every measured command runs in its own child process: wall time is the child's, peak RSS its own (wait4).
The forwards are `parity.runner.plain_forward`: load the model, run the prompt, no capture, no comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False}
LLAMA_32_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True}


def llama_config(shape: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001,
            "torch_dtype": "bfloat16"}


def make_checkpoint(directory: Path, config: dict, seed: int = 0) -> int:
    """Write seeded random bfloat16 weights in 5 GB shards (with an index when there are several), a tensor at a
    time, each generated in row blocks; returns the bytes written."""
    import torch

    from parity.shards import PlannedTensor, ShardWriter, plan

    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    planned = [PlannedTensor(name, shape, torch.bfloat16) for name, shape in shapes.items()]
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shards = plan(planned, directory, max_shard_bytes=5 * 10**9)
    gen = torch.Generator().manual_seed(seed)
    for shard in shards:
        writer = ShardWriter(shard)
        for t in shard.tensors:
            x = torch.empty(t.shape, dtype=torch.bfloat16)
            for a in range(0, t.shape[0], 4096):  # float32 randoms a block of rows at a time
                block = torch.randn((min(4096, t.shape[0] - a), *t.shape[1:]), generator=gen)
                x[a:a + block.shape[0]] = block.mul_(0.05).add_(1.0) if len(t.shape) == 1 else block.mul_(0.02)
            writer.write(t.name, x)
        writer.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in planned)},
                 "weight_map": {t.name: s.path.name for s in shards for t in s.tensors}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sum(t.nbytes for t in planned)


def measure(args: list[str], what: str) -> dict:
    """Run a child; its wall time, its own peak RSS (bytes), exit code, and the seconds it reports on stdout."""
    start = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.PIPE, cwd=ROOT)
    out = child.stdout.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    result = {"what": what, "wall": wall, "rss": usage.ru_maxrss * 1024, "exit": child.returncode}
    for line in out.splitlines():
        if line.startswith("seconds "):
            result["seconds"] = float(line.split()[1])
    print(f"  {what}: {wall:.1f} s, peak RSS {result['rss'] / 2**30:.2f} GiB, exit {child.returncode}", flush=True)
    return result


def forward(path: Path, length: int, stream: bool) -> dict:
    """One plain forward in a child: the seconds from the first byte read to the logits (imports excluded)."""
    code = ("import sys, time, torch; from pathlib import Path; from parity.runner import plain_forward; "
            "t = time.perf_counter(); "
            f"plain_forward(Path({str(path)!r}), torch.arange(3, {length + 3})[None], stream={stream}); "
            "print('seconds', time.perf_counter() - t)")
    return measure([sys.executable, "-c", code], f"forward {path.name} ({'streamed' if stream else 'whole'})")


def check(reference: Path, candidate: Path, length: int, *flags: str) -> dict:
    """`parity check --layerwise` in a child, timed from after its imports (the forwards' yardstick excludes them
    too); the verdict must be a pass."""
    args = ["check", "--reference", str(reference), "--candidate", str(candidate), "--layerwise", "--length", str(length),
            *flags]
    code = ("import sys, time; from parity.cli import cli; t = time.perf_counter()\n"
            "try:\n"
            f"    cli.main({args!r}, standalone_mode=False)\n"
            "finally:\n"
            "    print('seconds', time.perf_counter() - t)")
    result = measure([sys.executable, "-c", code], f"parity check --layerwise {' '.join(flags)}".strip())
    if result["exit"] != 0:
        raise SystemExit(f"the check did not pass (exit {result['exit']})")
    return result


def convert(source: Path, out: Path) -> dict:
    return measure([sys.executable, "-m", "parity.cli", "convert", str(source), "--to", "neutral", "-o", str(out)],
                   "parity convert --to neutral")


def copy(source: Path, out: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


def size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def big(root: Path, length: int, layers: int) -> None:
    ckpt, neutral = root / "llama-8b", root / "llama-8b.neutral"
    start = time.perf_counter()
    make_checkpoint(ckpt, llama_config({**LLAMA_31_8B, "num_hidden_layers": layers}))
    nbytes = size(ckpt)
    print(f"Llama-3.1-8B-shaped, {layers} layers, bfloat16: {nbytes / 1e9:.2f} GB written in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    subprocess.run(["sync"], check=True)
    cp = copy(ckpt, root / "copy")
    print(f"  cp -r: {cp:.1f} s", flush=True)
    shutil.rmtree(root / "copy")
    conv = convert(ckpt, neutral)
    ref, cand = forward(ckpt, length, True), forward(neutral, length, True)
    run = check(ckpt, neutral, length)
    print(f"  convert time / cp time:                 {conv['wall'] / cp:.2f}")
    print(f"  convert peak RSS / checkpoint size:     {conv['rss'] / nbytes:.3f}")
    print(f"  check peak RSS:                         {run['rss'] / 2**30:.2f} GiB")
    print(f"  check peak RSS / checkpoint size:       {run['rss'] / nbytes:.3f}")
    print(f"  check time / (streamed transformers forward + streamed executor forward): "
          f"{run['seconds'] / (ref['seconds'] + cand['seconds']):.2f}", flush=True)
    shutil.rmtree(neutral)
    onnx = measure([sys.executable, "-m", "parity.cli", "convert", str(ckpt), "--to", "onnx", "--dtype", "float16",
                    "-o", str(root / "llama-8b.onnx")], "parity convert --to onnx --dtype float16")
    if onnx["exit"] != 0:
        raise SystemExit(f"the ONNX export failed (exit {onnx['exit']})")
    print(f"  ONNX export peak RSS / checkpoint size: {onnx['rss'] / nbytes:.3f}   "
          f"({(root / 'llama-8b.onnx.data').stat().st_size / 1e9:.2f} GB of external data)", flush=True)


def fits(root: Path, length: int) -> None:
    ckpt, neutral = root / "llama-1b", root / "llama-1b.neutral"
    make_checkpoint(ckpt, llama_config(LLAMA_32_1B))
    nbytes = size(ckpt)
    print(f"Llama-3.2-1B-shaped, bfloat16: {nbytes / 1e9:.2f} GB", flush=True)
    convert(ckpt, neutral)
    plain = forward(ckpt, length, False)["seconds"] + forward(neutral, length, False)["seconds"]
    streamed = forward(ckpt, length, True)["seconds"] + forward(neutral, length, True)["seconds"]
    for flag in ("--stream", "--no-stream"):
        run = check(ckpt, neutral, length, flag)
        print(f"  check {flag} time / (plain transformers forward + plain executor forward): "
              f"{run['seconds'] / plain:.2f}   (peak RSS / checkpoint size {run['rss'] / nbytes:.2f})")
    print(f"  (streamed forwards / plain forwards: {streamed / plain:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/parity-bench-check"))
    parser.add_argument("--length", type=int, default=128, help="prompt tokens")
    parser.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model (32 is the real one)")
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args()
    if args.dir.exists():
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    print(f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB "
          f"memory; prompt of {args.length} tokens; float32 reference and candidate", flush=True)
    try:
        if not args.skip_1b:
            fits(args.dir, args.length)
        if not args.skip_8b:
            big(args.dir, args.length, args.layers)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
