"""One builder per model family: config.json fields -> :class:`MoEConfig`, following transformers 5.x's config
classes and models (family notes: docs/DESIGN.md section 6 and docs/DESIGN.md, models, config).

Each builder takes the typed readers of the file (:class:`Fields`) and the fields every family shares
(:func:`ft_jax.config.fields.common_fields`) and adds the family's own: the routed expert width, which decoder
layers are MoE, the shared experts, the router options and the attention variant. Errors: ConfigError naming the
file and the field; NotImplementedError for a feature of the family ft_jax does not implement.
"""

from __future__ import annotations

from typing import Any, Callable

from ft_jax.config.fields import Fields
from ft_jax.config.files import ConfigError
from ft_jax.config.record import LAYER_TYPES, MoEConfig


def _record(common: dict[str, Any], **fields) -> MoEConfig:
    """MoEConfig of the shared fields with the family's (which may override shared ones, e.g. sliding_window)."""
    return MoEConfig(**{**common, **fields})


def _window(f: Fields, window: int | None) -> int | None:
    """sliding_window (already read with f.opt) checked >= 1, or None."""
    return None if window is None else f.at_least("sliding_window", window, 1)


def _every_layer(common: dict[str, Any]) -> tuple[int, ...]:
    return tuple(range(common["num_layers"]))


def mixtral(f: Fields, common: dict[str, Any]) -> MoEConfig:
    """Mixtral: experts of width intermediate_size, every layer MoE, top-k always renormalised, sliding_window."""
    return _record(
        common, sliding_window=_window(f, f.opt("sliding_window", None)),
        moe_intermediate_size=f.at_least("intermediate_size", f.req("intermediate_size"), 1), intermediate_size=0,
        moe_layers=_every_layer(common), shared_expert_intermediate_size=0, norm_topk_prob=True, qkv_bias=False,
        o_bias=False, qk_norm="none")


def olmoe(f: Fields, common: dict[str, Any]) -> MoEConfig:
    """OLMoE: experts of width intermediate_size, every layer MoE, full-width q/k RMSNorm, clip_qkv, attention_bias."""
    bias = f.opt("attention_bias", False, bool)
    clip = f.opt("clip_qkv", None, float)
    if clip is not None and not clip > 0:
        raise ConfigError(f"{f.source}: clip_qkv must be > 0 (or null), got {clip}")
    return _record(
        common, clip_qkv=clip,
        moe_intermediate_size=f.at_least("intermediate_size", f.req("intermediate_size"), 1), intermediate_size=0,
        moe_layers=_every_layer(common), shared_expert_intermediate_size=0,
        norm_topk_prob=f.opt("norm_topk_prob", False, bool), qkv_bias=bias, o_bias=bias, qk_norm="full")


def _qwen_layers(f: Fields, num_layers: int) -> dict[str, Any]:
    """moe_layers, intermediate_size (dense layers) and moe_intermediate_size of Qwen2/3-MoE. As transformers'
    Qwen2MoeDecoderLayer: layer l is MoE iff l not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0
    (num_experts >= 1 is checked by common_fields)."""
    if f.opt("use_sliding_window", False, bool):
        raise NotImplementedError(f"{f.source}: use_sliding_window=true (Qwen sliding-window attention) is not "
                                  "implemented")
    step = f.at_least("decoder_sparse_step", f.opt("decoder_sparse_step", 1), 1)
    mlp_only_list = f.opt("mlp_only_layers", [], list)
    bad = [l for l in mlp_only_list if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < num_layers]
    if bad:
        raise ConfigError(f"{f.source}: mlp_only_layers entries must be layer indices in [0, "
                          f"num_hidden_layers={num_layers}), got {bad}")
    mlp_only = set(mlp_only_list)
    moe_layers = tuple(l for l in range(num_layers) if l not in mlp_only and (l + 1) % step == 0)
    if not moe_layers:
        raise ConfigError(f"{f.source}: no MoE layer: every one of the num_hidden_layers={num_layers} layers is "
                          f"dense (decoder_sparse_step={step}, mlp_only_layers={sorted(mlp_only)}); expected at least "
                          "one MoE layer")
    if len(moe_layers) < num_layers:
        dense_width = f.at_least("intermediate_size (width of the dense layers)", f.req("intermediate_size"), 1)
    else:
        dense_width = f.opt("intermediate_size", 0)
    return dict(moe_layers=moe_layers, intermediate_size=dense_width,
                moe_intermediate_size=f.at_least("moe_intermediate_size", f.req("moe_intermediate_size"), 1))


