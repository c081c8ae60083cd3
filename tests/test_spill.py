"""The reference's points written to disk while the candidate runs (parity.checker.prefill.Spill) and read back a
block at a time (parity.compare.OnDisk): every number is the one the tensor held in memory gives, bit for bit, and
a check that spills reports exactly what one that holds its reference's points in memory reports."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch

from parity import compare
from parity.checker import prefill
from parity.checker import run as runner
from parity.compare import OnDisk, logit_metrics, metrics


def pair(shape, dtype=torch.float32, noise=1e-3, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    c = r + noise * torch.randn(shape, generator=g, dtype=torch.float64)
    return c.to(dtype), r.to(dtype)


def on_disk(t: torch.Tensor, file, offset: int = 24) -> OnDisk:
    """``t`` written to ``file`` at ``offset`` (after some other bytes), as an OnDisk tensor."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    os.pwrite(file.fileno(), b"\xff" * offset + data, 0)
    return OnDisk(file.fileno(), offset, t.shape, t.dtype)


@pytest.fixture
def file():
    with tempfile.TemporaryFile() as f:
        yield f


@pytest.fixture(params=[None, 1000, 7], ids=["grain", "1000 elements an op", "7 elements an op"])
def grain(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(compare, "GRAIN", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(), (13,), (3, 5), (2, 3, 17), (1, 9, 2_000), (4, 1, 2, 9)])
def test_metrics_of_a_tensor_on_disk_are_the_tensors(grain, file, shape, dtype):
    c, r = pair(shape, dtype)
    assert metrics(c, on_disk(r, file)) == metrics(c, r)
    if len(shape):
        assert logit_metrics(c, on_disk(r, file)) == logit_metrics(c, r)


def test_strided_candidate_against_a_reference_on_disk(file):
    """The candidate a transposed view, the reference contiguous on disk: paired by position, as in memory."""
    c, r = pair((2, 300, 211))
    c_t = c.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert metrics(c_t, on_disk(r, file)) == metrics(c, r)
    assert logit_metrics(c_t, on_disk(r, file)) == logit_metrics(c, r)


def test_logits_on_disk_disagreeing(file):
    """Logits that disagree (top-1, top-5, allclose) give the in-memory numbers, read a row at a time."""
    c, r = pair((1, 37, 50_000), noise=3.0, seed=2)
    got = logit_metrics(c, on_disk(r, file))
    assert got == logit_metrics(c, r)
    assert 0 < got["top1_agreement"] < 1 and got["allclose_1e-5"] is False


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nonfinite_on_disk(file, bad):
    c, r = pair((6, 5_000))
    r[5, -2] = float(bad)
    got = metrics(c, on_disk(r, file))
    assert got["nonfinite"] == f"{'NaN' if bad == 'nan' else 'Inf'} in reference"
    assert got["nonfinite"] == metrics(c, r)["nonfinite"]
    assert logit_metrics(c, on_disk(r, file)) is None


def test_metrics_do_not_depend_on_threads(monkeypatch):
    """Each chunk's sums are kept by its number and summed in that order, whatever thread computed them."""
    c, r = pair((1, 64, 40_000), noise=0.5)
    results = []
    for threads in (1, 2, 5):
        monkeypatch.setattr(compare, "_threads", lambda device, per_thread, chunks, n=threads: n)
        results.append((metrics(c, r), logit_metrics(c, r)))
    assert results[0] == results[1] == results[2]


def test_chunk_sums_are_exact_enough():
    """The float64 sums of a long tensor stay within rounding of an exactly rounded sum (math.fsum)."""
    c, r = pair((1, 64, 40_000), noise=1e-6)
    got = metrics(c, r)
    cd, rd = c.double().reshape(-1).tolist(), r.double().reshape(-1).tolist()
    ss_r = math.fsum(x * x for x in rd)
    ss_d = math.fsum((a - b) ** 2 for a, b in zip(cd, rd))
    assert got["reference_norm"] == pytest.approx(math.sqrt(ss_r), rel=1e-14)
    assert got["rel_l2"] == pytest.approx(math.sqrt(ss_d / ss_r), rel=1e-12)


