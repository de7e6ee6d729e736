// Dot-product micro-kernels shared by the expert kernel (expert_kernel.cc) and the dense GEMV (linear.cc).
//
// DotRow<W>(avx2, row, x, len) = dot(row[0:len], x[0:len]) for one weight row of type W (float, or uint16_t holding
// bfloat16 bits) and a float32 activation vector; DotRowBf16 the same for bf16 weights and bf16 activations with
// AVX-512 BF16 (VDPBF16PS: pairs of bf16 products summed into float32); DotRows applies them to a block of rows and
// a batch of tokens. Weights are read one row at a time, front to back (why: docs/DESIGN.md sec. 9).
// Accumulation is float32 in a fixed order (8 independent partial sums, then a fixed reduction tree), so results do
// not depend on threads, scheduling or the other tokens of a call. The paths (chosen at run time, isa.h) may differ
// in the last bits (fused vs separate multiply-add, pairs).
#ifndef FT_JAX_XLA_FFI_DOT_KERNELS_H_
#define FT_JAX_XLA_FFI_DOT_KERNELS_H_

#include <cstdint>
#include <cstring>

#include "xla_ffi/isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define FT_JAX_HAVE_AVX2_PATH 1
#define FT_JAX_AVX2 __attribute__((target("avx2,fma")))
#define FT_JAX_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#else
#define FT_JAX_HAVE_AVX2_PATH 0
#endif

namespace ft_jax {


inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

constexpr int kAccumulators = 8;  // independent partial sums of 8 lanes: enough FMA chains in flight

// dot(row[0:len], x[0:len]): the row is read once, front to back, as one sequential stream (a hardware prefetcher
// follows it at full bandwidth, where several rows read side by side would each start a stream of their own every
// few KiB), into kAccumulators partial sums of 8 lanes, reduced by a fixed tree. The arithmetic of a (row, x) pair
// is the same whatever else the call computes, so a token's result never depends on the other tokens of a batch
// (or routed to the same expert).
template <typename W>
float DotRowGeneric(const W* row, const float* x, int64_t len) {
  constexpr int A = kAccumulators;
  float acc[A][8] = {};
  int64_t i = 0;
  for (; i + 8 * A <= len; i += 8 * A)
    for (int a = 0; a < A; ++a)
      for (int l = 0; l < 8; ++l) acc[a][l] += ToF32(row[i + 8 * a + l]) * x[i + 8 * a + l];
  for (; i + 8 <= len; i += 8)
    for (int l = 0; l < 8; ++l) acc[0][l] += ToF32(row[i + l]) * x[i + l];
  for (int width = A / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j)
      for (int l = 0; l < 8; ++l) acc[j][l] += acc[j + width][l];
  float s = ((acc[0][0] + acc[0][4]) + (acc[0][2] + acc[0][6])) + ((acc[0][1] + acc[0][5]) + (acc[0][3] + acc[0][7]));
  for (; i < len; ++i) s += ToF32(row[i]) * x[i];
  return s;
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
template <typename W>
FT_JAX_AVX2 float DotRowAvx2(const W* row, const float* x, int64_t len) {
  constexpr int A = kAccumulators;
  __m256 acc[A];
  for (int a = 0; a < A; ++a) acc[a] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 * A <= len; i += 8 * A)
    for (int a = 0; a < A; ++a) acc[a] = _mm256_fmadd_ps(Load8(row + i + 8 * a), _mm256_loadu_ps(x + i + 8 * a), acc[a]);
  for (; i + 8 <= len; i += 8) acc[0] = _mm256_fmadd_ps(Load8(row + i), _mm256_loadu_ps(x + i), acc[0]);
  for (int width = A / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] = _mm256_add_ps(acc[j], acc[j + width]);
  float s = HSum(acc[0]);
  for (; i < len; ++i) s += ToF32(row[i]) * x[i];
  return s;
}
#endif

#if FT_JAX_HAVE_AVX2_PATH
// Bytes ahead of its loads that a decode dot (one or two tokens, memory-bound) prefetches, a line for every 64 bytes
// it reads: bf16 rows here, q8_0 / q4_0 rows, q4_0x16 groups, fp8 and mxfp4 rows (quant_dot.cc). The hardware
// prefetchers alone left host_experts of one token on 2 threads of an Intel Xeon VM (AVX-512 BF16) at 22-24 GB/s for
// bf16, q4_0x16 21, fp8 14, mxfp4 7, with numpy reading 33; 2 KiB ahead into L1 gave bf16 29, q8_0 28, q4_0x16 28
// (docs/DESIGN.md sec. 20.26). A 4 KiB page ahead into L2, each prefetch between the loads (PrefetchAhead), is faster
// again (sec. 20.32). (An AMD EPYC VM measured no gain from a q4_0 row prefetch, sec. 20.23.) A prefetch does not
// fault: past a row's end it fetches the next row, read next.
constexpr int64_t kDecodePrefetchBytes = 4096;

// The decode dots' software prefetch: the line kDecodePrefetchBytes past p into L2 (PREFETCHT2; on CPUs that do not
// tell the levels apart, as a plain prefetch), kept in its place among the loads by an empty asm that clobbers memory
// (without it the compiler gathered a step's prefetches ahead of its loads). In a standalone C++ harness of
// host_experts' call pattern (q4_0x16, 2 threads, this VM): gathered 27-29 GB/s, interleaved 31.5-32.4 (2 KiB into
// L1: 31.5, 4 KiB into L2: 32.2); the decode of the bench model (generate, 3 processes each, alternated): q4_0 14.6
// against 16.3 ms per token, q8_0 26.0 against 28.6, bf16 57.4 against 60.5 (sec. 20.32).
inline __attribute__((always_inline)) void PrefetchAhead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kDecodePrefetchBytes, 0, 1);
  asm volatile("" ::: "memory");
}

