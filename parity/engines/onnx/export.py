"""``parity convert --to onnx``: the neutral executor exported as an ONNX graph.

The checkpoint is first converted to the neutral layout (in the output's temporary directory), then
the executor (parity/executor) is traced with torch.export and written by torch.onnx, so the graph
computes exactly what the manifest states: norms (in float32 inside a float16 graph), softcaps,
QK/v-norms, sliding-window masks and RoPE tables are ops in the graph, built from the sequence
length at run time. Batch and sequence are dynamic.

Inputs: ``input_ids`` [batch, sequence] int64, and ``token_type_ids`` where the model has token
types. Outputs: ``logits`` (or ``last_hidden_state`` for a model without an LM head); with
``debug_outputs`` every other capture point too, named as in docs/design.md, "Capture points" (``embed``,
``layers.0.attn_in``, ...); with ``op_outputs`` every operation-level point the executor emits (docs/ops.md:
``layers.0.attn.q``, ..., ``layers.0.mlp.act``, in its layouts), so that a check compares them (``--points ops``,
a drill-down). Scores and probabilities are [batch, sequence, heads * keys] per layer: an onnxruntime run computes
only the outputs it is asked for, and parity asks for the ops only when it compares them. With ``kv_cache`` (causal language models), the executor's KV cache
(parity/neutral/executor/cache.py) is in the graph: inputs ``past_key_values.{i}.key`` / ``.value``
[batch, kv_heads, past_sequence, head_dim] for each layer that computes its own keys (empty for a prompt),
outputs ``present.{i}.key`` / ``.value`` with this call's keys appended; positions start after the past. The
cache keeps every key and the mask windows them, so a decode step attends to what the executor's ring holds. Initializers keep the neutral tensor names (``layers.0.attn_norm.weight``).
``metadata_props`` hold the manifest (``parity.neutral.manifest``: family, conventions, source hashes) and
the capture points the graph outputs (``parity.capture_points``).

The executor is traced on fake tensors (shapes and dtypes, no data), and the weights are read from the
neutral files only when they are written: past 2 GB, streamed a chunk of rows at a time into external data
beside the graph (``OUT.onnx.data``), so that exporting an 8B model needs a few GB of memory, not the model's
size. The file is written atomically (parity/storage/atomic.py).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import onnx
import onnx_ir
import torch
from onnx_ir.passes.common import OutputFixPass
from onnxscript.optimizer import optimize_ir
from torch._subclasses.fake_tensor import FakeTensorMode

from parity import __version__
from parity.diagnosis import bugs
from parity.errors import ParityError
from parity.names import is_op
from parity.neutral.converter import convert
from parity.neutral.executor.cache import KVCache
from parity.neutral.executor.model import NeutralModel
from parity.neutral.manifest import load
from parity.neutral.model import Manifest, Tensor
from parity.rope import LENGTH_DEPENDENT
from parity.storage import atomic

DTYPES = ("float32", "float16")
FORMAT = "parity-onnx"
FORMAT_VERSION = 1
MANIFEST_KEY = "parity.neutral.manifest"
POINTS_KEY = "parity.capture_points"
EXTERNAL_DATA_BYTES = 2 * 10**9 - 64 * 2**20  # protobuf's 2 GB limit, less room for the graph itself


class _Exportable(torch.nn.Module):
    """The executor as an nn.Module whose buffers are the neutral tensors, under their neutral names.

    ``forward`` returns the final output followed by the capture points in ``points``.
    """

    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor], dtype: torch.dtype, points: list[str],
                 kv_cache: bool = False):
        super().__init__()
        self.manifest, self.dtype, self.points = manifest, dtype, points
        self.ops = False  # the executor emits its operation-level points (some of ``points`` are ops)
        # the layers whose keys and values the graph takes in and hands back (KV-sharing layers reuse another's)
        self.cached = [i for i, att in manifest.attentions() if att.kv_shared_from is None] if kv_cache else None
        for name, x in NeutralModel(manifest, tensors, dtype).w.items():  # cast as the executor casts
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, x)

    def forward(self, input_ids: torch.Tensor, extra=None) -> tuple[torch.Tensor, ...]:
        """``extra``: token_type_ids (a model with token types), or the past keys and values (with a cache:
        key, value per cached layer)."""
        weights = dict(self.named_buffers())
        model = NeutralModel(self.manifest, weights, self.dtype)
        seen: dict[str, torch.Tensor] = {}
        cache = None
        if self.cached is not None:
            cache = KVCache(self.manifest.num_layers, evict=False)
            cache.slots = {i: (extra[2 * k], extra[2 * k + 1]) for k, i in enumerate(self.cached)}
            cache.length = extra[0].shape[2]
        out = model(input_ids, on_point=seen.__setitem__, token_types=None if cache else extra, cache=cache,
                    ops=self.ops)
        presents = [t for i in self.cached for t in cache.slots[i]] if cache is not None else []
        return (out, *(seen[p] for p in self.points), *presents)


def _length_dependent_rope(manifest: Manifest, kv_cache: bool) -> str | None:
    """The RoPE scaling an export cannot carry: "dynamic" (its frequencies are a function of the length), and
    LongRoPE with a cache (its keys would keep the short factors once the length passes the threshold)."""
    for rope in manifest.ropes():
        kind = (rope.scaling or {}).get("rope_type")
        if kind in LENGTH_DEPENDENT and (kind != "longrope" or kv_cache):
            return kind
    return None


def onnx_metadata(manifest: Manifest, points: list[str], output: str) -> dict[str, str]:
    """The metadata_props of an export: the manifest (without the neutral files it was run from)."""
    kept = manifest.model_copy(update={"written_by": f"parity {__version__}", "files": {}}).to_json()
    return {
        "parity.format": FORMAT,
        "parity.format_version": str(FORMAT_VERSION),
        MANIFEST_KEY: json.dumps(kept, separators=(",", ":")),
        POINTS_KEY: json.dumps(points),
        "parity.output": output,
    }


def export(path: Path, out: Path, *, dtype: str | None = None, debug_outputs: bool = False, opset: int | None = None,
           force: bool = False, adapter_dirs=(), inject: str | None = None, kv_cache: bool = False,
           op_outputs: bool = False) -> dict:
    """Export a checkpoint directory as ONNX at ``out``; returns a summary (manifest, outputs, files).
    ``op_outputs``: the executor's operation-level points as outputs too (see the module docstring).

    ``inject`` writes a deliberately broken export (a catalogued porting mistake, see parity bugs), so
    that an engine team can rehearse its gate; a decode bug, with ``kv_cache``, is the cache policy the graph
    runs. ``kv_cache`` adds past key/value inputs and present outputs (see the module docstring)."""
    dtype = dtype or "float32"
    if dtype not in DTYPES:
        raise ParityError(f"--dtype {dtype} is not available for --to onnx; use one of {', '.join(DTYPES)}")
    if opset is not None and not 18 <= opset <= 23:
        raise ParityError(f"--opset {opset}: torch.onnx exports opsets 18 to 23; choose one of those")
    out = Path(out)
    if out.suffix != ".onnx":
        raise ParityError(f"-o {out}: an ONNX output must end in .onnx")
    if importlib.util.find_spec("onnxscript") is None:  # torch.onnx's exporter needs it
        raise ParityError("--to onnx needs the onnxscript package; pip install onnxscript")

    with atomic.output_file(out, force=force) as tmp:
        manifest = convert(path, tmp / "neutral", dtype=dtype, adapter_dirs=adapter_dirs)
        kind = _length_dependent_rope(manifest, kv_cache)
        if kind is not None:
            raise ParityError(f"{path}: RoPE scaling {kind!r} depends on the prompt length, which an exported "
                              f"graph{' with a KV cache' if kv_cache else ''} cannot follow; not exportable to ONNX "
                              f"yet{' (export it without --kv-cache)' if kv_cache else ''}")
        torch_dtype = getattr(torch, dtype)
        output = "logits" if manifest.head is not None else "last_hidden_state"
        if kv_cache and (manifest.head is None or not all(att.causal for _, att in manifest.attentions())):
            raise ParityError(f"--kv-cache: a {manifest.source.family} model is not a causal language model; "
                              f"export it without a cache")
        points = [p for p in manifest.capture_points if p != output] if debug_outputs else []
        weight_bytes = sum(_nbytes(t) for t in manifest.tensors.values())
        external = weight_bytes > EXTERNAL_DATA_BYTES
        if inject:  # a broken export rehearses a gate on small models: its tensors are changed in memory
            if bugs.parse(inject)[0].decode:
                raise ParityError(f"--inject {inject}: a KV-cache mistake is run by parity's executor, not written "
                                  f"into a graph; rehearse it with parity check --inject {inject} --decode N")

            manifest, tensors = bugs.inject(inject, *load(tmp / "neutral"), bugs.families())
            module, source = _Exportable(manifest, tensors, torch_dtype, points, kv_cache).eval(), None
            del tensors
        else:  # traced on fake tensors: the weights are read when written, a chunk at a time
            _, source = load(tmp / "neutral", lazy=True)
            with FakeTensorMode(allow_non_fake_inputs=True):
                fake = {name: torch.empty(info.shape, dtype=getattr(torch, info.dtype))
                        for name, info in manifest.tensors.items()}
                module = _Exportable(manifest, fake, torch_dtype, points, kv_cache).eval()
        points = _with_ops(module) if op_outputs else points  # on the fake weights: shapes only
        weights = {name: x.dtype for name, x in module.named_buffers()}
        program = _torch_export(module, manifest, points, output, opset)
        presents = _cache_names(module, "present")
        del module
        if source is not None:
            _put_weights(program, source, weights, tmp / f"{out.name}.data" if external else None)
        _tidy(program, [output, *points, *presents], set(weights))
        for key, value in onnx_metadata(manifest, points, output).items():
            program.model.metadata_props[key] = value
        program.model.producer_name, program.model.producer_version = "parity", __version__
        if source is None:
            program.save(tmp / out.name, external_data=external)
        else:  # the external tensors keep the file they were written to
            onnx_ir.save(program.model, tmp / out.name)
        del program
        _remove_tree(tmp / "neutral")
        check_file(tmp / out.name)
        files = sorted(p.name for p in tmp.iterdir())
    return {"manifest": manifest, "outputs": [output, *points, *presents], "files": files, "external_data": external,
            "dtype": dtype}


def _with_ops(module: _Exportable) -> list[str]:
    """Make ``module`` output the executor's operation-level points after its points: those it emits for this
    manifest, found by running it once on two tokens (on fake weights, where it was built on them: shapes only).
    Returns its points, ops included."""
    found: list[str] = []
    model = NeutralModel(module.manifest, dict(module.named_buffers()), module.dtype)
    with torch.no_grad():
        model(torch.full((1, 2), 3, dtype=torch.long), on_point=lambda name, t: found.append(name) if is_op(name)
              else None, ops=True)
    module.ops = True
    module.points = [*module.points, *dict.fromkeys(found)]
    return module.points


def _cache_names(module: _Exportable, prefix: str) -> list[str]:
    """The cache's graph inputs (``past_key_values``) or outputs (``present``): key, value per cached layer."""
    return [f"{prefix}.{i}.{kv}" for i in module.cached or () for kv in ("key", "value")]


