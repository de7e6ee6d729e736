"""Bandwidth profiler: measure BP (slot fill) and BH (host expert GEMV) with the production FFI handlers.

docs/DESIGN.md sections 1 and 7. At one expert size (H, I, dtype) this module measures, in GB/s (1e9 bytes/s) of expert
weight bytes:

- BP: ``ffi_ops.slot_fill`` inside ``jax.jit`` with the slot arrays donated (in place), filling the gate_up slots
  [S, 2I, H] and the down slots [S, H, I] from two host banks. Every call copies ``n`` whole experts (both banks);
  bank rows and slots rotate so that the bytes touched between two uses of a row exceed twice the last-level cache.
- BH: ``ffi_ops.host_experts`` inside ``jax.jit`` for one token (x [1, H] float32) routed to ``n`` distinct
  experts (ids [1, n], weights 1/n), rotating over bank rows that are disjoint from the fill rows, with the same
  cache rule. Bytes counted = weights read = n * expert_bytes.
- The contended pair (BPc, BHc): the two loops above run at the same time in two Python threads (each thread
  dispatches its own jitted function and blocks on its result; JAX releases the GIL while a computation runs, so
  the slot fill and the host GEMV execute concurrently, as they do in the offloaded decode step where the fill
  and the host GEMV have no data dependency). Only calls that start and end inside the window where both threads
  were running count. ``details["contended_speedup"]`` records how much the two really overlapped:
  (time the same work takes alone, one after the other) / (wall time together); 1.0 means no overlap, 2.0 a
  perfect overlap with no slowdown.
- Full profiles also time one jitted function holding both calls with no data dependency (plus 9 small
  independent dots, so that XLA:CPU's thunk executor does not take its sequential path for <= 8 thunks) against
  the two alone (``details["jit_overlap_speedup"]``, same meaning): whether XLA itself runs them concurrently
  inside one step. The contended pair is measured with threads rather than inside one jit because XLA:CPU may
  run a step's thunks one after the other (it does for <= 8 thunks), while on an accelerator the fill (device
  copy from mapped host memory) and the host GEMV (CPU worker pool) do run at the same time.
  On the shared 2-core dev machine (jax 0.10.2, load average 8-10 from other jobs, this process getting ~0.4 of
  a core) both overlap figures came out between 0.8 and 1.7 from run to run: no overlap could be shown there.

Each bandwidth is the median over ``repeats`` timed repeats after one warm-up call; every repeat runs calls until
``min_time`` seconds have passed; min and max over the repeats are kept as the spread. A quick profile (3 repeats,
short windows, no jit overlap check) takes about a second or two of measuring on a 2-core CPU plus compilation.

Command line (``ft-jax profile``): see ``build_parser`` / ``main``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fractions
import json
import math
import os
import statistics
import sys
import threading
import time
import warnings
from typing import Any, Callable, Sequence

from ft_jax.tools import profile_store
from ft_jax.tools.profile_store import Profile, ProfileKey

GB = 1e9  # bytes per GB (bandwidths are reported in GB/s = 1e9 bytes/s)
DEFAULT_LLC_BYTES = 32 * 1024 * 1024  # used when /sys does not tell the last-level cache size
FULL_REPEATS = 7
QUICK_REPEATS = 3
FULL_MIN_TIME_S = 0.25  # per timed repeat
QUICK_MIN_TIME_S = 0.04
FULL_CALL_BYTES = 64 * 1024 * 1024  # expert bytes moved per call (at least one expert)
QUICK_CALL_BYTES = 16 * 1024 * 1024
ABOUT_EQUAL_RATIO = 1.1  # recommendation(): BP and BH closer than this factor are "about as fast"
_JIT_CHECK_PADS = 9  # independent small dots in the jit overlap check (see _setup)


# ---------------------------------------------------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------------------------------------------------


def last_level_cache_bytes() -> int:
    """Largest data/unified CPU cache of cpu0 in bytes, from /sys/devices/system/cpu/cpu0/cache/index*/{size,type}.

    Sizes like "32768K" or "8M" are parsed; falls back to 32 MiB when the files are missing or unreadable.
    """
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        entries = os.listdir(base)
    except OSError:
        return DEFAULT_LLC_BYTES
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(base, entry, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or DEFAULT_LLC_BYTES


def default_max_bytes() -> int:
    """Memory budget for the banks + slots: a quarter of physical memory, at most 8 GiB (4 GiB if unknown)."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 4 * 1024**3
    return int(min(phys // 4, 8 * 1024**3))


@dataclasses.dataclass(frozen=True)
class WorkingSet:
    """Rows used by one measurement (all counts in experts; one expert = one gate_up row + one down row).

    region_rows: bank rows per region; the bank holds 2 regions: rows [0, R) feed the fill, [R, 2R) the host GEMV.
    slot_rows: slots S in each slot array.
    per_call: experts moved per call (n), <= region_rows and <= slot_rows.
    expert_bytes: bytes per expert; llc_bytes: last-level cache size used for the sizing.
    """

    region_rows: int
    slot_rows: int
    per_call: int
    expert_bytes: int
    llc_bytes: int

    @property
    def bank_rows(self) -> int:
        return 2 * self.region_rows

    @property
    def total_bytes(self) -> int:
        return (self.bank_rows + self.slot_rows) * self.expert_bytes


def plan_working_set(expert_bytes: int, llc_bytes: int, call_bytes: int, max_bytes: int) -> WorkingSet:
    """Choose row counts so that every region and the slot pool hold >= 2x the last-level cache.

    n = ceil(call_bytes / expert_bytes) experts per call; each region has max(n, ceil(2 * LLC / expert_bytes), 2) rows
    and the slot pool max(n, ceil(2 * LLC / expert_bytes)) slots; if that exceeds ``max_bytes``, the counts shrink
    (keeping >= 2 rows per region and 1 slot) and the profile notes it.

    Raises:
        ValueError: even 5 experts (2 regions of 2 rows + 1 slot) exceed ``max_bytes``.
    """
    if expert_bytes <= 0:
        raise ValueError(f"profiler: expert bytes must be positive, got {expert_bytes}")
    if 5 * expert_bytes > max_bytes:
        raise ValueError(
            f"profiler: one expert is {expert_bytes / 2**20:.1f} MiB; the measurement needs at least 5 experts "
            f"({5 * expert_bytes / 2**20:.1f} MiB) but the memory budget is {max_bytes / 2**20:.1f} MiB"
        )
    n = max(1, math.ceil(call_bytes / expert_bytes))
    cache_rows = math.ceil(2 * llc_bytes / expert_bytes)
    region = max(n, cache_rows, 2)
    slots = max(n, cache_rows, 1)
    while (2 * region + slots) * expert_bytes > max_bytes:
        region = max(2, region * 3 // 4)
        slots = max(1, slots * 3 // 4)
    n = min(n, region, slots)
    return WorkingSet(region, slots, n, expert_bytes, llc_bytes)


# ---------------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Bench:
    """Banks, slot arrays and the jitted calls of one measurement (built by _setup)."""

    ws: WorkingSet
    fill: Callable[[], None]  # one slot fill call of ws.per_call experts, blocks until done
    slot_pointers: Callable[[], tuple[int, int]]  # buffer addresses of the two slot arrays (in-place check)
    gemv: Callable[[], None]  # one host_experts call over ws.per_call experts, blocks until done
    both: Callable[[], None]  # one jitted call holding both (no data dependency), blocks until done
    release: Callable[[], None]


def _setup(hidden_size: int, intermediate_size: int, dtype: str, ws: WorkingSet) -> _Bench:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ft_jax.offload import ffi_ops
    from ft_jax.offload.host_bank import HostBank

    H, I = hidden_size, intermediate_size
    np_dtype = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    gate_up = HostBank(ws.bank_rows, (2 * I, H), np_dtype)
    down = HostBank(ws.bank_rows, (H, I), np_dtype)
    # Touch every page (first-touch page faults must not be timed); small values keep the GEMV finite.
    gate_up.numpy()[...] = np.asarray(0.01, dtype=np_dtype)
    down.numpy()[...] = np.asarray(0.01, dtype=np_dtype)
    # Slot arrays copied from numpy zeros (no compilation, unlike jnp.zeros; the copy touches every page).
    state = {
        "gu": jnp.array(np.zeros((ws.slot_rows, 2 * I, H), np_dtype)),  # [S, 2I, H]
        "dn": jnp.array(np.zeros((ws.slot_rows, H, I), np_dtype)),  # [S, H, I]
    }
    n, R, S = ws.per_call, ws.region_rows, ws.slot_rows

    # Rotation: call j uses bank rows (j*n + i) mod R of its region and slots (j*n + i) mod S, i < n.
    def rotation(period_rows: int, offset: int) -> list:
        calls = math.ceil(period_rows / n)
        return [jnp.asarray([offset + (j * n + i) % period_rows for i in range(n)], jnp.int32) for j in range(calls)]

    fill_rows = rotation(R, 0)  # each i32[n]
    fill_slots = rotation(S, 0)  # each i32[n]
    gemv_rows = [r.reshape(1, n) for r in rotation(R, R)]  # each i32[1, n], region 2
    x = jnp.asarray(np.linspace(-1.0, 1.0, H, dtype=np.float32).reshape(1, H))  # f32[1, H]
    w = jnp.full((1, n), 1.0 / n, jnp.float32)  # f32[1, n]

    def fill_fn(gu, dn, flat_ids, slot_ids):
        return (ffi_ops.slot_fill(gu, flat_ids, slot_ids, gate_up), ffi_ops.slot_fill(dn, flat_ids, slot_ids, down))

    def gemv_fn(x, ids, w):
        return ffi_ops.host_experts(x, ids, w, gate_up, down)  # f32[1, H]

    # XLA:CPU runs an executable with <= 8 thunks sequentially (ThunkExecutor::Options
    # execute_sequential_num_thunks_threshold); independent small dots ([64, 64] f32, over the 512-byte
    # small-buffer threshold) lift the check's thunk count above that, as in a real decode step.
    pads = [jnp.full((64, 64), 1.0 / (64 * (i + 1)), jnp.float32) for i in range(_JIT_CHECK_PADS)]

    def both_fn(gu, dn, flat_ids, slot_ids, x, ids, w, pads):
        return (*fill_fn(gu, dn, flat_ids, slot_ids), gemv_fn(x, ids, w), [p @ p for p in pads])

    fill_jit = jax.jit(fill_fn, donate_argnums=(0, 1))
    gemv_jit = jax.jit(gemv_fn)
    both_jit = jax.jit(both_fn, donate_argnums=(0, 1))
    counters = {"fill": 0, "gemv": 0, "both": 0}

    def fill():
        j = counters["fill"]
        counters["fill"] = j + 1
        state["gu"], state["dn"] = fill_jit(state["gu"], state["dn"], fill_rows[j % len(fill_rows)],
                                            fill_slots[j % len(fill_slots)])
        jax.block_until_ready((state["gu"], state["dn"]))

    def gemv():
        j = counters["gemv"]
        counters["gemv"] = j + 1
        gemv_jit(x, gemv_rows[j % len(gemv_rows)], w).block_until_ready()

    def both():
        j = counters["both"]
        counters["both"] = j + 1
        gu, dn, y, _ = both_jit(state["gu"], state["dn"], fill_rows[j % len(fill_rows)],
                                fill_slots[j % len(fill_slots)], x, gemv_rows[j % len(gemv_rows)], w, pads)
        state["gu"], state["dn"] = gu, dn
        jax.block_until_ready((gu, dn, y, _))

    def release():
        state.clear()
        gate_up.release()
        down.release()

    def slot_pointers():
        return state["gu"].unsafe_buffer_pointer(), state["dn"].unsafe_buffer_pointer()

    return _Bench(ws, fill, slot_pointers, gemv, both, release)


def _timed_repeat(call: Callable[[], None], min_time: float) -> tuple[float, int]:
    """Run ``call`` until ``min_time`` seconds passed (at least once); returns (seconds, calls)."""
    calls = 0
    t0 = time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            return elapsed, calls


def _contended_repeat(fill: Callable[[], None], gemv: Callable[[], None], window: float,
                      fill_bytes: int, gemv_bytes: int) -> tuple[float, float, float]:
    """Run fill and gemv loops in two threads for ~``window`` s.

    Returns (fill GB/s, gemv GB/s, info): each bandwidth counts only calls that started and ended while both
    threads were running; info = {"fill": (GB/s, calls counted, seconds spanned), "gemv": (...)}.
    """
    stop = threading.Event()
    barrier = threading.Barrier(2)
    records: dict[str, list[tuple[float, float]]] = {"fill": [], "gemv": []}
    errors: list[BaseException] = []

    def loop(name: str, call: Callable[[], None]):
        try:
            barrier.wait()
            while not stop.is_set():
                t0 = time.perf_counter()
                call()
                records[name].append((t0, time.perf_counter()))
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)
            stop.set()
            barrier.abort()

    threads = [threading.Thread(target=loop, args=("fill", fill)), threading.Thread(target=loop, args=("gemv", gemv))]
    for t in threads:
        t.start()
    stop.wait(window)
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    start = max(records["fill"][0][0], records["gemv"][0][0])
    end = min(records["fill"][-1][1], records["gemv"][-1][1])
    result = {}
    for name, nbytes in (("fill", fill_bytes), ("gemv", gemv_bytes)):
        inside = [(a, b) for a, b in records[name] if a >= start and b <= end]
        if not inside:  # one call longer than the overlap: use everything (documented as an approximation)
            inside = records[name]
        span = inside[-1][1] - inside[0][0]
        result[name] = (len(inside) * nbytes / span / GB, len(inside), span)
    return result["fill"][0], result["gemv"][0], result


def _median_spread(values: Sequence[float]) -> tuple[float, tuple[float, float]]:
    return float(statistics.median(values)), (float(min(values)), float(max(values)))


def measure_profile(hidden_size: int, intermediate_size: int, dtype: Any = "bfloat16", *, quick: bool = False,
                    repeats: int | None = None, contended: bool = True, progress: bool = True,
                    max_bytes: int | None = None, call_bytes: int | None = None,
                    min_time: float | None = None) -> Profile:
    """Measure BP, BH and the contended pair at expert size (H, I, dtype) on the default jax device.

    Args:
        hidden_size: H; intermediate_size: I (expert gate/up [I, H], down [H, I]).
        dtype: expert weight dtype, "bfloat16"/"bf16" or "float32"/"f32" (or a numpy/jax dtype).
        quick: a quick profile (3 repeats, 0.04 s windows, no jit overlap check): <= 5 s in total.
        repeats: timed repeats per bandwidth (default 3 quick, 7 full), >= 1.
        contended: also measure the contended pair.
        progress: show a tqdm progress bar on stderr (only when stderr is a terminal).
        max_bytes: memory budget for banks + slots (default: a quarter of RAM, at most 8 GiB).
        call_bytes: expert bytes per call (default 16 MiB quick, 64 MiB full); at least one expert per call.
        min_time: seconds per timed repeat (default 0.04 quick, 0.25 full).
    Returns:
        Profile with bandwidths in GB/s, key = this machine (profile_store.current_key).
    Raises:
        ValueError: bad dimensions, dtype, repeats, or the working set cannot fit ``max_bytes``.
    """
    import jax
    from tqdm import tqdm

    if hidden_size <= 0 or intermediate_size <= 0:
        raise ValueError(f"profiler: hidden_size and intermediate_size must be positive, got "
                         f"H={hidden_size}, I={intermediate_size}")
    dtype = profile_store.dtype_name(dtype)
    repeats = repeats if repeats is not None else (QUICK_REPEATS if quick else FULL_REPEATS)
    if repeats < 1:
        raise ValueError(f"profiler: repeats must be >= 1, got {repeats}")
    min_time = min_time if min_time is not None else (QUICK_MIN_TIME_S if quick else FULL_MIN_TIME_S)
    call_bytes = call_bytes if call_bytes is not None else (QUICK_CALL_BYTES if quick else FULL_CALL_BYTES)
    eb = profile_store.expert_nbytes(hidden_size, intermediate_size, dtype)
    ws = plan_working_set(eb, last_level_cache_bytes(), call_bytes,
                          max_bytes if max_bytes is not None else default_max_bytes())
    key = profile_store.current_key(dtype, eb)
    jit_check = not quick
    total = 1 + 2 * repeats + (repeats if contended else 0) + (repeats if jit_check else 0)
    t_start = time.perf_counter()
    show = progress and sys.stderr.isatty()  # no bar in logs, pipes or captured output
    bar = tqdm(total=total, desc="profile: setup", file=sys.stderr, disable=not show, leave=False, unit="step",
               dynamic_ncols=True)
    bench = _setup(hidden_size, intermediate_size, dtype, ws)
    try:
        call_b = ws.per_call * eb  # bytes per call, both fill and gemv
        bench.fill()  # warm-up (compiles)
        pointers = bench.slot_pointers()
        bench.fill()
        fill_in_place = bench.slot_pointers() == pointers  # a copied slot array would halve the measured BP
        bench.gemv()
        bar.update(1)
        samples: dict[str, list[float]] = {"bp": [], "bh": [], "bp_contended": [], "bh_contended": []}
        call_s = {"fill": [], "gemv": []}
        for name, call, out in (("fill", bench.fill, "bp"), ("gemv", bench.gemv, "bh")):
            bar.set_description(f"profile: {'slot fill (BP)' if name == 'fill' else 'host GEMV (BH)'}")
            for _ in range(repeats):
                seconds, calls = _timed_repeat(call, min_time)
                samples[out].append(calls * call_b / seconds / GB)
                call_s[name].append(seconds / calls)
                bar.update(1)
        details: dict[str, Any] = {
            "bank_rows": ws.bank_rows, "slot_rows": ws.slot_rows, "experts_per_call": ws.per_call,
            "working_set_bytes": ws.total_bytes, "llc_bytes": ws.llc_bytes,
            "region_exceeds_2x_llc": ws.region_rows * eb >= 2 * ws.llc_bytes,
            "min_time_s": min_time, "jax_version": jax.__version__, "fill_in_place": fill_in_place,
            "contention": "two threads, one jitted slot_fill loop and one jitted host_experts loop" if contended
            else "not measured",
        }
        if contended:
            bar.set_description("profile: contended pair")
            window = max(2 * min_time, 4 * max(statistics.median(call_s["fill"]), statistics.median(call_s["gemv"])))
            speedups = []
            for _ in range(repeats):
                bpc, bhc, info = _contended_repeat(bench.fill, bench.gemv, window, call_b, call_b)
                samples["bp_contended"].append(bpc)
                samples["bh_contended"].append(bhc)
                # Same work alone: calls * median standalone call time, for each; together: the overlap span.
                alone = (info["fill"][1] * statistics.median(call_s["fill"])
                         + info["gemv"][1] * statistics.median(call_s["gemv"]))
                speedups.append(alone / max(info["fill"][2], info["gemv"][2]))
                bar.update(1)
            details["contended_speedup"] = float(statistics.median(speedups))
        if jit_check:
            bar.set_description("profile: jit overlap check")
            bench.both()  # compile
            both_s = []
            for _ in range(repeats):
                seconds, calls = _timed_repeat(bench.both, min_time)
                both_s.append(seconds / calls)
                bar.update(1)
            details["jit_overlap_speedup"] = float(
                (statistics.median(call_s["fill"]) + statistics.median(call_s["gemv"])) / statistics.median(both_s))
    finally:
        bar.close()
        bench.release()
    details["seconds"] = round(time.perf_counter() - t_start, 3)
    if hasattr(os, "getloadavg"):
        details["load_average_1m"] = round(os.getloadavg()[0], 2)  # other jobs competing for the CPU skew BH and BP
    from ft_jax import _ffi  # extension internals, recorded when available (not part of the FFI contract)

    for name in ("num_threads", "kernel_isa"):
        if hasattr(_ffi, name):
            details[f"host_{name}"] = getattr(_ffi, name)()
    medians, spreads = {}, {}
    for name, values in samples.items():
        if values:
            medians[name], spreads[name] = _median_spread(values)
    return Profile(
        key=key, bp=medians["bp"], bh=medians["bh"], bp_contended=medians.get("bp_contended"),
        bh_contended=medians.get("bh_contended"), spreads=spreads, repeats=repeats, quick=quick,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        hidden_size=int(hidden_size), intermediate_size=int(intermediate_size), details=details,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Decoding API
# ---------------------------------------------------------------------------------------------------------------------


def get_or_measure_profile(hidden_size: int, intermediate_size: int, dtype: Any = "bfloat16", *,
                           allow_measure: bool = True, path: str | os.PathLike | None = None, save: bool = True,
                           progress: bool = False) -> tuple[Profile | None, str]:
    """The bandwidth profile decoding should use for experts of size (H, I, dtype) on this machine.

    1. A stored profile whose key matches this machine and expert size (profile_store.load_profile) is returned.
    2. Else, if ``allow_measure``: a quick profile (<= 5 s) is measured, saved (unless ``save`` is False) and returned;
       the message says so.
       If it cannot be saved (e.g. ``path`` is not an ft_jax profile file, profile_store.NotAProfileStoreError),
       it is still returned and the message says "not saved" and why.
    3. Else, or if the quick profile fails (ValueError, MemoryError, OSError, e.g. the working set does not fit):
       (None, message) and a ``UserWarning``; decoding then falls back to the fixed-cap 1 policy.

    Args:
        hidden_size, intermediate_size, dtype: the expert size (H, I) and weight dtype of the host banks.
        allow_measure: allow step 2.
        path: profile file (default: profile_store.default_profile_path()).
        save: store a newly measured profile.
        progress: show the quick profile's progress bar on stderr (only when stderr is a terminal).
    Returns:
        (profile or None, a one-line human message for the user).
    """
    eb = profile_store.expert_nbytes(hidden_size, intermediate_size, dtype)
    key = profile_store.current_key(dtype, eb)
    profile, why = profile_store.load_profile(key, path)
    if profile is not None:
        return profile, f"{why}: {summary_line(profile)}"
    if not allow_measure:
        msg = f"{why}; no bandwidth profile and measuring is off: falling back to the fixed-cap 1 policy " \
              f"(run `ft-jax profile` to measure this machine)"
        warnings.warn(msg, stacklevel=2)
        return None, msg
    t0 = time.perf_counter()
    try:
        profile = measure_profile(hidden_size, intermediate_size, dtype, quick=True, progress=progress)
    except (ValueError, MemoryError, OSError) as e:  # e.g. the working set does not fit: decode still runs
        msg = f"{why}; the quick bandwidth profile failed ({e}): falling back to the fixed-cap 1 policy"
        warnings.warn(msg, stacklevel=2)
        return None, msg
    seconds = time.perf_counter() - t0
    where = ""
    if save:
        with warnings.catch_warnings(record=True) as caught:  # e.g. a corrupted file moved aside: part of the message
            warnings.simplefilter("always")
            try:
                where = f", saved to {profile_store.save_profile(profile, path)}"
            except OSError as e:  # includes NotAProfileStoreError: decoding goes on with the unsaved profile
                where = f", not saved: {e}"
        for w in caught:
            where += f" ({w.message})"
            warnings.warn(str(w.message), stacklevel=2)
    return profile, (f"{why}; ran a quick bandwidth profile ({seconds:.1f} s{where}): {summary_line(profile)}; "
                     f"run `ft-jax profile` for a full one")


# ---------------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------------


def summary_line(profile: Profile) -> str:
    """One line: BP, BH, the contended pair if any, and the fraction."""
    s = f"BP {profile.bp:.2f} GB/s, BH {profile.bh:.2f} GB/s"
    if profile.bp_contended is not None and profile.bh_contended is not None:
        s += f", contended BP {profile.bp_contended:.2f} / BH {profile.bh_contended:.2f} GB/s"
    return s + f", fetch fraction {profile.fraction():.3f}"


def q_star_table(frac: float, max_m: int = 8) -> dict[int, int]:
    """{m: q*} for m = 1..max_m, q* = policy.fetch_count_np(m, frac) (misses fetched into slots)."""
    from ft_jax.offload import policy

    return {m: int(policy.fetch_count_np(m, frac)) for m in range(1, max_m + 1)}


def recommendation(profile: Profile) -> str:
    """Plain-language advice, e.g. "the host path is 3.1x faster than the fill: compute about 3 of every 4 misses
    on the CPU (fetch the other 1 into device slots)". Uses the contended pair when present, as fraction() does.
    Bandwidths within a factor ABOUT_EQUAL_RATIO of each other are called "about as fast as" each other."""
    if profile.bp_contended is not None and profile.bh_contended is not None:
        bp, bh, which = profile.bp_contended, profile.bh_contended, "while both run"
    else:
        bp, bh, which = profile.bp, profile.bh, "measured alone"
    frac = profile.fraction()
    host = 1.0 - frac
    if max(bp, bh) / min(bp, bh) < ABOUT_EQUAL_RATIO:
        speed = f"the host path is about as fast as the fill ({which})"
    elif bh > bp:
        speed = f"the host path is {bh / bp:.1f}x faster than the fill ({which})"
    else:
        speed = f"the fill is {bp / bh:.1f}x faster than the host path ({which})"
    share = fractions.Fraction(host).limit_denominator(8)
    if share == 0 or host < 1 / 16:
        return f"{speed}: fetch every miss into device slots (like fetch-all)"
    if share == 1 or host > 15 / 16:
        return f"{speed}: compute every miss on the CPU (like host-all)"
    num, den = share.numerator, share.denominator
    return (f"{speed}: compute about {num} of every {den} misses on the CPU "
            f"(fetch the other {den - num} into device slots)")


def format_report(profile: Profile, saved_to: str | None) -> str:
    """Human-readable report (multi-line) of a profile."""
    k = profile.key

    def line(label: str, name: str) -> str:
        value = getattr(profile, name)
        lo, hi = profile.spreads.get(name, (value, value))
        return f"  {label:<32}{value:8.2f} GB/s   (min {lo:.2f}, max {hi:.2f})"

    frac = profile.fraction()
    lines = [
        f"ft_jax bandwidth profile ({'quick' if profile.quick else 'full'}, {profile.repeats} repeats, median; "
        f"measured in {profile.details.get('seconds', 0):.1f} s; GB/s = 1e9 bytes/s, MiB = 2^20 bytes)",
        f"  device {k.platform}/{k.device_kind}; host CPU {k.cpu_model} x {k.cpu_count} cores"
        + (f"; host GEMV threads {profile.details['host_num_threads']}" if "host_num_threads" in profile.details
           else ""),
        f"  expert H={profile.hidden_size} I={profile.intermediate_size} {k.dtype}: {k.expert_bytes / 2**20:.2f} MiB; "
        f"working set {profile.details.get('working_set_bytes', 0) / 2**20:.0f} MiB "
        f"(last-level cache {profile.details.get('llc_bytes', 0) / 2**20:.0f} MiB)",
        line("BP  slot fill", "bp"),
        line("BH  host expert GEMV", "bh"),
    ]
    if profile.bp_contended is not None:
        lines += [line("BPc slot fill, contended", "bp_contended"), line("BHc host GEMV, contended", "bh_contended")]
        if "contended_speedup" in profile.details:
            lines.append(f"  overlap of the pair (threads): {profile.details['contended_speedup']:.2f}x "
                         f"(1 = none, 2 = perfect)")
        rule = "BPc / (BPc + BHc)"
    else:
        rule = "min(1, BP / BH)"
    if "jit_overlap_speedup" in profile.details:
        lines.append(f"  overlap inside one jitted step: {profile.details['jit_overlap_speedup']:.2f}x")
    load = profile.details.get("load_average_1m")
    if load is not None and load > k.cpu_count:
        lines.append(f"  note: load average {load:.1f} on {k.cpu_count} cores while measuring: other processes "
                     f"competed for the CPU, so these figures may be low and noisy")
    table = q_star_table(frac)
    lines += [
        f"  fetch fraction q*/m = {frac:.3f}  ({rule})",
        "  q* for m = 1..8:  " + "  ".join(f"m={m}:{q}" for m, q in table.items()),
        f"  recommendation: {recommendation(profile)}",
    ]
    lines.append(f"  saved to {saved_to}" if saved_to else "  not saved")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the ``ft-jax profile`` options to ``parser`` (e.g. a subparser) or to a new parser; returns it."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="ft-jax profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="PATH", help="model directory (config.json gives H, I and dtype)")
    parser.add_argument("--hidden-size", type=int, help="expert hidden size H (instead of --model)")
    parser.add_argument("--intermediate-size", type=int, help="expert intermediate size I (instead of --model)")
    parser.add_argument("--dtype", choices=["bfloat16", "bf16", "float32", "f32"],
                        help="expert weight dtype (default: the model's, else bfloat16)")
    parser.add_argument("--quick", action="store_true", help="quick profile (<= 5 s)")
    parser.add_argument("--repeats", type=int, help=f"timed repeats per bandwidth (default {FULL_REPEATS}, "
                                                    f"{QUICK_REPEATS} with --quick)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--profile", metavar="PATH", help="profile file (default: the user cache directory)")
    parser.add_argument("--no-save", action="store_true", help="do not store the profile")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _expert_size(args: argparse.Namespace) -> tuple[int, int, str]:
    """(H, I, dtype name) from --model or from --hidden-size/--intermediate-size (the two sources are exclusive).

    Raises:
        ValueError: neither or both sources given, a dimension < 1, a bad model path, or an unusable config.json
            (config.ConfigError).
    """
    H, I, dtype = args.hidden_size, args.intermediate_size, args.dtype
    for flag, value in (("--hidden-size", H), ("--intermediate-size", I)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.model:
        if H is not None or I is not None:
            raise ValueError("give either --model PATH or --hidden-size and --intermediate-size, not both "
                             "(the expert size comes from the model's config.json)")
        from ft_jax.config import load_config

        cfg = load_config(args.model)
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        # Host banks hold bfloat16 or float32; a float16 checkpoint's experts have bfloat16's size and bandwidth.
        dtype = dtype or {"float16": "bfloat16"}.get(str(cfg.dtype), str(cfg.dtype))
    elif H is None or I is None:
        raise ValueError("give --model PATH, or both --hidden-size and --intermediate-size")
    return int(H), int(I), profile_store.dtype_name(dtype or "bfloat16")


def run(args: argparse.Namespace) -> int:
    """Run ``ft-jax profile`` for parsed ``args`` (see build_parser); returns the exit status.

    0: measured (and saved unless --no-save). 2: bad arguments, a bad --model, or a --profile path that is a
    directory / not an ft_jax profile file (checked before measuring), or the measurement failed. 1: measured and
    printed, but saving failed.
    """
    try:
        H, I, dtype = _expert_size(args)
        if not args.no_save:
            profile_store.check_profile_path(args.profile)  # a bad --profile fails before measuring, not after
        profile = measure_profile(H, I, dtype, quick=args.quick, repeats=args.repeats,
                                  progress=not args.no_progress and not args.json)
    except (ValueError, OSError) as e:
        print(f"ft-jax profile: error: {e}", file=sys.stderr)
        return 2
    saved_to, status = None, 0
    if not args.no_save:
        try:
            saved_to = str(profile_store.save_profile(profile, args.profile))
        except OSError as e:  # the measurement is still printed below
            print(f"ft-jax profile: error: could not save the profile: {e}", file=sys.stderr)
            status = 1
    if args.json:
        frac = profile.fraction()
        print(json.dumps({
            "profile": profile.to_dict(), "fraction": frac,
            "q_star": {str(m): q for m, q in q_star_table(frac).items()},
            "recommendation": recommendation(profile), "saved_to": saved_to,
        }, sort_keys=True))
    else:
        print(format_report(profile, saved_to))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ft-jax profile``: ``argv`` holds the options only (no subcommand name)."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
