"""Loading quantized weights (issue 19): --quantize q8_0 / q4_0 of a float checkpoint, FP8 block-scaled checkpoints
and gpt-oss's MXFP4 experts kept as stored, the stored bytes per expert everywhere, and the errors.

References are computed independently: gguf's numpy quantizer (gguf.quants.quantize) for the q8_0 / q4_0 bytes, the
tensors written by the test itself (FP8 data and scale grids with partial edge blocks) for what the banks hold, and
numpy float64 for the dequantized values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import ft_jax
from ft_jax import _ffi, checkpoint, memory
from ft_jax import weight_formats as wf
from ft_jax.checkpoint import (CheckpointError, SafetensorsCheckpoint, _DenseReader, expert_tensor_plan,
                               load_checkpoint, allocate_expert_banks, fill_expert_banks)
from ft_jax.cli.generate import stats_table
from ft_jax.config import ConfigError, load_config
from ft_jax.config.quantization import expert_format, quantize_applies, read_quantization
from ft_jax.defaults import bundled_model_path
from ft_jax.engine.engine import Engine
from ft_jax.kernels.host_bank import HostBank
from ft_jax.offload import profile as bandwidth
from ft_jax.offload.banks import ExpertBanks
from ft_jax.offload.experts import OffloadedExperts
from ft_jax.offload.policy import Policy, PolicyKind

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
F8 = ml_dtypes.float8_e4m3fn
BLOCK = (24, 40)  # fp8 block of the written checkpoint: I = 32 rows -> 24 + 8, H = 64 cols -> 40 + 24 (partial edges)


def _bf16_copy(family: str, dst) -> str:
    """The fixture ``family`` rewritten in bfloat16 (config dtype bfloat16). Returns the folder."""
    d = str(dst)
    os.makedirs(d, exist_ok=True)
    src = os.path.join(FIXTURES, family)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
    return d


def _expert_banks(cfg, ckpt, plan, fmt, bias_dtype):
    """The filled expert banks, as load_checkpoint makes them (allocated, then filled)."""
    return fill_expert_banks(allocate_expert_banks(cfg, ckpt, plan, fmt, bias_dtype), cfg, ckpt, plan)


def _load_parts(d, dtype, quantize=None):
    """(config, ExpertBanks, dense factory, checkpoint) of folder d, as load_checkpoint builds them (the model itself
    is left out: these tests look at what the loader reads, not at the models' handling of QuantizedTensor)."""
    cfg = load_config(d)
    fmt = expert_format(cfg, dtype, quantize)
    ckpt = SafetensorsCheckpoint(d)
    banks = _expert_banks(cfg, ckpt, expert_tensor_plan(cfg, ckpt, fmt), fmt, np.dtype(dtype))
    return cfg, banks, _DenseReader(ckpt, np.dtype(dtype), cfg.family, fmt if fmt.quantized else None), ckpt


# where weight_formats.storage_format keeps q4_0 as Q4_0_X16: the CPU backend at the AVX-512 kernel level
X16_HERE = jax.default_backend() == "cpu" and _ffi.kernel_isa() == "avx512bf16"


def rows_of_q4_0x16(data, scales):
    """q4_0x16 data u8 [..., R, cols / 2] and scales f16 [..., R, nb] in q4_0's row layout, by the layout's
    definition (ft_jax.weight_formats docstring) read element by element: bytes 4c .. 4c + 3 of row 16g + i's block b
    are at byte 256 b + 64 c + 4 i of group g (which starts at row 16g's byte offset); its scale of block b at
    16 b + i of the group's scales."""
    R, half = data.shape[-2:]
    nb = half // 16
    r, b, c, j = np.ix_(np.arange(R), np.arange(nb), np.arange(4), np.arange(4))
    at = (r // 16) * 16 * half + 256 * b + 64 * c + 4 * (r % 16) + j  # [R, nb, 4, 4]: row r's byte 16b + 4c + j
    rows = data.reshape(*data.shape[:-2], -1)[..., at.reshape(R, half)]
    r, b = np.ix_(np.arange(R), np.arange(nb))
    srows = scales.reshape(*scales.shape[:-2], -1)[..., (r // 16) * 16 * nb + 16 * b + r % 16]
    return rows, srows


def test_q4_0x16_layout_and_its_inverse():
    """weight_formats.interleave_rows (C++) writes the layout its definition gives, deinterleave_rows undoes it, and
    dequantize reads Q4_0_X16 as the q4_0 values they hold; 16 rows (one group) and 48 rows of 3 blocks."""
    rng = np.random.default_rng(5)
    for rows, cols in ((16, 32), (48, 96)):
        data, scales = wf.quantize(rng.standard_normal((rows, cols)).astype(np.float32), wf.Q4_0)
        inter_data, inter_scales = data.copy(), scales.copy()
        wf.interleave_rows(inter_data, inter_scales)
        assert not np.array_equal(inter_data, data)
        back = rows_of_q4_0x16(inter_data, inter_scales)
        np.testing.assert_array_equal(back[0], data)
        np.testing.assert_array_equal(back[1], scales)
        for got, want in zip(wf.deinterleave_rows(np.stack([inter_data] * 2), np.stack([inter_scales] * 2)),
                             (np.stack([data] * 2), np.stack([scales] * 2))):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(wf.dequantize(inter_data, inter_scales, wf.Q4_0_X16),
                                      wf.dequantize(data, scales, wf.Q4_0))
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        wf.interleave_rows(*wf.quantize(np.ones((24, 32), np.float32), wf.Q4_0))


@pytest.mark.parametrize("kernel", ["avx512bf16", "avx2", "generic"])
def test_q4_0_storage_format_follows_the_kernel_level(kernel):
    """q4_0 is kept as Q4_0_X16 only where its kernel runs (the CPU backend at the AVX-512 level) and every matrix is
    whole groups of 16 rows; the AVX2 and portable levels keep q4_0's row layout, which their row kernels read.
    FT_JAX_KERNEL caps the level (read once per process, so in a subprocess)."""
    script = ("from ft_jax import _ffi, weight_formats as wf\n"
              "print(_ffi.kernel_isa(), wf.storage_format(wf.Q4_0, 64, 32).kernel_name, "
              "wf.storage_format(wf.Q4_0, 64, 24).kernel_name, wf.storage_format(wf.Q8_0, 64).kernel_name)")
    env = dict(os.environ, FT_JAX_KERNEL=kernel, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    isa = out[0]  # the level this CPU allows under the cap
    assert out[1:] == ["q4_0x16" if isa == "avx512bf16" else "q4_0", "q4_0", "q8_0"], out


def test_q4_0_dense_projections_are_stacked_in_the_cpu_storage_format(tmp_path):
    """quantize="q4_0" on the CPU: the stacked q/k/v and o projections and lm_head of the model are Q4_0_X16 (their
    row counts are multiples of 16) holding, read back by the layout's definition, weight_formats.quantize's bytes of
    the stored tensors (q/k/v concatenated along the rows)."""
    if not X16_HERE:
        pytest.skip("Q4_0_X16 is the layout of the CPU backend at the AVX-512 kernel level")
    d = _bf16_copy("qwen3_moe", tmp_path / "ckpt")
    ck = checkpoint.load_checkpoint(d, dtype=jnp.bfloat16, quantize="q4_0")
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in
               load_file(os.path.join(FIXTURES, "qwen3_moe", "model.safetensors")).items()}
    checked = 0
    for stack in ck.model.stacks:  # runs of MoE and dense layers (this fixture: 0-1 MoE, 2 dense, 3 MoE)
        for i, layer in enumerate(stack.layers):
            p = f"model.layers.{layer}.self_attn"
            for param, parts in ((stack.attn.qkv[...], ("q_proj", "k_proj", "v_proj")),
                                 (stack.attn.o[...], ("o_proj",))):
                assert param.fmt is wf.Q4_0_X16
                want = wf.quantize(np.concatenate([tensors[f"{p}.{n}.weight"] for n in parts]), wf.Q4_0)
                for got, expected in zip(rows_of_q4_0x16(np.asarray(param.data[i]), np.asarray(param.scales[i])), want):
                    np.testing.assert_array_equal(got, expected)
            checked += 1
    assert checked == ck.config.num_layers
    head = ck.model.lm_head[...]
    assert head.fmt is wf.Q4_0_X16
    for got, expected in zip(rows_of_q4_0x16(np.asarray(head.data), np.asarray(head.scales)),
                             wf.quantize(tensors["lm_head.weight"], wf.Q4_0)):
        np.testing.assert_array_equal(got, expected)
    ck.banks.release()


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_quantize_while_loading_equals_gguf(tmp_path, monkeypatch, name):
    """A bf16 Qwen3-MoE checkpoint loaded with quantize=q8_0 / q4_0: every bank row holds weight_formats.quantize of
    its tensors, whose bytes are gguf's (checked for every expert of one layer), expert_bytes is the stored size,
    dense projections (lm_head included) are QuantizedTensor, routers, embeddings and norms stay as stored. The
    loader quantizes pieces of rows (here 100 values: one or two rows a piece) and gets the bytes of the whole."""
    monkeypatch.setattr(checkpoint, "_QUANTIZE_PIECE_VALUES", 100)
    d = _bf16_copy("qwen3_moe", tmp_path / "ckpt")
    fmt = wf.by_name(name)
    cfg, banks, make, ckpt = _load_parts(d, ml_dtypes.bfloat16, name)
    tensors = load_file(os.path.join(FIXTURES, "qwen3_moe", "model.safetensors"))  # f32 values = the bf16 ones
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    # q4_0 on the CPU at the AVX-512 level: banks in groups of 16 interleaved rows (H and I are multiples of 16),
    # read back here by the layout's definition
    assert banks.format is (wf.Q4_0_X16 if name == "q4_0" and X16_HERE else fmt)
    assert banks.names == ("gate_up", "down", "gate_up_scale", "down_scale")
    assert banks.expert_bytes == fmt.nbytes(2 * I, H) + fmt.nbytes(H, I) == \
        memory.planned_expert_bytes(cfg, ml_dtypes.bfloat16, fmt)
    assert banks.expert_bytes < 3 * H * I * 2  # smaller than bf16
    gu, dn, gus, dns = (getattr(banks, n).numpy() for n in banks.names)
    if banks.format.interleave > 1:
        (gu, gus), (dn, dns) = rows_of_q4_0x16(gu, gus), rows_of_q4_0x16(dn, dns)
    gtype = getattr(gguf.GGMLQuantizationType, name.upper())
    for m, layer in enumerate(cfg.moe_layers):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            w_bf16 = {k: tensors[f"{p}.{k}_proj.weight"].astype(ml_dtypes.bfloat16) for k in ("gate", "up", "down")}
            gate_up = np.concatenate([w_bf16["gate"], w_bf16["up"]])
            data, scales = wf.quantize(gate_up, fmt)
            np.testing.assert_array_equal(gu[m * E + e], data)
            np.testing.assert_array_equal(gus[m * E + e], scales)
            data, scales = wf.quantize(w_bf16["down"], fmt)
            np.testing.assert_array_equal(dn[m * E + e], data)
            np.testing.assert_array_equal(dns[m * E + e], scales)
            if m == 0:  # the bytes gguf's quantizer writes for the same values
                ref = gguf.quants.quantize(w_bf16["down"].astype(np.float32), gtype)
                np.testing.assert_array_equal(wf.gguf_blocks(dn[e], dns[e], fmt), ref)
    q = make("model.layers.0.self_attn.q_proj.weight", tensors["model.layers.0.self_attn.q_proj.weight"].shape,
             "weight")
    assert isinstance(q, wf.QuantizedTensor) and q.fmt is fmt
    ref = gguf.quants.quantize(tensors["model.layers.0.self_attn.q_proj.weight"].astype(ml_dtypes.bfloat16)
                               .astype(np.float32), gtype)
    np.testing.assert_array_equal(wf.gguf_blocks(q.data, q.scales, fmt), ref)
    head = make("lm_head.weight", (cfg.vocab_size, H), "weight")
    assert isinstance(head, wf.QuantizedTensor) and head.data.shape == fmt.data_shape(cfg.vocab_size, H)
    for stays, kind in (("model.embed_tokens.weight", "weight"), ("model.layers.1.mlp.gate.weight", "weight"),
                        ("model.layers.0.input_layernorm.weight", "norm")):
        got = make(stays, tensors[stays].shape, kind)
        assert isinstance(got, np.ndarray) and got.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got, tensors[stays].astype(ml_dtypes.bfloat16))
    assert not quantize_applies("model.layers.3.mlp.shared_expert_gate.weight", (1, H))
    assert quantize_applies("model.layers.3.mlp.shared_expert.down_proj.weight", (H, I))
    ckpt.close()
    banks.release()


def test_quantize_refuses_a_row_that_does_not_fit_its_blocks(tmp_path):
    """q4_0 needs rows of a multiple of 32 values: DeepSeek-V2's fixture (I = 16) is refused naming the tensor."""
    d = os.path.join(FIXTURES, "deepseek_v2")
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.\d+.mlp.experts.0.down_proj"
                                              r".weight': rows of 16 elements do not fit q4_0's blocks of 32"):
        load_checkpoint(d, quantize="q4_0")
    cfg = load_config(d)
    with SafetensorsCheckpoint(d) as ckpt:  # the dense side names its tensor too
        make = _DenseReader(ckpt, np.float32, cfg.family, wf.Q8_0)
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        with pytest.raises(CheckpointError, match=re.escape(f"tensor {name!r}: rows of {cfg.kv_lora_rank} elements "
                                                            "do not fit q8_0's blocks of 32")):
            make(name, ckpt.tensors[name].shape, "weight")
    # ft_jax.load checks the rows from the headers before it sizes the banks and the host memory (found by a new
    # user's trial: that sizing used to refuse first, with "a [128, 16] matrix" and no file or tensor)
    for quantize in ("q8_0", "q4_0"):
        with pytest.raises(CheckpointError, match=r"deepseek_v2/model.safetensors: tensor 'model.layers.\d+\."
                                                  rf".+\.weight': rows of \d+ elements do not fit {quantize}'s"):
            ft_jax.load(d, quantize=quantize)


def _fp8_quantize(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """(f8e4m3fn [rows, cols], f32 scale_inv [ceil(rows / br), ceil(cols / bc)]): one scale per block = amax / 448,
    as DeepSeek's fp8 conversion (partial edge blocks take the amax of what they cover)."""
    br, bc = block
    R, C = w.shape
    s = np.zeros((-(-R // br), -(-C // bc)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = max(np.abs(w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]).max(), 1e-12) / wf.FP8_MAX
    full = np.repeat(np.repeat(s, br, 0)[:R], bc, 1)[:, :C]
    return (w / full).astype(F8), s


def _write_fp8_checkpoint(d) -> dict:
    """The Qwen3-MoE fixture as a block-FP8 checkpoint (BLOCK, partial edge blocks): every linear weight of the
    decoder layers but the router F8_E4M3 + weight_scale_inv (f32; bf16 for the down projections, values exactly
    bf16); embeddings, lm_head, norms and routers as stored. Returns the written tensors."""
    os.makedirs(d, exist_ok=True)
    src = os.path.join(FIXTURES, "qwen3_moe")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head", "mlp.gate"]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    out = {}
    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        if k.startswith("model.layers.") and k.endswith("proj.weight"):
            data, s = _fp8_quantize(v, BLOCK)
            out[k] = data
            out[f"{k}_scale_inv"] = s.astype(ml_dtypes.bfloat16) if "down_proj" in k else s
        else:
            out[k] = v.astype(ml_dtypes.bfloat16)
    save_file(out, os.path.join(d, "model.safetensors"))
    return out


def test_fp8_checkpoint_kept_as_stored(tmp_path):
    """The banks of a block-FP8 checkpoint hold exactly the stored FP8 bytes and the scale grids (gate's then up's,
    bf16 ones widened to f32 exactly); the dense projections are QuantizedTensor of the stored data and scales, the
    router and the embedding stay float; dequantized rows equal the float64 reference of the stored values."""
    d = str(tmp_path / "fp8")
    t = _write_fp8_checkpoint(d)
    cfg, banks, make, ckpt = _load_parts(d, ml_dtypes.bfloat16)
    fmt = banks.format
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert fmt.name == "fp8" and fmt.block == BLOCK and cfg.quantization.block == BLOCK
    sr = fmt.scale_rows(I)  # 2 scale rows per matrix of 32 rows
    assert banks.gate_up_scale.row_shape == (2 * sr, 2) and banks.down_scale.row_shape == (3, 1)
    assert banks.expert_bytes == 3 * H * I + 4 * (2 * sr * 2 + 3) == memory.planned_expert_bytes(cfg, "bfloat16", fmt)
    gu, dn, gus, dns = (getattr(banks, n).numpy() for n in banks.names)
    for m, layer in enumerate(cfg.moe_layers):
        for e in range(E):
            p, r = f"model.layers.{layer}.mlp.experts.{e}", m * E + e
            np.testing.assert_array_equal(gu[r, :I].view(np.uint8), t[f"{p}.gate_proj.weight"].view(np.uint8))
            np.testing.assert_array_equal(gu[r, I:].view(np.uint8), t[f"{p}.up_proj.weight"].view(np.uint8))
            np.testing.assert_array_equal(dn[r].view(np.uint8), t[f"{p}.down_proj.weight"].view(np.uint8))
            np.testing.assert_array_equal(gus[r, :sr], t[f"{p}.gate_proj.weight_scale_inv"])
            np.testing.assert_array_equal(gus[r, sr:], t[f"{p}.up_proj.weight_scale_inv"])
            np.testing.assert_array_equal(dns[r], t[f"{p}.down_proj.weight_scale_inv"].astype(np.float32))
            assert gus.dtype == dns.dtype == np.float32
    # value (r, c) = data * scale[r // br, c // bc], in float64, against the pair layout of dequantize
    p = "model.layers.0.mlp.experts.3"
    want = np.concatenate([t[f"{p}.{k}_proj.weight"].astype(np.float64) *
                           np.repeat(np.repeat(t[f"{p}.{k}_proj.weight_scale_inv"].astype(np.float64), BLOCK[0], 0)
                                     [:I], BLOCK[1], 1)[:, :H] for k in ("gate", "up")])
    np.testing.assert_array_equal(wf.dequantize(gu[3], gus[3], fmt, rows=I, dtype=np.float64), want)
    name = "model.layers.1.self_attn.o_proj.weight"
    o = make(name, t[name].shape, "weight")
    assert isinstance(o, wf.QuantizedTensor) and o.fmt == fmt
    np.testing.assert_array_equal(o.data.view(np.uint8), t[name].view(np.uint8))
    np.testing.assert_array_equal(o.scales, t[f"{name}_scale_inv"])
    router = make("model.layers.0.mlp.gate.weight", t["model.layers.0.mlp.gate.weight"].shape, "weight")
    assert isinstance(router, np.ndarray) and router.dtype == ml_dtypes.bfloat16
    emb = make("model.embed_tokens.weight", t["model.embed_tokens.weight"].shape, "weight")
    assert isinstance(emb, np.ndarray) and emb.dtype == ml_dtypes.bfloat16
    ckpt.close()
    banks.release()
    with pytest.raises(ConfigError, match=r"^quantize='q8_0' \(--quantize q8_0\): this Qwen3MoeForCausalLM "
                                          r"checkpoint is already quantized \(fp8"):
        load_checkpoint(d, quantize="q8_0")


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",  # a dense projection
                                  "model.layers.0.mlp.experts.2.gate_proj.weight"])  # an expert's rows in a bank
def test_fp8_block_that_dequantizes_to_inf_is_named(tmp_path, name):
    """A finite scale_inv whose product with the block's largest code overflows float32 fails the load naming the
    scale tensor and the block; the largest scale that cannot overflow (float32 max / 448) loads."""
    d = str(tmp_path / "fp8")
    t = _write_fp8_checkpoint(d)
    path = os.path.join(d, "model.safetensors")
    scale = f"{name}_scale_inv"
    codes = np.abs(t[name].astype(np.float32))  # f32[rows, cols]: the stored codes
    i, j = t[scale].shape[0] - 1, t[scale].shape[1] - 1  # the last (partial) block
    biggest = float(codes[i * BLOCK[0]:, j * BLOCK[1]:].max())
    assert biggest > 0
    t[scale] = t[scale].copy()
    t[scale][i, j] = 2 * float(np.finfo(np.float32).max) / biggest  # finite, its products are not
    save_file(t, path)
    rows, cols = t[name].shape
    with pytest.raises(CheckpointError, match=rf"^{re.escape(path)}: tensor '{re.escape(scale)}' block \[{i}, {j}\] "
                                              rf"\(rows {i * BLOCK[0]}..{rows - 1}, columns {j * BLOCK[1]}..{cols - 1}\) "
                                              r"holds the scale .* overflows float32"):
        load_checkpoint(d)
    t[scale][i, j] = float(np.finfo(np.float32).max) / 448 * 0.99
    save_file(t, path)
    load_checkpoint(d).banks.release()


@pytest.mark.parametrize("where", ["data", "f32 scale", "bf16 scale"])
def test_fp8_nan_is_reported_naming_file_and_tensor(tmp_path, where):
    d = str(tmp_path / "fp8")
    t = _write_fp8_checkpoint(d)
    path = os.path.join(d, "model.safetensors")
    name = {"data": "model.layers.1.mlp.experts.5.up_proj.weight",
            "f32 scale": "model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv",
            "bf16 scale": "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"}[where]
    bad = t[name].copy()
    if where == "data":
        bits = bad.view(np.uint8)
        bits[2, 3] = 0xFF  # S.1111.111: NaN in float8_e4m3fn
    else:
        bad[-1, -1] = np.inf if where == "f32 scale" else np.nan
    t[name] = bad
    save_file(t, path)
    cfg = load_config(d)
    fmt = expert_format(cfg, "bfloat16")
    with SafetensorsCheckpoint(d) as ckpt:
        plan = expert_tensor_plan(cfg, ckpt, fmt)
        kind = r"\+Inf" if where == "f32 scale" else "NaN"
        expect = (rf"^{re.escape(path)}: tensor '{re.escape(name)}' \[32, 64\] holds NaN: 1 of 2048 FP8 elements are "
                  r"NaN, the first at index \[2, 3\]") if where == "data" else \
            rf"^{re.escape(path)}: tensor '{re.escape(name)}' \[{bad.shape[0]}, {bad.shape[1]}\] holds {kind}: 1 of " \
            rf"{bad.size} elements are not finite, the first at index \[{bad.shape[0] - 1}, {bad.shape[1] - 1}\]"
        with pytest.raises(CheckpointError, match=expect):
            _expert_banks(cfg, ckpt, plan, fmt, np.dtype(ml_dtypes.bfloat16))
    name = "model.layers.0.self_attn.q_proj.weight"  # the dense side checks its FP8 data too
    t[name] = t[name].copy()
    t[name].view(np.uint8)[0, 0] = 0x7F
    save_file(t, path)
    with SafetensorsCheckpoint(d) as ckpt:
        with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' .* holds NaN"):
            _DenseReader(ckpt, np.dtype(ml_dtypes.bfloat16), cfg.family, fmt)(name, t[name].shape, "weight")


def test_mxfp4_scale_255_is_reported(tmp_path):
    """An E8M0 scale of 255 (NaN) in gpt-oss's MXFP4 experts is refused naming the file, tensor and expert."""
    d = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIXTURES, "gpt_oss_mxfp4"), d, ignore=shutil.ignore_patterns("reference"))
    path = os.path.join(d, "model.safetensors")
    t = load_file(path)
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    t[name][6, 9, 1] = 255
    save_file(t, path)
    cfg = load_config(d)
    with SafetensorsCheckpoint(d) as ckpt:
        plan = expert_tensor_plan(cfg, ckpt, wf.MXFP4)
        with pytest.raises(CheckpointError, match=rf"^{re.escape(path)}: tensor '{name}' expert 6 holds the E8M0 "
                                                  r"scale 255 \(NaN\)"):
            _expert_banks(cfg, ckpt, plan, wf.MXFP4, np.dtype(np.float32))


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors", "bitsandbytes"])
def test_other_quantization_methods_are_refused(tmp_path, method):
    d = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIXTURES, "qwen3_moe"), d, ignore=shutil.ignore_patterns("reference"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match=rf"config.json: quantization_config quant_method '{method}' is not "
                                          r"implemented \(supported: fp8, mxfp4"):
        load_checkpoint(d)


def test_fp8_config_fields_are_checked():
    with pytest.raises(ConfigError, match=r"^c: quantization_config has no quant_method \(an object naming one of "
                                          r"fp8, mxfp4"):  # it said "quant_method None is not implemented"
        read_quantization({"quantization_config": {}}, "c", "qwen3_moe")
    base = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert read_quantization({"quantization_config": base}, "c", "qwen3_moe").block == (128, 128)
    for bad, what in (({"weight_block_size": None}, "weight_block_size"), ({"weight_block_size": [128, 0]},
                      "weight_block_size"), ({"fmt": "e5m2"}, "fmt 'e5m2'"),
                      ({"activation_scheme": "static"}, "activation_scheme 'static'")):
        with pytest.raises(ConfigError, match=f"^c: quantization_config.{what}"):
            read_quantization({"quantization_config": {**base, **bad}}, "c", "qwen3_moe")
    with pytest.raises(ConfigError, match="'mxfp4' is implemented for gpt-oss"):
        read_quantization({"quantization_config": {"quant_method": "mxfp4"}}, "c", "mixtral")
    with pytest.raises(ValueError, match="quantize must be one of q8_0, q4_0"):
        expert_format(load_config(os.path.join(FIXTURES, "mixtral")), np.float32, "q5_k")


def test_load_accepts_the_cli_spellings_of_quantize():
    """ft_jax.load(quantize=...) takes what --quantize takes (any case, surrounding spaces): one normalization,
    weight_formats.quantize_choice, gives the same name to both, and the loaded experts are in that format."""
    from ft_jax.cli import arg_types

    model = ft_jax.load(quantize="Q8_0", policy="fixed-cap:1", measure=False)
    assert model.checkpoint.banks.format is wf.Q8_0
    model.checkpoint.banks.release()
    for text, name in (("Q8_0", "q8_0"), ("q4_0", "q4_0"), (" Q4_0 ", "q4_0")):
        assert wf.quantize_choice(text) == arg_types.quantize(text) == name
    assert wf.quantize_choice(None) is None
    with pytest.raises(ValueError, match=r"^quantize= / --quantize: quantize must be one of q8_0, q4_0 \(any case\) or "
                                         r"None, got 'Q5_K'$"):
        ft_jax.load(quantize="Q5_K")


@pytest.mark.parametrize("value", [8, b"q8_0", wf.Q8_0])
def test_load_refuses_a_quantize_that_is_not_a_str(value):
    """quantize=8 (or bytes, or a WeightFormat) is a TypeError naming the argument, the expected type and the value."""
    with pytest.raises(TypeError) as e:
        ft_jax.load(quantize=value, policy="fixed-cap:1", measure=False)
    assert str(e.value) == (f'quantize= / --quantize: quantize must be a str ("q8_0" or "q4_0", any case) or None, '
                            f"got {type(value).__name__} {value!r}")


def test_quantizing_a_quantized_checkpoint_names_the_argument():
    """quantize= on an MXFP4 (gpt-oss) or FP8 checkpoint: the error names the Python argument (quantize='q8_0') and
    the flag (--quantize q8_0), not the flag alone."""
    for family, method in (("gpt_oss_mxfp4", "mxfp4"), ("qwen3_moe_fp8", "fp8")):
        with pytest.raises(ConfigError) as e:
            ft_jax.load(os.path.join(FIXTURES, family), quantize="q8_0", policy="fixed-cap:1", measure=False)
        assert str(e.value).startswith("quantize='q8_0' (--quantize q8_0): this ") and \
            f"checkpoint is already quantized ({method}, quantization_config of config.json)" in str(e.value), e.value


def test_expert_banks_check_the_format_layout():
    """ExpertBanks refuses scale banks that do not match the format (naming the bank, expected vs got), and a
    quantized format without them."""
    H, I = 64, 32
    rows = wf.expert_rows(wf.Q4_0, H, I)
    assert rows == {"gate_up": ((64, 32), np.dtype(np.uint8)), "down": ((64, 16), np.dtype(np.uint8)),
                    "gate_up_scale": ((64, 2), np.dtype(np.float16)), "down_scale": ((64, 1), np.dtype(np.float16))}
    banks = {n: HostBank(2, s, dt) for n, (s, dt) in rows.items()}
    eb = ExpertBanks(**banks, format=wf.Q4_0)
    assert eb.expert_bytes == 64 * 32 + 64 * 16 + 2 * (64 * 2 + 64) == wf.Q4_0.nbytes(64, 64) + wf.Q4_0.nbytes(64, 32)
    assert eb.pool_shapes(3)["gate_up_scale"] == ((3, 64, 2), np.dtype(np.float16))
    with pytest.raises(ValueError, match=r"down_scale rows of format q8_0 \(H=64, I=32\) must be \[64, 1\] float16"):
        ExpertBanks(HostBank(2, (64, 64), np.int8), HostBank(2, (64, 32), np.int8), gate_up_scale=banks["gate_up_scale"],
                    down_scale=HostBank(2, (64, 2), np.float16), format=wf.Q8_0)
    with pytest.raises(ValueError, match="format q4_0 needs scale banks"):
        ExpertBanks(banks["gate_up"], banks["down"], format=wf.Q4_0)
    eb.release()


def test_stored_sizes_for_memory_check_and_profile(tmp_path):
    """The pre-load memory check, the profile key and --quantize's slot budgets count experts at the stored size."""
    cfg = load_config(os.path.join(FIXTURES, "qwen3_moe"))
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    q4 = memory.planned_expert_bytes(cfg, "bfloat16", wf.Q4_0)
    assert q4 == 2 * I * H // 2 + H * I // 2 + 2 * (2 * I * H // 32 + H * I // 32)
    with SafetensorsCheckpoint(os.path.join(FIXTURES, "qwen3_moe")) as ckpt:
        need = memory.host_need(cfg, ckpt.tensors, "bfloat16", 7, True, wf.Q4_0)
        plain = memory.host_need(cfg, ckpt.tensors, "bfloat16", 7, True)
        dense_q = sum(wf.Q4_0.nbytes(*t.shape) if quantize_applies(n, t.shape) else math.prod(t.shape) * 2
                      for n, t in ckpt.tensors.items() if ".experts." not in n)
    assert need.banks == cfg.num_moe_layers * cfg.num_experts * q4 and need.slots == 7 * q4
    assert need.dense == dense_q < plain.dense
    assert bandwidth.expert_nbytes(H, I, "bf16", wf.Q4_0) == q4  # no biases in qwen3
    key = bandwidth.machine_key("bfloat16", q4, wf.Q4_0)
    assert key["dtype"] == "q4_0" and key["expert_bytes"] == q4
    assert bandwidth.format_key("bf16", wf.fp8((128, 128))) == "fp8_128x128"


def test_weight_bytes_per_token_in_the_statistics():
    """Engine.generate's statistics name the weight format, and the weight bytes per token = (dense weights but the
    embedding table + active experts per step * expert bytes) / batch, the dense bytes counted from the headers; a row
    that ends early stops counting: the bytes are divided by the tokens the decode steps made."""
    d = bundled_model_path()
    ckpt = load_checkpoint(d, dtype=jnp.float32)
    with SafetensorsCheckpoint(d) as headers:
        dense = sum(math.prod(t.shape) * 4 for n, t in headers.tensors.items()
                    if ".experts." not in n and n != "model.embed_tokens.weight")
    engine = Engine(ckpt, policy=Policy(PolicyKind.FETCH_ALL), num_slots=8)
    assert engine.dense_bytes == dense
    stats = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=4).stats
    assert stats["weight_format"] == "f32" and stats["dense_weight_bytes"] == dense
    want = (dense + stats["active_per_step"] * ckpt.banks.expert_bytes) / 2
    assert stats["weight_bytes_per_token"] == pytest.approx(want, rel=1e-12)
    assert f"{want / 2**20:.2f} MiB read per token" in stats_table(stats)
    # row 0 ends at its first decoded token (its eos): 2 steps of which only the first decodes row 0
    first = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=2).tokens
    eos = first[0][1]  # row 0's second token, produced by the first decode step
    early = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=4, eos_token_ids=[eos])
    row1_tokens = len(early.tokens[1]) - 1
    assert len(early.tokens[0]) == 2 and row1_tokens > 1
    s = early.stats
    read = dense * s["decode_steps"] + s["active_per_step"] * s["decode_steps"] * ckpt.banks.expert_bytes
    want = read / (1 + row1_tokens)
    assert s["decode_tokens"] == 1 + row1_tokens and s["weight_bytes_per_token"] == pytest.approx(want, rel=1e-12)
    ckpt.banks.release()


