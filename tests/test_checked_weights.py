"""The record of checkpoint bytes already checked for NaN/Inf (ft_jax.checked_weights): what it covers is not checked
again, a changed file is checked again, and the loader's errors are the same with and without it."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import ft_jax
from ft_jax import checked_weights
from ft_jax import checkpoint as checkpoint_lib
from ft_jax.checked_weights import CheckedWeights, file_version
from ft_jax.checkpoint import CheckpointError, SafetensorsCheckpoint, load_checkpoint
from script_modules import load_script

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


@pytest.fixture
def settled(monkeypatch):
    """Files written by the test count as settled at once (the record otherwise waits SETTLE_NS after a write)."""
    monkeypatch.setattr(checked_weights, "SETTLE_NS", 0)


@pytest.fixture
def check_calls(monkeypatch):
    """The byte counts of the NaN/Inf checks the loader runs on float tensors: [bytes of each call]."""
    calls = []
    real = checkpoint_lib._has_non_finite

    def counting(bits, mask):
        calls.append(bits.nbytes)
        return real(bits, mask)

    monkeypatch.setattr(checkpoint_lib, "_has_non_finite", counting)
    return calls


def _mixtral_copy(folder):
    os.makedirs(folder)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(FIXTURES, "mixtral", name), os.path.join(folder, name))
    return os.path.join(folder, "model.safetensors")


def _bf16_mixtral(folder):
    """A bf16 Mixtral whose expert tensors are 1 MiB: mapped into the banks, not read (scripts/synthetic_checkpoint)."""
    sc = load_script("synthetic_checkpoint")
    config = sc.mixtral_config(hidden=2048, intermediate=256, layers=2, experts=2, heads=4, kv_heads=2, head_dim=64,
                               vocab=300, max_positions=128)
    sc.write_checkpoint(folder, config, seed=3)
    return os.path.join(folder, "model.safetensors")


def _data_bytes(path):
    """[start, stop) of a safetensors file's tensor data (after the 8-byte length and the JSON header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return 8 + n, os.path.getsize(path)


def test_ranges_are_merged_and_covered_only_inside_one(tmp_path, settled):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(1000))
    record = CheckedWeights(tmp_path / "record.json")
    record.opened(str(path), file_version(os.stat(path)))
    for start, stop in [(100, 200), (300, 400), (200, 250), (390, 500)]:
        record.add(str(path), start, stop)
    record.save()
    again = CheckedWeights(tmp_path / "record.json")
    again.opened(str(path), file_version(os.stat(path)))
    assert [again.covers(str(path), a, b) for a, b in [(100, 250), (120, 130), (300, 500), (99, 150), (240, 260),
                                                       (250, 300), (450, 501)]] == [True, True, True, False, False,
                                                                                  False, False]
    stored = json.loads((tmp_path / "record.json").read_text())["files"][str(path)]["ranges"]
    assert stored == [[100, 250], [300, 500]]


def test_a_file_written_since_is_not_covered(tmp_path, settled):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(1000))
    record = CheckedWeights(tmp_path / "record.json")
    record.opened(str(path), file_version(os.stat(path)))
    record.add(str(path), 0, 1000)
    record.save()
    st = os.stat(path)
    with open(path, "r+b") as f:  # the same size, and the modification time put back: only the change time moves
        f.write(b"\x01")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = CheckedWeights(tmp_path / "record.json")
    again.opened(str(path), file_version(os.stat(path)))
    assert not again.covers(str(path), 0, 10)


def test_a_file_just_written_is_not_recorded(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(1000))
    record = CheckedWeights(tmp_path / "record.json")
    record.opened(str(path), file_version(os.stat(path)))
    record.add(str(path), 0, 1000)
    record.save()  # its times are within SETTLE_NS: a second write in the same clock tick would not change them
    again = CheckedWeights(tmp_path / "record.json")
    again.opened(str(path), file_version(os.stat(path)))
    assert not again.covers(str(path), 0, 1000)


@pytest.mark.parametrize("text", [
    "", "{", "[1, 2]", '{"schema_version": 1, "files": {"a": {"version": 3}}}', '{"schema_version": 99, "files": {}}',
    '{"schema_version": 1, "files": {"/x": {"version": [1, 2, 3, 4, 5], "ranges": [[0, 1e999]]}}}',  # OverflowError
    '{"schema_version": 1, "files": {"/x": {"version": [1, 2, 3, 4, 5], "ranges": [], "used_ns": 1e999}}}',
    "[" * 100_000 + "]" * 100_000,  # RecursionError in the JSON parser
], ids=["empty", "cut", "a list", "a bad version", "another schema", "inf range", "inf used_ns", "deep nesting"])
def test_a_damaged_record_is_an_empty_one_and_is_replaced(tmp_path, settled, text):
    (tmp_path / "record.json").write_text(text)
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(10))
    record = CheckedWeights(tmp_path / "record.json")
    record.opened(str(path), file_version(os.stat(path)))
    assert not record.covers(str(path), 0, 10)
    record.add(str(path), 0, 10)
    record.save()
    assert json.loads((tmp_path / "record.json").read_text())["files"][str(path)]["ranges"] == [[0, 10]]


def test_the_record_keeps_the_most_recently_used_files(tmp_path, settled, monkeypatch):
    monkeypatch.setattr(checked_weights, "MAX_FILES", 3)
    for i in range(5):
        path = tmp_path / f"w{i}.bin"
        path.write_bytes(bytes(10))
        record = CheckedWeights(tmp_path / "record.json")
        record.opened(str(path), file_version(os.stat(path)))
        record.add(str(path), 0, 10)
        record.save()
    files = json.loads((tmp_path / "record.json").read_text())["files"]
    assert sorted(os.path.basename(f) for f in files) == ["w2.bin", "w3.bin", "w4.bin"]


