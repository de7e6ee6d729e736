"""The one cost model of an offloaded MoE layer, in two number types: float ms (trace, plan) and int32 ticks (auto).

``layer_time`` is the definition (docs/policies.md; docs/DESIGN.md sec. 12, "offload/cost_model.py"): with F
experts fetched into slots, H computed on the host and D = hits + F on the device, per-expert times fill_solo,
fill_cont, host_solo, host_cont, device and per-layer fixed costs,
  * the fill (F > 0) and the host GEMV (H > 0) start together at the contended times; when one ends, the other goes
    on solo; each path that runs adds its fixed cost;
  * the device path (D > 0) starts when the fill ends and takes device_fixed + D * device;
  * layer time = max(fill end + device time, host end);
  * except on a CPU "device" (``serial``): the slots are host memory and the slot experts, the slot fill and the host
    GEMV run on the same cores and memory bus, so nothing overlaps: layer time = fill + device time + host at the
    solo rates (measured: docs/DESIGN.md sec. 19.5).
``PathCosts`` holds the per-expert times in float ms (CostModel.path_costs); ``AutoCosts`` the same times rounded to
integer ticks (auto_costs, rounding stated there). ``layer_ms`` and ``auto_layer_ticks`` are ``layer_time`` on
each, with the float or the int32 arithmetic (``FLOAT_OPS``, ``TICK_OPS``). Bandwidths GB/s (1e9 B/s), times ms.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from ft_jax import units

GB = 1e9

# Named bandwidth presets: (BP, BH, BPc, BHc) in GB/s and where each figure comes from.
PRESETS = {
    "sapphire-rapids": {
        "bp": 55.0, "bh": 205.0, "bp_contended": None, "bh_contended": None,
        "source": "FreeToken (github.com/FlashML-org/FreeToken), python/freetoken/kernel/csrc/cpu_moe/cpu_moe_ext.cpp: "
                  "Sapphire Rapids 8480+, 13 cores, CPU MoE GEMV ~205 GB/s vs ~55 GB/s PCIe; no contended pair "
                  "published",
    },
    "xeon-6526y": {
        "bp": 25.2, "bh": 65.9, "bp_contended": 14.8, "bh_contended": 71.5,
        "source": "FreeToken PR #38 (github.com/FlashML-org/FreeToken/pull/38), bf16 9.00 MB experts: CPU MoE 65.9, "
                  "PCIe gather 25.2 GB/s alone; overlapped CPU MoE 71.5 + PCIe 14.8 GB/s. The machine (2x Xeon Gold "
                  "6526Y) is named by the same author in PR #71; PR #38's text does not name it",
    },
}
# The presets publish no device-memory bandwidth: an assumed 1000 GB/s (about an RTX 4090's 1008 GB/s; data-center
# GPUs read their memory faster). Also used for a stored GPU profile and for --bandwidth BP,BH unless
# --device-bandwidth is given.
ASSUMED_DEVICE_GBPS = 1000.0

Q16_ONE = 1 << 16  # fixed-point 1.0 of the q* policy's Q16 fraction
AUTO_TICKS = 1024  # the largest of the solo per-expert times (fill, host, device) in integer ticks
AUTO_MAX_TICKS = 1 << 20  # cap of any tick value (a contended bandwidth near 0 gives a huge per-expert time)
AUTO_MAX_FIXED = 1 << 18  # cap of a fixed cost in ticks


# --- The definition ----------------------------------------------------------------------------------------------------


def _part_of(x, num, den):
    """floor(x * num / den) for int32 x >= 0, as (x // den) * num + ((x % den) * num) // den: no int32 overflow for
    den <= AUTO_MAX_TICKS and num <= AUTO_TICKS (num is a solo time, at most AUTO_TICKS by construction)."""
    return (x // den) * num + ((x % den) * num) // den


# The arithmetic of each form: where (select), maximum, part(x, num, den) = x * num / den.
FLOAT_OPS = SimpleNamespace(where=lambda c, x, y: x if c else y, maximum=max, part=lambda x, num, den: x * num / den)
TICK_OPS = SimpleNamespace(where=jnp.where, maximum=jnp.maximum, part=_part_of)


def path_ends(c, fetched, host, ops=FLOAT_OPS):
    """(fill end, host end) of one MoE layer, fixed costs included; a path with no experts ends at 0.

    If both paths run, the one whose contended time is shorter (a = F*fill_cont vs b = H*host_cont; the fill on
    ties) ends first and the other's remaining work runs solo: host end = a + H*host_solo - a*host_solo/host_cont
    (or the mirror image); else each path takes its solo time.

    Args:
        c: PathCosts (float ms, host_cont may be inf) or AutoCosts (int ticks).
        fetched: F; host: H (Python ints for FLOAT_OPS, int32 arrays for TICK_OPS).
        ops: FLOAT_OPS or TICK_OPS (TICK_OPS: floor in part, elementwise selects).
    """
    F, H = fetched, host
    a, b = F * c.fill_cont, H * c.host_cont
    fill_first = a <= b
    both = (F > 0) & (H > 0)
    host_after = a + H * c.host_solo - ops.part(a, c.host_solo, c.host_cont)
    fill_after = b + F * c.fill_solo - ops.part(b, c.fill_solo, c.fill_cont)
    fill_end = ops.where(both, ops.where(fill_first, a, fill_after), F * c.fill_solo)
    host_end = ops.where(both, ops.where(fill_first, host_after, b), H * c.host_solo)
    return fill_end + ops.where(F > 0, c.fill_fixed, 0), host_end + ops.where(H > 0, c.host_fixed, 0)


def layer_time(c, fetched, host, device, ops=FLOAT_OPS):
    """Modelled time of one MoE layer (module docstring) in the unit and number type of the costs ``c``:
    max(fill end + device time, host end), device time = device_fixed + D * device when D = ``device`` > 0; with
    ``c.serial`` (a CPU device) the sum of the three paths at their solo rates.

    Args:
        c, fetched, host, ops: as in path_ends. device: D = hits + F.
    Returns:
        float ms for FLOAT_OPS, ticks (elementwise, the inputs' integer type) for TICK_OPS.
    """
    device_time = ops.where(device > 0, c.device_fixed + device * c.device, 0)
    if c.serial:  # static: one processor runs the fill, the slot experts and the host GEMV one after another
        fill = ops.where(fetched > 0, c.fill_fixed + fetched * c.fill_solo, 0)
        return fill + device_time + ops.where(host > 0, c.host_fixed + host * c.host_solo, 0)
    fill_end, host_end = path_ends(c, fetched, host, ops)
    return ops.maximum(fill_end + device_time, host_end)


@dataclasses.dataclass(frozen=True)
class PathCosts:
    """Per-expert times (ms) of each path and per-layer fixed costs (ms): the float form's costs.

    fill_solo = S_e/BP, fill_cont = S_e/BPc, host_solo = S_e/BH, host_cont = S_e/BHc (inf for BHc = 0),
    device = S_e/BD; fill_fixed, host_fixed, device_fixed; serial: the paths run one after another (a CPU device).
    Built by path_costs.
    """

    fill_solo: float
    fill_cont: float
    host_solo: float
    host_cont: float
    device: float
    fill_fixed: float
    host_fixed: float
    device_fixed: float
    serial: bool = False


def expert_ms(expert_bytes: int, gbps: float) -> float:
    """ms to move one expert of expert_bytes at gbps GB/s; inf for gbps <= 0."""
    return expert_bytes / (gbps * 1e9) * 1e3 if gbps > 0 else math.inf


def contended_pair(bp: float, bh: float, bp_contended: float | None, bh_contended: float | None):
    """(BPc, BHc) GB/s: the measured pair, else (BP, max(0, BH - BP)): the fill takes its bandwidth out of the
    host's, as in q* = m*BP/BH (docs/DESIGN.md sec. 1)."""
    if bp_contended is not None:
        return bp_contended, bh_contended
    return bp, max(0.0, bh - bp)


def path_costs(expert_bytes: int, bp: float, bh: float, bpc: float, bhc: float, bd: float, fill_fixed_ms: float = 0.0,
               host_fixed_ms: float = 0.0, device_fixed_ms: float = 0.0, serial: bool = False) -> PathCosts:
    """PathCosts (ms) of an expert size and the five bandwidths (GB/s; the pair already resolved)."""
    ms = lambda gbps: expert_ms(expert_bytes, gbps)  # noqa: E731
    return PathCosts(ms(bp), ms(bpc), ms(bh), ms(bhc), ms(bd), float(fill_fixed_ms), float(host_fixed_ms),
                     float(device_fixed_ms), bool(serial))


# --- The tick form (the auto policy, on the device) ------------------------------------------------------------------


def frac_to_q16(frac: float) -> int:
    """Q16 fixed-point fraction f = clamp(round(frac * 2^16), 0, 2^16) (docs/DESIGN.md sec. 1).

    round is round-half-up (floor(x + 0.5)), done once in Python so every implementation gets the same f.

    Args:
        frac: fetch fraction, finite (normally 0..1; values outside are clamped).
    Returns:
        int in [0, 65536].
    Raises:
        ValueError: frac is NaN or infinite.
    """
    frac = float(frac)
    if not math.isfinite(frac):
        raise ValueError(f"policy: fetch fraction must be finite, got {frac!r}")
    return min(max(math.floor(frac * Q16_ONE + 0.5), 0), Q16_ONE)


def fraction_from_bandwidth(bp: float, bh: float, bp_contended: float | None = None,
                            bh_contended: float | None = None) -> float:
    """Fetch fraction of the q* policy from measured bandwidths (docs/DESIGN.md sec. 1).

    With a contended pair (slot fill and host GEMV measured running at the same time): frac = BPc / (BPc + BHc).
    Otherwise frac = min(1, BP / BH); BH <= BP means fetch everything (1.0).

    Args:
        bp: slot-fill bandwidth BP (host bank -> device slots), GB/s (any unit, same as bh), > 0.
        bh: host expert GEMV bandwidth BH, same unit, > 0.
        bp_contended, bh_contended: the contended pair BPc, BHc (both or neither), > 0.
    Returns:
        frac in [0, 1].
    Raises:
        ValueError: a bandwidth is not a finite positive number, or only one of the contended pair is given.
    """
    def check(name: str, value) -> float:
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"policy: bandwidth {name} must be a finite positive number, got {value!r}")
        return value

    if (bp_contended is None) != (bh_contended is None):
        raise ValueError("policy: give both bp_contended and bh_contended or neither, got "
                         f"bp_contended={bp_contended!r}, bh_contended={bh_contended!r}")
    if bp_contended is not None:
        bpc = check("bp_contended", bp_contended)
        bhc = check("bh_contended", bh_contended)
        return bpc / (bpc + bhc)
    bp = check("bp", bp)
    bh = check("bh", bh)
    if bh <= bp:
        return 1.0
    return min(1.0, bp / bh)



@dataclasses.dataclass(frozen=True)
class AutoCosts:
    """The cost model of docs/policies.md in integer ticks, as the auto policy evaluates it on the device.

    Per expert: fill_solo = S_e/BP, fill_cont = S_e/BPc, host_solo = S_e/BH, host_cont = S_e/BHc,
    device = S_e/BD; per layer in which the path runs: fill_fixed, host_fixed, device_fixed. A tick is
    tick_ms milliseconds, chosen so that max(fill_solo, host_solo, device) = AUTO_TICKS; every value is capped at
    AUTO_MAX_TICKS. qstar_q16: the q* fraction of the same bandwidths (fraction_from_bandwidth, frac_to_q16), the
    split of auto's qstar candidate. serial: the paths run one after another (a CPU device; layer_time). Built by
    auto_costs; frozen and hashable (part of a static Policy).
    """

    fill_solo: int
    fill_cont: int
    host_solo: int
    host_cont: int
    device: int
    fill_fixed: int
    host_fixed: int
    device_fixed: int
    tick_ms: float
    qstar_q16: int = Q16_ONE
    serial: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "qstar_q16":
                if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= Q16_ONE):
                    raise ValueError(f"policy: AutoCosts.qstar_q16 must be an integer in [0, {Q16_ONE}], got {v!r}")
            elif f.name == "serial":
                if not isinstance(v, bool):
                    raise ValueError(f"policy: AutoCosts.serial must be a bool, got {v!r}")
            elif f.name == "tick_ms":
                if not (isinstance(v, float) and math.isfinite(v) and v > 0):
                    raise ValueError(f"policy: AutoCosts.tick_ms must be a positive float, got {v!r}")
            elif not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= AUTO_MAX_TICKS):
                raise ValueError(f"policy: AutoCosts.{f.name} must be an integer in [0, {AUTO_MAX_TICKS}], got {v!r}")
        for name in ("fill_solo", "fill_cont", "host_solo", "host_cont"):
            if getattr(self, name) < 1:
                raise ValueError(f"policy: AutoCosts.{name} must be >= 1 tick, got {getattr(self, name)}")




