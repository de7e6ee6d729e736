"""Bandwidth profiles: the record, its machine key, and JSON storage in the user cache directory.

A profile holds the two bandwidths the q* policy needs (docs/DESIGN.md sections 1 and 7), measured by
`ft_jax.tools.profiler` with the production FFI handlers at one expert size:

- ``bp``: slot fill bandwidth (host bank -> device slots), GB/s of expert weight bytes copied.
- ``bh``: host expert GEMV bandwidth, GB/s of expert weight bytes read by ``host_experts``.
- ``bp_contended`` / ``bh_contended``: the same two while both run at the same time (None if not measured).

All bandwidths are in GB/s with 1 GB = 1e9 bytes.

Storage format (JSON, one file for all profiles of all machines that share the cache directory)::

    {"schema_version": 1,
     "profiles": [{"key": {"platform": ..., "device_kind": ..., "cpu_model": ..., "cpu_count": ...,
                           "dtype": ..., "expert_bytes": ...},
                   "bp": ..., "bh": ..., "bp_contended": ..., "bh_contended": ...,
                   "spreads": {"bp": [min, max], ...}, "repeats": ..., "quick": ..., ...}, ...]}

Default location: ``$XDG_CACHE_HOME/ft_jax/profiles.json`` (when XDG_CACHE_HOME is set to an absolute path), else
``~/.cache/ft_jax/profiles.json``. Files are written atomically (a temporary file in the same directory, then
``os.replace``). Profiles of other machines are kept in the file but never used here. What loading and saving do with
a file that is not a clean profile store (``inspect_file`` decides):

- another schema version: ignored with a message; saving moves it aside to ``<name>.other-schema`` (with a warning).
- a corrupted ft_jax file (text starting with ``{`` that mentions "profiles" or "schema_version" but does not parse,
  or a JSON object with one of those keys of the wrong shape): ignored with a warning; saving moves it aside to
  ``<name>.corrupt`` (with a warning), never deletes it.
- anything else (a directory, an unreadable file, non-JSON text, JSON that is not an ft_jax store): ignored with a
  warning; saving refuses with ``NotAProfileStoreError`` naming the file, so an unrelated file is never replaced.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
PROFILE_FILENAME = "profiles.json"

# Names of the four measured bandwidths (Profile fields and keys of Profile.spreads).
BANDWIDTH_FIELDS = ("bp", "bh", "bp_contended", "bh_contended")


class ProfileFormatError(ValueError):
    """A profile entry is missing a field or has a field of the wrong type/value."""


class NotAProfileStoreError(OSError):
    """The profile path exists but is not an ft_jax profile store (a directory, an unreadable file, or other content).

    Raised by ``save_profile`` / ``check_profile_path`` instead of writing over it; the message names the file.
    A subclass of OSError so that callers treating "could not save" as an OSError keep working.
    """


@dataclasses.dataclass(frozen=True)
class ProfileKey:
    """What a profile is valid for: the machine (device and host CPU) and the expert size.

    Fields:
        platform: ``jax.devices()[0].platform`` (e.g. "cpu", "gpu").
        device_kind: ``jax.devices()[0].device_kind`` (e.g. "cpu", "NVIDIA H200").
        cpu_model: host CPU model name (``model name`` in /proc/cpuinfo, else ``platform.processor()``).
        cpu_count: logical host cores (``os.cpu_count()``).
        dtype: expert weight dtype name ("bfloat16" or "float32").
        expert_bytes: bytes of one expert (gate_up row + down row = 3 * H * I * itemsize).
    """

    platform: str
    device_kind: str
    cpu_model: str
    cpu_count: int
    dtype: str
    expert_bytes: int

    def same_machine(self, other: "ProfileKey") -> bool:
        """True when ``other`` describes the same device and host CPU (dtype and expert size may differ)."""
        return (self.platform, self.device_kind, self.cpu_model, self.cpu_count) == (
            other.platform,
            other.device_kind,
            other.cpu_model,
            other.cpu_count,
        )

    def describe_machine(self) -> str:
        """Short human description of the machine part of the key."""
        return f"{self.platform}/{self.device_kind}, host CPU {self.cpu_model!r} x {self.cpu_count}"

    def describe(self) -> str:
        """Short human description of the whole key."""
        return f"{self.describe_machine()}, {self.dtype}, expert {self.expert_bytes / 2**20:.2f} MiB"


@dataclasses.dataclass
class Profile:
    """One bandwidth profile (all bandwidths in GB/s, 1 GB = 1e9 bytes; medians over repeats).

    Fields:
        key: the ProfileKey the measurement is valid for.
        bp, bh: standalone slot fill / host expert GEMV bandwidth (> 0).
        bp_contended, bh_contended: the same two measured while both run at once, or None.
        spreads: {"bp": (min, max), "bh": ..., "bp_contended": ..., "bh_contended": ...} over the repeats
            (only for the measured bandwidths).
        repeats: timed repeats per bandwidth.
        quick: True for a quick (<= 5 s) profile.
        measured_at: ISO 8601 UTC timestamp.
        hidden_size, intermediate_size: expert dimensions H and I used.
        details: free-form measurement facts (working-set sizes, last-level cache size, overlap check, jax version).
    """

    key: ProfileKey
    bp: float
    bh: float
    bp_contended: float | None = None
    bh_contended: float | None = None
    spreads: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    repeats: int = 0
    quick: bool = False
    measured_at: str = ""
    hidden_size: int = 0
    intermediate_size: int = 0
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def fraction(self) -> float:
        """Fraction of misses to fetch into slots, ``policy.fraction_from_bandwidth`` of the stored bandwidths.

        docs/DESIGN.md section 1: with a contended pair, BPc / (BPc + BHc); else min(1, BP / BH); BH <= BP gives 1.
        """
        from ft_jax.offload import policy  # lazy: policy belongs to the cache module and pulls in jax

        return float(policy.fraction_from_bandwidth(self.bp, self.bh, self.bp_contended, self.bh_contended))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        d = dataclasses.asdict(self)
        d["spreads"] = {k: [float(lo), float(hi)] for k, (lo, hi) in self.spreads.items()}
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Profile":
        """Parse a dict written by ``to_dict``.

        Raises:
            ProfileFormatError: a field is missing, has the wrong type, or a bandwidth is not a positive finite number.
        """
        if not isinstance(d, dict):
            raise ProfileFormatError(f"profile entry: expected a JSON object, got {type(d).__name__}")
        kd = d.get("key")
        if not isinstance(kd, dict):
            raise ProfileFormatError("profile entry: field 'key' missing or not an object")
        key_types = {f.name: f.type for f in dataclasses.fields(ProfileKey)}
        key_args = {}
        for name, typ in key_types.items():
            if name not in kd:
                raise ProfileFormatError(f"profile entry: field 'key.{name}' missing")
            value = kd[name]
            want = int if typ == "int" else str
            if not isinstance(value, want) or isinstance(value, bool):
                raise ProfileFormatError(
                    f"profile entry: field 'key.{name}' expected {want.__name__}, got {type(value).__name__}"
                )
            key_args[name] = value
        args: dict[str, Any] = {"key": ProfileKey(**key_args)}
        for name in BANDWIDTH_FIELDS:
            value = d.get(name)
            if value is None and name.endswith("_contended"):
                args[name] = None
                continue
            args[name] = _positive_float(value, name)
        spreads = d.get("spreads", {})
        if not isinstance(spreads, dict):
            raise ProfileFormatError("profile entry: field 'spreads' is not an object")
        parsed_spreads = {}
        for name, pair in spreads.items():
            if name not in BANDWIDTH_FIELDS or not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ProfileFormatError(f"profile entry: spreads[{name!r}] expected [min, max] of a bandwidth")
            parsed_spreads[name] = (_positive_float(pair[0], f"spreads.{name}"),
                                    _positive_float(pair[1], f"spreads.{name}"))
        args["spreads"] = parsed_spreads
        for name, want, default in (
            ("repeats", int, 0),
            ("quick", bool, False),
            ("measured_at", str, ""),
            ("hidden_size", int, 0),
            ("intermediate_size", int, 0),
            ("details", dict, {}),
        ):
            value = d.get(name, default)
            if not isinstance(value, want):
                raise ProfileFormatError(
                    f"profile entry: field {name!r} expected {want.__name__}, got {type(value).__name__}"
                )
            args[name] = value
        return cls(**args)


def _positive_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProfileFormatError(f"profile entry: field {name!r} expected a positive finite number, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------------------------------
# Machine identification
# ---------------------------------------------------------------------------------------------------------------------


def host_cpu_model() -> str:
    """Host CPU model: the first ``model name`` line of /proc/cpuinfo, else ``platform.processor()``, else "unknown"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() in ("model name", "Model", "cpu model"):
                    value = value.strip()
                    if value:
                        return value
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name for keys: "bfloat16" or "float32" (accepts numpy/jax dtypes and common aliases).

    Raises:
        ValueError: any other dtype.
    """
    aliases = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32"}
    if isinstance(dtype, str):
        name = aliases.get(dtype.lower(), dtype.lower())
    else:
        import numpy as np

        try:
            import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
        except ImportError:  # pragma: no cover - jax always ships ml_dtypes
            pass
        name = np.dtype(dtype).name
    if name not in ("bfloat16", "float32"):
        raise ValueError(f"expert dtype: expected bfloat16 or float32, got {dtype!r}")
    return name


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of an expert dtype (2 for bfloat16, 4 for float32)."""
    return {"bfloat16": 2, "float32": 4}[dtype_name(dtype)]


