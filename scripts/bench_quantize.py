"""Benchmark: weight_formats.quantize (C++, xla_ffi/quantize.cc) against the numpy quantizer it replaced (the
float32 numpy steps of gguf/quants.py, kept here as the baseline) on a bf16 [rows, cols] matrix (default [5632, 2048],
one dense MLP projection of a 2B-class model). Variants alternate over rounds (the machine is shared); prints the
median seconds, values/s and the ratio, with the load average before and after. Checks the bytes are equal first.

    PYTHONPATH=$PWD python3 scripts/bench_quantize.py [--rows 5632] [--cols 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ml_dtypes
import numpy as np

from ft_jax import weight_formats as wf


def numpy_quantize(w: np.ndarray, fmt: wf.WeightFormat) -> tuple[np.ndarray, np.ndarray]:
    """The numpy quantizer weight_formats.quantize used before the C++ one (same bytes, gguf/quants.py's steps)."""
    blocks = np.asarray(w, np.float32).reshape(*w.shape[:-1], -1, wf.QBLOCK)  # f32[..., G, 32]
    if fmt is wf.Q8_0:
        d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        x = blocks * inv
        a = np.abs(x)
        floored = np.floor(a)
        q = (np.sign(x) * (floored + np.floor(2 * (a - floored)))).astype(np.int8)
        return q.reshape(w.shape), d[..., 0].astype(np.float16)
    imax = np.abs(blocks).argmax(axis=-1)[..., None]
    d = np.take_along_axis(blocks, imax, axis=-1) / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc(blocks * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    packed = q[..., :16] | (q[..., 16:] << np.uint8(4))
    return packed.reshape(*w.shape[:-1], -1), d[..., 0].astype(np.float16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5632)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    w = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(ml_dtypes.bfloat16)
    variants = {"numpy": numpy_quantize, "c++ 1 thread": lambda w, f: wf.quantize(w, f, 1),
                "c++ all threads": lambda w, f: wf.quantize(w, f, 0)}
    print(f"bf16 [{args.rows}, {args.cols}], {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"load average before {os.getloadavg()}")
    for fmt in (wf.Q8_0, wf.Q4_0):
        ref = numpy_quantize(w, fmt)
        for name, fn in variants.items():
            got = fn(w, fmt)
            assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1].view(np.uint16), ref[1].view(np.uint16)), name
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t = time.perf_counter()
                fn(w, fmt)
                times[name].append(time.perf_counter() - t)
        base = statistics.median(times["numpy"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"{fmt.name:5} {name:16} median {m * 1e3:8.1f} ms  {w.size / m / 1e6:8.0f} M values/s  "
                  f"numpy / this {base / m:5.1f}x  (min {min(ts) * 1e3:.1f} ms)")
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
