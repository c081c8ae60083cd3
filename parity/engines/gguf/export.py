"""``parity convert --to gguf``: a Hugging Face checkpoint as a GGUF file llama.cpp runs.

The tensors are the neutral layout's (``1 + w`` norms folded, q/k rows laid out for the RoPE kernel of
llama.cpp's architecture: the adapter's ``[gguf]`` section), renamed to llama.cpp's names
(``blk.{i}.attn_q.weight``, ...), as ``convert_hf_to_gguf.py`` writes them. Static RoPE scaling (llama3) is
written as llama.cpp reads it: per-pair frequency divisors in ``rope_freqs.weight``. Matrices are stored as
F32, F16 or Q8_0 (gguf-py), or in a type llama.cpp's own quantizer makes (Q4_0 ... Q6_K, the K-quant mixes:
parity/engines/gguf/quantize.py); norms and other vectors stay F32, as llama.cpp requires. The result states the type
each tensor got, read back from the written file's header.

The checkpoint's byte-level BPE vocabulary is written as llama.cpp's "gpt2" tokenizer with its default
pre-tokenizer (``tokenizer.ggml.model = "none"`` without one): parity feeds the reference's token ids either way,
and the check reports where llama.cpp's own tokenizer would have split the prompt otherwise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from parity.adapter import load_all
from parity.checkpoint import open_checkpoint
from parity.checkpoint.inputs import leading_bos
from parity.diagnosis import bugs
from parity.engines.gguf.file import header_types
from parity.engines.gguf.quantize import LLAMA_TYPES, ftype, quantize, summary
from parity.errors import ParityError
from parity.neutral.converter import build_manifest, check_convertible, neutral_tensors, restyle_rope, source_dtype
from parity.neutral.model import BLOCK_NORMS, Layer, Manifest, Moe, Norm, Rope
from parity.rope import LENGTH_DEPENDENT, inv_freq
from parity.storage import atomic
from parity.storage.jsonfile import read_json

# neutral name -> llama.cpp's (gguf-py's MODEL_TENSOR names), {i} the layer
NAMES = {
    "embed.tokens.weight": "token_embd.weight",
    "final_norm.weight": "output_norm.weight",
    "final_norm.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
    "head.bias": "output.bias",
    "layers.{i}.attn_norm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.attn_norm.bias": "blk.{i}.attn_norm.bias",
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
    "layers.{i}.mlp_norm.bias": "blk.{i}.ffn_norm.bias",
    "layers.{i}.attn_post_norm.weight": "blk.{i}.post_attention_norm.weight",
    "layers.{i}.mlp_post_norm.weight": "blk.{i}.post_ffw_norm.weight",
    "layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.up.bias": "blk.{i}.ffn_up.bias",
    "layers.{i}.mlp.down.weight": "blk.{i}.ffn_down.weight",
    "layers.{i}.mlp.down.bias": "blk.{i}.ffn_down.bias",
    "layers.{i}.moe.router.weight": "blk.{i}.ffn_gate_inp.weight",
    "layers.{i}.moe.shared.gate.weight": "blk.{i}.ffn_gate_shexp.weight",
    "layers.{i}.moe.shared.up.weight": "blk.{i}.ffn_up_shexp.weight",
    "layers.{i}.moe.shared.down.weight": "blk.{i}.ffn_down_shexp.weight",
    "layers.{i}.moe.shared_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
}
# a layer's experts, one neutral tensor each, are stacked into one [n_expert, rows, columns] tensor ({e}: the expert)
EXPERTS = {
    "layers.{i}.moe.experts.{e}.gate.weight": "blk.{i}.ffn_gate_exps.weight",
    "layers.{i}.moe.experts.{e}.up.weight": "blk.{i}.ffn_up_exps.weight",
    "layers.{i}.moe.experts.{e}.down.weight": "blk.{i}.ffn_down_exps.weight",
}
# matrices llama.cpp's converter and quantizer keep F32 whatever the file type: the routers (their logits pick experts)
KEPT_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
# the layers each [gguf] block builds
BLOCKS = {"sequential": ("sequence",), "parallel": ("parallel on one norm",),
          "parallel_residual_key": ("sequence", "parallel on two norms"),
          "parallel_by_norm": ("sequence", "parallel on one norm")}
GELUS = ("gelu_exact", "gelu_tanh")  # llama.cpp's GELU stands for both (its CPU kernel: the tanh form, f16 table)
TYPES = ("F32", "F16", "Q8_0")  # written by gguf-py; LLAMA_TYPES by llama.cpp from an F32 (or F16) file
QUANTIZE_ROWS = 1024  # rows quantized to Q8_0 at a time, from float32
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.(.*)$")


def gguf_name(name: str) -> str | None:
    m = _LAYER.match(name)
    if m is None:
        return NAMES.get(name)
    out = NAMES.get(f"layers.{{i}}.{m.group(2)}")
    return out and out.replace("{i}", m.group(1))


def expert_slot(name: str) -> tuple[str, int] | None:
    """(the stacked llama.cpp tensor, the expert's index in it) of one expert's neutral tensor; None: not one."""
    m = _EXPERT.match(name)
    out = m and EXPERTS.get(f"layers.{{i}}.moe.experts.{{e}}.{m.group(3)}")
    return (out.replace("{i}", m.group(1)), int(m.group(2))) if out else None


def expert_names(name: str, count: int) -> list[str] | None:
    """The neutral names of the ``count`` experts a stacked llama.cpp tensor holds, in order; None: not one."""
    m = re.match(r"^blk\.(\d+)\.(.*)$", name)
    for neutral, gguf in EXPERTS.items():
        if m is not None and gguf == f"blk.{{i}}.{m.group(2)}":
            return [neutral.replace("{i}", m.group(1)).replace("{e}", str(e)) for e in range(count)]
    return None


def neutral_name(name: str) -> str | None:
    """The neutral name of a llama.cpp tensor name (None: not one parity writes)."""
    m = re.match(r"^blk\.(\d+)\.(.*)$", name)
    for neutral, gguf in NAMES.items():
        if m is None and gguf == name:
            return neutral
        if m is not None and gguf == f"blk.{{i}}.{m.group(2)}":
            return neutral.replace("{i}", m.group(1))
    return None


def _rope_tensors(writer, rope: Rope | None, spec) -> dict[str, torch.Tensor]:
    """RoPE scaling as llama.cpp reads it: a static one (llama3, linear) as per-pair frequency divisors in
    rope_freqs; LongRoPE, where the architecture reads it, as its two divisor sets and attention factor."""
    scaling = rope.scaling if rope is not None else None
    if not scaling:
        return {}
    kind = scaling.get("rope_type")
    if kind == "longrope" and spec.longrope:
        _, attention = inv_freq(rope, seq_len=None)
        writer.add_rope_scaling_attn_factors(attention)
        writer.add_rope_scaling_orig_ctx_len(scaling.get("original_max_position_embeddings", rope.max_positions))
        return {f"rope_factors_{which}.weight": torch.tensor(scaling[f"{which}_factor"], dtype=torch.float32)
                for which in ("long", "short")}
    if kind in LENGTH_DEPENDENT:
        raise ParityError(f"RoPE scaling {kind!r} depends on the length; llama.cpp's {spec.arch} reads static "
                          f"scalings only (llama3, linear)" + (", and LongRoPE where its architecture does"
                                                               if kind == "longrope" else ""))
    scaled, attention = inv_freq(rope)
    if attention != 1.0:
        raise ParityError(f"RoPE scaling {kind!r} scales attention ({attention:g}); --to gguf does not write it yet")
    plain, _ = inv_freq(rope.model_copy(update={"scaling": None}))
    return {"rope_freqs.weight": (plain / scaled).float()}


def vocabulary(directory: Path, size: int) -> tuple[list[str], list[str]] | None:
    """The checkpoint's byte-level BPE vocabulary as llama.cpp's "gpt2" tokenizer reads it: (tokens by id, padded
    to the model's vocabulary, and merges); None without a tokenizer.json of that kind."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = read_json(path, "")
    except ParityError:  # an unreadable tokenizer.json is no vocabulary, as a missing one
        return None
    model = (data.get("model") if isinstance(data, dict) else None) or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    tokens = [f"[PAD{i}]" for i in range(size)]
    for token, i in {**model["vocab"], **{t["content"]: t["id"] for t in data.get("added_tokens") or []}}.items():
        if isinstance(i, int) and 0 <= i < size:
            tokens[i] = token
    # llama.cpp refuses a BPE vocabulary without merges; a byte-level one (the tiny checkpoints') gets one that can
    # never apply: its halves are two-symbol strings that only a merge could form
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []] or ["\u0120\u0120 \u0120\u0120"]
    return tokens, merges


def _block_norms(layer: Layer) -> list[Norm]:
    """The norms a layer's block has (BlockNorms' slots that are set)."""
    return [n for slot in BLOCK_NORMS if (n := getattr(layer.norms, slot)) is not None]


def _one(values: list, what: str, arch: str):
    """The single value a GGUF key holds for every layer it applies to."""
    distinct = {repr(v): v for v in values}
    if len(distinct) > 1:
        raise ParityError(f"{what} differs between layers ({', '.join(distinct)}); llama.cpp's {arch} holds one")
    return next(iter(distinct.values()), None)


def _multipliers(writer, manifest: Manifest, spec) -> None:
    """Granite's multipliers and a logit scale (Granite divides by it, Command-R multiplies) where the architecture
    reads them; elsewhere a model with one is refused (llama.cpp would run it without)."""
    arch, layers = spec.arch, manifest.layers
    residual = _one([layer.residual_scale for layer in layers], "the residual multiplier", arch)
    logits = manifest.head.scale if manifest.head is not None else 1.0
    if logits != 1.0 and not spec.logit_scale:
        raise ParityError(f"llama.cpp's {arch} has no logit scale; this model multiplies its logits by {logits:g}")
    if spec.logit_scale:
        writer.add_logit_scale(logits if spec.logit_scale == "multiply" else 1.0 / logits)
    if not spec.multipliers:
        if residual != 1.0:
            raise ParityError(f"llama.cpp's {arch} has no residual multiplier; this model has {residual:g}")
        return
    writer.add_embedding_scale(manifest.embedding.scale)
    writer.add_residual_scale(residual)
    writer.add_attention_scale(_one([layer.attention.scale for layer in layers], "the attention scale", arch))


def _nope(manifest: Manifest, spec) -> None:
    """llama.cpp fixes which layers go without RoPE (every ``nope_every``-th, or every global one): the model's
    must be those."""
    atts = [att for _, att in manifest.attentions()]
    ropes = [a.rope is not None for a in atts]
    every = spec.nope_every
    if spec.nope_global:
        expected, rule = [a.sliding_window is not None for a in atts], "every layer without a sliding window"
    else:
        expected = [not every or (i + 1) % every != 0 for i in range(len(ropes))]
        rule = f"every {every}th layer" if every else "none"
    if any(ropes) and ropes != expected:
        nope = [i for i, r in enumerate(ropes) if not r]
        raise ParityError(f"layers {nope or 'none'} apply no RoPE; llama.cpp's {spec.arch} skips it on {rule}")


def _block(manifest: Manifest, spec) -> bool | None:
    """The layer's structure llama.cpp's architecture builds: its norm kind, its MLP (gated or a plain GELU), and a
    parallel or sequential block. Returns use_parallel_residual where the architecture reads it (else None)."""
    arch = spec.arch
    final = manifest.final_norm
    if final and final.kind != spec.norm:
        raise ParityError(f"the final norm is a {final.kind}; llama.cpp's {arch} computes {spec.norm} only")
    blocks = []
    for i, layer in enumerate(manifest.layers):
        kinds = {n.kind for n in _block_norms(layer)}
        if kinds - {spec.norm}:
            raise ParityError(f"layer {i} has {', '.join(sorted(kinds))} norms; llama.cpp's {arch} computes "
                              f"{spec.norm} only")
        mlp = layer.mlp
        if mlp.moe is None and spec.mlp == "gelu" and (mlp.gated or mlp.activation not in GELUS):
            raise ParityError(f"layer {i}: the MLP is {'gated' if mlp.gated else 'plain'} {mlp.activation}; "
                              f"llama.cpp's {arch} computes a plain GELU MLP (no gate) only")
        if mlp.moe is None and spec.mlp == "gated" and not mlp.gated:
            raise ParityError(f"layer {i}: the MLP has no gate; llama.cpp's {arch} computes a gated MLP only")
        block = ("sequence" if not mlp.parallel else
                 "parallel on one norm" if mlp.shared_norm else "parallel on two norms")
        blocks.append(block)
        if block not in BLOCKS[spec.block]:
            raise ParityError(f"layer {i}: attention and MLP run in {block}; llama.cpp's {arch} runs them in "
                              f"{' or '.join(BLOCKS[spec.block])}")
    if spec.block != "parallel_residual_key":
        return None
    return _one(blocks, "the parallel residual", arch) == "parallel on two norms"


def _moe(manifest: Manifest, spec) -> Moe | None:
    """The one MoE block every layer holds, as llama.cpp's architecture computes it (None: a dense model); any
    routing or expert convention it does not compute is refused, rather than written to run otherwise."""
    arch = spec.arch
    moes = [layer.mlp.moe for layer in manifest.layers]
    if not any(moes):
        return None
    if not spec.experts:
        raise ParityError(f"llama.cpp's {arch} has no MoE layers; this model has them")
    dense = [i for i, m in enumerate(moes) if m is None]
    if dense:
        raise ParityError(f"layers {dense} hold a dense MLP between MoE layers; llama.cpp's {arch} reads experts on "
                          f"every layer")
    moe = _one(moes, "the MoE block", arch)
    renormalised = spec.experts_renormalised
    if moe.routing != "softmax":
        raise ParityError(f"the router scores experts by {moe.routing}; llama.cpp's {arch} by softmax")
    if moe.renormalise != renormalised:
        raise ParityError(f"the model {'divides' if moe.renormalise else 'does not divide'} the top-k routing "
                          f"weights by their sum (norm_topk_prob {str(moe.renormalise).lower()}); llama.cpp's "
                          f"{arch} {'always does' if renormalised else 'never does'} (build_moe_ffn norm_w "
                          f"{str(renormalised).lower()}), so its experts would be weighted otherwise")
    unexpressed = [what for what, present in (
        ("expert groups", moe.groups not in (None, 1)), ("a routing scale", moe.scale not in (None, 1.0)),
        ("a router norm", moe.router_norm is not None),
        ("a router input scale", moe.router_input_scale not in (None, 1.0)),
        ("routing weights on the experts' input", moe.weights_input),
        ("expert norms", any(n is not None for n in (moe.expert_norm, moe.expert_post_norm, moe.dense_post_norm))),
        (f"{moe.activation} experts", moe.activation != "silu"),
        ("a clamped or offset SwiGLU", (moe.glu_limit, moe.glu_alpha, moe.glu_up_offset) != (None, 1.0, 0.0)),
        ("a shared expert", bool(moe.shared_experts) and not spec.shared_expert_gated),
        ("no sigmoid-gated shared expert", spec.shared_expert_gated and (moe.shared_experts, moe.shared_gate)
         != (1, True))) if present]
    if unexpressed:
        raise ParityError(f"the MoE block has {', '.join(unexpressed)}; llama.cpp's {arch} computes softmax top-k "
                          f"SwiGLU experts" + (" plus one sigmoid-gated shared expert" if spec.shared_expert_gated
                                               else "") + " only")
    return moe


def _metadata(writer, manifest: Manifest, spec) -> Rope | None:
    """Write the hyperparameters llama.cpp reads; returns the RoPE of the (global) layers, for rope_freqs."""
    arch = spec.arch
    layers = manifest.layers
    atts = [layer.attention for layer in layers]
    att = atts[0]
    _one([(a.heads, a.kv_heads, a.head_dim) for a in atts], "the heads or head_dim", arch)
    intermediate = _one([layer.mlp.intermediate_size for layer in layers], "the MLP width", arch)
    if any(a.mla is not None for a in atts):
        raise ParityError(f"MLA layers are not written to GGUF yet (architecture {arch!r})")
    parallel = _block(manifest, spec)
    moe = _moe(manifest, spec)
    if not spec.qk_norms and any(a.q_norm or a.k_norm for a in atts):
        raise ParityError(f"the model normalises q and k; llama.cpp's {arch} has no q/k norms")
    if spec.k_norm_hidden_width and att.k_norm and att.kv_heads * att.head_dim != manifest.hidden_size:
        raise ParityError(f"the k-norm is {att.kv_heads * att.head_dim} wide ({att.kv_heads} kv heads); "
                          f"llama.cpp's {arch} sizes it to the hidden width {manifest.hidden_size} (no GQA)")
    _multipliers(writer, manifest, spec)
    for i, a in enumerate(atts):
        if not spec.multipliers and abs(a.scale - a.head_dim ** -0.5) > 1e-9 * a.scale:
            raise ParityError(f"layer {i}: attention scale {a.scale:g} is not head_dim ** -0.5 = "
                              f"{a.head_dim ** -0.5:g}; llama.cpp's {arch} computes 1/sqrt(head_dim) (it does not "
                              f"read query_pre_attn_scalar), so this model cannot be written for it")
    windowed = [a.sliding_window is not None for a in atts]
    softcap = _one([a.softcap for a in atts], "the attention softcap", arch)
    final_softcap = manifest.head.softcap if manifest.head is not None else None
    if (any(windowed) and not spec.windows) or ((softcap or final_softcap) and not spec.softcaps):
        raise ParityError(f"llama.cpp's {arch} has no sliding window or softcap; this model has one")
    norms = [n for layer in layers for n in (*_block_norms(layer), layer.attention.q_norm, layer.attention.k_norm)
             if n] + [manifest.final_norm]
    eps = _one([n.eps for n in norms if n], "the norms' eps", arch)  # llama.cpp holds one for every norm
    writer.add_context_length(manifest.embedding.max_positions)
    writer.add_embedding_length(manifest.hidden_size)
    writer.add_block_count(manifest.num_layers)
    # without an expert width of its own, the architecture reads the experts' from feed_forward_length
    writer.add_feed_forward_length(intermediate if moe is None or spec.expert_width_key else moe.intermediate_size)
    if moe is not None:
        writer.add_expert_count(moe.experts)
        writer.add_expert_used_count(moe.top_k)
        if spec.expert_width_key:
            writer.add_expert_feed_forward_length(moe.intermediate_size)
        if spec.shared_expert_gated:
            writer.add_expert_shared_feed_forward_length(moe.shared_intermediate_size)
    writer.add_head_count(att.heads)
    writer.add_head_count_kv(att.kv_heads)
    writer.add_key_length(att.head_dim)
    writer.add_value_length(att.head_dim)
    if parallel is not None:
        writer.add_parallel_residual(parallel)
    if spec.norm == "layernorm":
        writer.add_layer_norm_eps(eps)
    else:
        writer.add_layer_norm_rms_eps(eps)
    writer.add_vocab_size(manifest.vocab_size)
    if any(windowed):
        writer.add_sliding_window(_one([a.sliding_window for a in atts if a.sliding_window is not None],
                                       "the sliding window", arch))
        writer.add_sliding_window_pattern(windowed)  # per layer: llama.cpp's default patterns are not assumed
    if softcap:
        writer.add_attn_logit_softcapping(softcap)
    if final_softcap:
        writer.add_final_logit_softcapping(final_softcap)
    _nope(manifest, spec)
    pairs = [(a.rope, w) for a, w in zip(atts, windowed) if a.rope is not None]  # NoPE layers: none
    if not pairs:
        return None
    full = [r for r, w in pairs if not w] or [r for r, _ in pairs]
    rope = _one(full, "RoPE", arch)
    writer.add_rope_dimension_count(rope.rotary_dim)
    writer.add_rope_freq_base(rope.theta)
    local = [r for r, w in pairs if w]
    if local:
        swa = _one(local, "the sliding layers' RoPE", arch)
        if swa.model_copy(update={"theta": rope.theta}) != rope or (swa.theta != rope.theta
                                                                    and not spec.local_rope_base):
            raise ParityError(f"the sliding layers rotate otherwise than the others (theta {swa.theta:g}, "
                              f"scaling {swa.scaling}); llama.cpp's {arch} takes a different base only")
        if spec.local_rope_base:
            writer.add_rope_freq_base_swa(swa.theta)
    return rope


# Catalogued mistakes a GGUF file can carry (--inject): its metadata (rope.freq_base, layer_norm_rms_epsilon,
# logit_scale), its q/k row layout, or its norm weights. The others (an activation, a softcap skipped) live in
# llama.cpp's code.
INJECTABLE = ("rope-permuted", "rope-theta-wrong", "norm-eps-wrong", "norm-offset-dropped", "norm-offset-added",
              "logit-scale-dropped")


def _injected(bug: str, manifest: Manifest, tensors: dict[str, torch.Tensor], source_style: str
              ) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """(manifest, tensors) with the mistake, as llama.cpp would meet it in a file.

    ``rope-permuted`` is a port rotating the checkpoint's stored q/k rows in the other pairing than the one they
    are stored for. llama.cpp's pairing is fixed, so the file holds rows that, rotated in llama.cpp's pairing,
    rotate as the stored rows would in the wrong one: the stored rows restyled from the wrong pairing to llama.cpp's.
    """
    if bug not in INJECTABLE:
        raise ParityError(f"--inject {bug}: a GGUF file can carry {', '.join(INJECTABLE)}; the others are in "
                          f"llama.cpp's code, not its file")
    m, t = bugs.inject(bug, manifest, tensors)
    if bug == "rope-permuted":
        wrong = "interleaved" if source_style == "half" else "half"
        for name in list(t):
            layer = manifest.layer_of(name)
            if layer is not None and layer.attention.rope is not None:
                ours = layer.attention.rope.style  # llama.cpp's pairing, as written
                stored = restyle_rope(name, t[name], layer, ours, source_style)
                t[name] = restyle_rope(name, stored, layer, wrong, ours)
        m.layers = manifest.layers  # the file states llama.cpp's pairing; the rows carry the mistake
    return m, t


def _leading_bos(directory: Path) -> int | None:
    """The BOS the checkpoint's tokenizer adds to every text (parity.checkpoint.inputs.leading_bos): what llama.cpp
    must add itself (``tokenizer.ggml.add_bos_token``) to run a text as the reference does; None without one. Only
    the tokenizer's post-processor is built, on a one-word vocabulary: the whole tokenizer (Qwen's 11 MB) would add
    0.1 GB to the conversion's peak RSS."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = read_json(path, "")
    except ParityError:  # an unreadable tokenizer.json is no vocabulary (vocabulary() says so)
        return None
    processor = data.get("post_processor") if isinstance(data, dict) else None
    if not processor:
        return None
    one_word = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                "pre_tokenizer": None, "post_processor": processor, "decoder": None,
                "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}
    try:
        return leading_bos(Tokenizer.from_str(json.dumps(one_word)))
    except Exception:  # noqa: BLE001 - a post-processor this tokenizers cannot build: as without one
        return None


def _add_vocabulary(writer, vocab: tuple[list, list] | None, bos: int | None) -> None:
    """The file's tokenizer: llama.cpp's byte-level BPE with the default pre-tokenizer (the check reports any other
    tokenization), adding the BOS the checkpoint's tokenizer adds (``bos``) and no other, or "none" (parity feeds
    token ids; a file without a vocabulary says so)."""
    import gguf  # optional: gguf

    if vocab is None:
        writer.add_tokenizer_model("none")
        return
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab[0])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab[0]))
    writer.add_token_merges(vocab[1])
    if bos is not None:
        writer.add_bos_token_id(bos)
    writer.add_add_bos_token(bos is not None)


def _encoded(x: torch.Tensor, matrix, name: str = ""):
    """A tensor's data as gguf-py takes it, matrices (and stacked experts) in type ``matrix``, vectors and routers
    (KEPT_F32) F32: (data, its raw GGML type for quantized data, else None)."""
    import gguf  # optional: gguf

    kind = matrix if x.dim() >= 2 and not name.endswith(KEPT_F32) else gguf.GGMLQuantizationType.F32
    if kind == gguf.GGMLQuantizationType.Q8_0 and x.shape[-1] % 32:
        kind = gguf.GGMLQuantizationType.F16  # Q8_0 needs rows of 32; llama.cpp's converter falls back too
    if kind == gguf.GGMLQuantizationType.Q8_0:
        rows = [gguf.quants.quantize(part.float().numpy(), kind)
                for part in x.reshape(-1, x.shape[-1]).split(QUANTIZE_ROWS)]
        data = np.concatenate(rows)
        return data.reshape(*x.shape[:-1], data.shape[-1]), kind
    return x.to(torch.float16 if kind == gguf.GGMLQuantizationType.F16 else torch.float32).numpy(), None


def _gathered(tensors, fuse: dict[str, list[str]], experts: Callable[[int], int]):
    """(llama.cpp name, neutral name, tensor) for each tensor to write. One that gathers several is held until its
    last part arrives: a fused one (``fuse``) has its parts' rows concatenated, a layer's experts are stacked
    (``experts(layer)``: how many). The others come as they are, named by NAMES (llama.cpp name None)."""
    parts = {}  # neutral part -> (target, its index, how many)
    for target, names in fuse.items():
        for k, part in enumerate(names):
            parts[part] = (target, k, len(names))
    held: dict[str, dict[int, torch.Tensor]] = {}
    for name, x in tensors:
        m = _LAYER.match(name)
        key = f"layers.{{i}}.{m.group(2)}" if m else name
        if key in parts:
            target, k, n = parts[key]
            target, join = (target.replace("{i}", m.group(1)) if m else target), torch.cat
        elif (slot := expert_slot(name)) is not None:
            (target, k), n, join = slot, experts(int(m.group(1))), torch.stack
        else:
            yield None, name, x
            continue
        group = held.setdefault(target, {})
        group[k] = x.clone()  # the reader reuses its buffer for the next tensor
        if len(group) == n:
            del held[target]
            yield target, name, join([group[j] for j in range(n)], dim=0)
    if held:
        raise ParityError(f"the parts of {', '.join(held)} are not all in the checkpoint")


def export(path: Path, out: Path, *, qtype: str = "F32", force: bool = False, adapter_dirs=(),
           inject: str | None = None) -> dict:
    """Write checkpoint ``path`` as the GGUF file ``out`` (with a catalogued mistake: ``inject``), its matrices
    in ``qtype`` (one of TYPES, or LLAMA_TYPES: quantized by llama.cpp from the file written at F32, or F16 for a
    float16 checkpoint, beside ``out``). Returns the architecture, the family, ``tensors`` {name: GGML type}
    and ``summary`` (the types counted), as the written file's header states them."""
    try:
        import gguf  # optional: gguf
    except ImportError:
        raise ParityError("--to gguf writes with gguf-py: pip install 'parity[llama]' (or pip install gguf)") from None

    if qtype not in TYPES and qtype not in LLAMA_TYPES:
        raise ParityError(f"--gguf-type {qtype!r} is not one the exporter makes: {', '.join((*TYPES, *LLAMA_TYPES))}")
    if qtype in LLAMA_TYPES:
        ftype(qtype)  # llama-cpp-python and the type are there, before anything is written
    ckpt = open_checkpoint(Path(path), adapter_dirs)
    spec = ckpt.adapter.spec.gguf
    if spec is None:
        able = [f for f, a in load_all(adapter_dirs).items() if a.spec.gguf is not None]
        raise ParityError(f"{path}: parity does not export {ckpt.resolved.family} to GGUF (its adapter has no [gguf] "
                          f"section); families it does: {', '.join(able)}")
    check_convertible(ckpt)
    check = ckpt.check()
    # llama.cpp quantizes from a file written first: F16 where that is the checkpoint's own type, else F32
    plain = ("F16" if source_dtype(ckpt, check) == torch.float16 else "F32") if qtype in LLAMA_TYPES else qtype
    # tensors come out of the checkpoint at the type they are written in (F16), or at their own (quantized from
    # float32 a block of rows at a time): a float32 copy of a bf16 model's embedding would double the peak
    work = {"F32": torch.float32, "F16": torch.float16}.get(plain) or source_dtype(ckpt, check)
    manifest = build_manifest(ckpt, work, spec.rope_style, check.prefix, hashes=False)
    for info in manifest.tensors.values():  # vectors (norms with 1 + w folded, biases) are written F32, unrounded
        if len(info.shape) == 1:
            info.dtype = "float32"
    if manifest.head is None:
        raise ParityError(f"{path}: a model without an LM head cannot run in llama.cpp")
    matrix, file_type = {"F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
                         "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
                         "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}[plain]
    tensors = neutral_tensors(ckpt, manifest)
    if inject is not None:  # a broken twin, for tests and selftests: small models, held whole
        manifest, held = _injected(inject, manifest, dict(tensors), ckpt.resolved["positions.rope_style"])
        tensors = iter(held.items())
    with atomic.output_file(Path(out), force=force, companions=()) as tmp:
        # the file llama.cpp quantizes is a temporary too, in the same directory: removed with it on any error
        first = tmp / (Path(out).name if plain == qtype else f"unquantized-{plain}.gguf")
        writer = gguf.GGUFWriter(first, spec.arch, use_temp_file=True)
        # tensor data goes to a file on disk as each tensor is added (gguf-py's own spooled temp file keeps the
        # first 256 MB in memory and copies it when it rolls over: twice the largest tensor, or more)
        writer.temp_file = spill = open(tmp / "tensors.spill", "w+b")
        # the directory goes in general.basename, not general.name: llama.cpp sets token attributes by the name
        # ("phi3" in it: it looks up "</s>", and a vocabulary without that token fails to load)
        writer.add_name("parity convert --to gguf")
        writer.add_basename(ckpt.path.name)
        writer.add_file_type(file_type)
        rope = _metadata(writer, manifest, spec)
        _add_vocabulary(writer, vocabulary(ckpt.path, manifest.vocab_size), _leading_bos(ckpt.path))
        for name, x in _rope_tensors(writer, rope, spec).items():
            writer.add_tensor(name, x.numpy())
        experts = lambda i: manifest.layers[i].mlp.moe.experts  # noqa: E731
        for target, name, x in _gathered(tensors, spec.fuse, experts):
            target = target or gguf_name(name)
            if target is None:
                raise ParityError(f"{path}: neutral tensor {name} has no llama.cpp name in parity/engines/gguf/export.py")
            data, raw = _encoded(x, matrix, target)
            writer.add_tensor(target, data, raw_dtype=raw)
            del x, data
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()  # copies the spill file into place, and closes it
        writer.close()
        Path(spill.name).unlink()
        if plain != qtype:
            quantize(first, tmp / Path(out).name, qtype)
            first.unlink()
        header = header_types(tmp / Path(out).name)  # what each tensor got: llama.cpp's mix and fallbacks
    return {"arch": spec.arch, "type": qtype, "tensors": {name: h[0] for name, h in header.items()},
            "summary": summary(qtype, header), "family": ckpt.resolved.family}
