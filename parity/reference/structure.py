"""A model no adapter knows, its structure discovered from transformers itself (docs/generic.md).

For a config whose architecture no adapter recognises, and only for transformers' own model classes (never code
a checkpoint brings along: no trust_remote_code), the model is built on the meta device (no weights, no memory)
and read for where its capture points are:

- the decoder layers: the modules of the class the model records as its ``hidden_states``
  (``_can_record_outputs``), else of a class in ``_no_split_modules``, else the model's single ``nn.ModuleList``;
  they must be the items 0..N-1 of one ModuleList. ``embed`` is layer 0's input, ``layers.{i}.out`` layer i's
  output;
- the attention module: the class the model records as its ``attentions``;
- the sublayer outputs: the projections the config's ``base_model_tp_plan`` shards rowwise (an attention's output
  projection, an MLP's down projection; experts' projections are not a sublayer's output), else the attention
  module's output;
- the final norm: the module ``base_model_pp_plan`` lists after the layers, else the one child with weights of
  the module holding the layers, besides the embeddings and the layers;
- ``logits``: the model's output, where it has an LM head.

What is found is written as adapter data (a generated parity.adapter.Adapter: a capture map, the embedding's
tensor), so that the check, goldens, dumps, --isolate and --layers read it as they read any adapter. What cannot
be found this way, the family's conventions (norms, RoPE, the tensor map of the neutral layout), is marked
unknown (Adapter.unknown): every feature that needs them refuses such a model, and the report says which were not
checked.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch

from parity.adapter import Adapter, AdapterFile
from parity.errors import ParityError

# What a generated adapter cannot tell, as the report lists it (Adapter.unknown)
UNKNOWN = (
    "norms (kind, eps, weight convention, placement, float32 upcast)",
    "attention (scale, softcap, sliding windows, biases, QK-norm)",
    "positions (RoPE base, layout, scaling)",
    "MLP activation and gating, MoE routing",
    "embedding scale, tied head, final softcap",
    "the tensor map of the neutral layout",
)
# placeholders for the convention fields the schema requires: never read, since every feature that reads a
# convention refuses a generated adapter (parity.adapter.needs_family)
_PLACEHOLDERS = {
    "norm": {"kind": "rmsnorm", "eps": 0.0, "weight": "weight", "upcast": "none", "weight_dtype": "model",
             "placement": "pre", "final": False},
    "mlp": {"gated": False, "activation": "silu", "intermediate_size": 0},
}


def transformers_class(config: dict):
    """transformers' own model class for a config: its ``architectures``' first where transformers has it, else
    the causal LM of its ``model_type``, as AutoModelForCausalLM builds a checkpoint whose class comes with code of
    its own (EXAONE's published ExaoneForCausalLM is transformers' LlamaForCausalLM); None where it has neither."""
    import transformers  # heavy: transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = config.get("architectures") or []
    for name in (*archs[:1], MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))):
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if inspect.isclass(cls) and cls.__module__.startswith("transformers.models.") \
                and issubclass(cls, torch.nn.Module):
            return cls
    return None


def _config_object(config: dict, cls, source: str):
    from transformers import CONFIG_MAPPING  # heavy: transformers

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    kind = CONFIG_MAPPING[model_type]
    # transformers 5 writes inf and nan as {"__float__": "Infinity"} (Falcon-H1's and Granite 4's time_step_limit)
    # and decodes them when it reads a file; so does this
    decode = getattr(kind, "_decode_special_floats", lambda x: x)
    try:
        return kind.from_dict(decode({k: v for k, v in config.items() if k != "auto_map"}))
    except Exception as exc:  # noqa: BLE001 - a config transformers' own class refuses
        raise ParityError(f"{source}: transformers cannot read it as a {model_type} config ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160] if str(exc) else 'no message'}); fix the config") from None


def _meta_model(cls, cfg, source: str):
    """The model built on the meta device: its modules without any weight."""
    import transformers  # heavy: transformers

    transformers.utils.logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            return cls(cfg)
    except Exception as exc:  # noqa: BLE001 - a class that cannot be built from this config
        raise ParityError(f"{source}: transformers could not build {cls.__name__} from it on the meta device "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else 'no message'})"
                          f"; fix the config") from None


def _refused_weights(model, tensors: dict) -> str:
    """The model's weights transformers would leave missing, misshapen or unconverted loading a checkpoint of these
    tensors (name -> an object with its ``shape``), each kind counted and its first names given ("" for none):
    from_pretrained's own steps on meta tensors (no data read), its conversion mapping (renamed, split and fused
    layouts), tied weights and the keys it ignores included."""
    import transformers  # heavy: transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    state = {name: torch.empty(t.shape, device="meta") for name, t in tensors.items()}
    config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(model), device_map={"": "meta"})
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        loading, _ = convert_and_load_state_dict_in_model(model, state, config)
        model.tie_weights(missing_keys=loading.missing_keys, recompute_mapping=False)
        model._adjust_missing_and_unexpected_keys(loading)
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    kinds = (("missing", sorted(loading.missing_keys)), ("wrong shape", sorted(k for k, *_ in loading.mismatched_keys)),
             ("not converted", sorted(loading.conversion_errors)))
    return "; ".join(f"{label} ({len(keys)}): {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                     for label, keys in kinds if keys)


def _recorded(model, key: str) -> type | None:
    """The module class a model records for ``key`` in ``_can_record_outputs`` (a class, or an OutputRecorder's)."""
    for owner in (type(model), type(getattr(model, "base_model", model))):
        entry = (getattr(owner, "_can_record_outputs", None) or {}).get(key)
        target = getattr(entry, "target_class", entry)
        if inspect.isclass(target):
            return target
    return None


def _layers(model) -> tuple[str, int, str]:
    """(the ModuleList holding the decoder layers, how many, how they were found)."""
    recorded = _recorded(model, "hidden_states")
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    lists = {path: m for path, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)}
    tries = []
    if recorded is not None:
        tries.append((lambda m: isinstance(m, recorded), f"_can_record_outputs['hidden_states'] ({recorded.__name__})"))
    if no_split:
        tries.append((lambda m: type(m).__name__ in no_split, f"_no_split_modules ({', '.join(sorted(no_split))})"))
    for is_layer, how in tries:
        holders = {path for path, m in lists.items() if any(is_layer(x) for x in m)}
        if len(holders) == 1:
            path = holders.pop()
            return path, len(lists[path]), how
    top = [p for p in lists if not any(p.startswith(q + ".") for q in lists)]
    if len(top) == 1:
        return top[0], len(lists[top[0]]), "the model's single nn.ModuleList"
    return "", 0, ""


