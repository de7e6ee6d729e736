// host_experts on the CUDA platform as two custom calls with the device experts' work between them (cuda_handlers.h):
//
//   submit (stream): D2H x, flat_ids, weights -> pinned staging of this call site | host node: hand the GEMV to the
//                    CPU WorkerPool and return
//   ... device work (the slot experts) runs meanwhile ...
//   wait   (stream): host node: block until the WorkerPool finished that GEMV | H2D y, errors <- pinned staging
//
// The submit's instantiate state (a HostChannel) owns the staging buffers, the bound banks and the expert layout;
// its sizes come from the tokens / top_k attributes and the banks, so nothing is allocated while a command buffer is
// recorded. The wait finds the channel through the `pair` attribute both calls carry (an integer that
// ffi_ops.host_experts_submit assigns when the step is traced: distinct for distinct pairs, equal within a pair):
// the submit's instantiate and execute stages file the channel under that id and the wait's execute stage looks it
// up. Host functions touch only the channel (no CUDA API), and every per-step value reaches them through
// stream-ordered copies, so a recorded graph replays correctly: each replay runs both host nodes once.
//
// A route with a bad id, or a bank released under a running step, cannot stop the stream: the GEMV is skipped, y is
// zeros and the wait's `errors` result is 1 (0 otherwise); OffloadedExperts sums it on the device and read_stats
// raises on it (host_route_errors). The process-wide CudaCounters count the same events.
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/bank_state.h"
#include "xla_ffi/common.h"
#include "xla_ffi/cuda_handlers.h"
#include "xla_ffi/expert_inputs.h"
#include "xla_ffi/expert_kernel.h"
#include "xla_ffi/host_bank.h"
#include "xla_ffi/worker_pool.h"

namespace ffi = xla::ffi;

namespace ft_jax {
namespace {

using I32Matrix = ffi::Buffer<ffi::DataType::S32, 2>;
using F32Matrix = ffi::Buffer<ffi::DataType::F32, 2>;
using TicketResult = ffi::ResultBuffer<ffi::DataType::U8, 0>;
using Ticket = ffi::Buffer<ffi::DataType::U8, 0>;

struct PinnedDeleter {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using PinnedPtr = std::unique_ptr<void, PinnedDeleter>;

struct HostChannel {
  std::vector<std::shared_ptr<Bank>> banks;
  ExpertWeights m{};
  ExpertActivation act;
  int64_t T = 0, k = 0, H = 0;
  int32_t x_dtype = static_cast<int32_t>(BankDType::kF32);  // set by the execute stage before the host node runs
  PinnedPtr x_stage, ids_stage, w_stage, y_stage;            // [T, H] (f32 capacity), [T, k], [T, k], [T, H] f32
  PinnedPtr errors_stage;                                    // i32[]: 1 when the last GEMV was skipped, else 0
  std::vector<float> x32;                                    // bf16 x widened, [T, H]
  std::mutex mu;
  std::condition_variable cv;
  int64_t submitted = 0, completed = 0;  // generations, under mu

