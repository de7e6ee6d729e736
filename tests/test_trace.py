"""ft_jax/tools (trace_io, replay, plan) and ft_jax/offload/cost_model.py: trace files, replay against the plain-Python cache reference, the cost model
worked by hand, the `ft-jax trace` / `ft-jax plan` commands, and a trace recorded by the decode step replayed.

Traces here are synthetic (written to tmp_path in the shared trace's JSON-lines format) or recorded from the tiny
Mixtral fixture, so no third-party data is needed.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache_reference import ReferenceCache
from ft_jax import cli
from ft_jax.offload import profile as bandwidth
from ft_jax.offload.cache import CacheState
from ft_jax.offload.policy import Policy, auto_layer_ticks, parse_policy
from ft_jax.offload.cost_model import CostModel
from ft_jax.offload.policy import bind_policy
from ft_jax.tools.replay import evaluate, replay
from ft_jax.tools.trace_io import read_trace, routing_records, write_trace

L, E, K = 3, 60, 4  # 60 experts top-4 (the held-back model's shape), 3 MoE layers
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
GB = 10**9


def _routing(seed, lengths=(9, 6), hot=None):
    """{problem: i64[N, L, K]} distinct expert ids per (token, layer), drawn from a skewed popularity; with `hot`,
    each token repeats its previous token's experts with that probability (temporal reuse)."""
    rng = np.random.default_rng(seed)
    pop = rng.dirichlet(np.full(E, 0.3))
    out = {}
    for p, n in enumerate(lengths):
        ids = np.zeros((n, L, K), np.int64)
        for t in range(n):
            for layer in range(L):
                if hot is not None and t and rng.random() < hot:
                    ids[t, layer] = ids[t - 1, layer]
                else:
                    ids[t, layer] = rng.choice(E, K, replace=False, p=pop)
        out[p] = ids
    return out


def _write(path, routing, drop=()):
    """The routing as trace records (layer-major like the shared trace); (problem, token, layer) in drop left out."""
    recs = [{"dataset": "synthetic", "problem_id": p, "layer": layer, "token_idx": t,
             "experts": [int(e) for e in ids[t, layer]], "gating_probs": [1 / K] * K}
            for p, ids in routing.items() for layer in range(L) for t in range(len(ids)) if (p, t, layer) not in drop]
    write_trace(str(path), recs)
    return recs


def _reference_stats(routing_list, policy, S, carry=False):
    """i32[N, L, 5] stats of tests/cache_reference.py over the sequences' tokens, each sequence cold unless carry."""
    out, ref = [], None
    for ids in routing_list:
        if ref is None or not carry:
            ref = ReferenceCache(L, E, S, auto=policy.kind == "auto")
        for token in ids:
            for layer in range(L):
                active = np.zeros(E, bool)
                active[token[layer]] = True
                out.append(ref.plan(layer, active, policy)["stats"])
    return np.array(out, np.int32).reshape(-1, L, 5), ref


def test_read_skips_incomplete_tokens_and_npz_roundtrip(tmp_path):
    routing = _routing(0)
    recs = _write(tmp_path / "t.jsonl", routing, drop={(0, 8, 2), (1, 2, 0)})  # last token of 0, middle of 1
    t = read_trace(str(tmp_path / "t.jsonl"))
    assert [s.name for s in t.sequences] == ["synthetic/0", "synthetic/1"]
    assert [s.skipped for s in t.sequences] == [1, 1] and t.skipped_tokens == 2 and t.tokens == 8 + 5
    assert t.sequences[1].token_idx.tolist() == [0, 1, 3, 4, 5]
    assert (t.num_layers, t.num_experts, t.top_k) == (L, int(max(r["experts"][i] for r in recs for i in range(K))) + 1,
                                                      K)
    want = np.zeros(t.num_experts, bool)
    want[routing[1][3, 1]] = True
    np.testing.assert_array_equal(t.sequences[1].active[2, 1], want)
    write_trace(str(tmp_path / "t.npz"), recs)
    z = read_trace(str(tmp_path / "t.npz"), num_experts=E)
    assert [s.name for s in z.sequences] == [s.name for s in t.sequences]
    for a, b in zip(z.sequences, t.sequences):
        np.testing.assert_array_equal(a.token_idx, b.token_idx)
        np.testing.assert_array_equal(a.active[..., :t.num_experts], b.active)
        assert a.skipped == b.skipped


