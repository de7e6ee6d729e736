#!/usr/bin/env python3
"""Per-process host memory of expert parallelism: 1, 2 and 4 processes on this machine decode the same model.

    python3 scripts/bench_expert_parallel.py                        # the Mixtral-shaped bench model, P = 1 2 4
    python3 scripts/bench_expert_parallel.py --model DIR --processes 1 2 --json

For each P, P processes (one CPU device each) form one jax.distributed run on localhost (gloo CPU collectives) and
``ft_jax.load(model, mesh=ft_jax.expert_mesh())`` (P = 1: no mesh) loads only the experts each process's device owns
(E / P of every MoE layer), then decodes --new-tokens greedy tokens under host-all with one slot. Each process
reports its host bank bytes (ExpertBanks: the experts it holds, exact), the dense weight bytes (every process holds
all of them) and its peak resident set (VmHWM of /proc/self/status: banks, dense weights, the runtime and the
compiled steps). The table gives them per process with the ratio of the bank bytes and of the peak to P = 1, and
whether every process decoded P = 1's tokens. Issue 23's target: bank bytes per process = 1/P of P = 1's.

Model: --model DIR, else the Mixtral-shaped bench model of scripts/synthetic_checkpoint.py (bf16, hidden 2048,
expert width 5632, 8 layers, 8 experts top-2: the shape scripts/bench_peer.py uses), written once under --cache-dir.
A measurement, not a test: nothing is asserted. Run it under `flock /work/bench.lock` with nothing else timed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

PROMPT = [1, 415, 2936, 9060, 285, 1142, 28705]


def _status_bytes(field: str) -> int:
    """A "kB" field of /proc/self/status in bytes (0 where there is none)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def worker(spec: dict) -> None:
    """One process of a run (spec: model, processes, process_id, port, new_tokens); prints one JSON line."""
    import jax

    if spec["processes"] > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"localhost:{spec['port']}", spec["processes"], spec["process_id"],
                                   initialization_timeout=600)
    import ft_jax

    t0 = time.perf_counter()
    mesh = ft_jax.expert_mesh() if spec["processes"] > 1 else None
    model = ft_jax.load(spec["model"], policy="host-all", cache=1, mesh=mesh, measure=False)
    loaded = time.perf_counter() - t0
    out = model.generate(PROMPT, max_new_tokens=spec["new_tokens"], temperature=0)
    print(json.dumps({"process_id": spec["process_id"], "tokens": out.token_ids[0],
                      "host_bank_bytes": out.stats["host_bank_bytes"], "dense_bytes": model.engine.dense_bytes,
                      "peak_rss_bytes": _status_bytes("VmHWM"), "load_s": loaded,
                      "decode_tokens_per_s": out.stats["decode_tokens_per_s"]}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run(model: str, processes: int, new_tokens: int) -> list[dict]:
    """The per-process reports of one run of ``processes`` processes, in process order."""
    port = _free_port()
    procs = []
    for pid in reversed(range(processes)):  # process 0 last: the others wait for it
        spec = {"model": model, "processes": processes, "process_id": pid, "port": port, "new_tokens": new_tokens}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a process of the {processes}-process run failed:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))  # gloo prints its own lines first
    return sorted(reports, key=lambda r: r["process_id"])


def ensure_model(cache_dir: Path) -> str:
    """The Mixtral-shaped bench model (scripts/synthetic_checkpoint.py defaults), written once under cache_dir."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import synthetic_checkpoint

    config = synthetic_checkpoint.mixtral_config()
    folder = cache_dir / "models" / "expert_parallel_mixtral"
    marker = folder / "written.json"
    if not (marker.exists() and json.loads(marker.read_text()) == config):
        print(f"[bench_expert_parallel] writing the bench model to {folder}", file=sys.stderr, flush=True)
        synthetic_checkpoint.write_checkpoint(folder, config, progress=True)
        marker.write_text(json.dumps(config))
    return str(folder)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help="model folder (default: the Mixtral-shaped bench model under --cache-dir)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "ft_jax" / "bench_expert_parallel")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4], help="process counts (default 1 2 4)")
    p.add_argument("--new-tokens", type=int, default=4, help="greedy tokens each run decodes (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    model = args.model or ensure_model(args.cache_dir)
    results, load = {}, {"before": os.getloadavg()}
    for n in args.processes:
        print(f"[bench_expert_parallel] {n} process(es) (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        results[n] = run(model, n, args.new_tokens)
    load["after"] = os.getloadavg()
    base = results[args.processes[0]][0]
    rows = [{"processes": n, **r, "bank_ratio": r["host_bank_bytes"] / base["host_bank_bytes"],
             "peak_ratio": r["peak_rss_bytes"] / base["peak_rss_bytes"], "same_tokens": r["tokens"] == base["tokens"]}
            for n, reports in results.items() for r in reports]
    if args.json:
        print(json.dumps({"model": model, "rows": rows, "load_average": load}))
        return 0
    gib = 2**30
    print(f"model {model}; host-all, 1 slot, {args.new_tokens} greedy tokens; ratios to {args.processes[0]} "
          "process(es)")
    print(f"{'P':>2} {'proc':>4} {'banks GiB':>10} {'x':>6} {'dense GiB':>10} {'peak RSS GiB':>13} {'x':>6} "
          f"{'load s':>7} {'same tokens':>12}")
    for r in rows:
        print(f"{r['processes']:>2} {r['process_id']:>4} {r['host_bank_bytes'] / gib:>10.3f} {r['bank_ratio']:>6.3f} "
              f"{r['dense_bytes'] / gib:>10.3f} {r['peak_rss_bytes'] / gib:>13.3f} {r['peak_ratio']:>6.3f} "
              f"{r['load_s']:>7.1f} {str(r['same_tokens']):>12}")
    print(f"load average before/after (1 min): {load['before'][0]:.2f} / {load['after'][0]:.2f} on {os.cpu_count()} "
          "cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
