"""A GGUF file's own weights read back as a Hugging Face reference (``check --same-weights``), with the arithmetic
llama.cpp computes them with (parity.engines.gguf.arithmetic), so that the reference computes what a correct port of
the file computes, and only porting mistakes are left between them.

Each tensor is judged on its way back, by its type:

- stored unquantized (F32, F16, BF16: every norm and bias llama.cpp writes): it must equal the checkpoint's
  tensor after the documented layout transform (q/k rows in llama.cpp's RoPE order, ``1 + w`` norms), rounded to
  that type. Anything else is a porting mistake;
- quantized, of a type gguf-py can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in a file made without an importance
  matrix: llama.cpp's quantizer is deterministic, so its blocks must be the checkpoint's tensor quantized again
  (gguf-py ports llama.cpp's reference quantizers), from float32 or from the F16/BF16 a converter writes first.
  Every block of the real Qwen2.5-Coder file's Q8_0 and Q5_0 tensors is reproduced bit for bit;
- other quantized types (the K-quants, IQ types, or any type quantized with an importance matrix): within the
  type's band of the checkpoint's tensor (BANDS: about three times the rel_l2 each type's quantizer leaves on
  Gaussian weights, and far below the ~1.4 of q/k rows in the other RoPE order).

A tensor that fails is reported, and the reference keeps the checkpoint's own there, so that the check judges it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parity.checkpoint import stored_tensor_map
from parity.compare import metrics
from parity.engines.gguf.arithmetic import ACTIVATIONS, OUTPUT, Arithmetic, block_mins
from parity.engines.gguf.export import expert_names, neutral_name
from parity.engines.gguf.file import open_gguf
from parity.engines.same_weights import EXACT, neutral_map, write_reference
from parity.errors import ParityError
from parity.neutral.converter import build_manifest, restyle_rope, restyles
from parity.neutral.model import Layer
from parity.storage.lazy import Dequantizer

# rel_l2 of a quantized tensor against the checkpoint's beyond which it is not a quantization of it; measured on
# Gaussian 64x256 weights with gguf-py's quantizers: Q8_0 5.4e-3, Q5_0 4.3e-2, Q5_1 3.8e-2, Q4_0 8.6e-2, Q4_1
# 7.9e-2 (the K-quants of a bit count sit between those, Q6_K near 1e-2, Q2_K near 0.3)
BANDS = {"Q8_0": 0.02, "Q8_1": 0.02, "Q6_K": 0.05, "Q5_0": 0.15, "Q5_1": 0.15, "Q5_K": 0.15, "Q4_0": 0.3,
         "Q4_1": 0.3, "Q4_K": 0.3, "IQ4_NL": 0.3, "IQ4_XS": 0.3, "MXFP4": 0.3}
OTHER_BAND = 0.6     # Q3_K, Q2_K and the IQ2/IQ3/IQ1 types: coarse, still below a permutation's ~1.4
REQUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf-py's ports of llama.cpp's reference quantizers
REQUANTIZED_ROWS = 1 << 20  # values re-quantized per tensor: evenly spaced rows (blocks never cross a row)
UNQUANTIZED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def band(kind: str) -> float:
    return EXACT if kind in UNQUANTIZED else BANDS.get(kind, OTHER_BAND)


def read_back(ckpt, path: Path, out: Path) -> dict:
    """Write into ``out`` the reference checkpoint that holds the GGUF file's own weights, dequantized to float32
    and laid out back as the checkpoint stores them, beside the reference's config and the arithmetic llama.cpp
    computes them with (parity.engines.gguf.arithmetic.Arithmetic, saved there). Returns what the file held:
    {"types": {GGML type: count}, "tensors": n, "not_a_quantization": {checkpoint tensor: rel_l2}, "bands": {type:
    rel_l2}, "rope_order_swapped": [the checkpoint tensors among them whose rows are the checkpoint's in the other
    RoPE order: a converter that permuted q/k for the wrong rotation]}."""
    import gguf  # optional: gguf

    spec = ckpt.adapter.spec.gguf
    reader = open_gguf(Path(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if spec is None or arch != spec.arch:
        raise ParityError(f"--same-weights: {path} is a llama.cpp {arch!r} model; parity reads back only the "
                          f"architecture of the reference's family ({ckpt.resolved.family}: "
                          f"{spec.arch if spec else 'none'})")
    r = ckpt.resolved
    check = ckpt.check()
    manifest = build_manifest(ckpt, torch.float32, spec.rope_style, check.prefix, hashes=False)
    by_neutral = neutral_map(stored_tensor_map(r, check), "GGUF")
    source_style = r["positions.rope_style"]
    out_tensors, types, wrong, requantized, blocks, unemulated, reordered = {}, {}, {}, {}, {}, [], []
    imatrix = any(key.startswith("quantize.imatrix") for key in reader.fields)  # its blocks depend on the data
    arithmetic = Arithmetic(gelu_table=r["mlp.activation"] == "gelu_tanh")
    originals = Dequantizer.of(ckpt)
    names = {tensor.name for tensor in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
        types[kind] = types.get(kind, 0) + 1
        values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.tensor_type))
        stored = torch.from_numpy(values.astype("float32")).reshape(tuple(reversed(tensor.shape.tolist())))
        # a layer's experts, stacked [n_expert, rows, columns]: each judged and read back as its own tensor
        experts = expert_names(tensor.name, stored.shape[0]) if stored.dim() == 3 else None
        for k, name in enumerate(experts or [neutral_name(tensor.name)]):
            if name is None or name not in by_neutral:
                raise ParityError(f"--same-weights: {path} holds {tensor.name}, which the {r.family} checkpoint has "
                                  f"no place for")
            hf_name, t = by_neutral[name]
            layer = manifest.layer_of(name)

            def to_checkpoint(x: torch.Tensor, name: str = name, layer: Layer | None = layer) -> torch.Tensor:
                """From the file's layout back to the checkpoint's."""
                return x if layer is None else restyle_rope(name, x, layer, spec.rope_style, source_style)

            one = stored[k] if experts else stored
            original = originals.read(hf_name, torch.float32)
            # judged where the file's values are: the checkpoint's tensor written as the file should hold it
            expected = original + 1.0 if t.norm_offset else original  # llama.cpp's file holds 1 + w
            if layer is not None:
                expected = restyle_rope(name, expected, layer, source_style, spec.rope_style)
            error, differing = judged(one, expected, kind, imatrix)
            if differing == 0.0 and kind in REQUANTIZABLE and not imatrix:
                requantized[kind] = requantized.get(kind, 0) + 1
            if differing:  # a quantization, but not of the checkpoint's tensor: some other input was quantized
                blocks[hf_name] = differing
            if differing or not error <= band(kind):
                wrong[hf_name] = error
                x = original
                if layer is not None and _other_order(one, original, kind, imatrix, name, layer, source_style,
                                                      spec.rope_style):
                    reordered.append(hf_name)
            else:
                x = to_checkpoint(one - 1.0 if t.norm_offset else one)
            out_tensors[hf_name] = x.contiguous()
        if experts and ACTIVATIONS.get(kind):
            # transformers runs a layer's experts as one fused module, not as the checkpoint's per-expert
            # projections: their inputs go unrounded, and that rounding is left in the comparison
            unemulated.append(tensor.name)
        elif stored.dim() == 2 and tensor.name != "token_embd.weight":  # a matmul's weight (the embedding: a lookup)
            module = hf_name.removesuffix(".weight")
            arithmetic.matmuls[module] = kind
            mins = block_mins(tensor.data, kind)
            if mins is not None:
                arithmetic.mins[module] = to_checkpoint(mins)
    if "output.weight" not in names and "token_embd.weight" in names:
        _tied_output(reader, arithmetic)
    write_reference(ckpt, Path(out), out_tensors, arithmetic, untie="output.weight" in names)
    return {"from": str(path), "types": types, "tensors": len(out_tensors), "not_a_quantization": wrong,
            "requantized": requantized, "blocks_not_requantized": blocks, "importance_matrix": imatrix,
            "matmuls_not_emulated": unemulated, "rope_order_swapped": reordered,
            "bands": {kind: band(kind) for kind in sorted(types) if kind not in REQUANTIZABLE or imatrix}}


def _other_order(stored: torch.Tensor, original: torch.Tensor, kind: str, imatrix: bool, name: str, layer: Layer,
                 source: str, target: str) -> bool:
    """Whether a tensor that is not a quantization of the checkpoint's is one of its rows in the other RoPE
    order than llama.cpp's architecture rotates (q/k permuted for interleaved pairs where it rotates halves, or
    the reverse): the mistake is then named, not only the tensor."""
    other = "half" if target == "interleaved" else "interleaved"
    if not (restyles(name, layer, source, target) or restyles(name, layer, source, other)):
        return False  # not a tensor whose rows follow the rotation
    error, differing = judged(stored, restyle_rope(name, original, layer, source, other), kind, imatrix)
    return not differing and error <= band(kind)


def _tied_output(reader, arithmetic: Arithmetic) -> None:
    """A tied head: llama.cpp multiplies the final norm's output by token_embd, whose type rounds that input too."""
    import gguf  # optional: gguf

    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    kind = gguf.GGMLQuantizationType(embd.tensor_type).name
    arithmetic.matmuls[OUTPUT] = kind
    mins = block_mins(embd.data, kind)
    if mins is not None:
        arithmetic.mins[OUTPUT] = mins


