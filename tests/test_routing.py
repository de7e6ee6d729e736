"""DeepSeek-V2/V3 routers (ft_jax.models.routing.route_deepseek) against a float64 numpy reference written token by
token, and the router pitfalls peers shipped (issue 10), each with hand-worked numbers."""

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from ft_jax.config import load_config
from ft_jax.models.routing import route_deepseek

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
V2 = load_config(os.path.join(FIXTURES, "deepseek_v2"))
V3 = load_config(os.path.join(FIXTURES, "deepseek_v3"))


def _cfg(base, **change):
    return dataclasses.replace(base, **change)


def reference(cfg, logits, bias=None):
    """(ids [N, k] sorted by id, weights [N, k] in that order), float64, one token at a time."""
    logits = np.asarray(logits, np.float64)
    E = logits.shape[1]
    v3 = cfg.scoring_func == "sigmoid"
    all_ids, all_w = [], []
    for row in logits:
        if v3:
            s = 1 / (1 + np.exp(-row))
            choice = s + np.asarray(bias, np.float64)
        else:
            s = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            choice = s
        allowed = list(range(E))
        if v3 or cfg.topk_method == "group_limited_greedy":
            size = E // cfg.n_group
            groups = [choice[g * size:(g + 1) * size] for g in range(cfg.n_group)]
            gscore = [sorted(g)[-2] + sorted(g)[-1] if v3 else max(g) for g in groups]
            best = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[:cfg.topk_group]
            allowed = [e for e in range(E) if e // size in best]
        ids = sorted(sorted(allowed, key=lambda e: -choice[e])[:cfg.top_k])
        w = s[ids]
        if v3 and cfg.norm_topk_prob:
            w = w / w.sum()
        all_ids.append(ids)
        all_w.append(w * cfg.routed_scaling_factor)
    return np.array(all_ids), np.array(all_w)


def _route(cfg, logits, bias=None, valid=None):
    r = route_deepseek(cfg, jnp.asarray(logits, jnp.float32), None if valid is None else jnp.asarray(valid),
                       None if bias is None else jnp.asarray(bias, jnp.float32))
    ids, w = np.asarray(r.topk_ids), np.asarray(r.topk_weights)
    order = np.argsort(ids, -1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)


@pytest.mark.parametrize("name,cfg", [
    ("v2 greedy", _cfg(V2, num_experts=16, top_k=4, routed_scaling_factor=1.0)),
    ("v2 greedy scaled, norm_topk_prob ignored", _cfg(V2, num_experts=16, top_k=4, routed_scaling_factor=16.0,
                                                      norm_topk_prob=True)),
    ("v2 group_limited_greedy", _cfg(V2, num_experts=16, top_k=3, topk_method="group_limited_greedy", n_group=4,
                                     topk_group=2, routed_scaling_factor=1.5)),
    ("v3 norm", _cfg(V3, num_experts=16, top_k=4, n_group=4, topk_group=2)),
    ("v3 no norm", _cfg(V3, num_experts=16, top_k=4, n_group=4, topk_group=2, norm_topk_prob=False)),
    ("v3 one group", _cfg(V3, num_experts=16, top_k=6, n_group=1, topk_group=1)),
])
def test_matches_the_reference(name, cfg):
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, (200, cfg.num_experts)).astype(np.float32)
    bias = rng.normal(0, 0.3, cfg.num_experts).astype(np.float32)
    ids, w = _route(cfg, logits, bias)
    want_ids, want_w = reference(cfg, logits, bias)
    np.testing.assert_array_equal(ids, want_ids, err_msg=name)
    np.testing.assert_allclose(w, want_w, rtol=2e-6, atol=0, err_msg=name)


def test_v3_ids_come_in_descending_choice_and_raw_logits_are_returned():
    cfg = _cfg(V3, num_experts=8, top_k=3, n_group=1, topk_group=1)
    logits = np.array([[0.1, 2.0, -1.0, 0.5, 1.5, 0.0, -2.0, 0.3]], np.float32)
    bias = np.array([0, -1.0, 0, 0, 0, 0.5, 0, 0], np.float32)
    r = route_deepseek(cfg, jnp.asarray(logits), None, jnp.asarray(bias))
    s = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
    order = np.argsort(-(s + bias))[:3]  # [4, 5, 3]
    assert list(np.asarray(r.topk_ids[0])) == list(order)
    np.testing.assert_array_equal(np.asarray(r.logits), logits)


def test_bias_selects_but_never_weighs():
    """vLLM PR 12002: the e_score_correction_bias leaked into the combine weights. Expert 0 has a low score and a
    large bias: it is chosen, with its unbiased sigmoid score as weight."""
    cfg = _cfg(V3, num_experts=4, top_k=2, n_group=1, topk_group=1, norm_topk_prob=False,
               routed_scaling_factor=1.0)
    logits = np.array([[-1.0, 2.0, 1.0, 0.0]], np.float32)
    bias = np.array([3.0, 0.0, 0.0, 0.0], np.float32)
    ids, w = _route(cfg, logits, bias)
    sig = [1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-2.0))]  # experts 0 and 1
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w[0], sig, rtol=1e-6)
    assert not np.allclose(w[0, 0], sig[0] + 3.0)


