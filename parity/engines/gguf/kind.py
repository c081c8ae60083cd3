"""GGUF files as candidates: run by llama.cpp itself (``llama-cpp-python``, ``pip install parity[llama]``).

The reference's token ids go into one batch with every position's logits requested; llama.cpp's graph
callback (``cb_eval`` in the context parameters) sees every tensor the graph computes, named as the model
code names them (``attn_norm-0``, ``l_out-0``, ``result_norm``, ...). The tensors in POINTS are read back as
they are computed and emitted under parity's capture-point names; the points llama.cpp does not materialise
are reported as not compared. With ``options.ops`` (``--points ops``, a drill-down) the operation-level points are
read from the same graph (parity.engines.gguf.ops: which tensor holds which op, the scores rebuilt from the softmax's
input, scale and mask, q/k rows put back in the reference's order); the reference's ops it lacks are named in a warning.
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
from pathlib import Path

import torch
from tokenizers import Tokenizer

from parity.checkpoint.inputs import leading_bos
from parity.dumps.mistakes import bos_id, classify
from parity.engines.common import emit_steps
from parity.engines.gguf import file as gguf_file
from parity.engines.gguf.arithmetic import Arithmetic
from parity.engines.gguf.ops import FUSED_NODES, OpCapture, missing, row_order
from parity.engines.gguf.weights import read_back
from parity.errors import ParityError
from parity.names import point_order
from parity.weights import FLOAT_TYPES, Tally, commonest

KIND = "gguf"
TAKES = "a GGUF file (.gguf)"

# llama.cpp graph tensor -> capture point ({i}: the layer). llama.cpp names the MLP's output "ffn_out" and then
# the residual sum after it "ffn_out" again: the first of the two is the MLP's output.
POINTS = {
    "embd": "embed",                    # the looked-up embeddings
    "inp_scaled": "embed",              # gemma*: the embeddings times sqrt(hidden)
    "attn_norm-{i}": "layers.{i}.attn_in",
    "attn_out-{i}": "layers.{i}.attn_out",
    "ffn_inp-{i}": "layers.{i}.mid",
    "sa_out-{i}": "layers.{i}.mid",     # gemma: the residual after attention
    "ffn_norm-{i}": "layers.{i}.mlp_in",
    "ffn_out-{i}": "layers.{i}.mlp_out",
    "l_out-{i}": "layers.{i}.out",
    "result_norm": "final_norm",
    "result_output": "logits",
}
# the points some architectures' graphs leave unnamed (qwen2, qwen3 and gemma name no attention output): the
# tensor computed from the weight, which the graph names as the file does; a bias's sum, where the file has one,
# replaces its matmul. A point the graph names is read there instead (gemma2's post-norm, llama's attn_out).
CONSUMERS = {
    "blk.{i}.attn_output.weight": "layers.{i}.attn_out",
    "blk.{i}.attn_output.bias": "layers.{i}.attn_out",
}
_GGML_F32, _GGML_F16 = 0, 1
_NE_OFFSET = 16  # struct ggml_tensor: enum ggml_type type; (padding); ggml_backend_buffer * buffer; int64_t ne[4]
# ... size_t nb[4]; enum ggml_op op; int32_t op_params[16]; int32_t flags; ggml_tensor * src[10]; view_src;
# view_offs; data; char name[64]: src[] sits 104 bytes before the name (checked against ggml_get_name)
_SRC_BEFORE_NAME, _N_SRC = 104, 2
_PARAMS_BEFORE_NAME = 172  # int32_t op_params[16] (read as floats: a softmax's scale and ALiBi bias)
_LOCK = threading.Lock()  # one llama.cpp run at a time: its logging and backend state are process-wide


def _point(name: str, table: dict[str, str], layer: int | None = None) -> str | None:
    """The capture point of graph tensor ``name``: ``attn_norm-3`` by its own index; a name llama.cpp gives no index
    (gemma2's ``ffn_post_norm``) by ``layer``, the index of the indexed tensor the graph computed last."""
    m = re.fullmatch(r"(.+)-(\d+)", name)
    if m and f"{m.group(1)}-{{i}}" in table:
        return table[f"{m.group(1)}-{{i}}"].replace("{i}", m.group(2)) or None
    point = table.get(name) or None
    if point is not None and "{i}" in point:
        return None if layer is None else point.replace("{i}", str(layer))
    return point


def _ggml():
    """libggml-base (shipped beside libllama by llama-cpp-python), with the accessors the callback uses."""
    import llama_cpp  # optional: llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libggml-base*.so*")) + sorted(lib_dir.glob("libggml-base*.dylib")) \
        + sorted(lib_dir.glob("ggml-base*.dll"))
    if not found:
        raise ParityError(f"llama-cpp-python at {lib_dir.parent} has no libggml-base library; reinstall it")
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.name_at = ctypes.cast(lib.ggml_get_name, ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p))
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_op_desc.restype = ctypes.c_char_p
    lib.ggml_op_desc.argtypes = [ctypes.c_void_p]
    return lib


