#!/usr/bin/env python3
"""Launch-to-exit time and peak memory of ``ft-jax generate`` against llama.cpp on the bench_peer model.

    python3 scripts/bench_load.py --json-out /tmp/bench_load.json            # 3 rounds, 8 new tokens
    python3 scripts/bench_load.py --rounds 5 --ft-jax-args="--policy host-all"
    python3 scripts/bench_load.py --model /tmp/mixtral_8l                     # an existing HF folder, no llama.cpp

What runs, one fresh process per run, alternated over --rounds rounds (the order is rotated by one position per
round, so no program always runs first):
  ft_jax     ``python -m ft_jax generate --model DIR --prompt-ids IDS --max-new-tokens N --temperature 0 --json``
             (IDS: --prompt-tokens ids, default 1: the same N one-token forward passes as llama-bench below)
             plus --ft-jax-args (default policy and cache, as a user runs it; the compilation cache and the stored
             bandwidth profile of earlier runs are used, as they are on a user's second run)
  baseline   with --baseline-repo, the same ft_jax command from another checkout (e.g. /work/main), run by that
             checkout's own .venv/bin/python when it has one (ft_jax_python): before/after
  llama.cpp  ``llama-bench -m MODEL-bf16.gguf -p 0 -n N -r 1 -t T --no-warmup -o json`` (the same weights as GGUF:
             load, N decoded tokens, exit), when the llama.cpp build of scripts/llama_cpp_build.py (the "peer"
             benchmark's, under --cache-dir) and the GGUF exist; skipped with a note otherwise

Before each run the program's weight file is read once, so that both start with it in the page cache (llama.cpp
memory-maps its file; ft_jax maps the expert tensors into its host banks). Per run: wall seconds from the fork to
the exit (os.wait4), peak resident set size (ru_maxrss of the child: anonymous plus file pages mapped at the peak),
minor and major page faults, user and system CPU seconds, and the CPU other processes used meanwhile (in cores; a
value well above 0 means the timings are not steady). Reported per program: medians and ranges over the rounds,
peak RSS / weight-file bytes, and for ft_jax the ratios to llama.cpp's medians; the load average at the start and
end. A benchmark, not a test: nothing is asserted. Targets (issue 19): launch to exit <= 3x llama.cpp's, peak RSS
<= 1.1x the checkpoint's bytes.

Model: the bench_peer default (scripts/synthetic_checkpoint.py, Mixtral-shaped bf16, ~4.9 GB; its GGUF from
scripts/mixtral_to_gguf.py), found or written by bench_peer.ensure_models under --cache-dir/models/; or --model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peer  # noqa: E402
import llama_cpp_build  # noqa: E402
import synthetic_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _log(msg: str) -> None:
    print(f"[bench_load] {msg}", file=sys.stderr, flush=True)


def measure(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run ``cmd`` to its exit; returns {"wall_s", "peak_rss_bytes", "minor_faults", "major_faults", "user_s",
    "sys_s", "other_cores", "returncode", "stdout", "stderr_tail"}. The child's resource usage comes from os.wait4
    (ru_maxrss is in KiB on Linux); its output goes to temporary files (no pipe for it to wait on). Raises
    TimeoutError after ``timeout`` seconds (the child is killed first)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        meter = bench_peer.CpuMeter()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise TimeoutError(f"{cmd[0]} ran over {timeout} s")
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return {"wall_s": round(wall, 3), "peak_rss_bytes": usage.ru_maxrss * 1024, "minor_faults": usage.ru_minflt,
            "major_faults": usage.ru_majflt, "user_s": round(usage.ru_utime, 2), "sys_s": round(usage.ru_stime, 2),
            "other_cores": meter.stop()["other_cores"], "returncode": proc.returncode, "stdout": stdout,
            "stderr_tail": stderr.strip()[-800:]}


def find_llama_bench(cache_dir: Path) -> str | None:
    """The llama-bench binary of the newest cached scripts/llama_cpp_build.py build, or None (nothing is built)."""
    for info in sorted(cache_dir.glob(f"build-*/{llama_cpp_build.BUILD_INFO}"), reverse=True):
        path = json.loads(info.read_text()).get("llama_bench")
        if path and Path(path).is_file():
            return path
    return None


def ft_jax_python(repo: Path) -> str:
    """The interpreter that runs ``repo``'s ft_jax: its own .venv when it has one (an editable install there is what
    imports that checkout's code and extension; this interpreter's editable install would win over PYTHONPATH),
    else this one with the checkout on PYTHONPATH."""
    venv = repo / ".venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def ft_jax_run(model: Path, prompt: list[int], tokens: int, extra: list[str], timeout: float, repo: Path) -> dict:
    cmd = [ft_jax_python(repo), "-m", "ft_jax", "generate", "--model", str(model), "--prompt-ids",
           ",".join(map(str, prompt)), "--max-new-tokens", str(tokens), "--temperature", "0", "--json", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    r = measure(cmd, env, timeout)
    if r["returncode"]:
        raise RuntimeError(f"ft-jax generate exited {r['returncode']}: {r['stderr_tail']}")
    line = [l for l in r.pop("stdout").splitlines() if l.startswith("{")][-1]
    stats = json.loads(line)["stats"]
    r["stats"] = {k: stats[k] for k in ("decode_tokens_per_s", "compile_s", "policy", "num_slots") if k in stats}
    r["command"] = cmd
    return r


def llama_run(bench: str, gguf: Path, tokens: int, threads: int, timeout: float) -> dict:
    cmd = [bench, "-m", str(gguf), "-p", "0", "-n", str(tokens), "-r", "1", "-t", str(threads), "--no-warmup",
           "-o", "json"]
    r = measure(cmd, dict(os.environ), timeout)
    if r["returncode"]:
        raise RuntimeError(f"llama-bench exited {r['returncode']}: {r['stderr_tail']}")
    r.pop("stdout")
    r["command"] = cmd
    return r


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: dict[str, list[dict]], file_bytes: dict[str, int]) -> dict:
    out = {}
    for prog, rs in runs.items():
        if not rs:
            continue
        row = {k: _spread([r[k] for r in rs]) for k in ("wall_s", "peak_rss_bytes", "minor_faults", "user_s", "sys_s")}
        row["peak_rss_over_file"] = _spread([r["peak_rss_bytes"] / file_bytes[prog] for r in rs])
        row["file_bytes"] = file_bytes[prog]
        row["other_cores"] = _spread([r["other_cores"] or 0.0 for r in rs])
        out[prog] = row
    for prog in ("ft_jax", "baseline"):
        if out.get(prog) and out.get("llama.cpp"):
            f, l = out[prog], out["llama.cpp"]
            f["wall_over_llama_cpp"] = f["wall_s"]["median"] / l["wall_s"]["median"]
            f["wall_over_llama_cpp_per_round"] = _spread(
                [a["wall_s"] / b["wall_s"] for a, b in zip(runs[prog], runs["llama.cpp"])])
    if out.get("ft_jax") and out.get("baseline"):
        out["ft_jax"]["wall_over_baseline_per_round"] = _spread(
            [a["wall_s"] / b["wall_s"] for a, b in zip(runs["ft_jax"], runs["baseline"])])
    return out


def format_table(summary: dict) -> str:
    lines = [f"{'program':10} {'wall s [range]':>20} {'peak RSS GB':>12} {'x file':>7} {'minor faults':>13} "
             f"{'user s':>7} {'sys s':>7} {'others':>7}"]
    for prog, row in summary.items():
        w = row["wall_s"]
        lines.append(f"{prog:10} {w['median']:7.2f} [{w['min']:.2f}-{w['max']:.2f}] "
                     f"{row['peak_rss_bytes']['median'] / 1e9:12.2f} {row['peak_rss_over_file']['median']:7.2f} "
                     f"{row['minor_faults']['median']:13.0f} {row['user_s']['median']:7.2f} "
                     f"{row['sys_s']['median']:7.2f} {row['other_cores']['median']:7.2f}")
    for prog in ("ft_jax", "baseline"):
        f = summary.get(prog, {})
        if "wall_over_llama_cpp" in f:
            per = f["wall_over_llama_cpp_per_round"]
            lines.append(f"{prog} wall / llama.cpp wall: {f['wall_over_llama_cpp']:.2f} (same rounds "
                         f"{per['min']:.2f}-{per['max']:.2f}); target <= 3")
    if "wall_over_baseline_per_round" in summary.get("ft_jax", {}):
        per = summary["ft_jax"]["wall_over_baseline_per_round"]
        lines.append(f"ft_jax wall / baseline wall, same rounds: {per['median']:.2f} "
                     f"[{per['min']:.2f}-{per['max']:.2f}]")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds (default %(default)s)")
    p.add_argument("--tokens", type=int, default=8, help="new tokens per run (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=1,
                   help="ft_jax prompt length (default %(default)s: a 1-token prefill and N - 1 decode steps are the N "
                        "one-token forward passes of llama-bench's -p 0 -n N, which decodes from one start token; "
                        "a longer prompt adds a prefill that reads more experts than a token does)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (default: all cores)")
    p.add_argument("--ft-jax-args", default="", help="more `ft-jax generate` flags, e.g. '--policy host-all'")
    p.add_argument("--ft-jax-repo", type=Path, default=REPO,
                   help="checkout whose ft_jax runs (put first on PYTHONPATH; default: this one)")
    p.add_argument("--baseline-repo", type=Path, default=None,
                   help="also run the ft_jax of this checkout (e.g. /work/main) as program 'baseline', alternated with "
                        "the others: a before/after comparison in the same rounds")
    p.add_argument("--model", type=Path, default=None,
                   help="HF model folder (default: the bench_peer model under --cache-dir, written if missing)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="GGUF for llama.cpp (default: model-bf16.gguf in the model folder)")
    p.add_argument("--cache-dir", type=Path, default=llama_cpp_build.DEFAULT_CACHE_DIR,
                   help="the bench_peer cache: llama.cpp build and models (default %(default)s)")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (default %(default)s)")
    p.add_argument("--json-out", type=Path, default=None, help="write the JSON result to this file")
    args = p.parse_args(argv)

    if args.model is None:
        config = synthetic_checkpoint.mixtral_config()
        args.model, gguf, _ = bench_peer.ensure_models(args.cache_dir, config, seed=0)
        args.gguf = args.gguf or gguf
    gguf = args.gguf or args.model / "model-bf16.gguf"
    checkpoint = checkpoint_files(args.model)
    bench = find_llama_bench(args.cache_dir)
    programs = ["ft_jax"] + (["baseline"] if args.baseline_repo else [])
    if bench and gguf.is_file():
        programs.append("llama.cpp")
    else:
        why = f"no llama-bench build under {args.cache_dir}" if not bench else f"no {gguf}"
        _log(f"llama.cpp skipped: {why}")
    weight_files = {"ft_jax": checkpoint, "baseline": checkpoint, "llama.cpp": [gguf]}
    file_bytes = {prog: sum(f.stat().st_size for f in files) for prog, files in weight_files.items()
                  if all(f.is_file() for f in files)}
    prompt = bench_peer.prompt_ids(json.loads((args.model / "config.json").read_text())["vocab_size"],
                                   args.prompt_tokens, 0)
    extra = shlex.split(args.ft_jax_args)
    result = {"loadavg_start": bench_peer._loadavg(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "model": str(args.model), "gguf": str(gguf) if "llama.cpp" in programs else None,
              "tokens": args.tokens, "ft_jax_args": extra, "ft_jax_repo": str(args.ft_jax_repo),
              "baseline_repo": str(args.baseline_repo) if args.baseline_repo else None, "rounds": []}
    runs: dict[str, list[dict]] = {prog: [] for prog in programs}
    for rnd in range(args.rounds):
        order = programs[rnd % len(programs):] + programs[:rnd % len(programs)]
        record = {"loadavg": bench_peer._loadavg()}
        for prog in order:
            for f in weight_files[prog]:
                bench_peer.warm_page_cache(f)
            if prog == "llama.cpp":
                r = llama_run(bench, gguf, args.tokens, args.threads, args.timeout)
            else:
                r = ft_jax_run(args.model, prompt, args.tokens, extra, args.timeout,
                               args.ft_jax_repo if prog == "ft_jax" else args.baseline_repo)
            runs[prog].append(r)
            record[prog] = r
            _log(f"round {rnd + 1}/{args.rounds} {prog}: {r['wall_s']:.2f} s, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} "
                 f"GB, {r['minor_faults']} minor faults, other processes {r['other_cores']} cores")
        result["rounds"].append(record)
    result["loadavg_end"] = bench_peer._loadavg()
    result["summary"] = summarize(runs, file_bytes)
    print(format_table(result["summary"]), file=sys.stderr)
    print(f"load average: start {result['loadavg_start']}, end {result['loadavg_end']}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return 0


def checkpoint_files(model: Path) -> list[Path]:
    """The safetensors files of a model folder (the shards an index lists, or model.safetensors)."""
    index = model / "model.safetensors.index.json"
    if index.is_file():
        return [model / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [model / "model.safetensors"]


if __name__ == "__main__":
    sys.exit(main())
