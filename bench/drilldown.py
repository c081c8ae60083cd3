"""Benchmark the drill-down (docs/ops.md) and `--points ops`; prints ratios, not times.

    python bench/drilldown.py [--layers 16] [--hidden 1024] [--length 128] [--broken 15]

It writes a Llama-shaped float32 checkpoint (seeded random weights; hidden 1024, 16 heads, 4 KV heads, head_dim
64, intermediate 2816, vocabulary 32,000, 16 layers: about 1 GB) and a copy with one KV head's k-projection rows
of layer --broken scaled by 1.1, converted to the neutral layout too. In child processes (each one's wall time
and own peak RSS measured) it runs:

  a plain transformers forward and a plain executor forward of the prompt (the yardstick: one forward each side)
  parity check --layerwise of the broken copy (transformers candidate, then neutral): the check times its own
      phases from its progress messages, so the drill-down's share is measured inside the same run
  parity check --layerwise and --points ops of the unbroken neutral conversion (every op captured)

and prints:

  drill-down / one forward of each side     what re-running the failing layer at op granularity costs, against
                                            one plain forward of the reference plus one of the candidate
  drill-down / the layers it must run       ... against the layers it must run: transformers runs the layers
                                            before the failing one to reach it (it cannot start mid-model), the
                                            executor only the failing one, fed the reference's input
  --points ops / --layerwise (time, RSS)    what capturing every op of every layer costs on a whole model
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from harness import cli, llama_config, make_checkpoint, run

CHILD = """
import json, sys, time
from pathlib import Path
from parity.checker.run import check
marks = []
start = time.perf_counter()
report = check(Path(sys.argv[1]), Path(sys.argv[2]), layerwise=True, length=int(sys.argv[3]),
               progress=lambda m: marks.append((time.perf_counter() - start, m)))
end = time.perf_counter() - start
drill = next((t for t, m in marks if m.startswith("drilling down")), None)
after = next((t for t, m in marks if drill is not None and t > drill and m == "diagnosing"), end)
print(json.dumps({"total": end, "drill": None if drill is None else after - drill, "verdict": report.verdict,
                  "op": report.to_json()["first_divergence"].get("op") if report.first_divergence else None}))
"""

FORWARD = """
import sys, time, torch
from pathlib import Path
from parity.checker.run import plain_forward
ids = torch.randint(0, 32000, (1, int(sys.argv[2])), generator=torch.Generator().manual_seed(0))
plain_forward(Path(sys.argv[1]), ids, stream=False)  # warm: the first forward pays for allocations
start = time.perf_counter()
plain_forward(Path(sys.argv[1]), ids, stream=False)
print('seconds', time.perf_counter() - start)
"""


def _break(src: Path, out: Path, layer: int, head_dim: int) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        name = f"model.layers.{layer}.self_attn.k_proj.weight"
        if name in tensors:
            tensors[name][head_dim:2 * head_dim] *= 1.1
            save_file(tensors, f, metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--length", type=int, default=128, help="prompt tokens")
    ap.add_argument("--broken", type=int, default=None, help="the layer broken (default: the last)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/parity-bench-drilldown"))
    args = ap.parse_args()
    broken = args.layers - 1 if args.broken is None else args.broken
    shutil.rmtree(args.dir, ignore_errors=True)
    ref, bad, bad_n, good_n = (args.dir / n for n in ("reference", "broken", "broken.neutral", "reference.neutral"))
    heads, head_dim = args.hidden // 64, 64
    shape = {"hidden_size": args.hidden, "intermediate_size": int(args.hidden * 2.75), "num_hidden_layers": args.layers,
             "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "head_dim": head_dim,
             "vocab_size": 32000, "tie_word_embeddings": False}
    size, _ = make_checkpoint(ref, llama_config(shape, torch.float32), torch.float32)
    _break(ref, bad, broken, head_dim)
    for src, out in ((bad, bad_n), (ref, good_n)):
        if cli("convert", "convert", str(src), "--to", "neutral", "-o", str(out), quiet=True).exit:
            raise SystemExit("parity convert failed")
    try:
        forward_hf = run(FORWARD, "plain transformers forward", str(ref), str(args.length))
        forward_ex = run(FORWARD, "plain executor forward", str(good_n), str(args.length))
        hf_layer, ex_layer = forward_hf.seconds / args.layers, forward_ex.seconds / args.layers
        print(f"checkpoint {size / 2**30:.2f} GiB float32, {args.layers} layers, hidden {args.hidden}; prompt "
              f"{args.length} tokens; layer {broken} broken (one KV head's k rows x 1.1)")
        print(f"  one forward: transformers {forward_hf.seconds:.2f} s, executor {forward_ex.seconds:.2f} s")
        # the layers the drill-down must run: the reference (transformers) up to the broken one; the candidate
        # the same (transformers has no entry mid-model), or the broken one alone (the executor, fed)
        for candidate, label, must in ((bad, "transformers", (broken + 1) * 2 * hf_layer),
                                       (bad_n, "neutral", (broken + 1) * hf_layer + ex_layer)):
            done = run(CHILD, f"check --layerwise, {label} candidate", str(ref), str(candidate), str(args.length))
            out = done.json
            print(f"  {label}: verdict {out['verdict']}, first op {out['op']}; check {out['total']:.1f} s, "
                  f"drill-down {out['drill']:.1f} s")
            each = forward_hf.seconds + (forward_hf.seconds if label == "transformers" else forward_ex.seconds)
            print(f"  drill-down / one forward of each side ({label})    {out['drill'] / each:.2f}")
            print(f"  drill-down / the layers it must run ({label})      {out['drill'] / must:.2f}")
        layerwise = cli("check --layerwise", "check", "--reference", str(ref), "--candidate", str(good_n),
                        "--layerwise", "--length", str(args.length))
        ops = cli("check --points ops", "check", "--reference", str(ref), "--candidate", str(good_n),
                  "--points", "ops", "--length", str(args.length))
        print(f"  --points ops / --layerwise: time {ops.wall / layerwise.wall:.2f}, peak RSS "
              f"{ops.peak / layerwise.peak:.2f} (exits {ops.exit}, {layerwise.exit})")
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
