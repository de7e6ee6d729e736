"""weight_formats.quantize (the C++ quantizer xla_ffi/quantize.cc behind _ffi.quantize_rows): its bytes equal gguf's
numpy quantizer (gguf.quants.quantize, the independent reference) for every input -- random data at many scales,
f16-subnormal and f16-overflowing scales, exact rounding ties, all-zero blocks, |max| ties of opposite signs, NaN / inf,
float32 / bfloat16 / float16 sources, leading axes, any thread count -- and bad input is refused naming the problem.
"""

from __future__ import annotations

import warnings

import gguf
import ml_dtypes
import numpy as np
import pytest

from ft_jax import _ffi
from ft_jax import weight_formats as wf

FORMATS = {"q8_0": (wf.Q8_0, gguf.GGMLQuantizationType.Q8_0), "q4_0": (wf.Q4_0, gguf.GGMLQuantizationType.Q4_0)}


def gguf_bytes(w: np.ndarray, name: str) -> np.ndarray:
    """gguf.quants.quantize of w (any float dtype, widened to float32 exactly) as u8 [..., rows, blocks bytes]."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):  # NaN / inf blocks: numpy's invalid-cast warnings
        warnings.simplefilter("ignore")
        return gguf.quants.quantize(np.asarray(w).astype(np.float32), FORMATS[name][1])


def assert_gguf_equal(w: np.ndarray, name: str, threads: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """quantize(w) has the layouts of weight_formats and, interleaved, gguf's bytes; returns (data, scales)."""
    fmt = FORMATS[name][0]
    data, scales = wf.quantize(w, fmt, threads)
    *lead, rows, cols = w.shape
    assert data.shape == (*lead, *fmt.data_shape(rows, cols)) and data.dtype == fmt.data_dtype
    assert scales.shape == (*lead, *fmt.scale_shape(rows, cols)) and scales.dtype == np.float16
    got, want = wf.gguf_blocks(data, scales, fmt), gguf_bytes(w, name)
    if not np.array_equal(got, want):
        bad = np.argwhere(got != want)[0]
        raise AssertionError(f"{name} {w.dtype} {list(w.shape)}: {int((got != want).sum())} bytes differ from gguf's, "
                             f"the first at {bad.tolist()}: {got[tuple(bad)]} != {want[tuple(bad)]}")
    return data, scales


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
def test_random_at_many_scales(name, dtype):
    """Normal data from 1e-44 (float32 subnormals: 1 / d overflows) over f16-subnormal scales to values whose d
    overflows f16 (amax > 65504 * 127); heavy-tailed data too. float16 sources clip to their own range."""
    rng = np.random.default_rng(0)
    limit = 6e4 if dtype is np.float16 else 1e38
    for scale in [1.0, 0.02, 1e-3, 1e-5, 1e-7, 1e-9, 1e-20, 1e-37, 1e-39, 1e-44, 1e3, 6e4, 65504 * 127, 1e7, 1e30]:
        if scale * 4 > limit:
            continue
        w = (rng.standard_normal((24, 96)) * scale).astype(dtype)
        assert_gguf_equal(w, name)
        t = (rng.standard_cauchy((8, 64)) * scale).clip(-limit, limit).astype(dtype)
        assert_gguf_equal(t, name)
    if dtype is np.float16:  # every f16 magnitude class, subnormal halves included
        bits = rng.integers(0, 0x7c00, (16, 256), dtype=np.uint16) | (rng.integers(0, 2, (16, 256), np.uint16) << 15)
        assert_gguf_equal(bits.view(np.float16), name)


@pytest.mark.parametrize("name", FORMATS)
def test_random_float32_bit_patterns(name):
    """Blocks of random float32 bit patterns of every finite exponent (each block within a few binades, so the codes
    are not all 0), and single-element blocks: d covers the whole f16 range and its rounding."""
    rng = np.random.default_rng(1)
    exp = rng.integers(1, 254, (512, 1, 1))
    e = np.clip(exp + rng.integers(-3, 1, (512, 2, 32)), 0, 254)
    bits = (e << 23) | rng.integers(0, 1 << 23, (512, 2, 32)) | (rng.integers(0, 2, (512, 2, 32)) << 31)
    w = bits.astype(np.uint32).view(np.float32).reshape(512, 64)
    assert_gguf_equal(w, name)
    lone = np.zeros((512, 64), np.float32)
    lone[:, ::32] = w[:, ::32]
    assert_gguf_equal(lone, name)


