"""GGUF candidates run by llama.cpp itself: tiny checkpoints written with `parity convert --to gguf` (llama.cpp's
names and q/k layout, as convert_hf_to_gguf.py writes them) pass `check --layerwise` against transformers, and a
twin with a porting mistake fails where the mistake first acts."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests.conftest import ADAPTERS

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

GGUF_FAMILIES = sorted(f for f, a in ADAPTERS.items() if a.spec.gguf is not None)
# the capture points llama.cpp's graph does not hold, per architecture: OLMo 2 has no pre-norms, whose outputs
# these would be. Attention's output, named by llama's model code only, is read elsewhere as the tensor computed
# from blk.N.attn_output.weight (parity.engines.gguf.kind.CONSUMERS); the input embeddings are "embd", Gemma's
# scaled ones "inp_scaled"; gemma2's MLP output is named without a layer index ("ffn_post_norm") and read as the
# layer of the tensor before it
NOT_NAMED = {"llama": set(), "qwen2": set(), "qwen3": set(), "gemma": set(), "gemma2": set(), "gemma3": set(),
             "olmo2": {"attn_in", "mlp_in"}, "granite": set(), "smollm3": set(), "qwen2_moe": set(),
             "qwen3_moe": set(), "olmoe": set(), "mixtral": set(),
             # Command-R's MLP reads attention's norm (attn_norm): no norm of its own to name
             "cohere": {"mlp_in"}, "cohere2": {"mlp_in"},
             "phi3": {"mid"},  # phi3's graph leaves the residual after attention unnamed
             # gptneox names attn_norm, ffn_norm, ffn_out (the MLP's, then again its sum with the layer's input) and
             # l_out; its parallel block has no `mid` on either side
             "gpt_neox": set(),
             # phi2's MLP reads attention's norm (attn_norm), as Command-R's; stablelm's sequential block names all
             "phi": {"mlp_in"}, "stablelm": set()}
# llama.cpp's CPU GELU reads an f16 table (ggml-cpu vec.h, GGML_GELU_FP16): a GELU MLP's output differs by
# rel_l2 ~3e-4 from the exact function (measured on the tiny Gemma: 3.0e-4 at layers.0.mlp_out, 5.0e-4 at most),
# an engine approximation, not a port mistake; those families are judged at 1e-3.
# GPT-NeoX's exact (erf) GELU meets llama.cpp's tanh form through the same table (src/models/gptneox.cpp: LLM_FFN_GELU,
# ggml_gelu): measured on the tiny GPT-NeoX 3.73e-4 at layers.0.mlp.act (the tanh form alone 1.9e-4, the table on it
# 3.2e-4, both emulated in torch 3.7e-4), 4.2e-4 at most (layers.1.mlp_out), 2.5e-4 at the logits; Phi's tanh GELU
# (gelu_new) meets the table only (src/models/phi2.cpp): 3.1e-4 at layers.0.mlp.act, 3.8e-4 at most (layers.1.mlp.act),
# 2.1e-4 at the logits. Both judged at 1e-3 too.
TOLERANCE = {f: ("--tolerance", "*:rel_l2=1e-3") for f in ("gemma", "gemma2", "gemma3", "gpt_neox", "phi")}


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _check(reference, candidate, report, *extra):
    result = _cli("check", "--reference", reference, "--candidate", candidate, "--layerwise", "--report", report,
                  *extra)
    return result, json.loads(report.read_text())


def test_the_families_llama_cpp_runs():
    assert GGUF_FAMILIES == ["cohere", "cohere2", "gemma", "gemma2", "gemma3", "gpt_neox", "granite", "llama", "mixtral",
                             "olmo2", "olmoe", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3",
                             "stablelm"]


# The tiny checkpoints exercise every switch of a family; llama.cpp implements the released models: Qwen2.5 and
# Qwen3 ship use_sliding_window false (llama.cpp's qwen2/qwen3 have no window), no RoPE scaling (--to gguf does
# not write yarn yet), and Qwen3 and Gemma no attention biases (llama.cpp's have no o_proj bias).
RELEASED = {"llama": {}, "qwen2": {"use_sliding_window": False, "rope_scaling": None},
            "qwen3": {"use_sliding_window": False, "rope_scaling": None, "attention_bias": False},
            "gemma": {"attention_bias": False},
            # Gemma 2 2B/9B and Gemma 3 1B: query_pre_attn_scalar = head_dim, which llama.cpp assumes; no RoPE
            # scaling on Gemma 3 1B (the tiny one scales its global layers)
            "gemma2": {"attention_bias": False, "query_pre_attn_scalar": 16},
            "gemma3": {"attention_bias": False, "query_pre_attn_scalar": 16, "rope_scaling": None},
            "olmo2": {"attention_bias": False},  # OLMo 2 ships no attention biases (llama.cpp's olmo2 reads none)
            "granite": {}, "smollm3": {}, "cohere": {}, "cohere2": {},
            # Phi-4-mini: no sliding window (llama.cpp's phi3 ignores one: below)
            "phi3": {"sliding_window": None},
            # the MoE families: llama.cpp's qwen2moe/qwen3moe read experts on every layer (no mlp_only_layers), and
            # fix the top-k renormalisation (qwen2moe never, as Qwen1.5-MoE: norm_topk_prob false; qwen3moe always);
            # OLMoE-1B-7B has no GQA (llama.cpp's olmoe sizes the k-norm to the hidden width) and no biases;
            # Mixtral ships no sliding window (llama.cpp's llama has none)
            "qwen2_moe": {"use_sliding_window": False, "rope_scaling": None, "norm_topk_prob": False,
                          "mlp_only_layers": []},
            "qwen3_moe": {"use_sliding_window": False, "rope_scaling": None, "attention_bias": False,
                          "mlp_only_layers": []},
            "olmoe": {"attention_bias": False, "num_key_value_heads": 4},
            "mixtral": {"sliding_window": None},
            # Pythia: rotary_pct 0.25, parallel residual; the tiny one rotates half of each head
            "gpt_neox": {"rotary_pct": 0.25},
            # Phi-2: no q/k LayerNorms (llama.cpp's phi2 has none); StableLM 2 1.6B: q/k/v biases, the sequential
            # block (the parallel one is StableLM 2 12B's, with per-head q/k norms parity does not map)
            "phi": {"qk_layernorm": False},
            "stablelm": {"use_parallel_residual": False, "partial_rotary_factor": 0.25}}
MOE_FAMILIES = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """released(family): a tiny checkpoint of the family as its released models are configured."""
    from parity.reference.tiny import build_model

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
    result, report = _check(reference, out, tmp_path / "r.json", *TOLERANCE.get(family, ()))
    assert result.exit_code == 0, result.output
    assert report["candidate"]["kind"] == "gguf"
    points = {p["name"]: p for p in report["points"]}
    layers = max(int(n.split(".")[1]) for n in points if n.startswith("layers.")) + 1
    assert layers == ADAPTERS[family].spec.tiny.layers
    for name, p in points.items():
        point = name.split(".")[-1] if name.startswith("layers.") else name
        assert p["compared"] == (point not in NOT_NAMED[family]), (family, name)
    assert report["logits"]["top1_agreement"] == 1.0 and report["logits"]["kl_max"] < 1e-6


def test_llama_cpp_attends_globally_where_phi3_slides(tmp_path, tiny_dir):
    """llama.cpp's phi3 reads the sliding window and drops it (src/models/phi3.cpp, ggml-org/llama.cpp#13676): a
    Phi-3 whose window the prompt passes (Phi-3-mini: 2047) diverges in llama.cpp from the first position past
    it, and the check names the mistake. The LongRoPE factors before it agree."""
    reference = tiny_dir("phi3")
    out = tmp_path / "phi3.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json", "--calibrate")
    assert result.exit_code == 1
    assert report["first_divergence"]["point"] == "layers.0.attn_out"
    assert report["diagnosis"][0]["bug"] == "sliding-window-ignored"
    assert "starts at position 16" in report["diagnosis"][0]["evidence"]


def test_llama_cpp_picks_longrope_factors_by_its_context(tmp_path, released):
    """llama.cpp picks LongRoPE's factor set by the context it allocates (n_ctx_seq, padded to 256), not by the
    sequence (src/llama-model.cpp get_rope_factors; ggml-org/llama.cpp#24823): a 20-token prompt of a Phi-3 whose
    original context is 32 is rotated with the long factors, where transformers takes the short ones. Past 32
    tokens the two agree (test_f32_gguf_passes_layerwise_in_llama_cpp)."""
    reference = released("phi3")
    out = tmp_path / "phi3.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json", "--calibrate", "--length", "20")
    assert result.exit_code == 1
    assert report["first_divergence"]["op"] == "layers.0.attn.q_rope"
    assert report["diagnosis"][0]["bug"] == "longrope-long-factors-early"


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
    result = CliRunner().invoke(cli, ["convert", str(tiny_dir("mistral")), "--to", "gguf", "-o",
                                      str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and "does not export mistral to GGUF" in result.stderr
    assert not (tmp_path / "x.gguf").exists()


# (family, bug, where it first shows): RoPE mistakes in the attention output (qwen2/qwen3 name no attention output
# in llama.cpp's graph: the residual after it), norm mistakes in the first norm's output
TWINS = [("llama", "rope-permuted", "layers.0.attn_out"), ("llama", "rope-theta-wrong", "layers.0.attn_out"),
         ("llama", "norm-eps-wrong", "layers.0.attn_in"), ("llama", "norm-offset-added", "layers.0.attn_in"),
         ("qwen2", "rope-permuted", "layers.0.attn_out"), ("qwen3", "rope-theta-wrong", "layers.0.attn_out"),
         ("qwen3", "norm-eps-wrong", "layers.0.attn_in"), ("gemma", "norm-offset-dropped", "layers.0.attn_in"),
         ("gemma", "rope-permuted", "layers.0.attn_out"), ("gemma2", "norm-offset-dropped", "layers.0.attn_in"),
         ("gemma3", "rope-theta-wrong", "layers.0.attn_out"), ("olmo2", "norm-eps-wrong", "layers.0.attn_out"),
         ("olmo2", "rope-permuted", "layers.0.attn_out"), ("cohere", "logit-scale-dropped", "logits"),
         ("cohere", "norm-eps-wrong", "layers.0.attn_in"), ("cohere2", "rope-theta-wrong", "layers.0.attn_out"),
         ("granite", "logit-scale-dropped", "logits"), ("gpt_neox", "norm-eps-wrong", "layers.0.attn_in"),
         ("gpt_neox", "rope-theta-wrong", "layers.0.attn_out"), ("stablelm", "rope-theta-wrong", "layers.0.attn_out"),
         ("phi", "norm-eps-wrong", "layers.0.attn_in")]


@pytest.mark.parametrize("family,bug,first", TWINS)
def test_broken_twin_fails_where_its_bug_acts_and_is_named(family, bug, first, tmp_path, released):
    """A GGUF written with a catalogued mistake (`parity convert --to gguf --inject BUG`) fails in llama.cpp at the
    point the mistake first acts, and the diagnosis names the mistake."""
    reference = released(family)
    out = tmp_path / f"{bug}.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out, "--inject", bug).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json", *TOLERANCE.get(family, ()))
    assert result.exit_code == 1, result.output
    assert report["first_divergence"]["point"] == first
    assert report["diagnosis"][0]["bug"] == bug


def _moe_twin(reference, out, layer: int, swap: str):
    """A copy of the tiny qwen2_moe checkpoint ``reference`` with experts 0 and 1 of ``layer`` exchanged: their
    router rows ("router"), their weights ("experts"), or both (the same model, its experts renumbered)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = load_file(str(reference / "model.safetensors"))
    prefix = f"model.layers.{layer}.mlp."
    if swap in ("router", "both"):
        tensors[prefix + "gate.weight"] = tensors[prefix + "gate.weight"][[1, 0, *range(2, 8)]].contiguous()
    if swap in ("experts", "both"):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            a, b = f"{prefix}experts.0.{proj}.weight", f"{prefix}experts.1.{proj}.weight"
            tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((reference / "config.json").read_text())
    return out


@pytest.mark.parametrize("swap,first", [("router", "layers.1.mlp_out"), ("experts", "layers.1.mlp_out"),
                                        ("both", None)])
def test_a_moe_gguf_with_experts_out_of_router_order_fails_at_that_layer(swap, first, tmp_path, released):
    """The exporter stacks each layer's experts in the router's row order: a GGUF whose layer-1 router rows (or
    experts) are exchanged routes tokens to other experts from layer 1 on (measured: layers.1.mlp_out rel_l2 0.40,
    logits 0.16), while exchanging both renumbers the experts of the same model and passes (7.7e-7 there)."""
    reference = released("qwen2_moe")
    twin = _moe_twin(reference, tmp_path / "twin", 1, swap)
    out = tmp_path / "twin.gguf"
    assert _cli("convert", twin, "--to", "gguf", "-o", out).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json")
    points = {p["name"]: p for p in report["points"]}
    assert points["layers.0.out"]["rel_l2"] < 1e-5 and points["layers.1.mlp_in"]["rel_l2"] < 1e-5
    if first is None:
        assert result.exit_code == 0, result.output
        assert points["logits"]["rel_l2"] < 1e-5
    else:
        assert result.exit_code == 1, result.output
        assert report["first_divergence"]["point"] == first
        assert points[first]["rel_l2"] > 1e-2


@pytest.mark.parametrize("family,overrides,said", [
    ("qwen2_moe", {"norm_topk_prob": True}, "(norm_topk_prob true); llama.cpp's qwen2moe never does"),
    ("qwen3_moe", {"norm_topk_prob": False}, "(norm_topk_prob false); llama.cpp's qwen3moe always does"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "layers [1] hold a dense MLP between MoE layers"),
    ("olmoe", {"num_key_value_heads": 2}, "llama.cpp's olmoe sizes it to the hidden width 64 (no GQA)")])
def test_a_moe_block_llama_cpp_would_compute_otherwise_is_refused(family, overrides, said, tmp_path):
    from parity.reference.tiny import build_model

    reference = tmp_path / family
    build_model(ADAPTERS[family], overrides={**RELEASED[family], **overrides}).save_pretrained(reference)
    result = CliRunner().invoke(cli, ["convert", str(reference), "--to", "gguf", "-o", str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and said in result.stderr, result.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_a_mistake_a_gguf_file_cannot_carry_is_refused(tmp_path, released):
    result = CliRunner().invoke(cli, ["convert", str(released("llama")), "--to", "gguf", "-o",
                                      str(tmp_path / "x.gguf"), "--inject", "activation-swapped"])
    assert result.exit_code == 2 and "a GGUF file can carry" in result.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_an_attention_scale_llama_cpp_would_not_compute_is_refused(tmp_path, tiny_dir):
    """The tiny Gemma 2 scales attention by query_pre_attn_scalar ** -0.5 (24 against a head_dim of 16); llama.cpp's
    gemma2 computes 1/sqrt(head_dim) whatever the config says, so no GGUF file can express this model."""
    result = CliRunner().invoke(cli, ["convert", str(tiny_dir("gemma2")), "--to", "gguf", "-o",
                                      str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and "does not read query_pre_attn_scalar" in result.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_same_weights_builds_the_reference_from_the_files_own_weights(tmp_path, released):
    """--same-weights: transformers runs the GGUF's dequantized weights. A Q8_0 file's embedding rows then agree
    exactly (its error without --same-weights: rel_l2 ~5e-3 at the first norm), and what is left is llama.cpp's
    quantized arithmetic (activations rounded to Q8_0 in each matmul)."""
    reference = released("llama")
    out = tmp_path / "q8.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out, "--gguf-type", "Q8_0").exit_code == 0
    _, plain = _check(reference, out, tmp_path / "plain.json", "--float-reference")
    _, same = _check(reference, out, tmp_path / "same.json", "--same-weights")
    first = lambda report: next(p for p in report["points"] if p["name"] == "layers.0.attn_in")  # noqa: E731
    assert first(plain)["rel_l2"] > 1e-3 and first(same)["rel_l2"] < 1e-6
    held = same["reference"]["same_weights"]
    assert held["types"]["Q8_0"] == 2 * 7 + 2 and held["types"]["F32"] == 2 * 2 + 1  # matrices; norms stay F32
    assert same["reference"]["path"] == str(reference)
    assert same["logits"]["kl_mean"] < plain["logits"]["kl_mean"]


def test_same_weights_of_an_f32_file_is_the_plain_check(tmp_path, released):
    reference = released("gemma")
    out = tmp_path / "f32.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json", "--same-weights", *TOLERANCE["gemma"])
    assert result.exit_code == 0, result.output
    assert report["reference"]["same_weights"]["types"] == {"F32": report["reference"]["same_weights"]["tensors"]}


def test_same_weights_reads_stacked_experts_back(tmp_path, released):
    """--same-weights on a MoE file: each layer's stacked experts are read back as the checkpoint's per-expert
    tensors (117 tensors of the tiny qwen2_moe from 54 in the file) and judged one by one; an F32 file is then the
    plain check, and a Q8_0 file says that the experts' rounded activations are not emulated."""
    reference = released("qwen2_moe")
    for qtype in ("F32", "Q8_0"):
        out = tmp_path / f"{qtype}.gguf"
        assert _cli("convert", reference, "--to", "gguf", "-o", out, "--gguf-type", qtype).exit_code == 0
        result, report = _check(reference, out, tmp_path / f"{qtype}.json", "--same-weights")
        held = report["reference"]["same_weights"]
        assert held["tensors"] == 117 and sum(held["types"].values()) == 54 and held["not_a_quantization"] == {}
        said = [w for w in report["warnings"] if "fused module" in w]
        if qtype == "F32":
            assert result.exit_code == 0, result.output
            assert held["matmuls_not_emulated"] == [] and not said
        else:
            assert len(held["matmuls_not_emulated"]) == 3 * 3 and said  # gate, up, down of 3 layers
            assert next(p for p in report["points"] if p["name"] == "layers.0.attn_in")["rel_l2"] < 1e-6


def test_same_weights_is_refused_for_other_candidates(tmp_path, tiny_dir):
    result = CliRunner().invoke(cli, ["check", "--reference", str(tiny_dir("llama")), "--candidate",
                                      str(tiny_dir("llama")), "--same-weights"])
    assert result.exit_code == 2 and "cannot give them (kinds that can: onnx, gguf" in result.stderr


def test_a_vocabulary_that_splits_the_prompt_otherwise_is_reported(tmp_path, tiny_dir, monkeypatch):
    """The GGUF carries the checkpoint's byte-level BPE vocabulary; llama.cpp re-tokenizes the prompt's text with
    it. The same vocabulary gives the same ids (no warning); one with 'h' and 'e' swapped is reported (the check
    still feeds the reference's ids, so the verdict stands)."""
    from parity.engines.gguf import export as gguf_export

    reference = tiny_dir("llama")
    good = tmp_path / "good.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", good).exit_code == 0
    _, report = _check(reference, good, tmp_path / "good.json", "--prompt", "hello parity")
    assert not any("tokenizer" in w for w in report["warnings"])

    real = gguf_export.vocabulary

    def swapped(directory, size):
        tokens, merges = real(directory, size)
        tokens[ord("h")], tokens[ord("e")] = tokens[ord("e")], tokens[ord("h")]
        return tokens, merges

    monkeypatch.setattr(gguf_export, "vocabulary", swapped)
    bad = tmp_path / "bad.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", bad).exit_code == 0
    result, report = _check(reference, bad, tmp_path / "bad.json", "--prompt", "hello parity")
    assert result.exit_code == 0
    said = [w for w in report["warnings"] if "tokenizer" in w]
    assert said and f"first different at position 0 (reference {ord('h')}, llama.cpp {ord('e')})" in said[0]


def test_a_file_that_adds_its_bos_otherwise_is_named(tmp_path, tiny_dir, monkeypatch):
    """A checkpoint whose tokenizer puts BOS (id 1) before every text: the export tells llama.cpp to add it too
    (tokenizer.ggml.add_bos_token), and llama.cpp then tokenizes the prompt as the reference does. A file that
    says not to (as parity's exporter once wrote every file) makes a llama.cpp server run the prompt without its
    BOS: the check names bos-dropped in a warning (it fed the reference's ids, so the verdict stands)."""
    import shutil

    from parity.engines.gguf import export as gguf_export

    reference = tmp_path / "reference"
    shutil.copytree(tiny_dir("llama"), reference)
    tokenizer = json.loads((reference / "tokenizer.json").read_text())
    tokenizer["post_processor"] = {"type": "TemplateProcessing",
                                   "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                              {"Sequence": {"id": "A", "type_id": 0}}],
                                   "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                            {"Sequence": {"id": "A", "type_id": 0}},
                                            {"Sequence": {"id": "B", "type_id": 1}}],
                                   "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    (reference / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert json.loads((reference / "config.json").read_text())["bos_token_id"] == 1

    good = tmp_path / "good.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", good).exit_code == 0
    _, report = _check(reference, good, tmp_path / "good.json", "--prompt", "hello parity")
    assert report["inputs"]["runs"][0]["ids"][0] == 1  # the reference ran BOS first
    assert not any("tokenizer" in w or "special tokens" in w for w in report["warnings"])

    monkeypatch.setattr(gguf_export, "_leading_bos", lambda directory: None)
    bad = tmp_path / "bad.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", bad).exit_code == 0
    result, report = _check(reference, bad, tmp_path / "bad.json", "--prompt", "hello parity")
    assert result.exit_code == 0
    said = [w for w in report["warnings"] if "special tokens" in w]
    assert said and "bos-dropped: llama.cpp ran no BOS token (id 1) before the prompt" in said[0], said


