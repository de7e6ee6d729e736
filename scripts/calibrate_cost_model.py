#!/usr/bin/env python3
"""Hold the cost model against the running engine on the CPU backend (issue 21, item 3).

For each policy (fetch-all, host-all, qstar, auto) at three cache sizes on the Mixtral-shaped bench model
(scripts/synthetic_checkpoint.py's default: 8 layers, 8 experts top-2, hidden 2048, intermediate 5632, bf16; 66 MiB
experts):

1. a real generation, Engine.generate(record_routing=True) (what `ft-jax generate --record-trace` runs): its routing
   is written as a routing trace (trace_io.write_trace) and its decode ms per token is timed;
2. the same routing through the MoE layers alone: the engine's own OffloadedExperts (cache plan, slot_fill,
   host_experts, slot_experts) in a scan over the MoE layers, each layer's input depending on the previous one's
   output, from the cache state the generation's decode started from: the measured MoE ms per token;
3. the dense part = decode - MoE (attention, norms, router, lm_head, sampling): it does not depend on the policy, so
   its spread over the runs checks the split;
4. the trace read back and replayed through the cost model (ft_jax.tools.replay: what `ft-jax trace` / `ft-jax plan`
   run) from that same state, priced with the bandwidth profile measured at the start of this run and stored
   (`ft-jax profile`: BP, BH, the contended pair and the per-call costs, Profile.fixed_costs), timed on the loaded
   model's own banks (measure_profile's model_banks: the checkpoint's mapped pages, as the engine reads them), with
   BP and BH the medians of the profile's own loops timed again after every run: the modelled MoE ms per token.
   A shared VM's memory bandwidth drifts by up to +-25 % over minutes (one process timed the same host_experts scan at
   38.7-65 ms per token), so one profile at the start prices the runs at another moment's speed; its figures are
   printed beside ("start").

Printed: for every policy and cache size the replayed hit and fetch counts against the engine's own counters
(equal: the replay starts from the state the decode started from), the modelled ms per token, and the ratio modelled /
measured against both measures, the MoE layers alone ("MoE alone") and the decode step minus the median dense part
("decode-dense"); each "start" column is the same ratio with the replay priced by the start profile instead. The
verdict (target 0.85-1.15 for every policy and cache size) is taken on modelled / (decode - dense), the MoE layers'
share of the real decode step. Then the `ft-jax plan --observed` figures. The variants alternate over --rounds (the
median is reported); the load average is printed with every round. A run of the defaults takes about 15 minutes on
a 2-core machine and needs the model's 4.9 GB in the page cache plus up to 48 slots of 66 MiB (3.2 GB). Run it with
nothing else running:

    python3 scripts/calibrate_cost_model.py --model DIR
    python3 scripts/calibrate_cost_model.py --make-model /tmp/mixtral_8l --tokens 24 --rounds 1 \\
        --json /tmp/calibration.json

--make-model DIR writes the bench model there first unless DIR already holds one (4.9 GB; scripts/bench_peer.py
keeps the same model under ~/.cache/ft_jax/bench_peer/models/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import synthetic_checkpoint  # noqa: E402  (scripts/ is not a package)
from ft_jax.checkpoint import load_checkpoint  # noqa: E402
from ft_jax.engine.engine import Engine  # noqa: E402
from ft_jax.offload import profile as bandwidth  # noqa: E402
from ft_jax.offload.cache import STAT_FIELDS  # noqa: E402
from ft_jax.offload.experts import OffloadedExperts, OffloadState  # noqa: E402
from ft_jax.offload.policy import parse_policy  # noqa: E402
from ft_jax.tools.replay import replay, summarize  # noqa: E402
from ft_jax.tools.trace_io import read_trace, routing_records, write_trace  # noqa: E402

POLICIES = ("fetch-all", "host-all", "qstar", "auto")
FRACTIONS = (0.25, 0.5, 0.75)
LOW, HIGH = 0.85, 1.15  # the target band of modelled / measured


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def moe_only_run(backend: OffloadedExperts):
    """jit: (OffloadState, x bf16[1, H], ids i32[N, L, 1, k], weights f32[N, L, 1, k]) -> (OffloadState, y): N tokens
    through the MoE layers alone, as the decode step runs them (a lax.scan over the tokens of a lax.scan over the
    layers, layer index traced); each layer's input is x plus a negligible multiple of the previous layer's output,
    so the layers run one after another as in the model."""
    def run(state, x, ids, weights):
        def layer(carry, xs):
            state, h = carry
            index, layer_ids, layer_weights = xs
            y, state = backend(index, h, layer_ids, layer_weights, state)
            return (state, (h.astype(jnp.float32) + 1e-30 * y).astype(h.dtype)), None

        def token(carry, xs):
            token_ids, token_weights = xs
            L = token_ids.shape[0]
            return jax.lax.scan(layer, carry, (jnp.arange(L, dtype=jnp.int32), token_ids, token_weights))[0], None

        return jax.lax.scan(token, (state, x), (ids, weights))[0]

    return jax.jit(run, donate_argnums=0)


def time_moe(backend: OffloadedExperts, state, x, ids: np.ndarray, weights: np.ndarray, repeats: int = 3) -> float:
    """ms per token of the MoE layers alone over the recorded routing ids i32[N, L, 1, k] (weights f32[N, L, 1, k]):
    one compiled call for all N tokens (compiled ahead, not timed), so no per-token dispatch is counted; the median
    of ``repeats`` calls, each from the same starting state (a single call of ~1.5 s varied by +-15 % on the 2-core
    VM: DESIGN.md sec. 19.6)."""
    args = (x, jnp.asarray(ids), jnp.asarray(weights))
    compiled = moe_only_run(backend).lower(state, *args).compile()
    times = []
    for _ in range(repeats):
        start = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, state))  # the call donates its state
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(start, *args))
        times.append((time.perf_counter() - t0) / ids.shape[0] * 1e3)
    return statistics.median(times)


def one_run(checkpoint, policy, slots: int, prompt: list[int], tokens: int, trace_path: str, cost_model) -> dict:
    """One (policy, cache size): generate, MoE alone, replay priced by the cost model (module docstring). The result
    keeps the replayed stats (i64[N, L, 5]) to be priced again with the run's median bandwidths."""
    engine = Engine(checkpoint, policy=policy, num_slots=slots)
    backend = engine.decode_backend
    engine.generate([prompt], max_new_tokens=1)  # prefill only: compiles it; the state the decode starts from
    start = jax.tree_util.tree_map(jnp.array, engine.expert_state.cache)  # a copy (the next step donates it)
    engine.expert_state = backend.init_state(slots)
    engine.generate([prompt], max_new_tokens=2)  # compiles the decode step
    engine.expert_state = backend.init_state(slots)
    out = engine.generate([prompt], max_new_tokens=tokens + 1, record_routing=True)
    stats = out.stats
    decode_ms = stats["decode_s"] / stats["decode_tokens"] * 1e3
    ids, weights = out.routing  # i32[N, L, 1, k], f32[N, L, 1, k]
    write_trace(trace_path, routing_records(ids, weights))
    engine_counts = np.asarray([stats["per_layer"][f] for f in STAT_FIELDS[:5]]).sum(axis=1)  # i64[5]
    del engine, out

    trace = read_trace([trace_path])
    replayed = replay(trace, policy, slots, initial_state=start)
    modelled = summarize(replayed.stats, cost_model)
    replay_counts = replayed.stats.sum(axis=(0, 1))  # i64[5]

    pools = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in backend.banks.pool_shapes(slots).items()}
    state = OffloadState(start, pools, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    H = checkpoint.config.hidden_size
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, H)) * 0.1, jnp.bfloat16)  # bf16[1, H]
    moe_ms = time_moe(backend, state, x, ids, weights)
    return {"decode_ms": decode_ms, "moe_ms": moe_ms, "start_modelled_ms": modelled["ms_per_token"],
            "replayed_stats": replayed.stats,
            "hit_rate": modelled["hit_rate"], "fetched_per_token": modelled["fetched_per_token"],
            "host_per_token": modelled["host_per_token"], "counts_equal": bool(np.array_equal(engine_counts,
                                                                                             replay_counts)),
            "engine_counts": engine_counts.tolist(), "replay_counts": replay_counts.tolist()}


