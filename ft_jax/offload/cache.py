"""Expert slot cache: device-side tables and the per-MoE-layer plan, as pure static-shape jnp (docs/DESIGN.md sec. 1-3).

One pool of S device slots is shared by all L MoE layers. On every MoE-layer call `plan_layer` splits the layer's
active experts into hits (resident in a slot), fetched misses (copied into a slot by the slot-fill FFI call) and host
misses (computed on the CPU from the host bank), picks victim slots with a global LRU, and updates the tables. All
shapes depend only on (L, E, S): one compiled decode step replays for any routing.

Rules: hit = active & resident; miss = active & ~resident; F = policy.fetch_split (the policy's split). Misses are
fetched most recently active first (ties to the lower id, never-seen last); victims are the least recently used
slots (ties to the lowest slot), never one holding an expert active in this layer; F is capped by the eligible
slots. Hits and fills set usage = step; active experts get recency = step; step += 1 per call (int32: wraps after
2^31 - 1 calls, after which the LRU order is no longer meaningful but outputs stay correct). The auto policy's reuse
bookkeeping (slot gains, ghosts, decayed sums) and the full rules: docs/DESIGN.md sec. 12 ("offload/cache.py").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ft_jax.offload.policy import AUTO_DECAY_SHIFT, AUTO_GAIN_CLAMP, REUSE_FIELDS, Policy, PolicyKind, fetch_split

# Columns of CacheState.stats (per MoE layer); LayerPlan.stats holds the first five for one call.
STAT_FIELDS = ("active", "hits", "misses", "fetched", "host", "steps")


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
        slot_gain: i32[S] auto only: net hits of the slot's expert since its fill (module docstring), 0 otherwise.
        ghost_of_slot: i32[S] auto only: flat id the slot's latest fill evicted, -1 = none.
        reuse: i32[4] auto only: decayed sums (x32) policy.REUSE_FIELDS: the evicted replacement fills' net hits and
            their count (1/1024 decay per eviction), this cache's repeat misses and misses (1/1024 decay per call
            with a miss; docs/policies.md).
    The slot arrays themselves (e.g. gate_up [S, 2I, H], down [S, H, I]) live with the decode step, not here.
    """

    slot_of_expert: jax.Array
    expert_of_slot: jax.Array
    usage: jax.Array
    recency: jax.Array
    step: jax.Array
    stats: jax.Array
    slot_gain: jax.Array
    ghost_of_slot: jax.Array
    reuse: jax.Array


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


def init_cache_state(num_layers: int, num_experts: int, num_slots: int) -> CacheState:
    """Cold cache: every slot empty, nothing seen yet, step 0.

    Args:
        num_layers: L, number of MoE layers.
        num_experts: E, routed experts per MoE layer.
        num_slots: S, device slots shared by all layers.
    Returns:
        CacheState with slot_of_expert, expert_of_slot, usage, recency, ghost_of_slot all -1; step, stats,
        slot_gain, reuse zeros.
    Raises:
        ValueError: a dimension is not a positive int.
    """
    _check_dims(num_layers=num_layers, num_experts=num_experts, num_slots=num_slots)
    L, E, S = num_layers, num_experts, num_slots
    return CacheState(
        slot_of_expert=jnp.full((L, E), -1, jnp.int32),
        expert_of_slot=jnp.full((S,), -1, jnp.int32),
        usage=jnp.full((S,), -1, jnp.int32),
        recency=jnp.full((L, E), -1, jnp.int32),
        step=jnp.zeros((), jnp.int32),
        stats=jnp.zeros((L, len(STAT_FIELDS)), jnp.int32),
        slot_gain=jnp.zeros((S,), jnp.int32),
        ghost_of_slot=jnp.full((S,), -1, jnp.int32),
        reuse=jnp.zeros((len(REUSE_FIELDS),), jnp.int32),
    )


def init_cache_state_resident(num_layers: int, num_experts: int) -> CacheState:
    """Fully resident cache for the "resident" policy: S = L*E slots, slot s holds flat id s.

    Returns:
        CacheState with slot_of_expert[l, e] = l*E + e, expert_of_slot[s] = s, usage and recency -1, step 0.
    Raises:
        ValueError: a dimension is not a positive int.
    """
    _check_dims(num_layers=num_layers, num_experts=num_experts)
    L, E = num_layers, num_experts
    flat = jnp.arange(L * E, dtype=jnp.int32)  # i32[L*E]
    return CacheState(
        slot_of_expert=flat.reshape(L, E),
        expert_of_slot=flat,
        usage=jnp.full((L * E,), -1, jnp.int32),
        recency=jnp.full((L, E), -1, jnp.int32),
        step=jnp.zeros((), jnp.int32),
        stats=jnp.zeros((L, len(STAT_FIELDS)), jnp.int32),
        slot_gain=jnp.zeros((L * E,), jnp.int32),
        ghost_of_slot=jnp.full((L * E,), -1, jnp.int32),
        reuse=jnp.zeros((len(REUSE_FIELDS),), jnp.int32),
    )


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


