"""The Engine: the compiled-step cache and ``generate`` over the steps of ft_jax/engine/steps.py.

    >>> from ft_jax import bundled_model_path, load_checkpoint
    >>> engine = Engine(load_checkpoint(bundled_model_path()), policy=Policy("qstar", frac=0.4), num_slots=16)
    >>> result = engine.generate([[1, 17, 42]], max_new_tokens=32)  # greedy by default
    >>> len(result.tokens[0]), result.stats["decode_compiles"]
    (32, 1)

Requests are checked by ft_jax.api (check_request) before they reach the Engine. Buckets, donation, ahead-of-time
compilation and the statistics reads: docs/DESIGN.md sec. 11, "Engine, API and CLI".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import threading
import time
from typing import Callable, Iterable, Sequence

import jax
import numpy as np
from flax import nnx

from ft_jax.checkpoint import LoadedCheckpoint
from ft_jax.defaults import DEFAULT_PREFILL_CHUNK
from ft_jax.engine import stats as stats_lib
from ft_jax.engine import step_cache
from ft_jax.engine.sampling import NonFiniteLogitsError, Sampling, check_finite, row_key_data
from ft_jax.engine.steps import (FINISHED, DecodePace, bound_step, decode_n_tokens, decode_one_token, decode_tokens,
                                 prefill)
from ft_jax.kernels.host_bank import use_huge_pages
from ft_jax.models.layers import HostWeights
from ft_jax.offload import expert_parallel
from ft_jax.offload.cost_model import PREFILL_NEVER
from ft_jax.offload.experts import OffloadedExperts
from ft_jax.offload.policy import Policy, PolicyKind

__all__ = ["Engine", "GenerationResult", "NonFiniteLogitsError", "Sampling", "kv_bucket", "prefill_bucket"]

MIN_PREFILL_BUCKET = 16
MIN_KV_BUCKET = 64
DECODE_CHUNK_STEPS = 32  # the most decode steps of one executable run (steps.decode_tokens' max_steps)
DECODE_CHUNK_S = 0.1  # the wall time a run of decode steps aims at (steps.DecodePace; docs/DESIGN.md sec. 20.31)


def step_compiler_options() -> dict[str, str]:
    """XLA options the prefill and decode steps are compiled with: on the CPU backend YNNPACK takes the dots only.

    XLA:CPU hands an elementwise or reduce fusion to YNNPACK from some size on (a 512-token prefill's router softmax,
    not a 256-token one's), and YNNPACK's exp differs from XLA's own loops in the last bit, so a token's combine
    weights (and then its greedy ids) changed with the other rows of its call: the prefill chunk, the other prompts of
    a batch. Measured: no slower (docs/DESIGN.md sec. 15.3)."""
    if jax.default_backend() != "cpu":
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def _pow2_at_least(n: int, low: int) -> int:
    b = low
    while b < n:
        b *= 2
    return b


def eos_operand(eos: Iterable[int]) -> np.ndarray:
    """The EOS ids as steps.decode_tokens' operand: i32[n], n the next power of two >= len(eos) (at least 1), padded
    with steps.FINISHED, so that models with 1-2, 3-4, ... EOS ids share one executable."""
    ids = sorted(eos)
    return np.asarray(ids + [FINISHED] * (_pow2_at_least(len(ids), 1) - len(ids)), np.int32)


def prefill_bucket(length: int, chunk: int | None = None) -> int:
    """Tokens per prefill call: the next power of two >= length, at least MIN_PREFILL_BUCKET, at most chunk (a
    longer prompt is prefilled in ceil(length / chunk) calls of that one shape)."""
    b = _pow2_at_least(length, MIN_PREFILL_BUCKET)
    return b if chunk is None else min(b, chunk)


def row_bucket(rows: int, batch_size: int) -> int:
    """Rows a decode step of a batch_size-row DecodeBatch runs for ``rows`` live rows: the next power of two >= rows,
    capped at batch_size (ft_jax/engine/batch.py)."""
    return min(_pow2_at_least(rows, 1), batch_size)


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


def _left_padded(prompts: Sequence[Sequence[int]], bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, positions) i32[B, n * bucket] of the prompts, left-padded to the smallest multiple of bucket that
    holds the longest (position -1 = padding)."""
    bucket = -(-max(len(p) for p in prompts) // bucket) * bucket
    tokens = np.zeros((len(prompts), bucket), np.int32)
    positions = np.full((len(prompts), bucket), -1, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, bucket - len(p):] = p
        positions[b, bucket - len(p):] = np.arange(len(p))
    return tokens, positions


def dense_weight_bytes(params, tied_embeddings: bool) -> int:
    """Bytes of the dense weights one decode step reads: every parameter leaf (as stored: a QuantizedTensor's data and
    scales) but the embedding table, of which a step gathers only its tokens' rows (with tied embeddings the table is
    also the lm_head, read in full); HostWeights count their banks' bytes."""
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, HostWeights))
    return sum(int(leaf.nbytes) for path, leaf in leaves
               if tied_embeddings or "embed_tokens" not in jax.tree_util.keystr(path))


