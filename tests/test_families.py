"""Every family's adapter against transformers itself, on the family's tiny checkpoint."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity.checkpoint import open_checkpoint
from parity.reference.capture import run_and_capture
from tests.conftest import FAMILIES

PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(40)]])


def _norm_modules(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tiny_dir):
    family = request.param
    path = tiny_dir(family)
    ckpt = open_checkpoint(path)
    model = getattr(transformers, ckpt.variant.architectures[0]).from_pretrained(path, attn_implementation="eager").eval()
    return family, ckpt, model


def test_recognised_as_its_own_family(family_model):
    family, ckpt, _ = family_model
    assert ckpt.adapter.family == family


def test_tensor_map_accounts_for_every_tensor(family_model):
    _, ckpt, model = family_model
    from parity.checkpoint import check_tensors

    check = check_tensors(ckpt.resolved, ckpt.tensors)
    assert check.ok, check.problems()
    assert check.matched == len(ckpt.tensors) > 0
    # the map's parameter count is the checkpoint's
    assert sum(t.numel for t in ckpt.resolved.tensors) == sum(
        t.numel() for t in model.state_dict().values()) - _tied_duplicates(model)


def _tied_duplicates(model) -> int:
    seen, dup = set(), 0
    for t in model.state_dict().values():
        key = t.data_ptr()
        if key in seen:
            dup += t.numel()
        seen.add(key)
    return dup


def test_norm_count_matches_transformers_module_tree(family_model):
    _, ckpt, model = family_model
    ours = [n.hf.replace("{prefix}", ckpt.variant.module_prefix) for n in ckpt.resolved.norms]
    # one module may serve two norms (Llama 4's qk_norm normalises q, then k): each module once, every one named
    assert sorted(set(ours)) == sorted(_norm_modules(model))
    assert len(ours) - len(set(ours)) == sum(n.neutral.endswith("attn.k_norm") and n.hf in
                                             {m.hf for m in ckpt.resolved.norms if m.neutral.endswith("attn.q_norm")}
                                             for n in ckpt.resolved.norms)


def test_capture_points_are_produced_with_the_right_shapes(family_model):
    family, ckpt, model = family_model
    r = ckpt.resolved
    got = run_and_capture(model, r.capture, input_ids=PROMPT)
    hidden = r.config["hidden_size"] if "hidden_size" in r.config else r.config["n_embd"]
    for name, t in got.items():
        assert torch.isfinite(t).all(), name
        width = r.config["vocab_size"] if name == "logits" else hidden
        assert tuple(t.shape) == (1, PROMPT.shape[1], width), name
    # the residual stream: each layer adds attn_out and mlp_out (where the block is additive)
    if r["norm.placement"] != "post" and not any("layer_scalar" in t.hf for t in r.tensors):
        prev = got["embed"]
        for i in range(r.num_layers):
            scale = r.layer("norm.residual_scale", i)  # Granite: residual + sublayer * residual_multiplier
            if r.layer("mlp.parallel", i):  # GPT-NeoX: both sublayers read the layer's input; no `mid`
                assert f"layers.{i}.mid" not in got
                torch.testing.assert_close(got[f"layers.{i}.out"],
                                           prev + (got[f"layers.{i}.attn_out"] + got[f"layers.{i}.mlp_out"]) * scale)
                prev = got[f"layers.{i}.out"]
                continue
            torch.testing.assert_close(got[f"layers.{i}.mid"], prev + got[f"layers.{i}.attn_out"] * scale)
            torch.testing.assert_close(got[f"layers.{i}.out"],
                                       got[f"layers.{i}.mid"] + got[f"layers.{i}.mlp_out"] * scale)
            prev = got[f"layers.{i}.out"]


def test_tiny_checkpoint_makes_conventions_visible(family_model):
    """docs/design.md's test checkpoints: norms away from init, realistic embeddings, biting softcap, short windows."""
    _, ckpt, model = family_model
    r = ckpt.resolved
    state = model.state_dict()
    prefix = ckpt.variant.module_prefix
    for norm in r.norms:
        if norm.has_weight:
            w = state[norm.hf.replace("{prefix}", prefix) + ".weight"]
            init = 0.0 if norm.weight == "one_plus_weight" else 1.0
            assert (w - init).abs().mean() > 0.1, norm.hf
    embed = next(t for t in r.tensors if t.neutral == ("embed.tokens.weight",))
    std = state[embed.hf.replace("{prefix}", prefix)].std().item()
    assert 0.01 < std < 0.04
    windows = [w for w in (r.settings["attention.sliding_window"].value if r.settings["attention.sliding_window"].per_layer
                           else [r["attention.sliding_window"]]) if w]
    assert all(w < PROMPT.shape[1] // 2 for w in windows)
    cap = r["embedding.final_softcap"]
    if cap:
        got = run_and_capture(model, [c for c in r.capture if c.name == "logits"], input_ids=PROMPT)["logits"]
        saturated = (got.abs() > 0.76 * cap).float().mean().item()  # |x| > cap before tanh
        assert saturated > 0.05, f"final softcap {cap} barely bites ({saturated:.1%} of logits)"


def test_every_norm_eps_matches_the_module(family_model):
    _, ckpt, model = family_model
    for norm in ckpt.resolved.norms:
        module = model.get_submodule(norm.hf.replace("{prefix}", ckpt.variant.module_prefix))
        eps = next(getattr(module, a) for a in ("eps", "variance_epsilon", "epsilon") if hasattr(module, a))
        assert norm.eps == pytest.approx(eps, rel=1e-12), norm.hf
