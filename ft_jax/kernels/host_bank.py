"""Host expert banks: page-aligned host memory owned by the C++ extension, one row per expert.

A bank holds one weight kind for all L x E experts (flat id = moe_layer_index * E + expert_index), e.g.
  gate_up bank: rows [2I, H] (rows 0..I-1 = gate_proj.weight [I, H], rows I..2I-1 = up_proj.weight [I, H];
                Mixtral w1 = gate, w3 = up; the transformers ``experts.gate_up_proj`` [E, 2I, H] layout),
  down bank:    rows [H, I] (down_proj.weight, Mixtral w2).
The FFI handlers (ft_jax.kernels.ffi_ops) receive the bank's integer ``id`` as a compile-time attribute.

Read-only once loaded: ``freeze()`` (called by the checkpoint loader when every row is filled) makes the bank
read-only from Python, so weights that compiled decode steps read cannot be changed behind them: ``numpy()``
returns read-only views and ``write_row`` raises. It cannot be undone.

Lifetime: ``release()`` (or garbage collection of the HostBank) drops the bank from the C++ registry. A handler
that is running keeps the memory alive until it returns, numpy views returned by ``numpy()`` keep it alive while
they exist, and compiled steps that run after the release get an FFI error naming the bank instead of crashing.
"""

from __future__ import annotations

import math
import mmap
import operator
import weakref
from typing import Sequence

import jax
import ml_dtypes
import numpy as np

from ft_jax import _ffi
from ft_jax.memory import InsufficientMemoryError

_DTYPE_CODES: dict[str, int] = dict(_ffi.dtype_codes())

# A bank's data address is its page_offset modulo this (2 MiB, the x86-64 huge page; xla_ffi/host_bank.h
# kBankMapAlignment).
MAP_ALIGNMENT = 2 << 20

# Rows copied per chunk by from_numpy: bounds the temporary memory when the source is a memory map or needs a cast.
_COPY_CHUNK_BYTES = 64 << 20


def _bank_dtype(dtype) -> np.dtype:
    """np.dtype for a supported bank dtype (float32, bfloat16, float16, int8, uint8, float8_e4m3fn, float8_e5m2)."""
    if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):  # "bfloat16", "float8_e4m3fn"
        dtype = getattr(ml_dtypes, dtype)
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"HostBank: {dtype!r} is not a dtype") from e
    if dt.name not in _DTYPE_CODES:
        raise TypeError(f"HostBank: unsupported dtype {dt.name}; supported: {', '.join(sorted(_DTYPE_CODES))}")
    return dt


_INT64_MAX = 2**63 - 1


