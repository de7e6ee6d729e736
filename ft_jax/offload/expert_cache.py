"""Expert slot cache: device-side tables and the per-MoE-layer plan, as pure static-shape jnp (docs/DESIGN.md sec. 1-3).

One pool of S device slots is shared by all L MoE layers. On every MoE-layer call `plan_layer` takes the layer's
active-expert mask, splits the active experts into hits (resident in a slot), fetched misses (copied into a slot by
the slot-fill FFI call) and host misses (computed on the CPU from the host bank), picks victim slots with a global
LRU, and updates the tables. All shapes depend only on (L, E, S): one compiled decode step replays for any routing.

Rules (docs/DESIGN.md sec. 1 and sec. 3 steps 2-4):
  hit = active & resident; miss = active & ~resident; m = sum(miss); F = fetch_budget(policy, m).
  Misses are ranked most recently active first (recency = global step of the last activation), ties to the lower
  expert id, never-seen (recency -1) last; the F best-ranked are fetched, the rest go to the host.
  Victim slots: smallest usage (global step of the last hit or fill; -1 for a never-used slot), ties to the lowest
  slot, never a slot whose expert is active in the current layer. If fewer slots are eligible than F (e.g. S < k,
  or every slot holds an active expert of this layer), F is capped by the number of eligible slots and the rest of
  the misses go to the host. An evicted expert becomes non-resident (no stale hit).
  Hits and fills set usage = step; every active expert gets recency = step; then step += 1 (once per MoE-layer call).

Integer width: jax runs with x64 off, so the global step, usage, recency and stats are int32. step wraps after
2^31 - 1 MoE-layer calls (about 67 million decoded tokens with 32 MoE layers); past that the LRU and recency
orders are no longer meaningful (the outputs stay correct: every route is still computed exactly once). The stats
counters wrap likewise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ft_jax.offload.policy import Policy, fetch_budget

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
    The slot arrays themselves (e.g. gate_up [S, 2I, H], down [S, H, I]) live with the decode step, not here.
    """

    slot_of_expert: jax.Array
    expert_of_slot: jax.Array
    usage: jax.Array
    recency: jax.Array
    step: jax.Array
    stats: jax.Array