@pytest.mark.parametrize("family", ["llama", "gemma3", "cohere2", *MOE_FAMILIES])
def test_llama_cpp_decodes_with_its_own_cache(family, tmp_path, released):
    """--decode: the prompt, then 32 llama.cpp decode steps through its own KV cache (Gemma 3's sliding layers
    wrap during them), each step's points read through the eval callback."""
    reference = released(family)
    out = tmp_path / f"{family}.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out).exit_code == 0
    # one position's rel_l2 spreads wider than a prompt's: the f16 GELU table reaches 1.04e-3 on the tiny Gemma 3
    extra = ("--tolerance", "*:rel_l2=2e-3") if family in TOLERANCE else ()
    result, report = _check(reference, out, tmp_path / "r.json", "--decode", "32", *extra)
    assert result.exit_code == 0, result.output
    steps = [p for p in report["points"] if p["step"] is not None]
    assert {p["step"] for p in steps} == set(range(1, 33))
    compared = [p for p in steps if p["compared"]]
    assert len(compared) == 32 * sum(p["compared"] for p in report["points"] if p["step"] is None)
    assert report["decode"]["top1_agreement"] == 1.0 and report["decode"]["kl_max"] < 1e-8
    worst = max(p["rel_l2"] for p in compared)  # docs/gguf.md: 2.4e-6 (llama), 1.04e-3 (gemma3)
    assert worst < (1.1e-3 if family in TOLERANCE else 5e-6), worst  # float32: 3.05e-6 for llama on AVX2 alone
    if family == "gemma3":
        assert {c["what"]: c["crossed"] for c in report["decode"]["crossed"]}["sliding window 8"] == "decode"
    # a point llama.cpp does not name is not compared at any step; every other point is compared at every step
    assert ("at every decode step" in result.output) == bool(NOT_NAMED[family]) or family == "gemma3"