def _dequantized_banks(banks: ExpertBanks, I: int) -> ExpertBanks:
    """Float32 banks holding the dequantized values of quantized ``banks`` (weight_formats.dequantize, exact)."""
    fmt = banks.format
    gu = wf.dequantize(banks.gate_up.numpy(), banks.gate_up_scale.numpy(), fmt, rows=I)  # f32[R, 2I, H]
    dn = wf.dequantize(banks.down.numpy(), banks.down_scale.numpy(), fmt)  # f32[R, H, I]
    return ExpertBanks(HostBank.from_numpy(gu), HostBank.from_numpy(dn))


def _step_logits(model, backend, num_slots, tokens):
    """(logits f32[len(tokens), V], top-k ids i32[len(tokens), L, k]) of feeding ``tokens`` one at a time through one
    compiled T=1 step (teacher forcing: both paths of a comparison see the same tokens)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, token, position, kv, state):
        return nnx.merge(graphdef, params)(token, position, kv, state, backend, collect=True)

    kv = model.init_kv_cache(1, len(tokens))
    state = backend.init_state(num_slots)
    rows, routing = [], []
    for pos, token in enumerate(tokens):
        logits, kv, state, aux = step(params, jnp.asarray([[token]], jnp.int32), jnp.asarray([[pos]], jnp.int32), kv,
                                      state)
        rows.append(np.asarray(logits[0, 0]))
        routing.append(np.asarray(aux.topk_ids[:, 0, 0]))  # [L, k]
    assert step._cache_size() == 1
    return np.stack(rows), np.stack(routing)


# q8_0 / q4_0 on the int8-activation kernels (AVX2 or AVX-512 VNNI, as llama.cpp): each activation is rounded to its
# 32-block's int8 grid, an error <= amax / 254 per element, so a projection's output moves by <= 1/254 of
# sum |w| |x| (1/127 for the two roundings of gate/up then down, per layer); the residual stream of 4 MoE layers
# then moves by <= 4/127 of the MoE outputs, and the logits (lm_head of the RMS-normed stream) by at most ~3% of
# their largest magnitude, at positions whose routing is the float path's (a perturbed router input can flip a
# near-tie top-k choice: a different expert, an O(1) change; measured here: one of 27 positions, 0.31 at
# max |logit| 3.3, every other position <= 0.031). Float-activation paths (fp8, and q8_0 / q4_0 elsewhere) differ
# from the dequantized float path only in the order of float32 sums: 1e-4.
INT8_ACTIVATION_LOGIT_TOLERANCE = 4 / 127


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "fp8"])
def test_decode_of_quantized_experts_equals_the_dequantized_float_path(tmp_path, name):
    """Qwen3-MoE with its experts in q8_0 / q4_0 (quantized while loading) or block FP8 (the written checkpoint)
    decodes as the same model with float32 banks holding the dequantized expert weights (the dense weights float in
    both), the transformers greedy continuation fed to both: at the positions routed alike (all of them for fp8)
    logits within INT8_ACTIVATION_LOGIT_TOLERANCE x max |logit| for q8_0 / q4_0 (whose kernels may quantize the
    activations), 1e-4 for fp8, and the same argmax wherever the float path's top-2 margin exceeds twice the
    tolerance; identical logits under fetch-all (slots for half of the experts: the scale pools are filled) and
    host-all (the host kernel alone); one compiled step each."""
    base = os.path.join(FIXTURES, "qwen3_moe")
    info = json.load(open(os.path.join(base, "reference", "info.json")))
    tokens = info["prompt_ids"] + info["greedy_continuation"][:-1]
    ck = load_checkpoint(base, dtype=jnp.float32)
    cfg, I = ck.config, ck.config.moe_intermediate_size
    src = str(tmp_path / "fp8") if name == "fp8" else base
    if name == "fp8":
        _write_fp8_checkpoint(src)
    qcfg = load_config(src)
    fmt = expert_format(qcfg, np.float32, None if name == "fp8" else name)
    with SafetensorsCheckpoint(src) as ckpt:
        qbanks = _expert_banks(qcfg, ckpt, expert_tensor_plan(qcfg, ckpt, fmt), fmt, np.dtype(np.float32))
    fbanks = _dequantized_banks(qbanks, I)
    total = qbanks.num_rows
    by_policy = []
    for kind, slots in ((PolicyKind.FETCH_ALL, total // 2), (PolicyKind.HOST_ALL, 1)):
        (q, q_ids), (f, f_ids) = (_step_logits(ck.model, OffloadedExperts(b, cfg.num_experts, Policy(kind),
                                                                          activation=cfg.activation),
                                               slots, tokens) for b in (qbanks, fbanks))
        alike = np.all(q_ids == f_ids, axis=(1, 2))  # bool[positions]
        assert alike.mean() >= 0.8 and (name != "fp8" or alike.all()), alike
        tol = 1e-4 if name == "fp8" else INT8_ACTIVATION_LOGIT_TOLERANCE * np.abs(f).max()
        err = np.abs(q - f).max(-1)[alike]
        assert err.max() <= tol, (kind, err, tol)
        top2 = np.sort(f, -1)[:, -2:]
        clear = alike & (top2[:, 1] - top2[:, 0] > 2 * tol)
        assert clear.any() and (q.argmax(-1) == f.argmax(-1))[clear].all(), kind
        by_policy.append(q)
    np.testing.assert_array_equal(by_policy[0], by_policy[1])
    qck = dataclasses.replace(ck, banks=qbanks)
    result = Engine(qck, policy=Policy(PolicyKind.FETCH_ALL), num_slots=total // 2).generate(
        [info["prompt_ids"]], max_new_tokens=6)
    assert result.stats["decode_compiles"] == 1 and result.stats["weight_format"] == fmt.name
    assert result.stats["expert_bytes"] == qbanks.expert_bytes
    for b in (qbanks, fbanks, ck.banks):
        b.release()


def test_bandwidth_bench_fills_every_pool_of_a_quantized_format():
    """The profile's Bench at q8_0: one slot pool per bank (the scale pools included), and a fill copies the stored
    rows of every bank into the slots."""
    with bandwidth.Bench(64, 32, "bfloat16", call_bytes=1 << 16, fmt=wf.Q8_0) as b:
        assert b.expert_bytes == wf.Q8_0.nbytes(64, 64) + wf.Q8_0.nbytes(64, 32) == b.banks.expert_bytes
        assert len(b._slots) == 4
        b.fill()
        rows = b.fill_rows[0]
        for slots, bank in zip(b._slots, b.banks.banks):
            np.testing.assert_array_equal(np.asarray(slots)[rows], bank.numpy()[rows])
        b.gemv()


def _dequantized_checkpoint(src: str, dst: str, fmt: wf.WeightFormat | None) -> str:
    """A float32 copy of checkpoint ``src`` whose quantized weights hold their dequantized values: with fmt q8_0 /
    q4_0 (``src`` float) every tensor the loader quantizes (experts, quantize_applies) replaced by
    dequantize(quantize(w)); with fmt None (``src`` the written FP8 checkpoint) every FP8 tensor replaced by
    data * scale_inv and the quantization_config dropped. Returns dst."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    t = load_file(os.path.join(src, "model.safetensors")) if fmt is not None else None
    if t is None:  # FP8: the test wrote it, so read it with ft_jax's reader (safetensors' numpy API has no float8)
        with SafetensorsCheckpoint(src) as ckpt:
            t = {n: ckpt.read_rows(n, 0, i.shape[0], (i.dtype,)) for n, i in ckpt.tensors.items()}
    out = {}
    for n, w in t.items():
        if n.endswith("_scale_inv"):
            continue
        if fmt is None and w.dtype == F8:
            block = tuple(json.load(open(os.path.join(src, "config.json")))["quantization_config"]["weight_block_size"])
            out[n] = wf.dequantize(w, t[f"{n}_scale_inv"].astype(np.float32), wf.fp8(block))
        elif fmt is not None and (quantize_applies(n, w.shape) or ".experts." in n) and w.ndim == 2:
            out[n] = wf.dequantize(*wf.quantize(w, fmt), fmt)
        else:
            out[n] = w.astype(np.float32)
    save_file(out, os.path.join(dst, "model.safetensors"))
    return dst


