"""An ONNX file's own weights read back as a Hugging Face reference (``check --same-weights``), with the
arithmetic onnxruntime's CPU computes them with (parity.engines.onnx.arithmetic): parity's ONNX exports quantized by
onnxruntime (parity.engines.onnx.quantize) or not, and graphs other exporters wrote and onnxruntime's quantizers
quantized (Optimum, ``quantize_dynamic``, ``quantize_static``, ``MatMulNBitsQuantizer``).

Every weight is read where the graph keeps it: a float initializer; a DequantizeLinear of a quantized one (QDQ, or
the embedding quantize_dynamic quantizes); MatMulInteger's B with its scale and zero point; QLinearMatMul's B with
its own; MatMulNBits' packed B with its block scales and zero points (onnxruntime's contrib-op spec: B [N, blocks,
bytes], the low nibble first; zero points packed two blocks a byte, 2^(bits-1) where absent).

Where each belongs in the checkpoint (_Places): parity's exports name initializers by the neutral layout
(``layers.0.attn.q.weight``; ``.T``: laid out [in, out] for a MatMul). Other exporters keep the module's parameter
name, under a wrapper's prefix or none (``inner.encoder.layer.0.attention.self.query.weight``), or none at all where
torch.onnx folded a Linear's transpose into a new initializer (``onnx::MatMul_123``): the node reading it keeps the
module path (``/inner/encoder/layer.0/attention/self/query/MatMul_quant``), so a projection's or a lookup's weight
is placed by the node that reads it, and the quantizers' suffixes (``_quantized``, ``_Q4``) are dropped.

Each tensor is judged on its way back: a float one must equal the checkpoint's (after the neutral layout's own
transform, ``1 + w`` folded, for parity's exports) to 1e-6; a quantized one must lie within one step of its own
scale of the checkpoint's values, all but 0.1% of them (_a_quantization). One that is not keeps the checkpoint's own
tensor in the reference and is reported, so the check fails where it acts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from parity.checkpoint import stored_tensor_map
from parity.compare import metrics
from parity.engines.onnx import graph as onnx_graph
from parity.engines.onnx.arithmetic import (
    OUTPUT, PAIRS, Blocks, Dynamic, OrtArithmetic, Projection, QParams, Rounding, block_inverse, saturates_pairs)
from parity.engines.same_weights import EXACT, neutral_map, write_reference
from parity.errors import ParityError
from parity.neutral.converter import to_neutral
from parity.storage.lazy import Dequantizer
from parity.weights import FLOAT_TYPES, Tally, commonest

BAND = "within one step"  # a quantized tensor's values against the checkpoint's, in steps of its own scale
STRAYS = 1e-3             # the share of a quantized tensor's values allowed further off (clipped outliers)
SUFFIXES = ("_quantized", "_Q4", "_Q8", "_Q2")
PROJECTIONS = ("MatMul", "MatMulInteger", "MatMulNBits", "QLinearMatMul")
TIED_HEAD = "lm_head.weight"   # transformers' name of an untied head (the families read back here)
UNREAD_OPS = {"QGemm", "QAttention", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
              "GatherBlockQuantized", "QLinearAdd", "QLinearMul"}


class _Graph:
    def __init__(self, path: Path):
        import onnx  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)
        from onnx import numpy_helper

        model = onnx.load(str(path))
        self.model = model
        self.values = {i.name: np.array(numpy_helper.to_array(i, base_dir=str(Path(path).parent)))
                       for i in model.graph.initializer}
        self.nodes = list(model.graph.node)
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.readers: dict[str, list] = {}
        for n in self.nodes:
            for x in n.input:
                self.readers.setdefault(x, []).append(n)

    def op(self, value: str) -> str | None:
        node = self.producer.get(value)
        return node.op_type if node is not None else None

    def qparams(self, node) -> QParams:
        """A QuantizeLinear's (or DequantizeLinear's) scale, zero point and integer type."""
        scale = self.values[node.input[1]]
        zp = self.values[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        return QParams(scale=float(scale), zero_point=float(zp), type=str(zp.dtype))


def _base(name: str) -> tuple[str, bool]:
    """(neutral name, laid out [in, out]) of an initializer's name as parity's export and ORT's quantizers write it."""
    for suffix in SUFFIXES:
        name = name.removesuffix(suffix)
    return (name[:-2], True) if name.endswith(".T") else (name, False)


