"""Tests of ft_jax.tools.profile_store (storage, keys, schema) and ft_jax.tools.profiler (measurement, fraction, CLI).

Every test writes only under tmp_path (XDG_CACHE_HOME is pointed there): the real user cache is never touched.
Measurements use small experts (H=64, I=128) so each quick profile takes a few seconds on 2 cores; no timing asserts.
"""

import dataclasses
import json
import math
import os
import warnings
from pathlib import Path

import pytest

from ft_jax.tools import profile_store, profiler
from ft_jax.tools.profile_store import Profile, ProfileKey

FIXTURES = Path(__file__).parent / "fixtures" / "hf_tiny"
H, I = 64, 128  # small expert: 3 * 64 * 128 * 4 = 98304 bytes in float32


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def make_profile(bp=2.0, bh=8.0, bpc=None, bhc=None, key=None, **kw) -> Profile:
    key = key or profile_store.current_key("float32", profile_store.expert_nbytes(H, I, "float32"))
    spreads = {"bp": (bp * 0.9, bp * 1.1), "bh": (bh * 0.9, bh * 1.1)}
    if bpc is not None:
        spreads.update(bp_contended=(bpc, bpc), bh_contended=(bhc, bhc))
    return Profile(key=key, bp=bp, bh=bh, bp_contended=bpc, bh_contended=bhc, spreads=spreads, repeats=3,
                   quick=True, measured_at="2026-01-01T00:00:00+00:00", hidden_size=H, intermediate_size=I,
                   details={"llc_bytes": 1 << 25}, **kw)


def other_machine(key: ProfileKey) -> ProfileKey:
    return dataclasses.replace(key, cpu_model=key.cpu_model + " (another host)", cpu_count=key.cpu_count + 62)


def assert_valid_measurement(p: Profile):
    for name in ("bp", "bh", "bp_contended", "bh_contended"):
        value = getattr(p, name)
        assert value is not None and math.isfinite(value) and value > 0, (name, value)
        lo, hi = p.spreads[name]
        assert 0 < lo <= value <= hi, (name, lo, value, hi)
    assert 0.0 <= p.fraction() <= 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Fraction rules, q* table and recommendation (hand-worked values, docs/DESIGN.md section 1)
# ---------------------------------------------------------------------------------------------------------------------


def test_fraction_standalone_pair():
    p = make_profile(bp=2.0, bh=8.0)
    assert p.fraction() == pytest.approx(0.25)  # min(1, BP / BH) = 2 / 8
    # q* = fetch_count_np(m, 0.25), Q16 f = 16384, cost(F) = max(F * 49152, (m - F) * 16384):
    # m=3: lo=0, cost(0)=49152 <= cost(1)=49152 -> 0; m=4: lo=1 -> 1; m=7: cost(1)=98304 <= cost(2)=98304 -> 1;
    # m=8: lo=2, cost(2)=98304 <= cost(3)=147456 -> 2
    assert profiler.q_star_table(p.fraction()) == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1, 8: 2}
    assert "4.0x faster than the fill" in profiler.recommendation(p)
    assert "compute about 3 of every 4 misses on the CPU" in profiler.recommendation(p)


def test_fraction_contended_pair_takes_precedence():
    p = make_profile(bp=2.0, bh=8.0, bpc=1.0, bhc=3.1)
    assert p.fraction() == pytest.approx(1.0 / 4.1)  # BPc / (BPc + BHc), not BP / BH = 0.25
    text = profiler.recommendation(p)
    assert text.startswith("the host path is 3.1x faster than the fill (while both run)")
    assert "compute about 3 of every 4 misses on the CPU (fetch the other 1 into device slots)" in text
    # 1/4.1 = 0.2439 -> f = round(0.2439 * 65536) = 15984; m=4: lo=0, cost(0)=63936 > cost(1)=49552 -> 1
    assert profiler.q_star_table(p.fraction())[4] == 1


