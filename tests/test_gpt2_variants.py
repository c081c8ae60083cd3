"""GPT-2's other on-disk forms (GPT2Model, hub checkpoints without the `transformer.` prefix and
with attn.bias / attn.masked_bias buffers, an untied head) against the adapter, and a
neutral-layout rebuild of the forward pass (Conv1D transpose, c_attn split, per-layer scale)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from parity.capture import run_and_capture
from parity.checkpoint import check_tensors, open_checkpoint
from parity.tiny import build_model

from .conftest import ADAPTERS

PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(40)]])
ACT = {"gelu_exact": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _save(path, arch, **extra):
    build_model(ADAPTERS["gpt2"], architecture=arch, overrides=extra).save_pretrained(path)
    return path


def _neutral(ckpt):
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    raw = {}
    for f in ckpt.files:
        raw.update(load_file(f))
    out = {}
    for name, t in ckpt.resolved.tensor_map(check.prefix).items():
        x = raw[name].T if t.transpose else raw[name]
        parts = torch.split(x, list(t.split[1]), dim=t.split[0]) if t.split else [x]
        out.update(zip(t.neutral, parts))
    return out, check


def _rebuild(r, w, ids):
    """The Pre-Norm decoder as the resolved conventions describe it."""
    eps, act, n = r["norm.eps"], ACT[r["mlp.activation"]], ids.shape[1]

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)

    x = w["embed.tokens.weight"][ids] + w["embed.positions.weight"][:n]
    caps = {"embed": x}
    for i in range(r.num_layers):
        p = f"layers.{i}."
        heads, dim = r.layer("attention.heads", i), r.layer("attention.head_dim", i)
        h = caps[p + "attn_in"] = ln(x, p + "attn_norm")
        q, k, v = (F.linear(h, w[p + f"attn.{c}.weight"], w[p + f"attn.{c}.bias"]).view(1, n, heads, dim).transpose(1, 2)
                   for c in "qkv")
        s = (q @ k.transpose(-1, -2) * r.layer("attention.scale", i)).masked_fill(
            torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        a = F.linear((s.softmax(-1) @ v).transpose(1, 2).reshape(1, n, -1), w[p + "attn.o.weight"], w[p + "attn.o.bias"])
        caps[p + "attn_out"] = a
        x = caps[p + "mid"] = x + a
        h = caps[p + "mlp_in"] = ln(x, p + "mlp_norm")
        m = F.linear(act(F.linear(h, w[p + "mlp.up.weight"], w[p + "mlp.up.bias"])), w[p + "mlp.down.weight"], w[p + "mlp.down.bias"])
        caps[p + "mlp_out"] = m
        x = caps[p + "out"] = x + m
    x = caps["final_norm"] = ln(x, "final_norm")
    if r.variant.lm_head:
        caps["logits"] = F.linear(x, w["embed.tokens.weight"] if r["embedding.tied"] else w["lm_head.weight"])
    return caps


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
    arch, extra, mutate, prefix, ignored = CASES[case]
    path = _save(tmp_path / case, arch, **extra)
    if mutate:
        mutate(path)
    ckpt = open_checkpoint(path)
    assert ckpt.adapter.family == "gpt2" and ckpt.variant.architectures == [arch]
    weights, check = _neutral(ckpt)
    assert check.prefix == prefix and sorted(check.ignored) == sorted(ignored)
    r = ckpt.resolved
    names = {c.name for c in r.capture}
    assert ("logits" in names) == (arch != "GPT2Model") and "final_norm" in names

    model = getattr(transformers, arch).from_pretrained(path, attn_implementation="eager").eval()
    ref = run_and_capture(model, r.capture, input_ids=PROMPT)
    with torch.no_grad():
        ours = _rebuild(r, weights, PROMPT)
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