@pytest.mark.parametrize("gguf_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("bug,first", [("rope-permuted", "layers.0.attn_out"), ("norm-offset-added", "layers.0.attn_in")])
def test_same_weights_and_quantization_noise_do_not_absorb_a_broken_layout(gguf_type, bug, first, tmp_path,
                                                                           released):
    """Read back, a twin's q/k rows (or norms) are not a quantization of the checkpoint's: the same-weights
    reference keeps the checkpoint's own there, so --same-weights and a calibrated check still fail where the
    mistake acts, and say which tensors they were."""
    reference = released("llama")
    out = tmp_path / "twin.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out, "--gguf-type", gguf_type, "--inject",
                bug).exit_code == 0
    for mode in ("--same-weights", "--calibrate"):  # --calibrate against the float weights: the noise is the file's
        extra = ("--float-reference",) if mode == "--calibrate" else ()
        result, report = _check(reference, out, tmp_path / f"r{mode}.json", mode, *extra)
        assert result.exit_code == 1, (mode, result.output)
        assert report["first_divergence"]["point"] == first, mode
        if mode == "--same-weights" or gguf_type != "F32":  # an all-F32 file is calibrated as usual: nothing read back
            assert any("not a quantization of the checkpoint's" in w for w in report["warnings"])
        assert report["first_divergence"]["rel_l2"] > 0.3
        if mode == "--calibrate" and gguf_type == "Q8_0":  # docs/gguf.md: 38x and 197x the quantization's noise
            assert report["first_divergence"]["noise_ratio"] > 30


