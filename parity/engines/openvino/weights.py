"""An IR's weights: read back as a same-weights reference (``read_back``: each MatMul's and Gather's weight,
decompressed by OpenVINO itself), and how the IR stores them, from its .xml alone (``stored``)."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import torch

from parity.checkpoint import stored_tensor_map
from parity.compare import metrics
from parity.engines.openvino.graph import element_count, scope
from parity.engines.same_weights import write_reference
from parity.errors import ParityError
from parity.storage.lazy import Dequantizer
from parity.weights import Tally, commonest

BANDS = {8: 0.02, 4: 0.3}  # rel_l2 of an NNCF-compressed tensor beyond which it is not a compression of it
EXACT = 1e-6


def read_back(ckpt, xml: Path, out: Path) -> dict:
    """Write into ``out`` the reference checkpoint holding the IR's own weights: each MatMul's and Gather's weight
    (found by the module path in its op's name), decompressed by OpenVINO itself, where NNCF stored it in 8 or 4
    bits; the checkpoint's own tensors elsewhere. A tensor that is not a compression of the checkpoint's (beyond
    its band) is reported, and the reference keeps the checkpoint's own there (as every engine's read_back does).
    OpenVINO computes in float32 on decompressed weights (dynamic quantization is off): the arithmetic is
    transformers' own."""
    import openvino as ov  # optional: openvino

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
    write_reference(ckpt, Path(out), tensors, None, untie=untie)
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
            if element_count(n) > size:
                best, size = n.get_output_element_type(0).get_type_name(), element_count(n)
            continue
        if n.get_type_name() in ("Parameter", "ReadValue") or n.get_input_size() == 0:
            return None
        stack.extend(v.get_node() for v in n.input_values())
    return best


def _evaluate(ov, ports: list) -> list[np.ndarray]:
    """The values of constant subgraphs, computed by OpenVINO (its own decompression of NNCF's weights)."""
    if not ports:
        return []
    from openvino import opset13  # optional: openvino

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
