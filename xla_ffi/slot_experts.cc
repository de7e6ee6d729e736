// slot_experts: the routed-expert MLP on the CPU (the kernel of expert_kernel.h), weights read from the slot pool
// operands gate_up_slots [S, 2I, H] and down_slots [S, H, I] (as stored in weight_format: quant_dot.h), then
// optionally the bias pools [S, 2I] and [S, H], then for a block format the scale pools [S, 2 * ScaleRows(I),
// ScaleCols(H)] and [S, ScaleRows(H), ScaleCols(I)]. The pools are operands, so their layout is checked per call.
// Attributes as host_experts (weight_format, block_rows, block_cols, activation, alpha, limit); y is f32 [T, H].
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common.h"
#include "xla_ffi/expert_inputs.h"
#include "xla_ffi/expert_kernel.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/host_bank.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

constexpr const char* kOp = "slot_experts";

// The optional bias pools [S, 2I] and [S, H] (extra operands 0 and 1) into m.
ffi::Error SetBiasPools(ffi::RemainingArgs extra, size_t num_bias, int64_t S, ExpertWeights* m) {
  if (num_bias == 0) return ffi::Error::Success();
  auto gb = extra.get<ffi::AnyBuffer>(0);
  auto db = extra.get<ffi::AnyBuffer>(1);
  if (!gb.has_value() || !db.has_value()) return InvalidArgument(kOp, "bad bias pool operand");
  const auto gbd = gb->dimensions();
  const auto dbd = db->dimensions();
  const int32_t gbt = static_cast<int32_t>(gb->element_type());
  const int32_t dbt = static_cast<int32_t>(db->element_type());
  const int64_t I = m->inter, H = m->hidden;
  std::string err = CheckBias("gate_up bias pool " + Dims(gbd), gbd.size() == 2 ? gbd[0] : -1,
                              gbd.size() == 2 ? gbd[1] : -1, gbt, S, 2 * I, "[2I]");
  if (err.empty()) {
    err = CheckBias("down bias pool " + Dims(dbd), dbd.size() == 2 ? dbd[0] : -1, dbd.size() == 2 ? dbd[1] : -1, dbt,
                    S, H, "[H]");
  }
  if (!err.empty()) return InvalidArgument(kOp, err);
  m->gate_up_bias = static_cast<const uint8_t*>(gb->untyped_data());
  m->gate_up_bias_stride = static_cast<size_t>(2 * I) * BankDTypeSize(gbt);
  m->gate_up_bias_dtype = gbt;
  m->down_bias = static_cast<const uint8_t*>(db->untyped_data());
  m->down_bias_stride = static_cast<size_t>(H) * BankDTypeSize(dbt);
  m->down_bias_dtype = dbt;
  return ffi::Error::Success();
}

// Bytes per slot of a pool [S, ...] (0 for an empty pool: every slot id is then out of range).
size_t SlotBytes(const ffi::AnyBuffer& pool, int64_t S) { return S > 0 ? pool.size_bytes() / S : 0; }

// A pool [S, ...] without its slot axis, for the layout checks ({-1} when it has no slot axis of S).
std::vector<int64_t> SlotShape(ffi::Span<const int64_t> d, int64_t S) {
  if (d.size() < 1 || d[0] != S) return {-1};
  return std::vector<int64_t>(d.begin() + 1, d.end());
}

