"""Multi-head Latent Attention (ft_jax/models/mla.py): the absorbed form over the latent cache against a float64
numpy reference of the expanded form (keys and values rebuilt per head from the latents, RoPE as rotations of
dimension pairs), the cache contents, its size, and the YaRN softmax scale."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ft_jax.config import RopeScaling, load_config
from ft_jax.models.decoder import MoETransformer
from ft_jax.models.layers import Stacked, attention_inputs, random_param_factory, rope_frequencies
from ft_jax.models.mla import (MultiHeadLatentAttention, _heads_dot, _heads_ffi, mla_softmax_scale, per_head_linear,
                                split_kv_b)
from ft_jax.weight_formats import QuantizedTensor, dequantize, fp8

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
V3 = load_config(os.path.join(FIXTURES, "deepseek_v3"))
V2 = load_config(os.path.join(FIXTURES, "deepseek_v2"))
YARN = RopeScaling(factor=8.0, original_max_position_embeddings=4, mscale=0.707, mscale_all_dim=1.0)


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _rotate_pairs(x, pos, cfg, interleave):
    """RoPE as a rotation of dimension pairs: (x[2j], x[2j+1]) with rope_interleave, else (x[j], x[j + d/2]), by
    the angle pos * inv_freq[j], times the attention factor. x: [..., d] for one position. Returns the pairs
    rotated, in the input's layout (dot products do not depend on the layout)."""
    inv_freq, factor = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    d = x.shape[-1]
    a_idx, b_idx = (np.arange(0, d, 2), np.arange(1, d, 2)) if interleave else (np.arange(d // 2),
                                                                                np.arange(d // 2, d))
    ang = pos * inv_freq
    out = np.empty_like(x)
    a, b = x[..., a_idx], x[..., b_idx]
    out[..., a_idx] = (a * np.cos(ang) - b * np.sin(ang)) * factor
    out[..., b_idx] = (a * np.sin(ang) + b * np.cos(ang)) * factor
    return out


def reference(cfg, params, x, positions):
    """Expanded MLA of one layer in float64: out [B, T, H], latents {(b, pos): c [C]}."""
    P = {k: np.asarray(v, np.float64) for k, v in params.items()}
    NH, C, dn, dr, dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    eps = cfg.rms_norm_eps
    scale = (dn + dr) ** -0.5
    if cfg.rope_scaling is not None and cfg.rope_scaling.mscale_all_dim:
        scale *= (0.1 * cfg.rope_scaling.mscale_all_dim * math.log(cfg.rope_scaling.factor) + 1) ** 2
    B, T, H = x.shape
    out = np.zeros((B, T, H))
    latents = {}
    for b in range(B):
        keys, values = {}, {}
        for t in range(T):
            p = positions[b, t]
            if p < 0:
                continue
            xt = x[b, t].astype(np.float64)
            if cfg.q_lora_rank is not None:
                qa = P["q_a"] @ xt + P.get("q_a_bias", 0)
                q = P["q_b"] @ _rms(qa, P["q_a_norm"], eps)
            else:
                q = P["q_proj"] @ xt
            kv = P["kv_a"] @ xt + P.get("kv_a_bias", 0)
            c = _rms(kv[:C], P["kv_a_norm"], eps)
            latents[b, p] = c
            k_pe = _rotate_pairs(kv[C:], p, cfg, cfg.rope_interleave)
            kvb = (P["kv_b"] @ c).reshape(NH, dn + dv)
            keys[p] = np.concatenate([kvb[:, :dn], np.broadcast_to(k_pe, (NH, dr))], -1)  # [NH, dn + dr]
            values[p] = kvb[:, dn:]  # [NH, dv]
            q = q.reshape(NH, dn + dr)
            q = np.concatenate([q[:, :dn], _rotate_pairs(q[:, dn:], p, cfg, cfg.rope_interleave)], -1)
            seen = sorted(keys)
            s = np.stack([(q * keys[j]).sum(-1) for j in seen], -1) * scale  # [NH, len(seen)]
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            o = np.einsum("hs,shd->hd", w, np.stack([values[j] for j in seen]))  # [NH, dv]
            out[b, t] = P["o"] @ o.reshape(-1) + P.get("o_bias", 0)
    return out, latents


def _layer_params(cfg, make, layer=0):
    """The Hub tensors of one layer, drawn from ``make`` in the order MultiHeadLatentAttention asks for them."""
    names = {}
    p = Stacked(lambda name, shape, kind: names.setdefault(name, make(name, shape, kind)), (layer,))
    attn = MultiHeadLatentAttention(cfg, p)
    a = f"model.layers.{layer}.self_attn."
    out = {"kv_a": names[a + "kv_a_proj_with_mqa.weight"], "kv_a_norm": names[a + "kv_a_layernorm.weight"],
           "kv_b": names[a + "kv_b_proj.weight"], "o": names[a + "o_proj.weight"]}
    if cfg.q_lora_rank is not None:
        out.update(q_a=names[a + "q_a_proj.weight"], q_a_norm=names[a + "q_a_layernorm.weight"],
                   q_b=names[a + "q_b_proj.weight"])
    else:
        out["q_proj"] = names[a + "q_proj.weight"]
    if cfg.qkv_bias:
        out.update(kv_a_bias=names[a + "kv_a_proj_with_mqa.bias"], o_bias=names[a + "o_proj.bias"])
        if cfg.q_lora_rank is not None:
            out["q_a_bias"] = names[a + "q_a_proj.bias"]
    return attn, out


def _random_make(seed):
    rng = np.random.default_rng(seed)

    def make(name, shape, kind):
        if kind == "norm":
            return (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)

    return make


@pytest.mark.parametrize("name,cfg", [
    ("v3 q_lora, interleave", V3),
    ("v3 no interleave, yarn, biases", dataclasses.replace(V3, rope_interleave=False, rope_scaling=YARN,
                                                           qkv_bias=True, o_bias=True)),
    ("v2 q_proj, v 12 != nope 16", V2),
])
def test_absorbed_attention_equals_the_expanded_reference(name, cfg):
    attn, params = _layer_params(cfg, _random_make(3))
    rng = np.random.default_rng(4)
    B, T, S = 2, 6, 9
    x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]], np.int32)  # row 1 left-padded
    cache = attn.init_cache(1, B, S, jnp.float32)
    out, (latent_cache, rope_cache) = jax.jit(lambda x, p, c: attn(0, x, attention_inputs(p, S), c))(
        jnp.asarray(x), jnp.asarray(positions), cache)
    want, latents = reference(cfg, params, x, positions)
    valid = positions >= 0
    np.testing.assert_allclose(np.asarray(out)[valid], want[valid], atol=2e-5, rtol=1e-5, err_msg=name)
    # the cache holds the normalised latent at each written position, zeros elsewhere
    assert latent_cache.shape == (1, B, S, cfg.kv_lora_rank) and rope_cache.shape == (1, B, S, cfg.qk_rope_head_dim)
    for b in range(B):
        written = sorted(p for bb, p in latents if bb == b)
        np.testing.assert_allclose(np.asarray(latent_cache[0, b, written]), np.stack([latents[b, p] for p in written]),
                                   atol=1e-5, rtol=1e-5)
        rest = [s for s in range(S) if s not in written]
        assert (np.asarray(latent_cache[0, b, rest]) == 0).all() and (np.asarray(rope_cache[0, b, rest]) == 0).all()
    # decoding the next token from that cache equals the reference over the longer sequence
    x2 = rng.standard_normal((B, 1, cfg.hidden_size)).astype(np.float32)
    p2 = np.array([[6], [4]], np.int32)
    out2, _ = jax.jit(lambda x, p, c: attn(0, x, attention_inputs(p, S), c))(
        jnp.asarray(x2), jnp.asarray(p2), (latent_cache, rope_cache))
    want2, _ = reference(cfg, params, np.concatenate([x, x2], 1), np.concatenate([positions, p2], 1))
    np.testing.assert_allclose(np.asarray(out2)[:, 0], want2[:, -1], atol=2e-5, rtol=1e-5, err_msg=name)


