"""Dumps from tensor-parallel runs: a directory of rank dumps, merged by the shard layout each rank declares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

import parity
from parity.candidates import detect
from parity.checker.record import record
from parity.cli import cli

DECODE = 4
# as a Megatron-style llama splits it: o_proj and down_proj are row-parallel (partial sums before the all-reduce),
# the LM head column-parallel (a vocabulary slice per rank); one hidden point split by columns too, to cover widths
LAYOUT = {"layers.0.attn_out": "row", "layers.1.attn_out": "row", "layers.0.mlp_out": "row",
          "layers.1.mlp_out": "row", "logits": "column", "layers.1.mlp_in": "column"}


@pytest.fixture(scope="module")
def golden(tiny_dir, tmp_path_factory):
    """A golden of the tiny llama (every point, float32, 4 decode steps): transformers' activations in dump format."""
    root = tmp_path_factory.mktemp("tp")
    record(tiny_dir("llama"), root / "golden", points="all", decode=DECODE)
    with safe_open(root / "golden" / "activations.safetensors", "pt") as handle:
        points = {name: handle.get_tensor(name) for name in handle.keys()}
        metadata = handle.metadata()
    return {"reference": tiny_dir("llama"), "golden": root / "golden", "points": points, "metadata": metadata}


def split(golden: dict, out: Path, size: int, layout: dict = LAYOUT, change=None) -> Path:
    """Write the golden's points as ``size`` ranks would: column slices, row partial sums, replicated copies.
    ``change(ranks)`` breaks the ranks' tensors before they are written."""
    gen = torch.Generator().manual_seed(size)
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, t in golden["points"].items():
        shard = layout.get(name, layout.get(name.removeprefix("decode."), "replicated"))
        if shard == "column":
            parts = [p.contiguous() for p in torch.tensor_split(t, size, dim=-1)]
        elif shard == "row":
            noise = [torch.randn(t.shape, generator=gen) * t.std() for _ in range(size - 1)]
            parts = noise + [t - sum(noise)]
        else:
            parts = [t.clone() for _ in range(size)]
        for rank, part in zip(ranks, parts):
            rank[name] = part
    if change is not None:
        change(ranks)
    out.mkdir(parents=True, exist_ok=True)
    for r, tensors in enumerate(ranks):
        metadata = {**golden["metadata"], "tp_rank": str(r), "tp_size": str(size), "tp_layout": json.dumps(layout)}
        save_file(tensors, out / f"rank{r}.safetensors", metadata=metadata)
    return out


def check(reference, candidate, *extra):
    return CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(candidate),
                                    "--layerwise", *map(str, extra)])


@pytest.mark.parametrize("size", [2, 4])
def test_rank_dumps_merge_to_the_reference(golden, tmp_path, size):
    ranks = split(golden, tmp_path / "ranks", size)
    assert detect(ranks) == "dump"
    report = parity.check(golden["golden"], ranks, layerwise=True, decode=DECODE)
    assert report.verdict == "pass" and report.candidate["kind"] == "dump"
    prefill = [p for p in report.points if p.step is None]
    steps = [p for p in report.points if p.step is not None]
    assert len(prefill) == 15 and all(p.compared for p in prefill)
    assert len(steps) == 15 * DECODE and all(p.compared for p in steps)
    # column slices are exact, row partial sums add back to float32 rounding
    assert max(p.rel_l2 for p in report.points) < 1e-5
    assert max(p.rel_l2 for p in report.points if p.name in ("logits", "layers.1.mlp_in")) == 0.0


