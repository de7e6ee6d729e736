// XLA FFI handlers exported as C symbols (XLA_FFI_DEFINE_HANDLER_SYMBOL). Wrap one with jax.ffi.pycapsule (from a
// ctypes-loaded shared library) or take the capsules from the nanobind module ft_jax._ffi, then register it with
// jax.ffi.register_ffi_target(name, capsule, platform="cpu").
//
//   FtJaxSlotFill     operands: slots [S, *row] (aliased to the result), flat_ids i32[N], slot_ids i32[N]
//                     attrs: bank (i64) -> slots [S, *row]
//   FtJaxHostExperts  operands: x f32|bf16 [T, H], flat_ids i32[T, k], weights f32[T, k]
//                     attrs: gate_up_bank (i64), down_bank (i64), activation (str) -> y f32[T, H]
//   FtJaxSlotExperts  operands: x f32|bf16 [T, H], slot_ids i32[T, k], weights f32[T, k],
//                     gate_up_slots [S, 2I, H], down_slots [S, H, I]; attrs: activation (str) -> y f32[T, H]
#ifndef FT_JAX_XLA_FFI_FFI_HANDLERS_H_
#define FT_JAX_XLA_FFI_FFI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

#pragma GCC visibility push(default)
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxSlotFill);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxHostExperts);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtJaxSlotExperts);
#pragma GCC visibility pop

#endif  // FT_JAX_XLA_FFI_FFI_HANDLERS_H_
