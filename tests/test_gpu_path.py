"""The GPU path's pieces that run without a GPU: the Pallas device experts (Pallas' interpreter against a float64
numpy reference; their CUDA lowering: the slot pools go into the two Triton kernels and nowhere else, so no gathered
copy of the routed experts), the slot fill's error count on the CPU, OffloadedExperts.read_stats, and whether the
build has the CUDA handlers. tests/test_gpu.py runs the rest on a GPU."""

import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import ft_jax
from ft_jax import _ffi
from ft_jax.kernels import device_experts, ffi_ops
from ft_jax.offload.experts import OffloadedExperts
from ft_jax.kernels.host_bank import HostBank
from ft_jax.offload.banks import ExpertBanks
from ft_jax.offload.policy import Policy
from ft_jax.weight_formats import MXFP4, Q4_0, Q8_0, dequantize, fp8, quantize
from test_quant_kernels import check_within, experts_reference

BF16 = np.dtype(ml_dtypes.bfloat16)


def _glu(g, u, activation, alpha=1.702, limit=7.0):
    if activation == "silu":
        return g / (1 + np.exp(-g)) * u
    if activation == "gelu_tanh":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1) * g / (1 + np.exp(-alpha * g))


def float64_experts(x, ids, w, gu, dn, activation, gb=None, db=None):
    """float64: y[t] = sum_j w[t, j] * (dn_e @ a + bd), a = glu(gu_e[:I] x + bg, gu_e[I:] x + bu), e = ids[t, j] >= 0;
    a rounded to bf16 when x is bf16 (a bf16 model, as the CPU kernel and transformers)."""
    round_a = np.dtype(x.dtype) == BF16
    x, gu, dn = (np.asarray(a, np.float64) for a in (x, gu, dn))
    inter = gu.shape[1] // 2
    y = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0:
                continue
            h = gu[e] @ x[t] + (0 if gb is None else np.asarray(gb[e], np.float64))
            a = _glu(h[:inter], h[inter:], activation)
            a = a.astype(np.float32).astype(BF16).astype(np.float64) if round_a else a
            d = dn[e] @ a + (0 if db is None else np.asarray(db[e], np.float64))
            y[t] += w[t, j] * d
    return y


def _case(rng, T, k, S, H, inter, dtype, x_dtype, bias):
    x = rng.standard_normal((T, H)).astype(np.float32).astype(x_dtype)
    gu = (rng.standard_normal((S, 2 * inter, H)) * 0.1).astype(np.float32).astype(dtype)
    dn = (rng.standard_normal((S, H, inter)) * 0.1).astype(np.float32).astype(dtype)
    ids = np.stack([rng.permutation(S)[:k] for _ in range(T)]).astype(np.int32)  # distinct slots per token
    ids[0, -1] = -1  # a skipped route
    if T > 1:
        ids[-1, :] = -1  # a token with no route at all: its output row must be zeros
    w = rng.random((T, k)).astype(np.float32)
    biases = {}
    if bias:
        biases = dict(gate_up_bias_slots=(rng.standard_normal((S, 2 * inter)) * 0.1).astype(dtype),
                      down_bias_slots=(rng.standard_normal((S, H)) * 0.1).astype(dtype))
    return x, ids, w, gu, dn, biases


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
@pytest.mark.parametrize("dtype,x_dtype,bias,T", [(np.float32, np.float32, False, 1), (np.float32, np.float32, True, 5),
                                                   (BF16, BF16, True, 3), (BF16, np.float32, False, 2)])
def test_pallas_slot_experts_match_float64(activation, dtype, x_dtype, bias, T):
    rng = np.random.default_rng(T)
    x, ids, w, gu, dn, biases = _case(rng, T, 2, 4, 64, 48, dtype, x_dtype, bias)  # tokens share the 4 slots
    got = device_experts.slot_experts(x, ids, w, gu, dn, activation, interpret=True, **biases)
    want = float64_experts(x, ids, w, gu, dn, activation, biases.get("gate_up_bias_slots"),
                      biases.get("down_bias_slots"))
    assert got.shape == (T, 64) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    unrouted = [t for t in range(T) if (ids[t] < 0).all()]
    assert unrouted == ([T - 1] if T > 1 else [])  # the check below has a row to check
    assert np.all(np.asarray(got)[unrouted] == 0)


