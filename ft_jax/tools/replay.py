"""Replay routing traces through the decode step's own cache plan and price them with the cost model.

``replay`` runs ``ft_jax.offload.cache.plan_layer`` as the decode step does (jit, lax.scan over the MoE layers with
the layer index traced, ``max_active`` = rows x top-k) for one policy and cache size; ``evaluate`` does it for lists
of policies and cache sizes and ``summarize``s each with ``ft_jax.offload.cost_model.CostModel``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from ft_jax.offload.cache import init_cache_state, init_cache_state_resident, plan_layer
from ft_jax.offload.cost_model import CostModel
from ft_jax.offload.policy import PolicyKind, bind_policy
from ft_jax.tools.trace_io import Trace

CHUNK = 32  # tokens per compiled replay call (a lax.scan over tokens of a lax.scan over layers)


@functools.lru_cache(maxsize=None)
def _replay_step(policy, max_active: int):
    """jit: (CacheState, active bool[CHUNK, L, E], valid bool[CHUNK]) -> (CacheState, stats i32[CHUNK, L, 5]).

    Each valid token runs plan_layer over its L MoE layers as the decode step does (lax.scan, layer index traced);
    invalid (padding) tokens leave the state unchanged and report zeros."""
    def run(state, active, valid):
        L = active.shape[1]

        def token(state, xs):
            act, ok = xs  # bool[L, E], bool[]

            def layers(state):
                def layer(state, ys):
                    index, layer_active = ys  # i32[], bool[E]
                    state, plan = plan_layer(state, index, layer_active, policy, max_active=max_active)
                    return state, plan.stats  # i32[5]

                return jax.lax.scan(layer, state, (jnp.arange(L, dtype=jnp.int32), act))

            return jax.lax.cond(ok, layers, lambda s: (s, jnp.zeros((L, 5), jnp.int32)), state)

        return jax.lax.scan(token, state, (active, valid))

    return jax.jit(run, donate_argnums=0)


@dataclasses.dataclass
class ReplayResult:
    """Output of replay.

    Attributes:
        stats: i32[N, L, 5] per (token, MoE layer): active, hits, misses, fetched, host (tokens of all streams in
            order).
        state: the CacheState after the last token.
    """

    stats: np.ndarray
    state: object


def _streams(trace: Trace, batch: bool) -> list[np.ndarray]:
    """Active masks bool[N, L, E] of each stream replayed from its own cache: every sequence, or (batch) one stream
    whose token t is the union of the sequences' token t (rows of one batch decoded together)."""
    if not batch:
        return [s.active for s in trace.sequences]
    steps = sorted(set().union(*(s.token_idx.tolist() for s in trace.sequences)))
    merged = np.zeros((len(steps), trace.num_layers, trace.num_experts), bool)
    where = {t: i for i, t in enumerate(steps)}
    for s in trace.sequences:
        merged[[where[t] for t in s.token_idx.tolist()]] |= s.active
    return [merged]


def rows_per_step(trace: Trace, batch: bool) -> int:
    """Tokens one replayed step decodes: every sequence's (batch: the sequences are the rows of one batch), else 1."""
    return len(trace.sequences) if batch else 1


