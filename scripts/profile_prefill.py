#!/usr/bin/env python3
"""Where the prefill time goes: per-part time and FLOP/s of ft_jax's prefill, from XLA's profiler.

    python3 scripts/profile_prefill.py --model DIR --prompt-len 512,2048            # host-all, chunk 256
    python3 scripts/profile_prefill.py --model DIR --prompt-len 2048 --chunk 512 --policy resident --json
    python3 scripts/profile_prefill.py --model DIR --prompt-len 512 --top-ops 20     # also the 20 costliest ops

What it does: loads the checkpoint (bf16 model dtype) into an Engine with the given policy and chunk size, runs
``Engine.generate(prompt, max_new_tokens=1)`` once untimed (compilation, warm caches), then once more under
``jax.profiler.trace``. XLA:CPU records one trace event per executed op (thunk) under the op's name in the optimized
HLO; the script reads each op's ``op_name`` metadata (the JAX name stack, which carries the model's
``jax.named_scope`` names: attention/qkv_proj, attention/softmax_attention, attention/o_proj, ffn/router,
ffn/experts, ffn/shared_experts, lm_head) from the compiled prefill executable's HLO and sums the events' durations
per part. Control-flow ops (while, conditional, call) are not counted (their bodies' ops are). The rest of the
attention scope (the KV-cache write, RoPE) is "attention (other)"; ops outside every scope are "other" (embedding
gather, norms, residual adds, sampling).

FLOPs are counted from the config (multiply-add = 2 FLOPs) for the work the step must do:
  qkv_proj 2 P H (NH + 2 KVH) D; o_proj 2 P NH D H; router 2 P H E; experts 2 P k 3 H I (gate, up, down of each of
  the top-k routes); lm_head 2 B V H (the last position of each row only); softmax_attention 4 NH D times the
  causal (query, key) pairs sum_p (p + 1) (scores and values), and separately the pairs the chunked block loop
  computes: per chunk c tokens x (blocks read) x 128 keys (docs/DESIGN.md sec. 11).
Reported per part: milliseconds (sum of its ops' events; ops that run side by side on two threads may sum above the
wall time), share of the summed op time, GFLOP/s. A profile, not a benchmark: the profiler adds a little per op.
Run it under ``flock /work/bench.lock`` on a shared machine; the load average is printed with the numbers.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PARTS = ("attention/qkv_proj", "attention/softmax_attention", "attention/o_proj", "attention (other)",
         "ffn/router", "ffn/experts", "ffn/shared_experts", "lm_head", "other")
CONTROL_OPS = ("while", "conditional", "call")
KV_BLOCK_KEYS = 128


def _log(msg: str) -> None:
    print(f"[profile_prefill] {msg}", file=sys.stderr, flush=True)


def _part_of_stack(stack: str) -> str | None:
    """The PARTS entry a JAX name stack (op_name metadata) belongs to, or None for a stack outside every part."""
    for p in PARTS[:-2]:
        if p == "attention (other)":
            continue
        if f"/{p}/" in stack or stack.endswith(f"/{p}"):
            return p
    if "/attention/" in stack or stack.endswith("/attention"):
        return "attention (other)"
    if "/lm_head/" in stack or stack.endswith("/lm_head"):
        return "lm_head"
    return None


def _opcode(line: str) -> str:
    """The opcode of an HLO instruction line "name = TYPE opcode(operands), ..." (TYPE may be a nested tuple)."""
    rest = line.split("=", 1)[1].lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(None, 1)[1] if " " in rest else ""
    return rest.lstrip().split("(", 1)[0].strip()


def op_parts(hlo_text: str) -> dict[str, str | None]:
    """{HLO instruction name: part} of an optimized HLO module's text (None: a control-flow op, whose body's ops are
    counted instead). An op's part comes from the name stack of its op_name metadata; a fusion without metadata
    takes the first part named inside its fused computation; an op with neither takes the part of the op that
    calls its computation (a while loop's body ops inherit the loop's part); else "other"."""
    comp_re = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
    instr_re = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(")
    calls_re = re.compile(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)|branch_computations=\{([%\w.\-, ]+)\}")
    comps: dict[str, list] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            m = comp_re.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = instr_re.match(line)
        if not m:
            continue
        opcode = _opcode(line)
        meta = re.search(r'op_name="([^"]*)"', line)
        called = [c.strip().lstrip("%") for cm in calls_re.finditer(line) for c in (cm.group(1) or cm.group(2)).split(",")]
        comps[current].append((m.group(1), opcode, _part_of_stack(meta.group(1)) if meta else None,
                               bool(meta), [c for c in called if c]))

    def inner_part(comp: str, seen: set) -> str | None:
        for _, _, part, _, called in comps.get(comp, ()):
            if part is not None:
                return part
        for _, _, _, _, called in comps.get(comp, ()):
            for c in called:
                if c not in seen:
                    seen.add(c)
                    found = inner_part(c, seen)
                    if found is not None:
                        return found
        return None

    parts: dict[str, str | None] = {}

    def visit(comp: str, inherited: str | None, seen: set) -> None:
        for name, opcode, part, has_meta, called in comps.get(comp, ()):
            own = part if part is not None else (inner_part(called[0], set()) if opcode == "fusion" and called
                                                 else None)
            here = own or inherited
            parts[name] = None if opcode in CONTROL_OPS else (here or "other")
            if opcode != "fusion":
                for c in called:
                    if c not in seen:
                        seen.add(c)
                        visit(c, here, seen)

    visit(entry, None, {entry})
    return parts


def trace_op_times(trace_dir: Path, names: set[str]) -> tuple[dict[str, float], dict[str, int]]:
    """({op name: total microseconds}, {op name: event count}) of the complete ("X") events in the newest trace
    under trace_dir whose name is one of ``names``."""
    files = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        raise RuntimeError(f"no trace file under {trace_dir}")
    events = json.load(gzip.open(files[-1]))["traceEvents"]
    total, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in names:
            total[e["name"]] += float(e.get("dur", 0.0))
            count[e["name"]] += 1
    return total, count


def part_flops(cfg, prompt_len: int, chunk: int, batch: int = 1) -> dict[str, float]:
    """FLOPs of each part for a prompt of prompt_len tokens per row (module docstring)."""
    P, H, D = prompt_len, cfg.hidden_size, cfg.head_dim
    NH, KVH, E, k = cfg.num_heads, cfg.num_kv_heads, cfg.num_experts, cfg.top_k
    I = cfg.moe_intermediate_size or cfg.intermediate_size
    L = cfg.num_layers
    pairs = P * (P + 1) // 2
    computed = 0
    n_chunks = -(-P // chunk)
    for c in range(n_chunks):
        live = (c + 1) * chunk  # padded to whole chunks on the left: the last chunk ends at the prompt's end
        computed += chunk * -(-live // KV_BLOCK_KEYS) * KV_BLOCK_KEYS
    return {"attention/qkv_proj": 2.0 * batch * L * P * H * (NH + 2 * KVH) * D,
            "attention/o_proj": 2.0 * batch * L * P * NH * D * H,
            "attention/softmax_attention": 4.0 * batch * L * NH * D * pairs,
            "attention/softmax_attention (computed)": 4.0 * batch * L * NH * D * computed,
            "ffn/router": 2.0 * batch * L * P * H * E,
            "ffn/experts": 2.0 * batch * L * P * k * 3 * H * I,
            "lm_head": 2.0 * batch * cfg.vocab_size * H}


def profile_one(engine, cfg, prompt_len: int, chunk: int, seed: int, top_ops: int) -> dict:
    """The profile of one prompt length (module docstring)."""
    import jax

    rng = np.random.default_rng(seed + prompt_len)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, prompt_len)]
    engine.prefill_chunk = chunk
    t0 = time.perf_counter()
    engine.generate([prompt], max_new_tokens=1)  # compile + warm
    _log(f"P={prompt_len}: compiled and warmed in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    untraced = engine.generate([prompt], max_new_tokens=1).stats
    wall_untraced = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        t0 = time.perf_counter()
        stats = engine.generate([prompt], max_new_tokens=1).stats
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        hlo = "\n".join(exe.as_text() for key, exe in engine._executables.items() if key[0] == "prefill")
        parts = op_parts(hlo)
        times, counts = trace_op_times(Path(tmp), {n for n, p in parts.items() if p is not None})
    per_part = collections.defaultdict(float)
    for name, us in times.items():
        per_part[parts[name]] += us
    summed = sum(per_part.values())
    flops = part_flops(cfg, prompt_len, chunk)
    rows = {}
    for p in PARTS:
        ms = per_part.get(p, 0.0) / 1e3
        row = {"ms": round(ms, 2), "share": round(per_part.get(p, 0.0) / summed, 4) if summed else None}
        if p in flops and ms > 0:
            row["gflop"] = round(flops[p] / 1e9, 2)
            row["gflop_per_s"] = round(flops[p] / (ms / 1e3) / 1e9, 1)
            if p == "attention/softmax_attention":
                comp = flops["attention/softmax_attention (computed)"]
                row["gflop_computed"] = round(comp / 1e9, 2)
                row["gflop_per_s_computed"] = round(comp / (ms / 1e3) / 1e9, 1)
        rows[p] = row
    ops = sorted(times.items(), key=lambda kv: -kv[1])[:top_ops]
    prefill_s = stats["time_to_first_token_s"] if "time_to_first_token_s" in stats else None
    return {"prompt_len": prompt_len, "chunk": chunk, "wall_s_traced": round(wall, 3),
            "wall_s_untraced": round(wall_untraced, 3), "summed_op_ms": round(summed / 1e3, 1),
            "prefill_tokens_per_s_untraced": untraced.get("prefill_tokens_per_s"),
            "prefill_tokens_per_s_traced": stats.get("prefill_tokens_per_s"), "time_to_first_token_s": prefill_s,
            "parts": rows,
            "top_ops": [{"op": n, "part": parts[n], "ms": round(us / 1e3, 2), "calls": counts[n]} for n, us in ops]}


def format_table(result: dict) -> str:
    lines = [f"profile_prefill: policy {result['policy']}, {result['threads']} FFI threads, load average before "
             f"{result['load_average']['before']}, after {result['load_average']['after']}"]
    for prof in result["profiles"]:
        lines.append(f"P = {prof['prompt_len']} tokens, chunk {prof['chunk']}: prefill "
                     f"{prof['prefill_tokens_per_s_untraced']:.1f} tok/s untraced "
                     f"({prof['prefill_tokens_per_s_traced']:.1f} traced), summed op time {prof['summed_op_ms']} ms")
        lines.append(f"  {'part':<32} {'ms':>9} {'share':>6} {'GFLOP':>8} {'GFLOP/s':>8}")
        for p, row in prof["parts"].items():
            share = f"{100 * row['share']:.1f}%" if row["share"] is not None else "-"
            gf = f"{row['gflop']:.1f}" if "gflop" in row else ""
            rate = f"{row['gflop_per_s']:.1f}" if "gflop_per_s" in row else ""
            extra = (f"  (computed by the block loop: {row['gflop_computed']:.1f} GFLOP, "
                     f"{row['gflop_per_s_computed']:.1f} GFLOP/s)") if "gflop_computed" in row else ""
            lines.append(f"  {p:<32} {row['ms']:9.1f} {share:>6} {gf:>8} {rate:>8}{extra}")
        if prof["top_ops"]:
            lines.append("  costliest ops: " + "; ".join(f"{o['op']} ({o['part']}) {o['ms']:.1f} ms x{o['calls']}"
                                                        for o in prof["top_ops"]))
    return "\n".join(lines)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The flags profile_prefill.py and profile_decode.py share: the model, its policy and cache, the weights'
    quantization, the seed and the JSON output."""
    p.add_argument("--model", required=True, help="Hugging Face model folder (e.g. bench_peer's synthetic model)")
    p.add_argument("--policy", default="host-all", help="ft_jax policy (default %(default)s)")
    p.add_argument("--cache-fraction", type=float, default=0.5, help="slots as a fraction of all experts")
    p.add_argument("--quantize", default=None, help="q8_0 or q4_0: quantize the weights while loading")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the JSON result to stdout")
    p.add_argument("--json-out", type=Path, default=None, help="write the JSON result to this file")


