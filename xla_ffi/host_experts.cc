// host_experts and slot_experts: the routed-expert MLP computed on the CPU by the shared kernel in
// expert_kernel.{h,cc}, on the caller's XLA thread pool. host_experts reads expert weights from two host banks
// (attribute banks = [gate_up, down], or [gate_up, down, gate_up_bias, down_bias] with bias banks of rows [2I] and
// [H]; bound once per executable: bank_state.h), slot_experts from the slot pool operands [S, 2I, H] and [S, H, I]
// (then optionally the bias pools [S, 2I] and [S, H]). Attributes activation ("silu" | "gelu_tanh" | "swiglu_oai"),
// alpha and limit (f32, the clamped SwiGLU's). ids < 0 are skipped; a call with no route returns zeros at once;
// y is f32 [T, H].
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bank_state.h"
#include "xla_ffi/expert_kernel.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/host_bank.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

using I32Matrix = ffi::Buffer<ffi::DataType::S32, 2>;
using F32Matrix = ffi::Buffer<ffi::DataType::F32, 2>;
using F32MatrixResult = ffi::ResultBuffer<ffi::DataType::F32, 2>;

bool IsWeightDType(int32_t code) {
  return code == static_cast<int32_t>(BankDType::kF32) || code == static_cast<int32_t>(BankDType::kBF16);
}

std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// x's bf16 bits when x is bf16, else nullptr.
const uint16_t* XBf16(ffi::AnyBuffer x) {
  return x.element_type() == ffi::DataType::BF16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
}

// Checks x [T, H] (f32 or bf16), ids [T, k], weights [T, k], y [T, H]; returns x as f32 (converted copy for
// bf16, or the buffer itself). On error returns nullptr and sets *err.
const float* PrepareInputs(const char* op, ffi::AnyBuffer x, I32Matrix ids, F32Matrix weights, F32MatrixResult& y,
                           int64_t* T, int64_t* H, int64_t* k, std::string* err) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) {
    *err = std::string(op) + ": x must be [T, H], got shape " + Dims(xd);
    return nullptr;
  }
  *T = xd[0];
  *H = xd[1];
  const auto idd = ids.dimensions();
  *k = idd[1];
  if (idd[0] != *T || weights.dimensions()[0] != *T || weights.dimensions()[1] != *k) {
    *err = std::string(op) + ": ids " + Dims(idd) + " and weights " + Dims(weights.dimensions()) +
           " must both be [T, k] with T = " + std::to_string(*T) + " (rows of x)";
    return nullptr;
  }
  if (y->dimensions()[0] != *T || y->dimensions()[1] != *H) {
    *err = std::string(op) + ": result must be f32 [T, H] = [" + std::to_string(*T) + ", " + std::to_string(*H) +
           "], got " + Dims(y->dimensions());
    return nullptr;
  }
  const int32_t xt = static_cast<int32_t>(x.element_type());
  if (xt == static_cast<int32_t>(BankDType::kF32)) return static_cast<const float*>(x.untyped_data());
  if (xt != static_cast<int32_t>(BankDType::kBF16)) {
    *err = std::string(op) + ": x must be float32 or bfloat16, got " + BankDTypeName(xt);
    return nullptr;
  }
  thread_local std::vector<float> x32;
  const size_t n = static_cast<size_t>(*T * *H);
  if (x32.size() < n) x32.resize(n);
  const uint16_t* src = static_cast<const uint16_t*>(x.untyped_data());
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&x32[i], &bits, sizeof(float));
  }
  return x32.data();
}

// True when at least one route is computed (ids >= 0): a call with none returns zeros at once.
bool AnyRoute(I32Matrix ids) {
  const int32_t* p = ids.typed_data();
  for (size_t i = 0, n = ids.element_count(); i < n; ++i)
    if (p[i] >= 0) return true;
  return false;
}

void Zero(F32MatrixResult& y) { std::memset(y->typed_data(), 0, y->element_count() * sizeof(float)); }

// The activation attributes; false (and *err set) for an unknown name.
bool ParseExpertActivation(const char* op, std::string_view name, float alpha, float limit, ExpertActivation* act,
                           std::string* err) {
  act->alpha = alpha;
  act->limit = limit;
  if (ParseActivation(name, &act->kind)) return true;
  *err = std::string(op) + ": unknown activation '" + std::string(name) +
         "' (expected 'silu', 'gelu_tanh' or 'swiglu_oai')";
  return false;
}