def test_fraction_bh_not_above_bp_fetches_everything():
    for bh in (4.0, 8.0):  # BH < BP and BH == BP
        p = make_profile(bp=8.0, bh=bh)
        assert p.fraction() == 1.0
        assert profiler.q_star_table(p.fraction()) == {m: m for m in range(1, 9)}
        assert "fetch every miss into device slots" in profiler.recommendation(p)


def test_format_report_lists_everything():
    p = make_profile(bp=2.0, bh=8.0, bpc=1.0, bhc=3.0)
    p.details["load_average_1m"] = p.key.cpu_count + 5.0
    text = profiler.format_report(p, "/x/profiles.json")
    for needle in ("other processes competed for the CPU", "BP  slot fill", "BH  host expert GEMV",
                   "BPc slot fill, contended", "BHc host GEMV, contended",
                   "fetch fraction q*/m = 0.250", "q* for m = 1..8:", "m=8:2", "recommendation:",
                   "saved to /x/profiles.json", "GB/s = 1e9 bytes/s",
                   # 3 * 64 * 128 * 4 = 98304 bytes = 0.09375 MiB, the unit generate uses for expert sizes
                   "expert H=64 I=128 float32: 0.09 MiB"):
        assert needle in text, needle
    assert " MB" not in text


@pytest.mark.parametrize("bp, bh, expected", [
    (8.0, 8.0, "the host path is about as fast as the fill (measured alone)"),
    (8.0, 8.6, "the host path is about as fast as the fill"),  # 1.075x apart: printed as "1.1x" before
    (8.6, 8.0, "the host path is about as fast as the fill"),
    (8.0, 8.9, "the host path is 1.1x faster than the fill"),  # 1.1125x
    (8.9, 8.0, "the fill is 1.1x faster than the host path"),
])
def test_recommendation_wording_near_equal(bp, bh, expected):
    assert profiler.recommendation(make_profile(bp=bp, bh=bh)).startswith(expected)


def test_progress_bar_only_on_a_terminal(monkeypatch):
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        profiler.measure_profile(H, I, "float32", quick=True, repeats=1, contended=False, progress=True)
        assert ("profile:" in stream.getvalue()) == shown, stream.getvalue()


# ---------------------------------------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------------------------------------


def test_default_path_follows_xdg_cache_home(tmp_path, monkeypatch):
    assert profile_store.default_profile_path() == tmp_path / "xdg" / "ft_jax" / "profiles.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profile_store.default_profile_path() == tmp_path / "home" / ".cache" / "ft_jax" / "profiles.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says relative paths are ignored
    assert profile_store.default_profile_path() == tmp_path / "home" / ".cache" / "ft_jax" / "profiles.json"


def test_round_trip_in_default_location(tmp_path):
    p = make_profile(bp=2.5, bh=7.5, bpc=1.5, bhc=4.5)
    written = profile_store.save_profile(p)
    assert written == tmp_path / "xdg" / "ft_jax" / "profiles.json"
    doc = json.loads(written.read_text())
    assert doc["schema_version"] == profile_store.SCHEMA_VERSION and len(doc["profiles"]) == 1
    loaded, msg = profile_store.load_profile(p.key)
    assert loaded == p
    assert "using the bandwidth profile stored in" in msg


def test_save_replaces_same_key_and_keeps_others(tmp_path):
    path = tmp_path / "p.json"
    a = make_profile(bp=1.0, bh=2.0)
    other = make_profile(bp=9.0, bh=9.5, key=other_machine(a.key))
    profile_store.save_profile(a, path)
    profile_store.save_profile(other, path)
    profile_store.save_profile(make_profile(bp=3.0, bh=4.0), path)  # same key as a: replaces it
    profiles, msg = profile_store.read_profiles(path)
    assert msg == ""
    assert sorted((p.bp, p.bh) for p in profiles) == [(3.0, 4.0), (9.0, 9.5)]


