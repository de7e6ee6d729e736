"""Load a Hugging Face MoE checkpoint: dense weights to the device (or host banks), expert weights into host banks.

``model.safetensors`` or a sharded ``model.safetensors.index.json``; the safetensors rules are enforced as the
reference reader does (no duplicate keys, header <= 100 MB, the tensors tile the data section exactly). Every float
tensor is checked for NaN/Inf as it is read (a bit test on the exponent field). An expert tensor stored as its
bank holds it is not copied: the file's page-cache pages are mapped into the bank (copy-on-write; HostBank
page_offset, SafetensorsCheckpoint.page_offset); other tensors are read with positioned reads straight into their
destination (a bank row or one tensor-sized temporary). On the CPU backend with bf16 and the AVX-512 BF16 dot, the
dense projections, the embedding and the lm_head go into host banks the same way (models.layers.HostWeights, read by
FFI calls; _DenseReader.host_weights, docs/DESIGN.md sec. 20.27). Elsewhere a decoder layer's dense tensors are
read-only file views copied once into their stacks (view), and the embedding and lm_head are used in place as file
views where the CPU backend can (mapped, 64-byte aligned) or else read straight into their own buffers. Peak host
memory is about 1x the checkpoint (docs/DESIGN.md section 15.4). Expert
tensor names per family (Mixtral, Qwen2/3-MoE, OLMoE, fused, gpt-oss incl. MXFP4) and the bank row layout:
docs/DESIGN.md sec. 12 ("checkpoint.py"); the banks are one ExpertBanks (ft_jax.offload.banks): gate_up row =
[gate; up] [2I, H], down row [H, I], flat id = moe_layer * E + e, and for gpt-oss gate_up_bias [2I] (gate bias then
up bias), down_bias [H].

Quantized weights (ft_jax.weight_formats): FP8 block-scaled checkpoints (quantization_config quant_method "fp8":
F8_E4M3 ``<name>.weight`` + ``<name>.weight_scale_inv``) and gpt-oss's MXFP4 experts (``*_blocks`` + E8M0
``*_scales``) are kept as stored, never dequantized in host memory; ``quantize="q8_0" | "q4_0"`` quantizes a float
checkpoint while loading, one tensor (one expert) at a time (docs/DESIGN.md section 15.2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ft_jax import weight_formats as wf
from ft_jax.config import MoEConfig, check_regular_file, file_present, load_config, read_json_file
from ft_jax.config.quantization import expert_format, quantize_applies
from ft_jax.models.decoder import MoETransformer
from ft_jax.models.layers import HostWeights, host_weights_apply
from ft_jax import _ffi
from ft_jax.checked_weights import CheckedWeights, file_version
from ft_jax.kernels.host_bank import JAX_CPU_ALIGNMENT, MAP_ALIGNMENT, HostBank, huge_page_buffer
from ft_jax.offload.banks import ExpertBanks

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# The header size limit of the reference implementation (safetensors' MAX_HEADER_SIZE, 100 MB).
MAX_HEADER_BYTES = 100_000_000

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "U16": np.dtype(np.uint16), "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_FLOAT_NP = tuple(_ST_DTYPES[k] for k in ("F64", "F32", "F16", "BF16"))
_U8 = (np.dtype(np.uint8),)

_F8 = (np.dtype(ml_dtypes.float8_e4m3fn),)
_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))  # fp8 weight_scale_inv as stored
_F8_NAN = 0x7F  # float8_e4m3fn has no Inf; S.1111.111 is NaN (bits & 0x7F == 0x7F)
_E8M0_NAN = 255  # the E8M0 scale that means NaN (OCP Microscaling Formats v1.0)

# Float dtype -> (unsigned int of the same width, exponent field mask). An element is Inf or NaN iff its exponent
# bits are all ones (IEEE 754: binary64 11 bits, binary32 8, binary16 5; bfloat16 = the top half of a binary32, 8
# bits). float8_e4m3fn has no Inf and one NaN magnitude, S.1111.111: its "mask" is those 7 bits, so the same test
# (magnitude bits >= mask) finds exactly its NaNs.
_EXPONENT_MASKS: dict[np.dtype, tuple[type, int]] = {
    np.dtype(np.float64): (np.uint64, 0x7FF0_0000_0000_0000), np.dtype(np.float32): (np.uint32, 0x7F80_0000),
    np.dtype(np.float16): (np.uint16, 0x7C00), np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80),
    _F8[0]: (np.uint8, _F8_NAN),
}
# Bytes per positioned read: small enough that the finite check reads the piece from cache (L2 is 1-2 MiB on
# current x86 cores), large enough that the per-read overhead is negligible.
_READ_CHUNK_BYTES = 1 << 20
_MADV_POPULATE_READ = 22  # Linux >= 5.14 (mmap.MADV_POPULATE_READ from Python 3.12 on)
# Tensors from this size up are mapped into a host bank destination when the offsets allow (smaller ones are copied:
# a mapping costs a kernel call and a VMA, and is limited per process).
_MAP_MIN_BYTES = 1 << 20


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded: missing/unreadable/truncated/corrupted file, a header that breaks the
    safetensors rules, an unsafe shard name, a missing tensor, wrong shape or dtype, or NaN/Inf weights.

    The message is one line naming the file and, where one is involved, the tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file path, numpy dtype, shape, absolute byte offset and byte count."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _no_duplicate_keys(path: str):
    def hook(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise CheckpointError(f"{path}: corrupted safetensors header: duplicate key {key!r} (the format "
                                      "forbids duplicate keys)")
            seen.add(key)
        return dict(pairs)

    return hook


def _header_entry(path: str, name: str, entry: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, each field checked for type and consistency."""

    def bad(what: str):
        return CheckpointError(f"{path}: tensor {name!r}: corrupted header entry {entry!r} ({what})")

    if not isinstance(entry, dict):
        raise bad("not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    if entry["dtype"] not in _ST_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {entry['dtype']!r} (supported: "
                              f"{', '.join(_ST_DTYPES)})")
    dtype = _ST_DTYPES[entry["dtype"]]

    def is_uint(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(is_uint(d) for d in shape):
        raise bad("shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_uint(o) for o in offsets):
        raise bad("data_offsets must be [begin, end], non-negative integers")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end < begin or end - begin != nbytes:
        raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} do not match shape "
                              f"{list(shape)} x {dtype.itemsize} bytes (corrupted header)")
    return dtype, tuple(shape), begin, end


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header (reads only the header).

    Returns:
        {tensor name: TensorInfo} (absolute offsets in bytes); ``__metadata__`` is skipped.
    Raises:
        CheckpointError: the file is missing, unreadable (the cause is named) or not a regular file (a FIFO is
            refused before it is opened, so a load never blocks on it); shorter than its header says (truncated);
            header longer than 100 MB, not UTF-8 JSON or with duplicate keys (corrupted); an unknown dtype; a tensor
            whose byte range is inconsistent with its shape or lies beyond the end of the file (truncated); byte
            ranges that overlap, leave a gap, or leave bytes after the last tensor (the format requires the data
            section to be tiled exactly). Messages name the file and the tensor(s).
    """
    size = check_regular_file(path, "a safetensors checkpoint file", CheckpointError).st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated or corrupted safetensors file: header length {n} but "
                                      f"the file has {size} bytes")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: corrupted safetensors file: header length {n} bytes exceeds the "
                                      f"format's limit of {MAX_HEADER_BYTES} bytes")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the safetensors file: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    data_start, data_size = 8 + n, size - 8 - n
    out, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _header_entry(path, name, entry)
        if end > data_size:
            raise CheckpointError(f"{path}: truncated file: tensor {name!r} needs bytes "
                                  f"{data_start + begin}..{data_start + end} but the file has {size} bytes")
        out[name] = TensorInfo(path, dtype, shape, data_start + begin, end - begin)
        ranges.append((begin, end, name))
    # Tiling (README: "entirely indexed, and cannot contain holes"); zero-byte tensors may sit at any boundary.
    ranges.sort()
    covered, last = 0, None
    for begin, end, name in ranges:
        if begin < covered:
            raise CheckpointError(f"{path}: corrupted safetensors header: tensor {name!r} (data_offsets "
                                  f"{[begin, end]}) overlaps tensor {last[2]!r} (data_offsets {list(last[:2])}); "
                                  "the format forbids tensors sharing bytes")
        if begin > covered:
            raise CheckpointError(f"{path}: corrupted safetensors header: bytes {covered}..{begin} of the data "
                                  f"section (before tensor {name!r}) belong to no tensor; the format forbids holes")
        covered, last = end, (begin, end, name)
    if covered != data_size:
        raise CheckpointError(f"{path}: corrupted safetensors file: {data_size - covered} bytes after the last "
                              f"tensor's data (data section {data_size} bytes, tensors cover {covered}); the format "
                              "forbids bytes that belong to no tensor")
    return out


def _shard_file(index_path: str, tensor: str, shard: Any) -> str:
    """Check one weight_map value: a plain file name inside the model folder (never a path)."""
    if not isinstance(shard, str):
        raise CheckpointError(f"{index_path}: weight_map[{tensor!r}] should be a shard file name (a string), got "
                              f"{shard!r}")
    if (shard in ("", ".", "..") or "/" in shard or "\\" in shard or "\0" in shard or os.path.isabs(shard)
            or os.path.basename(shard) != shard):
        raise CheckpointError(f"{index_path}: weight_map[{tensor!r}] = {shard!r} is not a file name in the model "
                              "folder (absolute paths, '..' and path separators are refused)")
    return shard


class SafetensorsCheckpoint:
    """Tensor directory of a checkpoint folder (single file or sharded) with positioned reads.

    Use as a context manager (or call close()) to release the open file handles. Its reads may come from several
    threads at once (positioned reads on one handle per file). map_pages (default True): read_into
    maps the file's page-cache pages into a host bank where the offsets allow (no copy, fast to load), and the dense
    tensors load_checkpoint uses as stored stay views of the file; False copies every tensor (into a bank's own
    memory, 2 MiB aligned on transparent huge pages: page_offset 0), so nothing of the load keeps the file mapped:
    fresh memory to fault in at load, then fewer TLB misses per byte read, and the file may change while the model
    runs (docs/DESIGN.md sec. 20.22).

    Raises (constructor): CheckpointError when no safetensors file / index exists, the index is invalid, a shard
    is missing, truncated or corrupted, or a tensor listed in the index is absent from its shard.
    """

    def __init__(self, model_dir: str | os.PathLike, map_pages: bool = True, checked: CheckedWeights | None = None):
        model_dir = os.fspath(model_dir)
        self.map_pages = bool(map_pages)
        self.checked = checked  # the NaN/Inf check skips what it covers and records what it checks
        index_path = os.path.join(model_dir, INDEX_FILE)
        single_path = os.path.join(model_dir, SINGLE_FILE)
        self.tensors: dict[str, TensorInfo] = {}
        if file_present(index_path, INDEX_FILE, CheckpointError):
            index = read_json_file(index_path, "a safetensors index", CheckpointError)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: invalid safetensors index (expected an object with a "
                                      f"'weight_map' object, got {type(weight_map).__name__})")
            shards = {name: _shard_file(index_path, name, shard) for name, shard in weight_map.items()}
            self.files = [os.path.join(model_dir, s) for s in sorted(set(shards.values()))]
            self._directory_file = index_path  # the file that lists the tensors
            for path in self.files:
                for name, info in read_safetensors_header(path).items():
                    if name in self.tensors:
                        raise CheckpointError(f"{path}: tensor {name!r} is also in {self.tensors[name].file} "
                                              "(a tensor must be in one shard only)")
                    self.tensors[name] = info
            for name, shard in shards.items():
                info = self.tensors.get(name)
                if info is None or os.path.basename(info.file) != shard:
                    raise CheckpointError(f"{os.path.join(model_dir, shard)}: tensor {name!r} listed in "
                                          f"{INDEX_FILE} is missing from that file")
        elif file_present(single_path, SINGLE_FILE, CheckpointError):
            self.files = [single_path]
            self._directory_file = single_path
            self.tensors = read_safetensors_header(single_path)
        else:
            raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        self._handles: dict[str, Any] = {}
        self._handles_lock = threading.Lock()  # load_checkpoint reads the experts and the dense tensors in 2 threads
        self.used: set[str] = set()  # the tensors info() was asked for: everything read goes through it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close all open file handles."""
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    @property
    def nbytes(self) -> int:
        """Total size of the checkpoint files in bytes."""
        return sum(os.path.getsize(p) for p in self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str, shape: tuple[int, ...] | None = None, dtypes: tuple[np.dtype, ...] = _FLOAT_NP
             ) -> TensorInfo:
        """TensorInfo of ``name``, checking its shape (if given) and that its dtype is one of ``dtypes`` (default:
        a float type).

        Raises CheckpointError naming the tensor and the file(s)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self._directory_file}: missing tensor {name!r}")
        self.used.add(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected "
                                  f"{list(shape)}")
        if info.dtype not in dtypes:
            expected = "a float type" if dtypes == _FLOAT_NP else " or ".join(d.name for d in dtypes)
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, expected {expected}")
        return info

    def read_rows(self, name: str, start: int, stop: int, dtypes: tuple[np.dtype, ...] = _FLOAT_NP) -> np.ndarray:
        """Rows start:stop of tensor ``name`` along its leading axis, as a new array in the stored dtype (one
        positioned read of just those bytes; float rows are checked for NaN/Inf as in :meth:`read_into`).

        Raises CheckpointError as :meth:`read_into` (also for a dtype outside ``dtypes``); ValueError for a row
        range outside the tensor."""
        info = self.info(name, dtypes=dtypes)
        if not 0 <= start < stop <= info.shape[0]:
            raise ValueError(f"read_rows({name!r}): rows {start}:{stop} outside its {info.shape[0]} rows")
        row_bytes = info.nbytes // info.shape[0]
        part = dataclasses.replace(info, shape=(stop - start, *info.shape[1:]), offset=info.offset + start * row_bytes,
                                   nbytes=(stop - start) * row_bytes)
        out = np.empty(part.shape, info.dtype)
        self._pread(name, part, out.reshape(-1).view(np.uint8), rows=(range(start, stop), info))
        return out

    def read_into(self, name: str, out: np.ndarray, shape: tuple[int, ...] | None = None,
                  dtypes: tuple[np.dtype, ...] = _FLOAT_NP, rows: range | None = None) -> None:
        """Read tensor ``name`` (or with ``rows``, its rows rows.start:rows.stop along the leading axis) into the
        C-contiguous array ``out`` (same number of elements), casting to out.dtype if the stored dtype differs (via
        one temporary of the part's size). ``shape``: expected stored shape of the whole tensor (default out.shape,
        or out.shape with the tensor's leading size when ``rows`` is given); ``dtypes``: the stored dtypes allowed
        (default: a float type).

        Raises CheckpointError: missing tensor, wrong shape or dtype, truncated file, or a NaN/Inf element (the
        stored values are checked before any cast; FP8 e4m3fn: a NaN). ValueError: ``out`` not C-contiguous or of
        the wrong size, rows outside the tensor or with a step."""
        if rows is not None:
            whole = self.info(name, shape, dtypes)
            if rows.step != 1 or not 0 <= rows.start < rows.stop <= whole.shape[0]:
                raise ValueError(f"read_into({name!r}): rows {rows.start}:{rows.stop} outside its {whole.shape[0]} "
                                 f"rows")
            row_bytes = whole.nbytes // whole.shape[0]
            info = dataclasses.replace(whole, shape=(len(rows), *whole.shape[1:]),
                                       offset=whole.offset + rows.start * row_bytes, nbytes=len(rows) * row_bytes)
            if not out.flags.c_contiguous or out.size != math.prod(info.shape):
                raise ValueError(f"read_into({name!r}): destination must be C-contiguous with {math.prod(info.shape)} "
                                 f"elements, got shape {out.shape}")
            self._read_part(name, info, out, rows=(rows, whole))
            return
        info = self.info(name, out.shape if shape is None else shape, dtypes)
        if not out.flags.c_contiguous or out.size != math.prod(info.shape):
            raise ValueError(f"read_into({name!r}): destination must be C-contiguous with {math.prod(info.shape)} "
                             f"elements, got shape {out.shape}")
        self._read_part(name, info, out)

    def _read_part(self, name: str, info: TensorInfo, out: np.ndarray,
                   rows: tuple[range, TensorInfo] | None = None) -> None:
        """The bytes of ``info`` (tensor ``name`` or, with ``rows`` = (row range, the whole tensor's info), a row range
        of it) into ``out``, cast through a temporary when the dtypes differ."""
        if info.dtype == out.dtype:
            self._pread(name, info, out.reshape(-1).view(np.uint8), rows)
        else:
            tmp = np.empty(info.shape, info.dtype)
            self._pread(name, info, tmp.reshape(-1).view(np.uint8), rows)
            out.reshape(info.shape)[...] = tmp.astype(out.dtype)
            _check_cast(name, info, tmp, out, rows)

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor ``name`` as a new numpy array in its stored dtype (shape checked if given).

        Raises CheckpointError as :meth:`read_into`."""
        info = self.info(name, shape)
        out = np.empty(info.shape, info.dtype)
        self._pread(name, info, out.reshape(-1).view(np.uint8))
        return out

    def page_offsets(self, regions: Iterable[tuple[int, str, int, int, int]], num_rows: int, row_bytes: int,
                     dtype, per_row: bool = True) -> list[int]:
        """The page offsets for a HostBank of ``num_rows`` rows of ``row_bytes`` and dtype ``dtype`` that read_into
        fills with these tensors, so that it maps the most of them from the file (no copy), on 2 MiB page table
        entries where the page cache holds 2 MiB folios.

        Args:
            regions: (bank row, tensor name, byte offset in the tensor, byte offset in the row, bytes): the tensor's
                bytes from that offset go to that place of the row (a fused [E, 2I, H] tensor gives one per row).
            per_row: an offset for every row (the rows of one MoE layer follow each other as its tensors do in the
                file; layers start where their tensors' offsets say), else one for the bank (rows at one stride).
        Returns:
            [num_rows] (or [1]) offsets in [0, MAP_ALIGNMENT) (2 MiB), multiples of 8: a tensor maps when its file
            offset minus its bank offset is congruent with the row's modulo the page size (4096 bytes), so the
            page-size residue shared by the most bytes is chosen and, among those, the 2 MiB residue shared by the
            most. Only tensors read_into maps count (stored in ``dtype``, not cast; from 1 MiB, at offsets that are
            multiples of 8, and only when map_pages); a row without one follows the previous row (no gap), the first
            one at 0.
        Raises:
            CheckpointError: a missing tensor.
        """
        dtype = np.dtype(dtype)
        by_row = [{} for _ in range(num_rows if per_row else 1)]  # residue modulo 2 MiB of the row start -> bytes
        for row, name, skip, within, nbytes in regions:
            info = self.tensors.get(name)
            if info is None:
                raise CheckpointError(f"{self._directory_file}: missing tensor {name!r}")
            if self.map_pages and info.dtype == dtype and info.offset % 8 == 0 and info.nbytes >= _MAP_MIN_BYTES:
                residue = (info.offset + skip - within - (0 if per_row else row * row_bytes)) % MAP_ALIGNMENT
                votes = by_row[row if per_row else 0]
                votes[residue] = votes.get(residue, 0) + nbytes
        out: list[int] = []
        for votes in by_row:
            if not votes:
                out.append((out[-1] + row_bytes) % MAP_ALIGNMENT if out else 0)
                continue
            by_page: dict[int, int] = {}
            for residue, n in votes.items():
                by_page[residue % mmap.PAGESIZE] = by_page.get(residue % mmap.PAGESIZE, 0) + n
            page = max(by_page, key=by_page.get)
            out.append(max((r for r in votes if r % mmap.PAGESIZE == page), key=votes.get))
        return out

    def view(self, name: str, shape: tuple[int, ...] | None = None,
             dtypes: tuple[np.dtype, ...] = _FLOAT_NP) -> np.ndarray:
        """Tensor ``name`` as a read-only numpy array in its stored dtype (one of ``dtypes``, default a float type)
        that maps the file's pages (no copy; the mapping goes away with the array), checked for NaN/Inf as
        :meth:`read_into` does, in the one pass that brings the pages in. For data that is copied (stacked, cast,
        moved to a device) right after: the copy is then the only one.

        Raises CheckpointError as :meth:`read_into`."""
        info = self.info(name, shape, dtypes)
        fh = self._file(info.file)
        self._check_size(fh, name, info)
        if info.nbytes == 0:
            return np.empty(info.shape, info.dtype)
        first = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        try:
            region = mmap.mmap(fh.fileno(), info.offset + info.nbytes - first, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ, offset=first)
        except OSError as e:
            raise CheckpointError(f"{info.file}: cannot map tensor {name!r}: {e.strerror or e}") from None
        try:  # the page tables in one call, not a fault per 4 KiB page as the check reads it
            region.madvise(_MADV_POPULATE_READ)
        except OSError:  # Linux < 5.14: faulted in by the reads
            pass
        out = np.frombuffer(region, info.dtype, math.prod(info.shape), info.offset - first).reshape(info.shape)
        data = out.reshape(-1).view(np.uint8)
        if self._known_finite(info):
            return out
        if _check_finite(info, data, 0, info.nbytes)[1]:  # the one pass over the mapped pages, on every core
            _raise_non_finite(name, info, data)
        self._record_finite(info)
        return out

    def _file(self, path: str):
        with self._handles_lock:
            fh = self._handles.get(path)
            if fh is None:
                fh = self._handles[path] = open(path, "rb", buffering=0)
                if self.checked is not None:
                    self.checked.opened(path, file_version(os.fstat(fh.fileno())))
            return fh

    @staticmethod
    def _check_size(fh, name: str, info: TensorInfo) -> None:
        """The file still holds the tensor (it may have shrunk since its header was read: a mapped page past the end
        of a file faults with SIGBUS instead of an error)."""
        size = os.fstat(fh.fileno()).st_size
        if size < info.offset + info.nbytes:
            raise CheckpointError(f"{info.file}: truncated file while reading tensor {name!r}: it needs bytes "
                                  f"{info.offset}..{info.offset + info.nbytes} but the file has {size} bytes")

    def _pread(self, name: str, info: TensorInfo, dest: np.ndarray,
               rows: tuple[range, TensorInfo] | None = None) -> None:
        """Fill ``dest`` (u8[info.nbytes]) with the bytes of ``info`` (tensor ``name``, or with ``rows`` = (row
        range, the whole tensor's info) those rows of it), checking float tensors for NaN/Inf in the same pass, piece
        by piece (_READ_CHUNK_BYTES) while each piece is in cache; the error names the stored tensor, its shape and
        the index in it.

        A destination inside a host bank at an address congruent with the file offset modulo the page size (a
        HostBank made with SafetensorsCheckpoint.page_offset) gets the file's whole pages mapped there
        (_ffi.bank_map_file: copy-on-write, the page cache's own pages, no copy); the partial pages at both ends and
        any other destination are read with positioned reads. The mapped part is checked in one call on every core
        (its one pass: nothing else reads it while loading), the read pieces each while in cache."""
        if not dest.flags.writeable:  # e.g. a view of a frozen bank
            raise TypeError(f"cannot read tensor {name!r} into a read-only array (the destination must be read-write)")
        fh = self._file(info.file)
        self._check_size(fh, name, info)
        begin = end = 0  # the mapped part of dest
        if self.map_pages and info.nbytes >= _MAP_MIN_BYTES:
            begin, end = _ffi.bank_map_file(dest.ctypes.data, info.nbytes, fh.fileno(), info.offset)
        known = self._known_finite(info)
        checked, found = info.nbytes if known else 0, False
        for lo, hi, mapped in ((0, begin, False), (begin, end, True), (end, info.nbytes, False)):
            step = max(hi - lo, 1) if mapped else _READ_CHUNK_BYTES
            for piece in range(lo, hi, step):
                stop = min(hi, piece + step)
                if not mapped:
                    self._read_exactly(fh, name, info, dest, piece, stop)
                if not found and checked < stop:
                    checked, found = _check_finite(info, dest, checked, stop)
        if found:  # described once the whole tensor is in dest
            _raise_non_finite(name, info, dest, rows)
        if not known:
            self._record_finite(info)

    def _known_finite(self, info: TensorInfo) -> bool:
        """Whether the bytes of ``info`` (a tensor or rows of it) were checked for NaN/Inf by an earlier load of this
        file version (self.checked)."""
        return self.checked is not None and self.checked.covers(info.file, info.offset, info.offset + info.nbytes)

    def _record_finite(self, info: TensorInfo) -> None:
        """Record the bytes of ``info`` as checked: no NaN/Inf (self.checked)."""
        if self.checked is not None:
            self.checked.add(info.file, info.offset, info.offset + info.nbytes)

    @staticmethod
    def _read_exactly(fh, name: str, info: TensorInfo, dest: np.ndarray, start: int, stop: int) -> None:
        """dest[start:stop] = the tensor's bytes start:stop (reads until complete; a read may return less). Positioned
        reads (pread): the file position is never used, so the two threads of load_checkpoint share the handle."""
        view = memoryview(dest)
        while start < stop:
            got = os.preadv(fh.fileno(), [view[start:stop]], info.offset + start)
            if not got:
                raise CheckpointError(f"{info.file}: truncated file while reading tensor {name!r} at byte "
                                      f"{info.offset + start} (expected {info.nbytes} bytes)")
            start += got


def _check_finite(info: TensorInfo, data: np.ndarray, checked: int, stop: int) -> tuple[int, bool]:
    """Check the complete elements of ``data`` (u8[info.nbytes], the tensor's bytes) from byte ``checked`` up to
    byte ``stop`` for NaN/Inf when the tensor is a float one. Returns (the byte up to which it is checked: elements
    split by ``stop`` are checked with the next piece, whether a non-finite element was found)."""
    masks = _EXPONENT_MASKS.get(info.dtype)  # (unsigned int type, exponent mask) of a float dtype
    if masks is None:
        return stop, False
    whole = stop - stop % info.dtype.itemsize  # bytes of complete elements
    if whole <= checked:
        return checked, False
    return whole, _has_non_finite(data[checked:whole].view(masks[0]), masks[1])


def _raise_non_finite(name: str, info: TensorInfo, data: np.ndarray,
                      rows: tuple[range, TensorInfo] | None = None) -> None:
    """Raise the error for a tensor (or with ``rows``, a row range of it) with Inf/NaN elements; data: all the bytes
    read u8[info.nbytes]."""
    masks = _EXPONENT_MASKS[info.dtype]
    raise _non_finite_error(name, info, data.view(masks[0]), masks[1], rows)


def _has_non_finite(bits: np.ndarray, mask: int) -> bool:
    """Whether any element of ``bits`` (raw element bits [n], a contiguous unsigned view) has magnitude bits (the
    sign cleared) >= ``mask``, the exponent field: an Inf or NaN. One read of the bytes, split over the kernels'
    threads (CPU affinity, FT_JAX_NUM_THREADS) from 8 MiB per thread up (_ffi.first_non_finite,
    xla_ffi/finite_check.h)."""
    return _ffi.first_non_finite(bits.ctypes.data, bits.size, bits.itemsize, mask) >= 0


def _non_finite_error(name: str, info: TensorInfo, bits: np.ndarray, mask: int,
                      rows: tuple[range, TensorInfo] | None = None) -> CheckpointError:
    """The error for a tensor with Inf/NaN elements; bits: the raw element bits [size] read (an unsigned int view)
    of the whole tensor, or with ``rows`` = (row range, the whole tensor's info) of those rows: the message gives
    the stored tensor's shape and the index in it, and counts the elements of the rows read."""
    bad = np.flatnonzero((bits & mask) == mask)  # flat indices of the Inf/NaN elements
    shape, first_element, where = info.shape, 0, ""
    if rows is not None:
        shape = rows[1].shape
        first_element = rows[0].start * math.prod(shape[1:])
        if len(rows[0]) < shape[0]:  # a part: the count is of the rows read
            where = f" of rows {rows[0].start}:{rows[0].stop}"
    first = [int(i) for i in np.unravel_index(first_element + int(bad[0]), shape)]
    if info.dtype == _F8[0]:  # S.1111.111, its only non-finite value
        return CheckpointError(f"{info.file}: tensor {name!r} {list(shape)} holds NaN: {bad.size} of {bits.size} "
                               f"FP8 elements{where} are NaN, the first at index {first} (a corrupted checkpoint)")
    magnitude = bits[bad] & (mask | (mask - 1))  # sign cleared: == mask is Inf, > mask is NaN
    negative = bits[bad] != magnitude  # the sign bit set
    kinds = ", ".join(k for k, present in (("NaN", (magnitude > mask).any()),
                                           ("+Inf", ((magnitude == mask) & ~negative).any()),
                                           ("-Inf", ((magnitude == mask) & negative).any())) if present)
    return CheckpointError(f"{info.file}: tensor {name!r} {list(shape)} holds {kinds}: {bad.size} of {bits.size} "
                           f"elements{where} are not finite, the first at index {first} (a corrupted or unconverted "
                           "checkpoint; NaN/Inf weights make every logit NaN)")


def _check_cast(name: str, info: TensorInfo, stored: np.ndarray, cast: np.ndarray,
                rows: tuple[range, TensorInfo] | None = None) -> None:
    """Raise CheckpointError where the finite values ``stored`` (tensor ``name``, or with ``rows`` those rows of it)
    became infinite in ``cast`` (the same elements in a narrower float dtype: a float32 value beyond bfloat16's or
    float16's largest), naming the tensor, the count and the first index in the stored tensor."""
    masks = _EXPONENT_MASKS.get(cast.dtype)
    if masks is None:
        return
    bits = cast.reshape(-1).view(masks[0])
    if not _has_non_finite(bits, masks[1]):
        return
    bad = np.flatnonzero((bits & masks[1]) == masks[1])
    shape, first_element = info.shape, 0
    if rows is not None:
        shape, first_element = rows[1].shape, rows[0].start * math.prod(rows[1].shape[1:])
    first = [int(i) for i in np.unravel_index(first_element + int(bad[0]), shape)]
    value = stored.reshape(-1)[bad[0]]
    raise CheckpointError(f"{info.file}: tensor {name!r} {list(shape)} holds {bad.size} {info.dtype} values beyond "
                          f"the range of {cast.dtype}, the first {value:.6g} at index {first}: they would become "
                          f"infinite in the model (load it in a wider dtype, e.g. float32)")


@dataclasses.dataclass
class LoadedCheckpoint:
    """Result of :func:`load_checkpoint`.

    config: MoEConfig; model: MoETransformer (dense parameters on the device; the 2-D projections as
    weight_formats.QuantizedTensor when quantized or kept in FP8); banks: ExpertBanks in the experts' weight format
    (banks.format): gate_up [L_moe*E, *fmt.data_shape(2I, H)], down [L_moe*E, *fmt.data_shape(H, I)], for a block
    format the scale banks gate_up_scale / down_scale (ft_jax.weight_formats.expert_rows), and for families whose
    experts have biases (MoEConfig.expert_bias: gpt-oss) gate_up_bias [L_moe*E, 2I] (gate bias then up bias) and
    down_bias [L_moe*E, H] in the float expert dtype; checkpoint_bytes: total size of the safetensors files;
    unused_tensors: the names of the checkpoint's tensors the model does not read, sorted (config.json decides which
    are read: e.g. the layers past num_hidden_layers, DeepSeek-V3's multi-token-prediction layer, an lm_head.weight
    beside tie_word_embeddings; with a part of the experts in this process's banks, the others count as read).
    """

    config: MoEConfig
    model: MoETransformer
    banks: ExpertBanks
    checkpoint_bytes: int
    unused_tensors: tuple[str, ...] = ()


def check_experts(cfg: MoEConfig, experts: range | None) -> range:
    """The experts a process's banks hold: ``experts`` checked (a non-empty range of step 1 in [0, E)), or all E.
    Raises ValueError naming the range."""
    E = cfg.num_experts
    if experts is None:
        return range(E)
    if not isinstance(experts, range) or experts.step != 1 or not 0 <= experts.start < experts.stop <= E:
        raise ValueError(f"experts must be a non-empty range of step 1 within the {E} experts per MoE layer, got "
                         f"{experts!r}")
    return experts


def _np_dtype(dtype) -> np.dtype:
    d = np.dtype(jnp.dtype(dtype))
    if d not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16, got {d}")
    return d


def _fits(fmt: wf.WeightFormat, info: TensorInfo, name: str, cols: int) -> None:
    """CheckpointError naming the file and tensor when rows of ``cols`` elements do not fit fmt's blocks."""
    try:
        fmt.check_cols(cols, f"{info.file}: tensor {name!r}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def check_quantize_fits(tensors: dict, fmt: wf.WeightFormat) -> None:
    """Before anything is loaded: CheckpointError naming the file and the first float tensor that quantizing to fmt
    (--quantize q8_0 / q4_0) would store in blocks (an expert matrix, or a dense 2-D projection quantize_applies
    names) whose rows do not fit the blocks. tensors: {name: TensorInfo} (SafetensorsCheckpoint.tensors)."""
    for name, info in tensors.items():
        float_2d = len(info.shape) >= 2 and np.dtype(info.dtype).itemsize > 1
        if float_2d and (".experts." in name or quantize_applies(name, info.shape)):
            _fits(fmt, info, name, info.shape[-1])


def _gpt_oss_plan(cfg: MoEConfig, ckpt: SafetensorsCheckpoint, fmt: wf.WeightFormat, Ep: int
                  ) -> list[tuple[str, int, str, tuple]]:
    """expert_tensor_plan for gpt-oss: plain (float) or, when fmt is MXFP4, MXFP4 expert weights, plus the two bias
    tensors; Ep experts per layer in the banks."""
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    plan = []
    for m, layer in enumerate(cfg.moe_layers):
        p = f"model.layers.{layer}.mlp.experts"
        for proj, rows, cols, interleaved in (("gate_up_proj", 2 * I, H, True), ("down_proj", H, I, False)):
            bank, name, blocks, scales = ("gate_up" if interleaved else "down"), f"{p}.{proj}", f"{p}.{proj}_blocks", \
                f"{p}.{proj}_scales"
            if fmt is wf.MXFP4 and blocks in ckpt:
                _fits(fmt, ckpt.info(blocks, dtypes=_U8), blocks, cols)
                ckpt.info(blocks, (E, rows, cols // wf.QBLOCK, wf.QBLOCK // 2), _U8)
                ckpt.info(scales, (E, rows, cols // wf.QBLOCK), _U8)
                plan.append((bank, m * Ep, blocks, ("mxfp4", scales, interleaved)))
            elif fmt is not wf.MXFP4 and name in ckpt:  # as GptOssExperts holds them: [E, in, out]
                _fits(fmt, ckpt.info(name, (E, cols, rows)), name, cols)
                plan.append((bank, m * Ep, name, ("transposed", interleaved)))
            elif fmt is wf.MXFP4:
                raise CheckpointError(f"{ckpt._directory_file}: missing tensor {blocks!r} + {scales!r} (the MXFP4 "
                                      f"form of {name!r} that quantization_config quant_method 'mxfp4' announces)")
            else:
                raise CheckpointError(f"{ckpt._directory_file}: missing tensor {name!r} (a checkpoint whose experts "
                                      f"are MXFP4, {blocks!r} + {scales!r}, needs quantization_config quant_method "
                                      "'mxfp4' in config.json)")
        ckpt.info(f"{p}.gate_up_proj_bias", (E, 2 * I))
        ckpt.info(f"{p}.down_proj_bias", (E, H))
        plan += [("gate_up_bias", m * Ep, f"{p}.gate_up_proj_bias", ("interleaved_rows",)),
                 ("down_bias", m * Ep, f"{p}.down_proj_bias", ("fused",))]
    return plan


def _deinterleave(rows: np.ndarray) -> np.ndarray:
    """[2I, ...] rows in gpt-oss order (gate, up, gate, up, ...) -> [gate rows; up rows] (the bank row layout)."""
    return np.concatenate([rows[0::2], rows[1::2]])


def expert_tensor_plan(cfg: MoEConfig, ckpt: SafetensorsCheckpoint, fmt: wf.WeightFormat | None = None,
                       experts: range | None = None) -> list[tuple[str, int, str, tuple]]:
    """Which tensors fill which bank rows, validated against the headers (names, shapes, dtypes, the fit of each row
    length to fmt's blocks) before any reading.

    Args:
        cfg: the MoEConfig. ckpt: the checkpoint's headers. fmt: the banks' weight format (config.quantization.expert_format;
            default the float format: float tensors as stored).
        experts: the experts of every MoE layer the banks hold (check_experts; default all E): bank row
            moe_layer * len(experts) + j holds expert experts[j].
    Returns a list of (bank "gate_up" | "down" | "gate_up_bias" | "down_bias", first flat row, tensor name, part)
    where part is ("fused",) for an [E, ...] tensor covering rows first..first+E-1, ("rows", a, b) for one expert
    tensor going to rows a:b of the row's leading axis, ("fp8_rows", a, b, scale tensor name, first scale row) for
    one FP8 expert tensor and its weight_scale_inv, or for gpt-oss ("transposed", interleaved), ("mxfp4", scales
    tensor name, interleaved) and ("interleaved_rows",) (see _read_gpt_oss_experts). The entries of an [E, ...]
    tensor cover the bank rows first..first+len(experts)-1 with its rows experts.start..experts.stop-1.
    Raises CheckpointError (missing tensor / wrong shape or dtype / a row length that does not fit fmt's blocks,
    naming file and tensor).
    """
    fmt = wf.F32 if fmt is None else fmt
    experts = check_experts(cfg, experts)
    Ep = len(experts)
    if cfg.family == "gpt_oss":
        return _gpt_oss_plan(cfg, ckpt, fmt, Ep)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fp8 = fmt.name == "fp8"
    plan = []
    for m, layer in enumerate(cfg.moe_layers):
        p = f"model.layers.{layer}"
        fused_gu, fused_dn = f"{p}.mlp.experts.gate_up_proj", f"{p}.mlp.experts.down_proj"
        if fused_gu in ckpt and not fp8:
            _fits(fmt, ckpt.info(fused_gu, (E, 2 * I, H)), fused_gu, H)
            _fits(fmt, ckpt.info(fused_dn, (E, H, I)), fused_dn, I)
            plan += [("gate_up", m * Ep, fused_gu, ("fused",)), ("down", m * Ep, fused_dn, ("fused",))]
            continue
        for e in experts:
            if cfg.family == "mixtral":
                base = f"{p}.block_sparse_moe.experts.{e}"
                gate, up, down = f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
            else:
                base = f"{p}.mlp.experts.{e}"
                gate, up, down = (f"{base}.{n}_proj.weight" for n in ("gate", "up", "down"))
            row = m * Ep + e - experts.start
            parts = (("gate_up", gate, (I, H), 0), ("gate_up", up, (I, H), I), ("down", down, (H, I), 0))
            for bank, name, shape, first in parts:
                if fp8:
                    ckpt.info(name, shape, _F8)
                    scale_shape = fmt.scale_shape(*shape)
                    ckpt.info(f"{name}_scale_inv", scale_shape, _SCALE_DTYPES)
                    plan.append((bank, row, name, ("fp8_rows", first, first + shape[0], f"{name}_scale_inv",
                                                   fmt.scale_rows(first))))
                else:
                    _fits(fmt, ckpt.info(name, shape), name, shape[1])
                    plan.append((bank, row, name, ("rows", first, first + shape[0])))
    return plan


def _read_stored(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...], dtypes: tuple[np.dtype, ...]
                 ) -> np.ndarray:
    """The whole tensor ``name`` as stored (shape and dtype checked; float ones NaN/Inf-checked while read)."""
    ckpt.info(name, shape, dtypes)
    return ckpt.read_rows(name, 0, shape[0], dtypes)


def _read_fp8_scales(ckpt: SafetensorsCheckpoint, scale_name: str, shape: tuple[int, int],
                     fmt: wf.WeightFormat) -> np.ndarray:
    """The scales f32 [ceil(rows / br), ceil(cols / bc)] of an FP8 matrix [rows, cols]: its weight_scale_inv as
    stored (a bf16 scale_inv widened to f32, exactly). Raises CheckpointError: wrong shape or dtype, a non-finite
    scale."""
    return _read_stored(ckpt, scale_name, fmt.scale_shape(*shape), _SCALE_DTYPES).astype(np.float32)


def _read_fp8(ckpt: SafetensorsCheckpoint, name: str, scale_name: str, shape: tuple[int, int],
              fmt: wf.WeightFormat) -> tuple[np.ndarray, np.ndarray]:
    """(data f8e4m3fn [rows, cols]: a read-only view of the file (SafetensorsCheckpoint.view), scales f32) of one FP8
    matrix and its weight_scale_inv (_read_fp8_scales). Raises CheckpointError: wrong shape or dtype, NaN data, a
    non-finite scale, a block that dequantizes to Inf (_check_fp8_overflow)."""
    data = ckpt.view(name, shape, _F8)  # NaN-checked while mapped
    scales = _read_fp8_scales(ckpt, scale_name, shape, fmt)
    _check_fp8_overflow(ckpt, scale_name, data, scales, fmt)
    return data, scales


# Above this |scale| an FP8 e4m3 block can dequantize to Inf: 448 (the largest code) * scale > the float32 maximum.
_FP8_SCALE_CAN_OVERFLOW = float(np.finfo(np.float32).max) / 448.0


def _check_fp8_overflow(ckpt: SafetensorsCheckpoint, scale_name: str, data: np.ndarray, scales: np.ndarray,
                        fmt: wf.WeightFormat) -> None:
    """CheckpointError naming the file, the scale tensor and the block when a block's largest code times its scale
    overflows float32 (the weight the kernels compute with would be Inf). data f8e4m3fn [rows, cols], scales f32
    [ceil(rows / br), ceil(cols / bc)] of one matrix; only blocks whose |scale| exceeds float32 max / 448 are read
    again, so a sound checkpoint costs a comparison over its scales."""
    br, bc = fmt.block
    for i, j in np.argwhere(np.abs(scales) > _FP8_SCALE_CAN_OVERFLOW):
        block = data[i * br:(i + 1) * br, j * bc:(j + 1) * bc].astype(np.float32)
        with np.errstate(over="ignore"):
            if np.isinf(np.abs(block).max() * np.float32(scales[i, j])):
                raise CheckpointError(
                    f"{ckpt.tensors[scale_name].file}: tensor {scale_name!r} block [{i}, {j}] (rows "
                    f"{i * br}..{min(data.shape[0], (i + 1) * br) - 1}, columns {j * bc}.."
                    f"{min(data.shape[1], (j + 1) * bc) - 1}) holds the scale {float(scales[i, j]):.6g}, and the "
                    "block's largest weight times it overflows float32: a corrupted FP8 checkpoint")


def _block_in_rows(row: int, block: int) -> str:
    """Where block ``block`` of row ``row`` of a matrix stored as its rows lies: the row and its 32 columns."""
    return f"row {row}, block {block} (columns {32 * block}..{32 * block + 31})"


def _check_mxfp4_scales(ckpt: SafetensorsCheckpoint, blocks_name: str, scales_name: str, expert: int,
                        blocks: np.ndarray, scales: np.ndarray) -> None:
    """CheckpointError naming the file, tensor, row and block for an E8M0 scale of 255 (NaN) or a value that overflows
    float32: code * 2^(s - 127) >= 2^128 (the float32 maximum is just below it), i.e. a scale s of 254 with a code of
    magnitude >= 2, or 253 with one >= 4 (FP4 E2M1 magnitudes reach 6; OCP Microscaling Formats v1.0). blocks u8
    [rows, G, 16] and scales u8 [rows, G] of one expert."""
    def where(mask: np.ndarray) -> str:  # the first True of bool[rows, G]
        return _block_in_rows(*(int(i) for i in np.argwhere(mask)[0]))

    nan = scales == _E8M0_NAN  # bool[rows, G]
    if nan.any():
        raise CheckpointError(f"{ckpt.info(scales_name, dtypes=_U8).file}: tensor {scales_name!r} expert {expert} "
                              f"holds the E8M0 scale 255 (NaN) at {where(nan)}: a corrupted MXFP4 checkpoint")
    top = scales >= 253  # bool[rows, G]: the scales at which a code can overflow float32
    if top.any():
        limit = np.ldexp(1.0, 255 - scales[top].astype(np.int32))[:, None]  # f64[n, 1]: 2 (scale 254), 4 (253)
        big = np.zeros_like(top)  # bool[rows, G]: a block with a code of magnitude >= its limit
        big[top] = (np.abs(wf.FP4_E2M1[blocks[top] & 0x0F]) >= limit).any(-1) | (
            np.abs(wf.FP4_E2M1[blocks[top] >> 4]) >= limit).any(-1)
        if big.any():
            raise CheckpointError(f"{ckpt.info(blocks_name, dtypes=_U8).file}: tensor {blocks_name!r} expert {expert} "
                                  f"dequantizes to Inf at {where(big)} (an E8M0 scale too large for float32): a "
                                  "corrupted MXFP4 checkpoint")


# Rows quantized per weight_formats.quantize call: bounds its float32 temporaries (a few copies of the piece) to a few
# times 16 MiB whatever the tensor (an lm_head of 150k x 4096 values would otherwise take ~7 GB of temporaries).
_QUANTIZE_PIECE_VALUES = 4 << 20


def _quantize_into(w: np.ndarray, fmt: wf.WeightFormat, data: np.ndarray, scales: np.ndarray, what: str,
                   where: Callable[[int, int], str] = _block_in_rows) -> None:
    """weight_formats.quantize of w [rows, cols] (float, any dtype; finite: checked as read) written into data /
    scales ([rows, ...]), a piece of rows at a time (q8_0 / q4_0: every row is quantized on its own, so pieces give
    the same bytes). Raises CheckpointError naming ``what`` (the tensor) and ``where(row, block)`` (the block's place
    in the stored tensor) when a block's scale overflows float16 (|x| max / 127 for q8_0, / 8 for q4_0, above
    65504): it would decode to Inf / NaN."""
    step = max(1, _QUANTIZE_PIECE_VALUES // max(1, w.shape[1]))
    for r in range(0, w.shape[0], step):
        data[r:r + step], scales[r:r + step] = wf.quantize(w[r:r + step], fmt)
        bad = (scales[r:r + step].view(np.uint16) & 0x7C00) == 0x7C00  # f16 exponent all ones: Inf / NaN
        if bad.any():
            row, block = (int(i) for i in np.argwhere(bad)[0])
            raise CheckpointError(f"{what}: {where(r + row, block)} has values too large for {fmt.name} (its "
                                  "float16 block scale overflows 65504); load it without quantize= (--quantize)")


class _BankWriter:
    """Writes matrices into the bank rows of one weight format: float ones cast to the bank dtype, or quantized with
    weight_formats.quantize (q8_0 / q4_0: one scale row per matrix row; Q4_0_X16: quantized as q4_0, then each
    written piece interleaved in place, its rows whole groups of 16)."""

    def __init__(self, banks: dict[str, HostBank], fmt: wf.WeightFormat):
        self.banks, self.fmt = banks, fmt
        self.quantize_fmt = wf.row_layout(fmt)

    def rows(self, bank: str, row: int, n: int) -> np.ndarray:
        """Writable view [n, *row_shape] of rows row..row+n-1 of ``bank`` (rows the loader fills from one tensor:
        at one stride, HostBank.rows)."""
        return self.banks[bank].rows(row, row + n)

    def row(self, bank: str, row: int) -> np.ndarray:
        """Writable view [*row_shape] of one row of ``bank``."""
        return self.banks[bank].rows(row, row + 1)[0]

    def put(self, bank: str, row: int, first: int, w: np.ndarray, what: str,
            where: Callable[[int, int], str] = _block_in_rows) -> None:
        """w float [n, cols] -> rows first..first+n-1 of bank row ``row`` (and its scale rows); ``what`` names the
        tensor in errors, ``where(row of w, block)`` a block's place in it (_quantize_into)."""
        dst = self.row(bank, row)
        if not self.fmt.quantized:
            dst[first:first + w.shape[0]] = w.astype(dst.dtype, copy=False)
            return
        n = w.shape[0]
        data, scales = dst[first:first + n], self.row(f"{bank}_scale", row)[first:first + n]
        _quantize_into(w, self.quantize_fmt, data, scales, what, where)
        if self.fmt.interleave > 1:  # allocate_expert_banks picks it only where every piece is whole groups
            wf.interleave_rows(data, scales)


def _read_gpt_oss_experts(ckpt: SafetensorsCheckpoint, bank: str, row: int, name: str, part: tuple,
                          out: _BankWriter, experts: range) -> None:
    """Fill the bank rows row..row+len(experts)-1 of one layer from the experts' rows of a gpt-oss expert tensor,
    one expert at a time. part:
    ("transposed", interleaved) (float [E, in, out]; the temporary is one expert's weights) | ("mxfp4", scales name,
    interleaved) (blocks and scales copied as stored, rows de-interleaved; never dequantized) |
    ("interleaved_rows",) (the gate_up bias)."""
    if part[0] == "interleaved_rows":
        dst = out.rows(bank, row, len(experts))
        rows = ckpt.read_rows(name, experts.start, experts.stop)  # [Ep, 2I]
        dst[...] = np.stack([_deinterleave(b) for b in rows]).astype(dst.dtype)
        return
    for j, e in enumerate(experts):
        if part[0] == "mxfp4":
            blocks, scales = ckpt.read_rows(name, e, e + 1, _U8)[0], ckpt.read_rows(part[1], e, e + 1, _U8)[0]
            _check_mxfp4_scales(ckpt, name, part[1], e, blocks, scales)
            data = blocks.reshape(blocks.shape[0], -1)  # u8[rows, cols / 2]: byte j = elements 2j, 2j + 1
            if part[-1]:
                data, scales = _deinterleave(data), _deinterleave(scales)
            out.row(bank, row + j)[...] = data
            out.row(f"{bank}_scale", row + j)[...] = scales
        else:
            w = ckpt.read_rows(name, e, e + 1)[0].T  # [in, out] -> [out, in]
            what = f"{ckpt.tensors[name].file}: tensor {name!r} (expert {e})"
            half = w.shape[0] // 2  # de-interleaved: bank row r < half is stored column 2r, else 2(r - half) + 1

            def where(r: int, block: int, e=e, half=half) -> str:  # the block in the stored [E, in, out] tensor
                col = (2 * r if r < half else 2 * (r - half) + 1) if part[-1] else r
                return f"elements [{e}, {32 * block}:{32 * block + 32}, {col}] (a block of 32 along dimension 1)"
            out.put(bank, row + j, 0, _deinterleave(w) if part[-1] else w, what, where)


def allocate_expert_banks(cfg: MoEConfig, ckpt: SafetensorsCheckpoint, plan: list, fmt: wf.WeightFormat,
                          bias_dtype, experts: range | None = None) -> ExpertBanks:
    """The empty (zero, writable) expert banks that :func:`fill_expert_banks` fills by ``plan`` (expert_tensor_plan
    with the same ``experts``: the experts of every MoE layer the banks hold, default all): L_moe * len(experts) rows in
    the storage form of weight format ``fmt`` (weight_formats.storage_format), each row at the page offset that lets
    read_into map the tensors stored as the bank holds them (SafetensorsCheckpoint.page_offsets); bias banks (gpt-oss)
    of ``bias_dtype``.

    Each HostBank gets the next bank id, and the ids are attributes of the decode and prefill steps' FFI calls, so of
    their persistent compilation cache keys: load_checkpoint allocates the expert banks here, in its own thread, before
    the dense model's banks, so that the same load gives the same ids (and a cache hit) whatever the threads' timing.

    Raises CheckpointError (a missing tensor); on any error the banks made so far are released."""
    experts = check_experts(cfg, experts)
    Ep, H, I = len(experts), cfg.hidden_size, cfg.moe_intermediate_size
    rows = cfg.num_moe_layers * Ep
    fmt = wf.storage_format(fmt, H, I)
    row_specs = wf.expert_rows(fmt, H, I)
    # Each bank row's page offset from the tensors read_into puts into it as stored, so that it maps them (no copy).
    # Per row on the CPU backend; a GPU maps a bank for its slot fills only when the rows are at one stride.
    row_bytes = {k: math.prod(shape) * np.dtype(dtype).itemsize for k, (shape, dtype) in row_specs.items()}
    regions = {k: [] for k in row_specs}  # bank -> [(row, tensor, offset in it, offset in the row, bytes)]
    for bank, row, name, part in plan:
        if bank in row_specs and (not fmt.quantized and part[0] in ("fused", "rows") or part[0] == "fp8_rows"):
            rb = row_bytes[bank]
            if part[0] == "fused":  # the tensor's rows `experts` land at bank rows row, row + 1, ...
                regions[bank] += [(row + j, name, e * rb, 0, rb) for j, e in enumerate(experts)]
            else:  # the tensor is the stored rows part[1]:part[2] of bank row `row`
                per_stored_row = rb // row_specs[bank][0][0]
                regions[bank].append((row, name, 0, part[1] * per_stored_row, (part[2] - part[1]) * per_stored_row))
    per_row = jax.default_backend() == "cpu"
    specs = {name: (rows, shape, dtype, ckpt.page_offsets(regions[name], rows, row_bytes[name], dtype, per_row))
             for name, (shape, dtype) in row_specs.items()}
    if cfg.expert_bias:
        specs.update(gate_up_bias=(rows, (2 * I,), bias_dtype), down_bias=(rows, (H,), bias_dtype))
    host: dict[str, HostBank] = {}
    try:
        for name, spec in specs.items():
            host[name] = HostBank(*spec)
        return ExpertBanks(**host, format=fmt)
    except BaseException:
        for bank in host.values():
            bank.release()
        raise


def fill_expert_banks(banks: ExpertBanks, cfg: MoEConfig, ckpt: SafetensorsCheckpoint, plan: list,
                      experts: range | None = None, cancel: threading.Event | None = None) -> ExpertBanks:
    """Fill the banks of :func:`allocate_expert_banks` (same plan and experts) and freeze them.

    Float formats: tensors are read straight into the bank rows (a cast through one tensor-sized temporary when the
    stored dtype differs). q8_0 / q4_0: each expert tensor (one expert of a fused one) is read, quantized with
    weight_formats.quantize and written into the rows; the float copy is one expert's matrix. fp8: the stored bytes
    go into the rows as float tensors do (mapped from the file where the offsets allow, else read), the scales are
    copied (a bf16 scale_inv widened to f32); mxfp4: blocks and scales copied (gate/up rows de-interleaved); both
    checked for NaN (FP8 S.1111.111 as read, an E8M0 scale of 255, a non-finite scale) and never dequantized. Biases
    (gpt-oss) go to the float bias banks.

    cancel: when set (by another thread), the load stops before its next tensor and raises LoadCancelled.

    Returns: ``banks``, frozen. Raises CheckpointError (naming file and tensor), LoadCancelled; on any error the banks
    are released.
    """
    experts = check_experts(cfg, experts)
    Ep, fmt = len(experts), banks.format
    try:
        out = _BankWriter(dict(banks.items()), fmt)
        for bank, row, name, part in plan:
            if cancel is not None and cancel.is_set():
                raise LoadCancelled("fill_expert_banks: cancelled")
            if part[0] == "fused" and not (fmt.quantized and bank in ("gate_up", "down")):
                ckpt.read_into(name, out.rows(bank, row, Ep), rows=experts)
            elif part[0] == "fused":  # quantized while loading, one expert at a time
                for j, e in enumerate(experts):
                    what = f"{ckpt.tensors[name].file}: tensor {name!r} (expert {e})"
                    out.put(bank, row + j, 0, ckpt.read_rows(name, e, e + 1)[0], what)
            elif part[0] == "rows" and not fmt.quantized:
                ckpt.read_into(name, out.row(bank, row)[part[1]:part[2]])
            elif part[0] == "rows":
                what = f"{ckpt.tensors[name].file}: tensor {name!r}"
                out.put(bank, row, part[1], ckpt.view(name), what)  # quantized: read once, never copied
            elif part[0] == "fp8_rows":  # the data mapped or read straight into the rows, NaN-checked as read
                data = out.row(bank, row)[part[1]:part[2]]
                ckpt.read_into(name, data, dtypes=_F8)
                scales = _read_fp8_scales(ckpt, part[3], (part[2] - part[1], data.shape[-1]), fmt)
                _check_fp8_overflow(ckpt, part[3], data.view(_F8[0]), scales, fmt)
                out.row(f"{bank}_scale", row)[part[4]:part[4] + scales.shape[0]] = scales
            else:
                _read_gpt_oss_experts(ckpt, bank, row, name, part, out, experts)
        del out  # the writable views; views taken after freeze() are read-only
        banks.freeze()
    except BaseException:
        banks.release()
        raise
    return banks


class LoadCancelled(Exception):
    """fill_expert_banks stopped early because its ``cancel`` event was set (the dense model's load failed)."""


def _load_in_two_threads(make_model: Callable[[], Any], make_banks: Callable[[threading.Event], ExpertBanks]):
    """(make_model(), make_banks(cancel)): the expert banks read in a second thread while this one builds the dense
    model. Each is mostly page faults, file reads and C++ passes that release the GIL (mapping and populating the
    experts' pages with their NaN/Inf check; copying the dense tensors into fresh memory), so on a machine of 2+
    cores they partly overlap (docs/DESIGN.md sec. 20.23). The dense model's error, if any, is raised; otherwise the
    banks' error. On any error, a KeyboardInterrupt in either wait included, the banks' thread is cancelled (it stops
    before its next tensor), waited for, and the banks it made are released."""
    cancel = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="ft_jax-expert-banks") as pool:
        pending: Future = pool.submit(make_banks, cancel)
        try:
            return make_model(), pending.result()
        except BaseException:  # the model's error, the banks' error, or KeyboardInterrupt in either wait
            cancel.set()  # the other thread stops before its next tensor
            try:
                pending.result().release()
            except BaseException:  # its own failure or LoadCancelled: the first error is the one to report
                pass
            raise


class _DenseReader:
    """ParamFactory (ft_jax.models.layers) reading dense tensors from the checkpoint as host arrays of ``dtype``
    (float32 or bfloat16), or as numpy weight_formats.QuantizedTensor(data [rows, cols], scales, fmt): with fmt q8_0
    / q4_0 the tensors ft_jax.config.quantization.quantize_applies selects (kind "weight"), quantized while read;
    with an fp8 fmt every tensor stored as F8_E4M3 (with its ``<name>_scale_inv``), as stored. Raises CheckpointError
    naming file and tensor (a row length that does not fit the blocks, an FP8 tensor where a float one is needed,
    NaN).

    With host_banks, its ``host_weights`` puts the projections the model asks for (Stacked.projection, the embedding
    and lm_head) into host banks of ``dtype`` (models.layers.HostWeights): mapped from the file's pages where their
    offsets allow, so that loading them copies nothing (docs/DESIGN.md sec. 20.27). Without, it returns None and they
    are read through __call__ and stacked as arrays."""

    def __init__(self, ckpt: SafetensorsCheckpoint, dtype, family: str, fmt: wf.WeightFormat | None = None,
                 host_banks: bool = False):
        self.ckpt, self.dtype, self.family, self.fmt = ckpt, np.dtype(dtype), family, fmt
        self.host_banks = host_banks

    def __call__(self, name: str, shape: tuple[int, ...], kind: str):
        ckpt, dtype, family, fmt = self.ckpt, self.dtype, self.family, self.fmt
        # A tensor outside the decoder layers (embedding, lm_head, final norm) becomes a parameter of its own
        # (host_array); a layer's ("model.layers.{l}.", models.layers.Stacked) is copied into its layer stack.
        whole = not name.startswith("model.layers.")
        if name not in ckpt and family == "mixtral" and ".block_sparse_moe.gate." in name:
            alt = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # transformers-5 router name
            name = alt if alt in ckpt else name
        info = ckpt.tensors.get(name)
        if fmt is not None and fmt.name == "fp8" and info is not None and info.dtype == _F8[0]:
            if kind != "weight" or len(shape) != 2:
                raise CheckpointError(f"{info.file}: tensor {name!r} is stored in FP8, but ft_jax reads it as a "
                                      f"{kind.removesuffix('_f32')} in float (quantization_config should list it in "
                                      "modules_to_not_convert)")
            return wf.QuantizedTensor(*_read_fp8(ckpt, name, f"{name}_scale_inv", shape, fmt), fmt)
        quantized = fmt is not None and fmt.name in wf.QUANTIZE_CHOICES
        if quantized and kind == "weight" and quantize_applies(name, shape):
            _fits(fmt, ckpt.info(name, shape), name, shape[1])
            w = ckpt.view(name, shape)  # [rows, cols] as stored
            alloc = huge_page_buffer if whole else np.empty  # a whole one: a buffer host_array uses in place
            data, scales = alloc(fmt.data_shape(*shape), fmt.data_dtype), alloc(fmt.scale_shape(*shape),
                                                                                fmt.scale_dtype)
            _quantize_into(w, fmt, data, scales, f"{ckpt.tensors[name].file}: tensor {name!r}")
            return wf.QuantizedTensor(data, scales, fmt)
        target = np.dtype(np.float32 if kind.endswith("_f32") else dtype)
        in_place = ckpt.map_pages and info is not None and info.offset % JAX_CPU_ALIGNMENT == 0  # as host_array's test
        if whole and info is not None and info.dtype == target and not in_place:
            # Used as stored, and a copy either way: a file view host_array cannot use in place (the CPU backend
            # needs 64-byte alignment, and a mapping keeps the file offset's residue modulo the page size), or no
            # part of the file may stay mapped (map_pages False). Read straight into the buffer host_array then uses:
            # one pass over the bytes (checked piece by piece as read), no populated view beside the copy.
            out = huge_page_buffer(shape, target)
            ckpt.read_into(name, out)
            return out
        # A layer's tensor is a view of the file's pages, copied into its stack (one copy, no temporary), and so is
        # a whole one that host_array uses in place (mapped, 64-byte aligned) or that is cast.
        stored = ckpt.view(name, shape)
        cast = stored.astype(target, copy=False)
        if cast is not stored:
            _check_cast(name, info, stored, cast)
        return cast

    def _quantized(self, name: str, shape: tuple[int, int]) -> bool:
        """Whether __call__ gives weight ``name`` as a QuantizedTensor."""
        info, fmt = self.ckpt.tensors.get(name), self.fmt
        if fmt is None:
            return False
        if fmt.name == "fp8":
            return info is not None and info.dtype == _F8[0]
        return fmt.name in wf.QUANTIZE_CHOICES and quantize_applies(name, shape)

    def host_weights(self, layers: list[list[tuple[str, tuple[int, int]]]], stacked: bool) -> HostWeights | None:
        """Per layer, its tensors (name, [rows, K]) concatenated along their rows, in one host bank of the dense dtype
        (row l: layer l; each row at the page offset of its tensors in the file: SafetensorsCheckpoint.page_offsets),
        filled by read_into (mapped where congruent, else read; cast through a temporary when stored in another
        float dtype; checked for NaN/Inf) and frozen. None without host_banks, and where __call__ would give a part
        as a QuantizedTensor (stored in FP8 with an fp8 fmt, or quantized by a q8_0 / q4_0 fmt): those stay arrays.

        Raises CheckpointError naming the tensor (missing, wrong shape or dtype, truncated file, NaN/Inf, a value
        beyond the range of ``dtype``)."""
        if not self.host_banks or any(self._quantized(name, shape) for parts in layers for name, shape in parts):
            return None
        ckpt, dtype = self.ckpt, self.dtype
        K = layers[0][0][1][1]
        rows = sum(shape[0] for _, shape in layers[0])
        regions = []  # (bank row, tensor, 0, byte offset in the row, bytes)
        for l, parts in enumerate(layers):
            within = 0
            for name, shape in parts:
                regions.append((l, name, 0, within, ckpt.info(name, shape).nbytes))
                within += shape[0] * K * dtype.itemsize
        offsets = ckpt.page_offsets(regions, len(layers), rows * K * dtype.itemsize, dtype)
        bank = HostBank(len(layers), (rows, K), dtype, page_offset=offsets)
        try:
            for l, parts in enumerate(layers):
                row, r = bank.rows(l, l + 1)[0], 0  # [rows, K]
                for name, shape in parts:
                    ckpt.read_into(name, row[r:r + shape[0]], shape)
                    r += shape[0]
            bank.freeze()
        except BaseException:
            bank.release()
            raise
        return HostWeights(bank, stacked)


def load_banks(model_dir: str | os.PathLike, dtype=jnp.float32, quantize: str | None = None,
               experts: range | None = None) -> ExpertBanks:
    """The expert banks of a checkpoint folder alone (no dense model), as load_checkpoint builds them with expert
    dtype ``dtype``: the experts ``experts`` (a range in [0, E), default all) of every MoE layer, bank row
    moe_layer * len(experts) + j holding expert experts[j]. Raises as load_checkpoint."""
    cfg = load_config(model_dir)
    bank_dtype = _np_dtype(dtype)
    fmt = expert_format(cfg, bank_dtype, quantize)
    with SafetensorsCheckpoint(model_dir) as ckpt:
        plan = expert_tensor_plan(cfg, ckpt, fmt, experts)
        return fill_expert_banks(allocate_expert_banks(cfg, ckpt, plan, fmt, bank_dtype, experts), cfg, ckpt, plan,
                                 experts)


def load_checkpoint(model_dir: str | os.PathLike, dtype=jnp.float32, expert_dtype=None,
                    quantize: str | None = None, experts: range | None = None,
                    map_pages: bool = True, checked: CheckedWeights | None = None) -> LoadedCheckpoint:
    """Load config, dense model and host banks of a Hugging Face MoE checkpoint folder.

    Args:
        model_dir: folder with config.json and model.safetensors or model.safetensors.index.json.
        dtype: dense parameter dtype on the device (jnp.float32 or jnp.bfloat16) of the float tensors.
        expert_dtype: host-bank dtype of float experts and of expert biases (float32 or bfloat16); default ``dtype``.
        quantize: None, "q8_0" or "q4_0" (any case): quantize a float checkpoint while loading (llama.cpp's rounding,
            weight_formats.quantize): the expert banks and every dense 2-D projection but the routers and the
            embedding table (ft_jax.config.quantization.quantize_applies). FP8 (quantization_config quant_method
            "fp8") and MXFP4 (gpt-oss) checkpoints are always kept as stored: expert banks in that format, FP8
            dense projections as QuantizedTensor.
        experts: the experts of every MoE layer this process's banks hold (expert parallelism:
            ft_jax.offload.expert_parallel.ExpertPartition.process_experts), a range in [0, E); default all. Only
            their tensors (their rows of a fused [E, ...] tensor) are read; bank row moe_layer * len(experts) + j
            holds expert experts[j].
        map_pages: map the file's pages into the expert banks where the offsets allow (default: fast to load,
            the banks share the page cache); False: copy them onto the banks' own huge pages, and the dense tensors
            too (slower to load, faster to read, no mapping of the file kept; SafetensorsCheckpoint).
        checked: the record of byte ranges checked for NaN/Inf by earlier loads (ft_jax.checked_weights): the ranges
            it covers are not checked again, and those this load checks are added and saved once the load succeeds.
            None (default): every float tensor read is checked.
    Returns:
        LoadedCheckpoint(config, model, banks, checkpoint_bytes, unused_tensors); banks.format is the experts' weight
        format.
    Memory: expert tensors stored as the bank holds them are mapped from the file into the bank rows (no copy, see
    SafetensorsCheckpoint.read_into; with map_pages False they are read like the others), others read one at a time
    directly into the bank rows (plus one tensor-sized temporary when the stored dtype differs from the bank's; one
    expert's matrix when quantizing; gpt-oss tensors one expert at a time); the dense projections, embedding and lm_head
    go into host banks the same way where models.layers.host_weights_apply (the CPU backend, bf16, AVX-512 BF16:
    models.layers.HostWeights), and other dense tensors are file views copied once each. Peak host memory is about banks
    + dense weights + one tensor per thread: the expert banks are read in a second thread while this one builds the
    dense model (_load_in_two_threads; an error or KeyboardInterrupt cancels that thread and releases its banks). The
    banks are frozen (read-only, :meth:`HostBank.freeze`) before they are returned.
    Raises:
        CheckpointError: missing/unreadable/truncated/corrupted file (including headers that break the safetensors
            rules and unsafe shard names in the index), missing tensor, wrong shape or dtype, a NaN/Inf weight or
            scale (FP8 NaN, an MXFP4 scale of 255 or one that overflows float32 included), a value that becomes
            infinite when cast to ``dtype`` (a float32 weight beyond bfloat16's range), a row length that does not
            fit the format's blocks (names the file and the tensor).
        ValueError: a dtype or quantize value not listed above, an experts range that is empty, has a step or
            leaves [0, E).
        TypeError: quantize neither a str nor None.
        ConfigError / NotImplementedError: from :func:`ft_jax.config.load_config` (an unsupported quant_method), or
            quantize given for an FP8 / MXFP4 checkpoint (ft_jax.config.quantization.expert_format).
    """
    cfg = load_config(model_dir)
    dense_dtype = _np_dtype(dtype)
    bank_dtype = dense_dtype if expert_dtype is None else _np_dtype(expert_dtype)
    fmt = expert_format(cfg, bank_dtype, quantize)
    with SafetensorsCheckpoint(model_dir, map_pages=map_pages, checked=checked) as ckpt:
        plan = expert_tensor_plan(cfg, ckpt, fmt, experts)
        banks = allocate_expert_banks(cfg, ckpt, plan, fmt, bank_dtype, experts)  # before the dense banks: same ids
        model, banks = _load_in_two_threads(
            lambda: MoETransformer(cfg, _DenseReader(ckpt, dense_dtype, cfg.family, fmt if fmt.quantized else None,
                                                      host_weights_apply(dense_dtype))),
            lambda cancel: fill_expert_banks(banks, cfg, ckpt, plan, experts, cancel))
        nbytes = ckpt.nbytes
        if experts is not None:
            expert_tensor_plan(cfg, ckpt, fmt)  # the experts other processes hold count as read (headers only)
        unused = tuple(sorted(set(ckpt.tensors) - ckpt.used))
    if checked is not None:
        checked.save()
    return LoadedCheckpoint(cfg, model, banks, nbytes, unused)
