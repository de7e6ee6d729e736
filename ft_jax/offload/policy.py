"""Expert fetch policies: how many of a layer's m cache misses are copied into device slots.

`Policy` (kind: `PolicyKind`) is frozen and hashable: it is a static argument of the compiled step, and
`fetch_split` -- the policy's split of one layer, the one function plan_layer calls -- picks its branch in Python at
trace time: the q* Q16 min-max integer rule (docs/DESIGN.md sec. 1; the same integer arithmetic here in jnp, in
plain Python and in the numpy test reference, so the split is bit-identical everywhere), fetch-all, host-all,
fixed-cap, or auto's argmin of the cost model (ft_jax.offload.cost_model) minus its reuse credit (docs/policies.md).
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp

from ft_jax.offload.cost_model import Q16_ONE, AutoCosts, CostModel, auto_layer_ticks, frac_to_q16



class PolicyKind(str, enum.Enum):
    """The kinds of fetch policy (Policy.kind). str-valued: a kind equals its name ("qstar" == PolicyKind.QSTAR) and
    prints as it (str(PolicyKind.FIXED_CAP) == "fixed-cap")."""

    QSTAR = "qstar"  # F = fetch_count(m, frac): the bandwidth-balanced split
    FETCH_ALL = "fetch-all"  # F = m: classic LRU offload
    HOST_ALL = "host-all"  # F = 0: the cache never changes
    FIXED_CAP = "fixed-cap"  # F = min(m, cap)
    RESIDENT = "resident"  # every expert in a slot: no misses
    AUTO = "auto"  # F = auto_fetch_count: cost model + observed reuse

    __str__ = str.__str__

    @property
    def fetches(self) -> bool:
        """False for the kinds that never copy an expert into a slot (host-all, resident)."""
        return self not in (PolicyKind.HOST_ALL, PolicyKind.RESIDENT)


POLICY_KINDS = tuple(k.value for k in PolicyKind)


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


# --- The auto policy (docs/policies.md) --------------------------------------------------------------------------------

AUTO_DECAY_SHIFT = 10  # the reuse sums lose 1/1024 per call with a miss: the estimate spans the last ~1000 such calls
AUTO_PRIOR_HITS = 2  # prior of the reuse estimate: 2 repeat misses per other miss, i.e. 2 hits per fill
AUTO_MAX_HITS = 127  # hits per fill counted at most (keeps the credit exact in int32)
AUTO_MAX_CREDIT = 1 << 22  # cap of the reuse credit in ticks (credit * F stays in int32 for F <= 256)
REUSE_FIELDS = ("repeat_misses", "misses")  # CacheState.reuse, the two decayed sums (x32)
# The candidates auto follows, in the order of LaneState.cost (index = LaneState.leader): host-all (priced from a cold
# cache, without a lane) and the rules of AUTO_LANES, each run in a lane from the real cache's state.
AUTO_CANDIDATES = ("host-all", "fetch-all", "fixed-cap:1", "qstar", "reuse")
AUTO_LANES = AUTO_CANDIDATES[1:]
AUTO_FIRST_LEADER = AUTO_CANDIDATES.index("reuse")  # followed in the first window
AUTO_WINDOW_TOKENS = 128  # decode tokens per window (window = this many calls of every MoE layer)
AUTO_FIRST_CHECK_TOKENS = 16  # in the first window (a cold cache) the leader is also re-chosen every 16 tokens
AUTO_MAX_COST = (1 << 30) - 1  # a candidate's window cost saturates here (ticks)


def auto_reuse_hits(reuse):
    """Hits per fill estimated from the misses (Q4, int32 jnp): a miss is a repeat miss when its expert was active
    since the least recently used slot's last use, i.e. when a fill at its previous activation would still be
    resident under LRU (cache.plan_layer); with p the share of repeat misses, a fill starts a chain of p / (1 - p)
    hits. From the decayed sums (x32) with a prior of AUTO_PRIOR_HITS repeats per other miss:
    min(16 * (repeat_misses + 32 * AUTO_PRIOR_HITS) // (misses - repeat_misses + 32), 16 * AUTO_MAX_HITS).

    Args:
        reuse: i32[2] the decayed sums REUSE_FIELDS (CacheState.reuse).
    Returns:
        i32[] >= 0.
    """
    reuse = jnp.asarray(reuse, jnp.int32)
    rest = jnp.maximum(reuse[1] - reuse[0], 0)
    return jnp.minimum(16 * (reuse[0] + 32 * AUTO_PRIOR_HITS) // (rest + 32), 16 * AUTO_MAX_HITS).astype(jnp.int32)


def auto_credit(costs: AutoCosts, misses, hits, reuse):
    """Reuse credit of one more fetch, ticks (int32 jnp): the estimated hits per fill g = auto_reuse_hits(reuse)
    (Q4) times what one hit saves, taken as what turning one of this layer's misses into a hit would save now:
    saving = max(0, auto_layer_ticks(misses, hits, 0) - auto_layer_ticks(misses - 1, hits + 1, 0)) (on a GPU about
    one host GEMV). credit = min((g * saving) >> 4, AUTO_MAX_CREDIT); g <= 16 * 127 and saving < 2^20 keep the
    product exact in int32.

    Args:
        costs: AutoCosts (static). misses (>= 1 when it matters), hits: int32 scalars.
        reuse: i32[2] the decayed sums REUSE_FIELDS (CacheState.reuse).
    Returns:
        i32[] credit >= 0.
    """
    misses = jnp.asarray(misses, jnp.int32)
    hits = jnp.asarray(hits, jnp.int32)
    saving = jnp.maximum(auto_layer_ticks(costs, misses, hits, 0) -
                         auto_layer_ticks(costs, jnp.maximum(misses - 1, 0), hits + jnp.minimum(misses, 1), 0), 0)
    return jnp.minimum((auto_reuse_hits(reuse) * saving) >> 4, AUTO_MAX_CREDIT).astype(jnp.int32)


def auto_fetch_count(costs: AutoCosts, misses, hits, cap, credit, max_fetch: int):
    """F of the reuse rule for one layer (jnp): argmin over F in [0, cap] of auto_layer_ticks(F) - credit * F,
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


def auto_candidate_counts(costs: AutoCosts, misses, hits, cap, reuse, max_fetch: int):
    """F of every candidate of the auto policy (AUTO_CANDIDATES) for one layer (jnp): host-all 0, fetch-all m,
    fixed-cap:1 min(m, 1), qstar fetch_count(m, costs.qstar_q16), reuse auto_fetch_count with auto_credit; each
    capped by cap.

    Args:
        costs: AutoCosts (static). misses m, hits, cap (evictable slots): int32 scalars. reuse: i32[2] (REUSE_FIELDS).
        max_fetch: static bound on F (the plan's P).
    Returns:
        i32[len(AUTO_CANDIDATES)].
    """
    misses = jnp.asarray(misses, jnp.int32)
    cap = jnp.minimum(jnp.asarray(cap, jnp.int32), misses)
    credit = auto_credit(costs, misses, hits, reuse)
    counts = jnp.stack([jnp.zeros((), jnp.int32), misses, jnp.minimum(misses, 1), fetch_count(misses, costs.qstar_q16),
                        auto_fetch_count(costs, misses, hits, cap, credit, max_fetch)])
    return jnp.minimum(counts, cap)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A fetch policy (docs/DESIGN.md sec. 1). Frozen and hashable: pass it as a static argument of jit.

    Attributes:
        kind: PolicyKind (a name given as str is converted): "qstar" (F = fetch_count(m, frac)), "fetch-all" (F = m, classic LRU offload), "host-all" (F = 0, cache
            never changes), "fixed-cap" (F = min(m, cap)), "resident" (every expert in a slot, no misses), "auto"
            (F = auto_fetch_count: the cost model plus the observed reuse of fetched experts; docs/policies.md).
        frac: fetch fraction for "qstar" (None until a bandwidth profile supplies it: see with_frac); None otherwise.
        cap: K for "fixed-cap" (>= 0); None otherwise.
        costs: AutoCosts for "auto" (None until bandwidths supply them: see with_costs); None otherwise.
    Raises:
        ValueError: unknown kind, or frac/cap/costs missing, out of range, or given for a kind that does not use them.
    """

    kind: PolicyKind
    frac: float | None = None
    cap: int | None = None
    costs: AutoCosts | None = None

    def __post_init__(self):
        try:
            kind = PolicyKind(self.kind)
        except ValueError:
            raise ValueError(f"policy: unknown kind {self.kind!r}; expected one of {', '.join(POLICY_KINDS)}") from None
        object.__setattr__(self, "kind", kind)  # a name given as str becomes the enum member
        name = kind.value
        if kind is PolicyKind.QSTAR:
            if self.frac is not None:
                frac = float(self.frac)
                if not (math.isfinite(frac) and 0.0 <= frac <= 1.0):
                    raise ValueError(f"policy: qstar fraction must be in [0, 1], got {self.frac!r}")
        elif self.frac is not None:
            raise ValueError(f"policy: kind {name!r} takes no fraction, got frac={self.frac!r}")
        if kind is PolicyKind.FIXED_CAP:
            if not isinstance(self.cap, int) or isinstance(self.cap, bool) or self.cap < 0:
                raise ValueError(f"policy: fixed-cap needs an integer cap K >= 0, got cap={self.cap!r}")
        elif self.cap is not None:
            raise ValueError(f"policy: kind {name!r} takes no cap, got cap={self.cap!r}")
        if kind is PolicyKind.AUTO:
            if self.costs is not None and not isinstance(self.costs, AutoCosts):
                raise ValueError(f"policy: auto costs must be AutoCosts (see auto_costs), got {self.costs!r}")
        elif self.costs is not None:
            raise ValueError(f"policy: kind {name!r} takes no costs, got costs={self.costs!r}")

    def with_frac(self, frac: float) -> "Policy":
        """The same qstar policy with its fraction set (e.g. from fraction_from_bandwidth).

        Raises:
            ValueError: the policy is not qstar, or frac is outside [0, 1].
        """
        if self.kind is not PolicyKind.QSTAR:
            raise ValueError(f"policy: with_frac applies to qstar only, got kind {self.kind.value!r}")
        return Policy(PolicyKind.QSTAR, frac=float(frac))

    def with_costs(self, costs: AutoCosts) -> "Policy":
        """The same auto policy with its costs set (e.g. from auto_costs of a bandwidth profile).

        Raises:
            ValueError: the policy is not auto, or costs is not AutoCosts.
        """
        if self.kind is not PolicyKind.AUTO:
            raise ValueError(f"policy: with_costs applies to auto only, got kind {self.kind.value!r}")
        return Policy(PolicyKind.AUTO, costs=costs)

    def __str__(self) -> str:
        if self.kind is PolicyKind.FIXED_CAP:
            return f"fixed-cap:{self.cap}"
        if self.kind is PolicyKind.QSTAR and self.frac is not None:
            return f"qstar:{self.frac:g}"
        return self.kind.value


def parse_policy(text: str) -> Policy:
    """Parse a policy name: "qstar", "qstar:FRAC", "fetch-all", "host-all", "fixed-cap:K", "resident", "auto".

    "qstar" leaves frac None (filled later from a bandwidth profile with Policy.with_frac); "qstar:0.415" fixes it.
    "auto" leaves its costs None (Policy.with_costs(auto_costs(...)) of a bandwidth profile).

    Raises:
        ValueError: unknown name, missing or malformed K / FRAC, K < 0, FRAC outside [0, 1].
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"policy: expected a policy name string, got {type(text).__name__}")
    name, sep, arg = text.strip().partition(":")
    usage = ("expected one of auto, qstar, qstar:FRAC (0..1), fetch-all, host-all, fixed-cap:K (integer >= 0), "
             "resident")
    if name == PolicyKind.FIXED_CAP:
        if not sep:
            raise ValueError(f"policy: {text!r} needs a cap, e.g. fixed-cap:2; {usage}")
        try:
            cap = int(arg)
        except ValueError:
            raise ValueError(f"policy: cap in {text!r} is not an integer; {usage}") from None
        if cap < 0:
            raise ValueError(f"policy: cap in {text!r} must be >= 0; {usage}")
        return Policy(PolicyKind.FIXED_CAP, cap=cap)
    if name == PolicyKind.QSTAR:
        if not sep:
            return Policy(PolicyKind.QSTAR)
        try:
            frac = float(arg)
        except ValueError:
            raise ValueError(f"policy: fraction in {text!r} is not a number; {usage}") from None
        if not (math.isfinite(frac) and 0.0 <= frac <= 1.0):
            raise ValueError(f"policy: fraction in {text!r} must be in [0, 1]; {usage}")
        return Policy(PolicyKind.QSTAR, frac=frac)
    if name in (PolicyKind.FETCH_ALL, PolicyKind.HOST_ALL, PolicyKind.RESIDENT, PolicyKind.AUTO):
        if sep:
            raise ValueError(f"policy: {name!r} takes no argument, got {text!r}; {usage}")
        return Policy(PolicyKind(name))
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
    if policy.kind is PolicyKind.AUTO:
        raise ValueError("policy: auto's fetch count depends on the cache state; fetch_split computes it")
    m = jnp.asarray(m, jnp.int32)
    if policy.kind is PolicyKind.QSTAR:
        if policy.frac is None:
            raise ValueError("policy: qstar has no fraction yet; set it from a bandwidth profile "
                             "(Policy.with_frac(fraction_from_bandwidth(...))) or use qstar:FRAC")
        return fetch_count(m, frac_to_q16(policy.frac))
    if policy.kind is PolicyKind.FETCH_ALL:
        return m
    if policy.kind is PolicyKind.FIXED_CAP:
        return jnp.minimum(m, jnp.int32(policy.cap))
    return jnp.zeros((), jnp.int32)  # host-all, resident



