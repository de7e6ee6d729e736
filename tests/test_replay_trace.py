"""scripts/replay_trace.py: trace parsing, replay against the plain-Python cache reference, the time model, the CLI.

The trace is synthetic (written to tmp_path in the real trace's JSON-lines format), so no third-party data is needed.
"""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from cache_reference import ReferenceCache
from ft_jax.offload.policy import Policy

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "replay_trace.py")
L, E, K = 3, 8, 4  # up to 4 misses per layer, so qstar splits them


@pytest.fixture(scope="module")
def rt():
    spec = importlib.util.spec_from_file_location("replay_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _routing(seed):
    """{sequence: i64[N, L, K] distinct expert ids per (token, layer)}: two sequences of 7 and 5 tokens."""
    rng = np.random.default_rng(seed)
    return {p: np.array([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(n)])
            for p, n in ((0, 7), (1, 5))}


def _write_trace(path, routing, drop=()):
    """Write routing in the trace format; (problem, token, layer) in `drop` are left out (incomplete tokens)."""
    with open(path, "w") as f:
        for p, ids in routing.items():
            for layer in range(L):  # layer-major order, as the real trace is stored
                for t in range(len(ids)):
                    if (p, t, layer) in drop:
                        continue
                    f.write(json.dumps({"dataset": "synthetic", "problem_id": p, "layer": layer, "token_idx": t,
                                        "experts": [int(e) for e in ids[t, layer]],
                                        "gating_probs": [1 / K] * K}) + "\n")


def _reference(sequences_ids, policy, S, carry):
    """i32[N, L, 5] per-(token, layer) stats of tests/cache_reference.py over the sequences' token routing."""
    out, ref = [], None
    for ids in sequences_ids:
        if ref is None or not carry:
            ref = ReferenceCache(L, E, S)
        for token in ids:
            for layer in range(L):
                active = np.zeros(E, bool)
                active[token[layer]] = True
                out.append(ref.plan(layer, active, policy)["stats"])
    return np.array(out, np.int32).reshape(-1, L, 5)


def test_load_skips_incomplete_tokens(rt, tmp_path):
    routing = _routing(0)
    path = tmp_path / "trace.jsonl"
    _write_trace(path, routing, drop={(0, 6, 2), (1, 2, 0)})  # last token of seq 0, a middle token of seq 1
    seqs = rt.load_trace(str(path))
    assert [s.name for s in seqs] == ["synthetic/0", "synthetic/1"]
    assert [s.skipped for s in seqs] == [1, 1]
    assert seqs[0].token_idx.tolist() == [0, 1, 2, 3, 4, 5]
    assert seqs[1].token_idx.tolist() == [0, 1, 3, 4]
    assert seqs[1].active.shape == (4, L, E)
    expected = np.zeros((E,), bool)
    expected[routing[1][3, 1]] = True
    np.testing.assert_array_equal(seqs[1].active[2, 1], expected)
    assert seqs[0].active.sum() == 6 * L * K


@pytest.mark.parametrize("carry", [False, True])
def test_replay_matches_reference_cache(rt, tmp_path, carry):
    routing = _routing(1)
    path = tmp_path / "trace.jsonl"
    _write_trace(path, routing)
    seqs = rt.load_trace(str(path))
    # S = 3 < K: fetch-all is capped by the evictable slots and sends the rest to the host. (3 compiles in all:
    # test_cli_json reuses the fetch-all and host-all ones.)
    cases = [(Policy("fetch-all"), 3), (Policy("host-all"), 3), (Policy("qstar", frac=0.415), 3)]
    for policy, S in cases:
        got = rt.replay(seqs, policy, S, carry_cache=carry)
        want = _reference([routing[0], routing[1]], policy, S, carry)
        np.testing.assert_array_equal(got, want, err_msg=f"{policy} S={S} carry={carry}")
        if policy.kind != "host-all":  # the case really split misses between fills and the host
            assert want[..., 3].sum() > 0 and want[..., 4].sum() > 0
    assert want[..., 0].sum() == 12 * L * K  # every route counted once


def test_summarize_hand_worked(rt):
    # 2 tokens x 2 layers; columns (active, hits, misses, fetched, host).
    stats = np.array([[[2, 0, 2, 1, 1], [2, 1, 1, 0, 1]],
                      [[2, 2, 0, 0, 0], [2, 0, 2, 2, 0]]], np.int32)
    s = rt.summarize(stats, expert_bytes=1e9, bp=1.0, bh=4.0)  # 1 s per fetched expert, 0.25 s per host expert
    assert s["hit_rate"] == pytest.approx(3 / 8)
    assert s["fetched_per_token"] == pytest.approx(1.5) and s["host_per_token"] == pytest.approx(1.0)
    # token 0: max(1 * 1, 2 * 0.25) = 1 s; token 1: max(2 * 1, 0) = 2 s -> mean 1.5 s
    assert s["model_ms"] == pytest.approx(1500.0)
    # token 0: layer 0 max(1, 0.25) + layer 1 max(0, 0.25) = 1.25 s; token 1: 0 + 2 = 2 s -> mean 1.625 s
    assert s["serial_ms"] == pytest.approx(1625.0)


def test_cli_json(rt, tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    _write_trace(path, _routing(2), drop={(1, 4, 1)})
    # fetch-all and host-all at S = 3 were compiled by the test above (same jit cache): no new compile here.
    assert rt.main([str(path), "--slots", "3", "--policies", "fetch-all,host-all", "--bp", "2", "--bh", "8",
                    "--expert-bytes", "1000000000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 11 and report["num_layers"] == L and report["num_experts"] == E
    assert report["qstar_fraction"] == pytest.approx(0.25)  # min(1, BP/BH)
    assert [r["policy"] for r in report["rows"]] == ["fetch-all", "host-all"]
    fetch_all, host_all = report["rows"]
    assert fetch_all["vs_fetch_all"] == 1.0
    assert fetch_all["hits_per_token"] + fetch_all["fetched_per_token"] + fetch_all["host_per_token"] == L * K
    # fetch-all at S = 3 < K also computes some misses on the host: per layer max(F * 0.5 s, H * 0.125 s) lies
    # between F * 0.5 s and (F + H) * 0.5 s, and F + H <= K.
    assert fetch_all["fetched_per_token"] * 500.0 <= fetch_all["serial_ms"] <= L * K * 500.0
    assert host_all["hit_rate"] == 0 and host_all["host_per_token"] == L * K  # the cache stays empty
    assert host_all["serial_ms"] == pytest.approx(L * K * 125.0)  # 1 GB / 8 GB/s per expert
    assert host_all["vs_fetch_all"] == pytest.approx(fetch_all["serial_ms"] / host_all["serial_ms"])


def test_bad_traces(rt, tmp_path):
    path = tmp_path / "bad.jsonl"
    record = {"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}
    path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: duplicate record"):
        rt.load_trace(str(path))
    path.write_text(json.dumps({**record, "experts": [1, 9]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expert id 9 out of range \[0, 8\)"):
        rt.load_trace(str(path), num_experts=8)
    path.write_text('{"problem_id": 0, "layer": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a routing record"):
        rt.load_trace(str(path))
