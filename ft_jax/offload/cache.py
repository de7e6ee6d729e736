"""Expert slot cache: device-side tables and the per-MoE-layer plan, as pure static-shape jnp (docs/DESIGN.md sec. 1-3).

One pool of S device slots is shared by all L MoE layers. On every MoE-layer call `plan_layer` splits the layer's
active experts into hits (resident in a slot), fetched misses (copied into a slot by the slot-fill FFI call) and host
misses (computed on the CPU from the host bank), picks victim slots with a global LRU, and updates the tables. All
shapes depend only on (L, E, S): one compiled decode step replays for any routing.

Rules: hit = active & resident; miss = active & ~resident; F = policy.fetch_split (the policy's split). Misses are
fetched most recently active first (ties to the lower id, never-seen last); victims are the least recently used
slots (ties to the lowest slot), never one holding an expert active in this layer; F is capped by the eligible
slots. Hits and fills set usage = step; active experts get recency = step; step += 1 per call (int32: wraps after
2^31 - 1 calls, after which the LRU order is no longer meaningful but outputs stay correct). The auto policy's
repeat-miss sums and its lanes (LaneState: each candidate rule run from the real cache's state, window by window)
and the full rules: docs/policies.md ("The auto rule") and docs/DESIGN.md sec. 12 ("offload/cache.py").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ft_jax.offload.cost_model import auto_layer_ticks
from ft_jax.offload.policy import (AUTO_CANDIDATES, AUTO_DECAY_SHIFT, AUTO_FIRST_CHECK_TOKENS, AUTO_FIRST_LEADER,
                                   AUTO_LANES, AUTO_MAX_COST, AUTO_WINDOW_TOKENS, REUSE_FIELDS, Policy, PolicyKind,
                                   auto_candidate_counts, fetch_split)

# Columns of CacheState.stats (per MoE layer); LayerPlan.stats holds the first five for one call.
STAT_FIELDS = ("active", "hits", "misses", "fetched", "host", "steps")


class LaneState(NamedTuple):
    """The auto policy's lanes (docs/policies.md, "The auto rule"): each of the K = len(policy.AUTO_LANES) candidate
    rules run on its own copy of the cache tables, copied from the real cache at the start of every window, and the
    window's modelled cost of every candidate. C = len(policy.AUTO_CANDIDATES) = K + 1.

    Attributes:
        slot_of_expert: i32[K, L, E]; expert_of_slot, usage: i32[K, S]; reuse: i32[K, 2]: CacheState's tables, per
            lane (lane k runs candidate k + 1).
        cost: i32[C] ticks each candidate took in the current window (auto_layer_ticks of its own hits, misses and
            fills; host-all's from a cold cache, all misses), saturating at policy.AUTO_MAX_COST.
        window_active: bool[L, E] the experts active in the current window (what a lane's cache is scored on at a
            leader check).
        leader: i32[] the candidate the real cache follows (index into AUTO_CANDIDATES).
        window_start: i32[] global step at which the current window began.
    """

    slot_of_expert: jax.Array
    expert_of_slot: jax.Array
    usage: jax.Array
    reuse: jax.Array
    cost: jax.Array
    window_active: jax.Array
    leader: jax.Array
    window_start: jax.Array


class CacheState(NamedTuple):
    """Cache tables (a pytree of device arrays; docs/DESIGN.md sec. 2). L MoE layers, E experts per layer, S slots.

    Attributes:
        slot_of_expert: i32[L, E] slot holding expert (l, e), -1 = not resident.
        expert_of_slot: i32[S] flat id l*E + e held by the slot (the host bank row), -1 = empty.
        usage: i32[S] global step of the slot's last hit or fill, -1 = never used.
        recency: i32[L, E] global step of the expert's last activation, -1 = never active.
        step: i32[] global step, +1 per MoE-layer call (wraps after 2^31 - 1: see the module docstring).
        stats: i32[L, 6] per-layer counters accumulated on device, columns STAT_FIELDS = (active, hits, misses,
            fetched, host, steps); read once at the end, never synced per step.
        reuse: i32[2] auto only: decayed sums (x32) policy.REUSE_FIELDS: this cache's repeat misses and misses
            (1/1024 decay per call with a miss; docs/policies.md), zeros otherwise.
        lanes: LaneState for the auto policy (init_cache_state(..., auto=True)), else None.
    The slot arrays themselves (e.g. gate_up [S, 2I, H], down [S, H, I]) live with the decode step, not here.
    """

    slot_of_expert: jax.Array
    expert_of_slot: jax.Array
    usage: jax.Array
    recency: jax.Array
    step: jax.Array
    stats: jax.Array
    reuse: jax.Array
    lanes: LaneState | None = None


class LayerPlan(NamedTuple):
    """What one MoE layer must do this step (output of plan_layer). P = min(E, S, max_active) (static).

    Attributes:
        fill_flat_ids: i32[P] bank rows (flat ids l*E + e) to copy into slots, padded with -1 (slot_fill operand).
        fill_slot_ids: i32[P] destination slot of each fill, padded with -1.
        device_slot_of_expert: i32[E] slot of every hit or fetched expert of this layer, -1 otherwise.
        host_mask: bool[E] misses computed on the host (miss & ~fetch).
        stats: i32[5] this call's (active, hits, misses m, fetched F, host m - F).
    """

    fill_flat_ids: jax.Array
    fill_slot_ids: jax.Array
    device_slot_of_expert: jax.Array
    host_mask: jax.Array
    stats: jax.Array


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"expert_cache: {name} must be a positive int, got {value!r}")


def init_cache_state(num_layers: int, num_experts: int, num_slots: int, *, auto: bool = False) -> CacheState:
    """Cold cache: every slot empty, nothing seen yet, step 0.

    Args:
        num_layers: L, number of MoE layers.
        num_experts: E, routed experts per MoE layer.
        num_slots: S, device slots shared by all layers.
        auto: with the auto policy's lanes (LaneState: cold copies, costs 0, the first leader
            policy.AUTO_FIRST_LEADER, window from step 0); the state of an auto decode step needs them.
    Returns:
        CacheState with slot_of_expert, expert_of_slot, usage, recency all -1; step, stats, reuse zeros.
    Raises:
        ValueError: a dimension is not a positive int.
    """
    _check_dims(num_layers=num_layers, num_experts=num_experts, num_slots=num_slots)
    L, E, S = num_layers, num_experts, num_slots
    lanes = None
    if auto:
        K = len(AUTO_LANES)
        lanes = LaneState(slot_of_expert=np.full((K, L, E), -1, np.int32), expert_of_slot=np.full((K, S), -1, np.int32),
                          usage=np.full((K, S), -1, np.int32), reuse=np.zeros((K, len(REUSE_FIELDS)), np.int32),
                          cost=np.zeros((len(AUTO_CANDIDATES),), np.int32), window_active=np.zeros((L, E), bool),
                          leader=np.asarray(AUTO_FIRST_LEADER, np.int32), window_start=np.zeros((), np.int32))
    return _on_device(CacheState(
        slot_of_expert=np.full((L, E), -1, np.int32),
        expert_of_slot=np.full((S,), -1, np.int32),
        usage=np.full((S,), -1, np.int32),
        recency=np.full((L, E), -1, np.int32),
        step=np.zeros((), np.int32),
        stats=np.zeros((L, len(STAT_FIELDS)), np.int32),
        reuse=np.zeros((len(REUSE_FIELDS),), np.int32),
        lanes=lanes,
    ))


def _on_device(state: CacheState) -> CacheState:
    """A cold state built in numpy, copied to the default device in one transfer: the steps donate it, so it never
    aliases the numpy buffers, and building it with jnp would compile (and look up in the compilation cache) one
    small XLA program per distinct shape, 10-40 ms each at every launch (docs/DESIGN.md sec. 20.18)."""
    return jax.device_put(state, may_alias=False)


def init_cache_state_resident(num_layers: int, num_experts: int) -> CacheState:
    """Fully resident cache for the "resident" policy: S = L*E slots, slot s holds flat id s.

    Returns:
        CacheState with slot_of_expert[l, e] = l*E + e, expert_of_slot[s] = s, usage and recency -1, step 0.
    Raises:
        ValueError: a dimension is not a positive int.
    """
    _check_dims(num_layers=num_layers, num_experts=num_experts)
    L, E = num_layers, num_experts
    flat = np.arange(L * E, dtype=np.int32)  # i32[L*E]
    return _on_device(CacheState(
        slot_of_expert=flat.reshape(L, E),
        expert_of_slot=flat,
        usage=np.full((L * E,), -1, np.int32),
        recency=np.full((L, E), -1, np.int32),
        step=np.zeros((), np.int32),
        stats=np.zeros((L, len(STAT_FIELDS)), np.int32),
        reuse=np.zeros((len(REUSE_FIELDS),), np.int32),
    ))


def active_from_topk(topk_ids, num_experts: int):
    """Active-expert mask of one MoE layer from the router's top-k ids (elementwise: no scatter).

    Args:
        topk_ids: i32[T, k] expert ids in [0, E); negative ids (padding) are ignored.
        num_experts: E.
    Returns:
        bool[E], True for every expert routed to by at least one token.
    """
    ids = jnp.asarray(topk_ids, jnp.int32).reshape(-1)  # i32[T*k]
    return jnp.any(ids[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :], axis=0)  # bool[E]


# Plans with at most this many fills pick them by repeated argmax / argmin (a few fused reductions); larger ones
# (prefill: many tokens activate every expert) sort the candidates once. Both orders are identical.
_SELECT_BY_REDUCTION = 8


def _best_first(keys, count: int, largest: bool):
    """Indices of the `count` best entries of keys i32[n], best first, ties to the lower index: the same order as a
    stable sort by key (descending if largest, else ascending). count is static. Returns i32[count]."""
    n = keys.shape[0]
    if count > _SELECT_BY_REDUCTION:
        order_key = -keys if largest else keys  # callers keep keys away from INT32_MIN, so the negation is exact
        _, order = jax.lax.sort((order_key, jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)
        return order[:count]
    worst = jnp.iinfo(jnp.int32).min if largest else jnp.iinfo(jnp.int32).max
    picked = []
    for _ in range(count):
        i = (jnp.argmax(keys) if largest else jnp.argmin(keys)).astype(jnp.int32)  # first of the ties
        picked.append(i)
        keys = jnp.where(jnp.arange(n) == i, worst, keys)
    return jnp.stack(picked)


class _Layer(NamedTuple):
    """This layer's view of the cache (step 1 of plan_layer). E experts, S slots."""

    base: jax.Array  # i32[] flat id of expert 0 of this layer
    row: jax.Array  # i32[E] slot of each expert of this layer, -1 = not resident
    hit: jax.Array  # bool[E] active & resident
    miss: jax.Array  # bool[E] active & not resident
    m: jax.Array  # i32[] number of misses
    n_hits: jax.Array  # i32[]


