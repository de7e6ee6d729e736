// linear: the dense projections of the decoder on the CPU backend, reading every weight once per call.
//   y[n, o] = sum_k x[n, k] * w[layer, o, k]
// operands: x f32|bf16 [N, K]; w [L, O, K] (a stack of L like layers; [O, K]: L = 1) f32|bf16 (or u16 bf16 bits),
//           or stored in the block format of the weight_format attribute (data [L, O, K / values per item],
//           quant_dot.h); layer s32[] (which matrix of the stack); for a block format then scales
//           [L, ScaleRows(O), ScaleCols(K)] (or 2-D with a 2-D w)
// attrs:    weight_format ("float" | "q8_0" | "q4_0" | "mxfp4" | "fp8"), block_rows, block_cols (i64)
// result:   y f32 [N, O] (float32 accumulation; the stored bytes are dequantized in registers, quant_dot.h)
// The whole stack and the layer index are operands, so a scanned decode step reads each layer's weights in place
// (why a handler: docs/DESIGN.md sec. 9). Output rows are split over the caller's XLA thread pool; each task reads
// its rows once for all N tokens (dot_kernels.h DotRows).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bank_state.h"
#include "xla_ffi/common.h"
#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/gemm_bf16.h"
#include "xla_ffi/host_bank.h"
#include "xla_ffi/parallel.h"
#include "xla_ffi/quant_dot.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

using F32Matrix = ffi::Buffer<ffi::DataType::F32, 2>;
using F32MatrixResult = ffi::ResultBuffer<ffi::DataType::F32, 2>;
using I32Scalar = ffi::Buffer<ffi::DataType::S32, 0>;


constexpr int64_t kTiledMinTokens = 32;               // from here a bf16 x bf16 call copies x to the tiles' stride
constexpr size_t kTokenBlockBytes = size_t{256} << 10;  // bf16 token bytes per block (stays in L2 while rows pass)

void RunLinear(const MatrixView& w, const float* x, const uint16_t* xb, int64_t N, int64_t O, float* y,
               ffi::ThreadPool& pool) {
  const Isa isa = KernelIsaLevel();
  const size_t row_bytes = std::max<size_t>(w.row_bytes, 1);
  const int64_t threads = row_bytes * static_cast<size_t>(O) >= kParallelMinBytes ? LoopThreads(pool) : 1;
  // Many tokens of a bf16 x bf16 product (prefill): the register tiles (gemm_bf16.h) read x with its tokens
  // Bf16TokenStride apart (a 4 KiB stride evicts the rows from L1) in blocks that stay in L2. Same bits per
  // (row, token) as one token alone.
  const bool tiled = x == nullptr && w.format == WFormat::kBF16 && isa == Isa::kAvx512Bf16 && N >= kTiledMinTokens;
  const int64_t xs = tiled ? Bf16TokenStride(w.cols) : w.cols;
  const int64_t token_block = std::max<int64_t>(  // a multiple of the tiles' tokens
      gemm_bf16::kTokens, static_cast<int64_t>(kTokenBlockBytes / (2 * static_cast<size_t>(xs))) / gemm_bf16::kTokens *
                              gemm_bf16::kTokens);
  thread_local std::vector<uint16_t> xs_storage;
  Scratch<uint16_t> x_strided(xs_storage, tiled ? static_cast<size_t>(N) * static_cast<size_t>(xs) : 0);
  if (tiled) {
    for (int64_t t = 0; t < N; ++t) std::copy(xb + t * w.cols, xb + (t + 1) * w.cols, x_strided.data() + t * xs);
    xb = x_strided.data();
  }
  // rows r0 .. r1 - 1 for every token (tiled: a block of tokens at a time)
  auto rows_times_tokens = [&](int64_t r0, int64_t r1, const QuantizedActs* qx) {
    if (!tiled) return DotRowsView(isa, w, r0, r1, x, xb, w.cols, N, y, O, qx);
    for (int64_t t0 = 0; t0 < N; t0 += token_block) {
      DotRowsView(isa, w, r0, r1, nullptr, xb + t0 * xs, xs, std::min(token_block, N - t0), y + t0 * O, O, nullptr);
    }
  };
  if (threads <= 1) return RunOnCaller(1, [&](int64_t) { rows_times_tokens(0, O, nullptr); });
  // integer dots (q8_0 / q4_0; mxfp4 with bf16 x at the AVX2 level): x quantized once for every task
  // (quant_dot.h QuantizedActs)
  thread_local std::vector<uint8_t> qx_storage;
  Scratch<uint8_t> keep_qx(qx_storage, 0);  // freed after the call when large
  QuantizedActs qx_all;
  const QuantizedActs* qx = nullptr;
  const WFormat acts = ActivationFormat(w.format, w.interleave);
  if (UsesQuantizedActs(isa, acts, xb != nullptr)) {
    qx_all = QuantizeActivations(isa, acts, x, w.cols, N, qx_storage);
    qx = &qx_all;
  }
  // rows per task: a multiple of 4, and whole groups of q4_0x16 (16)
  const int64_t rows = RowsPerTask(row_bytes, O, std::max<int64_t>(4, w.interleave), threads, TaskBytes(N, 1));
  const int64_t tasks = (O + rows - 1) / rows;
  ParallelFor(pool, tasks, [&](int64_t t) {
    rows_times_tokens(t * rows, std::min(O, (t + 1) * rows), qx);
  });
}

