"""Quantized checkpoints kept as stored (FP8 block-scaled Qwen3-MoE and DeepSeek-V3, MXFP4 gpt-oss) against the
transformers references of tests/fixtures/hf_tiny (scripts/write_quantized_fixtures.py; gpt_oss_mxfp4 by
scripts/make_gpt_oss_references.py). The references come from a float32 transformers model holding the weights
dequantized in numpy from the stored bytes, so ft_jax computing on the stored bytes must give the same greedy tokens
and logits within 1e-4, under every policy and cache size (every routed (token, expert) pair is computed exactly
once, from a slot or from the host bank, whatever the split), with one compiled decode step.

The FP8 blocks ([20, 48] and [40, 48]) divide none of the tiny shapes: every matrix has partial edge blocks in
rows and columns, and the fused gate/up and q/k/v rows are not multiples of the block rows.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from engine_helpers import decode_cache_size
from test_offload import _backend, _greedy_logits  # the float fixtures' harness: one compiled T=1 step
from ft_jax import testing
from ft_jax.checkpoint import load_checkpoint
from ft_jax.engine.engine import Engine
from ft_jax.offload.cost_model import auto_costs
from ft_jax.offload.policy import Policy
from ft_jax.weight_formats import MXFP4, QuantizedTensor, fp8

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
QUANTIZED = ["qwen3_moe_fp8", "deepseek_v3_fp8", "gpt_oss_mxfp4"]
ATOL = 1e-4


class Fixture:
    """One quantized fixture: its folder, config.json, info.json, reference arrays, stored tensors (numpy; FP8 data
    read as raw bytes) and the loaded checkpoint."""

    def __init__(self, name):
        self.name = name
        self.dir = os.path.join(FIXTURES, name)
        self.hf_config = json.load(open(os.path.join(self.dir, "config.json")))
        ref = os.path.join(self.dir, "reference")
        self.info = json.load(open(os.path.join(ref, "info.json")))
        self.ref = {n[:-4]: np.load(os.path.join(ref, n)) for n in os.listdir(ref) if n.endswith(".npy")}
        self.ckpt = load_checkpoint(self.dir, dtype=jnp.float32)
        self.cfg = self.ckpt.config
        self.as_sets = self.cfg.family.startswith("deepseek")  # transformers' DeepSeek top-k order is undefined

    def stored(self) -> dict[str, np.ndarray]:
        """The checkpoint's tensors as numpy, read from the safetensors header and bytes (numpy has no F8_E4M3 or
        BF16 dtype of its own): F8_E4M3 as float8_e4m3fn, BF16 widened to float32 (exactly), F32, U8."""
        raw = open(os.path.join(self.dir, "model.safetensors"), "rb").read()
        size = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + size])
        header.pop("__metadata__", None)
        kinds = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "U8": np.uint8}
        out = {}
        for name, meta in header.items():
            start, end = meta["data_offsets"]
            a = np.frombuffer(raw[8 + size + start:8 + size + end], kinds[meta["dtype"]]).reshape(meta["shape"])
            out[name] = a.astype(np.float32) if meta["dtype"] == "BF16" else a
        return out

    def prompts(self) -> list[tuple[list[int], list[int], np.ndarray]]:
        """(prompt ids, greedy continuation, full-sequence logits [P + 16, V]) of the main and any extra prompts."""
        out = [(self.info["prompt_ids"], self.info["greedy_continuation"], self.ref["full_sequence_logits"])]
        for i, extra in enumerate(self.info.get("extra_prompts", [])):
            out.append((extra["prompt_ids"], extra["greedy_continuation"],
                        self.ref[f"extra_{i}_full_sequence_logits"]))
        return out


@pytest.fixture(scope="module", params=QUANTIZED)
def fx(request):
    return Fixture(request.param)


def _format_of(fx: Fixture):
    q = fx.hf_config["quantization_config"]
    return MXFP4 if q["quant_method"] == "mxfp4" else fp8(tuple(q["weight_block_size"]))


def test_experts_are_kept_as_stored(fx):
    """The host banks hold the stored bytes (no dequantized copy): for every expert of every MoE layer, the gate_up
    row is the stored gate then up matrix (gpt-oss: the HF rows interleave gate/up) with its scales (gate's scale
    grid then up's), the down row the stored down matrix; expert_bytes is the stored size of one expert."""
    banks, cfg, fmt = fx.ckpt.banks, fx.cfg, _format_of(fx)
    assert banks.format == fmt
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    st = fx.stored()
    gu, dn = banks.gate_up.numpy(), banks.down.numpy()
    gus, dns = banks.gate_up_scale.numpy(), banks.down_scale.numpy()
    assert gu.dtype == fmt.data_dtype and dn.dtype == fmt.data_dtype
    assert gu.shape[1:] == fmt.data_shape(2 * I, H) and dn.shape[1:] == fmt.data_shape(H, I)
    assert gus.shape[1:] == (2 * fmt.scale_rows(I), -(-H // fmt.block[1])) and dns.shape[1:] == fmt.scale_shape(H, I)
    for m, layer in enumerate(cfg.moe_layers):
        p = f"model.layers.{layer}.mlp.experts"
        if fmt is MXFP4:
            blocks, scales = st[f"{p}.gate_up_proj_blocks"], st[f"{p}.gate_up_proj_scales"]  # [E, 2I, H/32, 16]
            want = np.concatenate([blocks[:, 0::2], blocks[:, 1::2]], 1).reshape(E, 2 * I, H // 2)
            want_s = np.concatenate([scales[:, 0::2], scales[:, 1::2]], 1)
            want_dn = st[f"{p}.down_proj_blocks"].reshape(E, H, I // 2)
            want_dns = st[f"{p}.down_proj_scales"]
        else:
            def get(e, proj, suffix=""):
                return st[f"{p}.{e}.{proj}_proj.weight{suffix}"]

            want = np.stack([np.concatenate([get(e, "gate"), get(e, "up")]) for e in range(E)])
            want_s = np.stack([np.concatenate([get(e, "gate", "_scale_inv"), get(e, "up", "_scale_inv")])
                               for e in range(E)])
            want_dn = np.stack([get(e, "down") for e in range(E)])
            want_dns = np.stack([get(e, "down", "_scale_inv") for e in range(E)])
        rows = slice(m * E, (m + 1) * E)
        where = f"{fx.name} layer {layer}"
        np.testing.assert_array_equal(gu[rows].view(np.uint8), want.view(np.uint8), err_msg=where)
        np.testing.assert_array_equal(dn[rows].view(np.uint8), want_dn.view(np.uint8), err_msg=where)
        np.testing.assert_array_equal(gus[rows], want_s.astype(fmt.scale_dtype), err_msg=where)
        np.testing.assert_array_equal(dns[rows], want_dns.astype(fmt.scale_dtype), err_msg=where)
    one = fmt.nbytes(I, H) * 2 + fmt.nbytes(H, I) + (4 * (2 * I + H) if cfg.family == "gpt_oss" else 0)
    assert banks.expert_bytes == one


def test_fp8_dense_projections_are_kept_as_stored(fx):
    """FP8 checkpoints: the dense projections (attention, dense MLPs, shared experts) are QuantizedTensors of fp8
    data with the checkpoint's block columns (block rows as stored, or 1 where fused rows needed the scales expanded
    to one row per matrix row); the routers, embeddings and lm_head stay float (modules_to_not_convert)."""
    fmt = _format_of(fx)
    leaves = jax.tree_util.tree_leaves(nnx.state(fx.ckpt.model), is_leaf=lambda x: isinstance(x, QuantizedTensor))
    quantized = [x for x in leaves if isinstance(x, QuantizedTensor)]
    if fmt is MXFP4:  # gpt-oss: only the experts are MXFP4 (modules_to_not_convert: attention, router, ...)
        assert not quantized
        return
    assert quantized
    model = fx.ckpt.model
    # MLA's W_uk^T per head is a transpose of kv_b_proj rows (block (bc, gcd(br, dn + dv)), models/mla.py split_kv_b)
    transposed = [a.w_uk_t[...] for s in model.stacks if hasattr(a := s.attn, "w_uk_t")]
    for q in quantized:
        assert np.dtype(q.data.dtype) == np.dtype(ml_dtypes.float8_e4m3fn)
        if any(q.data is t.data for t in transposed):
            cfg = fx.cfg
            assert q.fmt == fp8((fmt.block[1], math.gcd(fmt.block[0], cfg.qk_nope_head_dim + cfg.v_head_dim)))
            continue
        assert q.fmt.name == "fp8" and q.fmt.block[1] == fmt.block[1] and q.fmt.block[0] in (fmt.block[0], 1), q.fmt
    # Every dense FP8 matrix, once (MLA's kv_b_proj as W_uk^T and W_uv per head): none dequantized.
    stored_fp8 = sum(int(np.prod(v.shape)) for k, v in fx.stored().items()
                     if v.dtype == ml_dtypes.float8_e4m3fn and ".experts." not in k)
    assert sum(math.prod(q.shape) for q in quantized) == stored_fp8


def _runs(ckpt, shift):
    """(policy, slots) pairs: resident, host-all (its cache never changes: one size), and fetch-all, qstar, auto,
    fixed-cap, each at one of 1 slot (k > S: routes on the host), half and all of the experts, the sizes rotated by
    ``shift`` (the fixture's index: over the fixtures every (policy, size) pair runs; each run is a compile)."""
    cfg = ckpt.config
    L, E, k = len(cfg.moe_layers), cfg.num_experts, cfg.top_k
    auto = Policy("auto", costs=auto_costs(ckpt.banks.expert_bytes, 10.0, 10.0, device_bandwidth=100.0))
    sizes = (1, L * E // 2, L * E)
    runs = [(Policy("resident"), L * E), (Policy("host-all"), k)]
    for i, policy in enumerate((Policy("fetch-all"), Policy("qstar", frac=0.415), auto, Policy("fixed-cap", cap=1))):
        runs.append((policy, sizes[(i + shift) % len(sizes)]))
    return runs


def test_greedy_and_logits_under_every_policy_and_cache_size(fx):
    """Every position fed one at a time (prompt, then greedy decode): tokens and routing identical to transformers',
    logits within 1e-4 of its full-sequence logits, identical tokens and logits within 1e-5 across the runs."""
    ckpt, cfg = fx.ckpt, fx.cfg
    prompt, want_tokens, full = fx.prompts()[0]
    ref_routing = np.concatenate([fx.ref["prompt_topk_ids"].transpose(1, 0, 2), fx.ref["decode_topk_ids"]])
    first = None
    runs = _runs(ckpt, QUANTIZED.index(fx.name))
    for policy, slots in runs:
        tokens, logits, routing, state = _greedy_logits(ckpt, _backend(ckpt, policy), slots, prompt, len(want_tokens))
        where = f"{fx.name} {policy} S={slots}"
        assert tokens == want_tokens, where
        np.testing.assert_array_equal(np.sort(routing, -1) if fx.as_sets else routing,
                                      np.sort(ref_routing, -1) if fx.as_sets else ref_routing, err_msg=where)
        np.testing.assert_allclose(logits, full[:len(prompt) + len(want_tokens) - 1], atol=ATOL, rtol=0,
                                   err_msg=where)
        if first is None:
            first = logits
        np.testing.assert_allclose(logits, first, atol=1e-5, rtol=0, err_msg=f"{where} vs {runs[0]}")
        stats = np.asarray(state.cache.stats)  # [L, 6]: active, hits, misses, fetched, host, steps
        if policy.kind == "host-all":
            assert stats[:, 3].sum() == 0 and stats[:, 1].sum() == 0, where
        if policy.kind == "resident":
            assert stats[:, 2].sum() == 0, where
        if slots == 1 and policy.kind != "host-all":
            assert stats[:, 4].sum() > 0, where  # k > S: some routes ran on the host kernel
        if policy.kind == "fetch-all" and slots > 1:
            assert stats[:, 3].sum() > 0, where  # some routes ran from slots filled with the stored bytes


def test_prompt_forward_logits_and_routing(fx):
    """The whole prompt in one call (the prefill shapes: T > 1 through the dense FP8 GEMMs): logits within 1e-4 of
    transformers' prompt logits, the same top-k experts and combine weights within 1e-5."""
    ckpt = fx.ckpt
    backend = _backend(ckpt, Policy("host-all"))
    graphdef, params = nnx.split(ckpt.model)
    prompt = np.asarray(fx.info["prompt_ids"], np.int32)
    kv = ckpt.model.init_kv_cache(1, len(prompt))
    logits, _, _, aux = jax.jit(lambda p, t, pos, kv, s: nnx.merge(graphdef, p)(t, pos, kv, s, backend, collect=True))(
        params, jnp.asarray(prompt[None]), jnp.arange(len(prompt), dtype=jnp.int32)[None], kv, backend.init_state(1))
    np.testing.assert_allclose(np.asarray(logits[0]), fx.ref["prompt_logits"], atol=ATOL, rtol=0, err_msg=fx.name)
    ids, weights = np.asarray(aux.topk_ids[:, 0]), np.asarray(aux.topk_weights[:, 0])  # [L, T, k]
    ref_ids, ref_w = fx.ref["prompt_topk_ids"], fx.ref["prompt_topk_weights"]
    if fx.as_sets:
        order, ref_order = np.argsort(ids, -1), np.argsort(ref_ids, -1)
        ids, weights = np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)
        ref_ids, ref_w = np.take_along_axis(ref_ids, ref_order, -1), np.take_along_axis(ref_w, ref_order, -1)
    np.testing.assert_array_equal(ids, ref_ids, err_msg=fx.name)
    np.testing.assert_allclose(weights, ref_w, atol=1e-5, rtol=0, err_msg=fx.name)


@pytest.mark.parametrize("policy", ["qstar", "fixed-cap", "fetch-all"])
def test_engine_batch_greedy_one_decode_compile(fx, policy):
    """The Engine (batched left-padded prefill, then decode) on every reference prompt at once: each row's greedy
    tokens are transformers', with one compiled decode step."""
    ckpt, cfg = fx.ckpt, fx.cfg
    L, E = len(cfg.moe_layers), cfg.num_experts
    pol = {"qstar": Policy("qstar", frac=0.415), "fixed-cap": Policy("fixed-cap", cap=1),
           "fetch-all": Policy("fetch-all")}[policy]
    engine = Engine(ckpt, policy=pol, num_slots=L * E // 2)
    cases = fx.prompts()
    result = engine.generate([c[0] for c in cases], max_new_tokens=16)
    for (prompt, want, _), got in zip(cases, result.tokens):
        assert got == want, f"{fx.name} {policy}: prompt of {len(prompt)} tokens"
    assert result.stats["decode_compiles"] == 1 and decode_cache_size(engine) == 1


def test_bfloat16_model_decodes_alike_on_slots_and_host(fx):
    """Loaded with bfloat16 dense weights (how ft_jax loads the real FP8 / MXFP4 releases, whose float tensors are
    bf16): the experts stay as stored, and a route computed from a slot gives the same tokens as one computed on
    the host (host-all vs fetch-all with 1 slot, where k > S mixes both). bf16 rounding may leave transformers'
    float32 continuation, so only the agreement is asserted."""
    tokens = testing.assert_policies_agree(fx.dir, fx.info["prompt_ids"], policies=("host-all", "fetch-all"),
                                           cache_slots=(1,), max_new_tokens=8, dtype="bfloat16")
    assert len(tokens) == 8
