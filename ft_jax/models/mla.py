"""Multi-head Latent Attention (MLA) of DeepSeek-V2/V3 for a stack of scanned decoder layers, in the absorbed form
(W_uk applied to the query, W_uv after the attention-weighted latents).

Widths: dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, C = kv_lora_rank, Q = q_lora_rank; x [B, T, H],
q [B, T, NH, dn + dr]; the KV cache of a stack is (latent [n, B, S, C], rope_key [n, B, S, dr]) in the model dtype.
Formulas, cache sizes and the derivation of the absorbed form: docs/DESIGN.md sec. 10 (models, mla.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.config import MoEConfig
from ft_jax.kernels import ffi_ops
from ft_jax.models.layers import (HIGHEST, AttentionInputs, Stacked, apply_rope, as_float, attend_live_blocks,
                                  cache_store, cache_zeros, linear, query_blocks, rms_norm, rope_cos_sin, stack)
from ft_jax.weight_formats import QuantizedTensor, dequantize_jnp, fp8, fp8_rowwise


def mla_softmax_scale(cfg: MoEConfig) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim)^-0.5, times (0.1 mscale_all_dim ln(factor) + 1)^2 under YaRN rope
    scaling with mscale_all_dim set and factor > 1 (transformers' yarn_apply_mscale / yarn_get_mscale)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim and rs.factor > 1:
        m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
        scale *= m * m
    return scale


def per_head_linear(x: jax.Array, w: "jax.Array | QuantizedTensor", layer, num_heads: int) -> jax.Array:
    """y[n, h, o] = sum_k x[n, h, k] * w[layer * num_heads + h, o, k], float32 accumulation.

    Args:
        x: f32 | bf16 [N, NH, K]. w: f32 | bf16 [n * NH, O, K], or an fp8 QuantizedTensor of that logical shape
            (read as stored): head h of layer l at row l * NH + h.
        layer: i32[] index into the stack (traced inside the layer scan). num_heads: NH.
    Returns:
        f32[N, NH, O].
    On the CPU backend: one ft_jax_linear FFI GEMV per head (a lax.map over the heads), each reading its [O, K] weight
    in place (see ft_jax.models.layers.linear for why not XLA's dot; scripts/bench_mla.py measures both);
    elsewhere one batched dot over the layer's heads.
    """
    base = jnp.asarray(layer, jnp.int32) * num_heads
    return jax.lax.platform_dependent(x, w, base, cpu=_heads_ffi, default=_heads_dot)


def _heads_ffi(x: jax.Array, w, base: jax.Array) -> jax.Array:
    """per_head_linear with heads base .. base + NH - 1 of w, one ffi_ops.linear call per head. x [N, NH, K]."""
    NH = x.shape[1]
    if isinstance(w, QuantizedTensor):
        def gemv(xh, head):  # the stored bytes, dequantized in registers
            return ffi_ops.linear(xh, w.data, head, scales=w.scales, weight_format=w.fmt)
    else:
        def gemv(xh, head):
            return ffi_ops.linear(xh, w, head)
    ys = jax.lax.map(lambda hx: gemv(hx[1], base + hx[0]),
                     (jnp.arange(NH, dtype=jnp.int32), jnp.swapaxes(x, 0, 1)))  # [NH, N, O]
    return jnp.swapaxes(ys, 0, 1)


def _heads_dot(x: jax.Array, w, base: jax.Array) -> jax.Array:
    """per_head_linear as one batched XLA dot over w[base : base + NH] (an fp8 w dequantized to x's dtype).
    x [N, NH, K]."""
    NH = x.shape[1]
    if isinstance(w, QuantizedTensor):
        part = QuantizedTensor(jax.lax.dynamic_slice_in_dim(w.data, base, NH),
                               jax.lax.dynamic_slice_in_dim(w.scales, base, NH), w.fmt)
        wl = dequantize_jnp(part, x.dtype)  # [NH, O, K]
    else:
        wl = jax.lax.dynamic_slice_in_dim(w, base, NH)  # [NH, O, K]
    return jnp.einsum("nhk,hok->nho", x.astype(wl.dtype), wl, precision=HIGHEST, preferred_element_type=jnp.float32)


def split_kv_b(t, num_heads: int, dn: int, dv: int) -> tuple[list, list]:
    """One layer's kv_b_proj [NH (dn + dv), C] split per head into (W_uk^T [C, dn] of every head, W_uv [dv, C] of
    every head), as numpy arrays, or as fp8 QuantizedTensors when it is stored in fp8 (read as stored, never
    dequantized; the values are exactly the stored ones):

    - W_uv of head h: rows h (dn + dv) + dn .. (h + 1)(dn + dv) of the matrix with one scale row per matrix row
      (fp8_rowwise: format fp8((1, bc))), so any block rows slice per head.
    - W_uk^T of head h: the transpose of rows h (dn + dv) .. h (dn + dv) + dn, format fp8((bc, g)) with
      g = gcd(br, dn + dv): a g-wide column group of the transpose comes from g consecutive rows starting at a
      multiple of g, which lie in one block row of the stored grid (g divides br), so the transpose's scale of
      (column block c, group j) is the stored scale of block (row (h (dn + dv) + j g) // br, c). DeepSeek-V3's
      dn = dv = br = bc = 128 gives g = 128: fp8((128, 128)) as stored.

    Other formats (q8_0 / q4_0 from --quantize) must be dequantized by the caller first.

    Args:
        t: numpy [NH (dn + dv), C] or an fp8 QuantizedTensor of that logical shape. num_heads: NH.
        dn: qk_nope_head_dim. dv: v_head_dim.
    Returns:
        (uk_t, uv): lists of NH arrays / QuantizedTensors [C, dn] and [dv, C].
    """
    w = dn + dv
    if not isinstance(t, QuantizedTensor):
        heads = t.reshape(num_heads, w, -1)  # [NH, dn + dv, C]
        return [heads[h, :dn].T for h in range(num_heads)], [heads[h, dn:] for h in range(num_heads)]
    br, bc = t.fmt.block
    rowwise = fp8_rowwise(t)  # scales [NH (dn + dv), ceil(C / bc)]
    uv = [QuantizedTensor(t.data[h * w + dn:(h + 1) * w], rowwise.scales[h * w + dn:(h + 1) * w], rowwise.fmt)
          for h in range(num_heads)]
    g = math.gcd(br, w)
    uk_fmt = fp8((bc, g))
    uk = []
    for h in range(num_heads):
        groups = (h * w + np.arange(0, dn, g)) // br  # stored block row of each g-wide column group
        uk.append(QuantizedTensor(t.data[h * w:h * w + dn].T, np.asarray(t.scales)[groups].T, uk_fmt))  # [C, dn]
    return uk, uv


def _deinterleave(x: jax.Array) -> jax.Array:
    """[..., d] -> [..., d] with the even dimensions first, then the odd ones (pairs (x0, x1), ... -> halves)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MultiHeadLatentAttention(nnx.Module):
    """MLA self-attention of a stack of n DeepSeek-V2/V3 layers (formulas: docs/DESIGN.md, models, mla.py), parameters
    [n, ...].

    Parameters (Hub names under model.layers.{l}.self_attn): with q_lora_rank Q, q_a_proj [Q, H] and
    kv_a_proj_with_mqa [C + dr, H] fused into one [n, Q + C + dr, H] projection (+ bias with attention_bias),
    q_a_layernorm [n, Q], q_b_proj [n, NH (dn + dr), Q]; without, q_proj [n, NH (dn + dr), H] and kv_a_proj_with_mqa
    [n, C + dr, H] (+ bias). kv_a_layernorm [n, C]; kv_b_proj [NH (dn + dv), C] kept as W_uk^T [n * NH, C, dn] and
    W_uv [n * NH, dv, C] (per head, for per_head_linear; fp8 as stored, split_kv_b); o_proj [n, H, NH dv] (+ bias).
    KV cache of the stack: (latent [n, B, S, C], rope_key [n, B, S, dr]).
    """

    def __init__(self, cfg: MoEConfig, p: Stacked):
        H, NH, Q, C = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.cfg = cfg
        self.scale = mla_softmax_scale(cfg)
        a = "self_attn"
        kv_a = (f"{a}.kv_a_proj_with_mqa.weight", (C + dr, H))
        if Q is not None:
            parts = [(f"{a}.q_a_proj.weight", (Q, H)), kv_a]
            self.a_proj = p.projection(parts)  # [n, Q + C + dr, H]
            self.a_bias = p.rows([(n.replace(".weight", ".bias"), (s[0],)) for n, s in parts], "bias") \
                if cfg.qkv_bias else None  # [n, Q + C + dr]
            self.q_a_norm = p(f"{a}.q_a_layernorm.weight", (Q,), "norm")  # [n, Q]
            self.q_b = p.projection([(f"{a}.q_b_proj.weight", (NH * (dn + dr), Q))])  # [n, NH (dn + dr), Q]
            self.q_proj = None
        else:
            self.a_proj = p.projection([kv_a])  # [n, C + dr, H]
            self.a_bias = p(kv_a[0].replace(".weight", ".bias"), (C + dr,), "bias") if cfg.qkv_bias else None
            self.q_a_norm = self.q_b = None
            # [n, NH (dn + dr), H]; never a bias
            self.q_proj = p.projection([(f"{a}.q_proj.weight", (NH * (dn + dr), H))])
        self.kv_a_norm = p(f"{a}.kv_a_layernorm.weight", (C,), "norm")  # [n, C]
        # kv_b_proj [NH (dn + dv), C] per layer, read per head (per_head_linear): fp8 as stored (split_kv_b), other
        # quantized formats dequantized here once
        dtype = self.kv_a_norm[...].dtype
        kv_b = [t if not isinstance(t, QuantizedTensor) or t.fmt.name == "fp8" else as_float(t, dtype)
                for t in p.each(f"{a}.kv_b_proj.weight", (NH * (dn + dv), C))]
        heads = [split_kv_b(t, NH, dn, dv) for t in kv_b]
        self.w_uk_t = nnx.Param(stack([uk for layer in heads for uk in layer[0]], "kv_b_proj (W_uk^T)"))  # [n NH, C, dn]
        self.w_uv = nnx.Param(stack([uv for layer in heads for uv in layer[1]], "kv_b_proj (W_uv)"))  # [n NH, dv, C]
        self.o = p.projection([(f"{a}.o_proj.weight", (H, NH * dv))])  # [n, H, NH dv]
        self.o_bias = p(f"{a}.o_proj.bias", (H,), "bias") if cfg.o_bias else None

    def init_cache(self, num_layers: int, batch_size: int, max_len: int, dtype) -> tuple[jax.Array, ...]:
        """Zero (latent [n, B, max_len, C], rope_key [n, B, max_len, dr]): n B max_len (C + dr) itemsize bytes."""
        lead = (num_layers, batch_size, max_len)
        return (cache_zeros(lead + (self.cfg.kv_lora_rank,), dtype),
                cache_zeros(lead + (self.cfg.qk_rope_head_dim,), dtype))  # bf16 as uint16 bits

    def __call__(self, i, x, ctx: AttentionInputs, cache: tuple[jax.Array, ...]):
        """Layer i's self-attention. x: [B, T, H]; cache: (latent [n, B, S, C], rope_key [n, B, S, dr]), layer i
        updated in place at the tokens' positions. Returns (out [B, T, H] in x.dtype, cache)."""
        cfg = self.cfg
        B, T, _ = x.shape
        NH, C, Q = cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
        dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        eps = cfg.rms_norm_eps
        latent_cache, rope_cache = cache

        a = linear(x, self.a_proj[...], i)  # f32[B, T, (Q) + C + dr]
        if self.a_bias is not None:
            a = a + self.a_bias[...][i].astype(jnp.float32)
        a = a.astype(x.dtype)
        if Q is not None:
            q = linear(rms_norm(a[..., :Q], self.q_a_norm[...][i], eps), self.q_b[...], i)  # f32[B, T, NH (dn+dr)]
            kv = a[..., Q:]
        else:
            q = linear(x, self.q_proj[...], i)
            kv = a
        q = q.astype(x.dtype).reshape(B, T, NH, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]  # [B, T, NH, dn], [B, T, NH, dr]
        c = rms_norm(kv[..., :C], self.kv_a_norm[...][i], eps)  # [B, T, C]
        k_pe = kv[..., None, C:]  # [B, T, 1, dr]
        if cfg.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        cos, sin = rope_cos_sin(jnp.maximum(ctx.positions, 0), dr, cfg.rope_theta, cfg.rope_scaling)  # f32[B, T, dr]
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)[:, :, 0]  # [B,T,NH,dr], [B,T,dr]

        latent_cache = latent_cache.at[i, ctx.rows, ctx.write_idx].set(cache_store(c.astype(x.dtype)), mode="drop")
        rope_cache = rope_cache.at[i, ctx.rows, ctx.write_idx].set(cache_store(k_pe.astype(x.dtype)), mode="drop")

        # absorbed W_uk: q_lat[h] = W_uk[h]^T q_nope[h]
        q_lat = per_head_linear(q_nope.reshape(B * T, NH, dn), self.w_uk_t[...], i, NH)  # f32[B T, NH, C]
        q_lat = q_lat.astype(x.dtype).reshape(B, T, NH, C)

        def attend(sub: AttentionInputs, q_lat, q_pe):  # [B, Tq, NH, C], [B, Tq, NH, dr] -> [B, Tq, NH, C]
            Tq = q_lat.shape[1]
            # Every head's queries as the rows of one matrix [NH Tq, .] (all heads share the latent keys): a block's
            # products are plain batched matrix products laid out as the softmax reads them (as in attention.py).
            q_lat_t = q_lat.transpose(0, 2, 1, 3).reshape(B, NH * Tq, C)
            q_pe_t = q_pe.transpose(0, 2, 1, 3).reshape(B, NH * Tq, dr)

            def scores(blocks):  # latents [B, blk, C], rope keys [B, blk, dr] -> f32[B, NH, Tq, blk]
                latents, rope_keys = blocks
                s = (jnp.einsum("bqc,bsc->bqs", q_lat_t, latents, precision=HIGHEST,
                                preferred_element_type=jnp.float32)
                     + jnp.einsum("bqr,bsr->bqs", q_pe_t, rope_keys, precision=HIGHEST,
                                  preferred_element_type=jnp.float32)) * self.scale  # [B, NH Tq, blk]
                return s.reshape(B, NH, Tq, -1)

            def values(probs, blocks):  # probs [B, NH, Tq, blk] -> f32[B, NH Tq, C]
                return jnp.einsum("bqs,bsc->bqc", probs.reshape(B, NH * Tq, -1), blocks[0], precision=HIGHEST,
                                  preferred_element_type=jnp.float32)

            o = attend_live_blocks(sub, (latent_cache, rope_cache), i, x.dtype, scores, values, (B, NH * Tq, C))
            return o.reshape(B, NH, Tq, C).transpose(0, 2, 1, 3).astype(x.dtype)

        o_lat = jnp.concatenate([attend(sub, q_lat[:, part], q_pe[:, part]) for part, sub in query_blocks(ctx)],
                                axis=1)  # [B, T, NH, C]
        # absorbed W_uv: out[h] = W_uv[h] o_lat[h]
        out = per_head_linear(o_lat.reshape(B * T, NH, C), self.w_uv[...], i, NH).astype(x.dtype)  # [B T, NH, dv]
        o = linear(out.reshape(B, T, NH * cfg.v_head_dim), self.o[...], i)  # f32[B, T, H]
        if self.o_bias is not None:
            o = o + self.o_bias[...][i].astype(jnp.float32)
        return o.astype(x.dtype), (latent_cache, rope_cache)
