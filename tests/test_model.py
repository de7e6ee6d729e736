"""Model tests against the Hugging Face transformers reference outputs in tests/fixtures/hf_tiny.

Each fixture holds a tiny float32 checkpoint written by transformers 5.24 and its outputs on a fixed prompt
(README.md there). Logits of the same model differ by up to 1.8e-6 between two transformers runs.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from ft_jax.checkpoint import load_checkpoint
from ft_jax.config import load_config
from ft_jax.models.decoder import MoETransformer
from ft_jax.models.layers import random_param_factory, rms_norm
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2", "deepseek_v2_group",
            "deepseek_v3_nonorm", "deepseek_v3_yarn", "gpt_oss", "gpt_oss_mxfp4"]
# gpt_oss: the shared fixture (zero expert and attention biases); gpt_oss_mxfp4: written by
# scripts/make_gpt_oss_references.py (Hub layout, MXFP4 experts, every bias non-zero, the SwiGLU clamp reached).
MAX_LEN = 40


def routing_as_sets(ids, weights):
    """(ids, weights) [..., k] with each row's routes sorted by expert id. DeepSeek's references come from
    torch.topk(sorted=False), whose order torch leaves undefined, so those routings are compared as sets."""
    ids, weights = np.asarray(ids), np.asarray(weights)
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def assert_same_routing(family, ids, weights, ref_ids, ref_weights):
    """Identical routing: equal ids (as sets for DeepSeek, see routing_as_sets) and combine weights within 1e-5."""
    if family.startswith("deepseek"):
        (ids, weights), (ref_ids, ref_weights) = routing_as_sets(ids, weights), routing_as_sets(ref_ids, ref_weights)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_weights, atol=1e-5, rtol=0)


class HostBankExperts:
    """Minimal ExpertBackend computing every route on the CPU from the host banks (ffi_ops.host_experts, checked
    against float64 numpy in test_ffi_ops.py), registered as a pytree without leaves so a jitted forward can take
    it as an argument. bias_banks: (gate_up_bias, down_bias) HostBanks for experts with biases (gpt-oss);
    quantized: (gate_up_scale, down_scale, weight_format) of banks in a block format (gpt-oss's MXFP4)."""

    def __init__(self, gate_up: HostBank, down: HostBank, cfg, bias_banks=(None, None), quantized=(None, None, None)):
        self.gate_up, self.down = gate_up, down
        self.num_experts, self.activation = cfg.num_experts, cfg.activation
        self.extra = dict(gate_up_bias=bias_banks[0], down_bias=bias_banks[1], alpha=cfg.swiglu_alpha,
                          limit=cfg.swiglu_limit, gate_up_scale=quantized[0], down_scale=quantized[1],
                          weight_format=quantized[2])

    def __call__(self, moe_layer, x, topk_ids, topk_weights, expert_state):
        flat = jnp.where(topk_ids >= 0, moe_layer * self.num_experts + topk_ids, -1)  # [N, k]
        return ffi_ops.host_experts(x, flat, topk_weights, self.gate_up, self.down, self.activation,
                                    **self.extra), expert_state


jax.tree_util.register_pytree_node(HostBankExperts, lambda b: ((), b), lambda b, _: b)


def jit_forward(model, *, collect=False, last_logits_only=False):
    """(fn(state, tokens, positions, kv_cache, experts) -> model outputs, state): the functional forward, jitted."""
    graphdef, state = nnx.split(model)

    def fn(state, tokens, positions, kv_cache, experts):
        return nnx.merge(graphdef, state)(tokens, positions, kv_cache, None, experts, collect=collect,
                                          last_logits_only=last_logits_only)

    return jax.jit(fn), state


def _experts_of(ck):
    b = ck.banks
    return HostBankExperts(b.gate_up, b.down, ck.config, (b.gate_up_bias, b.down_bias),
                           (b.gate_up_scale, b.down_scale, b.format) if b.quantized else (None, None, None))


class Loaded:
    """One fixture loaded once per module: checkpoint, host-bank experts, jitted forward, reference arrays."""

    def __init__(self, family):
        self.family = family
        self.dir = os.path.join(FIXTURES, family)
        self.info = json.load(open(os.path.join(self.dir, "reference", "info.json")))
        self.ref = {n[:-4]: np.load(os.path.join(self.dir, "reference", n))
                    for n in os.listdir(os.path.join(self.dir, "reference")) if n.endswith(".npy")}
        self.ckpt = load_checkpoint(self.dir)
        self.cfg = self.ckpt.config
        self.experts = _experts_of(self.ckpt)
        self.fwd, self.state = jit_forward(self.ckpt.model, collect=True)
        self.prompt = np.array(self.info["prompt_ids"], np.int32)

    def run(self, tokens, positions, kv, experts=None):
        return self.fwd(self.state, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), kv,
                        self.experts if experts is None else experts)

    def greedy(self, prompt, new_tokens, stepwise_prefill=False, experts=None):
        """KV-cached greedy decoding of one sequence: a prefill call over the prompt (or, with stepwise_prefill,
        one T=1 call per prompt token), then T=1 decode calls.
        Returns (new tokens, aux of each decode step, logits [P + new_tokens - 1, V] of every position fed)."""
        kv = self.ckpt.model.init_kv_cache(1, MAX_LEN)
        P = len(prompt)
        if stepwise_prefill:
            all_logits = []
            for p in range(P):
                logits, kv, _, _ = self.run([[prompt[p]]], [[p]], kv, experts)
                all_logits.append(np.asarray(logits[0, -1]))
        else:
            logits, kv, _, _ = self.run(prompt[None], np.arange(P)[None], kv, experts)
            all_logits = list(np.asarray(logits[0]))
        out, auxes = [int(np.argmax(all_logits[-1]))], []
        for i in range(new_tokens - 1):
            logits, kv, _, aux = self.run([[out[-1]]], [[P + i]], kv, experts)
            out.append(int(jnp.argmax(logits[0, -1])))
            auxes.append(aux)
            all_logits.append(np.asarray(logits[0, -1]))
        return out, auxes, np.stack(all_logits)


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    return Loaded(request.param)


