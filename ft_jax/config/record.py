"""The model configuration record: :class:`MoEConfig` (one flat, hashable record of everything the model, loader and
decode engine need) and :class:`RopeScaling` (YaRN), plus the tables of supported architectures, layer types and
activations. The builders from config.json are ft_jax/config/families.py."""

from __future__ import annotations

import dataclasses

from ft_jax.config.quantization import Quantization

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
}

LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' layer_types values used by gpt-oss

# Hugging Face ``hidden_act`` -> activation name used by the expert kernels (ft_jax.kernels.ffi_ops).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN rope scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models";
    transformers' ``_compute_yarn_parameters``), from ``rope_parameters`` / ``rope_scaling`` with rope_type "yarn".

    Attributes:
        factor: context extension factor s (> 0).
        original_max_position_embeddings: the pre-extension context L (> 0).
        beta_fast, beta_slow: rotation counts bounding the interpolation ramp (defaults 32 and 1).
        truncate: round the ramp's bounds to whole dimensions (default true).
        mscale, mscale_all_dim: DeepSeek's attention-scale terms (0 = absent).
        attention_factor: explicit cos/sin scale, or None for the rule of the paper (0.1 ln s + 1, or DeepSeek's
            mscale ratio).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Everything the model, loader and decode engine need, in one flat, hashable record.

    Attributes:
        family: "mixtral" | "qwen2_moe" | "qwen3_moe" | "olmoe" | "deepseek_v2" | "deepseek_v3" | "gpt_oss".
        architecture: the ``architectures[0]`` string of config.json.
        vocab_size, hidden_size (H), num_layers (decoder layers), num_heads, num_kv_heads, head_dim (D; the RoPE
            width qk_rope_head_dim for DeepSeek, whose num_kv_heads = num_heads).
        num_experts (E): routed experts per MoE layer. top_k (k): experts per token.
        moe_intermediate_size (I): routed expert width (gate/up rows: I, down: [H, I]).
        intermediate_size: width of the dense MLP in non-MoE layers (0 when every layer is MoE).
        moe_layers: decoder layer indices that are MoE layers, ascending; the MoE layer index used for
            flat expert ids (flat = moe_layer_index * E + e) is the position in this tuple.
        shared_expert_intermediate_size: Qwen2-MoE shared expert width (0 = no shared expert).
        norm_topk_prob: renormalise the top-k softmax probabilities to sum to 1 (always true for Mixtral).
        rope_theta: RoPE base. rope_scaling: RopeScaling for YaRN, None for the default rope.
        rms_norm_eps: RMSNorm epsilon.
        qkv_bias: q/k/v projections have a bias. o_bias: o projection has a bias.
        qk_norm: "none" | "per_head" (RMSNorm over D per head, Qwen3-MoE) | "full" (RMSNorm over NH*D / KVH*D
            before the head split, OLMoE).
        clip_qkv: clamp q, k, v to [-clip_qkv, clip_qkv] after projection/norm (OLMoE), or None.
        sliding_window: attention window (a query at p sees keys at positions > p - window), or None; applied to
            every layer, or with layer_types to the "sliding_attention" layers only (see attention_window).
        tie_word_embeddings: lm_head shares the embedding matrix.
        max_position_embeddings: maximum sequence length of the checkpoint.
        bos_token_id: int or None.
        eos_token_ids: every end-of-sequence id, in file order (may be empty): config.json's ``eos_token_id``
            (an int or a list), replaced by generation_config.json's when :func:`load_config` finds that key
            there. Decoding stops a sequence at any of them.
        hidden_act: Hugging Face activation name (e.g. "silu").
        dtype: checkpoint dtype name ("float32", "bfloat16", "float16").
        initializer_range: std of the normal init used for random (untrained) models.
        layer_types: per decoder layer "sliding_attention" | "full_attention" (gpt-oss), or () = every layer
            uses sliding_window.
        attention_sinks: each attention head has a learned sink logit (``self_attn.sinks`` [NH]) that joins the
            softmax and is dropped after it (gpt-oss).
        router_bias: the router has a bias (``mlp.router.bias`` [E], gpt-oss).
        expert_bias: routed experts have gate/up and down biases (gpt-oss's gate_up_proj_bias / down_proj_bias).
        swiglu_alpha, swiglu_limit: the clamped SwiGLU's sigmoid gain and clamp (gpt-oss; activation
            "swiglu_oai").
        quantization: config.json's quantization_config as ft_jax reads it (ft_jax.config.quantization: fp8 block
            scales or gpt-oss's mxfp4 experts), or None for a float checkpoint.

    DeepSeek-V2/V3 only (defaults elsewhere; DeepSeek-V2 paper arXiv 2405.04434 sec. 2.1, transformers'
    DeepseekV2/V3Attention and DeepseekV2/V3TopkRouter):
        q_lora_rank: query compression rank (q_a_proj [Q, H], q_a_layernorm, q_b_proj), or None: q_proj directly.
        kv_lora_rank (C): width of the compressed latent cached per token (0: not MLA, the other families).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head query/key widths without and with RoPE, value
            width. qkv_bias / o_bias mean attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj.
        n_shared_experts: shared experts (one ungated dense MLP of width moe_intermediate_size * n_shared_experts).
        scoring_func: "softmax" (V2) | "sigmoid" (V3). topk_method: "greedy" | "group_limited_greedy" (V2) |
            "noaux_tc" (V3). n_group, topk_group: experts in n_group equal groups, top-k from the best topk_group.
        routed_scaling_factor: multiplies the combine weights. rope_interleave: RoPE pairs (x0, x1), (x2, x3), ...
            (always for V2, whose transformers code rotates complex pairs).
    """

    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: str
    clip_qkv: float | None
    sliding_window: int | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str
    dtype: str
    initializer_range: float = 0.02
    rope_scaling: RopeScaling | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = False
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quantization: Quantization | None = None

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(
                f"hidden_act {self.hidden_act!r} is not implemented (supported: {sorted(ACTIVATIONS)})")
        if self.qk_norm not in ("none", "per_head", "full"):
            raise ValueError(f"qk_norm must be 'none', 'per_head' or 'full', got {self.qk_norm!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if not self.moe_layers:
            raise ValueError(f"moe_layers is empty: at least one of the {self.num_layers} decoder layers must be MoE")
        if any(not 0 <= l < self.num_layers for l in self.moe_layers):
            raise ValueError(f"moe_layers {self.moe_layers} out of range for {self.num_layers} layers")
        if len(self.moe_layers) < self.num_layers and self.intermediate_size <= 0:
            raise ValueError("dense (non-MoE) layers need intermediate_size > 0")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the {self.num_layers} layers, "
                             f"got {self.layer_types}")

    @property
    def num_moe_layers(self) -> int:
        """Number of MoE layers (L_moe); the host banks hold num_moe_layers * num_experts rows."""
        return len(self.moe_layers)

    @property
    def activation(self) -> str:
        """Activation name for the expert kernels: "silu" (SwiGLU) or "gelu_tanh" from hidden_act; gpt-oss's experts
        use "swiglu_oai" (the clamped SwiGLU with swiglu_alpha / swiglu_limit) whatever hidden_act says."""
        return "swiglu_oai" if self.family == "gpt_oss" else ACTIVATIONS[self.hidden_act]

    def attention_window(self, layer: int) -> int | None:
        """Sliding window of decoder layer ``layer`` (None = full attention): sliding_window for every layer, or with
        layer_types only for the "sliding_attention" ones (transformers' GptOssAttention)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def eos_token_id(self) -> int | None:
        """First end-of-sequence id, or None when there is none (use :attr:`eos_token_ids`: all of them)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def moe_layer_index(self, layer: int) -> int | None:
        """MoE layer index (0..num_moe_layers-1) of decoder layer ``layer``, or None for a dense layer."""
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            return None
