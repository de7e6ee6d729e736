// The loader's NaN / Inf check of a tensor's stored bytes, on several threads: the checkpoint's expert tensors are
// mapped from the page cache (no copy), so this check is the one pass that reads them while loading, and numpy's
// single-threaded reductions read only ~9 GB/s (docs/DESIGN.md sec. 20.18). No nanobind or Python dependency
// (module.cc binds it as _ffi.first_non_finite).
#pragma once

#include <cstdint>

namespace ft_jax {

// The index of the first element of data[0:count] (elements of elem_bytes = 1, 2, 4 or 8 bytes, read as unsigned
// integers of that width, any alignment) whose magnitude bits (the element with its sign bit cleared) are >= mask, or
// -1 when there is none. With mask = the exponent field (IEEE 754 binary16/32/64 and bfloat16: all ones; float8
// e4m3fn: its one NaN magnitude 0x7F) these are exactly the Inf and NaN elements. The range is split in contiguous
// parts (>= 8 MiB each; at most `threads` of them, or with threads <= 0 the shared WorkerPool's loop threads), run by
// ParallelFor on WorkerPool::Shared(); each part stops at its first hit.
// Returns -2 for an elem_bytes other than 1, 2, 4 or 8.
int64_t FirstNonFinite(const void* data, int64_t count, int elem_bytes, uint64_t mask, int threads);

}  // namespace ft_jax
