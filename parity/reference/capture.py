"""Reading capture points out of a transformers model with hooks placed by the adapter.

The adapter's capture map says, for each point, which module to hook and whether the value is
one of its inputs (``arg``: a parameter name or position) or its output (``field``: a tuple index
or an attribute such as ``logits``). No family-specific code lives here.

Operation-level points (the adapter's ``[ops]``, docs/ops.md) are read the same way, laid out as parity.ops says,
plus one more kind: ``io = "attention"``, what a module hands its attention function (query and key after RoPE) and
what that function computes (the softmax's input and output). For those, the model's eager attention is switched,
while hooked, to ATTENTION: a function registered with transformers' AttentionInterface that runs the module's own
eager function unchanged and watches it (parity.reference.attention).
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch

from parity import names, ops
from parity.adapter import ResolvedCapture
from parity.errors import ParityError
from parity.reference.attention import ATTENTION, recording

__all__ = ["ATTENTION", "hooks", "input_value", "run_and_capture", "with_input"]


def _where(module: torch.nn.Module, arg: str | int | None, args: tuple, kwargs: dict) -> str | int:
    """Where a forward's argument ``arg`` (a name or a position; None: the first) was given: its keyword, or its
    position in ``args``."""
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if arg is None:
        arg = 0
    name = arg if isinstance(arg, str) else params[arg].name
    if name in kwargs:
        return name
    position = next((k for k, p in enumerate(params) if p.name == name), None)
    if position is not None and position < len(args):
        return position
    raise ParityError(f"capture: {type(module).__name__}.forward was not given {name!r}")


def input_value(module: torch.nn.Module, arg: str | int | None, args: tuple, kwargs: dict) -> Any:
    at = _where(module, arg, args, kwargs)
    return kwargs[at] if isinstance(at, str) else args[at]


def with_input(module: torch.nn.Module, arg: str | int | None, args: tuple, kwargs: dict,
               value: Any) -> tuple[tuple, dict]:
    """(args, kwargs) with the argument ``input_value`` reads replaced by ``value`` (a pre-hook's return)."""
    at = _where(module, arg, args, kwargs)
    if isinstance(at, str):
        return args, {**kwargs, at: value}
    return (*args[:at], value, *args[at + 1:]), kwargs


def _output_value(output: Any, field: str | int | None) -> Any:
    if field is None:
        return output[0] if isinstance(output, tuple) else output
    if isinstance(field, int):
        return output[field] if isinstance(output, (tuple, list)) else output
    return output[field] if isinstance(output, dict) else getattr(output, field)


def op_layout(point: ResolvedCapture, t: torch.Tensor) -> torch.Tensor:
    """An op read at a module's input or output as every side emits it, [1, S, width] (parity.ops): its part
    (``slice``) kept; heads held first moved after the positions; a token-flattened [T, width] (a MoE router's
    logits) given its batch of one back."""
    if point.slice is not None:
        t = ops.part(t, point.slice, point.groups)
    if point.heads_first:
        return ops.from_heads(t)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    return ops.flat(t)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """A capture point read token-flattened, [T, D] (Llama 4's MoE block returns its output so), with its batch of
    one back: [1, T, D] as every other point."""
    return t.unsqueeze(0) if t.dim() == 2 else t


def _module(model: torch.nn.Module, point: ResolvedCapture) -> torch.nn.Module | None:
    """The module a point is read at; None for an op whose module this layer lacks (a dense layer's router, a
    KV-shared layer's k_proj): that op is simply absent there. A capture point's is an adapter error."""
    try:
        return model.get_submodule(point.module)
    except AttributeError:
        if names.is_op(point.name):
            return None
        raise ParityError(f"capture point {point.name}: the model has no module {point.module!r}; "
                          f"fix the adapter's capture map") from None


@contextmanager
def hooks(model: torch.nn.Module, points: list[ResolvedCapture],
          on_point: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``on_point(name, tensor)`` for each capture point as the model produces it. An op read at a module's
    input is read before any other pre-hook changes it (an engine's rounding of a projection's input); one read at
    an output after the hooks already there (what the engine adds to it)."""
    handles = []
    attention: list[tuple[torch.nn.Module, ResolvedCapture]] = []
    try:
        for point in points:
            module = _module(model, point)
            if module is None:
                continue
            op = names.is_op(point.name)
            if point.io == "attention":
                attention.append((module, point))
            elif point.io == "input":
                def pre(mod, args, kwargs, point=point, op=op):
                    value = input_value(mod, point.arg, args, kwargs).detach()
                    on_point(point.name, op_layout(point, value) if op else value)
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=op))
            else:
                def post(mod, args, output, point=point, op=op):
                    value = _output_value(output, point.field).detach()
                    on_point(point.name, op_layout(point, value) if op else _batched(value))
                handles.append(module.register_forward_hook(post))
        with ExitStack() as stack:
            if attention:
                stack.enter_context(recording(attention, on_point))
            yield
    finally:
        for h in handles:
            h.remove()


def run_and_capture(model: torch.nn.Module, points: list[ResolvedCapture], **inputs: Any) -> dict[str, torch.Tensor]:
    """Run the model once and return every capture point (clones, in the order produced); an op is missing where
    its layer lacks it."""
    seen: dict[str, torch.Tensor] = {}
    with hooks(model, points, lambda name, t: seen.setdefault(name, t.clone())), torch.no_grad():
        model(**inputs)
    missing = [p.name for p in points if p.name not in seen and not names.is_op(p.name)]
    if missing:
        raise ParityError(f"capture points never produced: {', '.join(missing)}; fix the adapter's capture map")
    return seen
