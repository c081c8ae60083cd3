"""ONNX files as ``parity check`` candidates, run with onnxruntime.

The graph is fed whatever inputs it declares (``input_ids``, ``attention_mask`` = ones,
``position_ids`` = arange, ``token_type_ids`` = zeros, ``cache_position``, and empty past key/values
for graphs exported with a cache). Which graph values are capture points is parity.engines.onnx.graph's to find (its
docstring gives the order of precedence: --map, names, the final output, module paths, structure).

Matched values are added to the graph's outputs; each is checked at run time to be [batch, sequence,
width] before it is compared. The report lists every point with the value it was read from and how
(``report.matching``); points that could not be matched are not compared, and say why.

With ``options.ops`` (``--points ops``, a drill-down) the reference's operation-level points are read too, where the
graph has them (parity.engines.graph_ops: outputs named as the ops, as ``parity convert --to onnx`` writes them with op
outputs; else by module path and around each attention's Softmax); the ops it lacks are named in a warning. A run
computes only the outputs it reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from parity import names
from parity.checkpoint import inside as in_directory
from parity.engines.graph_ops import as_point, match_ops, missing_note, read_ops, wanted_ops
from parity.engines.onnx.arithmetic import OrtArithmetic
from parity.engines.onnx.graph import Graph, Matching, hidden_width, match, vocabulary
from parity.engines.onnx.weights import read_back, stored
from parity.errors import ParityError

KIND = "onnx"
TAKES = "an ONNX graph (.onnx)"
OPTIONS = ("layerwise", "provider", "map")  # the graph values matched to points, the provider that runs them
GENERIC = True      # reads points by --map, by name or by module path: checks a model no adapter knows
def onnx_file(path: Path) -> Path | None:
    """The .onnx file a candidate path names: the file itself, or a directory's single model.onnx."""
    path = Path(path)
    if path.is_file() and path.suffix == ".onnx":
        return path
    if path.is_dir() and (path / "model.onnx").is_file() and not (path / "manifest.json").exists() \
            and not any(path.glob("*.safetensors")):
        return path / "model.onnx"
    return None


def detect(path: Path) -> bool:
    return onnx_file(path) is not None


# --------------------------------------------------------------------------------------------
# The graph, indexed


def _providers(name: str | None) -> list[str]:
    available = ort.get_available_providers()
    if name is None:
        return ["CPUExecutionProvider"]
    for p in available:
        if name.lower() in (p.lower(), p.lower().removesuffix("executionprovider")):
            return [p] + (["CPUExecutionProvider"] if p != "CPUExecutionProvider" else [])
    raise ParityError(f"--provider {name}: onnxruntime here offers {', '.join(available)}")


def _metadata(model) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


