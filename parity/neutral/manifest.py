"""A neutral directory as the executor reads it: ``manifest.json``'s schema and cross-checks (a damaged or
hand-edited manifest is refused before anything runs), its content hashes, and loading its tensors (whole, or a
layer at a time). parity.neutral.converter writes the layout; this module reads it back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Optional

from pydantic import Field, model_validator
from safetensors import safe_open

from parity.checkpoint import plain_file_name
from parity.errors import ParityError
from parity.storage.jsonfile import StrictSpec, check_schema, read_json
from parity.storage.shards import ALGORITHMS, hash_file, read_header

if TYPE_CHECKING:
    import torch

FORMAT = "parity-neutral"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the model dtypes a manifest may state (DTYPES: as torch's)
# Block norms by where they sit (see parity/names.py): the executor applies whichever are present.
BLOCK_NORMS = ("attn_norm", "attn_post_norm", "attn_res_norm", "mlp_norm", "mlp_post_norm", "mlp_res_norm")
EXTRA_NORMS = ("attn.q_norm", "attn.k_norm", "attn.v_norm", "attn.q_a_norm", "attn.kv_a_norm", "moe.router_norm",
               "moe_norm", "moe_post_norm", "mlp_dense_post_norm", "pli_post_norm")


# The manifest as the executor reads it (parity/executor): every field it indexes, with the values it knows.
# Checked at load time, so that a damaged or hand-edited manifest is refused before anything runs.

_Pos = Annotated[int, Field(gt=0)]
_Count = Annotated[int, Field(ge=0)]
_Num = Annotated[float, Field(allow_inf_nan=False)]
_PosNum = Annotated[float, Field(allow_inf_nan=False, gt=0)]
_NonNegNum = Annotated[float, Field(allow_inf_nan=False, ge=0)]
_Activation = Literal["gelu_exact", "gelu_tanh", "silu", "relu"]  # executor.ops.ACTIVATIONS
STORED_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}  # name -> safetensors'


class _NormSpec(StrictSpec):
    kind: Literal["rmsnorm", "layernorm"]
    eps: _NonNegNum
    upcast: Literal["float32", "none"]
    weight_dtype: Literal["float32", "model"]
    weight: bool
    bias: bool
    folded_offset: bool


_Norm = Optional[_NormSpec]


class _RopeSpec(StrictSpec):
    theta: _PosNum
    style: Literal["half", "interleaved"]
    rotary_dim: _Pos
    head_dim: _Pos
    scaling: Optional[dict[str, Any]] = None
    max_positions: Optional[_Pos]
    compute_dtype: Literal["model", "float32"] = "model"


class _MlaSpec(StrictSpec):
    q_lora_rank: Optional[_Pos]
    kv_lora_rank: _Pos
    qk_nope_head_dim: _Count
    qk_rope_head_dim: _Pos
    v_head_dim: _Pos
    q_a_norm: _Norm
    kv_a_norm: _Norm


class _Temperature(StrictSpec):
    floor: _Pos
    scale: _Num


class _AttentionSpec(StrictSpec):
    kind: Literal["mha", "mla"]
    heads: _Pos
    kv_heads: _Pos
    head_dim: _Pos
    scale: _PosNum
    softcap: Optional[_PosNum]
    causal: bool
    sliding_window: Optional[_Count]
    chunk_size: Optional[_Pos] = None
    temperature: Optional[_Temperature] = None
    qk_norm: Literal["none", "per_head", "full_width"]
    qk_norm_after_rope: bool = False
    q_norm: _Norm
    k_norm: _Norm
    v_norm: _Norm
    k_eq_v: bool
    kv_shared_from: Optional[_Count]
    rope: Optional[_RopeSpec]
    mla: Optional[_MlaSpec]
    sinks: bool = False


class _MoeSpec(StrictSpec):
    routing: Literal["softmax", "sigmoid", "topk_softmax", "topk_sigmoid"]
    experts: _Pos
    top_k: _Pos
    groups: Optional[_Pos] = None
    groups_kept: Optional[_Pos] = None
    renormalise: bool = False
    scale: Optional[_Num] = None
    shared_experts: Optional[_Count] = None
    shared_intermediate_size: Optional[_Pos] = None
    shared_gate: bool = False
    intermediate_size: _Pos
    activation: _Activation
    router_norm: _Norm = None
    router_input_scale: Optional[_Num] = None
    router_dtype: Literal["float32", "model"]
    weights_dtype: Literal["float32", "model"] = "float32"
    weights_input: bool = False
    expert_norm: _Norm
    expert_post_norm: _Norm
    dense_post_norm: _Norm
    glu_limit: Optional[_PosNum] = None
    glu_alpha: _PosNum = 1.0
    glu_up_offset: _Num = 0.0


class _MlpSpec(StrictSpec):
    gated: bool
    activation: _Activation
    intermediate_size: _Pos
    moe: Optional[_MoeSpec]
    glu_limit: Optional[_PosNum] = None
    glu_alpha: _PosNum = 1.0
    glu_up_offset: _Num = 0.0
    parallel: bool = False  # beside attention, on the layer's input (GPT-NeoX's parallel residual)
    shared_norm: bool = False  # parallel, reading attention's own normed input (Phi: one norm per layer)


class _BlockNorms(StrictSpec):
    attn_norm: _Norm
    attn_post_norm: _Norm
    attn_res_norm: _Norm
    mlp_norm: _Norm
    mlp_post_norm: _Norm
    mlp_res_norm: _Norm


class _PerLayerInput(StrictSpec):
    post_norm: _Norm


class _LayerSpec(StrictSpec):
    norms: _BlockNorms
    attention: _AttentionSpec
    mlp: _MlpSpec
    per_layer_input: Optional[_PerLayerInput]
    residual_scale: _PosNum = 1.0


class _PerLayerEmbedding(StrictSpec):
    size: _Pos
    scale: _Num
    projection_scale: _Num
    combine_scale: _Num
    norm: _Norm


class _EmbeddingSpec(StrictSpec):
    scale: _Num
    scale_dtype: Literal["model", "float32", "bfloat16"]  # bfloat16: a port's mistake (bugs: embed-scale-rounded)
    positions: Literal["rope", "learned"]
    max_positions: Optional[_Pos]
    token_types: _Count
    norm: _Norm
    per_layer_input: Optional[_PerLayerEmbedding]


class _HeadTransform(StrictSpec):
    activation: _Activation
    norm: _Norm


class _HeadSpec(StrictSpec):
    tied: bool
    softcap: Optional[_PosNum]
    transform: Optional[_HeadTransform]
    scale: _PosNum = 1.0


class _TensorSpec(StrictSpec):
    shape: list[_Count]
    dtype: Literal["float32", "bfloat16", "float16", "float64"]
    transposed: bool = False
    interleaved: _Count = 0  # a part of a fused tensor whose parts were interleaved in that many blocks (per head)
    file: Optional[str] = None


class _FileSpec(StrictSpec):
    blake3_tensors: Optional[str] = None  # HASH; manifests written before it have blake3 or sha256 (of the file)
    blake3: Optional[str] = None
    sha256: Optional[str] = None
    bytes: _Count

    @model_validator(mode="after")
    def _one_hash(self) -> _FileSpec:
        if sum(h is not None for h in (self.blake3_tensors, self.blake3, self.sha256)) != 1:
            raise ValueError("needs one hash: blake3_tensors (or blake3 or sha256, in manifests written before)")
        return self


class _Source(StrictSpec):
    family: str
    hash: Literal["blake3_tensors", "blake3", "sha256"] = "sha256"  # of files; absent before parity used BLAKE3
    rope_style: Optional[Literal["half", "interleaved"]] = None  # the checkpoint's; absent before ops (docs/ops.md)


class _ManifestSpec(StrictSpec):
    dtype: Literal["float32", "bfloat16", "float16"]
    source: _Source
    vocab_size: _Pos
    hidden_size: _Pos
    num_layers: _Pos
    rope_style: Optional[Literal["half", "interleaved"]]
    embedding: _EmbeddingSpec
    layers: list[_LayerSpec]
    final_norm: _Norm
    head: Optional[_HeadSpec]
    capture_points: list[str]
    tensors: dict[str, _TensorSpec]
    files: Annotated[dict[str, _FileSpec], Field(min_length=1)]


# RoPE scaling parameters per type, as parity/rope.py reads them: (required, optional) -> kind of value
_SCALING_PARAMS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "default": ({}, {}),
    "linear": ({"factor": "positive"}, {}),
    "dynamic": ({"factor": "positive"}, {}),
    "proportional": ({}, {"factor": "positive", "partial_rotary_factor": "fraction"}),
    "llama3": ({"factor": "positive", "low_freq_factor": "positive", "high_freq_factor": "positive"},
               {"original_max_position_embeddings": "size"}),
    "yarn": ({}, {"factor": "positive", "original_max_position_embeddings": "size", "attention_factor": "positive",
                  "beta_fast": "positive", "beta_slow": "positive", "mscale": "number", "mscale_all_dim": "number",
                  "truncate": "bool"}),
    "longrope": ({"long_factor": "factors", "short_factor": "factors"},
                 {"factor": "positive", "original_max_position_embeddings": "size", "attention_factor": "positive"}),
}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_SCALING_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "positive": ("a positive number", lambda x: _finite(x) and x > 0),
    "number": ("a finite number", _finite),
    "fraction": ("a number in (0, 1]", lambda x: _finite(x) and 0 < x <= 1),
    "size": ("a positive integer", lambda x: isinstance(x, int) and not isinstance(x, bool) and x > 0),
    "bool": ("true or false", lambda x: isinstance(x, bool)),
    "factors": ("a list of positive numbers", lambda x: isinstance(x, list) and all(_finite(v) and v > 0 for v in x)),
}


def _check_scaling(rope: dict, where: str) -> list[str]:
    """Problems with one layer's RoPE scaling (parity/rope.py SCALINGS), as 'where: what' strings."""
    scaling = rope.get("scaling") or {}
    kind = scaling.get("rope_type", "default")
    if not isinstance(kind, str) or kind not in _SCALING_PARAMS:
        return [f"{where}.rope_type: unknown RoPE scaling type {str(kind)[:30]!r}; known: {', '.join(_SCALING_PARAMS)}"]
    required, optional = _SCALING_PARAMS[kind]
    problems = [f"{where}: {kind} scaling needs {key}" for key in required if scaling.get(key) is None]
    for key, need in {**required, **optional}.items():
        value = scaling.get(key)
        label, ok = _SCALING_KINDS[need]
        if value is not None and not ok(value):
            problems.append(f"{where}.{key}: must be {label} (got {json.dumps(value)[:40]})")
    if problems:
        return problems
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        problems.append(f"{where}: high_freq_factor must exceed low_freq_factor")
    pairs = rope["rotary_dim"] // 2
    if kind == "longrope" and not len(scaling["long_factor"]) == len(scaling["short_factor"]) == pairs:
        problems.append(f"{where}: long_factor and short_factor need rotary_dim / 2 = {rope['rotary_dim'] // 2} values")
    needs_length = kind == "dynamic" or (kind in ("llama3", "yarn", "longrope")
                                         and scaling.get("original_max_position_embeddings") is None)
    if needs_length and rope.get("max_positions") is None:
        problems.append(f"{where}: {kind} scaling needs max_positions")
    return problems


