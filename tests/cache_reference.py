"""Plain Python reference of the expert slot cache rules (docs/DESIGN.md sec. 1-3), used by tests only.

Written independently of ft_jax/offload/cache.py and ft_jax/offload/policy.py: Python lists and loops, one fetch and
one victim at a time, its own Q16 integer rule and its own auto rule (docs/policies.md): the auto policy's lanes are
whole copies of the cache (ReferenceCache objects) taken at every window boundary. It reads only the attributes
kind / frac / cap / costs of a policy object (costs: the integer tick fields of AutoCosts and its qstar_q16).
"""

from __future__ import annotations

import math

import numpy as np


def q16_fetch_count(m: int, frac: float) -> int:
    """F for m misses at fraction frac (docs/DESIGN.md sec. 1 integer rule, round half up for the Q16 fraction)."""
    f = math.floor(frac * 65536 + 0.5)
    f = max(0, min(65536, f))
    lo = (m * f) // 65536
    cost_lo = max(lo * (65536 - f), (m - lo) * f)
    cost_hi = max((lo + 1) * (65536 - f), (m - lo - 1) * f)
    if cost_lo <= cost_hi:
        count = lo
    else:
        count = lo + 1
    if count > m:
        count = m
    return count


def ratio_floor(x: int, num: int, den: int) -> int:
    """floor(x * num / den) (Python integers are exact)."""
    return x * num // den


def auto_layer_time(costs, misses: int, hits: int, fetched: int) -> int:
    """Modelled layer time in ticks with F fetched, H = misses - F on the host, D = hits + F on the device."""
    c = costs
    F, H, D = fetched, misses - fetched, hits + fetched
    device = c.device_fixed + D * c.device if D > 0 else 0
    if c.serial:  # a CPU device: the three paths one after another, at their solo rates
        return ((c.fill_fixed + F * c.fill_solo) if F > 0 else 0) + device + (
            (c.host_fixed + H * c.host_solo) if H > 0 else 0)
    if F > 0 and H > 0:
        fill_alone = F * c.fill_cont  # contended duration of the fill
        host_alone = H * c.host_cont
        if fill_alone <= host_alone:  # the fill ends first; the host's remaining work runs solo
            fill_end = fill_alone
            done = ratio_floor(fill_alone, c.host_solo, c.host_cont)  # solo-time of host work done meanwhile
            host_end = fill_alone + (H * c.host_solo - done)
        else:
            host_end = host_alone
            done = ratio_floor(host_alone, c.fill_solo, c.fill_cont)
            fill_end = host_alone + (F * c.fill_solo - done)
    else:
        fill_end = F * c.fill_solo
        host_end = H * c.host_solo
    if F > 0:
        fill_end += c.fill_fixed
    if H > 0:
        host_end += c.host_fixed
    return max(fill_end + device, host_end)


