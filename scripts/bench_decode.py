#!/usr/bin/env python3
"""Decode throughput of the real ft_jax engine under each expert policy, measured side by side in one run.

One checkpoint is loaded once (dense weights on the device, experts in host banks); one ft_jax.engine.engine.Engine is
built per policy over the same banks:

  resident     every expert in a device slot (S = L*E): the no-offload reference
  fetch-all    every miss copied into a slot (classic LRU offload)
  host-all     every miss computed on the CPU from the host bank; the cache never changes after prefill
  qstar:FRAC   q* = m * FRAC misses fetched, the rest on the CPU (FRAC from --frac, else the stored bandwidth profile
               of this machine and expert size via ft_jax.offload.profile.get_or_measure_profile, else 0.25)
  fixed-cap:1  at most one miss fetched per MoE layer

Every offloading policy gets the same S = max(1, round(--cache-fraction * L * E)) slots.

Method: each engine first runs one warm-up generate (compiles prefill and the decode step; not counted). Then, for
each of --repeats rounds, every engine runs one greedy generate of --new-tokens tokens from the same prompt, the
policies interleaved within a round so that load from other processes hits them alike. Before every generate the
engine's expert state is reset to a cold cache, so every repeat decodes the identical routing (prefill with
fetch-all warms the cache, as in a fresh `ft-jax generate`). No EOS stop: every run decodes exactly --new-tokens.

Reported per policy: decode tokens/s (median over the repeats; from Engine.generate's decode_tokens_per_s, which
excludes prefill and compile), ms per decode step (median), its min-max spread, hit rate, fetched and host-computed
experts per decode step (summed over the MoE layers), and the ratio of the policy's tokens/s to fetch-all's.
Also the number of decode-step compilations of each engine over all its runs (must be 1: the step compiles once
and replays for any routing). Exit status 1 if any engine compiled its decode step more than once.

    nice -n 5 python3 scripts/bench_decode.py --new-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings

from tqdm import tqdm

DEFAULT_FRAC = 0.25  # qstar fraction when neither --frac nor a stored profile gives one


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Progress goes to stderr, the table (or --json) to stdout.")
    parser.add_argument("--model", metavar="PATH",
                        help="Hugging Face MoE model folder (default: the bundled tiny Shakespeare model)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="ROMEO:", help="prompt text, tokenised with the model's tokenizer "
                                                        "(default %(default)r)")
    src.add_argument("--prompt-ids", metavar="IDS",
                     help="prompt as comma-separated token ids instead (for a folder without a tokenizer)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated per run (default %(default)s); decode steps = this - 1")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per policy (default %(default)s)")
    parser.add_argument("--cache-fraction", type=float, default=0.25,
                        help="device slots as a fraction of all L*E experts, for every offloading policy "
                             "(default %(default)s)")
    parser.add_argument("--frac", type=float, default=None,
                        help="qstar fetch fraction in [0, 1] (default: from the stored bandwidth profile of this "
                             f"machine and expert size, else {DEFAULT_FRAC})")
    parser.add_argument("--measure", action="store_true",
                        help="with no --frac and no stored profile, run a quick bandwidth profile (< 5 s, saved) "
                             f"instead of using {DEFAULT_FRAC}")
    parser.add_argument("--profile", metavar="PATH", help="bandwidth profile file (default: the user cache dir)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="weights and activations dtype (default: float32 for float32 checkpoints, else bf16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def qstar_fraction(args: argparse.Namespace, checkpoint) -> tuple[float, str]:
    """The qstar fetch fraction and where it came from (--frac, the stored/measured profile, or the default).

    Raises:
        SystemExit: --frac outside [0, 1].
    """
    from ft_jax.offload import profile as bandwidth

    if args.frac is not None:
        if not 0.0 <= args.frac <= 1.0:
            raise SystemExit(f"bench_decode: --frac must be in [0, 1], got {args.frac}")
        return args.frac, "--frac"
    cfg, bank = checkpoint.config, checkpoint.banks.gate_up
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the message is returned instead
        profile, message = bandwidth.get_or_measure_profile(
            cfg.hidden_size, cfg.moe_intermediate_size, bank.dtype, allow_measure=args.measure, path=args.profile,
            progress=args.measure)
    if profile is None:
        return DEFAULT_FRAC, f"default {DEFAULT_FRAC} ({message})"
    return profile.fraction(), message


def prompt_ids(args: argparse.Namespace, path: str) -> list[int]:
    """The prompt as token ids (from --prompt-ids, else --prompt through the model's tokenizer)."""
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise SystemExit(f"bench_decode: --prompt-ids takes comma-separated integers, got {args.prompt_ids!r}")
        if not ids:
            raise SystemExit("bench_decode: --prompt-ids is empty")
        return ids
    from ft_jax.tokenizer import load_tokenizer

    return load_tokenizer(path).encode(args.prompt)


def run(args: argparse.Namespace) -> dict:
    """Build the engines, time them, and return the report dict (see format_table for its fields)."""
    import jax.numpy as jnp

    from ft_jax.checkpoint import load_checkpoint
    from ft_jax.defaults import bundled_model_path
    from ft_jax.config import load_config
    from ft_jax.engine.engine import Engine
    from ft_jax.engine.sampling import Sampling
    from ft_jax.offload.policy import Policy

    if args.new_tokens < 2:
        raise SystemExit(f"bench_decode: --new-tokens must be >= 2 (one decode step at least), got {args.new_tokens}")
    if args.repeats < 1:
        raise SystemExit(f"bench_decode: --repeats must be >= 1, got {args.repeats}")
    if not 0.0 < args.cache_fraction <= 1.0:
        raise SystemExit(f"bench_decode: --cache-fraction must be in (0, 1], got {args.cache_fraction}")

    path = args.model or bundled_model_path()
    cfg = load_config(path)
    dtype = args.dtype or ("float32" if str(cfg.dtype) == "float32" else "bfloat16")
    checkpoint = load_checkpoint(path, dtype=jnp.dtype(dtype))
    prompt = prompt_ids(args, path)
    total_experts = checkpoint.banks.gate_up.num_rows  # L*E
    num_slots = min(total_experts, max(1, round(args.cache_fraction * total_experts)))
    frac, frac_source = qstar_fraction(args, checkpoint)

    policies = [Policy("resident"), Policy("fetch-all"), Policy("host-all"), Policy("qstar", frac=frac),
                Policy("fixed-cap", cap=1)]
    engines = [Engine(checkpoint, policy=p, num_slots=num_slots) for p in policies]
    sampling = Sampling()  # greedy

    def generate(engine: Engine) -> dict:
        engine.expert_state = engine.decode_backend.init_state(engine.num_slots)  # cold cache: identical repeats
        return engine.generate([prompt], max_new_tokens=args.new_tokens, sampling=sampling)

    runs: list[list[dict]] = [[] for _ in engines]  # runs[policy][repeat] = Engine.generate stats
    tokens: list[list[int] | None] = [None] * len(engines)
    with tqdm(total=len(engines) * (1 + args.repeats), desc="bench_decode", unit="run", file=sys.stderr) as bar:
        for i, engine in enumerate(engines):  # warm-up: compile prefill and decode
            bar.set_postfix_str(f"warm-up {engine.policy}")
            tokens[i] = generate(engine).tokens[0]
            bar.update()
        for _ in range(args.repeats):  # interleaved rounds
            for i, engine in enumerate(engines):
                bar.set_postfix_str(str(engine.policy))
                result = generate(engine)
                if result.tokens[0] != tokens[i]:
                    raise RuntimeError(f"bench_decode: {engine.policy}: greedy tokens changed between runs")
                runs[i].append(result.stats)
                bar.update()

    rows = []
    for engine, stats_list in zip(engines, runs):
        tps = [s["decode_tokens_per_s"] for s in stats_list]  # tokens/s per repeat
        ms = [1e3 * s["decode_s"] / s["decode_steps"] for s in stats_list]  # ms per decode step per repeat
        last = stats_list[-1]  # routing and cache counters are identical in every repeat
        rows.append({
            "policy": str(engine.policy),
            "num_slots": engine.num_slots,
            "decode_tokens_per_s": statistics.median(tps),
            "decode_tokens_per_s_range": [min(tps), max(tps)],
            "ms_per_step": statistics.median(ms),
            "ms_per_step_range": [min(ms), max(ms)],
            "hit_rate": last["hit_rate"],
            "active_per_step": last["active_per_step"],
            "fetched_per_step": last["fetched_per_step"],
            "host_per_step": last["host_per_step"],
            "decode_steps": last["decode_steps"],
            "decode_compiles": sum(1 for key in engine._executables if key[0] == "decode"),  # executables built
        })
    base = next(r for r in rows if r["policy"] == "fetch-all")["decode_tokens_per_s"]
    for r in rows:
        r["vs_fetch_all"] = r["decode_tokens_per_s"] / base
    same_tokens = all(t == tokens[0] for t in tokens)
    return {
        "model": path, "dtype": dtype, "num_layers": len(cfg.moe_layers), "num_experts": cfg.num_experts,
        "top_k": cfg.top_k, "expert_bytes": engines[0].expert_bytes, "num_slots": num_slots,
        "cache_fraction": args.cache_fraction, "qstar_fraction": frac, "qstar_fraction_source": frac_source,
        "prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "repeats": args.repeats,
        "same_tokens_all_policies": same_tokens, "policies": rows,
    }


def format_table(report: dict) -> str:
    """Human-readable table of a run() report."""
    lines = [
        f"model {report['model']} ({report['dtype']}): {report['num_layers']} MoE layers x {report['num_experts']} "
        f"experts, top-{report['top_k']}, {report['expert_bytes'] / 2**20:.2f} MiB per expert",
        f"slots {report['num_slots']} of {report['num_layers'] * report['num_experts']} "
        f"(cache fraction {report['cache_fraction']}); prompt {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} new tokens (greedy), {report['repeats']} repeats (median [min-max])",
        f"qstar fraction {report['qstar_fraction']:.3f}: {report['qstar_fraction_source']}",
        "",
        f"{'policy':<14} {'slots':>5} {'tokens/s':>22} {'ms/step':>20} {'hit rate':>8} {'fetched':>8} "
        f"{'host':>6} {'vs fetch-all':>12} {'compiles':>8}",
    ]
    for r in report["policies"]:
        lo, hi = r["decode_tokens_per_s_range"]
        mlo, mhi = r["ms_per_step_range"]
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(
            f"{r['policy']:<14} {r['num_slots']:>5} {r['decode_tokens_per_s']:>8.1f} [{lo:>5.1f}-{hi:>5.1f}] "
            f"{r['ms_per_step']:>7.2f} [{mlo:>5.2f}-{mhi:>5.2f}] {hit:>8} {r['fetched_per_step']:>8.2f} "
            f"{r['host_per_step']:>6.2f} {r['vs_fetch_all']:>12.2f} {r['decode_compiles']:>8}")
    lines.append("")
    lines.append("fetched / host: experts per decode step, summed over the MoE layers; compiles: decode-step "
                 "compilations per engine over all its runs (must be 1)")
    lines.append("greedy tokens identical under every policy: " + ("yes" if report["same_tokens_all_policies"]
                                                                  else "NO"))
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark; returns 1 if an engine compiled its decode step more than once, else 0."""
    args = build_parser().parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0 if all(r["decode_compiles"] == 1 for r in report["policies"]) else 1


if __name__ == "__main__":
    sys.exit(main())
