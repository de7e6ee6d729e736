// decode_attention: one decode step's grouped-query softmax attention on the CPU backend, over the KV cache as the
// model stores it (one query per row).
//   s[j]   = round(round(q_h . k_j) * scale)              over the keys j a row's query sees (round: to the model
//                                                         dtype, as transformers' bf16 matmul and its scaling)
//   p[j]   = round(exp(s[j] - m) / (sum_j' exp(s[j'] - m) + exp(sink_h - m))),  m = max(max_j s[j], sink_h)
//   out_h  = round(sum_j p[j] v_j)                        (float32 sums; no sink: its terms are absent)
// where query head h reads KV head h / G (G = NH / KVH; transformers' repeat_kv) and a row at position p sees the keys
// at cache indices max(0, p - window + 1) .. p (transformers' eager_attention_forward with its causal and sliding-
// window masks; gpt-oss's sinks: softmax(concat(scores, sink))[:-1]).
// operands: q f32|bf16 [B, NH, D]; k_cache, v_cache [n, Bc, S, KVH, D] f32 or u16|bf16 (bf16 bits: how ft_jax keeps
//           a bf16 cache) with the dtype of q; layer s32[]; rows s32[B] (the cache row of each query row);
//           positions s32[B] (< S; -1: padding, whose output is zeros); window s32[] (>= S: no window); then
//           optionally sinks f32[NH] (this layer's sink logits)
// attrs:    scale (f32: the score scaling, head_dim^-0.5)
// result:   out [B, NH, D] of q's dtype
// It replaces about 12 XLA thunks per layer, among them a YNNPACK dot whose thread handoff cost more than the whole
// product, and the float32 copies of the layer's key and value blocks (docs/DESIGN.md sec. 20.21). A row, or a group
// of its KV heads when there are fewer rows than threads, is a task of the caller's XLA thread pool once the keys and
// values read reach kParallelMinBytes; below that the call runs on the calling thread. Every query head sums in a
// fixed order (the scores and the weighted values of a bf16 cache with VDPBF16PS where the CPU has AVX-512 BF16 and
// D is a multiple of 32 up to 128; float32 lanes otherwise), so results do not depend on the threads, on the other
// rows or on S.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common.h"
#include "xla_ffi/dot_kernels.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/isa.h"
#include "xla_ffi/parallel.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

using I32Scalar = ffi::Buffer<ffi::DataType::S32, 0>;
using I32Vector = ffi::Buffer<ffi::DataType::S32, 1>;

constexpr const char* kOp = "decode_attention";
constexpr int kLanes = 16;  // float lanes of the partial sums of a dot (one AVX-512 register; two AVX2 ones)

// 16 float32 lanes (GCC vector extension): one AVX-512 register, two AVX2 ones, four SSE ones, as the function it is
// inlined into is compiled for (floating-point contraction where the level has FMA).
typedef float F16Lanes __attribute__((vector_size(4 * kLanes)));
typedef int32_t I16Lanes __attribute__((vector_size(4 * kLanes)));
typedef uint32_t U16Lanes __attribute__((vector_size(4 * kLanes)));

inline __attribute__((always_inline)) F16Lanes Broadcast(float x) { return F16Lanes{} + x; }

inline __attribute__((always_inline)) F16Lanes LoadLanes(const float* p) {
  F16Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) void StoreLanes(float* p, F16Lanes v) { std::memcpy(p, &v, sizeof v); }

// Each lane rounded to the nearest bfloat16 (ties to even), as float32; NaN stays NaN.
inline __attribute__((always_inline)) F16Lanes RoundBf16(F16Lanes f) {
  const U16Lanes bits = (U16Lanes)f;
  const U16Lanes rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return (F16Lanes)((bits & 0x7FFFFFFFu) > 0x7F800000u ? bits : rounded);
}


