"""ft_jax: Mixture-of-Experts decoding in JAX with expert weights offloaded to host memory.

    >>> import ft_jax
    >>> model = ft_jax.load(policy="host-all")     # or ft_jax.load("~/models/Mixtral-8x7B-v0.1", cache="8GiB")
    >>> out = model.generate("ROMEO:", max_new_tokens=40)
    >>> len(out.token_ids[0]), out.finish_reasons
    (40, ['length'])

Public names: load, Model, Generation (ft_jax/api.py); Engine, Sampling, GenerationResult, NonFiniteLogitsError
(ft_jax/generate.py); Policy, parse_policy (ft_jax/offload/policy.py); load_checkpoint, load_config, load_tokenizer,
HostBank, bundled_model_path; __version__. They are imported on first use.

Importing the package registers every XLA FFI target of the compiled extension ``ft_jax._ffi`` for the CPU
platform: ``ft_jax_slot_fill``, ``ft_jax_host_experts``, ``ft_jax_slot_experts``, ``ft_jax_linear`` (see
ft_jax/offload/ffi_ops.py). When the extension was built with CUDA (CMake found nvcc) and jax has a CUDA backend, it
also registers the CUDA handlers for platform "CUDA": ``ft_jax_slot_fill`` (same name and signature) and
``ft_jax_host_experts_submit`` / ``ft_jax_host_experts_wait`` (xla_ffi/cuda_handlers.h); ``CUDA_ENABLED`` says
whether it did. The wrappers in ffi_ops pick the platform's form at lowering time (jax.lax.platform_dependent), so
the decode step code is the same on both.
"""

import jax

try:
    from ft_jax import _ffi  # noqa: E402
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "ft_jax._ffi (the compiled XLA FFI extension) is missing: build and install the package with "
        "`pip install -e .` (or `pip install .`) from the repository root"
    ) from e

__version__ = "0.2.0"

_PUBLIC = {
    "load": "ft_jax.api", "Model": "ft_jax.api", "Generation": "ft_jax.api", "bundled_model_path": "ft_jax.api",
    "Engine": "ft_jax.generate", "Sampling": "ft_jax.generate", "GenerationResult": "ft_jax.generate",
    "NonFiniteLogitsError": "ft_jax.generate", "Policy": "ft_jax.offload.policy",
    "parse_policy": "ft_jax.offload.policy", "load_checkpoint": "ft_jax.checkpoint", "load_config": "ft_jax.config",
    "load_tokenizer": "ft_jax.tokenizer", "HostBank": "ft_jax.offload.host_bank",
}
__all__ = sorted(_PUBLIC) + ["__version__", "CUDA_ENABLED"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ft_jax' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

# The CPU client must exist before the FFI state types are registered: a client created later registers the pending
# handlers before the pending types and refuses them (jaxlib 0.10 make_cpu_client). So importing ft_jax starts
# JAX's CPU backend; set XLA_FLAGS before the import.
jax.devices("cpu")
for _name, _type in _ffi.types().items():
    jax.ffi.register_ffi_type(_name, _type, platform="cpu")
for _name, _handler in _ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _handler, platform="cpu")


def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # jax without a CUDA plugin, or no GPU / driver
        return False


#: True when the CUDA FFI handlers are registered: the extension was built with nvcc and jax has a CUDA backend.
CUDA_ENABLED = _ffi.cuda_built() and _has_cuda_backend()
if CUDA_ENABLED:  # the CUDA client exists now (jax.devices above): types first, then the targets
    for _name, _type in _ffi.cuda_types().items():
        jax.ffi.register_ffi_type(_name, _type, platform="CUDA")
    for _name, _handler in _ffi.cuda_registrations().items():
        jax.ffi.register_ffi_target(_name, _handler, platform="CUDA")
del _name, _type, _handler
