"""llama.cpp's CPU arithmetic, emulated on the same-weights reference (parity/engines/gguf/arithmetic.py): exact at one matmul, closer
to llama.cpp than the plain same-weights reference over a whole model, and no cover for a broken twin.

Measured on this machine (x86, AVX-512; llama-cpp-python's ggml-cpu), the 64-token default prompt:

- one matmul, llama.cpp's own input rounded as its kernel rounds it, times gguf-py's dequantized weight: rel_l2
  1e-7 to 3e-7 of llama.cpp's output for every type (F16 Q8_0 Q4_1 Q4_K Q6_K), where the input unrounded is
  2e-4 (F16) to 1e-2 away, and Q4_1 without the Q8_1 sum correction 3e-4 to 1e-3;
- a whole model: the reference matches llama.cpp at 1e-7 until float32 summation order (attention, norms) moves
  one rounded value across a rounding boundary: an F16 rounding, a Q8_0 block's f16 scale (the tiny Llama's
  layer 0 o_proj: one block of 32 whose amax / 127 = 0.00385761284 sits on an f16 midpoint, 1 float32 ulp of
  amax apart), or a Q8_K value. Every quantized matmul after it turns an input difference e into about
  sqrt(step * e), so the emulating reference's error grows layer by layer towards the plain one's: ratios
  plain / emulating of 1e4 to 1e5 where no boundary is crossed, 2x to 60x where one is. F16 crosses one in
  about every matmul (a relative step of 2^-11 against 1e-7 of float32 noise) and never reaches 5x;
- isolated (--isolate: each reference layer, and each MLP, takes llama.cpp's own input), a crossing acts in one
  sublayer only: every point of every family, in F16, Q8_0, Q4_0, Q4_1 and Q4_K_M, is at least 5x closer to
  the emulating reference (F16's worst about 7x, the integer types' 20x to 1e5x);
- a tie is exact: torch's ``127.0 / t`` is ``127 * (1 / t)``, an ulp off C's division for a quarter of values,
  which put OLMo 2's layer-0 inputs (embeddings read from a Q4_0 table: lattice values, Q8_0 ties at 63.5) on
  the wrong side, 2.7e-3 off; parity.engines.gguf.arithmetic divides as C does (3e-8).
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from tests.conftest import ADAPTERS
from tests.gguf_twins import write_twin
from tests.test_gguf import GGUF_FAMILIES, RELEASED, _check, _cli
from tests.test_gguf_quantize import WIDE

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

from parity.compare import ENGINE_MULTIPLE, NOISE_FLOOR
from parity.engines.gguf.arithmetic import ACTIVATIONS, block_mins, round_activations
from parity.engines.gguf.kind import GGUFRun, _read
from parity.engines.gguf.weights import BANDS, REQUANTIZABLE

IDS = [(37 * k + 11) % 256 for k in range(16)]  # tokens for the one-op runs (every tiny vocabulary has 256)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double())).item()


# ---------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(source): a family's tiny checkpoint configured as its released models are (test_gguf.RELEASED),
    or "wide": the tiny Llama with rows of 256 and 512 columns, which the K-quants' blocks fit."""
    from parity.reference.tiny import build_model

    root = tmp_path_factory.mktemp("arith-checkpoints")
    made = {}

    def get(source: str):
        if source not in made:
            family = "llama" if source == "wide" else source.removeprefix("wide-")
            overrides = dict(RELEASED[family])
            if source.startswith("wide"):  # rows the K-quants' blocks of 256 fit (query_pre_attn_scalar = head_dim)
                overrides.update(WIDE, **({"query_pre_attn_scalar": WIDE["head_dim"]}
                                          if "query_pre_attn_scalar" in overrides else {}))
            build_model(ADAPTERS[family], overrides=overrides).save_pretrained(root / source)
            made[source] = root / source
        return made[source]

    return get


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory):
    """gguf_file(source, type, inject=None): the checkpoint written with `parity convert --to gguf`, once."""
    root = tmp_path_factory.mktemp("arith-gguf")
    made = {}

    def get(source: str, qtype: str, inject: str | None = None):
        key = (source, qtype, inject)
        if key not in made:
            out = root / f"{source}-{qtype}-{inject or 'correct'}.gguf"
            extra = ("--inject", inject) if inject else ()
            result = _cli("convert", checkpoint(source), "--to", "gguf", "-o", out, "--gguf-type", qtype, *extra)
            assert result.exit_code == 0, result.output
            made[key] = out
        return made[key]

    return get