// Checks a bias bank / pool holding got_rows rows of got_width elements (-1: rows are not vectors) against `rows`
// rows [width], float32 or bfloat16. Returns "" or the problem.
std::string CheckBias(const std::string& what, int64_t got_rows, int64_t got_width, int32_t dtype, int64_t rows,
                      int64_t width, const char* layout) {
  if (got_width != width || got_rows != rows) {
    return what + " must have " + std::to_string(rows) + " rows " + layout + " = [" + std::to_string(width) + "]";
  }
  if (!IsWeightDType(dtype)) return what + " must be float32 or bfloat16, got " + BankDTypeName(dtype);
  return "";
}

ffi::Error HostExpertsImpl(ffi::ThreadPool pool, BoundBanks* bound, ffi::AnyBuffer x, I32Matrix ids,
                           F32Matrix weights, F32MatrixResult y, ffi::Span<const int64_t> /*banks: in `bound`*/,
                           std::string_view activation, float alpha, float limit) {
  constexpr const char* kOp = "host_experts";
  if (!AnyRoute(ids)) {
    Zero(y);
    return ffi::Error::Success();
  }
  ExpertActivation act;
  std::string err;
  if (!ParseExpertActivation(kOp, activation, alpha, limit, &act, &err)) return ffi::Error::InvalidArgument(err);
  if (bound->banks.size() != 2 && bound->banks.size() != 4) {
    return ffi::Error::InvalidArgument(
        "host_experts: expected 2 banks (gate_up, down) or 4 (gate_up, down, gate_up_bias, down_bias), got " +
        std::to_string(bound->banks.size()));
  }
  if (ffi::Error err = CheckBanksLive(kOp, *bound); err.failure()) return err;
  const Bank* gu = bound->banks[0].get();
  const Bank* dn = bound->banks[1].get();
  int64_t T, H, k;
  const float* x32 = PrepareInputs(kOp, x, ids, weights, y, &T, &H, &k, &err);
  if (!x32) return ffi::Error::InvalidArgument(err);
  const auto& gs = gu->row_shape();
  const auto& ds = dn->row_shape();
  if (gs.size() != 2 || gs[0] % 2 != 0 || gs[1] != H) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": gate_up " + gu->Describe() +
                                       " must have rows [2I, H] with H = " + std::to_string(H) + " (columns of x)");
  }
  const int64_t I = gs[0] / 2;
  if (ds.size() != 2 || ds[0] != H || ds[1] != I) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": down " + dn->Describe() + " must have rows [H, I] = [" +
                                       std::to_string(H) + ", " + std::to_string(I) + "] to match gate_up " +
                                       gu->Describe());
  }
  if (gu->num_rows() != dn->num_rows()) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": gate_up " + gu->Describe() + " and down " +
                                       dn->Describe() + " hold different numbers of experts");
  }
  if (!IsWeightDType(gu->dtype_code()) || !IsWeightDType(dn->dtype_code())) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": expert weights must be float32 or bfloat16, got " +
                                       gu->Describe() + " and " + dn->Describe());
  }
  err = CheckExpertIds(ids.typed_data(), T * k, gu->num_rows(), gu->Describe());
  if (!err.empty()) return ffi::Error::InvalidArgument(std::string(kOp) + ": flat " + err);
  ExpertWeights m{gu->data(), gu->row_bytes(), gu->dtype_code(), dn->data(), dn->row_bytes(), dn->dtype_code(),
                  gu->num_rows(), H, I};
  if (bound->banks.size() == 4) {
    const Bank* gb = bound->banks[2].get();
    const Bank* db = bound->banks[3].get();
    auto width = [](const Bank* b) { return b->row_shape().size() == 1 ? b->row_shape()[0] : int64_t{-1}; };
    err = CheckBias("gate_up_bias " + gb->Describe(), gb->num_rows(), width(gb), gb->dtype_code(), gu->num_rows(),
                    2 * I, "[2I]");
    if (err.empty()) {
      err = CheckBias("down_bias " + db->Describe(), db->num_rows(), width(db), db->dtype_code(), gu->num_rows(), H,
                      "[H]");
    }
    if (!err.empty()) return ffi::Error::InvalidArgument(std::string(kOp) + ": " + err);
    m.gate_up_bias = gb->data();
    m.gate_up_bias_stride = gb->row_bytes();
    m.gate_up_bias_dtype = gb->dtype_code();
    m.down_bias = db->data();
    m.down_bias_stride = db->row_bytes();
    m.down_bias_dtype = db->dtype_code();
  }
  RunExperts(m, x32, XBf16(x), ids.typed_data(), weights.typed_data(), T, k, act, y->typed_data(), pool);
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<BoundBanks>> HostExpertsInstantiate(ffi::Span<const int64_t> banks,
                                                                  std::string_view /*activation*/, float /*alpha*/,
                                                                  float /*limit*/) {
  return BindBanks("host_experts", banks);
}