def _read(lib, t: int) -> torch.Tensor | None:
    kind = ctypes.c_int.from_address(t).value
    if kind not in (_GGML_F32, _GGML_F16) or not lib.ggml_is_contiguous(t):
        return None
    ne = (ctypes.c_int64 * 4).from_address(t + _NE_OFFSET)
    dtype = torch.float32 if kind == _GGML_F32 else torch.float16
    out = torch.empty(ne[3], ne[2], ne[1], ne[0], dtype=dtype)
    if out.numel() * out.element_size() != lib.ggml_nbytes(t):
        return None
    lib.ggml_backend_tensor_get(t, out.data_ptr(), 0, lib.ggml_nbytes(t))
    return out.float()


class _Node:
    """A graph tensor as parity.engines.gguf.ops reads it (its Node protocol): name, op, sources, op parameters."""

    def __init__(self, lib, address: int, src_ok: bool, name: str | None = None):
        self.lib, self.address, self.src_ok = lib, address, src_ok
        self.name = name if name is not None else (lib.ggml_get_name(address) or b"").decode(errors="replace")
        self.op = (lib.ggml_op_desc(address) or b"").decode(errors="replace")

    def read(self) -> torch.Tensor | None:
        return _read(self.lib, self.address)

    def src(self, k: int) -> _Node | None:
        if not self.src_ok or k >= _N_SRC:
            return None
        address = (ctypes.c_void_p * _N_SRC).from_address(self.lib.name_at(self.address) - _SRC_BEFORE_NAME)[k]
        return _Node(self.lib, address, self.src_ok) if address else None

    def param(self, k: int) -> float:
        at = self.lib.name_at(self.address) - _PARAMS_BEFORE_NAME + 4 * k
        return ctypes.c_float.from_address(at).value if self.src_ok else 0.0


def _layout_known(lib) -> bool:
    """Whether struct ggml_tensor is laid out as _SRC_BEFORE_NAME assumes: a tensor made here, named, whose
    src[0] is set through ggml's own API, reads back from that offset (else no point is read by a weight's use)."""
    try:
        class Params(ctypes.Structure):  # struct ggml_init_params, passed by value
            _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

        lib.ggml_init.restype = ctypes.c_void_p
        lib.ggml_init.argtypes = [Params]
        lib.ggml_new_tensor_1d.restype = lib.ggml_add.restype = lib.ggml_scale.restype = ctypes.c_void_p
        lib.ggml_new_tensor_1d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
        lib.ggml_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.ggml_scale.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]
        lib.ggml_free.argtypes = [ctypes.c_void_p]
        ctx = lib.ggml_init(Params(1 << 16, None, True))
        try:
            a = lib.ggml_new_tensor_1d(ctx, _GGML_F32, 4)
            b = lib.ggml_new_tensor_1d(ctx, _GGML_F32, 4)
            c = lib.ggml_add(ctx, a, b)
            src = (ctypes.c_void_p * 2).from_address(lib.name_at(c) - _SRC_BEFORE_NAME)
            scaled = lib.ggml_scale(ctx, a, 2.5)  # op_params[0] = 2.5
            param = ctypes.c_float.from_address(lib.name_at(scaled) - _PARAMS_BEFORE_NAME).value
            return src[0] == a and src[1] == b and param == 2.5
        finally:
            lib.ggml_free(ctx)
    except (AttributeError, OSError, ValueError):
        return False


