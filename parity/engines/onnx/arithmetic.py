"""onnxruntime's CPU arithmetic for quantized graphs, emulated on a transformers model (the same-weights reference
of an ONNX file quantized by onnxruntime: parity.engines.onnx.weights), with the interface every engine's
arithmetic has (parity.engines.arithmetic).

Read from onnxruntime's CPU kernels (core/util/qmath.h, core/mlas/lib/quantize.cpp, contrib_ops/cpu/quantization:
dynamic_quantize_matmul.cc, matmul_integer_to_float.cc, matmul_nbits.cc):

- DynamicQuantizeLinear (alone, or fused into DynamicQuantizeMatMul): one uint8 scale per tensor, over the whole
  activation: ``min = min(0, min x)``, ``max = max(0, max x)``, ``scale = (max - min) / 255`` in float32,
  ``zp = round_half_even(clamp(-min / scale, 0, 255))``; ``q = clamp(round_half_even(x / scale) + zp)`` (MLAS
  divides, it does not multiply by a reciprocal).
- MatMulInteger (or MatMulIntegerToFloat): the integer products summed exactly in int32, then
  ``float(acc) * float32(a_scale * b_scale)``: exact, so emulated exactly here (float64 holds every int32 sum).
  x86 without VNNI sums u8 x s8 pairs in int16 with saturation (vpmaddubsw); that is not emulated (see docs/onnx.md).
- QDQ: QuantizeLinear with the graph's static scale and zero point, the same division and rounding, saturated to
  int8 or uint8; DequantizeLinear ``(q - zp) * scale``; the MatMul between them in float32 (onnxruntime 1.32 on
  x86 leaves DQ -> MatMul unfused for int8 activations: torch's float32 product of the dequantized values equals
  its output bit for bit). Where a projection's output carries a Q/DQ pair too, it is rounded before the bias is
  added (the graph adds the bias after it).
- QLinearMatMul (quantize_linear_matmul.cc, MlasRequantizeOutput): the input's static QuantizeLinear, the integer
  products summed exactly, then back to the output's integers in float32, ``round_half_even(float(acc) *
  (a_scale * b_scale / y_scale)) + y_zp`` saturated, which the DequantizeLinear after it turns into float.
- MatMulNBits (matmul_nbits.cc GetComputeType): accuracy_level unset (0) or 1..3 computes in float32 on the
  dequantized weights (SQNBIT_CompFp32), so nothing is rounded beyond the weights; level 4 (SQNBIT_CompInt8, where
  MLAS has the kernel) first rounds each activation row in blocks of the weight's block size
  (QuantizeARow_CompInt8: ``scale = amax / 127``, ``q = round_half_even(a * (127 / amax))``, the tail block padded
  with zeros); the int8 x int4 block products are exact, their float32 sums are not reproduced.

What is left against onnxruntime is float32 summation order outside the integer matmuls, and the rounding
boundaries it moves an activation across.
"""

from __future__ import annotations

import functools
import json
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict

from parity.engines.arithmetic import FILE
from parity.reference.capture import input_value, with_input

ENGINE = "onnxruntime (CPU)"
OUTPUT = "@output"    # the model's output embeddings (a tied lm_head: the embedding matrix)
RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
BLOCK_INVERSES = ("127/amax", "1/scale")
PAIRS = "int16 pairs"  # a projection's products summed as MLAS's u8 x s8 kernels without VNNI sum them


@functools.cache  # read once: every quantized projection of a graph asks
def _cpu_flags() -> frozenset[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def block_inverse() -> str:
    """How this CPU's MLAS CompInt8 kernels invert an activation block's scale (int8_blocks)."""
    return BLOCK_INVERSES[0] if {"avx512f", "avx512bw"} <= _cpu_flags() else BLOCK_INVERSES[1]


def saturates_pairs() -> bool:
    """Whether onnxruntime's u8 x s8 matmuls on this CPU sum adjacent products in int16 with saturation: x86 with
    AVX2 or AVX-512BW but neither VNNI (vpdpbusd sums in int32) nor AMX (onnxruntime's documented caveat, and why
    its quantizers offer reduce_range)."""
    flags = _cpu_flags()
    return "avx2" in flags and not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}


