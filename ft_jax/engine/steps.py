"""The three steps of generation, in the shape of gpt-fast's generate.py: ``prefill`` (the prompt batch, jitted),
``decode_one_token`` (one token per row, jitted) and ``decode_n_tokens`` (the host loop over the compiled decode
step: one dispatch and one device-to-host read of the new tokens per step). Why the shapes never depend on the
routing, and why prefill uses fetch-all: docs/DESIGN.md sec. 11, "Engine, API and CLI"."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from ft_jax.engine.sampling import check_finite, sample_next
from ft_jax.models.layers import prefill_dots
from ft_jax.offload.expert_parallel import host_value


def _forward(graphdef, params, backend, tokens, positions, kv_cache, expert_state, last_logits_only: bool,
             collect: bool = False, rows=None):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, kv_cache, expert_state, backend, rows=rows, last_logits_only=last_logits_only,
                 collect=collect)


def prefill(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key_data, temperature, top_k,
            top_p, *, greedy: bool):
    """The prompt step: tokens, positions i32[B, Tb] (left-padded, position -1 = padding); key_data u32[B, 2] and the
    per-row sampling values f32[B] / i32[B] / f32[B] (sampling.sample_next).
    Returns (first tokens i32[B] (-1: non-finite logits), kv_cache, expert_state)."""
    with prefill_dots():  # a prompt token's bits do not depend on the chunk (models/layers.py)
        logits, kv_cache, expert_state = _forward(graphdef, params, backend, tokens, positions, kv_cache,
                                                  expert_state, last_logits_only=True)  # logits f32[B, 1, V]
    with jax.named_scope("sampling"):  # a part of the profiles (scripts/profile_decode.py)
        nxt = sample_next(logits[:, 0], key_data, positions[:, -1], temperature, top_k, top_p, greedy=greedy)
    return nxt, kv_cache, expert_state


def decode_one_token(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key_data, temperature,
                     top_k, top_p, rows=None, *, greedy: bool, record_routing: bool = False):
    """One decode step: tokens, positions i32[B] (position -1 = finished or free row, skipped); key_data u32[B, 2]
    and the per-row sampling values (sampling.sample_next; each row's key is folded with its position); rows: None
    (kv_cache has B rows) or i32[B] the KV-cache row of each of the B rows when the cache has more (a step over the
    live rows of a larger batch: ft_jax/engine/batch.py).
    Returns (next tokens i32[B] (-1: non-finite logits), kv_cache, expert_state) and, with record_routing (static),
    the routing of the fed tokens: (topk ids i32[L_moe, B, k], weights f32[L_moe, B, k])."""
    out = _forward(graphdef, params, backend, tokens[:, None], positions[:, None], kv_cache, expert_state,
                   last_logits_only=False, collect=record_routing, rows=rows)  # logits f32[B, 1, V], ...
    logits, kv_cache, expert_state = out[:3]
    with jax.named_scope("sampling"):
        nxt = sample_next(logits[:, 0], key_data, positions, temperature, top_k, top_p, greedy=greedy)
    if not record_routing:
        return nxt, kv_cache, expert_state
    return nxt, kv_cache, expert_state, (out[3].topk_ids[:, :, 0], out[3].topk_weights[:, :, 0])


def decode_n_tokens(decode_step, params, kv_cache, expert_state, ops, last, pos, done, n, eos, out, on_tokens,
                    routing):
    """Up to n decode steps of the compiled decode_one_token, until every row is done.

    Args:
        decode_step: the compiled decode step (Engine._executable). params, kv_cache, expert_state: its state
            (the last two donated and replaced every step). ops: (key_data u32[B, 2], Sampling.operands(B)...).
        last: i32[B] the tokens to feed; pos: i32[B] their positions; done: bool[B] finished rows (updated).
        eos: ids that end a row. out: per row, the generated ids (appended to). on_tokens: see Engine.generate.
        routing: a list that receives each step's recorded routing, or None.
    Returns:
        (steps run, kv_cache, expert_state).
    Raises:
        NonFiniteLogitsError: a row's logits were not finite (naming the step and rows).
    """
    steps = 0
    for i in range(1, n + 1):
        if done.all():
            break
        feed_tokens = np.where(done, 0, last).astype(np.int32)
        feed_pos = np.where(done, -1, pos).astype(np.int32)
        nxt, kv_cache, expert_state, *recorded = decode_step(params, feed_tokens, feed_pos, kv_cache, expert_state,
                                                             *ops)
        nxt = host_value(nxt)  # the one host sync per step: the tokens to stream
        if routing is not None:
            routing.append(tuple(host_value(a) for a in recorded[0]))
        steps += 1
        check_finite(np.where(done, 0, nxt), i)
        new: list[int | None] = [None if done[b] else int(nxt[b]) for b in range(len(out))]
        for b, token in enumerate(new):
            if token is not None:
                out[b].append(token)
                done[b] = token in eos
        pos, last = pos + 1, nxt
        if on_tokens is not None:
            done |= np.asarray(on_tokens(i, new) or False, bool)
    return steps, kv_cache, expert_state


def bound_step(step, graphdef, backend):
    """step (prefill or decode_one_token) with its graphdef and backend bound, f(params, tokens, positions, kv_cache,
    expert_state, key_data, temperature, top_k, top_p, *rows, **static) (rows: decode_one_token's optional operand): a
    function object of one Engine's own for its jax.jit, so that JAX's caches (keyed weakly on the function, holding
    static arguments strongly) never keep a dropped Engine's executables and host banks alive (docs/DESIGN.md sec. 11,
    "Engine, API and CLI")."""
    def call(params, tokens, positions, kv_cache, expert_state, key_data, temperature, top_k, top_p, *rows, **static):
        return step(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key_data, temperature, top_k,
                    top_p, *rows, **static)

    return call
