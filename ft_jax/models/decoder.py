"""Flax NNX decoder for the supported MoE families, with the routed experts delegated to an expert backend.

Forward (functional over the KV cache and the expert backend, jit-able with ``nnx.split`` / ``nnx.merge``)::

    logits, kv_cache, expert_state = model(tokens, positions, kv_cache, expert_state, experts)

Positions, KV cache and padding (the rule every caller follows):
    * ``positions[b, t]`` is the 0-based position of ``tokens[b, t]`` in its own sequence. The token's key/value
      are stored at KV-cache index ``positions[b, t]`` (so the cache index IS the position), and its query
      attends to the cache indices ``0 .. positions[b, t]`` of row b (and, with a sliding window W, only to
      indices ``> positions[b, t] - W``). Keys written earlier in the same call are visible, so a prefill is
      one call over the whole prompt and each decode step is a call with T = 1.
    * Callers must write every position of a sequence in order, without gaps (prefill 0..P-1, then P, P+1, ...),
      and keep positions < ``kv_cache.max_len``; cache entries above a row's current position are never read,
      so a cache can be reused without clearing it.
    * ``positions[b, t] = -1`` marks a padding slot (left-padding prompts of different lengths to one [B, T],
      or a finished sequence in a decode batch): nothing is written to the cache, its router output is
      topk_ids -1 / topk_weights 0 (no expert is activated for it), and its logits are finite but meaningless.
      With left padding every row's last real token is at t = T - 1.

Numerics follow transformers 5.x (eager attention): RMSNorm in float32 then cast back, default RoPE with the
rotate-half convention, softmax of attention and router in float32, matmuls at Precision.HIGHEST (true float32
for float32 checkpoints, also on GPUs). Parameters keep Hugging Face layouts ([out, in] weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.config import MoEConfig
from ft_jax.models.routing import route

HIGHEST = jax.lax.Precision.HIGHEST

ParamFactory = Callable[[str, tuple[int, ...], str], jax.Array]
"""make(hf_name, shape, kind) -> array of that shape in the model dtype. kind: "weight" | "norm" | "bias".
``hf_name`` is the Hugging Face (Hub) tensor name, e.g. "model.layers.0.self_attn.q_proj.weight"."""


class ExpertBackend(Protocol):
    """Computes the routed experts of one MoE layer (the shared expert is added by the model)."""

    def __call__(self, moe_layer: int, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                 expert_state: Any) -> tuple[jax.Array, Any]:
        """moe_layer: Python int (index among MoE layers); x: f32|bf16[N, H] (the model dtype);
        topk_ids: i32[N, k] (-1 = no expert); topk_weights: f32[N, k].
        Returns (y f32[N, H] = sum_j w[n, j] * expert_{ids[n, j]}(x[n]), new expert_state)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static-size KV cache: one key and one value array per decoder layer.

    k, v: tuples (length num_layers) of [B, max_len, num_kv_heads, head_dim] arrays in the cache dtype.
    Index s of row b holds the key/value of that sequence's token at position s (see the module docstring).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_kv_cache(cfg: MoEConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """A zero-filled :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` tokens.

    Memory: 2 * num_layers * batch_size * max_len * num_kv_heads * head_dim * itemsize bytes."""
    shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


class ModelAux(NamedTuple):
    """Per-layer intermediates returned with ``return_aux=True`` (for tests and debugging).

    hidden_states: [num_layers + 1, B, T, H]: embeddings, output of layers 0..L-2, and the final-norm output of
        the last layer (the transformers ``output_hidden_states`` convention).
    router_logits: f32[num_moe_layers, B, T, E]; topk_ids: i32[num_moe_layers, B, T, k];
    topk_weights: f32[num_moe_layers, B, T, k] (combine weights actually applied).
    """

    hidden_states: jax.Array
    router_logits: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array


def random_param_factory(seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> ParamFactory:
    """Param factory for an untrained model: weights ~ N(0, std^2), norms 1, biases 0. Drawn with numpy
    (deterministic in seed and parameter creation order; no per-shape XLA compilations)."""
    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...], kind: str) -> jax.Array:
        if kind == "norm":
            return jnp.asarray(np.ones(shape, np.float32), dtype)
        if kind == "bias":
            return jnp.asarray(np.zeros(shape, np.float32), dtype)
        return jnp.asarray(std * rng.standard_normal(shape, dtype=np.float32), dtype)

    return make


def activation_fn(name: str) -> Callable[[jax.Array], jax.Array]:
    """Activation by expert-kernel name: "silu" (x * sigmoid(x)) or "gelu_tanh" (tanh-approximated GELU)."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    raise NotImplementedError(f"activation {name!r} (supported: silu, gelu_tanh)")


