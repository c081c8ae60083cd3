"""`parity convert --to neutral`: folding, refusal of bad checkpoints, atomic output, sharding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from parity.cli import cli
from parity.errors import ParityError
from parity.neutral.converter import convert
from parity.neutral.manifest import load, read_manifest
from parity.neutral.model import Manifest
from parity.storage.shards import HASH, hash_file

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _refused(result, *needles) -> str:
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1, line
    for needle in needles:
        assert needle in line, line
    return line


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _leftovers(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name == name or ".parity-tmp-" in p.name]


def test_manifest_states_conventions_and_hashes(tiny_dir, tmp_path):
    src = tiny_dir("gemma2")
    manifest = convert(src, tmp_path / "out")
    assert manifest.source.family == "gemma2"
    assert manifest.source.files["model.safetensors"] == hash_file(src / "model.safetensors")
    for name, info in manifest.files.items():
        assert info.hash == (HASH, hash_file(tmp_path / "out" / name))
    layer0, layer1 = manifest.layers[:2]
    assert layer0.attention.sliding_window == 8 and layer1.attention.sliding_window is None
    assert layer0.attention.softcap == 0.5 and manifest.head.softcap == 0.1
    assert layer0.attention.scale == pytest.approx(24 ** -0.5)
    assert manifest.embedding.scale == pytest.approx(8.0)
    assert set(k for k, v in layer0.norms if v) == {"attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"}
    assert layer0.norms.attn_norm.folded_offset is True


def test_one_plus_w_is_folded_in_float32(tiny_dir, tmp_path):
    src = tiny_dir("gemma3")
    convert(src, tmp_path / "out", dtype="bfloat16")
    hf = load_file(src / "model.safetensors")
    _, tensors = load(tmp_path / "out")
    for hf_name, neutral in (("model.layers.0.input_layernorm.weight", "layers.0.attn_norm.weight"),
                             ("model.layers.0.self_attn.q_norm.weight", "layers.0.attn.q_norm.weight")):
        expected = (hf[hf_name].float() + 1.0).to(torch.bfloat16)
        assert torch.equal(tensors[neutral], expected)


def test_conv1d_is_transposed_and_c_attn_split(tiny_dir, tmp_path):
    src = tiny_dir("gpt2")
    convert(src, tmp_path / "out")
    hf = load_file(src / "model.safetensors")
    _, tensors = load(tmp_path / "out")
    c_attn = hf["transformer.h.0.attn.c_attn.weight"]            # [in, 3 * out]
    q, k, v = c_attn.t().split(c_attn.shape[1] // 3, dim=0)
    assert torch.equal(tensors["layers.0.attn.q.weight"], q) and torch.equal(tensors["layers.0.attn.v.weight"], v)
    assert torch.equal(tensors["layers.0.mlp.up.weight"], hf["transformer.h.0.mlp.c_fc.weight"].t())


def test_sharded_output_has_an_index_and_loads(tiny_dir, tmp_path):
    manifest = convert(tiny_dir("llama"), tmp_path / "out", max_shard_bytes=64 * 1024)
    assert len(manifest.files) > 2
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(manifest.tensors)
    _, tensors = load(tmp_path / "out", verify=True)
    assert set(tensors) == set(manifest.tensors)


def _tamper(path: Path) -> None:
    """Flip one byte in the middle of ``path`` (its tensor data: the header still reads)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _as_written_before(out: Path, src: Path, algorithm: str) -> dict:
    """Rewrite ``out``'s manifest as parity wrote it before its hash of parts: a whole file's ``algorithm`` (blake3,
    or sha256, when ``source.hash`` was absent) for every source and output file."""
    manifest = json.loads((out / "manifest.json").read_text())
    if algorithm == "sha256":
        del manifest["source"]["hash"]
    else:
        manifest["source"]["hash"] = algorithm
    manifest["source"]["files"] = {name: hash_file(src / name, algorithm) for name in manifest["source"]["files"]}
    manifest["files"] = {name: {algorithm: hash_file(out / name, algorithm), "bytes": info["bytes"]}
                         for name, info in manifest["files"].items()}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _parts_digest(path: Path) -> str:
    """HASH as its definition says, computed from safetensors' own reading of the file: BLAKE3 of the BLAKE3
    digests of the header (length and JSON) and of each tensor's bytes, in file order."""
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:start])
    header.pop("__metadata__", None)
    spans = sorted(tuple(info["data_offsets"]) for info in header.values())
    digests = [blake3.blake3(raw[:start]).digest()]
    digests += [blake3.blake3(raw[start + b:start + e]).digest() for b, e in spans]
    return blake3.blake3(b"".join(digests)).hexdigest()


