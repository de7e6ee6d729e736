"""Routing traces: read and write them, replay them through the decode step's cache plan, model the MoE time per token.

A routing trace says which experts every generated token routed to in every MoE layer; no weights are needed to
replay it. ``ft-jax trace`` replays a trace through ``ft_jax.offload.cache.plan_layer`` (the code the decode
step runs: jit, lax.scan over the MoE layers with the layer index traced, ``max_active`` = rows x top-k) for lists of
policies and cache sizes, and prices every MoE-layer call with the cost model below under a bandwidth profile.

Trace format (as in ../shared/traces; ``ft-jax generate --record-trace`` writes it): JSON lines, one object per
(sequence, generated token, MoE layer):
    {"dataset": str, "problem_id": int, "layer": int, "token_idx": int, "experts": [e0, e1, ...],
     "gating_probs": [p0, ...]}
A sequence is one (dataset, problem_id); "dataset" and "gating_probs" are optional. The .npz form holds the same
records as columns: names (str[Q], "dataset/problem_id"), sequence (i32[R] index into names), token_idx (i64[R]),
layer (i32[R]), experts (i32[R, K], -1 = padding) and optionally gating_probs (f32[R, K]). Tokens missing some
layer (a collector artefact at the end of a sequence) are skipped and counted; a malformed record is an error
naming the file and line (or record index).

Cost model (per MoE layer; docs/policies.md works an example): with F experts fetched into slots, H computed on the
host and D = hits + F computed on the device, S_e bytes per expert,
  * the fill path (F > 0) moves F*S_e bytes and the host path (H > 0) reads H*S_e bytes, both from t = 0; while
    both move bytes they run at the contended pair (BPc, BHc); when one is done the other goes on at its solo
    bandwidth (BP or BH). Each path that runs adds its fixed cost (c_F, c_H) to its end. Without a measured pair, BPc = BP and BHc = max(0, BH - BP): the fill is
    taken to use its full bandwidth out of the host's memory bandwidth (the assumption behind q* = m*BP/BH,
    docs/DESIGN.md sec. 1).
  * the device path (D > 0) starts when the fill ends (slot_experts reads the slots slot_fill wrote) and takes
    c_D + D*S_e/BD, BD the device's own bandwidth for expert weights in its slots.
  * layer time = max(fill end + device time, host end); layers run one after another (the next layer needs this
    one's output), so a token costs the sum over its MoE layers. Attention and the dense layers are not counted.
Bandwidths in GB/s (1e9 bytes/s), times in ms.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Iterable, Sequence as Seq

import numpy as np

GB = 1e9


# --- Reading and writing traces ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class TraceSequence:
    """The complete tokens of one generated sequence.

    Attributes:
        name: "dataset/problem_id".
        token_idx: i64[N] token index of each kept token, increasing.
        active: bool[N, L, E] experts each kept token routes to in each MoE layer.
        skipped: tokens dropped because some layer was missing.
    """

    name: str
    token_idx: np.ndarray
    active: np.ndarray
    skipped: int


@dataclasses.dataclass
class Trace:
    """A routing trace: sequences with the same L and E.

    Attributes:
        sequences: in order of first appearance in the file(s).
        num_layers: L MoE layers. num_experts: E routed experts per layer.
        top_k: the largest number of experts one record routes to (k).
        paths: the files read.
    """

    sequences: list[TraceSequence]
    num_layers: int
    num_experts: int
    top_k: int
    paths: list[str]

    @property
    def tokens(self) -> int:
        """Complete tokens over all sequences."""
        return sum(len(s.token_idx) for s in self.sequences)

    @property
    def skipped_tokens(self) -> int:
        """Tokens dropped because some layer was missing."""
        return sum(s.skipped for s in self.sequences)


def _records_jsonl(path: str):
    """(where, sequence name, token_idx, layer, experts list) per non-blank line. Raises ValueError naming path:line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise TypeError("not a JSON object")
                name = f"{obj.get('dataset', '')}/{obj['problem_id']}"
                token, layer = obj["token_idx"], obj["layer"]
                experts = obj["experts"]
                if not (isinstance(token, int) and isinstance(layer, int) and isinstance(experts, list)
                        and all(isinstance(e, int) and not isinstance(e, bool) for e in experts)):
                    raise TypeError("token_idx and layer must be integers and experts a list of integers")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{where}: not a routing record with problem_id, token_idx, layer and experts "
                                 f"({type(e).__name__}: {e})") from None
            yield where, name, token, layer, experts