// Accumulators per token of the AVX2 dot of a bf16 weight row with float32 tokens. Two chains of 8 lanes read 32
// bytes of weights per FMA latency, above one core's share of DRAM; with 2 per token, 4 tokens fit the 16 ymm
// registers beside the converted weights (docs/DESIGN.md sec. 20.18).
constexpr int kAvx2Bf16Accumulators = 2;
constexpr int kAvx2Bf16Tokens = 4;  // tokens that share one load and conversion of a row's weights

// out[t * out_stride] = dot(row[0:len], x[t * xs : t * xs + len]) for NT float32 tokens, bf16 weights converted to
// float32 once per 8 for all NT tokens (before, every token converted the row again: at 4 tokens per call the AVX2
// GEMV was compute-bound at ~8 GB/s). Each token has kAvx2Bf16Accumulators accumulators: accumulator a takes the
// 8-element chunks at i = 16 j + 8 a, a last chunk of 8 goes to accumulator 0, the two are added, reduced across lanes
// (HSum), and the last len % 8 products are added one by one. A token's result depends only on its own additions,
// so it is bit for bit the same whatever NT.
template <int NT>
FT_JAX_AVX2 inline void DotRowBf16Avx2Tokens(const uint16_t* row, const float* x, int64_t xs, int64_t len,
                                             float* out, int64_t out_stride) {
  constexpr int A = kAvx2Bf16Accumulators;
  __m256 acc[NT][A];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 2
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 * A <= len; i += 8 * A) {
    if constexpr (NT <= 2) {  // memory-bound: a line kDecodePrefetchBytes ahead every 64 bytes (PrefetchAhead)
      if ((i & 31) == 0) PrefetchAhead(row + i);
    }
    __m256 wv[A];
#pragma GCC unroll 2
    for (int a = 0; a < A; ++a) wv[a] = Load8(row + i + 8 * a);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 2
      for (int a = 0; a < A; ++a)
        acc[t][a] = _mm256_fmadd_ps(wv[a], _mm256_loadu_ps(x + t * xs + i + 8 * a), acc[t][a]);
  }
  for (; i + 8 <= len; i += 8) {
    const __m256 wv = Load8(row + i);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * xs + i), acc[t][0]);
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    float s = HSum(_mm256_add_ps(acc[t][0], acc[t][1]));
    for (int64_t k = i; k < len; ++k) s += ToF32(row[k]) * x[t * xs + k];
    out[t * out_stride] = s;
  }
}

// DotRows' AVX2 path for bf16 weights: each row read and converted once per kAvx2Bf16Tokens tokens.
FT_JAX_AVX2 inline void DotRowsBf16Avx2(const uint16_t* w, int64_t len, int64_t r0, int64_t r1, const float* x,
                                        int64_t T, float* out, int64_t out_stride) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* row = w + r * len;
    int64_t t = 0;
    for (; t + kAvx2Bf16Tokens <= T; t += kAvx2Bf16Tokens) {
      DotRowBf16Avx2Tokens<kAvx2Bf16Tokens>(row, x + t * len, len, len, out + t * out_stride + r, out_stride);
    }
    switch (T - t) {
      case 3: DotRowBf16Avx2Tokens<3>(row, x + t * len, len, len, out + t * out_stride + r, out_stride); break;
      case 2: DotRowBf16Avx2Tokens<2>(row, x + t * len, len, len, out + t * out_stride + r, out_stride); break;
      case 1: DotRowBf16Avx2Tokens<1>(row, x + t * len, len, len, out + t * out_stride + r, out_stride); break;
      default: break;
    }
  }
}
#endif

#if FT_JAX_HAVE_AVX2_PATH
// Accumulators of a bf16 x bf16 dot (VDPBF16PS, 16 float32 lanes each). Two chains keep a memory-bound row at the
// memory's speed (2 x 64 bytes per VDPBF16PS latency of ~6 cycles is several times what DRAM delivers to a core),
// and the register tiles of gemm_bf16.h then read a tile's rows in 2 passes instead of 8. Measured (docs/DESIGN.md
// sec. 20.15): host_experts on the bench shape, 1 and 3 tokens per expert, +14 % and +40 % over 8 accumulators.
constexpr int kBf16Accumulators = 2;

