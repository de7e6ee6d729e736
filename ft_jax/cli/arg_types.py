"""Argument types shared by the subcommands: each parses one flag's text or raises argparse.ArgumentTypeError with a
one-line message naming what was expected and what was given."""

from __future__ import annotations

import argparse
import math
import re

from ft_jax import units, weight_formats

SEED_MAX = 2**32 - 1  # jax.random.key keeps 32 bits of a seed without jax_enable_x64: larger seeds would collide
INT32_MAX = 2**31 - 1  # top-k and a fixed-cap K are int32 operands of the decode step


def _number(text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        return None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _number(text, int)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _number(text, int)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port number in [1, 65535] (0 is refused: the server would listen on a port nobody knows)."""
    value = _number(text, int)
    if value is None or not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in [1, 65535], got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A finite number >= 0."""
    value = _number(text)
    if value is None or not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def positive(text: str) -> float:
    """A finite number > 0."""
    value = _number(text)
    if value is None or not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def model_folder(text: str) -> str:
    """--model: a non-empty path (an empty one would fall back to the bundled model without a word)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the model folder is empty: give a path, or leave --model out for the "
                                         "bundled model")
    return text


def bandwidth_gbps(text: str) -> float:
    """A bandwidth in GB/s within cost_model.BANDWIDTH_RANGE_GBPS (1 kB/s to 1 PB/s)."""
    from ft_jax.offload.cost_model import BANDWIDTH_RANGE_GBPS

    low, high = BANDWIDTH_RANGE_GBPS
    value = _number(text)
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected a bandwidth in GB/s from {low:g} to {high:g}, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(text)
    if value is None or not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def top_k(text: str) -> int:
    """An integer in [0, 2^31) (0 = off)."""
    value = _number(text, int)
    if value is None or not 0 <= value <= INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0 = off), got {text!r}")
    return value


def seed(text: str) -> int:
    """An integer in [0, 2^32 - 1]."""
    value = _number(text, int)
    if value is None or not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {SEED_MAX}] (32 bits), got {text!r}")
    return value


def byte_count(text: str) -> int:
    """A byte count with a unit (units.parse_bytes): "8GiB" -> 8589934592."""
    try:
        return units.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def byte_text(text: str) -> str:
    """A byte count with a unit, checked and kept as text (ft_jax.load's cache= takes "8GiB" as bytes, an int as
    slots)."""
    byte_count(text)
    return text


def dtype(text: str) -> str:
    """bf16/bfloat16 -> "bfloat16", f32/float32 -> "float32" (any case; "auto" is the default, not a choice)."""
    name = units.DTYPE_NAMES.get(text.strip().lower())
    if name is None or name == "auto":
        raise argparse.ArgumentTypeError(f"expected bf16, bfloat16, f32 or float32, got {text!r}")
    return name


def model_dtype(text: str) -> str | None:
    """A model's dtype for generate / serve: as :func:`dtype`, or "auto" (any case) -> None, the checkpoint's dtype
    (what ft_jax.load(dtype="auto") and leaving the flag out do)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return dtype(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, bf16, bfloat16, f32 or float32, got {text!r}") from None


QUANTIZE_HELP = ("quantize a float (bf16/f32) checkpoint while loading: q8_0 or q4_0 (llama.cpp's block formats, "
                 "32 values per f16 scale) for the expert banks and every dense 2-D projection but the routers and the "
                 "embedding table (as llama-quantize --pure, which quantizes the embedding too); FP8 and MXFP4 "
                 "checkpoints are used as stored without it")


def quantize(text: str) -> str:
    """--quantize: "q8_0" or "q4_0" (any case), normalized as ft_jax.load(quantize=...) is
    (weight_formats.quantize_choice)."""
    try:
        return weight_formats.quantize_choice(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(weight_formats.QUANTIZE_CHOICES)}, "
                                         f"got {text!r}") from None


def token_ids(text: str) -> list[int]:
    """Comma- or space-separated integers: "1,17,42" (an empty item, as in "1,,2", is refused)."""
    items = re.split(r"\s*,\s*|\s+", text.strip())
    if not text.strip():
        raise argparse.ArgumentTypeError("expected comma-separated integers, got nothing")
    try:
        return [int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def comma_list(kind, what: str):
    """A type for a comma-separated list of `kind` values (each parsed by kind; ValueError -> a message naming
    `what`)."""
    def parse(text: str) -> list:
        items = text.split(",")
        if not text.strip() or any(not item.strip() for item in items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
        values = []
        for item in items:
            try:
                values.append(kind(item.strip()))
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return values

    return parse


def policy(text: str):
    """A policy name (ft_jax.offload.policy.parse_policy), a fixed-cap K <= 2^31 - 1; returns the Policy."""
    from ft_jax.offload.policy import parse_policy

    try:
        value = parse_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("policy: ")) from None  # argparse names the flag
    if value.cap is not None and value.cap > INT32_MAX:
        raise argparse.ArgumentTypeError(f"the cap in {text!r} must be at most {INT32_MAX} (a count of misses per "
                                         "layer)")
    return value


def policy_list(what: str):
    """A type for a comma-separated list of policies."""
    return comma_list(policy, what)
