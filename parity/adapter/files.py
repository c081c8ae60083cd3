"""Adapter files: reading one, resolving ``extends``, validating the result, and the adapter search path.

An adapter may state only how it differs from another: ``extends = "llama"`` at the top of the file names the
base adapter (a file ``llama.toml`` in the same directory, else in the directories searched before it, the
built-in adapters last). The base is resolved first (it may extend another in turn); the child's data is then
merged onto it, and the result is validated as a whole by the schema (``parity.adapter.schema``). Merge rules:

- ``family``, ``description`` and ``[[variants]]`` are never inherited: an extending file gives its own
  (inheriting them would make two families claim the same checkpoints).
- Top-level tables (``[derive]``, ``[norm]``, ``[attention]``, ``[positions]``, ``[mlp]``, ``[embedding]``,
  ``[legacy_names]``, ``[capture]``, ``[ops]``, ``[gguf]``, ``[tiny]``) merge key by key; each key's value replaces
  the base's whole: a ``{ key = ..., default = ... }`` parameter, a capture point, an op, ``tiny.config``,
  ``gguf.points``, ``positions.scaling_types`` are single values. ``[derive]`` names are evaluated in dependency
  order, so a child may add or redefine any of them.
- ``[[norms]]``, ``[[tensors]]`` and ``[[buffers]]`` merge entry by entry, matched by ``hf``: an entry whose
  ``hf`` the base has replaces that entry whole, where it stands; an entry with a new ``hf`` goes right after
  the entry listed before it in the child (at the end when it is listed first). ``after = HF`` or
  ``before = HF`` on an entry places (or moves) it next to the base entry with that ``hf`` instead.
- ``remove = { KEY = true }`` drops a whole top-level key of the base (``gguf``, or ``norms`` to restate the
  array whole); ``remove = { KEY = ["name or hf pattern", ...] }`` drops keys of a table (``derive``,
  ``capture``, ``ops``, a convention field, which then takes its schema default) or the entries of ``[[norms]]`` /
  ``[[tensors]]`` / ``[[buffers]]`` whose ``hf`` matches a pattern (``*`` and ``?`` as in shell globs).
  Removal applies to the base before the merge; a pattern that matches nothing is an error.

Unknown keys are refused in the extending file itself, before anything is merged; cycles and unknown bases
are refused naming the file. ``parity adapters --resolved NAME`` prints the data an adapter resolves to.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from parity import names
from parity.adapter.expr import ExprError, compile_expr, free_names
from parity.adapter.schema import CHOICES, SECTIONS, AdapterFile, Param
from parity.errors import ParityError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_VAR = "PARITY_ADAPTERS"
DIRECTIVES = ("extends", "remove")            # top-level keys read while merging, not part of the schema
OWN = ("family", "description", "variants")   # never inherited
KEYED = ("norms", "tensors", "buffers")        # arrays of tables merged entry by entry, matched by `hf`
PLACE = ("after", "before")                    # where an entry of a KEYED array goes
UNKNOWN = "unknown key (check its spelling against the schema in parity/adapter/schema.py)"


@dataclass(frozen=True)
class Adapter:
    spec: AdapterFile
    path: Path
    bases: tuple[Path, ...] = ()   # the files it extends, nearest first
    # a generated adapter (parity.reference.structure): the conventions it cannot tell, and where its structure was
    # found; empty for an adapter file
    unknown: tuple[str, ...] = ()
    discovered: dict | None = field(default=None, hash=False, compare=False)

    @property
    def generic(self) -> bool:
        """Generated from transformers' own model class: its structure known, its family's conventions not."""
        return bool(self.unknown)

    @property
    def family(self) -> str:
        return self.spec.family


def resolved_data(adapter: Adapter) -> dict:
    """Everything an adapter says once ``extends`` is merged and schema defaults are filled in (JSON types)."""
    return adapter.spec.model_dump(mode="json")


# --------------------------------------------------------------------------------------------
# Errors


def _loc(loc: Iterable) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("Param", "OpPoint", "bool", "int", "float", "str", "list", "none") or "[" in str(part):
            continue  # pydantic's union-branch labels say nothing to a reader
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _fail(path: Path, key: str, why: str) -> ParityError:
    return ParityError(f"{path}: {key}: {why}")


def _validate(path: Path, model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        kind = err["type"]
        if kind == "extra_forbidden":
            why = UNKNOWN
        elif kind == "missing":
            why = "required key is missing"
        else:
            why = err["msg"]
        more = f" (and {len(exc.errors()) - 1} more problem(s))" if len(exc.errors()) > 1 else ""
        key = _loc(err["loc"])
        if prefix:  # an entry validated on its own: its key within the file
            key = prefix if key == "(top level)" else f"{prefix}.{key}"
        raise _fail(path, key, why + more) from None
    except ExprError as exc:  # pragma: no cover - pydantic wraps validator errors
        raise _fail(path, "(expression)", str(exc)) from None


# --------------------------------------------------------------------------------------------
# Reading, extends and merging


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise _fail(path, "(syntax)", f"not valid TOML: {exc}") from None
    except OSError as exc:
        raise ParityError(f"{path}: cannot read adapter: {exc.strerror}") from None


def _check_keys(path: Path, value: Any, annotation: Any, loc: str, extra: tuple[str, ...] = ()) -> None:
    """Refuse keys the schema does not have anywhere in a (partial) table, before it is merged."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not isinstance(value, dict):
            return  # a wrong type: the schema says so once the adapter is merged
        for key, item in value.items():
            where = f"{loc}.{key}" if loc else key
            if key in extra:
                continue
            if key not in annotation.model_fields:
                raise _fail(path, where, UNKNOWN)
            _check_keys(path, item, annotation.model_fields[key].annotation, where)
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType) and isinstance(value, (dict, list)):
        for arg in args:
            if isinstance(value, dict) and isinstance(arg, type) and issubclass(arg, BaseModel):
                _check_keys(path, value, arg, loc)
                return
            if isinstance(value, list) and get_origin(arg) is list:  # alternatives (an [ops] entry)
                _check_keys(path, value, arg, loc)
                return
    elif origin is list and args and isinstance(value, list):
        for k, item in enumerate(value):
            _check_keys(path, item, args[0], f"{loc}[{k}]", PLACE if loc in KEYED else ())
    elif origin is dict and len(args) == 2 and isinstance(value, dict):
        for key, item in value.items():
            _check_keys(path, item, args[1], f"{loc}.{key}")


