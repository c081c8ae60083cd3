"""JSON descriptions: reading one, and checking it against its schema, each refused with one line.

Every JSON file parity reads (a config.json, a safetensors index, a neutral manifest, a golden description, an
--inputs file, a report to merge) goes through ``read_json``; every JSON description with a schema is a
``StrictSpec`` checked with ``check_schema``. A refusal is one ParityError line: ``{where}: {problem}; {fix}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from parity.errors import ParityError

Model = TypeVar("Model", bound=BaseModel)

# What json.loads raises on text that is not JSON: JSONDecodeError and UnicodeDecodeError are ValueErrors, and
# deeply nested arrays exhaust the recursion limit
NOT_JSON = (ValueError, RecursionError)


def read_json(path: Path, fix: str, *, where: str | None = None) -> Any:
    """The JSON value a UTF-8 file holds. ``where`` names the file in a refusal (default: its path); ``fix`` says
    what to do about it."""
    where = str(path) if where is None else where
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except NOT_JSON as exc:
        raise ParityError(f"{where}: not valid JSON ({str(exc)[:160]}); {fix}") from None
    except OSError as exc:
        raise ParityError(f"{where}: cannot be read ({exc.strerror or exc}); {fix}") from None


class StrictSpec(BaseModel):
    """A JSON description's schema: no coercion ("4" is not 4, true is not 1); keys it does not name are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


def validation_problem(exc: ValidationError) -> str:
    """pydantic's first error as 'where: what (got value)', with a count of the others."""
    errors = exc.errors()
    err = errors[0]
    where = ".".join(str(part) for part in err["loc"])
    got = "" if err["type"] == "missing" else f" (got {json.dumps(err['input'], default=str)[:40]})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {err['msg'][:120]}{got}{more}"


def check_schema(spec: type[Model], value: Any, where: Path | str, fix: str) -> Model:
    """``value`` as its schema reads it; refused where the schema rejects it: '{where}: {the first problem}; {fix}'."""
    try:
        return spec.model_validate(value)
    except ValidationError as exc:
        raise ParityError(f"{where}: {validation_problem(exc)}; {fix}") from None
