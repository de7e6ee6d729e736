#!/usr/bin/env python3
"""Benchmark of the ft_jax FFI handlers against numpy baselines, measured side by side in one run.

Uses the bandwidth profile's measuring harness (ft_jax.offload.profile: ``Bench`` for the banks, slots, jitted
production calls and the row rotation past twice the last-level cache; ``measure_rates`` for alternating timed
windows). Prints three tables:
  1. slot_fill GB/s (n experts per call copied from the host banks into donated slot arrays inside jax.jit) divided
     by numpy memcpy GB/s (np.copyto of the same rows into numpy slot arrays, same rotation), at experts of about
     1-8 MiB (H=1024, float32). Goal: ratio >= 0.9.
  2. host_experts GB/s of expert weights read (gate_up + down bytes of every routed expert per call) divided by
     numpy read bandwidth (np.add.reduce over the same bank rows viewed as float32, on 1 thread and on as many
     threads as the kernel uses), at Mixtral-like experts scaled to fit memory (default H=4096, I=3584, bf16:
     84 MiB per expert). Goal: >= 0.8. All T tokens go to the same k experts (the most arithmetic per byte).
     Also the gpt-oss form of the same call (gate_up/down bias banks and the clamped SwiGLU "swiglu_oai"; its GB/s
     count the bias bytes too) and its ratio to the plain call: the biases should cost nothing measurable.
  3. In-graph cost of one FFI call (microseconds): a jit of 200 chained slot_fill calls that copy nothing
     minus a jit with none, per call.
  4. (--formats) host_experts on stored weight formats (bf16, q8_0, q4_0, q4_0x16, mxfp4, fp8 128 x 128; q4_0x16 is
     q4_0 in groups of 16 interleaved rows, how the CPU keeps q4_0 at the AVX-512 level: weight_formats.Q4_0_X16, and
     q4_0 here is the row layout, as an AVX2 CPU or a GPU keeps it) at T in --tokens
     (every token routed to the same k experts; x of --dtype: bfloat16 as a bf16 model passes it, or float32): GB/s of
     STORED bytes read per call (data + scales of the k routed experts) divided by numpy read GB/s of the same bytes
     (np.add.reduce over them viewed as int64, split over the kernel's thread count), at H=2048, I=5632 (a
     Mixtral-like expert scaled to fit memory), 8 experts, k=2, consecutive calls rotating over the experts (no
     call finds its weights in cache). Goal: >= 0.85 for every format.

Figures are medians over --repeats timed windows of --min-time seconds each, the variants of a table alternating
window by window; the spread (min-max) is in brackets; "ratio" divides the medians, "best" the maxima (steadier when
other processes share the memory bus). The load average is printed with the results. Default sizes use about
0.6 GiB of memory and run in well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import itertools
import os
import statistics
import time

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np

from ft_jax import _ffi
from ft_jax import weight_formats as wf
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
from ft_jax.offload.profile import Bench, measure_rates

MiB = 1 << 20


def bench_slot_fill(expert_mib: float, experts_per_call: int, repeats: int, min_time: float) -> tuple:
    """(expert MiB, slot_fill rate, numpy copy rate); rates are (median, min, max) GB/s."""
    H = 1024
    I = max(1, round(expert_mib * MiB / (3 * H * 4)))
    with Bench(H, I, "float32", call_bytes=experts_per_call * 3 * H * I * 4) as b:
        gate_up, down = b.gate_up.numpy(), b.down.numpy()  # [2R, 2I, H], [2R, H, I]
        # Written: no first-touch page faults while timed.
        slots = [np.ones((b.rows, *bank.shape[1:]), np.float32) for bank in (gate_up, down)]
        calls = itertools.count()

        def numpy_copy():
            j = next(calls)
            for row in b.fill_rows[j % len(b.fill_rows)]:  # bank row r goes to slot r, as in Bench.fill
                np.copyto(slots[0][row], gate_up[row])
                np.copyto(slots[1][row], down[row])

        rates = measure_rates({"ffi": (b.fill, b.nbytes), "numpy": (numpy_copy, b.nbytes)}, repeats, min_time)
        del gate_up, down
        return b.expert_bytes / MiB, rates["ffi"], rates["numpy"]


def kernel_threads() -> int:
    """Threads the FFI kernels use: XLA's CPU pool (one per CPU this process may run on), capped by
    FT_JAX_NUM_THREADS."""
    cap = int(os.environ.get("FT_JAX_NUM_THREADS", "0") or 0)
    cores = len(os.sched_getaffinity(0))
    return min(cores, cap) if cap >= 1 else cores


def bench_host_experts(hidden: int, inter: int, dtype: str, T: int, k: int, repeats: int, min_time: float) -> tuple:
    """(bytes per call, host_experts rate, numpy read rate on 1 thread, on the kernel's thread count, rate of the
    gpt-oss form: bias banks + swiglu_oai)."""
    threads = kernel_threads()
    with Bench(hidden, inter, dtype, call_bytes=k * 3 * hidden * inter * (2 if dtype == "bfloat16" else 4),
               tokens=T) as b, ThreadPoolExecutor(threads) as pool:
        gate_up, down = b.gate_up.numpy(), b.down.numpy()
        biases = (HostBank(b.gate_up.num_rows, (2 * inter,), b.gate_up.dtype),
                  HostBank(b.gate_up.num_rows, (hidden,), b.gate_up.dtype))
        for bank in biases:
            bank.numpy()[...] = np.asarray(0.01, bank.dtype)
        gpt_oss = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, b.gate_up, b.down, "swiglu_oai",
                                                               gate_up_bias=biases[0], down_bias=biases[1]))
        ids = [jnp.asarray(np.tile(r, (T, 1))) for r in b.gemv_rows]  # each i32[T, n]: the rotation of Bench.gemv
        x = jnp.asarray(np.linspace(-1.0, 1.0, T * hidden, dtype=np.float32).reshape(T, hidden))  # f32[T, H]
        w = jnp.full((T, b.n), 1.0 / b.n, jnp.float32)  # f32[T, n]
        bias_calls = itertools.count()

        def gemv_bias():
            gpt_oss(x, ids[next(bias_calls) % len(ids)], w).block_until_ready()

        bias_bytes = b.nbytes + b.n * sum(bank.row_bytes for bank in biases)

        def numpy_read(parts: int):
            calls = itertools.count()

            def read():
                rows = b.gemv_rows[next(calls) % len(b.gemv_rows)]
                arrays = [a for r in rows for a in (*np.array_split(gate_up[r].view(np.float32).ravel(), parts),
                                                    *np.array_split(down[r].view(np.float32).ravel(), parts))]
                if parts > 1:
                    list(pool.map(np.add.reduce, arrays))
                else:
                    for a in arrays:
                        np.add.reduce(a)

            return read

        rates = measure_rates({"ffi": (b.gemv, b.nbytes), "np1": (numpy_read(1), b.nbytes),
                               "npN": (numpy_read(threads), b.nbytes), "bias": (gemv_bias, bias_bytes)},
                              repeats, min_time)
        del gate_up, down
        for bank in biases:
            bank.release()
        return b.nbytes, rates["ffi"], rates["np1"], rates["npN"], rates["bias"]


def _random_stored(rng, fmt: wf.WeightFormat, experts: int, rows: int, cols: int, pair: bool):
    """Random stored expert rows [experts, ...] of fmt (data, scales or None): values of realistic magnitude (the
    kernels' speed does not depend on them, but NaN / denormal inputs would slow the float paths)."""
    dshape = (experts, *fmt.data_shape(rows, cols))
    if not fmt.quantized:
        return (rng.standard_normal(dshape, np.float32) * 0.02).astype(fmt.data_dtype), None
    sshape = (experts, 2 * fmt.scale_rows(rows // 2) if pair else fmt.scale_rows(rows), -(-cols // fmt.block[1]))
    if fmt.name == "fp8":
        codes = rng.integers(0, 0x7F, dshape).astype(np.uint8) | (rng.integers(0, 2, dshape).astype(np.uint8) << 7)
        return codes.view(fmt.data_dtype), rng.uniform(1e-4, 1e-3, sshape).astype(np.float32)
    data = rng.integers(-128 if fmt is wf.Q8_0 else 0, 128 if fmt is wf.Q8_0 else 256, dshape).astype(fmt.data_dtype)
    if fmt is wf.MXFP4:
        return data, rng.integers(118, 122, sshape).astype(np.uint8)
    return data, rng.uniform(1e-4, 1e-3, sshape).astype(np.float16)


def bench_formats(hidden: int, inter: int, experts: int, k: int, formats: list[str], repeats: int,
                  min_time: float, tokens: int = 1, x_dtype=np.float32) -> list[tuple]:
    """[(format name, stored MiB per call, host_experts rate, numpy read rate)] for `tokens` tokens routed to the
    same k experts (x of x_dtype: float32, or bfloat16 as a bf16 model passes it); rates (median, min, max) GB/s of
    stored bytes. Each format's banks exist only while it is measured (memory)."""
    threads = kernel_threads()
    rng = np.random.default_rng(0)
    rows = [list(range(j, j + k)) for j in range(0, experts - k + 1, k)]  # calls rotate over disjoint expert groups
    results = []
    with ThreadPoolExecutor(threads) as pool:
        for name in formats:
            fmt = wf.Q4_0_X16 if name == "q4_0x16" else wf.by_name(name)  # random bytes: any layout holds them
            (gud, gus), (dnd, dns) = (_random_stored(rng, fmt, experts, 2 * inter, hidden, True),
                                      _random_stored(rng, fmt, experts, hidden, inter, False))
            arrays = [a for a in (gud, gus, dnd, dns) if a is not None]
            banks = [HostBank.from_numpy(a) for a in arrays]
            del gud, gus, dnd, dns
            views = [b.numpy() for b in banks]
            kw = dict(gate_up_scale=banks[1], down_scale=banks[3]) if fmt.quantized else {}
            gu_bank, dn_bank = (banks[0], banks[2]) if fmt.quantized else (banks[0], banks[1])
            call = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gu_bank, dn_bank, weight_format=fmt, **kw))
            ids = [jnp.asarray(np.array([r] * tokens, np.int32)) for r in rows]  # each i32[T, k]
            x = jnp.asarray(np.linspace(-1.0, 1.0, tokens * hidden, dtype=np.float32).reshape(tokens, hidden)
                            .astype(x_dtype))  # [T, H]
            w = jnp.full((tokens, k), 1.0 / k, jnp.float32)
            nbytes = k * sum(b.row_bytes for b in banks)
            calls, reads = itertools.count(), itertools.count()

            def ffi():
                call(x, ids[next(calls) % len(ids)], w).block_until_ready()

            def numpy_read():
                group = rows[next(reads) % len(rows)]
                parts = [p for v in views for r in group
                         for p in np.array_split(v[r].reshape(-1).view(np.uint8).view(np.int64), threads)]
                list(pool.map(np.add.reduce, parts))

            rates = measure_rates({"ffi": (ffi, nbytes), "numpy": (numpy_read, nbytes)}, repeats, min_time)
            results.append((name, nbytes / MiB, rates["ffi"], rates["numpy"]))
            del views
            for b in banks:
                b.release()
    return results


def bench_call_overhead(repeats: int, calls: int = 200) -> tuple[float, float, float]:
    bank = HostBank(4, (16,), np.float32)
    pad = jnp.full((1,), -1, jnp.int32)

    def chain(n):
        def f(s, flat, slot):
            for _ in range(n):
                s = ffi_ops.slot_fill((s,), flat, slot, (bank,))[0]
            return s

        return jax.jit(f, donate_argnums=0)

    with_calls, without = chain(calls), chain(0)
    s = jnp.zeros((4, 16), jnp.float32)
    s = with_calls(s, pad, pad).block_until_ready()
    s = without(s, pad, pad).block_until_ready()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        s = with_calls(s, pad, pad).block_until_ready()
        t1 = time.perf_counter()
        s = without(s, pad, pad).block_until_ready()
        t2 = time.perf_counter()
        per_call.append(((t1 - t0) - (t2 - t1)) / calls * 1e6)
    bank.release()
    return statistics.median(per_call), min(per_call), max(per_call)


def _fmt(rate: tuple[float, float, float]) -> str:
    return f"{rate[0]:6.2f} [{rate[1]:.2f}-{rate[2]:.2f}]"


def _ratios(ffi_rate: tuple, np_rate: tuple) -> str:
    """Ratio of medians, then ratio of best (max) rates: the latter is steadier on a machine shared with other work."""
    return f"{ffi_rate[0] / np_rate[0]:6.2f} {ffi_rate[2] / np_rate[2]:6.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--expert-mib", type=float, nargs="+", default=[1, 2, 4, 8],
                   help="slot_fill expert sizes (MiB, H=1024 float32)")
    p.add_argument("--fill-experts", type=int, default=8, help="experts copied per slot_fill call")
    p.add_argument("--hidden", type=int, default=4096, help="H of the host_experts benchmark")
    p.add_argument("--inter", type=int, default=3584, help="I of the host_experts benchmark (Mixtral: 14336)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="T values for host_experts")
    p.add_argument("--top-k", type=int, default=2, help="experts per host_experts call (all T tokens)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--formats", nargs="*", default=None,
                   help="only table 4: host_experts on these stored formats (default when given without names: "
                        "bf16 q8_0 q4_0 q4_0x16 mxfp4 fp8)")
    p.add_argument("--format-experts", type=int, default=8, help="experts in the table 4 banks")
    p.add_argument("--repeats", type=int, default=9, help="timed windows per variant")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per timed window")
    args = p.parse_args(argv)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, kernel {_ffi.kernel_isa()}, "
          f"{kernel_threads()} kernel threads (XLA's pool; cap with FT_JAX_NUM_THREADS); GB/s = 1e9 bytes/s, "
          f"median [min-max] of {args.repeats} windows")

    if args.formats is not None:
        formats = args.formats or ["bf16", "q8_0", "q4_0", "q4_0x16", "mxfp4", "fp8"]
        H, I = 2048, 5632
        x_dtype = np.float32 if args.dtype == "float32" else ml_dtypes.bfloat16
        for T in args.tokens:
            print(f"\n4. host_experts on stored formats vs numpy read of the same bytes (H={H}, I={I}, T={T}, "
                  f"x {args.dtype}, k={args.top_k}, {args.format_experts} experts, {kernel_threads()} threads; "
                  f"load average {os.getloadavg()[0]:.2f})")
            print(f"{'format':>7} {'MiB/call':>9} {'host_experts GB/s':>22} {'numpy read GB/s':>22} {'ratio':>6} "
                  f"{'best':>6}")
            for name, mib, ffi_rate, np_rate in bench_formats(H, I, args.format_experts, args.top_k, formats,
                                                              args.repeats, args.min_time, T, x_dtype):
                print(f"{name:>7} {mib:9.1f} {_fmt(ffi_rate):>22} {_fmt(np_rate):>22} {_ratios(ffi_rate, np_rate)}")
        print(f"\nload average (1 min) after the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        return

    print(f"\n1. slot_fill vs numpy memcpy ({args.fill_experts} experts per call)")
    print(f"{'expert MiB':>10} {'slot_fill GB/s':>22} {'numpy copy GB/s':>22} {'ratio':>6} {'best':>6}")
    for mib in args.expert_mib:
        size, ffi_rate, np_rate = bench_slot_fill(mib, args.fill_experts, args.repeats, args.min_time)
        print(f"{size:10.2f} {_fmt(ffi_rate):>22} {_fmt(np_rate):>22} {_ratios(ffi_rate, np_rate)}")

    print(f"\n2. host_experts vs numpy read (H={args.hidden}, I={args.inter}, {args.dtype}, k={args.top_k})")
    print(f"{'T':>4} {'MiB/call':>9} {'host_experts GB/s':>22} {'numpy read GB/s':>22} {'ratio':>6} {'best':>6}"
          f" {'numpy read GB/s x' + str(kernel_threads()):>22} {'ratio':>6} {'best':>6}"
          f" {'gpt-oss form GB/s':>22} {'/plain':>6} {'best':>6}")
    for T in args.tokens:
        nbytes, ffi_rate, np1, npn, bias = bench_host_experts(args.hidden, args.inter, args.dtype, T, args.top_k,
                                                              args.repeats, args.min_time)
        print(f"{T:4d} {nbytes / MiB:9.1f} {_fmt(ffi_rate):>22} {_fmt(np1):>22} {_ratios(ffi_rate, np1)}"
              f" {_fmt(npn):>22} {_ratios(ffi_rate, npn)} {_fmt(bias):>22} {_ratios(bias, ffi_rate)}")

    over = bench_call_overhead(args.repeats)
    print(f"\n3. in-graph cost of one FFI call (slot_fill, nothing copied): {over[0]:.2f} us "
          f"[{over[1]:.2f}-{over[2]:.2f}]")
    print(f"\nload average (1 min) after the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
