"""Offloaded expert execution: host banks + a device slot pool, split by the cache policy (docs/DESIGN.md sec. 3).

`OffloadedExperts` is the ExpertBackend the model calls for every MoE layer of a jit-compiled step. Per call:

  1. active mask bool[E] from the router's top-k ids
  2. expert_cache.plan_layer: hits, the F fetched misses (F from the policy), host misses, victim slots, tables
  3. slot_fill FFI (in place): bank rows -> victim slots of the gate_up and the down slot arrays, in one call
  4. slot_experts FFI: every (t, j) route whose expert is in a slot, read straight from the slot arrays
  5. host_experts FFI: every (t, j) route whose expert is a host miss, read straight from the host banks
  6. output = device part + host part (each route is computed exactly once: the slot and host route masks partition
     the routes)

All shapes depend only on (T, k, E, S, model dims), never on the miss count or F, so the step compiles once.
The slot arrays are carried in exactly the shape the FFI calls consume ([S, 2I, H] and [S, H, I]) so that, under a jit
that donates them, XLA fills them in place (no reshape, no copy; docs/DESIGN.md sec. 5).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ft_jax.offload import expert_cache, ffi_ops
from ft_jax.offload.host_bank import HostBank
from ft_jax.offload.policy import Policy


class OffloadState(NamedTuple):
    """What the offloaded backend threads through the decode step (a pytree of device arrays).

    Attributes:
        cache: expert_cache.CacheState (tables, usage, recency, step, stats).
        gate_up_slots: [S, 2I, H] slot pool for the gate and up projections (bank dtype).
        down_slots: [S, H, I] slot pool for the down projections (bank dtype).
    """

    cache: expert_cache.CacheState
    gate_up_slots: jax.Array
    down_slots: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadedExperts:
    """ExpertBackend computing routed experts from host banks and a device slot pool (module docstring).

    Attributes:
        gate_up_bank: HostBank [L*E, 2I, H] (rows: gate_proj then up_proj), flat id = moe_layer * E + expert.
        down_bank: HostBank [L*E, H, I].
        num_experts: E.
        policy: Policy deciding how many misses are fetched (static: baked into the compiled step).
        activation: "silu" (SwiGLU) or "gelu_tanh".
    """

    gate_up_bank: HostBank
    down_bank: HostBank
    num_experts: int
    policy: Policy
    activation: str = "silu"

    @property
    def num_layers(self) -> int:
        """L, MoE layers held by the banks."""
        return self.gate_up_bank.num_rows // self.num_experts

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
            return OffloadState(cache, jnp.asarray(self.gate_up_bank.numpy()), jnp.asarray(self.down_bank.numpy()))
        if num_slots < 1:
            raise ValueError(f"offload: the device budget must hold at least one expert slot, got {num_slots} slots")
        cache = expert_cache.init_cache_state(L, E, num_slots)
        gate_up = jnp.zeros((num_slots, *self.gate_up_bank.row_shape), self.gate_up_bank.dtype)  # [S, 2I, H]
        down = jnp.zeros((num_slots, *self.down_bank.row_shape), self.down_bank.dtype)  # [S, H, I]
        return OffloadState(cache, gate_up, down)

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

        if self.policy.kind in ("host-all", "resident"):
            # Never fetches: no slot_fill. A fill whose ids are constants does not depend on the previous layer's
            # slot_experts read, so XLA copied the whole pool before every fill (8 copies per step on 4 layers).
            gate_up_slots, down_slots = state.gate_up_slots, state.down_slots
        else:
            gate_up_slots, down_slots = ffi_ops.slot_fill(
                (state.gate_up_slots, state.down_slots), plan.fill_flat_ids, plan.fill_slot_ids,
                (self.gate_up_bank, self.down_bank))  # [S, 2I, H], [S, H, I]: one call, in place

        routed = topk_ids >= 0  # bool[N, k]; -1 = padding token, no expert
        ids = jnp.where(routed, topk_ids, 0)  # i32[N, k], safe to index with
        # Static skips: under host-all no expert is ever in a slot; under resident none is ever on the host.
        y_device = y_host = jnp.zeros(x.shape, jnp.float32)  # f32[N, H]
        if self.policy.kind != "host-all":
            route_slot = jnp.where(routed, plan.device_slot_of_expert[ids], -1)  # i32[N, k], -1 = not in a slot
            y_device = ffi_ops.slot_experts(x, route_slot, topk_weights, gate_up_slots, down_slots,
                                            activation=self.activation)  # f32[N, H]
        if self.policy.kind != "resident":
            route_host = jnp.where(routed & plan.host_mask[ids], moe_layer * E + ids, -1)  # i32[N, k] flat ids
            y_host = ffi_ops.host_experts(x, route_host, topk_weights, self.gate_up_bank, self.down_bank,
                                          activation=self.activation)  # f32[N, H]
        return y_device + y_host, OffloadState(cache, gate_up_slots, down_slots)
