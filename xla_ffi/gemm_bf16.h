// bf16 x bf16 products of many rows and many tokens (prefill) in register tiles, bit for bit what DotRowBf16
// (dot_kernels.h) gives for every (row, token) pair.
//
// DotRowBf16 sums a dot in A = kBf16Accumulators (2) accumulators of 16 float32 lanes: accumulator a takes the
// 32-element chunks at i = 64 j + 32 a (VDPBF16PS), then a last chunk of 32 goes to accumulator 0, the two are added,
// reduced across lanes, and the last len % 32 products are added one by one. Each accumulator's value depends only on
// the order of its own additions, so the A may be computed one after the other: a tile of R rows x T tokens runs A
// passes, pass a holding R x T accumulators in registers (one per output) over the chunks of accumulator a, each
// weight chunk loaded once for T tokens and each token chunk once for R rows (R + T loads for R x T VDPBF16PS, against
// about 1 load per VDPBF16PS for DotRowBf16Tokens). The A partial vectors of every output are kept and added in
// DotRowBf16's order. Over the A passes every 64-byte line of the tile's rows and tokens is read once, so the tile's
// data is read once from L2 whatever the pass order. Measured (docs/DESIGN.md sec. 16, with 8 accumulators then):
// 4 rows x 6 tokens ran at 1.9x the row-by-row DotRows on one core; sec. 20.15: from 3 tokens on, a decode call's
// rows read faster through the tiles than row by row.
//
// Bit-identity is what lets the expert kernel use the tiles for an expert with many tokens and DotRows for one with
// few: a token's result never depends on how many other tokens share its expert (chunked prefill equals unchunked,
// a batch row equals the row alone, prefill's rows equal decode's).
#ifndef FT_JAX_XLA_FFI_GEMM_BF16_H_
#define FT_JAX_XLA_FFI_GEMM_BF16_H_

#include <algorithm>
#include <cstdint>

#include "xla_ffi/dot_kernels.h"

namespace ft_jax {

// Tokens from which DotRowsView runs its bf16 x bf16 rows through the tiles (fewer: DotRows, each row read once as
// one stream for one or two tokens; at 3 tokens per expert the tiles read the bench shape's rows at 25 against 18 GB/s
// on 2 threads, docs/DESIGN.md sec. 20.15).
constexpr int64_t kBf16TileMinTokens = 3;

// Elements between tokens of bf16 activations laid out for the tiles: cols rounded up to 32, plus 64, and more until
// the row bytes are not a multiple of 1 KiB. A pass of a tile reads every A-th 64-byte line of its 4 rows and 6 tokens;
// rows a multiple of 4 KiB apart (cols 2048) put all those lines in the same few L1 sets, which hold 8 lines each, so
// the tokens evicted the rows on every pass. Measured on one core (AMD EPYC, 4 x 6 tiles, 128 tokens): cols 2048 with
// a stride of 2048 ran at 86-90 GFLOP/s, with 2112 at 145-154; cols 5632 (11 KiB rows) 96-98 against 136 at 5696.
inline int64_t Bf16TokenStride(int64_t cols) {
  int64_t s = (cols + 31) / 32 * 32 + 64;
  while ((2 * s) % 1024 == 0) s += 32;
  return s;
}

namespace gemm_bf16 {

constexpr int kRows = 4;    // R: rows of a register tile
constexpr int kTokens = 6;  // T: tokens of a register tile (R x T = 24 accumulators + R + 1 loaded vectors)

}  // namespace gemm_bf16

#if FT_JAX_HAVE_AVX2_PATH
namespace gemm_bf16 {

// acc[r][t] += the 32-element chunk at i of row r times that of token t (VDPBF16PS): R + NT loads, R x NT products.
template <int R, int NT>
FT_JAX_AVX512BF16 inline void Chunk(const uint16_t* const* wr, const uint16_t* const* xt, int64_t i,
                                    __m512 (&acc)[R][NT]) {
  __m512i wv[R];
  for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(wr[r] + i);
  for (int t = 0; t < NT; ++t) {
    const __m512i xv = _mm512_loadu_si512(xt[t] + i);
    for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
  }
}

// One tile: rows r0 .. r0 + R - 1 of w ([rows, len], row r at w + r * len) times tokens t0 .. t0 + NT - 1 of xb
// ([T, len]) into out[t * out_stride + r], as DotRowBf16 computes each. Meanwhile the 64-byte lines [pf, pf_end) (the
// next group's rows) are prefetched into L2, up to R lines per chunk step of the passes: spread over the tile's run, so
// the memory stream keeps going while the tile computes (a burst before the tile overlapped little: below).
template <int R, int NT>
FT_JAX_AVX512BF16 void Tile(const uint16_t* w, int64_t len, int64_t r0, const uint16_t* xb, int64_t xs, int64_t t0,
                            float* out, int64_t out_stride, const char* pf, const char* pf_end) {
  constexpr int A = kBf16Accumulators;
  const int64_t full = len / (32 * A) * (32 * A);  // elements of the A-accumulator loop of DotRowBf16Tokens
  const uint16_t* wr[R];
  const uint16_t* xt[NT];
  for (int r = 0; r < R; ++r) wr[r] = w + (r0 + r) * len;
  for (int t = 0; t < NT; ++t) xt[t] = xb + (t0 + t) * xs;
  __m512 part[A][R][NT];  // accumulator a of every output
  for (int a = 0; a < A; ++a) {
    __m512 acc[R][NT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 32 * a; i < full; i += 32 * A) {
      for (int r = 0; r < R && pf < pf_end; ++r, pf += 64) __builtin_prefetch(pf, 0, 2);
      Chunk<R, NT>(wr, xt, i, acc);
    }
    if (a == 0)  // the chunk past the A-accumulator loop, into accumulator 0
      for (int64_t i = full; i + 32 <= len; i += 32) Chunk<R, NT>(wr, xt, i, acc);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) part[a][r][t] = acc[r][t];
  }
  const int64_t tail = len / 32 * 32;
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) {
      __m512 v[A];
      for (int a = 0; a < A; ++a) v[a] = part[a][r][t];
      for (int width = A / 2; width >= 1; width /= 2)
        for (int j = 0; j < width; ++j) v[j] = _mm512_add_ps(v[j], v[j + width]);
      float s = _mm512_reduce_add_ps(v[0]);
      for (int64_t i = tail; i < len; ++i) s += ToF32(wr[r][i]) * ToF32(xt[t][i]);
      out[(t0 + t) * out_stride + r0 + r] = s;
    }
  }
}

