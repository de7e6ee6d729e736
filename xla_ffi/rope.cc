// rope: rotary position embedding (RoPE; Su et al. 2021, RoFormer) of bf16 query or key heads in the rotate-half
// layout, with the roundings of transformers' bf16 apply_rotary_pos_emb (layers.apply_rope computes the same):
//   c = bf16(cos), s = bf16(sin), rot(x) = (-x2, x1) for x = (x1, x2) the two halves of a head,
//   out = bf16(bf16(x * c) + bf16(rot(x) * s))   (each product and the sum in float32, then rounded)
// operands: x bf16 [B, T, H, D] (D even); cos, sin f32 [B, T, D] (one row per token, shared by its H heads)
// result:   bf16 [B, T, H, D]
// Why a handler: XLA:CPU runs the same formula as a loop fusion that it does not vectorize (the halves' reverse in
// its index arithmetic): 11 us per layer for the 16 query heads of 128 of the bench model, 5 ns a value; this loop
// takes about 1.5-2 us (docs/DESIGN.md sec. 20.33). It runs under XLA:CPU's flush-to-zero mode, as XLA's form does:
// subnormal inputs and products are zeros.
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/isa.h"

namespace ffi = xla::ffi;

namespace ft_jax {

using Bf16Heads = ffi::Buffer<ffi::DataType::BF16, 4>;
using RopeTable = ffi::Buffer<ffi::DataType::F32, 3>;

namespace {

// A float32 value rounded to bfloat16 (dot_kernels.h ToBf16), as a float32.
inline float RoundBf16(float v) { return ToF32(ToBf16(v)); }

// The heads of B * T tokens: x, y [BT, H, D] as bf16 bits, cos, sin [BT, D].
inline __attribute__((always_inline)) void RopeHeads(const uint16_t* x, const float* cos, const float* sin,
                                                     int64_t BT, int64_t H, int64_t D, uint16_t* y) {
  const int64_t half = D / 2;
  std::vector<float> c(D), s(D);
  for (int64_t bt = 0; bt < BT; ++bt) {
    for (int64_t d = 0; d < D; ++d) {
      c[d] = RoundBf16(cos[bt * D + d]);
      s[d] = RoundBf16(sin[bt * D + d]);
    }
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* xh = x + (bt * H + h) * D;
      uint16_t* yh = y + (bt * H + h) * D;
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = ToF32(xh[d]), x2 = ToF32(xh[half + d]);
        yh[d] = ToBf16(RoundBf16(x1 * c[d]) + RoundBf16(-x2 * s[d]));
        yh[half + d] = ToBf16(RoundBf16(x2 * c[half + d]) + RoundBf16(x1 * s[half + d]));
      }
    }
  }
}

void RopeGeneric(const uint16_t* x, const float* cos, const float* sin, int64_t BT, int64_t H, int64_t D,
                 uint16_t* y) {
  RopeHeads(x, cos, sin, BT, H, D, y);
}

#if FT_JAX_HAVE_AVX2_PATH
// The same loop in 8 lanes (no FMA can form: every product is rounded before the sum).
FT_JAX_AVX2 void RopeAvx2(const uint16_t* x, const float* cos, const float* sin, int64_t BT, int64_t H, int64_t D,
                          uint16_t* y) {
  RopeHeads(x, cos, sin, BT, H, D, y);
}
#endif

ffi::Error RopeImpl(Bf16Heads x, RopeTable cos, RopeTable sin, ffi::Result<Bf16Heads> out) {
  const auto dims = x.dimensions();
  const int64_t B = dims[0], T = dims[1], H = dims[2], D = dims[3];
  const auto cdims = cos.dimensions(), sdims = sin.dimensions();
  if (D % 2 != 0 || cdims[0] != B || cdims[1] != T || cdims[2] != D || sdims[0] != B || sdims[1] != T ||
      sdims[2] != D) {
    return ffi::Error::InvalidArgument("rope: x [" + std::to_string(B) + ", " + std::to_string(T) + ", " +
                                       std::to_string(H) + ", " + std::to_string(D) +
                                       "] needs an even D and cos, sin [B, T, D]");
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.untyped_data());
  uint16_t* ys = reinterpret_cast<uint16_t*>(out->untyped_data());
#if FT_JAX_HAVE_AVX2_PATH
  if (KernelIsaLevel() != Isa::kGeneric) {
    RopeAvx2(xs, cos.typed_data(), sin.typed_data(), B * T, H, D, ys);
    return ffi::Error::Success();
  }
#endif
  RopeGeneric(xs, cos.typed_data(), sin.typed_data(), B * T, H, D, ys);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxRope, ft_jax::RopeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ft_jax::Bf16Heads>()
                                  .Arg<ft_jax::RopeTable>()
                                  .Arg<ft_jax::RopeTable>()
                                  .Ret<ft_jax::Bf16Heads>());