def test_another_machines_profile_is_rejected(tmp_path):
    path = tmp_path / "p.json"
    here = make_profile().key
    profile_store.save_profile(make_profile(key=other_machine(here)), path)
    loaded, msg = profile_store.load_profile(here, path)
    assert loaded is None
    assert "another machine" in msg and "(another host)" in msg


def test_another_expert_size_is_not_used(tmp_path):
    path = tmp_path / "p.json"
    here = make_profile().key
    profile_store.save_profile(make_profile(key=dataclasses.replace(here, expert_bytes=here.expert_bytes * 2)), path)
    loaded, msg = profile_store.load_profile(here, path)
    assert loaded is None and "other expert sizes" in msg


def test_another_schema_is_rejected(tmp_path):
    path = tmp_path / "p.json"
    p = make_profile()
    profile_store.save_profile(p, path)
    doc = json.loads(path.read_text())
    doc["schema_version"] = profile_store.SCHEMA_VERSION + 1
    path.write_text(json.dumps(doc))
    loaded, msg = profile_store.load_profile(p.key, path)
    assert loaded is None
    assert f"schema version {profile_store.SCHEMA_VERSION + 1}" in msg
    # Saving moves the other-schema file aside and writes the current schema.
    with pytest.warns(UserWarning, match="moved it to .*p.json.other-schema"):
        profile_store.save_profile(p, path)
    assert profile_store.load_profile(p.key, path)[0] == p
    assert json.loads((tmp_path / "p.json.other-schema").read_text()) == doc


@pytest.mark.parametrize("content", ['{"schema_version": 1}', '{"schema_version": 1, "profiles": {}}',
                                     '{\n  "profiles": [\n    {\n      "bh": 8.0,'])  # the last: truncated
def test_corrupted_profile_file_warns_and_is_moved_aside(tmp_path, content):
    path = tmp_path / "ft_jax" / "profiles.json"
    path.parent.mkdir()
    path.write_text(content)
    p = make_profile()
    with pytest.warns(UserWarning, match="profiles.json is corrupted"):
        loaded, msg = profile_store.load_profile(p.key, path)
    assert loaded is None and "profiles.json.corrupt" in msg
    with pytest.warns(UserWarning, match="moved it to .*profiles.json.corrupt"):
        profile_store.save_profile(p, path)
    assert (path.parent / "profiles.json.corrupt").read_text() == content  # kept, not destroyed
    assert profile_store.load_profile(p.key, path)[0] == p
    path.write_text(content)  # a second corrupted file does not overwrite the first one set aside
    with pytest.warns(UserWarning, match="profiles.json.corrupt.1"):
        profile_store.save_profile(p, path)
    assert (path.parent / "profiles.json.corrupt.1").read_text() == content


def test_invalid_entries_are_dropped_on_save(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text('{"schema_version": 1, "profiles": [{"key": {}}]}')
    p = make_profile()
    with pytest.warns(UserWarning, match="ignored 1 invalid entries"):
        assert profile_store.load_profile(p.key, path)[0] is None
    profile_store.save_profile(p, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert profile_store.load_profile(p.key, path)[0] == p
    assert len(json.loads(path.read_text())["profiles"]) == 1


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"name": "some other tool"}', b"\xff\xfe\x00",
                                     b"plain text notes\n"])
def test_unrelated_file_is_never_overwritten(tmp_path, content):
    path = tmp_path / "some_other.json"
    path.write_bytes(content)
    p = make_profile()
    with pytest.warns(UserWarning, match="some_other.json is not an ft_jax bandwidth profile file"):
        assert profile_store.load_profile(p.key, path)[0] is None
    with pytest.raises(profile_store.NotAProfileStoreError, match="some_other.json is not an ft_jax"):
        profile_store.save_profile(p, path)
    assert path.read_bytes() == content and os.listdir(tmp_path) == ["some_other.json"]


