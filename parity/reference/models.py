"""Models as streams of capture points: transformers checkpoints loaded for a role (reference, calibration,
candidate), run in a background thread that hands each capture point over as it is produced, and the memory
and devices they run on. The sides of a check (parity.checker.sides) and candidate kinds (parity.candidates) run
through here; the check compares what they emit.
"""

from __future__ import annotations

import functools
import gc
import inspect
import queue
import threading
import weakref
from contextlib import nullcontext
from typing import Callable

import torch

from parity.checkpoint import Checkpoint
from parity.checkpoint.inputs import available_memory, trim_heap
from parity.errors import ParityError
from parity.reference.capture import hooks, input_value, with_input
from parity.storage import lazy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Emit = Callable[[str, torch.Tensor], None]
# (layer index, its input) -> the input to use; or (a point inside a layer that is a module's input, fed_points)
Feed = Callable[[int | str, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------------------------
# Models as streams of capture points


class _Done:
    pass


class _Stopped(Exception):
    """Raised inside a stream's thread once its consumer has stopped it: the model's forward ends there."""


class Stream:
    """A model run in a background thread; ``get(name)`` waits for that capture point. ``stop()`` ends the run at
    its next capture point (a check that is done with it, failed, or was interrupted does not wait for it)."""

    def __init__(self, run: Callable[[Emit], None], label: str, bound: int = 4):
        self.label = label
        self.items: queue.Queue = queue.Queue(maxsize=bound)  # 0: unbounded, the model runs ahead
        self.buffer: dict[str, torch.Tensor] = {}
        self.finished = False
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, args=(run,), daemon=True)
        self.thread.start()

    def _emit(self, name: str, t: torch.Tensor) -> None:
        while True:  # a full queue is waited on in slices, so that a stop is seen
            if self.stopping.is_set():
                raise _Stopped
            try:
                self.items.put((name, t.detach()), timeout=0.1)
                return
            except queue.Full:
                continue

    def _main(self, run: Callable[[Emit], None]) -> None:
        try:
            with torch.no_grad():
                run(self._emit)
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
            self.error = exc
        finally:
            while True:  # the consumer drains the queue (or it is unbounded), unless it has left without waiting
                try:
                    self.items.put(_Done, timeout=0.1)
                    break
                except queue.Full:
                    if self.stopping.is_set():
                        break

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

    def wait(self) -> None:
        """Until the run has ended (a model that runs ahead), raising its error."""
        self.thread.join()
        while not self.finished:
            self.get("\0")

    def stop(self, wait: bool = True) -> None:
        """End the run at its next capture point and let go of what it produced; its errors are not raised.
        ``wait=False`` (an error or Ctrl-C in the consumer) returns at once: the thread ends on its own, and a
        process that is exiting does not wait for a layer to finish."""
        self.stopping.set()
        while wait and not self.finished:
            item = self.items.get()
            self.finished = item is _Done
        self.buffer.clear()


def _load_hf(ckpt: Checkpoint, dtype: torch.dtype, stream: bool = False, device: str = "cpu", attn: str = "eager",
             compile: bool = False):
    """transformers' model for the checkpoint: whole (``from_pretrained``), or streamed a layer at a time
    (parity.storage.lazy). ``device`` "auto" with several GPUs spreads a whole model over them (accelerate's
    device_map). ``attn``: transformers' attention implementation (a candidate's kernel; the reference is eager);
    ``compile``: what runs between capture points is compiled (compile_between_points)."""
    import transformers  # heavy: transformers

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
            model = lazy.streamed_hf(cls, ckpt, dtype, device, **extra)
            if attn != "eager":
                model.set_attn_implementation(attn)
        else:
            place = {} if device == "cpu" else {"device_map": device}
            # a model no adapter knows is read with its model_type's config class, as AutoModelForCausalLM and
            # streamed_hf read it: the class it is built with may be borrowed, and the borrowed class's config class
            # not know its keys (EXAONE's num_layers is ExaoneConfig's alias, not LlamaConfig's)
            read = {"config": transformers.AutoConfig.from_pretrained(ckpt.path)} if ckpt.resolved.generic else {}
            model, loading = cls.from_pretrained(ckpt.path, attn_implementation=attn, dtype=dtype, **place, **read,
                                                 **extra, output_loading_info=True)
            model.eval()
            _refuse_missing(ckpt, loading)
    except (MemoryError, ParityError):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a damaged checkpoint
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        if "allocate" in text:  # the CPU allocator's out-of-memory error: the CLI says so
            raise
        if attn != "eager":  # e.g. a kernel this architecture does not support, or one not installed here
            raise ParityError(f"{ckpt.path}: transformers {transformers.__version__} cannot run {architecture} with "
                              f"attn_implementation={attn!r} ({type(exc).__name__}: {text[:200]}); choose another "
                              f"--candidate-attn") from None
        raise ParityError(f"{ckpt.path}: transformers could not load it as {architecture} ({type(exc).__name__}: "
                          f"{text[:200]}); check that its config and weights belong together") from None
    if compile:
        compile_between_points(model, {c.module for c in ckpt.resolved.capture}, ckpt.resolved.num_layers)
    return model


def _refuse_missing(ckpt: Checkpoint, loading: dict) -> None:
    """A model no adapter knows has no tensor map to check its weights against before it loads (an adapter's is
    checked by refuse_mismatched): a weight transformers did not find would be initialised at random, and the
    verdict would be about noise."""
    missing = sorted(loading.get("missing_keys") or [])
    if ckpt.resolved.generic and missing:
        listed = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ParityError(f"{ckpt.path}: transformers found no weights for {len(missing)} parameter(s) of "
                          f"{ckpt.variant.architectures[0]} ({listed}); check that config.json belongs to these "
                          f"weights")


def compile_between_points(model, hooked: set[str], layers: int) -> list[str]:
    """torch.compile each module holding no capture point inside it (attention, MLP, norms, ...), the largest such:
    a compiled region runs hooks as traced code (a hook handing a tensor to another thread breaks the graph, each
    hook's closure recompiles the frame), so the hooks stay outside it, on the modules whose forward is compiled.
    What runs between those modules (a residual add) stays eager. Returns the paths compiled."""
    inside = {""}  # modules with a hooked module strictly below them
    for path in hooked:
        parts = path.split(".") if path else []
        inside.update(".".join(parts[:k]) for k in range(len(parts)))
    compiled = []
    for path, module in model.named_modules():
        parent = path.rpartition(".")[0]
        if path in inside or parent not in inside or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        if not any(True for _ in module.parameters()) and not any(True for _ in module.buffers()):
            continue  # dropout, activations: nothing to fuse that is not in a compiled neighbour
        module.forward = _compiled(module.forward, layers)
        compiled.append(path)
    return compiled


def _compiled(forward, layers: int):
    """``forward`` under torch.compile. Each layer's module compiles its own variant (its layer index, its kind of
    attention are guarded constants; decode steps add a dynamic shape): dynamo's limit of 8 would leave every layer
    past the eighth running eagerly, silently, so the limit is raised for these calls, and hitting it raises."""
    compiled = torch.compile(forward)

    @functools.wraps(forward)  # its signature: capture hooks find their argument by name
    def run(*args, **kwargs):
        with compile_limits(layers):
            return compiled(*args, **kwargs)

    return run


def compile_limits(layers: int):
    """A context raising dynamo's recompile limit to what a model of ``layers`` layers compiles (a variant per
    layer, and per shape when decoding; transformers' flex_attention compiles one per mask), where hitting it
    raises instead of running the rest eagerly, unsaid."""
    import torch._dynamo  # heavy: torch._dynamo

    limit = 4 * layers + 8
    return torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, 4 * limit),
                                      fail_on_recompile_limit_hit=True)


