"""Operation-level points on the transformers side (docs/ops.md): every family's [ops] read from its tiny
checkpoint in the layouts parity.ops fixes, each checked against transformers' own modules and the adapter's
conventions, with the model computing bit for bit as without them."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from parity import names
from parity import ops as parity_ops
from parity.adapter import ResolvedCapture, load_adapter, resolve
from parity.candidates import Candidate, Notes, Options
from parity.candidates import huggingface as hf_kind
from parity.checkpoint import open_checkpoint
from parity.errors import ParityError
from parity.reference.capture import ATTENTION, hooks, run_and_capture
from parity.reference.models import Models, hf_decoder, hf_runner
from tests.conftest import FAMILIES

PROMPT = torch.tensor([[(7 * k + 3) % 256 for k in range(40)]])
S = PROMPT.shape[1]
ACT = {"silu": torch.nn.functional.silu, "relu": torch.relu, "gelu_exact": torch.nn.functional.gelu,
       "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh")}


def load(path, attn: str = "eager"):
    ckpt = open_checkpoint(path)
    cls = getattr(transformers, ckpt.variant.architectures[0])
    return ckpt, cls.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def captured(request, tiny_dir):
    """(ckpt, model, plain logits, every capture point and op of one forward)."""
    ckpt, model = load(tiny_dir(request.param))
    with torch.no_grad():
        plain = model(input_ids=PROMPT)
    seen = run_and_capture(model, ckpt.resolved.capture + ckpt.resolved.ops, input_ids=PROMPT)
    return ckpt, model, plain, seen


def logits_of(output):
    return output.logits if hasattr(output, "logits") else output[0]


def by_layer(ckpt) -> dict[int, dict[str, ResolvedCapture]]:
    out: dict[int, dict[str, ResolvedCapture]] = {}
    for o in ckpt.resolved.ops:
        out.setdefault(names.layer_of(o.name), {})[o.name.split(".", 2)[2]] = o
    return out


def width(r, op: str, i: int) -> int:
    """The width docs/ops.md gives op ``op`` of layer i, from the adapter's conventions."""
    heads, kv, dh = r.layer("attention.heads", i), r.layer("attention.kv_heads", i), r.layer("attention.head_dim", i)
    return {
        "attn.q": heads * dh, "attn.q_norm": heads * dh, "attn.q_rope": heads * dh,
        "attn.k": kv * dh, "attn.v": kv * dh, "attn.k_norm": kv * dh, "attn.k_rope": kv * dh,
        "attn.scores": heads * S, "attn.probs": heads * S,
        "attn.context": heads * (r.layer("attention.v_head_dim", i) or dh),
        "attn.kv_compressed": (r.layer("attention.kv_lora_rank", i) or 0)
        + (r.layer("attention.qk_rope_head_dim", i) or 0),
        "attn.kv_norm": r.layer("attention.kv_lora_rank", i),
        "mlp.router": r.layer("mlp.experts", i),
        "mlp.gate": r.layer("mlp.intermediate_size", i), "mlp.up": r.layer("mlp.intermediate_size", i),
        "mlp.act": r.layer("mlp.intermediate_size", i),
    }[op]


