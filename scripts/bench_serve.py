#!/usr/bin/env python3
"""Serving throughput and time to first token: `ft-jax serve` against llama-server on the Mixtral-shaped bench model.

    flock /work/bench.lock python3 scripts/bench_serve.py --json-out /tmp/bench_serve.json
    python3 scripts/bench_serve.py --clients 1,4 --rounds 2 --requests 2 --new-tokens 24     # shorter
    python3 scripts/bench_serve.py --programs ft_jax --clients 8                           # one side only
    python3 scripts/bench_serve.py --clients 1,4 --rows 8              # servers of 8 rows (ft-jax serve's default)

What runs (all on the CPU, side by side in one run): for each number of concurrent clients C (--clients, default
1,4,8) both servers are started with C rows (or --rows), `ft-jax serve --max-batch C` (--policy, default host-all
with one cache slot, the CPU setting of the README) and `llama-server --parallel C` (built from the llama-cpp-python
sdist by scripts/llama_cpp_build.py; -c C x the per-row context, -t --threads), each on the same weights
(bench_peer.py's synthetic checkpoint and its GGUF). Then --rounds rounds alternate between them (the first server of
a round alternates too): in a round, C client threads each send --requests streamed /v1/completions requests one
after the other, each with a prompt of its own (--prompt-len random token ids: no prefix cache can help; llama-server
gets cache_prompt false), --new-tokens tokens, temperature 0 and ignore_eos (every request generates all its tokens).

Reported per (program, C): aggregate tokens/s (all generated tokens of the round / the round's wall time, prefills
included) as median [min-max] over the rounds; decode tokens/s (tokens after each request's first / the summed
time from first to last token, x C: the rate of the decode steps under load); p50 and p99 time to first token over
every request of every round (send to the first streamed token event); the ratio ft_jax / llama-server of the medians;
the load average before and after each round. JSON to --json-out / --json; the table to stderr.

ft_jax's side needs a tokenizer to send text: a folder beside the model's (symbolic links to its files) gets a
word-level tokenizer.json over llama.cpp's placeholder vocabulary (mixtral_to_gguf.dummy_spm_vocab), so both sides
decode the same ids to the same pieces. Needs the serve extra (fastapi, uvicorn, prometheus-client), httpx, gguf and
the tokenizers package; cmake and a C++ compiler for the llama.cpp build.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peer  # noqa: E402
import llama_cpp_build  # noqa: E402
import mixtral_to_gguf  # noqa: E402
import synthetic_checkpoint  # noqa: E402

PROGRAMS = ("ft_jax", "llama-server")


def _log(msg: str) -> None:
    print(f"[bench_serve] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_folder(model_dir: Path, vocab_size: int) -> Path:
    """model_dir's files linked into model_dir-serve/ with a word-level tokenizer.json over the placeholder SPM
    vocabulary of its GGUF (written once)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = model_dir.with_name(model_dir.name + "-serve")
    folder.mkdir(exist_ok=True)
    for item in model_dir.iterdir():
        link = folder / item.name
        if not link.exists():
            link.symlink_to(item)
    path = folder / "tokenizer.json"
    if not path.is_file():
        tokens, _, _ = mixtral_to_gguf.dummy_spm_vocab(vocab_size)
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.Metaspace()
        tok.save(str(path))
    return folder


class Server:
    """A server subprocess on a free port: start() waits for /health; stop() ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None):
        self.name, self.cmd, self.env = name, cmd, env
        self.port = _free_port()
        self.cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = self.log = None

    def start(self, timeout: float) -> float:
        t0 = time.perf_counter()
        self.log = open(f"/tmp/bench_serve_{self.name}_{self.port}.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} while starting (log {self.log.name})")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s (log {self.log.name})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()


def one_request(url: str, prompt: list[int], new_tokens: int, extra: dict) -> dict:
    """One streamed completion: {"ttft_s", "first_s" and "end_s" (perf_counter), "tokens"}. The first token is the
    first event with a choice and no finish reason (llama-server sends one per token, its text possibly empty while a
    UTF-8 sequence is incomplete)."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices") and event["choices"][0].get("finish_reason") is None:  # a token's event
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    first = end if first is None else first  # no token event: every token was an incomplete UTF-8 piece (llama)
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": first - t0, "first_s": first, "end_s": end, "tokens": tokens}


