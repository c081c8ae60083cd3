"""`parity inspect` on real configs reproduces docs/design.md's conventions table ("Conventions")."""

from __future__ import annotations

import pytest

from parity.checkpoint import open_checkpoint
from parity.checkpoint.inspection import report
from tests.conftest import ADAPTERS, FIXTURES
from tests.design_doc import plain, table

ROWS = table("Conventions")
NO_CONFIG = "—"  # no verbatim public config.json of the family was found: the row is its tiny checkpoint's
# real config file -> (family, norm, eps, weight, placement, norms per layer), one row of docs/design.md a family
TABLE = {plain(config): (plain(family), norm, float(eps), plain(weight), placement, per_layer)
         for family, config, norm, eps, weight, placement, per_layer, _ in ROWS if config != NO_CONFIG}
WITHOUT = {plain(family): (norm, plain(weight), placement, per_layer)
           for family, config, norm, eps, weight, placement, per_layer, _ in ROWS if config == NO_CONFIG}


def test_the_table_covers_every_family():
    assert sorted(plain(row[0]) for row in ROWS) == sorted(ADAPTERS)


@pytest.mark.parametrize("family", sorted(WITHOUT))
def test_a_row_without_a_real_config_is_its_tiny_checkpoints(family, tiny_dir):
    s = report(open_checkpoint(tiny_dir(family))).to_json()["summary"]
    assert (s["norm"], s["weight"], s["placement"], s["norms_per_layer"]) == WITHOUT[family]


def test_every_real_config_is_in_the_table():
    assert sorted(TABLE) == sorted(p.name for p in (FIXTURES / "configs").glob("*.json"))


@pytest.mark.parametrize("name", sorted(TABLE))
def test_inspect_reproduces_design_table(name):
    family, norm, eps, weight, placement, per_layer = TABLE[name]
    data = report(open_checkpoint(FIXTURES / "configs" / name)).to_json()
    assert data["family"] == family
    s = data["summary"]
    assert (s["norm"], s["weight"], s["placement"], s["norms_per_layer"]) == (norm, weight, placement, per_layer)
    assert s["eps"] == eps


def test_llama_31_8b_norm_census():
    data = report(open_checkpoint(FIXTURES / "configs" / "llama-3.1-8b.json")).to_json()
    assert data["norms"]["count"] == 65
    assert data["norms"]["parameters"] == 266_240
    assert f"{data['norms']['share'] * 100:.3f}%" == "0.003%"


def test_gemma4_moe_norms_reported_apart_from_sandwich_norms():
    data = report(open_checkpoint(FIXTURES / "configs" / "gemma-4-26b-a4b.json")).to_json()
    (pattern,) = data["norms"]["per_layer"]
    assert (pattern["block"], pattern["attention"], pattern["layers"]) == (4, ["q", "k", "v"], "0-29")
    assert pattern["moe"] == 4  # router norm (weightless) + pre/post MoE-branch norms + dense-branch post norm
    assert data["norms"]["weightless"] == 30 + 30  # a v-norm and a router norm per layer