def executor_tensors(m: dict) -> dict[str, tuple[int, ...]]:
    """The tensors the executor indexes for this manifest, with the shapes its sizes imply."""
    v, d = m["vocab_size"], m["hidden_size"]
    e = m["embedding"]
    out: dict[str, tuple[int, ...]] = {"embed.tokens.weight": (v, d)}
    if e["positions"] == "learned":
        out["embed.positions.weight"] = (e["max_positions"] or 0, d)
    if e["token_types"]:
        out["embed.token_types.weight"] = (e["token_types"], d)
    pli = e["per_layer_input"]
    if pli is not None:
        out["embed.per_layer_tokens.weight"] = (v, m["num_layers"] * pli["size"])
        out["embed.per_layer_projection.weight"] = (m["num_layers"] * pli["size"], d)
    if m["head"] is not None and not m["head"]["tied"]:
        out["lm_head.weight"] = (v, d)
    for i, layer in enumerate(m["layers"]):
        p = f"layers.{i}."
        att, mlp = layer["attention"], layer["mlp"]
        h = att["heads"]
        if att["mla"] is not None:
            mla = att["mla"]
            nope, rot, vd = mla["qk_nope_head_dim"], mla["qk_rope_head_dim"], mla["v_head_dim"]
            if mla["q_lora_rank"] is None:
                out[p + "attn.q.weight"] = (h * (nope + rot), d)
            else:
                out[p + "attn.q_a.weight"] = (mla["q_lora_rank"], d)
                out[p + "attn.q_b.weight"] = (h * (nope + rot), mla["q_lora_rank"])
            out[p + "attn.kv_a.weight"] = (mla["kv_lora_rank"] + rot, d)
            out[p + "attn.kv_b.weight"] = (h * (nope + vd), mla["kv_lora_rank"])
            out[p + "attn.o.weight"] = (d, h * vd)
        else:
            dh = att["head_dim"]
            out[p + "attn.q.weight"] = (h * dh, d)
            if att["kv_shared_from"] is None:
                out[p + "attn.k.weight"] = (att["kv_heads"] * dh, d)
                if not att["k_eq_v"]:
                    out[p + "attn.v.weight"] = (att["kv_heads"] * dh, d)
            out[p + "attn.o.weight"] = (d, h * dh)
        moe = mlp["moe"]
        if moe is None or moe["dense_post_norm"] is not None:  # a dense MLP runs
            size = mlp["intermediate_size"]
            out[p + "mlp.up.weight"] = (size, d)
            out[p + "mlp.down.weight"] = (d, size)
            if mlp["gated"]:
                out[p + "mlp.gate.weight"] = (size, d)
        if moe is not None:
            out[p + "moe.router.weight"] = (moe["experts"], d)
            size = moe["intermediate_size"]
            for k in range(moe["experts"]):
                out.update({f"{p}moe.experts.{k}.gate.weight": (size, d), f"{p}moe.experts.{k}.up.weight": (size, d),
                            f"{p}moe.experts.{k}.down.weight": (d, size)})
        if layer["per_layer_input"] is not None and pli is not None:
            out[p + "pli.gate.weight"] = (pli["size"], d)
            out[p + "pli.proj.weight"] = (d, pli["size"])
    return out