def test_cache_keeps_latent_and_rope_key_bytes_per_token():
    """(kv_lora_rank + qk_rope_head_dim) * itemsize bytes per token and layer, not NH * (dn + dr + dv)."""
    cfg = V3
    model = MoETransformer(cfg, random_param_factory(0, jnp.bfloat16))
    kv = model.init_kv_cache(2, 32)
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    assert kv.nbytes == cfg.num_layers * 2 * 32 * per_token
    plain = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 2
    assert (per_token, plain) == (48, 320)


def test_softmax_scale_with_yarn_mscale_all_dim():
    """transformers' yarn_apply_mscale: (dn + dr)^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2; mscale (the
    cos/sin factor's numerator) does not enter; no YaRN or factor <= 1: the plain scale."""
    base = 24 ** -0.5
    assert mla_softmax_scale(V3) == pytest.approx(base)
    cfg = dataclasses.replace(V3, rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                                           mscale=1.0, mscale_all_dim=0.707))
    assert mla_softmax_scale(cfg) == pytest.approx(base * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    no_all_dim = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, mscale_all_dim=0.0))
    assert mla_softmax_scale(no_all_dim) == pytest.approx(base)
    shrink = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, factor=0.5))
    assert mla_softmax_scale(shrink) == pytest.approx(base)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_per_head_linear_both_backends_equal_float64(dtype):
    """The CPU form (one FFI GEMV per head) and the other backends' batched dot, both run here, against float64."""
    rng = np.random.default_rng(5)
    n, NH, N, O, K = 3, 4, 5, 6, 7
    w = jnp.asarray(rng.standard_normal((n * NH, O, K)), dtype)
    x = jnp.asarray(rng.standard_normal((N, NH, K)), dtype)
    layer = 2
    want = np.einsum("nhk,hok->nho", np.asarray(x, np.float64),
                     np.asarray(w, np.float64).reshape(n, NH, O, K)[layer])
    base = jnp.int32(layer * NH)
    for got in (jax.jit(per_head_linear, static_argnums=3)(x, w, layer, NH), jax.jit(_heads_ffi)(x, w, base),
                jax.jit(_heads_dot)(x, w, base)):
        assert got.dtype == jnp.float32 and got.shape == (N, NH, O)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_per_head_linear_on_fp8_heads_equals_float64():
    """An fp8 stack of heads (the form split_kv_b keeps, partial blocks) read as stored by both forms, against the
    float64 dot with its dequantized values."""
    rng = np.random.default_rng(6)
    n, NH, N, O, K, fmt = 2, 3, 4, 10, 7, fp8((4, 3))
    data = jnp.asarray(rng.standard_normal((n * NH, O, K)).astype(ml_dtypes.float8_e4m3fn))
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (n * NH, *fmt.scale_shape(O, K))).astype(np.float32))
    w = QuantizedTensor(data, scales, fmt)
    x = jnp.asarray(rng.standard_normal((N, NH, K)), jnp.float32)
    layer = 1
    values = dequantize(np.asarray(data), np.asarray(scales), fmt, dtype=np.float64).reshape(n, NH, O, K)
    want = np.einsum("nhk,hok->nho", np.asarray(x, np.float64), values[layer])
    base = jnp.int32(layer * NH)
    for got in (jax.jit(per_head_linear, static_argnums=3)(x, w, layer, NH), jax.jit(_heads_ffi)(x, w, base),
                jax.jit(_heads_dot)(x, w, base)):
        assert got.dtype == jnp.float32 and got.shape == (N, NH, O)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block,dn,dv,C", [((8, 8), 8, 8, 24), ((6, 5), 5, 7, 13), ((4, 16), 6, 2, 40)],
                         ids=["aligned", "partial", "narrow"])
