"""Host banks: shapes/dtypes, zero-copy page-aligned views, row writes with casting, from_numpy (incl. memory
maps), lifetime (release, double release, keep-alive of views, garbage collection)."""

import gc

import ml_dtypes
import numpy as np
import pytest

from ft_jax import _ffi
from ft_jax.kernels.host_bank import HostBank


@pytest.mark.parametrize("dtype, itemsize", [(np.float32, 4), (ml_dtypes.bfloat16, 2)])
def test_properties_and_zero_filled_aligned_view(dtype, itemsize):
    bank = HostBank(5, (6, 3), dtype)
    assert isinstance(bank.id, int) and bank.id >= 1
    assert bank.num_rows == 5 and bank.row_shape == (6, 3) and bank.shape == (5, 6, 3)
    assert bank.dtype == np.dtype(dtype)
    assert bank.row_bytes == 6 * 3 * itemsize and bank.nbytes == 5 * 6 * 3 * itemsize
    view = bank.numpy()
    assert view.shape == (5, 6, 3) and view.dtype == np.dtype(dtype)
    assert view.ctypes.data % 4096 == 0
    assert not view.any()
    assert _ffi.bank_buffer(bank.id).nbytes == bank.nbytes  # the C++ bank holds exactly these bytes
    bank.release()


def test_view_is_zero_copy_and_writable():
    bank = HostBank(3, (4,), np.float32)
    bank.numpy()[1] = [1.0, 2.0, 3.0, 4.0]
    again = bank.numpy()
    np.testing.assert_array_equal(again, [[0, 0, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]])
    assert again.ctypes.data == bank.numpy().ctypes.data
    bank.release()


def test_write_row_casts_f32_to_bf16_round_to_nearest_even():
    rng = np.random.default_rng(0)
    row = rng.standard_normal((4, 5)).astype(np.float32)
    bank = HostBank(2, (4, 5), "bfloat16")
    bank.write_row(1, row)
    expected = row.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bank.numpy()[1].view(np.uint16), expected.view(np.uint16))
    assert not bank.numpy()[0].astype(np.float32).any()
    bank.release()


def test_write_row_errors():
    bank = HostBank(2, (3,), np.float32)
    with pytest.raises(ValueError, match=r"rows have shape \(3,\), got array of shape \(4,\)"):
        bank.write_row(0, np.zeros(4, np.float32))
    with pytest.raises(IndexError, match="row 2 out of range"):
        bank.write_row(2, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="got a int64 array"):
        bank.write_row(0, np.zeros(3, np.int64))
    bank.release()
    with pytest.raises(ValueError, match="was released"):
        bank.write_row(0, np.zeros(3, np.float32))


def test_from_numpy_and_memmap(tmp_path):
    rng = np.random.default_rng(1)
    data = rng.standard_normal((7, 3, 4)).astype(np.float32)
    bank = HostBank.from_numpy(data)
    np.testing.assert_array_equal(bank.numpy(), data)
    path = tmp_path / "rows.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=data.shape)
    bank16 = HostBank.from_numpy(mm, dtype=ml_dtypes.bfloat16)
    assert bank16.dtype == np.dtype(ml_dtypes.bfloat16) and bank16.shape == (7, 3, 4)
    np.testing.assert_array_equal(bank16.numpy().view(np.uint16), data.astype(ml_dtypes.bfloat16).view(np.uint16))
    bank.release()
    bank16.release()


def test_bad_construction():
    with pytest.raises(TypeError, match="unsupported dtype float64"):
        HostBank(2, (3,), np.float64)
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        HostBank(0, (3,), np.float32)
    with pytest.raises(ValueError, match="row dimensions must be >= 1"):
        HostBank(2, (3, 0), np.float32)


def test_release_twice_is_an_error_and_views_keep_memory_alive():
    bank = HostBank(2, (8,), np.float32)
    view = bank.numpy()
    view[:] = 5.0
    bank.release()
    assert not bank.alive and not _ffi.bank_is_live(bank.id)
    with pytest.raises(ValueError, match=f"bank {bank.id} .* was already released"):
        bank.release()
    with pytest.raises(ValueError, match="was released"):
        bank.numpy()
    # The view taken before the release still owns the memory.
    np.testing.assert_array_equal(view, np.full((2, 8), 5.0, np.float32))
    assert "released" in repr(bank)


def test_context_manager_and_garbage_collection_release():
    with HostBank(1, (2,), np.float32) as bank:
        bank_id = bank.id
        assert _ffi.bank_is_live(bank_id)
    assert not _ffi.bank_is_live(bank_id)
    other = HostBank(1, (2,), np.float32)
    other_id = other.id
    del other
    gc.collect()
    assert not _ffi.bank_is_live(other_id)
    with pytest.raises(ValueError, match=f"bank {other_id} was released"):
        _ffi.bank_release(other_id)
    with pytest.raises(ValueError, match="bank 999999 does not exist"):
        _ffi.bank_buffer(999999)


def test_freeze_makes_the_bank_read_only():
    bank = HostBank(3, (2,), np.float32)
    bank.write_row(1, np.array([1.0, 2.0], np.float32))
    assert not bank.frozen
    bank.freeze()
    assert bank.frozen and "frozen" in repr(bank)
    view = bank.numpy()
    assert not view.flags.writeable
    np.testing.assert_array_equal(view, [[0, 0], [1, 2], [0, 0]])  # the data is still readable, unchanged
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 5.0
    with pytest.raises(ValueError, match=f"bank {bank.id} .* is read-only"):
        bank.write_row(0, np.zeros(2, np.float32))
    np.testing.assert_array_equal(bank.numpy(), [[0, 0], [1, 2], [0, 0]])
    bank.freeze()  # idempotent
    bank.release()
    with pytest.raises(ValueError, match="was released"):
        bank.freeze()