class _Record(BaseModel):
    """A part of the arithmetic as parity-arithmetic.json holds it (no other keys: the input's three forms are told
    apart by theirs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class QParams(_Record):
    """A static QuantizeLinear's (or DequantizeLinear's) scale, zero point and integer type."""

    scale: float
    zero_point: float
    type: str


class Dynamic(_Record):
    """DynamicQuantizeLinear: the activation's uint8 scale and zero point computed at run time, over all of it."""

    dynamic: Literal[True] = True


class Blocks(_Record):
    """MatMulNBits at accuracy_level 4: the activation rounded to int8 in blocks of the weight's (int8_blocks)."""

    blocks: int
    inverse: str = BLOCK_INVERSES[0]


class Projection(_Record):
    """One projection's kernel as onnxruntime's CPU computes it."""

    op: str                               # the graph's op ("MatMul (QDQ)": a MatMul between Q/DQ pairs)
    activations: Optional[str] = None     # how its input is rounded, in words (the report's)
    input: Optional[Union[QParams, Dynamic, Blocks]] = None  # None: the input goes in float32
    output: Optional[QParams] = None      # a Q/DQ pair on its output, rounded before the bias is added
    integer: bool = False                 # the integer products summed exactly (MatMulInteger, QLinearMatMul)
    weight_scale: Optional[list[float]] = None  # per output row, or one
    requantize: Optional[QParams] = None  # QLinearMatMul: the sum back to the output's integers, then dequantized
    pairs: Optional[str] = None           # PAIRS: summed as MLAS's u8 x s8 kernels without VNNI sum them


class Rounding(QParams):
    """A static Q/DQ pair on a capture point, where the adapter's capture map reads the point."""

    module: str
    io: str
    arg: Union[int, str, None] = None
    field: Union[int, str, None] = None


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, kind: str) -> torch.Tensor:
    """QuantizeLinear as MLAS computes it: x / scale in float32, rounded half to even, plus the zero point,
    saturated (float values of the integers)."""
    lo, hi = RANGES[kind]
    return torch.clamp(torch.round(x.float() / scale) + zero_point, lo, hi)


def dynamic_parameters(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DynamicQuantizeLinear's uint8 scale and zero point of the whole tensor ``x`` (float32 scalars)."""
    x = x.float()
    lo = torch.clamp(x.min(), max=0.0)
    hi = torch.clamp(x.max(), min=0.0)
    scale = torch.where(hi == lo, torch.ones_like(hi), (hi - lo) / 255.0)
    zero_point = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    return scale, zero_point


def fake_quantize(x: torch.Tensor, q: QParams) -> torch.Tensor:
    """x through a static QuantizeLinear / DequantizeLinear pair."""
    scale = torch.tensor(q.scale, dtype=torch.float32, device=x.device)
    zp = torch.tensor(q.zero_point, dtype=torch.float32, device=x.device)
    return ((quantize(x, scale, zp, q.type) - zp) * scale).to(x.dtype)


def int8_blocks(x: torch.Tensor, block: int, inverse: str = "127/amax") -> torch.Tensor:
    """x's rows as MLAS's CompInt8 kernels see them: int8 blocks of ``block`` along the last dimension, each
    ``q * (amax / 127)``, q rounded half to even from x times the inverse scale, which the AVX-512 kernels compute as
    ``127 / amax`` and the AVX2 ones as ``1 / (amax / 127)`` (``inverse``: one or the other; they differ in the last
    bit, enough to move a value across a rounding boundary)."""
    x = x.float()
    k = x.shape[-1]
    pad = (-k) % block
    b = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], -1, block)
    amax = b.abs().amax(-1, keepdim=True)
    scale = amax / 127.0
    if inverse == BLOCK_INVERSES[1]:
        inverse_scale = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    else:
        inverse_scale = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(b * inverse_scale)
    return (q * scale).reshape(*x.shape[:-1], -1)[..., :k]


