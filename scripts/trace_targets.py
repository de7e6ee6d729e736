#!/usr/bin/env python3
"""The issue-14 targets on a routing trace: auto's modelled ms/token against the pure policies.

For every bandwidth (the presets of ft_jax.tools.trace and, with --profile or a stored profile, this machine's) and
cache fraction, replays fetch-all, host-all, qstar, fixed-cap:1 and auto through the decode step's cache plan and
prints auto / best pure policy (target <= 1.02) and auto / qstar (target <= 0.85 somewhere). No timing: the
figures are the cost model's (docs/policies.md), deterministic for a given trace and profile.

    python3 scripts/trace_targets.py ../shared/traces/mixtral_8x7b_humaneval/humaneval_2_routing.jsonl \\
        --expert-bytes 352321536
"""

from __future__ import annotations

import argparse
import json
import sys

from ft_jax.offload.policy import parse_policy
from ft_jax.tools import trace as tr

PURE = ("fetch-all", "host-all", "qstar", "fixed-cap:1")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="+")
    p.add_argument("--expert-bytes", type=int, required=True)
    p.add_argument("--fractions", default="0.1,0.25,0.5")
    p.add_argument("--bandwidths", default=",".join(tr.PRESETS) + ",stored",
                   help="comma list of --bandwidth specs ('stored' is skipped when this machine has no profile)")
    p.add_argument("--profile", help="bandwidth profile store for 'stored'")
    p.add_argument("--host-fixed-ms", type=float, default=0.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    trace = tr.read_trace(args.trace)
    total = trace.num_layers * trace.num_experts
    sizes = [max(1, round(float(f) * total)) for f in args.fractions.split(",")]
    policies = [parse_policy(n) for n in PURE + ("auto",)]
    rows = []
    for spec in args.bandwidths.split(","):
        try:
            model = tr.cost_model(spec, args.expert_bytes, profile_path=args.profile, host_fixed_ms=args.host_fixed_ms)
        except ValueError as e:
            print(f"skipping {spec}: {e}", file=sys.stderr)
            continue
        for r_size in sizes:
            res = {r["policy"]: r for r in tr.evaluate(trace, policies, [r_size], model)}
            best = min(PURE, key=lambda n: res[n]["ms_per_token"])
            auto = res["auto"]["ms_per_token"]
            rows.append({"bandwidth": spec, "cache_slots": r_size, "cache_fraction": r_size / total,
                         **{n: res[n]["ms_per_token"] for n in PURE + ("auto",)}, "best_pure": best,
                         "auto_vs_best": auto / res[best]["ms_per_token"], "auto_vs_qstar": auto / res["qstar"]["ms_per_token"],
                         "auto_hit_rate": res["auto"]["hit_rate"]})
            r = rows[-1]
            print(f"{spec:<16} {r_size:>5} ({r['cache_fraction']:.2f})  " +
                  "  ".join(f"{n} {r[n]:.1f}" for n in PURE + ("auto",)) +
                  f"  auto/best {r['auto_vs_best']:.3f} ({best})  auto/qstar {r['auto_vs_qstar']:.3f}", flush=True)
    ok = all(r["auto_vs_best"] <= 1.02 for r in rows) and any(r["auto_vs_qstar"] <= 0.85 for r in rows)
    print(f"targets {'met' if ok else 'NOT met'}: auto/best <= 1.02 everywhere "
          f"(max {max(r['auto_vs_best'] for r in rows):.3f}), auto/qstar <= 0.85 somewhere "
          f"(min {min(r['auto_vs_qstar'] for r in rows):.3f})")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
