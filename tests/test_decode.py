"""Decode parity (--decode N): the KV-cache path step by step, against transformers' uncached forward.

The executor's cache (parity.neutral.executor.cache) and transformers' own cache classes must both reproduce the
uncached forward at every step and point in float32; each KV-cache bug of the catalog, run by the executor,
must fail at its step and be named, while the prefill-only check of the same candidate passes.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from parity.checker.run import check
from parity.checkpoint import open_checkpoint
from parity.cli import cli
from parity.diagnosis import bugs
from parity.errors import ParityError
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load
from parity.reference.decode import crossings, prompt_length
from tests.conftest import FAMILIES

DECODERS = [f for f in FAMILIES if f != "bert"]  # every causal language model


def _steps(report) -> list:
    return [p for p in report.points if p.step is not None]


@pytest.mark.parametrize("family", DECODERS)
def test_decode_32_passes_with_the_executor_and_transformers_caches(family, tiny_dir, neutral_dir):
    ckpt = open_checkpoint(tiny_dir(family))
    for candidate in (neutral_dir(family), tiny_dir(family)):
        report = check(tiny_dir(family), candidate, layerwise=True, decode=32)
        steps = _steps(report)
        longrope = [c for c in report.decode["crossed"] if c["what"].startswith("rope longrope")]
        if candidate == tiny_dir(family) and longrope and longrope[0]["crossed"] == "decode":
            # transformers' own cache keeps the keys it rotated with the short factors once the length passes the
            # threshold (its generate runs the prefix again instead): it fails at the first step past it
            assert report.verdict == "fail"
            assert report.first_divergence.step == longrope[0]["at"] + 1 - prompt_length(ckpt, 32)
            continue
        assert report.verdict == "pass", (candidate, report.first_divergence)
        assert {p.step for p in steps} == set(range(1, 33))
        assert len(steps) == 32 * len(ckpt.resolved.capture) and all(p.compared for p in steps)
        assert max(p.rel_l2 for p in steps) < 1e-4  # float32 rounding: the cache reproduces the uncached forward
        d = report.decode
        assert d["steps"] == 32 and len(d["tokens"]) == 32 and d["first_divergence"] is None
        assert d["kl_max"] < 1e-9 and d["top1_agreement"] == 1.0
        # every sliding window is crossed while decoding: the ring wraps during the steps
        windows = [c for c in d["crossed"] if c["what"].startswith("sliding window")]
        assert all(c["crossed"] == "decode" for c in windows)


def test_the_prompt_is_chosen_so_that_decoding_wraps_each_window(tiny_dir):
    ckpt = open_checkpoint(tiny_dir("gemma3"))  # sliding window 8 on alternate layers
    s = prompt_length(ckpt, 32)
    assert s < 8 < s + 32
    assert [c["crossed"] for c in crossings(ckpt, s, 32)] == ["decode", "decode"]
    assert [c["crossed"] for c in crossings(ckpt, 12, 32)][1] == "prefill"
    assert [c["crossed"] for c in crossings(ckpt, 2, 3)][1] is None
    llama = open_checkpoint(tiny_dir("llama"))  # nothing acts with length: the usual prompt
    assert prompt_length(llama, 32) == 64


def test_the_executor_cache_equals_its_uncached_forward_at_every_position(neutral_dir):
    """The executor's KV cache is its own specification: decoding token by token gives the uncached logits."""
    for family in ("gemma3", "deepseek_v3", "gemma4"):  # windows and global layers, MLA, shared KV
        manifest, tensors = load(neutral_dir(family))
        model = NeutralModel(manifest, tensors, torch.float32)
        ids = torch.randint(3, 100, (1, 20))
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :3], cache=cache)] + [model(ids[:, k:k + 1], cache=cache) for k in range(3, 20)]
        got = torch.cat(steps, dim=1)
        assert ((got - full).norm() / full.norm()).item() < 1e-5, family
        assert cache.length == 20
        # a sliding-window slot is a ring of window - 1 keys between calls; global slots keep all 20
        for i, att in manifest.attentions():
            window = att.sliding_window
            if i in cache.slots:
                assert cache.slots[i][0].shape[2] == (window - 1 if window else 20), (family, i)
        # keeping every key and letting the mask window them (an exported graph's cache) attends to the same
        from parity.neutral.executor.cache import KVCache

        everything = KVCache(manifest.num_layers, evict=False)
        kept = [model(ids[:, :3], cache=everything)] + [model(ids[:, k:k + 1], cache=everything) for k in range(3, 20)]
        kept = torch.cat(kept, dim=1)  # the same up to summation order (masked keys add exact zeros)
        assert ((kept - got).norm() / got.norm()).item() < 1e-6


