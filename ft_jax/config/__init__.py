"""Model configuration: parse a Hugging Face MoE ``config.json`` into one flat :class:`MoEConfig`.

Supported architectures (``config.json["architectures"][0]``):

=========================  ==========  ===============================================================
architecture               family      notes (see docs/DESIGN.md section 6)
=========================  ==========  ===============================================================
MixtralForCausalLM         mixtral     experts use ``intermediate_size``; top-k always renormalised
Qwen2MoeForCausalLM        qwen2_moe   ``moe_intermediate_size``; shared expert with sigmoid gate;
                                       q/k/v bias (``qkv_bias``, default true); dense layers from
                                       ``mlp_only_layers`` / ``decoder_sparse_step``
Qwen3MoeForCausalLM        qwen3_moe   ``moe_intermediate_size``; per-head q/k RMSNorm;
                                       ``attention_bias``; ``mlp_only_layers`` / ``decoder_sparse_step``
OlmoeForCausalLM           olmoe       experts use ``intermediate_size``; full-width q/k RMSNorm;
                                       ``clip_qkv``; ``attention_bias``
DeepseekV2ForCausalLM      deepseek_v2 Multi-head Latent Attention (``q_lora_rank`` null = q_proj,
                                       ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
                                       ``v_head_dim``); softmax router, ``topk_method`` greedy or
                                       group_limited_greedy (``n_group``, ``topk_group``),
                                       ``routed_scaling_factor``; ``n_shared_experts``;
                                       ``first_k_dense_replace`` (see :func:`_deepseek`)
DeepseekV3ForCausalLM      deepseek_v3 MLA as V2 (``rope_interleave``); sigmoid router with
                                       ``e_score_correction_bias`` (noaux_tc), group-limited top-k,
                                       ``norm_topk_prob``, ``routed_scaling_factor``
GptOssForCausalLM          gpt_oss     experts use ``intermediate_size``, with biases and the clamped SwiGLU
                                       (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0); router with bias;
                                       attention sinks; ``layer_types`` (sliding_attention / full_attention,
                                       default alternating from sliding) with ``sliding_window``;
                                       ``attention_bias`` (default true); YaRN rope (transformers'
                                       GptOssConfig defaults when the config has none); MXFP4 experts
                                       (``quantization_config.quant_method`` "mxfp4") are dequantized on load
=========================  ==========  ===============================================================

Both key styles are accepted: the ones recent transformers (5.x) writes (``rope_parameters{rope_theta,
rope_type}``, ``dtype``) and the ones Hub checkpoints use (``rope_theta`` + ``rope_scaling``,
``torch_dtype``); the expert count may be ``num_local_experts`` or ``num_experts``; ``head_dim`` null or absent
means ``hidden_size // num_attention_heads``.

BOS/EOS ids: ``bos_token_id`` / ``eos_token_id`` of config.json, each replaced by the same key of
``generation_config.json`` when that file has it (transformers' ``generate`` reads its ids from the generation
config). ``eos_token_id`` may be one id or a list (Qwen checkpoints ship e.g. ``[151645, 151643]``); every listed id
ends a sequence: :attr:`MoEConfig.eos_token_ids`.

File access errors name the file and the real cause (missing, permission denied, symbolic link loop, not a regular
file such as a FIFO, not UTF-8, not JSON): see :func:`check_regular_file` and :func:`read_json_file`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from typing import Any

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
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class ConfigError(ValueError):
    """A config.json that cannot be used: unreadable, unsupported architecture, missing or invalid field.

    The message names the file and the field (or the supported architectures)."""


def os_error_cause(e: OSError) -> str:
    """Short human cause of an OSError from stat/open ("permission denied", "symbolic link loop", ...)."""
    causes = {errno.ENOENT: "does not exist", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
              errno.ELOOP: "symbolic link loop (too many levels of symbolic links)",
              errno.ENOTDIR: "a component of the path is not a folder",
              errno.ENAMETOOLONG: "file name too long"}
    return causes.get(e.errno, e.strerror or str(e))


def _missing(path: str) -> str:
    """Why ``path`` cannot be found: a dangling symbolic link is named as such (it exists, its target does not)."""
    if os.path.islink(path):
        return f"is a symbolic link to {os.readlink(path)!r}, which does not exist"
    return "does not exist"


def check_regular_file(path: str, what: str, error: type[Exception] = ConfigError) -> os.stat_result:
    """``os.stat(path)`` (following symbolic links), checked to be a regular file, without opening it.

    A FIFO, socket or device is refused before any open: opening a FIFO for reading blocks until a writer appears.

    Args:
        path: file to check. what: what the file should be (used in messages, e.g. "a safetensors file").
        error: exception class raised (ConfigError, CheckpointError, ...).
    Returns:
        The stat result (st_size in bytes).
    Raises:
        ``error``: "<path>: cannot read <what>: <cause>" (does not exist / dangling symbolic link / permission
        denied / symbolic link loop / ...) or "<path>: is <kind>, not a regular file; expected <what>".
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: cannot read {what}: the file {_missing(path)}") from None
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {os_error_cause(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a special file")
        raise error(f"{path}: is {kind}, not a regular file; expected {what}")
    return st


def read_json_file(path: str, what: str, error: type[Exception] = ConfigError) -> Any:
    """Parse the UTF-8 JSON file ``path`` (checked with :func:`check_regular_file` first).

    Raises:
        ``error``: unreadable / not a regular file (see check_regular_file), not UTF-8 (names the first bad byte
        and its offset), or not valid JSON (line and column). Messages are one line starting with ``path``.
    """
    check_regular_file(path, what, error)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {os_error_cause(e)}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); {what} must be "
                    "UTF-8 JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def file_present(path: str, what: str, error: type[Exception] = ConfigError) -> bool:
    """Whether a directory entry ``path`` exists (a dangling symbolic link counts: reading it reports why).

    Unlike os.path.lexists, a folder that cannot be searched is an error, not "absent".
    Raises ``error`` "<path>: cannot read <what>: <cause>" when the entry cannot be looked up (permission denied).
    """
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {os_error_cause(e)}") from None
    return True


def check_model_dir(model_dir: str) -> None:
    """Check that ``model_dir`` is an accessible folder.

    Raises:
        ConfigError: "model path does not exist: <dir>" (or names a dangling symbolic link), the path is a file,
            or it cannot be accessed (permission denied, symbolic link loop, ...: the real cause is named).
    """
    try:
        st = os.stat(model_dir)
    except FileNotFoundError:
        if os.path.islink(model_dir):
            raise ConfigError(f"model path {model_dir} {_missing(model_dir)}") from None
        raise ConfigError(f"model path does not exist: {model_dir}") from None
    except OSError as e:
        raise ConfigError(f"{model_dir}: cannot open the model folder: {os_error_cause(e)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"the model path must be a folder with config.json and safetensors files, got the file "
                          f"{model_dir}")


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

    def __post_init__(self):
        if self.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(
                f"hidden_act {self.hidden_act!r} is not implemented (supported: {sorted(_ACTIVATIONS)})")
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
        return "swiglu_oai" if self.family == "gpt_oss" else _ACTIVATIONS[self.hidden_act]

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


def load_config(model_dir: str | os.PathLike) -> MoEConfig:
    """Read ``<model_dir>/config.json`` (and the BOS/EOS ids of ``generation_config.json``) into a :class:`MoEConfig`.

    Raises:
        ConfigError: model_dir does not exist, is a file or cannot be accessed (permission denied, symbolic link
            loop: the cause is named); no config.json; config.json or generation_config.json unreadable, not a
            regular file, not UTF-8 or not valid JSON; unsupported architecture (message lists the supported ones),
            a missing required field (message names it), a field of the wrong type, or an out-of-range value (a
            size or count < 1, num_key_value_heads not dividing num_attention_heads, num_experts_per_tok outside
            [1, number of experts], no MoE layer, ...). Every message is one line "<path>: <field> ..., got <value>".
        NotImplementedError: a RoPE scaling type other than "default" and "yarn", partial rotary embeddings,
            Qwen sliding-window attention, an activation other than silu / gelu_pytorch_tanh, or a gpt-oss
            quantization other than mxfp4 (names the file).
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
    return dataclasses.replace(cfg, bos_token_id=bos, eos_token_ids=eos)


def _bos_id(value, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: field 'bos_token_id' should be int, got {value!r}")
    if value < 0:
        raise ConfigError(f"{source}: bos_token_id must be >= 0, got {value}")
    return value


def _eos_ids(value, source: str) -> tuple[int, ...]:
    ids = tuple(value) if isinstance(value, list) else (() if value is None else (value,))
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(f"{source}: eos_token_id must be a non-negative integer or a list of them, got {value!r}")
    return ids


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
            bos = _bos_id(data["bos_token_id"], path)
        if "eos_token_id" in data:
            eos = _eos_ids(data["eos_token_id"], path)
    return bos, eos


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> MoEConfig:
    """Build a :class:`MoEConfig` from an already-parsed config.json dict (see :func:`load_config`; this reads
    no generation_config.json, so BOS/EOS ids are config.json's).

    ``source`` is only used in error messages. Raises ConfigError / NotImplementedError as load_config."""

    def req(key: str, kind: type = int):
        if key not in raw or raw[key] is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return _typed(raw[key], key, kind)

    def opt(key: str, default, kind: type = int):
        if raw.get(key) is None:
            return default
        return _typed(raw[key], key, kind)

    def _typed(value, key, kind):
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is bool and isinstance(value, bool):
            return value
        if kind is list and isinstance(value, list):
            return value
        if kind is str and isinstance(value, str):
            return value
        raise ConfigError(f"{source}: field {key!r} should be {kind.__name__}, got {value!r}")

    archs = raw.get("architectures")
    if archs is None:
        raise ConfigError(f"{source}: required field 'architectures' is missing "
                          f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{source}: field 'architectures' should be a non-empty list of class names such as "
                          f"[\"MixtralForCausalLM\"], got {archs!r}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{source}: unsupported architecture {arch!r}; supported architectures: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]

    def at_least(key: str, value: int, low: int) -> int:
        if value < low:
            raise ConfigError(f"{source}: {key} must be >= {low}, got {value}")
        return value

    hidden = at_least("hidden_size", req("hidden_size"), 1)
    num_layers = at_least("num_hidden_layers", req("num_hidden_layers"), 1)
    num_heads = at_least("num_attention_heads", req("num_attention_heads"), 1)
    num_kv_heads = at_least("num_key_value_heads", opt("num_key_value_heads", num_heads), 1)
    if num_heads % num_kv_heads:
        raise ConfigError(f"{source}: num_key_value_heads must divide num_attention_heads={num_heads}, "
                          f"got {num_kv_heads}")
    if raw.get("head_dim") is not None:
        head_dim = at_least("head_dim", req("head_dim"), 1)
    elif hidden < num_heads:
        raise ConfigError(f"{source}: head_dim is absent, so it is hidden_size // num_attention_heads, which needs "
                          f"hidden_size >= num_attention_heads={num_heads}, got hidden_size={hidden}")
    else:
        head_dim = hidden // num_heads
    vocab_size = at_least("vocab_size", req("vocab_size"), 1)
    max_positions = at_least("max_position_embeddings", req("max_position_embeddings"), 1)

    experts_key = "num_local_experts" if raw.get("num_local_experts") is not None else "num_experts"
    if family in ("deepseek_v2", "deepseek_v3"):
        experts_key = "n_routed_experts"
    if raw.get(experts_key) is None:
        raise ConfigError(f"{source}: required field {experts_key!r} is missing" if experts_key == "n_routed_experts"
                          else f"{source}: required field 'num_local_experts' (or 'num_experts') is missing")
    num_experts = at_least(experts_key, _typed(raw[experts_key], experts_key, int), 1)
    top_k = req("num_experts_per_tok")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"{source}: num_experts_per_tok must be in [1, {experts_key}={num_experts}], "
                          f"got {top_k}")
    rms_norm_eps = req("rms_norm_eps", float)
    if not rms_norm_eps > 0:
        raise ConfigError(f"{source}: rms_norm_eps must be > 0, got {rms_norm_eps}")
    bos = _bos_id(raw.get("bos_token_id"), source)
    hidden_act = opt("hidden_act", "silu", str)
    if hidden_act not in _ACTIVATIONS:
        raise NotImplementedError(f"{source}: hidden_act {hidden_act!r} is not implemented (supported: "
                                  f"{', '.join(sorted(_ACTIVATIONS))})")

    rope_theta, rope_scaling = _rope(_gpt_oss_rope_defaults(raw) if family == "gpt_oss" else raw, source)
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if dtype_name not in _DTYPES:
        raise ConfigError(f"{source}: dtype {dtype_name!r} not supported (supported: {sorted(_DTYPES)})")

    eos_ids = _eos_ids(raw.get("eos_token_id"), source)

    common = dict(
        family=family, architecture=arch, vocab_size=vocab_size, hidden_size=hidden,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        num_experts=num_experts, top_k=top_k, rope_theta=rope_theta, rope_scaling=rope_scaling,
        rms_norm_eps=rms_norm_eps, clip_qkv=None, sliding_window=None,
        tie_word_embeddings=opt("tie_word_embeddings", False, bool),
        max_position_embeddings=max_positions, bos_token_id=bos,
        eos_token_ids=eos_ids, hidden_act=hidden_act, dtype=_DTYPES[dtype_name],
        initializer_range=opt("initializer_range", 0.02, float),
    )

    if family in ("deepseek_v2", "deepseek_v3"):
        return _deepseek(raw, source, common, req, opt, at_least)
    if family == "gpt_oss":
        return _gpt_oss_config(raw, common, source, opt, req, at_least, num_layers)
    if family == "mixtral":
        window = opt("sliding_window", None)
        common["sliding_window"] = None if window is None else at_least("sliding_window", window, 1)
        return MoEConfig(
            **common, moe_intermediate_size=at_least("intermediate_size", req("intermediate_size"), 1),
            intermediate_size=0, moe_layers=tuple(range(num_layers)), shared_expert_intermediate_size=0,
            norm_topk_prob=True, qkv_bias=False, o_bias=False, qk_norm="none")
    if family == "olmoe":
        bias = opt("attention_bias", False, bool)
        clip = opt("clip_qkv", None, float)
        if clip is not None and not clip > 0:
            raise ConfigError(f"{source}: clip_qkv must be > 0 (or null), got {clip}")
        common["clip_qkv"] = clip
        return MoEConfig(
            **common, moe_intermediate_size=at_least("intermediate_size", req("intermediate_size"), 1),
            intermediate_size=0, moe_layers=tuple(range(num_layers)), shared_expert_intermediate_size=0,
            norm_topk_prob=opt("norm_topk_prob", False, bool), qkv_bias=bias, o_bias=bias, qk_norm="full")

    # Qwen2-MoE / Qwen3-MoE: which layers are sparse, as in transformers' Qwen2MoeDecoderLayer:
    # MoE iff layer not in mlp_only_layers and num_experts > 0 and (layer + 1) % decoder_sparse_step == 0
    # (num_experts >= 1 is checked above).
    if opt("use_sliding_window", False, bool):
        raise NotImplementedError(f"{source}: use_sliding_window=true (Qwen sliding-window attention) is not "
                                  "implemented")
    step = at_least("decoder_sparse_step", opt("decoder_sparse_step", 1), 1)
    mlp_only_list = opt("mlp_only_layers", [], list)
    bad = [l for l in mlp_only_list if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < num_layers]
    if bad:
        raise ConfigError(f"{source}: mlp_only_layers entries must be layer indices in [0, "
                          f"num_hidden_layers={num_layers}), got {bad}")
    mlp_only = set(mlp_only_list)
    moe_layers = tuple(l for l in range(num_layers) if l not in mlp_only and (l + 1) % step == 0)
    if not moe_layers:
        raise ConfigError(f"{source}: no MoE layer: every one of the num_hidden_layers={num_layers} layers is dense "
                          f"(decoder_sparse_step={step}, mlp_only_layers={sorted(mlp_only)}); expected at least "
                          "one MoE layer")
    if len(moe_layers) < num_layers:
        dense_width = at_least("intermediate_size (width of the dense layers)", req("intermediate_size"), 1)
    else:
        dense_width = opt("intermediate_size", 0)
    moe_width = at_least("moe_intermediate_size", req("moe_intermediate_size"), 1)
    if family == "qwen2_moe":
        shared = at_least("shared_expert_intermediate_size", req("shared_expert_intermediate_size"), 0)
        return MoEConfig(
            **common, moe_intermediate_size=moe_width, intermediate_size=dense_width,
            moe_layers=moe_layers, shared_expert_intermediate_size=shared,
            norm_topk_prob=opt("norm_topk_prob", False, bool), qkv_bias=opt("qkv_bias", True, bool),
            o_bias=False, qk_norm="none")
    bias = opt("attention_bias", False, bool)
    return MoEConfig(
        **common, moe_intermediate_size=moe_width, intermediate_size=dense_width,
        moe_layers=moe_layers, shared_expert_intermediate_size=0,
        norm_topk_prob=opt("norm_topk_prob", False, bool), qkv_bias=bias, o_bias=bias, qk_norm="per_head")


def _deepseek(raw: dict[str, Any], source: str, common: dict, req, opt, at_least) -> MoEConfig:
    """The DeepSeek-V2/V3 part of :func:`config_from_dict` (``common``: the fields every family shares; req / opt /
    at_least: its readers). Follows transformers 5.24 (DeepseekV2Config / DeepseekV3Config and the models), whose
    defaults fill absent routing fields (V2: topk_method greedy, norm_topk_prob false, routed_scaling_factor 1,
    n_shared_experts 2, first_k_dense_replace 0; V3: n_group 8, topk_group 4, norm_topk_prob true,
    routed_scaling_factor 2.5, n_shared_experts 1, first_k_dense_replace 3, rope_interleave true).

    Where transformers departs from DeepSeek's own modeling code, ft_jax follows transformers (the reference its
    fixtures are checked against; every released checkpoint sits where the two agree):
      * layer l is MoE iff l >= first_k_dense_replace; ``moe_layer_freq`` is checked (>= 1) but transformers does
        not read it (DeepSeek's code also requires l % moe_layer_freq == 0; released checkpoints have 1);
      * V2's router does not renormalise whatever ``norm_topk_prob`` says (DeepSeek's V2 code renormalises when it
        is true; released V2 checkpoints have false); V3's does when it is true;
      * ``q_lora_rank`` must be present (null = q_proj): transformers' default 1536 would be a silent guess.
    ``scoring_func`` / ``topk_method``, when present, must be the family's (V2: softmax, greedy or
    group_limited_greedy; V3: sigmoid, noaux_tc); ``mlp_bias`` true (V2) is not implemented.
    """
    v3 = common["family"] == "deepseek_v3"
    num_layers, E, k = common["num_layers"], common["num_experts"], common["top_k"]
    if "q_lora_rank" not in raw:
        raise ConfigError(f"{source}: required field 'q_lora_rank' is missing (null means a plain q_proj)")
    q_lora = opt("q_lora_rank", None)
    if q_lora is not None:
        at_least("q_lora_rank", q_lora, 1)
    kv_lora = at_least("kv_lora_rank", req("kv_lora_rank"), 1)
    nope = at_least("qk_nope_head_dim", req("qk_nope_head_dim"), 1)
    rope = at_least("qk_rope_head_dim", req("qk_rope_head_dim"), 2)
    if rope % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim must be even (RoPE rotates pairs of dimensions), got {rope}")
    v_dim = at_least("v_head_dim", req("v_head_dim"), 1)
    moe_width = at_least("moe_intermediate_size", req("moe_intermediate_size"), 1)
    shared = 0 if "n_shared_experts" in raw and raw["n_shared_experts"] is None else \
        at_least("n_shared_experts", opt("n_shared_experts", 1 if v3 else 2), 0)
    first_dense = opt("first_k_dense_replace", 3 if v3 else 0)
    if not 0 <= first_dense < num_layers:
        raise ConfigError(f"{source}: first_k_dense_replace must be in [0, num_hidden_layers - 1 = {num_layers - 1}] "
                          f"(at least one MoE layer), got {first_dense}")
    at_least("moe_layer_freq", opt("moe_layer_freq", 1), 1)
    dense_width = at_least("intermediate_size (width of the dense layers)", req("intermediate_size"), 1) \
        if first_dense else opt("intermediate_size", 0)
    if opt("mlp_bias", False, bool):
        raise NotImplementedError(f"{source}: mlp_bias=true (biases on the dense and shared-expert MLPs) is not "
                                  "implemented")
    scoring = opt("scoring_func", "sigmoid" if v3 else "softmax", str)
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise NotImplementedError(f"{source}: scoring_func {scoring!r} is not implemented for {common['architecture']}"
                                  f" (transformers scores its router with {'sigmoid' if v3 else 'softmax'})")
    method = opt("topk_method", "noaux_tc" if v3 else "greedy", str)
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ConfigError(f"{source}: topk_method must be {' or '.join(map(repr, methods))} for "
                          f"{common['architecture']}, got {method!r}")
    grouped = v3 or method == "group_limited_greedy"
    if not grouped:
        n_group, topk_group = 1, 1
    elif v3:
        n_group, topk_group = at_least("n_group", opt("n_group", 8), 1), opt("topk_group", 4)
    else:
        n_group, topk_group = at_least("n_group", req("n_group"), 1), req("topk_group")
    if E % n_group:
        raise ConfigError(f"{source}: n_group must divide n_routed_experts={E}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"{source}: topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if v3 and E // n_group < 2:
        raise ConfigError(f"{source}: n_group must leave >= 2 experts per group (a group's score is the sum of its "
                          f"top-2 expert scores), got n_group={n_group} for n_routed_experts={E}")
    if k > topk_group * (E // n_group):
        raise ConfigError(f"{source}: num_experts_per_tok must be <= topk_group * n_routed_experts / n_group = "
                          f"{topk_group * (E // n_group)} (the experts of the groups a token may use), got {k}")
    scale = opt("routed_scaling_factor", 2.5 if v3 else 1.0, float)
    if not scale > 0:
        raise ConfigError(f"{source}: routed_scaling_factor must be > 0, got {scale}")
    bias = opt("attention_bias", False, bool)
    common = {**common, "num_kv_heads": common["num_heads"], "head_dim": rope}
    return MoEConfig(
        **common, moe_intermediate_size=moe_width, intermediate_size=dense_width,
        moe_layers=tuple(range(first_dense, num_layers)), shared_expert_intermediate_size=0,
        norm_topk_prob=opt("norm_topk_prob", v3, bool), qkv_bias=bias, o_bias=bias, qk_norm="none",
        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v_dim,
        n_shared_experts=shared, scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=scale, rope_interleave=opt("rope_interleave", True, bool) if v3 else True)


# transformers' GptOssConfig: rope_theta 150000 (default_theta) and this YaRN when the config gives no rope parameters.
_GPT_OSS_THETA = 150000.0
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss_rope_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """raw with transformers' GptOssConfig rope defaults filled in (YaRN when neither rope_parameters nor
    rope_scaling is given; rope_theta 150000 when absent)."""
    raw = dict(raw)
    if not isinstance(raw.get("rope_parameters"), dict) and not isinstance(raw.get("rope_scaling"), dict):
        raw["rope_parameters"] = dict(_GPT_OSS_ROPE)
    params = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        raw["rope_theta"] = _GPT_OSS_THETA
    return raw


def _gpt_oss_config(raw, common: dict, source: str, opt, req, at_least, num_layers: int) -> MoEConfig:
    """The gpt_oss branch of config_from_dict (transformers' GptOssConfig and GptOssModel semantics)."""
    types = opt("layer_types", None, list)
    if types is None:  # GptOssConfig.__post_init__: sliding on even layers, full on odd ones
        types = ["sliding_attention" if (l + 1) % 2 else "full_attention" for l in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"{source}: layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                          f"num_hidden_layers={num_layers} layers, got {types!r}")
    window = opt("sliding_window", None)
    alpha, limit = opt("swiglu_alpha", 1.702, float), opt("swiglu_limit", 7.0, float)
    if not limit > 0:
        raise ConfigError(f"{source}: swiglu_limit must be > 0, got {limit}")
    quant = raw.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method != "mxfp4":
            raise NotImplementedError(f"{source}: quantization_config with quant_method {method!r} is not "
                                      "implemented (supported: mxfp4 experts, dequantized while loading)")
    bias = opt("attention_bias", True, bool)
    common = dict(common, sliding_window=None if window is None else at_least("sliding_window", window, 1))
    return MoEConfig(
        **common, moe_intermediate_size=at_least("intermediate_size", req("intermediate_size"), 1),
        intermediate_size=0, moe_layers=tuple(range(num_layers)), shared_expert_intermediate_size=0,
        norm_topk_prob=False, qkv_bias=bias, o_bias=bias, qk_norm="none", layer_types=tuple(types),
        attention_sinks=True, router_bias=True, expert_bias=True, swiglu_alpha=alpha, swiglu_limit=limit)


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(RoPE base, YaRN scaling or None) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (Hub). Other rope types raise NotImplementedError naming the type."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if isinstance(params, dict):
        spec = params
        theta = params.get("rope_theta", raw.get("rope_theta"))
        partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    else:
        spec = scaling if isinstance(scaling, dict) else {}
        theta = raw.get("rope_theta")
        partial = raw.get("partial_rotary_factor", 1.0)
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise NotImplementedError(f"{source}: RoPE scaling type {rope_type!r} is not implemented "
                                  "(supported: default, yarn)")
    if partial not in (None, 1, 1.0):
        raise NotImplementedError(f"{source}: partial_rotary_factor={partial} is not implemented")
    if theta is None:
        raise ConfigError(f"{source}: required field 'rope_theta' (or 'rope_parameters.rope_theta') is missing")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{source}: field 'rope_theta' should be a number, got {theta!r}")
    if not theta > 0:
        raise ConfigError(f"{source}: rope_theta must be > 0, got {theta}")
    if rope_type == "default":
        return float(theta), None

    def number(key, default=None, positive=True, where=spec):
        value = where.get(key, default)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (positive and not value > 0):
            raise ConfigError(f"{source}: yarn rope field {key!r} should be a {'positive ' if positive else ''}"
                              f"number, got {value!r}")
        return value

    # transformers 5 (PreTrainedConfig.standardize_rope_params): a top-level original_max_position_embeddings wins
    # (Phi-3 style), then the rope dict's, else the config's max_position_embeddings.
    key = "original_max_position_embeddings"
    original = number(key, where=raw) if raw.get(key) is not None else \
        number(key, raw.get("max_position_embeddings"))
    attention_factor = spec.get("attention_factor")
    return float(theta), RopeScaling(
        factor=float(number("factor")), original_max_position_embeddings=int(original),
        beta_fast=float(number("beta_fast", 32.0)), beta_slow=float(number("beta_slow", 1.0)),
        truncate=bool(spec.get("truncate", True)), mscale=float(number("mscale", 0.0, positive=False)),
        mscale_all_dim=float(number("mscale_all_dim", 0.0, positive=False)),
        attention_factor=None if attention_factor is None else float(number("attention_factor")))
