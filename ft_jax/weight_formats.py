"""Weight formats: how a weight matrix [rows, cols] (Hugging Face [out, in]) is stored, as one concept.

Every format stores a matrix as ``data`` and, for the block formats, ``scales``:

| name  | data                         | scales                                  | value of element (r, c)             |
|-------|------------------------------|-----------------------------------------|-------------------------------------|
| f32   | f32 [rows, cols]             | none                                    | data[r, c]                          |
| bf16  | bf16 [rows, cols]            | none                                    | data[r, c]                          |
| q8_0  | i8 [rows, cols]              | f16 [rows, cols / 32]                   | scales[r, c // 32] * data[r, c]     |
| q4_0  | u8 [rows, cols / 2]          | f16 [rows, cols / 32]                   | scales[r, c // 32] * (q - 8)        |
| mxfp4 | u8 [rows, cols / 2]          | u8 E8M0 [rows, cols / 32]               | FP4_E2M1[q] * 2^(scales - 127)      |
| fp8   | f8e4m3fn [rows, cols]        | f32 [ceil(rows / br), ceil(cols / bc)]  | data[r, c] * scales[r // br, c // bc]|

Packed 4-bit codes q: q4_0 as llama.cpp's block_q4_0 (ggml-common.h): byte j (0..15) of each 32-element block holds
element j in its low nibble and element j + 16 in its high nibble. mxfp4 as the OCP Microscaling Formats v1.0 spec
and the Hugging Face gpt-oss checkpoints (transformers integrations/mxfp4.py): byte j holds element 2j (low nibble)
and 2j + 1 (high nibble). q8_0 / q4_0 keep llama.cpp's values (gguf's numpy quantizer, gguf/quants.py, gives the
same bytes: :func:`quantize`), with the f16 scale of each block in a separate array instead of in front of the
block (:func:`gguf_blocks` interleaves them back). fp8 is the block-scaled FP8 of DeepSeek-V3 and the Qwen3 *-FP8
checkpoints (``weight_scale_inv`` per 128 x 128 block, ``quantization_config.weight_block_size``; edge blocks may be
partial).

q4_0x16 (``Q4_0_X16``, name "q4_0": the same values and bytes per matrix) is how the CPU keeps q4_0 expert banks and
projections at the AVX-512 kernel level (:func:`storage_format`): rows in groups of 16, each group one stream that
the AVX-512 VNNI kernel dots 16 rows at a time, one row per lane, as llama.cpp's repacked block_q4_0x8
(ggml-cpu/repack.cpp). Group g (rows 16g .. 16g + 15) holds, for block b, four 64-byte chunks c whose 4-byte word i
is bytes 4c .. 4c + 3 of row 16g + i's block b, and its scales [16g .. 16g + 15, b] as 16 consecutive f16
(xla_ffi/quant_dot.h; :func:`interleave_rows`, :func:`deinterleave_rows`).

A gate_up expert row [2I, H] holds two matrices (gate then up) of I rows each: the data of up starts at row I, its
scales at row ``scale_rows(I)`` of the scale array (the two scale grids are stacked, so a block never spans both).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import ft_jax  # CUDA_ENABLED (storage_format)
from ft_jax import _ffi

QBLOCK = 32  # elements per block of q8_0, q4_0 and mxfp4
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# FP4 E2M1 element values by 4-bit code (OCP Microscaling Formats v1.0; transformers' FP4_VALUES).
FP4_E2M1 = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """One storage format of a weight matrix (table in the module docstring).

    Attributes:
        name: "f32", "bf16", "q8_0", "q4_0", "mxfp4" or "fp8".
        data_dtype: numpy dtype of the data array.
        values_per_item: matrix elements per data element (2 for the packed 4-bit formats, else 1).
        scale_dtype: numpy dtype of the scale array, or None (f32, bf16).
        block: (rows, cols) of the matrix sharing one scale ((1, 32) for q8_0 / q4_0 / mxfp4, e.g. (128, 128) for
            fp8); (1, 1) for f32 / bf16.
        interleave: rows per interleaved group (16: Q4_0_X16, the CPU's q4_0 expert banks), else 1 (row layout).
    """

    name: str
    data_dtype: np.dtype
    values_per_item: int = 1
    scale_dtype: np.dtype | None = None
    block: tuple[int, int] = (1, 1)
    interleave: int = 1

    @property
    def quantized(self) -> bool:
        """True for the block formats (they have scales)."""
        return self.scale_dtype is not None

    @property
    def kernel_name(self) -> str:
        """The FFI handlers' ``weight_format`` attribute: "float" for f32 / bf16 (the buffer dtype tells), "q4_0x16"
        for Q4_0_X16, else name."""
        if not self.quantized:
            return "float"
        return f"{self.name}x{self.interleave}" if self.interleave > 1 else self.name

    def check_cols(self, cols: int, what: str) -> None:
        """Raises ValueError naming ``what`` (e.g. the tensor) when rows of ``cols`` elements do not fit the format:
        q8_0, q4_0 and mxfp4 need cols % 32 == 0 (fp8's edge blocks may be partial)."""
        if self.name != "fp8" and cols % self.block[1]:  # fp8((1, bc)) (fp8_rowwise) too may end partial
            raise ValueError(f"{what}: rows of {cols} elements do not fit {self.name}'s blocks of {self.block[1]} "
                             f"(the row length must be a multiple of {self.block[1]})")

    def data_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Shape of the data array of a [rows, cols] matrix."""
        self.check_cols(cols, f"a [{rows}, {cols}] matrix")
        return rows, cols // self.values_per_item

    def scale_rows(self, rows: int) -> int:
        """Rows of the scale array of a matrix of ``rows`` rows (ceil(rows / block rows)); 0 without scales."""
        return -(-rows // self.block[0]) if self.quantized else 0

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int] | None:
        """Shape of the scale array of a [rows, cols] matrix, or None without scales."""
        if not self.quantized:
            return None
        return self.scale_rows(rows), -(-cols // self.block[1])

    def nbytes(self, rows: int, cols: int) -> int:
        """Stored bytes of a [rows, cols] matrix: data plus scales (the "bytes per weight" of every budget)."""
        data = math.prod(self.data_shape(rows, cols)) * self.data_dtype.itemsize
        scales = self.scale_shape(rows, cols)
        return data + (0 if scales is None else math.prod(scales) * self.scale_dtype.itemsize)

    def bits_per_weight(self, rows: int, cols: int) -> float:
        """nbytes * 8 / (rows * cols)."""
        return self.nbytes(rows, cols) * 8 / (rows * cols)


F32 = WeightFormat("f32", np.dtype(np.float32))
BF16 = WeightFormat("bf16", np.dtype(ml_dtypes.bfloat16))
Q8_0 = WeightFormat("q8_0", np.dtype(np.int8), 1, np.dtype(np.float16), (1, QBLOCK))
Q4_0 = WeightFormat("q4_0", np.dtype(np.uint8), 2, np.dtype(np.float16), (1, QBLOCK))
MXFP4 = WeightFormat("mxfp4", np.dtype(np.uint8), 2, np.dtype(np.uint8), (1, QBLOCK))
Q4_0_X16 = dataclasses.replace(Q4_0, interleave=16)  # q4_0 in groups of 16 interleaved rows (module docstring)


def row_layout(fmt: WeightFormat) -> WeightFormat:
    """The row-layout format of ``fmt``: Q4_0 for Q4_0_X16 (what quantize makes and dequantize reads), else ``fmt``."""
    return Q4_0 if fmt == Q4_0_X16 else fmt


def fp8(block: tuple[int, int] = (128, 128)) -> WeightFormat:
    """The block-scaled FP8 (e4m3) format with ``block`` = (rows, cols) per scale (quantization_config's
    weight_block_size; DeepSeek-V3 and Qwen3-FP8: [128, 128]). Raises ValueError for a non-positive block."""
    br, bc = (int(b) for b in block)
    if br < 1 or bc < 1:
        raise ValueError(f"fp8: the block shape must be positive, got {list(block)}")
    return WeightFormat("fp8", np.dtype(ml_dtypes.float8_e4m3fn), 1, np.dtype(np.float32), (br, bc))


QUANTIZE_CHOICES = ("q8_0", "q4_0")  # what --quantize / load(quantize=...) makes from a float checkpoint


def quantize_choice(value: str | None) -> str | None:
    """The quantization target a user named, as --quantize and ``ft_jax.load(quantize=...)`` take it: "q8_0" or
    "q4_0" in any case, with surrounding spaces ("Q8_0", " q4_0 "), normalized to its QUANTIZE_CHOICES name; None
    stays None (no quantization). The one normalization of both (the CLI's arg_types.quantize and
    ft_jax.config.quantization.expert_format, which every loader calls).

    Raises:
        TypeError: ``value`` is neither a str nor None (names the argument ``quantize`` and what it got).
        ValueError: a str other than q8_0 / q4_0 (names the choices and what it got).
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f'quantize must be a str ("q8_0" or "q4_0", any case) or None, got {type(value).__name__} '
                        f"{value!r}")
    name = value.strip().lower()
    if name not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)} (any case) or None, got {value!r}")
    return name


