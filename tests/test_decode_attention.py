"""The decode attention FFI call (ffi_ops.decode_attention, xla_ffi/decode_attention.cc) against a float64 numpy
reference of transformers' eager attention: causal and sliding-window masks, gpt-oss's sinks, grouped KV heads, a
subset of cache rows, padding rows, head dims that are not a multiple of the kernel's 16 lanes, and the threaded
split of a long context. float32 to ~1e-6; bfloat16 with the reference rounding where transformers rounds (scores,
their scaling, the weights, the output) to within a bf16 step of the weights or the output."""

import os

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from engine_helpers import lower_decode_step
from ft_jax.checkpoint import load_checkpoint
from ft_jax.engine.engine import Engine
from ft_jax.kernels import ffi_ops
from ft_jax.offload.policy import Policy

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


def _bf16(x):
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def reference(q, k, v, layer, rows, positions, window, scale, sinks, bf16):
    """float64 attention of one query per row: q [B, NH, D], caches [n, Bc, S, KVH, D] -> [B, NH, D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, NH, D = q.shape
    S, KVH = k.shape[2], k.shape[3]
    G = NH // KVH
    rnd = _bf16 if bf16 else (lambda x: x)
    out = np.zeros((B, NH, D))
    for b in range(B):
        p = positions[b]
        if p < 0:
            continue
        keys = np.arange(max(0, p - window + 1), min(p, S - 1) + 1)
        for h in range(NH):
            kh = k[layer, rows[b], keys, h // G]  # [n, D]
            s = rnd(rnd(kh @ q[b, h]) * scale)
            logits = s if sinks is None else np.append(s, sinks[h])
            e = np.exp(logits - logits.max())
            w = rnd((e / e.sum())[:len(keys)])
            out[b, h] = rnd(w @ v[layer, rows[b], keys, h // G])
    return out


def _case(rng, B, NH, KVH, D, S, layers=3, Bc=None, dtype=np.float32):
    Bc = B if Bc is None else Bc
    q = rng.standard_normal((B, NH, D)).astype(dtype)
    k = (rng.standard_normal((layers, Bc, S, KVH, D)) * 0.7).astype(dtype)
    v = rng.standard_normal((layers, Bc, S, KVH, D)).astype(dtype)
    return q, k, v


def _run(q, k, v, layer, rows, positions, window, scale, sinks=None):
    bits = (lambda a: jnp.asarray(a).view(jnp.uint16)) if q.dtype == ml_dtypes.bfloat16 else jnp.asarray
    out = jax.jit(lambda q, k, v, rows, pos: ffi_ops.decode_attention(
        q, k, v, layer, rows, pos, window, scale=scale, sinks=None if sinks is None else jnp.asarray(sinks)))(
        jnp.asarray(q), bits(k), bits(v), jnp.asarray(rows, jnp.int32), jnp.asarray(positions, jnp.int32))
    return np.asarray(out).astype(np.float64)


CASES = [  # B, NH, KVH, D, S, Bc, rows, positions, window, sinks
    pytest.param(1, 4, 4, 16, 8, None, [0], [5], 8, False, id="mha-one-row"),
    pytest.param(2, 8, 2, 24, 20, None, [0, 1], [19, 3], 20, False, id="gqa-D24-last-index"),
    pytest.param(3, 8, 2, 64, 40, 5, [4, 0, 2], [30, -1, 0], 40, True, id="subset-rows-padding-sinks"),
    pytest.param(2, 6, 3, 40, 33, None, [1, 0], [32, 17], 8, True, id="window-8-sinks-swapped-rows"),
]


@pytest.mark.parametrize("B, NH, KVH, D, S, Bc, rows, positions, window, sinks", CASES)
def test_float32_matches_the_float64_reference(B, NH, KVH, D, S, Bc, rows, positions, window, sinks):
    rng = np.random.default_rng(B * 100 + D)
    q, k, v = _case(rng, B, NH, KVH, D, S, Bc=Bc)
    sink = (rng.standard_normal(NH) * 2).astype(np.float32) if sinks else None
    got = _run(q, k, v, 1, rows, positions, window, D ** -0.5, sink)
    want = reference(q, k, v, 1, rows, positions, window, D ** -0.5, sink, bf16=False)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    for b, p in enumerate(positions):
        if p < 0:
            assert not got[b].any(), "a padding row's output is zeros"


@pytest.mark.parametrize("B, NH, KVH, D, S, Bc, rows, positions, window, sinks", CASES)
def test_bfloat16_rounds_where_transformers_does(B, NH, KVH, D, S, Bc, rows, positions, window, sinks):
    rng = np.random.default_rng(B * 100 + D + 1)
    q, k, v = _case(rng, B, NH, KVH, D, S, Bc=Bc, dtype=ml_dtypes.bfloat16)
    sink = (rng.standard_normal(NH) * 2).astype(np.float32) if sinks else None
    got = _run(q, k, v, 2, rows, positions, window, D ** -0.5, sink)
    want = reference(q, k, v, 2, rows, positions, window, D ** -0.5, sink, bf16=True)
    # A float32 dot and a float64 one can round a score to neighbouring bf16 values (then its weight moves by
    # about 1 %); most outputs are the reference's bits.
    np.testing.assert_allclose(got, want, rtol=2 ** -6, atol=2 ** -6 * np.abs(np.asarray(v, np.float64)).max())
    assert np.mean(got == want) > 0.9


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_a_row_does_not_depend_on_the_other_rows_or_the_thread_split(dtype):
    """4096 keys of 8 KV heads (8-16 MiB of keys and values: the threaded path; bf16 with D = 64 takes the AVX-512
    BF16 score dots where the CPU has them) for one row alone and beside two others: the same bits, and the
    reference's values."""
    rng = np.random.default_rng(7)
    NH, KVH, D, S = 16, 8, 64, 4096
    q, k, v = _case(rng, 3, NH, KVH, D, S, layers=1, dtype=dtype)
    positions = [4000, 17, 2500]
    together = _run(q, k, v, 0, [0, 1, 2], positions, S, D ** -0.5)
    for b in range(3):
        alone = _run(q[b:b + 1], k, v, 0, [b], positions[b:b + 1], S, D ** -0.5)
        np.testing.assert_array_equal(alone[0], together[b])
    bf16 = dtype == ml_dtypes.bfloat16
    want = reference(q, k, v, 0, [0, 1, 2], positions, S, D ** -0.5, None, bf16=bf16)
    if bf16:
        np.testing.assert_allclose(together, want, rtol=2 ** -6, atol=2 ** -6 * np.abs(want).max())
    else:
        np.testing.assert_allclose(together, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [0.0, -0.25], ids=["zero", "negative"])