def table(results: list[dict]) -> str:
    """The calibration table: per (policy, slots) the replayed counts, the modelled ms per token (priced with the
    run's median BP and BH; "start": with the profile measured at the start), the measured MoE-alone and decode -
    dense ms per token, and the ratios modelled / measured."""
    dense = statistics.median(r["decode_ms"] - r["moe_ms"] for r in results)
    lines = [f"{'policy':<10} {'slots':>5} {'hit':>6} {'fetch/t':>7} {'host/t':>6} {'modelled':>9} {'MoE alone':>9} "
             f"{'ratio':>6} {'start':>6} {'decode':>8} {'decode-dense':>12} {'ratio':>6} {'start':>6} {'counts':>6}"]
    for r in results:
        measured = r["decode_ms"] - dense
        lines.append(
            f"{r['policy']:<10} {r['slots']:>5} {r['hit_rate']:6.3f} {r['fetched_per_token']:7.2f} "
            f"{r['host_per_token']:6.2f} {r['modelled_ms']:9.2f} {r['moe_ms']:9.2f} {r['modelled_ms'] / r['moe_ms']:6.3f} "
            f"{r['start_modelled_ms'] / r['moe_ms']:6.3f} {r['decode_ms']:8.2f} {measured:12.2f} "
            f"{r['modelled_ms'] / measured:6.3f} {r['start_modelled_ms'] / measured:6.3f} "
            f"{'equal' if r['counts_equal'] else 'DIFFER':>6}")
    spread = [r["decode_ms"] - r["moe_ms"] for r in results]
    lines.append(f"dense part (decode - MoE alone): median {dense:.2f} ms/token, range [{min(spread):.2f}, "
                 f"{max(spread):.2f}]; times are ms per token; ratio = modelled / measured (start: priced with the "
                 f"profile measured at the start)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="the bench model folder (scripts/synthetic_checkpoint.py)")
    where.add_argument("--make-model", metavar="DIR", help="write the bench model to DIR first (unless it is there)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated policies to run (default {','.join(POLICIES)})")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS),
                   help=f"comma-separated cache sizes, fractions of the L x E experts (default "
                        f"{','.join(f'{f:g}' for f in FRACTIONS)})")
    p.add_argument("--tokens", type=int, default=32, help="decode tokens timed per run (default 32)")
    p.add_argument("--prompt-len", type=int, default=4, help="prompt tokens (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over all variants (default 2; median reported)")
    p.add_argument("--profile", help="profile store to write the fresh profile to (default: a temporary file; the "
                                     "user's own store is left alone)")
    p.add_argument("--json", help="write every run to this file")
    args = p.parse_args(argv)

    path = args.model or args.make_model
    if args.make_model and not os.path.isfile(os.path.join(path, "config.json")):
        log(f"writing the bench model to {path}")
        synthetic_checkpoint.write_checkpoint(path, synthetic_checkpoint.mixtral_config(), progress=True)
    log(f"loading {path}; {load_average()}")
    checkpoint = load_checkpoint(path, dtype=jnp.bfloat16)
    cfg, banks = checkpoint.config, checkpoint.banks
    total = banks.num_rows
    store = args.profile or os.path.join(tempfile.mkdtemp(prefix="ft_jax_calibration_"), "profiles.json")
    log(f"measuring the bandwidth profile (full) at H={cfg.hidden_size}, I={cfg.moe_intermediate_size}; "
        f"{load_average()}")
    prof = bandwidth.measure_profile(cfg.hidden_size, cfg.moe_intermediate_size, "bfloat16", model_banks=banks)
    bandwidth.save_profile(prof, store)
    log(f"profile: {prof.summary()}; {load_average()}")
    model = bandwidth.cost_model_for("stored", banks.expert_bytes, profile_path=store)
    log(f"cost model: {model.describe()}")
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, cfg.vocab_size, args.prompt_len)]
    variants = []
    for name in args.policies.split(","):
        policy, _ = bandwidth.resolve_policy(name, banks, cfg.hidden_size, cfg.moe_intermediate_size, profile=store,
                                             measure=False)
        for f in (float(x) for x in args.fractions.split(",")):
            variants.append((name, policy, max(1, round(f * total))))
    runs: dict[tuple, list[dict]] = {}
    rates: dict[str, list[float]] = {"bp": [], "bh": []}  # timed after every run
    mode = bandwidth.MODES["full"]
    with tempfile.TemporaryDirectory() as tmp, bandwidth.Bench(
            cfg.hidden_size, cfg.moe_intermediate_size, "bfloat16", call_bytes=mode["call_bytes"],
            model_banks=bandwidth.rotatable_banks(banks, cfg.hidden_size, cfg.moe_intermediate_size, "bfloat16",
                                                  mode["call_bytes"])) as bench:
        for rnd in range(args.rounds):
            log(f"round {rnd + 1}/{args.rounds}: {load_average()}")
            for i, (name, policy, slots) in enumerate(variants):
                r = one_run(checkpoint, policy, slots, prompt, args.tokens, os.path.join(tmp, f"trace_{i}.jsonl"),
                            model)
                runs.setdefault((name, slots), []).append(r)
                beside = bandwidth.measure_rates({"bp": (bench.fill, bench.nbytes), "bh": (bench.gemv, bench.nbytes)},
                                                 3, mode["min_time"])
                for key in rates:
                    rates[key].append(beside[key][0])
                log(f"  {name} at {slots} slots: decode {r['decode_ms']:.1f}, MoE alone {r['moe_ms']:.1f}, modelled "
                    f"with the start profile {r['start_modelled_ms']:.1f} ms/token; then BP {beside['bp'][0]:.1f}, "
                    f"BH {beside['bh'][0]:.1f} GB/s; {load_average()}")
        # The run's profile: the start profile with the median BP and BH of the loops timed after every run.
        run_prof = dataclasses.replace(prof, bp=statistics.median(rates["bp"]), bh=statistics.median(rates["bh"]))
        run_store = os.path.join(tmp, "run_profile.json")
        bandwidth.save_profile(run_prof, run_store)
        run_model = bandwidth.cost_model_for("stored", banks.expert_bytes, profile_path=run_store)
    results = []
    for (name, slots), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("decode_ms", "moe_ms", "start_modelled_ms")}
        modelled = statistics.median(summarize(r["replayed_stats"], run_model)["ms_per_token"] for r in rs)
        results.append({**{k: v for k, v in rs[0].items() if k != "replayed_stats"}, **med, "modelled_ms": modelled,
                        "policy": name, "slots": slots, "rounds": len(rs)})
    print(f"cost model against the engine: {cfg.num_moe_layers} MoE layers, {cfg.num_experts} experts top-"
          f"{cfg.top_k}, {banks.expert_bytes / 2**20:.1f} MiB experts, {args.tokens} decode tokens, median of "
          f"{args.rounds} rounds; {load_average()}")
    print(f"start profile: {prof.summary()}")
    print(f"BP / BH timed after each of the {len(rates['bh'])} runs: median {run_prof.bp:.2f} / {run_prof.bh:.2f} GB/s, "
          f"range [{min(rates['bp']):.2f}, {max(rates['bp']):.2f}] / [{min(rates['bh']):.2f}, {max(rates['bh']):.2f}]"
          f"; the modelled column prices the replays with these medians")
    print(table(results))
    dense = statistics.median(r["decode_ms"] - r["moe_ms"] for r in results)
    ok = all(LOW <= r["modelled_ms"] / (r["decode_ms"] - dense) <= HIGH for r in results)
    print(f"target {LOW}-{HIGH} for every policy and cache size: {'met' if ok else 'NOT met'}")
    for slots in sorted({r["slots"] for r in results}):
        observed = ",".join(f"{r['policy']}@{slots}={r['decode_ms'] - dense:.2f}" for r in results
                            if r["slots"] == slots)
        print(f"  ft-jax plan TRACE --model {path} --observed {observed}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "dense_ms": dense, "profile": prof.__dict__, "run_profile": run_prof.__dict__,
                       "rates_after_runs": rates, "cost_model": run_model.describe(),
                       "load_average": os.getloadavg()}, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