class _Fills(NamedTuple):
    """The chosen fetches and their victim slots (step 3 of plan_layer). P = the plan's fill bound."""

    take: jax.Array  # bool[P] entry i is a fill (i < F)
    victims: jax.Array  # i32[P] victim slot of each entry, least recently used first
    evicted: jax.Array  # i32[P] flat id each victim slot held before (-1 = empty)
    flat_ids: jax.Array  # i32[P] bank rows to copy, -1 = padding
    slot_ids: jax.Array  # i32[P] destination slots, -1 = padding
    fetch: jax.Array  # bool[E] the fetched misses


def _check_plan(state: CacheState, layer, active, policy: Policy, max_active: int | None) -> int:
    """Trace-time checks of plan_layer's arguments (its Raises). Returns P = min(E, S[, max_active])."""
    L, E = state.slot_of_expert.shape
    S = state.expert_of_slot.shape[0]
    if max_active is not None and max_active < 1:
        raise ValueError(f"expert_cache.plan_layer: max_active must be >= 1, got {max_active}")
    if active.shape != (E,) or active.dtype != jnp.bool_:
        raise ValueError(f"expert_cache.plan_layer: active must be bool[{E}], got {active.dtype}{list(active.shape)}")
    if isinstance(layer, int):
        if not 0 <= layer < L:
            raise ValueError(f"expert_cache.plan_layer: layer must be in [0, {L}), got {layer}")
    if jnp.shape(layer) != ():
        raise ValueError(f"expert_cache.plan_layer: layer must be a scalar, got shape {list(jnp.shape(layer))}")
    if policy.kind is PolicyKind.AUTO and policy.costs is None:
        raise ValueError("expert_cache.plan_layer: the auto policy has no costs yet; set them from bandwidths "
                         "(Policy.with_costs(auto_costs(...)))")
    if policy.kind is PolicyKind.AUTO and state.lanes is None:
        raise ValueError("expert_cache.plan_layer: the auto policy needs a cache state with its lanes "
                         "(init_cache_state(..., auto=True))")
    if policy.kind is PolicyKind.RESIDENT and S != L * E:
        raise ValueError(f"expert_cache.plan_layer: resident policy needs S = L*E = {L * E} slots "
                         f"(init_cache_state_resident), got S = {S}")
    return min(E, S) if max_active is None else min(E, S, max_active)


