"""RoPE settings of a config.json: the base ``rope_theta`` and the scaling (None = default RoPE, or YaRN's
:class:`RopeScaling`), from either key style: ``rope_parameters{rope_theta, rope_type, ...}`` (transformers 5) or
``rope_theta`` + ``rope_scaling{type | rope_type, ...}`` (Hub checkpoints). Keys of both styles that disagree are
refused rather than one of them silently winning."""

from __future__ import annotations

from typing import Any

from ft_jax.config.files import ConfigError
from ft_jax.config.record import RopeScaling

IMPLEMENTED_ROPE_TYPES = ("default", "yarn")


def rope_type(spec: dict[str, Any]) -> str:
    """The rope type a rope dict names ("rope_type", or the Hub's older "type"; "default" when neither)."""
    return spec.get("rope_type", spec.get("type", "default"))


def check_rope_keys_agree(raw: dict[str, Any], source: str) -> None:
    """Refuse a config.json whose ``rope_parameters`` and ``rope_scaling`` (or top-level ``rope_theta``) disagree.

    Only ``rope_parameters`` is read when both dicts are given, so a ``rope_scaling`` of another type (e.g.
    ``{"type": "dynamic"}`` beside default ``rope_parameters``) or another value for a key both hold would be
    ignored and the model would decode with RoPE the checkpoint was not trained with.

    Raises:
        ConfigError: "<source>: rope_scaling {...} (type 'dynamic') disagrees with rope_parameters {...} (type
            'default'); ..." naming both keys and their values; the same for a shared key or rope_theta.
    """
    params, scaling = raw.get("rope_parameters"), raw.get("rope_scaling")
    if not isinstance(params, dict):
        return
    if isinstance(scaling, dict):
        if rope_type(scaling) != rope_type(params):
            raise ConfigError(f"{source}: rope_scaling {scaling!r} (type {rope_type(scaling)!r}) disagrees with "
                              f"rope_parameters {params!r} (type {rope_type(params)!r}); give the RoPE settings in "
                              f"one of the two keys (implemented types: {', '.join(IMPLEMENTED_ROPE_TYPES)})")
        for key in sorted((set(params) & set(scaling)) - {"rope_type", "type"}):
            if params[key] != scaling[key]:
                raise ConfigError(f"{source}: rope_scaling.{key}={scaling[key]!r} disagrees with "
                                  f"rope_parameters.{key}={params[key]!r}")
    theta = raw.get("rope_theta")
    if theta is not None and params.get("rope_theta") is not None and theta != params["rope_theta"]:
        raise ConfigError(f"{source}: rope_theta={theta!r} disagrees with rope_parameters.rope_theta="
                          f"{params['rope_theta']!r}")


def read_rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(RoPE base, YaRN scaling or None) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (Hub).

    Raises:
        ConfigError: the two key styles disagree (:func:`check_rope_keys_agree`), rope_theta missing, not a number
            or <= 0, a YaRN field that is not a positive number. Messages name ``source``.
        NotImplementedError: a rope type other than default / yarn, or partial_rotary_factor != 1 (names the type).
    """
    check_rope_keys_agree(raw, source)
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
    kind = rope_type(spec)
    if kind not in IMPLEMENTED_ROPE_TYPES:
        raise NotImplementedError(f"{source}: RoPE scaling type {kind!r} is not implemented "
                                  f"(supported: {', '.join(IMPLEMENTED_ROPE_TYPES)})")
    if partial not in (None, 1, 1.0):
        raise NotImplementedError(f"{source}: partial_rotary_factor={partial} is not implemented")
    if theta is None:
        raise ConfigError(f"{source}: required field 'rope_theta' (or 'rope_parameters.rope_theta') is missing")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{source}: field 'rope_theta' should be a number, got {theta!r}")
    if not theta > 0:
        raise ConfigError(f"{source}: rope_theta must be > 0, got {theta}")
    if kind == "default":
        return float(theta), None
    return float(theta), _yarn(raw, spec, source)


def _yarn(raw: dict[str, Any], spec: dict[str, Any], source: str) -> RopeScaling:
    """YaRN's RopeScaling from the rope dict ``spec`` (and raw's original_max_position_embeddings)."""

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
    return RopeScaling(
        factor=float(number("factor")), original_max_position_embeddings=int(original),
        beta_fast=float(number("beta_fast", 32.0)), beta_slow=float(number("beta_slow", 1.0)),
        truncate=bool(spec.get("truncate", True)), mscale=float(number("mscale", 0.0, positive=False)),
        mscale_all_dim=float(number("mscale_all_dim", 0.0, positive=False)),
        attention_factor=None if attention_factor is None else float(number("attention_factor")))