_BY_NAME = {f.name: f for f in (F32, BF16, Q8_0, Q4_0, MXFP4)}


def by_name(name: str) -> WeightFormat:
    """The format called ``name`` ("f32", "bf16", "q8_0", "q4_0", "mxfp4", "fp8" = fp8 with 128 x 128 blocks).
    Raises ValueError naming the supported ones."""
    if name == "fp8":
        return fp8()
    if name not in _BY_NAME:
        raise ValueError(f"unknown weight format {name!r}; supported: {', '.join([*_BY_NAME, 'fp8'])}")
    return _BY_NAME[name]


def float_format(dtype) -> WeightFormat:
    """F32 or BF16 for a float32 / bfloat16 dtype. Raises ValueError for any other dtype."""
    d = np.dtype(dtype)
    for f in (F32, BF16):
        if d == f.data_dtype:
            return f
    raise ValueError(f"no plain weight format holds {d.name} (expected float32 or bfloat16)")


_QUANTIZE_CODES = {"q8_0": 0, "q4_0": 1}  # _ffi.quantize_rows' fmt_code


def quantize(w: np.ndarray, fmt: WeightFormat, threads: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a float matrix to q8_0 or q4_0 with llama.cpp's reference rounding (ggml-quants.c
    quantize_row_q8_0_ref / quantize_row_q4_0_ref), in C++ (xla_ffi/quantize.cc, ``_ffi.quantize_rows``; the GIL is
    released). The bytes equal gguf.quants.quantize's (gguf/quants.py, numpy) for every input, split as in the module
    docstring: values are widened to float32 and computed in float32 operation by operation as numpy does.

    q8_0: d = max|x| / 127, id = 1 / d (0 when d = 0), q = roundf(x * id) (halves away from zero). q4_0: m = the
    element of largest |x| (the first one on ties), d = m / -8, id as for q8_0, q = min(15, trunc(x * id + 8.5)).
    d is stored as f16 (round to nearest even; >= 65520 becomes inf). Non-finite values give numpy's bytes on x86-64:
    a NaN or inf in a block makes d NaN / inf and the codes 0 (q8_0) or 0 / 8 (q4_0), and so does a block whose d is
    so small (< 2^-126 / 127 ...) that 1 / d overflows (its d is an f16 zero then).

    Args:
        w: float [..., rows, cols] (float32, bfloat16, float16 read as they are; float64 rounded to float32 first),
            cols % 32 == 0; any strides (copied when not C-contiguous).
        fmt: Q8_0 or Q4_0.
        threads: threads splitting the rows; 0 = one per hardware thread (the bytes do not depend on it).
    Returns:
        (data, scales): q8_0 i8 [..., rows, cols] and f16 [..., rows, cols / 32]; q4_0 u8 [..., rows, cols / 2] and
        f16 [..., rows, cols / 32].
    Raises:
        ValueError: another format, a 0-d or 1-d w, or cols not a multiple of 32.
        TypeError: w of a non-float dtype, or fmt not a WeightFormat.
    """
    if not isinstance(fmt, WeightFormat):
        raise TypeError(f"quantize: fmt must be a WeightFormat (Q8_0, Q4_0, or by_name('q8_0')), got {fmt!r}")
    if fmt not in (Q8_0, Q4_0):
        raise ValueError(f"quantize: {fmt.name} is not a quantization target (supported: {', '.join(QUANTIZE_CHOICES)})")
    w = np.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"quantize to {fmt.name}: expected a matrix [..., rows, cols], got shape {list(w.shape)}")
    fmt.check_cols(w.shape[-1], f"quantize to {fmt.name}: a {list(w.shape)} tensor")
    if w.dtype not in (np.float32, BF16.data_dtype, np.float16):
        if not np.issubdtype(w.dtype, np.floating):
            raise TypeError(f"quantize to {fmt.name}: a {w.dtype.name} tensor {list(w.shape)}; expected a float "
                            "dtype (float32, bfloat16, float16, float64)")
        w = w.astype(np.float32)  # float64: rounded to float32 first (gguf quantizes float32)
    *lead, rows, cols = w.shape
    src = np.ascontiguousarray(w).reshape(-1, cols)  # [R, cols], R = prod(lead) * rows
    if src.dtype == BF16.data_dtype:
        src = src.view(np.uint16)  # _ffi.quantize_rows reads uint16 as bfloat16 bits
    data = np.empty(fmt.data_shape(src.shape[0], cols), fmt.data_dtype)  # [R, cols / values_per_item]
    scales = np.empty((src.shape[0], cols // QBLOCK), np.float16)  # [R, cols / 32]
    _ffi.quantize_rows(src, _QUANTIZE_CODES[fmt.name], data, scales, threads)
    return data.reshape(*lead, rows, -1), scales.reshape(*lead, rows, -1)


def gguf_blocks(data: np.ndarray, scales: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """q8_0 / q4_0 (data, scales) as the bytes of a GGUF tensor: u8 [..., rows, G * (2 + 32 / values_per_item)],
    each block's f16 scale in front of its values (block_q8_0 / block_q4_0)."""
    g = scales.shape[-1]
    qs = data.view(np.uint8).reshape(*data.shape[:-1], g, -1)
    return np.concatenate([scales.astype(np.float16).view(np.uint8).reshape(*scales.shape, 2), qs],
                          axis=-1).reshape(*data.shape[:-1], -1)


