#!/usr/bin/env python3
"""Convert a bf16 Mixtral Hugging Face folder (config.json + safetensors) to a bf16 GGUF file for llama.cpp.

    python3 scripts/mixtral_to_gguf.py /tmp/mixtral_8l /tmp/mixtral_8l/model-bf16.gguf

Needs the ``gguf`` package (``pip install gguf``; llama.cpp's own Python writer). llama.cpp's
convert_hf_to_gguf.py needs torch, so this mirrors what it does for MixtralForCausalLM (llama.cpp
conversion/llama.py LlamaModel and conversion/base.py TextModel, as vendored in llama-cpp-python 0.3.36):

  * architecture "llama"; metadata llama.{block_count, context_length, embedding_length, feed_forward_length,
    attention.head_count, attention.head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon, expert_count,
    expert_used_count, attention.key_length, attention.value_length, vocab_size, rope.dimension_count},
    general.file_type MOSTLY_BF16, general.quantization_version;
  * q_proj and k_proj rows permuted (:func:`llama_permute`) so that llama.cpp's RoPE, which rotates adjacent pairs
    (2i, 2i+1), matches Hugging Face's rotate_half RoPE, which rotates (i, i + D/2);
  * the experts of a layer merged into blk.N.ffn_gate_exps (w1) / ffn_up_exps (w3) [E, I, H] and ffn_down_exps (w2)
    [E, H, I] (numpy order; GGUF stores the dims reversed);
  * tensor names from gguf's TensorNameMap for MODEL_ARCH.LLAMA (token_embd, blk.N.attn_{q,k,v,output,norm},
    blk.N.ffn_norm, blk.N.ffn_gate_inp, output_norm, output);
  * 1-D tensors, *_norm.weight and the router (ffn_gate_inp) in f32; every other weight bf16 (bytes unchanged from
    the bf16 checkpoint: the converter's f32 -> bf16 rounding of a bf16 value is exact).

The tokenizer is a dummy SentencePiece ("llama") vocabulary of vocab_size tokens: <unk>, <s>, </s>, the 256 byte
tokens <0x00>..<0xFF> that llama.cpp's SPM loader requires, then "▁t{i}" pieces; bos 1, eos 2, unk 0. It exists so
llama.cpp loads the model; the benchmark feeds token ids, not text.

Writing streams: tensor infos first, then one tensor at a time (the largest in memory at once is one merged expert
tensor, E*I*H*2 bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
NUM_SPECIAL = 3  # <unk>, <s>, </s>
MIN_VOCAB = NUM_SPECIAL + 256


def llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (conversion/llama.py) in numpy: reorder the rows of a q/k projection.

    weights: [n * D, ...] (q_proj [NH*D, H] with n_head=NH; k_proj [KVH*D, H] with n_head_kv=KVH). Within each
    head the rows go from Hugging Face's half-split order (0, 1, ..., D/2-1 | D/2, ..., D-1) to interleaved pairs
    (0, D/2, 1, D/2+1, ...): new row j*2 + s of a head is old row s*D/2 + j. Returns a new array, same shape/dtype.
    Raises ValueError when the rows are not a multiple of 2 * heads."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    if weights.shape[0] % (2 * n_head):
        raise ValueError(f"llama_permute: {weights.shape[0]} rows is not a multiple of 2 * {n_head} heads")
    return np.ascontiguousarray(
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])  # [n, 2, D/2, ...]
        .swapaxes(1, 2)                                                                  # [n, D/2, 2, ...]
        .reshape(weights.shape))


def dummy_spm_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a placeholder SentencePiece vocabulary of vocab_size entries.

    Types are gguf.TokenType values: UNKNOWN 2, CONTROL 3, BYTE 6, NORMAL 1. Raises ValueError when vocab_size is
    below the 259 entries (3 special + 256 byte tokens) llama.cpp's SPM loader needs."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is too small for a llama.cpp SPM vocabulary "
                         f"(needs >= {MIN_VOCAB}: <unk>, <s>, </s> and 256 byte tokens)")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"\u2581t{i}" for i in range(len(tokens), vocab_size)]
    types += [1] * (vocab_size - len(types))
    scores = [0.0] * MIN_VOCAB + [-float(i) for i in range(vocab_size - MIN_VOCAB)]
    return tokens, scores, types


def add_spm_vocab(w, vocab: tuple[list[str], list[float], list[int]]) -> None:
    """Writes a dummy_spm_vocab (tokens, scores, types) to the GGUFWriter w as llama.cpp's SPM ("llama") tokenizer
    metadata: unk 0, bos 1, eos 2, a BOS added to prompts."""
    tokens, scores, types = vocab
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)


def gguf_tensor_plan(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, "bf16" | "f32", numpy shape) of every tensor the GGUF gets, in write order.

    Raises ValueError if config is not a MixtralForCausalLM config or an HF name has no llama mapping."""
    import gguf

    arch = (config.get("architectures") or [None])[0]
    if arch != "MixtralForCausalLM":
        raise ValueError(f"config.json architectures[0] must be MixtralForCausalLM, got {arch!r}")
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    NH, KVH = config["num_attention_heads"], config["num_key_value_heads"]
    D = config.get("head_dim") or H // NH
    L, E = config["num_hidden_layers"], config["num_local_experts"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, L)

    def gname(hf: str) -> str:
        base = hf.removesuffix(".weight")
        new = names.get_name(base)
        if new is None:
            raise ValueError(f"no GGUF llama tensor name for {hf!r}")
        return new + ".weight"

    plan = [(gname("model.embed_tokens.weight"), "bf16", (V, H))]
    for l in range(L):
        p = f"model.layers.{l}"
        plan += [(gname(f"{p}.input_layernorm.weight"), "f32", (H,)),
                 (gname(f"{p}.self_attn.q_proj.weight"), "bf16", (NH * D, H)),
                 (gname(f"{p}.self_attn.k_proj.weight"), "bf16", (KVH * D, H)),
                 (gname(f"{p}.self_attn.v_proj.weight"), "bf16", (KVH * D, H)),
                 (gname(f"{p}.self_attn.o_proj.weight"), "bf16", (H, NH * D)),
                 (gname(f"{p}.post_attention_layernorm.weight"), "f32", (H,)),
                 (gname(f"{p}.block_sparse_moe.gate.weight"), "f32", (E, H)),
                 (gname(f"layers.{l}.feed_forward.experts.w1.weight"), "bf16", (E, I, H)),
                 (gname(f"layers.{l}.feed_forward.experts.w3.weight"), "bf16", (E, I, H)),
                 (gname(f"layers.{l}.feed_forward.experts.w2.weight"), "bf16", (E, H, I))]
    plan += [(gname("model.norm.weight"), "f32", (H,)), (gname("lm_head.weight"), "bf16", (V, H))]
    return plan


