"""FFI handlers through their JAX wrappers: slot_fill (bit-exact, in place, one compilation), host_experts,
slot_experts and linear (float64 numpy reference), and bad inputs (clear Python errors, process keeps working)."""

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ft_jax import _ffi
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank

BF16 = np.dtype(ml_dtypes.bfloat16)
# An FFI error raised while a compiled step runs reaches Python as JaxRuntimeError, or as ValueError when jit's C++
# fast path dispatched the call (jax 0.10; the handler's error code does not change this).
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


# ----------------------------------------------------------------------------------------------------------- slot_fill
def fill_one(slots, flat_ids, slot_ids, bank):
    """slot_fill of a single pool from a single bank."""
    return ffi_ops.slot_fill((slots,), flat_ids, slot_ids, (bank,))[0]


def _slot_fill_reference(slots, bank_rows, flat_ids, slot_ids):
    out = slots.copy()
    for f, s in zip(flat_ids, slot_ids):
        if f >= 0 and s >= 0:
            out[s] = bank_rows[f]
    return out


def _random_fill(rng, num_rows, num_slots, n):
    """n (flat id, slot id) pairs, distinct slots, about a third padded with -1 on one side or both."""
    flat = rng.integers(0, num_rows, n).astype(np.int32)
    slots = rng.permutation(num_slots)[:n].astype(np.int32)
    pad = rng.random(n)
    flat[pad < 0.2] = -1
    slots[(pad >= 0.2) & (pad < 0.33)] = -1
    return flat, slots


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_slot_fill_bit_exact_with_padding(dtype):
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((12, 5, 7)).astype(np.float32).astype(dtype)
    bank = HostBank.from_numpy(rows)
    slots = rng.standard_normal((6, 5, 7)).astype(np.float32).astype(dtype)
    fill = jax.jit(lambda s, f, i: fill_one(s, f, i, bank))
    for _ in range(5):
        flat_ids, slot_ids = _random_fill(rng, 12, 6, 5)
        got = np.asarray(fill(jnp.asarray(slots), jnp.asarray(flat_ids), jnp.asarray(slot_ids)))
        expected = _slot_fill_reference(slots, rows, flat_ids, slot_ids)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
        slots = expected
    bank.release()


