"""Quantized dense weights (issue 19): weight_formats.dequantize_jnp against the numpy dequantize, models/layers.linear
on QuantizedTensor weights against a float64 product, Stacked's fused rows (fp8 blocks that a part boundary would
split get one scale row per matrix row), and whole tiny models built from quantized projections against the same
models built from the dequantized weights as plain arrays (f32 and bf16), the decode step compiled once."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from ft_jax.config import load_config
from ft_jax.kernels.host_bank import HostBank
from ft_jax.models.decoder import MoETransformer
from ft_jax.models import layers
from ft_jax.models.layers import FFI_MAX_ROWS, Stacked, as_float, linear, random_param_factory
from ft_jax.weight_formats import (FP4_E2M1, FP8_MAX, MXFP4, Q4_0, Q8_0, QuantizedTensor, dequantize, dequantize_jnp,
                                   fp8, quantize)
from ft_jax.checkpoint import load_checkpoint
from ft_jax.engine.engine import Engine
from ft_jax.offload.policy import Policy, PolicyKind
from test_model import FIXTURES, HostBankExperts, _experts_of, bf16_logit_error_bound, jit_forward
from test_quant_kernels import check_within, linear_reference, quantized_acts
from test_quantized_load import _load_parts, _write_fp8_checkpoint

BF16 = np.dtype(ml_dtypes.bfloat16)


# ------------------------------------------------------------------------------------- independent test quantizers
def quantize_fp8(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """Block-scaled e4m3 of a float [rows, cols] matrix (DeepSeek-V3's scheme: scale = amax / 448 per block, edge
    blocks partial). Returns (f8 data [rows, cols], f32 scales [ceil(rows / br), ceil(cols / bc)])."""
    br, bc = block
    rows, cols = w.shape
    sr, sc = -(-rows // br), -(-cols // bc)
    scales = np.zeros((sr, sc), np.float32)
    for i in range(sr):
        for j in range(sc):
            scales[i, j] = max(np.abs(w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]).max(), 1e-12) / FP8_MAX
    full = np.repeat(np.repeat(scales, br, 0)[:rows], bc, 1)[:, :cols]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scales


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest FP4 E2M1 code per element with a power-of-two block scale >= amax / 6 (OCP MX). w: float [..., cols]
    with cols % 32 == 0. Returns (u8 [..., cols / 2] packed as byte j = code 2j | code (2j + 1) << 4, u8 E8M0
    [..., cols / 32])."""
    blocks = np.asarray(w, np.float64).reshape(*w.shape[:-1], -1, 32)
    e = np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-30) / 6.0))  # [..., G]
    scaled = blocks / np.exp2(e)[..., None]
    codes = np.abs(scaled[..., None] - FP4_E2M1.astype(np.float64)).argmin(-1).astype(np.uint8)  # [..., G, 32]
    codes = codes.reshape(*w.shape[:-1], -1)
    return codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4)), (e + 127).astype(np.uint8)


def quantized(w: np.ndarray, fmt) -> QuantizedTensor:
    """A float32 matrix [rows, cols] (numpy) in fmt (q8_0, q4_0, mxfp4 or fp8 with any block)."""
    if fmt in (Q8_0, Q4_0):
        return QuantizedTensor(*quantize(w, fmt), fmt)
    if fmt is MXFP4:
        return QuantizedTensor(*quantize_mxfp4(w), fmt)
    return QuantizedTensor(*quantize_fp8(w, fmt.block), fmt)


FORMATS = {"q8_0": Q8_0, "q4_0": Q4_0, "mxfp4": MXFP4, "fp8_24x48": fp8((24, 48)), "fp8_32x32": fp8((32, 32))}


