"""Bandwidth profile of the q* policy (DESIGN.md sections 1 and 7): measure BP, BH and the contended pair; store them.

At one expert size (H, I, dtype or weight format; an expert is a gate_up row [2I, H] plus a down row [H, I], as
stored: a quantized format's data plus its scales), with the production FFI handlers, in GB/s (1e9 bytes/s) of
stored expert weight bytes:
- BP: ``ffi_ops.slot_fill`` under jax.jit, slot arrays donated (filled in place), n experts per call;
- BH: ``ffi_ops.host_experts`` under jax.jit, one token routed to n distinct experts;
- BPc, BHc: both loops at once in two threads (JAX releases the GIL while a computation runs, so they execute
  concurrently, as in the decode step where the fill and the host GEMV have no data dependency);
- the cost of one call of slot_fill, host_experts and slot_experts (with no and with one route) inside a compiled
  loop (``Bench.call_costs``): the cost model's fixed costs per layer (``Profile.fixed_costs``).
Rows and slots rotate past twice the last-level cache (``Bench``); each value is the median of timed windows
(``measure_rates``) with the min-max spread. Quick mode: 3 windows of 0.04 s, a few seconds in all.

Store: JSON at ``platformdirs.user_cache_path("ft_jax") / "profiles.json"`` (Linux: $XDG_CACHE_HOME/ft_jax, else
~/.cache/ft_jax), ``{"schema_version": 1, "profiles": [Profile fields, ...]}``, one entry per ``machine_key``.
Saving holds an fcntl lock on ``.profiles.json.lock`` for its read-modify-write and replaces the file atomically.
Entries that do not parse are dropped (measured again). A file that looks like a store (JSON object text
mentioning "profiles" or "schema_version") but does not parse is damaged: ignored with a warning and moved aside to
``profiles.json.corrupt`` (``.corrupt.1``, ...) by the next save. Anything else is never written over.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import fcntl
import itertools
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import platformdirs

from ft_jax import units, weight_formats
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
from ft_jax.offload.banks import ExpertBanks
from ft_jax.offload.cost_model import PRESETS, CostModel, fraction_from_bandwidth, parse_bandwidth
from ft_jax.offload.policy import Policy, PolicyKind, parse_policy
from ft_jax.cache_dirs import folder_problem, output_file_problem, replace_file
from ft_jax.weight_formats import WeightFormat

GB = 1e9  # bandwidths are GB/s = 1e9 bytes/s
KEY_FIELDS = ("platform", "device_kind", "cpu_model", "cpu_count", "dtype", "expert_bytes")
MODES = {"quick": {"repeats": 3, "min_time": 0.04, "call_bytes": 16 << 20},
         "full": {"repeats": 7, "min_time": 0.25, "call_bytes": 64 << 20}}


class NotAStoreError(OSError):
    """The profile path exists but is not an ft_jax profile store (a directory, a FIFO, unreadable, other content)."""


def dtype_name(dtype: Any) -> str:
    """"bfloat16" or "float32" for "bf16"/"bfloat16"/"f32"/"float32" (any case) or a numpy/jax dtype.

    Raises ValueError for any other dtype."""
    name = dtype.lower() if isinstance(dtype, str) else np.dtype(dtype).name
    name = {"bf16": "bfloat16", "f32": "float32"}.get(name, name)
    if name not in ("bfloat16", "float32"):
        raise ValueError(f"expert dtype: expected bf16, bfloat16, f32 or float32, got {dtype!r}")
    return name


def weight_format(dtype: Any, fmt: WeightFormat | None = None) -> WeightFormat:
    """``fmt``, or the float format (F32 / BF16) of ``dtype`` (dtype_name's spellings). Raises ValueError."""
    return fmt if fmt is not None else weight_formats.float_format(
        {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype_name(dtype)])


def format_key(dtype: Any, fmt: WeightFormat | None = None) -> str:
    """The "dtype" field of a store key: the float dtype name ("bfloat16", "float32"), or a quantized format's name
    ("q8_0", "q4_0", "q4_0x16", "mxfp4"; "fp8_128x128" with its block shape)."""
    f = weight_format(dtype, fmt)
    if not f.quantized:
        return dtype_name(dtype)
    return f"fp8_{f.block[0]}x{f.block[1]}" if f.name == "fp8" else f.kernel_name


def expert_nbytes(hidden_size: int, intermediate_size: int, dtype: Any, fmt: WeightFormat | None = None) -> int:
    """Stored bytes of one expert's weights: gate_up [2I, H] + down [H, I] in ``fmt`` (data plus scales,
    weight_formats.expert_rows; default the float format of ``dtype``: 3 * H * I * 2 for bfloat16, 4 for float32).
    Biases are not counted (ExpertBanks.expert_bytes adds them for a loaded model)."""
    rows = weight_formats.expert_rows(weight_format(dtype, fmt), int(hidden_size), int(intermediate_size))
    return sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in rows.values())


