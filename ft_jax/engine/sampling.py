"""Next-token sampling: the Sampling rule (operands of the compiled steps) and sample_next (inside them)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


# Temperatures the f32 sampler can use: 1 / t and logits / t stay finite for any logit below 3e28.
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-10, 1e10


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN or infinite logits (non-finite weights or an overflow): nothing was decoded from them."""


def check_finite(tokens: np.ndarray, step: int) -> None:
    """Raise NonFiniteLogitsError if a sampled token is -1 (sample_next's mark for non-finite logits).

    Args:
        tokens: i32[B] sampled tokens of one step (finished rows already replaced by 0). step: the step index.
    """
    bad = np.flatnonzero(tokens < 0)
    if bad.size:
        raise NonFiniteLogitsError(
            f"the model produced non-finite (NaN or infinite) logits at step {step} for row(s) "
            f"{bad.tolist()}: the weights or the activations overflowed; nothing was decoded from them")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Next-token sampling rule. Passed to the compiled steps as operands: changing it does not recompile (greedy,
    temperature 0, is its own executable).

    Attributes:
        temperature: 0 = greedy (argmax); else logits / temperature.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off); nucleus sampling,
            Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration".
    Raises:
        ValueError: temperature neither 0 nor in [TEMPERATURE_MIN, TEMPERATURE_MAX] (outside it the reciprocal or
            logits / temperature overflows float32), top_k < 0, or top_p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature and not TEMPERATURE_MIN <= self.temperature <= TEMPERATURE_MAX:
            raise ValueError(f"temperature {self.temperature:g} is outside [{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]"
                             " (0 = greedy): logits / temperature would overflow or underflow float32")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0 or self.top_k > np.iinfo(np.int32).max:
            raise ValueError(f"top_k must be an integer in [0, 2^31), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def operands(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(temperature f32[], top_k i32[], top_p f32[]) for the compiled steps."""
        return (np.float32(self.temperature if self.temperature > 0 else 1.0), np.int32(self.top_k),
                np.float32(self.top_p))


def sample_next(logits: jax.Array, key: jax.Array, temperature, top_k, top_p, *, greedy: bool) -> jax.Array:
    """Pick the next token of every row; -1 for a row whose logits are not all finite.

    Args:
        logits: f32[B, V] next-token logits.
        key: PRNG key (unused when greedy).
        temperature: f32[] (> 0), top_k: i32[] (0 = off), top_p: f32[] (1 = off): see Sampling. Operands.
        greedy: argmax (static).
    Returns:
        i32[B] token ids, -1 where a logit of the row is NaN or infinite.
    """
    finite = jnp.all(jnp.isfinite(logits), axis=-1)  # bool[B]
    if greedy:
        return jnp.where(finite, jnp.argmax(logits, axis=-1), -1).astype(jnp.int32)
    logits = logits / temperature  # f32[B, V]
    V = logits.shape[-1]

    def truncate(logits):
        sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]  # f32[B, V]
        kth = sorted_desc[:, jnp.clip(top_k - 1, 0, V - 1)][:, None]  # f32[B, 1]
        kth = jnp.where((top_k > 0) & (top_k < V), kth, -jnp.inf)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        sorted_desc = jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        # Keep a token while the mass strictly before it is < top_p (the most likely token is always kept).
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # bool[B, V]
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)  # f32[B, 1]
        cutoff = jnp.where(top_p < 1.0, cutoff, -jnp.inf)
        return jnp.where(logits < cutoff, -jnp.inf, logits)

    logits = jax.lax.cond((top_k > 0) | (top_p < 1.0), truncate, lambda l: l, logits)
    return jnp.where(finite, jax.random.categorical(key, logits, axis=-1), -1).astype(jnp.int32)
