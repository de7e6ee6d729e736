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

Quantized pools (``weight_format`` q8_0, q4_0, mxfp4 or fp8 blocks; layouts: ft_jax.weight_formats and the slot
rows of the expert banks: gate_up data [S, *fmt.data_shape(2I, H)], its scales [S, 2 scale_rows(I), ceil(H / bc)]
with the up matrix's scale grid after the gate's, down data [S, *fmt.data_shape(H, I)], scales [S, *scale_shape(H,
I)]) are read as stored and dequantized per tile inside the kernels: each weight tile's scales are one gather from
the scale pool at (scale row of the element's matrix row, scale column of its data column), the 8-bit values
(i8, e4m3) are widened and multiplied, the 4-bit codes (q4_0: q - 8; mxfp4: the E2M1 value, computed from the code's
bits) are split into the low-nibble and high-nibble tiles, each multiplied with the matching half of the activations
(for q4_0 the elements j and j + 16 of every 32-block, for mxfp4 the even and odd elements; XLA slices of x and of
a outside the kernels, so no in-kernel shuffle). The dots run in f32 (no TF32) for every block format, with f32
accumulation: the dequantized weights are the numpy dequantize's float32 values exactly, and so the results agree
with a float64 reference on those values to f32 rounding (tests/test_gpu_path.py).

Requires H and I to be multiples of 16 (every released MoE model's are; 32 for q8_0, q4_0 and mxfp4, whose blocks
span 32 columns); raises ValueError otherwise.
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
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ft_jax.weight_formats import MXFP4, Q4_0, WeightFormat, float_format

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


def _fp4_values(codes):
    """FP4 E2M1 values (f32) of 4-bit codes (int32 0..15: sign bit 3, exponent bits 2..1, mantissa bit 0; OCP MX
    v1.0), computed rather than looked up: |v| = (m / 2 + [e > 0]) * 2^max(e - 1, 0), exact."""
    e, m = (codes >> 1) & 3, (codes & 1).astype(jnp.float32)
    mag = (0.5 * m + (e > 0).astype(jnp.float32)) * jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0))
    return jnp.where(codes >= 8, -mag, mag)


def _scale_values(scales, fmt: WeightFormat):
    """A tile of stored scales as f32: f16 (q8_0, q4_0) and f32 (fp8) widened, E8M0 (mxfp4) 2^(s - 127) from its bits
    (s = 0: the subnormal 2^-127, as weight_formats.dequantize)."""
    if fmt is MXFP4:
        s = scales.astype(jnp.int32)
        return jax.lax.bitcast_convert_type(jnp.where(s == 0, jnp.int32(1 << 22), s << 23), jnp.float32)
    return scales.astype(jnp.float32)


