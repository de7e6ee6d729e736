"""Host memory: what loading a checkpoint will take, what the machine (or its cgroup) has, and the one-line refusal.

``check_host_memory`` runs before anything is allocated (ft_jax.load calls it first): it needs only the config and
the safetensors headers (shapes, stored dtypes; never the tensor data), so it takes milliseconds and a few MB for a
checkpoint of any size. An allocation that fails anyway (HostBank's std::bad_alloc) becomes the same
InsufficientMemoryError (ft_jax.kernels.host_bank).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from ft_jax import units, weight_formats
from ft_jax.config.quantization import quantize_applies

MIB = 2**20


class InsufficientMemoryError(MemoryError):
    """Loading needs more host memory than is available; the message names both figures and what would fit."""


@dataclasses.dataclass(frozen=True)
class HostNeed:
    """Host bytes a load takes. banks: the expert host banks (weights + biases); dense: the non-expert weights at
    the load dtype; slots: device expert slots when they live in host memory (CPU backend), else 0; temporary: the
    loader's one read buffer (the largest dense tensor, or expert tensor stored in another dtype, at 4 bytes per
    value)."""

    banks: int
    dense: int
    slots: int
    temporary: int

    @property
    def total(self) -> int:
        return self.banks + self.dense + self.slots + self.temporary


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) -> None


def _cgroup_room() -> tuple[int, str] | None:
    """Bytes left under this process's cgroup memory limit (v2 memory.max - memory.current, or v1
    memory.limit_in_bytes - memory.usage_in_bytes), or None when no limit is set or readable."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2 unified hierarchy
            for folder in (os.path.join("/sys/fs/cgroup", rel), "/sys/fs/cgroup"):
                limit, used = _read_int(f"{folder}/memory.max"), _read_int(f"{folder}/memory.current")
                if limit is not None and used is not None:
                    return max(0, limit - used), "cgroup memory.max - memory.current"
        elif "memory" in controllers.split(","):
            for folder in (os.path.join("/sys/fs/cgroup/memory", rel), "/sys/fs/cgroup/memory"):
                limit = _read_int(f"{folder}/memory.limit_in_bytes")
                used = _read_int(f"{folder}/memory.usage_in_bytes")
                if limit is not None and used is not None and limit < 2**60:  # v1's "no limit" is ~2^63
                    return max(0, limit - used), "cgroup memory.limit_in_bytes - memory.usage_in_bytes"
    return None


def available_host_memory() -> tuple[int, str] | None:
    """(bytes, source): the smaller of MemAvailable (/proc/meminfo) and the room left under a cgroup limit; None
    when neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
                    break
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def _elements(info) -> int:
    return int(np.prod(info.shape, dtype=np.int64)) if info.shape else 1


def planned_expert_bytes(cfg, dtype, fmt=None) -> int:
    """Bytes one expert will take in host memory, from the config alone (before any bank exists): gate_up [2I, H] +
    down [H, I] in weight format ``fmt`` (stored size: data plus scales, ft_jax.weight_formats.expert_rows; default
    the float format of ``dtype``), plus the biases [2I] and [H] of experts with biases at ``dtype``. It equals the
    loaded ExpertBanks.expert_bytes, which is the figure everywhere after loading."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    fmt = weight_formats.float_format(np.dtype(dtype)) if fmt is None else fmt
    weights = sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in
                  weight_formats.expert_rows(fmt, H, I).values())
    return weights + ((2 * I + H) if cfg.expert_bias else 0) * np.dtype(dtype).itemsize


def budget_slots(budget: str, expert_bytes: int) -> int:
    """The whole expert slots a device budget given as bytes ("8GiB", units.parse_bytes) holds, not capped at the
    number of experts: the one check of a byte budget (ft_jax.load's cache=, generate's and plan's --device-memory).

    Raises:
        ValueError: not a byte count, or a budget smaller than one expert slot of ``expert_bytes`` (the stored size:
            planned_expert_bytes, ExpertBanks.expert_bytes).
    """
    nbytes = units.parse_bytes(budget)
    if nbytes < expert_bytes:
        raise ValueError(f"a device budget of {budget} ({units.count(nbytes, 'byte')}) is smaller than "
                         f"one expert slot ({expert_bytes} bytes: gate, up and down weights of one expert as stored)")
    return nbytes // expert_bytes


def _dense_bytes(name: str, info, itemsize: int, fmt) -> int:
    """Host bytes of one dense tensor after loading: FP8 data as stored and its scale grid in float32, a 2-D
    projection that --quantize makes q8_0 / q4_0 (ft_jax.config.quantization.quantize_applies) at its stored size,
    anything else at the load dtype."""
    if np.dtype(info.dtype).itemsize == 1:  # FP8 data (or int8 / uint8): kept as stored
        return _elements(info)
    if name.endswith("_scale_inv"):  # an FP8 scale grid, widened to float32
        return _elements(info) * 4
    if fmt is not None and fmt.name in weight_formats.QUANTIZE_CHOICES and quantize_applies(name, info.shape):
        return fmt.nbytes(*info.shape)
    return _elements(info) * itemsize


