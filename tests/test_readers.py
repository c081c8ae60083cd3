"""Readers of untrusted bytes, case by case: each refusal is a ParityError naming the file, nothing else escapes,
and nothing outside the input is read."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import parity
from parity import dumps
from parity.candidates import Candidate, Notes
from parity.checkpoint import open_checkpoint, read_config
from parity.engines.onnx import kind as onnx_candidate
from parity.errors import ParityError
from parity.neutral.manifest import load, read_manifest
from parity.reference.golden import open_golden
from parity.reference.models import Models
from parity.storage import shards
from tests.bad_inputs import GOLDEN, build, onnx_model, safetensors_bytes, sentinel
from tests.conftest import FIXTURES


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(tmp_path_factory.mktemp("readers"))


def refused(match: str, call, *args, **kwargs) -> str:
    with pytest.raises(ParityError, match=match) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------
# safetensors headers


def _file(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    return path


def _raw(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


def _entry(dtype="F32", shape=(2,), begin=0, end=8) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def test_a_real_header_reads_as_safetensors_sees_it(built):
    header = shards.read_header(built.dump)
    with safe_open(built.dump, "pt") as handle:
        assert set(header.tensors) == set(handle.keys())
        assert header.metadata == handle.metadata()
        for name, entry in header.tensors.items():
            assert list(entry.shape) == handle.get_slice(name).get_shape()
            assert entry.dtype == handle.get_slice(name).get_dtype()


BAD_HEADERS = [
    (b"", "0 bytes, shorter than the 8-byte header length"),
    (b"\x01\x00\x00", "shorter than the 8-byte"),
    (struct.pack("<Q", 2**64 - 1) + b"{}", "header length 18446744073709551615 exceeds the file's 2"),
    (struct.pack("<Q", 3) + b"{}", "exceeds the file's 2 remaining bytes"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "header is not UTF-8"),
    (struct.pack("<Q", 4) + b"{{}}", "header is not valid JSON"),
    (struct.pack("<Q", 2) + b"[]", "header is a JSON list, not an object"),
    (struct.pack("<Q", 9) + b'{"a": 1} ', "tensor 'a' needs dtype, shape and data_offsets"),
    (safetensors_bytes({"a": _entry(dtype="F12")}, b"\0" * 8), "unknown dtype 'F12'"),
    (safetensors_bytes({"a": _entry(shape=(-2,))}, b"\0" * 8), "not a list of non-negative integers"),
    (safetensors_bytes({"a": _entry(shape=(True, 2))}, b"\0" * 8), "not a list of non-negative integers"),
    (safetensors_bytes({"a": _entry(shape=(2.0,))}, b"\0" * 8), "not a list of non-negative integers"),
    (safetensors_bytes({"a": {**_entry(), "shape": "2"}}, b"\0" * 8), "not a list of non-negative integers"),
    (safetensors_bytes({"a": _entry(begin=8, end=0)}, b"\0" * 8), "not \\[begin, end\\] with begin <= end"),
    (safetensors_bytes({"a": {**_entry(), "data_offsets": [0]}}, b"\0" * 8), "not \\[begin, end\\]"),
    (safetensors_bytes({"a": _entry(end=12)}, b"\0" * 12), "needs 8 bytes but its data_offsets span 12"),
    (safetensors_bytes({"a": _entry(shape=(2**40, 2**40))}, b"\0" * 8), "needs more bytes than the file's 8"),
    (safetensors_bytes({"a": _entry(shape=(2**62,) * 200_000)}, b"\0" * 8), "200000 dims\\) needs more bytes"),
    (safetensors_bytes({"a": _entry(shape=(2, 3), end=8)}, b"\0" * 8), "needs 24 bytes but its data_offsets span 8"),
    (safetensors_bytes({"a": _entry(dtype="F4", shape=(3,), end=1)}, b"\0"), "needs 1.5 bytes"),
    (safetensors_bytes({"a": _entry(), "b": _entry(begin=4, end=12)}, b"\0" * 12), "overlapping"),
    (safetensors_bytes({"a": _entry(), "b": _entry(begin=12, end=20)}, b"\0" * 20), "a gap before it"),
    (safetensors_bytes({"a": _entry()}, b"\0" * 4), "cover 8 bytes of data but the file holds 4 \\(truncated\\)"),
    (safetensors_bytes({"a": _entry()}, b"\0" * 9), "cover 8 bytes of data but the file holds 9"),
    (safetensors_bytes({"__metadata__": {"input_ids": [1, 2]}}), "__metadata__ must map names to strings"),
    (safetensors_bytes({"__metadata__": "x"}), "__metadata__ must map names to strings"),
    (_raw(b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":1}'), "'a' appears twice"),
    (_raw(b"[" * 100000 + b"]" * 100000), "header is not valid JSON"),
]


@pytest.mark.parametrize("content,problem", BAD_HEADERS, ids=[f"{k}-{p[:40]}" for k, (_, p) in enumerate(BAD_HEADERS)])
def test_a_bad_header_is_refused_naming_the_file(tmp_path, content, problem):
    path = _file(tmp_path, content)
    message = refused(problem, shards.read_header, path, "write it again")
    assert message.startswith(f"{path}: not a readable safetensors file (") and message.endswith("; write it again")


def test_an_absurd_header_length_is_refused_without_reading_it(tmp_path, monkeypatch):
    path = _file(tmp_path, struct.pack("<Q", 2**40) + b"{}" + b"\0" * 100)
    reads = []
    real_open = open

    def spy(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        real_read = handle.read
        handle_reads = lambda n=-1: (reads.append(n), real_read(n))[1]  # noqa: E731
        return type("H", (), {"read": staticmethod(handle_reads), "fileno": handle.fileno,
                              "__enter__": lambda s: s, "__exit__": lambda s, *a: handle.close()})()

    monkeypatch.setattr(shards, "open", spy, raising=False)
    refused("exceeds the file's", shards.read_header, path)
    assert reads == [8]


def test_edge_cases_safetensors_allows_are_read(tmp_path):
    header = shards.read_header(_file(tmp_path, safetensors_bytes({})))
    assert header.tensors == {} and header.metadata == {}
    packed = shards.read_header(_file(tmp_path, safetensors_bytes(
        {"__metadata__": None, "e": _entry(shape=(0, 3), end=0), "f": _entry(dtype="F4", shape=(2,), end=1)}, b"\0")))
    assert packed.tensors["f"].end == 1 and packed.tensors["e"].shape == (0, 3)


def test_a_missing_or_directory_path_is_refused(tmp_path):
    refused("no such file", shards.read_header, tmp_path / "nope.safetensors")
    refused("cannot be read", shards.read_header, tmp_path)


# --------------------------------------------------------------------------------------------
# Checkpoints: config.json, the index, the weights


def _checkpoint(tmp_path: Path, built, config: dict | None = None) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copyfile(built.checkpoint / "model.safetensors", d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(config or json.loads((built.checkpoint / "config.json").read_text())))
    return d


def test_every_real_config_passes_the_config_checks():
    for path in sorted((FIXTURES / "configs").glob("*.json")):
        assert read_config(path)[0]


@pytest.mark.parametrize("key,value,problem", [
    ("hidden_size", "64", "hidden_size must be a positive integer \\(got \"64\"\\)"),
    ("hidden_size", 0, "hidden_size must be a positive integer"),
    ("vocab_size", True, "vocab_size must be a positive integer"),
    ("num_hidden_layers", 2.0, "num_hidden_layers must be a positive integer"),
    ("num_hidden_layers", 10**8, "num_hidden_layers must be at most 10,000"),
    ("sliding_window", -1, "sliding_window must be a non-negative integer"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps must be a non-negative number"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps must be a non-negative number"),
    ("rope_theta", 0, "rope_theta must be a positive number"),
    ("rope_parameters", [1], "rope_parameters must be a JSON object"),
    ("architectures", "LlamaForCausalLM", "architectures must be a list of class names"),
    ("architectures", [1], "architectures must be a list of class names"),
    ("model_type", 5, "model_type must be a string"),
    ("text_config", {"hidden_size": -1}, "text_config.hidden_size must be a positive integer"),
    ("rope_parameters", {"rope_type": "llama3", "factor": "8"}, "rope_parameters.factor must be a positive number"),
    ("rope_parameters", {"rope_type": 3}, "rope_parameters.rope_type must be a string"),
    ("rope_parameters", {"full_attention": {"rope_theta": -1}},
     "rope_parameters.full_attention.rope_theta must be a positive number"),
])
def test_a_config_value_of_the_wrong_type_is_refused(tmp_path, built, key, value, problem):
    config = json.loads((built.checkpoint / "config.json").read_text())
    config[key] = value
    message = refused(problem, open_checkpoint, _checkpoint(tmp_path, built, config))
    assert "config.json" in message and "fix the config" in message


def test_a_config_that_does_not_resolve_is_one_error(tmp_path, built, monkeypatch):
    from parity import checkpoint

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for //: 'str' and 'int'")

    monkeypatch.setattr(checkpoint, "resolve", broken)
    refused("config.json: does not resolve as a llama config \\(TypeError: unsupported operand",
            open_checkpoint, _checkpoint(tmp_path, built))


def test_unreadable_configs(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").mkdir()
    refused("not a file", read_config, tmp_path / "d")
    (tmp_path / "latin1.json").write_bytes(b'{"model_type": "\xe9"}')
    refused("not valid JSON", read_config, tmp_path / "latin1.json")


def _index(d: Path, weight_map) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("weight_map,problem", [
    ({}, "not a safetensors index"),
    ([1], "not a safetensors index"),
    ({"lm_head.weight": 3}, "not a safetensors index"),
    ({"lm_head.weight": "../ckpt/model.safetensors"}, "shard names must be file names"),
    ({"lm_head.weight": "/etc/passwd"}, "shard names must be file names"),
    ({"lm_head.weight": ".."}, "shard names must be file names"),
    ({"lm_head.weight": "other.safetensors"}, "names shard\\(s\\) that are not there: other.safetensors"),
    ({"no.such.tensor": "model.safetensors"}, "1 tensor\\(s\\) not where the index says: no.such.tensor"),
])
def test_a_bad_index_is_refused(tmp_path, built, weight_map, problem):
    d = _checkpoint(tmp_path, built)
    _index(d, weight_map)
    refused(problem, open_checkpoint, d)


def test_an_index_that_is_not_an_object_and_a_tensor_in_two_shards(tmp_path, built):
    d = _checkpoint(tmp_path, built)
    (d / "model.safetensors.index.json").write_text("[]")
    refused("not a safetensors index", open_checkpoint, d)
    (d / "model.safetensors.index.json").unlink()
    save_file({"lm_head.weight": torch.zeros(1)}, d / "extra.safetensors")
    refused("tensor lm_head.weight is also in", open_checkpoint, d)


def test_a_good_index_is_read(tmp_path, built):
    d = _checkpoint(tmp_path, built)
    with safe_open(d / "model.safetensors", "pt") as handle:
        _index(d, {name: "model.safetensors" for name in handle.keys()})
    ckpt = open_checkpoint(d)
    assert ckpt.files == [d / "model.safetensors"] and "lm_head.weight" in ckpt.tensors


# --------------------------------------------------------------------------------------------
# Neutral directories: manifest.json


@pytest.fixture
def neutral(tmp_path, built):
    d = tmp_path / "n"
    shutil.copytree(built.neutral, d)
    return d


def _edit_manifest(d: Path, change) -> None:
    """Apply ``change`` to the manifest: it edits in place, or returns a replacement (a list, a string)."""
    m = json.loads((d / "manifest.json").read_text())
    replaced = change(m)
    (d / "manifest.json").write_text(json.dumps(m if replaced is None else replaced))


def _tensor(name: str, change):
    return lambda m: change(m["tensors"], name) and None


def _at(m: dict, path: str):
    node = m
    for p in path.split("."):
        node = node[int(p)] if isinstance(node, list) else node[p]
    return node


def _put(path: str, value):
    """A change to a JSON document: set (or, with KeyError, delete) the value at a dotted path."""
    def change(m):
        *head, last = path.split(".")
        parent = _at(m, ".".join(head)) if head else m
        last = int(last) if isinstance(parent, list) else last
        if value is KeyError:
            del parent[last]
        else:
            parent[last] = value
    return change


@pytest.mark.parametrize("change,problem", [
    (lambda m: [m], "expected a JSON object, found list"),
    (lambda m: "x", "expected a JSON object, found str"),
    (_put("format_version", 2), "not a parity-neutral v1 manifest"),
    (_put("layers", KeyError), "layers: Field required"),
    (_put("layers.0.attention.heads", KeyError), "layers.0.attention.heads: Field required"),
    (_put("layers.0.attention.heads", 4.0), "layers.0.attention.heads: Input should be a valid integer"),
    (_put("layers.0.attention.heads", True), "layers.0.attention.heads: Input should be a valid integer"),
    (_put("layers.0.attention.heads", -4), "layers.0.attention.heads: Input should be greater than 0"),
    (_put("hidden_size", 0), "hidden_size: Input should be greater than 0"),
    (_put("layers.0.attention.rope.style", "diagonal"), "rope.style: Input should be 'half' or 'interleaved'"),
    (_put("layers.0.attention.rope.scaling.rope_type", "warp"), "unknown RoPE scaling type 'warp'"),
    (_put("layers.0.attention.rope.scaling.factor", KeyError), "llama3 scaling needs factor"),
    (_put("layers.0.attention.rope.scaling.low_freq_factor", 4.0), "high_freq_factor must exceed low_freq_factor"),
    (_put("layers.0.attention.rope.scaling.factor", "8"), "factor: must be a positive number"),
    (_put("layers.0.attention.rope.rotary_dim", 15), "rotary_dim: 15 must be even and at most 16"),
    (_put("layers.0.attention.rope.theta", float("nan")), "theta: Input should be a finite number"),
    (_put("final_norm.kind", "batchnorm"), "final_norm.kind: Input should be 'rmsnorm' or 'layernorm'"),
    (_put("layers.0.norms.attn_norm.eps", -1.0), "eps: Input should be greater than or equal to 0"),
    (_put("layers.0.mlp.activation", "swish"), "layers.0.mlp.activation: Input should be"),
    (_put("layers.0.attention.kv_heads", 3), "heads 4 is not a multiple of kv_heads 3"),
    (_put("layers.0.attention.kv_shared_from", 1), "kv_shared_from: 1 is not an earlier layer"),
    (_put("layers.0.attention.kind", "mla"), "kind 'mla' but mla is null"),
    (_put("num_layers", 3), "layers: 2 entries for num_layers 3"),
    (_put("dtype", "int8"), "dtype: Input should be"),
    (_put("files", {}), "files: lists no file"),
    (_put("vocab_size", 300), "tensors.embed.tokens.weight: shape \\[256, 64\\] does not match the sizes"),
    (_put("layers.1.attention.head_dim", 32), "tensors.layers.1.attn.q.weight: shape \\[64, 64\\] does not match"),
    (_tensor("layers.1.attn.o.weight", dict.pop), "tensors: layers.1.attn.o.weight is missing"),
    (_tensor("final_norm.weight", lambda t, n: t[n].update(file="other.safetensors")), "name file 'other.safetensors'"),
    (_put("capture_points", "embed"), "capture_points: Input should be a valid list"),
    (lambda m: m["files"]["model.safetensors"].pop("blake3_tensors") and None,
     "files.model.safetensors: Value error, needs one hash: blake3_tensors \\(or blake3 or sha256"),
    (lambda m: m["files"]["model.safetensors"].update(sha256="0" * 64), "needs one hash"),
    (lambda m: m["files"]["model.safetensors"].update(blake3_tensors=7),
     "files.model.safetensors.blake3_tensors: Input should be"),
    (_put("source.hash", "md5"), "source.hash: Input should be 'blake3_tensors', 'blake3' or 'sha256'"),
])
def test_a_bad_manifest_is_refused_at_load(neutral, change, problem):
    _edit_manifest(neutral, change)
    message = refused(problem, load, neutral)
    assert "manifest.json" in message and "re-convert" in message


@pytest.mark.parametrize("files,problem", [
    ({"../model.safetensors": {"sha256": "", "bytes": 0}}, "is not a file name in the directory"),
    ({"/tmp/model.safetensors": {"sha256": "", "bytes": 0}}, "is not a file name in the directory"),
])
def test_manifest_files_outside_the_directory_are_refused(neutral, files, problem, monkeypatch):
    def change(m):
        m["files"] = files
        for t in m["tensors"].values():
            t.pop("file")

    _edit_manifest(neutral, change)
    monkeypatch.setattr(shards, "open", lambda *a, **k: pytest.fail(f"opened {a[0]}"), raising=False)
    refused(problem, load, neutral)


def test_a_manifest_hashes_its_files_by_parts_and_older_sha256_ones_still_verify(neutral):
    manifest = read_manifest(neutral)
    assert manifest.source.hash == shards.HASH
    assert list(manifest.to_json()["files"]["model.safetensors"]) == [shards.HASH, "bytes"]
    load(neutral, verify=True)

    def as_before(m):  # what parity wrote before BLAKE3: sha256 everywhere, no source.hash
        del m["source"]["hash"]
        m["files"]["model.safetensors"] = {"sha256": shards.sha256_file(neutral / "model.safetensors"),
                                           "bytes": m["files"]["model.safetensors"]["bytes"]}

    _edit_manifest(neutral, as_before)
    assert read_manifest(neutral).files["model.safetensors"].sha256
    load(neutral, verify=True)
    data = bytearray((neutral / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (neutral / "model.safetensors").write_bytes(bytes(data))
    refused("model.safetensors: its sha256 differs from the manifest's; the file changed after conversion", load,
            neutral, verify=True)
    load(neutral)  # unverified, as `parity run` and `check` read it


def test_the_files_must_hold_what_the_manifest_states(neutral):
    tensors = load_file(neutral / "model.safetensors")
    save_file({**tensors, "final_norm.weight": torch.zeros(65)}, neutral / "model.safetensors")
    refused("final_norm.weight is F32 \\[65\\] but the manifest says F32 \\[64\\]", load, neutral)
    save_file({**tensors, "final_norm.weight": torch.zeros(64, dtype=torch.float16)}, neutral / "model.safetensors")
    refused("final_norm.weight is F16 \\[64\\] but the manifest says F32 \\[64\\]", load, neutral)
    save_file({k: v for k, v in tensors.items() if k != "final_norm.weight"}, neutral / "model.safetensors")
    refused("tensors listed in the manifest are missing: final_norm.weight", load, neutral)
    (neutral / "model.safetensors").write_bytes(b"")
    refused("model.safetensors: not a readable safetensors file", load, neutral)
    (neutral / "manifest.json").write_text("{")
    refused("not valid JSON", read_manifest, neutral)


def test_families_with_mla_moe_and_per_layer_inputs_load(tiny_dir, tmp_path):
    from parity.neutral.converter import convert

    for family in ("deepseek_v3", "gemma4", "bert"):
        manifest, tensors = load(convert(tiny_dir(family), tmp_path / family) and tmp_path / family)
        assert set(manifest.tensors) <= set(tensors)


# --------------------------------------------------------------------------------------------
# Goldens: golden.json and its activations


@pytest.fixture
def golden(tmp_path):
    d = tmp_path / "golden"
    shutil.copytree(GOLDEN, d)
    return d


def _edit_golden(d: Path, change) -> None:
    g = json.loads((d / "golden.json").read_text())
    replaced = change(g)
    (d / "golden.json").write_text(json.dumps(g if replaced is None else replaced))


@pytest.mark.parametrize("change,problem", [
    (lambda g: [g], "not a parity-golden v1 description"),
    (_put("runs", KeyError), "runs: Field required"),
    (_put("runs", []), "runs: List should have at least 1 item"),
    (_put("runs.0.ids", "1,2"), "runs.0.ids: Input should be a valid list"),
    (_put("runs.0.ids", []), "runs.0.ids: List should have at least 1 item"),
    (_put("runs.0.ids.0", True), "runs.0.ids.0: Input should be a valid integer"),
    (_put("runs.0.ids.0", -1), "runs.0.ids.0: Input should be greater than or equal to 0"),
    (_put("runs.0.ids.0", 256), "holds token ids outside \\[0, 256\\): \\[256\\]"),
    (_put("runs.0.file", "../outside.safetensors"), "is not a file in the golden directory"),
    (_put("runs.0.file", "/etc/passwd"), "is not a file in the golden directory"),
    (_put("runs.0.file", 7), "runs.0.file: Input should be a valid string"),
    (_put("runs.0.points.embed", KeyError), "does not describe embed"),
    (_put("runs.0.points.embed.shape", [1, 80, 65]), "embed is F16 \\[1, 80, 64\\] \\(golden.json: \\[1, 80, 65\\]\\)"),
    (_put("runs.0.points.embed.noise", "small"), "runs.0.points.embed.noise: Input should be a valid number"),
    (_put("capture_points", "embed"), "capture_points: Input should be a valid list"),
    (_put("capture_points", [1]), "capture_points.0: Input should be a valid string"),
    (_put("capture_points", ["embed", "embed"]), "some appear twice"),
    (_put("capture_points", ["layers.7.out"]), "must be distinct capture points of this llama model; layers.7.out"),
    (_put("dtype", "float8"), "dtype: Input should be"),
    (_put("recorded_with", {}), "recorded_with.torch: Field required"),
    (_put("checkpoint.config.hidden_size", "64"), "checkpoint.config.hidden_size must be a positive integer"),
    (_put("family", "gemma"), "recorded as gemma but its config reads as llama"),
])
def test_a_bad_golden_is_refused(golden, change, problem):
    _edit_golden(golden, change)
    message = refused(problem, open_golden, golden)
    assert str(golden) in message


def test_a_golden_never_reads_outside_its_directory(golden, tmp_path, monkeypatch):
    outside = sentinel(tmp_path)
    (golden / "activations.safetensors").unlink()
    (golden / "activations.safetensors").symlink_to(outside)
    opened = []
    monkeypatch.setattr(shards, "open", lambda *a, **k: opened.append(a[0]) or open(*a, **k), raising=False)
    refused("is not a file in the golden directory", open_golden, golden)
    for name in ("../secret.data", str(outside)):
        _edit_golden(golden, _put("runs.0.file", name))
        refused("is not a file in the golden directory", open_golden, golden)
    assert opened == []


def test_golden_activations_must_match_the_description(golden):
    tensors = load_file(golden / "activations.safetensors")
    with safe_open(golden / "activations.safetensors", "pt") as handle:
        metadata = handle.metadata()
    save_file({**tensors, "embed": tensors["embed"].to(torch.int16)}, golden / "activations.safetensors", metadata)
    refused("embed is I16", open_golden, golden)
    save_file(tensors, golden / "activations.safetensors", {"input_ids": "[1, 2]"})
    refused("its input ids differ from those golden.json records", open_golden, golden)
    save_file({k: v for k, v in tensors.items() if k != "logits"}, golden / "activations.safetensors", metadata)
    refused("missing logits", open_golden, golden)


# --------------------------------------------------------------------------------------------
# Engine dumps


@pytest.mark.parametrize("raw,problem", [
    ("20, 96", "is not a JSON list of token ids"),
    ('{"ids": [1]}', "is not a JSON list of token ids"),
    ("[]", "is not a JSON list of token ids"),
    ("7", "is not a JSON list of token ids"),
    ("[1.0, 2]", "holds something other than integer token ids"),
    ("[true, 2]", "holds something other than integer token ids"),
    ('["1"]', "holds something other than integer token ids"),
    ("[[1, 2], [3]]", "has rows of different lengths"),
    ("[1, [2]]", "holds something other than integer token ids"),
    ("[[1], 2]", "mixes ids and rows"),
    ("[[[1]]]", "holds something other than integer token ids"),
    ("[[]]", "mixes ids and rows, or has an empty row"),
    ("[-3, 1]", "holds negative token ids"),
    ("[" * 5000 + "]" * 5000, "is not a JSON list of token ids"),
])
def test_bad_input_ids_metadata_is_refused(raw, problem):
    message = refused(problem, dumps.parse_ids, raw, Path("d.safetensors"))
    assert message.startswith("d.safetensors: metadata 'input_ids' ")


def test_good_input_ids_metadata():
    assert dumps.parse_ids("[1, 2]", Path("d")) == [[1, 2]]
    assert dumps.parse_ids("[[1, 2], [3, 4]]", Path("d")) == [[1, 2], [3, 4]]


def _replay(built, path: Path, models=None, feed=None, notes=None) -> dict:
    golden = open_golden(GOLDEN)
    got = {}
    candidate = Candidate(models or Models(), path, torch.float32, golden.checkpoint, notes=notes or Notes())
    run = dumps.dump_runner(candidate, torch.tensor([built.ids]), feed)
    run(lambda name, t: got.__setitem__(name, t))
    return got


def _dump(tmp_path: Path, built, change, metadata=None) -> Path:
    tensors = load_file(built.dump)
    change(tensors)
    path = tmp_path / "d.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata or {"input_ids": json.dumps(built.ids)})
    return path


@pytest.mark.parametrize("change,problem", [
    (lambda t: t.update(embed=t["embed"][0]),
     "embed has shape \\[80, 64\\], expected \\[batch=1, seq=80, hidden=64\\]"),
    (lambda t: t.update(embed=t["embed"][:, :79]), "embed has shape \\[1, 79, 64\\]"),
    (lambda t: t.update(embed=t["embed"][..., :63]), "embed has shape \\[1, 80, 63\\]"),
    (lambda t: t.update(embed=torch.cat([t["embed"]] * 2)), "embed has shape \\[2, 80, 64\\]"),
    (lambda t: t.update(logits=t["logits"][..., :255]), "logits has shape \\[1, 80, 255\\], expected .*vocab=256"),
    (lambda t: t.update(logits=t["logits"].to(torch.int64)), "logits is I64; activations must be a float dtype"),
    (lambda t: t.update({"layers.0.q": torch.zeros(2, dtype=torch.bool)}), "layers.0.q is BOOL"),
])
def test_a_dump_of_the_wrong_shape_or_dtype_is_refused(tmp_path, built, change, problem):
    refused(problem, _replay, built, _dump(tmp_path, built, change))


def test_a_padded_vocabulary_is_sliced_with_a_warning(tmp_path, built):
    pad = lambda t: t.update(logits=torch.cat([t["logits"], torch.full((1, 80, 64), -1e4)], -1))  # noqa: E731
    path = _dump(tmp_path, built, pad)
    notes = Notes()
    got = _replay(built, path, notes=notes)
    assert got["logits"].shape == (1, 80, 256)
    assert torch.equal(got["logits"], load_file(built.dump)["logits"])
    assert any("320 wide for a vocabulary of 256" in w for w in notes.warnings)
    report = parity.check(GOLDEN, path, layerwise=True)
    assert report.verdict == "pass" and any("padded vocabulary" in w for w in report.warnings)


def test_a_dump_that_is_not_safetensors_is_refused(tmp_path, built):
    path = tmp_path / "d.safetensors"
    path.write_bytes(b"\0" * 7)
    refused("not a readable safetensors file", _replay, built, path)
    refused("drop --isolate", _replay, built, built.dump, feed=lambda i, x: x)


# --------------------------------------------------------------------------------------------
# ONNX files


@pytest.fixture
def no_onnxruntime(monkeypatch):
    """onnxruntime must never see a refused model: any session it would open fails the test."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: pytest.fail("onnxruntime was called"))