@pytest.mark.parametrize("name", FORMATS)
def test_rounding_ties_zero_blocks_and_max_ties(name):
    """Exact .5 ties of roundf (q8_0: d = 1 when max |x| = 127; q4_0: x * id + 8.5 an integer when max = -8), all-zero
    and +-0 blocks, and blocks whose largest |x| occurs with both signs (q4_0 takes the first: the sign of d)."""
    halves = np.arange(-126.5, 127, 1.0, dtype=np.float32)  # 254 ties
    rows = []
    for i in range(0, len(halves), 31):
        part = halves[i:i + 31]
        rows.append(np.concatenate([[127.0 if name == "q8_0" else -8.0], part / (1 if name == "q8_0" else 16),
                                    np.zeros(31 - len(part))]).astype(np.float32))
    q4_ties = np.arange(-7.5, 8, 0.5, dtype=np.float32)  # 31 values: x * 1 + 8.5 = 1..16
    rows.append(np.concatenate([[-8.0], q4_ties]).astype(np.float32))
    rows.append(np.zeros(32, np.float32))
    rows.append(np.where(np.arange(32) % 2, -0.0, 0.0).astype(np.float32))
    for a, b in [(3.0, -3.0), (-3.0, 3.0), (1e-30, -1e-30), (65504.0 * 8, -65504.0 * 8)]:
        r = (np.linspace(-1, 1, 32) * abs(a) / 2).astype(np.float32)  # |r| < |a| but at the two ties
        r[5], r[20] = a, b
        rows.append(r)
    w = np.stack(rows)  # f32[R, 32]
    data, scales = assert_gguf_equal(w, name)
    if name == "q4_0":  # the first of the opposite-sign maxima sets the sign of d = max / -8
        assert np.signbit(scales[-4:, 0]).tolist() == [True, False, True, True]
    assert_gguf_equal(np.tile(w, (1, 3)).astype(ml_dtypes.bfloat16), name)


def _f16_ties() -> np.ndarray:
    """float32 values exactly halfway between neighbouring f16 values (normal and subnormal), their float32
    neighbours, and the overflow edge (65504, the tie 65520, the largest float below 65520, 65536)."""
    h = np.concatenate([np.arange(0, 0x7bff, 97, dtype=np.uint16), np.arange(0, 64, dtype=np.uint16),
                        np.arange(0x3ff, 0x410, dtype=np.uint16)])
    lo, hi = h.view(np.float16).astype(np.float32), (h + 1).view(np.float16).astype(np.float32)
    mid = (lo + hi) / 2  # exact in float32 (11-bit significands)
    edge = np.array([65504.0, 65520.0, np.nextafter(np.float32(65520), np.float32(0)), 65536.0, 2.0 ** -25,
                     np.nextafter(np.float32(2.0 ** -25), np.float32(1)), 2.0 ** -24, 2.0 ** -14], np.float32)
    t = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0)), edge])
    return t[np.isfinite(t) & (t > 0)]


