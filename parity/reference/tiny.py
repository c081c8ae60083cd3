"""Tiny, deterministic test checkpoints built with transformers' own model classes.

Initial weights hide conventions: Gemma's norm weights start at 0 (so ``1 + w`` is 1 and a port
that drops the 1 is wrong by exactly the thing an init hides), biases start at 0, and 0.02-std
projections make every layer's contribution vanish. So every constant-initialised tensor (norm
weights and biases, scalars, router scales) is moved away from its initial value, projections get
a 1/sqrt(fan_in) scale so each layer changes the stream, and embeddings stay at std 0.02 where
eps matters. The adapter's ``[tiny]`` table makes softcaps bite and windows short.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import PreTrainedTokenizerFast

from parity.adapter import Adapter
from parity.adapter.expr import evaluate
from parity.checkpoint import open_checkpoint
from parity.errors import ParityError
from parity.neutral.converter import build_manifest
from parity.neutral.model import Manifest
from parity.storage import atomic

VOCAB = 256  # one token per byte: a real, offline tokenizer with no files to fetch
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hidden_key(adapter: Adapter) -> str:
    """The config key of the hidden size: the name in the embedding's shape (or the [derive] key behind it)."""
    spec = adapter.spec
    name = next(t.shape[1] for t in spec.tensors if t.neutral == "embed.tokens.weight").strip()
    return spec.derive[name].keys[0] if name in spec.derive and spec.derive[name].keys else name


def tiny_config(adapter: Adapter, layers: int | None = None, width: int | None = None) -> tuple[str, dict]:
    """The (architecture, config kwargs) make-tiny builds for a family; ``width`` widens the hidden size."""
    tiny = adapter.spec.tiny
    num_layers = tiny.layers if layers is None else layers
    if num_layers < 1:
        raise ParityError(f"--layers must be at least 1 (got {num_layers})")
    layer_key = adapter.spec.derive["num_layers"].keys[0]
    config = {"vocab_size": VOCAB, **SPECIAL_IDS, **tiny.config, layer_key: num_layers}
    if width is not None:
        config[hidden_key(adapter)] = width
    for key, source in tiny.expr.items():
        config[key] = evaluate(source, {**config, "num_layers": num_layers})
    return tiny.architecture, config


def build_model(adapter: Adapter, layers: int | None = None, seed: int = 0, *, width: int | None = None,
                architecture: str | None = None, overrides: dict | None = None) -> torch.nn.Module:
    """The tiny model of a family, randomised; ``architecture``/``overrides`` build other forms of it."""
    transformers.utils.logging.disable_progress_bar()
    default_arch, kwargs = tiny_config(adapter, layers, width)
    architecture = architecture or default_arch
    model_cls = getattr(transformers, architecture)
    config = model_cls.config_class(**{**kwargs, **(overrides or {})})
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomise(model, seed)
    return model


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Move constant-initialised tensors off their init; give projections a 1/sqrt(fan_in) scale."""
    gen = torch.Generator().manual_seed(seed + 1)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or t.numel() == 0 or id(t) in embeddings:
                continue
            flat = t.reshape(-1)
            if bool((flat == flat[0]).all()):
                # constant init (norm weight 1 or 0, bias 0, a scalar): move it, keep its sign
                noise = torch.empty(t.shape).uniform_(-0.5, 0.5, generator=gen)
                t.copy_(t + noise.to(t.dtype))
            elif t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1]))


def _tokenizer():
    byte_chars = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte-to-unicode table ordered by byte value, so that token id == byte value
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(VOCAB)}
    assert set(vocab) == set(byte_chars)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096)


def _bytes_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def make_tiny(adapter: Adapter, out: Path, *, layers: int | None = None, seed: int = 0, width: int | None = None,
              dtype: str = "float32", force: bool = False) -> Path:
    """Write a tiny checkpoint of ``adapter``'s family to ``out`` (atomically)."""
    if dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    model = build_model(adapter, layers, seed, width=width).to(DTYPES[dtype])
    with atomic.output_dir(Path(out), force=force) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        _tokenizer().save_pretrained(tmp)
        # drop run-specific noise so that the same seed gives the same bytes
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return Path(out)


def tiny_manifest(adapter: Adapter, width: int | None = None) -> Manifest:
    """The neutral manifest of the family's tiny checkpoint (``width``: its hidden size widened), from its config
    alone (no weights built)."""
    architecture, kwargs = tiny_config(adapter, width=width)
    config = getattr(transformers, architecture).config_class(**kwargs).to_dict()
    config["architectures"] = [architecture]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        ckpt = open_checkpoint(Path(tmp), adapters={adapter.family: adapter})
        return build_manifest(ckpt, torch.float32, ckpt.resolved["positions.rope_style"])