# ------------------------------------------------------------------------------------------------- dequantize_jnp
@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_jnp_equals_numpy_dequantize(name):
    """f32: bit-equal to weight_formats.dequantize (leading axes [2, 3], fp8 with partial edge blocks); bf16: the
    f32 values rounded once."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 3, 50, 96)).astype(np.float32)
    parts = [quantized(w[a, b], fmt) for a in range(2) for b in range(3)]
    data = np.stack([p.data for p in parts]).reshape(2, 3, *parts[0].data.shape)
    scales = np.stack([p.scales for p in parts]).reshape(2, 3, *parts[0].scales.shape)
    want = dequantize(data, scales, fmt)  # f32[2, 3, 50, 96]
    got = jax.jit(dequantize_jnp, static_argnums=1)(QuantizedTensor(jnp.asarray(data), jnp.asarray(scales), fmt),
                                                    jnp.float32)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)
    got16 = dequantize_jnp(QuantizedTensor(data, scales, fmt), jnp.bfloat16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got16).view(np.uint16), want.astype(BF16).view(np.uint16))
    # the values are the weights to the format's precision (an independent check of the quantizers above)
    np.testing.assert_allclose(want, w, atol=0.3 * np.abs(w).max(), rtol=0)


def test_dequantize_jnp_rejects_scales_of_another_shape():
    """fp8 [80, 64] in 32 x 32 blocks needs a [3, 2] scale grid; [4, 2] (a gate_up pair's two grids of 40-row
    matrices) raises naming the expected shape."""
    data = np.zeros((80, 64), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fp8: data \[80, 64\] needs scales \[\.\.\., 3, 2\], got \[4, 2\]"):
        dequantize_jnp(QuantizedTensor(data, np.ones((4, 2), np.float32), fp8((32, 32))))


# -------------------------------------------------------------------------------------------------------- linear
def check_linear(y, x, w64, fmt, gemv: bool, what: str):
    """y [N, O] against x @ w64.T in float64: 1e-5 (relative and absolute) where the arithmetic keeps float32
    activations, test_quant_kernels' derived bound (linear_reference) where the CPU GEMV quantizes them to integer
    blocks (q8_0 / q4_0 on the AVX2 and AVX-512 VNNI paths; mxfp4 with bf16 x on AVX2)."""
    if gemv and quantized_acts(fmt, bf16_x=np.asarray(x).dtype == BF16):
        check_within(y, *linear_reference(x, w64, fmt), what)
    else:
        np.testing.assert_allclose(np.asarray(y), np.asarray(x, np.float64) @ w64.T, rtol=1e-5, atol=1e-5,
                                   err_msg=what)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "mxfp4", "fp8_24x48"])
@pytest.mark.parametrize("rows", [3, FFI_MAX_ROWS + 5])
def test_linear_on_a_quantized_stack_matches_float64(name, rows):
    """linear(x, stack, layer) = x @ dequantize(stack)[layer]^T (float64 reference) for f32 and bf16 x; a single
    matrix (layer None). 3 rows take the CPU GEMV (the stored values; int8 activations for q8_0 / q4_0 on the AVX2 and
    VNNI paths: check_linear), FFI_MAX_ROWS + 5 rows XLA's dot on the weights dequantized to x's dtype (bf16: rounded
    once)."""
    fmt = FORMATS[name]
    gemv = rows <= FFI_MAX_ROWS
    rng = np.random.default_rng(2)
    ws = [quantized(rng.standard_normal((40, 96)).astype(np.float32), fmt) for _ in range(3)]
    stack = QuantizedTensor(jnp.asarray(np.stack([w.data for w in ws])), jnp.asarray(np.stack([w.scales for w in ws])),
                            fmt)
    assert stack.shape == (3, 40, 96)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    f = jax.jit(linear)
    for layer in (0, 2):
        w = dequantize(ws[layer].data, ws[layer].scales, fmt, dtype=np.float64)  # [40, 96]
        y = f(jnp.asarray(x), stack, jnp.int32(layer))
        assert y.shape == (rows, 40) and y.dtype == jnp.float32
        check_linear(y, x, w, fmt, gemv, f"f32 x, layer {layer}")
        xb = x.astype(BF16)
        yb = f(jnp.asarray(xb), stack, jnp.int32(layer))
        wb = w if gemv else w.astype(np.float32).astype(BF16).astype(np.float64)
        check_linear(yb, xb, wb, fmt, gemv, f"bf16 x, layer {layer}")
    single = QuantizedTensor(jnp.asarray(ws[1].data), jnp.asarray(ws[1].scales), fmt)
    check_linear(linear(jnp.asarray(x), single), x, dequantize(ws[1].data, ws[1].scales, fmt, dtype=np.float64), fmt,
                 gemv, "one matrix")
    with pytest.raises(ValueError, match="needs a layer index"):
        linear(jnp.asarray(x), stack)
    with pytest.raises(ValueError, match="does not end in K = 96"):
        linear(jnp.asarray(x[:, :64]), stack, 0)


def test_xla_dot_of_a_bf16_stack_slices_it_as_stored():
    """Above FFI_MAX_ROWS rows linear takes XLA's dot on w[layer]. XLA:CPU turned the dynamic slice of a bf16 stack
    inside a scan over the layers into one float32 copy of the whole stack per call, hoisted out of the loop (335 MB
    per prefill chunk on the bench model: docs/DESIGN.md sec. 20.11); linear slices the stack's bits instead, and
    keeps the bitcast to bits inside the loop, fused into the slice (hoisted, it was a uint16 copy of the whole stack
    per call: sec. 20.13). The compiled scan holds no float32 array of the stack's shape, its temporary buffers are
    smaller than the stack (with the hoisted copy: 1.32 MB against the stack's 0.79 MB), and its results equal the
    float64 reference within float32 accumulation (bf16 products are exact in float32)."""
    rng = np.random.default_rng(5)
    n, O, K, N = 3, 512, 256, FFI_MAX_ROWS + 5
    stack = rng.standard_normal((n, O, K)).astype(BF16)
    x = rng.standard_normal((N, K)).astype(BF16)

    def over_layers(x, stack):  # [n, N, O]
        return jax.lax.scan(lambda c, i: (c, linear(x, stack, i)), 0, jnp.arange(n))[1]

    compiled = jax.jit(over_layers).lower(jnp.asarray(x), jnp.asarray(stack)).compile()
    assert f"f32[{n},{O},{K}]" not in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < stack.nbytes
    y = np.asarray(jax.jit(over_layers)(jnp.asarray(x), jnp.asarray(stack)))
    for layer in range(n):
        expected = x.astype(np.float64) @ stack[layer].astype(np.float64).T
        np.testing.assert_allclose(y[layer], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(),
                                   err_msg=f"layer {layer}")


# ---------------------------------------------------------------------------------------------- Stacked, fused rows
def _factory(tensors: dict):
    return lambda name, shape, kind: tensors[name]


@pytest.mark.parametrize("rows,expanded", [((48, 16, 16), True), ((64, 32, 20), False)])
def test_stacked_rows_of_fp8_expand_scales_only_where_a_block_would_span_two_parts(rows, expanded):
    """q/k/v of fp8 (32 x 32 blocks): parts of 48 and 16 rows would share a scale block, so every part gets one
    scale row per matrix row (fp8((1, 32))); 64 and 32 (and a partial last part of 20) keep the 32-row grids. The
    values are the parts' values concatenated either way."""
    fmt = fp8((32, 32))
    rng = np.random.default_rng(3)
    names = ["q", "k", "v"]
    tensors, want = {}, []
    for l in (0, 1):
        for n, r in zip(names, rows):
            t = quantized(rng.standard_normal((r, 64)).astype(np.float32), fmt)
            tensors[f"model.layers.{l}.{n}"] = t
            want.append(dequantize(t.data, t.scales, fmt))
    p = Stacked(_factory(tensors), (0, 1))
    param = p.rows([(n, (r, 64)) for n, r in zip(names, rows)])
    t = param[...]
    assert isinstance(t, QuantizedTensor) and t.shape == (2, sum(rows), 64)
    assert t.fmt == (fp8((1, 32)) if expanded else fmt)
    np.testing.assert_array_equal(np.asarray(dequantize_jnp(t)), np.stack([np.concatenate(want[:3]),
                                                                            np.concatenate(want[3:])]))


def test_stacked_mixed_formats():
    """A quantized part next to a float part is dequantized to the float dtype; q8_0 next to q4_0 is an error naming
    the parameter; a factory tensor of the wrong shape is an error naming it."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    q8 = quantized(w, Q8_0)
    p = Stacked(_factory({"model.layers.0.a": q8, "model.layers.0.b": w, "model.layers.0.c": quantized(w, Q4_0)}),
                (0,))
    got = p.rows([("a", (32, 64)), ("b", (32, 64))])[...]
    assert not isinstance(got, QuantizedTensor) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got[0]), np.concatenate([dequantize(q8.data, q8.scales, Q8_0), w]))
    with pytest.raises(ValueError, match=r"a \+ c: .*q4_0.*q8_0"):
        p.rows([("a", (32, 64)), ("c", (32, 64))])
    with pytest.raises(ValueError, match=r"model.layers.0.a: .* shape \[32, 64\], expected \[32, 96\]"):
        p("a", (32, 96))


# ------------------------------------------------------------------------------------------------- whole models
def quantizing_factory(fmt, dtype, seed=0):
    """(quantized factory, plain factory): random_param_factory(seed) weights, every 2-D "weight" whose columns fit
    the format returned as a QuantizedTensor (embeddings, routers and lm_head included); the plain factory returns
    the same tensors dequantized (float32, then the model dtype) as arrays."""
    base = random_param_factory(seed, np.float32, std=0.1)
    cache = {}

    def raw(name, shape, kind):
        if name not in cache:
            t = base(name, shape, kind)
            fits = len(shape) == 2 and kind == "weight" and (fmt.block[0] > 1 or shape[1] % 32 == 0)
            cache[name] = quantized(t, fmt) if fits else t.astype(np.float32 if kind.endswith("_f32") else dtype)
        return cache[name]

    return raw, lambda name, shape, kind: as_float(raw(name, shape, kind), dtype)


def _banks(cfg, rng, dtype):
    E, H, I = cfg.num_moe_layers * cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gu = HostBank.from_numpy((0.1 * rng.standard_normal((E, 2 * I, H))).astype(dtype))
    dn = HostBank.from_numpy((0.1 * rng.standard_normal((E, H, I))).astype(dtype))
    biases = (None, None)
    if cfg.expert_bias:
        biases = (HostBank.from_numpy((0.1 * rng.standard_normal((E, 2 * I))).astype(dtype)),
                  HostBank.from_numpy((0.1 * rng.standard_normal((E, H))).astype(dtype)))
    return HostBankExperts(gu, dn, cfg, biases)


# deepseek_v3 (MLA, a dense first layer, shared experts): kv_b_proj (16 columns) stays float with q4_0 and is
# split per head as stored with fp8 (W_uk^T transposed: models/mla.py split_kv_b)
MODEL_CASES = [("mixtral", "q8_0"), ("qwen2_moe", "q4_0"), ("gpt_oss", "mxfp4"), ("deepseek_v3", "q4_0"),
               ("deepseek_v3", "fp8_24x48"), ("deepseek_v3", "fp8_32x32"), ("mixtral", "fp8_24x48")]


def _run(model, experts, tokens, prompt_len):
    """A prefill of tokens[:, :prompt_len], then one decode step per further token (teacher forcing: both models of a
    comparison see the same tokens). Returns (logits f32[len, V], the routed expert ids of every position as sorted
    sets i32[len, L_moe, k], the jitted forward)."""
    fwd, state = jit_forward(model, collect=True)
    P, n = prompt_len, tokens.shape[1]
    kv = model.init_kv_cache(1, n + 1)
    logits, kv, _, aux = fwd(state, jnp.asarray(tokens[:, :P]), jnp.arange(P, dtype=jnp.int32)[None], kv, experts)
    out, ids = [np.asarray(logits[0])], [np.asarray(aux.topk_ids[:, 0])]  # [L_moe, T, k]
    for p in range(P, n):
        logits, kv, _, aux = fwd(state, jnp.asarray(tokens[:, p:p + 1]), jnp.array([[p]], jnp.int32), kv, experts)
        out.append(np.asarray(logits[0]))
        ids.append(np.asarray(aux.topk_ids[:, 0]))
    return np.concatenate(out), np.sort(np.concatenate(ids, axis=1), -1).transpose(1, 0, 2), fwd


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family,name", MODEL_CASES)
def test_quantized_model_equals_the_dequantized_float_model(family, name, dtype, monkeypatch):
    """A tiny model whose projections are QuantizedTensors gives the logits of the same model built from the
    dequantized weights as plain arrays: f32 with the same routing and logits to 1e-5 (the same products in
    another order: the CPU GEMV on the stored values against XLA's dot or the float GEMV); bf16 within
    test_model's bf16 rounding bound at the positions routed alike (at most 2 of 9 may flip: the CPU GEMV reads
    the exact stored values, the plain bf16 model their bf16 roundings). The quantized tensors stay stored
    (QuantizedTensor parameters, fp8 blocks split by fused parts expanded to rows); the decode step compiles once.

    Where the CPU GEMV quantizes the activations (q8_0 / q4_0 on AVX2 or AVX-512 VNNI, mxfp4 on AVX2:
    quantized_acts) both models take XLA's dot instead (FFI_MAX_ROWS = 0): this test checks how the models hold and
    read quantized weights, exactly; the GEMV's int8 / int16 error is test_linear_on_a_quantized_stack_matches_float64's (a derived bound) and, through a whole
    trained model, test_quantized_checkpoint_loads_and_decodes's."""
    fmt = FORMATS[name]
    if quantized_acts(fmt, bf16_x=dtype == BF16):
        monkeypatch.setattr(layers, "FFI_MAX_ROWS", 0)
    cfg = load_config(f"{FIXTURES}/{family}")
    q_make, plain_make = quantizing_factory(fmt, dtype)
    qmodel, plain = MoETransformer(cfg, q_make), MoETransformer(cfg, plain_make)
    assert qmodel.dtype == plain.dtype == jnp.dtype(dtype)
    stack = qmodel.stacks[-1]
    qkv = stack.attn.a_proj[...] if cfg.kv_lora_rank else stack.attn.qkv[...]
    assert isinstance(qkv, QuantizedTensor) and isinstance(stack.attn.o[...], QuantizedTensor)
    assert isinstance(qmodel.lm_head[...], QuantizedTensor)
    if fmt.block[0] > 1:  # q/k/v rows 64, 32, 32 and a_proj 32 + 24 fit 32-row blocks, not 24-row ones
        assert qkv.fmt == (fmt if fmt.block[0] == 32 else fp8((1, fmt.block[1])))
    if cfg.kv_lora_rank and fmt.name == "fp8":  # MLA's kv_b_proj per head, as stored
        assert isinstance(stack.attn.w_uk_t[...], QuantizedTensor) and isinstance(stack.attn.w_uv[...], QuantizedTensor)
    leaves = jax.tree.leaves(nnx.state(qmodel))
    assert any(leaf.dtype == fmt.data_dtype for leaf in leaves)
    rng = np.random.default_rng(5)
    experts = _banks(cfg, rng, dtype)
    tokens = rng.integers(0, cfg.vocab_size, (1, 9)).astype(np.int32)
    got, got_ids, fwd = _run(qmodel, experts, tokens, 6)  # a 6-token prefill, 3 decode steps
    want, want_ids, _ = _run(plain, experts, tokens, 6)
    assert np.all(np.isfinite(got))
    same = np.all(got_ids == want_ids, axis=(1, 2))  # positions routed alike in every MoE layer
    if dtype == np.float32:
        assert same.all()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    else:  # router ties closer than bf16 noise may flip (test_model.test_bfloat16_load_is_close)
        assert same.sum() >= len(same) - 2
        bound = bf16_logit_error_bound(cfg.num_layers, np.abs(want).max(-1, keepdims=True))
        assert np.all(np.abs(got - want)[same] <= bound[same])
    assert fwd._cache_size() == 2  # the prefill and one decode step for the three decode calls


def test_quantized_model_lowered_for_cuda_dequantizes_with_xla():
    """Lowered for CUDA (no GPU needed), a quantized model's forward takes the XLA dequantize-and-dot form: no
    ft_jax_linear call, and the stored q8_0 data (i8 [n, rows, cols]) are operands of the step, not a float copy."""
    cfg = load_config(f"{FIXTURES}/mixtral")
    model = MoETransformer(cfg, quantizing_factory(Q8_0, np.float32)[0])
    graphdef, state = nnx.split(model)

    def no_experts(moe_layer, x, ids, weights, expert_state):  # the routed experts are not under test here
        return jnp.zeros(x.shape, jnp.float32), expert_state

    def fwd(state, tokens, positions, kv):
        return nnx.merge(graphdef, state)(tokens, positions, kv, None, no_experts)[0]

    kv = jax.eval_shape(lambda: model.init_kv_cache(1, 16))
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    text = jax.jit(fwd).trace(state, ids, ids, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "ft_jax_linear" not in text
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "tensor<4x128x64xi8>" in main  # q/k/v of the 4 layers: (4 + 2 * 2) * 16 rows, 64 columns


# int8 activation error model (test_model's bf16 model, for the CPU GEMV's int8 blocks): a block of 32 activations
# is quantized with step d = max |x| / 127 and round to nearest, an error of at most d / 2 = max |x| / 254 per element,
# as a rounding with u = 1 / 254 of the block's largest value. Each quantized input vector counts as one such rounding
# of the logit scale: per decoder layer at most 6 (q/k/v, o, router, the experts' gate_up and down, the shared
# expert), plus lm_head; the logit error then has std u sqrt(n / 3), and the bound is 5 std. Measured on the
# qwen3_moe fixture (this tree, dev VM): at most 6 u of max |logit| at positions routed alike; bound 14.2 u.
INT8_U, INT8_INPUTS_PER_LAYER = 1 / 254, 6


def int8_logit_error_bound(num_layers: int, logit_scale: np.ndarray) -> np.ndarray:
    """5 std of the int8 activation model above: 5 u sqrt(n / 3) * logit_scale, n = 6 num_layers + 1."""
    return 5 * INT8_U * np.sqrt((INT8_INPUTS_PER_LAYER * num_layers + 1) / 3) * logit_scale


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "fp8"])
def test_quantized_checkpoint_loads_and_decodes(tmp_path, name):
    """load_checkpoint end to end: Qwen3-MoE with --quantize q8_0 / q4_0, and as a block-FP8 checkpoint (24 x 40
    blocks, partial edges; tests/test_quantized_load.py writes it): the model keeps the projections as stored
    QuantizedTensors and gives the logits (f32, teacher-forced) of the model built from the same factory's tensors
    dequantized, with the same quantized expert banks: same routing and 1e-5 where the kernels keep float
    activations (fp8; q8_0 / q4_0 on the portable path), else within int8_logit_error_bound at the positions routed alike;
    the engine decodes with one compiled step."""
    d = os.path.join(FIXTURES, "qwen3_moe")
    if name == "fp8":
        d = str(tmp_path / "fp8")
        _write_fp8_checkpoint(d)
    quantize = None if name == "fp8" else name
    ck = load_checkpoint(d, dtype=jnp.float32, quantize=quantize)
    stack = ck.model.stacks[0]
    for param in (stack.attn.qkv, stack.attn.o):
        assert isinstance(param[...], QuantizedTensor) and param[...].fmt.name == name
    cfg, banks, make, ckpt = _load_parts(d, np.float32, quantize)
    plain = MoETransformer(cfg, lambda n, shape, kind: as_float(make(n, shape, kind), np.float32))
    ckpt.close()
    banks.release()
    experts = _experts_of(ck)
    tokens = np.array([[3, 17, 42, 5, 99, 7, 1, 60, 11]], np.int32)
    got, got_ids, _ = _run(ck.model, experts, tokens, 6)
    want, want_ids, _ = _run(plain, experts, tokens, 6)
    assert np.abs(want).max() > 0.1
    if quantized_acts(ck.banks.format):  # the GEMVs quantize activations: statistical bound, positions routed alike
        same = np.all(got_ids == want_ids, axis=(1, 2))
        assert same.sum() >= len(same) - 2
        bound = int8_logit_error_bound(cfg.num_layers, np.abs(want).max(-1, keepdims=True))
        assert np.all(np.abs(got - want)[same] <= bound[same])
    else:
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    result = Engine(ck, policy=Policy(PolicyKind.FETCH_ALL), num_slots=ck.banks.num_rows // 2).generate(
        [[3, 17, 42, 5, 99]], max_new_tokens=4)
    assert result.stats["decode_compiles"] == 1
    ck.banks.release()
