// Host banks on CUDA builds: page-locked and mapped into the device address space, so a kernel reads bank rows
// straight over PCIe / NVLink-C2C (zero-copy) with no host-side copy and no per-step host decision.
//
// MappedDeviceData(bank) registers the bank on first use with cudaHostRegister(cudaHostRegisterMapped |
// cudaHostRegisterPortable) in chunks of kRegisterChunkBytes (single registrations of hundreds of GiB fail) and
// returns the device address of row 0 (cudaHostGetDevicePointer; the chunks must be contiguous there, as they are
// under unified addressing). The registration lives as long as the bank (it is undone before the memory is
// unmapped). When registration fails, or FT_JAX_NO_HOST_REGISTER=1 is set, it prints one warning line naming the
// bank and the CUDA error, clears the error (cudaGetLastError) and returns nullptr: callers then stage rows through
// pinned bounce buffers.
#ifndef FT_JAX_XLA_FFI_HOST_BANK_CUDA_H_
#define FT_JAX_XLA_FFI_HOST_BANK_CUDA_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/host_bank.h"

namespace ft_jax {

constexpr size_t kRegisterChunkBytes = size_t{1} << 30;  // 1 GiB per cudaHostRegister call

uint8_t* MappedDeviceData(Bank& bank);

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_HOST_BANK_CUDA_H_
