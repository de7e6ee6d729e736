"""Compiled prefill and decode steps kept on disk, keyed by everything their trace reads, so that a launch that builds
the steps of an earlier launch loads them without tracing or lowering.

Why: JAX's persistent compilation cache keys an executable by the lowered module, so a launch still traces and lowers
every step before it can look one up: 0.13-0.15 s per step on the bench model of scripts/bench_load.py, 0.3 s of its
1.8 s launch; loading the executable itself takes 0.015-0.02 s (docs/DESIGN.md sec. 20.30).

The key (step_key) is a SHA-256 over:
  - the environment (environment_digest, once per process): the versions of Python, jax, jaxlib, flax and numpy; the
    bytes of every ft_jax module and of the ft_jax._ffi extension; the backend, its devices and the CPU's feature
    flags (XLA:CPU compiles for the host's ISA); XLA_FLAGS and the FT_JAX_* variables; every jax.config value but
    where executables are cached;
  - the thread's trace context (jax._src.config.trace_context, as jax.jit's own caches key on it);
  - the step: its kind, its static arguments, the compiler options;
  - its arguments' tree structure (nnx State paths, HostWeights' bank ids) and each leaf's shape, dtype, weak type
    and sharding;
  - what the step function closes over: the model's nnx GraphDef (every static attribute: the config) and the expert
    backend (policy, banks: id, rows, row shape and dtype of each), described field by field (describe). A value of
    a type describe does not know, or an object's address in the text, makes the step uncacheable (traced and
    compiled as before), never a partial key.
An executable references its host banks by id; the key holds the ids, and a process that gets the same key has built
the same banks under the same ids (the loader allocates them in a fixed order: ft_jax.checkpoint). The handlers'
instantiation refuses a bank that was released, so an entry naming one fails to load rather than run.

Only executables XLA compiled in this process can be stored: XLA:CPU cannot serialize again an executable it loaded
from JAX's persistent cache (the copy fails at its first run: "Function wrapped_iota not found"). So a step missing
here is compiled with JAX's cache bypassed (jax_cache_bypassed), once per key: after an upgrade of ft_jax, the first
launch of each configuration compiles its steps (0.6-0.8 s each on the bench model) where JAX's cache could have
loaded them (0.13-0.15 s). Entries are written atomically (a temporary file renamed); an entry that cannot be read or
loaded is removed and its step compiled as without this cache. At most MAX_ENTRIES entries, the least recently used
go first. Executables are loaded with jax's serialize_executable, which, like JAX's persistent cache, trusts the files
of the user's own cache folder. On the CPU backend only (where it is tested), for an Engine of one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import os
import pickle
import platform
import sys
import threading
import types
from collections.abc import Mapping
from pathlib import Path

import flax
import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

import ft_jax
from ft_jax import _ffi
from ft_jax.cache_dirs import replace_file
from ft_jax.kernels.host_bank import HostBank
from ft_jax.offload.profile import cpuinfo

FORMAT = 1  # of the key and the entries
FOLDER = "ft_jax_steps"  # inside JAX's compilation cache folder
MAX_ENTRIES = 256  # files of 0.2-0.3 MB on the bench model, more for deeper models
_MAX_ARRAY_BYTES = 1 << 20  # a closed-over numpy array up to this size is described by its bytes
_CACHE_SETTINGS = ("jax_compilation_cache", "jax_enable_compilation_cache", "jax_persistent_cache",
                   "jax_raise_persistent_cache_errors")  # jax.config names of where executables are cached


class Uncacheable(Exception):
    """A value the key cannot describe: the step is traced and compiled as without a cache."""


def describe(obj, depth: int = 0) -> str:
    """A canonical text of ``obj`` that two processes give alike exactly when their traces would read the same
    values: scalars and strings by repr, enums and types by qualified name, numpy dtypes by name, small numpy arrays by
    their bytes, tuples / lists / NamedTuples / mappings / dataclasses item by item with their type's name, pytree
    definitions as jax prints them (custom nodes with their static data), host banks by id, rows, row shape and dtype,
    a jax Mesh by its devices and axes, module-level functions by name (their code is in environment_digest).

    Raises Uncacheable: any other type (an object whose state describe cannot see), a function with a closure,
    a large array, nesting deeper than 64."""
    if depth > 64:
        raise Uncacheable("nested deeper than 64")
    d = depth + 1
    if isinstance(obj, enum.Enum):  # before str and int: a str or int enum is its member
        return f"{_name(type(obj))}.{obj.name}"
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, type):
        return f"type:{_name(obj)}"
    if isinstance(obj, np.dtype):
        return f"dtype:{obj.name}"
    if isinstance(obj, np.generic):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, np.ndarray):
        if obj.nbytes > _MAX_ARRAY_BYTES:
            raise Uncacheable(f"a numpy array of {obj.nbytes} bytes")
        digest = hashlib.sha256(np.ascontiguousarray(obj).view(np.uint8).reshape(-1).tobytes()).hexdigest()
        return f"ndarray:{obj.shape}:{obj.dtype.name}:{digest}"
    if isinstance(obj, HostBank):
        return f"HostBank(id={obj.id}, rows={obj.num_rows}, row_shape={tuple(obj.row_shape)}, dtype={obj.dtype.name})"
    if isinstance(obj, jax.tree_util.PyTreeDef):
        return f"treedef:{obj}"
    if isinstance(obj, jax.sharding.Mesh):
        return f"mesh:{obj.axis_names}:{obj.devices.shape}:{[dv.id for dv in obj.devices.flat]}"
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        if getattr(obj, "__closure__", None):
            raise Uncacheable(f"function {obj.__qualname__} with a closure")
        return f"function:{obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return f"{_name(type(obj))}(" + ",".join(f"{f}={describe(getattr(obj, f), d)}" for f in obj._fields) + ")"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__}[" + ",".join(describe(x, d) for x in obj) + "]"
    if isinstance(obj, Mapping):
        items = sorted((describe(k, d), describe(v, d)) for k, v in obj.items())
        return f"{_name(type(obj))}{{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if dataclasses.is_dataclass(obj):
        fields = ",".join(f"{f.name}={describe(getattr(obj, f.name), d)}" for f in dataclasses.fields(obj))
        return f"{_name(type(obj))}({fields})"
    raise Uncacheable(f"a value of type {_name(type(obj))}")


def _name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


_environment: str | None = None
_environment_lock = threading.Lock()


def environment_digest() -> str:
    """The SHA-256 (hex) of what every step's executable depends on besides the step itself (module docstring),
    computed once per process (about 5 ms: ft_jax's modules and extension are read).

    Raises Uncacheable: ft_jax installed without its .py sources (e.g. bytecode only)."""
    global _environment
    with _environment_lock:
        if _environment is None:
            h = hashlib.sha256()
            for part in _environment_parts():
                h.update(part.encode() if isinstance(part, str) else part)
                h.update(b"\0")
            _environment = h.hexdigest()
        return _environment


def _environment_parts():
    import jaxlib

    yield f"format {FORMAT}"
    yield f"python {sys.version}; {platform.machine()}"
    yield f"jax {jax.__version__}; jaxlib {jaxlib.__version__}; flax {flax.__version__}; numpy {np.__version__}"
    package = Path(ft_jax.__file__).parent
    sources = sorted(package.rglob("*.py"))
    if Path(__file__) not in sources:  # installed without its sources: a change of the code could not be seen
        raise Uncacheable(f"ft_jax's sources are not in {package}")
    for path in sources:
        yield str(path.relative_to(package))
        yield path.read_bytes()
    yield Path(_ffi.__file__).read_bytes()
    devices = jax.devices()
    yield f"backend {jax.default_backend()}; {devices[0].client.platform_version}"
    yield ";".join(f"{d.id}:{d.device_kind}:{d.process_index}" for d in devices)
    yield f"processes {jax.process_count()}; process {jax.process_index()}"
    yield _cpu_flags()
    yield ";".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k == "XLA_FLAGS" or k.startswith("FT_JAX_"))
    yield ";".join(f"{k}={v!r}" for k, v in sorted(jax.config.values.items())
                   if not k.startswith(_CACHE_SETTINGS))  # where executables are cached changes no program


def _cpu_flags() -> str:
    """The processor's model name and feature flags (/proc/cpuinfo), or the platform's processor string."""
    fields = cpuinfo("model name", "flags", "Features")
    return str(fields) if fields else platform.processor()


def step_key(kind: str, static: dict, args: tuple, closure: tuple, compiler_options: dict) -> str | None:
    """The cache key (hex SHA-256) of a step: ``kind`` ("prefill", "decode", "decode_rows"), its static arguments,
    its arguments (only their tree structure and each leaf's shape, dtype, weak type and sharding matter), what its
    function closes over (the GraphDef and the expert backend) and the compiler options. None when describe cannot
    describe a part, or when the text holds an object's address (the step is then compiled as without a cache: a key
    that differs at every launch would compile it at every launch)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    try:
        parts = [environment_digest(), _trace_context(), kind, describe(static), describe(compiler_options),
                 describe(treedef), describe(closure)]
        for leaf in leaves:
            parts.append(_leaf(leaf))
    except Uncacheable:
        return None
    text = "\n".join(parts)
    if " at 0x" in text:  # an object's address (a repr inside a pytree's static data): a key no other process gets
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _trace_context() -> str:
    """The thread's JAX configuration as jax.jit's own cache keys see it (jax._src.config.trace_context: e.g. a
    ``with jax.default_matmul_precision(...)`` around generate), objects by their slots' values."""
    from jax._src import config

    texts = []
    for value in config.trace_context():
        text = repr(value)
        if " at 0x" in text:  # e.g. core.AxisEnv (empty outside shard_map)
            slots = [s for s in getattr(type(value), "__slots__", ()) if s != "__weakref__"]
            if not slots:
                raise Uncacheable(f"a trace context value of type {_name(type(value))}")
            text = _name(type(value)) + repr([getattr(value, s) for s in slots])
            if " at 0x" in text:
                raise Uncacheable(f"a trace context value of type {_name(type(value))}")
        texts.append(text)
    return "|".join(texts)


def _leaf(leaf) -> str:
    if isinstance(leaf, jax.Array):
        return f"array:{leaf.shape}:{leaf.dtype.name}:{leaf.weak_type}:{leaf.sharding}"
    if isinstance(leaf, np.ndarray):
        return f"numpy:{leaf.shape}:{leaf.dtype.name}"
    raise Uncacheable(f"an argument of type {_name(type(leaf))}")


class StepCache:
    """The entries in ``folder`` (one file per key: the pickled serialized executable and its argument and result
    tree structures)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def load(self, key: str):
        """(the jax.stages.Compiled stored under ``key`` or None, whether an entry was there). An entry that cannot be
        read or loaded (damaged, or refused by a handler's instantiation, e.g. a bank that no longer exists) is
        removed: the caller compiles the step as without a cache and does not store it, so an entry that fails the
        same way every time costs no compile of its own."""
        path = self.folder / f"{key}.bin"
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            with contextlib.suppress(OSError):
                os.utime(path)  # used now: the last to go (store)
            return compiled, True
        except FileNotFoundError:
            return None, False
        except Exception:  # noqa: BLE001 - any failure to read or load is a miss
            with contextlib.suppress(OSError):
                path.unlink()
            return None, True

    def store(self, key: str, compiled) -> None:
        """Store ``compiled`` (a jax.stages.Compiled that XLA compiled in this process) under ``key``, then remove the
        least recently used entries beyond MAX_ENTRIES; an OSError or an executable that cannot be serialized leaves
        the cache as it was."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            self.folder.mkdir(parents=True, exist_ok=True)
            replace_file(self.folder / f"{key}.bin",
                         lambda f: pickle.dump((payload, in_tree, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL),
                         binary=True)
            entries = sorted(self.folder.glob("*.bin"), key=lambda p: p.stat().st_mtime_ns)
            for old in entries[:max(len(entries) - MAX_ENTRIES, 0)]:  # the least recently used
                old.unlink()
        except (OSError, ValueError, NotImplementedError, pickle.PicklingError):
            return


_folder: str | None = None


def enable(folder: str | os.PathLike | None) -> None:
    """Keep the steps of the Engines made from now on in ``folder`` (None: off, the default).
    ft_jax.api.enable_compile_cache turns it on in FOLDER of JAX's compilation cache folder."""
    global _folder
    _folder = None if folder is None else os.fspath(folder)


def default_step_cache() -> StepCache | None:
    """The step cache enable() turned on, or None; None on other backends than the CPU (where it is tested)."""
    return None if _folder is None or jax.default_backend() != "cpu" else StepCache(_folder)


_bypass_lock = threading.Lock()


@contextlib.contextmanager
def jax_cache_bypassed():
    """JAX's persistent compilation cache off for the compiles inside, so that XLA compiles the step here and it can be
    stored (module docstring); the public switch (jax_enable_compilation_cache) and reset_cache, which makes JAX read
    the switch again. A compile in another thread meanwhile also skips JAX's cache (it compiles; nothing is wrong)."""
    with _bypass_lock:
        enabled = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", enabled)
            compilation_cache.reset_cache()
