// slot_fill: pool_p[slot_ids[n]] = bank_p[flat_ids[n]] for every pool p and every n with both ids >= 0, in place.
// Operands flat_ids i32[N], slot_ids i32[N], pool_0 .. pool_{P-1} ([S, *row_shape_p]), each aliased to result p
// (a pool that is not aliased is refused: only the N rows are written); then optionally an error count i32[] (the
// CUDA handler's signature, so one step serves both platforms; always 0 here: bad ids are an FFI error on the CPU).
// Attribute banks: i64[P], bound at the instantiate stage (bank_state.h). Design notes: docs/DESIGN.md sec. 9.
#include <algorithm>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bank_state.h"
#include "xla_ffi/common.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/host_bank.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

using I32Vector = ffi::Buffer<ffi::DataType::S32, 1>;

constexpr size_t kStreamMinBytes = size_t{256} << 10;  // rows from here on take streaming stores (cpp.md)

#if defined(__x86_64__)
// dst and n must be multiples of 32 bytes (checked by the caller); src may be unaligned.
__attribute__((target("avx2"))) void StreamCopy(uint8_t* dst, const uint8_t* src, size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  for (; i < n; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
}

bool CanStream() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}
#endif

// Copies the selected rows; streaming stores for large aligned rows, memcpy otherwise.
void CopyRows(uint8_t* out, const Bank& bank, const int32_t* fid, const int32_t* sid, int64_t n) {
  const size_t row_bytes = bank.row_bytes();
#if defined(__x86_64__)
  const bool stream = CanStream() && row_bytes >= kStreamMinBytes && row_bytes % 32 == 0 &&
                      reinterpret_cast<uintptr_t>(out) % 32 == 0;
#else
  const bool stream = false;
#endif
  for (int64_t i = 0; i < n; ++i) {
    if (fid[i] < 0 || sid[i] < 0) continue;
    uint8_t* dst = out + static_cast<size_t>(sid[i]) * row_bytes;
#if defined(__x86_64__)
    if (stream) {
      StreamCopy(dst, bank.row(fid[i]), row_bytes);
      continue;
    }
#endif
    std::memcpy(dst, bank.row(fid[i]), row_bytes);
  }
#if defined(__x86_64__)
  if (stream) _mm_sfence();  // order the streaming stores before XLA's next use of the buffer
#endif
}

// Checks one pool against its bank; the message (built only on error) names the pool and the bank.
ffi::Error CheckPool(size_t p, ffi::AnyBuffer pool, const Bank& bank) {
  const auto dims = pool.dimensions();
  bool ok = dims.size() == bank.row_shape().size() + 1 &&
            static_cast<int32_t>(pool.element_type()) == bank.dtype_code();
  for (size_t i = 1; ok && i < dims.size(); ++i) ok = dims[i] == bank.row_shape()[i - 1];
  if (ok) return ffi::Error::Success();
  return InvalidArgument("slot_fill", "pool " + std::to_string(p) + " " + Dims(dims) + " " +
                                          BankDTypeName(static_cast<int32_t>(pool.element_type())) +
                                          " does not hold rows of " + bank.Describe());
}

// Every pool must be its result's buffer (input_output_aliases): the handler writes the N rows only.
ffi::Error CheckAliased(ffi::RemainingArgs pools, ffi::RemainingRets outs, size_t num_pools) {
  if (pools.size() != num_pools || (outs.size() != num_pools && outs.size() != num_pools + 1)) {
    return InvalidArgument("slot_fill", std::to_string(pools.size()) + " pools and " + std::to_string(outs.size()) +
                                            " results for " + std::to_string(num_pools) + " banks");
  }
  for (size_t p = 0; p < num_pools; ++p) {
    auto in = pools.get<ffi::AnyBuffer>(p);
    auto out = outs.get<ffi::AnyBuffer>(p);
    if (!in.has_value() || !out.has_value()) return InvalidArgument("slot_fill", "bad pool operand");
    if ((*out)->untyped_data() != in->untyped_data()) {
      return InvalidArgument("slot_fill", "pool " + std::to_string(p) + " is not aliased to result " +
                                              std::to_string(p) + " (call it with input_output_aliases {" +
                                              std::to_string(2 + p) + ": " + std::to_string(p) + "})");
    }
  }
  return ffi::Error::Success();
}