def run_round(url: str, clients: int, requests: int, prompts: list[list[int]], new_tokens: int,
              extra: dict) -> dict:
    """clients threads, each sending its share of prompts one after the other."""
    results: list[dict] = []
    errors: list[str] = []

    def client(c: int) -> None:
        for r in range(requests):
            try:
                results.append(one_request(url, prompts[c * requests + r], new_tokens, extra))
            except Exception as e:  # reported with the round
                errors.append(f"{type(e).__name__}: {e}")

    load_before = bench_peer._loadavg()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    tokens = sum(r["tokens"] for r in results)
    decode_s = sum(r["end_s"] - r["first_s"] for r in results)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": tokens / wall,
            "decode_tokens_per_s": clients * sum(r["tokens"] - 1 for r in results) / decode_s if decode_s else None,
            "ttft_s": [round(r["ttft_s"], 4) for r in results], "loadavg_before": load_before,
            "loadavg_after": bench_peer._loadavg()}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summarize(rounds: dict[str, list[dict]]) -> dict:
    out = {}
    for program, rs in rounds.items():
        if not rs:
            continue
        rates = [r["tokens_per_s"] for r in rs]
        decode = [r["decode_tokens_per_s"] for r in rs if r["decode_tokens_per_s"]]
        ttft = [t for r in rs for t in r["ttft_s"]]
        out[program] = {"tokens_per_s": statistics.median(rates), "tokens_per_s_range": [min(rates), max(rates)],
                        "decode_tokens_per_s": statistics.median(decode) if decode else None,
                        "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
                        "requests": len(ttft)}
    if len(out) == 2:
        a, b = out["ft_jax"], out["llama-server"]
        out["ratio_ft_jax_over_llama_server"] = {
            "tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
            "decode_tokens_per_s": (a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                                    if a["decode_tokens_per_s"] and b["decode_tokens_per_s"] else None)}
    return out


