"""Operation-level points (docs/ops.md) read out of llama.cpp's graph, as parity.engines.gguf.kind's eval callback
sees it: which graph tensor holds which op, and how each is laid out as ``[1, S, width]``.

llama.cpp names a graph tensor after what it holds (src/llama-graph.cpp's build_attn and build_ffn, the model
builders), and keeps a name as the tensor is biased and reshaped: ``Qcur-3`` is the query projection's matmul, then
its bias sum, then its reshape into heads, then RoPE's output. The tensors are told apart by their op and order:

    attn.q, .k, .v            the last Qcur / Kcur / Vcur before RoPE or QK-Norm (the bias sum, reshaped)
    attn.q_norm, .k_norm      Qcur_normed / Kcur_normed
    attn.q_rope, .k_rope      the Qcur / Kcur that is a ROPE op (Gemma scales the queries after it, unnamed); on
                              a layer without RoPE, the q / k (normed) that attention receives
    attn.scores               rebuilt from the softmax (below)
    attn.probs                kq_soft_max, cropped to the keys attended
    attn.context              the input of the matmul with blk.N.attn_output.weight (kqv_out)
    mlp.gate, .up             ffn_gate / ffn_up (ffn_gate_b / ffn_up_b: with the bias added)
    mlp.act                   the input of the matmul with blk.N.ffn_down.weight (ffn_swiglu, ffn_geglu, ...)
    mlp.router                ffn_moe_logits

Scores: llama.cpp's ``kq`` is q·kᵀ before the scale; where the model has a softcap it follows as kq_scaled_1,
kq_tanh, kq_scaled_2 (Gemma 2 scales the queries before, so its softmax's scale is 1), and the scale and the mask
are fused in the softmax: soft_max_ext(x, mask, scale) = softmax(x * scale + mask). The scores are rebuilt from
exactly that: the softmax's own input (the last ``kq*`` tensor read) times the scale in its op parameters, plus the
mask tensor llama.cpp itself built for that layer (its softmax's second input: causal, and the sliding window on
a sliding layer), so that a mask llama.cpp gets wrong shows in the scores, not only in the probabilities.
Masked entries (-inf) are emitted as 0 (parity.ops.scores).

Keys: llama.cpp attends over its KV cache's cells (256 and more, padded); a run from an empty cache fills cells
0, 1, ... in order, so the keys attended are the first ``start + n`` cells: the rest are cropped.

q and k rows: llama.cpp's "llama" architecture (and any whose rope type is LLAMA_ROPE_TYPE_NORM) rotates adjacent
pairs, and its GGUF files hold q/k rows permuted for it; they are put back in the reference's order per head
(parity.rope), so that a file whose rows were not permuted diverges at attn.q, where the mistake is.

Not exposed by llama.cpp's graph: MLA's compressed KV and its norm (named per architecture, not read here); the
scores and probabilities with flash attention on (the candidate turns it off); a MoE layer's gate and up per
expert (only the router's logits are read; its softmax over the experts is not attention's, and a shared expert's
ffn_gate / ffn_up after the router are no mlp.gate / mlp.up).
"""

from __future__ import annotations

import re
from typing import Callable, Protocol

import torch

from parity import ops
from parity.rope import half_permutation, interleave_permutation

# enum llama_rope_type -> the pairs its kernel rotates: LLAMA_ROPE_TYPE_NORM adjacent, LLAMA_ROPE_TYPE_NEOX halves
KERNEL_STYLES = {0: "interleaved", 2: "half"}
# graph tensors (without their "-N" layer) that hold an op as named; where a name repeats, the last holds it
NAMED = {"Qcur_normed": "attn.q_norm", "Kcur_normed": "attn.k_norm", "kq_soft_max": "attn.probs",
         "kq_soft_max_ext": "attn.probs", "ffn_gate": "mlp.gate", "ffn_gate_b": "mlp.gate", "ffn_up": "mlp.up",
         "ffn_up_b": "mlp.up", "ffn_moe_logits": "mlp.router"}
# the projections: (op before RoPE, op after it)
PROJECTIONS = {"Qcur": ("attn.q", "attn.q_rope"), "Kcur": ("attn.k", "attn.k_rope"), "Vcur": ("attn.v", None)}
# QK-Norm's output ends the projection's run of names
NORMED = {"Qcur_normed": "Qcur", "Kcur_normed": "Kcur"}
# ops read as the input of a matmul with one of the file's weights (blk.N.<weight>), whatever the graph names it
INPUTS = {"attn_output.weight": "attn.context", "ffn_down.weight": "mlp.act"}
# graph tensors that hold a fused matmul's output (then with its bias added), by the file's fused weight: split
# into the ops of the weight's parts (the adapter's [gguf] fuse), each as wide as the reference's op
FUSED_NODES = {"attn_qkv.weight": ("wqkv", "wqkv_b"), "ffn_up.weight": ("ffn_up", "ffn_up_b")}
# ops whose rows, within a head, are q's or k's
ROWS = ("attn.q", "attn.k", "attn.q_norm", "attn.k_norm", "attn.q_rope", "attn.k_rope")
ATTENTION_MAPS = ("attn.scores", "attn.probs")


