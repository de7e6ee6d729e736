"""Generation engine: one compiled decode step for any routing, in-place slot pools, long decodes, sampling."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ft_jax.checkpoint import load_checkpoint
from engine_helpers import decode_cache_size, lower_decode_step
from ft_jax.engine.engine import Engine, eos_operand, kv_bucket, prefill_bucket
from ft_jax.engine.sampling import (NonFiniteLogitsError, Sampling, first_argmax, greedy_pick, row_key_data,
                                   sample_next)
from ft_jax.engine.steps import FINISHED, DecodePace
from ft_jax.offload.cost_model import auto_costs
from ft_jax.offload.policy import Policy, PolicyKind

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


@pytest.fixture(scope="module")
def mixtral():
    return load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.float32)


def _info(family):
    return json.load(open(os.path.join(FIXTURES, family, "reference", "info.json")))


def test_decode_step_compiles_once_over_64_steps(mixtral):
    cfg = mixtral.config
    ckpt = dataclasses.replace(mixtral, config=dataclasses.replace(cfg, max_position_embeddings=512))
    engine = Engine(ckpt, policy=Policy("qstar", frac=0.415), num_slots=5)
    # Sampling at temperature 1 makes the routing differ from step to step.
    result = engine.generate([_info("mixtral")["prompt_ids"]], max_new_tokens=65, sampling=Sampling(1.0), seed=3)
    assert result.stats["decode_steps"] == 64
    assert result.stats["decode_compiles"] == 1
    assert decode_cache_size(engine) == 1
    # The routing really changed: experts were both fetched and computed on the host along the way.
    assert result.stats["fetched_per_step"] > 0 and result.stats["host_per_step"] > 0
    # Timing statistics: rates exclude compilation, which happened in this call.
    stats = result.stats
    assert stats["compile_s"] > 0 and 0 < stats["prefill_s"] <= stats["ttft_s"]
    assert stats["decode_tokens_per_s"] == pytest.approx(64 / stats["decode_s"])
    # A second generate call with another prompt of the same bucket reuses the compiled step.
    again = engine.generate([[5, 6, 7]], max_new_tokens=65, sampling=Sampling(1.0), seed=4)
    assert again.stats["decode_compiles"] == 0


def _copies(hlo: str, shape: str) -> list[str]:
    return [l for l in hlo.splitlines() if re.search(r"= " + re.escape(shape) + r"\{[^}]*\} copy(-start)?\(", l)]


@pytest.mark.parametrize("policy", [Policy("fetch-all"), Policy("qstar", frac=0.415), Policy("host-all"),
                                    Policy("resident")], ids=str)
def test_optimized_hlo_updates_slot_pools_and_kv_cache_in_place(mixtral, policy):
    """The scanned decode step: one while loop over the 4 MoE layers, no full copy of a slot pool or of a KV-cache
    stack in the optimized HLO, and the donated inputs aliased to the outputs."""
    cfg = mixtral.config
    engine = Engine(mixtral, policy=policy, num_slots=6)
    S = engine.num_slots  # L*E for resident
    hlo = lower_decode_step(engine, batch_size=1, kv_len=32).compile().as_text()
    I, H, L = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_layers
    # The layers are one loop, not unrolled: the loop body holds one q/k/v, o and router projection (plus lm_head).
    assert " while(" in hlo and hlo.count('custom_call_target="ft_jax_linear"') == 4
    pools = (f"f32[{S},{2 * I},{H}]", f"f32[{S},{H},{I}]")
    if policy.kind is PolicyKind.HOST_ALL:  # never fills or reads a slot: pools of one element per slot, not an expert
        pools = (f"f32[{S},1]",)
        assert sum(p.nbytes for p in engine.expert_state.pools.values()) == 2 * S * 4
    kv = f"f32[{L},1,32,{cfg.num_kv_heads},{cfg.head_dim}]"
    for shape in (*pools, kv):
        assert shape in hlo  # really in the step
        assert not _copies(hlo, shape), f"{shape} is copied:\n" + "\n".join(_copies(hlo, shape))
    assert "input_output_alias" in hlo


def test_long_decode_stays_finite_and_equal_to_resident(mixtral):
    cfg = mixtral.config
    ckpt = dataclasses.replace(mixtral, config=dataclasses.replace(cfg, max_position_embeddings=512))
    prompt = _info("mixtral")["prompt_ids"]
    resident = Engine(ckpt, policy=Policy("resident"), num_slots=0).generate([prompt], max_new_tokens=300)
    offloaded = Engine(ckpt, policy=Policy("qstar", frac=0.5), num_slots=3).generate([prompt], max_new_tokens=300)
    assert len(resident.tokens[0]) == 300
    assert offloaded.tokens == resident.tokens
    assert offloaded.stats["decode_compiles"] == 1


@pytest.fixture(scope="module")
def qwen2_moe():
    return load_checkpoint(os.path.join(FIXTURES, "qwen2_moe"), dtype=jnp.float32)


def _auto(ckpt):
    """auto with costs under which a layer both fetches and host-computes misses (equal bandwidths)."""
    return Policy("auto", costs=auto_costs(ckpt.banks.gate_up.row_bytes + ckpt.banks.down.row_bytes, 10.0, 10.0))


@pytest.mark.parametrize("policy", ["fetch-all", "qstar", "auto"])
def test_batch_of_prompts_equals_each_alone(qwen2_moe, policy):
    info = _info("qwen2_moe")
    prompts = [info["prompt_ids"], [9, 8, 7]]
    policy = {"fetch-all": Policy("fetch-all"), "qstar": Policy("qstar", frac=0.5), "auto": _auto(qwen2_moe)}[policy]
    engine = Engine(qwen2_moe, policy=policy, num_slots=4)
    batch = engine.generate(prompts, max_new_tokens=8).tokens
    assert batch[0] == info["greedy_continuation"][:8]
    assert batch[1] == engine.generate([prompts[1]], max_new_tokens=8).tokens[0]


def test_eos_stops_a_row(mixtral):
    info = _info("mixtral")
    engine = Engine(mixtral, policy=Policy("host-all"), num_slots=1)
    eos = info["greedy_continuation"][3]
    out = engine.generate([info["prompt_ids"]], max_new_tokens=16, eos_token_ids=[eos]).tokens[0]
    assert out == info["greedy_continuation"][: info["greedy_continuation"].index(eos) + 1]
    # every listed EOS id stops (Qwen checkpoints list several): the earliest one produced ends the row
    later = info["greedy_continuation"][6]
    out = engine.generate([info["prompt_ids"]], max_new_tokens=16, eos_token_ids=(later, eos)).tokens[0]
    first = min(info["greedy_continuation"].index(t) for t in (later, eos))
    assert out == info["greedy_continuation"][: first + 1]


def test_prefill_compiles_once_per_bucket(mixtral):
    engine = Engine(mixtral, policy=Policy("fetch-all"), num_slots=4)
    compiles = [engine.generate([prompt], max_new_tokens=2).stats["prefill_compiles"]
                for prompt in ([1, 2, 3], [4, 5, 6, 7, 8], list(range(1, 17)))]  # lengths 3, 5, 16: bucket 16
    assert compiles == [1, 0, 0]
    assert engine.generate([list(range(1, 18))], max_new_tokens=2).stats["prefill_compiles"] == 1  # bucket 32


def test_no_recompile_for_another_length_or_temperature_in_the_same_buckets(mixtral):
    """max_new_tokens 20 and 40 share the KV bucket 64 (12 prompt tokens + new tokens); temperature, top_k and
    top_p are operands: only greedy vs sampled is a second executable."""
    engine = Engine(mixtral, policy=Policy("qstar", frac=0.5), num_slots=5)
    prompt = _info("mixtral")["prompt_ids"]
    first = engine.generate([prompt], max_new_tokens=20, sampling=Sampling(0.8)).stats
    assert (first["prefill_compiles"], first["decode_compiles"], first["kv_cache_len"]) == (1, 1, 64)
    for n, sampling in ((40, Sampling(0.8)), (33, Sampling(1.3, top_k=5)), (20, Sampling(0.5, top_p=0.9))):
        stats = engine.generate([prompt], max_new_tokens=n, sampling=sampling, seed=n).stats
        assert (stats["prefill_compiles"], stats["decode_compiles"]) == (0, 0)
    greedy = engine.generate([prompt], max_new_tokens=30).stats
    assert (greedy["prefill_compiles"], greedy["decode_compiles"]) == (1, 1)
    assert engine.generate([prompt], max_new_tokens=52).stats["decode_compiles"] == 0
    assert engine.generate([prompt], max_new_tokens=53).stats["kv_cache_len"] == 128  # 12 + 53 > 64: next bucket


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux memory mappings")
def test_a_dropped_engine_releases_its_executables_memory_mappings(mixtral):
    """XLA:CPU keeps each executable's JIT code in mappings of its own. JAX's caches must not keep a dropped
    Engine's executables alive (a suite of many Engines once reached vm.max_map_count, 65530, and crashed), nor its
    backends, which hold the host banks."""
    import gc
    import weakref

    def mappings():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    before = mappings()
    engine = Engine(mixtral, policy=Policy("fetch-all"), num_slots=3)
    engine.generate([[1, 2, 3]], max_new_tokens=3)
    built = mappings() - before
    backends = [weakref.ref(engine.decode_backend), weakref.ref(engine.prefill_backend)]
    del engine
    gc.collect()
    left = mappings() - before
    assert built > 100 and left < built // 4, (built, left)
    assert [r() for r in backends] == [None, None]


def test_buckets():
    assert [prefill_bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    assert [kv_bucket(n, 4096) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    assert kv_bucket(200, 256) == 256 and kv_bucket(257, 300) == 300 and kv_bucket(10, 32) == 32  # capped


def test_non_finite_logits_are_reported_not_decoded(mixtral):
    """NaN in the lm_head: the step returns -1 for the row and generate raises naming the step, then keeps working
    once the weights are fixed."""
    engine = Engine(mixtral, policy=Policy("host-all"), num_slots=1)
    good = engine.params
    head = good["lm_head"][...]
    engine.params = jax.tree_util.tree_map(lambda x: x, good)
    engine.params["lm_head"] = engine.params["lm_head"].replace(head.at[3, 0].set(jnp.nan))
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite .* logits at step 0 for row\(s\) \[0\]"):
        engine.generate([[1, 2, 3]], max_new_tokens=4)
    engine.params = good
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=4).tokens[0]) == 4


def test_overflowing_activations_are_reported_not_decoded(mixtral):
    """A finite but huge weight (1e30 in the embedding row of token 2): the RMSNorms' mean of squares overflows
    float32. transformers' formula turns that vector into 0, the model goes on with finite numbers and every logit
    is equal (greedy: token 0); here the norm gives NaN and generate raises at the step, as for NaN weights."""
    engine = Engine(mixtral, policy=Policy("host-all"), num_slots=1)
    good = engine.params
    table = good["embed_tokens"][...]
    engine.params = jax.tree_util.tree_map(lambda x: x, good)
    engine.params["embed_tokens"] = engine.params["embed_tokens"].replace(table.at[2].set(1e30))
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite .* logits at step 0 for row\(s\) \[1\]"):
        engine.generate([[1, 3], [1, 2]], max_new_tokens=3)
    engine.params = good
    assert [len(t) for t in engine.generate([[1, 3], [1, 2]], max_new_tokens=3).tokens] == [3, 3]


def _draws(logits, sampling, n=400):
    step = jax.jit(lambda key, t, k, p: sample_next(logits, key, jnp.zeros(1, jnp.int32), t, k, p,
                                                    greedy=sampling.greedy))
    return np.array([int(step(row_key_data(i, 0)[None], *sampling.operands(1))[0]) for i in range(n)])


def test_a_row_samples_the_same_whatever_its_neighbours():
    """Per-row keys and sampling values: row 0's draws depend on its own logits, key and counter only; a greedy row
    (temperature 0) in the sampling executable takes the argmax."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 50)), jnp.float32)
    keys = np.stack([row_key_data(7, 0), row_key_data(1, 1), row_key_data(2, 2)])
    ops = (np.array([1.0, 0.0, 0.5], np.float32), np.array([0, 0, 5], np.int32), np.array([0.9, 1.0, 1.0], np.float32))
    step = jax.jit(lambda l, k, c, *o: sample_next(l, k, c, *o, greedy=False))
    counters = np.array([4, 9, 2], np.int32)
    out = np.asarray(step(logits, keys, counters, *ops))
    assert out[1] == int(jnp.argmax(logits[1]))
    other = logits.at[1:].set(jnp.asarray(rng.normal(size=(2, 50)), jnp.float32))
    alone = [int(step(l[None], keys[:1], counters[:1], *(o[:1] for o in ops))[0]) for l in (logits[0], other[0])]
    assert out[0] == alone[0] == alone[1] == int(step(other, keys, counters, *ops)[0])
    draws = {int(step(logits, keys, np.array([c, 9, 2], np.int32), *ops)[0]) for c in range(20)}
    assert len(draws) > 1  # the counter (the position) gives every step its own draw


