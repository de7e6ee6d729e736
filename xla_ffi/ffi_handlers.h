// XLA FFI handlers exported as C symbols (XLA_FFI_DEFINE_HANDLER_SYMBOL). Wrap one with jax.ffi.pycapsule (from a
// ctypes-loaded shared library) or take the capsules from the nanobind module ft_jax._ffi, then register it with
// jax.ffi.register_ffi_target(name, capsule or {"instantiate": ..., "execute": ...}, platform="cpu"). The handlers
// with an instantiate stage keep their host banks in a BoundBanks state: register its type first with
// jax.ffi.register_ffi_type("ft_jax_bound_banks", {"type_id": ..., "type_info": ...}) (bank_state.h).
//
//   FtJaxSlotFill         operands: flat_ids i32[N], slot_ids i32[N], pools [S, *row_p] ... (aliased to the results)
//   (+ ...Instantiate)    attrs: banks (i64[P]) -> pools
//   FtJaxHostExperts      operands: x f32|bf16 [T, H], flat_ids i32[T, k], weights f32[T, k]
//   (+ ...Instantiate)    attrs: banks (i64[2]: gate_up, down, or i64[4]: + gate_up_bias, down_bias),
//                         activation (str), alpha, limit (f32) -> y f32[T, H]
//   FtJaxSlotExperts      operands: x f32|bf16 [T, H], slot_ids i32[T, k], weights f32[T, k],
//                         gate_up_slots [S, 2I, H], down_slots [S, H, I] (+ optional gate_up bias [S, 2I], down
//                         bias [S, H]); attrs: activation (str), alpha, limit (f32) -> y f32[T, H]
//   FtJaxLinear           operands: x f32|bf16 [N, K], w f32|bf16 [L, O, K] or [O, K], layer i32[] -> y f32[N, O]
#ifndef FT_JAX_XLA_FFI_FFI_HANDLERS_H_
#define FT_JAX_XLA_FFI_FFI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

#pragma GCC visibility push(default)
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxSlotFill);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxSlotFillInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxHostExperts);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxHostExpertsInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxSlotExperts);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxLinear);
#pragma GCC visibility pop

#endif  // FT_JAX_XLA_FFI_FFI_HANDLERS_H_