def _weight_tiles(w_ref, scale_ref, s, data_row0, rows: int, matrix_row0, scale_row0: int, col0, cols: int,
                  fmt: WeightFormat):
    """Slot s's weight tile: data rows data_row0 .. + rows (matrix rows matrix_row0 .. of the matrix whose scale
    rows start at scale_row0), matrix columns col0 .. col0 + cols, dequantized per element (f32).

    Returns [w f32 [rows, cols]] for the 8-bit formats, [raw tile] for f32 / bf16, and [w_lo, w_hi] (each f32
    [rows, cols / 2]: the low / high nibble elements of the tile's bytes) for q4_0 / mxfp4, to be multiplied with
    the matching halves of the activations (_split_halves). The scale of every element comes from one gather of
    the scale pool at (scale_row0 + (matrix row) // br, (data column) // (bc / values_per_item)).
    """
    vpi = fmt.values_per_item
    data = w_ref[s, pl.ds(data_row0, rows), pl.ds(col0 // vpi, cols // vpi)]  # [rows, cols / vpi]
    if not fmt.quantized:
        return [data]
    br, bc_items = fmt.block[0], fmt.block[1] // vpi
    r = matrix_row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)  # [rows, 1] matrix rows
    c = col0 // vpi + jax.lax.broadcasted_iota(jnp.int32, (1, cols // vpi), 1)  # [1, cols / vpi] data columns
    scale = _scale_values(scale_ref[s, scale_row0 + r // br, c // bc_items], fmt)  # f32[rows, cols / vpi]
    if vpi == 1:  # q8_0 (i8), fp8 (e4m3)
        return [data.astype(jnp.float32) * scale]
    lo, hi = (data & 0x0F).astype(jnp.int32), (data >> 4).astype(jnp.int32)
    if fmt is Q4_0:
        return [(lo.astype(jnp.float32) - 8.0) * scale, (hi.astype(jnp.float32) - 8.0) * scale]
    return [_fp4_values(lo) * scale, _fp4_values(hi) * scale]  # mxfp4


def _split_halves(v, axis: int, fmt: WeightFormat) -> list:
    """The activations that meet the low and high nibbles of a 4-bit format's bytes along ``axis`` (the weights'
    column axis; XLA slices, outside the kernels): q4_0's byte j of a 32-block holds elements j and j + 16, mxfp4's
    elements 2j and 2j + 1 (weight_formats). [v] for the other formats."""
    if fmt.values_per_item == 1:
        return [v]
    n = v.shape[axis]
    if fmt is Q4_0:
        blocks = v.reshape(*v.shape[:axis], n // 32, 2, 16, *v.shape[axis + 1:])  # [..., G, 2, 16, ...]
        half = lambda i: jax.lax.index_in_dim(blocks, i, axis + 1, keepdims=False).reshape(
            *v.shape[:axis], n // 2, *v.shape[axis + 1:])
        return [half(0), half(1)]
    return [jax.lax.slice_in_dim(v, i, n, 2, axis) for i in (0, 1)]  # mxfp4: even, odd elements


def _gate_up_kernel(uniq_ref, *refs, inter, bi, bh, fmt, has_bias, activation, alpha, limit, low_precision):
    nx = fmt.values_per_item  # activation halves (_split_halves)
    x_refs, gu_ref = refs[:nx], refs[nx]
    scale_ref = refs[nx + 1] if fmt.quantized else None
    bias_ref = refs[nx + 1 + fmt.quantized] if has_bias else None
    a_ref = refs[-1]
    u, b = pl.program_id(0), pl.program_id(1)
    s = uniq_ref[u]
    up_scale_row0 = fmt.scale_rows(inter) if fmt.quantized else 0

    @pl.when(s >= 0)
    def _():
        tp = x_refs[0].shape[0]
        bx = bh // fmt.values_per_item  # columns of each activation half per step

        def step(c, acc):
            g, v = acc
            xs = [x_ref[:, pl.ds(c * bx, bx)] for x_ref in x_refs]  # [Tp, BX] each
            for w, xh in zip(_weight_tiles(gu_ref, scale_ref, s, b * bi, bi, b * bi, 0, c * bh, bh, fmt), xs):
                g = g + _dot(w, xh, low_precision)  # [BI, Tp]
            for w, xh in zip(_weight_tiles(gu_ref, scale_ref, s, inter + b * bi, bi, b * bi, up_scale_row0, c * bh,
                                           bh, fmt), xs):
                v = v + _dot(w, xh, low_precision)
            return g, v

        zero = jnp.zeros((bi, tp), jnp.float32)
        g, v = jax.lax.fori_loop(0, x_refs[0].shape[1] // bx, step, (zero, zero))
        if has_bias:
            g = g + bias_ref[s, pl.ds(b * bi, bi)].astype(jnp.float32)[:, None]
            v = v + bias_ref[s, pl.ds(inter + b * bi, bi)].astype(jnp.float32)[:, None]
        a = _glu(g, v, activation, alpha, limit)
        if x_refs[0].dtype == jnp.bfloat16:  # a bf16 model rounds a to bf16 before the down projection (CPU kernel)
            a = a.astype(jnp.bfloat16).astype(jnp.float32)
        a_ref[u, pl.ds(b * bi, bi), :] = a


def _down_kernel(uniq_ref, coef_ref, *refs, bo, bk, fmt, has_bias):
    na = fmt.values_per_item
    a_refs, dn_ref = refs[:na], refs[na]
    scale_ref = refs[na + 1] if fmt.quantized else None
    bias_ref = refs[na + 1 + fmt.quantized] if has_bias else None
    part_ref = refs[-1]
    u, o = pl.program_id(0), pl.program_id(1)
    s = uniq_ref[u]
    tp = a_refs[0].shape[2]

    @pl.when(s >= 0)
    def _():
        ba = bk // fmt.values_per_item

        def step(c, acc):
            tiles = _weight_tiles(dn_ref, scale_ref, s, o * bo, bo, o * bo, 0, c * bk, bk, fmt)  # [BO, BA] each
            for w, a_ref in zip(tiles, a_refs):
                acc = acc + plt.dot(w.astype(jnp.float32), a_ref[u, pl.ds(c * ba, ba), :], allow_tf32=False)
            return acc  # [BO, Tp]

        d = jax.lax.fori_loop(0, a_refs[0].shape[1] // ba, step, jnp.zeros((bo, tp), jnp.float32))
        if has_bias:
            d = d + bias_ref[s, pl.ds(o * bo, bo)].astype(jnp.float32)[:, None]
        coef = coef_ref[u, :]  # f32 [Tp]
        part_ref[u, pl.ds(o * bo, bo), :] = jnp.where(coef[None, :] != 0, d * coef[None, :], 0.0)

    @pl.when(s < 0)
    def _():
        part_ref[u, pl.ds(o * bo, bo), :] = jnp.zeros((bo, tp), jnp.float32)


def _check_pools(gate_up_slots, down_slots, gate_up_scale_slots, down_scale_slots, H: int,
                 fmt: WeightFormat) -> tuple[int, int]:
    """(S, I) of pools in ``fmt`` (module docstring, the CONTRACT's slot layouts). Raises ValueError naming the pool
    whose shape or dtype does not match."""
    op = f"slot_experts (GPU, {fmt.name})"
    S, inter = gate_up_slots.shape[0], gate_up_slots.shape[1] // 2
    want = {"gate_up_slots": ((S, *fmt.data_shape(2 * inter, H)), fmt.data_dtype),
            "down_slots": ((S, *fmt.data_shape(H, inter)), fmt.data_dtype)}
    pools = {"gate_up_slots": gate_up_slots, "down_slots": down_slots}
    if fmt.quantized:
        want["gate_up_scale_slots"] = ((S, 2 * fmt.scale_rows(inter), fmt.scale_shape(inter, H)[1]), fmt.scale_dtype)
        want["down_scale_slots"] = ((S, *fmt.scale_shape(H, inter)), fmt.scale_dtype)
        pools.update(gate_up_scale_slots=gate_up_scale_slots, down_scale_slots=down_scale_slots)
    elif gate_up_scale_slots is not None or down_scale_slots is not None:
        raise ValueError(f"{op}: scale pools given for a format without scales")
    for name, (shape, dtype) in want.items():
        pool = pools[name]
        if pool is None:
            raise ValueError(f"{op}: {name} is missing (a {fmt.name} pool needs both scale pools)")
        if tuple(pool.shape) != shape or (fmt.quantized and np.dtype(pool.dtype) != dtype):
            raise ValueError(f"{op}: {name} must be {list(shape)} {np.dtype(dtype).name} for x [T, {H}] and "
                             f"{2 * inter} gate/up rows, got {list(pool.shape)} {np.dtype(pool.dtype).name}")
    return S, inter


def slot_experts(x, slot_ids, weights, gate_up_slots, down_slots, activation: str = "silu", *,
                 gate_up_bias_slots=None, down_bias_slots=None, gate_up_scale_slots=None, down_scale_slots=None,
                 weight_format: WeightFormat | None = None, alpha: float = 1.702, limit: float = 7.0,
                 interpret: bool = False):
    """Routed experts from the slot pools on the GPU (module docstring); the arguments of ffi_ops.slot_experts.

    Args:
      x: f32 or bf16 [T, H].
      slot_ids: i32[T, k] slot per route; < 0 = skip (ids >= S are the caller's bug: the kernels do not check them).
      weights: f32[T, k] combine weights.
      gate_up_slots: [S, *fmt.data_shape(2I, H)] in fmt.data_dtype (f32 or bf16 [S, 2I, H] for the float formats);
        down_slots: [S, *fmt.data_shape(H, I)].
      activation: "silu", "gelu_tanh" or "swiglu_oai" (with alpha, limit).
      gate_up_bias_slots, down_bias_slots: optional bias pools [S, 2I] and [S, H], both or neither.
      gate_up_scale_slots, down_scale_slots: the scale pools of a block format: [S, 2 * fmt.scale_rows(I),
        ceil(H / bc)] (gate then up scale grids) and [S, *fmt.scale_shape(H, I)] in fmt.scale_dtype; None otherwise.
      weight_format: the pools' ft_jax.weight_formats.WeightFormat; None = the float format of the pool dtype.
      interpret: run the kernels in Pallas' interpreter (any backend) instead of compiling them with Triton.

    Returns:
      f32[T, H].

    Raises:
      ValueError: H or I not a multiple of 16 (32 for the 32-element block formats), an unknown activation, or pools
        whose shapes / dtypes do not match the format.
    """
    T, H = x.shape
    k = slot_ids.shape[1]
    fmt = float_format(gate_up_slots.dtype) if weight_format is None else weight_format
    if fmt.interleave > 1:  # the CPU banks' layout: a GPU's banks keep q4_0 rows (checkpoint.allocate_expert_banks)
        raise ValueError(f"slot_experts (GPU): {fmt.kernel_name} slots are not read here; q4_0 slots must be in row "
                         "layout")
    inter = gate_up_slots.shape[1] // 2
    if H % 16 or inter % 16:
        raise ValueError(f"slot_experts (GPU): hidden size {H} and intermediate size {inter} must be multiples of 16 "
                         f"(the Triton dot's smallest tile)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"slot_experts (GPU): unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    S, inter = _check_pools(gate_up_slots, down_slots, gate_up_scale_slots, down_scale_slots, H, fmt)
    if not interpret:
        _ignore_triton_deprecation()
    R = T * k
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
    scales = (lambda pool: (pool,) if fmt.quantized else ())
    bias = (lambda pool: (pool,) if has_bias else ())

    bi, bh = _block(inter, ROW_BLOCK), _block(H, COL_BLOCK)
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, inter=inter, bi=bi, bh=bh, fmt=fmt, has_bias=has_bias,
                          activation=activation, alpha=float(alpha), limit=float(limit), low_precision=low),
        out_shape=jax.ShapeDtypeStruct((R, inter, tp), jnp.float32), grid=(R, inter // bi),
        compiler_params=params, interpret=interpret, name="ft_jax_slot_experts_gate_up")
    a = gate_up(uniq, *_split_halves(xp, 1, fmt), gate_up_slots, *scales(gate_up_scale_slots),
                *bias(gate_up_bias_slots))  # f32[R, I, Tp]

    bo, bk = _block(H, ROW_BLOCK), _block(inter, COL_BLOCK)
    down = pl.pallas_call(
        functools.partial(_down_kernel, bo=bo, bk=bk, fmt=fmt, has_bias=has_bias),
        out_shape=jax.ShapeDtypeStruct((R, H, tp), jnp.float32), grid=(R, H // bo),
        compiler_params=params, interpret=interpret, name="ft_jax_slot_experts_down")
    part = down(uniq, coef, *_split_halves(a, 1, fmt), down_slots, *scales(down_scale_slots),
                *bias(down_bias_slots))  # f32[R, H, Tp]
    return jnp.sum(part, axis=0).T[:T]  # f32[T, H]
