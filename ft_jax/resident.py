"""ResidentExperts: the reference expert backend with every expert on the device (plain jnp).

Weights use the host-bank row layouts (contracts.md): gate_up [L_moe*E, 2I, H] (rows 0..I-1 gate_proj,
I..2I-1 up_proj), down [L_moe*E, H, I]; flat id = moe_layer * E + expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ft_jax.config import MoEConfig
from ft_jax.models.decoder import HIGHEST, activation_fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResidentExperts:
    """All routed experts as device arrays; an :class:`ft_jax.models.decoder.ExpertBackend` (expert_state passes through).

    gate_up: [L_moe*E, 2I, H]; down: [L_moe*E, H, I] (float32 or bfloat16; accumulation is float32).
    num_experts (E) and activation ("silu" | "gelu_tanh") are static pytree metadata.

    Two exact evaluations, chosen at trace time from the static shapes:
      * N*k < E (decode): gather the N*k routed experts' weights and apply them per route;
      * otherwise (prefill): apply each of the layer's E experts to all N tokens and combine with the dense
        [N, E] weight matrix (zero for experts a token did not pick), avoiding an [N*k] weight gather.
    """

    gate_up: jax.Array
    down: jax.Array
    num_experts: int = dataclasses.field(metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))

    @classmethod
    def from_banks(cls, gate_up_bank, down_bank, cfg: MoEConfig, dtype=None) -> "ResidentExperts":
        """Copy two host banks (ft_jax.offload.host_bank.HostBank or [R, *row] numpy arrays) to the device.

        dtype: device dtype (default: the bank dtype)."""
        gu = gate_up_bank if isinstance(gate_up_bank, np.ndarray) else gate_up_bank.numpy()
        dn = down_bank if isinstance(down_bank, np.ndarray) else down_bank.numpy()
        return cls(gate_up=jnp.asarray(gu, dtype), down=jnp.asarray(dn, dtype),
                   num_experts=cfg.num_experts, activation=cfg.activation)

    def __call__(self, moe_layer: int, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                 expert_state: Any) -> tuple[jax.Array, Any]:
        """y[n] = sum_j topk_weights[n, j] * down(act(gate(x[n])) * up(x[n])) of expert topk_ids[n, j]
        (ids -1 are skipped). x: [N, H]; topk_ids: i32[N, k]; topk_weights: f32[N, k]. Returns (f32[N, H],
        expert_state unchanged)."""
        E = self.num_experts
        N, k = topk_ids.shape
        I = self.down.shape[-1]
        act = activation_fn(self.activation)
        xw = x.astype(self.gate_up.dtype)
        if N * k < E:
            flat = jnp.where(topk_ids >= 0, moe_layer * E + topk_ids, 0).reshape(-1)  # [N*k]
            gu = jnp.take(self.gate_up, flat, axis=0).reshape(N, k, 2 * I, -1)  # [N, k, 2I, H]
            dn = jnp.take(self.down, flat, axis=0).reshape(N, k, -1, I)  # [N, k, H, I]
            h = jnp.einsum("nh,nkih->nki", xw, gu, precision=HIGHEST, preferred_element_type=jnp.float32)
            a = (act(h[..., :I]) * h[..., I:]).astype(dn.dtype)  # [N, k, I]
            out = jnp.einsum("nki,nkhi->nkh", a, dn, precision=HIGHEST, preferred_element_type=jnp.float32)
            w = jnp.where(topk_ids >= 0, topk_weights, 0.0)  # [N, k]
            return jnp.einsum("nkh,nk->nh", out, w, precision=HIGHEST), expert_state
        gu = jax.lax.dynamic_slice_in_dim(self.gate_up, moe_layer * E, E)  # [E, 2I, H]
        dn = jax.lax.dynamic_slice_in_dim(self.down, moe_layer * E, E)  # [E, H, I]
        dense_w = jnp.sum(jax.nn.one_hot(topk_ids, E, dtype=jnp.float32) * topk_weights[..., None], axis=1)  # [N, E]
        h = jnp.einsum("nh,eih->nei", xw, gu, precision=HIGHEST, preferred_element_type=jnp.float32)  # [N, E, 2I]
        a = (act(h[..., :I]) * h[..., I:]).astype(dn.dtype)  # [N, E, I]
        out = jnp.einsum("nei,ehi->neh", a, dn, precision=HIGHEST, preferred_element_type=jnp.float32)  # [N, E, H]
        return jnp.einsum("neh,ne->nh", out, dense_w, precision=HIGHEST), expert_state