def test_bad_traces_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    rec = {"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}
    cases = [
        (json.dumps(rec) + "\n{not json\n", r"bad.jsonl:2: not a routing record"),
        (json.dumps(rec) + "\n" + json.dumps(rec) + "\n", r"bad.jsonl:2: a second record .* token 0, layer 0"),
        (json.dumps({**rec, "experts": [1, 9]}) + "\n", r"bad.jsonl:1: expert id 9 out of range \[0, 8\)"),
        (json.dumps({**rec, "experts": []}) + "\n", r"bad.jsonl:1: experts must be a non-empty"),
        (json.dumps({**rec, "experts": [3, 3]}) + "\n", r"bad.jsonl:1: an expert appears twice"),
        (json.dumps({**rec, "layer": "0"}) + "\n", r"bad.jsonl:1: not a routing record"),
        (json.dumps({**rec, "layer": 1}) + "\n", r"no token .* has all 2 MoE layers"),
    ]
    for text, msg in cases:
        path.write_text(text)
        with pytest.raises(ValueError, match=msg):
            read_trace(str(path), num_layers=2 if "all 2" in msg else None, num_experts=8)


def _auto(expert_bytes=GB, bp=2.0, **kw):
    """auto bound to a cost model in which both paths and the reuse credit matter."""
    model = CostModel(expert_bytes=expert_bytes, bp=bp, bh=8.0, device_bandwidth=50.0, **kw)
    return bind_policy(parse_policy("auto"), model), model


@pytest.mark.parametrize("carry", [False, True])
def test_replay_matches_reference_step_by_step(tmp_path, carry):
    """Every (token, layer) of the replay equals tests/cache_reference.py: 60 experts top-4, S = 8 slots (2 tokens'
    worth), two reuse patterns, for every policy including auto."""
    S = 8
    auto, _ = _auto()
    policies = [auto] if carry else [Policy("fetch-all"), Policy("host-all"), Policy("qstar", frac=0.415),
                                     Policy("fixed-cap", cap=1), auto]
    for seed, hot in ((1, None), (2, 0.7)):
        routing = _routing(seed, hot=hot)
        _write(tmp_path / "t.jsonl", routing)
        trace = read_trace(str(tmp_path / "t.jsonl"), num_experts=E)
        for policy in policies:
            got = replay(trace, policy, S, carry_cache=carry)
            want, ref = _reference_stats([routing[0], routing[1]], policy, S, carry)
            np.testing.assert_array_equal(got.stats, want, err_msg=f"{policy} hot={hot} carry={carry}")
            for name, value in ref.arrays().items():  # the last sequence's final tables (auto: and lanes)
                have = getattr(got.state, name)
                for field, want_value in (value.items() if name == "lanes" else [(None, value)]):
                    np.testing.assert_array_equal(np.asarray(have if field is None else getattr(have, field)),
                                                  want_value, err_msg=f"{name} {field}")
            if policy.kind == "auto":
                assert want[..., 3].sum() > 0 and want[..., 4].sum() > 0  # it really split misses
    assert want[..., 0].sum() == 15 * L * K  # every route counted once


def test_cost_model_two_layers_by_hand():
    """1 GB experts: fill 1 GB/s alone, 0.5 contended; host 4 GB/s alone, 2 contended; device 10 GB/s; fixed ms:
    fill 10, host 20, device 5.
    Layer 0: F=1, H=2, 1 hit (D=2). Contended: fill 2000 ms, host 1000 ms, so the host ends first at 1000 (+20 =
    1020); by then the fill moved 0.5 GB, the other 0.5 GB at 1 GB/s take 500 ms: fill end 1500 + 10 = 1510; the
    device then takes 5 + 2 * 100 = 205: layer 1715 ms.
    Layer 1: F=0, H=1, 2 hits: host 250 + 20 = 270, device 5 + 200 = 205 from t = 0: layer 270 ms.
    Token: 1985 ms."""
    m = CostModel(expert_bytes=GB, bp=1.0, bh=4.0, bp_contended=0.5, bh_contended=2.0, device_bandwidth=10.0,
                     fill_fixed_ms=10.0, host_fixed_ms=20.0, device_fixed_ms=5.0)
    assert m.paths_ms(1, 2) == pytest.approx((1510.0, 1020.0))
    assert m.layer_ms(1, 2, 2) == pytest.approx(1715.0)
    assert m.layer_ms(0, 1, 2) == pytest.approx(270.0)
    stats = np.array([[[4, 1, 3, 1, 2], [3, 2, 1, 0, 1]]], np.int32)  # (active, hits, misses, fetched, host)
    assert m.token_ms(stats) == pytest.approx([1985.0])
    # The fill ends first: F=1, H=8: fill 2000 ms contended; the host read 2000 * 2 = 4 GB by then, the other
    # 4 GB at 4 GB/s take 1000 ms: host end 3000 + 20.
    assert m.paths_ms(1, 8) == pytest.approx((2010.0, 3020.0))
    # No measured pair: BPc = BP, BHc = BH - BP.
    assert CostModel(expert_bytes=GB, bp=1.0, bh=4.0).pair == (1.0, 3.0)
    # auto decides with the same model in integer ticks (tick = 1000 / 1024 ms here).
    costs = bind_policy(parse_policy("auto"), m).costs
    assert costs.tick_ms == pytest.approx(1000 / 1024)
    for F, H, hits in ((1, 2, 1), (0, 1, 2), (1, 8, 0), (3, 0, 1), (2, 2, 0)):
        ticks = int(auto_layer_ticks(costs, F + H, hits, F))
        assert ticks * costs.tick_ms == pytest.approx(m.layer_ms(F, H, hits + F), abs=3 * costs.tick_ms)


def test_trace_cli_json_and_help(tmp_path, capsys):
    _write(tmp_path / "t.jsonl", _routing(3), drop={(1, 5, 1)})
    status = cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                       "--bandwidth", "2,8", "--device-bandwidth", "50", "--cache-slots", "8,16",
                       "--policy", "fetch-all,host-all,auto", "--json"])
    out = capsys.readouterr().out
    assert status == 0
    rep = json.loads(out)
    assert rep["skipped_tokens"] == 1 and rep["tokens"] == 14
    assert [s["tokens"] for s in rep["sequences"]] == [9, 5]
    assert [(r["policy"], r["cache_slots"]) for r in rep["results"]] == [
        (p, s) for s in (8, 16) for p in ("fetch-all", "host-all", "auto")]
    for r in rep["results"]:
        assert {"policy", "cache_slots", "hit_rate", "fetched_per_token", "host_per_token", "ms_per_token"} <= set(r)
        assert r["hits_per_token"] + r["fetched_per_token"] + r["host_per_token"] == pytest.approx(L * K)
    host_all = rep["results"][1]
    # host-all never fills the cold cache: 4 host experts per layer at BH = 8 GB/s, 125 ms each, no contention.
    assert host_all["hit_rate"] == 0 and host_all["ms_per_token"] == pytest.approx(L * K * 125.0)
    assert rep["cost_model"]["bh_contended_used"] == 6.0  # BH - BP without a measured pair
    with pytest.raises(SystemExit):
        cli.main(["trace", "--help"])
    text = capsys.readouterr().out
    for needle in ("pull/38", "205", "55", "6526Y", "contended", "fixed cost"):
        assert needle in text, needle


