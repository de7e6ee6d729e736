#!/usr/bin/env python3
"""Synthetic routing traces of a 60-expert top-4 MoE (the shape of Qwen1.5-MoE-A2.7B: 24 MoE layers, 60 routed
experts, top-4, plus shared experts that are always on the device and so never appear in a trace).

Writes the JSON-lines trace format of docs/policies.md (one record per sequence, generated token and MoE layer;
"dataset" = the shape's name, "problem_id" = the sequence) or, for a file name ending in .npz, its column form.
Every draw comes from numpy's default_rng([seed, shape index]): the same seed gives the same file.

Shapes (each token picks top_k distinct experts per layer; "popularity" is a per-layer Zipf law p_r ~ 1 / r^s over
the ranks r = 1..E, the ranks assigned to experts by a random permutation):
  uniform   every expert equally likely, no temporal reuse.
  skewed    one Zipf popularity per layer (s = --zipf, default 1.0) shared by all sequences, no reuse.
  reused    the skewed popularity, and each of a token's top_k picks is, with probability p (--reuse, default
            0.6), one of the previous token's experts in that layer (uniformly among those not picked yet).
  local     per-sequence popularity: every sequence draws its own permutation (s default 0.8), as a
            load-balancing loss makes the popularity flat over a corpus while a prompt still prefers some
            experts; reuse p default 0.25 (the real Mixtral trace in ../shared/traces routes ~0.15 of a token's
            picks per layer beyond chance to the previous token's experts).
  drift     the skewed popularity re-permuted per layer at phase boundaries (phase lengths geometric with mean
            --phase tokens, default 50: topic shifts within a generation); reuse p default 0.25.

    python3 scripts/synthetic_traces.py uniform skewed reused local drift --out-dir /tmp/syn --seed 0
    python3 scripts/trace_targets.py /tmp/syn/*.jsonl --expert-bytes 17301504

17301504 bytes = one Qwen1.5-MoE-A2.7B expert in bf16 (gate, up and down projections, 3 x 2048 x 1408 x 2 bytes).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ft_jax.tools.trace_io import write_trace

SHAPES = ("uniform", "skewed", "reused", "local", "drift")
# Per-shape defaults: (Zipf exponent s, reuse probability p); s = 0 is uniform, p = 0 no temporal reuse.
DEFAULTS = {"uniform": (0.0, 0.0), "skewed": (1.0, 0.0), "reused": (1.0, 0.6), "local": (0.8, 0.25),
            "drift": (1.0, 0.25)}


def zipf_popularity(rng: np.random.Generator, num_experts: int, s: float) -> np.ndarray:
    """f64[E] probabilities p[e] = r(e)^-s / sum_r r^-s, r = a random permutation of the ranks 1..E (s = 0:
    uniform)."""
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -s  # f64[E] by rank
    return rng.permutation(weights) / weights.sum()


def draw_token(rng: np.random.Generator, pop: np.ndarray, top_k: int, previous: np.ndarray | None,
               reuse: float) -> np.ndarray:
    """i64[top_k] distinct expert ids: each pick is, with probability `reuse`, one of `previous` (i64[k'], the
    previous token's experts) not picked yet, else drawn from pop (f64[E]) over the experts not picked yet."""
    free = np.ones(len(pop), bool)  # bool[E] not picked yet
    picks = []
    for _ in range(top_k):
        candidates = [] if previous is None else [e for e in previous if free[e]]
        if candidates and rng.random() < reuse:
            e = int(candidates[rng.integers(len(candidates))])
        else:
            p = np.where(free, pop, 0.0)
            e = int(rng.choice(len(pop), p=p / p.sum()))
        free[e] = False
        picks.append(e)
    return np.array(picks, np.int64)


def generate(shape: str, *, num_layers: int = 24, num_experts: int = 60, top_k: int = 4, sequences: int = 2,
             tokens: int = 200, seed: int = 0, zipf: float | None = None, reuse: float | None = None,
             phase: float = 50.0) -> np.ndarray:
    """Routing of one shape (module docstring): i64[sequences, tokens, num_layers, top_k] expert ids.

    Args:
        shape: one of SHAPES. zipf, reuse: override the shape's defaults (DEFAULTS). phase: drift's mean phase
            length in tokens. seed: with the shape's index, the seed of numpy's default_rng.
    Raises:
        ValueError: unknown shape, top_k > num_experts, a dimension < 1, zipf < 0, reuse outside [0, 1], phase < 1.
    """
    if shape not in SHAPES:
        raise ValueError(f"synthetic_traces: unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k),
                    ("sequences", sequences), ("tokens", tokens)):
        if v < 1:
            raise ValueError(f"synthetic_traces: {name} must be >= 1, got {v}")
    if top_k > num_experts:
        raise ValueError(f"synthetic_traces: top_k {top_k} > num_experts {num_experts}")
    s0, p0 = DEFAULTS[shape]
    s = s0 if zipf is None else float(zipf)
    p = p0 if reuse is None else float(reuse)
    if s < 0 or not 0 <= p <= 1 or phase < 1:
        raise ValueError(f"synthetic_traces: need zipf >= 0, reuse in [0, 1], phase >= 1; got {s}, {p}, {phase}")
    rng = np.random.default_rng([seed, SHAPES.index(shape)])
    shared = [zipf_popularity(rng, num_experts, s) for _ in range(num_layers)]  # L x f64[E]
    out = np.zeros((sequences, tokens, num_layers, top_k), np.int64)
    for q in range(sequences):
        pops = [zipf_popularity(rng, num_experts, s) for _ in range(num_layers)] if shape == "local" else \
            list(shared)
        for t in range(tokens):
            if shape == "drift" and t and rng.random() < 1.0 / phase:  # a new phase: every layer re-permuted
                pops = [zipf_popularity(rng, num_experts, s) for _ in range(num_layers)]
            for layer in range(num_layers):
                previous = out[q, t - 1, layer] if t else None
                out[q, t, layer] = draw_token(rng, pops[layer], top_k, previous, p)
    return out


def records(shape: str, routing: np.ndarray) -> list[dict]:
    """Trace records (docs/policies.md) of routing i64[Q, N, L, k], layer-major within a sequence like the shared
    Mixtral trace."""
    Q, N, L, _ = routing.shape
    return [{"dataset": shape, "problem_id": q, "layer": layer, "token_idx": t,
             "experts": [int(e) for e in routing[q, t, layer]]}
            for q in range(Q) for layer in range(L) for t in range(N)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="+", choices=SHAPES, metavar="SHAPE", help=f"one or more of {', '.join(SHAPES)}")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out-dir", help="write DIR/SHAPE.jsonl for each shape")
    where.add_argument("--out", help="write one shape to this file (.jsonl, or .npz for the column form)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=60)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--tokens", type=int, default=200, help="generated tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zipf", type=float, help="Zipf exponent s (default: the shape's)")
    p.add_argument("--reuse", type=float, help="probability a pick repeats a previous-token expert (default: the "
                                                "shape's)")
    p.add_argument("--phase", type=float, default=50.0, help="drift: mean phase length in tokens")
    args = p.parse_args(argv)
    if args.out and len(args.shapes) != 1:
        p.error("--out takes one shape; use --out-dir for several")
    try:
        for shape in args.shapes:
            routing = generate(shape, num_layers=args.layers, num_experts=args.experts, top_k=args.top_k,
                               sequences=args.sequences, tokens=args.tokens, seed=args.seed, zipf=args.zipf,
                               reuse=args.reuse, phase=args.phase)
            path = args.out or os.path.join(args.out_dir, f"{shape}.jsonl")
            if args.out_dir:
                os.makedirs(args.out_dir, exist_ok=True)
            n = write_trace(path, records(shape, routing))
            print(f"{path}: {n} records ({args.sequences} sequences x {args.tokens} tokens x {args.layers} layers, "
                  f"top-{args.top_k} of {args.experts})")
    except (ValueError, OSError) as e:
        print(e if str(e).startswith("synthetic_traces: ") else f"synthetic_traces: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