def _linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """y[..., o] = sum_i x[..., i] * w[o, i] (+ b[o]); w in Hugging Face [out, in] layout."""
    y = jnp.einsum("...i,oi->...o", x, w, precision=HIGHEST)
    return y if b is None else y + b


class Linear(nnx.Module):
    """Linear layer with a Hugging Face [out, in] weight and an optional bias [out]."""

    def __init__(self, make: ParamFactory, name: str, out_dim: int, in_dim: int, bias: bool):
        self.weight = nnx.Param(make(f"{name}.weight", (out_dim, in_dim), "weight"))
        self.bias = nnx.Param(make(f"{name}.bias", (out_dim,), "bias")) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return _linear(x, self.weight[...], None if self.bias is None else self.bias[...])


class RMSNorm(nnx.Module):
    """y = w * (x / sqrt(mean(x^2, -1) + eps)) computed in float32 and cast back to x.dtype before the scale
    (transformers' LlamaRMSNorm / OlmoeRMSNorm / Qwen*RMSNorm)."""

    def __init__(self, make: ParamFactory, name: str, dim: int, eps: float):
        self.weight = nnx.Param(make(f"{name}.weight", (dim,), "norm"))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)). Used for dense layers and the Qwen2-MoE shared expert."""

    def __init__(self, make: ParamFactory, name: str, hidden: int, inter: int, activation: str):
        self.gate_proj = Linear(make, f"{name}.gate_proj", inter, hidden, bias=False)
        self.up_proj = Linear(make, f"{name}.up_proj", inter, hidden, bias=False)
        self.down_proj = Linear(make, f"{name}.down_proj", hidden, inter, bias=False)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(activation_fn(self.activation)(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Default RoPE tables (transformers' default rope init): inv_freq[i] = theta^(-2i/D), i < D/2;
    angle = position * inv_freq, duplicated to D. positions: i32[B, T]. Returns (cos, sin) f32[B, T, D]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, D]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = concat(-x2, x1). x: [B, T, heads, D];
    cos, sin: [B, T, D] (cast to x.dtype, as transformers does)."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


class Attention(nnx.Module):
    """Grouped-query self-attention with a static-size KV cache; q/k/v/o biases and q/k norms per config."""

    def __init__(self, cfg: MoEConfig, make: ParamFactory, name: str):
        H, D, NH, KVH = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = Linear(make, f"{name}.q_proj", NH * D, H, cfg.qkv_bias)
        self.k_proj = Linear(make, f"{name}.k_proj", KVH * D, H, cfg.qkv_bias)
        self.v_proj = Linear(make, f"{name}.v_proj", KVH * D, H, cfg.qkv_bias)
        self.o_proj = Linear(make, f"{name}.o_proj", H, NH * D, cfg.o_bias)
        if cfg.qk_norm == "per_head":  # Qwen3-MoE: RMSNorm over D of each head, after the head split
            self.q_norm = RMSNorm(make, f"{name}.q_norm", D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(make, f"{name}.k_norm", D, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":  # OLMoE: RMSNorm over the full projection, before the head split
            self.q_norm = RMSNorm(make, f"{name}.q_norm", NH * D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(make, f"{name}.k_norm", KVH * D, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        self.num_heads, self.num_kv_heads, self.head_dim = NH, KVH, D

    def __call__(self, x, cos, sin, k_cache, v_cache, write_idx, mask):
        """x: [B, T, H]; cos, sin: f32[B, T, D]; k_cache, v_cache: [B, S, KVH, D]; write_idx: i32[B, T] cache
        index per token (S = dropped); mask: bool[B, T, S] keys visible to each query.
        Returns (out [B, T, H], k_cache, v_cache)."""
        B, T, _ = x.shape
        NH, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, NH*D], [B, T, KVH*D] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -self.clip_qkv, self.clip_qkv) for a in (q, k, v))
        q = q.reshape(B, T, NH, D)
        k = k.reshape(B, T, KVH, D)
        v = v.reshape(B, T, KVH, D)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        k_cache = k_cache.at[rows, write_idx].set(k.astype(k_cache.dtype), mode="drop")  # [B, S, KVH, D]
        v_cache = v_cache.at[rows, write_idx].set(v.astype(v_cache.dtype), mode="drop")

        G = NH // KVH  # query head h uses KV head h // G (transformers' repeat_kv)
        qg = q.reshape(B, T, KVH, G, D)
        keys, values = k_cache.astype(q.dtype), v_cache.astype(q.dtype)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, precision=HIGHEST) * (D ** -0.5)  # [B, KVH, G, T, S]
        scores = scores.astype(jnp.float32)
        # finfo.min (not -inf): a padding query that sees no key gets finite (uniform) weights instead of NaN.
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, values, precision=HIGHEST)  # [B, T, KVH, G, D]
        return self.o_proj(out.reshape(B, T, NH * D)), k_cache, v_cache


class MoEBlock(nnx.Module):
    """Router (+ Qwen2-MoE shared expert with its sigmoid gate); routed experts come from the expert backend."""

    def __init__(self, cfg: MoEConfig, make: ParamFactory, name: str, router_name: str):
        self.router = nnx.Param(make(router_name, (cfg.num_experts, cfg.hidden_size), "weight"))
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(make, f"{name}.shared_expert", cfg.hidden_size,
                                     cfg.shared_expert_intermediate_size, cfg.activation)
            self.shared_expert_gate = Linear(make, f"{name}.shared_expert_gate", 1, cfg.hidden_size, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.cfg = cfg

    def __call__(self, x, valid, moe_layer: int, expert_state, experts: ExpertBackend):
        """x: [N, H]; valid: bool[N]. Returns (y [N, H] in x.dtype, expert_state, Routing)."""
        r = route(self.cfg, x, self.router[...], valid)
        routed, expert_state = experts(moe_layer, x, r.topk_ids, r.topk_weights, expert_state)
        y = routed.astype(x.dtype)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y, expert_state, r


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer: h = x + attn(norm(x)); out = h + mlp_or_moe(norm(h))."""

    def __init__(self, cfg: MoEConfig, make: ParamFactory, layer: int):
        p = f"model.layers.{layer}"
        self.input_layernorm = RMSNorm(make, f"{p}.input_layernorm", cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, make, f"{p}.self_attn")
        self.post_attention_layernorm = RMSNorm(make, f"{p}.post_attention_layernorm", cfg.hidden_size,
                                                cfg.rms_norm_eps)
        self.moe_layer = cfg.moe_layer_index(layer)
        if self.moe_layer is None:
            self.mlp = MLP(make, f"{p}.mlp", cfg.hidden_size, cfg.intermediate_size, cfg.activation)
            self.moe = None
        else:
            router_name = f"{p}.block_sparse_moe.gate.weight" if cfg.family == "mixtral" else f"{p}.mlp.gate.weight"
            self.moe = MoEBlock(cfg, make, f"{p}.mlp", router_name)
            self.mlp = None


