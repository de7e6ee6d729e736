#!/usr/bin/env python3
"""Write a synthetic (random-weight) Mixtral-shaped Hugging Face checkpoint folder: config.json + safetensors.

    python3 scripts/synthetic_checkpoint.py /tmp/mixtral_8l                      # the bench_peer default model
    python3 scripts/synthetic_checkpoint.py /tmp/mixtral_32l --layers 32        # a deeper one (compile benchmarks)
    python3 scripts/synthetic_checkpoint.py /tmp/tiny --hidden 64 --intermediate 96 --layers 2 --heads 4 \\
        --kv-heads 2 --head-dim 16 --vocab 256 --max-shard-bytes 200000    # tiny, sharded

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
(at most --block-bytes of float32 in memory), so the peak memory is small whatever the model size.

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

BF16 = np.dtype(ml_dtypes.bfloat16)

DEFAULTS = dict(hidden=2048, intermediate=5632, layers=8, experts=8, top_k=2, heads=16, kv_heads=4, head_dim=128,
                vocab=32000, rope_theta=1e6, max_positions=4096, rms_norm_eps=1e-5)


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


def _shards(specs, max_shard_bytes: int | None) -> list[list[tuple]]:
    """Specs grouped into consecutive shards of at most max_shard_bytes (a tensor larger than that gets its own)."""
    if not max_shard_bytes:
        return [specs]
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * BF16.itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    return shards + [current]


def _write_safetensors(path: Path, specs, rng: np.random.Generator, std: float, block_bytes: int) -> int:
    """Write one bf16 safetensors file of ``specs``, generating each tensor a block of rows at a time.
    Returns the file size in bytes."""
    header, offset = {}, 0
    for name, shape, _ in specs:
        nbytes = math.prod(shape) * BF16.itemsize
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
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
    """Write config.json and the bf16 safetensors file(s) of ``config`` (from :func:`mixtral_config`) into out_dir.

    Args:
        out_dir: folder to create or overwrite files in.
        config: config.json dict; its shapes decide the tensors (:func:`tensor_specs`).
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
    specs = tensor_specs(config)
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
        data_bytes = sum(math.prod(s[1]) * BF16.itemsize for s in specs)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": data_bytes}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"dir": str(out), "files": names, "bytes": total, "num_tensors": len(specs),
            "seconds": round(time.perf_counter() - t0, 2)}


def weight_bytes_per_token(config: dict, dtype_bytes: int = 2) -> dict:
    """Weight bytes one decoded token reads (every weight used once per token), by part, from config.json.

    Per layer: q/k/v/o projections (NH*D*H + 2*KVH*D*H + H*NH*D), the router (E*H), 2 RMSNorms (2H) and top_k
    experts of 3*I*H each; plus lm_head (V*H) and the final norm (H). The embedding row (H) is counted too; the KV
    cache is not (it is activations, not weights). All in ``dtype_bytes`` per element (2 = bf16).
    Returns {"attention", "router", "norms", "experts", "embedding_row", "lm_head", "total"} in bytes."""
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    NH, KVH = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or H // NH
    L, E, k = config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"]
    parts = {"attention": L * (2 * NH * D * H + 2 * KVH * D * H), "router": L * E * H, "norms": (2 * L + 1) * H,
             "experts": L * k * 3 * I * H, "embedding_row": H, "lm_head": V * H}
    parts = {key: n * dtype_bytes for key, n in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model-shape flags (--hidden ... --std), shared with scripts/bench_peer.py."""
    d = DEFAULTS
    p.add_argument("--hidden", type=int, default=d["hidden"], help="hidden_size H (default %(default)s)")
    p.add_argument("--intermediate", type=int, default=d["intermediate"],
                   help="expert intermediate_size I (default %(default)s)")
    p.add_argument("--layers", type=int, default=d["layers"], help="num_hidden_layers (default %(default)s)")
    p.add_argument("--experts", type=int, default=d["experts"], help="num_local_experts E (default %(default)s)")
    p.add_argument("--top-k", type=int, default=d["top_k"], help="num_experts_per_tok (default %(default)s)")
    p.add_argument("--heads", type=int, default=d["heads"], help="num_attention_heads (default %(default)s)")
    p.add_argument("--kv-heads", type=int, default=d["kv_heads"], help="num_key_value_heads (default %(default)s)")
    p.add_argument("--head-dim", type=int, default=d["head_dim"], help="head_dim D (default %(default)s)")
    p.add_argument("--vocab", type=int, default=d["vocab"], help="vocab_size (default %(default)s)")
    p.add_argument("--rope-theta", type=float, default=d["rope_theta"], help="rope_theta (default %(default)g)")
    p.add_argument("--max-positions", type=int, default=d["max_positions"],
                   help="max_position_embeddings (default %(default)s)")
    p.add_argument("--rms-norm-eps", type=float, default=d["rms_norm_eps"], help="rms_norm_eps (default %(default)g)")
    p.add_argument("--std", type=float, default=0.02, help="weight std, written as initializer_range (default 0.02)")


def config_from_args(args: argparse.Namespace) -> dict:
    """mixtral_config(...) from the flags of :func:`add_model_arguments`. Raises ValueError (bad size)."""
    return mixtral_config(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                          experts=args.experts, top_k=args.top_k, heads=args.heads, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, vocab=args.vocab, rope_theta=args.rope_theta,
                          max_positions=args.max_positions, rms_norm_eps=args.rms_norm_eps, std=args.std)


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
