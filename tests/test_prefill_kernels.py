"""The prefill kernels (issue 20 item 2): experts with many tokens in register tiles (xla_ffi/gemm_bf16.h), checked
against float64 numpy references and, bit for bit, against each token computed alone (the row-by-row dots of
decode), at edge shapes: token counts that are not multiples of the tile, experts with 0, 1 and many tokens, row
lengths that are not multiples of the 256-element accumulator stride or of a 32-element chunk."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
from test_gpu_path import float64_experts

BF16 = np.dtype(ml_dtypes.bfloat16)
F32_EPS = 2.0**-24


def _rel_err(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / np.abs(expected).max()


@pytest.fixture(scope="module", params=[(264, 165), (2 * 256 + 32 + 7, 96)], ids=["H264_I165", "H551_I96"])
def bf16_experts(request):
    """5 bf16 experts of odd sizes (H = 264: 4 chunk pairs of the 2-accumulator loop plus an 8-element tail; H = 551:
    a 32-chunk past that loop plus a 7-element tail) and 23 tokens routed top-2 so that expert 0 gets 1 route,
    expert 1 none, expert 4 two (the two-token row path), expert 2 many and expert 3 the rest; a few routes skipped
    (-1)."""
    H, I = request.param
    rng = np.random.default_rng(H)
    gate_up = (rng.standard_normal((5, 2 * I, H)) / np.sqrt(H)).astype(BF16)
    down = (rng.standard_normal((5, H, I)) / np.sqrt(I)).astype(BF16)
    T = 23
    x = rng.standard_normal((T, H)).astype(BF16)
    ids = np.full((T, 2), 2, np.int32)
    ids[:, 1] = 3
    ids[0, 1] = 0  # expert 0: one route
    ids[1, 1] = ids[2, 1] = 4  # expert 4: two routes
    ids[5, 0] = ids[9, 1] = -1  # skipped routes
    weights = rng.random((T, 2)).astype(np.float32)
    banks = HostBank.from_numpy(gate_up), HostBank.from_numpy(down)
    yield x, ids, weights, gate_up, down, banks
    for b in banks:
        b.release()


def test_bf16_experts_with_many_tokens_match_float64(bf16_experts):
    x, ids, weights, gate_up, down, banks = bf16_experts
    y = np.asarray(ffi_ops.host_experts(jnp.asarray(x), ids, weights, *banks))
    expected = float64_experts(x, ids, weights, gate_up, down, "silu")  # bf16 x: the activations rounded
    H, I = x.shape[1], down.shape[2]
    # bf16 products are exact in float32: what is left is the float32 accumulation over H + I terms per route
    assert _rel_err(y, expected) < (H + I) * F32_EPS


def test_bf16_experts_in_tiles_equal_each_token_alone(bf16_experts):
    """23 tokens (3 tiles of 6 + 5) through the register tiles are bit for bit the tokens computed one at a time
    (one token per call: the row-by-row dots), for the expert with many routes, the ones with two, one and none."""
    x, ids, weights, gate_up, down, banks = bf16_experts
    together = np.asarray(ffi_ops.host_experts(jnp.asarray(x), ids, weights, *banks))
    for t in range(x.shape[0]):
        alone = np.asarray(ffi_ops.host_experts(jnp.asarray(x[t:t + 1]), ids[t:t + 1], weights[t:t + 1], *banks))
        np.testing.assert_array_equal(alone[0], together[t])
    slots = np.asarray(ffi_ops.slot_experts(jnp.asarray(x), ids, weights, jnp.asarray(gate_up), jnp.asarray(down)))
    np.testing.assert_array_equal(slots, together)


@pytest.mark.parametrize("N, O", [(2, 30), (3, 30), (4, 30), (7, 30), (13, 30), (40, 30), (300, 1000)])
def test_bf16_linear_in_tiles_equals_rows_alone_and_float64(N, O):
    """The dense FFI projection with bf16 weights and activations (any row count where the CPU has the bf16 dot): N
    tokens (2: each row once for both, DotRowBf16Tokens; from 3: the tiles) equal each token alone bit for bit, and
    the float64 product within float32 accumulation. K = 551;
    O = 30 rows = 7 tiles of 4 rows plus 2 single rows; from 32 tokens x is copied to the tiles' token stride, and
    300 tokens are two token blocks (204 + 96) of a 1.1 MB matrix split over the threads."""
    rng = np.random.default_rng(N)
    w = (rng.standard_normal((2, O, 551)) / 20).astype(BF16)
    x = rng.standard_normal((N, 551)).astype(BF16)
    y = np.asarray(ffi_ops.linear(jnp.asarray(x), jnp.asarray(w), 1))
    expected = x.astype(np.float64) @ w[1].astype(np.float64).T
    assert _rel_err(y, expected) < 551 * F32_EPS
    for t in range(N):
        np.testing.assert_array_equal(np.asarray(ffi_ops.linear(jnp.asarray(x[t:t + 1]), jnp.asarray(w), 1))[0], y[t])