def _first_arg(module) -> str | int:
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return params[0].name if params else 0


def _rowwise(cfg, base: str, container: str, n: int) -> list[str]:
    """The module templates (``{i}`` for the layer) the tp plan shards rowwise inside each layer, experts' left
    out."""
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    found = []
    layers_rel = container[len(base) + 1:] if base and container.startswith(base + ".") else container
    for pattern, style in plan.items():
        if "rowwise" not in str(style) or "embedding" in str(style) or "expert" in pattern:
            continue
        head = re.escape(layers_rel) + r"\.\*\."
        if not re.match(head, pattern):
            continue
        rest = pattern[len(layers_rel) + 3:]
        if "*" in rest:
            continue
        found.append(f"{container}.{{i}}.{rest}")
    return found


def _inside_attention(model, template: str, n: int) -> bool:
    """Whether the module holding a rowwise projection is an attention (by its class name), for models that record
    no attentions: a hybrid whose mixer is attention in some layers, an MLP or SSM in others."""
    parent = template.rsplit(".", 1)[0]
    for i in _present(model, parent, n):
        return "Attention" in type(model.get_submodule(parent.replace("{i}", str(i)))).__name__
    return False


def _present(model, template: str, n: int) -> list[int]:
    out = []
    for i in range(n):
        try:
            model.get_submodule(template.replace("{i}", str(i)))
            out.append(i)
        except AttributeError:
            pass
    return out


def _final_norm(model, cfg, base: str, container: str, embedding) -> str | None:
    plan = getattr(cfg, "base_model_pp_plan", None) or {}
    names = list(plan)
    layers_rel = container[len(base) + 1:] if base else container
    if layers_rel in names:
        for name in names[names.index(layers_rel) + 1:]:
            path = f"{base}.{name}" if base else name
            try:
                model.get_submodule(path)
                return path
            except AttributeError:
                continue
    owner_path = container.rpartition(".")[0]  # the module whose forward runs the layers
    owner = model.get_submodule(owner_path) if owner_path else model
    rest = [name for name, child in owner.named_children()
            if child is not embedding and not isinstance(child, torch.nn.Embedding)
            and (f"{owner_path}.{name}" if owner_path else name) != container
            and any(True for _ in child.parameters())]
    if len(rest) == 1:
        return f"{owner_path}.{rest[0]}" if owner_path else rest[0]
    return None


def _when(present: list[int], n: int) -> str | None:
    return None if len(present) == n else f"i in {present}"


