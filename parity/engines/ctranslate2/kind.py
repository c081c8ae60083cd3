"""CTranslate2 models as candidates: ``--candidate ctranslate2:PATH`` (alias ``ct2``), run by CTranslate2 itself
(``pip install 'parity[ctranslate2]'``).

PATH is a Hugging Face checkpoint directory, converted by CTranslate2's own converter
(``ctranslate2.converters.TransformersConverter``, the Python API behind ``ct2-transformers-converter``) into
parity's conversion cache (parity.engines.common.converted), or a directory that converter already wrote
(``model.bin``, ``config.json``, ``vocabulary.json``). The conversion's weight type is the check's ``--dtype``
unless ``--engine-option quantization=...`` says otherwise, so that by default the engine is judged at float32.

What is compared is what CTranslate2's public API returns: the logits at every position. ``Generator.forward_batch``
is its prefill (the whole prompt in one call); ``--decode N`` forwards the prompt once as ``static_prompt`` and
then feeds each token as one step of ``generate_batch``'s constrained decoding through its own KV cache, reading
each step's logits (``return_logits_vocab``). No hidden state of any layer leaves the engine: the layer points
(embed, layers.N.*, final_norm) are reported as not compared, and a diagnosis works from the logits alone.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from parity.candidates.weights import checkpoint
from parity.checkpoint import stored_tensor_map
from parity.compare import metrics
from parity.engines.common import converted, require
from parity.engines.same_weights import write_reference
from parity.errors import ParityError
from parity.storage.lazy import Dequantizer
from parity.weights import FLOAT_TYPES, Tally, Weights, commonest

KIND = "ctranslate2"
MATRIX = "ctranslate2:{checkpoint}"  # its --candidate in the engine x family matrix (bench/engines.py)
ALIASES = ("ct2",)
EXPLICIT = True
REQUIRES = ("ctranslate2", "ctranslate2")
OPTIONS = ("layerwise",)
ENGINE_OPTIONS = {
    "quantization": "the conversion's weight type (a Hugging Face PATH only): float32, float16, bfloat16, int8, "
                    "int8_float32, int8_float16, int8_bfloat16, int16; default: the check's --dtype",
    "compute_type": "the type CTranslate2 computes in (default: the model's own), e.g. float32, int8_float32",
    "prefill": "batch (Generator.forward_batch: the prompt in one call; the default) or steps (the prompt fed a "
               "token at a time through the engine's cache)",
}
QUANTIZATIONS = ("float32", "float16", "bfloat16", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16")
DTYPE_QUANTIZATION = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NOT_COMPARED = ("CTranslate2's API returns the logits only (Generator.forward_batch, generate_batch's "
                "return_logits_vocab): the layer points (embed, layers.N.*, final_norm) are not compared")


def _ct2():
    return require("ctranslate2", "ctranslate2", "CTranslate2")


def is_ct2_dir(path: Path) -> bool:
    """A directory CTranslate2's converter wrote: its model.bin beside its own config.json."""
    return Path(path).is_dir() and (Path(path) / "model.bin").is_file()


def detect(path: Path) -> bool:
    path = Path(path)
    return is_ct2_dir(path) or (path / "config.json").is_file()


# --------------------------------------------------------------------------------------------
# model.bin, read as CTranslate2's ModelSpec._serialize writes it (the format is its own: version, spec name,
# revision, then each variable's name, shape, type id and bytes, then the aliases)

_TYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
_TYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}
_QUANTIZATION_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # as --engine-option quantization


