#!/usr/bin/env python3
"""Convert a gpt-oss Hugging Face folder with MXFP4 experts (config.json + safetensors) to a GGUF file for llama.cpp.

    python3 scripts/gpt_oss_to_gguf.py /tmp/gpt_oss_20b /tmp/gpt_oss_20b/model-mxfp4.gguf

Needs the ``gguf`` package (``pip install gguf``). llama.cpp's convert_hf_to_gguf.py needs torch; this mirrors what
it does for GptOssForCausalLM with quant_method mxfp4 (conversion/gpt_oss.py GptOssModel and conversion/base.py
TextModel, as vendored in llama-cpp-python 0.3.36):

  * architecture "gpt-oss"; metadata gpt-oss.{block_count, context_length (max_position_embeddings),
    embedding_length, feed_forward_length (intermediate_size), attention.head_count, attention.head_count_kv,
    rope.scaling.{type yarn, factor, original_context_length, yarn_beta_fast, yarn_beta_slow}, rope.freq_base,
    attention.layer_norm_rms_epsilon, expert_count, expert_used_count, attention.key_length,
    attention.value_length, attention.sliding_window, expert_feed_forward_length}, general.file_type
    MOSTLY_MXFP4_MOE, general.quantization_version;
  * the MXFP4 experts repacked losslessly (only bits move; :func:`repack_mxfp4`) into ggml's block_mxfp4
    (ggml-common.h: one E8M0 byte e, then 16 bytes qs whose byte j holds element j in its low nibble and element
    j + 16 in its high one) from Hugging Face's layout (blocks [..., G, 16] whose byte j holds element 2j low,
    2j + 1 high; scales [..., G]); the 4-bit codes keep their values (ggml's kvalues_mxfp4 are the FP4 E2M1 values
    doubled, read with half the scale: the same products);
  * gate_up_proj split into ffn_gate_exps (rows 0, 2, 4, ... of the interleaved [E, 2I, ...] tensor) and ffn_up_exps
    (rows 1, 3, 5, ...), its bias likewise (gate_up_proj_bias[:, 0::2] / [:, 1::2]); down_proj to ffn_down_exps;
  * tensor names from gguf's TensorNameMap for MODEL_ARCH.GPT_OSS (token_embd, blk.N.attn_{norm,q,k,v,output},
    blk.N.attn_sinks (HF self_attn.sinks), blk.N.post_attention_norm, blk.N.ffn_gate_inp (router),
    blk.N.ffn_{gate,up,down}_exps, output_norm, output), ``.weight`` and ``.bias``;
  * as TextModel.prepare_tensors types them: 1-D tensors, norms, every bias and the router weight (ffn_gate_inp)
    in f32; the other 2-D weights (q/k/v/o, token_embd, output) bf16 as stored.

The tokenizer is the dummy SentencePiece vocabulary of scripts/mixtral_to_gguf.py (gpt-oss's real one is a BPE
o200k vocabulary, which a synthetic checkpoint does not have); it exists so that llama.cpp loads the model.

Writing streams: tensor infos first, then one tensor at a time (the largest in memory at once is one MXFP4
expert tensor of a layer after repacking, E * rows * cols * 17 / 32 bytes, plus one expert's source blocks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from importlib.metadata import version
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mixtral_to_gguf  # noqa: E402  (the placeholder vocabulary)

BF16 = np.dtype(ml_dtypes.bfloat16)
U8 = np.dtype(np.uint8)
QK_MXFP4 = 32  # elements per MXFP4 block (ggml-common.h QK_MXFP4)
BLOCK_BYTES = 1 + QK_MXFP4 // 2  # sizeof(block_mxfp4): the E8M0 scale, then 16 bytes of codes


def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face MXFP4 (blocks u8 [..., G, 16]: byte j = element 2j (low nibble) | element 2j + 1 (high);
    scales u8 [..., G] E8M0) -> ggml block_mxfp4 bytes u8 [..., G * 17] (per block: the scale byte, then byte j =
    element j (low) | element j + 16 (high)). Lossless: the codes and scales are moved, not changed.

    Raises ValueError when the shapes do not match ([..., G, 16] with [..., G])."""
    if blocks.dtype != U8 or scales.dtype != U8 or blocks.shape[-1:] != (QK_MXFP4 // 2,) \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"repack_mxfp4: expected uint8 blocks [..., G, 16] and scales [..., G], got {blocks.dtype} "
                         f"{list(blocks.shape)} and {scales.dtype} {list(scales.shape)}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, QK_MXFP4)  # u8[..., G, 32]
    qs = codes[..., :QK_MXFP4 // 2] | (codes[..., QK_MXFP4 // 2:] << 4)  # u8[..., G, 16]
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)  # u8[..., G * 17]


def _rope(config: dict) -> dict:
    """The rope parameters: rope_parameters (transformers 5) or rope_scaling + rope_theta (the Hub config)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        return params
    return {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta")}


def gguf_tensor_plan(config: dict) -> list[tuple[str, str, tuple[int, ...], tuple]]:
    """(GGUF name, kind, numpy shape as written, source) of every tensor the GGUF gets, in write order.

    kind: "bf16", "f32" or "mxfp4" (shape then is the byte shape [E, rows, G * 17]). source: ("copy", HF name),
    ("even_cols" | "odd_cols", HF name) (a half of the interleaved gate_up bias) or ("mxfp4", blocks name, scales
    name, row slice) (row slice: slice(0, None, 2) gate, slice(1, None, 2) up, slice(None) down).
    Raises ValueError when config is not a GptOssForCausalLM config with quant_method mxfp4, a size does not fit
    the MXFP4 blocks, or a name has no GGUF mapping."""
    import gguf  # optional dependency (``pip install gguf``); imported here so --help works without it

    arch = (config.get("architectures") or [None])[0]
    if arch != "GptOssForCausalLM":
        raise ValueError(f"config.json architectures[0] must be GptOssForCausalLM, got {arch!r}")
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method != "mxfp4":
        raise ValueError(f"config.json quantization_config.quant_method must be 'mxfp4' (experts stored as MXFP4 "
                         f"blocks), got {method!r}")
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    NH, KVH = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or H // NH
    L, E = config["num_hidden_layers"], config["num_local_experts"]
    for key, value in (("hidden_size", H), ("intermediate_size", I)):
        if value % QK_MXFP4:
            raise ValueError(f"config.json {key} {value} is not a multiple of the MXFP4 block size {QK_MXFP4}")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, L)

    def gname(hf_base: str, suffix: str) -> str:
        new = names.get_name(hf_base)
        if new is None:
            raise ValueError(f"no GGUF gpt-oss tensor name for {hf_base!r}")
        return new + suffix

    plan = [(gname("model.embed_tokens", ".weight"), "bf16", (V, H), ("copy", "model.embed_tokens.weight"))]
    for l in range(L):
        p = f"model.layers.{l}"
        x = f"{p}.mlp.experts"
        plan.append((gname(f"{p}.input_layernorm", ".weight"), "f32", (H,), ("copy", f"{p}.input_layernorm.weight")))
        for n, rows, cols in (("q", NH * D, H), ("k", KVH * D, H), ("v", KVH * D, H), ("o", H, NH * D)):
            base = f"{p}.self_attn.{n}_proj"
            plan += [(gname(base, ".weight"), "bf16", (rows, cols), ("copy", f"{base}.weight")),
                     (gname(base, ".bias"), "f32", (rows,), ("copy", f"{base}.bias"))]
        plan += [(gname(f"{p}.self_attn.sinks", ".weight"), "f32", (NH,), ("copy", f"{p}.self_attn.sinks")),
                 (gname(f"{p}.post_attention_layernorm", ".weight"), "f32", (H,),
                  ("copy", f"{p}.post_attention_layernorm.weight")),
                 (gname(f"{p}.mlp.router", ".weight"), "f32", (E, H), ("copy", f"{p}.mlp.router.weight")),
                 (gname(f"{p}.mlp.router", ".bias"), "f32", (E,), ("copy", f"{p}.mlp.router.bias"))]
        gu = ("mxfp4", f"{x}.gate_up_proj_blocks", f"{x}.gate_up_proj_scales")
        plan += [(gname(f"{x}.gate_proj", ".weight"), "mxfp4", (E, I, H // QK_MXFP4 * BLOCK_BYTES),
                  gu + (slice(0, None, 2),)),
                 (gname(f"{x}.up_proj", ".weight"), "mxfp4", (E, I, H // QK_MXFP4 * BLOCK_BYTES),
                  gu + (slice(1, None, 2),)),
                 (gname(f"{x}.down_proj", ".weight"), "mxfp4", (E, H, I // QK_MXFP4 * BLOCK_BYTES),
                  ("mxfp4", f"{x}.down_proj_blocks", f"{x}.down_proj_scales", slice(None))),
                 (gname(f"{x}.gate_proj", ".bias"), "f32", (E, I), ("even_cols", f"{x}.gate_up_proj_bias")),
                 (gname(f"{x}.up_proj", ".bias"), "f32", (E, I), ("odd_cols", f"{x}.gate_up_proj_bias")),
                 (gname(f"{x}.down_proj", ".bias"), "f32", (E, H), ("copy", f"{x}.down_proj_bias"))]
    plan += [(gname("model.norm", ".weight"), "f32", (H,), ("copy", "model.norm.weight")),
             (gname("lm_head", ".weight"), "bf16", (V, H), ("copy", "lm_head.weight"))]
    return plan


def _tensor(ckpt, kind: str, shape: tuple[int, ...], source: tuple) -> np.ndarray:
    """The data of one planned GGUF tensor (bf16 / f32 / repacked MXFP4 bytes), read from the checkpoint."""
    if source[0] == "mxfp4":
        _, blocks_name, scales_name, rows = source
        E, R, G = shape[0], shape[1], shape[2] // BLOCK_BYTES
        src_rows = len(range(*rows.indices(ckpt.info(blocks_name, dtypes=(U8,)).shape[1])))
        if src_rows != R:
            raise ValueError(f"{blocks_name}: rows {rows} give {src_rows} rows, expected {R}")
        out = np.empty(shape, U8)  # u8[E, R, G * 17]
        for e in range(E):  # one expert's source blocks in memory at a time
            blocks = ckpt.read_rows(blocks_name, e, e + 1, (U8,))[0]  # u8[2I or H, G, 16]
            scales = ckpt.read_rows(scales_name, e, e + 1, (U8,))[0]  # u8[2I or H, G]
            if blocks.shape[1:] != (G, QK_MXFP4 // 2) or scales.shape[1:] != (G,):
                raise ValueError(f"{blocks_name} / {scales_name}: blocks {list(blocks.shape)} and scales "
                                 f"{list(scales.shape)} per expert, expected [rows, {G}, 16] and [rows, {G}]")
            out[e] = repack_mxfp4(blocks[rows], scales[rows])
        return out
    name = source[1]
    data = ckpt.read(name)
    if data.dtype != BF16:
        raise ValueError(f"tensor {name!r} is {data.dtype}, expected bfloat16 (as gpt-oss stores its non-expert "
                         "weights)")
    if source[0] == "even_cols":
        data = data[:, 0::2]
    elif source[0] == "odd_cols":
        data = data[:, 1::2]
    if tuple(data.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} ({source[0]}) has shape {list(data.shape)}, expected {list(shape)}")
    return np.ascontiguousarray(data.astype(np.float32) if kind == "f32" else data)


def write_gguf(model_dir: str | Path, out_path: str | Path, progress: bool = False) -> dict:
    """Write the GGUF of the gpt-oss MXFP4 checkpoint in model_dir to out_path (see the module docstring).

    Returns {"path", "bytes", "num_tensors", "seconds", "gguf_version"}.
    Raises: ValueError (not gpt-oss with MXFP4 experts, sizes, dtypes, vocab too small),
    ft_jax.checkpoint.CheckpointError (missing tensor, wrong shape or dtype), ImportError (no gguf package)."""
    import gguf  # optional dependency, as in gguf_tensor_plan

    from ft_jax.checkpoint import SafetensorsCheckpoint

    t0 = time.perf_counter()
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    plan = gguf_tensor_plan(config)
    vocab = mixtral_to_gguf.dummy_spm_vocab(config["vocab_size"])  # raises before any writing
    H, NH = config["hidden_size"], config["num_attention_heads"]
    D = config.get("head_dim") or H // NH
    rope = _rope(config)

    tmp = out_path.with_name(out_path.name + ".partial")
    w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    w.add_name("ft_jax synthetic gpt-oss")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(NH)
    w.add_head_count_kv(config["num_key_value_heads"])
    if rope.get("rope_type") == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_sliding_window(config["sliding_window"])
    w.add_expert_feed_forward_length(config["intermediate_size"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    mixtral_to_gguf.add_spm_vocab(w, vocab)
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "f32": gguf.GGMLQuantizationType.F32,
             "mxfp4": gguf.GGMLQuantizationType.MXFP4}
    np_dtype = {"bf16": BF16, "f32": np.dtype(np.float32), "mxfp4": U8}
    for name, kind, shape, _ in plan:
        # a u8 byte shape with a quantized raw_dtype: GGUFWriter turns it into the element shape
        w.add_tensor_info(name, shape, np_dtype[kind], math.prod(shape) * np_dtype[kind].itemsize,
                          raw_dtype=qtype[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with SafetensorsCheckpoint(model_dir) as ckpt:
        for i, (name, kind, shape, source) in enumerate(plan):
            w.write_tensor_data(_tensor(ckpt, kind, shape, source))
            if progress and (i % 20 == 19 or i == len(plan) - 1):
                print(f"[gpt_oss_to_gguf] {i + 1}/{len(plan)} tensors, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
    w.close()
    tmp.replace(out_path)
    return {"path": str(out_path), "bytes": out_path.stat().st_size, "num_tensors": len(plan),
            "seconds": round(time.perf_counter() - t0, 2), "gguf_version": version("gguf")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="GptOssForCausalLM folder with MXFP4 experts (config.json + safetensors)")
    p.add_argument("out", help="GGUF file to write")
    args = p.parse_args(argv)
    try:
        info = write_gguf(args.model_dir, args.out, progress=True)
    except ValueError as e:
        print(f"gpt_oss_to_gguf: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