@pytest.mark.parametrize("row_elems", [65544, 65545], ids=["streaming_stores", "memcpy_odd_size"])
def test_slot_fill_large_rows_bit_exact(row_elems):
    """Rows >= 256 KiB whose size is a multiple of 32 bytes take the streaming-store copy (with a 32-byte tail
    after the 128-byte blocks); an odd size falls back to memcpy."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((5, row_elems)).astype(np.float32)
    bank = HostBank.from_numpy(rows)
    slots = np.zeros((3, row_elems), np.float32)
    flat_ids, slot_ids = np.array([4, -1, 0, 2], np.int32), np.array([1, 0, 2, -1], np.int32)
    got = np.asarray(jax.jit(lambda s, f, i: fill_one(s, f, i, bank))(slots, flat_ids, slot_ids))
    np.testing.assert_array_equal(got.view(np.uint8), _slot_fill_reference(slots, rows, flat_ids, slot_ids).view(np.uint8))
    bank.release()


def _full_copies(hlo_text: str, shape: str) -> list[str]:
    """Instructions of the optimized HLO that copy a whole array of the given shape, e.g. 'f32[8,64,32]'."""
    pattern = re.compile(r"=\s*" + re.escape(shape) + r"\{[^}]*\}\s+copy\(")
    return [line for line in hlo_text.splitlines() if pattern.search(line)]


def test_slot_fill_in_place_under_jit_with_donation():
    rng = np.random.default_rng(1)
    bank = HostBank.from_numpy(rng.standard_normal((16, 64, 32)).astype(np.float32))
    fill = jax.jit(lambda s, f, i: fill_one(s, f, i, bank), donate_argnums=0)
    slots = jnp.zeros((8, 64, 32), jnp.float32)
    ids = jnp.array([3, -1, 9], jnp.int32), jnp.array([0, 4, 7], jnp.int32)
    hlo = fill.lower(slots, *ids).compile().as_text()
    assert "ft_jax_slot_fill" in hlo and "output_to_operand_aliasing" in hlo
    assert _full_copies(hlo, "f32[8,64,32]") == []
    pointer = slots.unsafe_buffer_pointer()
    for _ in range(3):
        slots = fill(slots, *ids)
        assert slots.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(np.asarray(slots)[7], bank.numpy()[9])
    # Control: when the pre-fill value is still used, XLA must copy, and the check above sees it.
    leaky = jax.jit(lambda s, f, i: (fill_one(s, f, i, bank), s.sum()), donate_argnums=0)
    assert _full_copies(leaky.lower(slots, *ids).compile().as_text(), "f32[8,64,32]") != []
    bank.release()


def test_one_slot_fill_call_fills_two_pools_in_place():
    """The decode step's form: gate_up and down pools of different row shapes and dtypes filled by one call, both
    aliased (no copy of either pool), and a call whose ids are all padding leaves both untouched."""
    rng = np.random.default_rng(4)
    gu_rows = rng.standard_normal((10, 6, 4)).astype(np.float32)
    dn_rows = rng.standard_normal((10, 4, 3)).astype(np.float32).astype(BF16)
    banks = HostBank.from_numpy(gu_rows), HostBank.from_numpy(dn_rows)
    fill = jax.jit(lambda p, f, i: ffi_ops.slot_fill(p, f, i, banks), donate_argnums=0)
    pools = (jnp.zeros((5, 6, 4), jnp.float32), jnp.zeros((5, 4, 3), jnp.bfloat16))
    flat, slot = jnp.array([7, -1, 2], jnp.int32), jnp.array([4, 0, 1], jnp.int32)
    hlo = fill.lower(pools, flat, slot).compile().as_text()
    assert hlo.count("ft_jax_slot_fill") >= 1
    assert _full_copies(hlo, "f32[5,6,4]") == [] and _full_copies(hlo, "bf16[5,4,3]") == []
    pointers = [p.unsafe_buffer_pointer() for p in pools]
    pools = fill(pools, flat, slot)
    assert [p.unsafe_buffer_pointer() for p in pools] == pointers
    expected = (_slot_fill_reference(np.zeros((5, 6, 4), np.float32), gu_rows, [7, -1, 2], [4, 0, 1]),
                _slot_fill_reference(np.zeros((5, 4, 3), BF16), dn_rows, [7, -1, 2], [4, 0, 1]))
    for got, want in zip(pools, expected):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    pools = fill(pools, jnp.array([-1, -1, 3], jnp.int32), jnp.array([2, -1, -1], jnp.int32))  # all padding
    for got, want in zip(pools, expected):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError, match="need one bank per pool, got 2 pools and 1 banks"):
        ffi_ops.slot_fill(pools, flat, slot, banks[:1])
    with pytest.raises(ValueError, match=r"pools\[1\] has 4 slots, pools\[0\] has 5"):
        ffi_ops.slot_fill((pools[0], jnp.zeros((4, 4, 3), jnp.bfloat16)), flat, slot, banks)
    for b in banks:
        b.release()


def test_slot_fill_compiles_once_for_100_different_routings():
    rng = np.random.default_rng(2)
    bank = HostBank.from_numpy(rng.standard_normal((32, 16)).astype(np.float32))
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    fill = jax.jit(lambda s, f, i: fill_one(s, f, i, bank), donate_argnums=0)
    slots = jnp.zeros((4, 16), jnp.float32)
    routings = [_random_fill(rng, 32, 4, 3) for _ in range(100)]
    device_routings = [(jnp.asarray(f), jnp.asarray(s)) for f, s in routings]
    expected = np.zeros((4, 16), np.float32)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for flat_ids, slot_ids in device_routings:
            slots = fill(slots, flat_ids, slot_ids)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for flat_ids, slot_ids in routings:
        expected = _slot_fill_reference(expected, bank.numpy(), flat_ids, slot_ids)
    np.testing.assert_array_equal(np.asarray(slots), expected)
    assert len(compiles) == 1
    assert fill._cache_size() == 1
    bank.release()


# --------------------------------------------------------------------------------------------------- expert kernels
def _glu(g, u, activation, alpha=1.702, limit=7.0):
    if activation == "silu":
        return g / (1.0 + np.exp(-g)) * u
    if activation == "swiglu_oai":  # transformers' GptOssExperts._apply_gate
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3))) * u


def _experts_reference(x, ids, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None,
                       bf16_activations=False, **params):
    """float64 y[t] = sum_j w[t,j] * (down[e] @ glu(gate[e] @ x[t] + bg[e], up[e] @ x[t] + bu[e]) + bd[e]) over
    ids[t,j] >= 0 (biases 0 when None); with bf16_activations the glu output is rounded to bf16 first (what the
    kernels do for bf16 x, as transformers' bf16 experts do)."""
    x = np.asarray(x, np.float64)
    inter = gate_up.shape[1] // 2
    rows = gate_up.shape[0]
    bgu = np.zeros((rows, 2 * inter)) if gate_up_bias is None else gate_up_bias.astype(np.float64)
    bd = np.zeros((rows, x.shape[1])) if down_bias is None else down_bias.astype(np.float64)
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if e < 0:
                continue
            g = gate_up[e, :inter].astype(np.float64) @ x[t] + bgu[e, :inter]
            u = gate_up[e, inter:].astype(np.float64) @ x[t] + bgu[e, inter:]
            a = _glu(g, u, activation, **params)
            if bf16_activations:
                a = a.astype(np.float32).astype(BF16).astype(np.float64)
            y[t] += weights[t, j] * (down[e].astype(np.float64) @ a + bd[e])
    return y


def _expert_case(rng, T, k, num_experts, hidden, inter):
    gate_up = (rng.standard_normal((num_experts, 2 * inter, hidden)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((num_experts, hidden, inter)) / np.sqrt(inter)).astype(np.float32)
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    ids = np.stack([rng.permutation(num_experts)[:k] for _ in range(T)]).astype(np.int32)
    ids[rng.random((T, k)) < 0.25] = -1
    weights = rng.random((T, k)).astype(np.float32)
    return x, ids, weights, gate_up, down


def _rel_err(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-30)


F32_EPS = 2.0**-24  # unit roundoff of float32


def _f32_sum_bound(*lengths):
    """Relative error bound of float32 dot products of these lengths in sequence (the standard gamma_n = n * u bound
    per dot, summed over the chained products): what the kernels' float32 accumulation may add to an exactly
    rounded reference. For H = 46, I = 37 it is 4.9e-6; a bf16 rounding the reference does not mirror costs ~1e-3."""
    return sum(lengths) * F32_EPS


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("wdtype", [np.dtype(np.float32), BF16], ids=["f32", "bf16"])
def test_host_and_slot_experts_match_float64_reference(T, k, wdtype):
    rng = np.random.default_rng(100 * T + 10 * k + (wdtype == BF16))
    # H and I odd-sized: exercises the vector loop tails and the single-row paths.
    x, ids, weights, gate_up, down = _expert_case(rng, T, k, num_experts=6, hidden=46, inter=37)
    # The reference reads the weights as the bank stores them (bf16-rounded for bf16); x is float32, so the kernel
    # rounds no activation (it does for bf16 x only) and only its float32 accumulation differs from float64.
    as_stored = lambda a: a.astype(wdtype).astype(np.float32)  # noqa: E731
    expected = _experts_reference(x, ids, weights, as_stored(gate_up), as_stored(down), "silu")
    tol = _f32_sum_bound(46, 37)
    gu_bank = HostBank.from_numpy(gate_up, dtype=wdtype)
    dn_bank = HostBank.from_numpy(down, dtype=wdtype)
    host = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gu_bank, dn_bank))
    y = np.asarray(host(x, ids, weights))
    assert y.shape == (T, 46) and y.dtype == np.float32
    assert _rel_err(y, expected) < tol
    # slot_experts: the same kernel over slot arrays. Slots in expert order: bit-identical to host_experts.
    same_order = jax.jit(ffi_ops.slot_experts)(x, ids, weights, jnp.asarray(gate_up.astype(wdtype)),
                                               jnp.asarray(down.astype(wdtype)))
    np.testing.assert_array_equal(np.asarray(same_order), y)
    # Permuted slots (slot s holds expert perm[s]): experts are accumulated in slot order, so compare to reference.
    perm = rng.permutation(6)
    slot_of = np.argsort(perm).astype(np.int32)
    slot_ids = np.where(ids >= 0, slot_of[np.maximum(ids, 0)], -1).astype(np.int32)
    gu_slots = jnp.asarray(gate_up[perm].astype(wdtype))
    dn_slots = jnp.asarray(down[perm].astype(wdtype))
    y_slots = np.asarray(jax.jit(ffi_ops.slot_experts)(x, slot_ids, weights, gu_slots, dn_slots))
    assert _rel_err(y_slots, expected) < tol
    gu_bank.release()
    dn_bank.release()


def _rows_at_their_own_offsets(rows: np.ndarray, dtype) -> HostBank:
    """A bank of ``rows`` [R, ...] whose rows 0-1 follow each other and every later row starts at its own residue
    modulo 2 MiB (as the loader places a mapped checkpoint's layers): not uniform."""
    rb = math.prod(rows.shape[1:]) * np.dtype(dtype).itemsize
    offsets = [0, rb] + [4096 * (3 + 5 * r) + 64 * r for r in range(2, rows.shape[0])]
    bank = HostBank(rows.shape[0], rows.shape[1:], dtype, page_offset=offsets)
    assert not bank.uniform
    for r, row in enumerate(rows):
        bank.write_row(r, row)
    return bank


