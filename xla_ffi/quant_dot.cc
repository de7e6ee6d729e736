#include "xla_ffi/quant_dot.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/host_bank.h"

#if FT_JAX_HAVE_AVX2_PATH
#define FT_JAX_AVX2_F16C __attribute__((target("avx2,fma,f16c")))
#define FT_JAX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
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

// 16 codes (int32 lanes, low 4 bits used) looked up in the 16-entry table lutd.
FT_JAX_AVX512 inline void Store16Lut(float* out, __m128i codes, __m512 lutd) {
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), lutd));
}

FT_JAX_AVX512 void DequantAvx512(const MatrixView& w, int64_t r, float* out) {
  const Tables& tab = Tab();
  const uint8_t* row = RowData(w, r);
  const uint8_t* srow = ScaleRow(w, r);
  const int64_t nb = w.cols / kQBlock;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  switch (w.format) {
    case WFormat::kQ8_0: {
      const uint16_t* d = reinterpret_cast<const uint16_t*>(srow);
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 s = _mm512_set1_ps(HalfToFloat(d[b]));
        for (int h = 0; h < 2; ++h) {
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * b + 16 * h));
          _mm512_storeu_ps(out + 32 * b + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s));
        }
      }
      return;
    }
    case WFormat::kQ4_0: {
      const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
      const uint16_t* d = reinterpret_cast<const uint16_t*>(srow);
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 lutd = _mm512_mul_ps(lut, _mm512_set1_ps(HalfToFloat(d[b])));  // exact: d * (q - 8)
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b)));
        _mm512_storeu_ps(out + 32 * b, _mm512_permutexvar_ps(idx, lutd));  // low nibbles: elements 0..15
        _mm512_storeu_ps(out + 32 * b + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), lutd));
      }
      return;
    }
    case WFormat::kMxfp4: {
      const __m512 lut = _mm512_loadu_ps(kFp4);
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 lutd = _mm512_mul_ps(lut, _mm512_set1_ps(tab.e8m0[srow[b]]));  // exact: a power of two
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
        const __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        Store16Lut(out + 32 * b, _mm_unpacklo_epi8(lo, hi), lutd);  // elements 0..15 (2j, 2j + 1 interleaved)
        Store16Lut(out + 32 * b + 16, _mm_unpackhi_epi8(lo, hi), lutd);
      }
      return;
    }
    case WFormat::kFp8: {
      const float* sc = reinterpret_cast<const float*>(srow);
      const __m256i low7 = _mm256_set1_epi16(0x7F);
      const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
      for (int64_t c0 = 0; c0 < w.cols; c0 += w.block_cols) {
        const int64_t end = std::min(w.cols, c0 + w.block_cols);
        const float s = sc[c0 / w.block_cols];
        const __m512 s256 = _mm512_set1_ps(s * 256.0f);
        int64_t c = c0;
        for (; c + 16 <= end; c += 16) {
          const __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
          const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(t, 8), 1),
                                             _mm256_set1_epi16(static_cast<short>(0xBFFF)));
          const __mmask16 is_nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(t, low7), low7);
          _mm512_storeu_ps(out + c, _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), s256), is_nan, nan));
        }
        for (; c < end; ++c) out[c] = tab.e4m3[row[c]] * s;
      }
      return;
    }
    default:
      return;
  }
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
  for (int width = A / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] = _mm512_add_ps(acc[j], acc[j + width]);
  float s = _mm512_reduce_add_ps(acc[0]);
  for (; i < len; ++i) s += w[i] * x[i];
  return s;
}
#endif

void DequantizeRow(Isa isa, const MatrixView& w, int64_t r, float* out) {
#if FT_JAX_HAVE_AVX2_PATH
  if (isa == Isa::kAvx512Bf16) return DequantAvx512(w, r, out);
  if (isa == Isa::kAvx2) return DequantAvx2(w, r, out);
#endif
  DequantGeneric(w, r, out);
}

float DotF32(Isa isa, const float* w, const float* x, int64_t len) {
#if FT_JAX_HAVE_AVX2_PATH
  if (isa == Isa::kAvx512Bf16) return DotRowAvx512(w, x, len);
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
  if (s.block_rows == 1 && cols % s.block_cols != 0) {
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
  thread_local std::vector<float> row_storage;  // one dequantized row: cols floats (tens of KiB at most)
  if (row_storage.size() < static_cast<size_t>(w.cols)) row_storage.resize(w.cols);
  float* row = row_storage.data();
  for (int64_t r = r0; r < r1; ++r) {
    DequantizeRow(isa, w, r, row);
    for (int64_t t = 0; t < T; ++t) out[t * out_stride + r] = DotF32(isa, row, x + t * w.cols, w.cols);
  }
}

}  // namespace ft_jax
