#!/usr/bin/env python3
"""GFLOP/s of one MoE layer's routed experts at prefill sizes: the FFI expert kernel (host_experts) on each weight
format, next to XLA's grouped matrix product (jax.lax.ragged_dot) on bf16 weights.

    python3 scripts/bench_prefill_experts.py                          # bf16, 256 and 512 tokens
    python3 scripts/bench_prefill_experts.py --formats bf16 q8_0 q4_0 fp8 mxfp4 --tokens 256
    python3 scripts/bench_prefill_experts.py --no-xla --tokens 64 256 1024 --repeats 5

One layer of E experts (default 8, H=2048, I=5632: the bench_peer model), T tokens routed top-k (default 2) at
random (seed 0; every expert gets about T k / E routes), bf16 activations as a bf16 model passes them:
  ffi:FMT   ffi_ops.host_experts over HostBanks of the format (bf16 as stored; q8_0 / q4_0 quantized from the same
            random bf16 weights; fp8 (128 x 128 blocks) / mxfp4, which ft_jax does not quantize to, random codes),
            inside jax.jit
  xla       the same routes through XLA: tokens sorted by expert, gate/up as one jax.lax.ragged_dot over the [E, H, 2I]
            weights, the SwiGLU, down as a second ragged_dot, then each route's output weighted and scattered back
            (bf16 operands, float32 accumulation)
FLOPs counted: 2 T k 3 H I (gate, up and down of every route). Each variant runs --repeats times (after one untimed
call), alternating with the others; reported: median [min-max] milliseconds per call, GFLOP/s of the median and
GFLOP per CPU-second of this process (steadier on a shared machine). The load average is printed with the figures. A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ft_jax import weight_formats as wf
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank

BF16 = np.dtype(ml_dtypes.bfloat16)
FORMATS = {"bf16": wf.BF16, "q8_0": wf.Q8_0, "q4_0": wf.Q4_0, "fp8": wf.fp8((128, 128)), "mxfp4": wf.MXFP4}


def make_banks(fmt_name: str, gate_up: np.ndarray, down: np.ndarray) -> dict:
    """host_experts' bank keywords for weights in format fmt_name (gate_up [E, 2I, H], down [E, H, I] bf16)."""
    fmt = FORMATS[fmt_name]
    if fmt_name == "bf16":
        return {"gate_up": HostBank.from_numpy(gate_up), "down": HostBank.from_numpy(down)}
    out = {}
    rng = np.random.default_rng(1)
    for name, w in (("gate_up", gate_up), ("down", down)):
        if fmt_name in ("q8_0", "q4_0"):
            parts = [wf.quantize(w[e].astype(np.float32), fmt) for e in range(w.shape[0])]
        else:  # no quantizer: random codes that decode to finite values (no fp8 NaN code, E8M0 scales near 1)
            shape, sshape = fmt.data_shape(*w.shape[1:]), fmt.scale_shape(*w.shape[1:])
            high = 0x70 if fmt_name == "fp8" else 256
            parts = [(rng.integers(0, high, shape, dtype=np.uint8).view(fmt.data_dtype),
                      np.full(sshape, 120, np.uint8) if fmt_name == "mxfp4" else np.full(sshape, 1e-2, np.float32))
                     for _ in range(w.shape[0])]
        out[name] = HostBank.from_numpy(np.stack([p[0] for p in parts]))
        out[f"{name}_scale"] = HostBank.from_numpy(np.stack([p[1] for p in parts]))
    out["weight_format"] = fmt
    return out


