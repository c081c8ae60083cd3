"""The typed neutral model: filled from its fields' declarations, one declaration per convention, its table in the
docs generated from them, and the dict plumbing it replaced kept out (issue 43's counts)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from parity.adapter import load_all
from parity.checkpoint import open_checkpoint
from parity.errors import ParityError
from parity.adapter import schema
from parity.neutral.declared import SETTING, declaration, declarations, settings
from parity.neutral.converter import build_manifest
from parity.neutral.manifest import validate_manifest
from parity.neutral.model import Attention, File, Glu, Layer, Manifest, field_table

ROOT = Path(__file__).resolve().parents[1]


def _string_subscripts(path: Path, fields_only: bool = False) -> int:
    """``x["key"]`` in a module; ``fields_only``: only keys that could be a field (a tensor's neutral name, dotted,
    looks a weight up in a dict of tensors)."""
    return sum(isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
               and (not fields_only or n.slice.value.isidentifier())
               for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


def test_the_docs_table_is_the_declarations():
    text = (ROOT / "docs" / "neutral-layout.md").read_text(encoding="utf-8")
    table = re.search(r"<!-- field table: generated -->\n(.*?)\n<!-- end of field table -->", text, re.S)
    assert table and table.group(1) == field_table(), \
        "docs/neutral-layout.md's field table is stale: paste field_table()'s output between its markers"


def test_a_convention_is_declared_once_and_read_off_the_adapter(tiny_dir):
    """GPT-OSS's sinks, its up offset and Granite's residual scale reach the model from their adapter settings,
    through their declarations alone (the converter names none of them)."""
    assert declaration(Attention.model_fields["sinks"]) == (SETTING, "attention.sinks")
    assert declaration(Glu.model_fields["glu_up_offset"]) == (SETTING, "mlp.glu_up_offset")
    assert declaration(Layer.model_fields["residual_scale"]) == (SETTING, "norm.residual_scale")
    gpt_oss = build_manifest(open_checkpoint(tiny_dir("gpt_oss")), "float32", "half", hashes=False)
    assert all(layer.attention.sinks for layer in gpt_oss.layers)
    assert {layer.mlp.moe.glu_up_offset for layer in gpt_oss.layers} == {1.0}
    granite = open_checkpoint(tiny_dir("granite"))
    manifest = build_manifest(granite, "float32", "half", hashes=False)
    assert {layer.residual_scale for layer in manifest.layers} == {float(granite.config["residual_multiplier"])}
    assert not any(layer.attention.sinks for layer in manifest.layers)
    source = (ROOT / "parity" / "neutral" / "converter.py").read_text(encoding="utf-8")
    for convention in ("sinks", "residual_scale", "glu_up_offset", "softcap", "qk_norm"):
        assert convention not in source, f"parity/neutral/converter.py names {convention}: declare it in the model"


def test_the_adapter_schema_takes_a_declared_convention_from_the_model():
    """A setting the model declares with a default is a field of the adapter's section with that default, and no
    section spells it again (a second place that must agree); the schema's own fields are those whose absence an
    adapter says otherwise (``false``) than a manifest (``null``)."""
    sections = {"norm": schema.NormConvention, "attention": schema.AttentionConvention,
                "positions": schema.PositionConvention, "mlp": schema.MLPConvention,
                "embedding": schema.EmbeddingConvention}
    spelled_again = []
    for key, info in settings(Manifest).items():
        section, _, name = key.partition(".")
        field = sections[section].model_fields.get(name)
        assert field is not None, f"the model reads {key}, which no adapter can set"
        if not info.is_required():
            own = sections[section].__mro__[1].model_fields.get(name)  # the class as schema.py spells it
            if own is not None and own.get_default() == info.get_default() \
                    and type(own.get_default()) is type(info.get_default()):
                spelled_again.append(key)
            if own is None:
                assert field.get_default() == info.get_default(), key
    assert not spelled_again, f"parity/adapter/schema.py spells {spelled_again} again: drop them there"
    assert schema.AttentionConvention.model_fields["sinks"].get_default() is False
    assert "sinks" not in schema.AttentionConvention.__mro__[1].model_fields
    assert schema.AdapterFile.model_fields["gguf"].annotation is not None  # the engine's section, found in its folder
    assert load_all()["gpt_oss"].spec.attention.sinks is True


@pytest.mark.parametrize("family", sorted(load_all()))
def test_the_model_round_trips_through_manifest_json(family, tiny_dir):
    """What convert writes reads back as the same model, and an older manifest (fields added since left out) reads
    with their defaults."""
    manifest = build_manifest(open_checkpoint(tiny_dir(family)), "float32", "half", hashes=False)
    manifest.files = {"model.safetensors": File(blake3_tensors="0" * 64, bytes=1)}
    data = json.loads(manifest.dumps())
    assert validate_manifest(data, Path("manifest.json")) == manifest
    for layer in data["layers"]:
        for key in ("sinks", "chunk_size", "qk_norm_after_rope"):
            layer["attention"].pop(key)
        layer.pop("residual_scale")
    older = validate_manifest(data, Path("manifest.json"))
    assert [(a.sinks, a.chunk_size) for _, a in older.attentions()] == [(False, None)] * len(older.layers)
    assert older.layers[0].residual_scale == 1.0


def test_a_damaged_manifest_is_refused_with_its_place(tiny_dir):
    data = build_manifest(open_checkpoint(tiny_dir("llama")), "float32", "half", hashes=False).to_json()
    data["files"] = {"model.safetensors": {"sha256": "0" * 64, "bytes": 1}}
    data["layers"][1]["attention"]["heads"] = "4"
    with pytest.raises(ParityError, match=r"layers\.1\.attention\.heads: Input should be a valid integer"):
        validate_manifest(data, Path("manifest.json"))
    data["layers"][1]["attention"]["heads"] = 3
    with pytest.raises(ParityError, match="heads 3 is not a multiple of kv_heads"):
        validate_manifest(data, Path("manifest.json"))


def test_the_executor_and_the_catalog_hold_no_dict_plumbing():
    """Issue 43: the model is read by attribute. The executor and the bug catalog subscript no string key, and the
    package as a whole keeps few (those left read or write JSON)."""
    for folder in ("parity/neutral/executor", "parity/diagnosis/bugs.py"):
        for path in sorted((ROOT / folder).rglob("*.py")) if (ROOT / folder).is_dir() else [ROOT / folder]:
            assert _string_subscripts(path, fields_only=True) == 0, \
                f"{path.relative_to(ROOT)}: read the neutral model by attribute"
    total = sum(_string_subscripts(p) for p in (ROOT / "parity").rglob("*.py"))
    assert total <= 300, f"{total} string-key subscripts in parity/ (at most 300: type the records they index)"


def test_no_call_passes_more_than_eight_positional_arguments():
    wide = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in sorted((ROOT / "parity").rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if isinstance(n, ast.Call) and len(n.args) > 8]
    assert not wide, f"calls with more than 8 positional arguments (pass them by keyword): {wide}"


def test_manifest_fields_have_meanings():
    undocumented = [path for path, _, _, meaning in [*_rows(Manifest)] if not meaning]
    assert not undocumented, undocumented


def _rows(cls):
    skip = ("tensors", "files", "source", "kv_cache", "format", "written_by", "injected")
    return [row for row in declarations(cls) if not row[0].startswith(skip)]
