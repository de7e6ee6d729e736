#!/usr/bin/env python3
"""Replay a real MoE routing trace through the ft_jax expert-cache rules and model the per-token MoE time.

No model weights are needed: only which experts each token routes to in each MoE layer. For every policy and every
cache size S (device slots shared by all layers), the trace is replayed token by token through
ft_jax.offload.expert_cache.plan_layer, the same jnp code the decode step runs: one jax.jit per token scans over all L layers
(layer index traced), so each (policy, S) compiles once. Each sequence (problem) starts from a cold cache (as a fresh
generate would, minus its prefill) unless --carry-cache keeps the cache across sequences.

Reported per (S, policy), averaged over the replayed tokens:
  hit rate          hits / active experts
  fetched, host     experts per token (summed over the L layers) copied into slots / computed on the CPU
  model ms/token    max(fetched * S_e / BP, host * S_e / BH) with the token's fetched and host counts summed over
                    its layers: slot fills and host GEMVs overlap perfectly, also across layers (a lower bound)
  serial ms/token   sum over layers of max(fetched_l * S_e / BP, host_l * S_e / BH): layers run one after another,
                    the two paths overlap only within a layer (closer to the real decode step)
  vs fetch-all      fetch-all's serial ms/token divided by this policy's (> 1 = faster than classic LRU offload)
Hits cost nothing in this model (the device reads its own memory far faster than either transfer path).

S_e = --expert-bytes (default Mixtral-8x7B bf16: 3 * 4096 * 14336 * 2 bytes). BP (slot-fill bandwidth) and BH (host
expert GEMV bandwidth), GB/s (1e9 B/s), come from --bp/--bh, else from the stored bandwidth profile of this machine
(ft_jax.tools.bandwidth: the entry for --dtype and S_e, else this machine's entry with the closest expert size; its
standalone BP and BH feed the time model). The qstar fetch fraction is --frac, else
ft_jax.offload.policy.fraction_from_bandwidth of those bandwidths (the profile's contended pair when it has one).

Trace format (the real trace used: Mixtral-8x7B-Instruct on two HumanEval problems, from
github.com/Mario928/speculative-moe, routing_data_collected/; no license file, so the trace is read from wherever it
lies and never copied into this repository): JSON lines, one object per (generated token, layer):
  {"dataset": str, "problem_id": int, "layer": int, "token_idx": int, "experts": [e0, e1, ...], "gating_probs": [...]}
A sequence is one (dataset, problem_id); tokens missing some layer (a collector artefact at the end of a sequence)
are skipped and counted.

    nice -n 5 python3 scripts/replay_trace.py ../shared/traces/mixtral_8x7b_humaneval/humaneval_2_routing.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import numpy as np
from tqdm import tqdm

MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2  # gate + up + down of one Mixtral-8x7B expert in bf16: 352,321,536 B
DEFAULT_POLICIES = "fetch-all,host-all,qstar,fixed-cap:1"


@dataclasses.dataclass
class Sequence:
    """The complete tokens of one generated sequence of a trace.

    Attributes:
        name: "dataset/problem_id".
        token_idx: i64[N] trace token index of each kept token (increasing).
        active: bool[N, L, E] experts each token routes to in each MoE layer.
        skipped: tokens dropped because some layer was missing.
    """

    name: str
    token_idx: np.ndarray
    active: np.ndarray
    skipped: int


def load_trace(path: str, num_layers: int | None = None, num_experts: int | None = None) -> list[Sequence]:
    """Read a routing trace (JSON lines; format in the module docstring) into per-sequence active masks.

    Args:
        path: the .jsonl file.
        num_layers: L (default: largest layer in the file + 1).
        num_experts: E (default: largest expert id in the file + 1).
    Returns:
        Sequences in order of first appearance; each keeps only the tokens that have all L layers.
    Raises:
        ValueError: a line is not JSON or lacks a field, a (sequence, token, layer) appears twice, a layer or expert
            id is out of range, or no complete token remains. Messages name the file and line.
    """
    rows = []  # (sequence key, token_idx, layer, experts)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                key = f"{obj.get('dataset', '')}/{obj['problem_id']}"
                token, layer = int(obj["token_idx"]), int(obj["layer"])
                experts = [int(e) for e in obj["experts"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: not a routing record with problem_id, token_idx, layer and "
                                 f"experts ({type(e).__name__}: {e})") from None
            if token < 0 or layer < 0 or not experts or min(experts) < 0:
                raise ValueError(f"{path}:{lineno}: negative token_idx/layer/expert id or empty experts: {obj}")
            rows.append((key, token, layer, experts, lineno))
    if not rows:
        raise ValueError(f"{path}: no routing records")
    L = num_layers if num_layers is not None else max(r[2] for r in rows) + 1
    E = num_experts if num_experts is not None else max(max(r[3]) for r in rows) + 1
    by_seq: dict[str, dict[int, dict[int, list[int]]]] = {}
    for key, token, layer, experts, lineno in rows:
        if layer >= L:
            raise ValueError(f"{path}:{lineno}: layer {layer} out of range [0, {L})")
        if max(experts) >= E:
            raise ValueError(f"{path}:{lineno}: expert id {max(experts)} out of range [0, {E})")
        layers = by_seq.setdefault(key, {}).setdefault(token, {})
        if layer in layers:
            raise ValueError(f"{path}:{lineno}: duplicate record for sequence {key}, token {token}, layer {layer}")
        layers[layer] = experts
    sequences = []
    for key, tokens in by_seq.items():
        kept = sorted(t for t, layers in tokens.items() if len(layers) == L)
        active = np.zeros((len(kept), L, E), bool)  # bool[N, L, E]
        for n, t in enumerate(kept):
            for layer, experts in tokens[t].items():
                active[n, layer, experts] = True
        sequences.append(Sequence(key, np.array(kept, np.int64), active, len(tokens) - len(kept)))
    if not any(len(s.token_idx) for s in sequences):
        raise ValueError(f"{path}: no token has all {L} layers")
    return sequences


@functools.lru_cache(maxsize=None)
def _token_step(policy):
    """jit of one token: scan plan_layer over the L layers. (CacheState, bool[L, E]) -> (CacheState, i32[L, 5])."""
    import jax
    import jax.numpy as jnp

    from ft_jax.offload.expert_cache import plan_layer

    def step(state, active):  # active: bool[L, E]
        def body(state, xs):
            layer, layer_active = xs  # i32[], bool[E]
            state, plan = plan_layer(state, layer, layer_active, policy)
            return state, plan.stats  # i32[5] = (active, hits, misses, fetched, host)

        return jax.lax.scan(body, state, (jnp.arange(active.shape[0], dtype=jnp.int32), active))

    return jax.jit(step, donate_argnums=0)


def replay(sequences: list[Sequence], policy, num_slots: int, carry_cache: bool = False,
           progress: tqdm | None = None) -> np.ndarray:
    """Replay every complete token of the sequences through plan_layer.

    Args:
        sequences: from load_trace (all with the same L, E).
        policy: ft_jax.offload.policy.Policy (not "resident").
        num_slots: S.
        carry_cache: keep the cache from one sequence to the next (default: cold cache per sequence).
        progress: a tqdm bar advanced by one per token, or None.
    Returns:
        i32[N_total, L, 5] per-(token, layer) stats (active, hits, misses, fetched, host), tokens of all sequences
        concatenated in order.
    """
    import jax

    from ft_jax.offload.expert_cache import init_cache_state

    L, E = sequences[0].active.shape[1:]
    step = _token_step(policy)
    out = []  # i32[L, 5] device arrays, read once at the end (no sync per token)
    state = None
    for seq in sequences:
        if state is None or not carry_cache:
            state = init_cache_state(L, E, num_slots)
        for active in seq.active:  # bool[L, E]
            state, stats = step(state, active)
            out.append(stats)
            if progress is not None:
                progress.update()
    if not out:
        return np.zeros((0, L, 5), np.int32)
    return np.stack(jax.device_get(out)).astype(np.int32)


def summarize(stats: np.ndarray, expert_bytes: float, bp: float, bh: float) -> dict:
    """Per-token averages and the modeled MoE time of replayed stats.

    Args:
        stats: i32[N, L, 5] from replay (N > 0).
        expert_bytes: S_e, bytes of one expert.
        bp, bh: slot-fill and host GEMV bandwidth, GB/s (1e9 B/s).
    Returns:
        dict: hit_rate, active/hits/fetched/host per token (summed over layers), model_ms (mean over tokens of
        max(F_t * S_e / BP, H_t * S_e / BH), F_t and H_t summed over the token's layers) and serial_ms (mean over
        tokens of sum_l max(F_tl * S_e / BP, H_tl * S_e / BH)), both in ms.
    """
    active, hits, fetched, host = (stats[..., i].astype(np.float64) for i in (0, 1, 3, 4))  # f64[N, L] each
    fill_s = fetched * expert_bytes / (bp * 1e9)  # f64[N, L] seconds of slot fills
    host_s = host * expert_bytes / (bh * 1e9)  # f64[N, L] seconds of host GEMVs
    return {
        "hit_rate": float(hits.sum() / active.sum()),
        "active_per_token": float(active.sum(axis=1).mean()),
        "hits_per_token": float(hits.sum(axis=1).mean()),
        "fetched_per_token": float(fetched.sum(axis=1).mean()),
        "host_per_token": float(host.sum(axis=1).mean()),
        "model_ms": float(1e3 * np.maximum(fill_s.sum(axis=1), host_s.sum(axis=1)).mean()),
        "serial_ms": float(1e3 * np.maximum(fill_s, host_s).sum(axis=1).mean()),
    }


def bandwidths(args: argparse.Namespace) -> tuple[float, float, float | None, float | None, str]:
    """(BP, BH, BPc, BHc, source) in GB/s from --bp/--bh or the stored profile (contended pair None if absent).

    Raises:
        SystemExit: only one of --bp/--bh, a non-positive value, or no bandwidths given and no stored profile.
    """
    if (args.bp is None) != (args.bh is None):
        raise SystemExit("replay_trace: give both --bp and --bh, or neither (then the stored profile is used)")
    if args.bp is not None:
        if not (args.bp > 0 and args.bh > 0):
            raise SystemExit(f"replay_trace: --bp and --bh must be > 0 GB/s, got {args.bp}, {args.bh}")
        return args.bp, args.bh, None, None, "--bp/--bh"
    from ft_jax.tools import bandwidth

    key = bandwidth.machine_key(args.dtype, args.expert_bytes)
    try:
        profiles, _ = bandwidth.read_profiles(args.profile)
    except bandwidth.NotAStoreError as e:
        raise SystemExit(f"replay_trace: {e}") from None
    exact = [p for p in profiles if p.key == key]
    near = sorted((p for p in profiles if bandwidth.describe_machine(p.key) == bandwidth.describe_machine(key)),
                  key=lambda p: abs(np.log(p.key["expert_bytes"] / args.expert_bytes)))
    chosen = exact[-1] if exact else (near[0] if near else None)
    if chosen is None:
        where = args.profile or bandwidth.default_store_path()
        raise SystemExit(f"replay_trace: no bandwidth profile of this machine in {where}; pass --bp and --bh (GB/s) "
                         "or run `ft-jax profile` first")
    how = "for this expert size" if exact else (f"closest expert size on this machine: {chosen.key['dtype']}, "
                                                f"{chosen.key['expert_bytes'] / 1e6:.1f} MB")
    return (chosen.bp, chosen.bh, chosen.bp_contended, chosen.bh_contended,
            f"stored profile ({how}, measured {chosen.measured_at})")


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Progress goes to stderr, the table (or --json) to stdout.")
    parser.add_argument("trace", help="routing trace (.jsonl), e.g. "
                                      "../shared/traces/mixtral_8x7b_humaneval/humaneval_2_routing.jsonl")
    parser.add_argument("--slots", default="32,64,128",
                        help="comma-separated cache sizes S (slots shared by all layers; Mixtral has 32 x 8 = 256 "
                             "experts) (default %(default)s)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated policies: qstar, qstar:FRAC, fetch-all, host-all, fixed-cap:K "
                             "(default %(default)s)")
    parser.add_argument("--frac", type=float, default=None,
                        help="qstar fetch fraction (default: fraction_from_bandwidth of the bandwidths)")
    parser.add_argument("--bp", type=float, default=None, help="slot-fill bandwidth BP, GB/s")
    parser.add_argument("--bh", type=float, default=None, help="host expert GEMV bandwidth BH, GB/s")
    parser.add_argument("--profile", metavar="PATH", help="bandwidth profile file (default: the user cache dir)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="expert dtype, to find the stored profile (default %(default)s)")
    parser.add_argument("--expert-bytes", type=int, default=MIXTRAL_EXPERT_BYTES,
                        help="S_e, bytes of one expert (default %(default)s: Mixtral-8x7B bf16, 3*4096*14336*2)")
    parser.add_argument("--num-layers", type=int, default=None, help="L (default: from the trace)")
    parser.add_argument("--num-experts", type=int, default=None, help="E (default: from the trace)")
    parser.add_argument("--carry-cache", action="store_true",
                        help="keep the cache across sequences (default: cold cache per sequence)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def run(args: argparse.Namespace) -> dict:
    """Load, replay every (S, policy), and return the report dict (see format_table)."""
    from ft_jax.offload.policy import fraction_from_bandwidth, parse_policy

    try:
        slot_sizes = [int(s) for s in args.slots.split(",") if s.strip()]
        policies = [parse_policy(p) for p in args.policies.split(",") if p.strip()]
    except ValueError as e:
        raise SystemExit(f"replay_trace: {e}") from None
    if not slot_sizes or not policies:
        raise SystemExit("replay_trace: --slots and --policies must each name at least one entry")
    if any(p.kind == "resident" for p in policies):
        raise SystemExit("replay_trace: resident has no misses and no cache size; leave it out of --policies")
    if args.expert_bytes < 1:
        raise SystemExit(f"replay_trace: --expert-bytes must be >= 1, got {args.expert_bytes}")
    try:
        sequences = load_trace(args.trace, args.num_layers, args.num_experts)
    except (OSError, ValueError) as e:
        raise SystemExit(f"replay_trace: {e}") from None
    L, E = sequences[0].active.shape[1:]
    bad = [s for s in slot_sizes if not 1 <= s <= L * E]
    if bad:
        raise SystemExit(f"replay_trace: --slots values must be in [1, L*E = {L * E}], got {bad}")
    bp, bh, bpc, bhc, bw_source = bandwidths(args)
    if args.frac is not None:
        if not 0.0 <= args.frac <= 1.0:
            raise SystemExit(f"replay_trace: --frac must be in [0, 1], got {args.frac}")
        frac, frac_source = args.frac, "--frac"
    else:
        frac = fraction_from_bandwidth(bp, bh, bpc, bhc)
        frac_source = "BPc/(BPc+BHc) of the profile" if bpc is not None else "min(1, BP/BH)"
    policies = [p.with_frac(frac) if p.kind == "qstar" and p.frac is None else p for p in policies]

    num_tokens = sum(len(s.token_idx) for s in sequences)
    rows = []
    with tqdm(total=len(slot_sizes) * len(policies) * num_tokens, desc="replay", unit="tok", file=sys.stderr) as bar:
        for S in slot_sizes:
            for policy in policies:
                bar.set_postfix_str(f"S={S} {policy}")
                stats = replay(sequences, policy, S, args.carry_cache, bar)  # i32[N, L, 5]
                rows.append({"num_slots": S, "policy": str(policy),
                             **summarize(stats, args.expert_bytes, bp, bh)})
    for S in slot_sizes:
        group = [r for r in rows if r["num_slots"] == S]
        base = next((r["serial_ms"] for r in group if r["policy"] == "fetch-all"), None)
        for r in group:
            r["vs_fetch_all"] = base / r["serial_ms"] if base is not None and r["serial_ms"] > 0 else None
    return {
        "trace": args.trace,
        "sequences": [{"name": s.name, "tokens": len(s.token_idx), "skipped_incomplete": s.skipped}
                      for s in sequences],
        "num_layers": int(L), "num_experts": int(E), "top_k_max": int(max(s.active.sum(-1).max() for s in sequences
                                                                            if len(s.token_idx))),
        "tokens": num_tokens, "expert_bytes": args.expert_bytes, "bp": bp, "bh": bh,
        "bp_contended": bpc, "bh_contended": bhc, "bandwidth_source": bw_source,
        "qstar_fraction": frac, "qstar_fraction_source": frac_source, "carry_cache": args.carry_cache,
        "rows": rows,
    }


def format_table(report: dict) -> str:
    """Human-readable table of a run() report."""
    seqs = ", ".join(f"{s['name']} {s['tokens']} tokens ({s['skipped_incomplete']} incomplete skipped)"
                     for s in report["sequences"])
    contended = ""
    if report["bp_contended"] is not None:
        contended = f" (contended {report['bp_contended']:.2f} / {report['bh_contended']:.2f})"
    lines = [
        f"trace {report['trace']}: {seqs}",
        f"L = {report['num_layers']} layers x E = {report['num_experts']} experts; "
        f"{'one cache carried across sequences' if report['carry_cache'] else 'cold cache per sequence'}",
        f"S_e = {report['expert_bytes'] / 1e6:.1f} MB; BP = {report['bp']:.2f} GB/s, BH = {report['bh']:.2f} GB/s"
        f"{contended}: {report['bandwidth_source']}",
        f"qstar fraction {report['qstar_fraction']:.3f} ({report['qstar_fraction_source']})",
        "",
        f"{'slots':>5} {'policy':<14} {'hit rate':>8} {'fetched/tok':>11} {'host/tok':>9} {'model ms/tok':>12} "
        f"{'serial ms/tok':>13} {'vs fetch-all':>12}",
    ]
    for r in report["rows"]:
        ratio = "-" if r["vs_fetch_all"] is None else f"{r['vs_fetch_all']:.2f}"
        lines.append(f"{r['num_slots']:>5} {r['policy']:<14} {100 * r['hit_rate']:>7.1f}% "
                     f"{r['fetched_per_token']:>11.2f} {r['host_per_token']:>9.2f} {r['model_ms']:>12.1f} "
                     f"{r['serial_ms']:>13.1f} {ratio:>12}")
    lines.append("")
    lines.append("per token, summed over the layers; model = max(fetched*S_e/BP, host*S_e/BH) per token; serial = "
                 "sum over layers of that max; vs fetch-all = fetch-all serial / this serial")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the replay and print the table (or JSON); returns 0."""
    args = build_parser().parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
