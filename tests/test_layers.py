"""parity's modules in floors (docs/design.md, "Architecture", whose table of floors this file reads): every import
goes to its own floor or one below, not even an import inside a function runs up or closes a cycle; the executor is
run only by the modules that must run a model; the check names no engine; and the import graph's depth, printed by
every failure here, does not grow unnoticed."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The modules outside parity/executor that import it, each with the reason it must run the executor
EXECUTOR_USERS = {
    "parity.candidates.neutral": "a neutral directory as a candidate is run by the executor",
    "parity.diagnosis.diagnose": "each catalogued mistake is replayed in the executor to find the one that explains a failure",
    "parity.engines.onnx.export": "`convert --to onnx` traces the executor into the graph (and its KV cache with it)",
    "parity.cli": "`parity run` runs a neutral directory with the executor",
}

# The longest chain of imports today, in modules ("floors"); a change that adds a floor raises it here, on purpose
MAX_FLOORS = 16


def package_imports() -> dict[str, set[str]]:
    """parity's modules and the parity modules each imports, at any depth of its code (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for file in sorted((ROOT / "parity").rglob("*.py")):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):  # "from .x import a": .x, and .x.a where a is a module
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                targets |= {name} | {f"{name}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[module] = targets
    # a package is imported before any of its modules: "from . import a" in it adds nothing but a
    return {m: {t for t in ts if t in graph and t != m and not m.startswith(t + ".")} for m, ts in graph.items()}


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports (the graph has no cycle): its depth in floors is its length."""
    @cache
    def chain(m: str) -> tuple[str, ...]:
        return (m, *max((chain(t) for t in sorted(graph[m])), key=len, default=()))

    return list(max((chain(m) for m in sorted(graph)), key=len))


def _depth(graph: dict[str, set[str]]) -> str:
    chain = longest_chain(graph)
    return f"import graph depth {len(chain)} floors: {' -> '.join(chain)}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the chain of modules that closes it; None when there is none."""
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [m, t] if t in path else path + [m, t]
            if t not in state and (found := visit(t, path + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def _below(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for t in graph[todo.pop()] - seen:
            seen.add(t)
            todo.append(t)
    return seen


def test_parity_has_no_import_cycles():
    """Not even through a function-level import: the reference kinds (golden) and the candidate kinds run below
    the check, whose modules alone join them (they import the candidate protocol)."""
    graph = package_imports()
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle {' -> '.join(cycle)}"
    joiners = {m for m, ts in graph.items() if "parity.candidates" in ts}
    assert joiners and joiners <= _below(graph, "parity.cli"), joiners
    kinds = [m for m in graph if m.startswith(("parity.candidates.", "parity.engines."))]  # and the engines they run
    for kind in ["parity.reference.golden", *kinds]:
        assert not _below(graph, kind) & joiners, f"{kind} imports {sorted(_below(graph, kind) & joiners)}"


def test_only_the_modules_that_run_a_model_import_the_executor():
    """The layout code (names, checkpoints, buffers, neutral, exporters, lengths) reads RoPE's math from parity.rope;
    parity.neutral.executor runs models and is imported only where a model is run."""
    graph = package_imports()
    users = {m for m, ts in graph.items() if not m.startswith("parity.neutral.executor")
             and any(t == "parity.neutral.executor" or t.startswith("parity.neutral.executor.") for t in ts)}
    assert users == set(EXECUTOR_USERS), (
        f"import parity.neutral.executor only to run a model; unexpected: {sorted(users - set(EXECUTOR_USERS))}, "
        f"no longer importing it (drop from EXECUTOR_USERS): {sorted(set(EXECUTOR_USERS) - users)}; {_depth(graph)}")
    assert not {t for t in graph["parity.rope"] if t.startswith("parity.")}, "parity.rope is pure math"


def test_the_import_graph_does_not_grow_deeper():
    graph = package_imports()
    assert _cycle(graph) is None
    floors = len(longest_chain(graph))
    assert floors <= MAX_FLOORS, f"{_depth(graph)}; at most {MAX_FLOORS} (tests/test_layers.py MAX_FLOORS)"


def test_no_private_name_is_imported_across_modules():
    """A name another module needs is public (no leading underscore): what a module keeps to itself may change
    without breaking another."""
    crossing = []
    for file in sorted((ROOT / "parity").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("parity")):
                crossing += [f"{file.relative_to(ROOT)}: from {'.' * node.level}{node.module or ''} import {a.name}"
                             for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, crossing


def test_no_module_level_state_carries_a_checks_options():
    """A check's options travel in its frozen plan: the modules that run a check keep no mutable module-level
    dict or list that a check could write into (the candidate kinds' registry is a cache of modules, not
    options)."""
    allowed = {("parity/candidates/__init__.py", "_loaded")}
    found = []
    for file in sorted((ROOT / "parity").rglob("*.py")):
        rel = str(file.relative_to(ROOT))
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Dict, ast.List, ast.Set)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and not t.id.isupper() and not t.id.startswith("__") \
                            and (rel, t.id) not in allowed:
                        found.append(f"{rel}: {t.id}")
    assert not found, found


def test_the_check_sits_above_everything_but_the_entry_points():
    """parity.checker runs both sides, so nothing below it (goldens, candidate kinds, models) imports it: only the
    entry points do."""
    graph = package_imports()
    users = {m for m, ts in graph.items() if not m.startswith("parity.checker")
             and any(t.startswith("parity.checker") for t in ts)}
    assert users <= {"parity", "parity.cli", "parity.cli.common", "parity.cli.golden", "parity.cli.selftest",
                     "parity.testing"}, users


@cache
def floors() -> dict[str, int]:
    """docs/design.md's table of floors: package or module prefix -> floor number. A ``*`` stands for any one name
    (``parity.engines.*.kind``: every engine's kind, whichever folder holds it)."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    found = {}
    for number, cells in re.findall(r"^\| (\d+) [^|]+\| ([^|]+) \|$", text, re.M):
        for name in re.findall(r"`([\w.*]+)`", cells):
            found[name] = int(number)
    assert found, "docs/design.md has no table of floors"
    return found


def _matches(prefix: str, module: str) -> bool:
    """Whether ``module`` is ``prefix`` or inside it, a ``*`` of the prefix matching any one name."""
    parts, names = prefix.split("."), module.split(".")
    return len(names) >= len(parts) and all(p in ("*", n) for p, n in zip(parts, names))


def floor_of(module: str) -> int:
    """The floor of the longest prefix ``module`` matches (in names; of two as long, the one without a ``*``)."""
    table = floors()
    best = max((p for p in table if _matches(p, module)), key=lambda p: (p.count("."), "*" not in p), default=None)
    assert best is not None, f"{module} is on no floor of docs/design.md's table: add its folder there"
    return table[best]


def test_every_import_runs_down_the_floors():
    graph = package_imports()
    up = sorted(f"{m} (floor {floor_of(m)}) imports {t} (floor {floor_of(t)})"
                for m, ts in graph.items() for t in ts if floor_of(t) > floor_of(m))
    assert not up, "imports that run up the floors (docs/design.md, Architecture):\n" + "\n".join(up)


def test_the_package_face_is_small_and_each_concern_a_folder():
    """At most 12 modules directly in parity/, and no family of files sharing a prefix (gguf_*, render_*): a concern
    with several modules is a folder."""
    top = sorted(f.stem for f in (ROOT / "parity").glob("*.py"))
    assert len(top) <= 12, top
    for folder in [ROOT / "parity", *(d for d in (ROOT / "parity").rglob("*") if d.is_dir())]:
        stems = [f.stem for f in folder.glob("*.py") if "_" in f.stem.strip("_")]
        prefixes = {}
        for stem in stems:
            prefixes.setdefault(stem.split("_")[0], []).append(stem)
        families = {k: v for k, v in prefixes.items() if len(v) > 1}
        assert not families, f"{folder.relative_to(ROOT)}: {families}: make each prefix a folder"
    assert not (ROOT / "parity" / "adapters").exists(), "the wheel force-includes adapters/ at parity/adapters"


def test_no_function_takes_more_than_12_parameters():
    """Options travel in typed objects (parity.checker.options.CheckOptions, Prompts, Outputs), not in long lists."""
    long = []
    for file in sorted((ROOT / "parity").rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                count = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
                         + (a.kwarg is not None))
                if count > 12:
                    long.append(f"{file.relative_to(ROOT)}:{node.lineno} {getattr(node, 'name', 'lambda')} ({count})")
    assert not long, long


ENGINE_WORDS = re.compile(r"gguf|ggml|llama\.?cpp|onnx|\bort\b|openvino|mlx|ctranslate|tensorrt|vllm", re.I)


def test_the_check_names_no_engine():
    """The check knows candidates only through their protocol: it imports no kind's module (nor any engine format)
    and names no engine, in its code, messages or comments; a new engine is one folder in parity/engines."""
    graph = package_imports()
    for m, ts in graph.items():
        if m.startswith("parity.checker"):
            kinds = {t for t in ts if t.startswith(("parity.candidates.", "parity.engines"))}
            assert not kinds, f"{m} imports {sorted(kinds)}"
    named = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in sorted((ROOT / "parity" / "checker").rglob("*.py"))
             for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if ENGINE_WORDS.search(line)]
    assert not named, named