// exp(x) per lane for x <= 0 (x = s - max): Cephes' expf (x = n ln 2 + r with n the nearest integer to x / ln 2,
// found with the 1.5 * 2^23 rounding constant; a degree-6 polynomial in r; ~1 ulp), 0 below -87.3 (where float32
// underflows), NaN for NaN.
inline __attribute__((always_inline)) F16Lanes Exp(F16Lanes x) {
  const F16Lanes low = Broadcast(-87.33654f);
  const F16Lanes xc = x < low ? low : x;
  const F16Lanes t = xc * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23 + n
  const F16Lanes n = t - 12582912.0f;
  const I16Lanes ni = (I16Lanes)t - 0x4B400000;  // n as an integer
  F16Lanes r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F16Lanes p = Broadcast(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const F16Lanes y = p * (F16Lanes)((ni + 127) << 23);
  return x < low ? F16Lanes{} : y;
}

// What one call reads and writes; element pointers of the layer's cache and the step's rows.
struct Problem {
  int64_t B, NH, KVH, D, G, Bc, S;
  bool bf16;
  const void* q;        // [B, NH, D]
  const void* k;        // this layer's keys [Bc, S, KVH, D]
  const void* v;        // this layer's values [Bc, S, KVH, D]
  const int32_t* rows;  // [B]
  const int32_t* positions;  // [B]
  int64_t window;
  const float* sinks;  // [NH] or nullptr
  float scale;
  void* out;  // [B, NH, D]
  int64_t parts = 1;  // tasks per row: its KV heads in this many groups
  bool bf16_dots = false;  // ScoresBf16 and ValuesBf16 (AVX-512 BF16; bf16, D a multiple of 32 up to 128)
};

// The sum of the lanes in a fixed tree: lane l + 8 into lane l, then l + 4, l + 2, l + 1.
inline __attribute__((always_inline)) float SumLanes(F16Lanes v) {
  v += __builtin_shuffle(v, I16Lanes{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  v += __builtin_shuffle(v, I16Lanes{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  v += __builtin_shuffle(v, I16Lanes{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  v += __builtin_shuffle(v, I16Lanes{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  return v[0];
}

// One row of D cache values (bf16 bits or float32) as float32 in dst[0 .. D), zeros up to Dp.
inline __attribute__((always_inline)) void WidenRow(const void* base, bool bf16, size_t at, int64_t D, int64_t Dp,
                                                    float* __restrict dst) {
  if (bf16) {
    WidenBf16(static_cast<const uint16_t*>(base) + at, dst, static_cast<size_t>(D));
  } else {
    const float* __restrict src = static_cast<const float*>(base) + at;
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d];
  }
  for (int64_t d = D; d < Dp; ++d) dst[d] = 0.0f;
}

// sum_d a[d] b[d] over Dp (a multiple of kLanes): kLanes partial sums, then SumLanes.
inline __attribute__((always_inline)) float Dot(const float* __restrict a, const float* __restrict b, int64_t Dp) {
  F16Lanes acc = {};
  for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) acc += LoadLanes(a + d0) * LoadLanes(b + d0);
  return SumLanes(acc);
}

#if FT_JAX_HAVE_AVX2_PATH
// The raw scores s[e * ns + j] = q_e . k_j of query heads e in [0, QH) (KV head e / G) over keys j in [0, n), q and
// the keys bf16 as stored (key j's KV head h at k + j * key_stride + h * D), with VDPBF16PS: the queries of 4 heads
// stay in registers (D / 32 <= 4 vectors each) while the keys pass. Float32 sums of the exact bf16 products.
FT_JAX_AVX512BF16 void ScoresBf16(const uint16_t* q, const uint16_t* k, size_t key_stride, int64_t QH, int64_t G,
                                  int64_t D, int64_t n, int64_t ns, float* s) {
  const int64_t C = D / 32;  // vectors of 32 bf16 per row
  for (int64_t e0 = 0; e0 < QH; e0 += 4) {
    const int64_t heads = std::min<int64_t>(4, QH - e0);
    __m512i q0[4], q1[4], q2[4], q3[4];  // the queries of heads e0 .. e0 + 3 (zeros past QH)
    const uint16_t* kh[4];               // their KV heads' first key
    __m512i* qs[4] = {q0, q1, q2, q3};
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t c = 0; c < 4; ++c)
        qs[i][c] = i < heads && c < C ? _mm512_loadu_si512(q + (e0 + i) * D + 32 * c) : _mm512_setzero_si512();
    for (int64_t i = 0; i < 4; ++i) kh[i] = k + std::min(e0 + i, QH - 1) / G * D;
    for (int64_t j = 0; j < n; ++j) {
      const size_t at = static_cast<size_t>(j) * key_stride;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)q0[c], (__m512bh)_mm512_loadu_si512(kh[0] + at + 32 * c));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)q1[c], (__m512bh)_mm512_loadu_si512(kh[1] + at + 32 * c));
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)q2[c], (__m512bh)_mm512_loadu_si512(kh[2] + at + 32 * c));
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)q3[c], (__m512bh)_mm512_loadu_si512(kh[3] + at + 32 * c));
      }
      const float sums[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),
                             _mm512_reduce_add_ps(a3)};
      for (int64_t i = 0; i < heads; ++i) s[(e0 + i) * ns + j] = sums[i];
    }
  }
}