def test_cache_fraction_with_devices_is_of_each_devices_experts(tmp_path, capsys):
    """--devices N --cache-fraction f: f of the L*E/N experts a device owns (as generate --devices reads it), and the
    frac column per device too."""
    _write(tmp_path / "t.jsonl", _routing(3))
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                     "--bandwidth", "2,8", "--cache-fraction", "0.5", "--devices", "1,2", "--policy", "fetch-all",
                     "--json"]) == 0
    one, two = json.loads(capsys.readouterr().out)["results"]
    assert (one.get("devices", 1), one["cache_slots"], one["cache_fraction"]) == (1, L * E // 2, 0.5)
    assert (two["devices"], two["cache_slots"], two["cache_fraction"]) == (2, L * E // 4, 0.5)


def test_cache_sizes_that_come_to_one_slot_count_give_one_row(tmp_path, capsys):
    """Two fractions that round to one slot count (and a count given twice) are replayed once: a fresh-user trial saw
    the same row printed twice."""
    _write(tmp_path / "t.jsonl", _routing(3))
    total = L * E
    close = [0.5, 0.5 + 0.4 / total]  # both round to L*E/2
    assert round(close[1] * total) == total // 2
    for flags in (["--cache-fraction", ",".join(map(str, close))], ["--cache-slots", "3,3,5"]):
        assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                         "--bandwidth", "2,8", "--policy", "fetch-all", "--json", *flags]) == 0
        rows = json.loads(capsys.readouterr().out)["results"]
        assert [r["cache_slots"] for r in rows] == ([total // 2] if flags[0] == "--cache-fraction" else [3, 5])
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                     "--bandwidth", "2,8", "--policy", "fetch-all", "--json", "--cache-slots", "3",
                     "--devices", "1,1"]) == 0  # a device count given twice (a second trial)
    assert len(json.loads(capsys.readouterr().out)["results"]) == 1