def _records_npz(path: str):
    """The same records from the .npz column form. Raises ValueError naming path and the record index."""
    try:
        with np.load(path, allow_pickle=False) as z:
            cols = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable .npz routing trace ({e})") from None
    missing = [k for k in ("names", "sequence", "token_idx", "layer", "experts") if k not in cols]
    if missing:
        raise ValueError(f"{path}: .npz routing trace lacks the arrays {missing} (expected names, sequence, "
                         "token_idx, layer, experts)")
    names, seq, tok, lay, ex = (cols[k] for k in ("names", "sequence", "token_idx", "layer", "experts"))
    R = len(seq)
    if ex.ndim != 2 or len(ex) != R or len(tok) != R or len(lay) != R:
        raise ValueError(f"{path}: sequence, token_idx, layer must be [R] and experts [R, K] with the same R, got "
                         f"{seq.shape}, {tok.shape}, {lay.shape}, {ex.shape}")
    for name, a in (("sequence", seq), ("token_idx", tok), ("layer", lay), ("experts", ex)):
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{path}: {name} must be integers, got {a.dtype}")
    for r in range(R):
        if not 0 <= seq[r] < len(names):
            raise ValueError(f"{path}: record {r}: sequence {int(seq[r])} out of range [0, {len(names)})")
        row = [int(e) for e in ex[r] if e != -1]
        yield f"{path}: record {r}", str(names[seq[r]]), int(tok[r]), int(lay[r]), row


