"""`parity convert` reads each source byte once, hashing as it reads, and writes tensors in source order.

The reference is the plain way: transformers' logits on the source, and a conversion that loads every
tensor whole, in the adapter's order, and hashes the source in a pass of its own. The single pass must
agree with it in everything but where (and in which order) tensors lie in the output files.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

from parity.checkpoint import check_tensors, open_checkpoint
from parity.cli import cli
from parity.neutral import converter as neutral
from parity.neutral import manifest as manifest_module
from parity.neutral.converter import build_manifest, convert, restyle_rope, to_neutral
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import DTYPES, load
from parity.neutral.model import Manifest
from parity.storage import shards
from parity.storage.shards import DTYPE_NAMES, HASH, hash_file, read_header

PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(24)]])
SHARDS = 3
# a saved buffer the gpt2 adapter ignores: skipped, but still hashed
MASK = "transformer.h.0.attn.bias"


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file holding ``tensors``' bytes in this order, its header listing them in the reverse
    order (the format ties the two together only through data_offsets)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(dict(reversed(header.items()))).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def resharded(src: Path, out: Path, extra: dict[str, torch.Tensor] | None = None) -> tuple[Path, list[str]]:
    """``src`` as save_pretrained shards it: SHARDS files and an index, each file's tensors in reverse name
    order (neither the adapter's order nor safetensors' own). Returns the directory and the source tensor
    names in the order their bytes lie on disk, file after file."""
    tensors = {**load_file(src / "model.safetensors"), **(extra or {})}
    names = sorted(tensors, reverse=True)
    out.mkdir()
    files = [f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors" for k in range(SHARDS)]
    for k, file in enumerate(files):
        _write(out / file, [(n, tensors[n]) for n in names[k::SHARDS]])
    weight_map = {n: files[k % SHARDS] for k, n in enumerate(names)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out, [n for k in range(SHARDS) for n in names[k::SHARDS]]


def reference(src: Path, dtype: str | None = None, rope_style: str | None = None) -> tuple[Manifest, dict]:
    """The conversion done the plain way: the manifest with the source hashed by hash_file, and every tensor
    loaded whole (safetensors' own reader) and converted in the adapter's order."""
    ckpt = open_checkpoint(src)
    r = ckpt.resolved
    source_style = r["positions.rope_style"]
    style = rope_style or source_style
    prefix = check_tensors(r, ckpt.tensors).prefix
    manifest = build_manifest(ckpt, DTYPES[dtype or "float32"], style, prefix)  # the tiny sources are float32
    hf = {name: x for f in ckpt.files for name, x in load_file(f).items()}
    tensors = {}
    for hf_name, t in r.tensor_map(prefix).items():
        for name, y in to_neutral(t, hf[hf_name]):
            if name.startswith("layers."):
                y = restyle_rope(name, y, manifest.layer_of(name), source_style, style)
            tensors[name] = y.to(getattr(torch, manifest.tensors[name].dtype))
    return manifest, tensors


def _without_places(manifest: Manifest) -> dict:
    """The manifest's JSON less what says where tensors landed (which files, and what those files hold)."""
    out = {k: v for k, v in manifest.to_json().items() if k != "files"}
    out["tensors"] = {n: {k: v for k, v in info.items() if k != "file"} for n, info in out["tensors"].items()}
    return out


def _output_order(out: Path, manifest: Manifest) -> list[str]:
    """The neutral tensors in the order their bytes lie in the output, file after file."""
    order = []
    for file in sorted(manifest.files):
        header = read_header(out / file)
        order += sorted(header.tensors, key=lambda n: header.tensors[n].begin)
    return order


def _logits_error(src: Path, out: Path, lazy: bool) -> float:
    ckpt = open_checkpoint(src)
    model = getattr(transformers, ckpt.variant.architectures[0]).from_pretrained(src, attn_implementation="eager")
    expected = model.eval()(PROMPT).logits.double()
    got = NeutralModel(*load(out, lazy=lazy))(PROMPT).double()
    return ((got - expected).norm() / expected.norm()).item()


CASES = [("llama", {}), ("llama", {"rope_style": "interleaved"}), ("gpt2", {}), ("gemma3", {"dtype": "bfloat16"}),
         ("gemma4", {}), ("deepseek_v3", {})]


@pytest.mark.parametrize("family,options", CASES, ids=[f"{f}-{'-'.join(o.values()) or 'default'}" for f, o in CASES])
def test_a_sharded_source_converts_as_the_plain_way_does(family, options, tiny_dir, tmp_path):
    extra = {MASK: torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()} if family == "gpt2" else None
    src, on_disk = resharded(tiny_dir(family), tmp_path / "src", extra)
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    manifest = convert(src, tmp_path / "out", max_shard_bytes=total // 4, **options)

    expected_manifest, expected = reference(src, **options)
    assert _without_places(manifest) == _without_places(expected_manifest)  # source hashes included
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest.to_json()
    assert len(manifest.files) > 1
    for file, info in manifest.files.items():
        assert (info.hash, info.bytes) == ((HASH, hash_file(tmp_path / "out" / file)),
                                           (tmp_path / "out" / file).stat().st_size)
    _, tensors = load(tmp_path / "out", verify=True)
    assert tensors.keys() == expected.keys()
    for name, x in expected.items():
        assert tensors[name].dtype == x.dtype and tensors[name].shape == x.shape, name
        assert torch.equal(tensors[name], x), name
    # written in the order the source holds them: one tensor may become several, kept together
    ckpt = open_checkpoint(src)
    tensor_map = ckpt.resolved.tensor_map(check_tensors(ckpt.resolved, ckpt.tensors).prefix)
    assert _output_order(tmp_path / "out", manifest) == [n for hf in on_disk if hf in tensor_map
                                                        for n in tensor_map[hf].neutral]
    if "dtype" not in options:  # float32: the executor on the output is transformers on the source
        assert _logits_error(tiny_dir(family), tmp_path / "out", lazy=False) <= 1e-5
        assert _logits_error(tiny_dir(family), tmp_path / "out", lazy=True) <= 1e-5


def _counting_open(reads: Counter):
    """``open`` for parity.neutral.converter that counts the bytes read from each safetensors file."""
    class Counted:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def readinto(self, b):
            n = self.f.readinto(b)
            reads[self.name] += n
            return n

        def read(self, n=-1):
            data = self.f.read(n)
            reads[self.name] += len(data)
            return data

    def counting_open(file, mode="r", *args, **kwargs):
        f = open(file, mode, *args, **kwargs)
        return Counted(f, Path(file).name) if Path(file).suffix == ".safetensors" else f

    return counting_open


def test_each_source_byte_is_read_once(tiny_dir, tmp_path, monkeypatch):
    src, _ = resharded(tiny_dir("llama"), tmp_path / "src")
    reads: Counter = Counter()
    monkeypatch.setattr(neutral, "open", _counting_open(reads), raising=False)

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the source was read a second time")

    for module in (neutral, manifest_module, shards):  # neither a second hashing pass nor a safetensors read
        for name in ("hash_file", "safe_open"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, no_second_pass)
    manifest = convert(src, tmp_path / "out")
    assert reads == {f.name: f.stat().st_size for f in src.glob("*.safetensors")}
    assert manifest.source.files == {f.name: hash_file(f) for f in sorted(src.glob("*.safetensors"))}


def test_a_tensor_written_as_read_is_hashed_once_for_both_files(tiny_dir, tmp_path, monkeypatch):
    """A Llama at its own dtype is written as it is stored: each byte it holds is hashed once (its digest serves
    the source's hash and the output's); gemma3's folded norms are hashed again as written, and only those."""
    hashed: Counter = Counter()
    update = shards.ContentHash.update

    def counting_update(self, data):
        hashed["bytes"] += len(data)
        return update(self, data)

    monkeypatch.setattr(shards.ContentHash, "update", counting_update)
    src, _ = resharded(tiny_dir("llama"), tmp_path / "src")
    manifest = convert(src, tmp_path / "out")
    assert hashed["bytes"] == sum(f.stat().st_size for f in src.glob("*.safetensors"))
    for file, info in manifest.files.items():
        assert info.hash == (HASH, hash_file(tmp_path / "out" / file))

    hashed.clear()
    src = tiny_dir("gemma3")
    manifest = convert(src, tmp_path / "gemma3", dtype="float32")
    folded = sum(t.shape[0] * 4 for n, t in manifest.tensors.items() if "norm" in n)
    assert folded and hashed["bytes"] == (src / "model.safetensors").stat().st_size + folded
    for file, info in manifest.files.items():
        assert info.hash == (HASH, hash_file(tmp_path / "gemma3" / file))


def test_pieces_smaller_than_a_tensor_give_the_same_bytes(tiny_dir, tmp_path, monkeypatch):
    """Tensors (and the header, and the skipped mask) spanning many pieces are assembled whole; a piece size
    that is no multiple of any element size changes nothing in the output."""
    src, _ = resharded(tiny_dir("gpt2"), tmp_path / "src", {MASK: torch.ones(1, 1, 64, 64, dtype=torch.bool)})
    convert(src, tmp_path / "whole")
    monkeypatch.setattr(neutral, "READ_CHUNK", 1000)
    manifest = convert(src, tmp_path / "pieces")
    assert manifest.source.files == {f.name: hash_file(f) for f in sorted(src.glob("*.safetensors"))}
    whole = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert whole == sorted(p.name for p in (tmp_path / "pieces").iterdir())
    for name in whole:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "pieces" / name).read_bytes(), name


def test_tensors_written_as_stored_are_streamed_and_give_the_same_bytes(tiny_dir, tmp_path, monkeypatch):
    """A tensor that converts to its own bytes is copied a piece at a time through the reader's ring (no buffer of
    its size), the others read whole: the output is byte for byte that of reading every tensor whole."""
    src, _ = resharded(tiny_dir("llama"), tmp_path / "src")
    monkeypatch.setattr(neutral, "READ_CHUNK", 1000)  # many more pieces than ring buffers
    buffers = []
    whole = neutral._Reader._read

    def recording(self, *args):
        out = whole(self, *args)
        buffers.append(len(self.buffer))
        return out

    monkeypatch.setattr(neutral._Reader, "_read", recording)
    streamed = convert(src, tmp_path / "streamed")
    assert max(buffers) < 1000 * neutral.RING  # the headers only: every llama tensor is written as stored
    monkeypatch.setattr(neutral, "_as_stored", lambda *args: False)
    assert convert(src, tmp_path / "whole") == streamed
    assert max(buffers) == max(len(t) for t in load_file(tiny_dir("llama") / "model.safetensors").values()
                               for t in [t.reshape(-1).view(torch.uint8)])
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "streamed").iterdir())
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name


@pytest.mark.parametrize("change,says", [
    (lambda data: data[: len(data) - 100], "truncated while it was read"),
    (lambda data: data + b"\0" * 8, "grew while it was read"),
    (lambda data: struct.pack("<Q", struct.unpack("<Q", data[:8])[0] + 8) + data[8:], "changed while it was read"),
])
def test_a_source_changed_under_the_conversion_is_refused_and_nothing_is_left(change, says, tiny_dir, tmp_path,
                                                                              monkeypatch):
    src, _ = resharded(tiny_dir("llama"), tmp_path / "src")
    victim = sorted(src.glob("*.safetensors"))[-1]
    checked = neutral.read_header

    def read_then_change(path, *args):
        header = checked(path, *args)
        if Path(path) == victim:  # after the checks, before the pass
            victim.write_bytes(change(victim.read_bytes()))
        return header

    monkeypatch.setattr(neutral, "read_header", read_then_change)
    result = CliRunner().invoke(cli, ["convert", str(src), "--to", "neutral", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and victim.name in line and says in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["src"]
