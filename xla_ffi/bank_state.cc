#include "xla_ffi/bank_state.h"

#include <string>

namespace ffi = xla::ffi;

namespace ft_jax {

ffi::TypeId BoundBanks::id = {};

ffi::ErrorOr<std::unique_ptr<BoundBanks>> BindBanks(const char* op, ffi::Span<const int64_t> ids) {
  auto bound = std::make_unique<BoundBanks>();
  bound->banks.reserve(ids.size());
  for (int64_t id : ids) {
    std::shared_ptr<Bank> bank = FindBank(id);
    if (!bank) return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(op) + ": " + MissingBankMessage(id)));
    bound->banks.push_back(std::move(bank));
  }
  return bound;
}

ffi::Error CheckBanksLive(const char* op, const BoundBanks& bound) {
  for (const auto& bank : bound.banks) {
    if (bank->released()) {
      return ffi::Error::InvalidArgument(std::string(op) + ": bank " + std::to_string(bank->id()) + " was released");
    }
  }
  return ffi::Error::Success();
}

}  // namespace ft_jax

extern "C" {
void* FtJaxBoundBanksTypeId() { return &ft_jax::BoundBanks::id; }
void* FtJaxBoundBanksTypeInfo() { return ft_jax::StateTypeInfo<ft_jax::BoundBanks>(); }
}