@pytest.mark.parametrize("wdtype", [np.dtype(np.float32), BF16], ids=["f32", "bf16"])
def test_host_experts_and_slot_fill_read_rows_placed_at_their_own_offsets(wdtype):
    """Banks whose rows are not at one stride (Bank::row_offsets) give host_experts and slot_fill the same bytes
    as uniform banks of the same rows: the outputs are identical."""
    rng = np.random.default_rng(7)
    x, ids, weights, gate_up, down = _expert_case(rng, 5, 2, num_experts=6, hidden=46, inter=37)
    uniform = [HostBank.from_numpy(gate_up, dtype=wdtype), HostBank.from_numpy(down, dtype=wdtype)]
    placed = [_rows_at_their_own_offsets(gate_up, wdtype), _rows_at_their_own_offsets(down, wdtype)]
    y_uniform = np.asarray(ffi_ops.host_experts(x, ids, weights, *uniform))
    y_placed = np.asarray(jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, *placed))(x, ids, weights))
    np.testing.assert_array_equal(y_placed, y_uniform)
    pools = (jnp.zeros((3, 74, 46), wdtype), jnp.zeros((3, 46, 37), wdtype))
    flat, slots = np.array([5, 0, 3], np.int32), np.array([0, 1, 2], np.int32)
    got = ffi_ops.slot_fill(pools, flat, slots, placed)
    np.testing.assert_array_equal(np.asarray(got[0]), gate_up[[5, 0, 3]].astype(wdtype))
    np.testing.assert_array_equal(np.asarray(got[1]), down[[5, 0, 3]].astype(wdtype))
    for bank in uniform + placed:
        bank.release()


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("wdtype", [np.dtype(np.float32), BF16], ids=["f32", "bf16"])
def test_biases_and_clamped_swiglu_match_float64_reference(T, wdtype):
    """gpt-oss experts: gate_up / down biases and the clamped SwiGLU (alpha, limit as attributes) in host_experts and
    slot_experts (bias pools), against float64 numpy. The inputs are scaled so that gate and up projections cross
    the clamp (|g|, |u| > limit) on both sides; biases with silu too (the kernel's bias path is per activation)."""
    rng = np.random.default_rng(40 + T + (wdtype == BF16))
    E, H, I, k = 6, 46, 37, 3
    x, ids, weights, gate_up, down = _expert_case(rng, T, k, num_experts=E, hidden=H, inter=I)
    x *= 6.0
    gu_bias = rng.standard_normal((E, 2 * I)).astype(np.float32)
    dn_bias = rng.standard_normal((E, H)).astype(np.float32)
    ids[0, 0] = 2  # at least one route
    gu_bank, dn_bank = HostBank.from_numpy(gate_up, dtype=wdtype), HostBank.from_numpy(down, dtype=wdtype)
    gb_bank, db_bank = HostBank.from_numpy(gu_bias, dtype=wdtype), HostBank.from_numpy(dn_bias, dtype=wdtype)
    as_stored = lambda a: a.astype(wdtype).astype(np.float32)  # noqa: E731  (the bank's rounding)
    for activation, params in (("swiglu_oai", dict(alpha=1.702, limit=7.0)), ("swiglu_oai", dict(alpha=0.9, limit=2.5)),
                               ("silu", {})):
        expected = _experts_reference(x, ids, weights, as_stored(gate_up), as_stored(down), activation,
                                      as_stored(gu_bias), as_stored(dn_bias), **params)
        if activation == "swiglu_oai":  # the clamp is exercised: some pre-activations lie beyond the limit
            pre = np.einsum("eih,th->tei", as_stored(gate_up).astype(np.float64), x) + as_stored(gu_bias)[None]
            assert (pre[..., :I] > params["limit"]).any() and (pre[..., I:] < -params["limit"]).any()
        host = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gu_bank, dn_bank, activation,
                                                            gate_up_bias=gb_bank, down_bias=db_bank, **params))
        y = np.asarray(host(x, ids, weights))
        assert _rel_err(y, expected) < 1e-5
        perm = rng.permutation(E)  # slot s holds expert perm[s]
        slot_of = np.argsort(perm).astype(np.int32)
        slot_ids = np.where(ids >= 0, slot_of[np.maximum(ids, 0)], -1).astype(np.int32)
        pools = [jnp.asarray(a[perm].astype(wdtype)) for a in (gate_up, down, gu_bias, dn_bias)]
        y_slots = jax.jit(lambda x, i, w, gu, dn, gb, db: ffi_ops.slot_experts(
            x, i, w, gu, dn, activation, gate_up_bias_slots=gb, down_bias_slots=db, **params))(
            x, slot_ids, weights, *pools)
        assert _rel_err(y_slots, expected) < 1e-5
    # Without the bias banks the same call is the bias-free expert (the biases really were applied above).
    y_plain = np.asarray(ffi_ops.host_experts(x, ids, weights, gu_bank, dn_bank, "swiglu_oai"))
    plain = _experts_reference(x, ids, weights, as_stored(gate_up), as_stored(down), "swiglu_oai")
    assert _rel_err(y_plain, plain) < 1e-5 and _rel_err(y_plain, expected) > 1e-2
    for bank in (gu_bank, dn_bank, gb_bank, db_bank):
        bank.release()


def test_bias_inputs_are_checked():
    gu_bank, dn_bank = HostBank(4, (8, 8), np.float32), HostBank(4, (8, 4), np.float32)
    gb_bank, db_bank = HostBank(4, (8,), np.float32), HostBank(4, (8,), np.float32)
    x, ids, w = np.ones((2, 8), np.float32), np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32)
    with pytest.raises(ValueError, match="host_experts: pass both bias banks"):
        ffi_ops.host_experts(x, ids, w, gu_bank, dn_bank, gate_up_bias=gb_bank)
    with pytest.raises(ValueError, match=r"gate_up_bias bank .* must hold 4 rows \[2I\] = \[8\]"):
        ffi_ops.host_experts(x, ids, w, gu_bank, dn_bank, gate_up_bias=dn_bank, down_bias=db_bank)
    with pytest.raises(ValueError, match="host_experts: limit must be > 0, got 0"):
        ffi_ops.host_experts(x, ids, w, gu_bank, dn_bank, "swiglu_oai", limit=0.0)
    with pytest.raises(ValueError, match="slot_experts: alpha must be a finite number, got nan"):
        ffi_ops.slot_experts(x, ids, w, jnp.zeros((3, 8, 8)), jnp.zeros((3, 8, 4)), alpha=float("nan"))
    with pytest.raises(ValueError, match=r"bias pools must be \[S, 2I\] = \(3, 8\) and \[S, H\] = \(3, 8\), got "
                                         r"\(3, 8\) and \(2, 8\)"):
        ffi_ops.slot_experts(x, ids, w, jnp.zeros((3, 8, 8)), jnp.zeros((3, 8, 4)),
                             gate_up_bias_slots=jnp.zeros((3, 8)), down_bias_slots=jnp.zeros((2, 8)))
    # The handler repeats the checks when the wrapper is bypassed (a bias pool of the wrong width).
    call = jax.ffi.ffi_call("ft_jax_slot_experts", jax.ShapeDtypeStruct((2, 8), jnp.float32))
    with pytest.raises(RUNTIME_ERRORS, match=r"slot_experts: gate_up bias pool \[3, 5\] must have 3 rows \[2I\]"):
        np.asarray(call(x, ids, w, jnp.zeros((3, 8, 8)), jnp.zeros((3, 8, 4)), jnp.zeros((3, 5)), jnp.zeros((3, 8)),
                        activation="swiglu_oai", alpha=np.float32(1.702), limit=np.float32(7.0),
                        weight_format="float", block_rows=np.int64(1), block_cols=np.int64(1)))
    for bank in (gu_bank, dn_bank, gb_bank, db_bank):
        bank.release()


