// What every CPU handler shares: dtype tests, bf16 widening, shape text and FFI errors named after the op, the
// exception guard of a handler body, FT_JAX_NUM_THREADS, and per-thread scratch that is bounded between calls.
#ifndef FT_JAX_XLA_FFI_COMMON_H_
#define FT_JAX_XLA_FFI_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/host_bank.h"

namespace ft_jax {

// Expert weights, biases and activations are float32 or bfloat16 (codes are XLA FFI data type codes).
inline bool IsWeightDType(int32_t code) {
  return code == static_cast<int32_t>(BankDType::kF32) || code == static_cast<int32_t>(BankDType::kBF16);
}
inline bool IsWeightDType(xla::ffi::DataType t) { return IsWeightDType(static_cast<int32_t>(t)); }

// bf16 data, or uint16 holding bf16 bits (how ft_jax keeps a bf16 embedding table and KV cache).
inline bool IsBf16Bits(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::BF16 || t == xla::ffi::DataType::U16;
}

// dst[i] = src[i] for bf16 bits src (exact: a bf16 value is a float32 with the low 16 bits zero).
inline void WidenBf16(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&dst[i], &bits, sizeof(float));
  }
}

// "[2, 8, 4]" for error messages.
inline std::string Dims(xla::ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// "op: message" as an FFI error (InvalidArgument: the caller's inputs; Internal: anything else).
inline xla::ffi::Error InvalidArgument(const char* op, const std::string& message) {
  return xla::ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// A spin-wait loop's pause (x86 PAUSE: the core yields to its sibling and leaves the loop without a memory-order
// flush); a no-op elsewhere. ParallelFor's caller and the kernel helpers poll with it.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Runs a handler body; an exception (a task of ParallelFor included, parallel.h) becomes an FFI error naming the op
// instead of unwinding into XLA.
template <typename Body>
xla::ffi::Error Guarded(const char* op, const Body& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted, std::string(op) + ": out of memory");
  } catch (const std::exception& e) {
    return xla::ffi::Error::Internal(std::string(op) + ": " + e.what());
  } catch (...) {
    return xla::ffi::Error::Internal(std::string(op) + ": unknown exception");
  }
}

// The environment variable `name` as an integer in [lo, hi]: ASCII decimal digits, spaces around them allowed (the
// rule ft_jax.kernels.environment_problem checks at launch and warns about); `fallback` when it is unset or anything
// else (a sign, an exponent, other text, out of range).
inline int64_t EnvInteger(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr) return fallback;
  while (*s == ' ' || (*s >= '\t' && *s <= '\r')) ++s;
  int64_t v = 0;
  const char* digits = s;
  for (; *s >= '0' && *s <= '9'; ++s) {
    if (v > hi) return fallback;  // stops before it can overflow: hi is far below INT64_MAX / 10
    v = 10 * v + (*s - '0');
  }
  while (*s == ' ' || (*s >= '\t' && *s <= '\r')) ++s;
  return s == digits || *s != '\0' || v < lo || v > hi ? fallback : v;
}

// FT_JAX_NUM_THREADS (read once per process): the most threads a loop or the worker pool uses; 0 when unset/invalid.
inline int64_t NumThreadsCap() {
  static const int64_t cap = EnvInteger("FT_JAX_NUM_THREADS", 1, int64_t{1} << 20, 0);
  return cap;
}

// Per-thread scratch kept between calls: at most this many bytes per buffer (docs/DESIGN.md sec. 9).
constexpr size_t kScratchKeepBytes = size_t{16} << 20;
// A larger buffer (a prefill chunk's) goes back, after its call, to one spare per element type shared by all threads,
// kept up to this size: the next chunk's call reuses its pages instead of faulting in fresh ones (sec. 20.11).
constexpr size_t kScratchSpareBytes = size_t{256} << 20;

namespace internal {
// The process's spare large scratch buffer of element type T (empty: none), and its lock.
template <typename T>
struct ScratchSpare {
  static std::mutex& Mutex() {
    static std::mutex mu;
    return mu;
  }
  static std::vector<T>& Buffer() {
    static std::vector<T> buffer;
    return buffer;
  }
};
}  // namespace internal

// A call's view of a thread_local buffer: grown to n elements for the call. Up to kScratchKeepBytes it stays with
// the thread for its next call; a larger one is taken from and given back to the process's one spare (kept up to
// kScratchSpareBytes; also on error), so a large prefill neither pins its scratch on every thread nor faults in
// fresh pages on every chunk.
template <typename T>
class Scratch {
 public:
  Scratch(std::vector<T>& storage, size_t n) : storage_(storage) {
    if (n * sizeof(T) > kScratchKeepBytes && storage_.capacity() * sizeof(T) <= kScratchKeepBytes) {
      std::lock_guard<std::mutex> lock(internal::ScratchSpare<T>::Mutex());
      std::vector<T>& spare = internal::ScratchSpare<T>::Buffer();
      if (spare.capacity() > storage_.capacity()) storage_.swap(spare);
    }
    if (storage_.size() < n) storage_.resize(n);
  }
  ~Scratch() {
    if (storage_.capacity() * sizeof(T) <= kScratchKeepBytes) return;
    std::vector<T> large;
    large.swap(storage_);
    if (large.capacity() * sizeof(T) > kScratchSpareBytes) return;  // freed
    std::lock_guard<std::mutex> lock(internal::ScratchSpare<T>::Mutex());
    std::vector<T>& spare = internal::ScratchSpare<T>::Buffer();
    if (large.capacity() > spare.capacity()) spare.swap(large);  // the larger one is kept, the other freed
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* data() { return storage_.data(); }

 private:
  std::vector<T>& storage_;
};

}  // namespace ft_jax

#endif  // FT_JAX_XLA_FFI_COMMON_H_