# ------------------------------------------------------------------------------ 1. one matmul, in llama.cpp

class _Keep(GGUFRun):
    """A llama.cpp run that keeps the first tensor of each wanted name. llama.cpp names a projection's output
    before anything else is done to it: the first "Vcur-0" is attn_v's matmul ([tokens, kv width]), and the
    next ones are it with the bias added (qwen2) and reshaped to heads; the first "ffn_out-0" is ffn_down's
    matmul, before the residual sum of the same name."""

    def __init__(self, path, n_tokens, wanted):
        self.wanted, self.kept = set(wanted), {}
        super().__init__(path, n_tokens)

    def _on_tensor(self, t, ask, _user) -> bool:
        name = (self.lib.ggml_get_name(t) or b"").decode(errors="replace")
        if ask:
            return name in self.wanted
        if name in self.wanted and name not in self.kept:
            x = _read(self.lib, t)
            if x is not None:
                self.kept[name] = x.reshape(-1, x.shape[-1]).clone()
        return True


def _weight(reader, name: str):
    """(the matrix dequantized by gguf-py [rows, columns], its GGML type, the f16 block minimums for Q4_1/Q5_1)."""
    tensor = next(t for t in reader.tensors if t.name == name)
    kind = gguf.GGMLQuantizationType(tensor.tensor_type)
    values = gguf.quants.dequantize(tensor.data, kind).astype("float32")
    w = torch.from_numpy(values).reshape(tuple(reversed(tensor.shape.tolist())))
    return w, kind.name, block_mins(tensor.data, kind.name)


# (source, file type, the type attn_v is stored in there): K-quant rows need 256 columns (the wide Llama), where
# llama.cpp's Q4_K_M mix stores output.weight (and layer 1's attn_v, ffn_down) in Q6_K; the tiny files keep
# output.weight in Q8_0 whatever the type asked. qwen2: the first Vcur-0 comes before its bias.
OP_FILES = [("llama", "Q4_1", "Q4_1"), ("qwen2", "Q4_1", "Q4_1"), ("llama", "Q8_0", "Q8_0"),
            ("wide", "Q4_K_M", "Q4_K"), ("llama", "F16", "F16")]
# (input, weight, output) of three matmuls: attention's v projection, the MLP's down projection, the LM head
OPS = [("attn_norm-0", "blk.0.attn_v.weight", "Vcur-0"), ("ffn_swiglu-0", "blk.0.ffn_down.weight", "ffn_out-0"),
       ("result_norm", "output.weight", "result_output")]


