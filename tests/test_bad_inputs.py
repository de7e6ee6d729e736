"""Bad inputs through the real entry point (`python -m ft_jax generate` in a subprocess): each is exit status 2
with ONE stderr line naming the problem (file, tensor, field or flag and the real cause), and no traceback unless
--verbose. Tiny checkpoints are copies of the Mixtral fixture, edited in tmp_path."""

import json
import os
import shlex
import shutil
import signal
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
    kind = "NaN" if np.isnan(value) else "+Inf"
    assert path in line and repr(tensor) in line and f"holds {kind}" in line and str(list(where)) in line, line


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


@pytest.mark.parametrize("field, value, named", [
    ("num_local_experts", 10**9, "missing tensor 'model.layers.0.block_sparse_moe.experts.8.w1.weight'"),
    ("intermediate_size", 10**9, "'model.layers.0.block_sparse_moe.experts.0.w1.weight'"),
    # beyond int32 (ft_jax's ids, shapes and counters): the field itself, before anything is computed from it
    ("num_local_experts", 10**30, "field 'num_local_experts' is 1000000000000000000000000000000, beyond 2^31 - 1"),
    ("num_hidden_layers", 10**12, "field 'num_hidden_layers' is 1000000000000, beyond 2^31 - 1"),
    ("vocab_size", 10**12, "field 'vocab_size' is 1000000000000, beyond 2^31 - 1"),
])
def test_a_config_far_from_the_checkpoint_is_a_tensor_error_not_a_memory_error(tmp_path, field, value, named):
    """The expert tensors are checked against the config before the memory it implies (which would be refused as
    InsufficientMemoryError with advice to quantize); an integer beyond int32 is refused as a config field."""
    d = _model(tmp_path)
    _edit_config(d, **{field: value})
    line = _error_line("--model", d, *REQUEST)
    assert named in line and "memory" not in line, line


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


# --- nothing accepted silently (issue 18, item 4) -----------------------------------------------------------------


def test_chat_with_prompt_ids_is_refused():
    line = _error_line("--model", FIXTURE, *REQUEST, "--chat")
    assert line == ("ft-jax generate: error: --chat renders text prompts with the chat template: it cannot be used "
                    "with --prompt-ids (see --help)"), line


@pytest.mark.parametrize("value", ["1e308", "1e-300"])
def test_temperature_that_overflows_float32_is_refused(value):
    line = _error_line("--model", FIXTURE, *REQUEST[:-2], "--temperature", value)
    assert line.startswith("ft-jax generate: error: --temperature: temperature ") and f"{float(value):g}" in line
    assert "[1e-10, 1e+10]" in line and "overflow" in line, line


def test_full_context_without_max_new_tokens_says_the_prompt_fills_it():
    context = json.load(open(os.path.join(FIXTURE, "config.json")))["max_position_embeddings"]
    line = _error_line("--model", FIXTURE, "--prompt-ids", ",".join(["1"] * context), "--policy", "host-all")
    assert line == (f"ft-jax generate: error: prompt of {context} tokens fills the model's context of {context} "
                    "tokens (max_position_embeddings): no room for a new token"), line