def test_prompt_logits_hidden_states_and_routing(loaded):
    ref, T = loaded.ref, len(loaded.prompt)
    kv = loaded.ckpt.model.init_kv_cache(1, MAX_LEN)
    logits, _, _, aux = loaded.run(loaded.prompt[None], np.arange(T)[None], kv)
    assert logits.shape == (1, T, loaded.cfg.vocab_size) and logits.dtype == jnp.float32
    # README: "prompt logits within 1e-5 of transformers" (measured 1.2e-6 .. 5e-6 over the fixtures; hidden states up
    # to 3e-5 where gpt-oss's MXFP4 fixture reaches the SwiGLU clamp)
    np.testing.assert_allclose(np.asarray(logits[0]), ref["prompt_logits"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(aux.hidden_states[:, 0]), ref["prompt_hidden_states"], atol=5e-5, rtol=1e-5)
    assert aux.topk_ids.shape[0] == len(loaded.info["moe_layers"]) == loaded.cfg.num_moe_layers
    assert list(loaded.cfg.moe_layers) == loaded.info["moe_layers"]
    np.testing.assert_allclose(np.asarray(aux.router_logits[:, 0]), ref["prompt_router_logits"], atol=1e-5, rtol=0)
    assert_same_routing(loaded.family, aux.topk_ids[:, 0], aux.topk_weights[:, 0], ref["prompt_topk_ids"],
                        ref["prompt_topk_weights"])


def test_greedy_continuation_and_decode_routing(loaded):
    n = len(loaded.info["greedy_continuation"])
    toks, auxes, all_logits = loaded.greedy(loaded.prompt, n)
    assert toks == loaded.info["greedy_continuation"]
    ids = np.stack([np.asarray(a.topk_ids[:, 0, 0]) for a in auxes])  # [n-1, L_moe, k]
    w = np.stack([np.asarray(a.topk_weights[:, 0, 0]) for a in auxes])
    assert_same_routing(loaded.family, ids, w, loaded.ref["decode_topk_ids"], loaded.ref["decode_topk_weights"])
    # the KV-cached decode logits are the teacher-forced logits of the same positions
    T = len(loaded.prompt)
    np.testing.assert_allclose(all_logits, loaded.ref["full_sequence_logits"][:T + n - 1], atol=1e-4, rtol=0)


def test_left_padded_batch_full_sequence_and_each_alone(loaded):
    """One [2, T] batch: row 0 = prompt + reference continuation (teacher forcing: full_sequence_logits), row 1 =
    a shorter prompt left-padded (positions -1). Each row's logits and greedy continuation equal the same
    sequence run alone (token by token through the KV cache)."""
    full = np.array(loaded.info["prompt_ids"] + loaded.info["greedy_continuation"], np.int32)
    b = np.array([1, 99, 5, 31, 77, 12, 250], np.int32)
    T, pad, steps = len(full), len(full) - len(b), 5
    tokens = np.stack([full, np.concatenate([np.zeros(pad, np.int32), b])])
    pos = np.stack([np.arange(T), np.concatenate([-np.ones(pad), np.arange(len(b))])]).astype(np.int32)
    kv = loaded.ckpt.model.init_kv_cache(2, MAX_LEN)
    logits, kv, _, aux = loaded.run(tokens, pos, kv)
    np.testing.assert_allclose(np.asarray(logits[0]), loaded.ref["full_sequence_logits"], atol=1e-4, rtol=0)
    alone_full, _, alone_full_logits = loaded.greedy(full, steps, stepwise_prefill=True)
    alone_b, _, alone_b_logits = loaded.greedy(b, steps, stepwise_prefill=True)
    np.testing.assert_allclose(np.asarray(logits[0]), alone_full_logits[:T], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(logits[1, pad:]), alone_b_logits[:len(b)], atol=1e-5, rtol=0)
    # padding slots activate no expert and give finite logits
    assert np.all(np.asarray(aux.topk_ids[:, 1, :pad]) == -1) and np.all(np.asarray(aux.topk_weights[:, 1, :pad]) == 0)
    assert np.all(np.isfinite(np.asarray(logits)))
    # batched greedy decode with per-row positions
    nxt = np.asarray(jnp.argmax(logits[:, -1], -1))
    got = [nxt]
    for i in range(steps - 1):
        p = np.array([[T + i], [len(b) + i]], np.int32)
        logits, kv, _, _ = loaded.run(nxt[:, None], p, kv)
        nxt = np.asarray(jnp.argmax(logits[:, -1], -1))
        got.append(nxt)
    got = np.stack(got, 1)
    assert list(got[0]) == alone_full and list(got[1]) == alone_b


def test_stepwise_prefill_gives_the_reference_continuation(loaded):
    """One T=1 call per prompt token through the KV cache gives the teacher-forced logits and the continuation."""
    n = len(loaded.info["greedy_continuation"])
    toks, _, all_logits = loaded.greedy(loaded.prompt, n, stepwise_prefill=True)
    assert toks == loaded.info["greedy_continuation"]
    T = len(loaded.prompt)
    np.testing.assert_allclose(all_logits, loaded.ref["full_sequence_logits"][:T + n - 1], atol=1e-4, rtol=0)


def test_layers_are_scanned(loaded):
    """Runs of like layers are one DecoderStack each (a lax.scan: one while loop per stack in the HLO; MLA's layer
    body adds its two loops over the heads, ft_jax.models.mla.per_head_linear, once per stack, not per layer)."""
    cfg = loaded.cfg
    kinds = ["moe" if cfg.moe_layer_index(l) is not None else "dense" for l in range(cfg.num_layers)]
    runs = [sum(1 for _ in g) for _, g in __import__("itertools").groupby(kinds)]
    model = loaded.ckpt.model
    assert [s.num_layers for s in model.stacks] == runs
    assert all(leaf.shape[0] in (n, n * cfg.num_heads) for s, n in zip(model.stacks, runs)
               for leaf in jax.tree.leaves(nnx.state(s)))
    kv = model.init_kv_cache(1, MAX_LEN)
    hlo = loaded.fwd.lower(loaded.state, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), kv,
                           loaded.experts).as_text()
    assert hlo.count("stablehlo.while") == len(runs) * (3 if cfg.kv_lora_rank else 1)


