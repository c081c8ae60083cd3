"""What a candidate's weights are: float, or quantized and how (a candidate kind's ``weights(path, engine)``).

A check reads this before anything runs: a quantized candidate is judged by default at its own weights and
arithmetic (parity.checker.plan), and the report's header says what the quantization is, in words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# storage types that are the checkpoint's values, merely rounded to a narrower float: not a quantization
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64", "float32", "float16", "bfloat16", "float64", "float"})


@dataclass(frozen=True)
class Weights:
    """How a candidate stores its weights.

    ``types``: tensors per storage type as the file names them ("Q4_K": 169, "F32": 121); ``parameters``: the
    weights each type holds, where the file says (bits per weight are counted over them); ``scheme``: the
    quantization's own name ("Q4_K_M", "int8, dynamic activations (MatMulInteger)", "affine 4-bit, groups of 64"),
    "" when not quantized; ``notes``: what sets the file apart from its scheme's name ("Q6_K output");
    ``bits_per_weight``: stored bits (scales included) per weight over every tensor, None where unknown;
    ``unemulated``: see below."""

    types: dict[str, int] = field(default_factory=dict)
    scheme: str = ""
    bits_per_weight: float | None = None
    parameters: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    unemulated: str = ""  # why a reference on these weights would not compute as the engine does (its int8
                          # activations, say): the default then judges against the float weights, calibrated

    @property
    def quantized(self) -> bool:
        """Integer or block-quantized tensors (float16 / bfloat16 storage is a rounding, not a quantization)."""
        return bool(self.scheme) or any(t not in FLOAT_TYPES for t in self.types)

    @property
    def rounded(self) -> bool:
        """Any tensor stored narrower than float32: the candidate's weights are not the checkpoint's exactly."""
        return any(t not in ("F32", "float32", "F64", "float64") for t in self.types)

    def words(self) -> str:
        """"quantized: Q4_K_M (Q6_K output), 4.9 bits per weight", or "not quantized (float16 weights)"."""
        bits = f", {self.bits_per_weight:.3g} bits per weight" if self.bits_per_weight else ""
        if not self.quantized:
            floats = sorted(self.types, key=lambda t: -self.types[t])
            return f"not quantized ({'/'.join(floats) if floats else 'float'} weights{bits})"
        notes = f" ({', '.join(self.notes)})" if self.notes else ""
        name = self.scheme or ", ".join(t for t in sorted(self.types, key=lambda t: -self.types[t])
                                        if t not in FLOAT_TYPES)
        return f"quantized: {name}{notes}{bits}"

    def to_json(self) -> dict:
        return {"quantized": self.quantized, "scheme": self.scheme or None, "bits_per_weight": self.bits_per_weight,
                "types": dict(self.types), "parameters": dict(self.parameters), "notes": list(self.notes),
                "words": self.words()}


def bits_per_weight(stored_bytes: int, parameters: int) -> float | None:
    """Stored bits per weight, rounded to what a reader compares (4.85), None without weights."""
    return round(8 * stored_bytes / parameters, 2) if parameters else None


class Tally:
    """What a kind's reader counts as it walks a header: tensors and weights per storage type, and the bytes they
    and what only serves them (scales, zero points) take."""

    def __init__(self):
        self.types: dict[str, int] = {}
        self.parameters: dict[str, int] = {}
        self.stored = 0

    def add(self, kind: str, elements: int, nbytes: int) -> None:
        self.types[kind] = self.types.get(kind, 0) + 1
        self.parameters[kind] = self.parameters.get(kind, 0) + elements
        self.stored += nbytes

    def weights(self, scheme: str = "", notes=()) -> Weights:
        return Weights(dict(self.types), scheme, bits_per_weight(self.stored, sum(self.parameters.values())),
                       dict(self.parameters), tuple(notes))


def commonest(types: dict[str, int]) -> str | None:
    """The quantized type most tensors are stored in (a mix's main type), None where all are floats."""
    found = sorted((t for t in types if t not in FLOAT_TYPES), key=lambda t: (-types[t], t))
    return found[0] if found else None
