"""The candidate protocol (parity/candidates): the runner depends on it alone, and a new engine is one module plus
one line in KINDS."""

from __future__ import annotations

import ast
import json
import sys
import types
from pathlib import Path

from click.testing import CliRunner

from parity import candidates
from parity.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):  # "from . import a" -> ".a"; "from .x import a" -> ".x"
            dots = "." * node.level
            out |= {dots + a.name for a in node.names} if node.module is None else {dots + node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_runner_imports_no_candidate_module():
    imported = _imports(ROOT / "parity" / "runner.py")
    kinds = {f".candidates.{k}" for k in candidates.KINDS} | {".dumps", ".onnx_candidate", ".gguf_candidate"}
    assert not imported & kinds, imported & kinds
    assert ".candidates" in imported  # the protocol, and only it


def test_every_kind_module_states_the_protocol():
    for name, kind in candidates.kinds().items():
        assert kind.name == name and callable(kind.detect) and callable(kind.make_runner)
    assert set(candidates.kinds()) == {"dump", "onnx", "gguf", "neutral", "transformers"}


def test_a_new_engine_is_one_module_and_one_line(tmp_path, tiny_dir, monkeypatch):
    """An "echo" engine (a file naming a neutral directory, run by parity's executor) checked end to end, added
    as a module of parity.candidates and one entry in KINDS, nothing else."""
    from parity.candidates import neutral as neutral_kind

    echo = types.ModuleType("parity.candidates.echo")
    echo.KIND = "echo"
    echo.detect = lambda path: Path(path).suffix == ".echo" and Path(path).is_file()

    def make_runner(models, path, dtype, ids, feed, ckpt):
        target = Path(Path(path).read_text().strip())
        return neutral_kind.make_runner(models, target, dtype, ids, feed, ckpt)

    echo.make_runner = make_runner
    monkeypatch.setitem(sys.modules, "parity.candidates.echo", echo)
    monkeypatch.setattr(candidates, "KINDS", (*candidates.KINDS, "echo"))
    monkeypatch.setattr(candidates, "_loaded", {})

    reference = tiny_dir("llama")
    neutral = tmp_path / "n"
    assert CliRunner().invoke(cli, ["convert", str(reference), "--to", "neutral", "-o", str(neutral)]).exit_code == 0
    file = tmp_path / "engine.echo"
    file.write_text(str(neutral))
    result = CliRunner().invoke(cli, ["check", "--reference", str(reference), "--candidate", str(file), "--layerwise",
                                      "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["candidate"]["kind"] == "echo" and all(p["passed"] for p in report["points"])


def _package_imports() -> dict[str, set[str]]:
    """parity's modules and the parity modules each imports, at any depth of its code (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for file in (ROOT / "parity").rglob("*.py"):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
                targets |= {name} if node.module else {f"{base}.{a.name}" for a in node.names}
        graph[module] = targets
    return {m: {t for t in ts if t in graph} for m, ts in graph.items()}


def test_parity_has_no_import_cycles():
    """Not even through a function-level import: the reference kinds (golden) and the candidate kinds run below
    the runner, which is the only module that joins them."""
    graph = _package_imports()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            assert state.get(t) != 1, " -> ".join(path + [m, t])
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert "parity.runner" not in graph["parity.golden"] and "parity.runner" in graph["parity.cli"]