def _observe_reuse(state: CacheState, lay: _Layer):
    """auto, step 2a: each slot's net hits since its fill: +1 per hit, -1 per miss on the expert its fill evicted
    (its ghost), clamped to +-AUTO_GAIN_CLAMP. Returns slot_gain i32[S]."""
    E = lay.row.shape[0]
    in_layer, local = _slots_in_layer(state.expert_of_slot, lay.base, E)
    ghost_in_layer, ghost_local = _slots_in_layer(state.ghost_of_slot, lay.base, E)
    ghost_miss = ghost_in_layer & lay.miss[ghost_local]  # bool[S]
    slot_hit = in_layer & lay.hit[local]  # bool[S]
    return jnp.clip(state.slot_gain + slot_hit.astype(jnp.int32) - ghost_miss.astype(jnp.int32),
                    -AUTO_GAIN_CLAMP, AUTO_GAIN_CLAMP)


def _observe_misses(state: CacheState, layer, lay: _Layer):
    """auto, step 2b: the repeat misses: misses whose expert was active (recency >= 0) no earlier than the least
    recently used slot's last use, i.e. that a fill at their previous activation would still hold under LRU. If the
    layer has misses, the decayed sums (x32, 1/1024 per such call) of repeat misses and misses take them in.
    Returns reuse i32[4] with entries 2 and 3 updated."""
    recency = jax.lax.dynamic_index_in_dim(state.recency, layer, keepdims=False)  # i32[E]
    repeat = lay.miss & (recency >= 0) & (recency >= jnp.min(state.usage))  # bool[E]
    seen = state.reuse[2:] - (state.reuse[2:] >> AUTO_DECAY_SHIFT) + \
        32 * jnp.stack([jnp.sum(repeat, dtype=jnp.int32), lay.m])  # i32[2]
    return jnp.concatenate([state.reuse[:2], jnp.where(lay.m > 0, seen, state.reuse[2:])])


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


def _realize_reuse(state: CacheState, fills: _Fills, slot_gain, reuse):
    """auto, step 4b: each fill that replaces an expert (its slot's previous fill had evicted one too) adds that slot's
    gain to the decayed sums, in fill order; the filled slots start afresh with the evicted expert as their ghost.
    Returns (slot_gain i32[S], ghost_of_slot i32[S], reuse i32[4] with entries 0 and 1 updated)."""
    S = state.expert_of_slot.shape[0]
    take, victims, evicted = fills.take, fills.victims, fills.evicted

    def realize(i, sums):
        gain, count = sums
        evicts = take[i] & (evicted[i] >= 0) & (state.ghost_of_slot[victims[i]] >= 0)  # a replacement
        gain = jnp.where(evicts, gain - (gain >> AUTO_DECAY_SHIFT) + 32 * slot_gain[victims[i]], gain)
        count = jnp.where(evicts, count - (count >> AUTO_DECAY_SHIFT) + 32, count)
        return gain, count

    realized = jnp.stack(jax.lax.fori_loop(0, take.shape[0], realize, (reuse[0], reuse[1])))  # i32[2]
    reuse = jnp.concatenate([realized, reuse[2:]])
    filled = jnp.where(take, victims, S)  # i32[P]
    return slot_gain.at[filled].set(0, mode="drop"), state.ghost_of_slot.at[filled].set(evicted, mode="drop"), reuse


def _layer_stats(state: CacheState, layer, active, lay: _Layer, count):
    """Step 5: this call's (active, hits, misses, fetched, host) i32[5] and the per-layer counters i32[L, 6]."""
    call_stats = jnp.stack([jnp.sum(active, dtype=jnp.int32), lay.n_hits, lay.m, count, lay.m - count])  # i32[5]
    stats_row = jax.lax.dynamic_index_in_dim(state.stats, layer, keepdims=False) + \
        jnp.concatenate([call_stats, jnp.ones((1,), jnp.int32)])  # i32[6]
    return call_stats, jax.lax.dynamic_update_index_in_dim(state.stats, stats_row, layer, axis=0)


