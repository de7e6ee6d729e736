#!/usr/bin/env python3
"""Write a synthetic (random-weight) Mixtral- or gpt-oss-shaped Hugging Face checkpoint folder: config.json +
safetensors.

    python3 scripts/synthetic_checkpoint.py /tmp/mixtral_8l                      # the bench_peer default model
    python3 scripts/synthetic_checkpoint.py /tmp/mixtral_32l --layers 32        # a deeper one (compile benchmarks)
    python3 scripts/synthetic_checkpoint.py /tmp/tiny --hidden 64 --intermediate 96 --layers 2 --heads 4 \\
        --kv-heads 2 --head-dim 16 --vocab 256 --max-shard-bytes 200000    # tiny, sharded
    python3 scripts/synthetic_checkpoint.py /tmp/gpt_oss_tiny --family gpt_oss  # tiny gpt-oss with MXFP4 experts
    python3 scripts/synthetic_checkpoint.py /tmp/gpt_oss_20b --family gpt_oss --preset gpt-oss-20b  # ~13.8 GB

Defaults: MixtralForCausalLM, hidden 2048, intermediate 5632, 8 layers, 8 experts top-2, 16 query / 4 KV heads of
head_dim 128, vocab 32000, bf16, rope_theta 1e6; about 1.41 GB of weights read per decoded token, 4.86 GB on disk.

The folder has what a Hub Mixtral checkpoint has: config.json with the Hub keys (architectures, hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, num_local_experts,
num_experts_per_tok, vocab_size, rms_norm_eps, rope_theta, torch_dtype "bfloat16", max_position_embeddings,
tie_word_embeddings false, ...) and Hub tensor names (model.embed_tokens.weight,
model.layers.N.self_attn.{q,k,v,o}_proj.weight, model.layers.N.{input,post_attention}_layernorm.weight,
model.layers.N.block_sparse_moe.gate.weight, model.layers.N.block_sparse_moe.experts.E.{w1,w2,w3}.weight,
model.norm.weight, lm_head.weight), in ``model.safetensors`` or, with --max-shard-bytes, in
``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.

Weights: projections, router and embeddings are N(0, std^2) (default std 0.02, transformers' initializer_range),
RMSNorm weights are 1 (transformers' init); all bf16. Tensors are generated and written a block of rows at a time
(at most 64 MiB of float32 in memory), so the peak memory is small whatever the model size.

gpt-oss (--family gpt_oss): GptOssForCausalLM as openai/gpt-oss-20b stores it on the Hub: config.json with its keys
(layer_types alternating sliding_attention / full_attention from layer 0, sliding_window, attention_bias true,
swiglu_limit 7, rope_scaling yarn factor 32 over 4096 positions, rope_theta 150000, experts_per_token and
quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]}) and its tensors: bf16
model.layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks [NH], mlp.router.{weight [E, H], bias [E]},
mlp.experts.gate_up_proj_bias [E, 2I], mlp.experts.down_proj_bias [E, H], norms, embeddings, lm_head; the experts
in MXFP4 (OCP MX: FP4 E2M1 codes, one E8M0 scale per 32 elements) as uint8 mlp.experts.gate_up_proj_blocks
[E, 2I, H/32, 16] + gate_up_proj_scales [E, 2I, H/32] and down_proj_blocks [E, H, I/32, 16] + down_proj_scales
[E, H, I/32] (rows = output features; byte j of a block holds element 2j in its low nibble, 2j+1 in its high one;
the gate_up rows interleave gate and up: row 2i is gate row i, row 2i+1 up row i, as the bias columns).
Its random MXFP4 experts: uniformly random codes (every byte) and scales drawn from {s0-1, s0, s0+1} where
2^(s0-127) * 2.93 (the RMS of the 16 FP4 values) is about std; the rest as for Mixtral, sinks and biases N(0, std^2).
Presets: --preset gpt-oss-20b (24 layers, 32 experts top-4, hidden 2880, intermediate 2880, 64 query / 8 KV heads
of 64, vocab 201088, sliding window 128; 13.8 GB); without a preset --family gpt_oss is a tiny test model
(GPT_OSS_TINY).

Safetensors layout (github.com/huggingface/safetensors): u64 little-endian header length N, N bytes of JSON
header (padded with spaces to a multiple of 8), then the data section in header order.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from ft_jax import weight_formats

BF16 = np.dtype(ml_dtypes.bfloat16)
U8 = np.dtype(np.uint8)
FP4_RMS = float(np.sqrt(np.mean(weight_formats.FP4_E2M1.astype(np.float64) ** 2)))  # 2.93: RMS of the 16 codes

DEFAULTS = dict(hidden=2048, intermediate=5632, layers=8, experts=8, top_k=2, heads=16, kv_heads=4, head_dim=128,
                vocab=32000, rope_theta=1e6, max_positions=4096, rms_norm_eps=1e-5)
# gpt-oss shapes: openai/gpt-oss-20b's config.json, and a tiny one for tests (vocab >= 259 for llama.cpp's SPM
# placeholder vocabulary of the GGUF writers).
GPT_OSS_20B = dict(hidden=2880, intermediate=2880, layers=24, experts=32, top_k=4, heads=64, kv_heads=8, head_dim=64,
                   vocab=201088, sliding_window=128, rope_theta=150000.0, max_positions=131072, rms_norm_eps=1e-5)
GPT_OSS_TINY = dict(hidden=64, intermediate=64, layers=2, experts=4, top_k=2, heads=4, kv_heads=2, head_dim=16,
                    vocab=300, sliding_window=8, rope_theta=150000.0, max_positions=131072, rms_norm_eps=1e-5)
PRESETS = {"gpt-oss-20b": ("gpt_oss", GPT_OSS_20B)}
FAMILY_DEFAULTS = {"mixtral": DEFAULTS, "gpt_oss": GPT_OSS_TINY}
# gpt-oss-20b's quantization_config: what stays bf16 (everything but the experts).
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def mixtral_config(hidden: int = 2048, intermediate: int = 5632, layers: int = 8, experts: int = 8, top_k: int = 2,
                   heads: int = 16, kv_heads: int = 4, head_dim: int = 128, vocab: int = 32000,
                   rope_theta: float = 1e6, max_positions: int = 4096, rms_norm_eps: float = 1e-5,
                   std: float = 0.02) -> dict:
    """config.json content (dict) of a Hub-style MixtralForCausalLM checkpoint with these dimensions.

    Raises ValueError naming the field when a size is < 1, kv_heads does not divide heads, or top_k is not in
    [1, experts]."""
    sizes = dict(hidden=hidden, intermediate=intermediate, layers=layers, experts=experts, top_k=top_k, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, vocab=vocab, max_positions=max_positions)
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} must divide heads {heads}")
    if top_k > experts:
        raise ValueError(f"top_k {top_k} must be in [1, experts={experts}]")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "vocab_size": vocab,
        "rms_norm_eps": rms_norm_eps, "rope_theta": float(rope_theta), "max_position_embeddings": max_positions,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": None,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": std, "attention_dropout": 0.0,
        "output_router_logits": False, "router_aux_loss_coef": 0.02, "use_cache": True,
    }


def tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(Hub tensor name, shape, kind "normal" | "ones") of every tensor of a Mixtral checkpoint, in Hub order.

    Shapes: embed_tokens / lm_head [V, H]; q_proj [NH*D, H]; k_proj, v_proj [KVH*D, H]; o_proj [H, NH*D];
    norms [H]; router (block_sparse_moe.gate) [E, H]; w1 (gate), w3 (up) [I, H]; w2 (down) [H, I]."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    NH, KVH, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E = config["num_local_experts"]
    specs = [("model.embed_tokens.weight", (V, H), "normal")]
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}"
        specs += [(f"{p}.input_layernorm.weight", (H,), "ones")]
        specs += [(f"{p}.self_attn.{n}_proj.weight", shape, "normal")
                  for n, shape in (("q", (NH * D, H)), ("k", (KVH * D, H)), ("v", (KVH * D, H)), ("o", (H, NH * D)))]
        specs += [(f"{p}.post_attention_layernorm.weight", (H,), "ones"),
                  (f"{p}.block_sparse_moe.gate.weight", (E, H), "normal")]
        for e in range(E):
            specs += [(f"{p}.block_sparse_moe.experts.{e}.{w}.weight", shape, "normal")
                      for w, shape in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H)))]
    specs += [("model.norm.weight", (H,), "ones"), ("lm_head.weight", (V, H), "normal")]
    return specs


def _check_sizes(**sizes) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")


def gpt_oss_config(hidden: int = 64, intermediate: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
                   heads: int = 4, kv_heads: int = 2, head_dim: int = 16, vocab: int = 300, sliding_window: int = 8,
                   rope_theta: float = 150000.0, max_positions: int = 131072, rms_norm_eps: float = 1e-5,
                   std: float = 0.02) -> dict:
    """config.json content (dict) of a Hub-style GptOssForCausalLM checkpoint with MXFP4 experts (the keys of
    openai/gpt-oss-20b's config.json; GPT_OSS_20B gives its sizes).

    Raises ValueError naming the field when a size is < 1, kv_heads does not divide heads, top_k is not in
    [1, experts], head_dim is odd, or hidden / intermediate is not a multiple of the MXFP4 block (32)."""
    _check_sizes(hidden=hidden, intermediate=intermediate, layers=layers, experts=experts, top_k=top_k, heads=heads,
                 kv_heads=kv_heads, head_dim=head_dim, vocab=vocab, sliding_window=sliding_window,
                 max_positions=max_positions)
    if heads % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} must divide heads {heads}")
    if top_k > experts:
        raise ValueError(f"top_k {top_k} must be in [1, experts={experts}]")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    for key, value in (("hidden", hidden), ("intermediate", intermediate)):
        if value % weight_formats.QBLOCK:
            raise ValueError(f"{key} {value} must be a multiple of {weight_formats.QBLOCK} (the MXFP4 experts pack "
                             f"rows in blocks of {weight_formats.QBLOCK})")
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "experts_per_token": top_k,
        "vocab_size": vocab, "rms_norm_eps": rms_norm_eps, "rope_theta": float(rope_theta),
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "max_position_embeddings": max_positions, "initial_context_length": 4096, "sliding_window": sliding_window,
        "layer_types": ["sliding_attention" if l % 2 == 0 else "full_attention" for l in range(layers)],
        "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": 7.0, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "initializer_range": std,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "output_router_logits": False,
        "router_aux_loss_coef": 0.9, "use_cache": True,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": list(GPT_OSS_NOT_CONVERTED)},
    }


def gpt_oss_tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(Hub tensor name, shape, kind) of every tensor of a gpt-oss checkpoint with MXFP4 experts, in Hub order.
    kind: "normal" / "ones" (bf16), "mxfp4_blocks" / "mxfp4_scales" (uint8).

    Shapes: embed_tokens / lm_head [V, H]; q_proj [NH*D, H] + bias [NH*D]; k_proj, v_proj [KVH*D, H] + bias;
    o_proj [H, NH*D] + bias [H]; sinks [NH]; router [E, H] + bias [E]; gate_up_proj_blocks [E, 2I, H/32, 16],
    gate_up_proj_scales [E, 2I, H/32], gate_up_proj_bias [E, 2I]; down_proj_blocks [E, H, I/32, 16],
    down_proj_scales [E, H, I/32], down_proj_bias [E, H]; norms [H]."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    NH, KVH, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E, B = config["num_local_experts"], weight_formats.QBLOCK
    specs = [("model.embed_tokens.weight", (V, H), "normal")]
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}"
        specs += [(f"{p}.input_layernorm.weight", (H,), "ones")]
        for n, rows, cols in (("q", NH * D, H), ("k", KVH * D, H), ("v", KVH * D, H), ("o", H, NH * D)):
            specs += [(f"{p}.self_attn.{n}_proj.weight", (rows, cols), "normal"),
                      (f"{p}.self_attn.{n}_proj.bias", (rows,), "normal")]
        specs += [(f"{p}.self_attn.sinks", (NH,), "normal"), (f"{p}.post_attention_layernorm.weight", (H,), "ones"),
                  (f"{p}.mlp.router.weight", (E, H), "normal"), (f"{p}.mlp.router.bias", (E,), "normal")]
        for proj, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
            specs += [(f"{p}.mlp.experts.{proj}_blocks", (E, rows, cols // B, B // 2), "mxfp4_blocks"),
                      (f"{p}.mlp.experts.{proj}_scales", (E, rows, cols // B), "mxfp4_scales"),
                      (f"{p}.mlp.experts.{proj}_bias", (E, rows), "normal")]
    specs += [("model.norm.weight", (H,), "ones"), ("lm_head.weight", (V, H), "normal")]
    return specs


def _specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """tensor_specs or gpt_oss_tensor_specs by config["model_type"]."""
    return gpt_oss_tensor_specs(config) if config.get("model_type") == "gpt_oss" else tensor_specs(config)


def _dtype(kind: str) -> np.dtype:
    return U8 if kind.startswith("mxfp4") else BF16


def _shards(specs, max_shard_bytes: int | None) -> list[list[tuple]]:
    """Specs grouped into consecutive shards of at most max_shard_bytes (a tensor larger than that gets its own)."""
    if not max_shard_bytes:
        return [specs]
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * _dtype(spec[2]).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    return shards + [current]


def _write_safetensors(path: Path, specs, rng: np.random.Generator, std: float, block_bytes: int) -> int:
    """Write one safetensors file of ``specs`` (bf16 and, for MXFP4 kinds, uint8 tensors), generating each tensor
    a block of rows at a time. Returns the file size in bytes."""
    header, offset = {}, 0
    scale0 = 127 + round(math.log2(std / FP4_RMS))  # E8M0 exponent whose 2^(s - 127) * FP4_RMS is about std
    for name, shape, kind in specs:
        nbytes = math.prod(shape) * _dtype(kind).itemsize
        header[name] = {"dtype": "U8" if _dtype(kind) == U8 else "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, kind in specs:
            if kind == "ones":
                np.ones(shape, BF16).tofile(f)
                continue
            if kind.startswith("mxfp4"):
                n = math.prod(shape)
                for start in range(0, n, block_bytes):
                    size = min(block_bytes, n - start)
                    if kind == "mxfp4_blocks":  # u8[size]: two uniformly random FP4 codes per byte
                        rng.integers(0, 256, size, dtype=np.uint8).tofile(f)
                    else:  # u8[size]: E8M0 scales s0 - 1, s0, s0 + 1
                        (rng.integers(-1, 2, size, dtype=np.int16) + scale0).astype(np.uint8).tofile(f)
                continue
            row = math.prod(shape[1:])
            rows_per_block = max(1, block_bytes // (4 * row))
            for r in range(0, shape[0], rows_per_block):
                n = min(rows_per_block, shape[0] - r)
                block = rng.standard_normal((n, row), np.float32)  # f32[n, row]
                block *= std
                block.astype(BF16).tofile(f)
    return os.path.getsize(path)


def write_checkpoint(out_dir: str | os.PathLike, config: dict, seed: int = 0, max_shard_bytes: int | None = None,
                     block_bytes: int = 64 << 20, progress: bool = False) -> dict:
    """Write config.json and the safetensors file(s) of ``config`` (from :func:`mixtral_config` or
    :func:`gpt_oss_config`) into out_dir, one tensor at a time.

    Args:
        out_dir: folder to create or overwrite files in.
        config: config.json dict; its shapes decide the tensors (:func:`tensor_specs`, :func:`gpt_oss_tensor_specs`
            when model_type is gpt_oss).
        seed: numpy Generator seed of the N(0, initializer_range^2) weights.
        max_shard_bytes: split into shards of at most this many bytes (+ model.safetensors.index.json); None:
            one model.safetensors.
        block_bytes: float32 bytes generated at a time (bounds the memory used).
        progress: print one line per file to stderr.
    Returns: {"dir", "files": [names], "bytes": total safetensors bytes, "num_tensors", "seconds"}.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    specs = _specs(config)
    std = float(config.get("initializer_range", 0.02))
    rng = np.random.default_rng(seed)
    shards = _shards(specs, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    total = 0
    for name, shard in zip(names, shards):
        total += _write_safetensors(out / name, shard, rng, std, block_bytes)
        if progress:
            print(f"[synthetic_checkpoint] wrote {out / name} ({total / 1e9:.2f} GB so far, "
                  f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    if len(shards) > 1:
        weight_map = {spec[0]: name for name, shard in zip(names, shards) for spec in shard}
        data_bytes = sum(math.prod(s[1]) * _dtype(s[2]).itemsize for s in specs)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": data_bytes}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"dir": str(out), "files": names, "bytes": total, "num_tensors": len(specs),
            "seconds": round(time.perf_counter() - t0, 2)}


def weight_bytes_per_token(config: dict, fmt: weight_formats.WeightFormat = weight_formats.BF16) -> dict:
    """Weight bytes one decoded token reads (every weight used once per token), by part, from config.json, as
    ft_jax stores them with its projections and experts in ``fmt`` (BF16: the checkpoint as written; Q8_0 / Q4_0:
    ``ft-jax generate --quantize``). A gpt-oss config counts its experts in MXFP4 and the rest in bf16, as stored
    (``fmt`` must be BF16 then: an MXFP4 checkpoint is not quantized again).

    Per layer: q/k/v/o projections ([NH*D, H], 2 x [KVH*D, H], [H, NH*D]) and top_k experts (gate, up [I, H],
    down [H, I]) at ``fmt.nbytes`` (data + scales, weight_formats); the router (E*H) and 2 RMSNorms (2H) in bf16 (kept
    as stored, as llama.cpp keeps ffn_gate_inp and the norms unquantized); gpt-oss's biases (q/k/v/o, router, the
    top_k experts' gate_up and down biases) and sinks [NH] in bf16; plus lm_head [V, H] at ``fmt.nbytes``, the final
    norm (H) and one embedding row (H, bf16: the embedding table stays as stored). The KV cache is not counted
    (activations, not weights).
    Returns {"attention", "router", "norms", "biases", "experts", "embedding_row", "lm_head", "total"} in bytes.
    Raises ValueError when a row length does not fit ``fmt``'s blocks, or for a gpt-oss config with another fmt."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    NH, KVH = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or H // NH
    L, E, k = config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"]
    gpt_oss = config.get("model_type") == "gpt_oss"
    if gpt_oss and fmt != weight_formats.BF16:
        raise ValueError(f"a gpt-oss config is counted as stored (MXFP4 experts, bf16 rest), not in {fmt.name}")
    expert_fmt = weight_formats.MXFP4 if gpt_oss else fmt
    bf16 = weight_formats.BF16.data_dtype.itemsize
    # q/k/v/o biases, sinks, router bias, the top_k experts' gate_up and down biases
    biases = L * (NH * D + 2 * KVH * D + H + NH + E + k * (2 * I + H)) if gpt_oss else 0
    parts = {"attention": L * (fmt.nbytes(NH * D, H) + 2 * fmt.nbytes(KVH * D, H) + fmt.nbytes(H, NH * D)),
             "router": L * E * H * bf16, "norms": (2 * L + 1) * H * bf16, "biases": biases * bf16,
             "experts": L * k * (2 * expert_fmt.nbytes(I, H) + expert_fmt.nbytes(H, I)), "embedding_row": H * bf16,
             "lm_head": fmt.nbytes(V, H)}
    parts["total"] = sum(parts.values())
    return parts


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model-shape flags (--family, --preset, --hidden ... --std), shared with scripts/bench_peer.py. A size
    left out comes from the preset, else from the family's defaults (DEFAULTS for mixtral, GPT_OSS_TINY for
    gpt_oss)."""
    d, t = DEFAULTS, GPT_OSS_TINY

    def dflt(key):
        return f"(default: mixtral {d[key]:g}, gpt_oss {t[key]:g})"

    p.add_argument("--family", choices=tuple(FAMILY_DEFAULTS), default=None,
                   help="model family (default: the preset's, else mixtral)")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="a released model's shape (gpt-oss-20b: 24 layers, 32 experts top-4, hidden 2880, ...)")
    p.add_argument("--hidden", type=int, default=None, help=f"hidden_size H {dflt('hidden')}")
    p.add_argument("--intermediate", type=int, default=None, help=f"expert intermediate_size I {dflt('intermediate')}")
    p.add_argument("--layers", type=int, default=None, help=f"num_hidden_layers {dflt('layers')}")
    p.add_argument("--experts", type=int, default=None, help=f"num_local_experts E {dflt('experts')}")
    p.add_argument("--top-k", type=int, default=None, help=f"num_experts_per_tok {dflt('top_k')}")
    p.add_argument("--heads", type=int, default=None, help=f"num_attention_heads {dflt('heads')}")
    p.add_argument("--kv-heads", type=int, default=None, help=f"num_key_value_heads {dflt('kv_heads')}")
    p.add_argument("--head-dim", type=int, default=None, help=f"head_dim D {dflt('head_dim')}")
    p.add_argument("--vocab", type=int, default=None, help=f"vocab_size {dflt('vocab')}")
    p.add_argument("--sliding-window", type=int, default=None,
                   help=f"gpt_oss only: sliding_window of the sliding layers (default: gpt_oss {t['sliding_window']})")
    p.add_argument("--rope-theta", type=float, default=None, help=f"rope_theta {dflt('rope_theta')}")
    p.add_argument("--max-positions", type=int, default=None,
                   help=f"max_position_embeddings {dflt('max_positions')}")
    p.add_argument("--rms-norm-eps", type=float, default=None, help=f"rms_norm_eps {dflt('rms_norm_eps')}")
    p.add_argument("--std", type=float, default=0.02, help="weight std, written as initializer_range (default 0.02)")


def config_from_args(args: argparse.Namespace) -> dict:
    """mixtral_config(...) or gpt_oss_config(...) from the flags of :func:`add_model_arguments`.
    Raises ValueError (bad size, a preset of another family, --sliding-window for mixtral)."""
    family, sizes = args.family, None
    if args.preset is not None:
        preset_family, sizes = PRESETS[args.preset]
        if family not in (None, preset_family):
            raise ValueError(f"--preset {args.preset} is a {preset_family} model, not --family {family}")
        family = preset_family
    family = family or "mixtral"
    base = dict(sizes or FAMILY_DEFAULTS[family])
    keys = ("hidden", "intermediate", "layers", "experts", "top_k", "heads", "kv_heads", "head_dim", "vocab",
            "rope_theta", "max_positions", "rms_norm_eps") + (("sliding_window",) if family == "gpt_oss" else ())
    if family != "gpt_oss" and args.sliding_window is not None:
        raise ValueError("--sliding-window applies to --family gpt_oss only")
    values = {k: base[k] if getattr(args, k) is None else getattr(args, k) for k in keys}
    make = gpt_oss_config if family == "gpt_oss" else mixtral_config
    return make(**values, std=args.std)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder to write (created if missing; existing model files are replaced)")
    add_model_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    p.add_argument("--max-shard-bytes", type=int, default=None,
                   help="write shards of at most this many bytes plus model.safetensors.index.json "
                        "(default: one model.safetensors)")
    args = p.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    info = write_checkpoint(args.out_dir, config, seed=args.seed, max_shard_bytes=args.max_shard_bytes,
                            progress=True)
    info["weight_bytes_per_token"] = weight_bytes_per_token(config)["total"]
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