def test_a_new_manifest_records_the_hash_of_parts_and_verifies(tiny_dir, tmp_path):
    src = tiny_dir("gemma3")  # its norms fold (1 + w): some tensors are written as read, some converted
    manifest = convert(src, tmp_path / "out", max_shard_bytes=64 * 1024)
    assert manifest.source.hash == HASH == "blake3_tensors" and len(manifest.files) > 1
    assert manifest.source.files == {"model.safetensors": _parts_digest(src / "model.safetensors")}
    assert _parts_digest(src / "model.safetensors") == hash_file(src / "model.safetensors")
    for name, info in manifest.files.items():
        assert info.model_dump(exclude_none=True) == {HASH: _parts_digest(tmp_path / "out" / name),
                                                      "bytes": (tmp_path / "out" / name).stat().st_size}
    assert read_manifest(tmp_path / "out") == manifest
    load(tmp_path / "out", verify=True)
    _tamper(tmp_path / "out" / sorted(manifest.files)[-1])
    with pytest.raises(ParityError, match=f"its {HASH} differs from the manifest's; the file changed after conversion"):
        load(tmp_path / "out", verify=True)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_an_older_manifest_still_reads_and_verifies(algorithm, tiny_dir, tmp_path):
    src = tiny_dir("llama")
    convert(src, tmp_path / "out", max_shard_bytes=64 * 1024)
    old = _as_written_before(tmp_path / "out", src, algorithm)
    assert read_manifest(tmp_path / "out") == Manifest.model_validate(old)
    _, tensors = load(tmp_path / "out", verify=True)
    assert set(tensors) == set(old["tensors"])
    assert run("run", tmp_path / "out", "--ids", "1,2,3").exit_code == 0
    victim = tmp_path / "out" / sorted(old["files"])[0]
    _tamper(victim)
    with pytest.raises(ParityError, match=f"{victim.name}: its {algorithm} differs from the manifest's"):
        load(tmp_path / "out", verify=True)


def _edit(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("case,change,needles", [
    ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), ["missing (1)", "layers.1.mlp.up_proj"]),
    ("unexpected", lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), ["unexpected (1)"]),
    ("wrong shape", lambda t: t.update({"model.norm.weight": torch.zeros(3)}), ["wrong shape (1)", "[3]"]),
    ("wrong dtype", lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int32)}),
     ["wrong dtype (1)", "I32"]),
    ("every offender", lambda t: (t.pop("model.norm.weight"), t.pop("lm_head.weight"),
                                  t.update({"model.layers.0.extra.weight": torch.zeros(2)})),
     ["missing (2)", "lm_head.weight", "model.norm.weight", "unexpected (1)"]),
])
def test_bad_checkpoints_are_refused_before_writing(tiny_dir, tmp_path, case, change, needles):
    src = _copy(tiny_dir("llama"), tmp_path / "src")
    _edit(src, change)
    _refused(run("convert", src, "--to", "neutral", "-o", tmp_path / "out"), *needles)
    assert _leftovers(tmp_path, "out") == []


def test_truncated_safetensors_is_refused(tiny_dir, tmp_path):
    src = _copy(tiny_dir("llama"), tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(run("convert", src, "--to", "neutral", "-o", tmp_path / "out"), "model.safetensors")
    assert _leftovers(tmp_path, "out") == []


def test_pickle_only_directory_is_refused(tiny_dir, tmp_path):
    src = _copy(tiny_dir("llama"), tmp_path / "src")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    _refused(run("convert", src, "--to", "neutral", "-o", tmp_path / "out"), "pickle", "pytorch_model.bin")
    assert _leftovers(tmp_path, "out") == []


def test_existing_output_is_refused_without_force(tiny_dir, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    _refused(run("convert", tiny_dir("llama"), "--to", "neutral", "-o", tmp_path / "out"), "--force")
    assert (tmp_path / "out" / "keep").exists()
    assert run("convert", tiny_dir("llama"), "--to", "neutral", "-o", tmp_path / "out", "--force").exit_code == 0
    assert not (tmp_path / "out" / "keep").exists() and (tmp_path / "out" / "manifest.json").exists()


SLOW_CONVERT = """
import sys, time
from parity.storage import shards
from parity.neutral.converter import convert
write = shards.ShardWriter.write
def slow(self, name, tensor):
    time.sleep(0.2)
    write(self, name, tensor)
shards.ShardWriter.write = slow
convert(sys.argv[1], sys.argv[2])
"""


def _start_slow_convert(src: Path, out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, str(src), str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not any(".parity-tmp-" in p.name for p in out.parent.iterdir()):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    time.sleep(0.5)  # well into writing
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_conversion_leaves_nothing(tiny_dir, tmp_path, sig):
    proc = _start_slow_convert(tiny_dir("llama"), tmp_path / "out")
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert _leftovers(tmp_path, "out") == []


def test_a_killed_conversion_is_cleaned_up_by_the_next(tiny_dir, tmp_path):
    proc = _start_slow_convert(tiny_dir("llama"), tmp_path / "out")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    stale = _leftovers(tmp_path, "out")
    assert stale and not (tmp_path / "out").exists()
    assert run("convert", tiny_dir("llama"), "--to", "neutral", "-o", tmp_path / "out").exit_code == 0
    assert _leftovers(tmp_path, "out") == [tmp_path / "out"]


def test_run_prints_the_executors_top_tokens(tiny_dir, tmp_path):
    convert(tiny_dir("qwen3"), tmp_path / "out")
    by_ids = run("run", tmp_path / "out", "--ids", "72,101,108,108,111", "--top", "3")
    by_prompt = run("run", tmp_path / "out", "--prompt", "Hello", "--top", "3")
    assert by_ids.exit_code == 0, by_ids.output
    assert by_ids.output == by_prompt.output  # the byte tokenizer maps "Hello" to those ids
    lines = by_ids.output.strip().splitlines()
    assert len(lines) == 3
    probs = [float(line.split()[-1]) for line in lines]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001
    # the top token is the reference model's argmax
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir("qwen3"))
    top = model(torch.tensor([[72, 101, 108, 108, 111]])).logits[0, -1].argmax().item()
    assert int(lines[0].split()[0]) == top
    _refused(run("run", tmp_path / "out", "--ids", "1,x"), "--ids")
    _refused(run("run", tmp_path / "out", "--ids", "999"), "[0, 256)")
    _refused(run("run", tmp_path / "out"), "--prompt")
    _refused(run("run", tmp_path), "manifest.json")
