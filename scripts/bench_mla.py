#!/usr/bin/env python3
"""Benchmark of Multi-head Latent Attention decode steps (ft_jax/models/mla.py), variants measured side by side.

A stack of --layers DeepSeek-V2-Lite attention layers (H 2048, 16 heads, qk_nope 128, qk_rope 64, v 128,
kv_lora_rank 512, q_proj without a q LoRA; random bf16 weights) decodes one token (B = 1, T = 1) at position
--context - 1 of a filled latent cache, all layers in one jitted lax.scan as in the engine. Two tables:

  1. The per-head products W_uk[h]^T q and W_uv[h] o (the absorbed form's only per-head weights): GB/s of those
     weights read per step, ft_jax's per_head_linear (on the CPU one ft_jax_linear GEMV per head) against XLA's
     batched einsum over the dynamically indexed layer. Goal: per_head_linear at least as fast (ratio >= 1).
  2. The whole attention step: the absorbed form ft_jax uses (scores and values on the cached latents) against the
     expanded form (every cached latent expanded through kv_b_proj to NH keys and values each step, as transformers
     computes it), milliseconds per step. Goal: absorbed faster, increasingly so with the context.

Figures are medians over --repeats timed windows of --min-time seconds (ft_jax.offload.profile.measure_rates, the
variants alternating window by window), spread (min-max) in brackets; the ratio divides the medians. The load average
is printed with the results.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from ft_jax.config import config_from_dict
from ft_jax.models.layers import Stacked, attention_inputs, random_param_factory
from ft_jax.models.layers import HIGHEST, linear
from ft_jax.models.mla import MultiHeadLatentAttention, per_head_linear
from ft_jax.offload.profile import measure_rates

V2_LITE = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 1024, "hidden_size": 2048,
           "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
           "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "intermediate_size": 10944,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840,
           "torch_dtype": "bfloat16"}


def expanded_step(attn: MultiHeadLatentAttention, kv_b: jax.Array, i, x, ctx, cache):
    """The expanded form of layer i's decode step: keys and values of every cached latent recomputed through
    kv_b_proj [n, NH (dn + dv), C]; the query side, the cache write and o_proj as the absorbed module."""
    cfg = attn.cfg
    B, T, _ = x.shape
    NH, C, dn, dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    q = linear(x, attn.q_proj[...], i).astype(x.dtype).reshape(B, T, NH, -1)  # rope left out: same cost either way
    kv = linear(x, attn.a_proj[...], i).astype(x.dtype)
    latent_cache, rope_cache = cache
    latent_cache = latent_cache.at[i, ctx.rows, ctx.write_idx].set(kv[..., :C], mode="drop")
    rope_cache = rope_cache.at[i, ctx.rows, ctx.write_idx].set(kv[..., C:], mode="drop")
    kv_full = linear(latent_cache[i], kv_b, i).astype(x.dtype).reshape(B, -1, NH, dn + dv)  # [B, S, NH, dn + dv]
    keys = jnp.concatenate([kv_full[..., :dn], jnp.broadcast_to(rope_cache[i][:, :, None], kv_full.shape[:3] +
                                                                 (cfg.qk_rope_head_dim,))], -1)
    scores = jnp.einsum("bthd,bshd->bhts", q, keys, precision=HIGHEST, preferred_element_type=jnp.float32)
    scores = jnp.where(ctx.causal[:, None], scores * attn.scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, -1).astype(x.dtype)
    out = jnp.einsum("bhts,bshd->bthd", probs, kv_full[..., dn:], precision=HIGHEST,
                     preferred_element_type=jnp.float32).astype(x.dtype)
    o = linear(out.reshape(B, T, NH * dv), attn.o[...], i).astype(x.dtype)
    return o, (latent_cache, rope_cache)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.5)
    args = parser.parse_args(argv)
    cfg = config_from_dict({**V2_LITE, "num_hidden_layers": args.layers})
    NH, C, dn, dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    attn = MultiHeadLatentAttention(cfg, Stacked(random_param_factory(0, jnp.bfloat16), tuple(range(args.layers))))
    n = args.layers
    w_uk_t, w_uv = attn.w_uk_t[...], attn.w_uv[...]  # [n NH, C, dn], [n NH, dv, C]
    # kv_b_proj rows per head: [W_uk[h] (dn rows); W_uv[h] (dv rows)], [n, NH (dn + dv), C]
    kv_b = jnp.concatenate([jnp.swapaxes(w_uk_t, 1, 2).reshape(n, NH, dn, C), w_uv.reshape(n, NH, dv, C)],
                           axis=2).reshape(n, NH * (dn + dv), C)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 1, cfg.hidden_size)), jnp.bfloat16)

    def layer_scan(body):
        def run(*carry):
            return jax.lax.scan(lambda c, i: (body(i, c), None), carry, jnp.arange(n, dtype=jnp.int32))[0]
        return jax.jit(run)

    # 1. per-head products
    q0 = jnp.asarray(rng.standard_normal((1, NH, dn)), jnp.bfloat16)
    ffi = layer_scan(lambda i, c: (per_head_linear(per_head_linear(c[0], w_uk_t, i, NH).astype(jnp.bfloat16), w_uv,
                                                   i, NH).astype(jnp.bfloat16),))

    def einsum_heads(x, w, i):
        return jnp.einsum("nhk,hok->nho", x, jax.lax.dynamic_slice_in_dim(w, i * NH, NH), precision=HIGHEST,
                          preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    xla = layer_scan(lambda i, c: (einsum_heads(einsum_heads(c[0], w_uk_t, i), w_uv, i),))
    np.testing.assert_allclose(np.asarray(ffi(q0)[0], np.float32), np.asarray(xla(q0)[0], np.float32), rtol=0.05,
                               atol=0.05 * float(jnp.abs(xla(q0)[0].astype(jnp.float32)).max()))
    nbytes = w_uk_t.nbytes + w_uv.nbytes
    rates = measure_rates({"per_head_linear": (lambda: ffi(q0)[0].block_until_ready(), nbytes),
                           "xla einsum": (lambda: xla(q0)[0].block_until_ready(), nbytes)},
                          args.repeats, args.min_time)
    print(f"1. per-head W_uk^T q and W_uv o, {n} layers x {NH} heads, {nbytes / 2**20:.1f} MiB bf16 per step (GB/s)")
    for name, (med, lo, hi) in rates.items():
        print(f"   {name:16s} {med:7.2f} [{lo:.2f}-{hi:.2f}]")
    print(f"   ratio per_head_linear / xla einsum: {rates['per_head_linear'][0] / rates['xla einsum'][0]:.2f}")

    # 2. whole attention step
    print(f"2. attention decode step, {n} layers (ms per step)")
    for S in args.context:
        cache = attn.init_cache(n, 1, S, jnp.bfloat16)
        cache = tuple(jnp.asarray(rng.standard_normal(a.shape), jnp.bfloat16) for a in cache)
        ctx = attention_inputs(jnp.full((1, 1), S - 1, jnp.int32), S)

        def residual(step):
            def body(i, carry):
                o, new_cache = step(i, carry[0], ctx, carry[1])
                return carry[0] + o, new_cache
            return body

        absorbed = layer_scan(residual(attn))
        expanded = layer_scan(residual(lambda i, x, ctx, c: expanded_step(attn, kv_b, i, x, ctx, c)))
        steps = {"absorbed": (lambda: absorbed(x, cache)[0].block_until_ready(), 1),
                 "expanded": (lambda: expanded(x, cache)[0].block_until_ready(), 1)}
        per_s = measure_rates(steps, args.repeats, args.min_time)  # "GB/s" of 1-byte calls: 1e-9 steps per second
        ms = {k: 1e-6 / v[0] for k, v in per_s.items()}
        spread = {k: (1e-6 / v[2], 1e-6 / v[1]) for k, v in per_s.items()}
        print(f"   S={S:6d}  absorbed {ms['absorbed']:7.3f} [{spread['absorbed'][0]:.3f}-{spread['absorbed'][1]:.3f}]"
              f"  expanded {ms['expanded']:7.3f} [{spread['expanded'][0]:.3f}-{spread['expanded'][1]:.3f}]"
              f"  expanded / absorbed {ms['expanded'] / ms['absorbed']:.2f}")
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
