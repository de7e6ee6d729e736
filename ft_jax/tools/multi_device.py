"""Model N devices of expert parallelism from a routing trace (`ft-jax trace --devices`, `ft-jax plan --devices`).

As the engine splits them (ft_jax.offload.expert_parallel), the E experts of every MoE layer are split over N devices
in blocks of E/N (device d: experts d*E/N .. (d+1)*E/N - 1). Each device replays its own share of the trace through
its own cache of ``slots`` slots (ft_jax.tools.replay, the decode step's cache plan) with its own policy bound to
its cost model, and is priced by it: its own link (BP, BPc) and its socket's host GEMV bandwidth (BH, BHc), which
the devices of one socket share (``host_sockets`` sockets, the devices spread evenly over them; one socket per
device = one host per device, as with one process per host): in a layer, the host experts of a socket's devices are
pooled and each device with host work finishes it when the pool would at the socket's BH (token_ms). A MoE layer
ends when its slowest device ends, plus ``allreduce_ms`` for the psum of the partial outputs when N > 1; a token is
the sum over its layers. N = 1 gives ft_jax.tools.replay.evaluate's figures. Not modelled: several devices' fills
at once exceeding the host memory bandwidth, and the dense (attention) time, as for one device.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence as Seq

import numpy as np

from ft_jax.offload.cost_model import CostModel
from ft_jax.offload.policy import bind_policy
from ft_jax.tools.replay import replay, replay_runs, rows_per_step
from ft_jax.tools.trace_io import Trace


def check_devices(trace: Trace, devices: int) -> None:
    """ValueError unless ``devices`` >= 1 divides the trace's experts per layer."""
    E = trace.num_experts
    if not isinstance(devices, int) or devices < 1 or E % devices:
        raise ValueError(f"--devices {devices}: the {E} experts per MoE layer cannot be split evenly over {devices} "
                         f"devices (use one of {', '.join(str(d) for d in range(1, E + 1) if E % d == 0)})")


def shard_trace(trace: Trace, devices: int) -> list[Trace]:
    """The trace as each of ``devices`` devices sees it: its own E/N experts of every layer (active bool[T, L, E/N]
    per sequence; tokens that route nowhere on a device stay, with no active expert). Raises ValueError as
    check_devices."""
    check_devices(trace, devices)
    Es = trace.num_experts // devices
    return [dataclasses.replace(trace, num_experts=Es, sequences=[
        dataclasses.replace(s, active=s.active[..., d * Es:(d + 1) * Es]) for s in trace.sequences])
        for d in range(devices)]


def sockets_of(devices: int, host_sockets: int) -> np.ndarray:
    """The socket of every device: i64[N], the devices spread evenly over ``host_sockets`` sockets in order (device d
    on socket d * host_sockets // N). Raises ValueError: host_sockets not in [1, N]."""
    if not isinstance(host_sockets, int) or not 1 <= host_sockets <= devices:
        raise ValueError(f"--host-sockets must be an integer in [1, {devices}] (the devices), got {host_sockets!r}")
    return np.arange(devices) * host_sockets // devices


def layer_ms(model: CostModel, stats: np.ndarray, host: np.ndarray | None = None) -> np.ndarray:
    """CostModel.layer_ms of every (token, layer): f64[T, L] from stats i32[T, L, 5] (replay's columns); ``host``
    i32[T, L], when given, replaces the host-computed count of the layers that have one (the socket's pooled host
    experts, token_ms)."""
    F, H, D = stats[..., 3], stats[..., 4], stats[..., 1] + stats[..., 3]  # each i32[T, L]
    if host is not None:
        H = np.where(H > 0, host, 0)
    keys, inverse = np.unique(np.stack([F, H, D], -1).reshape(-1, 3), axis=0, return_inverse=True)
    per = np.array([model.layer_ms(int(f), int(h), int(d)) for f, h, d in keys])  # f64[unique]
    return per[inverse.reshape(-1)].reshape(F.shape) if F.size else np.zeros(F.shape)


