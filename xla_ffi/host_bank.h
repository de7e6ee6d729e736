// Host expert banks: C++-owned, page-aligned host memory holding one weight kind (e.g. gate_up or down) for all
// L x E experts, one row per expert (flat id = moe_layer_index * E + expert_index).
//
// Banks live in a process-wide registry keyed by an integer id. The id is what the XLA FFI handlers receive as a
// (compile-time) attribute. Keep-alive: a handler copies the shared_ptr while it runs, so releasing a bank while a
// compiled step is executing only drops the registry entry; the memory goes away when the last user finishes.
// Later calls with the released id return an FFI error instead of touching freed memory. Releasing twice is an
// error.
//
// This header has no XLA or nanobind dependency. The extern "C" block is the API a ctypes user (for example the
// Bazel-built shared library in tests) uses; the C++ part is what the handlers and the nanobind module use.
#ifndef FT_JAX_XLA_FFI_HOST_BANK_H_
#define FT_JAX_XLA_FFI_HOST_BANK_H_

#include <cstddef>
#include <cstdint>

#include "xla_ffi/export.h"

#ifdef __cplusplus
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ft_jax {

// Element types a bank can hold. The numeric values are the XLA FFI data type codes (XLA_FFI_DataType in
// xla/ffi/api/c_api.h) so a bank dtype compares directly with an FFI buffer's element type.
enum class BankDType : int32_t {
  kS8 = 2,
  kU8 = 6,
  kF16 = 10,
  kF32 = 11,
  kBF16 = 16,
  kF8E5M2 = 19,
  kF8E4M3FN = 20,
};

// Every supported bank dtype (the nanobind module's dtype_codes table).
constexpr BankDType kBankDTypes[] = {BankDType::kS8,  BankDType::kU8,     BankDType::kF16,     BankDType::kF32,
                                     BankDType::kBF16, BankDType::kF8E5M2, BankDType::kF8E4M3FN};

// Bytes per element, or 0 for a code that is not a supported bank dtype.
size_t BankDTypeSize(int32_t dtype_code);
// Human-readable dtype name ("float32", "bfloat16", ...) for error messages; "dtype code N" if unknown.
std::string BankDTypeName(int32_t dtype_code);

constexpr size_t kBankAlignment = 4096;  // page size: rows of page-multiple size stay page aligned
// A bank's data address is congruent to its page_offset modulo this (2 MiB, the x86-64 huge page): a file region at a
// congruent offset (modulo the page size) can then be mapped into it, on huge page table entries where the page
// cache holds 2 MiB folios.
constexpr size_t kBankMapAlignment = size_t{2} << 20;

// The part of a bank byte range [offset, offset + n) that MapFile mapped: [offset + begin, offset + end), begin ==
// end when nothing was mapped (the caller copies the rest).
struct MappedRange {
  size_t begin = 0;
  size_t end = 0;
};

// What a device runtime attached to a bank (CUDA builds: the page-locked, device-mapped registration made by
// host_bank_cuda.cc). Destroyed by the bank before its memory is unmapped.
class BankDeviceMapping {
 public:
  virtual ~BankDeviceMapping() = default;
  // Device address of row 0, or nullptr when the bank could not be mapped (the caller falls back).
  virtual uint8_t* device_data() const = 0;
};

class Bank {
 public:
  // Allocates num_rows rows of prod(row_shape) elements of dtype, zero-filled (anonymous mmap). page_offsets holds
  // one offset for the whole bank or one per row, each in [0, kBankMapAlignment): row r's address is congruent to
  // its offset modulo kBankMapAlignment (one offset: rows at one stride from data(), which is congruent to it; 0: 2
  // MiB aligned). A safetensors file's tensors start at offsets that are neither page aligned nor, from one MoE
  // layer to the next, congruent modulo 2 MiB (the norms and routers between them), so the loader gives each row the
  // offset of its tensors in the file and MapFile can map them there, on 2 MiB page table entries where the page
  // cache holds 2 MiB folios (docs/DESIGN.md sec. 20.26). A row whose offset does not follow from the previous row's
  // is placed after a gap of less than 2 MiB of address space that is never touched. Throws std::invalid_argument
  // for a bad dtype/shape or offset, or a page_offsets size other than 1 or num_rows; std::bad_alloc when the memory
  // cannot be mapped.
  Bank(int64_t id, int64_t num_rows, std::vector<int64_t> row_shape, int32_t dtype_code,
       const std::vector<size_t>& page_offsets = {0});
  ~Bank();
  Bank(const Bank&) = delete;
  Bank& operator=(const Bank&) = delete;

  int64_t id() const { return id_; }
  int64_t num_rows() const { return num_rows_; }
  const std::vector<int64_t>& row_shape() const { return row_shape_; }
  int32_t dtype_code() const { return dtype_code_; }
  size_t elem_size() const { return elem_size_; }
  size_t row_elems() const { return row_elems_; }
  size_t row_bytes() const { return row_elems_ * elem_size_; }
  // Bytes of the rows (num_rows * row_bytes), without the gaps between rows.
  size_t nbytes() const { return static_cast<size_t>(num_rows_) * row_bytes(); }
  // Bytes from data() to the end of the last row: nbytes() plus the gaps.
  size_t span_bytes() const { return span_bytes_; }
  // Row 0; row r is at data() + row_offset(r).
  uint8_t* data() const { return data_; }
  size_t row_offset(int64_t r) const {
    return row_offsets_.empty() ? static_cast<size_t>(r) * row_bytes() : row_offsets_[static_cast<size_t>(r)];
  }
  const uint8_t* row(int64_t r) const { return data_ + row_offset(r); }
  // The byte offset of every row from data() ([num_rows]), or nullptr when the rows lie at one stride (row_bytes).
  const size_t* row_offsets() const { return row_offsets_.empty() ? nullptr : row_offsets_.data(); }
  // "bank 3 ([16, 128, 64] bfloat16)" for error messages.
  std::string Describe() const;
  // True once ReleaseBank dropped it from the registry (holders may still read it; handlers report an error).
  bool released() const { return released_.load(std::memory_order_acquire); }
  void MarkReleased() { released_.store(true, std::memory_order_release); }
  // Page-aligned start and length of the bank's whole mapping (data() - map_begin() == page_offset % page size).
  uint8_t* map_begin() const { return map_begin_; }
  size_t map_bytes() const { return map_bytes_; }
  // Fills bank bytes [offset, offset + nbytes) (offsets from data(), within span_bytes()) from file bytes
  // [file_offset, file_offset + nbytes) of the open file `fd` by mapping the file's pages there (MAP_PRIVATE |
  // MAP_FIXED, read-write copy-on-write: the bank stays writable and a write never reaches the file), for the whole
  // pages of the range, when the two addresses are
  // congruent modulo the page size; then asks the kernel to populate the page tables (MADV_POPULATE_READ). No data
  // is copied: the bank shares the page cache's pages. Returns the part mapped relative to offset (begin == end:
  // nothing, e.g. not congruent, too small, the process's mapping budget spent, or mmap failed); the caller copies
  // the partial pages at both ends and anything not mapped. Only while the bank is being filled (no reader).
  // Caveat of every file mapping: a file truncated in place later makes reads of the lost pages fault (SIGBUS), and
  // one rewritten in place changes the pages not yet written to.
  // Throws std::out_of_range for a range outside the bank.
  MappedRange MapFile(size_t offset, size_t nbytes, int fd, uint64_t file_offset);
  // The bank's device mapping: made by `make` on the first call (under a lock), the same object afterwards.
  const BankDeviceMapping& DeviceMapping(const std::function<std::unique_ptr<BankDeviceMapping>(const Bank&)>& make);

 private:
  int64_t id_;
  int64_t num_rows_;
  std::vector<int64_t> row_shape_;
  int32_t dtype_code_;
  size_t elem_size_;
  size_t row_elems_;
  std::vector<size_t> row_offsets_;  // empty: row r at r * row_bytes()
  size_t span_bytes_;
  uint8_t* map_begin_;
  size_t map_bytes_;
  uint8_t* data_;
  std::atomic<int64_t> file_segments_{0};  // file regions MapFile mapped (counted against the process budget)
  std::atomic<bool> released_{false};
  std::mutex mapping_mu_;
  std::unique_ptr<BankDeviceMapping> mapping_;
};

// Creates a bank and registers it; returns the registered shared_ptr (ids start at 1 and are never reused).
std::shared_ptr<Bank> CreateBank(int64_t num_rows, const std::vector<int64_t>& row_shape, int32_t dtype_code,
                                 const std::vector<size_t>& page_offsets = {0});
// The live bank whose span (data() .. data() + span_bytes()) holds [address, address + nbytes), or nullptr.
std::shared_ptr<Bank> FindBankHolding(uintptr_t address, size_t nbytes);
// Returns the live bank with this id, or nullptr if it was never created or has been released.
std::shared_ptr<Bank> FindBank(int64_t id);
// Removes the bank from the registry. Returns false if the id is not live (never created or already released).
bool ReleaseBank(int64_t id);
// Error text for a bank id that is not live: "bank 7 was released" or "bank 7 does not exist".
std::string MissingBankMessage(int64_t id);

}  // namespace ft_jax

extern "C" {
#endif  // __cplusplus

// C API (ctypes friendly). Functions returning int64_t return -1 on error; then ft_jax_last_error() describes it
// (thread-local, valid until the next failing call on this thread).
FT_JAX_EXPORT int64_t ft_jax_bank_create(int64_t num_rows, int32_t row_rank, const int64_t* row_dims,
                                         int32_t dtype_code);
FT_JAX_EXPORT void* ft_jax_bank_data(int64_t id);  // NULL if not live
FT_JAX_EXPORT int32_t ft_jax_bank_release(int64_t id);  // 0 on success, -1 if not live
FT_JAX_EXPORT int64_t ft_jax_bank_nbytes(int64_t id);
FT_JAX_EXPORT const char* ft_jax_last_error(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FT_JAX_XLA_FFI_HOST_BANK_H_