def _isolation_hooks(model, ckpt: Checkpoint, feed: Feed) -> list:
    """Pre-hooks that replace each layer's input (and the head's) by ``feed(i, input)``."""
    r = ckpt.resolved
    by_name = {c.name: c for c in r.capture}
    targets = [(i, by_name[f"layers.{i}.out"].module) for i in range(r.num_layers)]
    after = next((by_name[n] for n in ("final_norm", "logits") if n in by_name), None)
    if after is not None and after.module:  # the model itself ("") takes token ids, not a layer's output
        targets.append((r.num_layers, after.module))
    handles = []
    for i, path in targets:
        module = model.get_submodule(path)

        def pre(mod, args, kwargs, i=i):
            x = input_value(mod, 0, args, kwargs)
            new = feed(i, x)
            if args:
                return (new, *args[1:]), kwargs
            key = next(iter(kwargs))
            return args, {**kwargs, key: new}

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    return handles + _sublayer_hooks(model, ckpt, feed)


def fed_points(ckpt: Checkpoint) -> list[str]:
    """The points inside a layer that a reference following its candidate is fed too (Plan.follows): each
    MLP's input, where the adapter reads it as the MLP module's input, so that the MLP restarts from the
    candidate's input as each layer does (the attention before it, in the same layer, cannot cascade into it)."""
    return [c.name for c in ckpt.resolved.capture if c.name.endswith(".mlp_in") and c.io == "input"]


