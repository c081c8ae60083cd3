"""``--gguf-type Q4_K_M`` and the other types llama.cpp's own quantizer makes (``llama_model_quantize``, through
llama-cpp-python), and what a written GGUF file holds, read back from its header.

llama.cpp quantizes a file it reads: ``parity convert --to gguf`` writes the plain (F32, or F16 for a float16
checkpoint) file first, beside the output, and llama.cpp quantizes it into the output's temporary path. It runs in
a child process: its log goes to a pipe (the line that says why it failed becomes the error), Ctrl-C stops it at
once (a ctypes call cannot be interrupted; the child is killed), and a ggml abort ends the child, not parity.

llama.cpp chooses each tensor's type: the asked type for most matrices, a larger one where its mix says (Q6_K for
``output.weight``, ``attn_v``/``ffn_down`` in half the layers of a ``_M`` mix), F32 for vectors, and, where a
tensor's rows are not a multiple of the type's block (256 columns for the K-quants, 32 for the others), a fallback
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0 or IQ4_NL, F16 as the last resort). ``summary`` says
which each tensor got.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from parity.errors import ParityError

# --gguf-type -> (llama.cpp's llama_ftype, the GGML type of its matrices, before the mix and the fallbacks)
LLAMA_TYPES = {
    "Q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_0"),
    "Q4_1": ("LLAMA_FTYPE_MOSTLY_Q4_1", "Q4_1"),
    "Q5_0": ("LLAMA_FTYPE_MOSTLY_Q5_0", "Q5_0"),
    "Q5_1": ("LLAMA_FTYPE_MOSTLY_Q5_1", "Q5_1"),
    "Q2_K": ("LLAMA_FTYPE_MOSTLY_Q2_K", "Q2_K"),
    "Q3_K_M": ("LLAMA_FTYPE_MOSTLY_Q3_K_M", "Q3_K"),
    "Q4_K_S": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q4_K"),
    "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K"),
    "Q5_K_S": ("LLAMA_FTYPE_MOSTLY_Q5_K_S", "Q5_K"),
    "Q5_K_M": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q5_K"),
    "Q6_K": ("LLAMA_FTYPE_MOSTLY_Q6_K", "Q6_K"),
}
INSTALL = "pip install 'parity[llama]' (llama-cpp-python builds llama.cpp; see docs/gguf.md for the build flags)"


def ftype(qtype: str) -> int:
    """llama.cpp's llama_ftype number for ``qtype``; a one-line error without llama-cpp-python, or where the
    installed llama.cpp does not know the type."""
    if qtype not in LLAMA_TYPES:
        raise ParityError(f"--gguf-type {qtype!r}: llama.cpp's quantizer makes {', '.join(LLAMA_TYPES)}")
    try:
        import llama_cpp  # optional: llama_cpp
    except ImportError:
        raise ParityError(f"--gguf-type {qtype} is made by llama.cpp's own quantizer: {INSTALL}") from None
    number = getattr(llama_cpp, LLAMA_TYPES[qtype][0], None)
    if not isinstance(number, int):
        raise ParityError(f"--gguf-type {qtype}: the installed llama-cpp-python has no {LLAMA_TYPES[qtype][0]}; "
                          f"upgrade it ({INSTALL})")
    return number


def _said(log: str) -> str:
    """The line of llama.cpp's log that says why it failed."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for mark in ("failed to quantize:", "GGML_ASSERT", "error", "Error"):
        found = [line for line in lines if mark in line]
        if found:
            line = found[-1]
            return line.split("failed to quantize:", 1)[1].strip() if mark == "failed to quantize:" else line
    return lines[-1] if lines else "llama.cpp gave no reason"


def quantize(source: Path, out: Path, qtype: str, *, threads: int = 0) -> None:
    """Quantize the GGUF file ``source`` into ``out`` (a temporary path: the caller renames it into place) with
    llama.cpp's ``llama_model_quantize`` in a child process; ``threads`` 0 is llama.cpp's default (every core).
    Any failure, and Ctrl-C, ends the child before the error propagates."""
    number = ftype(qtype)
    root = str(Path(__file__).resolve().parents[3])  # the child imports this module from the same parity
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    child = subprocess.Popen([sys.executable, "-m", "parity.engines.gguf.quantize", str(source), str(out), str(number),
                              str(threads)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, env=env)
    try:
        _, log = child.communicate()
    except BaseException:  # Ctrl-C, SIGTERM (atomic turns it into KeyboardInterrupt): stop llama.cpp now
        child.kill()
        child.wait()
        raise
    text = log.decode(errors="replace")
    if child.returncode != 0:
        how = f"died (signal {-child.returncode})" if child.returncode < 0 else "failed"
        raise ParityError(f"llama.cpp's quantizer {how} making {qtype} from {source.name}: {_said(text)}")
    if not out.is_file():
        raise ParityError(f"llama.cpp's quantizer wrote no {qtype} file ({_said(text)})")


def _counts(types) -> str:
    return ", ".join(f"{n} {t}" for t, n in sorted(Counter(types).items(), key=lambda kv: (-kv[1], kv[0])))


def summary(qtype: str, header: dict[str, tuple[str, int, int]]) -> str:
    """What each tensor got, counted per type: the matrices whose rows fit the asked type's block, the others
    (which llama.cpp or gguf-py stored in a fallback type), and the vectors (F32).

    e.g. ``Q4_K_M asked; rows a multiple of 256: 12 Q4_K, 4 Q6_K; other rows fell back: 13 Q5_0, 3 Q8_0;
    vectors: 6 F32``."""
    import gguf  # optional: gguf

    base = LLAMA_TYPES[qtype][1] if qtype in LLAMA_TYPES else qtype
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[base]][0]
    matrices = {n: h for n, h in header.items() if h[2] > 1}
    fit = [t for t, row, _ in matrices.values() if row % block == 0]
    other = [t for t, row, _ in matrices.values() if row % block]
    vectors = [t for t, _, dims in header.values() if dims == 1]
    parts = [f"{qtype} asked"]
    if fit and other:
        parts.append(f"rows a multiple of {block}: {_counts(fit)}")
    elif fit:
        parts.append(f"matrices: {_counts(fit)}")
    if other:
        parts.append(f"{'other rows' if fit else f'no rows a multiple of {block}, so'} fell back: {_counts(other)}")
    if vectors:
        parts.append(f"vectors: {_counts(vectors)}")
    return "; ".join(parts)


def _child(argv: list[str]) -> int:
    """python -m parity.engines.gguf.quantize SOURCE OUT FTYPE THREADS: llama.cpp logs to stderr (the parent's pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides: it kills this process on Ctrl-C
    import llama_cpp  # optional: llama_cpp

    source, out, number, threads = argv
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(number)
    params.nthread = int(threads)
    return 1 if llama_cpp.llama_model_quantize(source.encode(), out.encode(), params) else 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
