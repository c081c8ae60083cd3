"""Reading capture points out of a transformers model with hooks placed by the adapter.

The adapter's capture map says, for each point, which module to hook and whether the value is
one of its inputs (``arg``: a parameter name or position) or its output (``field``: a tuple index
or an attribute such as ``logits``). No family-specific code lives here.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from .adapter import ResolvedCapture
from .errors import ParityError


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


@contextmanager
def hooks(model: torch.nn.Module, points: list[ResolvedCapture],
          on_point: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``on_point(name, tensor)`` for each capture point as the model produces it."""
    handles = []
    try:
        for point in points:
            try:
                module = model.get_submodule(point.module)
            except AttributeError:
                raise ParityError(f"capture point {point.name}: the model has no module {point.module!r}; "
                                  f"fix the adapter's capture map") from None
            if point.io == "input":
                def pre(mod, args, kwargs, point=point):
                    on_point(point.name, input_value(mod, point.arg, args, kwargs).detach())
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            else:
                def post(mod, args, output, point=point):
                    on_point(point.name, _output_value(output, point.field).detach())
                handles.append(module.register_forward_hook(post))
        yield
    finally:
        for h in handles:
            h.remove()


def run_and_capture(model: torch.nn.Module, points: list[ResolvedCapture], **inputs: Any) -> dict[str, torch.Tensor]:
    """Run the model once and return every capture point (clones, in the order produced)."""
    seen: dict[str, torch.Tensor] = {}
    with hooks(model, points, lambda name, t: seen.setdefault(name, t.clone())), torch.no_grad():
        model(**inputs)
    missing = [p.name for p in points if p.name not in seen]
    if missing:
        raise ParityError(f"capture points never produced: {', '.join(missing)}; fix the adapter's capture map")
    return seen
