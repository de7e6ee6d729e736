"""Offloaded expert execution: host banks + a device slot pool, split by the cache policy (docs/DESIGN.md sec. 3).

`OffloadedExperts` is the ExpertBackend the model calls for every MoE layer of a jit-compiled step. Per call:

  1. active mask bool[E] from the router's top-k ids
  2. expert_cache.plan_layer: hits, the F fetched misses (F from the policy), host misses, victim slots, tables
  3. slot_fill FFI (in place): bank rows -> victim slots of the gate_up and the down slot arrays (and, for experts
     with biases, the two bias pools), in one call
  4. slot_experts FFI: every (t, j) route whose expert is in a slot, read straight from the slot arrays
  5. host_experts FFI: every (t, j) route whose expert is a host miss, read straight from the host banks
  6. output = device part + host part (each route is computed exactly once: the slot and host route masks partition
     the routes)

On a GPU (ft_jax.CUDA_ENABLED) steps 4 and 5 become host_experts_submit -> slot_experts (Pallas) -> host_experts_wait,
so the CPU GEMV of the host misses runs while the GPU computes the resident ones; the wait takes the device part as an
operand and the submit is tied before the device part with an optimization barrier, so XLA keeps that order. The GPU
forms cannot stop the stream on a bad id, so they count instead of raising (the CPU handlers raise): the slot fill's
skipped entries are summed on the device in OffloadState.fill_errors, the host_experts calls zeroed for a bad route id
or a released bank in OffloadState.host_route_errors, and read_stats checks both.

All shapes depend only on (T, k, E, S, model dims), never on the miss count or F, so the step compiles once.
The slot arrays are carried in exactly the shape the FFI calls consume ([S, 2I, H] and [S, H, I]) so that, under a jit
that donates them, XLA fills them in place (no reshape, no copy; docs/DESIGN.md sec. 5).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

import ft_jax
from ft_jax.kernels import ffi_ops
from ft_jax.offload import cache as expert_cache
from ft_jax.offload.banks import HostBank
from ft_jax.offload.policy import Policy


def _no_errors() -> tuple[jax.Array, jax.Array]:
    """(fill_errors, host_route_errors) of a fresh state: i32[] zeros."""
    return jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)


class OffloadState(NamedTuple):
    """What the offloaded backend threads through the decode step (a pytree of device arrays).

    Attributes:
        cache: expert_cache.CacheState (tables, usage, recency, step, stats).
        gate_up_slots: [S, 2I, H] slot pool for the gate and up projections (bank dtype).
        down_slots: [S, H, I] slot pool for the down projections (bank dtype).
        gate_up_bias_slots: [S, 2I] and down_bias_slots: [S, H] bias pools (bias bank dtype), or None for experts
            without biases.
        fill_errors: i32[] slot fill entries skipped for an out-of-range id since init_state (read_stats checks it).
        host_route_errors: i32[] host_experts calls whose output was zeroed (a route id out of range or a released
            bank: GPU only) since init_state (read_stats checks it).
    """

    cache: expert_cache.CacheState
    gate_up_slots: jax.Array
    down_slots: jax.Array
    gate_up_bias_slots: jax.Array | None = None
    down_bias_slots: jax.Array | None = None
    fill_errors: jax.Array | None = None
    host_route_errors: jax.Array | None = None

    @property
    def pools(self) -> tuple[jax.Array, ...]:
        """Every slot pool, in bank order (gate_up, down[, gate_up_bias, down_bias])."""
        pools = (self.gate_up_slots, self.down_slots)
        return pools if self.gate_up_bias_slots is None else (*pools, self.gate_up_bias_slots, self.down_bias_slots)


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadedExperts:
    """ExpertBackend computing routed experts from host banks and a device slot pool (module docstring).

    Attributes:
        gate_up_bank: HostBank [L*E, 2I, H] (rows: gate_proj then up_proj), flat id = moe_layer * E + expert.
        down_bank: HostBank [L*E, H, I].
        num_experts: E.
        policy: Policy deciding how many misses are fetched (static: baked into the compiled step).
        activation: "silu" (SwiGLU), "gelu_tanh" or "swiglu_oai" (gpt-oss's clamped SwiGLU).
        gate_up_bias_bank: HostBank [L*E, 2I] (gate bias then up bias) and down_bias_bank: HostBank [L*E, H], both
            or neither (gpt-oss's expert biases; LoadedCheckpoint.expert_banks passes them).
        swiglu_alpha, swiglu_limit: the clamped SwiGLU's parameters (read by "swiglu_oai" only).
    """

    gate_up_bank: HostBank
    down_bank: HostBank
    num_experts: int
    policy: Policy
    activation: str = "silu"
    gate_up_bias_bank: HostBank | None = None
    down_bias_bank: HostBank | None = None
    swiglu_alpha: float = ffi_ops.SWIGLU_ALPHA
    swiglu_limit: float = ffi_ops.SWIGLU_LIMIT

    def __post_init__(self):
        if (self.gate_up_bias_bank is None) != (self.down_bias_bank is None):
            raise ValueError("offload: pass both expert bias banks (gate_up_bias_bank and down_bias_bank) or neither")

    @property
    def num_layers(self) -> int:
        """L, MoE layers held by the banks."""
        return self.gate_up_bank.num_rows // self.num_experts

    @property
    def banks(self) -> tuple[HostBank, ...]:
        """Every host bank, in the order of OffloadState.pools."""
        banks = (self.gate_up_bank, self.down_bank)
        return banks if self.gate_up_bias_bank is None else (*banks, self.gate_up_bias_bank, self.down_bias_bank)

    def init_state(self, num_slots: int) -> OffloadState:
        """Cold slot pool of `num_slots` slots (all zeros, no expert resident); resident policy: every expert loaded.

        Args:
            num_slots: S >= 1 (ignored for the resident policy, which uses S = L*E).
        Returns:
            OffloadState on the default device.
        Raises:
            ValueError: num_slots < 1.
        """
        L, E = self.num_layers, self.num_experts
        if self.policy.kind == "resident":
            cache = expert_cache.init_cache_state_resident(L, E)
            return self._state(cache, [jnp.asarray(bank.numpy()) for bank in self.banks], *_no_errors())
        if num_slots < 1:
            raise ValueError(f"offload: the device budget must hold at least one expert slot, got {num_slots} slots")
        cache = expert_cache.init_cache_state(L, E, num_slots)
        # [S, 2I, H], [S, H, I] (and the bias pools [S, 2I], [S, H])
        pools = [jnp.zeros((num_slots, *bank.row_shape), bank.dtype) for bank in self.banks]
        return self._state(cache, pools, *_no_errors())

    @staticmethod
    def _state(cache, pools, fill_errors, host_route_errors) -> OffloadState:
        return OffloadState(cache, *pools, *([None, None] if len(pools) == 2 else []), fill_errors=fill_errors,
                            host_route_errors=host_route_errors)

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
        n_fill, n_route = int(fill_errors), int(route_errors)
        if n_fill:
            raise RuntimeError(f"slot_fill: fill_errors = {n_fill}: {n_fill} slot fill entries had a flat id >= "
                               f"{self.gate_up_bank.num_rows} or a slot id >= the slot count and were skipped (the GPU "
                               f"kernel counts what the CPU handler raises for)")
        if n_route:
            raise RuntimeError(f"host_experts: host_route_errors = {n_route}: {n_route} host_experts calls had a flat "
                               f"id outside [0, {self.gate_up_bank.num_rows}) or a released bank and returned zeros "
                               f"(the GPU host node counts what the CPU handler raises for)")
        return stats

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
        cache, plan = expert_cache.plan_layer(state.cache, moe_layer, active, self.policy,
                                              max_active=topk_ids.size)

        fill_errors = state.fill_errors
        if self.policy.kind in ("host-all", "resident"):
            # Never fetches: no slot_fill. A fill whose ids are constants does not depend on the previous layer's
            # slot_experts read, so XLA copied the whole pool before every fill (8 copies per step on 4 layers).
            pools = state.pools
        else:  # [S, 2I, H], [S, H, I] (+ [S, 2I], [S, H]): one call for every pool, in place
            pools, errors = ffi_ops.slot_fill_with_errors(state.pools, plan.fill_flat_ids, plan.fill_slot_ids,
                                                          self.banks)
            fill_errors = fill_errors + errors
        gate = dict(alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        host_banks = dict(gate_up_bias=self.gate_up_bias_bank, down_bias=self.down_bias_bank)
        bias_pools = dict(gate_up_bias_slots=pools[2], down_bias_slots=pools[3]) if len(pools) == 4 else {}

        routed = topk_ids >= 0  # bool[N, k]; -1 = padding token, no expert
        ids = jnp.where(routed, topk_ids, 0)  # i32[N, k], safe to index with
        route_slot = jnp.where(routed, plan.device_slot_of_expert[ids], -1)  # i32[N, k], -1 = not in a slot
        route_host = jnp.where(routed & plan.host_mask[ids], moe_layer * E + ids, -1)  # i32[N, k] flat ids

        def device_part(x):  # f32[N, H]
            return ffi_ops.slot_experts(x, route_slot, topk_weights, pools[0], pools[1], self.activation,
                                        **bias_pools, **gate)

        def host_part(x):  # (f32[N, H], errors i32[])
            return ffi_ops.host_experts_with_errors(x, route_host, topk_weights, self.gate_up_bank, self.down_bank,
                                                    self.activation, **host_banks, **gate)

        def both(x):  # (f32[N, H], errors i32[])
            y_host, errors = host_part(x)
            return device_part(x) + y_host, errors

        def overlapped(x):  # GPU: submit, device part, wait (module docstring)
            ticket = ffi_ops.host_experts_submit(x, route_host, topk_weights, self.gate_up_bank, self.down_bank,
                                                 self.activation, **host_banks, **gate)
            ticket, x = jax.lax.optimization_barrier((ticket, x))
            y_device = device_part(x)
            y_host, errors = ffi_ops.host_experts_wait(ticket, y_device)
            return y_device + y_host, errors

        # Static skips: under host-all no expert is ever in a slot; under resident none is ever on the host.
        route_errors = jnp.zeros((), jnp.int32)
        if self.policy.kind == "host-all":
            y, route_errors = host_part(x)
        elif self.policy.kind == "resident":
            y = device_part(x)
        elif ft_jax.CUDA_ENABLED:
            y, route_errors = jax.lax.platform_dependent(x, cpu=both, cuda=overlapped)
        else:
            y, route_errors = both(x)
        return y, self._state(cache, pools, fill_errors, state.host_route_errors + route_errors)
