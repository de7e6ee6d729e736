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
        ConfigError: not an object; a quant_method other than fp8 / mxfp4 (named, with the supported ones); fp8 with
            fmt other than "e4m3", an activation_scheme other than "dynamic", or a weight_block_size that is not two
            positive integers (null = per-tensor scales is refused too); mxfp4 on a family other than gpt-oss;
            modules_to_not_convert not a list of strings. Messages start with ``source``.
    """
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"{source}: field 'quantization_config' should be an object, got {q!r}")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"{source}: quantization_config quant_method {method!r} is not implemented (supported: "
                          f"{', '.join(QUANT_METHODS)}: FP8 block-scaled and MXFP4 checkpoints, kept as stored; "
                          "float checkpoints can be quantized while loading with --quantize q8_0|q4_0)")
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
