"""Qwen2's sliding window as transformers 5 builds it: use_sliding_window, max_window_layers and layer_types."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from parity.adapter import recognise, resolve

from .conftest import ADAPTERS, FIXTURES

BASE = json.loads((FIXTURES / "configs" / "qwen2.5-0.5b.json").read_text())
CASES = {
    "released": {},
    "window-from-layer-21": {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21},
    "window-flag-off": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0},
    "null-window": {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    "explicit-layer-types": {"use_sliding_window": True, "sliding_window": 512,
                             "layer_types": ["full_attention", "sliding_attention"] * 12},
    "default-max-window-layers": {"use_sliding_window": True, "sliding_window": 512, "max_window_layers": None},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sliding_window_per_layer_matches_transformers(case):
    config = {**BASE, **CASES[case]}
    config = {k: v for k, v in config.items() if v is not None or k == "sliding_window"}  # None = key absent
    adapter, variant = recognise(config, ADAPTERS)
    r = resolve(adapter, variant, config)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(transformers.AutoConfig.for_model(**config))
    theirs = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert [r.layer("attention.sliding_window", i) for i in range(r.num_layers)] == theirs
    assert (r["attention.q_bias"], r["attention.k_bias"], r["attention.v_bias"], r["attention.o_bias"]) == (
        True, True, True, False)
