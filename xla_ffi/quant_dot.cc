#include "xla_ffi/quant_dot.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "xla_ffi/common.h"
#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/host_bank.h"

#if FT_JAX_HAVE_AVX2_PATH
#define FT_JAX_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#define FT_JAX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define FT_JAX_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
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
      for (int64_t c0 = 0; c0 < w.cols; c0 += w.block_cols) {
        const int64_t end = std::min(w.cols, c0 + w.block_cols);
        const float s = sc[c0 / w.block_cols];
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

// The AVX-512 level. Blocks of 32 (q8_0, q4_0, mxfp4) decode to two vectors of 16: q8_0 and q4_0 in element order
// (q4_0: low nibbles = elements 0..15, high = 16..31); mxfp4 as low nibbles (elements 0, 2, .., 30) then high
// nibbles (1, 3, .., 31), its activations permuted alike once per call (PermuteMxfp4), so no lane shuffle per block.
// A row's f16 / E8M0 scales are converted first (RowScales). With one token the decoded vectors go straight into the
// fused multiply-adds (DotBlocks, DotFp8); with more, a row is decoded once into a buffer (DequantBlocks,
// DequantAvx512) that DotRowAvx512 reads per token. Both run the same arithmetic in the same order (8 accumulators
// of 16 lanes over chunks of 128 elements, then single vectors into accumulator 0, then TailSum), so a token's result
// does not depend on how many tokens share the call.

// The scalar tail of a dot: s + w[0] x[0] + ... + w[n-1] x[n-1], left to right (one function for every caller, so
// every caller rounds it alike).
__attribute__((noinline)) float TailSum(float s, const float* w, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) s += w[i] * x[i];
  return s;
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

template <WFormat F>
FT_JAX_AVX512 void DequantBlocks(const uint8_t* row, const float* sf, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b) {
    __m512 v0, v1;
    DecodeBlock<F>(row, sf, b, &v0, &v1);
    _mm512_storeu_ps(out + 32 * b, v0);
    _mm512_storeu_ps(out + 32 * b + 16, v1);
  }
}

// DotRowAvx512(DequantBlocks(row), x) without the buffer.
template <WFormat F>
FT_JAX_AVX512 float DotBlocks(const uint8_t* row, const float* sf, int64_t nb, const float* x) {
  __m512 acc[kAccumulators];
  for (int a = 0; a < kAccumulators; ++a) acc[a] = _mm512_setzero_ps();
  static_assert(kAccumulators == 8, "a chunk of 128 elements is 4 blocks");
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    for (int q = 0; q < 4; ++q) {
      __m512 v0, v1;
      DecodeBlock<F>(row, sf, b + q, &v0, &v1);
      const float* xb = x + 32 * (b + q);
      acc[2 * q] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xb), acc[2 * q]);
      acc[2 * q + 1] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xb + 16), acc[2 * q + 1]);
    }
  }
  for (; b < nb; ++b) {
    __m512 v0, v1;
    DecodeBlock<F>(row, sf, b, &v0, &v1);
    acc[0] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x + 32 * b), acc[0]);
    acc[0] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x + 32 * b + 16), acc[0]);
  }
  return ReduceAcc(acc);  // no tail: rows are whole blocks
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
  for (int64_t c0 = 0; c0 < w.cols; c0 += w.block_cols) {
    const int64_t end = std::min(w.cols, c0 + w.block_cols);
    const float s = sc[c0 / w.block_cols];
    const __m512 s256 = _mm512_set1_ps(s * 256.0f);
    int64_t c = c0;
    for (; c + 16 <= end; c += 16) _mm512_storeu_ps(out + c, DecodeFp8(row + c, s256));
    for (; c < end; ++c) out[c] = tab.e4m3[row[c]] * s;
  }
}

