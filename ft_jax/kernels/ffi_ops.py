"""JAX wrappers of the ft_jax XLA FFI handlers (registered by ``import ft_jax``: CPU, and CUDA where built and present).

On a GPU (ft_jax.CUDA_ENABLED) slot_fill is the same call (its CUDA handler: a kernel reading the ids on the device),
host_experts lowers to host_experts_submit + host_experts_wait (host-function nodes around the CPU GEMV), and
slot_experts to the Pallas kernels of ft_jax.kernels.device_experts; jax.lax.platform_dependent picks the form when
the step is lowered, so callers write one step for both.

Per-step data (ids, weights, activations, slot arrays, layer indices) are operands; host banks are compile-time
attributes (their integer ids, bound to the executable once at XLA's instantiate stage), so one compiled step
replays for any routing. The handlers run on the caller's XLA thread pool. Every wrapper checks shapes, dtypes, bank
layouts and liveness at trace time and raises TypeError / ValueError naming the problem. The C++ side checks bank
layouts once per executable (host_experts' instantiate stage; a guard for callers that bypass these wrappers), and
rejects out-of-range ids, which only exist at run time: the call then raises jax.errors.JaxRuntimeError (or
ValueError when jit's C++ fast path dispatched it) with a message naming the id and the bank, and the process
carries on (slot_fill writes nothing then).

Weight formats (ft_jax.weight_formats): every weight operand (host bank, slot pool, dense matrix) is either float32 /
bfloat16, or stored in a block format (q8_0, q4_0, mxfp4, block-scaled fp8) as its data plus a scale operand; the
``weight_format`` keyword names the format (default: the float format of the weight dtype). The CPU kernels read the
stored bytes and dequantize in registers with float32 activations and accumulation (xla_ffi/quant_dot.h). A gate_up
row [2I, H] holds the gate matrix then the up matrix; its scale row holds their two scale grids stacked
([2 * fmt.scale_rows(I), ceil(H / block_cols)]).

Expert math (host_experts and slot_experts), for every token t:
    y[t] = sum_j weights[t, j] * (down_e @ glu(gate_e @ x[t] + bg_e, up_e @ x[t] + bu_e) + bd_e),  e = ids[t, j] >= 0
with gate_e = gate_up_e[:I], up_e = gate_up_e[I:], optional biases bg_e = gate_up_bias_e[:I], bu_e =
gate_up_bias_e[I:], bd_e = down_bias_e (0 when absent), float32 accumulation, and glu(g, u) by activation:
    "silu"       silu(g) * u  (SwiGLU)
    "gelu_tanh"  0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u
    "swiglu_oai" gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate): g' = min(g, limit),
                 u' = clamp(u, -limit, limit), (u' + 1) * g' * sigmoid(alpha * g')  (gpt-oss: alpha 1.702, limit 7.0)
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import ft_jax  # registers the FFI targets; CUDA_ENABLED
from ft_jax import weight_formats
from ft_jax.kernels.host_bank import HostBank
from ft_jax.weight_formats import WeightFormat

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's defaults (transformers' GptOssConfig)
_WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


def _shape_dtype(value, op: str, name: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        return tuple(value.shape), np.dtype(value.dtype)
    except AttributeError:
        raise TypeError(f"{op}: {name} must be an array (jax or numpy), got {type(value).__name__}") from None


def _expect(op: str, name: str, value, ndim: int, dtypes: tuple[np.dtype, ...], layout: str):
    shape, dtype = _shape_dtype(value, op, name)
    if dtype not in dtypes:
        allowed = " or ".join(d.name for d in dtypes)
        raise TypeError(f"{op}: {name} {layout} must be {allowed}, got {dtype.name}")
    if len(shape) != ndim:
        raise ValueError(f"{op}: {name} must be {layout} (rank {ndim}), got shape {shape}")
    return shape, dtype


def _expect_bank(op: str, name: str, bank) -> HostBank:
    if not isinstance(bank, HostBank):
        raise TypeError(f"{op}: {name} must be a HostBank, got {type(bank).__name__}")
    if not bank.alive:
        raise ValueError(f"{op}: {name} {bank.id} {bank_desc_shape(bank)} was released")
    return bank


def _expect_activation(op: str, activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    return activation


def _resolve_format(op: str, weight_format, name: str, dtype) -> WeightFormat:
    """The WeightFormat of a call: weight_format, or (None) the float format of the weight dtype."""
    if weight_format is None:
        if np.dtype(dtype) not in _WEIGHT_DTYPES:
            raise TypeError(f"{op}: {name} is {np.dtype(dtype).name}: float weights must be float32 or bfloat16; pass "
                            f"weight_format= (a ft_jax.weight_formats.WeightFormat) for stored quantized weights")
        return weight_formats.float_format(dtype)
    if not isinstance(weight_format, WeightFormat):
        raise TypeError(f"{op}: weight_format must be a ft_jax.weight_formats.WeightFormat or None, got "
                        f"{type(weight_format).__name__}")
    return weight_format


def _format_attrs(fmt: WeightFormat) -> dict:
    """The weight_format / block_rows / block_cols attributes of the FFI calls ("float" and (1, 1) for f32 / bf16)."""
    return dict(weight_format=fmt.kernel_name, block_rows=np.int64(fmt.block[0]), block_cols=np.int64(fmt.block[1]))


def _check_stored(op: str, name: str, shape, dtype, fmt: WeightFormat, rows: int, cols: int) -> None:
    """One stored matrix [rows, cols] (shape: its data array without leading axes) in block format fmt: cols must fit
    the blocks, data dtype and shape fmt's. Raises TypeError / ValueError naming the operand."""
    fmt.check_cols(cols, f"{op}: {name}")
    if np.dtype(dtype) != fmt.data_dtype:
        raise TypeError(f"{op}: {name} must be {fmt.data_dtype.name} ({fmt.name} data), got {np.dtype(dtype).name}")
    want = fmt.data_shape(rows, cols)
    if tuple(shape) != want:
        raise ValueError(f"{op}: {name} must hold {fmt.name} data {list(want)} of a [{rows}, {cols}] matrix, got "
                         f"{list(shape)}")