def test_pallas_slot_experts_no_route_is_zero():
    rng = np.random.default_rng(1)
    x, ids, w, gu, dn, _ = _case(rng, 2, 2, 3, 32, 16, np.float32, np.float32, False)
    y = device_experts.slot_experts(x, np.full_like(ids, -1), w, gu, dn, interpret=True)
    assert np.all(np.asarray(y) == 0)


def test_pallas_slot_experts_rejects_dims_not_multiple_of_16():
    x = np.zeros((1, 24), np.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        device_experts.slot_experts(x, np.zeros((1, 2), np.int32), np.ones((1, 2), np.float32),
                                    np.zeros((2, 64, 24), np.float32), np.zeros((2, 24, 32), np.float32))


def test_pallas_cuda_lowering_reads_the_pools_in_place():
    """Lowered for CUDA (no GPU needed): each slot pool is an operand of exactly one op, its Triton kernel; nothing
    gathers, slices or copies it (the only gathers act on the i32[T*k] route vectors)."""
    T, k, S, H, inter = 2, 2, 6, 256, 512
    args = (jax.ShapeDtypeStruct((T, H), jnp.bfloat16), jax.ShapeDtypeStruct((T, k), jnp.int32),
            jax.ShapeDtypeStruct((T, k), jnp.float32), jax.ShapeDtypeStruct((S, 2 * inter, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((S, H, inter), jnp.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # JAX 0.11's Triton deprecation must not become an error
        text = jax.jit(device_experts.slot_experts).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        ignore = ("ignore", re.compile(device_experts.TRITON_DEPRECATION, re.I), DeprecationWarning)
        assert warnings.filters[0][:3] == ignore  # ahead of the "error" above (JAX 0.10 never warns: checked here)
    body = [line for line in text.splitlines() if "=" in line]
    for arg, name in (("%arg3", "ft_jax_slot_experts_gate_up"), ("%arg4", "ft_jax_slot_experts_down")):
        users = [line for line in body if re.search(arg + r"\b", line.split("=", 1)[1])]
        assert len(users) == 1, users
        assert "__gpu$xla.gpu.triton" in users[0] and f'name = "{name}"' in users[0]
    for line in body:
        if "gather" in line or "dynamic_slice" in line:
            assert f"x{H}" not in line.split("->")[-1], line  # only small index vectors


# ----------------------------------------------------------------------------------- quantized pools (issue 19)
def _quantized_pools(rng, fmt, S, H, inter):
    """Random slot pools in fmt (CONTRACT layouts) and their float64 values: (gate_up data [S, *data_shape(2I, H)],
    gate_up scales [S, 2 scale_rows(I), ceil(H / bc)], down data, down scales, gu f64 [S, 2I, H], dn f64 [S, H, I]).
    q8_0 / q4_0 from gguf's quantizer (weight_formats.quantize), mxfp4 random codes and E8M0 exponents around 2^-3,
    fp8 random e4m3 values with random f32 block scales; values from the numpy dequantize in float64."""
    def one(rows, cols):
        if fmt in (Q8_0, Q4_0):
            return quantize((rng.standard_normal((S, rows, cols)) * 0.1).astype(np.float32), fmt)
        if fmt is MXFP4:
            return (rng.integers(0, 256, (S, rows, cols // 2)).astype(np.uint8),
                    rng.integers(121, 127, (S, rows, cols // 32)).astype(np.uint8))
        data = rng.standard_normal((S, rows, cols)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        return data, (rng.random((S, *fmt.scale_shape(rows, cols))) * 0.1 + 0.05).astype(np.float32)

    (gd, gs), (ud, us), (dd, ds) = one(inter, H), one(inter, H), one(H, inter)
    gu_data, gu_scales = np.concatenate([gd, ud], 1), np.concatenate([gs, us], 1)  # stacked grids
    gu = dequantize(gu_data, gu_scales, fmt, rows=inter, dtype=np.float64)
    np.testing.assert_array_equal(gu[:, inter:], dequantize(ud, us, fmt, dtype=np.float64))
    return gu_data, gu_scales, dd, ds, gu, dequantize(dd, ds, fmt, dtype=np.float64)


QUANTIZED = {"q8_0": Q8_0, "q4_0": Q4_0, "mxfp4": MXFP4, "fp8_16x32": fp8((16, 32)), "fp8_24x40": fp8((24, 40))}


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("activation,x_dtype,bias,T", [("silu", np.float32, False, 3), ("swiglu_oai", BF16, True, 2)])
def test_pallas_slot_experts_quantized_pools_match_float64(name, activation, x_dtype, bias, T):
    """Pools in q8_0, q4_0, mxfp4 and fp8 (16 x 32 blocks; 24 x 40 blocks: partial edge blocks in rows and columns,
    I = 48 rows per gate/up matrix) dequantized per tile in the kernels (Pallas interpreter) against the float64
    reference on the numpy dequantize's values (every product in float32 accumulation: 2e-5)."""
    fmt = QUANTIZED[name]
    rng = np.random.default_rng(7)
    S, H, inter = 4, 64, 48 if fmt.name == "fp8" else 64
    gu_data, gu_scales, dn_data, dn_scales, gu, dn = _quantized_pools(rng, fmt, S, H, inter)
    x, ids, w, _, _, biases = _case(rng, T, 2, S, H, inter, np.float32, x_dtype, bias)
    got = device_experts.slot_experts(x, ids, w, gu_data, dn_data, activation, interpret=True,
                                      gate_up_scale_slots=gu_scales, down_scale_slots=dn_scales, weight_format=fmt,
                                      **biases)
    want = float64_experts(x, ids, w, gu, dn, activation, biases.get("gate_up_bias_slots"),
                      biases.get("down_bias_slots"))
    assert got.shape == (T, H) and got.dtype == jnp.float32
    assert np.abs(want).max() > 0.05  # a non-trivial output to compare
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert np.all(np.asarray(got)[T - 1] == 0)  # the unrouted token


@pytest.mark.parametrize("name,inter", [("q4_0", 96), ("mxfp4", 96), ("q8_0", 96), ("fp8_24x40", 80)])
def test_pallas_slot_experts_quantized_pools_over_several_tiles(name, inter):
    """H = 256 (two 128-column steps of the gate/up loop, eight 32-row down programs) and I = 96 / 80 (several
    gate/up programs and down steps; fp8 24 x 40 blocks cut by the tiles): the scale gathers follow the tiles."""
    fmt = QUANTIZED[name]
    rng = np.random.default_rng(9)
    S, H = 3, 256
    gu_data, gu_scales, dn_data, dn_scales, gu, dn = _quantized_pools(rng, fmt, S, H, inter)
    x, ids, w, _, _, _ = _case(rng, 2, 2, S, H, inter, np.float32, np.float32, False)
    got = device_experts.slot_experts(x, ids, w, gu_data, dn_data, "gelu_tanh", interpret=True,
                                      gate_up_scale_slots=gu_scales, down_scale_slots=dn_scales, weight_format=fmt)
    want = float64_experts(x, ids, w, gu, dn, "gelu_tanh")
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["q4_0", "fp8_24x40"])
def test_ffi_slot_experts_cuda_form_passes_the_scale_pools(name, monkeypatch):
    """ffi_ops.slot_experts' CUDA branch (taken here: CUDA_ENABLED on, platform_dependent's cuda form, the Pallas
    kernels in the interpreter) hands the scale pools and the format to device_experts: the float64 reference's
    outputs (2e-5), as the CPU handler on the same pools gives them within its bound (tests/test_quant_kernels.py)."""
    fmt = QUANTIZED[name]
    rng = np.random.default_rng(11)
    S, H, inter = 4, 64, 48 if fmt.name == "fp8" else 64
    gu_data, gu_scales, dn_data, dn_scales, gu, dn = _quantized_pools(rng, fmt, S, H, inter)
    x, ids, w, _, _, biases = _case(rng, 3, 2, S, H, inter, np.float32, np.float32, True)
    args = (x, ids, w, gu_data, dn_data, "swiglu_oai")
    kw = dict(gate_up_scale_slots=gu_scales, down_scale_slots=dn_scales, weight_format=fmt, **biases)
    on_cpu = np.asarray(ffi_ops.slot_experts(*args, **kw))
    monkeypatch.setattr(ft_jax, "CUDA_ENABLED", True)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *a, cpu, cuda: cuda(*a))
    real = device_experts.slot_experts
    monkeypatch.setattr(device_experts, "slot_experts", lambda *a, **k: real(*a, interpret=True, **k))
    on_gpu = np.asarray(ffi_ops.slot_experts(*args, **kw))
    gb, db = biases["gate_up_bias_slots"], biases["down_bias_slots"]
    want = float64_experts(x, ids, w, gu, dn, "swiglu_oai", gb, db)
    np.testing.assert_allclose(on_gpu, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # the CPU handler within its own derived bound (int8 activations for q4_0 on AVX2 or AVX-512 VNNI)
    check_within(on_cpu, *experts_reference(x, ids, w, gu, dn, "swiglu_oai", fmt, gb, db), "CPU slot_experts")


def test_pallas_slot_experts_rejects_mismatched_quantized_pools():
    rng = np.random.default_rng(8)
    gu_data, gu_scales, dn_data, dn_scales, _, _ = _quantized_pools(rng, Q8_0, 2, 64, 32)
    x, ids, w = np.ones((1, 64), np.float32), np.zeros((1, 2), np.int32), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match=r"gate_up_scale_slots is missing"):
        device_experts.slot_experts(x, ids, w, gu_data, dn_data, weight_format=Q8_0, down_scale_slots=dn_scales)
    with pytest.raises(ValueError, match=r"down_scale_slots must be \[2, 64, 1\] float16.*got \[2, 64, 2\]"):
        device_experts.slot_experts(x, ids, w, gu_data, dn_data, weight_format=Q8_0, gate_up_scale_slots=gu_scales,
                                    down_scale_slots=np.zeros((2, 64, 2), np.float16))
    with pytest.raises(ValueError, match=r"gate_up_slots must be \[2, 64, 32\] uint8"):
        device_experts.slot_experts(x, ids, w, gu_data, dn_data, weight_format=Q4_0, gate_up_scale_slots=gu_scales,
                                    down_scale_slots=dn_scales)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "mxfp4", "fp8_16x32"])
def test_pallas_cuda_lowering_reads_quantized_pools_in_place(name):
    """Lowered for CUDA: the data and scale pools of a block format are each an operand of exactly one op, its
    Triton kernel (dequantized there, per tile): no dequantized or gathered copy of a pool."""
    fmt = QUANTIZED[name]
    T, k, S, H, inter = 2, 2, 6, 256, 512
    args = (jax.ShapeDtypeStruct((T, H), jnp.bfloat16), jax.ShapeDtypeStruct((T, k), jnp.int32),
            jax.ShapeDtypeStruct((T, k), jnp.float32),
            jax.ShapeDtypeStruct((S, *fmt.data_shape(2 * inter, H)), fmt.data_dtype),
            jax.ShapeDtypeStruct((S, *fmt.data_shape(H, inter)), fmt.data_dtype),
            jax.ShapeDtypeStruct((S, 2 * fmt.scale_rows(inter), fmt.scale_shape(inter, H)[1]), fmt.scale_dtype),
            jax.ShapeDtypeStruct((S, *fmt.scale_shape(H, inter)), fmt.scale_dtype))

    def f(x, ids, w, gu, dn, gus, dns):
        return device_experts.slot_experts(x, ids, w, gu, dn, gate_up_scale_slots=gus, down_scale_slots=dns,
                                           weight_format=fmt)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    body = [line for line in text.splitlines() if "=" in line]
    for arg, name in (("%arg3", "ft_jax_slot_experts_gate_up"), ("%arg4", "ft_jax_slot_experts_down"),
                      ("%arg5", "ft_jax_slot_experts_gate_up"), ("%arg6", "ft_jax_slot_experts_down")):
        users = [line for line in body if re.search(arg + r"\b", line.split("=", 1)[1])]
        assert len(users) == 1, users
        assert "__gpu$xla.gpu.triton" in users[0] and f'name = "{name}"' in users[0]


# ------------------------------------------------------------------------------------------ error count, read_stats
def test_cpu_slot_fill_error_count_is_zero_and_bad_ids_still_raise():
    rows = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    bank = HostBank.from_numpy(rows)
    fill = jax.jit(lambda s, f, i: ffi_ops.slot_fill_with_errors((s,), f, i, (bank,)), donate_argnums=0)
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU handler, also on a machine with a GPU
        (slots,), errors = fill(jnp.zeros((3, 8), jnp.float32), jnp.array([2, -1], jnp.int32),
                                jnp.array([1, 0], jnp.int32))
        assert int(errors) == 0 and errors.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(slots), np.stack([np.zeros(8), rows[2], np.zeros(8)]))
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="out of range"):
            jax.block_until_ready(fill(jnp.zeros((3, 8), jnp.float32), jnp.array([4], jnp.int32),
                                       jnp.array([0], jnp.int32)))


def _backend(policy="fetch-all"):
    gu = HostBank.from_numpy(np.zeros((2 * 4, 32, 16), np.float32))
    dn = HostBank.from_numpy(np.zeros((2 * 4, 16, 16), np.float32))
    return OffloadedExperts(ExpertBanks(gate_up=gu, down=dn), num_experts=4, policy=Policy(policy))


def test_read_stats_returns_the_stats_and_raises_on_fill_errors():
    backend = _backend()
    state = backend.init_state(3)
    assert int(state.fill_errors) == 0
    x = jnp.ones((1, 16), jnp.float32)
    step = jax.jit(lambda s: backend(0, x, jnp.array([[1, 2]], jnp.int32), jnp.full((1, 2), 0.5), s)[1])
    state = step(state)
    stats = backend.read_stats(state)
    np.testing.assert_array_equal(stats, np.asarray(state.cache.stats))
    assert stats[0].tolist()[:4] == [2, 0, 2, 2]  # active, hits, misses, fetched (fetch-all, cold cache)
    assert int(state.fill_errors) == 0
    with pytest.raises(RuntimeError, match="3 slot fill entries"):
        backend.read_stats(state._replace(fill_errors=jnp.int32(3)))


def test_read_stats_raises_on_host_route_errors():
    backend = _backend()
    state = backend.init_state(3)
    assert int(state.host_route_errors) == 0 and state.host_route_errors.dtype == jnp.int32
    with pytest.raises(RuntimeError, match=r"host_route_errors = 2: 2 host_experts calls"):
        backend.read_stats(state._replace(host_route_errors=jnp.int32(2)))


def _emulate_cuda_host_experts(monkeypatch):
    """Runs the CUDA forms of OffloadedExperts on the CPU: platform_dependent takes the cuda branch, the Pallas
    kernels run in the interpreter, and host_experts_submit / _wait become a CPU emulation of the CUDA handlers'
    contract (host_experts_cuda.cc, HostChannel::Run): a call with any flat id >= the bank's rows returns zeros and
    errors = 1, else the CPU handler's y and errors = 0. The wait receives the submit's HostTicket, pair id included."""
    monkeypatch.setattr(ft_jax, "CUDA_ENABLED", True)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cpu, cuda: cuda(*args))
    real_slot_experts = device_experts.slot_experts
    monkeypatch.setattr(device_experts, "slot_experts", lambda *a, **kw: real_slot_experts(*a, interpret=True, **kw))
    submitted = {}

    def submit(x, flat_ids, weights, gate_up, down, activation="silu", **kw):
        ticket = ffi_ops.HostTicket(jnp.zeros((), jnp.uint8), len(submitted) + 1)
        submitted[ticket.pair] = (x, flat_ids, weights, gate_up, down, activation, kw)
        return ticket

    def wait(ticket, after):
        x, flat_ids, weights, gate_up, down, activation, kw = submitted[ticket.pair]
        bad = jnp.any(flat_ids >= gate_up.num_rows)
        ft_jax.CUDA_ENABLED = False  # the CPU handler itself (the CUDA form would come back here)
        try:
            y = ffi_ops.host_experts(x, jnp.where(bad, -1, flat_ids), weights, gate_up, down, activation, **kw)
        finally:
            ft_jax.CUDA_ENABLED = True
        return jnp.where(bad, 0.0, y), bad.astype(jnp.int32)

    monkeypatch.setattr(ffi_ops, "host_experts_submit", submit)
    monkeypatch.setattr(ffi_ops, "host_experts_wait", wait)


@pytest.mark.parametrize("policy", ["host-all", "qstar"])
def test_a_bad_host_route_reaches_read_stats(policy, monkeypatch):
    """A route to a flat id past the banks (moe_layer = L) under the GPU forms: host_experts_wait's error count is
    summed into OffloadState.host_route_errors by the step, and read_stats raises naming it. Good routes count 0."""
    _emulate_cuda_host_experts(monkeypatch)
    rng = np.random.default_rng(0)
    gu = HostBank.from_numpy(rng.standard_normal((2 * 4, 32, 16)).astype(np.float32))
    dn = HostBank.from_numpy(rng.standard_normal((2 * 4, 16, 16)).astype(np.float32))
    backend = OffloadedExperts(ExpertBanks(gate_up=gu, down=dn), num_experts=4, policy=Policy(policy, frac=0.0) if policy == "qstar"
                               else Policy(policy))  # qstar at frac 0: every miss on the host, no fill
    x = jnp.asarray(rng.standard_normal((1, 16)), jnp.float32)
    ids, w = jnp.array([[1, 2]], jnp.int32), jnp.full((1, 2), 0.5)
    step = jax.jit(lambda layer, s: backend(layer, x, ids, w, s))  # a traced layer: no trace-time range check
    y, state = step(jnp.int32(1), backend.init_state(3))
    assert int(state.host_route_errors) == 0
    want = ffi_ops.host_experts(x, 4 + ids, w, gu, dn)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)
    backend.read_stats(state)
    y, state = step(jnp.int32(2), state)  # flat ids 8 + ids: past the 8 bank rows
    y, state = step(jnp.int32(2), state)
    assert int(state.host_route_errors) == 2 and np.all(np.asarray(y) == 0)
    with pytest.raises(RuntimeError, match=r"host_experts: host_route_errors = 2"):
        backend.read_stats(state)


def _submit_wait_pairs(text: str) -> list[tuple[int, int]]:
    """(submit pair id, wait pair id) for every host_experts_wait of a lowered module: the submit is the one whose
    ticket the wait's first operand is, directly or through an optimization_barrier. Scans in text order: value names
    repeat across sibling regions (the platform_dependent branches), so a use refers to the latest definition."""
    call = r"(%[\w#]+)(?::\d+)? = stablehlo\.custom_call @ft_jax_host_experts_(submit|wait)\(([^)]*)\).*?pair = (\d+) :"
    tickets, pairs = {}, []  # value name -> pair id of the submit it carries
    for line in text.splitlines():
        if m := re.search(r"(%\w+):\d+ = stablehlo\.optimization_barrier ([^:]*):", line):
            for i, operand in enumerate(o.strip() for o in m[2].split(",")):
                if operand in tickets:
                    tickets[f"{m[1]}#{i}"] = tickets[operand]
        elif m := re.search(call, line):
            if m[2] == "submit":
                tickets[m[1]] = int(m[4])
            else:
                ticket = m[3].split(",")[0].strip()
                assert ticket in tickets, (line, tickets)
                pairs.append((tickets[ticket], int(m[4])))
    return pairs


def test_submit_and_wait_carry_one_pair_id_per_pair_in_the_cuda_lowering(monkeypatch):
    """Lowered for CUDA: each host_experts submit / wait pair carries one `pair` attribute, distinct pairs distinct
    ones (the CUDA wait finds its submit's channel by it, never by a buffer address); the wait returns y and the
    i32 error count; a second trace of the same function takes new ids."""
    monkeypatch.setattr(ft_jax, "CUDA_ENABLED", True)
    gu = HostBank.from_numpy(np.zeros((8, 32, 16), np.float32))
    dn = HostBank.from_numpy(np.zeros((8, 16, 16), np.float32))

    def two_calls(x, ids, w):
        return (ffi_ops.host_experts_with_errors(x, ids, w, gu, dn),
                ffi_ops.host_experts_with_errors(x, ids + 1, w, gu, dn))

    args = (jax.ShapeDtypeStruct((1, 16), jnp.float32), jax.ShapeDtypeStruct((1, 2), jnp.int32),
            jax.ShapeDtypeStruct((1, 2), jnp.float32))
    texts = [jax.jit(lambda *a: two_calls(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
             for _ in range(2)]  # two functions: two traces (jit reuses the trace of one function, ids included)
    ids = []
    for text in texts:
        pairs = _submit_wait_pairs(text)
        assert len(pairs) == 2 and all(s == w for s, w in pairs), pairs
        ids += [s for s, _ in pairs]
        assert re.search(r"@ft_jax_host_experts_wait\(.*-> \(tensor<1x16xf32>, tensor<i32>\)", text)
    assert len(set(ids)) == 4, ids
    with pytest.raises(TypeError, match="HostTicket"):
        ffi_ops.host_experts_wait(jnp.zeros((), jnp.uint8), jnp.zeros((1, 16), jnp.float32))


# ------------------------------------------------------------------------------------------------------------ build
def test_cuda_handlers_built_when_nvcc_was_found():
    """The extension has the CUDA handlers iff the build found nvcc (CMake's AUTO); without a GPU none is registered."""
    assert _ffi.cuda_built() == (shutil.which("nvcc") is not None)
    try:
        has_gpu = bool(jax.devices("cuda"))
    except RuntimeError:
        has_gpu = False
    assert ft_jax.CUDA_ENABLED == (_ffi.cuda_built() and has_gpu)
    if _ffi.cuda_built():
        assert set(_ffi.cuda_registrations()) == {"ft_jax_slot_fill", "ft_jax_host_experts_submit",
                                                  "ft_jax_host_experts_wait"}
        assert set(_ffi.cuda_types()) == {"ft_jax_cuda_slot_fill_state", "ft_jax_cuda_host_channel"}
        if not ft_jax.CUDA_ENABLED:
            assert all(v == 0 for v in _ffi.cuda_counters().values())


# ------------------------------------------------------------------------------------- the decode step lowered for CUDA
@pytest.mark.parametrize("family,quantize", [("mixtral", None), ("gpt_oss", None), ("deepseek_v3", None),
                                             ("qwen3_moe", "q4_0"), ("gpt_oss_mxfp4", None)])
def test_decode_step_lowered_for_cuda_uses_only_the_cuda_forms(family, quantize, monkeypatch):
    """With the CUDA forms switched on (as import ft_jax does on a GPU), the same decode step lowers for CUDA here:
    slot_fill, host_experts_submit / _wait (with the optimization barrier tying the submit before the device part) and
    the Pallas kernels; none of the CPU-only targets (ft_jax_host_experts, ft_jax_slot_experts, ft_jax_linear). Also
    with quantized weights: q4_0 dense projections and experts (--quantize), gpt-oss's MXFP4 experts (slot pools and
    scale pools into the dequantizing Pallas kernels)."""
    import os

    from ft_jax.checkpoint import load_checkpoint
    from ft_jax.engine.engine import DECODE_CHUNK_STEPS, Engine, Sampling, eos_operand

    monkeypatch.setattr(ft_jax, "CUDA_ENABLED", True)
    path = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny", family)
    ckpt = load_checkpoint(path, dtype=jnp.float32, quantize=quantize)
    expected = {
        "qstar": {"ft_jax_slot_fill", "ft_jax_host_experts_submit", "ft_jax_host_experts_wait", "__gpu$xla.gpu.triton"},
        "host-all": {"ft_jax_host_experts_submit", "ft_jax_host_experts_wait"},
        "resident": {"__gpu$xla.gpu.triton"},
    }
    for kind, targets in expected.items():
        engine = Engine(ckpt, policy=Policy(kind, frac=0.5) if kind == "qstar" else Policy(kind), num_slots=8)
        kv = jax.eval_shape(lambda: engine.init_kv_cache(1, 64))
        ids = jax.ShapeDtypeStruct((1,), jnp.int32)
        traced = engine._decode.trace(engine.params, ids, ids, kv, engine.expert_state,
                                      jax.ShapeDtypeStruct((1, 2), jnp.uint32), *Sampling().operands(1),
                                      eos_operand(()), np.asarray(1, np.int32), greedy=True,
                                      max_steps=DECODE_CHUNK_STEPS)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert set(re.findall(r"custom_call @([\w$.]+)", text)) == targets, kind
        assert ("optimization_barrier" in text) == (kind == "qstar"), kind
        pairs = _submit_wait_pairs(text)
        assert len(pairs) == text.count("@ft_jax_host_experts_wait(") and bool(pairs) == (kind != "resident"), kind
        assert all(s == w for s, w in pairs) and len({s for s, _ in pairs}) == len(pairs), (kind, pairs)
