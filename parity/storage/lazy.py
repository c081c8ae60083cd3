"""Layer streaming: weights read from the safetensors files when the forward reaches them, dropped after.

A check of a model that does not fit in memory holds about one decoder layer of weights per model:

- ``TensorFiles`` reads a tensor, a range of its rows, or a set of rows straight from the files with
  ``pread`` (no mmap: nothing read stays resident in the process once it is dropped);
- ``NeutralSource`` hands the neutral executor one layer's tensors at a time, embedding rows for the
  prompt's ids, and the head in vocabulary chunks;
- ``streamed_hf`` builds transformers' own model for a checkpoint on the meta device and materialises
  each decoder layer from the checkpoint, through transformers' own loading code (its renames and
  fused-expert conversions), just before the layer runs, then returns it to the meta device. Embedding
  lookups read only the rows the prompt uses and the LM head runs in vocabulary chunks; every module is
  still transformers' own.
"""

from __future__ import annotations

import os
import threading
import types
from pathlib import Path
from typing import Iterator, Mapping

import torch

from parity.errors import ParityError
from parity.storage.quantization import BlockFP8, dequantize, quantized_weights
from parity.storage.shards import Header, HeaderEntry, read_header

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
CHUNK_BYTES = 256 * 2**20  # the LM head is applied this many bytes of weights at a time
_READ_BLOCK = 1 << 30      # preadv moves at most this much per call (Linux caps one read near 2 GiB)
_LOADING = threading.Lock()


