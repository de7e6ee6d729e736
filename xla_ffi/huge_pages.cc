#include "xla_ffi/huge_pages.h"

#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace ft_jax {

namespace {

// True if every byte of [p, p + n) is zero (n a multiple of 8, p 8-byte aligned); stops at the first non-zero block.
bool AllZero(const uint8_t* p, size_t n) {
  constexpr size_t kBlock = 4096;
  for (size_t off = 0; off < n; off += kBlock) {
    const size_t len = n - off < kBlock ? n - off : kBlock;
    uint64_t acc = 0;
    for (size_t i = 0; i < len; i += 8) {
      uint64_t v;
      std::memcpy(&v, p + off + i, 8);
      acc |= v;
    }
    if (acc != 0) return false;
  }
  return true;
}

}  // namespace

bool UseHugePages(uintptr_t address, size_t nbytes) {
#if defined(__linux__)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE, absent from older headers
  const uintptr_t begin = (address + kHuge - 1) & ~(kHuge - 1), end = (address + nbytes) & ~(kHuge - 1);
  if (end <= begin) return false;
  void* p = reinterpret_cast<void*>(begin);
  madvise(p, end - begin, MADV_HUGEPAGE);
  // A zero-filled buffer (a cold slot pool, a fresh KV cache): dropping its pages keeps its content (private
  // anonymous memory reads back as zeros) and the writes that come later fault in huge pages; far cheaper than a
  // collapse, which allocates huge pages and copies the zeros into them.
  if (AllZero(reinterpret_cast<const uint8_t*>(p), end - begin)) return madvise(p, end - begin, MADV_DONTNEED) == 0;
  return madvise(p, end - begin, kMadvCollapse) == 0;
#else
  (void)address;
  (void)nbytes;
  return false;
#endif
}

}  // namespace ft_jax
