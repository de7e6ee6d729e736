"""Grouped-query self-attention (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss) of a stack of scanned decoder layers, with
q/k norms, clip, RoPE, gpt-oss's attention sinks and per-layer sliding windows.

Shapes: x [B, T, H]; q [B, T, NH, D], k/v [B, T, KVH, D]; the KV cache of a stack is (k, v), each [n, B, S, KVH, D]
with the cache index = the token's position (ft_jax/models/decoder.py states the positions/padding rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ft_jax.config import MoEConfig
from ft_jax.kernels import ffi_ops
from ft_jax.models.layers import (HIGHEST, AttentionInputs, Stacked, apply_rope, attend_live_blocks, cache_store,
                                  cache_zeros, linear, query_blocks, rms_norm, rope_cos_sin)


class GroupedQueryAttention(nnx.Module):
    """Grouped-query self-attention of a stack of n layers (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss), parameters
    [n, ...].

    q/k/v are one fused projection [n, (NH + 2 KVH) D, H] (+ bias), then q/k norms per config (per head: Qwen3-MoE;
    over the whole projection: OLMoE), optional clip (OLMoE), RoPE (default or YaRN), the KV cache update, softmax
    attention in float32 over the visible keys of the live KV blocks (layers.attend_live_blocks), and the o
    projection (+ bias). KV cache of the stack: (k, v), each
    [n, B, S, KVH, D]. A decode step (one query per row) on the CPU backend attends in one FFI call per layer
    (ffi_ops.decode_attention: the same softmax over the cache as stored, without XLA's dots and block copies).

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
        self.qkv = p.projection(qkv)  # [n, (NH + 2 KVH) D, H]
        self.qkv_bias = p.rows([(n.replace(".weight", ".bias"), (s[0],)) for n, s in qkv], "bias") \
            if cfg.qkv_bias else None  # [n, (NH + 2 KVH) D]
        self.o = p.projection([(f"{a}.o_proj.weight", (H, NH * D))])  # [n, H, NH D]
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
        return cache_zeros(shape, dtype), cache_zeros(shape, dtype)

    def __call__(self, i, x, ctx: AttentionInputs, cache: tuple[jax.Array, ...]):
        """Layer i's self-attention. x: [B, T, H]; cache: (k, v) [n, B, S, KVH, D] (layer i updated in place).
        Returns (out [B, T, H] in x.dtype, cache)."""
        cfg = self.cfg
        B, T, _ = x.shape
        NH, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        with jax.named_scope("qkv_proj"):
            q, k, v = self._qkv(i, x, ctx.positions)  # [B, T, NH, D], [B, T, KVH, D], [B, T, KVH, D]
        k_cache, v_cache = cache
        k_cache = k_cache.at[i, ctx.rows, ctx.write_idx].set(cache_store(k), mode="drop")
        v_cache = v_cache.at[i, ctx.rows, ctx.write_idx].set(cache_store(v), mode="drop")

        G = NH // KVH  # query head h uses KV head h // G (transformers' repeat_kv)
        # The queries of a KV head as the rows of one matrix [G T, D], and each block's keys and values per KV head
        # [blk, D]: both products of a block are then plain batched matrix products whose results are laid out as
        # the softmax reads them (the layout [B, T, KVH, G, D] made XLA transpose the scores twice per block, which
        # cost 6x the products; docs/DESIGN.md sec. 16).
        def attend(sub: AttentionInputs, q, caches):  # the queries q [B, Tq, NH, D] -> [B, Tq, KVH, G, D] in q.dtype
            Tq = q.shape[1]
            qt = q.reshape(B, Tq, KVH, G, D).transpose(0, 2, 3, 1, 4).reshape(B, KVH, G * Tq, D)

            def scores(blocks):  # keys [B, blk, KVH, D] -> f32[B, KVH, G, Tq, blk]
                keys = blocks[0].transpose(0, 2, 1, 3)  # [B, KVH, blk, D]
                s = jnp.einsum("bkqd,bksd->bkqs", qt, keys, precision=HIGHEST) * (D ** -0.5)  # [B, KVH, G Tq, blk]
                return s.astype(jnp.float32).reshape(B, KVH, G, Tq, -1)

            def values(probs, blocks):  # probs [B, KVH, G, Tq, blk], values [B, blk, KVH, D] -> f32[B, KVH, G Tq, D]
                vals = blocks[1].transpose(0, 2, 1, 3)  # [B, KVH, blk, D]
                return jnp.einsum("bkqs,bksd->bkqd", probs.reshape(B, KVH, G * Tq, -1), vals, precision=HIGHEST,
                                  preferred_element_type=jnp.float32)

            out = attend_live_blocks(sub, caches, i, q.dtype, scores, values, (B, KVH, G * Tq, D),
                                     sink=self._sink(i), window=self._window(i, k_cache.shape[2]))
            return out.reshape(B, KVH, G, Tq, D).transpose(0, 3, 1, 2, 4).astype(q.dtype)

        def attend_all(q, k_cache, v_cache):  # XLA's ops: any step, any backend
            return jnp.concatenate([attend(sub, q[:, part], (k_cache, v_cache)) for part, sub in query_blocks(ctx)],
                                   axis=1)

        def attend_decode_ffi(q, k_cache, v_cache):  # one query per row on the CPU: one FFI call (sec. 20.21)
            window = self._window(i, k_cache.shape[2])
            sinks = None if self.sinks is None else self.sinks[...][i].astype(jnp.float32)  # [NH]
            out = ffi_ops.decode_attention(q[:, 0], k_cache, v_cache, i, ctx.rows[:, 0], ctx.positions[:, 0],
                                           k_cache.shape[2] if window is None else window, scale=D ** -0.5,
                                           sinks=sinks)  # [B, NH, D]
            return out.reshape(B, 1, KVH, G, D)

        with jax.named_scope("softmax_attention"):
            if T == 1 and q.dtype in (jnp.float32, jnp.bfloat16):
                out = jax.lax.platform_dependent(q, k_cache, v_cache, cpu=attend_decode_ffi, default=attend_all)
            else:
                out = attend_all(q, k_cache, v_cache)
        with jax.named_scope("o_proj"):
            o = linear(out.reshape(B, T, NH * D), self.o[...], i)  # f32[B, T, H]
            if self.o_bias is not None:
                o = o + self.o_bias[...][i].astype(jnp.float32)
        return o.astype(x.dtype), (k_cache, v_cache)

    def _qkv(self, i, x, positions):
        """Layer i's fused q/k/v projection (+ bias), q/k norms, clip and RoPE. x: [B, T, H]; positions: i32[B, T].
        Returns q [B, T, NH, D], k, v [B, T, KVH, D] in x.dtype."""
        cfg = self.cfg
        B, T, _ = x.shape
        NH, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
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
        cos, sin = rope_cos_sin(jnp.maximum(positions, 0), D, cfg.rope_theta, cfg.rope_scaling)  # f32[B, T, D]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _window(self, i, S: int):
        """Layer i's sliding window (int or i32[] at the traced layer index), or None: full attention."""
        if all(w is None for w in self.windows):
            return None
        if len(set(self.windows)) == 1:
            return self.windows[0]
        # a window of S keys is no limit: every visible key is at a position > p - S
        return jnp.asarray([S if w is None else w for w in self.windows], jnp.int32)[i]

    def _sink(self, i):
        """Layer i's sink logits f32[1, KVH, G, 1, 1] (query head h = kv head * G + g; gpt-oss), or None."""
        if self.sinks is None:
            return None
        KVH = self.cfg.num_kv_heads
        return self.sinks[...][i].astype(jnp.float32).reshape(1, KVH, -1, 1, 1)
