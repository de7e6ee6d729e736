"""Flax NNX decoder of the supported MoE families, its decoder layers scanned with ``jax.lax.scan``.

Forward (functional over the KV cache and the expert backend, jit-able with ``nnx.split`` / ``nnx.merge``)::

    logits, kv_cache, expert_state = model(tokens, positions, kv_cache, expert_state, experts)

Layers: consecutive decoder layers of the same kind (all MoE, or all dense, e.g. Qwen2-MoE's ``mlp_only_layers``)
form a :class:`DecoderStack` whose parameters are stacked on a leading axis ([n, ...]) and whose forward is one
``lax.scan`` over the n layers: the step compiles one layer body per stack, so compile time does not grow with depth.
The dense projections read the stacked weights in place with the traced layer index (ft_jax.models.layers.linear),
the KV cache of a stack is one array per tensor ([n, B, S, KVH, D]) carried through the scan and updated in place, and
the expert backend's state (the slot pools, in exactly the shape the FFI calls consume, and the cache tables) is
carried too, with the MoE layer index traced into the cache plan.

Positions, KV cache and padding (the rule every caller follows):
    * ``positions[b, t]`` is the 0-based position of ``tokens[b, t]`` in its own sequence. The token's key/value
      are stored at KV-cache index ``positions[b, t]`` (so the cache index IS the position), and its query
      attends to the cache indices ``0 .. positions[b, t]`` of row b (and, with a sliding window W, only to
      indices ``> positions[b, t] - W``). Keys written earlier in the same call are visible, so a prefill is
      one call over the whole prompt and each decode step is a call with T = 1.
    * Callers write every position of a sequence in order, without gaps (prefill 0..P-1, then P, P+1, ...),
      and keep positions < ``kv_cache.max_len``; cache entries above a row's current position are never read,
      so a cache can be reused without clearing it.
    * ``positions[b, t] = -1`` marks a padding slot (left-padding prompts of different lengths to one [B, T],
      or a finished sequence in a decode batch): nothing is written to the cache, its router output is
      topk_ids -1 / topk_weights 0 (no expert is activated for it), and its logits are finite but meaningless.
      With left padding every row's last real token is at t = T - 1.

Numerics follow transformers 5.x (eager attention): RMSNorm in float32 then cast back, default RoPE with the
rotate-half convention, softmax of attention and router in float32, every projection accumulated in float32 and
rounded to the model dtype (as a bf16 torch matmul does). Parameters keep Hugging Face layouts ([out, in] weights);
q/k/v are concatenated into one [(NH + 2 KVH) D, H] projection and gate/up into one [2I, H] projection, so each
weight is read once per step in one call.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.config import MoEConfig
from ft_jax.models.layers import apply_rope, cache_load, cache_store, gated_mlp, linear, rms_norm, rope_cos_sin
from ft_jax.models.mla import MultiHeadLatentAttention
from ft_jax.models.routing import route, route_deepseek

ParamFactory = Callable[[str, tuple[int, ...], str], np.ndarray]
"""make(hf_name, shape, kind) -> host (numpy) array of that shape in the model dtype (float32 or ml_dtypes.bfloat16).
kind: "weight" | "norm" | "bias", or "weight_f32" | "bias_f32": the same, kept in float32 whatever the model dtype
(transformers' _keep_in_fp32_modules_strict: DeepSeek's router weight and e_score_correction_bias). ``hf_name`` is
the Hugging Face (Hub) tensor name, e.g. "model.layers.0.self_attn.q_proj.weight"."""


class ExpertBackend(Protocol):
    """Computes the routed experts of one MoE layer (the shared expert is added by the model)."""

    def __call__(self, moe_layer: jax.Array, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                 expert_state: Any) -> tuple[jax.Array, Any]:
        """moe_layer: i32[] MoE layer index (traced inside the layer scan); x: f32|bf16[N, H] (the model dtype);
        topk_ids: i32[N, k] (-1 = no expert); topk_weights: f32[N, k].
        Returns (y f32[N, H] = sum_j w[n, j] * expert_{ids[n, j]}(x[n]), new expert_state)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Static-size KV cache: one tuple of arrays per DecoderStack, each array [n, B, max_len, ...] (n = layers of the
    stack; the attention module decides what is cached, e.g. (k, v) [n, B, S, KVH, D] for grouped-query attention,
    (latent [n, B, S, C], rope_key [n, B, S, dr]) for DeepSeek's latent attention, ft_jax/models/mla.py).
    Index s of row b holds what the sequence's token at position s left behind.
    """

    stacks: tuple[tuple[jax.Array, ...], ...]

    @property
    def batch_size(self) -> int:
        return self.stacks[0][0].shape[1]

    @property
    def max_len(self) -> int:
        return self.stacks[0][0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache."""
        return sum(a.nbytes for stack in self.stacks for a in stack)


class Intermediates(NamedTuple):
    """Per-layer values returned with ``collect=True`` (parity checks against transformers, routing traces).

    hidden_states: [num_layers + 1, B, T, H]: embeddings, output of layers 0..L-2, and the final-norm output of the
        last layer (the transformers ``output_hidden_states`` convention).
    router_logits: f32[num_moe_layers, B, T, E]; topk_ids: i32[num_moe_layers, B, T, k] (-1 for padding);
    topk_weights: f32[num_moe_layers, B, T, k] (the combine weights applied).
    """

    hidden_states: jax.Array
    router_logits: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array


class AttentionInputs(NamedTuple):
    """What every layer's attention needs from the step's positions (computed once per forward).

    positions: i32[B, T] (-1 = padding); write_idx: i32[B, T] cache index per token (max_len = dropped: padding);
    causal: bool[B, T, S] keys each query may see (before any sliding window); rows: i32[B, T] batch row of each
    token.
    """

    positions: jax.Array
    write_idx: jax.Array
    causal: jax.Array
    rows: jax.Array


def attention_inputs(positions: jax.Array, max_len: int) -> AttentionInputs:
    """Cache write indices and the causal mask for positions i32[B, T] and a KV cache of max_len entries."""
    B, T = positions.shape
    write_idx = jnp.where(positions >= 0, positions, max_len)  # [B, T]; max_len is out of range: dropped
    causal = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]  # [B, T, S]; all False for padding
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    return AttentionInputs(positions, write_idx, causal, rows)


