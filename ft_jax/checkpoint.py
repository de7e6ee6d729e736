"""Load a Hugging Face MoE checkpoint: dense weights to the device, expert weights streamed into host banks.

Files: ``model.safetensors`` (single file) or ``model.safetensors.index.json`` (sharded; its ``weight_map``
names the shard of every tensor). The safetensors format (github.com/huggingface/safetensors): 8-byte
little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, ...,
"__metadata__": {...}}``, then the data section (offsets are relative to its start, byte 8 + N).

Tensors are read with plain positioned reads straight into their destination (a host-bank row or a temporary
numpy array of one tensor), not through a memory map: a mapped checkpoint's pages count in the process RSS while
the map is open, which would make the peak host memory of a load about 2x the checkpoint instead of ~1x.

Expert tensor names (per MoE layer l, expert e; prefix ``model.layers.{l}.``):
  * Mixtral (Hub): ``block_sparse_moe.experts.{e}.w1.weight`` (gate [I, H]), ``.w3.`` (up [I, H]),
    ``.w2.`` (down [H, I]); router ``block_sparse_moe.gate.weight`` [E, H].
  * Qwen2-MoE / Qwen3-MoE / OLMoE (Hub): ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``;
    router ``mlp.gate.weight``.
  * Fused (transformers 5 in-memory names, any family): ``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj`` [E, H, I]; router ``mlp.gate.weight``.
Host-bank rows (contracts.md): gate_up row = [gate; up] [2I, H], down row [H, I]; flat id = moe_layer * E + e.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ft_jax.config import MoEConfig, load_config
from ft_jax.models.decoder import MoETransformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_FLOAT_NP = tuple(_ST_DTYPES[k] for k in ("F64", "F32", "F16", "BF16"))


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded: missing/truncated/corrupted file, missing tensor, wrong shape or dtype.

    The message names the file and, where one is involved, the tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file path, numpy dtype, shape, absolute byte offset and byte count."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_safetensors_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header (reads only the header).

    Raises:
        CheckpointError: file missing, shorter than its header says (truncated), header not valid JSON
            (corrupted), unknown dtype, or a tensor whose byte range is inconsistent with its shape or lies
            beyond the end of the file (truncated). Messages name the file and the tensor.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated or corrupted safetensors file: header length {n} but "
                                      f"the file has {size} bytes")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file not found") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (not a JSON object)")
    data_start = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r}: corrupted header entry {entry!r} ({e!r})") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} do not match shape "
                                  f"{list(shape)} x {dtype.itemsize} bytes (corrupted header)")
        if data_start + end > size:
            raise CheckpointError(f"{path}: truncated file: tensor {name!r} needs bytes "
                                  f"{data_start + begin}..{data_start + end} but the file has {size} bytes")
        out[name] = TensorInfo(path, dtype, shape, data_start + begin, nbytes)
    return out


class SafetensorsCheckpoint:
    """Tensor directory of a checkpoint folder (single file or sharded) with positioned reads.

    Use as a context manager (or call close()) to release the open file handles.

    Raises (constructor): CheckpointError when no safetensors file / index exists, the index is invalid, a shard
    is missing, truncated or corrupted, or a tensor listed in the index is absent from its shard.
    """

    def __init__(self, model_dir: str | os.PathLike):
        model_dir = os.fspath(model_dir)
        index_path = os.path.join(model_dir, INDEX_FILE)
        single_path = os.path.join(model_dir, SINGLE_FILE)
        self.tensors: dict[str, TensorInfo] = {}
        if os.path.exists(index_path):
            try:
                with open(index_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: invalid safetensors index ({e!r})") from None
            self.files = [os.path.join(model_dir, s) for s in sorted(set(weight_map.values()))]
            for path in self.files:
                self.tensors.update(read_safetensors_header(path))
            for name, shard in weight_map.items():
                info = self.tensors.get(name)
                if info is None or os.path.basename(info.file) != shard:
                    raise CheckpointError(f"{os.path.join(model_dir, shard)}: tensor {name!r} listed in "
                                          f"{INDEX_FILE} is missing from that file")
        elif os.path.exists(single_path):
            self.files = [single_path]
            self.tensors = read_safetensors_header(single_path)
        else:
            raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")
        self._handles: dict[str, Any] = {}

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

    def info(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """TensorInfo of ``name``, checking its shape (if given) and that it is a float tensor.

        Raises CheckpointError naming the tensor and the file(s)."""
        info = self.tensors.get(name)
        if info is None:
            where = self.files[0] if len(self.files) == 1 else f"{os.path.dirname(self.files[0])}/{INDEX_FILE}"
            raise CheckpointError(f"{where}: missing tensor {name!r}")
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, expected "
                                  f"{list(shape)}")
        if info.dtype not in _FLOAT_NP:
            raise CheckpointError(f"{info.file}: tensor {name!r} has dtype {info.dtype}, expected a float type")
        return info

    def read_into(self, name: str, out: np.ndarray, shape: tuple[int, ...] | None = None) -> None:
        """Read tensor ``name`` into the C-contiguous array ``out`` (same number of elements), casting to
        out.dtype if the stored dtype differs (via one temporary of the tensor's size). ``shape``: expected
        stored shape (default out.shape)."""
        info = self.info(name, out.shape if shape is None else shape)
        if not out.flags.c_contiguous or out.size != math.prod(info.shape):
            raise ValueError(f"read_into({name!r}): destination must be C-contiguous with {math.prod(info.shape)} "
                             f"elements, got shape {out.shape}")
        if info.dtype == out.dtype:
            self._pread(info, out.reshape(-1).view(np.uint8))
        else:
            tmp = np.empty(info.shape, info.dtype)
            self._pread(info, tmp.reshape(-1).view(np.uint8))
            out.reshape(info.shape)[...] = tmp.astype(out.dtype)

    def read(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor ``name`` as a new numpy array in its stored dtype (shape checked if given)."""
        info = self.info(name, shape)
        out = np.empty(info.shape, info.dtype)
        self._pread(info, out.reshape(-1).view(np.uint8))
        return out

    def _pread(self, info: TensorInfo, dest: np.ndarray) -> None:
        fh = self._handles.get(info.file)
        if fh is None:
            fh = self._handles[info.file] = open(info.file, "rb", buffering=0)
        fh.seek(info.offset)
        view, done = memoryview(dest), 0
        while done < info.nbytes:
            got = fh.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{info.file}: truncated file while reading tensor at byte "
                                      f"{info.offset + done} (expected {info.nbytes} bytes)")
            done += got


