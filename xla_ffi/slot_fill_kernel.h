// The CUDA slot fill kernel (slot_fill_kernel.cu), callable from host C++ compiled without nvcc.
//   for every entry n in [begin, end) with flat_ids[n] >= 0 and slot_ids[n] >= 0, for every pool p:
//     pools[p].dst[slot_ids[n]] = pools[p].src[source row]   (rows of pools[p].row_bytes bytes)
//   source row = flat_ids[n] (src is a device-mapped host bank), or n - bounce_base when bounce_base >= 0 (src is a
//   pinned bounce buffer holding entries bounce_base.. in order).
// flat_ids and slot_ids are device pointers read by the kernel (never on the host), so a launch recorded into a CUDA
// graph copies whatever rows the step chose on replay. Entries with flat_ids[n] >= num_rows or slot_ids[n] >=
// num_slots are skipped and counted: *errors += 1 per such entry (atomicAdd; the caller zeroes it first).
// 16-byte vector loads and stores when a pool's rows and bases are 16-byte aligned, 4-byte or 1-byte otherwise.
#ifndef FT_JAX_XLA_FFI_SLOT_FILL_KERNEL_H_
#define FT_JAX_XLA_FFI_SLOT_FILL_KERNEL_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace ft_jax {

constexpr int kMaxFillPools = 8;
constexpr int kMaxFillEntries = 65535;  // gridDim.y limit: entries per launch

struct FillPool {
  const uint8_t* src;  // device address of source row 0
  uint8_t* dst;        // device address of slot 0
  int64_t row_bytes;
};

struct FillParams {
  const int32_t* flat_ids;  // device, [N]
  const int32_t* slot_ids;  // device, [N]
  int32_t begin, end;       // entries of this launch (end - begin <= kMaxFillEntries)
  int32_t bounce_base;      // -1: src rows are flat ids; else n - bounce_base
  int64_t num_rows;         // valid flat ids 0..num_rows-1 (every bank has this many rows)
  int64_t num_slots;        // valid slot ids 0..num_slots-1
  int32_t num_pools;        // <= kMaxFillPools
  FillPool pools[kMaxFillPools];
  int32_t* errors;          // device, i32[]
};

// Enqueues the kernel on `stream` (no synchronisation). Returns the launch error (cudaSuccess if none).
cudaError_t LaunchSlotFill(const FillParams& params, cudaStream_t stream);

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_SLOT_FILL_KERNEL_H_