class MoETransformer(nnx.Module):
    """Decoder-only MoE language model (dense parameters only; routed experts live in an expert backend).

    Construct with a :data:`ParamFactory` (``ft_jax.checkpoint.load_checkpoint`` passes one that reads the
    checkpoint; :func:`random_param_factory` gives an untrained model). Parameters are in the factory's dtype.
    """

    def __init__(self, cfg: MoEConfig, make: ParamFactory):
        self.cfg = cfg
        self.embed_tokens = nnx.Param(make("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "weight"))
        self.layers = nnx.List([DecoderLayer(cfg, make, l) for l in range(cfg.num_layers)])
        self.norm = RMSNorm(make, "model.norm", cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(
            make("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "weight"))

    @property
    def dtype(self):
        """Parameter (and activation) dtype."""
        return self.embed_tokens[...].dtype

    def init_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """Zero KV cache in the model dtype (see :func:`init_kv_cache`)."""
        return init_kv_cache(self.cfg, batch_size, max_len, self.dtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache, expert_state: Any,
                 experts: ExpertBackend, *, return_aux: bool = False, last_logits_only: bool = False):
        """Run T tokens of B sequences through the model, updating the KV cache.

        Args:
            tokens: i32[B, T] token ids (any valid id in padding slots).
            positions: i32[B, T] per-sequence positions, -1 = padding (see the module docstring).
            kv_cache: :class:`KVCache` with batch size B.
            expert_state: pytree threaded through ``experts`` (None for ResidentExperts).
            experts: :class:`ExpertBackend`, called once per MoE layer in layer order with N = B*T tokens.
            return_aux: also return a :class:`ModelAux`.
            last_logits_only: compute logits for t = T-1 only (shape [B, 1, V]): the next-token logits of every
                row of a left-padded batch.
        Returns:
            (logits f32[B, T, V] (or [B, 1, V]), kv_cache, expert_state) and, with return_aux, a ModelAux.
        """
        cfg = self.cfg
        B, T = tokens.shape
        S = kv_cache.max_len
        valid = positions >= 0  # [B, T]
        cos, sin = rope_cos_sin(jnp.maximum(positions, 0), cfg.head_dim, cfg.rope_theta)  # [B, T, D]
        write_idx = jnp.where(valid, positions, S)  # [B, T]; S is out of range: dropped
        key_pos = jnp.arange(S)[None, None, :]
        mask = key_pos <= positions[:, :, None]  # [B, T, S]; all False for padding queries
        if cfg.sliding_window is not None:
            mask &= key_pos > positions[:, :, None] - cfg.sliding_window

        h = jnp.take(self.embed_tokens[...], tokens, axis=0)  # [B, T, H]
        hidden, logits_l, ids_l, weights_l = [h], [], [], []
        ks, vs = list(kv_cache.k), list(kv_cache.v)
        for l, layer in enumerate(self.layers):
            a, ks[l], vs[l] = layer.self_attn(layer.input_layernorm(h), cos, sin, ks[l], vs[l], write_idx, mask)
            h = h + a
            x = layer.post_attention_layernorm(h)
            if layer.moe is None:
                h = h + layer.mlp(x)
            else:
                y, expert_state, r = layer.moe(x.reshape(B * T, -1), valid.reshape(B * T), layer.moe_layer,
                                               expert_state, experts)
                h = h + y.reshape(B, T, -1)
                logits_l.append(r.logits)
                ids_l.append(r.topk_ids)
                weights_l.append(r.topk_weights)
            hidden.append(h)
        h = self.norm(h)
        hidden[-1] = h
        head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        h_out = h[:, -1:] if last_logits_only else h
        logits = jnp.einsum("bth,vh->btv", h_out, head, precision=HIGHEST,
                            preferred_element_type=jnp.float32)  # [B, T, V]
        kv_cache = KVCache(k=tuple(ks), v=tuple(vs))
        if not return_aux:
            return logits, kv_cache, expert_state
        L = len(ids_l)
        aux = ModelAux(
            hidden_states=jnp.stack(hidden),
            router_logits=jnp.stack(logits_l).reshape(L, B, T, -1) if L else jnp.zeros((0, B, T, cfg.num_experts)),
            topk_ids=jnp.stack(ids_l).reshape(L, B, T, -1) if L else jnp.zeros((0, B, T, cfg.top_k), jnp.int32),
            topk_weights=jnp.stack(weights_l).reshape(L, B, T, -1) if L else jnp.zeros((0, B, T, cfg.top_k)))
        return logits, kv_cache, expert_state, aux


def jit_forward(model: MoETransformer, *, return_aux: bool = False, last_logits_only: bool = False,
                donate_kv_cache: bool = True):
    """jit-compile the functional forward (``nnx.split`` once, ``nnx.merge`` inside the trace).

    Returns (fn, state) with ``fn(state, tokens, positions, kv_cache, expert_state, experts)`` returning what
    ``model(...)`` returns. ``experts`` must be a pytree (e.g. ResidentExperts, or an object registered as a
    pytree with no leaves); the KV cache argument is donated (updated in place) unless donate_kv_cache=False.
    """
    graphdef, state = nnx.split(model)

    def fn(state, tokens, positions, kv_cache, expert_state, experts):
        return nnx.merge(graphdef, state)(tokens, positions, kv_cache, expert_state, experts,
                                          return_aux=return_aux, last_logits_only=last_logits_only)

    return jax.jit(fn, donate_argnums=(3,) if donate_kv_cache else ()), state