def read_trace(paths: str | Seq[str], num_layers: int | None = None, num_experts: int | None = None) -> Trace:
    """Read routing traces (JSON lines, or .npz by file name) into per-sequence active masks (format: module docstring).

    Args:
        paths: one file or several (their sequences are concatenated; a name in two files is one sequence).
        num_layers: L (default: largest layer + 1). num_experts: E (default: largest expert id + 1).
    Returns:
        Trace; each sequence keeps only the tokens that have all L layers.
    Raises:
        ValueError: a record is malformed, negative, out of range, has no or repeated experts, or repeats a
            (sequence, token, layer); or no token is complete. The message names the file and line (record).
        OSError: a file cannot be read.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("trace: no trace file given")
    rows = []  # (where, name, token, layer, experts)
    for path in paths:
        path = os.fspath(path)
        reader = _records_npz if path.endswith(".npz") else _records_jsonl
        for where, name, token, layer, experts in reader(path):
            if token < 0 or layer < 0:
                raise ValueError(f"{where}: token_idx and layer must be >= 0, got {token}, {layer}")
            if not experts or min(experts) < 0:
                raise ValueError(f"{where}: experts must be a non-empty list of ids >= 0, got {experts}")
            if len(set(experts)) != len(experts):
                raise ValueError(f"{where}: an expert appears twice in {experts}")
            rows.append((where, name, token, layer, experts))
    if not rows:
        raise ValueError(f"trace: no routing records in {', '.join(map(str, paths))}")
    L = num_layers if num_layers is not None else max(r[3] for r in rows) + 1
    E = num_experts if num_experts is not None else max(max(r[4]) for r in rows) + 1
    by_seq: dict[str, dict[int, dict[int, list[int]]]] = {}
    for where, name, token, layer, experts in rows:
        if layer >= L:
            raise ValueError(f"{where}: layer {layer} out of range [0, {L}) (the model's MoE layers)")
        if max(experts) >= E:
            raise ValueError(f"{where}: expert id {max(experts)} out of range [0, {E}) (the model's experts)")
        layers = by_seq.setdefault(name, {}).setdefault(token, {})
        if layer in layers:
            raise ValueError(f"{where}: a second record for sequence {name}, token {token}, layer {layer}")
        layers[layer] = experts
    sequences = []
    for name, tokens in by_seq.items():
        kept = sorted(t for t, layers in tokens.items() if len(layers) == L)
        active = np.zeros((len(kept), L, E), bool)  # bool[N, L, E]
        for n, t in enumerate(kept):
            for layer, experts in tokens[t].items():
                active[n, layer, experts] = True
        sequences.append(TraceSequence(name, np.array(kept, np.int64), active, len(tokens) - len(kept)))
    if not any(len(s.token_idx) for s in sequences):
        raise ValueError(f"trace: no token of {', '.join(map(str, paths))} has all {L} MoE layers")
    return Trace(sequences, int(L), int(E), max(len(r[4]) for r in rows), [os.fspath(p) for p in paths])


def routing_records(ids: np.ndarray, weights: np.ndarray | None = None, dataset: str = "ft-jax",
                    first_problem_id: int = 0) -> list[dict]:
    """Trace records of recorded decode routing (Engine.generate(record_routing=True): GenerationResult.routing).

    Args:
        ids: i32[steps, L, B, k] top-k expert ids of every decode step; -1 for a row that had finished.
        weights: f32[steps, L, B, k] combine weights (written as gating_probs), or None.
        dataset: the records' "dataset". first_problem_id: problem_id of row 0 (row b gets first_problem_id + b).
    Returns:
        One dict per (row, step, layer) with an unfinished row, in the module docstring's format; token_idx = step.
    Raises:
        ValueError: ids is not 4-D or weights has another shape.
    """
    ids = np.asarray(ids)
    if ids.ndim != 4:
        raise ValueError(f"trace: routing ids must be [steps, L, B, k], got shape {list(ids.shape)}")
    if weights is not None and np.shape(weights) != ids.shape:
        raise ValueError(f"trace: routing weights shape {list(np.shape(weights))} != ids shape {list(ids.shape)}")
    steps, L, B, _ = ids.shape
    out = []
    for b in range(B):
        for t in range(steps):
            if np.any(ids[t, :, b] < 0):  # the row had finished (its EOS came earlier)
                continue
            for layer in range(L):
                rec = {"dataset": dataset, "problem_id": first_problem_id + b, "layer": layer, "token_idx": t,
                       "experts": [int(e) for e in ids[t, layer, b]]}
                if weights is not None:
                    rec["gating_probs"] = [float(w) for w in weights[t, layer, b]]
                out.append(rec)
    return out


def write_trace(path: str, records: Iterable[dict]) -> int:
    """Write trace records as JSON lines (or the .npz column form when path ends with .npz). Returns the count.

    Raises OSError if the file cannot be written."""
    records = list(records)
    if not str(path).endswith(".npz"):
        with open(path, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        return len(records)
    names = list(dict.fromkeys(f"{r.get('dataset', '')}/{r['problem_id']}" for r in records))
    index = {n: i for i, n in enumerate(names)}
    K = max((len(r["experts"]) for r in records), default=1)
    experts = np.full((len(records), K), -1, np.int32)  # i32[R, K]
    probs = np.zeros((len(records), K), np.float32)  # f32[R, K]
    for i, r in enumerate(records):
        experts[i, :len(r["experts"])] = r["experts"]
        probs[i, :len(r.get("gating_probs", []))] = r.get("gating_probs", [])
    np.savez(path, names=np.array(names), experts=experts, gating_probs=probs,
             sequence=np.array([index[f"{r.get('dataset', '')}/{r['problem_id']}"] for r in records], np.int32),
             token_idx=np.array([r["token_idx"] for r in records], np.int64),
             layer=np.array([r["layer"] for r in records], np.int32))
    return len(records)


# --- The cost model ---------------------------------------------------------------------------------------------------

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


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-MoE-layer time model of the offloaded decode step (module docstring).

    Attributes:
        expert_bytes: S_e, bytes of one expert (gate + up + down projections).
        bp, bh: slot-fill and host expert GEMV bandwidth, each alone, GB/s (> 0).
        bp_contended, bh_contended: the pair measured running at the same time (both or neither), GB/s.
        device_bandwidth: BD, GB/s at which the device computes the experts in its slots (> 0).
        fill_fixed_ms, host_fixed_ms, device_fixed_ms: c_F, c_H, c_D, fixed cost of each path per layer in which it
            runs (>= 0).
        source: where the bandwidths come from (one line).
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
        """(BPc, BHc) GB/s: the measured pair, else (BP, max(0, BH - BP)) (module docstring)."""
        if self.bp_contended is not None:
            return self.bp_contended, self.bh_contended
        return self.bp, max(0.0, self.bh - self.bp)

    @property
    def fraction(self) -> float:
        """The q* fetch fraction of these bandwidths (ft_jax.offload.policy.fraction_from_bandwidth)."""
        from ft_jax.offload.policy import fraction_from_bandwidth

        return fraction_from_bandwidth(self.bp, self.bh, self.bp_contended, self.bh_contended)

    def paths_ms(self, fetched: int, host: int) -> tuple[float, float]:
        """(fill end, host end) in ms of one layer with `fetched` fills and `host` host experts (module docstring).

        Both paths start at 0 and share the host memory at the contended pair; the one that finishes first (at
        t1 = min(F*S_e/BPc, H*S_e/BHc)) frees the other, whose remaining bytes move at its solo bandwidth. Each path
        that runs then adds its fixed cost. A path with no experts does not run and ends at 0."""
        bpc, bhc = self.pair
        fill_b, host_b = fetched * self.expert_bytes / GB * 1e3, host * self.expert_bytes / GB * 1e3  # ms at 1 GB/s
        if not fetched or not host:
            fill_end, host_end = fill_b / self.bp, host_b / self.bh
        else:
            a = fill_b / bpc  # fill time if contended throughout
            b = host_b / bhc if bhc > 0 else math.inf
            if a <= b:
                fill_end, host_end = a, a + (host_b - a * bhc) / self.bh
            else:
                host_end, fill_end = b, b + (fill_b - b * bpc) / self.bp
        return (fill_end + self.fill_fixed_ms if fetched else 0.0, host_end + self.host_fixed_ms if host else 0.0)

    def layer_ms(self, fetched: int, host: int, device: int) -> float:
        """Time of one MoE layer in ms: max(fill end + device time, host end); `device` = hits + fetched."""
        fill_end, host_end = self.paths_ms(fetched, host)
        device_ms = (self.device_fixed_ms + device * self.expert_bytes / (self.device_bandwidth * GB) * 1e3
                     if device else 0.0)
        return max(fill_end + device_ms, host_end)

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
                f"{self.device_fixed_ms:g}; S_e {self.expert_bytes / 2**20:.2f} MiB")


def parse_bandwidth(spec: str) -> dict | None:
    """--bandwidth: "stored" -> None; a preset name -> its dict; "BP,BH[,BPc,BHc]" GB/s -> a dict like a preset's.

    Raises:
        ValueError: not a preset, not 2 or 4 numbers, or a number that is not finite and > 0.
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
    if len(values) not in (2, 4) or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"--bandwidth {spec!r}: expected 'stored', a preset ({', '.join(PRESETS)}) or BP,BH[,BPc,BHc] "
                         "as positive numbers in GB/s")
    bpc, bhc = (values[2], values[3]) if len(values) == 4 else (None, None)
    return {"bp": values[0], "bh": values[1], "bp_contended": bpc, "bh_contended": bhc,
            "source": f"--bandwidth {spec}", "name": spec}


