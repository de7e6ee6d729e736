// Which inner loops the kernels run (dot_kernels.h), chosen once per process from the CPU's features.
#ifndef FT_JAX_XLA_FFI_ISA_H_
#define FT_JAX_XLA_FFI_ISA_H_

namespace ft_jax {

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512Bf16 = 2 };

// The best path the CPU has, capped by FT_JAX_KERNEL ("generic" or "avx2"; read once).
Isa KernelIsaLevel();

// KernelIsaLevel() as text: "avx512bf16" (AVX-512 F/BW/VL/BF16: bf16 dots, the
// 16-lane dequantizing paths), "avx2" (AVX2 + FMA + F16C) or "generic".
const char* KernelIsa();

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_ISA_H_