def test_cache_slots_beyond_what_a_device_owns_are_capped_with_a_note(tmp_path, capsys):
    """--devices 1,2 --cache-slots with a count above the L*E/2 experts a device owns: the 2-device row is replayed
    at L*E/2 slots, and stderr says so (a fresh-user trial found the count changed without a word)."""
    _write(tmp_path / "t.jsonl", _routing(3))
    own = L * E // 2
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                     "--bandwidth", "2,8", "--policy", "fetch-all", "--json", "--cache-slots", f"2,{own + 1}",
                     "--devices", "1,2"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)["results"]
    assert [(r.get("devices", 1), r["cache_slots"]) for r in rows] == [(1, 2), (1, own + 1), (2, 2), (2, own)]
    assert f"--devices 2: a device owns {own} experts; cache sizes [{own + 1}] are replayed as {own} slots" in out.err
    # A device count that does not divide E is refused before any note or replay (the note came first: a trial).
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                     "--bandwidth", "2,8", "--cache-slots", f"{own + 1}", "--devices", f"2,{2 * E}"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"ft-jax trace: error: --devices {2 * E}: the {E} experts per MoE layer cannot be "
                                f"split evenly over {2 * E} devices (use one of "
                                f"{', '.join(str(d) for d in range(1, E + 1) if E % d == 0)})"], err


def test_batch_figures_are_per_token_not_per_step(tmp_path, capsys):
    """--batch replays a step of R rows (the union of their experts) and divides its figures by R: host-all on a
    cold cache computes every distinct expert of a step on the host, worked out here from the routing itself."""
    routing = _routing(5, lengths=(7, 7))
    _write(tmp_path / "t.jsonl", routing)
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                     "--bandwidth", "2,8", "--cache-slots", "8", "--policy", "host-all", "--batch", "--json"]) == 0
    host_all = json.loads(capsys.readouterr().out)["results"][0]
    distinct = np.mean([sum(len(set(routing[0][t, layer]) | set(routing[1][t, layer])) for layer in range(L))
                        for t in range(7)])  # distinct experts per step, summed over layers
    assert host_all["host_per_token"] == pytest.approx(distinct / 2)
    assert host_all["ms_per_token"] == pytest.approx(distinct / 2 * 125.0)  # 1 GB at 8 GB/s each
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                     "--bandwidth", "2,8", "--cache-slots", "8", "--policy", "host-all", "--batch"]) == 0
    assert "the 2 sequences are the rows of one decode step" in capsys.readouterr().out


