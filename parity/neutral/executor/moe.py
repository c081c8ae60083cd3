"""Mixture-of-experts feed-forward: a router picks ``top_k`` of ``experts`` gated MLPs per token and sums
their outputs with per-token weights.

Three routings exist (transformers 5 semantics, which these functions reproduce op for op):

``sigmoid`` (DeepSeek-V3, ``DeepseekV3TopkRouter``)
    logits = router_input @ router.weight.T, computed in float32 (input and weight upcast);
    scores = sigmoid(logits). Experts are *chosen* on ``scores + score_bias``: with ``groups`` the
    experts form groups of E / groups consecutive experts, a group scores the sum of its two best
    biased scores, only the ``groups_kept`` best groups stay eligible, then the top-k eligible
    experts are chosen. Their *weights* are the un-biased ``scores``, renormalised to sum 1 when
    ``renormalise``, times ``scale`` (routed_scaling_factor).

``softmax`` (Gemma 4 ``Gemma4TextRouter``, Mixtral ``MixtralTopKRouter``, Qwen3-MoE ``Qwen3MoeTopKRouter``)
    Gemma 4 only: the router input is normed by a weightless RMSNorm (``router_norm``), times the
    ``moe.router.scale`` vector, times ``router_input_scale`` (hidden ** -0.5), in the model dtype.
    logits = router input @ router.weight.T in the model dtype; probabilities = softmax over all
    experts in float32; top-k; renormalised to sum 1 when ``renormalise`` (Gemma 4 and Mixtral always,
    Qwen3-MoE when norm_topk_prob); Gemma 4: times ``moe.router.expert_scale[expert]``.

``topk_softmax`` (GPT-OSS ``GptOssTopKRouter``)
    logits = router input @ router.weight.T + router.bias in the model dtype; the top-k logits;
    weights = softmax over those k (they sum to 1: nothing to renormalise).

``topk_sigmoid`` (Llama 4 ``Llama4Router``)
    logits = router input @ router.weight.T in the model dtype; the top-k logits; weights = their sigmoid,
    computed in float32 and cast to the model dtype (``weights_dtype`` "model"). With ``weights_input`` (Llama 4's
    ``Llama4TextMoe``) each chosen expert reads ``x * weight`` (in the model dtype) and its output is summed
    unweighted: a gated MLP is not linear, so this is not the same as weighting the outputs.

Each expert is a gated MLP, its unit act(gate) * up as ``ops.glu`` computes it (GPT-OSS: clamped,
``(up + 1) * gate * sigmoid(1.702 * gate)``), with biases where the layer has them (added after the
product is rounded, as transformers' grouped experts add them).

Dtypes (the model dtype is that of the inputs): routing weights are computed in float32. Each
expert's gated MLP runs in the model dtype; its output times its weight is accumulated over the k
chosen experts in float32 and the sum is cast to the model dtype (transformers' default "grouped_mm"
experts implementation). The weight multiplies in float32 (``weights_dtype`` "float32", the default)
or, where the router casts its weights to the model dtype first (Qwen3-MoE: ``weights_dtype``
"model"), in the model dtype. Shared experts run in the model dtype and are added to that sum in the
model dtype; with ``shared_gate`` (Qwen2-MoE's shared_expert_gate) their output is first multiplied by
sigmoid(expert_input @ moe.shared_gate.weight.T) [T, 1], in the model dtype.

Weights are a dict of neutral names relative to the layer (parity/names.py without "layers.{i}."):
``moe.router.weight`` [E, H], ``moe.router.score_bias`` [E], ``moe.router.scale`` [H],
``moe.router.expert_scale`` [E], ``moe.experts.{e}.{gate,up,down}.weight``,
``moe.shared.{gate,up,down}.weight``, ``moe.shared_gate.weight`` [1, H], and optionally ``moe.router.bias`` [E] and
``moe.experts.{e}.{gate,up,down}.bias``. Router tensors that are absent are not applied.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from parity.neutral.executor.ops import glu, norm
from parity.neutral.model import Moe


def moe(router_input: Tensor, expert_input: Tensor, w: dict, spec: Moe,
        on_logits: Callable[[Tensor], None] | None = None) -> Tensor:
    """The MoE block's output [T, H] in the model dtype.

    Args:
        router_input: [T, H] what the router reads (DeepSeek-V3: the post-attention-normed stream;
            Gemma 4: the raw residual stream ``mid``).
        expert_input: [T, H] what the experts (and shared experts) read (DeepSeek-V3: the same
            tensor; Gemma 4: ``pre_feedforward_layernorm_2(mid)``).
        w: the layer's tensors by neutral name (see the module docstring).
        spec: the layer's experts (parity.neutral.model.Moe): ``routing``, ``experts``, ``top_k``, ``groups``,
            ``groups_kept``, ``renormalise``, ``scale``, ``shared_experts``, ``shared_gate``, ``activation``,
            ``router_norm`` (None or a weightless RMSNorm), ``router_input_scale``, ``router_dtype`` ("float32" |
            "model": the dtype of the router projection), ``weights_dtype`` ("float32" | "model": the dtype in
            which the routing weights multiply the experts' outputs), ``weights_input``.
        on_logits: given the router's logits [T, E] float32 (the ``mlp.router`` operation-level point), if set.
    """
    weights, index = route(router_input, w, spec, on_logits)                 # [T, k] float32, [T, k] int64
    if spec.weights_dtype == "model":
        weights = weights.to(expert_input.dtype)                  # Qwen3-MoE: weights rounded to the model dtype
    act = lambda gate, up: glu(gate, up, spec)  # noqa: E731 - act(gate) * up, with any clamps and offset
    if spec.weights_input:  # Llama 4: experts(x * w), their outputs summed as they are
        out = routed_experts(expert_input, weights, index, w, act, spec.experts, on_input=True)
    else:
        out = routed_experts(expert_input, weights, index, w, act, spec.experts)  # [T, H] model dtype
    if spec.shared_experts:
        shared = gated_mlp(expert_input, w, "moe.shared", act)                # [T, H] model dtype
        if spec.shared_gate:  # Qwen2-MoE: times sigmoid(x @ shared_gate.T) [T, 1], in the model dtype
            shared = torch.sigmoid(F.linear(expert_input, w["moe.shared_gate.weight"])) * shared
        out = out + shared
    return out


def route(router_input: Tensor, w: dict, spec: Moe,
          on_logits: Callable[[Tensor], None] | None = None) -> tuple[Tensor, Tensor]:
    """Per token, the chosen experts and their weights: (weights [T, k] float32, index [T, k] int64).
    ``on_logits``: given the router's logits [T, E], if set."""
    logits = router_logits(router_input, w, spec)                 # [T, E] float32
    if on_logits is not None:
        on_logits(logits)
    if spec.routing == "sigmoid":
        weights, index = _sigmoid_choice(logits, w, spec)
    elif spec.routing == "softmax":
        probs = torch.softmax(logits, dim=-1)                     # [T, E] float32
        weights, index = probs.topk(spec.top_k, dim=-1)           # [T, k]
    elif spec.routing == "topk_softmax":                          # GPT-OSS: the top-k logits, then their softmax
        chosen, index = logits.topk(spec.top_k, dim=-1)           # [T, k]
        weights = torch.softmax(chosen, dim=-1)                   # [T, k] float32
    elif spec.routing == "topk_sigmoid":                          # Llama 4: the top-k logits, then their sigmoid
        chosen, index = logits.topk(spec.top_k, dim=-1)           # [T, k]
        weights = torch.sigmoid(chosen)                           # [T, k] float32
    else:
        raise ValueError(f"unknown MoE routing {spec.routing!r} (sigmoid, softmax, topk_softmax or topk_sigmoid)")
    if spec.renormalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # DeepSeek's guard; 1e-20 vanishes in any real sum
    if "moe.router.expert_scale" in w:
        weights = weights * w["moe.router.expert_scale"][index]   # stays float32
    if spec.scale is not None:
        weights = weights * spec.scale
    return weights, index


def router_logits(x: Tensor, w: dict, spec: Moe) -> Tensor:
    """Router logits [T, E] as float32 (computed in float32 or in the model dtype, see ``router_dtype``)."""
    if spec.router_norm is not None:                              # weightless: float32 statistics, cast back
        x = norm(x, spec.router_norm, None, None)                 # [T, H] model dtype
    if "moe.router.scale" in w:
        x = x * w["moe.router.scale"].to(x.dtype)
    if spec.router_input_scale is not None:
        x = x * spec.router_input_scale
    weight = w["moe.router.weight"]                               # [E, H]
    bias = w.get("moe.router.bias")                               # [E] (GPT-OSS)
    if spec.router_dtype == "float32":
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)).float()