def _remove(path: Path, base: dict, remove: Any) -> dict:
    """The base without what the child's ``remove`` table names."""
    usage = "give a table: { KEY = true } or { KEY = [names, or hf patterns for norms/tensors/buffers] }"
    if not isinstance(remove, dict):
        raise _fail(path, "remove", usage)
    out = dict(base)
    for key, what in remove.items():
        if key not in out:
            raise _fail(path, f"remove.{key}", f"the base adapter has no {key!r} to remove")
        if what is True:
            del out[key]
            continue
        if not isinstance(what, list) or not all(isinstance(p, str) for p in what):
            raise _fail(path, f"remove.{key}", usage)
        if not isinstance(out[key], (dict, list)) or (isinstance(out[key], list) and key not in KEYED):
            raise _fail(path, f"remove.{key}", "only tables and [[norms]]/[[tensors]]/[[buffers]] lose single "
                        "entries; use `true` to remove the whole key")
        for pattern in what:
            named = [n for n in (out[key] if isinstance(out[key], dict) else [e.get("hf") for e in out[key]])
                     if isinstance(n, str) and fnmatch.fnmatchcase(n, pattern)]
            if not named:
                raise _fail(path, f"remove.{key}", f"{pattern!r} matches nothing in the base adapter's {key}")
            if isinstance(out[key], dict):
                out[key] = {k: v for k, v in out[key].items() if k not in named}
            else:
                out[key] = [e for e in out[key] if e.get("hf") not in named]
    return out