def _classify(state: CacheState, layer, active) -> _Layer:
    """Step 1: hits (active and resident) and misses (active, not resident) of this layer."""
    E = state.slot_of_expert.shape[1]
    row = jax.lax.dynamic_index_in_dim(state.slot_of_expert, layer, keepdims=False)  # i32[E]
    hit = active & (row >= 0)  # bool[E]
    miss = active & (row < 0)  # bool[E]
    return _Layer(layer * E, row, hit, miss, jnp.sum(miss, dtype=jnp.int32), jnp.sum(hit, dtype=jnp.int32))


def _slots_in_layer(ids, base, E: int):
    """(in_layer bool[S], local i32[S] clipped to [0, E)) of flat ids i32[S] relative to this layer."""
    local = ids - base  # expert index within this layer (if in range)
    return (ids >= 0) & (local >= 0) & (local < E), jnp.clip(local, 0, E - 1)


def _observe_misses(state: CacheState, layer, lay: _Layer):
    """auto, step 2a: the repeat misses: misses whose expert was active (recency >= 0) no earlier than the least
    recently used slot's last use, i.e. that a fill at their previous activation would still hold under LRU. If the
    layer has misses, the decayed sums (x32, 1/1024 per such call) of repeat misses and misses take them in.
    Returns reuse i32[2]."""
    recency = jax.lax.dynamic_index_in_dim(state.recency, layer, keepdims=False)  # i32[E]
    repeat = lay.miss & (recency >= 0) & (recency >= jnp.min(state.usage))  # bool[E]
    seen = state.reuse - (state.reuse >> AUTO_DECAY_SHIFT) + \
        32 * jnp.stack([jnp.sum(repeat, dtype=jnp.int32), lay.m])  # i32[2]
    return jnp.where(lay.m > 0, seen, state.reuse)


