"""The command line: help, version, exit codes and one-line errors, make-tiny determinism."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from parity import __version__
from parity.cli import cli
from tests.conftest import FIXTURES

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env, catch_exceptions=False)


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("parity: error: ")
    return lines[0]


def test_version_and_help():
    assert run("--version").output.strip() == f"parity, version {__version__}"
    assert "Usage" in run("-h").output and run("-h").output == run("--help").output


def test_every_command_has_help_and_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name, command in cli.commands.items():
        assert command.help, name
        assert run(name, "-h").exit_code == 0
        assert f"parity {name}" in readme, f"README does not mention `parity {name}`"


def test_inspect_llama_31_8b_norm_census():
    result = run("inspect", FIXTURES / "configs" / "llama-3.1-8b.json")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "65 RMSNorms holding 266,240 parameters, 0.003% of the model" in text


def test_inspect_json(tmp_path):
    data = json.loads(run("inspect", "--json", FIXTURES / "configs" / "llama-3.1-8b.json").output)
    assert data["family"] == "llama"
    assert data["norms"]["count"] == 65 and data["norms"]["parameters"] == 266_240
    assert data["parameters"] == 8_030_261_248
    assert data["conventions"]["positions"]["rope_scaling"]["value"]["rope_type"] == "llama3"
    assert data["conventions"]["norm"]["eps"] == {"value": 1e-5, "source": "config rms_norm_eps", "per_layer": False}


def test_unsupported_architecture_lists_supported_families(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    line = _one_line_error(run("inspect", cfg))
    assert "unsupported architecture MambaForCausalLM" in line
    assert "llama" in line and "gemma4" in line and "bert" in line


def test_pickle_only_directory_is_refused_without_unpickling(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "configs" / "llama-3.1-8b.json").read_text())
    # not a valid pickle: if parity ever tried to unpickle it, it would fail differently
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    line = _one_line_error(run("inspect", tmp_path))
    assert "pickle" in line and "safetensors" in line and "pytorch_model.bin" in line


@pytest.mark.parametrize("content,expected", [
    (None, "no such file or directory"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_config_is_one_line_exit_2(tmp_path, content, expected):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    assert expected in _one_line_error(run("inspect", path))


def test_adapters_table_lists_every_family():
    result = run("adapters", "--json")
    rows = json.loads(result.output)
    assert len(rows) == 28
    by_family = {r["family"]: r for r in rows}
    assert by_family["gemma2"]["weight"] == "1 + w"
    assert by_family["gemma4"]["weight"] == "w"
    assert "parallel residual use_parallel_residual (default yes)" in by_family["gpt_neox"]["other"]
    assert by_family["bert"]["placement"] == "Post-Norm"
    assert run("adapters").exit_code == 0


def _digest(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_make_tiny_same_seed_same_bytes(tmp_path):
    for out in ("a", "b"):
        assert run("make-tiny", "qwen3", "-o", tmp_path / out, "--layers", "1").exit_code == 0
    assert run("make-tiny", "qwen3", "-o", tmp_path / "c", "--layers", "1", "--seed", "1").exit_code == 0
    a, b, c = (_digest(tmp_path / x) for x in "abc")
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert not list(tmp_path.glob(".*parity-tmp*"))


def test_make_tiny_refuses_to_overwrite_and_unknown_family(tmp_path):
    (tmp_path / "out").mkdir()
    assert "already exists" in _one_line_error(run("make-tiny", "llama", "-o", tmp_path / "out"))
    assert "unknown family 'llama9'" in _one_line_error(run("make-tiny", "llama9", "-o", tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_make_tiny_then_inspect(tmp_path):
    assert run("make-tiny", "llama", "-o", tmp_path / "t", "--dtype", "bfloat16").exit_code == 0
    data = json.loads(run("inspect", "--json", tmp_path / "t").output)
    assert data["weights"]["accounted_for"] is True
    assert set(data["weights"]["dtypes"]) == {"BF16"}
    assert re.fullmatch(r"\d+", str(data["norms"]["count"]))


def test_inspect_with_an_adapters_dir_recognises_a_new_family(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    text = (ROOT / "adapters" / "llama.toml").read_text().replace('family = "llama"', 'family = "myllama"')
    text = text.replace('"LlamaForCausalLM"', '"MyLlamaForCausalLM"').replace('model_type = "llama"', 'model_type = "myllama"')
    (d / "myllama.toml").write_text(text)
    cfg = json.loads((FIXTURES / "configs" / "llama-3.1-8b.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MyLlamaForCausalLM"], "myllama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    data = json.loads(run("inspect", "--json", "--adapters", d, tmp_path / "config.json").output)
    assert data["family"] == "myllama" and data["norms"]["count"] == 65
    env_run = run("inspect", "--json", tmp_path / "config.json", env={"PARITY_ADAPTERS": str(d)})
    assert json.loads(env_run.output)["family"] == "myllama"
    assert "unsupported architecture" in _one_line_error(run("inspect", tmp_path / "config.json"))


def test_an_unexpected_error_is_one_line_and_exit_2_and_debug_shows_the_traceback(monkeypatch):
    """Exit 1 means "parity fails": a crash must never read as that. Any exception becomes exit 2."""
    import parity.cli as cli_module

    def crash(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(cli_module, "_inspect", crash)
    line = _one_line_error(CliRunner().invoke(cli, ["inspect", "x"]))
    assert "KeyError" in line and "--debug" in line
    debug = CliRunner().invoke(cli, ["--debug", "inspect", "x"])
    assert debug.exit_code == 2 and "Traceback" in debug.stderr
    assert CliRunner().invoke(cli, ["inspect", "x"], env={"PARITY_DEBUG": "1"}).stderr.count("Traceback") == 1

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(cli_module, "_inspect", no_memory)
    assert "out of memory" in _one_line_error(CliRunner().invoke(cli, ["inspect", "x"]))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_inspect", interrupted)
    result = CliRunner().invoke(cli, ["inspect", "x"])
    assert result.exit_code == 130 and result.stderr.strip() == "parity: interrupted; nothing was written"