def token_ms(stats: np.ndarray, models: Seq[CostModel], host_sockets: int = 1, allreduce_ms: float = 0.0
             ) -> np.ndarray:
    """MoE time of every token: f64[T] ms (module docstring) from stats i32[N, T, L, 5] (per device, replay's
    columns) and one CostModel per device (its link's BP / BPc, its socket's BH / BHc). The devices of one socket
    share its host GEMV bandwidth work-conservingly: a device with host experts in a layer finishes its host part
    when the socket's pooled host experts would at the socket's BH (its share of the bandwidth is in proportion to
    its work), so it is priced with the socket's host count. A layer = the slowest device + allreduce_ms (N > 1)."""
    sockets = sockets_of(len(models), host_sockets)
    pooled = np.stack([stats[sockets == k, ..., 4].sum(axis=0) for k in range(host_sockets)])  # i32[K, T, L]
    per_device = np.stack([layer_ms(m, s, pooled[k]) for m, s, k in zip(models, stats, sockets)])  # f64[N, T, L]
    layer = per_device.max(axis=0) + (allreduce_ms if len(models) > 1 else 0.0)  # f64[T, L]
    return layer.sum(axis=1)


def experts_per_device(trace: Trace, devices: int) -> int:
    """The experts one of ``devices`` devices owns over the trace's layers, L * (E / N): the most slots a device's
    cache can use (evaluate_devices caps larger slot counts to it)."""
    return trace.num_layers * (trace.num_experts // devices)


def evaluate_devices(trace: Trace, policies: Seq, slot_counts: Seq[int], model: CostModel, devices: int, *,
                     host_sockets: int = 1, allreduce_ms: float = 0.0, carry_cache: bool = False, batch: bool = False,
                     progress=None) -> list[dict]:
    """evaluate (ft_jax.tools.replay) for ``devices`` devices: one row per (slots per device, policy).

    Args:
        trace: from read_trace. policies: Policy objects (bound per device with bind_policy on its model).
        slot_counts: slots of each device (a device holds at most its L*E/N experts: larger counts are capped, and
            counts that cap to one are replayed once).
        model: the CostModel of every device (its link's BP / BPc; BH / BHc of its socket). devices: N.
        host_sockets, allreduce_ms: module docstring. carry_cache, batch: as replay. progress: (done, total) or None.
    Returns:
        dicts with evaluate's keys (cache_slots per device, as capped; cache_fraction = cache_slots / (L*E/N), of
        the experts a device owns,
        hit_rate and the per-token figures summed over the devices, ms_per_token by token_ms) plus devices,
        host_sockets, allreduce_ms and per_device (hit_rate, fetched_per_token, host_per_token of each device);
        resident, which holds every expert of a device in a slot whatever S, one row after the others.
    Raises:
        ValueError: devices that do not divide E, host_sockets outside [1, N], a slot count < 1.
    """
    shards, models = shard_trace(trace, devices), [model] * devices
    sockets_of(devices, host_sockets)  # checked before the replays
    own = experts_per_device(trace, devices)
    capped = list(dict.fromkeys(min(int(S), own) for S in slot_counts))
    runs = replay_runs(policies, capped, own)
    out = []
    for slots, policy in runs:
        bound = [bind_policy(policy, m) for m in models]
        stats = np.stack([replay(t, b, slots, carry_cache=carry_cache, batch=batch).stats
                          for t, b in zip(shards, bound)])  # i32[N, T, L, 5]
        s = stats.astype(np.float64)
        rows = rows_per_step(trace, batch)
        active, hits = s[..., 0].sum(), s[..., 1].sum()
        per_device = [{"hit_rate": float(d[..., 1].sum() / d[..., 0].sum()) if d[..., 0].sum() else 0.0,
                       "fetched_per_token": float(d[..., 3].sum(axis=1).mean()) / rows,
                       "host_per_token": float(d[..., 4].sum(axis=1).mean()) / rows} for d in s]
        per_token = s.sum(axis=(0, 2)) / rows  # f64[T, 5]
        out.append({"policy": str(policy), "bound": str(bound[0]), "cache_slots": slots,
                    "cache_fraction": slots / own, "devices": devices, "host_sockets": host_sockets,
                    "allreduce_ms": allreduce_ms,
                    "hit_rate": float(hits / active) if active else 0.0,
                    "active_per_token": float(per_token[:, 0].mean()),
                    "hits_per_token": float(per_token[:, 1].mean()),
                    "fetched_per_token": float(per_token[:, 3].mean()),
                    "host_per_token": float(per_token[:, 4].mean()),
                    "ms_per_token": float(token_ms(stats, models, host_sockets, allreduce_ms).mean()) / rows,
                    "per_device": per_device})
        if progress is not None:
            progress(len(out), len(runs))
    return out
