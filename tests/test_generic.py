"""Any transformers model, no adapter needed (issue 32, part 1; docs/generic.md): a model of transformers' own
classes that no adapter knows is checked layer by layer, its structure discovered from transformers on the meta
device. Against itself: exit 0; against a twin whose layer-1 attention output projection is scaled by 1.05: exit 1,
the first divergence inside layer 1. What needs the family's conventions is refused with one line, exit 2."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity.adapter import load_all
from parity.cli import cli
from parity.errors import ParityError

# The done-when list: none of them has an adapter
ARCHITECTURES = ["gpt_neox", "cohere", "granite", "gpt_oss", "starcoder2", "falcon", "stablelm", "phi"]
# small sizes, each set where the config class has the key (its own name or an attribute_map alias)
SIZES = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=256, head_dim=16, max_position_embeddings=256, num_local_experts=4, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=64, ffn_hidden_size=128)
MAX_PARAMETERS = 5_000_000
# layer 1's attention output projection, as each of these architectures names it
O_PROJ = re.compile(r"(^|\.)(layers|h)\.1\.(self_attn\.o_proj|self_attn\.dense|attention\.dense|self_attention\.dense)"
                    r"\.weight$")


def build_tiny(model_type: str, out: Path, seed: int = 0) -> Path:
    """A tiny checkpoint of ``model_type``, built by transformers from its config class, saved in safetensors."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    default = AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(default.attribute_map)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in SIZES.items() if k in known})
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    with torch.device("meta"):  # sized first: a sub-config these sizes do not reach could need gigabytes
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{size:,} parameters at these sizes (a sub-config they do not reach)")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.set_attn_implementation("eager")  # as parity runs the reference
    with torch.no_grad():  # transformers itself runs it at these sizes (a rotary_dim wider than a head would not)
        model(input_ids=torch.arange(3, 67)[None])  # as long as parity's default prompt
    model.save_pretrained(out, safe_serialization=True)
    return out


