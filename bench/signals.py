"""Benchmark SIGTERM / SIGINT at every moment of `parity convert` of a real checkpoint, beside a busy process.

    python bench/signals.py CHECKPOINT [--signal TERM|INT] [--delays 0.1,0.3,...] [--out DIR]

CHECKPOINT: a Hugging Face directory (../shared/models/qwen2.5-coder-0.5b.sh fetches a 2.4 GB one). The plain
conversion runs once to time it; then, for each delay (by default 0.1 s to past the end), a conversion is started
with a second process spinning on one core, the signal sent at the delay, and printed: the exit code (143 for
SIGTERM, 130 for SIGINT; 0 where the conversion had ended before the signal), seconds from the signal to the exit,
what is at the output path (nothing, or the whole output), and any temporary left beside it. Ends with the counts,
and exit 1 if any run broke the contract: another exit code, a signal taking longer than GRACE + 5 s, a part of
an output, or a temporary left behind.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def convert(source: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "parity", "convert", str(source), "--to", "neutral", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--signal", choices=("TERM", "INT"), default="TERM")
    ap.add_argument("--delays", help="comma-separated seconds (default: 0.1 s to past the end)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/parity-bench-signals"))
    args = ap.parse_args()
    number = signal.SIGTERM if args.signal == "TERM" else signal.SIGINT
    from parity.signals import GRACE

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    started = time.monotonic()
    plain = convert(args.checkpoint, args.out / "plain")
    plain.wait()
    whole = time.monotonic() - started
    assert plain.returncode == 0, plain.stderr.read()
    print(f"plain conversion: {whole:.1f} s")
    delays = ([float(d) for d in args.delays.split(",")] if args.delays else
              [0.1, 0.3, 0.5, 0.8, 1.2, 2.0, *(round(whole * f, 1) for f in (0.25, 0.5, 0.75, 0.95)), whole + 2])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    broken = stopped = 0
    try:
        for delay in delays:
            out = args.out / f"out-{delay}"
            proc = convert(args.checkpoint, out)
            time.sleep(delay)
            ended = proc.poll() is not None
            sent = time.monotonic()
            if not ended:
                proc.send_signal(number)
            _, err = proc.communicate(timeout=600)
            took = time.monotonic() - sent
            left = sorted(p.name for p in args.out.iterdir() if p.name.startswith(f".out-{delay}"))
            there = "whole" if (out / "manifest.json").is_file() else ("part" if out.exists() else "nothing")
            good = (proc.returncode == 0 and there == "whole") if ended else (
                proc.returncode in (128 + number, -number) and took < GRACE + 5 and there != "part")
            good = good and not left
            stopped += not ended
            broken += not good
            print(f"delay {delay:6.2f} s: exit {proc.returncode:4d}"
                  f"{'' if ended else f', {took:5.2f} s after the signal'}; output: {there}"
                  f"{'; left: ' + ', '.join(left) if left else ''}{'' if good else '  <-- BROKEN'}")
            shutil.rmtree(out, ignore_errors=True)
    finally:
        spinner.kill()
        spinner.wait()
    print(f"{stopped} of {len(delays)} runs stopped by SIG{args.signal}, {broken} broke the contract")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