def judged(stored: torch.Tensor, expected: torch.Tensor, kind: str, imatrix: bool) -> tuple[float, float]:
    """A tensor read back from the file against the checkpoint's (laid out as the file holds it): its rel_l2, and
    the fraction of its blocks that are not the checkpoint's quantized again (0 where that cannot be told)."""
    if kind in UNQUANTIZED:
        expected = expected.to(UNQUANTIZED[kind]).float()
    error = metrics(stored, expected)["rel_l2"] if stored.shape == expected.shape else float("inf")
    if error <= band(kind) and kind in REQUANTIZABLE and not imatrix:
        return error, requantized_blocks(stored, expected, kind)
    return error, 0.0


def requantized_blocks(stored: torch.Tensor, expected: torch.Tensor, kind: str) -> float:
    """The fraction of ``stored``'s blocks that differ from the checkpoint's tensor (``expected``, laid out as the
    file holds it) quantized again by gguf-py, from float32 or from float16 or bfloat16 (what a converter writes
    before llama.cpp quantizes it), whichever reproduces more: 0 for a file llama.cpp quantized from this
    checkpoint. Evenly spaced rows, up to REQUANTIZED_ROWS values (the embedding takes 30 s whole)."""
    import gguf  # optional: gguf

    qt = gguf.GGMLQuantizationType[kind]
    rows = stored.reshape(-1, stored.shape[-1])
    step = max(1, rows.numel() // REQUANTIZED_ROWS)
    want, source = rows[::step], expected.reshape(rows.shape)[::step]
    best = 1.0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = source.to(dtype).float().numpy()
        again = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x, qt), qt).astype("float32"))
        best = min(best, (again.reshape(want.shape) != want).reshape(-1, 32).any(1).float().mean().item())
        if best == 0.0:
            break
    return best