def _sublayer_hooks(model, ckpt: Checkpoint, feed: Feed) -> list:
    """Pre-hooks that replace each fed point's module input by ``feed(point, input)``: registered after the
    capture hooks, so the point is reported as the model computed it, then replaced."""
    handles, fed = [], set(fed_points(ckpt))
    for c in ckpt.resolved.capture:
        if c.name not in fed:
            continue

        def pre(mod, args, kwargs, c=c):
            return with_input(mod, c.arg, args, kwargs, feed(c.name, input_value(mod, c.arg, args, kwargs)))

        handles.append(model.get_submodule(c.module).register_forward_pre_hook(pre, with_kwargs=True))
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
            raise ParityError("--device mps: this machine has no MPS device; use --device cpu")
        return "mps"
    raise ParityError(f"--device {spec!r} is not one of cpu, cuda, cuda:N, mps, auto")


def free_memory(device: str) -> int | None:
    """Bytes free where a model would be placed: MemAvailable for the CPU, free memory of the GPU(s)."""
    if device == "cpu" or device == "mps":
        return available_memory()
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

def would_not_fit(ckpt: Checkpoint, dtype: str, calibrate: bool, device: str, candidate_shapes=(),
                  candidate_device: str = "cpu") -> bool:
    """Whether the models of a check, held whole, would take more than 80% of the memory free for them: the
    float32 reference, the calibration reference, and the candidate at its dtype when parity runs it itself
    (``candidate_shapes``: its weights' shapes)."""
    params = _elements(info.shape for info in ckpt.tensors.values())
    need = {device: params * 4}
    if calibrate:
        need[device] += params * (8 if dtype == "float32" else DTYPES[dtype].itemsize)
    if candidate_shapes:
        need[candidate_device] = need.get(candidate_device, 0) + _elements(candidate_shapes) * DTYPES[dtype].itemsize
    for where, nbytes in need.items():
        free = free_memory(where)
        if free is not None and nbytes > 0.8 * free:
            return True
    return False


class Models:
    """Loaded models, reused across the prompts of one check."""

    def __init__(self, adapter_dirs=(), *, stream: bool = False, device: str = "cpu", candidate_device: str = "cpu"):
        self.adapter_dirs = tuple(adapter_dirs)  # --adapters: every checkpoint of the check is read with them
        self.stream = stream                     # weights read a layer at a time (parity.storage.lazy)
        self.device = {"reference": device, "calibration": device, "calibration (isolated)": device,
                       "candidate": candidate_device}
        self.loaded: dict = {}   # (kind, path, dtype, ...) -> a loaded model; candidate kinds cache theirs here too

    def hf(self, ckpt: Checkpoint, dtype: torch.dtype, role: str = "reference", attn: str = "eager",
           compile: bool = False):
        # one instance per role: the reference runs in another thread with its own hooks, so a
        # candidate that is the same checkpoint must not share its modules; the kernel is in the key, so a
        # candidate's sdpa never reaches the (eager) reference
        key = ("hf", str(ckpt.path), dtype, role, attn, compile)
        if key not in self.loaded:
            self.loaded[key] = _load_hf(ckpt, dtype, self.stream, self.device.get(role, self.device["reference"]),
                                        attn, compile)
        return self.loaded[key]

    def release(self, role: str) -> None:
        """Drop the transformers model of ``role``: a later use loads it again. Its memory goes at once (collected
        only if something still refers to it: a full collection takes a fifth of a second), and so does the heap
        memory its forwards freed."""
        keys = [key for key in self.loaded if key[0] == "hf" and key[3] == role]
        dropped = [weakref.ref(self.loaded.pop(key)) for key in keys]
        if any(model() is not None for model in dropped):
            gc.collect()
        trim_heap()


