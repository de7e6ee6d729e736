"""JAX wrappers of the ft_jax XLA FFI handlers (registered for the CPU platform by ``import ft_jax``).

Per-step data (ids, weights, activations, slot arrays) are operands; host banks are compile-time attributes
(their integer ids), so one compiled step replays for any routing. Every wrapper checks shapes, dtypes and bank
liveness at trace time and raises TypeError / ValueError naming the problem; the C++ handlers repeat the checks
and also reject out-of-range ids, which only exist at run time: the call then raises
jax.errors.JaxRuntimeError (or ValueError when jit's C++ fast path dispatched it) with a message naming the id and
the bank, nothing is written, and the process carries on.

Expert math (host_experts and slot_experts), for every token t:
    y[t] = sum_j weights[t, j] * down_e @ (act(gate_e @ x[t]) * (up_e @ x[t])),  e = ids[t, j] >= 0
with gate_e = gate_up_e[:I], up_e = gate_up_e[I:], float32 accumulation; act = silu (SwiGLU) or gelu_tanh
(0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ft_jax  # noqa: F401  (registers the FFI targets)
from ft_jax.offload.host_bank import HostBank

ACTIVATIONS = ("silu", "gelu_tanh")
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


def slot_fill(slots, flat_ids, slot_ids, bank: HostBank):
    """Copies host bank rows into slots: result[slot_ids[n]] = bank[flat_ids[n]] for every n with both ids >= 0.

    Args:
      slots: [S, *bank.row_shape], dtype bank.dtype. Aliased to the result (input_output_aliases): call under
        jax.jit with the slots argument donated (donate_argnums) and XLA updates the buffer in place, copying only
        the N rows.
      flat_ids: i32[N] bank rows (flat expert ids); < 0 = padding.
      slot_ids: i32[N] destination slots; < 0 = padding.
      bank: a live HostBank.

    Returns:
      [S, *row_shape] slots with the rows replaced (same dtype).

    Raises:
      TypeError / ValueError at trace time for wrong dtypes or shapes or a released bank. Out-of-range ids fail
      at run time (JAX runtime error naming the id and the bank); the slots are left untouched then.
    """
    op = "slot_fill"
    bank = _expect_bank(op, "bank", bank)
    shape, dtype = _shape_dtype(slots, op, "slots")
    if dtype != bank.dtype:
        raise TypeError(f"{op}: slots dtype {dtype.name} does not match bank {bank.id} dtype {bank.dtype.name}")
    if len(shape) < 1 or shape[1:] != bank.row_shape:
        raise ValueError(
            f"{op}: slots must be [S, *row_shape] with row_shape {bank.row_shape} of bank {bank.id} "
            f"({bank.row_bytes} bytes per row), got shape {shape}"
        )
    (n,), _ = _expect(op, "flat_ids", flat_ids, 1, (np.dtype(np.int32),), "[N]")
    (n2,), _ = _expect(op, "slot_ids", slot_ids, 1, (np.dtype(np.int32),), "[N]")
    if n != n2:
        raise ValueError(f"{op}: flat_ids has {n} entries but slot_ids has {n2}")
    call = jax.ffi.ffi_call(
        "ft_jax_slot_fill", jax.ShapeDtypeStruct(shape, dtype), input_output_aliases={0: 0}
    )
    return call(slots, flat_ids, slot_ids, bank=np.int64(bank.id))


def _check_expert_inputs(op: str, x, ids, weights, ids_name: str) -> tuple[int, int, int]:
    (T, H), _ = _expect(op, "x", x, 2, _WEIGHT_DTYPES, "[T, H]")
    (Ti, k), _ = _expect(op, ids_name, ids, 2, (np.dtype(np.int32),), "[T, k]")
    wshape, _ = _expect(op, "weights", weights, 2, (np.dtype(np.float32),), "[T, k]")
    if Ti != T or wshape != (T, k):
        raise ValueError(f"{op}: {ids_name} {(Ti, k)} and weights {wshape} must both be [T, k] with T = {T} (rows of x)")
    return T, H, k


def host_experts(x, flat_ids, weights, gate_up: HostBank, down: HostBank, activation: str = "silu"):
    """Routed experts computed on the CPU straight from the host banks (multi-threaded GEMV, f32 accumulation).

    Args:
      x: f32 or bf16 [T, H] token activations.
      flat_ids: i32[T, k] flat expert ids (bank rows); -1 (any negative) = skip the route.
      weights: f32[T, k] combine weights.
      gate_up: HostBank of rows [2I, H] (gate rows then up rows), float32 or bfloat16.
      down: HostBank of rows [H, I], float32 or bfloat16, same num_rows as gate_up.
      activation: "silu" (SwiGLU) or "gelu_tanh".

    Returns:
      f32[T, H]: sum over routes of weight * expert(x) (formula in the module docstring).

    Raises:
      TypeError / ValueError at trace time (dtypes, shapes, banks that do not match or were released, unknown
      activation); an out-of-range id fails at run time with an error naming it and the bank.
    """
    op = "host_experts"
    gate_up = _expect_bank(op, "gate_up bank", gate_up)
    down = _expect_bank(op, "down bank", down)
    activation = _expect_activation(op, activation)
    T, H, k = _check_expert_inputs(op, x, flat_ids, weights, "flat_ids")
    for name, bank in (("gate_up", gate_up), ("down", down)):
        if bank.dtype not in _WEIGHT_DTYPES:
            raise TypeError(f"{op}: {name} bank {bank.id} must be float32 or bfloat16, got {bank.dtype.name}")
    gs = gate_up.row_shape
    if len(gs) != 2 or gs[0] % 2 or gs[1] != H:
        raise ValueError(f"{op}: gate_up bank {bank_desc(gate_up)} must have rows [2I, H] with H = {H} (columns of x)")
    inter = gs[0] // 2
    if down.row_shape != (H, inter):
        raise ValueError(
            f"{op}: down bank {bank_desc(down)} must have rows [H, I] = {(H, inter)} to match gate_up bank "
            f"{bank_desc(gate_up)}"
        )
    if down.num_rows != gate_up.num_rows:
        raise ValueError(f"{op}: gate_up {bank_desc(gate_up)} and down {bank_desc(down)} hold different expert counts")
    call = jax.ffi.ffi_call("ft_jax_host_experts", jax.ShapeDtypeStruct((T, H), jnp.float32))
    return call(
        x, flat_ids, weights, gate_up_bank=np.int64(gate_up.id), down_bank=np.int64(down.id), activation=activation
    )


def slot_experts(x, slot_ids, weights, gate_up_slots, down_slots, activation: str = "silu"):
    """Routed experts computed from the slot pool arrays (on the CPU backend: the host_experts kernel pointed at
    the slot buffers, reading each routed expert's weights once, no gather copy).

    Args:
      x: f32 or bf16 [T, H].
      slot_ids: i32[T, k] slot per route; -1 (any negative) = skip.
      weights: f32[T, k] combine weights.
      gate_up_slots: f32 or bf16 [S, 2I, H] (gate rows then up rows per slot).
      down_slots: f32 or bf16 [S, H, I].
      activation: "silu" or "gelu_tanh".

    Returns:
      f32[T, H].

    Raises:
      TypeError / ValueError at trace time for dtypes, shapes or activation; a slot id >= S fails at run time.
    """
    op = "slot_experts"
    activation = _expect_activation(op, activation)
    T, H, k = _check_expert_inputs(op, x, slot_ids, weights, "slot_ids")
    gshape, _ = _expect(op, "gate_up_slots", gate_up_slots, 3, _WEIGHT_DTYPES, "[S, 2I, H]")
    if gshape[1] % 2 or gshape[2] != H:
        raise ValueError(f"{op}: gate_up_slots must be [S, 2I, H] with H = {H} (columns of x), got {gshape}")
    S, inter = gshape[0], gshape[1] // 2
    dshape, _ = _expect(op, "down_slots", down_slots, 3, _WEIGHT_DTYPES, "[S, H, I]")
    if dshape != (S, H, inter):
        raise ValueError(f"{op}: down_slots must be [S, H, I] = {(S, H, inter)}, got {dshape}")
    call = jax.ffi.ffi_call("ft_jax_slot_experts", jax.ShapeDtypeStruct((T, H), jnp.float32))
    return call(x, slot_ids, weights, gate_up_slots, down_slots, activation=activation)


def bank_desc_shape(bank: HostBank) -> str:
    """'([16, 128, 64] bfloat16)': a bank's shape and dtype for error messages."""
    return f"([{', '.join(str(d) for d in bank.shape)}] {bank.dtype.name})"


def bank_desc(bank: HostBank) -> str:
    """'3 ([16, 128, 64] bfloat16)': a bank's id, shape and dtype for error messages."""
    return f"{bank.id} {bank_desc_shape(bank)}"
