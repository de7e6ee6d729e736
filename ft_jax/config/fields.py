"""Typed readers over one parsed config.json (:class:`Fields`) and the fields every family shares
(:func:`common_fields`): sizes, heads, experts, norm epsilon, token ids, activation, RoPE and dtype. Every error is
one line "<source>: <field> ..., got <value>"."""

from __future__ import annotations

from typing import Any

from ft_jax.config.files import ConfigError
from ft_jax.config.quantization import read_quantization
from ft_jax.config.record import ACTIVATIONS, SUPPORTED_ARCHITECTURES
from ft_jax.config.rope import read_rope

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


INT32_MAX = 2**31 - 1  # the largest config integer: ft_jax's expert ids, shapes and counters are int32


class Fields:
    """Typed access to the keys of ``raw`` (a config.json dict); ``source`` (its path) starts every message.

    A key whose value is null counts as absent. ``kind`` is int, float (an int is widened), bool, list or str; bool
    is never accepted as an int.
    """

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def typed(self, value, key: str, kind: type = int):
        """``value`` checked to be of ``kind`` (an int within +-INT32_MAX). Raises ConfigError "field 'key' should be
        <kind>, got <value>" or naming the int beyond int32."""
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT32_MAX:
                raise ConfigError(f"{self.source}: field {key!r} is {value}, beyond 2^31 - 1 (ft_jax's expert ids, "
                                  "shapes and counters are int32)")
            return value
        if kind in (bool, list, str) and isinstance(value, kind):
            return value
        raise ConfigError(f"{self.source}: field {key!r} should be {kind.__name__}, got {value!r}")

    def req(self, key: str, kind: type = int):
        """Required key. Raises ConfigError "required field 'key' is missing" or a type error."""
        if self.raw.get(key) is None:
            raise ConfigError(f"{self.source}: required field {key!r} is missing")
        return self.typed(self.raw[key], key, kind)

    def opt(self, key: str, default, kind: type = int):
        """Optional key (``default`` when absent or null)."""
        if self.raw.get(key) is None:
            return default
        return self.typed(self.raw[key], key, kind)

    def at_least(self, key: str, value, low):
        """``value`` when >= ``low``. Raises ConfigError "<key> must be >= <low>, got <value>"."""
        if value < low:
            raise ConfigError(f"{self.source}: {key} must be >= {low}, got {value}")
        return value