@pytest.mark.parametrize("source,qtype,v_type", OP_FILES)
def test_one_matmul_is_emulated_exactly(source, qtype, v_type, gguf_file):
    """llama.cpp's own input to a matmul, rounded to the weight type's activation partner (ACTIVATIONS) and
    multiplied by the weight gguf-py dequantizes (plus, for Q4_1, the Q8_1 block sums' f16 excess times the weight
    blocks' minimums), is llama.cpp's output to float32 summation order; the input unrounded is >10x further."""
    path = gguf_file(source, qtype)
    run = _Keep(path, len(IDS), {name for op in OPS for name in (op[0], op[2])})
    try:
        run.run(IDS)
    finally:
        run.close()
    reader = gguf.GGUFReader(path)
    seen = {}
    names = {t.name for t in reader.tensors}
    for x_name, w_name, y_name in OPS:
        if w_name not in names:  # tied embeddings: llama.cpp multiplies by token_embd
            w_name = "token_embd.weight"
        w, kind, mins = _weight(reader, w_name)
        x, y = run.kept[x_name], run.kept[y_name]
        assert y.shape == (len(IDS), w.shape[0]), (y_name, y.shape)  # the matmul's own output, not a reshape
        rounded, excess = round_activations(x, ACTIVATIONS[kind])
        emulated = rounded @ w.T
        assert (excess is None) == (mins is None) == (kind not in ("Q4_1", "Q5_1")), kind
        if excess is not None:
            uncorrected = _rel(emulated, y)
            emulated = emulated + excess @ mins.T
        error, plain = _rel(emulated, y), _rel(x @ w.T, y)
        seen[w_name] = (kind, error, plain)
        assert error < 1e-5, (w_name, kind, error, plain)
        assert plain > 10 * error, (w_name, kind, error, plain)
        if excess is not None:  # the Q8_1 sums llama.cpp multiplies by the minimums are f16, not exact
            assert uncorrected > 10 * error, (w_name, kind, error, uncorrected)
    assert seen["blk.0.attn_v.weight"][0] == v_type, seen
    if source == "wide":
        assert seen["output.weight"][0] == "Q6_K", seen  # the second K-quant, through Q8_K too


# ---------------------------------------------------------- 2. a correct file passes, closer than the plain reference

_F16_CASCADE = ("F16 rounding: float32 summation order (1e-7) crosses an f16 rounding boundary in about every "
                "matmul (step 2^-11), and each later rounding amplifies the difference; the emulating reference "
                "stays only 2-3.5x closer than the plain one (isolated, every point is 5x closer: "
                "test_isolated_every_point_is_closer_to_the_emulating_reference). ")
CASCADES = {  # measured on x86/AVX-512 with the 64-token default prompt; a different machine may cross elsewhere
    ("llama", "F16"): _F16_CASCADE + "logits: rel_l2 2.79e-4 against plain 9.67e-4 (3.47x); the first crossing "
                                     "is layer 0 o_proj's input (1 value of 4096 at input rel_l2 2.6e-7), then "
                                     "24, 91, ... 2425 of 8192 in layer 1's down_proj",
    ("gemma", "F16"): _F16_CASCADE + "layers.1.mlp_out: rel_l2 3.80e-4 against plain 1.18e-3 (3.11x); the first crossing "
                                     "is layer 0 o_proj's input (12 values of 4096 at input rel_l2 2.8e-7), then "
                                     "18, 136, ... 3174 of 8192 in layer 1's down_proj",
    ("granite", "Q8_0"): "Q8_0 rounding cascade amplified by Granite's multipliers (embeddings x12): the emulating "
                         "reference is 2.4x closer at the logits (4.43e-3 against plain 1.06e-2), not 5x; isolated "
                         "layers pass",
    ("smollm3", "Q8_0"): "Q8_0 rounding cascade over 4 layers: layers.3.mlp_out rel_l2 1.12e-2 against plain 3.87e-2 "
                         "(3.45x); isolated layers pass",
    ("cohere2", "Q8_0"): "Q8_0 rounding cascade over 4 layers: layers.3.mlp_out rel_l2 1.08e-2 against plain 3.24e-2 "
                         "(3.0x; layer 0 is 27x to 143x closer); isolated layers pass",
    ("wide", "Q4_K_M"): "Q8_K rounding: layer 0's gate/up input (ffn_norm-0, rel_l2 3.4e-7 from llama.cpp's) puts one "
                        "of 16384 values across a Q8_K rounding boundary (rounded rel_l2 2.0e-4); down_proj then "
                        "2.6e-4 -> 1.4e-3 and layer 1 on; logits: rel_l2 9.36e-3 against plain 3.16e-2 (3.38x)",
}
# The emulation rounds the inputs of the checkpoint's own projections; transformers runs a MoE layer's experts as
# one fused module, so their inputs go unrounded (parity.engines.gguf.weights: matmuls_not_emulated) and the experts'
# rounding stays in the comparison: measured on the tiny qwen2_moe in F16, isolated, layers.1.mlp_out rel_l2 5.3e-2
# against both references (a routing flip), 166x the noise. The MoE families are left out until experts are emulated.
# --same-weights refuses a file whose tensors fuse several of the checkpoint's (phi3's attn_qkv, ffn_up): not read
# back yet, so those families are left out too
EMULATED = [f for f in GGUF_FAMILIES if not ADAPTERS[f].spec.gguf.experts and not ADAPTERS[f].spec.gguf.fuse]
MATRIX = [*((f, "Q8_0") for f in EMULATED),
          *(("llama", t) for t in ("F16", "Q4_0", "Q4_1", "Q4_K_M")),  # tiny Q4_K_M: Q5_0 and Q8_0 fallbacks
          *(("gemma", t) for t in ("F16", "Q4_0", "Q4_1")),            # GELU: ggml's f16 table emulated too
          ("wide", "Q4_K_M"), ("wide", "Q6_K")]                        # real K-quants: Q4_K, Q6_K x Q8_K