def test_last_logits_only_and_cache_reuse():
    loaded = Loaded("qwen2_moe")
    T = len(loaded.prompt)
    fwd_last, state = jit_forward(loaded.ckpt.model, last_logits_only=True)
    kv = loaded.ckpt.model.init_kv_cache(1, MAX_LEN)
    logits, kv, st = fwd_last(state, jnp.asarray(loaded.prompt[None]), jnp.arange(T)[None], kv, loaded.experts)
    assert logits.shape == (1, 1, loaded.cfg.vocab_size) and st is None
    np.testing.assert_allclose(np.asarray(logits[0, 0]), loaded.ref["prompt_logits"][-1], atol=1e-4, rtol=0)
    # a prefill over a used cache (stale entries above the positions are never read) gives the same result
    logits2, _, _ = fwd_last(state, jnp.asarray(loaded.prompt[None]), jnp.arange(T)[None], kv, loaded.experts)
    np.testing.assert_array_equal(np.asarray(logits2), np.asarray(logits))


# bf16 logit error bound, derived from the format. bf16 keeps p = 8 significant bits (7 stored + the implicit one),
# so one round-to-nearest has a relative error of at most u = 2^-8 (half an ulp of 2^-7). Along the path from the
# embedding to a logit the bf16 forward rounds, per decoder layer: the input RMSNorm (normalise, scale: 2), the q/k/v
# projection (1), q/k norms (<= 2), RoPE (cos/sin cast, x cos, rot sin, sum: 4), scores (1), probabilities (1),
# attention output (1), o projection (1), residual add (1); the post-attention RMSNorm (2), the expert's gate/up (1),
# activation and product (2), down projection (1), the combined expert output (1), residual add (1): 22 per layer,
# plus 4 outside the layers (embedding and head weights, final RMSNorm). Model: each rounding adds an independent
# error uniform in [-u, u] of the logit scale (the token's max |logit|), so the logit error has std
# u * sqrt(n / 3) for n = 22 L + 4 rounded ops; the bound is 5 std (a Gaussian tail of 6e-7 per logit, ~3000 logits
# per fixture). For L = 3 / 4 layers that is 24.2 u / 27.7 u of max |logit|; measured (dev VM, this tree): at most
# 8.5 u (gpt_oss_mxfp4: error 0.0969 at max |logit| 2.92, bound 0.275), 4.1-7.3 u for the other fixtures.
BF16_U = 2.0 ** -8
BF16_ROUNDED_OPS_PER_LAYER, BF16_ROUNDED_OPS_OUTSIDE = 22, 4


