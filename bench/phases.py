"""Where a child's time goes, without a profiler in parity: before the command runs, the parity functions that do
each part of a check are wrapped with timers (``install``). A phase's time is the main thread's wall time in its
functions, less that of the phases they call (loading a model inside making a plan counts as loading), so the
phases and the unattributed rest add up to the command's time. Work in other threads counts where the main thread
waits for it: the reference runs in a thread of its own while the main thread waits in PromptCheck._run_ahead,
and the metrics' helper threads while it computes its own share.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict

# phase -> seconds; in the order they are printed
PHASES = ("tokenizer", "plan", "loading", "reference forward", "candidate forward", "on point", "metrics",
          "drill-down, diagnosis", "report")
spent: dict[str, float] = defaultdict(float)
_nested: list[float] = []  # per phase in progress on the main thread: the seconds of the phases it called


def timed(phase: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        start = time.perf_counter()
        _nested.append(0.0)
        try:
            return fn(*args, **kwargs)
        finally:
            total = time.perf_counter() - start
            spent[phase] += total - _nested.pop()
            if _nested:
                _nested[-1] += total
    return wrapper


def _wrap(owner, name: str, phase: str) -> None:
    setattr(owner, name, timed(phase, getattr(owner, name)))


def install_loading() -> None:
    """Time the loading of the models (a bare forward: the rest of it is its forward)."""
    import parity.candidates.neutral as neutral
    import parity.reference.models as models

    _wrap(models, "_load_hf", "loading")               # transformers' from_pretrained
    _wrap(neutral, "load", "loading")                  # the executor's model
    _wrap(models.Models, "release", "loading")         # dropping the reference before the candidate loads


def install() -> None:
    """Time a check's phases."""
    import parity.checker.judge as judge
    import parity.checker.prefill as prefill
    import parity.checker.run as run
    import parity.checkpoint.inputs as inputs
    import parity.render as render

    install_loading()
    _wrap(inputs, "_tokenize", "tokenizer")            # reading tokenizer.json, encoding the prompt
    _wrap(run, "make_plan", "plan")                    # opening both sides, the inputs, refusing what cannot run
    _wrap(prefill.PromptCheck, "_run_ahead", "reference forward")  # with its capture hooks, points to disk
    _wrap(prefill.PromptCheck, "__call__", "candidate forward")    # the rest of a prompt: the executor's forward
    _wrap(prefill.PromptCheck, "on_point", "on point")  # each candidate point: its reference read back, kept
    _wrap(judge, "metrics", "metrics")                  # float64, a chunk at a time (reading from disk included)
    _wrap(prefill, "logits_compared", "metrics")
    _wrap(run, "drill", "drill-down, diagnosis")
    _wrap(run, "_diagnose", "drill-down, diagnosis")
    _wrap(render, "console", "report")
    _wrap(render, "write", "report")


def line() -> str:
    """What the child prints for the parent: ``phases`` and a JSON object of seconds."""
    import json

    return "phases " + json.dumps({p: round(spent.get(p, 0.0), 4) for p in PHASES})