def discover(config: dict, source: str = "config.json", tensors: dict | None = None) -> Adapter | None:
    """A generated adapter for a config of transformers' own classes (None for any other: the caller refuses it
    as an unsupported architecture), its capture map discovered from the model built on the meta device.
    ``tensors`` (a checkpoint's inventory: name -> its ``shape``): refused unless transformers loads them into that
    model with none of its weights missing or misshapen."""
    cls, model_type = transformers_class(config), config.get("model_type")
    if cls is None or not model_type:
        return None
    cfg = _config_object(config, cls, source)
    if cfg is None:
        return None
    model = _meta_model(cls, cfg, source)
    refused = _refused_weights(model, tensors) if tensors is not None else ""
    if refused:
        raise ParityError(f"{source}: its weights do not load into transformers' {cls.__name__} ({refused}); check "
                          f"that config.json belongs to these weights")
    base = getattr(model, "base_model_prefix", "") or ""
    if not hasattr(model, base) or getattr(model, base) is model:
        base = ""
    container, n, how = _layers(model)
    if not n:
        raise ParityError(f"{source}: {cls.__name__}: no decoder layers found (nothing recorded as hidden_states, "
                          f"no _no_split_modules, not one nn.ModuleList); parity checks it only with an adapter "
                          f"(--adapters DIR)")
    layer0 = model.get_submodule(f"{container}.0")
    attention = _recorded(model, "attentions")
    first = f"{container}.0."
    attention_paths = sorted(f"{container}.{{i}}.{p[len(first):]}" for p, m in model.named_modules()
                             if attention is not None and isinstance(m, attention) and p.startswith(first))
    rowwise = _rowwise(cfg, base, container, n)
    in_attention = [t for t in rowwise if (attention_paths and t.startswith(attention_paths[0] + "."))
                    or (not attention_paths and _inside_attention(model, t, n))]
    outside = [t for t in rowwise if t not in in_attention]
    # each sublayer's output, where one module gives it: (the module, what else its capture entry says)
    attn_out = ((in_attention[0], {}) if len(in_attention) == 1 else
                (attention_paths[0], {"field": 0}) if len(attention_paths) == 1 else None)
    mlp_out = (outside[0], {}) if len(outside) == 1 else None
    sublayers: dict[str, dict] = {}
    found: dict[str, str] = {"layers": f"{container} ({n}, by {how})"}
    for point, sublayer in (("layers.{i}.attn_out", attn_out), ("layers.{i}.mlp_out", mlp_out)):
        present = [] if sublayer is None else _present(model, sublayer[0], n)
        if present:
            module, more = sublayer
            sublayers[point] = {"module": module, "io": "output", **more, "when": _when(present, n)}
            found[point.rsplit(".", 1)[1]] = module
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    final = _final_norm(model, cfg, base, container, embedding)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(embedding, "weight", None)
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
        raise ParityError(f"{source}: {cls.__name__}: no token embedding found (get_input_embeddings); parity checks "
                          f"it only with an adapter (--adapters DIR)")
    capture = {"embed": {"module": f"{container}.0", "io": "input", "arg": _first_arg(layer0)}, **sublayers,
               "layers.{i}.out": {"module": f"{container}.{{i}}", "io": "output", "field": 0},
               **({} if final is None else {"final_norm": {"module": final, "io": "output", "field": 0}}),
               **({} if head is None else {"logits": {"module": "", "io": "output", "field": "logits"}})}
    found = {**found, **({} if final is None else {"final_norm": final}),
             "embedding": next(p for p, m in model.named_modules() if m is embedding)}
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # heavy: transformers

    causal = cls.__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    heads = getattr(cfg, "num_attention_heads", None)
    spec = AdapterFile.model_validate({
        "family": str(model_type),
        "description": f"{cls.__name__} as transformers builds it: structure discovered, conventions unknown",
        "variants": [{"architectures": [cls.__name__], "model_type": str(model_type), "tensor_prefix": [""],
                      "module_prefix": "", "lm_head": head is not None}],
        # no tensor map (transformers' own loading info says what a checkpoint lacks); the embedding's shape alone
        "derive": {"num_layers": {"expr": str(n)}, "embedding_shape": {"expr": str(list(weight.shape))}},
        **_PLACEHOLDERS,
        "attention": {"causal": causal, "heads": heads if isinstance(heads, int) and heads > 0 else 1,
                      "kv_heads": getattr(cfg, "num_key_value_heads", None) or 1, "head_dim": 0, "q_bias": False,
                      "k_bias": False, "v_bias": False, "o_bias": False, "scale": 0.0},
        "positions": {"kind": "rope", "max_positions": getattr(cfg, "max_position_embeddings", None),
                      "rope_theta": False, "rope_style": "none", "rotary_dim": False, "rope_scaling": False,
                      "rope_dtype": "model"},
        "embedding": {"tied": False},
        "norms": [], "tensors": [], "capture": capture,
        "tiny": {"architecture": cls.__name__, "layers": n, "config": {}},
    })
    return Adapter(spec, Path(f"<transformers {cls.__name__}>"), unknown=UNKNOWN,
                   discovered={"from": f"transformers {cls.__name__}", **found})
