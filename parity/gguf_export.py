"""``parity convert --to gguf``: a Hugging Face checkpoint as a GGUF file llama.cpp runs.

The tensors are the neutral layout's (``1 + w`` norms folded, q/k rows laid out for the RoPE kernel of
llama.cpp's architecture: the adapter's ``[gguf]`` section), renamed to llama.cpp's names
(``blk.{i}.attn_q.weight``, ...), as ``convert_hf_to_gguf.py`` writes them. Static RoPE scaling (llama3) is
written as llama.cpp reads it: per-pair frequency divisors in ``rope_freqs.weight``. Matrices are stored as
F32, F16 or Q8_0; norms and other vectors stay F32, as llama.cpp requires.

The file carries no tokenizer (``tokenizer.ggml.model = "none"``): parity feeds token ids.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from . import atomic
from .checkpoint import open_checkpoint
from .errors import ParityError

# neutral name -> llama.cpp's (gguf-py's MODEL_TENSOR names), {i} the layer
NAMES = {
    "embed.tokens.weight": "token_embd.weight",
    "final_norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layers.{i}.attn_norm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.attn.q.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.attn.q.bias": "blk.{i}.attn_q.bias",
    "layers.{i}.attn.k.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.attn.k.bias": "blk.{i}.attn_k.bias",
    "layers.{i}.attn.v.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.attn.v.bias": "blk.{i}.attn_v.bias",
    "layers.{i}.attn.o.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.attn.o.bias": "blk.{i}.attn_output.bias",
    "layers.{i}.attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.mlp_norm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down.weight": "blk.{i}.ffn_down.weight",
}
TYPES = ("F32", "F16", "Q8_0")
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def gguf_name(name: str) -> str | None:
    m = _LAYER.match(name)
    if m is None:
        return NAMES.get(name)
    out = NAMES.get(f"layers.{{i}}.{m.group(2)}")
    return out and out.replace("{i}", m.group(1))


def _rope_freqs(rope: dict) -> torch.Tensor | None:
    """llama.cpp divides each unscaled frequency by rope_freqs[k]: the static scaling as divisors (None: none)."""
    from .executor.rope import LENGTH_DEPENDENT, inv_freq

    scaling = rope.get("scaling")
    if not scaling:
        return None
    if scaling.get("rope_type") in LENGTH_DEPENDENT:
        raise ParityError(f"RoPE scaling {scaling.get('rope_type')!r} depends on the length; --to gguf writes static "
                          f"scalings only (llama3, linear)")
    scaled, attention = inv_freq(rope)
    if attention != 1.0:
        raise ParityError(f"RoPE scaling {scaling.get('rope_type')!r} scales attention ({attention:g}); --to gguf "
                          f"does not write it yet")
    plain, _ = inv_freq({**rope, "scaling": None})
    return (plain / scaled).float()


def _metadata(writer, manifest: dict, arch: str) -> None:
    layers = manifest["layers"]
    att, mlp = layers[0]["attention"], layers[0]["mlp"]
    for i, layer in enumerate(layers):
        a = layer["attention"]
        if (a["heads"], a["kv_heads"], a["head_dim"]) != (att["heads"], att["kv_heads"], att["head_dim"]) \
                or layer["mlp"]["intermediate_size"] != mlp["intermediate_size"] or a["rope"] != att["rope"]:
            raise ParityError(f"layer {i} differs in shape or RoPE from layer 0; --to gguf writes uniform layers")
        if a["sliding_window"] is not None or a["softcap"] is not None or a["mla"] is not None or layer["mlp"]["moe"]:
            raise ParityError(f"layer {i} has a sliding window, softcap, MLA or MoE; --to gguf does not write "
                              f"them yet for architecture {arch!r}")
    norm = layers[0]["norms"]["attn_norm"]
    rope = att["rope"]
    if abs(att["scale"] - att["head_dim"] ** -0.5) > 1e-12 * att["scale"]:
        raise ParityError(f"attention scale {att['scale']:g} is not head_dim ** -0.5; llama.cpp's {arch} assumes it")
    writer.add_context_length(manifest["embedding"]["max_positions"])
    writer.add_embedding_length(manifest["hidden_size"])
    writer.add_block_count(manifest["num_layers"])
    writer.add_feed_forward_length(mlp["intermediate_size"])
    writer.add_head_count(att["heads"])
    writer.add_head_count_kv(att["kv_heads"])
    writer.add_key_length(att["head_dim"])
    writer.add_value_length(att["head_dim"])
    writer.add_layer_norm_rms_eps(norm["eps"])
    writer.add_vocab_size(manifest["vocab_size"])
    if rope is not None:
        writer.add_rope_dimension_count(rope["rotary_dim"])
        writer.add_rope_freq_base(rope["theta"])
    writer.add_tokenizer_model("none")


def export(path: Path, out: Path, *, qtype: str = "F32", force: bool = False, adapter_dirs=()) -> dict:
    """Write checkpoint ``path`` as the GGUF file ``out``; returns what was written."""
    import gguf
    import numpy as np

    from .neutral import build_manifest, neutral_tensors

    if qtype not in TYPES:
        raise ParityError(f"--gguf-type {qtype!r} is not one of {', '.join(TYPES)}")
    ckpt = open_checkpoint(Path(path), adapter_dirs)
    spec = ckpt.adapter.spec.gguf
    if spec is None:
        raise ParityError(f"{path}: parity does not export {ckpt.resolved.family} to GGUF (its adapter has no [gguf] "
                          f"section); families it does: llama, qwen2, qwen3")
    from .neutral import _check_for_conversion

    _check_for_conversion(ckpt)
    manifest = build_manifest(ckpt, torch.float32, spec.rope_style, ckpt.check().prefix, hashes=False)
    if manifest["head"] is None:
        raise ParityError(f"{path}: a model without an LM head cannot run in llama.cpp")
    matrix = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
              "Q8_0": gguf.GGMLQuantizationType.Q8_0}[qtype]
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    written: dict[str, str] = {}
    with atomic.output_file(Path(out), force=force, companions=()) as tmp:
        writer = gguf.GGUFWriter(tmp / Path(out).name, spec.arch, use_temp_file=True)
        writer.add_name(f"{ckpt.path.name} (parity convert --to gguf)")
        writer.add_file_type(file_type)
        _metadata(writer, manifest, spec.arch)
        factors = _rope_freqs(manifest["layers"][0]["attention"]["rope"] or {})
        if factors is not None:
            writer.add_tensor("rope_freqs.weight", factors.numpy())
            written["rope_freqs.weight"] = "F32"
        for name, x in neutral_tensors(ckpt, manifest):
            target = gguf_name(name)
            if target is None:
                raise ParityError(f"{path}: neutral tensor {name} has no llama.cpp name in parity/gguf_export.py")
            data = x.float().numpy()
            kind = matrix if data.ndim == 2 else gguf.GGMLQuantizationType.F32
            if kind == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
                kind = gguf.GGMLQuantizationType.F16  # Q8_0 needs rows of 32; llama.cpp's converter falls back too
            if kind == gguf.GGMLQuantizationType.F16:
                data = data.astype(np.float16)
            elif kind == gguf.GGMLQuantizationType.Q8_0:
                data = gguf.quants.quantize(data, kind)
            writer.add_tensor(target, data, raw_dtype=kind if kind == gguf.GGMLQuantizationType.Q8_0 else None)
            written[target] = kind.name
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"arch": spec.arch, "type": qtype, "tensors": written, "family": ckpt.resolved.family}
