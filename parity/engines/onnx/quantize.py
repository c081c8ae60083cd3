"""``parity convert --to onnx --onnx-quant MODE``: parity's ONNX export, quantized by onnxruntime's own tools, as
users quantize theirs.

- ``int8-dynamic``: ``quantize_dynamic`` with its defaults: every MatMul whose B is a weight becomes
  DynamicQuantizeLinear (the activation to uint8, one scale per tensor, computed at run time) + MatMulInteger
  with the weight in int8 (one scale per tensor); the embedding's Gather reads uint8 weights through a
  DequantizeLinear.
- ``qdq``: ``quantize_static`` in QDQ format, calibrated (MinMax) on the check's default prompt: a
  QuantizeLinear/DequantizeLinear pair with a static scale on each projection's input, and int8 weights through a
  DequantizeLinear. Only the projections (MatMuls with a weight) are quantized: attention's own matmuls, softmax,
  norms, RoPE and the residual adds stay float32, as ORT's transformer recipes keep them.
- ``int4``: ``MatMulNBitsQuantizer``: MatMulNBits with 4-bit weights in blocks of 32 along the input, a float
  scale and a 4-bit zero point per block, accuracy_level left unset.

torch.onnx writes a projection as MatMul(x, Transpose(W)); the quantizers take only a MatMul whose B is an
initializer, so each such Transpose is folded first into an initializer named ``{W}.T`` (the neutral name, so that
``--same-weights`` maps each quantized weight back to the checkpoint: parity.engines.onnx.weights).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime import quantization as q
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from parity.checkpoint import open_checkpoint
from parity.checkpoint.inputs import make_inputs
from parity.engines.onnx.export import export as to_onnx
from parity.errors import ParityError
from parity.storage import atomic

MODES = ("int8-dynamic", "qdq", "int4")
TRANSPOSED = ".T"      # suffix of a weight folded from Transpose(W): W laid out [in, out]
BLOCK = 32             # int4: weights per block along the input


def fold_transposes(model) -> int:
    """Replace each Transpose of an initializer that only MatMuls read (as their B) by the transposed initializer,
    named ``{W}.T``; returns how many. Initializers left unread are dropped."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    kept, folded = [], 0
    for node in graph.node:
        users = readers.get(node.output[0], []) if node.output else []
        if node.op_type == "Transpose" and node.input[0] in inits and users and \
                all(u.op_type == "MatMul" and list(u.input).index(node.output[0]) == 1 for u in users):
            w = numpy_helper.to_array(inits[node.input[0]])
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if w.ndim != 2 or perm not in (None, [1, 0]):
                kept.append(node)
                continue
            name = node.input[0] + TRANSPOSED
            if name not in inits:
                inits[name] = numpy_helper.from_array(np.ascontiguousarray(w.T), name)
                graph.initializer.append(inits[name])
            for u in users:
                u.input[1] = name
            folded += 1
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    read = {x for n in graph.node for x in n.input} | {o.name for o in graph.output}
    alive = [i for i in graph.initializer if i.name in read]
    del graph.initializer[:]
    graph.initializer.extend(alive)
    return folded


def _weight_matmuls(model) -> list[str]:
    """The MatMul nodes whose B is an initializer (the projections), named (a name is given where none is)."""
    inits = {i.name for i in model.graph.initializer}
    found = []
    for k, node in enumerate(model.graph.node):
        if node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in inits:
            if not node.name:
                node.name = f"parity_matmul_{k}"
            found.append(node.name)
    return found


class _Prompt:
    """onnxruntime's CalibrationDataReader: the check's default prompt, once (the inputs the graph declares)."""

    def __init__(self, ids: np.ndarray, names: list[str]):
        feed = {"input_ids": ids}
        if "token_type_ids" in names:
            feed["token_type_ids"] = np.zeros_like(ids)
        self.feeds = [feed]

    def get_next(self):
        return self.feeds.pop() if self.feeds else None

    def rewind(self):  # noqa: D102 - part of onnxruntime's reader protocol; one pass is all MinMax takes
        pass


def _default_ids(model_dir: Path, adapter_dirs) -> np.ndarray:
    return make_inputs(open_checkpoint(Path(model_dir), adapter_dirs)).ids.numpy().astype(np.int64)


