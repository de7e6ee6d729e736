#include "xla_ffi/quant_dot.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "xla_ffi/common.h"
#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/gemm_bf16.h"
#include "xla_ffi/host_bank.h"

#if FT_JAX_HAVE_AVX2_PATH
#define FT_JAX_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#define FT_JAX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define FT_JAX_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
// For lambdas inside FT_JAX_VNNI functions (a lambda does not inherit its function's target; inlined into it).
#define FT_JAX_VNNI_LAMBDA __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"), always_inline))
#endif

namespace ft_jax {

namespace {

constexpr int64_t kQBlock = 32;  // elements per block of q8_0, q4_0 and mxfp4

// IEEE half bits -> float32 (exact; subnormal halves are normal float32 values, so no denormal arithmetic).
float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float f = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Decode tables: float8_e4m3fn by byte (0x7f / 0xff are NaN; no infinities), E8M0 scales 2^(s - 127) (255 = NaN) and
// half of them (the AVX2 mxfp4 path multiplies doubled FP4 codes), FP4 E2M1 by code (OCP MX v1.0).
struct Tables {
  float e4m3[256];
  float e8m0[256];
  float e8m0_half[256];
  Tables() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) v = nan;
      e4m3[b] = (b & 0x80) ? -v : v;
      e8m0[b] = b == 255 ? nan : std::ldexp(1.0f, b - 127);
      e8m0_half[b] = b == 255 ? nan : std::ldexp(1.0f, b - 128);
    }
  }
};
const Tables& Tab() {
  static const Tables tables;
  return tables;
}
constexpr float kFp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

const uint8_t* RowData(const MatrixView& w, int64_t r) { return w.data + static_cast<size_t>(r) * w.row_bytes; }
const uint8_t* ScaleRow(const MatrixView& w, int64_t r) {
  return w.scales + static_cast<size_t>(r / w.block_rows) * w.scale_row_bytes;
}

// The portable decoder: the reference every vector path reproduces value for value.
void DequantGeneric(const MatrixView& w, int64_t r, float* out) {
  const Tables& tab = Tab();
  const uint8_t* row = RowData(w, r);
  const uint8_t* srow = ScaleRow(w, r);
  const int64_t nb = w.cols / kQBlock;
  switch (w.format) {
    case WFormat::kQ8_0: {
      const int8_t* q = reinterpret_cast<const int8_t*>(row);
      const uint16_t* d = reinterpret_cast<const uint16_t*>(srow);
      for (int64_t b = 0; b < nb; ++b) {
        const float s = HalfToFloat(d[b]);
        for (int j = 0; j < 32; ++j) out[32 * b + j] = s * static_cast<float>(q[32 * b + j]);
      }
      return;
    }
    case WFormat::kQ4_0: {
      const uint16_t* d = reinterpret_cast<const uint16_t*>(srow);
      for (int64_t b = 0; b < nb; ++b) {
        const float s = HalfToFloat(d[b]);
        const uint8_t* q = row + 16 * b;
        for (int j = 0; j < 16; ++j) {
          out[32 * b + j] = s * static_cast<float>((q[j] & 15) - 8);
          out[32 * b + j + 16] = s * static_cast<float>((q[j] >> 4) - 8);
        }
      }
      return;
    }
    case WFormat::kMxfp4: {
      for (int64_t b = 0; b < nb; ++b) {
        const float s = tab.e8m0[srow[b]];
        const uint8_t* q = row + 16 * b;
        for (int j = 0; j < 16; ++j) {
          out[32 * b + 2 * j] = kFp4[q[j] & 15] * s;
          out[32 * b + 2 * j + 1] = kFp4[q[j] >> 4] * s;
        }
      }
      return;
    }
    case WFormat::kFp8: {
      const float* sc = reinterpret_cast<const float*>(srow);
      for (int64_t c = 0; c < w.cols; ++c) out[c] = tab.e4m3[row[c]] * sc[c / w.block_cols];
      return;
    }
    default:
      return;
  }
}

#if FT_JAX_HAVE_AVX2_PATH
// 16 int8 values times d into out[0:16].
FT_JAX_AVX2_F16C inline void Store16I8(float* out, __m128i v, __m256 d) {
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), d));
}

// float8_e4m3fn bytes (as 16-bit words) -> the half with the same value times 2^-8 (sign to bit 15, exponent and
// mantissa one bit down; an e4m3 subnormal becomes a half subnormal, converted exactly by F16C); NaN codes -> NaN.
FT_JAX_AVX2_F16C inline __m128i E4m3ToHalfScaled(__m128i t) {
  const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(t, 8), 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(t, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F));
  return _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7E00)));
}

FT_JAX_AVX2_F16C void DequantAvx2(const MatrixView& w, int64_t r, float* out) {
  const Tables& tab = Tab();
  const uint8_t* row = RowData(w, r);
  const uint8_t* srow = ScaleRow(w, r);
  const int64_t nb = w.cols / kQBlock;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  switch (w.format) {
    case WFormat::kQ8_0: {
      const uint16_t* d = reinterpret_cast<const uint16_t*>(srow);
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 s = _mm256_set1_ps(HalfToFloat(d[b]));
        Store16I8(out + 32 * b, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * b)), s);
        Store16I8(out + 32 * b + 16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * b + 16)), s);
      }
      return;
    }
    case WFormat::kQ4_0: {
      const uint16_t* d = reinterpret_cast<const uint16_t*>(srow);
      const __m128i lut = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 s = _mm256_set1_ps(HalfToFloat(d[b]));
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
        Store16I8(out + 32 * b, _mm_shuffle_epi8(lut, _mm_and_si128(q, m4)), s);
        Store16I8(out + 32 * b + 16, _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), m4)), s);
      }
      return;
    }
    case WFormat::kMxfp4: {
      const __m128i lut2 = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);  // 2 * FP4
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 s = _mm256_set1_ps(tab.e8m0_half[srow[b]]);
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
        const __m128i lo = _mm_shuffle_epi8(lut2, _mm_and_si128(q, m4));                     // elements 2j
        const __m128i hi = _mm_shuffle_epi8(lut2, _mm_and_si128(_mm_srli_epi16(q, 4), m4));  // elements 2j + 1
        Store16I8(out + 32 * b, _mm_unpacklo_epi8(lo, hi), s);
        Store16I8(out + 32 * b + 16, _mm_unpackhi_epi8(lo, hi), s);
      }
      return;
    }
    case WFormat::kFp8: {
      const float* sc = reinterpret_cast<const float*>(srow);
      for (int64_t c0 = 0, j = 0; c0 < w.cols; c0 += w.block_cols, ++j) {  // j = c0 / block_cols
        const int64_t end = std::min(w.cols, c0 + w.block_cols);
        const float s = sc[j];
        const __m256 s256 = _mm256_set1_ps(s * 256.0f);
        int64_t c = c0;
        for (; c + 8 <= end; c += 8) {
          const __m128i t = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
          _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_cvtph_ps(E4m3ToHalfScaled(t)), s256));
        }
        for (; c < end; ++c) out[c] = tab.e4m3[row[c]] * s;
      }
      return;
    }
    default:
      return;
  }
}

// q8_0 / q4_0 with int8 activations at the AVX2 level (CPUs without AVX-512 VNNI, e.g. AMD Zen 2/3), as llama.cpp's
// AVX2 ggml_vec_dot_q8_0_q8_0 / q4_0_q8_0: each token's activations are quantized per block of 32 exactly as the VNNI
// path does (dx = max |x| / 127 in float32, q = x * (1 / dx) rounded to nearest even, saturated to int8; a NaN in a
// block makes dx NaN, so the dot is NaN, never a silent value), a block's integer dot is exact (VPMADDUBSW of |w| and
// sign(x, w): pair sums <= 2 * 128 * 127 < 2^15, then VPMADDWD), then scaled by dw * dx in float32 (4 accumulators of
// 8 lanes, block b into accumulator b % 4). q4_0 dots its signed codes q - 8. Error bound: as the VNNI path's.
FT_JAX_AVX2_F16C void QuantizeActsAvx2(const float* x, int64_t cols, int8_t* q, float* dx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the lane interleave of the packs
  for (int64_t b = 0; b < cols / kQBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : _mm_cvtss_f32(m) / 127.0f;
    dx[b] = d;
    const __m256 inv = _mm256_set1_ps(d == 0.0f ? 0.0f : 1.0f / d);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), _mm256_permutevar8x32_epi32(p, order));
  }
}

// Block b of a q8_0 / q4_0 row as 32 signed bytes in element order (q4_0: low nibbles 0..15, high 16..31, minus 8).
template <WFormat F>
FT_JAX_AVX2_F16C inline __m256i BlockCodesAvx2(const uint8_t* row, int64_t b) {
  if constexpr (F == WFormat::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
  } else {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m256i n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
    return _mm256_sub_epi8(n, _mm256_set1_epi8(8));
  }
}

// acc + sdx_b (w_b . q_b): block b of a row with one token's int8 activations q [nb * 32], sdx_b = dw_b dx_b.
template <WFormat F>
FT_JAX_AVX2_F16C inline __m256 Int8BlockFma(const uint8_t* row, const float* sdx, const int8_t* q, int64_t b,
                                            __m256 acc) {
  const __m256i w = BlockCodesAvx2<F>(row, b);
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  const __m256 block = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  return _mm256_fmadd_ps(block, _mm256_set1_ps(sdx[b]), acc);
}

// sum_b sdx_b (w_b . q_b) of one row with one token's int8 activations q [nb * 32], block b into accumulator b % 4
// (four named registers: an array indexed by b % 4 was kept on the stack, a store and a load per block).
template <WFormat F>
FT_JAX_AVX2_F16C float DotInt8Avx2(const uint8_t* row, const float* sdx, int64_t nb, const int8_t* q) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t b = 0;
  constexpr int64_t kStepBytes = F == WFormat::kQ8_0 ? 128 : 64;  // 4 blocks
  for (; b + 4 <= nb; b += 4) {
    PrefetchAhead(row + b / 4 * kStepBytes);
    a0 = Int8BlockFma<F>(row, sdx, q, b, a0);
    a1 = Int8BlockFma<F>(row, sdx, q, b + 1, a1);
    if constexpr (kStepBytes > 64) PrefetchAhead(row + b / 4 * kStepBytes + 64);
    a2 = Int8BlockFma<F>(row, sdx, q, b + 2, a2);
    a3 = Int8BlockFma<F>(row, sdx, q, b + 3, a3);
  }
  if (b < nb) a0 = Int8BlockFma<F>(row, sdx, q, b, a0);
  if (b + 1 < nb) a1 = Int8BlockFma<F>(row, sdx, q, b + 1, a1);
  if (b + 2 < nb) a2 = Int8BlockFma<F>(row, sdx, q, b + 2, a2);
  return HSum(_mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3)));
}

