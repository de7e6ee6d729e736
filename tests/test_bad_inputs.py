"""Bad inputs through the real entry point (`python -m ft_jax generate` in a subprocess): each is exit status 2
with ONE stderr line naming the problem (file, tensor, field or flag and the real cause), and no traceback unless
--verbose. Tiny checkpoints are copies of the Mixtral fixture, edited in tmp_path."""

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny", "mixtral")
# A request that would succeed on the fixture: everything after the model path is valid.
REQUEST = ["--prompt-ids", "1,2,3", "--policy", "host-all", "--max-new-tokens", "2", "--temperature", "0"]
TIMEOUT_S = 120  # a load that blocks (e.g. opening a FIFO) fails the test instead of hanging the suite


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ft_jax", "generate", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=os.path.dirname(os.path.dirname(__file__)))


def _error_line(*args) -> str:
    """Run the CLI; check exit status 2, one stderr line, no traceback; return that line."""
    proc = _run(*args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def _model(tmp_path, name="model") -> str:
    """A writable copy of the Mixtral fixture (config.json, generation_config.json, model.safetensors)."""
    d = tmp_path / name
    d.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(FIXTURE, f), d / f)
    return str(d)


def _edit_config(d, **changes):
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))
    return path


# --- arguments -------------------------------------------------------------------------------------------------
def test_seed_out_of_range_is_rejected_while_parsing(tmp_path):
    # The model path is a FIFO checkpoint: any attempt to load would be an error (or a hang) of its own.
    d = tmp_path / "never_loaded"
    d.mkdir()
    os.mkfifo(d / "config.json")
    line = _error_line("--model", str(d), *REQUEST, "--seed", "99999999999999999999999")
    assert "--seed" in line and "99999999999999999999999" in line and "4294967295" in line, line
    assert "--seed" in line and "4294967295" in _error_line("--seed", "-1")
    help_text = _run("--help").stdout
    assert "4294967295" in help_text


def test_policy_cap_out_of_range_is_rejected_while_parsing(tmp_path):
    d = tmp_path / "never_loaded"
    d.mkdir()
    os.mkfifo(d / "config.json")
    line = _error_line("--model", str(d), "--prompt-ids", "1", "--policy", "fixed-cap:99999999999999999999")
    assert "--policy" in line and "99999999999999999999" in line and "2147483647" in line, line


# --- safetensors files -----------------------------------------------------------------------------------------
def test_index_with_a_non_string_shard(tmp_path):
    d = _model(tmp_path)
    names = load_file(os.path.join(d, "model.safetensors")).keys()
    weight_map = {n: "model.safetensors" for n in names}
    weight_map["lm_head.weight"] = 3
    index = os.path.join(d, "model.safetensors.index.json")
    json.dump({"metadata": {}, "weight_map": weight_map}, open(index, "w"))
    line = _error_line("--model", d, *REQUEST)
    assert index in line and "'lm_head.weight'" in line and "got 3" in line, line