def _put_weights(program, source, weights: dict[str, torch.dtype], data: Path | None) -> None:
    """Give the exported graph's fake weights their values, cast as the executor casts them: in the graph (small
    models), or streamed into the external data file ``data``, a chunk of rows at a time, each tensor 64-byte
    aligned and referenced where it lies (onnx_ir's ExternalTensor), so that no model-sized buffer is built."""
    initializers = program.model.graph.initializers
    if data is None:
        program.apply_weights({name: source.files.read(name, dtype=dtype) for name, dtype in weights.items()
                               if name in initializers})
        return
    with open(data, "wb") as f:
        for name, dtype in weights.items():
            if name not in initializers:
                continue
            f.write(b"\0" * (-f.tell() % 64))
            offset = f.tell()
            for _, chunk in source.row_chunks(name, dtype):
                f.write(memoryview(chunk.contiguous().view(torch.uint8).reshape(-1).numpy()))
            value = initializers[name].const_value
            initializers[name].const_value = onnx_ir.ExternalTensor(
                data.name, offset, f.tell() - offset, value.dtype, shape=value.shape, name=name, base_dir=data.parent)


def _nbytes(info: Tensor) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n * torch.empty(0, dtype=getattr(torch, info.dtype)).element_size()


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _torch_export(module: _Exportable, manifest: Manifest, points: list[str], output: str, opset: int | None):
    ids = torch.tensor([[3 + (7919 * k + 17) % max(manifest.vocab_size - 3, 1) for k in range(16)]] * 2)
    args: tuple = (ids,)
    names = ["input_ids"]
    shapes: dict = {"input_ids": {0: "batch", 1: "sequence"}}
    if manifest.embedding.token_types:
        args += (torch.zeros_like(ids),)
        names.append("token_type_ids")
        shapes["extra"] = {0: "batch", 1: "sequence"}
    if module.cached is not None:  # traced with 3 past positions: a dynamic size, 0 (a prompt) at run time too
        past = []
        for i in module.cached:
            att = manifest.layers[i].attention
            if att.mla:
                mla = att.mla
                dims = [(att.heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim), (att.heads, mla.v_head_dim)]
            else:
                dims = [(att.kv_heads, att.head_dim)] * 2
            past += [torch.zeros(2, heads, 3, width, dtype=module.dtype) for heads, width in dims]
        args += (past,)
        names += _cache_names(module, "past_key_values")
        shapes["extra"] = [{0: "batch", 2: "past_sequence"}] * len(past)
    outputs = [output, *points, *_cache_names(module, "present")]
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad(), _no_stack_traces():
            warnings.simplefilter("ignore")
            return torch.onnx.export(module, args, dynamo=True, input_names=names, output_names=outputs,
                                     dynamic_shapes=shapes, opset_version=opset, optimize=False, verbose=False,
                                     external_data=False)
    except ParityError:
        raise
    except Exception as exc:  # noqa: BLE001 - the exporter raises many types; one line for the user
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
        first = text.splitlines()[0][:300] if text else type(exc).__name__
        raise ParityError(f"torch.onnx could not export the {manifest.source.family} executor: {first}") from None
    finally:
        quiet.setLevel(level)


