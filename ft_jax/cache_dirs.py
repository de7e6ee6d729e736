"""User cache folders (compile/ and profiles.json under $XDG_CACHE_HOME/ft_jax): can one be created and written?

A folder that cannot (read-only file system, no permission, a regular file where a folder should be) turns its
cache off with one note instead of stopping the run (ft_jax.api.enable_compile_cache, the bandwidth profile store).
"""

from __future__ import annotations

import os
import tempfile

from ft_jax.config import os_error_cause


def folder_problem(path: str | os.PathLike) -> str | None:
    """None when ``path`` is (or can be made) a folder this process can create files in, else the cause in a few
    words ("read-only file system", "a component of the path is not a folder", ...). Creates the folder (and its
    parents) as a side effect; the probe file it writes is removed at once."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".ft_jax_probe"):
            pass
    except OSError as e:
        return os_error_cause(e)
    return None
