"""llama.cpp's CPU arithmetic (ggml-cpu), emulated on a transformers model, so that a reference computes what a
correct GGUF port computes and the two can be compared at float32 noise.

A correct quantized GGUF differs from its own dequantized weights run in float32 because ggml does not multiply
float32 activations by the weights: ggml-cpu's ``ggml_compute_forward_mul_mat`` first converts each row of the
activations to the weight type's dot-product partner (``type_traits_cpu[type].vec_dot_type``), and the integer
kernels multiply those blocks. Read from ggml-cpu (ggml-cpu.c, arch/x86/quants.c, ggml-quants.c, repack.cpp):

- F16 and BF16 weights: the activations rounded to F16 (BF16).
- Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4: Q8_0 blocks of 32, ``d = amax / 127`` stored as f16, ``q = round(x * 127 /
  amax)`` computed in float32 and rounded to nearest even (``_mm256_round_ps``); the repacked 8x8 kernels
  (``ggml_quantize_mat_q8_0_4x8``) and llamafile's sgemm take the same blocks.
- Q4_1, Q5_1: Q8_1 blocks, as Q8_0 plus ``s = f16(d * sum(q))``, which the kernel multiplies by the weight
  block's minimum instead of the exact sum: that term is added here as a correction after the matmul.
- K-quants and the IQ types: Q8_K blocks of 256, ``iscale = -127 / max`` (the signed value of largest
  magnitude), ``q = min(127, round(x * iscale))``, ``d = 1 / iscale`` in float32 (``quantize_row_q8_K_ref``; the
  repacked ``ggml_quantize_mat_q8_K_4x8`` flips the sign only).
- GELU (tanh approximation) reads a table of f16: ``f16(gelu(f16(x)))`` for -10 < x < 10 (``GGML_GELU_FP16``).

The integer dot products themselves are exact; what is left against llama.cpp is float32 summation order, which
a reference cannot reproduce, and the rounding boundaries that order moves an activation across (measured in
docs/gguf.md). Attention runs on llama.cpp's float32 KV cache (parity.engines.gguf.kind asks for one), so its
matmuls round nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from parity.engines.arithmetic import FILE

# weight type -> the type its activations are rounded to before the dot product (ggml-cpu's vec_dot_type)
_Q8_0 = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4", "Q1_0", "Q2_0", "NVFP4")
_Q8_K = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ2_S", "IQ1_S", "IQ1_M",
         "IQ4_XS", "TQ1_0", "TQ2_0")
ACTIVATIONS = {"F32": None, "F16": "F16", "BF16": "BF16", "Q4_1": "Q8_1", "Q5_1": "Q8_1",
               **{t: "Q8_0" for t in _Q8_0}, **{t: "Q8_K" for t in _Q8_K}}
# bytes of one block of 32 weights, and where its f16 minimum sits in it (the types whose kernels use Q8_1's sum)
_MIN_BLOCKS = {"Q4_1": (20, 2), "Q5_1": (24, 2)}
MINS_FILE = "parity-arithmetic.safetensors"
OUTPUT = "@output"   # the model's output embeddings (a tied lm_head: llama.cpp multiplies by token_embd)


def _over(c: float, t: torch.Tensor) -> torch.Tensor:
    """``c / t`` correctly rounded, as C's float division: torch's ``c / t`` for a Python number ``c`` computes
    ``c * (1 / t)``, off by an ulp for about a quarter of values, which moves ggml's exact ties (a Q8_0 value
    of 63.5 in blocks of lattice values, such as embeddings read from a Q4_0 table) across the rounding."""
    return torch.div(torch.full_like(t, c), t)


def _q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of 32 as quantize_row_q8_0 makes them: (dequantized, q, the f16 scale, the float32 scale)."""
    b = x.reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inverse = torch.where(amax > 0, _over(127.0, amax), torch.zeros_like(amax))
    q = torch.round(b * inverse)  # round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
    d16 = d.half().float()
    return (d16 * q).reshape(x.shape), q, d16, d


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """Blocks of 256 as quantize_row_q8_K_ref makes them, dequantized."""
    b = x.reshape(-1, 256)
    amax, where = b.abs().max(-1, keepdim=True)
    signed = b.gather(-1, where)  # the first value of largest magnitude, with its sign
    iscale = torch.where(amax > 0, _over(-127.0, signed), torch.zeros_like(signed))
    q = torch.clamp(torch.round(b * iscale), max=127.0)
    d = torch.where(amax > 0, _over(1.0, iscale), torch.zeros_like(iscale))
    return (d * q).reshape(x.shape)