def test_skipped_routes_contribute_nothing():
    rng = np.random.default_rng(5)
    x, ids, weights, gate_up, down = _expert_case(rng, 4, 2, num_experts=5, hidden=16, inter=8)
    ids[:, 1] = -1
    weights[:, 1] = 1e6  # would dominate if the skipped routes were computed
    gu_bank, dn_bank = HostBank.from_numpy(gate_up), HostBank.from_numpy(down)
    y = np.asarray(ffi_ops.host_experts(x, ids, weights, gu_bank, dn_bank))
    y_first = np.asarray(ffi_ops.host_experts(x, ids[:, :1].copy(), weights[:, :1].copy(), gu_bank, dn_bank))
    np.testing.assert_array_equal(y, y_first)
    all_skipped = np.asarray(ffi_ops.host_experts(x, np.full((4, 2), -1, np.int32), weights, gu_bank, dn_bank))
    np.testing.assert_array_equal(all_skipped, np.zeros((4, 16), np.float32))
    gu_bank.release()
    dn_bank.release()


_SUBPROCESS_SCRIPT = """
import sys, numpy as np, jax.numpy as jnp
import ml_dtypes
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
x, ids, w, gu, dn, gb, db, out = sys.argv[1:9]
banks = HostBank.from_numpy(np.load(gu)), HostBank.from_numpy(np.load(dn))
biases = dict(gate_up_bias=HostBank.from_numpy(np.load(gb)), down_bias=HostBank.from_numpy(np.load(db))) \\
    if sys.argv[9] == "swiglu_oai" else {}
xb = jnp.asarray(np.load(x).astype(ml_dtypes.bfloat16))
y = ffi_ops.host_experts(xb, np.load(ids), np.load(w), *banks, activation=sys.argv[9], **biases)
lin = ffi_ops.linear(xb, jnp.asarray(np.load(gu)), 2)
np.save(out, np.concatenate([np.asarray(y).ravel(), np.asarray(lin).ravel()]))
"""


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_large_experts_multithreaded_bf16_x_and_every_activation(activation, tmp_path):
    """Experts and a dense projection above the threading threshold (1 MiB per call), bf16 activations, many routes
    per expert (swiglu_oai with bias banks): within tolerance of float64 and bit-identical with the kernel helpers
    (this process), on one thread (a subprocess with FT_JAX_NUM_THREADS=1) and with helpers that sleep after each
    call (FT_JAX_HELPER_SPIN_US=0); the portable loops (a subprocess with FT_JAX_KERNEL=generic) within tolerance
    too."""
    rng = np.random.default_rng(6)
    x, ids, weights, gate_up, down = _expert_case(rng, 5, 2, num_experts=4, hidden=256, inter=600)
    ids[:, 0] = 0  # five routes to expert 0 (4-token inner loop + remainder); may repeat an id within a token
    gu_bias = rng.standard_normal((4, 1200)).astype(np.float32)
    dn_bias = rng.standard_normal((4, 256)).astype(np.float32)
    x_bf16 = x.astype(BF16)
    with_bias = activation == "swiglu_oai"
    expected = _experts_reference(x_bf16.astype(np.float32), ids, weights, gate_up, down, activation,
                                  *((gu_bias, dn_bias) if with_bias else ()), bf16_activations=True)
    expected_lin = x_bf16.astype(np.float64) @ gate_up[2].astype(np.float64).T
    gu_bank, dn_bank = HostBank.from_numpy(gate_up), HostBank.from_numpy(down)
    biases = dict(gate_up_bias=HostBank.from_numpy(gu_bias), down_bias=HostBank.from_numpy(dn_bias)) \
        if with_bias else {}
    run = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gu_bank, dn_bank, activation=activation, **biases))
    y = np.asarray(run(jnp.asarray(x_bf16), ids, weights))
    np.testing.assert_array_equal(y, np.asarray(run(jnp.asarray(x_bf16), ids, weights)))
    lin = np.asarray(ffi_ops.linear(jnp.asarray(x_bf16), jnp.asarray(gate_up), 2))
    assert _rel_err(y, expected) < 1e-4 and _rel_err(lin, expected_lin) < 1e-5
    names = ("x", "ids", "w", "gu", "dn", "gb", "db")
    paths = {n: str(tmp_path / f"{n}.npy") for n in (*names, "out")}
    for n, a in zip(names, (x, ids, weights, gate_up, down, gu_bias, dn_bias)):
        np.save(paths[n], a)

    def in_subprocess(**env):
        subprocess.run([sys.executable, "-c", _SUBPROCESS_SCRIPT, *(paths[n] for n in (*names, "out")), activation],
                       check=True, env=dict(os.environ, **env))
        got = np.load(paths["out"])
        return got[:y.size].reshape(y.shape), got[y.size:].reshape(lin.shape)

    for env in (dict(FT_JAX_NUM_THREADS="1"), dict(FT_JAX_HELPER_SPIN_US="0")):  # one thread; helpers that sleep
        np.testing.assert_array_equal(np.concatenate([a.ravel() for a in in_subprocess(**env)]),
                                      np.concatenate([y.ravel(), lin.ravel()]))
    y_generic, lin_generic = in_subprocess(FT_JAX_KERNEL="generic")
    assert _rel_err(y_generic, expected) < 1e-4 and _rel_err(lin_generic, expected_lin) < 1e-5
    for bank in (gu_bank, dn_bank, *biases.values()):
        bank.release()