def _cross_checks(m: dict) -> list[str]:
    """What the schema cannot say alone: counts that must agree, sizes that must divide, layers that must exist."""
    problems = []
    if len(m["layers"]) != m["num_layers"]:
        problems.append(f"layers: {len(m['layers'])} entries for num_layers {m['num_layers']}")
    for i, layer in enumerate(m["layers"]):
        where = f"layers.{i}.attention"
        att = layer["attention"]
        rope, mla = att["rope"], att["mla"]
        if (att["kind"] == "mla") != (mla is not None):
            problems.append(f"{where}: kind {att['kind']!r} but mla is {'set' if mla else 'null'}")
        if mla is None and att["heads"] % att["kv_heads"]:
            problems.append(f"{where}: heads {att['heads']} is not a multiple of kv_heads {att['kv_heads']}")
        if att["kv_shared_from"] is not None and att["kv_shared_from"] >= i:
            problems.append(f"{where}.kv_shared_from: {att['kv_shared_from']} is not an earlier layer")
        if mla is not None and rope is None:
            problems.append(f"{where}: MLA needs rope")
        if rope is not None:
            width = mla["qk_rope_head_dim"] if mla is not None else att["head_dim"]
            if rope["rotary_dim"] % 2 or rope["rotary_dim"] > width:
                problems.append(f"{where}.rope.rotary_dim: {rope['rotary_dim']} must be even and at most {width}")
            problems += _check_scaling(rope, f"{where}.rope.scaling")
        moe = layer["mlp"]["moe"]
        if moe is not None:
            where = f"layers.{i}.mlp.moe"
            groups = moe.get("groups") or 1
            if moe["top_k"] > moe["experts"]:
                problems.append(f"{where}: top_k {moe['top_k']} exceeds experts {moe['experts']}")
            if groups > 1 and (moe["experts"] % groups or moe["experts"] // groups < 2
                               or not 1 <= (moe.get("groups_kept") or 0) <= groups):
                problems.append(f"{where}: {moe['experts']} experts in {groups} groups (keeping "
                                f"{moe.get('groups_kept')}) do not divide into groups of 2 or more")
    stated = m["tensors"]
    for name, shape in executor_tensors(m).items():
        if name not in stated:
            problems.append(f"tensors: {name} is missing (the executor reads it)")
        elif tuple(stated[name]["shape"]) != shape:
            problems.append(f"tensors.{name}: shape {stated[name]['shape']} does not match the sizes the manifest "
                            f"states ({list(shape)})")
    odd = [f for f in m["files"] if not plain_file_name(f)]
    if odd:
        problems.append(f"files: {odd[0]!r} is not a file name in the directory")
    unknown = sorted({t["file"] for t in stated.values() if t.get("file") is not None} - set(m["files"]))
    if unknown:
        problems.append(f"tensors: name file {unknown[0]!r}, which files does not list")
    return problems