def test_sampling_rules():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.log(jnp.asarray([probs], jnp.float32))
    assert set(_draws(logits, Sampling(), 3)) == {0}
    draws = _draws(logits, Sampling(1.0, top_k=2))
    assert set(draws) <= {0, 1}
    assert abs((draws == 1).mean() - 0.3 / 0.8) < 0.08  # top-k 2 renormalises 0.5 : 0.3
    # top-p 0.7: keep {0, 1} (mass before token 1 is 0.5 < 0.7; before token 2 it is 0.8 >= 0.7)
    assert set(_draws(logits, Sampling(1.0, top_p=0.7))) <= {0, 1}
    # temperature 2 flattens: p ~ probs^(1/2), renormalised
    flat = np.sqrt(probs) / np.sqrt(probs).sum()
    counts = np.bincount(_draws(logits, Sampling(2.0)), minlength=4) / 400
    assert np.abs(counts - flat).max() < 0.08
    # no filter: all four tokens appear with their probabilities
    assert np.abs(np.bincount(_draws(logits, Sampling(1.0)), minlength=4) / 400 - probs).max() < 0.08
    nan_row = jnp.asarray([[0.0, jnp.nan, 1.0, 0.0]], jnp.float32)
    key, counter = row_key_data(0, 0)[None], jnp.zeros(1, jnp.int32)
    assert int(sample_next(nan_row, key, counter, *Sampling().operands(1), greedy=True)[0]) == -1
    assert int(sample_next(nan_row, key, counter, *Sampling(1.0).operands(1), greedy=False)[0]) == -1
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(float("inf"))


