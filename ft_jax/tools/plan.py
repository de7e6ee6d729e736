"""Recommend a policy and a cache size for a device memory budget from a routing trace.

The trace is replayed (ft_jax.tools.replay.evaluate: the decode step's own cache plan, the cost model of
ft_jax.offload.cost_model) for the candidate policies at cache sizes up to the budget: the budget's own size and 1/4, 1/2
of it (more slots never hurt a policy's hit rate, but they cost device memory that the KV cache could use). The
recommendation is the (policy, size) with the fewest modelled ms per token, the smallest size within 1% of it;
the report says by how much it beats every other policy at that size. On a CPU device (the cost model's
serial_paths) host-all, which needs no slot, is the recommendation whenever it is within 1% of the fastest: a slot
there is a copy of an expert in the same memory, read by the same cores.
"""

from __future__ import annotations

from ft_jax.offload.cost_model import CostModel
from ft_jax.offload.policy import Policy, PolicyKind
from ft_jax.tools.multi_device import evaluate_devices
from ft_jax.tools.replay import evaluate
from ft_jax.tools.trace_io import Trace

SIZE_STEPS = (0.25, 0.5, 1.0)  # cache sizes tried, as fractions of the budget's slots
WITHIN = 1.01  # a smaller cache within 1% of the best is preferred


def side_by_side(rows: list[dict], observed: dict) -> list[dict]:
    """Modelled and observed ms/token of the rows that have a measured figure.

    Args:
        rows: evaluate's rows. observed: {(policy name as given, cache slots): measured MoE ms per token}.
    Returns:
        [{"policy", "cache_slots", "modelled_ms", "observed_ms", "modelled_over_observed"}], in the rows' order;
        a measured (policy, size) the replay did not run is listed with modelled_ms None.
    """
    out, seen = [], set()
    for r in rows:
        key = (r["policy"], r["cache_slots"])
        if key in observed:
            seen.add(key)
            ms = observed[key]
            out.append({"policy": key[0], "cache_slots": key[1], "modelled_ms": r["ms_per_token"], "observed_ms": ms,
                        "modelled_over_observed": r["ms_per_token"] / ms if ms > 0 else None})
    out += [{"policy": k[0], "cache_slots": k[1], "modelled_ms": None, "observed_ms": v,
             "modelled_over_observed": None} for k, v in observed.items() if k not in seen]
    return out