def cpuinfo(*names: str) -> list[tuple[str, str]]:
    """The first non-empty value in /proc/cpuinfo of each field in ``names`` (the first processor's, or a field of its
    own block such as ARM boards' "Model"), as (name, value) in the file's order; [] where there is no such file."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name, value = name.strip(), value.strip()
                if name in names and value and name not in found:
                    found[name] = value
    except OSError:
        return []
    return list(found.items())


def machine_key(dtype: Any, expert_bytes: int, fmt: WeightFormat | None = None) -> dict[str, Any]:
    """Store key of this process: the first jax device's platform and device_kind, the host CPU model (first "model
    name" of /proc/cpuinfo, else platform.processor()), os.cpu_count(), the expert weight format (format_key: the
    float dtype name or the quantized format's name) and the stored bytes per expert."""
    cpu = next((value for _, value in cpuinfo("model name", "Model", "cpu model")), "")
    device = jax.devices()[0]
    return {"platform": str(device.platform), "device_kind": str(device.device_kind),
            "cpu_model": cpu or platform.processor() or platform.machine() or "unknown",
            "cpu_count": int(os.cpu_count() or 1), "dtype": format_key(dtype, fmt), "expert_bytes": int(expert_bytes)}


def describe_machine(key: dict[str, Any]) -> str:
    """E.g. "cpu/cpu, host CPU 'AMD EPYC' x 2" (the machine fields of a key)."""
    return f"{key['platform']}/{key['device_kind']}, host CPU {key['cpu_model']!r} x {key['cpu_count']}"


@dataclasses.dataclass
class Profile:
    """One bandwidth profile; bandwidths in GB/s, medians over ``repeats`` timed windows, > 0.

    key: machine_key; bp, bh: slot fill / host expert GEMV alone; bp_contended, bh_contended: the same while both
    run (None in stores written without the pair); spreads: {"bp": [min, max], ...}; measured_at: ISO 8601 UTC;
    details: working_set_bytes, llc_bytes, experts_per_call, seconds, load_average_1m, jax_version.
    call_ms: the cost of one call inside a compiled step, ms (Bench.call_costs; None in stores written before them):
    "fill" (slot_fill with nothing to copy), "host" (host_experts with no route), "slot" (slot_experts with no
    route) and "slot_route" (slot_experts with one route). fixed_costs() turns them into the cost model's terms.
    """

    key: dict[str, Any]
    bp: float
    bh: float
    bp_contended: float | None
    bh_contended: float | None
    spreads: dict[str, list[float]]
    repeats: int
    quick: bool
    measured_at: str
    hidden_size: int
    intermediate_size: int
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    call_ms: dict[str, float] | None = None

    def fraction(self) -> float:
        """Fetch fraction q*/m, ``policy.fraction_from_bandwidth``: BPc / (BPc + BHc) with the contended pair, else
        min(1, BP / BH). Raises ValueError for a bandwidth that is not a positive finite number."""
        return float(fraction_from_bandwidth(self.bp, self.bh, self.bp_contended, self.bh_contended))

    def fixed_costs(self) -> dict[str, float]:
        """The cost model's per-layer terms from call_ms (cost_model.CostModel; {} without call_ms):
        fill_fixed_ms = the slot_fill call, host_fixed_ms = the host_experts call, device_fixed_ms = the slot_experts
        call (each with nothing to do: what a layer pays for the call itself).

        No device bandwidth: on a CPU device the slot experts are the host GEMV kernel on the same cores reading a
        copy in the same memory, so the cost model takes BH for them (CostModel.from_spec). slot_route is not turned
        into a rate: its one route reads the same slot in every call of the loop, so a small expert is timed from
        the cache (a trial's quick profile on the bundled model: 15 GB/s against a BH of 7.8, which made `ft-jax
        plan` recommend resident slots on a CPU)."""
        if not self.call_ms:
            return {}
        c = self.call_ms
        return {"fill_fixed_ms": c["fill"], "host_fixed_ms": c["host"], "device_fixed_ms": c["slot"]}

    def summary(self) -> str:
        """One line: BP, BH, the contended pair, the fetch fraction and (when measured) the per-call costs."""
        pair = (f", contended BP {self.bp_contended:.2f} / BH {self.bh_contended:.2f} GB/s"
                if self.bp_contended is not None else "")
        calls = ""
        if self.call_ms:
            c = self.call_ms
            calls = (f"; per call: fill {c['fill']:.3f}, host {c['host']:.3f}, slot {c['slot']:.3f}, slot with one "
                     f"route {c['slot_route']:.3f} ms")
        return f"BP {self.bp:.2f} GB/s, BH {self.bh:.2f} GB/s{pair}, fetch fraction {self.fraction():.3f}{calls}"


# --- Measuring harness (also used by scripts/bench_ffi.py) -----------------------------------------------------------