def _check_scales(op: str, name: str, shape, dtype, fmt: WeightFormat, want: tuple[int, int]) -> None:
    """A scale array (shape without leading axes) must be fmt.scale_dtype of shape want."""
    if np.dtype(dtype) != fmt.scale_dtype:
        raise TypeError(f"{op}: {name} must be {fmt.scale_dtype.name} ({fmt.name} scales), got {np.dtype(dtype).name}")
    if tuple(shape) != tuple(want):
        raise ValueError(f"{op}: {name} must be {list(want)} ({fmt.name} scales of blocks {list(fmt.block)}), got "
                         f"{list(shape)}")


def _gate_up_scale_shape(fmt: WeightFormat, hidden: int, inter: int) -> tuple[int, int]:
    """Scale row of a gate_up pair [2I, H]: the gate and up grids stacked."""
    return 2 * fmt.scale_rows(inter), fmt.scale_shape(inter, hidden)[1]


def kernel_isa() -> str:
    """The inner loops the CPU kernels run: "avx512bf16", "avx2" or "generic" (the CPU's best, or FT_JAX_KERNEL's
    cap; xla_ffi/isa.cc)."""
    return ft_jax._ffi.kernel_isa()


def slot_fill(pools, flat_ids, slot_ids, banks):
    """slot_fill_with_errors without the error count (tools and tests that check their ids themselves).

    Returns:
      tuple of P pools with the rows replaced.
    """
    return slot_fill_with_errors(pools, flat_ids, slot_ids, banks)[0]


def slot_fill_with_errors(pools, flat_ids, slot_ids, banks):
    """Copies host bank rows into slot pools, one call for every pool: pools[p][slot_ids[n]] = banks[p][flat_ids[n]]
    for every n with both ids >= 0 (e.g. pools = (gate_up_slots, down_slots), banks = (gate_up_bank, down_bank)).

    Args:
      pools: sequence of P arrays [S, *banks[p].row_shape] of dtype banks[p].dtype, same S. Each is aliased to its
        result (input_output_aliases): call under jax.jit with the pools donated and XLA updates the buffers in
        place, copying only the N rows.
      flat_ids: i32[N] bank rows (flat expert ids); < 0 = padding.
      slot_ids: i32[N] destination slots; < 0 = padding.
      banks: sequence of P live HostBanks.

    Returns:
      (tuple of P pools with the rows replaced (same shapes and dtypes), errors i32[]: entries skipped because an id
      was out of range). A call whose ids are all padding returns at once. On the CPU an out-of-range id is a run-time
      error instead (errors is then always 0); on a GPU the kernel cannot stop the step without a host sync, so it
      skips the entry and counts it: accumulate errors on the device and check it when statistics are read
      (OffloadedExperts.read_stats).

    Raises:
      TypeError / ValueError at trace time for wrong dtypes or shapes, a pool count that differs from the bank count
      or a released bank. On the CPU out-of-range ids fail at run time (JAX runtime error naming the id and the
      bank); the pools are left untouched then.
    """
    op = "slot_fill"
    pools, banks = tuple(pools), tuple(banks)
    if not pools or len(pools) != len(banks):
        raise ValueError(f"{op}: need one bank per pool, got {len(pools)} pools and {len(banks)} banks")
    num_slots = None
    for p, (pool, bank) in enumerate(zip(pools, banks)):
        bank = _expect_bank(op, f"banks[{p}]", bank)
        shape, dtype = _shape_dtype(pool, op, f"pools[{p}]")
        if dtype != bank.dtype:
            raise TypeError(f"{op}: pools[{p}] dtype {dtype.name} does not match bank {bank.id} dtype {bank.dtype.name}")
        if len(shape) < 1 or shape[1:] != bank.row_shape:
            raise ValueError(f"{op}: pools[{p}] must be [S, *row_shape] with row_shape {bank.row_shape} of bank "
                             f"{bank.id} ({bank.row_bytes} bytes per row), got shape {shape}")
        if num_slots is not None and shape[0] != num_slots:
            raise ValueError(f"{op}: pools[{p}] has {shape[0]} slots, pools[0] has {num_slots}")
        num_slots = shape[0]
    (n,), _ = _expect(op, "flat_ids", flat_ids, 1, (np.dtype(np.int32),), "[N]")
    (n2,), _ = _expect(op, "slot_ids", slot_ids, 1, (np.dtype(np.int32),), "[N]")
    if n != n2:
        raise ValueError(f"{op}: flat_ids has {n} entries but slot_ids has {n2}")
    call = jax.ffi.ffi_call(
        "ft_jax_slot_fill",
        (*(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pools), jax.ShapeDtypeStruct((), jnp.int32)),
        input_output_aliases={2 + p: p for p in range(len(pools))},
    )
    *filled, errors = call(flat_ids, slot_ids, *pools, banks=np.array([b.id for b in banks], np.int64))
    return tuple(filled), errors


