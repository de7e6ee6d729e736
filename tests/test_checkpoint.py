"""Checkpoint loading: bank layouts, sharded / fused / bf16 files, and clear errors for broken checkpoints."""

import json
import mmap
import os
import re
import shutil
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from ft_jax import checkpoint as checkpoint_lib
from ft_jax import weight_formats as wf
from ft_jax.checkpoint import (CheckpointError, SafetensorsCheckpoint, load_checkpoint,
                               read_safetensors_header)
from ft_jax.config import ConfigError
from ft_jax.kernels.host_bank import HostBank
from ft_jax.models.layers import HostWeights

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def _copy(family, dst):
    """Writable copy of a fixture's config.json + model.safetensors in dst. Returns dst."""
    os.makedirs(dst, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(FIXTURES, family, name), os.path.join(dst, name))
    return dst


def _expert_names(family, layer, e):
    if family == "mixtral":
        b = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
        return f"{b}.w1.weight", f"{b}.w3.weight", f"{b}.w2.weight"
    b = f"model.layers.{layer}.mlp.experts.{e}"
    return f"{b}.gate_proj.weight", f"{b}.up_proj.weight", f"{b}.down_proj.weight"


def _params(model):
    """{path: numpy array} of the model's parameters (HostWeights: their bank's rows in the logical shape)."""
    def value(v):
        return v.bank.numpy().reshape(v.shape) if isinstance(v, HostWeights) else np.asarray(v)

    return {"/".join(map(str, k)): value(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _release(ck):
    ck.banks.gate_up.release()
    ck.banks.down.release()


@pytest.fixture(scope="module")
def mixtral():
    ck = load_checkpoint(os.path.join(FIXTURES, "mixtral"))
    yield ck
    _release(ck)


@pytest.mark.parametrize("family", FAMILIES)
def test_bank_rows_follow_the_contract_layout(family):
    """gate_up row = [gate_proj; up_proj] [2I, H], down row [H, I], flat id = moe_layer * E + e."""
    d = os.path.join(FIXTURES, family)
    ck = load_checkpoint(d)
    cfg = ck.config
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    tensors = load_file(os.path.join(d, "model.safetensors"))
    gu, dn = ck.banks.gate_up.numpy(), ck.banks.down.numpy()
    assert gu.shape == (cfg.num_moe_layers * E, 2 * I, H) and dn.shape == (cfg.num_moe_layers * E, H, I)
    assert gu.dtype == np.float32 and dn.dtype == np.float32
    for m, layer in enumerate(cfg.moe_layers):
        for e in range(E):
            g, u, dw = _expert_names(family, layer, e)
            np.testing.assert_array_equal(gu[m * E + e, :I], tensors[g])
            np.testing.assert_array_equal(gu[m * E + e, I:], tensors[u])
            np.testing.assert_array_equal(dn[m * E + e], tensors[dw])
    params = _params(ck.model)
    np.testing.assert_array_equal(params["embed_tokens"], tensors["model.embed_tokens.weight"])
    q_rows = cfg.num_heads * cfg.head_dim  # the fused q/k/v projection of stack 0 starts with layer 0's q_proj
    np.testing.assert_array_equal(params["stacks/0/attn/qkv"][0, :q_rows], tensors["model.layers.0.self_attn.q_proj.weight"])
    assert all(v.dtype == np.float32 for v in params.values())
    assert ck.checkpoint_bytes == os.path.getsize(os.path.join(d, "model.safetensors"))
    _release(ck)


def test_reader_agrees_with_safetensors_library():
    path = os.path.join(FIXTURES, "qwen2_moe", "model.safetensors")
    with SafetensorsCheckpoint(os.path.dirname(path)) as ckpt, safe_open(path, "numpy") as ref:
        assert set(ckpt.tensors) == set(ref.keys())
        for name in ref.keys():
            np.testing.assert_array_equal(ckpt.read(name), ref.get_tensor(name))


def test_sharded_checkpoint_equals_single_file(tmp_path, mixtral):
    tensors = load_file(os.path.join(FIXTURES, "mixtral", "model.safetensors"))
    names = sorted(tensors)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in shard}, str(tmp_path / fname))
        weight_map.update({n: fname for n in shard})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copyfile(os.path.join(FIXTURES, "mixtral", "config.json"), tmp_path / "config.json")
    ck = load_checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.banks.gate_up.numpy(), mixtral.banks.gate_up.numpy())
    np.testing.assert_array_equal(ck.banks.down.numpy(), mixtral.banks.down.numpy())
    a, b = _params(ck.model), _params(mixtral.model)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert ck.checkpoint_bytes == sum(os.path.getsize(tmp_path / f) for f in set(weight_map.values()))
    _release(ck)

    # a tensor the index lists is missing from its shard
    weight_map[names[0]] = "model-00002-of-00003.safetensors" if weight_map[names[0]].startswith("model-00001") \
        else "model-00001-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=names[0]):
        load_checkpoint(tmp_path)
    # a shard the index names does not exist
    weight_map[names[0]] = "model-00009-of-00009.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors"):
        load_checkpoint(tmp_path)


def test_fused_transformers5_expert_names(tmp_path, mixtral):
    """mlp.experts.gate_up_proj [E, 2I, H] / mlp.experts.down_proj [E, H, I] / mlp.gate.weight."""
    tensors = load_file(os.path.join(FIXTURES, "mixtral", "model.safetensors"))
    cfg = mixtral.config
    out = {}
    for name, t in tensors.items():
        if ".block_sparse_moe." not in name:
            out[name] = t
    for layer in cfg.moe_layers:
        p = f"model.layers.{layer}"
        out[f"{p}.mlp.gate.weight"] = tensors[f"{p}.block_sparse_moe.gate.weight"]
        names = [_expert_names("mixtral", layer, e) for e in range(cfg.num_experts)]
        out[f"{p}.mlp.experts.gate_up_proj"] = np.stack([np.concatenate([tensors[g], tensors[u]]) for g, u, _ in names])
        out[f"{p}.mlp.experts.down_proj"] = np.stack([tensors[d] for _, _, d in names])
    save_file(out, str(tmp_path / "model.safetensors"))
    shutil.copyfile(os.path.join(FIXTURES, "mixtral", "config.json"), tmp_path / "config.json")
    ck = load_checkpoint(tmp_path)
    np.testing.assert_array_equal(ck.banks.gate_up.numpy(), mixtral.banks.gate_up.numpy())
    np.testing.assert_array_equal(ck.banks.down.numpy(), mixtral.banks.down.numpy())
    a, b = _params(ck.model), _params(mixtral.model)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    _release(ck)