def _hf_tensor(ckpt, config: dict, gguf_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The HF tensor(s) behind one GGUF tensor, permuted / merged as convert_hf_to_gguf.py does (stored dtype)."""
    NH, KVH = config["num_attention_heads"], config["num_key_value_heads"]
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return ckpt.read(fixed[gguf_name], shape)
    _, l, part, _ = gguf_name.split(".")
    p = f"model.layers.{l}"
    if part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        w = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}[part]
        first = ckpt.info(f"{p}.block_sparse_moe.experts.0.{w}.weight", shape[1:])
        merged = np.empty(shape, first.dtype)  # [E, I, H] or [E, H, I]
        for e in range(shape[0]):
            ckpt.read_into(f"{p}.block_sparse_moe.experts.{e}.{w}.weight", merged[e])
        return merged
    hf = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate_inp": "block_sparse_moe.gate", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}[part]
    data = ckpt.read(f"{p}.{hf}.weight", shape)
    if part == "attn_q":
        data = llama_permute(data, NH, NH)
    elif part == "attn_k":
        data = llama_permute(data, NH, KVH)
    return data


def write_gguf(model_dir: str | Path, out_path: str | Path, progress: bool = False) -> dict:
    """Write the GGUF of the Mixtral checkpoint in model_dir to out_path (see the module docstring).

    Returns {"path", "bytes", "num_tensors", "seconds", "gguf_version"}.
    Raises: ValueError (not Mixtral, vocab too small), ft_jax.checkpoint.CheckpointError (missing tensor,
    wrong shape), ImportError (no gguf package: ``pip install gguf``)."""
    import gguf

    from ft_jax.checkpoint import SafetensorsCheckpoint

    t0 = time.perf_counter()
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    H, NH = config["hidden_size"], config["num_attention_heads"]
    D = config.get("head_dim") or H // NH
    plan = gguf_tensor_plan(config)
    vocab = dummy_spm_vocab(config["vocab_size"])  # raises before any writing

    tmp = out_path.with_name(out_path.name + ".partial")
    w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    w.add_name("ft_jax synthetic Mixtral")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(NH)
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(float(config["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("head_dim") is not None:
        w.add_key_length(D)
        w.add_value_length(D)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_vocab_size(config["vocab_size"])
    w.add_rope_dimension_count(D)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_spm_vocab(w, vocab)
    qtype = {"bf16": gguf.GGMLQuantizationType.BF16, "f32": gguf.GGMLQuantizationType.F32}
    itemsize = {"bf16": 2, "f32": 4}
    for name, kind, shape in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32) if kind == "f32" else BF16,
                          int(np.prod(shape)) * itemsize[kind], raw_dtype=qtype[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with SafetensorsCheckpoint(model_dir) as ckpt:
        for i, (name, kind, shape) in enumerate(plan):
            data = _hf_tensor(ckpt, config, name, shape)
            if data.dtype != BF16:
                raise ValueError(f"{model_dir}: tensor behind {name} is {data.dtype}, expected bfloat16 weights")
            w.write_tensor_data(data.astype(np.float32) if kind == "f32" else data)
            if progress and (i % 10 == 9 or i == len(plan) - 1):
                print(f"[mixtral_to_gguf] {i + 1}/{len(plan)} tensors, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr, flush=True)
    w.close()
    tmp.replace(out_path)
    return {"path": str(out_path), "bytes": out_path.stat().st_size, "num_tensors": len(plan),
            "seconds": round(time.perf_counter() - t0, 2), "gguf_version": _gguf_version()}


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="bf16 MixtralForCausalLM folder (config.json + safetensors)")
    p.add_argument("out", help="GGUF file to write")
    args = p.parse_args(argv)
    try:
        info = write_gguf(args.model_dir, args.out, progress=True)
    except (ValueError, OSError) as e:  # one line, as gpt_oss_to_gguf.py
        print(f"mixtral_to_gguf: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