# Per decoder layer two sublayers each round the activations twice on the int8 kernels (q/k/v then o; gate/up then
# down), each rounding moving its projection by <= 1/254 of sum |w| |x|: 4 layers give <= 16/254 = 8/127 of the
# logits' largest magnitude (same reasoning as INT8_ACTIVATION_LOGIT_TOLERANCE).
INT8_ACTIVATION_FULL_MODEL_TOLERANCE = 8 / 127


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "fp8"])
def test_quantized_model_decodes_as_its_dequantized_float_model(tmp_path, name):
    """The whole model loaded quantized (load_checkpoint(quantize=q8_0 / q4_0) of Qwen3-MoE: dense projections and
    experts; the written FP8 checkpoint as stored) against the float32 model of the same dequantized values, the
    transformers greedy continuation fed to both, fetch-all with slots for half of the experts: at positions routed
    alike logits within INT8_ACTIVATION_FULL_MODEL_TOLERANCE x max |logit| (q8_0 / q4_0), 1e-4 for fp8 (float
    activations, every position routed alike); the quantized load takes the stored size."""
    base = os.path.join(FIXTURES, "qwen3_moe")
    info = json.load(open(os.path.join(base, "reference", "info.json")))
    tokens = info["prompt_ids"] + info["greedy_continuation"][:-1]
    if name == "fp8":
        src = str(tmp_path / "fp8")
        _write_fp8_checkpoint(src)
        qck = load_checkpoint(src, dtype=jnp.float32)
        fck = load_checkpoint(_dequantized_checkpoint(src, str(tmp_path / "deq"), None), dtype=jnp.float32)
    else:
        qck = load_checkpoint(base, dtype=jnp.float32, quantize=name)
        fck = load_checkpoint(_dequantized_checkpoint(base, str(tmp_path / "deq"), wf.by_name(name)),
                              dtype=jnp.float32)
    assert qck.banks.format.name == name and isinstance(qck.model.lm_head[...], wf.QuantizedTensor) == (name != "fp8")
    cfg, total = qck.config, qck.banks.num_rows
    (q, q_ids), (f, f_ids) = (_step_logits(ck.model, OffloadedExperts(ck.banks, cfg.num_experts,
                                                                      Policy(PolicyKind.FETCH_ALL),
                                                                      activation=cfg.activation), total // 2, tokens)
                              for ck in (qck, fck))
    alike = np.all(q_ids == f_ids, axis=(1, 2))
    assert alike.mean() >= 0.5 and (name != "fp8" or alike.all()), alike
    tol = 1e-4 if name == "fp8" else INT8_ACTIVATION_FULL_MODEL_TOLERANCE * np.abs(f).max()
    err = np.abs(q - f).max(-1)[alike]
    assert err.max() <= tol, (err, tol)
    assert dense_bytes(qck) < dense_bytes(fck)
    for ck in (qck, fck):
        ck.banks.release()


def dense_bytes(ck) -> int:
    """Stored bytes of a loaded model's dense parameters."""
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(nnx.split(ck.model)[1]))


