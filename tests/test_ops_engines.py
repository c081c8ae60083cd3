"""Operation-level points (docs/ops.md) from the engine kinds that run a graph or a model of their own: ONNX
(parity's own export with its ops as outputs; a torch.onnx export of transformers' model, its ops found by module
path and by its attention's Softmax: parity.engines.graph_ops), OpenVINO (transformers' model converted by
openvino.convert_model: module paths, and the inputs of its ScaledDotProductAttention) and mlx-lm (its modules
wrapped; q_rope and k_rope from the queries and keys it hands scaled_dot_product_attention).

On the tiny llama and qwen3 (QK-Norm), `check --points ops` compares every op an engine gives against transformers'
at float32 noise, and names the ones it cannot give (OpenVINO and mlx-lm: scores and probabilities, inside a fused
attention op). A copy of the tiny llama with one KV head's k-projection rows scaled by 1.1 in layer 1, converted by
each engine, fails, and the drill-down names layers.1.attn.k and kv head 1.

Measured rel_l2 of the ops (worst over the ops of both layers, the default prompt): parity's ONNX export llama
7.9e-07, qwen3 5.7e-07 (torch.onnx's exports of qwen3 and gemma3 give every op too, at 6.7e-07 at most); OpenVINO
llama 8.4e-07, qwen3 5.1e-07; mlx-lm llama 1.1e-06, qwen3 1.1e-06 (mlp.act, the largest everywhere).
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity import names
from parity.checkpoint import open_checkpoint
from parity.cli import cli

FAMILIES = ("llama", "qwen3")
FLOAT32 = 1e-5
LAYER, DH = 1, 16  # the edited layer; the tiny llama's head_dim
FUSED = {"attn.scores", "attn.probs"}  # inside OpenVINO's and mlx-lm's fused attention


@pytest.fixture(scope="module", autouse=True)
def engine_cache(tmp_path_factory):
    """The engines' conversions go to a cache of this module's own (each made once)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PARITY_CACHE", str(tmp_path_factory.mktemp("parity-cache")))
        yield


def _edited(source: Path, out: Path) -> Path:
    """A copy of ``source`` whose layer-1 k-projection rows of KV head 1 are scaled by 1.1."""
    if not out.exists():
        shutil.copytree(source, out)
        tensors = load_file(out / "model.safetensors")
        tensors[f"model.layers.{LAYER}.self_attn.k_proj.weight"][DH:2 * DH] *= 1.1
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _check(reference, candidate, report: Path, *extra):
    result = CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(candidate),
                                      "--report", str(report), *map(str, extra)], catch_exceptions=False)
    return result, (json.loads(report.read_text()) if report.is_file() else None)


def _every_op_passes(reference: Path, candidate: str, tmp_path: Path, absent=frozenset()) -> dict[str, float]:
    """`check --points ops`: passes; every op of the reference's adapter is compared, those in ``absent`` (without
    the layer) not and named in a warning; returns the worst rel_l2 per op."""
    result, report = _check(reference, candidate, tmp_path / "r.json", "--points", "ops")
    assert result.exit_code == 0, result.output
    points = {p["name"]: p for p in report["points"]}
    expected = [c.name for c in open_checkpoint(reference).resolved.ops]
    assert expected and all(n in points for n in expected)
    worst: dict[str, float] = {}
    for name in expected:
        op, p = name.split(".", 2)[2], points[name]
        assert p["compared"] == (op not in absent), (name, p)
        if p["compared"]:
            assert p["passed"] and p["rel_l2"] < FLOAT32, (name, p["rel_l2"])
            worst[op] = max(worst.get(op, 0.0), p["rel_l2"])
    if absent:
        assert any(all(op in w for op in absent) for w in report["warnings"]), report["warnings"]
    assert all(p["compared"] for n, p in points.items() if not names.is_op(n))
    print(candidate, {op: f"{v:.1e}" for op, v in worst.items()})
    return worst


