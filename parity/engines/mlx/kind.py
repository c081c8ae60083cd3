"""MLX models as candidates, run by mlx-lm itself (``pip install 'parity[mlx]'``), named as ``mlx:PATH``.

PATH is a Hugging Face checkpoint, converted by mlx-lm's own converter (``mlx_lm.convert``) into parity's cache of
engine conversions (at the check's --dtype, float32 by default, or quantized with --engine-option bits=4), or a
directory mlx-lm's converter already wrote (its safetensors say ``format: mlx``), loaded as it is.

The capture points are read from mlx-lm's own modules: each module the adapter's capture map names (mlx-lm keeps
Hugging Face's module and parameter names, since it loads their weights by name) is given a subclass of its own
class whose ``__call__`` records the input or output the map asks for and then calls mlx-lm's. Nothing of mlx-lm's
model code is copied; a point whose module mlx-lm does not have is reported as not compared. Decoding runs through
mlx-lm's own KV cache (``make_prompt_cache``), one token per step. With ``options.ops`` (``--points ops``, a
drill-down) the adapter's operation-level points are read the same way (Taps: module inputs and outputs; q_rope and
k_rope from the attention function's arguments); the scores and probabilities mlx's fused attention keeps inside are
named in a warning.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from parity.candidates.weights import checkpoint
from parity.checkpoint import stored_tensor_map
from parity.compare import metrics
from parity.engines import common
from parity.engines.graph_ops import as_op, missing_note
from parity.engines.same_weights import write_reference
from parity.errors import ParityError
from parity.names import point_order
from parity.storage.lazy import Dequantizer
from parity.storage.shards import read_header
from parity.weights import Tally, Weights

KIND = "mlx"
MATRIX = "mlx:{checkpoint}"  # its --candidate in the engine x family matrix (bench/engines.py)
EXPLICIT = True                 # a Hugging Face directory is also a transformers candidate: mlx only when named
ALIASES = ("mlx-lm", "mlx_lm")
REQUIRES = ("mlx_lm", "mlx")
ENGINE_OPTIONS = {
    "bits": "quantize a converted checkpoint with mlx-lm (2, 3, 4, 5, 6 or 8 bits; default: not quantized)",
    "group_size": "weights per quantization group (32, 64 or 128; default: mlx-lm's for the mode)",
    "mode": "mlx-lm's quantization mode (affine, mxfp4, nvfp4, mxfp8; default affine)",
    "dtype": "the dtype mlx-lm converts to (float32, float16, bfloat16; default: the check's --dtype)",
}
CHOICES = {"bits": ("2", "3", "4", "5", "6", "8"), "group_size": ("32", "64", "128"),
           "mode": ("affine", "mxfp4", "nvfp4", "mxfp8"), "dtype": ("float32", "float16", "bfloat16")}
# Hugging Face module names mlx-lm spells otherwise (tried when the capture map's module is absent), and where
# mlx-lm's models hold their base model (a text model's ``model``; a multimodal wrapper's language model's)
RENAMED = {"mlp": ("block_sparse_moe",), "layers": ("h",)}  # mlx-lm's names (GPT-NeoX: its layers are `h`)
BASES = ("model.", "language_model.model.")
# the attention function mlx-lm's modeling files import from mlx_lm.models.base and call with queries and keys
# (after RoPE, the keys not repeated for GQA): wrapped while ops are read (Taps)
ATTENTION_FUNCTION = "scaled_dot_product_attention"
SAME_WEIGHTS = "parity-mlx-same-weights.json"   # beside a --same-weights reference: the conversion it read back
_LOCK = threading.Lock()  # one mlx-lm model at a time: mlx's default stream and the patched classes are shared


def _mlx_lm():
    return common.require("mlx_lm", "mlx", "mlx-lm (the mlx candidate's engine)")


def _version() -> str:
    mlx_lm = _mlx_lm()
    import mlx.core as mx  # optional: mlx

    return f"mlx-lm {getattr(mlx_lm, '__version__', '?')}, mlx {mx.__version__}"


def _header(file: Path):
    """A safetensors file's checked header (names, dtypes, shapes, metadata), no tensor read."""
    return read_header(Path(file))