// DotRowAvx512(DequantFp8Avx512(row), x) without the buffer, for block_cols a multiple of 128 (a chunk of 128
// elements, and so every vector, then lies in one scale block). Sets *nan (and the result means nothing) when the row
// holds a NaN code: the caller then takes DequantFp8Avx512's table decode (the check rides on the decode's loads).
FT_JAX_AVX512 float DotFp8(const MatrixView& w, const uint8_t* row, const float* sc, const float* x, bool* nan) {
  const int64_t bc = w.block_cols, len = w.cols;
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  __mmask64 any = 0;
  __m512 acc[kAccumulators];
  for (int a = 0; a < kAccumulators; ++a) acc[a] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 128 <= len; i += 128) {
    const __m512i b0 = _mm512_loadu_si512(row + i), b1 = _mm512_loadu_si512(row + i + 64);
    any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(b0, low7), low7) |
           _mm512_cmpeq_epi8_mask(_mm512_and_si512(b1, low7), low7);
    const __m512 s256 = _mm512_set1_ps(sc[i / bc] * 256.0f);
    for (int a = 0; a < kAccumulators; ++a)
      acc[a] = _mm512_fmadd_ps(DecodeFp8(row + i + 16 * a, s256), _mm512_loadu_ps(x + i + 16 * a), acc[a]);
  }
  bool has_nan = any != 0;
  for (int64_t c = i; c < len; ++c) has_nan |= (row[c] & 0x7F) == 0x7F;
  *nan = has_nan;
  for (; i + 16 <= len; i += 16)
    acc[0] = _mm512_fmadd_ps(DecodeFp8(row + i, _mm512_set1_ps(sc[i / bc] * 256.0f)), _mm512_loadu_ps(x + i), acc[0]);
  float tail[16];
  const Tables& tab = Tab();
  for (int64_t c = i; c < len; ++c) tail[c - i] = tab.e4m3[row[c]] * sc[c / bc];
  return TailSum(ReduceAcc(acc), tail, x + i, len - i);
}

// mxfp4 activations in the order its blocks decode: per block, elements 0, 2, .., 30 then 1, 3, .., 31.
void PermuteMxfp4(const float* x, int64_t cols, float* xp) {
  for (int64_t b = 0; b < cols / kQBlock; ++b)
    for (int j = 0; j < 16; ++j) {
      xp[32 * b + j] = x[32 * b + 2 * j];
      xp[32 * b + 16 + j] = x[32 * b + 2 * j + 1];
    }
}

template <WFormat F>
FT_JAX_AVX512 void DotRowsBlocks(const MatrixView& w, int64_t r0, int64_t r1, const float* x, int64_t T, float* out,
                                 int64_t out_stride, float* sf, float* buf) {
  const int64_t nb = w.cols / kQBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = RowData(w, r);
    RowScales(F, ScaleRow(w, r), nb, sf);
    if (T == 1) {
      out[r] = DotBlocks<F>(row, sf, nb, x);
      continue;
    }
    DequantBlocks<F>(row, sf, nb, buf);
    for (int64_t t = 0; t < T; ++t) out[t * out_stride + r] = DotRowAvx512(buf, x + t * w.cols, w.cols);
  }
}

// q8_0 / q4_0 with int8 activations (AVX-512 VNNI), as llama.cpp's ggml_vec_dot_q8_0_q8_0 / q4_0_q8_0: each token's
// activations are quantized per block of 32 to int8 with a float32 scale dx = max |x| / 127 (round to nearest even),
// a block's integer dot is exact (VPDPBUSD), then scaled by dw * dx in float32. Error (docs/design_parts/kern.md):
// |x - dx q| <= dx / 2 per element, so a row adds at most sum_b (max_b |x| / 254) sum_{i in b} |w_i| to the float32
// dot's own error.
struct Int8Acts {
  uint8_t* q;   // [T, cols]: q8_0: q + 128 (unsigned, element order); q4_0: q (signed) in the q4_0 pair order
  float* dx;    // [T, nb] block scales
  float* corr;  // [T, nb] q4_0: -8 dx_b sum_i q_i (the "- 8" of the weights, applied per row as a dot with dw)
};