def test_cache_slots_above_the_experts_are_clamped_with_a_note():
    cfg = json.load(open(os.path.join(FIXTURE, "config.json")))
    experts = cfg["num_hidden_layers"] * cfg["num_local_experts"]
    proc = _run("--model", FIXTURE, *REQUEST[:3], "fetch-all", *REQUEST[4:], "--cache-slots", "1000000000000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if "--cache-slots" in line]
    assert notes == [f"ft-jax: note: --cache-slots 1000000000000 is more than the {experts} experts; using "
                     f"{experts}"], proc.stderr
    assert f"expert slots         {experts} x" in proc.stderr
    proc = _run("--model", FIXTURE, *REQUEST[:3], "fetch-all", *REQUEST[4:], "--device-memory", "1GiB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if "--device-memory" in line]
    assert len(notes) == 1 and notes[0].startswith("ft-jax: note: --device-memory 1GiB holds ") and notes[0].endswith(
        f"experts, more than the {experts} experts; using {experts}"), proc.stderr


def test_stop_escapes_are_processed_like_llama_cpp():
    """--stop "\\n" (backslash, n: what a shell passes for the --help example) stops at a newline: the text is cut
    before the first one and the row ends with reason "stop"."""
    proc = _run("--prompt", "KING:", "--max-new-tokens", "60", "--temperature", "0", "--policy", "host-all",
                "--stop", "\\n", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["settings"]["stop"] == ["\n"] and out["finish_reasons"] == ["stop"]
    assert "\n" not in out["text"][0] and len(out["generated_ids"][0]) < 60


def test_a_mapped_file_truncated_under_the_process_is_named_on_the_bus_error(tmp_path):
    """The command line's SIGBUS line (interrupts.report_bus_errors): a read of a mapped page past the file's new end
    (as the expert banks map the checkpoint) writes one line naming the likely cause, then the process ends by the
    signal as before."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (1 << 16))
    code = f"""
import mmap, numpy as np
from ft_jax import interrupts
interrupts.set_label("ft-jax generate")
interrupts.report_bus_errors()
with open({str(path)!r}, "r+b") as f:
    view = np.frombuffer(mmap.mmap(f.fileno(), 1 << 16, prot=mmap.PROT_READ), np.uint8)
    f.truncate(0)
print(int(view.sum()))  # numpy's C loop touches the pages that are gone
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == -signal.SIGBUS and proc.stdout == "", (proc.returncode, proc.stderr)
    assert proc.stderr == ("\nft-jax generate: bus error: a memory-mapped file (most likely the checkpoint, whose pages "
                           "the expert banks map) shrank or was replaced while in use; leave the files alone while a "
                           "model runs, or load with --bank-memory copy to keep no mapping\n")


def test_a_closed_stdout_pipe_ends_quietly():
    """`ft-jax generate ... | head -c 20`: the reader goes away while tokens stream; exit 0 or 141, no message."""
    proc = subprocess.Popen([sys.executable, "-m", "ft_jax", "generate", "--prompt", "KING:", "--max-new-tokens",
                             "120", "--temperature", "0", "--policy", "host-all"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    head = proc.stdout.read(20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=TIMEOUT_S)
    assert head.startswith(b"KING:") and proc.returncode in (0, 141), (proc.returncode, err[-3000:])
    assert "error" not in err and "Traceback" not in err and "Exception" not in err, err[-3000:]


@pytest.mark.parametrize("kind, needle", [("binary", "is not a JSON-lines text file"), ("missing", "does not exist"),
                                          ("folder", "is a directory"), ("missing.npz", "does not exist")])
def test_trace_file_errors_name_the_file(tmp_path, capsys, kind, needle):
    """(A missing .npz said "not a readable .npz routing trace ... (FileNotFoundError)": a fresh-user trial.)"""
    from ft_jax import cli

    path = tmp_path / ("t.npz" if kind.endswith(".npz") else "t.jsonl")
    if kind == "binary":
        path.write_bytes(bytes([0x9F, 0x00, 0xFF]) * 50)
    elif kind == "folder":
        path.mkdir()
    assert cli.main(["trace", str(path), "--expert-bytes", "1000", "--bandwidth", "1,2"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and str(path) in lines[0], lines


def test_closed_stdout_is_one_line():
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "ft_jax", "generate", "--model", FIXTURE, *REQUEST])
    proc = subprocess.run(["bash", "-c", f"exec {command} >&-"], stderr=subprocess.PIPE, text=True,
                          timeout=TIMEOUT_S)  # fd 1 closed by the shell (no fork from this multithreaded process)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "stdout is closed" in lines[0], proc.stderr


@pytest.mark.parametrize("name, value", [("FT_JAX_KERNEL", "bogus"), ("FT_JAX_KERNEL", "AVX2"),
                                         ("FT_JAX_NUM_THREADS", "abc"), ("FT_JAX_NUM_THREADS", "0"),
                                         ("FT_JAX_NUM_THREADS", "\u00b2"), ("FT_JAX_HELPER_SPIN_US", "-5"),
                                         ("FT_JAX_HELPER_SPIN_US", "1e3"), ("FT_JAX_HELPER_SPIN_US", "\u0663"),
                                         ("FT_JAX_HELPER_SPIN_US", "100001")])
def test_malformed_kernel_knobs_are_refused(name, value):
    proc = subprocess.run([sys.executable, "-m", "ft_jax", "generate", "--model", FIXTURE, *REQUEST],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, name: value})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and f"{name}={value!r}" in lines[0], proc.stderr


def test_every_malformed_kernel_knob_is_named():
    """Two bad knobs at once: the CLI's one line and the library's warning name both, not only the first."""
    env = {**os.environ, "FT_JAX_KERNEL": "bogus", "FT_JAX_HELPER_SPIN_US": "-5"}
    proc = subprocess.run([sys.executable, "-m", "ft_jax", "generate", "--model", FIXTURE, *REQUEST],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "FT_JAX_KERNEL='bogus'" in lines[0] and "FT_JAX_HELPER_SPIN_US='-5'" in lines[0], lines[0]
    script = ("import warnings, ft_jax\n"
              "with warnings.catch_warnings(record=True) as w:\n"
              "    warnings.simplefilter('always')\n"
              f"    ft_jax.load({FIXTURE!r})\n"
              "print([str(x.message) for x in w if 'FT_JAX_' in str(x.message)])")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT_S,
                         env=env, check=True).stdout
    assert "FT_JAX_KERNEL='bogus'" in out and "FT_JAX_HELPER_SPIN_US='-5'" in out, out


def test_empty_list_items_are_refused():
    line = _error_line("--model", FIXTURE, "--prompt-ids", "1,,2", "--max-new-tokens", "2")
    assert "--prompt-ids" in line and "'1,,2'" in line, line


def test_clamp_notes_reach_the_json(tmp_path):
    proc = _run("--model", FIXTURE, "--prompt-ids", "1,2,3", "--policy", "fetch-all", "--max-new-tokens", "2",
                "--temperature", "0", "--cache-fraction", "1e-9", "--json")
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(proc.stdout)["notes"]
    assert any("less than one slot; using 1" in n for n in notes), notes


def test_cache_flags_under_host_all_say_they_are_not_used(tmp_path):
    """host-all (the CPU default here) never fills a slot: a cache budget is said to be unused and no slots are
    allocated for it (one, as without the flag)."""
    proc = _run("--model", FIXTURE, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--temperature", "0",
                "--cache-slots", "1000", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stats"]["policy"] == "host-all" and out["stats"]["num_slots"] == 1
    assert [n for n in out["notes"] if "--cache-slots" in n] == [
        "note: --cache-slots 1000 is not used: host-all computes every expert on the CPU and never fills a slot "
        "(give --policy fetch-all or qstar to use slots)"]


def test_cache_flags_under_resident_say_they_are_not_used():
    """resident sizes its slots to every expert whatever the budget: a budget flag was ignored without a word (a
    fresh-user trial: --cache-slots 1 ran with 24 slots)."""
    import argparse

    from ft_jax.cli import arg_types, generate
    from ft_jax.config import load_config

    for flag, value in (("cache_slots", 1), ("cache_fraction", 0.25), ("device_memory", "1MiB")):
        args = argparse.Namespace(cache_slots=None, cache_fraction=None, device_memory=None,
                                  policy=arg_types.policy("resident"))
        setattr(args, flag, value)
        notes = []
        assert generate._cache(args, load_config(FIXTURE), notes.append) is None
        shown = f"{value:g}" if isinstance(value, float) else value
        assert notes == [f"note: --{flag.replace('_', '-')} {shown} is not used: resident holds every expert of the "
                         "device in its slots"]


@pytest.mark.parametrize("backend, policies", [("cpu", "fetch-all or qstar"), ("gpu", "auto, qstar or fetch-all")])
def test_the_host_all_cache_note_names_the_policies_that_fill_slots_on_the_device(monkeypatch, backend, policies):
    """auto fills few slots or none on a CPU device (its cost model runs the paths serially there), so the note under
    an explicit host-all names it only on an accelerator."""
    import argparse

    import jax

    from ft_jax.cli import arg_types, generate
    from ft_jax.config import load_config

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    args = argparse.Namespace(cache_slots=None, cache_fraction=0.5, device_memory=None,
                              policy=arg_types.policy("host-all"))
    notes = []
    assert generate._cache(args, load_config(FIXTURE), notes.append) is None
    assert notes == ["note: --cache-fraction 0.5 is not used: host-all computes every expert on the CPU and never "
                     f"fills a slot (give --policy {policies} to use slots)"]


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_auto_on_a_cpu_device_says_its_slots_stay_unused(monkeypatch, backend):
    """A trial's `--policy auto` on a CPU allocated 16 slots and filled none (hit rate 0.0 %) without a word. The note
    does not promise none: with --devices 2 a shard's lone miss can pay for its fill through the fixed costs (a later
    trial found fills under a note that said there would be none)."""
    import argparse

    import jax

    from ft_jax.cli import arg_types, generate
    from ft_jax.config import load_config

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    args = argparse.Namespace(cache_slots=8, cache_fraction=None, device_memory=None, policy=arg_types.policy("auto"))
    notes = []
    assert generate._cache(args, load_config(FIXTURE), notes.append) == 8
    assert notes == (["note: --policy auto on a CPU device fills few slots or none: a slot there is a copy in the "
                      "same memory, read by the same cores, so a fill pays only through the calls' fixed costs in its "
                      "cost model (--policy qstar or fetch-all fill them)"] if backend == "cpu" else [])


def test_a_damaged_npz_trace_is_one_line(tmp_path, capsys):
    from ft_jax import cli

    path = tmp_path / "t.npz"
    path.write_bytes(b"PK\x03\x04garbage")
    assert cli.main(["trace", str(path), "--expert-bytes", "1000", "--bandwidth", "1,2"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "not a readable .npz routing trace" in lines[0] and str(path) in lines[0], lines
