"""Which values of an ONNX graph are parity's capture points (the ONNX candidate kind runs the graph; this
module only reads it).

Capture points come from, in this order of precedence:

1. ``--map POINT=VALUE``: any value of the graph, named explicitly;
2. values named exactly as the point (the debug outputs of ``parity convert --to onnx``);
3. the final output (``logits``, or the last hidden state of a model without an LM head);
4. the module path that the adapter's capture map gives for the point: exporters keep module paths
   in node names (``/model/layers.0/mlp/Add``) or metadata (torch.onnx's ``name_scopes``), under a
   wrapper's prefix or none (Graph.align); the point is the value leaving that module (or entering it)
   with the model's hidden width, seen through onnxruntime's quantizer nodes (unquantized);
5. structure: the k-th norm op of hidden width (fused LayerNormalization / RMSNormalization /
   SimplifiedLayerNormalization / Skip*LayerNormalization, or a decomposed RMSNorm or LayerNorm) is
   the k-th norm the family has, so its output is that norm's point (``attn_in`` after ``attn_norm``)
   and its input the residual stream (``layers.{i-1}.out`` before ``layers.{i}.attn_norm``); the
   residual adds around them give what each sublayer adds (``attn_out``, ``mlp_out``) and the stream.

A module path is used only where exactly one value of the right width crosses the module's boundary:
where two do (onnxruntime-genai fuses each residual add into the next norm), structure decides.

Matched values are added to the graph's outputs; each is checked at run time to be [batch, sequence,
width] before it is compared. The report lists every point with the value it was read from and how
(``report.matching``); points that could not be matched are not compared, and say why.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

import numpy as np

from parity.errors import ParityError

FUSED_NORMS = {"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"}
SKIP_NORMS = {"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"}
ELEMENTWISE_WITH_CONSTANT = {"Mul", "Add", "Div", "Sub"}
SHAPE_OPS = {"Shape", "ShapeOf"}  # read a value's shape, not its data (ONNX's, OpenVINO's)
QUANTIZERS = {"QuantizeLinear", "DynamicQuantizeLinear", "DequantizeLinear"}  # onnxruntime's quantizers add them
# which point a norm's output (and the stream it reads) is, by the norm's neutral slot
NORM_OUTPUT_POINT = {"attn_norm": "attn_in", "attn_post_norm": "attn_out", "attn_res_norm": "mid",
                     "mlp_norm": "mlp_in", "mlp_post_norm": "mlp_out", "mlp_res_norm": "out"}
LAYER_NORM_ORDER = ("attn_norm", "attn.q_norm", "attn.k_norm", "attn.v_norm", "attn_post_norm", "attn_res_norm", "mlp_norm", "mlp_dense_post_norm", "moe_norm",
                    "moe_post_norm", "mlp_post_norm", "mlp_res_norm", "pli_post_norm")


@dataclass
class Norm:
    index: int                 # the producing node's position (forward order)
    output: str
    stream: str | None         # the value the norm reads (None when fused away)
    width: int | None
    op: str


class Graph:
    """An ONNX graph's values: producers, consumers, module scopes, static shapes, constants."""

    alignment: tuple[str, str] = ("", "")  # (prefix of the checkpoint's module paths, the graph's in its place): align

    def __init__(self, model):
        import onnx  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

        try:
            model = onnx.shape_inference.infer_shapes(model)
        except Exception:  # noqa: BLE001 - contrib ops or a big model: go on without inferred shapes
            pass
        self.model = model
        g = model.graph
        self.nodes = list(g.node)
        self.inputs = [i.name for i in g.input]
        self.outputs = [o.name for o in g.output]
        self.initializers = {i.name for i in g.initializer}
        self.types: dict[str, tuple[int, list]] = {}
        for info in [*g.input, *g.output, *g.value_info]:
            t = info.type.tensor_type
            if info.type.HasField("tensor_type"):
                dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim] \
                    if t.HasField("shape") else None
                self.types[info.name] = (t.elem_type, dims)
        for init in g.initializer:
            self.types[init.name] = (init.data_type, list(init.dims))
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for k, node in enumerate(self.nodes):
            for v in node.output:
                if v:
                    self.producer[v] = k
            for v in node.input:
                if v:
                    self.consumers.setdefault(v, []).append(k)
        self.constants = set(self.initializers)
        for node in self.nodes:
            if node.op_type == "Constant" or (node.input and all(not v or v in self.constants for v in node.input)
                                              and node.op_type not in ("Shape", "Size", "RandomNormalLike")):
                self.constants.update(v for v in node.output if v)
        self.scopes = [node_scope(n) for n in self.nodes]
        self.values = set(self.producer) | set(self.inputs) | self.initializers

    def width(self, value: str) -> int | None:
        dims = self.types.get(value, (None, None))[1]
        return dims[-1] if dims and isinstance(dims[-1], int) and dims[-1] > 0 else None

    def rank(self, value: str) -> int | None:
        dims = self.types.get(value, (None, None))[1]
        return None if dims is None else len(dims)

    def fits(self, value: str, width: int) -> bool:
        """A float activation [.., width] (unknown shapes pass here; run time checks them)."""
        elem, dims = self.types.get(value, (None, None))
        if elem is not None and elem not in (1, 10, 11, 16):  # float, float16, double, bfloat16
            return False
        if value in self.constants:
            return False
        if dims is None:
            return True
        return len(dims) in (2, 3) and (not isinstance(dims[-1], int) or dims[-1] in (0, width))

    def in_scope(self, k: int, module: str) -> bool:
        s, module = self.scopes[k], self.module_path(module)
        return s is not None and (s == module or s.startswith(module + "."))

    def module_path(self, module: str) -> str:
        """The graph's path of a module of the checkpoint's model (align)."""
        drop, add = self.alignment
        if drop and module.startswith(drop + "."):
            module = module[len(drop) + 1:]
        return f"{add}.{module}" if add else module

    def align(self, modules: list[str]) -> None:
        """Learn how the graph's scopes name the checkpoint model's ``modules``: as they are, under a wrapper's
        prefix (``inner.model.layers.0``, a module that held the model when it was exported), or without the
        base model's prefix (``encoder.layer.0`` exported from BertModel for ``bert.encoder.layer.0``). Each module
        votes for where its longest dotted tail (two parts at least) sits in the scopes; most votes win."""
        scopes = {s for s in self.scopes if s}
        if not scopes or any(s == m or s.startswith(m + ".") for m in modules for s in scopes):
            return
        votes: dict[tuple[str, str], int] = {}
        for m in modules:
            parts = m.split(".")
            for k in range(len(parts) - 1):
                tail = parts[k:]
                hits = {".".join(sp[:i]) for sp in (s.split(".") for s in scopes)
                        for i in range(len(sp) - len(tail) + 1) if sp[i:i + len(tail)] == tail}
                for add in hits:
                    votes[".".join(parts[:k]), add] = votes.get((".".join(parts[:k]), add), 0) + 1
                if hits:
                    break
        if votes:
            drop, add = max(votes, key=votes.get)
            self.alignment = (drop, add)

    def has_scopes(self) -> bool:
        return any(s for s in self.scopes)


