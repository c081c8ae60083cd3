"""``parity check``: run the reference and a candidate side by side and compare them point by point.

The reference is a Hugging Face checkpoint run with transformers (eager attention), its capture
points read by hooks that the adapter's capture map places. The candidate is a neutral directory
(run with parity's executor) or another Hugging Face checkpoint. The reference runs in a
background thread and hands each point over as it is produced; the candidate, in this thread,
compares each of its points as it comes and drops both, so memory holds about one layer of
activations beyond the models.

``--isolate`` feeds each candidate layer the reference's input for that layer, separating the
error a layer adds from the error it inherits. ``--calibrate`` runs the reference at the
candidate's dtype (and at float64 for float32 checks) to measure each point's own precision
noise, and sets tolerances to a multiple of it.
"""

from __future__ import annotations

import gc
import json
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import candidates, names
from .checkpoint import Checkpoint, inventory, open_checkpoint, weight_files
from .compare import Tolerances, judge, logit_metrics, metrics
from .errors import ParityError
from .lengths import default_length, exercised
from .report import PointResult, Report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Emit = Callable[[str, torch.Tensor], None]
Feed = Callable[[int, torch.Tensor], torch.Tensor]  # (layer index, its input) -> the input to use


# --------------------------------------------------------------------------------------------
# Models as streams of capture points


class _Done:
    pass


class Stream:
    """A model run in a background thread; ``get(name)`` waits for that capture point."""

    def __init__(self, run: Callable[[Emit], None], label: str, bound: int = 4):
        self.label = label
        self.items: queue.Queue = queue.Queue(maxsize=bound)  # 0: unbounded, the model runs ahead
        self.buffer: dict[str, torch.Tensor] = {}
        self.finished = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, args=(run,), daemon=True)
        self.thread.start()

    def _main(self, run: Callable[[Emit], None]) -> None:
        try:
            with torch.no_grad():
                run(lambda name, t: self.items.put((name, t.detach())))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
            self.error = exc
        finally:
            self.items.put(_Done)

    def get(self, name: str) -> torch.Tensor | None:
        while name not in self.buffer and not self.finished:
            item = self.items.get()
            if item is _Done:
                self.finished = True
                if self.error is not None:
                    raise self.error
                break
            self.buffer[item[0]] = item[1]
        return self.buffer.pop(name, None)

    def drain(self) -> None:
        while not self.finished:
            self.get("\0")
        self.buffer.clear()


# --------------------------------------------------------------------------------------------
# Reference and candidates