def qwen2_moe(f: Fields, common: dict[str, Any]) -> MoEConfig:
    """Qwen2-MoE: dense layers from mlp_only_layers / decoder_sparse_step, a shared expert with a sigmoid gate,
    q/k/v bias (qkv_bias, default true)."""
    layers = _qwen_layers(f, common["num_layers"])
    shared = f.at_least("shared_expert_intermediate_size", f.req("shared_expert_intermediate_size"), 0)
    return _record(common, **layers, shared_expert_intermediate_size=shared,
                   norm_topk_prob=f.opt("norm_topk_prob", False, bool), qkv_bias=f.opt("qkv_bias", True, bool),
                   o_bias=False, qk_norm="none")


def qwen3_moe(f: Fields, common: dict[str, Any]) -> MoEConfig:
    """Qwen3-MoE: dense layers as Qwen2-MoE, per-head q/k RMSNorm, attention_bias, no shared expert."""
    layers = _qwen_layers(f, common["num_layers"])
    bias = f.opt("attention_bias", False, bool)
    return _record(common, **layers, shared_expert_intermediate_size=0,
                   norm_topk_prob=f.opt("norm_topk_prob", False, bool), qkv_bias=bias, o_bias=bias,
                   qk_norm="per_head")


def _mla_widths(f: Fields) -> dict[str, Any]:
    """q_lora_rank (required key; null = plain q_proj), kv_lora_rank, qk_nope/qk_rope/v head dims of MLA."""
    if "q_lora_rank" not in f.raw:
        raise ConfigError(f"{f.source}: required field 'q_lora_rank' is missing (null means a plain q_proj)")
    q_lora = f.opt("q_lora_rank", None)
    if q_lora is not None:
        f.at_least("q_lora_rank", q_lora, 1)
    kv_lora = f.at_least("kv_lora_rank", f.req("kv_lora_rank"), 1)
    nope = f.at_least("qk_nope_head_dim", f.req("qk_nope_head_dim"), 1)
    rope = f.at_least("qk_rope_head_dim", f.req("qk_rope_head_dim"), 2)
    if rope % 2:
        raise ConfigError(f"{f.source}: qk_rope_head_dim must be even (RoPE rotates pairs of dimensions), got {rope}")
    return dict(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                v_head_dim=f.at_least("v_head_dim", f.req("v_head_dim"), 1))


