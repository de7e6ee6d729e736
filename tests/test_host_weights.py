"""Dense weights in host banks (models.layers.HostWeights): the FFI calls that read them (ffi_ops.bank_linear,
ffi_ops.bank_take) against float64 numpy references and the array path, and the loader's banks (the checkpoint's
bytes, the file's pages where mapped, NaN named, the same logits as the array path)."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ft_jax import checkpoint as checkpoint_lib
from ft_jax.checkpoint import CheckpointError, SafetensorsCheckpoint, load_checkpoint
from ft_jax.engine.engine import dense_weight_bytes
from ft_jax.kernels import ffi_ops
from ft_jax.kernels.host_bank import HostBank
from ft_jax.models.layers import HostWeights, take_rows
from test_checkpoint import _mapped_ranges, _synthetic_bf16_mixtral
from test_checkpoint import _raw_safetensors_int16 as _raw_int16
from test_model import _experts_of, jit_forward

BF16 = ml_dtypes.bfloat16


def _reference(x, w) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64).T


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("N", [1, 2, 5, 40, 130])
def test_bank_linear_is_linear_on_the_same_matrix_and_near_float64(dtype, N):
    """Every layer of a 3-row bank [O, K] with O, K off every vector width (37, 291: partial chunks and scalar
    tails), at row counts from one token to past FFI_MAX_ROWS: the same bits as ffi_ops.linear on the stacked array
    (the same kernel), and within K * 2^-22 * (|x| |w|^T) of the float64 product (float32 sums of exact products)."""
    rng = np.random.default_rng(N)
    w = rng.standard_normal((3, 37, 291)).astype(dtype)  # [L, O, K]
    x = rng.standard_normal((N, 291)).astype(dtype)  # [N, K]
    bank = HostBank.from_numpy(w)
    step = jax.jit(lambda x, layer: ffi_ops.bank_linear(x, bank, layer))
    for layer in range(3):
        y = np.asarray(step(x, np.int32(layer)))  # f32[N, O]
        np.testing.assert_array_equal(y, np.asarray(ffi_ops.linear(jnp.asarray(x), jnp.asarray(w), layer)))
        bound = 291 * 2.0 ** -22 * (np.abs(x.astype(np.float64)) @ np.abs(w[layer].astype(np.float64)).T)
        assert np.all(np.abs(y - _reference(x, w[layer])) <= bound + 1e-30)
    bank.release()


def test_bank_linear_refuses_bad_inputs_by_name():
    bank = HostBank.from_numpy(np.ones((2, 4, 8), np.float32))
    x = jnp.ones((3, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"x \[3, 6\] and bank \d+ rows \[4, 8\] disagree on K"):
        ffi_ops.bank_linear(jnp.ones((3, 6), jnp.float32), bank, 0)
    with pytest.raises(Exception, match="bank_linear: layer 2 is out of range for bank"):
        jax.block_until_ready(jax.jit(lambda x, l: ffi_ops.bank_linear(x, bank, l))(x, np.int32(2)))
    int_bank = HostBank(2, (4, 8), np.int8)
    with pytest.raises(TypeError, match="must hold float32 or bfloat16 rows"):
        ffi_ops.bank_linear(x, int_bank, 0)
    bank.release()
    with pytest.raises(ValueError, match="was released"):
        ffi_ops.bank_linear(x, bank, 0)
    int_bank.release()


@pytest.mark.parametrize("dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_bank_take_gathers_the_stored_rows_and_names_a_bad_id(dtype):
    table = np.random.default_rng(0).standard_normal((1, 50, 24)).astype(dtype)  # one row [V, H]
    bank = HostBank.from_numpy(table)
    ids = np.array([0, 49, 7, 7], np.int32)
    rows = np.asarray(ffi_ops.bank_take(ids, bank))
    assert rows.dtype == np.dtype(dtype) and rows.shape == (4, 24)
    np.testing.assert_array_equal(rows.view(np.uint8), table[0][ids].view(np.uint8))
    got = take_rows(HostWeights(bank, stacked=False), jnp.asarray(ids.reshape(2, 2)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), table[0][ids].astype(np.float32).reshape(2, 2, 24))
    with pytest.raises(Exception, match=r"bank_take: token id 50 is out of range for the table .* \(50 rows\)"):
        jax.block_until_ready(ffi_ops.bank_take(np.array([3, 50], np.int32), bank))
    with pytest.raises(TypeError, match="must hold one float32 or bfloat16 table"):
        ffi_ops.bank_take(ids, HostBank.from_numpy(np.zeros((2, 50, 24), np.float32)))
    bank.release()


def test_host_weights_shape_and_refusals():
    stack = HostBank.from_numpy(np.zeros((3, 4, 8), np.float32))
    assert HostWeights(stack, stacked=True).shape == (3, 4, 8)
    assert HostWeights(stack, stacked=True).nbytes == 3 * 4 * 8 * 4
    with pytest.raises(ValueError, match="is not one matrix"):
        HostWeights(stack, stacked=False)
    with pytest.raises(ValueError, match="is not a stack of matrices"):
        HostWeights(HostBank(2, (8,), np.float32), stacked=True)
    with pytest.raises(TypeError, match=r"only \[\.\.\.\]"):
        HostWeights(stack, stacked=True)[0]
    stack.release()


# --- the loader ------------------------------------------------------------------------------------------------
def _load(folder, monkeypatch, host: bool, **kw):
    monkeypatch.setattr(checkpoint_lib, "host_weights_apply", lambda dtype: host)
    return load_checkpoint(folder, dtype=jnp.bfloat16, **kw)


def _release(ck):
    ck.banks.gate_up.release()
    ck.banks.down.release()


@pytest.mark.parametrize("map_pages", [True, False], ids=["mapped", "copied"])
def test_loaded_host_weights_hold_the_files_tensors_and_map_its_pages(tmp_path, monkeypatch, map_pages):
    """Every projection of the attention, the embedding and the lm_head is HostWeights holding the file's bytes (the
    fused q/k/v rows in q, k, v order); mapped, the banks of the >= 1 MiB tensors are the file's pages (not copies),
    copied, none is; frozen either way."""
    path = _synthetic_bf16_mixtral(tmp_path)
    ck = _load(tmp_path, monkeypatch, True, map_pages=map_pages)
    raw = _raw_int16(path)
    model = ck.model
    attn = model.stacks[0].attn
    weights = {"embed": (model.embed_tokens[...], [["model.embed_tokens.weight"]]),
               "lm_head": (model.lm_head[...], [["lm_head.weight"]]),
               "qkv": (attn.qkv[...], [[f"model.layers.{l}.self_attn.{p}_proj.weight" for p in "qkv"]
                                        for l in range(2)]),
               "o": (attn.o[...], [[f"model.layers.{l}.self_attn.o_proj.weight"] for l in range(2)])}
    for what, (w, names) in weights.items():
        assert isinstance(w, HostWeights), what
        assert w.bank.frozen
        for row, parts in enumerate(names):
            got = w.bank.rows(row, row + 1)[0].view(np.int16)
            np.testing.assert_array_equal(got, np.concatenate([raw[n] for n in parts]), err_msg=what)
        ranges = _mapped_ranges(path)
        first_rows = [w.bank.rows(r, r + 1) for r in range(w.bank.num_rows)]
        mapped = sum(min(e, a.ctypes.data + a.nbytes) - max(s, a.ctypes.data) for a in first_rows for s, e in ranges
                     if s < a.ctypes.data + a.nbytes and e > a.ctypes.data)
        big = sum(raw[n].nbytes for parts in names for n in parts if raw[n].nbytes >= 1 << 20)
        if map_pages:
            assert mapped >= big - 2 * 4096 * w.bank.num_rows * len(names[0]), (what, mapped, big)
        else:
            assert mapped == 0, what
    _release(ck)


def test_host_weights_give_the_array_paths_logits_and_dense_bytes(tmp_path, monkeypatch):
    """The same model with its projections in host banks and as arrays: bit-identical logits for a prompt of 5
    tokens (the FFI at every row count both ways up to FFI_MAX_ROWS) and the same dense weight bytes per step."""
    _synthetic_bf16_mixtral(tmp_path)
    out = {}
    for host in (True, False):
        ck = _load(tmp_path, monkeypatch, host)
        cfg = ck.config
        assert isinstance(ck.model.stacks[0].attn.qkv[...], HostWeights) == host
        fwd, state = jit_forward(ck.model)
        tokens = np.array([[3, 17, 299, 0, 42]], np.int32)
        positions = np.arange(5, dtype=np.int32)[None]
        logits, _, _ = fwd(state, tokens, positions, ck.model.init_kv_cache(1, 8), _experts_of(ck))
        out[host] = np.asarray(logits)  # f32[1, 5, V]
        out[host, "bytes"] = dense_weight_bytes(state, cfg.tie_word_embeddings)
        _release(ck)
    assert np.isfinite(out[True]).all()
    np.testing.assert_array_equal(out[True], out[False])
    assert out[True, "bytes"] == out[False, "bytes"]


def test_nan_in_a_projection_read_into_host_weights_names_the_tensor(tmp_path, monkeypatch):
    path = _synthetic_bf16_mixtral(tmp_path)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        info = ckpt.tensors["model.layers.1.self_attn.v_proj.weight"]  # [128, 2048] bf16
    with open(path, "r+b") as f:
        f.seek(info.offset + (5 * 2048 + 9) * 2)
        f.write(np.array([0x7FC0], np.uint16).tobytes())  # bfloat16 NaN
    with pytest.raises(CheckpointError) as e:
        _load(tmp_path, monkeypatch, True)
    assert str(e.value).startswith(f"{path}: tensor 'model.layers.1.self_attn.v_proj.weight' [128, 2048] holds")
    assert "[5, 9]" in str(e.value)


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


@pytest.mark.parametrize("fixture,quantize,host,arrays", [
    # FP8 projections stay QuantizedTensor arrays; the float embedding and lm_head go to host banks
    ("qwen3_moe_fp8", None, ["embed_tokens", "lm_head"], ["stacks/0/attn/qkv", "stacks/0/attn/o"]),
    # MXFP4 experts, bf16 dense weights: every projection in a host bank, the biases and sinks arrays
    ("gpt_oss_mxfp4", None, ["embed_tokens", "lm_head", "stacks/0/attn/qkv", "stacks/0/attn/o"],
     ["stacks/0/attn/qkv_bias", "stacks/0/attn/sinks"]),
    # --quantize q8_0 quantizes the projections and the lm_head; the embedding table stays float, in a host bank
    ("mixtral", "q8_0", ["embed_tokens"], ["lm_head", "stacks/0/attn/qkv", "stacks/0/attn/o"]),
])
def test_quantized_and_mixed_checkpoints_keep_only_their_float_projections_in_host_banks(
        monkeypatch, fixture, quantize, host, arrays):
    import flax.nnx as nnx

    ck = _load(os.path.join(FIXTURES, fixture), monkeypatch, True, quantize=quantize)
    params = {"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(ck.model, nnx.Param))}
    for name in host:
        assert isinstance(params[name], HostWeights), name
    for name in arrays:
        assert not isinstance(params[name], HostWeights), name
    _release(ck)


def test_a_dropped_model_releases_its_host_weights(monkeypatch):
    """After generating (the engine's steps donate their KV cache and expert state, and jax keeps a cache keyed on
    the arguments' tree structure, which holds the static part of every node), a dropped model's dense banks are
    released: the static part of HostWeights is its bank id, not the bank (a fresh-user trial saw every dropped
    model keep its four dense banks, ~300 MB per load)."""
    import gc

    import ft_jax
    from ft_jax import _ffi

    monkeypatch.setattr(checkpoint_lib, "host_weights_apply", lambda dtype: True)
    ids = []
    for _ in range(2):
        model = ft_jax.load(os.path.join(FIXTURES, "mixtral"), dtype="bfloat16", policy="host-all", measure=False)
        model.generate([1, 2, 3], max_new_tokens=2, temperature=0)
        leaves = jax.tree_util.tree_leaves(model.engine.params, is_leaf=lambda x: isinstance(x, HostWeights))
        banks = [w.bank.id for w in leaves if isinstance(w, HostWeights)]
        assert len(banks) >= 4  # embedding, lm_head, q/k/v, o
        ids += banks
        del model, leaves
        gc.collect()
        assert not [i for i in ids if _ffi.bank_is_live(i)]


@pytest.mark.parametrize("tensor,host", [("model.layers.0.self_attn.q_proj.weight", True),
                                         ("model.layers.0.self_attn.q_proj.weight", False),
                                         ("model.embed_tokens.weight", True),
                                         ("model.layers.1.block_sparse_moe.experts.0.w2.weight", True)])
def test_a_float32_value_beyond_bfloat16_fails_the_bf16_load_by_name(tmp_path, monkeypatch, tensor, host):
    """3.4e38 is finite in float32 and infinite in bfloat16 (largest 3.39e38): a float32 checkpoint loaded as bf16
    is refused with the tensor and the index, in the host banks, the arrays and the expert banks alike (a fresh-user
    trial saw it load and fail at the first step without a name)."""
    from safetensors.numpy import load_file, save_file

    src = os.path.join(FIXTURES, "mixtral")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    assert tensors[tensor].dtype == np.float32
    tensors[tensor][1, 2] = 3.4e38
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(tmp_path / "config.json", "w") as g:
        g.write(f.read())
    with pytest.raises(CheckpointError) as e:
        _load(tmp_path, monkeypatch, host)
    assert f"tensor {tensor!r}" in str(e.value)
    assert "1 float32 values beyond the range of bfloat16, the first 3.4e+38 at index [1, 2]" in str(e.value)
