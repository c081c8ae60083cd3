"""The engine x family matrix of docs/engines.md: every engine kind against transformers, on every family's tiny
checkpoint (`parity make-tiny`, transformers' own classes) and on the real Qwen2.5-Coder-0.5B when present.

    python bench/engines.py [--engines sdpa,mlx,ctranslate2,openvino] [--families llama,gemma2,...]
                            [--decode 8] [--real DIR] [--dir DIR] [--json out.json]

Each cell is one `parity check --reference CKPT --candidate KIND:CKPT --layerwise [--decode N] --report r.json`
(the --candidate its engine's kind names as MATRIX, e.g. `mlx:{checkpoint}`; transformers' sdpa kernel: `--candidate
CKPT --candidate-attn sdpa`) in a child process, in float32, the engine at its own float32 where it offers one. A
cell gives the verdict (exit 0 pass, 1 fail, 2 no verdict with its reason), the first diverging point and the
diagnosis, the worst rel_l2 over the compared points, the logits' KL mean and top-1 agreement, and the child's wall
time and peak RSS. Markdown on stdout.
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
from typing import Callable

PARITY = [sys.executable, "-c", "from parity.cli import main; main()"]
TRANSFORMERS = {"sdpa": lambda ckpt: [str(ckpt), "--candidate-attn", "sdpa"]}
SEED = ["bert", "gpt2", "llama", "mistral", "qwen2", "qwen3", "deepseek_v3", "olmo2", "gemma", "gemma2", "gemma3",
        "gemma4", "mixtral", "qwen3_moe"]


def engines() -> dict[str, Callable[[Path], list[str]]]:
    """transformers' sdpa kernel, then every candidate kind that names its cell of the matrix (its MATRIX: the
    --candidate of a checkpoint), in parity's order of kinds: an engine's folder adds its own row."""
    import importlib

    from parity.candidates import ENGINES, KINDS

    found = dict(TRANSFORMERS)
    for kind in map(importlib.import_module, KINDS + ENGINES):
        if hasattr(kind, "MATRIX"):
            found[kind.KIND] = lambda ckpt, spec=kind.MATRIX: [spec.format(checkpoint=ckpt)]
    return found


def families() -> list[str]:
    """Every built-in family: the seed ones in the order the docs show them, then the others by name."""
    from parity.adapter import load_all

    return SEED + sorted(set(load_all()) - set(SEED))
REAL = Path(os.environ.get("PARITY_REAL_QWEN", Path.home() / ".cache/parity-real/qwen2.5-coder-0.5b")) / "hf"


def run(*args: str) -> tuple[int, str, float, float]:
    """Exit code, the last stderr line, wall seconds and peak RSS (GiB) of one parity command."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([*PARITY, *args], stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = code = os.waitstatus_to_exitcode(status)
        err.seek(0)
        lines = [line for line in err.read().splitlines() if line.startswith("parity: error")]
    return code, (lines[-1] if lines else ""), time.perf_counter() - start, usage.ru_maxrss / 2**20


def cell(candidate: list[str], ckpt: Path, report: Path, decode: int) -> dict:
    code, error, wall, rss = run("check", "--reference", str(ckpt), "--candidate", *candidate,
                                 "--layerwise", "--report", str(report), *(["--decode", str(decode)] if decode else []))
    out = {"exit": code, "wall_s": round(wall, 1), "peak_rss_gib": round(rss, 2)}
    if code == 2 or not report.is_file():
        return {**out, "verdict": "no verdict", "reason": error.removeprefix("parity: error: ")[:160]}
    data = json.loads(report.read_text())
    report.unlink()
    compared = [p for p in data["points"] if p["compared"]]
    first = data.get("first_divergence") or {}
    diagnosis = (data.get("diagnosis") or [{}])[0].get("bug")
    logits = data.get("logits") or {}
    return {**out, "verdict": data["verdict"], "first": first.get("point"), "diagnosis": diagnosis,
            "compared": len(compared), "of": len(data["points"]),
            "worst": max((p["rel_l2"] for p in compared), default=None),
            "kl": logits.get("kl_mean"), "top1": logits.get("top1_agreement"), "decoded": data.get("decode") is not None}


def row(engine: str, family: str, c: dict) -> str:
    if c["verdict"] == "no verdict":
        return f"| {engine} | {family} | no verdict | {c['reason']} | | | | |"
    first = f"{c['first']}" + (f" ({c['diagnosis']})" if c.get("diagnosis") else "") if c["first"] else "-"
    fmt = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
    return (f"| {engine} | {family} | {c['verdict']} | {first} | {c['compared']}/{c['of']} | {fmt(c['worst'], '.1e')} "
            f"| {fmt(c['kl'], '.1e')} | {fmt(c['top1'], '.3g')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=None, help="comma-separated (default: sdpa and every engine kind with "
                                                         "a MATRIX entry)")
    parser.add_argument("--families", default=None, help="comma-separated (default: every built-in family)")
    parser.add_argument("--decode", type=int, default=0, help="also check N decode steps (causal families)")
    parser.add_argument("--real", type=Path, default=REAL if (REAL / "config.json").is_file() else None,
                        help="a real Hugging Face checkpoint to add as a row per engine (default: Qwen2.5-Coder "
                             "when ../shared/models/qwen2.5-coder-0.5b.sh has fetched it)")
    parser.add_argument("--dir", type=Path, default=None, help="where the tiny checkpoints go")
    parser.add_argument("--json", type=Path, default=None, help="also write every cell as JSON")
    args = parser.parse_args()
    specs = engines()
    work = args.dir or Path(tempfile.mkdtemp(prefix="parity-bench-engines-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoints = {}
    for family in (args.families.split(",") if args.families else families()):
        checkpoints[family] = work / family
        if not (work / family / "config.json").is_file():
            subprocess.run([*PARITY, "make-tiny", family, "-o", str(work / family)], check=True,
                           capture_output=True)
    if args.real is not None:
        checkpoints[f"real: {args.real.name}"] = args.real
    cells = {}
    print("| engine | family | verdict | first divergence (diagnosis) | points compared | worst rel_l2 | KL mean "
          "| top-1 |\n|---|---|---|---|---|---|---|---|", flush=True)
    for engine in args.engines.split(",") if args.engines else specs:
        for family, ckpt in checkpoints.items():
            decode = args.decode if family != "bert" else 0
            c = cells[f"{engine} {family}"] = cell(specs[engine](ckpt), ckpt, work / "r.json", decode)
            print(row(engine, family, c), flush=True)
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))
    print(f"\n{len(cells)} checks; wall {sum(c['wall_s'] for c in cells.values()):.0f} s; peak RSS up to "
          f"{max(c['peak_rss_gib'] for c in cells.values()):.2f} GiB; checkpoints in {work}")


if __name__ == "__main__":
    main()