def fetch_split(policy: Policy, misses, hits, cap, reuse, max_fetch: int, leader=None):
    """The policy's split of one MoE layer: F, how many of its m misses are fetched into slots (jnp, traced inputs;
    the branch is chosen in Python from the static policy). The rest of the misses are computed on the host.

    q* / fetch-all / fixed-cap / host-all / resident: min(fetch_budget(policy, m), cap). auto: the F of the
    candidate it follows (auto_candidate_counts[leader]).

    Args:
        policy: a bound Policy (static; qstar with its fraction, auto with its costs).
        misses: i32[] m. hits: i32[] active experts already in a slot. cap: i32[] evictable slots (F <= cap).
        reuse: i32[2] the cache's decayed sums REUSE_FIELDS (CacheState.reuse; auto only).
        max_fetch: static bound on F (the plan's P).
        leader: i32[] auto only: the index into AUTO_CANDIDATES it follows (LaneState.leader).
    Returns:
        i32[] F with 0 <= F <= min(m, cap).
    """
    if policy.kind is PolicyKind.AUTO:
        return auto_candidate_counts(policy.costs, misses, hits, cap, reuse, max_fetch)[leader]
    return jnp.minimum(fetch_budget(policy, misses), cap)


def bind_policy(policy: Policy, model: CostModel) -> Policy:
    """The policy with what it needs from a cost model: qstar without a fraction gets model.fraction, auto without
    costs gets model.auto_costs(); others are returned as they are."""
    if policy.kind is PolicyKind.QSTAR and policy.frac is None:
        return policy.with_frac(model.fraction)
    if policy.kind is PolicyKind.AUTO and policy.costs is None:
        return policy.with_costs(model.auto_costs())
    return policy
