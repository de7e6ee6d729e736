"""Checkpoint loading: bank layouts, sharded / fused / bf16 files, and clear errors for broken checkpoints."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from ft_jax.checkpoint import (CheckpointError, SafetensorsCheckpoint, load_checkpoint,
                               read_safetensors_header)
from ft_jax.config import ConfigError

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
    return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _release(ck):
    ck.gate_up_bank.release()
    ck.down_bank.release()


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
    gu, dn = ck.gate_up_bank.numpy(), ck.down_bank.numpy()
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
    np.testing.assert_array_equal(params["stacks/0/qkv"][0, :q_rows], tensors["model.layers.0.self_attn.q_proj.weight"])
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
    np.testing.assert_array_equal(ck.gate_up_bank.numpy(), mixtral.gate_up_bank.numpy())
    np.testing.assert_array_equal(ck.down_bank.numpy(), mixtral.down_bank.numpy())
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
    np.testing.assert_array_equal(ck.gate_up_bank.numpy(), mixtral.gate_up_bank.numpy())
    np.testing.assert_array_equal(ck.down_bank.numpy(), mixtral.down_bank.numpy())
    a, b = _params(ck.model), _params(mixtral.model)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    _release(ck)


def test_bfloat16_file_loads_into_float32_and_bfloat16(tmp_path, mixtral):
    tensors = load_file(os.path.join(FIXTURES, "mixtral", "model.safetensors"))
    save_file({n: t.astype(ml_dtypes.bfloat16) for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    shutil.copyfile(os.path.join(FIXTURES, "mixtral", "config.json"), tmp_path / "config.json")
    for dtype in (jnp.float32, jnp.bfloat16):
        ck = load_checkpoint(tmp_path, dtype=dtype)
        assert ck.gate_up_bank.numpy().dtype == np.dtype(dtype) and ck.model.dtype == dtype
        np.testing.assert_array_equal(ck.gate_up_bank.numpy().astype(np.float32),
                                      mixtral.gate_up_bank.numpy().astype(ml_dtypes.bfloat16).astype(np.float32))
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
