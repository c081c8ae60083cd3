"""Property tests: the adapters' arithmetic agrees with transformers for any geometry."""

from __future__ import annotations

import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity.adapter import recognise, resolve
from parity.checkpoint.inspection import _ranges
from parity.reference.tiny import tiny_config
from tests.conftest import ADAPTERS


@st.composite
def geometries(draw):
    family = draw(st.sampled_from(["llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "mistral"]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    return family, {
        "num_hidden_layers": draw(st.integers(1, 5)),
        "num_key_value_heads": kv_heads,
        "num_attention_heads": heads,
        "head_dim": draw(st.sampled_from([8, 16, 24])),
        "hidden_size": heads * draw(st.sampled_from([4, 8, 16])),  # transformers wants a multiple of heads
        "intermediate_size": draw(st.integers(8, 200)),
        "vocab_size": draw(st.integers(16, 600)),
        "tie_word_embeddings": draw(st.booleans()),
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries())
def test_norm_and_parameter_counts_match_transformers_for_any_geometry(case):
    family, geometry = case
    architecture, config = tiny_config(ADAPTERS[family])
    config = {**config, **geometry, "model_type": ADAPTERS[family].spec.variants[0].model_type,
              "architectures": [architecture]}
    with torch.device("meta"):
        model = getattr(transformers, architecture)(transformers.AutoConfig.for_model(**config))
    adapter, variant = recognise(config, ADAPTERS)
    r = resolve(adapter, variant, config)
    norms = [n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()]
    assert sorted(n.hf.replace("{prefix}", variant.module_prefix) for n in r.norms) == sorted(norms)
    assert sum(t.numel for t in r.tensors) == sum(p.numel() for p in model.parameters())


@given(st.sets(st.integers(0, 60)))
def test_layer_ranges_list_every_layer_once(layers):
    text = _ranges(sorted(layers))
    back = set()
    for part in filter(None, text.split(", ")):
        lo, _, hi = part.partition("-")
        back |= set(range(int(lo), int(hi or lo) + 1))
    assert back == layers
