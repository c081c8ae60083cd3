"""Qwen2/Qwen3 sliding windows as transformers 5 builds them: use_sliding_window, max_window_layers, layer_types."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from parity.adapter import recognise, resolve
from tests.conftest import ADAPTERS, FIXTURES

BASES = {"qwen2": "qwen2.5-0.5b.json", "qwen3": "qwen3-8b.json"}
CASES = {
    "released": {},
    "window-from-layer-21": {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21},
    "window-flag-off": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0},
    "null-window": {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    "absent-window": {"use_sliding_window": True, "sliding_window": "absent", "max_window_layers": 0},
    "explicit-layer-types": {"use_sliding_window": True, "sliding_window": 512,
                             "layer_types": ["full_attention", "sliding_attention"] * 12},
    "default-max-window-layers": {"use_sliding_window": True, "sliding_window": 512, "max_window_layers": "absent"},
    "no-head-dim-key": {"head_dim": "absent", "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 20},
}


@pytest.mark.parametrize("family", sorted(BASES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_sliding_window_per_layer_matches_transformers(family, case):
    config = {**json.loads((FIXTURES / "configs" / BASES[family]).read_text()), **CASES[case]}
    if "layer_types" in config:
        config["layer_types"] = (config["layer_types"] * 4)[: config["num_hidden_layers"]]
    config = {k: v for k, v in config.items() if v != "absent"}
    adapter, variant = recognise(config, ADAPTERS)
    r = resolve(adapter, variant, config)
    with torch.device("meta"):
        model = getattr(transformers, variant.architectures[0])(transformers.AutoConfig.for_model(**config))
    layers = model.model.layers
    assert [r.layer("attention.sliding_window", i) for i in range(r.num_layers)] == [
        layer.self_attn.sliding_window for layer in layers]
    assert r.layer("attention.head_dim", 0) == layers[0].self_attn.head_dim
    biases = [getattr(layers[0].self_attn, f"{p}_proj").bias is not None for p in "qkvo"]
    assert [r[f"attention.{p}_bias"] for p in "qkvo"] == biases
