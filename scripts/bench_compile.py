#!/usr/bin/env python3
"""Decode-step compile time against depth: a Mixtral-shaped model with 4 and with 32 layers, side by side.

    python3 scripts/bench_compile.py                       # 4 vs 32 layers, qstar and host-all, 3 rounds
    python3 scripts/bench_compile.py --layers 4 8 32 48 --policies fetch-all --rounds 2 --json
    python3 scripts/bench_compile.py --layers 32 --devices 1 4    # expert parallelism: 4 CPU devices vs one

Issue 9's target: the 32-layer decode step compiles in <= 1.5x the time of the 4-layer one, and in <= 10 s on a
quiet machine. Each measurement is ``lower_decode_step(engine, kv_len).compile()`` (XLA's compile of the whole
step: the scanned layers, the cache plan, the FFI calls, the sampler) in a fresh Engine, with JAX's persistent
compilation cache off, so nothing is reused between variants. The weights are zeros (compile time does not depend
on them; host banks are anonymous memory that costs nothing until written), so no checkpoint is written. Variants
alternate within each round; the table gives the median [min-max] seconds, the ratio to the smallest depth, and
the load average. --devices N builds the step of an expert mesh of N CPU devices (ft_jax.offload.expert_parallel:
the MoE layers in a shard_map with one psum each; jax_num_cpu_devices is set to the largest N before JAX starts),
with the same slots per device as one device has in all (cache fraction of the device's own experts); issue 23's
target: 4 devices compile in <= 1.5x the time of one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np


def mixtral_config(layers: int, hidden: int, intermediate: int, experts: int, top_k: int, heads: int, kv_heads: int,
                   head_dim: int, vocab: int):
    """An ft_jax MoEConfig of a Mixtral-shaped model (bf16)."""
    from ft_jax.config import config_from_dict

    return config_from_dict({
        "architectures": ["MixtralForCausalLM"], "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_local_experts": experts, "num_experts_per_tok": top_k, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"},
        source="bench_compile")


def build_engine(cfg, policy: str, cache_fraction: float, devices: int = 1):
    """An Engine over zero weights (dense on the device, experts in zero host banks) for cfg; devices > 1: on an
    expert mesh of that many devices (one process: its banks hold every expert)."""
    import ml_dtypes

    from ft_jax.checkpoint import LoadedCheckpoint
    from ft_jax.engine.engine import Engine
    from ft_jax.models.decoder import MoETransformer
    from ft_jax.kernels.host_bank import HostBank
    from ft_jax.offload.banks import ExpertBanks
    from ft_jax.offload.expert_parallel import expert_mesh
    from ft_jax.offload.policy import bind_policy, parse_policy
    from ft_jax.offload.profile import cost_model_for

    bf16 = np.dtype(ml_dtypes.bfloat16)
    model = MoETransformer(cfg, lambda name, shape, kind: np.zeros(shape, bf16))
    rows, H, I = cfg.num_moe_layers * cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    banks = ExpertBanks(HostBank(rows, (2 * I, H), bf16), HostBank(rows, (H, I), bf16))
    ckpt = LoadedCheckpoint(cfg, model, banks, 0)
    policy = parse_policy(policy if policy != "qstar" else "qstar:0.4")
    # The step's program does not depend on the bandwidths: auto is bound to a named preset's costs.
    policy = bind_policy(policy, cost_model_for("sapphire-rapids", banks.expert_bytes))
    mesh = expert_mesh(devices) if devices > 1 else None
    return Engine(ckpt, policy=policy, num_slots=max(1, round(cache_fraction * rows / devices)), mesh=mesh)


def lower_decode_step(engine, kv_len: int):
    """The Engine's greedy decode step for batch 1 and a KV cache of kv_len, lowered (jax.stages.Lowered)."""
    import jax
    import jax.numpy as jnp

    from ft_jax.engine.engine import DECODE_CHUNK_STEPS, eos_operand
    from ft_jax.engine.sampling import Sampling

    kv_cache = jax.eval_shape(lambda: engine.init_kv_cache(1, kv_len))
    ids = jax.ShapeDtypeStruct((1,), jnp.int32)
    return engine._decode.lower(engine.params, ids, ids, kv_cache, engine.expert_state, np.zeros((1, 2), np.uint32),
                                *Sampling().operands(1), eos_operand(()), np.asarray(1, np.int32), greedy=True,
                                max_steps=DECODE_CHUNK_STEPS)