// qx: x quantized at this level (QuantizeActivations).
template <WFormat F>
FT_JAX_AVX2_F16C void DotRowsInt8Avx2(const MatrixView& w, int64_t r0, int64_t r1, int64_t T, float* out,
                                      int64_t out_stride, const QuantizedActs& qx) {
  const int64_t cols = w.cols, nb = cols / kQBlock;
  // row scales [nb], their products with a token's dx [nb]
  thread_local std::vector<float> storage;
  Scratch<float> scratch(storage, static_cast<size_t>(2 * nb));
  float* sw = scratch.data();
  float* sdx = sw + nb;
  const float* dx = qx.dx;
  const int8_t* q = qx.q;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* d = reinterpret_cast<const uint16_t*>(ScaleRow(w, r));
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
      _mm256_storeu_ps(sw + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b))));
    for (; b < nb; ++b) sw[b] = _cvtsh_ss(d[b]);
    for (int64_t t = 0; t < T; ++t) {
      const float* dxt = dx + t * nb;
      for (b = 0; b + 8 <= nb; b += 8)
        _mm256_storeu_ps(sdx + b, _mm256_mul_ps(_mm256_loadu_ps(sw + b), _mm256_loadu_ps(dxt + b)));
      for (; b < nb; ++b) sdx[b] = sw[b] * dxt[b];
      out[t * out_stride + r] = DotInt8Avx2<F>(RowData(w, r), sdx, nb, q + t * cols);
    }
  }
}

// The AVX-512 level. Blocks of 32 (q8_0, q4_0, mxfp4) decode to two vectors of 16: q8_0 and q4_0 in element order
// (q4_0: low nibbles = elements 0..15, high = 16..31); mxfp4 as low nibbles (elements 0, 2, .., 30) then high
// nibbles (1, 3, .., 31), its activations permuted alike once per call (PermuteMxfp4), so no lane shuffle per block.
// A row's f16 / E8M0 scales are converted first (RowScales). The decoded vectors go straight into the fused
// multiply-adds of up to 2 tokens at a time (DotBlocks, DotFp8: the decode is shared, each token has its own 8
// accumulators); fp8 rows with NaN codes or blocks that are not whole chunks of 128 are decoded into a buffer
// (DequantFp8Avx512) that DotRowAvx512 reads per token. All run the same arithmetic in the same order (8 accumulators
// of 16 lanes over chunks of 128 elements, then single vectors into accumulator 0, then TailSum), so a token's result
// does not depend on how many tokens share the call.

// The scalar tail of a dot: s + w[0] x[0] + ... + w[n-1] x[n-1], left to right, a product then a sum (two roundings,
// never contracted to a fused multiply-add: one function for every caller, so every caller rounds it alike).
// VEX-encoded like its callers: a legacy-SSE instruction after AVX-512 code that used ZMM16-31 (which VZEROUPPER does
// not clear) pays an SSE/AVX transition on Intel cores, measured at ~1000 cycles per call (per row) here.
FT_JAX_AVX512 __attribute__((noinline)) float TailSum(float s, const float* w, const float* x, int64_t n) {
  __m128 acc = _mm_set_ss(s);
  for (int64_t i = 0; i < n; ++i) acc = _mm_add_ss(acc, _mm_mul_ss(_mm_load_ss(w + i), _mm_load_ss(x + i)));
  return _mm_cvtss_f32(acc);
}

FT_JAX_AVX512 inline float ReduceAcc(__m512* acc) {
  for (int width = kAccumulators / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] = _mm512_add_ps(acc[j], acc[j + width]);
  return _mm512_reduce_add_ps(acc[0]);
}

// dot(w[0:len], x[0:len]) of float32 rows, 8 accumulators of 16 lanes (the AVX-512 level of the quantized paths).
FT_JAX_AVX512 float DotRowAvx512(const float* w, const float* x, int64_t len) {
  constexpr int A = kAccumulators;
  __m512 acc[A];
  for (int a = 0; a < A; ++a) acc[a] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 * A <= len; i += 16 * A)
    for (int a = 0; a < A; ++a)
      acc[a] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16 * a), _mm512_loadu_ps(x + i + 16 * a), acc[a]);
  for (; i + 16 <= len; i += 16) acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc[0]);
  return TailSum(ReduceAcc(acc), w + i, x + i, len - i);
}

// The float32 scales of a row's nb blocks (q8_0 / q4_0: f16 through F16C, exact; mxfp4: 2^(s - 127)).
FT_JAX_AVX512 void RowScales(WFormat f, const uint8_t* srow, int64_t nb, float* sf) {
  if (f == WFormat::kMxfp4) {  // 2^(s - 127) = the float32 of exponent field s, except s = 0 (2^-127) and 255 (NaN)
    const Tables& tab = Tab();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16) {
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + b)));
      __m512i bits = _mm512_slli_epi32(e, 23);
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                   _mm512_set1_epi32(0x00400000));
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)),
                                   _mm512_set1_epi32(0x7FC00000));
      _mm512_storeu_ps(sf + b, _mm512_castsi512_ps(bits));
    }
    for (; b < nb; ++b) sf[b] = tab.e8m0[srow[b]];
    return;
  }
  const uint16_t* d = reinterpret_cast<const uint16_t*>(srow);
  int64_t b = 0;
  for (; b + 16 <= nb; b += 16)
    _mm512_storeu_ps(sf + b, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b))));
  for (; b < nb; ++b) sf[b] = _cvtsh_ss(d[b]);
}

// Block b of a row: its 32 values as two vectors (order: see above), scale sf[b].
template <WFormat F>
FT_JAX_AVX512 inline void DecodeBlock(const uint8_t* row, const float* sf, int64_t b, __m512* v0, __m512* v1) {
  const __m512 s = _mm512_set1_ps(sf[b]);
  if constexpr (F == WFormat::kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(row + 32 * b);
    *v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), s);
    *v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), s);
  } else {
    const __m512 lut = F == WFormat::kQ4_0
                           ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                           : _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                            -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512 lutd = _mm512_mul_ps(lut, s);  // exact: d * (q - 8), or an FP4 value times a power of two
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b)));
    *v0 = _mm512_permutexvar_ps(idx, lutd);  // vpermps reads the low 4 bits: the low nibbles
    *v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lutd);
  }
}

// DotRowAvx512(decoded row, x[t]) without a row buffer (DecodeBlock per block), for NT tokens at once (x[t] at x + t * x_stride, result
// to out[t * out_stride]): each token has its own accumulators, in the order DotRowAvx512 sums, so its result is
// bit for bit the same whatever NT.
template <WFormat F, int NT>
FT_JAX_AVX512 void DotBlocks(const uint8_t* row, const float* sf, int64_t nb, const float* x, int64_t x_stride,
                             float* out, int64_t out_stride) {
  __m512 acc[NT][kAccumulators];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < kAccumulators; ++a) acc[t][a] = _mm512_setzero_ps();
  static_assert(kAccumulators == 8, "a chunk of 128 elements is 4 blocks");
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    for (int q = 0; q < 4; ++q) {
      __m512 v0, v1;
      DecodeBlock<F>(row, sf, b + q, &v0, &v1);
      for (int t = 0; t < NT; ++t) {
        const float* xb = x + t * x_stride + 32 * (b + q);
        acc[t][2 * q] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xb), acc[t][2 * q]);
        acc[t][2 * q + 1] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xb + 16), acc[t][2 * q + 1]);
      }
    }
  }
  for (; b < nb; ++b) {
    __m512 v0, v1;
    DecodeBlock<F>(row, sf, b, &v0, &v1);
    for (int t = 0; t < NT; ++t) {
      acc[t][0] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x + t * x_stride + 32 * b), acc[t][0]);
      acc[t][0] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x + t * x_stride + 32 * b + 16), acc[t][0]);
    }
  }
  for (int t = 0; t < NT; ++t) out[t * out_stride] = ReduceAcc(acc[t]);  // no tail: rows are whole blocks
}

// 16 float8_e4m3fn bytes at p times the scale s256 / 256, for rows without NaN codes (RowHasNan): sign-extended to
// 16 bits and shifted by 7, a byte becomes the half of its value times 2^-8 once bit 14 (a copy of the sign) is
// cleared (see E4m3ToHalfScaled).
FT_JAX_AVX512 inline __m512 DecodeFp8(const uint8_t* p, __m512 s256) {
  const __m256i t = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(t, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), s256);
}

// Whether a row of n float8_e4m3fn bytes holds a NaN code (0x7f or 0xff): such rows are decoded by the table
// (DequantGeneric) so that NaN stays NaN; checkpoints have none, and the check costs a few instructions per 64 bytes.
FT_JAX_AVX512 bool RowHasNan(const uint8_t* row, int64_t n) {
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  __mmask64 any = 0;
  int64_t c = 0;
  for (; c + 64 <= n; c += 64)
    any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(row + c), low7), low7);
  bool nan = any != 0;
  for (; c < n; ++c) nan |= (row[c] & 0x7F) == 0x7F;
  return nan;
}

FT_JAX_AVX512 void DequantFp8Avx512(const MatrixView& w, int64_t r, float* out) {
  const uint8_t* row = RowData(w, r);
  if (RowHasNan(row, w.cols)) return DequantGeneric(w, r, out);
  const float* sc = reinterpret_cast<const float*>(ScaleRow(w, r));
  const Tables& tab = Tab();
  for (int64_t c0 = 0, j = 0; c0 < w.cols; c0 += w.block_cols, ++j) {  // j = c0 / block_cols (no division)
    const int64_t end = std::min(w.cols, c0 + w.block_cols);
    const float s = sc[j];
    const __m512 s256 = _mm512_set1_ps(s * 256.0f);
    int64_t c = c0;
    for (; c + 16 <= end; c += 16) _mm512_storeu_ps(out + c, DecodeFp8(row + c, s256));
    for (; c < end; ++c) out[c] = tab.e4m3[row[c]] * s;
  }
}

// DotRowAvx512(DequantFp8Avx512(row), x[t]) without the buffer for NT tokens at once (x[t] at x + t * x_stride,
// results to out[t * out_stride], each token in DotRowAvx512's order whatever NT), for block_cols a multiple of 128
// (a chunk of 128 elements, and so every vector, then lies in one scale block). Returns false (and the results mean
// nothing) when the row holds a NaN code: the caller then takes DequantFp8Avx512's table decode (the check rides on
// the decode's loads).
template <int NT>
FT_JAX_AVX512 bool DotFp8(const MatrixView& w, const uint8_t* row, const float* sc, const float* x, int64_t x_stride,
                          float* out, int64_t out_stride) {
  const int64_t bc = w.block_cols, len = w.cols;
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  __mmask64 any = 0;
  __m512 acc[NT][kAccumulators];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < kAccumulators; ++a) acc[t][a] = _mm512_setzero_ps();
  int64_t i = 0;
  // the scale block of chunk i / 128 without a division per chunk (an integer division costs tens of cycles)
  const int64_t chunks_per_block = bc / 128;
  int64_t block = 0, chunk_in_block = 0;
  for (; i + 128 <= len; i += 128) {
    const __m512i b0 = _mm512_loadu_si512(row + i), b1 = _mm512_loadu_si512(row + i + 64);
    any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(b0, low7), low7) |
           _mm512_cmpeq_epi8_mask(_mm512_and_si512(b1, low7), low7);
    const __m512 s256 = _mm512_set1_ps(sc[block] * 256.0f);
    if (++chunk_in_block == chunks_per_block) {
      chunk_in_block = 0;
      ++block;
    }
    for (int a = 0; a < kAccumulators; ++a) {
      const __m512 v = DecodeFp8(row + i + 16 * a, s256);
      for (int t = 0; t < NT; ++t)
        acc[t][a] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * x_stride + i + 16 * a), acc[t][a]);
    }
  }
  bool has_nan = any != 0;
  for (int64_t c = i; c < len; ++c) has_nan |= (row[c] & 0x7F) == 0x7F;
  if (has_nan) return false;
  for (; i + 16 <= len; i += 16) {
    const __m512 v = DecodeFp8(row + i, _mm512_set1_ps(sc[i / bc] * 256.0f));
    for (int t = 0; t < NT; ++t) acc[t][0] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x + t * x_stride + i), acc[t][0]);
  }
  float tail[16];
  const Tables& tab = Tab();
  for (int64_t c = i; c < len; ++c) tail[c - i] = tab.e4m3[row[c]] * sc[c / bc];
  for (int t = 0; t < NT; ++t) out[t * out_stride] = TailSum(ReduceAcc(acc[t]), tail, x + t * x_stride + i, len - i);
  return true;
}

