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


def test_a_cpu_device_runs_the_paths_one_after_another():
    """A profile measured on a CPU device (CostModel.from_spec(platform="cpu")) prices the fill, the slot experts and
    the host GEMV as one sequence on the same cores, worked by hand: 1 GB experts at BP 10, BH 20, BD 25 GB/s are
    100, 50 and 40 ms; fixed costs 1, 2, 3 ms. Two fills, three host experts and four on the device (two hits):
    (1 + 2 * 100) + (3 + 4 * 40) + (2 + 3 * 50) = 516 ms, where a GPU's overlapping paths would take max(fill +
    device, host). The tick form agrees within its rounding, and the decode step's reference mirrors it."""
    from cache_reference import auto_layer_time

    spec = {"bp": 10.0, "bh": 20.0, "bp_contended": None, "bh_contended": None, "fill_fixed_ms": 1.0,
            "host_fixed_ms": 2.0, "device_fixed_ms": 3.0, "device_bandwidth": 25.0}
    cpu = CostModel.from_spec(spec, 10**9, platform="cpu")
    gpu = CostModel.from_spec(spec, 10**9, platform="gpu")
    assert cpu.serial_paths and not gpu.serial_paths
    assert cpu.layer_ms(2, 3, 4) == 516.0
    assert gpu.layer_ms(2, 3, 4) < 516.0
    assert cpu.layer_ms(0, 3, 0) == 152.0 and cpu.layer_ms(0, 0, 0) == 0.0
    costs = cpu.auto_costs()
    assert costs.serial
    ticks = int(auto_layer_ticks(costs, 5, 2, 2))  # 5 misses, 2 hits, 2 fetched: F 2, H 3, D 4
    assert abs(ticks * costs.tick_ms - 516.0) <= (2 + 3 + 4 + 3) * costs.tick_ms
    assert auto_layer_time(costs, 5, 2, 2) == ticks
    assert "one after another" in cpu.describe()