def load_engine(args, dtype: str = "bfloat16", log=None):
    """(Engine, config, bound policy, load average before loading) of add_engine_arguments' flags: the checkpoint in
    ``dtype`` (quantized with --quantize), qstar without a fraction at 0.5, --cache-fraction of all experts as
    slots (at least one)."""
    import jax.numpy as jnp

    from ft_jax.checkpoint import load_checkpoint
    from ft_jax.engine.engine import Engine
    from ft_jax.offload.policy import parse_policy

    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.model, dtype=getattr(jnp, dtype), quantize=args.quantize)
    cfg = ckpt.config
    (log or _log)(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s")
    policy = parse_policy(args.policy)
    if policy.kind.value == "qstar" and policy.frac is None:
        policy = policy.with_frac(0.5)
    total = cfg.num_experts * sum(1 for l in range(cfg.num_layers) if cfg.moe_layer_index(l) is not None)
    engine = Engine(ckpt, policy=policy, num_slots=max(1, int(total * args.cache_fraction)))
    return engine, cfg, policy, load_before


def write_result(args, result: dict, table: str) -> None:
    """The table on stderr; the JSON to --json-out and, with --json, to stdout."""
    print(table, file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    if args.json:
        print(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    p.add_argument("--prompt-len", default="512,2048", help="comma-separated prompt lengths (default %(default)s)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: ft_jax's default)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--top-ops", type=int, default=0, help="also list the N costliest ops")
    args = p.parse_args(argv)

    from ft_jax.defaults import DEFAULT_PREFILL_CHUNK

    lengths = [int(x) for x in args.prompt_len.split(",") if x.strip()]
    chunk = args.chunk or DEFAULT_PREFILL_CHUNK
    engine, cfg, policy, load_before = load_engine(args, args.dtype)
    profiles = [profile_one(engine, cfg, n, chunk, args.seed, args.top_ops) for n in lengths]
    result = {"model": args.model, "policy": str(policy), "dtype": args.dtype, "quantize": args.quantize,
              "threads": os.environ.get("FT_JAX_NUM_THREADS", str(os.cpu_count())),
              "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
              "profiles": profiles}
    write_result(args, result, format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