// q4_0 activation order (matches the weight bytes of blocks 4g .. 4g + 3 split into low then high nibbles):
// x[b0 0..15], x[b1 0..15], x[b2 0..15], x[b3 0..15], x[b0 16..31], .., x[b3 16..31]; of the last nb % 4 blocks a
// pair as x[b0 0..15], x[b1 0..15], x[b0 16..31], x[b1 16..31], a single block in element order.
FT_JAX_VNNI void QuantizeActs(WFormat f, const float* x, int64_t cols, uint8_t* q, float* dx, float* corr) {
  const int64_t nb = cols / kQBlock;
  alignas(64) int8_t tmp[32];
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(d == 0.0f ? 0.0f : 1.0f / d);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    const __m128i lo = _mm512_cvtsepi32_epi8(q0), hi = _mm512_cvtsepi32_epi8(q1);
    dx[b] = d;
    if (f == WFormat::kQ8_0) {  // q + 128 = q ^ 0x80 as a byte
      const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm_xor_si128(lo, flip));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm_xor_si128(hi, flip));
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp + 16), hi);
    corr[b] = -8.0f * d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    // Groups of 4 blocks (low halves of blocks 4g..4g+3, then their high halves), then a pair, then a single block.
    const int64_t quads = nb / 4, rest = nb - 4 * quads;
    if (b < 4 * quads) {
      std::memcpy(q + 128 * (b / 4) + 16 * (b % 4), tmp, 16);
      std::memcpy(q + 128 * (b / 4) + 64 + 16 * (b % 4), tmp + 16, 16);
    } else if (rest >= 2 && b < 4 * quads + 2) {
      const int64_t j = b - 4 * quads;
      std::memcpy(q + 128 * quads + 16 * j, tmp, 16);
      std::memcpy(q + 128 * quads + 32 + 16 * j, tmp + 16, 16);
    } else {
      std::memcpy(q + 32 * b, tmp, 32);
    }
  }
}

