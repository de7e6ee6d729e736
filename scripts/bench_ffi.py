#!/usr/bin/env python3
"""Benchmark of the ft_jax FFI handlers against numpy baselines, measured side by side in one run.

Prints three tables:
  1. slot_fill GB/s (rows copied from a host bank into a donated slot array inside jax.jit) divided by numpy
     memcpy GB/s (np.copyto of the same rows between numpy arrays), for 1-8 MiB rows. Goal: ratio >= 0.9.
     Source rows and destination slots rotate through a 256 MiB bank and a 128 MiB pool (beyond the cache).
  2. host_experts GB/s of expert weights read (gate_up + down bytes of every routed expert per call) divided by
     numpy read bandwidth (np.add.reduce over the same bank bytes viewed as float32, on 1 thread and on as many
     threads as the kernel uses), at Mixtral-like rows scaled to fit memory (default H=4096, I=3584, bf16:
     84 MiB per expert). Goal: >= 0.8. All T tokens go to the same k experts (the most arithmetic per byte);
     every call reads experts not read by the previous call, so they come from DRAM, not the cache.
  3. In-graph cost of one FFI call (microseconds): a jit of 200 chained slot_fill calls that copy nothing
     minus a jit with none, per call.

Each timed step dispatches 4 calls back to back and waits once (as consecutive decode steps do); figures are
medians over --repeats steps; the spread (min-max) is shown in brackets; "ratio" divides the medians,
"best" the maxima (steadier when other processes share the memory bus). Default sizes use about
1.3 GiB of memory and run in well under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ft_jax import _ffi
from ft_jax.offload import ffi_ops
from ft_jax.offload.host_bank import HostBank

MiB = 1 << 20
# Calls dispatched back to back per timed step (one wait at the end), as consecutive decode steps run.
CALLS_PER_STEP = 4


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _gbps(nbytes: int, times: list[float]) -> tuple[float, float, float]:
    rates = [nbytes / t / 1e9 for t in times]
    return statistics.median(rates), min(rates), max(rates)


def bench_slot_fill(row_mib: float, num_fill: int, bank_mib: int, pool_mib: int, repeats: int) -> tuple:
    """Each call copies num_fill bank rows into num_fill slots; both windows rotate from call to call through a
    bank and a slot pool larger than the last-level cache, as cache victims do, so source and destination
    are in DRAM for slot_fill and numpy alike."""
    row_elems = int(row_mib * MiB) // 4
    bank_rows = max(2 * num_fill, int(bank_mib / row_mib))
    num_slots = max(2 * num_fill, int(pool_mib / row_mib))
    bank = HostBank(bank_rows, (row_elems,), np.float32)
    bank.numpy()[:] = 1.0  # commit the pages
    fill = jax.jit(lambda s, f, i: ffi_ops.slot_fill(s, f, i, bank), donate_argnums=0)
    slots = jnp.zeros((num_slots, row_elems), jnp.float32)
    calls = max(bank_rows, num_slots) // num_fill
    windows = [((np.arange(num_fill) + c * num_fill) % bank_rows, (np.arange(num_fill) + c * num_fill) % num_slots)
               for c in range(calls)]
    device_windows = [(jnp.asarray(f, jnp.int32), jnp.asarray(s, jnp.int32)) for f, s in windows]
    state = {"slots": fill(slots, *device_windows[0]).block_until_ready(), "i": 0}

    def ffi_step():  # CALLS_PER_STEP dispatches, one wait: like consecutive decode steps
        for _ in range(CALLS_PER_STEP):
            state["slots"] = fill(state["slots"], *device_windows[state["i"] % calls])
            state["i"] += 1
        state["slots"].block_until_ready()

    src = bank.numpy()
    dst = np.ones((num_slots, row_elems), np.float32)  # written: no first-touch page faults while timed
    np_state = {"i": 0}

    def numpy_step():
        for _ in range(CALLS_PER_STEP):
            flat_ids, slot_ids = windows[np_state["i"] % calls]
            np_state["i"] += 1
            for f, s in zip(flat_ids, slot_ids):
                np.copyto(dst[s], src[f])

    nbytes = CALLS_PER_STEP * num_fill * row_elems * 4
    ffi_step(), numpy_step()  # warm up
    ffi_t, np_t = [], []
    for _ in range(repeats):  # interleave so both see the same machine state
        ffi_t += _timed(ffi_step, 1)
        np_t += _timed(numpy_step, 1)
    del state, src, dst
    bank.release()
    return _gbps(nbytes, ffi_t), _gbps(nbytes, np_t)


def make_expert_banks(hidden: int, inter: int, num_experts: int, dtype) -> tuple[HostBank, HostBank]:
    """gate_up [E, 2I, H] and down [E, H, I] banks; every expert gets the same random weights (cheap to fill;
    the bytes still live at distinct addresses, so reads come from DRAM)."""
    rng = np.random.default_rng(0)
    gate_up = HostBank(num_experts, (2 * inter, hidden), dtype)
    down = HostBank(num_experts, (hidden, inter), dtype)
    for bank, scale in ((gate_up, hidden**-0.5), (down, inter**-0.5)):
        row = (rng.standard_normal(bank.row_shape, np.float32) * scale).astype(bank.dtype)
        view = bank.numpy()
        for e in range(num_experts):
            view[e] = row
    return gate_up, down


def bench_host_experts(gate_up: HostBank, down: HostBank, T: int, k: int, repeats: int) -> tuple:
    rng = np.random.default_rng(1)
    num_experts, hidden = gate_up.num_rows, gate_up.row_shape[1]
    run = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gate_up, down))
    x = jnp.asarray(rng.standard_normal((T, hidden), np.float32))
    weights = jnp.full((T, k), 1.0 / k, jnp.float32)
    # Routing windows: call c uses k consecutive experts starting at c*k (mod E), the same set for all T tokens.
    # With E >= 2k, no expert of one call was read by the previous call.
    windows = [np.tile((np.arange(k) + c * k) % num_experts, (T, 1)).astype(np.int32)
               for c in range(max(1, num_experts // k))]
    ids = [jnp.asarray(w) for w in windows]
    run(x, ids[0], weights).block_until_ready()
    ffi_state = {"i": 0}

    def ffi_step():
        outs = []
        for _ in range(CALLS_PER_STEP):
            outs.append(run(x, ids[ffi_state["i"] % len(ids)], weights))
            ffi_state["i"] += 1
        jax.block_until_ready(outs)

    # numpy baseline: sum the same expert bytes viewed as float32, on 1 thread and on as many threads as the
    # kernel uses (numpy reductions release the GIL; each thread sums its share of the rows).
    gu_np, dn_np = gate_up.numpy(), down.numpy()
    threads = _ffi.num_threads()
    pool = ThreadPoolExecutor(threads)

    def numpy_read(parts: int):
        state = {"i": 0}

        def step():
            for _ in range(CALLS_PER_STEP):
                arrays = []
                for e in windows[state["i"] % len(windows)][0]:
                    arrays += np.array_split(gu_np[e].view(np.float32), parts) + np.array_split(dn_np[e].view(np.float32), parts)
                state["i"] += 1
                if parts == 1:
                    for a in arrays:
                        np.add.reduce(a, axis=None)
                else:
                    list(pool.map(lambda a: np.add.reduce(a, axis=None), arrays))

        return step

    steps = {"ffi": ffi_step, "np1": numpy_read(1), "npN": numpy_read(threads)}
    times = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm up
    for _ in range(repeats):  # interleaved so all three see the same machine state
        for name, step in steps.items():
            times[name] += _timed(step, 1)
    pool.shutdown()
    del gu_np, dn_np
    nbytes = CALLS_PER_STEP * k * (gate_up.row_bytes + down.row_bytes)
    return (_gbps(nbytes, times["ffi"]), _gbps(nbytes, times["np1"]), _gbps(nbytes, times["npN"]),
            nbytes // CALLS_PER_STEP)


def bench_call_overhead(repeats: int, calls: int = 200) -> tuple[float, float, float]:
    bank = HostBank(4, (16,), np.float32)
    pad = jnp.full((1,), -1, jnp.int32)

    def chain(n):
        def f(s, flat, slot):
            for _ in range(n):
                s = ffi_ops.slot_fill(s, flat, slot, bank)
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
    p.add_argument("--row-mib", type=float, nargs="+", default=[1, 2, 4, 8], help="slot_fill row sizes (MiB)")
    p.add_argument("--fill-rows", type=int, default=8, help="rows copied per slot_fill call")
    p.add_argument("--bank-mib", type=int, default=256, help="slot_fill bank size (MiB); larger than the LLC")
    p.add_argument("--pool-mib", type=int, default=128, help="slot_fill slot pool size (MiB); larger than the LLC")
    p.add_argument("--hidden", type=int, default=4096, help="H of the host_experts benchmark")
    p.add_argument("--inter", type=int, default=3584, help="I of the host_experts benchmark (Mixtral: 14336)")
    p.add_argument("--experts", type=int, default=8, help="experts in the host_experts banks (>= 2k)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="T values for host_experts")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args(argv)
    if args.threads:
        _ffi.set_num_threads(args.threads)
    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, kernel {_ffi.kernel_isa()}, "
          f"{_ffi.num_threads()} kernel threads; GB/s = 1e9 bytes/s, median [min-max] of {args.repeats}")

    print(f"\n1. slot_fill vs numpy memcpy ({args.fill_rows} rows per call, {args.bank_mib} MiB bank, "
          f"{args.pool_mib} MiB slot pool)")
    print(f"{'row MiB':>8} {'slot_fill GB/s':>22} {'numpy copy GB/s':>22} {'ratio':>6} {'best':>6}")
    for row_mib in args.row_mib:
        ffi_rate, np_rate = bench_slot_fill(row_mib, args.fill_rows, args.bank_mib, args.pool_mib, args.repeats)
        print(f"{row_mib:8g} {_fmt(ffi_rate):>22} {_fmt(np_rate):>22} {_ratios(ffi_rate, np_rate)}")

    print(f"\n2. host_experts vs numpy read (H={args.hidden}, I={args.inter}, {args.dtype}, E={args.experts}, "
          f"k={args.top_k})")
    print(f"{'T':>4} {'MiB/call':>9} {'host_experts GB/s':>22} {'numpy read GB/s':>22} {'ratio':>6} {'best':>6}"
          f" {'numpy read GB/s x' + str(_ffi.num_threads()):>22} {'ratio':>6} {'best':>6}")
    gate_up, down = make_expert_banks(args.hidden, args.inter, args.experts, dtype)
    for T in args.tokens:
        ffi_rate, np1, npn, nbytes = bench_host_experts(gate_up, down, T, args.top_k, args.repeats)
        print(f"{T:4d} {nbytes / MiB:9.1f} {_fmt(ffi_rate):>22} {_fmt(np1):>22} {_ratios(ffi_rate, np1)}"
              f" {_fmt(npn):>22} {_ratios(ffi_rate, npn)}")
    gate_up.release()
    down.release()

    over = bench_call_overhead(args.repeats)
    print(f"\n3. in-graph cost of one FFI call (slot_fill, nothing copied): {over[0]:.2f} us "
          f"[{over[1]:.2f}-{over[2]:.2f}]")


if __name__ == "__main__":
    main()
