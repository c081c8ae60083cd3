"""An ONNX file's own weights read back as a Hugging Face reference (``check --same-weights``), with the
arithmetic onnxruntime's CPU computes them with (parity.reference.arithmetic.ort): for parity's ONNX exports,
quantized by onnxruntime (parity.ports.onnx.quantize) or not.

Every weight is read where the graph keeps it: a float initializer; a DequantizeLinear of a quantized one (QDQ, or
the embedding quantize_dynamic quantizes); MatMulInteger's B with its scale and zero point; MatMulNBits' packed
B with its block scales and zero points (onnxruntime's contrib-op spec: B [N, blocks, bytes], the low nibble
first; zero points packed two blocks a byte, 2^(bits-1) where absent). Initializers carry the neutral names
(``layers.0.attn.q.weight``; ``.T``: laid out [in, out] for a MatMul), which map back to the checkpoint's.

Each tensor is judged on its way back as parity.ports.gguf.weights judges GGUF's: a float one must equal the
checkpoint's (after the neutral layout's own transform, ``1 + w`` folded) to 1e-6; a quantized one must be within
its type's band. One that is not keeps the checkpoint's own tensor in the reference and is reported.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from parity.errors import ParityError
from parity.ports.same_weights import EXACT, neutral_map, write_reference
from parity.reference.arithmetic.ort import OUTPUT, OrtArithmetic

# rel_l2 against the checkpoint's tensor beyond which a tensor is not a quantization of it: about 3x what each
# type leaves on Gaussian weights (int8 per tensor ~8e-3, int4 in blocks of 32 ~0.08), far below a permutation's 1.4
BANDS = {"int8": 0.05, "uint8": 0.05, "int4": 0.3, "uint4": 0.3}
SUFFIXES = ("_quantized", "_Q4", "_Q8", "_Q2")
TIED_HEAD = "lm_head.weight"   # transformers' name of an untied head (the families read back here)
UNREAD_OPS = {"QLinearMatMul", "QGemm", "QAttention", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
              "GatherBlockQuantized", "QLinearAdd", "QLinearMul"}


class _Graph:
    def __init__(self, path: Path):
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
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

    def qparams(self, node) -> dict:
        """A QuantizeLinear's (or DequantizeLinear's) scale, zero point and integer type."""
        scale = self.values[node.input[1]]
        zp = self.values[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
        return {"scale": float(scale), "zero_point": float(zp), "type": str(zp.dtype)}


def _base(name: str) -> tuple[str, bool]:
    """(neutral name, laid out [in, out]) of an initializer's name as parity's export and ORT's quantizers write it."""
    for suffix in SUFFIXES:
        name = name.removesuffix(suffix)
    return (name[:-2], True) if name.endswith(".T") else (name, False)


def unpack_nbits(node, g: _Graph) -> torch.Tensor:
    """MatMulNBits' B dequantized, [N, K] (the checkpoint's [out, in]), as its spec lays it out."""
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
    return torch.from_numpy(w.reshape(n, -1)[:, :k].copy())


def _dequantized(g: _Graph, dq) -> tuple[torch.Tensor, list[float], str]:
    """A DequantizeLinear of an initializer: (float32 values, its scales, its integer type)."""
    q = g.values[dq.input[0]]
    scale = g.values[dq.input[1]].astype(np.float32)
    zp = g.values[dq.input[2]] if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale, dtype=q.dtype)
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    shape = [1] * q.ndim
    if scale.ndim == 1:
        shape[axis] = -1
    w = (q.astype(np.float32) - zp.astype(np.float32).reshape(shape)) * scale.reshape(shape)
    return torch.from_numpy(w), scale.reshape(-1).tolist(), str(q.dtype)


def _float_kind(x: np.ndarray) -> str:
    return "float16" if x.dtype == np.float16 else "float"


def _rounding(g: _Graph, value: str) -> dict | None:
    """The static Q/DQ pair a value goes through on its way into a node (its producer a DequantizeLinear of a
    QuantizeLinear), or None."""
    dq = g.producer.get(value)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    q = g.producer.get(dq.input[0])
    return g.qparams(q) if q is not None and q.op_type == "QuantizeLinear" else None