@pytest.mark.parametrize("make, dtype", [(_mixtral_copy, jnp.float32), (_bf16_mixtral, jnp.bfloat16)],
                         ids=["read", "mapped"])
def test_a_second_load_checks_nothing_and_loads_the_same_weights(tmp_path, settled, check_calls, make, dtype):
    path = make(str(tmp_path / "ckpt"))
    record_path = tmp_path / "record.json"
    first = load_checkpoint(tmp_path / "ckpt", dtype=dtype, checked=CheckedWeights(record_path))
    checked = sum(check_calls)
    start, stop = _data_bytes(path)
    with SafetensorsCheckpoint(tmp_path / "ckpt") as ckpt:
        floats = sum(t.nbytes for t in ckpt.tensors.values())
    assert checked == floats  # every float byte once (the fixtures hold float tensors only)
    assert json.loads(record_path.read_text())["files"][path]["ranges"] == [[start, stop]]
    check_calls.clear()
    second = load_checkpoint(tmp_path / "ckpt", dtype=dtype, checked=CheckedWeights(record_path))
    assert check_calls == []
    for bank in ("gate_up", "down"):
        np.testing.assert_array_equal(getattr(first.banks, bank).numpy(), getattr(second.banks, bank).numpy())
    first.banks.release()
    second.banks.release()


@pytest.mark.parametrize("make, dtype, tensor, bits", [
    (_mixtral_copy, jnp.float32, "model.layers.0.block_sparse_moe.experts.4.w2.weight", (np.float32, np.nan)),
    (_bf16_mixtral, jnp.bfloat16, "model.layers.1.block_sparse_moe.experts.1.w1.weight", (np.uint16, 0x7FC0)),
], ids=["read", "mapped"])
def test_a_nan_written_after_a_recorded_load_is_found(tmp_path, settled, make, dtype, tensor, bits):
    path = make(str(tmp_path / "ckpt"))
    record_path = tmp_path / "record.json"
    load_checkpoint(tmp_path / "ckpt", dtype=dtype, checked=CheckedWeights(record_path)).banks.release()
    with SafetensorsCheckpoint(tmp_path / "ckpt") as ckpt:
        offset = ckpt.tensors[tensor].offset
    st = os.stat(path)
    with open(path, "r+b") as f:  # in place, the same size, the modification time put back
        f.seek(offset + 8 * np.dtype(bits[0]).itemsize)
        f.write(np.array([bits[1]], bits[0]).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "ckpt", dtype=dtype, checked=CheckedWeights(record_path))
    assert str(e.value).startswith(f"{path}: tensor {tensor!r}") and "holds NaN" in str(e.value)


def test_a_failed_load_records_nothing(tmp_path, settled):
    path = _mixtral_copy(str(tmp_path / "ckpt"))
    with SafetensorsCheckpoint(tmp_path / "ckpt") as ckpt:
        info = ckpt.tensors["lm_head.weight"]
    with open(path, "r+b") as f:
        f.seek(info.offset)
        f.write(np.array([np.inf], np.float32).tobytes())
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_checkpoint(tmp_path / "ckpt", checked=CheckedWeights(tmp_path / "record.json"))
    assert not (tmp_path / "record.json").exists()


def test_load_records_by_default_and_weight_check_always_records_nothing(tmp_path, settled, check_calls,
                                                                         monkeypatch):
    record_path = tmp_path / "cache" / "checked_weights.json"
    monkeypatch.setattr(checked_weights, "default_record_path", lambda: record_path)
    _mixtral_copy(str(tmp_path / "ckpt"))
    ft_jax.load(tmp_path / "ckpt", weight_check="always")
    assert check_calls and not record_path.exists()
    ft_jax.load(tmp_path / "ckpt")
    assert record_path.exists()
    check_calls.clear()
    ft_jax.load(tmp_path / "ckpt", weight_check="ONCE")
    assert check_calls == []
    ft_jax.load(tmp_path / "ckpt", weight_check="always")
    assert check_calls


@pytest.mark.parametrize("value, error", [("never", ValueError), (True, TypeError), (None, TypeError)])
def test_load_refuses_other_weight_checks(value, error):
    with pytest.raises(error, match=r"weight_check= / --weight-check: expected one of once, always, got"):
        ft_jax.load(weight_check=value)


def test_the_command_line_records_by_default_and_refuses_other_values(tmp_path):
    import subprocess
    import sys
    import time

    folder = tmp_path / "ckpt"
    _mixtral_copy(str(folder))
    time.sleep(checked_weights.SETTLE_NS / 1e9 + 0.1)  # the copy settles: the record may hold it
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    base = [sys.executable, "-m", "ft_jax", "generate", "--model", str(folder), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "2", "--json", "--no-compile-cache"]
    record = tmp_path / "cache" / "ft_jax" / "checked_weights.json"
    out = subprocess.run(base + ["--weight-check", "always"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert not record.exists()
    out = subprocess.run(base, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    files = json.loads(record.read_text())["files"]
    assert list(files) == [str(folder / "model.safetensors")]
    out = subprocess.run(base + ["--weight-check", "never"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "--weight-check: invalid choice: 'never'" in out.stderr


def test_a_record_that_is_not_a_regular_file_is_not_read(tmp_path):
    import threading

    os.mkfifo(tmp_path / "record.json")  # reading it would block until a writer came
    made = []
    worker = threading.Thread(target=lambda: made.append(CheckedWeights(tmp_path / "record.json")), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert made and made[0]._files == {}