@dataclasses.dataclass
class LoadedCheckpoint:
    """Result of :func:`load_checkpoint`.

    config: MoEConfig; model: MoETransformer (dense parameters on the device);
    gate_up_bank: HostBank [L_moe*E, 2I, H]; down_bank: HostBank [L_moe*E, H, I];
    checkpoint_bytes: total size of the safetensors files.
    """

    config: MoEConfig
    model: MoETransformer
    gate_up_bank: Any
    down_bank: Any
    checkpoint_bytes: int


def _np_dtype(dtype) -> np.dtype:
    d = np.dtype(jnp.dtype(dtype))
    if d not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16, got {d}")
    return d


def expert_tensor_plan(cfg: MoEConfig, ckpt: SafetensorsCheckpoint) -> list[tuple[str, int, str, tuple]]:
    """Which tensors fill which bank rows, validated against the headers (names and shapes) before any reading.

    Returns a list of (bank "gate_up" | "down", first flat row, tensor name, part) where part is
    ("fused",) for an [E, ...] tensor covering rows first..first+E-1, or ("rows", a, b) for one expert tensor
    going to rows a:b of the row's leading axis.
    Raises CheckpointError (missing tensor / wrong shape, naming file and tensor).
    """
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    plan = []
    for m, layer in enumerate(cfg.moe_layers):
        p = f"model.layers.{layer}"
        fused_gu, fused_dn = f"{p}.mlp.experts.gate_up_proj", f"{p}.mlp.experts.down_proj"
        if fused_gu in ckpt:
            ckpt.info(fused_gu, (E, 2 * I, H))
            ckpt.info(fused_dn, (E, H, I))
            plan += [("gate_up", m * E, fused_gu, ("fused",)), ("down", m * E, fused_dn, ("fused",))]
            continue
        for e in range(E):
            if cfg.family == "mixtral":
                base = f"{p}.block_sparse_moe.experts.{e}"
                gate, up, down = f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
            else:
                base = f"{p}.mlp.experts.{e}"
                gate, up, down = (f"{base}.{n}_proj.weight" for n in ("gate", "up", "down"))
            ckpt.info(gate, (I, H))
            ckpt.info(up, (I, H))
            ckpt.info(down, (H, I))
            row = m * E + e
            plan += [("gate_up", row, gate, ("rows", 0, I)), ("gate_up", row, up, ("rows", I, 2 * I)),
                     ("down", row, down, ("rows", 0, H))]
    return plan