def _run_onnx(path: Path, built) -> None:
    golden = open_golden(GOLDEN)
    run = onnx_candidate.make_runner(Candidate(Models(), path, torch.float32, golden.checkpoint),
                                     torch.tensor([built.ids[:4]]), None)
    run(lambda name, t: None)


def test_a_valid_model_with_external_data_opens(tmp_path):
    import onnxruntime

    path = onnx_model(tmp_path)
    assert onnx_candidate.open_model(path).graph.initializer[0].data_location == 1
    assert onnxruntime.InferenceSession(str(path)).run(None, {})[0].tolist() == [2, 4, 6, 8]


@pytest.mark.parametrize("make,problem", [
    (lambda t: t / "m.onnx", "cannot be read"),
    (lambda t: _bytes(t, b""), "empty file, not an ONNX model"),
    (lambda t: _bytes(t, random.Random(0).randbytes(64) + b"\xff" * 8), "not a readable ONNX model|not an ONNX model"),
    (lambda t: _bytes(t, b"\x0a\x03abc"), "not an ONNX model \\(no IR version, graph or outputs\\)"),
    (lambda t: _bytes(t, onnx_model(t).read_bytes()[:40]), "not a readable ONNX model|not an ONNX model"),
    (lambda t: onnx_model(t, str(sentinel(t))), "outside the model's directory"),
    (lambda t: onnx_model(t, "../secret.data") if sentinel(t) else None, "outside the model's directory"),
    (lambda t: onnx_model(t, "sub/../../secret.data") if sentinel(t) else None, "outside the model's directory"),
    (lambda t: _symlinked(t), "outside the model's directory"),
    (lambda t: onnx_model(t, "gone.data"), "keeps its data in 'gone.data', which is missing"),
    (lambda t: onnx_model(t, data=b"\0" * 8), "holds 8 bytes, but tensor 'w' needs bytes up to 16 \\(truncated\\)"),
    (lambda t: _external_field(t, "length", "32"), "external data offset 0 and length 32 for 16 bytes"),
    (lambda t: _external_field(t, "offset", "-4"), "external data offset -4"),
    (lambda t: _external_field(t, "offset", "four"), "non-integer external data offset"),
])
def test_a_bad_onnx_file_is_refused_before_onnxruntime(tmp_path, built, no_onnxruntime, make, problem):
    refused(problem, _run_onnx, make(tmp_path), built)