def test_spill_reads_back_what_was_written(monkeypatch):
    """Layer inputs and small points come back whole, larger ones as OnDisk; each equal to what was written,
    whatever its dtype or shape."""
    monkeypatch.setattr(prefill, "CHUNK_BYTES", 1000)
    spill = prefill.Spill(whole={"layers.0.out"})
    points = {"layers.0.out": torch.randn(1, 40, 64), "layers.1.mid": torch.randn(1, 40, 64),
              "small": torch.randn(1, 2, 3), "logits": torch.randn(1, 40, 300).to(torch.bfloat16),
              "scalar": torch.tensor(2.5)}
    for name, t in points.items():
        spill.put(name, t, later=name == "logits")  # the scalar is written after it: writes wait their turn
    try:
        got = {name: spill.get(name) for name in points}
        assert isinstance(got["layers.0.out"], torch.Tensor) and isinstance(got["small"], torch.Tensor)
        assert isinstance(got["layers.1.mid"], OnDisk) and isinstance(got["logits"], OnDisk)
        for name, t in points.items():
            back = got[name].load() if isinstance(got[name], OnDisk) else got[name]
            assert back.dtype == t.dtype and torch.equal(back, t), name
        assert spill.get("logits") is None  # each point is handed over once
    finally:
        spill.stop()


def _same_report(a, b) -> None:
    assert [p.to_json() for p in a.points] == [p.to_json() for p in b.points]
    assert a.logits == b.logits
    assert a.first_divergence == b.first_divergence
    assert a.diagnosis == b.diagnosis


@pytest.mark.parametrize("family,inject", [("llama", None), ("gemma3", "embed-scale-dropped")])
def test_a_spilling_check_reports_what_one_in_memory_does(tiny_dir, neutral_dir, monkeypatch, family, inject):
    """Run ahead with every point but the layers' inputs read back from disk a block at a time, and run in step
    with the reference's points held in memory: the same report, bit for bit; a failing one (the candidate's
    embeddings unscaled) keeps the logits from disk for its diagnosis, which is the same too."""
    spilled = []
    original = prefill.Spill.get

    def spy(self, name):
        got = original(self, name)
        spilled.append(type(got).__name__)
        return got

    monkeypatch.setattr(prefill.Spill, "get", spy)
    monkeypatch.setattr(prefill, "CHUNK_BYTES", 0)
    ahead = runner.check(tiny_dir(family), neutral_dir(family), layerwise=True, stream=False, inject=inject)
    assert "OnDisk" in spilled and "Tensor" in spilled
    monkeypatch.setattr(prefill, "points_fit", lambda *args: False)
    spilled.clear()
    in_step = runner.check(tiny_dir(family), neutral_dir(family), layerwise=True, stream=False, inject=inject)
    assert not spilled
    assert bool(ahead) == bool(in_step) == (inject is None)
    _same_report(ahead, in_step)
    if inject:
        assert ahead.diagnosis and ahead.first_divergence.name == "embed"


def test_the_reference_logits_are_on_disk_before_the_candidate_computes_its_own(tiny_dir, neutral_dir, monkeypatch):
    """The reference's logits are written by a thread while the candidate runs its layers, never while the
    candidate holds its own: the executor's head waits for the write."""
    import time

    from parity.neutral.executor.model import NeutralModel

    events = []
    write, head = prefill.Spill._write_later, NeutralModel.head

    def slow_write(self, *args):
        time.sleep(0.5)  # slower than the tiny candidate's layers
        write(self, *args)
        events.append("reference logits written")

    def spy_head(self, x):
        events.append("candidate head")
        return head(self, x)

    monkeypatch.setattr(prefill.Spill, "_write_later", slow_write)
    monkeypatch.setattr(NeutralModel, "head", spy_head)
    report = runner.check(tiny_dir("llama"), neutral_dir("llama"), layerwise=True, stream=False)
    assert report and events == ["reference logits written", "candidate head"]
