"""Ctrl-C at any moment of a check or a conversion: exit code 130, one line, nothing written, within seconds.

Each case starts `parity` in a child process with SIGINT ignored, as a shell starts a background job (Python
keeps an inherited ignore: that is how an interrupt used to be swallowed). The child is parity's own CLI with
one function wrapped so that it marks a file when the phase under test begins and then, where the phase is
too short to hit by timing, stays in it; the test sends SIGINT once the mark appears.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# the child: wrap TARGET (module:attribute) so that calling it marks the file and, with STAY, waits there
CHILD = textwrap.dedent("""
    import importlib, os, sys, time
    mark, target, stay = os.environ["MARK"], os.environ.get("TARGET"), os.environ.get("STAY") == "1"
    if target:
        module, _, name = target.partition(":")
        owner = importlib.import_module(module)
        *path, last = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, last)

        def wrapped(*args, **kwargs):
            open(mark, "w").close()
            if stay:
                time.sleep(120)
            return original(*args, **kwargs)

        setattr(owner, last, wrapped)
    from parity.cli import main
    sys.argv = ["parity", *sys.argv[1:]]
    main()
""")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt(tmp_path: Path, args: list[str], target: str | None, stay: bool, after: float = 0.5) -> str:
    """Run the child until the phase begins (or ``after`` seconds with no target), interrupt it, and return its
    stderr once it has exited 130 within the allowed time."""
    mark = tmp_path / "phase-began"
    env = {**os.environ, "MARK": str(mark), "TARGET": target or "", "STAY": "1" if stay else "0"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=_ignore_sigint)
    try:
        deadline = time.monotonic() + 120
        while target and not mark.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"{target} was never reached"
            time.sleep(0.05)
        time.sleep(after)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert took < 10, f"exited {took:.1f} s after SIGINT"
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "parity: interrupted; nothing was written", err
    return err


# (what is interrupted, extra options, the function whose call begins the phase, stay in it)
PHASES = [
    ("start-up and imports", [], None, False),
    ("loading the reference", ["--layerwise"], "parity.reference.models:hf_runner", True),
    ("the reference's thread", ["--layerwise"], "parity.reference.capture:hooks", True),
    ("the candidate's forward", ["--layerwise"], "parity.candidates.neutral:make_runner", True),
    ("a long decode", ["--decode", "2000"], "parity.reference.decode:greedy", False),
    ("the candidate's decode", ["--decode", "8"], "parity.candidates.neutral:make_decoder", True),
    ("a long generation", ["--generate", "3000"], "parity.checker.run:_generate", False),
    ("the diagnosis", ["--layerwise", "--inject", "norm-offset-added"], "parity.diagnosis.diagnose:diagnose", True),
    ("writing the report", ["--layerwise"], "parity.render:write", True),
]


@pytest.mark.parametrize("phase,extra,target,stay", PHASES, ids=[p[0] for p in PHASES])
def test_ctrl_c_ends_a_check_in_every_phase(tiny_dir, neutral_dir, tmp_path, phase, extra, target, stay):
    report = tmp_path / "out" / "report.json"
    args = ["check", "--reference", str(tiny_dir("llama")), "--candidate", str(neutral_dir("llama")),
            "--report", str(report), *extra]
    _interrupt(tmp_path, args, target, stay, after=1.0 if phase.startswith("a long") else 0.3)
    assert not report.parent.exists() or not any(report.parent.iterdir())


def test_ctrl_c_ends_a_conversion_and_leaves_nothing(tiny_dir, tmp_path):
    out = tmp_path / "converted"
    _interrupt(tmp_path, ["convert", str(tiny_dir("llama")), "--to", "neutral", "-o", str(out)],
               "parity.storage.shards:ShardWriter.write", True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["phase-began"]