def unpack_nbits(node, g: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
    """MatMulNBits' B dequantized, [N, K] (the checkpoint's [out, in]), as its spec lays it out; and each weight's
    quantization step (its block's scale)."""
    attrs = {a.name: a.i for a in node.attribute}
    n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
    if bits != 4:
        raise ParityError(f"--same-weights: MatMulNBits of {bits} bits; parity reads 4-bit weights back")
    raw = g.values[node.input[1]].reshape(n, -1)
    q = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, -1).astype(np.float32)   # low nibble first
    blocks = q.shape[1] // block
    scales = g.values[node.input[2]].reshape(n, blocks).astype(np.float32)
    if len(node.input) > 3 and node.input[3]:
        packed = g.values[node.input[3]]
        if packed.dtype != np.uint8:
            raise ParityError("--same-weights: MatMulNBits with float zero points is not read back yet")
        packed = packed.reshape(n, -1)
        zp = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :blocks].astype(np.float32)
    else:
        zp = np.full((n, blocks), 8.0, np.float32)
    w = (q.reshape(n, blocks, block) - zp[:, :, None]) * scales[:, :, None]
    step = np.broadcast_to(np.abs(scales)[:, :, None], (n, blocks, block)).reshape(n, -1)[:, :k]
    return torch.from_numpy(w.reshape(n, -1)[:, :k].copy()), torch.from_numpy(step.copy())


def _dequantized(g: _Graph, dq) -> tuple[torch.Tensor, list[float], str, torch.Tensor]:
    """A DequantizeLinear of an initializer: (float32 values, its scales, its integer type, each value's step)."""
    q = g.values[dq.input[0]]
    scale = g.values[dq.input[1]].astype(np.float32)
    zp = g.values[dq.input[2]] if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale, dtype=q.dtype)
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    shape = [1] * q.ndim
    if scale.ndim == 1:
        shape[axis] = -1
    w = (q.astype(np.float32) - zp.astype(np.float32).reshape(shape)) * scale.reshape(shape)
    return torch.from_numpy(w), scale.reshape(-1).tolist(), str(q.dtype), _steps(scale.reshape(shape), w.shape)


class Read(NamedTuple):
    """A weight as the graph keeps it: its initializer, its values dequantized (a projection's [out, in]), its
    type, its kernel's spec (projections), each value's quantization step (None: a float one)."""

    init: str
    value: torch.Tensor
    kind: str
    spec: Projection | None = None
    step: torch.Tensor | None = None


def _steps(scale: np.ndarray, shape) -> torch.Tensor:
    return torch.from_numpy(np.broadcast_to(np.abs(scale.astype(np.float32)), shape).copy())


def _float_kind(x: np.ndarray) -> str:
    return "float16" if x.dtype == np.float16 else "float"


def _rounding(g: _Graph, value: str) -> QParams | None:
    """The static Q/DQ pair a value goes through on its way into a node (its producer a DequantizeLinear of a
    QuantizeLinear), or None."""
    dq = g.producer.get(value)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    q = g.producer.get(dq.input[0])
    return g.qparams(q) if q is not None and q.op_type == "QuantizeLinear" else None


