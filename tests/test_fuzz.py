"""Fuzzing every reader of untrusted bytes: corrupted configs, indexes, manifests, goldens, safetensors files,
engine dumps and ONNX files must end in a ParityError or in success, never in another exception, and never
read outside their directory.

Each corpus starts from a real file (the tiny llama checkpoint, its neutral conversion and ONNX export, the
committed llama golden, a dump of it) and corrupts it: JSON documents have keys deleted and values replaced by
other JSON types, negated, zeroed or turned into strings; binary files have their header length, header JSON,
offsets and dtypes changed, bytes flipped, and are truncated or extended. Examples are derandomized, so a run
is reproducible, and few, so the module stays under a minute on two cores; PARITY_FUZZ_SCALE=20 runs twenty
times as many (and PARITY_FUZZ_SCALE with derandomization off, PARITY_FUZZ_RANDOM=1, new ones each run).
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from parity import dumps, render
from parity.candidates import Candidate
from parity.checkpoint import inside, inventory, open_checkpoint
from parity.engines.onnx import kind as onnx_candidate
from parity.errors import ParityError
from parity.neutral.manifest import load
from parity.reference.golden import open_golden
from parity.reference.models import Models
from parity.report import Report, merge_slices
from parity.storage import shards
from tests.bad_inputs import GOLDEN, build, onnx_model
from tests.conftest import ADAPTERS, FIXTURES


def fuzz(examples: int):
    scale = int(os.environ.get("PARITY_FUZZ_SCALE", "1"))
    return settings(max_examples=examples * scale, deadline=None, database=None,
                    derandomize=os.environ.get("PARITY_FUZZ_RANDOM", "") in ("", "0"),
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The real files every corpus starts from, built once."""
    from parity.engines.onnx.export import export

    root = tmp_path_factory.mktemp("fuzz")
    built = build(root)
    export(built.checkpoint, root / "llama.onnx")
    return {"built": built, "onnx": root / "llama.onnx", "golden": open_golden(GOLDEN)}


@contextmanager
def scratch():
    """A fresh directory per example (hypothesis runs many examples in one test call), with decoys beside it:
    real files that a ../ path would reach, so that following one shows (reads_within) instead of failing."""
    with tempfile.TemporaryDirectory(prefix="parity-fuzz-") as root:
        (Path(root) / "model.safetensors").write_bytes((GOLDEN / "activations.safetensors").read_bytes())
        (Path(root) / "activations.safetensors").symlink_to(Path(root) / "model.safetensors")
        (Path(root) / "in").mkdir()
        yield Path(root) / "in"


@contextmanager
def reads_within(monkeypatch, directory: Path):
    """Every safetensors header read while inside names a path within ``directory`` (as written, before
    symlinks: the fixtures link real weights in)."""
    real_open = open
    opened: list[Path] = []
    monkeypatch.setattr(shards, "open", lambda p, *a, **k: opened.append(Path(p)) or real_open(p, *a, **k),
                        raising=False)
    yield opened
    monkeypatch.undo()
    outside = [p for p in opened if not Path(os.path.normpath(p)).is_relative_to(directory)]
    assert not outside, outside


def ends_well(call, *args, **kwargs):
    """Run a reader: a ParityError (one line) or a result; any other exception fails the example."""
    try:
        return call(*args, **kwargs)
    except ParityError as exc:
        assert "\n" not in str(exc), str(exc)
        return None


# --------------------------------------------------------------------------------------------
# Corrupting JSON documents

# paths a reader must never follow out of its directory, among the strings
PATHS = ["../model.safetensors", "../activations.safetensors", "/etc/hostname", "..", ".", "", "sub/x.safetensors",
         "model.safetensors\0"]
strings = st.text(max_size=6) | st.sampled_from(PATHS)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**66, 2**66) | st.floats() | strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=4)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


