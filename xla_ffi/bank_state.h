// Host banks bound to a compiled executable once, at XLA FFI's instantiate stage: the ids (compile-time attributes)
// are looked up in the registry there and the banks kept alive in a BoundBanks state. The execute stage only checks
// each bank's `released` flag, so a step run after HostBank.release() returns an error naming the bank.
#ifndef FT_JAX_XLA_FFI_BANK_STATE_H_
#define FT_JAX_XLA_FFI_BANK_STATE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/export.h"
#include "xla_ffi/host_bank.h"

namespace ft_jax {

struct BoundBanks {
  static xla::ffi::TypeId id;  // registered with jax.ffi.register_ffi_type("ft_jax_bound_banks", ...)
  std::vector<std::shared_ptr<Bank>> banks;
};

// The instantiate stage: looks up every id; an error names the op and the missing bank.
xla::ffi::ErrorOr<std::unique_ptr<BoundBanks>> BindBanks(const char* op, xla::ffi::Span<const int64_t> ids);

// The execute stage's check: Success, or an error naming the op and the first released bank.
xla::ffi::Error CheckBanksLive(const char* op, const BoundBanks& bound);

// The TypeInfo (deleter) of an FFI state type T, as the void* that jax.ffi.register_ffi_type takes (one per T).
template <typename T>
void* StateTypeInfo() {
#if XLA_FFI_API_MINOR >= 2
  static const auto info = xla::ffi::MakeTypeInfo<T>();
#else
  static const auto info = xla::ffi::TypeInfo<T>();
#endif
  return const_cast<void*>(static_cast<const void*>(&info));
}

}  // namespace ft_jax

// Type registration for Python (nanobind module) and ctypes users: the TypeId and its TypeInfo (deleter).
extern "C" {
FT_JAX_EXPORT void* FtJaxBoundBanksTypeId();
FT_JAX_EXPORT void* FtJaxBoundBanksTypeInfo();
}

#endif  // FT_JAX_XLA_FFI_BANK_STATE_H_