def storage_format(fmt: WeightFormat, *row_counts: int) -> WeightFormat:
    """The format matrices of ``fmt`` with these row counts are kept in on the default backend: q4_0 on the CPU as
    Q4_0_X16 (16 rows per stream, the AVX-512 VNNI kernel's layout) where the kernels run at the AVX-512 level
    (``_ffi.kernel_isa()``; every AVX-512 BF16 CPU has VNNI) and every matrix is whole groups of 16 rows (as every
    released MoE's projections are), else ``fmt``. AVX2 and the portable level keep q4_0's row layout, which their
    row kernels read directly; so does a process with the CUDA forms on (ft_jax.CUDA_ENABLED: its slots are read by
    the Pallas kernels)."""
    if (fmt == Q4_0 and not ft_jax.CUDA_ENABLED and jax.default_backend() == "cpu"
            and _ffi.kernel_isa() == "avx512bf16" and all(r % Q4_0_X16.interleave == 0 for r in row_counts)):
        return Q4_0_X16
    return fmt


def in_storage_format(t: "QuantizedTensor", empty) -> "QuantizedTensor":
    """A q4_0 QuantizedTensor (numpy; data [..., rows, cols / 2]) in storage_format: interleaved into new arrays made
    by ``empty(shape, dtype)`` (e.g. host_bank.huge_page_buffer, which the CPU backend then uses in place; Q4_0_X16,
    every matrix of the stack interleaved), or ``t`` itself. t's arrays are never written: they may be shared (a tied
    embedding)."""
    fmt = storage_format(t.fmt, t.data.shape[-2])
    if fmt == t.fmt:
        return t
    data, scales = empty(t.data.shape, t.data.dtype), empty(t.scales.shape, t.scales.dtype)
    data[...], scales[...] = t.data, t.scales
    interleave_rows(data.reshape(-1, data.shape[-1]), scales.reshape(-1, scales.shape[-1]))  # the matrices as one:
    return QuantizedTensor(data, scales, fmt)  # each starts at a multiple of 16 rows, so its groups are its own