def linear(x, w, layer=0, *, scales=None, weight_format: WeightFormat | None = None):
    """Dense projection y = x @ W[layer].T with float32 accumulation, reading each stored weight byte once (the CPU
    handler; block formats are dequantized in registers, xla_ffi/quant_dot.h).

    Args:
      x: f32 or bf16 [N, K] activations.
      w: the weights in Hugging Face [out, in] layout: float32 or bfloat16 (or uint16 holding bf16 bits) [L, O, K]
        (a stack of L) or [O, K] (L = 1); for a block format its data [L, *fmt.data_shape(O, K)] or
        fmt.data_shape(O, K) (q4_0 / mxfp4: K / 2 bytes per row).
      layer: i32[] or Python int: which weight of the stack (traced values are fine: the scanned decode step
        passes its layer index, and the handler reads that weight in place, without a copy of the slice).
      scales: the block format's scales [L, *fmt.scale_shape(O, K)] (or 2-D with a 2-D w); None for float formats.
      weight_format: a ft_jax.weight_formats.WeightFormat; None = the float format of w's dtype.

    Returns:
      f32[N, O].

    Raises:
      TypeError / ValueError at trace time for dtypes or shapes (w and scales checked against weight_format, K not
      fitting the format's blocks, scales given for a float format or missing for a block format); a layer outside
      [0, L) fails at run time.
    """
    op = "linear"
    (N, K), _ = _expect(op, "x", x, 2, _WEIGHT_DTYPES, "[N, K]")
    wshape, wdtype = _shape_dtype(w, op, "w")
    fmt = weight_format
    if fmt is None and wdtype == np.dtype(np.uint16):
        fmt = weight_formats.BF16  # bf16 bits (a tied bf16 embedding table)
    fmt = _resolve_format(op, fmt, "w", wdtype)
    operands = ()
    if not fmt.quantized:
        if scales is not None:
            raise ValueError(f"{op}: scales given for the float format {fmt.name} (only block formats have scales)")
        _expect(op, "w", w, len(wshape) if len(wshape) in (2, 3) else 3, _WEIGHT_DTYPES + (np.dtype(np.uint16),),
                "[L, O, K] or [O, K]")
        if wshape[-1] != K:
            raise ValueError(f"{op}: x [{N}, {K}] and w {list(wshape)} disagree on K (the input width)")
    else:
        if scales is None:
            raise ValueError(f"{op}: {fmt.name} weights need their scales (scales=)")
        if len(wshape) not in (2, 3):
            raise ValueError(f"{op}: w must be [L, O, Kd] or [O, Kd] ({fmt.name} data), got shape {wshape}")
        O = wshape[-2]
        _check_stored(op, f"w {list(wshape)}", wshape[-2:], wdtype, fmt, O, K)
        sshape, sdtype = _shape_dtype(scales, op, "scales")
        if len(sshape) != len(wshape) or sshape[:-2] != wshape[:-2]:
            raise ValueError(f"{op}: scales {list(sshape)} must have the leading axes of w {list(wshape)}")
        _check_scales(op, f"scales {list(sshape)}", sshape[-2:], sdtype, fmt, fmt.scale_shape(O, K))
        operands = (scales,)
    layer = jnp.asarray(layer, jnp.int32)
    if layer.shape != ():
        raise ValueError(f"{op}: layer must be a scalar, got shape {layer.shape}")
    call = jax.ffi.ffi_call("ft_jax_linear", jax.ShapeDtypeStruct((N, wshape[-2]), jnp.float32))
    return call(x, w, layer, *operands, **_format_attrs(fmt))


def bank_linear(x, bank: HostBank, layer=0):
    """Dense projection y = x @ W[layer].T with float32 accumulation, the weights read where a host bank holds them
    (row ``layer`` of ``bank``: for a checkpoint loaded with mapped pages, the file's own page-cache pages). The same
    kernel and the same bits per row as :func:`linear` on that matrix.

    Args:
      x: f32 or bf16 [N, K] activations.
      bank: HostBank of float32 or bfloat16 rows [O, K] (row l: layer l's weight in Hugging Face [out, in] layout).
      layer: i32[] or Python int, the row (traced values are fine: the scanned decode step passes its layer index).

    Returns:
      f32[N, O].

    Raises:
      TypeError / ValueError at trace time for dtypes or shapes, a bank of another dtype or row rank, or a released
      bank; a layer outside [0, bank.num_rows) fails at run time.
    """
    op = "bank_linear"
    (N, K), _ = _expect(op, "x", x, 2, _WEIGHT_DTYPES, "[N, K]")
    _expect_bank(op, "bank", bank)
    if bank.dtype not in _WEIGHT_DTYPES or len(bank.row_shape) != 2:
        raise TypeError(f"{op}: bank {bank.id} {bank_desc_shape(bank)} must hold float32 or bfloat16 rows [O, K]")
    O, Kw = bank.row_shape
    if Kw != K:
        raise ValueError(f"{op}: x [{N}, {K}] and bank {bank.id} rows [{O}, {Kw}] disagree on K (the input width)")
    layer = jnp.asarray(layer, jnp.int32)
    if layer.shape != ():
        raise ValueError(f"{op}: layer must be a scalar, got shape {layer.shape}")
    call = jax.ffi.ffi_call("ft_jax_bank_linear", jax.ShapeDtypeStruct((N, O), jnp.float32))
    return call(x, layer, bank=np.int64(bank.id))


def bank_take(ids, bank: HostBank):
    """Rows of the table a host bank holds as its one row [V, H] (the embedding lookup): y[n] = table[ids[n]], the
    stored values (no arithmetic).

    Args:
      ids: i32[N] row indices in [0, V).
      bank: HostBank of one row [V, H], float32 or bfloat16.

    Returns:
      [N, H] of the bank's dtype.

    Raises:
      TypeError / ValueError at trace time for dtypes or shapes, another bank layout, or a released bank; an id
      outside [0, V) fails at run time with an error naming it.
    """
    op = "bank_take"
    (N,), _ = _expect(op, "ids", ids, 1, (np.dtype(np.int32),), "[N]")
    _expect_bank(op, "bank", bank)
    if bank.dtype not in _WEIGHT_DTYPES or bank.num_rows != 1 or len(bank.row_shape) != 2:
        raise TypeError(f"{op}: bank {bank.id} {bank_desc_shape(bank)} must hold one float32 or bfloat16 table "
                        f"[V, H]")
    call = jax.ffi.ffi_call("ft_jax_bank_take", jax.ShapeDtypeStruct((N, bank.row_shape[1]), bank.dtype))
    return call(ids, bank=np.int64(bank.id))