ABOVE = 1e-5     # points where the two references differ by more than float32 noise
CLOSER = 5.0     # and the emulating one is at least this much closer to llama.cpp there


@pytest.mark.parametrize("source,qtype", [
    pytest.param(s, t, marks=pytest.mark.xfail(reason=CASCADES[(s, t)], strict=False)) if (s, t) in CASCADES
    else (s, t) for s, t in MATRIX])
def test_a_correct_file_passes_closer_to_the_emulating_reference(source, qtype, checkpoint, gguf_file, tmp_path):
    result, report = _check(checkpoint(source), gguf_file(source, qtype), tmp_path / "r.json", "--same-weights",
                            "--calibrate")
    assert result.exit_code == 0, result.output
    held = report["reference"]["same_weights"]
    assert held["not_a_quantization"] == {}
    # llama.cpp's quantizer reproduced: every tensor of a type gguf-py quantizes is the checkpoint's quantized again
    assert held["requantized"] == {k: n for k, n in held["types"].items() if k in REQUANTIZABLE}, held
    arithmetic = report["reference"]["arithmetic"]
    assert arithmetic["engine"] == "llama.cpp (ggml-cpu)" and arithmetic["matmuls"]
    for kinds in arithmetic["matmuls"]:  # "Q4_1 x Q8_1": a type the file holds, and its activation partner
        kind, act = kinds.split(" x ")
        assert kind in held["types"] and act == (ACTIVATIONS[kind] or "F32"), kinds
    # a GELU MLP (Gemma's gated one, Phi's plain one) goes through ggml's f16 table
    assert arithmetic["gelu"] == ("f16 table" if source.startswith(("gemma", "phi")) else "computed")
    assert "against_plain" in report["logits"]
    compared = [p for p in report["points"] if p["compared"]]
    assert compared and all(p["passed"] for p in compared)
    for p in compared:  # the distance between the references, twice, never below float32's floor
        assert p["tolerance"]["rel_l2"] == pytest.approx(max(ENGINE_MULTIPLE * p["noise"], NOISE_FLOOR["float32"]))
    apart = [p for p in compared if p["rel_l2_plain"] > ABOVE]
    assert apart, "the plain reference is as close as the emulating one everywhere: nothing rounded?"
    table = "\n".join(f"{p['name']:20s} rel_l2 {p['rel_l2']:.3g} plain {p['rel_l2_plain']:.3g} "
                      f"x{p['rel_l2_plain'] / max(p['rel_l2'], 1e-30):.3g}" for p in compared)
    worst = min(apart, key=lambda p: p["rel_l2_plain"] / max(p["rel_l2"], 1e-30))
    assert worst["rel_l2_plain"] >= CLOSER * worst["rel_l2"], f"{source} {qtype}: worst at {worst['name']}\n{table}"


