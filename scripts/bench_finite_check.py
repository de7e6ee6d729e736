#!/usr/bin/env python3
"""Cost of the NaN/Inf check of ft_jax.checkpoint (exponent-bit test on each piece as it is read).

Writes one safetensors file of expert-shaped tensors (default 0.75 GB, float32 or bfloat16, random normal values)
to a temporary folder, then reads every tensor into a reused destination, alternating over rounds:
  plain:   positioned reads of the same 1 MiB pieces into the same destination, no check (what the loader did
           before the check existed);
  checked: SafetensorsCheckpoint.read_into (the loader's path: the same reads plus the exponent-bit test).
Both read from the page cache (the file is read once before timing), which is the worst case for the relative
cost: from a disk the read is slower and the check's share smaller.
With --load-layers N it also times the whole load_checkpoint of a synthetic float32 Mixtral-shaped checkpoint with
N decoder layers (scripts/measure_load_memory.py's writer; 2 layers = 0.97 GB) into float32 or bfloat16 banks,
with the check and with ft_jax.checkpoint._has_non_finite replaced by a no-op, alternating over rounds.
Prints GB/s per round, the checked/unchecked time ratio per round and its median, and the load average.

Usage: python scripts/bench_finite_check.py [--gb 0.75] [--dtype float32|bfloat16] [--rounds 5]
       [--load-layers 2] [--dir PARENT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import struct
import tempfile
import time

import ml_dtypes
import numpy as np

from ft_jax.checkpoint import SafetensorsCheckpoint

SHAPE = (3584, 1024)  # one Mixtral-8x7B-like expert projection scaled 1/4 in hidden size
PIECE = 1 << 20  # the loader's piece size (ft_jax.checkpoint._READ_CHUNK_BYTES)


def write_file(path: str, gb: float, dtype: np.dtype) -> list[str]:
    """Write a safetensors file of about ``gb`` GB of random tensors [SHAPE]; returns the tensor names."""
    nbytes = int(np.prod(SHAPE)) * dtype.itemsize
    count = max(1, round(gb * 1e9 / nbytes))
    names = [f"model.layers.{i // 24}.block_sparse_moe.experts.{(i // 3) % 8}.w{1 + i % 3}.weight"
             for i in range(count)]
    code = {"float32": "F32", "bfloat16": "BF16"}[dtype.name]
    header = {n: {"dtype": code, "shape": list(SHAPE), "data_offsets": [i * nbytes, (i + 1) * nbytes]}
              for i, n in enumerate(names)}
    blob = json.dumps(header).encode()
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _ in names:
            f.write(rng.standard_normal(SHAPE, dtype=np.float32).astype(dtype).tobytes())
    return names


def plain_read(ckpt: SafetensorsCheckpoint, names: list[str], dest: np.ndarray) -> None:
    """The loader's reads (same handle reuse, same 1 MiB pieces), without the check."""
    handles = {}
    flat = memoryview(dest.reshape(-1).view(np.uint8))
    for name in names:
        info = ckpt.tensors[name]
        fh = handles.get(info.file) or handles.setdefault(info.file, open(info.file, "rb", buffering=0))
        fh.seek(info.offset)
        done = 0
        while done < info.nbytes:
            done += fh.readinto(flat[done:min(info.nbytes, done + PIECE)])
    for fh in handles.values():
        fh.close()


def checked_read(ckpt: SafetensorsCheckpoint, names: list[str], dest: np.ndarray) -> None:
    for name in names:
        ckpt.read_into(name, dest)


def _load_rounds(parent: str | None, layers: int, bank_dtype: str, rounds: int) -> None:
    import jax.numpy as jnp

    from ft_jax import checkpoint

    spec = importlib.util.spec_from_file_location(
        "measure_load_memory", os.path.join(os.path.dirname(os.path.abspath(__file__)), "measure_load_memory.py"))
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    folder = tempfile.mkdtemp(prefix="ft_jax_finite_load_", dir=parent)
    check = checkpoint._has_non_finite
    try:
        total = writer.write_checkpoint(folder, {**writer.CONFIG, "num_hidden_layers": layers}, 2)

        def load(checked: bool) -> float:
            checkpoint._has_non_finite = check if checked else (lambda bits, signed, mask: False)
            t0 = time.perf_counter()
            ck = checkpoint.load_checkpoint(folder, dtype=jnp.float32, expert_dtype=getattr(jnp, bank_dtype))
            seconds = time.perf_counter() - t0
            ck.banks.gate_up.release()
            ck.banks.down.release()
            return seconds

        load(True)  # page cache warm, first-call costs paid
        print(f"load_checkpoint: {total / 1e9:.2f} GB float32 checkpoint ({layers} layers), {bank_dtype} banks; "
              f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        ratios = []
        for r in range(rounds):
            times = {}
            for checked in ((True, False) if r % 2 == 0 else (False, True)):
                times[checked] = load(checked)
            ratios.append(times[True] / times[False])
            print(f"round {r}: unchecked {times[False]:.2f} s ({total / times[False] / 1e9:.2f} GB/s), checked "
                  f"{times[True]:.2f} s ({total / times[True] / 1e9:.2f} GB/s), checked/unchecked {ratios[-1]:.3f}")
        print(f"median checked/unchecked load time: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max "
              f"{max(ratios):.3f}); load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        checkpoint._has_non_finite = check
        shutil.rmtree(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.75, help="file size in GB (10^9 bytes)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load-layers", type=int, default=0,
                    help="also time load_checkpoint on a synthetic checkpoint with this many layers (0 = skip)")
    ap.add_argument("--dir", default=None, help="parent folder of the temporary checkpoint (default: system temp)")
    args = ap.parse_args()
    dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float32)
    folder = tempfile.mkdtemp(prefix="ft_jax_finite_", dir=args.dir)
    try:
        names = write_file(os.path.join(folder, "model.safetensors"), args.gb, dtype)
        total = os.path.getsize(os.path.join(folder, "model.safetensors"))
        dest = np.empty(SHAPE, dtype)
        with SafetensorsCheckpoint(folder) as ckpt:
            plain_read(ckpt, names, dest)  # page cache warm, destination pages committed
            checked_read(ckpt, names, dest)
            print(f"file: {total / 1e9:.2f} GB, {len(names)} tensors {list(SHAPE)} {dtype.name}; "
                  f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            ratios = []
            for r in range(args.rounds):
                times = {}
                order = [("plain", plain_read), ("checked", checked_read)]
                for label, fn in order if r % 2 == 0 else order[::-1]:  # alternate which runs first
                    t0 = time.perf_counter()
                    fn(ckpt, names, dest)
                    times[label] = time.perf_counter() - t0
                ratios.append(times["checked"] / times["plain"])
                print(f"round {r}: plain {total / times['plain'] / 1e9:5.2f} GB/s, checked "
                      f"{total / times['checked'] / 1e9:5.2f} GB/s, checked/plain time {ratios[-1]:.3f}")
        print(f"median checked/plain time ratio: {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}); load average after: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(folder)
    if args.load_layers:
        _load_rounds(args.dir, args.load_layers, args.dtype, args.rounds)


if __name__ == "__main__":
    main()
