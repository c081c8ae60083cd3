"""A small, safe expression language for adapter files.

Adapters derive values from a checkpoint's config (``hidden_size // num_attention_heads``,
``layer_types[i] == 'sliding_attention'``). Expressions are Python syntax restricted to
literals, names, arithmetic, comparisons, boolean logic, conditionals, subscripts, list
comprehensions and a few pure functions, so an adapter file can never run arbitrary code.
"""

from __future__ import annotations

import ast
import math
from functools import lru_cache
from typing import Any, Mapping

FUNCTIONS: dict[str, Any] = {
    "min": min,
    "max": max,
    "len": len,
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "sqrt": math.sqrt,
    "log": math.log,
    "range": range,
    "sum": sum,
    "any": any,
    "all": all,
    "rope_scaling": lambda params: _rope_scaling(params),
    "get": lambda mapping, key, default=None: (mapping or {}).get(key, default),
}

def _rope_scaling(params: Any) -> dict | None:
    """RoPE scaling from a config's ``rope_scaling``/``rope_parameters`` table; None when unscaled.

    Old configs spell the type ``type``; new ones ``rope_type`` and keep ``rope_theta`` beside it.
    """
    if not isinstance(params, dict):
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    rest = {k: v for k, v in sorted(params.items()) if k not in ("rope_type", "type", "rope_theta")}
    return {"rope_type": kind, **rest}


_ALLOWED = (
    ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Store, ast.BinOp, ast.UnaryOp,
    ast.BoolOp, ast.Compare, ast.IfExp, ast.Subscript, ast.Slice, ast.List, ast.Tuple, ast.Dict,
    ast.Call, ast.ListComp, ast.comprehension,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
    ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.Is, ast.IsNot,
)


class ExprError(ValueError):
    """An expression that does not parse, uses a forbidden construct, or fails to evaluate."""


@lru_cache(maxsize=None)
def compile_expr(source: str):
    """Parse and vet ``source``; return (code object, free names)."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"cannot parse expression {source!r}: {exc.msg}") from None
    bound: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"expression {source!r} uses {type(node).__name__}, which adapters may not use")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
            raise ExprError(f"expression {source!r} calls something other than {sorted(FUNCTIONS)}")
        if isinstance(node, ast.Name):
            if node.id.startswith("_"):
                raise ExprError(f"expression {source!r} uses the private name {node.id!r}")
            (bound if isinstance(node.ctx, ast.Store) else names).add(node.id)
    free = frozenset(names - bound - set(FUNCTIONS))
    return compile(tree, "<adapter expression>", "eval"), free


def free_names(source: str) -> frozenset[str]:
    return compile_expr(source)[1]


def evaluate(source: str, env: Mapping[str, Any]) -> Any:
    code, free = compile_expr(source)
    missing = sorted(n for n in free if n not in env)
    if missing:
        raise ExprError(f"expression {source!r} refers to unknown name(s) {', '.join(missing)}")
    scope = {"__builtins__": {}, **FUNCTIONS, **{n: env[n] for n in free}}
    try:
        return eval(code, scope)  # noqa: S307 - vetted above: no attributes, calls only to FUNCTIONS
    except Exception as exc:  # noqa: BLE001 - reported with the expression that failed
        raise ExprError(f"expression {source!r} failed: {type(exc).__name__}: {exc}") from None
