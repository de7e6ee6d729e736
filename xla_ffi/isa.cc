#include "xla_ffi/isa.h"

#include <cstdlib>
#include <string_view>

#include "xla_ffi/dot_kernels.h"  // FT_JAX_HAVE_AVX2_PATH

namespace ft_jax {

Isa KernelIsaLevel() {
  static const Isa isa = [] {
#if FT_JAX_HAVE_AVX2_PATH
    const char* env = std::getenv("FT_JAX_KERNEL");
    const std::string_view cap = env ? env : "";
    if (cap == "generic" || !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                              __builtin_cpu_supports("f16c")))
      return Isa::kGeneric;
    if (cap == "avx2" || !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512bf16")))
      return Isa::kAvx2;
    return Isa::kAvx512Bf16;
#else
    return Isa::kGeneric;
#endif
  }();
  return isa;
}

const char* KernelIsa() {
  switch (KernelIsaLevel()) {
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

}  // namespace ft_jax
