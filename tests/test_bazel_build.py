"""The Bazel-built FFI library (BUILD.bazel, scripts/bazel_build.sh) loads with ctypes and runs slot_fill under jit.

The library is build/bazel/libft_jax_ffi.so, or the path in FT_JAX_BAZEL_LIB. When it is missing the library tests
skip, except under CI (CI=true), where .ci/run builds it first and a missing library is a failure.
The library has its own host bank registry (separate from the pip-built ft_jax._ffi), so banks are created through
its extern "C" API (xla_ffi/host_bank.h) and its FtJaxSlotFill symbols (instantiate + execute stages, with the
BoundBanks state type) are registered under names of their own.
"""

import ctypes
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LIB = REPO / "build" / "bazel" / "libft_jax_ffi.so"
TARGET_NAME = "ft_jax_bazel_slot_fill"  # the pip-built extension registers its own names; this must not clash
DTYPE_CODES = {np.dtype(np.float32): 11, np.dtype(ml_dtypes.bfloat16): 16}  # XLA_FFI_DataType F32, BF16


def _lib_path() -> Path:
    return Path(os.environ.get("FT_JAX_BAZEL_LIB", DEFAULT_LIB))


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def lib():
    """ctypes handle of the Bazel-built library with the host bank C API typed; FtJaxSlotFill registered once."""
    path = _lib_path()
    if not path.is_file():
        reason = (f"Bazel-built FFI library not found at {path}: run scripts/bazel_build.sh "
                  f"(or set FT_JAX_BAZEL_LIB)")
        if _in_ci():
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    handle = ctypes.CDLL(str(path))
    handle.ft_jax_bank_create.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64),
                                          ctypes.c_int32]
    handle.ft_jax_bank_create.restype = ctypes.c_int64
    handle.ft_jax_bank_data.argtypes = [ctypes.c_int64]
    handle.ft_jax_bank_data.restype = ctypes.c_void_p
    handle.ft_jax_bank_nbytes.argtypes = [ctypes.c_int64]
    handle.ft_jax_bank_nbytes.restype = ctypes.c_int64
    handle.ft_jax_bank_release.argtypes = [ctypes.c_int64]
    handle.ft_jax_bank_release.restype = ctypes.c_int32
    handle.ft_jax_last_error.argtypes = []
    handle.ft_jax_last_error.restype = ctypes.c_char_p
    # slot_fill binds its banks at the instantiate stage in a BoundBanks state: register that type (under a name of
    # this library's own: its TypeId object differs from the pip extension's), then both stages of the handler.
    for fn in (handle.FtJaxBoundBanksTypeId, handle.FtJaxBoundBanksTypeInfo):
        fn.restype = ctypes.c_void_p
    jax.devices("cpu")  # types must be registered with a live CPU client (see ft_jax/__init__.py)
    jax.ffi.register_ffi_type("ft_jax_bazel_bound_banks", {"type_id": _capsule(handle.FtJaxBoundBanksTypeId()),
                                                           "type_info": _capsule(handle.FtJaxBoundBanksTypeInfo())},
                              platform="cpu")
    jax.ffi.register_ffi_target(TARGET_NAME, {"instantiate": jax.ffi.pycapsule(handle.FtJaxSlotFillInstantiate),
                                              "execute": jax.ffi.pycapsule(handle.FtJaxSlotFill)}, platform="cpu")
    return handle


def _capsule(address: int):
    """A PyCapsule holding a data pointer (jax.ffi.pycapsule wraps function pointers only)."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(address, None, None)


def _create_bank(lib, rows: np.ndarray) -> int:
    """Creates a bank in the Bazel library's registry holding rows [R, *row_shape] (f32 or bf16); returns its id."""
    row_shape = rows.shape[1:]
    dims = (ctypes.c_int64 * len(row_shape))(*row_shape)
    bank_id = lib.ft_jax_bank_create(rows.shape[0], len(row_shape), dims, DTYPE_CODES[rows.dtype])
    assert bank_id > 0, lib.ft_jax_last_error().decode()
    nbytes = lib.ft_jax_bank_nbytes(bank_id)
    assert nbytes == rows.nbytes
    ptr = lib.ft_jax_bank_data(bank_id)
    assert ptr % 4096 == 0  # page-aligned host bank
    view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))  # u8[nbytes], zero-copy
    view[:] = rows.reshape(-1).view(np.uint8)
    return bank_id