def _matmul(g: _Graph, node) -> Read | None:
    """A projection's weight (Read), or None for a matmul of two activations."""
    b = node.input[1]
    if node.op_type == "MatMulNBits":
        attrs = {a.name: a.i for a in node.attribute}
        w, step = unpack_nbits(node, g)
        if attrs.get("accuracy_level", 0) == 4:  # SQNBIT_CompInt8 (x86 and ARM MLAS have it for 4 bits)
            return Read(b, w, "int4", Projection(
                op="MatMulNBits", activations=f"int8 blocks of {attrs['block_size']} (accuracy_level 4)",
                input=Blocks(blocks=attrs["block_size"], inverse=block_inverse())), step)
        return Read(b, w, "int4", Projection(op="MatMulNBits", activations="float32"), step)
    if node.op_type == "MatMulInteger":
        if g.op(node.input[0]) != "DynamicQuantizeLinear":
            raise ParityError(f"--same-weights: MatMulInteger {node.name} reads an activation quantized statically; "
                              f"only quantize_dynamic's graphs are read back")
        q = g.values[b]
        zp = g.values[node.input[3]] if len(node.input) > 3 and node.input[3] else np.zeros((), q.dtype)
        scale = _integer_scale(g, node).astype(np.float32)
        w = (q.astype(np.float32) - zp.astype(np.float32)) * scale
        return Read(b, torch.from_numpy(w).T, str(q.dtype), _pairs(Projection(
            op="MatMulInteger", activations="uint8 per tensor (dynamic)", input=Dynamic(), integer=True,
            weight_scale=scale.reshape(-1).tolist()), "uint8", q.dtype), _steps(scale, w.shape).T)
    if node.op_type == "QLinearMatMul":  # a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp: all but a static
        a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = (g.values.get(v) for v in node.input[1:])
        if b is None or any(v is None for v in (a_scale, a_zp, b_scale, y_scale, y_zp)):
            return None
        scale = b_scale.astype(np.float32)
        zp = b_zp.astype(np.float32) if b_zp is not None else np.zeros_like(scale)
        w = (b.astype(np.float32) - zp) * scale   # [in, out], a scale per output column or one
        static = QParams(scale=float(a_scale), zero_point=float(a_zp), type=str(a_zp.dtype))
        return Read(node.input[3], torch.from_numpy(w).T, str(b.dtype), _pairs(Projection(
            op="QLinearMatMul", activations=f"{a_zp.dtype} (static)", input=static, integer=True,
            weight_scale=scale.reshape(-1).tolist(),
            requantize=QParams(scale=float(y_scale), zero_point=float(y_zp), type=str(y_zp.dtype))),
            str(a_zp.dtype), b.dtype), _steps(scale, w.shape).T)
    if b in g.values:
        return Read(b, torch.from_numpy(g.values[b]).T.float(), _float_kind(g.values[b]), Projection(op="MatMul"))
    dq = g.producer.get(b)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.values:
        return None
    w, scales, kind, step = _dequantized(g, dq)
    rounds_in = _rounding(g, node.input[0])
    after = g.readers.get(node.output[0], [])
    rounds_out = g.qparams(after[0]) if len(after) == 1 and after[0].op_type == "QuantizeLinear" else None
    return Read(dq.input[0], w.T, kind, Projection(op="MatMul (QDQ)", activations=rounds_in and rounds_in.type,
                                                   input=rounds_in, output=rounds_out, weight_scale=scales), step.T)


def _pairs(spec: Projection, activations: str, weights) -> Projection:
    """``spec``, with the int16 pair sums of u8 x s8 products where this CPU's onnxruntime saturates them."""
    if activations == "uint8" and weights == np.int8 and saturates_pairs():
        return spec.model_copy(update={"pairs": PAIRS,
                                       "activations": f"{spec.activations}, {PAIRS} saturated (no VNNI)"})
    return spec


def _integer_scale(g: _Graph, node) -> np.ndarray:
    """The scale of MatMulInteger's B: ``{B}_scale`` as onnxruntime's quantizer names it, or the initializer the
    graph multiplies the product by (Cast -> Mul, by a_scale * b_scale: the factor that is not the activation's)."""
    named = node.input[1].removesuffix("_quantized") + "_scale"
    if named in g.values:
        return g.values[named]
    a_scale = g.producer[node.input[0]].output[1]
    frontier, seen = [node.output[0]], set()
    while frontier:
        value = frontier.pop()
        for reader in g.readers.get(value, []):
            if reader.op_type == "Cast" and reader.output[0] not in seen:
                seen.add(reader.output[0])
                frontier.append(reader.output[0])
            elif reader.op_type == "Mul":
                for factor in reader.input:
                    if factor in g.values:
                        return g.values[factor]
                    made = g.producer.get(factor)
                    if made is not None and made.op_type == "Mul" and a_scale in made.input:
                        other = [v for v in made.input if v != a_scale]
                        if other and other[0] in g.values:
                            return g.values[other[0]]
    raise ParityError(f"--same-weights: cannot find the scale of {node.input[1]}, the weight of MatMulInteger "
                      f"{node.name} (neither {named} nor a Mul of its product by an initializer)")


def _gather(g: _Graph, node) -> Read | None:
    """An embedding lookup's table (Read, without a spec), or None."""
    table = node.input[0]
    if table not in g.values:
        return None
    q = g.values[table]
    if q.dtype in (np.float32, np.float16):
        return Read(table, torch.from_numpy(q).float(), _float_kind(q))
    dq = next((r for r in g.readers.get(node.output[0], []) if r.op_type == "DequantizeLinear"), None)
    if dq is None:
        return None
    scale = g.values[dq.input[1]].astype(np.float32)
    zp = g.values[dq.input[2]].astype(np.float32) if len(dq.input) > 2 and dq.input[2] else np.float32(0)
    w = (q.astype(np.float32) - zp) * scale
    return Read(table, torch.from_numpy(w), str(q.dtype), None, _steps(scale, w.shape))


