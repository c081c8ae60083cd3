"""Any Python engine as a candidate, in a few lines of the user's own: ``--candidate python:my_engine.py``.

For engines parity does not ship (vLLM, SGLang, TensorRT-LLM's PyTorch backend, TransformerLens, an in-house
one). The file is imported: it is code the user named explicitly, run as any script of theirs would be (nothing
in a checkpoint is executed, and transformers is never asked to trust remote code). It defines either

(a) the engine's PyTorch model and where parity's capture points are in it, read with forward hooks::

    POINTS = {                                   # parity's point -> "MODULE[:WHICH]" in the engine's model
        "embed": "blocks.0.hook_resid_pre",      #   a module's output (a tuple's first element)
        "layers.{i}.attn_in": "blocks.{i}.ln1",  #   {i}: each layer
        "layers.{i}.mid": "blocks.{i}.ln2:input",          # its first input; input.NAME: that argument
        "logits": ":output.logits",              #   output.FIELD: an index, key or attribute; "" is the model
    }                                            # a module called several times in a forward: its first call
    def build(checkpoint, dtype):                # -> torch.nn.Module, from the reference's checkpoint directory
        ...
    def forward(model, ids):                     # optional: run it on token ids [1, S] (default: model(ids))
        ...

(b) or a runner that emits the points itself (an engine whose modules parity cannot reach, e.g. run in worker
    processes, or not PyTorch)::

    def run(checkpoint, dtype, ids, emit):       # emit(point, tensor [1, S, width] or [S, width]), in order
        ...

``--engine-option entry=NAME`` calls NAME instead of ``build`` (with POINTS) or ``run`` (without): variants of
one engine in one file. The points an engine does not give are reported as not compared. It is run the way
it runs: not fed the reference's layer inputs (``--isolate`` makes the reference follow it instead), no
``--decode``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from parity.adapter import ResolvedCapture
from parity.errors import ParityError
from parity.reference.capture import hooks

KIND = "python"
ALIASES = ("python-engine",)
EXPLICIT = True     # any .py file could be one: taken only as python:FILE.py
GENERIC = True      # reads points by module path or name: checks a model no adapter knows
ENGINE_OPTIONS = {"entry": "the function of the file to call (default: build with POINTS, else run)"}


def detect(path: Path) -> bool:
    return Path(path).suffix == ".py" and Path(path).is_file()


def validate(path: Path, adapter_dirs=()) -> None:
    """Refused before any model is loaded: not a Python file, one that fails to import, or one that defines
    neither build with POINTS nor run."""
    _module(Path(path))


def _module(path: Path):
    if not detect(path):
        raise ParityError(f"--candidate python:{path}: expected a Python file (.py) defining build and POINTS, or "
                          f"run (see `parity engines`)")
    key = f"parity_engine_{abs(hash((str(path.resolve()), path.stat().st_mtime_ns)))}"  # an edited file: anew
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module: whatever it raises is said in one line
        del sys.modules[key]
        raise ParityError(f"--candidate python:{path}: importing it failed ({type(exc).__name__}: "
                          f"{_first(exc)}); install what it imports, or fix it") from None
    if not (hasattr(module, "POINTS") or callable(getattr(module, "run", None))):
        raise ParityError(f"--candidate python:{path}: it defines neither POINTS (with build) nor run; see "
                          f"`pydoc parity.candidates.python_engine`")
    return module


def _first(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:200]


def _entry(module, path: Path, options) -> tuple[str, object]:
    name = dict(options.engine).get("entry") or ("build" if hasattr(module, "POINTS") else "run")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ParityError(f"--candidate python:{path}: it has no function {name!r}"
                          + (" (--engine-option entry)" if dict(options.engine).get("entry") else ""))
    return name, fn


def points(table: dict, ckpt, path: Path) -> list[ResolvedCapture]:
    """POINTS as capture hooks, ``{i}`` spelled out for each layer of the reference; a name parity does not
    know is refused."""
    known = {c.name for c in ckpt.resolved.capture}
    out = []
    for name, where in table.items():
        names = [(name, where)]
        if "{i}" in name:
            names = [(name.replace("{i}", str(i)), where.replace("{i}", str(i)))
                     for i in range(ckpt.resolved.num_layers)]
        for point, target in names:
            if point not in known:
                raise ParityError(f"python:{path}: POINTS names {point!r}, not a capture point of this "
                                  f"{ckpt.resolved.family} model ({', '.join(sorted(known)[:6])}, ...)")
            out.append(_where(point, str(target), path))
    return out


def _where(point: str, target: str, path: Path) -> ResolvedCapture:
    module, _, which = target.partition(":")
    io, _, detail = (which or "output").partition(".")
    if io not in ("input", "output"):
        raise ParityError(f"python:{path}: POINTS[{point!r}] = {target!r}: expected MODULE, MODULE:input[.ARG] or "
                          f"MODULE:output[.FIELD]")
    value = int(detail) if detail.isdigit() else (detail or None)
    return ResolvedCapture(point, module, io, value if io == "input" else None, value if io == "output" else None)


def _model(candidate, module, name: str, build) -> torch.nn.Module:
    key = ("python", str(Path(candidate.path).resolve()), name, candidate.dtype)
    if key not in candidate.models.loaded:
        try:
            model = build(Path(candidate.ckpt.path), candidate.dtype)
        except ParityError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's engine
            raise ParityError(f"python:{candidate.path}: {name}() raised {type(exc).__name__}: {_first(exc)}") from None
        if not isinstance(model, torch.nn.Module):
            raise ParityError(f"python:{candidate.path}: {name}() returned {type(model).__name__}, not a "
                              f"torch.nn.Module whose submodules POINTS names")
        candidate.models.loaded[key] = model.eval()
    return candidate.models.loaded[key]


def make_runner(candidate, ids: torch.Tensor, feed):
    path = Path(candidate.path)
    module = _module(path)
    name, fn = _entry(module, path, candidate.options)
    if not hasattr(module, "POINTS"):
        return lambda emit: _guarded(path, name, lambda: fn(Path(candidate.ckpt.path), candidate.dtype, ids,
                                                            lambda point, t: emit(point, _batched(t))))
    capture = points(dict(module.POINTS), candidate.ckpt, path)
    model = _model(candidate, module, name, fn)
    for c in capture:
        try:
            model.get_submodule(c.module)
        except AttributeError:
            raise ParityError(f"python:{path}: POINTS puts {c.name} at {c.module!r}, and the engine's model has no "
                              f"such module") from None
    run = getattr(module, "forward", None) or (lambda model, ids: model(ids))

    def runner(emit) -> None:
        seen: set[str] = set()

        def once(point: str, t: torch.Tensor) -> None:  # a module called again (TransformerLens's ln1, for q, k
            if point not in seen:                        # and v): its first call, as a point comes once
                seen.add(point)
                emit(point, _batched(t))

        with hooks(model, capture, once), torch.no_grad():
            _guarded(path, "forward" if hasattr(module, "forward") else "the model", lambda: run(model, ids))

    return runner


def _batched(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t  # [S, width]: engines that pack a batch's tokens


def _guarded(path: Path, what: str, call) -> None:
    """The user's code run, its errors said in one line; parity's own (a stopped stream) pass through."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the user's engine
        if type(exc).__module__.split(".")[0] == "parity":
            raise
        raise ParityError(f"python:{path}: {what} raised {type(exc).__name__}: {_first(exc)}") from None