def test_bfloat16_file_loads_into_float32_and_bfloat16(tmp_path, mixtral):
    tensors = load_file(os.path.join(FIXTURES, "mixtral", "model.safetensors"))
    save_file({n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    shutil.copyfile(os.path.join(FIXTURES, "mixtral", "config.json"), tmp_path / "config.json")
    for dtype in (jnp.float32, jnp.bfloat16):
        ck = load_checkpoint(tmp_path, dtype=dtype)
        assert ck.banks.gate_up.numpy().dtype == np.dtype(dtype) and ck.model.dtype == dtype
        np.testing.assert_array_equal(ck.banks.gate_up.numpy().astype(np.float32),
                                      mixtral.banks.gate_up.numpy().astype(ml_dtypes.bfloat16).astype(np.float32))
        _release(ck)


def test_truncated_file_names_file_and_tensor(tmp_path):
    d = _copy("qwen2_moe", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    header = read_safetensors_header(path)
    new_size = os.path.getsize(path) - 1000
    cut = [n for n, t in header.items() if t.offset + t.nbytes > new_size]  # tensors reaching past the new end
    with open(path, "r+b") as f:
        f.truncate(new_size)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert "truncated" in msg and path in msg and any(repr(n) in msg for n in cut), (msg, cut)
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(d)


def test_corrupted_header(tmp_path):
    d = _copy("olmoe", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{{")
    with pytest.raises(CheckpointError, match="corrupted") as e:
        load_checkpoint(d)
    assert path in str(e.value)
    with open(path, "r+b") as f:
        f.write((10 ** 12).to_bytes(8, "little"))  # header length beyond the file
    with pytest.raises(CheckpointError, match="header length"):
        load_checkpoint(d)


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.experts.5.up_proj.weight",
                                     "model.layers.3.mlp.shared_expert_gate.weight", "lm_head.weight",
                                     "model.layers.0.self_attn.q_proj.bias"])
def test_missing_tensor_names_file_and_tensor(tmp_path, missing):
    d = _copy("qwen2_moe", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    del tensors[missing]
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    assert missing in str(e.value) and path in str(e.value) and "missing" in str(e.value)


@pytest.mark.parametrize("name", ["model.layers.2.block_sparse_moe.experts.3.w2.weight",
                                  "model.layers.0.self_attn.k_proj.weight"])
def test_wrong_shape_names_file_tensor_and_shapes(tmp_path, name):
    d = _copy("mixtral", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    expected = list(tensors[name].shape)
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert name in msg and path in msg and str(expected) in msg and str(expected[::-1]) in msg


@pytest.mark.parametrize("dense_fails_after_banks", [False, True])
def test_dense_failure_releases_the_expert_banks_of_the_other_thread(monkeypatch, dense_fails_after_banks):
    """load_checkpoint reads the experts in a second thread while the dense model is built: when the dense part
    fails, its error is raised and every expert bank is released, whether the thread filling them was cancelled part
    way (the dense error comes at once) or had finished (the error comes after the banks)."""
    import ft_jax.checkpoint as checkpoint

    made, finished = [], threading.Event()
    real_init, real_banks = HostBank.__init__, checkpoint.fill_expert_banks

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def banks_then_signal(*args, **kwargs):
        try:
            return real_banks(*args, **kwargs)
        finally:
            finished.set()

    def failing_model(cfg, make):
        if dense_fails_after_banks:
            assert finished.wait(60)
        raise CheckpointError("dense part failed")

    monkeypatch.setattr(HostBank, "__init__", recording_init)
    monkeypatch.setattr(checkpoint, "fill_expert_banks", banks_then_signal)
    monkeypatch.setattr(checkpoint, "MoETransformer", failing_model)
    with pytest.raises(CheckpointError, match="dense part failed"):
        load_checkpoint(os.path.join(FIXTURES, "mixtral"))
    assert finished.is_set()  # load_checkpoint waited for the other thread
    assert made and all(not bank.alive for bank in made)  # the banks were made, then released


def test_interrupt_while_waiting_for_the_banks_cancels_and_releases_them(monkeypatch):
    """A KeyboardInterrupt while load_checkpoint waits for the banks' thread (Ctrl-C in a Python program) cancels
    that thread at its next tensor and releases its banks, instead of waiting for every bank to load (found by a
    fresh-user trial: on the 4.9 GB bench model the interrupt came 3-9 s late)."""
    import concurrent.futures
    import time

    import ft_jax.checkpoint as checkpoint

    made, saw_cancel = [], []
    real_init, real_banks, real_result = HostBank.__init__, checkpoint.fill_expert_banks, concurrent.futures.Future.result

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    def banks_until_cancelled(*args):
        saw_cancel.append(args[-1].wait(60))  # a long load: still running when the interrupt comes
        return real_banks(*args)  # stops before its first tensor (LoadCancelled) and releases the banks

    interrupted = []

    def result_interrupted_once(self, timeout=None):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt  # as SIGINT does in the main thread's wait
        return real_result(self, timeout)

    monkeypatch.setattr(HostBank, "__init__", recording_init)
    monkeypatch.setattr(checkpoint, "fill_expert_banks", banks_until_cancelled)
    monkeypatch.setattr(concurrent.futures.Future, "result", result_interrupted_once)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(os.path.join(FIXTURES, "mixtral"))
    assert time.monotonic() - start < 30 and saw_cancel == [True]
    assert made and all(not bank.alive for bank in made)


def test_expert_bank_ids_do_not_depend_on_the_threads_timing(monkeypatch):
    """The host banks' ids are attributes of the steps' FFI calls, so of their persistent compilation cache keys: the
    expert banks are allocated in load_checkpoint's own thread before the dense model's banks, so that they get the
    lowest ids however late the filling thread starts (with them allocated in that thread, a late start gave the dense
    banks the lower ids, and a second launch a cache miss: a full compile)."""
    import time

    import ft_jax.checkpoint as checkpoint
    from ft_jax.models.layers import host_weights_apply

    if not host_weights_apply(np.dtype(ml_dtypes.bfloat16)):
        pytest.skip("the dense weights are host banks only on the CPU backend with the AVX-512 BF16 dot")
    made = []
    real_init, real_check = HostBank.__init__, checkpoint.check_experts

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self.id)

    def slow_off_the_main_thread(*args):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)  # the filling thread starts late (a busy machine)
        return real_check(*args)

    monkeypatch.setattr(HostBank, "__init__", recording_init)
    monkeypatch.setattr(checkpoint, "check_experts", slow_off_the_main_thread)
    loaded = load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.bfloat16)
    expert_ids = {bank.id for bank in loaded.banks.banks}
    dense_ids = set(made) - expert_ids
    assert expert_ids and dense_ids and max(expert_ids) < min(dense_ids)
    loaded.banks.release()


def test_reads_from_several_threads_share_the_file_handle_safely():
    """load_checkpoint reads from two threads through one SafetensorsCheckpoint (one handle per file): every read is
    positioned (a seek then a read, as the first two-thread version had, gave one thread the other's bytes: wrong FP8
    scales, caught intermittently by a test of tests/test_expert_parallel.py)."""
    path = os.path.join(FIXTURES, "qwen2_moe", "model.safetensors")
    expected = load_file(path)
    names = sorted(n for n, t in expected.items() if t.ndim >= 1 and t.shape[0] >= 2)[:24]
    errors = []
    with SafetensorsCheckpoint(os.path.dirname(path)) as ckpt:
        def reader(k: int) -> None:
            for rep in range(20):
                name = names[(k * 7 + rep) % len(names)]
                try:
                    got = ckpt.read_rows(name, 0, expected[name].shape[0])
                except Exception as e:  # a failure in a thread must fail the test too
                    errors.append((k, rep, name, repr(e)))
                    continue
                if not np.array_equal(got.view(np.uint8), expected[name].view(np.uint8)):
                    errors.append((k, rep, name))

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:5]


def test_expert_error_from_the_other_thread_is_raised(tmp_path):
    """A bad expert tensor (read in the banks' thread) fails the load with its own error, naming file and tensor."""
    d = _copy("mixtral", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 4] = np.inf
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    assert name in str(e.value) and path in str(e.value) and "Inf" in str(e.value)


def test_config_errors_surface_from_load_checkpoint(tmp_path):
    d = _copy("mixtral", tmp_path / "ckpt")
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, "architectures": ["LlamaForCausalLM"]}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="MixtralForCausalLM"):
        load_checkpoint(d)
    del cfg["num_hidden_layers"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_checkpoint(d)


def test_no_weights_file(tmp_path):
    shutil.copyfile(os.path.join(FIXTURES, "olmoe", "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_dense_weights_are_device_arrays_in_requested_dtype(mixtral):
    leaves = jax.tree.leaves(nnx.state(mixtral.model, nnx.Param))
    assert leaves and all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in leaves)
    # no routed expert weights among the dense parameters
    cfg = mixtral.config
    expert_size = cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    assert sum(x.size for x in leaves) < expert_size


# --- bad inputs (issue 11): every one a CheckpointError naming the file (and the tensor) -------------------------
def _write_raw(path, entries, data: bytes):
    """A safetensors file with a hand-written header: entries = [(name, dtype, shape, begin, end)]."""
    header = {name: {"dtype": dt, "shape": list(shape), "data_offsets": [b, e]} for name, dt, shape, b, e in entries}
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob + data)


def _reference_accepts(path) -> bool:
    """Whether the safetensors library (the format's reference reader) opens the file."""
    try:
        with safe_open(str(path), "numpy") as f:
            list(f.keys())
        return True
    except Exception:
        return False


@pytest.mark.parametrize("case,entries,data_bytes,expected", [
    ("overlap", [("a", "F32", [4], 0, 16), ("b", "F32", [4], 0, 16)], 16, "overlaps tensor 'a'"),
    ("partial overlap", [("a", "F32", [4], 0, 16), ("b", "F32", [4], 8, 24)], 24, "overlaps tensor 'a'"),
    ("gap", [("a", "F32", [2], 0, 8), ("b", "F32", [2], 12, 20)], 20, "bytes 8..12 of the data section"),
    ("trailing bytes", [("a", "F32", [2], 0, 8)], 12, "4 bytes after the last tensor"),
    ("past the end", [("a", "F32", [4], 0, 16)], 8, "truncated"),
])
def test_data_offsets_must_tile_the_data_section(tmp_path, case, entries, data_bytes, expected):
    path = tmp_path / "model.safetensors"
    _write_raw(path, entries, bytes(data_bytes))
    assert not _reference_accepts(path)
    with pytest.raises(CheckpointError) as e:
        read_safetensors_header(str(path))
    assert str(path) in str(e.value) and expected in str(e.value), str(e.value)


def test_valid_tilings_are_accepted_like_the_reference(tmp_path):
    """Out-of-order entries and zero-byte tensors on a boundary are valid (the reference reader accepts them)."""
    path = tmp_path / "model.safetensors"
    data = np.arange(6, dtype=np.float32).tobytes()
    _write_raw(path, [("b", "F32", [4], 8, 24), ("empty", "F32", [0], 8, 8), ("a", "F32", [2], 0, 8)], data)
    assert _reference_accepts(path)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        np.testing.assert_array_equal(ckpt.read("a"), [0, 1])
        np.testing.assert_array_equal(ckpt.read("b"), [2, 3, 4, 5])


def test_duplicate_header_keys_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    blob = (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(8))
    with pytest.raises(CheckpointError, match="duplicate key 'a'"):
        read_safetensors_header(str(path))


def _shard_index(d, names, **overrides):
    weight_map = {n: "model.safetensors" for n in names}
    weight_map.update(overrides)
    path = os.path.join(d, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def test_index_values_must_be_strings(tmp_path):
    d = _copy("mixtral", tmp_path / "ckpt")
    names = load_file(os.path.join(d, "model.safetensors")).keys()
    index = _shard_index(d, names, **{"lm_head.weight": 3})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    msg = str(e.value)
    assert msg.startswith(index) and "'lm_head.weight'" in msg and "got 3" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("shard", ["/etc/hostname", "../other/model.safetensors", "sub/model.safetensors", "..",
                                   "sub\\model.safetensors"])
def test_index_shard_names_outside_the_folder_are_refused(tmp_path, shard, monkeypatch):
    d = _copy("mixtral", tmp_path / "ckpt")
    names = load_file(os.path.join(d, "model.safetensors")).keys()
    index = _shard_index(d, names, **{"lm_head.weight": shard})
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: opened.append(os.fspath(p)) or real_open(p, *a, **k))
    with pytest.raises(CheckpointError) as e:
        SafetensorsCheckpoint(d)
    assert str(e.value).startswith(index) and repr(shard) in str(e.value), str(e.value)
    assert "not a file name in the model folder" in str(e.value)
    assert not [p for p in opened if p.endswith(".safetensors")], opened  # refused before opening any shard


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    tensors = load_file(os.path.join(FIXTURES, "mixtral", "model.safetensors"))
    save_file({"lm_head.weight": tensors["lm_head.weight"]}, str(tmp_path / "a.safetensors"))
    save_file(tensors, str(tmp_path / "b.safetensors"))
    _shard_index(str(tmp_path), tensors.keys())
    weight_map = {n: "b.safetensors" for n in tensors}
    weight_map["model.norm.weight"] = "a.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="'lm_head.weight' is also in"):
        SafetensorsCheckpoint(tmp_path)


def test_fifo_is_refused_without_opening(tmp_path):
    """Opening a FIFO for reading blocks until a writer appears: it must be refused from its stat alone."""
    d = _copy("mixtral", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    os.remove(path)
    os.mkfifo(path)
    done = threading.Event()

    def unblock():  # if the loader does block in open(), let it go after a while so the test fails, not hangs
        if not done.wait(20):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass

    guard = threading.Thread(target=unblock)
    guard.start()
    try:
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(d)
    finally:
        done.set()
        guard.join()
    assert str(e.value) == f"{path}: is a FIFO (named pipe), not a regular file; expected a safetensors checkpoint file"


def test_unreadable_or_looping_shard_names_the_cause(tmp_path):
    d = _copy("mixtral", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    os.remove(path)
    os.symlink(path, path)
    with pytest.raises(CheckpointError, match="symbolic link loop"):
        load_checkpoint(d)
    os.remove(path)
    os.symlink(os.path.join(d, "gone.safetensors"), path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    assert str(e.value).startswith(path) and "symbolic link to" in str(e.value) and "gone.safetensors" in str(e.value)


# Raw bit patterns: every exponent-all-ones pattern is non-finite; the largest finite value and subnormals are not.
_SPECIAL_BITS = {
    "F32": (np.uint32, [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001], [0x7F7FFFFF, 0xFF7FFFFF, 1,
                                                                                       0x80000000]),
    "BF16": (np.uint16, [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81], [0x7F7F, 0xFF7F, 1, 0x8000]),
    "F16": (np.uint16, [0x7C00, 0xFC00, 0x7E00, 0xFFFF, 0x7C01], [0x7BFF, 0xFBFF, 1, 0x8000]),
}
_NP = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16"])
def test_every_non_finite_bit_pattern_is_found(tmp_path, dtype):
    uint, bad, good = _SPECIAL_BITS[dtype]
    base = np.random.default_rng(0).standard_normal((6, 5)).astype(_NP[dtype])
    finite = base.copy()
    finite.reshape(-1).view(uint)[:len(good)] = good
    assert np.isfinite(finite.astype(np.float64)).all()
    save_file({"w": finite}, str(tmp_path / "model.safetensors"))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        np.testing.assert_array_equal(ckpt.read("w").view(uint), finite.view(uint))
    for bits in bad:
        t = base.copy()
        t.reshape(-1).view(uint)[17] = bits  # element [3, 2]
        with np.errstate(invalid="ignore"):  # casting a signalling NaN
            value = t.astype(np.float64)[3, 2]
        assert not np.isfinite(value)
        save_file({"w": t}, str(tmp_path / "model.safetensors"))
        with SafetensorsCheckpoint(tmp_path) as ckpt, pytest.raises(CheckpointError) as e:
            ckpt.read("w")
        kind = "NaN" if np.isnan(value) else "-Inf" if value < 0 else "+Inf"
        assert f"'w' [6, 5] holds {kind}: 1 of 30 elements are not finite, the first at index [3, 2]" in str(e.value)


def test_non_finite_check_covers_every_piece_of_a_large_tensor(tmp_path):
    """A 3 MiB float32 tensor is read (and checked) in 1 MiB pieces: the first/last element of each piece count."""
    n = 3 * 2**20 // 4
    for where in (0, 2**18 - 1, 2**18, n - 1):
        t = np.ones(n, np.float32)
        t[where] = np.inf
        save_file({"big": t}, str(tmp_path / "model.safetensors"))
        with SafetensorsCheckpoint(tmp_path) as ckpt, pytest.raises(CheckpointError, match=rf"index \[{where}\]"):
            ckpt.read_into("big", np.empty(n, ml_dtypes.bfloat16))


class _ShortReads:
    """A file handle whose reads return at most ``limit`` bytes (as reads of pipes or network file systems may)."""

    def __init__(self, path, limit):
        self._f, self._limit = open(path, "rb", buffering=0), limit

    def seek(self, offset):
        self._f.seek(offset)

    def readinto(self, view):
        return self._f.readinto(view[:self._limit])

    def fileno(self):
        return self._f.fileno()

    def close(self):
        self._f.close()


@pytest.mark.parametrize("limit", [4093, 999_999])  # neither a multiple of 4 bytes
def test_short_reads_split_elements_and_are_still_checked(tmp_path, limit):
    t = np.random.default_rng(1).standard_normal(300_001).astype(np.float32)  # 1.2 MB: more than one piece
    path = str(tmp_path / "model.safetensors")
    save_file({"t": t}, path)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        ckpt._handles[path] = _ShortReads(path, limit)
        np.testing.assert_array_equal(ckpt.read("t"), t)
    t[300_000] = np.nan  # the last element, read in pieces that end mid-element
    save_file({"t": t}, path)
    with SafetensorsCheckpoint(tmp_path) as ckpt, pytest.raises(CheckpointError, match=r"index \[300000\]"):
        ckpt._handles[path] = _ShortReads(path, limit)
        ckpt.read("t")


@pytest.mark.parametrize("tensor", ["lm_head.weight", "model.layers.2.block_sparse_moe.gate.weight",
                                    "model.layers.0.block_sparse_moe.experts.4.w2.weight",
                                    "model.embed_tokens.weight"])
def test_non_finite_weights_fail_the_load(tmp_path, tensor):
    d = _copy("mixtral", tmp_path / "ckpt")
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors[tensor][1, 2] = np.nan if "embed" not in tensor else -np.inf
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    kind = "-Inf" if "embed" in tensor else "NaN"
    assert str(e.value).startswith(f"{path}: tensor {tensor!r}") and f"holds {kind}" in str(e.value)
    assert "the first at index [1, 2]" in str(e.value)


def test_loaded_banks_are_read_only(mixtral):
    for bank in (mixtral.banks.gate_up, mixtral.banks.down):
        assert bank.frozen
        view = bank.numpy()
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 0
        with pytest.raises(ValueError, match="read-only"):
            bank.write_row(0, np.zeros(bank.row_shape, np.float32))


def test_index_with_an_empty_weight_map_names_the_index(tmp_path):
    shutil.copyfile(os.path.join(FIXTURES, "mixtral", "config.json"), tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'model.safetensors.index.json'}: missing tensor 'model.layers.0.")


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_hub_layout_loads(family, tmp_path):
    """DeepSeek's Hub names: mlp.experts.{e}.{gate,up,down}_proj into the banks, the MLA projections, the float32
    router (and V3's e_score_correction_bias) even in a bfloat16 load; the fused transformers-5 expert tensors
    (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) fill the same bank rows."""
    d = os.path.join(FIXTURES, family)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    ck = load_checkpoint(d, dtype=jnp.bfloat16)
    cfg = ck.config
    E, NH, bf16 = cfg.num_experts, cfg.num_heads, ml_dtypes.bfloat16
    gu, dn = ck.banks.gate_up.numpy(), ck.banks.down.numpy()
    for m, layer in enumerate(cfg.moe_layers):
        for e in range(E):
            g, u, dw = _expert_names(family, layer, e)
            np.testing.assert_array_equal(gu[m * E + e], np.concatenate([tensors[g], tensors[u]]).astype(bf16))
            np.testing.assert_array_equal(dn[m * E + e], tensors[dw].astype(bf16))
    params = _params(ck.model)
    first_moe = cfg.moe_layers[0]  # stack 0 holds the dense layers 0..first_moe-1, stack 1 the MoE layers
    a = f"model.layers.{first_moe}.self_attn."
    router = params["stacks/1/ffn/router"]
    assert router.dtype == np.float32
    np.testing.assert_array_equal(router[0], tensors[f"model.layers.{first_moe}.mlp.gate.weight"])
    if cfg.scoring_func == "sigmoid":
        np.testing.assert_array_equal(params["stacks/1/ffn/score_bias"][0],
                                      tensors[f"model.layers.{first_moe}.mlp.gate.e_score_correction_bias"])
    kv_a = tensors[a + "kv_a_proj_with_mqa.weight"]
    if cfg.q_lora_rank is not None:  # q_a_proj and kv_a_proj_with_mqa fused: one read of x
        want = np.concatenate([tensors[a + "q_a_proj.weight"], kv_a])
    else:
        want = kv_a
        np.testing.assert_array_equal(params["stacks/1/attn/q_proj"][0], tensors[a + "q_proj.weight"].astype(bf16))
    np.testing.assert_array_equal(params["stacks/1/attn/a_proj"][0], want.astype(bf16))
    kv_b = tensors[a + "kv_b_proj.weight"].reshape(NH, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    w_uv = params["stacks/1/attn/w_uv"].reshape(-1, NH, cfg.v_head_dim, cfg.kv_lora_rank)
    np.testing.assert_array_equal(w_uv[0], kv_b[:, cfg.qk_nope_head_dim:].astype(bf16))
    shared = np.concatenate([tensors[f"model.layers.{first_moe}.mlp.shared_experts.{n}_proj.weight"]
                             for n in ("gate", "up")])
    np.testing.assert_array_equal(params["stacks/1/ffn/shared_gate_up"][0], shared.astype(bf16))

    fused = {name: t for name, t in tensors.items() if ".mlp.experts." not in name}
    for layer in cfg.moe_layers:
        names = [_expert_names(family, layer, e) for e in range(E)]
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([tensors[g], tensors[u]]) for g, u, _ in names])
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([tensors[dw] for _, _, dw in names])
    save_file(fused, str(tmp_path / "model.safetensors"))
    shutil.copyfile(os.path.join(d, "config.json"), tmp_path / "config.json")
    ck2 = load_checkpoint(tmp_path, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(ck2.banks.gate_up.numpy(), gu)
    np.testing.assert_array_equal(ck2.banks.down.numpy(), dn)
    _release(ck)
    _release(ck2)
def _release_all(ck):
    for bank in ck.banks.banks:
        bank.release()


def test_gpt_oss_fused_experts_are_deinterleaved_into_the_bank_layout():
    """gpt-oss's gate_up_proj [E, H, 2I] (x @ W, gate = columns 0::2, up = 1::2) and down_proj [E, I, H] land as the
    bank rows [gate; up] [2I, H] and [H, I]; the biases as [gate bias; up bias] [2I] and [H]."""
    d = os.path.join(FIXTURES, "gpt_oss")
    ck = load_checkpoint(d)
    cfg = ck.config
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    tensors = load_file(os.path.join(d, "model.safetensors"))
    gu, dn, gb, db = (getattr(ck.banks, k).numpy() for k in ("gate_up", "down", "gate_up_bias", "down_bias"))
    assert gb.shape == (4 * E, 2 * I) and db.shape == (4 * E, cfg.hidden_size)
    for layer in range(4):
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(E):
            w, b = tensors[f"{p}.gate_up_proj"][e], tensors[f"{p}.gate_up_proj_bias"][e]  # [H, 2I], [2I]
            np.testing.assert_array_equal(gu[layer * E + e, :I], w[:, 0::2].T)
            np.testing.assert_array_equal(gu[layer * E + e, I:], w[:, 1::2].T)
            np.testing.assert_array_equal(dn[layer * E + e], tensors[f"{p}.down_proj"][e].T)
            np.testing.assert_array_equal(gb[layer * E + e], np.concatenate([b[0::2], b[1::2]]))
            np.testing.assert_array_equal(db[layer * E + e], tensors[f"{p}.down_proj_bias"][e])
    params = _params(ck.model)
    np.testing.assert_array_equal(params["stacks/0/ffn/router_bias"][1], tensors["model.layers.1.mlp.router.bias"])
    np.testing.assert_array_equal(params["stacks/0/attn/sinks"][3], tensors["model.layers.3.self_attn.sinks"])
    assert len(ck.model.stacks) == 1  # sliding and full layers share one scanned stack
    _release_all(ck)


@pytest.mark.parametrize("expert_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mxfp4_experts_equal_transformers_dequantization(expert_dtype):
    """The MXFP4 checkpoint's banks hold the stored blocks and E8M0 scales (format mxfp4, rows de-interleaved: gate
    rows then up rows), and their layer-0 rows dequantize to transformers' convert_moe_packed_tensors output (saved
    by scripts/make_gpt_oss_references.py); the biases are in the expert dtype."""
    d = os.path.join(FIXTURES, "gpt_oss_mxfp4")
    ref = np.load(os.path.join(d, "reference", "mxfp4_dequantized_layer0.npz"))
    gu_ref, dn_ref = ref["gate_up_proj"], ref["down_proj"]  # [E, H, 2I], [E, I, H]
    ck = load_checkpoint(d, expert_dtype=expert_dtype)
    E, H, I = ck.config.num_experts, ck.config.hidden_size, ck.config.moe_intermediate_size
    banks = ck.banks
    assert banks.format is wf.MXFP4 and banks.names == ("gate_up", "down", "gate_up_bias", "down_bias",
                                                        "gate_up_scale", "down_scale")
    gu, dn, gus, dns = (getattr(banks, n).numpy() for n in ("gate_up", "down", "gate_up_scale", "down_scale"))
    assert gu.shape[1:] == (2 * I, H // 2) and gus.shape[1:] == (2 * I, H // 32) and gu.dtype == np.uint8
    assert dn.shape[1:] == (H, I // 2) and dns.shape[1:] == (H, I // 32)
    assert banks.gate_up_bias.dtype == np.dtype(expert_dtype)
    assert banks.expert_bytes == wf.MXFP4.nbytes(2 * I, H) + wf.MXFP4.nbytes(H, I) + \
        (2 * I + H) * np.dtype(expert_dtype).itemsize
    tensors = load_file(os.path.join(d, "model.safetensors"))
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]  # u8[E, 2I, H/32, 16]
    scales = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]  # u8[E, 2I, H/32]
    for e in range(E):
        np.testing.assert_array_equal(gu[e, :I], blocks[e, 0::2].reshape(I, -1))
        np.testing.assert_array_equal(gu[e, I:], blocks[e, 1::2].reshape(I, -1))
        np.testing.assert_array_equal(gus[e], np.concatenate([scales[e, 0::2], scales[e, 1::2]]))
        w = wf.dequantize(gu[e], gus[e], wf.MXFP4)  # f32[2I, H]
        np.testing.assert_array_equal(w[:I], gu_ref[e][:, 0::2].T)
        np.testing.assert_array_equal(w[I:], gu_ref[e][:, 1::2].T)
        np.testing.assert_array_equal(wf.dequantize(dn[e], dns[e], wf.MXFP4), dn_ref[e].T)
    _release_all(ck)


def _mxfp4_copy(tmp_path, edit):
    d = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIXTURES, "gpt_oss_mxfp4"), d, ignore=shutil.ignore_patterns("reference"))
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return d, path


def test_mxfp4_bad_tensors_name_file_and_tensor(tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_scales"

    def nan_scale(t):
        t[name][3, 7, 0] = 255
    d, path = _mxfp4_copy(tmp_path / "a", nan_scale)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(path)}: tensor '{name}' expert 3 holds the E8M0 scale "
                                              r"255 \(NaN\) at row 7, block 0 \(columns 0\.\.31\)"):
        load_checkpoint(d)

    def overflow(t):
        t[name][0, :, :] = 254  # 2^127 times a code of magnitude >= 2 overflows float32 ...
        t[name.replace("scales", "blocks")][0] = 0x11  # ... 0.5 and 0.5 do not
        t[name.replace("scales", "blocks")][0, 2, 0, 5] = 0x71  # 6.0 (high nibble) at row 2, block 0
    d, path = _mxfp4_copy(tmp_path / "b", overflow)
    with pytest.raises(CheckpointError, match=r"down_proj_blocks' expert 0 dequantizes to Inf at row 2, block 0 "
                                              r"\(columns 0\.\.31\)"):
        load_checkpoint(d)

    gate_up = name.replace("down_proj", "gate_up_proj")  # u8 [E, 2I, 2, 16]: two blocks per row

    def overflow_253(t):  # 2^126 * 4 overflows float32, 2^126 * 3 does not
        t[gate_up][5, :, :] = 253
        t[gate_up.replace("scales", "blocks")][5] = 0x55  # 3.0 and 3.0
        t[gate_up.replace("scales", "blocks")][5, 4, 1, 9] = 0x56  # 4.0 (low nibble) at row 4, block 1
    d, path = _mxfp4_copy(tmp_path / "b253", overflow_253)
    with pytest.raises(CheckpointError, match=r"gate_up_proj_blocks' expert 5 dequantizes to Inf at row 4, block 1 "
                                              r"\(columns 32\.\.63\)"):
        load_checkpoint(d)

    def largest_finite(t):  # the largest scales with the largest codes that stay finite load
        t[name][5, :, :] = 253
        t[name.replace("scales", "blocks")][5] = 0x55
        t[name][6, :, :] = 254
        t[name.replace("scales", "blocks")][6] = 0x33  # 1.5 and 1.5
    d, path = _mxfp4_copy(tmp_path / "finite", largest_finite)
    load_checkpoint(d)

    def as_float(t):
        t[name] = t[name].astype(np.float32)
    d, path = _mxfp4_copy(tmp_path / "c", as_float)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype float32, expected uint8"):
        load_checkpoint(d)

    def drop(t):
        del t["model.layers.2.mlp.experts.gate_up_proj_blocks"]
    d, path = _mxfp4_copy(tmp_path / "d", drop)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.mlp.experts.gate_up_proj_blocks' \+ "
                                              r"'model.layers.2.mlp.experts.gate_up_proj_scales' \(the MXFP4 form of "):
        load_checkpoint(d)


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """[start, end) address ranges of the mappings of the file ``path`` in this process (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == os.path.realpath(path):
                out.append(tuple(int(a, 16) for a in fields[0].split("-")))
    return out


def _synthetic_bf16_mixtral(folder):
    """A bf16 Mixtral checkpoint by scripts/synthetic_checkpoint.py whose expert tensors are 1 MiB (mapped) and
    whose every tensor is a multiple of the page size (hidden 2048: a norm is 4096 bytes), as Mixtral's are."""
    import importlib.util

    script = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "synthetic_checkpoint.py")
    spec = importlib.util.spec_from_file_location("synthetic_checkpoint", script)
    sc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sc)
    config = sc.mixtral_config(hidden=2048, intermediate=256, layers=2, experts=2, heads=4, kv_heads=2, head_dim=64,
                               vocab=300, max_positions=128)
    sc.write_checkpoint(folder, config, seed=3)
    return os.path.join(folder, "model.safetensors")