// sums[e, d] = sum_j p[e * ns + j] v_j[d] of query heads e in [0, QH) (KV head e / G) over keys j in [0, n), the
// values bf16 as stored (as ScoresBf16's keys) and the weights bf16 values (p rounded; p[e * ns + n] = 0 when n is
// odd), with VDPBF16PS: keys in pairs, the two value rows interleaved (VPUNPCKLWD / VPUNPCKHWD: within each 128-bit
// lane, elements 0-3 then 4-7 of both rows) and each head's pair of weights broadcast, one dot adding both keys'
// products. Blocks of kPairBlock pairs keep 2 x 8 heads' sums in registers; each block's sums are added to `sums`
// (float32 [QH, D], zeros on entry) in that interleaved order and put back in element order at the end. pairs:
// scratch of QH * ceil(n / 2) words.
constexpr int64_t kPairBlock = 32;
FT_JAX_AVX512BF16 void ValuesBf16(const uint16_t* v, size_t key_stride, const float* p, int64_t QH, int64_t G,
                                  int64_t D, int64_t n, int64_t ns, float* sums, uint32_t* pairs) {
  const int64_t np = (n + 1) / 2, C = D / 32;
  for (int64_t e = 0; e < QH; ++e)
    for (int64_t i = 0; i < np; ++i) {
      uint32_t a, b;
      std::memcpy(&a, p + e * ns + 2 * i, 4);
      std::memcpy(&b, p + e * ns + 2 * i + 1, 4);
      pairs[e * np + i] = (a >> 16) | (b & 0xFFFF0000u);
    }
  for (int64_t i0 = 0; i0 < np; i0 += kPairBlock) {
    const int64_t i1 = std::min(np, i0 + kPairBlock);
    for (int64_t e0 = 0, heads = 0; e0 < QH; e0 += heads) {  // up to 8 query heads of one KV head at a time
      const int64_t h = e0 / G;
      heads = std::min<int64_t>({8, QH - e0, (h + 1) * G - e0});
      const uint16_t* vh = v + h * D;
      for (int64_t c = 0; c < C; ++c) {
        __m512 lo[8], hi[8];
        for (int g = 0; g < 8; ++g) lo[g] = hi[g] = _mm512_setzero_ps();
        for (int64_t i = i0; i < i1; ++i) {
          const size_t j = static_cast<size_t>(2 * i);
          const __m512i a = _mm512_loadu_si512(vh + j * key_stride + 32 * c);
          const bool pair = static_cast<int64_t>(j) + 1 < n;  // an odd last key pairs with itself at weight 0
          const __m512i b = pair ? _mm512_loadu_si512(vh + (j + 1) * key_stride + 32 * c) : a;
          const __m512i wl = _mm512_unpacklo_epi16(a, b), wh = _mm512_unpackhi_epi16(a, b);
          for (int g = 0; g < 8; ++g) {
            if (g >= heads) break;
            const __m512i pp = _mm512_set1_epi32(static_cast<int32_t>(pairs[(e0 + g) * np + i]));
            lo[g] = _mm512_dpbf16_ps(lo[g], (__m512bh)wl, (__m512bh)pp);
            hi[g] = _mm512_dpbf16_ps(hi[g], (__m512bh)wh, (__m512bh)pp);
          }
        }
        for (int g = 0; g < heads; ++g) {
          float* sc = sums + (e0 + g) * D + 32 * c;
          _mm512_storeu_ps(sc, _mm512_add_ps(_mm512_loadu_ps(sc), lo[g]));
          _mm512_storeu_ps(sc + 16, _mm512_add_ps(_mm512_loadu_ps(sc + 16), hi[g]));
        }
      }
    }
  }
  // element order: lane l of the low half holds element 8 (l / 4) + l % 4 of the 32, of the high half 8 (l / 4) + 4
  // + l % 4
  float chunk[32];
  for (int64_t e = 0; e < QH; ++e)
    for (int64_t c = 0; c < C; ++c) {
      float* sc = sums + e * D + 32 * c;
      for (int l = 0; l < 16; ++l) chunk[8 * (l / 4) + l % 4] = sc[l], chunk[8 * (l / 4) + 4 + l % 4] = sc[16 + l];
      std::memcpy(sc, chunk, sizeof chunk);
    }
}
#endif

