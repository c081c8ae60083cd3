"""Per-point metrics and tolerances.

Metrics are computed in float64 a chunk at a time, never by upcasting a whole tensor (a float64 copy of
Gemma 3's [positions, vocabulary] logits is over a gigabyte, and KL needs several): the float64 work is done
in a few buffers of at most CHUNK_BYTES each (a single row of logits larger than that is one chunk), reused
from chunk to chunk, and sums are accumulated in float64 (each chunk's sum, then the chunks' sums, pairwise), so
memory beyond the inputs grows neither with the vocabulary nor with the number of positions.

On the CPU no op of a comparison takes more than GRAIN elements, so that torch runs each on the calling thread:
an op spread over the cores is a parallel region that ends only once each of its threads has been scheduled,
and a comparison is thousands of small ops (on a busy 2-core machine a region cost ~15 ms, against 0.1 ms of
arithmetic). The chunks are spread over as many threads as torch's own instead, each taking the next; each
chunk's results are kept by its number, so they do not depend on the threads. A reference held on disk
(``OnDisk``: a check's points, written to a file while the candidate runs) is read back a block at a time, cut
exactly where the tensor would be, so its metrics are the in-memory tensor's bit for bit.

A point passes when its rel_l2 is within its tolerance (scale-aware: the residual stream grows with depth, so an
absolute tolerance that suits layer 0 means nothing at layer 40); NaN, Inf or a shape mismatch fail it. Cosine
similarity is reported as information only: rel_l2 <= t already implies 1 - cosine <= t**2 / 2, so a cosine
floor could never decide a verdict that rel_l2 had not.

A point's tolerance, in order of precedence (each step overrides the one before it):

1. the dtype's default (DEFAULTS);
2. a TOML file's ``[default]`` (it replaces the dtype default, so it does not discard calibration);
3. ``--calibrate``: CALIBRATION_MULTIPLE x the point's measured noise, never below the dtype's NOISE_FLOOR;
4. a TOML file's ``[points."GLOB"]``, then ``--tolerance GLOB:rel_l2=X``, in the order given (the last
   match wins): a point named explicitly gets what was asked for;
5. floors: no tolerance goes below what the reference can resolve, i.e. ROUNDING_MARGIN x a golden's
   storage rounding, and, when calibrated, the point's measured noise itself.

Each tolerance carries its source, so a report says which step set it.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from parity.errors import ParityError
from parity.report import PointResult, Tolerance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Defaults per dtype: what an honest port reaches against a float32 reference (rel_l2).
DEFAULTS = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
# --calibrate: tolerance = CALIBRATION_MULTIPLE x the point's noise, never below the dtype's rounding floor
CALIBRATION_MULTIPLE = 10.0
# --calibrate on a same-weights reference that computes as the engine does: tolerance = ENGINE_MULTIPLE x the
# distance between that reference and the plain one (what the engine's rounding would cost unmodelled)
# the emulating reference's error reaches the plain one's once rounding flips have cascaded through the layers
# (a float32 difference moves an activation across a rounding boundary): 2x leaves room for that, and stays far
# below what a porting mistake costs
ENGINE_MULTIPLE = 2.0
NOISE_FLOOR = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}
# a reference stored in low precision (a float16 golden) cannot resolve errors below a few times its rounding
ROUNDING_MARGIN = 3.0
COSINE_REFUSED = ("cosine is not a tolerance: rel_l2 <= t already implies cosine >= 1 - t**2/2, so a cosine floor "
                  "never decides a verdict; set rel_l2 only")


# The most bytes one float64 buffer may hold. A comparison allocates a few such buffers once and reuses them
# for every chunk (fresh temporaries per chunk fragment glibc's heap: RSS grew with the number of chunks), so
# it needs at most ~4 x CHUNK_BYTES beyond its inputs, whatever the vocabulary or the number of positions.
CHUNK_BYTES = 16 * 2**20
# torch's grain (at::internal::GRAIN_SIZE): an op over at most this many elements runs on the calling thread (its
# vectorised exp, log, ... take a smaller one: comparisons apply them to whole rows, with (log_)softmax)
GRAIN = 32768
THREAD_CHUNKS = 32  # the fewest chunks a comparison gives each of its threads
ALLCLOSE_RTOL, ALLCLOSE_ATOL = 1e-5, 1e-5  # what a final-output-only gate compares with: np.allclose(atol=1e-5)


class OnDisk:
    """A tensor written contiguously at byte ``offset`` of the open file ``fd``, standing in for it wherever metrics
    and logit_metrics take a tensor: they read it back a block at a time (``blocks``), into one buffer reused from
    block to block, so it never is in memory whole. The blocks are cut by _row_blocks itself, run on a meta tensor
    of its shape, so they are exactly the pieces the in-memory tensor would give, and so are the metrics."""

    def __init__(self, fd: int, offset: int, shape, dtype: torch.dtype, device="cpu"):
        self.fd, self.offset, self.shape, self.dtype = fd, offset, torch.Size(shape), dtype
        self.device = torch.device(device)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def detach(self) -> OnDisk:
        return self

    def to(self, device) -> OnDisk:
        """The same tensor, its blocks handed over on ``device`` (read on the CPU, then moved a block at a time)."""
        return self if torch.device(device) == self.device else OnDisk(self.fd, self.offset, self.shape, self.dtype,
                                                                       device)

    def _read(self, first: int, out: torch.Tensor) -> None:
        """Elements [first, first + out.numel()) into ``out`` (contiguous, on the CPU)."""
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        at, done = self.offset + first * self.element_size(), 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:done + (1 << 30)]], at + done)
            if n <= 0:
                raise OSError(f"a point written to a temporary file could not be read back ({done} of {len(view)} "
                              f"bytes)")
            done += n

    def load(self) -> torch.Tensor:
        """The whole tensor, in memory (for what needs it whole: a diagnosis)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        if out.numel():
            self._read(0, out)
        return out.to(self.device)

    def blocks(self, rows: int) -> Iterator[torch.Tensor]:
        """_row_blocks(the tensor, rows), each block valid until the next one is asked for."""
        pieces = list(_row_blocks(torch.empty(self.shape, dtype=self.dtype, device="meta"), rows))
        buf = torch.empty(max((p.numel() for p in pieces), default=0), dtype=self.dtype)
        for p in pieces:  # a piece of a contiguous meta tensor: its elements are [storage_offset, + numel)
            block = buf[:p.numel()]
            if p.numel():
                self._read(p.storage_offset(), block)
            yield block.view(p.shape).to(self.device)


