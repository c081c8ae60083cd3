"""GPT-NeoX's other forms against the adapter, converted and run by the executor against transformers: sequential
residual (use_parallel_residual false: a `mid` point, as Llama), Pythia-style checkpoints with the old per-layer
buffers, and the per-head split of the fused query_key_value."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from parity.checkpoint import check_tensors, open_checkpoint
from parity.neutral.converter import _split, convert
from parity.neutral.executor.model import NeutralModel
from parity.reference.capture import run_and_capture
from parity.reference.tiny import build_model
from tests.conftest import ADAPTERS

PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(40)]])


def _pythia_style(path):
    """Like EleutherAI/pythia-*: each layer's causal mask, masked fill value and RoPE inverse frequencies saved."""
    sd = load_file(path / "model.safetensors")
    for i in range(2):
        sd[f"gpt_neox.layers.{i}.attention.bias"] = torch.tril(torch.ones(256, 256, dtype=torch.bool))[None, None]
        sd[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        sd[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = 1.0 / (5000.0 ** (torch.arange(0, 8, 2) / 8))
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


CASES = {
    "parallel": ({}, None, True),
    "sequential": ({"use_parallel_residual": False}, None, False),
    "pythia-buffers": ({}, _pythia_style, True),
}


@pytest.mark.parametrize("case", CASES)
def test_gpt_neox_form(case, tmp_path):
    extra, mutate, parallel = CASES[case]
    path = tmp_path / case
    build_model(ADAPTERS["gpt_neox"], overrides=extra).save_pretrained(path)
    if mutate:
        mutate(path)
    ckpt = open_checkpoint(path)
    assert ckpt.adapter.family == "gpt_neox"
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    r = ckpt.resolved
    assert [r.layer("mlp.parallel", i) for i in range(2)] == [parallel, parallel]
    assert r.layer("positions.rotary_dim", 0) == 8 and r.layer("positions.rope_theta", 0) == 5000.0
    names = {c.name for c in r.capture}
    assert ("layers.0.mid" in names) == (not parallel)

    model = transformers.GPTNeoXForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ref = run_and_capture(model, r.capture, input_ids=PROMPT)
    convert(path, tmp_path / "n")
    got: dict[str, torch.Tensor] = {}
    NeutralModel.load(tmp_path / "n")(PROMPT, on_point=got.__setitem__)
    assert ("layers.0.mid" in got) == (not parallel)
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-4, msg=name)


def test_the_fused_split_is_per_head():
    """query_key_value's rows [heads, 3, head_dim] split into q, k, v as GPTNeoXAttention does."""
    heads, dim, hidden = 4, 3, 5
    fused = torch.randn(heads * 3 * dim, hidden)
    q, k, v = _split(fused, 0, (heads * dim,) * 3, heads)
    expected = fused.view(heads, 3 * dim, hidden).chunk(3, dim=1)
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got, want.reshape(heads * dim, hidden))
    bias = torch.randn(heads * 3 * dim)
    parts = _split(bias, 0, (heads * dim,) * 3, heads)
    assert torch.equal(parts[1], bias.view(heads, 3, dim)[:, 1].reshape(-1))


# StableLM and Phi share the parallel conventions: StableLM's is optional (on one shared norm), Phi's always on
SHARED = {
    "stablelm-parallel": ("stablelm", "StableLmForCausalLM", {}, True),
    "stablelm-sequential": ("stablelm", "StableLmForCausalLM", {"use_parallel_residual": False}, False),
    "phi": ("phi", "PhiForCausalLM", {}, True),
}


@pytest.mark.parametrize("case", SHARED)
def test_a_shared_norm_parallel_form(case, tmp_path):
    family, arch, extra, parallel = SHARED[case]
    path = tmp_path / case
    build_model(ADAPTERS[family], overrides=extra).save_pretrained(path)
    ckpt = open_checkpoint(path)
    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert ckpt.adapter.family == family and check.ok, check.problems()
    r = ckpt.resolved
    assert [(r.layer("mlp.parallel", i), r.layer("mlp.shared_norm", i)) for i in range(2)] == [(parallel,) * 2] * 2
    assert any(n.neutral == "layers.0.mlp_norm" for n in r.norms) == (not parallel)
    model = getattr(transformers, arch).from_pretrained(path, attn_implementation="eager").eval()
    ref = run_and_capture(model, r.capture, input_ids=PROMPT)
    assert ("layers.0.mid" in ref) == (not parallel)
    if parallel:  # attention and the MLP read the same normed input
        torch.testing.assert_close(ref["layers.0.mlp_in"], ref["layers.0.attn_in"])
    convert(path, tmp_path / "n")
    got: dict[str, torch.Tensor] = {}
    NeutralModel.load(tmp_path / "n")(PROMPT, on_point=got.__setitem__)
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-4, msg=name)