@pytest.mark.parametrize("family,bug,step", [
    ("gemma2", "sliding-window-cache-off-by-one", 4),   # prompt 4, window 8: position 7 is the first full window
    ("gemma3", "sliding-window-cache-off-by-one", 4),   # ... and only the sliding layers wrap
    ("gemma2", "sliding-window-ignored", 5),            # position 8: the first key outside the window
    ("gemma2", "decode-softcap-dropped", 1),
    ("llama", "decode-position-offset", 1),
    ("gpt2", "decode-position-offset", 1),              # learned positions: the embedding itself
    ("qwen3", "kv-cache-wrong-layer", 1),
    ("mistral", "kv-heads-order-swapped", 1),
])
def test_each_cache_bug_fails_at_its_step_and_is_named(family, bug, step, tiny_dir, neutral_dir):
    prefill = check(tiny_dir(family), neutral_dir(family), layerwise=True, inject=bug, length=4)
    if bugs.get(bug).decode:
        assert prefill.verdict == "pass"  # a cache mistake: the prefill alone cannot see it
    report = check(tiny_dir(family), neutral_dir(family), layerwise=True, inject=bug, decode=32)
    first = report.first_divergence
    assert report.verdict == "fail" and first.step == step, (first.step, first.name)
    assert report.decode["first_divergence"]["step"] == step
    assert report.diagnosis[0]["bug"] == bug and f"decode step {step}" in report.diagnosis[0]["evidence"]
    # the steps before the first divergence agree
    assert all(p.passed for p in _steps(report) if p.step < step)


def test_reports_carry_the_step_axis(tiny_dir, neutral_dir, tmp_path):
    paths = [tmp_path / f"r.{ext}" for ext in ("json", "html", "md")]
    result = CliRunner().invoke(cli, ["check", "--reference", str(tiny_dir("gemma2")), "--candidate",
                                      str(neutral_dir("gemma2")), "--layerwise", "--decode", "16", "--inject",
                                      "sliding-window-cache-off-by-one", "--junit", str(tmp_path / "j.xml"),
                                      *(a for p in paths for a in ("--report", str(p)))])
    assert result.exit_code == 1, result.output
    assert "FAIL at step 4 layers.0.attn_out" in result.output
    data = json.loads(paths[0].read_text())
    assert data["first_divergence"]["step"] == 4 and data["first_divergence"]["point"] == "layers.0.attn_out"
    assert data["decode"]["steps"] == 16 and len(data["decode"]["per_step"]) == 16
    assert [s["passed"] for s in data["decode"]["per_step"]][:4] == [True, True, True, False]
    assert {p["step"] for p in data["points"]} == {None, *range(1, 17)}
    page = paths[1].read_text()
    assert page.count("<svg") == 2 and 'aria-label="error versus decode step"' in page
    assert "first divergence: step 4 layers.0.attn_out" in page
    rows = {line.split("`")[1].split(" (")[0]: line for line in paths[2].read_text().splitlines()
            if line.startswith("| `step ")}  # one row per step: its worst point
    assert len(rows) == 16 and rows["step 3"].endswith("| pass |") and "| FAIL " in rows["step 4"]
    assert 'name="step 4 layers.0.attn_out"' in (tmp_path / "j.xml").read_text()


