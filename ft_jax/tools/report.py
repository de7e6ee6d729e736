"""What `ft-jax trace` and `ft-jax plan` print: the JSON report, the table, the plot."""

from __future__ import annotations

import dataclasses
import os

from ft_jax.offload.cost_model import CostModel
from ft_jax.tools.trace_io import Trace


def report(trace: Trace, model: CostModel, results: list[dict], carry_cache: bool, batch: bool) -> dict:
    """The JSON object of `ft-jax trace --json`: results plus what was replayed and how it was priced."""
    return {"results": results, "skipped_tokens": trace.skipped_tokens,
            "sequences": [{"name": s.name, "tokens": len(s.token_idx), "skipped": s.skipped} for s in trace.sequences],
            "tokens": trace.tokens, "trace": trace.paths, "num_layers": trace.num_layers,
            "num_experts": trace.num_experts, "top_k": trace.top_k, "carry_cache": carry_cache, "batch": batch,
            "cost_model": {**dataclasses.asdict(model), "bp_contended_used": model.pair[0],
                           "bh_contended_used": model.pair[1], "qstar_fraction": model.fraction}}


def format_table(rep: dict) -> str:
    """Human-readable table of a report(): one row per (devices, cache size, policy), with each row's ms relative to
    the best policy at that size and device count; a devices column when some row models several devices (its cache
    size is per device)."""
    seqs = ", ".join(f"{s['name']} {s['tokens']}" for s in rep["sequences"])
    several = any(r.get("devices", 1) > 1 for r in rep["results"])
    cm = rep["cost_model"]
    lines = [f"trace {', '.join(rep['trace'])}: {rep['tokens']} tokens ({seqs}), {rep['skipped_tokens']} incomplete "
             f"skipped; L = {rep['num_layers']} MoE layers x E = {rep['num_experts']}, top-{rep['top_k']}; "
             + ("one cache carried across sequences" if rep["carry_cache"] else "cold cache per sequence"),
             f"cost model: {CostModel(**{k: cm[k] for k in (f.name for f in dataclasses.fields(CostModel))}).describe()}",
             f"  bandwidths: {cm['source']}", "",
             f"{'devices':>7} " * several + f"{'slots':>6} {'frac':>5}  {'policy':<16} {'hit rate':>8} "
             f"{'fetched/tok':>11} {'host/tok':>9} {'ms/token':>10} {'vs best':>8}"]
    for N, S in dict.fromkeys((r.get("devices", 1), r["cache_slots"]) for r in rep["results"]):
        group = [r for r in rep["results"] if (r.get("devices", 1), r["cache_slots"]) == (N, S)]
        best = min(r["ms_per_token"] for r in group)
        for r in group:
            lines.append(f"{N:>7} " * several + f"{S:>6} {r['cache_fraction']:>5.2f}  {r['bound']:<16} "
                         f"{100 * r['hit_rate']:>7.1f}% {r['fetched_per_token']:>11.2f} {r['host_per_token']:>9.2f} "
                         f"{r['ms_per_token']:>10.2f} {r['ms_per_token'] / best if best > 0 else 1.0:>7.3f}x")
    lines += ["", "per token, summed over the MoE layers (and the devices); vs best = ms/token over the best policy at "
              "that cache size" + (" and device count; slots and frac are per device" if several else "")]
    if rep["batch"]:
        rows = len(rep["sequences"])
        lines.append(f"batch: the {rows} sequences are the rows of one decode step; a step's figures are divided by "
                     f"its {rows} tokens")
    if several:
        row = next(r for r in rep["results"] if r.get("devices", 1) > 1)
        lines.append(f"N devices: {row['host_sockets']} host socket(s) sharing the host GEMV bandwidth (at most one per "
                     f"device), {row['allreduce_ms']:g} ms per layer for the psum")
    return "\n".join(lines)


def plot(rep: dict, path: str) -> None:
    """ms per token against the cache fraction, one line per policy, saved as a PNG. Raises ImportError (no
    matplotlib) or OSError."""
    try:  # lazy: matplotlib is optional (the plot extra)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'ft-jax[plot]' (or pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["bound"] for r in rep["results"]):
        rows = [r for r in rep["results"] if r["bound"] == policy]
        ax.plot([100 * r["cache_fraction"] for r in rows], [r["ms_per_token"] for r in rows], marker="o", label=policy)
    ax.set_xlabel("cache size, % of all experts")
    ax.set_ylabel("modelled MoE ms per token")
    ax.set_title(os.path.basename(rep["trace"][0]))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
