#include "xla_ffi/expert_inputs.h"

#include <cstring>

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

}  // namespace ft_jax
