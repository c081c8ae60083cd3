"""Adapters against real configs of public checkpoints, and transformers' own module tree."""

from __future__ import annotations

import pytest
import torch
import transformers

from parity.adapter import recognise, resolve, text_config
from tests.conftest import ADAPTERS, FIXTURES, real_config

CONFIGS = sorted(p.name for p in (FIXTURES / "configs").glob("*.json"))


def _meta_model(config: dict, architecture: str):
    cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        return getattr(transformers, architecture)(cfg)


def _counts(model: torch.nn.Module, prefix: str, text_only: bool) -> tuple[int, int]:
    keep = (lambda n: n.startswith(prefix) or n.startswith("lm_head")) if text_only else (lambda n: True)
    norms = sum(1 for n, m in model.named_modules() if "norm" in type(m).__name__.lower() and keep(n))
    params = sum(p.numel() for n, p in model.named_parameters() if keep(n))
    persistent = set(model.state_dict())
    params += sum(b.numel() for n, b in model.named_buffers() if n in persistent and keep(n))
    return norms, params


@pytest.mark.parametrize("name", CONFIGS)
def test_adapter_agrees_with_transformers_on_real_config(name):
    config = real_config(name)
    adapter, variant = recognise(config, ADAPTERS)
    r = resolve(adapter, variant, text_config(config, variant))
    model = _meta_model(config, variant.architectures[0])
    norms, params = _counts(model, variant.module_prefix, variant.text_config is not None)
    assert len(r.norms) == norms
    assert sum(t.numel for t in r.tensors) == params
