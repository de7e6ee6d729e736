#!/usr/bin/env python3
"""Where a decode step's time goes: the FFI kernels against XLA's own ops, the executor and the Python loop.

    python3 scripts/profile_decode.py --model DIR                       # host-all, batch 1, 8-token prompt, 32 steps
    python3 scripts/profile_decode.py --model DIR --quantize q4_0 --top-ops 15 --json-out /tmp/decode_profile.json
    python3 scripts/profile_decode.py --model DIR --batch 8            # 8 rows, as `ft-jax serve --max-batch 8`

What it does: loads the checkpoint (bf16 model dtype, or quantized while loading) into an Engine with the given
policy, runs ``Engine.generate(prompt, max_new_tokens=N + 1)`` twice untimed (compilation, warm caches) and
--untraced times more for the decode tokens/s (as generate runs: up to Engine.decode_chunk_s of steps per executable
run, and again at one step per run), then once under ``jax.profiler.trace`` at one step per run (decode_chunk_s 0).
The decode steps are the executions inside the Python tracer's ``decode_n_tokens`` event (ft_jax/engine/steps.py);
each XLA:CPU trace event carries the ``run_id`` of its execution, so every step is measured on its own:

  step period     from one step's first op to the next step's first op (the steps are back to back: the host loop
                  waits for each step's token before it dispatches the next)
  execution span  the step's first op start to its last op end
  ops             the summed durations of the step's executed ops (control flow, whose bodies are counted, and the
                  executor's own events excluded), split into the FFI calls (custom-call targets ft_jax_*: the expert
                  kernel, the dense GEMVs, the decode attention) and XLA's own ops, and per part of the model
                  (scripts/profile_prefill.py maps ops to the model's jax.named_scope parts; "sampling" is
                  sample_next)
  executor gaps   span - ops: the thunk executor between ops (scheduling, waking a thread for each op)
  between steps   period - span: the host's share of a step: the token's device-to-host read, the Python loop of
                  decode_n_tokens, the dispatch of the next step and the wake-up of the thread that runs it (what
                  generate pays once per run of steps: the two untraced rates differ by about this)

Weight bytes per token (the dense weights read by a step and the top-k experts of every MoE layer, as stored) over
the FFI calls' time give the kernels' read rate; compare it with the numpy read of scripts/bench_peer.py (--programs
numpy). Medians over the traced steps (the first is left out: its buffers are new). A profile, not a benchmark: the
profiler adds a little per op and the Python tracer per call; the untraced tokens/s is printed beside it. Run it under
``flock /work/bench.lock`` on a shared machine; the load average is printed with the numbers.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# scripts/ is not a package
from profile_prefill import PARTS, add_engine_arguments, load_engine, op_parts, write_result  # noqa: E402

DECODE_PARTS = PARTS[:-1] + ("sampling", "other")
_FFI_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*custom_call_target="(ft_jax_\w+)"')


def _log(msg: str) -> None:
    print(f"[profile_decode] {msg}", file=sys.stderr, flush=True)


def ffi_targets(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: FFI target} of the custom calls into ft_jax's kernels (ft_jax_linear,
    ft_jax_host_experts, ...) of an optimized HLO module's text."""
    return {m.group(1): m.group(2) for m in map(_FFI_RE.match, hlo_text.splitlines()) if m}


def sampling_ops(hlo_text: str) -> set[str]:
    """Names of the ops whose op_name metadata lies in the "sampling" named scope (steps.decode_one_token)."""
    out = set()
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
        meta = re.search(r'op_name="([^"]*)"', line)
        if m and meta and "/sampling/" in meta.group(1) + "/":
            out.add(m.group(1))
    return out


def decode_events(trace_dir: Path) -> tuple[list[dict], dict]:
    """(the complete ("X") events of the XLA threads inside the decode loop, the loop's Python event) of the newest
    trace under trace_dir. Raises RuntimeError when the trace has no decode_n_tokens event (Python tracer off)."""
    files = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        raise RuntimeError(f"no trace file under {trace_dir}")
    events = [e for e in json.load(gzip.open(files[-1]))["traceEvents"] if e.get("ph") == "X"]
    loops = [e for e in events if e["name"].endswith("decode_n_tokens")]
    if not loops:
        raise RuntimeError("the trace has no decode_n_tokens event: the Python tracer must be on")
    loop = loops[-1]
    t0, t1 = loop["ts"], loop["ts"] + loop["dur"]
    return [e for e in events if t0 <= e["ts"] <= t1 and "run_id" in e.get("args", {})], loop


