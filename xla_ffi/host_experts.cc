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

// H and I of the bound banks (layout checked): the gate_up bank holds rows [2I, H / values per item].
void ExpertDims(const BoundBanks& bound, const WeightSpec& spec, int64_t* H, int64_t* I) {
  const auto& gs = bound.banks[0]->row_shape();
  *I = gs[0] / 2;
  *H = gs[1] * (spec.quantized ? ValuesPerItem(spec.format) : 1);
}

// The banks' layout (instantiate stage): "" or the problem, naming the bank, what it must hold and what it holds.
// bound.banks = the `banks` attribute's banks, then the `scale_banks` ones.
std::string CheckExpertBanks(const BoundBanks& bound, size_t num_banks, const WeightSpec& spec) {
  if (num_banks != 2 && num_banks != 4) {
    return "expected 2 banks (gate_up, down) or 4 (gate_up, down, gate_up_bias, down_bias), got " +
           std::to_string(num_banks);
  }
  const size_t num_scales = bound.banks.size() - num_banks;
  if (num_scales != (spec.quantized ? 2u : 0u)) {
    return std::string("weight_format '") + spec.name() + "' takes " + (spec.quantized ? "2 scale banks" : "no scale banks") +
           " (gate_up_scale, down_scale), got " + std::to_string(num_scales);
  }
  const Bank& gu = *bound.banks[0];
  const Bank& dn = *bound.banks[1];
  const auto& gs = gu.row_shape();
  if (gs.size() != 2 || gs[0] % 2 != 0) return "gate_up " + gu.Describe() + " must have rows [2I, H]";
  int64_t H, I;
  ExpertDims(bound, spec, &H, &I);
  if (!spec.quantized) {
    if (!IsWeightDType(gu.dtype_code()) || !IsWeightDType(dn.dtype_code())) {
      return "expert weights must be float32 or bfloat16, got " + gu.Describe() + " and " + dn.Describe();
    }
    if (dn.row_shape() != std::vector<int64_t>{H, I} || dn.num_rows() != gu.num_rows()) {
      return "down " + dn.Describe() + " must have " + std::to_string(gu.num_rows()) + " rows [H, I] = [" +
             std::to_string(H) + ", " + std::to_string(I) + "] to match gate_up " + gu.Describe();
    }
  } else {
    for (size_t i = 1; i < bound.banks.size(); ++i) {
      if (bound.banks[i]->num_rows() != gu.num_rows()) {
        return "bank " + bound.banks[i]->Describe() + " must have " + std::to_string(gu.num_rows()) +
               " rows (one per expert) to match gate_up " + gu.Describe();
      }
    }
    const Bank& gus = *bound.banks[num_banks];
    const Bank& dns = *bound.banks[num_banks + 1];
    std::string err = CheckStoredMatrix(spec, "gate_up " + gu.Describe(), gu.dtype_code(), gs.data(), gs.size(),
                                        "gate_up_scale " + gus.Describe(), gus.dtype_code(), gus.row_shape().data(),
                                        gus.row_shape().size(), 2 * I, H, /*pair=*/true);
    if (err.empty()) {
      err = CheckStoredMatrix(spec, "down " + dn.Describe(), dn.dtype_code(), dn.row_shape().data(),
                              dn.row_shape().size(), "down_scale " + dns.Describe(), dns.dtype_code(),
                              dns.row_shape().data(), dns.row_shape().size(), H, I, /*pair=*/false);
    }
    if (!err.empty()) return err;
  }
  if (num_banks == 2) return "";
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
  if (std::string err = CheckExpertBanks(**bound, banks.size(), spec); !err.empty()) {
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
  const Bank& dn = *bound->banks[1];
  int64_t H, I;
  ExpertDims(*bound, spec, &H, &I);  // layout checked at instantiate
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
  if (banks.size() == 4) {
    const Bank& gb = *bound->banks[2];
    const Bank& db = *bound->banks[3];
    m.gate_up_bias = gb.data();
    m.gate_up_bias_stride = gb.row_bytes();
    m.gate_up_bias_dtype = gb.dtype_code();
    m.down_bias = db.data();
    m.down_bias_stride = db.row_bytes();
    m.down_bias_dtype = db.dtype_code();
  }
  m.spec = spec;
  if (spec.quantized) {
    const Bank& gus = *bound->banks[banks.size()];
    const Bank& dns = *bound->banks[banks.size() + 1];
    m.gate_up_scale = gus.data();
    m.gate_up_scale_stride = gus.row_bytes();
    m.down_scale = dns.data();
    m.down_scale_stride = dns.row_bytes();
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