def compile_seconds(cfg, policy: str, cache_fraction: float, kv_len: int, devices: int = 1) -> float:
    engine = build_engine(cfg, policy, cache_fraction, devices)
    t0 = time.perf_counter()
    lower_decode_step(engine, kv_len).compile()
    seconds = time.perf_counter() - t0
    engine.decode_backend.banks.release()
    return seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 32], help="depths to compare (default 4 32)")
    p.add_argument("--devices", type=int, nargs="+", default=[1], help="expert-mesh sizes to compare (default 1)")
    p.add_argument("--policies", nargs="+", default=["qstar", "host-all"], help="decode policies (default qstar "
                                                                                 "host-all)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; variants alternate within each (default 3)")
    p.add_argument("--kv-len", type=int, default=256, help="KV-cache length of the step (default 256)")
    p.add_argument("--cache-fraction", type=float, default=0.25, help="slots / all experts (default 0.25)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    for flag, values in (("--layers", args.layers), ("--devices", args.devices), ("--rounds", [args.rounds]),
                         ("--kv-len", [args.kv_len]), ("--hidden", [args.hidden]),
                         ("--intermediate", [args.intermediate]), ("--experts", [args.experts]),
                         ("--top-k", [args.top_k]), ("--heads", [args.heads]), ("--kv-heads", [args.kv_heads]),
                         ("--head-dim", [args.head_dim]), ("--vocab", [args.vocab])):
        if min(values) < 1:
            p.error(f"{flag} must be >= 1, got {min(values)}")
    if not 0 < args.cache_fraction <= 1:
        p.error(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} is more than the {args.experts} experts")
    if any(args.experts % n for n in args.devices):
        p.error(f"--devices: each must divide the {args.experts} experts, got {args.devices}")
    import jax

    jax.config.update("jax_num_cpu_devices", max(args.devices))  # before ft_jax starts the backend
    from ft_jax.offload.policy import parse_policy

    for policy in args.policies:
        try:
            parse_policy(policy)
        except ValueError as e:
            p.error(f"--policies: {e}")

    jax.config.update("jax_compilation_cache_dir", None)  # nothing reused between variants
    times: dict[tuple[str, int, int], list[float]] = {}
    load_before = os.getloadavg()
    variants = [(pol, L, n) for pol in args.policies for L in args.layers for n in args.devices]
    for r in range(args.rounds):
        for pol, L, n in variants[r % len(variants):] + variants[:r % len(variants)]:
            cfg = mixtral_config(L, args.hidden, args.intermediate, args.experts, args.top_k, args.heads,
                                 args.kv_heads, args.head_dim, args.vocab)
            s = compile_seconds(cfg, pol, args.cache_fraction, args.kv_len, n)
            times.setdefault((pol, L, n), []).append(s)
            print(f"[bench_compile] round {r + 1}: {pol} {L} layers {n} device(s): {s:.2f} s (load "
                  f"{os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    rows = []
    for pol in args.policies:
        base = statistics.median(times[(pol, args.layers[0], args.devices[0])])
        for L in args.layers:
            for n in args.devices:
                t = times[(pol, L, n)]
                rows.append({"policy": pol, "layers": L, "devices": n, "median_s": statistics.median(t),
                             "min_s": min(t), "max_s": max(t), "ratio_to_first": statistics.median(t) / base})
    if args.json:
        print(json.dumps({"results": rows, "load_average": {"before": load_before, "after": load_after},
                          "jax": jax.__version__, "settings": vars(args)}))
        return 0
    print(f"decode-step compile seconds, median [min-max] of {args.rounds} rounds (XLA:CPU, jax {jax.__version__})")
    first = f"x {args.layers[0]} layers, {args.devices[0]} dev"
    print(f"{'policy':10s} {'layers':>6} {'devices':>7} {'seconds':>22} {first:>20}")
    for row in rows:
        print(f"{row['policy']:10s} {row['layers']:6d} {row['devices']:7d} {row['median_s']:8.2f} "
              f"[{row['min_s']:.2f}-{row['max_s']:.2f}]{'':>5} {row['ratio_to_first']:19.2f}")
    print(f"load average before/after (1 min): {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