def stored_profile(expert_bytes: int, dtype: str, path: str | None = None):
    """(Profile, how) of this machine from the bandwidth store: the entry for (dtype, expert_bytes), else this
    machine's entry with the closest expert size. Raises ValueError if the store has none of this machine."""
    from ft_jax.offload import profile as bandwidth

    key = bandwidth.machine_key(dtype, expert_bytes)
    profiles, damaged = bandwidth.read_profiles(path)
    here = [p for p in profiles if bandwidth.describe_machine(p.key) == bandwidth.describe_machine(key)]
    exact = [p for p in here if p.key == key]
    if exact:
        return exact[-1], f"stored profile for this expert size, measured {exact[-1].measured_at}"
    if not here:
        where = path or bandwidth.default_store_path()
        raise ValueError(f"no bandwidth profile of this machine ({bandwidth.describe_machine(key)}) in {where}"
                         f"{' (' + damaged + ')' if damaged else ''}: run `ft-jax profile` or pass --bandwidth "
                         f"BP,BH or a preset ({', '.join(PRESETS)})")
    near = min(here, key=lambda p: abs(math.log(p.key["expert_bytes"] / expert_bytes)))
    return near, (f"stored profile of this machine at the closest expert size ({near.key['dtype']}, "
                  f"{near.key['expert_bytes'] / 2**20:.2f} MiB), measured {near.measured_at}")


def cost_model(bandwidth: str, expert_bytes: int, *, dtype: str = "bfloat16", profile_path: str | None = None,
               device_bandwidth: float | None = None, fill_fixed_ms: float = 0.0, host_fixed_ms: float = 0.0,
               device_fixed_ms: float = 0.0) -> CostModel:
    """The CostModel of a --bandwidth spec (parse_bandwidth) at expert size expert_bytes.

    device_bandwidth None: BH for a stored profile of a CPU device (its slot_experts kernel is the host GEMV kernel
    reading slots in the same memory), else ASSUMED_DEVICE_GBPS. Raises ValueError (bad spec, no stored profile)."""
    spec = parse_bandwidth(bandwidth)
    platform = None
    if spec is None:
        profile, how = stored_profile(expert_bytes, dtype, profile_path)
        spec = {"bp": profile.bp, "bh": profile.bh, "bp_contended": profile.bp_contended,
                "bh_contended": profile.bh_contended, "source": how}
        platform = profile.key["platform"]
    if device_bandwidth is None:
        device_bandwidth = spec["bh"] if platform == "cpu" else ASSUMED_DEVICE_GBPS
    return CostModel(expert_bytes=int(expert_bytes), bp=spec["bp"], bh=spec["bh"], bp_contended=spec["bp_contended"],
                     bh_contended=spec["bh_contended"], device_bandwidth=float(device_bandwidth),
                     fill_fixed_ms=float(fill_fixed_ms), host_fixed_ms=float(host_fixed_ms),
                     device_fixed_ms=float(device_fixed_ms), source=spec["source"])


# --- Replay -------------------------------------------------------------------------------------------------------------

CHUNK = 32  # tokens per compiled replay call (a lax.scan over tokens of a lax.scan over layers)