def test_trace_cli_errors(tmp_path, capsys):
    _write(tmp_path / "t.jsonl", _routing(4))
    base = ["trace", str(tmp_path / "t.jsonl")]
    from ft_jax.defaults import bundled_model_path

    for extra, msg in [([], f"give --model DIR or --expert-bytes B (bytes of one expert) to price the replay (a trace "
                            f"of the bundled model: --model {bundled_model_path()})"),
                       (["--expert-bytes", "10", "--bandwidth", "nope"], "expected 'stored', a preset"),
                       (["--expert-bytes", "10", "--bandwidth", "1e-300,1e300"], "each from 1e-06 to 1e+06"),
                       (["--expert-bytes", "10", "--bandwidth", "nan,1"], "each from 1e-06 to 1e+06"),
                       (["--expert-bytes", "10", "--bandwidth", "1,2", "--device-bandwidth", "1e-300"],
                        "--device-bandwidth: expected a bandwidth in GB/s from 1e-06 to 1e+06, got '1e-300'"),
                       (["--expert-bytes", "10", "--bandwidth", "1,2", "--cache-slots", "0"], "--cache-slots: expected an integer >= 1")]:
        try:
            status = cli.main(base + extra)
        except SystemExit as e:  # argparse's own errors (a flag's type)
            status = e.code
        assert status == 2
        assert msg in capsys.readouterr().err


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _write(tmp_path / "t.jsonl", _routing(5))
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--bandwidth", "2,8",
                     "--cache-slots", "8,16", "--policy", "fetch-all,host-all", "--plot", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_into_a_missing_folder_is_one_line_before_the_replay(tmp_path, capsys):
    """--plot names its problem in one line, before anything is replayed (nothing is written), as generate's file
    flags do."""
    _write(tmp_path / "t.jsonl", _routing(5))
    target = tmp_path / "missing" / "p.png"
    status = cli.main(["trace", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--bandwidth", "2,8",
                       "--cache-slots", "8", "--plot", str(target)])
    out, err = capsys.readouterr()
    assert status == 2 and out == "", (out, err)
    assert err.strip().splitlines() == [f"ft-jax trace: error: --plot {target}: folder {target.parent} does not exist "
                                        "or is not writable"], err
    assert not target.parent.exists()


def test_resident_is_replayed_once_at_every_expert_and_left_out_where_the_budget_cannot_hold_them(tmp_path):
    """resident holds every expert in a slot whatever the cache size: evaluate gives it one row, last, at L*E slots
    (it gave a 100 % hit rate at each smaller size, labelled with that size), and plan leaves a given resident out of
    its candidates when the budget cannot hold every expert (it recommended resident at a budget of 73 of 256
    experts: found by a fresh-user trial); resident alone is an error there."""
    from ft_jax.tools import plan

    _write(tmp_path / "t.jsonl", _routing(6, hot=0.6))
    trace = read_trace(str(tmp_path / "t.jsonl"), num_experts=E)
    model = CostModel(expert_bytes=GB, bp=2.0, bh=8.0, device_bandwidth=50.0)  # hits are cheap: resident would win
    policies = [parse_policy(p) for p in ("resident", "auto", "host-all")]
    rows = evaluate(trace, policies, [2, 4], model)
    assert [(r["policy"], r["cache_slots"]) for r in rows] == [("auto", 2), ("host-all", 2), ("auto", 4),
                                                               ("host-all", 4), ("resident", L * E)]
    assert rows[-1]["hit_rate"] == 1.0 and rows[-1]["cache_fraction"] == 1.0
    small = plan.recommend(trace, model, 16 * GB, policies)  # 16 of the L * E experts
    assert small["dropped_candidates"] == ["resident"] and not small["resident"]
    assert "resident" not in {r["policy"] for r in small["results"]} and small["best"]["cache_slots"] <= 16
    fits = plan.recommend(trace, model, L * E * GB, policies)
    assert fits["resident"] and fits["dropped_candidates"] == []
    assert [r["cache_slots"] for r in fits["results"] if r["policy"] == "resident"] == [L * E]  # once, at L*E
    with pytest.raises(ValueError, match=rf"only resident, which needs all {L * E} experts .* the budget holds 16"):
        plan.recommend(trace, model, 16 * GB, [parse_policy("resident")])


