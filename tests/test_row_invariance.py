"""A token's prefill is the same bits whatever rows share its calls (docs/DESIGN.md sec. 15.3): the prefill chunk, the
other prompts of a batch and the server's group prefill give every prompt the KV cache and first token it gets alone.

On near-tied logits (random weights) one last bit decides a greedy token, so equality is checked on the bits of the
KV cache, which every layer's output reaches. Before the fix two things broke it on a bf16 model: above 128 rows the
dense projections took XLA's dot (another summation order than the FFI's), and from ~512 rows XLA:CPU handed the
router's softmax to YNNPACK, whose exp differs in the last bit."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ft_jax.checkpoint import load_checkpoint
from ft_jax.engine.batch import DecodeBatch, row_buckets
from ft_jax.engine.engine import Engine
from ft_jax.engine.sampling import Sampling
from ft_jax.models import layers
from ft_jax.offload.policy import Policy
from ft_jax.testing import tiny_config, write_random_checkpoint

KV_LEN = 1024
PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(0, 256, n)] for n in (300, 100, 17, 128)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A bf16 random-weight Mixtral (8 experts top-2, hidden 64), every expert on the host."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("bf16_mixtral"),
                                   tiny_config(max_position_embeddings=KV_LEN), dtype="bfloat16")
    return Engine(load_checkpoint(path, dtype=jnp.bfloat16), policy=Policy("host-all"), num_slots=1)


def prefill(engine, prompts, chunk):
    """prompts prefilled as one group in chunks of ``chunk`` tokens: (first tokens, each prompt's KV cache rows, as
    float32 numpy arrays [layers, length, ...] per cache array)."""
    engine.prefill_chunk = chunk
    batch = DecodeBatch(engine, batch_size=4, kv_len=KV_LEN)
    rows = list(range(len(prompts)))
    job = batch.start_prefill(rows, prompts, [Sampling(0.0)] * len(prompts), [0] * len(prompts))
    while not job.done:
        job.run_chunk()
    caches = [[np.asarray(a[:, r, :len(p)].astype(jnp.float32)) for stack in batch.kv_cache.stacks for a in stack]
              for r, p in zip(rows, prompts)]
    return job.first_tokens.tolist(), caches


def assert_same_bits(got, want):
    first_got, caches_got = got
    first_want, caches_want = want
    for i, (a, b) in enumerate(zip(caches_got, caches_want)):
        for j, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_array_equal(x, y, err_msg=f"prompt {i}, KV array {j}")
    assert first_got == first_want


def test_a_prompt_in_two_chunks_equals_one_call_of_512_rows(engine):
    """300 tokens as two calls of 256 rows, as one of 512 and as 19 of 16: the same KV cache bits."""
    one = prefill(engine, PROMPTS[:1], 512)
    assert_same_bits(prefill(engine, PROMPTS[:1], 256), one)
    assert_same_bits(prefill(engine, PROMPTS[:1], 16), one)


def test_a_group_prefill_equals_each_prompt_alone(engine):
    """The server's group prefill (4 rows x a 128-token bucket = 512 rows per call) gives each prompt the bits of
    its own one-row prefill."""
    group = prefill(engine, PROMPTS[1:], 256)
    alone = [prefill(engine, [p], 256) for p in PROMPTS[1:]]
    assert_same_bits(group, ([a[0][0] for a in alone], [a[1][0] for a in alone]))


_LM_HEAD_SCRIPT = """
import sys
import jax.numpy as jnp
from ft_jax.checkpoint import load_checkpoint
from ft_jax.engine.engine import Engine
from ft_jax.kernels import ffi_ops
from ft_jax.offload.policy import Policy
engine = Engine(load_checkpoint(sys.argv[1], dtype=jnp.bfloat16), policy=Policy("host-all"), num_slots=1)
engine.generate([[1, 2, 3]], max_new_tokens=1)
(exe,) = [e for key, e in engine._executables.items() if key[0] == "prefill"]
open(sys.argv[2], "w").write(ffi_ops.kernel_isa() + "\\n" + exe.as_text())
"""


def test_the_prefill_lm_head_is_the_decode_steps_gemv(tmp_path):
    """The prefill step's lm_head has one row per prompt whatever the chunk, so it takes the decode step's GEMV
    (layers.sequence_dots) where the other projections of a prefill take XLA's dot (prefill_dots: CPUs without the
    AVX-512 BF16 dot, here FT_JAX_KERNEL=avx2 in a subprocess so every CPU runs it). XLA's dot of a bf16 [V, H]
    weight converted it to float32 as a whole on every prefill call (262 MB of fresh memory and ~0.4 s per call on
    the bench model: docs/DESIGN.md sec. 20.18): the compiled prefill step holds no float32 [V, H] array and calls
    the ft_jax_linear GEMV on the final hidden state."""
    cfg = tiny_config(vocab_size=320, hidden_size=64)
    path = write_random_checkpoint(tmp_path / "model", cfg, dtype="bfloat16")
    subprocess.run([sys.executable, "-c", _LM_HEAD_SCRIPT, str(path), str(tmp_path / "hlo.txt")], check=True,
                   env=dict(os.environ, FT_JAX_KERNEL="avx2"))
    isa, hlo = (tmp_path / "hlo.txt").read_text().split("\n", 1)
    if isa == "generic":
        pytest.skip("this CPU has no AVX2 path")
    assert isa == "avx2"
    assert "f32[320,64]" not in hlo and "bf16[320,64]" in hlo
    assert re.search(r'f32\[1,320\][^\n]*custom_call_target="ft_jax_linear"', hlo)


def test_sequence_dots_restores_the_gemv_inside_prefill_dots():
    """linear inside prefill_dots takes XLA's dot for a float32 x (no bf16 register tiles); inside sequence_dots it
    is the FFI GEMV again, with the bits of linear outside either context."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 96)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((40, 96)).astype(np.float32))

    def calls(f):
        return str(jax.make_jaxpr(f)(x, w)).count("ft_jax_linear")

    def in_prefill(x, w):
        with layers.prefill_dots():
            return layers.linear(x, w)

    def in_sequence(x, w):
        with layers.prefill_dots(), layers.sequence_dots():
            return layers.linear(x, w)

    assert calls(in_prefill) == 0 and calls(in_sequence) == calls(layers.linear) == 1
    np.testing.assert_array_equal(np.asarray(jax.jit(in_sequence)(x, w)), np.asarray(jax.jit(layers.linear)(x, w)))