def _merge_entries(path: Path, key: str, base: list, child: Any) -> list:
    """A KEYED array: entries matched by ``hf`` replace the base's in place, new ones follow the one before. Two
    entries of the child may share an ``hf`` (one module serving two norms: Llama 4's qk_norm, for q and for k)."""
    if not isinstance(child, list) or not all(isinstance(e, dict) for e in child):
        raise _fail(path, key, f"must be an array of tables ([[{key}]])")
    out = list(base)
    mine: list[int] = []  # ids of the child's entries, which a later entry of the child does not replace

    def index(hf: Any) -> int | None:
        return next((n for n, e in enumerate(out) if e.get("hf") == hf and id(e) not in mine), None)

    def anchor_index(hf: Any) -> int | None:
        return next((n for n, e in enumerate(out) if e.get("hf") == hf), None)

    cursor = None  # where the next new entry goes: right after the previous entry of the child
    for k, entry in enumerate(child):
        entry = dict(entry)
        after, before = entry.pop("after", None), entry.pop("before", None)
        hf = entry.get("hf")
        if not isinstance(hf, str):
            raise _fail(path, f"{key}[{k}].hf", "required key is missing")
        if after is not None and before is not None:
            raise _fail(path, f"{key}[{k}]", "give 'after' or 'before', not both")
        at = index(hf)
        if after is not None or before is not None:
            if hf in (after, before):
                raise _fail(path, f"{key}[{k}]", "an entry cannot be placed next to itself")
            if at is not None:
                del out[at]
            anchor = anchor_index(after if after is not None else before)
            if anchor is None:
                raise _fail(path, f"{key}[{k}].{'after' if after is not None else 'before'}",
                            f"no {key} entry of the base (or listed before this one) has hf {after or before!r}")
            at = anchor + 1 if after is not None else anchor
            out.insert(at, entry)
        elif at is not None:
            out[at] = entry
        elif cursor is None:
            at = len(out)
            out.append(entry)
        else:
            at = cursor
            out.insert(at, entry)
        mine.append(id(entry))
        cursor = at + 1
    return out


def _merge(path: Path, base: dict, child: dict) -> dict:
    out = dict(base)
    for key, value in child.items():
        if key in KEYED:
            out[key] = _merge_entries(path, key, base.get(key, []), value)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = {**base[key], **value}
        else:
            out[key] = value
    return out


class _Loader:
    """Loads adapter files, each once, resolving ``extends`` against the directories searched before them."""

    def __init__(self, dirs: list[Path] | None):
        self._dirs = dirs
        self._done: dict[Path, tuple[dict, Adapter]] = {}

    @property
    def dirs(self) -> list[Path]:
        if self._dirs is None:  # a lone file: beside it, then the environment's and the built-in adapters
            self._dirs = search_path()
        return self._dirs

    def load(self, path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict, Adapter]:
        key = path.resolve()
        if key not in self._done:
            data = _read(path)
            _check_keys(path, {k: v for k, v in data.items() if k not in DIRECTIVES}, AdapterFile, "")
            bases: tuple[Path, ...] = ()
            if any(k in data for k in DIRECTIVES):
                data, bases = self._extend(path, data, (*chain, key))
            spec = _validate(path, AdapterFile, data)
            _check_semantics(spec, path)
            self._done[key] = (data, Adapter(spec, path, bases))
        return self._done[key]

    def _extend(self, path: Path, data: dict, chain: tuple[Path, ...]) -> tuple[dict, tuple[Path, ...]]:
        data = dict(data)
        name, remove = data.pop("extends", None), data.pop("remove", None)
        if name is None:
            raise _fail(path, "remove", "only an adapter that extends another removes from it; add extends = NAME")
        if not isinstance(name, str) or not name:
            raise _fail(path, "extends", "must be an adapter's name (a string), e.g. extends = \"llama\"")
        for key in OWN:
            if key not in data:
                raise _fail(path, key, f"an adapter that extends another gives its own {key!r} (it is never inherited)")
        for key in KEYED:
            for k, entry in enumerate(data.get(key) or []):
                if isinstance(entry, dict):
                    model = get_args(AdapterFile.model_fields[key].annotation)[0]
                    _validate(path, model, {n: v for n, v in entry.items() if n not in PLACE}, f"{key}[{k}]")
        base_path = self._find(path, name)
        if base_path.resolve() in chain:
            cycle = " -> ".join([*(p.stem for p in chain[chain.index(base_path.resolve()):]), base_path.stem])
            raise _fail(path, "extends", f"{name!r} leads back to this file ({cycle}); an adapter cannot extend "
                        f"itself, directly or through others: remove one of these 'extends'")
        base_data, base = self.load(base_path, chain)
        if remove is not None:
            base_data = _remove(path, base_data, remove)
        return _merge(path, base_data, data), (base_path, *base.bases)

    def _find(self, path: Path, name: str) -> Path:
        """NAME.toml beside the file, else in the nearest directory searched before the file's own."""
        here = path.parent.resolve()
        resolved = [d.resolve() for d in self.dirs]
        before = self.dirs[: resolved.index(here)] if here in resolved else self.dirs
        candidates = [path.parent, *reversed(before)]
        for d in candidates:
            found = d / f"{name}.toml"
            if found.is_file() and found.resolve() != path.resolve():
                return found
        known = sorted({p.stem for d in candidates for p in d.glob("*.toml") if p.resolve() != path.resolve()})
        raise _fail(path, "extends", f"no adapter named {name!r} beside this file or among those searched before it; "
                    f"name one of: {', '.join(known) or '(none)'}")


