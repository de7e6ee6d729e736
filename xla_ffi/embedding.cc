// bank_take: the embedding lookup from a host bank, y[n] = table[ids[n]], the table being the one row [V, H] of
// the bank given by the attribute `bank` (bound once per executable at the instantiate stage).
// operands: ids s32[N] in [0, V)
// result:   y [N, H] of the bank's dtype (float32 or bfloat16): the rows' bytes as stored
// Why a handler: the table stays where the loader put it, the checkpoint file's own pages (no copy of it as a jax
// array; docs/DESIGN.md sec. 20.27).
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bank_state.h"
#include "xla_ffi/common.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/host_bank.h"

namespace ffi = xla::ffi;

namespace ft_jax {

using I32Vector = ffi::Buffer<ffi::DataType::S32, 1>;

namespace {

constexpr const char* kOp = "bank_take";

ffi::ErrorOr<std::unique_ptr<BoundBanks>> BankTakeInstantiate(int64_t bank) {
  auto bound = BindBanks(kOp, ffi::Span<const int64_t>(&bank, 1));
  if (!bound.has_value()) return bound;
  const Bank& b = *(*bound)->banks[0];
  if (b.num_rows() != 1 || b.row_shape().size() != 2) {
    return ffi::Unexpected(InvalidArgument(kOp, b.Describe() + " must hold one table [V, H]"));
  }
  return bound;
}

ffi::Error BankTakeImpl(BoundBanks* bound, I32Vector ids, ffi::Result<ffi::AnyBuffer> y,
                        int64_t /*bank: in `bound`*/) {
  if (ffi::Error err = CheckBanksLive(kOp, *bound); err.failure()) return err;
  const Bank& b = *bound->banks[0];
  const int64_t V = b.row_shape()[0], H = b.row_shape()[1], N = ids.dimensions()[0];
  const auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != N || yd[1] != H || static_cast<int32_t>(y->element_type()) != b.dtype_code()) {
    return InvalidArgument(kOp, "the result must be [" + std::to_string(N) + ", " + std::to_string(H) + "] " +
                                    BankDTypeName(b.dtype_code()) + " for " + b.Describe() + ", got " + Dims(yd) +
                                    " " + BankDTypeName(static_cast<int32_t>(y->element_type())));
  }
  const size_t row = static_cast<size_t>(H) * b.elem_size();
  const int32_t* id = ids.typed_data();
  auto* out = static_cast<uint8_t*>(y->untyped_data());
  for (int64_t n = 0; n < N; ++n) {
    if (id[n] < 0 || id[n] >= V) {
      return InvalidArgument(kOp, "token id " + std::to_string(id[n]) + " is out of range for the table " +
                                      b.Describe() + " (" + std::to_string(V) + " rows)");
    }
    std::memcpy(out + static_cast<size_t>(n) * row, b.row(0) + static_cast<size_t>(id[n]) * row, row);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxBankTakeInstantiate, ft_jax::BankTakeInstantiate,
                              ffi::Ffi::BindInstantiate().Attr<int64_t>("bank"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxBankTake, ft_jax::BankTakeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::State<ft_jax::BoundBanks>>()
                                  .Arg<ft_jax::I32Vector>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("bank"));
