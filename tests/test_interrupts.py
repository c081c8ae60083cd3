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


def _reap(proc: subprocess.Popen) -> None:
    """Kill a child a failed assertion left running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


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
        _reap(proc)
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


# SIGTERM (a CI runner's timeout) or SIGINT at any moment of a command, from start-up on, while a second process
# keeps a core busy (issue 34: one SIGTERM of three sent 0.8 s into a conversion under load was swallowed)
DELAYS = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.1, 1.5, 2.5, 4.0)


def _stop_at(args: list[str], out: Path, number: int, delay: float) -> tuple[int | None, str]:
    """Start `python -m parity ARGS` (the console script's entry), send ``number`` ``delay`` s in, and return its
    exit code and stderr; None for the code where it had ended before the signal (then the signal is not sent)."""
    proc = subprocess.Popen([sys.executable, "-m", "parity", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parent.parent)
    try:
        time.sleep(delay)
        if proc.poll() is not None:
            _, err = proc.communicate()
            assert proc.returncode == 0, err
            return None, err
        sent = time.monotonic()
        proc.send_signal(number)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        _reap(proc)
    assert took < 15, f"exited {took:.1f} s after signal {number}"
    return proc.returncode, err


@pytest.fixture
def busy():
    """A second process keeping one of the cores busy while the command runs."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    spinner.kill()
    spinner.wait()


def _convert(tiny_dir, neutral_dir, out: Path) -> list[str]:
    return ["convert", str(tiny_dir("llama")), "--to", "neutral", "-o", str(out)]


def _check(tiny_dir, neutral_dir, out: Path) -> list[str]:
    return ["check", "--reference", str(tiny_dir("llama")), "--candidate", str(neutral_dir("llama")), "--layerwise",
            "--calibrate", "--report", str(out.with_name(out.name + ".json"))]


COMMANDS = {"convert": (_convert, ("manifest.json", "model.safetensors")), "check": (_check, ())}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_at_any_moment_ends_the_command(tiny_dir, neutral_dir, tmp_path, busy, number, command):
    """Every delay from start-up (imports) to the end: 143 for SIGTERM, 130 for SIGINT, and nothing at the output
    path, or, where the command had ended before the signal, exit 0 and the whole output."""
    arguments, parts = COMMANDS[command]
    stopped = 0
    for delay in DELAYS:
        out = tmp_path / f"out-{delay}"
        code, err = _stop_at(arguments(tiny_dir, neutral_dir, out), out, number, delay)
        made = [p for p in tmp_path.iterdir() if p.name.startswith((f"out-{delay}", f".out-{delay}"))]
        complete = all((out / part).is_file() for part in parts) if parts else out.with_name(out.name + ".json") \
            .is_file()
        if code is None:  # it had ended: the output is complete
            assert complete, delay
            continue
        stopped += 1
        # a signal in the last milliseconds, while Python shuts down (its handlers restored), ends the process as
        # the signal's default does: a shell sees 128 + the signal all the same
        assert code in (128 + number, -number), (delay, code, err)
        if code > 0:
            assert err.strip().splitlines()[-1] == "parity: interrupted; nothing was written", err
        # nothing, or (a signal after the output was put in place, as the command ended) the whole output; never a
        # part of it, nor a temporary left behind
        assert made == [] or (complete and len(made) == 1), (delay, made)
    assert stopped >= 3  # the first delays fall inside the run (start-up alone takes longer), whatever the machine


def test_a_signal_whose_interrupt_is_caught_still_ends_the_command(tiny_dir, tmp_path):
    """A library that catches the KeyboardInterrupt a signal raises (a broad except on the way up) cannot turn the
    signal into a finished command: the output is never put in place and the exit code is still 143."""
    child = textwrap.dedent("""
        import os, signal, sys
        from parity.storage import shards
        original = shards.ShardWriter.write

        def swallowing(self, *args, **kwargs):
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread
                for _ in range(10 ** 6):
                    pass
            except KeyboardInterrupt:
                pass  # swallowed
            return original(self, *args, **kwargs)

        shards.ShardWriter.write = swallowing
        from parity.__main__ import main
        sys.argv = ["parity", *sys.argv[1:]]
        main()
    """)
    out = tmp_path / "converted"
    proc = subprocess.run([sys.executable, "-c", child, "convert", str(tiny_dir("llama")), "--to", "neutral", "-o",
                           str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert "parity: interrupted; nothing was written" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