@pytest.mark.parametrize("N", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("wdtype", [np.dtype(np.float32), BF16], ids=["f32", "bf16"])
def test_linear_matches_float64_reference(N, wdtype):
    """y = x @ w[layer].T over a stack of 3 weights, odd sizes (vector-loop tails, single-row remainders), every
    layer index, f32 and bf16 weights and activations."""
    rng = np.random.default_rng(10 * N + (wdtype == BF16))
    w = (rng.standard_normal((3, 13, 45)) / 7).astype(np.float32).astype(wdtype)
    x = rng.standard_normal((N, 45)).astype(np.float32).astype(wdtype)
    f = jax.jit(ffi_ops.linear)
    for layer in range(3):
        y = np.asarray(f(jnp.asarray(x), jnp.asarray(w), layer))
        assert y.shape == (N, 13) and y.dtype == np.float32
        assert _rel_err(y, x.astype(np.float64) @ w[layer].astype(np.float64).T) < 1e-6
    single = np.asarray(ffi_ops.linear(jnp.asarray(x), jnp.asarray(w[1])))  # an [O, K] weight: L = 1
    np.testing.assert_array_equal(single, np.asarray(f(jnp.asarray(x), jnp.asarray(w), 1)))


def test_linear_reads_a_scanned_stack_in_place():
    """Under lax.scan with the layer index traced, each step reads its weight of the stack: no dynamic-slice copy
    of the stacked weight in the optimized HLO, and the result equals the unrolled numpy product."""
    rng = np.random.default_rng(11)
    w = jnp.asarray((rng.standard_normal((4, 32, 32)) / 6).astype(np.float32).astype(BF16))
    x0 = rng.standard_normal((1, 32)).astype(np.float32)

    def run(x, w):
        return jax.lax.scan(lambda h, l: (ffi_ops.linear(h, w, l), None), x, jnp.arange(4, dtype=jnp.int32))[0]

    hlo = jax.jit(run).lower(x0, w).compile().as_text()
    assert "ft_jax_linear" in hlo
    assert not re.search(r"= (bf16|f32)\[(1,)?32,32\]\{[^}]*\} (dynamic-slice|copy|convert)\(", hlo)
    ref = x0.astype(np.float64)
    for l in range(4):
        ref = ref @ np.asarray(w[l], np.float64).T
    assert _rel_err(np.asarray(jax.jit(run)(x0, w)), ref) < 1e-5
    with pytest.raises(RUNTIME_ERRORS, match="linear: layer 4 is out of range for a stack of 4 weights"):
        np.asarray(jax.jit(ffi_ops.linear)(x0, w, 4))
    with pytest.raises(ValueError, match=r"disagree on K"):
        ffi_ops.linear(x0[:, :16], w, 0)


# ------------------------------------------------------------------------------------------------------ bad inputs
@pytest.fixture
def f32_banks():
    rng = np.random.default_rng(7)
    _, _, _, gate_up, down = _expert_case(rng, 1, 1, num_experts=4, hidden=8, inter=4)
    banks = HostBank.from_numpy(gate_up), HostBank.from_numpy(down)
    yield banks
    for b in banks:
        if b.alive:
            b.release()


def _valid_call_still_works(gu_bank, dn_bank):
    x = np.ones((1, 8), np.float32)
    y = np.asarray(ffi_ops.host_experts(x, np.array([[1]], np.int32), np.ones((1, 1), np.float32), gu_bank, dn_bank))
    expected = _experts_reference(x, np.array([[1]]), np.ones((1, 1)), gu_bank.numpy(), dn_bank.numpy(), "silu")
    assert _rel_err(y, expected) < 1e-5


def test_out_of_range_ids_raise_runtime_errors_naming_them(f32_banks):
    gu_bank, dn_bank = f32_banks
    slots = jnp.zeros((2, 8, 8), jnp.float32)
    with pytest.raises(RUNTIME_ERRORS, match=rf"entry 1: flat id 99 / slot id 1 out of range for bank {gu_bank.id}"):
        np.asarray(fill_one(slots, jnp.array([0, 99], jnp.int32), jnp.array([0, 1], jnp.int32), gu_bank))
    with pytest.raises(RUNTIME_ERRORS, match=r"entry 0: flat id 0 / slot id 2 out of range for .* and 2 slots"):
        np.asarray(fill_one(slots, jnp.array([0], jnp.int32), jnp.array([2], jnp.int32), gu_bank))
    x, w = np.ones((1, 8), np.float32), np.ones((1, 2), np.float32)
    with pytest.raises(RUNTIME_ERRORS, match=rf"host_experts: flat id 4 at position 1 is out of range for bank {gu_bank.id}"):
        np.asarray(ffi_ops.host_experts(x, np.array([[0, 4]], np.int32), w, gu_bank, dn_bank))
    gu_slots, dn_slots = jnp.zeros((3, 8, 8), jnp.float32), jnp.zeros((3, 8, 4), jnp.float32)
    with pytest.raises(RUNTIME_ERRORS, match="slot_experts: slot id 3 at position 0 is out of range"):
        np.asarray(ffi_ops.slot_experts(x, np.array([[3, 0]], np.int32), w, gu_slots, dn_slots))
    _valid_call_still_works(gu_bank, dn_bank)


def test_wrong_dtypes_and_shapes_raise_at_trace_time(f32_banks):
    gu_bank, dn_bank = f32_banks
    i32 = jnp.array([0], jnp.int32)
    with pytest.raises(TypeError, match=rf"pools\[0\] dtype bfloat16 does not match bank {gu_bank.id} dtype float32"):
        fill_one(jnp.zeros((2, 8, 8), jnp.bfloat16), i32, i32, gu_bank)
    with pytest.raises(ValueError, match=r"row_shape \(8, 8\) .*got shape \(2, 8, 4\)"):
        fill_one(jnp.zeros((2, 8, 4), jnp.float32), i32, i32, gu_bank)
    with pytest.raises(TypeError, match="flat_ids .* must be int32, got int64"):
        fill_one(jnp.zeros((2, 8, 8), jnp.float32), np.array([0]), i32, gu_bank)
    with pytest.raises(ValueError, match="flat_ids has 1 entries but slot_ids has 2"):
        fill_one(jnp.zeros((2, 8, 8), jnp.float32), i32, jnp.array([0, 1], jnp.int32), gu_bank)
    x, ids, w = np.ones((2, 8), np.float32), np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32)
    with pytest.raises(TypeError, match="weights .* must be float32, got float64"):
        ffi_ops.host_experts(x, ids, w.astype(np.float64), gu_bank, dn_bank)
    with pytest.raises(TypeError, match="x .* must be float32 or bfloat16, got int32"):
        ffi_ops.host_experts(x.astype(np.int32), ids, w, gu_bank, dn_bank)
    with pytest.raises(ValueError, match="must have rows \\[2I, H\\] with H = 6"):
        ffi_ops.host_experts(np.ones((2, 6), np.float32), ids, w, gu_bank, dn_bank)
    with pytest.raises(ValueError, match="down bank .* must have rows \\[H, I\\] = \\(8, 4\\)"):
        ffi_ops.host_experts(x, ids, w, gu_bank, gu_bank)
    with pytest.raises(ValueError, match="must both be \\[T, k\\]"):
        ffi_ops.host_experts(x, np.zeros((3, 1), np.int32), w, gu_bank, dn_bank)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        ffi_ops.host_experts(x, ids, w, gu_bank, dn_bank, activation="relu")
    with pytest.raises(ValueError, match=r"down_slots must be \[S, H, I\] = \(3, 8, 4\), got \(3, 8, 5\)"):
        ffi_ops.slot_experts(x, ids, w, jnp.zeros((3, 8, 8)), jnp.zeros((3, 8, 5)))
    _valid_call_still_works(gu_bank, dn_bank)


def test_handler_checks_catch_what_bypasses_the_wrappers(f32_banks):
    """Calling the FFI target directly with a mismatched slot dtype / row shape gives a runtime error naming it."""
    gu_bank, _ = f32_banks
    i32 = jnp.array([0], jnp.int32)
    for slots, message in [
        (jnp.zeros((2, 8, 8), jnp.bfloat16), rf"pool 0 \[2, 8, 8\] bfloat16 does not hold rows of bank {gu_bank.id} "
                                             r"\(\[4, 8, 8\] float32\)"),
        (jnp.zeros((2, 8, 4), jnp.float32), r"pool 0 \[2, 8, 4\] float32 does not hold rows of bank"),
    ]:
        call = jax.ffi.ffi_call("ft_jax_slot_fill", (jax.ShapeDtypeStruct(slots.shape, slots.dtype),),
                                input_output_aliases={2: 0})
        with pytest.raises(RUNTIME_ERRORS, match=message):
            np.asarray(call(i32, i32, slots, banks=np.array([gu_bank.id], np.int64))[0])


