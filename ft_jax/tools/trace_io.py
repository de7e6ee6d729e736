"""Routing traces: read and write them (JSON lines or the .npz column form).

A routing trace says which experts every generated token routed to in every MoE layer (``ft-jax generate
--record-trace`` writes it). JSON lines, one object per (sequence, generated token, MoE layer):
    {"dataset": str, "problem_id": int, "layer": int, "token_idx": int, "experts": [e0, e1, ...],
     "gating_probs": [p0, ...]}
A sequence is one (dataset, problem_id); "dataset" and "gating_probs" are optional. The .npz form holds the same
records as columns: names (str[Q], "dataset/problem_id"), sequence (i32[R] index into names), token_idx (i64[R]),
layer (i32[R]), experts (i32[R, K], -1 = padding) and optionally gating_probs (f32[R, K]). Tokens missing some
layer (a collector artefact at the end of a sequence) are skipped and counted; a malformed record is an error
naming the file and line (or record index).
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
import os
from typing import Iterable, Sequence as Seq

import numpy as np


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
        top_k: the number of experts every record routes to (k).
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
    except (FileNotFoundError, PermissionError):
        raise  # named by _named_errors as for JSON lines
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable .npz routing trace: a trace named .npz must be the zip of arrays "
                         f"that routing_records/write_trace writes ({type(e).__name__})") from None
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


def _named_errors(path: str, reader):
    """reader(path)'s records; a file that cannot be opened or is not text becomes an error naming the file."""
    if os.path.isdir(path):
        raise ValueError(f"trace: {path} is a directory, expected a trace file (JSON lines or .npz)")
    try:
        yield from reader(path)
    except FileNotFoundError:
        raise ValueError(f"trace: {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"trace: {path} is not a JSON-lines text file (byte {e.start} is not UTF-8); a routing "
                         "trace is JSON lines or .npz") from None
    except PermissionError:
        raise ValueError(f"trace: {path} cannot be read (permission denied)") from None


def read_trace(paths: str | Seq[str], num_layers: int | None = None, num_experts: int | None = None) -> Trace:
    """Read routing traces (JSON lines, or .npz by file name) into per-sequence active masks (format: module docstring).

    Args:
        paths: one file or several (their sequences are concatenated; a name in two files is one sequence).
        num_layers: L (default: largest layer + 1). num_experts: E (default: largest expert id + 1).
    Returns:
        Trace; each sequence keeps only the tokens that have all L layers.
    Raises:
        ValueError: a record is malformed, negative, out of range, has no or repeated experts, routes to another
            number of experts than the first record, or repeats a (sequence, token, layer); files whose largest layer
            differs (when num_layers is not given); or no token is complete. The message names the file and line
            (record).
        OSError: a file cannot be read.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("trace: no trace file given")
    rows = []  # (where, name, token, layer, experts)
    file_layers = {}  # path -> its largest layer + 1
    for path in paths:
        path = os.fspath(path)
        reader = _records_npz if path.endswith(".npz") else _records_jsonl
        for where, name, token, layer, experts in _named_errors(path, reader):
            if token < 0 or layer < 0:
                raise ValueError(f"{where}: token_idx and layer must be >= 0, got {token}, {layer}")
            if not experts or min(experts) < 0:
                raise ValueError(f"{where}: experts must be a non-empty list of ids >= 0, got {experts}")
            if len(set(experts)) != len(experts):
                raise ValueError(f"{where}: an expert appears twice in {experts}")
            rows.append((where, name, token, layer, experts))
            file_layers[path] = max(file_layers.get(path, 0), layer + 1)
    if not rows:
        raise ValueError(f"trace: no routing records in {', '.join(map(str, paths))}")
    k = len(rows[0][4])  # a trace holds one model's top-k routing
    other = next((r for r in rows if len(r[4]) != k), None)
    if other is not None:
        raise ValueError(f"{other[0]}: {len(other[4])} experts, where {rows[0][0]} has {k} (a trace holds one "
                         "model's top-k routing)")
    if num_layers is None and len(set(file_layers.values())) > 1:  # L from the records: every file's the same
        raise ValueError("trace: the files disagree on the MoE layers: " + ", ".join(
            f"{file} has {n}" for file, n in file_layers.items()) + " (traces of one model; or give num_layers / "
            "--num-layers)")
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
        why = ""
        if num_layers is None:  # L came from the largest layer index: name the record that set it
            top = max(rows, key=lambda r: r[3])
            why = (f" (L = {L} from the largest layer index, {top[3]} at {top[0]}; give num_layers / --num-layers "
                   "to set it)")
        raise ValueError(f"trace: no token of {', '.join(map(str, paths))} has all {L} MoE layers{why}")
    return Trace(sequences, int(L), int(E), k, [os.fspath(p) for p in paths])


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