class Session:
    """An onnxruntime session over the graph with the matched values added as outputs."""

    def __init__(self, path: Path, extra: list[str], provider: str | None, g: Graph, ckpt):
        import onnx  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

        self.ckpt = ckpt
        options = ort.SessionOptions()
        options.log_severity_level = 4  # its errors come back as one ParityError line
        model = g.model
        added = [v for v in dict.fromkeys(extra) if v not in g.outputs]
        source: object = str(path)
        if added:
            model = onnx.ModelProto()
            model.CopyFrom(g.model)
            for v in added:
                elem, _ = g.types.get(v, (None, None))
                model.graph.output.append(onnx.helper.make_tensor_value_info(v, elem, None) if elem
                                          else onnx.ValueInfoProto(name=v))
            if any(init.external_data for init in model.graph.initializer):
                options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                                 str(path.parent))
            source = model.SerializeToString()
        try:
            self.session = ort.InferenceSession(source, options, providers=_providers(provider))
        except ParityError:
            raise
        except Exception as exc:  # noqa: BLE001 - onnxruntime's errors are one long line
            raise ParityError(f"{path}: onnxruntime cannot load the model ({str(exc).splitlines()[0][:300]})") from None
        self.inputs = self.session.get_inputs()
        self.outputs = [o.name for o in self.session.get_outputs()]

    def feeds(self, ids: torch.Tensor, path: Path, start: int = 0,
              past: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The graph's inputs for ``ids`` at positions ``start``, ``start + 1``, ...; past key/values are ``past``
        (a decode step: the cache the graph returned the step before), else empty."""
        b, s = ids.shape
        out: dict[str, np.ndarray] = {}
        for i in self.inputs:
            dtype = _numpy_dtype(i.type)
            name = i.name
            if name in ("input_ids", "ids", "tokens") or name.endswith("input_ids"):
                value = ids.numpy()
            elif "attention_mask" in name:
                value = np.ones((b, start + s))
            elif "position_ids" in name:
                positions = np.arange(start, start + s)
                value = np.broadcast_to(positions, (b, s)) if len(i.shape) == 2 else positions
            elif "token_type_ids" in name:
                value = np.zeros((b, s))
            elif name == "cache_position":
                value = np.arange(start, start + s)
            elif "past" in name or "cache" in name:
                value = past[name] if past is not None else np.zeros(self._past_shape(i.name, i.shape, b))
            elif i.type == "tensor(bool)" and len(i.shape) == 0:
                value = np.array(False)
            else:
                raise ParityError(f"{path}: the graph needs input {name!r} {i.type} {i.shape}, which parity cannot "
                                  f"fill; it feeds input_ids, attention_mask, position_ids, token_type_ids, "
                                  f"cache_position and past key/values")
            out[name] = np.ascontiguousarray(value).astype(dtype)
        return out

    def _past_shape(self, name: str, dims: list, b: int) -> list[int]:
        """An empty cache: batch b, no past positions; [batch, kv_heads, past, head_dim] dims the graph leaves
        symbolic are taken from the reference's layer (the one the input's name numbers, else the first)."""
        r = self.ckpt.resolved
        layer = next((int(part) for part in name.replace("_", ".").split(".") if part.isdigit()), 0)
        layer = min(layer, r.num_layers - 1)
        known = {1: r.layer("attention.kv_heads", layer), 3: r.layer("attention.head_dim", layer)}
        shape = []
        for k, d in enumerate(dims):
            if isinstance(d, int):
                shape.append(d)
            elif _is_batch(d):
                shape.append(b)
            elif any(word in str(d).lower() for word in ("seq", "len", "past", "total")) or len(dims) != 4:
                shape.append(0)
            else:
                shape.append(known.get(k) or 0)
        return shape

    def cache_outputs(self, path: Path) -> dict[str, str]:
        """Each past key/value input and the output that returns it updated (``past_key_values.0.key`` and
        ``present.0.key``, ``past.0.value`` and ``present.0.value``, ...), paired by name."""
        def key(name: str) -> str:
            for word in ("past_key_values", "present_key_values", "past", "present"):
                name = name.replace(word, "")
            return name.strip("._/")

        past = [i.name for i in self.inputs if ("past" in i.name or "cache" in i.name) and i.name != "cache_position"]
        if not past:
            raise ParityError(f"--candidate {path}: the ONNX graph has no past key/value inputs, so it cannot decode "
                              f"step by step; export it with a KV cache (past_key_values.* in, present.* out), or "
                              f"drop --decode")
        returned = {key(o): o for o in self.outputs if "present" in o}
        missing = [name for name in past if key(name) not in returned]
        if missing:
            raise ParityError(f"--candidate {path}: no output returns the updated cache for {', '.join(missing[:4])} "
                              f"(expected present.* outputs named like the past_key_values.* inputs); parity cannot "
                              f"feed the cache back")
        return {name: returned[key(name)] for name in past}

    def run(self, feeds: dict[str, np.ndarray], only: list[str] | None = None) -> dict[str, np.ndarray]:
        """The graph's outputs for ``feeds``: every one, or ``only`` these (an export's op outputs are large:
        scores and probabilities of every layer; they are computed when asked for)."""
        asked = self.outputs if only is None else [o for o in self.outputs if o in set(only)] or self.outputs[:1]
        try:
            return dict(zip(asked, self.session.run(asked, feeds)))
        except Exception as exc:  # noqa: BLE001
            raise ParityError(f"onnxruntime failed to run the model ({str(exc).splitlines()[0][:300]})") from None


def _is_batch(dim) -> bool:
    return isinstance(dim, str) and "batch" in dim.lower()


def _numpy_dtype(onnx_type: str):
    kinds = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16, "tensor(double)": np.float64, "tensor(bool)": np.bool_,
             "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}
    if onnx_type not in kinds:
        raise ParityError(f"an ONNX input of type {onnx_type} cannot be fed")
    return kinds[onnx_type]


def _load(candidate, path: Path, wanted: list[str]) -> tuple[Session, Matching]:
    """The session and matching for these points (cached across the prompts of one check)."""
    models, ckpt, options = candidate.models, candidate.ckpt, candidate.options
    key = ("onnx", str(path), options.provider, tuple(wanted), options.map)
    if key not in models.loaded:
        model = open_model(path)
        metadata = _metadata(model)
        try:
            g = Graph(model)
        except Exception as exc:  # noqa: BLE001 - a graph that parses but cannot be indexed is damaged
            raise ParityError(f"{path}: not a well-formed ONNX graph ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:160] if str(exc) else ''}); export it again") from None
        matching = match(g, ckpt, wanted, dict(options.map), metadata)
        match_ops(g, ckpt, [p for p in wanted if names.is_op(p)], dict(options.map), matching)
        _warn_about(matching, metadata, ckpt, str(candidate.dtype).removeprefix("torch."), g)
        session = Session(path, [m["value"] for m in matching.points.values()], options.provider, g, ckpt)
        models.loaded[key] = (session, matching)
    return models.loaded[key]


def open_model(path: Path):
    """The ModelProto of an .onnx file, its weights left on disk: refused unless it is a model with a graph whose
    external data all lies, complete, in files inside the model's directory. Checked before onnxruntime sees the
    file: it would read whatever path a tensor's location names."""
    import onnx  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ParityError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if size == 0:
        raise ParityError(f"{path}: empty file, not an ONNX model; export it again")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or an OSError
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ParityError(f"{path}: not a readable ONNX model ({why}); export it again") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.output:
        raise ParityError(f"{path}: not an ONNX model (no IR version, graph or outputs); give a .onnx model file")
    for tensor in _all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            _check_external(path, tensor)
    return model


