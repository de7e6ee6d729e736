#!/usr/bin/env python3
"""Peak host memory of ft_jax.checkpoint.load_checkpoint on a synthetic multi-GB Mixtral-shaped checkpoint.

Writes a sharded float32 checkpoint (config.json, model-XXXXX-of-YYYYY.safetensors, model.safetensors.index.json)
with random weights to a temporary folder, loads it in a fresh subprocess and reports that process's peak resident
set size (VmHWM from /proc/self/status, which includes the Python/JAX runtime; page-cache pages mapped into the
banks count as they are resident) divided by the checkpoint bytes, and how many bank bytes are the checkpoint's own
pages mapped into the bank (SafetensorsCheckpoint.read_into; the rest was copied: a float32 -> bfloat16 cast, or
tensors whose file offsets are not congruent with their rows' page offsets).
Goal (issue 3): peak / checkpoint <= 1.3; issue 19: <= 1.1 (llama.cpp, which memory-maps its file: 1.02).

Usage: python scripts/measure_load_memory.py [--layers 9] [--shards 4] [--expert-dtype float32|bfloat16]
       [--dir PARENT] [--keep]
Needs about (checkpoint bytes) of free disk and ~1.3x that of free memory; default checkpoint ~3.4 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

# Mixtral-8x7B proportions scaled down (hidden 4096 -> 1024, expert width 14336 -> 3584, vocab 32000).
CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": None,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
    "max_position_embeddings": 4096, "torch_dtype": "float32", "tie_word_embeddings": False,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None,
}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(Hub name, shape) of every tensor of a Mixtral checkpoint with this config, in file order."""
    H, I, E, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], cfg["vocab_size"]
    D = H // cfg["num_attention_heads"]
    KV = cfg["num_key_value_heads"] * D
    out = [("model.embed_tokens.weight", (V, H))]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        out += [(f"{p}.input_layernorm.weight", (H,)), (f"{p}.post_attention_layernorm.weight", (H,)),
                (f"{p}.self_attn.q_proj.weight", (H, H)), (f"{p}.self_attn.k_proj.weight", (KV, H)),
                (f"{p}.self_attn.v_proj.weight", (KV, H)), (f"{p}.self_attn.o_proj.weight", (H, H)),
                (f"{p}.block_sparse_moe.gate.weight", (E, H))]
        for e in range(E):
            b = f"{p}.block_sparse_moe.experts.{e}"
            out += [(f"{b}.w1.weight", (I, H)), (f"{b}.w3.weight", (I, H)), (f"{b}.w2.weight", (H, I))]
    out += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    return out


def write_checkpoint(folder: str, cfg: dict, num_shards: int) -> int:
    """Write config.json, up to num_shards safetensors shards of about equal size and the index; returns the
    total bytes of the shard files. Only one shard's tensors are in memory at a time."""
    from safetensors.numpy import save_file

    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shapes = tensor_shapes(cfg)
    per_shard = sum(int(np.prod(s)) * 4 for _, s in shapes) / num_shards
    groups, size = [[]], 0
    for name, shape in shapes:
        if size >= per_shard and len(groups) < num_shards:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += int(np.prod(shape)) * 4
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: rng.random(s, dtype=np.float32) * 0.02 - 0.01 for n, s in group},
                  os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _ in group})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sum(os.path.getsize(os.path.join(folder, f)) for f in set(weight_map.values()))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def mapped_bytes(paths: list[str], ranges: list[tuple[int, int]]) -> int:
    """Bytes of the address ranges [start, start + nbytes) that are mappings of the files ``paths``
    (/proc/self/maps, read once)."""
    real = {os.path.realpath(p) for p in paths}
    with open("/proc/self/maps") as f:
        maps = [tuple(int(a, 16) for a in fields[0].split("-")) for fields in map(str.split, f)
                if len(fields) >= 6 and fields[5] in real]
    return sum(max(0, min(hi, start + nbytes) - max(lo, start)) for start, nbytes in ranges for lo, hi in maps)


def child(folder: str, expert_dtype: str) -> None:
    """Load the checkpoint and print a JSON line with the memory numbers (run in a fresh process)."""
    import jax.numpy as jnp

    from ft_jax.checkpoint import SafetensorsCheckpoint, load_checkpoint

    baseline_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    ck = load_checkpoint(folder, dtype=jnp.float32, expert_dtype=getattr(jnp, expert_dtype))
    seconds = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    # spot check: bank rows hold the file's tensors
    cfg = ck.config
    with SafetensorsCheckpoint(folder) as f:
        last = cfg.num_moe_layers * cfg.num_experts - 1
        w2 = f.read(f"model.layers.{cfg.moe_layers[-1]}.block_sparse_moe.experts.{cfg.num_experts - 1}.w2.weight")
        assert np.array_equal(ck.banks.down.rows(last, last + 1)[0], w2.astype(ck.banks.down.dtype)), \
            "bank row mismatch"
        files = f.files
    banks = (ck.banks.gate_up, ck.banks.down)
    # the rows at their file offsets (the gaps between layers not counted)
    rows = [(b.rows(r, r + 1).ctypes.data, b.row_bytes) for b in banks for r in range(b.num_rows)]
    mapped = mapped_bytes(files, rows)
    print(json.dumps({
        "checkpoint_bytes": ck.checkpoint_bytes, "bank_bytes": ck.banks.gate_up.nbytes + ck.banks.down.nbytes,
        "peak_rss_bytes": peak_kb * 1024, "baseline_rss_bytes": baseline_kb * 1024,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_load_bytes": _status_kb("VmRSS") * 1024, "load_seconds": seconds, "bank_bytes_mapped": mapped}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=9, help="decoder layers (each ~352 MB of float32 experts)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--expert-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dir", default=None, help="parent folder for the temporary checkpoint")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.expert_dtype)
        return

    folder = tempfile.mkdtemp(prefix="ft_jax_load_mem_", dir=args.dir)
    try:
        t0 = time.perf_counter()
        nbytes = write_checkpoint(folder, {**CONFIG, "num_hidden_layers": args.layers}, args.shards)
        print(f"wrote {nbytes / 1e9:.2f} GB in {args.shards} shards to {folder} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", folder, "--expert-dtype",
                               args.expert_dtype], capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.exit(f"loader subprocess failed:\n{proc.stderr}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        ck = r["checkpoint_bytes"]
        print(f"checkpoint            {ck / 1e9:8.3f} GB")
        print(f"host banks ({args.expert_dtype:8s}) {r['bank_bytes'] / 1e9:8.3f} GB")
        print(f"baseline RSS          {r['baseline_rss_bytes'] / 1e9:8.3f} GB (Python + JAX before loading)")
        print(f"peak RSS (VmHWM)      {r['peak_rss_bytes'] / 1e9:8.3f} GB   ru_maxrss {r['ru_maxrss_bytes'] / 1e9:.3f} GB")
        print(f"RSS after load        {r['rss_after_load_bytes'] / 1e9:8.3f} GB")
        print(f"bank bytes mapped     {r['bank_bytes_mapped'] / 1e9:8.3f} GB (the file's pages; the rest copied)")
        print(f"load time             {r['load_seconds']:8.1f} s ({ck / 1e9 / r['load_seconds']:.2f} GB/s)")
        ratio = r["peak_rss_bytes"] / ck
        print(f"peak / checkpoint     {ratio:8.3f}   (goal <= 1.1: {'OK' if ratio <= 1.1 else 'FAILED'})")
        print(f"(peak - baseline) / checkpoint {(r['peak_rss_bytes'] - r['baseline_rss_bytes']) / ck:.3f}")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
