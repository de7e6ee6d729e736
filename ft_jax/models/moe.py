"""The MoE blocks of a stack of scanned decoder layers: router call, routed experts through the expert backend, shared
experts on the device.

Shapes: x [B, T, H] flattened to [N, H] (N = B * T) for the router and the backend; router logits f32[N, E],
topk ids i32[N, k] (-1 = padding token), combine weights f32[N, k]. The routing rules are in
ft_jax/models/routing.py; the backend (ExpertBackend) owns the routed expert weights (host banks + device slots).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from ft_jax.config import MoEConfig
from ft_jax.models.layers import Stacked, gated_mlp, linear
from ft_jax.models.routing import route, route_deepseek


class ExpertBackend(Protocol):
    """Computes the routed experts of one MoE layer (the shared expert is added by the model)."""

    def __call__(self, moe_layer: jax.Array, x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                 expert_state: Any) -> tuple[jax.Array, Any]:
        """moe_layer: i32[] MoE layer index (traced inside the layer scan); x: f32|bf16[N, H] (the model dtype);
        topk_ids: i32[N, k] (-1 = no expert); topk_weights: f32[N, k].
        Returns (y f32[N, H] = sum_j w[n, j] * expert_{ids[n, j]}(x[n]), new expert_state)."""



class MoEBlock(nnx.Module):
    """Router [n, E, H] (+ bias [n, E] for gpt-oss) and, for Qwen2-MoE, the shared expert with its sigmoid gate; the
    routed experts come from the expert backend (host banks and slots)."""

    def __init__(self, cfg: MoEConfig, p: Stacked, moe_base: int):
        H, SI = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.cfg, self.moe_base = cfg, moe_base  # moe_base: MoE index of the stack's first layer
        router = {"mixtral": "block_sparse_moe.gate", "gpt_oss": "mlp.router"}.get(cfg.family, "mlp.gate")
        self.router = p(f"{router}.weight", (cfg.num_experts, H))  # [n, E, H]
        self.router_bias = p(f"{router}.bias", (cfg.num_experts,), "bias") if cfg.router_bias else None  # [n, E]
        if SI:
            s = "mlp.shared_expert"
            self.shared_gate_up = p.projection([(f"{s}.gate_proj.weight", (SI, H)), (f"{s}.up_proj.weight", (SI, H))])
            self.shared_down = p.projection([(f"{s}.down_proj.weight", (H, SI))])  # [n, H, SI]
            self.shared_gate = p("mlp.shared_expert_gate.weight", (1, H))  # [n, 1, H]
        else:
            self.shared_gate_up = self.shared_down = self.shared_gate = None

    def __call__(self, i, x, valid, expert_state, experts: ExpertBackend):
        """Layer i's MoE block. x: [B, T, H]; valid: bool[B, T].
        Returns (y [B, T, H], expert_state, (router logits f32[N, E], topk ids i32[N, k], weights f32[N, k]))."""
        cfg = self.cfg
        B, T, H = x.shape
        xf = x.reshape(B * T, H)  # [N, H]
        with jax.named_scope("router"):
            logits = linear(xf, self.router[...], i)  # f32[N, E]
            if self.router_bias is not None:
                logits = logits + self.router_bias[...][i].astype(jnp.float32)
            logits = logits.astype(x.dtype).astype(jnp.float32)  # rounded to the model dtype, as transformers
            r = route(cfg, logits, valid.reshape(B * T))
        with jax.named_scope("experts"):
            routed, expert_state = experts(jnp.int32(self.moe_base) + i, xf, r.topk_ids, r.topk_weights,
                                           expert_state)
        y = routed.astype(x.dtype)  # [N, H]
        if self.shared_gate_up is not None:
            with jax.named_scope("shared_experts"):
                gate = jax.nn.sigmoid(linear(xf, self.shared_gate[...], i).astype(x.dtype))  # [N, 1]
                y = y + gate * gated_mlp(xf, self.shared_gate_up[...], self.shared_down[...], i, cfg.activation)
        return y.reshape(B, T, H), expert_state, (r.logits, r.topk_ids, r.topk_weights)


class DeepseekMoEBlock(nnx.Module):
    """DeepSeek-V2/V3 MoE block (transformers' DeepseekV2Moe / DeepseekV3MoE): a float32 router [n, E, H] (with
    e_score_correction_bias [n, E] for V3, "mlp.gate.e_score_correction_bias"), routed experts from the expert
    backend, plus n_shared_experts shared experts as one ungated dense MLP of width SI = moe_intermediate_size *
    n_shared_experts on the device ("mlp.shared_experts.{gate,up,down}_proj.weight": gate/up fused [n, 2 SI, H],
    down [n, H, SI]) added to the routed output."""

    def __init__(self, cfg: MoEConfig, p: Stacked, moe_base: int):
        H, E, SI = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size * cfg.n_shared_experts
        self.cfg, self.moe_base = cfg, moe_base
        self.router = p("mlp.gate.weight", (E, H), "weight_f32")  # f32[n, E, H]
        self.score_bias = p("mlp.gate.e_score_correction_bias", (E,), "bias_f32") \
            if cfg.scoring_func == "sigmoid" else None  # f32[n, E]
        if SI:
            s = "mlp.shared_experts"
            self.shared_gate_up = p.projection([(f"{s}.gate_proj.weight", (SI, H)), (f"{s}.up_proj.weight", (SI, H))])
            self.shared_down = p.projection([(f"{s}.down_proj.weight", (H, SI))])  # [n, H, SI]
        else:
            self.shared_gate_up = self.shared_down = None

    def __call__(self, i, x, valid, expert_state, experts: ExpertBackend):
        """Layer i's MoE block. x: [B, T, H]; valid: bool[B, T].
        Returns (y [B, T, H], expert_state, (router logits f32[N, E], topk ids i32[N, k], weights f32[N, k]))."""
        cfg = self.cfg
        B, T, H = x.shape
        xf = x.reshape(B * T, H)  # [N, H]
        with jax.named_scope("router"):
            logits = linear(xf.astype(jnp.float32), self.router[...], i)  # f32[N, E], as transformers: in float32
            bias = None if self.score_bias is None else self.score_bias[...][i]
            r = route_deepseek(cfg, logits, valid.reshape(B * T), bias)
        with jax.named_scope("experts"):
            routed, expert_state = experts(jnp.int32(self.moe_base) + i, xf, r.topk_ids, r.topk_weights,
                                           expert_state)
        y = routed.astype(x.dtype)  # [N, H]
        if self.shared_gate_up is not None:
            with jax.named_scope("shared_experts"):
                y = y + gated_mlp(xf, self.shared_gate_up[...], self.shared_down[...], i, cfg.activation)
        return y.reshape(B, T, H), expert_state, (r.logits, r.topk_ids, r.topk_weights)

