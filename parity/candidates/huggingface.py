"""Hugging Face checkpoints as candidates: another checkpoint (a re-save, a merge, a port back to transformers)
run by transformers like the reference, with its own model instance and hooks."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import inventory, open_checkpoint, refuse_mismatched, weight_files
from ..models import Models, hf_decoder, hf_runner

KIND = "transformers"
ISOLATES = True  # pre-hooks replace each layer's input


def detect(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def validate(path: Path, adapter_dirs=()) -> None:
    """Refused before anything is loaded: an unknown family, or tensors that do not match the config."""
    refuse_mismatched(open_checkpoint(Path(path), adapter_dirs), "--candidate")


def make_runner(models: Models, path: Path, dtype: torch.dtype, ids: torch.Tensor, feed, ckpt):
    return hf_runner(models, open_checkpoint(Path(path), models.adapter_dirs), dtype, ids, feed, "candidate",
                     last=models.options.get("last"))


def make_decoder(models: Models, path: Path, dtype: torch.dtype, ids: torch.Tensor, tokens: list[int], ckpt):
    """Decoded with transformers' own cache classes (the cache its config asks for), which checks them too."""
    return hf_decoder(models, open_checkpoint(Path(path), models.adapter_dirs), dtype, ids, tokens)


def shapes(path: Path, adapter_dirs=()) -> list:
    return [info.shape for info in inventory(weight_files(Path(path))).values()]
