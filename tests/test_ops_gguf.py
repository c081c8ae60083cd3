"""Operation-level points (docs/ops.md) out of llama.cpp's graph (parity.engines.gguf.ops): on tiny float32 GGUFs written by
`parity convert --to gguf`, every op llama.cpp exposes matches transformers' (the adapter's [ops], parity.reference.capture)
at float32 noise, in the layout docs/ops.md gives; q/k rows that llama.cpp's "llama" kernel wants permuted come back
in the checkpoint's order, so that a file whose rows were not permuted diverges at attn.q.

Measured rel_l2 (20 tokens, worst over the layers): llama 8.6e-07, qwen2 7.4e-07, qwen3 7.8e-07; gemma2 and gemma3
3.5e-07 at most in layer 0 up to its mlp.act, where llama.cpp's CPU GELU reads an f16 table (see tests/test_gguf.py):
3.1e-04 / 3.4e-04 there, and that error flows on (5.0e-04 / 5.8e-04 at most in the layers after). The MoE families
(their router's logits, ffn_moe_logits, as mlp.router): mixtral 7.5e-07, olmoe 5.9e-07, qwen2_moe 6.9e-07, qwen3_moe
8.9e-07. stablelm 7.4e-07; phi and gpt_neox 3.1e-07 at most in layer 0 up to its mlp.act, where the GELU table
(gpt_neox: with llama.cpp's tanh form for the exact GELU) gives 3.6e-04 / 4.6e-04 at most, flowing on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity import names
from parity.cli import cli
from tests.conftest import ADAPTERS

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

# the released configurations (tests/test_gguf.py's RELEASED): what llama.cpp implements
RELEASED = {"llama": {}, "qwen2": {"use_sliding_window": False, "rope_scaling": None},
            "qwen3": {"use_sliding_window": False, "rope_scaling": None, "attention_bias": False},
            "gemma2": {"attention_bias": False, "query_pre_attn_scalar": 16},
            "gemma3": {"attention_bias": False, "query_pre_attn_scalar": 16, "rope_scaling": None},
            # no window (llama.cpp's phi3 ignores one), and LongRoPE's long factors from 8 tokens on: llama.cpp takes
            # them for any context it allocates past the original length (tests/test_gguf.py)
            "cohere2": {}, "phi3": {"sliding_window": None, "original_max_position_embeddings": 8},
            "qwen2_moe": {"use_sliding_window": False, "rope_scaling": None, "norm_topk_prob": False,
                          "mlp_only_layers": []},
            "qwen3_moe": {"use_sliding_window": False, "rope_scaling": None, "attention_bias": False,
                          "mlp_only_layers": []},
            "olmoe": {"attention_bias": False, "num_key_value_heads": 4}, "mixtral": {"sliding_window": None},
            "gpt_neox": {"rotary_pct": 0.25}, "phi": {"qk_layernorm": False},
            "stablelm": {"use_parallel_residual": False, "partial_rotary_factor": 0.25}}
FAMILIES = sorted(RELEASED)
S = 20  # past the tiny Gemmas' sliding window (8): their sliding layers' masks are exercised
FLOAT32 = 1e-5
GELU_TABLE = 1e-3  # llama.cpp's f16 GELU table: a GELU family's mlp.act, and every op after it
WIDTHS = {"attn.q": "q", "attn.q_norm": "q", "attn.q_rope": "q", "attn.context": "q", "attn.k": "kv",
          "attn.k_norm": "kv", "attn.k_rope": "kv", "attn.v": "kv", "attn.scores": "maps", "attn.probs": "maps"}


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(family): (checkpoint directory, its float32 GGUF), built once."""
    from parity.reference.tiny import build_model

    root = tmp_path_factory.mktemp("ops_gguf")
    done: dict[str, tuple[Path, Path]] = {}

    def get(family: str, adapters: Path | None = None, tag: str = "") -> tuple[Path, Path]:
        key = family + tag
        if key not in done:
            path = root / family
            if not path.exists():
                build_model(ADAPTERS[family], overrides=RELEASED[family]).save_pretrained(path)
            out = root / f"{key}.gguf"
            extra = ("--adapters", adapters) if adapters else ()
            result = _cli("convert", path, "--to", "gguf", "-o", out, *extra)
            assert result.exit_code == 0, result.output
            done[key] = (path, out)
        return done[key]

    return get


def _ids() -> torch.Tensor:
    return torch.randint(1, 200, (1, S), generator=torch.Generator().manual_seed(0))


def _candidate(reference: Path, gguf: Path, ops: bool):
    from parity.candidates import Candidate, Options, get
    from parity.checkpoint import open_checkpoint

    ckpt = open_checkpoint(reference)
    candidate = Candidate(None, gguf, torch.float32, ckpt, Options(ops=ops))
    emitted: dict[str, torch.Tensor] = {}
    get("gguf").make_runner(candidate, _ids(), None)(lambda name, t: emitted.setdefault(name, t))
    return ckpt, candidate, emitted


