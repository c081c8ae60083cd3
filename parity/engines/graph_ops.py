"""Operation-level points (docs/ops.md) among the values of a graph an engine runs: an ONNX graph
(parity.engines.onnx.graph) or an OpenVINO model seen as one (parity.engines.openvino.graph). The candidate kinds add
the matched values to the graph's outputs and lay each out as docs/ops.md says (``as_op``; a capture point's value as
[B, S, width]: ``as_point``).

Each op of the reference's adapter (its ``[ops]`` table) is read from, in this order of precedence:

1. ``--map OP=VALUE``: any value of the graph, named explicitly;
2. a value named as the op: ``parity convert --to onnx`` with op outputs (the executor's ops as graph outputs);
3. for an op the adapter reads at a module's output or input (q, k, v, q_norm, k_norm, context, gate, up, act,
   router): the one float value leaving (entering) that module's nodes, by module path (the exporter's name
   scopes, OpenVINO's op names); where several do, the one whose width is one of the module's weights' dims;
4. for an op the adapter reads inside attention (q_rope, k_rope, scores, probs), the nodes of the attention module:
   - a fused attention op (OpenVINO's ScaledDotProductAttention, ONNX's Attention): its query is q_rope and its
     key, traced back past GQA's repeat (Unsqueeze, Expand or Broadcast, Reshape) and the KV cache's
     concatenation (the input that is not the past), k_rope; its scores and probabilities are no values of the
     graph, and are not read;
   - else its one Softmax (an eager attention, traced): its input is the scores (after the scale, the softcap and
     the mask, as transformers' eager attention hands the softmax), its output the probabilities, and the matmul of
     queries and keys the scores come from gives q_rope (its first input) and k_rope (its second, traced back).

A value whose shape at run time is not one of the op's layouts ([B, S, width], [S, width], [B, S, heads, dim], heads
first [B, heads, S, dim]) is not compared, and says why.
"""

from __future__ import annotations

import numpy as np
import torch

from parity import names, ops
from parity.engines.onnx.graph import Graph, Matching, crossing

FUSED_ATTENTION = ("ScaledDotProductAttention", "Attention")
# ops a key passes through between RoPE and the attention: layout (transpose, reshape, GQA's repeat) and casts
PASS_THROUGH = {"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Broadcast", "Cast", "Identity", "Tile"}
# ops between the scores' matmul and the softmax's input: scale, softcap, mask
SCORE_CHAIN = {"Add", "Mul", "Div", "Sub", "Tanh", "Cast", "Where", "Slice"}
ATTENTION_FIELDS = {"query": "attn.q_rope", "key": "attn.k_rope", "scores": "attn.scores", "probs": "attn.probs"}
FLOATS = (1, 10, 11, 16)  # float, float16, double, bfloat16


def wanted_ops(ckpt, options) -> list[str]:
    """The reference's ops a check asks a graph for: every one its adapter maps, with ``options.ops``; else none."""
    return [c.name for c in ckpt.resolved.ops] if getattr(options, "ops", False) else []


def match_ops(g: Graph, ckpt, wanted: list[str], maps: dict[str, str], result: Matching) -> None:
    """Add to ``result`` the value each wanted op is read from (``points``, with how) and how to lay it out
    (``layouts``: "point" as named, "module" by its adapter entry, "heads", "scores", "probs"), or why not."""
    entries = {c.name: c for c in ckpt.resolved.ops}
    widths = _widths(ckpt)
    attention: dict[str, tuple[dict[str, str], str]] = {}
    for op in wanted:
        c = entries.get(op)
        if op in maps:
            result.points[op], result.layouts[op] = {"value": maps[op], "how": "--map"}, "module"
        elif op in g.values and op not in g.inputs:
            how = "debug output" if op in g.outputs else "value name"
            result.points[op], result.layouts[op] = {"value": op, "how": how}, "point"
        elif c is None:
            result.unmatched[op] = "not an op of the reference's adapter"
        elif c.io in ("input", "output"):
            value, why = _by_module(g, c.module, c.io, widths)
            if value is None:
                result.unmatched[op] = why
            else:
                result.points[op] = {"value": value, "how": f"module path {c.module} ({c.io})"}
                result.layouts[op] = "module"
        else:
            if c.module not in attention:
                attention[c.module] = inside_attention(g, c.module)
            found, why = attention[c.module]
            if c.field in found:
                value, how = found[c.field]
                result.points[op] = {"value": value, "how": f"attention: {how} in {c.module}"}
                result.layouts[op] = {"scores": "scores", "probs": "probs"}.get(c.field, "heads")
            else:
                result.unmatched[op] = why if not found else f"{why}: no {c.field} is a value of the graph"