def bf16_logit_error_bound(num_layers: int, logit_scale: np.ndarray) -> np.ndarray:
    """5 std of the rounding-error model above: 5 u sqrt(n / 3) * logit_scale, n = 22 num_layers + 4."""
    n = BF16_ROUNDED_OPS_PER_LAYER * num_layers + BF16_ROUNDED_OPS_OUTSIDE
    return 5 * BF16_U * np.sqrt(n / 3) * logit_scale


def test_bfloat16_load_is_close(loaded):
    """bfloat16 dense weights and host banks: the banks hold the rounded float32 weights; routing agrees for most
    tokens (router ties closer than bf16 noise may flip: info.json min margins are ~1e-4) and the logits of
    tokens whose routing did not change stay within the bf16 rounding bound (bf16_logit_error_bound)."""
    ck = load_checkpoint(loaded.dir, dtype=jnp.bfloat16)
    assert ck.model.dtype == jnp.bfloat16
    for bank, ref_bank in ((ck.banks.gate_up, loaded.ckpt.banks.gate_up), (ck.banks.down, loaded.ckpt.banks.down)):
        if ck.banks.quantized:  # MXFP4 experts are kept as stored whatever the dtype
            np.testing.assert_array_equal(bank.numpy(), ref_bank.numpy())
            continue
        assert bank.numpy().dtype == jnp.bfloat16
        np.testing.assert_array_equal(bank.numpy(), ref_bank.numpy().astype(jnp.bfloat16))
    experts = _experts_of(ck)
    fwd, state = jit_forward(ck.model, collect=True)
    T = len(loaded.prompt)
    logits, _, _, aux = fwd(state, jnp.asarray(loaded.prompt[None]), jnp.arange(T)[None],
                            ck.model.init_kv_cache(1, 16), experts)
    assert logits.dtype == jnp.float32
    ids, ref_ids = np.asarray(aux.topk_ids[:, 0]), loaded.ref["prompt_topk_ids"]
    if loaded.family.startswith("deepseek"):
        ids, ref_ids = np.sort(ids, -1), np.sort(ref_ids, -1)
    same = np.all(ids == ref_ids, axis=(0, 2))  # [T]
    assert same.mean() >= 0.75, same
    ref_logits = loaded.ref["prompt_logits"]  # [T, V]
    err = np.abs(np.asarray(logits[0]) - ref_logits).max(-1)  # [T]
    bound = bf16_logit_error_bound(loaded.cfg.num_layers, np.abs(ref_logits).max(-1))  # [T]
    assert np.all(err[same] < bound[same]), (err, bound)
    for bank in ck.banks.banks:
        bank.release()