def xla_experts(x, ids, weights, gate_up_t, down_t):
    """The routes through jax.lax.ragged_dot. x bf16[T, H]; ids i32[T, k]; weights f32[T, k]; gate_up_t bf16[E, H, 2I];
    down_t bf16[E, I, H]. Returns f32[T, H]."""
    T, k = ids.shape
    E, I = gate_up_t.shape[0], down_t.shape[1]
    flat = ids.reshape(-1)  # [T k]
    order = jnp.argsort(flat, stable=True)  # routes grouped by expert
    tokens = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E]
    xs = x[tokens]  # [T k, H]
    h = jax.lax.ragged_dot(xs, gate_up_t, sizes, preferred_element_type=jnp.float32)  # [T k, 2I]
    a = (jax.nn.silu(h[:, :I]) * h[:, I:]).astype(x.dtype)
    d = jax.lax.ragged_dot(a, down_t, sizes, preferred_element_type=jnp.float32)  # [T k, H]
    d = d * weights.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), jnp.float32).at[tokens].add(d)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["bf16"], choices=tuple(FORMATS))
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 512])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=5632)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-xla", action="store_true", help="leave out the ragged_dot variant")
    args = p.parse_args(argv)
    E, H, I, k = args.experts, args.hidden, args.inter, args.top_k
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((E, 2 * I, H), np.float32) / np.sqrt(H)).astype(BF16)
    down = (rng.standard_normal((E, H, I), np.float32) / np.sqrt(I)).astype(BF16)
    banks = {f: make_banks(f, gate_up, down) for f in args.formats}
    host = jax.jit(lambda x, i, w, b: ffi_ops.host_experts(x, i, w, **b), static_argnums=3)
    variants = {f"ffi:{f}": (lambda f: lambda x, i, w: host(x, i, w, _Hashable(banks[f])))(f) for f in args.formats}
    if not args.no_xla:
        gu_t = jnp.asarray(np.ascontiguousarray(gate_up.transpose(0, 2, 1)))
        dn_t = jnp.asarray(np.ascontiguousarray(down.transpose(0, 2, 1)))
        xla = jax.jit(xla_experts)
        variants["xla"] = lambda x, i, w: xla(x, i, w, gu_t, dn_t)
    load_before = [round(v, 2) for v in os.getloadavg()]
    print(f"bench_prefill_experts: E={E} H={H} I={I} top-{k}, FT_JAX_NUM_THREADS="
          f"{os.environ.get('FT_JAX_NUM_THREADS', 'unset')}, load average {load_before}", file=sys.stderr)
    for T in args.tokens:
        x = jnp.asarray(rng.standard_normal((T, H), np.float32).astype(BF16))
        ids = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
        w = jnp.asarray(rng.random((T, k), np.float32))
        for f in variants.values():
            jax.block_until_ready(f(x, ids, w))
        times = {name: [] for name in variants}
        cpu = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, f in variants.items():
                c0, t0 = _cpu_seconds(), time.perf_counter()
                jax.block_until_ready(f(x, ids, w))
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu_seconds() - c0)
        flop = 2.0 * T * k * 3 * H * I
        for name, ts in times.items():
            med, cmed = statistics.median(ts), statistics.median(cpu[name])
            print(f"T={T:5d} {name:<10} {1e3 * med:9.1f} ms [{1e3 * min(ts):.1f}-{1e3 * max(ts):.1f}]  "
                  f"{flop / med / 1e9:7.1f} GFLOP/s; {flop / cmed / 1e9:7.1f} GFLOP per CPU-second",
                  file=sys.stderr)
    print(f"load average after {[round(v, 2) for v in os.getloadavg()]}", file=sys.stderr)
    return 0


def _cpu_seconds() -> float:
    """CPU time of this process (all threads), seconds: on a shared machine the work done per CPU-second is steadier
    than per wall second."""
    t = os.times()
    return t.user + t.system


class _Hashable:
    """A dict of banks as a static jit argument (hashed by identity)."""

    def __init__(self, d):
        self.d = d

    def __hash__(self):
        return id(self.d)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and other.d is self.d

    def keys(self):
        return self.d.keys()

    def __getitem__(self, key):
        return self.d[key]


if __name__ == "__main__":
    sys.exit(main())