def _files(path: Path) -> list[Path]:
    return sorted(Path(path).glob("model*.safetensors"))


def is_mlx_dir(path: Path) -> bool:
    """A directory mlx-lm's converter wrote: its safetensors are marked ``format: mlx``."""
    files = _files(path) if Path(path).is_dir() else []
    return bool(files) and _header(files[0]).metadata.get("format") == "mlx"


def detect(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def validate(path: Path, adapter_dirs=()) -> None:
    """Refuse, before any model loads, a path that is no model directory or a model type mlx-lm does not know."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ParityError(f"--candidate mlx:{path}: not a model directory (no config.json); name a Hugging Face "
                          f"checkpoint or a directory mlx_lm.convert wrote")
    if not _files(path):
        raise ParityError(f"--candidate mlx:{path}: no model*.safetensors in it; mlx-lm reads safetensors only")
    _mlx_lm()
    from mlx_lm.utils import _get_classes  # optional: mlx_lm

    config = json.loads((path / "config.json").read_text())
    try:
        _get_classes(config)
    except (ValueError, KeyError, ImportError) as exc:
        raise ParityError(f"--candidate mlx:{path}: {_version()} cannot load a {config.get('model_type')!r} model "
                          f"({_line(exc)}); check it with another engine") from None


def _line(exc: BaseException) -> str:
    """An engine's error in one line (mlx-lm lists the parameters it has no place for, one per line)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:240]}{' ...' if len(text) > 240 else ''}"


def settings(candidate) -> dict:
    """The conversion the engine options ask for (checked), with the check's dtype as mlx-lm's default dtype."""
    dtype = str(candidate.dtype).removeprefix("torch.")
    return conversion_settings(candidate.path, dict(candidate.options.engine), dtype)


def conversion_settings(path: Path, given: dict, dtype: str = "float32") -> dict:
    """The conversion the engine options ``given`` ask for (checked), at ``dtype`` unless they name one: what the
    runner converts (at the check's --dtype) and what describe and same_weights read (at float32, the dtype a
    same-weights reference computes in, unless --engine-option dtype says otherwise)."""
    for key, value in given.items():
        if value not in CHOICES[key]:
            raise ParityError(f"--engine-option {key}={value}: mlx-lm takes {', '.join(CHOICES[key])}")
    if is_mlx_dir(path) and given:
        raise ParityError(f"--engine-option {', '.join(given)}: {path} is already an mlx-lm conversion; "
                          f"convert the Hugging Face checkpoint instead (mlx:HF_DIR with the options)")
    if "bits" not in given and ("group_size" in given or "mode" in given):
        raise ParityError("--engine-option group_size/mode quantize: give bits too (e.g. bits=4)")
    dtype = given.get("dtype") or dtype
    out = {"dtype": dtype}
    if "bits" in given:
        out.update(bits=int(given["bits"]), group_size=int(given["group_size"]) if "group_size" in given else None,
                   mode=given.get("mode", "affine"))
    return out


def model_dir(path: Path, conversion: dict) -> Path:
    """The mlx-lm directory to load: ``path`` itself when mlx-lm wrote it, else its conversion (cached)."""
    path = Path(path)
    if is_mlx_dir(path):
        return path
    _mlx_lm()
    from mlx_lm.convert import convert  # optional: mlx_lm

    def run(out: Path) -> None:
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm's progress lines are not parity's output
                convert(str(path), str(out), quantize="bits" in conversion, q_bits=conversion.get("bits"),
                        q_group_size=conversion.get("group_size"), q_mode=conversion.get("mode", "affine"),
                        dtype=conversion["dtype"])
        except Exception as exc:  # mlx-lm's own refusal (unknown parameters, a config field it needs, ...)
            raise ParityError(f"--candidate mlx:{path}: {_version()} cannot convert it ({_line(exc)}): the checkpoint "
                              f"uses something mlx-lm's model of it does not implement") from None

    return common.converted("mlx", path, conversion, _version(), run)


def load(directory: Path):
    """mlx-lm's model for an mlx-lm directory, with its config."""
    _mlx_lm()
    from mlx_lm.utils import load_model  # optional: mlx_lm

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return load_model(Path(directory))
    except Exception as exc:  # strict loading: tensors the model has no place for, a config field missing, ...
        raise ParityError(f"--candidate mlx:{directory}: {_version()} cannot load it ({_line(exc)})") from None


def _child(module, name: str):
    """A child module or list item of an mlx module by its name, or None."""
    if isinstance(module, (list, tuple)):
        return module[int(name)] if name.isdigit() and int(name) < len(module) else None
    if isinstance(module, dict) and name in module:
        return module[name]
    return None


def find(root, path: str, prefix: str):
    """The mlx-lm module at a capture map's module path: the path as written, else with the variant's module
    prefix (GPT-2's ``transformer.``, ``model.language_model.``) replaced by where mlx-lm holds its base model
    (BASES), each part also by mlx-lm's name for it (RENAMED)."""
    rest = path[len(prefix):] if prefix and path.startswith(prefix) else path
    for start in dict.fromkeys([path, *(base + rest for base in BASES if rest), rest]):
        module = root
        for part in (p for p in start.split(".") if p):
            module = next((m for m in (_child(module, n) for n in (part, *RENAMED.get(part, ()))) if m is not None),
                          None)
            if module is None:
                break
        if module is not None:
            return module
    return None


def _input(args: tuple, kwargs: dict, arg) -> object:
    """The argument a capture point reads: a position, or a name (mlx-lm names the stream ``x`` or ``h`` where
    transformers says ``hidden_states``: the first positional argument, the stream in every mlx-lm module)."""
    if isinstance(arg, int):
        return args[arg] if arg < len(args) else None
    if isinstance(arg, str) and arg in kwargs:
        return kwargs[arg]
    return args[0] if args else next(iter(kwargs.values()), None)


def _output(out, field) -> object:
    if isinstance(out, (tuple, list)):
        return out[field if isinstance(field, int) else 0]
    if isinstance(out, dict):
        return out.get(field)
    return out


class Taps:
    """mlx-lm's modules at the capture map's points, each given a subclass of its own class whose ``__call__``
    records what the point reads (the first time in a forward) and then runs mlx-lm's own. ``close()`` gives
    each module its class back.

    ``ops`` (the adapter's operation-level points, docs/ops.md) are read the same way where the adapter reads them
    at a module's input or output; q_rope and k_rope (io "attention": what the attention module hands its attention
    function) from the queries and keys the attention module passes to ``scaled_dot_product_attention``, the
    function its modeling file imports from mlx-lm's models.base: that name in that file is wrapped while the taps
    are on (``ATTENTION_FUNCTION``). Its scores and probabilities stay inside mx.fast.scaled_dot_product_attention
    and are not read (``absent_ops``, with why)."""

    def __init__(self, model, capture, prefix: str, ops=()):
        self.seen: dict[str, object] = {}
        self.absent: list[str] = []
        self.absent_ops: dict[str, str] = {}
        self.ops = {c.name: c for c in ops}
        self.active: list[list] = []  # the attention points of the attention modules running now (innermost last)
        self._patched: list[tuple[object, type]] = []
        self._functions: dict[str, tuple[object, object]] = {}  # modeling file -> (its module, the original)
        by_module: dict[int, tuple[object, list]] = {}
        for point in [*capture, *ops]:
            module = find(model, point.module, prefix)
            if (module is None or not callable(module)) and point.name in self.ops:
                self.absent_ops[point.name] = f"mlx-lm's model has no module {point.module}"
                continue
            if module is None or not callable(module):
                self.absent.append(point.name)
                continue
            if point.io == "attention" and not self._attention_function(module, point):
                continue
            by_module.setdefault(id(module), (module, []))[1].append(point)
        for module, points in by_module.values():
            self._patch(module, points)

    def _attention_function(self, module, point) -> bool:
        """Wrap the attention function of ``module``'s modeling file (once per file); False (and why, in absent_ops)
        where the op cannot be read from it."""
        if point.field not in ("query", "key"):
            self.absent_ops[point.name] = ("mlx-lm computes attention in mx.fast.scaled_dot_product_attention: its "
                                           "scores and probabilities are not values")
            return False
        where = sys.modules.get(type(module).__module__)
        original = getattr(where, ATTENTION_FUNCTION, None)
        if not callable(original):
            self.absent_ops[point.name] = (f"mlx-lm's {type(module).__module__} calls no {ATTENTION_FUNCTION} "
                                           f"function (it computes attention its own way)")
            return False
        if where.__name__ not in self._functions:
            seen, active = self.seen, self.active

            def attention(queries, keys, *args, **kwargs):
                for p in active[-1] if active else ():
                    seen.setdefault(p.name, queries if p.field == "query" else keys)
                return original(queries, keys, *args, **kwargs)

            self._functions[where.__name__] = (where, original)
            setattr(where, ATTENTION_FUNCTION, attention)
        return True

    def _patch(self, module, points: list) -> None:
        cls, seen, active = type(module), self.seen, self.active
        inputs = [p for p in points if p.io == "input"]
        outputs = [p for p in points if p.io not in ("input", "attention")]
        attention = [p for p in points if p.io == "attention"]

        def __call__(self, *args, **kwargs):
            for p in inputs:
                seen.setdefault(p.name, _input(args, kwargs, p.arg))
            active.append(attention)
            try:
                out = cls.__call__(self, *args, **kwargs)
            finally:
                active.pop()
            for p in outputs:
                seen.setdefault(p.name, _output(out, p.field))
            return out

        module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        self._patched.append((module, cls))

    def take(self, s: int | None = None) -> dict[str, torch.Tensor]:
        """What the last forward recorded, as float32 torch tensors [1, S, width] (evaluated together); an op laid
        out as docs/ops.md says (``s``: the forward's positions; an op whose shape is not one of its layouts is
        left out, and why is in ``absent_ops``)."""
        import mlx.core as mx  # optional: mlx

        arrays = {k: v for k, v in self.seen.items() if isinstance(v, mx.array)}
        mx.eval(*arrays.values())
        out = {}
        for name, x in arrays.items():
            t = torch.from_numpy(np.array(x.astype(mx.float32)))
            c = self.ops.get(name)
            if c is None:
                out[name] = t.reshape(1, -1, t.shape[-1])
                continue
            got = as_op(t, s, "heads" if c.io == "attention" else "module", c) if s is not None else None
            if got is None:
                self.absent_ops[name] = f"mlx-lm's value has shape {list(t.shape)}, not a layout of the op"
            else:
                out[name] = got
        self.seen.clear()
        return out

    def close(self) -> None:
        for module, cls in self._patched:
            module.__class__ = cls
        self._patched.clear()
        for where, original in self._functions.values():
            setattr(where, ATTENTION_FUNCTION, original)
        self._functions.clear()


def _opened(candidate, ops: bool = False):
    """mlx-lm's model for the candidate, with its capture points tapped (and, with ``ops``, its operation-level
    points when the check asks for them)."""
    conversion = settings(candidate)
    directory = model_dir(candidate.path, conversion)
    _refuse_other_weights(candidate, directory)
    model, _ = load(directory)
    resolved = candidate.ckpt.resolved
    wanted = resolved.ops if ops and candidate.options.ops else ()
    taps = Taps(model, resolved.capture, resolved.variant.module_prefix, wanted)
    if taps.absent:
        candidate.notes.warn(f"mlx-lm's {type(model).__module__.rsplit('.', 1)[-1]} model has no module for "
                             f"{_summary(taps.absent)}: not compared")
    return model, taps


def _summary(points: list[str]) -> str:
    kinds = sorted({p.split(".")[-1] if p.startswith("layers.") else p for p in points})
    return ", ".join(kinds)


def _refuse_other_weights(candidate, directory: Path) -> None:
    """A --same-weights reference read back one conversion: the candidate must be that one (the reference reads
    a Hugging Face checkpoint's conversion at float32 unless --engine-option dtype names another; the runner at
    the check's --dtype)."""
    held = Path(candidate.ckpt.path) / SAME_WEIGHTS
    if held.is_file() and json.loads(held.read_text()).get("model") != str(directory):
        raise ParityError(f"--same-weights read back mlx-lm's float32 conversion, but the check runs it at "
                          f"{str(candidate.dtype).removeprefix('torch.')}: give --engine-option dtype="
                          f"{str(candidate.dtype).removeprefix('torch.')} too, so both are one conversion")


def make_runner(candidate, ids: torch.Tensor, feed):
    if ids.shape[0] != 1:
        raise ParityError("an mlx candidate runs one sequence at a time")

    def run(emit) -> None:
        import mlx.core as mx  # optional: mlx

        with _LOCK:
            model, taps = _opened(candidate, ops=True)
            try:
                model(mx.array(ids.tolist()))
                captured = taps.take(ids.shape[1])
            finally:
                taps.close()
        lacking = missing_note(taps.absent_ops, "mlx-lm model")
        if lacking:
            candidate.notes.warn(lacking)
        for name in sorted(captured, key=point_order):
            emit(name, captured[name])

    return run


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """The prompt, then each token as one step through mlx-lm's own KV cache (make_prompt_cache: rotating caches on
    sliding layers where the model asks for them); each step's points read by the same taps."""
    if ids.shape[0] != 1:
        raise ParityError("an mlx candidate runs one sequence at a time")

    def run(emit) -> None:
        import mlx.core as mx  # optional: mlx, mlx_lm
        from mlx_lm.models.cache import make_prompt_cache

        with _LOCK:
            model, taps = _opened(candidate)
            try:
                cache = make_prompt_cache(model)
                model(mx.array(ids.tolist()), cache=cache)
                taps.take()
                steps = []
                for token in tokens:
                    model(mx.array([[token]]), cache=cache)
                    steps.append(taps.take())
            finally:
                taps.close()
        common.emit_steps(steps, emit)

    return run


# rel_l2 of a dequantized tensor against the checkpoint's beyond which it is not a quantization of it: about three
# times what mlx's quantizer leaves on Gaussian weights (measured, group 64: 8 bits 5.4e-3, 6 bits 2.2e-2, 5 bits
# 4.4e-2, 4 bits 9.1e-2, mxfp4 0.12, 3 bits 0.19, 2 bits 0.40), capped below the ~1.4 of a permuted matrix
BANDS = {8: 0.02, 6: 0.08, 5: 0.15, 4: 0.35, 3: 0.6, 2: 0.6}
EXACT = 1e-6        # an unquantized tensor against the checkpoint's, rounded to the same dtype


def same_weights(ckpt, path: Path, out: Path, engine: dict) -> dict:
    """--same-weights: the mlx model's own weights (a Hugging Face checkpoint's: the conversion its engine options
    ask for, as the runner makes it), dequantized by mlx-lm (``dequantize_model``: mx.dequantize of each quantized
    layer), written as a float32 reference checkpoint under the checkpoint's names and layout. Each tensor is
    judged on its way back (BANDS, EXACT); one that is not a quantization of the checkpoint's is reported and the
    reference keeps the checkpoint's own there, so that the check judges it."""
    from mlx.utils import tree_flatten  # optional: mlx, mlx_lm
    from mlx_lm.utils import dequantize_model

    directory = model_dir(Path(path), conversion_settings(Path(path), engine))
    with _LOCK:
        model, config = load(directory)
        quantized = {name.removesuffix(".scales") for name, _ in tree_flatten(model.parameters())
                     if name.endswith(".scales")}
        held = {name: _torch(x) for name, x in tree_flatten(dequantize_model(model).parameters())}
    quantization = config.get("quantization") or {}
    bits, label = quantization.get("bits"), f"{quantization.get('mode', 'affine')}-{quantization.get('bits')}bit"
    originals, prefix = Dequantizer.of(ckpt), ckpt.check().prefix
    tensors, wrong, types, bands = {}, {}, {}, {}
    for name in _weights(ckpt):
        original = originals.read(name, torch.float32)
        mlx_name = next((n for n in _names(name, prefix) if n in held), None)
        if mlx_name is None:
            raise ParityError(f"--same-weights: mlx-lm holds {name} in another layout (stacked experts, a fused or "
                              f"absorbed matrix); reading {directory} back is not supported")
        value = held[mlx_name]
        if mlx_name.removesuffix(".weight") in quantized:
            kind, band = label, BANDS.get(bits, 0.6)
            x, error = _oriented(value, original)
        else:  # unquantized: the checkpoint's tensor rounded to the dtype mlx holds it in, exactly
            kind, band = _dtype_name(value), EXACT
            x, error = _oriented(value, original.to(value.dtype).float())
        types[kind], bands[kind] = types.get(kind, 0) + 1, band
        if x is None or not error <= band:
            wrong[name], x = error, original
        tensors[name] = x.float().contiguous()
    Path(out).mkdir(parents=True, exist_ok=True)
    write_reference(ckpt, Path(out), tensors, None, untie=False)  # mlx's float32 matmuls on the dequantized weights
    (Path(out) / SAME_WEIGHTS).write_text(json.dumps({"model": str(directory)}))
    return {"from": str(directory), "types": types, "tensors": len(tensors), "not_a_quantization": wrong,
            "bands": dict(sorted(bands.items()))}


def _weights(ckpt) -> list[str]:
    """The checkpoint's weights as stored (the adapter's tensor map; buffers and ignored tensors left out)."""
    stored = stored_tensor_map(ckpt.resolved, ckpt.check())
    return [name for name in ckpt.tensors if name in stored]


def _names(name: str, prefix: str) -> list[str]:
    """Where mlx-lm keeps a checkpoint tensor: its own name, or under mlx-lm's base model (BASES)."""
    rest = name[len(prefix):] if prefix and name.startswith(prefix) else name
    return [name, *(base + rest for base in BASES), rest]


def _oriented(x: torch.Tensor, original: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """``x`` laid out as the checkpoint stores it (mlx-lm transposes GPT-2's Conv1D matrices as it loads them):
    as held, or transposed, whichever is nearer the checkpoint's; None where neither shape fits."""
    options = [x] + ([x.T] if x.dim() == 2 and x.shape[0] != x.shape[1] else [])
    fits = [(metrics(y.float(), original)["rel_l2"], k) for k, y in enumerate(options) if y.shape == original.shape]
    if not fits:
        return None, float("inf")
    error, k = min(fits)
    return options[k], error


def _torch(x) -> torch.Tensor:
    """An mlx array as a torch tensor of the same dtype (bfloat16 through float32: numpy has no bfloat16)."""
    import mlx.core as mx  # optional: mlx

    if x.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(x.astype(mx.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(x))


def _dtype_name(t: torch.Tensor) -> str:
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(t.dtype, str(t.dtype))


def describe(path: Path, engine: dict) -> dict:
    """What the report's candidate entry adds: the engine, whether mlx-lm wrote the directory, and its tensors by
    type (read from the safetensors headers; a quantized matrix counted once, by its bits). A Hugging Face
    checkpoint with engine options is described by the conversion they ask for (made now if not yet cached)."""
    path = Path(path)
    mlx_written = is_mlx_dir(path)
    if engine and not mlx_written:
        path = model_dir(path, conversion_settings(path, engine))
    return {"engine": _version(), "written_by": "mlx-lm" if mlx_written else "transformers (converted by mlx-lm)",
            "tensor_types": _stored(path).types}


# mlx-lm's default group size per quantization mode (mlx_lm.convert's q_group_size=None)
GROUP_SIZES = {"affine": 64, "mxfp4": 32, "nvfp4": 16, "mxfp8": 32}
OUTPUT, EMBEDDINGS = "lm_head", ("embed_tokens", "wte", "embed_in", "word_embeddings")


def weights(path: Path, engine: dict):
    """How the model stores its weights: a directory mlx-lm wrote, from its config's quantization and its
    safetensors headers (_stored); a Hugging Face checkpoint, from the conversion the engine options ask for,
    without converting: its bits, mode and group size by name (which matrices mlx-lm quantizes is its to decide
    when it converts), or unquantized, its safetensors headers cast to the conversion's dtype."""
    path = Path(path)
    conversion = conversion_settings(path, engine)
    if is_mlx_dir(path):
        return _stored(path)
    if "bits" not in conversion:
        return checkpoint(path, conversion["dtype"])
    return Weights(scheme=_scheme(conversion))


def _scheme(quantization: dict) -> str:
    """mlx-lm's quantization in words: "affine 4-bit, groups of 64"."""
    mode = quantization.get("mode") or "affine"
    return (f"{mode} {quantization['bits']}-bit, groups of "
            f"{quantization.get('group_size') or GROUP_SIZES.get(mode, GROUP_SIZES['affine'])}")


def _stored(directory: Path):
    """An mlx-lm directory's weights (parity.weights.Weights) from its safetensors headers: a quantized
    matrix (its ``.scales`` beside it) once, as "affine-4bit", of its packed uint32 columns' weights, its scales
    and biases adding their bytes; the rest by dtype. The config's per-module overrides (mlx-lm's mixed recipes)
    give a module its own bits; an output or embedding stored otherwise than the rest is noted."""
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    quantization = config.get("quantization") or {}
    mode = quantization.get("mode", "affine")
    tally, kinds = Tally(), {}
    for f in _files(directory):
        entries = _header(f).tensors
        for name, entry in entries.items():
            module = name.removesuffix(".weight")
            if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] + ".weight" in entries:
                tally.stored += entry.end - entry.begin
                continue
            elements = math.prod(entry.shape)
            if name.endswith(".weight") and module + ".scales" in entries:
                override = quantization.get(module)
                bits = (override if isinstance(override, dict) else quantization).get("bits")
                kind, elements = f"{mode}-{bits}bit", elements * 32 // bits
            else:
                kind = entry.dtype
            kinds[module] = kind
            tally.add(kind, elements, entry.end - entry.begin)
    if not quantization.get("bits"):
        return tally.weights()
    main = f"{mode}-{quantization['bits']}bit"
    output = next((kinds[m] for m in kinds if m.endswith(OUTPUT)), None)
    embedding = next((kinds[m] for m in kinds if m.endswith(EMBEDDINGS)), None)
    notes = [f"{kind} {what}" for kind, what in ((output, "output"), (embedding, "embedding"))
             if kind is not None and kind != main]
    return tally.weights(_scheme(quantization), notes)


def shapes(path: Path, adapter_dirs=()) -> list:
    """The weights the engine holds (as stored: a quantized matrix by its packed size)."""
    return [entry.shape for f in _files(Path(path)) for entry in _header(f).tensors.values()]