class ModelBin:
    """The variables of a model.bin, read lazily: ``spec``, ``names`` (name -> (shape, type id, offset, size)),
    ``aliases`` (alias -> variable), ``array(name)``."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.names: dict[str, tuple[tuple[int, ...], int, int, int]] = {}
        try:
            with open(self.path, "rb") as f:
                self.version = self._u(f, "I")
                if not 3 <= self.version <= 6:
                    raise ValueError(f"binary version {self.version}")
                self.spec = self._s(f)
                self.revision = self._u(f, "I")
                for _ in range(self._u(f, "I")):
                    name = self._s(f)
                    shape = tuple(self._u(f, "I") for _ in range(self._u(f, "B")))
                    kind = self._u(f, "B")
                    size = self._u(f, "I")
                    if kind not in _TYPES:
                        raise ValueError(f"type id {kind} of {name}")
                    self.names[name] = (shape, kind, f.tell(), size)
                    f.seek(size, 1)
                self.aliases = {self._s(f): self._s(f) for _ in range(self._u(f, "I"))}
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
            raise ParityError(f"{self.path}: not a CTranslate2 model.bin that parity can read ({exc}); convert the "
                              f"checkpoint again with ct2-transformers-converter") from None

    @staticmethod
    def _u(f, fmt: str) -> int:
        raw = f.read(struct.calcsize(fmt))
        return struct.unpack(fmt, raw)[0]

    def _s(self, f) -> str:
        n = self._u(f, "H")
        return f.read(n)[:-1].decode()

    def resolve(self, name: str) -> str:
        return self.aliases.get(name, name)

    def array(self, name: str) -> np.ndarray:
        shape, kind, offset, size = self.names[self.resolve(name)]
        with open(self.path, "rb") as f:
            f.seek(offset)
            raw = f.read(size)
        if kind == 5:  # bfloat16: the high half of a float32
            return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        return np.frombuffer(raw, _TYPES[kind]).reshape(shape)

    def scalar(self, suffix: str) -> float | None:
        """The first scalar variable whose name ends with ``suffix`` (e.g. a model-wide setting), or None."""
        found = next((n for n in self.names if n.endswith(suffix) and not self.names[n][0]), None)
        return None if found is None else float(self.array(found).reshape(-1)[0])

    def types(self) -> dict[str, int]:
        """How many matrices (rank 2) it stores of each type (float32 named "F32", as the check reads it:
        unquantized)."""
        out: dict[str, int] = {}
        for shape, kind, _, _ in self.names.values():
            if len(shape) == 2:
                out[_type_name(kind)] = out.get(_type_name(kind), 0) + 1
        return out

    def weights(self):
        """How it stores its weights (parity.weights.Weights): every variable but the scalar settings
        and the int8 rows' scales (their bytes counted), by type; the scheme by CTranslate2's own name of the
        quantization that stores them so ("int8_float16": int8 matrices, float16 elsewhere)."""
        tally = Tally()
        for name, (shape, kind, _, size) in self.names.items():
            if name.endswith("_scale") and name.removesuffix("_scale") in self.names:
                tally.stored += size
            elif shape and kind != 3:  # int32: vocabulary ids, not weights
                tally.add(_type_name(kind), math.prod(shape), size)
        integer = commonest(tally.types)
        floats = {_QUANTIZATION_FLOATS[t] for t in tally.types if t in FLOAT_TYPES}
        rest = "" if floats <= {"float32"} else f"_{'/'.join(sorted(floats))}"
        return tally.weights(f"{integer}{rest}" if integer is not None else "")


def _type_name(kind: int) -> str:
    """A type id by the name the check reads (float32 "F32": unquantized, as parity.weights names it)."""
    return {0: "F32", 4: "F16", 5: "BF16"}.get(kind, _TYPE_NAMES[kind])


# --------------------------------------------------------------------------------------------
# the model directory: as given, or converted from a Hugging Face checkpoint by CTranslate2's converter


def _engine_options(candidate) -> dict[str, str]:
    return _checked(Path(candidate.path), dict(candidate.options.engine))


def _checked(path: Path, given: dict[str, str]) -> dict[str, str]:
    """The engine options, each value checked (the runner's, and describe's and same_weights')."""
    q = given.get("quantization")
    if q is not None and q not in QUANTIZATIONS:
        raise ParityError(f"--engine-option quantization={q}: CTranslate2 converts to {', '.join(QUANTIZATIONS)}")
    prefill = given.get("prefill", "batch")
    if prefill not in ("batch", "steps"):
        raise ParityError(f"--engine-option prefill={prefill}: batch or steps")
    if q is not None and is_ct2_dir(path):
        raise ParityError(f"--engine-option quantization={q}: {path} is already converted (its model.bin "
                          f"has its types); use compute_type, or name the Hugging Face checkpoint")
    return given


def model_dir(candidate) -> Path:
    """The CTranslate2 model directory of a candidate: the one given, or its checkpoint converted (cached)."""
    path = Path(candidate.path)
    if is_ct2_dir(path):
        return path
    q = _engine_options(candidate).get("quantization") or DTYPE_QUANTIZATION.get(candidate.dtype, "float32")
    return convert(path, q)


def convert(source: Path, quantization: str) -> Path:
    """``source`` converted by CTranslate2's TransformersConverter at ``quantization``, into the cache."""
    ct2 = _ct2()

    def run(out: Path) -> None:
        import transformers  # heavy: transformers
        from ctranslate2.converters import TransformersConverter  # optional: ctranslate2

        transformers.utils.logging.disable_progress_bar()
        level = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()  # its load report of the heads it drops
        try:
            TransformersConverter(str(source)).convert(str(out), quantization=quantization)
        except Exception as exc:  # noqa: BLE001 - the converter's own words, one line
            said = str(exc).split("(supported configurations", 1)[0].strip().splitlines()
            said = said[0].split(". ", 1)[0].rstrip(".") if said else ""  # its first sentence
            raise ParityError(f"--candidate ctranslate2:{source}: CTranslate2 {ct2.__version__}'s converter cannot "
                              f"convert it ({type(exc).__name__}: {said})") from None
        finally:
            transformers.utils.logging.set_verbosity(level)
        _name_special_tokens(out, source)

    return converted("ctranslate2", Path(source), {"quantization": quantization}, ct2.__version__, run)


def _name_special_tokens(out: Path, source: Path) -> None:
    """CTranslate2 refuses to load a config whose bos/eos/unk token is null, which its converter writes for a
    tokenizer that names none: those are named from the checkpoint's config ids (they choose where generation
    stops, never what a position computes)."""
    path = Path(out) / "config.json"
    config = json.loads(path.read_text())
    vocabulary = json.loads((Path(out) / "vocabulary.json").read_text())
    hf = json.loads((Path(source) / "config.json").read_text())
    hf = hf.get("text_config") or hf
    for key in ("bos_token", "eos_token", "unk_token"):
        if config.get(key) is None or config.get(key) == "" and key != "unk_token":
            token_id = hf.get(f"{key}_id")
            token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
            config[key] = vocabulary[token_id if isinstance(token_id, int) and 0 <= token_id < len(vocabulary) else 0]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _generator(candidate, directory: Path, compute_type: str):
    ct2 = _ct2()
    device = candidate.models.device.get("candidate", "cpu") if candidate.models is not None else "cpu"
    kind, _, index = str(device).partition(":")
    kind = "cuda" if kind == "cuda" else "cpu"
    key = ("ctranslate2", str(directory), kind, index, compute_type)
    loaded = candidate.models.loaded if candidate.models is not None else {}
    if key not in loaded:
        spec = ModelBin(directory / "model.bin").spec
        if "Decoder" not in spec or "Encoder" in spec:
            raise ParityError(f"--candidate ctranslate2:{candidate.path}: CTranslate2 holds it as {spec}; parity "
                              f"runs its Generator models (decoder-only language models) and compares their logits")
        try:
            loaded[key] = ct2.Generator(str(directory), device=kind, device_index=int(index or 0),
                                        compute_type=compute_type, inter_threads=1,
                                        intra_threads=max(1, torch.get_num_threads()))
        except (RuntimeError, ValueError) as exc:
            said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            hint = ("; its config.json names no bos/eos token (null): set them to tokens of its vocabulary.json"
                    if "null" in said else "")
            raise ParityError(f"--candidate ctranslate2:{candidate.path}: CTranslate2 cannot load {directory} "
                              f"({said}){hint}") from None
    return loaded[key]


def _tensor(view) -> torch.Tensor:
    """A StorageView as a float32 CPU tensor (a CUDA one through its array interface)."""
    if getattr(view, "device", "cpu") == "cuda":
        return torch.as_tensor(view, device="cuda").float().cpu()
    return torch.from_numpy(np.array(view)).float()


class Engine:
    """One CTranslate2 Generator and its vocabulary: ``prefill(ids)`` and ``steps(ids, tokens)`` give logits."""

    def __init__(self, candidate):
        options = _engine_options(candidate)
        self.directory = model_dir(candidate)
        self.generator = _generator(candidate, self.directory, options.get("compute_type", "default"))
        self.vocabulary = json.loads((self.directory / "vocabulary.json").read_text())
        self.prefill_mode = options.get("prefill", "batch")
        window = ModelBin(self.directory / "model.bin").scalar("sliding_window")
        self.window = int(window) if window else None

    def tokens(self, ids: list[int]) -> list[str]:
        if ids and max(ids) >= len(self.vocabulary):
            raise ParityError(f"token id {max(ids)} is outside the CTranslate2 model's vocabulary of "
                              f"{len(self.vocabulary)} ({self.directory}): not a conversion of the reference")
        return [self.vocabulary[t] for t in ids]

    def prefill(self, ids: list[int], notes) -> torch.Tensor:
        """[1, S, V]: the prompt's logits, from forward_batch; token by token where asked, or where the prompt is
        longer than the model's sliding window (forward_batch keeps only that many positions and refuses)."""
        if self.prefill_mode == "steps" or (self.window is not None and len(ids) > self.window):
            if self.prefill_mode == "batch":
                notes.warn(f"CTranslate2's forward_batch cannot take a prompt of {len(ids)} tokens past the model's "
                           f"sliding window ({self.window}): the prompt's logits were read from its token-by-token "
                           f"decode instead (generate_batch, through its cache)")
            return self._stepped(ids)
        try:
            return _tensor(self.generator.forward_batch([ids]))
        except (RuntimeError, ValueError) as exc:
            raise ParityError(f"CTranslate2's forward_batch failed on the prompt of {len(ids)} tokens ({exc}); "
                              f"try --engine-option prefill=steps") from None

    def _stepped(self, ids: list[int]) -> torch.Tensor:
        """Every position's logits, each token fed as one step of constrained decoding (include_prompt_in_result:
        the prompt is decoded, not forwarded at once)."""
        result = self.generator.generate_batch([self.tokens(ids)], max_length=len(ids), min_length=len(ids),
                                               include_prompt_in_result=True, return_logits_vocab=True,
                                               end_token=[], sampling_topk=1)[0]
        return _tensor(result.logits[0])[: len(ids)].unsqueeze(0)

    def steps(self, ids: list[int], tokens: list[int]) -> torch.Tensor:
        """[N, V]: the logits after each of ``tokens``: the prompt forwarded once as the static prompt, then each
        token one step of constrained decoding through the cache the prompt left."""
        result = self.generator.generate_batch([self.tokens(tokens)], static_prompt=self.tokens(ids),
                                               cache_static_prompt=False, max_length=len(tokens),
                                               min_length=len(tokens), include_prompt_in_result=True,
                                               return_logits_vocab=True, end_token=[], sampling_topk=1)[0]
        return _tensor(result.logits[0])[: len(tokens)]


def _one_sequence(candidate, ids: torch.Tensor, feed) -> None:
    if ids.shape[0] != 1:
        raise ParityError("a CTranslate2 candidate runs one sequence at a time")
    if feed is not None:
        raise ParityError(f"--candidate ctranslate2:{candidate.path}: CTranslate2 cannot be fed a layer's input")


def make_runner(candidate, ids: torch.Tensor, feed):
    """The prompt's logits (the only point CTranslate2 gives back)."""
    _one_sequence(candidate, ids, feed)
    engine = Engine(candidate)
    if candidate.options.layerwise:
        candidate.notes.warn(NOT_COMPARED)

    def run(emit) -> None:
        emit("logits", engine.prefill(ids[0].tolist(), candidate.notes))

    return run


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """The prompt, then each token as one step through CTranslate2's own cache: step k's logits at position
    S + k - 1."""
    _one_sequence(candidate, ids, None)
    engine = Engine(candidate)

    def run(emit) -> None:
        if not tokens:
            return
        logits = engine.steps(ids[0].tolist(), list(tokens))
        if logits.shape[0] != len(tokens):
            raise ParityError(f"CTranslate2 returned {logits.shape[0]} decode steps for {len(tokens)} tokens")
        for step in range(1, len(tokens) + 1):
            emit(step, "logits", logits[step - 1].reshape(1, 1, -1))

    return run


def check_span(path: Path, start: int, stop: int) -> None:
    raise ParityError(f"--layers {start}:{stop}: CTranslate2 runs the whole model and gives back its logits only; "
                      f"drop --layers")


def validate(path: Path, adapter_dirs=()) -> None:
    """Refuse, before any model loads, a directory that is neither kind, or a Hugging Face checkpoint whose
    configuration CTranslate2's converter does not know."""
    path = Path(path)
    if is_ct2_dir(path):
        ModelBin(path / "model.bin")  # a damaged file is refused in one line now
        return
    if not (path / "config.json").is_file():
        raise ParityError(f"--candidate ctranslate2:{path}: neither a Hugging Face checkpoint (config.json) nor a "
                          f"CTranslate2 model directory (model.bin)")
    ct2 = _ct2()
    import transformers  # heavy: transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ParityError(f"--candidate ctranslate2:{path}: transformers cannot read its config ({exc})") from None
    try:
        from ctranslate2.converters.transformers import _MODEL_LOADERS as known  # optional: ctranslate2
    except ImportError:  # a converter laid out otherwise: its own error comes at conversion
        return
    name = type(config).__name__
    if name not in known:
        raise ParityError(f"--candidate ctranslate2:{path}: CTranslate2 {ct2.__version__}'s converter has no "
                          f"loader for {name} (model_type {getattr(config, 'model_type', '?')})")


def describe(path: Path, engine: dict) -> dict:
    """The report's candidate entry: a model directory's matrix types (its model.bin's header); for a Hugging
    Face checkpoint converted at the type --engine-option quantization names, that conversion's (made now if not
    yet cached: the runner's own)."""
    path = Path(path)
    q = _checked(path, engine).get("quantization")
    if is_ct2_dir(path) or q is not None:
        directory = path if is_ct2_dir(path) else convert(path, q)
        found = ModelBin(directory / "model.bin")
        out = {"engine": "ctranslate2", "spec": found.spec, "tensor_types": found.types()}
        return out if directory == path else {**out, "converted": str(directory), "quantization": q}
    # converted when run at the check's --dtype, not quantized: an empty tensor_types keeps --calibrate from
    # reading weights back (its noise is the dtype's)
    return {"engine": "ctranslate2", "converted_by": "ctranslate2.converters.TransformersConverter",
            "tensor_types": {}}


def weights(path: Path, engine: dict):
    """How the model directory stores its weights (its model.bin's header: ModelBin.weights). A checkpoint, as
    --engine-option quantization has it converted, without converting: an int8 / int16 one by CTranslate2's name of
    it, a float one as its safetensors headers cast; without the option, converted at the check's --dtype: a float,
    not quantized. Integer weights computed at an integer compute_type (the model's own by default) quantize the
    activations too, which a reference on the dequantized weights does not (it computes as transformers does): said
    in ``unemulated``."""
    path = Path(path)
    given = _checked(path, engine)
    q = given.get("quantization")
    if is_ct2_dir(path):
        found = ModelBin(path / "model.bin").weights()
    elif q is None:
        return Weights()
    else:
        found = checkpoint(path, q) if q in _QUANTIZATION_FLOATS.values() else Weights(scheme=q)
    compute = given.get("compute_type", "default")
    if found.quantized and not compute.startswith(("float", "bfloat")):
        integer = found.scheme.split("_", 1)[0]
        return replace(found, unemulated=f"CTranslate2's {integer} activations, compute_type {compute}")
    return found


# --------------------------------------------------------------------------------------------
# --same-weights: a model.bin's weights read back into the checkpoint's layout

# how far a matrix read back may be from the checkpoint's and still be its quantization (rel_l2): int8 keeps a
# row's largest value in 127 steps (~1e-2 on a random row), int16 the matrix's in 1024, float16/bfloat16 round
BANDS = {"F32": 1e-7, "F16": 1e-3, "BF16": 8e-3, "int16": 1e-2, "int8": 5e-2}


def _dequantized(found: ModelBin, name: str) -> np.ndarray:
    """A variable as float32: int8 rows divided by their scale (CTranslate2 stores round(w * 127 / max|row|)),
    int16 by its one scale."""
    name = found.resolve(name)
    value = found.array(name)
    if value.dtype in (np.int8, np.int16):
        scale = found.array(f"{name}_scale").astype(np.float32)
        return value.astype(np.float32) / (scale.reshape(-1, 1) if scale.ndim else scale)
    return value.astype(np.float32)


def _locate(layout: ModelBin, index: dict, original: np.ndarray) -> tuple[str, int, bool] | None:
    """Where the converter put a checkpoint matrix (exact float32 rows, found through ``index``: row bytes ->
    [(variable, row)]): (variable, first row, transposed), its rows consecutive there (a fused q/k/v or gate/up
    matrix holds several)."""
    for transposed, matrix in ((False, original), (True, np.ascontiguousarray(original.T))):
        for name, row in index.get(matrix[0].tobytes(), ()):
            block = layout.array(name)[row: row + matrix.shape[0]]
            if block.shape == matrix.shape and np.array_equal(block, matrix):
                return name, row, transposed
    return None


def _row_index(layout: ModelBin) -> dict:
    index: dict[bytes, list[tuple[str, int]]] = {}
    for name, (shape, kind, _, _) in layout.names.items():
        if len(shape) == 2 and kind == 0:
            for k, row in enumerate(layout.array(name)):
                index.setdefault(row.tobytes(), []).append((name, k))
    return index


def read_back(ckpt, path: Path, out: Path) -> dict:
    """Write into ``out`` the reference checkpoint holding the model.bin's own matrices, dequantized to float32 and
    laid out as the checkpoint stores them (where each one went is found by converting the reference itself at
    float32 with the same converter: its rows are the checkpoint's exactly). Vectors (norms, biases), which
    CTranslate2 does not quantize, keep the checkpoint's own. Returns what the file held, as
    every engine's read_back does (parity.engines.same_weights)."""
    found = ModelBin(Path(path) / "model.bin")
    layout = ModelBin(convert(ckpt.path, "float32") / "model.bin")
    index = _row_index(layout)
    originals = Dequantizer.of(ckpt)
    tensors, types, wrong = {}, {}, {}
    for hf_name in stored_tensor_map(ckpt.resolved, ckpt.check()):
        original = originals.read(hf_name, torch.float32)
        if original.dim() != 2:
            tensors[hf_name] = original.contiguous()
            continue
        where = _locate(layout, index, original.numpy())
        if where is None:
            raise ParityError(f"--same-weights: CTranslate2's converter does not store {hf_name} as rows of one of "
                              f"its matrices; parity cannot read it back from {path}")
        name, row, transposed = where
        kind = _TYPE_NAMES[found.names[found.resolve(name)][1]]
        kind = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(kind, kind)
        rows = original.shape[1] if transposed else original.shape[0]
        value = torch.from_numpy(_dequantized(found, name)[row: row + rows].copy())
        value = value.T.contiguous() if transposed else value
        error = metrics(value, original)["rel_l2"] if value.shape == original.shape else float("inf")
        if not error <= BANDS.get(kind, 0.0):
            wrong[hf_name], value = error, original
        tensors[hf_name] = value
        types[kind] = types.get(kind, 0) + 1
    # transformers' own arithmetic: CTranslate2's int8 activation quantization is not emulated (what is left after
    # the weights is it, and its kernels)
    write_reference(ckpt, Path(out), tensors, None, untie=False)
    return {"from": str(path), "types": types, "tensors": len(tensors), "not_a_quantization": wrong,
            "bands": {kind: BANDS.get(kind, 0.0) for kind in sorted(types)}}


def same_weights(ckpt, path: Path, out: Path, engine: dict) -> dict:
    """--same-weights: the model.bin's own weights, dequantized, as a reference; for a Hugging Face checkpoint,
    those of its conversion at --engine-option quantization (the runner's, from the same cache)."""
    path = Path(path)
    q = _checked(path, engine).get("quantization")
    if is_ct2_dir(path):
        return read_back(ckpt, path, Path(out))
    if q is None:
        raise ParityError(f"--same-weights reads a CTranslate2 conversion's weights back; {path} is a Hugging Face "
                          f"checkpoint: say which conversion with --engine-option quantization=TYPE (e.g. int8), "
                          f"or name a directory ct2-transformers-converter wrote")
    return read_back(ckpt, convert(path, q), Path(out))
