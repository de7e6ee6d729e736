"""Expert fetch policies: how many of a layer's m cache misses are copied into device slots.

The q* policy and its Q16 min-max integer rule are defined in docs/DESIGN.md sec. 1 ("The q* policy (bandwidth-balanced
split)"). Every implementation (this jnp version, the plain Python version and the numpy test reference) follows
the same integer arithmetic, so the split is bit-identical everywhere.

A policy is chosen once, when the decode step is built: `Policy` is a frozen (hashable) dataclass that is passed as a
static argument, and `fetch_budget` picks its branch in Python at trace time. The per-step miss count m is the only
traced input, so a step never retraces because of the policy.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

Q16_ONE = 1 << 16  # fixed-point 1.0 of the Q16 fraction

POLICY_KINDS = ("qstar", "fetch-all", "host-all", "fixed-cap", "resident", "auto")


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


def fetch_count_np(m: int, frac: float) -> int:
    """The Q16 min-max integer rule in plain Python (docs/DESIGN.md sec. 1).

    f = frac_to_q16(frac); lo = (m*f) >> 16; cost(F) = max(F*(2^16 - f), (m - F)*f);
    F = lo if cost(lo) <= cost(lo+1) else lo+1; F = min(F, m).
    Guarantees 0 <= F <= m and |F - frac*m| <= 1; e.g. F(3, 0.415) = 1, F(4, 0.415) = 2.

    Args:
        m: number of misses (>= 0).
        frac: fetch fraction (see frac_to_q16).
    Returns:
        F, the number of misses to fetch into device slots.
    Raises:
        ValueError: m < 0 or frac not finite.
    """
    m = int(m)
    if m < 0:
        raise ValueError(f"policy: miss count m must be >= 0, got {m}")
    f = frac_to_q16(frac)
    lo = (m * f) >> 16

    def cost(n: int) -> int:
        return max(n * (Q16_ONE - f), (m - n) * f)

    count = lo if cost(lo) <= cost(lo + 1) else lo + 1
    return min(count, m)


def fetch_count(m, frac_q16: int):
    """The Q16 min-max integer rule in jnp on a traced miss count (docs/DESIGN.md sec. 1).

    Same arithmetic as fetch_count_np. int32 is exact while m * 2^16 < 2^31, i.e. m < 32768 misses per layer.

    Args:
        m: i32[] number of misses (traced or concrete), 0 <= m < 32768.
        frac_q16: Python int in [0, 65536] from frac_to_q16 (static: baked into the step).
    Returns:
        i32[] F with 0 <= F <= m.
    Raises:
        ValueError: frac_q16 outside [0, 65536] (trace time).
    """
    f = int(frac_q16)
    if not 0 <= f <= Q16_ONE:
        raise ValueError(f"policy: frac_q16 must be in [0, {Q16_ONE}], got {frac_q16}")
    m = jnp.asarray(m, jnp.int32)
    lo = (m * f) >> 16  # i32[]

    def cost(n):
        return jnp.maximum(n * (Q16_ONE - f), (m - n) * f)

    count = jnp.where(cost(lo) <= cost(lo + 1), lo, lo + 1)
    return jnp.minimum(count, m).astype(jnp.int32)


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


# --- The auto policy (docs/policies.md) --------------------------------------------------------------------------------

AUTO_TICKS = 1024  # the largest of the solo per-expert times (fill, host, device) in integer ticks
AUTO_MAX_TICKS = 1 << 20  # cap of any tick value (a contended bandwidth near 0 gives a huge per-expert time)
AUTO_GAIN_CLAMP = 127  # |net hits| of one fill counted at most (keeps the int32 estimator exact, see auto_credit)
AUTO_DECAY_SHIFT = 10  # realized fills decay by 1/1024 per eviction: the estimate spans the last ~1000 evictions
AUTO_PRIOR_HITS = 2  # prior: one pseudo-fill with this many net hits (docs/policies.md: why 2, not more)
AUTO_MAX_FIXED = 1 << 18  # cap of a fixed cost in ticks
AUTO_MAX_CREDIT = 1 << 22  # cap of the reuse credit in ticks (credit * F stays in int32 for F <= 256)


@dataclasses.dataclass(frozen=True)
class AutoCosts:
    """The cost model of docs/policies.md in integer ticks, as the auto policy evaluates it on the device.

    Per expert: fill_solo = S_e/BP, fill_cont = S_e/BPc, host_solo = S_e/BH, host_cont = S_e/BHc,
    device = S_e/BD; per layer in which the path runs: fill_fixed, host_fixed, device_fixed. A tick is
    tick_ms milliseconds, chosen so that max(fill_solo, host_solo, device) = AUTO_TICKS; every value is capped at
    AUTO_MAX_TICKS. Built by auto_costs; frozen and hashable (part of a static Policy).
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

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "tick_ms":
                if not (isinstance(v, float) and math.isfinite(v) and v > 0):
                    raise ValueError(f"policy: AutoCosts.tick_ms must be a positive float, got {v!r}")
            elif not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= AUTO_MAX_TICKS):
                raise ValueError(f"policy: AutoCosts.{f.name} must be an integer in [0, {AUTO_MAX_TICKS}], got {v!r}")
        for name in ("fill_solo", "fill_cont", "host_solo", "host_cont"):
            if getattr(self, name) < 1:
                raise ValueError(f"policy: AutoCosts.{name} must be >= 1 tick, got {getattr(self, name)}")