def auto_costs(expert_bytes: int, bp: float, bh: float, bp_contended: float | None = None,
               bh_contended: float | None = None, device_bandwidth: float | None = None, fill_fixed_ms: float = 0.0,
               host_fixed_ms: float = 0.0, device_fixed_ms: float = 0.0, serial: bool = False) -> AutoCosts:
    """AutoCosts of an expert size, bandwidths (GB/s = 1e9 B/s) and fixed costs (ms per layer): the PathCosts in ms
    rounded to ticks, and the q* fraction of the bandwidths in Q16 (qstar_q16); serial: a CPU device (layer_time).

    Without a contended pair: contended_pair. device_bandwidth None: BH (a CPU device: its slot experts run the host
    GEMV kernel in the same memory). Rounding: tick_ms = max(fill_solo, host_solo, device) / AUTO_TICKS; ticks =
    max(1, round(ms / tick_ms)) for the per-expert times (inf, i.e. BHc = 0, becomes AUTO_MAX_TICKS) capped at
    AUTO_MAX_TICKS, round(ms / tick_ms) for the fixed costs capped at AUTO_MAX_FIXED (round = half up). So each tick
    value times tick_ms is within tick_ms / 2 of its ms (below the caps, and above the floor of 1 tick).

    Raises:
        ValueError: expert_bytes < 1, a bandwidth not finite and > 0, only one of the pair, a negative fixed cost.
    """
    def positive(name, v):
        v = float(v)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"policy: auto bandwidth {name} must be a finite number > 0 GB/s, got {v!r}")
        return v

    if not (isinstance(expert_bytes, int) and expert_bytes >= 1):
        raise ValueError(f"policy: auto expert_bytes must be an integer >= 1, got {expert_bytes!r}")
    if (bp_contended is None) != (bh_contended is None):
        raise ValueError("policy: give both contended bandwidths or neither")
    bp, bh = positive("bp", bp), positive("bh", bh)
    bd = bh if device_bandwidth is None else positive("device_bandwidth", device_bandwidth)
    if bp_contended is None:
        bpc, bhc = contended_pair(bp, bh, None, None)
    else:
        bpc, bhc = positive("bp_contended", bp_contended), positive("bh_contended", bh_contended)
    for name, v in (("fill_fixed_ms", fill_fixed_ms), ("host_fixed_ms", host_fixed_ms),
                    ("device_fixed_ms", device_fixed_ms)):
        if not (math.isfinite(float(v)) and float(v) >= 0):
            raise ValueError(f"policy: auto {name} must be a finite time >= 0 ms, got {float(v)!r}")
    c = path_costs(expert_bytes, bp, bh, bpc, bhc, bd, fill_fixed_ms, host_fixed_ms, device_fixed_ms)
    tick = max(c.fill_solo, c.host_solo, c.device) / AUTO_TICKS

    def ticks(value_ms, low):
        if not math.isfinite(value_ms):
            return AUTO_MAX_TICKS
        return min(max(low, math.floor(value_ms / tick + 0.5)), AUTO_MAX_TICKS)

    fixed = [min(ticks(v, 0), AUTO_MAX_FIXED) for v in (c.fill_fixed, c.host_fixed, c.device_fixed)]
    q16 = frac_to_q16(fraction_from_bandwidth(bp, bh, bp_contended, bh_contended))
    return AutoCosts(fill_solo=ticks(c.fill_solo, 1), fill_cont=ticks(c.fill_cont, 1), host_solo=ticks(c.host_solo, 1),
                     host_cont=ticks(c.host_cont, 1), device=ticks(c.device, 1), fill_fixed=fixed[0],
                     host_fixed=fixed[1], device_fixed=fixed[2], tick_ms=float(tick), qstar_q16=q16,
                     serial=bool(serial))