// dot of one q8_0 / q4_0 row with one token's int8 activations: sum_b sdx_b (w_b . q_b), sdx_b = dw_b dx_b
// (q4_0: + sum_b dw_b corr_b).
template <WFormat F>
FT_JAX_VNNI float DotInt8(const uint8_t* row, const float* sw, const float* sdx, int64_t nb, const uint8_t* q,
                          const float* corr) {
  const int64_t nb_all = nb;
  __m512 acc[4];
  for (int a = 0; a < 4; ++a) acc[a] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  int64_t p = 0;
  if constexpr (F == WFormat::kQ4_0) {  // 4 blocks per step: their low nibbles, then their high nibbles
    const __m512i m4z = _mm512_set1_epi8(0x0F);
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    int64_t g = 0;
    for (; 4 * g + 4 <= nb; ++g) {
      const __m512i wb = _mm512_loadu_si512(row + 64 * g);
      const __m512i lo = _mm512_and_si512(wb, m4z), hi = _mm512_and_si512(_mm512_srli_epi16(wb, 4), m4z);
      const __m512i isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512(q + 128 * g)), hi,
                                               _mm512_loadu_si512(q + 128 * g + 64));
      const __m512 s = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(sdx + 4 * g)));
      acc[g % 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[g % 4]);
    }
    // the pair and single block below start at block 4g: shift the pointers so that they see them as blocks 0, 1
    row += 64 * g;
    q += 128 * g;
    sdx += 4 * g;
    nb -= 4 * g;
  }
  for (; 2 * p + 2 <= nb; ++p) {
    __m512i isum;
    __mmask16 second;  // lanes of block 2p + 1
    if constexpr (F == WFormat::kQ8_0) {
      const __m512i w = _mm512_loadu_si512(row + 64 * p);
      const __m512i xu = _mm512_loadu_si512(q + 64 * p);
      // (q + 128) . w - 128 sum(w): VPDPBUSD multiplies unsigned by signed bytes
      isum = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xu, w),
                              _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, _mm512_set1_epi8(1), w), 7));
      second = 0xFF00;
    } else {
      const __m256i wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * p));
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(wb, m4)),
                                           _mm256_and_si256(_mm256_srli_epi16(wb, 4), m4), 1);
      isum = _mm512_dpbusd_epi32(zero, w, _mm512_loadu_si512(q + 64 * p));
      second = 0xF0F0;
    }
    const __m512 s = _mm512_mask_blend_ps(second, _mm512_set1_ps(sdx[2 * p]), _mm512_set1_ps(sdx[2 * p + 1]));
    acc[p % 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[p % 4]);
  }
  if (2 * p < nb) {  // an odd last block
    const int64_t b = 2 * p;
    __m256i isum;
    const __m256i z = _mm256_setzero_si256();
    if constexpr (F == WFormat::kQ8_0) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
      const __m256i xu = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
      isum = _mm256_sub_epi32(_mm256_dpbusd_epi32(z, xu, w),
                              _mm256_slli_epi32(_mm256_dpbusd_epi32(z, _mm256_set1_epi8(1), w), 7));
    } else {
      const __m128i wb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
      const __m128i m4x = _mm_set1_epi8(0x0F);
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(wb, 4), m4x), _mm_and_si128(wb, m4x));
      isum = _mm256_dpbusd_epi32(z, w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b)));
    }
    const __m512 f = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(isum));
    acc[0] = _mm512_fmadd_ps(f, _mm512_set1_ps(sdx[b]), acc[0]);
  }
  acc[0] = _mm512_add_ps(acc[0], acc[2]);
  acc[1] = _mm512_add_ps(acc[1], acc[3]);
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
  if constexpr (F == WFormat::kQ4_0) sum += DotRowAvx512(sw, corr, nb_all);
  return sum;
}

template <WFormat F>
FT_JAX_VNNI void DotRowsInt8(const MatrixView& w, int64_t r0, int64_t r1, const float* x, int64_t T, float* out,
                             int64_t out_stride) {
  const int64_t cols = w.cols, nb = cols / kQBlock;
  // row scales [nb], their products with dx [nb], dx [T, nb], corr [T, nb], activations [T, cols] bytes
  thread_local std::vector<float> storage;
  Scratch<float> scratch(storage, static_cast<size_t>(nb * (2 + 2 * T) + (T * cols + 3) / 4));
  float* sw = scratch.data();
  float* sdx = sw + nb;
  float* dx = sdx + nb;
  float* corr = dx + T * nb;
  uint8_t* q = reinterpret_cast<uint8_t*>(corr + T * nb);
  for (int64_t t = 0; t < T; ++t) QuantizeActs(F, x + t * cols, cols, q + t * cols, dx + t * nb, corr + t * nb);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = RowData(w, r);
    RowScales(F, ScaleRow(w, r), nb, sw);
    for (int64_t t = 0; t < T; ++t) {
      const float* dxt = dx + t * nb;
      int64_t b = 0;
      for (; b + 16 <= nb; b += 16)
        _mm512_storeu_ps(sdx + b, _mm512_mul_ps(_mm512_loadu_ps(sw + b), _mm512_loadu_ps(dxt + b)));
      for (; b < nb; ++b) sdx[b] = sw[b] * dxt[b];
      out[t * out_stride + r] = DotInt8<F>(row, sw, sdx, nb, q + t * cols, corr + t * nb);
    }
  }
}

bool HaveVnni() {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
}

