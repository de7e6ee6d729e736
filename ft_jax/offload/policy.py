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

POLICY_KINDS = ("qstar", "fetch-all", "host-all", "fixed-cap", "resident")


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


@dataclasses.dataclass(frozen=True)
class Policy:
    """A fetch policy (docs/DESIGN.md sec. 1). Frozen and hashable: pass it as a static argument of jit.

    Attributes:
        kind: "qstar" (F = fetch_count(m, frac)), "fetch-all" (F = m, classic LRU offload), "host-all" (F = 0, cache
            never changes), "fixed-cap" (F = min(m, cap)), "resident" (every expert in a slot, no misses).
        frac: fetch fraction for "qstar" (None until a bandwidth profile supplies it: see with_frac); None otherwise.
        cap: K for "fixed-cap" (>= 0); None otherwise.
    Raises:
        ValueError: unknown kind, or frac/cap missing, out of range, or given for a kind that does not use them.
    """

    kind: str
    frac: float | None = None
    cap: int | None = None

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

    def with_frac(self, frac: float) -> "Policy":
        """The same qstar policy with its fraction set (e.g. from fraction_from_bandwidth).

        Raises:
            ValueError: the policy is not qstar, or frac is outside [0, 1].
        """
        if self.kind != "qstar":
            raise ValueError(f"policy: with_frac applies to qstar only, got kind {self.kind!r}")
        return Policy("qstar", frac=float(frac))

    def __str__(self) -> str:
        if self.kind == "fixed-cap":
            return f"fixed-cap:{self.cap}"
        if self.kind == "qstar" and self.frac is not None:
            return f"qstar:{self.frac:g}"
        return self.kind


def parse_policy(text: str) -> Policy:
    """Parse a policy name: "qstar", "qstar:FRAC", "fetch-all", "host-all", "fixed-cap:K", "resident".

    "qstar" leaves frac None (filled later from a bandwidth profile with Policy.with_frac); "qstar:0.415" fixes it.

    Raises:
        ValueError: unknown name, missing or malformed K / FRAC, K < 0, FRAC outside [0, 1].
    """
    if not isinstance(text, str):
        raise ValueError(f"policy: expected a policy name string, got {type(text).__name__}")
    name, sep, arg = text.strip().partition(":")
    usage = ("expected one of qstar, qstar:FRAC (0..1), fetch-all, host-all, fixed-cap:K (integer >= 0), "
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
    if name in ("fetch-all", "host-all", "resident"):
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
        ValueError: qstar policy without a fraction.
    """
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