def _k_head_located(reference: Path, candidate: str, tmp_path: Path) -> dict:
    """A plain layerwise check of the edited copy fails at layer 1; its drill-down names attn.k and kv head 1, every
    op before it agreeing."""
    result, report = _check(reference, candidate, tmp_path / "r.json", "--layerwise")
    assert result.exit_code == 1, result.output
    first = report["first_divergence"]
    assert first["op"] == f"layers.{LAYER}.attn.k", (first, report["drilldown"]["summary"])
    assert first["head"] is not None and (first["head"]["axis"], first["head"]["index"]) == ("kv head", 1)
    drill = report["drilldown"]
    assert drill["layer"] == LAYER and drill["fed"] == "own"
    ordered = [p["name"] for p in drill["ops"]]
    assert all(p["passed"] for p in drill["ops"][:ordered.index(first["op"])] if p["compared"])
    assert {f"layers.{LAYER}.attn.q", f"layers.{LAYER}.attn.v"} <= {p["name"] for p in drill["ops"] if p["compared"]}
    return drill


# --------------------------------------------------------------------------------------------
# ONNX


@pytest.fixture(scope="module")
def onnx_files(tiny_dir, tmp_path_factory):
    """onnx_files(name): parity's exports of the tiny llama and qwen3 with op outputs ("llama", "qwen3"), and
    torch.onnx's export of the edited llama ("llama-k"), made two at a time in worker processes."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from parity.engines.onnx.export import export
    from tests.onnx_helpers import export_foreign

    root = tmp_path_factory.mktemp("ops-onnx")
    sources = {f: tiny_dir(f) for f in FAMILIES}
    edited = _edited(sources["llama"], root / "llama-k")
    pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    jobs = {f: pool.submit(export, sources[f], root / f"{f}.onnx", debug_outputs=True, op_outputs=True)
            for f in FAMILIES}
    jobs["llama-k"] = pool.submit(export_foreign, str(edited), str(root / "llama-k.onnx"))
    yield lambda name: (jobs[name].result(), root / f"{name}.onnx")[1]
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_export_gives_every_op(family, tiny_dir, onnx_files, tmp_path):
    import onnx

    path = onnx_files(family)
    outputs = [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]
    assert {c.name for c in open_checkpoint(tiny_dir(family)).resolved.ops} <= {o for o in outputs if names.is_op(o)}
    _every_op_passes(tiny_dir(family), path, tmp_path)


def test_onnx_torch_export_located_by_module_paths_and_softmax(tiny_dir, onnx_files, tmp_path):
    """torch.onnx's graph of transformers' model: q, k, v, context, gate, up, act by module path; q_rope, k_rope,
    scores and probabilities from the Softmax of each self_attn (and the matmul before it)."""
    drill = _k_head_located(tiny_dir("llama"), onnx_files("llama-k"), tmp_path)
    compared = {p["name"].split(".", 2)[2] for p in drill["ops"] if p["compared"]}
    assert {"attn.q_rope", "attn.k_rope", "attn.scores", "attn.probs", "attn.context", "mlp.act"} <= compared


# --------------------------------------------------------------------------------------------
# OpenVINO


@pytest.mark.parametrize("family", FAMILIES)
def test_openvino_gives_every_op_but_the_fused_attentions(family, tiny_dir, tmp_path):
    pytest.importorskip("openvino")
    _every_op_passes(tiny_dir(family), f"openvino:{tiny_dir(family)}", tmp_path, absent=FUSED)


def test_openvino_k_head_located(tiny_dir, tmp_path_factory, tmp_path):
    pytest.importorskip("openvino")
    edited = _edited(tiny_dir("llama"), tmp_path_factory.mktemp("ops-ov") / "llama-k")
    _k_head_located(tiny_dir("llama"), f"openvino:{edited}", tmp_path)


# --------------------------------------------------------------------------------------------
# mlx-lm


@pytest.fixture(scope="module")
def mlx_tiny(tmp_path_factory):
    """mlx_tiny(family): the tiny checkpoint configured as released models are (tests/test_mlx.py: what mlx-lm
    implements), "llama-k" the edited llama."""
    pytest.importorskip("mlx_lm")
    from tests.test_mlx import write_tiny

    root = tmp_path_factory.mktemp("ops-mlx")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = (_edited(get("llama"), root / name) if name == "llama-k" else write_tiny(name, root / name))
        return made[name]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_gives_every_op_but_the_fused_attentions(family, mlx_tiny, tmp_path):
    _every_op_passes(mlx_tiny(family), f"mlx:{mlx_tiny(family)}", tmp_path, absent=FUSED)


def test_mlx_k_head_located(mlx_tiny, tmp_path):
    _k_head_located(mlx_tiny("llama"), f"mlx:{mlx_tiny('llama-k')}", tmp_path)