def test_a_q8_0_file_passes_within_tolerances_measured_on_its_own_quantization(tmp_path, released):
    """--calibrate with a quantized file: each point's noise is the reference against the reference run on the
    file's own dequantized weights (what the quantization costs this model), and the tolerance 10x that. A correct
    Q8_0 file of the tiny Llama is within 1.3x of it at every point (llama.cpp also rounds activations to Q8_0);
    its broken twins are 20x to 200x beyond (the test above)."""
    reference = released("llama")
    out = tmp_path / "q8.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out, "--gguf-type", "Q8_0").exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json", "--calibrate", "--float-reference")
    assert result.exit_code == 0, result.output
    compared = [p for p in report["points"] if p["compared"]]
    assert all(p["tolerance"]["source"].startswith("calibrated") for p in compared)
    assert all(p["noise"] > 1e-3 and p["noise_ratio"] < 2 for p in compared)  # docs/gguf.md: 1.0x to 1.3x
    assert report["candidate"]["quantization"]["types"]["Q8_0"] == 16
    assert 0.9 < report["logits"]["top1_agreement"] < 1.0  # Q8_0 flips near ties on these random weights


@pytest.mark.parametrize("family,overrides,mid", [("gpt_neox", {"use_parallel_residual": False}, True),
                                                  ("stablelm", {"use_parallel_residual": True}, False)])