def test_directory_is_not_a_profile_file(tmp_path):
    with pytest.raises(profile_store.NotAProfileStoreError, match="it is a directory"):
        profile_store.save_profile(make_profile(), tmp_path)
    assert os.listdir(tmp_path) == []


def test_bad_bandwidth_entry_rejected():
    d = make_profile().to_dict()
    for bad in (0.0, -1.0, float("nan"), float("inf"), "3", None, True):
        with pytest.raises(profile_store.ProfileFormatError, match="'bh'"):
            Profile.from_dict({**d, "bh": bad})
    with pytest.raises(profile_store.ProfileFormatError, match="key.cpu_count"):
        Profile.from_dict({**d, "key": {**d["key"], "cpu_count": "2"}})


def test_atomic_write_leaves_no_temp_files(tmp_path, monkeypatch):
    path = tmp_path / "d" / "p.json"
    first = make_profile(bp=1.0, bh=2.0)
    profile_store.save_profile(first, path)
    profile_store.save_profile(make_profile(bp=1.0, bh=3.0, key=other_machine(first.key)), path)
    assert os.listdir(path.parent) == ["p.json"]
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(profile_store.os, "replace", failing_replace)
    with pytest.raises(OSError, match="simulated"):
        profile_store.save_profile(make_profile(bp=5.0, bh=6.0), path)
    assert os.listdir(path.parent) == ["p.json"]  # the temporary file was removed
    assert path.read_bytes() == before  # and the old file is intact


def test_get_or_measure_without_measuring_falls_back_with_warning(tmp_path):
    path = tmp_path / "p.json"
    profile_store.save_profile(make_profile(key=other_machine(make_profile().key)), path)
    with pytest.warns(UserWarning, match="fixed-cap 1"):
        profile, msg = profiler.get_or_measure_profile(H, I, "float32", allow_measure=False, path=path)
    assert profile is None and "another machine" in msg
    path.write_text('{"profiles": [garbage')
    with pytest.warns(UserWarning):
        profile, msg = profiler.get_or_measure_profile(H, I, "float32", allow_measure=False, path=path)
    assert profile is None and "corrupted" in msg


