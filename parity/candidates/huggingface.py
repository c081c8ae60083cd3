"""Hugging Face checkpoints as candidates: another checkpoint (a re-save, a merge, a port back to transformers)
run by transformers like the reference, with its own model instance and hooks."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import inventory, open_checkpoint, refuse_mismatched, weight_files
from ..models import hf_decoder, hf_runner

KIND = "transformers"
ALIASES = ("hf", "huggingface")
ISOLATES = True     # pre-hooks replace each layer's input
OPTIONS = ("last",)  # a slice stops after its last layer


def detect(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def validate(path: Path, adapter_dirs=()) -> None:
    """Refused before anything is loaded: an unknown family, or tensors that do not match the config."""
    refuse_mismatched(open_checkpoint(Path(path), adapter_dirs), "--candidate")


def make_runner(candidate, ids: torch.Tensor, feed):
    ckpt = open_checkpoint(Path(candidate.path), candidate.models.adapter_dirs)
    return hf_runner(candidate.models, ckpt, candidate.dtype, ids, feed, "candidate", last=candidate.options.last)


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """Decoded with transformers' own cache classes (the cache its config asks for), which checks them too."""
    return hf_decoder(candidate.models, open_checkpoint(Path(candidate.path), candidate.models.adapter_dirs), candidate.dtype, ids, tokens)


def shapes(path: Path, adapter_dirs=()) -> list:
    return [info.shape for info in inventory(weight_files(Path(path))).values()]
