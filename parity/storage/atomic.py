"""Atomic outputs: write into a temporary sibling, rename into place only when complete.

A failed or interrupted run leaves neither the output nor its temporary directory; one killed
outright leaves a recognisable ``.OUT.parity-tmp-*`` directory that the next run into the same
place clears.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from parity import signals
from parity.errors import ParityError


def _tmp_prefix(out: Path) -> str:
    return f".{out.name}.parity-tmp-"


@contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so cleanup runs (main thread only), where nothing handles it yet (a
    library caller; the command line's handlers, parity.signals, already do)."""
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            yield
            return
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def output_dir(out: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` when the block completes."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if out.exists() and not force:
        raise ParityError(f"{out} already exists; choose another -o or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise ParityError(f"{out} exists and is not a directory; remove it or choose another -o")
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(_tmp_prefix(out) + "*"):  # left by a run that was killed outright
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(out), dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
    try:
        with _sigterm_as_exception():
            yield tmp
            signals.stop_if_received()  # a signal whose interrupt was caught on the way: never put in place
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=_tmp_prefix(out), dir=parent))
                os.replace(out, old / out.name)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def output_file(out: Path, *, force: bool = False, companions: tuple[str, ...] = (".data",)) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; when the block completes, the file named like ``out``
    in it becomes ``out``. Companions written beside it (``out.name`` + a suffix in ``companions``, such
    as ONNX external data) are renamed into place first, so ``out`` never appears without them; those
    of a replaced output that the new one lacks are removed."""
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ParityError(f"{out} is a directory; give a file name for -o")
    if out.exists() and not force:
        raise ParityError(f"{out} already exists; choose another -o or pass --force to replace it")
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(_tmp_prefix(out) + "*"):  # left by a run that was killed outright
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(out), dir=parent))
    try:
        with _sigterm_as_exception():
            yield tmp
            signals.stop_if_received()  # a signal whose interrupt was caught on the way: never put in place
            if not (tmp / out.name).is_file():
                raise ParityError(f"{out}: nothing was written")
            for suffix in companions:
                made, old = tmp / (out.name + suffix), parent / (out.name + suffix)
                if made.is_file():
                    os.replace(made, old)
                elif old.is_file() and out.exists():
                    old.unlink()
            os.replace(tmp / out.name, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