def auto_layer_ticks(costs: AutoCosts, misses, hits, fetched):
    """Modelled time of one MoE layer in ticks: layer_time on the AutoCosts with int32 arithmetic (jnp, elementwise;
    the fill's share of the host's time is floored: floor(a*host_solo/host_cont), no int32 overflow).

    Args:
        costs: AutoCosts (static). misses, hits, fetched: int32 arrays (broadcast), 0 <= fetched <= misses.
    Returns:
        int32 ticks, same shape as the broadcast inputs.
    """
    F = jnp.asarray(fetched, jnp.int32)
    H = jnp.asarray(misses, jnp.int32) - F
    D = jnp.asarray(hits, jnp.int32) + F
    return layer_time(costs, F, H, D, TICK_OPS).astype(jnp.int32)


# --- The float form (trace and plan price a replay) ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-MoE-layer time model of the offloaded decode step in float ms (module docstring).

    Attributes:
        expert_bytes: S_e, bytes of one expert (ExpertBanks.expert_bytes of a loaded model).
        bp, bh: slot-fill and host expert GEMV bandwidth, each alone, GB/s (> 0).
        bp_contended, bh_contended: the pair measured running at the same time (both or neither), GB/s.
        device_bandwidth: BD, GB/s at which the device computes the experts in its slots (> 0).
        fill_fixed_ms, host_fixed_ms, device_fixed_ms: c_F, c_H, c_D, fixed cost of each path per layer in which it
            runs (>= 0).
        source: where the bandwidths come from (one line).
        serial_paths: the device is the host CPU (a CPU backend's slots): the paths run one after another
            (layer_time); from_spec sets it for a profile measured on a CPU device.
    Raises:
        ValueError: a bandwidth not finite and > 0 (BHc may be 0), a negative fixed cost, only one of the pair.
    """

    expert_bytes: int
    bp: float
    bh: float
    bp_contended: float | None = None
    bh_contended: float | None = None
    device_bandwidth: float = ASSUMED_DEVICE_GBPS
    fill_fixed_ms: float = 0.0
    host_fixed_ms: float = 0.0
    device_fixed_ms: float = 0.0
    source: str = ""
    serial_paths: bool = False

    def __post_init__(self):
        if not (isinstance(self.expert_bytes, int) and self.expert_bytes >= 1):
            raise ValueError(f"cost model: expert_bytes must be an integer >= 1, got {self.expert_bytes!r}")
        if (self.bp_contended is None) != (self.bh_contended is None):
            raise ValueError("cost model: give both contended bandwidths (BPc, BHc) or neither")
        for name in ("bp", "bh", "device_bandwidth", "bp_contended", "bh_contended"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"cost model: {name} must be a finite bandwidth > 0 GB/s, got {v!r}")
        for name in ("fill_fixed_ms", "host_fixed_ms", "device_fixed_ms"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"cost model: {name} must be a finite time >= 0 ms, got {v!r}")

    @property
    def pair(self) -> tuple[float, float]:
        """(BPc, BHc) GB/s: the measured pair, else (BP, max(0, BH - BP)) (contended_pair)."""
        return contended_pair(self.bp, self.bh, self.bp_contended, self.bh_contended)

    @property
    def fraction(self) -> float:
        """The q* fetch fraction of these bandwidths (fraction_from_bandwidth)."""
        return fraction_from_bandwidth(self.bp, self.bh, self.bp_contended, self.bh_contended)

    def path_costs(self) -> PathCosts:
        """The per-expert and fixed times of this model in ms."""
        return path_costs(self.expert_bytes, self.bp, self.bh, *self.pair, self.device_bandwidth, self.fill_fixed_ms,
                          self.host_fixed_ms, self.device_fixed_ms, self.serial_paths)

    def auto_costs(self) -> AutoCosts:
        """AutoCosts of this model: the auto policy decides with the same costs, rounded to ticks."""
        return auto_costs(self.expert_bytes, self.bp, self.bh, self.bp_contended, self.bh_contended,
                          self.device_bandwidth, self.fill_fixed_ms, self.host_fixed_ms, self.device_fixed_ms,
                          self.serial_paths)

    def paths_ms(self, fetched: int, host: int) -> tuple[float, float]:
        """(fill end, host end) in ms of one layer with `fetched` fills and `host` host experts: layer_time's two
        paths (no device experts). A path with no experts does not run and ends at 0."""
        fill_end, host_end = path_ends(self.path_costs(), int(fetched), int(host))
        return float(fill_end), float(host_end)

    def layer_ms(self, fetched: int, host: int, device: int) -> float:
        """Time of one MoE layer in ms (layer_time in float): max(fill end + device time, host end);
        `device` = hits + fetched."""
        return float(layer_time(self.path_costs(), int(fetched), int(host), int(device)))

    def token_ms(self, stats: np.ndarray) -> np.ndarray:
        """MoE time of every token: f64[N] ms, the sum over layers of layer_ms, from stats i32[N, L, 5] columns
        (active, hits, misses, fetched, host) as replay returns them."""
        stats = np.asarray(stats)
        F, H, D = stats[..., 3], stats[..., 4], stats[..., 1] + stats[..., 3]  # each i32[N, L]
        keys, inverse = np.unique(np.stack([F, H, D], -1).reshape(-1, 3), axis=0, return_inverse=True)
        per = np.array([self.layer_ms(int(f), int(h), int(d)) for f, h, d in keys])  # f64[unique]
        return per[inverse.reshape(-1)].reshape(F.shape).sum(axis=1) if F.size else np.zeros(len(stats))

    def describe(self) -> str:
        """One line: the bandwidths, the device bandwidth and the fixed costs."""
        bpc, bhc = self.pair
        pair = ("contended BPc %.2f / BHc %.2f" % (bpc, bhc) + ("" if self.bp_contended is not None else
                                                                 " (assumed: BP, BH - BP)"))
        return (f"BP {self.bp:.2f}, BH {self.bh:.2f} GB/s, {pair}, device {self.device_bandwidth:.0f} GB/s; fixed "
                f"ms per layer: fill {self.fill_fixed_ms:g}, host {self.host_fixed_ms:g}, device "
                f"{self.device_fixed_ms:g}; S_e {units.format_bytes(self.expert_bytes)}"
                + ("; a CPU device: fill, slot experts and host GEMV one after another" if self.serial_paths else ""))

    @classmethod
    def from_spec(cls, spec: dict, expert_bytes: int, *, platform: str | None = None,
                  device_bandwidth: float | None = None, fill_fixed_ms: float | None = None,
                  host_fixed_ms: float | None = None, device_fixed_ms: float | None = None) -> "CostModel":
        """The CostModel of a bandwidth spec (a preset's dict, parse_bandwidth's, or a stored profile's) at an expert
        size. An argument left None takes the spec's value when it has one (a stored profile's measured fixed costs:
        profile.Profile.fixed_costs), else its default: fixed costs 0, and a device
        bandwidth of BH when the bandwidths were measured on a CPU device (platform "cpu": its slot_experts kernel
        is the host GEMV kernel reading slots in the same memory), else ASSUMED_DEVICE_GBPS. A CPU device's paths
        share its cores: serial_paths."""
        def pick(value, name, default):
            return float(value if value is not None else spec.get(name, default))

        bd = pick(device_bandwidth, "device_bandwidth", spec["bh"] if platform == "cpu" else ASSUMED_DEVICE_GBPS)
        return cls(expert_bytes=int(expert_bytes), bp=spec["bp"], bh=spec["bh"], bp_contended=spec["bp_contended"],
                   bh_contended=spec["bh_contended"], device_bandwidth=bd,
                   fill_fixed_ms=pick(fill_fixed_ms, "fill_fixed_ms", 0.0),
                   host_fixed_ms=pick(host_fixed_ms, "host_fixed_ms", 0.0),
                   device_fixed_ms=pick(device_fixed_ms, "device_fixed_ms", 0.0), source=spec.get("source", ""),
                   serial_paths=platform == "cpu")


# Bandwidths --bandwidth takes, GB/s: 1 kB/s to 1 PB/s (beyond them the ms per token underflow or overflow).
BANDWIDTH_RANGE_GBPS = (1e-6, 1e6)


def parse_bandwidth(spec: str) -> dict | None:
    """--bandwidth: "stored" -> None; a preset name -> its dict; "BP,BH[,BPc,BHc]" GB/s -> a dict like a preset's.

    Raises:
        ValueError: not a preset, not 2 or 4 numbers, or a number outside BANDWIDTH_RANGE_GBPS (NaN too).
    """
    spec = spec.strip()
    if spec == "stored":
        return None
    if spec in PRESETS:
        return dict(PRESETS[spec], name=spec)
    try:
        values = [float(v) for v in spec.split(",")]
    except ValueError:
        values = []
    low, high = BANDWIDTH_RANGE_GBPS
    if len(values) not in (2, 4) or not all(low <= v <= high for v in values):
        raise ValueError(f"--bandwidth {spec!r}: expected 'stored', a preset ({', '.join(PRESETS)}) or BP,BH[,BPc,BHc] "
                         f"in GB/s, each from {low:g} to {high:g}")
    bpc, bhc = (values[2], values[3]) if len(values) == 4 else (None, None)
    return {"bp": values[0], "bh": values[1], "bp_contended": bpc, "bh_contended": bhc,
            "source": f"--bandwidth {spec}", "name": spec}


# --- Prefill: an expert's host time grows with its tokens (issue 20 item 5) ---------------------------------------------

PREFILL_NEVER = 2**31 - 1  # a minimum token count no expert reaches: prefill fetches no miss
# Dense bf16 FLOP/s assumed for a GPU's expert matrix products when none is measured (a consumer GPU's tensor cores
# give ~165 TFLOP/s, a data-center one several hundred): a device expert's time is then its weight read, S_e/BD,
# up to thousands of tokens.
ASSUMED_DEVICE_TFLOPS = 100.0


def expert_flops_per_token(hidden: int, inter: int) -> float:
    """FLOPs one token costs in one expert: 2 * 3 * H * I (the gate, up and down products, a multiply-add = 2)."""
    return 6.0 * hidden * inter


def prefill_expert_ms(c: PathCosts, tokens, host_ms_per_token: float, device_ms_per_token: float):
    """(host ms, fetched ms) of one missed expert routed ``tokens`` tokens in a prefill call, from the decode costs
    c (PathCosts): the host kernel reads the expert once and computes every token (xla_ffi/gemm_bf16.h), so
    host = max(host_solo, tokens * host_ms_per_token); fetched = fill_solo + max(device, tokens *
    device_ms_per_token). A GEMV (one token) costs what decode's model says; many tokens are compute-bound.
    ``tokens``: an int or a numpy array (elementwise)."""
    host = np.maximum(c.host_solo, tokens * host_ms_per_token)
    fetched = c.fill_solo + np.maximum(c.device, tokens * device_ms_per_token)
    return host, fetched


def prefill_fetch_min_tokens(c: PathCosts, host_ms_per_token: float, device_ms_per_token: float,
                             max_tokens: int = 1 << 16) -> int:
    """The prefill split of the cost model: the smallest number of routed tokens from which a missed expert is
    cheaper fetched (fill + device) than computed on the host (prefill_expert_ms), or PREFILL_NEVER when no count
    up to max_tokens is (a CPU device, whose slot experts run the host kernel: the fill only adds its copy).

    Per expert rather than per layer: the prompt's experts have very different token counts, and the choice that
    makes each expert cheapest makes the layer's paths shortest when the fill and host paths do not share a
    bandwidth (a GPU behind PCIe); the policy's cap on fills (free slots) then takes the counted misses in its order.

    Args:
        c: PathCosts (ms). host_ms_per_token, device_ms_per_token: ms one token costs in one expert on each side
            (expert_flops_per_token / FLOP/s), > 0.
    Returns:
        int >= 1, or PREFILL_NEVER.
    Raises:
        ValueError: a per-token time that is not finite and > 0.
    """
    for name, v in (("host_ms_per_token", host_ms_per_token), ("device_ms_per_token", device_ms_per_token)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"cost model: {name} must be a finite time > 0 ms, got {v!r}")
    n = np.arange(1, max_tokens + 1, dtype=np.float64)
    host, fetched = prefill_expert_ms(c, n, host_ms_per_token, device_ms_per_token)
    cheaper = np.flatnonzero(fetched < host)
    return int(n[cheaper[0]]) if cheaper.size else PREFILL_NEVER