def plan_layer(state: CacheState, layer, active, policy: Policy, max_active: int | None = None,
               fetchable=None) -> tuple[CacheState, LayerPlan]:
    """Plan one MoE layer's experts and update the cache tables (rules: module docstring, docs/DESIGN.md sec. 1-3).

    Steps: 1 classify hits and misses; 2 F from the policy's split (policy.fetch_split; auto first observes the
    reuse of its fills and its repeat misses); 3 choose the fetched misses and their victim slots; 4 update the
    tables (auto: realize the evicted fills' reuse); 5 usage, recency and stats. host-all and resident never fetch
    (steps 2-4 skipped).
    Pure static-shape jnp, jit-compatible; `policy` must be static (a frozen, hashable dataclass), its branch chosen
    in Python at trace time. No sort for plans of at most 8 fills (decode): repeated argmax / argmin.

    Args:
        state: CacheState with shapes [L, E] / [S].
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
        S != L*E, qstar policy without a fraction, auto policy without costs, max_active < 1.
    """
    active = jnp.asarray(active)
    P = _check_plan(state, layer, active, policy, max_active)
    layer = jnp.asarray(layer, jnp.int32)
    S = state.expert_of_slot.shape[0]
    lay = _classify(state, layer, active)  # 1
    slot_of_expert, expert_of_slot = state.slot_of_expert, state.expert_of_slot
    slot_gain, ghost_of_slot, reuse = state.slot_gain, state.ghost_of_slot, state.reuse  # auto updates them
    if not policy.kind.fetches:
        count = jnp.zeros((), jnp.int32)
        fetch = jnp.zeros_like(active)
        fill_flat_ids = fill_slot_ids = jnp.full((P,), -1, jnp.int32)
        usage_slots = jnp.where(lay.hit, lay.row, S)  # i32[E] slots to mark used (S = none)
    else:
        eligible = _eligible_slots(state, lay, active)  # bool[S]
        if policy.kind is PolicyKind.AUTO:
            slot_gain = _observe_reuse(state, lay)  # 2a
            reuse = _observe_misses(state, layer, lay)  # 2b
        wanted = lay if fetchable is None else lay._replace(miss=lay.miss & fetchable,
                                                            m=jnp.sum(lay.miss & fetchable, dtype=jnp.int32))
        count = fetch_split(policy, wanted.m, lay.n_hits, jnp.sum(eligible, dtype=jnp.int32), reuse, P)  # 2: F
        fills = _choose_fills(state, layer, wanted, eligible, count, P)  # 3
        slot_of_expert, expert_of_slot = _apply_fills(state, fills)  # 4
        if policy.kind is PolicyKind.AUTO:
            slot_gain, ghost_of_slot, reuse = _realize_reuse(state, fills, slot_gain, reuse)  # 4b
        fetch, fill_flat_ids, fill_slot_ids = fills.fetch, fills.flat_ids, fills.slot_ids
        usage_slots = jnp.concatenate([jnp.where(lay.hit, lay.row, S), jnp.where(fills.take, fills.victims, S)])

    # 5: hits and fills get usage = step (one scatter; a hit's slot is unchanged by this call's fills), every
    # active expert recency = step.
    step = state.step
    usage = state.usage.at[usage_slots].set(step, mode="drop")
    recency_row = jnp.where(active, step, jax.lax.dynamic_index_in_dim(state.recency, layer, keepdims=False))
    recency = jax.lax.dynamic_update_index_in_dim(state.recency, recency_row, layer, axis=0)
    device_row = jax.lax.dynamic_index_in_dim(slot_of_expert, layer, keepdims=False)  # i32[E] after the fills
    call_stats, stats = _layer_stats(state, layer, active, lay, count)
    new_state = CacheState(slot_of_expert=slot_of_expert, expert_of_slot=expert_of_slot, usage=usage,
                           recency=recency, step=step + 1, stats=stats, slot_gain=slot_gain,
                           ghost_of_slot=ghost_of_slot, reuse=reuse)
    plan = LayerPlan(fill_flat_ids=fill_flat_ids, fill_slot_ids=fill_slot_ids,
                     device_slot_of_expert=jnp.where(lay.hit | fetch, device_row, -1), host_mask=lay.miss & ~fetch,
                     stats=call_stats)
    return new_state, plan
