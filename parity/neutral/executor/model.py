"""The neutral model, in plain torch: the executable specification of every convention.

It reads only a neutral manifest and its tensors (parity/neutral/converter.py) and imports nothing from
transformers. One function per sublayer; every convention comes from the manifest, never from a
family name. As it runs it reports each capture point (docs/design.md, "Capture points") through
``on_point(name, x)``, so a caller can compare and discard as it goes.

Shapes: B batch, S sequence, D hidden, H heads, K kv heads, Dh head_dim, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from parity.neutral.executor import rope as rope_fn
from parity.neutral.executor.cache import KVCache
from parity.neutral.executor.mla import mla_attention
from parity.neutral.executor.moe import moe as routed
from parity.neutral.executor.ops import ACTIVATIONS, LayerOps, glu, norm, row_order, softcap
from parity.neutral.manifest import load
from parity.neutral.model import Attention, Manifest, Mlp, Norm
from parity.rope import inv_freq

OnPoint = Callable[[str, torch.Tensor], None]


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


class NeutralModel:
    """Runs a neutral checkpoint. ``model(ids, on_point=...)`` returns logits (or the last hidden state)."""

    def __init__(self, manifest: Manifest, tensors, dtype: torch.dtype | None = None, device: str = "cpu",
                 source_rope_style: str | None = None):
        """``tensors``: every tensor by name, or a source that reads them when used (parity.storage.lazy.NeutralSource:
        ``resident()``, ``layer(i)``, ``rows(name, ids)``, ``row_chunks(name, dtype)``), which holds one layer's
        weights at a time, reads only the embedding rows a prompt uses and applies the head in chunks.
        ``source_rope_style``: the RoPE style of the checkpoint this one was converted from ("half" |
        "interleaved"; default: the manifest's ``source.rope_style``, else its own ``rope_style``, i.e. not
        restyled), so that operation-level points put q/k rows back in that checkpoint's order."""
        self.m = manifest
        self.source_rope_style = source_rope_style or manifest.source.rope_style
        self.row_orders: dict[int, dict[str, torch.Tensor]] = {}
        self.dtype = dtype or getattr(torch, manifest.dtype)
        self.device = torch.device(device)
        # tensors stored in float32 in a lower-precision model (a float32 router) stay float32
        self.kept = {k for k, info in manifest.tensors.items() if info.dtype != manifest.dtype}
        # the layers whose keys and values a later layer reuses (Gemma 4): only theirs are kept past their layer
        self.kv_sources = {att.kv_shared_from for _, att in manifest.attentions()} - {None}
        self.source = None if isinstance(tensors, dict) else tensors
        resident = tensors if self.source is None else self.source.resident()
        self.w = {k: self._cast(k, v) for k, v in resident.items()}

    def _cast(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, x.dtype if name in self.kept else self.dtype)

    @classmethod
    def load(cls, path, dtype: torch.dtype | None = None) -> "NeutralModel":
        manifest, tensors = load(path)
        return cls(manifest, tensors, dtype)

    def row_order(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's ops whose q/k rows the conversion's --rope-style permuted: the index restoring the source's
        order (executor.ops.row_order; the weights' rows are in the manifest's ``rope_style``)."""
        if i not in self.row_orders:
            self.row_orders[i] = row_order(self.m.layers[i].attention, self.m.rope_style, self.source_rope_style)
        return self.row_orders[i]

    def layer_weights(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        if self.source is not None:  # read now, dropped when the layer is done
            return {k: self._cast(prefix + k, v) for k, v in self.source.layer(i).items()}
        return {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}

    def lookup(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``ids``: only those rows are read when streaming."""
        if self.source is None or name in self.w:
            return F.embedding(ids, self.w[name])
        used, inverse = torch.unique(ids, return_inverse=True)
        return F.embedding(inverse, self._cast(name, self.source.rows(name, used.cpu())))

    def vocab_linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T (+ bias) for a [V, D] weight; streamed, W is read and applied a chunk of rows at a time."""
        if self.source is None or name in self.w:
            return F.linear(x, self.w[name], bias)
        rows = self.source.shape(name)[0]
        out = x.new_empty(*x.shape[:-1], rows)
        for a, w in self.source.row_chunks(name, self.dtype, self.device):
            out[..., a:a + w.shape[0]] = F.linear(x, w, None if bias is None else bias[a:a + w.shape[0]])
        return out

    def _norm(self, x: torch.Tensor, spec: Norm | None, w: dict, name: str) -> torch.Tensor:
        return x if spec is None else norm(x, spec, w.get(f"{name}.weight"), w.get(f"{name}.bias"))

    # ---------------------------------------------------------------- embeddings

    def embed(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        e = self.m.embedding
        x = self.lookup("embed.tokens.weight", ids)                                   # [B, S, D]
        if e.scale != 1.0:
            # in the model dtype where the family does so (Gemma: sqrt(D) rounded to bf16 first)
            dtype = {"model": self.dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[e.scale_dtype]
            scale = torch.tensor(e.scale, dtype=dtype)
            x = (x * scale).to(self.dtype)
        if e.positions == "learned":
            x = x + self.lookup("embed.positions.weight", positions)
        if e.token_types:
            types = token_types if token_types is not None else torch.zeros_like(ids)
            x = x + self.lookup("embed.token_types.weight", types)
        return self._norm(x, e.norm, self.w, "embed.norm")

    def per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Per-layer input embeddings (Gemma 4): [B, S, L, P], one P-vector per layer."""
        spec = self.m.embedding.per_layer_input
        if spec is None:
            return None
        n, p = self.m.num_layers, spec.size
        tok = self.lookup("embed.per_layer_tokens.weight", ids)                       # [B, S, L*P]
        tok = (tok * torch.tensor(spec.scale, dtype=self.dtype)).reshape(*ids.shape, n, p)
        proj = F.linear(x, self.w["embed.per_layer_projection.weight"])              # [B, S, L*P]
        proj = proj * torch.tensor(spec.projection_scale, dtype=self.dtype)
        proj = self._norm(proj.reshape(*ids.shape, n, p), spec.norm, self.w, "embed.per_layer_norm")
        return (proj + tok) * torch.tensor(spec.combine_scale, dtype=self.dtype)

    # ---------------------------------------------------------------- attention

    def mask(self, positions: torch.Tensor, t: int, att: Attention) -> torch.Tensor:
        """Additive [S, T] mask of the queries at ``positions`` over ``t`` keys, the last of them at the last query's
        position: causal and/or sliding window (key j visible from i when i - j < window), and/or chunked (key j
        visible from i when both sit in the same chunk of ``chunk_size`` positions: Llama 4)."""
        s = positions.shape[0]
        i = positions[:, None]
        j = (positions[-1] + 1 - t + torch.arange(t, device=self.device))[None, :]
        allowed = torch.ones(s, t, dtype=torch.bool, device=self.device)
        if att.causal:
            allowed &= j <= i
        if att.sliding_window:
            allowed &= (i - j) < att.sliding_window
            if not att.causal:
                allowed &= (j - i) < att.sliding_window
        if att.chunk_size:
            chunk = att.chunk_size
            allowed &= torch.div(i, chunk, rounding_mode="floor") == torch.div(j, chunk, rounding_mode="floor")
        return torch.zeros(s, t, device=self.device).masked_fill(~allowed, float("-inf"))

    def attention(self, x: torch.Tensor, w: dict, att: Attention, positions: torch.Tensor,
                  shared: dict, i: int, cache: KVCache | None = None, op: LayerOps | None = None) -> torch.Tensor:
        """Multi-head attention of layer i with GQA, QK/v-norms, RoPE, softcap and windows: [B, S, D] -> [B, S, D].
        With a ``cache``, the keys it holds are attended to before this call's, and it keeps them for the next.
        ``op``: where its operation-level points go (None: not emitted)."""
        b, s, _ = x.shape
        own = att.kv_shared_from is None                                             # else another layer's K/V
        q = linear(x, w, "attn.q")                                                   # [B, S, H*Dh]
        k = linear(x, w, "attn.k") if own else None                                  # [B, S, K*Dh]
        v = (k if att.k_eq_v else linear(x, w, "attn.v")) if own else None           # k_eq_v: values = raw keys
        if op is not None:
            op("attn.q", q)
            if own:
                op("attn.k", k)
                if not att.k_eq_v:  # no value projection to read
                    op("attn.v", v)
        late = att.qk_norm_after_rope  # Llama 4: the norm reads the rotated q/k
        q = self.qk_norm(q, w, att, "q", op, not late).transpose(1, 2)              # [B, H, S, Dh]
        if own:
            k = self.qk_norm(k, w, att, "k", op, not late).transpose(1, 2)          # [B, K, S, Dh]
            v = self._norm(v.view(b, s, att.kv_heads, att.head_dim), att.v_norm, w, "attn.v_norm")
            v = v.transpose(1, 2)
        if att.rope is not None:
            cos_sin = rope_fn.cos_sin(att.rope, positions)
            q = rope_fn.apply(q, *cos_sin, att.rope)
            k = rope_fn.apply(k, *cos_sin, att.rope) if own else k
        if late:
            q = self.heads_norm(q, w, att, "q", op)
            k = self.heads_norm(k, w, att, "k", op) if own else k
        if att.temperature:  # Llama 4's NoPE layers: each query scaled by its position, in float32
            t = att.temperature
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / t.floor)) * t.scale + 1.0   # [S]
            q = (q * scale.view(1, 1, -1, 1)).to(q.dtype)
        if op is not None and self.m.rope_style is not None:  # a NoPE layer hands q/k on unrotated
            op.heads("attn.q_rope", q)
            if own:
                op.heads("attn.k_rope", k)
        if not own:
            k, v = shared[att.kv_shared_from]
        elif cache is not None:  # the cached keys, then this call's: [B, K, T, Dh]
            k, v = cache.extend(i, k, v, att.sliding_window)
        if i in self.kv_sources:
            shared[i] = (k, v)  # a later layer reuses this layer's keys and values
        return linear(self.attend(q, k, v, att, positions, cache, op, w.get("attn.sinks")), w, "attn.o")

    def qk_norm(self, x: torch.Tensor, w: dict, att: Attention, which: str, op: LayerOps | None,
                apply: bool = True) -> torch.Tensor:
        """q or k [B, S, n*Dh] -> [B, S, n, Dh] through its QK-Norm, full width or per head (if any, and ``apply``:
        a norm after RoPE is heads_norm's)."""
        b, s, _ = x.shape
        kind, name, spec = att.qk_norm if apply else "none", f"attn.{which}_norm", getattr(att, f"{which}_norm")
        if kind == "full_width":
            x = self._norm(x, spec, w, name)
        x = x.view(b, s, -1, att.head_dim)
        if kind == "per_head":
            x = self._norm(x, spec, w, name)
        if op is not None and kind != "none":
            op(name, x)
        return x

    def heads_norm(self, x: torch.Tensor, w: dict, att: Attention, which: str, op: LayerOps | None) -> torch.Tensor:
        """The QK-Norm of rotated q or k [B, n, S, Dh] (Llama 4's L2 norm, after RoPE), per head or full width."""
        if att.qk_norm == "none":
            return x
        name, spec = f"attn.{which}_norm", getattr(att, f"{which}_norm")
        if att.qk_norm == "full_width":  # over every head at once: [B, S, n*Dh]
            b, n, s, dh = x.shape
            wide = self._norm(x.transpose(1, 2).reshape(b, s, n * dh), spec, w, name)
            x = wide.view(b, s, n, dh).transpose(1, 2)
        else:
            x = self._norm(x, spec, w, name)
        if op is not None:
            op.heads(name, x)
        return x

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, att: Attention, positions: torch.Tensor,
               cache: KVCache | None, op: LayerOps | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T * scale, softcapped, masked) v: q [B, H, S, Dh], k, v [B, K, T, Dh] -> [B, S, H*Dh].
        ``sinks`` [H]: where the manifest says ``sinks``, each head's learned logit joins its scores as one more
        column of the softmax, and that column's probability is dropped (GPT-OSS)."""
        b, h, s, dh = q.shape
        t = k.shape[2]
        k = k.repeat_interleave(h // k.shape[1], dim=1)                              # GQA: [B, H, T, Dh]
        v = v.repeat_interleave(h // v.shape[1], dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * att.scale                      # [B, H, S, T]
        if cache is None or cache.policy.decode_softcap or not cache.decoding:
            scores = softcap(scores, att.softcap)
        scores = scores + self.mask(positions, t, att).to(scores.dtype)
        if att.sinks:  # GPT-OSS: each head's learned logit as one more column, its probability dropped
            sink = sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, s, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
            probs = probs.to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h * dh)          # [B, S, H*Dh]
        if op is not None:
            op.scores(scores)
            op.heads("attn.probs", probs)
            op("attn.context", out)
        return out

    def mla(self, x: torch.Tensor, w: dict, att: Attention, positions: torch.Tensor, i: int,
            cache: KVCache | None = None, op: LayerOps | None = None) -> torch.Tensor:
        half = att.rope.model_copy(update={"style": "half"})  # mla.py rotates from half tables
        cos, sin = rope_fn.cos_sin(half, positions)
        # per-head keys and values are cached, as transformers does
        kv = None if cache is None else (lambda k, v: cache.extend(i, k, v, None))
        t = positions.shape[0] + (0 if cache is None or i not in cache.slots else cache.slots[i][0].shape[2])
        return mla_attention(x, w, att, cos, sin, self.mask(positions, t, att)[None, None], cache_kv=kv, op=op)

    # ---------------------------------------------------------------- MLP

    def mlp(self, x: torch.Tensor, w: dict, spec: Mlp, op: LayerOps | None = None) -> torch.Tensor:
        """Gated: down(act(gate(x)) * up(x)); plain: down(act(up(x)))."""
        act = ACTIVATIONS[spec.activation]
        gate = linear(x, w, "mlp.gate") if spec.gated else None
        up = linear(x, w, "mlp.up")
        hidden = glu(gate, up, spec) if spec.gated else act(up)
        if op is not None:
            if gate is not None:
                op("mlp.gate", gate)
            op("mlp.up", up)
            op("mlp.act", hidden)
        return linear(hidden, w, "mlp.down")

    def feed_forward(self, x: torch.Tensor, mid: torch.Tensor, w: dict, spec: Mlp,
                     op: LayerOps | None = None) -> torch.Tensor:
        """The MLP sublayer: dense, routed experts instead of it, or both side by side."""
        moe = spec.moe
        if moe is None:
            return self.mlp(x, w, spec, op)
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        # the router's logits [B*S, E] as mlp.router [B, S, E]
        router = None if op is None else (lambda logits: op("mlp.router", logits.view(*x.shape[:-1], -1)))
        if moe.dense_post_norm is None:  # experts replace the dense MLP (DeepSeek-V3)
            return routed(flat(x), flat(x), w, moe, router).view_as(x)
        # experts beside the dense MLP, reading the residual stream through their own norm (Gemma 4); the experts
        # run first, so that the router's op comes before the dense MLP's (forward order, names.OP_POINTS)
        expert_in = self._norm(mid, moe.expert_norm, w, "moe_norm")
        experts = routed(flat(mid), flat(expert_in), w, moe, router).view_as(x)
        dense = self._norm(self.mlp(x, w, spec, op), moe.dense_post_norm, w, "mlp_dense_post_norm")
        return dense + self._norm(experts, moe.expert_post_norm, w, "moe_post_norm")

    # ---------------------------------------------------------------- the model

    def layer(self, x: torch.Tensor, i: int, positions: torch.Tensor, shared: dict,
              per_layer: torch.Tensor | None, emit: OnPoint, cache: KVCache | None = None,
              ops: bool = False) -> torch.Tensor:
        spec, w = self.m.layers[i], self.layer_weights(i)
        n, att = spec.norms, spec.attention
        p = f"layers.{i}."
        op = LayerOps(emit, p, self.row_order(i)) if ops else None

        a_in = self._norm(x, n.attn_norm, w, "attn_norm")
        emit(p + "attn_in", a_in)
        a = self.mla(a_in, w, att, positions, i, cache, op) if att.mla else \
            self.attention(a_in, w, att, positions, shared, i, cache, op)
        a = self._norm(a, n.attn_post_norm, w, "attn_post_norm")
        emit(p + "attn_out", a)
        scale = spec.residual_scale  # Granite: residual + sublayer * residual_multiplier
        a = a if scale == 1.0 else a * scale
        # parallel (GPT-NeoX): the MLP reads the layer's input too, and both outputs are added to it at the end,
        # so there is no stream between the two adds (no `mid`)
        parallel = spec.mlp.parallel
        x_in = x
        if not parallel:
            x = self._norm(x + a, n.attn_res_norm, w, "attn_res_norm")
            emit(p + "mid", x)

        # Phi: a parallel MLP that shares attention's norm reads what attention read
        m_in = a_in if spec.mlp.shared_norm else self._norm(x, n.mlp_norm, w, "mlp_norm")
        emit(p + "mlp_in", m_in)
        m = self.feed_forward(m_in, x, w, spec.mlp, op)
        m = self._norm(m, n.mlp_post_norm, w, "mlp_post_norm")
        emit(p + "mlp_out", m)
        m = m if scale == 1.0 else m * scale
        # transformers' GPTNeoXLayer: `mlp_output + attn_output + hidden_states`, in that order
        x = self._norm((m + a) + x_in if parallel else x + m, n.mlp_res_norm, w, "mlp_res_norm")

        if spec.per_layer_input is not None:  # Gemma 4: a gated per-layer input, added and normed
            g = ACTIVATIONS[spec.mlp.activation](linear(x, w, "pli.gate")) * per_layer[:, :, i]
            x = x + self._norm(linear(g, w, "pli.proj"), spec.per_layer_input.post_norm, w, "pli_post_norm")
        scalar = w.get("layer_scalar")  # a weight of the layer's own (Gemma 4), not a convention
        if scalar is not None:
            x = x * scalar
        emit(p + "out", x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        head = self.m.head
        if head.transform is not None:  # BERT's MLM head: dense, activation, LayerNorm
            x = ACTIVATIONS[head.transform.activation](linear(x, self.w, "head.transform"))
            x = self._norm(x, head.transform.norm, self.w, "head.norm")
        weight = "embed.tokens.weight" if head.tied else "lm_head.weight"
        logits = self.vocab_linear(x, weight, self.w.get("head.bias"))               # [B, S, V]
        if head.scale != 1.0:  # Cohere's logit_scale, Granite's 1 / logits_scaling
            logits = logits * head.scale
        return softcap(logits, head.softcap)

    def new_cache(self) -> KVCache:
        """An empty KV cache, following the manifest's ``kv_cache`` policy (a correct cache unless a decode
        bug was injected)."""
        return KVCache(self.m.num_layers, self.m.kv_cache)

    def _length_tables(self, cache: KVCache, ids: torch.Tensor) -> bool:
        """Keep the ids a cache has seen where a layer's RoPE frequencies follow the length (LongRoPE, dynamic);
        True where this step's length changes them, so that the cached keys no longer hold."""
        ropes = [rope for rope in self.m.ropes() if rope_fn.by_length(rope)]
        if not ropes:
            return False
        tables = [inv_freq(rope, cache.length + ids.shape[1])[0] for rope in ropes]
        if cache.decoding and cache.tables is not None and not all(map(torch.equal, tables, cache.tables)) \
                and cache.policy.refill_on_rope_change:
            return True
        cache.tables = tables
        cache.ids = ids if cache.ids is None else torch.cat([cache.ids, ids], dim=1)
        return False

    def _prefill_again(self, ids, emit, token_types, feed, layers, cache: KVCache, ops: bool) -> torch.Tensor:
        """A decode step whose length changes the RoPE tables: the whole prefix again with a fresh cache, as
        transformers' generate does for Phi-3's LongRoPE (Phi3ForCausalLM.prepare_inputs_for_generation); only the
        step's own positions are emitted and returned."""
        s = ids.shape[1]
        seen = torch.cat([cache.ids, ids], dim=1)
        cache.reset()

        def last(t: torch.Tensor) -> torch.Tensor:
            return t[:, -s:] if t.dim() > 1 and t.shape[1] == seen.shape[1] else t

        def tail_feed(i: int, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, :-s], feed(i, x[:, -s:])], dim=1)

        out = self(seen, lambda name, t: emit(name, last(t)), token_types, tail_feed, layers, cache, ops)
        return last(out)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, on_point: OnPoint | None = None, token_types: torch.Tensor | None = None,
                 feed: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                 layers: range | None = None, cache: KVCache | None = None, ops: bool = False) -> torch.Tensor:
        """Run the model. ``feed(i, x)`` may replace layer i's input (i = num_layers: the head's), which is
        how a parity check isolates each layer from the error of the layers before it. ``layers``: run only
        these (a slice of a check: the first is fed its input; the output of the last is returned).
        ``cache`` (from ``new_cache``): the first call is the prefill, each later call continues at the next
        positions (a decode step: one token) from what the cache holds. ``ops``: also emit every layer's
        operation-level points (docs/ops.md: layers.{i}.attn.q, ..., layers.{i}.mlp.act), in forward order within
        its sublayers, q/k rows in the source checkpoint's RoPE order (``source_rope_style``)."""
        emit = on_point or (lambda name, t: None)
        feed = feed or (lambda i, x: x)
        ids = (ids if ids.dim() == 2 else ids[None]).to(self.device)
        if cache is not None and self._length_tables(cache, ids):
            return self._prefill_again(ids, emit, token_types, feed, layers, cache, ops)
        positions = (torch.arange(ids.shape[1], device=self.device) if cache is None
                     else cache.positions(ids.shape[1], self.device))
        x = self.embed(ids, positions, token_types)
        per_layer = self.per_layer_inputs(ids, x)
        emit("embed", x)
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        span = layers if layers is not None else range(self.m.num_layers)
        for i in span:
            x = self.layer(feed(i, x), i, positions, shared, per_layer, emit, cache, ops)
        if cache is not None:
            cache.advance(ids.shape[1])
        if span.stop < self.m.num_layers:
            return x
        x = feed(self.m.num_layers, x)
        if self.m.final_norm is not None:
            x = self._norm(x, self.m.final_norm, self.w, "final_norm")
            emit("final_norm", x)
        if self.m.head is None:
            return x
        logits = self.head(x)
        emit("logits", logits)
        return logits