class GGUFRun:
    """One llama.cpp model and context: ``run(ids)`` -> {capture point: tensor [1, S, width]}; with ``ops``, the
    operation-level points too (parity.engines.gguf.ops), q/k rows in the order of the reference ``resolved``."""

    def __init__(self, path: Path, n_tokens: int, points: dict[str, str] | None = None, ops: bool = False,
                 resolved=None, fuse: dict[str, list[str]] | None = None):
        try:
            import llama_cpp  # optional: llama_cpp
        except ImportError:
            raise ParityError("a GGUF candidate runs in llama.cpp: pip install 'parity[llama]' (llama-cpp-python "
                              "builds llama.cpp; see docs/gguf.md for the build flags)") from None
        self.llama_cpp, self.lib = llama_cpp, _ggml()
        self.points = {**POINTS, **(points or {})}  # the architecture's own meanings (the adapter's [gguf] points)
        llama_cpp.llama_backend_init()
        self.log: list[str] = []  # llama.cpp's own words, for an error message
        self._quiet = llama_cpp.llama_log_callback(
            lambda level, text, data: self.log.append((text or b"").decode(errors="replace").strip()))
        llama_cpp.llama_log_set(self._quiet, ctypes.c_void_p(0))
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            said = next((line for line in reversed(self.log) if "error loading model" in line), None)
            raise ParityError(f"--candidate {path}: llama.cpp cannot load it ("
                              f"{said.split('error loading model:', 1)[1].strip() if said else 'see llama.cpp log'}): a damaged file, "
                              f"or an architecture, tensor or setting this llama.cpp does not know")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.captured: dict[str, torch.Tensor] = {}
        self.by_use: set[str] = set()  # captured points read from a weight's use (CONSUMERS), not by name
        self.layer: int | None = None
        self.src_ok = _layout_known(self.lib)
        self.ops = None
        if ops:
            self.ops = OpCapture(row_order(resolved, llama_cpp.llama_model_rope_type(self.model)),
                                 *_fused_ops(fuse or {}, resolved))
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = max(n_tokens, 16)
        cparams.n_batch = cparams.n_ubatch = max(n_tokens, 1)
        cparams.n_threads = cparams.n_threads_batch = max(1, torch.get_num_threads())
        # llama.cpp's default KV cache is F16: the keys and values of a float32 model would be rounded before
        # attention. The cache holds what the model computes, in float32, so that only the port is compared.
        cparams.type_k = cparams.type_v = _GGML_F32
        # LLAMA_FLASH_ATTN_TYPE_DISABLED: the CPU flash kernel rounds Q to F16, and it fuses q·kᵀ, the softmax and
        # the product with v into one op, so that the ops read scores, probabilities and context from would not exist
        cparams.flash_attn_type = 0
        cparams.cb_eval = self._callback
        cparams.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise ParityError(f"--candidate {path}: llama.cpp could not make a context for {n_tokens} tokens")

    def _on_tensor(self, t, ask, _user) -> bool:
        name = (self.lib.ggml_get_name(t) or b"").decode(errors="replace")
        indexed = re.fullmatch(r".+-(\d+)", name)
        if indexed:  # the graph is walked in order: an unindexed name belongs to the layer of the last indexed one
            self.layer = int(indexed.group(1))
        point = _point(name, self.points, self.layer)
        consumed = None if point is not None else self._consumer(t)
        node = _Node(self.lib, t, self.src_ok, name) if self.ops is not None else None
        if ask:
            return point is not None or consumed is not None or (node is not None and self.ops.wants(node))
        if node is not None:
            self.ops.take(node)
        # the first "ffn_out" is the MLP's output; a point the graph names replaces one read from a weight's use
        if (point is not None and (point not in self.captured or point in self.by_use)) or (
                consumed is not None and (consumed not in self.captured or consumed in self.by_use)):
            x = _read(self.lib, t)
            if x is not None:
                self.captured[point or consumed] = x.reshape(-1, x.shape[-1]).unsqueeze(0).clone()
                if point is not None:
                    self.by_use.discard(point)
                else:
                    self.by_use.add(consumed)
        return True

    def _consumer(self, t) -> str | None:
        """The point (CONSUMERS) a tensor computed from one of the file's named weights is, else None."""
        if not self.src_ok:
            return None
        sources = (ctypes.c_void_p * _N_SRC).from_address(self.lib.name_at(t) - _SRC_BEFORE_NAME)
        for src in sources:
            if not src:
                continue
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", (self.lib.ggml_get_name(src) or b"").decode(errors="replace"))
            point = CONSUMERS.get(f"blk.{{i}}.{m.group(2)}") if m else None
            if point is not None:
                return point.replace("{i}", m.group(1))
        return None

    def run(self, ids: list[int], start: int = 0) -> dict[str, torch.Tensor]:
        """Run ``ids`` at positions ``start``, ``start + 1``, ...: the prompt (start 0), or a decode step after
        it, which attends to the keys and values llama.cpp's own cache kept from the calls before."""
        llama_cpp = self.llama_cpp
        n = len(ids)
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            for k, token in enumerate(ids):
                batch.token[k] = token
                batch.pos[k] = start + k
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = 0
                batch.logits[k] = True
            batch.n_tokens = n
            self.captured, self.by_use, self.layer = {}, set(), None
            if self.ops is not None:
                self.ops.begin(n, start + n)  # a cache filled from cell 0 in order: its first start + n cells
            if llama_cpp.llama_decode(self.ctx, batch) != 0:
                raise ParityError(f"llama.cpp failed to decode {'the prompt' if start == 0 else f'position {start}'}")
            if self.ops is not None:
                self.captured.update(self.ops.captured)
            if "logits" not in self.captured:
                raw = llama_cpp.llama_get_logits(self.ctx)
                self.captured["logits"] = torch.tensor(raw[: n * self.vocab]).reshape(1, n, self.vocab)
        finally:
            llama_cpp.llama_batch_free(batch)
        return self.captured

    def tokenize(self, text: str, special: bool = False) -> list[int] | None:
        """llama.cpp's own tokenization of ``text``: no BOS added, or (``special``) the BOS the file says to add;
        None for a file without a vocabulary."""
        llama_cpp = self.llama_cpp
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        if llama_cpp.llama_vocab_type(vocab) == 0:  # LLAMA_VOCAB_TYPE_NONE
            return None
        raw = text.encode()
        room = len(raw) + 16
        out = (llama_cpp.llama_token * room)()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), out, room, special, True)
        return list(out[:n]) if n >= 0 else None

    def close(self) -> None:
        self.llama_cpp.llama_free(self.ctx)
        self.llama_cpp.llama_model_free(self.model)