def _row_blocks(t: torch.Tensor, rows: int) -> Iterator[torch.Tensor]:
    """[k, last_dim] pieces of ``t``, k <= rows (at least 1), covering its rows (vectors along the last dim) in
    order. The cuts depend on the shape only, so two tensors of one shape give matching pieces whatever their
    strides; a piece is a view where the layout allows, else a copy of that piece alone. An OnDisk tensor gives
    the same pieces, read from its file."""
    if isinstance(t, OnDisk):
        yield from t.blocks(rows)
        return
    if t.dim() <= 1:
        yield t.reshape(1, t.numel())
        return
    if t.dim() == 2:
        for i in range(0, t.shape[0], rows):
            yield t[i:i + rows]
        return
    inner = math.prod(t.shape[1:-1])   # rows under one index of the first dim
    if inner == 0:
        return
    if inner <= rows:
        step = rows // inner
        for i in range(0, t.shape[0], step):
            yield t[i:i + step].reshape(-1, t.shape[-1])
    else:
        for i in range(t.shape[0]):
            yield from _row_blocks(t[i], rows)


def _flat_chunks(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """1-D pieces of at most ``limit`` elements, in order, cut by shape only (as _row_blocks): elementwise
    metrics need no whole rows, so even a row longer than ``limit`` is cut."""
    last = t.shape[-1] if t.dim() else 1
    for block in _row_blocks(t, max(1, limit // max(last, 1))):
        if block.numel() <= limit:
            yield block.reshape(-1)
        else:                           # one row longer than limit
            for j in range(0, block.shape[-1], limit):
                yield block[0, j:j + limit]


def _op_elements(device: torch.device) -> int:
    """The most elements one op of a comparison takes: GRAIN on the CPU (each op on the calling thread), a
    CHUNK_BYTES float64 buffer elsewhere (a GPU's kernels are best few and large)."""
    return GRAIN if device.type == "cpu" else max(1, CHUNK_BYTES // 8)


def _threads(device: torch.device, per_thread: int, chunks: int) -> int:
    """The threads a comparison spreads its ``chunks`` over: on the CPU, as many as torch's own (each runs its
    chunks' ops serially, so that none waits on another's scheduling), within 4 x CHUNK_BYTES of buffers
    (``per_thread`` bytes each), and none for fewer than THREAD_CHUNKS chunks (starting one costs more than
    they do); elsewhere one."""
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), 4 * CHUNK_BYTES // max(per_thread, 1), chunks // THREAD_CHUNKS))


def _each_pair(pairs: Iterator, threads: int, setup: Callable[[], Any], take: Callable, work: Callable) -> None:
    """For each pair of chunks (candidate's, reference's) of ``pairs``, numbered i from 0: ``take(cc, rc, own)``
    under a lock (it copies them into the thread's ``own`` buffers, made by ``setup()``: an OnDisk reference's
    chunks share one buffer), then ``work(i, taken, own)`` outside it; on ``threads`` threads, this one among
    them. Results are kept by i, so they do not depend on the threads. The first error stops them all and is
    raised here."""
    lock, stop, errors = threading.Lock(), threading.Event(), []
    numbered = enumerate(pairs)

    def run() -> None:
        try:
            own = setup()
            while not stop.is_set():
                with lock:
                    item = next(numbered, None)
                    if item is None:
                        return
                    i, (cc, rc) = item
                    taken = take(cc, rc, own)
                work(i, taken, own)
        except BaseException as exc:  # noqa: BLE001 - raised in the calling thread
            stop.set()
            errors.append(exc)

    helpers = [threading.Thread(target=run, daemon=True) for _ in range(threads - 1)]
    for helper in helpers:
        helper.start()
    try:
        run()
        for helper in helpers:
            helper.join()
    except BaseException:  # Ctrl-C while waiting: the helpers end after their chunk
        stop.set()
        raise
    if errors:
        raise errors[0]


def _upcast(t: torch.Tensor, buf: torch.Tensor, limit: int | None = None) -> torch.Tensor:
    """``t`` in float64, copied into the front of the reusable ``buf`` (``limit`` elements a copy)."""
    out = buf[:t.shape[0]]
    if limit is None or t.numel() <= limit:
        return out.copy_(t)
    for dst, src in zip(_flat_chunks(out, limit), _flat_chunks(t, limit)):
        dst.copy_(src)
    return out


def _row_sums(x: torch.Tensor, limit: int, out: torch.Tensor) -> None:
    """out[i] = the sum of row i of ``x`` [n, V], no op over more than ``limit`` elements: longer rows are summed a
    piece at a time, then their pieces' sums."""
    if x.numel() <= limit:
        torch.sum(x, -1, out=out)
        return
    for i in range(x.shape[0]):
        out[i] = torch.stack([piece.sum() for piece in _flat_chunks(x[i], limit)]).sum()


def _buffer(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A reusable float64 buffer for ``like``'s chunks, on its device."""
    return torch.empty(shape, dtype=torch.float64, device=like.device)


def metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict:
    """max_abs, mean_abs, rel_l2 = ||c - r|| / ||r||, cosine, and any NaN/Inf, in float64, a chunk at a time."""
    c, r = candidate.detach(), reference.detach()
    if c.shape != r.shape:
        return {"max_abs": float("inf"), "mean_abs": float("inf"), "rel_l2": float("inf"), "cosine": 0.0,
                "nonfinite": f"shape {list(c.shape)} vs reference {list(r.shape)}", "reference_norm": 0.0}
    n = r.numel()
    limit = _op_elements(r.device)
    size = (min(limit, n),)
    # each chunk's float64 sums by its number, on the tensors' device (no host sync until the end), summed
    # pairwise in chunk order at the end
    sums, maxes = {}, {}

    def work(i: int, taken, own) -> None:
        sums[i], largest = _piece_sums(*taken, own[2][:taken[1].shape[0]], own[3][:taken[1].shape[0]])
        if largest is not None:
            maxes[i] = largest

    _each_pair(zip(_flat_chunks(c, limit), _flat_chunks(r, limit)), _threads(r.device, 4 * 8 * size[0], n // limit),
               lambda: tuple(_buffer(r, size) for _ in range(4)),
               lambda cc, rc, own: (_upcast(cc, own[0]), _upcast(rc, own[1])), work)
    return _point_metrics(c, r, limit, [sums[i] for i in sorted(sums)], list(maxes.values()))


def _piece_sums(c64: torch.Tensor, r64: torch.Tensor, diff: torch.Tensor,
                w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One piece's float64 sums (|d|^2, |r|^2, |c|^2, c.r, sum |d|), d = c - r, and its max |d| (None for an empty
    piece); |d| is left in ``diff``, ``w`` is scratch."""
    dot = torch.mul(c64, r64, out=w).sum()
    ss_c = torch.mul(c64, c64, out=w).sum()
    ss_r = torch.mul(r64, r64, out=w).sum()
    torch.sub(c64, r64, out=diff).abs_()
    sums = torch.stack((torch.mul(diff, diff, out=w).sum(), ss_r, ss_c, dot, diff.sum()))
    return sums, diff.max() if diff.numel() else None


def _point_metrics(c: torch.Tensor, r: torch.Tensor, limit: int, sums: list[torch.Tensor],
                   maxes: list[torch.Tensor]) -> dict:
    """metrics' result from its pieces' sums, in the pieces' order, and their max |d|."""
    n = r.numel()
    acc = torch.stack(sums, 1).sum(-1) if sums else torch.zeros(5, dtype=torch.float64)
    ss_diff, ss_r, ss_c, dot, sum_abs = acc.tolist()
    nonfinite = None
    # A NaN or Inf on a side makes its sum of squares NaN or Inf; only then are its elements looked at (the
    # sum may also overflow on finite values), NaN reported over Inf, the reference before the candidate.
    for side, t, ss in (("reference", r, ss_r), ("candidate", c, ss_c)):
        if not math.isfinite(ss):
            kind = _nonfinite(t, limit)
            if kind:
                nonfinite = f"{kind} in {side}"
                break
    if nonfinite:
        return {"max_abs": float("inf"), "mean_abs": float("inf"), "rel_l2": float("inf"), "cosine": 0.0,
                "nonfinite": nonfinite, "reference_norm": float("nan")}
    r_norm, c_norm = math.sqrt(ss_r), math.sqrt(ss_c)
    rel = math.sqrt(ss_diff) / r_norm if r_norm > 0 else (0.0 if c_norm == 0 else float("inf"))
    cosine = 1.0 if r_norm == 0 and c_norm == 0 else (0.0 if r_norm == 0 or c_norm == 0 else dot / (c_norm * r_norm))
    return {"max_abs": torch.stack(maxes).max().item() if maxes else 0.0,
            "mean_abs": sum_abs / n if n else 0.0, "rel_l2": rel, "cosine": cosine, "nonfinite": None,
            "reference_norm": r_norm}


def _nonfinite(t: torch.Tensor, limit: int) -> str | None:
    """'NaN', 'Inf' or None for ``t``, checked a chunk at a time in its own dtype (no float64 copy)."""
    inf = False
    for x in _flat_chunks(t, limit):
        if torch.isnan(x).any():
            return "NaN"
        inf = inf or bool(torch.isinf(x).any())
    return "Inf" if inf else None


def logit_metrics(candidate: torch.Tensor, reference: torch.Tensor) -> dict | None:
    """KL(reference || candidate) per position, top-1 agreement, top-5 overlap, max logit difference; None when
    the two cannot be compared (shapes differ, or NaN/Inf: the logits point itself fails and says why; or there
    are no logits). Computed in float64, a chunk of positions at a time."""
    both = _logits(candidate, reference, point=False)
    return None if both is None else both[1]


def logits_compared(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[dict, dict | None]:
    """(metrics, logit_metrics) of the logits, in one pass: each side's logits are read (from disk, for an OnDisk
    reference) and upcast once, not once for each. The metrics are summed over the same pieces in the same order
    as metrics' own, so they are its numbers exactly."""
    both = _logits(candidate, reference, point=True)
    return (metrics(candidate, reference), None) if both is None else both


class _LogitBuffers(NamedTuple):
    """A thread's float64 buffers for a chunk of logits, reused from chunk to chunk."""

    c: torch.Tensor
    r: torch.Tensor
    log_p: torch.Tensor
    log_q: torch.Tensor
    p: torch.Tensor
    within: torch.Tensor   # |c - r| <= atol + rtol * |r|, element by element
    top: torch.Tensor      # top-k values (only the indices are kept)


def _logits(c: torch.Tensor, r: torch.Tensor, point: bool) -> tuple[dict | None, dict] | None:
    """logit_metrics, and with ``point`` metrics too (else None in its place); None where logit_metrics is."""
    c, r = c.detach(), r.detach()
    if c.shape != r.shape or r.dim() == 0 or r.numel() == 0:
        return None
    vocab = r.shape[-1]
    positions = r.numel() // vocab
    limit = _op_elements(r.device)
    rows = max(1, limit // vocab)  # a chunk of whole rows: one row, where a row is longer than an op may be
    # in the inputs' dtype, one read: min and max are finite only without Inf, and NaN propagates into them; a
    # tensor in one reduction (nothing copied), an OnDisk one a piece at a time
    bounds = [torch.stack(torch.aminmax(block)) for block in itertools.chain(
        *((t,) if isinstance(t, torch.Tensor) else _flat_chunks(t, limit) for t in (c, r)))]
    if not torch.isfinite(torch.stack(bounds)).all().item():
        return None
    k = min(5, vocab)
    dev, f64 = r.device, torch.float64
    chunk = (min(rows, positions), vocab)
    top_r, top_c = (torch.empty(positions, k, dtype=torch.long, device=dev) for _ in range(2))
    kl = torch.empty(positions, dtype=f64, device=dev)
    # the first position of each chunk (chunks are cut by shape alone)
    sizes = [b.shape[0] for b in _row_blocks(torch.empty(r.shape, device="meta"), rows)]
    starts = list(itertools.accumulate(sizes, initial=0))
    worst: dict[int, torch.Tensor] = {}
    sums: dict[int, list[torch.Tensor]] = {}  # with ``point``: each chunk's pieces' sums, as metrics cuts them
    close = [True]  # torch.allclose(c, r, rtol, atol) over every chunk so far
    pieces = lambda *ts: zip(*(_flat_chunks(t, limit) for t in ts))  # noqa: E731 - same shapes, same cuts

    def setup() -> _LogitBuffers:
        return _LogitBuffers(c=_buffer(c, chunk), r=_buffer(r, chunk), log_p=_buffer(r, chunk),
                             log_q=_buffer(r, chunk), p=_buffer(r, chunk),
                             within=torch.empty(chunk, dtype=torch.bool, device=dev),
                             top=torch.empty(chunk[0], k, dtype=f64, device=dev))

    def work(i: int, taken, own: _LogitBuffers) -> None:
        c64, r64 = taken
        n, start = r64.shape[0], starts[i]
        stop = start + n
        log_p, log_q, p = own.log_p[:n], own.log_q[:n], own.p[:n]
        # top-k and (log-)softmax run over whole rows: a chunk of one row, or of rows within one op's elements
        torch.topk(r64, k, -1, out=(own.top[:n], top_r[start:stop]))
        torch.topk(c64, k, -1, out=(own.top[:n], top_c[start:stop]))
        chunk_worst, sums[i] = [], []
        for d, w, cp, rp in pieces(log_p, p, c64, r64):  # metrics' pieces: the same shapes, the same cuts
            if point:  # max |d| is max(-min d, max d)
                piece, largest = _piece_sums(cp, rp, d, w)
                sums[i].append(piece)
                chunk_worst.append(largest)
            else:
                low, high = torch.aminmax(torch.sub(cp, rp, out=d))
                chunk_worst.append(torch.maximum(-low, high))
        worst[i] = torch.stack(chunk_worst).max()
        # |c - r| <= atol + rtol * |r| everywhere, on finite inputs: a chunk within atol is (atol + rtol * |r| >=
        # atol), and once an element is not, no other chunk needs looking at
        if close[0] and worst[i].item() > ALLCLOSE_ATOL:
            ok = torch.ones((), dtype=torch.bool, device=dev)
            for d, a, rp, within in pieces(log_p, log_q, r64, own.within[:n]):
                allowed = torch.abs(rp, out=a).mul_(ALLCLOSE_RTOL).add_(ALLCLOSE_ATOL)
                ok &= torch.le(d.abs_(), allowed, out=within).all()
            if not ok.item():
                close[0] = False
        torch.log_softmax(r64, -1, out=log_p)
        torch.log_softmax(c64, -1, out=log_q)
        for lp, lq, pp in pieces(log_p, log_q, p):  # p * (log p - log q), in place; p = exp(log p): the softmax
            torch.sub(lp, lq, out=lq).mul_(torch.exp(lp, out=pp))
        _row_sums(log_q, limit, kl[start:stop])

    threads = _threads(dev, 5 * 8 * chunk[0] * vocab, positions // chunk[0])
    _each_pair(zip(_row_blocks(c, rows), _row_blocks(r, rows)), threads, setup,
               lambda cc, rc, own: (_upcast(cc, own.c, limit), _upcast(rc, own.r, limit)), work)
    agree = top_r[:, 0] == top_c[:, 0]
    # topk's indices are distinct within a row, so the matches count |topk_r & topk_c|
    overlap = (top_r.unsqueeze(-1) == top_c.unsqueeze(-2)).any(-1).sum(-1)
    chunks = sorted(worst)
    found = _point_metrics(c, r, limit, [x for i in chunks for x in sums[i]], [worst[i] for i in chunks]) \
        if point else None
    return found, {
        "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
        "top1_agreement": agree.double().mean().item(),
        "top5_overlap": (overlap.double() / k).mean().item(),
        "max_logit_diff": max(0.0, torch.stack(list(worst.values())).max().item()),  # -0.0 when equal
        "positions": positions,
        # what a final-output-only gate would have said: np.allclose(atol=1e-5), and the next token
        "allclose_1e-5": close[0],
        "next_token_agrees": bool(agree[-1].item()),
    }


class Tolerances:
    """Each point's tolerance, by the precedence in this module's docstring."""

    def __init__(self, dtype: str, specs: list[str] = ()):
        if dtype not in DEFAULTS:
            raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DEFAULTS)}")
        self.dtype = dtype
        self.default = Tolerance(DEFAULTS[dtype], f"{dtype} default")
        self.rules: list[tuple[str, float, str]] = []   # (glob, rel_l2, label), in the order given
        for spec in specs:
            default, rules = _parse(spec)
            if default is not None:
                self.default = default
            self.rules += rules

    def for_point(self, name: str, noise: float | None = None, rounding: float = 0.0,
                  multiple: float = CALIBRATION_MULTIPLE, what: str = "noise") -> Tolerance:
        """``noise``: the point's measured noise (with --calibrate), of which the tolerance is ``multiple`` times
        (``what`` names it); ``rounding``: the reference's own storage rounding (a golden stored in float16)."""
        tol = self.default
        if noise is not None:
            tol = Tolerance(max(multiple * noise, NOISE_FLOOR[self.dtype]), f"calibrated ({multiple:g}x {what})")
        for pattern, rel_l2, label in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                tol = Tolerance(rel_l2, label)
        for floor, why in ((ROUNDING_MARGIN * rounding, f"{ROUNDING_MARGIN:g}x the reference's storage rounding"),
                           (noise or 0.0, "the point's measured noise")):
            if floor > tol.rel_l2:
                tol = Tolerance(floor, f"{tol.source}, raised to {why}")
        return tol


def _parse(spec: str) -> tuple[Tolerance | None, list[tuple[str, float, str]]]:
    """'GLOB:rel_l2=1e-3' or a TOML file with [default] and [points."GLOB"] tables: (its default, its globs)."""
    path = Path(spec)
    if spec.endswith(".toml"):
        if not path.is_file():
            raise ParityError(f"--tolerance {spec}: no such file; give a TOML file or 'GLOB:rel_l2=1e-3'")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
            raise ParityError(f"{spec}: not valid TOML ({str(exc).splitlines()[0] if str(exc) else exc}); "
                              f"fix the file") from None
        unknown = set(data) - {"default", "points"}
        if unknown:
            raise ParityError(f"{spec}: unknown table(s) {', '.join(sorted(unknown))}; use [default] and [points.\"GLOB\"]")
        default = data.get("default")
        points = data.get("points", {})
        if default is not None and not isinstance(default, dict) or not isinstance(points, dict):
            raise ParityError(f"{spec}: [default] and [points.\"GLOB\"] must be tables of rel_l2 = NUMBER")
        rules = []
        for pattern, values in points.items():
            if not isinstance(values, dict):
                raise ParityError(f"{spec}: points.{pattern!r} must be a table like {{ rel_l2 = 1e-3 }}")
            rules.append((pattern, _rel_l2(f"{spec} [points.{pattern!r}]", values), f"{spec} {pattern}"))
        return (None if default is None else Tolerance(_rel_l2(f"{spec} [default]", default), f"{spec} [default]"),
                rules)
    pattern, sep, rest = spec.rpartition(":")
    if not sep or not pattern:
        raise ParityError(f"--tolerance {spec!r}: expected 'GLOB:rel_l2=1e-3' or a .toml file")
    values = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq:
            raise ParityError(f"--tolerance {spec!r}: {item!r} is not KEY=VALUE; expected 'GLOB:rel_l2=1e-3'")
        values[key.strip()] = value.strip()
    return None, [(pattern, _rel_l2(f"--tolerance {spec!r}", values), spec)]


def _rel_l2(where: str, values: dict) -> float:
    """The rel_l2 of a tolerance table: a finite, non-negative number, and nothing else."""
    if "cosine" in values:
        raise ParityError(f"{where}: {COSINE_REFUSED}")
    unknown = set(values) - {"rel_l2"}
    if unknown or "rel_l2" not in values:
        raise ParityError(f"{where}: expected rel_l2 = NUMBER, got {', '.join(sorted(values)) or 'nothing'}")
    value = values["rel_l2"]
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not number >= 0 or number == float("inf"):
        raise ParityError(f"{where}: rel_l2={value!r} is not a finite number >= 0")
    return number


def judge(name: str, m: dict, tol: Tolerance, noise: float | None) -> PointResult:
    passed = m["nonfinite"] is None and m["rel_l2"] <= tol.rel_l2
    return PointResult(name=name, max_abs=m["max_abs"], mean_abs=m["mean_abs"], rel_l2=m["rel_l2"],
                       cosine=m["cosine"], tolerance=tol, passed=passed, noise=noise, nonfinite=m["nonfinite"],
                       reference_norm=m["reference_norm"])