def decode_attention(q, k_cache, v_cache, layer, rows, positions, window, *, scale: float, sinks=None):
    """One decode step's grouped-query softmax attention over a stacked KV cache as stored (the CPU handler,
    xla_ffi/decode_attention.cc): for query head h of row b at position p = positions[b], over the keys j of cache
    row rows[b] at indices max(0, p - window + 1) .. p of KV head h // (NH / KVH),
        s_j = rnd(rnd(q[b, h] . k_j) * scale),  p_j = rnd(softmax(s ++ [sinks[h]])_j),  out[b, h] = rnd(sum_j p_j v_j)
    with float32 sums and rnd the rounding to q's dtype (none for float32): transformers' eager_attention_forward in
    the model dtype (scores and their scaling in the dtype, softmax in float32; gpt-oss's sink as one more logit
    dropped after the softmax). A padding row (p = -1) gets zeros.

    Args:
      q: f32 | bf16 [B, NH, D] queries (after RoPE).
      k_cache, v_cache: [n, Bc, S, KVH, D] stacks of layer caches in layers.cache_store form (bf16 as uint16 bits,
        or bf16; float32 for a float32 q); NH a multiple of KVH.
      layer: i32[] (or int) which layer of the stack.
      rows: i32[B] cache row of each query row. positions: i32[B] in [-1, S) (-1 = padding).
      window: i32[] (or int) sliding window in keys; >= S for full attention.
      scale: the score scaling (head_dim ** -0.5; any finite value).
      sinks: f32[NH] this layer's sink logits, or None.

    Returns:
      [B, NH, D] in q's dtype.

    Raises:
      TypeError / ValueError at trace time for dtypes or shapes; a layer, row or position outside the cache fails
      at run time.
    """
    op = "decode_attention"
    (B, NH, D), qdtype = _expect(op, "q", q, 3, _WEIGHT_DTYPES, "[B, NH, D]")
    cache_dtypes = (np.dtype(jnp.bfloat16), np.dtype(np.uint16)) if qdtype == np.dtype(jnp.bfloat16) \
        else (np.dtype(np.float32),)
    kshape, _ = _expect(op, "k_cache", k_cache, 5, cache_dtypes, "[n, Bc, S, KVH, D]")
    vshape, _ = _expect(op, "v_cache", v_cache, 5, cache_dtypes, "[n, Bc, S, KVH, D]")
    if kshape != vshape or kshape[-1] != D or kshape[3] < 1 or NH % kshape[3]:
        raise ValueError(f"{op}: q [{B}, {NH}, {D}] needs key and value caches [n, Bc, S, KVH, {D}] alike with NH a "
                         f"multiple of KVH, got {list(kshape)} and {list(vshape)}")
    for name, value in (("rows", rows), ("positions", positions)):
        shape, _ = _expect(op, name, value, 1, (np.dtype(np.int32),), f"[{B}]")
        if shape != (B,):
            raise ValueError(f"{op}: {name} must be [{B}], got {list(shape)}")
    operands = ()
    if sinks is not None:
        shape, _ = _expect(op, "sinks", sinks, 1, (np.dtype(np.float32),), f"[{NH}]")
        if shape != (NH,):
            raise ValueError(f"{op}: sinks must be [{NH}], got {list(shape)}")
        operands = (sinks,)
    call = jax.ffi.ffi_call("ft_jax_decode_attention", jax.ShapeDtypeStruct((B, NH, D), qdtype))
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), rows, positions, jnp.asarray(window, jnp.int32),
                *operands, scale=np.float32(scale))


def greedy_pick(logits):
    """The greedy token of each row, checked finite (the CPU handler, xla_ffi/greedy_pick.cc): ids[b] = the first
    index of the maximum of logits[b], as jnp.argmax, or -1 when the row holds a NaN or an infinity. One pass over
    the row where XLA:CPU runs a tree of reduce-window loops (docs/DESIGN.md sec. 20.33). Like XLA's ops it runs
    under XLA:CPU's flush-to-zero mode: subnormal logits count as zeros.

    Args:
      logits: f32[B, V], V >= 1.

    Returns:
      i32[B]. Under jax.vmap, one call per mapped element.

    Raises:
      TypeError / ValueError at trace time for another dtype or rank.
    """
    (B, V), _ = _expect("greedy_pick", "logits", logits, 2, (np.dtype(np.float32),), "[B, V]")
    if V < 1:
        raise ValueError(f"greedy_pick: logits [B, V] need V >= 1, got shape {(B, V)}")
    return jax.ffi.ffi_call("ft_jax_greedy_pick", jax.ShapeDtypeStruct((B,), jnp.int32),
                            vmap_method="sequential")(logits)


