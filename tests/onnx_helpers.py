"""ONNX exports for tests/test_onnx.py, run in worker processes (importable by name, so spawn can find them)."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path


def export_ours(src: str, out: str, dtype: str, kv_cache: bool = False) -> str:
    """`parity convert SRC --to onnx --debug-outputs --dtype DTYPE -o OUT [--kv-cache]`."""
    from parity.engines.onnx.export import export

    export(Path(src), Path(out), dtype=dtype, debug_outputs=True, kv_cache=kv_cache)
    return out


def export_foreign(src: str, out: str) -> str:
    """torch.onnx (dynamo) straight from the transformers model, as a user would export it: no parity involved."""
    import torch
    import transformers


    warnings.simplefilter("ignore")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cls = getattr(transformers, json.loads((Path(src) / "config.json").read_text())["architectures"][0])
    model = cls.from_pretrained(src, attn_implementation="eager").eval()
    model.config.use_cache = False
    ids = torch.tensor([[3 + (7 * k) % 200 for k in range(16)]] * 2)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "token_type_ids" in model.forward.__code__.co_varnames:
        kwargs["token_type_ids"] = torch.zeros_like(ids)
    dims = {name: {0: "batch", 1: "sequence"} for name in kwargs}
    with torch.no_grad():
        program = torch.onnx.export(model, (), kwargs=kwargs, dynamo=True, dynamic_shapes=dims, verbose=False)
    program.save(out)
    return out