@pytest.mark.parametrize("tensor,where,value", [
    ("lm_head.weight", (7, 3), np.nan),
    ("model.layers.1.block_sparse_moe.gate.weight", (2, 0), np.nan),  # a router
    ("model.layers.0.block_sparse_moe.experts.0.w1.weight", (5, 9), np.nan),  # a layer-0 expert (host bank)
    ("model.embed_tokens.weight", (42, 0), np.inf),  # one embedding row
])
def test_non_finite_weights_are_found_while_loading(tmp_path, tensor, where, value):
    d = _model(tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors[tensor][where] = value
    save_file(tensors, path)
    line = _error_line("--model", d, *REQUEST)
    kind = "NaN" if np.isnan(value) else "Inf"
    assert path in line and repr(tensor) in line and kind in line and str(list(where)) in line, line


def test_verbose_shows_the_traceback(tmp_path):
    d = _model(tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"][0, 0] = np.nan
    save_file(tensors, path)
    proc = _run("--model", d, *REQUEST, "--verbose")
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert "'lm_head.weight'" in proc.stderr.strip().splitlines()[-1]


def test_fifo_checkpoint_is_refused_without_blocking(tmp_path):
    d = _model(tmp_path)
    path = os.path.join(d, "model.safetensors")
    os.remove(path)
    os.mkfifo(path)
    line = _error_line("--model", d, *REQUEST)
    assert path in line and "not a regular file" in line and "FIFO" in line, line


def _alias_file(path, tensors, alias, target):
    """Write a safetensors file whose tensor ``alias`` has the data_offsets of ``target`` (no bytes of its own)."""
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        if name == alias:
            continue
        raw = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    header[alias] = {**header[target], "shape": list(tensors[alias].shape)}
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def test_overlapping_tensors_are_refused(tmp_path):
    d = _model(tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    _alias_file(path, tensors, b, a)
    line = _error_line("--model", d, *REQUEST)
    assert path in line and "overlaps" in line and repr(a) in line and repr(b) in line, line


@pytest.mark.parametrize("shard", ["{outside}", "../outside/model.safetensors", "sub/../../outside/model.safetensors"])
def test_shard_names_outside_the_folder_are_refused_before_opening(tmp_path, shard):
    d = _model(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.mkfifo(outside / "model.safetensors")  # opening it would block: the test shows it is never opened
    shard = shard.format(outside=outside / "model.safetensors")
    names = load_file(os.path.join(d, "model.safetensors")).keys()
    weight_map = {n: "model.safetensors" for n in names}
    weight_map["lm_head.weight"] = shard
    index = os.path.join(d, "model.safetensors.index.json")
    json.dump({"weight_map": weight_map}, open(index, "w"))
    line = _error_line("--model", d, *REQUEST)
    assert index in line and repr(shard) in line and "not a file name in the model folder" in line, line


# --- config.json and the model folder --------------------------------------------------------------------------
def test_config_not_utf8_names_the_file(tmp_path):
    d = _model(tmp_path)
    path = os.path.join(d, "config.json")
    text = open(path, "rb").read().replace(b'"model_type": "mixtral"', b'"model_type": "mixtral\xff"')
    open(path, "wb").write(text)
    line = _error_line("--model", d, *REQUEST)
    assert path in line and "not UTF-8" in line and "0xff" in line, line


def test_unsupported_activation_names_the_file(tmp_path):
    d = _model(tmp_path)
    path = _edit_config(d, hidden_act="relu")
    line = _error_line("--model", d, *REQUEST)
    assert path in line and "'relu'" in line and "silu" in line, line


def test_architectures_as_a_string_is_not_called_missing(tmp_path):
    d = _model(tmp_path)
    path = _edit_config(d, architectures="MixtralForCausalLM")
    line = _error_line("--model", d, *REQUEST)
    assert path in line and "'architectures'" in line and "list" in line and "missing" not in line, line


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod 000 does not deny root reads")
def test_unreadable_model_folder_says_permission_denied(tmp_path):
    d = _model(tmp_path)
    os.chmod(d, 0)
    try:
        line = _error_line("--model", d, *REQUEST)
    finally:
        os.chmod(d, 0o755)
    assert d in line and "permission denied" in line and "no config.json" not in line, line


def test_symlink_loops_are_named(tmp_path):
    loop_a, loop_b = tmp_path / "loop_a", tmp_path / "loop_b"
    os.symlink(loop_b, loop_a)
    os.symlink(loop_a, loop_b)
    line = _error_line("--model", str(loop_a), *REQUEST)
    assert str(loop_a) in line and "symbolic link loop" in line and "does not exist" not in line, line

    d = _model(tmp_path)
    for name in ("config.json", "model.safetensors"):
        path = os.path.join(d, name)
        os.rename(path, path + ".bak")
        os.symlink(path, path)  # a link to itself
        line = _error_line("--model", d, *REQUEST)
        assert path in line and "symbolic link loop" in line and "no " not in line, line
        os.remove(path)
        os.rename(path + ".bak", path)
