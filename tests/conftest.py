"""Suite-wide test settings.

XLA:CPU compiles each of the many small decode-step variants the suite builds (policies x cache sizes x fixtures);
LLVM's optimisation level 0 makes those compiles about 20% cheaper here without changing the HLO passes (copy
insertion, buffer aliasing: the in-place checks still see the production pipeline) or float semantics. It must be
set before JAX creates its CPU backend, hence here. A caller's own XLA_FLAGS are kept.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
