"""Reading Hugging Face checkpoint directories: config, safetensors inventory, tensor-map checks.

Only safetensors are read, and only their headers until a tensor is asked for; pickle-based
weights (``*.bin``, ``*.pt``) are refused, never unpickled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from parity.adapter import (
    Adapter,
    Resolved,
    ResolvedTensor,
    Variant,
    ignored,
    load_all,
    recognise,
    resolve,
    text_config,
)
from parity.errors import ParityError
from parity.storage.jsonfile import read_json
from parity.storage.quantization import FP8_DTYPES, BlockFP8, read_quantization, scale_name, scale_shape
from parity.storage.shards import plain_file_name, read_header

# (config, its file's name[, a checkpoint's tensors]) -> a generated adapter, or None
# (parity.reference.structure.discover)
Discover = Callable[..., Optional[Adapter]]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


# Well-known config keys and what they must hold (null is allowed: adapters give it a meaning). A wrong
# type here would otherwise surface deep inside an adapter expression, or not at all.
POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                 "head_dim", "intermediate_size", "max_position_embeddings", "n_embd", "n_head", "n_layer",
                 "n_positions", "n_ctx", "n_inner", "moe_intermediate_size", "n_routed_experts", "num_experts",
                 "num_local_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                 "v_head_dim", "global_head_dim", "num_global_key_value_heads", "n_group", "topk_group",
                 "top_k_experts", "original_max_position_embeddings")
COUNTS = ("qk_nope_head_dim", "n_shared_experts", "first_k_dense_replace", "num_kv_shared_layers",
          "hidden_size_per_layer_input", "vocab_size_per_layer_input", "type_vocab_size", "sliding_window")
NON_NEGATIVE_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "attn_logit_softcapping",
                        "final_logit_softcapping", "routed_scaling_factor")
POSITIVE_NUMBERS = ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "partial_rotary_factor",
                    "factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor")
STRINGS = ("model_type", "rope_type", "type")
ROPE_TABLES = ("rope_scaling", "rope_parameters")
TABLES = (*ROPE_TABLES, "text_config")
LAYER_COUNTS = ("num_hidden_layers", "n_layer")
MAX_LAYERS = 10_000  # far above any real model; a larger count is damage (and would take hours to resolve)


def read_config(path: Path) -> tuple[dict, Path]:
    """The config of a checkpoint directory or a bare config.json; returns (config, its path)."""
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.exists():
        if path.is_dir():
            raise ParityError(f"{path}: no config.json; give a Hugging Face checkpoint directory or a config.json")
        raise ParityError(f"{path}: no such file or directory")
    if not cfg_path.is_file():
        raise ParityError(f"{cfg_path}: not a file; give the checkpoint's config.json")
    config = read_json(cfg_path, "give the checkpoint's config.json")
    if not isinstance(config, dict):
        raise ParityError(f"{cfg_path}: expected a JSON object, found {type(config).__name__}")
    check_config(config, cfg_path)
    return config, cfg_path


def check_config(config: dict, cfg_path: Path, prefix: str = "") -> None:
    """Refuse well-known keys holding the wrong type, a non-positive size or a non-finite number."""
    def refuse(key: str, want: str) -> ParityError:
        return ParityError(f"{cfg_path}: {prefix}{key} must be {want} (got {json.dumps(config[key])[:60]}); "
                           f"fix the config")

    def integer(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def number(x) -> bool:
        return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)

    for key, value in config.items():
        if value is None:
            continue
        if key in POSITIVE_INTS and not (integer(value) and value > 0):
            raise refuse(key, "a positive integer")
        if key in COUNTS and not (integer(value) and value >= 0):
            raise refuse(key, "a non-negative integer")
        if key in LAYER_COUNTS and value > MAX_LAYERS:
            raise refuse(key, f"at most {MAX_LAYERS:,}")
        if key in NON_NEGATIVE_NUMBERS and not (number(value) and value >= 0):
            raise refuse(key, "a non-negative number")
        if key in POSITIVE_NUMBERS and not (number(value) and value > 0):
            raise refuse(key, "a positive number")
        if key in TABLES and not isinstance(value, dict):
            raise refuse(key, "a JSON object")
        if key == "architectures" and not (isinstance(value, list) and all(isinstance(a, str) for a in value)):
            raise refuse(key, "a list of class names")
        if key in STRINGS and not isinstance(value, str):
            raise refuse(key, "a string")
        if key == "text_config":
            check_config(value, cfg_path, f"{prefix}text_config.")
        if key in ROPE_TABLES:  # its parameters, or one table of them per layer type (Gemma 3/4)
            check_config(value, cfg_path, f"{prefix}{key}.")
            for kind, table in value.items():
                if isinstance(table, dict):
                    check_config(table, cfg_path, f"{prefix}{key}.{kind}.")


INDEX = "model.safetensors.index.json"


def read_index(directory: Path) -> dict[str, str] | None:
    """The weight map (tensor -> shard file name) of a sharded checkpoint, checked; None when unsharded."""
    index = Path(directory) / INDEX
    if not index.exists():
        return None
    fix = "fix it or save the checkpoint again with save_pretrained"
    data = read_json(index, fix)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map \
            or not all(isinstance(v, str) for v in weight_map.values()):
        raise ParityError(f"{index}: not a safetensors index (expected {{\"weight_map\": {{tensor: shard file}}}}); "
                          f"{fix}")
    # a shard is a file beside the index: a path (absolute, or through ..) would read outside the checkpoint
    odd = sorted({s for s in weight_map.values() if not plain_file_name(s)})
    if odd:
        raise ParityError(f"{index}: shard names must be file names in the checkpoint directory, not paths: "
                          f"{', '.join(map(repr, odd[:3]))}; {fix}")
    return weight_map


def inside(path: Path, directory: Path) -> bool:
    """Whether ``path``, symlinks followed, lies within ``directory`` (a symlink loop counts as outside)."""
    try:
        return Path(path).resolve().is_relative_to(Path(directory).resolve())
    except (OSError, RuntimeError):
        return False


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory ([] when it has no weights at all)."""
    directory = Path(directory)
    weight_map = read_index(directory)
    if weight_map is not None:
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise ParityError(f"{directory / INDEX}: names shard(s) that are not there: {', '.join(missing)}; "
                              f"copy them beside it")
        return [directory / s for s in shards]
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if files:
        return files
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ParityError(
            f"{directory}: holds only pickle weights ({', '.join(pickles)}); parity reads safetensors only and never "
            f"unpickles. Convert on a machine you trust, e.g. load with transformers and "
            f"save_pretrained(OUT, safe_serialization=True), then point parity at OUT"
        )
    return []


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    file: Path


