"""Attention that costs what the context holds, and chunked prefill (issue 20 items 3, 4, 6): the loop over the live
KV blocks (ft_jax.models.layers.attend_live_blocks) and prompts in chunks appended to the KV cache
(Engine.prefill_chunk) keep the transformers references, and a new prompt length compiles nothing new."""

import dataclasses
import io
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import lower_decode_step
from ft_jax.checkpoint import load_checkpoint
from ft_jax.cli.generate import PrefillProgress
from ft_jax.engine.engine import Engine, prefill_bucket
from ft_jax.models import layers
from ft_jax.offload.policy import Policy
from test_model import Loaded

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
# GQA, GQA with sinks and alternating sliding (window 8) / full layers, MLA (latent cache, absorbed form)
CHUNKED_FAMILIES = ["mixtral", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module", params=CHUNKED_FAMILIES)
def small_blocks(request):
    """A fixture's model traced with 8-key blocks, so a 40-entry cache is 5 blocks, the last one moved back, and
    queries in blocks of 4 (layers.query_blocks), so every chunk of more than 4 tokens attends block by block, each
    query block over the keys up to its own last position (and gpt-oss's window layers from the first block their
    window of 8 reaches)."""
    saved = layers.KV_BLOCK, layers.QUERY_BLOCK
    layers.KV_BLOCK, layers.QUERY_BLOCK = 8, 4
    try:
        yield Loaded(request.param)
    finally:
        layers.KV_BLOCK, layers.QUERY_BLOCK = saved


def test_chunked_full_sequence_logits_match_transformers(small_blocks):
    """Prompt + continuation fed in chunks of 5 tokens through a 38-entry KV cache (blocks of 8: the live blocks
    grow chunk by chunk, the last one overlaps its neighbour): every position's logits within 1e-4 of the
    transformers full-sequence logits, as the unchunked forward is checked in test_model.py."""
    loaded = small_blocks
    seq = np.array(loaded.info["prompt_ids"] + loaded.info["greedy_continuation"], np.int32)
    ref = loaded.ref["full_sequence_logits"]
    kv, got = loaded.ckpt.model.init_kv_cache(1, 38), []
    for start in range(0, len(seq), 5):
        part = seq[start:start + 5]
        logits, kv, _, _ = loaded.run(part[None], np.arange(start, start + len(part))[None], kv)
        got.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.concatenate(got), ref[:len(seq)], atol=1e-4, rtol=0)


def test_left_padded_chunks_give_each_row_its_own_logits(small_blocks):
    """A batch of two lengths, left-padded to a multiple of the chunk and fed chunk by chunk: each row's last
    logits equal its unpadded forward (padding writes and reads nothing)."""
    loaded = small_blocks
    a = np.array(loaded.info["prompt_ids"] + loaded.info["greedy_continuation"][:8], np.int32)  # 20 tokens
    b = a[3:10]
    width = 24
    tokens = np.zeros((2, width), np.int32)
    positions = np.full((2, width), -1, np.int32)
    for r, p in enumerate((a, b)):
        tokens[r, width - len(p):], positions[r, width - len(p):] = p, np.arange(len(p))
    kv = loaded.ckpt.model.init_kv_cache(2, 32)
    for c in range(0, width, 8):
        logits, kv, _, _ = loaded.run(tokens[:, c:c + 8], positions[:, c:c + 8], kv)
    for r, p in enumerate((a, b)):
        alone, _, _, _ = loaded.run(p[None], np.arange(len(p))[None], loaded.ckpt.model.init_kv_cache(1, 32))
        np.testing.assert_allclose(np.asarray(logits[r, -1]), np.asarray(alone[0, -1]), atol=1e-5, rtol=0)


def test_long_prompt_first_token_logits_in_chunks_equal_one_call(small_blocks):
    """A 120-token prompt in chunks of 16 (15 blocks of 8 keys live at the end) gives the last logits of one call."""
    loaded = small_blocks
    prompt = np.asarray(LONG_PROMPT, np.int32)[None] % loaded.cfg.vocab_size
    positions = np.arange(prompt.shape[1])[None]
    whole, _, _, _ = loaded.run(prompt, positions, loaded.ckpt.model.init_kv_cache(1, 128))
    kv = loaded.ckpt.model.init_kv_cache(1, 128)
    for c in range(0, 128, 16):  # left-padded to 128: the first chunk holds 8 padding slots
        tokens = np.zeros((1, 16), np.int32)
        pos = np.full((1, 16), -1, np.int32)
        lo = max(c, 8)
        tokens[0, lo - c:] = prompt[0, lo - 8:c + 16 - 8]
        pos[0, lo - c:] = positions[0, lo - 8:c + 16 - 8]
        logits, kv, _, _ = loaded.run(tokens, pos, kv)
    np.testing.assert_allclose(np.asarray(logits[0, -1]), np.asarray(whole[0, -1]), atol=1e-5, rtol=0)
    assert int(np.argmax(logits[0, -1])) == int(np.argmax(whole[0, -1]))


@pytest.fixture(scope="module")
def mixtral_long():
    ckpt = load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.float32)
    return dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, max_position_embeddings=4096))


