"""`ft-jax plan`: recommend a policy and a cache size for a device memory budget from a routing trace.

The trace is replayed (ft_jax.tools.trace.evaluate: the decode step's own cache plan, the cost model of
docs/policies.md) for the candidate policies at cache sizes up to the budget: the budget's own size and 1/4, 1/2
of it (more slots never hurt a policy's hit rate, but they cost device memory that the KV cache could use). The
recommendation is the (policy, size) with the fewest modelled ms per token, the smallest size within 1% of it;
the report says by how much it beats every other policy at that size.
"""

from __future__ import annotations

import argparse
import json

from ft_jax.tools import trace as tr

DEFAULT_CANDIDATES = "auto,qstar,fetch-all,host-all,fixed-cap:1,fixed-cap:2"
SIZE_STEPS = (0.25, 0.5, 1.0)  # cache sizes tried, as fractions of the budget's slots
WITHIN = 1.01  # a smaller cache within 1% of the best is preferred


def recommend(trace: tr.Trace, model: tr.CostModel, budget_bytes: int, policies, *, carry_cache: bool = False,
              batch: bool = False) -> dict:
    """Replay the candidates and pick a (policy, cache size) for a device budget (module docstring).

    Args:
        trace, model: from ft_jax.tools.trace.load_inputs. budget_bytes: device memory for expert slots, bytes.
        policies: candidate Policy objects (unbound). carry_cache, batch: as in replay.
    Returns:
        {"budget_bytes", "budget_slots", "resident": bool (resident is the recommendation; a candidate only when
         every expert fits), "results" (evaluate's rows),
         "best": the recommended row, "alternatives": [{"policy", "ms_per_token", "speedup"} at the best's size,
         speedup = their ms / the best's]}.
    Raises:
        ValueError: the budget holds no expert slot.
    """
    from ft_jax.offload.policy import Policy

    total = trace.num_layers * trace.num_experts
    slots = budget_bytes // model.expert_bytes
    if slots < 1:
        raise ValueError(f"the device budget of {budget_bytes} bytes holds no expert of {model.expert_bytes} bytes")
    # Every expert fitting makes resident one more candidate, not the answer: on a CPU device the host path beside
    # the slots can still be faster than hits only.
    sizes = sorted({max(1, int(min(slots, total) * f)) for f in SIZE_STEPS})
    rows = tr.evaluate(trace, policies, sizes, model, carry_cache=carry_cache, batch=batch)
    if slots >= total:
        rows += tr.evaluate(trace, [Policy("resident")], [total], model, carry_cache=carry_cache, batch=batch)
    fastest = min(r["ms_per_token"] for r in rows)
    best = min((r for r in rows if r["ms_per_token"] <= WITHIN * fastest),
               key=lambda r: (r["cache_slots"], r["ms_per_token"]))
    alternatives = [{"policy": r["bound"], "ms_per_token": r["ms_per_token"],
                     "speedup": r["ms_per_token"] / best["ms_per_token"] if best["ms_per_token"] > 0 else 1.0}
                    for r in rows if r["cache_slots"] == best["cache_slots"] and r is not best]
    return {"budget_bytes": budget_bytes, "budget_slots": int(slots), "resident": best["policy"] == "resident",
            "results": rows, "best": best, "alternatives": alternatives}


def add_plan_arguments(sub) -> None:
    """Register `ft-jax plan` on the CLI's subparsers."""
    from ft_jax.cli import arg_types

    nbytes, policies = arg_types.byte_count, arg_types.policy_list("--candidates")

    p = sub.add_parser("plan", help="recommend a policy and cache size for a device memory budget from a trace",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=tr.COST_MODEL_HELP, description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("trace", nargs="+", metavar="TRACE", help="routing trace file(s) (JSON lines or .npz)")
    p.add_argument("--device-memory", type=nbytes, required=True, metavar="BYTES",
                   help="device memory for expert slots, e.g. 24GiB")
    p.add_argument("--candidates", type=policies, default=policies(DEFAULT_CANDIDATES), metavar="LIST",
                   help=f"policies to compare (default {DEFAULT_CANDIDATES})")
    tr.add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the recommendation")


def run_plan(args) -> int:
    """`ft-jax plan`: returns the exit status; bad input raises ValueError / OSError."""
    trace, model = tr.load_inputs(args)
    rec = recommend(trace, model, args.device_memory, args.candidates, carry_cache=args.carry_cache,
                    batch=args.batch)
    rep = tr.report(trace, model, rec["results"], args.carry_cache, args.batch)
    if args.json:
        print(json.dumps({**rep, **{k: v for k, v in rec.items() if k != "results"}}, indent=1))
        return 0
    best = rec["best"]
    total = trace.num_layers * trace.num_experts
    if rec["resident"]:
        print(f"recommendation: --policy resident: the budget holds {rec['budget_slots']} experts, all {total} fit "
              f"({best['ms_per_token']:.2f} ms/token modelled, hits only)")
    else:
        gib = best["cache_slots"] * model.expert_bytes / 2**30
        print(f"recommendation: --policy {best['policy']} --cache-slots {best['cache_slots']} ({gib:.2f} GiB, "
              f"{100 * best['cache_fraction']:.1f}% of the {total} experts; budget {rec['budget_slots']} slots): "
              f"{best['ms_per_token']:.2f} ms/token modelled, hit rate {100 * best['hit_rate']:.1f}%")
    for alt in sorted(rec["alternatives"], key=lambda a: a["speedup"]):
        print(f"  beats {alt['policy']:<16} ({alt['ms_per_token']:.2f} ms/token) by {alt['speedup']:.3f}x")
    print()
    print(tr.format_table(rep))
    return 0
