#include "xla_ffi/expert_inputs.h"

#include <cstring>
#include <memory>
#include <vector>

#include "xla_ffi/common.h"
#include "xla_ffi/host_bank.h"

namespace ffi = xla::ffi;

namespace ft_jax {

ffi::Error PrepareExpertInputs(const char* op, ffi::AnyBuffer x, I32Matrix ids, F32Matrix weights,
                               F32MatrixResult& y, std::vector<float>& x32_storage, ExpertInputs* in) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArgument(op, "x must be [T, H], got shape " + Dims(xd));
  in->T = xd[0];
  in->H = xd[1];
  in->k = ids.dimensions()[1];
  if (ids.dimensions()[0] != in->T || weights.dimensions()[0] != in->T || weights.dimensions()[1] != in->k) {
    return InvalidArgument(op, "ids " + Dims(ids.dimensions()) + " and weights " + Dims(weights.dimensions()) +
                                   " must both be [T, k] with T = " + std::to_string(in->T) + " (rows of x)");
  }
  if (y->dimensions()[0] != in->T || y->dimensions()[1] != in->H) {
    return InvalidArgument(op, "result must be f32 [T, H] = " + Dims(xd) + ", got " + Dims(y->dimensions()));
  }
  if (x.element_type() == ffi::DataType::F32) {
    in->x32 = static_cast<const float*>(x.untyped_data());
    in->x_bf16 = nullptr;
    return ffi::Error::Success();
  }
  if (x.element_type() != ffi::DataType::BF16) {
    return InvalidArgument(op, "x must be float32 or bfloat16, got " +
                                   BankDTypeName(static_cast<int32_t>(x.element_type())));
  }
  const size_t n = static_cast<size_t>(in->T * in->H);
  if (x32_storage.size() < n) x32_storage.resize(n);
  in->x_bf16 = static_cast<const uint16_t*>(x.untyped_data());
  WidenBf16(in->x_bf16, x32_storage.data(), n);
  in->x32 = x32_storage.data();
  return ffi::Error::Success();
}

ffi::Error ParseExpertActivation(const char* op, std::string_view name, float alpha, float limit,
                                 ExpertActivation* act) {
  act->alpha = alpha;
  act->limit = limit;
  if (ParseActivation(name, &act->kind)) return ffi::Error::Success();
  return InvalidArgument(op, "unknown activation '" + std::string(name) +
                                 "' (expected 'silu', 'gelu_tanh' or 'swiglu_oai')");
}

bool AnyRoute(I32Matrix ids) {
  const int32_t* p = ids.typed_data();
  for (size_t i = 0, n = ids.element_count(); i < n; ++i)
    if (p[i] >= 0) return true;
  return false;
}

std::string CheckBias(const std::string& what, int64_t got_rows, int64_t got_width, int32_t dtype, int64_t rows,
                      int64_t width, const char* layout) {
  if (got_width != width || got_rows != rows) {
    return what + " must have " + std::to_string(rows) + " rows " + layout + " = [" + std::to_string(width) + "]";
  }
  if (!IsWeightDType(dtype)) return what + " must be float32 or bfloat16, got " + BankDTypeName(dtype);
  return "";
}

ffi::Error RunExpertsOrError(const char* op, const char* kind, const std::string& id_space, const ExpertWeights& m,
                             const ExpertInputs& in, I32Matrix ids, F32Matrix weights, const ExpertActivation& act,
                             F32MatrixResult& y, ffi::ThreadPool& pool) {
  return Guarded(op, [&] {
    try {
      RunExperts(m, in.x32, in.x_bf16, ids.typed_data(), weights.typed_data(), in.T, in.k, act, y->typed_data(),
                 pool);
    } catch (const ExpertIdError& e) {
      return InvalidArgument(op, std::string(kind) + " " + e.Describe(id_space));
    }
    return ffi::Error::Success();
  });
}

void ExpertDims(const std::vector<std::shared_ptr<Bank>>& banks, const WeightSpec& spec, int64_t* H, int64_t* I) {
  const auto& gs = banks[0]->row_shape();
  *I = gs[0] / 2;
  *H = gs[1] * (spec.quantized ? ValuesPerItem(spec.format) : 1);
}

