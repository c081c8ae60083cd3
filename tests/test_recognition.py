"""Recognition that checks itself (issue 44, item 3): the family is chosen by model_type, the architecture name only a
hint; an adapter whose tensor map does not fit a checkpoint that transformers loads gives way to the comparison of a
model no adapter knows (docs/generic.md), with a warning saying why. transformers 5.25 builds `exaone` as
LlamaForCausalLM and `param2moe` and `sarvam_moe` as Glm4MoeForCausalLM, and saves each under that class's name with
its original tensor names (EXAONE's transformer.h.*, the fused attention.query_key_value), which it renames as it
loads: the llama and glm4_moe adapters do not fit them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity.adapter import load_all, recognise
from parity.cli import cli
from tests.test_generic import SIZES, build_tiny, check, scaled_twin

# the class each is saved under (what transformers writes, and what the issue found on the hub), the adapter that
# name points to, and the one weight of layer 1 its twin scales
BORROWED = {
    "exaone": (["LlamaForCausalLM"], "llama", r"^transformer\.h\.1\.attn\.attention\.out_proj\.weight$"),
    "param2moe": (["Glm4MoeForCausalLM"], "glm4_moe", r"^model\.layers\.1\.attention\.dense\.weight$"),
    "sarvam_moe": (["Glm4MoeForCausalLM"], "glm4_moe", r"^model\.layers\.1\.attention\.dense\.weight$"),
}
LAYERS = SIZES["num_hidden_layers"]
# the keys EXAONE's published configs use, which only ExaoneConfig knows (its attribute_map)
EXAONE_KEYS = {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
               "hidden_act": "activation_function"}


def _shipped(model_type: str) -> None:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers here does not ship {model_type}")


@pytest.fixture(scope="module")
def borrowed(tmp_path_factory):
    root = tmp_path_factory.mktemp("borrowed")
    built: dict[str, tuple[Path, Path]] = {}

    def get(model_type: str) -> tuple[Path, Path]:
        """(the tiny checkpoint as transformers saves it, its twin with one weight of layer 1 scaled by 1.05)"""
        if model_type not in built:
            architectures, _, twin_of = BORROWED[model_type]
            ref = build_tiny(model_type, root / model_type)
            config = json.loads((ref / "config.json").read_text())
            if config.get("architectures") != architectures:  # as the published checkpoints carry it
                (ref / "config.json").write_text(json.dumps({**config, "architectures": architectures}, indent=2))
            scaled_twin(ref, root / f"{model_type}-twin", re.compile(twin_of))
            built[model_type] = ref, root / f"{model_type}-twin"
        return built[model_type]

    return get


def _report(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("model_type", sorted(BORROWED))
def test_a_borrowed_class_is_compared_as_a_model_no_adapter_knows(model_type, borrowed, tmp_path):
    _shipped(model_type)
    ref, twin = borrowed(model_type)
    architectures, adapter, _ = BORROWED[model_type]
    copy = shutil.copytree(ref, tmp_path / "copy")
    code, output = check("--reference", ref, "--candidate", copy, "--layerwise", "--report", tmp_path / "self.json")
    assert code == 0, output
    report = _report(tmp_path / "self.json")
    assert report["family"] == model_type and report["family_known"] is False
    names = [p["name"] for p in report["points"]]
    assert names[0] == "embed" and names[-1] == "logits" and "final_norm" in names
    assert [n for n in names if n.endswith(".out")] == [f"layers.{i}.out" for i in range(LAYERS)]
    assert all(p["compared"] and p["passed"] for p in report["points"])
    why = [w for w in report["warnings"] if w.startswith("adapter not used:")]
    assert len(why) == 1, report["warnings"]
    stored = set(load_file(ref / "model.safetensors"))
    assert f"the {adapter} adapter does not fit these tensors (missing (" in why[0] and "unexpected (" in why[0]
    assert any(name in why[0] for name in stored), why[0]  # names what the checkpoint holds instead
    assert f"transformers' {architectures[0]} loads them" in why[0]

    code, output = check("--reference", ref, "--candidate", twin, "--layerwise", "--report", tmp_path / "twin.json")
    assert code == 1, output
    report = _report(tmp_path / "twin.json")
    assert report["first_divergence"]["point"].startswith("layers.1."), report["first_divergence"]
    assert all(p["passed"] for p in report["points"] if p["name"] in ("embed", "layers.0.out"))


def test_the_published_exaone_config_is_built_as_transformers_builds_it(borrowed, tmp_path):
    """EXAONE 3.x on the hub: ExaoneForCausalLM (its own code, never run) and EXAONE's key names, which only
    ExaoneConfig knows (num_layers, layer_norm_epsilon, activation_function): transformers' LlamaForCausalLM, read
    with ExaoneConfig, as AutoModelForCausalLM builds it."""
    _shipped("exaone")
    ref, twin = borrowed("exaone")
    for src, dst in ((ref, tmp_path / "ref"), (twin, tmp_path / "twin")):
        shutil.copytree(src, dst)
        config = json.loads((src / "config.json").read_text())
        config = {EXAONE_KEYS.get(k, k): v for k, v in config.items()}
        config.update(architectures=["ExaoneForCausalLM"],
                      auto_map={"AutoConfig": "configuration_exaone.ExaoneConfig",
                                "AutoModelForCausalLM": "modeling_exaone.ExaoneForCausalLM"})
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    code, output = check("--reference", tmp_path / "ref", "--candidate", tmp_path / "ref", "--layerwise",
                         "--report", tmp_path / "r.json")
    assert code == 0, output
    names = [p["name"] for p in _report(tmp_path / "r.json")["points"]]
    assert [n for n in names if n.endswith(".out")] == [f"layers.{i}.out" for i in range(LAYERS)]
    code, output = check("--reference", tmp_path / "ref", "--candidate", tmp_path / "twin", "--layerwise")
    assert code == 1 and "FAIL at layers.1." in output, output


def test_the_family_is_chosen_by_model_type_first():
    adapters = load_all()
    for config, family in [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "mistral"}, "mistral"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "exaone"}, "llama"),  # the hint: no adapter has it
        ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "sarvam_moe"}, "glm4_moe"),
        ({"model_type": "qwen2"}, "qwen2"),
    ]:
        assert recognise(config, adapters)[0].family == family, config
    # the architecture tells apart the variants of one model_type
    adapter, variant = recognise({"architectures": ["BertModel"], "model_type": "bert"}, adapters)
    assert adapter.family == "bert" and variant.architectures == ["BertModel"]


def test_an_adapter_named_by_the_architecture_alone_must_fit_exactly(tmp_path, monkeypatch):
    """InternLM3 (LlamaForCausalLM) with its biases on, under InternLM3's own key names (qkv_bias and bias,
    InternLM3Config's aliases of attention_bias and mlp_bias): the llama adapter reads no bias and would leave every
    bias tensor out, as LlamaConfig would leave them out of the model."""
    _shipped("internlm3")
    monkeypatch.setattr("tests.test_generic.SIZES", {**SIZES, "attention_bias": True, "mlp_bias": True})
    ref = build_tiny("internlm3", tmp_path / "ref")
    config = json.loads((ref / "config.json").read_text())
    config["qkv_bias"], config["bias"] = config.pop("attention_bias"), config.pop("mlp_bias")
    (ref / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copytree(ref, tmp_path / "twin")  # layer 1's o_proj bias moved off transformers' zeros
    tensors = load_file(ref / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.bias"] += 0.1
    save_file(tensors, tmp_path / "twin" / "model.safetensors", metadata={"format": "pt"})
    code, output = check("--reference", ref, "--candidate", ref, "--layerwise", "--report", tmp_path / "r.json")
    assert code == 0, output
    report = _report(tmp_path / "r.json")
    assert report["family"] == "internlm3" and report["family_known"] is False
    assert any(w.startswith("adapter not used: the llama adapter does not fit these tensors (unexpected (")
               and "_proj.bias" in w for w in report["warnings"]), report["warnings"]
    code, output = check("--reference", ref, "--candidate", tmp_path / "twin", "--layerwise")
    assert code == 1 and "FAIL at layers.1." in output, output  # the biases are in the model


def _one_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("parity: error:")]
    assert len(lines) == 1, output
    return lines[0]


def _without(src: Path, dst: Path, name: str) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    del tensors[name]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_weights_transformers_cannot_load_either_are_refused_with_one_line(borrowed, tiny_dir, tmp_path):
    _shipped("exaone")
    ref, _ = borrowed("exaone")
    broken = _without(ref, tmp_path / "exaone", "transformer.h.1.mlp.c_fc_1.weight")
    code, output = check("--reference", ref, "--candidate", broken, "--layerwise")
    assert code == 2, output
    assert "do not load into transformers' LlamaForCausalLM (missing (1): model.layers.1.mlp.up_proj.weight)" in \
        _one_error(output)
    # a checkpoint of the adapter's own model_type is refused by its adapter, as before
    llama = _without(tiny_dir("llama"), tmp_path / "llama", "model.layers.1.mlp.up_proj.weight")
    code, output = check("--reference", llama, "--candidate", llama, "--layerwise")
    assert code == 2, output
    assert "tensors do not match its config (llama): missing (1): model.layers.1.mlp.up_proj.weight" in \
        _one_error(output)


def test_a_golden_of_a_borrowed_class(borrowed, tmp_path):
    _shipped("exaone")
    ref, twin = borrowed("exaone")
    done = CliRunner().invoke(cli, ["golden", "record", str(ref), "-o", str(tmp_path / "golden")])
    assert done.exit_code == 0, done.output
    code, output = check("--reference", tmp_path / "golden", "--candidate", twin, "--layerwise")
    assert code == 1 and "FAIL at layers.1." in output, output