def test_the_other_block_of_a_family_runs_in_llama_cpp(family, overrides, mid, tmp_path):
    """llama.cpp's gptneox reads use_parallel_residual (src/models/gptneox.cpp): a GPT-NeoX configured without the
    parallel residual runs in sequence there too, `mid` read from ffn_inp; its stablelm runs a layer without
    ffn_norm in parallel on attn_norm (src/models/stablelm.cpp), StableLM's parallel residual on one norm."""
    from parity.reference.tiny import build_model

    reference = tmp_path / family
    build_model(ADAPTERS[family], overrides={**RELEASED[family], **overrides}).save_pretrained(reference)
    out = tmp_path / "x.gguf"
    assert _cli("convert", reference, "--to", "gguf", "-o", out).exit_code == 0
    result, report = _check(reference, out, tmp_path / "r.json", *TOLERANCE.get(family, ()))
    assert result.exit_code == 0, result.output
    points = {p["name"]: p for p in report["points"]}
    assert ("layers.0.mid" in points) == mid
    if mid:
        assert points["layers.0.mid"]["compared"] and points["layers.0.mid"]["rel_l2"] < 1e-5


def test_a_convention_the_architecture_lacks_is_refused(tmp_path, tiny_dir):
    """The tiny Phi normalises q and k (qk_layernorm), which llama.cpp's phi2 does not."""
    result = CliRunner().invoke(cli, ["convert", str(tiny_dir("phi")), "--to", "gguf", "-o", str(tmp_path / "x.gguf")])
    assert result.exit_code == 2 and "llama.cpp's phi2 has no q/k norms" in result.stderr, result.stderr
    assert not (tmp_path / "x.gguf").exists()