def inventory(files: list[Path]) -> dict[str, TensorInfo]:
    """Name -> shape/dtype/file for every tensor, read from the (checked) headers only."""
    out: dict[str, TensorInfo] = {}
    for f in files:
        for name, entry in read_header(f).tensors.items():
            if name in out:
                raise ParityError(f"{f}: tensor {name} is also in {out[name].file.name}; a checkpoint holds each "
                                  f"tensor once")
            out[name] = TensorInfo(entry.shape, entry.dtype, f)
    return out


def check_index(directory: Path, tensors: dict[str, TensorInfo]) -> None:
    """Every tensor the index lists is in the shard it names."""
    weight_map = read_index(directory) or {}
    wrong = [f"{name} (index: {shard}, {'in ' + tensors[name].file.name if name in tensors else 'in no shard'})"
             for name, shard in weight_map.items() if name not in tensors or tensors[name].file.name != shard]
    if wrong:
        raise ParityError(f"{Path(directory) / INDEX}: {len(wrong)} tensor(s) not where the index says: "
                          f"{', '.join(wrong[:3])}; save the checkpoint again")


@dataclass
class TensorCheck:
    """How a checkpoint's tensors line up with the adapter's tensor map.

    Names in ``missing`` are the adapter's; every other list holds names as stored in the checkpoint.
    """

    prefix: str
    matched: int
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)       # saved buffers, not weights
    scales: list[str] = field(default_factory=list)        # FP8 block scales of quantized weights
    stored: dict[str, str] = field(default_factory=dict)   # adapter name -> name in the checkpoint (legacy names)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.wrong_shape)

    def problems(self) -> str:
        parts = []
        for label, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("wrong shape", self.wrong_shape)):
            if items:
                parts.append(f"{label} ({len(items)}): {', '.join(items)}")
        return "; ".join(parts)


