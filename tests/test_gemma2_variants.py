"""Gemma 2 adapter against transformers: sandwich norms, softcaps, query_pre_attn_scalar, alternating windows."""

from __future__ import annotations

import json

from parity.adapter import recognise, resolve
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS, FIXTURES
from tests.test_gemma_variants import mismatches, real_model


def test_tiny_gemma2_agrees_with_transformers():
    model = build_model(ADAPTERS["gemma2"])
    config = model.config.to_dict()
    adapter, variant = recognise(config, ADAPTERS)
    r = resolve(adapter, variant, config)
    assert mismatches(model, r, variant.module_prefix) == []
    assert r["embedding.final_softcap"] == model.config.final_logit_softcapping
    assert r["attention.scale"] != r.layer("attention.head_dim", 0) ** -0.5  # query_pre_attn_scalar rules


def test_real_gemma2_config_agrees_with_transformers():
    config = json.loads((FIXTURES / "configs" / "gemma-2-9b.json").read_text())
    model, r, variant = real_model(config)
    assert mismatches(model, r, variant.module_prefix) == []
    # no layer_types in the file: transformers' default alternation, even layers slide
    assert r["attention.sliding_window"][:4] == [4096, None, 4096, None]
    assert (r["attention.softcap"], r["embedding.final_softcap"]) == (50.0, 30.0)
    assert r["attention.scale"] == 256 ** -0.5


def test_absent_keys_take_gemma2_config_defaults():
    config = json.loads((FIXTURES / "configs" / "gemma-2-9b.json").read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "query_pre_attn_scalar"):
        config.pop(key)
    model, r, variant = real_model(config)
    assert mismatches(model, r, variant.module_prefix) == []
    assert r["embedding.final_softcap"] == model.config.final_logit_softcapping == 30.0
