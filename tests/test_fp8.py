"""FP8 block-scaled checkpoints (DeepSeek-V3/R1, Qwen3-FP8): inspected, dequantized by convert tensor by
tensor, and checked layerwise against transformers running the same FP8 checkpoint (its own CPU
dequantization) and against the checkpoint's dequantized twin."""

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
from parity.storage.quantization import dequantize, scale_shape
from tests.conftest import ADAPTERS
from tests.fp8 import dequantized_twin, expand, quantize

BLOCK = (8, 16)  # not square, so that a transposed block grid cannot pass


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    source = make_tiny(ADAPTERS["deepseek_v3"], root / "source")
    exact = quantize(source, root / "fp8", BLOCK)
    twin = dequantized_twin(root / "fp8", root / "twin", exact)
    return root / "fp8", twin, exact


def test_dequantize_is_the_blockwise_product_with_partial_blocks():
    torch.manual_seed(0)
    q = (torch.randn(40, 50) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(*scale_shape((40, 50), (16, 16))) + 0.01
    assert scale.shape == (3, 4)  # 40 rows: blocks of 16, 16 and 8; 50 columns: 16, 16, 16, 2
    want = q.float() * expand(scale, q.shape, (16, 16))
    assert torch.equal(dequantize(q, scale, (16, 16)), want)
    assert dequantize(q, scale, (16, 16), torch.bfloat16).dtype == torch.bfloat16


def test_inspect_reports_the_quantization_and_accounts_for_every_scale(deepseek_fp8):
    path, _, exact = deepseek_fp8
    data = report(open_checkpoint(path)).to_json()
    w = data["weights"]
    assert w["accounted_for"], w
    assert w["scales"] == len(exact) == 72 and w["dtypes"]["F8_E4M3"] == 72
    assert data["quantization"] == {"method": "fp8", "format": "e4m3", "block": [8, 16],
                                    "activation_scheme": "dynamic"}
    assert "fp8 e4m3, 8x16 blocks; 72 weights" in " ".join(_cli("inspect", path).output.split())


def test_a_scale_grid_that_does_not_fit_the_block_is_refused(deepseek_fp8, tmp_path):
    path, _, _ = deepseek_fp8
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [16, 8]  # transposed
    (bad / "config.json").write_text(json.dumps(config))
    w = report(open_checkpoint(bad)).to_json()["weights"]
    assert not w["accounted_for"] and any("weight_scale_inv" in x and "16x8 blocks" in x for x in w["wrong_shape"])
    result = CliRunner().invoke(cli, ["convert", str(bad), "--to", "neutral", "-o", str(tmp_path / "n")])
    assert result.exit_code == 2 and "wrong shape" in result.stderr and not (tmp_path / "n").exists()


def test_other_quantizations_are_refused_with_a_fix(deepseek_fp8, tmp_path):
    path, _, _ = deepseek_fp8
    bad = tmp_path / "gptq"
    bad.mkdir()
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["inspect", str(bad)])
    assert result.exit_code == 2 and "'gptq' is not one parity reads" in result.stderr


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
def test_fp8_converts_and_passes_layerwise_against_transformers(deepseek_fp8, tmp_path, stream):
    """--no-stream: the reference is transformers' own FP8 loading (it dequantizes on a CPU); --stream: parity
    dequantizes each layer's weights as it loads them into transformers' modules."""
    path, _, _ = deepseek_fp8
    assert _cli("convert", path, "--to", "neutral", "-o", tmp_path / "n", "--dtype", "float32").exit_code == 0
    result = _cli("check", "--reference", path, "--candidate", tmp_path / "n", "--layerwise", stream,
                  "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert all(p["passed"] for p in data["points"]) and len(data["points"]) == 21
    ref, cand = data["reference"]["quantization"], data["candidate"]["quantization"]
    assert ref["dequantized_by"] == ("transformers" if stream == "--no-stream" else "parity, a layer at a time")
    assert cand["dequantized"] == 72 and cand["dtype"] == "float32"
    assert cand["rel_l2_max"] == 0 and cand["worst"] is None  # written as dequantized: fp8 * scale in float32
    assert "72 weights dequantized to float32" in " ".join(result.output.split())


def test_dequantization_error_at_bfloat16_is_stated(deepseek_fp8, tmp_path):
    path, _, exact = deepseek_fp8
    manifest_path = tmp_path / "n" / "manifest.json"
    assert _cli("convert", path, "--to", "neutral", "-o", tmp_path / "n", "--dtype", "bfloat16").exit_code == 0
    q = json.loads(manifest_path.read_text())["source"]["quantization"]
    assert q["dtype"] == "bfloat16" and q["dequantized"] == 72
    # bf16 keeps 8 significant bits: a rounding error near 2 ** -9 relative (rel_l2 a little under)
    assert 5e-4 < q["rel_l2_mean"] <= q["rel_l2_max"] < 3e-3
    # and it is the rounding actually written: recompute the worst tensor's
    written = {}
    for shard in (tmp_path / "n").glob("*.safetensors"):
        written.update(load_file(shard))
    name = q["worst"]
    neutral = {hf: t.neutral for hf, t in open_checkpoint(path).resolved.tensor_map("model.").items()}
    assert len(neutral[name]) == 1  # DeepSeek's per-expert linears convert one to one
    got = written[neutral[name][0]].double()
    want = exact[name].float().double()  # the float32 dequantization (fp8 * scale, correctly rounded) it rounds
    assert float((got - want).norm() / want.norm()) == pytest.approx(q["rel_l2_max"], rel=1e-6)


def test_fp8_candidate_passes_against_its_dequantized_twin(deepseek_fp8, tmp_path):
    """transformers running the exact dequantized weights as plain float32 agrees with parity's dequantization."""
    path, twin, _ = deepseek_fp8
    assert _cli("convert", path, "--to", "neutral", "-o", tmp_path / "n", "--dtype", "float32").exit_code == 0
    result = _cli("check", "--reference", twin, "--candidate", tmp_path / "n", "--layerwise")
    assert result.exit_code == 0, result.output


def test_a_wrong_block_scale_fails_at_its_layer(deepseek_fp8, tmp_path):
    """One scale of layer 1's kv_b_proj doubled in the candidate's source: the check against the true FP8
    reference fails where that weight is first used."""
    path, _, _ = deepseek_fp8
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    sd = load_file(broken / "model.safetensors")
    sd["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"][0, 0] *= 2
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    assert _cli("convert", broken, "--to", "neutral", "-o", tmp_path / "n", "--dtype", "float32").exit_code == 0
    result = _cli("check", "--reference", path, "--candidate", tmp_path / "n", "--layerwise", "--report",
                  tmp_path / "r.json")
    assert result.exit_code == 1
    assert json.loads((tmp_path / "r.json").read_text())["first_divergence"]["point"] == "layers.1.attn_out"


def test_qwen3_fp8_converts_and_passes(tmp_path):
    """Qwen3-FP8 is saved the same way (128x128 blocks there; 16x16 here)."""
    source = make_tiny(ADAPTERS["qwen3"], tmp_path / "source")
    exact = quantize(source, tmp_path / "fp8", (16, 16))
    assert exact
    assert report(open_checkpoint(tmp_path / "fp8")).to_json()["weights"]["accounted_for"]
    assert _cli("convert", tmp_path / "fp8", "--to", "neutral", "-o", tmp_path / "n").exit_code == 0
    result = _cli("check", "--reference", tmp_path / "fp8", "--candidate", tmp_path / "n", "--layerwise")
    assert result.exit_code == 0, result.output