def saturated_pairs(a: torch.Tensor, w: torch.Tensor, budget: int = 2**25) -> torch.Tensor:
    """sum_k a[.., k] w[n, k] as MLAS's u8 x s8 kernels without VNNI sum it (vpmaddubsw, then vpmaddwd by ones):
    each pair of adjacent products (k = 2m, 2m + 1) added in int16 with saturation, the pairs summed in int32.
    ``a`` [.., K] holds uint8 values, ``w`` [N, K] int8 ones; float64 out. The exact sum is a float64 matmul; only a
    pair of weights of one sign with 255 (|w0| + |w1|) > 32767 can saturate (the activations are not negative), a
    few in a hundred of Gaussian weights, and those pairs alone are summed again, ``budget`` elements at a time."""
    rows = a.reshape(-1, a.shape[-1]).double()
    w = w.double()
    out = rows @ w.T  # exact: every partial sum is an integer far below 2^53
    if rows.shape[-1] % 2:
        rows, w = torch.nn.functional.pad(rows, (0, 1)), torch.nn.functional.pad(w, (0, 1))
    w0, w1 = w[:, 0::2], w[:, 1::2]
    n, m = ((w0 * w1 > 0) & ((w0.abs() + w1.abs()) * 255 > 32767)).nonzero(as_tuple=True)
    step = max(1, budget // max(1, rows.shape[0]))
    for i in range(0, len(n), step):
        nn, mm = n[i:i + step], m[i:i + step]
        pairs = rows[:, 2 * mm] * w0[nn, mm] + rows[:, 2 * mm + 1] * w1[nn, mm]
        out.index_add_(1, nn, pairs.clamp(-32768, 32767) - pairs)
    return out.reshape(*a.shape[:-1], out.shape[-1])


def integer_matmul(x: torch.Tensor, weight: torch.Tensor, spec: Projection) -> torch.Tensor:
    """A quantized projection without its bias, as MatMulInteger / MatMulIntegerToFloat computes it: ``x``'s
    quantization (dynamic, or the static one of ``spec.input``) times the weight's integers (recovered from the
    dequantized ``weight`` [out, in] and its scales), summed exactly, times float32(a_scale * b_scale); or, as
    QLinearMatMul does (``spec.requantize``), requantized at the output's scale and dequantized."""
    x = x.float()
    if isinstance(spec.input, Dynamic):
        scale, zp = dynamic_parameters(x)
        kind = "uint8"
    else:
        scale = torch.tensor(spec.input.scale, dtype=torch.float32, device=x.device)
        zp = torch.tensor(spec.input.zero_point, dtype=torch.float32, device=x.device)
        kind = spec.input.type
    qx = quantize(x, scale, zp, kind).double()
    w_scale = torch.tensor(spec.weight_scale, dtype=torch.float32, device=x.device).reshape(-1, 1)
    qw = torch.round(weight.double() / w_scale.double())  # the dequantized weight is (q - zp) * scale in float32
    if spec.pairs == PAIRS:  # the zero point's share is taken off exactly, from the weights' sums
        acc = (saturated_pairs(qx, qw) - zp.double() * qw.sum(1)).float()
    else:
        acc = ((qx - zp.double()) @ qw.T).float()
    if spec.requantize:  # QLinearMatMul: the sum back to integers at the output's scale, then dequantized
        out = spec.requantize
        y_scale = torch.tensor(out.scale, dtype=torch.float32, device=x.device)
        y_zp = torch.tensor(out.zero_point, dtype=torch.float32, device=x.device)
        lo, hi = RANGES[out.type]
        q = torch.clamp(torch.round(acc * (scale * w_scale.reshape(-1) / y_scale)) + y_zp, lo, hi)
        return (q - y_zp) * y_scale
    return acc * (scale * w_scale.reshape(-1))


@dataclass
class OrtArithmetic:
    """What onnxruntime's CPU computes differently from float32 for one quantized graph: each projection's kernel
    and roundings (by the transformers module path), and the static Q/DQ pairs that sit on capture points (the
    graph outputs the quantizer rounded)."""

    matmuls: dict[str, Projection] = field(default_factory=dict)
    points: dict[str, Rounding] = field(default_factory=dict)
    engine: str = ENGINE

    @property
    def rounds(self) -> bool:
        return bool(self.points) or any(s.input or s.output for s in self.matmuls.values())

    def to_json(self) -> dict:
        ops: dict[str, int] = {}
        for spec in self.matmuls.values():
            name = spec.op + (f" x {spec.activations}" if spec.activations else "")
            ops[name] = ops.get(name, 0) + 1
        return {"engine": self.engine, "matmuls": ops, "gelu": "computed",
                "points rounded": sorted(self.points)}

    def save(self, out: Path) -> None:
        (Path(out) / FILE).write_text(json.dumps({
            "engine": self.engine, "matmuls": {k: s.model_dump(exclude_none=True) for k, s in self.matmuls.items()},
            "points": {k: p.model_dump() for k, p in self.points.items()}}))

    @staticmethod
    def load(path: Path) -> OrtArithmetic | None:
        """The onnxruntime arithmetic saved beside a same-weights reference, or None where there is none (or
        another engine's)."""
        found = Path(path) / FILE
        data = json.loads(found.read_text()) if found.is_file() else {}
        return OrtArithmetic.from_json(data) if str(data.get("engine", "")).startswith("onnxruntime") else None

    @staticmethod
    def from_json(data: dict) -> OrtArithmetic:
        return OrtArithmetic({k: Projection.model_validate(s) for k, s in data["matmuls"].items()},
                             {k: Rounding.model_validate(p) for k, p in (data.get("points") or {}).items()},
                             data["engine"])

    @contextmanager
    def emulate(self, model: torch.nn.Module) -> Iterator[None]:
        """``model``'s forwards, while inside, compute as onnxruntime's CPU kernels do (the module docstring).
        The hooks run before any other (capture hooks see the rounded values, as the graph's outputs are)."""
        handles = []
        try:
            for path, spec in self.matmuls.items():
                if spec.input or spec.output:
                    module = model.get_output_embeddings() if path == OUTPUT else model.get_submodule(path)
                    handles.append(module.register_forward_hook(_projection(spec), prepend=True))
            for point in self.points.values():
                handles.append(_round_point(model, point))
            yield
        finally:
            for h in handles:
                h.remove()


def _projection(spec: Projection):
    """A linear module's forward hook: its output recomputed as the kernel computes it."""
    def post(mod, args, out):
        x = args[0]
        if spec.integer:
            y = integer_matmul(x, mod.weight, spec)
        elif isinstance(spec.input, Blocks):
            xin = int8_blocks(x, spec.input.blocks, spec.input.inverse)
            y = torch.nn.functional.linear(xin, mod.weight.float())
        else:
            xin = fake_quantize(x.float(), spec.input) if spec.input else x.float()
            y = torch.nn.functional.linear(xin, mod.weight.float())
        if spec.output:
            y = fake_quantize(y, spec.output)
        if getattr(mod, "bias", None) is not None:
            y = y + mod.bias.float()
        return y.to(out.dtype)

    return post


def _round_point(model: torch.nn.Module, point: Rounding):
    """A hook rounding a capture point's value where the adapter's capture map reads it (a module's input or
    output), so that the point and everything that reads it see the graph's rounded value."""
    module = model.get_submodule(point.module)
    if point.io == "input":
        def pre(mod, args, kwargs):
            value = input_value(mod, point.arg, args, kwargs)
            return with_input(mod, point.arg, args, kwargs, fake_quantize(value, point))
        return module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)

    def post(mod, args, out):
        if isinstance(out, torch.Tensor):
            return fake_quantize(out, point)
        if isinstance(out, tuple) and point.field in (None, 0):
            return (fake_quantize(out[0], point), *out[1:])
        return None  # a point inside a richer output: left as computed (none of parity's quantized points)
    return module.register_forward_hook(post, prepend=True)