def same_weights(ckpt, path: Path, out: Path, engine: dict | None = None) -> dict:
    """--same-weights: the file's own weights, and llama.cpp's arithmetic, as a reference
    (parity.engines.gguf.weights)."""
    return read_back(ckpt, Path(path), Path(out))


def describe(path: Path, engine: dict | None = None) -> dict:
    """What the report's candidate entry adds: how many tensors the file holds of each GGML type (its header only,
    checked: a malformed file is refused in one line; nothing is dequantized)."""
    return {"tensor_types": weights(path).types}


def weights(path: Path, engine: dict | None = None):
    """How the file stores its weights, from its header alone (a malformed file is refused in one line; nothing is
    dequantized): tensors and weights per GGML type, stored bits per weight over every tensor (each type's bytes
    per block, scales included), llama.cpp's name of the mix (general.file_type; without it, the type most
    matrices are in), and where the output (or the embedding it is tied to) and the token embedding are stored
    in another type than the mix's own (llama.cpp's mixes keep them wider)."""
    header, names = gguf_file.read_header(Path(path)), gguf_file.ggml_types()
    tally, matrices, kinds = Tally(), {}, {}
    for t in header.tensors:
        kind = kinds[t.name] = names[t.type]
        elements = math.prod(t.shape)
        tally.add(kind, elements, t.nbytes)
        if len(t.shape) > 1:
            matrices[kind] = matrices.get(kind, 0) + 1
    named = gguf_file.file_type(header)
    if named is None:
        scheme = commonest(matrices) or ""
    else:
        scheme = "" if named in FLOAT_TYPES else named
    if not scheme:
        return tally.weights()
    # the type the mix is named after ("Q4_K_M": Q4_K, "Q8_0": itself), even where the file's rows fell back to
    # another; an IQ mix's is the type most matrices are in
    main = next((t for t in (scheme, scheme.rsplit("_", 1)[0]) if t in names.values()), commonest(matrices))
    return tally.weights(scheme, _apart(kinds, main))


