"""Run by tests/test_expert_parallel.py in a subprocess with 4 CPU devices (jax_num_cpu_devices must be set before JAX
starts, which importing ft_jax does). For each case it decodes on an expert mesh (and, for a case with "reference":
"one device", on one device too) and inspects the optimized HLO of the sharded decode step generate compiled where
asked; then it runs single MoE layers on 2 devices (idle_shard). It prints one JSON object of what it found. Its argv: a folder with one checkpoint per case (written by the test) and the JSON list of cases."""

import json
import os
import re
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ft_jax  # noqa: E402
from ft_jax import _ffi  # noqa: E402
from ft_jax.checkpoint import load_checkpoint  # noqa: E402
from ft_jax.config import load_config  # noqa: E402
from ft_jax.engine.engine import Engine  # noqa: E402
from ft_jax.engine.sampling import Sampling  # noqa: E402
from ft_jax.kernels import ffi_ops  # noqa: E402
from ft_jax.offload.cost_model import auto_costs  # noqa: E402
from ft_jax.offload.expert_parallel import ExpertPartition, ShardedExperts  # noqa: E402
from ft_jax.offload.policy import PolicyKind, parse_policy  # noqa: E402


def bound(name, expert_bytes):
    policy = parse_policy(name)
    if policy.kind is PolicyKind.AUTO:  # equal bandwidths: layers both fetch and host-compute misses
        policy = policy.with_costs(auto_costs(expert_bytes, 10.0, 10.0))
    return policy


def decode(engine, case):
    sampling = Sampling(temperature=0.9, top_k=20) if case["sampled"] else Sampling()
    return engine.generate(case["prompts"], max_new_tokens=case["new_tokens"], sampling=sampling, seed=3)


def run_case(folder, case):
    path = os.path.join(folder, case["name"])
    mesh = ft_jax.expert_mesh(case["devices"])
    part = ExpertPartition.from_mesh(mesh, load_config(path).num_experts)
    sharded = load_checkpoint(path, experts=part.process_experts)
    policy = bound(case["policy"], sharded.banks.expert_bytes)
    engine = Engine(sharded, policy=policy, num_slots=case["slots"], mesh=mesh)
    many = decode(engine, case)
    entry = {"name": case["name"], "many": many.tokens, "active_many": many.stats["active_per_step"],
             "active_devices": [d["active_per_step"] for d in many.stats["per_device"]],
             "host_bank_bytes": many.stats["host_bank_bytes"], "decode_compiles": many.stats["decode_compiles"]}
    if case["reference"] == "one device":
        single = load_checkpoint(path)
        one = decode(Engine(single, policy=policy, num_slots=case["slots"] * case["devices"]), case)
        entry.update(one=one.tokens, active_one=one.stats["active_per_step"])
    if case.get("hlo"):  # the decode step generate compiled (batch 1, KV cache 64): no compile of its own
        hlo = next(exe for key, exe in engine._executables.items() if key[0] == "decode").as_text()
        hlo_type = {"float32": "f32", "bfloat16": "bf16"}
        pools = [f"{hlo_type[bank.dtype.name]}[{case['slots']},{','.join(map(str, bank.row_shape))}]"
                 for bank in sharded.banks.banks]
        entry["hlo"] = {op: len(re.findall(r"\b" + op + r"(-start)?\(", hlo))
                        for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")}
        entry["hlo"]["pool_copies"] = sum(len(re.findall(re.escape(p) + r"\{[^}]*\} copy(-start)?\(", hlo))
                                          for p in pools)
        entry["hlo"]["pools_present"] = all(p in hlo for p in pools)
    return entry


def idle_shard(path):
    """One MoE layer on 2 devices (experts 0..3 on device 0, 4..7 on device 1). First with a policy per device
    (fetch every miss / none): the output equals one device's host GEMV and the statistics show each device's own
    split. Then host-all with routes that all go to experts 0..3 and every bank row of experts 4..7 set to NaN:
    device 1 runs no host GEMV, so the output is finite and equals one device's; its statistics count nothing. Then
    NaN in experts 0..3 makes the output non-finite (the check can fail)."""
    ck = load_checkpoint(path)
    E, mesh = ck.config.num_experts, ft_jax.expert_mesh(2)
    backend = ShardedExperts(ck.banks, ExpertPartition.from_mesh(mesh, E), mesh, (parse_policy("host-all"),) * 2,
                             activation=ck.config.activation)
    state = backend.init_state(1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, ck.config.hidden_size)), jnp.float32)
    ids = jnp.asarray([[0, 3], [1, 2], [3, 1]], jnp.int32)
    weights = jnp.asarray([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]], jnp.float32)
    step = jax.jit(backend.__call__)

    def poison(experts):
        for bank in ck.banks.banks:
            rows = _ffi.bank_buffer(bank.id).view(bank.dtype).reshape(bank.shape)  # writable: bypasses freeze
            for layer in range(ck.banks.num_rows // E):
                rows[layer * E + experts.start:layer * E + experts.stop] = np.nan

    # The reference straight from the host GEMV of one device (OffloadedExperts' host path, no cache).
    reference = ffi_ops.host_experts(x, ids, weights, ck.banks.gate_up, ck.banks.down, ck.config.activation)
    # Each device its own policy (lax.switch on the shard): device 0 fetches every miss, device 1 none.
    own = ShardedExperts(ck.banks, ExpertPartition.from_mesh(mesh, E), mesh,
                         (parse_policy("qstar:1.0"), parse_policy("qstar:0.0")), activation=ck.config.activation)
    routes = jnp.asarray([[0, 5], [1, 6], [3, 4]], jnp.int32)  # one route on each device per token
    y_own, own_state = jax.jit(own.__call__)(0, x, routes, weights, own.init_state(4))
    own_reference = ffi_ops.host_experts(x, routes, weights, ck.banks.gate_up, ck.banks.down, ck.config.activation)
    own_stats = own.read_stats(own_state).sum(axis=1)  # i32[2, 6]
    poison(range(4, 8))
    y, state = step(0, x, ids, weights, state)
    stats = backend.read_stats(state)  # i32[2, L, 6]
    poison(range(0, 4))
    y_bad, state = step(0, x, ids, weights, state)
    return {"own_policies_equal": bool(np.array_equal(np.asarray(y_own), np.asarray(own_reference))),
            "own_policies_fetched": own_stats[:, 3].tolist(), "own_policies_host": own_stats[:, 4].tolist(),
            "finite": bool(np.isfinite(np.asarray(y)).all()),
            "equal": bool(np.array_equal(np.asarray(y), np.asarray(reference))),
            "device_stats": stats.sum(axis=1).tolist(), "poisoned_shard0_finite": bool(np.isfinite(y_bad).all())}


def main(folder, cases):
    report = {"cases": []}
    for case in cases:
        t0 = time.perf_counter()
        report["cases"].append(run_case(folder, case))
        print(f"{case['name']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    report["idle_shard"] = idle_shard(os.path.join(folder, "idle"))
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
