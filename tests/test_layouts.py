"""`parity inspect` against the layouts of real public checkpoints, headers only (tests/fixtures/layouts).

Each layout is materialised by ``tests/layouts.py``: every tensor the real index lists, under its real name,
with the shape transformers' own model class gives it and the config's dtype, over sparse zero data. The
index's own ``total_size`` (written by whoever saved the real checkpoint) must equal the bytes those shapes
take, so the shapes are the real ones, not transformers' opinion of them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.cli import cli
from tests.layouts import INDEX, NAMES, LayoutError, load, load_dir, materialise


@dataclass(frozen=True)
class Facts:
    """What is true of each real checkpoint, stated here rather than derived from parity (SOURCES.md)."""

    family: str
    layers: int
    tied: bool                  # head tied to the embeddings: no lm_head.weight in the checkpoint
    dtype: str
    prefix: str = "model."
    ignored: int = 0            # tensors the adapter deliberately skips (a vision tower)


FACTS = {
    "llama-3.1-8b-modelstock-merge": Facts("llama", 32, tied=False, dtype="BF16"),
    "mistral-7b-finetune-neuroweave": Facts("mistral", 32, tied=False, dtype="BF16"),
    "qwen2.5-3b-finetune": Facts("qwen2", 36, tied=True, dtype="BF16"),
    "qwen3-1.7b": Facts("qwen3", 28, tied=True, dtype="F16"),
    "olmo-2-1124-13b": Facts("olmo2", 40, tied=False, dtype="F32"),
    "gemma-2b-it": Facts("gemma", 18, tied=True, dtype="BF16"),
    "gemma-2-2b-it": Facts("gemma2", 26, tied=True, dtype="BF16"),
    # the vision tower and the projector: 439 of the 1247 tensors
    "medgemma-27b-it": Facts("gemma3", 62, tied=True, dtype="BF16", prefix="language_model.model.", ignored=439),
}


def inspect(path: Path):
    """`parity inspect PATH --json`, in-process: (exit code, parsed JSON or None, stderr)."""
    result = CliRunner().invoke(cli, ["inspect", "--json", str(path)])
    data = json.loads(result.stdout) if result.stdout.strip() else None  # shown also when the tensors do not match
    return result.exit_code, data, result.stderr


def weight_map(name: str) -> dict[str, str]:
    return json.loads((Path(__file__).parent / "fixtures" / "layouts" / name / INDEX).read_text())["weight_map"]


def test_every_layout_has_its_facts():
    assert sorted(FACTS) == NAMES


@pytest.fixture(scope="module", params=NAMES)
def inspected(request, tmp_path_factory):
    """(layout name, materialised directory, inspect's JSON), once per layout."""
    name = request.param
    directory = materialise(name, tmp_path_factory.mktemp(name))
    code, data, stderr = inspect(directory)
    assert code == 0, f"parity inspect {name}: exit {code}: {stderr}"
    return name, directory, data


def test_shapes_are_the_real_checkpoints(inspected):
    """The index's total_size, written when the real checkpoint was saved, is what transformers' shapes take."""
    name, _, _ = inspected
    layout = load(name)
    assert layout.total_size == layout.index["metadata"]["total_size"]
    assert list(layout.shapes) == list(layout.weight_map)


def test_inspect_recognises_the_family_and_accounts_for_every_tensor(inspected):
    name, directory, data = inspected
    facts = FACTS[name]
    w = data["weights"]
    assert data["family"] == facts.family
    assert data["layers"] == facts.layers
    assert w["missing"] == [] and w["unexpected"] == [] and w["wrong_shape"] == [], w
    assert w["accounted_for"] is True
    assert w["tensors"] == len(weight_map(name))
    assert w["ignored"] == facts.ignored
    assert w["prefix"] == facts.prefix
    assert w["dtypes"] == {facts.dtype: len(weight_map(name))}
    assert sorted(w["files"]) == sorted(set(weight_map(name).values()))


def test_tied_or_untied_head(inspected):
    name, _, data = inspected
    facts = FACTS[name]
    assert ("lm_head.weight" in weight_map(name)) is (not facts.tied)
    assert data["conventions"]["embedding"]["tied"]["value"] is facts.tied


def test_layer_count_is_the_checkpoints(inspected):
    name, _, data = inspected
    facts = FACTS[name]
    text = [k for k in weight_map(name) if k.startswith(facts.prefix)]
    layers = {int(m[1]) for k in text if (m := re.match(re.escape(facts.prefix) + r"layers\.(\d+)\.", k))}
    assert layers == set(range(facts.layers)) and data["layers"] == facts.layers


def test_parameter_count_is_the_text_models_tensors(inspected):
    """inspect's parameter count is the sum over the checkpoint's text tensors (the ignored ones excluded)."""
    name, _, data = inspected
    facts = FACTS[name]
    layout = load(name)
    text = [k for k in layout.shapes if k.startswith(facts.prefix) or k == "lm_head.weight"]
    assert len(layout.shapes) - len(text) == facts.ignored
    numel = 0
    for k in text:
        n = 1
        for d in layout.shapes[k]:
            n *= d
        numel += n
    assert data["parameters"] == numel


def _last_layer_tensor(name: str) -> str:
    facts = FACTS[name]
    key = f"{facts.prefix}layers.{facts.layers - 1}.mlp.down_proj.weight"
    assert key in weight_map(name)
    return key


@pytest.mark.parametrize("name", NAMES)
def test_a_deleted_tensor_is_reported_missing(name, tmp_path):
    gone = _last_layer_tensor(name)
    code, data, stderr = inspect(materialise(name, tmp_path, drop=(gone,)))
    assert code == 2 and "1 missing" in stderr and stderr.count("\n") == 1, stderr
    w = data["weights"]
    assert w["accounted_for"] is False
    assert w["missing"] == [gone] and w["unexpected"] == [] and w["wrong_shape"] == []
    assert w["tensors"] == len(weight_map(name)) - 1


@pytest.mark.parametrize("name", NAMES)
def test_a_renamed_tensor_is_reported_unexpected(name, tmp_path):
    old = _last_layer_tensor(name)
    new = old.replace(".mlp.down_proj.", ".mlp.down_projection.")
    code, data, stderr = inspect(materialise(name, tmp_path, rename={old: new}))
    assert code == 2 and "1 missing, 1 unexpected" in stderr, stderr
    w = data["weights"]
    assert w["accounted_for"] is False
    assert w["unexpected"] == [new] and w["missing"] == [old] and w["wrong_shape"] == []
    assert w["tensors"] == len(weight_map(name))


def test_inspect_exit_code_when_a_tensor_is_missing(tmp_path):
    result = CliRunner().invoke(cli, ["inspect", str(materialise("qwen3-1.7b", tmp_path,
                                                                 drop=(_last_layer_tensor("qwen3-1.7b"),)))])
    assert result.exit_code == 2, result.output


# ------------------------------------------------------------------------------------------------
# the helper itself


def test_a_materialised_27b_layout_takes_kilobytes(tmp_path):
    directory = materialise("medgemma-27b-it", tmp_path / "medgemma")
    layout = load("medgemma-27b-it")
    shards = sorted(directory.glob("*.safetensors"))
    assert [p.name for p in shards] == sorted(set(layout.weight_map.values()))
    apparent = sum(p.stat().st_size for p in shards)
    on_disk = sum(os.stat(p).st_blocks * 512 for p in directory.iterdir())
    assert apparent > layout.total_size > 50e9   # 54.9 GB of data, plus the headers
    assert on_disk < 4 * 2**20, f"{on_disk} bytes on disk: the data region is not sparse"
    assert (directory / INDEX).read_bytes() == (layout.directory / INDEX).read_bytes()


def test_checkpoint_names_map_to_transformers_names():
    """medgemma's `language_model.model.X` is `model.language_model.X` in transformers 5."""
    layout = load("medgemma-27b-it")
    assert layout.in_memory["language_model.model.layers.0.self_attn.q_proj.weight"] \
        == "model.language_model.layers.0.self_attn.q_proj.weight"
    assert layout.in_memory["multi_modal_projector.mm_input_projection_weight"] \
        == "model.multi_modal_projector.mm_input_projection_weight"


def test_a_tensor_transformers_drops_is_a_failure_not_skipped(tmp_path):
    source = Path(__file__).parent / "fixtures" / "layouts" / "qwen3-1.7b"
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "config.json").write_bytes((source / "config.json").read_bytes())
    index = json.loads((source / INDEX).read_text())
    index["weight_map"]["model.layers.0.self_attn.rotary_emb.inv_freq"] = "model-00001-of-00003.safetensors"
    (tmp_path / "qwen3" / INDEX).write_text(json.dumps(index))
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"):
        load_dir(tmp_path / "qwen3")
