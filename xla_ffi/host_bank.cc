#include "xla_ffi/host_bank.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <new>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

#include "xla_ffi/parallel.h"
#include "xla_ffi/worker_pool.h"

namespace ft_jax {

size_t BankDTypeSize(int32_t dtype_code) {
  switch (static_cast<BankDType>(dtype_code)) {
    case BankDType::kS8:
    case BankDType::kU8:
    case BankDType::kF8E5M2:
    case BankDType::kF8E4M3FN:
      return 1;
    case BankDType::kF16:
    case BankDType::kBF16:
      return 2;
    case BankDType::kF32:
      return 4;
  }
  return 0;
}

std::string BankDTypeName(int32_t dtype_code) {
  switch (static_cast<BankDType>(dtype_code)) {
    case BankDType::kS8:
      return "int8";
    case BankDType::kU8:
      return "uint8";
    case BankDType::kF16:
      return "float16";
    case BankDType::kF32:
      return "float32";
    case BankDType::kBF16:
      return "bfloat16";
    case BankDType::kF8E5M2:
      return "float8_e5m2";
    case BankDType::kF8E4M3FN:
      return "float8_e4m3fn";
  }
  return "dtype code " + std::to_string(dtype_code);
}

namespace {

// Budget of file regions MapFile may map, process-wide: each one can split a bank's mapping into up to three (the
// anonymous part before, the file part, the anonymous part after), and the kernel refuses new mappings past
// vm.max_map_count (65530 by default), which would make later mmap calls (JAX's, malloc's) fail. A quarter of it.
int64_t FileSegmentBudget() {
  static const int64_t budget = [] {
    int64_t max_count = 65530;
    if (FILE* f = std::fopen("/proc/sys/vm/max_map_count", "r")) {
      long long v = 0;
      if (std::fscanf(f, "%lld", &v) == 1 && v > 0) max_count = v;
      std::fclose(f);
    }
    return max_count / 4;
  }();
  return budget;
}

std::atomic<int64_t> file_segments_in_use{0};

// MADV_POPULATE_READ of [begin, begin + len) (page aligned) in parts of >= 8 MiB, one per loop thread of the shared
// WorkerPool (ParallelFor): filling the page tables of gigabytes of page-cache pages scales with the threads (4 GiB
// of a checkpoint on a 2-core VM: 0.39 s on one thread, 0.21 s on two; docs/DESIGN.md sec. 20.18). Advisory: a
// failure leaves lazy faults.
void PopulateRead(uintptr_t begin, size_t len, size_t page) {
  WorkerPool& pool = WorkerPool::Shared();
  const int64_t n = std::min<int64_t>(LoopThreads(pool), std::max<size_t>(1, len / (size_t{8} << 20)));
  const size_t step = (len / n + page - 1) / page * page;
  ParallelFor(pool, n, [&](int64_t t) {
    const size_t first = static_cast<size_t>(t) * step;
    if (first < len) madvise(reinterpret_cast<void*>(begin + first), std::min(step, len - first), MADV_POPULATE_READ);
  });
}

// The system page size (4096 on x86-64; 16 or 64 KiB on some ARM64 kernels): what mmap and MAP_FIXED align to.
size_t PageSize() {
  static const size_t page = [] {
    const long v = sysconf(_SC_PAGESIZE);
    return v > 0 ? static_cast<size_t>(v) : kBankAlignment;
  }();
  return page;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux >= 5.14; absent from older headers
#endif

}  // namespace

Bank::Bank(int64_t id, int64_t num_rows, std::vector<int64_t> row_shape, int32_t dtype_code,
           const std::vector<size_t>& page_offsets)
    : id_(id), num_rows_(num_rows), row_shape_(std::move(row_shape)), dtype_code_(dtype_code) {
  elem_size_ = BankDTypeSize(dtype_code);
  if (elem_size_ == 0) {
    throw std::invalid_argument("host bank: unsupported dtype " + BankDTypeName(dtype_code) +
                                " (supported: float32, bfloat16, float16, int8, uint8, float8_e4m3fn, float8_e5m2)");
  }
  if (num_rows_ <= 0) {
    throw std::invalid_argument("host bank: num_rows must be >= 1, got " + std::to_string(num_rows_));
  }
  if (page_offsets.size() != 1 && page_offsets.size() != static_cast<size_t>(num_rows_)) {
    throw std::invalid_argument("host bank: " + std::to_string(page_offsets.size()) + " page offsets for " +
                                std::to_string(num_rows_) + " rows (one for the bank or one per row)");
  }
  for (size_t i = 0; i < page_offsets.size(); ++i) {
    if (page_offsets[i] >= kBankMapAlignment) {
      throw std::invalid_argument("host bank: page offsets must be in [0, " + std::to_string(kBankMapAlignment) +
                                  "), got " + std::to_string(page_offsets[i]) + " (row " + std::to_string(i) + ")");
    }
  }
  // Sizes are checked against the address space (2^47 bytes on x86-64) before any product can wrap.
  constexpr size_t kMaxBytes = size_t{1} << 47;
  const std::string too_big = "host bank: " + Describe() + " exceeds the address space (2^47 bytes)";
  row_elems_ = 1;
  for (int64_t d : row_shape_) {
    if (d <= 0) throw std::invalid_argument("host bank: row dimensions must be >= 1, got " + std::to_string(d));
    if (static_cast<size_t>(d) > kMaxBytes / elem_size_ / row_elems_) throw std::invalid_argument(too_big);
    row_elems_ *= static_cast<size_t>(d);
  }
  // num_rows rows, plus a gap of < 2 MiB before each when every row has its own offset
  const size_t per_row = row_bytes() + (page_offsets.size() > 1 ? kBankMapAlignment : 0);
  if (static_cast<size_t>(num_rows_) > kMaxBytes / per_row) throw std::invalid_argument(too_big);
  const size_t page_offset = page_offsets[0];
  span_bytes_ = nbytes();
  if (page_offsets.size() > 1) {  // row r at the first offset past row r - 1 that is congruent to its page offset
    const size_t mask = kBankMapAlignment - 1;
    row_offsets_.assign(static_cast<size_t>(num_rows_), 0);
    bool uniform = true;
    for (size_t r = 1; r < row_offsets_.size(); ++r) {
      const size_t end = row_offsets_[r - 1] + row_bytes();
      row_offsets_[r] = end + ((page_offsets[r] - page_offset - end) & mask);
      uniform &= row_offsets_[r] == end;
    }
    span_bytes_ = row_offsets_.back() + row_bytes();
    if (uniform) row_offsets_.clear();
  }
  const size_t bytes = span_bytes_;
  const size_t page = PageSize();
  const size_t in_page = page_offset % page;
  map_bytes_ = (in_page + bytes + page - 1) / page * page;
  // Anonymous mmap: zero-filled, committed lazily (a bank sized for a large model costs nothing until written),
  // returned to the OS on release. Reserved 2 MiB larger, then trimmed so that data_ = page_offset (mod 2 MiB).
  const size_t reserve = map_bytes_ + kBankMapAlignment;
  void* p = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(p), target = page_offset - in_page;  // page multiples
  // The first page at or after start that is target modulo 2 MiB (within 2 MiB - 4096 of start).
  const uintptr_t begin = start + ((target - start) & (kBankMapAlignment - 1)), end = begin + map_bytes_;
  if (begin > start) munmap(p, begin - start);
  if (start + reserve > end) munmap(reinterpret_cast<void*>(end), start + reserve - end);
  map_begin_ = reinterpret_cast<uint8_t*>(begin);
#ifdef MADV_HUGEPAGE
  // Transparent huge pages cut TLB misses of the streaming GEMV; advisory only, failure is harmless.
  if (map_bytes_ >= (size_t{2} << 20)) madvise(map_begin_, map_bytes_, MADV_HUGEPAGE);
#endif
  data_ = map_begin_ + in_page;
}

Bank::~Bank() {
  mapping_.reset();  // unregisters the memory from the device runtime before it goes away
  munmap(map_begin_, map_bytes_);  // the file regions MapFile mapped included
  file_segments_in_use.fetch_sub(file_segments_.load());
}

MappedRange Bank::MapFile(size_t offset, size_t nbytes, int fd, uint64_t file_offset) {
  if (offset > span_bytes_ || nbytes > span_bytes_ - offset) {
    throw std::out_of_range("host bank: MapFile range [" + std::to_string(offset) + ", " +
                            std::to_string(offset + nbytes) + ") outside " + Describe());
  }
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data_) + offset;
  const size_t page = PageSize();
  if ((addr - file_offset) % page != 0) return {};  // no page of the file lands on a page of the bank
  const uintptr_t first = (addr + page - 1) / page * page;
  const uintptr_t last = (addr + nbytes) / page * page;
  if (last <= first) return {};
  if (file_segments_in_use.fetch_add(1) >= FileSegmentBudget()) {
    file_segments_in_use.fetch_sub(1);
    return {};
  }
  void* want = reinterpret_cast<void*>(first);
  const size_t len = last - first;
  void* got = mmap(want, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd,
                   static_cast<off_t>(file_offset + (first - addr)));
  if (got != want) {
    file_segments_in_use.fetch_sub(1);
    // A failed MAP_FIXED may have unmapped the range: put zero-filled anonymous memory back (the caller copies it).
    if (mmap(want, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != want) {
      throw std::runtime_error("host bank: mapping the file into " + Describe() +
                               " failed and its memory could not be restored");
    }
    return {};
  }
  file_segments_.fetch_add(1);
#ifdef MADV_HUGEPAGE
  // File pages not yet in the page cache are then read in 2 MiB folios, which a mapping congruent with the file
  // modulo 2 MiB gets on huge page table entries (pages already cached keep their folios). Advisory.
  if (len >= kBankMapAlignment) madvise(want, len, MADV_HUGEPAGE);
#endif
  PopulateRead(first, len, page);  // page tables filled in a call per thread; advisory (lazy faults otherwise)
  return {first - addr, last - addr};
}

const BankDeviceMapping& Bank::DeviceMapping(
    const std::function<std::unique_ptr<BankDeviceMapping>(const Bank&)>& make) {
  std::lock_guard<std::mutex> lock(mapping_mu_);
  if (!mapping_) mapping_ = make(*this);
  return *mapping_;
}

std::string Bank::Describe() const {
  std::ostringstream s;
  s << "bank " << id_ << " ([" << num_rows_;
  for (int64_t d : row_shape_) s << ", " << d;
  s << "] " << BankDTypeName(dtype_code_) << ")";
  return s.str();
}

namespace {

struct Registry {
  std::mutex mu;
  int64_t next_id = 1;
  std::unordered_map<int64_t, std::shared_ptr<Bank>> banks;
};

Registry& GetRegistry() {
  // Leaked on purpose: handlers may still run during interpreter shutdown.
  static Registry* registry = new Registry();
  return *registry;
}

thread_local std::string last_error;

}  // namespace

std::shared_ptr<Bank> CreateBank(int64_t num_rows, const std::vector<int64_t>& row_shape, int32_t dtype_code,
                                 const std::vector<size_t>& page_offsets) {
  Registry& r = GetRegistry();
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    id = r.next_id++;
  }
  auto bank = std::make_shared<Bank>(id, num_rows, row_shape, dtype_code, page_offsets);
  std::lock_guard<std::mutex> lock(r.mu);
  r.banks.emplace(id, bank);
  return bank;
}

std::shared_ptr<Bank> FindBank(int64_t id) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.banks.find(id);
  return it == r.banks.end() ? nullptr : it->second;
}

