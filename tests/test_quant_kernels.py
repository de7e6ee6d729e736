"""The CPU kernels on stored quantized weights (q8_0, q4_0, mxfp4, block-scaled fp8): host_experts, slot_experts and
linear against float64 numpy references (weight_formats.dequantize(..., dtype=np.float64), then the expert math), on
every ISA path, with the error bound of float32 arithmetic derived per case; and the errors of bad inputs."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ft_jax import _ffi
from ft_jax import weight_formats as wf
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank

RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
U = 2.0**-24  # unit roundoff of float32
ALPHA, LIMIT = 1.702, 7.0

# (format, H, I): q formats with rows of 32 and 96 elements; fp8 with partial edge blocks (H, I not multiples of the
# block: 80 = 2.5 x 32 columns, 48 = 1.5 x 32; 200 and 72 against 128 x 128).
CASES = [
    (wf.Q8_0, 96, 32), (wf.Q4_0, 32, 96), (wf.Q4_0, 96, 32), (wf.Q4_0_X16, 32, 96), (wf.Q4_0_X16, 96, 32),
    (wf.Q4_0_X16, 1024, 512),  # q4_0x16: > 1 MiB of weights, so the row tasks (whole groups of 16) run on threads
    (wf.MXFP4, 96, 32), (wf.MXFP4, 32, 96), (wf.fp8((16, 32)), 80, 48), (wf.fp8((128, 128)), 200, 72),
]
CASE_IDS = [f"{f.kernel_name}{'x'.join(map(str, f.block)) if f.name == 'fp8' else ''}-H{h}-I{i}" for f, h, i in CASES]


def stored_matrix(rng, fmt, rows, cols, parts=1):
    """Random stored (data, scales) of a [rows, cols] matrix in fmt; parts=2: a gate_up pair of two [rows / 2, cols]
    matrices with their scale grids stacked (weight_formats module docstring). Values of magnitude ~1 / sqrt(cols)."""
    if parts == 2:
        a, b = (stored_matrix(rng, fmt, rows // 2, cols) for _ in range(2))
        return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])
    if fmt in (wf.Q8_0, wf.Q4_0):
        return wf.quantize(rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols), fmt)
    if fmt is wf.Q4_0_X16:  # q4_0's bytes, its groups of 16 rows interleaved (a pair: each matrix's own groups)
        data, scales = stored_matrix(rng, wf.Q4_0, rows, cols)
        wf.interleave_rows(data, scales)
        return data, scales
    if fmt is wf.MXFP4:  # every FP4 code; scales 2^-5 .. 2^-3 (E8M0 122 .. 124)
        return (rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8),
                rng.integers(122, 125, (rows, cols // 32)).astype(np.uint8))
    # fp8: every finite e4m3 code (subnormals included; 0x7f / 0xff are NaN), scales of ~1 / (64 sqrt(cols))
    codes = rng.integers(0, 256, (rows, cols)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x30
    scales = (rng.uniform(0.5, 2.0, fmt.scale_shape(rows, cols)) / (64 * np.sqrt(cols))).astype(np.float32)
    return codes.view(ml_dtypes.float8_e4m3fn), scales


def dequant64(data, scales, fmt, rows=None):
    """float64 values of stored matrices (any leading axes)."""
    return wf.dequantize(data, scales, fmt, rows=rows, dtype=np.float64)


def glu64(g, u, activation):
    if activation == "silu":
        return g / (1.0 + np.exp(-g)) * u
    g, u = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)  # transformers' GptOssExperts._apply_gate
    return (u + 1.0) * g / (1.0 + np.exp(-ALPHA * g))


def gamma(n):
    """gamma_n = n u / (1 - n u): the relative error bound of n float32 roundings in sequence (Higham, Accuracy and
    Stability of Numerical Algorithms, 3.1)."""
    return n * U / (1 - n * U)


def _cpu_has_vnni() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " avx512_vnni" in line for line in f)


ISA = _ffi.kernel_isa()  # this process's kernel path: "avx512bf16", "avx2" or "generic"


def quantized_acts(fmt, isa=ISA, bf16_x=False):
    """The integer type, "int8" or "int16", that kernels on ISA path isa quantize fmt's activations to in their dots,
    or None (float32 activations): q8_0 / q4_0 to int8 blocks on the AVX2 and AVX-512 VNNI paths (as llama.cpp
    does); mxfp4 to int16 blocks on the AVX2 path when the activations are a bf16 model's (bf16_x); the portable path
    and the rest keep float32."""
    if fmt.name in ("q8_0", "q4_0") and (isa == "avx2" or (isa == "avx512bf16" and _cpu_has_vnni())):
        return "int8"
    if fmt is wf.MXFP4 and isa == "avx2" and bf16_x:
        return "int16"
    return None


def int16_step(xmag):
    """Per element [K]: the int16 path's dx = 2^(E - 15) of its block of 32, E the least with max_b |x| < 2^E
    (2^-126 for blocks below 2^-112; 0 for all-zero blocks); |x - dx q| <= dx, saturation included."""
    m = np.asarray(xmag, np.float64).reshape(-1, 32).max(axis=1)
    e = np.maximum(np.frexp(m)[1], -111)  # m = f 2^e with 0.5 <= f < 1
    return np.repeat(np.where(m == 0, 0.0, np.ldexp(1.0, e - 15)), 32)


def dot_bound(w, xmag, fmt, isa=ISA, bf16_x=False):
    """Per-row bound [R] of |kernel dot - exact dot| for exact weights w [R, K] (float64; fp8's once-rounded weight
    adds a u per weight) and activations of magnitude at most xmag [K].

    Float32 activations: gamma_{K+2} |w| @ xmag. Int8 activations (quantized_acts): each block of 32 is quantized
    with dx = max_b |x| / 127 and round to nearest, |x - dx q| <= dx / 2 (times 1 + 2^-10 for the float32 rounding
    of x / dx), which adds |w| @ ex; the integer block dots are exact and their float32 scaling and sum add
    gamma_{K+4} of the magnitudes summed: |w| @ (xmag + ex) for q8_0, and for q4_0, whose kernel sums the unsigned
    codes q (0..15) and subtracts 8 sum(q_x) apart, 3 max_b |w| (= 24 |d|) per weight instead of |w|. Int16
    activations (mxfp4 with bf16_x on AVX2): ex = int16_step (a power of two per block, so x / dx is exact), the
    same sums."""
    K = w.shape[-1]
    kind = quantized_acts(fmt, isa, bf16_x)
    if kind is None:
        return gamma(K + 2) * (np.abs(w) @ xmag)
    if kind == "int16":
        ex = int16_step(xmag)
        return np.abs(w) @ ex + gamma(K + 4) * (np.abs(w) @ (xmag + ex))
    ex = np.repeat(xmag.reshape(-1, 32).max(axis=1) / 254 * (1 + 2.0**-10), 32)  # [K]
    mag = np.abs(w) if fmt is wf.Q8_0 else np.repeat(3 * np.abs(w).reshape(len(w), -1, 32).max(axis=2), 32, axis=1)
    return np.abs(w) @ ex + gamma(K + 4) * (mag @ (xmag + ex))


def experts_reference(x, ids, weights, gu, dn, activation, fmt, gb=None, db=None, isa=ISA,
                      bf16_acts=False):
    """(y, bound): float64 expert outputs [T, H] and a per-element bound of what the kernels' arithmetic may add.

    The gate / up projections and biases err by eg, eu <= dot_bound (+ gamma |b|); the gated activation propagates
    them with its partial derivatives (silu: |d silu / dg| <= 1.1; swiglu_oai: |d (g sigma(alpha g)) / dg| <=
    1 + alpha |g| / 4, |d a / du| <= |g|, clamps only shrink them; taken at |g| + eg) plus 8 u |a| for its own float32
    evaluation, ea; the down projection errs by |Wd| @ ea plus dot_bound of activations up to |a| + ea
    (+ gamma |bd|); the weighted sum over k routes adds gamma_{k+1} sum |w_j d_j|. bf16_acts (a bf16 model): the
    kernel rounds a to bf16 before the down projection, + 2^-8 (|a| + ea) (half a bf16 ulp, relative)."""
    x = np.asarray(x, np.float64)
    T, H = x.shape
    inter = gu.shape[1] // 2
    y = np.zeros((T, H))
    bound = np.zeros((T, H))
    for t in range(T):
        terms, mags = [], []
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0:
                continue
            bg = np.zeros(2 * inter) if gb is None else gb[e].astype(np.float64)
            bd = np.zeros(H) if db is None else db[e].astype(np.float64)
            h = gu[e] @ x[t] + bg  # [2I]
            eh = dot_bound(gu[e], np.abs(x[t]), fmt, isa, bf16_acts) + gamma(2) * np.abs(h)
            g, u, eg, eu = h[:inter], h[inter:], eh[:inter], eh[inter:]
            a = glu64(g, u, activation)
            if activation == "silu":
                lg, lu = 1.1 * (np.abs(u) + eu), np.abs(g) + eg
            else:
                lg, lu = (np.abs(u) + eu + 1) * (1 + ALPHA * (np.abs(g) + eg) / 4), np.abs(g) + eg
            ea = lg * eg + lu * eu + 8 * U * np.abs(a)
            if bf16_acts:
                ea = ea + 2.0**-8 * (np.abs(a) + ea)
            d = dn[e] @ a + bd
            ed = (np.abs(dn[e]) @ ea + dot_bound(dn[e], np.abs(a) + ea, fmt, isa, bf16_acts)
                  + gamma(2) * (np.abs(d) + np.abs(bd)))
            y[t] += weights[t, j] * d
            terms.append(abs(weights[t, j]) * ed)
            mags.append(abs(weights[t, j]) * (np.abs(d) + ed))
        if terms:
            bound[t] = np.sum(terms, axis=0) + gamma(len(terms) + 1) * np.sum(mags, axis=0)
    return y, bound


def expert_case(rng, fmt, H, inter, T, k, activation, biases, num_experts=5):
    """Random stored experts, biases, x [T, H], ids [T, k] (some -1) and weights; x larger for swiglu_oai so that
    its clamps engage."""
    gu = [stored_matrix(rng, fmt, 2 * inter, H, parts=2) for _ in range(num_experts)]
    dn = [stored_matrix(rng, fmt, H, inter) for _ in range(num_experts)]
    gu_data, gu_scales = (np.stack(a) for a in zip(*gu))
    dn_data, dn_scales = (np.stack(a) for a in zip(*dn))
    x = (rng.standard_normal((T, H)) * (6.0 if activation == "swiglu_oai" else 2.0)).astype(np.float32)
    ids = np.stack([rng.permutation(num_experts)[:k] for _ in range(T)]).astype(np.int32)
    if T * k > 2:
        ids[0, -1] = -1
    weights = rng.random((T, k)).astype(np.float32)
    bias = ((rng.standard_normal((num_experts, 2 * inter)).astype(np.float32),
             rng.standard_normal((num_experts, H)).astype(np.float32)) if biases else (None, None))
    return x, ids, weights, (gu_data, gu_scales, dn_data, dn_scales), bias


def check_within(y, expected, bound, what):
    y = np.asarray(y, np.float64)
    excess = np.abs(y - expected) - bound
    assert np.all(np.isfinite(y)) and excess.max() <= 0, (
        f"{what}: error {np.abs(y - expected).max():.3g} exceeds the bound {bound[np.argmax(excess.ravel()) // bound.shape[1]].max():.3g}")


@pytest.mark.parametrize("activation,biases", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("fmt,H,inter", CASES, ids=CASE_IDS)
def test_host_and_slot_experts_match_float64_reference(fmt, H, inter, activation, biases):
    rng = np.random.default_rng(hash((fmt.name, fmt.block, H, activation)) % 2**32)
    for T, k in ((1, 1), (2, 2), (3, 3), (4, 2)):
        x, ids, weights, stored, (gb, db) = expert_case(rng, fmt, H, inter, T, k, activation, biases)
        gu_data, gu_scales, dn_data, dn_scales = stored
        expected, bound = experts_reference(x, ids, weights, dequant64(gu_data, gu_scales, fmt, rows=inter),
                                            dequant64(dn_data, dn_scales, fmt), activation, fmt, gb, db)
        banks = [HostBank.from_numpy(a) for a in stored]
        bias_banks = dict(gate_up_bias=HostBank.from_numpy(gb), down_bias=HostBank.from_numpy(db)) if biases else {}
        y = ffi_ops.host_experts(x, ids, weights, banks[0], banks[2], activation, gate_up_scale=banks[1],
                                 down_scale=banks[3], weight_format=fmt, **bias_banks)
        check_within(y, expected, bound, f"host_experts {fmt.name} T={T} k={k}")
        # slot_experts over slot pools holding the experts in reverse order
        perm = np.arange(len(gu_data))[::-1]
        slot_ids = np.where(ids >= 0, perm[np.maximum(ids, 0)], -1).astype(np.int32)
        bias_pools = dict(gate_up_bias_slots=jnp.asarray(gb[perm]), down_bias_slots=jnp.asarray(db[perm])) \
            if biases else {}
        y_slots = jax.jit(lambda x, i, w, *pools: ffi_ops.slot_experts(
            x, i, w, pools[0], pools[2], activation, gate_up_scale_slots=pools[1], down_scale_slots=pools[3],
            weight_format=fmt, **bias_pools))(x, slot_ids, weights, *(jnp.asarray(a[perm]) for a in stored))
        check_within(y_slots, expected, bound, f"slot_experts {fmt.name} T={T} k={k}")
        # a token's result does not depend on the other tokens of the call
        np.testing.assert_array_equal(
            np.asarray(ffi_ops.host_experts(x[-1:], ids[-1:], weights[-1:], banks[0], banks[2], activation,
                                            gate_up_scale=banks[1], down_scale=banks[3], weight_format=fmt,
                                            **bias_banks))[0], np.asarray(y)[-1])
        for bank in (*banks, *bias_banks.values()):
            bank.release()


BF16_CASES = [c for c in CASES if c[0].name in ("mxfp4", "fp8")] + [(wf.fp8((1, 64)), 200, 72)]


@pytest.mark.parametrize("fmt,H,inter", BF16_CASES,
                         ids=[f"{f.name}{'x'.join(map(str, f.block)) if f.name == 'fp8' else ''}-H{h}-I{i}"
                              for f, h, i in BF16_CASES])
def test_bf16_model_experts_match_float64_reference(fmt, H, inter):
    """x in bf16 (a bf16 model; fp8 / mxfp4 then take the bf16 x bf16 dots on AVX-512 BF16, the activations a
    rounded to bf16 as transformers' bf16 expert rounds them): within the bound of the float64 reference fed the
    bf16 x (bf16_acts adds the rounding of a); slot_experts equal to host_experts and a token's result independent
    of the other tokens, bit for bit."""
    rng = np.random.default_rng(H * 7 + inter)
    for T, k in ((1, 2), (4, 2), (6, 3)):
        x, ids, weights, stored, (gb, db) = expert_case(rng, fmt, H, inter, T, k, "swiglu_oai", True)
        xb = x.astype(ml_dtypes.bfloat16)
        gu_data, gu_scales, dn_data, dn_scales = stored
        expected, bound = experts_reference(xb, ids, weights, dequant64(gu_data, gu_scales, fmt, rows=inter),
                                            dequant64(dn_data, dn_scales, fmt), "swiglu_oai", fmt, gb, db,
                                            bf16_acts=True)
        banks = [HostBank.from_numpy(a) for a in (*stored, gb, db)]
        kw = dict(gate_up_scale=banks[1], down_scale=banks[3], gate_up_bias=banks[4], down_bias=banks[5],
                  weight_format=fmt)
        y = np.asarray(ffi_ops.host_experts(jnp.asarray(xb), ids, weights, banks[0], banks[2], "swiglu_oai", **kw))
        check_within(y, expected, bound, f"host_experts {fmt.name} bf16 x T={T} k={k}")
        y_slots = ffi_ops.slot_experts(jnp.asarray(xb), ids, weights, *(jnp.asarray(a) for a in stored[::2]),
                                       "swiglu_oai", gate_up_scale_slots=jnp.asarray(gu_scales),
                                       down_scale_slots=jnp.asarray(dn_scales), gate_up_bias_slots=jnp.asarray(gb),
                                       down_bias_slots=jnp.asarray(db), weight_format=fmt)
        np.testing.assert_array_equal(np.asarray(y_slots), y)
        for t in range(T):
            y_t = ffi_ops.host_experts(jnp.asarray(xb[t:t + 1]), ids[t:t + 1], weights[t:t + 1], banks[0], banks[2],
                                       "swiglu_oai", **kw)
            np.testing.assert_array_equal(np.asarray(y_t)[0], y[t])
        for bank in banks:
            bank.release()


def linear_reference(x, w64, fmt, isa=ISA):
    """(y, bound) of x @ w64.T [N, O] (dot_bound per token; x of dtype bfloat16: a bf16 model's activations)."""
    bf16_x = np.asarray(x).dtype == ml_dtypes.bfloat16
    x = np.asarray(x, np.float64)
    return x @ w64.T, np.stack([dot_bound(w64, np.abs(xt), fmt, isa, bf16_x) for xt in x])


def int8_activations(x):
    """float64 values of float32 activations [K] as the int8 path quantizes them, computed with the same float32
    operations: per block of 32, d = max |x| / 127, q = round-half-even(x * (1 / d)), value d * q."""
    b = np.asarray(x, np.float32).reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / np.float32(127)).astype(np.float32)  # [K / 32]
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.rint((b * inv[:, None]).astype(np.float32))
    return (q.astype(np.float64) * d[:, None].astype(np.float64)).ravel()


@pytest.mark.skipif(quantized_acts(wf.Q8_0) is None, reason="this CPU's kernels keep float32 activations for q8_0 / q4_0")
@pytest.mark.parametrize("fmt,K,O", [(wf.Q8_0, 96, 67), (wf.Q4_0, 32, 67), (wf.Q4_0, 160, 67), (wf.Q4_0, 224, 67),
                                     (wf.Q8_0, 4096, 67),
                                     (wf.Q4_0, 800, 67), (wf.Q4_0, 896, 67),  # 16 blocks + 2 or 3 groups of 4 (+ 1)
                                     (wf.Q8_0, 2048, 600), (wf.Q4_0, 2048, 1100)])  # > 1 MiB: row tasks on threads
def test_int8_activation_dots_match_their_quantized_activations(fmt, K, O):
    """The int8 path against a float64 reference fed with the activations quantized as the kernel quantizes them
    (int8_activations): then only the float32 scaling and summation of exact integer block dots differ,
    |err| <= gamma_{K+4} (mag @ |x_q|) (mag as dot_bound: |w| for q8_0, 3 max_b |w| for q4_0), about 1e-6 of the
    result where the bound against unquantized activations is ~1e-2: a wrong scale, block order or nibble shows.
    Matrices above 1 MiB are split into row tasks on the thread pool, which all read the activations quantized
    once per call (quant_dot.h Int8Acts), each task from its token's part."""
    rng = np.random.default_rng(K)
    data, scales = stored_matrix(rng, fmt, O, K)
    w = dequant64(data, scales, fmt)
    mag = np.abs(w) if fmt is wf.Q8_0 else np.repeat(3 * np.abs(w).reshape(len(w), -1, 32).max(axis=2), 32, axis=1)
    x = rng.standard_normal((3, K)).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero block (d = 0)
    y = np.asarray(ffi_ops.linear(x, data, scales=scales, weight_format=fmt))
    for t in range(3):
        xq = int8_activations(x[t])
        check_within(y[t:t + 1], (w @ xq)[None], (gamma(K + 4) * (mag @ np.abs(xq)))[None],
                     f"{fmt.name} int8 dot, token {t}")
        # tokens 0 and 1 share the row loads (the two-token form), token 2 runs alone: each equals its solo call
        solo = np.asarray(ffi_ops.linear(x[t:t + 1], data, scales=scales, weight_format=fmt))
        np.testing.assert_array_equal(y[t:t + 1], solo, err_msg=f"{fmt.name} token {t} of 3 vs alone")


def int16_activations(x):
    """float64 values of activations [K] as the int16 path (mxfp4 with bf16 x on AVX2) quantizes them: per block of
    32, q = round-half-even(x / dx) saturated to int16, dx = int16_step (a power of two, so x / dx is exact)."""
    x = np.asarray(x, np.float64)
    dx = int16_step(np.abs(x))
    q = np.clip(np.rint(x / np.where(dx == 0, 1.0, dx)), -32768, 32767)
    return q * dx


_INT16_SCRIPT = """
import sys, numpy as np, ml_dtypes
from ft_jax import _ffi, weight_formats as wf
from ft_jax.kernels import ffi_ops
d = np.load(sys.argv[1])
x = d["x"].view(ml_dtypes.bfloat16)
out = {"isa": np.array(_ffi.kernel_isa()),
       "y": np.asarray(ffi_ops.linear(x, d["data"], scales=d["scales"], weight_format=wf.MXFP4))}
for t in range(len(x)):
    out[f"solo{t}"] = np.asarray(ffi_ops.linear(x[t:t + 1], d["data"], scales=d["scales"], weight_format=wf.MXFP4))
np.savez(sys.argv[2], **out)
"""


@pytest.mark.skipif(ISA == "generic", reason="this CPU has no AVX2 path")
@pytest.mark.parametrize("K,O", [(32, 67), (96, 67), (2880, 67), (2048, 600)])  # 2048 x 600: row tasks on threads
def test_int16_activation_dots_match_their_quantized_activations(K, O, tmp_path):
    """mxfp4 at the AVX2 level (FT_JAX_KERNEL=avx2 in a subprocess, so also on AVX-512 CPUs) with a bf16 model's
    activations against a float64 reference fed them quantized as the kernel quantizes them (int16_activations):
    the block dots are exact integers and the scales powers of two, so only the float32 sum of the scaled blocks
    differs, |err| <= gamma_{K+4} (|w| @ |x_q|), ~1e-7 of the result where the bound against x is ~1e-4: a wrong
    exponent, element order or rounding shows. Activations spread over 2^-30 .. 2^4 (a block below 2^-112 and an
    all-zero block among them); bf16 values within 2^7 of their block's largest are quantized exactly; each token
    equals its solo call."""
    rng = np.random.default_rng(K + O)
    data, scales = stored_matrix(rng, wf.MXFP4, O, K)
    w = dequant64(data, scales, wf.MXFP4)
    x = rng.standard_normal((3, K)) * np.exp2(rng.integers(-30, 4, (3, K)))
    x[1, :32] = 0.0  # an all-zero block (dx = 0)
    x[2, -32:] *= 2.0**-100  # a block below 2^-112 (dx = 2^-126)
    x = x.astype(ml_dtypes.bfloat16)
    np.savez(tmp_path / "in.npz", x=x.view(np.uint16), data=data, scales=scales)
    subprocess.run([sys.executable, "-c", _INT16_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   check=True, env=dict(os.environ, FT_JAX_KERNEL="avx2"))
    got = np.load(tmp_path / "out.npz")
    assert str(got["isa"]) == "avx2"
    for t in range(3):
        xq = int16_activations(x[t])
        check_within(got["y"][t:t + 1], (w @ xq)[None], (gamma(K + 4) * (np.abs(w) @ np.abs(xq)))[None],
                     f"mxfp4 int16 dot, token {t}")
        np.testing.assert_array_equal(got["y"][t:t + 1], got[f"solo{t}"], err_msg=f"mxfp4 token {t} of 3 vs alone")
        b = np.asarray(x[t], np.float64).reshape(-1, 32)
        exact = np.abs(b) >= np.abs(b).max(axis=1, keepdims=True) / 2**7
        np.testing.assert_array_equal(int16_activations(x[t]).reshape(-1, 32)[exact], b[exact])


@pytest.mark.parametrize("fmt,K,O", [(f, h, 3 * i + 5 if f.name == "fp8" else 2 * i + 16 if f.interleave > 1
                                      else 3 * i + 1) for f, h, i in CASES],
                         ids=CASE_IDS)  # q4_0x16: whole groups of 16 rows
def test_linear_matches_float64_reference(fmt, K, O):
    """A stack of 3 layers (the layer an operand) and a single 2-D matrix; N = 1..3 tokens, f32 and bf16 x."""
    rng = np.random.default_rng(K * 1000 + O)
    layers = [stored_matrix(rng, fmt, O, K) for _ in range(3)]
    data, scales = (np.stack(a) for a in zip(*layers))
    for N in (1, 3):
        x = rng.standard_normal((N, K)).astype(np.float32)
        for layer in range(3):
            expected, bound = linear_reference(x, dequant64(data[layer], scales[layer], fmt), fmt)
            y = jax.jit(lambda x, w, s, l: ffi_ops.linear(x, w, l, scales=s, weight_format=fmt))(
                x, data, scales, layer)
            check_within(y, expected, bound, f"linear {fmt.name} N={N} layer={layer}")
        y2 = ffi_ops.linear(jnp.asarray(x.astype(ml_dtypes.bfloat16)), data[1], 0, scales=scales[1],
                            weight_format=fmt)
        expected, bound = linear_reference(x.astype(ml_dtypes.bfloat16), dequant64(data[1], scales[1], fmt), fmt)
        check_within(y2, expected, bound, f"linear {fmt.name} bf16 x, 2-D w")


_ISA_SCRIPT = """
import sys, numpy as np, ml_dtypes, jax.numpy as jnp
from ft_jax import _ffi, weight_formats as wf
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
d = np.load(sys.argv[1], allow_pickle=True)
out = {"isa": np.array(_ffi.kernel_isa())}
for n, fmt in enumerate(d["formats"]):
    fmt = wf.fp8(tuple(fmt[1])) if fmt[0] == "fp8" else wf.Q4_0_X16 if fmt[0] == "q4_0x16" else wf.by_name(fmt[0])
    a = [d[f"{n}_{name}"] for name in ("x", "ids", "w", "gud", "gus", "dnd", "dns", "gb", "db", "lind", "lins")]
    banks = [HostBank.from_numpy(b) for b in a[3:9]]
    out[f"{n}_y"] = np.asarray(ffi_ops.host_experts(a[0], a[1], a[2], banks[0], banks[2], "swiglu_oai",
                                                    gate_up_scale=banks[1], down_scale=banks[3],
                                                    gate_up_bias=banks[4], down_bias=banks[5], weight_format=fmt))
    out[f"{n}_lin"] = np.asarray(ffi_ops.linear(a[0], a[9], scales=a[10], weight_format=fmt))
    xb = jnp.asarray(a[0].astype(ml_dtypes.bfloat16))  # a bf16 model's activations
    out[f"{n}_yb"] = np.asarray(ffi_ops.host_experts(xb, a[1], a[2], banks[0], banks[2], "swiglu_oai",
                                                     gate_up_scale=banks[1], down_scale=banks[3],
                                                     gate_up_bias=banks[4], down_bias=banks[5], weight_format=fmt))
    out[f"{n}_linb"] = np.asarray(ffi_ops.linear(xb, a[9], scales=a[10], weight_format=fmt))
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("kernel", ["avx2", "generic"])
def test_every_isa_path_within_the_bound(kernel, tmp_path):
    """FT_JAX_KERNEL caps the ISA path (read once per process, so in a subprocess): the AVX2 + F16C decoders (int8
    activations for q8_0 / q4_0, int16 for mxfp4 with a bf16 model's activations, float32 otherwise) and the
    portable ones (float32 activations for every format) give results within their bound, for every format
    (host_experts with biases and swiglu_oai, and linear over the gate matrix of expert 0), with float32 and bf16 x."""
    isa = kernel if ISA != "generic" else "generic"  # a CPU without AVX2 runs the portable path
    rng = np.random.default_rng(77)
    arrays, refs = {"formats": np.array([(f.kernel_name if f.quantized else f.name, f.block) for f, _, _ in CASES],
                                        dtype=object)}, []
    for n, (fmt, H, inter) in enumerate(CASES):
        x, ids, weights, stored, (gb, db) = expert_case(rng, fmt, H, inter, 3, 2, "swiglu_oai", True)
        gate = stored[0][0, :inter], stored[1][0, :fmt.scale_rows(inter)]  # expert 0's gate matrix [I, H]
        for name, a in zip(("x", "ids", "w", "gud", "gus", "dnd", "dns", "gb", "db", "lind", "lins"),
                           (x, ids, weights, *stored, gb, db, *gate)):
            arrays[f"{n}_{name}"] = a.view(np.uint8) if a.dtype == ml_dtypes.float8_e4m3fn else a
        xb = x.astype(ml_dtypes.bfloat16)
        w64 = dequant64(stored[0], stored[1], fmt, rows=inter), dequant64(stored[2], stored[3], fmt)
        refs.append((experts_reference(x, ids, weights, *w64, "swiglu_oai", fmt, gb, db, isa),
                     linear_reference(x, dequant64(*gate, fmt), fmt, isa),
                     experts_reference(xb, ids, weights, *w64, "swiglu_oai", fmt, gb, db, isa, bf16_acts=True),
                     linear_reference(xb, dequant64(*gate, fmt), fmt, isa)))
    np.savez(tmp_path / "in.npz", **arrays)
    script = _ISA_SCRIPT.replace('d = np.load(sys.argv[1], allow_pickle=True)', '''d = dict(np.load(sys.argv[1], allow_pickle=True))
import ml_dtypes
for key in [k for k in d if k.endswith(("_gud", "_dnd", "_lind")) and d["formats"][int(k.split("_")[0])][0] == "fp8"]:
    d[key] = d[key].view(ml_dtypes.float8_e4m3fn)''')
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], check=True,
                   env=dict(os.environ, FT_JAX_KERNEL=kernel))
    got = np.load(tmp_path / "out.npz")
    assert str(got["isa"]) == (kernel if _ffi.kernel_isa() != "generic" else "generic")
    for n, ref in enumerate(refs):
        for (want, bound), key in zip(ref, ("y", "lin", "yb", "linb")):
            check_within(got[f"{n}_{key}"], want, bound, f"{kernel} {key} {CASE_IDS[n]}")



@pytest.mark.parametrize("fmt", [wf.Q8_0, wf.Q4_0, wf.MXFP4, wf.fp8((128, 128))], ids=lambda f: f.name)
def test_non_finite_activations_give_non_finite_outputs(fmt):
    """A NaN or inf activation is never quantized away (the int8 paths: a NaN block's scale is NaN, an inf makes it
    inf): its token's outputs are all non-finite (NaN for NaN), the other tokens' are unchanged and finite."""
    rng = np.random.default_rng(5)
    data, scales = stored_matrix(rng, fmt, 7, 96)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    clean = np.asarray(ffi_ops.linear(x[:1], data, scales=scales, weight_format=fmt))
    x[1, 40], x[2, 70] = np.nan, np.inf  # block 1 of token 1, block 2 of token 2
    y = np.asarray(ffi_ops.linear(x, data, scales=scales, weight_format=fmt))
    np.testing.assert_array_equal(y[0], clean[0])
    assert np.isfinite(y[0]).all()
    assert np.isnan(y[1]).all(), y[1]
    assert not np.isfinite(y[2]).any(), y[2]
    # a bf16 model's activations (mxfp4 on AVX2: the int16 blocks, whose dx is NaN for a NaN or inf)
    yb = np.asarray(ffi_ops.linear(jnp.asarray(x.astype(ml_dtypes.bfloat16)), data, scales=scales, weight_format=fmt))
    assert np.isfinite(yb[0]).all()
    assert np.isnan(yb[1]).all(), yb[1]
    assert not np.isfinite(yb[2]).any(), yb[2]

def test_fp8_codes_decode_exactly_on_every_row_position():
    """Every finite e4m3fn code (subnormals, +-448, negative zero) through linear with unit scales and a one-hot x:
    y[o] is exactly the code's value whichever vector lane or scalar tail reads it (K = 45: 2 vectors of 16 and a
    tail of 13 on AVX-512, 5 of 8 and 5 on AVX2); a NaN code (0x7f, 0xff) makes its row NaN, in a vector or a tail."""
    fmt, K = wf.fp8((1, 45)), 45
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    data = np.resize(finite, (6, K)).view(ml_dtypes.float8_e4m3fn)  # [6, 45]: the 254 finite codes, then again
    values = data.astype(np.float32)
    scales = np.ones((6, 1), np.float32)
    for col in range(K):
        x = np.zeros((1, K), np.float32)
        x[0, col] = 1.0
        y = np.asarray(ffi_ops.linear(x, data, scales=scales, weight_format=fmt))[0]
        np.testing.assert_array_equal(y, values[:, col])
    nan_rows = np.full((2, K), 0x38, np.uint8)  # 1.0
    nan_rows[0, 3], nan_rows[1, 44] = 0x7F, 0xFF  # a vector lane, the scalar tail
    y = np.asarray(ffi_ops.linear(np.ones((1, K), np.float32), nan_rows.view(ml_dtypes.float8_e4m3fn),
                                  scales=np.ones((2, 1), np.float32), weight_format=fmt))
    assert np.isnan(y).all()
    # 128-column blocks (the fused one-token path on AVX-512) and K = 200: a chunk of 128, 4 vectors, a tail of 8
    rows = np.full((4, 200), 0x38, np.uint8)
    rows[0, 5], rows[1, 130], rows[2, 199] = 0x7F, 0xFF, 0x7F  # row 3 has no NaN: y = 200
    for n in (1, 2):
        y = np.asarray(ffi_ops.linear(np.ones((n, 200), np.float32), rows.view(ml_dtypes.float8_e4m3fn),
                                      scales=np.ones((4, 2), np.float32), weight_format=wf.fp8((1, 128))))
        assert np.isnan(y[:, :3]).all() and (y[:, 3] == 200.0).all()


@pytest.fixture
def q4_banks():
    """Two q4_0 experts H = 64, I = 32 and their scale banks, released after the test."""
    rng = np.random.default_rng(3)
    gu = [stored_matrix(rng, wf.Q4_0, 64, 64, parts=2) for _ in range(2)]
    dn = [stored_matrix(rng, wf.Q4_0, 64, 32) for _ in range(2)]
    banks = [HostBank.from_numpy(np.stack(a)) for a in (*zip(*gu), *zip(*dn))]
    yield banks
    for bank in banks:
        if bank.alive:
            bank.release()


def test_bad_quantized_inputs_raise_clear_errors(q4_banks):
    gud, gus, dnd, dns = q4_banks
    x, ids, w = np.ones((1, 64), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    q4 = dict(gate_up_scale=gus, down_scale=dns, weight_format=wf.Q4_0)
    with pytest.raises(ValueError, match=r"host_experts: q4_0 expert weights need both scale banks"):
        ffi_ops.host_experts(x, ids, w, gud, dnd, weight_format=wf.Q4_0)
    with pytest.raises(TypeError, match=r"host_experts: gate_up bank \d+ \(\[2, 64, 32\] uint8\) is uint8: float "
                                        r"weights must be float32 or bfloat16; pass weight_format="):
        ffi_ops.host_experts(x, ids, w, gud, dnd)
    with pytest.raises(TypeError, match=r"host_experts: gate_up bank .* must be int8 \(q8_0 data\), got uint8"):
        ffi_ops.host_experts(x, ids, w, gud, dnd, **dict(q4, weight_format=wf.Q8_0))
    with pytest.raises(ValueError, match=r"host_experts: gate_up_scale bank .* must be \[64, 2\] \(q4_0 scales of "
                                         r"blocks \[1, 32\]\), got \[64, 1\]"):
        ffi_ops.host_experts(x, ids, w, gud, dnd, **dict(q4, gate_up_scale=dns))
    with pytest.raises(ValueError, match=r"host_experts: gate_up bank .* must hold q4_0 data \[64, 48\] of a "
                                         r"\[64, 96\] matrix, got \[64, 32\]"):
        ffi_ops.host_experts(np.ones((1, 96), np.float32), ids, w, gud, dnd, **q4)
    f32_bank, odd_inter = HostBank(2, (64, 40), np.float32), HostBank(2, (40, 32), np.uint8)  # I = 20
    try:
        with pytest.raises(ValueError, match=r"host_experts: down bank .* rows of 20 elements do not fit q4_0's "
                                             r"blocks of 32"):
            ffi_ops.host_experts(x, ids, w, odd_inter, dnd, **q4)
        with pytest.raises(ValueError, match=r"scale banks given for the float format f32"):
            ffi_ops.host_experts(x, ids, w, f32_bank, f32_bank, gate_up_scale=gus, down_scale=dns)
    finally:
        f32_bank.release()
        odd_inter.release()
    with pytest.raises(TypeError, match=r"weight_format must be a ft_jax.weight_formats.WeightFormat or None, got str"):
        ffi_ops.host_experts(x, ids, w, gud, dnd, **dict(q4, weight_format="q4_0"))
    # slot_experts and linear
    pools = [jnp.asarray(b.numpy()) for b in q4_banks]
    with pytest.raises(ValueError, match=r"slot_experts: down_scale_slots \[2, 64, 2\] \(per slot\) must be "
                                         r"\[64, 1\]"):
        ffi_ops.slot_experts(x, ids, w, pools[0], pools[2], gate_up_scale_slots=pools[1],
                             down_scale_slots=pools[1], weight_format=wf.Q4_0)
    with pytest.raises(ValueError, match=r"linear: q4_0 weights need their scales"):
        ffi_ops.linear(x, pools[0][0], weight_format=wf.Q4_0)
    with pytest.raises(ValueError, match=r"linear: scales given for the float format f32"):
        ffi_ops.linear(x, jnp.zeros((8, 64)), scales=pools[1][0])
    with pytest.raises(ValueError, match=r"linear: w \[64, 32\]: rows of 40 elements do not fit q4_0's blocks"):
        ffi_ops.linear(np.ones((1, 40), np.float32), pools[0][0], scales=pools[1][0], weight_format=wf.Q4_0)
    # The handlers check what bypasses the wrappers: an unknown format, a scale bank of the wrong shape
    # (instantiate), a missing scales operand.
    lin = jax.ffi.ffi_call("ft_jax_linear", jax.ShapeDtypeStruct((1, 64), jnp.float32))
    one = dict(block_rows=np.int64(1), block_cols=np.int64(32))
    with pytest.raises(RUNTIME_ERRORS, match=r"linear: unknown weight_format 'q5_0'"):
        np.asarray(lin(x, pools[0][0], np.int32(0), pools[1][0], weight_format="q5_0", **one))
    with pytest.raises(RUNTIME_ERRORS, match=r"linear: weight_format 'q4_0' takes one scales operand, got 0"):
        np.asarray(lin(x, pools[0][0], np.int32(0), weight_format="q4_0", **one))
    with pytest.raises(RUNTIME_ERRORS, match=r"linear: scales \[64, 1\] must be float16 \[64, 2\] for q4_0"):
        np.asarray(lin(x, pools[0][0], np.int32(0), pools[3][0], weight_format="q4_0", **one))  # down's [64, 1]
    he = jax.ffi.ffi_call("ft_jax_host_experts", jax.ShapeDtypeStruct((1, 64), jnp.float32))
    with pytest.raises(RUNTIME_ERRORS, match=rf"host_experts: gate_up_scale bank {dns.id} \(\[2, 64, 1\] float16\) "
                                             r"must be float16 \[64, 2\] for q4_0"):
        np.asarray(he(x, ids, w, banks=np.array([gud.id, dnd.id], np.int64),
                      scale_banks=np.array([dns.id, dns.id], np.int64), weight_format="q4_0", activation="silu",
                      alpha=np.float32(ALPHA), limit=np.float32(LIMIT), **one))


def test_quantized_runtime_errors_name_the_id_and_the_released_bank(q4_banks):
    gud, gus, dnd, dns = q4_banks
    x, w = np.ones((1, 64), np.float32), np.ones((1, 1), np.float32)
    run = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gud, dnd, gate_up_scale=gus, down_scale=dns,
                                                       weight_format=wf.Q4_0))
    with pytest.raises(RUNTIME_ERRORS, match=rf"host_experts: flat id 5 at position 0 is out of range for bank "
                                             rf"{gud.id}"):
        np.asarray(run(x, np.array([[5]], np.int32), w))
    assert np.isfinite(np.asarray(run(x, np.array([[1]], np.int32), w))).all()
    gus.release()
    with pytest.raises(RUNTIME_ERRORS, match=rf"host_experts: bank {gus.id} was released"):
        np.asarray(run(x, np.array([[1]], np.int32), w))