def _slot_fill(slots, flat_ids, slot_ids, bank_id: int):
    """slots [S, *row] updated in place with bank rows: slots[slot_ids[n]] = bank[flat_ids[n]] (ids < 0 skipped)."""
    return jax.ffi.ffi_call(TARGET_NAME, (jax.ShapeDtypeStruct(slots.shape, slots.dtype),),
                            input_output_aliases={2: 0})(flat_ids, slot_ids, slots, banks=np.array([bank_id], np.int64))[0]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_slot_fill_bit_exact(lib, dtype):
    rng = np.random.default_rng(7)
    num_rows, num_slots, n, row_shape = 12, 6, 5, (3, 16)
    bank_rows = rng.standard_normal((num_rows, *row_shape)).astype(dtype)   # [R, 3, 16]
    slots0 = rng.standard_normal((num_slots, *row_shape)).astype(dtype)     # [S, 3, 16]
    flat_ids = rng.integers(0, num_rows, n).astype(np.int32)               # i32[N]
    slot_ids = rng.permutation(num_slots)[:n].astype(np.int32)             # i32[N], distinct slots
    flat_ids[1] = -1  # padding entries: skipped
    slot_ids[3] = -1
    expected = slots0.copy()
    for f, s in zip(flat_ids, slot_ids):
        if f >= 0 and s >= 0:
            expected[s] = bank_rows[f]

    bank_id = _create_bank(lib, bank_rows)
    try:
        step = jax.jit(lambda s, f, i: _slot_fill(s, f, i, bank_id), donate_argnums=0)
        out = np.asarray(step(jnp.asarray(slots0), jnp.asarray(flat_ids), jnp.asarray(slot_ids)))
    finally:
        assert lib.ft_jax_bank_release(bank_id) == 0
    assert out.dtype == np.dtype(dtype) and out.shape == slots0.shape
    np.testing.assert_array_equal(out.view(np.uint16 if out.itemsize == 2 else np.uint32),
                                  expected.view(np.uint16 if out.itemsize == 2 else np.uint32))


def test_out_of_range_id_is_an_error_and_release_twice_fails(lib):
    bank_id = _create_bank(lib, np.ones((4, 8), np.float32))
    slots = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(Exception, match=r"flat id 9 .*out of range"):
        jax.block_until_ready(jax.jit(lambda s, f, i: _slot_fill(s, f, i, bank_id))(
            slots, jnp.array([9], jnp.int32), jnp.array([0], jnp.int32)))
    # The library keeps working after the error.
    out = jax.jit(lambda s, f, i: _slot_fill(s, f, i, bank_id))(
        slots, jnp.array([3], jnp.int32), jnp.array([1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.array([[0.0] * 8, [1.0] * 8], np.float32))
    assert lib.ft_jax_bank_release(bank_id) == 0
    assert lib.ft_jax_bank_release(bank_id) == -1
    assert str(bank_id) in lib.ft_jax_last_error().decode()


def _cmake_core_sources() -> list[str]:
    text = (REPO / "CMakeLists.txt").read_text()
    match = re.search(r"add_library\(\s*ft_jax_ffi_core\s+STATIC\s+([^)]*)\)", text)
    assert match, "CMakeLists.txt: add_library(ft_jax_ffi_core STATIC ...) not found"
    return match.group(1).split()


def _bazel_sources() -> list[str]:
    text = (REPO / "BUILD.bazel").read_text()
    match = re.search(r"FFI_SRCS\s*=\s*\[([^\]]*)\]", text)
    assert match, "BUILD.bazel: FFI_SRCS = [...] not found"
    return re.findall(r'"([^"]+)"', match.group(1))


def test_bazel_sources_match_cmake():
    """BUILD.bazel compiles exactly the C++ sources of CMake's ft_jax_ffi_core (no nanobind module)."""
    assert sorted(_bazel_sources()) == sorted(_cmake_core_sources())
    assert "xla_ffi/module.cc" not in _bazel_sources()


def test_bazel_headers_hold_every_included_header():
    """FFI_HDRS lists every xla_ffi/ header the sources include, directly or through another header (Bazel's
    sandbox sees only the listed files: a missing one fails the build, not this machine's CMake build)."""
    text = (REPO / "BUILD.bazel").read_text()
    match = re.search(r"FFI_HDRS\s*=\s*\[([^\]]*)\]", text)
    assert match, "BUILD.bazel: FFI_HDRS = [...] not found"
    listed = set(re.findall(r'"([^"]+)"', match.group(1)))
    todo, needed = list(_bazel_sources()), set()
    while todo:
        for header in re.findall(r'#include "(xla_ffi/[^"]+)"', (REPO / todo.pop()).read_text()):
            if header not in needed:
                needed.add(header)
                todo.append(header)
    assert needed - listed == set(), f"BUILD.bazel FFI_HDRS misses {sorted(needed - listed)}"


def test_exports_every_handler_and_the_state_type(lib):
    """Every CPU handler symbol of xla_ffi/ffi_handlers.h and the BoundBanks type hooks are exported (export.h)."""
    for name in ("FtJaxSlotFill", "FtJaxSlotFillInstantiate", "FtJaxHostExperts", "FtJaxHostExpertsInstantiate",
                 "FtJaxSlotExperts", "FtJaxLinear", "FtJaxDecodeAttention", "FtJaxBoundBanksTypeId",
                 "FtJaxBoundBanksTypeInfo"):
        assert hasattr(lib, name), name


def test_coexists_with_pip_extension(lib):
    """Both libraries export the same symbols; each handler must read its own bank registry (no interposition)."""
    host_bank = pytest.importorskip("ft_jax.kernels.host_bank")
    pip_bank = host_bank.HostBank(3, (5,), np.float32)  # lives in ft_jax._ffi's registry, not the Bazel library's
    try:
        rows = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)  # [R=4, 8]
        bank_id = _create_bank(lib, rows)
        out = jax.jit(lambda s, f, i: _slot_fill(s, f, i, bank_id))(
            jnp.zeros((2, 8), jnp.float32), jnp.array([2, -1], jnp.int32), jnp.array([0, 1], jnp.int32))
        np.testing.assert_array_equal(np.asarray(out), np.stack([rows[2], np.zeros(8, np.float32)]))
        assert lib.ft_jax_bank_release(bank_id) == 0
    finally:
        pip_bank.release()