def _integer(value, what: str) -> int:
    """``value`` as an int when it is integral (an int or a numpy integer, not a bool, a float or a string)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"HostBank: {what}: expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"HostBank: {what}: expected an integer, got {value!r}") from None


def _sequence(value, what: str) -> list:
    """A scalar as [value], a 1-D sequence (list, tuple, 1-D numpy array) as a list of its items."""
    if np.ndim(value) == 0 and not isinstance(value, (list, tuple)):
        return [value]
    if np.ndim(value) != 1 and not (isinstance(value, (list, tuple)) and not value):
        raise TypeError(f"HostBank: {what} must be an integer or a 1-D sequence of integers, got {value!r}")
    return list(value)


def _release_if_live(bank_id: int) -> None:
    if _ffi.bank_is_live(bank_id):
        _ffi.bank_release(bank_id)


class HostBank:
    """A C++-owned host bank of ``num_rows`` rows of shape ``row_shape`` and dtype ``dtype``, zero-filled.

    Args:
      num_rows: number of rows (experts), >= 1.
      row_shape: shape of one row, every dimension >= 1 (e.g. (2 * I, H) for gate_up, (H, I) for down); () is a
        row of one element.
      dtype: np.float32 or jnp.bfloat16 / ml_dtypes.bfloat16 for expert weights; float16, int8, uint8,
        float8_e4m3fn and float8_e5m2 banks can be created and slot-filled but the expert kernels reject them.
      page_offset: the rows' addresses modulo MAP_ALIGNMENT (2 MiB), each in [0, MAP_ALIGNMENT): one int for the
        bank (row r at r * row_bytes from row 0, whose address is congruent to it), or one per row. The checkpoint
        loader passes SafetensorsCheckpoint.page_offsets of the tensors it fills the rows with, so that the tensors
        of a safetensors file, whose data offsets are rarely page aligned and shift from one MoE layer to the next,
        land on pages congruent with the file's: SafetensorsCheckpoint.read_into then maps the file's pages into the
        bank instead of copying them, on 2 MiB page table entries where the page cache holds 2 MiB folios. A row
        whose offset does not follow from the previous row's starts after a gap (< 2 MiB of address space, never
        touched): such a bank is not "uniform", and its rows are read with :meth:`rows` / :meth:`take`.

    Memory is an anonymous mmap (committed on first write, on transparent huge pages where the kernel allows), or
    where read_into mapped a file region, that file's page-cache pages mapped copy-on-write (a private mapping:
    writing to the bank never changes the file; docs/DESIGN.md section 15.4).

    Raises:
      TypeError: unsupported dtype; num_rows, a row dimension or a page offset that is not an integer (a float, a
        string, a bool). ValueError: non-positive num_rows or row dimension, a bank beyond the address space (2^47
        bytes, gaps included), a page offset out of range or not a multiple of the element size, or a number of page
        offsets other than 1 or num_rows.
      ft_jax.memory.InsufficientMemoryError (a MemoryError): the allocation failed.
    """

    def __init__(self, num_rows: int, row_shape: Sequence[int], dtype, page_offset: int | Sequence[int] = 0):
        self._dtype = _bank_dtype(dtype)
        num_rows = _integer(num_rows, "num_rows")
        row_shape = tuple(_integer(d, "row_shape") for d in _sequence(row_shape, "row_shape"))
        offsets = [_integer(p, "page_offset") for p in _sequence(page_offset, "page_offset")]
        for p in offsets:
            if not 0 <= p < MAP_ALIGNMENT or p % self._dtype.itemsize:
                raise ValueError(f"HostBank: page_offset must be a multiple of the {self._dtype.name} element size in "
                                 f"[0, {MAP_ALIGNMENT}), got {p}")
        if num_rows > _INT64_MAX or any(d > _INT64_MAX for d in row_shape):  # below 1: the C++ check names it
            raise ValueError(f"HostBank: {num_rows} rows of {list(row_shape)} exceed the address space (2^47 bytes)")
        try:
            self._id = int(_ffi.bank_create(num_rows, list(row_shape), _DTYPE_CODES[self._dtype.name], offsets))
        except MemoryError:  # std::bad_alloc: the same one-line error as the pre-load check
            need = num_rows * math.prod(row_shape) * self._dtype.itemsize
            gaps = ", plus up to 2 MiB of address space before each row whose offset breaks the stride" \
                if len(offsets) > 1 else ""
            raise InsufficientMemoryError(f"could not allocate a host bank of {num_rows} x {list(row_shape)} "
                                          f"{self._dtype.name} ({need // 2**20} MiB of rows{gaps}): out of host "
                                          "memory") from None
        self._num_rows = num_rows
        self._row_shape = row_shape
        self._row_offsets = np.asarray(_ffi.bank_row_offsets(self._id), np.int64)  # [num_rows] bytes from row 0
        self._frozen = False
        self._finalizer = weakref.finalize(self, _release_if_live, self._id)

    @classmethod
    def from_numpy(cls, array, dtype=None) -> "HostBank":
        """New bank holding a copy of ``array`` [R, *row_shape] (numpy array or np.memmap).

        Copies in chunks of rows, so a memory-mapped source is never materialised in full. ``dtype`` (default:
        the array's dtype) may differ from the array's, e.g. float32 data into a bfloat16 bank (round to nearest
        even, as ml_dtypes casts).

        Raises:
          ValueError: array rank < 1 or an empty dimension. TypeError: unsupported dtype.
        """
        src = np.asarray(array) if not isinstance(array, np.ndarray) else array
        if src.ndim < 1:
            raise ValueError(f"HostBank.from_numpy: array must be [R, *row_shape], got a scalar of shape {src.shape}")
        bank = cls(src.shape[0], src.shape[1:], src.dtype if dtype is None else dtype)
        dst = bank.numpy()
        rows_per_chunk = max(1, _COPY_CHUNK_BYTES // max(1, bank.row_bytes))
        for start in range(0, bank.num_rows, rows_per_chunk):
            stop = min(bank.num_rows, start + rows_per_chunk)
            dst[start:stop] = src[start:stop]
        return bank

    @property
    def id(self) -> int:
        """Integer id of the bank in the C++ registry (the FFI attribute)."""
        return self._id

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self._row_shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """(num_rows, *row_shape)."""
        return (self._num_rows, *self._row_shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return math.prod(self._row_shape) * self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the rows (num_rows * row_bytes; the gaps of a bank that is not uniform are not counted)."""
        return self._num_rows * self.row_bytes

    @property
    def uniform(self) -> bool:
        """True when row r lies at r * row_bytes from row 0 (every bank made with one page_offset)."""
        return bool(self._row_offsets[-1] == (self._num_rows - 1) * self.row_bytes)

    @property
    def row_offsets(self) -> np.ndarray:
        """int64 [num_rows]: each row's byte offset from row 0 (r * row_bytes in a uniform bank); a copy."""
        return self._row_offsets.copy()

    @property
    def alive(self) -> bool:
        """False once the bank has been released."""
        return bool(_ffi.bank_is_live(self._id))

    @property
    def frozen(self) -> bool:
        """True once :meth:`freeze` was called: the bank is read-only from Python."""
        return self._frozen

    def freeze(self) -> None:
        """Make the bank read-only: later ``numpy()`` views are read-only and ``write_row`` raises ValueError.

        Irreversible; calling it again is a no-op. Views taken before the call keep their own writability (numpy
        cannot revoke it), which is why the loader fills the rows first and freezes last. The FFI handlers only
        read banks, so they are unaffected. Raises ValueError if the bank was released.
        """
        self._check_alive("freeze")
        self._frozen = True

    def _check_alive(self, what: str) -> None:
        if not self.alive:
            raise ValueError(f"HostBank.{what}: bank {self._id} {self._describe_shape()} was released")

    def _describe_shape(self) -> str:
        return f"[{', '.join(str(d) for d in self.shape)}] {self._dtype.name}"

    def numpy(self) -> np.ndarray:
        """The rows [num_rows, *row_shape] (bank dtype): of a uniform bank a zero-copy view of its memory, read-only
        once frozen; of a frozen bank that is not uniform, a read-only copy.

        A view keeps the memory alive even if the bank is released afterwards. Raises ValueError if released, or for
        a bank that is neither uniform nor frozen (write its rows through :meth:`rows`).
        """
        self._check_alive("numpy")
        if self.uniform:
            return self.rows(0, self._num_rows)
        if not self._frozen:
            raise ValueError(f"HostBank.numpy: the rows of bank {self._id} {self._describe_shape()} are not at one "
                             "stride; write them through rows() or write_row()")
        out = self.take(range(self._num_rows))
        out.flags.writeable = False
        return out

    def take(self, rows: Sequence[int]) -> np.ndarray:
        """A new array [len(rows), *row_shape] (bank dtype) holding copies of these rows, in this order.

        Raises IndexError for a row outside [0, num_rows), TypeError for rows that are not integers (booleans
        included), ValueError if released."""
        self._check_alive("take")
        rows = [_integer(r, "take") for r in _sequence(rows, "take")]
        bad = [r for r in rows if not 0 <= r < self._num_rows]
        if bad:
            raise IndexError(f"HostBank.take: rows {bad} outside bank {self._id} with {self._num_rows} rows")
        out = np.empty((len(rows), *self._row_shape), self._dtype)
        for i, r in enumerate(rows):
            out[i] = self.rows(r, r + 1)[0]
        return out

    def to_jax(self) -> jax.Array:
        """A jax array [num_rows, *row_shape] (bank dtype) on the default device holding a copy of the rows, copied
        once (stack_on_huge_pages: on the CPU backend into a huge-page buffer that the array then owns).
        Raises ValueError if released."""
        self._check_alive("to_jax")
        return stack_on_huge_pages([[self.rows(r, r + 1)[0]] for r in range(self._num_rows)])

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Zero-copy numpy view [stop - start, *row_shape] (bank dtype) of rows start..stop-1, which must lie at one
        stride (always in a uniform bank; in another, within a run of rows that share their tensors' file layout,
        e.g. one MoE layer's rows of a fused [E, 2I, H] tensor); read-only once frozen. The view keeps the memory
        alive even if the bank is released afterwards.

        Raises:
          IndexError: an empty range or one outside [0, num_rows). ValueError: released, or rows not at one stride.
        """
        self._check_alive("rows")
        start, stop = _integer(start, "rows"), _integer(stop, "rows")
        if start >= stop:
            raise IndexError(f"HostBank.rows: rows {start}:{stop} are an empty range")
        if not 0 <= start < stop <= self._num_rows:
            raise IndexError(f"HostBank.rows: rows {start}:{stop} outside bank {self._id} with {self._num_rows} rows")
        first, rb = int(self._row_offsets[start]), self.row_bytes
        if self._row_offsets[stop - 1] - first != (stop - 1 - start) * rb:
            raise ValueError(f"HostBank.rows: rows {start}:{stop} of bank {self._id} {self._describe_shape()} are not "
                             "at one stride (rows placed at their tensors' file offsets)")
        view = _ffi.bank_buffer(self._id)[first:first + (stop - start) * rb]
        view = view.view(self._dtype).reshape(stop - start, *self._row_shape)
        if self._frozen:
            view.flags.writeable = False
        return view

    def write_row(self, i: int, array) -> None:
        """Copies ``array`` (shape row_shape) into row ``i``; float data is cast to the bank dtype (f32 -> bf16).

        Raises:
          IndexError: i outside [0, num_rows). ValueError: wrong shape, released or frozen (read-only) bank.
          TypeError: a non-float array into a float bank, or a dtype mismatch for an integer/fp8 bank.
        """
        self._check_alive("write_row")
        if self._frozen:
            raise ValueError(f"HostBank.write_row: bank {self._id} {self._describe_shape()} is read-only (frozen "
                             "after loading: compiled decode steps read it)")
        i = _integer(i, "write_row")
        if not 0 <= i < self._num_rows:
            raise IndexError(f"HostBank.write_row: row {i} out of range for bank {self._id} with {self._num_rows} rows")
        src = np.asarray(array)
        if src.shape != self._row_shape:
            raise ValueError(
                f"HostBank.write_row: bank {self._id} rows have shape {self._row_shape}, got array of shape {src.shape}"
            )
        float_bank = self._dtype.kind == "f" or self._dtype.name == "bfloat16"
        float_src = src.dtype.kind == "f" or src.dtype.name == "bfloat16"
        if src.dtype != self._dtype and not (float_bank and float_src and self._dtype.itemsize >= 2):
            raise TypeError(
                f"HostBank.write_row: bank {self._id} is {self._dtype.name}, got a {src.dtype.name} array "
                "(only float data is cast, and only into float32/bfloat16/float16 banks)"
            )
        self.rows(i, i + 1)[0] = src

    def release(self) -> None:
        """Drops the bank from the registry; later FFI calls with its id fail with an error naming it.

        Raises ValueError if the bank was already released.
        """
        if not self._finalizer.alive or not self.alive:
            raise ValueError(f"HostBank.release: bank {self._id} {self._describe_shape()} was already released")
        self._finalizer.detach()
        _ffi.bank_release(self._id)

    def __enter__(self) -> "HostBank":
        return self

    def __exit__(self, *exc) -> None:
        if self.alive:
            self.release()

    def __repr__(self) -> str:
        state = ("" if self.alive else ", released") + (", frozen" if self._frozen else "")
        return f"HostBank(id={self._id}, shape={self.shape}, dtype={self._dtype.name}{state})"


HUGE_PAGE_MIN_BYTES = 4 << 20


JAX_CPU_ALIGNMENT = 64  # the CPU backend uses a numpy buffer in place only at this alignment (else it copies it)


def huge_page_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised, writable numpy array of ``shape`` and ``dtype`` that host_array uses in place on the CPU
    backend: from HUGE_PAGE_MIN_BYTES up in a 2 MiB-aligned anonymous mmap advised MADV_HUGEPAGE (its first write
    commits transparent huge pages), below that 64-byte aligned (JAX_CPU_ALIGNMENT) in numpy's memory."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_MIN_BYTES:
        raw = np.empty(nbytes + JAX_CPU_ALIGNMENT, np.uint8)
        pad = -raw.ctypes.data % JAX_CPU_ALIGNMENT
        return raw[pad:pad + nbytes].view(dtype).reshape(shape)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pad = -_address(region) % _HUGE_PAGE  # to the next 2 MiB boundary
    region.madvise(mmap.MADV_HUGEPAGE, pad, nbytes)
    return np.frombuffer(region, dtype, math.prod(shape), pad).reshape(shape)


def _may_alias(a: np.ndarray) -> bool:
    """Whether :func:`host_array` may use ``a`` in place instead of copying it: the CPU backend, a C-contiguous array
    64-byte aligned (a file view that passes stays the file's pages)."""
    return jax.default_backend() == "cpu" and a.ctypes.data % JAX_CPU_ALIGNMENT == 0 and a.flags.c_contiguous


def host_array(a: np.ndarray) -> jax.Array:
    """A host numpy array (e.g. a read-only file view, SafetensorsCheckpoint.view) as a jax array on the default
    device, copied at most once. On the CPU backend an array jax can use as it is (64-byte aligned) is aliased
    (jax.device_put with may_alias: a file view stays the file's page-cache pages, nothing is copied, and jax keeps
    the view alive); another is copied once onto huge pages (huge_page_buffer), never through a temporary. Other
    backends copy it to the device. For arrays that are never donated or written (parameters)."""
    if _may_alias(a):
        out = jax.device_put(a, may_alias=True)
        if out.unsafe_buffer_pointer() == a.ctypes.data:
            return out
    buf = huge_page_buffer(a.shape, a.dtype)
    buf[...] = a
    return jax.device_put(buf, may_alias=True)


def stacked_buffer(layers: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """Stack per-layer host arrays into one new numpy array, copying the data once.

    Args:
        layers: n lists of parts (numpy arrays of one dtype, e.g. read-only views of a checkpoint file); layer i of
            the result is its parts concatenated along axis 0 (one part: the array itself, e.g. a layer's norm [H];
            several: fused rows such as q/k/v [Q + 2 KV, H]).
    Returns:
        a writable numpy array [n, rows, *trailing] (rows = the parts' leading sizes summed) of the parts' dtype in a
        huge_page_buffer (from HUGE_PAGE_MIN_BYTES up on transparent huge pages, committed by this one write), which
        host_array then uses in place on the CPU backend.
    Raises:
        ValueError: no layers, or parts whose trailing shapes or row counts differ between layers.
    """
    if not layers or not layers[0]:
        raise ValueError("stacked_buffer: no layers (or a layer without parts)")
    first = layers[0]
    out = huge_page_buffer((len(layers), sum(p.shape[0] for p in first), *first[0].shape[1:]),
                            np.result_type(*first))
    shape = out.shape
    for i, parts in enumerate(layers):
        if sum(p.shape[0] for p in parts) != shape[1]:
            raise ValueError(f"stacked_buffer: layer {i} has {sum(p.shape[0] for p in parts)} rows, layer 0 "
                             f"{shape[1]}")
        row = 0
        for p in parts:  # the one copy
            out[i, row:row + p.shape[0]] = p
            row += p.shape[0]
    return out


def stack_on_huge_pages(layers: Sequence[Sequence[np.ndarray]]) -> jax.Array:
    """stacked_buffer(layers) as a jax array [n, rows, *trailing] on the default device: the CPU backend uses the
    buffer itself (jax.device_put with may_alias: no copy, and nothing for use_huge_pages to collapse); other
    backends copy it to the device. Against np.stack + jnp.asarray this saves a temporary and a copy into fresh
    memory, whose page faults are most of the cost of loading dense weights (docs/DESIGN.md section 15.4).
    Raises ValueError as stacked_buffer."""
    return jax.device_put(stacked_buffer(layers), may_alias=True)


_HUGE_PAGE = 2 << 20


def _address(region: mmap.mmap) -> int:
    """Start address of a writable mmap object."""
    return np.frombuffer(region, np.uint8, 1).ctypes.data


def use_huge_pages(tree) -> int:
    """Back the CPU buffers of the jax arrays in ``tree`` (>= 4 MiB each) with transparent huge pages.

    Host banks get huge pages when they are created; XLA's own buffers (the dense weights, the slot pools, a long KV
    cache) are plain 4 KiB pages, which cost the streaming GEMVs a TLB miss every 4 KiB (measurements:
    docs/DESIGN.md sec. 12, "offload/banks.py (use_huge_pages)"). Linux >= 6.1 with transparent huge pages in "madvise" or "always" mode; elsewhere, and
    for arrays on other devices, nothing happens.

    Args:
        tree: a pytree of jax arrays (e.g. the nnx parameter state), on one device or sharded / replicated over
            several (each addressable shard's buffer, once).
    Returns:
        how many buffers were moved onto huge pages.
    """
    moved, seen = 0, set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:  # one per device (a mesh's replicas may share one host buffer)
            data = shard.data
            if data.nbytes < HUGE_PAGE_MIN_BYTES or data.device.platform != "cpu":
                continue
            address = data.unsafe_buffer_pointer()
            if address not in seen:
                seen.add(address)
                moved += bool(_ffi.use_huge_pages(address, data.nbytes))
    return moved