def random_param_factory(seed: int = 0, dtype=np.float32, std: float = 0.02) -> ParamFactory:
    """Param factory for an untrained model: weights ~ N(0, std^2), norms 1, biases 0, drawn with numpy
    (deterministic in seed and parameter creation order) and cast to ``dtype`` (float32 or bfloat16)."""
    rng = np.random.default_rng(seed)
    model_dtype = np.dtype(jnp.dtype(dtype))

    def make(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        np_dtype = np.dtype(np.float32) if kind.endswith("_f32") else model_dtype
        kind = kind.removesuffix("_f32")
        if kind == "norm":
            return np.ones(shape, np_dtype)
        if kind == "bias":
            return np.zeros(shape, np_dtype)
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np_dtype)

    return make


class Stacked:
    """Reads one parameter of every layer of a stack and stacks them: nnx.Param [n, *shape] on the device.

    Args: make: ParamFactory; layers: decoder layer indices of the stack (names "model.layers.{l}.{suffix}").
    """

    def __init__(self, make: ParamFactory, layers: tuple[int, ...]):
        self.make, self.layers = make, layers

    def __call__(self, suffix: str, shape: tuple[int, ...], kind: str = "weight") -> nnx.Param:
        return nnx.Param(jnp.asarray(np.stack([self.make(f"model.layers.{l}.{suffix}", shape, kind)
                                               for l in self.layers])))

    def rows(self, parts: list[tuple[str, tuple[int, ...]]], kind: str = "weight") -> nnx.Param:
        """Concatenates several tensors of each layer along their first axis (fused q/k/v or gate/up)."""
        return nnx.Param(jnp.asarray(np.stack([
            np.concatenate([self.make(f"model.layers.{l}.{s}", shape, kind) for s, shape in parts])
            for l in self.layers])))


