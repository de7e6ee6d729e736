// q8_0 / q4_0 quantizer (quantize.h). The float32 arithmetic is numpy's, step by step (gguf/quants.py, which is
// bit-exact with ggml-quants.c): every product and sum is rounded on its own, so contraction into FMA is switched
// off for this file whatever the build flags (-march=native would otherwise allow x * id + 8.5f -> one fma).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "xla_ffi/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace ft_jax {
namespace {

inline uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// float32 -> int32 as x86's cvttss2si (what numpy's float -> int8 / uint8 casts compile to): truncation, and
// INT32_MIN (low byte 0) for NaN, +-inf and values outside the int32 range.
inline int32_t TruncToInt32(float v) {
  if (!(std::fabs(v) < 2147483648.0f)) return INT32_MIN;
  return static_cast<int32_t>(v);
}

// gguf's np_roundf (= C roundf: halves away from zero) of v [32] followed by numpy's cast to int8 (the low byte of
// cvttss2si: 0 for NaN, +-inf and |v| >= 2^31). Branch-free selects, so the compiler vectorizes the loop.
inline void RoundToI8(const float* v, int8_t* q) {
  for (int j = 0; j < kQuantBlock; ++j) {
    const bool in_range = std::fabs(v[j]) < 2147483648.0f;  // false for NaN
    const float x = in_range ? v[j] : 0.0f;
    int32_t i = static_cast<int32_t>(x);          // truncation
    const float frac = x - static_cast<float>(i);  // exact: |x| < 2^31, and x is an integer once |x| >= 2^23
    i += static_cast<int32_t>(frac >= 0.5f) - static_cast<int32_t>(frac <= -0.5f);
    q[j] = static_cast<int8_t>(static_cast<uint8_t>(static_cast<uint32_t>(in_range ? i : 0)));
  }
}

// One row of float32 values [cols] from the source row.
void LoadRow(const void* src, QuantSrc type, int64_t row, int64_t cols, float* out) {
  if (type == QuantSrc::kF32) {
    std::memcpy(out, static_cast<const float*>(src) + row * cols, cols * 4);
  } else if (type == QuantSrc::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + row * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = FromBits(static_cast<uint32_t>(s[c]) << 16);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + row * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = HalfBitsToFloat(s[c]);
  }
}

// Index of the first element of largest |x| in a block (numpy's argmax of abs: first one on ties; a NaN counts as
// larger than everything, the first NaN wins). |x| is compared as its bits (monotonic for non-negative floats).
inline int ArgMaxAbs(const float* x) {
  int best = 0;
  uint32_t best_key = 0;
  for (int j = 0; j < kQuantBlock; ++j) {
    const uint32_t key = std::min<uint32_t>(Bits(x[j]) & 0x7fffffffu, 0x7f800001u);  // every NaN -> one key
    if (key > best_key) {
      best_key = key;
      best = j;
    }
  }
  return best;
}

// q8_0 (quantize_row_q8_0_ref): d = amax / 127, id = d ? 1 / d : 0, q = roundf(x * id).
void Q8Row(const float* x, int64_t cols, int8_t* q, uint16_t* scales) {
  for (int64_t b = 0; b < cols / kQuantBlock; ++b, x += kQuantBlock, q += kQuantBlock) {
    int32_t key = 0;  // max |x| as bits (non-negative floats order as their bits); a NaN's exceed inf's
    for (int j = 0; j < kQuantBlock; ++j) key = std::max(key, static_cast<int32_t>(Bits(x[j]) & 0x7fffffffu));
    const float amax = key > 0x7f800000 ? std::fabs(x[ArgMaxAbs(x)]) : FromBits(static_cast<uint32_t>(key));
    const float d = amax / 127.0f;  // NaN: numpy's max is the first NaN, as ArgMaxAbs picks
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    float v[kQuantBlock];
    for (int j = 0; j < kQuantBlock; ++j) v[j] = x[j] * id;
    RoundToI8(v, q);
    scales[b] = FloatToHalfBits(d);
  }
}

// q4_0 (quantize_row_q4_0_ref): max = the element of largest |x| (with its sign), d = max / -8,
// id = d ? 1 / d : 0, q = min(15, (uint8)trunc(x * id + 8.5)); byte j = q[j] | q[j + 16] << 4.
void Q4Row(const float* x, int64_t cols, uint8_t* out, uint16_t* scales) {
  for (int64_t b = 0; b < cols / kQuantBlock; ++b, x += kQuantBlock, out += kQuantBlock / 2) {
    const float d = x[ArgMaxAbs(x)] / -8.0f;
    const float id = d == 0.0f ? 0.0f : 1.0f / d;
    uint8_t q[kQuantBlock];
    for (int j = 0; j < kQuantBlock; ++j) {
      const float scaled = x[j] * id;  // rounded to float32 before the add (numpy: two operations)
      const float t = scaled + 8.5f;
      const uint8_t v = static_cast<uint8_t>(static_cast<uint32_t>(TruncToInt32(t)));
      q[j] = std::min<uint8_t>(v, 15);  // numpy's .astype(np.uint8).clip(0, 15)
    }
    for (int j = 0; j < kQuantBlock / 2; ++j) out[j] = static_cast<uint8_t>(q[j] | (q[j + kQuantBlock / 2] << 4));
    scales[b] = FloatToHalfBits(d);
  }
}

void QuantizeRange(const void* src, QuantSrc type, int64_t begin, int64_t end, int64_t cols, QuantFormat fmt,
                   void* data, uint16_t* scales) {
  std::vector<float> row(cols);
  const int64_t groups = cols / kQuantBlock;
  for (int64_t r = begin; r < end; ++r) {
    LoadRow(src, type, r, cols, row.data());
    if (fmt == QuantFormat::kQ8_0) {
      Q8Row(row.data(), cols, static_cast<int8_t*>(data) + r * cols, scales + r * groups);
    } else {
      Q4Row(row.data(), cols, static_cast<uint8_t*>(data) + r * (cols / 2), scales + r * groups);
    }
  }
}

}  // namespace