def _widths(ckpt) -> dict[str, set[int]]:
    """module path -> the dims of its own weights (a linear's in and out, a norm's width)."""
    out: dict[str, set[int]] = {}
    for name, t in ckpt.resolved.tensor_map(ckpt.resolved.variant.module_prefix).items():
        module = name.rpartition(".")[0]
        out.setdefault(module, set()).update(int(d) for d in t.shape)
    return out


def _by_module(g: Graph, module: str, io: str, widths: dict[str, set[int]]) -> tuple[str | None, str]:
    """The one float activation leaving (entering) a module's nodes; where several do, the one whose last dim is
    one of the module's weights' dims."""
    found = crossing(g, module, io)
    verb = "leaves" if io == "output" else "enters"
    if found is None:
        return None, f"no node of module {module}"
    found = [v for v in found if _activation(g, v)]
    if len(found) > 1:
        known = widths.get(module, set())
        found = [v for v in found if g.width(v) in known] or found
    if len(found) == 1:
        return found[0], ""
    return None, f"{len(found) or 'no'} float value{'s' if len(found) != 1 else ''} {verb} {module}"


def _activation(g: Graph, value: str) -> bool:
    elem, dims = g.types.get(value, (None, None))
    return value not in g.constants and (elem is None or elem in FLOATS) and (dims is None or len(dims) >= 2)


def inside_attention(g: Graph, module: str) -> tuple[dict[str, tuple[str, str]], str]:
    """({field: (value, how)}, what was found) for the attention computed in ``module``'s nodes: query and key, and
    scores and probabilities where a Softmax computes them; ({}, why) where none is found."""
    inside = [k for k in range(len(g.nodes)) if g.in_scope(k, module)]
    if not inside:
        return {}, f"no node of module {module}"
    fused = [k for k in inside if g.nodes[k].op_type in FUSED_ATTENTION]
    traced = "traced back past GQA's repeat and the KV cache"
    if len(fused) == 1:
        node = g.nodes[fused[0]]
        return ({"query": (node.input[0], f"the query of {node.op_type}"),
                 "key": (key_source(g, node.input[1]), f"the key of {node.op_type}, {traced}")},
                f"{node.op_type} computes the attention of {module} in one op (its scores and probabilities inside)")
    softmax = [k for k in inside if g.nodes[k].op_type == "Softmax"]
    if len(fused) > 1 or len(softmax) != 1:
        what = f"{len(fused)} fused attention ops" if fused else f"{len(softmax) or 'no'} Softmax"
        return {}, f"{what} in module {module}"
    node = g.nodes[softmax[0]]
    found = {"scores": (node.input[0], "the Softmax's input"), "probs": (node.output[0], "the Softmax's output")}
    matmul = _scores_matmul(g, node.input[0])
    if matmul is not None:
        found.update(query=(matmul.input[0], "the first input of the matmul before the Softmax"),
                     key=(key_source(g, matmul.input[1]), f"the second input of that matmul, {traced}"))
    return found, f"the Softmax of {module}"


def _scores_matmul(g: Graph, value: str):
    """The matmul of two activations (queries and keys) that the softmax's input is computed from."""
    frontier = [value]
    for _ in range(8):
        following = []
        for v in frontier:
            k = g.producer.get(v)
            if k is None:
                continue
            node = g.nodes[k]
            if node.op_type == "MatMul" and all(i not in g.constants for i in node.input):
                return node
            if node.op_type in SCORE_CHAIN:
                following += [i for i in node.input if i and i not in g.constants]
        frontier = following
    return None