def test_scale_f16_rounding_ties():
    """q4_0's d = max / -8 is exact (a power of two), so max = -8 t puts d exactly on f16 rounding ties (round to
    nearest even), subnormal halves and the overflow to inf; the scales equal numpy's astype(np.float16) of t."""
    t = _f16_ties()
    n = -(-len(t) // 2) * 2
    t = np.resize(t, n)
    w = np.zeros((n // 2, 64), np.float32)
    w[:, 0], w[:, 32] = -8 * t[0::2], 8 * t[1::2]  # d = t and -t
    data, scales = assert_gguf_equal(w, "q4_0")
    with np.errstate(over="ignore"):  # the values >= 65520 become inf, as they should
        want = np.stack([t[0::2], -t[1::2]], axis=1).astype(np.float16)
    np.testing.assert_array_equal(scales.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("name", FORMATS)
def test_non_finite_values(name):
    """NaN and +-inf in a block (alone, with each other, first or last) give gguf's bytes (NaN / inf scales, codes 0 or
    8); the other blocks of the row are unaffected."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((12, 64)).astype(np.float32)
    w[0, 3] = np.nan
    w[1, 0], w[1, 31] = np.inf, 1.0
    w[2, 7] = -np.inf
    w[3, 1], w[3, 2] = -np.inf, np.nan
    w[4, 2], w[4, 9] = np.nan, -np.inf
    w[5, 31] = -np.nan
    w[6, :32] = np.inf
    w[7, 4], w[7, 5] = np.inf, -np.inf
    assert_gguf_equal(w, name)
    assert_gguf_equal(w.astype(ml_dtypes.bfloat16), name)
    assert_gguf_equal(w.astype(np.float16), name)


@pytest.mark.parametrize("name", FORMATS)
def test_leading_axes_strides_and_threads(name):
    """Leading axes keep their shape; a transposed (non-contiguous) input equals its contiguous copy; the bytes do
    not depend on the thread count (a matrix large enough to be split)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 3, 5, 64)).astype(ml_dtypes.bfloat16)
    data, scales = assert_gguf_equal(w, name)
    flat = wf.quantize(w.reshape(30, 64), FORMATS[name][0])
    np.testing.assert_array_equal(data.reshape(30, -1), flat[0])
    wt = rng.standard_normal((96, 40)).astype(np.float32).T  # [40, 96], column-major
    assert_gguf_equal(wt, name)
    ro = rng.standard_normal((8, 64)).astype(np.float16)
    ro.flags.writeable = False  # a read-only source (the loader's mmapped tensors)
    assert_gguf_equal(ro, name)
    big = (rng.standard_normal((1024, 4096)) * 0.02).astype(ml_dtypes.bfloat16)  # 4 Mi values: up to 4 threads
    ref = wf.gguf_blocks(*wf.quantize(big[:64], FORMATS[name][0], 1), FORMATS[name][0])
    np.testing.assert_array_equal(ref, gguf_bytes(big[:64], name))
    outs = [wf.quantize(big, FORMATS[name][0], n) for n in (1, 2, 3, 0)]
    for d, s in outs[1:]:
        np.testing.assert_array_equal(d, outs[0][0])
        np.testing.assert_array_equal(s.view(np.uint16), outs[0][1].view(np.uint16))
    np.testing.assert_array_equal(wf.gguf_blocks(*outs[0], FORMATS[name][0])[:64], ref)


def test_float64_is_rounded_to_float32():
    """A float64 matrix is quantized as its float32 rounding (what gguf quantizes)."""
    w = np.random.default_rng(4).standard_normal((4, 64))
    for name, (fmt, _) in FORMATS.items():
        got = wf.quantize(w, fmt)
        want = wf.quantize(w.astype(np.float32), fmt)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(wf.gguf_blocks(*got, fmt), gguf_bytes(w.astype(np.float32), name))


def test_errors_name_the_problem():
    w = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match=r"rows of 48 elements do not fit q8_0's blocks of 32"):
        wf.quantize(np.zeros((4, 48), np.float32), wf.Q8_0)
    with pytest.raises(ValueError, match=r"mxfp4 is not a quantization target"):
        wf.quantize(w, wf.MXFP4)
    with pytest.raises(ValueError, match=r"expected a matrix \[..., rows, cols\], got shape \[64\]"):
        wf.quantize(np.zeros(64, np.float32), wf.Q4_0)
    with pytest.raises(TypeError, match=r"a int32 tensor \[4, 64\]; expected a float dtype"):
        wf.quantize(np.zeros((4, 64), np.int32), wf.Q8_0)
    with pytest.raises(TypeError, match=r"fmt must be a WeightFormat \(Q8_0, Q4_0, or by_name\('q8_0'\)\), got 'q8_0'"):
        wf.quantize(w, "q8_0")
    d8, d4, s = np.empty((4, 64), np.int8), np.empty((4, 32), np.uint8), np.empty((4, 2), np.float16)
    with pytest.raises(ValueError, match=r"fmt_code must be 0 \(q8_0\) or 1 \(q4_0\), got 2"):
        _ffi.quantize_rows(w, 2, d8, s)
    with pytest.raises(TypeError, match=r"src must be float32, float16 or uint16"):
        _ffi.quantize_rows(w.astype(np.float64), 0, d8, s)
    with pytest.raises(ValueError, match=r"src must be 2-D, got \[256\]"):
        _ffi.quantize_rows(w.reshape(-1), 0, d8, s)
    with pytest.raises(ValueError, match=r"src \[2, 48\]: the row length must be a multiple of 32"):
        _ffi.quantize_rows(np.zeros((2, 48), np.float32), 0, d8, s)
    with pytest.raises(ValueError, match=r"data must be uint8 \[4, 32\], got \[4, 64\]"):
        _ffi.quantize_rows(w, 1, d8, s)
    with pytest.raises(ValueError, match=r"data must be int8 \[4, 64\], got \[4, 32\]"):
        _ffi.quantize_rows(w, 0, d4, s)
    with pytest.raises(ValueError, match=r"scales must be float16 \[4, 2\], got \[4, 3\]"):
        _ffi.quantize_rows(w, 0, d8, np.empty((4, 3), np.float16))
    with pytest.raises(TypeError):  # a non-contiguous output is refused, never written through a copy
        _ffi.quantize_rows(w, 0, np.empty((64, 4), np.int8).T, s)
    ro = np.empty((4, 64), np.int8)
    ro.flags.writeable = False
    with pytest.raises(TypeError):  # a read-only output
        _ffi.quantize_rows(w, 0, ro, s)