def rope(x, cos, sin):
    """RoPE (Su et al. 2021) of bf16 heads in the rotate-half layout, with transformers' bf16 roundings (the CPU
    handler, xla_ffi/rope.cc): out = bf16(bf16(x * bf16(cos)) + bf16(rotate_half(x) * bf16(sin))), rotate_half(x) =
    (-x2, x1) for the halves (x1, x2) of a head; bit-identical to ft_jax.models.layers.apply_rope's XLA ops (under
    the same flush-to-zero mode: subnormals are zeros; a NaN's payload may differ), in one vectorized loop where
    XLA:CPU's fusion takes 5 ns a value (docs/DESIGN.md sec. 20.33).

    Args:
      x: bf16[B, T, H, D], D even.
      cos, sin: f32[B, T, D] (layers.rope_cos_sin), one row per token for all H heads.

    Returns:
      bf16[B, T, H, D]. Under jax.vmap, one call per mapped element.

    Raises:
      TypeError / ValueError at trace time for other dtypes, ranks or shapes.
    """
    op = "rope"
    (B, T, H, D), _ = _expect(op, "x", x, 4, (np.dtype(jnp.bfloat16),), "[B, T, H, D]")
    for name, table in (("cos", cos), ("sin", sin)):
        shape, _ = _expect(op, name, table, 3, (np.dtype(np.float32),), "[B, T, D]")
        if shape != (B, T, D):
            raise ValueError(f"{op}: {name} must be [B, T, D] = {[B, T, D]} for x {[B, T, H, D]}, got {list(shape)}")
    if D % 2:
        raise ValueError(f"{op}: x [B, T, H, D] needs an even D (two halves), got {[B, T, H, D]}")
    return jax.ffi.ffi_call("ft_jax_rope", jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16),
                            vmap_method="sequential")(x, cos, sin)


def _check_expert_inputs(op: str, x, ids, weights, ids_name: str) -> tuple[int, int, int]:
    (T, H), _ = _expect(op, "x", x, 2, _WEIGHT_DTYPES, "[T, H]")
    (Ti, k), _ = _expect(op, ids_name, ids, 2, (np.dtype(np.int32),), "[T, k]")
    wshape, _ = _expect(op, "weights", weights, 2, (np.dtype(np.float32),), "[T, k]")
    if Ti != T or wshape != (T, k):
        raise ValueError(f"{op}: {ids_name} {(Ti, k)} and weights {wshape} must both be [T, k] with T = {T} (rows of x)")
    return T, H, k