def replay(trace: Trace, policy, num_slots: int, *, carry_cache: bool = False, batch: bool = False,
           initial_state=None) -> ReplayResult:
    """Replay every complete token of a trace through plan_layer, the decode step's cache plan.

    Args:
        trace: from read_trace.
        policy: a bound ft_jax.offload.policy.Policy (qstar with its fraction, auto with its costs; see policy.bind_policy);
            "resident" needs num_slots = L*E.
        num_slots: S, device slots shared by all MoE layers.
        carry_cache: keep the cache from one sequence to the next (default: each sequence starts cold).
        batch: the sequences are the rows of one batch decoded together (token t of every row in one decode step,
            max_active = rows x top-k), replayed as one stream.
        initial_state: a CacheState to start the first stream from (e.g. the state after a prefill), else cold.
    Returns:
        ReplayResult.
    Raises:
        ValueError: num_slots < 1 or > L*E, a policy that is not bound, or an initial_state of other shapes.
    """
    L, E = trace.num_layers, trace.num_experts
    if not isinstance(num_slots, int) or not 1 <= num_slots <= L * E:
        raise ValueError(f"trace: cache slots must be an integer in [1, L*E = {L * E}], got {num_slots!r}")
    rows = rows_per_step(trace, batch)
    step = _replay_step(policy, max_active=rows * trace.top_k)

    def cold():
        if policy.kind is PolicyKind.RESIDENT:
            return init_cache_state_resident(L, E)
        return init_cache_state(L, E, num_slots, auto=policy.kind is PolicyKind.AUTO)

    out, state = [], None
    for i, active in enumerate(_streams(trace, batch)):
        if state is None or not carry_cache:
            state = cold() if (i or initial_state is None) else jax.tree_util.tree_map(jnp.array, initial_state)
        for start in range(0, len(active), CHUNK):
            part = active[start:start + CHUNK]
            pad = CHUNK - len(part)
            chunk = np.concatenate([part, np.zeros((pad, L, E), bool)]) if pad else part
            state, stats = step(state, jnp.asarray(chunk), jnp.asarray(np.arange(CHUNK) < len(part)))
            out.append((stats, len(part)))
    host = [np.asarray(s)[:n] for s, n in jax.device_get(out)] if out else []
    stats = np.concatenate(host).astype(np.int32) if host else np.zeros((0, L, 5), np.int32)
    return ReplayResult(stats=stats, state=state)


def summarize(stats: np.ndarray, model: CostModel, rows: int = 1) -> dict:
    """Per-token figures of replayed stats i32[N, L, 5] (N > 0 decode steps of ``rows`` rows, one token per row):
    hit_rate (hits / active experts), active, hits, fetched and host experts per token (summed over MoE layers),
    ms_per_token (mean of CostModel.token_ms); a step's figures are divided by its rows (replay's batch)."""
    s = stats.astype(np.float64)
    active, hits = s[..., 0].sum(), s[..., 1].sum()
    per_token = s.sum(axis=1) / rows  # f64[N, 5]
    return {"hit_rate": float(hits / active) if active else 0.0,
            "active_per_token": float(per_token[:, 0].mean()), "hits_per_token": float(per_token[:, 1].mean()),
            "fetched_per_token": float(per_token[:, 3].mean()), "host_per_token": float(per_token[:, 4].mean()),
            "ms_per_token": float(model.token_ms(stats).mean()) / rows}


def replay_runs(policies: Seq, slot_counts: Seq[int], every_expert: int) -> list[tuple[int, object]]:
    """The (slots, policy) replays of evaluate and evaluate_devices: every policy at every S, S-major; resident, which
    holds every expert in a slot whatever S, once, last, at ``every_expert`` slots (L*E, or a device's share)."""
    runs = [(int(S), p) for S in slot_counts for p in policies if p.kind is not PolicyKind.RESIDENT]
    return runs + [(every_expert, p) for p in policies if p.kind is PolicyKind.RESIDENT]


def evaluate(trace: Trace, policies: Seq, slot_counts: Seq[int], model: CostModel, *, carry_cache: bool = False,
             batch: bool = False, progress=None) -> list[dict]:
    """Replay every (cache size, policy) and summarize it (Python API of `ft-jax trace`).

    Args:
        trace: from read_trace. policies: ft_jax.offload.policy.Policy (bound here with bind_policy).
        slot_counts: cache sizes S. model: CostModel. carry_cache, batch: as in replay.
        progress: called with (done, total) after each replay, or None.
    Returns:
        One dict per (S, policy), S-major: policy (its name as given, e.g. "qstar"), bound (str of the bound
        policy), cache_slots, cache_fraction (S / (L*E)), and summarize's fields; resident, which holds every
        expert in a slot whatever S, one row after the others, with cache_slots L*E.
    """
    LE = trace.num_layers * trace.num_experts
    runs = replay_runs(policies, slot_counts, LE)
    out = []
    for slots, policy in runs:
        bound = bind_policy(policy, model)
        res = replay(trace, bound, slots, carry_cache=carry_cache, batch=batch)
        out.append({"policy": str(policy), "bound": str(bound), "cache_slots": slots, "cache_fraction": slots / LE,
                    **summarize(res.stats, model, rows_per_step(trace, batch))})
        if progress is not None:
            progress(len(out), len(runs))
    return out