def node_scope(node) -> str | None:
    """The module path a node was exported from: torch.onnx's name_scopes metadata, or a /a/b/Op name."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                break
            paths = [s for s in scopes[:-1] if isinstance(s, str)]
            return paths[-1] if paths else ""
    if node.name.startswith("/"):
        return ".".join(p for p in node.name.split("/")[1:-1] if p)
    return None


# --------------------------------------------------------------------------------------------
# Matching capture points to values


def crossing(g: Graph, module: str, io: str) -> list[str] | None:
    """The values leaving (io "output") or entering (io "input") a module's nodes, in graph order; None when the
    graph has no node of that module."""
    inside = [k for k in range(len(g.nodes)) if g.in_scope(k, module)]
    if not inside:
        return None
    members = set(inside)
    found: list[str] = []
    for k in inside:
        node = g.nodes[k]
        if io == "output":
            for v in node.output:  # a value only a shape op reads outside (its length, for a mask) stays inside
                if v and (v in g.outputs or any(j not in members and g.nodes[j].op_type not in SHAPE_OPS
                                                for j in g.consumers.get(v, []))):
                    found.append(unquantized(g, dequantized(g, v)))
        else:
            for v in node.input:
                if v and v not in g.constants and g.producer.get(v) not in members:
                    found.append(unquantized(g, v))
    return list(dict.fromkeys(found))


def unquantized(g: Graph, value: str) -> str:
    """The float value that quantizers turned into ``value`` (a QuantizeLinear's or a DynamicQuantizeLinear's
    integers, or the rounded floats of a Q/DQ pair only projections read): what the module reads before
    onnxruntime's quantizers round it for a kernel (the reference rounds it in the kernel too:
    parity.engines.onnx.arithmetic). A pair whose rounded value the model goes on with is kept: the reference
    rounds that capture point (parity.engines.onnx.weights)."""
    while (k := g.producer.get(value)) is not None and g.nodes[k].op_type in QUANTIZERS:
        source = g.nodes[k].input[0]
        if g.nodes[k].op_type == "DequantizeLinear" and not kernel_rounding(g, k):
            break  # a kernel's integer output, or a value the model itself goes on with rounded
        value = source
    return value


def kernel_rounding(g: Graph, k: int) -> bool:
    """Whether node ``k`` is the DequantizeLinear of a Q/DQ pair whose rounded value only projections read (a
    MatMul or Gemm by a constant weight): the rounding of a kernel's input, not a value of the model."""
    node = g.nodes[k]
    q = g.producer.get(node.input[0])
    readers = g.consumers.get(node.output[0], [])
    return (node.op_type == "DequantizeLinear" and q is not None and g.nodes[q].op_type == "QuantizeLinear"
            and node.output[0] not in g.outputs and bool(readers)
            and all(g.nodes[j].op_type in ("MatMul", "Gemm") and len(g.nodes[j].input) > 1
                    and g.nodes[j].input[1] in g.constants for j in readers))