# --------------------------------------------------------------------------------------------
# Validation beyond the schema


def derive_order(derive: dict[str, Param], path: Path | None = None) -> list[str]:
    """``[derive]`` names in evaluation order: each after the derived names its expressions use, file order
    otherwise (so an adapter that extends another may add or redefine any of them)."""
    uses = {name: {n for src in (p.expr, p.default_expr) if src for n in free_names(src)} & derive.keys() - {name}
            for name, p in derive.items()}
    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in stack:
            raise ParityError(f"{path}: derive.{name}: depends on itself ({' -> '.join([*stack, name])})")
        for used in (n for n in derive if n in uses[name]):
            visit(used, (*stack, name))
        order.append(name)

    for name in derive:
        visit(name, ())
    return order


def _check_choices(spec: AdapterFile, path: Path) -> None:
    for section in SECTIONS:
        for key, value in getattr(spec, section):
            choices = CHOICES.get(f"{section}.{key}")
            if choices is None:
                continue
            if isinstance(value, Param):
                for mapped in (value.map or {}).values():
                    if mapped not in choices:
                        raise _fail(path, f"{section}.{key}.map", f"{mapped!r} is not one of {', '.join(choices)}")
                if value.key is not None and value.default is not None and value.map is None and value.default not in choices:
                    raise _fail(path, f"{section}.{key}.default", f"{value.default!r} is not one of {', '.join(choices)}")
            elif value not in choices:
                raise _fail(path, f"{section}.{key}", f"{value!r} is not one of {', '.join(choices)}")