class Engine:
    """Prefill + decode with experts in host banks and a device slot pool (docs/DESIGN.md sec. 11, "Engine, API and CLI").

    One generate call at a time: calls from several threads are serialised by a lock (the expert state is one cache
    that every call reads and updates).

    Args:
        checkpoint: LoadedCheckpoint (config, model with dense params on the device, gate_up and down host banks).
        policy: decode policy (ft_jax.offload.policy.Policy). A qstar policy needs its fraction (Policy.frac).
        num_slots: S, device expert slots shared by all MoE layers (ignored for the resident policy: S = L*E).
        on_compile: on_compile(text, finished) is called before each compilation with ("building the decode step
            (batch 1, KV cache 256) ...", False) and after it with (" compiled in 3.1 s" or " loaded from the
            compilation cache in 0.2 s", True): the two texts make one line (the first is said before JAX knows
            whether its persistent compilation cache has the step).
        prefill_chunk: prompt tokens per prefill call (>= 1; the attribute may be changed between calls): a longer
            prompt is prefilled in chunks appended to the KV cache, all by one executable per (batch, KV bucket).
        on_prefill: on_prefill(tokens done, tokens in all, seconds since the prefill began) after each chunk of a
            prompt longer than one chunk (the attribute may be set later), or None.
        prefill_fetch_min_tokens: the prefill split of the qstar and auto policies (cost_model.
            prefill_fetch_min_tokens): prefill fetches only the misses routed at least this many tokens of a chunk and
            computes the rest on the host. None: cost_model.PREFILL_NEVER on a CPU device (its slot experts run the
            host kernel, so a fill would only add a copy), else 1 (every miss). Other policies: fetch-all and
            fixed-cap prefill as fetch-all, host-all on the host, resident in the slots (docs/DESIGN.md sec. 17).
        mesh: None (one device), or a jax.sharding.Mesh with an ``expert`` axis (ft_jax.offload.expert_parallel:
            expert_mesh): the experts of every MoE layer split over its N devices, each with ``num_slots`` slots of
            its own and the policy; the checkpoint's banks must hold this process's experts
            (load_checkpoint(experts=ExpertPartition.from_mesh(mesh, E).process_experts)); the dense weights and the
            KV cache are replicated on every device.
        decode_chunk_s: seconds of decode steps per executable run (the attribute may be changed between calls):
            generate runs the decode steps in chunks of one compiled while loop (steps.decode_tokens), the whole
            number of steps nearest to this time at the last run's rate (1 to DECODE_CHUNK_STEPS), and streams the
            tokens after each run; 0 runs one step per dispatch. With a mesh every run takes one step (all
            processes must run the same chunks). The tokens do not depend on it.
    Raises:
        ValueError: num_slots < 1 for an offloading policy, prefill_chunk < 1, decode_chunk_s not a finite number
            >= 0, or a mesh that does not fit the model or the processes (ExpertPartition.from_mesh), or banks that
            do not hold this process's experts.
    """

    def __init__(self, checkpoint: LoadedCheckpoint, *, policy: Policy, num_slots: int,
                 on_compile: Callable[[str, bool], None] | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 on_prefill: Callable[[int, int, float], None] | None = None,
                 prefill_fetch_min_tokens: int | None = None, mesh=None, decode_chunk_s: float = DECODE_CHUNK_S):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.decode_chunk_s = decode_chunk_s
        cfg = checkpoint.config
        self.config = cfg
        self.policy = policy
        self.on_compile = on_compile
        self.prefill_chunk, self.on_prefill = prefill_chunk, on_prefill
        self.graphdef, self.params = nnx.split(checkpoint.model)
        self.mesh = mesh
        experts = dict(banks=checkpoint.banks, activation=cfg.activation, swiglu_alpha=cfg.swiglu_alpha,
                       swiglu_limit=cfg.swiglu_limit)
        prefill_policy = policy if not policy.kind.fetches else Policy(PolicyKind.FETCH_ALL)
        min_tokens = None
        if policy.kind in (PolicyKind.QSTAR, PolicyKind.AUTO):  # priced by the cost model
            min_tokens = prefill_fetch_min_tokens
            if min_tokens is None:
                min_tokens = PREFILL_NEVER if jax.default_backend() == "cpu" else 1
        self.prefill_fetch_min_tokens = min_tokens
        if mesh is None:
            self.num_devices, experts_per_device = 1, cfg.num_experts
            self.decode_backend = OffloadedExperts(**experts, num_experts=cfg.num_experts, policy=policy)
            self.prefill_backend = OffloadedExperts(**experts, num_experts=cfg.num_experts, policy=prefill_policy,
                                                    fetch_min_tokens=min_tokens)
        else:
            partition = expert_parallel.ExpertPartition.from_mesh(mesh, cfg.num_experts)
            self.num_devices, experts_per_device = partition.num_shards, partition.experts_per_shard
            sharded = dict(experts, partition=partition, mesh=mesh)
            self.decode_backend = expert_parallel.ShardedExperts(**sharded, policies=(policy,) * partition.local_shards)
            self.prefill_backend = expert_parallel.ShardedExperts(
                **sharded, policies=(prefill_policy,) * partition.local_shards, fetch_min_tokens=min_tokens)
            self.params = expert_parallel.replicate(self.params, mesh)
        resident = policy.kind is PolicyKind.RESIDENT
        self.num_slots = experts_per_device * self.decode_backend.num_layers if resident else num_slots
        self.expert_bytes = checkpoint.banks.expert_bytes
        self.host_bank_bytes = checkpoint.banks.num_rows * checkpoint.banks.expert_bytes  # this process's experts
        self.weight_format = checkpoint.banks.format
        self.dense_bytes = dense_weight_bytes(self.params, cfg.tie_word_embeddings)
        self.expert_state = self.decode_backend.init_state(self.num_slots)
        use_huge_pages((self.params, self.expert_state))  # the dense weights and slot pools, read every step
        # Donated: the KV cache (3) and the expert state (4) of f(params, tokens, positions, kv_cache, expert_state,
        # key_data, temperature, top_k, top_p); see steps.bound_step.
        self._prefill = jax.jit(bound_step(prefill, self.graphdef, self.prefill_backend),
                                static_argnames=("greedy",), donate_argnums=(3, 4))
        self._decode = jax.jit(bound_step(decode_tokens, self.graphdef, self.decode_backend),
                               static_argnames=("greedy", "record_routing", "max_steps"), donate_argnums=(3, 4))
        self._decode_rows = jax.jit(bound_step(decode_one_token, self.graphdef, self.decode_backend),
                                    static_argnames=("greedy", "record_routing"), donate_argnums=(3, 4))
        # A zero KV cache as one XLA program per (batch, length) on an accelerator; on a CPU only its shapes are used
        self._zero_kv_cache = jax.jit(nnx.merge(self.graphdef, self.params).init_kv_cache, static_argnums=(0, 1))
        self._executables: dict[tuple, object] = {}
        # Steps from earlier launches, loaded without tracing (one device only: a mesh's steps are traced each time)
        self._step_cache = step_cache.default_step_cache() if mesh is None else None
        self._lock = threading.Lock()
        stats_lib.CompileCounter.install()

    @property
    def decode_chunk_s(self) -> float:
        """Seconds of decode steps per executable run (see the class docstring)."""
        return self._decode_chunk_s

    @decode_chunk_s.setter
    def decode_chunk_s(self, seconds: float) -> None:
        """Raises ValueError: not a finite number >= 0 (a bool neither)."""
        try:
            value = None if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) else float(seconds)
        except OverflowError:  # an int or Fraction beyond float's range
            value = None
        if value is None or not 0 <= value < math.inf:
            raise ValueError(f"decode_chunk_s must be a finite number of seconds >= 0, got {seconds!r}")
        self._decode_chunk_s = value

    def init_kv_cache(self, batch_size: int, max_len: int):
        """Zero KV cache for batch_size sequences of up to max_len tokens (ft_jax.models.decoder.KVCache); with a mesh,
        a copy of its own on every device. On one CPU device, numpy zeros put on the device: no XLA program, which as
        the first of a launch paid XLA's set-up (0.02-0.03 s; docs/DESIGN.md sec. 20.30)."""
        if self.mesh is None and jax.default_backend() != "cpu":
            return self._zero_kv_cache(batch_size, max_len)  # numpy zeros would cross PCIe
        shapes = self._zero_kv_cache.eval_shape(batch_size, max_len)  # traced once per shape
        if self.mesh is not None:
            return expert_parallel.replicated_zeros(shapes, self.mesh)
        return jax.tree_util.tree_map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype), may_alias=False), shapes)

    def _executable(self, kind: str, args: tuple, greedy: bool, what: str, tally: dict, record_routing: bool = False):
        """The compiled step of ``kind`` ("prefill"; "decode": decode_tokens, generate's; "decode_rows":
        decode_one_token, a DecodeBatch's) for these argument shapes, compiling it (and announcing it) the first
        time."""
        shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(args[3:5]))
        rest = tuple(np.shape(a) for a in args[9:])  # decode's EOS ids and limit, or decode_rows' rows
        key = (kind, greedy, record_routing, len(args), tuple(a.shape for a in args[1:3]), shapes, rest)
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        step, backend = {"prefill": (self._prefill, self.prefill_backend),
                         "decode": (self._decode, self.decode_backend),
                         "decode_rows": (self._decode_rows, self.decode_backend)}[kind]
        if self.on_compile is not None:
            self.on_compile(f"building {what} ...", False)
        compiles_before, hits_before = stats_lib.CompileCounter.snapshot()
        t0 = time.perf_counter()
        extra = {} if kind == "prefill" else {"record_routing": record_routing}
        if kind == "decode":
            extra["max_steps"] = DECODE_CHUNK_STEPS
        options = step_compiler_options()
        cache_key = None if self._step_cache is None else step_cache.step_key(
            kind, {"greedy": greedy, **extra}, args, (self.graphdef, backend), options)
        exe, found = (None, False) if cache_key is None else self._step_cache.load(cache_key)
        if exe is not None:  # no tracing, no lowering
            compiles, hits = 0, 1
        else:
            store = cache_key is not None and not found  # compiled here, so XLA can serialize it (step_cache)
            with step_cache.jax_cache_bypassed() if store else contextlib.nullcontext():
                exe = step.lower(*args, greedy=greedy, **extra).compile(compiler_options=options)
            compiles, hits = (a - b for a, b in zip(stats_lib.CompileCounter.snapshot(),
                                                    (compiles_before, hits_before)))
            if store:
                self._step_cache.store(cache_key, exe)
        seconds = time.perf_counter() - t0
        tally["compile_s"] += seconds
        tally["xla_compiles"] += compiles
        tally["cache_hits"] += hits
        tally["prefill_compiles" if kind == "prefill" else "decode_compiles"] += 1
        if self.on_compile is not None:
            how = "loaded from the compilation cache" if hits and not compiles else "compiled"
            self.on_compile(f" {how} in {seconds:.1f} s", True)
        self._executables[key] = exe
        return exe

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, eos_token_ids: Iterable[int] = (),
                 on_tokens: Callable[[int, list[int | None]], Sequence[bool] | None] | None = None,
                 record_routing: bool = False) -> GenerationResult:
        """Decode every prompt (as one batch) for up to max_new_tokens tokens. The request is not checked here
        (ft_jax.api.check_request does that); an invalid one fails in numpy or JAX.

        Args:
            prompts: B lists of token ids (each non-empty, ids in [0, vocab)).
            max_new_tokens: tokens to generate per prompt (>= 1); prompt + new tokens must fit
                config.max_position_embeddings.
            sampling: Sampling rule. seed: PRNG seed for sampling (any int; reduced modulo 2^32); prompt b samples
                with sampling.row_key_data(seed, b), whatever the other prompts.
            eos_token_ids: a row stops after producing any of them (empty: never stop early).
            on_tokens: called once per step with (step index, the new token of each row or None if the row had
                already finished): used to stream text. It may return one bool per row: True ends that row there
                (stop strings). The calls of a run of decode steps come together after it (about
                decode_chunk_s apart).
            record_routing: also return the routing of every decode step (GenerationResult.routing; a decode step
                of its own, compiled once).
        Returns:
            GenerationResult with tokens and stats (the keys: ft_jax.engine.stats.generation_stats).
        Raises:
            NonFiniteLogitsError: the model produced NaN or infinite logits.
            If a step fails (e.g. an FFI error), the expert state is rebuilt (a cold cache) before the error
            propagates, so the Engine stays usable.
        """
        eos, B = frozenset(eos_token_ids), len(prompts)
        eos_ids = eos_operand(eos)
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        kv_len = kv_bucket(int(lengths.max()) + max_new_tokens, self.config.max_position_embeddings)
        tally = stats_lib.new_tally()
        ops = (np.stack([row_key_data(seed, b) for b in range(B)]), *sampling.operands(B))  # per-row operands
        with self._lock:
            try:
                kv_cache = self.init_kv_cache(B, kv_len)
                use_huge_pages(kv_cache)
                chunk = prefill_bucket(int(lengths.max()), self.prefill_chunk)
                tokens, positions = _left_padded(prompts, chunk)
                prefill_args = (self.params, tokens[:, :chunk], positions[:, :chunk], kv_cache, self.expert_state,
                                *ops)
                prefill_step, decode_step = self._compile_steps(prefill_args, kv_len, max_new_tokens > 1, sampling,
                                                                eos_ids, record_routing, tally)
                t0 = time.perf_counter()
                first, kv_cache = self._prefill_chunks(prefill_step, prefill_args, tokens, positions, chunk)
                first = expert_parallel.host_value(first)  # i32[B]
                t_first = time.perf_counter()
                stats_after_prefill = self._read_stats()  # one sync
                check_finite(first, 0)
                out: list[list[int]] = [[int(t)] for t in first]
                done = np.array([int(t) in eos for t in first])
                if on_tokens is not None:
                    done |= np.asarray(on_tokens(0, [int(t) for t in first]) or False, bool)
                routing: list | None = [] if record_routing else None
                pace = DecodePace(self.decode_chunk_s if self.mesh is None else 0.0, DECODE_CHUNK_STEPS)
                steps, kv_cache, self.expert_state = decode_n_tokens(
                    decode_step, self.params, kv_cache, self.expert_state, ops, first, lengths, done,
                    max_new_tokens - 1, eos_ids, out, on_tokens, routing, pace)
                per_device = self._read_stats() - stats_after_prefill  # [N, L, 6]
            except BaseException:
                if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.expert_state)):
                    self.expert_state = self.decode_backend.init_state(self.num_slots)  # the donated state is gone
                raise
        stats = stats_lib.generation_stats(self, prompts, out, steps, (t0, t_first, time.perf_counter()), tally,
                                           kv_len, per_device.sum(axis=0),
                                           per_device if self.mesh is not None else None)
        return GenerationResult(tokens=out, stats=stats, routing=self._routing_arrays(routing, B))

    def _read_stats(self) -> np.ndarray:
        """The expert cache counters of every device: i32[N, L, 6] (N = 1 without a mesh)."""
        stats = np.asarray(self.decode_backend.read_stats(self.expert_state))
        return stats if self.mesh is not None else stats[None]

    def _prefill_chunks(self, prefill_step, args: tuple, tokens: np.ndarray, positions: np.ndarray, chunk: int):
        """The prompt through prefill_step chunk by chunk (the chunks of tokens, positions i32[B, n * chunk] in order,
        each appended to the KV cache): (first tokens i32[B] of the last chunk, kv_cache); self.expert_state updated.
        A prompt of more than one chunk reports its progress to on_prefill."""
        n = tokens.shape[1] // chunk
        kv_cache, t0 = args[3], time.perf_counter()
        for c in range(n):
            part = slice(c * chunk, (c + 1) * chunk)
            first, kv_cache, self.expert_state = prefill_step(args[0], tokens[:, part], positions[:, part], kv_cache,
                                                              self.expert_state, *args[5:])
            if self.on_prefill is not None and n > 1:
                jax.block_until_ready(first)
                done = int(np.maximum(positions[:, part].max(axis=1) + 1, 0).sum())
                self.on_prefill(done, int((positions.max(axis=1) + 1).sum()), time.perf_counter() - t0)
        return first, kv_cache

    def _compile_steps(self, prefill_args: tuple, kv_len: int, decodes: bool, sampling: Sampling, eos_ids: np.ndarray,
                       record_routing: bool, tally: dict):
        """(prefill executable, decode_tokens executable or None): both before the first token, so the stream is
        never held up by a compile."""
        B, bucket = prefill_args[1].shape
        shape = f"batch {B}, KV cache {kv_len}"
        prefill_step = self._executable("prefill", prefill_args, sampling.greedy,
                                        f"the prefill step ({shape}, prompt bucket {bucket})", tally)
        if not decodes:
            return prefill_step, None
        step_args = (self.params, prefill_args[1][:, 0], prefill_args[2][:, 0], *prefill_args[3:], eos_ids,
                     np.asarray(1, np.int32))
        return prefill_step, self._executable("decode", step_args, sampling.greedy, f"the decode step ({shape})",
                                              tally, record_routing)

    def _routing_arrays(self, routing: list | None, B: int):
        """The recorded per-step routing stacked into (ids i32[steps, L, B, k], weights f32[steps, L, B, k])."""
        if routing is None:
            return None
        L, k = self.decode_backend.num_layers, self.config.top_k
        ids = np.stack([r[0] for r in routing]) if routing else np.zeros((0, L, B, k), np.int32)
        weights = np.stack([r[1] for r in routing]) if routing else np.zeros((0, L, B, k), np.float32)
        return ids, weights
