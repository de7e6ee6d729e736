// host_experts: the routed-expert MLP on the CPU, weights read from host banks by the shared kernel
// (expert_kernel.h) on the caller's XLA thread pool. Attribute banks = [gate_up, down] or [gate_up, down,
// gate_up_bias, down_bias] (rows [2I, H], [H, I], [2I], [H] as stored: quant_dot.h), scale_banks = [] or
// [gate_up_scale, down_scale] (rows [2 * ScaleRows(I), ScaleCols(H)] and [ScaleRows(H), ScaleCols(I)]), present iff
// weight_format ("float" | "q8_0" | "q4_0" | "mxfp4" | "fp8", with block_rows / block_cols) is a block format. The
// layout is checked once per executable at the instantiate stage, the execute stage checks the operands against it.
// Attributes activation ("silu" | "gelu_tanh" | "swiglu_oai"), alpha, limit (f32). ids < 0 are skipped; a call with
// no route returns zeros; y is f32 [T, H].
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bank_state.h"
#include "xla_ffi/common.h"
#include "xla_ffi/expert_inputs.h"
#include "xla_ffi/expert_kernel.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/host_bank.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

constexpr const char* kOp = "host_experts";

ffi::ErrorOr<std::unique_ptr<BoundBanks>> HostExpertsInstantiate(ffi::Span<const int64_t> banks,
                                                                  ffi::Span<const int64_t> scale_banks,
                                                                  std::string_view weight_format, int64_t block_rows,
                                                                  int64_t block_cols, std::string_view /*activation*/,
                                                                  float /*alpha*/, float /*limit*/) {
  WeightSpec spec;
  if (std::string err = ParseWeightSpec(weight_format, block_rows, block_cols, &spec); !err.empty()) {
    return ffi::Unexpected(InvalidArgument(kOp, err));
  }
  auto bound = BindBanks(kOp, banks);
  if (!bound.has_value()) return bound;
  auto scales = BindBanks(kOp, scale_banks);
  if (!scales.has_value()) return scales;
  for (auto& bank : (*scales)->banks) (*bound)->banks.push_back(std::move(bank));
  if (std::string err = CheckExpertBanks((*bound)->banks, banks.size(), spec); !err.empty()) {
    return ffi::Unexpected(InvalidArgument(kOp, err));
  }
  return bound;
}

ffi::Error HostExpertsBody(ffi::ThreadPool pool, BoundBanks* bound, ffi::AnyBuffer x, I32Matrix ids,
                           F32Matrix weights, F32MatrixResult y, ffi::Span<const int64_t> banks,
                           std::string_view weight_format, int64_t block_rows, int64_t block_cols,
                           std::string_view activation, float alpha, float limit) {
  if (!AnyRoute(ids)) {
    std::memset(y->typed_data(), 0, y->element_count() * sizeof(float));
    return ffi::Error::Success();
  }
  ExpertActivation act;
  if (ffi::Error err = ParseExpertActivation(kOp, activation, alpha, limit, &act); err.failure()) return err;
  WeightSpec spec;
  if (std::string err = ParseWeightSpec(weight_format, block_rows, block_cols, &spec); !err.empty()) {
    return InvalidArgument(kOp, err);
  }
  if (ffi::Error err = CheckBanksLive(kOp, *bound); err.failure()) return err;
  const Bank& gu = *bound->banks[0];
  const ExpertWeights m = ExpertBankWeights(bound->banks, banks.size(), spec);  // layout checked at instantiate
  thread_local std::vector<float> x32_storage;
  Scratch<float> bounded(x32_storage, 0);  // grown by PrepareExpertInputs, trimmed after the call
  ExpertInputs in;
  if (ffi::Error err = PrepareExpertInputs(kOp, x, ids, weights, y, x32_storage, &in); err.failure()) return err;
  if (in.H != m.hidden) {
    return InvalidArgument(kOp, "gate_up " + gu.Describe() + " must have rows [2I, H] with H = " +
                                    std::to_string(in.H) + " (columns of x)");
  }
  return RunExpertsOrError(kOp, "flat", gu.Describe(), m, in, ids, weights, act, y, pool);
}

// The body, with any exception (an allocation failure) returned as an FFI error.
ffi::Error HostExpertsImpl(ffi::ThreadPool pool, BoundBanks* bound, ffi::AnyBuffer x, I32Matrix ids,
                           F32Matrix weights, F32MatrixResult y, ffi::Span<const int64_t> banks,
                           ffi::Span<const int64_t> /*scale_banks: in `bound`*/, std::string_view weight_format,
                           int64_t block_rows, int64_t block_cols, std::string_view activation, float alpha,
                           float limit) {
  return Guarded(kOp, [&] {
    return HostExpertsBody(pool, bound, x, ids, weights, y, banks, weight_format, block_rows, block_cols, activation,
                           alpha, limit);
  });
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxHostExpertsInstantiate, ft_jax::HostExpertsInstantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<ffi::Span<const int64_t>>("banks")
                                  .Attr<ffi::Span<const int64_t>>("scale_banks")
                                  .Attr<std::string_view>("weight_format")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols")
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxHostExperts, ft_jax::HostExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ctx<ffi::State<ft_jax::BoundBanks>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ft_jax::I32Matrix>()
                                  .Arg<ft_jax::F32Matrix>()
                                  .Ret<ft_jax::F32Matrix>()
                                  .Attr<ffi::Span<const int64_t>>("banks")
                                  .Attr<ffi::Span<const int64_t>>("scale_banks")
                                  .Attr<std::string_view>("weight_format")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols")
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));
