"""Engine dumps: a safetensors file of capture points an engine wrote (docs/dumps.md; the format is parity.dumps)."""

from __future__ import annotations

from ..dumps import dump_runner as make_runner, is_dump as detect  # noqa: F401 - the kind's protocol

KIND = "dump"
