"""parity.compare's metrics, computed a chunk at a time, against whole-tensor float64 formulas written out here
(the oracle), and the memory they take: it must not grow with the vocabulary."""

from __future__ import annotations

import math
import os
import re
import threading
import time

import pytest
import torch

from parity import compare
from parity.compare import logit_metrics, metrics

# ---------------------------------------------------------------- the oracle: whole tensors, upcast to float64


def oracle_metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict:
    c, r = candidate.double(), reference.double()
    if c.shape != r.shape:
        return {"max_abs": math.inf, "mean_abs": math.inf, "rel_l2": math.inf, "cosine": 0.0,
                "nonfinite": f"shape {list(c.shape)} vs reference {list(r.shape)}", "reference_norm": 0.0}
    for side, t in (("reference", r), ("candidate", c)):
        if not torch.isfinite(t).all():
            return {"max_abs": math.inf, "mean_abs": math.inf, "rel_l2": math.inf, "cosine": 0.0,
                    "nonfinite": f"{'NaN' if torch.isnan(t).any() else 'Inf'} in {side}",
                    "reference_norm": math.nan}
    d = c - r
    rn, cn = r.norm().item(), c.norm().item()
    if rn > 0:
        rel = d.norm().item() / rn
    else:
        rel = 0.0 if cn == 0 else math.inf
    if rn == 0 and cn == 0:
        cos = 1.0
    elif rn == 0 or cn == 0:
        cos = 0.0
    else:
        cos = (c.flatten() @ r.flatten()).item() / (rn * cn)
    n = d.numel()
    return {"max_abs": d.abs().max().item() if n else 0.0, "mean_abs": d.abs().mean().item() if n else 0.0,
            "rel_l2": rel, "cosine": cos, "nonfinite": None, "reference_norm": rn}


def oracle_logits(candidate: torch.Tensor, reference: torch.Tensor) -> dict | None:
    if candidate.shape != reference.shape:
        return None
    if not (torch.isfinite(candidate).all() and torch.isfinite(reference).all()):
        return None
    vocab = reference.shape[-1]
    c, r = candidate.double().reshape(-1, vocab), reference.double().reshape(-1, vocab)
    p, log_p, log_q = torch.softmax(r, -1), torch.log_softmax(r, -1), torch.log_softmax(c, -1)
    kl = (p * (log_p - log_q)).sum(-1)
    k = min(5, vocab)
    top_r, top_c = r.topk(k, -1).indices.tolist(), c.topk(k, -1).indices.tolist()
    overlap = [len(set(a) & set(b)) / k for a, b in zip(top_r, top_c)]
    top1 = [a[0] == b[0] for a, b in zip(top_r, top_c)]
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(), "top1_agreement": sum(top1) / len(top1),
            "top5_overlap": sum(overlap) / len(overlap), "max_logit_diff": (c - r).abs().max().item(),
            "positions": r.shape[0], "allclose_1e-5": bool(torch.allclose(c, r, rtol=1e-5, atol=1e-5)),
            "next_token_agrees": top1[-1]}


def assert_same(got: dict | None, want: dict | None, rel: float = 1e-12) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None and set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        if isinstance(w, float) and not isinstance(w, bool):
            assert isinstance(g, float), (key, g)
            if math.isnan(w):
                assert math.isnan(g), (key, g)
            else:
                # abs: KL of near-identical rows is ~1e-13, mostly rounding; 1e-20 is far below anything reported
                assert g == pytest.approx(w, rel=rel, abs=1e-20), (key, g, w)
        else:
            assert g == w and type(g) is type(w), (key, g, w)


# ---------------------------------------------------------------- chunk sizes

ROW = 50_000
CHUNKS = {
    "default": None,
    "3 rows": 8 * ROW * 3,         # many chunks of whole rows
    "under a row": 8 * 4_096,      # a row of logits is larger than a chunk: one row a chunk, metrics cut it
    "7 elements": 8 * 7,           # chunk boundaries off every row boundary
}


def _chunk_bytes(name, monkeypatch):
    if CHUNKS[name] is not None:
        monkeypatch.setattr(compare, "CHUNK_BYTES", CHUNKS[name])
    return name


@pytest.fixture(params=list(CHUNKS))
def chunk(request, monkeypatch):
    return _chunk_bytes(request.param, monkeypatch)


@pytest.fixture(params=[name for name in CHUNKS if name != "7 elements"])
def big_chunk(request, monkeypatch):
    """For [*, 50_000] tensors, where 7-element chunks would be slow and add nothing."""
    return _chunk_bytes(request.param, monkeypatch)


