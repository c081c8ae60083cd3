"""How far ONNX Runtime strays from transformers: the figures docs/onnx.md quotes.

    python bench/onnx_parity.py [--families F,G] [--no-genai]

For every family's tiny checkpoint it exports parity's executor (`parity convert --to onnx
--debug-outputs`) in float32 and in float16, checks each layer by layer against transformers, and
prints the worst capture point: in float32 its rel_l2, in float16 its rel_l2 as a multiple of the
reference's own float16 noise (`--calibrate`). With onnxruntime-genai installed it also builds the
tiny Llama with onnxruntime-genai's model builder and prints how many capture points were found in
that graph. The tests assert bounds on the same numbers (tests/test_onnx.py); this prints them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import parity
from parity.adapter import load_all
from parity.engines.onnx.export import export
from parity.reference.tiny import make_tiny


def worst(report, key) -> tuple[float, str]:
    return max((key(p), p.name) for p in report.points if p.compared)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=None, help="comma-separated (default: all)")
    ap.add_argument("--no-genai", action="store_true", help="skip the onnxruntime-genai build")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    adapters = load_all()
    families = args.families.split(",") if args.families else list(adapters)
    with tempfile.TemporaryDirectory(prefix="parity-bench-onnx-") as tmp:
        root = Path(tmp)
        print(f"{'family':12} {'float32 worst rel_l2':28} {'float16 worst rel_l2 / noise':34}")
        rows = []
        for family in families:
            src = make_tiny(adapters[family], root / family)
            row = [family]
            for dtype in ("float32", "float16"):
                out = root / f"{family}-{dtype}.onnx"
                export(src, out, dtype=dtype, debug_outputs=True)
                report = parity.check(src, out, layerwise=True, dtype=dtype, calibrate=dtype == "float16")
                assert report.verdict == "pass", (family, dtype, report.first_divergence)
                row += worst(report, (lambda p: p.rel_l2) if dtype == "float32" else (lambda p: p.noise_ratio))
            rows.append(row)
            _, f32, f32_at, f16, f16_at = row
            print(f"{family:12} {f'{f32:.1e} ({f32_at})':28} {f'{f16:.2f}x ({f16_at})':34}", flush=True)
        w32, w16 = max(rows, key=lambda r: r[1]), max(rows, key=lambda r: r[3])
        print(f"worst: float32 rel_l2 {w32[1]:.1e} ({w32[0]}); float16 rel_l2 / noise {w16[3]:.2f}x ({w16[0]})")
        if not args.no_genai and importlib.util.find_spec("onnxruntime_genai"):
            src, out = root / "llama", root / "genai"
            if not src.exists():
                src = make_tiny(adapters["llama"], src)
            subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", "tiny-llama", "-i",
                            str(src), "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(root / "cache")],
                           check=True, capture_output=True)
            report = parity.check(src, out, layerwise=True)
            missing = [p.name for p in report.points if not p.compared]
            print(f"onnxruntime-genai tiny llama: {len(report.points) - len(missing)} of {len(report.points)} "
                  f"capture points found (not found: {', '.join(missing) or 'none'}); verdict {report.verdict}")


if __name__ == "__main__":
    main()
