#include "xla_ffi/slot_fill_kernel.h"

#include <algorithm>

namespace ft_jax {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // vectors in flight per thread: mapped host reads need many outstanding loads

template <typename V>
__device__ void CopyRow(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t bytes) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = s[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) d[i] = s[i];
}

__global__ void SlotFillKernel(FillParams p) {
  const int32_t n = p.begin + static_cast<int32_t>(blockIdx.y);
  const int32_t fid = p.flat_ids[n], sid = p.slot_ids[n];
  if (fid < 0 || sid < 0) return;  // padding
  if (fid >= p.num_rows || sid >= p.num_slots) {
    if (blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) atomicAdd(p.errors, 1);
    return;
  }
  const FillPool& pool = p.pools[blockIdx.z];
  const int64_t src_row = p.bounce_base < 0 ? fid : n - p.bounce_base;
  const uint8_t* src = pool.src + src_row * pool.row_bytes;
  uint8_t* dst = pool.dst + static_cast<int64_t>(sid) * pool.row_bytes;
  const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                          static_cast<uintptr_t>(pool.row_bytes);
  if (align % 16 == 0) {
    CopyRow<uint4>(src, dst, pool.row_bytes);
  } else if (align % 4 == 0) {
    CopyRow<uint32_t>(src, dst, pool.row_bytes);
  } else {
    CopyRow<uint8_t>(src, dst, pool.row_bytes);
  }
}

}  // namespace

cudaError_t LaunchSlotFill(const FillParams& params, cudaStream_t stream) {
  const int32_t entries = params.end - params.begin;
  if (entries <= 0 || params.num_pools <= 0) return cudaSuccess;
  int64_t max_row = 0;
  for (int p = 0; p < params.num_pools; ++p) max_row = std::max(max_row, params.pools[p].row_bytes);
  // Blocks per row: enough 16-byte vectors in flight to cover the row once (capped; the loop strides over the rest).
  const int64_t per_block = int64_t{kThreads} * kUnroll * 16;
  const unsigned bx = static_cast<unsigned>(std::min<int64_t>((max_row + per_block - 1) / per_block, 1024));
  dim3 grid(std::max(bx, 1u), static_cast<unsigned>(entries), static_cast<unsigned>(params.num_pools));
  SlotFillKernel<<<grid, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace ft_jax
