"""Engine dumps: a safetensors file of capture points an engine wrote (docs/dumps.md; the format is parity.dumps)."""

from __future__ import annotations

from ..dumps import (  # noqa: F401 - the kind's protocol
    dump_decoder as make_decoder, dump_runner as make_runner, is_dump as detect)

KIND = "dump"