class LayerPlan(NamedTuple):
    """What one MoE layer must do this step (output of plan_layer). P = min(E, S) (static).

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
        CacheState with slot_of_expert, expert_of_slot, usage, recency all -1; step 0; stats zeros.
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
    )


def active_from_topk(topk_ids, num_experts: int):
    """Active-expert mask of one MoE layer from the router's top-k ids.

    Args:
        topk_ids: i32[T, k] expert ids in [0, E); negative ids (padding) are ignored.
        num_experts: E.
    Returns:
        bool[E], True for every expert routed to by at least one token.
    """
    ids = jnp.asarray(topk_ids, jnp.int32).reshape(-1)  # i32[T*k]
    ids = jnp.where(ids >= 0, ids, num_experts)  # padding -> out of range, dropped (negative ids would wrap)
    return jnp.zeros((num_experts,), jnp.bool_).at[ids].set(True, mode="drop")


def plan_layer(state: CacheState, layer, active, policy: Policy) -> tuple[CacheState, LayerPlan]:
    """Plan one MoE layer's experts and update the cache tables (rules: module docstring, docs/DESIGN.md sec. 1-3).

    Pure static-shape jnp, jit-compatible; `policy` must be static (it is a frozen, hashable dataclass) and its
    branch is chosen in Python at trace time. host-all and resident never fetch, so they skip victim selection.

    Args:
        state: CacheState with shapes [L, E] / [S].
        layer: MoE layer index in [0, L): Python int or traced i32[] (out-of-range traced values are not checked).
        active: bool[E] active-expert mask of this layer (e.g. active_from_topk).
        policy: Policy; "resident" requires S == L*E (init_cache_state_resident).
    Returns:
        (new_state, LayerPlan). new_state.step = state.step + 1.
    Raises:
        ValueError (trace time): active is not bool[E], layer out of range or not a scalar, resident policy with
        S != L*E, qstar policy without a fraction.
    """
    L, E = state.slot_of_expert.shape
    S = state.expert_of_slot.shape[0]
    P = min(E, S)
    active = jnp.asarray(active)
    if active.shape != (E,) or active.dtype != jnp.bool_:
        raise ValueError(f"expert_cache.plan_layer: active must be bool[{E}], got {active.dtype}{list(active.shape)}")
    if isinstance(layer, int):
        if not 0 <= layer < L:
            raise ValueError(f"expert_cache.plan_layer: layer must be in [0, {L}), got {layer}")
    layer = jnp.asarray(layer, jnp.int32)
    if layer.shape != ():
        raise ValueError(f"expert_cache.plan_layer: layer must be a scalar, got shape {list(layer.shape)}")
    if policy.kind == "resident" and S != L * E:
        raise ValueError(f"expert_cache.plan_layer: resident policy needs S = L*E = {L * E} slots "
                         f"(init_cache_state_resident), got S = {S}")

    step = state.step
    base = layer * E  # i32[] flat id of expert 0 of this layer
    expert_ids = jnp.arange(E, dtype=jnp.int32)  # i32[E]
    row = state.slot_of_expert[layer]  # i32[E]
    hit = active & (row >= 0)  # bool[E]
    miss = active & (row < 0)  # bool[E]
    m = jnp.sum(miss, dtype=jnp.int32)  # i32[]

    slot_of_expert = state.slot_of_expert
    expert_of_slot = state.expert_of_slot
    usage = state.usage
    if policy.kind in ("host-all", "resident"):
        count = jnp.zeros((), jnp.int32)
        fetch = jnp.zeros((E,), jnp.bool_)
        fill_flat_ids = jnp.full((P,), -1, jnp.int32)
        fill_slot_ids = jnp.full((P,), -1, jnp.int32)
    else:
        # Eligible victims: every slot except those holding an expert active in this layer.
        local = expert_of_slot - base  # i32[S] expert index within this layer (if in range)
        in_layer = (expert_of_slot >= 0) & (local >= 0) & (local < E)  # bool[S]
        eligible = ~(in_layer & active[jnp.clip(local, 0, E - 1)])  # bool[S]
        count = jnp.minimum(fetch_budget(policy, m), jnp.sum(eligible, dtype=jnp.int32))  # i32[] F
        # One-key stable sorts (XLA's CPU sort costs ~2x more with lexsort's 3 keys). Ties keep the lower index.
        # Misses by recency, most recent first: key -recency (never-seen -1 -> 1, last); non-misses INT32_MAX.
        # Keys of candidates are clamped below INT32_MAX so they stay ahead even after the int32 wrap.
        int_max = jnp.iinfo(jnp.int32).max
        expert_key = jnp.where(miss, jnp.minimum(-state.recency[layer], int_max - 1), int_max)  # i32[E]
        _, rank = jax.lax.sort((expert_key, expert_ids), num_keys=1, is_stable=True)  # i32[E] experts, best first
        # Eligible slots by usage, least recently used first; ineligible slots INT32_MAX (last).
        slot_key = jnp.where(eligible, jnp.minimum(usage, int_max - 1), int_max)  # i32[S]
        _, lru = jax.lax.sort((slot_key, jnp.arange(S, dtype=jnp.int32)), num_keys=1, is_stable=True)  # i32[S]
        take = jnp.arange(P, dtype=jnp.int32) < count  # bool[P]; count <= min(m, eligible) <= P
        fetched = rank[:P]  # i32[P] expert index of the i-th fetch
        victims = lru[:P]  # i32[P] slot of the i-th fetch
        fill_flat_ids = jnp.where(take, base + fetched, -1)  # i32[P]
        fill_slot_ids = jnp.where(take, victims, -1)  # i32[P]
        fetch = jnp.zeros((E,), jnp.bool_).at[fetched].set(take)  # bool[E]; fetched ids are distinct

        # Out-of-range index = no-op (mode="drop"); -1 must not be used as an index (it would wrap).
        flat = slot_of_expert.reshape(L * E)  # i32[L*E]
        evicted = expert_of_slot[victims]  # i32[P] flat id previously held by each victim slot
        flat = flat.at[jnp.where(take & (evicted >= 0), evicted, L * E)].set(-1, mode="drop")
        flat = flat.at[jnp.where(take, fill_flat_ids, L * E)].set(victims, mode="drop")
        slot_of_expert = flat.reshape(L, E)
        expert_of_slot = expert_of_slot.at[jnp.where(take, victims, S)].set(fill_flat_ids, mode="drop")
        usage = usage.at[jnp.where(take, victims, S)].set(step, mode="drop")

    usage = usage.at[jnp.where(hit, row, S)].set(step, mode="drop")  # hits' slots (row unchanged for hits)
    recency = state.recency.at[layer].set(jnp.where(active, step, state.recency[layer]))
    host_mask = miss & ~fetch  # bool[E]
    device_slot_of_expert = jnp.where(hit | fetch, slot_of_expert[layer], -1)  # i32[E]
    call_stats = jnp.stack([jnp.sum(active, dtype=jnp.int32), jnp.sum(hit, dtype=jnp.int32), m, count,
                            m - count])  # i32[5]
    stats = state.stats.at[layer].add(jnp.concatenate([call_stats, jnp.ones((1,), jnp.int32)]))
    new_state = CacheState(slot_of_expert=slot_of_expert, expert_of_slot=expert_of_slot, usage=usage,
                           recency=recency, step=step + 1, stats=stats)
    plan = LayerPlan(fill_flat_ids=fill_flat_ids, fill_slot_ids=fill_slot_ids,
                     device_slot_of_expert=device_slot_of_expert, host_mask=host_mask, stats=call_stats)
    return new_state, plan
