"""The XLA FFI kernels of ft_jax: registration of the compiled extension's targets at import, and their wrappers.

Importing this package registers every FFI target of ``ft_jax._ffi`` for the CPU platform (``ft_jax_slot_fill``,
``ft_jax_host_experts``, ``ft_jax_slot_experts``, ``ft_jax_linear``, ``ft_jax_bank_linear``, ``ft_jax_bank_take``,
``ft_jax_decode_attention``: ffi_ops.py) and,
when the extension was built with CUDA and jax has a CUDA backend, the CUDA handlers for platform "CUDA"
(``CUDA_ENABLED`` says whether it did).
"""

import os
import re

import jax

try:
    from ft_jax import _ffi
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "ft_jax._ffi (the compiled XLA FFI extension) is missing: build and install the package with "
        "`pip install -e .` (or `pip install .`) from the repository root"
    ) from e

# The CPU client must exist before the FFI state types are registered: a client created later registers the pending
# handlers before the pending types and refuses them (jaxlib 0.10 make_cpu_client). So importing ft_jax starts
# JAX's CPU backend; set XLA_FLAGS before the import.
jax.devices("cpu")
for _name, _type in _ffi.types().items():
    jax.ffi.register_ffi_type(_name, _type, platform="cpu")
for _name, _handler in _ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _handler, platform="cpu")


KERNEL_CAPS = ("generic", "avx2")  # FT_JAX_KERNEL values (xla_ffi/isa.cc); unset = the best the CPU has
MAX_HELPER_SPIN_US = 100_000  # FT_JAX_HELPER_SPIN_US's largest value (xla_ffi/kernel_helpers.cc clamps to it)
_DECIMAL = re.compile(r"\s*[0-9]+\s*", re.ASCII)  # what the C++ side's strtol reads whole (ASCII digits)


def environment_problem() -> str | None:
    """A one-line description of the malformed knobs of the kernels (every one, joined by "; "), or None:
    FT_JAX_KERNEL must be one of KERNEL_CAPS (the C++ side ignores anything else), FT_JAX_NUM_THREADS an integer
    >= 1 (the C++ side ignores anything else: xla_ffi/common.h) and FT_JAX_HELPER_SPIN_US an integer >= 0
    (microseconds; xla_ffi/kernel_helpers.h). Each is read once per process."""
    problems = []
    cap = os.environ.get("FT_JAX_KERNEL")
    if cap is not None and cap not in KERNEL_CAPS:
        problems.append(f"FT_JAX_KERNEL={cap!r} is not one of {', '.join(KERNEL_CAPS)} (unset it to use the best the "
                        f"CPU has)")
    threads = os.environ.get("FT_JAX_NUM_THREADS")
    if threads is not None and not (_DECIMAL.fullmatch(threads) and int(threads) >= 1):
        problems.append(f"FT_JAX_NUM_THREADS={threads!r} is not an integer >= 1 (unset it to use XLA's CPU thread "
                        f"pool)")
    spin = os.environ.get("FT_JAX_HELPER_SPIN_US")
    if spin is not None and not (_DECIMAL.fullmatch(spin) and int(spin) <= MAX_HELPER_SPIN_US):
        problems.append(f"FT_JAX_HELPER_SPIN_US={spin!r} is not an integer from 0 to {MAX_HELPER_SPIN_US} "
                        f"microseconds (unset it for the default)")
    return "; ".join(problems) or None


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
