#include "xla_ffi/expert_kernel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string_view>
#include <vector>

#include "xla_ffi/common.h"
#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/gemm_bf16.h"
#include "xla_ffi/host_bank.h"
#include "xla_ffi/parallel.h"
#include "xla_ffi/worker_pool.h"


namespace ft_jax {

namespace {

// glu(g, u) of the module comment: act(g) * u, or the clamped SwiGLU of gpt-oss.
inline float Glu(const ExpertActivation& act, float g, float u) {
  if (act.kind == Activation::kSilu) return g / (1.0f + std::exp(-g)) * u;
  if (act.kind == Activation::kSwigluOai) {
    g = std::min(g, act.limit);  // NaN stays NaN, as torch.clamp
    u = std::min(std::max(u, -act.limit), act.limit);
    return (u + 1.0f) * (g / (1.0f + std::exp(-act.alpha * g)));
  }
  // gelu_tanh: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * u;
}

// Element i of an optional bias vector (float32 or bfloat16 bits); 0 when there is none.
inline float BiasAt(const uint8_t* bias, int32_t dtype, int64_t i) {
  if (bias == nullptr) return 0.0f;
  if (dtype == static_cast<int32_t>(BankDType::kBF16)) return ToF32(reinterpret_cast<const uint16_t*>(bias)[i]);
  return reinterpret_cast<const float*>(bias)[i];
}

// Routes grouped by expert: routes of group g are order[begin[g] .. begin[g+1]) (route = t * k + j).
struct Groups {
  std::vector<int32_t> expert;   // [G] ascending
  std::vector<int64_t> begin;    // [G + 1]
  std::vector<int64_t> token;    // [routes] token index per grouped route
  std::vector<int64_t> route;    // [routes] route index t * k + j (error messages)
  std::vector<float> weight;     // [routes]
};

void GroupRoutes(const int32_t* ids, const float* weights, int64_t T, int64_t k, Groups* g) {
  std::vector<int64_t> order;
  order.reserve(T * k);
  for (int64_t r = 0; r < T * k; ++r)
    if (ids[r] >= 0) order.push_back(r);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  g->expert.clear();
  g->begin.clear();
  g->token.resize(order.size());
  g->route.assign(order.begin(), order.end());
  g->weight.resize(order.size());
  for (size_t n = 0; n < order.size(); ++n) {
    int32_t e = ids[order[n]];
    if (g->expert.empty() || g->expert.back() != e) {
      g->expert.push_back(e);
      g->begin.push_back(static_cast<int64_t>(n));
    }
    g->token[n] = order[n] / k;
    g->weight[n] = weights[order[n]];
  }
  g->begin.push_back(static_cast<int64_t>(order.size()));
}

// The view of a float (dtype) or block-format matrix of `cols` columns.
WFormat FormatOf(const WeightSpec& spec, int32_t dtype) {
  if (spec.quantized) return spec.format;
  return dtype == static_cast<int32_t>(BankDType::kBF16) ? WFormat::kBF16 : WFormat::kF32;
}

template <typename Pool>
void RunGrouped(const ExpertWeights& m, const float* x, const uint16_t* x_bf16, const Groups& g, int64_t T,
                const ExpertActivation& act, float* y, Pool& pool) {
  const Isa isa = KernelIsaLevel();
  const int64_t H = m.hidden, I = m.inter;
  const int64_t G = static_cast<int64_t>(g.expert.size());
  const int64_t routes = g.begin.back();
  const WFormat fgu = FormatOf(m.spec, m.gate_up_dtype), fdn = FormatOf(m.spec, m.down_dtype);
  const size_t gu_row = DataRowBytes(fgu, H), dn_row = DataRowBytes(fdn, I);  // stored bytes of one row
  const size_t weight_bytes = static_cast<size_t>(G) * (2 * I * gu_row + H * dn_row);
  const int64_t threads = weight_bytes >= kParallelMinBytes ? LoopThreads(pool) : 1;
  auto run = [&](int64_t n, const auto& fn) {
    if (threads > 1) {
      ParallelFor(pool, n, fn);
    } else {
      RunOnCaller(n, fn);
    }
  };

  // A bf16 model (x arrives in bf16): the activations a = glu(...) are rounded to bf16 before the down projection,
  // as transformers' bf16 expert computes them, and bf16 weights then take the bf16 x bf16 dot where the CPU has it.
  const bool bf16_model = x_bf16 != nullptr;
  const bool bf16_dots = isa == Isa::kAvx512Bf16 && bf16_model &&
                         (!m.spec.quantized || m.spec.format == WFormat::kFp8 || m.spec.format == WFormat::kMxfp4);

  // Per-call buffers of the calling thread (tasks write disjoint parts): the routes' inputs side by side
  // xg [routes, H], gate/up outputs hb [routes, 2I], activations a [routes, I], down outputs d [routes, H]; with
  // bf16 dots also xgb [routes, Hs] and ab [routes, Is] as bf16 bits, their tokens Bf16TokenStride apart (the
  // register tiles' L1 sets, gemm_bf16.h). Freed after the call when above kScratchKeepBytes (common.h Scratch; the
  // bound: docs/DESIGN.md sec. 9).
  const int64_t Hs = Bf16TokenStride(H), Is = Bf16TokenStride(I);
  thread_local std::vector<float> buf_storage;
  thread_local std::vector<uint16_t> buf16_storage;
  Scratch<float> buf(buf_storage, static_cast<size_t>(routes) * static_cast<size_t>(2 * H + 3 * I));
  Scratch<uint16_t> buf16(buf16_storage, bf16_dots ? static_cast<size_t>(routes) * static_cast<size_t>(Hs + Is) : 0);
  float* xg = buf.data();
  float* hb = xg + routes * H;
  float* a = hb + routes * 2 * I;
  float* d = a + routes * I;
  uint16_t* xgb = nullptr;
  uint16_t* ab = nullptr;
  if (bf16_dots) {
    xgb = buf16.data();
    ab = xgb + routes * Hs;
    for (int64_t n = 0; n < routes; ++n)
      std::copy(x_bf16 + g.token[n] * H, x_bf16 + (g.token[n] + 1) * H, xgb + n * Hs);
  }
  for (int64_t n = 0; n < routes; ++n) std::copy(x + g.token[n] * H, x + (g.token[n] + 1) * H, xg + n * H);
  // Integer dots (q8_0 / q4_0 with int8 activations; mxfp4 with a bf16 model's activations in int16 at the AVX2
  // level): xg quantized here once for every task (quant_dot.h QuantizedActs), and a after phase 1; qxg / qa: nullptr
  // where the dots read the floats.
  thread_local std::vector<uint8_t> qxg_storage, qa_storage;
  Scratch<uint8_t> keep_qxg(qxg_storage, 0), keep_qa(qa_storage, 0);  // freed after the call when large
  QuantizedActs qxg_all, qa_all;
  const QuantizedActs* qxg = nullptr;
  const QuantizedActs* qa = nullptr;
  const WFormat agu = ActivationFormat(fgu, m.spec.interleave), adn = ActivationFormat(fdn, m.spec.interleave);
  if (UsesQuantizedActs(isa, agu, bf16_model)) {
    qxg_all = QuantizeActivations(isa, agu, xg, H, routes, qxg_storage);
    qxg = &qxg_all;
  }

  // Phase 1: tasks = (expert group, block [i0, i1) of the I gate/up row pairs): the block's gate rows, then its up
  // rows (two sequential streams, each row read once for all the group's routes), then a = glu(gate + b_gate,
  // up + b_up) for the block: the activation runs on every thread, inside the tasks. A bf16 model rounds a to bf16
  // (as transformers' bf16 expert computes it), kept as bits too for the bf16 x bf16 dots. A task whose expert id
  // is out of range throws ExpertIdError before reading anything (ParallelFor hands it to the caller).
  // Rows per task: a multiple of the register tile's rows where the bf16 tiles run (gemm_bf16.h), whole groups of
  // q4_0x16 (quant_dot.h), else any.
  const int64_t row_multiple = bf16_dots ? gemm_bf16::kRows : m.spec.interleave;
  const size_t task_bytes = TaskBytes(routes, G);  // parallel.h: long tasks for decode, 256 KiB for prefill
  const int64_t rpt1 = RowsPerTask(2 * gu_row, I, row_multiple, threads, task_bytes);
  const int64_t blocks1 = (I + rpt1 - 1) / rpt1;
  run(G * blocks1, [&](int64_t task) {
    const int64_t grp = task / blocks1, blk = task % blocks1;
    const int64_t b = g.begin[grp], e = g.begin[grp + 1];
    const int64_t i0 = blk * rpt1, i1 = std::min(I, (blk + 1) * rpt1);
    if (g.expert[grp] >= m.num_experts) throw ExpertIdError(g.expert[grp], g.route[b], m.num_experts);
    const size_t expert = static_cast<size_t>(g.expert[grp]);
    const uint8_t* gu = m.GateUp(expert);
    const uint8_t* gus = m.gate_up_scale == nullptr ? nullptr : m.gate_up_scale + expert * m.gate_up_scale_stride;
    const uint16_t* xb = xgb == nullptr ? nullptr : xgb + b * Hs;
    // The gate matrix is rows 0..I-1; the up matrix its own view (data from row I, scales from its stacked grid).
    const MatrixView gate = MakeView(fgu, m.spec, gu, gus, H), up = MakeView(fgu, m.spec, gu, gus, H, I);
    const QuantizedActs qx = qxg == nullptr ? QuantizedActs() : qxg->FromToken(b);
    const QuantizedActs* qxb = qxg == nullptr ? nullptr : &qx;
    DotRowsView(isa, gate, i0, i1, xg + b * H, xb, Hs, e - b, hb + b * 2 * I, 2 * I, qxb);     // gate rows
    DotRowsView(isa, up, i0, i1, xg + b * H, xb, Hs, e - b, hb + b * 2 * I + I, 2 * I, qxb);  // up rows
    const uint8_t* bias = m.gate_up_bias == nullptr ? nullptr : m.gate_up_bias + expert * m.gate_up_bias_stride;
    for (int64_t n = b; n < e; ++n) {
      const float* h = hb + n * 2 * I;
      float* an = a + n * I;
      for (int64_t i = i0; i < i1; ++i) {
        an[i] = bias == nullptr ? Glu(act, h[i], h[I + i])
                                : Glu(act, h[i] + BiasAt(bias, m.gate_up_bias_dtype, i),
                                      h[I + i] + BiasAt(bias, m.gate_up_bias_dtype, I + i));
        if (bf16_model) {
          const uint16_t bits = ToBf16(an[i]);
          an[i] = ToF32(bits);
          if (ab != nullptr) ab[n * Is + i] = bits;
        }
      }
    }
  });

  if (UsesQuantizedActs(isa, adn, bf16_model)) {
    qa_all = QuantizeActivations(isa, adn, a, I, routes, qa_storage);
    qa = &qa_all;
  }

  // Phase 2: tasks = blocks of output rows h; inside a task every expert group in ascending order, routes in order,
  // so each y element is summed in one fixed order.
  const int64_t rpt2 = RowsPerTask(static_cast<size_t>(G) * dn_row, H, row_multiple, threads, task_bytes);
  const int64_t blocks2 = (H + rpt2 - 1) / rpt2;
  run(blocks2, [&](int64_t blk) {
    const int64_t h0 = blk * rpt2, h1 = std::min(H, (blk + 1) * rpt2);
    for (int64_t t = 0; t < T; ++t) std::fill(y + t * H + h0, y + t * H + h1, 0.0f);
    for (int64_t grp = 0; grp < G; ++grp) {
      const int64_t b = g.begin[grp], e = g.begin[grp + 1];
      const size_t expert = static_cast<size_t>(g.expert[grp]);
      // bf16 dots: the first rows (one register tile's) of the next group's h0..h1 into L2 while this group runs, so
      // its stream starts warm (the tiles read a row in 2 strided passes, which the hardware prefetchers do not run
      // ahead of; inside a tiled call, gemm_bf16.h prefetches each next row group itself)
      if (bf16_dots && grp + 1 < G) {
        const uint8_t* next = m.Down(g.expert[grp + 1]) + h0 * dn_row;
        const size_t bytes = static_cast<size_t>(std::min<int64_t>(h1 - h0, gemm_bf16::kRows)) * dn_row;
        for (size_t at = 0; at < bytes; at += 64) __builtin_prefetch(next + at, 0, 2);
      }
      const uint8_t* dns = m.down_scale == nullptr ? nullptr : m.down_scale + expert * m.down_scale_stride;
      const MatrixView down = MakeView(fdn, m.spec, m.Down(expert), dns, I);
      const QuantizedActs qx = qa == nullptr ? QuantizedActs() : qa->FromToken(b);
      DotRowsView(isa, down, h0, h1, a + b * I, ab == nullptr ? nullptr : ab + b * Is, Is, e - b, d + b * H, H,
                  qa == nullptr ? nullptr : &qx);
      const uint8_t* bias = m.down_bias == nullptr ? nullptr
                                                   : m.down_bias + static_cast<size_t>(g.expert[grp]) * m.down_bias_stride;
      for (int64_t n = b; n < e; ++n) {
        float* yt = y + g.token[n] * H;
        const float w = g.weight[n];
        if (bias == nullptr) {
          for (int64_t h = h0; h < h1; ++h) yt[h] += w * d[n * H + h];
        } else {
          for (int64_t h = h0; h < h1; ++h) yt[h] += w * (d[n * H + h] + BiasAt(bias, m.down_bias_dtype, h));
        }
      }
    }
  });
}

}  // namespace

bool ParseActivation(std::string_view name, Activation* out) {
  if (name == "silu") {
    *out = Activation::kSilu;
    return true;
  }
  if (name == "gelu_tanh") {
    *out = Activation::kGeluTanh;
    return true;
  }
  if (name == "swiglu_oai") {
    *out = Activation::kSwigluOai;
    return true;
  }
  return false;
}

std::string ExpertIdError::Describe(const std::string& id_space) const {
  return "id " + std::to_string(id) + " at position " + std::to_string(position) + " is out of range for " +
         id_space + " (expected -1 or 0.." + std::to_string(num_experts - 1) + ")";
}

std::string CheckExpertIds(const int32_t* ids, int64_t n, int64_t num_experts, const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] >= num_experts) return ExpertIdError(ids[i], i, num_experts).Describe(what);
  }
  return "";
}