def pair(shape, dtype=torch.float32, noise=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    c = r + noise * torch.randn(shape, generator=g, dtype=torch.float64)
    return c.to(dtype), r.to(dtype)


# ---------------------------------------------------------------- metrics


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (13,), (3, 5), (2, 3, 17), (4, 1, 2, 9)])
def test_metrics_match_oracle(chunk, shape, dtype):
    c, r = pair(shape, dtype)
    assert_same(metrics(c, r), oracle_metrics(c, r))
    assert_same(metrics(r, r), oracle_metrics(r, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_metrics_of_logits_match_oracle(big_chunk, dtype):
    c, r = pair((37, ROW), dtype)
    assert_same(metrics(c, r), oracle_metrics(c, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])   # float64: the views are used in place
def test_strided_inputs_pair_by_position(big_chunk, dtype):
    """One side contiguous, the other a transposed view: elements are paired by index, not by memory."""
    c, r = pair((2, 300, 211), dtype)
    r_t = r.transpose(0, 2).contiguous().transpose(0, 2)       # same values, other strides
    c_t = c.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert not r_t.is_contiguous() and not c_t.is_contiguous()
    want = oracle_metrics(c, r)
    assert_same(metrics(c, r_t), want)
    assert_same(metrics(c_t, r), want)
    assert_same(logit_metrics(c_t, r_t), oracle_logits(c, r))


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5), (2, 0, 4)])
def test_metrics_empty(shape):
    z = torch.zeros(shape)
    assert_same(metrics(z, z), oracle_metrics(z, z))


@pytest.mark.parametrize("c_val,r_val", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (2.0, -2.0)])
def test_metrics_zero_norms(chunk, c_val, r_val):
    c, r = torch.full((5, 1_000), c_val), torch.full((5, 1_000), r_val)
    got, want = metrics(c, r), oracle_metrics(c, r)
    assert_same(got, want)