def validate_manifest(manifest: Any, file: Path) -> None:
    """Refuse a manifest the executor could not run: one line naming the first problem and its place."""
    fix = "re-convert with `parity convert --to neutral`"
    if not isinstance(manifest, dict):
        raise ParityError(f"{file}: expected a JSON object, found {type(manifest).__name__}; {fix}")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ParityError(f"{file}: not a {FORMAT} v{FORMAT_VERSION} manifest; {fix}")
    check_schema(_ManifestSpec, manifest, file, fix)
    problems = _cross_checks(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ParityError(f"{file}: {problems[0]}{more}; {fix}")


def read_manifest(path: Path) -> dict:
    """A neutral directory's (or a manifest file's) manifest, validated."""
    path = Path(path)
    file = path / MANIFEST if path.is_dir() else path
    if not file.is_file():
        raise ParityError(f"{path}: no {MANIFEST}; give a directory written by `parity convert --to neutral`")
    manifest = read_json(file, "re-convert with `parity convert`")
    validate_manifest(manifest, file)
    return manifest


def file_hash(info: dict) -> tuple[str, str]:
    """A manifest ``files`` entry's (algorithm, hex digest): HASH, or what manifests written before it record."""
    return next((a, info[a]) for a in ALGORITHMS if info.get(a) is not None)


def load(path: Path, *, verify: bool = False, lazy: bool = False) -> tuple[dict, Any]:
    """Read a neutral directory: (manifest, tensors by neutral name). Every file's header is checked, and every
    tensor the manifest lists must be there with the shape and dtype it states, before any tensor is read.
    ``lazy``: the tensors are a parity.storage.lazy.NeutralSource, read a layer at a time as the executor reaches
    them."""
    path = Path(path)
    manifest = read_manifest(path)
    directory = path if path.is_dir() else path.parent
    fix = "re-convert with `parity convert --to neutral`"
    found: dict[str, str] = {}
    for file in manifest["files"]:
        header = read_header(directory / file, fix)
        for name, entry in header.tensors.items():
            if name in found:
                raise ParityError(f"{directory / file}: {name} is also in {found[name]}; {fix}")
            found[name] = file
            info = manifest["tensors"].get(name)
            if info is None:
                continue
            if list(entry.shape) != info["shape"] or entry.dtype != STORED_DTYPES[info["dtype"]]:
                raise ParityError(f"{directory / file}: {name} is {entry.dtype} {list(entry.shape)} but the manifest "
                                  f"says {STORED_DTYPES[info['dtype']]} {info['shape']}; {fix}")
            if info.get("file") not in (None, file):
                raise ParityError(f"{directory / file}: holds {name}, which the manifest places in {info['file']}; "
                                  f"{fix}")
    missing = sorted(set(manifest["tensors"]) - set(found))
    if missing:
        raise ParityError(f"{path}: tensors listed in the manifest are missing: {', '.join(missing[:8])}"
                          f"{' ...' if len(missing) > 8 else ''}; {fix}")
    if lazy:
        from parity.storage.lazy import NeutralSource

        for name, info in manifest["tensors"].items():
            info.setdefault("file", found[name])
        return manifest, NeutralSource(manifest, directory)
    tensors: dict[str, torch.Tensor] = {}
    for file, info in manifest["files"].items():
        algorithm, digest = file_hash(info)
        if verify and hash_file(directory / file, algorithm) != digest:
            raise ParityError(f"{directory / file}: its {algorithm} differs from the manifest's; the file changed "
                              f"after conversion")
        try:
            with safe_open(directory / file, framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - the header is checked; a dtype torch lacks, or an I/O error
            raise ParityError(f"{directory / file}: not a readable safetensors file ({str(exc)[:160]}); "
                              f"{fix}") from None
    return manifest, tensors


def __getattr__(name: str) -> Any:
    """DTYPES (name -> torch dtype), made when first asked for, so that writing a manifest needs no torch."""
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def summary(manifest: dict) -> dict[str, Any]:
    return {"family": manifest["source"]["family"], "dtype": manifest["dtype"], "layers": manifest["num_layers"],
            "tensors": len(manifest["tensors"]), "files": list(manifest["files"])}