def host_need(cfg, tensors: dict, dtype, num_slots: int, slots_in_host: bool, fmt=None,
              experts_held: int | None = None) -> HostNeed:
    """Host bytes of a load, from the config and the headers.

    Args:
        cfg: MoEConfig. tensors: {name: TensorInfo} (SafetensorsCheckpoint.tensors: shapes and stored dtypes).
        dtype: the load dtype (float32 or bfloat16) of the float banks and dense weights.
        num_slots: device expert slots. slots_in_host: True on a CPU backend (the slots are host arrays).
        fmt: the experts' weight format (ft_jax.config.quantization.expert_format; default the float format of
            dtype): banks and slots at its stored size, and with q8_0 / q4_0 the dense 2-D projections too.
        experts_held: experts of every MoE layer this process's banks hold (expert parallelism:
            len(ExpertPartition.process_experts)); default all E.
    Returns:
        HostNeed. Expert tensors are those with ".experts." in their name; every other tensor counts as dense
        (_dense_bytes).
    """
    itemsize = np.dtype(dtype).itemsize
    expert = planned_expert_bytes(cfg, dtype, fmt)
    dense = sum(_dense_bytes(name, t, itemsize, fmt) for name, t in tensors.items() if ".experts." not in name)
    # The loader's one read buffer: a dense tensor's host copy, or an expert tensor stored in another dtype.
    load = np.dtype(dtype)
    largest = max((_elements(t) for name, t in tensors.items()
                   if ".experts." not in name or np.dtype(t.dtype) != load), default=0) * max(itemsize, 4)
    held = cfg.num_experts if experts_held is None else experts_held
    return HostNeed(banks=cfg.num_moe_layers * held * expert, dense=dense,
                    slots=num_slots * expert if slots_in_host else 0, temporary=largest)


def refusal(need: HostNeed, available: int, source: str, *, dtype: str, expert_bytes: int, num_slots: int,
            slots_in_host: bool, quantizable: bool = False) -> str | None:
    """The one-line refusal when ``need.total`` exceeds ``available`` bytes, else None. It names both figures and
    what would fit, each as the CLI flag / the ft_jax.load argument: fewer device slots (--cache-slots / cache=),
    bfloat16 instead of float32 (--dtype / dtype=), --quantize q8_0 / q4_0 (quantize=) for a
    float checkpoint loaded unquantized (``quantizable``), or a machine with more memory."""
    if need.total <= available:
        return None
    parts = f"expert banks {need.banks // MIB} MiB, dense weights {need.dense // MIB} MiB"
    if need.slots:
        parts += f", {num_slots} device slots {need.slots // MIB} MiB (in host memory on the CPU backend)"
    if need.temporary:
        parts += f", a read buffer {need.temporary // MIB} MiB"
    fits = []
    if slots_in_host and need.slots:
        room = available - (need.total - need.slots)
        if room >= expert_bytes:
            fits.append(f"--cache-slots {room // expert_bytes} / cache={room // expert_bytes} (a smaller cache)")
    if dtype == "float32" and need.total // 2 <= available:
        fits.append("--dtype bf16 / dtype='bf16' (half the bytes of float32)")
    if quantizable:
        fits.append("--quantize q8_0 or q4_0 / quantize='q8_0' or 'q4_0' (8.5 or 4.5 bits per weight instead of 16 "
                    "for bf16)")
    fits.append(f"a machine with more than {-(-need.total // MIB)} MiB available")
    return (f"loading needs {-(-need.total // MIB)} MiB of host memory ({parts}) but only {available // MIB} MiB "
            f"is available ({source}); what would fit: {' or '.join(fits)}")


def check_host_memory(cfg, tensors: dict, dtype, num_slots: int, slots_in_host: bool, fmt=None,
                      experts_held: int | None = None) -> HostNeed:
    """Refuse a load that cannot fit, before anything is allocated (arguments as host_need).

    Returns:
        HostNeed (when it fits, or when the available memory cannot be read).
    Raises:
        InsufficientMemoryError: one line naming the need, the available memory and what would fit.
    """
    need = host_need(cfg, tensors, dtype, num_slots, slots_in_host, fmt, experts_held)
    found = available_host_memory()
    if found is not None:
        message = refusal(need, found[0], found[1], dtype=np.dtype(dtype).name,
                          expert_bytes=planned_expert_bytes(cfg, dtype, fmt),
                          num_slots=num_slots, slots_in_host=slots_in_host,
                          quantizable=fmt is None or not fmt.quantized)
        if message is not None:
            raise InsufficientMemoryError(message)
    return need