class GroupedQueryAttention(nnx.Module):
    """Grouped-query self-attention of a stack of n layers (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss), parameters
    [n, ...].

    q/k/v are one fused projection [n, (NH + 2 KVH) D, H] (+ bias), then q/k norms per config (per head: Qwen3-MoE;
    over the whole projection: OLMoE), optional clip (OLMoE), RoPE (default or YaRN), the KV cache update, softmax
    attention in float32 over the visible keys, and the o projection (+ bias). KV cache of the stack: (k, v), each
    [n, B, S, KVH, D].

    gpt-oss: attention sinks ``self_attn.sinks`` [n, NH]: a learned logit per head joins each query's softmax over
    the keys and is dropped after it (transformers' eager_attention_forward: softmax(concat(scores, sink))[:-1]), so
    the weights of a row sum to less than 1. Sliding windows per layer (MoEConfig.attention_window): the layers of
    one scanned stack may differ (gpt-oss alternates sliding and full attention), so the window is read from a
    constant per-layer table at the traced layer index; a stack whose layers share one window uses it as a constant.
    """

    def __init__(self, cfg: MoEConfig, p: Stacked):
        H, D, NH, KVH = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.cfg = cfg
        a = "self_attn"
        qkv = [(f"{a}.q_proj.weight", (NH * D, H)), (f"{a}.k_proj.weight", (KVH * D, H)),
               (f"{a}.v_proj.weight", (KVH * D, H))]
        self.qkv = p.rows(qkv)  # [n, (NH + 2 KVH) D, H]
        self.qkv_bias = p.rows([(n.replace(".weight", ".bias"), (s[0],)) for n, s in qkv], "bias") \
            if cfg.qkv_bias else None  # [n, (NH + 2 KVH) D]
        self.o = p(f"{a}.o_proj.weight", (H, NH * D))  # [n, H, NH D]
        self.o_bias = p(f"{a}.o_proj.bias", (H,), "bias") if cfg.o_bias else None
        if cfg.qk_norm == "per_head":  # Qwen3-MoE: RMSNorm over D of each head, after the head split
            self.q_norm, self.k_norm = p(f"{a}.q_norm.weight", (D,), "norm"), p(f"{a}.k_norm.weight", (D,), "norm")
        elif cfg.qk_norm == "full":  # OLMoE: RMSNorm over the whole projection, before the head split
            self.q_norm = p(f"{a}.q_norm.weight", (NH * D,), "norm")
            self.k_norm = p(f"{a}.k_norm.weight", (KVH * D,), "norm")
        else:
            self.q_norm = self.k_norm = None
        self.sinks = p(f"{a}.sinks", (NH,), "bias") if cfg.attention_sinks else None  # [n, NH]
        self.windows = tuple(cfg.attention_window(l) for l in p.layers)  # per layer: int or None (full)

    def init_cache(self, num_layers: int, batch_size: int, max_len: int, dtype) -> tuple[jax.Array, ...]:
        """Zero (k, v) caches [n, B, max_len, KVH, D] of the model dtype (bf16 kept as its uint16 bits:
        layers.cache_store): 2 * n * B * max_len * KVH * D * itemsize bytes."""
        shape = (num_layers, batch_size, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        return cache_store(jnp.zeros(shape, dtype)), cache_store(jnp.zeros(shape, dtype))

    def __call__(self, i, x, ctx: AttentionInputs, cache: tuple[jax.Array, ...]):
        """Layer i's self-attention. x: [B, T, H]; cache: (k, v) [n, B, S, KVH, D] (layer i updated in place).
        Returns (out [B, T, H] in x.dtype, cache)."""
        cfg = self.cfg
        B, T, _ = x.shape
        NH, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        k_cache, v_cache = cache
        qkv = linear(x, self.qkv[...], i)  # f32[B, T, (NH + 2 KVH) D]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...][i].astype(jnp.float32)
        qkv = qkv.astype(x.dtype)
        q, k, v = qkv[..., :NH * D], qkv[..., NH * D:(NH + KVH) * D], qkv[..., (NH + KVH) * D:]
        if cfg.qk_norm == "full":
            q = rms_norm(q, self.q_norm[...][i], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...][i], cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.reshape(B, T, NH, D)
        k = k.reshape(B, T, KVH, D)
        v = v.reshape(B, T, KVH, D)
        if cfg.qk_norm == "per_head":
            q = rms_norm(q, self.q_norm[...][i], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...][i], cfg.rms_norm_eps)
        cos, sin = rope_cos_sin(jnp.maximum(ctx.positions, 0), D, cfg.rope_theta, cfg.rope_scaling)  # f32[B, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        k_cache = k_cache.at[i, ctx.rows, ctx.write_idx].set(cache_store(k), mode="drop")
        v_cache = v_cache.at[i, ctx.rows, ctx.write_idx].set(cache_store(v), mode="drop")
        keys, values = cache_load(k_cache[i], q.dtype), cache_load(v_cache[i], q.dtype)  # [B, S, KVH, D]

        mask = ctx.causal  # [B, T, S]
        if any(w is not None for w in self.windows):
            S = mask.shape[-1]
            if len(set(self.windows)) == 1:
                window = self.windows[0]
            else:  # a window of S keys is no limit: every visible key is at a position > p - S
                window = jnp.asarray([S if w is None else w for w in self.windows], jnp.int32)[i]
            key_pos = jnp.arange(S)[None, None, :]
            mask = mask & (key_pos > ctx.positions[:, :, None] - window)
        G = NH // KVH  # query head h uses KV head h // G (transformers' repeat_kv)
        qg = q.reshape(B, T, KVH, G, D)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, precision=jax.lax.Precision.HIGHEST) * (D ** -0.5)
        scores = scores.astype(jnp.float32)  # [B, KVH, G, T, S]
        # finfo.min (not -inf): a padding query that sees no key gets finite (uniform) weights instead of NaN.
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        if self.sinks is not None:  # query head h = kv head * G + g has sink logit sinks[i, h]
            sink = self.sinks[...][i].astype(jnp.float32).reshape(KVH, G)
            sink = jnp.broadcast_to(sink[None, :, :, None, None], (B, KVH, G, T, 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(q.dtype)
        else:
            probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, values, precision=jax.lax.Precision.HIGHEST)  # [B, T, KVH, G, D]
        o = linear(out.reshape(B, T, NH * D), self.o[...], i)  # f32[B, T, H]
        if self.o_bias is not None:
            o = o + self.o_bias[...][i].astype(jnp.float32)
        return o.astype(x.dtype), (k_cache, v_cache)


class DenseMLP(nnx.Module):
    """The gated MLP of dense decoder layers (Qwen2/3-MoE mlp_only_layers, DeepSeek first_k_dense_replace),
    gate/up fused [n, 2I, H], down [n, H, I]."""

    def __init__(self, cfg: MoEConfig, p: Stacked):
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.activation = cfg.activation
        self.gate_up = p.rows([("mlp.gate_proj.weight", (I, H)), ("mlp.up_proj.weight", (I, H))])  # [n, 2I, H]
        self.down = p("mlp.down_proj.weight", (H, I))  # [n, H, I]

    def __call__(self, i, x, valid, expert_state, experts: ExpertBackend):
        """x: [B, T, H]. Returns (y [B, T, H], expert_state unchanged, None: no routing)."""
        return gated_mlp(x, self.gate_up[...], self.down[...], i, self.activation), expert_state, None


class MoEBlock(nnx.Module):
    """Router [n, E, H] (+ bias [n, E] for gpt-oss) and, for Qwen2-MoE, the shared expert with its sigmoid gate; the
    routed experts come from the expert backend (host banks and slots)."""

    def __init__(self, cfg: MoEConfig, p: Stacked, moe_base: int):
        H, SI = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.cfg, self.moe_base = cfg, moe_base  # moe_base: MoE index of the stack's first layer
        router = {"mixtral": "block_sparse_moe.gate", "gpt_oss": "mlp.router"}.get(cfg.family, "mlp.gate")
        self.router = p(f"{router}.weight", (cfg.num_experts, H))  # [n, E, H]
        self.router_bias = p(f"{router}.bias", (cfg.num_experts,), "bias") if cfg.router_bias else None  # [n, E]
        if SI:
            s = "mlp.shared_expert"
            self.shared_gate_up = p.rows([(f"{s}.gate_proj.weight", (SI, H)), (f"{s}.up_proj.weight", (SI, H))])
            self.shared_down = p(f"{s}.down_proj.weight", (H, SI))  # [n, H, SI]
            self.shared_gate = p("mlp.shared_expert_gate.weight", (1, H))  # [n, 1, H]
        else:
            self.shared_gate_up = self.shared_down = self.shared_gate = None

    def __call__(self, i, x, valid, expert_state, experts: ExpertBackend):
        """Layer i's MoE block. x: [B, T, H]; valid: bool[B, T].
        Returns (y [B, T, H], expert_state, (router logits f32[N, E], topk ids i32[N, k], weights f32[N, k]))."""
        cfg = self.cfg
        B, T, H = x.shape
        xf = x.reshape(B * T, H)  # [N, H]
        logits = linear(xf, self.router[...], i)  # f32[N, E]
        if self.router_bias is not None:
            logits = logits + self.router_bias[...][i].astype(jnp.float32)
        logits = logits.astype(x.dtype).astype(jnp.float32)  # rounded to the model dtype, as transformers
        r = route(cfg, logits, valid.reshape(B * T))
        routed, expert_state = experts(jnp.int32(self.moe_base) + i, xf, r.topk_ids, r.topk_weights, expert_state)
        y = routed.astype(x.dtype)  # [N, H]
        if self.shared_gate_up is not None:
            gate = jax.nn.sigmoid(linear(xf, self.shared_gate[...], i).astype(x.dtype))  # [N, 1]
            y = y + gate * gated_mlp(xf, self.shared_gate_up[...], self.shared_down[...], i, cfg.activation)
        return y.reshape(B, T, H), expert_state, (r.logits, r.topk_ids, r.topk_weights)


class DeepseekMoEBlock(nnx.Module):
    """DeepSeek-V2/V3 MoE block (transformers' DeepseekV2Moe / DeepseekV3MoE): a float32 router [n, E, H] (with
    e_score_correction_bias [n, E] for V3, "mlp.gate.e_score_correction_bias"), routed experts from the expert
    backend, plus n_shared_experts shared experts as one ungated dense MLP of width SI = moe_intermediate_size *
    n_shared_experts on the device ("mlp.shared_experts.{gate,up,down}_proj.weight": gate/up fused [n, 2 SI, H],
    down [n, H, SI]) added to the routed output."""

    def __init__(self, cfg: MoEConfig, p: Stacked, moe_base: int):
        H, E, SI = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size * cfg.n_shared_experts
        self.cfg, self.moe_base = cfg, moe_base
        self.router = p("mlp.gate.weight", (E, H), "weight_f32")  # f32[n, E, H]
        self.score_bias = p("mlp.gate.e_score_correction_bias", (E,), "bias_f32") \
            if cfg.scoring_func == "sigmoid" else None  # f32[n, E]
        if SI:
            s = "mlp.shared_experts"
            self.shared_gate_up = p.rows([(f"{s}.gate_proj.weight", (SI, H)), (f"{s}.up_proj.weight", (SI, H))])
            self.shared_down = p(f"{s}.down_proj.weight", (H, SI))  # [n, H, SI]
        else:
            self.shared_gate_up = self.shared_down = None

    def __call__(self, i, x, valid, expert_state, experts: ExpertBackend):
        """Layer i's MoE block. x: [B, T, H]; valid: bool[B, T].
        Returns (y [B, T, H], expert_state, (router logits f32[N, E], topk ids i32[N, k], weights f32[N, k]))."""
        cfg = self.cfg
        B, T, H = x.shape
        xf = x.reshape(B * T, H)  # [N, H]
        logits = linear(xf.astype(jnp.float32), self.router[...], i)  # f32[N, E], as transformers: all in float32
        bias = None if self.score_bias is None else self.score_bias[...][i]
        r = route_deepseek(cfg, logits, valid.reshape(B * T), bias)
        routed, expert_state = experts(jnp.int32(self.moe_base) + i, xf, r.topk_ids, r.topk_weights, expert_state)
        y = routed.astype(x.dtype)  # [N, H]
        if self.shared_gate_up is not None:
            y = y + gated_mlp(xf, self.shared_gate_up[...], self.shared_down[...], i, cfg.activation)
        return y.reshape(B, T, H), expert_state, (r.logits, r.topk_ids, r.topk_weights)


def _layer_kind(cfg: MoEConfig, layer: int) -> str:
    return "dense" if cfg.moe_layer_index(layer) is None else "moe"


class DecoderStack(nnx.Module):
    """n consecutive decoder layers of one kind, parameters stacked on a leading axis, run as one ``lax.scan``.

    Each layer is pre-norm: h = x + attn(norm(x)); out = h + ffn(norm(h)), with the family's attention module and
    a DenseMLP or an MoEBlock as the ffn. Every module of a stack takes the traced layer index i first and reads
    its stacked parameters at i; caches are tuples of [n, B, S, ...] arrays updated in place at i.

    Args:
        cfg: model config. make: ParamFactory. layers: the decoder layer indices of the stack (consecutive, one kind).
    """

    def __init__(self, cfg: MoEConfig, make: ParamFactory, layers: tuple[int, ...]):
        H = cfg.hidden_size
        self.cfg, self.layers = cfg, layers
        p = Stacked(make, layers)
        self.input_norm = p("input_layernorm.weight", (H,), "norm")  # [n, H]
        self.post_norm = p("post_attention_layernorm.weight", (H,), "norm")  # [n, H]
        self.attn = MultiHeadLatentAttention(cfg, p) if cfg.kv_lora_rank else GroupedQueryAttention(cfg, p)
        moe_base = cfg.moe_layer_index(layers[0])
        if moe_base is None:
            self.ffn = DenseMLP(cfg, p)
        elif cfg.family in ("deepseek_v2", "deepseek_v3"):
            self.ffn = DeepseekMoEBlock(cfg, p, moe_base)
        else:
            self.ffn = MoEBlock(cfg, p, moe_base)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def init_cache(self, batch_size: int, max_len: int, dtype) -> tuple[jax.Array, ...]:
        """This stack's zero KV cache (arrays [n, B, max_len, ...]; the attention module defines them)."""
        return self.attn.init_cache(self.num_layers, batch_size, max_len, dtype)

    def layer(self, i, h, cache, ctx: AttentionInputs, valid, expert_state, experts: ExpertBackend):
        """Decoder layer i of the stack (the scan body). h: [B, T, H]; valid: bool[B, T].
        Returns (h, cache, expert_state, routing (router logits [N, E], topk ids [N, k], weights [N, k]) or None)."""
        eps = self.cfg.rms_norm_eps
        a, cache = self.attn(i, rms_norm(h, self.input_norm[...][i], eps), ctx, cache)
        h = h + a
        y, expert_state, routing = self.ffn(i, rms_norm(h, self.post_norm[...][i], eps), valid, expert_state,
                                            experts)
        return h + y, cache, expert_state, routing

    def __call__(self, h, cache, ctx: AttentionInputs, valid, expert_state, experts: ExpertBackend,
                 collect: bool = False):
        """All n layers as one lax.scan. Returns (h, cache, expert_state, per-layer outputs or None): with collect,
        the output of every layer [n, B, T, H] and, for MoE stacks, the routing [n, N, ...]."""

        def body(carry, i):
            h, cache, expert_state = carry
            h, cache, expert_state, routing = self.layer(i, h, cache, ctx, valid, expert_state, experts)
            return (h, cache, expert_state), ((h, routing) if collect else None)

        (h, cache, expert_state), ys = jax.lax.scan(body, (h, cache, expert_state),
                                                    jnp.arange(self.num_layers, dtype=jnp.int32))
        return h, cache, expert_state, ys


class MoETransformer(nnx.Module):
    """Decoder-only MoE language model (dense parameters only; routed experts live in an expert backend).

    Construct with a :data:`ParamFactory` (``ft_jax.checkpoint.load_checkpoint`` passes one that reads the
    checkpoint; :func:`random_param_factory` gives an untrained model). Parameters are in the factory's dtype.
    """

    def __init__(self, cfg: MoEConfig, make: ParamFactory):
        self.cfg = cfg
        # [V, H]; a bf16 table is kept as its uint16 bits: XLA:CPU would convert the whole table to float32 for every
        # gather (a 250 MiB copy per step for a 32000 x 2048 vocabulary). take_rows and linear read the bits.
        self.embed_tokens = nnx.Param(cache_store(jnp.asarray(make("model.embed_tokens.weight",
                                                                   (cfg.vocab_size, cfg.hidden_size), "weight"))))
        runs = itertools.groupby(range(cfg.num_layers), key=lambda l: _layer_kind(cfg, l))
        self.stacks = nnx.List([DecoderStack(cfg, make, tuple(layers)) for _, layers in runs])
        self.norm = nnx.Param(jnp.asarray(make("model.norm.weight", (cfg.hidden_size,), "norm")))
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(
            jnp.asarray(make("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "weight")))  # [V, H]

    @property
    def dtype(self):
        """Parameter (and activation) dtype."""
        return self.norm[...].dtype

    def init_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """Zero KV cache in the model dtype for batch_size sequences of up to max_len tokens."""
        return KVCache(tuple(s.init_cache(batch_size, max_len, self.dtype) for s in self.stacks))

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache, expert_state: Any,
                 experts: ExpertBackend, *, last_logits_only: bool = False, collect: bool = False):
        """Run T tokens of B sequences through the model, updating the KV cache.

        Args:
            tokens: i32[B, T] token ids (any valid id in padding slots).
            positions: i32[B, T] per-sequence positions, -1 = padding (see the module docstring).
            kv_cache: :class:`KVCache` with batch size B.
            expert_state: pytree threaded through ``experts``.
            experts: :class:`ExpertBackend`, called once per MoE layer in layer order with N = B*T tokens.
            last_logits_only: compute logits for t = T-1 only (shape [B, 1, V]): the next-token logits of every
                row of a left-padded batch.
            collect: also return :class:`Intermediates` (static: a separate executable).
        Returns:
            (logits f32[B, T, V] (or [B, 1, V]), kv_cache, expert_state) and, with collect, Intermediates.
        """
        cfg = self.cfg
        B, T = tokens.shape
        ctx = attention_inputs(positions, kv_cache.max_len)
        valid = positions >= 0  # [B, T]
        h = cache_load(jnp.take(self.embed_tokens[...], tokens, axis=0), self.dtype)  # [B, T, H]
        hidden, routing, caches = [h[None]], [], []
        for stack, cache in zip(self.stacks, kv_cache.stacks):
            h, cache, expert_state, ys = stack(h, cache, ctx, valid, expert_state, experts, collect)
            caches.append(cache)
            if collect:
                hidden.append(ys[0])
                if ys[1] is not None:
                    routing.append(ys[1])
        h = rms_norm(h, self.norm[...], cfg.rms_norm_eps)
        head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        h_out = h[:, -1:] if last_logits_only else h
        logits = linear(h_out, head)  # f32[B, T, V]
        kv_cache = KVCache(tuple(caches))
        if not collect:
            return logits, kv_cache, expert_state
        hidden_states = jnp.concatenate(hidden)[:cfg.num_layers + 1]  # [L + 1, B, T, H]
        hidden_states = hidden_states.at[-1].set(h)
        E, k = cfg.num_experts, cfg.top_k
        logits_l = jnp.concatenate([r[0] for r in routing]).reshape(-1, B, T, E)
        aux = Intermediates(hidden_states=hidden_states, router_logits=logits_l,
                            topk_ids=jnp.concatenate([r[1] for r in routing]).reshape(-1, B, T, k),
                            topk_weights=jnp.concatenate([r[2] for r in routing]).reshape(-1, B, T, k))
        return logits, kv_cache, expert_state, aux
