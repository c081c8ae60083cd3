"""CTranslate2 candidates (``--candidate ctranslate2:PATH``): tiny checkpoints converted by CTranslate2's own
converter and run by its Generator pass against transformers on the logits (the one point its API gives back;
the layer points are reported as not compared), prefill and decode through its own cache; families its
converter cannot convert are refused in one line; twins carrying a catalogued mistake, converted by the same
converter, fail and the diagnosis (from the logits alone) names the mistake, as it names the conventions
CTranslate2 4.8's converter itself drops; an int8 model.bin's weights are read back (--same-weights)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests.conftest import ADAPTERS

pytest.importorskip("ctranslate2")

# The tiny checkpoints turn on every switch of a family; these are the forms CTranslate2 4.8's converter computes
# as transformers does (the released models' settings where they differ). What it gets wrong is tested below.
CT2 = {"llama": {"rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}},  # its llama3 scaling differs
       "mistral": {},  # window 16: a prompt past it is read token by token (forward_batch refuses it)
       # yarn is not converted; the converter's Qwen2 vocabulary counts the tokenizer's added <|endoftext|>
       "qwen2": {"use_sliding_window": False, "rope_scaling": {"rope_type": "default", "rope_theta": 1e6},
                 "vocab_size": 260},
       "qwen3": {"use_sliding_window": False, "rope_scaling": {"rope_type": "default", "rope_theta": 1e6},
                 "attention_bias": False},
       "gemma": {"attention_bias": False},  # its converter drops the attention biases (Gemma ships none)
       # no softcaps, query_pre_attn_scalar = head_dim and a window past the prompt: what the converter reads
       "gemma2": {"attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                  "query_pre_attn_scalar": 16, "sliding_window": 4096},
       "gemma3": {"attention_bias": False, "query_pre_attn_scalar": 16, "rope_scaling": None,
                  "final_logit_softcapping": None},
       "gpt2": {"scale_attn_by_inverse_layer_idx": False}}


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _check(reference, candidate, report, *extra):
    result = _cli("check", "--reference", reference, "--candidate", candidate, "--report", report, *extra)
    return result, json.loads(report.read_text()) if report.exists() else None


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """The conversions go to a cache of the module's own (PARITY_CACHE)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PARITY_CACHE", str(tmp_path_factory.mktemp("ct2-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(family, overrides=None, name=None): a tiny checkpoint (with its tokenizer: the converter reads it)."""
    from parity.reference.tiny import _tokenizer, build_model

    root = tmp_path_factory.mktemp("ct2-checkpoints")
    built = {}

    def get(family: str, overrides: dict | None = None, name: str | None = None):
        name = name or family
        if name not in built:
            path = root / name
            build_model(ADAPTERS[family], overrides=CT2[family] if overrides is None else overrides) \
                .save_pretrained(path)
            _tokenizer().save_pretrained(path)
            built[name] = path
        return built[name]

    return get


def test_the_kind_is_named_and_listed():
    result = _cli("engines")
    assert result.exit_code == 0 and "ctranslate2" in result.output


@pytest.mark.parametrize("family", sorted(CT2))
def test_converted_by_ctranslate2_the_logits_pass(family, made, tmp_path):
    reference = made(family)
    result, report = _check(reference, f"ct2:{reference}", tmp_path / "r.json", "--layerwise")
    assert result.exit_code == 0, result.output
    assert report["candidate"]["kind"] == "ctranslate2"
    points = {p["name"]: p for p in report["points"]}
    assert points["logits"]["compared"] and points["logits"]["rel_l2"] < 1e-5
    assert not any(p["compared"] for name, p in points.items() if name != "logits")  # nothing else leaves it
    assert any("not compared" in w for w in report["warnings"])
    assert report["logits"]["top1_agreement"] == 1.0 and report["logits"]["kl_max"] < 1e-9


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_decode_steps_through_its_own_cache(family, made, tmp_path):
    """The prompt forwarded once (static_prompt), then each token one step of constrained decoding; mistral and
    gemma3 decode across their sliding windows (16, 8)."""
    reference = made(family)
    result, report = _check(reference, f"ct2:{reference}", tmp_path / "r.json", "--decode", 6)
    assert result.exit_code == 0, result.output
    steps = report["decode"]["per_step"]
    assert [s["step"] for s in steps] == list(range(1, 7)) and all(s["worst_rel_l2"] < 1e-5 for s in steps)
    if family != "llama":
        assert any(c["crossed"] == "decode" for c in report["decode"]["crossed"] if "window" in c["what"])


def test_a_prompt_past_the_window_is_read_token_by_token(made, tmp_path):
    reference = made("mistral")
    result, report = _check(reference, f"ct2:{reference}", tmp_path / "r.json", "--length", 40)
    assert result.exit_code == 0, result.output
    assert any("sliding window (16)" in w for w in report["warnings"])


@pytest.mark.parametrize("family,words", [("olmo2", "has no loader for Olmo2Config"),
                                          ("deepseek_v3", "has no loader for DeepseekV3Config"),
                                          ("qwen3_moe", "has no loader for Qwen3MoeConfig"),
                                          ("qwen2", "RoPE scaling type 'yarn' is not yet implemented"),
                                          ("bert", "converter cannot convert it")])
def test_what_its_converter_cannot_convert_is_refused_in_one_line(family, words, tiny_dir, tmp_path):
    result, report = _check(tiny_dir(family), f"ctranslate2:{tiny_dir(family)}", tmp_path / "r.json")
    assert result.exit_code == 2 and words in result.stderr and report is None
    assert len(result.stderr.strip().splitlines()) == 1


