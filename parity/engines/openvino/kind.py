"""OpenVINO models as candidates (``--candidate openvino:PATH``, ``pip install 'parity[openvino]'``), run by
OpenVINO Runtime on its CPU plugin.

PATH is an OpenVINO IR (a directory holding ``openvino_model.xml``/``model.xml`` and its ``.bin``, or the
``.xml`` itself) or a Hugging Face checkpoint directory, which OpenVINO's own converter turns into an IR once
(``openvino.convert_model`` on transformers' model, traced with example inputs; kept in the engines' cache, see
parity.engines.common.converted). A causal language model is exported with its KV cache as inputs and
outputs and made stateful by OpenVINO's own transformation, as OpenVINO serves LLMs: the prompt and each decode
step run through the model's own cache (its states). ``--engine-option weights=int8|int4`` compresses the weights
with NNCF (``nncf.compress_weights``) on the way.

The model runs at ``INFERENCE_PRECISION_HINT=f32`` unless ``--engine-option precision=bf16|f16``: the engine
checked at its own float32 first. Capture points are read by adding the matched ops' outputs to the model's
results; which ops they are is parity.engines.openvino.graph's to find (the module paths OpenVINO keeps in op names).
With ``options.ops`` (``--points ops``, a drill-down) the reference's operation-level points are read the same way
(parity.engines.graph_ops): by module path, and q_rope / k_rope from the inputs of the ScaledDotProductAttention op that
transformers' attention converts to; its scores and probabilities stay inside that op and are not compared (a
warning names them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from parity import names
from parity.adapter.files import load_all
from parity.candidates.weights import checkpoint
from parity.checkpoint import open_checkpoint, refuse_mismatched
from parity.engines.common import cache_root, converted, fingerprint, require
from parity.engines.graph_ops import as_point, missing_note, read_ops, wanted_ops
from parity.engines.onnx.graph import hidden_width, vocabulary
from parity.engines.openvino.export import export
from parity.engines.openvino.graph import match_points
from parity.engines.openvino.weights import read_back, stored
from parity.errors import ParityError
from parity.reference.structure import discover
from parity.weights import Weights

KIND = "openvino"
MATRIX = "openvino:{checkpoint}"  # its --candidate in the engine x family matrix (bench/engines.py)
ALIASES = ("ov",)
EXPLICIT = True
REQUIRES = ("openvino", "openvino")
OPTIONS = ("layerwise",)
GENERIC = True      # reads points by the module paths OpenVINO keeps: checks a model no adapter knows
ENGINE_OPTIONS = {
    "precision": "f32 (default), bf16 or f16: the CPU plugin's INFERENCE_PRECISION_HINT",
    "weights": "int8 or int4: a checkpoint's weights compressed by NNCF (nncf.compress_weights) on conversion",
    "kv_cache": "the KV cache's element type (KV_CACHE_PRECISION: f32, f16, bf16 or u8; default: the precision)",
    "device": "the OpenVINO device that runs the model (default CPU)",
}
PRECISIONS = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16"}
KV_CACHE = ("f32", "f16", "bf16", "u8")
WEIGHTS = {"int8": "INT8_ASYM", "int4": "INT4_ASYM"}  # nncf.CompressWeightsMode names
IR_NAMES = ("openvino_model.xml", "model.xml")
_CACHE = "past_key_values"  # the exported cache's input names: past_key_values.{layer}.{key|value}


def ir_file(path: Path) -> Path | None:
    """The .xml an OpenVINO candidate path names: the file, or a directory's openvino_model.xml / model.xml /
    single .xml."""
    path = Path(path)
    if path.is_file() and path.suffix == ".xml":
        return path
    if path.is_dir():
        for name in IR_NAMES:
            if (path / name).is_file():
                return path / name
        found = sorted(path.glob("*.xml"))
        if len(found) == 1 and found[0].with_suffix(".bin").is_file():
            return found[0]
    return None


def detect(path: Path) -> bool:
    return ir_file(path) is not None or (Path(path) / "config.json").is_file()


def validate(path: Path, adapter_dirs=()) -> None:
    """An IR with its weights beside it, or a checkpoint of a family parity knows whose tensors match."""
    xml = ir_file(path)
    if xml is not None:
        if not xml.with_suffix(".bin").is_file():
            raise ParityError(f"--candidate {xml}: its weights {xml.with_suffix('.bin').name} are missing beside it; "
                              f"copy the .bin next to the .xml")
        return
    if not (Path(path) / "config.json").is_file():
        raise ParityError(f"--candidate openvino:{path}: neither an OpenVINO IR (openvino_model.xml and .bin) nor a "
                          f"Hugging Face checkpoint directory (config.json)")
    refuse_mismatched(_open(Path(path), adapter_dirs), "--candidate")


def settings(options, dtype=None) -> dict:
    """The engine options, checked: {"precision", "kv_cache", "weights", "device"}; the precision follows the
    check's --dtype unless given (float32: OpenVINO checked at its own f32, whatever the CPU's default)."""
    return checked(dict(getattr(options, "engine", ()) or ()), dtype)


def checked(given: dict, dtype=None) -> dict:
    """``settings`` of the engine options as a dict (what describe and same_weights are given)."""
    default = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype, "f32")
    precision = PRECISIONS.get(given.get("precision", default).lower())
    if precision is None:
        raise ParityError(f"--engine-option precision={given['precision']}: OpenVINO's CPU plugin computes in f32, "
                          f"bf16 or f16")
    kv = given.get("kv_cache", precision).lower()
    if kv not in KV_CACHE:
        raise ParityError(f"--engine-option kv_cache={given['kv_cache']}: one of {', '.join(KV_CACHE)}")
    weights = given.get("weights")
    if weights is not None and weights.lower() not in WEIGHTS:
        raise ParityError(f"--engine-option weights={weights}: NNCF compresses to {' or '.join(WEIGHTS)}")
    return {"precision": precision, "kv_cache": kv, "weights": weights and weights.lower(),
            "device": given.get("device", "CPU")}


def model_xml(path: Path, adapter_dirs, chosen: dict, source=None) -> Path:
    """The IR to run: the one named, or the checkpoint converted by OpenVINO (cached per weights setting; the
    checkpoint opened with ``adapter_dirs`` unless ``source`` is it, opened)."""
    xml = ir_file(path)
    if xml is not None:
        if chosen["weights"]:
            raise ParityError(f"--engine-option weights={chosen['weights']}: {xml} is already an IR; compression "
                              f"applies when converting a checkpoint (name its directory instead)")
        return xml
    ov = require("openvino", "openvino", "OpenVINO")
    source = source if source is not None else _open(Path(path), adapter_dirs)
    weights = chosen["weights"]
    version = ov.get_version() + (f" nncf {_nncf().__version__}" if weights else "")
    out = converted("openvino", Path(path), {"weights": weights}, version,
                    lambda out: export(source, out, WEIGHTS[weights] if weights else None))
    return out / IR_NAMES[0]


def _nncf():
    return require("nncf", "openvino", "NNCF (OpenVINO's weight compression)")


class Engine:
    """One compiled model with the matched capture points added as outputs, and an infer request."""

    def __init__(self, xml: Path, ckpt, chosen: dict, wanted: list[str]):
        ov = require("openvino", "openvino", "OpenVINO")
        core = ov.Core()
        try:
            model = core.read_model(str(xml))
        except Exception as exc:  # noqa: BLE001 - OpenVINO's errors are long C++ messages
            raise ParityError(f"{xml}: OpenVINO cannot read the model ({_first_line(exc)}); convert it again") from None
        g, self.matching = match_points(model, ckpt, wanted)
        self.first = len(model.outputs)
        values = list(dict.fromkeys(m["value"] for m in self.matching.points.values()))
        added = [v for v in values if v not in g.outputs]  # an output already (logits) is not added again
        model.add_outputs([g.port(v) for v in added])
        self.index = {v: self.first + k for k, v in enumerate(added)}
        self.index.update({v: g.outputs.index(v) for v in values if v in g.outputs})
        config = {"INFERENCE_PRECISION_HINT": chosen["precision"], "KV_CACHE_PRECISION": chosen["kv_cache"],
                  "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0", "INFERENCE_NUM_THREADS": str(max(1, torch.get_num_threads()))}
        if chosen["device"].upper() != "CPU":
            config = {"INFERENCE_PRECISION_HINT": chosen["precision"]}
        try:
            self.compiled = core.compile_model(model, chosen["device"], config)
        except Exception as exc:  # noqa: BLE001
            raise ParityError(f"{xml}: OpenVINO cannot compile it for {chosen['device']} ({_first_line(exc)})") from None
        self.request = self.compiled.create_infer_request()
        self.inputs = [(i.get_any_name(), i.get_partial_shape()) for i in model.inputs]
        self.states = {op.get_variable_id(): op.get_output_partial_shape(0)
                       for op in model.get_ops() if op.get_type_name() == "ReadValue"}
        self.xml = xml

    def reset(self, b: int) -> None:
        """An empty cache: each state [b, heads, 0, head_dim] where the model does not initialise it itself."""
        self.request.reset_state()
        for state in self.request.query_state():
            shape = self.states.get(state.name)
            if shape is None or shape.rank.is_dynamic:
                continue
            dims = [d.get_length() if d.is_static else None for d in shape]
            free = [k for k, d in enumerate(dims) if d is None]
            if len(free) == 2:  # batch and sequence
                dims[free[0]], dims[free[1]] = b, 0
                state.state = _ov_tensor(np.zeros(dims, np.float32))

    def feeds(self, ids: torch.Tensor, start: int = 0) -> dict[str, np.ndarray]:
        b, s = ids.shape
        out = {}
        for name, shape in self.inputs:
            if name in ("input_ids", "ids") or name.endswith("input_ids"):
                value = ids.numpy()
            elif "attention_mask" in name:
                value = np.ones((b, start + s))
            elif "position_ids" in name:
                value = np.broadcast_to(np.arange(start, start + s), (b, s))
            elif "token_type_ids" in name:
                value = np.zeros((b, s))
            elif name == "beam_idx":  # optimum-intel's stateful models: the batch rows the cache keeps
                value = np.arange(b)
            elif "past" in name:
                value = np.zeros(_empty(shape, b, name, self.xml), np.float32)
            else:
                raise ParityError(f"{self.xml}: the model needs input {name!r} {shape}, which parity cannot fill; it "
                                  f"feeds input_ids, attention_mask, position_ids, token_type_ids and beam_idx")
            out[name] = np.ascontiguousarray(value).astype(np.float32 if "past" in name else np.int64)
        return out

    def run(self, ids: torch.Tensor, start: int = 0) -> list[np.ndarray]:
        try:
            self.request.infer(self.feeds(ids, start))
        except ParityError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ParityError(f"OpenVINO failed to run {self.xml.name} ({_first_line(exc)})") from None
        return [self.request.get_output_tensor(k).data.copy() for k in range(len(self.compiled.outputs))]

    def value(self, values: list[np.ndarray], value: str) -> np.ndarray:
        """A matched value of one run's outputs (``run``'s)."""
        return values[self.index[value]]

    def points(self, values: list[np.ndarray], b: int, s: int, hidden: int, vocab: int):
        """(point, tensor [b, s, width]) for each matched point, or (point, None, why)."""
        for point in sorted(self.matching.points, key=names.point_order):
            if point in self.matching.layouts:  # an op: read_ops lays it out
                continue
            value = self.matching.points[point]["value"]
            x = values[self.index[value]]
            if x.dtype != np.float32:
                x = x.astype(np.float32)
            got = as_point(x, b, s, vocab if point == "logits" else hidden)
            yield point, got, None if got is not None else f"{value} has shape {list(x.shape)}, not [{b}, {s}, width]"


def _empty(shape, b: int, name: str, xml: Path) -> list[int]:
    if shape.rank.is_dynamic:
        raise ParityError(f"{xml}: input {name!r} has no known rank; parity cannot make an empty cache for it")
    dims = [d.get_length() if d.is_static else None for d in shape]
    free = [k for k, d in enumerate(dims) if d is None]
    if len(free) != 2:
        raise ParityError(f"{xml}: cache input {name!r} {shape}: parity fills [batch, heads, 0, head_dim] with only "
                          f"the batch and sequence dimensions left dynamic; export it with static heads")
    dims[free[0]], dims[free[1]] = b, 0
    return dims


def _ov_tensor(x: np.ndarray):
    import openvino as ov  # optional: openvino

    return ov.Tensor(x)


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and "Exception from" not in line]
    return (lines[0] if lines else type(exc).__name__)[:300]


def _engine(candidate, wanted: list[str]) -> Engine:
    """The compiled model for these points (kept across the prompts of one check)."""
    chosen = settings(candidate.options, candidate.dtype)
    dtype = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(candidate.dtype, "f32")
    if chosen["precision"] != dtype:
        candidate.notes.warn(f"OpenVINO computes in {chosen['precision']} (precision={chosen['precision']}) but "
                             f"--dtype is {str(candidate.dtype).removeprefix('torch.')}: tolerances are those of "
                             f"--dtype; pass --dtype {dict(bf16='bfloat16', f16='float16', f32='float32')[chosen['precision']]}")
    key = ("openvino", str(candidate.path), tuple(sorted(chosen.items())), tuple(wanted))
    loaded = candidate.models.loaded
    if key not in loaded:
        xml = model_xml(Path(candidate.path), candidate.models.adapter_dirs, chosen)
        loaded[key] = Engine(xml, candidate.ckpt, chosen, wanted)
    return loaded[key]


def _report_matching(candidate, engine: Engine, wanted: list[str], unmatched: dict) -> None:
    notes, layerwise = candidate.notes, candidate.options.layerwise
    matched = {p: m for p, m in engine.matching.points.items() if p not in unmatched}
    notes.matching = {"points": matched, "unmatched": unmatched}
    for w in engine.matching.warnings:
        notes.warn(w)
    missing = sorted((p for p in unmatched if not names.is_op(p)), key=names.point_order)
    if layerwise and missing:
        found = len([p for p in wanted if not names.is_op(p)]) - len(missing)
        notes.warn(f"{found} of {found + len(missing)} capture points were found in the OpenVINO model; not "
                   f"compared: {', '.join(missing[:6])}{' and more' if len(missing) > 6 else ''}")
    lacking = missing_note(unmatched, "OpenVINO model")
    if lacking:
        notes.warn(lacking)


def make_runner(candidate, ids: torch.Tensor, feed):
    if feed is not None:
        raise ParityError("--isolate: an OpenVINO model runs whole and cannot be fed the reference's layer inputs")
    ckpt = candidate.ckpt
    wanted = names.compared_points(ckpt, candidate.options.layerwise) + wanted_ops(ckpt, candidate.options)
    engine = _engine(candidate, wanted)
    hidden, vocab = hidden_width(ckpt), vocabulary(ckpt)

    def run(emit) -> None:
        b, s = ids.shape
        engine.reset(b)
        values = engine.run(ids)
        unmatched = dict(engine.matching.unmatched)
        for point, got, why in engine.points(values, b, s, hidden, vocab):
            if got is None:
                unmatched[point] = why
            else:
                emit(point, got)
        if b == 1:  # ops: one sequence (docs/ops.md's [1, S, width])
            read_ops(engine.matching, lambda v: engine.value(values, v), ckpt, s, emit, unmatched)
        _report_matching(candidate, engine, wanted, unmatched)

    return run


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """The prompt, then one token per step through the model's own cache: its states (a stateful IR), which
    OpenVINO keeps between the infer calls of one request."""
    ckpt = candidate.ckpt
    engine = _engine(candidate, names.compared_points(ckpt, candidate.options.layerwise))
    if not engine.states:
        raise ParityError(f"--decode: {engine.xml} is not stateful (it keeps no KV cache between calls); convert it "
                          f"with its cache made stateful (OpenVINO's make_stateful, optimum-cli's default), or drop "
                          f"--decode")
    hidden, vocab = hidden_width(ckpt), vocabulary(ckpt)

    def run(emit) -> None:
        engine.reset(ids.shape[0])
        engine.run(ids)
        start = ids.shape[1]
        for step, token in enumerate(tokens, 1):
            values = engine.run(torch.tensor([[token]]), start)
            start += 1
            for point, got, _ in engine.points(values, 1, 1, hidden, vocab):
                if got is not None:
                    emit(step, point, got)

    return run


def describe(path: Path, engine: dict) -> dict:
    """What the report's candidate entry adds: the IR, or for a checkpoint the weights setting it is converted at
    and the IRs OpenVINO converted it into (the cache). A checkpoint converted without compression keeps its
    weights (tensor_types: none quantized); with --engine-option weights, --calibrate reads them back."""
    xml = ir_file(path)
    if xml is None:
        weights = checked(engine)["weights"]
        out = {"source": "huggingface", "converter": "openvino.convert_model", "weights": weights or "none",
               "converted": conversions(path)}
        return out if weights else {**out, "tensor_types": {}}
    meta = xml.parent / "parity-conversion.json"
    out = {"source": "ir", "ir": str(xml)}
    if meta.is_file():
        out["conversion"] = json.loads(meta.read_text()).get("settings")
    return out


def conversions(path: Path) -> dict[str, str]:
    """{weights setting: IR} of this checkpoint's conversions in the cache (those made from its current files)."""
    found = {}
    source = Path(path).resolve()
    for meta in sorted((cache_root() / KIND).glob(f"{source.name}-*/parity-conversion.json")):
        key = json.loads(meta.read_text())
        if key.get("source") == str(source) and key.get("files") == fingerprint(source):
            found[key["settings"].get("weights") or "none"] = str(meta.parent / IR_NAMES[0])
    return found