def test_greedy_pick_is_numpys_argmax_ties_first():
    """The greedy pick, both forms (first_argmax: XLA's ops; greedy_pick: the CPU's FFI call): numpy's argmax (the
    first index of the maximum) on random rows, on rows with ties (equal values, -0.0 against 0.0, a tie at the last
    index), on a row of one value and on a row of 201088 logits (gpt-oss's vocabulary) whose maximum is last; a row
    holding a NaN or an infinity anywhere gives -1 from greedy_pick (first_argmax of a NaN row gives V)."""
    rng = np.random.default_rng(3)
    rows = [rng.normal(size=50), np.round(rng.normal(size=50)), np.r_[np.zeros(49), 3.0],
            np.r_[[-0.0, 0.0], -np.ones(48)], np.r_[[0.0, -0.0], -np.ones(48)], np.r_[np.ones(49) * 2, 5.0 - 3.0],
            np.full(50, -7.5)]
    logits = np.asarray(rows, np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(logits))), np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_pick)(jnp.asarray(logits))), np.argmax(logits, axis=-1))
    nan_row = np.r_[[1.0, np.nan], np.zeros(48)].astype(np.float32)[None]
    assert int(first_argmax(jnp.asarray(nan_row))[0]) == 50
    wide = rng.normal(size=(3, 201088)).astype(np.float32)
    wide[0, -1] = 10.0
    wide[2, [7, 90000]] = 10.0
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_pick)(wide)), [201087, np.argmax(wide[1]), 7])
    bad = np.repeat(logits[:1], 7, axis=0)
    for row, (at, value) in enumerate([(0, np.nan), (17, np.nan), (49, np.nan), (3, np.inf), (49, -np.inf),
                                       (0, -np.inf), (25, np.inf)]):
        bad[row, at] = value
    clean = rng.normal(size=(1, 50)).astype(np.float32)
    mixed = np.concatenate([bad, clean])
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_pick)(mixed)), [-1] * 7 + [np.argmax(clean[0])])
    stacked = np.stack([logits, logits[::-1]])  # [2, B, V] under jax.vmap: one call per element
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(greedy_pick))(stacked)),
                                  np.argmax(stacked, axis=-1))