// DotRowsView's block formats at the AVX-512 level.
FT_JAX_AVX512 void DotRowsAvx512(const MatrixView& w, int64_t r0, int64_t r1, const float* x, int64_t T, float* out,
                                 int64_t out_stride) {
  thread_local std::vector<float> storage;  // a row buffer [cols], row scales [cols / 32], mxfp4's x [T, cols]
  const size_t cols = static_cast<size_t>(w.cols);
  const size_t need = cols + cols / kQBlock + (w.format == WFormat::kMxfp4 ? static_cast<size_t>(T) * cols : 0);
  Scratch<float> scratch(storage, need);
  float* buf = scratch.data();
  float* sf = buf + cols;
  switch (w.format) {
    case WFormat::kQ8_0:
      if (HaveVnni()) return DotRowsInt8<WFormat::kQ8_0>(w, r0, r1, x, T, out, out_stride);
      return DotRowsBlocks<WFormat::kQ8_0>(w, r0, r1, x, T, out, out_stride, sf, buf);
    case WFormat::kQ4_0:
      if (HaveVnni()) return DotRowsInt8<WFormat::kQ4_0>(w, r0, r1, x, T, out, out_stride);
      return DotRowsBlocks<WFormat::kQ4_0>(w, r0, r1, x, T, out, out_stride, sf, buf);
    case WFormat::kMxfp4: {
      float* xp = sf + cols / kQBlock;
      for (int64_t t = 0; t < T; ++t) PermuteMxfp4(x + t * w.cols, w.cols, xp + t * w.cols);
      return DotRowsBlocks<WFormat::kMxfp4>(w, r0, r1, xp, T, out, out_stride, sf, buf);
    }
    default:
      break;
  }
  const bool fused = T == 1 && w.block_cols % 128 == 0;
  for (int64_t r = r0; r < r1; ++r) {
    if (fused) {
      bool nan;
      out[r] = DotFp8(w, RowData(w, r), reinterpret_cast<const float*>(ScaleRow(w, r)), x, &nan);
      if (!nan) continue;
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

const char* WeightSpec::name() const {
  if (!quantized) return "float";
  switch (format) {
    case WFormat::kQ8_0:
      return "q8_0";
    case WFormat::kQ4_0:
      return "q4_0";
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
  } else if (name == "q8_0" || name == "q4_0" || name == "mxfp4") {
    s.quantized = true;
    s.format = name == "q8_0" ? WFormat::kQ8_0 : name == "q4_0" ? WFormat::kQ4_0 : WFormat::kMxfp4;
    if (block_rows != 1 || block_cols != kQBlock) {
      return "weight_format '" + std::string(name) + "' has blocks (1, 32), got " + shape;
    }
  } else if (name == "fp8") {
    s.quantized = true;
    s.format = WFormat::kFp8;
    if (block_rows < 1 || block_cols < 1) return "weight_format 'fp8' needs a positive block shape, got " + shape;
  } else {
    return "unknown weight_format '" + std::string(name) + "' (expected 'float', 'q8_0', 'q4_0', 'mxfp4' or 'fp8')";
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
  if (s.quantized) {
    v.block_rows = s.block_rows;
    v.block_cols = s.block_cols;
    v.scale_row_bytes = ScaleRowBytes(s, cols);
    v.scales = scales + static_cast<size_t>(ScaleRows(s, first_row)) * v.scale_row_bytes;
  }
  return v;
}

void DotRowsView(Isa isa, const MatrixView& w, int64_t r0, int64_t r1, const float* x, const uint16_t* xb, int64_t T,
                 float* out, int64_t out_stride) {
  if (w.format == WFormat::kF32) {
    return DotRows<float>(isa, reinterpret_cast<const float*>(w.data), w.cols, r0, r1, x, xb, T, out, out_stride);
  }
  if (w.format == WFormat::kBF16) {
    return DotRows<uint16_t>(isa, reinterpret_cast<const uint16_t*>(w.data), w.cols, r0, r1, x, xb, T, out,
                             out_stride);
  }
#if FT_JAX_HAVE_AVX2_PATH
  if (isa == Isa::kAvx512Bf16) return DotRowsAvx512(w, r0, r1, x, T, out, out_stride);
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
