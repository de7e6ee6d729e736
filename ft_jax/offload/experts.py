"""Offloaded expert execution: host banks + a device slot pool, split by the cache policy.

`OffloadedExperts` is the ExpertBackend the model calls for every MoE layer of a jit-compiled step: the cache plan
(ft_jax.offload.cache.plan_layer), one slot_fill for every pool, the slot experts and the host experts, summed (each
route computed exactly once). The step-by-step description, the GPU overlap and why the pools are carried in the
shape the FFI calls consume; the GPU forms count bad ids (fill_errors,
host_route_errors, checked by read_stats) where the CPU handlers raise: docs/DESIGN.md sec. 12 ("offload/experts.py") and docs/DESIGN.md sec. 3 and 5.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import ft_jax
from ft_jax.kernels import ffi_ops
from ft_jax.offload import cache as expert_cache
from ft_jax.offload.banks import ExpertBanks
from ft_jax.offload.policy import Policy, PolicyKind


def _no_errors() -> tuple[jax.Array, jax.Array]:
    """(fill_errors, host_route_errors) of a fresh state: i32[] zeros (numpy copied to the device: no XLA program
    to compile, as expert_cache.init_cache_state)."""
    return tuple(jax.device_put((np.zeros((), np.int32), np.zeros((), np.int32)), may_alias=False))


@functools.partial(jax.jit, static_argnums=0)
def _zero_pools(shapes: tuple[tuple[str, tuple[tuple[int, ...], np.dtype]], ...]) -> dict[str, jax.Array]:
    """Zero slot pools {name: [S, *row shape]} as one XLA program (eager jnp.zeros compiled, or looked up, a program
    per shape and one more per dtype; docs/DESIGN.md sec. 20.18). shapes: ((name, (shape, dtype)), ...)."""
    return {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in shapes}


class OffloadState(NamedTuple):
    """What the offloaded backend threads through the decode step (a pytree of device arrays).

    Attributes:
        cache: expert_cache.CacheState (tables, usage, recency, step, stats).
        pools: {bank name: slot pool [S, *row_shape] (bank dtype); [S, 1] under host-all, which never uses a slot},
            one per bank of the ExpertBanks, in its order:
            gate_up [S, 2I, H], down [S, H, I] (as stored: [S, *format.data_shape(...)] in format.data_dtype), for
            experts with biases gate_up_bias [S, 2I], down_bias [S, H], and for a quantized format the scale pools
            gate_up_scale [S, *gate_up_scale row], down_scale [S, *down_scale row] (ExpertBanks).
        fill_errors: i32[] slot fill entries skipped for an out-of-range id since init_state (read_stats checks it).
        host_route_errors: i32[] host_experts calls whose output was zeroed (a route id out of range or a released
            bank: GPU only) since init_state (read_stats checks it).
    """

    cache: expert_cache.CacheState
    pools: dict[str, jax.Array]
    fill_errors: jax.Array
    host_route_errors: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadedExperts:
    """ExpertBackend computing routed experts from host banks and a device slot pool (module docstring).

    Attributes:
        banks: ExpertBanks (gate_up [L*E, 2I, H], down [L*E, H, I] in its weight format, optional biases, the scale
            banks of a quantized format), flat id = moe_layer * E + expert.
        num_experts: E.
        policy: Policy deciding how many misses are fetched (static: baked into the compiled step).
        activation: "silu" (SwiGLU), "gelu_tanh" or "swiglu_oai" (gpt-oss's clamped SwiGLU).
        swiglu_alpha, swiglu_limit: the clamped SwiGLU's parameters (read by "swiglu_oai" only).
        fetch_min_tokens: None, or the prefill split of the cost model (cost_model.prefill_fetch_min_tokens): only a
            miss routed at least this many tokens in the call may be fetched (the policy's F is taken among those),
            the others are computed on the host (cost_model.PREFILL_NEVER: none is fetched).
    """

    banks: ExpertBanks
    num_experts: int
    policy: Policy
    activation: str = "silu"
    swiglu_alpha: float = ffi_ops.SWIGLU_ALPHA
    swiglu_limit: float = ffi_ops.SWIGLU_LIMIT
    fetch_min_tokens: int | None = None

    @property
    def num_layers(self) -> int:
        """L, MoE layers held by the banks."""
        return self.banks.num_rows // self.num_experts

    def init_state(self, num_slots: int) -> OffloadState:
        """Cold slot pool of `num_slots` slots (all zeros, no expert resident); resident policy: every expert loaded;
        host-all, whose steps never fill or read a slot: pools [S, 1] of one element per slot (a slot of a
        Mixtral-8x7B expert is 336 MiB of memory to zero at every launch, and the CPU's default policy is host-all).

        Args:
            num_slots: S >= 1 (ignored for the resident policy, which uses S = L*E).
        Returns:
            OffloadState on the default device.
        Raises:
            ValueError: num_slots < 1.
        """
        L, E = self.num_layers, self.num_experts
        if self.policy.kind is PolicyKind.RESIDENT:
            cache = expert_cache.init_cache_state_resident(L, E)
            return OffloadState(cache, {name: bank.to_jax() for name, bank in self.banks.items()},
                                *_no_errors())
        if num_slots < 1:
            raise ValueError(f"offload: the device budget must hold at least one expert slot, got {num_slots} slots")
        cache = expert_cache.init_cache_state(L, E, num_slots, auto=self.policy.kind is PolicyKind.AUTO)
        if self.policy.kind is PolicyKind.HOST_ALL:  # its steps never fill or read a slot (_fill, _compute)
            pools = {n: jax.device_put(np.zeros((num_slots, 1), dtype), may_alias=False)
                     for n, (_, dtype) in self.banks.pool_shapes(num_slots).items()}
        else:
            pools = _zero_pools(tuple(self.banks.pool_shapes(num_slots).items()))
        return OffloadState(cache, pools, *_no_errors())

    def read_stats(self, state: OffloadState):
        """The per-layer statistics, read from the device (one transfer; call it once per generate, never per step).

        Args:
            state: OffloadState.
        Returns:
            numpy i32[L, 6] = state.cache.stats (columns expert_cache.STAT_FIELDS).
        Raises:
            RuntimeError: the GPU slot fill skipped entries with an out-of-range flat id or slot id (fill_errors), or
                the GPU host_experts zeroed calls for a route id out of range or a released bank (host_route_errors):
                the cache plan produced ids outside the banks / slots, or a bank was released under the step (a bug).
                The message names the counter and its count.
        """
        stats, fill_errors, route_errors = jax.device_get((state.cache.stats, state.fill_errors,
                                                           state.host_route_errors))
        self.check_error_counts(int(fill_errors), int(route_errors))
        return stats

    def check_error_counts(self, n_fill: int, n_route: int) -> None:
        """Raises read_stats' RuntimeError when the GPU error counters (fill_errors, host_route_errors) are not 0."""
        if n_fill:
            raise RuntimeError(f"slot_fill: fill_errors = {n_fill}: {n_fill} slot fill entries had a flat id >= "
                               f"{self.banks.num_rows} or a slot id >= the slot count and were skipped (the GPU "
                               f"kernel counts what the CPU handler raises for)")
        if n_route:
            raise RuntimeError(f"host_experts: host_route_errors = {n_route}: {n_route} host_experts calls had a flat "
                               f"id outside [0, {self.banks.num_rows}) or a released bank and returned zeros "
                               f"(the GPU host node counts what the CPU handler raises for)")

    def __call__(self, moe_layer, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                 state: OffloadState) -> tuple[jax.Array, OffloadState]:
        """Routed-experts output of one MoE layer.

        Args:
            moe_layer: MoE layer index in [0, L): i32[] (traced inside the layer scan) or a Python int.
            x: f32|bf16[N, H] tokens entering the experts (after the post-attention norm).
            topk_ids: i32[N, k] expert ids in [0, E); -1 = no expert (padding token).
            topk_weights: f32[N, k] combine weights.
            state: OffloadState.
        Returns:
            (y f32[N, H] = sum_j w[n, j] * expert_{ids[n, j]}(x[n]), new OffloadState).
        """
        E = self.num_experts
        topk_ids = topk_ids.astype(jnp.int32)
        topk_weights = topk_weights.astype(jnp.float32)
        active = expert_cache.active_from_topk(topk_ids, E)  # bool[E]
        fetchable = None
        if self.fetch_min_tokens is not None:  # prefill: only experts with enough tokens are worth their fill
            counts = jnp.zeros((E,), jnp.int32).at[jnp.where(topk_ids >= 0, topk_ids, E)].add(1, mode="drop")
            fetchable = counts >= self.fetch_min_tokens  # bool[E]
        cache, plan = expert_cache.plan_layer(state.cache, moe_layer, active, self.policy,
                                              max_active=topk_ids.size, fetchable=fetchable)
        pools, fill_errors = self._fill(state.pools, plan, state.fill_errors)
        routed = topk_ids >= 0  # bool[N, k]; -1 = padding token, no expert
        ids = jnp.where(routed, topk_ids, 0)  # i32[N, k], safe to index with
        route_slot = jnp.where(routed, plan.device_slot_of_expert[ids], -1)  # i32[N, k], -1 = not in a slot
        route_host = jnp.where(routed & plan.host_mask[ids], self.bank_rows(moe_layer * E + ids), -1)  # i32[N, k]
        y, route_errors = self._compute(x, route_slot, route_host, topk_weights, pools)
        return y, OffloadState(cache, pools, fill_errors, state.host_route_errors + route_errors)

    def bank_rows(self, flat_ids: jax.Array) -> jax.Array:
        """Host bank rows of the cache's flat ids i32[...] (moe_layer * E + expert; -1 = padding, kept): the same ids
        here, where the banks hold every expert; a shard of ft_jax.offload.expert_parallel maps them into its
        process's banks."""
        return flat_ids

    def _fill(self, pools: dict[str, jax.Array], plan: expert_cache.LayerPlan, fill_errors: jax.Array):
        """The plan's fills copied from the host banks into the slot pools: one slot_fill for every pool, in place.
        Returns (pools, fill_errors + the call's error count)."""
        if not self.policy.kind.fetches:
            # Never fetches: no slot_fill. A fill whose ids are constants does not depend on the previous layer's
            # slot_experts read, so XLA copied the whole pool before every fill (8 copies per step on 4 layers).
            return pools, fill_errors
        names = self.banks.names
        filled, errors = ffi_ops.slot_fill_with_errors(tuple(pools[n] for n in names),
                                                       self.bank_rows(plan.fill_flat_ids), plan.fill_slot_ids,
                                                       self.banks.banks)
        return dict(zip(names, filled)), fill_errors + errors

    def _compute(self, x, route_slot, route_host, topk_weights, pools: dict[str, jax.Array]):
        """The slot experts (routes with a slot id) plus the host experts (routes with a flat id): each route is in
        exactly one of the two. x f32|bf16[N, H]; route_slot, route_host i32[N, k] (-1 = not on that path).
        Returns (y f32[N, H], host route errors i32[])."""
        banks = self.banks
        gate = dict(alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        host_banks, slot_pools = {}, {}
        for name in banks.names[2:]:  # biases and scales: the keyword arguments of host_experts / slot_experts
            host_banks[name], slot_pools[f"{name}_slots"] = getattr(banks, name), pools[name]
        if banks.quantized:  # the kernels read the stored bytes and dequantize them (ft_jax.weight_formats)
            host_banks["weight_format"] = slot_pools["weight_format"] = banks.format

        def device_part(x):  # f32[N, H]
            return ffi_ops.slot_experts(x, route_slot, topk_weights, pools["gate_up"], pools["down"], self.activation,
                                        **slot_pools, **gate)

        def host_part(x):  # (f32[N, H], errors i32[])
            return ffi_ops.host_experts_with_errors(x, route_host, topk_weights, banks.gate_up, banks.down,
                                                    self.activation, **host_banks, **gate)

        def both(x):  # (f32[N, H], errors i32[])
            y_host, errors = host_part(x)
            return device_part(x) + y_host, errors

        def overlapped(x):  # GPU: submit, device part, wait (module docstring)
            ticket = ffi_ops.host_experts_submit(x, route_host, topk_weights, banks.gate_up, banks.down,
                                                 self.activation, **host_banks, **gate)
            ticket, x = jax.lax.optimization_barrier((ticket, x))
            y_device = device_part(x)
            y_host, errors = ffi_ops.host_experts_wait(ticket, y_device)
            return y_device + y_host, errors

        # Static skips: under host-all no expert is ever in a slot; under resident none is ever on the host.
        if self.policy.kind is PolicyKind.HOST_ALL:
            return host_part(x)
        if self.policy.kind is PolicyKind.RESIDENT:
            return device_part(x), jnp.zeros((), jnp.int32)
        if ft_jax.CUDA_ENABLED:
            return jax.lax.platform_dependent(x, cpu=both, cuda=overlapped)
        return both(x)
