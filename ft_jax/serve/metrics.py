"""The server's Prometheus metrics (prometheus-client, one registry per server) and the expert-cache JSON view.

Metrics (all prefixed ft_jax_):
  requests_total{endpoint}                     accepted requests (completions | chat)
  requests_finished_total{reason}              stop | length | cancelled | error
  requests_rejected_total{status}              400 | 401 | 429 | 503 answers
  prompt_tokens_total, generation_tokens_total tokens of accepted prompts / generated tokens
  time_to_first_token_seconds                  histogram: submit to first token (queueing + prefill)
  time_per_output_token_seconds                histogram: between two tokens of one request (one decode step)
  queue_depth, rows_busy, max_batch            gauges: waiting requests, taken rows, rows in all
  expert_cache_{active,hits,misses,fills,host_computed}_total   expert routes since the start (prefill + decode)
  expert_cache_hit_rate                        hits / active since the start
  expert_cache_fill_bytes_total, host_gemv_bytes_total          bytes copied into slots / read by host GEMVs
  expert_cache_slots                           device expert slots
The expert counters come from the device (one read per scrape, on the batcher thread between two steps).
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ft_jax.offload.cache import STAT_FIELDS

# Seconds: from a fast decode step of a tiny model to a slow CPU prefill of a long prompt.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def cache_view(engine, stats: np.ndarray, resident: np.ndarray) -> dict:
    """The expert cache as JSON: {"policy", "num_slots", "expert_bytes", "weight_format", "totals": {active, hits,
    misses, fetched, host, hit_rate, fill_bytes, host_gemv_bytes}, "layers": [{"layer", the same counts, "hit_rate",
    "resident"}]}.

    Args:
        engine: the Engine. stats: i32[L_moe, 6] counters (columns STAT_FIELDS). resident: i32[L_moe] experts in
            slots per layer (DecodeBatch.read_cache_stats).
    """
    def counts(row) -> dict:
        c = {k: int(v) for k, v in zip(STAT_FIELDS, row) if k != "steps"}
        c["hit_rate"] = c["hits"] / c["active"] if c["active"] else None
        return c

    totals = counts(stats.sum(axis=0))
    totals.update(fill_bytes=totals["fetched"] * engine.expert_bytes,
                  host_gemv_bytes=totals["host"] * engine.expert_bytes)
    layers = [{"layer": l, **counts(row), "resident": int(resident[l])} for l, row in enumerate(stats)]
    return {"policy": str(engine.policy), "num_slots": engine.num_slots, "expert_bytes": engine.expert_bytes,
            "weight_format": engine.weight_format.name, "totals": totals, "layers": layers}


class _CacheCollector:
    """Collector of the expert-cache metrics: read_view() -> cache_view's dict, or None (not loaded yet)."""

    def __init__(self, read_view):
        self.read_view = read_view

    def collect(self):
        view = self.read_view()
        if view is None:
            return
        t = view["totals"]
        for name, key, doc in (("active", "active", "expert routes"), ("hits", "hits", "routes to a resident expert"),
                               ("misses", "misses", "routes to an expert not in a slot"),
                               ("fills", "fetched", "experts copied into a slot"),
                               ("host_computed", "host", "experts computed by the host GEMV")):
            yield CounterMetricFamily(f"ft_jax_expert_cache_{name}", f"{doc} since the start", value=t[key])
        yield CounterMetricFamily("ft_jax_expert_cache_fill_bytes", "bytes copied into expert slots",
                                  value=t["fill_bytes"])
        yield CounterMetricFamily("ft_jax_host_gemv_bytes", "expert weight bytes read by host GEMVs",
                                  value=t["host_gemv_bytes"])
        yield GaugeMetricFamily("ft_jax_expert_cache_hit_rate", "hits / active routes since the start",
                                value=t["hit_rate"] if t["hit_rate"] is not None else float("nan"))
        yield GaugeMetricFamily("ft_jax_expert_cache_slots", "device expert slots", value=view["num_slots"])


class Metrics:
    """The server's metrics in a registry of its own (several servers in one process do not clash).

    Args:
        read_cache_view: () -> cache_view dict or None, called at each scrape.
        queue_depth, rows_busy: () -> int. max_batch: rows in all.
    """

    def __init__(self, read_cache_view, queue_depth, rows_busy, max_batch: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ft_jax_requests", "accepted requests", ["endpoint"], registry=r)
        self.finished = Counter("ft_jax_requests_finished", "finished requests by reason", ["reason"], registry=r)
        self.rejected = Counter("ft_jax_requests_rejected", "requests answered with an error status", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("ft_jax_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("ft_jax_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("ft_jax_time_to_first_token_seconds", "submit to first token (queueing + prefill)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ft_jax_time_per_output_token_seconds", "time between two tokens of one request",
                              buckets=TPOT_BUCKETS, registry=r)
        Gauge("ft_jax_queue_depth", "requests waiting for a row", registry=r).set_function(queue_depth)
        Gauge("ft_jax_rows_busy", "batch rows taken (prefilling or decoding)", registry=r).set_function(rows_busy)
        Gauge("ft_jax_max_batch", "batch rows in all (--max-batch)", registry=r).set(max_batch)
        r.register(_CacheCollector(read_cache_view))

    def on_submit(self, params) -> None:
        self.requests.labels("chat" if params.chat else "completions").inc()
        self.prompt_tokens.inc(len(params.prompt_ids))

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def on_end(self, reason: str, completion_tokens: int) -> None:
        self.finished.labels(reason).inc()
        self.generation_tokens.inc(completion_tokens)

    def on_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