def reuse_hits_q4(repeat_misses: int, seen_misses: int) -> int:
    """Hits per fill from the repeat-miss sums (Q4): p / (1 - p) with a prior of 2 repeats per other miss, <= 127."""
    rest = seen_misses - repeat_misses
    if rest < 0:
        rest = 0
    return min(16 * (repeat_misses + 32 * 2) // (rest + 32), 16 * 127)


def auto_count(costs, misses: int, hits: int, cap: int, repeat_misses: int, seen_misses: int) -> int:
    """The reuse rule's F: the smallest F in [0, cap] minimising layer time - credit * F."""
    if misses > 0:  # what turning one of this layer's misses into a hit would save now
        saving = auto_layer_time(costs, misses, hits, 0) - auto_layer_time(costs, misses - 1, hits + 1, 0)
    else:
        saving = 0
    if saving < 0:
        saving = 0
    credit = min(reuse_hits_q4(repeat_misses, seen_misses) * saving // 16, 1 << 22)
    best, best_value = 0, None
    for F in range(cap + 1):
        value = auto_layer_time(costs, misses, hits, F) - credit * F
        if best_value is None or value < best_value:
            best, best_value = F, value
    return best


# The auto policy's candidates (cost order) and its window: docs/policies.md, "The auto rule".
CANDIDATES = ("host-all", "fetch-all", "fixed-cap:1", "qstar", "reuse")
WINDOW_TOKENS = 128
FIRST_CHECK_TOKENS = 16  # in the first window the leader is also re-chosen every this many tokens


def candidate_count(name: str, costs, misses: int, hits: int, evictable: int, repeat_misses: int,
                    seen_misses: int) -> int:
    """F of one auto candidate, capped by the evictable slots."""
    if name == "host-all":
        count = 0
    elif name == "fetch-all":
        count = misses
    elif name == "fixed-cap:1":
        count = min(misses, 1)
    elif name == "qstar":
        count = q16_fetch_count(misses, costs.qstar_q16 / 65536)
    else:
        count = auto_count(costs, misses, hits, min(misses, evictable), repeat_misses, seen_misses)
    return min(count, evictable)


def policy_budget(policy, m: int) -> int:
    """F(m) before the eligible-slot cap, for a policy with attributes kind / frac / cap."""
    if policy.kind == "qstar":
        return q16_fetch_count(m, policy.frac)
    if policy.kind == "fetch-all":
        return m
    if policy.kind == "fixed-cap":
        return min(m, policy.cap)
    if policy.kind in ("host-all", "resident"):
        return 0
    raise ValueError(f"cache_reference: unknown policy kind {policy.kind!r}")


class ReferenceCache:
    """The cache tables as Python lists; `plan` applies one MoE-layer call.

    resident=True builds the fully resident cache (S = L*E, slot s holds flat id s). auto=True adds the auto
    policy's lanes (one ReferenceCache per candidate after host-all, copied from this one at every window boundary),
    the window's costs and the leader.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int | None = None, resident: bool = False,
                 auto: bool = False):
        self.L = num_layers
        self.E = num_experts
        if resident:
            self.S = num_layers * num_experts
        else:
            self.S = num_slots
        self.slot_of_expert = [[-1] * self.E for _ in range(self.L)]
        self.expert_of_slot = [-1] * self.S
        self.usage = [-1] * self.S
        self.recency = [[-1] * self.E for _ in range(self.L)]
        self.step = 0
        self.stats = [[0] * 6 for _ in range(self.L)]
        self.repeat_misses = 0  # auto: decayed (x32) sums over calls with misses
        self.seen_misses = 0
        self.auto = auto
        if auto:
            self.lanes = [self._copy() for _ in CANDIDATES[1:]]
            self.cost = [0] * len(CANDIDATES)
            self.leader = CANDIDATES.index("reuse")
            self.window_start = 0
            self.window_active = [[False] * self.E for _ in range(self.L)]  # experts active in this window
        if resident:
            for layer in range(self.L):
                for e in range(self.E):
                    flat = layer * self.E + e
                    self.slot_of_expert[layer][e] = flat
                    self.expert_of_slot[flat] = flat

    def _copy(self) -> "ReferenceCache":
        """A lane: a copy of this cache's tables, recency, step and repeat-miss sums (no lanes of its own)."""
        lane = ReferenceCache(self.L, self.E, self.S)
        lane.slot_of_expert = [row[:] for row in self.slot_of_expert]
        lane.expert_of_slot = self.expert_of_slot[:]
        lane.usage = self.usage[:]
        lane.recency = [row[:] for row in self.recency]
        lane.step = self.step
        lane.repeat_misses, lane.seen_misses = self.repeat_misses, self.seen_misses
        return lane

    def _slot_blocked(self, slot: int, layer: int, active: list[bool]) -> bool:
        """True if the slot holds an expert of `layer` that is active now."""
        flat = self.expert_of_slot[slot]
        if flat < 0:
            return False
        owner_layer = flat // self.E
        owner_expert = flat % self.E
        return owner_layer == layer and active[owner_expert]

    def _pick_victim(self, layer: int, active: list[bool]) -> int:
        """Eligible slot with the smallest usage, lowest slot on ties; -1 if none is eligible."""
        best = -1
        for slot in range(self.S):
            if self._slot_blocked(slot, layer, active):
                continue
            if best == -1 or self.usage[slot] < self.usage[best]:
                best = slot
        return best

    def _count_repeats(self, layer: int, misses: list[int]) -> None:
        """The repeat-miss sums: misses active since the least recently used slot's last use."""
        if misses:
            oldest = min(self.usage)
            repeats = 0
            for e in misses:
                rec = self.recency[layer][e]
                if rec >= 0 and rec >= oldest:
                    repeats += 1
            self.repeat_misses = self.repeat_misses - (self.repeat_misses >> 10) + 32 * repeats
            self.seen_misses = self.seen_misses - (self.seen_misses >> 10) + 32 * len(misses)

    def _scores(self, costs) -> list[int]:
        """Each candidate's window cost minus one host GEMV's ticks for every expert active in this window that its
        lane's cache holds (host-all, a cold cache, none)."""
        saving = max(costs.host_solo - (costs.device if costs.serial else 0), 0)
        scores = [self.cost[0]]
        for i, lane in enumerate(self.lanes):
            warm = 0
            for layer in range(self.L):
                for e in range(self.E):
                    if lane.slot_of_expert[layer][e] >= 0 and self.window_active[layer][e]:
                        warm += 1
            scores.append(self.cost[i + 1] - warm * saving)
        return scores

    def _advance_lanes(self, layer: int, active: list[bool], costs) -> None:
        """The leader check (window boundary, or every FIRST_CHECK_TOKENS in the first window), fresh lanes at a
        boundary, the window's active experts and every candidate's ticks of this call."""
        boundary = self.step - self.window_start >= WINDOW_TOKENS * self.L
        first = self.window_start == 0 and self.step > 0 and self.step % (FIRST_CHECK_TOKENS * self.L) == 0
        if boundary or first:
            scores = self._scores(costs)
            best = 0
            for i in range(1, len(CANDIDATES)):
                if scores[i] < scores[best]:
                    best = i
            if scores[best] < scores[self.leader]:
                self.leader = best
        if boundary:
            self.lanes = [self._copy() for _ in CANDIDATES[1:]]
            self.cost = [0] * len(CANDIDATES)
            self.window_active = [[False] * self.E for _ in range(self.L)]
            self.window_start = self.step
        for e in range(self.E):
            if active[e]:
                self.window_active[layer][e] = True
        n_active = sum(1 for a in active if a)
        ticks = [auto_layer_time(costs, n_active, 0, 0)]  # host-all, every active expert a miss of a cold cache
        for name, lane in zip(CANDIDATES[1:], self.lanes):
            lane.recency = [row[:] for row in self.recency]  # the lanes read the real cache's recency and step
            lane.step = self.step
            st = lane.plan(layer, active, _Lane(name, costs))["stats"]
            ticks.append(auto_layer_time(costs, int(st[2]), int(st[1]), int(st[3])))
        limit = (1 << 30) - 1
        self.cost = [min(min(c, limit) + min(t, limit), limit) for c, t in zip(self.cost, ticks)]

    def plan(self, layer: int, active, policy) -> dict:
        """One MoE-layer call. active: sequence of E bools. Returns the plan as numpy arrays (P = min(E, S))."""
        active = [bool(a) for a in active]
        E = self.E
        step = self.step
        hits = []
        misses = []
        for e in range(E):
            if not active[e]:
                continue
            if self.slot_of_expert[layer][e] >= 0:
                hits.append(e)
            else:
                misses.append(e)
        m = len(misses)
        evictable = sum(1 for slot in range(self.S) if not self._slot_blocked(slot, layer, active))
        if policy.kind == "auto":
            self._advance_lanes(layer, active, policy.costs)  # the lanes copy the tables as they were before the call
            self._count_repeats(layer, misses)
            budget = candidate_count(CANDIDATES[self.leader], policy.costs, m, len(hits), evictable,
                                     self.repeat_misses, self.seen_misses)
        elif policy.kind == "lane":  # one candidate of an auto policy, in a lane
            self._count_repeats(layer, misses)
            budget = candidate_count(policy.name, policy.costs, m, len(hits), evictable, self.repeat_misses,
                                     self.seen_misses)
        else:
            budget = policy_budget(policy, m)

        # Rank the misses: seen before (most recent first) ahead of never-seen; lower id on ties.
        def miss_key(e):
            rec = self.recency[layer][e]
            never = 1 if rec < 0 else 0
            return (never, -rec, e)

        ranked = sorted(misses, key=miss_key)

        fills = []  # (flat id, slot)
        fetched = set()
        for e in ranked:
            if len(fills) == budget:
                break
            slot = self._pick_victim(layer, active)
            if slot == -1:
                break  # no evictable slot left: the remaining misses go to the host
            old = self.expert_of_slot[slot]
            if old >= 0:
                self.slot_of_expert[old // E][old % E] = -1
            flat = layer * E + e
            self.expert_of_slot[slot] = flat
            self.slot_of_expert[layer][e] = slot
            self.usage[slot] = step
            fills.append((flat, slot))
            fetched.add(e)

        for e in hits:
            self.usage[self.slot_of_expert[layer][e]] = step
        for e in range(E):
            if active[e]:
                self.recency[layer][e] = step

        P = min(E, self.S)
        fill_flat_ids = [-1] * P
        fill_slot_ids = [-1] * P
        for i, (flat, slot) in enumerate(fills):
            fill_flat_ids[i] = flat
            fill_slot_ids[i] = slot
        device_slot = [-1] * E
        host_mask = [False] * E
        for e in hits:
            device_slot[e] = self.slot_of_expert[layer][e]
        for e in fetched:
            device_slot[e] = self.slot_of_expert[layer][e]
        for e in misses:
            if e not in fetched:
                host_mask[e] = True
        n_active = sum(1 for a in active if a)
        call_stats = [n_active, len(hits), m, len(fills), m - len(fills)]
        for i in range(5):
            self.stats[layer][i] += call_stats[i]
        self.stats[layer][5] += 1
        self.step += 1
        return {
            "fill_flat_ids": np.array(fill_flat_ids, np.int32),
            "fill_slot_ids": np.array(fill_slot_ids, np.int32),
            "device_slot_of_expert": np.array(device_slot, np.int32),
            "host_mask": np.array(host_mask, bool),
            "stats": np.array(call_stats, np.int32),
        }

    def arrays(self) -> dict:
        """The tables as numpy arrays named like the CacheState fields (auto: "lanes" with the LaneState fields)."""
        out = {
            "slot_of_expert": np.array(self.slot_of_expert, np.int32).reshape(self.L, self.E),
            "expert_of_slot": np.array(self.expert_of_slot, np.int32),
            "usage": np.array(self.usage, np.int32),
            "recency": np.array(self.recency, np.int32).reshape(self.L, self.E),
            "step": np.array(self.step, np.int32),
            "stats": np.array(self.stats, np.int32).reshape(self.L, 6),
            "reuse": np.array([self.repeat_misses, self.seen_misses], np.int32),
        }
        if self.auto:
            lanes = [lane.arrays() for lane in self.lanes]
            out["lanes"] = {
                **{name: np.stack([lane[name] for lane in lanes]) for name in
                   ("slot_of_expert", "expert_of_slot", "usage", "reuse")},
                "cost": np.array(self.cost, np.int32), "window_active": np.array(self.window_active, bool).reshape(self.L, self.E),
                "leader": np.array(self.leader, np.int32),
                "window_start": np.array(self.window_start, np.int32),
            }
        return out


class _Lane:
    """The policy of a lane: one auto candidate (name) with the auto policy's costs."""

    kind = "lane"

    def __init__(self, name: str, costs):
        self.name, self.costs = name, costs