def test_any_finite_scale_gives_the_softmax_of_the_scaled_scores(scale):
    """3 visible keys (the kernel's score rows padded to 16 lanes): a scale of 0 gives uniform weights, a negative one
    the reversed softmax; the padding never turns into a weight (it is set after the scaling)."""
    rng = np.random.default_rng(11)
    q, k, v = _case(rng, 1, 4, 2, 32, 8, layers=1)
    got = _run(q, k, v, 0, [0], [2], 8, scale)
    want = reference(q, k, v, 0, [0], [2], 8, scale, None, bf16=False)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    if scale == 0.0:
        np.testing.assert_allclose(got[0, 0], np.asarray(v, np.float64)[0, 0, :3, 0].mean(axis=0), rtol=1e-5)


def test_bad_operands_are_named():
    q = jnp.zeros((1, 4, 16), jnp.bfloat16)
    cache = jnp.zeros((2, 1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="k_cache"):
        ffi_ops.decode_attention(q, cache, cache, 0, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), 8, scale=0.25)
    with pytest.raises(ValueError, match="multiple of KVH"):
        ffi_ops.decode_attention(q.astype(jnp.float32), jnp.zeros((2, 1, 8, 3, 16)), jnp.zeros((2, 1, 8, 3, 16)), 0,
                                 jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), 8, scale=0.25)
    with pytest.raises(ValueError, match="multiple of KVH"):  # no KV head at all
        ffi_ops.decode_attention(q.astype(jnp.float32), jnp.zeros((2, 1, 8, 0, 16)), jnp.zeros((2, 1, 8, 0, 16)), 0,
                                 jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), 8, scale=0.25)
    with pytest.raises(Exception, match="cache row 3 of 1"):
        jax.block_until_ready(ffi_ops.decode_attention(q.astype(jnp.float32), cache, cache, 0,
                                                       jnp.array([3], jnp.int32), jnp.zeros(1, jnp.int32), 8,
                                                       scale=0.25))
    with pytest.raises(Exception, match="row 0 is at position 8, past the KV cache of 8 entries"):
        jax.block_until_ready(ffi_ops.decode_attention(q.astype(jnp.float32), cache, cache, 0,
                                                       jnp.zeros(1, jnp.int32), jnp.array([8], jnp.int32), 8,
                                                       scale=0.25))


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_the_cpu_decode_step_attends_in_one_call_per_layer(family):
    """The decode step's attention is one FFI call in the scanned layer body, with no score dot of XLA left (prefill
    keeps XLA's ops: several queries per row)."""
    engine = Engine(load_checkpoint(os.path.join(FIXTURES, family)), policy=Policy("host-all"), num_slots=4)
    hlo = lower_decode_step(engine, batch_size=2, kv_len=64).compile().as_text()
    assert hlo.count('custom_call_target="ft_jax_decode_attention"') == 1
    assert "__ynn_fusion" not in hlo
