"""Host memory is checked from the config and the safetensors headers before anything is allocated (issue 18)."""

import json
import os
import struct
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import ft_jax
from ft_jax import memory
from ft_jax.api import bundled_model_path
from ft_jax.checkpoint import SafetensorsCheckpoint
from ft_jax.config import load_config
from ft_jax.kernels import host_bank as banks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
# Mixtral-8x7B's dense shapes with 64 experts per layer: 722 GiB of bf16 experts, more than any test machine has.
BIG = dict(H=4096, I=14336, L=32, E=64, V=32000, heads=32, kv=8, head_dim=128)


def write_fake_checkpoint(folder, H, I, L, E, V, heads, kv, head_dim, dtype="BF16"):
    """A Mixtral folder whose model.safetensors has a consistent header (tiled byte ranges, file size) but no data:
    the file is sparse, so it takes no disk space. Returns {tensor name: shape}."""
    cfg = json.load(open(os.path.join(bundled_model_path(), "config.json")))
    cfg.pop("ft_jax_tokenizer", None)
    cfg.update(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_local_experts=E, vocab_size=V,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=4096,
               torch_dtype="bfloat16" if dtype == "BF16" else "float32")
    shapes = {"model.embed_tokens.weight": [V, H], "lm_head.weight": [V, H], "model.norm.weight": [H]}
    for layer in range(L):
        p = f"model.layers.{layer}"
        shapes.update({f"{p}.input_layernorm.weight": [H], f"{p}.post_attention_layernorm.weight": [H],
                       f"{p}.self_attn.q_proj.weight": [heads * head_dim, H],
                       f"{p}.self_attn.k_proj.weight": [kv * head_dim, H],
                       f"{p}.self_attn.v_proj.weight": [kv * head_dim, H],
                       f"{p}.self_attn.o_proj.weight": [H, heads * head_dim],
                       f"{p}.block_sparse_moe.gate.weight": [E, H],
                       f"{p}.mlp.experts.gate_up_proj": [E, 2 * I, H], f"{p}.mlp.experts.down_proj": [E, H, I]})
    size = 2 if dtype == "BF16" else 4
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * size
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # sparse: the data section is never read
    return shapes


def test_host_need_matches_the_headers_bundled_model():
    """Banks, dense weights and slots computed independently from the header shapes (numpy) at f32 and bf16."""
    path = bundled_model_path()
    cfg = load_config(path)
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
    with SafetensorsCheckpoint(path) as ckpt:
        tensors = ckpt.tensors
    for dt, itemsize in ((np.dtype(np.float32), 4), (np.dtype(ml_dtypes.bfloat16), 2)):
        expert_elems = sum(int(np.prod(v["shape"])) for k, v in header.items() if ".experts." in k)
        dense_elems = sum(int(np.prod(v["shape"])) for k, v in header.items() if ".experts." not in k)
        stored = {"F32": np.float32, "BF16": ml_dtypes.bfloat16}
        largest = max(int(np.prod(v["shape"])) for k, v in header.items()
                      if ".experts." not in k or np.dtype(stored[v["dtype"]]) != dt)
        one_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        assert expert_elems == cfg.num_moe_layers * cfg.num_experts * one_expert
        need = memory.host_need(cfg, tensors, dt, num_slots=5, slots_in_host=True)
        assert need.banks == expert_elems * itemsize
        assert need.dense == dense_elems * itemsize
        assert need.slots == 5 * one_expert * itemsize
        assert need.temporary == largest * 4
        assert need.total == need.banks + need.dense + need.slots + need.temporary
        assert memory.host_need(cfg, tensors, dt, num_slots=5, slots_in_host=False).slots == 0