def test_a_quantize_that_does_not_fit_the_experts_names_the_model(tmp_path, capsys):
    """trace --model M --quantize q8_0 on experts whose rows do not fit the blocks named only "a [64, 40] matrix"
    (generate names the tensor): the message names the flag, the model and its expert sizes."""
    d = tmp_path / "odd"
    shutil.copytree(os.path.join(FIXTURES, "mixtral"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (d / "config.json").write_text(json.dumps(cfg))
    _write(tmp_path / "t.jsonl", _routing(3))
    assert cli.main(["trace", str(tmp_path / "t.jsonl"), "--model", str(d), "--quantize", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ft-jax trace: error: --quantize q8_0: the experts of {d} (H={cfg['hidden_size']}, "
                          "I=40): ") and "do not fit q8_0" in err, err


def test_traces_that_disagree_are_refused_naming_the_record_or_files(tmp_path):
    """A record with another number of experts (it made the whole trace top-3), files of different layer counts (the
    shorter one was dropped as incomplete tokens, exit 0), and an inferred L that no token reaches (the message blamed
    every token) are errors naming the record or the files: found by a fresh-user trial."""
    recs = _write(tmp_path / "t.jsonl", _routing(3))
    odd = [dict(r) for r in recs]
    odd[5]["experts"] = odd[5]["experts"] + [E - 1 if E - 1 not in odd[5]["experts"] else 0]
    write_trace(str(tmp_path / "k.jsonl"), odd)
    with pytest.raises(ValueError, match=rf"k.jsonl:6: {K + 1} experts, where .*k.jsonl:1 has {K} "):
        read_trace(str(tmp_path / "k.jsonl"))
    write_trace(str(tmp_path / "short.jsonl"), [{**r, "dataset": "other"} for r in recs if r["layer"] < L - 1])
    with pytest.raises(ValueError, match=rf"the files disagree on the MoE layers: .*t.jsonl has {L}, .*short.jsonl "
                                         rf"has {L - 1}"):
        read_trace([str(tmp_path / "t.jsonl"), str(tmp_path / "short.jsonl")])
    assert read_trace([str(tmp_path / "t.jsonl"), str(tmp_path / "short.jsonl")], num_layers=L).num_layers == L
    far = [dict(r) for r in recs]
    far[7]["layer"] = 40
    write_trace(str(tmp_path / "far.jsonl"), far)
    with pytest.raises(ValueError, match=r"has all 41 MoE layers \(L = 41 from the largest layer index, 40 at "
                                         r".*far.jsonl:8; give num_layers"):
        read_trace(str(tmp_path / "far.jsonl"))


def test_plan_recommends_the_fastest_and_says_by_how_much(tmp_path, capsys):
    from ft_jax.tools import plan

    _write(tmp_path / "t.jsonl", _routing(6, hot=0.6))
    trace = read_trace(str(tmp_path / "t.jsonl"), num_experts=E)
    model = CostModel(expert_bytes=GB, bp=2.0, bh=8.0, device_bandwidth=50.0)
    policies = [parse_policy(p) for p in ("auto", "fetch-all", "host-all")]
    rec = plan.recommend(trace, model, 16 * GB, policies)
    assert rec["budget_slots"] == 16 and sorted({r["cache_slots"] for r in rec["results"]}) == [4, 8, 16]
    fastest = min(r["ms_per_token"] for r in rec["results"])
    assert rec["best"]["ms_per_token"] <= 1.01 * fastest
    assert all(r["ms_per_token"] > 1.01 * fastest for r in rec["results"]
               if r["cache_slots"] < rec["best"]["cache_slots"])  # no smaller cache is as good
    assert len(rec["alternatives"]) == 2
    for alt in rec["alternatives"]:
        same = next(r for r in rec["results"] if r["bound"] == alt["policy"] and
                    r["cache_slots"] == rec["best"]["cache_slots"])
        assert alt["speedup"] == pytest.approx(same["ms_per_token"] / rec["best"]["ms_per_token"])
    assert plan.recommend(trace, model, L * E * GB, policies)["resident"]  # the device is 6x the host here
    # A CPU-like device (its hits cost what a host GEMV does): with every expert fitting, resident is a candidate,
    # not the answer; the two paths side by side are faster than hits only.
    cpu_like = CostModel(expert_bytes=GB, bp=8.0, bh=8.0, device_bandwidth=8.0)
    fits = plan.recommend(trace, cpu_like, 2 * L * E * GB, policies)
    resident = next(r for r in fits["results"] if r["policy"] == "resident")
    assert not fits["resident"] and fits["best"]["ms_per_token"] < resident["ms_per_token"]
    # A profile measured on a CPU device: its slots are the same memory and cores, so a fill is pure extra work
    # and a hit costs a host GEMV; the recommendation fetches nothing (host-all; ties with whatever also fetches
    # nothing), which is what the engine's CPU default does.
    on_cpu = CostModel.from_spec({"bp": 16.0, "bh": 22.0, "bp_contended": 14.0, "bh_contended": 16.0}, GB,
                                 platform="cpu")
    rec_cpu = plan.recommend(trace, on_cpu, 16 * GB, policies)
    assert rec_cpu["best"]["fetched_per_token"] == 0 and rec_cpu["best"]["hits_per_token"] == 0
    host_all = next(r for r in rec_cpu["results"] if r["policy"] == "host-all")
    assert rec_cpu["best"]["ms_per_token"] == pytest.approx(host_all["ms_per_token"])
    # Every expert fitting does not make resident a candidate there: it would be a second copy of every expert.
    fits_cpu = plan.recommend(trace, on_cpu, 2 * L * E * GB, policies)
    assert not fits_cpu["resident"] and "resident" not in {r["policy"] for r in fits_cpu["results"]}
    # host-all, which needs no slot, wins its ties there (auto fetching nothing ties it), is a candidate even when
    # not asked for, and a budget that holds no expert is no error on a CPU (host-all needs none).
    assert rec_cpu["best"]["policy"] == fits_cpu["best"]["policy"] == "host-all"
    assert rec_cpu["recommended_slots"] == 0 and rec_cpu["added_candidates"] == []  # it needs no slot
    without = plan.recommend(trace, on_cpu, 16 * GB, [parse_policy(p) for p in ("auto", "fetch-all")])
    assert without["best"]["policy"] == "host-all" and without["added_candidates"] == ["host-all"]
    tiny = plan.recommend(trace, on_cpu, GB // 2, policies)
    assert tiny["budget_slots"] == tiny["recommended_slots"] == 0
    assert {r["policy"] for r in tiny["results"]} == {"host-all"}
    assert rec["recommended_slots"] == rec["best"]["cache_slots"] and rec["added_candidates"] == []
    with pytest.raises(ValueError, match="holds no expert"):
        plan.recommend(trace, model, GB // 2, policies)
    assert cli.main(["plan", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                     "--bandwidth", "2,8", "--device-bandwidth", "50", "--device-memory", "16GB",
                     "--candidates", "auto,fetch-all,host-all", "--observed", "fetch-all@8=123.5,host-all@3=5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recommendation: --policy ") and "beats" in out
    # A stored profile of a CPU device: host-all, with no cache size (it never fills a slot).
    store = tmp_path / "profiles.json"
    bandwidth.save_profile(bandwidth.Profile(
        key=bandwidth.machine_key("bfloat16", GB), bp=16.0, bh=22.0, bp_contended=14.0, bh_contended=16.0,
        spreads={}, repeats=1, quick=True, measured_at="2026-01-01T00:00:00+00:00", hidden_size=1, intermediate_size=1),
        store)
    if bandwidth.machine_key("bfloat16", GB)["platform"] == "cpu":
        assert cli.main(["plan", str(tmp_path / "t.jsonl"), "--expert-bytes", str(GB), "--num-experts", str(E),
                         "--profile", str(store), "--device-memory", "16GB"]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first.startswith("recommendation: --policy host-all, no slots: every expert on the CPU (a CPU device: "
                                "a slot would be a copy in the same memory, read by the same cores): "), first
    # Measured figures are stated beside the modelled ones (item 4 of issue 21).
    modelled = next(r["ms_per_token"] for r in rec["results"] if r["policy"] == "fetch-all" and r["cache_slots"] == 8)
    assert (f"fetch-all at 8 slots: {modelled:.2f} ms/token modelled, 123.50 observed (modelled / observed "
            f"{modelled / 123.5:.3f})") in out
    assert "host-all at 3 slots: not replayed, 5.00 observed" in out
    side = plan.recommend(trace, model, 16 * GB, policies, observed={("host-all", 8): 2.0})["observed"]
    host8 = next(r["ms_per_token"] for r in rec["results"] if r["policy"] == "host-all" and r["cache_slots"] == 8)
    assert side == [{"policy": "host-all", "cache_slots": 8, "modelled_ms": host8, "observed_ms": 2.0,
                     "modelled_over_observed": host8 / 2.0}]
    with pytest.raises(SystemExit):
        cli.main(["plan", str(tmp_path / "t.jsonl"), "--device-memory", "16GB", "--observed", "qstar=3"])


def _routing_of_decode(ckpt, policy, slots, steps, prompts):
    """(engine after a prefill-only call: its cache state, the routing and final state of a full generate)."""
    from ft_jax.engine.engine import Engine, Sampling

    sampling = Sampling(temperature=1.0)  # varied routing from step to step
    first = Engine(ckpt, policy=policy, num_slots=slots)
    first.generate(prompts, max_new_tokens=1, sampling=sampling, seed=7)  # prefill only
    after_prefill = jax.tree_util.tree_map(np.asarray, first.expert_state.cache)
    engine = Engine(ckpt, policy=policy, num_slots=slots)
    result = engine.generate(prompts, max_new_tokens=steps + 1, sampling=sampling, seed=7, record_routing=True)
    return after_prefill, result, jax.tree_util.tree_map(np.asarray, engine.expert_state.cache)


@pytest.mark.parametrize("rows", [1, 2])
def test_replayed_trace_makes_the_decode_steps_decisions(tmp_path, rows):
    """Decode routing recorded by the engine, written as a trace, read back and replayed from the state after the
    prefill, gives the decode step's own cache tables (every slot, usage and recency) and per-layer counters."""
    from ft_jax.checkpoint import load_checkpoint

    ckpt = load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.float32)
    cfg = ckpt.config
    # A fill costs two host GEMVs here: top-2 of 8 experts gives auto layers worth fetching and layers not.
    auto, _ = _auto(expert_bytes=ckpt.banks.gate_up.row_bytes + ckpt.banks.down.row_bytes, bp=4.0)
    prompts = [[1, 17, 42, 5], [3, 9, 11, 2]][:rows]
    for policy in (auto, Policy("fetch-all")):
        start, result, end = _routing_of_decode(ckpt, policy, 5, 24, prompts)
        path = tmp_path / f"rec{rows}.jsonl"
        write_trace(str(path), routing_records(*result.routing))
        trace = read_trace(str(path), cfg.num_moe_layers, cfg.num_experts)
        assert trace.tokens == rows * 24
        got = replay(trace, policy, 5, batch=True, initial_state=start)
        got_leaves = dict(jax.tree_util.tree_leaves_with_path(got.state))
        for path, want_leaf in jax.tree_util.tree_leaves_with_path(end):  # auto: its lanes too
            np.testing.assert_array_equal(np.asarray(got_leaves[path]), want_leaf,
                                          err_msg=f"{policy} rows={rows}: {jax.tree_util.keystr(path)}")
        per_layer = got.stats.sum(axis=0)  # [L, 5]
        for i, field in enumerate(("active", "hits", "misses", "fetched", "host")):
            assert per_layer[:, i].tolist() == result.stats["per_layer"][field], field
        if policy.kind == "auto":
            assert result.stats["fetched_per_step"] > 0 and result.stats["host_per_step"] > 0


def test_generate_record_trace_flag(tmp_path, capsys):
    info = json.load(open(os.path.join(FIXTURES, "mixtral", "reference", "info.json")))
    path = tmp_path / "rec.jsonl"
    assert cli.main(["generate", "--model", os.path.join(FIXTURES, "mixtral"), "--prompt-ids",
                     ",".join(map(str, info["prompt_ids"])), "--temperature", "0", "--max-new-tokens", "6",
                     "--policy", "fetch-all", "--cache-slots", "3", "--record-trace", str(path), "--json"]) == 0
    capsys.readouterr()
    trace = read_trace(str(path))
    ref_ids = np.load(os.path.join(FIXTURES, "mixtral", "reference", "decode_topk_ids.npy"))  # [15, L, k]
    assert trace.tokens == 5 and trace.sequences[0].name == "mixtral/0"
    for t in range(5):
        for layer in range(trace.num_layers):
            assert np.flatnonzero(trace.sequences[0].active[t, layer]).tolist() == sorted(ref_ids[t, layer])


@pytest.mark.parametrize("where", ["folder", "missing"])
def test_generate_refuses_a_record_trace_path_before_loading(tmp_path, capsys, where):
    """A --record-trace target that cannot be written is refused up front (the trace is written only after the
    whole generation), with the flag named."""
    target = tmp_path if where == "folder" else tmp_path / "no" / "t.jsonl"
    assert cli.main(["generate", "--model", os.path.join(FIXTURES, "mixtral"), "--prompt-ids", "1,2",
                     "--record-trace", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "building the" not in captured.err
    assert f"--record-trace {target}: " + ("is a directory" if where == "folder" else "folder") in captured.err
