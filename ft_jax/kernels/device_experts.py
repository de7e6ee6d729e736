"""Routed experts computed on the GPU from the slot pools, reading each routed slot's weights once (Pallas, Triton).

``slot_experts(x, slot_ids, weights, gate_up_slots, down_slots, ...)`` is the GPU form of ffi_ops.slot_experts (the
same math: ffi_ops' module docstring). A plain jnp gather of the T*k routed slots would copy every routed expert
before reading it (twice the bytes of a weight-bound decode step); here two Pallas kernels take the whole slot pools
as operands and each program loads only the tiles of its own slot:

  0. (XLA, small) the distinct routed slots u[0..R) of the R = T*k routes, ascending, padded with -1, and the combine
     weights C[u, t] = sum_j weights[t, j] * (slot_ids[t, j] == u) (0 where token t does not use slot u)
  1. grid (R, I / BI): program (u, b) streams gate rows and up rows b*BI .. b*BI+BI of slot u[u] once, for all T
     tokens at once: g = W_gate x^T, v = W_up x^T (+ biases), a[u, rows, :] = glu(g, v)   (f32 [R, I, Tp])
  2. grid (R, H / BO): program (u, o) streams down rows o*BO .. of slot u[u] once:
     part[u, rows, t] = C[u, t] * (W_down a[u] + b_down)[rows, t]                          (f32 [R, H, Tp])
  3. (XLA) y[t] = sum_u part[u, :, t]  (u ascending: a fixed order)

So every distinct slot's weights are read once per call whatever the number of tokens routed to it; the price is
that every program computes all Tp = max(16, next power of two >= T) token columns (matrix units need >= 16), which
decode (T = batch) does not notice and prefill pays in FLOPs, not bytes. bf16 weights with bf16 x use a bf16 x bf16
-> f32 dot (exact products, f32 sums, as the CPU kernel); otherwise both sides go to f32 (no TF32). With bf16 x (a
bf16 model) a is rounded to bf16 before the down projection, as the CPU kernel and transformers do; the second dot
takes a in f32. Summation order differs from the CPU kernel, so results agree to rounding, not bit for bit.

Requires H and I to be multiples of 16 (every released MoE model's are); raises ValueError otherwise.
``interpret=True`` runs the same kernels through Pallas' interpreter on any backend (the CPU tests do).

The kernels use Pallas' Triton backend, which JAX 0.11 deprecates (a DeprecationWarning at every lowering) in favour
of Mosaic GPU; they stay on Triton until a Mosaic GPU form has been run on a GPU, and that one warning is filtered
(TRITON_DEPRECATION; docs/DESIGN.md, the GPU section).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

ROW_BLOCK = 32  # weight rows per program (gate/up rows in phase 1, down rows in phase 2)
COL_BLOCK = 128  # columns per step of the reduction loop
MIN_TOKENS = 16  # token columns per dot: the smallest matrix the Triton dot takes
NUM_WARPS = 4
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
# JAX >= 0.11 warns when a Triton pallas_call is lowered (deprecation id "jax-pallas-triton"); JAX 0.10 does not.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def _ignore_triton_deprecation() -> None:
    """Ignores TRITON_DEPRECATION (that message, as a DeprecationWarning, nothing else) for the process. JAX warns
    when the jit around the whole step is lowered, after slot_experts returned, so a filter scoped to this call would
    not see it. Called at every trace: filterwarnings moves an existing identical filter to the front, so a filter
    added since (pytest's per-test "error", -W error) does not turn this one warning into an error."""
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def _block(dim: int, cap: int) -> int:
    """Largest power of two <= cap dividing dim (>= 16 when dim % 16 == 0)."""
    b = cap
    while dim % b:
        b //= 2
    return b


def _glu(g, v, activation: str, alpha: float, limit: float):
    """f32 gated activation, as the CPU kernel's Glu (xla_ffi/expert_kernel.cc)."""
    if activation == "silu":
        return g / (1.0 + jnp.exp(-g)) * v
    if activation == "swiglu_oai":
        g = jnp.minimum(g, limit)
        v = jnp.clip(v, -limit, limit)
        return (v + 1.0) * (g / (1.0 + jnp.exp(-alpha * g)))
    return 0.5 * g * (1.0 + jnp.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * v  # gelu_tanh


def _dot(w, x, low_precision: bool):
    """w [M, K] @ x[N, K]^T -> f32 [M, N]: bf16 x bf16 when both are bf16, else f32 x f32 without TF32."""
    if low_precision:
        return plt.dot(w, x, trans_b=True).astype(jnp.float32)
    return plt.dot(w.astype(jnp.float32), x.astype(jnp.float32), trans_b=True, allow_tf32=False)


def _gate_up_kernel(uniq_ref, x_ref, gu_ref, *rest, inter, bi, bh, has_bias, activation, alpha, limit,
                    low_precision):
    a_ref = rest[-1]
    u, b = pl.program_id(0), pl.program_id(1)
    s = uniq_ref[u]

    @pl.when(s >= 0)
    def _():
        tp = x_ref.shape[0]

        def step(c, acc):
            g, v = acc
            cols = pl.ds(c * bh, bh)
            xs = x_ref[:, cols]  # [Tp, BH]
            g = g + _dot(gu_ref[s, pl.ds(b * bi, bi), cols], xs, low_precision)  # [BI, Tp]
            v = v + _dot(gu_ref[s, pl.ds(inter + b * bi, bi), cols], xs, low_precision)
            return g, v

        zero = jnp.zeros((bi, tp), jnp.float32)
        g, v = jax.lax.fori_loop(0, x_ref.shape[1] // bh, step, (zero, zero))
        if has_bias:
            bias_ref = rest[0]
            g = g + bias_ref[s, pl.ds(b * bi, bi)].astype(jnp.float32)[:, None]
            v = v + bias_ref[s, pl.ds(inter + b * bi, bi)].astype(jnp.float32)[:, None]
        a = _glu(g, v, activation, alpha, limit)
        if x_ref.dtype == jnp.bfloat16:  # a bf16 model rounds a to bf16 before the down projection, as the CPU kernel
            a = a.astype(jnp.bfloat16).astype(jnp.float32)
        a_ref[u, pl.ds(b * bi, bi), :] = a


def _down_kernel(uniq_ref, coef_ref, a_ref, dn_ref, *rest, bo, bk, has_bias):
    part_ref = rest[-1]
    u, o = pl.program_id(0), pl.program_id(1)
    s = uniq_ref[u]
    tp = a_ref.shape[2]

    @pl.when(s >= 0)
    def _():
        def step(c, acc):
            cols = pl.ds(c * bk, bk)
            w = dn_ref[s, pl.ds(o * bo, bo), cols]  # [BO, BK]
            a = a_ref[u, cols, :]  # f32 [BK, Tp]
            return acc + plt.dot(w.astype(jnp.float32), a, allow_tf32=False)  # [BO, Tp]

        d = jax.lax.fori_loop(0, a_ref.shape[1] // bk, step, jnp.zeros((bo, tp), jnp.float32))
        if has_bias:
            d = d + rest[0][s, pl.ds(o * bo, bo)].astype(jnp.float32)[:, None]
        coef = coef_ref[u, :]  # f32 [Tp]
        part_ref[u, pl.ds(o * bo, bo), :] = jnp.where(coef[None, :] != 0, d * coef[None, :], 0.0)

    @pl.when(s < 0)
    def _():
        part_ref[u, pl.ds(o * bo, bo), :] = jnp.zeros((bo, tp), jnp.float32)


def slot_experts(x, slot_ids, weights, gate_up_slots, down_slots, activation: str = "silu", *,
                 gate_up_bias_slots=None, down_bias_slots=None, alpha: float = 1.702, limit: float = 7.0,
                 interpret: bool = False):
    """Routed experts from the slot pools on the GPU (module docstring); the arguments of ffi_ops.slot_experts.

    Args:
      x: f32 or bf16 [T, H].
      slot_ids: i32[T, k] slot per route; < 0 = skip (ids >= S are the caller's bug: the kernels do not check them).
      weights: f32[T, k] combine weights.
      gate_up_slots: f32 or bf16 [S, 2I, H]; down_slots: f32 or bf16 [S, H, I].
      activation: "silu", "gelu_tanh" or "swiglu_oai" (with alpha, limit).
      gate_up_bias_slots, down_bias_slots: optional bias pools [S, 2I] and [S, H], both or neither.
      interpret: run the kernels in Pallas' interpreter (any backend) instead of compiling them with Triton.

    Returns:
      f32[T, H].

    Raises:
      ValueError: H or I not a multiple of 16, or an unknown activation.
    """
    T, H = x.shape
    k = slot_ids.shape[1]
    inter = gate_up_slots.shape[1] // 2
    if H % 16 or inter % 16:
        raise ValueError(f"slot_experts (GPU): hidden size {H} and intermediate size {inter} must be multiples of 16 "
                         f"(the Triton dot's smallest tile)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"slot_experts (GPU): unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    if not interpret:
        _ignore_triton_deprecation()
    R, S = T * k, gate_up_slots.shape[0]
    tp = max(MIN_TOKENS, 1 << (T - 1).bit_length())
    flat = slot_ids.reshape(R)  # i32[R]
    uniq = jnp.unique(jnp.where(flat >= 0, flat, S), size=R, fill_value=S)  # ascending distinct slots, S = pad
    uniq = jnp.where(uniq < S, uniq, -1).astype(jnp.int32)  # i32[R], -1 = no slot
    match = (slot_ids[None, :, :] == uniq[:, None, None]) & (uniq[:, None, None] >= 0)  # bool[R, T, k]
    coef = jnp.sum(jnp.where(match, weights[None].astype(jnp.float32), 0.0), axis=2)  # f32[R, T]
    coef = jnp.pad(coef, ((0, 0), (0, tp - T)))  # f32[R, Tp]
    xp = jnp.pad(x, ((0, tp - T), (0, 0)))  # [Tp, H]
    low = x.dtype == jnp.bfloat16 and gate_up_slots.dtype == jnp.bfloat16
    has_bias = gate_up_bias_slots is not None
    params = plt.CompilerParams(num_warps=NUM_WARPS)

    bi, bh = _block(inter, ROW_BLOCK), _block(H, COL_BLOCK)
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, inter=inter, bi=bi, bh=bh, has_bias=has_bias, activation=activation,
                          alpha=float(alpha), limit=float(limit), low_precision=low),
        out_shape=jax.ShapeDtypeStruct((R, inter, tp), jnp.float32), grid=(R, inter // bi),
        compiler_params=params, interpret=interpret, name="ft_jax_slot_experts_gate_up")
    a = gate_up(uniq, xp, gate_up_slots, *((gate_up_bias_slots,) if has_bias else ()))  # f32[R, I, Tp]

    bo, bk = _block(H, ROW_BLOCK), _block(inter, COL_BLOCK)
    down = pl.pallas_call(
        functools.partial(_down_kernel, bo=bo, bk=bk, has_bias=has_bias),
        out_shape=jax.ShapeDtypeStruct((R, H, tp), jnp.float32), grid=(R, H // bo),
        compiler_params=params, interpret=interpret, name="ft_jax_slot_experts_down")
    part = down(uniq, coef, a, down_slots, *((down_bias_slots,) if has_bias else ()))  # f32[R, H, Tp]
    return jnp.sum(part, axis=0).T[:T]  # f32[T, H]
