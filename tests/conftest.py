"""Suite-wide test settings.

XLA:CPU compiles each of the many small decode-step variants the suite builds (policies x cache sizes x fixtures);
LLVM's optimisation level 0 makes those compiles about 20% cheaper here without changing the HLO passes (copy
insertion, buffer aliasing: the in-place checks still see the production pipeline) or float semantics. It must be
set before JAX creates its CPU backend, hence here. A caller's own XLA_FLAGS are kept.

Every test runs with XDG_CACHE_HOME in a fresh temporary folder (subprocesses inherit it), so the user's bandwidth
profiles and compilation cache are never read or written. `ft-jax` subprocesses use JAX's persistent compilation
cache there, as the CLI does by default. In this process it stays off, even where a test calls cli.main (which
turns it on): after some hundreds of XLA:CPU compiles in one process (jaxlib 0.10.2), a failing
executable.serialize() of the cache write throws a C++ exception whose unwinding segfaults in libgcc's
_Unwind_Find_FDE (the whole suite died at the DeepSeek-V3 bf16 policy test; that test alone writes its entries
fine). docs/DESIGN.md sec. 5 has the details.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ft_jax_tests_")

import jax  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)  # in this process only: see above