def step_table(events: list[dict], parts: dict[str, str | None], ffi: dict[str, str], sampling: set[str]) -> list:
    """Per decode step (execution, by run_id, in time order): {"start", "end" (us), "ops_us" {(part, kind): us},
    "op_us" {op name: us}, "op_calls" {op name: events}} where kind is "ffi" or "xla"."""
    runs: dict[str, dict] = {}
    for e in events:
        name, run = e["name"], e["args"]["run_id"]
        if name.startswith("end: ") or name not in parts:
            continue
        r = runs.setdefault(run, {"start": e["ts"], "end": e["ts"] + e["dur"], "ops_us": collections.Counter(),
                                  "op_us": collections.Counter(),
                                  "op_calls": collections.Counter()})
        r["start"], r["end"] = min(r["start"], e["ts"]), max(r["end"], e["ts"] + e["dur"])
        part = parts[name]
        if part is None:  # control flow: its body's ops are counted
            continue
        part = "sampling" if name in sampling else part
        kind = "ffi" if name in ffi else "xla"
        r["ops_us"][(part, kind)] += e["dur"]
        r["op_us"][name] += e["dur"]
        r["op_calls"][name] += 1
    return sorted(runs.values(), key=lambda r: r["start"])


def _ms(values_us: list[float]) -> dict:
    """{"median", "min"} of per-step microseconds, in ms."""
    return {"median": round(statistics.median(values_us) / 1e3, 3), "min": round(min(values_us) / 1e3, 3)}


def summarize(steps: list, ffi: dict[str, str], parts: dict, sampling: set, top_ops: int) -> dict:
    """The quantities of the module docstring per step, {"median", "min"} in ms over the steps (the first left out:
    its buffers are new). The minimum is the step least disturbed by other processes."""
    steps = steps[1:]
    if len(steps) < 2:
        raise RuntimeError(f"too few decode steps in the trace ({len(steps) + 1}); decode more tokens")
    periods = [b["start"] - a["start"] for a, b in zip(steps, steps[1:])]
    spans = [r["end"] - r["start"] for r in steps]
    ops = [sum(r["ops_us"].values()) for r in steps]
    ffi_us = [sum(us for (p, k), us in r["ops_us"].items() if k == "ffi") for r in steps]
    rows = {}
    for p in DECODE_PARTS:
        for kind in ("ffi", "xla"):
            vals = [r["ops_us"].get((p, kind), 0.0) for r in steps]
            if any(vals):
                rows[f"{p} ({kind})"] = _ms(vals)
    per_op, calls = collections.defaultdict(list), collections.Counter()
    for r in steps:
        for n, us in r["op_us"].items():
            per_op[n].append(us)
            calls[n] += r["op_calls"][n]
    ranked = sorted(per_op.items(), key=lambda kv: -statistics.median(kv[1]))[:top_ops]
    return {"steps": len(steps), "period": _ms(periods), "span": _ms(spans), "ops": _ms(ops), "ffi": _ms(ffi_us),
            "xla_ops": _ms([o - f for o, f in zip(ops, ffi_us)]),
            "executor_gaps": _ms([s - o for s, o in zip(spans, ops)]),
            "between_steps": _ms([b["start"] - a["end"] for a, b in zip(steps, steps[1:])]),
            "ops_per_step": statistics.median(sum(r["op_calls"].values()) for r in steps), "parts": rows,
            "top_ops": [{"op": n, "ffi": ffi.get(n), "part": "sampling" if n in sampling else parts[n],
                         **_ms(v), "calls": round(calls[n] / len(steps), 2)} for n, v in ranked]}


