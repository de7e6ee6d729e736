#!/usr/bin/env python3
"""The issue-14 targets on a routing trace: auto's modelled ms/token against the pure policies.

For every trace file (each replayed on its own), bandwidth (the presets of ft_jax.offload.cost_model and, with --profile or
a stored profile, this machine's) and cache fraction, replays fetch-all, host-all, qstar, fixed-cap:1 and auto
through the decode step's cache plan and prints auto / best pure policy (target <= 1.02) and auto / qstar (target
<= 0.85 somewhere), then the per-case ratio table of every trace and the worst ratio. No timing: the figures are
the cost model's (docs/policies.md), deterministic for a given trace and profile.

    python3 scripts/trace_targets.py ../shared/traces/mixtral_8x7b_humaneval/humaneval_2_routing.jsonl \\
        --expert-bytes 352321536
    python3 scripts/trace_targets.py /tmp/syn/*.jsonl --expert-bytes 17301504     # scripts/synthetic_traces.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ft_jax.offload.cost_model import PRESETS
from ft_jax.offload.policy import parse_policy
from ft_jax.offload.profile import cost_model_for
from ft_jax.tools.replay import evaluate
from ft_jax.tools.trace_io import read_trace

PURE = ("fetch-all", "host-all", "qstar", "fixed-cap:1")


def targets(path: str, expert_bytes: int, fractions, bandwidths, profile=None, host_fixed_ms: float = 0.0,
            echo=print) -> list[dict]:
    """One row per (bandwidth, cache fraction) of one trace file: every policy's ms/token, the best pure policy,
    auto / best and auto / qstar. A bandwidth spec that cannot be priced (no stored profile) is skipped with a
    message on stderr."""
    trace = read_trace(path)
    total = trace.num_layers * trace.num_experts
    sizes = [max(1, round(float(f) * total)) for f in fractions]
    policies = [parse_policy(n) for n in PURE + ("auto",)]
    rows = []
    for spec in bandwidths:
        try:
            model = cost_model_for(spec, expert_bytes, profile_path=profile, host_fixed_ms=host_fixed_ms)
        except ValueError as e:
            print(f"skipping {spec}: {e}", file=sys.stderr)
            continue
        for r_size in sizes:
            res = {r["policy"]: r for r in evaluate(trace, policies, [r_size], model)}
            best = min(PURE, key=lambda n: res[n]["ms_per_token"])
            auto = res["auto"]["ms_per_token"]
            rows.append({"trace": path, "bandwidth": spec, "cache_slots": r_size, "cache_fraction": r_size / total,
                         **{n: res[n]["ms_per_token"] for n in PURE + ("auto",)}, "best_pure": best,
                         "auto_vs_best": auto / res[best]["ms_per_token"],
                         "auto_vs_qstar": auto / res["qstar"]["ms_per_token"],
                         "auto_hit_rate": res["auto"]["hit_rate"]})
            r = rows[-1]
            echo(f"{os.path.basename(path):<26} {spec:<16} {r_size:>5} ({r['cache_fraction']:.2f})  " +
                 "  ".join(f"{n} {r[n]:.2f}" for n in PURE + ("auto",)) +
                 f"  auto/best {r['auto_vs_best']:.3f} ({best})  auto/qstar {r['auto_vs_qstar']:.3f}")
    return rows


def ratio_table(rows: list[dict]) -> str:
    """auto / best pure policy per (trace, bandwidth) row and cache-fraction column, a * where it exceeds 1.02."""
    fracs = sorted({round(r["cache_fraction"], 2) for r in rows})
    lines = [f"{'trace':<26} {'bandwidth':<16} " + " ".join(f"{f'{100 * f:.0f}%':>8}" for f in fracs)]
    for key in dict.fromkeys((r["trace"], r["bandwidth"]) for r in rows):
        cells = {round(r["cache_fraction"], 2): r["auto_vs_best"] for r in rows if (r["trace"], r["bandwidth"]) == key}
        lines.append(f"{os.path.basename(key[0]):<26} {key[1]:<16} " + " ".join(
            f"{cells[f]:>7.3f}{'*' if cells[f] > 1.02 else ' '}" if f in cells else f"{'-':>8}" for f in fracs))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="+", help="routing trace files, each replayed on its own")
    p.add_argument("--expert-bytes", type=int, required=True, help="bytes of one expert (> 0)")
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="cache sizes as fractions of L*E, each in (0, 1]")
    p.add_argument("--bandwidths", default=",".join(PRESETS) + ",stored",
                   help="comma list of --bandwidth specs ('stored' is skipped when this machine has no profile)")
    p.add_argument("--profile", help="bandwidth profile store for 'stored'")
    p.add_argument("--host-fixed-ms", type=float, default=0.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.expert_bytes < 1:
        p.error(f"--expert-bytes must be > 0, got {args.expert_bytes}")
    try:
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        p.error(f"--fractions: expected numbers in (0, 1] separated by commas, got {args.fractions!r}")
    if not all(0.0 < f <= 1.0 for f in fractions):
        p.error(f"--fractions: each must be in (0, 1], got {args.fractions!r}")
    if args.profile is not None and not os.path.isfile(args.profile):
        p.error(f"--profile {args.profile}: no such file")
    rows = []
    try:
        for path in args.trace:
            rows += targets(path, args.expert_bytes, args.fractions.split(","), args.bandwidths.split(","),
                            args.profile, args.host_fixed_ms, echo=lambda line: print(line, flush=True))
    except (ValueError, OSError) as e:  # a trace that cannot be read: one line
        print(f"trace_targets: error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("no case could be priced", file=sys.stderr)
        return 1
    print("\nauto / best of " + ", ".join(PURE) + " (* above 1.02):")
    print(ratio_table(rows))
    worst = max(rows, key=lambda r: r["auto_vs_best"])
    ok = worst["auto_vs_best"] <= 1.02 and any(r["auto_vs_qstar"] <= 0.85 for r in rows)
    print(f"targets {'met' if ok else 'NOT met'}: auto/best <= 1.02 everywhere (worst {worst['auto_vs_best']:.3f}: "
          f"{os.path.basename(worst['trace'])}, {worst['bandwidth']}, {100 * worst['cache_fraction']:.0f}%, vs "
          f"{worst['best_pure']}), auto/qstar <= 0.85 somewhere (min {min(r['auto_vs_qstar'] for r in rows):.3f})")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