ffi::Error SlotExpertsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, I32Matrix ids, F32Matrix weights,
                           ffi::AnyBuffer gate_up_slots, ffi::AnyBuffer down_slots, ffi::RemainingArgs bias_slots,
                           F32MatrixResult y, std::string_view activation, float alpha, float limit) {
  constexpr const char* kOp = "slot_experts";
  if (!AnyRoute(ids)) {
    Zero(y);
    return ffi::Error::Success();
  }
  ExpertActivation act;
  std::string err;
  if (!ParseExpertActivation(kOp, activation, alpha, limit, &act, &err)) return ffi::Error::InvalidArgument(err);
  if (bias_slots.size() != 0 && bias_slots.size() != 2) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": expected no bias pools or 2 (gate_up [S, 2I], down "
                                       "[S, H]), got " + std::to_string(bias_slots.size()));
  }
  int64_t T, H, k;
  const float* x32 = PrepareInputs(kOp, x, ids, weights, y, &T, &H, &k, &err);
  if (!x32) return ffi::Error::InvalidArgument(err);
  const auto gd = gate_up_slots.dimensions();
  const auto dd = down_slots.dimensions();
  if (gd.size() != 3 || gd[1] % 2 != 0 || gd[2] != H) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": gate_up_slots must be [S, 2I, H] with H = " +
                                       std::to_string(H) + " (columns of x), got " + Dims(gd));
  }
  const int64_t S = gd[0], I = gd[1] / 2;
  if (dd.size() != 3 || dd[0] != S || dd[1] != H || dd[2] != I) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": down_slots must be [S, H, I] = [" + std::to_string(S) +
                                       ", " + std::to_string(H) + ", " + std::to_string(I) + "], got " + Dims(dd));
  }
  const int32_t gt = static_cast<int32_t>(gate_up_slots.element_type());
  const int32_t dt = static_cast<int32_t>(down_slots.element_type());
  if (!IsWeightDType(gt) || !IsWeightDType(dt)) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": slot weights must be float32 or bfloat16, got " +
                                       BankDTypeName(gt) + " and " + BankDTypeName(dt));
  }
  err = CheckExpertIds(ids.typed_data(), T * k, S, "the slot pool of " + std::to_string(S) + " slots");
  if (!err.empty()) return ffi::Error::InvalidArgument(std::string(kOp) + ": slot " + err);
  const size_t gu_stride = static_cast<size_t>(2 * I * H) * BankDTypeSize(gt);
  const size_t dn_stride = static_cast<size_t>(H * I) * BankDTypeSize(dt);
  ExpertWeights m{static_cast<const uint8_t*>(gate_up_slots.untyped_data()), gu_stride, gt,
                  static_cast<const uint8_t*>(down_slots.untyped_data()), dn_stride, dt, S, H, I};
  if (bias_slots.size() == 2) {
    auto gb = bias_slots.get<ffi::AnyBuffer>(0);
    auto db = bias_slots.get<ffi::AnyBuffer>(1);
    if (!gb.has_value() || !db.has_value()) return ffi::Error::InvalidArgument("slot_experts: bad bias pool operand");
    const auto gbd = gb->dimensions();
    const auto dbd = db->dimensions();
    const int32_t gbt = static_cast<int32_t>(gb->element_type());
    const int32_t dbt = static_cast<int32_t>(db->element_type());
    err = CheckBias("gate_up bias pool " + Dims(gbd), gbd.size() == 2 ? gbd[0] : -1, gbd.size() == 2 ? gbd[1] : -1,
                    gbt, S, 2 * I, "[2I]");
    if (err.empty()) {
      err = CheckBias("down bias pool " + Dims(dbd), dbd.size() == 2 ? dbd[0] : -1, dbd.size() == 2 ? dbd[1] : -1,
                      dbt, S, H, "[H]");
    }
    if (!err.empty()) return ffi::Error::InvalidArgument(std::string(kOp) + ": " + err);
    m.gate_up_bias = static_cast<const uint8_t*>(gb->untyped_data());
    m.gate_up_bias_stride = static_cast<size_t>(2 * I) * BankDTypeSize(gbt);
    m.gate_up_bias_dtype = gbt;
    m.down_bias = static_cast<const uint8_t*>(db->untyped_data());
    m.down_bias_stride = static_cast<size_t>(H) * BankDTypeSize(dbt);
    m.down_bias_dtype = dbt;
  }
  RunExperts(m, x32, XBf16(x), ids.typed_data(), weights.typed_data(), T, k, act, y->typed_data(), pool);
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxSlotExperts, ft_jax::SlotExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ft_jax::I32Matrix>()
                                  .Arg<ft_jax::F32Matrix>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ft_jax::F32Matrix>()
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));