def _points(g: _Graph, ckpt, projections: set[str], path: Path) -> dict[str, Rounding]:
    """The static Q/DQ pairs the quantizer put on values the model goes on with (not only a projection's input, nor
    its output): point -> where the capture map reads it, with the rounding. parity's exports name them
    (``{point}_QuantizeLinear_Input``: a capture point that is a graph output); elsewhere the pair's value must be
    one the candidate's matching finds for a capture point (BERT's post-norms, read by the residual add and the
    next projections alike). A pair on any other value (attention's own matmuls quantized) is refused: the
    reference cannot round it."""
    captures = {c.name: c for c in ckpt.resolved.capture}
    found, named = {}, set()
    for node in g.nodes:
        point = node.input[0].removesuffix("_QuantizeLinear_Input") if node.op_type == "QuantizeLinear" else None
        if point in captures and point != node.input[0] and node.input[0] not in projections:
            found[point] = _rounded_at(captures[point], g.qparams(node))
            named.add(node.output[0])
    if not any(n.op_type == "QuantizeLinear" and n.output[0] not in named for n in g.nodes):
        return found
    graph = onnx_graph.Graph(g.model)
    pairs = [k for k, n in enumerate(graph.nodes) if n.op_type == "DequantizeLinear" and n.input[0] not in named
             and (q := graph.producer.get(n.input[0])) is not None and graph.nodes[q].op_type == "QuantizeLinear"
             and graph.nodes[q].input[0] not in projections and not onnx_graph.kernel_rounding(graph, k)]
    if not pairs:
        return found
    matching = onnx_graph.match(graph, ckpt, list(captures), {}, {})
    by_value: dict[str, str] = {}
    for point in captures:  # forward order: the point where the value is made, so that all its readers see it rounded
        if point in matching.points:
            by_value.setdefault(matching.points[point]["value"], point)
    for k in pairs:
        dq = graph.nodes[k]
        point = by_value.get(dq.output[0])
        if point is None:
            raise ParityError(f"--same-weights: {path} rounds {graph.nodes[graph.producer[dq.input[0]]].input[0]} "
                              f"(a Q/DQ pair) where no capture point is, so the reference cannot round it as the "
                              f"graph does: parity reads back graphs whose quantizer rounded only the projections' "
                              f"inputs (quantize_static(..., nodes_to_quantize=the MatMuls by a weight))")
        found[point] = _rounded_at(captures[point], g.qparams(dq))
    return found


def _rounded_at(c, rounding: QParams) -> Rounding:
    """A Q/DQ pair's rounding, where the capture map reads its point (OrtArithmetic.points)."""
    return Rounding(**rounding.model_dump(), module=c.module, io=c.io, arg=c.arg, field=c.field)


@dataclass(frozen=True)
class _Place:
    hf: str                # the checkpoint's tensor
    neutral: bool          # laid out as the neutral layout has it (parity's exports), or as the checkpoint does
    head: bool = False     # the output matrix of a tied checkpoint, multiplied apart from the embedding lookup


