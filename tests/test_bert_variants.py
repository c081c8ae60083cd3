"""BERT's other on-disk forms (BertModel, BertForPreTraining, BertLMHeadModel, untied MLM head,
bert-base-uncased's extra tensors) against the adapter, and a neutral-layout rebuild of the
forward pass from the adapter's tensor map and conventions (Post-Norm, MLM head, tied decoder)."""

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
    build_model(ADAPTERS["bert"], architecture=arch, overrides=extra).save_pretrained(path)
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
    """The Post-Norm encoder and MLM head as the resolved conventions describe them."""
    eps, act, n = r["norm.eps"], ACT[r["mlp.activation"]], ids.shape[1]

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)

    x = w["embed.tokens.weight"][ids] + w["embed.positions.weight"][:n] + w["embed.token_types.weight"][0]
    x = ln(x, "embed.norm")
    caps = {"embed": x}
    for i in range(r.num_layers):
        p = f"layers.{i}."
        heads, dim = r.layer("attention.heads", i), r.layer("attention.head_dim", i)
        q, k, v = (F.linear(x, w[p + f"attn.{c}.weight"], w[p + f"attn.{c}.bias"]).view(1, n, heads, dim).transpose(1, 2)
                   for c in "qkv")
        s = q @ k.transpose(-1, -2) * r.layer("attention.scale", i)
        if r.layer("attention.causal", i):
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        a = F.linear((s.softmax(-1) @ v).transpose(1, 2).reshape(1, n, -1), w[p + "attn.o.weight"], w[p + "attn.o.bias"])
        caps[p + "attn_out"] = a
        x = caps[p + "mid"] = ln(x + a, p + "attn_res_norm")
        m = F.linear(act(F.linear(x, w[p + "mlp.up.weight"], w[p + "mlp.up.bias"])), w[p + "mlp.down.weight"], w[p + "mlp.down.bias"])
        caps[p + "mlp_out"] = m
        x = caps[p + "out"] = ln(x + m, p + "mlp_res_norm")
    if r.variant.lm_head:
        assert r["embedding.head_transform"]
        h = ln(act(F.linear(x, w["head.transform.weight"], w["head.transform.bias"])), "head.norm")
        decoder = w["embed.tokens.weight"] if r["embedding.tied"] else w["lm_head.weight"]
        caps["logits"] = F.linear(h, decoder, w["head.bias"])
    return caps


def _add_pretraining_leftovers(path):
    """What bert-base-uncased holds beyond BertForMaskedLM: pooler, NSP head, a decoder copy."""
    sd = load_file(path / "model.safetensors")
    sd["bert.pooler.dense.weight"], sd["bert.pooler.dense.bias"] = torch.zeros(64, 64), torch.zeros(64)
    sd["cls.seq_relationship.weight"], sd["cls.seq_relationship.bias"] = torch.zeros(2, 64), torch.zeros(2)
    sd["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"].clone()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


CASES = {
    "BertForMaskedLM": ("BertForMaskedLM", {}, None, "bert.", []),
    "BertForPreTraining": ("BertForPreTraining", {}, None, "bert.",
                           ["bert.pooler.dense.bias", "bert.pooler.dense.weight",
                            "cls.seq_relationship.bias", "cls.seq_relationship.weight"]),
    "BertModel": ("BertModel", {}, None, "", ["pooler.dense.bias", "pooler.dense.weight"]),
    "BertLMHeadModel": ("BertLMHeadModel", {"is_decoder": True}, None, "bert.", []),
    "untied": ("BertForMaskedLM", {"tie_word_embeddings": False}, None, "bert.", ["cls.predictions.bias"]),
    "bert-base-uncased-like": ("BertForMaskedLM", {}, _add_pretraining_leftovers, "bert.",
                               ["bert.pooler.dense.bias", "bert.pooler.dense.weight", "cls.predictions.decoder.weight",
                                "cls.seq_relationship.bias", "cls.seq_relationship.weight"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bert_on_disk_form(case, tmp_path):
    arch, extra, mutate, prefix, ignored = CASES[case]
    path = _save(tmp_path / case, arch, **extra)
    if mutate:
        mutate(path)
    ckpt = open_checkpoint(path)
    assert ckpt.adapter.family == "bert" and arch in ckpt.variant.architectures
    weights, check = _neutral(ckpt)
    assert check.prefix == prefix and sorted(check.ignored) == sorted(ignored)
    r = ckpt.resolved
    assert r["attention.causal"] == bool(extra.get("is_decoder"))
    names = {c.name for c in r.capture}
    assert ("logits" in names) == (arch != "BertModel") and "final_norm" not in names

    model = getattr(transformers, arch).from_pretrained(path, attn_implementation="eager").eval()
    ref = run_and_capture(model, r.capture, input_ids=PROMPT)
    with torch.no_grad():
        ours = _rebuild(r, weights, PROMPT)
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-4, msg=name)