// Tokens t0 .. t0 + nt - 1 (nt <= kTokens) of rows r0 .. r0 + R - 1.
template <int R>
FT_JAX_AVX512BF16 void TokenTile(int64_t nt, const uint16_t* w, int64_t len, int64_t r0, const uint16_t* xb,
                                 int64_t xs, int64_t t0, float* out, int64_t out_stride, const char* pf = nullptr,
                                 const char* pf_end = nullptr) {
  switch (nt) {
    case 6: return Tile<R, 6>(w, len, r0, xb, xs, t0, out, out_stride, pf, pf_end);
    case 5: return Tile<R, 5>(w, len, r0, xb, xs, t0, out, out_stride, pf, pf_end);
    case 4: return Tile<R, 4>(w, len, r0, xb, xs, t0, out, out_stride, pf, pf_end);
    case 3: return Tile<R, 3>(w, len, r0, xb, xs, t0, out, out_stride, pf, pf_end);
    case 2: return Tile<R, 2>(w, len, r0, xb, xs, t0, out, out_stride, pf, pf_end);
    default: return Tile<R, 1>(w, len, r0, xb, xs, t0, out, out_stride, pf, pf_end);
  }
}

}  // namespace gemm_bf16

// out[t * out_stride + r] = DotRowBf16(w + r * len, xb + t * xs, len) for rows r in [r0, r1) and tokens t < T, bit
// for bit, in register tiles (module comment); a token stride xs of Bf16TokenStride(len) runs fastest. Rows are taken
// kRows at a time, each group against every token: the group's rows stay in L1 while the tokens stream from L2; the
// last r1 - r0 mod kRows rows form one narrower tile. The T tokens go into ceil(T / kTokens) tiles of sizes that
// differ by at most one (8 tokens: 4 + 4, not 6 + 2, whose 2-token tile loads 6 vectors per 8 products).
// Callers should hand out row ranges of a multiple of kRows (a tile of 1 row loads 7 vectors per 6 products).
// Needs the AVX-512 BF16 level (Isa::kAvx512Bf16).
FT_JAX_AVX512BF16 inline void DotRowsBf16Tiled(const uint16_t* w, int64_t len, int64_t r0, int64_t r1,
                                               const uint16_t* xb, int64_t xs, int64_t T, float* out,
                                               int64_t out_stride) {
  using namespace gemm_bf16;
  if (T <= 0) return;
  const int64_t tiles = (T + kTokens - 1) / kTokens, base = T / tiles, extra = T % tiles;
  auto first = [&](int64_t i) { return i * base + std::min(i, extra); };  // tile i: tokens first(i) .. first(i + 1)
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) {
    // the next group's rows (contiguous) into L2 while this group runs, a share per token tile, spread over its
    // passes (4 rows of 2048: 256 lines over 64 chunk steps). Measured against one burst before the tile (host_experts
    // on the bench shape, bf16, every token to the same 2 experts, 2 threads, 3 alternated rounds; GB/s of weights):
    // T = 4 13-17 -> 23-24, T = 6 11-15 -> 20-21, T = 8 14-15 -> 16-17, T = 12 12 -> 13-14, T >= 24 unchanged
    // (compute-bound). Prefetching 2 or 4 groups ahead, or the first group in a burst too, measured no better.
    const char* next = reinterpret_cast<const char*>(w + (r + kRows) * len);
    const int64_t next_lines = (std::min(r1, r + 2 * kRows) - std::min(r1, r + kRows)) * len * 2 / 64;
    const int64_t per_tile = (next_lines + tiles - 1) / tiles;
    for (int64_t i = 0, line = 0; i < tiles; ++i) {
      const int64_t end = std::min(next_lines, line + per_tile);
      TokenTile<kRows>(first(i + 1) - first(i), w, len, r, xb, xs, first(i), out, out_stride, next + 64 * line,
                       next + 64 * end);
      line = end;
    }
  }
  const int64_t left = r1 - r;  // 0 .. kRows - 1 rows: one tile of that many rows
  for (int64_t i = 0; i < tiles && left > 0; ++i) {
    const int64_t t = first(i), nt = first(i + 1) - t;
    if (left == 3) TokenTile<3>(nt, w, len, r, xb, xs, t, out, out_stride);
    if (left == 2) TokenTile<2>(nt, w, len, r, xb, xs, t, out, out_stride);
    if (left == 1) TokenTile<1>(nt, w, len, r, xb, xs, t, out, out_stride);
  }
}
#endif

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_GEMM_BF16_H_