class _Places:
    """Where each of a graph's weights belongs in the checkpoint (the module docstring)."""

    def __init__(self, ckpt):
        self.family = ckpt.resolved.family
        self.stored = stored_tensor_map(ckpt.resolved, ckpt.check())
        try:
            self.by_neutral, self.unmapped = neutral_map(self.stored, "ONNX"), None
        except ParityError as e:  # split or fused tensors: parity's own names cannot be read back (say so if used)
            self.by_neutral, self.unmapped = {}, e
        self.by_suffix: dict[str, list[str]] = {}
        for name in self.stored:
            parts = name.split(".")
            for k in range(len(parts) - 1):  # down to the module's own name and the parameter's
                self.by_suffix.setdefault(".".join(parts[k:]), []).append(name)
        tied = "embed.tokens.weight" in self.by_neutral and "lm_head.weight" not in self.by_neutral
        self.embed = self.by_neutral["embed.tokens.weight"][0] if tied else None

    def of(self, init: str, reader=None) -> _Place | None:
        """The place of initializer ``init`` (read by the node ``reader``, a projection or a lookup), or None."""
        name, _ = _base(init)
        if name in self.by_neutral:
            if self.unmapped is not None:
                raise self.unmapped
            hf = self.by_neutral[name][0]
            return _Place(hf, True, head=reader is not None and reader.op_type in PROJECTIONS and hf == self.embed)
        scope = onnx_graph.node_scope(reader) if reader is not None else None
        for guess in ([scope + ".weight"] if scope else []) + [name]:
            hf = self._checkpoint_name(guess)
            if hf is not None:
                return _Place(hf, False)
            if self.embed is not None and guess.split(".")[-2:] == TIED_HEAD.split("."):
                return _Place(self.embed, False, head=True)
        return None

    def _checkpoint_name(self, name: str) -> str | None:
        """The checkpoint tensor that ``name`` is, under any wrapper's prefix: the longest dotted suffix of it that
        ends exactly one checkpoint name (``inner.encoder.layer.0...`` is ``bert.encoder.layer.0...``)."""
        parts = name.split(".")
        for k in range(len(parts) - 1):
            found = self.by_suffix.get(".".join(parts[k:]))
            if found:
                return found[0] if len(found) == 1 else None
        return None


def read_back(ckpt, path: Path, out: Path) -> dict:
    """Write into ``out`` the reference checkpoint that holds the ONNX file's own weights, dequantized to float32
    and laid out as the checkpoint stores them, beside the reference's config and the arithmetic onnxruntime
    computes them with (parity.engines.onnx.arithmetic.OrtArithmetic, saved there). Returns what the file held, as
    every engine's read_back does (parity.engines.same_weights)."""
    g = _Graph(Path(path))
    fused = sorted({n.op_type for n in g.nodes} & UNREAD_OPS)
    if fused:
        raise ParityError(f"--same-weights: {path} computes with {', '.join(fused)} (fused or QOperator kernels "
                          f"beyond QLinearMatMul); parity reads back quantize_dynamic, QDQ, QLinearMatMul and "
                          f"MatMulNBits graphs (quantize the projections only: nodes_to_quantize=the MatMuls by a "
                          f"weight)")
    places = _Places(ckpt)
    originals = Dequantizer.of(ckpt)
    arithmetic, tensors, types, wrong, projections = OrtArithmetic(), {}, {}, {}, set()
    found: list[tuple[_Place, Read]] = []
    for node in g.nodes:
        got = _matmul(g, node) if node.op_type in PROJECTIONS else _gather(g, node) if node.op_type == "Gather" \
            else None
        if got is None:
            if node.op_type == "QLinearMatMul":  # attention's own matmul, rounded: the reference cannot follow
                raise ParityError(f"--same-weights: {path}: QLinearMatMul {node.name} multiplies two activations; "
                                  f"parity reads back graphs whose quantizer quantized only the projections "
                                  f"(quantize_static(..., nodes_to_quantize=the MatMuls by a weight))")
            continue
        place = places.of(got.init, node)
        if place is None:
            raise ParityError(f"--same-weights: {path}: {node.op_type} {node.name or node.output[0]} reads "
                              f"{got.init}, which is no tensor of the {places.family} checkpoint by its name or its "
                              f"node's module path")
        found.append((place, got))
        if got.spec is not None:
            projections.add(node.output[0])
    used = {got.init for _, got in found}
    for init, v in g.values.items():  # norms, biases: read where they are, by their names
        if init not in used and v.dtype in (np.float32, np.float16) and (place := places.of(init)) is not None:
            found.append((place, Read(init, torch.from_numpy(v).float(), _float_kind(v))))
    for place, (init, stored, kind, spec, step) in found:
        t = places.stored[place.hf]
        original = originals.read(place.hf, torch.float32)
        if place.neutral:
            expected = next(to_neutral(t, original))[1].float()
        else:  # the checkpoint's own layout: a projection's B.T is [out, in], as Conv1D's stored [in, out] is not
            expected = original
            if spec is not None and t.transpose and not place.head:
                stored, step = stored.T, None if step is None else step.T
        if kind == "float16":  # a float16 graph: the checkpoint's values as it rounds them
            expected = expected.half().float()
        error = metrics(stored.float(), expected)["rel_l2"] if stored.shape == expected.shape else float("inf")
        value = stored.float() - 1.0 if place.neutral and t.norm_offset else stored.float()
        key = TIED_HEAD if place.head else place.hf
        if not _a_quantization(stored.float(), expected, step, error):
            wrong[f"{TIED_HEAD} (tied to {place.hf})" if place.head else place.hf] = error
            value = original
        if key in tensors and not torch.equal(tensors[key], value.contiguous()):
            raise ParityError(f"--same-weights: {path} holds two different weights for {key} ({init} and another); "
                              f"which one the graph computes with cannot be told apart")
        tensors[key] = value.contiguous()
        types[kind] = types.get(kind, 0) + 1
        if spec is not None:
            arithmetic.matmuls[OUTPUT if place.head else place.hf.removesuffix(".weight")] = spec
    absent = sorted(set(places.stored) - set(tensors))
    for name in absent:  # not in the graph (a pooler or a head it does not compute): the checkpoint's own
        tensors[name] = originals.read(name, torch.float32).contiguous()
    # a tied head quantized apart from the embedding (a MatMul's weight, a Gather's table): two tensors
    untie = places.embed is not None and TIED_HEAD in tensors and not torch.equal(tensors[TIED_HEAD],
                                                                                tensors[places.embed])
    if places.embed is not None and not untie:
        tensors.pop(TIED_HEAD, None)
    arithmetic.points = _points(g, ckpt, projections, Path(path))
    write_reference(ckpt, Path(out), tensors, arithmetic, untie=untie)
    bands = {kind: EXACT if kind.startswith("float") else BAND for kind in sorted(types)}
    return {"from": str(path), "types": types, "tensors": len(tensors) - len(absent), "not_a_quantization": wrong,
            "not_in_file": absent, "bands": bands}


