"""An OpenVINO model's ops seen as parity.ports.onnx.graph sees an ONNX graph, so that the same matching finds its
capture points (the openvino candidate kind runs the model; this module only reads it).

OpenVINO's PyTorch frontend names every op after the module it was traced in and the aten op it came from
(``__module.model.layers.5.mlp.down_proj/aten::linear/MatMul``): the module path before the first ``/`` is the
op's scope, which is what parity.ports.onnx.graph.by_module reads from an ONNX node's name or metadata. Op types are
renamed to their ONNX counterparts (Multiply -> Mul, MVN -> LayerNormalization, ...) so that the structural
matching (norms, residual adds) applies unchanged. Each value is named after the op that produces it (its
friendly name, ``:k`` added for output k > 0); ``output(value)`` gives the OpenVINO port to add as an output.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from parity.errors import ParityError
from parity.names import is_op
from parity.ports.onnx.graph import Graph, Matching, match

# OpenVINO op type -> the ONNX op type parity.ports.onnx.graph looks for
OP_TYPES = {"Multiply": "Mul", "Divide": "Div", "Subtract": "Sub", "Power": "Pow", "Convert": "Cast",
            "ShapeOf": "Shape", "MVN": "LayerNormalization", "RMS": "RMSNormalization"}
# OpenVINO element type name -> ONNX TensorProto element type (0: not a float parity compares)
ELEMENTS = {"f32": 1, "u8": 2, "i8": 3, "i32": 6, "i64": 7, "boolean": 9, "f16": 10, "f64": 11, "bf16": 16}
SMALL_CONSTANT = 16   # constants read as values (a norm's exponent, its eps); the weights are not read
MODULE_PREFIX = "__module"


@dataclass
class Node:
    op_type: str
    name: str
    input: list[str] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    metadata_props: tuple = ()
    attribute: tuple = ()


def scope(friendly_name: str) -> str | None:
    """The module path an op was traced in (``model.layers.5.mlp.down_proj``), "" for the root module's own ops,
    None for ops the frontend or a transformation added without one."""
    head = friendly_name.split("/", 1)[0]
    if head == MODULE_PREFIX:
        return ""
    if head.startswith(MODULE_PREFIX + "."):
        return head[len(MODULE_PREFIX) + 1:]
    return None


def value_name(port) -> str:
    node = port.get_node()
    k = port.get_index()
    return node.get_friendly_name() if k == 0 else f"{node.get_friendly_name()}:{k}"


class OVGraph(Graph):
    """An ov.Model's ops as parity.ports.onnx.graph.Graph's nodes, values and scopes (its matching reads only these)."""

    def __init__(self, model):  # noqa: D401 - replaces Graph's ONNX reading, keeps its methods
        import onnx.numpy_helper as nh

        self.ports: dict[str, object] = {}
        self.nodes, self.types, small = [], {}, []
        self.inputs = [value_name(p.output(0)) for p in model.get_parameters()]
        self.outputs = []
        self.initializers: set[str] = set()
        for op in model.get_ordered_ops():
            kind = op.get_type_name()
            outs = []
            for port in op.outputs():
                name = value_name(port)
                self.ports[name] = port
                self.types[name] = _type(port)
                outs.append(name)
            if kind == "Result":
                self.outputs.append(value_name(op.input_value(0)))
                continue
            ins = [value_name(v) for v in op.input_values()]
            if kind == "Constant":
                self.initializers.add(outs[0])
                if _size(op) <= SMALL_CONSTANT and op.get_output_element_type(0).is_real():
                    small.append(nh.from_array(np.array(op.get_data()), outs[0]))
            self.nodes.append(Node(OP_TYPES.get(kind, kind), op.get_friendly_name(), ins, outs))
        self.model = SimpleNamespace(graph=SimpleNamespace(initializer=small))
        self.producer, self.consumers = {}, {}
        for k, node in enumerate(self.nodes):
            for v in node.output:
                self.producer[v] = k
            for v in node.input:
                self.consumers.setdefault(v, []).append(k)
        self.constants = set(self.initializers)
        for node in self.nodes:  # weights decompressed on the fly (Convert, Subtract, Multiply of constants)
            if node.op_type not in ("Shape", "ReadValue", "Parameter") and node.input \
                    and all(v in self.constants for v in node.input):
                self.constants.update(node.output)
        self.scopes = [scope(n.name) for n in self.nodes]
        self.values = set(self.producer) | set(self.inputs)

    def port(self, value: str):
        return self.ports[value]


def _type(port) -> tuple[int, list | None]:
    ps = port.get_partial_shape()
    dims = None if ps.rank.is_dynamic else [d.get_length() if d.is_static else "?" for d in ps]
    return ELEMENTS.get(port.get_element_type().get_type_name(), 0), dims


def _size(op) -> int:
    shape = op.get_output_partial_shape(0)
    if shape.is_dynamic:
        return SMALL_CONSTANT + 1
    n = 1
    for d in shape.to_shape():
        n *= d
    return n


def match_points(model, ckpt, wanted: list[str]) -> tuple[OVGraph, Matching]:
    """Which value of the OpenVINO model each wanted capture point is read from (parity.ports.onnx.graph.match: the
    final output, the module paths of the adapter's capture map, then structure), and each wanted op
    (parity.ports.graph_ops.match_ops: module paths; q_rope and k_rope from the inputs of the ScaledDotProductAttention
    op that transformers' sdpa attention converts to, which holds the scores and probabilities inside)."""
    from parity.ports.graph_ops import match_ops

    g = OVGraph(model)
    matching = match(g, ckpt, wanted, {}, {})
    match_ops(g, ckpt, [p for p in wanted if is_op(p)], {}, matching)
    return g, matching


# --------------------------------------------------------------------------------------------
# Conversion: OpenVINO's own converter on transformers' model

EXAMPLE_PAST, EXAMPLE_NEW = 3, 2   # the traced call: a cache of 3 positions, 2 new tokens (no size is special)


def export(ckpt, out: Path, compression: str | None = None) -> None:
    """Write into ``out`` the OpenVINO IR of the checkpoint: transformers' own model traced by
    ``openvino.convert_model`` (a causal LM with its KV cache, made stateful by OpenVINO's transformation),
    weights compressed by NNCF when ``compression`` names an nncf.CompressWeightsMode, float32 kept as is."""
    import openvino as ov

    from parity.reference.decode import decodes

    model = _torch_model(ckpt)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's warnings about Python branches transformers takes
            ovm = _convert_cached(ov, model) if decodes(ckpt) else _convert_plain(ov, model)
    except ParityError:
        raise
    except Exception as exc:  # noqa: BLE001 - the frontend's errors name the aten ops it could not convert
        text = " ".join(str(exc).split())
        said = text[text.find("Summary:"):][:300] if "Summary:" in text else text[:300]
        raise ParityError(f"{ckpt.path}: OpenVINO's converter (openvino.convert_model) could not convert this "
                          f"{ckpt.resolved.family} model ({said})") from None
    if compression:
        ovm = _compress(ovm, compression)
    Path(out).mkdir(parents=True, exist_ok=True)
    ov.save_model(ovm, str(Path(out) / "openvino_model.xml"), compress_to_fp16=False)


def _torch_model(ckpt):
    """transformers' model of the checkpoint in float32, its experts computed as batched matmuls (the
    one expert implementation a trace keeps whole: the others branch on which experts the example routed to)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    architecture = ckpt.variant.architectures[0]
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ParityError(f"{ckpt.path}: transformers {transformers.__version__} has no {architecture}")
    return cls.from_pretrained(ckpt.path, dtype=torch.float32, use_safetensors=True,
                               experts_implementation="batched_mm").eval()


def _example_ids(model, n: int, start: int = 3) -> torch.Tensor:
    return (torch.arange(start, start + n) % model.config.get_text_config().vocab_size)[None]


def _convert_plain(ov, model):
    ids = _example_ids(model, EXAMPLE_NEW + EXAMPLE_PAST)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return ov.convert_model(model, example_input={"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def _convert_cached(ov, model):
    """The model with its KV cache as inputs (``past_key_values.{i}.key``, ...) and outputs (``present...``),
    traced through transformers' own DynamicCache, then made stateful: the cache becomes the model's states."""
    import inspect

    from openvino._offline_transformations import apply_make_stateful_transformation
    from transformers.cache_utils import DynamicCache, DynamicLayer

    from parity.reference.models import cached_forward

    _, filled = cached_forward(model, _example_ids(model, EXAMPLE_PAST))
    held = [i for i, layer in enumerate(filled.layers)  # KV-sharing layers keep no cache of their own
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel()]
    past = [t for i in held for t in (filled.layers[i].keys, filled.layers[i].values)]
    n_layers = len(filled.layers)
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    original = model.forward

    def forward(input_ids, attention_mask, position_ids, past):
        layers = [DynamicLayer() for _ in range(n_layers)]
        for i, k, v in zip(held, past[0::2], past[1::2]):
            layers[i].keys, layers[i].values, layers[i].is_initialized, layers[i].device = k, v, True, k.device
        cache = DynamicCache()
        cache.layers = layers
        out = original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=True, **{arg: cache})
        kept = getattr(out, arg, None) or out.past_key_values
        return (out.logits, *[t for i in held for t in (kept.layers[i].keys, kept.layers[i].values)])

    ids = _example_ids(model, EXAMPLE_NEW, 3 + EXAMPLE_PAST)
    example = {"input_ids": ids, "attention_mask": torch.ones(1, EXAMPLE_PAST + EXAMPLE_NEW, dtype=torch.long),
               "position_ids": torch.arange(EXAMPLE_PAST, EXAMPLE_PAST + EXAMPLE_NEW)[None], "past": tuple(past)}
    model.forward = forward  # traced as the model itself: op names keep transformers' module paths
    try:
        ovm = ov.convert_model(model, example_input=example)
    finally:
        del model.forward
    cache_names = [f"past_key_values.{i}.{kv}" for i in held for kv in ("key", "value")]
    for port, name in zip(ovm.inputs, ["input_ids", "attention_mask", "position_ids", *cache_names]):
        port.get_tensor().set_names({name})
    for port, name in zip(ovm.outputs, ["logits", *(n.replace("past_key_values", "present") for n in cache_names)]):
        port.get_tensor().set_names({name})
    # heads and head_dim static: the states start empty ([batch, heads, 0, head_dim])
    ovm.reshape({name: ov.PartialShape([-1, t.shape[1], -1, t.shape[3]]) for name, t in zip(cache_names, past)})
    apply_make_stateful_transformation(ovm, {n: n.replace("past_key_values", "present") for n in cache_names})
    return ovm


def _compress(ovm, mode: str):
    """NNCF's data-free weight compression (its defaults: int4 groups of 128 where the width allows, else
    per channel; the embeddings and the head kept in int8, as NNCF chooses)."""
    from parity.ports.engines import require

    nncf = require("nncf", "openvino", "NNCF (OpenVINO's weight compression)")
    try:
        return nncf.compress_weights(ovm, mode=getattr(nncf.CompressWeightsMode, mode))
    except Exception:  # noqa: BLE001 - a width that 128 does not divide: per-channel scales
        return nncf.compress_weights(ovm, mode=getattr(nncf.CompressWeightsMode, mode), group_size=-1)


# --------------------------------------------------------------------------------------------
# Same weights: the IR's own weights read back

BANDS = {8: 0.02, 4: 0.3}  # rel_l2 of an NNCF-compressed tensor beyond which it is not a compression of it
EXACT = 1e-6


def read_back(ckpt, xml: Path, out: Path) -> dict:
    """Write into ``out`` the reference checkpoint holding the IR's own weights: each MatMul's and Gather's weight
    (found by the module path in its op's name), decompressed by OpenVINO itself, where NNCF stored it in 8 or 4
    bits; the checkpoint's own tensors elsewhere. A tensor that is not a compression of the checkpoint's (beyond
    its band) is reported, and the reference keeps the checkpoint's own there (parity.ports.gguf.weights does the same).
    OpenVINO computes in float32 on decompressed weights (dynamic quantization is off): the arithmetic is plain."""
    import openvino as ov

    from parity.checkpoint import stored_tensor_map
    from parity.compare import metrics
    from parity.ports.same_weights import write_reference
    from parity.reference.arithmetic.ggml import Arithmetic
    from parity.storage.lazy import Dequantizer

    model = ov.Core().read_model(str(xml))
    stored = stored_tensor_map(ckpt.resolved, ckpt.check())
    found = _weights(model)
    values = _evaluate(ov, [port for port, _ in found.values()])
    originals = Dequantizer.of(ckpt)
    tensors = {name: originals.read(name, torch.float32) for name in stored}
    tied = [n for n in stored if n.endswith("embed_tokens.weight") or n.endswith("wte.weight")]
    types: dict[str, int] = {}
    wrong: dict[str, float] = {}
    untie = False
    for (name, (_, kind)), value in zip(found.items(), values):
        head = name not in stored and name.endswith("lm_head.weight") and len(tied) == 1
        original = tensors.get(tied[0] if head else name)
        if original is None:
            continue
        x = torch.from_numpy(np.array(value, dtype=np.float32))
        x = x if x.shape == original.shape else x.T if x.T.shape == original.shape else None
        bits = _bits(kind)
        error = metrics(x, original)["rel_l2"] if x is not None else float("inf")
        types[kind] = types.get(kind, 0) + 1
        if not error <= BANDS.get(bits, EXACT if kind == "f32" else 1e-3):
            wrong[name] = error
            continue
        if head:  # a tied head compressed apart from the embedding: two matrices
            untie = untie or not torch.equal(x, tensors[tied[0]])
            tensors[name] = x.contiguous()
        else:
            tensors[name] = x.contiguous()
    if not untie:
        tensors = {n: t for n, t in tensors.items() if n in stored}
    write_reference(ckpt, Path(out), tensors, Arithmetic(engine="OpenVINO (decompressed weights, float32)"),
                    untie=untie)
    return {"from": str(xml), "types": types, "tensors": len(found), "not_a_quantization": wrong,
            "bands": {kind: BANDS.get(_bits(kind), EXACT) for kind in sorted(types)}}


def _bits(kind: str) -> int | None:
    return {"u8": 8, "i8": 8, "u4": 4, "i4": 4, "nf4": 4, "f4e2m1": 4}.get(kind)


def _weights(model) -> dict[str, tuple[object, str]]:
    """checkpoint tensor name -> (the port computing a MatMul's or a Gather's weight from constants, the element
    type it is stored in)."""
    found = {}
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        path = scope(op.get_friendly_name())
        if kind not in ("MatMul", "Gather") or not path:
            continue
        port = op.input_value(1 if kind == "MatMul" else 0)
        storage = _stored_as(port.get_node())
        if storage is not None:
            found.setdefault(f"{path}.weight", (port, storage))
    return found


def _stored_as(node) -> str | None:
    """The element type of the largest constant a constant-only subgraph reads (its weight), None when it reads an
    input (an activation)."""
    best, size, stack, seen = None, -1, [node], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.get_type_name() == "Constant":
            if _size(n) > size:
                best, size = n.get_output_element_type(0).get_type_name(), _size(n)
            continue
        if n.get_type_name() in ("Parameter", "ReadValue") or n.get_input_size() == 0:
            return None
        stack.extend(v.get_node() for v in n.input_values())
    return best


def _evaluate(ov, ports: list) -> list[np.ndarray]:
    """The values of constant subgraphs, computed by OpenVINO (its own decompression of NNCF's weights)."""
    if not ports:
        return []
    from openvino import opset13

    weights = ov.Model([opset13.result(p) for p in ports], [], "weights")
    compiled = ov.Core().compile_model(weights, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    request.infer({})
    return [request.get_output_tensor(k).data.copy() for k in range(len(ports))]


# --------------------------------------------------------------------------------------------
# How an IR stores its weights: its .xml alone (each Const's element type, shape and size; the .bin is not read)

FLOAT_ELEMENTS = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64"}
DECOMPRESSION = ("Convert", "Subtract", "Multiply", "Reshape")   # NNCF's path from a compressed Const to its use


def stored(xml: Path):
    """How an IR stores its weights (parity.candidates.weights.Weights), from its .xml: every Const NNCF compressed
    (u8, i8, u4, i4, nf4, ...) or left in float of more than one value (a norm's [1, 1, width], and RoPE's
    frequencies, which cannot be told from one; not the shapes or epsilons), counted by its element type; the zero
    points and scales of its decompression (a Subtract's or Multiply's second input, where the first comes from a
    compressed Const) add their bytes only. The scheme is NNCF's mode as its rt_info records it (else the
    commonest compressed type) and its groups: a Const of [out, groups, size] is compressed in groups of ``size``,
    one of [out, in] per channel."""
    import xml.etree.ElementTree as ElementTree

    from parity.weights import Tally, commonest

    try:
        root = ElementTree.parse(xml).getroot()
    except (OSError, ElementTree.ParseError) as exc:
        raise ParityError(f"{xml}: not a readable OpenVINO IR ({exc}); convert it again") from None
    layers = {layer.get("id"): layer for layer in root.iter("layer")}
    feeds = {(e.get("to-layer"), e.get("to-port")): e.get("from-layer") for e in root.iter("edge")}
    consts = {}
    for lid, layer in layers.items():
        data = layer.find("data")
        if layer.get("type") == "Const" and data is not None:
            shape = tuple(int(d) for d in (data.get("shape") or "").replace(" ", "").split(",") if d)
            consts[lid] = (data.get("element_type"), shape, int(data.get("size") or 0))

    def source(lid: str | None) -> str | None:
        """The Const a value is decompressed from: back through each op's first input along DECOMPRESSION."""
        while lid in layers and layers[lid].get("type") in DECOMPRESSION:
            lid = feeds.get((lid, "0"))
        return lid

    compressed = {lid for lid, (kind, _, _) in consts.items() if _bits(kind)}
    serves = {source(feeds.get((lid, "1"))) for lid, layer in layers.items()
              if layer.get("type") in ("Subtract", "Multiply") and source(feeds.get((lid, "0"))) in compressed}
    tally, groups = Tally(), {}
    for lid, (kind, shape, size) in consts.items():
        if lid in serves:
            tally.stored += size
            continue
        elements = math.prod(shape)
        if lid in compressed or (kind in FLOAT_ELEMENTS and shape and elements > 1):
            tally.add(FLOAT_ELEMENTS.get(kind, kind), elements, size)
            if lid in compressed:
                groups.setdefault(kind, []).append(shape[-1] if len(shape) == 3 else None)
    main = commonest(tally.types)
    if main is None:
        return tally.weights()
    mode = root.find("rt_info/nncf/weight_compression/mode")
    sizes = sorted({g for g in groups[main] if g is not None})
    scheme = (f"{mode.get('value') if mode is not None else main}, "
              f"{'groups of ' + '/'.join(map(str, sizes)) if sizes else 'per channel'}")
    notes = [f"{len(groups[kind])} {kind} matrices" for kind in groups if kind != main]
    return tally.weights(scheme, notes[:2])