// x as float32: the buffer itself, or bf16 data widened into `scratch`.
const float* XAsF32(ffi::AnyBuffer x, size_t n, Scratch<float>& scratch) {
  if (x.element_type() == ffi::DataType::F32) return static_cast<const float*>(x.untyped_data());
  WidenBf16(static_cast<const uint16_t*>(x.untyped_data()), scratch.data(), n);
  return scratch.data();
}

constexpr const char* kOp = "linear";
constexpr const char* kBankOp = "bank_linear";

// y[N, O] = x [N, K] . rows of `view` (checked by the caller), on the caller's thread pool.
ffi::Error Project(const char* op, const MatrixView& view, ffi::AnyBuffer x, int64_t N, int64_t O, float* y,
                   ffi::ThreadPool& pool) {
  const int64_t K = view.cols;
  const uint16_t* xb =
      x.element_type() == ffi::DataType::BF16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  const WFormat format = view.format;
  // bf16 x bf16 where the CPU has the dot: x is used as it is, no float32 copy.
  const bool bf16_dots = format == WFormat::kBF16 && xb != nullptr && KernelIsaLevel() == Isa::kAvx512Bf16;
  const size_t n = static_cast<size_t>(N * K);
  return Guarded(op, [&] {
    thread_local std::vector<float> x32_storage;
    Scratch<float> x32(x32_storage, xb != nullptr && !bf16_dots ? n : 0);  // trimmed after the call (common.h)
    const bool bf16_x_dots = format == WFormat::kBF16 || format == WFormat::kFp8 || format == WFormat::kMxfp4;
    RunLinear(view, bf16_dots ? nullptr : XAsF32(x, n, x32), bf16_x_dots ? xb : nullptr, N, O, y, pool);
    return ffi::Error::Success();
  });
}

ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, I32Scalar layer,
                      ffi::RemainingArgs extra, F32MatrixResult y, std::string_view weight_format, int64_t block_rows,
                      int64_t block_cols) {
  WeightSpec spec;
  if (std::string err = ParseWeightSpec(weight_format, block_rows, block_cols, &spec); !err.empty()) {
    return InvalidArgument(kOp, err);
  }
  if (extra.size() != (spec.quantized ? 1u : 0u)) {
    return InvalidArgument(kOp, std::string("weight_format '") + spec.name() + "' takes " +
                                    (spec.quantized ? "one scales operand" : "no scales operand") + ", got " +
                                    std::to_string(extra.size()));
  }
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int32_t wt = static_cast<int32_t>(w.element_type());
  const bool float_w = IsWeightDType(w.element_type()) || IsBf16Bits(w.element_type());
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3) || !IsWeightDType(x.element_type()) ||
      (!spec.quantized && !float_w)) {
    return InvalidArgument(kOp, "x must be f32|bf16 [N, K] and w f32|bf16 [L, O, K] or [O, K] (or stored in the "
                                "weight_format's dtype), got x " + Dims(xd) + " " +
                                BankDTypeName(static_cast<int32_t>(x.element_type())) + " and w " + Dims(wd) + " " +
                                BankDTypeName(wt));
  }
  const int64_t vpi = spec.quantized ? ValuesPerItem(spec.format) : 1;
  const int64_t L = wd.size() == 3 ? wd[0] : 1, O = wd[wd.size() - 2], K = wd[wd.size() - 1] * vpi, N = xd[0];
  if (xd[1] != K || y->dimensions()[0] != N || y->dimensions()[1] != O) {
    return InvalidArgument(kOp, "x [" + std::to_string(N) + ", " + std::to_string(xd[1]) + "] does not match w [.., " +
                                    std::to_string(O) + ", " + std::to_string(K) + "] or the result shape");
  }
  const WFormat format = spec.quantized ? spec.format : (wt == static_cast<int32_t>(BankDType::kF32) ? WFormat::kF32
                                                                                                   : WFormat::kBF16);
  const uint8_t* scales = nullptr;
  if (spec.quantized) {
    auto s = extra.get<ffi::AnyBuffer>(0);
    if (!s.has_value()) return InvalidArgument(kOp, "bad scales operand");
    const auto sd = s->dimensions();
    if (sd.size() != wd.size() || (wd.size() == 3 && sd[0] != L)) {
      return InvalidArgument(kOp, "scales " + Dims(sd) + " must have the rank and stack size of w " + Dims(wd));
    }
    const size_t lead = wd.size() - 2;
    std::string err = CheckStoredMatrix(spec, "w " + Dims(wd), wt, &wd[lead], 2, "scales " + Dims(sd),
                                        static_cast<int32_t>(s->element_type()), &sd[lead], 2, O, K,
                                        /*pair=*/false);
    if (!err.empty()) return InvalidArgument(kOp, err);
    scales = static_cast<const uint8_t*>(s->untyped_data());
  }
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= L) {
    return InvalidArgument(kOp, "layer " + std::to_string(l) + " is out of range for a stack of " +
                                    std::to_string(L) + " weights");
  }
  if (N == 0 || O == 0) return ffi::Error::Success();
  MatrixView view = MakeView(format, spec, static_cast<const uint8_t*>(w.untyped_data()), scales, K);
  view.data += static_cast<size_t>(l) * static_cast<size_t>(O) * view.row_bytes;
  if (spec.quantized) view.scales += static_cast<size_t>(l) * static_cast<size_t>(ScaleRows(spec, O)) * view.scale_row_bytes;
  return Project(kOp, view, x, N, O, y->typed_data(), pool);
}