def _deepseek_router(f: Fields, common: dict[str, Any], v3: bool) -> dict[str, Any]:
    """scoring_func, topk_method, n_group / topk_group and routed_scaling_factor of DeepSeek-V2 (softmax; greedy
    or group_limited_greedy) or V3 (sigmoid; noaux_tc), with transformers' defaults."""
    E, k, arch = common["num_experts"], common["top_k"], common["architecture"]
    scoring = f.opt("scoring_func", "sigmoid" if v3 else "softmax", str)
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise NotImplementedError(f"{f.source}: scoring_func {scoring!r} is not implemented for {arch} "
                                  f"(transformers scores its router with {'sigmoid' if v3 else 'softmax'})")
    method = f.opt("topk_method", "noaux_tc" if v3 else "greedy", str)
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ConfigError(f"{f.source}: topk_method must be {' or '.join(map(repr, methods))} for {arch}, "
                          f"got {method!r}")
    if not (v3 or method == "group_limited_greedy"):
        n_group, topk_group = 1, 1
    elif v3:
        n_group, topk_group = f.at_least("n_group", f.opt("n_group", 8), 1), f.opt("topk_group", 4)
    else:
        n_group, topk_group = f.at_least("n_group", f.req("n_group"), 1), f.req("topk_group")
    if E % n_group:
        raise ConfigError(f"{f.source}: n_group must divide n_routed_experts={E}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"{f.source}: topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if v3 and E // n_group < 2:
        raise ConfigError(f"{f.source}: n_group must leave >= 2 experts per group (a group's score is the sum of its "
                          f"top-2 expert scores), got n_group={n_group} for n_routed_experts={E}")
    if k > topk_group * (E // n_group):
        raise ConfigError(f"{f.source}: num_experts_per_tok must be <= topk_group * n_routed_experts / n_group = "
                          f"{topk_group * (E // n_group)} (the experts of the groups a token may use), got {k}")
    scale = f.opt("routed_scaling_factor", 2.5 if v3 else 1.0, float)
    if not scale > 0:
        raise ConfigError(f"{f.source}: routed_scaling_factor must be > 0, got {scale}")
    return dict(scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=scale)


def deepseek(f: Fields, common: dict[str, Any]) -> MoEConfig:
    """DeepSeek-V2 / V3 (transformers 5.24 DeepseekV2Config / DeepseekV3Config, whose defaults fill absent fields):
    Multi-head Latent Attention, layer l MoE iff l >= first_k_dense_replace (moe_layer_freq is checked but, as in
    transformers, not read), n_shared_experts shared experts, the router of :func:`_deepseek_router`; rope_interleave
    (V3; always for V2). Where transformers departs from DeepSeek's own code ft_jax follows transformers
    (docs/DESIGN.md, models, config). mlp_bias true (V2) raises NotImplementedError."""
    v3 = common["family"] == "deepseek_v3"
    num_layers = common["num_layers"]
    mla = _mla_widths(f)
    moe_width = f.at_least("moe_intermediate_size", f.req("moe_intermediate_size"), 1)
    shared = 0 if "n_shared_experts" in f.raw and f.raw["n_shared_experts"] is None else \
        f.at_least("n_shared_experts", f.opt("n_shared_experts", 1 if v3 else 2), 0)
    first_dense = f.opt("first_k_dense_replace", 3 if v3 else 0)
    if not 0 <= first_dense < num_layers:
        raise ConfigError(f"{f.source}: first_k_dense_replace must be in [0, num_hidden_layers - 1 = "
                          f"{num_layers - 1}] (at least one MoE layer), got {first_dense}")
    f.at_least("moe_layer_freq", f.opt("moe_layer_freq", 1), 1)
    dense_width = f.at_least("intermediate_size (width of the dense layers)", f.req("intermediate_size"), 1) \
        if first_dense else f.opt("intermediate_size", 0)
    if f.opt("mlp_bias", False, bool):
        raise NotImplementedError(f"{f.source}: mlp_bias=true (biases on the dense and shared-expert MLPs) is not "
                                  "implemented")
    router = _deepseek_router(f, common, v3)
    bias = f.opt("attention_bias", False, bool)
    return _record(
        common, num_kv_heads=common["num_heads"], head_dim=mla["qk_rope_head_dim"], **mla, **router,
        moe_intermediate_size=moe_width, intermediate_size=dense_width,
        moe_layers=tuple(range(first_dense, num_layers)), shared_expert_intermediate_size=0, qkv_bias=bias,
        o_bias=bias, qk_norm="none", n_shared_experts=shared,
        norm_topk_prob=f.opt("norm_topk_prob", v3, bool),  # transformers' V2 router never renormalises anyway
        rope_interleave=f.opt("rope_interleave", True, bool) if v3 else True)


# transformers' GptOssConfig: rope_theta 150000 (default_theta) and this YaRN when the config gives no rope parameters.
_GPT_OSS_THETA = 150000.0
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def gpt_oss_rope_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """raw with transformers' GptOssConfig rope defaults filled in (YaRN when neither rope_parameters nor
    rope_scaling is given; rope_theta 150000 when absent)."""
    raw = dict(raw)
    if not isinstance(raw.get("rope_parameters"), dict) and not isinstance(raw.get("rope_scaling"), dict):
        raw["rope_parameters"] = dict(_GPT_OSS_ROPE)
    params = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        raw["rope_theta"] = _GPT_OSS_THETA
    return raw


def gpt_oss(f: Fields, common: dict[str, Any]) -> MoEConfig:
    """gpt-oss (transformers' GptOssConfig / GptOssModel): experts of width intermediate_size with biases and the
    clamped SwiGLU (swiglu_alpha, swiglu_limit), router bias, attention sinks, layer_types (default alternating from
    sliding) with sliding_window, attention_bias (default true)."""
    num_layers = common["num_layers"]
    types = f.opt("layer_types", None, list)
    if types is None:  # GptOssConfig.__post_init__: sliding on even layers, full on odd ones
        types = ["sliding_attention" if (l + 1) % 2 else "full_attention" for l in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"{f.source}: layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                          f"num_hidden_layers={num_layers} layers, got {types!r}")
    window = f.opt("sliding_window", None)
    alpha, limit = f.opt("swiglu_alpha", 1.702, float), f.opt("swiglu_limit", 7.0, float)
    if not limit > 0:
        raise ConfigError(f"{f.source}: swiglu_limit must be > 0, got {limit}")
    bias = f.opt("attention_bias", True, bool)
    return _record(
        common, sliding_window=_window(f, window),
        moe_intermediate_size=f.at_least("intermediate_size", f.req("intermediate_size"), 1), intermediate_size=0,
        moe_layers=_every_layer(common), shared_expert_intermediate_size=0, norm_topk_prob=False, qkv_bias=bias,
        o_bias=bias, qk_norm="none", layer_types=tuple(types), attention_sinks=True, router_bias=True,
        expert_bias=True, swiglu_alpha=alpha, swiglu_limit=limit)


BUILDERS: dict[str, Callable[[Fields, dict[str, Any]], MoEConfig]] = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe,
    "deepseek_v2": deepseek, "deepseek_v3": deepseek, "gpt_oss": gpt_oss,
}
"""family -> builder(fields, common) -> MoEConfig."""

ROPE_DEFAULTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"gpt_oss": gpt_oss_rope_defaults}
"""family -> raw config with the family's RoPE defaults filled in (families absent: none)."""
