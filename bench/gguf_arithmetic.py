"""How much closer to llama.cpp the emulating same-weights reference is than the plain one: the figures
of docs/gguf.md, printed as tables (rel_l2 against each reference, KL, top-1, wall time and peak RSS of each check).

    python bench/gguf_arithmetic.py real [--dir DIR]     the real Qwen2.5-Coder-0.5B Q4_K_M file
                                                         (../shared/models/qwen2.5-coder-0.5b.sh), free and
                                                         isolated, on the default prompt and the real text
    python bench/gguf_arithmetic.py tiny [--dir DIR]     tiny files of every exportable family in F16, Q8_0,
                                                         Q4_0, Q4_1 (and Q4_K_M on 256-column rows), free and
                                                         isolated: the worst point's ratio per type

Each check is `parity check --reference HF --candidate FILE --same-weights --layerwise --calibrate [--isolate]`
run in a child process (peak RSS from its rusage); the JSON reports stay in --dir.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARITY = [sys.executable, "-c", "from parity.cli import main; main()"]
ABOVE = 1e-5  # points where the references differ by more than float32 noise
POINTS = ["layers.0.attn_in", "layers.0.attn_out", "layers.0.mid", "layers.0.out", "layers.3.out", "layers.11.out",
          "layers.23.out", "logits"]


def check(reference: Path, candidate: Path, report: Path, *extra: str) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([*PARITY, "check", "--reference", str(reference), "--candidate", str(candidate),
                                  "--same-weights", "--layerwise", "--calibrate", "--report", str(report), *extra],
                                 stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS, not the largest one so far
        child.returncode = code = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        err.seek(0)
        if code not in (0, 1):
            raise SystemExit(f"parity check exited {code}: {err.read().strip()[-500:]}")
    rss = usage.ru_maxrss / 2**20  # KiB -> GiB
    data = json.loads(report.read_text())
    apart = [p for p in data["points"] if p["compared"] and p.get("rel_l2_plain", 0) > ABOVE]
    worst = min(apart, key=lambda p: p["rel_l2_plain"] / max(p["rel_l2"], 1e-30))
    return {"exit": code, "wall_s": wall, "peak_rss_gib": rss, "report": data,
            "worst": (worst["name"], worst["rel_l2_plain"] / max(worst["rel_l2"], 1e-30))}


def real(out: Path) -> None:
    from tests.test_real_gguf import REAL, TEXT

    if not (REAL / "model.gguf").is_file():
        raise SystemExit(f"no real model at {REAL}: run ../shared/models/qwen2.5-coder-0.5b.sh")
    for mode in ([], ["--isolate"]):
        runs = {name: check(REAL / "hf", REAL / "model.gguf", out / f"real-{name}{'-iso' if mode else ''}.json",
                            *prompt, *mode)
                for name, prompt in (("default prompt", []), ("real text", ["--prompt", TEXT]))}
        print(f"\n{'isolated' if mode else 'free run'}: rel_l2 against the plain | emulating reference")
        print("| point | " + " | ".join(f"{n}: vs plain | vs emulating" for n in runs) + " |")
        for name in POINTS:
            cells = []
            for r in runs.values():
                p = next(p for p in r["report"]["points"] if p["name"] == name)
                cells += [f"{p.get('rel_l2_plain', p['rel_l2']):.2e}", f"{p['rel_l2']:.2e}"]
            print(f"| {name} | " + " | ".join(cells) + " |")
        for key, label, fmt in (("kl_mean", "logits kl_mean", ".2e"), ("top1_agreement", "top-1", ".3f")):
            cells = []
            for r in runs.values():
                logits = r["report"]["logits"]
                cells += [format(logits["against_plain"][key], fmt), format(logits[key], fmt)]
            print(f"| {label} | " + " | ".join(cells) + " |")
        for name, r in runs.items():
            compared = sum(p["compared"] for p in r["report"]["points"])
            print(f"{name}: exit {r['exit']}, {compared} points, worst point {r['worst'][1]:.1f}x closer "
                  f"({r['worst'][0]}), {r['wall_s']:.0f} s, peak RSS {r['peak_rss_gib']:.2f} GiB")


def tiny(out: Path) -> None:
    from parity.reference.tiny import build_model
    from tests.conftest import ADAPTERS
    from tests.test_gguf import GGUF_FAMILIES, RELEASED
    from tests.test_gguf_quantize import WIDE

    rows: dict[tuple[str, str], list] = {}
    for family in GGUF_FAMILIES:
        for source in (family, "wide-" + family):
            overrides = dict(RELEASED[family])
            if source.startswith("wide"):
                overrides.update(WIDE, **({"query_pre_attn_scalar": 64} if "query_pre_attn_scalar" in overrides
                                          else {}))
            build_model(ADAPTERS[family], overrides=overrides).save_pretrained(out / source)
        for source, kind in [(family, "F16"), (family, "Q8_0"), (family, "Q4_0"), (family, "Q4_1"),
                             ("wide-" + family, "Q4_K_M")]:
            gguf = out / f"{source}-{kind}.gguf"
            subprocess.run([*PARITY, "convert", str(out / source), "--to", "gguf", "-o",
                            str(gguf), "--gguf-type", kind], check=True, capture_output=True)
            for mode in ("isolated", "free"):
                r = check(out / source, gguf, out / "r.json", *(["--isolate"] if mode == "isolated" else []))
                rows.setdefault((kind, mode), []).append((family, r))
                print(f"{family} {kind} {mode}: exit {r['exit']}, worst {r['worst'][1]:.1f}x ({r['worst'][0]}), "
                      f"KL {r['report']['logits']['kl_mean']:.1e}", flush=True)
    print("\n| type | isolated: worst point | free run: worst point |")
    for kind in ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M"):
        cells = []
        for mode in ("isolated", "free"):
            family, r = min(rows[(kind, mode)], key=lambda fr: fr[1]["worst"][1])
            cells.append(f"{r['worst'][1]:.1f}x ({family} {r['worst'][0]})")
        print(f"| {kind} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=["real", "tiny"])
    parser.add_argument("--dir", type=Path, default=None, help="where the reports (and tiny files) go")
    args = parser.parse_args()
    out = args.dir or Path(tempfile.mkdtemp(prefix="parity-bench-gguf-"))
    out.mkdir(parents=True, exist_ok=True)
    (real if args.which == "real" else tiny)(out)
    print(f"\nreports in {out}")


if __name__ == "__main__":
    main()