def recommend(trace: Trace, model: CostModel, budget_bytes: int, policies, *, carry_cache: bool = False,
              batch: bool = False, observed: dict | None = None, devices: int = 1, host_sockets: int = 1,
              allreduce_ms: float = 0.0) -> dict:
    """Replay the candidates and pick a (policy, cache size) for a device budget (module docstring).

    Args:
        trace, model: a Trace and a CostModel (e.g. from ft_jax.cli.trace.load_inputs). budget_bytes: device memory
            for expert slots, bytes (of each device).
        policies: candidate Policy objects (unbound). carry_cache, batch: as in replay.
        observed: {(policy name, cache slots): measured MoE ms per token} to state beside the modelled figures.
        devices, host_sockets, allreduce_ms: N devices of expert parallelism, each with this budget for the experts
            it owns (ft_jax.tools.multi_device.evaluate_devices); with N > 1 the result also holds "one_device",
            the recommendation for one device with the same budget, to state next to it.
    Returns:
        {"budget_bytes", "budget_slots", "resident": bool (resident is the recommendation; a candidate only when
         every expert fits, on a device that is not a CPU), "recommended_slots" (the slots to give: 0 for host-all,
         whatever size its row was replayed at), "added_candidates" (["host-all"] when a CPU device added it to
         the given policies, else []), "dropped_candidates" (["resident"] when it was given but the budget cannot
         hold every expert of a device, or the device is a CPU; else []), "results" (evaluate's rows),
         "best": the recommended row, "alternatives": [{"policy", "ms_per_token", "speedup"} at the best's size,
         speedup = their ms / the best's], "observed": side_by_side's rows ([] without observed)}.
    Raises:
        ValueError: the budget holds no expert slot (on a CPU device: only host-all is replayed then); resident the
            only candidate where the budget cannot hold every expert.
    """
    total = trace.num_layers * trace.num_experts // devices  # the experts of one device
    slots = budget_bytes // model.expert_bytes
    host_all = [p for p in policies if p.kind is PolicyKind.HOST_ALL] or [Policy(PolicyKind.HOST_ALL)]
    added = []  # candidates the caller did not give
    if slots < 1:
        if not model.serial_paths:
            raise ValueError(f"the device budget of {budget_bytes} bytes holds no expert of {model.expert_bytes} "
                             "bytes")
        policies = host_all  # a CPU device: host-all needs no slot (replayed with one, which it never fills)

    def run(candidates, sizes):
        if devices == 1:
            return evaluate(trace, candidates, sizes, model, carry_cache=carry_cache, batch=batch)
        return evaluate_devices(trace, candidates, sizes, model, devices, host_sockets=host_sockets,
                                allreduce_ms=allreduce_ms, carry_cache=carry_cache, batch=batch)

    # Every expert fitting makes resident one more candidate, not the answer: the host path beside the slots can
    # still be faster than hits only. Never on a CPU device (serial_paths): its slots would be a second copy of every
    # expert in the same memory, read by the same kernel on the same cores. A resident among the given candidates is
    # that one candidate (run below) where it may be, and is left out where the budget cannot hold every expert.
    dropped = []
    if any(p.kind is PolicyKind.RESIDENT for p in policies):
        policies = [p for p in policies if p.kind is not PolicyKind.RESIDENT]
        if slots < total or model.serial_paths:
            dropped = ["resident"]
        if not policies and not model.serial_paths and slots < total:
            raise ValueError(f"the candidates are only resident, which needs all {total} experts of a device in "
                             f"slots, and the budget holds {slots}: give other candidates too")
    sizes = sorted({max(1, int(min(slots, total) * f)) for f in SIZE_STEPS})
    if model.serial_paths and not any(p.kind is PolicyKind.HOST_ALL for p in policies):
        policies, added = [*policies, *host_all], ["host-all"]  # a CPU device's default is always a candidate there
    rows = run(policies, sizes) if policies else []
    if slots >= total and not model.serial_paths:
        rows += run([Policy(PolicyKind.RESIDENT)], [total])
    fastest = min(r["ms_per_token"] for r in rows)
    near = [r for r in rows if r["ms_per_token"] <= WITHIN * fastest]
    if model.serial_paths and any(r["policy"] == PolicyKind.HOST_ALL for r in near):
        near = [r for r in near if r["policy"] == PolicyKind.HOST_ALL]
    best = min(near, key=lambda r: (r["cache_slots"], r["ms_per_token"]))
    alternatives = [{"policy": r["bound"], "ms_per_token": r["ms_per_token"],
                     "speedup": r["ms_per_token"] / best["ms_per_token"] if best["ms_per_token"] > 0 else 1.0}
                    for r in rows if r["cache_slots"] == best["cache_slots"] and r is not best]
    # host-all never fills a slot (its rows are replayed with the sizes of the others, or one slot): it needs none
    needed = 0 if best["policy"] == PolicyKind.HOST_ALL else int(best["cache_slots"])
    out = {"budget_bytes": budget_bytes, "budget_slots": int(slots), "resident": best["policy"] == PolicyKind.RESIDENT,
           "recommended_slots": needed, "added_candidates": added, "dropped_candidates": dropped,
           "results": rows, "best": best,
           "alternatives": alternatives, "observed": side_by_side(rows, observed or {}), "devices": devices}
    if devices > 1:
        out["one_device"] = recommend(trace, model, budget_bytes, policies, carry_cache=carry_cache,
                                      batch=batch)["best"]
    return out
