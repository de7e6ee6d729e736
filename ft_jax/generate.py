"""Generation engine: bucketed prefill and a decode step that compiles once, over offloaded experts.

    engine = Engine(load_checkpoint(path), policy=parse_policy("qstar"), num_slots=16, frac=0.4)
    result = engine.generate([[1, 17, 42]], max_new_tokens=32)      # GenerationResult

The decode step is ONE jax.jit over the functional nnx state (nnx.split once; nnx.merge inside the trace): all
decoder layers (unrolled), the router, the offloaded experts (expert_cache + slot_fill + slot_experts + host_experts
FFI calls) and the sampler. The KV cache, the slot arrays and the cache tables are donated, so XLA updates them in
place. Its shapes depend only on (batch, KV-cache length, model dims, S), never on the routing: it compiles once per
generate configuration and replays for any routing (docs/DESIGN.md sec. 3). Statistics are accumulated on the device and
read twice per generate call (after prefill, at the end), never per step.

Prefill runs through the same machinery with the `fetch-all` policy (capped, as always, by the slots that are not
in use by the current layer): a prompt activates most experts of every layer, and with many tokens per expert the
device GEMM amortises one slot fill over all of them, while the host GEMV cost grows with the token count; it also
warms the cache with the prompt's experts. Under the `resident` and `host-all` policies prefill uses the same policy
as decode. Prompt lengths are bucketed to powers of two (at least 16), left-padded, so a new length compiles the
prefill at most once per bucket.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ft_jax.checkpoint import LoadedCheckpoint
from ft_jax.offload.expert_cache import STAT_FIELDS
from ft_jax.offload.experts import OffloadedExperts, OffloadState
from ft_jax.offload.policy import Policy

MIN_PREFILL_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Next-token sampling rule (static: baked into the compiled decode step).

    Attributes:
        temperature: 0 = greedy (argmax); else logits / temperature.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off); nucleus sampling,
            Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration".
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_next(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Pick the next token of every row.

    Args:
        logits: f32[B, V] next-token logits.
        key: PRNG key (unused when greedy).
        sampling: Sampling (static).
    Returns:
        i32[B] token ids.
    """
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature  # f32[B, V]
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]  # f32[B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # f32[B, V] descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token while the mass strictly before it is < top_p (the most likely token is always kept).
        keep = (jnp.cumsum(probs, axis=-1) - probs) < sampling.top_p  # bool[B, V]
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)  # f32[B, 1]
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


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


def prefill_bucket(length: int) -> int:
    """Padded prompt length: the next power of two >= length, at least MIN_PREFILL_BUCKET."""
    bucket = MIN_PREFILL_BUCKET
    while bucket < length:
        bucket *= 2
    return bucket


@dataclasses.dataclass
class GenerationResult:
    """Output of Engine.generate.

    Attributes:
        tokens: generated ids per prompt (stopping after EOS, which is included).
        stats: dict of statistics (see Engine.generate).
    """

    tokens: list[list[int]]
    stats: dict


class _CompileTimer:
    """Sums JAX's compile-time duration events (tracing, lowering, backend compile) while installed."""

    _EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
               "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.seconds = 0.0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_):
        if self.active and event in self._EVENTS:
            self.seconds += duration


_COMPILE_TIMER: _CompileTimer | None = None


def _compile_timer() -> _CompileTimer:
    global _COMPILE_TIMER
    if _COMPILE_TIMER is None:  # one listener per process (JAX has no way to remove one)
        _COMPILE_TIMER = _CompileTimer()
    return _COMPILE_TIMER


