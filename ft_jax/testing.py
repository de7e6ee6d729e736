"""What a test suite needs to test its own use of ft_jax: tiny random checkpoints and an assertion that the offload
policies and cache sizes all decode the same tokens.

    >>> import tempfile
    >>> from ft_jax import testing
    >>> path = testing.write_random_checkpoint(tempfile.mkdtemp(), testing.tiny_config("Qwen3MoeForCausalLM"))
    >>> tokens = testing.assert_policies_agree(path, [1, 2, 3], max_new_tokens=4)
    >>> len(tokens)
    4

The checkpoints are written in the Hugging Face layout ft_jax loads (config.json and a model.safetensors with the
tensor names of the family; the routed experts as the fused ``mlp.experts.gate_up_proj`` / ``down_proj`` tensors
transformers 5 writes, gpt-oss's interleaved form with biases for GptOssForCausalLM), from the parameter list the
model itself asks for, so every supported family can be written. Writing needs the ``safetensors`` package (the
``test`` extra).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ft_jax.checkpoint import load_checkpoint
from ft_jax.config import config_from_dict, load_config
from ft_jax.engine.engine import Engine
from ft_jax.models.decoder import MoETransformer
from ft_jax.offload.cost_model import auto_costs
from ft_jax.offload.policy import PolicyKind, parse_policy
from ft_jax.units import model_dtype

_COMMON = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1,
           "eos_token_id": 2, "tie_word_embeddings": False}
_FAMILIES = {
    "MixtralForCausalLM": {"intermediate_size": 96, "num_local_experts": 8},
    "Qwen2MoeForCausalLM": {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
                            "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "qkv_bias": True,
                            "decoder_sparse_step": 1, "mlp_only_layers": []},
    "Qwen3MoeForCausalLM": {"intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8, "head_dim": 16,
                            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "OlmoeForCausalLM": {"intermediate_size": 32, "num_experts": 8, "norm_topk_prob": False, "clip_qkv": None},
    "DeepseekV2ForCausalLM": {"intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 8,
                              "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                              "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                              "v_head_dim": 16, "num_key_value_heads": 4, "topk_method": "greedy",
                              "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                              "n_group": None, "topk_group": None, "num_hidden_layers": 3},
    "DeepseekV3ForCausalLM": {"intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 8,
                              "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                              "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                              "v_head_dim": 16, "num_key_value_heads": 4, "topk_method": "noaux_tc",
                              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_group": 4, "topk_group": 2,
                              "num_hidden_layers": 3},
    "GptOssForCausalLM": {"intermediate_size": 32, "num_local_experts": 8, "head_dim": 16, "attention_bias": True,
                          "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                          "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
}
DEFAULT_POLICIES = ("resident", "fetch-all", "host-all", "qstar:0.4", "fixed-cap:1", "auto")


def tiny_config(architecture: str = "MixtralForCausalLM", **overrides) -> dict:
    """config.json content of a tiny model (vocab 256, hidden 64, 2-3 layers, 8 experts top-2) of a supported family.

    Args:
        architecture: one of ft_jax.config.SUPPORTED_ARCHITECTURES. overrides: config.json keys to change.
    Raises:
        ValueError: an architecture ft_jax does not support (the message lists the supported ones).
    """
    if architecture not in _FAMILIES:
        raise ValueError(f"tiny_config: unsupported architecture {architecture!r}; supported: {', '.join(_FAMILIES)}")
    return {"architectures": [architecture], **_COMMON, **_FAMILIES[architecture], **overrides}


def write_random_checkpoint(path: str | os.PathLike, config: dict | None = None, *, seed: int = 0, std: float = 0.1,
                            dtype: str = "float32") -> str:
    """Write a random-weight checkpoint folder (config.json + model.safetensors) that ft_jax loads.

    Weights and biases ~ N(0, std^2), norm weights 1 + N(0, std^2), in ``dtype`` ("float32" or "bfloat16";
    config.json's torch_dtype says which).

    Args:
        path: the folder (created if missing). config: config.json content (default tiny_config()).
        seed: numpy seed of the weights. std: their spread.
    Returns:
        the folder path (str).
    Raises:
        ConfigError: the config does not describe a supported model. ImportError: safetensors is not installed.
    """
    from safetensors.numpy import save_file  # lazy: safetensors is optional (the ``test`` extra)

    config = dict(tiny_config() if config is None else config)
    config["torch_dtype"] = dtype
    cfg = config_from_dict(config, source="ft_jax.testing config")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}

    def make(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        value = rng.normal(0.0, std, shape).astype(np.float32) + (1.0 if kind == "norm" else 0.0)
        stored = value.astype(np.float32 if kind.endswith("_f32") else np_dtype)
        if name not in tensors:  # a model-side alias asks for the same tensor again
            tensors[name] = stored
        return tensors[name]

    MoETransformer(cfg, make)  # asks for every dense tensor of the family, by its Hub name
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for layer in cfg.moe_layers:
        p = f"model.layers.{layer}.mlp.experts"
        normal = lambda *shape: rng.normal(0.0, std, shape).astype(np.float32).astype(np_dtype)  # noqa: E731
        if cfg.family == "gpt_oss":  # gate/up interleaved on the last axis, with biases
            tensors.update({f"{p}.gate_up_proj": normal(E, H, 2 * I), f"{p}.gate_up_proj_bias": normal(E, 2 * I),
                            f"{p}.down_proj": normal(E, I, H), f"{p}.down_proj_bias": normal(E, H)})
        else:
            tensors.update({f"{p}.gate_up_proj": normal(E, 2 * I, H), f"{p}.down_proj": normal(E, H, I)})
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    mask = os.umask(0)  # safetensors writes through a temporary file of mode 0600: give the file open()'s mode
    os.umask(mask)
    os.chmod(weights, 0o666 & ~mask)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return os.fspath(path)


def assert_policies_agree(model_dir: str | os.PathLike, prompt_ids: Sequence[int], *,
                          policies: Sequence[str] = DEFAULT_POLICIES, cache_slots: Sequence[int | None] = (1, None),
                          max_new_tokens: int = 8, dtype: str = "auto") -> list[int]:
    """Greedy-decode one prompt under every policy and cache size and assert the tokens are identical (the
    invariant of ft_jax: every routed (token, expert) pair is computed exactly once, from a slot or from the host
    bank, whatever the split).

    Args:
        model_dir: a model folder. prompt_ids: the prompt's token ids.
        policies: policy names; "auto" and "qstar" get nominal bandwidths (no profile is measured).
        cache_slots: slot counts to try; None = half of all experts. max_new_tokens: tokens to compare.
        dtype: as ft_jax.load.
    Returns:
        the common tokens.
    Raises:
        AssertionError: naming the policy, the cache size and the first position where the tokens differ.
    """
    cfg = load_config(model_dir)
    ckpt = load_checkpoint(model_dir, dtype=jnp.dtype(model_dtype(dtype, cfg.dtype)))
    expert_bytes = ckpt.banks.expert_bytes
    total = ckpt.banks.num_rows
    reference, where = None, None
    for name in policies:
        policy = parse_policy(name)
        if policy.kind is PolicyKind.QSTAR and policy.frac is None:
            policy = policy.with_frac(0.5)
        if policy.kind is PolicyKind.AUTO:
            policy = policy.with_costs(auto_costs(expert_bytes, 10.0, 20.0, device_bandwidth=100.0))
        for slots in ([total] if policy.kind is PolicyKind.RESIDENT else cache_slots):
            slots = max(1, total // 2) if slots is None else slots
            tokens = Engine(ckpt, policy=policy, num_slots=slots).generate(
                [list(prompt_ids)], max_new_tokens=max_new_tokens).tokens[0]
            if reference is None:
                reference, where = tokens, f"{name} with {slots} slots"
            elif tokens != reference:
                first = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
                raise AssertionError(f"{model_dir}: {name} with {slots} slots decodes {tokens} but {where} decodes "
                                     f"{reference}: they differ first at new token {first}")
    return reference