@st.composite
def corrupted(draw, doc, max_changes: int = 3):
    """``doc`` with 1..max_changes of: a key deleted or renamed (to a path, often), a value replaced by another
    JSON value, a number negated or zeroed, a value turned into a string or wrapped in a list (the root
    included)."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_changes))):
        path = draw(st.sampled_from(list(_paths(doc))))
        old = _get(doc, path)
        op = draw(st.sampled_from(["delete", "rename", "replace", "path", "path", "negate", "zero", "string",
                                   "wrap"]))
        parent = _get(doc, path[:-1]) if path else None
        if op == "delete" and path:
            del parent[path[-1]]
            continue
        if op == "rename" and isinstance(parent, dict):
            parent[draw(strings)] = parent.pop(path[-1])
            continue
        op = "replace" if op in ("delete", "rename") else op  # the root, or a list item
        new = {"replace": draw(json_values), "path": draw(st.sampled_from(PATHS)), "zero": 0, "wrap": [old],
               "string": str(old)[:8],
               "negate": -old if isinstance(old, (int, float)) and not isinstance(old, bool) else -1}[op]
        if not path:
            doc = new
        else:
            _get(doc, path[:-1])[path[-1]] = new
    return doc


def _write_json(path: Path, doc) -> None:
    path.write_text(json.dumps(doc))  # NaN and Infinity are written as Python's json reads them


# --------------------------------------------------------------------------------------------
# JSON readers

REAL_CONFIGS = sorted((FIXTURES / "configs").glob("*.json"))


@fuzz(60)
@given(data=st.data())
def test_corrupted_configs(world, data, monkeypatch):
    source = data.draw(st.sampled_from([world["built"].checkpoint / "config.json", *REAL_CONFIGS]))
    config = data.draw(corrupted(json.loads(source.read_text())))
    with scratch() as d:
        _write_json(d / "config.json", config)
        if source.parent == world["built"].checkpoint:  # with its weights: the tensors are listed too
            (d / "model.safetensors").symlink_to(source.parent / "model.safetensors")
        with reads_within(monkeypatch, d):
            ends_well(open_checkpoint, d, adapters=ADAPTERS)


@fuzz(40)
@given(data=st.data())
def test_corrupted_safetensors_indexes(world, data, monkeypatch):
    weights = world["built"].checkpoint / "model.safetensors"
    with safe_open(weights, "pt") as handle:
        index = {"metadata": {"total_size": weights.stat().st_size},
                 "weight_map": {name: "model.safetensors" for name in handle.keys()}}
    doc = data.draw(corrupted(index))
    with scratch() as d:
        shutil.copyfile(world["built"].checkpoint / "config.json", d / "config.json")
        (d / "model.safetensors").symlink_to(weights)
        _write_json(d / "model.safetensors.index.json", doc)
        with reads_within(monkeypatch, d):
            ends_well(open_checkpoint, d, adapters=ADAPTERS)


@fuzz(60)
@given(data=st.data())
def test_corrupted_manifests(world, data, monkeypatch):
    neutral = world["built"].neutral
    manifest = data.draw(corrupted(json.loads((neutral / "manifest.json").read_text())))
    with scratch() as d:
        (d / "model.safetensors").symlink_to(neutral / "model.safetensors")
        _write_json(d / "manifest.json", manifest)
        with reads_within(monkeypatch, d):
            ends_well(load, d)


@fuzz(50)
@given(data=st.data())
def test_corrupted_goldens(world, data, monkeypatch):
    description = data.draw(corrupted(json.loads((GOLDEN / "golden.json").read_text())))
    with scratch() as d:
        golden = d / "golden"
        golden.mkdir()
        shutil.copyfile(GOLDEN / "activations.safetensors", golden / "activations.safetensors")
        _write_json(golden / "golden.json", description)
        with reads_within(monkeypatch, golden):
            g = ends_well(open_golden, golden)
        if g is not None:  # what a check then asks of it must work
            g.inputs()
            g.runner(0)(lambda name, t: None)
            for name in g.points:
                g.noise(0, name, g.dtype)
                g.rounding(0, name)


# --------------------------------------------------------------------------------------------
# safetensors files


@st.composite
def damaged_safetensors(draw, raw: bytes) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    how = draw(st.sampled_from(["length", "header", "offsets", "dtype", "flip", "truncate", "extend"]))
    if how == "length":
        length = draw(st.integers(0, 2**64 - 1) | st.integers(n - 16, n + 16).filter(lambda x: x >= 0))
        return struct.pack("<Q", length) + raw[8:]
    if how in ("header", "offsets", "dtype"):
        names = [k for k in header if k != "__metadata__"]
        name = draw(st.sampled_from(names))
        if how == "header":
            header = draw(corrupted(header))
        elif how == "offsets":
            header[name]["data_offsets"] = draw(st.lists(st.integers(-8, len(data) + 64), min_size=0, max_size=3))
        else:
            header[name]["dtype"] = draw(st.sampled_from(list(shards.DTYPE_BITS)) | st.text(max_size=5))
        text = json.dumps(header).encode()
        keep_length = draw(st.booleans())
        return struct.pack("<Q", n if keep_length else len(text)) + text + data
    if how == "flip":
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 8))):
            k = draw(st.integers(0, min(len(out), 8 + n + 64) - 1))
            out[k] ^= draw(st.integers(1, 255))
        return bytes(out)
    if how == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    return raw + draw(st.binary(min_size=1, max_size=64))


@fuzz(80)
@given(data=st.data())
def test_corrupted_safetensors_files(world, data):
    content = data.draw(damaged_safetensors((GOLDEN / "activations.safetensors").read_bytes()))
    with scratch() as d:
        path = d / "x.safetensors"
        path.write_bytes(content)
        header = ends_well(shards.read_header, path)
        ends_well(inventory, [path])
        ends_well(dumps.read_ids, path)
        if header is not None:  # accepted: safetensors itself must be able to read every tensor
            with safe_open(path, "pt") as handle:
                assert set(handle.keys()) == set(header.tensors)
                for name, entry in header.tensors.items():
                    if entry.dtype not in ("F6_E2M3", "F6_E3M2"):  # dtypes torch has no type for
                        handle.get_tensor(name)


# --------------------------------------------------------------------------------------------
# Engine dumps

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool]


@fuzz(50)
@given(data=st.data())
def test_corrupted_engine_dumps(world, data):
    built = world["built"]
    tensors = load_file(built.dump)
    ids_text = json.dumps(built.ids)
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["ids", "ids-json", "shape", "dtype", "drop", "rename"]))
        name = data.draw(st.sampled_from(sorted(tensors))) if tensors else None
        if how == "ids":
            ids_text = data.draw(st.text(max_size=20))
        elif how == "ids-json":
            ids_text = json.dumps(data.draw(json_values | st.just(built.ids[:-1]) | st.just([built.ids])))
        elif name is None:
            continue
        elif how == "shape":
            shape = data.draw(st.lists(st.integers(0, 3), max_size=4) |
                              st.sampled_from([(1, 80, 63), (1, 79, 64), (2, 80, 64), (1, 80, 300), (80, 64)]))
            tensors[name] = torch.zeros(shape)
        elif how == "dtype":
            tensors[name] = tensors[name].to(data.draw(st.sampled_from(DTYPES)))
        elif how == "drop":
            del tensors[name]
        else:
            tensors[data.draw(st.sampled_from(["layers.9.out", "layer.0.out", "logits.x", "layers.0.q", ""]))] = \
                tensors.pop(name)
    with scratch() as d:
        path = d / "dump.safetensors"
        save_file(tensors, path, metadata={"input_ids": ids_text})
        run = ends_well(dumps.dump_runner, Candidate(Models(), path, torch.float32, world["golden"].checkpoint),
                        torch.tensor([built.ids]), None)
        if run is not None:
            ends_well(run, lambda name, t: None)


# --------------------------------------------------------------------------------------------
# ONNX files


@contextmanager
def counted_sessions(monkeypatch):
    """onnxruntime sessions opened while inside (each a path or serialized model)."""
    import onnxruntime

    real = onnxruntime.InferenceSession
    calls: list = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    yield calls
    monkeypatch.setattr(onnxruntime, "InferenceSession", real)


def _run_onnx(world, path: Path) -> None:
    ids = torch.tensor([world["built"].ids[:6]])
    run = ends_well(onnx_candidate.make_runner, Candidate(Models(), path, torch.float32, world["golden"].checkpoint),
                    ids, None)
    if run is not None:
        ends_well(run, lambda name, t: None)


@fuzz(25)
@given(data=st.data())
def test_corrupted_onnx_files(world, data):
    raw = world["onnx"].read_bytes()
    how = data.draw(st.sampled_from(["random", "flip", "truncate"]))
    if how == "random":
        content = data.draw(st.binary(max_size=512))
    elif how == "truncate":
        content = raw[:data.draw(st.integers(0, len(raw) - 1))]
    else:
        content = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 16))):
            content[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        content = bytes(content)
    with scratch() as d:
        path = d / "model.onnx"
        path.write_bytes(content)
        _run_onnx(world, path)


LOCATION_PARTS = ["..", ".", "weights.data", "sub", "link.data", "secret.data", "", "/"]


@fuzz(40)
@given(data=st.data())
def test_external_data_never_leaves_the_model_directory(world, data, monkeypatch):
    parts = data.draw(st.lists(st.sampled_from(LOCATION_PARTS), min_size=1, max_size=4))
    with scratch() as d:
        secret = d / "secret.data"
        secret.write_bytes(b"\0" * 64)  # beside the model's directory, never to be read
        absolute = data.draw(st.booleans())
        location = (str(d) + "/" if absolute else "") + "/".join(parts)
        path = onnx_model(d, location, data=b"\0" * data.draw(st.sampled_from([0, 8, 16, 64])))
        model_dir = path.parent
        (model_dir / "sub").mkdir()
        (model_dir / "link.data").symlink_to(secret)
        with counted_sessions(monkeypatch) as sessions:
            try:
                onnx_candidate.open_model(path)
                accepted = True
            except ParityError:
                accepted = False
            _run_onnx(world, path)
        target = model_dir / location
        if not inside(target, model_dir) or ".." in location.split("/") or absolute:
            assert not accepted and sessions == [], location


# --------------------------------------------------------------------------------------------
# parity report merge


@pytest.fixture(scope="module")
def slices(world):
    """The JSON reports of the tiny llama's two layers checked as slices."""
    from parity.checker.run import check

    built = world["built"]
    return [json.loads(render.WRITERS[".json"](check(built.checkpoint, built.neutral, layerwise=True, layers=span)))
            for span in ("0:1", "1:2")]


@fuzz(60)
@given(data=st.data())
def test_corrupted_reports_to_merge(slices, data):
    k = data.draw(st.integers(0, 1))
    docs = list(slices)
    docs[k] = data.draw(corrupted(docs[k]))
    reports = ends_well(lambda: [(f"slice{i}.json", Report.from_json(doc, f"slice{i}.json"))
                                 for i, doc in enumerate(docs)])
    merged = reports and ends_well(merge_slices, reports)
    if merged:  # what merge then does with it must work
        render.console(merged, Console(file=io.StringIO(), width=120))
        for fmt in render.WRITERS:
            render.WRITERS[fmt](merged)
