"""The same-weights reference every engine kind writes (``check --same-weights``, and the noise of a quantized
candidate's ``--calibrate``): an engine file's own weights read back, laid out as the checkpoint stores them, in a
Hugging Face directory beside the arithmetic the engine computes them with (parity.engines.arithmetic). Each
engine reads its weights its own way (its ``read_back``) and writes them here."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from parity.errors import ParityError

EXACT = 1e-6         # an unquantized tensor against the checkpoint's, rounded the same way


def neutral_map(stored: dict, source: str) -> dict:
    """neutral name -> (checkpoint name, its resolved tensor), for tensors that map one to one (``source``: the
    format read back, for the error)."""
    by_neutral = {}
    for hf_name, t in stored.items():
        if len(t.neutral) != 1 or t.transpose or t.unstack or t.split is not None:
            raise ParityError(f"--same-weights: {hf_name} is split, fused or transposed on its way to the neutral "
                              f"layout; reading it back from {source} is not supported (check without "
                              f"--same-weights: the plain check compares the file against the checkpoint)")
        by_neutral[t.neutral[0]] = (hf_name, t)
    return by_neutral


def write_reference(ckpt, out: Path, tensors: dict[str, torch.Tensor], arithmetic, untie: bool) -> None:
    """The reference directory: the tensors, the arithmetic (None: the engine computes in float32, as transformers
    does, and nothing is saved), the checkpoint's config (untied where the file stores the output matrix apart from
    the embeddings, e.g. quantized otherwise) and tokenizer."""
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if arithmetic is not None:
        arithmetic.save(out)
    config = json.loads(ckpt.config_path.read_text())
    if untie and config.get("tie_word_embeddings"):
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (ckpt.path / name).exists():
            (out / name).write_bytes((ckpt.path / name).read_bytes())