// mxfp4 activations in the order its blocks decode: per block, elements 0, 2, .., 30 then 1, 3, .., 31.
void PermuteMxfp4(const float* x, int64_t cols, float* xp) {
  for (int64_t b = 0; b < cols / kQBlock; ++b)
    for (int j = 0; j < 16; ++j) {
      xp[32 * b + j] = x[32 * b + 2 * j];
      xp[32 * b + 16 + j] = x[32 * b + 2 * j + 1];
    }
}

// mxfp4 at the AVX2 level, dotted straight from the row's bytes with float32 activations as they arrive (no row
// buffer): a block's 16 bytes become its doubled FP4 codes (VPSHUFB over 2 * FP4_E2M1, exact int8), low nibbles
// (elements 0, 2, .., 30) then high nibbles (1, 3, .., 31) against x permuted alike once per call (PermuteMxfp4);
// each token sums code * x over the block in float32 and adds that sum times 2^(s - 128) (exact: a power of two)
// to one of 2 accumulators (block b into b % 2). Up to 2 tokens share a block's decode, each in its own fixed order,
// so a token's result does not depend on the other. Error: the float32 bound (gamma_{K+2} sum |w x|). An E8M0 scale
// 255 (NaN) makes the row's dot NaN.
template <int N>
FT_JAX_AVX2_F16C void DotMxfp4Avx2(const uint8_t* row, const uint8_t* srow, int64_t nb, const float* xp,
                                   int64_t cols, float* out, int64_t out_stride) {
  const Tables& tab = Tab();
  const __m128i lut2 = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);  // 2 * FP4
  const __m128i m4 = _mm_set1_epi8(0x0F);
  __m256 acc[N][2];
  for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m128i lo = _mm_shuffle_epi8(lut2, _mm_and_si128(q, m4));
    const __m128i hi = _mm_shuffle_epi8(lut2, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
    const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    const __m256 v2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    const __m256 v3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    const __m256 s = _mm256_set1_ps(tab.e8m0_half[srow[b]]);
    for (int n = 0; n < N; ++n) {
      const float* xb = xp + n * cols + 32 * b;
      __m256 p = _mm256_mul_ps(v0, _mm256_loadu_ps(xb));
      p = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xb + 8), p);
      p = _mm256_fmadd_ps(v2, _mm256_loadu_ps(xb + 16), p);
      p = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xb + 24), p);
      acc[n][b & 1] = _mm256_fmadd_ps(p, s, acc[n][b & 1]);
    }
  }
  for (int n = 0; n < N; ++n) out[n * out_stride] = HSum(_mm256_add_ps(acc[n][0], acc[n][1]));
}

// Rows [r0, r1) of an mxfp4 matrix, tokens in pairs sharing a block's decode (DotMxfp4Avx2).
FT_JAX_AVX2_F16C void DotRowsMxfp4Avx2(const MatrixView& w, int64_t r0, int64_t r1, const float* x, int64_t T,
                                       float* out, int64_t out_stride) {
  thread_local std::vector<float> storage;  // x permuted [T, cols]
  Scratch<float> scratch(storage, static_cast<size_t>(T * w.cols));
  float* xp = scratch.data();
  for (int64_t t = 0; t < T; ++t) PermuteMxfp4(x + t * w.cols, w.cols, xp + t * w.cols);
  const int64_t nb = w.cols / kQBlock;
  for (int64_t r = r0; r < r1; ++r) {
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {
      DotMxfp4Avx2<2>(RowData(w, r), ScaleRow(w, r), nb, xp + t * w.cols, w.cols, out + t * out_stride + r, out_stride);
    }
    if (t < T) DotMxfp4Avx2<1>(RowData(w, r), ScaleRow(w, r), nb, xp + t * w.cols, w.cols, out + t * out_stride + r, out_stride);
  }
}

// The even (imm 0x88) or odd (0xDD) elements of a and b, in order.
template <int Imm>
FT_JAX_AVX2_F16C inline __m256 Mxfp4Half(__m256 a, __m256 b) {
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, Imm)), 0xD8));
}

// 16 int16 in order: round-half-even(lo * s), round-half-even(hi * s), saturated (PACKSSDW interleaves 128-bit lanes).
FT_JAX_AVX2_F16C inline __m256i RoundToInt16(__m256 lo, __m256 hi, __m256 s) {
  const __m256i p =
      _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(lo, s)), _mm256_cvtps_epi32(_mm256_mul_ps(hi, s)));
  return _mm256_permute4x64_epi64(p, 0xD8);
}

// mxfp4 at the AVX2 level with int16 activations. Per token and block of 32, in the order the block's codes decode
// (low nibbles: elements 0, 2, .., 30, then high nibbles: 1, 3, .., 31), x is quantized to q = round-half-even(x / dx)
// saturated to int16, with dx = 2^(E - 15) a power of two and max_b |x| < 2^E (so |q| <= 32768, and x / dx is exact:
// |x - dx q| <= dx / 2, or <= dx where +32768 saturates to 32767); dx = 0 for an all-zero block, NaN for a block with
// a NaN or inf (the dot is then NaN, never a value computed as if it were not there). A bf16 activation within 2^7 of
// its block's maximum is quantized exactly. Blocks below 2^-112 use dx = 2^-126.
FT_JAX_AVX2_F16C void QuantizeMxfp4ActsAvx2(const float* x, int64_t cols, int16_t* q, float* dx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < cols / kQBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
      const __m256 a = _mm256_andnot_ps(sign, v[j]);
      amax = _mm256_max_ps(amax, a);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));  // NaN
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    uint32_t bits;
    const float mx = _mm_cvtss_f32(m);
    std::memcpy(&bits, &mx, 4);
    const int32_t eb = static_cast<int32_t>(bits >> 23);  // biased exponent of max |x|: max < 2^(eb - 126)
    float d, inv;
    if (_mm256_movemask_ps(bad) || eb == 255) {
      d = std::numeric_limits<float>::quiet_NaN(), inv = 0.0f;
    } else if (bits == 0) {
      d = inv = 0.0f;
    } else {
      const int32_t e = std::max(eb, 15);  // dx = 2^(e - 141), 1 / dx = 2^(141 - e): both normal floats
      const uint32_t db = static_cast<uint32_t>(e - 14) << 23, ib = static_cast<uint32_t>(268 - e) << 23;
      std::memcpy(&d, &db, 4);
      std::memcpy(&inv, &ib, 4);
    }
    dx[b] = d;
    const __m256 s = _mm256_set1_ps(inv);
    // even elements 0, 2, .., 30 and odd 1, 3, .., 31, each in order (SHUFPS within 128-bit lanes, then VPERMPD)
    const __m256 e0 = Mxfp4Half<0x88>(v[0], v[1]), e1 = Mxfp4Half<0x88>(v[2], v[3]);
    const __m256 o0 = Mxfp4Half<0xDD>(v[0], v[1]), o1 = Mxfp4Half<0xDD>(v[2], v[3]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), RoundToInt16(e0, e1, s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b + 16), RoundToInt16(o0, o1, s));
  }
}

// A row's block scales times one token's dx: sdx[b] = 2^(s_b - 128) dx[b] for b < nb (E8M0 s_b; 2^(s - 128), half the
// scale, because the codes are doubled). A product of powers of two, exact unless below float32's subnormals; NaN
// for s_b = 255 or a NaN dx.
FT_JAX_AVX2_F16C void Mxfp4BlockScales(const uint8_t* srow, const float* dx, int64_t nb, float* sdx) {
  const Tables& tab = Tab();
  int64_t b = 0;
  const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2), nan = _mm256_set1_epi32(0x7FC00000);
  for (; b + 8 <= nb; b += 8) {
    const __m256i sv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(srow + b)));
    // 2^(s - 128) as float32 bits: exponent field s - 1 for s >= 2; subnormal 2^-127 (s = 1), 2^-128 (s = 0)
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(sv, one), 23);
    const __m256i sub = _mm256_srlv_epi32(_mm256_set1_epi32(0x00800000), _mm256_sub_epi32(two, sv));
    __m256i bits = _mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(sv, one));
    bits = _mm256_blendv_epi8(bits, nan, _mm256_cmpeq_epi32(sv, _mm256_set1_epi32(255)));
    _mm256_storeu_ps(sdx + b, _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_loadu_ps(dx + b)));
  }
  for (; b < nb; ++b) sdx[b] = tab.e8m0_half[srow[b]] * dx[b];
}

// acc[n] + sdx_nb (code . q_nb) for N tokens n: block b of a row (its doubled codes as int16, w0: elements 0, 2, ..,
// 30; w1: 1, 3, .., 31) with each token's int16 activations q + n * cols and block scales sdx + n * nb.
template <int N>
FT_JAX_AVX2_F16C inline void Int16BlockFma(__m256i w0, __m256i w1, const int16_t* q, const float* sdx, int64_t nb,
                                           int64_t cols, int64_t b, __m256* acc) {
  for (int n = 0; n < N; ++n) {
    const int16_t* qb = q + n * cols + 32 * b;
    const __m256i sum = _mm256_add_epi32(
        _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb))),
        _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 16))));
    acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(sdx + n * nb + b), acc[n]);
  }
}

// The doubled FP4 codes (VPSHUFB over 2 * FP4_E2M1: exact int8) of the mxfp4 blocks in c, one block of 16 bytes per
// 128-bit lane: lo the low nibbles (elements 0, 2, .., 30 of the lane's block), hi the high ones (1, 3, .., 31).
FT_JAX_AVX2_F16C inline void Mxfp4Codes(__m256i c, __m256i* lo, __m256i* hi) {
  const __m256i lut2 = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,  // 2 * FP4, per lane
                                        0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  *lo = _mm256_shuffle_epi8(lut2, _mm256_and_si256(c, m4));
  *hi = _mm256_shuffle_epi8(lut2, _mm256_and_si256(_mm256_srli_epi16(c, 4), m4));
}

// One row's dots with N tokens' int16 activations (QuantizeMxfp4ActsAvx2; token n's at q + n * cols) and block
// scales sdx + n * nb (Mxfp4BlockScales): a block's integer dot with a token's q is exact (VPMADDWD: |code| <= 12,
// pair sums < 2^20, block sums < 2^24, so also exact in float32), then scaled by sdx_b into one of 2 accumulators per
// token (block b into b % 2, named registers). Up to 2 tokens share a block's decode, each in its own fixed order, so
// a token's result does not depend on the other. Error against the quantized activations: the float32 bound of the
// scaled sum (gamma_{K/32+1}); against x, |w| . ex besides, ex <= dx per element.
template <int N>
FT_JAX_AVX2_F16C void DotMxfp4Int16Avx2(const uint8_t* row, int64_t nb, const int16_t* q, const float* sdx,
                                        int64_t cols, float* out, int64_t out_stride) {
  __m256 even[N], odd[N];
  for (int n = 0; n < N; ++n) even[n] = odd[n] = _mm256_setzero_ps();
  __m256i lo, hi;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {  // blocks b and b + 1 decoded together, one in each 128-bit lane
    Mxfp4Codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * b)), &lo, &hi);
    Int16BlockFma<N>(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo)), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi)),
                     q, sdx, nb, cols, b, even);
    Int16BlockFma<N>(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1)),
                     _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1)), q, sdx, nb, cols, b + 1, odd);
  }
  if (b < nb) {  // an odd last block, in the low lane
    Mxfp4Codes(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b))), &lo, &hi);
    Int16BlockFma<N>(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo)), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi)),
                     q, sdx, nb, cols, b, even);
  }
  for (int n = 0; n < N; ++n) out[n * out_stride] = HSum(_mm256_add_ps(even[n], odd[n]));
}