  // The GEMV of the staged inputs into y_stage (on a WorkerPool thread).
  void Run() {
    float* y = static_cast<float*>(y_stage.get());
    int32_t* errors = static_cast<int32_t*>(errors_stage.get());
    const int32_t* ids = static_cast<const int32_t*>(ids_stage.get());
    bool ok = CheckExpertIds(ids, T * k, m.num_experts, "").empty();
    for (const auto& b : banks) ok &= !b->released();
    if (!ok) {
      std::memset(y, 0, sizeof(float) * T * H);
      *errors = 1;
      GetCudaCounters().host_route_errors.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    *errors = 0;
    const float* x = static_cast<const float*>(x_stage.get());
    const uint16_t* x_bf16 = nullptr;  // as the CPU handler: the bf16 bits too when x is bf16 (expert_kernel.h)
    if (x_dtype == static_cast<int32_t>(BankDType::kBF16)) {
      x_bf16 = static_cast<const uint16_t*>(x_stage.get());
      WidenBf16(x_bf16, x32.data(), static_cast<size_t>(T * H));
      x = x32.data();
    }
    RunExperts(m, x, x_bf16, ids, static_cast<const float*>(w_stage.get()), T, k, act, y, WorkerPool::Shared());
  }
};

// The submit's instantiate state.
struct HostChannelState {
  static ffi::TypeId id;
  std::shared_ptr<HostChannel> channel;
};
ffi::TypeId HostChannelState::id = {};

// The `pair` attribute -> the channel of that pair's submit. Filed by the submit's instantiate stage and again by
// each execution of the submit (the same HLO compiled twice, e.g. for two devices, has two channels under one id: the
// latest submit executed is the one its wait, next in the same thunk sequence, must find), read by the wait's
// execute stage. Entries of executables that are gone are dropped when a submit is instantiated (once per compile).
std::mutex channels_mu;
std::unordered_map<int64_t, std::weak_ptr<HostChannel>>& Channels() {
  static auto* channels = new std::unordered_map<int64_t, std::weak_ptr<HostChannel>>();
  return *channels;
}

void FileChannel(int64_t pair, const std::shared_ptr<HostChannel>& ch, bool drop_expired) {
  std::lock_guard<std::mutex> lock(channels_mu);
  auto& channels = Channels();
  if (drop_expired) {
    for (auto it = channels.begin(); it != channels.end();) {
      it = it->second.expired() ? channels.erase(it) : std::next(it);
    }
  }
  channels[pair] = ch;
}

std::shared_ptr<HostChannel> FindChannel(int64_t pair) {
  std::lock_guard<std::mutex> lock(channels_mu);
  auto it = Channels().find(pair);
  return it == Channels().end() ? nullptr : it->second.lock();
}

void CUDART_CB SubmitNode(void* data) {
  HostChannel* ch = static_cast<HostChannel*>(data);
  {
    std::lock_guard<std::mutex> lock(ch->mu);
    ++ch->submitted;
  }
  GetCudaCounters().host_submits.fetch_add(1, std::memory_order_relaxed);
  WorkerPool::Shared().Schedule([ch] {
    ch->Run();
    {
      std::lock_guard<std::mutex> lock(ch->mu);
      ++ch->completed;
    }
    ch->cv.notify_all();
  });
}

void CUDART_CB WaitNode(void* data) {
  HostChannel* ch = static_cast<HostChannel*>(data);
  std::unique_lock<std::mutex> lock(ch->mu);
  ch->cv.wait(lock, [ch] { return ch->completed == ch->submitted; });
  GetCudaCounters().host_waits.fetch_add(1, std::memory_order_relaxed);
}

ffi::Error CudaError(const char* op, const char* what, cudaError_t err) {
  cudaGetLastError();
  return ffi::Error::Internal(std::string(op) + ": " + what + ": " + cudaGetErrorString(err));
}

std::string Shape2(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + "]"; }

ffi::ErrorOr<std::unique_ptr<HostChannelState>> SubmitInstantiate(ffi::Span<const int64_t> bank_ids,
                                                                   ffi::Span<const int64_t> scale_bank_ids,
                                                                   std::string_view weight_format, int64_t block_rows,
                                                                   int64_t block_cols, std::string_view activation,
                                                                   float alpha, float limit, int64_t tokens,
                                                                   int64_t top_k, int64_t pair) {
  constexpr const char* kOp = "host_experts_submit (CUDA)";
  auto fail = [&](const std::string& msg) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(kOp) + ": " + msg));
  };
  auto ch = std::make_shared<HostChannel>();
  if (!ParseActivation(activation, &ch->act.kind)) return fail("unknown activation '" + std::string(activation) + "'");
  ch->act.alpha = alpha;
  ch->act.limit = limit;
  WeightSpec spec;
  if (std::string err = ParseWeightSpec(weight_format, block_rows, block_cols, &spec); !err.empty()) return fail(err);
  if (tokens < 1 || top_k < 1) return fail("tokens and top_k must be >= 1");
  for (auto ids : {bank_ids, scale_bank_ids}) {
    for (int64_t id : ids) {
      auto bank = FindBank(id);
      if (!bank) return fail(MissingBankMessage(id));
      ch->banks.push_back(std::move(bank));
    }
  }
  // The layout checks of the CPU handler (expert_inputs.h): banks, biases, and the scale banks of a block format.
  if (std::string err = CheckExpertBanks(ch->banks, bank_ids.size(), spec); !err.empty()) return fail(err);
  ch->m = ExpertBankWeights(ch->banks, bank_ids.size(), spec);
  const int64_t H = ch->m.hidden;
  ch->T = tokens;
  ch->k = top_k;
  ch->H = H;
  const size_t th = static_cast<size_t>(tokens * H), tk = static_cast<size_t>(tokens * top_k);
  PinnedPtr* bufs[] = {&ch->x_stage, &ch->ids_stage, &ch->w_stage, &ch->y_stage, &ch->errors_stage};
  const size_t sizes[] = {th * sizeof(float), tk * sizeof(int32_t), tk * sizeof(float), th * sizeof(float),
                          sizeof(int32_t)};
  for (int i = 0; i < 5; ++i) {
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, sizes[i], cudaHostAllocPortable);
    if (err != cudaSuccess) return ffi::Unexpected(CudaError(kOp, "cudaHostAlloc of the staging", err));
    bufs[i]->reset(p);
  }
  ch->x32.resize(th);
  *static_cast<int32_t*>(ch->errors_stage.get()) = 0;
  FileChannel(pair, ch, /*drop_expired=*/true);
  auto state = std::make_unique<HostChannelState>();
  state->channel = std::move(ch);
  return state;
}