def auto_costs(expert_bytes: int, bp: float, bh: float, bp_contended: float | None = None,
               bh_contended: float | None = None, device_bandwidth: float | None = None, fill_fixed_ms: float = 0.0,
               host_fixed_ms: float = 0.0, device_fixed_ms: float = 0.0) -> AutoCosts:
    """AutoCosts of an expert size, bandwidths (GB/s = 1e9 B/s) and fixed costs (ms per layer).

    Without a contended pair: BPc = BP, BHc = max(0, BH - BP) (the fill takes its bandwidth out of the host's, as
    in q* = m*BP/BH; docs/DESIGN.md sec. 1). device_bandwidth None: BH (a CPU device: its slot experts run the host
    GEMV kernel in the same memory). Rounding: ticks = max(1, round(ms / tick_ms)) for the bandwidth terms (0 for
    BD = inf is not allowed) capped at AUTO_MAX_TICKS, round(ms / tick_ms) for the fixed costs capped at
    AUTO_MAX_FIXED.

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
        bpc, bhc = bp, max(0.0, bh - bp)
    else:
        bpc, bhc = positive("bp_contended", bp_contended), positive("bh_contended", bh_contended)
    ms = lambda gbps: expert_bytes / (gbps * 1e9) * 1e3 if gbps > 0 else math.inf  # noqa: E731
    tick = max(ms(bp), ms(bh), ms(bd)) / AUTO_TICKS

    def ticks(value_ms, low):
        if not math.isfinite(value_ms):
            return AUTO_MAX_TICKS
        return min(max(low, math.floor(value_ms / tick + 0.5)), AUTO_MAX_TICKS)

    fixed = []
    for name, v in (("fill_fixed_ms", fill_fixed_ms), ("host_fixed_ms", host_fixed_ms),
                    ("device_fixed_ms", device_fixed_ms)):
        v = float(v)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"policy: auto {name} must be a finite time >= 0 ms, got {v!r}")
        fixed.append(min(ticks(v, 0), AUTO_MAX_FIXED))
    return AutoCosts(fill_solo=ticks(ms(bp), 1), fill_cont=ticks(ms(bpc), 1), host_solo=ticks(ms(bh), 1),
                     host_cont=ticks(ms(bhc), 1), device=ticks(ms(bd), 1), fill_fixed=fixed[0],
                     host_fixed=fixed[1], device_fixed=fixed[2], tick_ms=float(tick))


def _part_of(x, num, den):
    """floor(x * num / den) for int32 x >= 0, as (x // den) * num + ((x % den) * num) // den: no int32 overflow for
    den <= AUTO_MAX_TICKS and num <= AUTO_TICKS (num is a solo time, at most AUTO_TICKS by construction)."""
    return (x // den) * num + ((x % den) * num) // den


def auto_layer_ticks(costs: AutoCosts, misses, hits, fetched):
    """Modelled time of one MoE layer in ticks (docs/policies.md), int32, elementwise (jnp).

    With F = fetched, H = misses - F host experts and D = hits + F device experts: if both paths run, the one
    whose contended time is shorter (a = F*fill_cont vs b = H*host_cont; the fill on ties) ends first and the
    other's remaining work runs solo: host end = a + H*host_solo - floor(a*host_solo/host_cont) (or the mirror
    image); else each path takes its solo time. Ends add the path's fixed cost; the device path (D > 0) starts at
    the fill end and takes device_fixed + D*device. Layer time = max(fill end + device time, host end).

    Args:
        costs: AutoCosts (static). misses, hits, fetched: int32 arrays (broadcast), 0 <= fetched <= misses.
    Returns:
        int32 ticks, same shape as the broadcast inputs.
    """
    c = costs
    F = jnp.asarray(fetched, jnp.int32)
    H = jnp.asarray(misses, jnp.int32) - F
    D = jnp.asarray(hits, jnp.int32) + F
    a, b = F * c.fill_cont, H * c.host_cont
    fill_first = a <= b
    both = (F > 0) & (H > 0)
    host_after = a + H * c.host_solo - _part_of(a, c.host_solo, c.host_cont)
    fill_after = b + F * c.fill_solo - _part_of(b, c.fill_solo, c.fill_cont)
    fill_end = jnp.where(both, jnp.where(fill_first, a, fill_after), F * c.fill_solo)
    host_end = jnp.where(both, jnp.where(fill_first, host_after, b), H * c.host_solo)
    fill_end = fill_end + jnp.where(F > 0, c.fill_fixed, 0)
    host_end = host_end + jnp.where(H > 0, c.host_fixed, 0)
    device = jnp.where(D > 0, c.device_fixed + D * c.device, 0)
    return jnp.maximum(fill_end + device, host_end).astype(jnp.int32)


def auto_credit(costs: AutoCosts, misses, hits, realized_gain, realized_fills):
    """Reuse credit of one more fetch, ticks (int32 jnp): the expected net future hits of a fill times what one hit
    saves, taken as what turning one of this layer's misses into a hit would save now:
    max(0, auto_layer_ticks(misses, hits, 0) - auto_layer_ticks(misses - 1, hits + 1, 0)) (on a GPU about one host
    GEMV; on a CPU device, whose slot experts run beside the host path, what the parallel path takes off the
    slower one).

    Net hits per fill (Q4, 1/16 hit): g = floor(16 * max(0, realized_gain + 32 * AUTO_PRIOR_HITS) /
    (realized_fills + 32)), from the decayed sums (x32) over the fills evicted so far (the marginal fills: the
    ones the cache gave up) and a prior of one pseudo-fill with AUTO_PRIOR_HITS net hits; credit =
    min((g * saving) >> 4, AUTO_MAX_CREDIT). The sums stay below 32 * 1024 * (AUTO_GAIN_CLAMP + 1): exact in int32.

    Args:
        costs: AutoCosts (static). misses (>= 1 when it matters), hits, realized_gain, realized_fills: int32 scalars.
    Returns:
        i32[] credit >= 0.
    """
    misses = jnp.asarray(misses, jnp.int32)
    hits = jnp.asarray(hits, jnp.int32)
    saving = jnp.maximum(auto_layer_ticks(costs, misses, hits, 0) -
                         auto_layer_ticks(costs, jnp.maximum(misses - 1, 0), hits + jnp.minimum(misses, 1), 0), 0)
    num = jnp.asarray(realized_gain, jnp.int32) + 32 * AUTO_PRIOR_HITS
    den = jnp.asarray(realized_fills, jnp.int32) + 32
    g = jnp.maximum(num, 0) * 16 // den  # i32[] net hits per fill, Q4
    return jnp.minimum((g * saving) >> 4, AUTO_MAX_CREDIT).astype(jnp.int32)


def auto_fetch_count(costs: AutoCosts, misses, hits, cap, credit, max_fetch: int):
    """F of the auto policy for one layer (jnp): argmin over F in [0, cap] of auto_layer_ticks(F) - credit * F,
    the smallest F on ties.

    Args:
        costs: AutoCosts (static). misses m, hits, cap (min(m, evictable slots)), credit: int32 scalars.
        max_fetch: static bound on cap (the plan's P).
    Returns:
        i32[] F, 0 <= F <= cap.
    """
    F = jnp.arange(max_fetch + 1, dtype=jnp.int32)  # i32[P + 1]
    value = auto_layer_ticks(costs, misses, hits, jnp.minimum(F, misses)) - credit * F  # i32[P + 1]
    value = jnp.where(F <= cap, value, jnp.iinfo(jnp.int32).max)
    return jnp.argmin(value).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A fetch policy (docs/DESIGN.md sec. 1). Frozen and hashable: pass it as a static argument of jit.

    Attributes:
        kind: "qstar" (F = fetch_count(m, frac)), "fetch-all" (F = m, classic LRU offload), "host-all" (F = 0, cache
            never changes), "fixed-cap" (F = min(m, cap)), "resident" (every expert in a slot, no misses), "auto"
            (F = auto_fetch_count: the cost model plus the observed reuse of fetched experts; docs/policies.md).
        frac: fetch fraction for "qstar" (None until a bandwidth profile supplies it: see with_frac); None otherwise.
        cap: K for "fixed-cap" (>= 0); None otherwise.
        costs: AutoCosts for "auto" (None until bandwidths supply them: see with_costs); None otherwise.
    Raises:
        ValueError: unknown kind, or frac/cap/costs missing, out of range, or given for a kind that does not use them.
    """

    kind: str
    frac: float | None = None
    cap: int | None = None
    costs: AutoCosts | None = None

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"policy: unknown kind {self.kind!r}; expected one of {', '.join(POLICY_KINDS)}")
        if self.kind == "qstar":
            if self.frac is not None:
                frac = float(self.frac)
                if not (math.isfinite(frac) and 0.0 <= frac <= 1.0):
                    raise ValueError(f"policy: qstar fraction must be in [0, 1], got {self.frac!r}")
        elif self.frac is not None:
            raise ValueError(f"policy: kind {self.kind!r} takes no fraction, got frac={self.frac!r}")
        if self.kind == "fixed-cap":
            if not isinstance(self.cap, int) or isinstance(self.cap, bool) or self.cap < 0:
                raise ValueError(f"policy: fixed-cap needs an integer cap K >= 0, got cap={self.cap!r}")
        elif self.cap is not None:
            raise ValueError(f"policy: kind {self.kind!r} takes no cap, got cap={self.cap!r}")
        if self.kind == "auto":
            if self.costs is not None and not isinstance(self.costs, AutoCosts):
                raise ValueError(f"policy: auto costs must be AutoCosts (see auto_costs), got {self.costs!r}")
        elif self.costs is not None:
            raise ValueError(f"policy: kind {self.kind!r} takes no costs, got costs={self.costs!r}")

    def with_frac(self, frac: float) -> "Policy":
        """The same qstar policy with its fraction set (e.g. from fraction_from_bandwidth).

        Raises:
            ValueError: the policy is not qstar, or frac is outside [0, 1].
        """
        if self.kind != "qstar":
            raise ValueError(f"policy: with_frac applies to qstar only, got kind {self.kind!r}")
        return Policy("qstar", frac=float(frac))

    def with_costs(self, costs: AutoCosts) -> "Policy":
        """The same auto policy with its costs set (e.g. from auto_costs of a bandwidth profile).

        Raises:
            ValueError: the policy is not auto, or costs is not AutoCosts.
        """
        if self.kind != "auto":
            raise ValueError(f"policy: with_costs applies to auto only, got kind {self.kind!r}")
        return Policy("auto", costs=costs)

    def __str__(self) -> str:
        if self.kind == "fixed-cap":
            return f"fixed-cap:{self.cap}"
        if self.kind == "qstar" and self.frac is not None:
            return f"qstar:{self.frac:g}"
        return self.kind


