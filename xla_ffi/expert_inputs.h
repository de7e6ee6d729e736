// The operand checks and conversions host_experts.cc and slot_experts.cc share (per call: x, ids, weights, y,
// activation attributes); the weights' layout is each handler's own (banks: once at instantiate; slot pools: per call).
#ifndef FT_JAX_XLA_FFI_EXPERT_INPUTS_H_
#define FT_JAX_XLA_FFI_EXPERT_INPUTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/expert_kernel.h"
#include "xla_ffi/host_bank.h"

namespace ft_jax {

using I32Matrix = xla::ffi::Buffer<xla::ffi::DataType::S32, 2>;
using F32Matrix = xla::ffi::Buffer<xla::ffi::DataType::F32, 2>;
using F32MatrixResult = xla::ffi::ResultBuffer<xla::ffi::DataType::F32, 2>;

// The checked operands of an expert call: x [T, H] as f32 (widened into `x32_storage` when bf16) and its bf16 bits.
struct ExpertInputs {
  int64_t T = 0, H = 0, k = 0;
  const float* x32 = nullptr;
  const uint16_t* x_bf16 = nullptr;  // non-null when x is bf16 (a bf16 model: expert_kernel.h)
};

// Checks x [T, H] (f32 or bf16), ids [T, k], weights [T, k], y [T, H]; widens bf16 x into x32_storage.
xla::ffi::Error PrepareExpertInputs(const char* op, xla::ffi::AnyBuffer x, I32Matrix ids, F32Matrix weights,
                                    F32MatrixResult& y, std::vector<float>& x32_storage, ExpertInputs* in);

// The activation attributes; an error names an unknown activation.
xla::ffi::Error ParseExpertActivation(const char* op, std::string_view name, float alpha, float limit,
                                      ExpertActivation* act);

// True when at least one route is computed (ids >= 0): a call with none returns zeros at once.
bool AnyRoute(I32Matrix ids);

// "" or the problem of a bias bank / pool (`what`) holding got_rows rows of got_width elements (-1: rows are not
// vectors) of `dtype`, against `rows` rows of [width] float32 or bfloat16 (`layout` names the width, e.g. "[2I]").
std::string CheckBias(const std::string& what, int64_t got_rows, int64_t got_width, int32_t dtype, int64_t rows,
                      int64_t width, const char* layout);

// Host expert banks (host_experts on the CPU and on CUDA): banks = the `banks` attribute's num_banks banks (gate_up,
// down[, gate_up_bias, down_bias]) then the `scale_banks` ones. CheckExpertBanks returns "" or the layout problem,
// naming the bank, what it must hold for `spec` and what it holds; ExpertDims gives H and I of checked banks (the
// gate_up bank holds rows [2I, H / values per item]); ExpertBankWeights points the kernel at them.
std::string CheckExpertBanks(const std::vector<std::shared_ptr<Bank>>& banks, size_t num_banks,
                             const WeightSpec& spec);
void ExpertDims(const std::vector<std::shared_ptr<Bank>>& banks, const WeightSpec& spec, int64_t* H, int64_t* I);
ExpertWeights ExpertBankWeights(const std::vector<std::shared_ptr<Bank>>& banks, size_t num_banks,
                                const WeightSpec& spec);

// Runs the kernel; an id out of range (found inside the kernel's tasks) becomes an error "<op>: <kind> id ... is
// out of range for <id_space> ...", any other exception an error naming the op (common.h Guarded).
xla::ffi::Error RunExpertsOrError(const char* op, const char* kind, const std::string& id_space,
                                  const ExpertWeights& m, const ExpertInputs& in, I32Matrix ids, F32Matrix weights,
                                  const ExpertActivation& act, F32MatrixResult& y, xla::ffi::ThreadPool& pool);

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_EXPERT_INPUTS_H_