def test_get_or_measure_falls_back_when_quick_profile_fails(tmp_path, monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError("simulated: no room for the working set")

    monkeypatch.setattr(profiler, "measure_profile", no_memory)
    with pytest.warns(UserWarning, match="fixed-cap 1"):
        profile, msg = profiler.get_or_measure_profile(H, I, "float32", path=tmp_path / "p.json")
    assert profile is None and "simulated" in msg
    assert not (tmp_path / "p.json").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------------------------------------------------


def test_llc_size_read_from_sys():
    llc = profiler.last_level_cache_bytes()
    assert llc >= 256 * 1024 and llc % 1024 == 0


def test_working_set_exceeds_cache_and_respects_budget():
    llc, mb = 32 << 20, 1 << 20
    ws = profiler.plan_working_set(88 * mb, llc, 64 * mb, 4 << 30)  # Mixtral-like 88 MB experts
    assert (ws.region_rows, ws.slot_rows, ws.per_call) == (2, 1, 1)
    ws = profiler.plan_working_set(96 * 1024, llc, 16 * mb, 4 << 30)  # H=64, I=128 f32
    assert ws.region_rows == math.ceil(2 * llc / (96 * 1024)) == ws.slot_rows == 683
    assert ws.per_call == math.ceil(16 * mb / (96 * 1024)) == 171
    small = profiler.plan_working_set(96 * 1024, llc, 16 * mb, 100 * mb)  # budget below 3 x 2 x LLC: shrinks
    assert small.total_bytes <= 100 * mb and small.per_call <= min(small.region_rows, small.slot_rows)
    with pytest.raises(ValueError, match="at least 5 experts"):
        profiler.plan_working_set(100 * mb, llc, 16 * mb, 400 * mb)


# ---------------------------------------------------------------------------------------------------------------------
# Real measurements with the production FFI handlers (small experts)
# ---------------------------------------------------------------------------------------------------------------------


def test_quick_profile_measures_saves_and_is_reused(tmp_path):
    path = tmp_path / "p.json"
    profile, msg = profiler.get_or_measure_profile(H, I, "float32", path=path)
    assert "ran a quick bandwidth profile" in msg and str(path) in msg
    assert profile.quick and profile.key == profile_store.current_key("float32", 3 * H * I * 4)
    assert_valid_measurement(profile)
    assert profile.details["region_exceeds_2x_llc"]
    again, msg = profiler.get_or_measure_profile(H, I, "float32", path=path)
    assert again == profile and "using the bandwidth profile stored" in msg


def test_cli_json_with_model_config(tmp_path, capsys):
    model = FIXTURES / "mixtral"
    status = profiler.main(["--model", str(model), "--quick", "--json", "--repeats", "2", "--no-save"])
    out = capsys.readouterr().out
    assert status == 0
    doc = json.loads(out)  # exactly one JSON object on stdout
    p = Profile.from_dict(doc["profile"])
    assert (p.hidden_size, p.intermediate_size, p.key.dtype) == (64, 128, "float32")  # from config.json
    assert p.repeats == 2
    assert_valid_measurement(p)
    assert doc["fraction"] == pytest.approx(p.fraction())
    assert doc["q_star"] == {str(m): q for m, q in profiler.q_star_table(p.fraction()).items()}
    assert doc["saved_to"] is None and isinstance(doc["recommendation"], str)
    assert not (tmp_path / "xdg").exists()  # --no-save wrote nothing


def test_cli_errors_without_expert_size(capsys):
    assert profiler.main(["--quick", "--json"]) == 2
    assert "--hidden-size" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--hidden-size", "0", "--intermediate-size", "512"], "--hidden-size must be >= 1, got 0"),
    (["--hidden-size", "64", "--intermediate-size", "-3"], "--intermediate-size must be >= 1, got -3"),
    (["--model", "/nonexistent"], "model path does not exist: /nonexistent"),
    (["--model", str(FIXTURES / "mixtral" / "config.json")], "must be a folder with config.json"),
    (["--model", str(FIXTURES)], f"no config.json in {FIXTURES}"),
    (["--model", str(FIXTURES / "mixtral"), "--hidden-size", "8"], "give either --model PATH or --hidden-size"),
    (["--model", str(FIXTURES / "mixtral"), "--intermediate-size", "8"], "give either --model PATH or"),
])
def test_cli_argument_errors_are_one_clean_line(argv, expected, capsys):
    assert profiler.main(argv + ["--quick", "--no-save"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err == f"ft-jax profile: error: {err.split('error: ', 1)[1]}" and "\n" not in err
    assert expected in err and "Errno" not in err


@pytest.mark.parametrize("kind", ["directory", "unrelated file"])
def test_cli_bad_profile_path_fails_before_measuring(tmp_path, kind, capsys, monkeypatch):
    target = tmp_path / "target"
    if kind == "directory":
        target.mkdir()
    else:
        target.write_text("my notes\n")
    monkeypatch.setattr(profiler, "measure_profile", lambda *a, **k: pytest.fail("measured despite a bad --profile"))
    assert profiler.main(["--hidden-size", "64", "--intermediate-size", "128", "--profile", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ft-jax profile: error: {target} is not an ft_jax bandwidth profile file")
    assert err.count("\n") == 1
    assert kind == "directory" or target.read_text() == "my notes\n"


def test_generate_path_keeps_unsaved_profile_when_file_is_unrelated(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile, msg = profiler.get_or_measure_profile(H, I, "float32", path=path)
    assert profile is not None and profile.quick
    assert f"not saved: {path} is not an ft_jax bandwidth profile file" in msg
    assert path.read_text() == "my notes\n"