def test_slot_fill_refuses_pools_not_aliased_to_their_results(f32_banks):
    """The handler writes only the N rows, so a pool that is not its result's buffer (an ffi_call without
    input_output_aliases) is an FFI error naming the pool, also for a call whose ids are all padding."""
    gu_bank, _ = f32_banks
    slots = jnp.zeros((2, 8, 8), jnp.float32)
    call = jax.ffi.ffi_call("ft_jax_slot_fill", (jax.ShapeDtypeStruct(slots.shape, slots.dtype),))
    for ids in (jnp.array([1], jnp.int32), jnp.array([-1], jnp.int32)):
        with pytest.raises(RUNTIME_ERRORS, match=r"slot_fill: pool 0 is not aliased to result 0 \(call it with "
                                                 r"input_output_aliases \{2: 0\}\)"):
            np.asarray(call(ids, ids, slots, banks=np.array([gu_bank.id], np.int64))[0])
    out = np.asarray(fill_one(slots, jnp.array([1], jnp.int32), jnp.array([0], jnp.int32), gu_bank))
    np.testing.assert_array_equal(out[0], gu_bank.numpy()[1])  # the aliased call still works


def test_host_experts_bank_layout_checked_at_instantiate(f32_banks):
    """Bypassing the wrapper's trace-time checks, mismatched banks are refused once, when the executable binds them
    (the instantiate stage), with an error naming the bank, what it must hold and what it holds."""
    gu_bank, _ = f32_banks
    call = jax.ffi.ffi_call("ft_jax_host_experts", jax.ShapeDtypeStruct((1, 8), jnp.float32))
    x, ids, w = np.ones((1, 8), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32)
    with pytest.raises(RUNTIME_ERRORS, match=rf"host_experts: down bank {gu_bank.id} \(\[4, 8, 8\] float32\) must "
                                             r"have 4 rows \[H, I\] = \[8, 4\] to match gate_up bank"):
        np.asarray(call(x, ids, w, banks=np.array([gu_bank.id, gu_bank.id], np.int64),
                        scale_banks=np.array([], np.int64), weight_format="float", block_rows=np.int64(1),
                        block_cols=np.int64(1), activation="silu", alpha=np.float32(1.702), limit=np.float32(7.0)))


_THROWING_TASK_SCRIPT = """
import numpy as np, jax
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
rng = np.random.default_rng(0)
E, H, I = 4, 256, 600  # 1.8 MiB of f32 weights per expert: the kernel runs its tasks on XLA's thread pool
banks = (HostBank.from_numpy(rng.standard_normal((E, 2 * I, H)).astype(np.float32)),
         HostBank.from_numpy(rng.standard_normal((E, H, I)).astype(np.float32)))
x, w = rng.standard_normal((4, H)).astype(np.float32), np.ones((4, 2), np.float32)
ids = np.array([[0, 1], [2, 3], [1, 9], [0, 2]], np.int32)  # id 9 (position 5) is found by the task reading it
for name, run in (("host", lambda: ffi_ops.host_experts(x, ids, w, *banks)),
                  ("slot", lambda: ffi_ops.slot_experts(x, ids, w, *(b.numpy() for b in banks)))):
    try:
        np.asarray(run())
        print(name, "no error")
    except (jax.errors.JaxRuntimeError, ValueError) as e:
        print(name, str(e).splitlines()[0])
ids[2, 1] = 3
print("after", bool(np.isfinite(np.asarray(ffi_ops.host_experts(x, ids, w, *banks))).all()))
"""


def test_an_error_inside_a_parallel_task_is_an_ffi_error_not_a_hang():
    """An out-of-range expert id is detected by the kernel task that would read the expert, on XLA's thread pool
    (the call is above the 1 MiB threading threshold): ParallelFor finishes the other tasks and the caller gets an
    FFI error naming the id, the position and the weights; the process keeps working. In a subprocess with a
    timeout, so a regression (the caller waiting forever) fails instead of hanging the suite."""
    result = subprocess.run([sys.executable, "-c", _THROWING_TASK_SCRIPT], capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, FT_JAX_NUM_THREADS="2"))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert re.search(r"^host .*host_experts: flat id 9 at position 5 is out of range for bank \d+ \(\[4, 1200, 256\] "
                     r"float32\) \(expected -1 or 0\.\.3\)", lines[0]), lines
    assert re.search(r"^slot .*slot_experts: slot id 9 at position 5 is out of range for the slot pool of 4 slots",
                     lines[1]), lines
    assert lines[2] == "after True"


def test_released_bank_trace_time_and_compiled_step(f32_banks):
    gu_bank, dn_bank = f32_banks
    slots = jnp.zeros((2, 8, 8), jnp.float32)
    ids = jnp.array([1], jnp.int32), jnp.array([0], jnp.int32)
    fill = jax.jit(lambda s, f, i: fill_one(s, f, i, gu_bank))
    np.asarray(fill(slots, *ids))  # compiled while the bank is live
    gu_bank.release()
    with pytest.raises(ValueError, match=rf"slot_fill: banks\[0\] {gu_bank.id} \(\[4, 8, 8\] float32\) was released"):
        fill_one(slots, *ids, gu_bank)
    with pytest.raises(RUNTIME_ERRORS, match=f"slot_fill: bank {gu_bank.id} was released"):
        np.asarray(fill(slots, *ids))
    with pytest.raises(ValueError, match="gate_up bank .* was released"):
        ffi_ops.host_experts(np.ones((1, 8), np.float32), np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32), gu_bank, dn_bank)
    # The process keeps working with a fresh bank.
    fresh = HostBank.from_numpy(np.arange(2 * 8 * 8, dtype=np.float32).reshape(2, 8, 8))
    out = np.asarray(jax.jit(lambda s, f, i: fill_one(s, f, i, fresh))(slots, *ids))
    np.testing.assert_array_equal(out[0], fresh.numpy()[1])
    fresh.release()


def test_results_do_not_depend_on_the_other_tokens_of_a_call():
    """A token's expert output and dense projection are bit-identical whether it is computed alone or with other
    tokens routed to the same experts (batch invariance: outputs never depend on how routes are grouped, so the
    slot/host split and the batch composition cannot change them)."""
    rng = np.random.default_rng(12)
    x, ids, weights, gate_up, down = _expert_case(rng, 6, 2, num_experts=3, hidden=200, inter=152)
    ids[:] = np.array([0, 1], np.int32)  # every token on experts 0 and 1
    gu_bank, dn_bank = HostBank.from_numpy(gate_up), HostBank.from_numpy(down)
    together = np.asarray(ffi_ops.host_experts(x, ids, weights, gu_bank, dn_bank))
    for t in range(6):
        alone = np.asarray(ffi_ops.host_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], gu_bank, dn_bank))
        np.testing.assert_array_equal(alone[0], together[t])
    w = jnp.asarray(gate_up[0])
    rows = np.asarray(ffi_ops.linear(jnp.asarray(x), w))
    for t in range(6):
        np.testing.assert_array_equal(np.asarray(ffi_ops.linear(jnp.asarray(x[t:t + 1]), w))[0], rows[t])
    gu_bank.release()
    dn_bank.release()


