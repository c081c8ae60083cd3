"""The test tiers (tests/conftest.py: TIERS, NODE_TIERS, FAST): every test file chooses its tier, every file and
pattern named there exists, and the markers are the registered ones."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from tests.conftest import COLLECTED, FAST, MARKERS, MATCHED, NODE_TIERS, TIERS, tiers_of

TESTS = Path(__file__).parent
PARITY = TESTS.parent / "parity"
# the packages of the engine extras (and optimum), which the fast tier runs without
ENGINES = ("llama_cpp", "gguf", "mlx", "mlx_lm", "openvino", "nncf", "ctranslate2", "transformer_lens",
           "onnxruntime_genai", "optimum")


def _files() -> set[str]:
    return {p.name for p in TESTS.glob("test_*.py")}


def _pattern_files() -> set[str]:
    return {p.split("::", 1)[0].rsplit("/", 1)[-1] for p in NODE_TIERS}


def test_every_file_named_exists():
    assert not set(TIERS) - _files(), "TIERS names files that are gone"
    assert not FAST - _files(), "FAST names files that are gone"
    assert not _pattern_files() - _files(), "NODE_TIERS names files that are gone"
    assert all(p.startswith("tests/test_") and "::" in p for p in NODE_TIERS), "a pattern is tests/FILE::TEST"


def test_every_test_file_chooses_its_tier():
    unlisted = _files() - set(TIERS) - _pattern_files() - FAST
    assert not unlisted, (f"{sorted(unlisted)}: add each to tests/conftest.py's TIERS (engine, family, real, slow), "
                          f"NODE_TIERS (some of its tests) or FAST (all of it in the fast tier)")
    assert not FAST & (set(TIERS) | _pattern_files()), "a file in FAST has tests in a tier"


def test_the_markers_are_the_registered_ones(pytestconfig):
    used = set().union(*TIERS.values(), *NODE_TIERS.values())
    assert used <= set(MARKERS)
    registered = {line.split(":", 1)[0].strip() for line in pytestconfig.getini("markers")}
    assert set(MARKERS) <= registered
    assert "--strict-markers" in pytestconfig.getini("addopts")


def test_every_pattern_matches_a_test_of_a_collected_file():
    """A pattern that matches nothing (a test renamed or gone) is stale: checked for the files this session
    collected (all of them in a plain run, whatever -m deselects afterwards)."""
    collected = {p.rsplit("/", 1)[-1] for p in COLLECTED}
    stale = [p for p in NODE_TIERS if p.split("::", 1)[0].rsplit("/", 1)[-1] in collected and p not in MATCHED]
    assert not stale, f"NODE_TIERS patterns matching no test: {stale}"


@pytest.mark.parametrize("nodeid, marks", [
    ("tests/test_mlx.py::test_converted_by_mlx_lm_passes_layerwise[llama]", {"engine", "family"}),
    ("tests/test_mlx.py::test_a_conversion_is_made_once", {"engine"}),
    ("tests/test_ops_gguf.py::test_real_qwen_q4_k_m_gives_every_op", {"engine", "family", "real"}),
    ("tests/test_bad_inputs.py::test_a_bad_input_gets_one_line_and_leaves_nothing[gguf-tensor-with-9-dimensions]",
     {"engine"}),
    ("tests/test_bad_inputs.py::test_a_bad_input_gets_one_line_and_leaves_nothing[gguf-file-of-its-magic-alone]",
     set()),
    ("tests/test_tiers.py::test_every_file_named_exists", set()),
])
def test_tiers_of_a_node_id(nodeid, marks):
    assert tiers_of(nodeid) == marks


def _modules() -> list[str]:
    names = [".".join(p.relative_to(PARITY.parent).with_suffix("").parts) for p in sorted(PARITY.rglob("*.py"))]
    return [n.removesuffix(".__init__") for n in names]


def test_every_module_of_parity_imports_without_the_engines(monkeypatch):
    """The fast tier runs without the engine extras: no module of parity/ imports an engine's package where it is
    loaded, and each loads with them absent. Importing executes the modules only engine tests run otherwise
    (parity.engines.openvino.graph, parity.engines.gguf.ops, parity.engines.gguf.weights), so the fast tier executes
    every module of parity/."""
    problems = []
    for path in sorted(PARITY.rglob("*.py")):
        try:
            body = ast.parse(path.read_text()).body
        except SyntaxError as e:
            problems.append(f"{path}: {e}")
            continue
        top = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
        named = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        named |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        problems += [f"{path} imports {m} where it loads" for m in sorted(named) if m.split(".")[0] in ENGINES]
    for engine in ENGINES:
        monkeypatch.setitem(sys.modules, engine, None)  # `import gguf` raises ImportError
    for name in _modules():
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every module's failure, in one assertion
            problems.append(f"import {name}: {type(e).__name__}: {e}")
    assert not problems, "\n".join(problems)