// Keys per block of the value pass: their widened rows stay in L1 while every query head reads them.
constexpr int64_t kValueBlock = 8;

// Scratch of one task, float32: scores [heads, ns], queries [heads, Dp], sums [heads, Dp], cache rows
// [kValueBlock, kv heads, Dp].
struct TaskScratch {
  std::vector<float> scores, queries, sums, rows;
  std::vector<uint32_t> pairs;  // ValuesBf16's packed weights
};

// Row b, KV heads h0 .. h1 - 1: their query heads over their visible keys. The keys and values are read key by key,
// the task's heads of a key being contiguous in the cache (one stream per pass, which the prefetchers follow).
inline __attribute__((always_inline)) void AttendRowHeads(const Problem& pb, int64_t b, int64_t h0, int64_t h1,
                                                          TaskScratch& ts) {
  const int64_t G = pb.G, D = pb.D, KV = h1 - h0, QH = KV * G;  // the task's KV heads and query heads
  const int64_t pos = pb.positions[b];
  const int64_t first = pos < 0 ? 0 : std::max<int64_t>(0, pos - pb.window + 1);
  const int64_t last = std::min<int64_t>(pos, pb.S - 1);  // pos < S (checked by the handler)
  const int64_t n = pos < 0 ? 0 : std::max<int64_t>(0, last - first + 1);
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;  // rows padded to whole lanes (zeros)
  const int64_t ns = (n + kLanes - 1) / kLanes * kLanes;  // score rows padded to whole lanes
  ts.scores.resize(static_cast<size_t>(QH * ns));  // every entry written before it is read
  ts.queries.resize(static_cast<size_t>(QH * Dp));
  ts.sums.assign(static_cast<size_t>(QH * Dp), 0.0f);
  ts.rows.resize(static_cast<size_t>(kValueBlock * KV * Dp));
  float* __restrict s = ts.scores.data();
  float* __restrict qf = ts.queries.data();
  float* __restrict acc = ts.sums.data();
  float* __restrict rows = ts.rows.data();
  const size_t out0 = static_cast<size_t>((b * pb.NH + h0 * G) * D);  // the task's first query head
  const size_t cache_row = static_cast<size_t>(pb.rows[b]) * static_cast<size_t>(pb.S);
  auto cache_at = [&](int64_t j, int64_t h) {  // element offset of key / value j of KV head h0 + h
    return ((cache_row + static_cast<size_t>(j)) * static_cast<size_t>(pb.KVH) + static_cast<size_t>(h0 + h)) *
           static_cast<size_t>(D);
  };
  // raw scores q . k
#if FT_JAX_HAVE_AVX2_PATH
  if (pb.bf16_dots) {
    ScoresBf16(static_cast<const uint16_t*>(pb.q) + out0, static_cast<const uint16_t*>(pb.k) + cache_at(first, 0),
               static_cast<size_t>(pb.KVH * D), QH, G, D, n, ns, s);
  }
#endif
  if (!pb.bf16_dots) {  // each key's rows widened once for the query heads that read them
    for (int64_t e = 0; e < QH; ++e) WidenRow(pb.q, pb.bf16, out0 + static_cast<size_t>(e * D), D, Dp, qf + e * Dp);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < KV; ++h) WidenRow(pb.k, pb.bf16, cache_at(first + j, h), D, Dp, rows + h * Dp);
      for (int64_t e = 0; e < QH; ++e) s[e * ns + j] = Dot(qf + e * Dp, rows + (e / G) * Dp, Dp);
    }
  }
  // per query head: the scores scaled (rounded as transformers' bf16 matmul and scaling), softmax with the sink as
  // one more logit, the weights rounded to the model dtype
  for (int64_t e = 0; e < QH; ++e) {
    float* __restrict se = s + e * ns;
    for (int64_t j = 0; j < ns; j += kLanes) {
      const F16Lanes x = LoadLanes(se + j);
      StoreLanes(se + j, pb.bf16 ? RoundBf16(RoundBf16(x) * pb.scale) : x * pb.scale);
    }
    for (int64_t j = n; j < ns; ++j) se[j] = -INFINITY;  // the padding: weight 0
    F16Lanes mx = Broadcast(-INFINITY);
    for (int64_t j = 0; j < ns; j += kLanes) {
      const F16Lanes x = LoadLanes(se + j);
      mx = mx > x ? mx : x;
    }
    const bool has_sink = pb.sinks != nullptr;
    const float sink = has_sink ? pb.sinks[h0 * G + e] : -INFINITY;
    float m = sink;
    for (int l = 0; l < kLanes; ++l) m = std::max(m, mx[l]);
    F16Lanes total = {};
    for (int64_t j = 0; j < ns; j += kLanes) {
      const F16Lanes x = Exp(LoadLanes(se + j) - m);
      StoreLanes(se + j, x);
      total += x;
    }
    const float l = SumLanes(total) + (has_sink ? Exp(Broadcast(sink - m))[0] : 0.0f);
    const float inv = 1.0f / l;
    for (int64_t j = 0; j < ns; j += kLanes) {
      const F16Lanes w = LoadLanes(se + j) * inv;
      StoreLanes(se + j, pb.bf16 ? RoundBf16(w) : w);
    }
  }
