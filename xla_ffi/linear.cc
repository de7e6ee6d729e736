// linear: the dense projections of the decoder on the CPU backend, reading every weight once per call.
//   y[n, o] = sum_k x[n, k] * w[layer, o, k]
// operands: x f32|bf16 [N, K]; w f32|bf16 (or u16 bf16 bits) [L, O, K] (a stack of L like layers; [O, K]: L = 1);
//           layer s32[] (which matrix of the stack)
// result:   y f32 [N, O] (float32 accumulation)
// The whole stack and the layer index are operands, so a scanned decode step reads each layer's weights in place
// (why a handler: docs/DESIGN.md sec. 9). Output rows are split over the caller's XLA thread pool; each task reads
// its rows once for all N tokens (dot_kernels.h DotRows).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common.h"
#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/host_bank.h"
#include "xla_ffi/parallel.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

using F32Matrix = ffi::Buffer<ffi::DataType::F32, 2>;
using F32MatrixResult = ffi::ResultBuffer<ffi::DataType::F32, 2>;
using I32Scalar = ffi::Buffer<ffi::DataType::S32, 0>;

constexpr size_t kParallelMinBytes = size_t{1} << 20;  // below: the caller alone (waking helpers costs more)
constexpr size_t kTaskBytes = size_t{256} << 10;       // weight bytes per task (fits L2 while the tokens pass)

template <typename W>
void RunLinear(const W* w, const float* x, const uint16_t* xb, int64_t N, int64_t K, int64_t O, float* y,
               ffi::ThreadPool& pool) {
  const Isa isa = KernelIsaLevel();
  const size_t row_bytes = static_cast<size_t>(K) * sizeof(W);
  const int64_t threads = row_bytes * static_cast<size_t>(O) >= kParallelMinBytes ? LoopThreads(pool) : 1;
  if (threads <= 1) {
    DotRows<W>(isa, w, K, 0, O, x, xb, N, y, O);
    return;
  }
  int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(kTaskBytes / row_bytes));
  rows = std::min(rows, (O + 4 * threads - 1) / (4 * threads));  // at least 4 tasks per thread
  rows = (std::max<int64_t>(rows, 1) + 3) / 4 * 4;
  const int64_t tasks = (O + rows - 1) / rows;
  ParallelFor(pool, tasks, [&](int64_t t) {
    DotRows<W>(isa, w, K, t * rows, std::min(O, (t + 1) * rows), x, xb, N, y, O);
  });
}

// x as float32: the buffer itself, or bf16 data widened into `scratch`.
const float* XAsF32(ffi::AnyBuffer x, size_t n, Scratch<float>& scratch) {
  if (x.element_type() == ffi::DataType::F32) return static_cast<const float*>(x.untyped_data());
  WidenBf16(static_cast<const uint16_t*>(x.untyped_data()), scratch.data(), n);
  return scratch.data();
}

// Weights may also arrive as uint16 holding bf16 bits (how ft_jax keeps a bf16 embedding table: a tied lm_head).
bool IsBf16Bits(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::U16; }

ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, I32Scalar layer, F32MatrixResult y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3) || !IsWeightDType(x.element_type()) ||
      !(IsWeightDType(w.element_type()) || IsBf16Bits(w.element_type()))) {
    return ffi::Error::InvalidArgument("linear: x must be f32|bf16 [N, K] and w f32|bf16 [L, O, K] or [O, K]");
  }
  const int64_t L = wd.size() == 3 ? wd[0] : 1, O = wd[wd.size() - 2], K = wd[wd.size() - 1], N = xd[0];
  if (xd[1] != K || y->dimensions()[0] != N || y->dimensions()[1] != O) {
    return ffi::Error::InvalidArgument("linear: x [" + std::to_string(N) + ", " + std::to_string(xd[1]) +
                                       "] does not match w [.., " + std::to_string(O) + ", " + std::to_string(K) +
                                       "] or the result shape");
  }
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= L) {
    return ffi::Error::InvalidArgument("linear: layer " + std::to_string(l) + " is out of range for a stack of " +
                                       std::to_string(L) + " weights");
  }
  if (N == 0 || O == 0) return ffi::Error::Success();
  const size_t offset = static_cast<size_t>(l) * static_cast<size_t>(O * K);
  const uint16_t* xb = x.element_type() == ffi::DataType::BF16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  // bf16 x bf16 where the CPU has the dot: x is used as it is, no float32 copy.
  const bool bf16_dots = IsBf16Bits(w.element_type()) && xb != nullptr && KernelIsaLevel() == Isa::kAvx512Bf16;
  const size_t n = static_cast<size_t>(N * K);
  return Guarded("linear", [&] {
    thread_local std::vector<float> x32_storage;
    Scratch<float> x32(x32_storage, xb != nullptr && !bf16_dots ? n : 0);  // trimmed after the call (common.h)
    if (IsBf16Bits(w.element_type())) {
      RunLinear<uint16_t>(static_cast<const uint16_t*>(w.untyped_data()) + offset,
                          bf16_dots ? nullptr : XAsF32(x, n, x32), xb, N, K, O, y->typed_data(), pool);
    } else {
      RunLinear<float>(static_cast<const float*>(w.untyped_data()) + offset, XAsF32(x, n, x32), nullptr, N, K, O,
                       y->typed_data(), pool);
    }
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxLinear, ft_jax::LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ft_jax::I32Scalar>()
                                  .Ret<ft_jax::F32Matrix>());