def _reference(ckpt, path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from parity.reference.capture import run_and_capture

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return run_and_capture(model, ckpt.resolved.ops, input_ids=_ids())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_op_llama_cpp_gives_matches_transformers(family, made):
    reference, gguf = made(family)
    ckpt, candidate, got = _candidate(reference, gguf, ops=True)
    want = _reference(ckpt, reference)
    ops = [n for n in got if names.is_op(n)]
    assert sorted(ops, key=names.point_order) == [c.name for c in ckpt.resolved.ops]  # all of them, nothing else
    assert candidate.notes.warnings == []  # nothing the reference has is missing on llama.cpp's side
    r = ckpt.resolved
    heads, kv_heads, head_dim = r["attention.heads"], r["attention.kv_heads"], r["attention.head_dim"]
    widths = {"q": heads * head_dim, "kv": kv_heads * head_dim, "maps": heads * S}
    gelu = "gelu" in str(ckpt.config.get("hidden_activation") or ckpt.config.get("hidden_act"))
    worst = {}
    for name in ops:
        op = name.split(".", 2)[2]
        if op in WIDTHS:
            assert tuple(got[name].shape) == (1, S, widths[WIDTHS[op]]), name
        assert got[name].shape == want[name].shape, (name, got[name].shape, want[name].shape)
        rel = _rel(got[name], want[name])
        worst[op] = max(worst.get(op, 0.0), rel)
        # a GELU family's error from the first mlp.act on is the table's (it flows into the layers after)
        table = gelu and (op == "mlp.act" or names.layer_of(name) > 0)
        assert rel < (GELU_TABLE if table else FLOAT32), (name, rel)
    print(family, {op: f"{v:.1e}" for op, v in worst.items()})


def test_masked_scores_are_zero_and_the_keys_are_the_prompts(made):
    """llama.cpp's KV cache holds 256 cells: the scores and probabilities are cropped to the S keys attended, the
    causal (and, on a sliding layer, the window's) masked entries emitted as 0."""
    reference, gguf = made("gemma2")
    ckpt, _, got = _candidate(reference, gguf, ops=True)
    window = ckpt.resolved.layer("attention.sliding_window", 0)
    heads = ckpt.resolved["attention.heads"]
    for layer, span in ((0, window), (1, None)):
        scores = got[f"layers.{layer}.attn.scores"].view(S, heads, S)
        probs = got[f"layers.{layer}.attn.probs"].view(S, heads, S)
        query, key = torch.arange(S)[:, None], torch.arange(S)[None, :]
        masked = (key > query) | ((query - key >= span) if span else torch.zeros(S, S, dtype=torch.bool))
        assert masked.any() and (scores[masked.unsqueeze(1).expand_as(scores)] == 0).all()
        assert (probs[masked.unsqueeze(1).expand_as(probs)] == 0).all()
        assert torch.allclose(probs.sum(-1), torch.ones(S, heads), atol=1e-5)


def test_without_ops_no_op_is_emitted(made):
    reference, gguf = made("qwen2")
    _, _, got = _candidate(reference, gguf, ops=False)
    assert got and not [n for n in got if names.is_op(n)]


def test_points_ops_check_passes(made, tmp_path):
    reference, gguf = made("qwen2")
    report = tmp_path / "r.json"
    result = _cli("check", "--reference", reference, "--candidate", gguf, "--points", "ops", "--report", report)
    assert result.exit_code == 0, result.output
    points = {p["name"]: p for p in json.loads(report.read_text())["points"]}
    ops = [n for n in points if names.is_op(n)]
    assert len(ops) == 11 * ADAPTERS["qwen2"].spec.tiny.layers and all(points[n]["compared"] for n in ops)


def test_unpermuted_llama_rows_diverge_at_attn_q(made, tmp_path):
    """A llama file whose q/k rows were left half-split for llama.cpp's adjacent-pair kernel: the drill-down names
    attn.q (the rows put back in the checkpoint's order no longer are its rows), v and the layer's input agree."""
    overrides = tmp_path / "adapters"
    overrides.mkdir()
    toml = ADAPTERS["llama"].path.read_text()
    assert 'rope_style = "interleaved"' in toml
    (overrides / "llama.toml").write_text(toml.replace('rope_style = "interleaved"', 'rope_style = "half"'))
    reference, gguf = made("llama", overrides, tag="-unpermuted")
    report = tmp_path / "r.json"
    result = _cli("check", "--reference", reference, "--candidate", gguf, "--layerwise", "--report", report)
    assert result.exit_code == 1, result.output
    found = json.loads(report.read_text())
    assert found["first_divergence"]["op"] == "layers.0.attn.q"
    drilled = {p["name"]: p for p in found["drilldown"]["ops"]}
    assert drilled["layers.0.attn.v"]["rel_l2"] < FLOAT32 and drilled["layers.0.attn.q"]["rel_l2"] > 0.5


REAL = Path(os.environ.get("PARITY_REAL_QWEN", Path.home() / ".cache/parity-real/qwen2.5-coder-0.5b"))


@pytest.mark.skipif(not (REAL / "model.gguf").is_file() or not (REAL / "hf" / "config.json").is_file(),
                    reason=f"the real Qwen2.5-Coder GGUF is not at {REAL}: run ../shared/models/qwen2.5-coder-0.5b.sh "
                           f"(or set PARITY_REAL_QWEN)")
def test_real_qwen_q4_k_m_gives_every_op(capsys):
    """Opt-in: the real Qwen2.5-Coder-0.5B Q4_K_M file (llama.cpp's own converter) gives every op its reference maps,
    in the reference's shapes; the values are the quantized model's (not compared here)."""
    ckpt, candidate, got = _candidate(REAL / "hf", REAL / "model.gguf", ops=True)
    expected = [c.name for c in ckpt.resolved.ops]
    found = sorted({n.split(".", 2)[2] for n in got if names.is_op(n)})
    with capsys.disabled():
        print(f"\nllama.cpp ops of {REAL.name}: {', '.join(found)} ({len(expected)} over "
              f"{ckpt.resolved.num_layers} layers)")
    assert [n for n in expected if n not in got] == [] and candidate.notes.warnings == []
    heads, head_dim = ckpt.resolved["attention.heads"], ckpt.resolved["attention.head_dim"]
    assert tuple(got["layers.0.attn.q"].shape) == (1, S, heads * head_dim)
    assert tuple(got["layers.0.attn.scores"].shape) == (1, S, heads * S)
