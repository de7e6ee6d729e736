"""Units of what users type and read: byte counts ("8GiB"), dtype names ("bf16") and counted nouns ("1 token"),
parsed and shown in one place."""

from __future__ import annotations

import fractions
import re

SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "tib": 2**40}
DTYPE_NAMES = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32", "float32": "float32"}


def parse_bytes(text: str) -> int:
    """A byte count with an optional unit: "512MiB", "2GB", "1.5g", "4096". KB/MB/GB/TB are powers of 1000;
    KiB/MiB/GiB/TiB (and K/M/G) powers of 1024; a fraction needs a unit larger than a byte ("1.5" and "1.5b" are
    refused, "1.5GiB" is not; "1.5KB" is 1500; "3.3KiB", 3379.2 bytes, is 3379: whole bytes, rounded down). Any
    size, without float rounding or overflow (rational arithmetic).
    Raises ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in SIZE_UNITS:
        raise ValueError(f"not a byte count: {text!r} (examples: 4096, 512MiB, 2GB)")
    unit = SIZE_UNITS[m.group(2).lower()]
    nbytes = fractions.Fraction(m.group(1)) * unit  # exact: no float rounding or overflow
    if nbytes.denominator != 1 and unit == 1:
        raise ValueError(f"not a whole number of bytes: {text!r} (a fraction needs a unit larger than a byte, e.g. "
                         f"{m.group(1)}GiB)")
    return int(nbytes)


def format_bytes(n: float) -> str:
    """A byte count in the largest binary unit that keeps it >= 1, two decimals: 1536 -> "1.50 KiB",
    3 * 2**30 -> "3.00 GiB", 100 -> "100 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_dtype(text: str) -> str:
    """"auto", or bf16/bfloat16 -> "bfloat16", f32/float32 -> "float32" (any case). Raises ValueError otherwise."""
    name = DTYPE_NAMES.get(str(text).strip().lower())
    if name is None:
        raise ValueError(f"dtype must be one of bf16, bfloat16, f32, float32 or auto, got {text!r}")
    return name


def model_dtype(dtype: str, checkpoint_dtype: str) -> str:
    """The dtype to load with: ``dtype`` unless "auto", which is float32 for float32 checkpoints, else bfloat16."""
    dtype = parse_dtype(dtype)
    if dtype != "auto":
        return dtype
    return "float32" if checkpoint_dtype == "float32" else "bfloat16"


def count(n: int, noun: str) -> str:
    """``n`` and ``noun`` in the plural unless n is 1: "1 token", "2 tokens", "0 rows" (English nouns that take -s)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