def test_recorded_routing_is_the_reference_decode_routing(mixtral):
    """record_routing returns each decode step's top-k ids and weights: transformers' decode routing of the fixture."""
    info = _info("mixtral")
    ref_ids = np.load(os.path.join(FIXTURES, "mixtral", "reference", "decode_topk_ids.npy"))  # [15, L, k]
    ref_w = np.load(os.path.join(FIXTURES, "mixtral", "reference", "decode_topk_weights.npy"))
    engine = Engine(mixtral, policy=Policy("qstar", frac=0.5), num_slots=5)
    result = engine.generate([info["prompt_ids"]], max_new_tokens=16, record_routing=True)
    assert result.tokens[0] == info["greedy_continuation"]
    ids, weights = result.routing  # [15, L, B=1, k]
    assert ids.shape == (15, mixtral.config.num_moe_layers, 1, 2)
    np.testing.assert_array_equal(ids[:, :, 0], ref_ids)
    np.testing.assert_allclose(weights[:, :, 0], ref_w, atol=1e-5)
    assert engine.generate([info["prompt_ids"]], max_new_tokens=4).routing is None


@pytest.mark.parametrize("policy", [Policy("qstar", frac=0.415), Policy("resident")], ids=str)
def test_gpt_oss_decode_step_bias_pools_in_place_and_reference_routing(policy):
    """gpt-oss (MXFP4 fixture: biases, mixed sliding/full layers in one stack): the bias and scale pools travel with
    the weight pools (the MXFP4 bytes as stored) through one slot_fill per layer (6 pools) and are not copied, the
    layers are one loop, and the engine's greedy continuation and recorded decode routing are transformers'."""
    ckpt = load_checkpoint(os.path.join(FIXTURES, "gpt_oss_mxfp4"), dtype=jnp.float32)
    cfg = ckpt.config
    engine = Engine(ckpt, policy=policy, num_slots=5)
    S, I, H = engine.num_slots, cfg.moe_intermediate_size, cfg.hidden_size
    hlo = lower_decode_step(engine, batch_size=1, kv_len=32).compile().as_text()
    assert " while(" in hlo and hlo.count('custom_call_target="ft_jax_linear"') == 4
    hlo_type = {"uint8": "u8", "float32": "f32"}
    pools = [f"{hlo_type[dt.name]}[{','.join(map(str, shape))}]"
             for shape, dt in engine.decode_backend.banks.pool_shapes(S).values()]
    assert pools == [f"u8[{S},{2 * I},{H // 2}]", f"u8[{S},{H},{I // 2}]", f"f32[{S},{2 * I}]", f"f32[{S},{H}]",
                     f"u8[{S},{2 * I},{H // 32}]", f"u8[{S},{H},{I // 32}]"]
    for shape in pools:
        assert shape in hlo and not _copies(hlo, shape), f"{shape} missing or copied"
    fills = [l for l in hlo.splitlines() if 'custom_call_target="ft_jax_slot_fill"' in l]
    assert len(fills) == (0 if policy.kind == "resident" else 1)  # in the loop body: one call for all 6 pools
    assert all(all(p in l for p in pools) for l in fills)
    info = _info("gpt_oss_mxfp4")
    ref_ids = np.load(os.path.join(FIXTURES, "gpt_oss_mxfp4", "reference", "decode_topk_ids.npy"))  # [15, L, k]
    result = engine.generate([info["prompt_ids"]], max_new_tokens=16, record_routing=True)
    assert result.tokens[0] == info["greedy_continuation"] and result.stats["decode_compiles"] == 1
    np.testing.assert_array_equal(result.routing[0][:, :, 0], ref_ids)


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"])
def test_bf16_models_decode_alike_under_every_policy_and_cache_size(tmp_path, architecture):
    """bf16 weights take the bf16 kernel paths (bf16 dots, activations rounded to bf16 before the down projection):
    a slot-computed and a host-computed route must still give the same tokens. Random checkpoints from
    ft_jax.testing, one per path family (plain SwiGLU, MLA with shared experts, biased clamped SwiGLU)."""
    from ft_jax import testing

    path = testing.write_random_checkpoint(tmp_path, testing.tiny_config(architecture), seed=2, std=0.2,
                                           dtype="bfloat16")
    # one slot (every policy splits a layer's misses) everywhere; half of the experts too on the plain SwiGLU model
    slots = (1, None) if architecture == "MixtralForCausalLM" else (1,)
    tokens = testing.assert_policies_agree(path, [3, 1, 4, 1, 5, 9], cache_slots=slots, max_new_tokens=6)
    assert len(tokens) == 6


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_row_key_data_is_jax_random_fold_in_of_the_seed(impl):
    """row_key_data computes threefry's fold_in itself (no XLA program at launch); other PRNGs run JAX's."""
    with jax.default_prng_impl(impl):
        for seed in [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, -3]:
            for row in [0, 1, 2, 63, 255, 2**31 - 1]:
                key = jax.random.fold_in(jax.random.key(np.uint32(seed % 2**32)), np.int32(row))
                want = np.asarray(jax.random.key_data(key))
                got = row_key_data(seed, row)
                assert got.dtype == np.uint32 and np.array_equal(got, want), (impl, seed, row)


