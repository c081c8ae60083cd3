"""Typed records filled from an adapter's resolved settings by their fields' own declarations.

A field of such a record (a pydantic model: the neutral model's parts, parity.neutral.model; one layer's RoPE,
parity.rope.Rope) says where its value comes from, its default and its meaning, once:

    causal: bool = setting("attention.causal", "a query sees no later key")

``fill`` reads every declared field off a ``Source`` (the resolved settings at one layer, or the model's), so a
convention is added by declaring its field, never by copying a setting into a dict by hand. A nested record is
filled the same way, and is absent (None) where its class's ``present(source)`` says so; values that no single
setting holds are computed by the class's ``derive(values, source)``.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

# a field's declaration, as it sits in its json_schema_extra
SETTING, MODULE, GIVEN, NORM, DERIVED = "setting", "module", "given", "norm", "derived"


def setting(key: str | tuple[str, ...], meaning: str, default: Any = PydanticUndefined) -> Any:
    """The value of the adapter setting ``key`` (at the layer, inside one); a tuple: the first of them that is set.
    ``default``: what a manifest written before the field existed means by its absence."""
    return Field(default, description=meaning, json_schema_extra={SETTING: key})


def module(attribute: str, meaning: str) -> Any:
    """The resolved norm module's ``attribute`` (parity.adapter.ResolvedNorm): its eps, its weight, ..."""
    return Field(description=meaning, json_schema_extra={MODULE: attribute})


def given(name: str, meaning: str, default: Any = PydanticUndefined) -> Any:
    """A value the caller states, not the adapter (the RoPE style a conversion writes, the hidden size)."""
    return Field(default, description=meaning, json_schema_extra={GIVEN: name})


def norm(slot: str, meaning: str) -> Any:
    """The norm module at ``slot`` (parity/names.py: ``attn_norm``, ``attn.q_norm``, ``final_norm``), None where the
    model has none there."""
    return Field(None, description=meaning, json_schema_extra={NORM: slot})


def derived(meaning: str, default: Any = PydanticUndefined) -> Any:
    """A value computed from the others by the class's ``derive``."""
    return Field(default, description=meaning, json_schema_extra={DERIVED: True})


@dataclass(frozen=True)
class Source:
    """Where declared values are read: the resolved settings at one layer (``layer``) or the model's."""

    resolved: Any   # parity.adapter.Resolved (not imported: the adapter schema reads the declarations here)
    layer: int | None = None
    given: Mapping[str, Any] = field(default_factory=dict)

    def at(self, key: str) -> Any:
        return self.resolved.layer(key, self.layer) if self.layer is not None else self.resolved[key]

    def first(self, keys: str | tuple[str, ...]) -> Any:
        keys = (keys,) if isinstance(keys, str) else keys
        return next((v for v in map(self.at, keys) if v), self.at(keys[-1]))

    def norm(self, slot: str) -> Any:
        name = slot if self.layer is None else f"layers.{self.layer}.{slot}"
        return next((n for n in self.resolved.norms if n.neutral == name), None)


def declaration(info: Any) -> tuple[str, Any] | None:
    """A field's declaration: (SETTING | MODULE | GIVEN | NORM | DERIVED, its argument), or None."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return next(((k, v) for k, v in extra.items() if k in (SETTING, MODULE, GIVEN, NORM, DERIVED)), None)


def record_class(annotation: Any) -> type[BaseModel] | None:
    """The record class a field holds (``X`` or ``Optional[X]``), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        found = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return found[0] if len(found) == 1 else None
    return None


def _coerce(annotation: Any, value: Any) -> Any:
    """A setting's value as the field's type states it: a float field holds a float, a flag a bool."""
    args = set(typing.get_args(annotation)) if typing.get_origin(annotation) in (Union, types.UnionType) else set()
    kind = annotation if not args else next(iter(args - {type(None)}), None)
    kind = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind
    if value is None and type(None) in args:
        return None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is bool:
        return bool(value)
    return value


def fill(cls: type[BaseModel], source: Source, module_of: Any = None, /, **values: Any) -> Any:
    """A ``cls`` with every declared field read off ``source`` (``values``: fields the caller gives outright); None
    where ``cls.present(source)`` says the model has no such part."""
    present: Callable[[Source], bool] | None = getattr(cls, "present", None)
    if present is not None and not present(source):
        return None
    for name, info in cls.model_fields.items():
        if name in values:
            continue
        how = declaration(info)
        kind, argument = how if how else (None, None)
        if kind == SETTING:
            values[name] = _coerce(info.annotation, source.first(argument))
        elif kind == MODULE:
            values[name] = getattr(module_of, argument)
        elif kind == GIVEN and argument in source.given:
            values[name] = source.given[argument]
        elif kind == NORM:
            found = source.norm(argument)
            values[name] = None if found is None else fill(record_class(info.annotation), source, found)
        elif kind is None and (nested := record_class(info.annotation)) is not None \
                and (info.is_required() or hasattr(nested, "present")):  # a part of the model, not a default
            values[name] = fill(nested, source)
    derive = getattr(cls, "derive", None)
    if derive is not None:
        values = derive(values, source)
    return cls(**values)


def settings(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    """Every adapter setting the fields of ``cls`` and of the records it holds read: key -> the first field that
    reads it (what parity.adapter.schema adds to an adapter's sections)."""
    found: dict[str, FieldInfo] = {}
    seen: set[type] = set()

    def walk(record: type[BaseModel]) -> None:
        seen.add(record)
        for info in record.model_fields.values():
            how = declaration(info)
            if how and how[0] == SETTING:
                for key in (how[1],) if isinstance(how[1], str) else how[1]:
                    found.setdefault(key, info)
            held = info.annotation
            held = typing.get_args(held)[0] if typing.get_origin(held) is list else held
            nested = record_class(held)
            if nested is not None and nested not in seen:
                walk(nested)

    walk(cls)
    return found


def declarations(cls: type[BaseModel], where: str = "") -> list[tuple[str, str, str, str]]:
    """Every field of ``cls`` and of the records it holds: (path, where its value comes from, default, meaning)."""
    rows = []
    for name, info in cls.model_fields.items():
        path = f"{where}{name}"
        how = declaration(info)
        nested = record_class(info.annotation)
        if typing.get_origin(info.annotation) is list:
            nested = record_class(typing.get_args(info.annotation)[0])
            path += "[]"
        origin = {SETTING: lambda a: " or ".join(f"`{k}`" for k in ((a,) if isinstance(a, str) else a)),
                  MODULE: lambda a: f"the norm module's {a}", GIVEN: lambda a: f"given: {a}",
                  NORM: lambda a: f"norm at `{a}`", DERIVED: lambda a: "derived"}
        source = origin[how[0]](how[1]) if how else ""
        default = "" if info.is_required() else repr(info.get_default())
        if nested is not None and (how is None or how[0] == NORM):
            rows.append((path, source, default, info.description or ""))
            if how is None:  # a norm's own fields are listed once, under Norm
                rows += declarations(nested, path + ".")
        else:
            rows.append((path, source, default, info.description or ""))
    return rows
