// nanobind module ft_jax._ffi: the FFI registration tables (handler capsules, state types) and the bindings of the
// host bank registry (host_bank.h), the ISA query (isa.h) and huge-page advice (huge_pages.h). No logic of its own.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "xla_ffi/bank_state.h"
#include "xla_ffi/ffi_handlers.h"
#include "xla_ffi/host_bank.h"
#include "xla_ffi/huge_pages.h"
#include "xla_ffi/isa.h"
#include "xla_ffi/finite_check.h"
#include "xla_ffi/quant_dot.h"
#include "xla_ffi/quantize.h"
#ifdef FT_JAX_CUDA
#include "xla_ffi/cuda_handlers.h"
#endif

namespace nb = nanobind;

namespace {

// install_bus_error_message: the line SIGBUS writes (a signal handler may only call async-signal-safe functions).
char bus_message[512];
size_t bus_message_len = 0;

void OnBusError(int) {
  // write() is async-signal-safe; SA_RESETHAND restored the default action, so the faulting access, run again on
  // return, ends the process by the signal (status 128 + SIGBUS) as before.
  ssize_t written = write(2, bus_message, bus_message_len);
  (void)written;
}

std::shared_ptr<ft_jax::Bank> LiveBank(int64_t id) {
  auto bank = ft_jax::FindBank(id);
  if (!bank) throw nb::value_error(ft_jax::MissingBankMessage(id).c_str());
  return bank;
}

// dtype of a numpy array as nanobind sees it (float16 / uint16 / ...).
nb::dlpack::dtype DType(nb::dlpack::dtype_code code, uint8_t bits) {
  return nb::dlpack::dtype{static_cast<uint8_t>(code), bits, 1};
}

using CpuArray = nb::ndarray<nb::c_contig, nb::device::cpu>;            // writable
using CpuInput = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;  // read-only views too (mmapped tensors)

template <typename Array>
std::string ShapeText(const Array& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// _ffi.quantize_rows: checks the arrays (names the bad one), then ft_jax::QuantizeRows without the GIL.
void QuantizeRowsPy(CpuInput src, int32_t fmt_code, CpuArray data, CpuArray scales, int threads) {
  using Code = nb::dlpack::dtype_code;
  ft_jax::QuantSrc type;
  if (src.dtype() == DType(Code::Float, 32)) type = ft_jax::QuantSrc::kF32;
  else if (src.dtype() == DType(Code::UInt, 16)) type = ft_jax::QuantSrc::kBF16;
  else if (src.dtype() == DType(Code::Float, 16)) type = ft_jax::QuantSrc::kF16;
  else throw nb::type_error("quantize_rows: src must be float32, float16 or uint16 (bfloat16 bits)");
  if (fmt_code != 0 && fmt_code != 1) {
    throw nb::value_error(("quantize_rows: fmt_code must be 0 (q8_0) or 1 (q4_0), got " +
                           std::to_string(fmt_code)).c_str());
  }
  if (src.ndim() != 2) throw nb::value_error(("quantize_rows: src must be 2-D, got " + ShapeText(src)).c_str());
  const int64_t rows = src.shape(0), cols = src.shape(1);
  if (cols % ft_jax::kQuantBlock) {
    throw nb::value_error(
        ("quantize_rows: src " + ShapeText(src) + ": the row length must be a multiple of 32").c_str());
  }
  const bool q8 = fmt_code == 0;
  const int64_t data_cols = q8 ? cols : cols / 2;
  if (data.dtype() != DType(q8 ? Code::Int : Code::UInt, 8) || data.ndim() != 2 || data.shape(0) != size_t(rows) ||
      data.shape(1) != size_t(data_cols)) {
    throw nb::value_error(("quantize_rows: data must be " + std::string(q8 ? "int8" : "uint8") + " [" +
                           std::to_string(rows) + ", " + std::to_string(data_cols) + "], got " + ShapeText(data) +
                           " of another dtype or shape").c_str());
  }
  if ((scales.dtype() != DType(Code::Float, 16) && scales.dtype() != DType(Code::UInt, 16)) || scales.ndim() != 2 ||
      scales.shape(0) != size_t(rows) || scales.shape(1) != size_t(cols / ft_jax::kQuantBlock)) {
    throw nb::value_error(("quantize_rows: scales must be float16 [" + std::to_string(rows) + ", " +
                           std::to_string(cols / ft_jax::kQuantBlock) + "], got " + ShapeText(scales) +
                           " of another dtype or shape").c_str());
  }
  std::string err;
  {
    nb::gil_scoped_release release;  // seconds for a large matrix
    err = ft_jax::QuantizeRows(src.data(), type, rows, cols, static_cast<ft_jax::QuantFormat>(fmt_code), data.data(),
                               static_cast<uint16_t*>(scales.data()), threads);
  }
  if (!err.empty()) throw nb::value_error(("quantize_rows: " + err).c_str());
}

// _ffi.interleave_q4_0_rows: checks the arrays (names the bad one), then ft_jax::InterleaveQ4Rows without the GIL.
void InterleaveQ4RowsPy(CpuArray data, CpuArray scales) {
  using Code = nb::dlpack::dtype_code;
  if (data.dtype() != DType(Code::UInt, 8) || data.ndim() != 2) {
    throw nb::value_error(("interleave_q4_0_rows: data must be uint8 [rows, cols / 2], got " + ShapeText(data) +
                           " of another dtype or rank").c_str());
  }
  const int64_t rows = data.shape(0), cols = 2 * static_cast<int64_t>(data.shape(1));
  if ((scales.dtype() != DType(Code::Float, 16) && scales.dtype() != DType(Code::UInt, 16)) || scales.ndim() != 2 ||
      scales.shape(0) != size_t(rows) || cols % ft_jax::kQuantBlock != 0 ||
      scales.shape(1) != size_t(cols / ft_jax::kQuantBlock)) {
    throw nb::value_error(("interleave_q4_0_rows: scales must be float16 [" + std::to_string(rows) + ", " +
                           std::to_string(cols / ft_jax::kQuantBlock) + "] for data " + ShapeText(data) + ", got " +
                           ShapeText(scales) + " of another dtype or shape").c_str());
  }
  if (rows % ft_jax::kQ4Interleave != 0) {
    throw nb::value_error(("interleave_q4_0_rows: data " + ShapeText(data) + " needs a multiple of " +
                           std::to_string(ft_jax::kQ4Interleave) + " rows").c_str());
  }
  nb::gil_scoped_release release;
  ft_jax::InterleaveQ4Rows(static_cast<uint8_t*>(data.data()), static_cast<uint16_t*>(scales.data()), rows, cols);
}

// A handler symbol as the PyCapsule jax.ffi.register_ffi_target takes; a staged handler as {stage: capsule}.
template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

template <typename Instantiate, typename Execute>
nb::dict Staged(Instantiate* instantiate, Execute* execute) {
  nb::dict stages;
  stages["instantiate"] = Capsule(instantiate);
  stages["execute"] = Capsule(execute);
  return stages;
}

// {type_id, type_info} capsules of an FFI state type, as jax.ffi.register_ffi_type takes them.
nb::dict TypeInfo(void* id, void* type_info) {
  nb::dict d;
  d["type_id"] = nb::capsule(id);
  d["type_info"] = nb::capsule(type_info);
  return d;
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "ft_jax XLA FFI handlers (CPU) and host expert banks";

  m.def(
      "registrations",
      [] {
        nb::dict d;
        d["ft_jax_slot_fill"] = Staged(FtJaxSlotFillInstantiate, FtJaxSlotFill);
        d["ft_jax_host_experts"] = Staged(FtJaxHostExpertsInstantiate, FtJaxHostExperts);
        d["ft_jax_slot_experts"] = Capsule(FtJaxSlotExperts);
        d["ft_jax_linear"] = Capsule(FtJaxLinear);
        d["ft_jax_bank_linear"] = Staged(FtJaxBankLinearInstantiate, FtJaxBankLinear);
        d["ft_jax_bank_take"] = Staged(FtJaxBankTakeInstantiate, FtJaxBankTake);
        d["ft_jax_decode_attention"] = Capsule(FtJaxDecodeAttention);
        d["ft_jax_greedy_pick"] = Capsule(FtJaxGreedyPick);
        d["ft_jax_rope"] = Capsule(FtJaxRope);
        return d;
      },
      "dict target name -> PyCapsule of the XLA FFI handler, or a dict stage -> PyCapsule (CPU platform).");

  m.def(
      "types",
      [] {
        nb::dict d;
        d["ft_jax_bound_banks"] = TypeInfo(FtJaxBoundBanksTypeId(), FtJaxBoundBanksTypeInfo());
        return d;
      },
      "dict type name -> {type_id, type_info} PyCapsules of the FFI state types (register before the targets).");

  m.def("cuda_built", [] {
#ifdef FT_JAX_CUDA
    return true;
#else
    return false;
#endif
  }, "True when the extension was built with the CUDA handlers (CMake found nvcc).");

#ifdef FT_JAX_CUDA
  m.def(
      "cuda_registrations",
      [] {
        nb::dict d;
        d["ft_jax_slot_fill"] = Staged(FtJaxSlotFillCudaInstantiate, FtJaxSlotFillCuda);
        d["ft_jax_host_experts_submit"] = Staged(FtJaxHostExpertsSubmitInstantiate, FtJaxHostExpertsSubmit);
        d["ft_jax_host_experts_wait"] = Capsule(FtJaxHostExpertsWait);
        return d;
      },
      "dict target name -> PyCapsule (or dict stage -> PyCapsule) of the CUDA-platform handlers.");

  m.def(
      "cuda_types",
      [] {
        nb::dict d;
        d["ft_jax_cuda_slot_fill_state"] =
            TypeInfo(ft_jax::CudaSlotFillStateTypeId(), ft_jax::CudaSlotFillStateTypeInfo());
        d["ft_jax_cuda_host_channel"] = TypeInfo(ft_jax::HostChannelTypeId(), ft_jax::HostChannelTypeInfo());
        return d;
      },
      "dict type name -> {type_id, type_info} of the CUDA handlers' states (register before the targets).");

  m.def(
      "cuda_counters",
      [] {
        const ft_jax::CudaCounters& c = ft_jax::GetCudaCounters();
        nb::dict d;
        d["slot_fill_records"] = c.slot_fill_records.load();
        d["submit_records"] = c.submit_records.load();
        d["wait_records"] = c.wait_records.load();
        d["host_submits"] = c.host_submits.load();
        d["host_waits"] = c.host_waits.load();
        d["host_route_errors"] = c.host_route_errors.load();
        d["bounce_fills"] = c.bounce_fills.load();
        return d;
      },
      "Process-wide counts of the CUDA handlers (cuda_handlers.h): handler bodies run (records) and host-function "
      "nodes run (every execution, command buffer replays included), host GEMVs skipped for bad ids, bounce rounds.");
#endif

  m.def(
      "dtype_codes",
      [] {
        nb::dict d;
        for (ft_jax::BankDType c : ft_jax::kBankDTypes) {
          d[nb::str(ft_jax::BankDTypeName(static_cast<int32_t>(c)).c_str())] = static_cast<int32_t>(c);
        }
        return d;
      },
      "dict numpy dtype name -> bank dtype code (the XLA FFI data type code).");

  m.def(
      "bank_create",
      [](int64_t num_rows, const std::vector<int64_t>& row_shape, int32_t dtype_code,
         const std::vector<size_t>& page_offsets) {
        try {
          return ft_jax::CreateBank(num_rows, row_shape, dtype_code, page_offsets)->id();
        } catch (const std::invalid_argument& e) {
          throw nb::value_error(e.what());
        }
      },
      nb::arg("num_rows"), nb::arg("row_shape"), nb::arg("dtype_code"), nb::arg("page_offsets"),
      "Allocates a zero-filled bank whose rows' addresses are page_offsets modulo 2 MiB (one offset for the bank, "
      "or one per row: Bank::Bank); returns its id. Raises ValueError (bad shape/dtype/page_offsets), MemoryError.");

  m.def(
      "bank_row_offsets",
      [](int64_t id) {
        auto bank = LiveBank(id);
        std::vector<int64_t> out(static_cast<size_t>(bank->num_rows()));
        for (size_t r = 0; r < out.size(); ++r) out[r] = static_cast<int64_t>(bank->row_offset(r));
        return out;
      },
      nb::arg("id"), "Byte offset of every row from the bank's data address (list of int). ValueError if not live.");

  m.def(
      "bank_map_file",
      [](uintptr_t address, size_t nbytes, int fd, uint64_t file_offset) {
        auto bank = ft_jax::FindBankHolding(address, nbytes);
        if (!bank) return nb::make_tuple(0, 0);
        ft_jax::MappedRange r;
        {
          nb::gil_scoped_release release;  // mmap + page-table population of up to gigabytes
          r = bank->MapFile(address - reinterpret_cast<uintptr_t>(bank->data()), nbytes, fd, file_offset);
        }
        return nb::make_tuple(r.begin, r.end);
      },
      nb::arg("address"), nb::arg("nbytes"), nb::arg("fd"), nb::arg("file_offset"),
      "If [address, address + nbytes) lies in a live bank: map the whole pages of file bytes [file_offset, ...) of "
      "the open file fd there (Bank::MapFile) and return (begin, end), the part mapped relative to address; (0, 0) "
      "when nothing was mapped (not in a bank, offsets not congruent modulo the page size, too small, budget spent). "
      "RuntimeError if a failed mapping could not be undone.");

  m.def(
      "bank_release",
      [](int64_t id) {
        if (!ft_jax::ReleaseBank(id)) throw nb::value_error(ft_jax::MissingBankMessage(id).c_str());
      },
      nb::arg("id"), "Drops the bank from the registry (memory freed when the last user ends). ValueError if not live.");

  m.def("bank_is_live", [](int64_t id) { return ft_jax::FindBank(id) != nullptr; }, nb::arg("id"));

  m.def(
      "bank_buffer",
      [](int64_t id) {
        auto bank = LiveBank(id);
        // The array owns a shared_ptr copy: the memory stays valid while any numpy view exists, even after release.
        auto* keep = new std::shared_ptr<ft_jax::Bank>(bank);
        nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<ft_jax::Bank>*>(p); });
        size_t shape[1] = {bank->span_bytes()};
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(bank->data(), 1, shape, owner);
      },
      nb::arg("id"),
      "Writable uint8 numpy view [span_bytes] of the bank memory from row 0 to the end of the last row (keeps it "
      "alive). ValueError if not live.");