namespace {

template <typename Pool>
void RunExpertsOn(const ExpertWeights& m, const float* x, const uint16_t* x_bf16, const int32_t* ids,
                  const float* weights, int64_t T, int64_t k, const ExpertActivation& act, float* y, Pool& pool) {
  thread_local Groups groups;
  GroupRoutes(ids, weights, T, k, &groups);
  if (groups.expert.empty()) {
    std::fill(y, y + T * m.hidden, 0.0f);
    return;
  }
  RunGrouped(m, x, x_bf16, groups, T, act, y, pool);
}

}  // namespace

void RunExperts(const ExpertWeights& m, const float* x, const uint16_t* x_bf16, const int32_t* ids,
                const float* weights, int64_t T, int64_t k, const ExpertActivation& act, float* y,
                xla::ffi::ThreadPool& pool) {
  RunExpertsOn(m, x, x_bf16, ids, weights, T, k, act, y, pool);
}

void RunExperts(const ExpertWeights& m, const float* x, const uint16_t* x_bf16, const int32_t* ids,
                const float* weights, int64_t T, int64_t k, const ExpertActivation& act, float* y,
                WorkerPool& pool) {
  RunExpertsOn(m, x, x_bf16, ids, weights, T, k, act, y, pool);
}

}  // namespace ft_jax
