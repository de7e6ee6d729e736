// Weight matrices in every storage format of ft_jax/weight_formats.py, as the CPU kernels read them: a MatrixView
// (format, data, row bytes, scales, scale row stride, block shape, columns) and DotRowsView, the GEMV over a view that
// the expert kernel (gate, up and down projections) and the dense projection (linear.cc) share.
//
// Formats (matrix [rows, cols] = Hugging Face [out, in]; layouts as ft_jax/weight_formats.py):
//   f32, bf16  data [rows, cols]                                                  value = data
//   q8_0       data i8 [rows, cols], scales f16 [rows, cols / 32]                 value = d * q
//   q4_0       data u8 [rows, cols / 2] (byte j of a 32-block: low nibble = element j, high = element j + 16;
//              llama.cpp's block_q4_0, ggml-common.h), scales f16 [rows, cols / 32]  value = d * (q - 8)
//   mxfp4      data u8 [rows, cols / 2] (byte j: low nibble = element 2j, high = element 2j + 1; OCP Microscaling
//              Formats v1.0 / Hugging Face gpt-oss), scales u8 E8M0 [rows, cols / 32]  value = FP4_E2M1[q] * 2^(s - 127)
//   fp8        data float8_e4m3fn [rows, cols], scales f32 [ceil(rows / br), ceil(cols / bc)] (edge blocks may be
//              partial)                                                           value = data * scale
//
// Arithmetic (quant_dot.cc): a block-format row is decoded in registers (integer / table decode, one multiply by the
// block scale) to float32 values: the exact product for q8_0, q4_0 and mxfp4 (an f16 or power-of-two scale times a
// code of <= 8 bits fits a float32 mantissa), the float32 rounding of data * scale for fp8 (one rounding, as numpy's
// float32 dequantize), the same on every ISA path. The decoded vectors feed the fused multiply-adds of one or a few
// tokens at once (AVX-512; elsewhere a row is decoded once into a per-thread buffer and dotted with each token), each
// token in one fixed order, so a token's result never depends on the other tokens of a call. Activations are used
// as they arrive for mxfp4 and fp8 (they must match transformers): float32, or a bf16 model's bf16 x, with which
// fp8 / mxfp4 at the AVX-512 BF16 level decode rows to bf16 (their values are exact in bf16) for VDPBF16PS dots of
// exact products, the block scale applied to the block's partial sums. q8_0 / q4_0 at the AVX-512 VNNI and AVX2
// levels quantize each token's activations to int8 blocks of 32 as llama.cpp does (ggml_vec_dot_q8_0_q8_0 /
// q4_0_q8_0; float32 block scales here) and sum exact integer block dots (VPDPBUSD; AVX2: VPMADDUBSW + VPMADDWD)
// scaled in float32. Errors
// (docs/DESIGN.md section 15.1): float32 or bf16 activations, |err| <= gamma_{K+2} sum_i |w_i x_i| (gamma_n ~ n 2^-24);
// int8 activations add sum_b (max_b |x| / 254) sum_{i in b} |w_i|. Paths differ in the dot's summation only (fused multiply-add, lanes).
#ifndef FT_JAX_XLA_FFI_QUANT_DOT_H_
#define FT_JAX_XLA_FFI_QUANT_DOT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/isa.h"