// Rows [r0, r1) of an mxfp4 matrix with int16 activations quantized once per call (qx: QuantizeActivations of a bf16
// model's activations), tokens in pairs sharing a block's decode (DotMxfp4Int16Avx2).
FT_JAX_AVX2_F16C void DotRowsMxfp4Int16Avx2(const MatrixView& w, int64_t r0, int64_t r1, int64_t T, float* out,
                                            int64_t out_stride, const QuantizedActs& qx) {
  const int64_t cols = w.cols, nb = cols / kQBlock;
  thread_local std::vector<float> storage;  // one row's block scales times each token's dx [T, nb]
  Scratch<float> scratch(storage, static_cast<size_t>(T * nb));
  float* sdx = scratch.data();
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t t = 0; t < T; ++t) Mxfp4BlockScales(ScaleRow(w, r), qx.dx + t * nb, nb, sdx + t * nb);
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {
      DotMxfp4Int16Avx2<2>(RowData(w, r), nb, qx.q16 + t * cols, sdx + t * nb, cols, out + t * out_stride + r,
                           out_stride);
    }
    if (t < T) {
      DotMxfp4Int16Avx2<1>(RowData(w, r), nb, qx.q16 + t * cols, sdx + t * nb, cols, out + t * out_stride + r,
                           out_stride);
    }
  }
}

// fp8 at the AVX2 level, dotted straight from the row's bytes (no row buffer): 8 codes at a time become halves of
// value * 2^-8 (E4m3ToHalfScaled, exact) and float32 (F16C, exact); each token sums them times x over a column
// block, then adds that sum times 256 * the block's float32 scale to one of 2 accumulators (block j into j % 2);
// a block's last cols % 8 elements go to a scalar tail sum. As the AVX-512 bf16 dots, the scale multiplies the
// block's partial sum (one rounding) in place of numpy's rounding of data * scale: the float32 bound holds. A NaN
// code makes the row's dot NaN. Up to 2 tokens share the decode, each in its own fixed order.
template <int N>
FT_JAX_AVX2_F16C void DotFp8Avx2(const MatrixView& w, int64_t r, const float* x, float* out, int64_t out_stride) {
  const Tables& tab = Tab();
  const uint8_t* row = RowData(w, r);
  const float* sc = reinterpret_cast<const float*>(ScaleRow(w, r));
  __m256 acc[N][2];
  float tail[N];
  for (int n = 0; n < N; ++n) {
    acc[n][0] = acc[n][1] = _mm256_setzero_ps();
    tail[n] = 0.0f;
  }
  int64_t j = 0;
  for (int64_t c0 = 0; c0 < w.cols; c0 += w.block_cols, ++j) {
    const int64_t end = std::min(w.cols, c0 + w.block_cols);
    __m256 p[N];
    for (int n = 0; n < N; ++n) p[n] = _mm256_setzero_ps();
    int64_t c = c0;
    for (; c + 8 <= end; c += 8) {
      const __m128i t = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
      const __m256 v = _mm256_cvtph_ps(E4m3ToHalfScaled(t));
      for (int n = 0; n < N; ++n) p[n] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + n * w.cols + c), p[n]);
    }
    const __m256 s = _mm256_set1_ps(sc[j] * 256.0f);
    for (int n = 0; n < N; ++n) {
      acc[n][j & 1] = _mm256_fmadd_ps(p[n], s, acc[n][j & 1]);
      for (int64_t i = c; i < end; ++i) tail[n] += tab.e4m3[row[i]] * sc[j] * x[n * w.cols + i];
    }
  }
  for (int n = 0; n < N; ++n) out[n * out_stride] = HSum(_mm256_add_ps(acc[n][0], acc[n][1])) + tail[n];
}

// Rows [r0, r1) of an fp8 matrix, tokens in pairs sharing the decode (DotFp8Avx2).
FT_JAX_AVX2_F16C void DotRowsFp8Avx2(const MatrixView& w, int64_t r0, int64_t r1, const float* x, int64_t T,
                                     float* out, int64_t out_stride) {
  for (int64_t r = r0; r < r1; ++r) {
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) DotFp8Avx2<2>(w, r, x + t * w.cols, out + t * out_stride + r, out_stride);
    if (t < T) DotFp8Avx2<1>(w, r, x + t * w.cols, out + t * out_stride + r, out_stride);
  }
}

// Rows [r0, r1) of q8_0 / q4_0 (no VNNI) or mxfp4 (x permuted, PermuteMxfp4), tokens in pairs sharing a row's decode.
template <WFormat F>
FT_JAX_AVX512 void DotRowsBlocks(const MatrixView& w, int64_t r0, int64_t r1, const float* x, int64_t T, float* out,
                                 int64_t out_stride, float* sf) {
  const int64_t nb = w.cols / kQBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = RowData(w, r);
    RowScales(F, ScaleRow(w, r), nb, sf);
    int64_t t = 0;
    for (; t + 2 <= T; t += 2)
      DotBlocks<F, 2>(row, sf, nb, x + t * w.cols, w.cols, out + t * out_stride + r, out_stride);
    if (t < T) DotBlocks<F, 1>(row, sf, nb, x + t * w.cols, w.cols, out + t * out_stride + r, out_stride);
  }
}

// q8_0 / q4_0 with int8 activations (AVX-512 VNNI), as llama.cpp's ggml_vec_dot_q8_0_q8_0 / q4_0_q8_0: each token's
// activations are quantized per block of 32 to int8 with a float32 scale dx = max |x| / 127 (round to nearest even;
// a NaN in the block makes dx NaN, so the dot is NaN rather than a value computed without it),
// a block's integer dot is exact (VPDPBUSD), then scaled by dw * dx in float32. Error (docs/DESIGN.md section 15.1):
// |x - dx q| <= dx / 2 per element, so a row adds at most sum_b (max_b |x| / 254) sum_{i in b} |w_i| to the float32
// dot's own error.
//
// Both formats dot unsigned weight bytes with the signed activations q (VPDPBUSD multiplies unsigned by signed
// bytes): q4_0 its nibbles n (the weight is n - 8), q8_0 its int8 codes w flipped to w + 128 (one XOR). The weights'
// offsets make an integer per block and token that depends on the activations only, -8 sum(q) for q4_0 and
// -128 sum(q) for q8_0: the int32 lanes of each block's dot start from these corrections (Int8Corrections) instead
// of zero, so the block's integer sum is the exact sum w q at no extra instruction per row.
//
// Corrections per token, int32 lanes in the order the dots fill them: q4_0 16 per group of 4 blocks (block 4g + j in
// lane 4j, the first of the 4 lanes its low nibbles go to), 16 for a last pair (lanes 0 and 4), 16 for a last single
// block (lane 0); q8_0 16 per pair of blocks (lanes 0 and 8), 16 for a last single block (lane 0).
int64_t Int8Corrections(WFormat f, int64_t nb) { return f == WFormat::kQ4_0 ? 16 * (nb / 4 + 2) : 16 * (nb / 2 + 1); }

// q4_0 activation order (matches the weight bytes of blocks 4g .. 4g + 3 split into low then high nibbles):
// x[b0 0..15], x[b1 0..15], x[b2 0..15], x[b3 0..15], x[b0 16..31], .., x[b3 16..31]; of the last nb % 4 blocks a
// pair as x[b0 0..15], x[b1 0..15], x[b0 16..31], x[b1 16..31], a single block in element order. q8_0: element order.
// corr: Int8Corrections(f, nb) int32 lanes.
FT_JAX_VNNI void QuantizeActs(WFormat f, const float* x, int64_t cols, int8_t* q, float* dx, int32_t* corr) {
  const int64_t nb = cols / kQBlock;
  alignas(64) int8_t tmp[32];
  std::fill(corr, corr + Int8Corrections(f, nb), 0);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const bool nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
    const float d = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;  // a NaN block: a NaN dot
    const __m512 inv = _mm512_set1_ps(d == 0.0f ? 0.0f : 1.0f / d);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    const __m128i lo = _mm512_cvtsepi32_epi8(q0), hi = _mm512_cvtsepi32_epi8(q1);
    dx[b] = d;
    // the saturated int8 values: the sum the dot sees
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_cvtepi8_epi32(lo), _mm512_cvtepi8_epi32(hi)));
    if (f == WFormat::kQ8_0) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), lo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), hi);
      corr[16 * (b / 2) + 8 * (b % 2)] = -128 * sum;
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp + 16), hi);
    // Groups of 4 blocks (low halves of blocks 4g..4g+3, then their high halves), then a pair, then a single block.
    const int64_t quads = nb / 4, rest = nb - 4 * quads;
    if (b < 4 * quads) {
      std::memcpy(q + 128 * (b / 4) + 16 * (b % 4), tmp, 16);
      std::memcpy(q + 128 * (b / 4) + 64 + 16 * (b % 4), tmp + 16, 16);
      corr[16 * (b / 4) + 4 * (b % 4)] = -8 * sum;
    } else if (rest >= 2 && b < 4 * quads + 2) {
      const int64_t j = b - 4 * quads;
      std::memcpy(q + 128 * quads + 16 * j, tmp, 16);
      std::memcpy(q + 128 * quads + 32 + 16 * j, tmp + 16, 16);
      corr[16 * quads + 4 * j] = -8 * sum;
    } else {
      std::memcpy(q + 32 * b, tmp, 32);
      corr[16 * quads + 16] = -8 * sum;
    }
  }
}

// One token's activations as the int8 dots read them (QuantizeActs): q [cols], the block products sdx_b = dw_b dx_b
// of the current row [nb], the corrections [Int8Corrections].
struct Int8Token {
  const int8_t* q;
  const float* sdx;
  const int32_t* corr;
};

// acc + the block sums of q4_0 group g (blocks 4g .. 4g + 3; lo, hi: their low and high nibbles) of one token,
// each block's int32 lanes scaled by its sdx: one token's step of DotInt8<kQ4_0>.
FT_JAX_VNNI_LAMBDA inline __m512 Q4GroupFma(__m512 acc, __m512i lo, __m512i hi, const Int8Token& tok, int64_t g) {
  const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int8_t* qt = tok.q + 128 * g;
  const __m512i isum = _mm512_dpbusd_epi32(
      _mm512_dpbusd_epi32(_mm512_loadu_si512(tok.corr + 16 * g), lo, _mm512_loadu_si512(qt)), hi,
      _mm512_loadu_si512(qt + 64));
  const __m512 s = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(tok.sdx + 4 * g)));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc);
}