def _apart(kinds: dict[str, str], main: str | None) -> tuple[str, ...]:
    """The output's and the token embedding's types where they are not the mix's main type ("Q6_K output")."""
    notes = []
    tied = "output.weight" not in kinds
    output = kinds.get("output.weight", kinds.get("token_embd.weight"))
    if output is not None and output != main:
        notes.append(f"{output} {'tied output' if tied else 'output'}")
    embedding = kinds.get("token_embd.weight")
    if not tied and embedding is not None and embedding != main:
        notes.append(f"{embedding} token embedding")
    return tuple(notes)


def detect(path: Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def make_runner(candidate, ids: torch.Tensor, feed):
    ckpt = candidate.ckpt
    if ids.shape[0] != 1:
        raise ParityError("a GGUF candidate runs one sequence at a time")

    def run(emit) -> None:
        with _LOCK:
            engine = _engine(candidate, ids.shape[1])
            try:
                captured = engine.run(ids[0].tolist())
                _compare_tokenization(candidate.notes, ckpt, engine, ids[0].tolist())
                _note_ops(candidate, engine, captured)
            finally:
                engine.close()
        for name in sorted(captured, key=point_order):
            emit(name, captured[name])

    return run


def make_decoder(candidate, ids: torch.Tensor, tokens: list[int]):
    """The prompt, then each token as one llama.cpp decode step (its own KV cache, F32 as above), each step's
    capture points read through the same eval callback."""
    if ids.shape[0] != 1:
        raise ParityError("a GGUF candidate runs one sequence at a time")

    def run(emit) -> None:
        s = ids.shape[1]
        with _LOCK:
            engine = _engine(candidate, s + len(tokens), ops=False)  # decode steps compare layer points only
            try:
                engine.run(ids[0].tolist())
                steps = [engine.run([token], start=s + k) for k, token in enumerate(tokens)]
            finally:
                engine.close()
        emit_steps(steps, emit)

    return run


def _fused_ops(fuse: dict[str, list[str]], resolved) -> tuple[dict[str, list[str]], object]:
    """The fused graph tensors of the file (the adapter's [gguf] fuse) -> the ops side by side in them, and the
    reference's width of each op, to split them by."""
    fused = {}
    for target, parts in fuse.items():
        nodes = FUSED_NODES.get(target.removeprefix("blk.{i}."), ())
        ops = [part.removeprefix("layers.{i}.").removesuffix(".weight") for part in parts]
        fused.update({node: ops for node in nodes})
    if not fused or resolved is None:
        return {}, None

    def width(i: int, op: str) -> int:
        heads = {"attn.q": "attention.heads", "attn.k": "attention.kv_heads", "attn.v": "attention.kv_heads"}
        if op in heads:
            return resolved.layer(heads[op], i) * resolved.layer("attention.head_dim", i)
        return resolved.layer("mlp.intermediate_size", i)  # mlp.gate, mlp.up

    return fused, width


def _engine(candidate, n_tokens: int, ops: bool = True) -> GGUFRun:
    """The candidate's llama.cpp run, with the architecture's own point meanings (its adapter's [gguf] points) and,
    where the check wants them, the operation-level points."""
    ckpt = candidate.ckpt
    spec = ckpt.adapter.spec.gguf if ckpt is not None else None
    return GGUFRun(Path(candidate.path), n_tokens, spec.points if spec is not None else None,
                   ops=ops and candidate.options.ops, resolved=ckpt.resolved if ckpt is not None else None,
                   fuse=spec.fuse if spec is not None else None)


def _note_ops(candidate, engine: GGUFRun, captured: dict) -> None:
    """Warn of the reference's ops llama.cpp's graph did not give (and of what it said while reading them)."""
    if engine.ops is None:
        return
    for text in engine.ops.notes:
        candidate.notes.warn(f"llama.cpp: {text}")
    expected = [c.name for c in getattr(candidate.ckpt.resolved, "ops", ())] if candidate.ckpt is not None else []
    lacking = missing(captured, expected)  # the reference's ops: concrete names (layers.3.attn.q)
    if lacking:
        candidate.notes.warn(f"llama.cpp's graph exposes no {', '.join(lacking)}: not compared")


def _compare_tokenization(notes, ckpt, engine: GGUFRun, ids: list[int]) -> None:
    """The prompt's text (the reference's ids, decoded by its tokenizer) re-tokenized by llama.cpp with the file's
    own vocabulary: a different split is a porting bug of its own, reported as a warning (the check itself feeds
    the reference's ids)."""
    path = getattr(ckpt, "path", None)
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    bos = leading_bos(tokenizer)
    ids = ids[1:] if bos is not None and ids[:1] == [bos] else ids  # the text's own ids, after the BOS added to it
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if tokenizer.encode(text, add_special_tokens=False).ids != ids:
        return  # not the tokenization of a text (generated ids, --length): there is nothing to re-tokenize
    theirs = engine.tokenize(text)
    if theirs is None:
        return
    if theirs == ids:
        _compare_bos(notes, ckpt, tokenizer, engine, text)
        return
    k = next((k for k, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
    got = theirs[k] if k < len(theirs) else "nothing"
    warning = (f"llama.cpp's tokenizer (the GGUF's own vocabulary) splits this prompt otherwise: {len(theirs)} ids "
               f"for the reference's {len(ids)}, first different at position {k} (reference "
               f"{ids[k] if k < len(ids) else 'nothing'}, llama.cpp {got}); the check fed the reference's ids")
    notes.warn(warning)


def _compare_bos(notes, ckpt, tokenizer, engine: GGUFRun, text: str) -> None:
    """The same text with the specials each side adds to a text (the reference's tokenizer: its post-processor's;
    llama.cpp: the file's add_bos_token): a BOS added twice or left out is an input mistake of the file
    (parity.dumps.mistakes), named in a warning (the check fed the reference's ids)."""
    ours, theirs = tokenizer.encode(text).ids, engine.tokenize(text, special=True)
    if theirs is None or theirs == ours:
        return
    found = classify(theirs, ours, bos_id(ckpt.config), runner="llama.cpp")
    what = (f"{found.bug}: {found.evidence}" if found is not None else
            f"{len(theirs)} ids for the reference's {len(ours)}, starting {theirs[:2]} for {ours[:2]}")
    notes.warn(f"llama.cpp adds other special tokens to a text than the reference's tokenizer (the GGUF's "
               f"tokenizer.ggml.add_bos_token): {what}; the check fed the reference's ids")


def validate(path: Path, adapter_dirs=()) -> None:
    """Refuse, before any model loads, a malformed GGUF file or one of an architecture no adapter covers."""
    gguf_file.validate(Path(path), adapter_dirs)


def arithmetic(out: Path):
    """llama.cpp's CPU arithmetic (parity.engines.gguf.arithmetic) that same_weights saved in ``out``, or None."""
    return Arithmetic.load(Path(out))