def last_level_cache_bytes() -> int:
    """Largest data/unified cache of cpu0 (/sys/devices/system/cpu/cpu0/cache/index*/{type,size}), else 32 MiB."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (entry / "type").read_text().strip() != "Instruction":
                text = (entry / "size").read_text().strip().upper()  # e.g. "32768K"
                sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


# A bank value of each dtype for the timed banks (any finite value times the same; the kernels' speed does not depend
# on the values): data and scales of every format.
_BENCH_VALUES = {"float32": 0.01, "bfloat16": 0.01, "float16": 0.01, "float8_e4m3fn": 0.01, "int8": 1,
                 "uint8": 0x77}


class Bench:
    """Host banks, slot arrays and the jitted production FFI calls at one expert size (H, I, weight format).

    The banks hold 2R experts (rows [0, R) feed the fill, [R, 2R) the GEMV), the slots S = R (one pool per bank:
    gate_up [S, 2I, H], down [S, H, I] as stored, and a quantized format's two scale pools). Call j of a loop uses
    rows (j*n + i) mod R (and slots), i < n = ceil(call_bytes / expert_bytes), R = max(n, ceil(2 * LLC /
    expert_bytes), 2). ``fill()`` / ``gemv()`` run the next call and block; ``gemv`` routes ``tokens`` tokens
    (x f32[T, H]) to the same n experts. Attributes: expert_bytes (stored bytes, expert_nbytes), fmt, n, nbytes
    (bytes per call = n * expert_bytes), rows (R), llc_bytes, banks (ExpertBanks), gate_up, down (HostBank),
    fill_rows, gemv_rows (the rotation: np.int32[n] bank rows of call j at j % len; fill_rows are also the slots).

    model_banks: a loaded model's ExpertBanks (of these H, I and format) with at least 2R rows: the timed rows are
    its rows 0 .. 2R - 1 instead of fresh banks, so BH is measured on the memory the engine reads (banks that map the
    checkpoint's page-cache pages, not fresh anonymous huge pages; on the bench model both read alike, DESIGN.md
    sec. 19.6); its bias banks are left out (host_experts is timed without biases either way) and it is not
    released on exit. on_model_banks says which.
    A context manager: leaving it releases the banks it made. Raises ValueError: a size < 1, a bad dtype, H or I that
    does not fit the format's blocks, model_banks of another expert shape or format or with fewer than 2R rows, or
    banks + slots over half the host memory.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: Any = "bfloat16", *,
                 call_bytes: int = 16 << 20, tokens: int = 1, fmt: WeightFormat | None = None,
                 model_banks: ExpertBanks | None = None):
        H, I = int(hidden_size), int(intermediate_size)
        if min(H, I, tokens) < 1:
            raise ValueError(f"bandwidth: H, I and tokens must be >= 1, got H={H}, I={I}, tokens={tokens}")
        self.fmt = fmt = weight_formats.storage_format(weight_format(dtype, fmt), H, I)  # as the model's banks
        self.expert_bytes, self.llc_bytes = eb, llc = expert_nbytes(H, I, dtype, fmt), last_level_cache_bytes()
        self.n, self.rows = n, R = self.rotation_rows(eb, call_bytes, llc)
        self.nbytes, ram = n * eb, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        rows = weight_formats.expert_rows(fmt, H, I)
        self.on_model_banks = model_banks is not None
        if model_banks is not None:
            got = {name: (getattr(model_banks, name, None), shape, dtype) for name, (shape, dtype) in rows.items()}
            if model_banks.format != fmt or any(b is None or b.row_shape != tuple(shape) or b.dtype != dtype
                                                for b, shape, dtype in got.values()):
                raise ValueError(f"bandwidth: the model's banks ({model_banks.format.name}, gate_up rows "
                                 f"{list(model_banks.gate_up.row_shape)}) are not {fmt.name} experts of H={H}, I={I}")
            if model_banks.num_rows < 2 * R:
                raise ValueError(f"bandwidth: the model's banks hold {model_banks.num_rows} experts, the rotation "
                                 f"needs {2 * R}")
            host = {name: bank for name, (bank, _, _) in got.items()}
        else:
            if 3 * R * eb > ram // 2:
                raise ValueError(f"bandwidth: measuring {eb / 2**20:.1f} MiB experts needs {3 * R * eb / 2**20:.0f} "
                                 f"MiB of banks and slots, over half of the {ram / 2**20:.0f} MiB of host memory")
            host = {name: HostBank(2 * R, shape, dtype) for name, (shape, dtype) in rows.items()}
            for bank in host.values():  # touch every page: no first-touch faults while timed
                bank.numpy()[...] = np.asarray(_BENCH_VALUES[bank.dtype.name], bank.dtype)
        self.banks = banks = ExpertBanks(**host, format=fmt)
        self.gate_up, self.down = banks.gate_up, banks.down
        self._slots = tuple(jnp.array(np.zeros(shape, dtype)) for shape, dtype in banks.pool_shapes(R).values())

        def rotation(period: int, offset: int) -> list:  # the distinct calls of (j*n + i) mod period
            return [np.arange(j * n, (j + 1) * n, dtype=np.int32) % period + offset
                    for j in range(period // math.gcd(period, n))]

        self.fill_rows, self.gemv_rows = rotation(R, 0), rotation(R, R)
        self._rows = [jnp.asarray(r) for r in self.fill_rows]  # each i32[n]: bank rows and slots
        self._ids = [jnp.asarray(np.tile(r, (tokens, 1))) for r in self.gemv_rows]  # each i32[T, n]
        self._x = jnp.asarray(np.linspace(-1.0, 1.0, tokens * H, dtype=np.float32).reshape(tokens, H))  # f32[T, H]
        self._w = jnp.full((tokens, n), 1.0 / n, jnp.float32)  # f32[T, n]
        quant = dict(gate_up_scale=banks.gate_up_scale, down_scale=banks.down_scale, weight_format=fmt) \
            if fmt.quantized else {}
        self._fill = jax.jit(lambda slots, rows, dest: ffi_ops.slot_fill(slots, rows, dest, banks.banks),
                             donate_argnums=(0,))
        self._gemv = jax.jit(lambda x, ids, w: ffi_ops.host_experts(x, ids, w, banks.gate_up, banks.down,
                                                                    **quant))  # f32[T, H]
        self._calls = itertools.count(), itertools.count()  # call indices j of fill(), gemv()

    def fill(self) -> None:
        j = next(self._calls[0])
        rows = self._rows[j % len(self._rows)]
        self._slots = self._fill(self._slots, rows, rows)
        for slots in self._slots:
            slots.block_until_ready()

    def gemv(self) -> None:
        j = next(self._calls[1])
        self._gemv(self._x, self._ids[j % len(self._ids)], self._w).block_until_ready()

    def call_costs(self, calls: int = 16, repeats: int = 3) -> dict[str, float]:
        """ms per call of the production handlers inside one compiled loop (jax.lax.fori_loop of ``calls`` calls, so
        no Python dispatch per call: what a decode step pays per MoE layer), the median of ``repeats`` timed runs
        after one warm-up: "fill" (slot_fill whose entries are all -1), "host" (host_experts with no route), "slot"
        (slot_experts with no route), "slot_route" (slot_experts with one route, T = 1). The ids depend on the loop
        index, so XLA cannot hoist a call out of the loop."""
        banks, names = self.banks, self.banks.names
        quant = {"weight_format": banks.format} if banks.quantized else {}
        one = jnp.ones((1, 1), jnp.float32)  # f32[T=1, k=1] combine weight

        def pools_of(slots):
            return dict(zip(names, slots))

        def fill(i, slots, x):
            ids = jnp.where(i < 0, i, -1).astype(jnp.int32).reshape(1)  # i32[1], always -1
            return ffi_ops.slot_fill(slots, ids, ids, banks.banks), x

        def host(i, slots, x):
            ids = jnp.where(i < 0, i, -1).astype(jnp.int32).reshape(1, 1)  # i32[1, 1], no route
            extra = {name: getattr(banks, name) for name in names[2:]}
            y = ffi_ops.host_experts(x, ids, one, banks.gate_up, banks.down, **extra, **quant)
            return slots, x + 1e-30 * y

        def slot(route):
            def call(i, slots, x):
                ids = (i % self.rows if route else jnp.where(i < 0, i, -1)).astype(jnp.int32).reshape(1, 1)
                pools = pools_of(slots)
                extra = {f"{name}_slots": pools[name] for name in names[2:]}
                y = ffi_ops.slot_experts(x, ids, one, pools["gate_up"], pools["down"], **extra, **quant)
                return slots, x + 1e-30 * y
            return call

        def looped(body):
            def run(slots, x):
                return jax.lax.fori_loop(0, calls, lambda i, c: body(i, *c), (slots, x))
            return jax.jit(run, donate_argnums=0)

        x = self._x[:1]  # f32[1, H]
        out = {}
        for name, body in (("fill", fill), ("host", host), ("slot", slot(False)), ("slot_route", slot(True))):
            run, times = looped(body), []
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                self._slots, y = run(self._slots, x)
                jax.block_until_ready((self._slots, y))
                if r:  # the first run compiles
                    times.append((time.perf_counter() - t0) / calls * 1e3)
            out[name] = statistics.median(times)
        return out

    def __enter__(self) -> "Bench":
        return self

    @staticmethod
    def rotation_rows(expert_bytes: int, call_bytes: int, llc_bytes: int) -> tuple[int, int]:
        """(n, R): experts per call, n = ceil(call_bytes / expert_bytes), and rows per rotation, R = max(n,
        ceil(2 * llc_bytes / expert_bytes), 2) rounded up to a multiple of n, so a rotation's rows exceed twice the
        last-level cache and the calls' rows repeat after R / n calls (tiny experts: a few calls of many rows, not
        one distinct call per row)."""
        n = max(1, math.ceil(call_bytes / expert_bytes))
        return n, math.ceil(max(n, math.ceil(2 * llc_bytes / expert_bytes), 2) / n) * n

    def __exit__(self, *exc) -> None:
        self._slots = ()
        if not self.on_model_banks:
            self.banks.release()


def rotatable_banks(model_banks: ExpertBanks | None, hidden_size: int, intermediate_size: int, dtype: Any,
                    call_bytes: int, fmt: WeightFormat | None = None) -> ExpertBanks | None:
    """``model_banks`` if they hold the 2R rows Bench's rotation needs at ``call_bytes`` per call for experts of this
    shape and format (so the timed rows are the engine's own memory), else None (too few rows to rotate past the
    last-level cache: Bench times fresh banks)."""
    if model_banks is None:
        return None
    _, R = Bench.rotation_rows(expert_nbytes(hidden_size, intermediate_size, dtype, fmt), call_bytes,
                               last_level_cache_bytes())
    return model_banks if model_banks.num_rows >= 2 * R else None


def measure_rates(calls: dict[str, tuple[Callable[[], Any], int]], repeats: int,
                  min_time: float) -> dict[str, tuple[float, float, float]]:
    """GB/s {name: (median, min, max)} over ``repeats`` rounds of blocking calls {name: (call, bytes per call)}.

    Each call runs once first (warm-up, compilation); in every round each call in turn runs until ``min_time``
    seconds have passed (at least once), so the variants alternate and see the same machine state."""
    for call, _ in calls.values():
        call()
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (call, nbytes) in calls.items():
            count, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < min_time or count == 0:
                call()
                count += 1
            rates[name].append(count * nbytes / elapsed / GB)
    return {name: (statistics.median(v), min(v), max(v)) for name, v in rates.items()}


def contended_rates(fill: Callable[[], Any], gemv: Callable[[], Any], nbytes: int,
                    window: float) -> tuple[float, float]:
    """(fill GB/s, gemv GB/s) with both loops running at once in two threads for ``window`` seconds.

    The loops start together (a barrier); each counts the calls that ended within its window (at least the first),
    so every counted call overlapped the other loop. ``nbytes`` per call; an exception in a loop is re-raised."""
    barrier = threading.Barrier(2)

    def loop(call: Callable[[], Any]) -> float:
        barrier.wait()
        start, ends = time.perf_counter(), []
        while not ends or ends[-1] < start + window:
            call()
            ends.append(time.perf_counter())
        inside = [t for t in ends if t <= start + window] or ends[:1]
        return len(inside) * nbytes / (inside[-1] - start) / GB

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(loop, fill), pool.submit(loop, gemv)]
        return futures[0].result(), futures[1].result()


def measure_profile(hidden_size: int, intermediate_size: int, dtype: Any = "bfloat16", *, quick: bool = False,
                    repeats: int | None = None, progress: bool = False, fmt: WeightFormat | None = None,
                    model_banks: ExpertBanks | None = None) -> Profile:
    """Measure BP, BH, the contended pair and the per-call costs (Bench.call_costs) at expert size (H, I, dtype) on
    the default jax device, with the experts in weight format ``fmt`` (default the float format of dtype; a
    quantized format: its stored bytes, read by the kernels that dequantize them).

    quick: MODES["quick"] (a few seconds) instead of MODES["full"]; repeats: timed windows per bandwidth (default
    the mode's), >= 1; progress: show the stage on stderr when it is a terminal; model_banks: a loaded model's
    ExpertBanks of this expert shape and format, timed instead of fresh banks when they hold the rotation's 2R rows
    (Bench), so BH is the rate of the memory the engine reads.
    Returns a Profile keyed by machine_key (details["load_average_1m"]: 1-minute load average afterwards;
    details["banks"]: "model" or "fresh", which banks were timed).
    Raises ValueError: bad sizes, dtype or repeats, model_banks of another shape or format, or the working set does
    not fit (Bench).
    """
    fmt = weight_formats.storage_format(weight_format(dtype, fmt), hidden_size, intermediate_size)  # as the banks
    mode = MODES["quick" if quick else "full"]
    repeats = mode["repeats"] if repeats is None else int(repeats)
    if repeats < 1:
        raise ValueError(f"bandwidth: repeats must be >= 1, got {repeats}")

    def stage(text: str) -> None:
        if progress and sys.stderr.isatty():
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()

    t0 = time.perf_counter()
    stage("ft-jax profile: allocating host banks and slots")
    model_banks = rotatable_banks(model_banks, hidden_size, intermediate_size, dtype, mode["call_bytes"], fmt)
    with Bench(hidden_size, intermediate_size, dtype, call_bytes=mode["call_bytes"], fmt=fmt,
               model_banks=model_banks) as b:
        stage("ft-jax profile: slot fill (BP) and host GEMV (BH), each alone")
        rates = measure_rates({"bp": (b.fill, b.nbytes), "bh": (b.gemv, b.nbytes)}, repeats, mode["min_time"])
        window = max(2 * mode["min_time"], 4 * b.nbytes / GB / min(rates["bp"][0], rates["bh"][0]))  # >= ~4 calls
        stage("ft-jax profile: contended pair (both at once)")
        pairs = [contended_rates(b.fill, b.gemv, b.nbytes, window) for _ in range(repeats)]
        stage("ft-jax profile: per-call costs inside a compiled step")
        call_ms = b.call_costs(calls=8 if quick else 32, repeats=repeats)
    stage("")
    for i, name in enumerate(("bp_contended", "bh_contended")):
        values = [pair[i] for pair in pairs]
        rates[name] = (statistics.median(values), min(values), max(values))
    return Profile(
        key=machine_key(dtype, b.expert_bytes, fmt), bp=rates["bp"][0], bh=rates["bh"][0],
        bp_contended=rates["bp_contended"][0], bh_contended=rates["bh_contended"][0],
        spreads={name: [lo, hi] for name, (_, lo, hi) in rates.items()}, repeats=repeats, quick=quick,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hidden_size=int(hidden_size), intermediate_size=int(intermediate_size),
        details={"working_set_bytes": 3 * b.rows * b.expert_bytes, "llc_bytes": b.llc_bytes,
                 "experts_per_call": b.n, "seconds": round(time.perf_counter() - t0, 3),
                 "load_average_1m": round(os.getloadavg()[0], 2), "jax_version": jax.__version__,
                 "banks": "model" if b.on_model_banks else "fresh"},
        call_ms={name: round(ms, 6) for name, ms in call_ms.items()})


# --- Store -----------------------------------------------------------------------------------------------------------


def default_store_path() -> Path:
    """``platformdirs.user_cache_path("ft_jax") / "profiles.json"`` (Linux: $XDG_CACHE_HOME or ~/.cache)."""
    return platformdirs.user_cache_path("ft_jax") / "profiles.json"


def check_store_path(path: str | os.PathLike) -> None:
    """An explicit store path (ft_jax.load(profile=...), generate's --profile) names a file that can be written in a
    folder that exists (cache_dirs.output_file_problem): only the default store's folder (default_store_path) is
    created. Raises ValueError naming the path."""
    problem = output_file_problem(path)
    if problem:
        raise ValueError(f"{os.fspath(path)}: {problem}")


def read_profiles(path: str | os.PathLike | None = None) -> tuple[list[Profile], str]:
    """(every entry of the store that parses, "" or why the whole file is damaged); a missing file gives ([], "").

    An empty file counts as damaged (what a crash can leave). Raises NotAStoreError: the path is not a regular
    file, not UTF-8 text, or text that is not an ft_jax store."""
    path = Path(path) if path is not None else default_store_path()
    if not os.path.lexists(path):
        return [], ""
    not_ours = f"{path} is not an ft_jax bandwidth profile store"
    if not path.is_file():
        raise NotAStoreError(f"{not_ours} (not a regular file)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NotAStoreError(f"{not_ours} ({getattr(e, 'strerror', None) or 'not UTF-8 text'})") from None
    if text.strip() and not (text.lstrip().startswith("{") and ('"profiles"' in text or '"schema_version"' in text)):
        raise NotAStoreError(f"{not_ours} (no 'schema_version' and 'profiles' fields)")
    try:
        doc = json.loads(text)
        if doc.get("schema_version") != 1 or not isinstance(doc.get("profiles"), list):
            raise ValueError("expected schema_version 1 and a 'profiles' list")
    except ValueError as e:
        return [], f"{path} is a damaged ft_jax bandwidth profile store ({e})"
    profiles = []
    for entry in doc["profiles"]:
        try:
            profile = Profile(**entry)
            profile.fraction()  # ValueError unless every bandwidth is a positive finite number
            if sorted(profile.key) == sorted(KEY_FIELDS):
                profiles.append(profile)
        except (TypeError, ValueError):
            continue  # a cache entry that does not parse: measured again
    return profiles, ""


def save_profile(profile: Profile, path: str | os.PathLike | None = None) -> tuple[Path, str]:
    """Store ``profile`` in place of the entry with its key; returns (the path written, "" or a note such as
    " (moved the damaged store to PATH.corrupt)": a damaged store goes to .corrupt, .corrupt.1, ..., with a warning).

    Under an exclusive fcntl lock on .NAME.lock in the same folder: read, merge, write a temporary file, os.replace
    (readers see the old or the new file). Raises NotAStoreError (the path is left untouched) or OSError."""
    path = Path(path) if path is not None else default_store_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    note = ""
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file closes
        profiles, damaged = read_profiles(path)
        if damaged:
            names = (path.with_name(f"{path.name}.corrupt{f'.{i}' if i else ''}") for i in itertools.count())
            aside = next(p for p in names if not os.path.lexists(p))
            os.rename(path, aside)
            note = f" (moved the damaged store to {aside})"
            warnings.warn(f"{damaged}: moved it to {aside}", stacklevel=2)
        entries = [dataclasses.asdict(p) for p in profiles if p.key != profile.key] + [dataclasses.asdict(profile)]
        replace_file(path, lambda f: json.dump({"schema_version": 1, "profiles": entries}, f, indent=1))
    return path, note


def get_or_measure_profile(hidden_size: int, intermediate_size: int, dtype: Any = "bfloat16", *,
                           allow_measure: bool = True, path: str | os.PathLike | None = None, save: bool = True,
                           progress: bool = False, fmt: WeightFormat | None = None,
                           model_banks: ExpertBanks | None = None) -> tuple[Profile | None, str]:
    """(the profile decoding uses for experts (H, I, dtype; in weight format ``fmt``, default the float format of
    dtype) on this machine, or None; a one-line message).

    1. The stored profile for machine_key (a damaged store or a path that is not a store is ignored with a
    UserWarning; profiles of other machines are ignored and named in the message). 2. Else, if ``allow_measure``,
    a quick profile, saved unless ``save`` is False (a failed save is told in the message; the profile is still
    returned). 3. Else, or if the quick profile fails (ValueError, MemoryError, OSError): None and a UserWarning;
    decoding then uses the fixed-cap 1 policy. ``path``: the store (default default_store_path()); model_banks:
    the loaded model's banks, which the quick profile times when they are large enough (measure_profile).
    """
    fmt = weight_formats.storage_format(weight_format(dtype, fmt), hidden_size, intermediate_size)  # as the banks
    key = machine_key(dtype, expert_nbytes(hidden_size, intermediate_size, dtype, fmt), fmt)
    store = Path(path) if path is not None else default_store_path()
    try:
        profiles, damaged = read_profiles(store)
    except NotAStoreError as e:
        profiles, damaged = [], str(e)
    if damaged:
        warnings.warn(f"{damaged}; ignoring it", stacklevel=2)
    found = [p for p in profiles if p.key == key]
    if found:
        return found[-1], (f"using the bandwidth profile stored in {store} (measured {found[-1].measured_at}): "
                           f"{found[-1].summary()}")
    notes = [f"{damaged}; ignoring it"] if damaged else []
    notes.append(f"no bandwidth profile of this machine for {key['dtype']} experts of "
                 f"{units.format_bytes(key['expert_bytes'])} in {store}")
    others = sorted({describe_machine(p.key) for p in profiles} - {describe_machine(key)})
    if others:
        notes.append(f"ignoring the profiles of another machine ({'; '.join(others)}); this is {describe_machine(key)}")
    why = "; ".join(notes)
    if not allow_measure:
        msg = f"{why}; measuring is off: falling back to the fixed-cap 1 policy (run `ft-jax profile` to measure)"
        warnings.warn(msg, stacklevel=2)
        return None, msg
    try:
        profile = measure_profile(hidden_size, intermediate_size, dtype, quick=True, progress=progress, fmt=fmt,
                                  model_banks=model_banks)
    except (ValueError, MemoryError, OSError) as e:
        msg = f"{why}; the quick bandwidth profile failed ({e}): falling back to the fixed-cap 1 policy"
        warnings.warn(msg, stacklevel=2)
        return None, msg
    where = ""
    problem = folder_problem(store.parent) if save else None
    if problem is not None:
        where = f", not saved: the profile store is off, {store.parent} cannot be created or written ({problem})"
    elif save:
        try:
            where = ", saved to {}{}".format(*save_profile(profile, store))
        except OSError as e:  # includes NotAStoreError: decoding goes on with the unsaved profile
            where = f", not saved: {e}"
    return profile, (f"{why}; ran a quick bandwidth profile ({profile.details['seconds']:.1f} s{where}): "
                     f"{profile.summary()}; run `ft-jax profile` for a full one")


def stored_profile(expert_bytes: int, dtype: str, path: str | os.PathLike | None = None,
                   fmt: WeightFormat | None = None) -> tuple[Profile, str]:
    """(Profile, how) of this machine from the bandwidth store: the entry for (format_key(dtype, fmt), expert_bytes),
    else this machine's entry with the closest expert size, of the same weight format where there is one. Raises
    ValueError if the store has none of this machine."""
    key = machine_key(dtype, expert_bytes, fmt)
    profiles, damaged = read_profiles(path)
    here = [p for p in profiles if describe_machine(p.key) == describe_machine(key)]
    exact = [p for p in here if p.key == key]
    if exact:
        return exact[-1], f"stored profile for this expert size, measured {exact[-1].measured_at}"
    if not here:
        where = path or default_store_path()
        raise ValueError(f"no bandwidth profile of this machine ({describe_machine(key)}) in {where}"
                         f"{' (' + damaged + ')' if damaged else ''}: run `ft-jax profile` or pass --bandwidth "
                         f"BP,BH or a preset ({', '.join(PRESETS)})")
    same_format = [p for p in here if p.key["dtype"] == key["dtype"]]  # another format's bandwidths differ most
    near = min(same_format or here, key=lambda p: abs(math.log(p.key["expert_bytes"] / expert_bytes)))
    return near, (f"stored profile of this machine at the closest expert size ({near.key['dtype']}, "
                  f"{units.format_bytes(near.key['expert_bytes'])}), measured {near.measured_at}")


def _spec(profile: Profile, source: str) -> dict:
    """A bandwidth spec (cost_model.parse_bandwidth's keys) of a stored profile, with its fixed costs
    (Profile.fixed_costs)."""
    return {"bp": profile.bp, "bh": profile.bh, "bp_contended": profile.bp_contended,
            "bh_contended": profile.bh_contended, "source": source, **profile.fixed_costs()}


def cost_model_for(bandwidth: str, expert_bytes: int, *, dtype: str = "bfloat16", profile_path: str | None = None,
                   device_bandwidth: float | None = None, fill_fixed_ms: float | None = None,
                   host_fixed_ms: float | None = None, device_fixed_ms: float | None = None,
                   fmt: WeightFormat | None = None, shape: tuple[int, int] | None = None) -> CostModel:
    """The CostModel of a --bandwidth spec (cost_model.parse_bandwidth; "stored": stored_profile) at an expert size
    (stored bytes; ``fmt``: the weight format whose stored profile is looked up, default the float one of dtype).

    shape: (H, I) of the model's experts, when known: the stored profile is then looked up under the key that
    ``ft-jax profile`` and generate store it under (get_or_measure_profile: the weights' bytes in the banks' storage
    format, without biases), while ``expert_bytes`` (biases included) prices the experts.
    device_bandwidth and the fixed costs (ms per layer) None: a stored profile's fixed costs (Profile.fixed_costs:
    measured per call) and, for a profile measured on a CPU device, BH as the device bandwidth; else
    ASSUMED_DEVICE_GBPS and 0 (CostModel.from_spec). Raises ValueError (bad spec, no stored profile)."""
    spec = parse_bandwidth(bandwidth)
    platform_name = None
    if spec is None:
        key_bytes = expert_bytes
        if shape is not None:  # as get_or_measure_profile keys it
            fmt = weight_formats.storage_format(weight_format(dtype, fmt), *shape)
            key_bytes = expert_nbytes(*shape, dtype, fmt)
        profile, how = stored_profile(key_bytes, dtype, profile_path, fmt)
        spec, platform_name = _spec(profile, how), profile.key["platform"]
    return CostModel.from_spec(spec, expert_bytes, platform=platform_name, device_bandwidth=device_bandwidth,
                               fill_fixed_ms=fill_fixed_ms, host_fixed_ms=host_fixed_ms,
                               device_fixed_ms=device_fixed_ms)


def resolve_policy(policy, banks: ExpertBanks, hidden_size: int, intermediate_size: int, *,
                   profile: str | os.PathLike | None = None, measure: bool = True,
                   progress: bool = False) -> tuple[Policy, str | None]:
    """The decode Policy bound to this machine's bandwidth profile, and a one-line note.

    auto takes its costs, and a qstar policy without a fraction its fraction, from the stored profile of this machine
    for experts (hidden_size, intermediate_size, the banks' weight format), or a quick profile (stored; timed on
    ``banks`` themselves when they hold enough experts to rotate past the last-level cache), or, with
    measure=False and none stored, falls back to fixed-cap:1 (the note says so). The costs are those of
    CostModel.from_spec at banks.expert_bytes: device bandwidth BH on a CPU device (the slot experts run the host
    kernel), else cost_model.ASSUMED_DEVICE_GBPS. Other policies, and a qstar policy with its fraction, pass through.

    Args:
        policy: a policy name (parse_policy) or a Policy. banks: the loaded ExpertBanks.
        hidden_size, intermediate_size: H and I of one expert (MoEConfig.hidden_size, .moe_intermediate_size).
        profile: the profile store path (default: profiles.json in the user cache directory).
        measure: allow the quick profile. progress: show its progress on stderr.
    Returns:
        (Policy, note or None).
    Raises:
        ValueError: an unknown policy name.
    """
    if not isinstance(policy, Policy):
        policy = parse_policy(policy)
    if policy.kind not in (PolicyKind.QSTAR, PolicyKind.AUTO) or policy.frac is not None:
        return policy, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note says it
        fmt = banks.format if banks.quantized else None  # a quantized format sets the key (format_key), not dtype
        found, note = get_or_measure_profile(hidden_size, intermediate_size, "bfloat16" if fmt else banks.gate_up.dtype,
                                             allow_measure=measure, path=profile, progress=progress, fmt=fmt,
                                             model_banks=banks)
    if found is None:
        return Policy(PolicyKind.FIXED_CAP, cap=1), note
    model = CostModel.from_spec(_spec(found, note), banks.expert_bytes, platform=found.key["platform"])
    if policy.kind is PolicyKind.AUTO:
        return policy.with_costs(model.auto_costs()), note
    return policy.with_frac(model.fraction), note