def check_tensors(resolved: Resolved, tensors: dict[str, TensorInfo],
                  quantization: BlockFP8 | None = None) -> TensorCheck:
    """Every tensor accounted for, none missing, every shape as the config implies.

    Legacy names (``LayerNorm.gamma``) count as today's; a checkpoint holding both forms of one tensor keeps
    the current one and the legacy one is unexpected. Saved buffers are listed apart, and so are the block
    scales of a quantized checkpoint's FP8 weights (each of the shape its weight and block imply).
    """
    by_name: dict[str, str] = {}  # adapter-convention name -> stored name
    legacy: list[str] = []
    for name in sorted(tensors):
        canonical = resolved.canonical_name(name)
        if canonical != name and canonical in tensors:
            legacy.append(name)
        else:
            by_name[canonical] = name
    best: TensorCheck | None = None
    for prefix in resolved.variant.tensor_prefix:
        expected = resolved.tensor_map(prefix)
        buffers = resolved.buffer_map(prefix)
        check = TensorCheck(prefix, matched=len(expected.keys() & by_name.keys()), unexpected=list(legacy))
        quantized: set[str] = set()
        for name, t in expected.items():
            if name not in by_name:
                check.missing.append(name)
                continue
            stored = by_name[name]
            check.stored[name] = stored
            if tensors[stored].shape != t.shape:
                check.wrong_shape.append(f"{stored} {list(tensors[stored].shape)} (expected {list(t.shape)})")
            if quantization is not None and tensors[stored].dtype in FP8_DTYPES:
                scale = scale_name(stored)
                want = scale_shape(t.shape, quantization.block)
                if scale not in tensors:
                    check.missing.append(scale)
                elif tensors[scale].shape != want:
                    check.wrong_shape.append(f"{scale} {list(tensors[scale].shape)} (expected {list(want)} for "
                                             f"{quantization.block[0]}x{quantization.block[1]} blocks)")
                quantized.add(scale)
        for name in sorted(by_name.keys() - expected.keys()):
            stored = by_name[name]
            if stored in quantized:
                check.scales.append(stored)
            elif name in buffers:
                check.buffers.append(stored)
            elif ignored(stored, resolved.variant, resolved.env):
                check.ignored.append(stored)
            else:
                check.unexpected.append(stored)
        check.unexpected.sort()
        if best is None or check.matched > best.matched:
            best = check
    assert best is not None  # a variant always has a prefix
    return best


def stored_tensor_map(resolved: Resolved, check: TensorCheck) -> dict[str, ResolvedTensor]:
    """The adapter's tensor map keyed by the names this checkpoint stores them under."""
    return {check.stored.get(name, name): t for name, t in resolved.tensor_map(check.prefix).items()}


@dataclass
class Checkpoint:
    """A checkpoint directory (or a bare config), recognised and resolved against its adapter."""

    path: Path
    config_path: Path
    config: dict
    adapter: Adapter
    variant: Variant
    resolved: Resolved
    files: list[Path]
    tensors: dict[str, TensorInfo]
    quantization: BlockFP8 | None = None
    # why the adapter recognised was not used: its tensor map did not fit these tensors, transformers' model did
    unfit: str | None = None

    @property
    def has_weights(self) -> bool:
        return bool(self.files)

    def check(self) -> TensorCheck:
        """How this checkpoint's tensors line up with its adapter (check_tensors)."""
        return check_tensors(self.resolved, self.tensors, self.quantization)


def resolve_config(config: dict, cfg_path: Path, adapters: dict[str, Adapter],
                   discover: Discover | None = None) -> tuple[Adapter, Variant, Resolved]:
    """A (checked) config's family, on-disk variant and every convention, through its adapter. ``discover``
    (parity.reference.structure.discover): where no adapter recognises the config, the adapter generated from
    transformers' own model class, if it has one; without it, such a config is refused."""
    try:
        adapter, variant = recognise(config, adapters, str(cfg_path))
    except ParityError:
        generated = discover(config, str(cfg_path)) if discover is not None else None
        if generated is None:
            raise
        adapter, variant = generated, generated.spec.variants[0]
    return adapter, variant, _resolve(adapter, variant, config, cfg_path)