def dequantized(g: Graph, value: str) -> str:
    """The float a module's integer output becomes outside it (QLinearMatMul's, through a DequantizeLinear)."""
    readers = g.consumers.get(value, [])
    if len(readers) == 1 and g.nodes[readers[0]].op_type == "DequantizeLinear":
        return g.nodes[readers[0]].output[0]
    return value


def by_module(g: Graph, module: str, io: str, width: int) -> tuple[str | None, str]:
    """The value leaving (io "output") or entering (io "input") a module's nodes, of the given width;
    (None, why) when there is none, or more than one."""
    found = crossing(g, module, io)
    verb = "leaves" if io == "output" else "enters"
    if found is None:
        return None, f"no node of module {module}"
    found = [v for v in found if g.fits(v, width)]
    exact = [v for v in found if g.width(v) == width]
    unknown = [v for v in found if g.width(v) is None]
    # one value, or none: a module that two stream-wide values enter or leave (a fused residual add
    # and norm, as onnxruntime-genai builds them) cannot say which one is the point
    if len(exact) == 1:
        return exact[0], ""
    if not exact and len(unknown) == 1:
        return unknown[0], ""
    if len(exact) > 1:
        return None, f"{len(exact)} values of width {width} {verb.removesuffix('s')} {module}"
    return None, f"no value of width {width} {verb} {module}"


def find_norms(g: Graph) -> list[Norm]:
    """Every norm op of the graph, fused or decomposed, in forward order."""
    norms: list[Norm] = []
    for k, node in enumerate(g.nodes):
        if node.op_type in FUSED_NORMS:
            stream, p = node.input[0], g.producer.get(node.input[0])
            if p is not None and g.nodes[p].op_type == "Cast":  # the upcast to float32
                stream = g.nodes[p].input[0]
            out = _affine(g, node.output[0])
            norms.append(Norm(k, out, stream, g.width(out), node.op_type))
        elif node.op_type in SKIP_NORMS:
            stream = node.output[3] if len(node.output) > 3 and node.output[3] else None
            out = _affine(g, node.output[0])
            norms.append(Norm(k, out, stream, g.width(out), node.op_type))
        elif node.op_type == "ReduceMean":
            norm = _decomposed_norm(g, k)
            if norm is not None:
                norms.append(norm)
    return sorted(norms, key=lambda n: n.index)


def _is_square(g: Graph, node) -> str | None:
    """x for Pow(x, 2) or Mul(x, x)."""
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node.input[0]
    if node.op_type == "Pow" and node.input[1] in g.constants:
        value = _constant_value(g, node.input[1])
        if value is not None and value.size == 1 and float(value.reshape(-1)[0]) == 2.0:
            return node.input[0]
    return None


def _constant_value(g: Graph, name: str):
    import onnx.numpy_helper as nh  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

    for init in g.model.graph.initializer:
        if init.name == name:
            return nh.to_array(init) if not init.external_data else None
    k = g.producer.get(name)
    if k is not None and g.nodes[k].op_type == "Constant":
        for attr in g.nodes[k].attribute:
            if attr.name == "value":
                return nh.to_array(attr.t)
            if attr.name in ("value_float", "value_int"):
                return np.array(attr.f if attr.name == "value_float" else attr.i)
    return None


