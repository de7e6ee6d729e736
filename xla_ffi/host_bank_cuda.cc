#include "xla_ffi/host_bank_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace ft_jax {
namespace {

class CudaBankMapping final : public BankDeviceMapping {
 public:
  ~CudaBankMapping() override {
    for (void* p : chunks_) cudaHostUnregister(p);
  }
  uint8_t* device_data() const override { return device_; }

  // Registers [data, data + nbytes) chunk by chunk; on failure undoes what was registered and returns the reason.
  std::string Register(uint8_t* data, size_t nbytes) {
    for (size_t off = 0; off < nbytes; off += kRegisterChunkBytes) {
      const size_t n = std::min(kRegisterChunkBytes, nbytes - off);
      cudaError_t err = cudaHostRegister(data + off, n, cudaHostRegisterMapped | cudaHostRegisterPortable);
      if (err != cudaSuccess) return Fail("cudaHostRegister of " + std::to_string(n) + " bytes at offset " +
                                          std::to_string(off), err);
      chunks_.push_back(data + off);
      void* dev = nullptr;
      err = cudaHostGetDevicePointer(&dev, data + off, 0);
      if (err != cudaSuccess) return Fail("cudaHostGetDevicePointer", err);
      if (off == 0) {
        device_ = static_cast<uint8_t*>(dev);
      } else if (static_cast<uint8_t*>(dev) != device_ + off) {
        return Fail("the registered chunks are not contiguous in the device address space", cudaSuccess);
      }
    }
    return "";
  }

 private:
  std::string Fail(const std::string& what, cudaError_t err) {
    cudaGetLastError();  // clear the sticky-free error so the next CUDA call does not report it
    for (void* p : chunks_) cudaHostUnregister(p);
    cudaGetLastError();
    chunks_.clear();
    device_ = nullptr;
    return err == cudaSuccess ? what : what + ": " + cudaGetErrorString(err);
  }

  std::vector<void*> chunks_;
  uint8_t* device_ = nullptr;
};

}  // namespace

uint8_t* MappedDeviceData(Bank& bank) {
  const BankDeviceMapping& mapping = bank.DeviceMapping([](const Bank& b) -> std::unique_ptr<BankDeviceMapping> {
    auto m = std::make_unique<CudaBankMapping>();
    const char* off = std::getenv("FT_JAX_NO_HOST_REGISTER");
    // Rows placed at their file offsets (Bank::row_offsets) leave gaps that registering would commit, and the fill
    // kernel reads rows at one stride: such a bank is staged.
    std::string why = off && std::string(off) == "1" ? std::string("FT_JAX_NO_HOST_REGISTER=1")
                      : b.row_offsets() != nullptr   ? std::string("its rows are not at one stride")
                                                     : m->Register(b.map_begin(), b.map_bytes());
    if (!why.empty()) {
      std::fprintf(stderr, "ft_jax: warning: %s not mapped for the GPU (%s); slot fills stage its rows through pinned "
                   "bounce buffers (slower)\n", b.Describe().c_str(), why.c_str());
    }
    return m;
  });
  // Registered from the page-aligned start of the mapping; the data starts page_offset % page size bytes into it.
  uint8_t* base = mapping.device_data();
  return base == nullptr ? nullptr : base + (bank.data() - bank.map_begin());
}

}  // namespace ft_jax
