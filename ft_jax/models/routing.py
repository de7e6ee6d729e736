"""Router rules of the supported MoE families (docs/DESIGN.md section 6).

All four supported families use the same rule with one switch, as in transformers 5.x
(MixtralTopKRouter, Qwen2MoeTopKRouter, Qwen3MoeTopKRouter, OlmoeTopKRouter):

    logits = x @ W_router.T                      (model dtype, then float32)
    probs  = softmax(logits, axis=-1)            (float32, over all E experts)
    w, ids = top_k(probs, k)                     (descending; ties -> lower expert id)
    w      = w / sum(w)   if renormalise         (Mixtral: always; Qwen2/Qwen3-MoE, OLMoE: norm_topk_prob)

The combine weights returned are the ones the experts' outputs are multiplied by.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ft_jax.config import MoEConfig


class Routing(NamedTuple):
    """Router output for N tokens.

    logits: f32[N, E] raw router logits (before softmax).
    topk_ids: i32[N, k] chosen experts, descending by probability (-1 = no expert: padding token).
    topk_weights: f32[N, k] combine weights (0 for padding tokens).
    """

    logits: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array


def softmax_topk(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over experts (float32), top-k, optional renormalisation of the k probabilities.

    Args:
        logits: f32/bf16[N, E] router logits.
        top_k: k (static).
        renormalize: divide the k probabilities by their sum.
    Returns:
        (topk_ids i32[N, k], topk_weights f32[N, k]), ordered by descending probability.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, E]
    weights, ids = jax.lax.top_k(probs, top_k)  # [N, k], [N, k]
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def mixtral_route(logits: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Mixtral: softmax over E, top-k, always renormalised (MixtralTopKRouter)."""
    return softmax_topk(logits, cfg.top_k, renormalize=True)


def qwen_moe_route(logits: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """Qwen2-MoE / Qwen3-MoE: softmax over E, top-k, renormalised only if cfg.norm_topk_prob."""
    return softmax_topk(logits, cfg.top_k, renormalize=cfg.norm_topk_prob)


def olmoe_route(logits: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, jax.Array]:
    """OLMoE: softmax over E, top-k, renormalised only if cfg.norm_topk_prob."""
    return softmax_topk(logits, cfg.top_k, renormalize=cfg.norm_topk_prob)


ROUTE_RULES: dict[str, Callable[[jax.Array, MoEConfig], tuple[jax.Array, jax.Array]]] = {
    "mixtral": mixtral_route,
    "qwen2_moe": qwen_moe_route,
    "qwen3_moe": qwen_moe_route,
    "olmoe": olmoe_route,
}


def route(cfg: MoEConfig, x: jax.Array, router_weight: jax.Array, valid: jax.Array | None = None) -> Routing:
    """Route N tokens with the family rule of ``cfg``.

    Args:
        cfg: model config (family, top_k, norm_topk_prob).
        x: f32/bf16[N, H] hidden states after post_attention_layernorm.
        router_weight: [E, H] router (gate) weight, Hugging Face layout.
        valid: optional bool[N]; tokens with False (padding) get topk_ids -1 and topk_weights 0, so no
            expert backend sees them as active.
    Returns:
        Routing(logits f32[N, E], topk_ids i32[N, k], topk_weights f32[N, k]).
    """
    logits = jnp.einsum("nh,eh->ne", x, router_weight, precision=jax.lax.Precision.HIGHEST)  # [N, E]
    logits = logits.astype(jnp.float32)
    ids, weights = ROUTE_RULES[cfg.family](logits, cfg)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, -1)
        weights = jnp.where(valid[:, None], weights, 0.0)
    return Routing(logits, ids, weights)
