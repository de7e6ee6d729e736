"""Tests of ft_jax.offload.profile (measurement, store, fraction) and the `ft-jax profile` command.

Every test writes only under tmp_path (XDG_CACHE_HOME points there): the real user cache is never touched.
Measurements use small experts (H=64, I=128) and quick mode; nothing asserts on timing.
"""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ft_jax import api, cli
from ft_jax.offload import profile as bandwidth
from ft_jax.offload.profile import Profile

FIXTURES = Path(__file__).parent / "fixtures" / "hf_tiny"
BUNDLED = Path(api.bundled_model_path())
H, I = 64, 128  # 3 * 64 * 128 * 4 = 98304 bytes per float32 expert
KEY = {"platform": "cpu", "device_kind": "cpu", "cpu_model": "Test CPU", "cpu_count": 2, "dtype": "float32",
       "expert_bytes": 98304}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def here() -> dict:
    """This machine's key for float32 experts of (H, I)."""
    return bandwidth.machine_key("float32", 3 * H * I * 4)


def make_profile(bp=2.0, bh=8.0, bpc=None, bhc=None, **key) -> Profile:
    spreads = {"bp": [bp, bp], "bh": [bh, bh]}
    return Profile(key={**KEY, **key}, bp=bp, bh=bh, bp_contended=bpc, bh_contended=bhc, spreads=spreads, repeats=3,
                   quick=True, measured_at="2026-01-01T00:00:00+00:00", hidden_size=H, intermediate_size=I)


def q_star_reference(m: int, frac: float) -> int:
    """DESIGN.md section 1, written out again: f = round(frac * 2^16); F = argmin over {lo, lo+1} of the cost."""
    f = min(max(round(frac * 65536), 0), 65536)
    lo = (m * f) >> 16

    def cost(n: int) -> int:
        return max(n * (65536 - f), (m - n) * f)

    return min(lo if cost(lo) <= cost(lo + 1) else lo + 1, m)


