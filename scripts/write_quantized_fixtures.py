#!/usr/bin/env python3
"""Write the tiny quantized checkpoints of tests/fixtures/hf_tiny in the layouts the real ones ship, with their
transformers references (not run in CI; needs torch==2.13.0 + transformers==5.24.0 + safetensors).

FP8 block-scaled checkpoints (DeepSeek-V3 and the Qwen3 *-FP8 releases), made from the float32 weights of an
existing fixture (same config, same tokenizer-free vocabulary of 256 ids):

  qwen3_moe_fp8    from qwen3_moe,   weight_block_size [20, 48], weight_scale_inv bfloat16 (as Qwen3-FP8 ships)
  deepseek_v3_fp8  from deepseek_v3, weight_block_size [40, 48], weight_scale_inv float32  (as DeepSeek-V3 ships)

  Every 2-D weight of the decoder layers except the routers (attention projections, the dense MLPs, the shared
  experts, each routed expert's ``mlp.experts.E.{gate,up,down}_proj.weight``) is stored as F8_E4M3 with
  ``<name>_scale_inv`` [ceil(out / br), ceil(in / bc)]; embeddings, lm_head, norms, the routers ``mlp.gate.weight``
  and DeepSeek's ``e_score_correction_bias`` stay float32 and their modules are listed in
  quantization_config.modules_to_not_convert (one entry per module, as Qwen3-FP8's config.json lists them). The
  blocks do not divide the tiny shapes (hidden 64, experts 32, dense 128, MLA 24 / 16 / 96 / 128), so every matrix
  has partial edge blocks in rows and columns (DeepSeek-V3's own kv_a_proj_with_mqa [576, 7168] has a partial row
  block at [128, 128]).
  Quantizer (per block, as DeepSeek's and Qwen's FP8 conversion scripts): scale = amax(|w|) / 448 (rounded to
  bfloat16 first where the scales are stored as bfloat16), e4m3 = round-to-nearest-even(w / scale) (ml_dtypes
  float8_e4m3fn, |w / scale| clipped to 448), scale_inv = scale; the stored value is e4m3 * scale_inv.

  The reference model is the float32 eager transformers model of the source config with the weights DEQUANTIZED BY
  THIS SCRIPT in numpy from the bytes written (ft_jax.weight_formats.dequantize, cross-checked against an
  element-by-element decode), loaded with ``from_pretrained`` from a temporary float folder: transformers 5.24's
  own FP8 reader is not used (its CPU dequantize derives the block from the scale grid and refuses partial edge
  blocks: "Weight shape (64, 128) not divisible by scale grid (2, 3)"; it rejects DeepSeek-V3's kv_a_proj_with_mqa
  [576, 7168] the same way).

MXFP4 gpt-oss: tests/fixtures/hf_tiny/gpt_oss_mxfp4 already exists (scripts/make_gpt_oss_references.py: random
MXFP4 codes in the Hub layout, gate_up rows interleaved gate/up, every bias non-zero, the SwiGLU clamp reached).
This script checks it: its blocks/scales dequantized in numpy equal transformers' convert_moe_packed_tensors, and
the float model built from the numpy-dequantized experts reproduces its reference files.

reference/ of the FP8 fixtures: the files of tests/fixtures/hf_tiny/README.md (scripts/write_deepseek_fixtures.py
computes them: prompt_logits, prompt_hidden_states, router logits / top-k, decode routing, full_sequence_logits,
info.json with greedy_continuation and the margins), plus for two more prompts extra_<i>_full_sequence_logits.npy
[P_i + 16, V] and info.json "extra_prompts" (prompt_ids, greedy_continuation, min_greedy_logit_margin), and
info.json "numpy_float64_moe_check": one MoE block recomputed in float64 numpy from the stored FP8 bytes (router,
group-limited top-k, experts, shared expert) against transformers' output of that block on the prompt.

Usage:
    python3 scripts/write_quantized_fixtures.py                 # writes tests/fixtures/hf_tiny/{qwen3_moe,deepseek_v3}_fp8
    python3 scripts/write_quantized_fixtures.py --check         # recompute every quantized fixture's references
                                                                # from its stored bytes and compare (incl. gpt_oss_mxfp4)
The output is deterministic (no random numbers: the weights are the source fixture's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile

import ml_dtypes
import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from write_deepseek_fixtures import NEW_TOKENS, PROMPT, references  # noqa: E402  (the reference files' writer)
from ft_jax.weight_formats import FP8_MAX, MXFP4, dequantize, fp8  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf_tiny")
EXTRA_PROMPTS = [[1, 5, 9, 200, 31],
                 [1, 250, 249, 3, 77, 64, 12, 8, 190, 45, 101, 33, 2, 99, 7, 18, 140, 66, 21, 230]]
MIN_ROUTER_MARGIN = 1e-4
MIN_LOGIT_MARGIN = 1e-3

# Blocks tried in order (the first whose router and greedy margins clear the limits is kept): none divides the tiny
# shapes (64, 32, 128, 24, 16, 96), so every matrix has partial edge blocks in rows and columns.
BLOCK_CANDIDATES = [(20, 48), (40, 48), (24, 40), (20, 40), (40, 24), (12, 48), (24, 80)]
# name -> (source fixture, first block tried, scale dtype, notes)
FP8_VARIANTS = {
    "qwen3_moe_fp8": ("qwen3_moe", (20, 48), "bfloat16",
                      "Qwen3-MoE FP8 (qwen3_moe weights): block [20, 48], bfloat16 weight_scale_inv as Qwen3-FP8; "
                      "partial edge blocks in both directions of every matrix; layer 2 dense (mlp_only_layers)"),
    "deepseek_v3_fp8": ("deepseek_v3", (40, 48), "float32",
                        "DeepSeek-V3 FP8 (deepseek_v3 weights): block [40, 48], float32 weight_scale_inv as "
                        "DeepSeek-V3; MLA projections (kv_a_proj_with_mqa [24, 64], kv_b_proj [128, 16]), layer 0 "
                        "dense, shared expert and routed experts all FP8; partial edge blocks in both directions"),
}


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file, as stored (torch dtypes: float8_e4m3fn and bfloat16 included)."""
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def is_fp8_weight(name: str, shape) -> bool:
    """The tensors the FP8 releases store as F8_E4M3: 2-D weights of the decoder layers except the routers."""
    return (len(shape) == 2 and name.startswith("model.layers.") and name.endswith(".weight")
            and not name.endswith(".mlp.gate.weight"))


