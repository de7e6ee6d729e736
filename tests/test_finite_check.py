"""_ffi.first_non_finite (xla_ffi/finite_check.h), the loader's NaN / Inf check of mapped checkpoint bytes, against
a numpy reference: every element width, every magnitude at and around the exponent mask, unaligned addresses,
1-3 threads with hits at the threads' part boundaries (the first hit of the whole range is reported)."""

import numpy as np
import pytest

from ft_jax import _ffi

# width -> (unsigned type, exponent mask): float8_e4m3fn's one NaN magnitude, binary16 / bfloat16, binary32, binary64
_MASKS = {1: (np.uint8, 0x7F), 2: (np.uint16, 0x7F80), 4: (np.uint32, 0x7F80_0000), 8: (np.uint64, 0x7FF0 << 48)}


def _reference(bits: np.ndarray, mask: int) -> int:
    sign = np.array(1 << (8 * bits.itemsize - 1), bits.dtype)
    hits = np.flatnonzero((bits & ~sign) >= np.array(mask, bits.dtype))
    return int(hits[0]) if hits.size else -1


def _first(bits: np.ndarray, mask: int, threads: int) -> int:
    return _ffi.first_non_finite(bits.ctypes.data, bits.size, bits.itemsize, mask, threads)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_every_magnitude_around_the_mask_and_both_signs(width):
    uint, mask = _MASKS[width]
    sign = 1 << (8 * width - 1)
    for magnitude in sorted({mask - 1, mask, min(mask + 1, sign - 1), sign - 1, 0, 1}):  # float8: mask = sign - 1
        for negative in (False, True):
            bits = np.zeros(1000, uint)
            bits[537] = magnitude | (sign if negative else 0)
            expected = 537 if magnitude >= mask else -1
            assert _reference(bits, mask) == expected
            assert _first(bits, mask, 1) == expected, (width, hex(magnitude), negative)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("misalign", [0, 1, 3])
def test_random_bits_at_unaligned_addresses(width, misalign):
    uint, mask = _MASKS[width]
    rng = np.random.default_rng(width * 10 + misalign)
    n = 50_000
    raw = np.zeros(n * width + misalign, np.uint8)
    data = raw[misalign:misalign + n * width]
    for trial in range(4):
        values = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
        values &= ~np.array(mask, uint) | np.array(mask >> 1, uint)  # mostly finite: clear the top exponent bit
        if trial:  # then a few non-finite ones at random places
            values[rng.integers(0, n, trial)] |= np.array(mask, uint)
        data[:] = values.view(np.uint8)
        expected = _reference(values, mask)
        assert _ffi.first_non_finite(data.ctypes.data, n, width, mask, 1) == expected


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_first_hit_of_the_range_whatever_the_threads(threads):
    """40 MiB of bfloat16 bits: with 8 MiB or more per thread every thread takes a part; hits at the parts' first
    and last elements, in a later part only, and in several parts at once (the earliest is reported)."""
    uint, mask = _MASKS[2]
    n = 20 * 2**20
    bits = np.full(n, 0x3F80, uint)  # 1.0
    assert _first(bits, mask, threads) == -1
    step = -(-n // threads)
    places = sorted(p for p in {0, step - 1, step, n - 1, 2 * step, n // 2} if p < n)
    for where in places:
        bits[where] = 0xFF80  # -Inf
        assert _first(bits, mask, threads) == where
        bits[where] = 0x3F80
    several = [p for p in (n - 1, step, 5 * 2**20 + 7) if p < n]
    bits[several] = 0x7FC0  # NaN in several parts
    assert _first(bits, mask, threads) == min(several)


def test_empty_range_and_bad_width():
    assert _ffi.first_non_finite(0, 0, 2, 0x7F80, 2) == -1
    with pytest.raises(ValueError, match="elem_bytes must be 1, 2, 4 or 8, got 3"):
        _ffi.first_non_finite(0, 10, 3, 0x7F80, 1)