@functools.lru_cache(maxsize=None)
def _replay_step(policy, max_active: int):
    """jit: (CacheState, active bool[CHUNK, L, E], valid bool[CHUNK]) -> (CacheState, stats i32[CHUNK, L, 5]).

    Each valid token runs plan_layer over its L MoE layers as the decode step does (lax.scan, layer index traced);
    invalid (padding) tokens leave the state unchanged and report zeros."""
    import jax
    import jax.numpy as jnp

    from ft_jax.offload.cache import plan_layer

    def run(state, active, valid):
        L = active.shape[1]

        def token(state, xs):
            act, ok = xs  # bool[L, E], bool[]

            def layers(state):
                def layer(state, ys):
                    index, layer_active = ys  # i32[], bool[E]
                    state, plan = plan_layer(state, index, layer_active, policy, max_active=max_active)
                    return state, plan.stats  # i32[5]

                return jax.lax.scan(layer, state, (jnp.arange(L, dtype=jnp.int32), act))

            return jax.lax.cond(ok, layers, lambda s: (s, jnp.zeros((L, 5), jnp.int32)), state)

        return jax.lax.scan(token, state, (active, valid))

    return jax.jit(run, donate_argnums=0)


@dataclasses.dataclass
class ReplayResult:
    """Output of replay.

    Attributes:
        stats: i32[N, L, 5] per (token, MoE layer): active, hits, misses, fetched, host (tokens of all streams in
            order).
        state: the CacheState after the last token.
    """

    stats: np.ndarray
    state: object


def _streams(trace: Trace, batch: bool) -> list[np.ndarray]:
    """Active masks bool[N, L, E] of each stream replayed from its own cache: every sequence, or (batch) one stream
    whose token t is the union of the sequences' token t (rows of one batch decoded together)."""
    if not batch:
        return [s.active for s in trace.sequences]
    steps = sorted(set().union(*(s.token_idx.tolist() for s in trace.sequences)))
    merged = np.zeros((len(steps), trace.num_layers, trace.num_experts), bool)
    where = {t: i for i, t in enumerate(steps)}
    for s in trace.sequences:
        merged[[where[t] for t in s.token_idx.tolist()]] |= s.active
    return [merged]


def replay(trace: Trace, policy, num_slots: int, *, carry_cache: bool = False, batch: bool = False,
           initial_state=None) -> ReplayResult:
    """Replay every complete token of a trace through plan_layer, the decode step's cache plan.

    Args:
        trace: from read_trace.
        policy: a bound ft_jax.offload.policy.Policy (qstar with its fraction, auto with its costs; see bind_policy);
            "resident" needs num_slots = L*E.
        num_slots: S, device slots shared by all MoE layers.
        carry_cache: keep the cache from one sequence to the next (default: each sequence starts cold).
        batch: the sequences are the rows of one batch decoded together (token t of every row in one decode step,
            max_active = rows x top-k), replayed as one stream.
        initial_state: a CacheState to start the first stream from (e.g. the state after a prefill), else cold.
    Returns:
        ReplayResult.
    Raises:
        ValueError: num_slots < 1 or > L*E, a policy that is not bound, or an initial_state of other shapes.
    """
    import jax
    import jax.numpy as jnp

    from ft_jax.offload.cache import init_cache_state, init_cache_state_resident

    L, E = trace.num_layers, trace.num_experts
    if not isinstance(num_slots, int) or not 1 <= num_slots <= L * E:
        raise ValueError(f"trace: cache slots must be an integer in [1, L*E = {L * E}], got {num_slots!r}")
    rows = len(trace.sequences) if batch else 1
    step = _replay_step(policy, max_active=rows * trace.top_k)

    def cold():
        if policy.kind == "resident":
            return init_cache_state_resident(L, E)
        return init_cache_state(L, E, num_slots)

    out, state = [], None
    for i, active in enumerate(_streams(trace, batch)):
        if state is None or not carry_cache:
            state = cold() if (i or initial_state is None) else jax.tree_util.tree_map(jnp.array, initial_state)
        for start in range(0, len(active), CHUNK):
            part = active[start:start + CHUNK]
            pad = CHUNK - len(part)
            chunk = np.concatenate([part, np.zeros((pad, L, E), bool)]) if pad else part
            state, stats = step(state, jnp.asarray(chunk), jnp.asarray(np.arange(CHUNK) < len(part)))
            out.append((stats, len(part)))
    host = [np.asarray(s)[:n] for s, n in jax.device_get(out)] if out else []
    stats = np.concatenate(host).astype(np.int32) if host else np.zeros((0, L, 5), np.int32)
    return ReplayResult(stats=stats, state=state)


def summarize(stats: np.ndarray, model: CostModel) -> dict:
    """Per-token figures of replayed stats i32[N, L, 5] (N > 0): hit_rate (hits / active experts), active, hits,
    fetched and host experts per token (summed over MoE layers), ms_per_token (mean of CostModel.token_ms)."""
    s = stats.astype(np.float64)
    active, hits = s[..., 0].sum(), s[..., 1].sum()
    per_token = s.sum(axis=1)  # f64[N, 5]
    return {"hit_rate": float(hits / active) if active else 0.0,
            "active_per_token": float(per_token[:, 0].mean()), "hits_per_token": float(per_token[:, 1].mean()),
            "fetched_per_token": float(per_token[:, 3].mean()), "host_per_token": float(per_token[:, 4].mean()),
            "ms_per_token": float(model.token_ms(stats).mean())}