class TensorFiles:
    """Tensors by name, read on demand from the safetensors files that hold them."""

    def __init__(self, where: Mapping[str, Path]):
        self.where = {name: Path(f) for name, f in where.items()}
        self._headers: dict[Path, Header] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def entry(self, name: str) -> tuple[Path, HeaderEntry, int]:
        file = self.where[name]
        with self._lock:
            if file not in self._headers:
                self._headers[file] = read_header(file)
            header = self._headers[file]
        return file, header.tensors[name], header.data_start

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name)[1].shape

    def read(self, name: str, start: int = 0, stop: int | None = None, *, dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
        """Rows [start, stop) of the tensor (all of it by default), cast to ``dtype`` on ``device``."""
        file, entry, data = self.entry(name)
        torch_dtype = _torch_dtype(file, name, entry)
        shape = entry.shape
        rows = shape[0] if shape else 1
        stop = rows if stop is None else min(stop, rows)
        row_bytes = (entry.end - entry.begin) // max(rows, 1)
        raw = _pread(file, data + entry.begin + start * row_bytes, (stop - start) * row_bytes)
        x = raw.view(torch_dtype).reshape((stop - start, *shape[1:]) if shape else ())
        return _place(x, dtype, device)

    def rows(self, name: str, index: torch.Tensor, *, dtype: torch.dtype | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
        """The rows ``index`` (ascending, unique) of a 2-D tensor, one read per run of consecutive rows."""
        index = index.tolist()
        parts, k = [], 0
        while k < len(index):
            j = k
            while j + 1 < len(index) and index[j + 1] == index[j] + 1:
                j += 1
            parts.append(self.read(name, index[k], index[j] + 1))
            k = j + 1
        x = torch.cat(parts) if len(parts) != 1 else parts[0]
        return _place(x, dtype, device)

    def row_chunks(self, name: str, *, dtype: torch.dtype, device=None) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of a 2-D tensor, CHUNK_BYTES of ``dtype`` at a time."""
        rows, cols = self.shape(name)[0], max(1, _numel(self.shape(name)[1:]))
        step = max(1, CHUNK_BYTES // (cols * torch.empty((), dtype=dtype).element_size()))
        for a in range(0, rows, step):
            yield a, self.read(name, a, a + step, dtype=dtype, device=device)


class Dequantizer:
    """Reads checkpoint tensors, dequantizing FP8 weights with their block scales (the scales are small: read
    once, kept)."""

    def __init__(self, files, quantization: BlockFP8 | None, scales: dict[str, str]):
        self.files, self.quantization, self.scales = files, quantization, scales
        self._scale: dict[str, torch.Tensor] = {}

    @classmethod
    def of(cls, ckpt) -> "Dequantizer":
        """A checkpoint's tensors by name, its FP8 weights dequantized on read (float32 unless asked)."""
        files = TensorFiles({name: info.file for name, info in ckpt.tensors.items()})
        return cls(files, ckpt.quantization, quantized_weights(ckpt.tensors) if ckpt.quantization else {})

    def quantized(self, name: str) -> bool:
        return self.quantization is not None and name in self.scales

    def scale(self, name: str) -> torch.Tensor:
        if name not in self._scale:
            self._scale[name] = self.files.read(self.scales[name]).float()
        return self._scale[name]

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        x = self.files.read(name)
        if self.quantized(name):
            return dequantize(x, self.scale(name), self.quantization.block, dtype or torch.float32)
        return x if dtype is None else x.to(dtype)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _torch_dtype(file: Path, name: str, entry: HeaderEntry) -> torch.dtype:
    if entry.dtype not in TORCH_DTYPES:
        raise ParityError(f"{file}: {name} is {entry.dtype}, which parity cannot read; convert it to F32, BF16 or F16")
    return TORCH_DTYPES[entry.dtype]


def _place(x: torch.Tensor, dtype, device) -> torch.Tensor:
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    return x if device is None else x.to(device)


def _pread(file: Path, offset: int, nbytes: int) -> torch.Tensor:
    """nbytes of the file from offset, into a fresh uint8 tensor (read straight into its memory)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy()) if nbytes else None
    fd = os.open(file, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:done + _READ_BLOCK]], offset + done)
            if n <= 0:
                raise ParityError(f"{file}: ends before the tensor data its header promises; the file is truncated")
            done += n
    finally:
        os.close(fd)
    return buf


# --------------------------------------------------------------------------------------------
# The neutral executor's weights, a layer at a time


class NeutralSource:
    """A neutral directory's tensors for parity's executor, read when used: ``resident()`` the small tensors
    outside the layers, ``layer(i)`` one layer's, ``rows`` embedding rows, ``row_chunks`` a head's rows."""

    LARGE = ("embed.tokens.weight", "embed.per_layer_tokens.weight", "lm_head.weight")

    def __init__(self, files: dict[str, str], directory: Path):
        """``files``: each tensor's file in ``directory``, by neutral name."""
        self.files = TensorFiles({name: Path(directory) / file for name, file in files.items()})
        self.names = list(files)

    def resident(self) -> dict[str, torch.Tensor]:
        return {n: self.files.read(n) for n in self.names if not n.startswith("layers.") and n not in self.LARGE}

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        return {n[len(prefix):]: self.files.read(n) for n in self.names if n.startswith(prefix)}

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self.files.rows(name, index)

    def row_chunks(self, name: str, dtype: torch.dtype, device=None) -> Iterator[tuple[int, torch.Tensor]]:
        return self.files.row_chunks(name, dtype=dtype, device=device)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(name)


# --------------------------------------------------------------------------------------------
# transformers' model, a layer at a time


def streamed_hf(cls, ckpt, dtype: torch.dtype, device: str = "cpu", **kwargs):
    """transformers' model ``cls`` for checkpoint ``ckpt``, built on the meta device, with hooks that
    materialise each decoder layer from the checkpoint as the forward reaches it and drop it after.

    Loading goes through transformers' own ``convert_and_load_state_dict_in_model`` with the model's own
    conversion mapping, one layer's checkpoint tensors at a time, so renamed, legacy and fused (MoE
    expert) layouts load exactly as ``from_pretrained`` loads them.
    """
    import transformers  # heavy: transformers, accelerate
    from accelerate import init_empty_weights

    config = transformers.AutoConfig.from_pretrained(ckpt.path)
    # parameters on meta, buffers (RoPE tables) computed. accelerate patches nn.Module for every thread while
    # it builds, so no other model may load weights meanwhile (they would land on meta too)
    with _LOADING, init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=dtype, attn_implementation="eager", **kwargs)
    model.eval()
    loader = _Loader(model, ckpt, dtype, device)
    layers = loader.layer_paths()
    groups = loader.group(layers)
    embeddings, head = loader.vocabulary_modules(layers)
    skip = {key for key, _ in embeddings.values()} | ({head[1]} if head else set())
    loader.load({k: v for k, v in groups.pop(None, {}).items() if k not in skip})
    model.tie_weights()  # heads and biases tied to what was just loaded
    for i, path in enumerate(layers):
        module = model.get_submodule(path)
        module.register_forward_pre_hook(lambda mod, args, keys=groups.get(i, {}), path=path:
                                         loader.materialise(path, keys))
        module.register_forward_hook(lambda mod, args, out, path=path: loader.drop(path))
    for path, (source, target) in embeddings.items():
        _rows_only(model.get_submodule(path), loader.files, source, dtype, device)
    if head is not None:
        _chunked_head(model.get_submodule(head[0]), loader.files, head[2], dtype, device)
    for name, p in model.named_parameters():  # what remains on meta was in no group: the checkpoint lacks it
        owner = name.rpartition(".")[0]
        if p.is_meta and not any(name.startswith(f"{x}.") for x in layers) and owner not in embeddings \
                and (head is None or owner != head[0]):
            raise ParityError(f"{ckpt.path}: {name} is in no checkpoint file; check that its config and weights "
                              f"belong together")
    return model


class _Loader:
    """Checkpoint tensors grouped by the decoder layer they load into, and loading them with transformers."""

    def __init__(self, model, ckpt, dtype: torch.dtype, device: str):
        from transformers.conversion_mapping import get_model_conversion_mapping  # heavy: transformers
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.model, self.ckpt, self.dtype, self.device = model, ckpt, dtype, device
        self.deq = Dequantizer.of(ckpt)  # FP8 block-quantized weights are loaded dequantized; their scales unused
        self.files = self.deq.files
        self.mapping = get_model_conversion_mapping(model)
        self.renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        self.converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        self.meta = model.state_dict()  # meta tensors: names and shapes, no memory
        self.loaded: dict[str, set[str]] = {}

    def rename(self, key: str) -> tuple[str, str | None]:
        """(the model's key, the converter pattern if one applies) for a checkpoint key, as transformers does."""
        from transformers.core_model_loading import rename_source_key  # heavy: transformers

        prefix = self.model.base_model_prefix
        renamed, pattern = rename_source_key(key, self.renamings, self.converters, prefix, self.meta)
        if renamed not in self.meta and key in self.meta:
            renamed, pattern = rename_source_key(key, [], [], prefix, self.meta)
        return renamed, pattern

    def layer_paths(self) -> list[str]:
        """Each decoder layer's module path, from the adapter's capture map (``layers.{i}.out``)."""
        by_name = {c.name: c.module for c in self.ckpt.resolved.capture}
        return [by_name[f"layers.{i}.out"] for i in range(self.ckpt.resolved.num_layers)]

    def group(self, layers: list[str]) -> dict[int | None, dict[str, str]]:
        """layer index (None: outside the layers) -> {checkpoint key: model key}; keys the model has no place
        for (saved buffers, an unused head) are left out, as transformers leaves them."""
        out: dict[int | None, dict[str, str]] = {}
        for key in self.ckpt.tensors:
            renamed, _ = self.rename(key)
            if renamed not in self.meta:
                continue
            i = next((k for k, p in enumerate(layers) if renamed.startswith(f"{p}.")), None)
            out.setdefault(i, {})[key] = renamed
        return out

    def vocabulary_modules(self, layers: list[str]):
        """Embeddings outside the layers whose rows can be read alone ({path: (checkpoint key, model key)}), and
        the LM head if its weight is a plain tensor of the checkpoint: (path, model key, checkpoint key)."""
        source_of = {}
        for key in self.ckpt.tensors:
            renamed, pattern = self.rename(key)
            if renamed in self.meta and pattern is None and not self.deq.quantized(key):
                source_of[renamed] = key
        embeddings = {}
        for path, module in self.model.named_modules():
            if isinstance(module, torch.nn.Embedding) and not any(path.startswith(f"{p}.") for p in layers) \
                    and f"{path}.weight" in source_of:
                embeddings[path] = (source_of[f"{path}.weight"], f"{path}.weight")
        head = None
        out = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if isinstance(out, torch.nn.Linear):
            path = next(p for p, m in self.model.named_modules() if m is out)
            key = f"{path}.weight"
            source = source_of.get(key)
            if source is None:  # tied: the head is the input embedding
                inp = self.model.get_input_embeddings()
                in_path = next(p for p, m in self.model.named_modules() if m is inp)
                source = source_of.get(f"{in_path}.weight")
            if source is not None:
                head = (path, key, source)
        return embeddings, head

    def load(self, keys: Mapping[str, str]) -> None:
        """Load these checkpoint tensors into the model with transformers' own conversion code."""
        if not keys:
            return
        import transformers  # heavy: transformers
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        state = {key: self.deq.read(key) for key in keys}
        config = LoadStateDictConfig(dtype=self.dtype, dtype_plan=self.model._get_dtype_plan(self.dtype),
                                     weight_mapping=self.mapping, device_map={"": self.device})
        verbosity = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        try:
            with _LOADING:  # not while another model is being built (above)
                convert_and_load_state_dict_in_model(self.model, state, config)
        finally:
            transformers.utils.logging.set_verbosity(verbosity)

    def materialise(self, path: str, keys: Mapping[str, str]) -> None:
        self.load(keys)
        module = self.model.get_submodule(path)
        missing = [n for n, p in module.named_parameters() if p.is_meta]
        if missing:
            raise ParityError(f"{self.ckpt.path}: {path}.{missing[0]} is in no checkpoint file; check that its "
                              f"config and weights belong together")
        self.loaded[path] = set(keys.values())

    def drop(self, path: str) -> None:
        """Return a layer's weights (and the buffers loaded from the checkpoint) to the meta device."""
        module = self.model.get_submodule(path)
        loaded = self.loaded.pop(path, set())
        for name, sub in module.named_modules():
            full = f"{path}.{name}" if name else path
            for pname, p in list(sub._parameters.items()):
                if p is not None and not p.is_meta:
                    sub._parameters[pname] = torch.nn.Parameter(p.to("meta"), requires_grad=False)
            for bname, b in list(sub._buffers.items()):
                if b is not None and f"{full}.{bname}" in loaded:
                    sub._buffers[bname] = b.to("meta")


def _rows_only(module: torch.nn.Embedding, files: TensorFiles, source: str, dtype, device) -> None:
    """The embedding reads only the rows its input uses: the input is replaced by positions in those rows."""
    def before(mod, args):
        ids = args[0]
        used, inverse = torch.unique(ids, return_inverse=True)
        # set in _parameters, not by attribute: accelerate's build patch (streamed_hf) must not reach it
        mod._parameters["weight"] = torch.nn.Parameter(files.rows(source, used.cpu(), dtype=dtype, device=device),
                                                       requires_grad=False)
        mod._parity_padding, mod.padding_idx = mod.padding_idx, None  # its index is into the full table
        return (inverse, *args[1:])

    def idle(mod) -> None:
        # between calls, a weight of the table's shape on the real device, with no storage behind it (a stride-0
        # view of one zero): a model that moves the ids to the embedding's device first (Llama 4) keeps real ids
        shape, kind = mod.weight.shape, mod.weight.dtype
        mod._parameters["weight"] = torch.nn.Parameter(torch.zeros((), dtype=kind, device=device).expand(shape),
                                                       requires_grad=False)

    def after(mod, args, out):
        idle(mod)
        mod.padding_idx = mod._parity_padding

    idle(module)
    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _chunked_head(module: torch.nn.Linear, files: TensorFiles, source: str, dtype, device) -> None:
    """The LM head computed CHUNK_BYTES of its weight at a time, read from the checkpoint (a tied head from
    the embedding's rows)."""
    rows = files.shape(source)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], rows)
        bias = self.bias if self.bias is not None and not self.bias.is_meta else None
        for a, w in files.row_chunks(source, dtype=dtype, device=device):
            out[..., a:a + w.shape[0]] = torch.nn.functional.linear(
                x, w, None if bias is None else bias[a:a + w.shape[0]])
        return out

    module.forward = types.MethodType(forward, module)