def quantize_fp8(w: np.ndarray, block: tuple[int, int], scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """Block FP8 quantizer: w f32 [rows, cols] -> (e4m3 float8_e4m3fn [rows, cols], scale_inv ``scale_dtype``
    [ceil(rows / br), ceil(cols / bc)]) with scale = amax / 448 per (partial) block, e4m3 = RNE(w / scale)."""
    br, bc = block
    rows, cols = w.shape
    gr, gc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = np.zeros((gr * br, gc * bc), np.float64)
    padded[:rows, :cols] = w
    amax = np.abs(padded.reshape(gr, br, gc, bc)).max(axis=(1, 3))  # f64[gr, gc]
    assert (amax > 0).all(), "an all-zero block"
    scale = (amax / FP8_MAX).astype(np.float32).astype(scale_dtype)  # as stored
    full = np.repeat(np.repeat(scale.astype(np.float64), br, 0), bc, 1)[:rows, :cols]
    q = np.clip(w.astype(np.float64) / full, -FP8_MAX, FP8_MAX).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def decode_fp8_elementwise(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Independent check of weight_formats.dequantize: value[r, c] = float(q[r, c]) * scale_inv[r // br, c // bc],
    with the e4m3 bits decoded by hand (sign, 4-bit exponent bias 7, 3-bit mantissa, subnormals; 0x7F / 0xFF NaN).
    Returns f64 [rows, cols]."""
    bits = q.view(np.uint8).astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    assert not ((exp == 0xF) & (man == 0x7)).any(), "NaN in the FP8 data"
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    r = np.arange(q.shape[0])[:, None] // block[0]
    c = np.arange(q.shape[1])[None, :] // block[1]
    return sign * mag * scale_inv.astype(np.float64)[r, c]


def modules_not_converted(names) -> list[str]:
    """Module paths of the tensors kept as stored (name minus its last component), sorted."""
    return sorted({n.rsplit(".", 1)[0] for n in names})


def to_torch(a: np.ndarray) -> torch.Tensor:
    """numpy (float8_e4m3fn / bfloat16 via ml_dtypes, or a plain dtype) -> torch tensor of the same bytes."""
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(torch.float8_e4m3fn)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def dequantized_fp8_state(stored: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A stored FP8 checkpoint's tensors with every ``*.weight`` + ``*.weight_scale_inv`` pair replaced by its
    float32 values (weight_formats.dequantize; asserted equal to the element-by-element decode)."""
    fmt = fp8(block)
    out = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            q = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
            s = stored[name + "_scale_inv"].float().numpy()  # bf16 -> f32 exactly
            w = dequantize(q, s, fmt)  # f32[out, in]
            ref = decode_fp8_elementwise(q, s, block)
            assert np.array_equal(w, ref.astype(np.float32)), name
            out[name] = torch.from_numpy(w)
        else:
            out[name] = t
    return out


def float_model(config: dict, state: dict[str, torch.Tensor]):
    """The float32 eager transformers model of ``config`` (no quantization_config) with ``state``, through
    from_pretrained of a temporary folder (its checkpoint-name conversions: per-expert tensors -> fused experts)."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        json.dump(plain, open(os.path.join(tmp, "config.json"), "w"))
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        model, loading = AutoModelForCausalLM.from_pretrained(
            tmp, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32,
            output_loading_info=True)
    bad = {k: v for k, v in loading.items() if v and k != "error_msgs" or k == "error_msgs" and v}
    assert not bad, f"from_pretrained did not take every tensor: {bad}"
    return model.eval()


def greedy_refs(model, prompt: list[int]) -> tuple[list[int], np.ndarray, float]:
    """(greedy continuation of NEW_TOKENS with the KV cache, full-sequence logits f32[P + NEW_TOKENS, V] of
    prompt + continuation, min top-2 logit gap over the greedy steps)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
        cont = gen[0, len(prompt):].tolist()
        nocache = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=False)
        assert nocache[0, len(prompt):].tolist() == cont, "cached and uncached greedy decoding differ"
        full = model(torch.tensor([prompt + cont])).logits[0].numpy()
    steps = full[len(prompt) - 1:len(prompt) + NEW_TOKENS - 1]
    top2 = np.sort(steps, -1)[:, -2:]
    assert (np.argmax(steps, -1) == np.asarray(cont)).all()
    return cont, full, float((top2[:, 1] - top2[:, 0]).min())


def _silu(x):
    return x / (1 + np.exp(-x))


def numpy_moe_block(stored: dict[str, torch.Tensor], config: dict, layer: int, block: tuple[int, int],
                    x: np.ndarray) -> np.ndarray:
    """One MoE block in float64 numpy from the stored FP8 bytes (decode_fp8_elementwise): Qwen3 softmax top-k
    (norm_topk_prob) or DeepSeek-V3 sigmoid + e_score_correction_bias group-limited top-k, normalised, scaled, plus
    the shared experts. x f64[T, H] -> f64[T, H]."""
    p = f"model.layers.{layer}.mlp"

    def w(name):
        t = stored[name]
        if t.dtype != torch.float8_e4m3fn:
            return t.double().numpy()
        q = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        return decode_fp8_elementwise(q, stored[name + "_scale_inv"].float().numpy(), block)

    def mlp(prefix, v):
        return (_silu(v @ w(f"{prefix}.gate_proj.weight").T) * (v @ w(f"{prefix}.up_proj.weight").T)) @ \
            w(f"{prefix}.down_proj.weight").T

    E = next(config[key] for key in ("n_routed_experts", "num_local_experts", "num_experts") if key in config)
    k = config["num_experts_per_tok"]
    logits = x @ w(f"{p}.gate.weight").T  # [T, E]
    if config["model_type"] == "deepseek_v3":
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + stored[f"{p}.gate.e_score_correction_bias"].double().numpy()
        ng, tg = config["n_group"], config["topk_group"]
        groups = np.sort(choice.reshape(len(x), ng, E // ng), -1)[..., -2:].sum(-1)  # [T, n_group]
        keep = np.zeros_like(groups, bool)
        np.put_along_axis(keep, np.argsort(-groups, -1)[:, :tg], True, -1)
        choice = np.where(np.repeat(keep, E // ng, -1), choice, -np.inf)
        ids = np.argsort(-choice, -1)[:, :k]
        weights = np.take_along_axis(scores, ids, -1)
    else:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ids = np.argsort(-probs, -1)[:, :k]
        weights = np.take_along_axis(probs, ids, -1)
    if config["norm_topk_prob"]:
        weights = weights / weights.sum(-1, keepdims=True)
    weights = weights * config.get("routed_scaling_factor", 1.0)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for e, g in zip(ids[t], weights[t]):
            out[t] += g * mlp(f"{p}.experts.{e}", x[t:t + 1])[0]
    if config["model_type"] == "deepseek_v3":
        out += mlp(f"{p}.shared_experts", x)
    return out


def moe_check(model, stored, config, block) -> dict:
    """transformers' output of the first MoE block on the prompt vs numpy_moe_block on the same input."""
    layer = next(i for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "gate"))
    seen = {}
    h = model.model.layers[layer].mlp.register_forward_hook(
        lambda mod, args, out: seen.update(x=args[0][0].double().numpy(), y=out[0].double().numpy()))
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    h.remove()
    y = numpy_moe_block(stored, config, layer, block, seen["x"])
    err = float(np.abs(y - seen["y"]).max())
    scale = float(np.abs(y).max())
    assert err < 1e-5 * max(1.0, scale), (layer, err, scale)
    return {"layer": layer, "max_abs_diff": err, "max_abs_output": scale}


def fp8_references(folder: str, config: dict, block: tuple[int, int]) -> tuple[dict, dict]:
    """Reference arrays and info fields of an FP8 fixture folder, computed from its stored bytes."""
    stored = read_safetensors(os.path.join(folder, "model.safetensors"))
    model = float_model(config, dequantized_fp8_state(stored, block))
    kind = "v3" if config["model_type"] == "deepseek_v3" else "v2"
    if kind == "v2":
        # Qwen3's router: softmax over the logits, then top-k: selection_margins' softmax rule ("greedy").
        model.config.topk_method = "greedy"
    refs, info = references(model, kind)
    extra = []
    for i, prompt in enumerate(EXTRA_PROMPTS):
        cont, full, margin = greedy_refs(model, prompt)
        refs[f"extra_{i}_full_sequence_logits"] = full
        extra.append({"prompt_ids": prompt, "greedy_continuation": cont, "min_greedy_logit_margin": margin,
                      "full_sequence_logits": f"extra_{i}_full_sequence_logits.npy"})
    info["extra_prompts"] = extra
    info["numpy_float64_moe_check"] = moe_check(model, stored, config, block)
    return refs, info


def write_fp8(root: str, name: str, block: tuple[int, int]) -> dict:
    """Write the FP8 fixture ``name`` with ``block`` (rows, cols) per scale; returns its info.json."""
    source, _, scale_dtype, notes = FP8_VARIANTS[name]
    src = os.path.join(root, source)
    folder = os.path.join(root, name)
    config = json.load(open(os.path.join(src, "config.json")))
    weights = read_safetensors(os.path.join(src, "model.safetensors"))
    sdt = ml_dtypes.bfloat16 if scale_dtype == "bfloat16" else np.float32
    out, kept, shapes = {}, [], {}
    for tname, t in sorted(weights.items()):
        a = t.numpy()
        if is_fp8_weight(tname, a.shape):
            q, s = quantize_fp8(a, block, sdt)
            out[tname], out[tname + "_scale_inv"] = to_torch(q), to_torch(s)
            shapes.setdefault(f"{list(a.shape)} -> scale_inv {list(s.shape)}", []).append(tname)
        else:
            out[tname] = t.contiguous()
            kept.append(tname)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block),
                                     "modules_to_not_convert": modules_not_converted(kept)}
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.makedirs(os.path.join(folder, "reference"))
    json.dump(config, open(os.path.join(folder, "config.json"), "w"), indent=2)
    shutil.copy(os.path.join(src, "generation_config.json"), folder)
    save_file(out, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    refs, info = fp8_references(folder, config, block)
    for key, arr in refs.items():
        np.save(os.path.join(folder, "reference", key + ".npy"), arr)
    fmt = fp8(block)
    full = {
        "name": name, "model_class": config["architectures"][0], "transformers": transformers.__version__,
        "torch": torch.__version__, "source_fixture": source, "attn_implementation": "eager",
        "experts_implementation": "eager", "dtype": "float32", "weight_block_size": list(block),
        "scale_inv_dtype": scale_dtype, "prompt_ids": PROMPT, **info, "notes": notes,
        "fp8_tensors_by_shape": {k: len(v) for k, v in shapes.items()},
        "stored_bytes": os.path.getsize(os.path.join(folder, "model.safetensors")),
        "fp8_bits_per_weight_of_an_expert_gate_proj": fmt.bits_per_weight(
            *weights[next(n for n in weights if ".experts.0.gate_proj" in n)].shape),
    }
    json.dump(full, open(os.path.join(folder, "reference", "info.json"), "w"), indent=1)
    return full


def check_fp8(folder: str) -> bool:
    """Recompute an FP8 fixture's references from its stored bytes and compare with its files."""
    config = json.load(open(os.path.join(folder, "config.json")))
    block = tuple(config["quantization_config"]["weight_block_size"])
    refs, info = fp8_references(folder, config, block)
    stored_info = json.load(open(os.path.join(folder, "reference", "info.json")))
    ok = compare(folder, refs)
    same = info["greedy_continuation"] == stored_info["greedy_continuation"] and all(
        a["greedy_continuation"] == b["greedy_continuation"]
        for a, b in zip(info["extra_prompts"], stored_info["extra_prompts"]))
    print(f"  greedy continuations {'same' if same else 'DIFFERENT'}; numpy float64 MoE block check "
          f"{info['numpy_float64_moe_check']}")
    return ok and same


def compare(folder: str, refs: dict[str, np.ndarray]) -> bool:
    ok = True
    for key, arr in refs.items():
        want = np.load(os.path.join(folder, "reference", key + ".npy"))
        if arr.dtype.kind == "i":
            same = np.array_equal(np.sort(arr, -1), np.sort(want, -1))  # DeepSeek's unsorted top-k: as sets
        else:
            same = arr.shape == want.shape and np.allclose(arr, want, atol=2e-5, rtol=1e-6)
        diff = np.abs(arr.astype(np.float64) - want).max() if arr.shape == want.shape else float("nan")
        print(f"  {key:32s} {'same' if same else 'DIFFERENT'} (max |diff| {diff:.2e})")
        ok &= bool(same)
    return ok


def check_mxfp4(folder: str) -> bool:
    """gpt_oss_mxfp4: numpy MXFP4 dequantize == transformers' convert_moe_packed_tensors (every layer, and the
    stored layer-0 npz); the float model with the numpy-dequantized experts reproduces the reference files."""
    config = json.load(open(os.path.join(folder, "config.json")))
    stored = read_safetensors(os.path.join(folder, "model.safetensors"))
    ref0 = np.load(os.path.join(folder, "reference", "mxfp4_dequantized_layer0.npz"))
    state, ok = {}, True
    for name, t in stored.items():
        m = re.fullmatch(r"(.*)_(blocks|scales)", name)
        if m is None:
            state[name] = t
            continue
        if m.group(2) == "scales":
            continue
        base = m.group(1)
        blocks, scales = t.numpy(), stored[base + "_scales"].numpy()  # u8[E, out, G, 16], u8[E, out, G]
        E, rows = blocks.shape[:2]
        w = dequantize(blocks.reshape(E, rows, -1), scales, MXFP4)  # f32[E, out, in]
        hf = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()  # [E, in, out]
        same = np.array_equal(w.transpose(0, 2, 1), hf)
        if base.startswith("model.layers.0."):
            same &= np.array_equal(w.transpose(0, 2, 1), ref0[base.rsplit(".", 1)[1]])
        print(f"  {base}: numpy MXFP4 dequantize {'==' if same else '!='} transformers' (and the layer-0 npz)")
        ok &= bool(same)
        state[base] = torch.from_numpy(np.ascontiguousarray(w.transpose(0, 2, 1)))  # HF param [E, in, out]
    model = float_model(config, state)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    info = json.load(open(os.path.join(folder, "reference", "info.json")))
    cont, full, _ = greedy_refs(model, PROMPT)
    refs = {"prompt_logits": out.logits[0].numpy(),
            "prompt_hidden_states": np.stack([h[0].numpy() for h in out.hidden_states]),
            "full_sequence_logits": full}
    ok &= compare(folder, refs)
    same = cont == info["greedy_continuation"]
    print(f"  greedy_continuation {'same' if same else 'DIFFERENT'}")
    return ok and same


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=FIXTURES, help="fixture root (default tests/fixtures/hf_tiny)")
    parser.add_argument("--check", action="store_true", help="recompute and compare instead of writing")
    parser.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)  # nothing here is random; fixed anyway
    if args.check:
        ok = True
        for name in args.only or [*FP8_VARIANTS, "gpt_oss_mxfp4"]:
            print(name)
            folder = os.path.join(args.root, name)
            ok &= check_mxfp4(folder) if name == "gpt_oss_mxfp4" else check_fp8(folder)
        print("all same" if ok else "SOME DIFFERENT")
        return 0 if ok else 1
    for name in args.only or FP8_VARIANTS:
        first = FP8_VARIANTS[name][1]
        for block in [first] + [b for b in BLOCK_CANDIDATES if b != first]:
            info = write_fp8(args.root, name, block)
            router = min(info["min_topk_choice_margin_per_moe_layer"] +
                         [g for g in info.get("min_group_choice_margin_per_moe_layer", []) if g is not None])
            logit = min([info["min_greedy_logit_margin"]] +
                        [e["min_greedy_logit_margin"] for e in info["extra_prompts"]])
            ok = router > MIN_ROUTER_MARGIN and logit > MIN_LOGIT_MARGIN and info["cache_vs_nocache_equal"]
            print(f"{name} block {list(block)}: {info['stored_bytes']} bytes, router margin {router:.2e}, logit "
                  f"margin {logit:.2e}, greedy {info['greedy_continuation']}, numpy MoE check "
                  f"{info['numpy_float64_moe_check']}: {'kept' if ok else 'rejected'}")
            if ok:
                break
        else:
            raise SystemExit(f"{name}: no block gives margins above ({MIN_ROUTER_MARGIN}, {MIN_LOGIT_MARGIN})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
