// slot_fill on the CUDA platform (cuda_handlers.h): the same operands, results and attributes as the CPU handler
// (slot_fill.cc). The instantiate stage binds the banks and resolves each one's device address once per executable
// (MappedDeviceData: registration on first use); the execute stage, which under XLA command buffers runs only while
// the graph is recorded, enqueues: a memset of the error count, then one kernel over all entries and pools that
// reads the ids from device memory (slot_fill_kernel.h). Nothing on the host depends on the ids.
//
// Fallback for a bank that could not be mapped: rows go through pinned bounce buffers in rounds of at most
// kBounceBytes per pool: a D2H copy of flat_ids into pinned memory, then per round a host-function node that copies
// the round's bank rows into the bounce buffers (memcpy; no CUDA call) and a kernel launch that copies them into the
// slots. Every pointer and size a round uses is fixed per (executable, N), so the graph replays correctly.
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bank_state.h"
#include "xla_ffi/cuda_handlers.h"
#include "xla_ffi/host_bank.h"
#include "xla_ffi/host_bank_cuda.h"
#include "xla_ffi/slot_fill_kernel.h"

namespace ffi = xla::ffi;

namespace ft_jax {

CudaCounters& GetCudaCounters() {
  static CudaCounters* counters = new CudaCounters();  // leaked: host nodes may run during shutdown
  return *counters;
}

namespace {

using I32Vector = ffi::Buffer<ffi::DataType::S32, 1>;
constexpr size_t kBounceBytes = size_t{64} << 20;

struct PinnedDeleter {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using PinnedPtr = std::unique_ptr<void, PinnedDeleter>;

struct CudaSlotFillState;

// One bounce round: entries [begin, end) of an N-entry call; read by the host-function node.
struct BounceRound {
  CudaSlotFillState* state;
  int32_t begin, end;
};

struct CudaSlotFillState {
  static ffi::TypeId id;
  std::vector<std::shared_ptr<Bank>> banks;
  std::vector<uint8_t*> device_src;  // per bank: mapped device address of row 0, or nullptr (bounce)
  bool bounce = false;               // some bank is not mapped: every pool goes through the bounce buffers
  int32_t bounce_rows = 0;           // entries per round
  std::vector<PinnedPtr> bounce_buf;  // per pool: [bounce_rows, row_bytes], pinned and mapped
  std::vector<uint8_t*> bounce_dev;   // device addresses of bounce_buf
  PinnedPtr host_ids;                 // pinned copy of flat_ids [kMaxFillEntries]
  std::mutex mu;
  std::map<int32_t, std::vector<std::unique_ptr<BounceRound>>> rounds;  // by N; never erased (graphs point here)
};
ffi::TypeId CudaSlotFillState::id = {};

// Host-function node: copies the round's bank rows into the bounce buffers. No CUDA API call.
void CUDART_CB BounceCopy(void* data) {
  const BounceRound& r = *static_cast<const BounceRound*>(data);
  const CudaSlotFillState& s = *r.state;
  const int32_t* fid = static_cast<const int32_t*>(s.host_ids.get());
  for (size_t p = 0; p < s.banks.size(); ++p) {
    const Bank& bank = *s.banks[p];
    uint8_t* out = static_cast<uint8_t*>(s.bounce_buf[p].get());
    for (int32_t n = r.begin; n < r.end; ++n) {
      if (fid[n] < 0 || fid[n] >= bank.num_rows()) continue;  // padding, or counted as an error by the kernel
      std::memcpy(out + static_cast<size_t>(n - r.begin) * bank.row_bytes(), bank.row(fid[n]), bank.row_bytes());
    }
  }
  GetCudaCounters().bounce_fills.fetch_add(1, std::memory_order_relaxed);
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  cudaGetLastError();
  return ffi::Error::Internal(std::string("slot_fill (CUDA): ") + what + ": " + cudaGetErrorString(err));
}

ffi::ErrorOr<std::unique_ptr<CudaSlotFillState>> Instantiate(ffi::Span<const int64_t> ids) {
  auto s = std::make_unique<CudaSlotFillState>();
  if (ids.size() == 0 || ids.size() > static_cast<size_t>(kMaxFillPools)) {
    return ffi::Unexpected(ffi::Error::InvalidArgument("slot_fill (CUDA): 1.." + std::to_string(kMaxFillPools) +
                                                       " banks expected, got " + std::to_string(ids.size())));
  }
  for (int64_t id : ids) {
    std::shared_ptr<Bank> bank = FindBank(id);
    if (!bank) return ffi::Unexpected(ffi::Error::InvalidArgument("slot_fill (CUDA): " + MissingBankMessage(id)));
    if (bank->num_rows() != FindBank(ids[0])->num_rows()) {
      return ffi::Unexpected(ffi::Error::InvalidArgument("slot_fill (CUDA): " + bank->Describe() + " and bank " +
                                                         std::to_string(ids[0]) + " hold different numbers of rows"));
    }
    uint8_t* dev = MappedDeviceData(*bank);
    s->bounce |= dev == nullptr;
    s->device_src.push_back(dev);
    s->banks.push_back(std::move(bank));
  }
  if (s->bounce) {
    size_t widest = 1;
    for (const auto& b : s->banks) widest = std::max(widest, b->row_bytes());
    s->bounce_rows = static_cast<int32_t>(std::max<size_t>(1, std::min<size_t>(kBounceBytes / widest,
                                                                               kMaxFillEntries)));
    void* ids_buf = nullptr;
    cudaError_t err = cudaHostAlloc(&ids_buf, sizeof(int32_t) * kMaxFillEntries, cudaHostAllocPortable);
    if (err != cudaSuccess) return ffi::Unexpected(CudaError("cudaHostAlloc of the id staging", err));
    s->host_ids.reset(ids_buf);
    for (const auto& b : s->banks) {
      void* buf = nullptr;
      err = cudaHostAlloc(&buf, b->row_bytes() * s->bounce_rows, cudaHostAllocMapped | cudaHostAllocPortable);
      if (err != cudaSuccess) return ffi::Unexpected(CudaError("cudaHostAlloc of a bounce buffer", err));
      s->bounce_buf.emplace_back(buf);
      void* dev = nullptr;
      err = cudaHostGetDevicePointer(&dev, buf, 0);
      if (err != cudaSuccess) return ffi::Unexpected(CudaError("cudaHostGetDevicePointer of a bounce buffer", err));
      s->bounce_dev.push_back(static_cast<uint8_t*>(dev));
    }
  }
  return s;
}

// The pool must be [S, *row_shape] of the bank's dtype (the Python wrapper checks this at trace time as well).
ffi::Error CheckPool(size_t p, const ffi::AnyBuffer& pool, const Bank& bank, int64_t num_slots) {
  const auto dims = pool.dimensions();
  bool ok = dims.size() == bank.row_shape().size() + 1 && dims[0] == num_slots &&
            static_cast<int32_t>(pool.element_type()) == bank.dtype_code();
  for (size_t i = 1; ok && i < dims.size(); ++i) ok = dims[i] == bank.row_shape()[i - 1];
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument("slot_fill (CUDA): pool " + std::to_string(p) + " does not hold " +
                                     std::to_string(num_slots) + " rows of " + bank.Describe());
}

ffi::Error Execute(cudaStream_t stream, CudaSlotFillState* s, I32Vector flat_ids, I32Vector slot_ids,
                   ffi::RemainingArgs pools, ffi::RemainingRets outs, ffi::Span<const int64_t> /*banks*/) {
  GetCudaCounters().slot_fill_records.fetch_add(1, std::memory_order_relaxed);
  const size_t P = s->banks.size();
  const int64_t n = static_cast<int64_t>(flat_ids.element_count());
  if (static_cast<int64_t>(slot_ids.element_count()) != n) {
    return ffi::Error::InvalidArgument("slot_fill (CUDA): flat_ids has " + std::to_string(n) +
                                       " entries but slot_ids has " + std::to_string(slot_ids.element_count()));
  }
  if (n > kMaxFillEntries) {
    return ffi::Error::InvalidArgument("slot_fill (CUDA): at most " + std::to_string(kMaxFillEntries) +
                                       " entries per call, got " + std::to_string(n));
  }
  if (pools.size() != P || outs.size() != P + 1) {
    return ffi::Error::InvalidArgument("slot_fill (CUDA): " + std::to_string(pools.size()) + " pools and " +
                                       std::to_string(outs.size()) + " results for " + std::to_string(P) +
                                       " banks (expected the pools, then the error count)");
  }
  for (const auto& b : s->banks) {
    if (b->released()) {
      return ffi::Error::InvalidArgument("slot_fill (CUDA): bank " + std::to_string(b->id()) + " was released");
    }
  }
  auto errors = outs.get<ffi::AnyBuffer>(P);
  if (!errors.has_value() || (*errors)->element_type() != ffi::DataType::S32 || (*errors)->element_count() != 1) {
    return ffi::Error::InvalidArgument("slot_fill (CUDA): the last result must be the error count i32[]");
  }
  FillParams params{};
  params.flat_ids = flat_ids.typed_data();
  params.slot_ids = slot_ids.typed_data();
  params.num_rows = s->banks[0]->num_rows();
  params.num_pools = static_cast<int32_t>(P);
  params.errors = static_cast<int32_t*>((*errors)->untyped_data());
  for (size_t p = 0; p < P; ++p) {
    auto in = pools.get<ffi::AnyBuffer>(p);
    auto out = outs.get<ffi::AnyBuffer>(p);
    if (!in.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("slot_fill (CUDA): bad pool operand");
    if (p == 0) params.num_slots = in->dimensions().size() ? in->dimensions()[0] : 0;
    if (ffi::Error err = CheckPool(p, *in, *s->banks[p], params.num_slots); err.failure()) return err;
    uint8_t* dst = static_cast<uint8_t*>((*out)->untyped_data());
    if (dst != in->untyped_data()) {  // not aliased: stay functional
      cudaError_t err = cudaMemcpyAsync(dst, in->untyped_data(), in->size_bytes(), cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return CudaError("cudaMemcpyAsync of a pool", err);
    }
    params.pools[p] = FillPool{s->device_src[p], dst, static_cast<int64_t>(s->banks[p]->row_bytes())};
  }
  cudaError_t err = cudaMemsetAsync(params.errors, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess) return CudaError("cudaMemsetAsync of the error count", err);
  if (n == 0) return ffi::Error::Success();
  if (!s->bounce) {
    params.begin = 0;
    params.end = static_cast<int32_t>(n);
    params.bounce_base = -1;
    err = LaunchSlotFill(params, stream);
    return err == cudaSuccess ? ffi::Error::Success() : CudaError("kernel launch", err);
  }
  // Fallback: ids to the host, then rounds of (host copy into the bounce buffers, kernel from them).
  err = cudaMemcpyAsync(s->host_ids.get(), params.flat_ids, sizeof(int32_t) * n, cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return CudaError("cudaMemcpyAsync of flat_ids", err);
  std::vector<std::unique_ptr<BounceRound>>* rounds;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    rounds = &s->rounds[static_cast<int32_t>(n)];
    if (rounds->empty()) {
      for (int32_t b = 0; b < n; b += s->bounce_rows) {
        rounds->push_back(std::make_unique<BounceRound>(
            BounceRound{s, b, static_cast<int32_t>(std::min<int64_t>(n, int64_t{b} + s->bounce_rows))}));
      }
    }
  }
  for (const auto& r : *rounds) {
    err = cudaLaunchHostFunc(stream, BounceCopy, r.get());
    if (err != cudaSuccess) return CudaError("cudaLaunchHostFunc", err);
    params.begin = r->begin;
    params.end = r->end;
    params.bounce_base = r->begin;
    for (size_t p = 0; p < P; ++p) params.pools[p].src = s->bounce_dev[p];
    err = LaunchSlotFill(params, stream);
    if (err != cudaSuccess) return CudaError("kernel launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace

void* CudaSlotFillStateTypeId() { return &CudaSlotFillState::id; }
void* CudaSlotFillStateTypeInfo() { return StateTypeInfo<CudaSlotFillState>(); }

}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxSlotFillCudaInstantiate, ft_jax::Instantiate,
                              ffi::Ffi::BindInstantiate().Attr<ffi::Span<const int64_t>>("banks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxSlotFillCuda, ft_jax::Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<ft_jax::CudaSlotFillState>>()
                                  .Arg<ft_jax::I32Vector>()
                                  .Arg<ft_jax::I32Vector>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("banks"),
                              {ffi::Traits::kCmdBufferCompatible});
