// greedy_pick: the decode step's greedy token of each row of logits, with the check that the row is finite.
// operands: logits f32[B, V]
// result:   ids s32[B]: the first index of the row's maximum, or -1 for a row holding a NaN or an infinity
// Why a handler: the same pick in XLA's ops (a maximum, the lowest index holding it, an is-finite reduction over the
// row) runs as XLA:CPU's tree of reduce-window loops, one element at a time, about 10 ops and 70 us of a decode step
// over a 32000-entry vocabulary; here one SSE2 pass finds the maximum and checks the row, and one stops at the first
// index holding the maximum: 5.7 us (docs/DESIGN.md sec. 20.33).
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/ffi_handlers.h"

namespace ffi = xla::ffi;

namespace ft_jax {

using Logits = ffi::Buffer<ffi::DataType::F32, 2>;
using TokenIdsBuffer = ffi::Buffer<ffi::DataType::S32, 1>;
using TokenIds = ffi::Result<TokenIdsBuffer>;

namespace {

// The first index of the maximum of x[0 .. n), or -1 if an element is a NaN or an infinity (exponent bits all
// ones). Two passes: the maximum and the non-finite test, then the first index equal to the maximum (== treats -0.0
// and 0.0 alike, as numpy's argmax). x86-64: SSE2 (every x86-64 CPU), 8 values per step; elsewhere plain C++.
int32_t GreedyPickRow(const float* x, int64_t n) {
  int64_t i = 0;
  float m = x[0];
  bool non_finite = false;
#if defined(__SSE2__)
  const __m128i exp_mask = _mm_set1_epi32(0x7f800000);
  __m128 m0 = _mm_set1_ps(m), m1 = m0;
  __m128i bad = _mm_setzero_si128();
  for (; i + 8 <= n; i += 8) {
    const __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4);
    m0 = _mm_max_ps(a, m0);  // a > m0 ? a : m0, lane by lane
    m1 = _mm_max_ps(b, m1);
    bad = _mm_or_si128(bad, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(a), exp_mask), exp_mask));
    bad = _mm_or_si128(bad, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(b), exp_mask), exp_mask));
  }
  non_finite = _mm_movemask_epi8(bad) != 0;
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(m0, m1));
  for (float v : lanes) m = v > m ? v : m;
#endif
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    non_finite |= (bits & 0x7f800000u) == 0x7f800000u;
    m = x[i] > m ? x[i] : m;
  }
  if (non_finite) return -1;
  i = 0;
#if defined(__SSE2__)
  const __m128 mv = _mm_set1_ps(m);
  for (; i + 4 <= n; i += 4) {
    const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), mv));
    if (hit) return static_cast<int32_t>(i + __builtin_ctz(hit));
  }
#endif
  for (; i < n; ++i) {
    if (x[i] == m) return static_cast<int32_t>(i);
  }
  return -1;  // not reached: the maximum of finite values is one of them
}

ffi::Error GreedyPickImpl(Logits logits, TokenIds ids) {
  const auto dims = logits.dimensions();
  const int64_t B = dims[0], V = dims[1];
  if (V < 1 || V > INT32_MAX || ids->dimensions()[0] != B) {
    return ffi::Error::InvalidArgument("greedy_pick: logits [" + std::to_string(B) + ", " + std::to_string(V) +
                                       "] need 1 <= V <= 2^31 - 1 and ids [B]");
  }
  const float* x = logits.typed_data();
  int32_t* out = ids->typed_data();
  for (int64_t b = 0; b < B; ++b) out[b] = GreedyPickRow(x + b * V, V);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxGreedyPick, ft_jax::GreedyPickImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ft_jax::Logits>()
                                  .Ret<ft_jax::TokenIdsBuffer>());
