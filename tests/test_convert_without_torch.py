"""`parity convert --to neutral` imports torch only when a tensor must be transformed: for a checkpoint whose
tensors are all written as stored, importing torch (and tearing it down at exit) took longer than hashing 5 GB
(bench/convert.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parity.neutral.manifest import load

ROOT = Path(__file__).resolve().parent.parent
CONVERT = """
import sys
from parity.cli import cli
try:
    cli(["convert", sys.argv[1], "--to", "neutral", "-o", sys.argv[2], *sys.argv[3:]], prog_name="parity",
        standalone_mode=False)
finally:
    print("torch imported" if "torch" in sys.modules else "no torch")
"""


@pytest.mark.parametrize("family,options,imported", [
    ("llama", [], False),                     # every tensor as stored
    ("llama", ["--dtype", "bfloat16"], True),  # cast
    ("llama", ["--rope-style", "interleaved"], True),  # q/k rows permuted
    ("gpt2", [], True),                       # Conv1D transposed, c_attn split
])
def test_torch_is_imported_only_to_transform_a_tensor(family, options, imported, tiny_dir, tmp_path):
    done = subprocess.run([sys.executable, "-c", CONVERT, str(tiny_dir(family)), str(tmp_path / "out"), *options],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == ("torch imported" if imported else "no torch")
    load(tmp_path / "out", verify=True)  # hashes recorded as they were written