def allowed(r, i: int) -> torch.Tensor:
    """[S, S]: the keys query s attends in layer i (causality, a sliding window), as the adapter states them."""
    s, t = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ok = t <= s if r.layer("attention.causal", i) else torch.ones(S, S, dtype=torch.bool)
    window = r.layer("attention.sliding_window", i)
    if window:
        ok = ok & ((s - t < window) if r.layer("attention.causal", i) else ((s - t).abs() < window))
    chunk = r.layer("attention.chunk_size", i) if "attention.chunk_size" in r.settings else None
    if chunk:  # Llama 4: keys only within the query's chunk
        ok = ok & (s // chunk == t // chunk)
    return ok


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[1, S, n * d] -> [n, S, d]."""
    return x[0].unflatten(-1, (n, -1)).transpose(0, 1)


# --------------------------------------------------------------------------------------------
# Every family: which ops, their layouts, the model unchanged


def test_the_model_computes_bit_for_bit_as_without_ops(captured):
    ckpt, model, plain, seen = captured
    logits = seen.get("logits", seen.get("final_norm"))
    assert torch.equal(logits, logits_of(plain) if "logits" in seen else logits)
    with torch.no_grad():
        assert torch.equal(logits_of(model(input_ids=PROMPT)), logits_of(plain))
    assert model.config._attn_implementation == "eager"   # switched back


def test_every_op_resolved_is_produced_in_its_layout(captured):
    ckpt, _, _, seen = captured
    r = ckpt.resolved
    assert r.ops and all(names.is_op(o.name) for o in r.ops)
    assert [o.name for o in r.ops] == sorted((o.name for o in r.ops), key=names.point_order)
    for o in r.ops:
        i, op = names.layer_of(o.name), o.name.split(".", 2)[2]
        assert o.name in seen, o.name
        assert tuple(seen[o.name].shape) == (1, S, width(r, op, i)), o.name
        assert torch.isfinite(seen[o.name]).all(), o.name
    # nothing but what the adapter resolves
    assert {n for n in seen if names.is_op(n)} == {o.name for o in r.ops}


def test_every_layer_has_the_ops_of_the_modules_it_has(captured):
    """Every layer has attention's projections' (or MLA's), its context and its scores; the MLP ops where the
    layer has a dense MLP, the router where it has experts; and an op is absent from a layer whose module is."""
    ckpt, model, _, _ = captured
    r = ckpt.resolved
    layers = by_layer(ckpt)
    for i in range(r.num_layers):
        ops = layers[i]
        # scores and probs: where the adapter can read them (GPT-OSS's softmax runs over its sinks too)
        declared = {"attn.scores", "attn.probs"} & {o.name.split(".", 2)[2] for o in r.ops}
        assert {"attn.q", "attn.context", *declared} <= set(ops)
        assert ("attn.kv_compressed" in ops) == (r.layer("attention.kind", i) == "mla")
        assert ("mlp.router" in ops) == bool(r.layer("mlp.moe", i))
        # a QK-norm module applied to q and then to k (Llama 4's qk_norm) is not read as an op
        if r.layer("attention.qk_norm", i) != "none" and "attn.q_norm" in {o.name.split(".", 2)[2] for o in r.ops}:
            assert "attn.q_norm" in ops
        if r["positions.kind"] == "rope" and r.layer("attention.kind", i) == "mha":
            assert "attn.q_rope" in ops
        for op, where in ops.items():
            if where.io != "attention":
                model.get_submodule(where.module)   # every op resolved reads a module this layer has


# --------------------------------------------------------------------------------------------
# Values, against transformers' modules and the adapter's conventions


def test_projections_are_their_modules_applied_to_the_sublayer_input(captured):
    ckpt, model, _, seen = captured
    checked = 0
    for i, ops in by_layer(ckpt).items():
        for op, point in ops.items():
            source = seen[f"layers.{i}.attn_in"] if op.startswith("attn.") else seen[f"layers.{i}.mlp_in"]
            module = model.get_submodule(point.module)
            if point.io != "output" or op not in ("attn.q", "attn.k", "attn.v", "attn.kv_compressed", "mlp.gate",
                                                  "mlp.up"):
                continue
            if getattr(module, "in_features", getattr(module, "nx", None)) != source.shape[-1]:
                continue  # reads something else (MLA's q_b after q_a)
            with torch.no_grad():
                expected = module(source)
            if point.slice is not None:  # its part of a fused projection (per head: GPT-NeoX)
                expected = parity_ops.part(expected, point.slice, point.groups)
            assert torch.equal(seen[point.name], expected), point.name
            checked += 1
    assert checked >= ckpt.resolved.num_layers


def test_qk_norms_and_mla_norm_are_their_modules_applied_to_the_projections(captured):
    ckpt, model, _, seen = captured
    for i, ops in by_layer(ckpt).items():
        for norm, before in (("attn.q_norm", "attn.q"), ("attn.k_norm", "attn.k"), ("attn.kv_norm", None)):
            if norm not in ops:
                continue
            module = model.get_submodule(ops[norm].module)
            if before is None:  # MLA: the latent part of the compressed KV
                x = seen[ops["attn.kv_compressed"].name][..., :ckpt.resolved.layer("attention.kv_lora_rank", i)]
            else:
                x = seen[ops[before].name]
            with torch.no_grad():  # per head or over the full width: the norm's own width says which
                expected = module(x.unflatten(-1, (-1, module.weight.shape[-1]))).flatten(2)
            assert torch.equal(seen[ops[norm].name], expected), ops[norm].name


def test_scores_are_queries_times_keys_and_probs_their_softmax(captured):
    """scores = q_rope . k_rope * scale (softcapped), masked entries 0; probs = softmax of the unmasked scores,
    rows summing to 1, masked entries 0; the context = probs @ v."""
    ckpt, _, _, seen = captured
    r = ckpt.resolved
    for i, ops in by_layer(ckpt).items():
        if "attn.scores" not in ops:  # GPT-OSS: its softmax reads the sink column too (the adapter says why)
            continue
        h, kv = r.layer("attention.heads", i), r.layer("attention.kv_heads", i)
        ok = allowed(r, i)
        scores, probs = heads(seen[ops["attn.scores"].name], h), heads(seen[ops["attn.probs"].name], h)
        assert (scores[:, ~ok] == 0).all() and (probs[:, ~ok] == 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(h, S))
        torch.testing.assert_close(probs, torch.softmax(scores.masked_fill(~ok, float("-inf")), -1))
        q, k = (ops.get("attn.q_rope", ops.get("attn.q")), ops.get("attn.k_rope", ops.get("attn.k")))
        if r.layer("attention.kind", i) == "mha" and k is not None and (r["positions.kind"] != "rope"
                                                                       or "attn.q_rope" in ops):
            qh, kh = heads(seen[q.name], h), heads(seen[k.name], kv).repeat_interleave(h // kv, 0)
            expected = qh @ kh.transpose(1, 2) * r.layer("attention.scale", i)
            if r.layer("attention.softcap", i):
                expected = torch.tanh(expected / r.layer("attention.softcap", i)) * r.layer("attention.softcap", i)
            torch.testing.assert_close(scores[:, ok], expected[:, ok], rtol=1e-4, atol=1e-5)
        if "attn.v" in ops and r.layer("attention.v_norm", i) == "none":
            v = heads(seen[ops["attn.v"].name], kv).repeat_interleave(h // kv, 0)
            context = (probs @ v).transpose(0, 1).flatten(1)[None]
            torch.testing.assert_close(seen[ops["attn.context"].name], context, rtol=1e-4, atol=1e-5)


def test_mlp_activation_is_act_of_gate_times_up(captured):
    ckpt, _, _, seen = captured
    r = ckpt.resolved
    for i, ops in by_layer(ckpt).items():
        if "mlp.act" not in ops:
            continue
        act = ACT[r.layer("mlp.activation", i)]
        up = seen[ops["mlp.up"].name]
        expected = act(seen[ops["mlp.gate"].name]) * up if r.layer("mlp.gated", i) else act(up)
        torch.testing.assert_close(seen[ops["mlp.act"].name], expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Absent modules, other kernels, threads


def test_an_op_whose_module_is_absent_is_absent_a_capture_point_is_an_error(tiny_dir):
    ckpt, model = load(tiny_dir("llama"))
    ghost = ResolvedCapture("layers.0.mlp.router", "model.layers.0.mlp.gate", "output", None, 0)
    seen = run_and_capture(model, ckpt.resolved.capture + [ghost], input_ids=PROMPT)
    assert "layers.0.mlp.router" not in seen and "logits" in seen
    missing = ResolvedCapture("layers.0.mid", "model.layers.0.nowhere", "output", None, None)
    with pytest.raises(ParityError, match="has no module 'model.layers.0.nowhere'"):
        run_and_capture(model, [missing], input_ids=PROMPT)


def test_attention_ops_need_eager_attention(tiny_dir):
    ckpt, model = load(tiny_dir("llama"), attn="sdpa")
    with pytest.raises(ParityError, match="eager attention only"):
        run_and_capture(model, ckpt.resolved.ops, input_ids=PROMPT)
    assert model.config._attn_implementation == "sdpa"


def test_another_threads_model_is_neither_switched_nor_watched(tiny_dir):
    """The reference and a transformers candidate run in threads of one process: ops hooked on one model leave
    the other's forward (running meanwhile) alone."""
    path = tiny_dir("llama")
    ckpt, watched = load(path)
    _, other = load(path)
    with torch.no_grad():
        plain = logits_of(other(input_ids=PROMPT))
    result: dict = {}

    def meanwhile():
        with torch.no_grad():
            result["logits"] = logits_of(other(input_ids=PROMPT))
        result["attn"] = other.config._attn_implementation

    seen: dict[str, torch.Tensor] = {}

    def on_point(name, t):
        seen[name] = t
        if name == "layers.0.attn.scores":  # in the middle of the watched forward
            thread = threading.Thread(target=meanwhile)
            thread.start()
            thread.join()

    with hooks(watched, ckpt.resolved.ops, on_point), torch.no_grad():
        watched(input_ids=PROMPT)
    assert result["attn"] == "eager" and torch.equal(result["logits"], plain)
    assert len(seen) == len(ckpt.resolved.ops)


def test_the_registered_function_is_not_a_kernel_to_choose():
    assert ATTENTION in transformers.AttentionInterface._global_mapping
    assert ATTENTION not in hf_kind.kernels()


# --------------------------------------------------------------------------------------------
# Runners: the reference's hf_runner, the decoder, the transformers candidate


def run_points(run) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    run(lambda name, t: out.setdefault(name, t.clone()))
    return out


def test_hf_runner_hooks_ops_only_when_asked(tiny_dir):
    ckpt = open_checkpoint(tiny_dir("qwen3"))
    models = Models()
    plain = run_points(hf_runner(models, ckpt, torch.float32, PROMPT))
    assert not any(names.is_op(n) for n in plain)
    layer0 = {o.name for o in ckpt.resolved.ops if o.name.startswith("layers.0.")}
    both = run_points(hf_runner(models, ckpt, torch.float32, PROMPT, points=layer0 | {"logits"}))
    assert set(both) == layer0 | {"logits"}
    assert torch.equal(both["logits"], plain["logits"])


def test_hf_decoder_emits_ops_at_each_step(tiny_dir):
    ckpt = open_checkpoint(tiny_dir("llama"))
    r = ckpt.resolved
    steps: dict[int, dict[str, torch.Tensor]] = {}
    wanted = {o.name for o in r.ops} | {"logits"}
    run = hf_decoder(Models(), ckpt, torch.float32, PROMPT[:, :8], [5, 6], role="reference", points=wanted)
    run(lambda step, name, t: steps.setdefault(step, {}).setdefault(name, t.clone()))
    h = r.layer("attention.heads", 0)
    assert set(steps) == {0, 1, 2} and set(steps[2]) == wanted
    for step in (1, 2):
        assert steps[step]["layers.0.attn.q"].shape == (1, 1, h * r.layer("attention.head_dim", 0))
        assert steps[step]["layers.0.attn.k_rope"].shape == steps[step]["layers.0.attn.k"].shape
        assert steps[step]["layers.0.attn.scores"].shape == (1, 1, h * (8 + step))   # the keys so far


@pytest.mark.parametrize("attn, compile, has", [("eager", False, {"attn.q", "attn.q_rope", "attn.probs"}),
                                                ("sdpa", False, {"attn.q", "attn.context"}),
                                                ("eager", True, set())])
def test_the_transformers_candidate_emits_the_ops_it_can_read(tiny_dir, attn, compile, has):
    path = tiny_dir("llama")
    ckpt = open_checkpoint(path)
    candidate = Candidate(Models(), path, torch.float32, ckpt, Options(ops=True), Notes())
    points = hf_kind.points(candidate, ckpt, attn, compile)
    ops = {p.split(".", 2)[2] for p in points if names.is_op(p)}
    assert has <= ops and {c.name for c in ckpt.resolved.capture} <= points
    if attn != "eager":
        assert "attn.q_rope" not in ops and "attn.scores" not in ops and candidate.notes.warnings
    assert hf_kind.points(Candidate(Models(), path, torch.float32, ckpt), ckpt, attn, compile) is None
    if not compile:
        emitted = run_points(hf_runner(Models(), ckpt, torch.float32, PROMPT, role="candidate", attn=attn,
                                       points=points))
        assert {p for p in points} == set(emitted)


# --------------------------------------------------------------------------------------------
# The [ops] table: validated like [capture], merged by extends


def write(tmp_path, name: str, text: str):
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


CHILD = '''family = "child"
description = "test"
extends = "llama"
{head}
[[variants]]
architectures = ["ChildForCausalLM"]
model_type = "child"
tensor_prefix = ["model."]
module_prefix = "model."

[tiny]
architecture = "ChildForCausalLM"

{body}'''


@pytest.mark.parametrize("body, message", [
    ('[ops]\n"layers.{i}.attn.q" = { module = "x", io = "output", fold = 1 }',
     "ops.layers.{i}.attn.q.fold: unknown key"),
    ('[ops]\n"layers.{i}.attn.qq" = { module = "x", io = "output" }', "ops.layers.{i}.attn.qq: not an operation-level"),
    ('[ops]\n"layers.{i}.attn.q" = { module = "x", io = "attention", field = "values" }', "io = \"attention\" reads"),
    ('[ops]\n"layers.{i}.attn.q" = { module = "x", io = "output", slice = ["0"] }', "'slice' is [start, stop]"),
    ('[ops]\n"layers.{i}.attn.q" = [{ module = "x", io = "output", wen = "1" }]', "unknown key"),
])
def test_bad_ops_entries_are_refused_naming_the_key(tmp_path, body, message):
    path = write(tmp_path, "child", CHILD.format(head="", body=body))
    with pytest.raises(ParityError, match=message.replace("[", r"\[").replace("{", r"\{").replace(".", r"\.")):
        load_adapter(path)


def test_extends_merges_ops_and_removes_them(tmp_path, tiny_dir):
    body = '''[ops]
"layers.{i}.attn.q" = { module = "{prefix}layers.{i}.self_attn.q_proj", io = "output", when = "i > 0" }
"layers.{i}.attn.kv_norm" = [
    { module = "{prefix}layers.{i}.a", io = "output", when = "i == 0" },
    { module = "{prefix}layers.{i}.b", io = "output", slice = ["0", "attention_head_dim"] },
]'''
    path = write(tmp_path, "child", CHILD.format(head='remove = { ops = ["layers.{i}.mlp.*"] }', body=body))
    adapter = load_adapter(path)
    base = open_checkpoint(tiny_dir("llama"))
    r = resolve(adapter, adapter.spec.variants[0], base.config)
    ops = {o.name: o for o in r.ops}
    assert "layers.0.attn.q" not in ops and ops["layers.1.attn.q"].module == "model.layers.1.self_attn.q_proj"
    assert ops["layers.0.attn.kv_norm"].module == "model.layers.0.a" and ops["layers.0.attn.kv_norm"].slice is None
    assert ops["layers.1.attn.kv_norm"].slice == (0, r.layer("attention.head_dim", 1))
    assert "layers.0.attn.k_rope" in ops and not any(".mlp." in n for n in ops)   # inherited; removed
    assert [c.name for c in r.capture] == [c.name for c in base.resolved.capture]  # capture untouched