def _eligible_slots(state: CacheState, lay: _Layer, active):
    """Eligible victims: every slot except those holding an expert active in this layer. Returns bool[S]."""
    in_layer, local = _slots_in_layer(state.expert_of_slot, lay.base, lay.row.shape[0])
    return ~(in_layer & active[local])


def _choose_fills(state: CacheState, layer, lay: _Layer, eligible, count, P: int) -> _Fills:
    """Step 3: the `count` most recently active misses and the least recently used eligible slots.

    Misses by recency, most recent first, ties to the lower id; never-seen (-1) after every seen one; other experts
    last. Keys clamp to >= INT32_MIN + 2 so that they stay ahead of the non-misses after the wrap. Slots by usage,
    least recently used first, ties to the lower slot; ineligible slots last."""
    E = lay.row.shape[0]
    int_max = jnp.iinfo(jnp.int32).max
    recency = jax.lax.dynamic_index_in_dim(state.recency, layer, keepdims=False)  # i32[E]
    floor = jnp.iinfo(jnp.int32).min + 1
    fetched = _best_first(jnp.where(lay.miss, jnp.maximum(recency, floor + 1), floor), P, largest=True)  # i32[P]
    victims = _best_first(jnp.where(eligible, jnp.minimum(state.usage, int_max - 1), int_max), P,
                          largest=False)  # i32[P]
    take = jnp.arange(P, dtype=jnp.int32) < count  # bool[P]; count <= min(m, eligible) <= P
    flat_ids = jnp.where(take, lay.base + fetched, -1)  # i32[P]
    fetch = jnp.any(take[:, None] & (fetched[:, None] == jnp.arange(E, dtype=jnp.int32)[None, :]), axis=0)  # bool[E]
    return _Fills(take, victims, state.expert_of_slot[victims], flat_ids, jnp.where(take, victims, -1), fetch)