def _all_tensors(model):
    """Every TensorProto of a model: initializers, sparse ones, node attributes, in subgraphs and functions too."""
    def in_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                sparse = ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + list(attr.sparse_tensors)
                for s in sparse:
                    yield from (s.values, s.indices)
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from in_graph(sub)

    def in_graph(graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
        yield from in_nodes(graph.node)

    yield from in_graph(model.graph)
    for function in model.functions:
        yield from in_nodes(function.node)


def _check_external(path: Path, tensor) -> None:
    """One tensor's external data: a relative location inside the model's directory, present and long enough."""
    fields = {entry.key: entry.value for entry in tensor.external_data}
    name = tensor.name or "(unnamed)"
    location = fields.get("location", "")
    base = path.parent
    parts = location.replace("\\", "/").split("/")
    target = base / location
    if not location or Path(location).is_absolute() or ".." in parts or "\0" in location \
            or not in_directory(target, base):
        raise ParityError(f"{path}: tensor {name!r} points its external data at {location[:100]!r}, outside the "
                          f"model's directory; keep the data file beside the .onnx and name it by a relative path")
    try:
        offset, length = int(fields.get("offset", 0)), (int(fields["length"]) if "length" in fields else None)
    except ValueError:
        raise ParityError(f"{path}: tensor {name!r} has a non-integer external data offset or length; export it "
                          f"again") from None
    needed = _nbytes(tensor)
    if offset < 0 or (length is not None and (length < 0 or (needed is not None and length != needed))):
        raise ParityError(f"{path}: tensor {name!r} has external data offset {offset} and length {length} for "
                          f"{needed} bytes of data; export it again")
    if not target.is_file():
        raise ParityError(f"{path}: tensor {name!r} keeps its data in {location!r}, which is missing beside the model; "
                          f"copy it next to {path.name}")
    end = offset + (length if length is not None else needed or 0)
    if target.stat().st_size < end:
        raise ParityError(f"{path}: {location} holds {target.stat().st_size} bytes, but tensor {name!r} needs bytes up "
                          f"to {end} (truncated); copy the complete file")


def _nbytes(tensor) -> int | None:
    """Bytes of a tensor's data, where its element type has a fixed width (None for strings and packed 4-bit)."""
    import onnx  # heavy: onnx, loaded when the kind runs, not with every kind (candidates.kinds)

    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except Exception:  # noqa: BLE001 - an element type numpy cannot hold (4-bit, string, or damage)
        return None
    packed = {getattr(onnx.TensorProto, kind, None) for kind in ("STRING", "INT4", "UINT4", "FLOAT4E2M1", "INT2",
                                                                  "UINT2")}
    if tensor.data_type in packed or any(d < 0 for d in tensor.dims):
        return None
    n = 1
    for d in tensor.dims:
        n *= d
    return n * itemsize


def _warn_about(matching: Matching, metadata: dict, ckpt, dtype: str | None, g: Graph) -> None:
    if matching.own_export:
        manifest = json.loads(metadata.get("parity.neutral.manifest", "{}"))
        family = manifest.get("source", {}).get("family")
        if family and family != ckpt.resolved.family:
            matching.warnings.append(f"the ONNX model was exported from a {family} checkpoint; the reference is "
                                     f"{ckpt.resolved.family}")
        graph_dtype = manifest.get("dtype")
    else:
        elem = g.types.get(g.outputs[0], (None, None))[0] if g.outputs else None
        graph_dtype = {1: "float32", 10: "float16", 16: "bfloat16", 11: "float64"}.get(elem)
    if dtype and graph_dtype and graph_dtype != dtype:
        matching.warnings.append(f"the ONNX graph computes in {graph_dtype} but --dtype is {dtype}: tolerances are "
                                 f"those of {dtype}; pass --dtype {graph_dtype}")


def _shorten(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def describe(path: Path, engine: dict | None = None) -> dict:
    """What the report's candidate entry adds: the weights by how the graph stores them (weights)."""
    found = weights(path)
    return {"tensor_types": found.types} if found is not None else {}


def same_weights(ckpt, path: Path, out: Path, engine: dict | None = None) -> dict:
    """--same-weights: the graph's own weights (dequantized where onnxruntime quantized them), and onnxruntime's
    arithmetic, as a reference (parity.engines.onnx.weights)."""
    file = onnx_file(Path(path))
    if file is None:
        raise ParityError(f"--same-weights: {path} is not an .onnx file")
    return read_back(ckpt, file, Path(out))


def _warnings(matching: Matching, wanted: list[str], matched: dict, unmatched: dict, layerwise: bool) -> list[str]:
    """What the report says of the matching: the points (and ops) not found, and how to name them."""
    warnings = list(matching.warnings)
    lacking = missing_note(unmatched, "ONNX graph")
    if lacking:
        warnings.append(lacking + ("; export it again with its ops as outputs (parity convert --to onnx "
                                   "--op-outputs)" if matching.own_export else ""))
    points = sorted((p for p in unmatched if not names.is_op(p)), key=names.point_order)
    if layerwise and len(wanted) > 1 and not set(matched) - {wanted[-1]}:
        warnings.append(f"no capture point of the ONNX graph could be matched beyond the final output: only "
                        f"{wanted[-1]} is compared; name values with --map POINT=VALUE")
    elif layerwise and points:
        warnings.append(f"{len(wanted) - len(points)} of {len(wanted)} capture points were found in the ONNX graph; "
                        f"not compared: {_shorten(points)}")
    return warnings


def make_runner(candidate, ids: torch.Tensor, feed):
    """Run the ONNX graph once and emit every capture point that could be matched."""
    if feed is not None:
        raise ParityError(f"--candidate {candidate.path}: --isolate is not possible for an ONNX graph (its layers cannot be "
                          f"fed the reference's inputs); run without --isolate")
    path, ckpt, notes = onnx_file(Path(candidate.path)) or Path(candidate.path), candidate.ckpt, candidate.notes
    layerwise = candidate.options.layerwise
    wanted = names.compared_points(ckpt, layerwise)
    ops = wanted_ops(ckpt, candidate.options)
    session, matching = _load(candidate, path, wanted + ops)
    hidden, vocab = hidden_width(ckpt), vocabulary(ckpt)

    def run(emit) -> None:
        values = session.run(session.feeds(ids, path), [m["value"] for m in matching.points.values()])
        b, s = ids.shape
        unmatched = {p: why for p, why in matching.unmatched.items() if not names.is_op(p)}
        for point in sorted(matching.points, key=names.point_order):
            if point in matching.layouts:
                continue
            value = matching.points[point]["value"]
            got = as_point(values[value], b, s, vocab if point == "logits" else hidden)
            if got is None:
                unmatched[point] = f"{value} has shape {list(values[value].shape)}, not [{b}, {s}, width]"
                continue
            emit(point, got)
        if ops and b == 1:
            unmatched.update({p: why for p, why in matching.unmatched.items() if names.is_op(p)})
            read_ops(matching, values.get, ckpt, s, emit, unmatched)
        matched = {p: m for p, m in matching.points.items() if p not in unmatched}
        notes.matching = {"points": matched, "unmatched": unmatched}
        for w in _warnings(matching, wanted, matched, unmatched, layerwise):
            notes.warn(w)

    return run


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """The prompt with an empty cache, then one token per step, each fed the ``present.*`` the step before
    returned as its ``past_key_values.*`` (by name) and its position; each step's matched points are emitted."""
    path, ckpt = onnx_file(Path(candidate.path)) or Path(candidate.path), candidate.ckpt
    session, matching = _load(candidate, path, names.compared_points(ckpt, candidate.options.layerwise))
    links = session.cache_outputs(path)
    hidden, vocab = hidden_width(ckpt), vocabulary(ckpt)

    needed = [m["value"] for m in matching.points.values()] + list(links.values())

    def run(emit) -> None:
        values = session.run(session.feeds(ids, path), needed)
        start = ids.shape[1]
        for step, token in enumerate(tokens, 1):
            past = {name: values[out] for name, out in links.items()}
            values = session.run(session.feeds(torch.tensor([[token]]), path, start, past), needed)
            start += 1
            for point in sorted(matching.points, key=names.point_order):
                value = matching.points[point]["value"]
                got = as_point(values[value], 1, 1, vocab if point == "logits" else hidden)
                if got is not None:
                    emit(step, point, got)

    return run


def arithmetic(out: Path):
    """onnxruntime's arithmetic (parity.engines.onnx.arithmetic) that same_weights saved in ``out``, or None."""
    return OrtArithmetic.load(Path(out))


def weights(path: Path, engine: dict | None = None):
    """How the graph stores its weights and which quantizer's form it holds (parity.engines.onnx.weights.stored),
    from its initializers' dims and types: external data is checked, never read (open_model refuses an unreadable
    file in one line, before anything else reads it)."""
    file = onnx_file(Path(path))
    return stored(open_model(file)) if file is not None else None