def _load_hf(ckpt: Checkpoint, dtype: torch.dtype, stream: bool = False, device: str = "cpu"):
    """transformers' model for the checkpoint: whole (``from_pretrained``), or streamed a layer at a time
    (parity.lazy). ``device`` "auto" with several GPUs spreads a whole model over them (accelerate's
    device_map)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    architecture = ckpt.variant.architectures[0]
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ParityError(f"{ckpt.path}: transformers {transformers.__version__} has no {architecture}; upgrade "
                          f"transformers or use a checkpoint of a family it supports")
    # grouped-matmul expert kernels have no float64 version; the plain loop computes the same thing
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    try:
        if stream:
            from .lazy import streamed_hf

            return streamed_hf(cls, ckpt, dtype, device, **extra)
        place = {} if device == "cpu" else {"device_map": device}
        return cls.from_pretrained(ckpt.path, attn_implementation="eager", dtype=dtype, **place, **extra).eval()
    except (MemoryError, ParityError):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a damaged checkpoint
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        if "allocate" in text:  # the CPU allocator's out-of-memory error: the CLI says so
            raise
        raise ParityError(f"{ckpt.path}: transformers could not load it as {architecture} ({type(exc).__name__}: "
                          f"{text[:200]}); check that its config and weights belong together") from None


def _isolation_hooks(model, ckpt: Checkpoint, feed: Feed) -> list:
    """Pre-hooks that replace each layer's input (and the head's) by ``feed(i, input)``."""
    from .capture import _input_value

    r = ckpt.resolved
    by_name = {c.name: c for c in r.capture}
    targets = [(i, by_name[f"layers.{i}.out"].module) for i in range(r.num_layers)]
    after = next((by_name[n] for n in ("final_norm", "logits") if n in by_name), None)
    if after is not None:
        targets.append((r.num_layers, after.module))
    handles = []
    for i, path in targets:
        module = model.get_submodule(path)

        def pre(mod, args, kwargs, i=i):
            x = _input_value(mod, 0, args, kwargs)
            new = feed(i, x)
            if args:
                return (new, *args[1:]), kwargs
            key = next(iter(kwargs))
            return args, {**kwargs, key: new}

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


# --------------------------------------------------------------------------------------------
# Devices and memory


def device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(spec: str) -> str:
    """'cpu', 'cuda', 'cuda:N', 'mps' or 'auto' (every GPU there is, else the CPU), checked against this machine."""
    spec = (spec or "cpu").strip().lower()
    if spec == "auto":
        if device_count():
            return "auto" if device_count() > 1 else "cuda:0"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    if spec == "cpu":
        return spec
    kind, _, index = spec.partition(":")
    if kind == "cuda":
        if not device_count():
            raise ParityError(f"--device {spec}: this machine has no CUDA GPU visible to torch "
                              f"({torch.__version__}); use --device cpu")
        n = int(index) if index.isdigit() else 0 if not index else -1
        if not 0 <= n < device_count():
            raise ParityError(f"--device {spec}: expected cuda or cuda:N with N in 0..{device_count() - 1}")
        return f"cuda:{n}"
    if kind == "mps" and not index:
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ParityError(f"--device mps: this machine has no MPS device; use --device cpu")
        return "mps"
    raise ParityError(f"--device {spec!r} is not one of cpu, cuda, cuda:N, mps, auto")


def _memory(device: str) -> int | None:
    """Bytes free where a model would be placed: MemAvailable for the CPU, free memory of the GPU(s)."""
    if device == "cpu" or device == "mps":
        return _available_memory()
    if device == "auto":
        return sum(torch.cuda.mem_get_info(i)[0] for i in range(device_count()))
    return torch.cuda.mem_get_info(torch.device(device))[0]


def _elements(shapes) -> int:
    n = 0
    for shape in shapes:
        k = 1
        for s in shape:
            k *= s
        n += k
    return n


def would_not_fit(ckpt: Checkpoint, candidate: Path, kind: str, dtype: str, calibrate: bool, device: str,
                  candidate_device: str) -> bool:
    """Whether the models of a check, held whole, would take more than 80% of the memory free for them: the
    float32 reference, the candidate at its dtype (when parity runs it: ``kind`` neutral or transformers) and
    the calibration reference."""
    params = _elements(info.shape for info in ckpt.tensors.values())
    need = {device: params * 4}
    if calibrate:
        need[device] += params * (8 if dtype == "float32" else DTYPES[dtype].itemsize)
    if kind in ("neutral", "transformers"):
        from .neutral import read_manifest

        shapes = ([info["shape"] for info in read_manifest(candidate)["tensors"].values()] if kind == "neutral"
                  else [info.shape for info in inventory(weight_files(candidate)).values()])
        count = _elements(shapes)
        need[candidate_device] = need.get(candidate_device, 0) + count * DTYPES[dtype].itemsize
    for where, nbytes in need.items():
        free = _memory(where)
        if free is not None and nbytes > 0.8 * free:
            return True
    return False


class Models:
    """Loaded models, reused across the prompts of one check."""

    def __init__(self, adapter_dirs=(), *, stream: bool = False, device: str = "cpu", candidate_device: str = "cpu"):
        self.adapter_dirs = tuple(adapter_dirs)  # --adapters: every checkpoint of the check is read with them
        self.stream = stream                     # weights read a layer at a time (parity.lazy)
        self.device = {"reference": device, "calibration": device, "calibration (isolated)": device,
                       "candidate": candidate_device}
        self.loaded: dict = {}
        self.options: dict = {}  # candidate options from check() (ONNX: provider, map, layerwise)
        self.notes: dict = {}    # what a candidate runner reports back: "matching", "warnings"

    def hf(self, ckpt: Checkpoint, dtype: torch.dtype, role: str = "reference"):
        # one instance per role: the reference runs in another thread with its own hooks, so a
        # candidate that is the same checkpoint must not share its modules
        key = ("hf", str(ckpt.path), dtype, role)
        if key not in self.loaded:
            self.loaded[key] = _load_hf(ckpt, dtype, self.stream, self.device.get(role, self.device["reference"]))
        return self.loaded[key]

    def release(self, role: str) -> None:
        """Drop the transformers model of ``role``: a later use loads it again."""
        for key in [k for k in self.loaded if k[0] == "hf" and k[3] == role]:
            del self.loaded[key]
        gc.collect()

    def neutral(self, path: Path, dtype: torch.dtype, inject: str | None = None):
        from . import bugs
        from .executor.model import NeutralModel
        from .neutral import load

        key = ("neutral", str(path), dtype, inject)
        if key not in self.loaded:
            # an injected mistake rewrites tensors, so that candidate is held whole
            manifest, tensors = load(path, lazy=self.stream and not inject)
            if inject:  # the executor runs the mistake exactly as a port would
                manifest, tensors = bugs.inject(inject, manifest, tensors, bugs.families())
            self.loaded[key] = NeutralModel(manifest, tensors, dtype, self.device["candidate"])
        return self.loaded[key]


def hf_runner(models: Models, ckpt: Checkpoint, dtype: torch.dtype, ids: torch.Tensor, feed: Feed | None = None,
              role: str = "reference", points: set[str] | None = None, on_layer: Callable[[int], None] | None = None,
              last: int | None = None):
    """A function that runs a transformers checkpoint and emits its capture points (only ``points``, when
    given: nothing else is hooked, so nothing else is held). ``on_layer(i)`` is told when layer i is done;
    with ``last``, the forward stops after that layer (a slice of a check needs nothing beyond it)."""
    model = models.hf(ckpt, dtype, role)
    capture = [c for c in ckpt.resolved.capture if points is None or c.name in points]
    layer_paths = {c.name: c.module for c in ckpt.resolved.capture}
    device = models.device.get(role, models.device["reference"])

    def run(emit: Emit) -> None:
        from .capture import hooks

        # capture hooks first: a layer's input is reported as computed, then replaced when isolating
        with hooks(model, capture, emit), torch.no_grad():
            handles = _isolation_hooks(model, ckpt, feed) if feed is not None else []
            if on_layer is not None:
                for i in range(ckpt.resolved.num_layers):
                    module = model.get_submodule(layer_paths[f"layers.{i}.out"])
                    handles.append(module.register_forward_hook(lambda *_, i=i: on_layer(i)))
            if last is not None:
                module = model.get_submodule(layer_paths[f"layers.{last}.out"])
                handles.append(module.register_forward_hook(_stop))
            try:
                model(input_ids=ids.to(_first_device(model, device)))
            except _Enough:
                pass
            finally:
                for h in handles:
                    h.remove()

    return run


class _Enough(Exception):
    """Raised after the last layer a slice needs: the rest of the forward is not run."""


def _stop(*_) -> None:
    raise _Enough


def _first_device(model, device: str) -> torch.device:
    """Where a model's inputs go: its embedding's device when spread over several (device_map)."""
    if device != "auto":
        return torch.device(device)
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def neutral_runner(models: Models, path: Path, dtype: torch.dtype, ids: torch.Tensor, feed: Feed | None = None,
                   inject: str | None = None, layers: range | None = None):
    model = models.neutral(path, dtype, inject)

    def run(emit: Emit) -> None:
        model(ids, on_point=emit, feed=feed, layers=layers)

    return run


def only(run: Callable[[Emit], None], names: set[str]) -> Callable[[Emit], None]:
    """The run, emitting only ``names``: nothing else is queued or held."""
    return lambda emit: run(lambda name, t: emit(name, t) if name in names else None)


def plain_forward(path: Path, ids: torch.Tensor, *, stream: bool, dtype: torch.dtype = torch.float32,
                  device: str = "cpu", adapter_dirs=()) -> torch.Tensor:
    """One forward of a Hugging Face checkpoint (transformers) or a neutral directory (parity's executor), with
    no capture or comparison: the yardstick a check's cost is measured against (bench/check.py)."""
    models = Models(adapter_dirs, stream=stream, device=device, candidate_device=device)
    with torch.no_grad():
        if candidate_kind(Path(path)) == "neutral":
            return models.neutral(Path(path), dtype)(ids)
        ckpt = open_checkpoint(Path(path), adapter_dirs)
        model = models.hf(ckpt, dtype)
        out = model(input_ids=ids.to(_first_device(model, device)))
        return out.logits if getattr(out, "logits", None) is not None else out[0]


def candidate_kind(path: Path) -> str:
    """A candidate's kind: one of parity.candidates' kinds, else a neutral directory or a Hugging Face checkpoint."""
    path = Path(path)
    found = candidates.detect(path)
    if found is not None:
        return found
    if (path / "manifest.json").exists():
        return "neutral"
    if (path / "config.json").exists():
        return "transformers"
    if not path.exists():
        raise ParityError(f"--candidate {path}: no such file or directory")
    raise ParityError(f"--candidate {path}: not a neutral directory (manifest.json), a Hugging Face checkpoint "
                      f"(config.json){''.join(', or ' + k for k in candidates.kinds())}")


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass
class Inputs:
    ids: torch.Tensor          # [1, S]
    source: str


def make_inputs(ckpt: Checkpoint, *, prompt: str | None = None, ids: list[int] | None = None,
                length: int | None = None) -> Inputs:
    vocab = next(t.shape[0] for t in ckpt.resolved.tensors if t.neutral == ("embed.tokens.weight",))
    given = [x is not None for x in (prompt, ids, length)]
    if sum(given) > 1:
        raise ParityError("give at most one of --prompt, --ids, --inputs, --length")
    if prompt is not None:
        token_ids = _tokenize(ckpt, prompt)
        source = f"prompt {prompt!r}"
    elif ids is not None:
        token_ids, source = list(ids), "ids"
    else:
        n = default_length(ckpt) if length is None else length
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParityError(f"--length must be at least 1 (got {n}); leave it out for the default prompt")
        check_length(ckpt, n)
        # a deterministic spread of ids, away from the few special tokens at the start of most vocabularies
        token_ids = [3 + (7919 * k + 17) % max(vocab - 3, 1) for k in range(n)]
        source = f"deterministic prompt of {n} tokens"
    bad = [i for i in token_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab]
    if not token_ids or bad:
        raise ParityError(f"token ids must be integers in [0, {vocab}); got {bad[:5] or 'none'}")
    check_length(ckpt, len(token_ids))
    return Inputs(torch.tensor([token_ids]), source)


def _available_memory() -> int | None:
    """Bytes of memory available to a new allocation (MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_length(ckpt: Checkpoint, n: int) -> None:
    """Refuse a prompt the model cannot take (past its positions) or this machine cannot hold: eager attention
    materialises [heads, n, n] scores, and a check runs it in float32 (float64 to calibrate)."""
    r = ckpt.resolved
    limit = r["positions.max_positions"]
    if limit and n > limit and r["positions.kind"] != "rope":  # a learned position table has no row past its end
        raise ParityError(f"a prompt of {n} tokens exceeds the model's {limit} learned positions "
                          f"(max_position_embeddings); use --length {limit} or less")
    heads = max(r.layer("attention.heads", i) for i in range(r.num_layers)) if r.num_layers else 1
    need = heads * n * n * 8 * 2  # scores and their softmax, in float64 when calibrating
    available = _available_memory()
    if available is not None and need > available:
        raise ParityError(f"a prompt of {n} tokens needs about {need / 2**30:.0f} GiB for eager attention's "
                          f"[{heads}, {n}, {n}] scores and this machine has {available / 2**30:.0f} GiB available; "
                          f"use a shorter --length")


def _tokenize(ckpt: Checkpoint, prompt: str) -> list[int]:
    file = ckpt.path / "tokenizer.json"
    if not file.exists():
        raise ParityError(f"{ckpt.path}: no tokenizer.json to tokenize --prompt; give --ids or --length")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file)).encode(prompt).ids


def read_inputs_file(path: Path) -> list[dict]:
    """A JSON list of prompts: strings, or lists of token ids."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ParityError(f"--inputs {path}: cannot read a JSON list of prompts ({exc})") from None
    if not isinstance(data, list) or not data:
        raise ParityError(f"--inputs {path}: expected a non-empty JSON list of strings or id lists")
    out = []
    for k, item in enumerate(data):
        if isinstance(item, str):
            out.append({"prompt": item})
        elif isinstance(item, list) and all(isinstance(i, int) for i in item):
            out.append({"ids": item})
        else:
            raise ParityError(f"--inputs {path}: item {k} is neither a string nor a list of token ids")
    return out


def select_inputs(ckpt: Checkpoint, *, prompt: str | None = None, ids: list[int] | None = None,
                  length: int | None = None, inputs_file: Path | None = None) -> list[Inputs]:
    """A check's inputs: each prompt of ``inputs_file``, or the one given (or the default prompt)."""
    prompts = read_inputs_file(inputs_file) if inputs_file else [{"prompt": prompt, "ids": ids, "length": length}]
    return [make_inputs(ckpt, prompt=p.get("prompt"), ids=p.get("ids"), length=p.get("length")) for p in prompts]


def _golden(reference: Path, adapter_dirs):
    """The golden at ``reference``, or None for a checkpoint directory."""
    from .golden import is_golden, open_golden

    return open_golden(reference, adapter_dirs) if is_golden(reference) else None


# --------------------------------------------------------------------------------------------
# The check


@dataclass(frozen=True)
class Span:
    """The layers [start, stop) of ``of`` that a check covers (--layers A:B); a slice starts from the
    reference's input to layer ``start`` and compares only its own points (embed with the first layer, the
    final points with the last)."""

    start: int
    stop: int
    of: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.of

    def holds(self, point: str) -> bool:
        layer = names.layer_of(point)
        if layer is not None:
            return self.start <= layer < self.stop
        return self.start == 0 if point == "embed" else self.stop == self.of

    def to_json(self) -> dict:
        return {"start": self.start, "stop": self.stop, "of": self.of}


def parse_layers(spec: str | None, num_layers: int) -> Span:
    """'A:B' (either side may be left out), checked against the model's layer count."""
    if spec is None:
        return Span(0, num_layers, num_layers)
    first, sep, last = str(spec).partition(":")
    try:
        start = int(first) if first.strip() else 0
        stop = int(last) if last.strip() else num_layers
    except ValueError:
        start = stop = -1
    if not sep or not 0 <= start < stop <= num_layers:
        raise ParityError(f"--layers {spec!r}: expected A:B with 0 <= A < B <= {num_layers} (the model's layers), "
                          f"e.g. --layers 0:{max(1, num_layers // 2)}")
    return Span(start, stop, num_layers)


def _forward_names(ckpt: Checkpoint, layerwise: bool, isolate: bool = False) -> list[str]:
    """The points a check compares: every one (--layerwise), else the final output; an isolated check also
    compares what each layer hands on (embed, layers.{i}.out), since fed the reference's inputs, a layer whose
    own output is not compared would not be tested at all."""
    points = [c.name for c in ckpt.resolved.capture]
    final = "logits" if "logits" in points else ("final_norm" if "final_norm" in points else points[-1])
    if layerwise:
        return points
    if isolate:
        stream = {"embed", final, *(f"layers.{i}.out" for i in range(ckpt.resolved.num_layers))}
        return [p for p in points if p in stream]
    return [final]


def check(reference: Path, candidate: Path, *, dtype: str = "float32", layerwise: bool = False,
          isolate: bool = False, calibrate: bool = False, tolerance: list[str] = (), prompt: str | None = None,
          ids: list[int] | None = None, length: int | None = None, inputs_file: Path | None = None,
          generate: int = 0, inject: str | None = None, diagnose: bool = True, checkpoint: Path | None = None,
          adapter_dirs=(), progress: Callable[[str], None] | None = None, provider: str | None = None,
          maps: list[str] | dict[str, str] = (), stream: bool | None = None, device: str = "cpu",
          candidate_device: str | None = None, on_layer: Callable[[str, int, int], None] | None = None,
          layers: str | None = None) -> Report:
    """Compare ``candidate`` against ``reference``; returns the report (truthy when parity holds).

    ``inject`` runs a neutral candidate with a catalogued porting mistake applied (parity bugs);
    ``diagnose`` names the likely mistake when parity fails. ``reference`` may be a golden (parity.golden):
    its stored activations replace the transformers run, and ``checkpoint`` must match its sha256s.
    ``provider`` (an onnxruntime execution provider) and ``maps`` ("POINT=VALUE": the graph value a
    capture point is read from) apply to ONNX candidates. With several inputs (``inputs_file``), each
    point keeps its worst result and the diagnosis looks at the input where the first divergence was seen.
    ``stream`` reads the models' weights a layer at a time (None: when they would not fit in memory);
    ``device`` runs the reference there ("cpu", "cuda", "cuda:N", "mps", "auto"), ``candidate_device`` the
    candidate (default: the same); ``on_layer(model, done, total)`` reports each model's progress.
    ``layers`` "A:B" checks only layers [A, B), starting from the reference's input to layer A (a golden's
    ``layers.{A-1}.out``); ``parity report merge`` joins the slices' reports.
    """
    from . import bugs

    # everything that can be refused is refused before a model is loaded
    if dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if isinstance(generate, bool) or not isinstance(generate, int) or generate < 0:
        raise ParityError(f"--generate must be a number of tokens >= 0 (got {generate!r})")
    tolerances = Tolerances(dtype, list(tolerance))
    if inject:
        bugs.get(inject)
    golden = _golden(Path(reference), adapter_dirs)
    if golden is not None:
        golden.check_options(dtype=dtype, calibrate=calibrate, isolate=isolate, generate=generate)
        if checkpoint is not None:
            golden.match(Path(checkpoint), adapter_dirs)
        ckpt, calibrate = golden.checkpoint, golden.calibrated_for(dtype, isolated=isolate)
        all_inputs = golden.inputs(prompt=prompt, ids=ids, length=length, inputs_file=inputs_file)
    else:
        if checkpoint is not None:
            raise ParityError("--checkpoint goes with a golden --reference: it checks the golden was recorded from it")
        ckpt = open_checkpoint(Path(reference), adapter_dirs)
        if not ckpt.has_weights:
            raise ParityError(f"--reference {reference}: no weights; give a Hugging Face checkpoint directory")
        all_inputs = select_inputs(ckpt, prompt=prompt, ids=ids, length=length, inputs_file=inputs_file)
    kind = candidate_kind(Path(candidate))
    device = resolve_device(device)
    candidate_device = resolve_device(candidate_device) if candidate_device else device
    if candidate_device == "auto":  # spreading over GPUs is for transformers models; the executor takes one
        candidate_device = resolve_device("cuda") if device_count() else "cpu"
    if inject and kind != "neutral":
        raise ParityError(f"--inject needs a neutral candidate (the executor runs the mistake); {candidate} is {kind}")
    if isolate and not getattr(candidates.get(kind), "isolates", True):  # neutral and transformers can be fed
        raise ParityError(f"--isolate: a {kind} candidate ({candidate}) cannot be fed the reference's layer inputs; "
                          f"drop --isolate")
    span = parse_layers(layers, ckpt.resolved.num_layers)
    if not span.whole:
        _check_span(span, ckpt, golden, kind, generate, Path(candidate))
    if golden is None:
        _refuse_mismatched(ckpt, "--reference")
    if kind == "transformers":  # a candidate of an unknown family, or with wrong tensors, is refused now, not later
        _refuse_mismatched(open_checkpoint(Path(candidate), adapter_dirs), "--candidate")
    report = Report(family=ckpt.resolved.family,
                    reference=golden.describe() if golden else {"kind": "transformers", "path": str(reference)},
                    candidate={"kind": kind, "path": str(candidate)}, dtype=dtype,
                    mode="isolated" if isolate else "free", layerwise=layerwise, calibrated=calibrate)
    if not span.whole:
        report.layers = span.to_json()
    runs = []
    if stream is None:
        stream = golden is None and would_not_fit(ckpt, Path(candidate), kind, dtype, calibrate, device,
                                                  candidate_device)
        if stream and progress:
            progress("the models do not fit in memory: streaming their weights a layer at a time")
    _describe_quantization(report, ckpt, golden, kind, Path(candidate), stream)
    models = Models(adapter_dirs, stream=stream, device=device, candidate_device=candidate_device)
    models.options = _candidate_options(kind, provider, maps, layerwise)
    kept_by_run: dict[int, dict] = {}  # the tensors a diagnosis needs, for each input that failed
    for k, inputs in enumerate(all_inputs):
        seen, warnings = exercised(ckpt, inputs.ids.shape[1])
        report.warnings += [w for w in warnings if w not in report.warnings]
        kept: dict = {"ids": inputs.ids}
        results, logits = _check_once(models, ckpt, Path(candidate), kind, inputs.ids, dtype, layerwise, isolate,
                                      calibrate, tolerances, progress, inject, kept, golden, k, on_layer, span,
                                      done_with_reference=k == len(all_inputs) - 1 and not generate)
        failing = [p for p in results if p.compared and not p.passed]
        for p in results:
            p.run = k
        runs.append({"source": inputs.source, "ids": inputs.ids[0].tolist(), "exercised": seen,
                     "verdict": "fail" if failing or not any(p.compared for p in results) else "pass",
                     "first_divergence": failing[0].name if failing else None})
        if failing:
            kept_by_run[k] = kept
        _merge(report, results, logits)
    report.inputs = {"runs": runs}
    report.matching = models.notes.get("matching")
    report.warnings += [w for w in models.notes.get("warnings", []) if w not in report.warnings]
    # against a golden, the diagnosis needs the checkpoint's weights: --checkpoint
    source = Path(reference) if golden is None else checkpoint and Path(checkpoint)
    first = report.first_divergence
    kept = kept_by_run.get(first.run, {}) if first is not None else {}
    if diagnose and not source and not report:
        report.warnings.append("no diagnosis: naming the likely mistake needs the weights; pass --checkpoint DIR")
    if diagnose and source and first is not None and first.name in kept.get("candidate", {}):
        from .diagnose import diagnose as name_the_bug

        if progress:
            progress("diagnosing")
        report.diagnosis = name_the_bug(source, first.name, first.tolerance.rel_l2, kept["candidate"],
                                        kept["reference"], kept["ids"], DTYPES[dtype], adapter_dirs=adapter_dirs,
                                        layer_input=kept.get("layer_input"))
    if generate:
        if report.logits is None and "logits" not in {p.name for p in report.points}:
            raise ParityError("--generate needs a model with an LM head")
        gen = _compare_generation(models, ckpt, Path(candidate), kind, all_inputs[0].ids, DTYPES[dtype], generate,
                                  inject)
        report.generation = gen
        if report.logits is not None:
            report.logits["generate"] = gen
        if gen["first_difference"] is not None:
            report.warnings.append(f"greedy generation differs from token {gen['first_difference']} of {generate}")
    return report


def check_same_weights(reference: Path, candidate: Path, *, adapter_dirs=(), **options) -> Report:
    """``check`` with the reference built from the candidate's own weights (dequantized; --same-weights), loaded
    into transformers' model of the reference's family: a quantized candidate is then judged on its compute and
    conventions, not on its quantization."""
    import tempfile

    kind = candidate_kind(Path(candidate))
    build = getattr(candidates.get(kind), "same_weights", None)
    if build is None:
        raise ParityError(f"--same-weights reads the candidate's weights back; a {kind} candidate ({candidate}) "
                          f"cannot give them (GGUF files can)")
    if _golden(Path(reference), adapter_dirs) is not None:
        raise ParityError("--same-weights needs a Hugging Face --reference (its config and model class); a golden "
                          "holds activations, not a model")
    ckpt = open_checkpoint(Path(reference), adapter_dirs)
    with tempfile.TemporaryDirectory(prefix="parity-same-weights-") as tmp:
        held = build(ckpt, Path(candidate), Path(tmp))
        report = check(Path(tmp), candidate, adapter_dirs=adapter_dirs, **options)
    report.reference = {"kind": "transformers", "path": str(reference), "same_weights": held}
    return report


def _check_span(span: Span, ckpt: Checkpoint, golden, kind: str, generate: int, candidate: Path) -> None:
    """A slice runs from the reference's input to its first layer: refuse what cannot give one."""
    if generate:
        raise ParityError("--generate needs the whole model; drop --layers")
    entry = "embed" if span.start == 0 else f"layers.{span.start - 1}.out"
    if golden is not None and span.start > 0 and entry not in golden.points:
        raise ParityError(f"--layers {span.start}:{span.stop}: the golden does not hold {entry}, the input of layer "
                          f"{span.start}; record it with --points all or --points layers")
    if kind == "neutral":
        from .neutral import read_manifest

        for i, layer in enumerate(read_manifest(candidate)["layers"][span.start:span.stop], span.start):
            source = layer["attention"].get("kv_shared_from")
            if source is not None and source < span.start:
                raise ParityError(f"--layers {span.start}:{span.stop}: layer {i} reuses the keys and values of "
                                  f"layer {source}; start the slice at {source} or earlier")


def _describe_quantization(report: Report, ckpt: Checkpoint, golden, kind: str, candidate: Path, stream: bool) -> None:
    """An FP8 block-quantized reference runs on its dequantized weights (float32): the report says so, and what a
    converted candidate's dequantization at its dtype cost (rel_l2 against the float32 dequantization)."""
    if golden is None and ckpt.quantization is not None:
        report.reference["quantization"] = {**ckpt.quantization.to_json(), "dequantized_to": "float32",
                                            "dequantized_by": "parity, a layer at a time" if stream else "transformers"}
    if kind == "neutral":
        from .neutral import read_manifest

        q = read_manifest(candidate)["source"].get("quantization")
        if q is not None:
            report.candidate["quantization"] = q


def _refuse_mismatched(ckpt: Checkpoint, role: str) -> None:
    """A checkpoint whose tensors are missing or misshapen for its config: transformers would crash on it, or
    initialise the missing weights at random and give a verdict about noise."""
    from .checkpoint import check_tensors

    found = ckpt.check()
    if found.missing or found.wrong_shape:
        problems = "; ".join(f"{label} ({len(items)}): {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                             for label, items in (("missing", found.missing), ("wrong shape", found.wrong_shape))
                             if items)
        raise ParityError(f"{role} {ckpt.path}: tensors do not match its config ({ckpt.resolved.family}): {problems}; "
                          f"check that config.json belongs to these weights")


def _candidate_options(kind: str, provider: str | None, maps, layerwise: bool) -> dict:
    """--provider and --map (ONNX candidates only), checked and parsed."""
    if isinstance(maps, dict):
        maps = [f"{k}={v}" for k, v in maps.items()]
    if (provider or maps) and kind != "onnx":
        raise ParityError(f"--provider and --map apply to ONNX candidates; this candidate is {kind}")
    parsed: dict[str, str] = {}
    for item in maps:
        point, sep, value = item.partition("=")
        if not sep or not point.strip() or not value.strip():
            raise ParityError(f"--map {item!r}: expected POINT=VALUE, e.g. layers.0.out=/model/layers.0/Add_1_output_0")
        parsed[point.strip()] = value.strip()
    return {"provider": provider, "map": parsed, "layerwise": layerwise}


def _compare_generation(models: Models, ckpt: Checkpoint, candidate: Path, kind: str, ids: torch.Tensor,
                        dtype: torch.dtype, n: int, inject: str | None = None) -> dict:
    """Greedy-decode n tokens with both models (no cache: each step re-runs the whole sequence). The candidate
    is the one the check compared, injected mistake included."""
    def greedy(step: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
        seq = ids
        for _ in range(n):
            nxt = step(seq)[0, -1].float().argmax().item()
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        return seq[0, ids.shape[1]:].tolist()

    check_length(ckpt, ids.shape[1] + n)
    reference_model = models.hf(ckpt, torch.float32)
    with torch.no_grad():
        reference = greedy(lambda seq: reference_model(input_ids=seq).logits)
        if kind == "neutral":
            cand_model = models.neutral(candidate, dtype, inject)
            produced = greedy(lambda seq: cand_model(seq))
        elif candidates.get(kind) is not None:  # a candidate kind: its run's logits point
            produced = greedy(lambda seq: _plugin_logits(models, ckpt, candidate, kind, seq, dtype))
        else:
            hf = models.hf(open_checkpoint(candidate, models.adapter_dirs), dtype, "candidate")
            produced = greedy(lambda seq: hf(input_ids=seq).logits)
    first = next((k for k, (a, b) in enumerate(zip(reference, produced)) if a != b), None)
    return {"tokens": n, "reference": reference, "candidate": produced, "first_difference": first}


def _plugin_logits(models: Models, ckpt: Checkpoint, candidate: Path, kind: str, ids: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    got: dict[str, torch.Tensor] = {}
    candidates.get(kind).make_runner(models, candidate, dtype, ids, None, ckpt)(lambda name, t: got.setdefault(name, t))
    if "logits" not in got:
        raise ParityError(f"--generate: the {kind} candidate {candidate} gives no logits")
    return got["logits"]


def _severity(p: PointResult) -> tuple[int, float]:
    """How bad a point's result is: failing beats passing beats not compared; then rel_l2 / tolerance."""
    if not p.compared:
        return (0, 0.0)
    ratio = p.rel_l2 / p.tolerance.rel_l2 if p.tolerance.rel_l2 > 0 else float("inf")
    if p.nonfinite or ratio != ratio:  # NaN, Inf, shape: as bad as it gets
        ratio = float("inf")
    return (1 if p.passed else 2, ratio)


# several inputs: the worst of each logit metric
_WORST_LOGITS = {"kl_mean": max, "kl_max": max, "max_logit_diff": max, "top1_agreement": min, "top5_overlap": min,
                 "allclose_1e-5": min, "next_token_agrees": min, "positions": lambda a, b: a + b}


def _merge(report: Report, results: list[PointResult], logits: dict | None) -> None:
    """Several inputs: each point keeps its worst result (a failure is never replaced by a pass)."""
    if not report.points:
        report.points, report.logits = results, logits
        return
    worst = {p.name: p for p in report.points}
    for p in results:
        if p.name not in worst or _severity(p) > _severity(worst[p.name]):
            worst[p.name] = p
    report.points = sorted(worst.values(), key=lambda p: names.point_order(p.name))
    if logits and report.logits:
        report.logits = {k: _WORST_LOGITS[k](report.logits[k], logits[k]) if k in _WORST_LOGITS else report.logits[k]
                         for k in report.logits}
    elif logits or report.logits:  # one input's logits could not be compared: no summary stands for all
        report.logits = None


def layer_inputs(num_layers: int) -> dict[str, int]:
    """The points that are a layer's input: `embed` feeds layer 0, `layers.{i}.out` feeds layer i + 1 (the head
    after the last); point -> the index isolation feeds it to."""
    return {"embed": 0, **{f"layers.{i}.out": i + 1 for i in range(num_layers)}}


class LayerInputs:
    """The reference's input to each layer, handed from the comparing thread to an isolated calibration run in
    its own thread (which waits for each one). ``close`` releases a waiting run when the check stops early."""

    def __init__(self):
        self.values: dict[int, torch.Tensor] = {}
        self.closed = False
        self.ready = threading.Condition()

    def put(self, i: int, x: torch.Tensor) -> None:
        with self.ready:
            self.values[i] = x
            self.ready.notify_all()

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()

    def feed(self, i: int, x: torch.Tensor) -> torch.Tensor:
        with self.ready:
            self.ready.wait_for(lambda: i in self.values or self.closed)
            ref = self.values.pop(i, None)
        return x if ref is None else ref.to(x.device, x.dtype)


def _points_fit(ckpt: Checkpoint, ids: torch.Tensor, points: set[str], device: str) -> bool:
    """Whether the reference's float32 points (the logits [positions, vocabulary] included) take under a tenth of
    the memory free where it runs."""
    vocab, hidden = next(t.shape for t in ckpt.resolved.tensors if t.neutral == ("embed.tokens.weight",))
    nbytes = ids.numel() * 4 * sum(vocab if p == "logits" else hidden for p in points)
    free = _memory(device)
    return free is None or nbytes < 0.1 * free


def _check_once(models: Models, ckpt: Checkpoint, candidate: Path, kind: str, ids: torch.Tensor, dtype: str, layerwise: bool,
                isolate: bool, calibrate: bool, tolerances: Tolerances, progress: Callable[[str], None] | None,
                inject: str | None = None, kept: dict | None = None, golden=None,
                run_index: int = 0, on_layer: Callable[[str, int, int], None] | None = None,
                span: Span | None = None, done_with_reference: bool = False) -> tuple[list[PointResult], dict | None]:
    """One prompt. ``kept`` (when given) receives the two sides' tensors at the first failing point and
    the final output, for the diagnosis. With a ``golden``, its run ``run_index`` is the reference.
    ``done_with_reference``: no later prompt runs the reference, so a whole one is dropped once it has run."""
    say = progress or (lambda message: None)
    low = DTYPES[dtype]
    n_layers = ckpt.resolved.num_layers
    span = span or Span(0, n_layers, n_layers)
    # a slice compares what each of its layers hands on, like an isolated check: its layers are all it tests
    wanted = [p for p in _forward_names(ckpt, layerwise, isolate or not span.whole) if span.holds(p)]
    input_of = layer_inputs(n_layers)
    # the layers fed the reference's input: every one when isolating, else a slice's first (when the candidate
    # can be fed: a dump or a graph runs from its own start)
    feedable = getattr(candidates.get(kind), "isolates", True)
    feeding = set(range(n_layers + 1)) if isolate else ({span.start} if span.start > 0 and feedable else set())
    entry = next((p for p, i in input_of.items() if i == span.start), None) if span.start > 0 else None
    noise_inputs = LayerInputs() if feeding else None
    # each stream emits only what is compared (and what feeds a layer): nothing else is held
    needed = set(wanted) | {p for p, i in input_of.items() if i in feeding}
    last = span.stop - 1 if span.stop < n_layers else None  # the models stop after the slice

    def layer_done(label: str) -> Callable[[int], None] | None:
        return None if on_layer is None else (lambda i: on_layer(label, i + 1, n_layers))
    # the reference at float32 is the truth; calibration adds the reference at the candidate's dtype
    # (or float64 for a float32 check): their distance is each point's own precision noise. An isolated
    # check calibrates in isolation too: the noisy reference's layers are fed the float32 reference's inputs,
    # so each point's noise is one layer's, not the noise accumulated over the layers before it.
    # held whole, the models run one after the other when the reference's points fit beside them: side by side
    # they would share the same cores, each op already spread over all of them, and pay for it; streamed (or
    # with points too many to hold), they run in step, so that few points are held at a time
    ahead = not models.stream and golden is None and _points_fit(ckpt, ids, needed, models.device["reference"])
    if golden is not None:  # stored activations (and noise), in place of transformers
        wanted = [n for n in wanted if n in golden.points]
        streams = {"reference": Stream(only(golden.runner(run_index), needed), "golden")}
    else:
        say("loading the reference")
        streams = {"reference": Stream(hf_runner(models, ckpt, torch.float32, ids, points=needed,
                                                 on_layer=layer_done("reference"), last=last), "reference",
                                       bound=0 if ahead else 4)}
    if calibrate and golden is None:
        other = torch.float64 if low == torch.float32 else low
        say(f"loading the reference at {str(other).removeprefix('torch.')} for calibration")
        feed_noise = (lambda i, x: noise_inputs.feed(i, x) if i in feeding else x) if noise_inputs else None
        streams["noise"] = Stream(hf_runner(models, ckpt, other, ids, feed_noise, "calibration", points=needed,
                                            on_layer=layer_done("calibration"), last=last),
                                  "reference (calibration)")

    last_reference_out: dict[int, torch.Tensor] = {}
    results: list[PointResult] = []
    logits: dict | None = None
    wanted_set = set(wanted)

    def feed(i: int, x: torch.Tensor) -> torch.Tensor:
        if i not in feeding:
            return x
        ref = last_reference_out.pop(i, None)
        if ref is None and i == span.start and entry is not None:  # the candidate skipped the layers before
            ref = streams["reference"].get(entry)
            if noise_inputs is not None and ref is not None:
                noise_inputs.put(i, ref)
        return x if ref is None else ref.to(x.device, x.dtype)

    candidate_done = layer_done("candidate")
    reference_input: dict[int, torch.Tensor] = {}  # the reference's input to the layer being compared

    def on_point(name: str, got: torch.Tensor) -> None:
        nonlocal logits
        if candidate_done is not None and input_of.get(name, 0) > 0:  # layers.{i}.out: layer i is done
            candidate_done(input_of[name] - 1)
        if name not in needed:
            return
        ref = streams["reference"].get(name)
        noisy = streams["noise"].get(name) if "noise" in streams else None
        if ref is None:
            return
        if ref.device != got.device:  # models on different devices are compared where the candidate is
            ref = ref.to(got.device)
            noisy = None if noisy is None else noisy.to(got.device)
        if input_of.get(name) in feeding:
            last_reference_out[input_of[name]] = ref
            noise_inputs.put(input_of[name], ref)
        if name not in wanted_set:
            return
        if golden is None:
            noise, rounding = (metrics(noisy, ref)["rel_l2"] if noisy is not None else None), 0.0
        else:
            noise, rounding = golden.noise(run_index, name, dtype, isolated=isolate), golden.rounding(run_index, name)
        # a golden's storage rounding is part of this comparison's noise
        result = judge(name, metrics(got, ref), tolerances.for_point(name, noise, rounding),
                       noise if noise is None else max(noise, rounding))
        results.append(result)
        first_failure = not result.passed and not any(not p.passed for p in results[:-1])
        if kept is not None and (name in ("logits", "final_norm") or first_failure):
            kept.setdefault("candidate", {})[name] = got.detach().to("cpu", copy=True)
            kept.setdefault("reference", {})[name] = ref.detach().to("cpu", copy=True)
        if kept is not None and first_failure and names.layer_of(name) in reference_input:
            # the diagnosis re-runs only this layer, from the reference's input to it
            kept["layer_input"] = reference_input[names.layer_of(name)].detach().to("cpu", copy=True)
        if input_of.get(name) is not None:  # only the latest layer input is held
            reference_input.clear()
            reference_input[input_of[name]] = ref
        if name == "logits":
            logits = logit_metrics(got, ref)
        if name.endswith(".out"):
            say(f"compared {name}")

    if ahead:
        streams["reference"].thread.join()
        if done_with_reference:  # the candidate is loaded into the memory the reference held
            models.release("reference")
    say(f"running the candidate ({kind})")
    try:  # the reference streams are running: whatever happens, let them finish
        fed = feed if feeding else None
        if candidates.get(kind) is not None:
            run = candidates.get(kind).make_runner(models, candidate, low, ids, fed, ckpt)
        elif kind == "neutral":
            run = neutral_runner(models, candidate, low, ids, fed, inject, range(span.start, span.stop))
        else:
            run = hf_runner(models, open_checkpoint(candidate, models.adapter_dirs), low, ids, fed, "candidate",
                            last=last)
        run(on_point)
    finally:
        if noise_inputs is not None:
            noise_inputs.close()
        for s in streams.values():
            s.drain()
    produced = {p.name for p in results}
    for name in wanted:
        if name not in produced:
            results.append(PointResult(name=name, max_abs=float("nan"), mean_abs=float("nan"), rel_l2=float("nan"),
                                       cosine=float("nan"), tolerance=tolerances.for_point(name), passed=False,
                                       compared=False))
    results.sort(key=lambda p: names.point_order(p.name))
    return results, logits