#if FT_JAX_HAVE_AVX2_PATH
  if (pb.bf16_dots) {
    ts.pairs.resize(static_cast<size_t>(QH * ((n + 1) / 2)));
    ValuesBf16(static_cast<const uint16_t*>(pb.v) + cache_at(first, 0), static_cast<size_t>(pb.KVH * D), s, QH, G,
               D, n, ns, acc, ts.pairs.data());  // acc: [QH, D] (Dp = D)
  }
#endif
  // values, kValueBlock keys at a time: sums[e] += p[e, j] v_j in key order, each lane group kept in a register
  // over the block
  for (int64_t j0 = 0; j0 < n && !pb.bf16_dots; j0 += kValueBlock) {
    const int64_t nb = std::min(kValueBlock, n - j0);
    for (int64_t jj = 0; jj < nb; ++jj)
      for (int64_t h = 0; h < KV; ++h)
        WidenRow(pb.v, pb.bf16, cache_at(first + j0 + jj, h), D, Dp, rows + (jj * KV + h) * Dp);
    for (int64_t e = 0; e < QH; ++e) {
      const float* __restrict pe = s + e * ns + j0;
      const float* __restrict ve = rows + (e / G) * Dp;
      for (int64_t d0 = 0; d0 < Dp; d0 += kLanes) {
        F16Lanes a = LoadLanes(acc + e * Dp + d0);
        for (int64_t jj = 0; jj < nb; ++jj) a += pe[jj] * LoadLanes(ve + jj * KV * Dp + d0);
        StoreLanes(acc + e * Dp + d0, a);
      }
    }
  }
  for (int64_t e = 0; e < QH; ++e) {
    const float* __restrict ae = acc + e * Dp;
    if (pb.bf16) {
      uint16_t* __restrict o = static_cast<uint16_t*>(pb.out) + out0 + static_cast<size_t>(e * D);
      for (int64_t d = 0; d < D; ++d) o[d] = ToBf16(ae[d]);
    } else {
      float* __restrict o = static_cast<float*>(pb.out) + out0 + static_cast<size_t>(e * D);
      for (int64_t d = 0; d < D; ++d) o[d] = ae[d];
    }
  }
}