@pytest.mark.parametrize("name,index,where", [
    ("model.layers.1.mlp.experts.gate_up_proj", (5, 33, 17), r"\[5, 32:64, 17\]"),  # an up column (odd)
    ("model.layers.1.mlp.experts.gate_up_proj", (2, 3, 40), r"\[2, 0:32, 40\]"),  # a gate column (even)
    ("model.layers.0.mlp.experts.down_proj", (7, 3, 50), r"\[7, 0:32, 50\]")])
def test_quantize_names_the_stored_index_of_a_transposed_expert_tensor(tmp_path, name, index, where):
    """gpt-oss stores its experts as [E, in, out] with gate and up columns interleaved; the quantized banks hold them
    transposed and de-interleaved, and a block that overflows is named by its elements in the stored tensor."""
    d = tmp_path / "m"
    shutil.copytree(os.path.join(FIXTURES, "gpt_oss"), d, ignore=shutil.ignore_patterns("reference"))
    path = d / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = tensors[name].copy()
    tensors[name][index] = 1e30
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name!r} (expert {index[0]}): elements ") + where +
                       r" \(a block of 32 along dimension 1\) has values too large for q8_0"):
        load_checkpoint(d, quantize="q8_0")


@pytest.mark.parametrize("name,fmt", [("model.layers.1.block_sparse_moe.experts.2.w1.weight", "q8_0"),
                                      ("model.layers.0.self_attn.q_proj.weight", "q4_0")])
def test_quantize_refuses_values_whose_block_scale_overflows_float16(tmp_path, name, fmt):
    """A finite weight of 1e7 makes a q8_0 / q4_0 block scale (|x| max / 127, / 8) exceed float16's 65504: the load
    is refused naming the file, tensor, row and block, instead of a model that decodes Inf / NaN."""
    shutil.copytree(bundled_model_path(), tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = tensors[name].copy()
    tensors[name][3, 40] = 1e7  # row 3, block 1
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=re.escape(f"model.safetensors: tensor {name!r}") + r".*row 3, block 1 "
                                              r"\(columns 32..63\) has values too large for " + fmt):
        load_checkpoint(tmp_path / "m", quantize=fmt)