def _quantize(mode: str, src: Path, dst: Path, ids: np.ndarray) -> None:
    """Run onnxruntime's quantizer of ``mode`` on the folded float graph at ``src``, writing ``dst``."""
    model = onnx.load(str(src))
    nodes = _weight_matmuls(model)
    if not nodes:
        raise ParityError(f"{src.name}: the graph has no MatMul with a weight to quantize")
    onnx.save(model, str(src))  # with the node names given above
    disabled = logging.root.manager.disable
    with warnings.catch_warnings():  # its advice to pre-process, its per-node log and numpy's casts: not the user's
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            _run_quantizer(mode, src, dst, model, nodes, ids)
        finally:
            logging.disable(disabled)


def _run_quantizer(mode: str, src: Path, dst: Path, model, nodes: list[str], ids: np.ndarray) -> None:
    if mode == "int8-dynamic":
        q.quantize_dynamic(str(src), str(dst))
    elif mode == "qdq":
        reader = _Prompt(ids, [i.name for i in model.graph.input])
        q.quantize_static(str(src), str(dst), reader, quant_format=q.QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                          nodes_to_quantize=nodes)
    elif mode == "int4":
        quantizer = MatMulNBitsQuantizer(model, block_size=BLOCK, nodes_to_include=nodes)
        quantizer.process()
        quantizer.model.save_model_to_file(str(dst))
    else:
        raise ParityError(f"--onnx-quant {mode}: choose one of {', '.join(MODES)}")


def quantize(model_dir: Path, out: Path, mode: str, *, force: bool = False, adapter_dirs=(), **export) -> dict:
    """Export ``model_dir`` to ONNX in float32 (parity.engines.onnx.export.export, with ``export``'s options), fold the
    weights' transposes and quantize it with onnxruntime (``mode``: one of MODES), atomically at ``out``. Returns
    the export's summary with "quantized": {"mode", "ops": {op type: count}}."""
    if mode not in MODES:
        raise ParityError(f"--onnx-quant {mode}: choose one of {', '.join(MODES)}")
    if export.get("dtype") not in (None, "float32"):
        raise ParityError(f"--onnx-quant quantizes a float32 graph; drop --dtype {export['dtype']}")
    if export.get("kv_cache"):
        raise ParityError("--onnx-quant: a graph with a KV cache is not quantized by parity yet; drop --kv-cache")
    out = Path(out)
    if out.suffix != ".onnx":
        raise ParityError(f"-o {out}: an ONNX output must end in .onnx")
    with atomic.output_file(out, force=force) as tmp:
        done = to_onnx(model_dir, tmp / "float.onnx", adapter_dirs=adapter_dirs, **export)
        if done["external_data"]:
            raise ParityError(f"{model_dir}: past 2 GB of weights; parity quantizes graphs that fit one file")
        ops = quantize_graph(tmp / "float.onnx", tmp / out.name, mode, _default_ids(model_dir, adapter_dirs))
    return {**done, "quantized": {"mode": mode, "ops": ops}}


def quantize_graph(src: Path, dst: Path, mode: str, ids: np.ndarray) -> dict[str, int]:
    """Quantize parity's float32 export at ``src`` into ``dst`` (``mode``: one of MODES; ``ids`` [1, S]: the
    calibration prompt of qdq): its weights' transposes folded, onnxruntime's quantizer run, the export's metadata
    kept. Returns the quantized graph's count of each quantization op."""
    model = onnx.load(str(src))
    if not fold_transposes(model):
        raise ParityError(f"{src}: the graph has no weight read through a Transpose to fold (not parity's export)")
    folded = Path(dst).with_name(Path(dst).name + ".folded.onnx")
    try:
        onnx.save(model, str(folded))
        _quantize(mode, folded, Path(dst), ids)
    finally:
        folded.unlink(missing_ok=True)
    written = onnx.load(str(dst))
    for p in model.metadata_props:  # the manifest and capture points
        if not any(m.key == p.key for m in written.metadata_props):
            written.metadata_props.append(p)
    ops: dict[str, int] = {}
    for node in written.graph.node:
        if node.op_type in ("MatMulInteger", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear",
                            "MatMulNBits", "MatMul"):
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    onnx.save(written, str(dst))
    return ops
