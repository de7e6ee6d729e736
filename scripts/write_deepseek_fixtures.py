#!/usr/bin/env python3
"""Write the tiny DeepSeek-V2/V3 reference checkpoints of tests/fixtures/hf_tiny with transformers (not run in CI).

Each variant is a random float32 DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (seed below, initializer_range 0.1,
eager attention and experts), saved with ``save_pretrained``, its config.json optionally rewritten in the Hub key style
(``rope_theta`` + ``rope_scaling`` with ``type``, ``torch_dtype``, the DeepSeek release keys ``scoring_func``,
``topk_method``, ``moe_layer_freq``), then loaded back from the folder with ``from_pretrained`` and run on the prompt
of the other fixtures. The reference/ files are the ones of tests/fixtures/hf_tiny/README.md:

  prompt_logits [T, V]; prompt_hidden_states [L+1, T, H]; prompt_router_logits [n_moe, T, E] (the router's raw
  logits: transformers' ``output_router_logits``, DeepseekV*TopkRouter output 0); prompt_topk_ids int64 and
  prompt_topk_weights [n_moe, T, k] (the router's outputs 2 and 1: ids as torch.topk(sorted=False) returns them,
  combine weights after normalisation and routed_scaling_factor); decode_topk_ids / decode_topk_weights [15, n_moe, k]
  (each KV-cached greedy decode step); full_sequence_logits [T+16, V]; info.json (greedy continuation with and
  without the KV cache, moe_layers, the routing config, the smallest selection margins).

The router margins are computed from the router logits with the selection rule of the family (V2: softmax, group
max; V3: sigmoid + e_score_correction_bias, group = sum of its top-2): a variant whose k-th and (k+1)-th choice (or
whose topk_group-th and next group) are closer than 1e-4 on any prompt or decode token, or whose greedy top-2 logits
are closer than 1e-3, is rejected (the script tries the next seed), so float32 noise cannot flip a reference choice.

Usage (a separate venv: pip install torch==2.13.0 transformers==5.24.0 safetensors numpy):
    /work/venvs/ds-ref/bin/python scripts/write_deepseek_fixtures.py tests/fixtures/hf_tiny
    /work/venvs/ds-ref/bin/python scripts/write_deepseek_fixtures.py --check ../shared/fixtures/hf_tiny/deepseek_v3
(--check recomputes the reference files of an existing folder and compares them, a test of this script.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch
import transformers
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

PROMPT = [1, 17, 42, 99, 123, 7, 250, 3, 64, 128, 5, 200]
NEW_TOKENS = 16
MIN_ROUTER_MARGIN = 1e-4
MIN_LOGIT_MARGIN = 1e-3

COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, hidden_act="silu",
              initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False, kv_lora_rank=16, qk_nope_head_dim=16, n_routed_experts=8)

# name -> (model class, config kwargs, e_score_correction_bias (mean, std) or None, Hub-style config.json, notes)
VARIANTS = {
    "deepseek_v2": (
        "v2", dict(num_hidden_layers=3, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=12, intermediate_size=96,
                   moe_intermediate_size=16, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=1,
                   topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=128,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        None, True,
        "V2 softmax router, topk_method greedy, q_lora_rank null (q_proj), v_head_dim 12 != qk_nope_head_dim 16, "
        "2 shared experts, layer 0 dense, top-3; Hub-style config.json"),
    "deepseek_v2_group": (
        "v2", dict(num_hidden_layers=3, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
                   moe_intermediate_size=16, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=0,
                   topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=True,
                   routed_scaling_factor=1.5, attention_bias=True, max_position_embeddings=64,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale": 0.707, "mscale_all_dim": 1.0}),
        None, False,
        "V2 group_limited_greedy (n_group 4, topk_group 2), norm_topk_prob true (transformers' V2 router does not "
        "read it), routed_scaling_factor 1.5, attention_bias, every layer MoE, YaRN factor 4 with mscale 0.707 != "
        "mscale_all_dim 1.0"),
    "deepseek_v3_nonorm": (
        "v3", dict(num_hidden_layers=4, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
                   moe_intermediate_size=16, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=2,
                   n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.0, rope_interleave=False,
                   max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        (-1.0, 0.1), False,
        "V3 norm_topk_prob false, e_score_correction_bias about -1 (every biased score negative: a masked group "
        "filled with 0 instead of -inf would win), n_group 2 / topk_group 1, top-3, rope_interleave false, layers "
        "0-1 dense, 2 shared experts"),
    "deepseek_v3_yarn": (
        "v3", dict(num_hidden_layers=3, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96,
                   moe_intermediate_size=16, num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                   n_group=4, topk_group=3, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                   max_position_embeddings=128,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                    "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale": 1.0, "mscale_all_dim": 1.0}),
        (0.0, 0.05), True,
        "V3 with YaRN as DeepSeek-V3 ships it (rope_scaling type yarn, mscale 1.0 = mscale_all_dim 1.0, here factor "
        "8 over 16 original positions), qk_rope_head_dim 16, top-4 of 8 in 4 groups (topk_group 3); Hub-style "
        "config.json"),
}


def hub_style(cfg: dict) -> dict:
    """config.json as DeepSeek's Hub releases write it: rope_theta + rope_scaling{type}, torch_dtype, no head_dim /
    qk_head_dim, and the release's routing keys (which transformers reads or ignores)."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "dtype", "head_dim", "qk_head_dim")}
    rope = dict(cfg["rope_parameters"])
    out["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    out["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    out["torch_dtype"] = cfg.get("dtype", "float32")
    out["moe_layer_freq"] = 1
    if cfg["model_type"] == "deepseek_v3":
        out.update(scoring_func="sigmoid", topk_method="noaux_tc")
    else:
        out.update(scoring_func="softmax")
    return dict(sorted(out.items()))


def selection_margins(kind: str, cfg, logits: np.ndarray, bias: np.ndarray | None) -> tuple[float, float]:
    """(min gap between the k-th and (k+1)-th choice score, min gap between the topk_group-th and next group score)
    over the rows of router logits f32[N, E], with the family's selection rule (float64)."""
    logits = logits.astype(np.float64)
    E, k = logits.shape[-1], cfg.num_experts_per_tok
    if kind == "v3":
        choice = 1 / (1 + np.exp(-logits)) + bias
        groups = np.sort(choice.reshape(-1, cfg.n_group, E // cfg.n_group), -1)[..., -2:].sum(-1)
        grouped = True
    else:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        choice = p / p.sum(-1, keepdims=True)
        grouped = cfg.topk_method == "group_limited_greedy"
        groups = choice.reshape(-1, cfg.n_group, E // cfg.n_group).max(-1) if grouped else None
    group_gap = np.inf
    if grouped:
        order = np.sort(groups, -1)[:, ::-1]
        if cfg.topk_group < cfg.n_group:
            group_gap = float((order[:, cfg.topk_group - 1] - order[:, cfg.topk_group]).min())
        top = np.argsort(-groups, -1, kind="stable")[:, :cfg.topk_group]
        keep = np.zeros_like(groups, bool)
        np.put_along_axis(keep, top, True, -1)
        choice = np.where(np.repeat(keep, E // cfg.n_group, -1), choice, -np.inf)
    srt = np.sort(choice, -1)[:, ::-1]
    gap = srt[:, k - 1] - srt[:, k] if k < E else np.full(len(srt), np.inf)
    gap = np.where(np.isfinite(srt[:, k]) if k < E else True, gap, np.inf)
    return float(gap.min()), group_gap


class RouterTap:
    """Forward hooks on every MoE layer's router: each call appends (logits, topk_weights, topk_ids) per layer."""

    def __init__(self, model):
        self.calls: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        self.moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        self._current: list = []
        for i in self.moe_layers:
            model.model.layers[i].mlp.gate.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        logits, weights, ids = (t.detach().cpu().numpy() for t in out)
        self._current.append((logits, weights, ids))
        if len(self._current) == len(self.moe_layers):
            self.calls.append(self._current)
            self._current = []


def references(model, kind: str) -> tuple[dict[str, np.ndarray], dict]:
    """Reference arrays and the info.json fields computed from the model (see the module docstring)."""
    cfg = model.config
    tap = RouterTap(model)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_router_logits=True)
    prompt_call = tap.calls[-1]
    hooked_logits = np.stack([c[0] for c in prompt_call])
    router_logits = np.stack([r.detach().numpy() for r in out.router_logits])
    refs = {
        "prompt_logits": out.logits[0].numpy(),
        "prompt_hidden_states": np.stack([h[0].numpy() for h in out.hidden_states]),
        "prompt_router_logits": router_logits,
        "prompt_topk_ids": np.stack([c[2] for c in prompt_call]).astype(np.int64),
        "prompt_topk_weights": np.stack([c[1] for c in prompt_call]),
    }
    tap.calls.clear()
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
    steps = tap.calls
    continuation = gen[0, len(PROMPT):].tolist()
    prefill = np.stack([c[2] for c in steps[0]]).astype(np.int64)
    refs["decode_topk_ids"] = np.stack([np.stack([c[2][0] for c in s]) for s in steps[1:]]).astype(np.int64)
    refs["decode_topk_weights"] = np.stack([np.stack([c[1][0] for c in s]) for s in steps[1:]])
    with torch.no_grad():
        nocache = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=False)
        full = model(torch.tensor([PROMPT + continuation]))
    refs["full_sequence_logits"] = full.logits[0].numpy()
    margins = []
    for m, layer in enumerate(tap.moe_layers):
        rows = np.concatenate([s[m][0] for s in steps])  # prefill rows + one row per decode step
        bias = (model.model.layers[layer].mlp.gate.e_score_correction_bias.detach().numpy()
                if kind == "v3" else None)
        margins.append(selection_margins(kind, cfg, rows, bias))
    gl = refs["full_sequence_logits"][len(PROMPT) - 1:len(PROMPT) + NEW_TOKENS - 1]
    top2 = np.sort(gl, -1)[:, -2:]
    info = {
        "greedy_continuation": continuation,
        "greedy_continuation_no_cache": nocache[0, len(PROMPT):].tolist(),
        "cache_vs_nocache_equal": continuation == nocache[0, len(PROMPT):].tolist(),
        "min_greedy_logit_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "moe_layers": tap.moe_layers,
        "router_logits_from_output_router_logits_equal_hook": bool(np.array_equal(hooked_logits, router_logits)),
        "prefill_routing_equals_prompt_forward": bool(np.array_equal(prefill, refs["prompt_topk_ids"])),
        "min_topk_choice_margin_per_moe_layer": [m[0] for m in margins],
        "min_group_choice_margin_per_moe_layer": [m[1] if np.isfinite(m[1]) else None for m in margins],
    }
    return refs, info


def load(kind: str, folder: str):
    cls = DeepseekV3ForCausalLM if kind == "v3" else DeepseekV2ForCausalLM
    return cls.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager",
                               dtype=torch.float32).eval()


def write_variant(root: str, name: str, seed: int) -> dict:
    kind, kwargs, bias, hub, notes = VARIANTS[name]
    cls, config_cls = ((DeepseekV3ForCausalLM, DeepseekV3Config) if kind == "v3"
                       else (DeepseekV2ForCausalLM, DeepseekV2Config))
    folder = os.path.join(root, name)
    t0 = time.time()
    torch.manual_seed(seed)
    config = config_cls(**COMMON, **kwargs)
    config._attn_implementation = "eager"
    model = cls(config).eval()
    if bias is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                b = layer.mlp.gate.e_score_correction_bias
                b.copy_(bias[0] + bias[1] * torch.randn(b.shape, generator=gen))
    if os.path.exists(folder):
        shutil.rmtree(folder)
    model.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    if hub:
        raw = json.load(open(path))
        json.dump(hub_style(raw), open(path, "w"), indent=2)
    model = load(kind, folder)
    for key, value in kwargs.items():  # the reloaded config is the one meant (Hub keys parsed as intended)
        got = getattr(model.config, key)
        if key == "rope_parameters":
            got = {k: v for k, v in got.items() if k in value}
        assert got == value, (name, key, got, value)
    refs, info = references(model, kind)
    os.makedirs(os.path.join(folder, "reference"), exist_ok=True)
    for key, arr in refs.items():
        np.save(os.path.join(folder, "reference", key + ".npy"), arr)
    full = {
        "name": name, "model_class": cls.__name__, "transformers": transformers.__version__,
        "torch": torch.__version__, "seed": seed, "initializer_range": COMMON["initializer_range"],
        "attn_implementation": "eager", "experts_implementation": "eager", "dtype": "float32",
        "prompt_ids": PROMPT, **info, "notes": notes, "hub_style_config": hub,
        "routing_config": {k: getattr(model.config, k) for k in (
            "n_routed_experts", "num_experts_per_tok", "norm_topk_prob", "n_shared_experts", "n_group", "topk_group",
            "routed_scaling_factor", "first_k_dense_replace", "moe_intermediate_size", "intermediate_size",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank",
            "rope_parameters", "attention_bias") + (("topk_method",) if kind == "v2" else ("rope_interleave",))},
        "seconds_total": round(time.time() - t0, 3),
    }
    json.dump(full, open(os.path.join(folder, "reference", "info.json"), "w"), indent=1)
    return full


def check(folder: str) -> None:
    """Recompute an existing folder's references and compare them with its files."""
    info = json.load(open(os.path.join(folder, "reference", "info.json")))
    kind = "v3" if info["model_class"] == "DeepseekV3ForCausalLM" else "v2"
    refs, mine = references(load(kind, folder), kind)
    for key, arr in refs.items():
        want = np.load(os.path.join(folder, "reference", key + ".npy"))
        same = np.array_equal(arr, want) if arr.dtype.kind == "i" else np.allclose(arr, want, atol=1e-5, rtol=0)
        print(f"{key:24s} {'same' if same else 'DIFFERENT'} (max |diff| {np.abs(arr - want).max():.2e})")
    print("greedy_continuation", "same" if mine["greedy_continuation"] == info["greedy_continuation"] else "DIFFERENT")
    print("min_topk_choice_margin_per_moe_layer", mine["min_topk_choice_margin_per_moe_layer"],
          "stored", info["min_topk_choice_margin_per_moe_layer"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", help="fixture root (tests/fixtures/hf_tiny), or the folder to check with --check")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--only", nargs="*", default=None, help="variant names (default: all)")
    args = parser.parse_args(argv)
    if args.check:
        check(args.root)
        return 0
    for name in args.only or VARIANTS:
        for seed in range(1234, 1244):
            info = write_variant(args.root, name, seed)
            router = min(info["min_topk_choice_margin_per_moe_layer"] +
                         [g for g in info["min_group_choice_margin_per_moe_layer"] if g is not None])
            ok = (router > MIN_ROUTER_MARGIN and info["min_greedy_logit_margin"] > MIN_LOGIT_MARGIN
                  and info["cache_vs_nocache_equal"] and info["prefill_routing_equals_prompt_forward"])
            print(f"{name} seed {seed}: router margin {router:.2e}, logit margin "
                  f"{info['min_greedy_logit_margin']:.2e}, cache == no cache {info['cache_vs_nocache_equal']}: "
                  f"{'kept' if ok else 'rejected'}")
            if ok:
                break
        else:
            raise SystemExit(f"{name}: no seed in 1234..1243 gives margins above the limits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
