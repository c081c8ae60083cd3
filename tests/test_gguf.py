"""GGUF candidates run by llama.cpp itself: tiny checkpoints written with `parity convert --to gguf` (llama.cpp's
names and q/k layout, as convert_hf_to_gguf.py writes them) pass `check --layerwise` against transformers, and a
twin with a porting mistake fails where the mistake first acts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from parity.cli import cli

from .conftest import ADAPTERS

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

GGUF_FAMILIES = sorted(f for f, a in ADAPTERS.items() if a.spec.gguf is not None)
# what llama.cpp names in every architecture's graph; attention's output only where the model code names it
COMPARED = {"attn_in", "mid", "mlp_in", "mlp_out", "out"}
ATTN_OUT_NAMED = {"llama"}


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _check(reference, candidate, report, *extra):
    result = _cli("check", "--reference", reference, "--candidate", candidate, "--layerwise", "--report", report,
                  *extra)
    return result, json.loads(report.read_text())


def test_the_families_llama_cpp_runs():
    assert GGUF_FAMILIES == ["llama", "qwen2", "qwen3"]


# The tiny checkpoints exercise every switch of a family; llama.cpp implements the released models: Qwen2.5 and
# Qwen3 ship use_sliding_window false (llama.cpp's qwen2/qwen3 have no window), no RoPE scaling (--to gguf does
# not write yarn yet), and Qwen3 no attention biases (llama.cpp's qwen3 has no o_proj bias).
RELEASED = {"llama": {}, "qwen2": {"use_sliding_window": False, "rope_scaling": None},
            "qwen3": {"use_sliding_window": False, "rope_scaling": None, "attention_bias": False}}


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """released(family): a tiny checkpoint of the family as its released models are configured."""
    from parity.tiny import build_model

    root = tmp_path_factory.mktemp("released")
    made = {}

    def get(family: str):
        if family not in made:
            path = root / family
            build_model(ADAPTERS[family], overrides=RELEASED[family]).save_pretrained(path)
            made[family] = path
        return made[family]

    return get


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_f32_gguf_passes_layerwise_in_llama_cpp(family, tmp_path, released):
    reference = released(family)
    out = tmp_path / f"{family}.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert report["candidate"]["kind"] == "gguf"
    points = {p["name"]: p for p in report["points"]}
    layers = max(int(n.split(".")[1]) for n in points if n.startswith("layers.")) + 1
    assert layers == ADAPTERS[family].spec.tiny.layers
    for i in range(layers):
        for point in COMPARED:
            assert points[f"layers.{i}.{point}"]["compared"], (family, i, point)
        assert points[f"layers.{i}.attn_out"]["compared"] == (family in ATTN_OUT_NAMED)
    assert points["final_norm"]["compared"] and points["logits"]["compared"]
    assert not points["embed"]["compared"]  # llama.cpp's input embedding is not a named graph tensor here
    assert report["logits"]["top1_agreement"] == 1.0 and report["logits"]["kl_max"] < 1e-6


def test_llama_with_unpermuted_q_k_fails_at_the_first_attention(tmp_path, released):
    """The classic llama.cpp port mistake: q/k rows left half-split for a kernel that rotates adjacent pairs
    (written here through an adapter override that says llama.cpp's llama rotates half-split)."""
    reference = released("llama")
    overrides = tmp_path / "adapters"
    overrides.mkdir()
    toml = ADAPTERS["llama"].path.read_text()
    assert 'rope_style = "interleaved"' in toml
    (overrides / "llama.toml").write_text(toml.replace('rope_style = "interleaved"', 'rope_style = "half"'))
    out = tmp_path / "broken.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out, "--adapters", overrides).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json")
    assert result.exit_code == 1
    assert report["first_divergence"]["point"] == "layers.0.attn_out"


def test_a_family_without_gguf_export_is_refused(tmp_path, tiny_dir):
    result = CliRunner().invoke(cli, ["convert", str(tiny_dir("gemma2")), "--to", "gguf", "-o",
                                      str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and "does not export gemma2 to GGUF" in result.stderr
    assert not (tmp_path / "x.gguf").exists()
