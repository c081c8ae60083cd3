"""Shared fixtures: tiny checkpoints are built once per session, per family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.adapter import load_all
from parity.reference.tiny import make_tiny

FIXTURES = Path(__file__).parent / "fixtures"
ADAPTERS = load_all()
FAMILIES = sorted(ADAPTERS)


@pytest.fixture(scope="session")
def adapters():
    return ADAPTERS


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(family) -> path of that family's tiny checkpoint (built on first use)."""
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = make_tiny(ADAPTERS[family], root / family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def neutral_dir(tiny_dir, tmp_path_factory):
    """neutral_dir(family) -> that family's tiny checkpoint converted to the neutral layout (on first use)."""
    from parity.neutral.converter import convert

    root = tmp_path_factory.mktemp("neutral")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            convert(tiny_dir(family), root / family)
            built[family] = root / family
        return built[family]

    return get


def real_config(name: str) -> dict:
    return json.loads((FIXTURES / "configs" / name).read_text())