def _raw_safetensors_int16(path):
    """{name: int16 [shape]} of a safetensors file's 2-byte tensors read by the format's definition (an 8-byte
    little-endian header length, the JSON header, then the data; safetensors' README), not by any loader: bf16 bits
    compared as int16 (numpy has no bfloat16 for safetensors.numpy)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    return {name: np.frombuffer(data[t["data_offsets"][0]:t["data_offsets"][1]], np.int16).reshape(t["shape"])
            for name, t in header.items() if name != "__metadata__" and t["dtype"] in ("BF16", "F16", "I16")}


def _page_align_data(path) -> None:
    """Rewrites a safetensors file with its header padded by spaces (the format allows trailing whitespace) so that
    its data starts at a multiple of the page size: every tensor then starts 64-byte aligned (a size multiple of 64)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = f.read(n), f.read()
    header += b" " * (-(8 + n) % mmap.PAGESIZE)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("aligned", [False, True], ids=["data_at_32_mod_64", "data_page_aligned"])
@pytest.mark.parametrize("map_pages", [True, False], ids=["mapped", "copied"])
def test_bf16_expert_banks_map_the_file_and_hold_its_tensors(tmp_path, monkeypatch, map_pages, aligned):
    """Mapped (the default): the banks are the file's pages. Copied (map_pages=False, `--bank-memory copy`): the same
    bytes in the banks' own memory, 2 MiB aligned (huge pages), and no mapping of the file left in the process.
    Dense tensors as arrays (where they are not HostWeights: tests/test_host_weights.py): a 64-byte aligned embedding
    is used in place when mapped (no copy), copied when not."""
    monkeypatch.setattr(checkpoint_lib, "host_weights_apply", lambda dtype: False)
    path = _synthetic_bf16_mixtral(tmp_path)
    if aligned:
        _page_align_data(path)
    ck = load_checkpoint(tmp_path, dtype=jnp.bfloat16, map_pages=map_pages)
    E = ck.config.num_experts
    raw = _raw_safetensors_int16(path)  # the reference reader: the file format read by hand
    for m, layer in enumerate(ck.config.moe_layers):
        for e in range(E):
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            w1, w2, w3 = (raw[f"{p}.{w}.weight"] for w in ("w1", "w2", "w3"))
            np.testing.assert_array_equal(ck.banks.gate_up.numpy()[m * E + e].view(np.int16),
                                          np.concatenate([w1, w3]))
            np.testing.assert_array_equal(ck.banks.down.numpy()[m * E + e].view(np.int16), w2)
    # mapped: the bank memory is (mostly) the file's pages, not a copy, and every row lies at its tensor's file
    # offset modulo 2 MiB (each layer's, though the norms and routers between layers shift them); copied: none of
    # it, rows at one stride from a 2 MiB aligned start
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data_start = json.loads(f.read(n)), 8 + n
    for bank, first in ((ck.banks.gate_up, "w1"), (ck.banks.down, "w2")):
        starts = [bank.rows(r, r + 1).ctypes.data for r in range(bank.num_rows)]
        inside = sum(min(e, a + bank.row_bytes) - max(s, a) for a in starts for s, e in _mapped_ranges(path)
                     if s < a + bank.row_bytes and e > a)
        if map_pages:
            assert inside >= 0.9 * bank.nbytes, (inside, bank.nbytes)
            file_offsets = [data_start + header[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{first}.weight"]
                            ["data_offsets"][0] for layer in ck.config.moe_layers for e in range(E)]
            assert [a % (2 << 20) for a in starts] == [o % (2 << 20) for o in file_offsets]
            assert len({(o - r * bank.row_bytes) % (2 << 20) for r, o in enumerate(file_offsets)}) > 1
            assert not bank.uniform  # so rows at one stride could not all have matched
        else:
            assert bank.uniform and inside == 0 and starts[0] % (2 << 20) == 0, (inside, starts[0])
    if not map_pages:  # nor do the dense weights (embedding, lm_head used as stored) keep the file mapped
        assert not _mapped_ranges(path)
    embed = ck.model.embed_tokens[...].unsafe_buffer_pointer()
    in_file = any(s <= embed < e for s, e in _mapped_ranges(path))
    assert in_file == (map_pages and aligned), (in_file, map_pages, aligned)
    _release(ck)


def _split_into_shards(path, shard_of) -> list[str]:
    """Rewrites the safetensors file ``path`` as shards (model-0000i-of-0000n.safetensors + the index), tensor
    ``name`` into shard ``shard_of(name)``, byte for byte; shard i's header carries i * 1000 + 40 bytes of metadata,
    so the shards' data start at different offsets modulo the page size (as real shards' header lengths differ), each
    a multiple of 8.
    Returns the shard paths."""
    folder = os.path.dirname(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(n)), f.read()
    header.pop("__metadata__", None)
    names = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    count = 1 + max(shard_of(k) for k in names)
    paths, weight_map = [], {}
    for i in range(count):
        shard = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        head, blobs, at = {"__metadata__": {"pad": "x" * (i * 1000 + 40)}}, [], 0
        for k in (k for k in names if shard_of(k) == i):
            lo, hi = header[k]["data_offsets"]
            head[k] = {"dtype": header[k]["dtype"], "shape": header[k]["shape"], "data_offsets": [at, at + hi - lo]}
            blobs.append(data[lo:hi])
            at += hi - lo
            weight_map[k] = shard
        raw = json.dumps(head).encode()
        raw += b" " * (-(8 + len(raw)) % 8)  # data 8-byte aligned, as the format's writers pad it
        paths.append(os.path.join(folder, shard))
        with open(paths[-1], "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))
    os.remove(path)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return paths


def test_every_shard_of_a_sharded_checkpoint_maps_into_the_banks(tmp_path):
    """Each shard has its own header length, so its tensors lie at another offset modulo the page size: with one page
    offset per bank only one shard's rows could be mapped; with one per row, every row is its file's pages, and holds
    the file's bytes."""
    path = _synthetic_bf16_mixtral(tmp_path)
    raw = _raw_safetensors_int16(path)
    shards = _split_into_shards(path, lambda name: 1 if name.startswith("model.layers.1.") else 0)
    residues = set()
    for shard in shards:
        with open(shard, "rb") as f:
            residues.add((8 + int.from_bytes(f.read(8), "little")) % mmap.PAGESIZE)
    assert len(residues) == 2
    ck = load_checkpoint(tmp_path, dtype=jnp.bfloat16)
    E = ck.config.num_experts
    for bank, parts in ((ck.banks.gate_up, ("w1", "w3")), (ck.banks.down, ("w2",))):
        for r in range(bank.num_rows):
            layer, e = ck.config.moe_layers[r // E], r % E
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            row = bank.rows(r, r + 1)
            np.testing.assert_array_equal(row[0].view(np.int16),
                                          np.concatenate([raw[f"{p}.{w}.weight"] for w in parts]))
            start = row.ctypes.data
            inside = sum(min(hi, start + bank.row_bytes) - max(lo, start) for shard in shards
                         for lo, hi in _mapped_ranges(shard) if lo < start + bank.row_bytes and hi > start)
            assert inside >= 0.9 * bank.row_bytes, (r, inside, bank.row_bytes)
    _release(ck)


def test_expert_banks_of_a_cast_keep_one_stride_and_map_nothing(tmp_path):
    """bf16 experts loaded into float32 banks are cast (read, not mapped): no row takes a file offset, so the banks stay
    uniform (a fresh-user trial saw gaps between layers with nothing mapped), and they hold the cast values."""
    path = _synthetic_bf16_mixtral(tmp_path)
    raw = _raw_safetensors_int16(path)
    ck = load_checkpoint(tmp_path, dtype=jnp.float32)
    bank = ck.banks.down
    assert bank.dtype == np.float32 and bank.uniform and ck.banks.gate_up.uniform
    assert not _mapped_ranges(path)
    w2 = raw["model.layers.1.block_sparse_moe.experts.1.w2.weight"].view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(bank.numpy()[bank.num_rows - 1], w2)
    _release(ck)


@pytest.mark.parametrize("aligned", [False, True], ids=["data_at_32_mod_64", "data_page_aligned"])
@pytest.mark.parametrize("map_pages", [True, False], ids=["mapped", "copied"])
def test_embedding_and_lm_head_are_read_straight_into_their_own_buffers_unless_used_in_place(
        tmp_path, monkeypatch, map_pages, aligned):
    """As arrays (where they are not HostWeights: tests/test_host_weights.py), the embedding and lm_head (used whole,
    not stacked) are file views only where the model uses the view in place (mapped and 64-byte aligned); otherwise
    they are read into a 2 MiB aligned buffer that the parameter is (one pass, no view populated beside the copy),
    holding the file's bytes. Layer tensors are always views (copied into their stacks)."""
    monkeypatch.setattr(checkpoint_lib, "host_weights_apply", lambda dtype: False)
    path = _synthetic_bf16_mixtral(tmp_path)
    if aligned:
        _page_align_data(path)
    viewed = []
    view = SafetensorsCheckpoint.view
    monkeypatch.setattr(SafetensorsCheckpoint, "view",
                        lambda self, name, *a, **k: viewed.append(name) or view(self, name, *a, **k))
    ck = load_checkpoint(tmp_path, dtype=jnp.bfloat16, map_pages=map_pages)
    raw = _raw_safetensors_int16(path)
    whole = {"model.embed_tokens.weight": ck.model.embed_tokens[...], "lm_head.weight": ck.model.lm_head[...]}
    for name, param in whole.items():
        np.testing.assert_array_equal(np.asarray(param).view(np.int16), raw[name])
        assert (name in viewed) == (map_pages and aligned), (name, viewed)
        if not (map_pages and aligned):  # a buffer of its own (huge_page_buffer: 64-byte aligned at this size)
            pointer = param.unsafe_buffer_pointer()
            assert pointer % 64 == 0 and not any(s <= pointer < e for s, e in _mapped_ranges(path))
    assert "model.layers.0.self_attn.q_proj.weight" in viewed
    _release(ck)


def test_nan_in_the_lm_head_read_into_its_buffer_names_the_tensor(tmp_path):
    path = _synthetic_bf16_mixtral(tmp_path)  # data at 32 mod 64: lm_head is read, not mapped
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        info = ckpt.tensors["lm_head.weight"]  # [300, 2048] bf16
    assert info.offset % 64 == 32
    with open(path, "r+b") as f:
        f.seek(info.offset + (299 * 2048 + 2047) * 2)  # its last element
        f.write(np.array([0xFF80], np.uint16).tobytes())  # bfloat16 -inf
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, dtype=jnp.bfloat16)
    assert str(e.value).startswith(f"{path}: tensor 'lm_head.weight' [300, 2048] holds")
    assert "the first at index [299, 2047]" in str(e.value)


def test_nan_in_a_mapped_expert_tensor_names_the_tensor(tmp_path):
    path = _synthetic_bf16_mixtral(tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.1.w1.weight"  # [256, 2048] bf16 (gate_up bank row 3)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        offset = ckpt.tensors[name].offset
    with open(path, "r+b") as f:
        f.seek(offset + (100 * 2048 + 7) * 2)  # element [100, 7], in a page in the middle of the tensor
        f.write(np.array([0x7FC0], np.uint16).tobytes())  # bfloat16 quiet NaN
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, dtype=jnp.bfloat16)
    assert str(e.value).startswith(f"{path}: tensor {name!r} [256, 2048] holds NaN: 1 of 524288 elements")
    assert "the first at index [100, 7]" in str(e.value)


def test_view_maps_the_tensor_read_only_and_checks_it(tmp_path):
    t = np.random.default_rng(4).standard_normal((300, 1000)).astype(np.float32)
    save_file({"a": np.ones(3, np.float32), "t": t}, str(tmp_path / "model.safetensors"))
    path = str(tmp_path / "model.safetensors")
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        v = ckpt.view("t", (300, 1000))
        np.testing.assert_array_equal(v, t)
        assert not v.flags.writeable and _mapped_ranges(path)
        del v
        assert not _mapped_ranges(path)  # the mapping went with the array
    t[299, 999] = -np.inf
    save_file({"a": np.ones(3, np.float32), "t": t}, path)
    with SafetensorsCheckpoint(tmp_path) as ckpt, pytest.raises(CheckpointError, match=r"'t' \[300, 1000\] holds "
                                                                                        r"-Inf.*index \[299, 999\]"):
        ckpt.view("t")


def test_page_offsets_map_the_most_bytes_per_row(tmp_path):
    """A 104-byte tensor shifts the later tensors by 104 bytes: in a row holding a (1 MiB) and b (2 MiB) the residue
    of b wins; a row of its own follows its tensor; a row without a mapped tensor (none, or one under 1 MiB) follows
    the previous row; with per_row False one offset wins for the bank."""
    save_file({"a": np.zeros(1 << 18, np.float32), "b": np.zeros(1 << 19, np.float32),
               "c": np.zeros(1 << 19, np.float32), "a0": np.zeros(26, np.float32)}, str(tmp_path / "model.safetensors"))
    M, H2 = 1 << 20, 2 << 20
    with SafetensorsCheckpoint(tmp_path) as ckpt:  # file order: a, a0 (104 bytes), b, c
        off = {n: ckpt.tensors[n].offset for n in ("a", "b", "c")}
        assert (off["b"] - off["a"]) % 4096 == 104
        regions = [(0, "a", 0, 0, M), (0, "b", 0, M, 2 * M), (1, "c", 0, 0, 2 * M), (2, "a0", 0, 0, 104)]
        row0, row1 = (off["b"] - M) % H2, off["c"] % H2
        assert ckpt.page_offsets(regions, 3, 3 * M, np.float32) == [row0, row1, (row1 + 3 * M) % H2]
        # one offset: row 1 at 3 MiB from row 0, so c votes for (off_c - 3 MiB), which is b's: 4 MiB against a's 1
        assert ckpt.page_offsets(regions, 3, 3 * M, np.float32, per_row=False) == [row0]
        assert ckpt.page_offsets(regions[:1], 2, 3 * M, np.float32) == [off["a"] % H2, (off["a"] + 3 * M) % H2]
        assert ckpt.page_offsets([(1, "b", M, 0, M)], 2, 3 * M, np.float32) == [0, (off["b"] + M) % H2]  # b's 2nd half
        assert ckpt.page_offsets([], 3, 3 * M, np.float32) == [0, M, 0]
        with pytest.raises(CheckpointError, match="missing tensor 'z'"):
            ckpt.page_offsets([(0, "z", 0, 0, 4)], 1, 4, np.float32)
        assert ckpt.page_offsets(regions, 3, 3 * M, ml_dtypes.bfloat16) == [0, M, 0]  # a cast maps nothing
    with SafetensorsCheckpoint(tmp_path, map_pages=False) as ckpt:  # nothing is mapped: rows at one stride
        assert ckpt.page_offsets(regions, 3, 3 * M, np.float32) == [0, M, 0]


def test_read_into_a_frozen_bank_view_is_refused_and_maps_nothing(tmp_path):
    t = np.random.default_rng(5).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    save_file({"t": t}, str(tmp_path / "model.safetensors"))
    path = str(tmp_path / "model.safetensors")
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        bank = HostBank(1, (512, 1024), np.float32, ckpt.page_offsets([(0, "t", 0, 0, 2 << 20)], 1, 2 << 20,
                                                                          np.float32))
        bank.freeze()
        with pytest.raises(TypeError, match="read-write"):  # as any read-only destination
            ckpt.read_into("t", bank.numpy()[0])
        assert not _mapped_ranges(path) and not bank.numpy().any()
        bank.release()


@pytest.mark.parametrize("how", ["read_rows", "read_into"])
def test_a_non_finite_element_in_a_row_range_is_named_in_the_stored_tensor(tmp_path, how):
    """The expert loader reads one expert's rows of a fused [E, ...] tensor; the error names the stored tensor, its
    shape and the index in it (a fresh-user trial saw 'w[5:6]' [1, 4, 5] at [0, 2, 3])."""
    t = np.random.default_rng(2).standard_normal((8, 4, 5)).astype(np.float32)
    t[5, 2, 3] = np.nan
    save_file({"w": t}, str(tmp_path / "model.safetensors"))
    message = (r"tensor 'w' \[8, 4, 5\] holds NaN: 1 of 20 elements of rows 5:6 are not finite, the first at index "
               r"\[5, 2, 3\]")
    with SafetensorsCheckpoint(tmp_path) as ckpt, pytest.raises(CheckpointError, match=message):
        if how == "read_rows":
            ckpt.read_rows("w", 5, 6)
        else:
            ckpt.read_into("w", np.empty((1, 4, 5), np.float32), rows=range(5, 6))
    with SafetensorsCheckpoint(tmp_path) as ckpt:  # the other rows are fine
        np.testing.assert_array_equal(ckpt.read_rows("w", 6, 8), t[6:8])
