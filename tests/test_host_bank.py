"""Host banks: shapes/dtypes, zero-copy page-aligned views, row writes with casting, from_numpy (incl. memory
maps), lifetime (release, double release, keep-alive of views, garbage collection), page offsets and file regions
mapped into a bank; stack_on_huge_pages and use_huge_pages keep the values."""

import gc
import mmap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ft_jax import _ffi
from ft_jax.kernels.host_bank import MAP_ALIGNMENT, HostBank, host_array, stack_on_huge_pages, use_huge_pages


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


def _file_mappings(path) -> list[tuple[int, int]]:
    """[start, end) address ranges of the mappings of ``path`` in this process (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                start, end = (int(a, 16) for a in fields[0].split("-"))
                out.append((start, end))
    return out


@pytest.mark.parametrize("page_offset", [0, 8, 4096 + 200, MAP_ALIGNMENT - 8])
def test_page_offset_places_the_data_and_banks_do_not_overlap(page_offset):
    banks = [HostBank(3, (1000, 700), np.float32, page_offset=page_offset) for _ in range(4)]  # 8.4 MB each
    for i, bank in enumerate(banks):
        assert bank.numpy().ctypes.data % MAP_ALIGNMENT == page_offset
        bank.numpy()[...] = i + 1
    for i, bank in enumerate(banks):  # no bank's memory runs into another's
        view = bank.numpy()
        assert view.min() == view.max() == i + 1
        bank.release()


def test_page_offset_errors():
    with pytest.raises(ValueError, match="page_offset must be"):
        HostBank(2, (3,), np.float32, page_offset=MAP_ALIGNMENT)
    with pytest.raises(ValueError, match="page_offset must be a multiple of the float32 element size"):
        HostBank(2, (3,), np.float32, page_offset=6)


def test_a_page_offset_per_row_places_each_row_and_gaps_only_where_the_offsets_break():
    """Rows 0-1 follow each other (row 1's offset is row 0's + row_bytes), row 2 wants another residue: it starts
    after a gap of less than 2 MiB, row 3 follows it. The views, row writes, take and the frozen copy see the rows."""
    rb = 300 * 1000 * 4  # 1.2 MB, not a page multiple
    wanted = [4096 + 200, (4096 + 200 + rb) % MAP_ALIGNMENT, 64, (64 + rb) % MAP_ALIGNMENT]
    bank = HostBank(4, (300, 1000), np.float32, page_offset=wanted)
    offsets = bank.row_offsets
    assert offsets[0] == 0 and offsets[1] == rb and offsets[3] == offsets[2] + rb
    assert rb * 2 < offsets[2] < rb * 2 + MAP_ALIGNMENT and not bank.uniform
    assert [bank.rows(r, r + 1).ctypes.data % MAP_ALIGNMENT for r in range(4)] == wanted
    assert _ffi.bank_buffer(bank.id).nbytes == offsets[3] + rb  # the span, gaps included
    assert bank.nbytes == 4 * rb
    with pytest.raises(ValueError, match="rows 1:3 of bank .* are not at one stride"):
        bank.rows(1, 3)
    with pytest.raises(ValueError, match="not at one stride; write them through rows"):
        bank.numpy()
    with pytest.raises(IndexError, match="rows 3:5 outside"):
        bank.rows(3, 5)
    for r in range(4):
        bank.write_row(r, np.full((300, 1000), r + 1, np.float32))
    bank.rows(0, 2)[1, 0, 0] = -1  # rows 0-1 and 2-3 are each one view
    bank.rows(2, 4)[0, 299, 999] = -2
    expected = np.repeat(np.arange(1, 5, dtype=np.float32), 300 * 1000).reshape(4, 300, 1000)
    expected[1, 0, 0], expected[2, 299, 999] = -1, -2
    np.testing.assert_array_equal(bank.take([0, 1, 2, 3]), expected)
    np.testing.assert_array_equal(bank.take([3, 0]), expected[[3, 0]])
    bank.freeze()
    frozen = bank.numpy()  # a read-only copy
    np.testing.assert_array_equal(frozen, expected)
    assert not frozen.flags.writeable and not bank.rows(2, 4).flags.writeable
    as_jax = bank.to_jax()  # the resident policy's device copy
    assert as_jax.shape == (4, 300, 1000) and as_jax.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(as_jax), expected)
    bank.release()
    one = HostBank(3, (5,), np.float32, page_offset=[8, 28, 48])  # offsets that follow: one stride
    assert one.uniform and list(one.row_offsets) == [0, 20, 40] and one.numpy().ctypes.data % MAP_ALIGNMENT == 8
    with pytest.raises(ValueError, match="2 page offsets for 3 rows"):
        HostBank(3, (5,), np.float32, page_offset=[0, 20])
    with pytest.raises(ValueError, match="page_offset must be"):
        HostBank(2, (5,), np.float32, page_offset=[0, MAP_ALIGNMENT])


def test_sizes_beyond_the_address_space_and_values_that_are_not_integers_are_refused_by_name():
    """A fresh-user trial: [2, 2^40, 2^40] float32 made a bank of 0 bytes (the byte count wrapped), 2^52 rows of 4 KiB
    a bare std::bad_alloc after the bank was made, 2^70 rows nanobind's "incompatible function arguments"; a float
    page offset, row count or row index was truncated, take() read booleans as row indices."""
    for rows, shape in ((2, (2**40, 2**40)), (2**52, (1024,)), (2**62, (1024,)), (2**70, (4,))):
        with pytest.raises(ValueError, match=r"exceeds? the address space \(2\^47 bytes\)"):
            HostBank(rows, shape, np.float32)
    for kwargs in ({"num_rows": 2.5}, {"row_shape": (4.0,)}, {"page_offset": 4.7}, {"page_offset": "4"},
                   {"page_offset": [0, 64.5]}, {"page_offset": None}, {"page_offset": True}):
        args = {"num_rows": 2, "row_shape": (4,), "dtype": np.float32, **kwargs}
        with pytest.raises(TypeError, match=f"HostBank: {next(iter(kwargs))}: expected an integer, got"):
            HostBank(**args)
    with pytest.raises(TypeError, match="page_offset must be an integer or a 1-D sequence of integers"):
        HostBank(2, (4,), np.float32, page_offset=np.zeros((2, 2), np.int64))
    bank = HostBank(4, (3,), np.float32, page_offset=np.array([0, 12, 24, 36]))  # numpy integers are integers
    bank.write_row(3, np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(bank.take(np.array([3, 0])), [[0, 1, 2], [0, 0, 0]])
    with pytest.raises(TypeError, match="take: expected an integer, got np.True_"):
        bank.take(np.array([True, False]))
    with pytest.raises(IndexError, match=r"HostBank.take: rows \[-1, 4\] outside bank"):
        bank.take([-1, 0, 4])
    with pytest.raises(TypeError, match="rows: expected an integer, got 0.5"):
        bank.rows(0.5, 1)
    with pytest.raises(TypeError, match="write_row: expected an integer, got 1.9"):
        bank.write_row(1.9, np.zeros(3, np.float32))
    bank.release()


def _random_file(path, nbytes: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    return data


def test_bank_from_a_file_region_holds_exactly_the_file_bytes(tmp_path):
    path = tmp_path / "weights.bin"
    data = _random_file(path, 3 << 20)
    file_offset, nbytes, row_offset = 1234 * 8, (1 << 20) + 4000, 3 * 4096  # not page aligned, not a page multiple
    bank = HostBank(4, (1 << 20,), np.uint8, page_offset=(file_offset - row_offset) % MAP_ALIGNMENT)
    dest = bank.numpy().reshape(-1)[row_offset:row_offset + nbytes]
    with open(path, "rb") as f:
        begin, end = _ffi.bank_map_file(dest.ctypes.data, nbytes, f.fileno(), file_offset)
    address = dest.ctypes.data
    # The whole pages inside the range are mapped; the partial pages at both ends are left to the caller.
    assert begin == -address % 4096 and end == (address + nbytes) // 4096 * 4096 - address and begin < end
    assert [(s, e) for s, e in _file_mappings(path)] == [(address + begin, address + end)]
    np.testing.assert_array_equal(dest[begin:end], np.frombuffer(data, np.uint8, end - begin, file_offset + begin))
    assert not bank.numpy().reshape(-1)[:row_offset + begin].any()  # nothing outside was touched
    assert not bank.numpy().reshape(-1)[row_offset + end:].any()
    # Copy-on-write: the bank is writable and writing never reaches the file.
    dest[begin:begin + 16] = 7
    assert (dest[begin:begin + 16] == 7).all()
    assert open(path, "rb").read() == data
    bank.release()
    del dest  # the last view: the memory goes with it
    gc.collect()
    assert _file_mappings(path) == []


def test_bank_map_file_maps_nothing_it_cannot(tmp_path):
    path = tmp_path / "weights.bin"
    _random_file(path, 1 << 20)
    bank = HostBank(1, (1 << 20,), np.uint8)  # page_offset 0
    dest = bank.numpy().reshape(-1)
    outside = np.zeros(1 << 20, np.uint8)
    with open(path, "rb") as f:
        assert _ffi.bank_map_file(dest.ctypes.data, 1 << 19, f.fileno(), 8) == (0, 0)  # not page congruent
        assert _ffi.bank_map_file(dest.ctypes.data + 8, 1000, f.fileno(), 8) == (0, 0)  # no whole page
        assert _ffi.bank_map_file(outside.ctypes.data, 1 << 19, f.fileno(), 0) == (0, 0)  # not in a bank
        assert _ffi.bank_map_file(dest.ctypes.data + 4096, 1 << 20, f.fileno(), 0) == (0, 0)  # runs past the bank
    assert _file_mappings(path) == [] and not dest.any()
    bank.release()


def test_stack_on_huge_pages_stacks_and_concatenates():
    rng = np.random.default_rng(2)
    layers = [[rng.standard_normal((300, 2048)).astype(ml_dtypes.bfloat16),
               rng.standard_normal((100, 2048)).astype(ml_dtypes.bfloat16)] for _ in range(3)]  # 4.9 MB
    out = stack_on_huge_pages(layers)
    expected = np.stack([np.concatenate(parts) for parts in layers])
    assert out.shape == (3, 400, 2048) and out.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), expected.view(np.uint16))
    if jax.default_backend() == "cpu":  # the CPU backend uses the huge-page buffer itself
        assert out.unsafe_buffer_pointer() % MAP_ALIGNMENT == 0
    small = stack_on_huge_pages([[np.arange(4, dtype=np.float32)], [np.arange(4, 8, dtype=np.float32)]])
    np.testing.assert_array_equal(np.asarray(small), np.arange(8, dtype=np.float32).reshape(2, 4))
    with pytest.raises(ValueError, match="layer 1 has 3 rows, layer 0 4"):
        stack_on_huge_pages([[np.zeros(4, np.float32)], [np.zeros(3, np.float32)]])
    with pytest.raises(ValueError, match="no layers"):
        stack_on_huge_pages([])


def test_host_array_aliases_what_it_can_and_copies_the_rest_once():
    """An aligned read-only buffer (as a file view) becomes the jax array's memory; one jax cannot use (32 bytes off,
    as a safetensors tensor often is) is copied once onto huge pages; the values are the same."""
    region = mmap.mmap(-1, 8 << 20)
    region[:] = np.random.default_rng(4).integers(0, 1 << 16, 4 << 20, dtype=np.uint16).tobytes()
    aligned = np.frombuffer(region, np.uint16, (4 << 20) - 64).reshape(-1, 64)
    shifted = np.frombuffer(region, np.uint16, (4 << 20) - 64, 32).reshape(-1, 64)
    for a in (aligned, shifted):
        a.flags.writeable = False
        out = host_array(a)
        np.testing.assert_array_equal(np.asarray(out), a)
        if jax.default_backend() == "cpu":
            assert (out.unsafe_buffer_pointer() == a.ctypes.data) == (a is aligned)
            if a is shifted:
                assert out.unsafe_buffer_pointer() % MAP_ALIGNMENT == 0


def test_use_huge_pages_keeps_the_values():
    """A zero buffer's pages are dropped (it reads back as zeros), another is collapsed: values unchanged."""
    values = np.random.default_rng(3).standard_normal(3 << 20).astype(np.float32)  # 12 MiB
    a, z = jnp.asarray(values), jnp.zeros(3 << 20, jnp.float32)
    use_huge_pages((a, z))
    np.testing.assert_array_equal(np.asarray(a), values)
    assert not np.asarray(z).any()
    z = jax.jit(lambda z: z.at[5].set(2.0), donate_argnums=0)(z)  # written after its pages were dropped
    assert float(z[5]) == 2.0 and float(jnp.abs(z).sum()) == 2.0


def test_an_empty_row_shape_is_one_element_per_row():
    bank = HostBank(3, (), np.float32)
    bank.write_row(1, np.float32(2.5))
    assert bank.shape == (3,) and bank.row_bytes == 4
    np.testing.assert_array_equal(bank.numpy(), [0.0, 2.5, 0.0])
    bank.release()
