"""Entry points: :func:`load_config` (a model folder's config.json + generation_config.json ids),
:func:`config_from_dict` (an already-parsed config.json) and :func:`read_special_ids` (BOS/EOS ids)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ft_jax.config.families import BUILDERS, ROPE_DEFAULTS
from ft_jax.config.fields import Fields, architecture, bos_id, common_fields, eos_ids
from ft_jax.config.files import (CONFIG_FILE, GENERATION_CONFIG_FILE, ConfigError, check_model_dir, file_present,
                                 read_json_file)
from ft_jax.config.record import MoEConfig


def load_config(model_dir: str | os.PathLike) -> MoEConfig:
    """Read ``<model_dir>/config.json`` (and the BOS/EOS ids of ``generation_config.json``) into a :class:`MoEConfig`.

    Raises:
        ConfigError: model_dir does not exist, is a file or cannot be accessed (permission denied, symbolic link
            loop: the cause is named); no config.json; config.json or generation_config.json unreadable, not a
            regular file, not UTF-8 or not valid JSON; unsupported architecture (message lists the supported ones),
            a missing required field (message names it), a field of the wrong type, or an out-of-range value (a
            size or count < 1, num_key_value_heads not dividing num_attention_heads, num_experts_per_tok outside
            [1, number of experts], no MoE layer, ...), or RoPE keys that disagree (rope_scaling beside
            rope_parameters with another type or value, rope_theta beside rope_parameters.rope_theta: both named).
            Every message is one line "<path>: <field> ..., got <value>".
        NotImplementedError: a RoPE scaling type other than "default" and "yarn", partial rotary embeddings,
            Qwen sliding-window attention, or an activation other than silu / gelu_pytorch_tanh (names the file).
        A quantization_config other than fp8 (block scales) and mxfp4 (gpt-oss) is a ConfigError naming the method
        and the supported ones (ft_jax.config.quantization).
    """
    model_dir = os.fspath(model_dir)
    check_model_dir(model_dir)
    path = os.path.join(model_dir, CONFIG_FILE)
    if not file_present(path, "config.json"):
        raise ConfigError(f"no config.json in {model_dir}: not a Hugging Face model folder")
    raw = read_json_file(path, "config.json")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    cfg = config_from_dict(raw, source=path)
    bos, eos = read_special_ids(model_dir, config=raw)
    outside = [i for i in (bos, *eos) if i is not None and i >= cfg.vocab_size]
    if outside:  # an EOS id the model can never produce would never end a row
        raise ConfigError(f"{model_dir}: special token id {outside[0]} (bos_token_id / eos_token_id of config.json or "
                          f"generation_config.json) is outside the vocabulary [0, {cfg.vocab_size})")
    return dataclasses.replace(cfg, bos_token_id=bos, eos_token_ids=eos)



def read_special_ids(model_dir: str | os.PathLike, config: dict | None = None) -> tuple[int | None, tuple[int, ...]]:
    """BOS id and every EOS id of a model folder.

    config.json's ``bos_token_id`` / ``eos_token_id``, each replaced by generation_config.json's when that file
    has the key (an explicit null there means "none"), as transformers' ``generate`` takes them from the
    generation config. Only these two keys are read: the folder need not hold a complete model config.

    Args:
        model_dir: model folder. config: config.json already parsed (read from the folder when None; an absent
            config.json counts as empty).
    Returns:
        (bos_token_id or None, eos_token_ids: tuple of ints in file order, empty when there is no EOS).
    Raises:
        ConfigError: a file that cannot be read or parsed (see :func:`read_json_file`); an id field that is not a
            non-negative int (or, for EOS, a list of them). Messages name the file.
    """
    model_dir = os.fspath(model_dir)
    sources = []
    cfg_path = os.path.join(model_dir, CONFIG_FILE)
    if config is not None:
        sources.append((cfg_path, config))
    elif file_present(cfg_path, "config.json"):
        sources.append((cfg_path, read_json_file(cfg_path, "config.json")))
    gen_path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if file_present(gen_path, "generation_config.json"):
        sources.append((gen_path, read_json_file(gen_path, "generation_config.json")))
    bos, eos = None, ()
    for path, data in sources:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
        if "bos_token_id" in data:
            bos = bos_id(data["bos_token_id"], path)
        if "eos_token_id" in data:
            eos = eos_ids(data["eos_token_id"], path)
    return bos, eos



def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> MoEConfig:
    """Build a :class:`MoEConfig` from an already-parsed config.json dict (see :func:`load_config`; this reads
    no generation_config.json, so BOS/EOS ids are config.json's): the fields every family shares, then the
    family's builder (ft_jax/config/families.py).

    ``source`` is only used in error messages. Raises ConfigError / NotImplementedError as load_config."""
    f = Fields(raw, source)
    arch, family = architecture(f)
    rope_raw = ROPE_DEFAULTS[family](raw) if family in ROPE_DEFAULTS else raw
    return BUILDERS[family](f, common_fields(f, arch, family, rope_raw))