def start_cli(*args, env_cache: Path) -> subprocess.Popen:
    """The real `ft-jax` entry point (python -m ft_jax) in a subprocess, with its own cache folder."""
    env = {**os.environ, "XDG_CACHE_HOME": str(env_cache)}
    return subprocess.Popen([sys.executable, "-m", "ft_jax", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_cli(*args, env_cache: Path) -> subprocess.CompletedProcess:
    return finish(start_cli(*args, env_cache=env_cache))


def assert_one_line_error(proc: subprocess.CompletedProcess, command: str, needle: str):
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"ft-jax {command}: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert needle in proc.stderr, proc.stderr


# --- fraction, q* and the recommendation (hand-worked, DESIGN.md section 1) -------------------------------------------


def test_fraction_from_a_hand_worked_pair():
    assert make_profile(bp=2.0, bh=8.0).fraction() == pytest.approx(0.25)  # min(1, BP / BH)
    contended = make_profile(bp=2.0, bh=8.0, bpc=1.0, bhc=3.1, platform="gpu", device_kind="Test GPU")
    assert contended.fraction() == pytest.approx(1.0 / 4.1)  # BPc / (BPc + BHc) takes precedence
    assert make_profile(bp=8.0, bh=4.0).fraction() == 1.0  # BH <= BP: fetch everything
    # f = round(0.25 * 65536) = 16384; m=3: lo=0, cost(0) = 49152 = cost(1) -> 0; m=8: lo=2, cost(2)=98304 -> 2
    assert [q_star_reference(m, 0.25) for m in range(1, 9)] == [0, 0, 0, 1, 1, 1, 1, 2]
    text = cli.profile.recommendation(contended)
    assert text == ("the host path is 3.1x faster than the fill (while both run): compute about 3 of every 4 misses "
                    "on the CPU (fetch the other 1 into device slots)")
    assert cli.profile.recommendation(make_profile(bp=8.0, bh=8.6)).startswith("the host path is about as fast as the fill")
    assert cli.profile.recommendation(make_profile(bp=8.0, bh=4.0, platform="gpu")).endswith(
        "fetch every miss into device slots (like fetch-all)")


@pytest.mark.parametrize("bp, bh", [(2.0, 8.0), (8.0, 4.0), (8.0, 8.6)])
def test_a_cpu_profile_recommends_the_cpu_default_not_fetching(bp, bh):
    # On a CPU device a slot is a copy in the same host memory, read by the same cores: whatever the pair, the advice
    # is host-all, never "fetch ... into device slots" (a trial's quick profile on a CPU advised fetching).
    text = cli.profile.recommendation(make_profile(bp=bp, bh=bh, platform="cpu"))
    assert text.endswith(": keep the CPU default, host-all (compute every expert on the CPU): on a CPU device a slot "
                         "is a copy in the same host memory, read by the same cores, so slots do not speed up decode")
    assert "fetch" not in text


def test_dtype_spellings():
    for text, name in (("bf16", "bfloat16"), ("BFloat16", "bfloat16"), ("f32", "float32"), ("FLOAT32", "float32")):
        assert bandwidth.dtype_name(text) == name
        assert cli.build_parser().parse_args(["generate", "--dtype", text]).dtype == name
        assert cli.build_parser().parse_args(["profile", "--dtype", text]).dtype == name
    for command in ("generate", "serve", "profile"):  # auto: the checkpoint's dtype, as leaving the flag out
        assert cli.build_parser().parse_args([command, "--dtype", "Auto"]).dtype is None
    assert bandwidth.expert_nbytes(H, I, "bf16") == 3 * 64 * 128 * 2
    with pytest.raises(ValueError, match="expected bf16, bfloat16, f32 or float32, got 'f16'"):
        bandwidth.dtype_name("f16")


# --- store ------------------------------------------------------------------------------------------------------------


def test_round_trip_through_the_default_file(tmp_path):
    p = make_profile(bp=2.5, bh=7.5, bpc=1.5, bhc=4.5, **here())
    path = tmp_path / "xdg" / "ft_jax" / "profiles.json"
    assert bandwidth.default_store_path() == path
    assert bandwidth.save_profile(p) == (path, "")
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 1 and len(doc["profiles"]) == 1
    assert doc["profiles"][0]["key"] == here() and doc["profiles"][0]["bh_contended"] == 4.5
    assert bandwidth.read_profiles() == ([p], "")
    loaded, msg = bandwidth.get_or_measure_profile(H, I, "float32", allow_measure=False)
    assert loaded == p  # 1.5 / (1.5 + 4.5) = 0.25
    assert msg == (f"using the bandwidth profile stored in {path} (measured 2026-01-01T00:00:00+00:00): BP 2.50 GB/s, "
                   "BH 7.50 GB/s, contended BP 1.50 / BH 4.50 GB/s, fetch fraction 0.250")
    # Same key replaces, other keys stay.
    bandwidth.save_profile(make_profile(bp=1.0, bh=3.0, dtype="bfloat16"))
    bandwidth.save_profile(make_profile(bp=3.0, bh=4.0))
    assert sorted((p.key["dtype"], p.bp) for p in bandwidth.read_profiles()[0]) == [
        ("bfloat16", 1.0), ("float32", 2.5), ("float32", 3.0)]  # here() and KEY differ in the CPU
    assert sorted(os.listdir(path.parent)) == [".profiles.json.lock", "profiles.json"]  # no temporary file left


def test_foreign_machine_is_ignored_with_a_message(tmp_path):
    path = tmp_path / "p.json"
    bandwidth.save_profile(make_profile(**{**here(), "cpu_model": "Other CPU", "cpu_count": 640}), path)
    with pytest.warns(UserWarning, match="falling back to the fixed-cap 1 policy"):
        loaded, msg = bandwidth.get_or_measure_profile(H, I, "float32", allow_measure=False, path=path)
    assert loaded is None
    k = here()
    assert msg.startswith(f"no bandwidth profile of this machine for float32 experts of 96.00 KiB in {path}; ignoring "
                          f"the profiles of another machine ({k['platform']}/{k['device_kind']}, host CPU 'Other CPU' "
                          f"x 640); this is {k['platform']}/{k['device_kind']}, host CPU {k['cpu_model']!r} x "
                          f"{k['cpu_count']}; measuring is off")


def test_entry_that_does_not_parse_is_measured_again(tmp_path):
    path = tmp_path / "p.json"
    good = dataclasses.asdict(make_profile(**here()))
    bad = [{**good, "bh": -1.0}, {**good, "bh": "fast"}, {**good, "surprise": 1}, {"key": here()}, [1, 2]]
    path.write_text(json.dumps({"schema_version": 1, "profiles": bad}))
    assert bandwidth.read_profiles(path) == ([], "")  # bad entries: not a damaged store
    with pytest.warns(UserWarning, match="no bandwidth profile of this machine") as caught:
        assert bandwidth.get_or_measure_profile(H, I, "float32", allow_measure=False, path=path)[0] is None
    assert len(caught) == 1
    bandwidth.save_profile(make_profile(bp=5.0), path)
    assert [e["bp"] for e in json.loads(path.read_text())["profiles"]] == [5.0]


@pytest.mark.parametrize("content", ["", '{"schema_version": 1}', '{"schema_version": 2, "profiles": []}',
                                     '{\n "schema_version": 1,\n "profiles": [\n  {\n   "bh": 8.0,'])  # truncated
def test_damaged_store_is_moved_aside(tmp_path, content):
    path = tmp_path / "profiles.json"
    path.write_text(content)
    profiles, damaged = bandwidth.read_profiles(path)
    assert profiles == [] and damaged.startswith(f"{path} is a damaged ft_jax bandwidth profile store (")
    with pytest.warns(UserWarning, match="profiles.json is a damaged ft_jax bandwidth profile store"):
        assert bandwidth.get_or_measure_profile(H, I, "float32", allow_measure=False, path=path)[0] is None
    with pytest.warns(UserWarning, match="moved it to .*profiles.json.corrupt"):
        assert bandwidth.save_profile(make_profile(), path) == (path, f" (moved the damaged store to {path}.corrupt)")
    assert (tmp_path / "profiles.json.corrupt").read_text() == content  # kept, not destroyed
    assert bandwidth.read_profiles(path) == ([make_profile()], "")
    path.write_text(content)  # a second damaged store does not overwrite the first one set aside
    with pytest.warns(UserWarning, match="profiles.json.corrupt.1"):
        bandwidth.save_profile(make_profile(), path)
    assert (tmp_path / "profiles.json.corrupt.1").read_text() == content


@pytest.mark.parametrize("kind", ["not json", "a list", "other json", "binary", "directory", "fifo"])
def test_a_file_that_is_not_a_store_is_never_written_over(tmp_path, kind):
    path = tmp_path / "target"
    content = {"not json": b"my notes\n", "a list": b'["profiles"]', "other json": b'{"name": "other tool"}',
               "binary": b"\xff\xfe{\x00"}.get(kind)
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # reading it would block forever
    else:
        path.write_bytes(content)
    with pytest.raises(bandwidth.NotAStoreError, match="target is not an ft_jax bandwidth profile store"):
        bandwidth.save_profile(make_profile(), path)
    with pytest.warns(UserWarning, match="target is not an ft_jax bandwidth profile store"):
        assert bandwidth.get_or_measure_profile(H, I, "float32", allow_measure=False, path=path)[0] is None
    assert content is None or path.read_bytes() == content
    assert sorted(os.listdir(tmp_path)) == [".target.lock", "target"]


def test_two_processes_saving_at_once_keep_every_entry(tmp_path):
    path = tmp_path / "p.json"
    script = textwrap.dedent(f"""
        import os, sys, time
        from ft_jax.offload.profile import Profile, save_profile
        open({str(tmp_path)!r} + "/ready." + sys.argv[1], "w").close()
        while not all(os.path.exists({str(tmp_path)!r} + "/ready." + n) for n in "ab"):  # start together
            time.sleep(0.001)
        for i in range(50):
            key = {KEY!r} | {{"cpu_model": f"process {{sys.argv[1]}} entry {{i}}"}}
            save_profile(Profile(key=key, bp=1.0, bh=2.0, bp_contended=None, bh_contended=None, spreads={{}},
                                 repeats=1, quick=True, measured_at="", hidden_size=1, intermediate_size=1),
                         {str(path)!r})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, name]) for name in "ab"]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    names = {p.key["cpu_model"] for p in bandwidth.read_profiles(path)[0]}
    assert names == {f"process {n} entry {i}" for n in "ab" for i in range(50)}


# --- measurement ------------------------------------------------------------------------------------------------------


def test_bench_rotation_exceeds_the_last_level_cache():
    with bandwidth.Bench(H, I, "f32", call_bytes=16 << 20) as b:
        llc, eb = b.llc_bytes, 3 * H * I * 4
        n = math.ceil((16 << 20) / eb)  # 171 experts of 96 KiB per call
        rows = math.ceil(math.ceil(2 * llc / eb) / n) * n  # e.g. 683 rows for a 32 MiB cache, 684: 4 calls of 171
        assert (b.expert_bytes, b.rows) == (eb, rows)
        assert b.n == n and b.nbytes == b.n * eb
        assert (b.gate_up.num_rows, b.gate_up.row_shape, b.down.row_shape) == (2 * rows, (2 * I, H), (H, I))
        for j in (0, 1, len(b.fill_rows) - 1, len(b.fill_rows)):
            expect = [(j * b.n + i) % rows for i in range(b.n)]
            assert b.fill_rows[j % len(b.fill_rows)].tolist() == expect
            assert b.gemv_rows[j % len(b.gemv_rows)].tolist() == [rows + r for r in expect]  # disjoint half
        b.fill()
        b.gemv()


def test_bench_times_a_models_own_banks_when_they_hold_the_rotation(monkeypatch):
    # The engine reads banks that map the checkpoint's pages; a profile timed on fresh anonymous banks measured a BH
    # ~13 % above what the engine reads on the bench model (DESIGN.md sec. 19.5). A loaded model's banks with 2R rows
    # are timed themselves, rows 0 .. 2R - 1, and left alive; fewer rows, or banks of another shape, are not used.
    from ft_jax.kernels.host_bank import HostBank
    from ft_jax.offload.banks import ExpertBanks

    monkeypatch.setattr(bandwidth, "last_level_cache_bytes", lambda: 4 * 3 * H * I * 4)  # R = 8 rows
    assert bandwidth.Bench.rotation_rows(3 * H * I * 4, 1, 4 * 3 * H * I * 4) == (1, 8)
    # tiny experts (126 bytes): many per call, the rotation a whole number of calls past twice a 32 MiB cache
    n, R = bandwidth.Bench.rotation_rows(126, 8 << 20, 32 << 20)
    assert n == 66577 and R % n == 0 and R >= 2 * (32 << 20) / 126 and R // n == 8
    model = ExpertBanks(HostBank(16, (2 * I, H), np.float32), HostBank(16, (H, I), np.float32))
    small = ExpertBanks(HostBank(15, (2 * I, H), np.float32), HostBank(15, (H, I), np.float32))
    try:
        for bank in (*model.banks, *small.banks):
            bank.numpy()[...] = 0.5
        with bandwidth.Bench(H, I, "float32", call_bytes=1, model_banks=model) as b:
            assert b.on_model_banks and b.rows == 8 and b.gate_up is model.gate_up and b.down is model.down
            assert b.gemv_rows[0].tolist() == [8]  # the second half of the model's rows
            b.fill()
            b.gemv()
        assert model.gate_up.alive and model.down.alive  # not released: the model's
        with pytest.raises(ValueError, match="hold 15 experts, the rotation needs 16"):
            bandwidth.Bench(H, I, "float32", call_bytes=1, model_banks=small)
        with pytest.raises(ValueError, match=f"are not f32 experts of H={H}, I={2 * I}"):
            bandwidth.Bench(H, 2 * I, "float32", call_bytes=1, model_banks=model)
        quick = dict(bandwidth.MODES["quick"], call_bytes=1)
        monkeypatch.setitem(bandwidth.MODES, "quick", quick)
        assert bandwidth.measure_profile(H, I, "float32", quick=True, model_banks=model).details["banks"] == "model"
        assert bandwidth.measure_profile(H, I, "float32", quick=True, model_banks=small).details["banks"] == "fresh"
        assert model.gate_up.alive and small.gate_up.alive
    finally:
        model.release()
        small.release()


def test_quick_profile_is_measured_saved_and_reused(tmp_path):
    path = tmp_path / "p.json"
    profile, msg = bandwidth.get_or_measure_profile(H, I, "float32", path=path)
    assert msg.startswith(f"no bandwidth profile of this machine for float32 experts of 96.00 KiB in {path}; "
                          f"ran a quick bandwidth profile (") and f"saved to {path}" in msg
    assert profile.quick and profile.repeats == 3 and profile.key["expert_bytes"] == 98304
    for name in ("bp", "bh", "bp_contended", "bh_contended"):
        value, (lo, hi) = getattr(profile, name), profile.spreads[name]
        assert math.isfinite(value) and 0 < lo <= value <= hi, name
    assert profile.fraction() == pytest.approx(profile.bp_contended / (profile.bp_contended + profile.bh_contended))
    assert profile.details["working_set_bytes"] >= 3 * 2 * profile.details["llc_bytes"]
    assert profile.details["load_average_1m"] >= 0
    again, msg = bandwidth.get_or_measure_profile(H, I, "float32", path=path)
    assert again == profile and msg.startswith(f"using the bandwidth profile stored in {path}")


def test_without_a_profile_decoding_falls_back_with_a_warning(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match="measuring is off: falling back to the fixed-cap 1 policy"):
        assert bandwidth.get_or_measure_profile(H, I, "float32", allow_measure=False)[0] is None

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for the working set")

    monkeypatch.setattr(bandwidth, "measure_profile", no_memory)
    with pytest.warns(UserWarning, match=r"quick bandwidth profile failed \(no room for the working set\)"):
        assert bandwidth.get_or_measure_profile(H, I, "float32")[0] is None
    assert not (tmp_path / "xdg").exists()


# --- the command line, in a subprocess -------------------------------------------------------------------------------


def test_profile_without_arguments_profiles_the_bundled_model(tmp_path):
    proc = run_cli("profile", "--quick", "--json", "--no-save", "--repeats", "2", env_cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # one JSON object
    config = json.loads((BUNDLED / "config.json").read_text())
    p = doc["profile"]
    assert (p["hidden_size"], p["intermediate_size"]) == (config["hidden_size"], config["intermediate_size"])
    assert p["key"]["dtype"] == "float32" and p["key"]["expert_bytes"] == 3 * 128 * 256 * 4
    assert p["repeats"] == 2 and p["quick"] is True
    frac = p["bp_contended"] / (p["bp_contended"] + p["bh_contended"])
    assert doc["fraction"] == pytest.approx(frac, rel=1e-12)
    assert doc["q_star"] == {str(m): q_star_reference(m, frac) for m in range(1, 9)}
    assert doc["saved_to"] is None and not (tmp_path / "cache").exists()


def test_profile_of_the_bundled_model_says_why_it_times_fresh_banks(capsys):
    config = json.loads((BUNDLED / "config.json").read_text())
    assert cli.main(["profile", "--quick", "--no-save", "--repeats", "1"]) == 0
    (banks,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  banks    ")]
    experts = config["num_hidden_layers"] * config["num_local_experts"]
    assert banks.startswith(f"  banks    fresh host banks of this expert size (the model's {experts} experts are too "
                            "few to rotate past twice the "), banks


def test_profile_report_and_store_for_a_model_folder(tmp_path):
    store = tmp_path / "store.json"
    proc = run_cli("profile", "--model", str(FIXTURES / "mixtral"), "--dtype", "bf16", "--quick", "--repeats", "1",
                   "--profile", str(store), env_cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
    H_, I_ = config["hidden_size"], config["intermediate_size"]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ft_jax bandwidth profile (quick, median of 1 repeats")
    assert lines[2].startswith(f"  expert   H={H_} I={I_} bfloat16: {3 * H_ * I_ * 2 / 2**10:.2f} KiB")
    for label in ("BP  slot fill", "BH  host expert GEMV", "BPc slot fill, contended", "BHc host GEMV, contended",
                  "fetch fraction q*/m = ", "q* for m = 1..8:  m=1:", "recommendation: "):
        assert sum(line.startswith(f"  {label}") for line in lines) == 1, label
    (banks,) = [line for line in lines if line.startswith("  banks    ")]  # too few experts to rotate past the cache
    assert banks.startswith(f"  banks    fresh host banks of this expert size (the model's "
                            f"{config['num_hidden_layers'] * config['num_local_experts']} experts are too few to "
                            "rotate past twice the "), banks
    (advice,) = [line for line in lines if line.startswith("  recommendation: ")]
    if here()["platform"] == "cpu":  # slots are copies in the same memory: the CPU default, not fetching
        assert "keep the CPU default, host-all" in advice and "into device slots" not in advice, advice
    assert lines[-1] == f"  saved to {store}"
    (entry,) = json.loads(store.read_text())["profiles"]
    assert entry["key"]["dtype"] == "bfloat16" and entry["key"]["expert_bytes"] == 3 * H_ * I_ * 2
    c = entry["call_ms"]  # the stored per-call costs are printed too, as stored
    assert (f"  per call in a compiled step (the cost model's fixed ms per layer): fill {c['fill']:.3f}, host_experts "
            f"{c['host']:.3f}, slot_experts {c['slot']:.3f} ms, with one route {c['slot_route']:.3f} ms") in lines


def test_profile_of_a_model_folder_times_its_own_banks_when_they_rotate_past_the_cache(monkeypatch, capsys,
                                                                                         tmp_path):
    # With a last-level cache of one expert, the rotation needs 2R = 4 rows: the fixture's first experts of each
    # layer, loaded as generate loads them, are timed instead of fresh banks.
    from ft_jax import checkpoint

    config = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
    eb = 3 * config["hidden_size"] * config["intermediate_size"] * 2
    monkeypatch.setattr(bandwidth, "last_level_cache_bytes", lambda: eb)
    monkeypatch.setitem(bandwidth.MODES, "quick", dict(bandwidth.MODES["quick"], call_bytes=1))
    loaded = []
    real = checkpoint.load_banks
    monkeypatch.setattr(checkpoint, "load_banks", lambda *a: loaded.append(a) or real(*a))
    assert cli.main(["profile", "--model", str(FIXTURES / "mixtral"), "--dtype", "bf16", "--quick", "--repeats", "1",
                     "--no-save"]) == 0
    assert "  banks    the model's own expert banks, as generate loads them" in capsys.readouterr().out.splitlines()
    layers = config["num_hidden_layers"]
    assert [a[3] for a in loaded] == [range(-(-4 // layers))]  # the fewest experts per layer that give 4 rows
    # A damaged checkpoint is then read: a one-line error naming the file, exit status 2 (a trial got a traceback).
    damaged = tmp_path / "damaged"
    shutil.copytree(FIXTURES / "mixtral", damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    assert cli.main(["profile", "--model", str(damaged), "--quick", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ft-jax profile: error: {weights}") and "truncated" in err and err.count("\n") == 1, err


def test_profile_errors_are_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    cases = [
        (["profile", "--hidden-size", "0", "--intermediate-size", "8"], "argument --hidden-size: expected an integer "
                                                                        ">= 1, got '0'"),
        (["profile", "--hidden-size", "64"], "give both --hidden-size and --intermediate-size"),
        (["profile", "--model", str(tmp_path / "missing")], "missing"),
        (["profile", "--profile", str(notes), "--quick"], f"{notes} is not an ft_jax bandwidth profile store"),
        (["generate", "--dtype", "f16"], "argument --dtype: expected auto, bf16, bfloat16, f32 or float32, got 'f16'"),
    ]
    procs = [start_cli(*argv, env_cache=tmp_path / "cache") for argv, _ in cases]  # concurrently: import-bound
    for proc, (argv, needle) in zip(procs, cases):
        assert_one_line_error(finish(proc), argv[0], needle)
    assert notes.read_text() == "my notes\n"


def test_generate_goes_on_past_a_damaged_store(tmp_path):
    store = tmp_path / "cache" / "ft_jax" / "profiles.json"
    store.parent.mkdir(parents=True)
    store.write_text('{\n "schema_version": 1,\n "profiles": [\n  {"key"')
    proc = run_cli("generate", "--prompt", "ROMEO:", "--max-new-tokens", "1", "--temperature", "0",
                   "--policy", "qstar", env_cache=tmp_path / "cache")  # qstar reads the store (host-all does not)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ROMEO:")
    assert "ran a quick bandwidth profile" in proc.stderr
    assert f"(moved the damaged store to {store}.corrupt)" in proc.stderr
    assert (store.parent / "profiles.json.corrupt").read_text().endswith('{"key"')
    assert len(json.loads(store.read_text())["profiles"]) == 1


# --- resolve_policy: the policy bound to this machine's profile ---------------------------------------------------------


def _banks():
    """float32 ExpertBanks of one layer of 2 experts of (H, I): 98304 bytes per expert (no biases)."""
    import numpy as np

    from ft_jax.kernels.host_bank import HostBank
    from ft_jax.offload.banks import ExpertBanks

    return ExpertBanks(HostBank(2, (2 * I, H), np.float32), HostBank(2, (H, I), np.float32))


def test_resolve_policy_takes_the_stored_profile(tmp_path):
    from ft_jax.offload import cost_model
    from ft_jax.offload.policy import Policy

    path = tmp_path / "p.json"
    bandwidth.save_profile(make_profile(bp=2.0, bh=8.0, bpc=1.5, bhc=6.0, **here()), path)
    banks = _banks()
    qstar, note = bandwidth.resolve_policy("qstar", banks, H, I, profile=path, measure=False)
    assert qstar == Policy("qstar", frac=1.5 / 7.5) and "stored" in note
    auto, _ = bandwidth.resolve_policy(Policy("auto"), banks, H, I, profile=path, measure=False)
    cpu = here()["platform"] == "cpu"  # a CPU device: slot experts at BH, its paths one after another
    device = 8.0 if cpu else cost_model.ASSUMED_DEVICE_GBPS
    assert auto == Policy("auto", costs=cost_model.auto_costs(banks.expert_bytes, 2.0, 8.0, 1.5, 6.0, device,
                                                              serial=cpu))


def test_a_cpu_profile_prices_slot_experts_at_bh_and_keeps_its_call_costs(tmp_path):
    # A trial's quick profile timed slot_experts with one route from the cache (the same small slot every call of
    # the loop): 15 GB/s against a BH of 7.8, and `ft-jax plan` then recommended resident slots on a CPU. On a CPU
    # device the slot experts are the host kernel in the same memory: the model prices them at BH whatever
    # slot_route says; the per-call costs are still its fixed costs.
    path = tmp_path / "p.json"
    if here()["platform"] != "cpu":
        pytest.skip("a CPU device's profile")
    profile = make_profile(bp=2.0, bh=8.0, **here())
    profile.call_ms = {"fill": 0.01, "host": 0.02, "slot": 0.03, "slot_route": 0.031}  # 1 us per route: "fast"
    bandwidth.save_profile(profile, path)
    model = bandwidth.cost_model_for("stored", profile.key["expert_bytes"], dtype="float32", profile_path=str(path))
    assert model.device_bandwidth == 8.0 and model.serial_paths
    assert (model.fill_fixed_ms, model.host_fixed_ms, model.device_fixed_ms) == (0.01, 0.02, 0.03)


def test_resolve_policy_without_a_profile_falls_back_to_fixed_cap_1(tmp_path):
    policy, note = bandwidth.resolve_policy("auto", _banks(), H, I, profile=tmp_path / "none.json", measure=False)
    assert str(policy) == "fixed-cap:1" and "fixed-cap 1" in note


def test_resolve_policy_passes_a_bound_policy_through(tmp_path):
    from ft_jax.offload.policy import Policy

    for policy in (Policy("qstar", frac=0.3), Policy("fetch-all"), Policy("fixed-cap", cap=2)):
        assert bandwidth.resolve_policy(policy, _banks(), H, I, profile=tmp_path / "none.json",
                                        measure=False) == (policy, None)


def test_profile_store_in_a_missing_folder_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    """`ft-jax profile --profile` in a folder that does not exist is refused in one line before measuring, as
    generate's --profile and ft_jax.load(profile=) are (it created the folders, for a store generate then refused:
    found by a fresh-user trial)."""
    monkeypatch.setattr(bandwidth, "measure_profile", lambda *a, **k: pytest.fail("measured"))
    missing = tmp_path / "no" / "dir" / "p.json"
    assert cli.main(["profile", "--quick", "--profile", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == (f"ft-jax profile: error: --profile {missing}: folder {missing.parent} does not exist or is not "
                   "writable\n"), err
    assert not (tmp_path / "no").exists()



def test_trace_finds_the_profile_generate_stored_for_mxfp4_experts(tmp_path):
    """`ft-jax profile` and generate store a profile under the weights' bytes in the banks' storage format (no
    biases); trace / plan priced gpt-oss's experts (biases included) and looked up that size, so they never found it
    and took the closest size of any format (a q4_0x16 profile: a wrong BH and q*; a fresh-user trial). With the
    model's shape the lookup uses generate's key; without a match it prefers the same format."""
    from ft_jax import weight_formats as wf
    from ft_jax.config import load_config
    from ft_jax.memory import planned_expert_bytes

    cfg = load_config(str(FIXTURES / "gpt_oss_mxfp4"))
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    key_bytes = bandwidth.expert_nbytes(H, I, "bfloat16", wf.MXFP4)
    priced = planned_expert_bytes(cfg, np.dtype("float32"), wf.MXFP4)
    assert priced > key_bytes  # the biases

    def store(path, fmt, nbytes, bh):
        bandwidth.save_profile(Profile(key=bandwidth.machine_key("bfloat16", nbytes, fmt), bp=5.0, bh=bh,
                                       bp_contended=None, bh_contended=None, spreads={}, repeats=1, quick=True,
                                       measured_at="2026-01-01T00:00:00+00:00", hidden_size=H, intermediate_size=I),
                               path)

    path = tmp_path / "profiles.json"
    store(path, wf.Q4_0_X16, priced - 100, 4.58)  # closer to the priced size, another format
    store(path, wf.MXFP4, key_bytes, 1.16)
    model = bandwidth.cost_model_for("stored", priced, profile_path=str(path), fmt=wf.MXFP4, shape=(H, I))
    assert model.bh == 1.16 and model.expert_bytes == priced and "for this expert size" in model.source
    other = tmp_path / "other.json"  # no exact entry: the same format at another size beats a closer other format
    store(other, wf.Q4_0_X16, priced - 100, 4.58)
    store(other, wf.MXFP4, 4 * key_bytes, 1.5)
    near = bandwidth.cost_model_for("stored", priced, profile_path=str(other), fmt=wf.MXFP4)
    assert near.bh == 1.5 and "closest expert size (mxfp4" in near.source