@pytest.mark.parametrize("batch_size, buckets", [(1, [1]), (2, [1, 2]), (5, [1, 2, 4, 5]), (6, [1, 2, 4, 6]),
                                                 (8, [1, 2, 4, 8])])
def test_row_buckets(batch_size, buckets):
    assert row_buckets(batch_size) == buckets


def decode_rows(engine, batch_size, prompts, steps):
    """prompts prefilled alone into the rows given as keys, then ``steps`` decode steps of the batch: (each row's
    tokens, each row's KV cache bits after the steps (float32 numpy arrays [layers, length, ...]), the rows of the
    last step)."""
    batch = DecodeBatch(engine, batch_size=batch_size, kv_len=64)
    tokens = {}
    for row, prompt in prompts.items():
        job = batch.start_prefill([row], [prompt], [Sampling(0.0)], [0])
        while not job.done:
            job.run_chunk()
        tokens[row] = [int(job.first_tokens[0])]
    ran = batch.bucket_rows(batch.positions >= 0)
    for _ in range(steps):
        nxt = batch.decode()
        for row in prompts:
            tokens[row].append(int(nxt[row]))
    caches = {row: [np.asarray(a[:, row, :len(p) + steps].astype(jnp.float32)) for stack in batch.kv_cache.stacks
                    for a in stack] for row, p in prompts.items()}
    return tokens, caches, ran.tolist()


def test_a_row_decodes_the_same_bits_in_any_row_bucket(engine):
    """Rows 3 and 1 of a 4-row batch decode in the 2-row bucket (their KV blocks gathered from the 4-row cache; the
    ops of 2 rows) when they are the only live rows, and in the 4-row step when rows 0 and 2 decode too, or row 0
    only (the 4-row step with row 2 free): the same tokens and KV cache bits every way, as one row alone in a 1-row
    batch."""
    two = {3: PROMPTS[2], 1: PROMPTS[3][:40]}
    others = {0: PROMPTS[1][:30], 2: PROMPTS[0][:50]}
    tok2, kv2, ran2 = decode_rows(engine, 4, two, 6)
    tok4, kv4, ran4 = decode_rows(engine, 4, {**two, **others}, 6)
    tok3, kv3, ran3 = decode_rows(engine, 4, {**two, 0: others[0]}, 6)
    tok1, kv1, ran1 = decode_rows(engine, 1, {0: two[3]}, 6)
    assert (ran2, ran4, ran3, ran1) == ([1, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0])
    for row in two:
        assert tok2[row] == tok4[row] == tok3[row]
        for x, y, z in zip(kv2[row], kv4[row], kv3[row]):
            np.testing.assert_array_equal(x, y, err_msg=f"row {row}")
            np.testing.assert_array_equal(x, z, err_msg=f"row {row}")
    assert tok1[0] == tok2[3]
    for x, y in zip(kv1[0], kv2[3]):
        np.testing.assert_array_equal(x, y)
