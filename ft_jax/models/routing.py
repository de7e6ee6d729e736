"""Router rules of the supported MoE families (docs/DESIGN.md section 6).

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE share one rule with one switch, as in transformers 5.x
(MixtralTopKRouter, Qwen2MoeTopKRouter, Qwen3MoeTopKRouter, OlmoeTopKRouter):

    probs  = softmax(logits, axis=-1)            (float32, over all E experts)
    w, ids = top_k(probs, k)                     (descending; ties -> lower expert id)
    w      = w / sum(w)   if norm_topk_prob      (Mixtral's config always sets it)

gpt-oss (transformers' GptOssTopKRouter; the logits already include the router bias):

    w, ids = top_k(logits, k)                    (top-k over the raw logits, descending)
    w      = softmax(w)                          (float32, over the k chosen logits only)

The combine weights returned are the ones the experts' outputs are multiplied by.
"""

from __future__ import annotations

from typing import NamedTuple

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


def route(cfg: MoEConfig, logits: jax.Array, valid: jax.Array | None = None) -> Routing:
    """Route N tokens with the family rule of ``cfg`` (module docstring).

    Args:
        cfg: model config (family, top_k, norm_topk_prob).
        logits: f32[N, E] router logits (x @ W_router.T (+ bias for gpt-oss), rounded to the model dtype as
            transformers computes them).
        valid: optional bool[N]; tokens with False (padding) get topk_ids -1 and topk_weights 0, so no
            expert backend sees them as active.
    Returns:
        Routing(logits f32[N, E], topk_ids i32[N, k], topk_weights f32[N, k]).
    """
    if cfg.family == "gpt_oss":
        top, ids = jax.lax.top_k(logits.astype(jnp.float32), cfg.top_k)  # [N, k], [N, k]
        weights = jax.nn.softmax(top, axis=-1)  # [N, k]
    else:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [N, E]
        weights, ids = jax.lax.top_k(probs, cfg.top_k)  # [N, k], [N, k]
        if cfg.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    ids = ids.astype(jnp.int32)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, -1)
        weights = jnp.where(valid[:, None], weights, 0.0)
    return Routing(logits, ids, weights)
