"""BERT's other on-disk forms (BertModel, BertForPreTraining, BertLMHeadModel, untied MLM head,
bert-base-uncased's extra tensors) against the adapter, converted and run by the executor
against transformers at every capture point (Post-Norm, MLM head, tied decoder)."""

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
    build_model(ADAPTERS["bert"], architecture=arch, overrides=extra).save_pretrained(path)
    return path


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
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    assert check.prefix == prefix and sorted(check.ignored) == sorted(ignored)
    r = ckpt.resolved
    assert r["attention.causal"] == bool(extra.get("is_decoder"))
    names = {c.name for c in r.capture}
    assert ("logits" in names) == (arch != "BertModel") and "final_norm" not in names

    model = getattr(transformers, arch).from_pretrained(path, attn_implementation="eager").eval()
    ref = run_and_capture(model, r.capture, input_ids=PROMPT)
    convert(path, tmp_path / f"{case}.neutral")  # the converter's transforms, run by the executor
    ours: dict = {}
    NeutralModel.load(tmp_path / f"{case}.neutral")(PROMPT, on_point=lambda n, t: ours.setdefault(n, t))
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-4, msg=name)