def test_rank_dumps_check_against_the_live_reference(golden, tmp_path):
    ranks = split(golden, tmp_path / "ranks", 2)
    result = check(golden["reference"], ranks, "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["points"]) == 15 and all(p["compared"] and p["passed"] for p in data["points"])


def _scale_row_shard(ranks):
    ranks[1]["layers.1.mlp_out"] = ranks[1]["layers.1.mlp_out"] * 1.5


def _swap_vocab_slices(ranks):
    ranks[0]["logits"], ranks[1]["logits"] = ranks[1]["logits"], ranks[0]["logits"]


@pytest.mark.parametrize("change, first", [(_scale_row_shard, "layers.1.mlp_out"), (_swap_vocab_slices, "logits")])
def test_a_broken_rank_fails_at_its_point(golden, tmp_path, change, first):
    ranks = split(golden, tmp_path / "ranks", 4, change=change)
    result = check(golden["golden"], ranks, "--report", tmp_path / "r.json")
    assert result.exit_code == 1, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["first_divergence"]["point"] == first and data["first_divergence"]["rel_l2"] > 0.1


def test_a_broken_rank_in_the_decode_steps_fails_at_its_step(golden, tmp_path):
    def scale_step_3(ranks):
        ranks[2]["decode.layers.0.attn_out"][:, 2] *= 1.5

    report = parity.check(golden["golden"], split(golden, tmp_path / "ranks", 4, change=scale_step_3),
                          layerwise=True, decode=DECODE)
    assert report.verdict == "fail"
    first = report.first_divergence
    assert (first.step, first.name) == (3, "layers.0.attn_out") and first.rel_l2 > 0.1
    assert report.decode["first_divergence"]["step"] == 3


def _retag(ranks_dir: Path, rank: int, **metadata):
    path = ranks_dir / f"rank{rank}.safetensors"
    with safe_open(path, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        meta = {**handle.metadata(), **metadata}
    save_file(tensors, path, metadata=meta)


def _drift_replica(ranks):
    ranks[1]["layers.0.out"] = ranks[1]["layers.0.out"] * 1.01


def _narrow_shard(ranks):
    ranks[1]["logits"] = ranks[1]["logits"][..., 1:].contiguous()


def test_inconsistent_ranks_exit_2_with_one_line(golden, tmp_path):
    def refused(ranks, message, *extra):
        result = check(golden["golden"], ranks, *extra)
        assert result.exit_code == 2 and message in result.stderr, (message, result.output)
        assert len(result.stderr.strip().splitlines()) == 1

    missing = split(golden, tmp_path / "missing", 4)
    (missing / "rank2.safetensors").unlink()
    refused(missing, "tp_size is 4 but missing rank2.safetensors")
    sizes = split(golden, tmp_path / "sizes", 2)
    _retag(sizes, 1, tp_size="4")
    refused(sizes, "the ranks disagree on tp_size (rank0 says 2, rank1 says 4)")
    misnamed = split(golden, tmp_path / "misnamed", 2)
    _retag(misnamed, 1, tp_rank="0")
    refused(misnamed, "rank1.safetensors says tp_rank 0")
    ids = split(golden, tmp_path / "ids", 2)
    _retag(ids, 1, input_ids=json.dumps(json.loads(golden["metadata"]["input_ids"])[:-1]))
    refused(ids, "differ in their 'input_ids' metadata")
    layout = split(golden, tmp_path / "layout", 2)
    _retag(layout, 0, tp_layout=json.dumps({"logits": "vocab"}))
    refused(layout, "'tp_layout' must be a JSON object of point -> one of replicated, column, row")
    refused(split(golden, tmp_path / "drift", 2, change=_drift_replica),
            "layers.0.out is declared replicated but rank1 differs from rank0 (rel_l2 1.00e-02 > 0.001)")
    seq = len(json.loads(golden["metadata"]["input_ids"]))
    refused(split(golden, tmp_path / "narrow", 2, change=_narrow_shard),
            f"logits has shape [1, {seq}, 255], expected [batch=1, seq={seq}, vocab=256] for these ids and this llama "
            f"model (merged from 2 column shards, widths 128+127)")
    refused(split(golden, tmp_path / "typo", 2, layout={**LAYOUT, "layers.9.out": "row"}),
            "'tp_layout' names layers.9.out, which no rank holds")