@pytest.fixture(scope="module")
def chunked_engine(mixtral_long):
    """Prefill in chunks of 16 (one executable for every prompt longer than 16 tokens)."""
    return Engine(mixtral_long, policy=Policy("fetch-all"), num_slots=8, prefill_chunk=16)


LONG_PROMPT = [int(t) for t in np.random.default_rng(7).integers(1, 200, 120)]


def test_long_prompt_in_chunks_equals_one_prefill(mixtral_long, chunked_engine):
    """A 120-token prompt in 8 chunks of 16 decodes the tokens of one 128-token prefill call."""
    whole = Engine(mixtral_long, policy=Policy("fetch-all"), num_slots=8, prefill_chunk=256)
    one = whole.generate([LONG_PROMPT], max_new_tokens=12)
    chunked = chunked_engine.generate([LONG_PROMPT], max_new_tokens=12)
    assert chunked.tokens == one.tokens
    assert one.stats["prefill_compiles"] == 1 and chunked.stats["prefill_compiles"] == 1


def test_a_new_prompt_length_compiles_no_new_prefill_step(chunked_engine):
    chunked_engine.generate([LONG_PROMPT], max_new_tokens=2)  # the chunk-16 executable of KV bucket 128
    for n in (66, 77, 100, 119):
        stats = chunked_engine.generate([LONG_PROMPT[:n]], max_new_tokens=2).stats
        assert (stats["prefill_compiles"], stats["kv_cache_len"]) == (0, 128), n
    assert prefill_bucket(1000, 256) == 256 and prefill_bucket(100, 256) == 128 and prefill_bucket(3) == 16


def test_batch_of_two_lengths_in_chunks_equals_each_alone(chunked_engine):
    prompts = [LONG_PROMPT[:90], LONG_PROMPT[50:63]]
    batch = chunked_engine.generate(prompts, max_new_tokens=6).tokens
    assert batch[0] == chunked_engine.generate([prompts[0]], max_new_tokens=6).tokens[0]
    assert batch[1] == chunked_engine.generate([prompts[1]], max_new_tokens=6).tokens[0]


def test_prefill_progress_is_reported_per_chunk(chunked_engine):
    seen = []
    chunked_engine.on_prefill = lambda done, total, seconds: seen.append((done, total, seconds))
    try:
        chunked_engine.generate([LONG_PROMPT[:40]], max_new_tokens=1)
        chunked_engine.generate([[1, 2, 3]], max_new_tokens=1)  # one chunk: nothing to report
    finally:
        chunked_engine.on_prefill = None
    assert [(d, t) for d, t, _ in seen] == [(8, 40), (24, 40), (40, 40)]  # left-padded to 48: 8 padding slots first
    assert all(s > 0 for _, _, s in seen)


def test_decode_step_holds_nothing_of_the_kv_length(chunked_engine):
    """The decode step of a 4096-entry KV cache: no value of the optimized HLO but the cache itself has an axis of
    4096 (scores, weights and cache reads are per block of layers.KV_BLOCK keys), and the cache is not copied."""
    hlo = lower_decode_step(chunked_engine, batch_size=1, kv_len=4096).compile().as_text()
    shapes = re.findall(r"= ([a-z0-9]+\[[0-9,]*\])", hlo)
    cfg = chunked_engine.config
    cache = f"[{cfg.num_layers},1,4096,{cfg.num_kv_heads},{cfg.head_dim}]"
    long = {s for s in shapes if re.search(r"\b4096\b", s)}
    assert long and all(s.endswith(cache) for s in long), long
    assert not re.search(r"= \S+\[[0-9,]*\b4096\b[0-9,]*\]\{[^}]*\} copy(-start)?\(", hlo)


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_cli_prefill_progress_line(tty):
    """Nothing in the first second; then on a terminal every chunk rewrites one line (carriage return, a newline at
    the end), elsewhere a line per second or so and one at the end."""
    stream = _Stream(tty)
    progress = PrefillProgress(stream)
    for done, seconds in ((256, 0.5), (512, 1.0), (768, 1.4), (1024, 2.1), (1280, 2.5), (1536, 3.0)):
        progress(done, 1536, seconds)
    if tty:
        assert stream.getvalue() == ("\rft-jax: prefill 512/1536 tokens, 512.0 tokens/s"
                                     "\rft-jax: prefill 768/1536 tokens, 548.6 tokens/s"
                                     "\rft-jax: prefill 1024/1536 tokens, 487.6 tokens/s"
                                     "\rft-jax: prefill 1280/1536 tokens, 512.0 tokens/s"
                                     "\rft-jax: prefill 1536/1536 tokens, 512.0 tokens/s\n")
    else:
        assert stream.getvalue().splitlines() == ["ft-jax: prefill 512/1536 tokens, 512.0 tokens/s",
                                                  "ft-jax: prefill 1024/1536 tokens, 487.6 tokens/s",
                                                  "ft-jax: prefill 1536/1536 tokens, 512.0 tokens/s"]
    quick = _Stream(tty)
    PrefillProgress(quick)(512, 512, 0.4)  # a prefill under a second prints nothing
    assert quick.getvalue() == ""