def test_external_data_in_attributes_and_subgraphs_is_checked(tmp_path, built, no_onnxruntime):
    import onnx
    from onnx import TensorProto, helper

    path = onnx_model(tmp_path, str(sentinel(tmp_path)))
    model = onnx.load(str(path), load_external_data=False)
    w = model.graph.initializer.pop()
    then = helper.make_graph([helper.make_node("Constant", [], ["c"], value=w)], "then", [],
                             [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])])
    model.graph.node.insert(0, helper.make_node("If", ["cond"], ["w"], then_branch=then, else_branch=then))
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    onnx.save_model(model, str(path))
    refused("outside the model's directory", _run_onnx, path, built)


def _bytes(tmp_path: Path, content: bytes) -> Path:
    (tmp_path / "m.onnx").write_bytes(content)
    return tmp_path / "m.onnx"


def _symlinked(tmp_path: Path) -> Path:
    path = onnx_model(tmp_path, "link.data")
    (path.parent / "link.data").symlink_to(sentinel(tmp_path))
    return path


def _external_field(tmp_path: Path, key: str, value: str) -> Path:
    import onnx

    path = onnx_model(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    entries = model.graph.initializer[0].external_data
    for entry in entries:
        if entry.key == key:
            entry.value = value
            break
    else:
        entries.add(key=key, value=value)
    onnx.save_model(model, str(path))
    return path