@pytest.mark.parametrize("where", ["reference", "candidate", "both"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "nan+inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite(big_chunk, where, bad, dtype):
    c, r = pair((6, ROW), dtype)
    for side, t in (("reference", r), ("candidate", c)):
        if where in (side, "both"):
            if bad == "nan+inf":              # Inf found first, NaN later: still reported as NaN
                t[0, 3], t[5, -1] = math.inf, math.nan
            else:
                t[5, -2] = float(bad)          # in the last chunk
    got = metrics(c, r)
    assert_same(got, oracle_metrics(c, r))
    side = "candidate" if where == "candidate" else "reference"   # the reference is reported first
    assert got["nonfinite"] == f"{'Inf' if bad in ('inf', '-inf') else 'NaN'} in {side}"
    assert logit_metrics(c, r) is None and oracle_logits(c, r) is None


def test_early_returns_build_no_float64_copy(monkeypatch):
    c, r = torch.zeros(3, 4), torch.zeros(3, 5)

    def refuse(*_a, **_k):
        raise AssertionError("a float64 copy before an early return")

    monkeypatch.setattr(torch.Tensor, "double", refuse)
    monkeypatch.setattr(compare, "_buffer", refuse)
    assert metrics(c, r) == {"max_abs": math.inf, "mean_abs": math.inf, "rel_l2": math.inf, "cosine": 0.0,
                             "nonfinite": "shape [3, 4] vs reference [3, 5]", "reference_norm": 0.0}
    assert logit_metrics(c, r) is None
    c[1, 1] = math.nan                                        # a NaN in a logits pair: None, nothing upcast
    assert logit_metrics(c, c.clone()) is None
    monkeypatch.undo()
    assert_same(metrics(c, r), oracle_metrics(c, r))


# ---------------------------------------------------------------- logit_metrics


@pytest.mark.parametrize("shape,noise,dtype", [
    ((2, 5, 1_000), 1.0, torch.float64), ((1_000,), 1.0, torch.float16), ((4, 3), 2.0, torch.float32),
    ((6, 2), 5.0, torch.bfloat16), ((3, 1), 1.0, torch.float32)])
def test_logit_metrics_match_oracle(chunk, shape, noise, dtype):
    c, r = pair(shape, dtype, noise=noise, seed=len(shape))
    assert_same(logit_metrics(c, r), oracle_logits(c, r), rel=1e-10)


@pytest.mark.parametrize("noise,dtype", [(0.3, torch.float32), (3.0, torch.float32), (1.0, torch.bfloat16)])
def test_large_logit_metrics_match_oracle(big_chunk, noise, dtype):
    c, r = pair((37, ROW), dtype, noise=noise, seed=2)
    got = logit_metrics(c, r)
    assert_same(got, oracle_logits(c, r), rel=1e-10)
    if noise == 3.0:   # the case exercises disagreement, not only agreement
        assert 0 < got["top1_agreement"] < 1 and 0 < got["top5_overlap"] < 1


def test_allclose_is_all_chunks(big_chunk):
    r = pair((37, ROW), noise=0)[1]
    c = r + 1e-7 * r.abs()                                    # within rtol=1e-5 everywhere
    assert logit_metrics(c, r)["allclose_1e-5"] is True
    c[36, ROW - 1] += 1e-3                                    # one element, in the last chunk
    got = logit_metrics(c, r)
    assert got["allclose_1e-5"] is False and got["next_token_agrees"] == oracle_logits(c, r)["next_token_agrees"]
    assert_same(got, oracle_logits(c, r), rel=1e-10)
    assert_same(logit_metrics(r, r), oracle_logits(r, r))    # identical: KL 0, all agree, allclose


@pytest.mark.parametrize("shape,dtype", [((2, 5, 1_000), torch.float64), ((1_000,), torch.float16),
                                         ((4, 3), torch.float32), ((3, 1), torch.bfloat16)])
def test_logits_compared_are_metrics_and_logit_metrics(chunk, shape, dtype):
    """One pass over the logits gives metrics' numbers exactly (the same pieces, summed in the same order), and
    logit_metrics'; where logit_metrics has none (NaN, shapes), metrics alone says why."""
    c, r = pair(shape, dtype, noise=1.0)
    assert compare.logits_compared(c, r) == (metrics(c, r), logit_metrics(c, r))
    assert compare.logits_compared(r, r) == (metrics(r, r), logit_metrics(r, r))
    assert compare.logits_compared(c[..., :-1], r[..., 1:]) == (metrics(c[..., :-1], r[..., 1:]),
                                                                   logit_metrics(c[..., :-1], r[..., 1:]))
    c.view(-1)[-1] = math.nan
    got, logits = compare.logits_compared(c, r)
    assert logits is None and got["nonfinite"] == "NaN in candidate"
    assert compare.logits_compared(c, r[:-1])[0]["nonfinite"].startswith("shape")


def test_large_logits_compared(big_chunk):
    c, r = pair((37, ROW), noise=0.3, seed=2)
    assert compare.logits_compared(c, r) == (metrics(c, r), logit_metrics(c, r))


def test_logit_metrics_without_logits():
    assert logit_metrics(torch.zeros(0, 10), torch.zeros(0, 10)) is None
    assert logit_metrics(torch.zeros(3, 0), torch.zeros(3, 0)) is None
    assert logit_metrics(torch.tensor(1.0), torch.tensor(1.0)) is None


def test_row_blocks_cut_by_shape_only():
    t = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    strided = t.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    for rows in (1, 2, 5, 12, 13, 100):
        a, b = list(compare._row_blocks(t, rows)), list(compare._row_blocks(strided, rows))
        assert [x.shape for x in a] == [x.shape for x in b]
        assert all(x.shape[0] <= rows for x in a)
        assert torch.equal(torch.cat(a), t.reshape(-1, 5)) and torch.equal(torch.cat(b), t.reshape(-1, 5))
    for limit in (1, 3, 7, 64, 10**6):
        pieces = list(compare._flat_chunks(t, limit))
        assert all(p.dim() == 1 and p.numel() <= limit for p in pieces)
        assert torch.equal(torch.cat(pieces), t.reshape(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_on_gpu_stays_on_gpu():
    c, r = pair((9, ROW))
    assert_same(metrics(c.cuda(), r.cuda()), oracle_metrics(c, r), rel=1e-9)
    assert_same(logit_metrics(c.cuda(), r.cuda()), oracle_logits(c, r), rel=1e-9)


# ---------------------------------------------------------------- memory


def _peak_rss_during(fn) -> int:
    """Peak resident bytes while fn runs, above the resident bytes before it."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def hwm() -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024

    before = rss()
    try:   # Linux resets the high-water mark on writing 5 here: exact, no sampling
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        peak, stop = [before], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.0005)

        thread = threading.Thread(target=sample)
        thread.start()
        try:
            fn()
        finally:
            stop.set()
            thread.join()
        return peak[0] - before
    fn()
    return hwm() - before


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_memory_does_not_grow_with_vocabulary():
    """A [64, 262144] float32 pair (64 MiB a side): whole-tensor float64 code took ~15x one input above the
    inputs for logit_metrics and ~8x for metrics; chunked, a few CHUNK_BYTES."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(64, 262_144, generator=g)
    c = r + 0.1 * torch.randn(64, 262_144, generator=g)
    size = r.numel() * r.element_size()
    logit_metrics(c[:2], r[:2]), metrics(c[:2], r[:2])      # warm up kernels and thread pools first
    used = _peak_rss_during(lambda: logit_metrics(c, r))
    assert used < 2 * size, f"logit_metrics took {used / 2**20:.0f} MiB above its inputs"
    used = _peak_rss_during(lambda: metrics(c, r))
    assert used < 2 * size, f"metrics took {used / 2**20:.0f} MiB above its inputs"