def key_source(g: Graph, value: str) -> str:
    """The keys an attention reads, traced back past layout ops and GQA's repeat to what RoPE produced; past a KV
    cache's concatenation, the part this call computed (not the past)."""
    for _ in range(16):
        k = g.producer.get(value)
        if k is None:
            return value
        node = g.nodes[k]
        if node.op_type in PASS_THROUGH and node.input:
            value = node.input[0]
            continue
        if node.op_type == "Concat":
            fresh = [v for v in node.input if v and not _from_cache(g, v)]
            if len(fresh) == 1 and len(node.input) == 2:
                value = fresh[0]
                continue
        return value
    return value


def _from_cache(g: Graph, value: str) -> bool:
    """Whether a value is the past of a KV cache: a cache input (past_key_values.*), or a state read (ReadValue),
    within a few ops."""
    frontier = [value]
    for _ in range(4):
        following = []
        for v in frontier:
            if v in g.inputs and ("past" in v or "cache" in v):
                return True
            k = g.producer.get(v)
            if k is None:
                continue
            if g.nodes[k].op_type == "ReadValue":
                return True
            following += [i for i in g.nodes[k].input if i and i not in g.constants]
        frontier = following
    return False


def as_op(x, s: int, layout: str, c=None) -> torch.Tensor | None:
    """A value read for an op laid out as docs/ops.md says, [1, S, width] (parity.ops), or None where its shape is not
    one of the op's layouts. ``layout``: "point" (already so), "module" (as its adapter entry ``c`` reads it: its
    slice, its heads first or not), "heads" (a per-head value, heads first unless its shape says otherwise),
    "scores", "probs" ([B, H, S, T])."""
    t = torch.from_numpy(np.array(x, dtype=np.float32)) if not isinstance(x, torch.Tensor) else x.float()
    if layout in ("scores", "probs"):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != s:
            return None
        return ops.scores(t) if layout == "scores" else ops.probs(t)
    if c is not None and c.slice is not None:
        t = ops.part(t, c.slice, c.groups)
    heads_first = layout == "heads" or (c is not None and c.heads_first)
    if t.dim() == 2 and t.shape[0] == s:
        return t.reshape(1, s, -1)
    if t.dim() == 3 and tuple(t.shape[:2]) == (1, s):
        return t
    if t.dim() == 4 and t.shape[0] == 1:
        if t.shape[2] == s and (heads_first or t.shape[1] != s):
            return ops.from_heads(t)
        if t.shape[1] == s:
            return ops.flat(t)
    return None


def as_point(x: np.ndarray, b: int, s: int, width: int) -> torch.Tensor | None:
    """A capture point's [B, S, width] from what a graph produced, or None if it is something else."""
    if x.shape == (b, s, width):
        return torch.from_numpy(np.array(x))
    if x.shape == (b * s, width) or (b == 1 and x.shape == (s, width)):
        return torch.from_numpy(np.array(x)).reshape(b, s, width)
    return None


def read_ops(matching: Matching, values, ckpt, s: int, emit, unmatched: dict) -> None:
    """Emit each matched op from the run's ``values`` (value name -> array), laid out by ``as_op``; an op whose value
    has another shape goes to ``unmatched`` with why."""
    entries = {c.name: c for c in ckpt.resolved.ops}
    for op in sorted(matching.layouts, key=names.point_order):
        value = matching.points[op]["value"]
        x = values(value)
        got = as_op(x, s, matching.layouts[op], entries.get(op)) if x is not None else None
        if got is not None:
            emit(op, got)
        elif x is None:
            unmatched[op] = f"{value} was not computed"
        else:
            unmatched[op] = f"{value} has shape {list(np.shape(x))}, which is not a layout of {op.split('.', 2)[2]}"


def missing_note(unmatched: dict[str, str], engine: str) -> str | None:
    """One warning naming the ops (without their layer) an engine did not give, each kind with why (its first
    layer's reason; kinds that share a reason are named together)."""
    kinds: dict[str, str] = {}
    for name in sorted(unmatched, key=names.point_order):
        if names.is_op(name):
            kinds.setdefault(name.split(".", 2)[2], unmatched[name][:200])
    if not kinds:
        return None
    reasons: dict[str, list[str]] = {}
    for kind, why in kinds.items():
        reasons.setdefault(why, []).append(kind)
    return (f"the {engine} gives no " + "; no ".join(f"{', '.join(k)} ({why})" for why, k in reasons.items())
            + ": operation-level points not compared")