def parse_policy(text: str) -> Policy:
    """Parse a policy name: "qstar", "qstar:FRAC", "fetch-all", "host-all", "fixed-cap:K", "resident", "auto".

    "qstar" leaves frac None (filled later from a bandwidth profile with Policy.with_frac); "qstar:0.415" fixes it.
    "auto" leaves its costs None (Policy.with_costs(auto_costs(...)) of a bandwidth profile).

    Raises:
        ValueError: unknown name, missing or malformed K / FRAC, K < 0, FRAC outside [0, 1].
    """
    if not isinstance(text, str):
        raise ValueError(f"policy: expected a policy name string, got {type(text).__name__}")
    name, sep, arg = text.strip().partition(":")
    usage = ("expected one of auto, qstar, qstar:FRAC (0..1), fetch-all, host-all, fixed-cap:K (integer >= 0), "
             "resident")
    if name == "fixed-cap":
        if not sep:
            raise ValueError(f"policy: {text!r} needs a cap, e.g. fixed-cap:2; {usage}")
        try:
            cap = int(arg)
        except ValueError:
            raise ValueError(f"policy: cap in {text!r} is not an integer; {usage}") from None
        if cap < 0:
            raise ValueError(f"policy: cap in {text!r} must be >= 0; {usage}")
        return Policy("fixed-cap", cap=cap)
    if name == "qstar":
        if not sep:
            return Policy("qstar")
        try:
            frac = float(arg)
        except ValueError:
            raise ValueError(f"policy: fraction in {text!r} is not a number; {usage}") from None
        if not (math.isfinite(frac) and 0.0 <= frac <= 1.0):
            raise ValueError(f"policy: fraction in {text!r} must be in [0, 1]; {usage}")
        return Policy("qstar", frac=frac)
    if name in ("fetch-all", "host-all", "resident", "auto"):
        if sep:
            raise ValueError(f"policy: {name!r} takes no argument, got {text!r}; {usage}")
        return Policy(name)
    raise ValueError(f"policy: unknown policy {text!r}; {usage}")


