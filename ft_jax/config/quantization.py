"""``quantization_config`` of config.json: which quantized checkpoints ft_jax reads as stored (:class:`Quantization`).

Supported ``quant_method`` values (transformers' quantizer names):
- "fp8": the block-scaled FP8 of DeepSeek-V3/R1 and the Qwen3 *-FP8 checkpoints (transformers' FineGrainedFP8Config:
  ``fmt`` "e4m3", ``weight_block_size`` [rows, cols], ``activation_scheme`` "dynamic", ``modules_to_not_convert``):
  every converted linear weight is F8_E4M3 ``<name>.weight`` with a ``<name>.weight_scale_inv`` grid.
- "mxfp4": gpt-oss's MXFP4 experts (``*_blocks`` + E8M0 ``*_scales``; transformers' Mxfp4Config).
Any other method (awq, gptq, compressed-tensors, bitsandbytes, ...) is a ConfigError naming it and these two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ft_jax import weight_formats
from ft_jax.config.files import ConfigError

QUANT_METHODS = ("fp8", "mxfp4")


@dataclasses.dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization as stored (MoEConfig.quantization; None for a float checkpoint).

    Attributes:
        method: "fp8" or "mxfp4".
        block: fp8's weight_block_size (rows, cols) sharing one scale, e.g. (128, 128); (1, 32) for mxfp4.
        modules_to_not_convert: module name patterns the checkpoint keeps unquantized (informative: the loader goes by
            each tensor's stored dtype and scale tensor, which these patterns only describe).
    """

    method: str
    block: tuple[int, int]
    modules_to_not_convert: tuple[str, ...] = ()


def read_quantization(raw: dict[str, Any], source: str, family: str) -> Quantization | None:
    """The ``quantization_config`` of a parsed config.json, or None without one.

    Raises:
        ConfigError: not an object; no quant_method, or one other than fp8 / mxfp4 (named, with the supported
            ones); fp8 with fmt other than "e4m3", an activation_scheme other than "dynamic", or a weight_block_size
            that is not two positive integers (null = per-tensor scales is refused too); mxfp4 on a family other than
            gpt-oss; modules_to_not_convert not a list of strings. Messages start with ``source``.
    """
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{source}: field 'quantization_config' should be an object, got {q!r}")
    method = q.get("quant_method")
    if method is None:
        raise ConfigError(f"{source}: quantization_config has no quant_method (an object naming one of "
                          f"{', '.join(QUANT_METHODS)}, or no quantization_config for a float checkpoint)")
    if method not in QUANT_METHODS:
        raise ConfigError(f"{source}: quantization_config quant_method {method!r} is not implemented (supported: "
                          f"{', '.join(QUANT_METHODS)}: FP8 block-scaled and MXFP4 checkpoints, kept as stored; "
                          "float checkpoints can be quantized while loading with quantize='q8_0' | 'q4_0' (--quantize q8_0|q4_0))")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"{source}: quantization_config.modules_to_not_convert should be a list of module names, "
                          f"got {skip!r}")
    if method == "mxfp4":
        if family != "gpt_oss":
            raise ConfigError(f"{source}: quantization_config quant_method 'mxfp4' is implemented for gpt-oss "
                              f"(GptOssForCausalLM) experts only, got family {family}")
        return Quantization("mxfp4", (1, 32), tuple(skip))
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: quantization_config.fmt {fmt!r} is not implemented (supported: 'e4m3', "
                          "float8_e4m3fn weights)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{source}: quantization_config.activation_scheme {scheme!r} is not implemented "
                          "(supported: 'dynamic'; ft_jax keeps float activations)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ConfigError(f"{source}: quantization_config.weight_block_size should be [rows, cols], two positive "
                          f"integers (block-scaled FP8), got {block!r}")
    return Quantization("fp8", (block[0], block[1]), tuple(skip))


# Dense 2-D weights --quantize leaves as stored. As llama-quantize: the routers (its ffn_gate_inp; Qwen2-MoE's one-row
# shared_expert_gate is a router-like gate, kept too). Unlike its --pure, the token embedding stays as stored (the
# step gathers rows of it, no GEMV reads it; with tied embeddings lm_head is that table, so it stays too). Norms,
# biases and the other 1-D tensors are never quantized.
ROUTER_SUFFIXES = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight",
                   ".mlp.shared_expert_gate.weight")
EMBEDDING = "model.embed_tokens.weight"


def quantize_applies(name: str, shape: tuple[int, ...]) -> bool:
    """Whether --quantize makes the dense tensor ``name`` (Hugging Face name, stored shape) q8_0 / q4_0: every 2-D
    projection weight (``*.weight``), lm_head included, but the routers and the embedding table (ROUTER_SUFFIXES,
    EMBEDDING)."""
    return (len(shape) == 2 and name.endswith(".weight") and name != EMBEDDING
            and not name.endswith(ROUTER_SUFFIXES))


def expert_format(cfg, expert_dtype, quantize: str | None = None) -> weight_formats.WeightFormat:
    """The weight format of a checkpoint's expert banks: the checkpoint's own (fp8 with its weight_block_size,
    gpt-oss's mxfp4), else ``quantize`` (q8_0 / q4_0, made while loading), else the float format of ``expert_dtype``
    (float32 or bfloat16).

    Args:
        cfg: MoEConfig (its quantization). expert_dtype: the float bank dtype. quantize: None, "q8_0" or "q4_0" (any
            case, as --quantize: weight_formats.quantize_choice).
    Raises:
        TypeError: ``quantize`` neither a str nor None.
        ValueError: ``quantize`` a str other than q8_0 / q4_0; an expert_dtype other than float32 / bfloat16.
        ConfigError: ``quantize`` given for a checkpoint that is already quantized (fp8 / mxfp4: used as stored); the
            message names the argument and the flag ("quantize='q8_0' (--quantize q8_0): ...").
    """
    quantize = weight_formats.quantize_choice(quantize)
    q = cfg.quantization
    if quantize is not None and q is not None:
        raise ConfigError(f"quantize={quantize!r} (--quantize {quantize}): this {cfg.architecture} checkpoint is "
                          f"already quantized ({q.method}, quantization_config of config.json) and is used as stored; "
                          "quantizing while loading makes q8_0 / q4_0 from a float (bf16 / f32) checkpoint only")
    if quantize is not None:
        return weight_formats.by_name(quantize)
    if q is not None:
        return weight_formats.fp8(q.block) if q.method == "fp8" else weight_formats.MXFP4
    return weight_formats.float_format(np.dtype(expert_dtype))
