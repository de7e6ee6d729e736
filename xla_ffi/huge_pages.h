// Transparent huge pages for buffers ft_jax does not allocate itself (the decode step's dense weights).
#ifndef FT_JAX_XLA_FFI_HUGE_PAGES_H_
#define FT_JAX_XLA_FFI_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>

namespace ft_jax {

// Advises the 2 MiB-aligned interior of [address, address + nbytes) onto huge pages: MADV_HUGEPAGE for what is
// mapped later, and for what is mapped now MADV_COLLAPSE (Linux >= 6.1), or when the interior is all zeros
// MADV_DONTNEED (its pages are dropped and read back as zeros; later writes fault in huge pages). The buffer must be
// private anonymous memory (malloc'd, as XLA's CPU buffers are) that nothing writes meanwhile. Advisory: returns
// true if the collapse (or the drop) succeeded; errors (older kernel, THP off, other systems) leave the memory as
// it was.
bool UseHugePages(uintptr_t address, size_t nbytes);

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_HUGE_PAGES_H_
