"""The bad-input catalog: every way a user's input can be wrong, and what parity says about it.

Each case is data: a human description (docs/commands.md's "input" column), a setup that builds the bad
input in a temporary directory and returns the command line, the exit code (2: no verdict; 1 for a
candidate whose weights hold NaN, which is a verdict), and a fragment of the one-line message (the
docs/commands.md's "what parity says"). tests/test_bad_inputs.py runs each one through the CLI; docs/commands.md
holds ``markdown_table()`` between its bad-inputs markers.

Cases whose refusal depends on a change not made yet carry ``lead``: what that change must do.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "golden" / "llama"          # committed: recorded from `parity make-tiny llama`
OUTPUT_OPTIONS = ("-o", "--output", "--report", "--junit")


@dataclass(frozen=True)
class Built:
    """What the cases start from, built once: the tiny llama checkpoint, its neutral conversion, and a
    correct engine dump of the committed golden's ids."""

    checkpoint: Path
    neutral: Path
    golden: Path
    dump: Path
    ids: list[int]


def build(root: Path) -> Built:
    from parity.adapter import load_all
    from parity.dumps import write_dump
    from parity.neutral.converter import convert
    from parity.neutral.executor.model import NeutralModel
    from parity.reference.tiny import make_tiny

    checkpoint = make_tiny(load_all()["llama"], root / "llama")
    neutral = root / "llama.neutral"
    convert(checkpoint, neutral)
    ids = json.loads((GOLDEN / "golden.json").read_text())["runs"][0]["ids"]
    points: dict[str, torch.Tensor] = {}
    NeutralModel.load(neutral)(torch.tensor([ids]), on_point=lambda name, t: points.__setitem__(name, t.clone()))
    dump = write_dump(root / "dump.safetensors", points, ids)
    return Built(checkpoint, neutral, GOLDEN, dump, ids)


@dataclass(frozen=True)
class Case:
    input: str                                   # what is wrong, as a docs/commands.md row names it
    setup: Callable[[Path, Built], list[str]]    # builds the input under a temporary directory; the argv
    says: str                                    # a fragment of the message: the docs/commands.md's "what parity says"
    exit: int = 2
    lead: str | None = None                      # a change in progress this case waits for (xfail until then)

    @property
    def id(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.input.lower()).strip("-")[:60]


def outputs(argv: list[str]) -> list[Path]:
    """The files a command line asks to write (none may exist after a refusal)."""
    return [Path(argv[k + 1]) for k, a in enumerate(argv[:-1]) if a in OUTPUT_OPTIONS]


# --------------------------------------------------------------------------------------------
# Building bad inputs