class Engine:
    """Prefill + decode with experts in host banks and a device slot pool (module docstring).

    Args:
        checkpoint: LoadedCheckpoint (config, model with dense params on the device, gate_up and down host banks).
        policy: decode policy (ft_jax.offload.policy.Policy). A qstar policy needs its fraction (Policy.frac).
        num_slots: S, device expert slots shared by all MoE layers (ignored for the resident policy: S = L*E).
    Raises:
        ValueError: num_slots < 1 for an offloading policy.
    """

    def __init__(self, checkpoint: LoadedCheckpoint, *, policy: Policy, num_slots: int):
        cfg = checkpoint.config
        self.config = cfg
        self.policy = policy
        self.graphdef, self.params = nnx.split(checkpoint.model)
        activation = cfg.activation
        decode = OffloadedExperts(checkpoint.gate_up_bank, checkpoint.down_bank, cfg.num_experts, policy, activation)
        prefill_policy = policy if policy.kind in ("resident", "host-all") else Policy("fetch-all")
        prefill = OffloadedExperts(checkpoint.gate_up_bank, checkpoint.down_bank, cfg.num_experts, prefill_policy,
                                   activation)
        self.decode_backend, self.prefill_backend = decode, prefill
        self.num_slots = cfg.num_experts * decode.num_layers if policy.kind == "resident" else num_slots
        self.expert_bytes = checkpoint.gate_up_bank.row_bytes + checkpoint.down_bank.row_bytes
        self.expert_state = decode.init_state(self.num_slots)
        # Donated: KV cache (2) and expert state (3).
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("sampling",), donate_argnums=(3, 4))
        self._decode = jax.jit(self._decode_impl, static_argnames=("sampling",), donate_argnums=(3, 4))

    # --- jitted bodies -------------------------------------------------------------------------------------------
    def _prefill_impl(self, params, tokens, positions, kv_cache, expert_state, key, sampling: Sampling):
        """tokens, positions: i32[B, Tb] (left-padded, position -1 = padding). Returns first tokens i32[B]."""
        model = nnx.merge(self.graphdef, params)
        logits, kv_cache, expert_state = model(tokens, positions, kv_cache, expert_state, self.prefill_backend,
                                               last_logits_only=True)  # logits f32[B, 1, V]
        return sample_next(logits[:, 0], key, sampling), kv_cache, expert_state

    def _decode_impl(self, params, tokens, positions, kv_cache, expert_state, key, sampling: Sampling):
        """One decode step. tokens, positions: i32[B] (position -1 = finished row, skipped).

        Returns (next tokens i32[B], kv_cache, expert_state, the key for the next step): the PRNG key is split inside
        the step, so the host loop dispatches nothing but the step itself.
        """
        model = nnx.merge(self.graphdef, params)
        logits, kv_cache, expert_state = model(tokens[:, None], positions[:, None], kv_cache, expert_state,
                                               self.decode_backend)  # logits f32[B, 1, V]
        key, sub = jax.random.split(key)
        return sample_next(logits[:, 0], sub, sampling), kv_cache, expert_state, key

    def init_kv_cache(self, batch_size: int, max_len: int):
        """Zero KV cache for batch_size sequences of up to max_len tokens (ft_jax.models.decoder.KVCache, model dtype)."""
        return nnx.merge(self.graphdef, self.params).init_kv_cache(batch_size, max_len)

    def decode_cache_size(self) -> int:
        """How many decode-step executables jit has compiled so far (1 after any number of steps of one config)."""
        return self._decode._cache_size()

    # --- generation ----------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, eos_token_id: int | None = None,
                 on_tokens: Callable[[int, list[int | None]], None] | None = None) -> GenerationResult:
        """Decode every prompt (as one batch) for up to max_new_tokens tokens.

        Args:
            prompts: B lists of token ids (each non-empty, ids in [0, vocab)).
            max_new_tokens: tokens to generate per prompt (>= 1); prompt + new tokens must fit
                config.max_position_embeddings.
            sampling: Sampling rule.
            seed: PRNG seed for sampling.
            eos_token_id: a row stops after producing it (None: never stop early).
            on_tokens: called after every step with (step index, the new token of each row or None if the row had
                already finished): used to stream text.
        Returns:
            GenerationResult with tokens and stats: prompt_tokens, generated_tokens, ttft_s (wall time to the first
            token, compilation included), prefill_s, prefill_tokens_per_s, decode_s, decode_tokens (tokens produced
            by decode steps, i.e. after the first), decode_tokens_per_s (rates exclude compilation; None without a
            decode step), compile_s (tracing, lowering and XLA compilation during this call), decode_compiles (jit
            cache entries of the decode step added by this call), decode_steps, and over the decode steps (None
            without one): active/hits/misses/fetched/host per step (summed over MoE layers), hit_rate,
            h2d_bytes_per_step (slot fills), host_bytes_per_step (expert weights read by the CPU), per_layer (the raw
            counters).
        Raises:
            ValueError: empty prompt, id out of range, max_new_tokens < 1, or prompt too long for the context.
        """
        cfg = self.config
        check_request(cfg, prompts, max_new_tokens)
        lengths = [len(p) for p in prompts]
        B = len(prompts)
        bucket = prefill_bucket(max(lengths))
        max_len = bucket + max_new_tokens  # KV cache length: padded prompt + generated tokens
        timer = _compile_timer()
        timer.seconds, timer.active = 0.0, True
        compiles_before = self.decode_cache_size()
        try:
            tokens = np.zeros((B, bucket), np.int32)
            positions = np.full((B, bucket), -1, np.int32)
            for b, p in enumerate(prompts):  # left padding
                tokens[b, bucket - len(p):] = p
                positions[b, bucket - len(p):] = np.arange(len(p))
            key = jax.random.key(seed)
            kv_cache = self.init_kv_cache(B, max_len)

            t0, compile_before_prefill = time.perf_counter(), timer.seconds
            key, sub = jax.random.split(key)
            first, kv_cache, self.expert_state = self._prefill(self.params, tokens, positions, kv_cache,
                                                               self.expert_state, sub, sampling=sampling)
            first = np.asarray(first)  # i32[B]
            t_first = time.perf_counter()
            prefill_compile_s = timer.seconds - compile_before_prefill
            stats_after_prefill = np.asarray(self.expert_state.cache.stats)  # one sync

            out: list[list[int]] = [[int(t)] for t in first]
            done = np.array([eos_token_id is not None and t == eos_token_id for t in first])
            if on_tokens is not None:
                on_tokens(0, [int(t) for t in first])
            pos = np.asarray(lengths, np.int32)  # i32[B] position of the token fed next
            last = first.astype(np.int32)
            steps = 0
            for i in range(1, max_new_tokens):
                if done.all():
                    break
                feed_pos = np.where(done, -1, pos).astype(np.int32)
                nxt, kv_cache, self.expert_state, key = self._decode(self.params, last, feed_pos, kv_cache,
                                                                     self.expert_state, key, sampling=sampling)
                nxt = np.asarray(nxt)  # the one host sync per step: the tokens to stream
                steps += 1
                new = []
                for b in range(B):
                    if done[b]:
                        new.append(None)
                        continue
                    out[b].append(int(nxt[b]))
                    new.append(int(nxt[b]))
                    if eos_token_id is not None and nxt[b] == eos_token_id:
                        done[b] = True
                pos = pos + 1
                last = np.where(done, 0, nxt).astype(np.int32)
                if on_tokens is not None:
                    on_tokens(i, new)
            stats_end = np.asarray(self.expert_state.cache.stats)
            t_end = time.perf_counter()
        finally:
            timer.active = False

        decode_tokens = sum(len(o) for o in out) - B
        # Rates exclude compilation (reported as compile_s); time to first token is what the caller waited.
        prefill_s = max(t_first - t0 - prefill_compile_s, 1e-9)
        decode_s = max(t_end - t_first - (timer.seconds - compile_before_prefill - prefill_compile_s), 1e-9)
        per_layer = stats_end - stats_after_prefill  # i32[L, 6]
        totals = dict(zip(STAT_FIELDS, per_layer.sum(axis=0).tolist()))
        stats = {
            "policy": str(self.policy),
            "fraction": self.policy.frac if self.policy.kind == "qstar" else None,
            "num_slots": self.num_slots,
            "expert_bytes": self.expert_bytes,
            "batch_size": B,
            "prompt_tokens": sum(lengths),
            "generated_tokens": sum(len(o) for o in out),
            "decode_tokens": decode_tokens,
            "ttft_s": t_first - t0,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": sum(lengths) / prefill_s,
            "decode_s": decode_s,
            "decode_steps": steps,
            "decode_tokens_per_s": decode_tokens / decode_s if steps else None,
            "compile_s": timer.seconds,
            "decode_compiles": self.decode_cache_size() - compiles_before,
            "hit_rate": totals["hits"] / totals["active"] if totals["active"] else None,
            **{f"{k}_per_step": totals[k] / steps if steps else None
               for k in ("active", "hits", "misses", "fetched", "host")},
            "h2d_bytes_per_step": totals["fetched"] * self.expert_bytes / steps if steps else None,
            "host_bytes_per_step": totals["host"] * self.expert_bytes / steps if steps else None,
            "per_layer": {k: per_layer[:, i].tolist() for i, k in enumerate(STAT_FIELDS)},
        }
        return GenerationResult(tokens=out, stats=stats)