def _run_generate(engine, prompts, stop_row_at=None, **kw):
    """generate with an on_tokens that logs every call and ends row stop_row_at[0] at step stop_row_at[1]."""
    calls = []

    def on_tokens(step, new):
        calls.append((step, list(new)))
        if stop_row_at is not None and step == stop_row_at[1]:
            return [b == stop_row_at[0] for b in range(len(new))]
        return None

    return engine.generate(prompts, on_tokens=on_tokens, **kw), calls


def test_runs_of_many_decode_steps_equal_one_step_runs(mixtral):
    """generate's decode loop (steps.decode_tokens) runs up to DECODE_CHUNK_STEPS steps per executable run; a row that
    ends inside a run (an EOS id, a stop from on_tokens) takes no later token, and the tokens, the on_tokens calls,
    the recorded routing and the step count equal one step per run (decode_chunk_s=0)."""
    info = _info("mixtral")
    prompts = [info["prompt_ids"], [9, 8, 7, 6], [5]]
    eos = info["greedy_continuation"][6]
    kw = dict(max_new_tokens=40, sampling=Sampling(0.9, top_k=20), seed=11, eos_token_ids=[eos], record_routing=True)
    one = Engine(mixtral, policy=Policy("qstar", frac=0.5), num_slots=5, decode_chunk_s=0)
    many = Engine(mixtral, policy=Policy("qstar", frac=0.5), num_slots=5, decode_chunk_s=1e9)
    a, calls_a = _run_generate(one, prompts, stop_row_at=(1, 9), **kw)
    b, calls_b = _run_generate(many, prompts, stop_row_at=(1, 9), **kw)
    assert a.tokens == b.tokens and calls_a == calls_b
    assert len(a.tokens[1]) == 10  # the first token and steps 1..9
    assert a.stats["decode_steps"] == b.stats["decode_steps"] == 39
    for x, y in zip(a.routing, b.routing):
        np.testing.assert_array_equal(x, y)
    # on_tokens ends the only row at step 3, inside the second run (steps 2..19): no later on_tokens call, token or
    # routing step; the 16 steps the device ran past it count as run
    a, calls_a = _run_generate(one, prompts[:1], stop_row_at=(0, 3), **kw)
    b, calls_b = _run_generate(many, prompts[:1], stop_row_at=(0, 3), **dict(kw, max_new_tokens=20))
    assert a.tokens == b.tokens and calls_a == calls_b and len(calls_a) == 4 and len(a.tokens[0]) == 4
    assert a.routing[0].shape[0] == b.routing[0].shape[0] == 3
    assert a.stats["decode_steps"] == 3 and b.stats["decode_steps"] == 19
    greedy = many.generate([info["prompt_ids"]], max_new_tokens=16, eos_token_ids=[eos]).tokens[0]
    assert greedy == info["greedy_continuation"][: info["greedy_continuation"].index(eos) + 1]