def _decomposed_norm(g: Graph, k: int) -> Norm | None:
    """ReduceMean(x^2) ... x * rsqrt(.) [* w] [+ b]: an RMSNorm, or a LayerNorm when x = y - mean(y)."""
    squared = g.producer.get(g.nodes[k].input[0])
    if squared is None:
        return None
    centred = _is_square(g, g.nodes[squared])
    if centred is None:
        return None
    stream = centred
    p = g.producer.get(centred)
    if p is not None and g.nodes[p].op_type == "Sub":  # LayerNorm: (y - mean(y))
        m = g.producer.get(g.nodes[p].input[1])
        if m is not None and g.nodes[m].op_type == "ReduceMean" and g.nodes[m].input[0] == g.nodes[p].input[0]:
            stream = g.nodes[p].input[0]
    p = g.producer.get(stream)
    if p is not None and g.nodes[p].op_type == "Cast":  # the upcast to float32
        stream = g.nodes[p].input[0]
    # from the statistics forward to the op that scales the centred value: x * rsqrt(...) or x / sqrt(...)
    frontier, seen, normalised = [g.nodes[k].output[0]], set(), None
    for _ in range(6):
        following = []
        for v in frontier:
            for j in g.consumers.get(v, []):
                if j in seen:
                    continue
                seen.add(j)
                node = g.nodes[j]
                if centred in node.input and node.op_type in ("Mul", "Div"):
                    normalised = node.output[0]
                    break
                following.extend(o for o in node.output if o)
            if normalised:
                break
        if normalised or not following:
            break
        frontier = following
    if normalised is None:
        return None
    out = _affine(g, normalised)
    return Norm(g.producer[out], out, stream, g.width(out), "decomposed")


def _affine(g: Graph, out: str) -> str:
    """Past a normalised value's weight, bias and casts (elementwise ops with a constant), while it has
    one consumer: the norm's output as the model uses it."""
    while True:
        users = g.consumers.get(out, [])
        if len(users) != 1 or out in g.outputs:
            return out
        node = g.nodes[users[0]]
        others = [v for v in node.input if v and v != out]
        if node.op_type == "Cast" or (node.op_type in ELEMENTWISE_WITH_CONSTANT and others
                                      and all(v in g.constants for v in others)):
            out = node.output[0]
            continue
        return out


def expected_norms(ckpt) -> list[str]:
    """The family's norms of hidden width, in forward order, by neutral name."""
    r = ckpt.resolved
    hidden = hidden_width(ckpt)
    present = {n.neutral for n in r.norms if n.dim == hidden}
    order = ["embed.norm"]
    for i in range(r.num_layers):
        order += [f"layers.{i}.{slot}" for slot in LAYER_NORM_ORDER]
    order += ["final_norm", "head.norm"]
    return [n for n in order if n in present]


def by_structure(g: Graph, ckpt) -> tuple[dict[str, tuple[str, str]], str | None]:
    """Points from the k-th norm op of hidden width, then from the residual adds around them:
    ({point: (value, how)}, why nothing matched)."""
    hidden = hidden_width(ckpt)
    found = [n for n in find_norms(g) if n.width == hidden]
    expected = expected_norms(ckpt)
    if not found:
        return {}, "no norm op of hidden width found"
    if len(found) != len(expected):
        return {}, f"found {len(found)} norm ops of width {hidden}, the family has {len(expected)}"
    r = ckpt.resolved
    layers = r.num_layers
    norms = {name: norm for norm, name in zip(found, expected)}
    # layers whose output is more than the MLP's residual add (Gemma 4: per-layer input, layer scalar)
    extra = {n.layer for n in r.norms if n.neutral.endswith(".pli_post_norm")} | \
        {int(t.neutral[0].split(".")[1]) for t in r.tensors if t.neutral[0].endswith(".layer_scalar")}
    # layers whose MLP sits beside attention (GPT-NeoX, Phi, Cohere): out = x + (mlp + attn), no `mid`
    parallel = [bool(r.settings["mlp.parallel"].at(i)) if "mlp.parallel" in r.settings else False
                for i in range(layers)]
    out: dict[str, tuple[str, str]] = {}

    def put(point: str, value: str | None, how: str) -> None:
        if value is not None and point not in out:
            out[point] = (value, how)

    def get(point: str) -> str | None:
        return out[point][0] if point in out else None

    for k, name in enumerate(expected):
        norm = norms[name]
        how = f"structure: norm {k + 1} of {len(found)} ({norm.op}) is {name}"
        if name == "embed.norm":
            put("embed", norm.output, how)
        elif name == "final_norm":
            put("final_norm", norm.output, how)
            put(f"layers.{layers - 1}.out", norm.stream, how + ", its input")
        elif name.startswith("layers."):
            _, i, slot = name.split(".", 2)
            i = int(i)
            point = NORM_OUTPUT_POINT.get(slot)
            if point and not (point == "out" and i in extra):
                put(f"layers.{i}.{point}", norm.output, how)
            if slot == "attn_norm":
                put("embed" if i == 0 else f"layers.{i - 1}.out", norm.stream, how + ", its input")
            if slot == "mlp_norm" and not parallel[i]:
                put(f"layers.{i}.mid", norm.stream, how + ", its input")
    for _ in range(2):  # each layer's outputs are the next one's inputs: go over them twice
        for i in range(layers):
            x = "embed" if i == 0 else f"layers.{i - 1}.out"
            p = f"layers.{i}."
            if f"{p}attn_norm" not in norms:  # no pre-norm: attention reads the stream itself
                put(p + "attn_in", get(x), f"structure: the layer's input ({x}), no attention pre-norm")
            if parallel[i]:
                _parallel_residual(g, get, put, x, p, shared_norm=r.layer("mlp.shared_norm", i))
                continue
            _residual(g, get, put, x, p + "attn_out", p + "mid", norms.get(f"{p}attn_res_norm"))
            if f"{p}mlp_norm" not in norms:
                put(p + "mlp_in", get(p + "mid"), "structure: the stream after attention, no MLP pre-norm")
            _residual(g, get, put, p + "mid", p + "mlp_out", p + "out",
                      norms.get(f"{p}mlp_res_norm"), summed_is_output=i not in extra)
    return out, None


