"""Default prompt lengths: only conventions that change the computation with length count (sliding windows,
`dynamic` and `longrope` RoPE scaling), pinned for real configs and checked against transformers' own RoPE
functions for every scaling type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parity.checkpoint import open_checkpoint
from parity.checkpoint.lengths import default_length, exercised, thresholds

CONFIGS = Path(__file__).parent / "fixtures" / "configs"

# real configs (tests/fixtures/configs/SOURCES.md): the default prompt crosses each sliding window by 16 tokens;
# Llama 3.1's llama3 scaling and DeepSeek-V3's yarn act at every length, so their 8192 / 4096 is no threshold
PINNED = {
    "llama-3.1-8b.json": (64, {"rope llama3 scaling": True}),
    "deepseek-v3.json": (64, {"rope yarn scaling": True}),
    "gemma-2-9b.json": (4112, {"sliding window 4096": True}),
    "gemma-3-1b-it.json": (528, {"sliding window 512": True}),
    "gemma-4-26b-a4b.json": (1040, {"rope proportional scaling": True, "sliding window 1024": True}),
    "mistral-7b-v0.1.json": (4112, {"sliding window 4096": True}),
    "qwen3-8b.json": (64, {}),
    "qwen2.5-0.5b.json": (64, {}),
    "olmo-2-1124-13b.json": (64, {}),
    "gpt2.json": (64, {}),
    "bert-base-uncased.json": (64, {}),
    "codegemma-7b-it-ft.json": (64, {}),
    "qwen3-30b-a3b.json": (64, {}),           # use_sliding_window false: no window
    "mixtral-8x7b-v0.1.json": (64, {}),       # sliding_window null
    "smollm3-3b.json": (64, {}),              # use_sliding_window false, no RoPE scaling
}


def test_every_real_config_is_pinned():
    assert {f.name for f in CONFIGS.glob("*.json")} == set(PINNED)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_default_length_of_real_configs(name):
    ckpt = open_checkpoint(CONFIGS / name)
    length, seen = PINNED[name]
    assert default_length(ckpt) == length
    assert exercised(ckpt, length) == (seen, [])


SCALINGS = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 1024},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "longrope": {"original_max_position_embeddings": 1024, "short_factor": [1.0] * 8,
                 "long_factor": [2.0 + k for k in range(8)]},
}


def _llama(tmp_path: Path, kind: str) -> tuple[Path, dict]:
    config = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
    config.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_hidden_layers=2,
                  max_position_embeddings=2048, rope_scaling={"rope_type": kind, **SCALINGS[kind]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path / "config.json", config


def _hf_frequencies(config: dict, kind: str, seq_len: int) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[kind](LlamaConfig(**config), None, seq_len=seq_len)[0]


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_a_threshold_is_where_transformers_changes_the_frequencies(tmp_path, kind):
    path, config = _llama(tmp_path, kind)
    found = thresholds(open_checkpoint(path))
    short = _hf_frequencies(config, kind, 1)
    if kind not in ("dynamic", "longrope"):
        assert found == {}
        assert torch.equal(short, _hf_frequencies(config, kind, 100_000))  # the same at every length
        seen, warnings = exercised(open_checkpoint(path), 1)
        assert seen == {f"rope {kind} scaling": True} and warnings == []
        return
    ((label, at),) = found.items()
    assert at == (2048 if kind == "dynamic" else 1024)
    assert torch.equal(short, _hf_frequencies(config, kind, at))          # up to the threshold: unchanged
    assert not torch.equal(short, _hf_frequencies(config, kind, at + 1))  # one past it: changed
    seen, warnings = exercised(open_checkpoint(path), at)
    assert seen == {label: False} and f"use --length {at + 16}" in warnings[0]


def test_default_length_stops_at_the_models_positions(tmp_path):
    path, _ = _llama(tmp_path, "dynamic")  # dynamic NTK acts only past max_position_embeddings (2048)
    assert default_length(open_checkpoint(path)) == 2048
    path, _ = _llama(tmp_path, "longrope")
    assert default_length(open_checkpoint(path)) == 1040


def test_llama4_chunks_and_temperature_floor_are_thresholds(tiny_dir):
    """Llama 4's chunked attention changes nothing until a prompt outgrows the first chunk, and its temperature
    tuning nothing until position floor_scale - 1: both are lengths the default prompt must cross."""
    ckpt = open_checkpoint(tiny_dir("llama4"))
    assert thresholds(ckpt) == {"attention chunk 16": 16, "attention temperature floor 8": 8}
    assert default_length(ckpt) == 64  # MIN_LENGTH, past 16 + 16
    seen, warnings = exercised(ckpt, 12)
    assert seen["attention chunk 16"] is False and seen["attention temperature floor 8"] is True
    assert any("attention chunk 16" in w for w in warnings)