def scaled_twin(src: Path, dst: Path, pattern: re.Pattern = O_PROJ, factor: float = 1.05) -> str:
    """A copy of ``src`` with the one tensor ``pattern`` matches scaled by ``factor``; returns its name."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    names = [n for n in tensors if pattern.search(n)]
    assert len(names) == 1, names
    tensors[names[0]] = tensors[names[0]] * factor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return names[0]


def check(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["check", *map(str, args)])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    built: dict[str, tuple[Path, Path]] = {}

    def get(model_type: str) -> tuple[Path, Path]:
        """(the tiny checkpoint, its twin with layer 1's attention output projection scaled by 1.05)"""
        if model_type not in built:
            ref = build_tiny(model_type, root / model_type)
            scaled_twin(ref, root / f"{model_type}-twin")
            built[model_type] = ref, root / f"{model_type}-twin"
        return built[model_type]

    return get


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_self_passes_and_a_scaled_attention_projection_fails_in_layer_1(model_type, tiny, tmp_path):
    ref, twin = tiny(model_type)
    code, output = check("--reference", ref, "--candidate", ref, "--layerwise", "--report", tmp_path / "self.json")
    assert code == 0, output
    report = json.loads((tmp_path / "self.json").read_text())
    names = [p["name"] for p in report["points"]]
    assert names[0] == "embed" and names[-1] == "logits" and "final_norm" in names
    assert [f"layers.{i}.out" for i in range(3)] == [n for n in names if n.endswith(".out")]
    known = model_type in load_all()  # families given an adapter since: checked with it, the same verdicts
    assert report["family"] == model_type and report["family_known"] is known
    assert known or report["generic"]["unchecked"] and any("family unknown" in w for w in report["warnings"])

    code, output = check("--reference", ref, "--candidate", twin, "--layerwise", "--report", tmp_path / "twin.json")
    assert code == 1, output
    report = json.loads((tmp_path / "twin.json").read_text())
    first = report["first_divergence"]["point"]
    assert first.startswith("layers.1."), first
    assert all(p["passed"] for p in report["points"] if p["name"] in ("embed", "layers.0.out"))
    assert known or report["diagnosis"] == []


def test_the_discovered_structure(tiny):
    """The sublayer outputs come from the tp plan's rowwise projections; an MoE's experts are not an MLP output."""
    from parity.checkpoint import open_checkpoint
    from parity.reference.structure import discover

    ckpt = open_checkpoint(tiny("starcoder2")[0], discover=discover)
    where = {c.name: c.module for c in ckpt.resolved.capture}
    assert where["layers.1.attn_out"] == "model.layers.1.self_attn.o_proj"
    assert where["layers.1.mlp_out"] == "model.layers.1.mlp.c_proj"
    assert where["final_norm"] == "model.norm" and where["embed"] == "model.layers.0"
    assert ckpt.resolved.generic and ckpt.resolved.family == "starcoder2"
    moe = open_checkpoint(tiny("granitemoe")[0], discover=discover)
    assert not any(c.name.endswith("mlp_out") for c in moe.resolved.capture)


def test_isolate_layers_and_decode_work_unchanged(tiny):
    ref, twin = tiny("starcoder2")
    code, output = check("--reference", ref, "--candidate", twin, "--layerwise", "--isolate")
    assert code == 1 and "FAIL at layers.1." in output, output
    code, output = check("--reference", ref, "--candidate", twin, "--layers", "2:3")
    assert code == 0, output  # layer 2, fed the reference's input, computes the same
    code, output = check("--reference", ref, "--candidate", ref, "--decode", "3")
    assert code == 0, output


def test_goldens_and_dumps_of_a_generic_model(tiny, tmp_path):
    from parity.checker.sides import inputs_for
    from parity.checkpoint import open_checkpoint
    from parity.checkpoint.inputs import Prompts
    from parity.dumps import write_dump
    from parity.reference.capture import run_and_capture
    from parity.reference.models import Models
    from parity.reference.structure import discover

    ref, twin = tiny("falcon")
    golden = tmp_path / "golden"
    done = CliRunner().invoke(cli, ["golden", "record", str(ref), "-o", str(golden), "--points", "all"])
    assert done.exit_code == 0, done.output
    code, output = check("--reference", golden, "--candidate", twin, "--layerwise")
    assert code == 1 and "FAIL at layers.1." in output, output
    code, output = check("--reference", ref, "--candidate", golden, "--layerwise")
    assert code == 0, output

    ids = inputs_for(ref, Prompts())[0][0]
    ckpt = open_checkpoint(twin, discover=discover)
    model = Models().hf(ckpt, torch.float32)
    points = run_and_capture(model, ckpt.resolved.capture, input_ids=torch.tensor([ids]))
    dump = write_dump(tmp_path / "engine.safetensors", points, ids)
    code, output = check("--reference", ref, "--candidate", dump, "--layerwise")
    assert code == 1 and "FAIL at layers.1." in output, output


def test_an_onnx_export_of_a_model_no_adapter_knows(tiny, tmp_path):
    """A graph torch.onnx exported from transformers' model (no parity involved): its values found by module path."""
    from tests.onnx_helpers import export_foreign

    ref, twin = tiny("starcoder2")
    ours = export_foreign(str(ref), str(tmp_path / "a.onnx"))
    theirs = export_foreign(str(twin), str(tmp_path / "b.onnx"))
    code, output = check("--reference", ref, "--candidate", ours, "--layerwise", "--report", tmp_path / "r.json")
    assert code == 0, output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["family_known"] is False
    assert {p["name"] for p in report["points"] if p["compared"]} >= {"layers.1.attn_out", "layers.1.out", "logits"}
    code, output = check("--reference", ref, "--candidate", theirs, "--layerwise")
    assert code == 1 and "FAIL at layers.1.attn_out" in output, output


def test_openvino_converts_a_model_no_adapter_knows(tiny):
    pytest.importorskip("openvino")
    ref, twin = tiny("starcoder2")
    code, output = check("--reference", ref, "--candidate", f"openvino:{ref}", "--layerwise")
    assert code == 0 and "family unknown" in output, output
    code, output = check("--reference", ref, "--candidate", f"openvino:{twin}", "--layerwise")
    assert code == 1 and "FAIL at layers.1.attn_out" in output, output


# Hybrid families (issue 32, part 3): attention beside or between stateful layers (gated delta-net linear attention,
# Mamba-2, short convolutions). Each built with both kinds of layers; layer 1's mixer output projection scaled in
# the twin (a stateful layer in qwen3_next, qwen3_5_text and lfm2; attention in granitemoehybrid; falcon_h1 runs
# attention and Mamba side by side).
HYBRIDS = {
    "qwen3_next": ({"num_hidden_layers": 4}, r"layers\.1\.linear_attn\.out_proj\.weight$"),
    "qwen3_5_text": ({"num_hidden_layers": 4}, r"layers\.1\.linear_attn\.out_proj\.weight$"),
    "granitemoehybrid": ({"num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"]},
                         r"layers\.1\.self_attn\.o_proj\.weight$"),
    "falcon_h1": ({"num_hidden_layers": 4}, r"layers\.1\.self_attn\.o_proj\.weight$"),
    "lfm2": ({"num_hidden_layers": 4, "layer_types": ["full_attention", "conv", "full_attention", "conv"]},
             r"layers\.1\.conv\.out_proj\.weight$", 3.0),  # at 1.05, layer 1's output moves by 4e-5 only
}


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_hybrids_check_layer_by_layer_and_decode(model_type, tmp_path, monkeypatch):
    sizes, twin_of, *factor = HYBRIDS[model_type]
    monkeypatch.setattr(sys.modules[__name__], "SIZES", {**SIZES, **sizes})
    ref = build_tiny(model_type, tmp_path / "ref")
    scaled_twin(ref, tmp_path / "twin", re.compile(twin_of), *factor)
    code, output = check("--reference", ref, "--candidate", ref, "--layerwise", "--decode", "3",
                         "--report", tmp_path / "r.json")
    assert code == 0, output
    report = json.loads((tmp_path / "r.json").read_text())
    outs = [p["name"] for p in report["points"] if p["name"].endswith(".out")]
    assert [f"layers.{i}.out" for i in range(4)] == list(dict.fromkeys(outs))  # the prefill's, then each step's
    assert report["decode"]["steps"] == 3, report["decode"]
    code, output = check("--reference", ref, "--candidate", tmp_path / "twin", "--layerwise",
                         "--report", tmp_path / "t.json")
    assert code == 1, output
    first = json.loads((tmp_path / "t.json").read_text())["first_divergence"]["point"]
    assert first.startswith("layers.1."), first