def _check_gate_params(op: str, alpha, limit) -> tuple[np.float32, np.float32]:
    """alpha and limit of the clamped SwiGLU as float32 attributes: finite numbers, limit > 0."""
    for name, v in (("alpha", alpha), ("limit", limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not np.isfinite(v):
            raise ValueError(f"{op}: {name} must be a finite number, got {v!r}")
    if not limit > 0:
        raise ValueError(f"{op}: limit must be > 0, got {limit}")
    return np.float32(alpha), np.float32(limit)


def _check_bias_bank(op: str, name: str, bank, num_rows: int, width: int, layout: str) -> HostBank:
    bank = _expect_bank(op, f"{name} bank", bank)
    if bank.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"{op}: {name} bank {bank.id} must be float32 or bfloat16, got {bank.dtype.name}")
    if bank.row_shape != (width,) or bank.num_rows != num_rows:
        raise ValueError(f"{op}: {name} bank {bank_desc(bank)} must hold {num_rows} rows {layout} = [{width}]")
    return bank


def host_experts(x, flat_ids, weights, gate_up: HostBank, down: HostBank, activation: str = "silu", *,
                 gate_up_bias: HostBank | None = None, down_bias: HostBank | None = None,
                 gate_up_scale: HostBank | None = None, down_scale: HostBank | None = None,
                 weight_format: WeightFormat | None = None, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT):
    """Routed experts computed on the CPU straight from the host banks (multi-threaded GEMV, f32 accumulation).
    On a GPU: host_experts_submit then host_experts_wait (x, ids and weights copied to pinned host memory, the GEMV
    on ft_jax's CPU worker pool, y copied back), all stream-ordered.

    Args:
      x: f32 or bf16 [T, H] token activations.
      flat_ids: i32[T, k] flat expert ids (bank rows); -1 (any negative) = skip the route.
      weights: f32[T, k] combine weights.
      gate_up: HostBank of rows [2I, H] (gate rows then up rows), float32 or bfloat16; for a block format
        weight_format its data rows fmt.data_shape(2I, H) in fmt.data_dtype (q4_0 / mxfp4: [2I, H / 2] uint8).
      down: HostBank of rows [H, I] (float32 or bfloat16, or fmt.data_shape(H, I) in fmt.data_dtype), same num_rows
        as gate_up.
      activation: "silu" (SwiGLU), "gelu_tanh" or "swiglu_oai" (gpt-oss's clamped SwiGLU).
      gate_up_bias, down_bias: optional HostBanks of rows [2I] (gate bias then up bias) and [H], float32 or
        bfloat16, same num_rows; both or neither.
      gate_up_scale, down_scale: the block format's scale HostBanks (both iff weight_format is a block format), rows
        [2 * fmt.scale_rows(I), ceil(H / block_cols)] (the gate grid then the up grid) and fmt.scale_shape(H, I), in
        fmt.scale_dtype (q8_0 / q4_0 float16, mxfp4 uint8 E8M0, fp8 float32).
      weight_format: a ft_jax.weight_formats.WeightFormat (F32, BF16, Q8_0, Q4_0, MXFP4, fp8(block)); None = the
        float format of the bank dtypes (float32 or bfloat16).
      alpha, limit: the clamped SwiGLU's sigmoid gain and clamp (read by "swiglu_oai" only; limit > 0).

    Returns:
      f32[T, H]: sum over routes of weight * expert(x) (formula in the module docstring). On a GPU a bad id yields
      zeros without an error: use host_experts_with_errors where that must not pass silently.

    Raises:
      TypeError / ValueError at trace time (dtypes, shapes, banks that do not match weight_format or each other or
      were released, H or I not fitting the format's blocks, scale banks missing for a block format or given for a
      float one, unknown activation, one bias bank without the other, a non-finite alpha / limit); on the CPU an
      out-of-range id fails at run time with an error naming it and the bank.
    """
    return host_experts_with_errors(x, flat_ids, weights, gate_up, down, activation, gate_up_bias=gate_up_bias,
                                    down_bias=down_bias, gate_up_scale=gate_up_scale, down_scale=down_scale,
                                    weight_format=weight_format, alpha=alpha, limit=limit)[0]


def host_experts_with_errors(x, flat_ids, weights, gate_up: HostBank, down: HostBank, activation: str = "silu", *,
                             gate_up_bias: HostBank | None = None, down_bias: HostBank | None = None,
                             gate_up_scale: HostBank | None = None, down_scale: HostBank | None = None,
                             weight_format: WeightFormat | None = None, alpha: float = SWIGLU_ALPHA,
                             limit: float = SWIGLU_LIMIT):
    """host_experts (same arguments) and its error count.

    Returns:
      (y f32[T, H], errors i32[]). On the CPU errors is always 0 (an out-of-range id raises, as host_experts). On a GPU
      the host node cannot stop the stream: a call with an out-of-range id or a bank released under the running step
      has y = zeros and errors = 1; accumulate errors on the device and check it when statistics are read
      (OffloadedExperts.read_stats, OffloadState.host_route_errors).
    """
    T, H, _, attrs = _host_experts_attrs("host_experts", x, flat_ids, weights, gate_up, down, activation,
                                         gate_up_bias, down_bias, gate_up_scale, down_scale, weight_format, alpha,
                                         limit)

    def cpu(x, flat_ids, weights):
        y = jax.ffi.ffi_call("ft_jax_host_experts", jax.ShapeDtypeStruct((T, H), jnp.float32))(
            x, flat_ids, weights, **attrs)
        return y, jnp.zeros((), jnp.int32)

    if not ft_jax.CUDA_ENABLED:
        return cpu(x, flat_ids, weights)

    def cuda(x, flat_ids, weights):
        ticket = host_experts_submit(x, flat_ids, weights, gate_up, down, activation, gate_up_bias=gate_up_bias,
                                     down_bias=down_bias, gate_up_scale=gate_up_scale, down_scale=down_scale,
                                     weight_format=weight_format, alpha=alpha, limit=limit)
        return host_experts_wait(ticket, jnp.zeros((T, H), jnp.float32))

    return jax.lax.platform_dependent(x, flat_ids, weights, cpu=cpu, cuda=cuda)


_pair_ids = itertools.count(1)  # host_experts_submit / _wait pair ids, one per traced submit (never reused)


@jax.tree_util.register_pytree_node_class
class HostTicket:
    """What host_experts_submit returns and host_experts_wait takes: the ticket array (u8[], orders the wait after
    the submit; its value means nothing) and the pair id both custom calls carry as their `pair` attribute (static:
    pytree aux data, so the ticket passes through jax.lax.optimization_barrier and other pytree functions)."""

    def __init__(self, ticket, pair: int):
        self.ticket = ticket
        self.pair = pair

    def tree_flatten(self):
        return (self.ticket,), self.pair

    @classmethod
    def tree_unflatten(cls, pair, children):
        return cls(children[0], pair)


def host_experts_submit(x, flat_ids, weights, gate_up: HostBank, down: HostBank, activation: str = "silu", *,
                        gate_up_bias: HostBank | None = None, down_bias: HostBank | None = None,
                        gate_up_scale: HostBank | None = None, down_scale: HostBank | None = None,
                        weight_format: WeightFormat | None = None, alpha: float = SWIGLU_ALPHA,
                        limit: float = SWIGLU_LIMIT) -> HostTicket:
    """GPU only: starts host_experts (same arguments): stream-ordered D2H copies of x, flat_ids and weights into the
    call site's pinned staging, then a host-function node that queues the GEMV on the CPU worker pool and returns.
    Device work issued after it overlaps the CPU work; host_experts_wait(ticket, after) collects y.

    Returns:
      HostTicket: pass it to host_experts_wait. Each call (each trace) takes a new pair id, so the submit / wait
      custom calls of one pair carry the same `pair` attribute and distinct pairs distinct ones; the CUDA handlers
      find the submit's channel by it.

    Raises:
      as host_experts at trace time; lowering it for the CPU fails (no CPU handler: use host_experts).
    """
    T, _, k, attrs = _host_experts_attrs("host_experts_submit", x, flat_ids, weights, gate_up, down, activation,
                                         gate_up_bias, down_bias, gate_up_scale, down_scale, weight_format, alpha,
                                         limit)
    pair = next(_pair_ids)
    call = jax.ffi.ffi_call("ft_jax_host_experts_submit", jax.ShapeDtypeStruct((), jnp.uint8))
    ticket = call(x, flat_ids, weights, tokens=np.int64(T), top_k=np.int64(k), pair=np.int64(pair), **attrs)
    return HostTicket(ticket, pair)


def host_experts_wait(ticket: HostTicket, after):
    """GPU only: finishes the host_experts started by host_experts_submit: a host-function node that blocks until the
    CPU worker pool has computed it, then the H2D copies of y and the error count.

    Args:
      ticket: HostTicket from host_experts_submit.
      after: f32[T, H], any value the wait must come after (the device experts' output): XLA cannot move the wait,
        and so the blocking host node, ahead of the device work it should overlap.

    Returns:
      (y f32[T, H]: the host experts' output, errors i32[]: 1 when the GEMV was skipped (an id out of range or a
      released bank; y is zeros then), else 0).

    Raises:
      TypeError: ticket is not a HostTicket; ValueError: after is not f32[T, H].
    """
    if not isinstance(ticket, HostTicket):
        raise TypeError(f"host_experts_wait: ticket must be the HostTicket of host_experts_submit, got "
                        f"{type(ticket).__name__}")
    shape, dtype = _shape_dtype(after, "host_experts_wait", "after")
    if len(shape) != 2 or dtype != np.dtype(np.float32):
        raise ValueError(f"host_experts_wait: after must be f32[T, H], got {dtype.name}{list(shape)}")
    results = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    return jax.ffi.ffi_call("ft_jax_host_experts_wait", results)(ticket.ticket, after, pair=np.int64(ticket.pair))


def _host_experts_attrs(op, x, flat_ids, weights, gate_up, down, activation, gate_up_bias, down_bias, gate_up_scale,
                        down_scale, weight_format, alpha, limit):
    """host_experts' trace-time checks; returns (T, H, k, attributes of the FFI call)."""
    gate_up = _expect_bank(op, "gate_up bank", gate_up)
    down = _expect_bank(op, "down bank", down)
    activation = _expect_activation(op, activation)
    alpha, limit = _check_gate_params(op, alpha, limit)
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError(f"{op}: pass both bias banks (gate_up_bias and down_bias) or neither")
    T, H, k = _check_expert_inputs(op, x, flat_ids, weights, "flat_ids")
    fmt = _resolve_format(op, weight_format, f"gate_up bank {bank_desc(gate_up)}", gate_up.dtype)
    gs = gate_up.row_shape
    if len(gs) != 2 or gs[0] % 2:
        raise ValueError(f"{op}: gate_up bank {bank_desc(gate_up)} must have rows [2I, H] with H = {H} (columns of x)")
    inter = gs[0] // 2
    scale_ids = []
    if not fmt.quantized:
        if gate_up_scale is not None or down_scale is not None:
            raise ValueError(f"{op}: scale banks given for the float format {fmt.name} (only block formats have "
                             f"scales)")
        for name, bank in (("gate_up", gate_up), ("down", down)):
            if bank.dtype not in _WEIGHT_DTYPES or (weight_format is not None and bank.dtype != fmt.data_dtype):
                want = fmt.data_dtype.name if weight_format is not None else "float32 or bfloat16"
                raise TypeError(f"{op}: {name} bank {bank.id} must be {want}, got {bank.dtype.name}")
        if gs[1] != H:
            raise ValueError(f"{op}: gate_up bank {bank_desc(gate_up)} must have rows [2I, H] with H = {H} (columns "
                             f"of x)")
        if down.row_shape != (H, inter):
            raise ValueError(
                f"{op}: down bank {bank_desc(down)} must have rows [H, I] = {(H, inter)} to match gate_up bank "
                f"{bank_desc(gate_up)}"
            )
    else:
        if gate_up_scale is None or down_scale is None:
            raise ValueError(f"{op}: {fmt.name} expert weights need both scale banks (gate_up_scale and down_scale)")
        _check_stored(op, f"gate_up bank {bank_desc(gate_up)} (rows)", gs, gate_up.dtype, fmt, 2 * inter, H)
        _check_stored(op, f"down bank {bank_desc(down)} (rows)", down.row_shape, down.dtype, fmt, H, inter)
        for name, bank, want in (("gate_up_scale", gate_up_scale, _gate_up_scale_shape(fmt, H, inter)),
                                 ("down_scale", down_scale, fmt.scale_shape(H, inter))):
            bank = _expect_bank(op, f"{name} bank", bank)
            _check_scales(op, f"{name} bank {bank_desc(bank)} (rows)", bank.row_shape, bank.dtype, fmt, want)
            if bank.num_rows != gate_up.num_rows:
                raise ValueError(f"{op}: {name} bank {bank_desc(bank)} must hold {gate_up.num_rows} rows (one per "
                                 f"expert of gate_up bank {bank_desc(gate_up)})")
            scale_ids.append(bank.id)
    if down.num_rows != gate_up.num_rows:
        raise ValueError(f"{op}: gate_up {bank_desc(gate_up)} and down {bank_desc(down)} hold different expert counts")
    ids = [gate_up.id, down.id]
    if gate_up_bias is not None:
        ids.append(_check_bias_bank(op, "gate_up_bias", gate_up_bias, gate_up.num_rows, 2 * inter, "[2I]").id)
        ids.append(_check_bias_bank(op, "down_bias", down_bias, gate_up.num_rows, H, "[H]").id)
    return T, H, k, dict(banks=np.array(ids, np.int64), scale_banks=np.array(scale_ids, np.int64),
                         activation=activation, alpha=alpha, limit=limit, **_format_attrs(fmt))


def slot_experts(x, slot_ids, weights, gate_up_slots, down_slots, activation: str = "silu", *,
                 gate_up_bias_slots=None, down_bias_slots=None, gate_up_scale_slots=None, down_scale_slots=None,
                 weight_format: WeightFormat | None = None, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT):
    """Routed experts computed from the slot pool arrays, reading each routed expert's weights once (no gather copy):
    on the CPU backend the host_experts kernel pointed at the slot buffers; on a GPU the Pallas kernels of
    ft_jax.kernels.device_experts (float formats only).

    Args:
      x: f32 or bf16 [T, H].
      slot_ids: i32[T, k] slot per route; -1 (any negative) = skip.
      weights: f32[T, k] combine weights.
      gate_up_slots: f32 or bf16 [S, 2I, H] (gate rows then up rows per slot), or for a block format weight_format
        [S, *fmt.data_shape(2I, H)] in fmt.data_dtype.
      down_slots: f32 or bf16 [S, H, I], or [S, *fmt.data_shape(H, I)].
      activation: "silu", "gelu_tanh" or "swiglu_oai".
      gate_up_bias_slots, down_bias_slots: optional f32 or bf16 bias pools [S, 2I] and [S, H]; both or neither.
      gate_up_scale_slots, down_scale_slots: the block format's scale pools (both iff weight_format is a block
        format) [S, 2 * fmt.scale_rows(I), ceil(H / block_cols)] and [S, *fmt.scale_shape(H, I)] in
        fmt.scale_dtype.
      weight_format: a ft_jax.weight_formats.WeightFormat; None = the float format of the pool dtypes.
      alpha, limit: the clamped SwiGLU's parameters (see host_experts).

    Returns:
      f32[T, H].

    Raises:
      TypeError / ValueError at trace time for dtypes, shapes (pools against weight_format and each other, H or I
      not fitting the format's blocks), activation, one bias pool without the other, scale pools missing for a
      block format or given for a float one, or a non-finite alpha / limit; a slot id >= S fails at run time.
    """
    op = "slot_experts"
    activation = _expect_activation(op, activation)
    alpha, limit = _check_gate_params(op, alpha, limit)
    if (gate_up_bias_slots is None) != (down_bias_slots is None):
        raise ValueError(f"{op}: pass both bias pools (gate_up_bias_slots and down_bias_slots) or neither")
    T, H, k = _check_expert_inputs(op, x, slot_ids, weights, "slot_ids")
    gshape, gdtype = _shape_dtype(gate_up_slots, op, "gate_up_slots")
    fmt = _resolve_format(op, weight_format, "gate_up_slots", gdtype)
    scales = ()
    if not fmt.quantized:
        if gate_up_scale_slots is not None or down_scale_slots is not None:
            raise ValueError(f"{op}: scale pools given for the float format {fmt.name} (only block formats have "
                             f"scales)")
        gshape, _ = _expect(op, "gate_up_slots", gate_up_slots, 3, _WEIGHT_DTYPES, "[S, 2I, H]")
        if gshape[1] % 2 or gshape[2] != H:
            raise ValueError(f"{op}: gate_up_slots must be [S, 2I, H] with H = {H} (columns of x), got {gshape}")
        S, inter = gshape[0], gshape[1] // 2
        dshape, _ = _expect(op, "down_slots", down_slots, 3, _WEIGHT_DTYPES, "[S, H, I]")
        if dshape != (S, H, inter):
            raise ValueError(f"{op}: down_slots must be [S, H, I] = {(S, H, inter)}, got {dshape}")
    else:
        if gate_up_scale_slots is None or down_scale_slots is None:
            raise ValueError(f"{op}: {fmt.name} expert weights need both scale pools (gate_up_scale_slots and "
                             f"down_scale_slots)")
        if len(gshape) != 3 or gshape[1] % 2:
            raise ValueError(f"{op}: gate_up_slots must be [S, 2I, Hd] ({fmt.name} data), got {gshape}")
        S, inter = gshape[0], gshape[1] // 2
        _check_stored(op, f"gate_up_slots {list(gshape)} (per slot)", gshape[1:], gdtype, fmt, 2 * inter, H)
        dshape, ddtype = _shape_dtype(down_slots, op, "down_slots")
        if len(dshape) != 3 or dshape[0] != S:
            raise ValueError(f"{op}: down_slots must be [S, ...] with S = {S}, got {dshape}")
        _check_stored(op, f"down_slots {list(dshape)} (per slot)", dshape[1:], ddtype, fmt, H, inter)
        for name, pool, want in (("gate_up_scale_slots", gate_up_scale_slots, _gate_up_scale_shape(fmt, H, inter)),
                                 ("down_scale_slots", down_scale_slots, fmt.scale_shape(H, inter))):
            sshape, sdtype = _shape_dtype(pool, op, name)
            if len(sshape) != 3 or sshape[0] != S:
                raise ValueError(f"{op}: {name} must be [S, {want[0]}, {want[1]}] with S = {S}, got {sshape}")
            _check_scales(op, f"{name} {list(sshape)} (per slot)", sshape[1:], sdtype, fmt, want)
        scales = (gate_up_scale_slots, down_scale_slots)
    biases = ()
    if gate_up_bias_slots is not None:
        gb, _ = _expect(op, "gate_up_bias_slots", gate_up_bias_slots, 2, _WEIGHT_DTYPES, "[S, 2I]")
        db, _ = _expect(op, "down_bias_slots", down_bias_slots, 2, _WEIGHT_DTYPES, "[S, H]")
        if gb != (S, 2 * inter) or db != (S, H):
            raise ValueError(f"{op}: bias pools must be [S, 2I] = {(S, 2 * inter)} and [S, H] = {(S, H)}, got {gb} "
                             f"and {db}")
        biases = (gate_up_bias_slots, down_bias_slots)
    attrs = dict(activation=activation, alpha=alpha, limit=limit, **_format_attrs(fmt))

    def cpu(x, slot_ids, weights, gate_up_slots, down_slots, *extra):
        return jax.ffi.ffi_call("ft_jax_slot_experts", jax.ShapeDtypeStruct((T, H), jnp.float32))(
            x, slot_ids, weights, gate_up_slots, down_slots, *extra, **attrs)

    operands = (x, slot_ids, weights, gate_up_slots, down_slots, *biases, *scales)
    if not ft_jax.CUDA_ENABLED:
        return cpu(*operands)

    def cuda(x, slot_ids, weights, gate_up_slots, down_slots, *extra):
        from ft_jax.kernels import device_experts  # Pallas (~0.15 s to import): only where CUDA is present

        names = (("gate_up_bias_slots", "down_bias_slots")[:len(biases)]
                 + ("gate_up_scale_slots", "down_scale_slots")[:len(scales)])
        return device_experts.slot_experts(x, slot_ids, weights, gate_up_slots, down_slots, activation, alpha=alpha,
                                           limit=limit, weight_format=fmt, **dict(zip(names, extra)))

    return jax.lax.platform_dependent(*operands, cpu=cpu, cuda=cuda)


def bank_desc_shape(bank: HostBank) -> str:
    """'([16, 128, 64] bfloat16)': a bank's shape and dtype for error messages."""
    return f"([{', '.join(str(d) for d in bank.shape)}] {bank.dtype.name})"


def bank_desc(bank: HostBank) -> str:
    """'3 ([16, 128, 64] bfloat16)': a bank's id, shape and dtype for error messages."""
    return f"{bank.id} {bank_desc_shape(bank)}"