# Isolated, each reference layer restarts from llama.cpp's own input to it (the candidate cannot be fed: the
# reference follows it), so a rounding boundary crossed in one layer no longer cascades through the next ones.
# Every family in every type asked for; the K-quants on the wide checkpoints, whose rows their blocks fit.
ISOLATED = [*((f, t) for f in EMULATED for t in ("F16", "Q8_0", "Q4_0", "Q4_1")),
            *((f"wide-{f}", "Q4_K_M") for f in EMULATED)]


@pytest.mark.parametrize("source,qtype", ISOLATED)
def test_isolated_every_point_is_closer_to_the_emulating_reference(source, qtype, checkpoint, gguf_file, tmp_path):
    result, report = _check(checkpoint(source), gguf_file(source, qtype), tmp_path / "r.json", "--same-weights",
                            "--calibrate", "--isolate")
    assert result.exit_code == 0, result.output
    assert report["mode"] == "isolated" and report["reference"]["fed"] == "the candidate's input to each layer"
    compared = [p for p in report["points"] if p["compared"]]
    assert compared and all(p["passed"] for p in compared)
    apart = [p for p in compared if p["rel_l2_plain"] > ABOVE]
    assert apart, "the plain reference is as close as the emulating one everywhere: nothing rounded?"
    table = "\n".join(f"{p['name']:20s} rel_l2 {p['rel_l2']:.3g} plain {p['rel_l2_plain']:.3g}" for p in compared)
    for p in apart:
        assert p["rel_l2_plain"] >= CLOSER * p["rel_l2"], f"{source} {qtype}: {p['name']}\n{table}"


# -------------------------------------------------------------- 3. broken twins are not absorbed by the emulation

def _biases_zeroed(source, destination):
    """A qwen2 file whose q/k/v biases are zeros: a port that drops them (llama.cpp's qwen2 loads them; the
    converter has no --inject for it). The F32 vectors are overwritten in place."""
    shutil.copyfile(source, destination)
    reader = gguf.GGUFReader(destination, "r+")
    zeroed = 0
    for tensor in reader.tensors:
        if re.fullmatch(r"blk\.\d+\.attn_[qkv]\.bias", tensor.name):
            assert gguf.GGMLQuantizationType(tensor.tensor_type).name == "F32"
            tensor.data[...] = 0
            zeroed += 1
    reader.data.flush()
    del reader
    assert zeroed == 3 * ADAPTERS["qwen2"].spec.tiny.layers
    return destination


# (family, bug, where it first acts): norms stored as w for 1 + w (gemma, gemma2), q/k rows in the other RoPE
# pairing, a wrong rope.freq_base (metadata), q/k/v biases dropped
TWIN_MATRIX = [("gemma", "norm-offset-dropped", "layers.0.attn_in"),
               ("gemma2", "norm-offset-dropped", "layers.0.attn_in"),
               ("llama", "rope-permuted", "layers.0.attn_out"), ("qwen2", "rope-permuted", "layers.0.attn_out"),
               ("llama", "rope-theta-wrong", "layers.0.attn_out"), ("qwen3", "rope-theta-wrong", "layers.0.attn_out"),
               ("qwen2", "qkv-bias-dropped", "layers.0.attn_out")]


@pytest.mark.parametrize("family,bug,first", TWIN_MATRIX)
def test_a_q8_0_twin_fails_where_its_bug_acts(family, bug, first, checkpoint, gguf_file, tmp_path):
    """The twin's tensors that are not a quantization of the checkpoint's (q/k rows, norms, biases) stay the
    checkpoint's in the reference; metadata (rope.freq_base) never enters it. The emulation then leaves the bug
    alone: the first failing point is where it acts, far beyond the engine's calibrated rounding."""
    if bug == "qkv-bias-dropped":
        candidate = _biases_zeroed(gguf_file(family, "Q8_0"), tmp_path / "twin.gguf")
    else:
        candidate = gguf_file(family, "Q8_0", bug)
    result, report = _check(checkpoint(family), candidate, tmp_path / "r.json", "--same-weights", "--calibrate")
    assert result.exit_code == 1, result.output
    assert report["reference"]["arithmetic"]["matmuls"]  # judged against the emulating reference
    divergence = report["first_divergence"]
    assert divergence["point"] == first
    point = next(p for p in report["points"] if p["name"] == first)
    assert point["rel_l2"] > 10 * point["tolerance"]["rel_l2"], point
    warned = bug != "rope-theta-wrong"  # a tensor that is not the checkpoint's, kept out of the reference
    assert any("not a quantization of the checkpoint's" in w for w in report["warnings"]) == warned
    # named since the candidate's embeddings are read (llama.cpp's "embd"): the diagnosis replays layer 0 from them
    assert report["diagnosis"][0]["bug"] == bug, report["diagnosis"]


