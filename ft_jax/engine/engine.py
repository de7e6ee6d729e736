"""Generation over offloaded experts: prefill, decode_one_token, decode_n_tokens (the shape of gpt-fast's generate.py).

    >>> from ft_jax import bundled_model_path, load_checkpoint
    >>> engine = Engine(load_checkpoint(bundled_model_path()), policy=Policy("qstar", frac=0.4), num_slots=16)
    >>> result = engine.generate([[1, 17, 42]], max_new_tokens=32)  # greedy by default
    >>> len(result.tokens[0]), result.stats["decode_compiles"]
    (32, 1)

Two jit-compiled steps do all the work. ``prefill`` runs a left-padded prompt batch through the model and samples
the first token; ``decode_one_token`` feeds one token per row and samples the next. Each is the whole model (the
scanned decoder layers, the router, the offloaded experts: cache plan + slot_fill + slot_experts + host_experts FFI
calls) plus the sampler, over the functional nnx state (nnx.split once; nnx.merge inside the trace). The KV cache and
the expert state (slot pools, cache tables) are donated, so XLA updates them in place. ``decode_n_tokens`` is the host
loop: one dispatch and one device-to-host read of the new tokens per step; the PRNG key is split inside the step.

No recompiles per request: shapes depend only on (batch size, prompt bucket, KV-cache bucket, model dims, slots),
never on the routing; the sampling parameters (temperature, top_k, top_p) are operands, with greedy decoding a
separate executable (argmax, no sampler); prompt lengths are bucketed to powers of two (at least 16) and the
KV-cache length to a power of two that holds the longest prompt plus the new tokens, so another ``max_new_tokens`` or
temperature in the same buckets replays the compiled steps. Executables are compiled ahead of time (``jit.lower(...)
.compile()``) before the first token, each announced through ``on_compile``; with JAX's persistent compilation cache
enabled (the CLI does) a second process loads them instead of compiling.

Prefill runs through the same machinery with the `fetch-all` policy (capped, as always, by the slots that are not in
use by the current layer): a prompt activates most experts of every layer, and with many tokens per expert one slot
fill is amortised over all of them, while the host GEMV cost grows with the token count; it also warms the cache
with the prompt's experts. Under `resident` and `host-all` prefill uses the same policy as decode.

Statistics are accumulated on the device and read twice per generate call (after prefill, at the end), never per
step. A non-finite logit is reported (NonFiniteLogitsError naming the step and row), never decoded into a token.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.checkpoint import LoadedCheckpoint
from ft_jax.offload.cache import STAT_FIELDS
from ft_jax.offload.experts import OffloadedExperts
from ft_jax.offload.banks import use_huge_pages
from ft_jax.offload.policy import Policy, PolicyKind

MIN_PREFILL_BUCKET = 16
MIN_KV_BUCKET = 64


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN or infinite logits (non-finite weights or an overflow): nothing was decoded from them."""


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
        ValueError: temperature not a finite number >= 0, top_k < 0, or top_p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
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