def _apply_fills(state: CacheState, fills: _Fills):
    """Step 4: the tables after the fills: evicted experts become non-resident, fetched ones point at their slot.
    Returns (slot_of_expert i32[L, E], expert_of_slot i32[S])."""
    L, E = state.slot_of_expert.shape
    S = state.expert_of_slot.shape[0]
    P = fills.take.shape[0]
    # Out-of-range index = no-op (mode="drop"); -1 must not be used as an index (it would wrap).
    flat_updates = jnp.concatenate([jnp.where(fills.take & (fills.evicted >= 0), fills.evicted, L * E),
                                    jnp.where(fills.take, fills.flat_ids, L * E)])
    slot_of_expert = state.slot_of_expert.reshape(L * E).at[flat_updates].set(
        jnp.concatenate([jnp.full((P,), -1, jnp.int32), fills.victims]), mode="drop").reshape(L, E)
    expert_of_slot = state.expert_of_slot.at[jnp.where(fills.take, fills.victims, S)].set(fills.flat_ids,
                                                                                          mode="drop")
    return slot_of_expert, expert_of_slot


def _layer_stats(state: CacheState, layer, active, lay: _Layer, count):
    """Step 5: this call's (active, hits, misses, fetched, host) i32[5] and the per-layer counters i32[L, 6]."""
    call_stats = jnp.stack([jnp.sum(active, dtype=jnp.int32), lay.n_hits, lay.m, count, lay.m - count])  # i32[5]
    stats_row = jax.lax.dynamic_index_in_dim(state.stats, layer, keepdims=False) + \
        jnp.concatenate([call_stats, jnp.ones((1,), jnp.int32)])  # i32[6]
    return call_stats, jax.lax.dynamic_update_index_in_dim(state.stats, stats_row, layer, axis=0)


def _fill_tables(state: CacheState, layer, active, lay: _Layer, count, P: int):
    """Steps 3-4 and the usage update of 5 for `count` fills: (slot_of_expert, expert_of_slot, usage after the call,
    the _Fills)."""
    S = state.expert_of_slot.shape[0]
    eligible = _eligible_slots(state, lay, active)  # bool[S]
    fills = _choose_fills(state, layer, lay, eligible, count, P)  # 3
    slot_of_expert, expert_of_slot = _apply_fills(state, fills)  # 4
    # 5: hits and fills get usage = step (one scatter; a hit's slot is unchanged by this call's fills).
    usage_slots = jnp.concatenate([jnp.where(lay.hit, lay.row, S), jnp.where(fills.take, fills.victims, S)])
    return slot_of_expert, expert_of_slot, state.usage.at[usage_slots].set(state.step, mode="drop"), fills


def _fetchable_misses(lay: _Layer, fetchable) -> _Layer:
    """The layer's view with only the misses the policy may fetch (plan_layer's `fetchable` bool[E]; None: all)."""
    if fetchable is None:
        return lay
    miss = lay.miss & fetchable
    return lay._replace(miss=miss, m=jnp.sum(miss, dtype=jnp.int32))


def _lane_call(state: CacheState, tables, candidate, layer, active, costs, P: int, fetchable):
    """One lane's plan of this call (vmapped over the lanes): the real cache's recency and step with the lane's own
    tables (slot_of_expert i32[L, E], expert_of_slot i32[S], usage i32[S], reuse i32[2]) and the split of its
    candidate (i32[], index into AUTO_CANDIDATES) among the fetchable misses (bool[E] or None: all). Returns (the
    lane's new tables, its modelled ticks i32[])."""
    lane = state._replace(slot_of_expert=tables[0], expert_of_slot=tables[1], usage=tables[2], reuse=tables[3],
                          lanes=None)
    lay = _classify(lane, layer, active)
    reuse = _observe_misses(lane, layer, lay)
    wanted = _fetchable_misses(lay, fetchable)
    evictable = jnp.sum(_eligible_slots(lane, lay, active), dtype=jnp.int32)
    count = auto_candidate_counts(costs, wanted.m, lay.n_hits, evictable, reuse, P)[candidate]
    slot_of_expert, expert_of_slot, usage, _ = _fill_tables(lane, layer, active, wanted, count, P)
    ticks = auto_layer_ticks(costs, lay.m, lay.n_hits, count)
    return (slot_of_expert, expert_of_slot, usage, reuse), ticks


