"""ft_jax/offload/cost_model.py: the float form (CostModel.layer_ms, ms) and the tick form (auto_layer_ticks, int32
ticks) are one definition (layer_time) evaluated on two number types; they agree within the rounding of the ticks."""

import numpy as np

from ft_jax.offload.cost_model import CostModel, auto_layer_ticks


def test_ticks_and_ms_agree_on_random_layers():
    """ticks * tick_ms is within the rounding bound of the float ms. Each tick value is its ms rounded to the nearest
    tick (auto_costs), so: half a tick per expert term (F + H + D), half a tick per fixed cost (3), the contended
    share a*solo/cont of the path that ends second (its two rounded times, at most H or F half-ticks each, since the
    share only counts while a <= b), and one tick lost by flooring that share: bound = F + H + D + 3 ticks."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        pair = rng.random() < 0.5
        bp, bh = rng.uniform(1.0, 200.0, 2)
        model = CostModel(expert_bytes=int(rng.integers(10**6, 10**9)), bp=float(bp), bh=float(bh),
                          bp_contended=float(rng.uniform(0.5, bp)) if pair else None,
                          bh_contended=float(rng.uniform(0.5, bh)) if pair else None,
                          device_bandwidth=float(rng.uniform(bh / 4, 4 * bh)),
                          fill_fixed_ms=float(rng.choice([0.0, rng.uniform(0, 5)])),
                          host_fixed_ms=float(rng.choice([0.0, rng.uniform(0, 5)])),
                          device_fixed_ms=float(rng.choice([0.0, rng.uniform(0, 5)])))
        costs = model.auto_costs()
        if max(costs.fill_cont, costs.host_cont) >= (1 << 20):  # capped (BHc = BH - BP near 0): not a rounding
            continue
        m = int(rng.integers(0, 17))
        hits = int(rng.integers(0, 9))
        F = int(rng.integers(0, m + 1))
        ticks = int(auto_layer_ticks(costs, m, hits, F))
        ms = model.layer_ms(F, m - F, hits + F)
        bound = (m - F) + F + (hits + F) + 3  # F + H + D + 3 ticks (docstring)
        assert abs(ticks * costs.tick_ms - ms) <= bound * costs.tick_ms, (model, m, hits, F, ticks, ms)
        checked += 1
    assert checked > 200
