"""mlx candidates run by mlx-lm itself (`--candidate mlx:PATH`): tiny checkpoints converted by mlx-lm's own
converter pass `check --layerwise` against transformers point by point, decode through mlx-lm's KV cache, a
quantized conversion is judged on its own weights (--same-weights), broken twins fail where their mistake first
acts and are named, and the places where mlx-lm 0.32 computes otherwise than transformers are caught and named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity.cli import cli
from tests.conftest import ADAPTERS

pytest.importorskip("mlx_lm")

# every family of parity's that mlx-lm has a model for (bert: none), but gpt_oss (mlx-lm has one; not yet checked
# against its tiny checkpoint: attention sinks, clamped SwiGLU and interleaved experts untested there) and llama4
# (mlx-lm's llama4 reads only the multimodal layout; its llama4_text has no MoE, chunks, temperature or RoPE scaling)
MLX_FAMILIES = sorted(set(ADAPTERS) - {"bert", "gpt_oss", "llama4"})
# The tiny checkpoints turn on every switch of a family; mlx-lm 0.32 implements the released models, so these are
# turned off as the released models have them: attention biases (gemma*, qwen3*: mlx-lm's have none, and its
# strict loading refuses them), sliding windows on qwen2/qwen3/mistral/mixtral (mlx-lm attends globally: see
# FINDINGS), Gemma 2's window beyond the prompt (likewise), Gemma 3's final softcap (released: none), Qwen3-MoE's
# RoPE scaling (its mlx-lm model has plain RoPE), Qwen2-MoE's RoPE scaling, top-k renormalisation and dense layers
# (its mlx-lm model has plain RoPE, never renormalises and makes every layer MoE), GPT-2's n_inner and per-layer
# attention scale (released: none).
RELEASED = {
    "gemma": {"attention_bias": False}, "gemma2": {"attention_bias": False, "sliding_window": 4096},
    "gemma3": {"attention_bias": False, "final_logit_softcapping": None}, "gemma4": {"attention_bias": False},
    "qwen2": {"use_sliding_window": False}, "qwen3": {"attention_bias": False, "use_sliding_window": False},
    "qwen3_moe": {"attention_bias": False, "use_sliding_window": False, "rope_scaling": None,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "qwen2_moe": {"use_sliding_window": False, "rope_scaling": None, "norm_topk_prob": False, "mlp_only_layers": [],
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "mistral": {"sliding_window": None}, "mixtral": {"sliding_window": None},
    "gpt2": {"n_inner": None, "scale_attn_by_inverse_layer_idx": False},
    "gpt_neox": {"intermediate_size": 256},  # mlx-lm's MLP is 4 x hidden, as every Pythia's
    "phi": {"qk_layernorm": False},  # mlx-lm's Phi has no q/k LayerNorms (released Phis: none)
    "phi3": {"sliding_window": None},  # mlx-lm's Phi-3 attends globally
}
# model types whose mlx-lm ModelArgs read transformers 5's nested rope_parameters (the others read the top-level
# rope_theta / rope_scaling that released checkpoints' configs hold, and default to their own theta without them)
READS_ROPE_PARAMETERS = {"qwen3", "gemma4_text"}


def hub_config(config: dict) -> dict:
    """A config saved by transformers 5 written as released checkpoints on the hub state it (what mlx-lm reads):
    RoPE at the top level (Gemma 3's local base as rope_local_base_freq), Gemma 4's global head size and kv heads,
    Qwen3-MoE's num_experts, GPT-2's n_ctx, GLM-4.5's null rope_scaling."""
    rope = config.get("rope_parameters")
    if rope and config["model_type"] not in READS_ROPE_PARAMETERS:
        config.pop("rope_parameters")
        if "full_attention" in rope:
            config["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
            rope = rope["full_attention"]
        rope = dict(rope)
        config["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:  # Phi's, Pythia's and GLM-4.5's configs hold it at the top level
            config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        if config["model_type"] == "gpt_neox":  # Pythia's config.json spells them so (mlx-lm requires them)
            config["rotary_emb_base"], config["rotary_pct"] = config["rope_theta"], config["partial_rotary_factor"]
        if rope.get("rope_type", "default") != "default":
            config["rope_scaling"] = rope
            if rope["rope_type"] == "longrope":  # Phi-3's hub configs spell it `type` (mlx-lm requires that)
                rope["type"] = rope["rope_type"]
        elif config["model_type"] == "glm4_moe":  # GLM-4.5's configs say rope_scaling null (mlx-lm requires the key)
            config["rope_scaling"] = None
    if config.get("per_layer_config"):
        wide = next(iter(config["per_layer_config"].values()))
        config["global_head_dim"], config["num_global_key_value_heads"] = wide["head_dim"], wide["num_key_value_heads"]
    if "num_local_experts" in config and config["model_type"] == "qwen3_moe":
        config["num_experts"] = config["num_local_experts"]
    if "n_positions" in config:
        config["n_ctx"] = config["n_positions"]
    return config


def write_tiny(family: str, out: Path, overrides: dict | None = None, hub: bool = True) -> Path:
    """The family's tiny checkpoint as released models are configured (RELEASED, then ``overrides``), with a
    hub-style config (``hub``) and GPT-2's tensors unprefixed, as the hub's gpt2 stores them."""
    from safetensors.torch import load_file, save_file

    from parity.reference.tiny import _tokenizer, build_model

    build_model(ADAPTERS[family], overrides={**RELEASED.get(family, {}), **(overrides or {})}).save_pretrained(out)
    _tokenizer().save_pretrained(out)
    if hub:
        config = hub_config(json.loads((out / "config.json").read_text()))
        (out / "config.json").write_text(json.dumps(config, indent=2))
        tensors = load_file(out / "model.safetensors")
        if any(k.startswith("transformer.") for k in tensors):
            save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, out / "model.safetensors",
                      metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", autouse=True)
def engine_cache(tmp_path_factory):
    """mlx-lm's conversions go to a cache of this module's own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PARITY_CACHE", str(tmp_path_factory.mktemp("parity-cache")))
        yield


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-released")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_tiny(family, root / family)
        return made[family]

    return get


@pytest.fixture(scope="module")
def quantized(released, tmp_path_factory):
    """The tiny Qwen2 converted by mlx_lm.convert to 4 bits (group 64), in float32 otherwise."""
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("mlx-q4") / "qwen2-q4"
    convert(str(released("qwen2")), str(out), quantize=True, q_bits=4, q_group_size=64, dtype="float32")
    return out


def _check(reference, candidate, report: Path, *extra):
    result = CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", f"mlx:{candidate}",
                                      "--report", str(report), *map(str, extra)], catch_exceptions=False)
    return result, (json.loads(report.read_text()) if report.is_file() else None)


def test_the_families_mlx_runs():
    assert MLX_FAMILIES == ["cohere", "cohere2", "deepseek_v3", "gemma", "gemma2", "gemma3", "gemma4", "glm4_moe",
                            "gpt2", "gpt_neox", "granite", "llama", "mistral", "mixtral", "olmo2", "olmo3", "olmoe",
                            "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3", "stablelm"]


# Gemma (1): mlx-lm's MLP uses the exact GELU where transformers uses the tanh one (FINDINGS): 1.9e-4 on the tiny
# model, judged at 1e-3 here, asserted at the default tolerance below
# GPT-NeoX likewise: mlx-lm's MLP computes nn.gelu_approx (tanh) where Pythia's config says the exact "gelu"
# (parity names it gelu-variant-swapped): 1.4e-4 at final_norm, judged at 1e-3
TOLERANCE = {"gemma": ("--tolerance", "*:rel_l2=1e-3"), "gpt_neox": ("--tolerance", "*:rel_l2=1e-3")}


@pytest.mark.parametrize("family", MLX_FAMILIES)
def test_converted_by_mlx_lm_passes_layerwise(family, tmp_path, released):
    result, report = _check(released(family), released(family), tmp_path / "r.json", "--layerwise",
                            *TOLERANCE.get(family, ()))
    assert result.exit_code == 0, result.output
    assert report["verdict"] == "pass" and report["candidate"]["kind"] == "mlx"
    points = report["points"]
    assert all(p["compared"] for p in points), [p["name"] for p in points if not p["compared"]]
    assert {"embed", "layers.0.attn_in", "layers.0.mlp_out", "layers.1.out", "final_norm", "logits"} <= \
        {p["name"] for p in points}
    worst = max(p["rel_l2"] for p in points)
    assert worst < (5e-4 if family in TOLERANCE else 3e-5), worst


def test_converted_at_the_checks_dtype(tmp_path, released):
    """--dtype bfloat16: mlx-lm converts to bfloat16 and computes in it, judged at bfloat16's tolerances."""
    result, report = _check(released("llama"), released("llama"), tmp_path / "r.json", "--layerwise", "--dtype",
                            "bfloat16")
    assert result.exit_code == 0, result.output
    assert report["dtype"] == "bfloat16" and 1e-4 < max(p["rel_l2"] for p in report["points"]) < 5e-2


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4"])
def test_decodes_through_mlx_lms_own_cache(family, tmp_path, released):
    """gemma3: the decode steps cross the sliding window (mlx-lm's rotating cache); gemma4: KV-shared layers."""
    result, report = _check(released(family), released(family), tmp_path / "r.json", "--decode", 10, "--layerwise")
    assert result.exit_code == 0, result.output
    steps = {p["step"] for p in report["points"] if p.get("step")}
    assert steps == set(range(1, 11))
    assert all(p["compared"] and p["rel_l2"] < 3e-5 for p in report["points"] if p.get("step"))


def test_a_4_bit_conversion_passes_on_its_own_weights(tmp_path, released, quantized):
    result, report = _check(released("qwen2"), quantized, tmp_path / "r.json", "--layerwise", "--same-weights")
    assert result.exit_code == 0, result.output
    held = report["reference"]["same_weights"]
    assert held["types"] == {"affine-4bit": 15, "F32": 11} and held["not_a_quantization"] == {}
    assert max(p["rel_l2"] for p in report["points"]) < 1e-5
    # judged on the checkpoint's own weights, the same file fails by its quantization's error
    result, report = _check(released("qwen2"), quantized, tmp_path / "plain.json", "--layerwise", "--float-reference")
    assert result.exit_code == 1 and report["first_divergence"]["point"] == "embed"
    assert report["candidate"]["tensor_types"] == {"affine-4bit": 15, "F32": 11}


def test_quantized_through_an_engine_option(tmp_path, released):
    result, report = _check(released("qwen2"), released("qwen2"), tmp_path / "r.json", "--layerwise",
                            "--engine-option", "bits=8", "--engine-option", "group_size=32", "--float-reference")
    assert result.exit_code == 1  # float32 tolerances: 8 bits are visible, and said to be the quantization's
    assert result.output.startswith("candidate quantized: affine 8-bit, groups of 32") and \
        "the quantization's error counts as the port's" in result.output.splitlines()[0]
    assert 1e-6 < report["logits"]["kl_max"] < 1e-3 and report["logits"]["top1_agreement"] > 0.9


def _twin(source: Path, out: Path, tensors=None, config=None) -> Path:
    """A copy of ``source`` (a checkpoint, or a directory mlx-lm wrote) with one mistake in its tensors or config."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    if tensors is not None:
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            metadata = f.metadata()
        held = load_file(out / "model.safetensors")
        save_file({k: tensors(k, v) for k, v in held.items()}, out / "model.safetensors", metadata=metadata)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config(json.loads((out / "config.json").read_text()))))
    return out


def _shift_norms(name: str, t: torch.Tensor) -> torch.Tensor:
    return t + 1.0 if name.endswith("norm.weight") else t


def _drop_qkv_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t) if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) else t


# broken twins of Hugging Face checkpoints, converted by mlx-lm: (family, tensors, bug, first divergence)
TWINS = [("llama", _shift_norms, "norm-offset-added", "layers.0.attn_in"),
         ("qwen2", _drop_qkv_bias, "qkv-bias-dropped", "layers.0.attn_out")]


@pytest.mark.parametrize("family, edit, bug, first", TWINS, ids=[t[2] for t in TWINS])
def test_a_broken_twin_converted_by_mlx_lm_fails_where_it_acts(family, edit, bug, first, tmp_path, released):
    twin = _twin(released(family), tmp_path / "twin", tensors=edit)
    result, report = _check(released(family), twin, tmp_path / "r.json", "--layerwise")
    assert result.exit_code == 1
    assert report["first_divergence"]["point"] == first
    assert report["diagnosis"][0]["bug"] == bug


def test_a_quantized_twin_fails_on_its_own_weights_and_is_named(tmp_path, released, quantized):
    """The 4-bit directory mlx-lm wrote, with its config's RoPE base changed: --same-weights takes the quantization
    out, and what is left is the mistake."""
    twin = _twin(quantized, tmp_path / "twin", config=lambda c: {**c, "rope_theta": 10000.0})
    result, report = _check(released("qwen2"), twin, tmp_path / "r.json", "--layerwise", "--same-weights")
    assert result.exit_code == 1
    assert report["first_divergence"]["point"] == "layers.0.attn_out"
    assert report["diagnosis"][0]["bug"] == "rope-theta-wrong"


# Where mlx-lm 0.32 computes otherwise than transformers 5, on configs that exercise it: (family, config overrides,
# whether the config is hub-style, first divergence, the diagnosis)
FINDINGS = [
    ("gemma", {}, True, "layers.0.mlp_out", "gelu-variant-swapped"),            # exact GELU (mlx-lm gemma.py)
    ("gemma2", {"sliding_window": 8}, True, "layers.0.attn_out", "sliding-window-ignored"),
    ("mistral", {"sliding_window": 16}, True, "layers.0.attn_out", "sliding-window-ignored"),
    ("qwen2", {"use_sliding_window": True}, True, "layers.1.attn_out", "sliding-window-ignored"),
    ("gemma3", {"final_logit_softcapping": 0.1}, True, "logits", "final-softcap-dropped"),
    # sqrt(hidden) rounded to bfloat16 in a float32 run (mlx-lm gemma3_text.py); at hidden 96 it is 9.8125, not 9.798
    ("gemma3", {"final_logit_softcapping": None, "hidden_size": 96}, True, "embed", "embed-scale-rounded"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, True, "layers.1.attn_out", "attn-scale-wrong"),
    # transformers 5 nests the RoPE base in rope_parameters; mlx-lm's olmo2 reads rope_theta only (default 10000)
    ("olmo2", {}, False, "layers.0.attn_out", "rope-theta-wrong"),
]


@pytest.mark.parametrize("family, overrides, hub, first, bug", FINDINGS, ids=[f"{f[0]}-{f[4]}" for f in FINDINGS])
def test_where_mlx_lm_differs_from_transformers_is_named(family, overrides, hub, first, bug, tmp_path):
    checkpoint = write_tiny(family, tmp_path / family, overrides, hub=hub)
    result, report = _check(checkpoint, checkpoint, tmp_path / "r.json", "--layerwise")
    assert result.exit_code == 1, result.output
    assert report["first_divergence"]["point"] == first
    assert report["diagnosis"][0]["bug"] == bug


def test_what_mlx_lm_cannot_load_is_refused(tmp_path, tiny_dir):
    for candidate, said in ((tiny_dir("bert"), "cannot load a 'bert' model"),
                            # the tiny Qwen3 has attention biases: mlx-lm's qwen3 has no place for them
                            (tiny_dir("qwen3"), "parameters not in model")):
        result, report = _check(candidate, candidate, tmp_path / "r.json", "--layerwise")
        assert result.exit_code == 2 and said in result.output and report is None, result.output


def test_engine_options_are_checked(tmp_path, released, quantized):
    qwen2 = released("qwen2")
    for candidate, options, said in ((qwen2, ("bits=7",), "mlx-lm takes 2, 3, 4, 5, 6, 8"),
                                     (qwen2, ("group_size=32",), "give bits too"),
                                     (quantized, ("bits=4",), "already an mlx-lm conversion")):
        extra = [a for o in options for a in ("--engine-option", o)]
        result, _ = _check(qwen2, candidate, tmp_path / "r.json", *extra)
        assert result.exit_code == 2 and said in result.output, result.output


def test_a_quantizing_option_is_read_back_by_same_weights_and_calibrate(tmp_path, released):
    """mlx:HF_DIR --engine-option bits=4: --same-weights and --calibrate read back the conversion the check runs
    (the engines' cache), not the checkpoint."""
    qwen2 = released("qwen2")
    result, report = _check(qwen2, qwen2, tmp_path / "s.json", "--layerwise", "--same-weights",
                            "--engine-option", "bits=4")
    assert result.exit_code == 0, result.output
    held = report["reference"]["same_weights"]
    assert held["types"] == {"affine-4bit": 15, "F32": 11} and held["not_a_quantization"] == {}
    assert max(p["rel_l2"] for p in report["points"]) < 1e-5
    assert report["candidate"]["tensor_types"] == {"affine-4bit": 15, "F32": 11}
    result, report = _check(qwen2, qwen2, tmp_path / "c.json", "--layerwise", "--calibrate",
                            "--engine-option", "bits=4", "--float-reference")
    assert result.exit_code == 0, result.output
    assert report["candidate"]["quantization"]["types"] == {"affine-4bit": 15, "F32": 11}


def test_a_conversion_is_made_once(tmp_path, released):
    from parity.engines.common import cache_root

    _check(released("llama"), released("llama"), tmp_path / "a.json")
    made = sorted((cache_root() / "mlx").iterdir())
    stamps = [p.stat().st_mtime_ns for p in made]
    _check(released("llama"), released("llama"), tmp_path / "b.json")
    assert sorted((cache_root() / "mlx").iterdir()) == made
    assert [p.stat().st_mtime_ns for p in made] == stamps
