// Dot-product micro-kernels shared by the expert kernel (expert_kernel.cc) and the dense GEMV (linear.cc).
//
// Dot<W, R, NT>(avx2, rows, xs, len, out): out[r * NT + n] = dot(rows[r][0:len], xs[n][0:len]) for R weight rows of
// type W (float, or uint16_t holding bfloat16 bits) and NT float32 activation vectors. Each weight element is loaded
// once and feeds NT multiply-adds, so a kernel that keeps NT tokens per pass reads its weights once per NT tokens.
// Accumulation is float32 in a fixed order (8 interleaved partial sums, then a fixed reduction tree), so results do
// not depend on threads or scheduling. The AVX2+FMA path (chosen at run time, see UseAvx2) and the portable path
// may differ in the last bits (fused vs separate multiply-add).
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

// out[r * NT + n] = dot(rows[r][0:len], xs[n][0:len]), eight interleaved partial sums per pair.
template <typename W, int R, int NT>
void DotGeneric(const W* const* rows, const float* const* xs, int64_t len, float* out) {
  float acc[R][NT][8] = {};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    for (int r = 0; r < R; ++r) {
      float w[8];
      for (int l = 0; l < 8; ++l) w[l] = ToF32(rows[r][i + l]);
      for (int n = 0; n < NT; ++n) {
        for (int l = 0; l < 8; ++l) acc[r][n][l] += w[l] * xs[n][i + l];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NT; ++n) {
      const float* a = acc[r][n];
      float s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
      for (int64_t j = i; j < len; ++j) s += ToF32(rows[r][j]) * xs[n][j];
      out[r * NT + n] = s;
    }
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

// Same contract as DotGeneric; AVX2 + FMA, weights converted to f32 in registers.
template <typename W, int R, int NT>
FT_JAX_AVX2 void DotAvx2(const W* const* rows, const float* const* xs, int64_t len, float* out) {
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NT; ++n) acc[r][n] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 xv[NT];
    for (int n = 0; n < NT; ++n) xv[n] = _mm256_loadu_ps(xs[n] + i);
    for (int r = 0; r < R; ++r) {
      __m256 w = Load8(rows[r] + i);
      for (int n = 0; n < NT; ++n) acc[r][n] = _mm256_fmadd_ps(w, xv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NT; ++n) {
      float s = HSum(acc[r][n]);
      for (int64_t j = i; j < len; ++j) s += ToF32(rows[r][j]) * xs[n][j];
      out[r * NT + n] = s;
    }
  }
}
#endif

template <typename W, int R, int NT>
inline void Dot(bool avx2, const W* const* rows, const float* const* xs, int64_t len, float* out) {
#if FT_JAX_HAVE_AVX2_PATH
  if (avx2) return DotAvx2<W, R, NT>(rows, xs, len, out);
#endif
  (void)avx2;
  DotGeneric<W, R, NT>(rows, xs, len, out);
}

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_DOT_KERNELS_H_
