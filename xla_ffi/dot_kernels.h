// Dot-product micro-kernels shared by the expert kernel (expert_kernel.cc) and the dense GEMV (linear.cc).
//
// DotRow<W, NT>(avx2, row, xs, len, out): out[n] = dot(row[0:len], xs[n][0:len]) for one weight row of type W (float,
// or uint16_t holding bfloat16 bits) and NT float32 activation vectors; DotRows applies it to a block of rows and a
// batch of tokens. Weights are read one row at a time, front to back: on the 2-core dev VM (AMD EPYC, 4 KiB pages)
// a bf16 matrix-vector product reached 23.6 GB/s that way against 15.4 GB/s reading 4 rows side by side (25.4 GB/s
// for a plain read of the same bytes). Accumulation is float32 in a fixed order (8 independent partial sums of 8
// lanes, then a fixed reduction tree), so results do not depend on threads or scheduling. The AVX2+FMA path (chosen
// at run time, see UseAvx2) and the portable path may differ in the last bits (fused vs separate multiply-add).
#ifndef FT_JAX_XLA_FFI_DOT_KERNELS_H_
#define FT_JAX_XLA_FFI_DOT_KERNELS_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define FT_JAX_HAVE_AVX2_PATH 1
#define FT_JAX_AVX2 __attribute__((target("avx2,fma")))
#else
#define FT_JAX_HAVE_AVX2_PATH 0
#endif

namespace ft_jax {

// True when the AVX2+FMA loops run: the CPU supports them and FT_JAX_KERNEL=generic is not set.
bool UseAvx2();

inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Vector accumulators per row pass: 8 / NT per activation, so every pass keeps 8 independent FMA chains in flight.
template <int NT>
constexpr int kAccumulators = 8 / NT;

// Tree sum of a[0..n) (n a power of two), the same order in every path.
template <typename V, typename Add>
inline V TreeSum(V* a, int n, Add add) {
  for (int width = n / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) a[j] = add(a[j], a[j + width]);
  return a[0];
}

// out[n] = dot(row[0:len], xs[n][0:len]) for n < NT (1, 2 or 4): the row is read once, front to back, as one
// sequential stream (a hardware prefetcher follows it at full bandwidth, where several rows read side by side
// would each start a stream of their own every few KiB), into kAccumulators<NT> partial sums of 8 lanes per
// activation.
template <typename W, int NT>
void DotRowGeneric(const W* row, const float* const* xs, int64_t len, float* out) {
  constexpr int A = kAccumulators<NT>;
  float acc[NT][A][8] = {};
  int64_t i = 0;
  for (; i + 8 * A <= len; i += 8 * A) {
    for (int a = 0; a < A; ++a) {
      float w[8];
      for (int l = 0; l < 8; ++l) w[l] = ToF32(row[i + 8 * a + l]);
      for (int n = 0; n < NT; ++n)
        for (int l = 0; l < 8; ++l) acc[n][a][l] += w[l] * xs[n][i + 8 * a + l];
    }
  }
  for (; i + 8 <= len; i += 8) {
    float w[8];
    for (int l = 0; l < 8; ++l) w[l] = ToF32(row[i + l]);
    for (int n = 0; n < NT; ++n)
      for (int l = 0; l < 8; ++l) acc[n][0][l] += w[l] * xs[n][i + l];
  }
  for (int n = 0; n < NT; ++n) {
    float lanes[8];
    for (int l = 0; l < 8; ++l) {
      float part[A];
      for (int a = 0; a < A; ++a) part[a] = acc[n][a][l];
      lanes[l] = TreeSum(part, A, [](float p, float q) { return p + q; });
    }
    float s = TreeSum(lanes, 8, [](float p, float q) { return p + q; });
    for (int64_t j = i; j < len; ++j) s += ToF32(row[j]) * xs[n][j];
    out[n] = s;
  }
}

#if FT_JAX_HAVE_AVX2_PATH
FT_JAX_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
FT_JAX_AVX2 inline __m256 Load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
FT_JAX_AVX2 inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes l + l+4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Same contract as DotRowGeneric; AVX2 + FMA, weights converted to f32 in registers.
template <typename W, int NT>
FT_JAX_AVX2 void DotRowAvx2(const W* row, const float* const* xs, int64_t len, float* out) {
  constexpr int A = kAccumulators<NT>;
  __m256 acc[NT][A];
  for (int n = 0; n < NT; ++n)
    for (int a = 0; a < A; ++a) acc[n][a] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 * A <= len; i += 8 * A) {
    for (int a = 0; a < A; ++a) {
      const __m256 w = Load8(row + i + 8 * a);
      for (int n = 0; n < NT; ++n) acc[n][a] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[n] + i + 8 * a), acc[n][a]);
    }
  }
  for (; i + 8 <= len; i += 8) {
    const __m256 w = Load8(row + i);
    for (int n = 0; n < NT; ++n) acc[n][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xs[n] + i), acc[n][0]);
  }
  for (int n = 0; n < NT; ++n) {
    for (int width = A / 2; width >= 1; width /= 2)  // the tree of TreeSum
      for (int j = 0; j < width; ++j) acc[n][j] = _mm256_add_ps(acc[n][j], acc[n][j + width]);
    float s = HSum(acc[n][0]);
    for (int64_t j = i; j < len; ++j) s += ToF32(row[j]) * xs[n][j];
    out[n] = s;
  }
}
#endif

template <typename W, int NT>
inline void DotRow(bool avx2, const W* row, const float* const* xs, int64_t len, float* out) {
#if FT_JAX_HAVE_AVX2_PATH
  if (avx2) return DotRowAvx2<W, NT>(row, xs, len, out);
#endif
  (void)avx2;
  DotRowGeneric<W, NT>(row, xs, len, out);
}

// out[t * out_stride + r] = dot(w[r], x[t]) for rows r in [r0, r1) of w ([rows, len], row r at w + r * len) and
// tokens t < T (x [T, len]): row by row, tokens 4 (then 2, 1) per pass, so a row is read from memory once and the
// later passes find it in L1.
template <typename W>
inline void DotRows(bool avx2, const W* w, int64_t len, int64_t r0, int64_t r1, const float* x, int64_t T, float* out,
                    int64_t out_stride) {
  float dots[4];
  for (int64_t r = r0; r < r1; ++r) {
    const W* row = w + r * len;
    for (int64_t t = 0; t < T;) {
      const float* xs[4] = {x + t * len, nullptr, nullptr, nullptr};
      const int64_t left = T - t;
      if (left >= 4) {
        for (int q = 1; q < 4; ++q) xs[q] = x + (t + q) * len;
        DotRow<W, 4>(avx2, row, xs, len, dots);
      } else if (left >= 2) {
        xs[1] = x + (t + 1) * len;
        DotRow<W, 2>(avx2, row, xs, len, dots);
      } else {
        DotRow<W, 1>(avx2, row, xs, len, dots);
      }
      const int64_t nt = left >= 4 ? 4 : left >= 2 ? 2 : 1;
      for (int64_t q = 0; q < nt; ++q) out[(t + q) * out_stride + r] = dots[q];
      t += nt;
    }
  }
}

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_DOT_KERNELS_H_
