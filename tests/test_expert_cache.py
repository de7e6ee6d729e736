"""Tests of ft_jax/expert_cache.py against the plain Python reference (tests/cache_reference.py) and hand-worked
cases (docs/DESIGN.md sec. 1-3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ft_jax.offload.cache import (STAT_FIELDS, CacheState, LaneState, active_from_topk, init_cache_state,
                                 init_cache_state_resident, plan_layer)
from ft_jax.offload.cost_model import auto_costs
from ft_jax.offload.policy import parse_policy
from cache_reference import ReferenceCache

POLICIES = ("qstar:0.415", "fetch-all", "host-all", "fixed-cap:2", "auto")
# auto with 1 GB experts, fill 2 GB/s, host 8 GB/s, device 50 GB/s: the reuse credit and the host path both matter.
AUTO_COSTS = auto_costs(10**9, 2.0, 8.0, device_bandwidth=50.0)


def policy_of(name: str):
    """parse_policy, with auto bound to AUTO_COSTS."""
    policy = parse_policy(name)
    return policy.with_costs(AUTO_COSTS) if policy.kind == "auto" else policy
PLAN_FIELDS = ("fill_flat_ids", "fill_slot_ids", "device_slot_of_expert", "host_mask", "stats")
# plan_layer with a Python int layer (static) and a static policy; jit only to keep the tests fast.
plan_static = jax.jit(plan_layer, static_argnums=(1, 3))


def assert_state_equal(state: CacheState, want: dict, where: str):
    for name in CacheState._fields:
        if name == "lanes":
            assert (state.lanes is None) == ("lanes" not in want), (where, "lanes")
            for lane_field in LaneState._fields if state.lanes is not None else ():
                got = np.asarray(getattr(state.lanes, lane_field))
                np.testing.assert_array_equal(got, want["lanes"][lane_field],
                                              err_msg=f"{where}: CacheState.lanes.{lane_field}")
            continue
        got = np.asarray(getattr(state, name))
        assert got.dtype == np.int32, (where, name, got.dtype)
        np.testing.assert_array_equal(got, want[name], err_msg=f"{where}: CacheState.{name}")


def assert_plan_equal(plan, want: dict, where: str):
    for name in PLAN_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(plan, name)), want[name], err_msg=f"{where}: plan.{name}")


def random_active(rng, E, k, popularity):
    """Union of the top-k sets of 1-3 tokens, experts drawn from a skewed popularity (so hits happen)."""
    active = np.zeros(E, bool)
    for _ in range(rng.integers(1, 4)):
        active[rng.choice(E, size=k, replace=False, p=popularity)] = True
    return active


# resident uses S = L*E (the num_slots column is ignored): one run per L is enough.
CASES = [(p, L, S) for p in POLICIES for L, S in ((1, 40), (3, 40), (4, 5))] + [("resident", 1, 40), ("resident", 3, 40)]


@pytest.mark.parametrize("policy_name,num_layers,num_slots", CASES)
def test_matches_reference_200_steps(policy_name, num_layers, num_slots):
    E, k, steps = 32, 8, 200
    policy = policy_of(policy_name)
    if policy.kind == "resident":
        state = init_cache_state_resident(num_layers, E)
        ref = ReferenceCache(num_layers, E, resident=True)
    else:
        auto = policy.kind == "auto"
        state = init_cache_state(num_layers, E, num_slots, auto=auto)  # cold start
        ref = ReferenceCache(num_layers, E, num_slots, auto=auto)
    rng = np.random.default_rng(1234 + 17 * num_layers + num_slots)
    popularity = rng.dirichlet(np.full(E, 0.5))
    step_fn = jax.jit(lambda s, l, a: plan_layer(s, l, a, policy))  # own jit cache (jit caches are per function)
    assert_state_equal(state, ref.arrays(), "initial")
    for t in range(steps):
        layer = t % num_layers if rng.random() < 0.8 else int(rng.integers(num_layers))
        active = random_active(rng, E, k, popularity)
        state, plan = step_fn(state, jnp.int32(layer), jnp.asarray(active))
        want_plan = ref.plan(layer, active, policy)
        where = f"{policy_name} L={num_layers} S={num_slots} step {t} layer {layer}"
        assert_plan_equal(plan, want_plan, where)
        assert_state_equal(state, ref.arrays(), where)
        if policy.kind == "resident":
            assert int(plan.stats[1]) == int(active.sum())  # every active expert is a hit
    assert step_fn._cache_size() == 1  # one compilation for all routings and layers
    stats = np.asarray(state.stats)
    assert stats[:, STAT_FIELDS.index("steps")].sum() == steps
    np.testing.assert_array_equal(stats[:, 1] + stats[:, 2], stats[:, 0])  # hits + misses = active
    np.testing.assert_array_equal(stats[:, 3] + stats[:, 4], stats[:, 2])  # fetched + host = misses


def test_cold_fixed_cap_1_eight_misses():
    state = init_cache_state(2, 32, 40)
    active = np.zeros(32, bool)
    active[[3, 5, 8, 13, 21, 22, 30, 31]] = True
    state, plan = plan_static(state, 1, jnp.asarray(active), parse_policy("fixed-cap:1"))
    np.testing.assert_array_equal(np.asarray(plan.stats), [8, 0, 8, 1, 7])
    # all never seen: the lowest id is fetched, into slot 0 (all slots usage -1, lowest slot wins)
    assert int(plan.fill_flat_ids[0]) == 1 * 32 + 3 and int(plan.fill_slot_ids[0]) == 0
    assert (np.asarray(plan.fill_flat_ids[1:]) == -1).all() and (np.asarray(plan.fill_slot_ids[1:]) == -1).all()
    assert int(np.asarray(plan.host_mask).sum()) == 7
    assert not bool(plan.host_mask[3]) and bool(plan.host_mask[31])
    dev = np.asarray(plan.device_slot_of_expert)
    assert dev[3] == 0 and (np.delete(dev, 3) == -1).all()


def test_no_stale_hit_after_overwrite():
    fetch_all = parse_policy("fetch-all")
    state = init_cache_state(2, 4, 1)
    only = lambda e: jnp.asarray(np.arange(4) == e)
    state, plan = plan_static(state, 0, only(2), fetch_all)  # expert (0, 2) -> slot 0
    assert int(state.slot_of_expert[0, 2]) == 0
    state, plan = plan_static(state, 1, only(1), fetch_all)  # (1, 1) overwrites slot 0
    assert int(state.slot_of_expert[0, 2]) == -1 and int(state.expert_of_slot[0]) == 1 * 4 + 1
    state, plan = plan_static(state, 0, only(2), parse_policy("host-all"))
    np.testing.assert_array_equal(np.asarray(plan.stats), [1, 0, 1, 0, 1])  # a miss, not a stale hit
    assert bool(plan.host_mask[2]) and int(plan.device_slot_of_expert[2]) == -1


def test_never_evicts_active_expert_of_current_layer():
    # L=1, E=4, S=2: both slots hold experts active again, so the two new misses cannot be fetched.
    fetch_all = parse_policy("fetch-all")
    state = init_cache_state(1, 4, 2)
    state, _ = plan_static(state, 0, jnp.array([True, True, False, False]), fetch_all)
    state, plan = plan_static(state, 0, jnp.array([True, True, True, True]), fetch_all)
    np.testing.assert_array_equal(np.asarray(plan.stats), [4, 2, 2, 0, 2])  # F capped to 0 eligible slots
    np.testing.assert_array_equal(np.asarray(plan.fill_slot_ids), [-1, -1])
    np.testing.assert_array_equal(np.asarray(plan.device_slot_of_expert), [0, 1, -1, -1])
    np.testing.assert_array_equal(np.asarray(plan.host_mask), [False, False, True, True])


def _mask(E, ids):
    return jnp.asarray(np.isin(np.arange(E), ids))


# Hand-worked scenario: L=2 MoE layers, E=4 experts, S=2 slots, P = min(E, S) = 2. Each entry: (layer, active
# experts, policy) -> expected plan (fill_flat_ids, fill_slot_ids, device_slot_of_expert, host_mask, stats) and
# expected tables after the call (slot_of_expert, expert_of_slot, usage, recency, step).
HAND_STEPS = [
    # step 0: cold. misses 1, 3 (never seen, lower id first) -> slots 0, 1 (usage -1, lowest slot first).
    ((0, [1, 3], "fetch-all"),
     ([1, 3], [0, 1], [-1, 0, -1, 1], [0, 0, 0, 0], [2, 0, 2, 2, 0]),
     ([[-1, 0, -1, 1], [-1, -1, -1, -1]], [1, 3], [0, 0], [[-1, 0, -1, 0], [-1, -1, -1, -1]], 1)),
    # step 1: layer 1 misses 0, 2 (flat 4, 6) evict layer 0's experts (global pool, usage 0 tie -> slot 0 first).
    ((1, [0, 2], "fetch-all"),
     ([4, 6], [0, 1], [0, -1, 1, -1], [0, 0, 0, 0], [2, 0, 2, 2, 0]),
     ([[-1, -1, -1, -1], [0, -1, 1, -1]], [4, 6], [1, 1], [[-1, 0, -1, 0], [1, -1, 1, -1]], 2)),
    # step 2: hit 2 (slot 1); miss 3 may not evict slot 1 (expert 2 active) -> slot 0, evicting flat 4.
    ((1, [2, 3], "fetch-all"),
     ([7, -1], [0, -1], [-1, -1, 1, 0], [0, 0, 0, 0], [2, 1, 1, 1, 0]),
     ([[-1, -1, -1, -1], [-1, -1, 1, 0]], [7, 6], [2, 2], [[-1, 0, -1, 0], [1, -1, 2, 2]], 3)),
    # step 3: misses 0 (never), 1 (rec 0), 3 (rec 0) rank 1, 3, 0; only 2 slots -> F = 2, expert 0 on the host.
    ((0, [0, 1, 3], "fetch-all"),
     ([1, 3], [0, 1], [-1, 0, -1, 1], [1, 0, 0, 0], [3, 0, 3, 2, 1]),
     ([[-1, 0, -1, 1], [-1, -1, -1, -1]], [1, 3], [3, 3], [[3, 3, -1, 3], [1, -1, 2, 2]], 4)),
    # step 4: qstar 0.415, m = 2 -> F = 1 (f = 27197: cost(0) = 54394 > cost(1) = 38339). Expert 0 (rec 3)
    # ranks above never-seen 2; victim slot 0 (usage tie 3, lowest slot), evicting flat 1.
    ((0, [0, 2], "qstar:0.415"),
     ([0, -1], [0, -1], [0, -1, -1, -1], [0, 0, 1, 0], [2, 0, 2, 1, 1]),
     ([[0, -1, -1, 1], [-1, -1, -1, -1]], [0, 3], [4, 3], [[4, 3, 4, 3], [1, -1, 2, 2]], 5)),
    # step 5: host-all: hit 3 (slot 1, usage -> 5), miss 2 on the host, tables otherwise unchanged.
    ((0, [2, 3], "host-all"),
     ([-1, -1], [-1, -1], [-1, -1, -1, 1], [0, 0, 1, 0], [2, 1, 1, 0, 1]),
     ([[0, -1, -1, 1], [-1, -1, -1, -1]], [0, 3], [4, 5], [[4, 3, 5, 5], [1, -1, 2, 2]], 6)),
    # step 6: fixed-cap 1, miss (1, 1) = flat 5 -> LRU slot 0 (usage 4 < 5), evicting flat 0.
    ((1, [1], "fixed-cap:1"),
     ([5, -1], [0, -1], [-1, 0, -1, -1], [0, 0, 0, 0], [1, 0, 1, 1, 0]),
     ([[-1, -1, -1, 1], [-1, 0, -1, -1]], [5, 3], [6, 5], [[4, 3, 5, 5], [1, 6, 2, 2]], 7)),
]
# Per layer: (active, hits, misses, fetched, host, steps) summed over the calls above.
HAND_FINAL_STATS = [[9, 1, 8, 5, 3, 4], [5, 1, 4, 4, 0, 3]]


@pytest.mark.parametrize("use_reference", [False, True])
def test_hand_worked_two_layers(use_reference):
    E = 4
    state = init_cache_state(2, E, 2)
    ref = ReferenceCache(2, E, 2)
    for t, ((layer, ids, name), plan_want, tables_want) in enumerate(HAND_STEPS):
        policy = parse_policy(name)
        if use_reference:  # the reference must agree with the hand-worked values too
            got_plan = ref.plan(layer, np.asarray(_mask(E, ids)), policy)
            got_tables = ref.arrays()
        else:
            state, plan = plan_static(state, layer, _mask(E, ids), policy)
            got_plan = {name: np.asarray(getattr(plan, name)) for name in PLAN_FIELDS}
            got_tables = {name: np.asarray(getattr(state, name)) for name in CacheState._fields}
        for name, want in zip(PLAN_FIELDS, plan_want):
            np.testing.assert_array_equal(got_plan[name], np.array(want).astype(got_plan[name].dtype),
                                          err_msg=f"step {t}: plan.{name}")
        for name, want in zip(("slot_of_expert", "expert_of_slot", "usage", "recency", "step"), tables_want):
            np.testing.assert_array_equal(got_tables[name], np.array(want, np.int32), err_msg=f"step {t}: {name}")
    np.testing.assert_array_equal(got_tables["stats"], np.array(HAND_FINAL_STATS, np.int32))


def test_resident_state_and_policy():
    state = init_cache_state_resident(2, 3)
    np.testing.assert_array_equal(np.asarray(state.slot_of_expert), [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(np.asarray(state.expert_of_slot), np.arange(6))
    state, plan = plan_static(state, 1, jnp.array([False, True, True]), parse_policy("resident"))
    np.testing.assert_array_equal(np.asarray(plan.device_slot_of_expert), [-1, 4, 5])
    np.testing.assert_array_equal(np.asarray(plan.stats), [2, 2, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(plan.fill_flat_ids), [-1, -1, -1])
    np.testing.assert_array_equal(np.asarray(state.usage), [-1, -1, -1, -1, 0, 0])
    with pytest.raises(ValueError, match="S = L\\*E"):
        plan_layer(init_cache_state(2, 3, 4), 0, jnp.zeros(3, bool), parse_policy("resident"))


def test_python_int_and_traced_layer_agree():
    policy = parse_policy("qstar:0.454")
    rng = np.random.default_rng(7)
    s_int = s_traced = init_cache_state(3, 8, 5)
    traced = jax.jit(plan_layer, static_argnums=3)  # layer traced
    for t in range(12):
        active = jnp.asarray(rng.random(8) < 0.4)
        s_int, p_int = plan_static(s_int, t % 3, active, policy)
        s_traced, p_traced = traced(s_traced, jnp.int32(t % 3), active, policy)
        for a, b in zip(jax.tree_util.tree_leaves((s_int, p_int)), jax.tree_util.tree_leaves((s_traced, p_traced))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_active_from_topk():
    ids = jnp.array([[1, 5], [5, 2], [-1, 7]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(active_from_topk(ids, 8)),
                                  [False, True, True, False, False, True, False, True])


def test_input_errors():
    state = init_cache_state(2, 4, 3)
    with pytest.raises(ValueError, match=r"bool\[4\]"):
        plan_layer(state, 0, jnp.zeros(5, bool), parse_policy("fetch-all"))
    with pytest.raises(ValueError, match=r"bool\[4\]"):
        plan_layer(state, 0, jnp.zeros(4, jnp.int32), parse_policy("fetch-all"))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        plan_layer(state, 2, jnp.zeros(4, bool), parse_policy("fetch-all"))
    with pytest.raises(ValueError, match="no fraction"):
        plan_layer(state, 0, jnp.zeros(4, bool), parse_policy("qstar"))
    with pytest.raises(ValueError, match="auto policy has no costs"):
        plan_layer(state, 0, jnp.zeros(4, bool), parse_policy("auto"))
    with pytest.raises(ValueError, match="num_slots"):
        init_cache_state(2, 4, 0)


def test_victim_choice_safe_at_int32_limit():
    # After 2^31 - 1 layer calls usage can reach INT32_MAX: an eligible slot with that usage must still be chosen
    # before a slot holding an active expert (which would drop the hit route).
    int_max = np.iinfo(np.int32).max
    state = CacheState(slot_of_expert=jnp.array([[0, -1, -1, 1]], jnp.int32),
                       expert_of_slot=jnp.array([0, 3], jnp.int32),
                       usage=jnp.array([5, int_max], jnp.int32),
                       recency=jnp.array([[4, -1, -1, 4]], jnp.int32),
                       step=jnp.array(int_max - 1, jnp.int32),
                       stats=jnp.zeros((1, 6), jnp.int32), reuse=jnp.zeros((2,), jnp.int32))
    state, plan = plan_static(state, 0, jnp.array([True, True, False, False]), parse_policy("fetch-all"))
    np.testing.assert_array_equal(np.asarray(plan.fill_slot_ids), [1, -1])
    np.testing.assert_array_equal(np.asarray(plan.device_slot_of_expert), [0, 1, -1, -1])
    np.testing.assert_array_equal(np.asarray(plan.host_mask), [False, False, False, False])
    np.testing.assert_array_equal(np.asarray(state.slot_of_expert), [[0, 1, -1, -1]])


@pytest.mark.parametrize("policy_name", ["qstar:0.415", "fetch-all", "fixed-cap:1", "auto"])
def test_decode_plan_with_max_active_matches_reference(policy_name):
    """The decode step's plan: at most T*k = 6 active experts, so P = 6 fills, chosen by argmax/argmin instead of
    sorts; the tables and the first P plan entries equal the reference (whose remaining entries are padding)."""
    E, k, L, S, steps = 32, 2, 3, 10, 150
    policy = policy_of(policy_name)
    auto = policy.kind == "auto"
    state, ref = init_cache_state(L, E, S, auto=auto), ReferenceCache(L, E, S, auto=auto)
    rng = np.random.default_rng(99)
    popularity = rng.dirichlet(np.full(E, 0.3))
    step_fn = jax.jit(lambda s, l, a: plan_layer(s, l, a, policy, max_active=3 * k))
    for t in range(steps):
        layer = t % L
        active = random_active(rng, E, k, popularity)
        state, plan = step_fn(state, jnp.int32(layer), jnp.asarray(active))
        want = ref.plan(layer, active, policy)
        assert np.all(want["fill_flat_ids"][3 * k:] == -1)
        for name in ("fill_flat_ids", "fill_slot_ids"):
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), want[name][:3 * k], err_msg=f"{t} {name}")
        for name in ("device_slot_of_expert", "host_mask", "stats"):
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), want[name], err_msg=f"{t} {name}")
        assert_state_equal(state, ref.arrays(), f"{policy_name} step {t}")
    assert step_fn._cache_size() == 1
    hlo = step_fn.lower(state, jnp.int32(0), jnp.zeros(E, bool)).compile().as_text()
    assert " sort(" not in hlo  # decode plans sort nothing


@pytest.mark.parametrize("num_slots,costs", [(12, AUTO_COSTS), (40, auto_costs(10**9, 20.0, 8.0, device_bandwidth=50.0)),
                                             (40, auto_costs(10**9, 0.5, 8.0, device_bandwidth=1000.0))])
def test_auto_lanes_match_reference_across_windows(monkeypatch, num_slots, costs):
    """auto with a 3-token window (so that 300 calls cross 33 window boundaries): every lane's tables, the window
    costs, the leader and the real cache equal the reference's after every call, under three machines (a slow, a
    fast and a very slow fill) that make different candidates lead."""
    import cache_reference
    from ft_jax.offload import cache as cache_module
    monkeypatch.setattr(cache_module, "AUTO_WINDOW_TOKENS", 3)
    monkeypatch.setattr(cache_reference, "WINDOW_TOKENS", 3)
    monkeypatch.setattr(cache_module, "AUTO_FIRST_CHECK_TOKENS", 1)  # checks after tokens 1 and 2 of the first window
    monkeypatch.setattr(cache_reference, "FIRST_CHECK_TOKENS", 1)
    E, k, L, steps = 32, 4, 3, 300
    policy = parse_policy("auto").with_costs(costs)
    state, ref = init_cache_state(L, E, num_slots, auto=True), ReferenceCache(L, E, num_slots, auto=True)
    rng = np.random.default_rng(7 + num_slots)
    popularity = rng.dirichlet(np.full(E, 0.4))
    step_fn = jax.jit(lambda s, l, a: plan_layer(s, l, a, policy, max_active=3 * k))
    leaders = set()
    for t in range(steps):
        layer = t % L
        active = random_active(rng, E, k, popularity)
        state, plan = step_fn(state, jnp.int32(layer), jnp.asarray(active))
        want = ref.plan(layer, active, policy)
        for name in ("device_slot_of_expert", "host_mask", "stats"):
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), want[name], err_msg=f"{t} {name}")
        assert_state_equal(state, ref.arrays(), f"auto S={num_slots} step {t}")
        leaders.add(int(state.lanes.leader))
    assert step_fn._cache_size() == 1
    print("leaders", sorted(leaders))


def _one_expert_auto(monkeypatch, costs, window_tokens: int, first_check_tokens: int):
    """L=1, E=4, S=1 auto with the given window and first-window check: (policy, state, reference, jitted plan)."""
    import cache_reference
    from ft_jax.offload import cache as cache_module
    monkeypatch.setattr(cache_module, "AUTO_WINDOW_TOKENS", window_tokens)
    monkeypatch.setattr(cache_reference, "WINDOW_TOKENS", window_tokens)
    monkeypatch.setattr(cache_module, "AUTO_FIRST_CHECK_TOKENS", first_check_tokens)
    monkeypatch.setattr(cache_reference, "FIRST_CHECK_TOKENS", first_check_tokens)
    policy = parse_policy("auto").with_costs(costs)
    state, ref = init_cache_state(1, 4, 1, auto=True), ReferenceCache(1, 4, 1, auto=True)
    return policy, state, ref, jax.jit(lambda s, a: plan_layer(s, 0, a, policy))


def _run_by_hand(policy, state, ref, step_fn, want: dict, calls: int):
    """Expert 1 active in every call; after each call listed in want: (leader, fetched, window costs)."""
    only_1 = jnp.asarray([False, True, False, False])
    for call in range(calls):
        state, plan = step_fn(state, only_1)
        ref.plan(0, np.asarray(only_1), policy)
        assert_state_equal(state, ref.arrays(), f"call {call}")
        if call in want:
            leader, fetched, cost = want[call]
            assert (int(state.lanes.leader), int(plan.stats[3]), np.asarray(state.lanes.cost).tolist()) == \
                (leader, fetched, cost), call
    assert int(plan.stats[1]) == 1  # the real cache hits expert 1


def test_auto_leader_by_hand(monkeypatch):
    """L=1, E=4, S=1, a 3-token window, expert 1 active in every call; a fill costs 3 host GEMVs (1024 vs 341 ticks),
    a hit 3 ticks. Window 1 (calls 0-2) follows the reuse rule, which fetches nothing yet: the fetch-all and
    fixed-cap:1 lanes fill at call 0 (1024 + 3) and hit twice (1033), the others pay 3 x 341 = 1023. At call 3 the
    score credits each lane one host GEMV (341) per expert active in the window that its cache holds: 1033 - 341 =
    692 for the two lanes that hold expert 1 against 1023, so fetch-all (the first of the cheapest) leads and the
    real cache fetches expert 1 at call 3. From then on every lane starts warm; at call 6 the lanes that hold expert 1
    score 1033 - 341 = 692 against the cold qstar lane's (it never fetches) and host-all's 1023, and fetch-all keeps
    the lead. On the window cost alone host-all (1023 < 1033) would have led from call 6: the myopic choice."""
    costs = auto_costs(10**9, 8 / 3, 8.0, device_bandwidth=1000.0)
    assert (costs.fill_solo, costs.fill_cont, costs.host_solo, costs.host_cont, costs.device) == (1024, 1024, 341, 512, 3)
    policy, state, ref, step_fn = _one_expert_auto(monkeypatch, costs, 3, first_check_tokens=16)  # none in window 1
    want = {0: (4, 0, [341, 1027, 1027, 341, 341]), 2: (4, 0, [1023, 1033, 1033, 1023, 1023]),
            3: (1, 1, [341, 1027, 1027, 341, 1027]), 5: (1, 0, [1023, 1033, 1033, 1023, 1033]),
            6: (1, 0, [341, 3, 3, 3, 3]), 9: (1, 0, [341, 3, 3, 3, 3])}
    _run_by_hand(policy, state, ref, step_fn, want, 10)


@pytest.mark.parametrize("first_check_tokens,switch", [(1, 18), (64, 32)])
def test_auto_first_window_checks_by_hand(monkeypatch, first_check_tokens, switch):
    """L=1, E=4, S=1, a 32-token window, expert 1 active in every call; a fill costs 16 host GEMVs (1024 vs 64
    ticks), a hit 10. The reuse rule (the first leader) never fetches here; fetch-all's lane fills at call 0 and
    then hits: 1024 + 10 n after n calls, against 64 n for the others. With a check after every token of the first
    window its score (minus one host GEMV for the expert it holds) first drops below the others' at call 18:
    1204 - 64 = 1140 < 1152 (call 17: 1194 - 64 = 1130 > 1088), so the real cache fetches expert 1 at call 18;
    without checks inside the window (every 64 tokens) it waits for the window's end, call 32 (1344 - 64 < 2048)."""
    costs = auto_costs(10**9, 0.5, 8.0, device_bandwidth=50.0)
    assert (costs.fill_solo, costs.host_solo, costs.host_cont, costs.device) == (1024, 64, 68, 10)
    policy, state, ref, step_fn = _one_expert_auto(monkeypatch, costs, 32, first_check_tokens)
    before = switch - 1
    want = {before: (4, 0, [64 * switch] + [1024 + 10 * switch] * 2 + [64 * switch] * 2),
            switch: (1, 1, ([64 * (switch + 1)] + [1024 + 10 * (switch + 1)] * 2 + [64 * (switch + 1)] * 2)
                     if switch < 32 else [64, 1034, 1034, 64, 64])}  # call 32: the lanes restart from the cold cache
    _run_by_hand(policy, state, ref, step_fn, want, 34)


def test_auto_repeat_misses_by_hand():
    """L=1, E=4, S=1, auto with a fill 16x a host GEMV (never worth it at the prior): nothing is fetched, and a miss
    on an expert active since the LRU slot's last use (here: the slot was never used) is a repeat miss."""
    policy = parse_policy("auto").with_costs(auto_costs(10**9, 0.5, 8.0, device_bandwidth=50.0))
    state = init_cache_state(1, 4, 1, auto=True)
    only = lambda *e: jnp.asarray(np.isin(np.arange(4), e))  # noqa: E731
    state, plan = plan_static(state, 0, only(1), policy)  # never seen: not a repeat
    assert int(plan.stats[3]) == 0 and np.asarray(state.reuse).tolist() == [0, 32]
    state, plan = plan_static(state, 0, only(1, 3), policy)  # 1 again (a repeat), 3 new
    assert int(plan.stats[3]) == 0 and np.asarray(state.reuse).tolist() == [32, 32 + 64]