@pytest.mark.parametrize("kernel", ["auto", "avx2", "generic"])
def test_bf16_weights_and_activations_on_every_kernel_path(kernel, tmp_path):
    """bf16 weights with bf16 activations (a bf16 model): the AVX-512 BF16 dots where the CPU has them, AVX2, and the
    portable loops (FT_JAX_KERNEL caps the path, in a subprocess) all within bf16 tolerance of the float64 reference
    with bf16-rounded activations; the path actually taken is reported by kernel_isa()."""
    rng = np.random.default_rng(13)
    x, ids, weights, gate_up, down = _expert_case(rng, 3, 2, num_experts=3, hidden=320, inter=96)
    x, gate_up, down = x.astype(BF16), gate_up.astype(BF16), down.astype(BF16)
    expected = _experts_reference(x.astype(np.float32), ids, weights, gate_up.astype(np.float32),
                                  down.astype(np.float32), "silu", bf16_activations=True)
    expected_lin = x.astype(np.float64) @ gate_up[1].astype(np.float64).T
    arrays = dict(x=x.view(np.uint16), ids=ids, w=weights, gu=gate_up.view(np.uint16), dn=down.view(np.uint16))
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)  # bf16 as its uint16 bits (np.save has no bf16)
    script = """
import sys, numpy as np, jax.numpy as jnp, ml_dtypes
from ft_jax import _ffi
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
d = sys.argv[1]
load = lambda n: (lambda a: a.view(ml_dtypes.bfloat16) if a.dtype == np.uint16 else a)(np.load(f"{d}/{n}.npy"))
banks = HostBank.from_numpy(load("gu")), HostBank.from_numpy(load("dn"))
x = jnp.asarray(load("x"))
y = ffi_ops.host_experts(x, load("ids"), load("w"), *banks)
lin = ffi_ops.linear(x, jnp.asarray(load("gu")), 1)
np.save(f"{d}/y.npy", np.asarray(y)); np.save(f"{d}/lin.npy", np.asarray(lin)); print(_ffi.kernel_isa())
"""
    env = dict(os.environ, **({} if kernel == "auto" else {"FT_JAX_KERNEL": kernel}))
    isa = subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, env=env, capture_output=True,
                         text=True).stdout.strip()
    assert isa == (_ffi.kernel_isa() if kernel == "auto" else
                   kernel if kernel == "generic" or _ffi.kernel_isa() != "generic" else "generic")
    # expected rounds the activations to bf16 as the kernels do, so what is left is float32 accumulation over the
    # H + I = 416 products of a route (gate/up, then down): (H + I) * 2^-24 = 2.5e-5 (measured 7e-8 to 9e-8); a
    # kernel that skipped the bf16 rounding of the activations scores 1.6e-3.
    assert _rel_err(np.load(tmp_path / "y.npy"), expected) < _f32_sum_bound(320, 96)
    assert _rel_err(np.load(tmp_path / "lin.npy"), expected_lin) < 1e-5


def test_calls_above_the_scratch_bound_stay_exact():
    """A prefill-sized call needs more kernel scratch than a thread keeps between calls (common.h
    kScratchKeepBytes = 16 MiB: routes * (2H + 3I) floats = 2048 * 2312 * 4 B = 18.9 MB here), so its scratch goes
    back to the process's one spare after the call, and the next large call reuses that spare with the previous
    call's values still in it. f32 x: within float32 accumulation of the float64 reference; bf16 x (the widened copy
    and the bf16 buffers too): bit-identical to the same tokens computed in calls of 128 (scratch under the bound),
    before and after, and a second large call equal to the first, so growing, handing back and reusing the scratch
    changes nothing."""
    rng = np.random.default_rng(21)
    x, ids, weights, gate_up, down = _expert_case(rng, 1024, 2, num_experts=4, hidden=256, inter=600)
    ids[ids < 0] = 1
    assert 2048 * (2 * 256 + 3 * 600) * 4 > 16 << 20
    gu_bank, dn_bank = HostBank.from_numpy(gate_up), HostBank.from_numpy(down)
    run = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gu_bank, dn_bank))
    expected = _experts_reference(x, ids, weights, gate_up, down, "silu")
    assert _rel_err(np.asarray(run(x, ids, weights)), expected) < _f32_sum_bound(256, 600)
    x_bf16 = jnp.asarray(x.astype(BF16))
    chunks = lambda: np.concatenate([np.asarray(run(x_bf16[t:t + 128], ids[t:t + 128], weights[t:t + 128]))  # noqa: E731
                                     for t in range(0, 1024, 128)])
    before = chunks()
    large = np.asarray(run(x_bf16, ids, weights))
    np.testing.assert_array_equal(large, before)
    np.testing.assert_array_equal(chunks(), before)
    np.testing.assert_array_equal(np.asarray(run(x_bf16, ids, weights)), large)
    gu_bank.release()
    dn_bank.release()


def test_concurrent_kernel_calls_from_several_threads_equal_one_call():
    """Four Python threads call a multithreaded dense projection and expert call at once, 25 times each: the kernel
    helpers take one offered job at a time and a later offer replaces one not yet taken (xla_ffi/kernel_helpers.h),
    so a caller may run its tasks alone; every result must still equal the single call's, bit for bit."""
    import threading

    rng = np.random.default_rng(12)
    x, ids, weights, gate_up, down = _expert_case(rng, 2, 2, num_experts=4, hidden=256, inter=600)
    gu_bank, dn_bank = HostBank.from_numpy(gate_up), HostBank.from_numpy(down)
    experts = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gu_bank, dn_bank))
    linear = jax.jit(lambda x, w: ffi_ops.linear(x, w, 1))
    w = jnp.asarray(gate_up)  # 4.9 MB: above the one-thread threshold
    want = (np.asarray(experts(x, ids, weights)), np.asarray(linear(x, w)))
    failures = []

    def hammer():
        for _ in range(25):
            got = (np.asarray(experts(x, ids, weights)), np.asarray(linear(x, w)))
            if not all(np.array_equal(a, b) for a, b in zip(got, want)):
                failures.append(got)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gu_bank.release()
    dn_bank.release()
    assert not failures