class Node(Protocol):
    """One graph tensor, as the eval callback sees it (parity.engines.gguf.kind gives these)."""

    name: str
    op: str          # ggml_op_desc: MUL_MAT, ROPE, SOFT_MAX, ...
    address: int

    def read(self) -> torch.Tensor | None: ...          # [ne3, ne2, ne1, ne0] float32; None: not readable

    def src(self, k: int) -> Node | None: ...            # its k-th source; None: none, or not readable here

    def param(self, k: int) -> float: ...                # op_params[k] as a float


def split(name: str) -> tuple[str, int | None]:
    """``Qcur-3`` -> ("Qcur", 3); a name without a layer -> (name, None)."""
    m = re.fullmatch(r"(.+)-(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def row_order(resolved, kernel: int) -> Callable[[int], torch.Tensor | None] | None:
    """rows(layer): the per-head index map that puts llama.cpp's q/k rows back in the reference's order (None: the
    same order); None where llama.cpp's rope type is not one whose pairs are known (q/k ops are then not read).
    ``resolved``: the reference's parity.adapter.Resolved (None: a Hugging Face half-split order is assumed)."""
    kernel_style = KERNEL_STYLES.get(kernel)
    if kernel_style is None:
        return None

    def setting(key: str, i: int):
        found = resolved.settings.get(key) if resolved is not None else None
        return found.at(i) if found is not None else None

    def rows(i: int) -> torch.Tensor | None:
        if setting("positions.kind", i) not in ("rope", None):
            return None  # no RoPE: the rows are the file's, as the reference's
        style = setting("positions.rope_style", i) or "half"
        head_dim = setting("attention.head_dim", i)
        if style == kernel_style or not head_dim:
            return None
        rotary = setting("positions.rotary_dim", i) or head_dim
        return (half_permutation if kernel_style == "interleaved" else interleave_permutation)(head_dim, rotary)

    return rows


class OpCapture:
    """The ops of one llama.cpp run: ``wants(node)`` when the callback asks, ``take(node)`` when it is computed;
    ``captured`` holds them as parity names them, laid out as docs/ops.md says."""

    def __init__(self, rows: Callable[[int], torch.Tensor | None] | None,
                 fused: dict[str, list[str]] | None = None, width: Callable[[int, str], int] | None = None):
        self.rows = rows
        self.fused = fused or {}  # graph tensor (FUSED_NODES) -> the ops it holds side by side
        self.width = width        # width(layer, op): the reference's width of an op, to split a fused one
        self.notes: list[str] = []
        self.begin(0, 0)

    def begin(self, tokens: int, keys: int) -> None:
        """A run of ``tokens`` positions attending to ``keys`` keys (the cache's first cells)."""
        self.tokens, self.keys = tokens, keys
        self.captured: dict[str, torch.Tensor] = {}
        self.projected: set[tuple[str, int]] = set()  # projections whose RoPE or QK-Norm came: their op is read
        self.rotated: set[tuple[str, int]] = set()    # projections whose RoPE came
        self.kq: tuple[int, torch.Tensor] | None = None  # the last kq* tensor: the softmax's input
        self.routed: set[int] = set()  # MoE layers: a gate or up after the router is a shared expert's, not an op

    def wants(self, node: Node) -> bool:
        base, layer = split(node.name)
        if self._input_of(node) is not None:  # some builders leave the output projection unnamed ("node_32")
            return True
        return layer is not None and (base in NAMED or base in PROJECTIONS or base in self.fused
                                      or _scores_part(base) or _attention_softmax(node, base))

    def take(self, node: Node) -> None:
        base, layer = split(node.name)
        if layer is None:
            pass
        elif _attention_softmax(node, base):
            self._softmax(node, layer)
        elif base in self.fused:
            self._split(node, self.fused[base], layer)
        elif base in PROJECTIONS:
            self._projection(node, base, layer)
        elif base in NAMED and not (layer in self.routed and NAMED[base] in ("mlp.gate", "mlp.up")):
            if NAMED[base] == "mlp.router":
                self.routed.add(layer)
            if base in NORMED:
                self.projected.add((NORMED[base], layer))
            self._put(layer, NAMED[base], node.read())
        elif _scores_part(base):
            x = node.read()
            self.kq = (node.address, x) if x is not None else None
        if (found := self._input_of(node)) is not None:
            op, i = found
            source = node.src(1)
            self._put(i, op, source.read() if source is not None else None)

    def _projection(self, node: Node, base: str, layer: int) -> None:
        before, after = PROJECTIONS[base]
        if node.op == "ROPE":
            self.projected.add((base, layer))
            if after is not None and (base, layer) not in self.rotated:
                self.rotated.add((base, layer))
                self._put(layer, after, node.read())
        elif (base, layer) not in self.projected:
            self._put(layer, before, node.read())

    def _split(self, node: Node, parts: list[str], layer: int) -> None:
        """A fused matmul's output [tokens, sum of widths]: each part's columns as its op."""
        x = node.read()
        if x is None or self.width is None or not self.tokens:
            return
        x = x.reshape(self.tokens, -1)
        widths = [self.width(layer, op) for op in parts]
        if sum(widths) != x.shape[-1]:
            self._note(f"{', '.join(parts)}: llama.cpp's fused output is {x.shape[-1]} wide, not {sum(widths)}")
            return
        for op, part in zip(parts, x.split(widths, dim=-1)):
            self._put(layer, op, part.contiguous())

    def _softmax(self, node: Node, layer: int) -> None:
        """attn.probs (the softmax's output) and attn.scores (its input rebuilt: see the module's docstring)."""
        s, t = self.tokens, self.keys
        for base, (before, after) in PROJECTIONS.items():  # a NoPE layer: attention receives q/k unrotated
            normed = before + "_norm"
            held = self.captured.get(f"layers.{layer}.{normed}", self.captured.get(f"layers.{layer}.{before}"))
            if after is not None and (base, layer) not in self.rotated and held is not None:
                self.captured[f"layers.{layer}.{after}"] = held
        probs = node.read()
        if probs is not None and probs.dim() == 4:
            self._put(layer, "attn.probs", ops.probs(probs[..., :s, :t]))
        source, mask = node.src(0), node.src(1)
        if source is None or self.kq is None or source.address != self.kq[0]:
            self._note("attn.scores: the softmax's input is no kq tensor the graph names, so it was not read")
            return
        if node.param(1) != 0.0:
            self._note("attn.scores: the softmax adds an ALiBi bias, which is not rebuilt here")
            return
        x = self.kq[1][..., :s, :t] * node.param(0)
        held = mask.read() if mask is not None else None
        if mask is not None and held is None:
            self._note("attn.scores: llama.cpp's mask could not be read")
            return
        if held is not None:
            x = x + held[..., :s, :t]
        self._put(layer, "attn.scores", ops.scores(x))

    def _input_of(self, node: Node) -> tuple[str, int] | None:
        """(op, layer) where ``node`` is a matmul with a weight whose input is an op (INPUTS), else None."""
        if node.op != "MUL_MAT":
            return None
        weight = node.src(0)
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", weight.name) if weight is not None else None
        return (INPUTS[m.group(2)], int(m.group(1))) if m and m.group(2) in INPUTS else None

    def _put(self, layer: int, op: str, x: torch.Tensor | None) -> None:
        if x is None:
            return
        if op not in ATTENTION_MAPS:
            if x.numel() % max(self.tokens, 1):
                return
            x = x.reshape(1, self.tokens, -1)
        if op in ROWS:
            if self.rows is None:
                self._note("attn.q and attn.k: llama.cpp's RoPE pairs dims in a way not known here, so its q/k "
                           "rows could not be put in the reference's order; they were not read")
                return
            order = self.rows(layer)
            if order is not None:
                if x.shape[-1] % order.numel():
                    return
                x = x.view(1, self.tokens, -1, order.numel())[..., order].reshape(1, self.tokens, -1)
        self.captured[f"layers.{layer}.{op}"] = x.clone()

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _attention_softmax(node: Node, base: str) -> bool:
    """A softmax of attention's (a MoE router's, ffn_moe_probs, is over the experts)."""
    return node.op == "SOFT_MAX" and not base.startswith("ffn_")


def _scores_part(base: str) -> bool:
    """kq, kq_scaled_1, kq_tanh, kq_scaled_2, ...: what the softmax's input may be (not kqv, kqv_out)."""
    return base.startswith("kq") and not base.startswith("kqv") and not base.startswith("kq_soft_max")


def missing(captured, expected) -> list[str]:
    """The ops (``attn.q``, without the layer) of ``expected`` (concrete names) that ``captured`` lacks."""
    kinds: list[str] = []
    for name in expected:
        kind = name.split(".", 2)[2]
        if name not in captured and kind not in kinds:
            kinds.append(kind)
    return kinds
