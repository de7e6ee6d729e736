#include "xla_ffi/huge_pages.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace ft_jax {

bool UseHugePages(uintptr_t address, size_t nbytes) {
#if defined(__linux__)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE, absent from older headers
  const uintptr_t begin = (address + kHuge - 1) & ~(kHuge - 1), end = (address + nbytes) & ~(kHuge - 1);
  if (end <= begin) return false;
  void* p = reinterpret_cast<void*>(begin);
  madvise(p, end - begin, MADV_HUGEPAGE);
  return madvise(p, end - begin, kMadvCollapse) == 0;
#else
  (void)address;
  (void)nbytes;
  return false;
#endif
}

}  // namespace ft_jax