def _warm_credit(lanes: LaneState, costs):
    """What each candidate's cache is worth at a leader check, ticks i32[C]: one hit for every expert active in the
    window (LaneState.window_active) that its lane's tables hold -- what a cache without it loses at the expert's next
    activation --, at what a hit saves against a host GEMV (host_solo; on a CPU device, serial, host_solo - device).
    host-all (a cold cache) gets none. Without it a lane's window cost is myopic: a rule that fills less leaves a
    colder cache for the next window at the same cost (docs/policies.md). The count is clipped at 2^20 experts and
    host_solo <= AUTO_TICKS = 2^10 ticks, so the credit stays below 2^30: no int32 overflow in cost - credit."""
    warm = jnp.sum(lanes.window_active[None] & (lanes.slot_of_expert >= 0), axis=(1, 2), dtype=jnp.int32)  # i32[K]
    saving = max(costs.host_solo - (costs.device if costs.serial else 0), 0)  # static int
    credit = jnp.minimum(warm, 1 << 20) * saving  # i32[K]
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), credit.astype(jnp.int32)])


def _advance_lanes(state: CacheState, layer, active, costs, P: int, fetchable) -> LaneState:
    """auto, step 2b (docs/policies.md, "The auto rule"): at a leader check -- a window of AUTO_WINDOW_TOKENS calls of
    every layer has ended, or, in the first window, every AUTO_FIRST_CHECK_TOKENS tokens -- the candidate with the
    lowest score (window cost minus _warm_credit) becomes the leader (the current one on ties); at a window's end
    every lane then restarts from a copy of the real cache's tables, the costs at 0 and no expert active. Then this
    call's active experts are marked, every lane plans this call with its candidate's split and every
    candidate adds its modelled ticks (host-all: this call's active experts as misses of a cold cache)."""
    lanes = state.lanes
    L = state.slot_of_expert.shape[0]
    K = lanes.usage.shape[0]
    boundary = state.step - lanes.window_start >= AUTO_WINDOW_TOKENS * L
    first = (lanes.window_start == 0) & (state.step > 0) & (state.step % (AUTO_FIRST_CHECK_TOKENS * L) == 0)
    check = boundary | first
    score = lanes.cost - jax.lax.cond(check, lambda: _warm_credit(lanes, costs), lambda: jnp.zeros_like(lanes.cost))
    best = jnp.argmin(score).astype(jnp.int32)
    leader = jnp.where(check & (score[best] < score[lanes.leader]), best, lanes.leader)
    real = (state.slot_of_expert, state.expert_of_slot, state.usage, state.reuse)
    tables = tuple(jnp.where(boundary, jnp.broadcast_to(r, t.shape), t)
                   for r, t in zip(real, (lanes.slot_of_expert, lanes.expert_of_slot, lanes.usage, lanes.reuse)))
    cost = jnp.where(boundary, 0, lanes.cost)
    window_active = lanes.window_active & ~boundary  # bool[L, E]
    row = jax.lax.dynamic_index_in_dim(window_active, layer, keepdims=False) | active  # bool[E]
    window_active = jax.lax.dynamic_update_index_in_dim(window_active, row, layer, axis=0)
    tables, ticks = jax.vmap(_lane_call, in_axes=(None, 0, 0, None, None, None, None, None))(
        state, tables, jnp.arange(1, K + 1, dtype=jnp.int32), layer, active, costs, P, fetchable)  # ticks i32[K]
    cold = auto_layer_ticks(costs, jnp.sum(active, dtype=jnp.int32), 0, 0)  # host-all from a cold cache
    ticks = jnp.concatenate([cold[None], ticks])  # i32[C]
    cost = jnp.minimum(cost, AUTO_MAX_COST) + jnp.clip(ticks, 0, AUTO_MAX_COST)  # no int32 overflow: < 2^31
    return LaneState(*tables, cost=jnp.minimum(cost, AUTO_MAX_COST), window_active=window_active, leader=leader,
                     window_start=jnp.where(boundary, state.step, lanes.window_start))