ffi::Error SlotFillImpl(BoundBanks* bound, I32Vector flat_ids, I32Vector slot_ids, ffi::RemainingArgs pools,
                        ffi::RemainingRets outs, ffi::Span<const int64_t> /*banks: in `bound`*/) {
  const int64_t n = static_cast<int64_t>(flat_ids.element_count());
  if (slot_ids.element_count() != static_cast<size_t>(n)) {
    return InvalidArgument("slot_fill", "flat_ids has " + std::to_string(n) + " entries but slot_ids has " +
                                            std::to_string(slot_ids.element_count()));
  }
  const int32_t* fid = flat_ids.typed_data();
  const int32_t* sid = slot_ids.typed_data();
  const size_t num_pools = bound->banks.size();
  if (ffi::Error err = CheckAliased(pools, outs, num_pools); err.failure()) return err;
  if (outs.size() == num_pools + 1) {  // the error count
    auto errors = outs.get<ffi::AnyBuffer>(num_pools);
    if (!errors.has_value() || (*errors)->element_type() != ffi::DataType::S32 || (*errors)->element_count() != 1) {
      return InvalidArgument("slot_fill", "the result after the pools must be the error count i32[]");
    }
    *static_cast<int32_t*>((*errors)->untyped_data()) = 0;
  }
  int64_t valid = 0;
  for (int64_t i = 0; i < n; ++i) valid += fid[i] >= 0 && sid[i] >= 0;
  if (valid == 0) return ffi::Error::Success();  // nothing to copy: the (aliased) pools are already the results
  if (ffi::Error err = CheckBanksLive("slot_fill", *bound); err.failure()) return err;
  for (size_t p = 0; p < num_pools; ++p) {
    ffi::AnyBuffer pool = *pools.get<ffi::AnyBuffer>(p);
    const Bank& bank = *bound->banks[p];
    if (ffi::Error err = CheckPool(p, pool, bank); err.failure()) return err;
    const int64_t num_slots = pool.dimensions()[0];
    // Validate everything before the first copy so a bad call leaves the pools untouched.
    for (int64_t i = 0; i < n; ++i) {
      if (fid[i] < 0 || sid[i] < 0) continue;
      if (fid[i] >= bank.num_rows() || sid[i] >= num_slots) {
        return InvalidArgument(
            "slot_fill", "entry " + std::to_string(i) + ": flat id " + std::to_string(fid[i]) + " / slot id " +
                             std::to_string(sid[i]) + " out of range for " + bank.Describe() + " and " +
                             std::to_string(num_slots) + " slots (expected -1 or 0..num_rows-1 / 0..slots-1)");
      }
    }
  }
  for (size_t p = 0; p < num_pools; ++p) {
    CopyRows(static_cast<uint8_t*>(pools.get<ffi::AnyBuffer>(p)->untyped_data()), *bound->banks[p], fid, sid, n);
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::unique_ptr<BoundBanks>> SlotFillInstantiate(ffi::Span<const int64_t> banks) {
  return BindBanks("slot_fill", banks);
}

}  // namespace
}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxSlotFillInstantiate, ft_jax::SlotFillInstantiate,
                              ffi::Ffi::BindInstantiate().Attr<ffi::Span<const int64_t>>("banks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxSlotFill, ft_jax::SlotFillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::State<ft_jax::BoundBanks>>()
                                  .Arg<ft_jax::I32Vector>()
                                  .Arg<ft_jax::I32Vector>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("banks"));