def interleave_rows(data: np.ndarray, scales: np.ndarray) -> None:
    """Rewrite q4_0 (data u8 [rows, cols / 2], scales f16 [rows, cols / 32], C-contiguous and writable, rows a
    multiple of 16) in place from row layout into Q4_0_X16's (module docstring), in C++ (``_ffi.interleave_q4_0_rows``,
    the GIL released). Raises ValueError naming the array of a wrong dtype or shape (rows not a multiple of 16)."""
    _ffi.interleave_q4_0_rows(data, scales.view(np.uint16))


def deinterleave_rows(data: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0_X16 (data u8 [..., rows, cols / 2], scales f16 [..., rows, cols / 32], rows a multiple of 16) back in q4_0's
    row layout, as new arrays of the same shapes (numpy; the inverse of :func:`interleave_rows`). Raises ValueError
    for rows that are not a multiple of 16."""
    *lead, rows, half = data.shape
    nb, n = scales.shape[-1], Q4_0_X16.interleave
    if rows % n or half != 16 * nb:
        raise ValueError(f"deinterleave_rows: q4_0x16 data {list(data.shape)} with scales {list(scales.shape)} needs a "
                         f"multiple of {n} rows and 32 elements per scale")
    words = np.ascontiguousarray(data).view(np.uint32).reshape(*lead, rows // n, nb, 4, n)  # [.., G, b, c, i]
    out = np.ascontiguousarray(np.moveaxis(words, -1, -3)).reshape(*lead, rows, 4 * nb)  # [.., G, i, b, c]: rows
    s = np.ascontiguousarray(np.moveaxis(scales.reshape(*lead, rows // n, nb, n), -1, -2)).reshape(*lead, rows, nb)
    return out.view(np.uint8), s


def dequantize(data: np.ndarray, scales: np.ndarray | None, fmt: WeightFormat, rows: int | None = None,
               dtype=np.float32) -> np.ndarray:
    """Stored (data, scales) of ``fmt`` back to values [..., rows, cols] in ``dtype`` (float32 or float64; exact for
    every format: each value is one product of two floats).

    Args:
        data, scales: as :meth:`WeightFormat.data_shape` / :meth:`WeightFormat.scale_shape` give them, with any
            leading axes (scales None for f32 / bf16).
        rows: for a gate_up pair (two matrices of ``rows`` rows each, stacked; see the module docstring) the rows of
            one matrix; default: data holds one matrix.
    Raises:
        ValueError: shapes that do not match the format.
    """
    if not fmt.quantized:
        return np.asarray(data).astype(dtype)
    if fmt.interleave > 1:  # Q4_0_X16: its rows back in order first
        data, scales = deinterleave_rows(np.asarray(data), np.asarray(scales))
        fmt = row_layout(fmt)
    n = data.shape[-2]
    if rows is not None and rows * 2 == n and fmt.block[0] > 1:
        sr = fmt.scale_rows(rows)
        parts = [dequantize(data[..., :rows, :], scales[..., :sr, :], fmt, None, dtype),
                 dequantize(data[..., rows:, :], scales[..., sr:, :], fmt, None, dtype)]
        return np.concatenate(parts, axis=-2)
    cols = data.shape[-1] * fmt.values_per_item
    want = fmt.scale_shape(n, cols)
    if scales.shape[-2:] != want or scales.shape[:-2] != data.shape[:-2]:
        raise ValueError(f"dequantize {fmt.name}: data {list(data.shape)} needs scales [..., {want[0]}, {want[1]}], "
                         f"got {list(scales.shape)}")
    if fmt.name == "fp8":
        s = np.repeat(np.repeat(scales.astype(dtype), fmt.block[0], -2)[..., :n, :], fmt.block[1], -1)[..., :cols]
        return data.astype(dtype) * s
    if fmt is Q8_0:
        values = data.astype(dtype).reshape(*data.shape[:-1], -1, QBLOCK)
        scale = scales.astype(dtype)
    elif fmt is Q4_0:
        b = data.reshape(*data.shape[:-1], -1, QBLOCK // 2)  # u8[..., G, 16]
        values = np.concatenate([b & 0x0F, b >> 4], axis=-1).astype(dtype) - 8
        scale = scales.astype(dtype)
    else:  # mxfp4
        b = data.reshape(*data.shape[:-1], -1, QBLOCK // 2)
        codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], QBLOCK)  # element 2j, 2j + 1
        values = FP4_E2M1.astype(dtype)[codes]
        with np.errstate(over="ignore"):
            scale = np.ldexp(np.ones((), dtype), scales.astype(np.int32) - 127)
    return (values * scale[..., None]).reshape(*data.shape[:-1], cols)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """A (stack of) block-format weight matrices kept as stored: ``data`` and ``scales`` as the module docstring
    gives them for ``fmt``, with any leading axes (a stack of L layers: data [L, *data_shape], scales
    [L, *scale_shape]). A pytree (data and scales are its leaves; fmt is static), so it can be an nnx.Param's value
    and a jit argument; numpy arrays while loading, jax arrays on the device.

    ``t[...]`` returns ``t`` (how the models read a parameter: ``self.wq[...]``).
    """

    data: object
    scales: object
    fmt: WeightFormat = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("QuantizedTensor: only t[...] is supported (index the data and scales instead)")

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape (..., rows, cols) of the matrices."""
        *lead, rows, cols = self.data.shape
        return (*lead, rows, cols * self.fmt.values_per_item)

    @property
    def nbytes(self) -> int:
        """Stored bytes: data plus scales."""
        return int(self.data.nbytes) + int(self.scales.nbytes)


def _e8m0_jnp(scales):
    """E8M0 exponents (u8) as f32 2^(s - 127), built from the bits (exact: s = 0 gives the subnormal 2^-127 and 255
    gives inf, as np.ldexp in :func:`dequantize`)."""
    s = scales.astype(jnp.int32)
    bits = jnp.where(s == 0, jnp.int32(1 << 22), s << 23)  # 2^-127 = mantissa bit 22 of a zero exponent
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize_jnp(t: QuantizedTensor, dtype=jnp.float32):
    """The jnp form of :func:`dequantize` for one matrix (or a stack of them: data and scales with any leading axes;
    traceable: jit, scan, any backend): the values [..., rows, cols] of ``t``, computed in float32 and cast to
    ``dtype`` (float32 or bfloat16). (A gate_up pair with stacked fp8 scale grids is two matrices: dequantize each.)

    In float32 the values equal :func:`dequantize`'s bit for bit (each is one product of two floats, the same two),
    except where a backend flushes subnormal results to zero (XLA:CPU does): mxfp4 scales below 2^-126, or an
    fp8 / q8_0 / q4_0 product below 2^-126, are then 0.

    Args:
        t: a QuantizedTensor of jax (or numpy) arrays.
        dtype: result dtype; bfloat16 rounds the float32 values once (round to nearest even).
    Returns:
        [..., rows, cols] in ``dtype``.
    Raises:
        ValueError: scales whose shape does not match the format and the data.
    """
    fmt, data, scales = t.fmt, jnp.asarray(t.data), jnp.asarray(t.scales)
    if fmt.interleave > 1:  # Q4_0_X16: its rows back in order (reshapes and one transpose, as deinterleave_rows)
        *lead, rows, half = data.shape
        nb = scales.shape[-1]
        words = jax.lax.bitcast_convert_type(data.reshape(*lead, rows // 16, nb, 4, 16, 4), jnp.uint32)
        data = jax.lax.bitcast_convert_type(jnp.moveaxis(words, -1, -3), jnp.uint8).reshape(*lead, rows, half)
        scales = jnp.moveaxis(scales.reshape(*lead, rows // 16, nb, 16), -1, -2).reshape(*lead, rows, nb)
        fmt = row_layout(fmt)
    n = data.shape[-2]
    cols = data.shape[-1] * fmt.values_per_item
    want = fmt.scale_shape(n, cols)
    if scales.shape[-2:] != want or scales.shape[:-2] != data.shape[:-2]:
        raise ValueError(f"dequantize_jnp {fmt.name}: data {list(data.shape)} needs scales [..., {want[0]}, "
                         f"{want[1]}], got {list(scales.shape)}")
    f32 = jnp.float32
    if fmt.name == "fp8":
        s = jnp.repeat(jnp.repeat(scales.astype(f32), fmt.block[0], -2)[..., :n, :], fmt.block[1], -1)[..., :cols]
        return (data.astype(f32) * s).astype(dtype)  # [..., rows, cols]
    if fmt is Q8_0:
        values = data.astype(f32).reshape(*data.shape[:-1], -1, QBLOCK)  # [..., rows, G, 32]
        scale = scales.astype(f32)
    elif fmt is Q4_0:
        b = data.reshape(*data.shape[:-1], -1, QBLOCK // 2)  # u8[..., rows, G, 16]
        values = jnp.concatenate([b & 0x0F, b >> 4], axis=-1).astype(f32) - 8  # element j, j + 16
        scale = scales.astype(f32)
    elif fmt is MXFP4:
        b = data.reshape(*data.shape[:-1], -1, QBLOCK // 2)
        codes = jnp.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], QBLOCK)  # element 2j, 2j + 1
        values = jnp.asarray(FP4_E2M1)[codes.astype(jnp.int32)]  # f32[..., rows, G, 32]
        scale = _e8m0_jnp(scales)
    else:
        raise ValueError(f"dequantize_jnp: no block format {fmt.name!r}")
    return (values * scale[..., None]).reshape(*data.shape[:-1], cols).astype(dtype)


def fp8_rowwise(t: QuantizedTensor) -> QuantizedTensor:
    """An fp8 matrix (numpy, any leading axes) with one scale row per matrix row: format fp8((1, bc)), scales
    repeated along the rows (the same values; what lets fused projections concatenate fp8 parts whose row counts
    are not multiples of the block rows). Raises ValueError for another format."""
    if t.fmt.name != "fp8":
        raise ValueError(f"fp8_rowwise: {t.fmt.name} is not fp8")
    rows = t.data.shape[-2]
    scales = np.repeat(np.asarray(t.scales), t.fmt.block[0], axis=-2)[..., :rows, :]  # [..., rows, ceil(cols / bc)]
    return QuantizedTensor(t.data, scales, fp8((1, t.fmt.block[1])))


def expert_rows(fmt: WeightFormat, hidden: int, intermediate: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{bank name: (row shape, dtype)} of one routed expert's weights in ``fmt`` (the ExpertBanks rows; biases are not
    weights of a format and are not listed): gate_up fmt.data_shape(2I, H), down fmt.data_shape(H, I) in
    fmt.data_dtype and, for a block format, gate_up_scale (2 * fmt.scale_rows(I), ceil(H / bc)) (the gate and up
    scale grids stacked, module docstring) and down_scale fmt.scale_shape(H, I) in fmt.scale_dtype.

    Raises ValueError (WeightFormat.check_cols) when H or I does not fit the format's blocks."""
    H, I = int(hidden), int(intermediate)
    rows = {"gate_up": (fmt.data_shape(2 * I, H), fmt.data_dtype), "down": (fmt.data_shape(H, I), fmt.data_dtype)}
    if fmt.quantized:
        rows["gate_up_scale"] = ((2 * fmt.scale_rows(I), -(-H // fmt.block[1])), fmt.scale_dtype)
        rows["down_scale"] = (fmt.scale_shape(H, I), fmt.scale_dtype)
    return rows