def expert_nbytes(hidden_size: int, intermediate_size: int, dtype: Any) -> int:
    """Bytes of one expert: gate_up row [2I, H] + down row [H, I] = 3 * H * I * itemsize."""
    return 3 * int(hidden_size) * int(intermediate_size) * dtype_itemsize(dtype)


def current_key(dtype: Any, expert_bytes: int) -> ProfileKey:
    """ProfileKey of this process: the first jax device, this host's CPU model and core count."""
    import jax

    device = jax.devices()[0]
    return ProfileKey(
        platform=str(device.platform),
        device_kind=str(device.device_kind),
        cpu_model=host_cpu_model(),
        cpu_count=int(os.cpu_count() or 1),
        dtype=dtype_name(dtype),
        expert_bytes=int(expert_bytes),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------------


def default_profile_path() -> Path:
    """``$XDG_CACHE_HOME/ft_jax/profiles.json`` if XDG_CACHE_HOME is an absolute path, else ``~/.cache/ft_jax/...``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "ft_jax" / PROFILE_FILENAME


def inspect_file(path: str | os.PathLike) -> tuple[str, Any]:
    """Classify a profile path without changing it.

    Returns (kind, info):
        ("absent", None): nothing there.
        ("store", doc): an ft_jax profile store of this schema version (doc: the parsed JSON object).
        ("other-schema", version): an ft_jax profile store of another schema version.
        ("corrupted", reason): looks like an ft_jax store (see the module docstring) but cannot be used.
        ("foreign", reason): a directory, an unreadable file, or a file that is not an ft_jax store.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return "absent", None
    if path.is_dir():
        return "foreign", "it is a directory"
    if not path.is_file():
        return "foreign", "it is not a regular file"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        return "foreign", f"it could not be read: {e.strerror or e}"
    except UnicodeDecodeError:
        return "foreign", "it is not UTF-8 text"
    looks_ours = text.lstrip().startswith("{") and ('"profiles"' in text or '"schema_version"' in text)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return ("corrupted", f"invalid JSON: {e}") if looks_ours else ("foreign", "it is not JSON")
    if not isinstance(doc, dict) or not ("profiles" in doc or "schema_version" in doc):
        return "foreign", "it is JSON without the 'schema_version' and 'profiles' fields"
    if "schema_version" in doc and doc["schema_version"] != SCHEMA_VERSION:
        return "other-schema", doc["schema_version"]
    if doc.get("schema_version") != SCHEMA_VERSION or not isinstance(doc.get("profiles"), list):
        return "corrupted", "expected an object with 'schema_version' 1 and a 'profiles' list"
    return "store", doc


def read_profiles(path: str | os.PathLike | None = None) -> tuple[list[Profile], str]:
    """Read every valid profile entry of a profile file.

    Returns:
        (profiles, message). ``message`` is "" when the file was read cleanly or does not exist; it explains why
        the file (another schema version, corrupted, not a profile store) or some entries (bad fields) were ignored
        otherwise. A corrupted file, a path that is not a profile store, or bad entries also raise a ``UserWarning``;
        callers then measure a fresh profile.
    """
    path = Path(path) if path is not None else default_profile_path()
    kind, info = inspect_file(path)
    if kind == "absent":
        return [], ""
    if kind == "other-schema":
        return [], (f"bandwidth profile file {path} has schema version {info!r}, expected {SCHEMA_VERSION}; "
                    f"ignoring it (saving a profile moves it to {path}.other-schema)")
    if kind in ("corrupted", "foreign"):
        if kind == "corrupted":
            msg = (f"bandwidth profile file {path} is corrupted ({info}); ignoring it (saving a profile moves it "
                   f"to {path}.corrupt)")
        else:
            msg = (f"{path} is not an ft_jax bandwidth profile file ({info}); ignoring it, and no profile is saved "
                   "over it")
        warnings.warn(msg, stacklevel=2)
        return [], msg
    profiles, problems = _parse_entries(info)
    msg = ""
    if problems:
        msg = f"bandwidth profile file {path}: ignored {len(problems)} invalid entries ({'; '.join(problems)})"
        warnings.warn(msg, stacklevel=2)
    return profiles, msg


def _parse_entries(doc: dict[str, Any]) -> tuple[list[Profile], list[str]]:
    profiles, problems = [], []
    for i, entry in enumerate(doc["profiles"]):
        try:
            profiles.append(Profile.from_dict(entry))
        except ProfileFormatError as e:
            problems.append(f"entry {i}: {e}")
    return profiles, problems


def check_profile_path(path: str | os.PathLike | None = None) -> Path:
    """The path ``save_profile`` would write (default: default_profile_path()), checked before measuring.

    Raises:
        NotAProfileStoreError: the path is a directory, unreadable, or a file that is not an ft_jax profile store.
    """
    path = Path(path) if path is not None else default_profile_path()
    kind, info = inspect_file(path)
    if kind == "foreign":
        raise NotAProfileStoreError(f"{path} is not an ft_jax bandwidth profile file ({info}); not writing over it "
                                    f"(give another --profile path, or move that file)")
    return path


def load_profile(key: ProfileKey, path: str | os.PathLike | None = None) -> tuple[Profile | None, str]:
    """The stored profile for ``key`` (exact match on every key field), or None with a message saying why not.

    A profile measured on another machine (device or host CPU differ) or for another dtype / expert size is never
    returned; the message names what was found instead.
    """
    path = Path(path) if path is not None else default_profile_path()
    profiles, msg = read_profiles(path)
    notes = [msg] if msg else []
    matching = [p for p in profiles if p.key == key]
    if matching:
        return matching[-1], f"using the bandwidth profile stored in {path} (measured {matching[-1].measured_at})"
    same_machine = [p for p in profiles if p.key.same_machine(key)]
    if same_machine:
        sizes = ", ".join(f"{p.key.dtype} {p.key.expert_bytes / 2**20:.2f} MiB" for p in same_machine)
        notes.append(f"{path} has profiles of this machine only for other expert sizes ({sizes})")
    elif profiles:
        others = "; ".join(sorted({p.key.describe_machine() for p in profiles}))
        notes.append(f"ignoring the profiles in {path}: they are for another machine ({others}), "
                     f"this is {key.describe_machine()}")
    elif not notes:
        notes.append(f"no bandwidth profile stored in {path}")
    return None, "; ".join(notes)


def save_profile(profile: Profile, path: str | os.PathLike | None = None) -> Path:
    """Store ``profile`` (replacing an entry with the same key, keeping other valid entries), atomically.

    The file is written to a temporary file in the same directory and moved into place with ``os.replace``, so
    readers see either the old or the new file, and no temporary file remains (also on error). Invalid entries of
    an existing store are dropped (``read_profiles`` warned about them). A corrupted ft_jax file or one with another
    schema version is first moved aside to ``<name>.corrupt`` / ``<name>.other-schema`` (``.1``, ``.2``, ... appended
    if that name exists) with a ``UserWarning``; nothing is deleted.

    Returns:
        The path written.
    Raises:
        NotAProfileStoreError: the path is a directory, unreadable, or a file that is not an ft_jax profile store
            (it is left untouched).
        OSError: the directory cannot be created or written.
    """
    path = check_profile_path(path)
    kind, info = inspect_file(path)
    existing: list[Profile] = []
    if kind == "store":
        existing = _parse_entries(info)[0]
    elif kind in ("corrupted", "other-schema"):
        aside = _move_aside(path, ".corrupt" if kind == "corrupted" else ".other-schema")
        what = "corrupted" if kind == "corrupted" else f"of schema version {info!r}"
        warnings.warn(f"bandwidth profile file {path} was {what}: moved it to {aside}", stacklevel=2)
    entries = [p.to_dict() for p in existing if p.key != profile.key] + [profile.to_dict()]
    doc = {"schema_version": SCHEMA_VERSION, "profiles": entries}
    _atomic_write_text(path, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def _move_aside(path: Path, suffix: str) -> Path:
    """Rename ``path`` to ``path + suffix`` (or ``path + suffix + ".N"``, the first N that does not exist)."""
    aside, n = path.with_name(path.name + suffix), 0
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{path.name}{suffix}.{n}")
    os.rename(path, aside)
    return aside


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
