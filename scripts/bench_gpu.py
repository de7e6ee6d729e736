#!/usr/bin/env python3
"""GPU benchmark of the CUDA path, every variant measured side by side in one run (scripts/gpu_check.sh runs it).

Prints four tables (and writes them as JSON to --out/bench_gpu.json):
  1. slot_fill GB/s (the CUDA kernel reading device-mapped host banks; --fill-experts Mixtral-sized experts per call,
     rotating over a bank larger than the last-level cache, into donated slot pools) against cudaMemcpyAsync of the
     same bytes from pinned host memory (cupy), timed windows alternating. Target: ratio >= 0.9.
  2. host_experts GB/s of expert weights read (T = 1 token, k = 2 distinct experts per call, rotating) on the GPU path
     (D2H staging, host-function nodes, the CPU worker pool, H2D) against the same handler on the CPU backend.
  3. Command buffers: the decode step's optimized HLO (an XLA dump) - how many command-buffer computations it has and
     which of ft_jax's custom calls sit inside them - and the replay evidence: over the timed decode steps, how often
     the host_experts submit host node ran against how often its handler body ran (recording).
  4. Decode tokens/s of a synthetic Mixtral-shaped bf16 model (scripts/synthetic_checkpoint.py: H 4096, I 14336,
     8 experts top-2, --layers layers) for resident, fetch-all, host-all, qstar and auto at a --cache-fraction cache,
     the policies interleaved round by round; qstar's fraction and auto's costs come from a quick bandwidth profile
     measured here (ft_jax.offload.profile, stored in --out). Target: qstar >= 1.2 x max(fetch-all, host-all).
     Greedy tokens must be identical across the policies (checked).

Medians over the rounds, spreads (min-max) in brackets; the load average is printed. Needs a GPU, jax with CUDA,
ft_jax built with nvcc, and cupy for the memcpy reference.

    python3 scripts/bench_gpu.py --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the synthetic model, the XLA dump and the JSON")
    p.add_argument("--layers", type=int, default=2, help="layers of the synthetic model (default %(default)s)")
    p.add_argument("--cache-fraction", type=float, default=0.25)
    p.add_argument("--new-tokens", type=int, default=24, help="decode tokens per timed generate")
    p.add_argument("--rounds", type=int, default=2, help="timed generates per policy")
    p.add_argument("--fill-experts", type=int, default=2, help="experts per slot_fill call")
    p.add_argument("--repeats", type=int, default=7, help="timed windows per variant (tables 1, 2)")
    return p


def median_spread(xs):
    return statistics.median(xs), min(xs), max(xs)


def fmt(xs, unit=""):
    m, lo, hi = median_spread(xs)
    return f"{m:8.2f}{unit} [{lo:.2f}-{hi:.2f}]"


def timed(fn, n):
    """Seconds per call of fn() over n calls (fn returns something to block on)."""
    import jax

    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(n):
        r = fn()
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n


def bench_fill_and_host(args, gpu, cpu):
    import cupy
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from ft_jax.kernels import ffi_ops
    from ft_jax.kernels.host_bank import HostBank

    H, inter, E = 4096, 14336, 8
    bf16 = np.dtype(ml_dtypes.bfloat16)
    gate_up = HostBank(E, (2 * inter, H), bf16)  # E x 224 MiB
    down = HostBank(E, (H, inter), bf16)  # E x 112 MiB: 2.6 GiB in all, past any last-level cache
    rng = np.random.default_rng(0)
    for bank in (gate_up, down):
        row = (rng.standard_normal(bank.row_shape, np.float32) * 0.02).astype(bf16)
        for e in range(E):
            bank.write_row(e, row)
    n = args.fill_experts
    expert_bytes = gate_up.row_bytes + down.row_bytes
    fill = jax.jit(lambda p, f, s: ffi_ops.slot_fill_with_errors(p, f, s, (gate_up, down)), donate_argnums=0)
    pools = [(jax.device_put(jnp.zeros((n, 2 * inter, H), jnp.bfloat16), gpu),
              jax.device_put(jnp.zeros((n, H, inter), jnp.bfloat16), gpu))]
    rot = iter(range(10 ** 9))

    def fill_call():
        r = next(rot)
        flat = np.array([(r * n + i) % E for i in range(n)], np.int32)
        pools[0], err = fill(pools[0], flat, np.arange(n, dtype=np.int32))
        return err

    nbytes = n * expert_bytes
    host = cupy.cuda.alloc_pinned_memory(nbytes)
    dev = cupy.empty(nbytes, cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)

    def memcpy_call():
        cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ptr, nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        stream.synchronize()
        return None

    fill_gbps, copy_gbps = [], []
    for _ in range(args.repeats):
        fill_gbps.append(nbytes / timed(fill_call, 4) / 1e9)
        t = time.perf_counter()
        for _ in range(4):
            memcpy_call()
        copy_gbps.append(nbytes * 4 / (time.perf_counter() - t) / 1e9)
    assert int(fill_call()) == 0

    host_fn = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gate_up, down))
    x = np.random.default_rng(1).standard_normal((1, H)).astype(np.float32)
    w = np.full((1, 2), 0.5, np.float32)
    on = {d.platform: [jax.device_put(a, d) for a in (x, w)] for d in (gpu, cpu)}
    host_gbps = {"gpu": [], "cpu": []}
    for _ in range(args.repeats):
        for dev_ in (gpu, cpu):
            xs, ws = on[dev_.platform]

            def call():
                r = next(rot)
                ids = jax.device_put(np.array([[(2 * r) % E, (2 * r + 1) % E]], np.int32), dev_)
                return host_fn(xs, ids, ws)

            host_gbps[dev_.platform].append(2 * expert_bytes / timed(call, 3) / 1e9)
    return dict(fill_gbps=fill_gbps, memcpy_gbps=copy_gbps, host_gpu_gbps=host_gbps["gpu"],
                host_cpu_gbps=host_gbps["cpu"], expert_mib=expert_bytes / 2 ** 20)


def command_buffer_report(dump_dir):
    """Command-buffer computations of the decode step's optimized HLO, and ft_jax custom calls inside them."""
    files = sorted(glob.glob(os.path.join(dump_dir, "*decode_one_token*after_optimizations.txt")))
    if not files:
        return dict(found=False)
    text = open(files[-1]).read()
    comps, current = [], None  # computations: a header line ending in "{" up to a line "}"
    for line in text.splitlines():
        if current is None and line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = [line]
        elif current is not None:
            current.append(line)
            if line.strip() == "}":
                comps.append("\n".join(current))
                current = None
    cmd = [c for c in comps if "command_buffer" in c.split("\n", 1)[0]]
    targets = ("ft_jax_slot_fill", "ft_jax_host_experts_submit", "ft_jax_host_experts_wait",
               "ft_jax_slot_experts_gate_up", "ft_jax_slot_experts_down")
    inside = {t: sum(c.count(t) for c in cmd) for t in targets}
    total = {t: text.count(t) for t in targets}
    return dict(found=True, file=os.path.basename(files[-1]), command_buffers=len(cmd), inside=inside, total=total)


