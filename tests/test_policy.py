"""Tests of ft_jax/policy.py: the Q16 min-max integer rule (docs/DESIGN.md sec. 1), fractions, policy parsing."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ft_jax.offload import cost_model as cm
from ft_jax.offload import policy as pol
from cache_reference import q16_fetch_count

FRACS = (0.1, 0.415, 0.454, 0.7, 1.0)


def brute_force_count(m: int, frac: float) -> int:
    """argmin over F in 0..m of max(F*(2^16 - f), (m - F)*f), smallest F on ties (the rule's definition)."""
    f = min(max(math.floor(frac * 65536 + 0.5), 0), 65536)
    costs = [max(F * (65536 - f), (m - F) * f) for F in range(m + 1)]
    return costs.index(min(costs))


@pytest.mark.parametrize("frac", FRACS)
def test_integer_rule_bounds_and_agreement(frac):
    ms = np.arange(65, dtype=np.int32)
    counts_jnp = np.asarray(jax.jit(pol.fetch_count, static_argnums=1)(jnp.asarray(ms), pol.frac_to_q16(frac)))
    for m in range(65):
        count = pol.fetch_count_np(m, frac)
        assert 0 <= count <= m
        assert abs(count - frac * m) <= 1.0
        assert count == brute_force_count(m, frac), (m, frac)
        assert count == q16_fetch_count(m, frac)
        assert int(counts_jnp[m]) == count
        assert int(pol.fetch_count(jnp.int32(m), pol.frac_to_q16(frac))) == count


def test_integer_rule_worked_values():
    # f = round(0.415 * 65536) = 27197. m=3: lo = 1; cost(1) = max(38339, 54394) = 54394 <= cost(2) = 76678 -> 1.
    assert pol.frac_to_q16(0.415) == 27197
    assert pol.fetch_count_np(3, 0.415) == 1
    # m=4: lo = 1; cost(1) = max(38339, 81591) = 81591 > cost(2) = max(76678, 54394) = 76678 -> 2.
    assert pol.fetch_count_np(4, 0.415) == 2
    assert int(pol.fetch_count(jnp.int32(3), 27197)) == 1
    assert int(pol.fetch_count(jnp.int32(4), 27197)) == 2
    assert pol.fetch_count_np(0, 0.415) == 0
    assert pol.fetch_count_np(7, 0.0) == 0
    assert pol.fetch_count_np(7, 1.0) == 7


def test_frac_to_q16():
    assert pol.frac_to_q16(0.0) == 0
    assert pol.frac_to_q16(1.0) == 65536
    assert pol.frac_to_q16(1.5) == 65536
    assert pol.frac_to_q16(-0.2) == 0
    assert pol.frac_to_q16(0.5 / 65536) == 1  # round half up
    with pytest.raises(ValueError, match="finite"):
        pol.frac_to_q16(float("nan"))
    with pytest.raises(ValueError, match="frac_q16"):
        pol.fetch_count(jnp.int32(3), 70000)


def test_fraction_from_bandwidth():
    assert cm.fraction_from_bandwidth(5.0, 12.0) == pytest.approx(5.0 / 12.0)
    assert cm.fraction_from_bandwidth(12.0, 5.0) == 1.0  # BH <= BP: fetch everything
    assert cm.fraction_from_bandwidth(6.0, 6.0) == 1.0
    # contended pair wins over the single measurements: BPc / (BPc + BHc)
    assert cm.fraction_from_bandwidth(6.0, 12.0, 3.0, 4.0) == pytest.approx(3.0 / 7.0)
    assert cm.fraction_from_bandwidth(12.0, 5.0, 3.0, 4.0) == pytest.approx(3.0 / 7.0)
    with pytest.raises(ValueError, match="both"):
        cm.fraction_from_bandwidth(6.0, 12.0, 3.0)
    with pytest.raises(ValueError, match="bh"):
        cm.fraction_from_bandwidth(6.0, 0.0)
    with pytest.raises(ValueError, match="bp_contended"):
        cm.fraction_from_bandwidth(6.0, 12.0, -1.0, 4.0)


def test_parse_policy():
    assert pol.parse_policy("qstar") == pol.Policy("qstar")
    assert pol.parse_policy("qstar:0.415") == pol.Policy("qstar", frac=0.415)
    assert pol.parse_policy("fetch-all") == pol.Policy("fetch-all")
    assert pol.parse_policy("host-all") == pol.Policy("host-all")
    assert pol.parse_policy("fixed-cap:2") == pol.Policy("fixed-cap", cap=2)
    assert pol.parse_policy("resident") == pol.Policy("resident")
    assert str(pol.parse_policy("fixed-cap:3")) == "fixed-cap:3"
    for bad, msg in [("lru", "unknown policy"), ("fixed-cap", "needs a cap"), ("fixed-cap:x", "not an integer"),
                     ("fixed-cap:-1", ">= 0"), ("qstar:2", r"\[0, 1\]"), ("qstar:abc", "not a number"),
                     ("fetch-all:3", "takes no argument")]:
        with pytest.raises(ValueError, match=msg):
            pol.parse_policy(bad)
    with pytest.raises(TypeError, match="expected a policy name string, got int"):
        pol.parse_policy(5)
    with pytest.raises(ValueError, match="unknown kind"):
        pol.Policy("lru")
    with pytest.raises(ValueError, match="cap"):
        pol.Policy("fixed-cap")
    with pytest.raises(ValueError, match="takes no fraction"):
        pol.Policy("fetch-all", frac=0.5)
    assert pol.Policy("qstar").with_frac(0.25) == pol.Policy("qstar", frac=0.25)
    with pytest.raises(ValueError, match="qstar only"):
        pol.Policy("host-all").with_frac(0.25)
    hash(pol.Policy("fixed-cap", cap=1))  # usable as a static jit argument


def test_fetch_budget_per_kind():
    ms = jnp.arange(10, dtype=jnp.int32)
    expected = {
        "qstar:0.454": [q16_fetch_count(m, 0.454) for m in range(10)],
        "fetch-all": list(range(10)),
        "host-all": [0] * 10,
        "fixed-cap:3": [min(m, 3) for m in range(10)],
        "resident": [0] * 10,
    }
    for name, want in expected.items():
        policy = pol.parse_policy(name)
        got = jax.jit(lambda m, p=policy: pol.fetch_budget(p, m))(ms)
        np.testing.assert_array_equal(np.asarray(got), np.array(want, np.int32), err_msg=name)
    with pytest.raises(ValueError, match="no fraction"):
        pol.fetch_budget(pol.Policy("qstar"), jnp.int32(3))


def test_auto_parsing_and_binding():
    assert pol.parse_policy("auto") == pol.Policy("auto")
    with pytest.raises(ValueError, match="takes no argument"):
        pol.parse_policy("auto:1")
    costs = cm.auto_costs(10**9, 1.0, 4.0, device_bandwidth=10.0)
    assert pol.Policy("auto").with_costs(costs) == pol.Policy("auto", costs=costs)
    hash(pol.Policy("auto", costs=costs))  # a static jit argument
    with pytest.raises(ValueError, match="takes no costs"):
        pol.Policy("fetch-all", costs=costs)
    with pytest.raises(ValueError, match="auto only"):
        pol.Policy("qstar").with_costs(costs)
    with pytest.raises(ValueError, match="cache state"):
        pol.fetch_budget(pol.Policy("auto", costs=costs), jnp.int32(2))
    assert pol.AUTO_CANDIDATES[0] == "host-all" and pol.AUTO_LANES == pol.AUTO_CANDIDATES[1:]
    with pytest.raises(ValueError, match="both contended"):
        cm.auto_costs(10**9, 1.0, 4.0, 0.5)


def test_auto_costs_worked_values():
    # 1 GB experts: fill 1000 ms alone (the slowest solo time: 1024 ticks, tick = 1000/1024 ms), host 250 ms -> 256,
    # device 100 ms -> 102.4 -> 102; no pair: BPc = BP (1024), BHc = BH - BP = 3 GB/s: 333.3 ms -> 341.3 -> 341;
    # fixed 0.5 ms -> 0.512 -> 1 tick.
    c = cm.auto_costs(10**9, 1.0, 4.0, device_bandwidth=10.0, host_fixed_ms=0.5)
    assert c.tick_ms == pytest.approx(1000 / 1024)
    assert (c.fill_solo, c.fill_cont, c.host_solo, c.host_cont, c.device) == (1024, 1024, 256, 341, 102)
    assert (c.fill_fixed, c.host_fixed, c.device_fixed) == (0, 1, 0)
    # BH <= BP: the host gets nothing while the fill runs (capped tick value).
    assert cm.auto_costs(10**9, 4.0, 2.0).host_cont == cm.AUTO_MAX_TICKS


def test_auto_fetch_count_matches_reference_rule():
    """auto_layer_ticks, auto_credit and auto_fetch_count (jnp) against tests/cache_reference.py's independent
    auto_count over a grid of layers and reuse sums, for three machines (one with fixed costs); every candidate's
    split (auto_candidate_counts) against the reference's candidate_count."""
    from cache_reference import CANDIDATES, auto_count, auto_layer_time, candidate_count

    machines = [cm.auto_costs(10**9, 2.0, 8.0, device_bandwidth=50.0),
                cm.auto_costs(10**9, 14.8 * 25.2 / 14.8, 65.9, 14.8, 71.5, device_bandwidth=1000.0),
                cm.auto_costs(10**8, 1.0, 1.5, 0.7, 0.9, host_fixed_ms=30.0, fill_fixed_ms=5.0)]
    rng = np.random.default_rng(5)
    for costs in machines:
        fn = jax.jit(lambda m, h, cap, reuse, c=costs: pol.auto_fetch_count(
            c, m, h, cap, pol.auto_credit(c, m, h, reuse), 8))
        all_fn = jax.jit(lambda m, h, cap, reuse, c=costs: pol.auto_candidate_counts(c, m, h, cap, reuse, 8))
        for _ in range(60):
            m = int(rng.integers(0, 9))
            h = int(rng.integers(0, 9))
            cap = int(rng.integers(0, m + 1))
            seen = int(rng.integers(0, 300000))
            repeats = int(rng.integers(0, seen + 1))
            reuse = jnp.array([repeats, seen], jnp.int32)
            want = auto_count(costs, m, h, cap, repeats, seen)
            assert int(fn(m, h, cap, reuse)) == want, (costs, m, h, cap, repeats, seen)
            evictable = int(rng.integers(0, 9))
            got = np.asarray(all_fn(m, h, evictable, reuse)).tolist()
            assert got == [candidate_count(name, costs, m, h, evictable, repeats, seen) for name in CANDIDATES]
            for F in range(m + 1):
                assert int(cm.auto_layer_ticks(costs, m, h, F)) == auto_layer_time(costs, m, h, F)
