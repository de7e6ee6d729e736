"""The prefill split of the qstar and auto policies on a GPU: from how many routed tokens a missed expert is worth its
slot fill (cost_model.prefill_fetch_min_tokens), with the host's expert GEMM rate measured here.

Decode prices an expert by its bytes (a GEMV reads the expert once per token); a prefill chunk routes many tokens
to each expert, and the host kernel then reads the expert once for all of them and is bound by arithmetic. The
split needs the host's FLOP/s for that: ``measure_host_gflops`` times the host_experts kernel on a small bank of the
model's row length (one expert of 256 intermediate rows, 64 tokens: about 0.2 GFLOP for H = 2048, milliseconds).
On a CPU device no split is computed: its slot experts run the same kernel on a copy, so prefill fetches nothing
there (the Engine's default, cost_model.PREFILL_NEVER).
"""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ft_jax import weight_formats
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
from ft_jax.offload.banks import ExpertBanks
from ft_jax.offload.cost_model import (ASSUMED_DEVICE_TFLOPS, CostModel, expert_flops_per_token,
                                       prefill_fetch_min_tokens)
from ft_jax.offload.policy import Policy, PolicyKind


def measure_host_gflops(hidden: int, fmt: weight_formats.WeightFormat, *, inter: int = 256, tokens: int = 64,
                        repeats: int = 5) -> float:
    """GFLOP/s of the host expert kernel (ffi_ops.host_experts on the CPU) with ``tokens`` bf16 tokens routed to one
    expert of rows H = hidden, I = inter in weight format ``fmt`` (random weights; a block format quantized from
    them): expert_flops_per_token(H, I) * tokens over the fastest of ``repeats`` calls after one untimed call.
    Raises ValueError for a hidden size the format's blocks do not fit."""
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((1, 2 * inter, hidden), np.float32) / np.sqrt(hidden)
    down = rng.standard_normal((1, hidden, inter), np.float32) / np.sqrt(inter)
    banks = {}
    if fmt.quantized:
        for name, w in (("gate_up", gate_up), ("down", down)):
            data, scales = _random_stored(rng, fmt, *w.shape[1:])
            banks[name], banks[f"{name}_scale"] = HostBank.from_numpy(data[None]), HostBank.from_numpy(scales[None])
        banks["weight_format"] = fmt
    else:
        banks = {"gate_up": HostBank.from_numpy(gate_up.astype(fmt.data_dtype)),
                 "down": HostBank.from_numpy(down.astype(fmt.data_dtype))}
    cpu = jax.devices("cpu")[0]
    try:
        with jax.default_device(cpu):
            x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32).astype(ml_dtypes.bfloat16))
            ids = jnp.zeros((tokens, 1), jnp.int32)
            w = jnp.ones((tokens, 1), jnp.float32)
            call = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, **banks))
            jax.block_until_ready(call(x, ids, w))
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(call(x, ids, w))
                times.append(time.perf_counter() - t0)
    finally:
        for bank in banks.values():
            if isinstance(bank, HostBank):
                bank.release()
    return expert_flops_per_token(hidden, inter) * tokens / min(times) / 1e9


def _random_stored(rng, fmt: weight_formats.WeightFormat, rows: int, cols: int):
    """(data, scales) of a random [rows, cols] matrix as fmt stores it (codes that decode to finite values: no fp8
    NaN code, E8M0 scales near 1), for timing only."""
    shape = fmt.data_shape(rows, cols)
    if fmt.name == "fp8":
        data = rng.integers(0, 0x70, shape, dtype=np.uint8).view(fmt.data_dtype)
    else:
        data = rng.integers(0, 256, shape, dtype=np.uint8).view(fmt.data_dtype)
    if fmt.name == "mxfp4":
        scales = np.full(fmt.scale_shape(rows, cols), 120, np.uint8)
    else:
        scales = np.full(fmt.scale_shape(rows, cols), 1e-2, fmt.scale_dtype)
    return data, scales


def prefill_min_tokens_for(policy: Policy, model: CostModel, banks: ExpertBanks, hidden: int, inter: int) -> int | None:
    """The Engine's prefill_fetch_min_tokens for ``policy`` on this machine's default device: None where the Engine's
    default applies (a policy other than qstar / auto; a CPU device), else cost_model.prefill_fetch_min_tokens of
    ``model``'s path costs with the measured host GEMM rate (measure_host_gflops, at the banks' weight format) and
    ASSUMED_DEVICE_TFLOPS for the device. hidden, inter: H and I of one expert."""
    if policy.kind not in (PolicyKind.QSTAR, PolicyKind.AUTO) or jax.default_backend() == "cpu":
        return None
    fmt = banks.format
    try:
        host = measure_host_gflops(hidden, fmt)
    except (ValueError, MemoryError) as e:
        warnings.warn(f"prefill split: measuring the host expert GEMM failed ({e}); prefill fetches every miss",
                      stacklevel=2)
        return None
    flops = expert_flops_per_token(hidden, inter)
    return prefill_fetch_min_tokens(model.path_costs(), flops / (host * 1e6), flops / (ASSUMED_DEVICE_TFLOPS * 1e9))
