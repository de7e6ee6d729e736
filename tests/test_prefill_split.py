"""Prefill priced by the cost model (issue 20 item 5): the per-expert split (cost_model.prefill_fetch_min_tokens) by
hand, plan_layer's fetchable misses, and the Engine's prefill on a CPU device, which fetches nothing under qstar and
auto and gives the tokens of host-all."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ft_jax.checkpoint import load_checkpoint
from ft_jax.engine.engine import Engine
from ft_jax.engine.sampling import Sampling, row_key_data
from ft_jax.offload.cache import STAT_FIELDS, init_cache_state, plan_layer
from ft_jax.offload.cost_model import (PREFILL_NEVER, CostModel, PathCosts, expert_flops_per_token,
                                       prefill_expert_ms, prefill_fetch_min_tokens)
from ft_jax.offload.policy import Policy, parse_policy

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


def _costs(fill, host, device):
    return PathCosts(fill_solo=fill, fill_cont=fill, host_solo=host, host_cont=host, device=device, fill_fixed=0.0,
                     host_fixed=0.0, device_fixed=0.0)


def test_split_by_hand():
    """fill 2 ms, host GEMV 1 ms, device read 0.1 ms; a token costs 0.05 ms on the host, 0.001 ms on the device:
    host(n) = max(1, 0.05 n), fetched(n) = 2 + max(0.1, 0.001 n) = 2.1 up to n = 100: fetched < host from
    0.05 n > 2.1, n = 43 (at 42 they tie: the host keeps it)."""
    c = _costs(2.0, 1.0, 0.1)
    assert prefill_fetch_min_tokens(c, 0.05, 0.001) == 43
    host, fetched = prefill_expert_ms(c, np.array([1, 42, 43]), 0.05, 0.001)
    np.testing.assert_allclose(host, [1.0, 2.1, 2.15])
    np.testing.assert_allclose(fetched, [2.1, 2.1, 2.1])
    # a CPU device: its slot experts are the host kernel (same read, same arithmetic), so the fill never pays
    assert prefill_fetch_min_tokens(_costs(2.0, 1.0, 1.0), 0.05, 0.05) == PREFILL_NEVER
    with pytest.raises(ValueError, match="host_ms_per_token"):
        prefill_fetch_min_tokens(c, 0.0, 0.001)


def test_split_of_a_published_machine():
    """FreeToken's Xeon 6526Y (BP 25.2, BH 65.9 GB/s), a bench_peer-sized bf16 expert (H 2048, I 5632: 69.2 MB),
    an assumed 1 TFLOP/s host GEMM and 100 TFLOP/s device: the fill (2.75 ms) pays once the host's arithmetic for
    the tokens exceeds it: n * 69.2 MFLOP / 1 TFLOP/s > 2.75 ms + 0.07 ms, n = 41."""
    H, I = 2048, 5632
    model = CostModel(expert_bytes=3 * H * I * 2, bp=25.2, bh=65.9, device_bandwidth=1000.0)
    f = expert_flops_per_token(H, I)
    assert f == 6 * H * I
    assert prefill_fetch_min_tokens(model.path_costs(), f / 1e12 * 1e3, f / 1e14 * 1e3) == 41


def test_plan_layer_fetches_only_the_fetchable_misses():
    """Four active misses, two of them fetchable: fetch-all fetches those two, the other two go to the host; the
    stats count all four misses."""
    state = init_cache_state(1, 6, 4)
    active = jnp.array([True, True, True, True, False, False])
    fetchable = jnp.array([False, True, False, True, True, False])
    state, plan = plan_layer(state, 0, active, parse_policy("fetch-all"), fetchable=fetchable)
    np.testing.assert_array_equal(np.asarray(plan.host_mask), [True, False, True, False, False, False])
    assert sorted(int(e) for e in np.asarray(plan.fill_flat_ids) if e >= 0) == [1, 3]
    stats = dict(zip(STAT_FIELDS, np.asarray(plan.stats)))
    assert (stats["misses"], stats["fetched"], stats["host"]) == (4, 2, 2)


@pytest.fixture(scope="module")
def mixtral():
    return load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.float32)


def test_prefill_on_a_cpu_device(mixtral):
    """qstar on a CPU device prefills with no fill (every miss on the host, as host-all); fetch-all still fills in
    prefill (while free slots last: 4 slots, at most 4 fills per layer). Both give host-all's tokens."""
    prompt = [1, 17, 42, 99, 5, 23, 64, 7, 11, 30]
    ref = Engine(mixtral, policy=Policy("host-all"), num_slots=4).generate([prompt], max_new_tokens=4).tokens
    for policy in (Policy("qstar", frac=0.5), Policy("fetch-all")):
        engine = Engine(mixtral, policy=policy, num_slots=4)
        qstar = policy.kind == "qstar"
        assert engine.prefill_backend.fetch_min_tokens == (PREFILL_NEVER if qstar else None)
        tokens = np.asarray([[0] * 6 + prompt], np.int32)
        positions = np.asarray([[-1] * 6 + list(range(len(prompt)))], np.int32)
        _, _, state = engine._prefill(engine.params, tokens, positions, engine.init_kv_cache(1, 64),
                                      engine.decode_backend.init_state(4), row_key_data(0, 0)[None],
                                      *Sampling().operands(1), greedy=True)
        stats = dict(zip(STAT_FIELDS, np.asarray(state.cache.stats).sum(axis=0)))
        assert stats["misses"] > 0
        if qstar:
            assert stats["fetched"] == 0 and stats["host"] == stats["misses"]
        else:
            assert stats["fetched"] == min(stats["misses"], 4 * mixtral.config.num_layers)
        assert engine.generate([prompt], max_new_tokens=4).tokens == ref


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "mxfp4", "fp8"])
def test_host_gemm_rate_is_measured_for_every_format(fmt):
    """The GPU split's host GEMM rate (offload.prefill_split.measure_host_gflops) runs the host kernel on a small
    random expert of each stored format and gives a finite positive rate."""
    from ft_jax import weight_formats as wf
    from ft_jax.offload.prefill_split import measure_host_gflops

    f = wf.fp8((128, 128)) if fmt == "fp8" else wf.by_name(fmt)
    rate = measure_host_gflops(256, f, inter=128, tokens=8, repeats=2)
    assert np.isfinite(rate) and rate > 0