def hf_runner(models: Models, ckpt: Checkpoint, dtype: torch.dtype, ids: torch.Tensor, feed: Feed | None = None,
              role: str = "reference", points: set[str] | None = None, on_layer: Callable[[int], None] | None = None,
              last: int | None = None, arithmetic=None, attn: str = "eager", compile: bool = False):
    """A function that runs a transformers checkpoint and emits its capture points (only ``points``, when
    given: nothing else is hooked, so nothing else is held; operation-level points among them are read from the
    adapter's [ops], and are absent from a layer that lacks them). ``on_layer(i)`` is told when layer i is done;
    with ``last``, the forward stops after that layer (a slice of a check needs nothing beyond it);
    ``arithmetic`` (parity.engines.arithmetic: an engine's): computed as that engine computes; ``attn``,
    ``compile``: the attention kernel and torch.compile (Models.hf)."""
    model = models.hf(ckpt, dtype, role, attn, compile)
    capture = [c for c in ckpt.resolved.capture if points is None or c.name in points]
    op_points = wanted_ops(ckpt, points)
    layer_paths = {c.name: c.module for c in ckpt.resolved.capture}
    device = models.device.get(role, models.device["reference"])

    def run(emit: Emit) -> None:
        # capture hooks first: a layer's input is reported as computed, then replaced when isolating; ops after the
        # engine's hooks, so that an op read at an output includes what the engine adds there
        engine = arithmetic.emulate(model) if arithmetic is not None else nullcontext()
        limits = compile_limits(ckpt.resolved.num_layers) if attn != "eager" or compile else nullcontext()
        with hooks(model, capture, emit), engine, hooks(model, op_points, emit), limits, torch.no_grad():
            handles = _isolation_hooks(model, ckpt, feed) if feed is not None else []
            if on_layer is not None:
                for i in range(ckpt.resolved.num_layers):
                    module = model.get_submodule(layer_paths[f"layers.{i}.out"])
                    handles.append(module.register_forward_hook(lambda *_, i=i: on_layer(i)))
            if last is not None:
                module = model.get_submodule(layer_paths[f"layers.{last}.out"])
                handles.append(module.register_forward_hook(_stop))
            try:
                model(input_ids=ids.to(first_device(model, device)))
            except _Enough:
                pass
            finally:
                for h in handles:
                    h.remove()

    return run


def cached_forward(model, ids: torch.Tensor, cache=None):
    """One forward of a transformers causal LM that keeps its KV cache: (output, the cache to pass next time).
    transformers 5.24 names the cache ``cache``; earlier releases ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **({} if cache is None else {name: cache}))
    return out, getattr(out, name, None)


def hf_decoder(models: Models, ckpt: Checkpoint, dtype: torch.dtype, ids: torch.Tensor, tokens: list[int],
               role: str = "candidate", attn: str = "eager", compile: bool = False, points: set[str] | None = None):
    """A function that runs the prompt, then each token as one decode step with transformers' cache, and emits
    each step's capture points as ``emit(step, name, tensor)`` (step 0: the prompt); ``points`` as hf_runner's
    (operation-level points among them are emitted at each step too)."""
    model = models.hf(ckpt, dtype, role, attn, compile)
    device = first_device(model, models.device.get(role, models.device["reference"]))
    capture = [c for c in ckpt.resolved.capture if points is None or c.name in points]
    wanted = capture + wanted_ops(ckpt, points)

    def run(emit: Callable[[int, str, torch.Tensor], None]) -> None:
        step = 0
        limits = compile_limits(ckpt.resolved.num_layers) if attn != "eager" or compile else nullcontext()
        with hooks(model, wanted, lambda name, t: emit(step, name, t)), limits, torch.no_grad():
            _, cache = cached_forward(model, ids.to(device))
            for step, token in enumerate(tokens, 1):
                _, cache = cached_forward(model, torch.tensor([[token]], device=device), cache)

    return run


def wanted_ops(ckpt: Checkpoint, points: set[str] | None) -> list:
    """The adapter's operation-level points among ``points`` (none when every capture point is wanted: None)."""
    return [] if points is None else [o for o in ckpt.resolved.ops if o.name in points]


class _Enough(Exception):
    """Raised after the last layer a slice needs: the rest of the forward is not run."""


def _stop(*_) -> None:
    raise _Enough


def first_device(model, device: str) -> torch.device:
    """Where a model's inputs go: its embedding's device when spread over several (device_map)."""
    if device != "auto":
        return torch.device(device)
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def only(run: Callable[[Emit], None], names: set[str]) -> Callable[[Emit], None]:
    """The run, emitting only ``names``: nothing else is queued or held."""
    return lambda emit: run(lambda name, t: emit(name, t) if name in names else None)


def layer_inputs(num_layers: int) -> dict[str, int]:
    """The points that are a layer's input: `embed` feeds layer 0, `layers.{i}.out` feeds layer i + 1 (the head
    after the last); point -> the index isolation feeds it to."""
    return {"embed": 0, **{f"layers.{i}.out": i + 1 for i in range(num_layers)}}


def replay_steps(steps: dict[str, torch.Tensor], n: int) -> Callable[[Callable[[int, str, torch.Tensor], None]], None]:
    """A decode run from held steps (point -> [1, n, width], step k at index k - 1): emit(step, point,
    [1, 1, width]) for steps 1..n, as a decoder would."""
    def run(emit: Callable[[int, str, torch.Tensor], None]) -> None:
        for step in range(1, n + 1):
            for name, t in steps.items():
                emit(step, name, t[:, step - 1:step])

    return run
