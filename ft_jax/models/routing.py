"""Router rules of the supported MoE families: :func:`route` (Mixtral, Qwen2/3-MoE, OLMoE: softmax then top-k;
gpt-oss: top-k of the logits then softmax) and :func:`route_deepseek` (DeepSeek-V2 softmax / V3 sigmoid with the
correction bias, group-limited top-k, routed_scaling_factor).

Shapes: logits f32[N, E] -> Routing(logits f32[N, E], topk_ids i32[N, k], topk_weights f32[N, k]). The formulas of
each rule: docs/DESIGN.md sec. 10 (models, routing.py) and section 6.
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
    """Route N tokens with the family rule of ``cfg`` (formulas: docs/DESIGN.md, models, routing.py).

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


def _group_mask(cfg: MoEConfig, choice: jax.Array, group_score: str) -> jax.Array:
    """choice f32[N, E] with every expert outside the cfg.topk_group best of cfg.n_group groups set to -inf.
    group_score: "max" (V2: a group's best choice) or "top2" (V3: the sum of its two best choices)."""
    N, E = choice.shape
    G = cfg.n_group
    grouped = choice.reshape(N, G, E // G)  # [N, G, E/G]
    if group_score == "max":
        scores = jnp.max(grouped, axis=-1)  # [N, G]
    else:
        scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
    _, best = jax.lax.top_k(scores, cfg.topk_group)  # [N, topk_group]
    keep = jnp.any(best[:, :, None] == jnp.arange(G)[None, None, :], axis=1)  # bool[N, G]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(N, E)


def route_deepseek(cfg: MoEConfig, logits: jax.Array, valid: jax.Array | None = None,
                   score_bias: jax.Array | None = None) -> Routing:
    """Route N tokens with DeepSeek-V2's or V3's rule, chosen by cfg.scoring_func (formulas: docs/DESIGN.md,
    models, routing.py).

    Masked groups are -inf, not 0 (transformers' V2 router fills 0, the same choice for softmax scores, all > 0),
    so a token whose biased scores are all negative still picks inside its groups
    (vLLM PR 13474 filled 0); the weights are gathered from the unbiased scores, never recovered as
    (s + b) - b, which rounds a small s to 0 in float32 (flashinfer PR 3875), and never include the bias (vLLM
    PR 12002); without norm_topk_prob they are the sigmoid scores times the factor, not the logits (sglang PR 35160).

    Args:
        cfg: model config (scoring_func, topk_method, n_group, topk_group, top_k, norm_topk_prob,
            routed_scaling_factor).
        logits: f32[N, E] router logits (float32 hidden states times the float32 router weight, as transformers).
        valid: optional bool[N]; False (padding) gives topk_ids -1 and topk_weights 0.
        score_bias: f32[E] e_score_correction_bias (V3; required there, unused by V2).
    Returns:
        Routing(logits f32[N, E] (the raw logits, transformers' router output 0), topk_ids i32[N, k] in descending
        order of the choice score, topk_weights f32[N, k]). transformers returns the same ids with
        torch.topk(sorted=False), in an order torch leaves undefined: compare routings as sets.
    Raises:
        ValueError: sigmoid scoring without score_bias.
    """
    logits = logits.astype(jnp.float32)
    if cfg.scoring_func == "sigmoid":
        if score_bias is None:
            raise ValueError("route_deepseek: sigmoid (DeepSeek-V3) routing needs e_score_correction_bias")
        scores = jax.nn.sigmoid(logits)  # [N, E]
        choice = _group_mask(cfg, scores + score_bias.astype(jnp.float32)[None, :], "top2")
    else:
        scores = jax.nn.softmax(logits, axis=-1)  # [N, E]
        choice = _group_mask(cfg, scores, "max") if cfg.topk_method == "group_limited_greedy" else scores
    _, ids = jax.lax.top_k(choice, cfg.top_k)  # [N, k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # [N, k]
    if cfg.scoring_func == "sigmoid" and cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    ids = ids.astype(jnp.int32)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, -1)
        weights = jnp.where(valid[:, None], weights, 0.0)
    return Routing(logits, ids, weights)