def test_what_cannot_decode_is_refused_with_exit_2(tiny_dir, neutral_dir, tmp_path):
    def run(*args: str):
        return CliRunner().invoke(cli, ["check", *args])

    bert = run("--reference", str(tiny_dir("bert")), "--candidate", str(neutral_dir("bert")), "--decode", "4")
    assert bert.exit_code == 2 and "not a causal language model" in bert.stderr
    isolated = run("--reference", str(tiny_dir("llama")), "--candidate", str(neutral_dir("llama")), "--decode", "4",
                   "--isolate")
    assert isolated.exit_code == 2 and "drop --isolate" in isolated.stderr
    onnx = tmp_path / "m.onnx"
    assert run_convert(tiny_dir("llama"), onnx).exit_code == 0
    graph = run("--reference", str(tiny_dir("llama")), "--candidate", str(onnx), "--decode", "4")
    assert graph.exit_code == 2 and "no past key/value inputs" in graph.stderr  # parity's export has no cache yet
    with pytest.raises(ParityError, match="must be a number of steps"):
        check(tiny_dir("llama"), neutral_dir("llama"), decode=-1)


def run_convert(src, out):
    return CliRunner().invoke(cli, ["convert", str(src), "--to", "onnx", "-o", str(out)])


# --------------------------------------------------------------------------------------------
# Goldens and engine dumps with decode steps


def _engine_decode(neutral, ids: list[int], tokens: list[int], out_dir, bug: str | None = None) -> list[str]:
    """An engine's decode run, played by the executor with its cache (a decode bug of the catalog injected, if
    asked): each point's .f32 file for the C writer, prompt points [1, S, w] and steps stacked [1, N, w]."""
    manifest, tensors = load(neutral)
    if bug:
        manifest, tensors = bugs.inject(bug, manifest, tensors)
    model = NeutralModel(manifest, tensors, torch.float32)
    cache = model.new_cache()
    prompt: dict[str, torch.Tensor] = {}
    model(torch.tensor([ids]), cache=cache, on_point=lambda n, t: prompt.setdefault(n, t.clone()))
    steps: dict[str, list[torch.Tensor]] = {}
    for token in tokens:
        model(torch.tensor([[token]]), cache=cache, on_point=lambda n, t: steps.setdefault(n, []).append(t.clone()))
    args = []
    for name, t in [*prompt.items(), *((f"decode.{n}", torch.cat(ts, dim=1)) for n, ts in steps.items())]:
        t.contiguous().numpy().tofile(out_dir / f"{name}.f32")
        args.append(f"{name}={out_dir / (name + '.f32')}:{'x'.join(map(str, t.shape))}")
    return args


def test_a_golden_with_decode_steps_checks_an_engine_dump_with_steps_from_the_c_writer(tiny_dir, neutral_dir,
                                                                                     tmp_path):
    import shutil
    import subprocess
    from pathlib import Path

    from safetensors import safe_open

    compiler = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH")
    exe = tmp_path / "dump_writer"
    root = Path(__file__).resolve().parent.parent
    build = subprocess.run([compiler, "-std=c99", "-Wall", "-Wextra", "-O2", "-o", str(exe),
                            str(root / "docs" / "dump_writer.c")], capture_output=True, text=True)
    assert build.returncode == 0 and not build.stderr, build.stderr

    golden = tmp_path / "golden"
    recorded = CliRunner().invoke(cli, ["golden", "record", str(tiny_dir("gemma2")), "-o", str(golden),
                                        "--decode", "16"])
    assert recorded.exit_code == 0 and "16 decode steps" in recorded.output, recorded.output
    inputs = tmp_path / "inputs.json"
    assert CliRunner().invoke(cli, ["inputs", str(golden), "--decode", "16", "-o", str(inputs)]).exit_code == 0
    (item,) = json.loads(inputs.read_text())
    ids, tokens = item["ids"], item["decode"]
    assert len(ids) == 4 and len(tokens) == 16  # the prompt stays inside the window of 8; decoding wraps it

    def dump(name: str, bug: str | None = None, fed: list[int] = tokens):
        out = tmp_path / name
        out.mkdir()
        args = _engine_decode(neutral_dir("gemma2"), ids, fed, out, bug)
        written = subprocess.run([str(exe), str(out / "dump.safetensors"), ",".join(map(str, ids)), "--decode",
                                  ",".join(map(str, fed)), *args], capture_output=True, text=True)
        assert written.returncode == 0, written.stderr
        return out / "dump.safetensors"

    good = dump("good")
    with safe_open(good, "pt") as handle:
        meta = handle.metadata()
        assert json.loads(meta["decode_tokens"]) == tokens and meta["steps"] == "16"
        assert list(handle.get_slice("decode.logits").get_shape()) == [1, 16, 256]
    passed = CliRunner().invoke(cli, ["check", "--reference", str(golden), "--candidate", str(good), "--layerwise",
                                      "--decode", "16", "--report", str(tmp_path / "r.json")])
    assert passed.exit_code == 0, passed.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["reference"]["kind"] == "golden" and data["candidate"]["kind"] == "dump"
    steps = [p for p in data["points"] if p["step"] is not None]
    assert len(steps) == 16 * 15 and all(p["compared"] and p["passed"] for p in steps)

    broken = dump("broken", "sliding-window-cache-off-by-one")
    failed = CliRunner().invoke(cli, ["check", "--reference", str(golden), "--candidate", str(broken), "--layerwise",
                                      "--decode", "16", "--checkpoint", str(tiny_dir("gemma2"))])
    assert failed.exit_code == 1 and "FAIL at step 4 layers.0.attn_out" in failed.output
    assert "diagnosis: sliding-window-cache-off-by-one" in failed.output
    # the prefill alone passes the same dump
    prefill = CliRunner().invoke(cli, ["check", "--reference", str(golden), "--candidate", str(broken), "--layerwise"])
    assert prefill.exit_code == 0, prefill.output

    other = dump("other", fed=[tokens[0], (tokens[1] + 1) % 256, *tokens[2:]])
    refused = CliRunner().invoke(cli, ["check", "--reference", str(golden), "--candidate", str(other), "--decode",
                                       "16"])
    assert refused.exit_code == 2 and "first difference at step 2" in refused.stderr
    longer = CliRunner().invoke(cli, ["check", "--reference", str(golden), "--candidate", str(good), "--decode", "17"])
    assert longer.exit_code == 2 and "holds 16 decode steps" in longer.stderr