def bench_decode(args, synth_dir):
    import jax.numpy as jnp

    from ft_jax import _ffi
    from ft_jax.offload.profile import resolve_policy
    from ft_jax.checkpoint import load_checkpoint
    from ft_jax.engine.engine import Engine

    ckpt = load_checkpoint(synth_dir, dtype=jnp.bfloat16)
    L_E = ckpt.banks.gate_up.num_rows
    slots = max(1, round(args.cache_fraction * L_E))
    profile = os.path.join(args.out, "profiles.json")
    engines, notes = {}, {}
    for name in ("resident", "fetch-all", "host-all", "qstar", "auto"):
        policy, note = resolve_policy(name, ckpt.banks, ckpt.config.hidden_size, ckpt.config.moe_intermediate_size,
                                      profile=profile, measure=True)
        notes[name] = f"{policy}" + (f" ({note})" if note else "")
        engines[name] = Engine(ckpt, policy=policy, num_slots=slots)
    prompt = [[1, 17, 42, 99, 123, 7, 250, 3]]
    for e in engines.values():  # compile + warm-up
        e.generate(prompt, max_new_tokens=4)
    rates = {k: [] for k in engines}
    tokens = {}
    stats = {}
    before = after = None
    for r in range(args.rounds):
        for name, e in engines.items():
            e.expert_state = e.decode_backend.init_state(e.num_slots)  # cold cache: identical routing every run
            before = _ffi.cuda_counters() if name == "qstar" and r == 0 else before
            res = e.generate(prompt, max_new_tokens=args.new_tokens)
            after = _ffi.cuda_counters() if name == "qstar" and r == 0 else after
            rates[name].append(res.stats["decode_tokens_per_s"])
            tokens.setdefault(name, res.tokens[0])
            stats[name] = {k: res.stats[k] for k in ("hit_rate", "fetched_per_step", "host_per_step",
                                                    "decode_compiles")}
    replay = {k: after[k] - before[k] for k in after}
    same = all(t == tokens["resident"] for t in tokens.values())
    return dict(slots=slots, experts=L_E, policies=notes, tokens_per_s=rates, stats=stats, greedy_identical=same,
                qstar_counters=replay)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dump = os.path.join(args.out, "xla_dump")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text "
                               "--xla_dump_hlo_module_re=.*decode_one_token.*").strip()
    import jax

    import ft_jax

    if not ft_jax.CUDA_ENABLED:
        print("bench_gpu: ft_jax.CUDA_ENABLED is False (no GPU, or the extension was built without nvcc)",
              file=sys.stderr)
        return 2
    gpu, cpu = jax.devices("cuda")[0], jax.devices("cpu")[0]
    print(f"device {gpu.device_kind}; jax {jax.__version__}; load average {os.getloadavg()}", flush=True)

    synth = os.path.join(args.out, "mixtral_synthetic")
    if not os.path.exists(os.path.join(synth, "config.json")):
        t = time.perf_counter()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "synthetic_checkpoint.py")
        code = os.system(f"{sys.executable} {script} {synth} --hidden 4096 --intermediate 14336 --layers "
                         f"{args.layers} --heads 32 --kv-heads 8 --head-dim 128 --vocab 32000 > /dev/null")
        if code:
            print("bench_gpu: synthetic_checkpoint.py failed", file=sys.stderr)
            return 1
        print(f"synthetic Mixtral-shaped checkpoint ({args.layers} layers) written in "
              f"{time.perf_counter() - t:.1f} s", flush=True)

    r1 = bench_fill_and_host(args, gpu, cpu)
    fill, copy = statistics.median(r1["fill_gbps"]), statistics.median(r1["memcpy_gbps"])
    print(f"\n1. slot_fill ({args.fill_experts} experts of {r1['expert_mib']:.0f} MiB per call)")
    print(f"   slot_fill (mapped banks)     {fmt(r1['fill_gbps'], ' GB/s')}")
    print(f"   cudaMemcpy pinned H2D        {fmt(r1['memcpy_gbps'], ' GB/s')}")
    print(f"   ratio {fill / copy:.3f} (target >= 0.9)")
    hg, hc = statistics.median(r1["host_gpu_gbps"]), statistics.median(r1["host_cpu_gbps"])
    print("\n2. host_experts (T 1, k 2, weights read)")
    print(f"   GPU path (submit/wait)       {fmt(r1['host_gpu_gbps'], ' GB/s')}")
    print(f"   CPU backend handler          {fmt(r1['host_cpu_gbps'], ' GB/s')}")
    print(f"   ratio {hg / hc:.3f}", flush=True)

    r4 = bench_decode(args, synth)
    r3 = command_buffer_report(dump)
    c = r4["qstar_counters"]
    print("\n3. command buffers (decode step, qstar)")
    if r3["found"]:
        print(f"   {r3['file']}: {r3['command_buffers']} command-buffer computations")
        for t in r3["total"]:
            print(f"   {t:32s} {r3['inside'][t]} of {r3['total'][t]} inside command buffers")
    else:
        print("   no optimized HLO of the decode step in the dump")
    print(f"   one timed generate: submit host nodes {c['host_submits']}, submit handler bodies "
          f"{c['submit_records']}, wait host nodes {c['host_waits']}, slot_fill bodies {c['slot_fill_records']}")
    print(f"   replays: {'yes' if c['host_submits'] > c['submit_records'] else 'no'} "
          f"(host nodes {c['host_submits']} {'>' if c['host_submits'] > c['submit_records'] else '<='} records "
          f"{c['submit_records']})")

    print(f"\n4. decode, synthetic Mixtral-shaped bf16, {args.layers} layers, {r4['slots']} of {r4['experts']} experts "
          f"as slots ({args.cache_fraction:.0%})")
    for name, xs in r4["tokens_per_s"].items():
        s = r4["stats"][name]
        print(f"   {name:10s} {fmt(xs, ' tok/s')}  hit {s['hit_rate'] or 0:.2f} fetched/step "
              f"{s['fetched_per_step'] or 0:.2f} host/step {s['host_per_step'] or 0:.2f} compiles "
              f"{s['decode_compiles']}  {r4['policies'][name]}")
    med = {k: statistics.median(v) for k, v in r4["tokens_per_s"].items()}
    print(f"   qstar / max(fetch-all, host-all) = {med['qstar'] / max(med['fetch-all'], med['host-all']):.3f} "
          f"(target >= 1.2); auto / max = {med['auto'] / max(med['fetch-all'], med['host-all']):.3f}")
    print(f"   greedy tokens identical across policies: {r4['greedy_identical']}")
    print(f"load average {os.getloadavg()}")
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as f:
        json.dump(dict(fill_host=r1, command_buffers=r3, decode=r4), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