def _check_semantics(spec: AdapterFile, path: Path) -> None:
    if spec.family != path.stem:
        raise _fail(path, "family", f"{spec.family!r} must match the file name {path.stem!r}")
    _check_choices(spec, path)
    derive_order(spec.derive, path)
    for k, norm in enumerate(spec.norms):
        if norm.neutral not in names.NORMS:
            raise _fail(path, f"norms[{k}].neutral", f"{norm.neutral!r} is not a neutral norm name (parity/names.py)")
        for source in (norm.dim, norm.when, norm.eps):
            _check_expr(path, f"norms[{k}]", source)
    for k, t in enumerate(spec.tensors):
        targets = [t.neutral] if isinstance(t.neutral, str) else t.neutral
        for target in targets:
            if target not in names.TENSORS:
                raise _fail(path, f"tensors[{k}].neutral", f"{target!r} is not a neutral tensor name (parity/names.py)")
            if ("{e}" in target) != (t.experts is not None):
                raise _fail(path, f"tensors[{k}].experts", "give 'experts' exactly when the neutral name has {e}")
        if len(targets) > 1 and t.split is None and not t.unstack:
            raise _fail(path, f"tensors[{k}].neutral", "several neutral names need a 'split'")
        if t.split is not None and len(t.split.sizes) != len(targets):
            raise _fail(path, f"tensors[{k}].split.sizes", f"{len(t.split.sizes)} sizes for {len(targets)} neutral names")
        if t.split is not None and t.split.interleaved and len(set(t.split.sizes)) != 1:
            raise _fail(path, f"tensors[{k}].split.sizes", "an interleaved split takes equal sizes (one expression)")
        for source in [*t.shape, t.when, t.experts, *(t.split.sizes if t.split else []),
                       *([t.split.groups] if t.split and t.split.groups else [])]:
            _check_expr(path, f"tensors[{k}]", source)
    for k, b in enumerate(spec.buffers):
        _check_expr(path, f"buffers[{k}]", b.when)
    if not any(spec.tiny.architecture in v.architectures for v in spec.variants):
        raise _fail(path, "tiny.architecture", f"{spec.tiny.architecture!r} is not one of the variants' architectures")
    for key, source in spec.tiny.expr.items():
        _check_expr(path, f"tiny.expr.{key}", source)
    for point in names.CAPTURE_POINTS:
        if point not in spec.capture:
            raise _fail(path, f"capture.{point}", "required capture point is missing")
    for point, where in spec.capture.items():
        if point not in names.CAPTURE_POINTS and not any(point.startswith(p + ".") for p in names.CAPTURE_POINTS):
            raise _fail(path, f"capture.{point}", f"not a capture point; use one of {', '.join(names.CAPTURE_POINTS)}")
        _check_expr(path, f"capture.{point}", where.when)
    for point, entry in spec.ops.items():
        if point not in names.OP_POINTS:
            raise _fail(path, f"ops.{point}", f"not an operation-level point; use one of {', '.join(names.OP_POINTS)}")
        for where in entry if isinstance(entry, list) else [entry]:
            for source in [where.when, *(where.slice or []), *([where.groups] if where.groups else [])]:
                _check_expr(path, f"ops.{point}", source)


def _check_expr(path: Path, key: str, source: str | None) -> None:
    if source is None:
        return
    try:
        compile_expr(source)
    except ExprError as exc:
        raise _fail(path, key, str(exc)) from None


# --------------------------------------------------------------------------------------------
# Where adapters are found


def load_adapter(path: os.PathLike | str, dirs: Iterable[os.PathLike | str] | None = None) -> Adapter:
    """Read and validate one adapter file; errors name the file and the key.

    An adapter that ``extends`` another finds it beside itself, then in ``dirs`` searched before its own
    directory (default: the built-in adapters and $PARITY_ADAPTERS, as :func:`search_path`).
    """
    return _Loader(None if dirs is None else [Path(d) for d in dirs]).load(Path(path))[1]


def builtin_dir() -> Path:
    """The adapters shipped with parity: inside the wheel, or the repository's adapters/."""
    here = Path(__file__).resolve().parents[1]  # the parity package
    for candidate in (here / "adapters", here.parent / "adapters"):
        if candidate.is_dir():
            return candidate
    raise ParityError(f"parity's built-in adapters are missing (looked in {here / 'adapters'}); reinstall parity")


def search_path(extra: Iterable[os.PathLike | str] = ()) -> list[Path]:
    """Directories searched for adapters, lowest priority first.

    Built-in adapters, then each directory in $PARITY_ADAPTERS (os.pathsep-separated), then
    ``--adapters`` directories: a later file with the same family name overrides an earlier one.
    """
    dirs = [builtin_dir()]
    env = os.environ.get(ENV_VAR, "")
    dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs += [Path(p) for p in extra]
    for d in dirs[1:]:
        if not d.is_dir():
            raise ParityError(f"adapter directory {d} does not exist; fix --adapters or ${ENV_VAR}")
    return dirs


def load_all(extra: Iterable[os.PathLike | str] = ()) -> dict[str, Adapter]:
    """Every adapter on the search path, by family name."""
    dirs = search_path(extra)
    loader = _Loader(dirs)
    found: dict[str, Adapter] = {}
    for d in dirs:
        for path in sorted(d.glob("*.toml")):
            adapter = loader.load(path)[1]
            found[adapter.family] = adapter
    return dict(sorted(found.items()))