def same_weights(ckpt, path: Path, out: Path, engine: dict) -> dict:
    """--same-weights: the IR's own weights (decompressed where NNCF compressed them) as a reference; for a
    checkpoint, those of the IR it is converted into at its --engine-option weights (the runner's, from the same
    cache; converted now if not yet)."""
    chosen = checked(engine)
    xml = ir_file(path)
    if xml is None or chosen["weights"]:  # an IR with weights= is refused there: it is compressed when converted
        xml = model_xml(Path(path), (), chosen, _source(ckpt, Path(path)) if xml is None else None)
    return read_back(ckpt, xml, Path(out))


def _source(ckpt, path: Path):
    """The candidate checkpoint opened as the runner opens it: the reference's own when it is the same directory,
    else with the reference's adapter among the known ones (the adapter directories are not passed here)."""
    if Path(path).resolve() == Path(ckpt.path).resolve():
        return ckpt
    if ckpt.resolved.generic:
        return _open(path, ())
    return open_checkpoint(path, adapters={**load_all(), ckpt.adapter.family: ckpt.adapter})


def _open(path: Path, adapter_dirs):
    """A checkpoint OpenVINO converts: through its family's adapter, else (a model no adapter knows) its structure
    discovered from transformers, whose module paths OpenVINO keeps in its op names."""
    return open_checkpoint(Path(path), adapter_dirs, discover=discover)


def weights(path: Path, engine: dict):
    """How the IR stores its weights (parity.engines.openvino.weights.stored: its .xml alone). A checkpoint, as the
    --engine-option weights setting has it converted, without converting: its IR's where the cache holds that
    conversion; else float32 as converted (its safetensors headers), or NNCF's mode by name."""
    chosen = checked(engine)["weights"]
    xml = ir_file(path)
    if xml is None:
        made = conversions(path).get(chosen or "none")
        xml = Path(made) if made is not None else None
    if xml is not None:
        return stored(xml)
    return Weights(scheme=WEIGHTS[chosen].lower()) if chosen else checkpoint(path, "float32")
