#!/usr/bin/env python3
"""Write the gpt-oss reference fixtures with Hugging Face transformers (not run in CI; needs torch + transformers).

    python3 -m venv /work/venvs/go-ref
    /work/venvs/go-ref/bin/pip install torch==2.13.0 transformers safetensors   # transformers 5.24, CPU torch
    /work/venvs/go-ref/bin/python scripts/make_gpt_oss_references.py            # writes under tests/fixtures/

Writes:
  tests/fixtures/rope_yarn_reference.json: transformers' ``_compute_yarn_parameters`` (inv_freq, attention factor)
      for gpt-oss / DeepSeek-style rope configs (truncate on and off, the mscale pair, an explicit attention_factor,
      original_max_position_embeddings absent, at the top level, in the rope dict), for tests/test_config.py.
  tests/fixtures/hf_tiny/gpt_oss_mxfp4/: a tiny GptOssForCausalLM checkpoint in the Hub layout (config.json with
      rope_theta + rope_scaling, torch_dtype and quantization_config mxfp4; experts as gate_up_proj_blocks/_scales and
      down_proj_blocks/_scales, uint8) whose biases (attention q/k/v/o, router, experts) and sinks are all non-zero
      and whose expert weights are large enough that the clamped SwiGLU clips (the shared fixture has zero biases and
      never reaches the clamp). Layer types sliding, sliding, full (window 5 < prompt length) in one stack of 3.
      reference/: the files of the shared hf_tiny fixtures (README there), computed by the float32 eager model built
      in memory from the dequantized weights, checked against the same checkpoint loaded back by
      ``from_pretrained`` (transformers' own MXFP4 reader, dequantize=True); plus
      mxfp4_dequantized_layer0.npz: transformers' ``convert_moe_packed_tensors`` output of layer 0 (gate_up_proj
      [E, H, 2I], down_proj [E, I, H], float32) for the loader test.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
PROMPT = [1, 17, 42, 99, 123, 7, 250, 3, 64, 128, 5, 200]
NEW_TOKENS = 16
SEED = 2024


def yarn_references() -> None:
    """transformers' YaRN inv_freq / attention factor for several configs -> rope_yarn_reference.json."""
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    cases = {
        "gpt_oss_20b": dict(head_dim=64, max_position_embeddings=131072, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=4096, truncate=False)),
        "gpt_oss_truncate": dict(head_dim=64, max_position_embeddings=131072, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=4096, truncate=True)),
        "tiny_fixture": dict(head_dim=16, max_position_embeddings=131072, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
            original_max_position_embeddings=4096, truncate=False)),
        "deepseek_v3_mscale": dict(head_dim=64, max_position_embeddings=163840, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=1.0, original_max_position_embeddings=4096)),
        "mscale_ratio": dict(head_dim=32, max_position_embeddings=65536, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=16.0, mscale=0.707, mscale_all_dim=1.0,
            original_max_position_embeddings=4096)),
        "attention_factor": dict(head_dim=32, max_position_embeddings=32768, rope_parameters=dict(
            rope_type="yarn", rope_theta=500000.0, factor=8.0, attention_factor=0.9, beta_fast=16.0, beta_slow=2.0,
            original_max_position_embeddings=4096)),
        "original_absent": dict(head_dim=32, max_position_embeddings=8192, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0)),
        "original_top_level": dict(head_dim=32, max_position_embeddings=131072, original_max_position_embeddings=2048,
                                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=64.0,
                                                        original_max_position_embeddings=4096)),
    }
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": {}}
    for name, fields in cases.items():
        raw = dict(base, **fields)
        cfg = GptOssConfig(**json.loads(json.dumps(raw)))
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        out["cases"][name] = {"config": raw, "inv_freq": inv_freq.double().tolist(),
                              "attention_factor": float(attention_factor)}
    path = os.path.join(ROOT, "rope_yarn_reference.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)


def random_mxfp4(gen: torch.Generator, shape: tuple[int, ...], scale_lo: int, scale_hi: int):
    """Random MXFP4 tensors: blocks u8[*shape, G, 16] (any codes) and scales u8[*shape, G] in [scale_lo, scale_hi]."""
    *lead, cols = shape
    g = cols // 32
    blocks = torch.randint(0, 256, (*lead, g, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(scale_lo, scale_hi + 1, (*lead, g), generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def capture_routing(model):
    """Forward hooks on every layer's router: returns (records list, handles); each record is (logits, ids, scores)."""
    records = []
    handles = [layer.mlp.router.register_forward_hook(
        lambda mod, inp, out: records.append(tuple(t.detach().clone() for t in out))) for layer in model.model.layers]
    return records, handles


def tiny_mxfp4_model() -> None:
    out_dir = os.path.join(ROOT, "hf_tiny", "gpt_oss_mxfp4")
    ref_dir = os.path.join(out_dir, "reference")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(ref_dir)
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    hub_config = {  # Hub key style (rope_theta + rope_scaling, torch_dtype), as openai/gpt-oss-20b's config.json
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.1, "intermediate_size": 32,
        "layer_types": layer_types, "max_position_embeddings": 131072, "num_attention_heads": 4,
        "num_experts_per_tok": 3, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_local_experts": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 150000, "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "rope_type": "yarn", "truncate": False},
        "sliding_window": 5, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "vocab_size": 256, "use_cache": True,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hub_config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, f, indent=2)

    plain = {k: v for k, v in hub_config.items() if k != "quantization_config"}
    cfg = GptOssConfig(**json.loads(json.dumps(plain)))
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = GptOssForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    tensors, dequant0 = {}, {}
    with torch.no_grad():
        for name, p in model.named_parameters():  # every bias and sink non-zero
            if name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for l, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            gu_blocks, gu_scales = random_mxfp4(gen, (E, 2 * I, H), 124, 126)  # |w| up to 6 * 2^-1
            dn_blocks, dn_scales = random_mxfp4(gen, (E, H, I), 122, 124)
            gu = convert_moe_packed_tensors(gu_blocks, gu_scales, dtype=torch.float32)  # [E, H, 2I]
            dn = convert_moe_packed_tensors(dn_blocks, dn_scales, dtype=torch.float32)  # [E, I, H]
            assert gu.shape == ex.gate_up_proj.shape and dn.shape == ex.down_proj.shape, (gu.shape, dn.shape)
            ex.gate_up_proj.copy_(gu)
            ex.down_proj.copy_(dn)
            p = f"model.layers.{l}.mlp.experts"
            tensors.update({f"{p}.gate_up_proj_blocks": gu_blocks, f"{p}.gate_up_proj_scales": gu_scales,
                            f"{p}.down_proj_blocks": dn_blocks, f"{p}.down_proj_scales": dn_scales})
            if l == 0:
                dequant0 = {"gate_up_proj": gu.numpy(), "down_proj": dn.numpy()}
    for name, p in model.state_dict().items():
        if not (name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")):
            tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)
    np.savez_compressed(os.path.join(ref_dir, "mxfp4_dequantized_layer0.npz"), **dequant0)

    # The clamp is reached: gate/up pre-activations beyond the limit in the prompt forward.
    pre = []
    hooks = [layer.mlp.register_forward_hook(lambda mod, inp, out: pre.append(inp[0].detach()))
             for layer in model.model.layers]
    normed = []
    hooks.append(model.model.norm.register_forward_hook(lambda mod, inp, out: normed.append(out.detach())))
    ids = torch.tensor([PROMPT])
    records, handles = capture_routing(model)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    clamped = []
    for l, x in enumerate(pre):
        ex = model.model.layers[l].mlp.experts
        gu = torch.einsum("th,ehc->tec", x[0], ex.gate_up_proj) + ex.gate_up_proj_bias[None]
        clamped.append([float((gu[..., 0::2] > cfg.swiglu_limit).float().mean()),
                        float((gu[..., 1::2].abs() > cfg.swiglu_limit).float().mean())])
    prompt_logits = out.logits[0].float().numpy()
    # [L + 1, T, H]: embeddings, the outputs of layers 0..L-2 and the final norm's output (the shared fixtures'
    # convention: transformers' output_hidden_states)
    hidden = [h[0].numpy() for h in out.hidden_states]
    assert len(hidden) == cfg.num_hidden_layers + 1 and np.array_equal(hidden[-1], normed[0][0].numpy())
    router_logits = np.stack([r[0].numpy() for r in records])  # [L, T, E]
    topk_ids = np.stack([r[2].numpy() for r in records]).astype(np.int64)
    topk_w = np.stack([r[1].numpy() for r in records])
    margins = []
    for lg in router_logits:
        s = np.sort(lg, axis=-1)[:, ::-1]
        margins.append(float((s[:, cfg.num_experts_per_tok - 1] - s[:, cfg.num_experts_per_tok]).min()))
    for h in handles:
        h.remove()

    # KV-cached greedy decoding, recording each decode step's routing.
    records, handles = capture_routing(model)
    with torch.no_grad():
        o = model(ids, use_cache=True)
        past, nxt = o.past_key_values, int(o.logits[0, -1].argmax())
        generated, decode_ids, decode_w, logit_margins = [nxt], [], [], []
        top2 = torch.topk(o.logits[0, -1], 2).values
        logit_margins.append(float(top2[0] - top2[1]))
        for _ in range(NEW_TOKENS - 1):
            records.clear()
            o = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
            decode_ids.append(np.stack([r[2][0].numpy() for r in records]))
            decode_w.append(np.stack([r[1][0].numpy() for r in records]))
            top2 = torch.topk(o.logits[0, -1], 2).values
            logit_margins.append(float(top2[0] - top2[1]))
            nxt = int(o.logits[0, -1].argmax())
            generated.append(nxt)
    for h in handles:
        h.remove()
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + generated])).logits[0].numpy()
    greedy_no_cache = []
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            greedy_no_cache.append(nxt)
            seq.append(nxt)

    # transformers' own reader of the checkpoint (MXFP4 dequantized on load) gives the same model.
    loaded = GptOssForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        reread = loaded(ids).logits[0].float().numpy()
    reread_err = float(np.abs(reread - prompt_logits).max())
    assert reread_err < 1e-5, reread_err

    arrays = {"prompt_logits": prompt_logits, "prompt_hidden_states": np.stack(hidden),
              "prompt_router_logits": router_logits, "prompt_topk_ids": topk_ids, "prompt_topk_weights": topk_w,
              "decode_topk_ids": np.stack(decode_ids).astype(np.int64), "decode_topk_weights": np.stack(decode_w),
              "full_sequence_logits": full}
    for name, a in arrays.items():
        np.save(os.path.join(ref_dir, f"{name}.npy"), a)
    info = {
        "name": "gpt_oss_mxfp4", "model_class": "GptOssForCausalLM", "transformers": transformers.__version__,
        "torch": torch.__version__, "seed": SEED, "attn_implementation": "eager", "dtype": "float32",
        "prompt_ids": PROMPT, "greedy_continuation": generated, "greedy_continuation_no_cache": greedy_no_cache,
        "cache_vs_nocache_equal": generated == greedy_no_cache, "moe_layers": list(range(cfg.num_hidden_layers)),
        "min_topk_choice_margin_per_moe_layer": margins, "min_greedy_logit_margin": min(logit_margins),
        "clamped_fraction_gate_up_per_layer": clamped, "from_pretrained_prompt_logits_max_abs_diff": reread_err,
        "files": {n: f"{n}.npy {list(a.shape)} {a.dtype}" for n, a in arrays.items()},
    }
    with open(os.path.join(ref_dir, "info.json"), "w") as f:
        json.dump(info, f, indent=1)
    print("wrote", out_dir, json.dumps({k: info[k] for k in ("greedy_continuation", "cache_vs_nocache_equal",
                                                              "min_topk_choice_margin_per_moe_layer",
                                                              "min_greedy_logit_margin",
                                                              "clamped_fraction_gate_up_per_layer",
                                                              "from_pretrained_prompt_logits_max_abs_diff")}))


if __name__ == "__main__":
    yarn_references()
    tiny_mxfp4_model()
