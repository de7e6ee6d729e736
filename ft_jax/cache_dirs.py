"""Where ft_jax writes: can a user cache folder (compile/ and profiles.json under $XDG_CACHE_HOME/ft_jax) be created
and written, and can a file the user named (--record-trace, --profile) be written? And how its cache files are
written: whole or not at all (replace_file).

A cache folder that cannot (read-only file system, no permission, a regular file where a folder should be) turns its
cache off with one note instead of stopping the run (ft_jax.api.enable_compile_cache, the bandwidth profile store); a
named file that cannot is refused before anything is loaded, and its folder is never created.
"""

from __future__ import annotations

import os
import tempfile
from typing import IO, Callable

from ft_jax.config import os_error_cause
from ft_jax.interrupts import deferred_exit


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


def output_file_problem(path: str | os.PathLike) -> str | None:
    """None when ``path`` names a file that can be written in a folder that exists, else the problem in a few words
    ("expected a file name", "is a directory, expected a file name", "folder /x does not exist or is not
    writable"). The folder is probed by creating a file there and removing it at once (as folder_problem does:
    permission bits say nothing to root, and /proc or /sys refuse new files whatever they say); an existing file is
    opened for appending and left as it was. Creates nothing that stays."""
    path = os.fspath(path)
    if not path or path.endswith(os.sep):
        return "expected a file name"
    if os.path.isdir(path):
        return "is a directory, expected a file name"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.exists(path):
            with open(path, "ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=folder, prefix=".ft_jax_probe"):
                pass
    except OSError:
        return f"folder {folder} does not exist or is not writable"
    return None


def replace_file(path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False) -> None:
    """Write ``path`` whole or not at all: ``write(f)`` fills a temporary file in the same folder (text in UTF-8, or
    bytes with ``binary``), which then replaces ``path`` (os.replace: a reader sees the old file or the new one), all
    inside interrupts.deferred_exit (a signal waits for the write). On any error the temporary file is removed and the
    error raised (OSError, or write's own)."""
    path = os.fspath(path)
    with deferred_exit():
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=os.path.dirname(os.path.abspath(path)))
        try:
            with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
