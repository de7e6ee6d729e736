// The CPU XLA FFI handlers, exported as C symbols. ft_jax takes them as PyCapsules from the nanobind module
// (module.cc); a ctypes user of the Bazel-built library wraps them with jax.ffi.pycapsule. Handlers with an
// instantiate stage keep their banks in a BoundBanks state (bank_state.h): register that type first.
//
//   FtJaxSlotFill         slot_fill.cc     flat_ids i32[N], slot_ids i32[N], pools ... (aliased to the results)
//   (+ ...Instantiate)                     attrs: banks (i64[P]) -> pools [, errors i32[]]
//   FtJaxHostExperts      host_experts.cc  x f32|bf16 [T, H], flat_ids i32[T, k], weights f32[T, k]
//   (+ ...Instantiate)                     attrs: banks (i64[2] or i64[4]), scale_banks (i64[0] or i64[2]),
//                                          weight_format (str), block_rows, block_cols (i64), activation (str),
//                                          alpha, limit (f32) -> y f32[T, H]
//   FtJaxSlotExperts      slot_experts.cc  x, slot_ids i32[T, k], weights, gate_up_slots [S, 2I, H], down_slots
//                                          [S, H, I] (+ bias pools [S, 2I], [S, H]) (+ scale pools of a block
//                                          format); attrs weight_format .. limit as above -> y f32[T, H]
//   FtJaxLinear           linear.cc        x f32|bf16 [N, K], w [L, O, K] or [O, K] (as stored), layer i32[]
//                                          (+ scales of a block format); attrs weight_format, block_rows,
//                                          block_cols -> y f32[N, O]
//   FtJaxBankLinear       linear.cc        x f32|bf16 [N, K], layer i32[]; attr bank (i64: rows [O, K] f32|bf16)
//   (+ ...Instantiate)                     -> y f32[N, O]
//   FtJaxBankTake         embedding.cc     ids i32[N]; attr bank (i64: one row [V, H]) -> y [N, H] of its dtype
//   (+ ...Instantiate)
//   FtJaxDecodeAttention  decode_attention.cc  q f32|bf16 [B, NH, D], k/v caches [n, Bc, S, KVH, D], layer i32[],
//                                          rows i32[B], positions i32[B], window i32[] (+ sinks f32[NH]);
//                                          attr scale (f32) -> out [B, NH, D] of q's dtype
//   FtJaxGreedyPick       greedy_pick.cc   logits f32[B, V] -> ids i32[B] (first index of the maximum; -1: a row
//                                          holding a NaN or an infinity)
//   FtJaxRope             rope.cc          x bf16 [B, T, H, D], cos f32 [B, T, D], sin f32 [B, T, D] -> bf16
//                                          [B, T, H, D] (RoPE, rotate-half layout, transformers' bf16 roundings)
// Weight formats and layouts: quant_dot.h.
#ifndef FT_JAX_XLA_FFI_FFI_HANDLERS_H_
#define FT_JAX_XLA_FFI_FFI_HANDLERS_H_

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/export.h"

FT_JAX_DECLARE_HANDLER(FtJaxSlotFill);
FT_JAX_DECLARE_HANDLER(FtJaxSlotFillInstantiate);
FT_JAX_DECLARE_HANDLER(FtJaxHostExperts);
FT_JAX_DECLARE_HANDLER(FtJaxHostExpertsInstantiate);
FT_JAX_DECLARE_HANDLER(FtJaxSlotExperts);
FT_JAX_DECLARE_HANDLER(FtJaxLinear);
FT_JAX_DECLARE_HANDLER(FtJaxBankLinear);
FT_JAX_DECLARE_HANDLER(FtJaxBankLinearInstantiate);
FT_JAX_DECLARE_HANDLER(FtJaxBankTake);
FT_JAX_DECLARE_HANDLER(FtJaxBankTakeInstantiate);
FT_JAX_DECLARE_HANDLER(FtJaxDecodeAttention);
FT_JAX_DECLARE_HANDLER(FtJaxGreedyPick);
FT_JAX_DECLARE_HANDLER(FtJaxRope);

#endif  // FT_JAX_XLA_FFI_FFI_HANDLERS_H_
