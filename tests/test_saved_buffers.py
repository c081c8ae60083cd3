"""Checkpoints as older transformers and re-save tools wrote them: saved buffers (RoPE inv_freq, BERT's
position_ids, GPT-2's masks) recognised and checked against the config, legacy names (LayerNorm.gamma /
.beta) renamed as transformers renames them; each converts and passes ``check --layerwise`` against
transformers loading the very same directory."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity.checkpoint import check_tensors, open_checkpoint
from parity.checkpoint.inspection import report
from parity.cli import cli
from parity.reference.tiny import make_tiny
from tests.conftest import ADAPTERS


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _rewrite(path, edit):
    sd = load_file(path / "model.safetensors")
    sd = edit(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    """How transformers < 4.31 computed the buffer it then saved."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))


def _buffers(path) -> dict[str, dict]:
    return {b["name"]: b for b in report(open_checkpoint(path)).to_json()["weights"]["buffers"]}


@pytest.fixture
def llama_with_inv_freq(tmp_path):
    """A Llama saved by transformers < 4.31: every layer's rotary_emb.inv_freq in the shards (fp16, like a
    model.half() save), plus a model-level one as some merge tools keep."""
    path = make_tiny(ADAPTERS["llama"], tmp_path / "llama")
    config = json.loads((path / "config.json").read_text())
    dim = config["hidden_size"] // config["num_attention_heads"]
    config["rope_theta"] = open_checkpoint(path).resolved["positions.rope_theta"]
    assert config["rope_theta"] == 500000.0

    def add(sd):
        for i in range(config["num_hidden_layers"]):
            sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = _inv_freq(config["rope_theta"], dim).half()
        sd["model.rotary_emb.inv_freq"] = _inv_freq(config["rope_theta"], dim)
        return sd

    _rewrite(path, add)
    return path, config, dim


def test_inv_freq_buffers_are_listed_apart_and_agree(llama_with_inv_freq):
    path, config, _ = llama_with_inv_freq
    ckpt = open_checkpoint(path)
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok and not check.unexpected
    assert sorted(check.buffers) == sorted([f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
                                            for i in range(config["num_hidden_layers"])] + ["model.rotary_emb.inv_freq"])
    buffers = _buffers(path)
    assert all(b["agrees"] and b["kind"] == "rope_inv_freq" for b in buffers.values())
    # the tiny llama has llama3 scaling: the saved (pre-scaling) buffer is the unscaled table
    assert "unscaled" in buffers["model.rotary_emb.inv_freq"]["note"]
    out = _cli("inspect", path).output
    assert "every one accounted for" in out and "saved buffers, not weights (3)" in out


def test_inv_freq_that_disagrees_with_rope_theta_is_flagged(llama_with_inv_freq):
    path, config, dim = llama_with_inv_freq
    _rewrite(path, lambda sd: {**sd, "model.layers.1.self_attn.rotary_emb.inv_freq": _inv_freq(10000.0, dim)})
    buffers = _buffers(path)
    wrong = buffers["model.layers.1.self_attn.rotary_emb.inv_freq"]
    assert not wrong["agrees"]
    assert "implies rope_theta ~ 10000" in wrong["note"] and "500000" in wrong["note"]
    assert buffers["model.layers.0.self_attn.rotary_emb.inv_freq"]["agrees"]
    out = _cli("inspect", path).output
    assert "disagrees with the config" in " ".join(out.split())