// out[t * out_stride] = sum_b sdx_b (w_b . q_b) of one q8_0 / q4_0 row for NT tokens at once, the weight bytes loaded
// and unpacked once for all of them; each token has its own accumulators in the order a single token sums (block
// b's products into accumulator b % 4 of its step), so its result is bit for bit the same whatever NT.
template <WFormat F, int NT>
FT_JAX_VNNI void DotInt8(const uint8_t* row, int64_t nb, const Int8Token* tok, float* out, int64_t out_stride) {
  __m512 acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < 4; ++a) acc[t][a] = _mm512_setzero_ps();
  int64_t b0 = 0;   // the first block the pair / single code below starts at
  int64_t c0 = 0;   // its first correction lane
  if constexpr (F == WFormat::kQ4_0) {  // 4 blocks per step: their low nibbles, then their high nibbles
    const __m512i m4z = _mm512_set1_epi8(0x0F);
    int64_t g = 0;
    if constexpr (NT == 1) {
      // One token (decode): the accumulators as plain variables. Through the array of the general form below, GCC
      // stored every accumulator to the stack once per group; this form read q4_0 rows 8 % faster on one thread
      // (in-process A/B, 12 alternated rounds on the 2-core EPYC VM: median 10.7 -> 11.6 GB/s; same bits).
      __m512 a0 = acc[0][0], a1 = acc[0][1], a2 = acc[0][2], a3 = acc[0][3];
      auto step = [&](__m512 a, int64_t at) FT_JAX_VNNI_LAMBDA {
        const __m512i wb = _mm512_loadu_si512(row + 64 * at);
        return Q4GroupFma(a, _mm512_and_si512(wb, m4z), _mm512_and_si512(_mm512_srli_epi16(wb, 4), m4z), tok[0], at);
      };
      for (; 4 * g + 16 <= nb; g += 4) {
        a0 = step(a0, g);
        a1 = step(a1, g + 1);
        a2 = step(a2, g + 2);
        a3 = step(a3, g + 3);
      }
      if (4 * g + 4 <= nb) {  // the last groups into accumulators 0, 1, 2, as the general form
        a0 = step(a0, g);
        ++g;
      }
      if (4 * g + 4 <= nb) {
        a1 = step(a1, g);
        ++g;
      }
      if (4 * g + 4 <= nb) {
        a2 = step(a2, g);
        ++g;
      }
      acc[0][0] = a0, acc[0][1] = a1, acc[0][2] = a2, acc[0][3] = a3;
    } else {
      // group g of 4 blocks into accumulator a = g % 4 of every token
      auto group = [&](int64_t g, int a) FT_JAX_VNNI_LAMBDA {
        const __m512i wb = _mm512_loadu_si512(row + 64 * g);
        const __m512i lo = _mm512_and_si512(wb, m4z), hi = _mm512_and_si512(_mm512_srli_epi16(wb, 4), m4z);
        for (int t = 0; t < NT; ++t) acc[t][a] = Q4GroupFma(acc[t][a], lo, hi, tok[t], g);
      };
      for (; 4 * g + 16 <= nb; g += 4) {  // the accumulator indices constant
        group(g, 0);
        group(g + 1, 1);
        group(g + 2, 2);
        group(g + 3, 3);
      }
      for (int a = 0; 4 * g + 4 <= nb; ++g, ++a) group(g, a);
    }
    b0 = 4 * g;
    c0 = 16 * g;
    if (nb - b0 >= 2) {  // a last pair: low nibbles of both blocks, then high nibbles
      const __m256i m4 = _mm256_set1_epi8(0x0F);
      const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * b0));
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(wb, m4)),
                                           _mm256_and_si256(_mm256_srli_epi16(wb, 4), m4), 1);
      for (int t = 0; t < NT; ++t) {
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_loadu_si512(tok[t].corr + c0), w,
                                                 _mm512_loadu_si512(tok[t].q + 32 * b0));
        const __m512 s = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(tok[t].sdx[b0]),
                                              _mm512_set1_ps(tok[t].sdx[b0 + 1]));
        acc[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[t][0]);
      }
      b0 += 2;
    }
    c0 += 16;  // the single block's lanes follow the pair's
  } else {  // q8_0: 2 blocks per step, the codes flipped to unsigned once for all tokens
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    // pair p of blocks into accumulator a = p % 4 of every token
    auto pair = [&](int64_t p, int a) FT_JAX_VNNI_LAMBDA {
      if constexpr (NT <= 2) PrefetchAhead(row + 64 * p);  // memory-bound decode
      const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(row + 64 * p), flip);
      for (int t = 0; t < NT; ++t) {
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_loadu_si512(tok[t].corr + 16 * p), wu,
                                                 _mm512_loadu_si512(tok[t].q + 64 * p));
        const __m512 s = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(tok[t].sdx[2 * p]),
                                              _mm512_set1_ps(tok[t].sdx[2 * p + 1]));
        acc[t][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[t][a]);
      }
    };
    int64_t p = 0;
    for (; 2 * p + 8 <= nb; p += 4) {  // constant accumulator indices
      pair(p, 0);
      pair(p + 1, 1);
      pair(p + 2, 2);
      pair(p + 3, 3);
    }
    for (int a = 0; 2 * p + 2 <= nb; ++p, ++a) pair(p, a);
    b0 = 2 * p;
    c0 = 16 * p;
  }
  if (b0 < nb) {  // an odd last block
    __m256i w;
    if constexpr (F == WFormat::kQ8_0) {
      w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b0)),
                           _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      const __m128i wb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b0));
      const __m128i m4x = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(wb, 4), m4x), _mm_and_si128(wb, m4x));
    }
    for (int t = 0; t < NT; ++t) {
      const __m256i isum = _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tok[t].corr + c0)),
                                               w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tok[t].q + 32 * b0)));
      const __m512 f = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(isum));
      acc[t][0] = _mm512_fmadd_ps(f, _mm512_set1_ps(tok[t].sdx[b0]), acc[t][0]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    acc[t][0] = _mm512_add_ps(acc[t][0], acc[t][2]);
    acc[t][1] = _mm512_add_ps(acc[t][1], acc[t][3]);
    out[t * out_stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
  }
}

// x [T, cols] quantized into dx [T, nb], corr [T, nc], q [T, cols] (QuantizeActs per token).
FT_JAX_VNNI void QuantizeActsTokens(WFormat f, const float* x, int64_t cols, int64_t T, int8_t* q, float* dx,
                                    int32_t* corr) {
  const int64_t nb = cols / kQBlock, nc = Int8Corrections(f, nb);
  for (int64_t t = 0; t < T; ++t) QuantizeActs(f, x + t * cols, cols, q + t * cols, dx + t * nb, corr + t * nc);
}

// qx: x quantized at this level (QuantizeActivations).
template <WFormat F>
FT_JAX_VNNI void DotRowsInt8(const MatrixView& w, int64_t r0, int64_t r1, int64_t T, float* out, int64_t out_stride,
                             const QuantizedActs& qx) {
  const int64_t cols = w.cols, nb = cols / kQBlock;
  const int64_t nc = Int8Corrections(F, nb);
  // row scales [nb], the block products of every token [T, nb]
  thread_local std::vector<float> storage;
  Scratch<float> scratch(storage, static_cast<size_t>(nb * (1 + T)));
  float* sw = scratch.data();
  float* sdx = sw + nb;
  const float* dx = qx.dx;
  const int32_t* corr = qx.corr;
  const int8_t* q = qx.q;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = RowData(w, r);
    RowScales(F, ScaleRow(w, r), nb, sw);
    for (int64_t t = 0; t < T; ++t) {
      const float* dxt = dx + t * nb;
      float* sdxt = sdx + t * nb;
      int64_t b = 0;
      for (; b + 16 <= nb; b += 16)
        _mm512_storeu_ps(sdxt + b, _mm512_mul_ps(_mm512_loadu_ps(sw + b), _mm512_loadu_ps(dxt + b)));
      for (; b < nb; ++b) sdxt[b] = sw[b] * dxt[b];
    }
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) {  // tokens in pairs sharing the row's loads and unpacking
      const Int8Token tok[2] = {{q + t * cols, sdx + t * nb, corr + t * nc},
                                {q + (t + 1) * cols, sdx + (t + 1) * nb, corr + (t + 1) * nc}};
      DotInt8<F, 2>(row, nb, tok, out + t * out_stride + r, out_stride);
    }
    if (t < T) {
      const Int8Token tok[1] = {{q + t * cols, sdx + t * nb, corr + t * nc}};
      DotInt8<F, 1>(row, nb, tok, out + t * out_stride + r, out_stride);
    }
  }
}

bool HaveVnni() {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
}

// ---- q4_0x16: 16 interleaved rows at once (AVX-512 VNNI) ----
// out[0..15] = the dots of the 16 rows of one q4_0x16 group (gd: its data, gs: its scales; layout: quant_dot.h
// WeightSpec) with one token's int8 activations in element order (QuantizeActs of q8_0: q [nb * 32], dx [nb],
// corr: q8_0's corrections, -128 sum(q_b) for block b at lane 16 (b / 2) + 8 (b % 2)). Lane i is row i: block b's
// integer dot of every row is exact (VPDPBUSD of the nibbles n with q, from -8 sum(q_b) = corr / 16: the weights are
// n - 8), then scaled by dw * dx_b in float32 and summed into accumulator b % 2 (one per lane), the two added last.
// The same error bound as the row form's (DotInt8), a different float32 summation order.
FT_JAX_VNNI void DotQ4x16Group(const uint8_t* gd, const uint16_t* gs, int64_t nb, const int8_t* q, const float* dx,
                               const int32_t* corr, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = gd + 256 * b;
    const int8_t* qb = q + 32 * b;
    __m512i s0 = _mm512_set1_epi32(corr[16 * (b / 2) + 8 * (b % 2)] / 16), s1 = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      int32_t lo_q, hi_q;  // activations 4c .. 4c + 3 and 16 + 4c .. 16 + 4c + 3 of the block
      std::memcpy(&lo_q, qb + 4 * c, 4);
      std::memcpy(&hi_q, qb + 16 + 4 * c, 4);
      PrefetchAhead(blk + 64 * c);
      const __m512i w = _mm512_loadu_si512(blk + 64 * c);
      s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(w, m4), _mm512_set1_epi32(lo_q));
      s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(w, 4), m4), _mm512_set1_epi32(hi_q));
    }
    const __m512 sdx = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gs + 16 * b))),
                                     _mm512_set1_ps(dx[b]));
    acc[b % 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), sdx, acc[b % 2]);
  }
  _mm512_storeu_ps(out, _mm512_add_ps(acc[0], acc[1]));
}

// ---- bf16 dots for fp8 and mxfp4 (AVX-512 BF16; fp8 also VBMI) ----
// Every float8_e4m3fn and FP4 E2M1 value is exact in bfloat16 (<= 4 significant bits, exponents -9..8), so a row
// decodes to bf16 by table lookups (fp8: VPERMI2B over a 128-entry table of high and of low bytes, the sign OR-ed
// in, NaN codes give NaN; mxfp4: VPERMW over the 16 values) and VDPBF16PS multiplies it with the bf16 activations,
// each product exact in float32. The block scale multiplies the block's partial sums (one FMA per vector and
// block; exact for E8M0, one rounding for fp8's float32 scale, in place of numpy's rounding of data * scale).
// Only for a bf16 model's activations (x arrives in bf16, where transformers' bf16 model rounds alike): the
// products w * x are then exact and the dot errs by float32 sums only (the gamma_{K+2} bound holds: the chain per
// lane is ~K / 32 + K / bc + 8 roundings long). float32 activations keep the float32 decode (DotBlocks, DotFp8):
// an exact split of x into 3 bf16 terms (h = bf16(x), m = bf16(x - h), l = bf16(x - h - m)) was measured no faster
// there. The activations are laid out once per call in the order the weight decode produces (PrepBf16Acts), zero
// padded to whole chunks. Tokens share a row's decode (up to 4 at a time), each with its own accumulators in the
// same order, so a token's result never depends on the others.
#define FT_JAX_BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,avx2,fma,f16c")))