def test_refusal_names_both_figures_and_what_fits():
    need = memory.HostNeed(banks=10 * 1024 * MIB, dense=1024 * MIB, slots=4096 * MIB, temporary=0)
    text = memory.refusal(need, 13 * 1024 * MIB, "MemAvailable", dtype="float32", expert_bytes=64 * MIB,
                          num_slots=64, slots_in_host=True)
    assert "\n" not in text
    assert "needs 15360 MiB" in text and "only 13312 MiB is available (MemAvailable)" in text
    assert "--cache-slots 32" in text  # (13 - 11) GiB / 64 MiB
    assert "--dtype bf16" in text and "more than 15360 MiB" in text
    assert memory.refusal(need, 15360 * MIB, "x", dtype="float32", expert_bytes=64 * MIB, num_slots=64,
                          slots_in_host=True) is None
    bf16 = memory.refusal(need, 1024 * MIB, "x", dtype="bfloat16", expert_bytes=64 * MIB, num_slots=64,
                          slots_in_host=True)
    assert "--dtype" not in bf16 and "--cache-slots" not in bf16 and "a machine with more than" in bf16
    assert "--quantize" not in bf16
    assert "--quantize q8_0 or q4_0" in memory.refusal(need, 1024 * MIB, "x", dtype="bfloat16", expert_bytes=64 * MIB,
                                                      num_slots=64, slots_in_host=True, quantizable=True)


def test_available_host_memory_reads_proc_meminfo():
    found = memory.available_host_memory()
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("not Linux")
    avail_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    assert 0 < found[0] <= avail_kib * 1024 * 1.1 and found[1]


def test_load_refuses_before_allocating_any_bank(tmp_path, monkeypatch):
    write_fake_checkpoint(tmp_path / "big", **BIG)

    def no_bank(*a, **k):
        raise AssertionError("a HostBank was allocated")

    monkeypatch.setattr(banks.HostBank, "__init__", no_bank)
    t0 = time.perf_counter()
    with pytest.raises(memory.InsufficientMemoryError) as e:
        ft_jax.load(str(tmp_path / "big"), policy="host-all", cache=4)
    assert time.perf_counter() - t0 < 2.0
    msg = str(e.value)
    assert "\n" not in msg and "loading needs" in msg and "MiB is available" in msg
    assert "722 GiB" not in msg and f"expert banks {BIG['L'] * BIG['E'] * 3 * BIG['H'] * BIG['I'] * 2 // MIB} MiB" in msg


def test_generate_refuses_with_one_line_exit_2_small_rss(tmp_path):
    """`ft-jax generate` on the fake: exit 2, one line naming both figures, child peak RSS < 1 GB."""
    write_fake_checkpoint(tmp_path / "big", **BIG)
    launcher = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
                "print('RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    env = dict(os.environ, PYTHONPATH=REPO)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "ft_jax", "generate", "--model",
                        str(tmp_path / "big"), "--prompt-ids", "1,2,3", "--no-compile-cache", "--policy", "host-all"], capture_output=True, text=True, env=env, timeout=120)
    wall = time.perf_counter() - t0
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ft-jax generate: error: loading needs") and "MiB is available" in lines[0]
    assert "Traceback" not in r.stderr
    rss = int(r.stdout.split("RSS_KIB")[1])
    assert rss < 1024 * 1024, f"peak RSS {rss} KiB"
    assert wall < 60  # start-up (jax import) included; the check itself is timed in the test above


@pytest.mark.skipif(open("/proc/sys/vm/overcommit_memory").read().strip() == "1" if
                    os.path.exists("/proc/sys/vm/overcommit_memory") else True,
                    reason="needs an overcommit policy that refuses a 4 TiB mapping")
def test_failed_bank_allocation_is_the_same_memory_error():
    with pytest.raises(memory.InsufficientMemoryError, match="could not allocate a host bank"):
        banks.HostBank(1 << 20, (1 << 20,), np.float32)  # 4 TiB


def test_host_all_needs_no_memory_for_slots(monkeypatch):
    """host-all never fills or reads a slot, so its slot pools hold one element per slot: the check counts none, and
    a machine with room for the banks and dense weights but not one expert more loads it; qstar with one slot, which
    would hold an expert, is refused there."""
    path = bundled_model_path()
    cfg = load_config(path)
    with SafetensorsCheckpoint(path) as ckpt:
        need = memory.host_need(cfg, ckpt.tensors, np.dtype(np.float32), 0, True)
    monkeypatch.setattr(memory, "available_host_memory", lambda: (need.total, "test"))
    model = ft_jax.load(policy="host-all", cache=1)
    assert model.engine.num_slots == 1
    with pytest.raises(memory.InsufficientMemoryError, match=r", 1 device slots 0 MiB"):
        ft_jax.load(policy="qstar", cache=1, measure=False)
