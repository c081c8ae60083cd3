"""The executor's operation-level points (docs/ops.md) against transformers' (the adapters' [ops], parity.reference.capture):
the same ops per layer, in the same layouts, within float32 noise; q/k rows back in the source's order when the
conversion restyled RoPE; nothing extra when ops are off."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity import names
from parity.checkpoint import open_checkpoint
from parity.neutral.converter import convert
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load
from parity.reference.capture import run_and_capture
from tests.conftest import FAMILIES

# long enough to cross every tiny checkpoint's sliding window (8 or 16) and RoPE scaling threshold
PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(48)]])


def rel_l2(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    c, r = candidate.double(), reference.double()
    return ((c - r).norm() / r.norm()).item()


def reference_ops(path) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(path)
    model = getattr(transformers, ckpt.variant.architectures[0]).from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()
    points = run_and_capture(model, ckpt.resolved.capture + ckpt.resolved.ops, input_ids=PROMPT)
    return {name: t for name, t in points.items() if names.is_op(name)}


def executor_points(path, source_rope_style=None, **call) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    model = NeutralModel(*load(path), dtype=torch.float32, source_rope_style=source_rope_style)
    model(PROMPT, on_point=lambda n, t: got.setdefault(n, t.clone()), **call)
    return got


def by_layer(points) -> dict[int, set[str]]:
    layers: dict[int, set[str]] = {}
    for name in points:
        layers.setdefault(names.layer_of(name), set()).add(name.split(".", 2)[2])
    return layers


def assert_ops_match(family: str, got: dict, reference: dict) -> float:
    """Same op names per layer, same shapes, rel_l2 < 1e-5 at each; returns the worst."""
    # the executor emits every op; an adapter may read fewer from transformers (GPT-OSS: no scores, no probs)
    ops = {name: t for name, t in got.items() if names.is_op(name) and name in reference}
    assert by_layer(ops) == by_layer(reference), family
    for name, t in reference.items():
        assert ops[name].shape == t.shape, f"{family} {name}: {tuple(ops[name].shape)} vs {tuple(t.shape)}"
    errors = {name: rel_l2(ops[name], t) for name, t in reference.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{family}: {worst} rel_l2 {errors[worst]:.3g}"
    return errors[worst]


def source_style(path) -> str | None:
    style = open_checkpoint(path).resolved["positions.rope_style"]
    return style if style in ("half", "interleaved") else None


@pytest.mark.parametrize("family", FAMILIES)
def test_executor_ops_match_transformers_in_float32(family, tiny_dir, neutral_dir):
    reference = reference_ops(tiny_dir(family))
    assert reference, f"{family}: the adapter maps no ops"
    got = executor_points(neutral_dir(family), source_style(tiny_dir(family)), ops=True)
    assert_ops_match(family, got, reference)
    # ops sit in forward order among the layer points, as the executor emits them
    assert list(got) == sorted(got, key=names.point_order)


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma4", "deepseek_v3"])
def test_a_restyled_conversion_emits_the_source_row_order(family, tiny_dir, tmp_path):
    """--rope-style permutes q/k rows within each head (MLA: the rotated part of q and of the compressed KV; Gemma 4's
    k_eq_v layers: the values and the merged heads too); the ops put them back, so they still match transformers."""
    source = source_style(tiny_dir(family))
    other = "interleaved" if source == "half" else "half"
    convert(tiny_dir(family), tmp_path / "n", rope_style=other)
    reference = reference_ops(tiny_dir(family))
    assert_ops_match(family, executor_points(tmp_path / "n", source, ops=True), reference)
    # told the source has the stored style, the rows stay as stored: permuted, so q no longer matches
    unrestored = executor_points(tmp_path / "n", other, ops=True)
    assert rel_l2(unrestored["layers.0.attn.q"], reference["layers.0.attn.q"]) > 1e-2


@pytest.mark.parametrize("family", ["llama", "gemma4", "deepseek_v3", "gpt2"])
def test_ops_off_emits_the_layer_points_only(family, neutral_dir):
    path = neutral_dir(family)
    off = executor_points(path)
    assert list(off) == load(path)[0].capture_points
    on = executor_points(path, ops=True)
    assert [n for n in on if not names.is_op(n)] == list(off)
    for name, t in off.items():  # emitting ops changes nothing it computes
        assert torch.equal(on[name], t), name


def test_a_decode_step_scores_every_cached_key(neutral_dir):
    manifest, tensors = load(neutral_dir("llama"))
    model = NeutralModel(manifest, tensors, torch.float32)
    cache = model.new_cache()
    model(PROMPT[:, :10], cache=cache)
    got: dict[str, torch.Tensor] = {}
    model(PROMPT[:, 10:11], on_point=lambda n, t: got.setdefault(n, t.clone()), cache=cache, ops=True)
    heads = manifest.layers[0].attention.heads
    assert got["layers.0.attn.scores"].shape == (1, 1, heads * 11)
    assert got["layers.0.attn.probs"].sum().item() == pytest.approx(heads)
    assert got["layers.0.attn.k_rope"].shape[1] == 1  # this step's key only