  m.def("use_huge_pages", &ft_jax::UseHugePages, nb::arg("address"), nb::arg("nbytes"),
        "Back the 2 MiB-aligned interior of a buffer with transparent huge pages (Linux); True if collapsed.");
  m.def("quantize_rows", &QuantizeRowsPy, nb::arg("src").noconvert(), nb::arg("fmt_code"), nb::arg("data").noconvert(),
        nb::arg("scales").noconvert(), nb::arg("threads") = 0,
        "Quantize src [rows, cols] (C-contiguous float32, float16 or uint16 = bfloat16 bits; cols % 32 == 0) to "
        "fmt_code 0 = q8_0 (data int8 [rows, cols]) or 1 = q4_0 (data uint8 [rows, cols / 2]), scales float16 "
        "[rows, cols / 32], written into the given C-contiguous arrays; bytes equal gguf.quants.quantize's. "
        "threads <= 0: one per hardware thread. Releases the GIL. TypeError / ValueError naming the bad array.");
  m.def("interleave_q4_0_rows", &InterleaveQ4RowsPy, nb::arg("data").noconvert(), nb::arg("scales").noconvert(),
        "Rewrite q4_0 data uint8 [rows, cols / 2] and its float16 scales [rows, cols / 32] (C-contiguous, rows % 16 "
        "== 0) in place from row layout into the q4_0x16 layout (xla_ffi/quant_dot.h). Releases the GIL. "
        "ValueError naming the bad array.");
  m.def(
      "first_non_finite",
      [](uintptr_t address, int64_t count, int elem_bytes, uint64_t mask, int threads) {
        int64_t first;
        {
          nb::gil_scoped_release release;  // gigabytes of mapped checkpoint pages
          first = ft_jax::FirstNonFinite(reinterpret_cast<const void*>(address), count, elem_bytes, mask, threads);
        }
        if (first == -2) {
          throw nb::value_error(("first_non_finite: elem_bytes must be 1, 2, 4 or 8, got " +
                                 std::to_string(elem_bytes)).c_str());
        }
        return first;
      },
      nb::arg("address"), nb::arg("count"), nb::arg("elem_bytes"), nb::arg("mask"), nb::arg("threads") = 0,
      "Index of the first of count elements of elem_bytes bytes at address whose bits with the sign cleared are >= "
      "mask (the Inf / NaN elements for mask = the exponent field), or -1; threads <= 0: the kernels' loop threads. "
      "Releases the GIL. ValueError for another elem_bytes.");
  m.def("kernel_isa", &ft_jax::KernelIsa, "'avx512bf16', 'avx2' or 'generic': the inner loops the kernels use.");
  m.def(
      "install_bus_error_message",
      [](const std::string& message) {
        bus_message_len = std::min(message.size(), sizeof(bus_message));
        std::memcpy(bus_message, message.data(), bus_message_len);
        struct sigaction action {};
        action.sa_handler = OnBusError;
        action.sa_flags = SA_RESETHAND;
        sigemptyset(&action.sa_mask);
        if (sigaction(SIGBUS, &action, nullptr) != 0) throw std::runtime_error("sigaction(SIGBUS) failed");
      },
      nb::arg("message"),
      "On SIGBUS (an access to a mapped file's page past its end: the file shrank under the mapping) write message "
      "(UTF-8, up to 512 bytes) to stderr, then end by the signal as without it. For the command line only: a "
      "library must not take over a program's signals.");
}
