"""What the default for a quantized file costs (docs/quantized.md): the check with no flag (the port judged at its
own weights, plus the float comparison that measures the quantization's cost) against `--same-weights --calibrate`
alone, on the real Qwen2.5-Coder-0.5B Q4_K_M file (../shared/models/qwen2.5-coder-0.5b.sh).

    python bench/quantized.py [--rounds N] [--dir DIR]

Each check runs in a child process (bench/harness.py), alternated, the median of N rounds; printed: wall time of each, their ratio,
peak RSS of each and its ratio to the float32 checkpoint, and the cost the default reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from harness import cli

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.test_real_gguf: where the real model is


def main() -> None:
    from tests.test_real_gguf import REAL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    a = parser.parse_args()
    if not (REAL / "model.gguf").is_file() or not (REAL / "hf" / "config.json").is_file():
        raise SystemExit(f"no real model at {REAL}: run ../shared/models/qwen2.5-coder-0.5b.sh")
    out = a.dir or Path(tempfile.mkdtemp(prefix="parity-bench-quantized-"))
    base = ["check", "--reference", str(REAL / "hf"), "--candidate", str(REAL / "model.gguf"), "--layerwise"]
    modes = {"no flag": [], "--same-weights --calibrate": ["--same-weights", "--calibrate"]}
    got: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for k in range(a.rounds):
        for mode, extra in modes.items():
            done = cli(mode, *base, *extra, "--report", str(out / f"{len(extra)}-{k}.json"))
            if done.exit != 0:
                raise SystemExit(f"{mode}: exit {done.exit} (a correct file must pass)")
            got[mode].append((done.wall, done.peak / 2**30))
    size = sum(f.stat().st_size for f in (REAL / "hf").glob("*.safetensors")) / 2**30
    wall = {m: statistics.median(w for w, _ in v) for m, v in got.items()}
    rss = {m: max(r for _, r in v) for m, v in got.items()}
    for m in modes:
        print(f"{m:28s} wall {wall[m]:6.1f} s   peak RSS {rss[m]:.2f} GiB ({rss[m] / size:.2f}x the {size:.2f} GiB "
              f"checkpoint)")
    print(f"no flag / --same-weights --calibrate: wall {wall['no flag'] / wall['--same-weights --calibrate']:.2f}x, "
          f"peak RSS {rss['no flag'] / rss['--same-weights --calibrate']:.2f}x ({a.rounds} rounds, alternated)")
    cost = json.loads((out / f"0-{a.rounds - 1}.json").read_text())["quantization"]["cost"]
    print("cost the default reports: " + ", ".join(f"{k} {cost[k]:.3g}" for k in
                                                    ("kl_mean", "kl_max", "top1_agreement", "top5_overlap")))


if __name__ == "__main__":
    main()