def _error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("parity: error:")]
    assert len(lines) == 1, output
    return lines[0]


def test_what_needs_the_family_is_refused_with_one_line(tiny, tmp_path, tiny_dir):
    ref, _ = tiny("starcoder2")
    for args, said in [
        (["convert", ref, "--to", "neutral", "-o", tmp_path / "n"], "needs its family's conventions"),
        (["inspect", ref], "needs its family's conventions"),
        (["check", "--reference", ref, "--candidate", ref, "--inject", "norm-eps-wrong"], "--inject"),
        (["check", "--reference", ref, "--candidate", ref, "--points", "ops"], "no operation-level points"),
    ]:
        result = CliRunner().invoke(cli, list(map(str, args)))
        assert result.exit_code == 2, result.output
        assert said in _error(result.output)
    assert not (tmp_path / "n").exists()


def test_a_neutral_candidate_needs_the_family(tiny, tmp_path, tiny_dir):
    from parity.neutral.converter import convert

    ref, _ = tiny("starcoder2")
    neutral = convert(tiny_dir("llama"), tmp_path / "neutral") and tmp_path / "neutral"
    code, output = check("--reference", ref, "--candidate", neutral)
    assert code == 2 and "a neutral candidate" in _error(output) and "starcoder2 has no adapter" in _error(output)