std::shared_ptr<Bank> FindBankHolding(uintptr_t address, size_t nbytes) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& [id, bank] : r.banks) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(bank->data());
    const size_t span = bank->span_bytes();
    if (address >= begin && address - begin <= span && nbytes <= span - (address - begin)) {
      return bank;
    }
  }
  return nullptr;
}

bool ReleaseBank(int64_t id) {
  std::shared_ptr<Bank> doomed;  // destroyed (memory unmapped) outside the lock
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.banks.find(id);
  if (it == r.banks.end()) return false;
  doomed = std::move(it->second);
  doomed->MarkReleased();
  r.banks.erase(it);
  return true;
}

std::string MissingBankMessage(int64_t id) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (id >= 1 && id < r.next_id) return "bank " + std::to_string(id) + " was released";
  return "bank " + std::to_string(id) + " does not exist";
}

}  // namespace ft_jax

extern "C" {

int64_t ft_jax_bank_create(int64_t num_rows, int32_t row_rank, const int64_t* row_dims, int32_t dtype_code) {
  try {
    if (row_rank < 0 || (row_rank > 0 && row_dims == nullptr)) throw std::invalid_argument("host bank: bad row rank");
    std::vector<int64_t> shape(row_dims, row_dims + row_rank);
    return ft_jax::CreateBank(num_rows, shape, dtype_code)->id();
  } catch (const std::bad_alloc&) {
    ft_jax::last_error = "host bank: out of memory";
  } catch (const std::exception& e) {
    ft_jax::last_error = e.what();
  }
  return -1;
}

void* ft_jax_bank_data(int64_t id) {
  auto bank = ft_jax::FindBank(id);
  if (!bank) {
    ft_jax::last_error = ft_jax::MissingBankMessage(id);
    return nullptr;
  }
  return bank->data();
}

int32_t ft_jax_bank_release(int64_t id) {
  if (ft_jax::ReleaseBank(id)) return 0;
  ft_jax::last_error = ft_jax::MissingBankMessage(id);
  return -1;
}

#define FT_JAX_BANK_QUERY(ret_type, name, expr)     \
  ret_type name(int64_t id) {                       \
    auto bank = ft_jax::FindBank(id);               \
    if (!bank) {                                    \
      ft_jax::last_error = ft_jax::MissingBankMessage(id); \
      return -1;                                    \
    }                                               \
    return static_cast<ret_type>(expr);             \
  }

FT_JAX_BANK_QUERY(int64_t, ft_jax_bank_nbytes, bank->nbytes())

#undef FT_JAX_BANK_QUERY

const char* ft_jax_last_error(void) { return ft_jax::last_error.c_str(); }

}  // extern "C"
