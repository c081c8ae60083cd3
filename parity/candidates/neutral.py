"""Neutral directories (``parity convert``): run by parity's own executor, which can also run a catalogued
porting mistake (``--inject``) exactly as a port would."""

from __future__ import annotations

from pathlib import Path

import torch

from parity.candidates.weights import checkpoint
from parity.diagnosis import bugs
from parity.errors import ParityError
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load as read, read_manifest
from parity.reference.models import Emit, Models

KIND = "neutral"
TAKES = "a neutral directory (manifest.json)"
ISOLATES = True                    # the executor takes each layer's input from the reference
OPTIONS = ("inject", "layers")     # --inject: the executor runs a catalogued mistake; --layers: a slice


def detect(path: Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def load(models: Models, path: Path, dtype: torch.dtype, inject: str | None = None,
         source_rope_style: str | None = None):
    """The executor's model for a neutral directory, loaded once per check (and per injected mistake).
    ``source_rope_style``: the RoPE style of the checkpoint it was converted from (the reference's), in whose q/k
    row order its operation-level points are emitted."""
    key = (KIND, str(path), dtype, inject)
    if key not in models.loaded:
        # an injected mistake rewrites tensors, so that candidate is held whole
        manifest, tensors = read(path, lazy=models.stream and not inject)
        if inject:  # the executor runs the mistake exactly as a port would
            manifest, tensors = bugs.inject(inject, manifest, tensors, bugs.families())
        models.loaded[key] = NeutralModel(manifest, tensors, dtype, models.device["candidate"], source_rope_style)
    return models.loaded[key]


def _source_rope_style(candidate) -> str | None:
    """The reference checkpoint's RoPE style: the q/k row order operation-level points are emitted in."""
    ckpt = candidate.ckpt
    style = None if ckpt is None else ckpt.resolved["positions.rope_style"]
    return style if style in ("half", "interleaved") else None


def _model(candidate):
    return load(candidate.models, candidate.path, candidate.dtype, candidate.options.inject,
                _source_rope_style(candidate))


def make_runner(candidate, ids: torch.Tensor, feed):
    model = _model(candidate)

    def run(emit: Emit) -> None:
        model(ids, on_point=emit, feed=feed, layers=candidate.options.layers, ops=candidate.options.ops)

    return run


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """The prompt, then one token per step through the executor's KV cache (parity.neutral.executor.cache), following
    the manifest's cache policy (an injected decode bug changes it)."""
    model = _model(candidate)

    def run(emit) -> None:
        cache = model.new_cache()
        model(ids, cache=cache)
        for step, token in enumerate(tokens, 1):
            model(torch.tensor([[token]]), on_point=lambda name, t: emit(step, name, t), cache=cache,
                  ops=candidate.options.ops)

    return run


def shapes(path: Path, adapter_dirs=()) -> list:
    """The shapes of the weights parity will hold to run it (the check decides from them whether to stream)."""
    return [info.shape for info in read_manifest(path).tensors.values()]


def describe(path: Path, engine: dict | None = None) -> dict:
    """What the report's candidate entry adds: how a quantized source was dequantized by convert."""
    q = read_manifest(path).source.quantization
    return {} if q is None else {"quantization": q}


def check_span(path: Path, start: int, stop: int) -> None:
    """A slice --layers START:STOP starts from the reference's input to layer START: a layer of the slice that
    reuses the keys and values of an earlier layer outside it cannot run."""
    for i, layer in enumerate(read_manifest(path).layers[start:stop], start):
        source = layer.attention.kv_shared_from
        if source is not None and source < start:
            raise ParityError(f"--layers {start}:{stop}: layer {i} reuses the keys and values of layer {source}; "
                              f"start the slice at {source} or earlier")


def weights(path: Path, engine: dict | None = None):
    """Its tensors' dtypes, from the safetensors headers (convert dequantized a quantized source: describe says how)."""
    return checkpoint(path)