def test_split_kv_b_keeps_fp8_as_stored(block, dn, dv, C):
    """split_kv_b of an fp8 kv_b_proj [NH (dn + dv), C]: every head's W_uk^T and W_uv dequantize (float64, the
    stored bytes times their scales) to exactly the rows of the dequantized matrix, transposed for W_uk; data stays
    float8_e4m3fn (no dequantized copy); aligned blocks (DeepSeek-V3's 128s scaled down) give W_uk^T block (bc, br)."""
    NH = 3
    rng = np.random.default_rng(7)
    rows = NH * (dn + dv)
    fmt = fp8(block)
    data = rng.standard_normal((rows, C)).astype(ml_dtypes.float8_e4m3fn)
    scales = rng.uniform(0.5, 2.0, fmt.scale_shape(rows, C)).astype(np.float32)
    full = dequantize(data, scales, fmt, dtype=np.float64)  # [NH (dn + dv), C]
    uk, uv = split_kv_b(QuantizedTensor(data, scales, fmt), NH, dn, dv)
    for h in range(NH):
        w = full[h * (dn + dv):(h + 1) * (dn + dv)]
        assert uk[h].shape == (C, dn) and uv[h].shape == (dv, C)
        assert uk[h].data.dtype == uv[h].data.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(dequantize(uk[h].data, uk[h].scales, uk[h].fmt, dtype=np.float64), w[:dn].T)
        np.testing.assert_array_equal(dequantize(uv[h].data, uv[h].scales, uv[h].fmt, dtype=np.float64), w[dn:])
    if block == (8, 8):
        assert uk[0].fmt == fp8((8, 8))