def test_layers_and_unknown_options_are_refused(made, tmp_path):
    reference = made("llama")
    result, _ = _check(reference, f"ct2:{reference}", tmp_path / "r.json", "--layers", "0:1")
    assert result.exit_code == 2 and "drop --layers" in result.stderr
    result, _ = _check(reference, f"ct2:{reference}", tmp_path / "r.json", "--engine-option", "quantization=int3")
    assert result.exit_code == 2 and "CTranslate2 converts to" in result.stderr


def test_a_directory_its_converter_wrote_without_special_tokens_is_refused_with_the_fix(made, tmp_path):
    """The converter writes null bos/eos for a tokenizer that names none, which CTranslate2 cannot load (parity's
    own conversions name them from the config's ids)."""
    from ctranslate2.converters import TransformersConverter

    reference = made("llama")
    TransformersConverter(str(reference)).convert(str(tmp_path / "ct2"), quantization="float32")
    result, _ = _check(reference, f"ct2:{tmp_path / 'ct2'}", tmp_path / "r.json")
    assert result.exit_code == 2 and "names no bos/eos token" in result.stderr


def _twin(source, out, bug: str):
    """A copy of the checkpoint carrying ``bug`` (then converted by CTranslate2's converter, like any PATH)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    if bug == "rope-theta-wrong":  # the base the catalog's hypothesis uses
        config["rope_parameters"]["rope_theta"] = 10000.0
    elif bug == "norm-eps-wrong":
        config["rms_norm_eps"] = 1e-5 if config["rms_norm_eps"] == 1e-6 else 1e-6
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        if bug == "norm-offset-added" and name.endswith("norm.weight"):
            tensors[name] = t + 1.0
        if bug == "qkv-bias-dropped" and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            tensors[name] = torch.zeros_like(t)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("family,bug", [("qwen3", "rope-theta-wrong"), ("qwen3", "norm-eps-wrong"),
                                        ("llama", "norm-offset-added"), ("qwen2", "qkv-bias-dropped")])
def test_a_broken_twin_fails_and_its_mistake_is_named_from_the_logits(family, bug, made, tmp_path):
    reference = made(family)
    twin = _twin(reference, tmp_path / "twin", bug)
    result, report = _check(reference, f"ct2:{twin}", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert report["first_divergence"]["point"] == "logits"  # the only point compared
    assert report["diagnosis"][0]["bug"] == bug and report["diagnosis"][0]["confidence"] > 0.9


# What CTranslate2 4.8's converter itself drops, each in a tiny checkpoint that turns on one convention, named
# by the diagnosis: Gemma 2's attention softcap (50 in the released models), query_pre_attn_scalar (Gemma 2
# 27B: 144 for a head_dim of 128) and sliding window; GPT-2's scale_attn_by_inverse_layer_idx
CONVERTER_DROPS = [
    ("gemma2", {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}, "attn-softcap-dropped"),
    ("gemma2", {"query_pre_attn_scalar": 24}, "attn-scale-wrong"),
    ("gemma2", {"sliding_window": 8}, "sliding-window-ignored"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "attn-scale-wrong"),
]


@pytest.mark.parametrize("family,switch,bug", CONVERTER_DROPS)
def test_what_its_converter_drops_is_named(family, switch, bug, made, tmp_path):
    reference = made(family, {**CT2[family], **switch}, f"{family}-{bug}")
    result, report = _check(reference, f"ct2:{reference}", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    assert report["diagnosis"][0]["bug"] == bug


def test_int8_weights_are_read_back(made, tmp_path):
    """An int8 model.bin (CTranslate2's converter, quantization=int8): computed in float32 (compute_type), it is
    the same-weights reference to float32 rounding, which proves the read-back; computed in int8, what is left
    is CTranslate2's int8 activations, and --calibrate measures the weights' share."""
    from parity.engines.ctranslate2.kind import convert

    reference = made("llama")
    int8 = convert(reference, "int8")
    result, report = _check(reference, f"ct2:{int8}", tmp_path / "a.json", "--float-reference")
    assert result.exit_code == 1 and report["candidate"]["tensor_types"] == {"int8": 12}
    plain = report["points"][-1]["rel_l2"]
    assert 1e-2 < plain < 0.5  # under 0.1 with AVX-512 VNNI; 0.24 on AVX2 alone
    result, report = _check(reference, f"ct2:{int8}", tmp_path / "b.json", "--same-weights", "--engine-option",
                            "compute_type=float32")
    assert result.exit_code == 0, result.output
    held = report["reference"]["same_weights"]
    assert held["types"] == {"int8": 16} and held["not_a_quantization"] == {}
    assert report["points"][-1]["rel_l2"] < 1e-5
    result, report = _check(reference, f"ct2:{int8}", tmp_path / "c.json", "--calibrate")
    assert result.exit_code == 0, result.output
    assert report["candidate"]["quantization"]["types"] == {"int8": 16}
    # with no flag the same: its int8 activations are not emulated, so the default is the float reference,
    # calibrated to what the weights' quantization costs (the first line says why)
    result, report = _check(reference, f"ct2:{int8}", tmp_path / "n.json")
    assert result.exit_code == 0, result.output
    assert not report["judging"]["same_weights"] and report["calibrated"]
    assert "CTranslate2's int8 activations" in result.output.splitlines()[0]
    # the checkpoint itself with quantization=int8: the same conversion (the cache's), read back alike
    for extra, name in ((("--same-weights", "--engine-option", "compute_type=float32"), "d.json"),
                        (("--calibrate",), "e.json")):
        result, report = _check(reference, f"ct2:{reference}", tmp_path / name, "--engine-option",
                                "quantization=int8", *extra)
        assert result.exit_code == 0, result.output
        assert report["candidate"]["tensor_types"] == {"int8": 12} and report["candidate"]["converted"] == str(int8)
    assert report["candidate"]["quantization"]["types"] == {"int8": 16}