// out[t * out_stride] = dot(row[0:len], token t) for the NT bf16 tokens at xb + t * xs, bf16 weights: the row is
// loaded once per chunk for all NT tokens. Each token has kBf16Accumulators accumulators; accumulator a takes the
// 32-element chunks at i = 64 j + 32 a, a last chunk of 32 goes to accumulator 0, the two are added, reduced across
// lanes, and the last len % 32 products are added one by one. A token's result depends only on its own additions, so
// it is bit for bit the same whatever NT (and the register tiles of gemm_bf16.h follow the same order).
template <int NT>
FT_JAX_AVX512BF16 inline void DotRowBf16Tokens(const uint16_t* row, const uint16_t* xb, int64_t xs, int64_t len,
                                               float* out, int64_t out_stride) {
  constexpr int A = kBf16Accumulators;
  __m512 acc[NT][A];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < A; ++a) acc[t][a] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 * A <= len; i += 32 * A) {
    __m512i wv[A];
    for (int a = 0; a < A; ++a) {
      if constexpr (NT <= 2) PrefetchAhead(row + i + 32 * a);  // memory-bound: each line kDecodePrefetchBytes ahead
      wv[a] = _mm512_loadu_si512(row + i + 32 * a);
    }
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t)
#pragma GCC unroll 4
      for (int a = 0; a < A; ++a)
        acc[t][a] = _mm512_dpbf16_ps(acc[t][a], (__m512bh)wv[a],
                                     (__m512bh)_mm512_loadu_si512(xb + t * xs + i + 32 * a));
  }
  for (; i + 32 <= len; i += 32) {
    const __m512i wv = _mm512_loadu_si512(row + i);
    for (int t = 0; t < NT; ++t)
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], (__m512bh)wv, (__m512bh)_mm512_loadu_si512(xb + t * xs + i));
  }
  for (int t = 0; t < NT; ++t) {
    for (int width = A / 2; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) acc[t][j] = _mm512_add_ps(acc[t][j], acc[t][j + width]);
    float s = _mm512_reduce_add_ps(acc[t][0]);
    for (int64_t k = i; k < len; ++k) s += ToF32(row[k]) * ToF32(xb[t * xs + k]);
    out[t * out_stride] = s;
  }
}

// dot(row[0:len], x[0:len]) for bf16 weights and bf16 activations (DotRowBf16Tokens of one token).
FT_JAX_AVX512BF16 inline float DotRowBf16(const uint16_t* row, const uint16_t* x, int64_t len) {
  float s;
  DotRowBf16Tokens<1>(row, x, 0, len, &s, 0);
  return s;
}

#endif

template <typename W>
inline float DotRow(bool avx2, const W* row, const float* x, int64_t len) {
#if FT_JAX_HAVE_AVX2_PATH
  if (avx2) return DotRowAvx2<W>(row, x, len);
#endif
  (void)avx2;
  return DotRowGeneric<W>(row, x, len);
}

// out[t * out_stride + r] = dot(w[r], x[t]) for rows r in [r0, r1) of w ([rows, len], row r at w + r * len) and
// tokens t < T (x [T, len] float32; xb: the same values as bf16 bits, token t at xb + t * xb_stride, or nullptr):
// row by row; the first token reads a row from memory, the others find it in cache. bf16 weights with xb use
// DotRowBf16Tokens where the CPU has it (each row read once for two tokens).
template <typename W>
inline void DotRows(Isa isa, const W* w, int64_t len, int64_t r0, int64_t r1, const float* x, const uint16_t* xb,
                    int64_t xb_stride, int64_t T, float* out, int64_t out_stride) {
#if FT_JAX_HAVE_AVX2_PATH
  if constexpr (sizeof(W) == 2) {
    if (isa == Isa::kAvx512Bf16 && xb != nullptr) {
      // each row once for two tokens (more tokens take the register tiles of gemm_bf16.h)
      for (int64_t r = r0; r < r1; ++r) {
        int64_t t = 0;
        for (; t + 2 <= T; t += 2)
          DotRowBf16Tokens<2>(w + r * len, xb + t * xb_stride, xb_stride, len, out + t * out_stride + r, out_stride);
        if (t < T) out[t * out_stride + r] = DotRowBf16(w + r * len, xb + t * xb_stride, len);
      }
      return;
    }
  }
#endif
  const bool avx2 = isa != Isa::kGeneric;
#if FT_JAX_HAVE_AVX2_PATH
  if constexpr (sizeof(W) == 2) {
    if (avx2) return DotRowsBf16Avx2(w, len, r0, r1, x, T, out, out_stride);
  }
#endif
  for (int64_t r = r0; r < r1; ++r) {
    const W* row = w + r * len;
    for (int64_t t = 0; t < T; ++t) out[t * out_stride + r] = DotRow<W>(avx2, row, x + t * len, len);
  }
}

// float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN), as a bf16 torch tensor stores a result.
// Written as a select, not a branch, so loops over it vectorize (rope.cc).
inline uint16_t ToBf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(((bits & 0x7fffffffu) > 0x7f800000u ? bits | 0x00400000u : rounded) >> 16);
}

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_DOT_KERNELS_H_
