"""GPT-2's other on-disk forms (GPT2Model, hub checkpoints without the `transformer.` prefix and
with attn.bias / attn.masked_bias buffers, an untied head) against the adapter, converted and
run by the executor against transformers (Conv1D transpose, c_attn split, per-layer scale)."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from parity.checkpoint import check_tensors, open_checkpoint
from parity.neutral.converter import convert
from parity.neutral.executor.model import NeutralModel
from parity.reference.capture import run_and_capture
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS

PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(40)]])


def _save(path, arch, **extra):
    build_model(ADAPTERS["gpt2"], architecture=arch, overrides=extra).save_pretrained(path)
    return path


def _hub_style(path):
    """Like openai-community/gpt2: saved from GPT2Model (no prefix), with the old mask buffers."""
    sd = {k.removeprefix("transformer."): v for k, v in load_file(path / "model.safetensors").items()}
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


BUFFERS = [f"h.{i}.attn.{b}" for i in range(2) for b in ("bias", "masked_bias")]
CASES = {
    "GPT2LMHeadModel": ("GPT2LMHeadModel", {}, None, "transformer.", []),
    "GPT2Model": ("GPT2Model", {}, None, "", []),
    "hub": ("GPT2LMHeadModel", {}, _hub_style, "", BUFFERS),
    "untied-unscaled": ("GPT2LMHeadModel", {"tie_word_embeddings": False, "scale_attn_weights": False,
                                            "scale_attn_by_inverse_layer_idx": False}, None, "transformer.", []),
}


@pytest.mark.parametrize("case", CASES)
def test_gpt2_on_disk_form(case, tmp_path):
    arch, extra, mutate, prefix, buffers = CASES[case]
    path = _save(tmp_path / case, arch, **extra)
    if mutate:
        mutate(path)
    ckpt = open_checkpoint(path)
    assert ckpt.adapter.family == "gpt2" and ckpt.variant.architectures == [arch]
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    assert check.prefix == prefix and sorted(check.buffers) == sorted(buffers) and not check.ignored
    r = ckpt.resolved
    names = {c.name for c in r.capture}
    assert ("logits" in names) == (arch != "GPT2Model") and "final_norm" in names

    model = getattr(transformers, arch).from_pretrained(path, attn_implementation="eager").eval()
    ref = run_and_capture(model, r.capture, input_ids=PROMPT)
    convert(path, tmp_path / f"{case}.neutral")  # the converter's transforms, run by the executor
    ours: dict = {}
    NeutralModel.load(tmp_path / f"{case}.neutral")(PROMPT, on_point=lambda n, t: ours.setdefault(n, t))
    assert set(ours) == set(ref)
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-4, msg=name)


def test_gpt2_attention_scale_per_layer():
    from parity.adapter import resolve

    a = ADAPTERS["gpt2"]
    base = {"n_layer": 3, "n_embd": 64, "n_head": 4, "vocab_size": 256}
    r = resolve(a, a.spec.variants[0], base)
    assert r["attention.scale"] == [0.25] * 3
    r = resolve(a, a.spec.variants[0], {**base, "scale_attn_by_inverse_layer_idx": True})
    assert r["attention.scale"] == [0.25, 0.125, 0.25 / 3]
    r = resolve(a, a.spec.variants[0], {**base, "scale_attn_weights": False})
    assert r["attention.scale"] == [1.0] * 3
