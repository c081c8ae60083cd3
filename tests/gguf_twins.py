"""Broken twins of a real GGUF file: the same file rewritten by gguf-py with one porting mistake, its quantized
tensors copied as stored (a row permutation moves whole rows of blocks, so it needs no re-quantization)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# mistake -> what a converter got wrong
MISTAKES = {
    "norms-shifted": "every RMSNorm weight stored as 1 + w (a convention of Gemma's applied to a family without it)",
    "qk-permuted": "q/k rows (and biases) permuted into the interleaved RoPE order llama.cpp's llama expects",
    "qkv-bias-dropped": "the q/k/v biases written as zeros",
    "freq-base-wrong": "rope.freq_base written as 10,000 (the Llama 2 value) instead of the config's",
    "v-from-another-revision": "every attn_v weight quantized from another revision of the checkpoint (the "
                               "weights 5% apart): within a 4- or 5-bit type's band, but not the checkpoint's "
                               "quantized",
}


def _another_revision(t) -> np.ndarray:
    """The tensor's blocks re-quantized from its values 5% (rel_l2) away, seeded: what a file made from a
    neighbouring revision of the checkpoint holds."""
    import gguf

    kind = gguf.GGMLQuantizationType(t.tensor_type)
    values = gguf.quants.dequantize(t.data, kind).astype(np.float32)
    noise = np.random.default_rng(0).standard_normal(values.shape).astype(np.float32)
    values = values + 0.05 * noise * np.linalg.norm(values) / np.linalg.norm(noise)
    return gguf.quants.quantize(values, kind).reshape(t.data.shape)


def _interleave_rows(x: np.ndarray, head_dim: int) -> np.ndarray:
    """Rows of each head from the half-split order to the interleaved one (what llama.cpp's converter does for
    llama's q/k, wrongly applied here)."""
    from parity.rope import interleave_permutation

    perm = interleave_permutation(head_dim, head_dim).numpy()
    heads = x.shape[0] // head_dim
    return x.reshape(heads, head_dim, *x.shape[1:])[:, perm].reshape(x.shape)


def write_twin(source: Path, out: Path, mistake: str) -> Path:
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    head_dim = None
    writer = gguf.GGUFWriter(str(out), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if mistake == "freq-base-wrong" and field.name == f"{arch}.rope.freq_base":
            value = 10000.0
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    n_embd = int(reader.fields[f"{arch}.embedding_length"].contents())
    n_head = int(reader.fields[f"{arch}.attention.head_count"].contents())
    head_dim = n_embd // n_head
    data = {}
    for t in reader.tensors:
        x = np.array(t.data)
        if mistake == "norms-shifted" and t.name.endswith("_norm.weight"):
            x = x + 1.0
        if mistake == "qkv-bias-dropped" and t.name.split(".")[-2] in ("attn_q", "attn_k", "attn_v") \
                and t.name.endswith(".bias"):
            x = np.zeros_like(x)
        if mistake == "qk-permuted" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            x = _interleave_rows(x, head_dim)
        if mistake == "v-from-another-revision" and t.name.endswith("attn_v.weight"):
            x = _another_revision(t)
        data[t.name] = x
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(data[t.name], tensor_endianess=reader.endianess)
    writer.close()
    return Path(out)