def _tidy(program, outputs: list[str], weights: set[str]) -> None:
    """Fold the small constants the exporter leaves (CastLike of scalars, shape arithmetic) without
    touching a weight, so initializers keep their neutral names and no tensor is stored twice; give
    every output its own value under its capture-point name (points that are the same tensor, such as
    BERT's ``embed`` and ``layers.0.attn_in``, get an Identity each)."""
    def should_fold(node) -> bool | None:
        return False if any(v is not None and v.name in weights for v in node.inputs) else None

    optimize_ir(program.model, should_fold=should_fold)
    OutputFixPass()(program.model)
    graph = program.model.graph
    for k, value in enumerate(graph.outputs):  # two steps: a point's name may sit on another output now
        value.name = f"parity_output_{k}"
    for value, name in zip(graph.outputs, outputs):
        value.name = name
    if [v.name for v in graph.outputs] != outputs:
        raise ParityError(f"the exported graph's outputs are {[v.name for v in graph.outputs]}, expected {outputs}")


@contextmanager
def _no_stack_traces() -> Iterator[None]:
    """torch.fx records a Python stack trace per traced node, a third of the export's time; skip it."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):  # older torch
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def check_file(path: Path) -> None:
    """onnx.checker's full check (by path: it reads external data itself)."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001
        raise ParityError(f"{path}: the exported graph fails onnx.checker ({str(exc).splitlines()[0]})") from None