# --------------------------------------------------------------------------------------------
# parity's own ONNX export with a KV cache


@pytest.fixture(scope="module")
def cached_onnx(tiny_dir, tmp_path_factory):
    """cached_onnx(family) -> `parity convert --to onnx --debug-outputs --kv-cache` of its tiny checkpoint, exported
    in two worker processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tests import onnx_helpers

    root = tmp_path_factory.mktemp("onnx-cache")
    sources = {f: str(tiny_dir(f)) for f in DECODERS}
    pool = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    futures = {f: pool.submit(onnx_helpers.export_ours, sources[f], str(root / f"{f}.onnx"), "float32", True)
               for f in DECODERS}
    yield lambda family: futures[family].result()
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("family", DECODERS)
def test_decode_32_passes_with_parity_own_onnx_export_with_cache(family, tiny_dir, cached_onnx):
    """The graph takes past_key_values.* and returns present.*; parity feeds each step the cache the step before
    returned, by name. Every point of every step is a debug output, so all are compared. LongRoPE (phi3) is
    refused: its cached keys would keep the short factors once decoding passes the threshold."""
    try:
        exported = cached_onnx(family)
    except ParityError as exc:
        assert "'longrope'" in str(exc) and "without --kv-cache" in str(exc), str(exc)
        return
    report = check(tiny_dir(family), exported, layerwise=True, decode=32)
    steps = _steps(report)
    assert report.verdict == "pass", report.first_divergence
    assert len(steps) == 32 * len(open_checkpoint(tiny_dir(family)).resolved.capture)
    assert all(p.compared for p in steps) and max(p.rel_l2 for p in steps) < 1e-4
    assert report.decode["top1_agreement"] == 1.0


def test_an_onnx_export_refuses_a_cache_it_cannot_have(tiny_dir, tmp_path):
    bert = CliRunner().invoke(cli, ["convert", str(tiny_dir("bert")), "--to", "onnx", "-o", str(tmp_path / "b.onnx"),
                                    "--kv-cache"])
    assert bert.exit_code == 2 and "not a causal language model" in bert.stderr
    bug = CliRunner().invoke(cli, ["convert", str(tiny_dir("llama")), "--to", "onnx", "-o", str(tmp_path / "l.onnx"),
                                   "--kv-cache", "--inject", "kv-cache-wrong-layer"])
    assert bug.exit_code == 2 and "run by parity's executor" in bug.stderr
    assert not list(tmp_path.iterdir())