def bind_policy(policy, model: CostModel):
    """The policy with what it needs from the cost model: qstar without a fraction gets model.fraction, auto without
    costs gets model.auto_costs(); others are returned as they are."""
    if policy.kind == "qstar" and policy.frac is None:
        return policy.with_frac(model.fraction)
    if policy.kind == "auto" and policy.costs is None:
        return policy.with_costs(model.auto_costs())
    return policy


def _auto_costs(self) -> object:
    """AutoCosts (ft_jax.offload.policy.auto_costs) of this model: the auto policy decides with the same costs."""
    from ft_jax.offload.policy import auto_costs

    return auto_costs(self.expert_bytes, self.bp, self.bh, self.bp_contended, self.bh_contended,
                      self.device_bandwidth, self.fill_fixed_ms, self.host_fixed_ms, self.device_fixed_ms)


CostModel.auto_costs = _auto_costs


def evaluate(trace: Trace, policies: Seq, slot_counts: Seq[int], model: CostModel, *, carry_cache: bool = False,
             batch: bool = False, progress=None) -> list[dict]:
    """Replay every (cache size, policy) and summarize it (Python API of `ft-jax trace`).

    Args:
        trace: from read_trace. policies: ft_jax.offload.policy.Policy (bound here with bind_policy).
        slot_counts: cache sizes S. model: CostModel. carry_cache, batch: as in replay.
        progress: called with (done, total) after each replay, or None.
    Returns:
        One dict per (S, policy), S-major: policy (its name as given, e.g. "qstar"), bound (str of the bound
        policy), cache_slots, cache_fraction (S / (L*E)), and summarize's fields.
    """
    out, total = [], len(slot_counts) * len(policies)
    for S in slot_counts:
        for policy in policies:
            bound = bind_policy(policy, model)
            res = replay(trace, bound, trace.num_layers * trace.num_experts if policy.kind == "resident" else S,
                         carry_cache=carry_cache, batch=batch)
            out.append({"policy": str(policy), "bound": str(bound), "cache_slots": int(S),
                        "cache_fraction": S / (trace.num_layers * trace.num_experts), **summarize(res.stats, model)})
            if progress is not None:
                progress(len(out), total)
    return out


BANDWIDTH_HELP = ("'stored' (default: this machine's profile from `ft-jax profile`, at the expert size or the "
                  "closest one stored), BP,BH[,BPc,BHc] in GB/s, or a preset: " +
                  "; ".join(f"{name}: BP {p['bp']:g}, BH {p['bh']:g}" +
                            (f", BPc {p['bp_contended']:g}, BHc {p['bh_contended']:g}" if p["bp_contended"] else "")
                            + f" GB/s ({p['source']})" for name, p in PRESETS.items()))

COST_MODEL_HELP = """cost model, per MoE layer with F fetched, H host-computed and D = hits + F device experts of S_e bytes:
  fill F*S_e bytes and host GEMV H*S_e bytes start together and share host memory at the contended pair
  (BPc, BHc; without a measured pair BPc = BP, BHc = max(0, BH - BP)); when one ends the other goes on at its
  solo bandwidth (BP or BH); each path that runs adds its fixed cost (--fill-fixed-ms, --host-fixed-ms);
  the device computes its D experts after the fill: --device-fixed-ms + D*S_e/BD (BD = --device-bandwidth);
  layer = max(fill end + device, host end); a token = the sum over its MoE layers (attention not counted).
  Each sequence starts from a cold cache (a trace has no prompt), unless --carry-cache."""