def check_request(config, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Validate a generation request against a model config before any work is done.

    Args:
        config: ft_jax.config.MoEConfig (vocab_size, max_position_embeddings).
        prompts: B lists of token ids.
        max_new_tokens: tokens to generate per prompt.
    Raises:
        ValueError: no prompt, an empty prompt, an id outside [0, vocab), max_new_tokens < 1, or a prompt plus the
            new tokens longer than the context (max_position_embeddings); the message names the prompt and values.
    """
    if not prompts:
        raise ValueError("no prompt given")
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest, context = max(len(p) for p in prompts), config.max_position_embeddings
    if longest + max_new_tokens > context:
        raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's context of "
                         f"{context} tokens (max_position_embeddings)")


def _pow2_at_least(n: int, low: int) -> int:
    b = low
    while b < n:
        b *= 2
    return b


def prefill_bucket(length: int) -> int:
    """Padded prompt length: the next power of two >= length, at least MIN_PREFILL_BUCKET."""
    return _pow2_at_least(length, MIN_PREFILL_BUCKET)


def kv_bucket(needed: int, context: int) -> int:
    """KV-cache length for sequences of up to ``needed`` positions (longest prompt + new tokens; padding writes
    nothing): the next power of two >= needed, at least MIN_KV_BUCKET, capped at the model's context (>= needed)."""
    return min(_pow2_at_least(needed, MIN_KV_BUCKET), max(context, needed))


@dataclasses.dataclass
class GenerationResult:
    """Output of Engine.generate.

    Attributes:
        tokens: generated ids per prompt (stopping after an EOS id, which is included).
        stats: dict of statistics (see Engine.generate).
        routing: with record_routing, the routing of every decode step: (topk ids i32[steps, L_moe, B, k], combine
            weights f32[steps, L_moe, B, k]); step i fed generated token i of each row (-1 / 0 for finished rows).
            None otherwise.
    """

    tokens: list[list[int]]
    stats: dict
    routing: tuple[np.ndarray, np.ndarray] | None = None


class _CompileCounter:
    """Per-thread count of XLA compiles and persistent-cache hits (JAX monitoring events of the calling thread)."""

    _local = threading.local()
    _installed = False
    _lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:  # one listener per process (JAX has no way to remove one)
                jax.monitoring.register_event_listener(cls._on_event)
                jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
                cls._installed = True

    @classmethod
    def _counts(cls) -> dict:
        if not hasattr(cls._local, "counts"):
            cls._local.counts = {"compiles": 0, "cache_hits": 0}
        return cls._local.counts

    @classmethod
    def _on_event(cls, event: str, **_):
        if event == "/jax/compilation_cache/cache_hits":
            cls._counts()["cache_hits"] += 1

    @classmethod
    def _on_duration(cls, event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            cls._counts()["compiles"] += 1

    @classmethod
    def snapshot(cls) -> tuple[int, int]:
        """(XLA compiles, persistent-cache hits) so far in this thread. JAX times a cache hit as a backend compile
        too (the event wraps compile_or_get_cached), so hits are subtracted."""
        c = cls._counts()
        return c["compiles"] - c["cache_hits"], c["cache_hits"]


def _forward(graphdef, params, backend, tokens, positions, kv_cache, expert_state, last_logits_only: bool,
             collect: bool = False):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, kv_cache, expert_state, backend, last_logits_only=last_logits_only,
                 collect=collect)


def prefill(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key, temperature, top_k, top_p, *,
            greedy: bool):
    """The prompt step: tokens, positions i32[B, Tb] (left-padded, position -1 = padding).
    Returns (first tokens i32[B] (-1: non-finite logits), kv_cache, expert_state)."""
    logits, kv_cache, expert_state = _forward(graphdef, params, backend, tokens, positions, kv_cache, expert_state,
                                              last_logits_only=True)  # logits f32[B, 1, V]
    return sample_next(logits[:, 0], key, temperature, top_k, top_p, greedy=greedy), kv_cache, expert_state


def decode_one_token(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key, temperature, top_k,
                     top_p, *, greedy: bool, record_routing: bool = False):
    """One decode step: tokens, positions i32[B] (position -1 = finished row, skipped).
    Returns (next tokens i32[B] (-1: non-finite logits), kv_cache, expert_state, the key for the next step) and, with
    record_routing (static), the routing of the fed tokens: (topk ids i32[L_moe, B, k], weights f32[L_moe, B, k])."""
    out = _forward(graphdef, params, backend, tokens[:, None], positions[:, None], kv_cache, expert_state,
                   last_logits_only=False, collect=record_routing)  # logits f32[B, 1, V], ...
    logits, kv_cache, expert_state = out[:3]
    key, sub = jax.random.split(key)
    nxt = sample_next(logits[:, 0], sub, temperature, top_k, top_p, greedy=greedy)
    if not record_routing:
        return nxt, kv_cache, expert_state, key
    return nxt, kv_cache, expert_state, key, (out[3].topk_ids[:, :, 0], out[3].topk_weights[:, :, 0])


def _bound_step(step, graphdef, backend):
    """step (prefill or decode_one_token) with its graphdef and backend bound: a function object of one Engine's
    own, f(params, tokens, positions, kv_cache, expert_state, key, temperature, top_k, top_p, **static), for its
    jax.jit. JAX's tracing and compilation caches are keyed weakly on the jitted function and hold its static
    arguments and executables strongly: with jax.jit over the module-level functions and the backends (which hold
    the host banks) as static arguments, every Engine ever built stayed alive, with its executables' JIT code
    (about 500 memory mappings per Engine of a tiny model; Linux refuses a process more than vm.max_map_count =
    65530) and its host-bank references."""
    def call(params, tokens, positions, kv_cache, expert_state, key, temperature, top_k, top_p, **static):
        return step(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key, temperature, top_k,
                    top_p, **static)

    return call


class Engine:
    """Prefill + decode with experts in host banks and a device slot pool (module docstring).

    One generate call at a time: calls from several threads are serialised by a lock (the expert state is one cache
    that every call reads and updates).

    Args:
        checkpoint: LoadedCheckpoint (config, model with dense params on the device, gate_up and down host banks).
        policy: decode policy (ft_jax.offload.policy.Policy). A qstar policy needs its fraction (Policy.frac).
        num_slots: S, device expert slots shared by all MoE layers (ignored for the resident policy: S = L*E).
        on_compile: on_compile(text, finished) is called before each compilation with ("compiling the decode step
            (batch 1, KV cache 256) ...", False) and after it with (" done in 3.1 s" or " loaded from the compilation
            cache in 0.2 s", True): the two texts make one line.
    Raises:
        ValueError: num_slots < 1 for an offloading policy.
    """

    def __init__(self, checkpoint: LoadedCheckpoint, *, policy: Policy, num_slots: int,
                 on_compile: Callable[[str, bool], None] | None = None):
        cfg = checkpoint.config
        self.config = cfg
        self.policy = policy
        self.on_compile = on_compile
        self.graphdef, self.params = nnx.split(checkpoint.model)
        experts = dict(banks=checkpoint.banks, num_experts=cfg.num_experts, activation=cfg.activation,
                       swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
        self.decode_backend = OffloadedExperts(**experts, policy=policy)
        prefill_policy = policy if not policy.kind.fetches else Policy(PolicyKind.FETCH_ALL)
        self.prefill_backend = OffloadedExperts(**experts, policy=prefill_policy)
        resident = policy.kind is PolicyKind.RESIDENT
        self.num_slots = cfg.num_experts * self.decode_backend.num_layers if resident else num_slots
        self.expert_bytes = checkpoint.banks.expert_bytes
        self.expert_state = self.decode_backend.init_state(self.num_slots)
        use_huge_pages((self.params, self.expert_state))  # the dense weights and slot pools, read every step
        # Donated: the KV cache (3) and the expert state (4) of f(params, tokens, positions, kv_cache, expert_state,
        # key, temperature, top_k, top_p); see _bound_step.
        self._prefill = jax.jit(_bound_step(prefill, self.graphdef, self.prefill_backend),
                                static_argnames=("greedy",), donate_argnums=(3, 4))
        self._decode = jax.jit(_bound_step(decode_one_token, self.graphdef, self.decode_backend),
                               static_argnames=("greedy", "record_routing"), donate_argnums=(3, 4))
        self._executables: dict[tuple, object] = {}
        self._lock = threading.Lock()
        _CompileCounter.install()

    def init_kv_cache(self, batch_size: int, max_len: int):
        """Zero KV cache for batch_size sequences of up to max_len tokens (ft_jax.models.decoder.KVCache)."""
        return nnx.merge(self.graphdef, self.params).init_kv_cache(batch_size, max_len)

    def decode_cache_size(self) -> int:
        """How many decode-step executables this Engine has compiled (1 after any number of steps of one shape)."""
        return sum(1 for key in self._executables if key[0] == "decode")

    def lower_decode_step(self, batch_size: int, kv_len: int, sampling: Sampling = Sampling()) -> jax.stages.Lowered:
        """The decode step for a batch and KV-cache length, lowered (not compiled): ``.compile().as_text()`` gives the
        optimized HLO XLA runs, e.g. to check that the slot pools and the KV cache are updated in place.

        Args:
            batch_size: B >= 1. kv_len: KV-cache length S >= 1. sampling: greedy or sampled (two executables).
        Returns:
            jax.stages.Lowered of decode_one_token over this Engine's parameters and expert state.
        """
        kv_cache = jax.eval_shape(lambda: self.init_kv_cache(batch_size, kv_len))
        ids = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
        return self._decode.lower(self.params, ids, ids, kv_cache,
                                  self.expert_state, jax.random.key(0), *sampling.operands(), greedy=sampling.greedy)

    def _executable(self, kind: str, args: tuple, greedy: bool, what: str, tally: dict, record_routing: bool = False):
        """The compiled step for these argument shapes, compiling it (and announcing it) the first time."""
        shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(args[3:5]))
        key = (kind, greedy, record_routing, tuple(a.shape for a in args[1:3]), shapes)
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        step = self._prefill if kind == "prefill" else self._decode
        if self.on_compile is not None:
            self.on_compile(f"compiling {what} ...", False)
        compiles_before, hits_before = _CompileCounter.snapshot()
        t0 = time.perf_counter()
        extra = {} if kind == "prefill" else {"record_routing": record_routing}
        exe = step.lower(*args, greedy=greedy, **extra).compile()
        seconds = time.perf_counter() - t0
        compiles, hits = (a - b for a, b in zip(_CompileCounter.snapshot(), (compiles_before, hits_before)))
        tally["compile_s"] += seconds
        tally["xla_compiles"] += compiles
        tally["cache_hits"] += hits
        tally[f"{kind}_compiles"] += 1
        if self.on_compile is not None:
            how = "loaded from the compilation cache" if hits and not compiles else "done"
            self.on_compile(f" {how} in {seconds:.1f} s", True)
        self._executables[key] = exe
        return exe

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, eos_token_ids: Iterable[int] = (),
                 on_tokens: Callable[[int, list[int | None]], Sequence[bool] | None] | None = None,
                 record_routing: bool = False) -> GenerationResult:
        """Decode every prompt (as one batch) for up to max_new_tokens tokens.

        Args:
            prompts: B lists of token ids (each non-empty, ids in [0, vocab)).
            max_new_tokens: tokens to generate per prompt (>= 1); prompt + new tokens must fit
                config.max_position_embeddings.
            sampling: Sampling rule.
            seed: PRNG seed for sampling (any int; reduced modulo 2^32).
            eos_token_ids: a row stops after producing any of them (empty: never stop early).
            on_tokens: called after every step with (step index, the new token of each row or None if the row had
                already finished): used to stream text. It may return one bool per row: True ends that row there
                (stop strings).
            record_routing: also return the routing of every decode step (GenerationResult.routing; a decode step
                of its own, compiled once).
        Returns:
            GenerationResult with tokens and stats: prompt_tokens, generated_tokens, ttft_s (wall time to the first
            token, compilation included), prefill_s, prefill_tokens_per_s, decode_s, decode_tokens (tokens produced
            by decode steps, i.e. after the first), decode_tokens_per_s (rates exclude compilation; None without a
            decode step), compile_s (ahead-of-time compilation of the steps during this call), prefill_compiles and
            decode_compiles (executables this call built: 0 once the shapes were seen), xla_compiles and
            cache_hits (of those, how many XLA compiled and how many came from the persistent compilation cache),
            kv_cache_len, decode_steps, and over the decode steps (None without one): active/hits/misses/fetched/host
            per step (summed over MoE layers), hit_rate, h2d_bytes_per_step (slot fills), host_bytes_per_step (expert
            weights read by the CPU), per_layer (the raw counters).
        Raises:
            ValueError: empty prompt, id out of range, max_new_tokens < 1, or prompt too long for the context.
            NonFiniteLogitsError: the model produced NaN or infinite logits.
            If a step fails (e.g. an FFI error), the expert state is rebuilt (a cold cache) before the error
            propagates, so the Engine stays usable.
        """
        check_request(self.config, prompts, max_new_tokens)
        with self._lock:
            try:
                return self._generate(prompts, max_new_tokens, sampling, seed, frozenset(eos_token_ids), on_tokens,
                                      record_routing)
            except BaseException:
                if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.expert_state)):
                    self.expert_state = self.decode_backend.init_state(self.num_slots)  # the donated state is gone
                raise

    def _generate(self, prompts, max_new_tokens, sampling: Sampling, seed: int, eos: frozenset, on_tokens,
                  record_routing: bool):
        cfg = self.config
        lengths = [len(p) for p in prompts]
        B = len(prompts)
        bucket = prefill_bucket(max(lengths))
        kv_len = kv_bucket(max(lengths) + max_new_tokens, cfg.max_position_embeddings)
        tally = dict(compile_s=0.0, xla_compiles=0, cache_hits=0, prefill_compiles=0, decode_compiles=0)
        tokens = np.zeros((B, bucket), np.int32)
        positions = np.full((B, bucket), -1, np.int32)
        for b, p in enumerate(prompts):  # left padding
            tokens[b, bucket - len(p):] = p
            positions[b, bucket - len(p):] = np.arange(len(p))
        ops = sampling.operands()
        key = jax.random.key(seed % 2**32)
        key, sub = jax.random.split(key)
        kv_cache = self.init_kv_cache(B, kv_len)
        use_huge_pages(kv_cache)

        # Both executables before the first token, so the stream is never held up by a compile.
        shape = f"batch {B}, KV cache {kv_len}"
        prefill_args = (self.params, tokens, positions, kv_cache, self.expert_state, sub, *ops)
        prefill_step = self._executable("prefill", prefill_args, sampling.greedy,
                                        f"the prefill step ({shape}, prompt bucket {bucket})", tally)
        decode_step = None
        if max_new_tokens > 1:
            step_args = (self.params, tokens[:, 0], positions[:, 0], kv_cache, self.expert_state, key, *ops)
            decode_step = self._executable("decode", step_args, sampling.greedy, f"the decode step ({shape})", tally,
                                           record_routing)

        t0 = time.perf_counter()
        first, kv_cache, self.expert_state = prefill_step(*prefill_args)
        first = np.asarray(first)  # i32[B]
        t_first = time.perf_counter()
        stats_after_prefill = self.decode_backend.read_stats(self.expert_state)  # one sync
        self._check_finite(first, 0)
        out: list[list[int]] = [[int(t)] for t in first]
        done = np.array([int(t) in eos for t in first])
        if on_tokens is not None:
            done |= np.asarray(on_tokens(0, [int(t) for t in first]) or False, bool)
        routing: list | None = [] if record_routing else None
        steps, kv_cache, key = self._decode_n_tokens(decode_step, first, np.asarray(lengths, np.int32), done,
                                                     max_new_tokens - 1, kv_cache, key, ops, eos, out, on_tokens,
                                                     routing)
        stats_end = self.decode_backend.read_stats(self.expert_state)
        t_end = time.perf_counter()
        stats = self._stats(prompts, out, steps, t0, t_first, t_end, tally, kv_len, stats_end - stats_after_prefill)
        if routing is not None:
            L, k = self.decode_backend.num_layers, cfg.top_k
            ids = np.stack([r[0] for r in routing]) if routing else np.zeros((0, L, B, k), np.int32)
            weights = np.stack([r[1] for r in routing]) if routing else np.zeros((0, L, B, k), np.float32)
            routing = (ids, weights)
        return GenerationResult(tokens=out, stats=stats, routing=routing)

    def _decode_n_tokens(self, decode_step, last, pos, done, n, kv_cache, key, ops, eos, out, on_tokens, routing):
        """Up to n decode steps; appends to out (per row) until every row is done, and each step's routing to
        routing (a list, or None). Returns (steps, kv_cache, key)."""
        steps = 0
        for i in range(1, n + 1):
            if done.all():
                break
            feed_tokens = np.where(done, 0, last).astype(np.int32)
            feed_pos = np.where(done, -1, pos).astype(np.int32)
            nxt, kv_cache, self.expert_state, key, *recorded = decode_step(self.params, feed_tokens, feed_pos, kv_cache,
                                                                           self.expert_state, key, *ops)
            nxt = np.asarray(nxt)  # the one host sync per step: the tokens to stream
            if routing is not None:
                routing.append(tuple(np.asarray(a) for a in recorded[0]))
            steps += 1
            self._check_finite(np.where(done, 0, nxt), i)
            new: list[int | None] = []
            for b in range(len(out)):
                if done[b]:
                    new.append(None)
                    continue
                out[b].append(int(nxt[b]))
                new.append(int(nxt[b]))
                done[b] = int(nxt[b]) in eos
            pos = pos + 1
            last = nxt
            if on_tokens is not None:
                done |= np.asarray(on_tokens(i, new) or False, bool)
        return steps, kv_cache, key

    @staticmethod
    def _check_finite(tokens: np.ndarray, step: int) -> None:
        bad = np.flatnonzero(tokens < 0)
        if bad.size:
            raise NonFiniteLogitsError(
                f"the model produced non-finite (NaN or infinite) logits at step {step} for row(s) "
                f"{bad.tolist()}: the weights or the activations overflowed; nothing was decoded from them")

    def _stats(self, prompts, out, steps, t0, t_first, t_end, tally, kv_len, per_layer) -> dict:
        B = len(prompts)
        prompt_tokens = sum(len(p) for p in prompts)
        decode_tokens = sum(len(o) for o in out) - B
        prefill_s = max(t_first - t0, 1e-9)
        decode_s = max(t_end - t_first, 1e-9)
        totals = dict(zip(STAT_FIELDS, per_layer.sum(axis=0).tolist()))
        per_step = (lambda v: v / steps if steps else None)
        return {
            "policy": str(self.policy),
            "fraction": self.policy.frac if self.policy.kind is PolicyKind.QSTAR else None,
            "num_slots": self.num_slots,
            "expert_bytes": self.expert_bytes,
            "batch_size": B,
            "kv_cache_len": kv_len,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": sum(len(o) for o in out),
            "decode_tokens": decode_tokens,
            "ttft_s": t_first - t0 + tally["compile_s"],
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": prompt_tokens / prefill_s,
            "decode_s": decode_s,
            "decode_steps": steps,
            "decode_tokens_per_s": decode_tokens / decode_s if steps else None,
            **tally,
            "hit_rate": totals["hits"] / totals["active"] if totals["active"] else None,
            **{f"{k}_per_step": per_step(totals[k]) for k in ("active", "hits", "misses", "fetched", "host")},
            "h2d_bytes_per_step": per_step(totals["fetched"] * self.expert_bytes),
            "host_bytes_per_step": per_step(totals["host"] * self.expert_bytes),
            "per_layer": {k: per_layer[:, i].tolist() for i, k in enumerate(STAT_FIELDS)},
        }
