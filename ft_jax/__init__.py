"""ft_jax: Mixture-of-Experts decoding in JAX with expert weights offloaded to host memory.

    >>> import ft_jax
    >>> model = ft_jax.load(policy="host-all")     # or ft_jax.load("~/models/Mixtral-8x7B-v0.1", cache="8GiB")
    >>> out = model.generate("ROMEO:", max_new_tokens=40)
    >>> len(out.token_ids[0]), out.finish_reasons
    (40, ['length'])

Public names: load, Model, Generation, Request, enable_compile_cache, default_compile_cache_dir (ft_jax/api.py);
Engine, Sampling, GenerationResult, NonFiniteLogitsError (ft_jax/engine/); Policy, parse_policy
(ft_jax/offload/policy.py); expert_mesh (ft_jax/offload/expert_parallel.py); load_checkpoint, load_config,
load_tokenizer, HostBank, bundled_model_path; the errors load raises for a folder or a machine it cannot use:
CheckpointError, ConfigError, InsufficientMemoryError, ChatTemplateError; __version__. They are imported on first use.

Importing the package registers the XLA FFI targets of the compiled extension (ft_jax/kernels/__init__.py);
``CUDA_ENABLED`` says whether the CUDA handlers were registered too.
"""

import importlib

from ft_jax import interrupts as _interrupts
from ft_jax import launch as _launch

_interrupts.install_for_command_line()  # `ft-jax` only, before jax is imported: Ctrl-C at any moment (interrupts.py)
_launch.setup_for_command_line()  # `ft-jax generate --devices / --coordinator`: before JAX starts (launch.py)

from ft_jax.kernels import CUDA_ENABLED  # noqa: E402  # registers the FFI targets (ft_jax/kernels/__init__.py)

__version__ = "0.2.0"

_PUBLIC = {
    "load": "ft_jax.api", "Model": "ft_jax.api", "Generation": "ft_jax.api", "Request": "ft_jax.api",
    "enable_compile_cache": "ft_jax.api", "default_compile_cache_dir": "ft_jax.api",
    "bundled_model_path": "ft_jax.defaults",
    "Engine": "ft_jax.engine.engine", "Sampling": "ft_jax.engine.sampling", "GenerationResult": "ft_jax.engine.engine",
    "NonFiniteLogitsError": "ft_jax.engine.sampling", "Policy": "ft_jax.offload.policy",
    "parse_policy": "ft_jax.offload.policy", "load_checkpoint": "ft_jax.checkpoint", "load_config": "ft_jax.config",
    "load_tokenizer": "ft_jax.tokenizer", "HostBank": "ft_jax.kernels.host_bank",
    "expert_mesh": "ft_jax.offload.expert_parallel",
    "CheckpointError": "ft_jax.checkpoint", "ConfigError": "ft_jax.config",
    "InsufficientMemoryError": "ft_jax.memory", "ChatTemplateError": "ft_jax.chat",
}
__all__ = sorted(_PUBLIC) + ["__version__", "CUDA_ENABLED"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The module's names plus the public ones imported on first use (so that dir() and tab completion list them)."""
    return sorted(set(globals()) | set(_PUBLIC))
