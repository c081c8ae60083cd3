"""Adapters that state only what differs: `extends`, merge rules, schema defaults, `parity adapters --resolved`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity.adapter import builtin_dir, load_adapter, load_all, resolve, resolved_data
from parity.cli import cli
from parity.errors import ParityError
from tests.conftest import FIXTURES

# Every built-in family's data, dumped with the code before adapters could extend one another.
RESOLVED = json.loads((FIXTURES / "resolved_adapters.json").read_text())
SCHEMA_HINT = "unknown key (check its spelling against the schema in parity/adapter/schema.py)"
KNOWN = ("bert, cohere, cohere2, deepseek_v3, gemma, gemma2, gemma3, gemma4, glm4_moe, gpt2, gpt_neox, gpt_oss, "
         "granite, llama, llama4, mistral, mixtral, olmo2, olmo3, olmoe, phi, phi3, qwen2, qwen2_moe, qwen3, "
         "qwen3_moe, smollm3, stablelm")


def run(*args, env: dict | None = None):
    return CliRunner().invoke(cli, [str(a) for a in args], env={"PARITY_ADAPTERS": "", **(env or {})},
                              catch_exceptions=False)


def error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def canonical(data) -> str:
    return json.dumps(data, sort_keys=True)  # tells 1, 1.0 and true apart


def write(d: Path, name: str, text: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.toml"
    path.write_text(text)
    return path


def child(name: str, base: str, body: str = "", head: str = "") -> str:
    """A minimal adapter extending ``base``: its own name, variant and tiny architecture, plus ``body``."""
    return f'''family = "{name}"
description = "test adapter {name}"
extends = "{base}"
{head}
[[variants]]
architectures = ["{name.title()}ForCausalLM"]
model_type = "{name}"
tensor_prefix = ["model."]
module_prefix = "model."

[tiny]
architecture = "{name.title()}ForCausalLM"

{body}'''


# --------------------------------------------------------------------------------------------
# The key test: every built-in family resolves to exactly what it said before


@pytest.mark.parametrize("family", sorted(RESOLVED))
def test_resolved_builtin_equals_the_fixture(family):
    result = run("adapters", "--resolved", family)
    assert result.exit_code == 0, result.output
    assert canonical(json.loads(result.output)) == canonical(RESOLVED[family])


def test_the_fixture_covers_every_builtin_family():
    assert sorted(load_all()) == sorted(RESOLVED)


def test_builtin_adapters_extend_their_relatives():
    adapters = load_all()
    chain = {name: [p.stem for p in a.bases] for name, a in adapters.items()}
    assert chain["mistral"] == ["llama"] and chain["mixtral"] == ["mistral", "llama"]
    assert chain["qwen2"] == ["llama"] and chain["qwen3"] == ["qwen2", "llama"]
    assert chain["qwen3_moe"] == ["qwen3", "qwen2", "llama"] and chain["olmo2"] == ["llama"]
    assert chain["gemma2"] == ["gemma"] and chain["gemma3"] == ["gemma2", "gemma"]
    assert chain["gemma4"] == ["gemma3", "gemma2", "gemma"]
    assert chain["llama"] == chain["gemma"] == chain["bert"] == chain["gpt2"] == []
    # dense families no longer spell MoE / MLA fields: the schema's defaults
    text = (builtin_dir() / "llama.toml").read_text()
    assert "moe_routing" not in text and "q_lora_rank" not in text and "softcap" not in text


def test_resolved_unknown_name_is_one_line_exit_2():
    assert error_line(run("adapters", "--resolved", "lama")) == (
        f"parity: error: no adapter named 'lama'; name one of: {KNOWN} (or add one with --adapters DIR)")


# --------------------------------------------------------------------------------------------
# User adapters extending built-in ones (and each other)


def test_user_adapter_extending_a_builtin_end_to_end(tmp_path):
    """helium.toml (tests/fixtures/adapters) extends the built-in llama: it resolves as the full file did."""
    adapters = load_all([FIXTURES / "adapters"])
    helium = adapters["helium"]
    assert helium.bases == (builtin_dir() / "llama.toml",)
    expected = json.loads((FIXTURES / "adapters" / "helium.resolved.json").read_text())
    assert canonical(resolved_data(helium)) == canonical(expected)
    # and through the CLI: a config of the new family is recognised and resolved like llama's
    cfg = json.loads((FIXTURES / "configs" / "llama-3.1-8b.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["HeliumForCausalLM"], "helium"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = run("inspect", "--json", "--adapters", FIXTURES / "adapters", tmp_path / "config.json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["family"] == "helium" and data["norms"]["count"] == 65
    assert data["conventions"]["positions"]["rope_style"]["value"] == "interleaved"


def test_user_adapter_extends_one_in_the_same_directory(tmp_path):
    d = tmp_path / "mine"
    write(d, "base1", child("base1", "qwen3", '[positions]\nmax_positions = { key = "max_position_embeddings", '
                                               'default = 4096 }\n'))
    write(d, "leaf", child("leaf", "base1", '[norm]\neps = { key = "rms_norm_eps", default = 1e-3 }\n'))
    adapters = load_all([d])
    leaf = adapters["leaf"]
    assert [p.stem for p in leaf.bases] == ["base1", "qwen3", "qwen2", "llama"]
    assert leaf.spec.norm.eps.default == 1e-3 and leaf.spec.positions.max_positions.default == 4096
    assert leaf.spec.attention.qk_norm == "per_head"   # from qwen3, two levels up
    # the same file loaded on its own finds its base beside it, and the built-in ones after
    assert load_adapter(d / "leaf.toml").spec == leaf.spec


def test_a_user_file_may_extend_the_builtin_it_overrides(tmp_path):
    d = tmp_path / "override"
    write(d, "llama", child("llama", "llama", '[norm]\neps = { key = "rms_norm_eps", default = 1e-3 }\n'))
    adapters = load_all([d])
    assert adapters["llama"].path == d / "llama.toml"
    assert adapters["llama"].bases == (builtin_dir() / "llama.toml",)
    assert adapters["llama"].spec.norm.eps.default == 1e-3
    # built-in families that extend llama still extend the built-in one
    assert adapters["mistral"].spec.norm.eps.default == 1e-6


# --------------------------------------------------------------------------------------------
# Refusals: one line naming the file and the fix, exit code 2


def test_unknown_key_in_a_child_is_refused_before_merging(tmp_path):
    path = write(tmp_path / "d", "kid", child("kid", "llama", "[attention]\nsofcap = 50.0\n"))
    assert error_line(run("adapters", "--adapters", path.parent)) == (
        f"parity: error: {path}: attention.sofcap: {SCHEMA_HINT}")
    path.write_text(child("kid", "llama", '[[tensors]]\nhf = "x.weight"\nneutral = "lm_head.weight"\n'
                                          'shape = ["1"]\nafer = "lm_head.weight"\n'))
    assert error_line(run("adapters", "--adapters", path.parent)) == (
        f"parity: error: {path}: tensors[0].afer: {SCHEMA_HINT}")


def test_a_cycle_is_refused(tmp_path):
    d = tmp_path / "d"
    write(d, "a", child("a", "b"))
    b = write(d, "b", child("b", "a"))
    assert error_line(run("adapters", "--adapters", d)) == (
        f"parity: error: {b}: extends: 'a' leads back to this file (a -> b -> a); an adapter cannot extend itself, "
        f"directly or through others: remove one of these 'extends'")


def test_an_unknown_base_is_refused(tmp_path):
    path = write(tmp_path / "d", "kid", child("kid", "lama"))
    assert error_line(run("adapters", "--adapters", path.parent)) == (
        f"parity: error: {path}: extends: no adapter named 'lama' beside this file or among those searched before "
        f"it; name one of: {KNOWN}")


def test_a_builtin_cannot_extend_itself(tmp_path):
    path = write(tmp_path, "llama", child("llama", "llama"))
    with pytest.raises(ParityError, match="extends: no adapter named 'llama'"):
        load_adapter(path, dirs=[tmp_path])


def _error(tmp_path: Path, body: str, head: str = "", name: str = "kid", base: str = "llama") -> str:
    path = write(tmp_path / "e", name, child(name, base, body, head))
    with pytest.raises(ParityError) as info:
        load_adapter(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message[len(f"{path}: "):]


def test_other_refusals(tmp_path):
    assert _error(tmp_path, "", 'remove = { tensors = ["nope*"] }') == (
        "remove.tensors: 'nope*' matches nothing in the base adapter's tensors")
    assert _error(tmp_path, "", 'remove = { softcaps = true }') == (
        "remove.softcaps: the base adapter has no 'softcaps' to remove")
    assert _error(tmp_path, '[[tensors]]\nhf = "x.weight"\nneutral = "lm_head.weight"\n') == (
        "tensors[0].shape: required key is missing")
    assert _error(tmp_path, '[[norms]]\nhf = "{prefix}q"\nneutral = "final_norm"\ngroup = "final"\ndim = "1"\n'
                            'after = "nope"\n') == (
        "norms[0].after: no norms entry of the base (or listed before this one) has hf 'nope'")
    assert _error(tmp_path, '[derive]\na = { expr = "b" }\nb = { expr = "a + 1" }\n') == (
        "derive.a: depends on itself (a -> b -> a)")
    text = child("kid", "llama").replace('[[variants]]\narchitectures = ["KidForCausalLM"]\nmodel_type = "kid"\n'
                                         'tensor_prefix = ["model."]\nmodule_prefix = "model."\n', "")
    path = write(tmp_path / "f", "kid", text)
    with pytest.raises(ParityError, match=r"kid.toml: variants: an adapter that extends another gives its own "
                                          r"'variants' \(it is never inherited\)"):
        load_adapter(path)
    path = write(tmp_path / "g", "kid", child("kid", "llama", head="remove = {}").replace('extends = "llama"\n', ""))
    with pytest.raises(ParityError, match="only an adapter that extends another removes from it"):
        load_adapter(path)


# --------------------------------------------------------------------------------------------
# Merge rules


def _hfs(entries) -> list[str]:
    return [e.hf for e in entries]


def test_arrays_of_tables_merge_by_hf(tmp_path):
    base = load_all()["llama"].spec
    body = '''
[[tensors]]
hf = "{prefix}layers.{i}.self_attn.o_proj.weight"   # replaced where it stands
neutral = "layers.{i}.attn.o.weight"
shape = ["hidden_size", "hidden_size"]

[[tensors]]
hf = "{prefix}layers.{i}.extra_a.weight"            # new: right after the entry listed before it
neutral = "layers.{i}.mlp.gate.weight"
shape = ["1"]

[[tensors]]
hf = "{prefix}layers.{i}.extra_b.weight"
neutral = "layers.{i}.mlp.up.weight"
shape = ["1"]

[[tensors]]
hf = "{prefix}embed_tokens.weight"                  # moved
neutral = "embed.tokens.weight"
shape = ["vocab_size", "hidden_size"]
before = "lm_head.weight"

[[buffers]]
hf = "{prefix}extra.inv_freq"                       # listed first: at the end
kind = "rope_inv_freq"
'''
    path = write(tmp_path, "kid", child("kid", "llama", body,
                                        'remove = { tensors = ["{prefix}layers.{i}.*.bias"], derive = ["rope_params"] }'
                                        ).replace("[tiny]", "[positions]\nrope_scaling = false\n\n[tiny]"))
    spec = load_adapter(path).spec
    kept = [h for h in _hfs(base.tensors) if not h.endswith(".bias") and h != "{prefix}embed_tokens.weight"]
    o = kept.index("{prefix}layers.{i}.self_attn.o_proj.weight")
    expected = [*kept[:o + 1], "{prefix}layers.{i}.extra_a.weight", "{prefix}layers.{i}.extra_b.weight", *kept[o + 1:]]
    expected.insert(expected.index("lm_head.weight"), "{prefix}embed_tokens.weight")
    assert _hfs(spec.tensors) == expected
    assert spec.tensors[expected.index("{prefix}layers.{i}.self_attn.o_proj.weight")].shape == ["hidden_size",
                                                                                               "hidden_size"]
    assert _hfs(spec.buffers) == [*_hfs(base.buffers), "{prefix}extra.inv_freq"]
    assert "rope_params" not in spec.derive and spec.norms == base.norms and spec.capture == base.capture


def test_tables_merge_key_by_key_and_values_replace_whole(tmp_path):
    body = '''
[attention]
sliding_window = 128                         # one key of [attention]; the others are llama's

[capture]
"layers.{i}.mid" = { module = "{prefix}layers.{i}.mlp", io = "input", arg = 0 }

[gguf]
arch = "kid"                                 # rope_style stays llama's
'''
    spec = load_adapter(write(tmp_path, "kid", child("kid", "llama", body))).spec
    llama = load_all()["llama"].spec
    assert spec.attention.sliding_window == 128 and spec.attention.heads == llama.attention.heads
    assert spec.capture["layers.{i}.mid"].arg == 0 and spec.capture["layers.{i}.mid"].field is None
    assert spec.capture["logits"] == llama.capture["logits"]
    assert spec.gguf.arch == "kid" and spec.gguf.rope_style == llama.gguf.rope_style
    # a parameter table is one value: the child's replaces the base's whole
    spec = load_adapter(write(tmp_path, "kid", child("kid", "llama", '[norm]\neps = { expr = "1e-3" }\n'))).spec
    assert spec.norm.eps.expr == "1e-3" and spec.norm.eps.key is None and spec.norm.eps.default is None
    # tiny.config is one value too
    spec = load_adapter(write(tmp_path, "kid", child("kid", "llama").replace(
        '[tiny]\narchitecture = "KidForCausalLM"', '[tiny]\narchitecture = "KidForCausalLM"\nconfig = { a = 1 }'))).spec
    assert spec.tiny.config == {"a": 1} and spec.tiny.layers == llama.tiny.layers


def test_derive_evaluates_in_dependency_order(tmp_path):
    """A child may redefine a base's derived name in terms of a name it adds (gemma3's layer_types does)."""
    body = '[derive]\nhead_dim = { expr = "width // 2" }\nwidth = { key = "hidden_size" }\n'
    adapter = load_adapter(write(tmp_path, "kid", child("kid", "llama", body)))
    config = json.loads((FIXTURES / "configs" / "llama-3.1-8b.json").read_text())
    r = resolve(adapter, adapter.spec.variants[0], config)
    assert r["attention.head_dim"] == config["hidden_size"] // 2