def _matmul(g: _Graph, node) -> tuple[str, torch.Tensor, str, dict] | None:
    """A projection: (its weight's initializer, the weight [out, in] dequantized, its type, its kernel's spec), or
    None for a matmul of two activations."""
    b = node.input[1]
    if node.op_type == "MatMulNBits":
        attrs = {a.name: a.i for a in node.attribute}
        if attrs.get("accuracy_level", 0) == 4:  # SQNBIT_CompInt8 (x86 and ARM MLAS have it for 4 bits)
            return b, unpack_nbits(node, g), "int4", {
                "op": "MatMulNBits", "activations": f"int8 blocks of {attrs['block_size']} (accuracy_level 4)",
                "input": {"blocks": attrs["block_size"]}}
        return b, unpack_nbits(node, g), "int4", {"op": "MatMulNBits", "activations": "float32"}
    if node.op_type == "MatMulInteger":
        if g.op(node.input[0]) != "DynamicQuantizeLinear":
            raise ParityError(f"--same-weights: MatMulInteger {node.name} reads an activation quantized statically; "
                              f"only quantize_dynamic's graphs are read back")
        q = g.values[b]
        zp = g.values[node.input[3]] if len(node.input) > 3 and node.input[3] else np.zeros((), q.dtype)
        scale = g.values[b.removesuffix("_quantized") + "_scale"].astype(np.float32)
        w = (q.astype(np.float32) - zp.astype(np.float32)) * scale
        return b, torch.from_numpy(w).T, str(q.dtype), {
            "op": "MatMulInteger", "activations": "uint8 per tensor (dynamic)", "input": {"dynamic": True},
            "integer": True, "weight_scale": scale.reshape(-1).tolist()}
    if b in g.values:
        return b, torch.from_numpy(g.values[b]).T.float(), _float_kind(g.values[b]), {"op": "MatMul"}
    dq = g.producer.get(b)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in g.values:
        return None
    w, scales, kind = _dequantized(g, dq)
    rounds_in = _rounding(g, node.input[0])
    after = g.readers.get(node.output[0], [])
    rounds_out = g.qparams(after[0]) if len(after) == 1 and after[0].op_type == "QuantizeLinear" else None
    return dq.input[0], w.T, kind, {"op": "MatMul (QDQ)", "activations": rounds_in and rounds_in["type"],
                                    "input": rounds_in, "output": rounds_out, "integer": False,
                                    "weight_scale": scales}


def _gather(g: _Graph, node) -> tuple[str, torch.Tensor, str] | None:
    """An embedding lookup: (its table's initializer, the table dequantized, its type), or None."""
    table = node.input[0]
    if table not in g.values:
        return None
    q = g.values[table]
    if q.dtype in (np.float32, np.float16):
        return table, torch.from_numpy(q).float(), _float_kind(q)
    dq = next((r for r in g.readers.get(node.output[0], []) if r.op_type == "DequantizeLinear"), None)
    if dq is None:
        return None
    scale = g.values[dq.input[1]].astype(np.float32)
    zp = g.values[dq.input[2]].astype(np.float32) if len(dq.input) > 2 and dq.input[2] else np.float32(0)
    return table, torch.from_numpy((q.astype(np.float32) - zp) * scale), str(q.dtype)


def _points(g: _Graph, ckpt, projections: set[str]) -> dict[str, dict]:
    """The static Q/DQ pairs the quantizer put on capture points that are graph outputs (their value renamed
    ``{point}_QuantizeLinear_Input``), other than a projection's output: point -> where the capture map reads it,
    with the rounding."""
    captures = {c.name: c for c in ckpt.resolved.capture}
    found = {}
    for node in g.nodes:
        point = node.input[0].removesuffix("_QuantizeLinear_Input") if node.op_type == "QuantizeLinear" else None
        if point in captures and point != node.input[0] and node.input[0] not in projections:
            c = captures[point]
            found[point] = {**g.qparams(node), "module": c.module, "io": c.io, "arg": c.arg, "field": c.field}
    return found