def test_greedy_pick_rejects_other_dtypes_and_ranks_naming_them():
    """greedy_pick checks its operand at trace time: float32 [B, V] with V >= 1 (the values: test_engine.py)."""
    with pytest.raises(TypeError, match=r"greedy_pick: logits \[B, V\] must be float32, got bfloat16"):
        ffi_ops.greedy_pick(jnp.zeros((1, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"greedy_pick: logits must be \[B, V\] \(rank 2\), got shape \(8,\)"):
        ffi_ops.greedy_pick(jnp.zeros(8, jnp.float32))
    with pytest.raises(ValueError, match=r"greedy_pick: logits \[B, V\] need V >= 1, got shape \(2, 0\)"):
        ffi_ops.greedy_pick(jnp.zeros((2, 0), jnp.float32))


def _rope_reference(x, cos, sin):
    """numpy's RoPE of bf16 heads with transformers' bf16 roundings: out = bf16(bf16(x c) + bf16(rot(x) s)), c, s
    the tables rounded to bf16, rot(x) = (-x2, x1); each product and the sum in float32 (ml_dtypes rounds to nearest
    even). x: bf16[B, T, H, D]; cos, sin: f32[B, T, D]."""
    r = lambda a: a.astype(BF16).astype(np.float32)  # noqa: E731
    xf = x.astype(np.float32)
    c, s = r(cos)[:, :, None, :], r(sin)[:, :, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (r(xf * c) + r(rot * s)).astype(BF16)


@pytest.mark.parametrize("kernel", ["auto", "generic"])
def test_rope_is_the_bf16_formula_bit_for_bit(kernel, tmp_path):
    """ffi_ops.rope (the CPU handler, vector and portable loops: FT_JAX_KERNEL in a subprocess) against numpy's bf16
    formula, and layers.apply_rope (which calls it for bf16 heads on the CPU) against its XLA form: bit-identical at
    decode (T = 1, the bench model's 16 heads of 128), prefill (T = 37) and MLA's shapes (one key head of 64), with
    YaRN-scaled tables, values from 1e-3 to 1e4 (normal numbers: XLA:CPU's flush-to-zero mode, under which both
    forms run, makes subnormals zeros where numpy keeps them) and a NaN that stays a NaN."""
    from ft_jax.models.layers import _apply_rope_xla, apply_rope, rope_cos_sin
    rng = np.random.default_rng(5)
    cases = []
    for B, T, H, D, theta, scale in [(1, 1, 16, 128, 1e6, 1.0), (2, 37, 4, 64, 1e4, 1.0), (1, 5, 1, 64, 1e4, 1.3),
                                     (3, 2, 3, 2, 5e5, 0.7)]:
        x = (rng.standard_normal((B, T, H, D)) * 10.0 ** rng.uniform(-3, 4, (B, T, H, 1))).astype(BF16)
        pos = rng.integers(0, 200_000, (B, T)).astype(np.int32)
        cos, sin = (np.asarray(t) * scale for t in rope_cos_sin(jnp.asarray(pos), D, theta))
        cases.append((x, cos.astype(np.float32), sin.astype(np.float32)))
    cases[1][0][1, 3, 2, 5] = np.nan
    for i, (x, cos, sin) in enumerate(cases):
        np.save(tmp_path / f"x{i}.npy", x.view(np.uint16))
        np.save(tmp_path / f"cos{i}.npy", cos)
        np.save(tmp_path / f"sin{i}.npy", sin)
    script = """
import sys, numpy as np, jax.numpy as jnp, ml_dtypes
from ft_jax import _ffi
from ft_jax.kernels import ffi_ops
d, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    x = jnp.asarray(np.load(f"{d}/x{i}.npy").view(ml_dtypes.bfloat16))
    y = ffi_ops.rope(x, jnp.asarray(np.load(f"{d}/cos{i}.npy")), jnp.asarray(np.load(f"{d}/sin{i}.npy")))
    np.save(f"{d}/y{i}.npy", np.asarray(y).view(np.uint16))
print(_ffi.kernel_isa())
"""
    env = dict(os.environ, **({} if kernel == "auto" else {"FT_JAX_KERNEL": kernel}))
    isa = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(len(cases))], check=True, env=env,
                         capture_output=True, text=True).stdout.strip()
    assert isa == (_ffi.kernel_isa() if kernel == "auto" else "generic")
    for i, (x, cos, sin) in enumerate(cases):
        got = np.load(tmp_path / f"y{i}.npy")
        want = _rope_reference(x, cos, sin).view(np.uint16)
        nan = np.isnan(want.view(BF16))
        assert nan.sum() == (2 if i == 1 else 0)  # the NaN input: its own output and its partner's in the other half
        np.testing.assert_array_equal(np.isnan(got.view(BF16)), nan)
        np.testing.assert_array_equal(got[~nan], want[~nan])
        if kernel == "auto":
            args = (jnp.asarray(x), jnp.asarray(cos), jnp.asarray(sin))
            np.testing.assert_array_equal(np.asarray(jax.jit(apply_rope)(*args)).view(np.uint16)[~nan], want[~nan])
            np.testing.assert_array_equal(np.asarray(jax.jit(_apply_rope_xla)(*args)).view(np.uint16)[~nan],
                                          want[~nan])


def test_apply_rope_keeps_xlas_form_for_tables_it_cannot_pass_to_the_call():
    """layers.apply_rope takes the FFI call only for float32 tables of the heads' own [B, T, D]; a table that
    broadcasts over the batch, or a bf16 one, takes XLA's form (as before the call existed), with the same values as
    the full float32 table. Under jax.vmap the call runs once per element."""
    from ft_jax.models.layers import _apply_rope_xla, apply_rope, rope_cos_sin
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((3, 2, 4, 16)), jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.asarray([[5, 6]], jnp.int32), 16, 1e4)  # [1, 2, 16]: broadcasts over B = 3
    full = [jnp.broadcast_to(t, (3, 2, 16)) for t in (cos, sin)]
    want = np.asarray(_apply_rope_xla(x, *full)).view(np.uint16)
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_rope)(x, cos, sin)).view(np.uint16), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_rope)(x, *full)).view(np.uint16), want)
    half = [t.astype(jnp.bfloat16) for t in full]  # bf16 tables: rounded the same way inside either form
    np.testing.assert_array_equal(np.asarray(jax.jit(apply_rope)(x, *half)).view(np.uint16), want)
    stacked = jnp.stack([x, x[::-1]])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(lambda a: ffi_ops.rope(a, *full)))(stacked)),
                                  np.stack([np.asarray(_apply_rope_xla(a, *full)) for a in (x, x[::-1])]))


def test_rope_rejects_bad_operands_naming_them():
    """rope checks its operands at trace time: bf16 x [B, T, H, D] with D even, float32 cos / sin [B, T, D]."""
    x, table = jnp.zeros((1, 2, 4, 8), jnp.bfloat16), jnp.zeros((1, 2, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"rope: x \[B, T, H, D\] must be bfloat16, got float32"):
        ffi_ops.rope(x.astype(jnp.float32), table, table)
    with pytest.raises(ValueError, match=r"rope: sin must be \[B, T, D\] = \[1, 2, 8\] for x \[1, 2, 4, 8\], got \[1, 1, 8\]"):
        ffi_ops.rope(x, table, table[:, :1])
    with pytest.raises(TypeError, match=r"rope: cos \[B, T, D\] must be float32, got bfloat16"):
        ffi_ops.rope(x, table.astype(jnp.bfloat16), table)
    with pytest.raises(ValueError, match=r"rope: x \[B, T, H, D\] needs an even D \(two halves\), got \[1, 2, 4, 7\]"):
        ffi_ops.rope(x[..., :7], table[..., :7], table[..., :7])
