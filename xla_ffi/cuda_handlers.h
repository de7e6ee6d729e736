// XLA FFI handlers for the CUDA platform (built only when CMake finds nvcc: FT_JAX_CUDA). Registered by ft_jax under
// the CPU handlers' target names where the call structure is the same, with platform "CUDA":
//
//   FtJaxSlotFillCuda          same operands, results and attributes as FtJaxSlotFill (ffi_handlers.h): flat_ids
//   (+ ...Instantiate)         i32[N], slot_ids i32[N], pools ... (aliased) -> pools ..., errors i32[]; attr banks.
//                              One kernel reads the ids from device memory and copies 16-byte vectors from the
//                              device-mapped host banks (host_bank_cuda.h) into the slots; invalid entries are
//                              skipped and counted in `errors`. Command-buffer compatible.
//   FtJaxHostExpertsSubmit     x f32|bf16 [T, H], flat_ids i32[T, k], weights f32[T, k] -> ticket u8[] (orders the
//   (+ ...Instantiate)         wait after the submit); attrs banks, scale_banks, weight_format, block_rows,
//                              block_cols, activation, alpha, limit (as FtJaxHostExperts),
//                              tokens (T), top_k (k), pair (i64, the id shared with its wait, fixed at trace time).
//                              Enqueues D2H copies into pinned staging and a host-function node that hands the expert
//                              GEMV to the CPU WorkerPool. Command-buffer compatible.
//   FtJaxHostExpertsWait       ticket u8[], after f32[T, H] (any value computed after the submit: orders the wait
//                              after the device work) -> y f32[T, H], errors i32[]; attr pair (the submit's). A
//                              host-function node that blocks until the CPU work of that pair's submit is done, then
//                              the H2D copies of y and errors (1: a route id out of range or a released bank, y is
//                              zeros; else 0). Command-buffer compatible.
//
// Host functions call no CUDA API; every per-step value (ids, weights, x) is read on the device or copied by
// stream-ordered nodes, so the work the handlers enqueue replays correctly inside a CUDA graph.
#ifndef FT_JAX_XLA_FFI_CUDA_HANDLERS_H_
#define FT_JAX_XLA_FFI_CUDA_HANDLERS_H_

#include <atomic>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/export.h"

FT_JAX_DECLARE_HANDLER(FtJaxSlotFillCuda);
FT_JAX_DECLARE_HANDLER(FtJaxSlotFillCudaInstantiate);
FT_JAX_DECLARE_HANDLER(FtJaxHostExpertsSubmit);
FT_JAX_DECLARE_HANDLER(FtJaxHostExpertsSubmitInstantiate);
FT_JAX_DECLARE_HANDLER(FtJaxHostExpertsWait);

namespace ft_jax {

// Process-wide event counts of the CUDA handlers (read by ft_jax._ffi.cuda_counters()). A handler body runs when XLA
// executes the custom call directly or records it into a command buffer; a host node runs on every execution,
// replays of a recorded command buffer included. So host_submits - submit_records counts the replays.
struct CudaCounters {
  std::atomic<int64_t> slot_fill_records{0};  // FtJaxSlotFillCuda handler bodies
  std::atomic<int64_t> submit_records{0};     // FtJaxHostExpertsSubmit handler bodies
  std::atomic<int64_t> wait_records{0};       // FtJaxHostExpertsWait handler bodies
  std::atomic<int64_t> host_submits{0};       // submit host-function nodes run
  std::atomic<int64_t> host_waits{0};         // wait host-function nodes run
  std::atomic<int64_t> host_route_errors{0};  // host GEMVs skipped: an id out of range or a released bank
  std::atomic<int64_t> bounce_fills{0};       // slot fill rounds staged through pinned bounce buffers (fallback)
};
CudaCounters& GetCudaCounters();

// Type ids and infos of the CUDA handlers' instantiate states, for jax.ffi.register_ffi_type(platform="CUDA").
void* CudaSlotFillStateTypeId();
void* CudaSlotFillStateTypeInfo();
void* HostChannelTypeId();
void* HostChannelTypeInfo();

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_CUDA_HANDLERS_H_
