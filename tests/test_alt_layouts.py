"""The other ways one model lies on disk: saved from the base model (no ``model.`` prefix), with source dtypes
mixed in one checkpoint, in shards whose names only the index knows. Each is recognised, converted and
checked layerwise against transformers loading the same directory."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity.checkpoint import open_checkpoint
from parity.checkpoint.inspection import report
from parity.cli import cli
from parity.reference.tiny import make_tiny
from tests.conftest import ADAPTERS


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _converts_and_passes(path, tmp_path, *extra) -> dict:
    assert _cli("convert", path, "--to", "neutral", "-o", tmp_path / "n").exit_code == 0
    result = _cli("check", "--reference", path, "--candidate", tmp_path / "n", "--layerwise", *extra,
                  "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["points"] and all(p["passed"] for p in data["points"])
    return data


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_saved_without_the_model_prefix(family, stream, tmp_path):
    """Saved from the base model class (``LlamaModel.save_pretrained``: ``layers.0...``, ``embed_tokens``), the
    config still naming the LM class; the head kept as ``lm_head.weight``. transformers adds the prefix."""
    path = make_tiny(ADAPTERS[family], tmp_path / family)
    sd = {k.removeprefix("model."): v for k, v in load_file(path / "model.safetensors").items()}
    assert "embed_tokens.weight" in sd
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    data = report(open_checkpoint(path)).to_json()["weights"]
    assert data["accounted_for"] and data["prefix"] == ""
    _converts_and_passes(path, tmp_path, stream)


def test_mixed_source_dtypes(tmp_path):
    """bf16 embeddings, fp16 attention, fp32 norms and MLP in one checkpoint (as partial re-saves leave them)."""
    path = make_tiny(ADAPTERS["llama"], tmp_path / "llama")
    sd = load_file(path / "model.safetensors")
    for name in sd:
        if "embed_tokens" in name or name == "lm_head.weight":
            sd[name] = sd[name].to(torch.bfloat16)
        elif "self_attn" in name:
            sd[name] = sd[name].to(torch.float16)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    dtypes = report(open_checkpoint(path)).to_json()["weights"]["dtypes"]
    assert set(dtypes) == {"BF16", "F16", "F32"}
    _converts_and_passes(path, tmp_path)
    manifest = json.loads((tmp_path / "n" / "manifest.json").read_text())
    assert manifest["dtype"] == "float32"  # no one source dtype: converted without losing any


def test_shards_named_only_by_the_index(tmp_path):
    """Shards with names no glob would guess, split across three files; the index is the only map."""
    path = make_tiny(ADAPTERS["gemma2"], tmp_path / "gemma2")
    sd = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(sd)
    weight_map = {}
    for k, part in enumerate((names[0::3], names[1::3], names[2::3])):
        shard = f"weights-part{k}-of-three.safetensors"
        save_file({n: sd[n] for n in part}, path / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    data = report(open_checkpoint(path)).to_json()["weights"]
    assert data["accounted_for"] and len(data["files"]) == 3
    _converts_and_passes(path, tmp_path)