def _dense_factory(ckpt: SafetensorsCheckpoint, dtype, family: str):
    """ParamFactory reading dense tensors from the checkpoint as host arrays of ``dtype`` (float32 or bfloat16)."""

    def make(name: str, shape: tuple[int, ...], kind: str) -> jax.Array:
        if name not in ckpt and family == "mixtral" and ".block_sparse_moe.gate." in name:
            alt = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # transformers-5 router name
            name = alt if alt in ckpt else name
        return ckpt.read(name, shape).astype(dtype, copy=False)

    return make


def load_checkpoint(model_dir: str | os.PathLike, dtype=jnp.float32, expert_dtype=None) -> LoadedCheckpoint:
    """Load config, dense model and host banks of a Hugging Face MoE checkpoint folder.

    Args:
        model_dir: folder with config.json and model.safetensors or model.safetensors.index.json.
        dtype: dense parameter dtype on the device (jnp.float32 or jnp.bfloat16).
        expert_dtype: host-bank dtype (float32 or bfloat16); default ``dtype``.
    Returns:
        LoadedCheckpoint(config, model, gate_up_bank HostBank [L_moe*E, 2I, H], down_bank HostBank [L_moe*E, H, I],
        checkpoint_bytes).
    Memory: expert tensors are read one at a time directly into the bank rows (plus one tensor-sized temporary
    when the stored dtype differs from expert_dtype); dense tensors pass through one host copy each. Peak host
    memory is about banks + dense weights + one tensor.
    Raises:
        CheckpointError: missing/truncated/corrupted file, missing tensor, wrong shape (names file and tensor).
        ConfigError / NotImplementedError: from :func:`ft_jax.config.load_config`.
    """
    from ft_jax.offload.host_bank import HostBank

    cfg = load_config(model_dir)
    dense_dtype = _np_dtype(dtype)
    bank_dtype = dense_dtype if expert_dtype is None else _np_dtype(expert_dtype)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rows = cfg.num_moe_layers * E
    with SafetensorsCheckpoint(model_dir) as ckpt:
        plan = expert_tensor_plan(cfg, ckpt)
        model = MoETransformer(cfg, _dense_factory(ckpt, dense_dtype, cfg.family))
        gate_up = HostBank(rows, (2 * I, H), bank_dtype)
        down = HostBank(rows, (H, I), bank_dtype)
        try:
            banks = {"gate_up": gate_up.numpy(), "down": down.numpy()}
            for bank, row, name, part in plan:
                arr = banks[bank]
                if part[0] == "fused":
                    ckpt.read_into(name, arr[row:row + E])
                else:
                    ckpt.read_into(name, arr[row, part[1]:part[2]])
        except BaseException:
            gate_up.release()
            down.release()
            raise
        nbytes = ckpt.nbytes
    return LoadedCheckpoint(cfg, model, gate_up, down, nbytes)
