#!/usr/bin/env python3
"""The wider evaluation set of issue 21: auto against the best single policy on generated routing traces.

Every setting = family (scripts/synthetic_traces.py: uniform, skewed, reused, local, drift) x experts/top-k
(8/2, 60/4, 64/8, 128/8, 256/8) x bandwidth (the FreeToken presets, this machine's stored profile if there is
one -- skipped with a note otherwise --, and two invented extremes: PCIe 10x faster than the host GEMV, "fast-pcie"
= 1000,100 GB/s, and 10x slower, "slow-pcie" = 10,100 GB/s) x cache (5, 10, 25, 50, 75 % of L x E slots) x seed.
Each trace is one long generation: its sequences are replayed one after another with the cache carried
(--carry-cache), through the decode step's own cache plan (ft_jax.tools.replay.replay, what `evaluate` runs) and
priced with ft_jax.offload.cost_model. Policies whose replay does not depend on the bandwidth (fetch-all, host-all,
fixed-cap:1) are replayed once per (trace, cache) and priced under every bandwidth.

Seeds are split: the tuning seeds (default 0) and the held-out seeds (default 1, 2 in the full set, 1 in --quick),
reported separately. The full set: 8 MoE layers, 4 sequences x 500 tokens = 2000 carried tokens per trace. --quick:
2 x 150 tokens (a few minutes on a 2-core machine; most of it is compiling one replay step per bound policy and
cache size).

    python3 scripts/eval_auto.py --quick --json /tmp/eval.json
    python3 scripts/eval_auto.py --json /tmp/eval_full.json          # the full set (tens of minutes)

Output: a table of auto / best-of(fetch-all, host-all, qstar, fixed-cap:1) per setting (one row per trace and
bandwidth, one column per cache), the five worst settings of each seed group, the targets (auto <= 1.02x the best
in every setting; <= 0.85x qstar somewhere) and, with --json, every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from synthetic_traces import SHAPES, generate, records  # noqa: E402  (scripts/ is not a package)

from ft_jax.offload.policy import bind_policy, parse_policy  # noqa: E402
from ft_jax.offload.profile import cost_model_for  # noqa: E402
from ft_jax.tools.replay import replay, summarize  # noqa: E402
from ft_jax.tools.trace_io import read_trace, write_trace  # noqa: E402

PURE = ("fetch-all", "host-all", "qstar", "fixed-cap:1")
# (experts, top-k, bytes per expert in bf16: gate + up + down of the model this shape stands for)
MODELS = {
    "8x2": (8, 2, 352321536),  # Mixtral-8x7B: 3 x 4096 x 14336 x 2
    "60x4": (60, 4, 17301504),  # Qwen1.5-MoE-A2.7B: 3 x 2048 x 1408 x 2
    "64x8": (64, 8, 12582912),  # OLMoE-1B-7B: 3 x 2048 x 1024 x 2
    "128x8": (128, 8, 9437184),  # Qwen3-30B-A3B: 3 x 2048 x 768 x 2
    "256x8": (256, 8, 88080384),  # DeepSeek-V3: 3 x 7168 x 2048 x 2
}
BANDWIDTHS = {"sapphire-rapids": "sapphire-rapids", "xeon-6526y": "xeon-6526y", "stored": "stored",
              "fast-pcie": "1000,100", "slow-pcie": "10,100"}
FRACTIONS = (0.05, 0.10, 0.25, 0.50, 0.75)


def make_trace(family: str, model: str, seed: int, layers: int, sequences: int, tokens: int, tmp: str):
    E, k, _ = MODELS[model]
    routing = generate(family, num_layers=layers, num_experts=E, top_k=k, sequences=sequences, tokens=tokens,
                       seed=seed)
    path = os.path.join(tmp, f"{family}_{model}_{seed}.npz")
    write_trace(path, records(family, routing))
    return read_trace(path)


def evaluate_trace(trace, family, model, seed, cost_models, fractions) -> list[dict]:
    """One row per (bandwidth, cache fraction) of one trace: each policy's modelled ms/token and auto's ratios."""
    total = trace.num_layers * trace.num_experts
    rows = []
    for frac in fractions:
        S = max(1, round(frac * total))
        shared = {n: replay(trace, parse_policy(n), S, carry_cache=True).stats for n in ("fetch-all", "host-all",
                                                                                         "fixed-cap:1")}
        for bw, model_ in cost_models.items():
            ms = {n: summarize(st, model_)["ms_per_token"] for n, st in shared.items()}
            hit = {}
            for n in ("qstar", "auto"):
                s = summarize(replay(trace, bind_policy(parse_policy(n), model_), S, carry_cache=True).stats, model_)
                ms[n], hit[n] = s["ms_per_token"], s["hit_rate"]
            best = min(PURE, key=lambda n: ms[n])
            rows.append({"family": family, "model": model, "seed": seed, "bandwidth": bw, "cache_fraction": frac,
                         "cache_slots": S, **ms, "best_pure": best, "auto_vs_best": ms["auto"] / ms[best],
                         "auto_vs_qstar": ms["auto"] / ms["qstar"], "auto_hit_rate": hit["auto"]})
    return rows


def ratio_table(rows: list[dict], fractions) -> str:
    lines = [f"{'family':<8} {'model':<6} {'seed':>4} {'bandwidth':<16} " +
             " ".join(f"{f'{100 * f:.0f}%':>8}" for f in fractions)]
    keys = dict.fromkeys((r["family"], r["model"], r["seed"], r["bandwidth"]) for r in rows)
    for key in keys:
        cells = {r["cache_fraction"]: r["auto_vs_best"] for r in rows
                 if (r["family"], r["model"], r["seed"], r["bandwidth"]) == key}
        lines.append(f"{key[0]:<8} {key[1]:<6} {key[2]:>4} {key[3]:<16} " + " ".join(
            f"{cells[f]:>7.3f}{'*' if cells[f] > 1.02 else ' '}" if f in cells else f"{'-':>8}" for f in fractions))
    return "\n".join(lines)


def compact_table(rows: list[dict]) -> str:
    """Markdown: the worst auto / best over families, caches and seeds, per experts/top-k and bandwidth."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    bws = list(dict.fromkeys(r["bandwidth"] for r in rows))
    lines = ["| bandwidth | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for bw in bws:
        cells = [max((r["auto_vs_best"] for r in rows if r["model"] == m and r["bandwidth"] == bw), default=None)
                 for m in models]
        lines.append(f"| {bw} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


def worst(rows: list[dict], n: int = 5) -> str:
    out = []
    for r in sorted(rows, key=lambda r: -r["auto_vs_best"])[:n]:
        out.append(f"  {r['auto_vs_best']:.3f}  {r['family']} {r['model']} seed {r['seed']} {r['bandwidth']} "
                   f"{100 * r['cache_fraction']:.0f}%: auto {r['auto']:.3f} ms vs {r['best_pure']} "
                   f"{r[r['best_pure']]:.3f} (qstar {r['qstar']:.3f})")
    return "\n".join(out)


def summary(name: str, rows: list[dict]) -> str:
    if not rows:
        return f"{name}: no rows"
    w = max(r["auto_vs_best"] for r in rows)
    q = min(r["auto_vs_qstar"] for r in rows)
    over = sum(r["auto_vs_best"] > 1.02 for r in rows)
    mean = sum(r["auto_vs_best"] for r in rows) / len(rows)
    return (f"{name}: {len(rows)} settings, auto/best worst {w:.3f}, mean {mean:.3f}, {over} above 1.02; "
            f"auto/qstar min {q:.3f}\n  five worst:\n{worst(rows)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 x 150 tokens per trace, one held-out seed")
    p.add_argument("--families", default=",".join(SHAPES))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--bandwidths", default=",".join(BANDWIDTHS))
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS))
    p.add_argument("--tune-seeds", default="0")
    p.add_argument("--held-out-seeds", help="default 1,2 (--quick: 1); '' for none")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sequences", type=int, help="sequences per trace, replayed with the cache carried "
                                                  "(default 4; --quick 2)")
    p.add_argument("--tokens", type=int, help="tokens per sequence (default 500; --quick 150)")
    p.add_argument("--profile", help="bandwidth profile store of the 'stored' bandwidth (default: the user cache "
                                     "directory's, written by `ft-jax profile`)")
    p.add_argument("--json", help="write every row (and the notes) to this file")
    p.add_argument("--from-json", help="print the tables of a previous --json file (no replay)")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        for group in ("tune", "held-out"):
            rows = [r for r in saved["rows"] if r["group"] == group]
            print(summary(f"{group} seeds", rows))
            print(compact_table(rows) + "\n")
        return 0
    sequences = args.sequences or (2 if args.quick else 4)
    tokens = args.tokens or (150 if args.quick else 500)
    held = args.held_out_seeds if args.held_out_seeds is not None else ("1" if args.quick else "1,2")
    seeds = [(int(s), "tune") for s in args.tune_seeds.split(",")] + [(int(s), "held-out") for s in held.split(",") if s]
    fractions = [float(f) for f in args.fractions.split(",")]
    notes, rows, t0 = [], [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            cost_models = {}
            for bw in args.bandwidths.split(","):
                try:
                    cost_models[bw] = cost_model_for(BANDWIDTHS.get(bw, bw), MODELS[model][2], profile_path=args.profile)
                except ValueError as e:
                    notes.append(f"{model}: bandwidth {bw} skipped: {e}")
                    print(notes[-1], file=sys.stderr)
            for family in args.families.split(","):
                for seed, group in seeds:
                    trace = make_trace(family, model, seed, args.layers, sequences, tokens, tmp)
                    for r in evaluate_trace(trace, family, model, seed, cost_models, fractions):
                        rows.append({**r, "group": group})
                    print(f"[{time.time() - t0:6.0f} s] {family} {model} seed {seed}: worst auto/best "
                          f"{max(r['auto_vs_best'] for r in rows[-len(cost_models) * len(fractions):]):.3f}",
                          file=sys.stderr, flush=True)
    print(f"auto / best of {', '.join(PURE)} (* above 1.02); {args.layers} MoE layers, {sequences} x {tokens} "
          f"tokens carried per trace")
    print(ratio_table(rows, fractions))
    for group in ("tune", "held-out"):
        print(summary(f"\n{group} seeds", [r for r in rows if r["group"] == group]))
        print(f"worst auto / best per experts x top-k and bandwidth ({group} seeds):")
        print(compact_table([r for r in rows if r["group"] == group]))
    ok = all(r["auto_vs_best"] <= 1.02 for r in rows) and any(r["auto_vs_qstar"] <= 0.85 for r in rows)
    print(f"\ntargets {'met' if ok else 'NOT met'} (auto/best <= 1.02 everywhere, auto/qstar <= 0.85 somewhere)")
    for n in notes:
        print("note:", n)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "notes": notes, "layers": args.layers, "sequences": sequences,
                       "tokens": tokens, "seconds": time.time() - t0}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
