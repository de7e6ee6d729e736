"""`ft-jax plan`: recommend a policy and a cache size for a device memory budget from a routing trace.

The arguments and inputs are `ft-jax trace`'s (ft_jax.cli.trace); the recommendation is ft_jax.tools.plan.recommend.
"""

from __future__ import annotations

import argparse
import json

from ft_jax.cli import arg_types
from ft_jax.cli.trace import COST_MODEL_HELP, add_model_arguments, load_inputs
from ft_jax.cli.usage import HelpFormatter, UsageError
from ft_jax.memory import budget_slots
from ft_jax.tools import plan
from ft_jax.tools.multi_device import check_devices
from ft_jax.tools.report import format_table, report
from ft_jax.units import format_bytes, parse_bytes

DEFAULT_CANDIDATES = "auto,qstar,fetch-all,host-all,fixed-cap:1,fixed-cap:2"


def observed_figures(text: str) -> dict:
    """--observed: "POLICY@SLOTS=MS[,...]" -> {(policy name, slots): ms}. Raises argparse.ArgumentTypeError."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, at, rest = item.partition("@")
        slots, eq, ms = rest.partition("=")
        try:
            key, value = (name.strip(), int(slots)), float(ms)
        except ValueError:
            key = value = None
        if not (at and eq and key and key[0] and key[1] >= 1 and value is not None and value > 0):
            raise argparse.ArgumentTypeError(f"expected POLICY@SLOTS=MS (e.g. qstar@64=12.5), got {item!r}")
        out[key] = value
    return out


def add_plan_arguments(sub) -> None:
    """Register `ft-jax plan` on the CLI's subparsers."""
    policies = arg_types.policy_list("--candidates")

    p = sub.add_parser("plan", help="recommend a policy and cache size for a device memory budget from a trace",
                       formatter_class=HelpFormatter,
                       epilog=COST_MODEL_HELP, description=plan.__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("trace", nargs="+", metavar="TRACE", help="routing trace file(s) (JSON lines or .npz)")
    p.add_argument("--device-memory", type=arg_types.byte_text, required=True, metavar="BYTES",
                   help="device memory for expert slots, e.g. 24GiB (of each device with --devices)")
    p.add_argument("--devices", type=arg_types.positive_int, default=1, metavar="N",
                   help="model N devices of expert parallelism (each owns E/N experts of every layer, with its own "
                        "cache and link; see below), and state one device's figure beside it (default 1)")
    p.add_argument("--candidates", type=policies, default=policies(DEFAULT_CANDIDATES), metavar="LIST",
                   help=f"policies to compare (default {DEFAULT_CANDIDATES})")
    p.add_argument("--observed", type=observed_figures, default={}, metavar="LIST",
                   help="measured MoE ms per token to state beside the modelled ones: POLICY@SLOTS=MS[,...] "
                        "(e.g. from ft-jax generate --json at that policy and cache size)")
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the recommendation")


def run_plan(args) -> int:
    """`ft-jax plan`: returns the exit status; bad input raises ValueError / OSError."""
    trace, model = load_inputs(args)
    try:  # generate's check (and message): a budget that holds no expert slot is refused
        budget_slots(args.device_memory, model.expert_bytes)
    except ValueError as e:
        raise UsageError(f"--device-memory: {e}") from None
    if args.devices > 1:
        check_devices(trace, args.devices)
    rec = plan.recommend(trace, model, parse_bytes(args.device_memory), args.candidates, carry_cache=args.carry_cache,
                         batch=args.batch, observed=args.observed, devices=args.devices,
                         host_sockets=min(args.host_sockets, args.devices), allreduce_ms=args.allreduce_ms)
    rep = report(trace, model, rec["results"], args.carry_cache, args.batch)
    if args.json:
        print(json.dumps({**rep, **{k: v for k, v in rec.items() if k != "results"}}, indent=1))
        return 0
    best = rec["best"]
    total = trace.num_layers * trace.num_experts // args.devices
    if rec["resident"]:
        print(f"recommendation: --policy resident: the budget holds {rec['budget_slots']} experts, all {total} fit "
              f"({best['ms_per_token']:.2f} ms/token modelled, hits only)")
    elif best["policy"] == "host-all":  # it never fills a slot: no cache size to give
        where = (" (a CPU device: a slot would be a copy in the same memory, read by the same cores)"
                 if model.serial_paths else "")
        print(f"recommendation: --policy host-all, no slots: every expert on the CPU{where}: "
              f"{best['ms_per_token']:.2f} ms/token modelled")
    else:
        size = format_bytes(best["cache_slots"] * model.expert_bytes)
        each = f" on each of {args.devices} devices" if args.devices > 1 else ""
        print(f"recommendation: --policy {best['policy']} --cache-slots {best['cache_slots']} ({size}{each}, "
              f"{100 * best['cache_slots'] / total:.1f}% of the {total} experts of a device; budget "
              f"{rec['budget_slots']} slots): {best['ms_per_token']:.2f} ms/token modelled, hit rate "
              f"{100 * best['hit_rate']:.1f}%")
    if args.devices > 1:
        one = rec["one_device"]
        print(f"  one device with the same budget: --policy {one['policy']} --cache-slots {one['cache_slots']}: "
              f"{one['ms_per_token']:.2f} ms/token modelled ({one['ms_per_token'] / best['ms_per_token']:.2f}x the "
              f"{args.devices} devices' time)")
    if rec["added_candidates"]:
        print(f"  ({', '.join(rec['added_candidates'])} added to the candidates: the CPU device's default)")
    if rec["dropped_candidates"]:
        why = ("a CPU device's slots would be a second copy of every expert in the same memory" if model.serial_paths
               else f"it needs all {total} experts of a device in slots, the budget holds {rec['budget_slots']}")
        print(f"  (resident left out of the candidates: {why})")
    for alt in sorted(rec["alternatives"], key=lambda a: a["speedup"]):
        if alt["speedup"] < 1.0005:  # equal to the printed digits: e.g. qstar and auto taking the same fills
            print(f"  ties  {alt['policy']:<16} ({alt['ms_per_token']:.2f} ms/token)")
        else:
            print(f"  beats {alt['policy']:<16} ({alt['ms_per_token']:.2f} ms/token) by {alt['speedup']:.3f}x")
    for o in rec["observed"]:
        modelled = "not replayed" if o["modelled_ms"] is None else f"{o['modelled_ms']:.2f} ms/token modelled"
        r = o["modelled_over_observed"]
        ratio = "" if r is None else f" (modelled / observed {r:.3f})"
        print(f"  {o['policy']} at {o['cache_slots']} slots: {modelled}, {o['observed_ms']:.2f} observed{ratio}")
    print()
    print(format_table(rep))
    return 0
