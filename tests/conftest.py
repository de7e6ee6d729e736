"""Suite-wide test settings.

XLA:CPU compiles each of the many small decode-step variants the suite builds (policies x cache sizes x fixtures);
LLVM's optimisation level 0 makes those compiles about 20% cheaper here without changing the HLO passes (copy
insertion, buffer aliasing: the in-place checks still see the production pipeline) or float semantics. It must be
set before JAX creates its CPU backend, hence here. A caller's own XLA_FLAGS are kept.

Every test runs with XDG_CACHE_HOME in a fresh temporary folder (subprocesses inherit it), so the user's bandwidth
profiles and compilation cache are never read or written. JAX's persistent compilation cache is on for the session
in that folder, as the CLI has it by default: steps that many tests build alike (same fixture, shapes and policy)
are compiled once.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ft_jax_tests_")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ["XDG_CACHE_HOME"], "ft_jax", "compile"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
