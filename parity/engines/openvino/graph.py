"""An OpenVINO model's ops seen as parity.engines.onnx.graph sees an ONNX graph, so that the same matching finds its
capture points (the openvino candidate kind runs the model; this module only reads it; export.py writes one from a
checkpoint, weights.py reads its weights back).

OpenVINO's PyTorch frontend names every op after the module it was traced in and the aten op it came from
(``__module.model.layers.5.mlp.down_proj/aten::linear/MatMul``): the module path before the first ``/`` is the
op's scope, which is what parity.engines.onnx.graph.by_module reads from an ONNX node's name or metadata. Op types are
renamed to their ONNX counterparts (Multiply -> Mul, MVN -> LayerNormalization, ...) so that the structural
matching (norms, residual adds) applies unchanged. Each value is named after the op that produces it (its
friendly name, ``:k`` added for output k > 0); ``output(value)`` gives the OpenVINO port to add as an output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from parity.engines.graph_ops import match_ops
from parity.engines.onnx.graph import Graph, Matching, match
from parity.names import is_op

# OpenVINO op type -> the ONNX op type parity.engines.onnx.graph looks for
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
    """An ov.Model's ops as parity.engines.onnx.graph.Graph's nodes, values and scopes (its matching reads only
    these)."""

    def __init__(self, model):  # noqa: D401 - replaces Graph's ONNX reading, keeps its methods
        import onnx.numpy_helper as nh  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

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
                if element_count(op) <= SMALL_CONSTANT and op.get_output_element_type(0).is_real():
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


def element_count(op) -> int:
    shape = op.get_output_partial_shape(0)
    if shape.is_dynamic:
        return SMALL_CONSTANT + 1
    n = 1
    for d in shape.to_shape():
        n *= d
    return n


def match_points(model, ckpt, wanted: list[str]) -> tuple[OVGraph, Matching]:
    """Which value of the OpenVINO model each wanted capture point is read from (parity.engines.onnx.graph.match: the
    final output, the module paths of the adapter's capture map, then structure), and each wanted op
    (parity.engines.graph_ops.match_ops: module paths; q_rope and k_rope from the inputs of the
    ScaledDotProductAttention op that transformers' sdpa attention converts to, which holds the scores and
    probabilities inside)."""
    g = OVGraph(model)
    matching = match(g, ckpt, wanted, {}, {})
    match_ops(g, ckpt, [p for p in wanted if is_op(p)], {}, matching)
    return g, matching