def _sigmoid_choice(logits: Tensor, w: dict, spec: Moe) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 selection: choose on biased sigmoid scores within the best groups; weigh by unbiased ones."""
    scores = logits.sigmoid()                                     # [T, E] float32
    choice = scores
    if "moe.router.score_bias" in w:
        choice = scores + w["moe.router.score_bias"].float()      # only for choosing experts
    groups = spec.groups or 1
    if groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, groups, E // groups)             # [T, G, E/G]
        group_score = grouped.topk(2, dim=-1).values.sum(-1)      # [T, G] sum of each group's two best
        kept = group_score.topk(spec.groups_kept, dim=-1).indices  # [T, groups_kept]
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        keep = keep.repeat_interleave(E // groups, dim=1)         # [T, E]
        choice = choice.masked_fill(~keep, float("-inf"))
    index = choice.topk(spec.top_k, dim=-1).indices               # [T, k]
    return scores.gather(1, index), index


def routed_experts(x: Tensor, weights: Tensor, index: Tensor, w: dict, act, experts: int | None = None,
                   on_input: bool = False) -> Tensor:
    """sum_j weights[t, j] * expert_{index[t, j]}(x[t]) [T, H]: products in the weights' dtype promoted with
    x's (float32 weights: float32), sum in float32, cast to x.dtype. ``on_input``: sum_j expert(x[t] * weights[t, j])
    instead, the product in x's dtype.

    Each chosen expert runs on the tokens that chose it. A graph being exported (torch.export, for
    ONNX) cannot branch on which experts were chosen: there every one of the ``experts`` runs on every
    token and keeps its output where it was chosen: the same sum, in the same order.
    """
    T, k = index.shape
    contrib = torch.zeros(T, k, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, k, H]
    if torch.compiler.is_exporting() and experts is not None:
        for e in range(experts):
            chosen = (index == e)[..., None]                      # [T, k, 1]
            if on_input:  # the expert's weight for each token (0 where it was not chosen) scales its input
                scaled = x * (weights * chosen[..., 0]).sum(-1, keepdim=True).to(x.dtype)
                y = gated_mlp(scaled, w, f"moe.experts.{e}", act)[:, None, :].float()   # [T, 1, H]
            else:
                y = gated_mlp(x, w, f"moe.experts.{e}", act)[:, None, :] * weights[..., None]  # [T, k, H]
            contrib = torch.where(chosen, y, contrib)             # float32
        return contrib.sum(1).to(x.dtype)
    for e in index.unique().tolist():
        token, slot = (index == e).nonzero(as_tuple=True)
        if on_input:
            y = gated_mlp(x[token] * weights[token, slot, None].to(x.dtype), w, f"moe.experts.{e}", act)
            contrib[token, slot] = y.float()
            continue
        y = gated_mlp(x[token], w, f"moe.experts.{e}", act)       # [n, H] model dtype
        contrib[token, slot] = (y * weights[token, slot, None]).float()  # float32 (a model-dtype product widened)
    return contrib.sum(1).to(x.dtype)


def gated_mlp(x: Tensor, w: dict, prefix: str, act) -> Tensor:
    """down(act(gate(x), up(x))), all in x's dtype; ``act(gate, up)`` is the gated unit (ops.glu). Biases where
    the layer has them (GPT-OSS's experts)."""
    gate = _biased(F.linear(x, w[f"{prefix}.gate.weight"]), w.get(f"{prefix}.gate.bias"))
    up = _biased(F.linear(x, w[f"{prefix}.up.weight"]), w.get(f"{prefix}.up.bias"))
    return _biased(F.linear(act(gate, up), w[f"{prefix}.down.weight"]), w.get(f"{prefix}.down.bias"))


def _biased(y: Tensor, bias: Tensor | None) -> Tensor:
    """An expert's projection plus its bias, added after the product is rounded to the model dtype (transformers'
    grouped experts: ``out.add_(bias)``), not fused into it."""
    return y if bias is None else y + bias