def test_non_finite_logits_inside_a_run_of_steps_name_their_step(mixtral):
    """NaN in the embedding row of the 5th generated token: decode step 5 feeds it, and generate names step 5 whether
    the steps run one per dispatch or many."""
    info = _info("mixtral")
    cont = info["greedy_continuation"]
    token = cont[4]
    assert token not in cont[:4] and token not in info["prompt_ids"]
    for chunk_s in (0, 1e9):
        engine = Engine(mixtral, policy=Policy("host-all"), num_slots=1, decode_chunk_s=chunk_s)
        table = engine.params["embed_tokens"][...]
        engine.params["embed_tokens"] = engine.params["embed_tokens"].replace(table.at[token].set(jnp.nan))
        with pytest.raises(NonFiniteLogitsError, match=r"non-finite .* logits at step 5 for row\(s\) \[0\]"):
            engine.generate([info["prompt_ids"]], max_new_tokens=12)


def test_decode_pace_and_eos_operand():
    """Steps per run: as many as fill the time at the last run's rate, 1..max_steps (hand-worked); the EOS operand is
    padded to a power of two with FINISHED."""
    pace = DecodePace(0.1, 32)
    assert pace.steps == 1
    pace.measured(1, 0.02)  # 20 ms a step: 5 steps fill 0.1 s
    assert pace.steps == 5
    pace.measured(5, 0.001)
    assert pace.steps == 32
    pace.measured(2, 1.0)
    assert pace.steps == 1
    pace.measured(1, 0.054)  # 54 ms a step: 1.85 steps fill 0.1 s, rounded to 2
    assert pace.steps == 2
    huge = DecodePace(1e308, 32)  # seconds / per step overflows to inf: capped first
    huge.measured(1, 1e-3)
    assert huge.steps == 32
    off = DecodePace(0.0, 32)
    off.measured(3, 0.001)
    assert off.steps == 1
    assert eos_operand(()).tolist() == [FINISHED]
    assert eos_operand({7}).tolist() == [7]
    assert eos_operand((3, 1, 2)).tolist() == [1, 2, 3, FINISHED]
    engine = Engine(load_checkpoint(os.path.join(FIXTURES, "mixtral")), policy=Policy("host-all"), num_slots=1)
    for bad in (-1, float("inf"), float("nan"), None, True, "0.1", 10**400):
        with pytest.raises(ValueError, match="decode_chunk_s must be a finite number of seconds >= 0"):
            engine.decode_chunk_s = bad
    with pytest.raises(ValueError, match="decode_chunk_s must be"):
        Engine(load_checkpoint(os.path.join(FIXTURES, "mixtral")), policy=Policy("host-all"), num_slots=1,
               decode_chunk_s=float("inf"))
    assert engine.decode_chunk_s == 0.1
