"""ft_jax: Mixture-of-Experts decoding in JAX with expert weights offloaded to host memory.

Importing the package registers every XLA FFI target of the compiled extension ``ft_jax._ffi`` for the CPU
platform: ``ft_jax_slot_fill``, ``ft_jax_host_experts``, ``ft_jax_slot_experts``, ``ft_jax_linear`` (see
ft_jax/offload/ffi_ops.py).
"""

import pkgutil

# When the package is installed non-editably and Python runs from the repository root (``python -m pytest``
# puts the source tree first on sys.path), this source directory shadows the installed copy, which is the one
# holding the compiled _ffi module. Extending __path__ with every ``ft_jax`` directory on sys.path lets
# ``ft_jax._ffi`` resolve to the installed extension in that case; in every other case it changes nothing.
__path__ = pkgutil.extend_path(__path__, __name__)

import jax  # noqa: E402

try:
    from ft_jax import _ffi  # noqa: E402
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "ft_jax._ffi (the compiled XLA FFI extension) is missing: build and install the package with "
        "`pip install -e .` (or `pip install .`) from the repository root"
    ) from e

__version__ = "0.1.0"

# The CPU client must exist before the FFI state types are registered: a client created later registers the pending
# handlers before the pending types and refuses them (jaxlib 0.10 make_cpu_client). So importing ft_jax starts
# JAX's CPU backend; set XLA_FLAGS before the import.
jax.devices("cpu")
for _name, _type in _ffi.types().items():
    jax.ffi.register_ffi_type(_name, _type, platform="cpu")
for _name, _handler in _ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _handler, platform="cpu")
del _name, _type, _handler