def _a_quantization(stored: torch.Tensor, expected: torch.Tensor, step: torch.Tensor | None, error: float) -> bool:
    """Whether a tensor read back is the checkpoint's (a float one, to 1e-6) or a quantization of it: all but
    STRAYS of its values within one quantization step of the checkpoint's (rounding leaves half a step; clipping a
    few outliers, more). A rel_l2 band would not do: per-tensor int8 of real weights with outliers leaves 0.05 to 0.4
    (all-MiniLM-L6-v2's output.dense), where another layer's tensor is 1.4 away and still within a wide band's reach."""
    if step is None or stored.shape != expected.shape:
        return error <= EXACT
    off = (stored - expected).abs() > step * (1 + 1e-3) + 1e-12
    return off.float().mean().item() <= STRAYS


# the inputs of a quantized op that are its quantization parameters (scales, zero points), not its weights
QPARAMS = {"DequantizeLinear": (1, 2), "QuantizeLinear": (1, 2), "MatMulInteger": (2, 3), "MatMulNBits": (2, 3),
           "QLinearMatMul": (1, 2, 4, 5, 6, 7), "MatMulIntegerToFloat": (2, 3, 4, 5), "DynamicQuantizeMatMul": (2, 3),
           "GatherBlockQuantized": (2, 3)}
