"""Next-token sampling: the Sampling rule (operands of the compiled steps) and sample_next (inside them)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ft_jax.kernels import ffi_ops


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
    """Next-token sampling rule. Passed to the compiled steps as per-row operands (operands): changing it does not
    recompile. Greedy (temperature 0 on every row) is its own executable; in the sampling executable a row at
    temperature 0 takes the argmax, so greedy and sampled rows share one batch.

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

    def operands(self, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(temperature f32[B], top_k i32[B], top_p f32[B]): this rule for every row of the compiled steps."""
        return (np.full(batch_size, self.temperature, np.float32), np.full(batch_size, self.top_k, np.int32),
                np.full(batch_size, self.top_p, np.float32))


def row_key_data(seed: int, row: int) -> np.ndarray:
    """The PRNG key of one sequence, as its raw data u32[2] (an operand of the compiled steps): jax.random.key(seed)
    folded with the row index. A row's draws depend only on (seed, row, the positions it samples at), never on the
    other rows of its batch (Model.generate gives prompt b row b; the server gives every request row 0).

    With JAX's default PRNG (threefry2x32) it is computed here (threefry_fold_in), not by an XLA program: that program
    was the first of a launch and paid XLA's set-up, 0.03-0.05 s (docs/DESIGN.md sec. 20.30); the bits are the same.
    Other PRNG implementations (jax_default_prng_impl) run JAX's own."""
    impl = jax.config.jax_default_prng_impl
    if impl != "threefry2x32":
        return np.asarray(_row_key_data(np.uint32(seed % 2**32), np.int32(row), impl))
    # jax.random.key(s) of a 32-bit seed is the key data [0, s]; fold_in(key, row) hashes the count [0, row] with it
    return np.array(threefry2x32((0, seed % 2**32), (0, row % 2**32)), np.uint32)


@functools.partial(jax.jit, static_argnums=2)
def _row_key_data(seed: jax.Array, row: jax.Array, impl: str) -> jax.Array:
    """row_key_data as one XLA program (u32[] seed, i32[] row -> the key data of PRNG implementation ``impl``, one of
    jax_default_prng_impl's names), for implementations other than threefry2x32."""
    return jax.random.key_data(jax.random.fold_in(jax.random.key(seed, impl=impl), row))


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_MASK32 = 0xFFFFFFFF


def threefry2x32(key: tuple[int, int], count: tuple[int, int]) -> tuple[int, int]:
    """Threefry-2x32 with 20 rounds (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011; the
    rounds, rotations and key schedule of jax._src.random.threefry2x32._threefry2x32_lowering) of one count pair:
    key and count are two unsigned 32-bit ints each; returns the two output words."""
    k0, k1 = key
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = (count[0] + ks[0]) & _MASK32, (count[1] + ks[1]) & _MASK32
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = (x0 + x1) & _MASK32
            x1 = (((x1 << r) | (x1 >> (32 - r))) & _MASK32) ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & _MASK32
        x1 = (x1 + ks[(i + 2) % 3] + i + 1) & _MASK32
    return x0, x1


def greedy_pick(logits: jax.Array) -> jax.Array:
    """i32[B]: each row's greedy token of f32[B, V] (first_argmax), or -1 for a row that is not all finite. On the CPU
    one FFI call (ffi_ops.greedy_pick: one pass over the row, where XLA's reductions cost about 70 us of a decode
    step over 32000 logits, docs/DESIGN.md sec. 20.33); elsewhere XLA's ops, with the same result."""

    def xla_pick(logits):
        return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), first_argmax(logits), -1).astype(jnp.int32)

    return jax.lax.platform_dependent(logits, cpu=ffi_ops.greedy_pick, default=xla_pick)


def first_argmax(logits: jax.Array) -> jax.Array:
    """i32[B]: the first index of each row's maximum of f32[B, V], as jnp.argmax for a row of finite values (a row
    with a NaN gives V). Two plain reductions (the maximum, then the lowest index holding it) instead of argmax's
    reduction over (value, index) pairs, which XLA:CPU runs one element at a time: 0.14 ms of a decode step over a
    32000-entry vocabulary (docs/DESIGN.md sec. 20)."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)  # f32[B, 1]
    return jnp.min(jnp.where(logits == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def sample_next(logits: jax.Array, key_data: jax.Array, counters: jax.Array, temperature, top_k, top_p, *,
                greedy: bool) -> jax.Array:
    """Pick the next token of every row; -1 for a row whose logits are not all finite.

    Every row samples with its own key and sampling values, so its token never depends on the other rows.

    Args:
        logits: f32[B, V] next-token logits.
        key_data: u32[B, 2] each row's key (row_key_data), folded with the row's counter: a fresh key per step.
        counters: i32[B] the position of each row's last input token (distinct for every step of a sequence).
        temperature: f32[B] (0 = greedy: argmax), top_k: i32[B] (0 = off), top_p: f32[B] (1 = off): see Sampling.
        greedy: every row argmax, no sampler (static: its own executable).
    Returns:
        i32[B] token ids, -1 where a logit of the row is NaN or infinite.
    """
    best = greedy_pick(logits)  # i32[B]; -1: a row that is not all finite
    if greedy:
        return best
    finite = best >= 0  # bool[B]
    row_greedy = temperature == 0.0  # bool[B]
    scaled = logits / jnp.where(row_greedy, 1.0, temperature)[:, None]  # f32[B, V]
    V = logits.shape[-1]

    def truncate(logits):
        sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]  # f32[B, V]
        kth = jnp.take_along_axis(sorted_desc, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)  # f32[B, 1]
        kth = jnp.where(((top_k > 0) & (top_k < V))[:, None], kth, -jnp.inf)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        sorted_desc = jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        # Keep a token while the mass strictly before it is < top_p (the most likely token is always kept).
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # bool[B, V]
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)  # f32[B, 1]
        # a top_p that is 0 in float32 (1e-300 passes the (0, 1] check) keeps no token above: keep the first anyway
        cutoff = jnp.minimum(cutoff, sorted_desc[:, :1])
        cutoff = jnp.where((top_p < 1.0)[:, None], cutoff, -jnp.inf)
        return jnp.where(logits < cutoff, -jnp.inf, logits)

    scaled = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)), truncate, lambda l: l, scaled)
    keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data), counters)  # [B] keys
    drawn = jax.vmap(jax.random.categorical)(keys, scaled)  # i32[B]
    return jnp.where(finite, jnp.where(row_greedy, best, drawn), -1).astype(jnp.int32)