def safetensors_bytes(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file from a header as given (however wrong) and raw data."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copyfile(src, dst)
    return dst


def checkpoint_with(tmp: Path, b: Built, files: dict[str, bytes | str | None], weights: bool = True) -> Path:
    """A copy of the tiny checkpoint (its config, and its weights unless told not) with files replaced or removed."""
    d = tmp / "ckpt"
    d.mkdir()
    for name in ["config.json"] + (["model.safetensors"] if weights else []):
        shutil.copyfile(b.checkpoint / name, d / name)
    for name, content in files.items():
        if content is None:
            (d / name).unlink()
        else:
            (d / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return d


def config_with(tmp: Path, b: Built, **changes) -> Path:
    config = json.loads((b.checkpoint / "config.json").read_text())
    config.update(changes)
    return checkpoint_with(tmp, b, {"config.json": json.dumps(config)}, weights=False)


def inspect(path: Path) -> list[str]:
    return ["inspect", str(path)]


def weights_with(tmp: Path, b: Built, content: bytes) -> list[str]:
    """`parity convert` of the checkpoint with its model.safetensors replaced: refused, nothing written."""
    d = checkpoint_with(tmp, b, {"model.safetensors": content})
    return ["convert", str(d), "--to", "neutral", "-o", str(tmp / "out")]


def real_weights(b: Built) -> bytes:
    return (b.checkpoint / "model.safetensors").read_bytes()


def header_edited(b: Built, change: Callable[[dict], None]) -> bytes:
    """The checkpoint's model.safetensors with its header changed (same data)."""
    raw = real_weights(b)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    return safetensors_bytes(header, raw[8 + n:])


def check(tmp: Path, reference: Path, candidate: Path, *extra: str) -> list[str]:
    """`parity check --layerwise`, asking for a report and JUnit XML that must not appear."""
    return ["check", "--reference", str(reference), "--candidate", str(candidate), "--layerwise",
            "--report", str(tmp / "report.json"), "--junit", str(tmp / "junit.xml"), *extra]


def neutral_with(tmp: Path, b: Built, change: Callable[[dict], object]) -> list[str]:
    """The neutral conversion with its manifest changed (change may return a replacement manifest)."""
    d = copy(b.neutral, tmp / "cand")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest = change(manifest) or manifest
    (d / "manifest.json").write_text(json.dumps(manifest))
    return check(tmp, b.golden, d)


def neutral_tensors(tmp: Path, b: Built, change: Callable[[dict], None]) -> list[str]:
    d = copy(b.neutral, tmp / "cand")
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return check(tmp, b.golden, d)


def golden_with(tmp: Path, b: Built, change: Callable[[Path, dict], object]) -> list[str]:
    """A copy of the committed golden with its golden.json (or files) changed."""
    g = copy(b.golden, tmp / "golden")
    description = json.loads((g / "golden.json").read_text())
    description = change(g, description) or description
    if description != "keep":
        (g / "golden.json").write_text(description if isinstance(description, str) else json.dumps(description))
    return check(tmp, g, b.neutral)


def dump_with(tmp: Path, b: Built, change: Callable[[dict], None] | None = None,
              metadata: dict | None = None) -> list[str]:
    """The correct dump with its tensors changed and its metadata replaced."""
    tensors = load_file(b.dump)
    if change is not None:
        change(tensors)
    path = tmp / "dump.safetensors"
    save_file(tensors, path, metadata={"input_ids": json.dumps(b.ids)} if metadata is None else metadata)
    return check(tmp, b.golden, path)


def ranks_with(tmp: Path, b: Built, size: int = 2, change: Callable[[list], None] | None = None,
               retag: dict[int, dict | None] | None = None) -> list[str]:
    """The correct dump as a tensor-parallel run's ranks (logits split by columns, the rest replicated), with the
    ranks' tensors changed, a rank's metadata changed (``retag``: rank -> keys) or a rank left out (None)."""
    tensors, ranks = load_file(b.dump), []
    for r in range(size):
        ranks.append({n: (t.tensor_split(size, dim=-1)[r] if n == "logits" else t).contiguous()
                      for n, t in tensors.items()})
    if change is not None:
        change(ranks)
    d = tmp / "ranks"
    d.mkdir()
    for r, rank in enumerate(ranks):
        extra = (retag or {}).get(r, {})
        if extra is not None:
            save_file(rank, d / f"rank{r}.safetensors", metadata={
                "input_ids": json.dumps(b.ids), "tp_rank": str(r), "tp_size": str(size),
                "tp_layout": json.dumps({"logits": "column"}), **extra})
    return check(tmp, b.golden, d)


def _drift_rank1(ranks: list) -> None:
    ranks[1]["layers.0.out"] = ranks[1]["layers.0.out"] * 1.01


def onnx_model(tmp: Path, location: str | None = "weights.data", data: bytes | None = None) -> Path:
    """A small valid ONNX model (out = w + w) with its initializer kept as external data at ``location``."""
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [4], struct.pack("<4f", 1, 2, 3, 4), raw=True)
    graph = helper.make_graph([helper.make_node("Add", ["w", "w"], ["logits"])], "g", [],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    d = tmp / "model"
    d.mkdir()
    path = d / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.data", size_threshold=0)
    if data is not None:
        (d / "weights.data").write_bytes(data)
    if location != "weights.data":
        model = onnx.load(str(path), load_external_data=False)
        for entry in model.graph.initializer[0].external_data:
            if entry.key == "location":
                entry.value = location
        onnx.save_model(model, str(path))
    return path


def sentinel(tmp: Path) -> Path:
    """A file outside the model's directory that an external-data path must never reach."""
    (tmp / "secret.data").write_bytes(b"\0" * 64)
    return tmp / "secret.data"


def inputs(b: Built, tmp: Path, *extra: str) -> list[str]:
    return ["inputs", str(b.checkpoint), "-o", str(tmp / "inputs.json"), *extra]


def toml(tmp: Path, text: str) -> str:
    (tmp / "tol.toml").write_text(text)
    return str(tmp / "tol.toml")


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def tiny_gguf(b: Built) -> Path:
    """The tiny llama as a GGUF file (`parity convert --to gguf`), written once beside the built inputs."""
    path = b.checkpoint.parent / "llama.gguf"
    if not path.exists():
        from parity.engines.gguf.export import export

        export(b.checkpoint, path)
    return path


def gguf_with(tmp: Path, b: Built, change: Callable) -> list[str]:
    """`parity check` of the tiny GGUF file with its bytes changed: ``change(raw, reader)`` edits the bytearray in
    place or returns the bytes to write; gguf-py's reader of the valid file says where each field lies."""
    import gguf

    src = tiny_gguf(b)
    raw = bytearray(src.read_bytes())
    raw = change(raw, gguf.GGUFReader(str(src))) or raw
    return check(tmp, b.golden, write(tmp / "model.gguf", bytes(raw)))


def gguf_at(field, part: int) -> int:
    """The byte offset of part ``part`` of a gguf-py ReaderField (its parts lie back to back from its offset)."""
    return field.offset + sum(int(p.nbytes) for p in field.parts[:part])


def gguf_put(fmt: str, at: Callable, value) -> Callable:
    """A GGUF change: pack ``value`` (little-endian ``fmt``) at the offset ``at(reader)``."""
    return lambda raw, r: struct.pack_into("<" + fmt, raw, at(r), value)


def _set(path: str, value):
    """A manifest change: set the value at a dotted path (list indices as numbers)."""
    def change(m: dict) -> None:
        *parts, last = path.split(".")
        node = m
        for p in parts:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return change


_DELETE = object()


def _arch_mamba(raw: bytearray, r) -> None:
    """general.architecture "llama" rewritten in place as "mamba" (the same length: nothing else moves)."""
    at = gguf_at(r.fields["general.architecture"], 4)
    assert raw[at:at + 5] == b"llama"
    raw[at:at + 5] = b"mamba"


def _nan(tensors: dict) -> None:
    tensors["layers.0.mlp.down.weight"][0, 0] = float("nan")


def _narrow_logits(tensors: dict) -> None:
    tensors["logits"] = tensors["logits"][..., :200].contiguous()


def _short_embed(tensors: dict) -> None:
    tensors["embed"] = tensors["embed"][:, :-1].contiguous()


def _ints(tensors: dict) -> None:
    tensors["embed"] = tensors["embed"].to(torch.int32)


def _drop_runs(g: Path, d: dict) -> None:
    del d["runs"]


def _escape_run(g: Path, d: dict) -> None:
    (g.parent / "outside.safetensors").write_bytes((g / "activations.safetensors").read_bytes())
    d["runs"][0]["file"] = "../outside.safetensors"


def _absolute_run(g: Path, d: dict) -> None:
    d["runs"][0]["file"] = str((g / "activations.safetensors").resolve())


def _no_activations(g: Path, d: dict) -> str:
    (g / "activations.safetensors").unlink()
    return "keep"


def _float_ids(g: Path, d: dict) -> None:
    d["runs"][0]["ids"][3] = 2.5


def _points_not_strings(g: Path, d: dict) -> None:
    d["capture_points"] = "embed"


# --------------------------------------------------------------------------------------------
# The catalog

BAD_INPUTS: list[Case] = [
    # a Hugging Face checkpoint: config.json
    Case("checkpoint directory without config.json",
         lambda t, b: inspect(checkpoint_with(t, b, {"config.json": None})), "no config.json"),
    Case("config.json that is not JSON",
         lambda t, b: inspect(checkpoint_with(t, b, {"config.json": "{not json"}, weights=False)), "not valid JSON"),
    Case("config.json holding a JSON list",
         lambda t, b: inspect(checkpoint_with(t, b, {"config.json": "[1, 2]"}, weights=False)),
         "expected a JSON object"),
    Case("config.json of an unknown architecture",
         lambda t, b: inspect(config_with(t, b, architectures=["MambaForCausalLM"], model_type="mamba")),
         "unsupported architecture MambaForCausalLM"),
    Case("config.json with hidden_size as a string",
         lambda t, b: inspect(config_with(t, b, hidden_size="64")), "hidden_size must be a positive integer"),
    Case("config.json with a negative num_attention_heads",
         lambda t, b: inspect(config_with(t, b, num_attention_heads=-4)),
         "num_attention_heads must be a positive integer"),
    Case("config.json with 100 million layers",
         lambda t, b: inspect(config_with(t, b, num_hidden_layers=100_000_000)),
         "num_hidden_layers must be at most 10,000"),
    # sharded checkpoints: model.safetensors.index.json
    Case("model.safetensors.index.json that is not JSON",
         lambda t, b: inspect(checkpoint_with(t, b, {"model.safetensors.index.json": "{"})), "not valid JSON"),
    Case("index naming a shard that is missing",
         lambda t, b: inspect(checkpoint_with(t, b, {"model.safetensors.index.json": json.dumps(
             {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})})),
         "names shard(s) that are not there"),
    Case("index naming a shard outside the directory (../x)",
         lambda t, b: inspect(checkpoint_with(t, b, {"model.safetensors.index.json": json.dumps(
             {"weight_map": {"lm_head.weight": "../model.safetensors"}})})),
         "shard names must be file names in the checkpoint directory"),
    # weights: safetensors files (each through `parity convert`, which must leave no output)
    Case("zero-byte model.safetensors", lambda t, b: weights_with(t, b, b""),
         "shorter than the 8-byte header length"),
    Case("safetensors header length of 2^60 bytes",
         lambda t, b: weights_with(t, b, safetensors_bytes({}, length=2**60)),
         "header length 1152921504606846976 exceeds the file's 2 remaining bytes"),
    Case("safetensors header that is not JSON",
         lambda t, b: weights_with(t, b, struct.pack("<Q", 8) + b"not json"), "header is not valid JSON"),
    Case("safetensors tensor offsets past the end of the file",
         lambda t, b: weights_with(t, b, safetensors_bytes({"lm_head.weight": {
             "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4)),
         "the tensors cover 8 bytes of data but the file holds 4 (truncated)"),
    Case("safetensors tensors that overlap",
         lambda t, b: weights_with(t, b, safetensors_bytes({
             "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)), "overlapping"),
    Case("safetensors tensor of an unknown dtype",
         lambda t, b: weights_with(t, b, header_edited(b, lambda h: h["lm_head.weight"].update(dtype="F12"))),
         "unknown dtype 'F12'"),
    Case("safetensors shape that disagrees with its byte range",
         lambda t, b: weights_with(t, b, header_edited(b, lambda h: h["lm_head.weight"].update(shape=[256, 65]))),
         "needs 66560 bytes but its data_offsets span 65536"),
    Case("safetensors file cut in half",
         lambda t, b: weights_with(t, b, real_weights(b)[:len(real_weights(b)) // 2]),
         "not a readable safetensors file (the tensors cover"),
    Case("checkpoint holding only pickle weights (pytorch_model.bin)",
         lambda t, b: inspect(checkpoint_with(t, b, {"model.safetensors": None, "pytorch_model.bin": b"not a pickle"})),
         "holds only pickle weights"),
    # a neutral candidate: manifest.json
    Case("manifest.json holding a JSON list", lambda t, b: neutral_with(t, b, lambda m: [m]), "expected a JSON object"),
    Case("manifest.json without a layer's heads",
         lambda t, b: neutral_with(t, b, _set("layers.0.attention.heads", _DELETE)),
         "layers.0.attention.heads: Field required"),
    Case("manifest.json with heads as a string",
         lambda t, b: neutral_with(t, b, _set("layers.0.attention.heads", "4")),
         "layers.0.attention.heads: Input should be a valid integer"),
    Case("manifest.json with zero heads", lambda t, b: neutral_with(t, b, _set("layers.1.attention.heads", 0)),
         "layers.1.attention.heads: Input should be greater than 0"),
    Case("manifest.json with an unknown RoPE style",
         lambda t, b: neutral_with(t, b, _set("layers.0.attention.rope.style", "diagonal")),
         "rope.style: Input should be 'half' or 'interleaved'"),
    Case("manifest.json with an unknown RoPE scaling type",
         lambda t, b: neutral_with(t, b, _set("layers.0.attention.rope.scaling.rope_type", "warp")),
         "unknown RoPE scaling type 'warp'"),
    Case("manifest.json with a norm kind the executor does not know",
         lambda t, b: neutral_with(t, b, _set("final_norm.kind", "batchnorm")),
         "final_norm.kind: Input should be 'rmsnorm' or 'layernorm'"),
    Case("manifest.json listing a tensor the file lacks",
         lambda t, b: neutral_with(t, b, lambda m: m["tensors"].update(
             {"layers.0.extra.weight": {"shape": [4], "dtype": "float32", "file": "model.safetensors"}})),
         "tensors listed in the manifest are missing: layers.0.extra.weight"),
    Case("manifest.json stating a shape the file does not hold",
         lambda t, b: neutral_with(t, b, lambda m: m["tensors"]["final_norm.weight"].update(shape=[65])),
         "final_norm.weight is F32 [64] but the manifest says F32 [65]"),
    Case("manifest.json naming a weight file outside the directory",
         lambda t, b: neutral_with(t, b, lambda m: m.update(files={"../model.safetensors": {"sha256": "",
                                                                                          "bytes": 0}})),
         "is not a file name in the directory"),
    Case("neutral candidate whose weights hold NaN", lambda t, b: neutral_tensors(t, b, _nan),
         "FAIL at layers.0.out: NaN in candidate", exit=1),
    # a golden reference: golden.json and its activations
    Case("golden.json that is not JSON", lambda t, b: golden_with(t, b, lambda g, d: "{oops"), "not valid JSON"),
    Case("golden.json holding a JSON list", lambda t, b: golden_with(t, b, lambda g, d: [d]),
         "not a parity-golden v1 description"),
    Case("golden.json without its runs", lambda t, b: golden_with(t, b, _drop_runs), "runs: Field required"),
    Case("golden.json with capture_points as a string", lambda t, b: golden_with(t, b, _points_not_strings),
         "capture_points: Input should be a valid list"),
    Case("golden.json with a fractional token id", lambda t, b: golden_with(t, b, _float_ids),
         "runs.0.ids.3: Input should be a valid integer"),
    Case("golden run file escaping the directory (../x)", lambda t, b: golden_with(t, b, _escape_run),
         "is not a file in the golden directory"),
    Case("golden run file given as an absolute path", lambda t, b: golden_with(t, b, _absolute_run),
         "is not a file in the golden directory"),
    Case("golden without its activations file", lambda t, b: golden_with(t, b, _no_activations),
         "not a readable safetensors file (no such file)"),
    # an engine dump candidate
    Case("engine dump without input_ids metadata", lambda t, b: dump_with(t, b, metadata={"format": "pt"}),
         "no 'input_ids' in the metadata"),
    Case("engine dump whose input_ids are not JSON", lambda t, b: dump_with(t, b, metadata={"input_ids": "20, 96"}),
         "is not a JSON list of token ids"),
    Case("engine dump whose input_ids are a JSON object",
         lambda t, b: dump_with(t, b, metadata={"input_ids": '{"ids": [1]}'}), "is not a JSON list of token ids"),
    Case("engine dump with negative input_ids",
         lambda t, b: dump_with(t, b, metadata={"input_ids": json.dumps([-1] + b.ids[1:])}),
         "holds negative token ids"),
    Case("engine dump of other ids than the reference's",
         lambda t, b: dump_with(t, b, metadata={"input_ids": json.dumps(b.ids[:-1] + [b.ids[-1] ^ 1])}),
         "input ids differ from the reference's"),
    Case("engine dump whose activations are one token short", lambda t, b: dump_with(t, b, _short_embed),
         "embed has shape [1, 79, 64], expected [batch=1, seq=80, hidden=64]"),
    Case("engine dump whose logits are narrower than the vocabulary", lambda t, b: dump_with(t, b, _narrow_logits),
         "logits has shape [1, 80, 200], expected [batch=1, seq=80, vocab=256]"),
    Case("engine dump holding integer activations", lambda t, b: dump_with(t, b, _ints), "embed is I32"),
    Case("engine dump with --isolate", lambda t, b: check(t, b.golden, b.dump, "--isolate"),
         "cannot be fed the reference's layer inputs"),
    Case("tensor-parallel dump directory missing a rank", lambda t, b: ranks_with(t, b, 4, retag={2: None}),
         "tp_size is 4 but missing rank2.safetensors"),
    Case("tensor-parallel rank dumps disagreeing on tp_size",
         lambda t, b: ranks_with(t, b, retag={1: {"tp_size": "4"}}), "the ranks disagree on tp_size"),
    Case("tensor-parallel rank dump whose tp_rank is not an integer",
         lambda t, b: ranks_with(t, b, retag={1: {"tp_rank": "one"}}),
         "rank1.safetensors has tp_rank 'one' in its metadata"),
    Case("tensor-parallel layout naming an unknown shard",
         lambda t, b: ranks_with(t, b, retag={0: {"tp_layout": '{"logits": "vocab"}'}}),
         "must be a JSON object of point -> one of replicated, column, row"),
    Case("tensor-parallel replicated point differing between ranks", lambda t, b: ranks_with(t, b, change=_drift_rank1),
         "layers.0.out is declared replicated but rank1 differs from rank0"),
    # an ONNX candidate
    Case("ONNX file of garbage bytes",
         lambda t, b: check(t, b.golden, write(t / "m.onnx", b"\x08\x07garbage" * 9)),
         "not a readable ONNX model"),
    Case("empty ONNX file", lambda t, b: check(t, b.golden, write(t / "m.onnx", b"")),
         "empty file, not an ONNX model"),
    Case("ONNX external data at an absolute path",
         lambda t, b: check(t, b.golden, onnx_model(t, str(sentinel(t)))), "outside the model's directory"),
    Case("ONNX external data path leaving the directory (../)",
         lambda t, b: check(t, b.golden, onnx_model(t, f"../{sentinel(t).name}")), "outside the model's directory"),
    Case("ONNX external data file missing",
         lambda t, b: check(t, b.golden, onnx_model(t, "gone.data")), "which is missing beside the model"),
    Case("ONNX external data file shorter than its tensors",
         lambda t, b: check(t, b.golden, onnx_model(t, data=b"\0" * 8)),
         "holds 8 bytes, but tensor 'w' needs bytes up to 16 (truncated)"),
    # a GGUF candidate: its header, checked before gguf-py or llama.cpp reads it
    Case("GGUF file cut inside its tensor data",
         lambda t, b: gguf_with(t, b, lambda raw, r: raw[:(r.data_offset + len(raw)) // 2]),
         "truncated: tensor 'output.weight' ends at byte"),
    Case("GGUF file cut inside its header",
         lambda t, b: gguf_with(t, b, lambda raw, r: raw[:r.fields["tokenizer.ggml.tokens"].offset + 3]),
         "truncated inside its header: the file ends at byte"),
    Case("GGUF file of its magic alone", lambda t, b: check(t, b.golden, write(t / "model.gguf", b"GGUF")),
         "truncated: 4 bytes, shorter than the 24-byte GGUF header"),
    Case("GGUF magic with an unknown version",
         lambda t, b: gguf_with(t, b, gguf_put("I", lambda r: 4, 7)), "GGUF version 7; parity reads versions 2 and 3"),
    Case("GGUF header claiming 2^40 tensors",
         lambda t, b: gguf_with(t, b, gguf_put("Q", lambda r: 8, 2**40)),
         "claims 1,099,511,627,776 tensors, which cannot fit"),
    Case("GGUF header claiming 2^40 metadata keys",
         lambda t, b: gguf_with(t, b, gguf_put("Q", lambda r: 16, 2**40)),
         "claims 1,099,511,627,776 metadata keys, which cannot fit"),
    Case("GGUF metadata value of a garbled type",
         lambda t, b: gguf_with(t, b, gguf_put("I", lambda r: gguf_at(r.fields["general.name"], 2), 2**32 - 1)),
         "metadata key 'general.name' has value type 4294967295"),
    Case("GGUF tensor of an unknown GGML type",
         lambda t, b: gguf_with(t, b, gguf_put("I", lambda r: gguf_at(r.tensors[0].field, 4), 99)),
         "has GGML type 99, which this gguf-py does not know"),
    Case("GGUF tensor with 9 dimensions",
         lambda t, b: gguf_with(t, b, gguf_put("I", lambda r: gguf_at(r.tensors[0].field, 2), 9)),
         "has 9 dimensions; GGML tensors have at most 4"),
    Case("GGUF file of an architecture no adapter covers (mamba)",
         lambda t, b: gguf_with(t, b, _arch_mamba), "a llama.cpp 'mamba' model, an architecture no adapter covers"),
    # command-line values
    Case("--ids 1,x", lambda t, b: inputs(b, t, "--ids", "1,x"), "expected comma-separated integers"),
    Case("--ids outside the vocabulary", lambda t, b: inputs(b, t, "--ids", "1,256"),
         "token ids must be integers in [0, 256)"),
    Case('--ids ""', lambda t, b: inputs(b, t, "--ids", ""), "token ids must be integers in [0, 256); got none"),
    Case("--length 0", lambda t, b: inputs(b, t, "--length", "0"), "--length must be at least 1"),
    Case("--length -5", lambda t, b: inputs(b, t, "--length", "-5"), "--length must be at least 1"),
    Case("--length 100000000", lambda t, b: inputs(b, t, "--length", "100000000"),
         "a prompt of 100000000 tokens needs about"),
    Case("--prompt without a tokenizer.json",
         lambda t, b: ["inputs", str(checkpoint_with(t, b, {})), "-o", str(t / "inputs.json"), "--prompt", "hi"],
         "no tokenizer.json"),
    Case("--tolerance 'nonsense'", lambda t, b: check(t, b.golden, b.neutral, "--tolerance", "nonsense"),
         "expected 'GLOB:rel_l2=1e-3' or a .toml file"),
    Case("--tolerance 'x:rel_l2=abc'", lambda t, b: check(t, b.golden, b.neutral, "--tolerance", "x:rel_l2=abc"),
         "rel_l2='abc' is not a finite number >= 0"),
    Case("--tolerance 'x:cosine=0.9'", lambda t, b: check(t, b.golden, b.neutral, "--tolerance", "x:cosine=0.9"),
         "cosine is not a tolerance"),
    Case("--tolerance missing.toml",
         lambda t, b: check(t, b.golden, b.neutral, "--tolerance", str(t / "missing.toml")), "no such file"),
    Case("tolerance TOML file with an unknown table",
         lambda t, b: check(t, b.golden, b.neutral, "--tolerance", toml(t, "[defaults]\nrel_l2 = 1e-3\n")),
         "unknown table(s) defaults"),
    Case("--inputs file that is not a list",
         lambda t, b: check(t, b.golden, b.neutral, "--inputs", str(write(t / "in.json", b'{"ids": [1]}'))),
         "expected a non-empty JSON list"),
    Case("--report out.txt (unknown format)",
         lambda t, b: ["check", "--reference", str(b.golden), "--candidate", str(b.neutral), "--report",
                       str(t / "out.txt")], "unknown report format '.txt'"),
    Case("--report under a file (a directory that cannot be created)",
         lambda t, b: ["check", "--reference", str(b.golden), "--candidate", str(b.neutral), "--report",
                       str(write(t / "file", b"") / "sub" / "r.json")], "cannot create a file there"),
    Case("run --top -2", lambda t, b: ["run", str(b.neutral), "--ids", "1,2", "--top", "-2"],
         "-2 is not in the range x>=1"),
    Case("run --top 0", lambda t, b: ["run", str(b.neutral), "--ids", "1,2", "--top", "0"],
         "0 is not in the range x>=1"),
    Case("--dtype float8 (unknown)", lambda t, b: check(t, b.golden, b.neutral, "--dtype", "float8"),
         "'float8' is not one of 'float32', 'bfloat16', 'float16'"),
    Case("--candidate that does not exist", lambda t, b: check(t, b.golden, t / "nowhere"),
         "no such file or directory"),
    Case("--inject an unknown bug id", lambda t, b: check(t, b.golden, b.neutral, "--inject", "no-such-bug"),
         "unknown bug id 'no-such-bug'"),
    Case("--inject with a non-neutral candidate",
         lambda t, b: check(t, b.golden, b.dump, "--inject", "norm-eps-wrong"), "--inject needs a neutral candidate"),
    Case("--device tpu (unknown)", lambda t, b: check(t, b.checkpoint, b.neutral, "--device", "tpu"),
         "is not one of cpu, cuda, cuda:N, mps, auto"),
    Case("--device cuda:7 (no such GPU)", lambda t, b: check(t, b.checkpoint, b.neutral, "--device", "cuda:7"),
         "--device cuda:7:"),
    Case("--layers 3:1 (an empty slice)", lambda t, b: check(t, b.checkpoint, b.neutral, "--layers", "3:1"),
         "expected A:B with 0 <= A < B <="),
    Case("--layers past the model's layers", lambda t, b: check(t, b.checkpoint, b.neutral, "--layers", "0:99"),
         "expected A:B with 0 <= A < B <="),
    Case("--layers with a golden lacking the slice's input", lambda t, b: check(
        t, *_final_only_golden(t, b), b.neutral, "--layers", "1:2"), "the golden does not hold layers.0.out"),
    Case("report merge with a slice missing", lambda t, b: merge(t, _slices(t, b, "0:1")),
         "no report covers layers 1:2 of 2"),
    Case("report merge of overlapping slices", lambda t, b: merge(t, _slices(t, b, "0:2", "1:2")),
         "overlap"),
    Case("report merge of slices from different checks", lambda t, b: merge(
        t, _slices(t, b, "0:1") + _slices(t, b, "1:2", dtype="bfloat16")), "dtype 'bfloat16' differs"),
    Case("report merge of a file that is not a report", lambda t, b: merge(
        t, [write(t / "x.json", b'{"verdict": "pass"}')]), "not a parity report"),
    Case("convert --onnx-quant with --to gguf",
         lambda t, b: ["convert", str(b.checkpoint), "--to", "gguf", "-o", str(t / "m.gguf"), "--onnx-quant", "qdq"],
         "--onnx-quant applies to --to onnx, not --to gguf (it quantizes an ONNX export"),
]


def merge(tmp: Path, files: list[Path]) -> list[str]:
    """`parity report merge`, asking for a report and JUnit XML that must not appear."""
    return ["report", "merge", *map(str, files), "-o", str(tmp / "merged.json"), "--junit", str(tmp / "junit.xml")]


def _slices(tmp: Path, b: Built, *spans: str, **options) -> list[Path]:
    """The JSON reports of checking the tiny llama's neutral conversion one slice of layers at a time."""
    from parity.checker.run import check as run_check
    from parity.render import write as write_report

    files = []
    for span in spans:
        files.append(tmp / f"slice-{span.replace(':', '-')}-{options.get('dtype', 'float32')}.json")
        write_report(run_check(b.checkpoint, b.neutral, layerwise=True, layers=span, **options), files[-1])
    return files


def _final_only_golden(tmp: Path, b: Built) -> tuple[Path]:
    from parity.checker.record import record

    record(b.checkpoint, tmp / "final-golden", points="final")
    return (tmp / "final-golden",)


def markdown_table() -> str:
    """The catalog as docs/commands.md shows it."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| input | exit | what parity says |", "|---|---|---|"]
    rows += [f"| {cell(c.input)} | {c.exit} | {cell(c.says)} |" for c in BAD_INPUTS]
    return "\n".join(rows)