def add_model_arguments(p) -> None:
    """--model / --expert-bytes / --num-layers / --num-experts / --dtype and the cost-model flags (trace and plan)."""
    from ft_jax.cli import arg_types

    p.add_argument("--model", metavar="DIR", help="Hugging Face model folder: expert bytes, MoE layers and experts "
                                                  "from its config.json (instead of the three flags below)")
    p.add_argument("--expert-bytes", type=arg_types.positive_int, metavar="B",
                   help="S_e, bytes of one expert (gate + up + down), e.g. 352321536 for Mixtral-8x7B in bf16")
    p.add_argument("--num-layers", type=arg_types.positive_int, metavar="L", help="MoE layers (default: from the trace)")
    p.add_argument("--num-experts", type=arg_types.positive_int, metavar="E", help="experts per layer (default: the trace)")
    p.add_argument("--dtype", default=None, help="bf16/bfloat16 or f32/float32: the stored profile to look up "
                                                 "(default: the model's, else bfloat16)")
    p.add_argument("--bandwidth", default="stored", metavar="SPEC", help=BANDWIDTH_HELP)
    p.add_argument("--profile", metavar="PATH", help="bandwidth profile store (default: the user cache directory)")
    p.add_argument("--device-bandwidth", type=arg_types.positive, metavar="GBPS",
                   help=f"BD, GB/s at which the device computes experts in its slots (default: BH for a stored CPU "
                        f"profile, the slot experts run the host GEMV kernel; else an assumed {ASSUMED_DEVICE_GBPS:g})")
    for path in ("fill", "host", "device"):
        p.add_argument(f"--{path}-fixed-ms", type=arg_types.non_negative, default=0.0, metavar="MS",
                       help=f"fixed cost of the {path} path per layer in which it runs (default 0; DESIGN.md sec. 5 "
                            "cites FreeToken PR #39 for 0.08 ms on its CPU path)" if path == "host" else
                       f"fixed cost of the {path} path per layer in which it runs (default 0)")
    p.add_argument("--carry-cache", action="store_true", help="keep the cache across sequences (default: cold)")
    p.add_argument("--batch", action="store_true",
                   help="the sequences are the rows of one batch decoded together (a trace recorded by "
                        "`ft-jax generate` with several prompts): token t of every row is one decode step")
    p.add_argument("--verbose", action="store_true", help="show tracebacks")


def load_inputs(args) -> tuple[Trace, CostModel]:
    """(Trace, CostModel) from the shared trace/plan arguments. Raises ValueError / OSError (one-line messages)."""
    from ft_jax.offload.profile import dtype_name

    L, E, eb, dtype = args.num_layers, args.num_experts, args.expert_bytes, args.dtype
    if args.model:
        from ft_jax.config import load_config
        from ft_jax.offload.profile import expert_nbytes

        cfg = load_config(args.model)
        dtype = dtype or ("float32" if str(cfg.dtype) == "float32" else "bfloat16")
        model_eb = expert_nbytes(cfg.hidden_size, cfg.moe_intermediate_size, dtype)
        if eb is not None and eb != model_eb:
            raise ValueError(f"--expert-bytes {eb} disagrees with --model ({model_eb} bytes per {dtype} expert)")
        eb = model_eb
        for name, given, value in (("--num-layers", L, cfg.num_moe_layers), ("--num-experts", E, cfg.num_experts)):
            if given is not None and given != value:
                raise ValueError(f"{name} {given} disagrees with --model ({value})")
        L, E = cfg.num_moe_layers, cfg.num_experts
    if eb is None:
        raise ValueError("give --model DIR or --expert-bytes B (bytes of one expert) to price the replay")
    dtype = dtype_name(dtype or "bfloat16")
    trace = read_trace(args.trace, L, E)
    model = cost_model(args.bandwidth, eb, dtype=dtype, profile_path=args.profile,
                       device_bandwidth=args.device_bandwidth, fill_fixed_ms=args.fill_fixed_ms,
                       host_fixed_ms=args.host_fixed_ms, device_fixed_ms=args.device_fixed_ms)
    return trace, model


def add_trace_arguments(sub) -> None:
    """Register `ft-jax trace` on the CLI's subparsers."""
    import argparse

    from ft_jax.cli import arg_types

    policies = arg_types.policy_list("--policy")

    p = sub.add_parser("trace", help="replay a routing trace: hit rate, fetched/host experts and modelled ms per "
                                     "token for each policy and cache size",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=COST_MODEL_HELP,
                       description="Replay routing traces (JSON lines or .npz, see docs/policies.md) through the "
                       "decode step's own cache plan for every policy and cache size, and model the MoE time per "
                       "token under a bandwidth profile.")
    p.add_argument("trace", nargs="+", metavar="TRACE", help="routing trace file(s)")
    p.add_argument("--policy", type=policies, default=policies(DEFAULT_POLICIES), metavar="LIST",
                   help=f"comma-separated policies (default {DEFAULT_POLICIES})")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--cache-slots", type=arg_types.comma_list(arg_types.positive_int, "--cache-slots"), metavar="LIST",
                      help="comma-separated cache sizes in slots (shared by all MoE layers)")
    size.add_argument("--cache-fraction", type=arg_types.comma_list(arg_types.fraction, "--cache-fraction"), metavar="LIST",
                      help=f"comma-separated cache sizes as fractions of the L*E experts (default {DEFAULT_FRACTIONS})")
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="also plot ms per token against the cache size (matplotlib: "
                                                      "pip install 'ft-jax[plot]')")


DEFAULT_POLICIES = "fetch-all,host-all,qstar,fixed-cap:1,auto"
DEFAULT_FRACTIONS = "0.1,0.25,0.5"