def _resolve(adapter: Adapter, variant: Variant, config: dict, cfg_path: Path) -> Resolved:
    inner = text_config(config, variant, str(cfg_path))
    try:
        return resolve(adapter, variant, inner, wrapper=config if inner is not config else None)
    except ParityError:
        raise
    except Exception as exc:  # noqa: BLE001 - a value of a type or range the adapter's expressions cannot take
        raise ParityError(f"{cfg_path}: does not resolve as a {adapter.family} config ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160] if str(exc) else 'no message'}); fix the config") from None


def open_checkpoint(path: Path, adapter_dirs=(), *, adapters: dict[str, Adapter] | None = None,
                    discover: Discover | None = None) -> Checkpoint:
    """Read a checkpoint's config, find its family, and list its tensors (no weights loaded). ``discover``: as
    resolve_config's, given by the features that work without a family's conventions (a layerwise check)."""
    path = Path(path)
    config, cfg_path = read_config(path)
    adapter, variant, resolved = resolve_config(config, cfg_path, adapters if adapters is not None
                                                else load_all(adapter_dirs), discover)
    quantization = read_quantization(config, str(cfg_path))
    files = weight_files(path) if path.is_dir() else []
    tensors = inventory(files)
    if files:
        check_index(path, tensors)
    ckpt = Checkpoint(path=path, config_path=cfg_path, config=config, adapter=adapter, variant=variant,
                      resolved=resolved, files=files, tensors=tensors, quantization=quantization)
    return _unadapted(ckpt, discover) if files and discover is not None and not resolved.generic else ckpt


def _unadapted(ckpt: Checkpoint, discover: Discover) -> Checkpoint:
    """The checkpoint compared as a model no adapter knows where its adapter's tensor map does not fit its tensors
    but transformers' own model loads them (a borrowed class: EXAONE saved as LlamaForCausalLM with EXAONE's
    tensor names, which transformers renames as it loads). An adapter recognised by the architecture name alone
    must fit exactly: a tensor it does not map says its config keys are not the ones it reads (InternLM3's
    qkv_bias, an alias of Llama's attention_bias). Where transformers does not load them either, a checkpoint of
    the adapter's own model_type is left for refuse_mismatched to refuse; one that borrowed the class name is
    refused with what transformers' model lacks."""
    borrowed = ckpt.variant.model_type != ckpt.config.get("model_type")
    found = ckpt.check()
    if not (found.missing or found.wrong_shape or (borrowed and found.unexpected)):
        return ckpt
    try:
        generated = discover(ckpt.config, str(ckpt.config_path), ckpt.tensors)
    except ParityError:
        if not borrowed:
            return ckpt
        raise
    if generated is None:
        return ckpt
    variant = generated.spec.variants[0]
    resolved = _resolve(generated, variant, ckpt.config, ckpt.config_path)
    why = (f"the {ckpt.resolved.family} adapter does not fit these tensors ({_listed(found, unexpected=True)}) and "
           f"transformers' {variant.architectures[0]} loads them, so {resolved.family} is compared as a model no "
           f"adapter knows")
    return replace(ckpt, adapter=generated, variant=variant, resolved=resolved, unfit=why)


def _listed(found: TensorCheck, unexpected: bool = False) -> str:
    """What does not fit, each kind counted and its first names given."""
    kinds = (("missing", found.missing), ("wrong shape", found.wrong_shape),
             ("unexpected", found.unexpected if unexpected else []))
    return "; ".join(f"{label} ({len(items)}): {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                     for label, items in kinds if items)


def refuse_mismatched(ckpt: Checkpoint, role: str) -> None:
    """Refuse a checkpoint whose tensors are missing or misshapen for its config: transformers would crash on it,
    or initialise the missing weights at random and give a verdict about noise."""
    found = ckpt.check()
    if found.missing or found.wrong_shape:
        raise ParityError(f"{role} {ckpt.path}: tensors do not match its config ({ckpt.resolved.family}): "
                          f"{_listed(found)}; check that config.json belongs to these weights")
