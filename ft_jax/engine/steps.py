"""The steps of generation, in the shape of gpt-fast's generate.py: ``prefill`` (the prompt batch, jitted),
``decode_one_token`` (one token per row, jitted), ``decode_tokens`` (up to max_steps of decode_one_token in one
jitted while loop: one executable run per chunk of steps) and ``decode_n_tokens`` (the host loop over the chunks: one
dispatch and one device-to-host read of the new tokens per chunk, the chunk sized by DecodePace). Why the shapes
never depend on the routing, and why prefill uses fetch-all: docs/DESIGN.md sec. 11, "Engine, API and CLI"; why
the decode steps run in chunks: sec. 20.31."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
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


FINISHED = -2  # decode_tokens' mark for a row that took no step (never a token: sample_next's ids are >= -1)


def decode_tokens(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key_data, temperature, top_k,
                  top_p, eos_ids, limit, *, greedy: bool, max_steps: int, record_routing: bool = False):
    """Up to ``limit`` decode steps (decode_one_token) in one executable: a jax.lax.while_loop that feeds each step's
    tokens to the next, so the host's share of a step (the token's device-to-host read, the Python loop, the dispatch
    and the wake-up of the thread that runs it: about 1 ms on a 2-vCPU VM, docs/DESIGN.md sec. 20.31) is paid once per
    chunk. Every step is decode_one_token's, so the tokens equal one-step-per-dispatch decoding.

    Args:
        tokens, positions: i32[B] the first step's tokens and positions (position -1 = finished row: fed token 0 at
            position -1, as decode_n_tokens feeds it). key_data, temperature, top_k, top_p: decode_one_token's.
        eos_ids: i32[n] the ids that end a row (engine.eos_operand; FINISHED pads). limit: i32[] steps to run,
            1..max_steps.
        max_steps: (static) the chunk's capacity, the first axis of the outputs.
    Returns:
        (tokens i32[max_steps, B]: step j's token of each row (-1: non-finite logits, FINISHED: the row had finished
        or the loop had stopped), steps run i32[], kv_cache, expert_state) and, with record_routing, each step's
        routing (topk ids i32[max_steps, L_moe, B, k], weights f32[max_steps, L_moe, B, k]; zeros after the last step).
        The loop stops after ``limit`` steps, when every row has finished (an EOS id), or after a step with
        non-finite logits in a live row (the host then raises, naming that step).
    """
    B = tokens.shape[0]

    def cond(carry):
        i, _, pos, _, _, bad, _ = carry
        return (i < limit) & jnp.any(pos >= 0) & ~bad

    def body(carry):
        i, tok, pos, kv, state, _, outs = carry
        res = decode_one_token(graphdef, backend, params, tok, pos, kv, state, key_data, temperature, top_k, top_p,
                               greedy=greedy, record_routing=record_routing)
        nxt, kv, state = res[:3]  # i32[B]
        live = pos >= 0
        step_out = (jnp.where(live, nxt, FINISHED),) + (tuple(res[3]) if record_routing else ())
        outs = tuple(jax.lax.dynamic_update_index_in_dim(o, x, i, 0) for o, x in zip(outs, step_out))
        ended = jnp.any(nxt[:, None] == eos_ids[None, :], axis=1)  # bool[B]
        bad = jnp.any(live & (nxt < 0))
        pos = jnp.where(live & ~ended, pos + 1, -1)
        return i + 1, jnp.where(pos >= 0, nxt, 0), pos, kv, state, bad, outs

    outs = (jnp.full((max_steps, B), FINISHED, jnp.int32),)
    if record_routing:
        ids, weights = jax.eval_shape(
            lambda: decode_one_token(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key_data,
                                     temperature, top_k, top_p, greedy=greedy, record_routing=True)[3])
        outs += tuple(jnp.zeros((max_steps,) + a.shape, a.dtype) for a in (ids, weights))
    carry = (jnp.int32(0), tokens, positions, kv_cache, expert_state, jnp.bool_(False), outs)
    steps, _, _, kv_cache, expert_state, _, outs = jax.lax.while_loop(cond, body, carry)
    if not record_routing:
        return outs[0], steps, kv_cache, expert_state
    return outs[0], steps, kv_cache, expert_state, outs[1:]


class DecodePace:
    """How many steps the next decode_tokens run takes: the whole number of steps nearest to ``seconds`` at the last
    run's time per step (at least 1, at most max_steps); the first run takes 1. The host streams the tokens once per
    run, so a streamed token waits about ``seconds`` at most (0.1 s: ten updates a second), and an interrupt is seen
    within it."""

    def __init__(self, seconds: float, max_steps: int):
        self.seconds, self.max_steps, self.steps = seconds, max_steps, 1

    def measured(self, steps: int, elapsed_s: float) -> None:
        """Record that a run of ``steps`` steps took ``elapsed_s`` seconds (wall, host read included)."""
        per_step = elapsed_s / max(steps, 1)
        fill = self.seconds / per_step if per_step > 0 else math.inf
        self.steps = max(1, round(min(fill, self.max_steps)))


def decode_n_tokens(decode_chunk, params, kv_cache, expert_state, ops, last, pos, done, n, eos_ids, out, on_tokens,
                    routing, pace: DecodePace):
    """Up to n decode steps, in runs of the compiled decode_tokens, until every row is done.

    Args:
        decode_chunk: the compiled decode_tokens (Engine._executable "decode"). params, kv_cache,
            expert_state: its state (the last two donated and replaced every run). ops: (key_data u32[B, 2],
            Sampling.operands(B)...).
        last: i32[B] the tokens to feed; pos: i32[B] their positions; done: bool[B] finished rows (updated).
        eos_ids: i32[n] the ids that end a row, decode_tokens' operand (FINISHED pads it, never a token). out: per
            row, the generated ids (appended to). on_tokens: see Engine.generate
            (called once per step, in order, after the run that made it; a row it ends takes no later token of that
            run). routing: a list that receives each step's recorded routing, or None. pace: DecodePace (steps per
            run; fixed at 1 step where every process must run the same chunks: a mesh).
    Returns:
        (steps run on the device, kv_cache, expert_state): when on_tokens ends the last live rows inside a run, the
        steps after it were run (and counted in the cache statistics) but give no token, on_tokens call or routing.
    Raises:
        NonFiniteLogitsError: a row's logits were not finite (naming the step and rows).
    """
    steps, eos = 0, frozenset(eos_ids.tolist())
    while steps < n and not done.all():
        limit = min(pace.steps, n - steps)
        feed_tokens = np.where(done, 0, last).astype(np.int32)
        feed_pos = np.where(done, -1, pos).astype(np.int32)
        t0 = time.perf_counter()
        toks, ran, kv_cache, expert_state, *recorded = decode_chunk(params, feed_tokens, feed_pos, kv_cache,
                                                                    expert_state, *ops, eos_ids,
                                                                    np.asarray(limit, np.int32))
        toks, ran = host_value(toks), int(host_value(ran))  # the one host sync per run: the tokens to stream
        pace.measured(ran, time.perf_counter() - t0)
        if routing is not None:
            ids, weights = (host_value(a) for a in recorded[0])  # [max_steps, L_moe, B, k]
        for j in range(ran):
            nxt = toks[j]
            check_finite(np.where(done, 0, nxt), steps + j + 1)
            if routing is not None:  # a row on_tokens ended inside the run was still run: its routing as padding's
                gone = done[None, :, None]
                routing.append((np.where(gone, -1, ids[j]), np.where(gone, 0, weights[j])))
            new: list[int | None] = [None if done[b] else int(nxt[b]) for b in range(len(out))]
            for b, token in enumerate(new):
                if token is not None:
                    out[b].append(token)
                    done[b] = token in eos
            if on_tokens is not None:
                done |= np.asarray(on_tokens(steps + j + 1, new) or False, bool)
            if done.all():  # on_tokens ended the last live row inside the run: its later steps are not reported
                break
        pos, last = pos + ran, toks[ran - 1]
        steps += ran
    return steps, kv_cache, expert_state


def bound_step(step, graphdef, backend):
    """step (prefill, decode_one_token or decode_tokens) with its graphdef and backend bound, f(params, tokens,
    positions, kv_cache, expert_state, key_data, temperature, top_k, top_p, *rest, **static) (rest: decode_one_token's
    optional rows, decode_tokens' eos_ids and limit): a function object of one Engine's own for its jax.jit, so that
    JAX's caches (keyed weakly on the function, holding static arguments strongly) never keep a dropped Engine's
    executables and host banks alive (docs/DESIGN.md sec. 11, "Engine, API and CLI")."""
    def call(params, tokens, positions, kv_cache, expert_state, key_data, temperature, top_k, top_p, *rest, **static):
        return step(graphdef, backend, params, tokens, positions, kv_cache, expert_state, key_data, temperature, top_k,
                    top_p, *rest, **static)

    return call
