"""The neutral vocabulary: capture-point names and neutral tensor names, spelled once.

Every other module (adapters, converter, executor, reports) refers to these names; an adapter
that maps to a name not listed here is rejected when it loads.
"""

from __future__ import annotations

import re

# Capture points, in forward order (docs/design.md, "Capture points").
MODEL_POINTS_BEFORE = ("embed",)
# the pseudo-point before them all: the token ids a candidate that records them (an engine dump) ran, compared
# with the reference's before ``embed`` (parity.dumps.mistakes); never an activation
INPUT_IDS = "input_ids"
LAYER_POINTS = ("attn_in", "attn_out", "mid", "mlp_in", "mlp_out", "out")
MODEL_POINTS_AFTER = ("final_norm", "logits")
CAPTURE_POINTS = (
    *MODEL_POINTS_BEFORE,
    *(f"layers.{{i}}.{p}" for p in LAYER_POINTS),
    *MODEL_POINTS_AFTER,
)


def capture_names(num_layers: int, *, final_norm: bool, logits: bool) -> list[str]:
    """Concrete capture-point names in forward order for a model."""
    names = list(MODEL_POINTS_BEFORE)
    for i in range(num_layers):
        names += [f"layers.{i}.{p}" for p in LAYER_POINTS]
    if final_norm:
        names.append("final_norm")
    if logits:
        names.append("logits")
    return names


def layer_of(name: str) -> int | None:
    """The layer index of a point inside a layer (layers.{i}.*), else None."""
    if name.startswith("layers."):
        index = name.split(".", 2)[1]
        return int(index) if index.isdigit() else None
    return None


# Operation-level points inside a layer's sublayers (docs/ops.md): ``layers.{i}.attn.<op>``, ``layers.{i}.mlp.<op>``,
# in forward order. Their layouts (heads and positions kept) are parity.ops'.
ATTN_OPS = ("q", "k", "v", "kv_compressed", "kv_norm", "q_norm", "k_norm", "q_rope", "k_rope", "scores", "probs",
            "context")
MLP_OPS = ("router", "gate", "up", "act")
OP_POINTS = (*(f"layers.{{i}}.attn.{op}" for op in ATTN_OPS), *(f"layers.{{i}}.mlp.{op}" for op in MLP_OPS))
# where each sublayer's ops sit among the layer points: attention ops between attn_in and attn_out, MLP ops
# between mlp_in and mlp_out
_LAYER_ORDER = ("attn_in", *(f"attn.{op}" for op in ATTN_OPS), "attn_out", "mid", "mlp_in",
                *(f"mlp.{op}" for op in MLP_OPS), "mlp_out", "out")


def op_names(i: int) -> list[str]:
    """Every operation-level point name of layer ``i``, in forward order (a family has a subset: its adapter's)."""
    return [t.replace("{i}", str(i)) for t in OP_POINTS]


def is_op(name: str) -> bool:
    """Whether ``name`` is an operation-level point (layers.{i}.attn.q, layers.{i}.mlp.act, ...)."""
    if not name.startswith("layers."):
        return False
    rest = name.split(".", 2)[2] if name.count(".") >= 2 else ""
    return rest in _LAYER_ORDER and rest not in LAYER_POINTS