def bos_id(value, source: str) -> int | None:
    """A ``bos_token_id`` value: None or an int >= 0. Raises ConfigError naming ``source``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: field 'bos_token_id' should be int, got {value!r}")
    if value < 0:
        raise ConfigError(f"{source}: bos_token_id must be >= 0, got {value}")
    return value


def eos_ids(value, source: str) -> tuple[int, ...]:
    """An ``eos_token_id`` value (None, an int or a list of ints >= 0) as a tuple. Raises ConfigError."""
    ids = tuple(value) if isinstance(value, list) else (() if value is None else (value,))
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(f"{source}: eos_token_id must be a non-negative integer or a list of them, got {value!r}")
    return ids


def architecture(f: Fields) -> tuple[str, str]:
    """(architecture, family) from ``architectures[0]``. Raises ConfigError naming the supported ones."""
    archs, supported = f.raw.get("architectures"), ", ".join(SUPPORTED_ARCHITECTURES)
    if archs is None:
        raise ConfigError(f"{f.source}: required field 'architectures' is missing (supported: {supported})")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{f.source}: field 'architectures' should be a non-empty list of class names such as "
                          f"[\"MixtralForCausalLM\"], got {archs!r}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{f.source}: unsupported architecture {archs[0]!r}; supported architectures: {supported}")
    return archs[0], SUPPORTED_ARCHITECTURES[archs[0]]


def _heads(f: Fields) -> dict[str, int]:
    """hidden_size, num_layers, num_heads, num_kv_heads, head_dim (null/absent: hidden_size // num_heads)."""
    hidden = f.at_least("hidden_size", f.req("hidden_size"), 1)
    num_layers = f.at_least("num_hidden_layers", f.req("num_hidden_layers"), 1)
    num_heads = f.at_least("num_attention_heads", f.req("num_attention_heads"), 1)
    num_kv_heads = f.at_least("num_key_value_heads", f.opt("num_key_value_heads", num_heads), 1)
    if num_heads % num_kv_heads:
        raise ConfigError(f"{f.source}: num_key_value_heads must divide num_attention_heads={num_heads}, "
                          f"got {num_kv_heads}")
    if f.raw.get("head_dim") is not None:
        head_dim = f.at_least("head_dim", f.req("head_dim"), 1)
    elif hidden < num_heads:
        raise ConfigError(f"{f.source}: head_dim is absent, so it is hidden_size // num_attention_heads, which needs "
                          f"hidden_size >= num_attention_heads={num_heads}, got hidden_size={hidden}")
    else:
        head_dim = hidden // num_heads
    return dict(hidden_size=hidden, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim)


def _experts(f: Fields, family: str) -> tuple[int, int]:
    """(num_experts, top_k): num_local_experts | num_experts (n_routed_experts for DeepSeek), num_experts_per_tok."""
    key = "num_local_experts" if f.raw.get("num_local_experts") is not None else "num_experts"
    if family in ("deepseek_v2", "deepseek_v3"):
        key = "n_routed_experts"
    if f.raw.get(key) is None:
        raise ConfigError(f"{f.source}: required field {key!r} is missing" if key == "n_routed_experts"
                          else f"{f.source}: required field 'num_local_experts' (or 'num_experts') is missing")
    num_experts = f.at_least(key, f.typed(f.raw[key], key, int), 1)
    top_k = f.req("num_experts_per_tok")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"{f.source}: num_experts_per_tok must be in [1, {key}={num_experts}], got {top_k}")
    return num_experts, top_k


def common_fields(f: Fields, arch: str, family: str, rope_raw: dict[str, Any]) -> dict[str, Any]:
    """The MoEConfig fields every family shares, as keyword arguments (clip_qkv and sliding_window None: the
    family builders that use them override). ``rope_raw``: the dict RoPE is read from (raw with the family's
    rope defaults filled in)."""
    heads = _heads(f)
    vocab_size = f.at_least("vocab_size", f.req("vocab_size"), 1)
    max_positions = f.at_least("max_position_embeddings", f.req("max_position_embeddings"), 1)
    num_experts, top_k = _experts(f, family)
    rms_norm_eps = f.req("rms_norm_eps", float)
    if not rms_norm_eps > 0:
        raise ConfigError(f"{f.source}: rms_norm_eps must be > 0, got {rms_norm_eps}")
    bos = bos_id(f.raw.get("bos_token_id"), f.source)
    hidden_act = f.opt("hidden_act", "silu", str)
    if hidden_act not in ACTIVATIONS:
        raise NotImplementedError(f"{f.source}: hidden_act {hidden_act!r} is not implemented (supported: "
                                  f"{', '.join(sorted(ACTIVATIONS))})")
    rope_theta, rope_scaling = read_rope(rope_raw, f.source)
    dtype_name = f.raw.get("dtype", f.raw.get("torch_dtype")) or "float32"
    if dtype_name not in DTYPES:
        raise ConfigError(f"{f.source}: dtype {dtype_name!r} not supported (supported: {sorted(DTYPES)})")
    eos = eos_ids(f.raw.get("eos_token_id"), f.source)
    return dict(
        family=family, architecture=arch, vocab_size=vocab_size, **heads, num_experts=num_experts, top_k=top_k,
        rope_theta=rope_theta, rope_scaling=rope_scaling, rms_norm_eps=rms_norm_eps, clip_qkv=None,
        sliding_window=None, tie_word_embeddings=f.opt("tie_word_embeddings", False, bool),
        max_position_embeddings=max_positions, bos_token_id=bos, eos_token_ids=eos,
        hidden_act=hidden_act, dtype=DTYPES[dtype_name], initializer_range=f.opt("initializer_range", 0.02, float),
        quantization=read_quantization(f.raw, f.source, family))