DYNAMIC_OPS = ("DynamicQuantizeLinear", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")


def stored(model):
    """How a graph (its ModelProto, read without external data: dims and types only) stores its weights
    (parity.weights.Weights), and the form its quantizer left (scheme).

    Weights are the float initializers and the integer ones a quantized op (or a Cast) reads, every dim over 1:
    the matrices, norms and biases, not the shape constants, epsilons or RoPE's [1, d] frequencies. MatMulNBits'
    packed B counts as its N x K weights. Bits per weight: the bytes of the weights and of their scales and zero
    points, over the weights' elements (a float32 graph: 32)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    serves, packed, tables = _quantization_parameters(graph, inits, producer), {}, set()
    for node in graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if node.op_type == "MatMulNBits" and node.input[1] in inits:
            packed[node.input[1]] = (attrs.get("bits", 4), attrs["N"] * attrs["K"])
        if node.op_type in ("Gather", "GatherBlockQuantized") and node.input[0] in inits:
            tables.add(node.input[0])
        if node.op_type == "GatherBlockQuantized" and node.input[0] in inits:  # uint8 data: 8 // bits a byte
            table, bits = inits[node.input[0]], attrs.get("bits", 4)
            per_byte = 8 // bits if _storage(table) == "uint8" else 1
            packed[node.input[0]] = (bits, math.prod(table.dims) * per_byte)
    tally, kinds = Tally(), {}
    for name, init in inits.items():
        kind = _storage(init)
        if name in serves:
            tally.stored += _bytes(init)
            continue
        if name in packed:
            kind, elements = f"int{packed[name][0]}", packed[name][1]
        elif kind is None or not init.dims or min(init.dims) < 2:
            continue  # a constant, not a weight
        else:
            elements = math.prod(init.dims)
        kinds[name] = kind
        tally.add(kind, elements, _bytes(init))
    main = commonest(tally.types)
    scheme = _scheme(graph, main, inits) if main is not None else ""
    notes = []
    for table in sorted(tables & set(kinds)):
        if scheme and kinds[table] != main:
            notes.append(f"{kinds[table]} embedding")
    floats = [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and kinds.get(_source(n.input[1], producer))
              in FLOAT_TYPES]
    if scheme and floats:
        notes.append(f"{len(floats)} float projection{'s' if len(floats) > 1 else ''}")
    return tally.weights(scheme, notes[:2])


def _quantization_parameters(graph, inits: dict, producer: dict) -> set[str]:
    """The initializers that are scales and zero points: a quantized op's (QPARAMS), and a Mul's scale where the
    other factor is a dynamic quantization's scale or an integer weight cast to float (the weight-only form)."""
    found = set()
    for node in graph.node:
        for k in QPARAMS.get(node.op_type, ()):
            if k < len(node.input) and node.input[k] in inits:
                found.add(node.input[k])
        if node.op_type == "Mul" and len(node.input) == 2:
            for mine, other in (node.input, node.input[::-1]):
                source = producer.get(other)
                if mine in inits and source is not None and (source.op_type == "DynamicQuantizeLinear"
                                                             or _cast_weight(source, inits)):
                    found.add(mine)
    return found


def _scheme(graph, kind: str, inits: dict) -> str:
    """The quantizer's form, named by the ops it left (onnxruntime's quantizers, or the weight-only Cast + Mul)."""
    ops = {n.op_type for n in graph.node}
    if "MatMulNBits" in ops:
        sizes = sorted({next((a.i for a in n.attribute if a.name == "block_size"), 0) for n in graph.node
                        if n.op_type == "MatMulNBits"})
        return f"{kind} blocks of {'/'.join(map(str, sizes))} (MatMulNBits)"
    dynamic = [op for op in DYNAMIC_OPS if op in ops]
    if set(dynamic) - {"DynamicQuantizeLinear"}:  # a matmul of dynamically quantized activations
        return f"{kind}, dynamic activations ({' + '.join(dynamic)})"
    if "QLinearMatMul" in ops:
        return f"{kind} QLinearMatMul"
    if {"QuantizeLinear", "DequantizeLinear"} <= ops:
        return f"{kind} QDQ (QuantizeLinear/DequantizeLinear)"
    if "DequantizeLinear" in ops:
        return f"{kind} weights, DequantizeLinear"
    if any(_cast_weight(n, inits) for n in graph.node):
        return f"{kind} weights, Cast + Mul(scale)"
    return ""


def _source(value: str, producer: dict) -> str:
    """The initializer a projection's weight input is, through the Transpose or Cast in front of it."""
    node = producer.get(value)
    while node is not None and node.op_type in ("Transpose", "Cast"):
        value, node = node.input[0], producer.get(node.input[0])
    return value


def _storage(init) -> str | None:
    """An initializer's storage type by name ("int8", "float16"), None for one that is no weight (int64 shapes,
    booleans)."""
    from onnx import TensorProto as T  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

    return {T.INT8: "int8", T.UINT8: "uint8", T.INT4: "int4", T.UINT4: "uint4", T.FLOAT: "float32",
            T.FLOAT16: "float16", T.BFLOAT16: "bfloat16", T.DOUBLE: "float64"}.get(init.data_type)


def _cast_weight(node, inits: dict) -> bool:
    """A Cast of an integer initializer to float: the weight-only form's dequantization, before its Mul."""
    return node.op_type == "Cast" and node.input[0] in inits and _storage(inits[node.input[0]]) in (
        "int8", "uint8", "int4", "uint4")


def _bytes(init) -> int:
    """The bytes of an initializer's data by its dims and type (4-bit types packed two a byte)."""
    import onnx  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

    if init.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (math.prod(init.dims) + 1) // 2
    return math.prod(init.dims) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
