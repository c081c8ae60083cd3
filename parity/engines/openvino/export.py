"""Conversion: OpenVINO's own converter (``openvino.convert_model``) on transformers' model of a checkpoint, its
weights compressed by NNCF where asked (the openvino candidate kind converts a Hugging Face checkpoint with it)."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import torch

from parity.engines.common import require
from parity.errors import ParityError
from parity.reference.decode import decodes
from parity.reference.models import cached_forward

EXAMPLE_PAST, EXAMPLE_NEW = 3, 2   # the traced call: a cache of 3 positions, 2 new tokens (no size is special)


def export(ckpt, out: Path, compression: str | None = None) -> None:
    """Write into ``out`` the OpenVINO IR of the checkpoint: transformers' own model traced by
    ``openvino.convert_model`` (a causal LM with its KV cache, made stateful by OpenVINO's transformation),
    weights compressed by NNCF when ``compression`` names an nncf.CompressWeightsMode, float32 kept as is."""
    import openvino as ov  # optional: openvino

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
    import transformers  # heavy: transformers

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
    from openvino._offline_transformations import apply_make_stateful_transformation  # optional: openvino
    from transformers.cache_utils import DynamicCache, DynamicLayer  # heavy: transformers

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
    nncf = require("nncf", "openvino", "NNCF (OpenVINO's weight compression)")
    try:
        return nncf.compress_weights(ovm, mode=getattr(nncf.CompressWeightsMode, mode))
    except Exception:  # noqa: BLE001 - a width that 128 does not divide: per-channel scales
        return nncf.compress_weights(ovm, mode=getattr(nncf.CompressWeightsMode, mode), group_size=-1)
