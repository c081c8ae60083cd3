"""SIGINT and SIGTERM: end a command within seconds, leave nothing at its output path, exit 128 + the signal.

A CI runner's timeout sends SIGTERM, a user's Ctrl-C SIGINT. ``install()`` runs before anything slow (the CLI calls
it before its imports): each signal then raises KeyboardInterrupt in the main thread, which every command turns into
its cleanup and ``exit_code()`` (130 for SIGINT, 143 for SIGTERM). Two things make sure a signal is never lost:

- ``received`` keeps the first signal, whatever catches the KeyboardInterrupt on its way up (a library's broad
  ``except``): an output is never renamed into place after it (``stop_if_received``, parity.storage.atomic), and
  the command's exit code is the signal's even if the command went on to its end.
- a watchdog ends the process ``GRACE`` seconds after the first signal, where the cleanup has not ended it: an
  output is complete or absent (renames are atomic), and a killed run's temporary directory is recognisable and
  cleared by the next run into the same place.

Only the standard library here: it is imported before everything else.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

GRACE = 10.0  # seconds the cleanup gets after the first signal

received: int | None = None  # the first SIGINT / SIGTERM this process got


def _handler(number: int, frame) -> None:
    global received
    if received is None:
        received = number
        watchdog = threading.Timer(GRACE, _end)
        watchdog.daemon = True
        watchdog.start()
    raise KeyboardInterrupt


def _end() -> None:
    sys.stderr.write("parity: interrupted; nothing was written\n")
    leave()


def leave() -> None:
    """End the process now with ``exit_code()``, its output flushed. Not through the interpreter's exit: CPython
    3.11 ends a process in which a KeyboardInterrupt once left an ``exec`` of a string (dataclasses and pydantic
    build classes that way while they are imported) by killing it with SIGINT, whatever exit code it asked for."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not keep the process alive
            pass
    os._exit(exit_code())


def install() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread and are remembered. A shell starts a background
    job (`parity check ... &`, a CI step's child) with SIGINT ignored, and Python keeps an inherited ignore: it is
    replaced too, or such a run would never stop. Nothing happens outside the main thread (signals are its)."""
    if threading.current_thread() is threading.main_thread():
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, _handler)


def exit_code() -> int:
    """128 + the signal received (130 for SIGINT, 143 for SIGTERM); 130 for an interrupt no signal sent."""
    return 128 + (received or signal.SIGINT)


def stop_if_received() -> None:
    """Raise KeyboardInterrupt where a signal has been received, even if its first KeyboardInterrupt was caught
    on the way: called before anything is put in place."""
    if received is not None:
        raise KeyboardInterrupt