def read_back(ckpt, path: Path, out: Path) -> dict:
    """Write into ``out`` the reference checkpoint that holds the ONNX file's own weights, dequantized to float32
    and laid out as the checkpoint stores them, beside the reference's config and the arithmetic onnxruntime
    computes them with (parity.reference.arithmetic.ort.OrtArithmetic, saved there). Returns what the file held, as
    parity.ports.gguf.weights.read_back does."""
    from parity.checkpoint import stored_tensor_map
    from parity.compare import metrics
    from parity.neutral.converter import to_neutral
    from parity.storage.lazy import Dequantizer

    g = _Graph(Path(path))
    fused = sorted({n.op_type for n in g.nodes} & UNREAD_OPS)
    if fused:
        raise ParityError(f"--same-weights: {path} computes with {', '.join(fused)} (static QOperator quantization or "
                          f"fused kernels); parity reads back quantize_dynamic, QDQ and MatMulNBits graphs")
    by_neutral = neutral_map(stored_tensor_map(ckpt.resolved, ckpt.check()), "ONNX")
    originals = Dequantizer.of(ckpt)
    arithmetic, tensors, types, wrong, projections = OrtArithmetic(), {}, {}, {}, set()
    found: list[tuple[str, torch.Tensor, str, dict | None]] = []
    for node in g.nodes:
        got = _matmul(g, node) if node.op_type in ("MatMul", "MatMulInteger", "MatMulNBits") else None
        if got is not None:
            found.append(got)
            projections.add(node.output[0])
        elif node.op_type == "Gather" and (table := _gather(g, node)) is not None:
            found.append((*table, None))
    used = {name for name, *_ in found}
    found += [(name, torch.from_numpy(v).float(), _float_kind(v), None) for name, v in g.values.items()
              if name not in used and v.dtype in (np.float32, np.float16) and _base(name)[0] in by_neutral]
    for init, stored, kind, spec in found:
        name, _ = _base(init)
        if name not in by_neutral:
            raise ParityError(f"--same-weights: {path} holds {init}, which the {ckpt.resolved.family} checkpoint has "
                              f"no place for (parity reads back its own exports)")
        hf_name, t = by_neutral[name]
        head = spec is not None and name == "embed.tokens.weight"   # a tied head, multiplied apart
        original = originals.read(hf_name, torch.float32)
        expected = next(to_neutral(t, original))[1].float()
        if kind == "float16":  # a float16 export: the checkpoint's values as it rounds them
            expected = expected.half().float()
        error = metrics(stored.float(), expected)["rel_l2"] if stored.shape == expected.shape else float("inf")
        band = EXACT if kind.startswith("float") else BANDS.get(kind, 0.3)
        value = stored.float() - 1.0 if t.norm_offset else stored.float()
        if not error <= band:
            wrong[f"{TIED_HEAD} (tied to {hf_name})" if head else hf_name] = error
            value = original
        tensors[TIED_HEAD if head else hf_name] = value.contiguous()
        types[kind] = types.get(kind, 0) + 1
        if spec is not None:
            arithmetic.matmuls[OUTPUT if head else hf_name.removesuffix(".weight")] = spec
    missing = sorted(set(stored_tensor_map(ckpt.resolved, ckpt.check())) - set(tensors))
    if missing:
        raise ParityError(f"--same-weights: {path} does not hold {', '.join(missing[:3])}; parity reads back "
                          f"graphs that hold every weight (its own exports)")
    tied = "embed.tokens.weight" in by_neutral and "lm_head.weight" not in by_neutral
    # a tied head quantized apart from the embedding (a MatMul's weight, a Gather's table): two tensors
    embed = by_neutral["embed.tokens.weight"][0] if tied else None
    untie = tied and TIED_HEAD in tensors and not torch.equal(tensors[TIED_HEAD], tensors[embed])
    if tied and not untie:
        tensors.pop(TIED_HEAD, None)
    arithmetic.points = _points(g, ckpt, projections)
    write_reference(ckpt, Path(out), tensors, arithmetic, untie=untie)
    return {"from": str(path), "types": types, "tensors": len(tensors), "not_a_quantization": wrong,
            "bands": {kind: BANDS.get(kind, EXACT) for kind in sorted(types)}}


QUANTIZED_OPS = {"MatMulInteger", "MatMulNBits", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear",
                 "QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "GatherBlockQuantized"}


def tensor_types(model) -> dict[str, int]:
    """How many weights a graph (its ModelProto, read without external data) stores of each kind. A graph
    without quantization ops reports its weights as "F32": unquantized, so that ``--calibrate`` keeps the
    check's precision noise (parity.checker.plan reads F32 so) even for a float16 graph."""
    import onnx

    inits = model.graph.initializer
    if not any(node.op_type in QUANTIZED_OPS for node in model.graph.node):
        return {"F32": len(inits)}
    names = {onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.INT4: "int4",
             onnx.TensorProto.UINT4: "uint4"}
    packed = {node.input[1] for node in model.graph.node if node.op_type == "MatMulNBits"}
    types: dict[str, int] = {}
    for init in inits:
        if init.name not in packed and (len(init.dims) < 2 or min(init.dims) < 2 or init.name.endswith(
                ("_scale", "_scales", "_zero_point", "_zero_points"))):
            continue  # scales, zero points, norms, biases and constants: not the matrices
        kind = "int4" if init.name in packed else names.get(init.data_type, "float")
        types[kind] = types.get(kind, 0) + 1
    return types