ffi::Error SlotExpertsBody(ffi::ThreadPool pool, ffi::AnyBuffer x, I32Matrix ids, F32Matrix weights,
                           ffi::AnyBuffer gate_up_slots, ffi::AnyBuffer down_slots, ffi::RemainingArgs extra,
                           F32MatrixResult y, std::string_view weight_format, int64_t block_rows, int64_t block_cols,
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
  const size_t num_scales = spec.quantized ? 2 : 0;
  if (extra.size() != num_scales && extra.size() != num_scales + 2) {
    return InvalidArgument(kOp, std::string("weight_format '") + spec.name() + "' expects " +
                                    (spec.quantized ? "2 scale pools (gate_up, down), after " : "") +
                                    "no bias pools or 2 (gate_up [S, 2I], down [S, H]), got " +
                                    std::to_string(extra.size()) + " extra operands");
  }
  const size_t num_bias = extra.size() - num_scales;
  thread_local std::vector<float> x32_storage;
  Scratch<float> bounded(x32_storage, 0);  // grown by PrepareExpertInputs, trimmed after the call
  ExpertInputs in;
  if (ffi::Error err = PrepareExpertInputs(kOp, x, ids, weights, y, x32_storage, &in); err.failure()) return err;
  const int64_t H = in.H;
  const auto gd = gate_up_slots.dimensions();
  const auto dd = down_slots.dimensions();
  const int64_t vpi = spec.quantized ? ValuesPerItem(spec.format) : 1;
  if (gd.size() != 3 || gd[1] % 2 != 0 || gd[2] * vpi != H) {
    return InvalidArgument(kOp, "gate_up_slots must be [S, 2I, H" + std::string(vpi == 2 ? " / 2" : "") +
                                    "] with H = " + std::to_string(H) + " (columns of x), got " + Dims(gd));
  }
  const int64_t S = gd[0], I = gd[1] / 2;
  const int32_t gt = static_cast<int32_t>(gate_up_slots.element_type());
  const int32_t dt = static_cast<int32_t>(down_slots.element_type());
  ExpertWeights m{static_cast<const uint8_t*>(gate_up_slots.untyped_data()), SlotBytes(gate_up_slots, S), gt,
                  static_cast<const uint8_t*>(down_slots.untyped_data()), SlotBytes(down_slots, S), dt, S, H, I};
  m.spec = spec;
  if (!spec.quantized) {
    if (dd.size() != 3 || dd[0] != S || dd[1] != H || dd[2] != I) {
      return InvalidArgument(kOp, "down_slots must be [S, H, I] = [" + std::to_string(S) + ", " + std::to_string(H) +
                                      ", " + std::to_string(I) + "], got " + Dims(dd));
    }
    if (!IsWeightDType(gt) || !IsWeightDType(dt)) {
      return InvalidArgument(kOp, "slot weights must be float32 or bfloat16, got " + BankDTypeName(gt) + " and " +
                                      BankDTypeName(dt));
    }
  } else {
    auto gs = extra.get<ffi::AnyBuffer>(num_bias);
    auto ds = extra.get<ffi::AnyBuffer>(num_bias + 1);
    if (!gs.has_value() || !ds.has_value()) return InvalidArgument(kOp, "bad scale pool operand");
    const std::vector<int64_t> gu_row = SlotShape(gd, S), dn_row = SlotShape(dd, S);
    const std::vector<int64_t> gus_row = SlotShape(gs->dimensions(), S), dns_row = SlotShape(ds->dimensions(), S);
    std::string err = CheckStoredMatrix(spec, "gate_up_slots " + Dims(gd), gt, gu_row.data(), gu_row.size(),
                                        "gate_up scale pool " + Dims(gs->dimensions()),
                                        static_cast<int32_t>(gs->element_type()), gus_row.data(), gus_row.size(),
                                        2 * I, H, /*pair=*/true);
    if (err.empty()) {
      err = CheckStoredMatrix(spec, "down_slots " + Dims(dd), dt, dn_row.data(), dn_row.size(),
                              "down scale pool " + Dims(ds->dimensions()), static_cast<int32_t>(ds->element_type()),
                              dns_row.data(), dns_row.size(), H, I, /*pair=*/false);
    }
    if (!err.empty()) return InvalidArgument(kOp, err + " (pools carry a leading slot axis of " + std::to_string(S) + ")");
    m.gate_up_scale = static_cast<const uint8_t*>(gs->untyped_data());
    m.gate_up_scale_stride = SlotBytes(*gs, S);
    m.down_scale = static_cast<const uint8_t*>(ds->untyped_data());
    m.down_scale_stride = SlotBytes(*ds, S);
  }
  if (ffi::Error err = SetBiasPools(extra, num_bias, S, &m); err.failure()) return err;
  return RunExpertsOrError(kOp, "slot", "the slot pool of " + std::to_string(S) + " slots", m, in, ids, weights, act,
                           y, pool);
}

// The body, with any exception (an allocation failure) returned as an FFI error.
ffi::Error SlotExpertsImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, I32Matrix ids, F32Matrix weights,
                           ffi::AnyBuffer gate_up_slots, ffi::AnyBuffer down_slots, ffi::RemainingArgs extra,
                           F32MatrixResult y, std::string_view weight_format, int64_t block_rows, int64_t block_cols,
                           std::string_view activation, float alpha, float limit) {
  return Guarded(kOp, [&] {
    return SlotExpertsBody(pool, x, ids, weights, gate_up_slots, down_slots, extra, y, weight_format, block_rows,
                           block_cols, activation, alpha, limit);
  });
}

}  // namespace
}  // namespace ft_jax

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
                                  .Attr<std::string_view>("weight_format")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols")
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit"));