def point_order(name: str) -> tuple:
    """Sort key putting concrete capture points (and finer points below them) in forward order: a layer's
    operation-level points sit inside its sublayers."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        for k in (2, 1):  # an op (attn.q), then a layer point (attn_out), each perhaps with a finer part below it
            head = ".".join(rest.split(".")[:k])
            if head in _LAYER_ORDER and (k == 2 or head in LAYER_POINTS):
                return (1, int(index), _LAYER_ORDER.index(head), rest[len(head) + 1:])
        return (1, int(index), len(_LAYER_ORDER), rest)
    if name == INPUT_IDS:
        return (0, -1)
    if name in MODEL_POINTS_BEFORE:
        return (0, MODEL_POINTS_BEFORE.index(name))
    head, _, finer = name.partition(".")
    return (2, MODEL_POINTS_AFTER.index(head) if head in MODEL_POINTS_AFTER else len(MODEL_POINTS_AFTER), finer)


def _norm(prefix: str, bias: bool = True) -> list[str]:
    return [f"{prefix}.weight"] + ([f"{prefix}.bias"] if bias else [])


def _linear(prefix: str) -> list[str]:
    return [f"{prefix}.weight", f"{prefix}.bias"]


# Norm modules by neutral name. Block norms are named by where they sit:
#   *_norm       on the sublayer's input (Pre-Norm, and the first half of a sandwich)
#   *_post_norm  on the sublayer's output, before the residual add (sandwich, OLMo 2)
#   *_res_norm   on the residual stream after the add (Post-Norm, as in BERT)
NORMS = (
    "embed.norm",
    "embed.per_layer_norm",
    "layers.{i}.attn_norm",
    "layers.{i}.attn_post_norm",
    "layers.{i}.attn_res_norm",
    "layers.{i}.mlp_norm",
    "layers.{i}.mlp_post_norm",
    "layers.{i}.mlp_res_norm",
    "layers.{i}.attn.q_norm",
    "layers.{i}.attn.k_norm",
    "layers.{i}.attn.v_norm",
    "layers.{i}.attn.q_a_norm",
    "layers.{i}.attn.kv_a_norm",
    "layers.{i}.moe.router_norm",
    "layers.{i}.moe_norm",
    "layers.{i}.moe_post_norm",
    "layers.{i}.mlp_dense_post_norm",
    "layers.{i}.pli_post_norm",
    "final_norm",
    "head.norm",
)

TENSORS = frozenset(
    [n for norm in NORMS for n in _norm(norm)]
    + [
        "embed.tokens.weight",
        "embed.positions.weight",
        "embed.token_types.weight",
        "embed.per_layer_tokens.weight",
        "embed.per_layer_projection.weight",
        *_linear("layers.{i}.attn.q"),
        *_linear("layers.{i}.attn.k"),
        *_linear("layers.{i}.attn.v"),
        *_linear("layers.{i}.attn.o"),
        *_linear("layers.{i}.attn.q_a"),
        "layers.{i}.attn.q_b.weight",
        *_linear("layers.{i}.attn.kv_a"),
        "layers.{i}.attn.kv_b.weight",
        "layers.{i}.attn.sinks",
        *_linear("layers.{i}.mlp.gate"),
        *_linear("layers.{i}.mlp.up"),
        *_linear("layers.{i}.mlp.down"),
        "layers.{i}.moe.router.weight",
        "layers.{i}.moe.router.score_bias",
        "layers.{i}.moe.router.scale",
        "layers.{i}.moe.router.expert_scale",
        "layers.{i}.moe.router.bias",
        *_linear("layers.{i}.moe.experts.{e}.gate"),
        *_linear("layers.{i}.moe.experts.{e}.up"),
        *_linear("layers.{i}.moe.experts.{e}.down"),
        "layers.{i}.moe.shared.gate.weight",
        "layers.{i}.moe.shared.up.weight",
        "layers.{i}.moe.shared.down.weight",
        "layers.{i}.moe.shared_gate.weight",
        "layers.{i}.pli.gate.weight",
        "layers.{i}.pli.proj.weight",
        "layers.{i}.layer_scalar",
        *_linear("head.transform"),
        "head.bias",
        "lm_head.weight",
    ]
)

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def placeholders(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))


def compared_points(ckpt, layerwise: bool, isolate: bool = False) -> list[str]:
    """The points a check compares: every one (--layerwise), else the final output; an isolated check also
    compares what each layer hands on (embed, layers.{i}.out), since fed the reference's inputs, a layer whose
    own output is not compared would not be tested at all."""
    points = [c.name for c in ckpt.resolved.capture]
    final = "logits" if "logits" in points else ("final_norm" if "final_norm" in points else points[-1])
    if layerwise:
        return points
    if isolate:
        stream = {"embed", final, *(f"layers.{i}.out" for i in range(ckpt.resolved.num_layers))}
        return [p for p in points if p in stream]
    return [final]