def test_masked_groups_are_minus_infinity_not_zero():
    """vLLM PR 13474 filled the masked groups with 0: with every biased score negative, a masked expert (0) beat the
    allowed ones. E = 4 in 2 groups, topk_group 1, bias -2: s = sigmoid([0, 0, 3, 2]) = [.5, .5, .953, .881], biased
    [-1.5, -1.5, -1.047, -1.119]; group scores (sum of the top 2) -3 and -2.166: only group 1 (experts 2, 3)."""
    cfg = _cfg(V3, num_experts=4, top_k=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    logits = np.array([[0.0, 0.0, 3.0, 2.0]], np.float32)
    ids, w = _route(cfg, logits, np.full(4, -2.0, np.float32))
    s2, s3 = 1 / (1 + math.exp(-3.0)), 1 / (1 + math.exp(-2.0))
    assert ids.tolist() == [[2, 3]]
    np.testing.assert_allclose(w[0], [2.5 * s2 / (s2 + s3), 2.5 * s3 / (s2 + s3)], rtol=1e-6)
    # the same for V2's group_limited_greedy on softmax scores
    v2 = _cfg(V2, num_experts=4, top_k=2, topk_method="group_limited_greedy", n_group=2, topk_group=1)
    ids, _ = _route(v2, np.array([[2.0, 0.0, 1.5, 1.4]], np.float32))  # group maxima 2.0 vs 1.5 -> group 0
    assert ids.tolist() == [[0, 1]]


def test_small_score_with_large_bias_keeps_its_weight():
    """flashinfer PR 3875 recovered the weight as (s + b) - b, which is 0 in float32 for s = sigmoid(-30) = 9.4e-14
    and b = 10. Experts 0, 1 are chosen by their bias; their weights are their scores, renormalised."""
    cfg = _cfg(V3, num_experts=4, top_k=2, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    logits = np.array([[-30.0, -31.0, 5.0, 5.0]], np.float32)
    bias = np.array([10.0, 10.0, 0.0, 0.0], np.float32)
    assert np.float32(np.float32(1 / (1 + math.exp(30.0))) + np.float32(10.0)) - np.float32(10.0) == 0
    ids, w = _route(cfg, logits, bias)
    s0, s1 = 1 / (1 + math.exp(30.0)), 1 / (1 + math.exp(31.0))
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w[0], [2.5 * s0 / (s0 + s1), 2.5 * s1 / (s0 + s1)], rtol=1e-5)
    ids, w = _route(_cfg(cfg, norm_topk_prob=False), logits, bias)
    np.testing.assert_allclose(w[0], [2.5 * s0, 2.5 * s1], rtol=1e-5)
    assert (w > 0).all()


def test_without_norm_topk_prob_weights_are_scaled_scores_not_logits():
    """sglang PR 35160 returned the raw logits as weights when norm_topk_prob is false."""
    cfg = _cfg(V3, num_experts=4, top_k=2, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.0)
    logits = np.array([[1.0, -0.5, 0.25, 3.0]], np.float32)
    ids, w = _route(cfg, logits, np.zeros(4, np.float32))
    assert ids.tolist() == [[0, 3]]
    np.testing.assert_allclose(w[0], [2 / (1 + math.exp(-1.0)), 2 / (1 + math.exp(-3.0))], rtol=1e-6)
    assert not np.allclose(w[0], [1.0, 3.0]) and not np.allclose(w[0], [2.0, 6.0])


def test_v2_weights_are_scaled_softmax_probabilities_without_renormalisation():
    """transformers' DeepseekV2TopkRouter: softmax over all experts, top-k, times routed_scaling_factor; it does not
    renormalise even when norm_topk_prob is true (tests/fixtures/hf_tiny/deepseek_v2_group pins this too)."""
    logits = np.array([[1.0, 2.0, 0.0, -1.0]], np.float32)
    p = np.exp(logits[0].astype(np.float64)) / np.exp(logits[0].astype(np.float64)).sum()
    for norm in (False, True):
        ids, w = _route(_cfg(V2, num_experts=4, top_k=2, routed_scaling_factor=1.5, norm_topk_prob=norm), logits)
        assert ids.tolist() == [[0, 1]]
        np.testing.assert_allclose(w[0], 1.5 * p[[0, 1]], rtol=1e-6)


def test_padding_routes_nowhere_and_v3_needs_the_bias():
    cfg = _cfg(V3, num_experts=8, top_k=2, n_group=4, topk_group=2)
    logits = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    r = route_deepseek(cfg, jnp.asarray(logits), jnp.asarray([True, False, True]), jnp.zeros(8))
    assert (np.asarray(r.topk_ids[1]) == -1).all() and (np.asarray(r.topk_weights[1]) == 0).all()
    assert (np.asarray(r.topk_ids)[[0, 2]] >= 0).all()
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        route_deepseek(cfg, jnp.asarray(logits))
