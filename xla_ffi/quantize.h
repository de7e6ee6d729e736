// q8_0 / q4_0 quantization of float matrices with llama.cpp's reference rounding (ggml-quants.c
// quantize_row_q8_0_ref / quantize_row_q4_0_ref): the bytes equal gguf.quants.quantize's (gguf/quants.py, numpy on
// x86-64) for every input, non-finite ones included. Layouts as ft_jax/weight_formats.py: q8_0 data i8 [rows, cols],
// q4_0 data u8 [rows, cols / 2] (byte j of a 32-block: element j in the low nibble, j + 16 in the high one), scales
// f16 bits [rows, cols / 32]. No nanobind or Python dependency (module.cc binds it as _ffi.quantize_rows).
#pragma once

#include <cstdint>
#include <string>

namespace ft_jax {

enum class QuantSrc : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };  // source element type (bf16 / f16 as u16 bits)
enum class QuantFormat : int32_t { kQ8_0 = 0, kQ4_0 = 1 };

constexpr int64_t kQuantBlock = 32;  // elements per q8_0 / q4_0 block

// float32 -> IEEE binary16 bits, round to nearest even: subnormal halves, overflow to inf (|x| >= 65520), NaN quieted
// with its sign and top payload bits (as numpy's astype(np.float16) and F16C's vcvtps2ph). Integer-only, so the
// result does not depend on the FTZ/DAZ state.
uint16_t FloatToHalfBits(float x);
// IEEE binary16 bits -> float32 (exact, subnormals included).
float HalfBitsToFloat(uint16_t h);

// Quantizes the C-contiguous matrix src [rows, cols] (cols % 32 == 0) into the C-contiguous data (q8_0: i8
// [rows, cols]; q4_0: u8 [rows, cols / 2]) and scales (f16 bits [rows, cols / 32]). threads <= 0: one per hardware
// thread (std::thread::hardware_concurrency); the rows are split among them (each row is quantized on its own, so the
// bytes do not depend on the split). Returns an empty string, or the error (unknown format / source code, bad cols).
std::string QuantizeRows(const void* src, QuantSrc src_type, int64_t rows, int64_t cols, QuantFormat fmt,
                         void* data, uint16_t* scales, int threads);

}  // namespace ft_jax
