"""Test-only views of an Engine: how many decode executables it built, and its decode step lowered (for HLO checks)."""

import jax
import jax.numpy as jnp
import numpy as np

from ft_jax.engine.engine import DECODE_CHUNK_STEPS, Engine, eos_operand
from ft_jax.engine.sampling import Sampling


def decode_cache_size(engine: Engine) -> int:
    """How many decode-step executables the Engine has compiled (1 after any number of steps of one shape)."""
    return sum(1 for key in engine._executables if key[0] == "decode")


def lower_decode_step(engine: Engine, batch_size: int, kv_len: int,
                      sampling: Sampling = Sampling()) -> jax.stages.Lowered:
    """The Engine's decode step (the loop of steps.decode_tokens, as generate runs it) for a batch and KV-cache length,
    lowered (not compiled): ``.compile().as_text()``
    gives the optimized HLO XLA runs, e.g. to check that the slot pools and the KV cache are updated in place.

    Args:
        batch_size: B >= 1. kv_len: KV-cache length S >= 1. sampling: greedy or sampled (two executables).
    """
    kv_cache = jax.eval_shape(lambda: engine.init_kv_cache(batch_size, kv_len))
    ids = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    key_data = jax.ShapeDtypeStruct((batch_size, 2), jnp.uint32)
    return engine._decode.lower(engine.params, ids, ids, kv_cache, engine.expert_state, key_data,
                                *sampling.operands(batch_size), eos_operand(()), np.asarray(1, np.int32),
                                greedy=sampling.greedy, max_steps=DECODE_CHUNK_STEPS)