def test_inv_freq_of_the_wrong_width_is_flagged(llama_with_inv_freq):
    path, config, dim = llama_with_inv_freq
    _rewrite(path, lambda sd: {**sd, "model.rotary_emb.inv_freq": _inv_freq(config["rope_theta"], dim // 2)})
    note = _buffers(path)["model.rotary_emb.inv_freq"]["note"]
    assert f"holds {dim // 4} frequencies" in note and f"implies {dim // 2}" in note


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_llama_with_inv_freq_converts_and_passes_layerwise(llama_with_inv_freq, tmp_path, stream):
    path, _, _ = llama_with_inv_freq
    assert _cli("convert", path, "--to", "neutral", "-o", tmp_path / "n").exit_code == 0
    result = _cli("check", "--reference", path, "--candidate", tmp_path / "n", "--layerwise", stream,
                  "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    points = json.loads((tmp_path / "r.json").read_text())["points"]
    assert len(points) == 15 and all(p["passed"] for p in points)


def test_gemma3_local_and_global_inv_freq_each_agree_with_their_theta(tmp_path):
    """Gemma 3 has two rotary tables: a model-level buffer is checked against the layers that use it."""
    path = make_tiny(ADAPTERS["gemma3"], tmp_path / "g3")
    r = open_checkpoint(path).resolved
    dim = r.layer("attention.head_dim", 0)
    thetas = sorted({r.layer("positions.rope_theta", i) for i in range(r.num_layers)})
    assert len(thetas) == 2
    _rewrite(path, lambda sd: {**sd, "model.rotary_emb_local.inv_freq": _inv_freq(thetas[0], dim),
                               "model.rotary_emb.inv_freq": _inv_freq(thetas[1], dim)})
    buffers = _buffers(path)
    assert all(b["agrees"] for b in buffers.values()) and len(buffers) == 2
    _rewrite(path, lambda sd: {**sd, "model.rotary_emb.inv_freq": _inv_freq(thetas[1] * 7, dim)})
    assert not _buffers(path)["model.rotary_emb.inv_freq"]["agrees"]


@pytest.fixture
def minilm_style_bert(tmp_path):
    """Like sentence-transformers/all-MiniLM-L6-v2 as converted from TF: a BertModel saved without the `bert.`
    prefix, LayerNorm.gamma / .beta names, and the embeddings.position_ids buffer."""
    source = make_tiny(ADAPTERS["bert"], tmp_path / "source")
    path = tmp_path / "bert"
    path.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (path / "config.json").write_text(json.dumps(config))
    sd = {}
    for name, x in load_file(source / "model.safetensors").items():
        if name.startswith("bert."):
            sd[name.removeprefix("bert.").replace("LayerNorm.weight", "LayerNorm.gamma")
               .replace("LayerNorm.bias", "LayerNorm.beta")] = x
    sd["embeddings.position_ids"] = torch.arange(config["max_position_embeddings"]).unsqueeze(0)
    sd["embeddings.token_type_ids"] = torch.zeros(1, config["max_position_embeddings"], dtype=torch.long)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path, config


def test_bert_legacy_names_and_position_ids_are_accounted_for(minilm_style_bert):
    path, config = minilm_style_bert
    data = report(open_checkpoint(path)).to_json()["weights"]
    assert data["accounted_for"] and data["prefix"] == ""
    assert len(data["legacy_names"]) == 2 * (1 + 2 * config["num_hidden_layers"])  # gamma and beta of each LN
    assert all(n.endswith(("LayerNorm.gamma", "LayerNorm.beta")) for n in data["legacy_names"])
    kinds = {b["name"]: (b["kind"], b["agrees"]) for b in data["buffers"]}
    assert kinds == {"embeddings.position_ids": ("position_ids", True),
                     "embeddings.token_type_ids": ("token_type_ids", True)}


def test_bert_position_ids_out_of_order_are_flagged(minilm_style_bert):
    path, config = minilm_style_bert
    n = config["max_position_embeddings"]
    _rewrite(path, lambda sd: {**sd, "embeddings.position_ids": (torch.arange(n) + 1).unsqueeze(0)})
    b = _buffers(path)["embeddings.position_ids"]
    assert not b["agrees"] and "position 0 holds 1" in b["note"]


def test_bert_legacy_checkpoint_converts_and_passes_layerwise(minilm_style_bert, tmp_path):
    path, _ = minilm_style_bert
    assert _cli("convert", path, "--to", "neutral", "-o", tmp_path / "n").exit_code == 0
    result = _cli("check", "--reference", path, "--candidate", tmp_path / "n", "--layerwise",
                  "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    points = json.loads((tmp_path / "r.json").read_text())["points"]
    assert all(p["passed"] for p in points) and any(p["name"] == "layers.1.out" for p in points)
    # transformers reads the gamma/beta tensors themselves: one changed in the reference now fails the check
    _rewrite(path, lambda sd: {**sd, "encoder.layer.0.output.LayerNorm.gamma":
                               sd["encoder.layer.0.output.LayerNorm.gamma"] * 1.05})
    broken = _cli("check", "--reference", path, "--candidate", tmp_path / "n", "--layerwise",
                  "--report", tmp_path / "broken.json")
    assert broken.exit_code == 1, broken.output
    assert json.loads((tmp_path / "broken.json").read_text())["first_divergence"]["point"] == "layers.0.out"


def test_legacy_and_current_name_of_one_tensor_is_unexpected(minilm_style_bert):
    path, _ = minilm_style_bert
    _rewrite(path, lambda sd: {**sd, "embeddings.LayerNorm.weight": sd["embeddings.LayerNorm.gamma"].clone()})
    ckpt = open_checkpoint(path)
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.unexpected == ["embeddings.LayerNorm.gamma"]


def test_a_tied_head_saved_anyway_is_a_copy_or_refused(tmp_path):
    """Qwen2.5-style tied model whose re-save kept lm_head.weight: equal to the embeddings it is recognised; if it
    differs, transformers unties the two, so convert refuses (exit 2) and says how to fix the config."""
    path = make_tiny(ADAPTERS["qwen2"], tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))
    _rewrite(path, lambda sd: {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    assert _buffers(path)["lm_head.weight"] == {
        "name": "lm_head.weight", "kind": "tied_copy", "shape": list(load_file(path / "model.safetensors")
                                                                     ["lm_head.weight"].shape),
        "dtype": "F32", "agrees": True, "note": "the same values as model.embed_tokens.weight: tied, as the config says"}
    assert _cli("convert", path, "--to", "neutral", "-o", tmp_path / "n").exit_code == 0
    assert _cli("check", "--reference", path, "--candidate", tmp_path / "n", "--layerwise").exit_code == 0

    _rewrite(path, lambda sd: {**sd, "lm_head.weight": sd["lm_head.weight"] * 1.5})
    assert not _buffers(path)["lm_head.weight"]["agrees"]
    result = CliRunner().invoke(cli, ["convert", str(path), "--to", "neutral", "-o", str(tmp_path / "m")])
    assert result.exit_code == 2 and "set tie_word_embeddings to false" in result.stderr
    assert not (tmp_path / "m").exists()