uint16_t FloatToHalfBits(float x) {
  const uint32_t u = Bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a & 0x7fffffu) >> 13);  // NaN, quieted
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (half-way above 65504) and inf: inf
  const uint32_t e = a >> 23;                     // biased float32 exponent
  if (e >= 113) {                                 // >= 2^-14: a normal half
    const uint32_t m = a & 0x7fffffu;
    uint32_t h = ((e - 112) << 10) | (m >> 13);
    const uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) ++h;  // may carry into the exponent: still right
    return sign | static_cast<uint16_t>(h);
  }
  if (e < 102) return sign;  // < 2^-25: rounds to (signed) zero (2^-25 itself is the tie to even 0, handled below)
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;  // value = m * 2^(e - 150) = (m >> shift) units of 2^-24
  const uint32_t shift = 126 - e;                  // 14..24
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1))) ++h;  // 1024 = the smallest normal half, encoded the same way
  return sign | static_cast<uint16_t>(h);
}

float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 31) return FromBits(sign | 0x7f800000u | (m << 13));  // inf / NaN (payload kept)
  if (e != 0) return FromBits(sign | ((e + 112) << 23) | (m << 13));
  const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24: exact (a normal float32)
  return sign ? -v : v;
}

std::string QuantizeRows(const void* src, QuantSrc src_type, int64_t rows, int64_t cols, QuantFormat fmt,
                         void* data, uint16_t* scales, int threads) {
  if (fmt != QuantFormat::kQ8_0 && fmt != QuantFormat::kQ4_0) {
    return "unknown quantization format code " + std::to_string(static_cast<int32_t>(fmt)) + " (0 = q8_0, 1 = q4_0)";
  }
  if (src_type != QuantSrc::kF32 && src_type != QuantSrc::kBF16 && src_type != QuantSrc::kF16) {
    return "unknown source type code " + std::to_string(static_cast<int32_t>(src_type)) +
           " (0 = float32, 1 = bfloat16, 2 = float16)";
  }
  if (rows < 0 || cols < 0 || cols % kQuantBlock) {
    return "a [" + std::to_string(rows) + ", " + std::to_string(cols) + "] matrix: the row length must be a " +
           "non-negative multiple of 32";
  }
  if (rows == 0 || cols == 0) return "";
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // At least 1 Mi values per thread: below that a thread's start costs more than it saves.
  const int64_t by_size = std::max<int64_t>(1, rows * cols / (int64_t{1} << 20));
  const int n = static_cast<int>(std::min<int64_t>({threads, by_size, rows}));
  if (n == 1) {
    QuantizeRange(src, src_type, 0, rows, cols, fmt, data, scales);
    return "";
  }
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  const int64_t step = (rows + n - 1) / n;
  for (int t = 1; t < n; ++t) {
    const int64_t begin = std::min(rows, t * step), end = std::min(rows, begin + step);
    pool.emplace_back(QuantizeRange, src, src_type, begin, end, cols, fmt, data, scales);
  }
  QuantizeRange(src, src_type, 0, std::min(rows, step), cols, fmt, data, scales);
  for (auto& th : pool) th.join();
  return "";
}

}  // namespace ft_jax