bool HaveVbmi() {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  return vbmi;
}

// bf16 bits of float8_e4m3fn magnitude codes 0..127 as high and low bytes (0x7f: NaN).
struct Fp8Bf16Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  Fp8Bf16Tables() {
    for (int b = 0; b < 128; ++b) {
      const uint16_t v = ToBf16(Tab().e4m3[b]);
      hi[b] = static_cast<uint8_t>(v >> 8);
      lo[b] = static_cast<uint8_t>(v & 0xff);
    }
  }
};
const Fp8Bf16Tables& Fp8Bf16() {
  static const Fp8Bf16Tables tables;
  return tables;
}

// Chunk lengths (elements) of the decodes: fp8 64 (one 64-byte load), mxfp4 128 (4 blocks, 64 bytes).
constexpr int64_t Bf16Chunk(WFormat f) { return f == WFormat::kFp8 ? 64 : 128; }

// xp[t * padded + c]: token t's bf16 activations (xb + t * xb_stride, cols of them) in the element order of the decode of
// format f, zero from cols to padded (a multiple of Bf16Chunk(f)). fp8, per 64 elements: 128-bit lanes 0, 2 of each
// 32, then 1, 3 (as VPUNPCKL/HBW pair the bytes). mxfp4, per 128 elements (64 bytes, read as 32 words of 4 codes):
// elements 4j for j = 0..31, then 4j + 1, 4j + 2, 4j + 3 (the 4 codes of word j, DotMxfp4Bf16).
FT_JAX_BF16DOT void PrepBf16Acts(WFormat f, const uint16_t* xb, int64_t xb_stride, int64_t T, int64_t cols,
                                 int64_t padded, uint16_t* xp) {
  // mxfp4: word j of output k is element 4 (j % 16) + k of its half (lanes 0..15 from the first 64 elements, 16..31
  // from the second)
  alignas(64) static const uint16_t kQuad[32] = {0,  4,  8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                                                 0,  4,  8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60};
  const __m512i quad = _mm512_load_si512(kQuad);
  const int64_t chunk = Bf16Chunk(f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < padded; c += chunk) {
      __m512i x[4];
      for (int i = 0; i < chunk / 32; ++i) {
        const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, cols - c - 32 * i));
        x[i] = _mm512_maskz_loadu_epi16(n >= 32 ? ~0u : (1u << n) - 1, xb + t * xb_stride + c + 32 * i);
      }
      uint16_t* o = xp + t * padded + c;
      if (f == WFormat::kFp8) {
        _mm512_storeu_si512(o, _mm512_shuffle_i64x2(x[0], x[1], 0x88));
        _mm512_storeu_si512(o + 32, _mm512_shuffle_i64x2(x[0], x[1], 0xDD));
        continue;
      }
      for (int k = 0; k < 4; ++k) {
        const __m512i idx = _mm512_add_epi16(quad, _mm512_set1_epi16(static_cast<int16_t>(k)));
        _mm512_storeu_si512(o + 32 * k, _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_permutex2var_epi16(x[0], idx, x[1]),
                                                                _mm512_permutex2var_epi16(x[2], idx, x[3])));
      }
    }
  }
}

FT_JAX_BF16DOT inline __m512 Dp(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

FT_JAX_BF16DOT inline float Reduce2(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

// fp8 rows [r0, r1) with NT tokens (terms xp, PrepBf16Acts) into out[t * out_stride + r]; block_cols % 64 == 0.
template <int NT>
FT_JAX_BF16DOT void DotFp8Bf16(const MatrixView& w, int64_t r0, int64_t r1, const uint16_t* xp, int64_t padded,
                               float* out, int64_t out_stride) {
  const Fp8Bf16Tables& tb = Fp8Bf16();
  const __m512i hi0 = _mm512_load_si512(tb.hi), hi1 = _mm512_load_si512(tb.hi + 64);
  const __m512i lo0 = _mm512_load_si512(tb.lo), lo1 = _mm512_load_si512(tb.lo + 64);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t cols = w.cols, bc = w.block_cols;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = RowData(w, r);
    const float* sc = reinterpret_cast<const float*>(ScaleRow(w, r));
    __m512 acc[NT][2];
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t c0 = 0, j = 0; c0 < cols; c0 += bc, ++j) {  // j = c0 / bc (no division)
      const int64_t end = std::min(cols, c0 + bc);
      __m512 tmp[NT][2];
      for (int t = 0; t < NT; ++t) tmp[t][0] = tmp[t][1] = _mm512_setzero_ps();
      for (int64_t c = c0; c < end; c += 64) {
        if constexpr (NT <= 2) PrefetchAhead(row + c);  // memory-bound decode
        const __mmask64 m = end - c >= 64 ? ~0ull : (1ull << (end - c)) - 1;
        const __m512i b = _mm512_maskz_loadu_epi8(m, row + c);
        const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b, sign, 0xF8);
        const __m512i l = _mm512_permutex2var_epi8(lo0, b, lo1);
        const __m512i w0 = _mm512_unpacklo_epi8(l, h), w1 = _mm512_unpackhi_epi8(l, h);
        for (int t = 0; t < NT; ++t) {
          tmp[t][0] = Dp(tmp[t][0], w0, xp + t * padded + c);
          tmp[t][1] = Dp(tmp[t][1], w1, xp + t * padded + c + 32);
        }
      }
      const __m512 s = _mm512_set1_ps(sc[j]);
      for (int t = 0; t < NT; ++t) {
        acc[t][0] = _mm512_fmadd_ps(tmp[t][0], s, acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(tmp[t][1], s, acc[t][1]);
      }
    }
    for (int t = 0; t < NT; ++t) out[t * out_stride + r] = Reduce2(acc[t][0], acc[t][1]);
  }
}

// mxfp4 rows [r0, r1) likewise; sf: scratch of cols / 32 rounded up to 4 floats. A row's 64 bytes (4 blocks) are read
// as 32 words, word j holding the codes of elements 4j .. 4j + 3 in its 4 nibbles: VPERMW of the word, and of the word
// shifted by 4, 8 and 12, decodes each code to bf16 (its low 5 bits index a table of the 16 values twice), and the 4
// VDPBF16PS put float32 lane i on elements 8i .. 8i + 7: lanes 4b .. 4b + 3 hold block b, scaled by one vector.
template <int NT>
FT_JAX_BF16DOT void DotMxfp4Bf16(const MatrixView& w, int64_t r0, int64_t r1, const uint16_t* xp, int64_t padded,
                                 float* out, int64_t out_stride, float* sf) {
  // FP4 E2M1 as bf16, twice: VPERMW reads 5 index bits, so the next code's low bit needs no mask
  alignas(64) static const uint16_t kLut[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040,
      0xC080, 0xC0C0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0,
      0xC000, 0xC040, 0xC080, 0xC0C0};
  const __m512i lut = _mm512_load_si512(kLut);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane -> its block
  const int64_t nb = w.cols / kQBlock, bytes = w.cols / 2;
  for (int64_t b = nb; b % 4 != 0; ++b) sf[b] = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = RowData(w, r);
    RowScales(WFormat::kMxfp4, ScaleRow(w, r), nb, sf);
    __m512 acc[NT][2];
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t g = 0; 4 * g < nb; ++g) {
      if constexpr (NT <= 2) PrefetchAhead(row + 64 * g);  // memory-bound decode
      const int64_t n = std::min<int64_t>(64, bytes - 64 * g);
      const __m512i c = _mm512_maskz_loadu_epi8(n >= 64 ? ~0ull : (1ull << n) - 1, row + 64 * g);
      const __m512i v0 = _mm512_permutexvar_epi16(c, lut), v1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 4), lut);
      const __m512i v2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 8), lut);
      const __m512i v3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 12), lut);
      const __m512 s = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(_mm_loadu_ps(sf + 4 * g)));
      for (int t = 0; t < NT; ++t) {
        const uint16_t* xs = xp + t * padded + 128 * g;
        const __m512 d = Dp(Dp(Dp(Dp(_mm512_setzero_ps(), v0, xs), v1, xs + 32), v2, xs + 64), v3, xs + 96);
        acc[t][g & 1] = _mm512_fmadd_ps(d, s, acc[t][g & 1]);
      }
    }
    for (int t = 0; t < NT; ++t) out[t * out_stride + r] = Reduce2(acc[t][0], acc[t][1]);
  }
}

// out[t * out_stride + r] for rows [r0, r1) and tokens t < T of bf16 activations (token t at xb + t * xb_stride)
// (Bf16DotsApply).
FT_JAX_BF16DOT void DotRowsBf16(const MatrixView& w, int64_t r0, int64_t r1, const uint16_t* xb, int64_t xb_stride,
                                int64_t T, float* out, int64_t out_stride) {
  const int64_t chunk = Bf16Chunk(w.format), padded = (w.cols + chunk - 1) / chunk * chunk;
  thread_local std::vector<uint16_t> xp_storage;  // the laid-out activations [T, padded]
  thread_local std::vector<float> sf_storage;     // mxfp4 row scales [padded / 32]
  Scratch<uint16_t> xps(xp_storage, static_cast<size_t>(T * padded));
  Scratch<float> sfs(sf_storage, static_cast<size_t>(padded / kQBlock));
  uint16_t* xp = xps.data();
  float* sf = sfs.data();
  PrepBf16Acts(w.format, xb, xb_stride, T, w.cols, padded, xp);
  for (int64_t t0 = 0; t0 < T; t0 += 4) {
    const uint16_t* x = xp + t0 * padded;
    float* o = out + t0 * out_stride;
    const int64_t nt = std::min<int64_t>(4, T - t0);
    if (w.format == WFormat::kFp8) {
      if (nt == 4) DotFp8Bf16<4>(w, r0, r1, x, padded, o, out_stride);
      if (nt == 3) DotFp8Bf16<3>(w, r0, r1, x, padded, o, out_stride);
      if (nt == 2) DotFp8Bf16<2>(w, r0, r1, x, padded, o, out_stride);
      if (nt == 1) DotFp8Bf16<1>(w, r0, r1, x, padded, o, out_stride);
    } else {
      if (nt == 4) DotMxfp4Bf16<4>(w, r0, r1, x, padded, o, out_stride, sf);
      if (nt == 3) DotMxfp4Bf16<3>(w, r0, r1, x, padded, o, out_stride, sf);
      if (nt == 2) DotMxfp4Bf16<2>(w, r0, r1, x, padded, o, out_stride, sf);
      if (nt == 1) DotMxfp4Bf16<1>(w, r0, r1, x, padded, o, out_stride, sf);
    }
  }
}

// Whether DotRowsBf16 takes the rows of w: fp8 (with VBMI, column blocks of whole 64-element chunks) and mxfp4 with
// bf16 activations.
bool Bf16DotsApply(const MatrixView& w, bool bf16_x) {
  if (!bf16_x) return false;
  if (w.format == WFormat::kFp8) return HaveVbmi() && w.block_cols % 64 == 0;
  return w.format == WFormat::kMxfp4;
}

