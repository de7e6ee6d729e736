"""Plain Python reference of the expert slot cache rules (docs/DESIGN.md sec. 1-3), used by tests only.

Written independently of ft_jax/expert_cache.py and ft_jax/policy.py: Python lists and loops, one fetch and one
victim at a time, its own Q16 integer rule and its own auto rule (docs/policies.md). It reads only the attributes
kind / frac / cap / costs of a policy object (costs: the integer tick fields of AutoCosts).
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
    device = c.device_fixed + D * c.device if D > 0 else 0
    return max(fill_end + device, host_end)


def auto_count(costs, misses: int, hits: int, cap: int, realized_gain: int, realized_fills: int,
               repeat_misses: int = 0, seen_misses: int = 0) -> int:
    """auto's F: the smallest F in [0, cap] minimising layer time - credit * F (credit from the reuse estimate)."""
    prior = 2  # AUTO_PRIOR_HITS
    # Net hits per fill the misses suggest (Q4): p / (1 - p) with p the share of repeat misses, prior 2 : 1.
    rest = seen_misses - repeat_misses
    if rest < 0:
        rest = 0
    shadow_q4 = min(16 * (repeat_misses + 32 * prior) // (rest + 32), 16 * 127)
    # ... as one pseudo-fill beside the evicted replacement fills.
    per_fill_q4 = max(16 * realized_gain + 32 * shadow_q4, 0) // (realized_fills + 32)
    if misses > 0:  # what turning one of this layer's misses into a hit would save now
        saving = auto_layer_time(costs, misses, hits, 0) - auto_layer_time(costs, misses - 1, hits + 1, 0)
    else:
        saving = 0
    if saving < 0:
        saving = 0
    credit = min(per_fill_q4 * saving // 16, 1 << 22)
    best, best_value = 0, None
    for F in range(cap + 1):
        value = auto_layer_time(costs, misses, hits, F) - credit * F
        if best_value is None or value < best_value:
            best, best_value = F, value
    return best


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

    resident=True builds the fully resident cache (S = L*E, slot s holds flat id s).
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int | None = None, resident: bool = False):
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
        self.slot_gain = [0] * self.S  # auto: net hits since the slot's fill
        self.ghost = [-1] * self.S  # auto: the flat id the slot's latest fill evicted
        self.realized_gain = 0  # auto: decayed (x32) sums over evicted fills
        self.realized_fills = 0
        self.repeat_misses = 0  # auto: decayed (x32) sums over calls with misses
        self.seen_misses = 0
        if resident:
            for layer in range(self.L):
                for e in range(self.E):
                    flat = layer * self.E + e
                    self.slot_of_expert[layer][e] = flat
                    self.expert_of_slot[flat] = flat

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
        if policy.kind == "auto":
            for slot in range(self.S):
                g = self.ghost[slot]
                if g >= 0 and g // E == layer and (g % E) in misses:
                    self.slot_gain[slot] = max(-127, self.slot_gain[slot] - 1)
            for e in hits:
                slot = self.slot_of_expert[layer][e]
                self.slot_gain[slot] = min(127, self.slot_gain[slot] + 1)
            if m > 0:  # repeat misses: active since the least recently used slot's last use
                oldest = min(self.usage)
                repeats = 0
                for e in misses:
                    rec = self.recency[layer][e]
                    if rec >= 0 and rec >= oldest:
                        repeats += 1
                self.repeat_misses = self.repeat_misses - (self.repeat_misses >> 10) + 32 * repeats
                self.seen_misses = self.seen_misses - (self.seen_misses >> 10) + 32 * m
            evictable = sum(1 for slot in range(self.S) if not self._slot_blocked(slot, layer, active))
            budget = auto_count(policy.costs, m, len(hits), min(m, evictable), self.realized_gain,
                                self.realized_fills, self.repeat_misses, self.seen_misses)
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
            if policy.kind == "auto":
                if old >= 0 and self.ghost[slot] >= 0:  # an evicted replacement fill's net hits join the sums
                    self.realized_gain = self.realized_gain - (self.realized_gain >> 10) + 32 * self.slot_gain[slot]
                    self.realized_fills = self.realized_fills - (self.realized_fills >> 10) + 32
                self.slot_gain[slot] = 0
                self.ghost[slot] = old
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
        """The tables as numpy arrays named like the CacheState fields."""
        return {
            "slot_of_expert": np.array(self.slot_of_expert, np.int32).reshape(self.L, self.E),
            "expert_of_slot": np.array(self.expert_of_slot, np.int32),
            "usage": np.array(self.usage, np.int32),
            "recency": np.array(self.recency, np.int32).reshape(self.L, self.E),
            "step": np.array(self.step, np.int32),
            "stats": np.array(self.stats, np.int32).reshape(self.L, 6),
            "slot_gain": np.array(self.slot_gain, np.int32),
            "ghost_of_slot": np.array(self.ghost, np.int32),
            "reuse": np.array([self.realized_gain, self.realized_fills, self.repeat_misses, self.seen_misses],
                              np.int32),
        }