def _parallel_residual(g: Graph, get, put, stream: str, p: str, shared_norm: bool) -> None:
    """A parallel block: out = x + (mlp + attn), with no stream between the adds. The outer add reads x; the inner
    add's operands are the two sublayers' outputs, told apart by the softmax on attention's side."""
    x, total = get(stream), get(p + "out")
    how = f"structure: the parallel residual add {stream} + ({p}attn_out + {p}mlp_out)"
    if shared_norm:  # one norm for both sublayers: the MLP reads what attention reads
        put(p + "mlp_in", get(p + "attn_in"), "structure: the layer's one norm, shared by attention and the MLP")
    if x is None:
        return
    if total is None:
        adds = [j for j in g.consumers.get(x, []) if g.nodes[j].op_type == "Add"
                and all(v not in g.constants for v in g.nodes[j].input)]
        if len(adds) != 1:
            return
        total = g.nodes[adds[0]].output[0]
        put(p + "out", total, how)
    outer = g.nodes[g.producer[total]] if total in g.producer else None
    if outer is None or outer.op_type != "Add" or len(outer.input) != 2 or x not in outer.input:
        return
    summed = outer.input[1] if outer.input[0] == x else outer.input[0]
    inner = g.nodes[g.producer[summed]] if summed in g.producer else None
    if inner is None or inner.op_type != "Add" or len(inner.input) != 2:
        return
    sides = [_reaches_softmax(g, v, stop={x, get(p + "attn_in"), get(p + "mlp_in")}) for v in inner.input]
    if sides.count(True) != 1:
        return
    attn, mlp = (inner.input[0], inner.input[1]) if sides[0] else (inner.input[1], inner.input[0])
    put(p + "attn_out", attn, how)
    put(p + "mlp_out", mlp, how)


def _reaches_softmax(g: Graph, value: str, stop: set) -> bool:
    """Whether the subgraph producing ``value``, back to the ``stop`` values, holds a Softmax (attention's side)."""
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        if v in seen or v in stop or v not in g.producer:
            continue
        seen.add(v)
        node = g.nodes[g.producer[v]]
        if node.op_type == "Softmax":
            return True
        todo.extend(node.input)
    return False