ffi::Error SubmitExecute(cudaStream_t stream, HostChannelState* state, ffi::AnyBuffer x, I32Matrix ids,
                         F32Matrix weights, TicketResult ticket, ffi::Span<const int64_t> /*banks*/,
                         ffi::Span<const int64_t> /*scale_banks*/, std::string_view /*weight_format*/,
                         int64_t /*block_rows*/, int64_t /*block_cols*/, std::string_view /*activation*/,
                         float /*alpha*/, float /*limit*/, int64_t /*tokens*/, int64_t /*top_k*/, int64_t pair) {
  constexpr const char* kOp = "host_experts_submit (CUDA)";
  GetCudaCounters().submit_records.fetch_add(1, std::memory_order_relaxed);
  HostChannel& ch = *state->channel;
  const auto xd = x.dimensions();
  const int32_t xt = static_cast<int32_t>(x.element_type());
  if (xd.size() != 2 || xd[0] != ch.T || xd[1] != ch.H || !IsWeightDType(xt) || ids.dimensions()[0] != ch.T ||
      ids.dimensions()[1] != ch.k || weights.dimensions()[0] != ch.T || weights.dimensions()[1] != ch.k) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": expected x f32|bf16 " + Shape2(ch.T, ch.H) +
                                       " and ids / weights " + Shape2(ch.T, ch.k) + " (the tokens, top_k "
                                       "attributes and the banks)");
  }
  ch.x_dtype = xt;
  FileChannel(pair, state->channel, /*drop_expired=*/false);
  cudaError_t err = cudaMemcpyAsync(ch.x_stage.get(), x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(ch.ids_stage.get(), ids.typed_data(), sizeof(int32_t) * ch.T * ch.k, cudaMemcpyDeviceToHost,
                          stream);
  }
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(ch.w_stage.get(), weights.typed_data(), sizeof(float) * ch.T * ch.k, cudaMemcpyDeviceToHost,
                          stream);
  }
  if (err != cudaSuccess) return CudaError(kOp, "cudaMemcpyAsync to the staging", err);
  err = cudaLaunchHostFunc(stream, SubmitNode, &ch);
  if (err != cudaSuccess) return CudaError(kOp, "cudaLaunchHostFunc", err);
  return ffi::Error::Success();
}

ffi::Error WaitExecute(cudaStream_t stream, Ticket /*ticket*/, F32Matrix /*after*/, ffi::Result<F32Matrix> y,
                       ffi::Result<ffi::BufferR0<ffi::DataType::S32>> errors, int64_t pair) {
  constexpr const char* kOp = "host_experts_wait (CUDA)";
  GetCudaCounters().wait_records.fetch_add(1, std::memory_order_relaxed);
  std::shared_ptr<HostChannel> ch = FindChannel(pair);
  if (!ch) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": no live host_experts_submit has pair id " +
                                       std::to_string(pair));
  }
  if (y->dimensions()[0] != ch->T || y->dimensions()[1] != ch->H) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": y must be f32 " + Shape2(ch->T, ch->H));
  }
  cudaError_t err = cudaLaunchHostFunc(stream, WaitNode, ch.get());
  if (err != cudaSuccess) return CudaError(kOp, "cudaLaunchHostFunc", err);
  err = cudaMemcpyAsync(y->typed_data(), ch->y_stage.get(), sizeof(float) * ch->T * ch->H, cudaMemcpyHostToDevice,
                        stream);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(errors->typed_data(), ch->errors_stage.get(), sizeof(int32_t), cudaMemcpyHostToDevice,
                          stream);
  }
  if (err != cudaSuccess) return CudaError(kOp, "cudaMemcpyAsync of y and errors", err);
  return ffi::Error::Success();
}

}  // namespace

void* HostChannelTypeId() { return &HostChannelState::id; }
void* HostChannelTypeInfo() { return StateTypeInfo<HostChannelState>(); }

}  // namespace ft_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxHostExpertsSubmitInstantiate, ft_jax::SubmitInstantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<ffi::Span<const int64_t>>("banks")
                                  .Attr<ffi::Span<const int64_t>>("scale_banks")
                                  .Attr<std::string_view>("weight_format")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols")
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit")
                                  .Attr<int64_t>("tokens")
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("pair"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxHostExpertsSubmit, ft_jax::SubmitExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::State<ft_jax::HostChannelState>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ft_jax::I32Matrix>()
                                  .Arg<ft_jax::F32Matrix>()
                                  .Ret<ft_jax::Ticket>()
                                  .Attr<ffi::Span<const int64_t>>("banks")
                                  .Attr<ffi::Span<const int64_t>>("scale_banks")
                                  .Attr<std::string_view>("weight_format")
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols")
                                  .Attr<std::string_view>("activation")
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit")
                                  .Attr<int64_t>("tokens")
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("pair"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtJaxHostExpertsWait, ft_jax::WaitExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ft_jax::Ticket>()
                                  .Arg<ft_jax::F32Matrix>()
                                  .Ret<ft_jax::F32Matrix>()
                                  .Ret<ffi::BufferR0<ffi::DataType::S32>>()
                                  .Attr<int64_t>("pair"),
                              {ffi::Traits::kCmdBufferCompatible});