namespace ft_jax {

enum class WFormat : int32_t { kF32, kBF16, kQ8_0, kQ4_0, kMxfp4, kFp8 };

// The weight_format attribute of the handlers ("float" | "q8_0" | "q4_0" | "q4_0x16" | "mxfp4" | "fp8") with
// block_rows / block_cols: the format of every weight matrix of a call ("float": each buffer's dtype, f32 or bf16,
// decides).
//
// "q4_0x16" is q4_0 with its rows stored in groups of kQ4Interleave (interleave = 16): the same bytes per matrix, each
// group of 16 rows written as one stream. Group g (rows 16g .. 16g + 15) takes the bytes of rows 16g.. at data +
// 16g * row_bytes: for block b, four 64-byte chunks c = 0..3 whose 4-byte word i is bytes 4c .. 4c + 3 of row
// 16g + i's block b (elements 4c .. 4c + 3 in the low nibbles, 16 + 4c .. 16 + 4c + 3 in the high ones, as q4_0
// stores them); its scales at scales + 16g * scale_row_bytes, block b's 16 f16 scales (row 16g + i's at i) at b * 16.
// So one AVX-512 VNNI pass dots 16 rows at once from one sequential stream, each row in its own int32 / float32
// lane, without a horizontal sum per row (as llama.cpp's repacked block_q4_0x8, ggml-cpu/repack.cpp; measured:
// docs/DESIGN.md sec. 20.24). A matrix in it has a multiple of 16 rows (a gate_up pair: of 16 per matrix).
constexpr int64_t kQ4Interleave = 16;

struct WeightSpec {
  bool quantized = false;
  WFormat format = WFormat::kF32;  // the block format when quantized
  int64_t block_rows = 1, block_cols = 1;
  int64_t interleave = 1;  // kQ4Interleave for "q4_0x16"
  const char* name() const;  // "float", "q8_0", "q4_0x16", ...
};

// Parses the attributes; returns "" or the problem ("unknown weight_format 'q5'", a block shape the format does not
// have: (1, 1) for float, (1, 32) for q8_0 / q4_0 / mxfp4, positive for fp8).
std::string ParseWeightSpec(std::string_view name, int64_t block_rows, int64_t block_cols, WeightSpec* out);

// The BankDType codes (host_bank.h) of a block format's data and scales.
int32_t DataDTypeCode(WFormat f);
int32_t ScaleDTypeCode(WFormat f);
// Matrix elements per data element: 2 for the packed 4-bit formats, else 1.
int64_t ValuesPerItem(WFormat f);
// Bytes of one data row of `cols` elements.
size_t DataRowBytes(WFormat f, int64_t cols);
// Rows / columns of the scale grid of a [rows, cols] matrix (0 for float formats).
int64_t ScaleRows(const WeightSpec& s, int64_t rows);
int64_t ScaleCols(const WeightSpec& s, int64_t cols);
// Bytes of one scale row of a matrix of `cols` columns.
size_t ScaleRowBytes(const WeightSpec& s, int64_t cols);

// "" or the problem of one stored matrix [rows, cols] of block format s (pair: a gate_up pair of two [rows / 2, cols]
// matrices with stacked scale grids): its data `what` (dtype code, the dims of one row / slot) and its scales
// `scale_what` (dtype code, dims). Messages name the operand, the expected dtype and shape, and what was got; cols
// that do not fit the blocks (q formats: a multiple of 32) are named too.
std::string CheckStoredMatrix(const WeightSpec& s, const std::string& what, int32_t dtype, const int64_t* dims,
                              size_t ndims, const std::string& scale_what, int32_t scale_dtype,
                              const int64_t* scale_dims, size_t scale_ndims, int64_t rows, int64_t cols, bool pair);

// One weight matrix: row r's data at data + r * row_bytes; (block formats) its scale row r / block_rows at
// scales + (r / block_rows) * scale_row_bytes, column c's scale at index c / block_cols of that row.
struct MatrixView {
  WFormat format = WFormat::kF32;
  const uint8_t* data = nullptr;
  size_t row_bytes = 0;
  const uint8_t* scales = nullptr;
  size_t scale_row_bytes = 0;
  int64_t block_rows = 1, block_cols = 1;
  int64_t cols = 0;
  int64_t interleave = 1;  // rows per interleaved group (WeightSpec::interleave; > 1: rows are not at r * row_bytes)
};

// The view of a matrix of `cols` columns stored contiguously in format f (float: f = kF32 / kBF16) with scales
// (block formats) of spec s; `first_row` rows in (the up matrix of a gate_up pair: first_row = I; its scales start
// at scale row ScaleRows(s, first_row), where the two stacked scale grids meet).
MatrixView MakeView(WFormat f, const WeightSpec& s, const uint8_t* data, const uint8_t* scales, int64_t cols,
                    int64_t first_row = 0);

// The format whose activation quantization (QuantizeActivations) the dots of format f stored with `interleave`
// (WeightSpec, MatrixView) read: q8_0's (element order) for q4_0x16, else f.
WFormat ActivationFormat(WFormat f, int64_t interleave);

// Rewrites q4_0 data u8 [rows, cols / 2] and its f16 scales [rows, cols / 32] (row layout, C-contiguous) in place
// into the q4_0x16 layout (WeightSpec). Throws std::invalid_argument unless rows % kQ4Interleave == 0 and
// cols % 32 == 0.
void InterleaveQ4Rows(uint8_t* data, uint16_t* scales, int64_t rows, int64_t cols);

// Activations quantized once per call for the integer dots, so the row tasks of one call share them instead of each
// quantizing x again (per task that was 20-40 % of a q4_0 or q8_0 matrix's time at the 40-230 rows of a task:
// docs/DESIGN.md sec. 20.9): int8 blocks for q8_0 / q4_0 weights (AVX-512 VNNI and AVX2 levels, as llama.cpp), int16
// blocks for mxfp4 weights dotted with a bf16 model's activations at the AVX2 level (docs/DESIGN.md sec. 20.16).
// Made by QuantizeActivations; FromToken(t) is the view of tokens t.. (an expert group's routes within a call's
// [routes, cols]).
struct QuantizedActs {
  Isa isa = Isa::kGeneric;
  WFormat format = WFormat::kF32;
  int64_t cols = 0;
  int64_t corr_stride = 0;        // int32 corrections per token (AVX-512 VNNI: quant_dot.cc Int8Corrections; AVX2: 0)
  const int8_t* q = nullptr;      // [T, cols] int8 codes, in the order the level's dots read them (q8_0, q4_0)
  const int16_t* q16 = nullptr;   // [T, cols] int16 codes, in the order mxfp4 blocks decode (mxfp4)
  const float* dx = nullptr;      // [T, cols / 32] float32 block scales
  const int32_t* corr = nullptr;  // [T, corr_stride]
  QuantizedActs FromToken(int64_t t) const;
};

// Whether DotRowsView dots format-f rows at level isa with quantized activations (and so reads a QuantizedActs);
// bf16_acts: the activations are a bf16 model's (bf16 values), which the int16 blocks of mxfp4 hold exactly down to
// 2^-7 of each block's largest.
bool UsesQuantizedActs(Isa isa, WFormat f, bool bf16_acts);

// x f32 [T, cols] quantized as DotRowsView's integer dots of format f at level isa quantize it, into `storage` (grown
// as needed; the view points into it). Throws std::invalid_argument unless f and isa have integer dots
// (UsesQuantizedActs for some bf16_acts) and cols % 32 == 0.
QuantizedActs QuantizeActivations(Isa isa, WFormat f, const float* x, int64_t cols, int64_t T,
                                  std::vector<uint8_t>& storage);

// out[t * out_stride + r] = dot(w[r], x[t]) for rows r in [r0, r1) and tokens t < T; x f32 [T, cols]; xb: the same
// activations as bf16 bits, token t at xb + t * xb_stride (gemm_bf16.h Bf16TokenStride(cols) is fastest for many
// tokens), or nullptr (bf16, fp8 and mxfp4 weights then use bf16 x bf16 dots where the CPU has them; every other
// format reads x); qx: x already quantized for these T tokens (QuantizeActivations of the same isa, format and cols)
// or nullptr (quantized here where the dots need it: q8_0 / q4_0 at the levels above; mxfp4 at the AVX2 level when xb
// is given, bf16 activations, and read as float32 otherwise). Rows are read once each, front to back.
void DotRowsView(Isa isa, const MatrixView& w, int64_t r0, int64_t r1, const float* x, const uint16_t* xb,
                 int64_t xb_stride, int64_t T, float* out, int64_t out_stride, const QuantizedActs* qx = nullptr);

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_QUANT_DOT_H_
