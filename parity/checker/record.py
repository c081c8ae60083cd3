"""``parity golden record``: run the reference (and its calibration twins, parity.checker.noise) and store its
capture points as a golden (parity.reference.golden holds the format and reads it back)."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import transformers

from parity import __version__, dumps
from parity.checker.noise import Twin
from parity.checkpoint import Checkpoint, open_checkpoint
from parity.checkpoint.inputs import Prompts
from parity.compare import Tolerances, metrics
from parity.errors import ParityError
from parity.reference.decode import decodes, greedy, prompt_length, uncached_steps
from parity.reference.golden import (
    DESCRIPTION,
    FORMAT,
    FORMAT_VERSION,
    STORAGE,
    Golden,
    checkpoint_sha256,
    is_golden,
    open_golden,
    select_points,
)
from parity.reference.models import DTYPES, Models, Stream, hf_runner, layer_inputs, would_not_fit
from parity.reference.structure import discover
from parity.storage import atomic


def _capture(models: Models, ckpt: Checkpoint, ids: torch.Tensor, points: list[str], dtype: str,
             calibrate: bool, storage: torch.dtype) -> tuple[dict, dict]:
    """Run the reference (and its calibration twins); returns (stored tensors, per-point description)."""
    wanted = set(points)
    ref = Stream(hf_runner(models, ckpt, torch.float32, ids, points=wanted), "reference")
    other = torch.float64 if dtype == "float32" else DTYPES[dtype]
    noisy = Twin(models, ckpt, other, ids, wanted) if calibrate else None
    # where the golden can feed isolated checks (it holds every layer's input), measure their noise too: the
    # twin's layers fed the float32 reference's inputs, as an isolated check will be
    input_of = layer_inputs(ckpt.resolved.num_layers)
    isolated = (Twin(models, ckpt, other, ids, wanted, fed=set(input_of.values()), role="calibration (isolated)",
                     label="isolated calibration") if calibrate and set(input_of) <= wanted else None)
    tolerances = Tolerances(dtype)
    tensors, info = {}, {}
    try:
        for name in points:
            x = ref.get(name)
            if x is None:
                raise ParityError(f"{ckpt.path}: the reference never produced {name}; fix the adapter's capture map")
            if isolated is not None and name in input_of:
                isolated.feed_layer(input_of[name], x)
            kept = x.to(storage).contiguous()
            if torch.isfinite(x).all() and not torch.isfinite(kept).all():
                raise ParityError(f"{name} exceeds {str(storage).removeprefix('torch.')}'s range (max |x| "
                                  f"{x.abs().max().item():.4g}); record with --storage float32")
            rounding = metrics(kept, x)["rel_l2"]
            entry = {"shape": list(x.shape), "storage_rel_l2": rounding}
            if noisy is not None:
                noise = noisy.of(0, name, x)[0]
                entry.update(noise=noise, tolerance=asdict(tolerances.for_point(name, noise, rounding)))
            if isolated is not None:
                entry.update(noise_isolated=isolated.of(0, name, x)[0])
            tensors[name], info[name] = kept, entry
    except BaseException:  # an error, Ctrl-C: the threads are told to end, and not waited for
        _stop(ref, noisy, isolated, wait=False)
        raise
    _stop(ref, noisy, isolated, wait=True)
    return tensors, info


def _stop(ref: Stream, *twins, wait: bool) -> None:
    ref.stop(wait)
    for twin in twins:
        if twin is not None:
            twin.close(wait)


def record(reference: Path, out: Path, *, prompts: Prompts = Prompts(), dtype: str = "float32", points: str = "all",
           calibrate: bool = False, storage: str = "float32", force: bool = False, adapter_dirs=(),
           progress: Callable[[str], None] | None = None, decode: int = 0) -> Golden:
    """Run the reference checkpoint with transformers and store its capture points as a golden at ``out``.
    ``decode`` N also stores the first input's greedy continuation (N tokens) and each decode step's points (the
    uncached forward at its position, ``decode.{point}`` [1, N, width]): an engine's decode path is then checked
    against the golden (``check --decode N``) without transformers."""
    say = progress or (lambda message: None)
    if dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if storage not in STORAGE:
        raise ParityError(f"--storage {storage!r} is not one of {', '.join(STORAGE)}")
    if is_golden(Path(reference)):
        raise ParityError(f"{reference} is a golden; record from the Hugging Face checkpoint it was recorded from")
    ckpt = open_checkpoint(Path(reference), adapter_dirs, discover=discover)
    if not ckpt.has_weights:
        raise ParityError(f"{reference}: no weights; give a Hugging Face checkpoint directory")
    selected = select_points(ckpt, points)
    if isinstance(decode, bool) or not isinstance(decode, int) or decode < 0:
        raise ParityError(f"--decode must be a number of steps >= 0 (got {decode!r})")
    if decode and not decodes(ckpt):
        raise ParityError(f"--decode: a {ckpt.resolved.family} model is not a causal language model; drop --decode")
    # with --decode and no input given, a prompt that decoding takes across each sliding window
    all_inputs = prompts.select(ckpt, prompt_length(ckpt, decode) if decode and not prompts.given else None)
    say("hashing the checkpoint")
    runs = []
    description = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "family": ckpt.resolved.family, "architecture": ckpt.variant.architectures[0],
        "dtype": dtype, "storage": storage, "points": points, "calibrated": calibrate,
        "checkpoint": {"path": str(reference), "sha256": checkpoint_sha256(ckpt), "config": ckpt.config},
        "recorded_with": {"parity": __version__, "torch": torch.__version__,
                          "transformers": transformers.__version__, "python": platform.python_version()},
        "capture_points": selected,
        "runs": runs,
    }
    # a reference too big to hold whole (with its calibration twin) is read a layer at a time
    models = Models(stream=would_not_fit(ckpt, dtype, calibrate, "cpu"))
    with atomic.output_dir(Path(out), force=force) as tmp:
        for k, inputs in enumerate(all_inputs):
            say(f"running the reference on input {k + 1} of {len(all_inputs)}")
            tensors, info = _capture(models, ckpt, inputs.ids, selected, dtype, calibrate, STORAGE[storage])
            tokens, decoded = None, {}
            if decode and k == 0:  # a check decodes its first input
                say(f"decoding {decode} tokens")
                tokens = greedy(models, ckpt, inputs.ids, decode)
                steps = uncached_steps(models, ckpt, inputs.ids, tokens, set(selected))
                stepped = {}
                for name in selected:
                    kept = steps[name].to(STORAGE[storage]).contiguous()
                    tensors[f"{dumps.DECODE}{name}"] = kept
                    stepped[name] = {"shape": list(kept.shape), "storage_rel_l2": metrics(kept, steps[name])["rel_l2"]}
                decoded = {"decode": {"tokens": tokens, "points": stepped}}
            file = "activations.safetensors" if k == 0 else f"activations.{k}.safetensors"
            dumps.write_dump(tmp / file, tensors, inputs.ids, decode_tokens=tokens)
            runs.append({"source": inputs.source, "ids": inputs.ids[0].tolist(), "points": info, **decoded,
                         "file": file})
        (tmp / DESCRIPTION).write_text(json.dumps(description, indent=1) + "\n")
    return open_golden(Path(out), adapter_dirs)