def plan_layer(state: CacheState, layer, active, policy: Policy, max_active: int | None = None,
               fetchable=None) -> tuple[CacheState, LayerPlan]:
    """Plan one MoE layer's experts and update the cache tables (rules: module docstring, docs/DESIGN.md sec. 1-3).

    Steps: 1 classify hits and misses; 2 F from the policy's split (policy.fetch_split; auto first counts its repeat
    misses and advances its lanes, then follows its leader); 3 choose the fetched misses and their victim slots;
    4 update the tables; 5 usage, recency and stats. host-all and resident never fetch (steps 2-4 skipped).
    Pure static-shape jnp, jit-compatible; `policy` must be static (a frozen, hashable dataclass), its branch chosen
    in Python at trace time. No sort for plans of at most 8 fills (decode): repeated argmax / argmin.

    Args:
        state: CacheState with shapes [L, E] / [S] (auto: with its lanes, init_cache_state(..., auto=True)); the
            lanes of a state pass other policies unchanged.
        layer: MoE layer index in [0, L): Python int or traced i32[] (out-of-range traced values are not checked).
        active: bool[E] active-expert mask of this layer (e.g. active_from_topk).
        policy: Policy; "resident" requires S == L*E (init_cache_state_resident).
        max_active: static bound on the number of active experts (T * k for T tokens of top-k routing), which
            bounds the fills: P = min(E, S, max_active). None: P = min(E, S).
        fetchable: bool[E], the misses the policy may fetch (prefill: the experts routed enough tokens to be worth
            their fill, OffloadedExperts.fetch_min_tokens); the others are computed on the host. None: every miss.
    Returns:
        (new_state, LayerPlan). new_state.step = state.step + 1.
    Raises:
        ValueError (trace time): active is not bool[E], layer out of range or not a scalar, resident policy with
        S != L*E, qstar policy without a fraction, auto policy without costs or without lanes, max_active < 1.
    """
    active = jnp.asarray(active)
    P = _check_plan(state, layer, active, policy, max_active)
    layer = jnp.asarray(layer, jnp.int32)
    S = state.expert_of_slot.shape[0]
    lay = _classify(state, layer, active)  # 1
    slot_of_expert, expert_of_slot, usage = state.slot_of_expert, state.expert_of_slot, state.usage
    reuse, lanes = state.reuse, state.lanes  # auto updates them
    if not policy.kind.fetches:
        count = jnp.zeros((), jnp.int32)
        fetch = jnp.zeros_like(active)
        fill_flat_ids = fill_slot_ids = jnp.full((P,), -1, jnp.int32)
        usage = usage.at[jnp.where(lay.hit, lay.row, S)].set(state.step, mode="drop")  # 5: hits get usage = step
    else:
        leader = None
        if policy.kind is PolicyKind.AUTO:
            reuse = _observe_misses(state, layer, lay)  # 2a
            lanes = _advance_lanes(state, layer, active, policy.costs, P, fetchable)  # 2b
            leader = lanes.leader
        wanted = _fetchable_misses(lay, fetchable)
        evictable = jnp.sum(_eligible_slots(state, lay, active), dtype=jnp.int32)
        count = fetch_split(policy, wanted.m, lay.n_hits, evictable, reuse, P, leader)  # 2: F
        slot_of_expert, expert_of_slot, usage, fills = _fill_tables(state, layer, active, wanted, count, P)  # 3-5
        fetch, fill_flat_ids, fill_slot_ids = fills.fetch, fills.flat_ids, fills.slot_ids

    # 5: every active expert gets recency = step; the stats.
    recency_row = jnp.where(active, state.step, jax.lax.dynamic_index_in_dim(state.recency, layer, keepdims=False))
    recency = jax.lax.dynamic_update_index_in_dim(state.recency, recency_row, layer, axis=0)
    device_row = jax.lax.dynamic_index_in_dim(slot_of_expert, layer, keepdims=False)  # i32[E] after the fills
    call_stats, stats = _layer_stats(state, layer, active, lay, count)
    new_state = CacheState(slot_of_expert=slot_of_expert, expert_of_slot=expert_of_slot, usage=usage,
                           recency=recency, step=state.step + 1, stats=stats, reuse=reuse, lanes=lanes)
    plan = LayerPlan(fill_flat_ids=fill_flat_ids, fill_slot_ids=fill_slot_ids,
                     device_slot_of_expert=jnp.where(lay.hit | fetch, device_row, -1), host_mask=lay.miss & ~fetch,
                     stats=call_stats)
    return new_state, plan
