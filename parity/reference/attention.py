"""Operation-level points inside attention (docs/ops.md): the queries and keys an attention module hands its
attention function (after RoPE), and the scores and probabilities that function computes.

transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)``. While these points are hooked, a model that runs eager attention is switched to
ATTENTION, registered once with transformers' AttentionInterface (and its mask with AttentionMaskInterface, as the
eager mask, so the masks are eager's): it calls the module's own ``eager_attention_forward`` with the same arguments,
so the model computes bit for bit as under eager. The softmax's input and output are read by a TorchFunctionMode
active only during that call, in the thread making it: the reference and a transformers candidate run in threads
of one process, and nothing global is patched.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from functools import cache
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from parity import ops
from parity.errors import ParityError

ATTENTION = "parity_eager"    # the name registered with transformers (not a kernel a user chooses)
SOFTMAX = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax)

# attention module -> [(field, point name, on_point)] while its points are hooked: how the one registered function
# finds what to report for the module calling it (a model is run by one thread at a time)
_wanted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Softmax(TorchFunctionMode):
    """Notes the first softmax's input and output; every call runs exactly as it would without the mode."""

    def __init__(self):
        super().__init__()
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.seen is None and func in SOFTMAX:
            self.seen = (args[0], out)
        return out


@cache
def eager_function(kind: type) -> Callable:
    """The eager attention function of an attention module class's modeling file (or of a base class's, for a
    subclass defined elsewhere): the one transformers calls it with under eager."""
    found = (getattr(sys.modules.get(c.__module__), "eager_attention_forward", None) for c in kind.__mro__)
    fn = next((f for f in found if callable(f)), None)
    if fn is None:
        raise ParityError(f"{kind.__name__}: its modeling file has no eager_attention_forward, so its queries, "
                          f"keys, scores and probabilities cannot be read; drop those ops from the adapter")
    return fn


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, *args: Any, **kwargs: Any):
    """ATTENTION: the module's eager attention, its inputs and softmax reported for the points hooked on it."""
    eager = eager_function(type(module))
    wanted = {field: (name, emit) for field, name, emit in _wanted.get(module, ())}
    if (hooked := wanted.get("query")) is not None:
        name, emit = hooked
        emit(name, ops.from_heads(query.detach()))
    if (hooked := wanted.get("key")) is not None:  # with a cache, this forward's positions' keys are the last ones
        name, emit = hooked
        emit(name, ops.from_heads(key.detach()[..., key.shape[-2] - query.shape[-2]:, :]))
    if "scores" not in wanted and "probs" not in wanted:
        return eager(module, query, key, value, attention_mask, *args, **kwargs)
    watch = _Softmax()
    with watch:
        out = eager(module, query, key, value, attention_mask, *args, **kwargs)
    if watch.seen is None:
        raise ParityError(f"{type(module).__name__}: its eager attention computed no softmax; its scores and "
                          f"probabilities cannot be read")
    scores, probs = watch.seen
    if (hooked := wanted.get("scores")) is not None:
        name, emit = hooked
        emit(name, ops.scores(scores.detach()))
    if (hooked := wanted.get("probs")) is not None:
        name, emit = hooked
        emit(name, ops.probs(probs.detach()))
    return out


@cache
def register() -> None:
    """ATTENTION in transformers' registries, once per process (registering again would change nothing)."""
    from transformers import AttentionInterface  # heavy: transformers
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])


@contextmanager
def recording(points: list[tuple[torch.nn.Module, Any]],
              on_point: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """While inside, each (attention module, point) reports ``point.field`` (query, key, scores, probs) as
    ``on_point(point.name, [1, S, width])``; the models these modules belong to run ATTENTION instead of eager,
    and eager again after."""
    register()
    switched: dict[int, Any] = {}
    added: list[tuple[torch.nn.Module, tuple]] = []
    try:
        for module, point in points:
            config = getattr(module, "config", None)
            kind = getattr(config, "_attn_implementation", None)
            if kind not in ("eager", ATTENTION):
                raise ParityError(f"{point.name}: read from transformers' eager attention only; this model runs "
                                  f"attn_implementation={kind!r}")
            entry = (point.field, point.name, on_point)
            _wanted.setdefault(module, []).append(entry)
            added.append((module, entry))
            if kind == "eager":
                switched[id(config)] = config
        for config in switched.values():
            config._attn_implementation = ATTENTION
        yield
    finally:
        for config in switched.values():
            config._attn_implementation = "eager"
        for module, entry in added:
            entries = _wanted.get(module, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                _wanted.pop(module, None)