// The float weights of one host-bank row: bank_linear's attribute `bank`, bound once per executable.
ffi::ErrorOr<std::unique_ptr<BoundBanks>> BankLinearInstantiate(int64_t bank) {
  auto bound = BindBanks(kBankOp, ffi::Span<const int64_t>(&bank, 1));
  if (!bound.has_value()) return bound;
  const Bank& b = *(*bound)->banks[0];
  const int32_t dt = b.dtype_code();
  if (b.row_shape().size() != 2 || (dt != static_cast<int32_t>(BankDType::kF32) &&
                                    dt != static_cast<int32_t>(BankDType::kBF16))) {
    return ffi::Unexpected(InvalidArgument(kBankOp, b.Describe() + " must hold float32 or bfloat16 rows [O, K]"));
  }
  return bound;
}

ffi::Error BankLinearImpl(ffi::ThreadPool pool, BoundBanks* bound, ffi::AnyBuffer x, I32Scalar layer,
                          F32MatrixResult y, int64_t /*bank: in `bound`*/) {
  if (ffi::Error err = CheckBanksLive(kBankOp, *bound); err.failure()) return err;
  const Bank& b = *bound->banks[0];
  const auto xd = x.dimensions();
  const int64_t O = b.row_shape()[0], K = b.row_shape()[1];
  if (xd.size() != 2 || !IsWeightDType(x.element_type()) || xd[1] != K || y->dimensions()[0] != xd[0] ||
      y->dimensions()[1] != O) {
    return InvalidArgument(kBankOp, "x must be f32|bf16 [N, " + std::to_string(K) + "] and the result f32 [N, " +
                                        std::to_string(O) + "] for " + b.Describe() + ", got x " + Dims(xd));
  }
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= b.num_rows()) {
    return InvalidArgument(kBankOp, "layer " + std::to_string(l) + " is out of range for " + b.Describe());
  }
  if (xd[0] == 0 || O == 0) return ffi::Error::Success();
  const WFormat format = b.dtype_code() == static_cast<int32_t>(BankDType::kF32) ? WFormat::kF32 : WFormat::kBF16;
  return Project(kBankOp, MakeView(format, WeightSpec{}, b.row(l), nullptr, K), x, xd[0], O, y->typed_data(), pool);
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxLinear, ft_jax::LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ft_jax::I32Scalar>()
                                  .RemainingArgs()
                                  .Ret<ft_jax::F32Matrix>()
                                  .Attr<std::string_view>("weight_format")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxBankLinearInstantiate, ft_jax::BankLinearInstantiate,
                              ffi::Ffi::BindInstantiate().Attr<int64_t>("bank"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxBankLinear, ft_jax::BankLinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ctx<ffi::State<ft_jax::BoundBanks>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ft_jax::I32Scalar>()
                                  .Ret<ft_jax::F32Matrix>()
                                  .Attr<int64_t>("bank"));
