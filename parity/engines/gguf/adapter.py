"""An adapter file's ``[gguf]`` section (``SECTION``, which parity.adapter.schema finds in this folder): how llama.cpp runs the family, for the
exporter (export.py) and the candidate kind (kind.py). Absent: the family is not exported to GGUF."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class GGUFExport(BaseModel):
    """How llama.cpp runs the family: its architecture name in GGUF metadata, and the q/k row layout its RoPE
    kernel for that architecture expects ("interleaved": LLAMA_ROPE_TYPE_NORM, adjacent pairs, so
    convert_hf_to_gguf.py permutes Llama's q/k; "half": NEOX, as Hugging Face stores them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the schema

    arch: str
    rope_style: Literal["half", "interleaved"]
    windows: bool = False           # reads attention.sliding_window and a per-layer sliding_window_pattern
    softcaps: bool = False          # reads attn_logit_softcapping / final_logit_softcapping
    local_rope_base: bool = False   # sliding layers rotate with rope.freq_base_swa
    # reads embedding_scale, residual_scale and attention.scale (Granite)
    multipliers: bool = False
    # reads logit_scale and multiplies the logits by it (Command-R) or divides them (Granite); "": has none
    logit_scale: Literal["", "multiply", "divide"] = ""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"   # the kind of every norm, and the eps key it reads
    # the block the architecture builds: "sequential"; "parallel" (attention and MLP on one shared norm, added to
    # the layer's input together: Command-R's, Phi-2's); "parallel_residual_key" (it reads use_parallel_residual:
    # parallel on two norms, or sequential, one for every layer: GPT-NeoX's); "parallel_by_norm" (a layer written
    # without ffn_norm runs parallel on attn_norm, one with it in sequence: StableLM's, no metadata key)
    block: Literal["sequential", "parallel", "parallel_residual_key", "parallel_by_norm"] = "sequential"
    # the MLP the architecture computes: "gated" (SwiGLU/GeGLU: ffn_gate, ffn_up, ffn_down) or "gelu" (ffn_up, a
    # GELU, ffn_down: no gate)
    mlp: Literal["gated", "gelu"] = "gated"
    nope_every: int = 0             # the architecture skips RoPE on every n-th layer, n fixed in llama.cpp (SmolLM3: 4)
    nope_global: bool = False       # it rotates q/k on its sliding-window layers only (Cohere 2)
    # LongRoPE as llama.cpp reads it: rope_factors_long / _short (divisors), rope.scaling.attn_factor and
    # original_context_length; it picks the long set when the context it is given exceeds the original (Phi-3)
    longrope: bool = False
    # llama.cpp tensors written as neutral tensors concatenated along their rows, in order ({i}: the layer):
    # {"blk.{i}.ffn_up.weight": ["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"]}
    fuse: dict[str, list[str]] = {}
    # MoE layers (softmax-routed top-k SwiGLU experts, every layer): whether the architecture reads them, whether its
    # graph divides the top-k weights by their sum (build_moe_ffn's norm_w, fixed per architecture, not read from the
    # file), whether it reads the experts' width from expert_feed_forward_length (else feed_forward_length is it),
    # and whether it adds one shared expert times sigmoid(ffn_gate_inp_shexp . x) (its width:
    # expert_shared_feed_forward_length)
    experts: bool = False
    experts_renormalised: bool = False
    expert_width_key: bool = False
    shared_expert_gated: bool = False
    # the architecture reads q/k norms (attn_q_norm, attn_k_norm) where the file has them; false: it has none
    qk_norms: bool = True
    # the architecture sizes attn_k_norm to the hidden width (llama.cpp's olmoe): no narrower (GQA) k-norm
    k_norm_hidden_width: bool = False
    # llama.cpp graph tensors whose meaning in this architecture differs from parity/engines/gguf/kind.py's table:
    # {tensor name ({i}: the layer): capture point, or "" where it is none of them}; a name llama.cpp gives no
    # layer index may still map to "layers.{i}...": the layer of the indexed tensor computed before it
    points: dict[str, str] = {}


SECTION = GGUFExport  # an adapter file's [gguf]
