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
from ft_jax.generate import Engine, Sampling, prefill_bucket, sample_next
from ft_jax.offload.policy import Policy

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
    assert engine.decode_cache_size() == 1
    # The routing really changed: experts were both fetched and computed on the host along the way.
    assert result.stats["fetched_per_step"] > 0 and result.stats["host_per_step"] > 0
    # Timing statistics: rates exclude compilation, which happened in this call.
    stats = result.stats
    assert stats["compile_s"] > 0 and 0 < stats["prefill_s"] <= stats["ttft_s"]
    assert stats["decode_tokens_per_s"] == pytest.approx(64 / stats["decode_s"])
    # A second generate call with another prompt of the same bucket reuses the compiled step.
    again = engine.generate([[5, 6, 7]], max_new_tokens=65, sampling=Sampling(1.0), seed=4)
    assert again.stats["decode_compiles"] == 0


@pytest.mark.parametrize("policy", [Policy("fetch-all"), Policy("qstar", frac=0.415), Policy("host-all"),
                                    Policy("resident")], ids=str)
def test_optimized_hlo_has_no_copy_of_the_slot_pools(mixtral, policy):
    cfg = mixtral.config
    engine = Engine(mixtral, policy=policy, num_slots=6)
    S = engine.num_slots  # L*E for resident
    kv = engine.init_kv_cache(batch_size=1, max_len=32)
    tokens = jnp.zeros((1,), jnp.int32)
    positions = jnp.zeros((1,), jnp.int32)
    hlo = engine._decode.lower(engine.params, tokens, positions, kv, engine.expert_state, jax.random.key(0),
                               sampling=Sampling()).compile().as_text()
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for shape in (f"f32[{S},{2 * I},{H}]", f"f32[{S},{H},{I}]"):
        assert shape in hlo  # the pool is really in the step
        copies = [l for l in hlo.splitlines() if shape in l and re.search(r"= \S+ copy(-start)?\(", l)]
        assert not copies, f"slot pool {shape} is copied:\n" + "\n".join(copies)
    # The donated slot arrays are aliased to the outputs.
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


def test_batch_of_prompts_equals_each_alone():
    ckpt = load_checkpoint(os.path.join(FIXTURES, "qwen2_moe"), dtype=jnp.float32)
    info = _info("qwen2_moe")
    prompts = [info["prompt_ids"], [9, 8, 7]]
    engine = Engine(ckpt, policy=Policy("fetch-all"), num_slots=4)
    batch = engine.generate(prompts, max_new_tokens=8).tokens
    assert batch[0] == info["greedy_continuation"][:8]
    assert batch[1] == engine.generate([prompts[1]], max_new_tokens=8).tokens[0]


def test_eos_stops_a_row(mixtral):
    info = _info("mixtral")
    engine = Engine(mixtral, policy=Policy("host-all"), num_slots=1)
    eos = info["greedy_continuation"][3]
    out = engine.generate([info["prompt_ids"]], max_new_tokens=16, eos_token_id=eos).tokens[0]
    assert out == info["greedy_continuation"][: info["greedy_continuation"].index(eos) + 1]


def test_prefill_compiles_once_per_bucket(mixtral):
    engine = Engine(mixtral, policy=Policy("fetch-all"), num_slots=4)
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8], list(range(1, 17))):  # lengths 3, 5, 16: one bucket (16)
        engine.generate([prompt], max_new_tokens=2)
    assert engine._prefill._cache_size() == 1
    engine.generate([list(range(1, 18))], max_new_tokens=2)  # length 17: bucket 32
    assert engine._prefill._cache_size() == 2


def test_prefill_buckets():
    assert [prefill_bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]


def test_sampling_rules():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    assert int(sample_next(logits, jax.random.key(0), Sampling())[0]) == 0
    draws = np.array([int(sample_next(logits, jax.random.key(i), Sampling(1.0, top_k=2))[0]) for i in range(200)])
    assert set(draws) <= {0, 1}
    # top-k 2 renormalises 0.5 : 0.3 -> P(1) = 0.375
    assert abs((draws == 1).mean() - 0.375) < 0.1
    # top-p 0.7: keep {0, 1} (mass before token 1 is 0.5 < 0.7; before token 2 it is 0.8 >= 0.7)
    draws = np.array([int(sample_next(logits, jax.random.key(i), Sampling(1.0, top_p=0.7))[0]) for i in range(200)])
    assert set(draws) <= {0, 1}
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0.0)