std::string CheckExpertBanks(const std::vector<std::shared_ptr<Bank>>& banks, size_t num_banks,
                             const WeightSpec& spec) {
  if (num_banks != 2 && num_banks != 4) {
    return "expected 2 banks (gate_up, down) or 4 (gate_up, down, gate_up_bias, down_bias), got " +
           std::to_string(num_banks);
  }
  const size_t num_scales = banks.size() - num_banks;
  if (num_scales != (spec.quantized ? 2u : 0u)) {
    return std::string("weight_format '") + spec.name() + "' takes " + (spec.quantized ? "2 scale banks" : "no scale banks") +
           " (gate_up_scale, down_scale), got " + std::to_string(num_scales);
  }
  const Bank& gu = *banks[0];
  const Bank& dn = *banks[1];
  const auto& gs = gu.row_shape();
  if (gs.size() != 2 || gs[0] % 2 != 0) return "gate_up " + gu.Describe() + " must have rows [2I, H]";
  int64_t H, I;
  ExpertDims(banks, spec, &H, &I);
  if (!spec.quantized) {
    if (!IsWeightDType(gu.dtype_code()) || !IsWeightDType(dn.dtype_code())) {
      return "expert weights must be float32 or bfloat16, got " + gu.Describe() + " and " + dn.Describe();
    }
    if (dn.row_shape() != std::vector<int64_t>{H, I} || dn.num_rows() != gu.num_rows()) {
      return "down " + dn.Describe() + " must have " + std::to_string(gu.num_rows()) + " rows [H, I] = [" +
             std::to_string(H) + ", " + std::to_string(I) + "] to match gate_up " + gu.Describe();
    }
  } else {
    for (size_t i = 1; i < banks.size(); ++i) {
      if (banks[i]->num_rows() != gu.num_rows()) {
        return "bank " + banks[i]->Describe() + " must have " + std::to_string(gu.num_rows()) +
               " rows (one per expert) to match gate_up " + gu.Describe();
      }
    }
    const Bank& gus = *banks[num_banks];
    const Bank& dns = *banks[num_banks + 1];
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
  const Bank& gb = *banks[2];
  const Bank& db = *banks[3];
  std::string err = CheckBias("gate_up_bias " + gb.Describe(), gb.num_rows(), width(gb), gb.dtype_code(),
                              gu.num_rows(), 2 * I, "[2I]");
  if (err.empty()) {
    err = CheckBias("down_bias " + db.Describe(), db.num_rows(), width(db), db.dtype_code(), gu.num_rows(), H, "[H]");
  }
  return err;
}

ExpertWeights ExpertBankWeights(const std::vector<std::shared_ptr<Bank>>& banks, size_t num_banks,
                                const WeightSpec& spec) {
  const Bank& gu = *banks[0];
  const Bank& dn = *banks[1];
  int64_t H, I;
  ExpertDims(banks, spec, &H, &I);
  ExpertWeights m{gu.data(), gu.row_bytes(), gu.dtype_code(), dn.data(), dn.row_bytes(), dn.dtype_code(),
                  gu.num_rows(), H, I};
  m.gate_up_rows = gu.row_offsets();
  m.down_rows = dn.row_offsets();
  if (num_banks == 4) {
    const Bank& gb = *banks[2];
    const Bank& db = *banks[3];
    m.gate_up_bias = gb.data();
    m.gate_up_bias_stride = gb.row_bytes();
    m.gate_up_bias_dtype = gb.dtype_code();
    m.down_bias = db.data();
    m.down_bias_stride = db.row_bytes();
    m.down_bias_dtype = db.dtype_code();
  }
  m.spec = spec;
  if (spec.quantized) {
    m.gate_up_scale = banks[num_banks]->data();
    m.gate_up_scale_stride = banks[num_banks]->row_bytes();
    m.down_scale = banks[num_banks + 1]->data();
    m.down_scale_stride = banks[num_banks + 1]->row_bytes();
  }
  return m;
}

}  // namespace ft_jax