def test_code_a_checkpoint_brings_is_never_run(tmp_path):
    """A class transformers does not have (trust_remote_code's) stays an unsupported architecture."""
    config = json.loads((build_tiny("phi", tmp_path / "m") / "config.json").read_text())
    config.update(architectures=["MyPhiForCausalLM"], model_type="my_phi",
                  auto_map={"AutoModelForCausalLM": "modeling_my_phi.MyPhiForCausalLM"})
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    code, output = check("--reference", tmp_path / "m", "--candidate", tmp_path / "m")
    assert code == 2 and "unsupported architecture MyPhiForCausalLM" in _error(output)


def test_weights_missing_from_a_generic_checkpoint_are_refused(tiny, tmp_path):
    """No tensor map to check them against: transformers' own loading info says what it did not find, which it
    would otherwise initialise at random."""
    ref, _ = tiny("starcoder2")
    shutil.copytree(ref, tmp_path / "m")
    tensors = load_file(ref / "model.safetensors")
    dropped = next(n for n in tensors if n.endswith("layers.1.mlp.c_fc.weight"))
    del tensors[dropped]
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    code, output = check("--reference", ref, "--candidate", tmp_path / "m", "--layerwise")
    assert code == 2 and "found no weights" in _error(output) and dropped in _error(output)


def _causal_lms() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@pytest.mark.parametrize("model_type", _causal_lms())
def test_every_causal_lm_transformers_lists(model_type, tmp_path):
    """Every causal LM transformers lists that a test can build tiny: itself exit 0, a twin with layer 1's weights
    scaled by 1.05 exit 1 in layer 1. Skipped, each with its reason: those an adapter covers (tests/test_families.py)
    and those transformers cannot build from the small sizes here."""
    from parity.adapter import load_all, recognise
    from parity.checkpoint import open_checkpoint
    from parity.reference.structure import discover

    try:
        ref = build_tiny(model_type, tmp_path / "ref")
    except Exception as exc:  # noqa: BLE001 - a config these small sizes do not fit, or a model needing more
        pytest.skip(f"transformers cannot build a tiny {model_type} here: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:120] if str(exc) else ''}")
    try:
        adapter, _ = recognise(json.loads((ref / "config.json").read_text()), load_all())
        pytest.skip(f"{model_type}: the {adapter.family} adapter covers it (tests/test_families.py)")
    except ParityError:
        pass
    try:
        ckpt = open_checkpoint(ref, discover=discover)
    except ParityError as exc:  # a structure parity cannot find (no decoder layers): refused with one line
        pytest.skip(f"parity refuses {model_type}: {exc}")
    layer1 = next(c.module for c in ckpt.resolved.capture if c.name == "layers.1.out") + "."
    _scale_all(ref, tmp_path / "twin", layer1)
    code, output = check("--reference", ref, "--candidate", ref, "--layerwise")
    assert code == 0, output
    code, output = check("--reference", ref, "--candidate", tmp_path / "twin", "--layerwise")
    assert code == 1 and "FAIL at layers.1." in output, output


def _scale_all(src: Path, dst: Path, prefix: str) -> None:
    """Every matrix of the layer at module path ``prefix``, saved under that path or under the one transformers
    writes for it (NemotronH's ``model.layers.1.`` is saved as ``backbone.layers.1.``)."""
    shutil.copytree(src, dst)
    tail = prefix.split(".", 1)[1] if prefix.count(".") > 2 else prefix

    def in_layer(name: str) -> bool:
        return name.startswith(prefix) or name.split(".", 1)[-1].startswith(tail)

    tensors = load_file(src / "model.safetensors")
    scaled = [n for n, t in tensors.items() if in_layer(n) and t.is_floating_point() and t.dim() >= 2]
    assert scaled, f"no matrix of {prefix} among {sorted(tensors)[:8]}..."
    tensors.update({n: tensors[n] * 1.05 for n in scaled})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