// DotRowsView's block formats at the AVX-512 level.
FT_JAX_AVX512 void DotRowsAvx512(const MatrixView& w, int64_t r0, int64_t r1, const float* x, const uint16_t* xb,
                                 int64_t xb_stride, int64_t T, float* out, int64_t out_stride, const QuantizedActs* qx) {
  if (Bf16DotsApply(w, xb != nullptr)) return DotRowsBf16(w, r0, r1, xb, xb_stride, T, out, out_stride);
  thread_local std::vector<float> storage;  // a row buffer [cols], row scales [cols / 32], mxfp4's x [T, cols]
  const size_t cols = static_cast<size_t>(w.cols);
  const size_t need = cols + cols / kQBlock + (w.format == WFormat::kMxfp4 ? static_cast<size_t>(T) * cols : 0);
  Scratch<float> scratch(storage, need);
  float* buf = scratch.data();
  float* sf = buf + cols;
  switch (w.format) {
    case WFormat::kQ8_0:
      if (HaveVnni()) return DotRowsInt8<WFormat::kQ8_0>(w, r0, r1, T, out, out_stride, *qx);
      return DotRowsBlocks<WFormat::kQ8_0>(w, r0, r1, x, T, out, out_stride, sf);
    case WFormat::kQ4_0:
      if (HaveVnni()) return DotRowsInt8<WFormat::kQ4_0>(w, r0, r1, T, out, out_stride, *qx);
      return DotRowsBlocks<WFormat::kQ4_0>(w, r0, r1, x, T, out, out_stride, sf);
    case WFormat::kMxfp4: {
      float* xp = sf + cols / kQBlock;
      for (int64_t t = 0; t < T; ++t) PermuteMxfp4(x + t * w.cols, w.cols, xp + t * w.cols);
      return DotRowsBlocks<WFormat::kMxfp4>(w, r0, r1, xp, T, out, out_stride, sf);
    }
    default:
      break;
  }
  const bool fused = w.block_cols % 128 == 0;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = RowData(w, r);
    const float* sc = reinterpret_cast<const float*>(ScaleRow(w, r));
    if (fused) {  // tokens in pairs sharing the decode
      bool ok = true;
      int64_t t = 0;
      for (; ok && t + 2 <= T; t += 2) ok = DotFp8<2>(w, row, sc, x + t * w.cols, w.cols, out + t * out_stride + r, out_stride);
      if (ok && t < T) ok = DotFp8<1>(w, row, sc, x + t * w.cols, w.cols, out + t * out_stride + r, out_stride);
      if (ok) continue;
    }
    DequantFp8Avx512(w, r, buf);
    for (int64_t t = 0; t < T; ++t) out[t * out_stride + r] = DotRowAvx512(buf, x + t * w.cols, w.cols);
  }
}
#endif

void DequantizeRow(Isa isa, const MatrixView& w, int64_t r, float* out) {
#if FT_JAX_HAVE_AVX2_PATH
  if (isa == Isa::kAvx2) return DequantAvx2(w, r, out);
#endif
  DequantGeneric(w, r, out);
}

float DotF32(Isa isa, const float* w, const float* x, int64_t len) {
#if FT_JAX_HAVE_AVX2_PATH
  if (isa == Isa::kAvx2) return DotRowAvx2<float>(w, x, len);
#endif
  return DotRowGeneric<float>(w, x, len);
}

}  // namespace

namespace {
// The q4_0x16 layout in one place (quant_dot.h WeightSpec): bytes 4c .. 4c + 3 of row i's block b (16 bytes per
// block in row layout) are the 4-byte word i of chunk c of block b in its group's stream (256 bytes per block), and
// row i's scale of block b is the group's scale b * 16 + i.
constexpr size_t X16Word(int64_t b, int64_t c, int64_t i) { return static_cast<size_t>(256 * b + 64 * c + 4 * i); }
constexpr size_t RowWord(int64_t b, int64_t c) { return static_cast<size_t>(16 * b + 4 * c); }
constexpr size_t X16Scale(int64_t b, int64_t i) { return static_cast<size_t>(b * kQ4Interleave + i); }

// Group g of a q4_0x16 matrix back in row layout: data [16, row_bytes], scales [16, scale_row_bytes].
void DeinterleaveQ4Group(const MatrixView& w, int64_t g, uint8_t* data, uint8_t* scales) {
  const int64_t nb = w.cols / kQBlock, n = kQ4Interleave;
  const uint8_t* gd = w.data + static_cast<size_t>(g * n) * w.row_bytes;
  const uint16_t* gs = reinterpret_cast<const uint16_t*>(w.scales + static_cast<size_t>(g * n) * w.scale_row_bytes);
  uint16_t* s = reinterpret_cast<uint16_t*>(scales);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t c = 0; c < 4; ++c) {
        std::memcpy(data + i * w.row_bytes + RowWord(b, c), gd + X16Word(b, c, i), 4);
      }
      s[i * nb + b] = gs[X16Scale(b, i)];
    }
  }
}

// DotRowsView of a q4_0x16 matrix, rows [r0, r1) whole groups; qx: x quantized as ActivationFormat says (q8_0's
// order) where this level has int8 dots. AVX-512 VNNI: DotQ4x16Group, every group once for all T tokens. Other
// levels: each group back in row layout (16 rows in a buffer of the thread), then the q4_0 row dots of the level.
void DotRowsQ4x16(Isa isa, const MatrixView& w, int64_t r0, int64_t r1, const float* x, int64_t T, float* out,
                  int64_t out_stride, const QuantizedActs* qx) {
  const int64_t n = kQ4Interleave, nb = w.cols / kQBlock;
  if (r0 % n != 0 || r1 % n != 0) {
    throw std::invalid_argument("DotRowsView: rows " + std::to_string(r0) + ".." + std::to_string(r1) +
                                " of a q4_0x16 matrix must be whole groups of 16");
  }
#if FT_JAX_HAVE_AVX2_PATH
  if (isa == Isa::kAvx512Bf16 && HaveVnni()) {
    for (int64_t g = r0 / n; g < r1 / n; ++g) {
      const uint8_t* gd = w.data + static_cast<size_t>(g * n) * w.row_bytes;
      const uint16_t* gs = reinterpret_cast<const uint16_t*>(w.scales + static_cast<size_t>(g * n) * w.scale_row_bytes);
      for (int64_t t = 0; t < T; ++t) {
        DotQ4x16Group(gd, gs, nb, qx->q + t * w.cols, qx->dx + t * nb, qx->corr + t * qx->corr_stride,
                      out + t * out_stride + g * n);
      }
    }
    return;
  }
#endif
  thread_local std::vector<uint8_t> group_storage;  // one group in row layout: 16 rows and their scale rows
  const size_t data_bytes = static_cast<size_t>(n) * w.row_bytes;
  Scratch<uint8_t> group(group_storage, data_bytes + static_cast<size_t>(n) * w.scale_row_bytes);
  MatrixView rows = w;
  rows.interleave = 1;
  rows.data = group.data();
  rows.scales = group.data() + data_bytes;
  thread_local std::vector<float> row_storage;
  if (row_storage.size() < static_cast<size_t>(w.cols)) row_storage.resize(w.cols);
  for (int64_t g = r0 / n; g < r1 / n; ++g) {
    DeinterleaveQ4Group(w, g, group.data(), group.data() + data_bytes);
    float* o = out + g * n;
#if FT_JAX_HAVE_AVX2_PATH
    if (isa == Isa::kAvx2 && qx != nullptr) {  // AVX2 quantizes q4_0 and q8_0 activations alike
      DotRowsInt8Avx2<WFormat::kQ4_0>(rows, 0, n, T, o, out_stride, *qx);
      continue;
    }
    if (isa == Isa::kAvx512Bf16) {  // without VNNI: the float decode
      DotRowsAvx512(rows, 0, n, x, nullptr, 0, T, o, out_stride, nullptr);
      continue;
    }
#endif
    for (int64_t r = 0; r < n; ++r) {
      DequantizeRow(isa, rows, r, row_storage.data());
      for (int64_t t = 0; t < T; ++t) o[t * out_stride + r] = DotF32(isa, row_storage.data(), x + t * w.cols, w.cols);
    }
  }
}
}  // namespace

WFormat ActivationFormat(WFormat f, int64_t interleave) {
  return f == WFormat::kQ4_0 && interleave > 1 ? WFormat::kQ8_0 : f;
}

void InterleaveQ4Rows(uint8_t* data, uint16_t* scales, int64_t rows, int64_t cols) {
  const int64_t n = kQ4Interleave;
  if (rows % n != 0 || cols % kQBlock != 0) {
    throw std::invalid_argument("InterleaveQ4Rows: a [" + std::to_string(rows) + ", " + std::to_string(cols) +
                                "] q4_0 matrix needs rows % 16 == 0 and cols % 32 == 0");
  }
  const int64_t nb = cols / kQBlock;
  const size_t row_bytes = static_cast<size_t>(cols / 2);
  std::vector<uint8_t> tmp(static_cast<size_t>(n) * row_bytes);
  std::vector<uint16_t> tmp_s(static_cast<size_t>(n * nb));
  for (int64_t g = 0; g < rows / n; ++g) {
    uint8_t* gd = data + static_cast<size_t>(g * n) * row_bytes;
    uint16_t* gs = scales + g * n * nb;
    std::memcpy(tmp.data(), gd, tmp.size());
    std::memcpy(tmp_s.data(), gs, tmp_s.size() * 2);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t c = 0; c < 4; ++c) {
          std::memcpy(gd + X16Word(b, c, i), tmp.data() + i * row_bytes + RowWord(b, c), 4);
        }
        gs[X16Scale(b, i)] = tmp_s[i * nb + b];
      }
    }
  }
}

const char* WeightSpec::name() const {
  if (!quantized) return "float";
  switch (format) {
    case WFormat::kQ8_0:
      return "q8_0";
    case WFormat::kQ4_0:
      return interleave > 1 ? "q4_0x16" : "q4_0";
    case WFormat::kMxfp4:
      return "mxfp4";
    default:
      return "fp8";
  }
}

std::string ParseWeightSpec(std::string_view name, int64_t block_rows, int64_t block_cols, WeightSpec* out) {
  WeightSpec s;
  s.block_rows = block_rows;
  s.block_cols = block_cols;
  const std::string shape = "(" + std::to_string(block_rows) + ", " + std::to_string(block_cols) + ")";
  if (name == "float") {
    if (block_rows != 1 || block_cols != 1) return "weight_format 'float' takes block (1, 1), got " + shape;
  } else if (name == "q8_0" || name == "q4_0" || name == "q4_0x16" || name == "mxfp4") {
    s.quantized = true;
    s.format = name == "q8_0" ? WFormat::kQ8_0 : name == "mxfp4" ? WFormat::kMxfp4 : WFormat::kQ4_0;
    if (name == "q4_0x16") s.interleave = kQ4Interleave;
    if (block_rows != 1 || block_cols != kQBlock) {
      return "weight_format '" + std::string(name) + "' has blocks (1, 32), got " + shape;
    }
  } else if (name == "fp8") {
    s.quantized = true;
    s.format = WFormat::kFp8;
    if (block_rows < 1 || block_cols < 1) return "weight_format 'fp8' needs a positive block shape, got " + shape;
  } else {
    return "unknown weight_format '" + std::string(name) +
           "' (expected 'float', 'q8_0', 'q4_0', 'q4_0x16', 'mxfp4' or 'fp8')";
  }
  *out = s;
  return "";
}

int32_t DataDTypeCode(WFormat f) {
  switch (f) {
    case WFormat::kQ8_0:
      return static_cast<int32_t>(BankDType::kS8);
    case WFormat::kQ4_0:
    case WFormat::kMxfp4:
      return static_cast<int32_t>(BankDType::kU8);
    case WFormat::kFp8:
      return static_cast<int32_t>(BankDType::kF8E4M3FN);
    case WFormat::kBF16:
      return static_cast<int32_t>(BankDType::kBF16);
    default:
      return static_cast<int32_t>(BankDType::kF32);
  }
}

