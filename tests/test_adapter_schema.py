"""The adapter schema: every shipped file validates; bad files are rejected naming file and key."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import parity
from parity.adapter import builtin_dir, load_adapter, load_all, recognise
from parity.errors import ParityError

ROOT = Path(__file__).resolve().parent.parent
LLAMA = (ROOT / "adapters" / "llama.toml").read_text()
FAMILIES = ["bert", "cohere", "cohere2", "deepseek_v3", "gemma", "gemma2", "gemma3", "gemma4", "glm4_moe", "gpt2",
            "gpt_neox", "gpt_oss", "granite", "llama", "llama4", "mistral", "mixtral", "olmo2", "olmo3", "olmoe", "phi",
            "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3", "stablelm"]


def test_every_family_ships_and_validates():
    assert sorted(load_all()) == FAMILIES


def _write(tmp_path: Path, text: str, name: str = "llama") -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def _error(path: Path) -> str:
    with pytest.raises(ParityError) as info:
        load_adapter(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    return message


def test_unknown_key_is_rejected_with_file_and_key(tmp_path):
    path = _write(tmp_path, LLAMA.replace('placement = "pre"', 'placement = "pre"\nplacment = "pre"'))
    assert re.search(r"norm\.placment: unknown key", _error(path))


def test_unknown_key_inside_a_parameter_table(tmp_path):
    path = _write(tmp_path, LLAMA.replace('eps = { key = "rms_norm_eps", default = 1e-6 }',
                                          'eps = { key = "rms_norm_eps", defualt = 1e-6 }'))
    assert "norm.eps.defualt: unknown key" in _error(path)


def test_missing_field_is_rejected_with_file_and_key(tmp_path):
    path = _write(tmp_path, LLAMA.replace('eps = { key = "rms_norm_eps", default = 1e-6 }\n', ""))
    assert "norm.eps: required key is missing" in _error(path)


def test_bad_value_is_rejected_with_file_and_key(tmp_path):
    path = _write(tmp_path, LLAMA.replace('kind = "rmsnorm"', 'kind = "batchnorm"'))
    assert "norm.kind: 'batchnorm' is not one of rmsnorm, layernorm" in _error(path)


def test_wrong_type_is_rejected_with_file_and_key(tmp_path):
    path = _write(tmp_path, LLAMA.replace("layers = 2", 'layers = "two"'))
    assert "tiny.layers:" in _error(path)


def test_unknown_neutral_name_is_rejected(tmp_path):
    path = _write(tmp_path, LLAMA.replace('neutral = "layers.{i}.mlp.up.weight"', 'neutral = "layers.{i}.ffn.up"'))
    assert "tensors[" in _error(path) and "not a neutral tensor name" in _error(path)


def test_missing_capture_point_is_rejected(tmp_path):
    text = "\n".join(line for line in LLAMA.splitlines() if not line.startswith('"layers.{i}.mid"'))
    assert "capture.layers.{i}.mid: required capture point is missing" in _error(_write(tmp_path, text))


def test_expressions_cannot_reach_python(tmp_path):
    path = _write(tmp_path, LLAMA.replace('scale = { expr = "head_dim ** -0.5" }',
                                          'scale = { expr = "().__class__.__bases__" }'))
    assert "Attribute" in _error(path)
    path = _write(tmp_path, LLAMA.replace('scale = { expr = "head_dim ** -0.5" }', 'scale = { expr = "open(1)" }'))
    assert "calls something other than" in _error(path)


def test_toml_syntax_error_names_the_file(tmp_path):
    assert "not valid TOML" in _error(_write(tmp_path, LLAMA + "\n[[["))


def test_family_must_match_file_name(tmp_path):
    assert "family: 'llama' must match the file name 'other'" in _error(_write(tmp_path, LLAMA, name="other"))


def _custom_family(tmp_path: Path) -> Path:
    text = LLAMA.replace('family = "llama"', 'family = "myllama"').replace(
        '"LlamaForCausalLM"', '"MyLlamaForCausalLM"').replace('model_type = "llama"', 'model_type = "myllama"')
    d = tmp_path / "extra"
    d.mkdir()
    (d / "myllama.toml").write_text(text)
    return d


def test_adapters_dir_adds_a_family(tmp_path):
    d = _custom_family(tmp_path)
    adapters = load_all([d])
    adapter, _ = recognise({"architectures": ["MyLlamaForCausalLM"]}, adapters)
    assert adapter.family == "myllama" and adapter.path == d / "myllama.toml"


def test_environment_variable_overrides_a_builtin(tmp_path, monkeypatch):
    d = tmp_path / "override"
    d.mkdir()
    (d / "llama.toml").write_text(LLAMA.replace("rms_norm_eps\", default = 1e-6", "rms_norm_eps\", default = 1e-3"))
    monkeypatch.setenv("PARITY_ADAPTERS", str(d))
    adapters = load_all()
    assert adapters["llama"].path == d / "llama.toml"
    assert adapters["llama"].spec.norm.eps.default == 1e-3


def test_missing_adapter_dir_is_an_error(tmp_path):
    with pytest.raises(ParityError, match="does not exist"):
        load_all([tmp_path / "nope"])


def test_editable_install_finds_the_repository_adapters():
    try:
        direct = importlib.metadata.distribution("parity").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("parity is not installed; tests run from the source tree")
    if not direct or not json.loads(direct).get("dir_info", {}).get("editable"):
        pytest.skip("parity is installed from a wheel, not editable")
    assert Path(parity.__file__).resolve().parent.parent == ROOT
    assert builtin_dir() == ROOT / "adapters"


def test_wheel_ships_the_adapters(tmp_path):
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next(out.glob("parity-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        shipped = sorted(Path(n).stem for n in zf.namelist() if n.startswith("parity/adapters/") and n.endswith(".toml"))
        zf.extractall(tmp_path / "site")
    assert shipped == FAMILIES
    # the unpacked wheel, imported from elsewhere, finds its own adapters
    probe = ("import parity, parity.adapter as a; print(parity.__file__); print(a.builtin_dir()); "
             "print(len(a.load_all()))")
    env = {"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                            check=True)
    module, adapters_dir, count = result.stdout.split()
    assert module.startswith(str(tmp_path / "site"))
    assert adapters_dir == str(tmp_path / "site" / "parity" / "adapters")
    assert int(count) == len(FAMILIES)
