"""Hugging Face checkpoints as candidates: another checkpoint (a re-save, a merge, a port back to transformers)
run by transformers like the reference, with its own model instance and hooks.

``--candidate-attn sdpa|flex_attention|flash_attention_2|eager`` runs the candidate with that attention kernel of
transformers (the reference stays eager), and ``--compile`` runs it under torch.compile: transformers' own kernels
checked as candidates (``--reference M --candidate M --candidate-attn sdpa``). A kernel that cannot express a
convention the config asks for is refused with the reason (KERNEL_LIMITS); one that drops it silently (a
kernel registered with transformers' AttentionInterface) fails at the first layer it touches.

With ``options.ops`` (``--points ops``, a drill-down) it emits the adapter's operation-level points too: all of them
under eager; under another kernel those read at module inputs and outputs only (the queries, keys, scores and
probabilities are read from eager attention), and none under ``--compile`` (hooks inside compiled code would break
its graphs); the report is told which.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parity.candidates.weights import checkpoint
from parity.checkpoint import inventory, open_checkpoint, refuse_mismatched, weight_files
from parity.errors import ParityError
from parity.reference.capture import ATTENTION
from parity.reference.models import hf_decoder, hf_runner
from parity.reference.structure import discover

KIND = "transformers"
TAKES = "a Hugging Face checkpoint (config.json)"
ALIASES = ("hf", "huggingface")
ISOLATES = True     # pre-hooks replace each layer's input
GENERIC = True      # reads points by module path or name: checks a model no adapter knows
OPTIONS = ("last", "attn", "compile")  # a slice stops after its last layer; --candidate-attn, --compile

# What a kernel cannot compute, as (adapter setting, why): a property of the kernel and of the config value the
# setting resolves to, so that any family whose config sets it is refused, whatever its name.
KERNEL_LIMITS = {
    "sdpa": (("attention.softcap", "torch's scaled_dot_product_attention has no attention logit softcap "
                                   "(transformers refuses it: its sdpa path raises on a softcap)"),),
}


def detect(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def validate(path: Path, adapter_dirs=()) -> None:
    """Refused before anything is loaded: an unknown family, or tensors that do not match the config."""
    refuse_mismatched(open_checkpoint(Path(path), adapter_dirs, discover=discover), "--candidate")


def kernels() -> list[str]:
    """The attention implementations transformers here can be asked for by name: eager and those registered with
    its AttentionInterface (sdpa, flex_attention, flash_attention_*, and any a user registered)."""
    from transformers import AttentionInterface  # heavy: transformers

    names = ["eager"] + [k for k in AttentionInterface._global_mapping if not k.startswith("paged|") and k != ATTENTION]
    return list(dict.fromkeys(names))


def check_options(options, ckpt, stream: bool) -> None:
    """Refused when the plan is made, before any model loads: an unknown kernel name, a hub kernel (``org/repo``:
    code downloaded and run, as trust_remote_code would), a convention the kernel cannot express, a compile of a
    model streamed a layer at a time."""
    attn, compile = options.attn or "eager", bool(options.compile)
    if "/" in attn:
        raise ParityError(f"--candidate-attn {attn}: a kernel from the Hugging Face hub runs downloaded code; "
                          f"parity runs only kernels installed here: {', '.join(kernels())}")
    if attn not in kernels():
        raise ParityError(f"--candidate-attn {attn!r} is not an attention implementation of transformers here; "
                          f"expected one of {', '.join(kernels())}")
    for setting, why in KERNEL_LIMITS.get(attn, ()):
        r = ckpt.resolved
        values = {r.layer(setting, i) for i in range(r.num_layers)} - {None, False, 0}
        if values:
            source = r.settings[setting].source
            raise ParityError(f"--candidate-attn {attn}: this {r.family} model sets {setting} = "
                              f"{', '.join(map(str, sorted(values)))} (from {source}), and {why}; use eager or a "
                              f"kernel that applies it (flex_attention, flash_attention_2)")
    if compile and stream:
        raise ParityError("--compile: a model streamed a layer at a time cannot be compiled; add --no-stream")


def kernel(candidate, ckpt) -> tuple[str, bool]:
    """The candidate's (attention implementation, compiled), refused where it cannot run (check_options: the plan
    asks first), with a note where the kernel is given no mask."""
    check_options(candidate.options, ckpt, candidate.models.stream)
    attn, compile = candidate.options.attn or "eager", bool(candidate.options.compile)
    from transformers.masking_utils import AttentionMaskInterface  # heavy: transformers

    if attn not in AttentionMaskInterface._global_mapping:  # transformers then passes attention_mask=None
        candidate.notes.warn(f"attention kernel {attn} has no mask function registered with transformers' "
                             f"AttentionMaskInterface: it is given no mask, and must apply causality and any "
                             f"sliding window itself")
    return attn, compile


def _built(run, attn: str, compile: bool):
    """``run``, with torch.compile's failures to build a kernel here (flex_attention's and --compile's code is
    generated and compiled on first use) said in one line: no verdict, the kernel never ran."""
    if attn == "eager" and not compile:
        return run

    def guarded(*args):
        try:
            return run(*args)
        except Exception as exc:  # noqa: BLE001 - torch._dynamo / torch._inductor wrap a compiler's error
            if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            raise ParityError(f"torch.compile could not build the candidate's code here (--candidate-attn {attn}"
                              f"{', --compile' if compile else ''}): {type(exc).__name__}: {first[:160]}; use "
                              f"another --candidate-attn or drop --compile") from None

    return guarded


def points(candidate, ckpt, attn: str, compile: bool) -> set[str] | None:
    """What the candidate emits: every capture point (None), and with ``options.ops`` the ops it can read."""
    if not candidate.options.ops:
        return None
    ops = ckpt.resolved.ops
    if compile:
        candidate.notes.warn("--compile: the transformers candidate emits no operation-level points (hooks inside "
                             "compiled code would break its graphs)")
        ops = []
    elif attn != "eager":
        if any(o.io == "attention" for o in ops):
            candidate.notes.warn(f"--candidate-attn {attn}: the transformers candidate emits no queries, keys, "
                                 f"scores or probabilities after RoPE (they are read from eager attention only)")
        ops = [o for o in ops if o.io != "attention"]
    return {c.name for c in ckpt.resolved.capture} | {o.name for o in ops}


def make_runner(candidate, ids: torch.Tensor, feed):
    ckpt = open_checkpoint(Path(candidate.path), candidate.models.adapter_dirs, discover=discover)
    attn, compile = kernel(candidate, ckpt)
    return _built(hf_runner(candidate.models, ckpt, candidate.dtype, ids, feed, "candidate",
                            points=points(candidate, ckpt, attn, compile), last=candidate.options.last, attn=attn,
                            compile=compile), attn, compile)


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """Decoded with transformers' own cache classes (the cache its config asks for), which checks them too."""
    ckpt = open_checkpoint(Path(candidate.path), candidate.models.adapter_dirs, discover=discover)
    attn, compile = kernel(candidate, ckpt)
    return _built(hf_decoder(candidate.models, ckpt, candidate.dtype, ids, tokens, attn=attn, compile=compile,
                             points=points(candidate, ckpt, attn, compile)), attn, compile)


def shapes(path: Path, adapter_dirs=()) -> list:
    return [info.shape for info in inventory(weight_files(Path(path))).values()]


def weights(path: Path, engine: dict | None = None):
    """Its tensors' dtypes, from the safetensors headers (a quantization_config names its scheme)."""
    return checkpoint(path)
