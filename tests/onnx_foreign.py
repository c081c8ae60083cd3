"""Third-party ONNX files as users deploy them, for tests/test_onnx_foreign.py: the transformers model exported by
torch.onnx's TorchScript exporter (the one Optimum drives) inside a wrapper module, so that every name carries the
wrapper's prefix (``inner.encoder.layer.0...``) and each Linear's weight becomes an anonymous transposed initializer
(``onnx::MatMul_312``); then quantized by onnxruntime's own tools, which name what they add after it
(``onnx::MatMul_312_quantized``, ``_scale``, ``MatMul_quant`` nodes). No parity code is involved in making them."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np

MODES = ("int8-dynamic", "qdq", "qoperator", "int4")


def export(src: str, out: str) -> str:
    """The model at ``src`` (a BERT one as its BertModel, without pooler: an encoder's embeddings; a causal LM
    whole) wrapped as ``inner`` and exported with dynamic batch and sequence, opset 17."""
    import torch
    import transformers

    warnings.simplefilter("ignore")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = json.loads((Path(src) / "config.json").read_text())
    encoder = config["model_type"] == "bert"
    if encoder:
        inner = transformers.BertModel.from_pretrained(src, attn_implementation="eager", add_pooling_layer=False)
    else:
        inner = getattr(transformers, config["architectures"][0]).from_pretrained(src, attn_implementation="eager")
        inner.config.use_cache = False

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            if token_type_ids is None:
                return self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if encoder else [])
    ids = torch.tensor([[3 + (7 * k) % 200 for k in range(16)]] * 2)
    args = (ids, torch.ones_like(ids)) + ((torch.zeros_like(ids),) if encoder else ())
    with torch.no_grad():
        torch.onnx.export(Wrapper(inner.eval()), args, out, input_names=names,
                          output_names=["last_hidden_state" if encoder else "logits"],
                          dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names}, opset_version=17,
                          dynamo=False)
    return out


class _Prompt:
    """onnxruntime's CalibrationDataReader over one prompt of the graph's inputs."""

    def __init__(self, ids: np.ndarray, inputs: list[str]):
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        self.feeds = [{k: v for k, v in feed.items() if k in inputs}]

    def get_next(self):
        return self.feeds.pop() if self.feeds else None

    def rewind(self):
        pass


def quantize(src: str, out: str, mode: str, only_matmuls: bool = True) -> str:
    """``src`` quantized by onnxruntime as its docs show: quantize_dynamic with its defaults (int8-dynamic),
    quantize_static in QDQ or QOperator format calibrated on one prompt, of the projections alone (the MatMuls by a
    weight, as onnxruntime's transformer recipes keep attention's own matmuls in float) unless ``only_matmuls`` is
    False (then every op it quantizes), or MatMulNBitsQuantizer (int4, blocks of 32)."""
    import onnx
    from onnxruntime import quantization as q

    warnings.simplefilter("ignore")
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        if mode == "int8-dynamic":
            q.quantize_dynamic(src, out)
        elif mode in ("qdq", "qoperator"):
            model = onnx.load(src)
            inputs = [i.name for i in model.graph.input]
            weights = {i.name for i in model.graph.initializer}
            projections = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
            ids = np.array([[3 + (7919 * k + 17) % 253 for k in range(64)]], dtype=np.int64)
            fmt = q.QuantFormat.QDQ if mode == "qdq" else q.QuantFormat.QOperator
            q.quantize_static(src, out, _Prompt(ids, inputs), quant_format=fmt,
                              nodes_to_quantize=projections if only_matmuls else None)
        else:
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            quantizer = MatMulNBitsQuantizer(onnx.load(src), block_size=32)
            quantizer.process()
            quantizer.model.save_model_to_file(out)
    finally:
        logging.disable(disabled)
    return out


def copy_weights(src: str, out: str, scope: str) -> str:
    """The int8 graph at ``src`` with the MatMulInteger of module path ``scope.format(1)`` computing with the
    weights and scale of ``scope.format(0)`` (``/layer.{}/attention/self/query/``): a plausible quantization of the
    wrong tensor."""
    import onnx
    from onnx import numpy_helper as nh

    model = onnx.load(src)
    inits = {i.name: i for i in model.graph.initializer}
    b = {k: next(n.input[1] for n in model.graph.node if n.op_type == "MatMulInteger" and scope.format(k) in n.name)
         for k in (0, 1)}
    for suffix in ("_quantized", "_scale"):
        source, target = (inits[b[k].removesuffix("_quantized") + suffix] for k in (0, 1))
        target.CopyFrom(nh.from_array(nh.to_array(source), target.name))
    onnx.save(model, out)
    return out