def test_float32_model_with_bfloat16_banks(loaded):
    ck = load_checkpoint(loaded.dir, dtype=jnp.float32, expert_dtype=jnp.bfloat16)
    assert ck.model.dtype == jnp.float32
    for bank, ref_bank in ((ck.banks.gate_up, loaded.ckpt.banks.gate_up), (ck.banks.down, loaded.ckpt.banks.down)):
        if ck.banks.quantized:  # MXFP4 experts are kept as stored whatever the dtype
            np.testing.assert_array_equal(bank.numpy(), ref_bank.numpy())
            continue
        assert bank.numpy().dtype == jnp.bfloat16
        np.testing.assert_array_equal(bank.numpy(), ref_bank.numpy().astype(jnp.bfloat16))
    for bank in ck.banks.banks:
        bank.release()


def _random_model(cfg, key=0):
    return MoETransformer(cfg, random_param_factory(key, jnp.float32, std=0.2))


def _random_experts(cfg, seed=1):
    rng = np.random.default_rng(seed)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = HostBank.from_numpy(rng.normal(0, 0.2, (cfg.num_moe_layers * E, 2 * I, H)).astype(np.float32))
    down = HostBank.from_numpy(rng.normal(0, 0.2, (cfg.num_moe_layers * E, H, I)).astype(np.float32))
    return HostBankExperts(gate_up, down, cfg)


def test_sliding_window_limits_attention():
    """With window W a query at position p sees keys p-W+1..p, so through 4 layers token 0 reaches positions
    <= 4 * (W - 1): with W = 2 changing token 0 changes the logits at t <= 4 only; without a window, all."""
    cfg = dataclasses.replace(load_config(os.path.join(FIXTURES, "mixtral")), sliding_window=2)
    model, experts = _random_model(cfg), _random_experts(cfg)
    fwd, state = jit_forward(model)
    a = np.array([[5, 9, 13, 17, 21, 25, 29]], np.int32)
    b = a.copy()
    b[0, 0] = 200
    pos = jnp.arange(7)[None]
    la, _, _ = fwd(state, jnp.asarray(a), pos, model.init_kv_cache(1, 8), experts)
    lb, _, _ = fwd(state, jnp.asarray(b), pos, model.init_kv_cache(1, 8), experts)
    diff = np.abs(np.asarray(la - lb)).max(-1)[0]  # [T]
    assert np.all(diff[:5] > 1e-4) and np.all(diff[5:] == 0), diff
    full = dataclasses.replace(cfg, sliding_window=None)
    fwd_full, state_full = jit_forward(MoETransformer(full, random_param_factory(0, std=0.2)))
    lf, _, _ = fwd_full(state_full, jnp.asarray(b), pos, model.init_kv_cache(1, 8), experts)
    lfa, _, _ = fwd_full(state_full, jnp.asarray(a), pos, model.init_kv_cache(1, 8), experts)
    assert np.all(np.abs(np.asarray(lf - lfa)).max(-1)[0] > 1e-4)


def test_tied_word_embeddings_use_embedding_as_lm_head():
    cfg = dataclasses.replace(load_config(os.path.join(FIXTURES, "qwen3_moe")), tie_word_embeddings=True)
    model, experts = _random_model(cfg), _random_experts(cfg)
    assert model.lm_head is None
    fwd, state = jit_forward(model, collect=True)
    toks = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
    logits, _, _, aux = fwd(state, toks, jnp.arange(5)[None], model.init_kv_cache(1, 8), experts)
    ref = np.asarray(aux.hidden_states[-1, 0], np.float64) @ np.asarray(model.embed_tokens[...], np.float64).T
    np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=1e-4, rtol=1e-5)


def test_rms_norm_of_an_overflowing_vector_is_nan():
    """mean(x^2) beyond float32 gives NaN (not transformers' 0); a large vector that does not overflow is normalized
    as numpy computes it, in float64."""
    x = np.array([[3e19, 1.0, -2.0, 0.5], [3e18, 1.0, -2.0, 0.5]], np.float32)
    w = np.array([1.0, 2.0, 0.5, -1.0], np.float32)
    got = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6))
    assert np.isnan(got[0]).all()
    x64 = x[1].astype(np.float64)
    np.testing.assert_allclose(got[1], w * x64 / np.sqrt(np.mean(x64 * x64) + 1e-6), rtol=1e-6)
