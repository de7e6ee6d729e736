// The expert MLP kernel shared by the host_experts handler (weights in host banks) and the slot_experts handler
// (weights in the slot pool buffers): y[t] = sum_j w[t, j] * expert_e(x[t]), e = ids[t, j], with
//   expert_e(x) = down_e @ glu(gate_e @ x + bg_e, up_e @ x + bu_e) + bd_e
// and glu(g, u) = act(g) * u for silu / gelu_tanh, or gpt-oss's clamped SwiGLU (transformers' GptOssExperts):
//   swiglu_oai: g' = min(g, limit), u' = clamp(u, -limit, limit), glu = (u' + 1) * g' * sigmoid(alpha * g').
// The biases bg, bu, bd are optional (absent = 0: the bias-free families).
//
// Weight layouts (one expert = one bank row / one slot):
//   gate_up [2I, H]: rows 0..I-1 = gate_proj.weight [I, H], rows I..2I-1 = up_proj.weight [I, H]
//   down    [H, I]:  down_proj.weight
//   gate_up bias [2I] (gate bias then up bias), down bias [H]
// Weights are float32 or bfloat16 (each tensor kind independently), or one block format for both (q8_0, q4_0, mxfp4,
// fp8: quant_dot.h, with scale rows per expert: gate_up scales [2 * ScaleRows(I), ScaleCols(H)] (gate grid then up
// grid), down scales [ScaleRows(H), ScaleCols(I)]); biases float32 or bfloat16; activations and accumulation float32.
//
// Every expert's weights are read once per call whatever the number of tokens routed to it, and every output element
// is summed in one fixed order, so results do not depend on threads or scheduling (docs/DESIGN.md sec. 9).
#ifndef FT_JAX_XLA_FFI_EXPERT_KERNEL_H_
#define FT_JAX_XLA_FFI_EXPERT_KERNEL_H_

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/quant_dot.h"

namespace ft_jax {

class WorkerPool;  // worker_pool.h

enum class Activation { kSilu, kGeluTanh, kSwigluOai };

// "silu", "gelu_tanh" or "swiglu_oai"; returns false for anything else.
bool ParseActivation(std::string_view name, Activation* out);

// The gated activation and the clamped SwiGLU's parameters (read by kSwigluOai only; gpt-oss: 1.702 and 7.0).
struct ExpertActivation {
  Activation kind = Activation::kSilu;
  float alpha = 1.702f;  // sigmoid gain
  float limit = 7.0f;    // clamp of the gate (above) and the up projection (both sides)
};

struct ExpertWeights {
  const uint8_t* gate_up;  // expert e at gate_up + e * gate_up_stride (GateUp(e)), [2I, H] (stored as spec says)
  size_t gate_up_stride;   // bytes between consecutive experts
  int32_t gate_up_dtype;   // BankDType code: kF32 or kBF16 (float spec), else the block format's data dtype
  const uint8_t* down;     // expert e at down + e * down_stride (Down(e)), [H, I]
  size_t down_stride;
  int32_t down_dtype;
  int64_t num_experts;  // valid ids are 0..num_experts-1
  int64_t hidden;       // H
  int64_t inter;        // I
  // Optional biases (nullptr = none): expert e's gate_up bias [2I] at gate_up_bias + e * gate_up_bias_stride, its
  // down bias [H] at down_bias + e * down_bias_stride; dtypes kF32 or kBF16.
  const uint8_t* gate_up_bias = nullptr;
  size_t gate_up_bias_stride = 0;
  int32_t gate_up_bias_dtype = 0;
  const uint8_t* down_bias = nullptr;
  size_t down_bias_stride = 0;
  int32_t down_bias_dtype = 0;
  // The storage format of gate_up and down ("float": their dtypes decide) and, for a block format, the scale rows:
  // expert e's gate_up scales at gate_up_scale + e * gate_up_scale_stride, its down scales likewise.
  WeightSpec spec{};
  const uint8_t* gate_up_scale = nullptr;
  size_t gate_up_scale_stride = 0;
  const uint8_t* down_scale = nullptr;
  size_t down_scale_stride = 0;
  // Banks whose rows are not at one stride (Bank::row_offsets): expert e's gate_up at gate_up + gate_up_rows[e], its
  // down at down + down_rows[e]; nullptr: at the strides above.
  const size_t* gate_up_rows = nullptr;
  const size_t* down_rows = nullptr;

  const uint8_t* GateUp(int64_t e) const {
    return gate_up + (gate_up_rows ? gate_up_rows[e] : static_cast<size_t>(e) * gate_up_stride);
  }
  const uint8_t* Down(int64_t e) const {
    return down + (down_rows ? down_rows[e] : static_cast<size_t>(e) * down_stride);
  }
};

// Thrown by RunExperts, inside the task that would read the expert, for an id >= num_experts (ParallelFor carries
// it to the caller; the handler turns it into an FFI error). position = t * k + j of the expert's first route.
struct ExpertIdError : std::exception {
  ExpertIdError(int32_t id, int64_t position, int64_t num_experts)
      : id(id), position(position), num_experts(num_experts) {}
  const char* what() const noexcept override { return "expert id out of range"; }
  // "id 9 at position 3 is out of range for <id_space> (expected -1 or 0..N-1)"
  std::string Describe(const std::string& id_space) const;
  int32_t id;
  int64_t position;
  int64_t num_experts;
};

// Checks ids (>= num_experts is an error; < 0 = skip). Returns "" if fine, else a message naming the first bad
// id and its position; `what` names the id space in the message (e.g. "bank 3" or "slot pool").
std::string CheckExpertIds(const int32_t* ids, int64_t n, int64_t num_experts, const std::string& what);

// x: f32 [T, H]; x_bf16: the same values as bf16 bits when the caller's x was bf16 (a bf16 model: the activations
// between the gate/up and the down projection are then rounded to bf16, as transformers computes them, and bf16
// weights use the bf16 x bf16 dot where the CPU has one), else nullptr; ids: i32 [T, k] (< 0 = skip; an id >=
// num_experts throws ExpertIdError); weights: f32 [T, k]; y: f32 [T, H], overwritten. Weight dtypes must match
// m.spec and bias dtypes be kF32 or kBF16 (the handlers check both). Runs on `pool` (the FFI caller's XLA thread pool, see parallel.h; or the WorkerPool of the
// CUDA host_experts path) when the call reads at least 1 MiB of weights.
void RunExperts(const ExpertWeights& m, const float* x, const uint16_t* x_bf16, const int32_t* ids,
                const float* weights, int64_t T, int64_t k, const ExpertActivation& act, float* y,
                xla::ffi::ThreadPool& pool);
void RunExperts(const ExpertWeights& m, const float* x, const uint16_t* x_bf16, const int32_t* ids,
                const float* weights, int64_t T, int64_t k, const ExpertActivation& act, float* y,
                WorkerPool& pool);

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_EXPERT_KERNEL_H_