def format_table(result: dict) -> str:
    s = result["summary"]
    f = lambda q: f"{q['median']:.2f} ({q['min']:.2f})"  # noqa: E731
    gb = result["weight_bytes_per_step"] / 1e6
    lines = [f"profile_decode: {result['model']} policy {result['policy']}, weights {result['weights']}, "
             f"batch {result['batch']}, "
             f"{result['threads']} FFI threads; load average before {result['load_average']['before']}, "
             f"after {result['load_average']['after']}",
             f"decode {result['tokens_per_s_untraced']:.2f} tok/s untraced ({1e3 / result['tokens_per_s_untraced']:.2f}"
             f" ms/token; {result['tokens_per_s_untraced_one_step_runs']:.2f} at one step per run), "
             f"{result['tokens_per_s_traced']:.2f} traced (one step per run); {s['steps']} traced steps, per step in "
             f"ms, median (min):",
             f"  step period {f(s['period'])} = execution span {f(s['span'])} + between steps "
             f"{f(s['between_steps'])} (token read, Python loop, dispatch)",
             f"  execution span = ops {f(s['ops'])} (FFI {f(s['ffi'])}, XLA {f(s['xla_ops'])}; "
             f"{s['ops_per_step']:.0f} ops) + executor gaps {f(s['executor_gaps'])}",
             f"  weight bytes per step {gb / 1e3:.3f} GB: {gb / s['ffi']['median']:.1f} ({gb / s['ffi']['min']:.1f}) "
             f"GB/s over the FFI time, {gb / s['period']['median']:.1f} ({gb / s['period']['min']:.1f}) GB/s over "
             f"the step period",
             f"  {'part (kind)':<40} {'median':>8} {'min':>8}"]
    for p, q in s["parts"].items():
        lines.append(f"  {p:<40} {q['median']:8.3f} {q['min']:8.3f}")
    if s["top_ops"]:
        lines.append(f"  {'costliest ops':<40} {'median':>8} {'min':>8} calls")
        for o in s["top_ops"]:
            lines.append(f"  {o['op'] + ' (' + (o['ffi'] or o['part']) + ')':<40} {o['median']:8.3f} {o['min']:8.3f}"
                         f" {o['calls']:g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens (default %(default)s, bench_peer's)")
    p.add_argument("--steps", type=int, default=32, help="decode steps traced (default %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together, each its own random prompt (default "
                   "%(default)s)")
    p.add_argument("--untraced", type=int, default=2, help="untraced runs for the tokens/s (default %(default)s)")
    p.add_argument("--top-ops", type=int, default=12, help="list the N costliest ops (default %(default)s)")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    engine, cfg, policy, load_before = load_engine(args, log=_log)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, args.prompt_len)] for _ in range(args.batch)]
    run = lambda: engine.generate(prompts, max_new_tokens=args.steps + 1).stats  # noqa: E731
    for _ in range(2):
        run()
    untraced = [run()["decode_tokens_per_s"] for _ in range(args.untraced)]
    engine.decode_chunk_s = 0  # one step per executable run: each run_id is one step
    untraced_one = [run()["decode_tokens_per_s"] for _ in range(args.untraced)]
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        stats = run()
        jax.profiler.stop_trace()
        hlo = "\n".join(exe.as_text() for key, exe in engine._executables.items() if key[0] == "decode")
        events, _ = decode_events(Path(tmp))
    parts, ffi, sampling = op_parts(hlo), ffi_targets(hlo), sampling_ops(hlo)
    summary = summarize(step_table(events, parts, ffi, sampling), ffi, parts, sampling, args.top_ops)
    # the experts a step reads: top-k per MoE layer at batch 1; with more rows the distinct active ones (cache counters)
    expert_bytes = engine.expert_bytes * (cfg.top_k * engine.decode_backend.num_layers if args.batch == 1
                                          else stats["active_per_step"])
    result = {"model": args.model, "policy": str(policy), "weights": args.quantize or "bf16",
              "threads": os.environ.get("FT_JAX_NUM_THREADS", str(os.cpu_count())),
              "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
              "batch": args.batch,
              "tokens_per_s_untraced": statistics.median(untraced), "tokens_per_s_untraced_runs": untraced,
              "tokens_per_s_untraced_one_step_runs": statistics.median(untraced_one),
              "tokens_per_s_traced": stats["decode_tokens_per_s"],
              "weight_bytes_per_step": int(engine.dense_bytes + expert_bytes), "summary": summary}
    write_result(args, result, format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