def _residual(g: Graph, get, put, stream: str, added: str, summed: str, res_norm: Norm | None,
              summed_is_output: bool = True) -> None:
    """x + f(x): with two of (stream x, what the sublayer adds, their sum) known, find the third.

    The sum is the point ``summed`` unless a norm follows the add (Post-Norm), whose input it then is.
    """
    total = res_norm.stream if res_norm is not None else (get(summed) if summed_is_output else None)
    x, a = get(stream), get(added)
    how = f"structure: the residual add {stream} + {added}"
    if total is None and (a is not None or x is not None):
        adds = [j for j in g.consumers.get(a if a is not None else x, []) if g.nodes[j].op_type == "Add"]
        if a is None:  # from the stream, only when one add reads it
            adds = [j for j in adds if all(v not in g.constants for v in g.nodes[j].input)]
        if len(adds) == 1:
            total = g.nodes[adds[0]].output[0]
            if res_norm is None and summed_is_output:
                put(summed, total, how)
    if total is None:
        return
    k = g.producer.get(total)
    if k is None:
        return
    node = g.nodes[k]
    if node.op_type == "Add" and len(node.input) == 2:
        left, right = node.input
    elif node.op_type in SKIP_NORMS and len(node.output) > 3 and node.output[3] == total:
        left, right = node.input[:2]  # the fused add: input + skip
    else:
        return
    if x in (left, right) and a is None:
        put(added, right if left == x else left, how)
    elif a in (left, right) and x is None:
        put(stream, right if left == a else left, how)


def hidden_width(ckpt) -> int:
    return ckpt.resolved.embedding_shape[1]


def vocabulary(ckpt) -> int:
    return ckpt.resolved.embedding_shape[0]


@dataclass
class Matching:
    points: dict[str, dict] = field(default_factory=dict)     # point -> {"value", "how"}
    unmatched: dict[str, str] = field(default_factory=dict)   # point -> why
    layouts: dict[str, str] = field(default_factory=dict)     # op -> how its value is laid out (engines.graph_ops)
    own_export: bool = False
    warnings: list[str] = field(default_factory=list)


def match(g: Graph, ckpt, wanted: list[str], maps: dict[str, str], metadata: dict[str, str]) -> Matching:
    """Which graph value each wanted capture point is read from, and how it was found."""
    result = Matching(own_export=metadata.get("parity.format") == "parity-onnx")
    hidden, vocab = hidden_width(ckpt), vocabulary(ckpt)
    capture = {c.name: c for c in ckpt.resolved.capture}
    op_names = {c.name for c in ckpt.resolved.ops}
    wanted = [p for p in wanted if p not in op_names]  # ops: parity.engines.graph_ops.match_ops
    final = wanted[-1] if wanted else None
    for point, value in maps.items():
        if point not in capture and point not in op_names:
            raise ParityError(f"--map {point}={value}: {point} is not a capture point (or an op) of this "
                              f"{ckpt.resolved.family} model; points: {', '.join(capture)}")
        if value not in g.values:
            raise ParityError(f"--map {point}={value}: the ONNX graph has no value named {value!r}")
    structure: dict[str, tuple[str, str]] | None = None
    why_structure = None
    g.align([c.module for c in capture.values() if c.module])
    for point in wanted:
        width = vocab if point == "logits" else hidden
        if point in maps:
            result.points[point] = {"value": maps[point], "how": "--map"}
            continue
        if point in g.values and point not in g.inputs:
            how = "debug output" if result.own_export and point in g.outputs else \
                "final output" if point == final and point in g.outputs else "value name"
            result.points[point] = {"value": point, "how": how}
            continue
        if point == final:
            value = _final_output(g, point, width)
            if value is not None:
                result.points[point] = {"value": value, "how": "final output"}
                continue
        c = capture.get(point)
        why_module = "the graph keeps no module paths"
        if c is not None and c.module and g.has_scopes():
            value, why_module = by_module(g, c.module, c.io, width)
            if value is not None:
                result.points[point] = {"value": value, "how": f"module path {g.module_path(c.module)} ({c.io})"}
                continue
        if structure is None:
            structure, why_structure = by_structure(g, ckpt)
        if point in structure:
            value, how = structure[point]
            result.points[point] = {"value": value, "how": how}
            continue
        reasons = []
        if c is not None and c.module:
            reasons.append(why_module)
        reasons.append(f"structure: {why_structure}" if why_structure else
                       "structure: not a norm's input or output, nor a residual add's operand")
        result.unmatched[point] = "; ".join(reasons)
    unused = [p for p in maps if p not in wanted and p not in op_names]
    if unused:
        result.warnings.append(f"--map {', '.join(unused)}: not compared without --layerwise")
    return result


def _final_output(g: Graph, point: str, width: int) -> str | None:
    outputs = [o for o in g.outputs if g.fits(o, width)]
    if point in outputs:
        return point
    exact = [o for o in outputs if g.width(o) == width]
    named = [o for o in exact if o in ("logits", "last_hidden_state")]
    return (named or exact or [None])[0]


# --------------------------------------------------------------------------------------------
# Running