def test_a_tensor_quantized_from_other_weights_is_not_taken_for_the_checkpoints(checkpoint, gguf_file, tmp_path):
    """Every attn_v quantized from weights 5% away (a file made from another revision of the checkpoint): within
    Q4_0's band (0.3; its own quantization costs 9%), so only re-quantizing the checkpoint's tensor tells it
    apart. The reference keeps the checkpoint's own v, and the check fails where v acts, with the tensors named."""
    twin = write_twin(gguf_file("llama", "Q4_0"), tmp_path / "twin.gguf", "v-from-another-revision")
    result, report = _check(checkpoint("llama"), twin, tmp_path / "r.json", "--same-weights", "--calibrate")
    assert result.exit_code == 1, result.output
    held = report["reference"]["same_weights"]
    v = {name for name in held["not_a_quantization"]}
    assert v == {f"model.layers.{i}.self_attn.v_proj.weight" for i in range(2)}, held["not_a_quantization"]
    assert all(0.05 < held["not_a_quantization"][name] < BANDS["Q4_0"] for name in v)  # inside the band
    assert all(held["blocks_not_requantized"][name] > 0.9 for name in v)
    assert held["requantized"]["Q4_0"] == held["types"]["Q4_0"] - 2
    assert report["first_divergence"]["point"] == "layers.0.attn_out"
    assert any("not the checkpoint's quantized again" in w for w in report["warnings"]), report["warnings"]


# --------------------------------------------------------------------------- 4. nothing to emulate in an F32 file

def test_an_f32_file_has_no_arithmetic_and_passes(checkpoint, gguf_file, tmp_path):
    """llama.cpp computes an F32 Llama in float32 throughout: the same-weights reference emulates nothing, runs
    no plain reference beside it, and passes at float32's default tolerance."""
    result, report = _check(checkpoint("llama"), gguf_file("llama", "F32"), tmp_path / "r.json", "--same-weights")
    assert result.exit_code == 0, result.output
    assert "arithmetic" not in report["reference"]
    assert report["reference"]["same_weights"]["types"] == {"F32": report["reference"]["same_weights"]["tensors"]}
    compared = [p for p in report["points"] if p["compared"]]
    assert compared and all(p["passed"] and p.get("rel_l2_plain") is None for p in compared)
    assert "against_plain" not in report["logits"]


def test_an_f32_gemma_emulates_only_the_gelu_table(checkpoint, gguf_file, tmp_path):
    """An F32 Gemma still reads GELU from ggml's f16 table: that alone is emulated, and the file passes at
    float32's default tolerance without test_gguf's 1e-3 for the table (measured: 5.6e-5 at most, the plain
    reference 5.0e-4)."""
    result, report = _check(checkpoint("gemma"), gguf_file("gemma", "F32"), tmp_path / "r.json", "--same-weights")
    assert result.exit_code == 0, result.output
    assert report["reference"]["arithmetic"]["gelu"] == "f16 table"
    assert set(report["reference"]["arithmetic"]["matmuls"]) == {"F32 x F32"}
    compared = [p for p in report["points"] if p["compared"]]
    assert max(p["rel_l2"] for p in compared) < max(p.get("rel_l2_plain") or 0.0 for p in compared) / 5