def format_table(result: dict) -> str:
    lines = [f"{'clients':>7} {'rows':>4}  {'program':<13} {'tok/s':>8} {'[min-max]':>17} {'decode tok/s':>13} "
             f"{'TTFT p50':>9} {'p99':>8}"]
    for level in result["levels"]:
        for program in PROGRAMS:
            s = level["summary"].get(program)
            if s is None:
                continue
            lo, hi = s["tokens_per_s_range"]
            dec = "-" if s["decode_tokens_per_s"] is None else f"{s['decode_tokens_per_s']:.1f}"
            rows = level.get("rows", level["clients"])
            lines.append(f"{level['clients']:>7} {rows:>4}  {program:<13} {s['tokens_per_s']:>8.1f} "
                         f"{f'[{lo:.1f}-{hi:.1f}]':>17} {dec:>13} {s['ttft_p50_s']:>8.2f}s {s['ttft_p99_s']:>7.2f}s")
        ratio = level["summary"].get("ratio_ft_jax_over_llama_server")
        if ratio:
            lines.append(f"{'':>12}  ft_jax / llama-server: tokens/s {ratio['tokens_per_s']:.2f}x" +
                         (f", decode {ratio['decode_tokens_per_s']:.2f}x" if ratio["decode_tokens_per_s"] else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,4,8", help="comma-separated concurrent clients (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per number of clients (default %(default)s)")
    p.add_argument("--requests", type=int, default=2, help="requests per client per round (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per request (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default %(default)s)")
    p.add_argument("--ctx-size", type=int, default=256, help="tokens per row on both sides (default %(default)s)")
    p.add_argument("--rows", type=int, default=None,
                   help="rows of both servers (--max-batch, --parallel); default: the number of clients")
    p.add_argument("--programs", default=",".join(PROGRAMS), help="subset of %(default)s")
    p.add_argument("--policy", default="host-all", help="ft-jax serve --policy (default %(default)s)")
    p.add_argument("--cache-slots", type=int, default=1, help="ft-jax serve --cache-slots (default %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="llama-server -t and ft_jax's FT_JAX_NUM_THREADS (default: all %(default)s cores)")
    p.add_argument("--cache-dir", type=Path, default=llama_cpp_build.DEFAULT_CACHE_DIR,
                   help="llama.cpp build and model folders, as bench_peer.py (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default 0)")
    p.add_argument("--start-timeout", type=float, default=1800, help="seconds a server may take to be ready")
    p.add_argument("--json-out", type=Path, default=None, help="write the JSON result to this file")
    p.add_argument("--json", action="store_true", help="print the JSON result to stdout")
    g = p.add_argument_group("model (scripts/synthetic_checkpoint.py)")
    synthetic_checkpoint.add_model_arguments(g)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    levels = [int(c) for c in args.clients.split(",")]
    programs = [p for p in args.programs.split(",") if p]
    if not levels or min(levels) < 1 or any(p not in PROGRAMS for p in programs):
        raise SystemExit(f"bench_serve: --clients takes integers >= 1 and --programs a subset of {PROGRAMS}")
    config = synthetic_checkpoint.config_from_args(args)
    model_dir, gguf_path, _ = bench_peer.ensure_models(args.cache_dir, config, args.seed)
    folder = serve_folder(model_dir, config["vocab_size"])
    server_bin = None
    if "llama-server" in programs:
        build = llama_cpp_build.ensure_llama_cpp(args.cache_dir, targets=("llama-server",))
        server_bin = build["binaries"]["llama-server"]
    env = {**os.environ, "FT_JAX_NUM_THREADS": str(args.threads)}
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "model": str(model_dir), "gguf": str(gguf_path), "loadavg_start": bench_peer._loadavg(), "levels": []}
    for clients in levels:
        rows = args.rows or clients
        n = args.rounds * clients * args.requests
        prompts = [bench_peer.prompt_ids(config["vocab_size"], args.prompt_len, args.seed * 1000 + i) for i in range(n)]
        servers = {}
        if "ft_jax" in programs:
            servers["ft_jax"] = Server("ft_jax", bench_peer.ft_jax_command() + [
                "serve", "--model", str(folder), "--port", "{port}", "--max-batch", str(rows), "--ctx-size",
                str(args.ctx_size), "--policy", args.policy, "--cache-slots", str(args.cache_slots),
                "--max-queue", str(n)], env)
        if "llama-server" in programs:
            servers["llama-server"] = Server("llama-server", [
                server_bin, "-m", str(gguf_path), "--port", "{port}", "--host", "127.0.0.1", "--parallel",
                str(rows), "-c", str(args.ctx_size * rows), "-t", str(args.threads), "--no-warmup"])
        extra = {"ft_jax": {}, "llama-server": {"cache_prompt": False}}
        level = {"clients": clients, "rows": rows, "start_s": {}, "rounds": {p: [] for p in servers}}
        try:
            for name, server in servers.items():
                _log(f"starting {name} with {rows} rows")
                if name == "llama-server":  # memory-mapped: read once (ft_jax reads its checkpoint while loading)
                    bench_peer.warm_page_cache(gguf_path)
                level["start_s"][name] = round(server.start(args.start_timeout), 1)
                # an untimed round (C clients, one short request each): every executable built (ft_jax compiles a
                # prefill shape on its first use: one row, and all rows for a group), the weights paged in
                run_round(server.url, clients, 1, prompts[:clients], 2, extra[name])
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    chunk = prompts[r * clients * args.requests:(r + 1) * clients * args.requests]
                    res = run_round(servers[name].url, clients, args.requests, chunk, args.new_tokens, extra[name])
                    level["rounds"][name].append(res)
                    _log(f"{clients} clients, round {r + 1}, {name}: {res['tokens_per_s']:.1f} tok/s, TTFT max "
                         f"{max(res['ttft_s']):.2f} s, load {res['loadavg_before']}")
        finally:
            for server in servers.values():
                server.stop()
        level["summary"] = summarize(level["rounds"])
        result["levels"].append(level)
    result["loadavg_end"] = bench_peer._loadavg()
    print(format_table(result), file=sys.stderr)
    print(f"load average: start {result['loadavg_start']}, end {result['loadavg_end']}", file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text)
    if args.json:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
