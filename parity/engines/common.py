"""What the engine kinds share (those taken as KIND:PATH, converting a checkpoint their own way): importing an
engine's Python package with one line that names the extra to install, and the cache of directories an engine's own
converter wrote from a Hugging Face checkpoint; and the emitting of the points a decoder captured, step by step."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from parity import names
from parity.errors import ParityError


def require(module: str, extra: str, what: str | None = None):
    """``module`` imported, or one line naming the extra that installs it (exit 2)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ParityError(f"{what or module} is not installed ({exc}); pip install 'parity[{extra}]'") from None


def cache_root() -> Path:
    """Where engines' conversions are kept: $PARITY_CACHE/engines, default ~/.cache/parity/engines."""
    base = os.environ.get("PARITY_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "parity") / "engines"


def fingerprint(source: Path) -> list:
    """What identifies a checkpoint directory's contents without reading its weights: each file's name, size and
    modification time (a re-save or an edit changes them)."""
    out = []
    for f in sorted(Path(source).iterdir()):
        if f.is_file():
            st = f.stat()
            out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def converted(engine: str, source: Path, settings: dict, version: str, convert: Callable[[Path], None]) -> Path:
    """The directory ``convert(out)`` (the engine's own converter) writes from the checkpoint at ``source`` with
    ``settings``: made once into the cache, keyed by the checkpoint's files, the converter's ``version`` and the
    settings, written to a temporary directory beside it and renamed into place when complete (an interrupted
    conversion leaves nothing that a later check would take for a finished one)."""
    key = json.dumps({"source": str(Path(source).resolve()), "files": fingerprint(source), "version": version,
                      "settings": settings}, sort_keys=True)
    out = cache_root() / engine / f"{Path(source).resolve().name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (out / "parity-conversion.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        convert(tmp / "model")
        (tmp / "model" / "parity-conversion.json").write_text(key)
        try:
            os.rename(tmp / "model", out)
        except OSError:  # another process finished the same conversion first
            if not (out / "parity-conversion.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def emit_steps(steps: list[dict], emit) -> None:
    """A decoder's captured steps ({point: tensor [1, 1, width]} each, the first token's first), emitted as
    ``emit(step, point, tensor)`` from step 1, each step's points in their order."""
    for step, captured in enumerate(steps, 1):
        for name in sorted(captured, key=names.point_order):
            emit(step, name, captured[name])