def slot_counts(args, trace: Trace) -> list[int]:
    """Cache sizes in slots from --cache-slots or --cache-fraction (round(f * L*E), at least 1). Raises ValueError."""
    total = trace.num_layers * trace.num_experts
    if args.cache_slots is not None:
        bad = [s for s in args.cache_slots if not 1 <= s <= total]
        if bad:
            raise ValueError(f"--cache-slots must be in [1, L*E = {total}], got {bad}")
        return list(args.cache_slots)
    fractions = args.cache_fraction or [float(f) for f in DEFAULT_FRACTIONS.split(",")]
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad:
        raise ValueError(f"--cache-fraction must be in (0, 1], got {bad}")
    return [max(1, round(f * total)) for f in fractions]


def report(trace: Trace, model: CostModel, results: list[dict], carry_cache: bool, batch: bool) -> dict:
    """The JSON object of `ft-jax trace --json`: results plus what was replayed and how it was priced."""
    return {"results": results, "skipped_tokens": trace.skipped_tokens,
            "sequences": [{"name": s.name, "tokens": len(s.token_idx), "skipped": s.skipped} for s in trace.sequences],
            "tokens": trace.tokens, "trace": trace.paths, "num_layers": trace.num_layers,
            "num_experts": trace.num_experts, "top_k": trace.top_k, "carry_cache": carry_cache, "batch": batch,
            "cost_model": {**dataclasses.asdict(model), "bp_contended_used": model.pair[0],
                           "bh_contended_used": model.pair[1], "qstar_fraction": model.fraction}}


def format_table(rep: dict) -> str:
    """Human-readable table of a report(): one row per (cache size, policy), with each row's ms relative to the best
    policy at that size."""
    seqs = ", ".join(f"{s['name']} {s['tokens']}" for s in rep["sequences"])
    cm = rep["cost_model"]
    lines = [f"trace {', '.join(rep['trace'])}: {rep['tokens']} tokens ({seqs}), {rep['skipped_tokens']} incomplete "
             f"skipped; L = {rep['num_layers']} MoE layers x E = {rep['num_experts']}, top-{rep['top_k']}; "
             + ("one cache carried across sequences" if rep["carry_cache"] else "cold cache per sequence"),
             f"cost model: {CostModel(**{k: cm[k] for k in (f.name for f in dataclasses.fields(CostModel))}).describe()}",
             f"  bandwidths: {cm['source']}", "",
             f"{'slots':>6} {'frac':>5}  {'policy':<16} {'hit rate':>8} {'fetched/tok':>11} {'host/tok':>9} "
             f"{'ms/token':>10} {'vs best':>8}"]
    for S in dict.fromkeys(r["cache_slots"] for r in rep["results"]):
        group = [r for r in rep["results"] if r["cache_slots"] == S]
        best = min(r["ms_per_token"] for r in group)
        for r in group:
            lines.append(f"{S:>6} {r['cache_fraction']:>5.2f}  {r['bound']:<16} {100 * r['hit_rate']:>7.1f}% "
                         f"{r['fetched_per_token']:>11.2f} {r['host_per_token']:>9.2f} {r['ms_per_token']:>10.2f} "
                         f"{r['ms_per_token'] / best if best > 0 else 1.0:>7.3f}x")
    lines += ["", "per token, summed over the MoE layers; vs best = ms/token over the best policy at that cache size"]
    return "\n".join(lines)


def plot(rep: dict, path: str) -> None:
    """ms per token against the cache fraction, one line per policy, saved as a PNG. Raises ImportError (no
    matplotlib) or OSError."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'ft-jax[plot]' (or pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["bound"] for r in rep["results"]):
        rows = [r for r in rep["results"] if r["bound"] == policy]
        ax.plot([100 * r["cache_fraction"] for r in rows], [r["ms_per_token"] for r in rows], marker="o", label=policy)
    ax.set_xlabel("cache size, % of all experts")
    ax.set_ylabel("modelled MoE ms per token")
    ax.set_title(os.path.basename(rep["trace"][0]))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_trace(args) -> int:
    """`ft-jax trace`: returns the exit status; bad input raises ValueError / OSError / ImportError."""
    import sys

    trace, model = load_inputs(args)
    sizes = slot_counts(args, trace)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError("--plot needs matplotlib: pip install 'ft-jax[plot]' (or pip install matplotlib)") \
                from None

    def progress(done, total):
        if not args.json and sys.stderr.isatty():
            sys.stderr.write(f"\r\033[Kft-jax trace: replayed {done} of {total}")
            sys.stderr.flush()

    results = evaluate(trace, args.policy, sizes, model, carry_cache=args.carry_cache, batch=args.batch,
                       progress=progress)
    if not args.json and sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    rep = report(trace, model, results, args.carry_cache, args.batch)
    if args.plot:
        plot(rep, args.plot)
    print(json.dumps(rep, indent=1) if args.json else format_table(rep))
    return 0