def fetch_budget(policy: Policy, m):
    """Per-layer fetch budget F(m) for a policy, in jnp (docs/DESIGN.md sec. 1). The branch is chosen in Python.

    qstar: fetch_count(m, frac_to_q16(frac)); fetch-all: m; host-all: 0; fixed-cap K: min(m, K); resident: 0
    (a resident cache has no misses).

    Args:
        policy: a Policy (static).
        m: i32[] miss count (traced or concrete).
    Returns:
        i32[] F with 0 <= F <= m. (plan_layer further caps F by the number of evictable slots.)
    Raises:
        ValueError: qstar policy without a fraction; auto (its F depends on the cache state: plan_layer computes it
            with auto_fetch_count).
    """
    if policy.kind == "auto":
        raise ValueError("policy: auto's fetch count depends on the cache state; plan_layer computes it")
    m = jnp.asarray(m, jnp.int32)
    if policy.kind == "qstar":
        if policy.frac is None:
            raise ValueError("policy: qstar has no fraction yet; set it from a bandwidth profile "
                             "(Policy.with_frac(fraction_from_bandwidth(...))) or use qstar:FRAC")
        return fetch_count(m, frac_to_q16(policy.frac))
    if policy.kind == "fetch-all":
        return m
    if policy.kind == "fixed-cap":
        return jnp.minimum(m, jnp.int32(policy.cap))
    return jnp.zeros((), jnp.int32)  # host-all, resident

