#include "xla_ffi/expert_kernel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/host_bank.h"
#include "xla_ffi/parallel.h"


namespace ft_jax {

bool UseAvx2() {
#if FT_JAX_HAVE_AVX2_PATH
  // FT_JAX_KERNEL=generic (read once) forces the portable loops, e.g. to rule out the vector path when debugging.
  static const bool use = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !(std::getenv("FT_JAX_KERNEL") && std::string_view(std::getenv("FT_JAX_KERNEL")) == "generic");
  return use;
#else
  return false;
#endif
}

namespace {

// Below this many weight bytes per call the kernel runs on the calling thread (waking workers costs more).
constexpr size_t kParallelMinBytes = size_t{1} << 20;
// Target weight bytes per task: large enough to amortise the task hand-out, small enough to balance the threads.
constexpr size_t kTaskBytes = size_t{256} << 10;

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

int64_t RowsPerTask(size_t row_bytes, int64_t rows, int64_t multiple, int64_t threads) {
  int64_t r = static_cast<int64_t>(kTaskBytes / std::max<size_t>(row_bytes, 1));
  // At least 4 tasks per thread for balance.
  int64_t cap = (rows + 4 * threads - 1) / (4 * threads);
  r = std::max<int64_t>(1, std::min(r, cap));
  return (r + multiple - 1) / multiple * multiple;
}

// Token chunks: groups of 4 routes use 2 rows x 4 tokens per inner loop (each weight load feeds 4 FMAs), smaller
// remainders use 4 rows x 2 or 1 tokens (enough independent accumulators to hide the FMA latency). Every
// (row, token) accumulator sees the same sequence of operations in every variant, so the chunking does not
// change results.

// Phase 1 for one expert and gate rows [i0, i1): a[route][i] = glu(gate_i . x + bg_i, up_i . x + bu_i).
// bias: the expert's gate_up bias [2I] or nullptr.
template <typename WG>
void GateUpRows(bool avx2, const WG* gu, const uint8_t* bias, int32_t bias_dtype, const Groups& g, int64_t grp,
                const float* x, int64_t H, int64_t I, const ExpertActivation& act, int64_t i0, int64_t i1, float* a) {
  const int64_t b = g.begin[grp], e = g.begin[grp + 1];
  float out[8];
  // glu of gate row i and up row i: biases added only when present (bias-free results unchanged bit for bit)
  auto glu = [&](int64_t i, float gate, float up) {
    if (bias != nullptr) {
      gate += BiasAt(bias, bias_dtype, i);
      up += BiasAt(bias, bias_dtype, I + i);
    }
    return Glu(act, gate, up);
  };
  for (int64_t i = i0; i < i1;) {
    const int64_t nrows = i + 1 < i1 ? 2 : 1;  // gate/up row pairs handled together
    for (int64_t n = b; n < e;) {
      const int64_t left = e - n;
      const float* xs[4];
      for (int q = 0; q < 4; ++q) xs[q] = x + g.token[n + std::min<int64_t>(q, left - 1)] * H;
      if (left >= 4) {
        for (int64_t r = 0; r < nrows; ++r) {
          const WG* rows[2] = {gu + (i + r) * H, gu + (I + i + r) * H};
          Dot<WG, 2, 4>(avx2, rows, xs, H, out);  // out = [gate x 4 tokens, up x 4 tokens]
          for (int tn = 0; tn < 4; ++tn) a[(n + tn) * I + i + r] = glu(i + r, out[tn], out[4 + tn]);
        }
        n += 4;
      } else if (nrows == 2) {
        const WG* rows[4] = {gu + i * H, gu + (i + 1) * H, gu + (I + i) * H, gu + (I + i + 1) * H};
        const int64_t nt = std::min<int64_t>(left, 2);
        if (nt == 2) {
          Dot<WG, 4, 2>(avx2, rows, xs, H, out);  // out = [gate_i, gate_i+1, up_i, up_i+1] x 2 tokens
        } else {
          Dot<WG, 4, 1>(avx2, rows, xs, H, out);
        }
        for (int tn = 0; tn < nt; ++tn)
          for (int q = 0; q < 2; ++q)
            a[(n + tn) * I + i + q] = glu(i + q, out[q * nt + tn], out[(2 + q) * nt + tn]);
        n += nt;
      } else {
        const WG* rows[2] = {gu + i * H, gu + (I + i) * H};
        Dot<WG, 2, 1>(avx2, rows, xs, H, out);
        a[n * I + i] = glu(i, out[0], out[1]);
        n += 1;
      }
    }
    i += nrows;
  }
}

// Phase 2 for output rows [h0, h1): y[t][h] = sum over groups (ascending), routes (in order) of
// w * (down_h . a + bd_h).
template <typename WD>
void DownRows(bool avx2, const ExpertWeights& m, const Groups& g, const float* a, int64_t T, int64_t h0,
              int64_t h1, float* y) {
  const int64_t H = m.hidden, I = m.inter;
  for (int64_t t = 0; t < T; ++t) std::fill(y + t * H + h0, y + t * H + h1, 0.0f);
  float out[8];
  const uint8_t* bias = nullptr;  // the current group's down bias [H], or nullptr
  auto accumulate = [&](int64_t h, int64_t n, int R, int nt) {
    for (int r = 0; r < R; ++r) {
      if (bias != nullptr) {
        const float bd = BiasAt(bias, m.down_bias_dtype, h + r);
        for (int tn = 0; tn < nt; ++tn) y[g.token[n + tn] * H + h + r] += g.weight[n + tn] * (out[r * nt + tn] + bd);
      } else {
        for (int tn = 0; tn < nt; ++tn) y[g.token[n + tn] * H + h + r] += g.weight[n + tn] * out[r * nt + tn];
      }
    }
  };
  for (size_t grp = 0; grp + 1 < g.begin.size(); ++grp) {
    const WD* dn = reinterpret_cast<const WD*>(m.down + static_cast<size_t>(g.expert[grp]) * m.down_stride);
    if (m.down_bias != nullptr) bias = m.down_bias + static_cast<size_t>(g.expert[grp]) * m.down_bias_stride;
    const int64_t b = g.begin[grp], e = g.begin[grp + 1];
    for (int64_t h = h0; h < h1;) {
      const int64_t nrows = h + 4 <= h1 ? 4 : 1;
      for (int64_t n = b; n < e;) {
        const int64_t left = e - n;
        const float* as[4];
        for (int q = 0; q < 4; ++q) as[q] = a + (n + std::min<int64_t>(q, left - 1)) * I;
        if (left >= 4) {
          for (int64_t r = 0; r < nrows; r += 2) {
            if (nrows == 4) {
              const WD* rows[2] = {dn + (h + r) * I, dn + (h + r + 1) * I};
              Dot<WD, 2, 4>(avx2, rows, as, I, out);
              accumulate(h + r, n, 2, 4);
            } else {
              const WD* rows[1] = {dn + h * I};
              Dot<WD, 1, 4>(avx2, rows, as, I, out);
              accumulate(h, n, 1, 4);
            }
          }
          n += 4;
        } else if (nrows == 4) {
          const WD* rows[4] = {dn + h * I, dn + (h + 1) * I, dn + (h + 2) * I, dn + (h + 3) * I};
          const int64_t nt = std::min<int64_t>(left, 2);
          if (nt == 2) {
            Dot<WD, 4, 2>(avx2, rows, as, I, out);
          } else {
            Dot<WD, 4, 1>(avx2, rows, as, I, out);
          }
          accumulate(h, n, 4, static_cast<int>(nt));
          n += nt;
        } else {
          const WD* rows[1] = {dn + h * I};
          Dot<WD, 1, 1>(avx2, rows, as, I, out);
          accumulate(h, n, 1, 1);
          n += 1;
        }
      }
      h += nrows;
    }
  }
}

template <typename WG, typename WD>
void RunTyped(const ExpertWeights& m, const float* x, const Groups& g, int64_t T, const ExpertActivation& act,
              float* y, xla::ffi::ThreadPool& pool) {
  const bool avx2 = UseAvx2();
  const int64_t H = m.hidden, I = m.inter;
  const int64_t G = static_cast<int64_t>(g.expert.size());
  const int64_t routes = g.begin.back();
  const size_t egu = sizeof(WG), ed = sizeof(WD);
  const size_t weight_bytes = static_cast<size_t>(G) * static_cast<size_t>(H * I) * (2 * egu + ed);
  const int64_t threads = weight_bytes >= kParallelMinBytes ? LoopThreads(pool) : 1;
  auto run = [&](int64_t n, const auto& fn) {
    if (threads > 1) {
      ParallelFor(pool, n, fn);
    } else {
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
  };

  thread_local std::vector<float> a_buf;
  if (a_buf.size() < static_cast<size_t>(routes * I)) a_buf.resize(routes * I);
  float* a = a_buf.data();

  // Phase 1: tasks = (expert group, block of gate/up row pairs).
  const int64_t rpt1 = RowsPerTask(2 * H * egu, I, 2, threads);
  const int64_t blocks1 = (I + rpt1 - 1) / rpt1;
  run(G * blocks1, [&](int64_t task) {
    const int64_t grp = task / blocks1, blk = task % blocks1;
    const size_t e = static_cast<size_t>(g.expert[grp]);
    const WG* gu = reinterpret_cast<const WG*>(m.gate_up + e * m.gate_up_stride);
    const uint8_t* bias = m.gate_up_bias == nullptr ? nullptr : m.gate_up_bias + e * m.gate_up_bias_stride;
    GateUpRows<WG>(avx2, gu, bias, m.gate_up_bias_dtype, g, grp, x, H, I, act, blk * rpt1,
                   std::min(I, (blk + 1) * rpt1), a);
  });

  // Phase 2: tasks = blocks of output rows h (all experts inside one task: fixed accumulation order).
  const int64_t rpt2 = RowsPerTask(static_cast<size_t>(G) * I * ed, H, 4, threads);
  const int64_t blocks2 = (H + rpt2 - 1) / rpt2;
  run(blocks2, [&](int64_t blk) {
    DownRows<WD>(avx2, m, g, a, T, blk * rpt2, std::min(H, (blk + 1) * rpt2), y);
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

std::string CheckExpertIds(const int32_t* ids, int64_t n, int64_t num_experts, const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] >= num_experts) {
      return "id " + std::to_string(ids[i]) + " at position " + std::to_string(i) + " is out of range for " + what +
             " (expected -1 or 0.." + std::to_string(num_experts - 1) + ")";
    }
  }
  return "";
}

void RunExperts(const ExpertWeights& m, const float* x, const int32_t* ids, const float* weights, int64_t T,
                int64_t k, const ExpertActivation& act, float* y, xla::ffi::ThreadPool& pool) {
  thread_local Groups groups;
  GroupRoutes(ids, weights, T, k, &groups);
  if (groups.expert.empty()) {
    std::fill(y, y + T * m.hidden, 0.0f);
    return;
  }
  const bool gu_bf16 = m.gate_up_dtype == static_cast<int32_t>(BankDType::kBF16);
  const bool dn_bf16 = m.down_dtype == static_cast<int32_t>(BankDType::kBF16);
  if (gu_bf16 && dn_bf16) {
    RunTyped<uint16_t, uint16_t>(m, x, groups, T, act, y, pool);
  } else if (gu_bf16) {
    RunTyped<uint16_t, float>(m, x, groups, T, act, y, pool);
  } else if (dn_bf16) {
    RunTyped<float, uint16_t>(m, x, groups, T, act, y, pool);
  } else {
    RunTyped<float, float>(m, x, groups, T, act, y, pool);
  }
}

const char* KernelIsa() { return UseAvx2() ? "avx2" : "generic"; }


}  // namespace ft_jax