def round_activations(x: torch.Tensor, kind: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (float32, rows of a matmul's input) as the kernel of a ``kind`` activation type sees it, and for Q8_1
    the per-block excess of its f16 sum over the exact one ([..., blocks]), which the minimum of each weight block
    multiplies (None otherwise)."""
    if kind is None:
        return x, None
    if kind == "F16":
        return x.half().float(), None
    if kind == "BF16":
        return x.bfloat16().float(), None
    if kind == "Q8_K":
        return _q8_k(x), None
    rounded, q, d16, d = _q8_0(x)
    if kind == "Q8_0":
        return rounded, None
    s16 = (d * q.sum(-1, keepdim=True)).half().float()  # y.s = f16(d * sum(q)), with the unrounded d
    excess = (s16 - d16 * q.sum(-1, keepdim=True)).reshape(*x.shape[:-1], x.shape[-1] // 32)
    return rounded, excess


def gelu_table(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ggml's GELU of ``x`` given the exact (tanh) GELU ``y`` computes from: the f16 table's value, read at f16(x)
    (ggml_vec_gelu_f32 under GGML_GELU_FP16); outside (-10, 10) ggml computes 0 or x."""
    table = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table)).to(y.dtype)


def block_mins(data, kind: str) -> torch.Tensor | None:
    """The f16 minimum of each block of 32 weights ([rows, blocks], float32) of a Q4_1 or Q5_1 tensor from its raw
    bytes (gguf-py's ReaderTensor.data: [rows, bytes per row] of uint8); None for other types."""
    if kind not in _MIN_BLOCKS:
        return None
    size, at = _MIN_BLOCKS[kind]
    raw = torch.from_numpy(data.copy()).reshape(data.shape[0], -1, size)
    return raw[:, :, at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


@dataclass
class Arithmetic:
    """What llama.cpp's CPU computes differently from float32, for one model: each matmul's weight type (by the
    transformers module path of the projection), the weight blocks' minimums where the kernel reads Q8_1 sums,
    and whether the MLP's GELU reads ggml's f16 table."""

    matmuls: dict[str, str] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)
    gelu_table: bool = False
    engine: str = "llama.cpp (ggml-cpu)"

    @property
    def rounds(self) -> bool:
        """Whether anything is rounded at all (an all-F32 file computes in float32 throughout)."""
        return self.gelu_table or any(ACTIVATIONS.get(t) for t in self.matmuls.values())

    def to_json(self) -> dict:
        types: dict[str, int] = {}
        for kind in self.matmuls.values():
            act = ACTIVATIONS.get(kind) or "F32"
            types[f"{kind} x {act}"] = types.get(f"{kind} x {act}", 0) + 1
        return {"engine": self.engine, "matmuls": types, "gelu": "f16 table" if self.gelu_table else "computed"}

    def save(self, out: Path) -> None:
        (Path(out) / FILE).write_text(json.dumps({"engine": self.engine, "matmuls": self.matmuls,
                                                  "gelu_table": self.gelu_table}))
        if self.mins:
            save_file({k: v.contiguous() for k, v in self.mins.items()}, str(Path(out) / MINS_FILE))

    @staticmethod
    def load(path: Path) -> Arithmetic | None:
        """The arithmetic saved beside a same-weights reference, or None where there is none (or another
        engine's)."""
        found = Path(path) / FILE
        if not found.is_file():
            return None
        data = json.loads(found.read_text())
        if not str(data.get("engine", "")).startswith("llama.cpp"):
            return None
        mins = load_file(str(Path(path) / MINS_FILE)) if (Path(path) / MINS_FILE).is_file() else {}
        return Arithmetic(dict(data["matmuls"]), mins, bool(data["gelu_table"]), data["engine"])

    @contextmanager
    def emulate(self, model: torch.nn.Module) -> Iterator[None]:
        """``model``'s forwards, while inside, compute as llama.cpp's CPU does (see the module's docstring): each
        projection's input rounded as its weight type's kernel rounds it, the Q8_1 sum's rounding added to its
        output, GELU read from the f16 table."""
        handles = []
        try:
            for path, kind in self.matmuls.items():
                act = ACTIVATIONS.get(kind)
                if act is None:
                    continue
                module = model.get_output_embeddings() if path == OUTPUT else model.get_submodule(path)
                handles += _round_inputs(module, act, self.mins.get(path))
            if self.gelu_table:
                for module in model.modules():
                    if _is_tanh_gelu(module):
                        handles.append(module.register_forward_hook(
                            lambda mod, args, out: gelu_table(args[0].float(), out)))
            yield
        finally:
            for h in handles:
                h.remove()


def _is_tanh_gelu(module: torch.nn.Module) -> bool:
    """transformers' tanh-approximated GELU modules (ACT2FN's gelu_pytorch_tanh, gelu_new, gelu_fast, ...)."""
    name = type(module).__name__
    return type(module).__module__.startswith("transformers.activations") and "GELU" in name and (
        "Tanh" in name or "New" in name or "Fast" in name)


def _round_inputs(module: torch.nn.Module, act: str, mins: torch.Tensor | None) -> list:
    """A linear module's hooks: its input rounded to ``act`` blocks; with block minimums, the Q8_1 sums' excess
    times them added to its output."""
    excess: list[torch.Tensor | None] = [None]

    def pre(mod, args):
        x = args[0]
        rounded, excess[0] = round_activations(x.float(), act)
        return (rounded.to(x.dtype), *args[1:])

    handles = [module.register_forward_pre_hook(pre)]
    if mins is not None:
        def post(mod, args, out):
            extra = excess[0] @ mins.to(out.device).T
            excess[0] = None
            return out + extra.to(out.dtype)

        handles.append(module.register_forward_hook(post))
    return handles