// The same loops compiled for each instruction set (the body inlined into each; F16Lanes).
inline __attribute__((always_inline)) void AttendTask(const Problem& pb, int64_t task) {
  thread_local TaskScratch scratch;
  const int64_t b = task / pb.parts, part = task % pb.parts;
  AttendRowHeads(pb, b, part * pb.KVH / pb.parts, (part + 1) * pb.KVH / pb.parts, scratch);
}
#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl"))) void AttendTaskAvx512(const Problem& pb, int64_t t) {
  AttendTask(pb, t);
}
__attribute__((target("avx2,fma"))) void AttendTaskAvx2(const Problem& pb, int64_t t) { AttendTask(pb, t); }
#endif
void AttendTaskGeneric(const Problem& pb, int64_t t) { AttendTask(pb, t); }

void RunAttention(Problem pb, ffi::ThreadPool& pool) {
  void (*task)(const Problem&, int64_t) = AttendTaskGeneric;
#if defined(__x86_64__)
  const Isa isa = KernelIsaLevel();
  if (isa == Isa::kAvx512Bf16) task = AttendTaskAvx512;
  if (isa == Isa::kAvx2) task = AttendTaskAvx2;
#endif
  size_t keys = 0;  // keys read over the call
  for (int64_t b = 0; b < pb.B; ++b) {
    keys += static_cast<size_t>(std::max<int64_t>(0, std::min<int64_t>(pb.positions[b] + 1, pb.window)));
  }
  const size_t bytes = 2 * keys * static_cast<size_t>(pb.KVH * pb.D) * (pb.bf16 ? 2 : 4);
  const int64_t threads = bytes < kParallelMinBytes ? 1 : LoopThreads(pool);
#if FT_JAX_HAVE_AVX2_PATH
  pb.bf16_dots = pb.bf16 && isa == Isa::kAvx512Bf16 && pb.D % 32 == 0 && pb.D <= 128;
#endif
  // Fewer rows than threads: each row's KV heads in up to `threads` groups (same bits: a head's sums do not depend on
  // the group it is in).
  pb.parts = pb.B >= threads ? 1 : std::min<int64_t>(pb.KVH, (threads + pb.B - 1) / pb.B);
  const int64_t tasks = pb.B * pb.parts;
  if (threads <= 1) return RunOnCaller(tasks, [&](int64_t t) { task(pb, t); });
  ParallelFor(pool, tasks, [&](int64_t t) { task(pb, t); });
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                               ffi::AnyBuffer v_cache, I32Scalar layer, I32Vector rows,
                               I32Vector positions, I32Scalar window, ffi::RemainingArgs extra,
                               ffi::Result<ffi::AnyBuffer> out, float scale) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  const bool bf16 = q.element_type() == ffi::DataType::BF16;
  if (!bf16 && q.element_type() != ffi::DataType::F32) return InvalidArgument(kOp, "q must be f32 or bf16");
  const auto kt = k_cache.element_type(), vt = v_cache.element_type();
  const bool cache_ok = bf16 ? IsBf16Bits(kt) && IsBf16Bits(vt) : kt == ffi::DataType::F32 && vt == ffi::DataType::F32;
  if (!cache_ok) return InvalidArgument(kOp, "the key and value caches must hold q's dtype (bf16 as u16 bits)");
  if (qd.size() != 3 || kd.size() != 5 || Dims(kd) != Dims(vd)) {
    return InvalidArgument(kOp, "q must be [B, NH, D] and the caches [n, Bc, S, KVH, D] alike, got q " + Dims(qd) +
                                    ", k " + Dims(kd) + ", v " + Dims(vd));
  }
  const int64_t B = qd[0], NH = qd[1], D = qd[2], L = kd[0], Bc = kd[1], S = kd[2], KVH = kd[3];
  if (kd[4] != D || KVH <= 0 || NH % KVH != 0 || out->dimensions().size() != 3 || out->dimensions()[0] != B ||
      out->dimensions()[1] != NH || out->dimensions()[2] != D || out->element_type() != q.element_type()) {
    return InvalidArgument(kOp, "q " + Dims(qd) + " does not fit the caches " + Dims(kd) +
                                    " (head_dim, query heads a multiple of the KV heads) or the result");
  }
  if (rows.dimensions()[0] != B || positions.dimensions()[0] != B) {
    return InvalidArgument(kOp, "rows and positions must be [" + std::to_string(B) + "]");
  }
  const float* sinks = nullptr;
  if (extra.size() > 1) return InvalidArgument(kOp, "at most one extra operand (the sinks)");
  if (extra.size() == 1) {
    auto s = extra.get<ffi::AnyBuffer>(0);
    if (!s.has_value() || s->element_type() != ffi::DataType::F32 || s->dimensions().size() != 1 ||
        s->dimensions()[0] != NH) {
      return InvalidArgument(kOp, "sinks must be f32[" + std::to_string(NH) + "]");
    }
    sinks = static_cast<const float*>(s->untyped_data());
  }
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= L) {
    return InvalidArgument(kOp, "layer " + std::to_string(l) + " is out of range for a cache of " +
                                    std::to_string(L) + " layers");
  }
  for (int64_t b = 0; b < B; ++b) {
    const int32_t r = rows.typed_data()[b], p = positions.typed_data()[b];
    if (r < 0 || r >= Bc) {
      return InvalidArgument(kOp, "row " + std::to_string(b) + " reads cache row " + std::to_string(r) +
                                      " of " + std::to_string(Bc));
    }
    if (p >= S) {
      return InvalidArgument(kOp, "row " + std::to_string(b) + " is at position " + std::to_string(p) +
                                      ", past the KV cache of " + std::to_string(S) + " entries");
    }
  }
  const int64_t w = *window.typed_data();
  if (w < 1) return InvalidArgument(kOp, "window must be >= 1, got " + std::to_string(w));
  const size_t elem = bf16 ? 2 : 4;
  const size_t layer_elems = static_cast<size_t>(Bc * S * KVH * D);
  Problem pb{B, NH, KVH, D, NH / KVH, Bc, S, bf16,
             q.untyped_data(),
             static_cast<const char*>(k_cache.untyped_data()) + static_cast<size_t>(l) * layer_elems * elem,
             static_cast<const char*>(v_cache.untyped_data()) + static_cast<size_t>(l) * layer_elems * elem,
             rows.typed_data(), positions.typed_data(), std::min<int64_t>(w, S), sinks, scale,
             out->untyped_data()};
  return Guarded(kOp, [&] {
    RunAttention(pb, pool);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxDecodeAttention, ft_jax::DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ft_jax::I32Scalar>()
                                  .Arg<ft_jax::I32Vector>()
                                  .Arg<ft_jax::I32Vector>()
                                  .Arg<ft_jax::I32Scalar>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));
