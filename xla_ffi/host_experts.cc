// host_experts: the routed-expert MLP on the CPU, weights read from host banks by the shared kernel
// (expert_kernel.h) on the caller's XLA thread pool. Attribute banks = [gate_up, down] or [gate_up, down,
// gate_up_bias, down_bias] (rows [2I, H], [H, I], [2I], [H]); their layout is checked once per executable at the
// instantiate stage, the execute stage checks the operands against it. Attributes activation ("silu" | "gelu_tanh"
// | "swiglu_oai"), alpha, limit (f32). ids < 0 are skipped; a call with no route returns zeros; y is f32 [T, H].
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

// The banks' layout (instantiate stage): "" or the problem, naming the bank, what it must hold and what it holds.
std::string CheckExpertBanks(const BoundBanks& bound) {
  if (bound.banks.size() != 2 && bound.banks.size() != 4) {
    return "expected 2 banks (gate_up, down) or 4 (gate_up, down, gate_up_bias, down_bias), got " +
           std::to_string(bound.banks.size());
  }
  const Bank& gu = *bound.banks[0];
  const Bank& dn = *bound.banks[1];
  if (!IsWeightDType(gu.dtype_code()) || !IsWeightDType(dn.dtype_code())) {
    return "expert weights must be float32 or bfloat16, got " + gu.Describe() + " and " + dn.Describe();
  }
  const auto& gs = gu.row_shape();
  if (gs.size() != 2 || gs[0] % 2 != 0) return "gate_up " + gu.Describe() + " must have rows [2I, H]";
  const int64_t H = gs[1], I = gs[0] / 2;
  if (dn.row_shape() != std::vector<int64_t>{H, I} || dn.num_rows() != gu.num_rows()) {
    return "down " + dn.Describe() + " must have " + std::to_string(gu.num_rows()) + " rows [H, I] = [" +
           std::to_string(H) + ", " + std::to_string(I) + "] to match gate_up " + gu.Describe();
  }
  if (bound.banks.size() == 2) return "";
  auto width = [](const Bank& b) { return b.row_shape().size() == 1 ? b.row_shape()[0] : int64_t{-1}; };
  const Bank& gb = *bound.banks[2];
  const Bank& db = *bound.banks[3];
  std::string err = CheckBias("gate_up_bias " + gb.Describe(), gb.num_rows(), width(gb), gb.dtype_code(),
                              gu.num_rows(), 2 * I, "[2I]");
  if (err.empty()) {
    err = CheckBias("down_bias " + db.Describe(), db.num_rows(), width(db), db.dtype_code(), gu.num_rows(), H, "[H]");
  }
  return err;
}

ffi::ErrorOr<std::unique_ptr<BoundBanks>> HostExpertsInstantiate(ffi::Span<const int64_t> banks,
                                                                  std::string_view /*activation*/, float /*alpha*/,
                                                                  float /*limit*/) {
  auto bound = BindBanks(kOp, banks);
  if (!bound.has_value()) return bound;
  if (std::string err = CheckExpertBanks(**bound); !err.empty()) return ffi::Unexpected(InvalidArgument(kOp, err));
  return bound;
}

ffi::Error HostExpertsBody(ffi::ThreadPool pool, BoundBanks* bound, ffi::AnyBuffer x, I32Matrix ids,
                           F32Matrix weights, F32MatrixResult y, ffi::Span<const int64_t> /*banks: in `bound`*/,
                           std::string_view activation, float alpha, float limit) {
  if (!AnyRoute(ids)) {
    std::memset(y->typed_data(), 0, y->element_count() * sizeof(float));
    return ffi::Error::Success();
  }
  ExpertActivation act;
  if (ffi::Error err = ParseExpertActivation(kOp, activation, alpha, limit, &act); err.failure()) return err;
  if (ffi::Error err = CheckBanksLive(kOp, *bound); err.failure()) return err;
  const Bank& gu = *bound->banks[0];
  const Bank& dn = *bound->banks[1];
  const int64_t H = gu.row_shape()[1], I = gu.row_shape()[0] / 2;  // layout checked at instantiate
  thread_local std::vector<float> x32_storage;
  Scratch<float> bounded(x32_storage, 0);  // grown by PrepareExpertInputs, trimmed after the call
  ExpertInputs in;
  if (ffi::Error err = PrepareExpertInputs(kOp, x, ids, weights, y, x32_storage, &in); err.failure()) return err;
  if (in.H != H) {
    return InvalidArgument(kOp, "gate_up " + gu.Describe() + " must have rows [2I, H] with H = " +
                                    std::to_string(in.H) + " (columns of x)");
  }
  ExpertWeights m{gu.data(), gu.row_bytes(), gu.dtype_code(), dn.data(), dn.row_bytes(), dn.dtype_code(),
                  gu.num_rows(), H, I};
  if (bound->banks.size() == 4) {
    const Bank& gb = *bound->banks[2];
    const Bank& db = *bound->banks[3];
    m.gate_up_bias = gb.data();
    m.gate_up_bias_stride = gb.row_bytes();
    m.gate_up_bias_dtype = gb.dtype_code();
    m.down_bias = db.data();
    m.down_bias_stride = db.row_bytes();
    m.down_bias_dtype = db.dtype_code();
  }
  return RunExpertsOrError(kOp, "flat", gu.Describe(), m, in, ids, weights, act, y, pool);
}

// The body, with any exception (an allocation failure) returned as an FFI error.
ffi::Error HostExpertsImpl(ffi::ThreadPool pool, BoundBanks* bound, ffi::AnyBuffer x, I32Matrix ids,
                           F32Matrix weights, F32MatrixResult y, ffi::Span<const int64_t> banks,
                           std::string_view activation, float alpha, float limit) {
  return Guarded(kOp, [&] {
    return HostExpertsBody(pool, bound, x, ids, weights, y, banks, activation, alpha, limit);
  });
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxHostExpertsInstantiate, ft_jax::HostExpertsInstantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<ffi::Span<const int64_t>>("banks")
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
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));
