"""`parity inspect` on real configs reproduces DESIGN.md's conventions table."""

from __future__ import annotations

import pytest

from parity.checkpoint import open_checkpoint
from parity.inspection import report

from .conftest import FIXTURES

# config file -> (family, norm, eps or None, weight, placement, norms per layer), as in DESIGN.md
TABLE = {
    "bert-base-uncased.json": ("bert", "LayerNorm", 1e-12, "w, with bias", "Post-Norm", "2"),
    "gpt2.json": ("gpt2", "LayerNorm", 1e-5, "w, with bias", "Pre-Norm", "2"),
    "llama-3.1-8b.json": ("llama", "RMSNorm", 1e-5, "w", "Pre-Norm", "2"),
    "mistral-7b-v0.1.json": ("mistral", "RMSNorm", None, "w", "Pre-Norm", "2"),
    "qwen2.5-0.5b.json": ("qwen2", "RMSNorm", 1e-6, "w", "Pre-Norm", "2"),
    "qwen3-8b.json": ("qwen3", "RMSNorm", 1e-6, "w", "Pre-Norm", "2 + q/k norm"),
    "deepseek-v3.json": ("deepseek_v3", "RMSNorm", None, "w", "Pre-Norm", "2 + 2 inside MLA"),
    # families added after DESIGN.md's table: Qwen3's and Mistral's norms, with MoE feed-forwards (no MoE norms)
    "qwen3-30b-a3b.json": ("qwen3_moe", "RMSNorm", 1e-6, "w", "Pre-Norm", "2 + q/k norm"),
    "mixtral-8x7b-v0.1.json": ("mixtral", "RMSNorm", 1e-5, "w", "Pre-Norm", "2"),
    "olmo-2-1124-13b.json": ("olmo2", "RMSNorm", None, "w", "norm on sublayer output", "2 + q/k norm"),
    "codegemma-7b-it-ft.json": ("gemma", "RMSNorm", None, "1 + w", "Pre-Norm", "2"),
    "gemma-2-9b.json": ("gemma2", "RMSNorm", None, "1 + w", "sandwich", "4"),
    "gemma-3-1b-it.json": ("gemma3", "RMSNorm", None, "1 + w", "sandwich", "4 + q/k norm"),
    "gemma-4-26b-a4b.json": ("gemma4", "RMSNorm", None, "w", "sandwich", "4 + q/k/v norm"),
}


def test_every_real_config_is_in_the_table():
    assert sorted(TABLE) == sorted(p.name for p in (FIXTURES / "configs").glob("*.json"))


@pytest.mark.parametrize("name", sorted(TABLE))
def test_inspect_reproduces_design_table(name):
    family, norm, eps, weight, placement, per_layer = TABLE[name]
    data = report(open_checkpoint(FIXTURES / "configs" / name))
    assert data["family"] == family
    s = data["summary"]
    assert (s["norm"], s["weight"], s["placement"], s["norms_per_layer"]) == (norm, weight, placement, per_layer)
    if eps is not None:
        assert s["eps"] == eps


def test_llama_31_8b_norm_census():
    data = report(open_checkpoint(FIXTURES / "configs" / "llama-3.1-8b.json"))
    assert data["norms"]["count"] == 65
    assert data["norms"]["parameters"] == 266_240
    assert f"{data['norms']['share'] * 100:.3f}%" == "0.003%"


def test_gemma4_moe_norms_reported_apart_from_sandwich_norms():
    data = report(open_checkpoint(FIXTURES / "configs" / "gemma-4-26b-a4b.json"))
    (pattern,) = data["norms"]["per_layer"]
    assert (pattern["block"], pattern["attention"], pattern["layers"]) == (4, ["q", "k", "v"], "0-29")
    assert pattern["moe"] == 4  # router norm (weightless) + pre/post MoE-branch norms + dense-branch post norm
    assert data["norms"]["weightless"] == 30 + 30  # a v-norm and a router norm per layer
