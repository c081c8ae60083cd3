"""The tables of docs/design.md, read by the tests that hold the code to them."""

from __future__ import annotations

import re
from pathlib import Path

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def table(section: str) -> list[list[str]]:
    """The rows of the first table under the heading ``section`` (any level), each a list of its cells as
    written (backticks kept), the header and its rule left out."""
    text = DESIGN.read_text(encoding="utf-8")
    found = re.search(rf"^#+ {re.escape(section)}\n(.*?)(?=^#|\Z)", text, re.M | re.S)
    assert found, f"docs/design.md has no section {section!r}"
    lines = [line for line in found.group(1).splitlines() if line.startswith("|")]
    assert len(lines) > 2, f"docs/design.md, {section}: no table"
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


def plain(cell: str) -> str:
    """A cell without its backticks."""
    return cell.replace("`", "")
