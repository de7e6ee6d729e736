"""Continuous batching in static shapes: a DecodeBatch of B rows over one KV cache, each row its own sequence.

    batch = DecodeBatch(engine, batch_size=8, kv_len=2048)
    job = batch.start_prefill([3], [[1, 17, 42]], [Sampling(0.0)], seeds=[0])  # row 3 takes this prompt
    while not job.done:
        job.run_chunk()                                                        # one chunk per call
    first = job.first_tokens                                                   # row 3 now decodes
    tokens = batch.decode()                                                    # i32[8]: every live row's next
    batch.release(3)                                                           # row 3 is free again

Shapes never depend on the requests: a decode step runs the live rows in a row bucket, the smallest of 1, 2, 4, ..
(powers of two below B) and B that holds them (row_buckets), so a lone request on an 8-row server pays for one row's
projections, attention and sampling, not eight: one decode executable per (row bucket, B, KV length); two in fact,
the greedy one (argmax only) runs while every live row is greedy. A bucket's rows are the live rows' indices into
the B-row KV cache (the attention gathers their KV blocks, layers.attend_live_blocks), its spare rows free rows that
feed position -1 (nothing written, nothing routed). One prefill executable per (prefill rows, prompt bucket, prefill
KV length) and one row-insert per (prefill rows, prefill KV length). A group of new prompts is prefilled together into
a KV cache of its own, [P, S_p] (P = 1 for one prompt, else B: two shapes only, as a prefill reads every expert's
weights once whatever its rows; S_p: the KV bucket of the longest prompt), then copied into its rows of the batch
cache ([:, rows, :S_p]); entries past S_p keep a former row's keys, which no query of the new sequence can see (a
query sees the cache indices up to its position, and every index is written before the position that reads it). Every row samples with its own key and values
(sampling.sample_next), so a row's tokens never depend on its neighbours. docs/DESIGN.md sec. 16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ft_jax.engine import stats as stats_lib
from ft_jax.engine.engine import Engine, kv_bucket, prefill_bucket, row_bucket
from ft_jax.engine.sampling import Sampling, row_key_data
from ft_jax.kernels.host_bank import use_huge_pages
from ft_jax.models.decoder import KVCache


def row_buckets(batch_size: int) -> list[int]:
    """Every decode row bucket of a batch of batch_size rows (engine.row_bucket of 1 .. batch_size): the powers of two
    below it, then batch_size (8 -> [1, 2, 4, 8]; 6 -> [1, 2, 4, 6])."""
    return sorted({row_bucket(n, batch_size) for n in range(1, batch_size + 1)})


def insert_rows(kv_cache: KVCache, part: KVCache, rows: jax.Array) -> KVCache:
    """kv_cache (arrays [n, B, S, ...]) with the P rows of part ([n, P, S_p, ...], S_p <= S) written into rows
    i32[P] at cache indices 0 .. S_p - 1; a row index >= B (padding of the group) writes nothing."""
    S_p = part.max_len
    return KVCache(tuple(tuple(a.at[:, rows, :S_p].set(b, mode="drop") for a, b in zip(big, small))
                         for big, small in zip(kv_cache.stacks, part.stacks)))


class PrefillJob:
    """The prefill of a group of prompts into rows of a DecodeBatch, run chunk by chunk (DecodeBatch.start_prefill).

    Attributes:
        rows: the batch rows the prompts go to. done: every chunk has run and the rows are inserted.
        first_tokens: after done, i32[len(rows)] each prompt's first generated token (-1: non-finite logits).
        chunks: chunks in all; chunks_done: chunks run so far.
    """

    def __init__(self, batch: "DecodeBatch", rows: list[int], prompts: list[list[int]], samplings: list[Sampling],
                 seeds: list[int]):
        engine = batch.engine
        self.batch, self.rows = batch, list(rows)
        P = 1 if len(rows) == 1 else batch.batch_size  # prefill rows (the group's padding rows write nothing)
        lengths = [len(p) for p in prompts]
        self.chunk = prefill_bucket(max(lengths), engine.prefill_chunk)
        padded = -(-max(lengths) // self.chunk) * self.chunk
        self.tokens = np.zeros((P, padded), np.int32)  # i32[P, n * chunk], left-padded
        self.positions = np.full((P, padded), -1, np.int32)  # -1 = padding (and the group's padding rows)
        for i, p in enumerate(prompts):
            self.tokens[i, padded - len(p):] = p
            self.positions[i, padded - len(p):] = np.arange(len(p))
        self.ops = batch.row_operands(P, samplings, seeds)
        # [P, S_p]: the cache index is the position, so S_p holds the longest prompt (not its left padding)
        self.kv_cache = engine.init_kv_cache(P, kv_bucket(max(lengths), batch.kv_len))
        self.chunks, self.chunks_done = padded // self.chunk, 0
        self.first_tokens: np.ndarray | None = None
        self.lengths = lengths

    @property
    def done(self) -> bool:
        return self.first_tokens is not None

    def run_chunk(self) -> None:
        """Run the next chunk through the prefill step; after the last one, insert the rows into the batch and set
        first_tokens (the rows then decode at the next DecodeBatch.decode). Raises what the step raises."""
        batch, engine = self.batch, self.batch.engine
        part = slice(self.chunks_done * self.chunk, (self.chunks_done + 1) * self.chunk)
        with engine._lock:
            args = (engine.params, self.tokens[:, part], self.positions[:, part], self.kv_cache, engine.expert_state,
                    *self.ops)
            P, S_p = self.tokens.shape[0], self.kv_cache.max_len
            step = engine._executable("prefill", args, False, f"the prefill step (batch {P}, KV cache {S_p}, "
                                      f"prompt bucket {self.chunk})", batch.tally)
            first, self.kv_cache, engine.expert_state = step(*args)
            self.chunks_done += 1
            if self.chunks_done < self.chunks:
                return
            rows = np.full(P, batch.batch_size, np.int32)  # the group's padding rows: dropped
            rows[:len(self.rows)] = self.rows
            batch.kv_cache = batch._insert(batch.kv_cache, self.kv_cache, rows)
            first = np.asarray(first)[:len(self.rows)]  # i32[len(rows)]: the one host sync of the prefill
        self.kv_cache = None
        for i, row in enumerate(self.rows):
            batch.tokens[row], batch.positions[row] = first[i], self.lengths[i]
            batch.set_row_sampling(row, self.ops, i)
        self.first_tokens = first


class DecodeBatch:
    """B rows of one KV cache of kv_len entries, decoded together by one executable (module docstring).

    Not thread-safe: one thread drives it (the server's batcher). Each call holds the Engine's lock.

    Args:
        engine: the Engine (its params, expert state and executable cache are shared with Engine.generate).
        batch_size: B rows. kv_len: KV-cache entries per row (a row's prompt + new tokens must fit).
    Attributes:
        tokens, positions: i32[B] what each row feeds at the next decode (position -1: a free row or one still
            prefilling). busy: bool[B] rows taken (prefilling or decoding). tally: compile counters
            (stats.new_tally) of every executable built for this batch.
    Raises:
        ValueError: batch_size or kv_len < 1.
    """

    def __init__(self, engine: Engine, batch_size: int, kv_len: int):
        if batch_size < 1 or kv_len < 1:
            raise ValueError(f"batch_size and kv_len must be >= 1, got {batch_size} and {kv_len}")
        self.engine, self.batch_size, self.kv_len = engine, batch_size, kv_len
        self.kv_cache = engine.init_kv_cache(batch_size, kv_len)
        use_huge_pages(self.kv_cache)
        self.tokens = np.zeros(batch_size, np.int32)
        self.positions = np.full(batch_size, -1, np.int32)
        self.busy = np.zeros(batch_size, bool)
        self.key_data = np.zeros((batch_size, 2), np.uint32)  # u32[B, 2] each row's PRNG key
        self.temperature, self.top_k, self.top_p = Sampling().operands(batch_size)
        self.tally = stats_lib.new_tally()
        self._insert = jax.jit(insert_rows, donate_argnums=(0,))

    def free_rows(self) -> list[int]:
        """The rows not taken, lowest first."""
        return np.flatnonzero(~self.busy).tolist()

    def row_operands(self, rows: int, samplings: list[Sampling], seeds: list[int]) -> tuple[np.ndarray, ...]:
        """(key_data u32[rows, 2], temperature f32[rows], top_k i32[rows], top_p f32[rows]) of the given rules and
        seeds (each sequence's key: sampling.row_key_data(seed, 0)); rows past len(samplings) are greedy."""
        ops = (np.zeros((rows, 2), np.uint32), *Sampling().operands(rows))
        for i, (rule, seed) in enumerate(zip(samplings, seeds)):
            ops[0][i] = row_key_data(seed, 0)
            for dst, src in zip(ops[1:], rule.operands(1)):
                dst[i] = src[0]
        return ops

    def set_row_sampling(self, row: int, ops: tuple[np.ndarray, ...], i: int) -> None:
        """Row ``row`` samples with entry i of row_operands' arrays ops."""
        for dst, src in zip((self.key_data, self.temperature, self.top_k, self.top_p), ops):
            dst[row] = src[i]

    def start_prefill(self, rows: list[int], prompts: list[list[int]], samplings: list[Sampling],
                      seeds: list[int]) -> PrefillJob:
        """Take free ``rows`` for ``prompts`` (checked: non-empty, in the vocabulary, prompt + new tokens <= kv_len)
        with their sampling rules and seeds. Returns the PrefillJob (nothing runs until run_chunk).

        Raises:
            ValueError: a row that is taken or out of range, or lists of different lengths.
        """
        if not len(rows) == len(prompts) == len(samplings) == len(seeds) or not rows:
            raise ValueError(f"start_prefill: {len(rows)} rows, {len(prompts)} prompts, {len(samplings)} samplings "
                             f"and {len(seeds)} seeds: give one of each per prompt (at least one)")
        bad = [r for r in rows if not 0 <= r < self.batch_size or self.busy[r]]
        if bad:
            raise ValueError(f"start_prefill: row {bad[0]} is taken or outside [0, {self.batch_size})")
        self.busy[rows] = True
        return PrefillJob(self, rows, prompts, samplings, seeds)

    def decode(self) -> np.ndarray:
        """One decode step over the live rows (position >= 0), in the smallest row bucket that holds them: each
        feeds its token and advances by one. When every live row is greedy the greedy executable runs (argmax only),
        else the sampling one.
        Returns i32[B] the next token of each row (-1: non-finite logits of that row; 0 for rows not live).
        Raises what the step raises (the KV cache and the expert state may then be gone: see reset)."""
        engine = self.engine
        live = self.positions >= 0
        rows = self.bucket_rows(live)
        with engine._lock:
            args = self._decode_args(rows)
            step = self._decode_step(args, greedy=bool((self.temperature[live] == 0).all()))
            out, self.kv_cache, engine.expert_state = step(*args)
            out = np.asarray(out)  # the one host sync per step
        nxt = np.zeros(self.batch_size, np.int32)
        ran = live[rows]  # bool[b]: the bucket's live rows
        nxt[rows[ran]] = out[ran]
        self.tokens = nxt
        self.positions = np.where(live, self.positions + 1, -1).astype(np.int32)
        return nxt

    def bucket_rows(self, live: np.ndarray) -> np.ndarray:
        """i32[b] the rows a decode step runs for the live rows (bool[B]), b = engine.row_bucket of their count: all
        B rows in order when b = B, else the live rows in order, then free rows."""
        n = int(live.sum())
        b = row_bucket(n, self.batch_size)
        if b == self.batch_size:
            return np.arange(b, dtype=np.int32)
        return np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)[:b - n]]).astype(np.int32)

    def _decode_args(self, rows: np.ndarray) -> tuple:
        """The decode step's arguments for the rows i32[b] (all B in order: the cache's own rows, no gather)."""
        engine = self.engine
        extra = () if len(rows) == self.batch_size else (rows,)
        return (engine.params, self.tokens[rows], self.positions[rows], self.kv_cache, engine.expert_state,
                self.key_data[rows], self.temperature[rows], self.top_k[rows], self.top_p[rows], *extra)

    def _decode_step(self, args: tuple, greedy: bool):
        what = "greedy" if greedy else "sampling"
        rows = len(args[1])
        return self.engine._executable("decode_rows", args, greedy, f"the {what} decode step ({rows} of "
                                       f"{self.batch_size} rows, KV cache {self.kv_len})", self.tally)

    def compile_decode(self) -> None:
        """Build the decode executables (greedy and sampling, each row bucket) now, ahead of the first request."""
        with self.engine._lock:
            for b in row_buckets(self.batch_size):
                args = self._decode_args(np.arange(b, dtype=np.int32))
                for greedy in (True, False):
                    self._decode_step(args, greedy)

    def release(self, row: int) -> None:
        """Free a row (finished or cancelled): it feeds position -1 from the next step on."""
        self.busy[row], self.positions[row], self.tokens[row] = False, -1, 0

    def read_cache_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(counters i32[L_moe, 6], resident i32[L_moe]): the expert cache's per-layer counters since the Engine was
        built (columns ft_jax.offload.cache.STAT_FIELDS; prefill and decode steps of every request) and how many of
        each layer's experts are in a slot now. One device read (read_stats checks the error counters)."""
        engine = self.engine
        with engine._lock:
            stats = engine.decode_backend.read_stats(engine.expert_state)
            slot_of_expert = np.asarray(engine.expert_state.cache.slot_of_expert)  # i32[L_moe, E]
        return stats, (slot_of_expert >= 0).sum(axis=1)

    def zero_cache_stats(self) -> None:
        """Zero the expert cache's counters (read_cache_stats), e.g. after a warm-up whose routes are no request's."""
        engine = self.engine
        with engine._lock:
            state = engine.expert_state
            engine.expert_state = state._replace(cache=state.cache._replace(stats=jnp.zeros_like(state.cache.stats)))

    def reset(self) -> None:
        """After a failed step: a fresh KV cache (every row free) and, if the donated expert state is gone, a cold
        one (as Engine.generate does)."""
        engine = self.engine
        with engine._lock:
            if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(engine.expert_state)):
                engine.expert_state = engine.decode_backend.init_state(engine.num_slots)
            self.kv_cache = engine.init_kv_cache(self.batch_size, self.kv_len)
        self.busy[:] = False
        self.positions[:] = -1
        self.tokens[:] = 0
