"""Generation statistics: the per-call statistics dict and the per-thread XLA compile counter."""

from __future__ import annotations

import threading

import jax
import numpy as np

from ft_jax.offload.cache import STAT_FIELDS
from ft_jax.offload.policy import PolicyKind


class CompileCounter:
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


def new_tally() -> dict:
    """The compile counters of one generate call (filled by Engine._executable)."""
    return dict(compile_s=0.0, xla_compiles=0, cache_hits=0, prefill_compiles=0, decode_compiles=0)


def _counter_stats(per_layer: np.ndarray, steps: int, expert_bytes: int) -> dict:
    """hit_rate, active/hits/misses/fetched/host per step, h2d_bytes_per_step and host_bytes_per_step of cache
    counters i64[L, len(STAT_FIELDS)] over ``steps`` decode steps (None without a step or an active expert)."""
    totals = dict(zip(STAT_FIELDS, per_layer.sum(axis=0).tolist()))
    per_step = (lambda v: v / steps if steps else None)
    return {"hit_rate": totals["hits"] / totals["active"] if totals["active"] else None,
            **{f"{k}_per_step": per_step(totals[k]) for k in ("active", "hits", "misses", "fetched", "host")},
            "h2d_bytes_per_step": per_step(totals["fetched"] * expert_bytes),
            "host_bytes_per_step": per_step(totals["host"] * expert_bytes)}


def generation_stats(engine, prompts, out, steps: int, times: tuple[float, float, float], tally: dict, kv_len: int,
                     per_layer: np.ndarray, per_device: np.ndarray | None = None) -> dict:
    """The statistics dict of one generate call: policy, fraction, num_slots, expert_bytes, batch_size, prompt_tokens,
    generated_tokens, ttft_s (wall time to the first token, compilation included), prefill_s, prefill_tokens_per_s,
    decode_s, decode_tokens (tokens produced by decode steps, i.e. after the first), decode_tokens_per_s (rates
    exclude compilation; None without a decode step), compile_s (ahead-of-time compilation of the steps during this
    call), prefill_compiles and decode_compiles (executables this call built: 0 once the shapes were seen),
    xla_compiles and cache_hits (of those, how many XLA compiled and how many came from the persistent compilation
    cache), kv_cache_len, decode_steps, weight_format (the experts' weight format name, e.g. "bf16", "q4_0"),
    dense_weight_bytes (Engine.dense_bytes: the dense weights a step reads), host_bank_bytes (the bytes of this
    process's expert banks: all experts, or with a mesh those of its devices), and over the decode steps (None without
    one): active/hits/misses/fetched/host per step (summed over MoE layers), hit_rate, h2d_bytes_per_step (slot
    fills), host_bytes_per_step (expert weights read by the CPU), weight_bytes_per_token (weights read per token of the
    decode steps: (dense_weight_bytes * steps + active experts of all steps * expert_bytes) / decode_tokens, every
    byte as stored; with every row running to the end that is per step / batch size),
    per_layer (the raw counters), devices (N, the devices of the expert axis; 1 without a mesh) and, with a mesh,
    per_device: one dict per device of the counter figures above (hit_rate, active/hits/misses/fetched/host per step,
    h2d_bytes_per_step, host_bytes_per_step; the summed figures are theirs added up) and its per_layer counters.
    num_slots is per device.

    Args:
        engine: the Engine (policy, num_slots, expert_bytes, weight_format, dense_bytes). prompts: B prompts; out: B generated id lists.
        steps: decode steps run. times: perf_counter at prefill start, first token, end. tally: new_tally().
        kv_len: KV-cache length. per_layer: i64[L_moe, len(STAT_FIELDS)] cache counters of the decode steps, summed
        over the devices. per_device: with a mesh, the same counters of every device i64[N, L_moe, len(STAT_FIELDS)].
    """
    t0, t_first, t_end = times
    B = len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    decode_tokens = sum(len(o) for o in out) - B
    prefill_s = max(t_first - t0, 1e-9)
    decode_s = max(t_end - t_first, 1e-9)
    totals = dict(zip(STAT_FIELDS, per_layer.sum(axis=0).tolist()))
    per_step = (lambda v: v / steps if steps else None)
    devices = {"devices": 1 if per_device is None else len(per_device)}
    if per_device is not None:
        devices["per_device"] = [{**_counter_stats(d, steps, engine.expert_bytes),
                                  "per_layer": {k: d[:, i].tolist() for i, k in enumerate(STAT_FIELDS)}}
                                 for d in per_device]
    policy = engine.policy
    return {
        "policy": str(policy),
        "fraction": policy.frac if policy.kind is PolicyKind.QSTAR else None,
        "num_slots": engine.num_slots,
        "expert_bytes": engine.expert_bytes,
        "host_bank_bytes": engine.host_bank_bytes,
        "weight_format": engine.weight_format.name,
        "dense_weight_bytes": engine.dense_bytes,
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
        **_counter_stats(per_layer, steps, engine.expert_bytes),
        "weight_bytes_per_token": ((engine.dense_bytes * steps + totals["active"] * engine.expert_bytes) / decode_tokens
                                   if decode_tokens else None),
        "per_layer": {k: per_layer[:, i].tolist() for i, k in enumerate(STAT_FIELDS)},
        **devices,
    }