int32_t ScaleDTypeCode(WFormat f) {
  switch (f) {
    case WFormat::kQ8_0:
    case WFormat::kQ4_0:
      return static_cast<int32_t>(BankDType::kF16);
    case WFormat::kMxfp4:
      return static_cast<int32_t>(BankDType::kU8);
    default:
      return static_cast<int32_t>(BankDType::kF32);
  }
}

int64_t ValuesPerItem(WFormat f) { return f == WFormat::kQ4_0 || f == WFormat::kMxfp4 ? 2 : 1; }

size_t DataRowBytes(WFormat f, int64_t cols) {
  return static_cast<size_t>(cols / ValuesPerItem(f)) * BankDTypeSize(DataDTypeCode(f));
}

int64_t ScaleRows(const WeightSpec& s, int64_t rows) {
  return s.quantized ? (rows + s.block_rows - 1) / s.block_rows : 0;
}
int64_t ScaleCols(const WeightSpec& s, int64_t cols) {
  return s.quantized ? (cols + s.block_cols - 1) / s.block_cols : 0;
}
size_t ScaleRowBytes(const WeightSpec& s, int64_t cols) {
  return s.quantized ? static_cast<size_t>(ScaleCols(s, cols)) * BankDTypeSize(ScaleDTypeCode(s.format)) : 0;
}

namespace {
std::string Shape(const int64_t* d, size_t n) {
  std::string t = "[";
  for (size_t i = 0; i < n; ++i) t += (i ? ", " : "") + std::to_string(d[i]);
  return t + "]";
}
}  // namespace

std::string CheckStoredMatrix(const WeightSpec& s, const std::string& what, int32_t dtype, const int64_t* dims,
                              size_t ndims, const std::string& scale_what, int32_t scale_dtype,
                              const int64_t* scale_dims, size_t scale_ndims, int64_t rows, int64_t cols, bool pair) {
  const std::string fmt = s.name();
  if (s.format != WFormat::kFp8 && cols % s.block_cols != 0) {  // fp8 edge blocks may be partial, (1, bc) too
    return what + ": rows of " + std::to_string(cols) + " elements do not fit " + fmt + "'s blocks of " +
           std::to_string(s.block_cols) + " (the row length must be a multiple of " + std::to_string(s.block_cols) +
           ")";
  }
  if (s.interleave > 1 && (pair ? rows / 2 : rows) % s.interleave != 0) {
    return what + ": " + fmt + " stores rows in groups of " + std::to_string(s.interleave) + ", so a matrix needs a " +
           "multiple of " + std::to_string(s.interleave) + " rows, got " + std::to_string(pair ? rows / 2 : rows);
  }
  const int64_t want[2] = {rows, cols / ValuesPerItem(s.format)};
  if (dtype != DataDTypeCode(s.format) || ndims != 2 || dims[0] != want[0] || dims[1] != want[1]) {
    return what + " must be " + BankDTypeName(DataDTypeCode(s.format)) + " " + Shape(want, 2) + " for " + fmt +
           ", got " + BankDTypeName(dtype) + " " + Shape(dims, ndims);
  }
  const int64_t swant[2] = {pair ? 2 * ScaleRows(s, rows / 2) : ScaleRows(s, rows), ScaleCols(s, cols)};
  if (scale_dtype != ScaleDTypeCode(s.format) || scale_ndims != 2 || scale_dims[0] != swant[0] ||
      scale_dims[1] != swant[1]) {
    return scale_what + " must be " + BankDTypeName(ScaleDTypeCode(s.format)) + " " + Shape(swant, 2) + " for " +
           fmt + " blocks (" + std::to_string(s.block_rows) + ", " + std::to_string(s.block_cols) + "), got " +
           BankDTypeName(scale_dtype) + " " + Shape(scale_dims, scale_ndims);
  }
  return "";
}

MatrixView MakeView(WFormat f, const WeightSpec& s, const uint8_t* data, const uint8_t* scales, int64_t cols,
                    int64_t first_row) {
  MatrixView v;
  v.format = f;
  v.cols = cols;
  v.row_bytes = DataRowBytes(f, cols);
  v.data = data + static_cast<size_t>(first_row) * v.row_bytes;
  v.interleave = s.interleave;  // first_row: a multiple of it (CheckStoredMatrix)
  if (s.quantized) {
    v.block_rows = s.block_rows;
    v.block_cols = s.block_cols;
    v.scale_row_bytes = ScaleRowBytes(s, cols);
    v.scales = scales + static_cast<size_t>(ScaleRows(s, first_row)) * v.scale_row_bytes;
  }
  return v;
}

QuantizedActs QuantizedActs::FromToken(int64_t t) const {
  QuantizedActs v = *this;
  if (v.q != nullptr) v.q += t * cols;
  if (v.q16 != nullptr) v.q16 += t * cols;
  v.dx += t * (cols / kQBlock);
  v.corr += t * corr_stride;
  return v;
}

namespace {
bool HasInt8Dots(Isa isa, WFormat f) {
#if FT_JAX_HAVE_AVX2_PATH
  if (f != WFormat::kQ8_0 && f != WFormat::kQ4_0) return false;
  return isa == Isa::kAvx2 || (isa == Isa::kAvx512Bf16 && HaveVnni());
#else
  return false;
#endif
}

bool HasInt16Dots(Isa isa, WFormat f) { return FT_JAX_HAVE_AVX2_PATH && isa == Isa::kAvx2 && f == WFormat::kMxfp4; }
}  // namespace

bool UsesQuantizedActs(Isa isa, WFormat f, bool bf16_acts) {
  return HasInt8Dots(isa, f) || (bf16_acts && HasInt16Dots(isa, f));
}

QuantizedActs QuantizeActivations(Isa isa, WFormat f, const float* x, int64_t cols, int64_t T,
                                  std::vector<uint8_t>& storage) {
  const bool int16 = HasInt16Dots(isa, f);
  if (!(int16 || HasInt8Dots(isa, f)) || cols % kQBlock != 0) {
    throw std::invalid_argument("QuantizeActivations: no integer dots for this format, level and " +
                                std::to_string(cols) + " columns");
  }
  QuantizedActs v;
  v.isa = isa;
  v.format = f;
  v.cols = cols;
  const int64_t nb = cols / kQBlock;
#if FT_JAX_HAVE_AVX2_PATH
  v.corr_stride = isa == Isa::kAvx512Bf16 ? Int8Corrections(f, nb) : 0;
#endif
  // dx [T, nb] f32, corr [T, corr_stride] i32, then q [T, cols] i8 or q16 [T, cols] i16
  const size_t words = static_cast<size_t>(T * (nb + v.corr_stride));
  const size_t code_bytes = static_cast<size_t>(T * cols) * (int16 ? 2 : 1);
  if (storage.size() < 4 * words + code_bytes) storage.resize(4 * words + code_bytes);
  float* dx = reinterpret_cast<float*>(storage.data());
  int32_t* corr = reinterpret_cast<int32_t*>(dx + T * nb);
  v.dx = dx, v.corr = corr;
#if FT_JAX_HAVE_AVX2_PATH
  if (int16) {
    int16_t* q16 = reinterpret_cast<int16_t*>(storage.data() + 4 * words);  // 4-byte aligned
    v.q16 = q16;
    for (int64_t t = 0; t < T; ++t) QuantizeMxfp4ActsAvx2(x + t * cols, cols, q16 + t * cols, dx + t * nb);
    return v;
  }
  int8_t* q = reinterpret_cast<int8_t*>(storage.data() + 4 * words);
  v.q = q;
  if (isa == Isa::kAvx512Bf16) {
    QuantizeActsTokens(f, x, cols, T, q, dx, corr);
  } else {
    for (int64_t t = 0; t < T; ++t) QuantizeActsAvx2(x + t * cols, cols, q + t * cols, dx + t * nb);
  }
#endif
  return v;
}

void DotRowsView(Isa isa, const MatrixView& w, int64_t r0, int64_t r1, const float* x, const uint16_t* xb,
                 int64_t xb_stride, int64_t T, float* out, int64_t out_stride, const QuantizedActs* qx) {
  const WFormat acts = ActivationFormat(w.format, w.interleave);
  if (qx != nullptr && (qx->isa != isa || qx->format != acts || qx->cols != w.cols)) {
    throw std::invalid_argument("DotRowsView: activations quantized for another level, format or width");
  }
  thread_local std::vector<uint8_t> qx_storage;  // x quantized here when the caller did not
  Scratch<uint8_t> keep_qx(qx_storage, 0);
  QuantizedActs own;
  if (qx == nullptr && UsesQuantizedActs(isa, acts, xb != nullptr)) {
    own = QuantizeActivations(isa, acts, x, w.cols, T, qx_storage);
    qx = &own;
  }
  if (w.interleave > 1) return DotRowsQ4x16(isa, w, r0, r1, x, T, out, out_stride, qx);
  if (w.format == WFormat::kF32) {
    return DotRows<float>(isa, reinterpret_cast<const float*>(w.data), w.cols, r0, r1, x, xb, xb_stride, T, out,
                          out_stride);
  }
  if (w.format == WFormat::kBF16) {
    const uint16_t* data = reinterpret_cast<const uint16_t*>(w.data);
#if FT_JAX_HAVE_AVX2_PATH
    // many tokens: register tiles, bit for bit the dots of DotRows' bf16 x bf16 path (gemm_bf16.h)
    if (isa == Isa::kAvx512Bf16 && xb != nullptr && T >= kBf16TileMinTokens) {
      return DotRowsBf16Tiled(data, w.cols, r0, r1, xb, xb_stride, T, out, out_stride);
    }
#endif
    return DotRows<uint16_t>(isa, data, w.cols, r0, r1, x, xb, xb_stride, T, out, out_stride);
  }
#if FT_JAX_HAVE_AVX2_PATH
  if (isa == Isa::kAvx512Bf16) return DotRowsAvx512(w, r0, r1, x, xb, xb_stride, T, out, out_stride, qx);
  if (isa == Isa::kAvx2 && w.format == WFormat::kQ8_0) {
    return DotRowsInt8Avx2<WFormat::kQ8_0>(w, r0, r1, T, out, out_stride, *qx);
  }
  if (isa == Isa::kAvx2 && w.format == WFormat::kQ4_0) {
    return DotRowsInt8Avx2<WFormat::kQ4_0>(w, r0, r1, T, out, out_stride, *qx);
  }
  if (isa == Isa::kAvx2 && w.format == WFormat::kMxfp4) {
    if (qx != nullptr) return DotRowsMxfp4Int16Avx2(w, r0, r1, T, out, out_stride, *qx);
    return DotRowsMxfp4Avx2(w, r0, r1, x, T, out, out_stride);
  }
  if (isa == Isa::kAvx2 && w.format == WFormat::kFp8) return DotRowsFp8Avx2(w, r0, r1, x, T, out, out_stride);
#endif
  thread_local std::vector<float> row_storage;  // one dequantized row: cols floats (tens of KiB at most)
  if (row_storage.size() < static_cast<size_t>(w.cols)) row_storage.resize(w.cols);
  float* row = row_storage.data();
  for (int64_t r = r0; r < r1; ++r) {
    DequantizeRow(isa, w, r, row);
    for (int64_t t = 0; t < T; ++t) out[t * out_stride + r] = DotF32(isa, row, x + t * w.cols, w.cols);
  }
}

}  // namespace ft_jax
