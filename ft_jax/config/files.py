"""File access for config.json and the other JSON/safetensors files of a model folder: every error names the file
and the real cause (missing, permission denied, symbolic link loop, not a regular file such as a FIFO, not UTF-8,
not JSON)."""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class ConfigError(ValueError):
    """A config.json that cannot be used: unreadable, unsupported architecture, missing or invalid field.

    The message names the file and the field (or the supported architectures)."""


def os_error_cause(e: OSError) -> str:
    """Short human cause of an OSError from stat/open ("permission denied", "symbolic link loop", ...)."""
    causes = {errno.ENOENT: "does not exist", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
              errno.ELOOP: "symbolic link loop (too many levels of symbolic links)",
              errno.ENOTDIR: "a component of the path is not a folder",
              errno.ENAMETOOLONG: "file name too long"}
    return causes.get(e.errno, e.strerror or str(e))


def _missing(path: str) -> str:
    """Why ``path`` cannot be found: a dangling symbolic link is named as such (it exists, its target does not)."""
    if os.path.islink(path):
        return f"is a symbolic link to {os.readlink(path)!r}, which does not exist"
    return "does not exist"


def check_regular_file(path: str, what: str, error: type[Exception] = ConfigError) -> os.stat_result:
    """``os.stat(path)`` (following symbolic links), checked to be a regular file, without opening it.

    A FIFO, socket or device is refused before any open: opening a FIFO for reading blocks until a writer appears.

    Args:
        path: file to check. what: what the file should be (used in messages, e.g. "a safetensors file").
        error: exception class raised (ConfigError, CheckpointError, ...).
    Returns:
        The stat result (st_size in bytes).
    Raises:
        ``error``: "<path>: cannot read <what>: <cause>" (does not exist / dangling symbolic link / permission
        denied / symbolic link loop / ...) or "<path>: is <kind>, not a regular file; expected <what>".
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: cannot read {what}: the file {_missing(path)}") from None
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {os_error_cause(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a special file")
        raise error(f"{path}: is {kind}, not a regular file; expected {what}")
    return st


def read_json_file(path: str, what: str, error: type[Exception] = ConfigError) -> Any:
    """Parse the UTF-8 JSON file ``path`` (checked with :func:`check_regular_file` first).

    Raises:
        ``error``: unreadable / not a regular file (see check_regular_file), not UTF-8 (names the first bad byte
        and its offset), or not valid JSON (line and column). Messages are one line starting with ``path``.
    """
    check_regular_file(path, what, error)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {os_error_cause(e)}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); {what} must be "
                    "UTF-8 JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def file_present(path: str, what: str, error: type[Exception] = ConfigError) -> bool:
    """Whether a directory entry ``path`` exists (a dangling symbolic link counts: reading it reports why).

    Unlike os.path.lexists, a folder that cannot be searched is an error, not "absent".
    Raises ``error`` "<path>: cannot read <what>: <cause>" when the entry cannot be looked up (permission denied).
    """
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {os_error_cause(e)}") from None
    return True


def check_model_dir(model_dir: str) -> None:
    """Check that ``model_dir`` is an accessible folder.

    Raises:
        ConfigError: "model path does not exist: <dir>" (or names a dangling symbolic link), an empty path, the path
            is a file, or it cannot be accessed (permission denied, symbolic link loop, ...: the real cause is named).
    """
    if not str(model_dir).strip():
        raise ConfigError("the model path is empty: give a folder with config.json and safetensors files")
    try:
        st = os.stat(model_dir)
    except FileNotFoundError:
        if os.path.islink(model_dir):
            raise ConfigError(f"model path {model_dir} {_missing(model_dir)}") from None
        raise ConfigError(f"model path does not exist: {model_dir}") from None
    except OSError as e:
        raise ConfigError(f"{model_dir}: cannot open the model folder: {os_error_cause(e)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"the model path must be a folder with config.json and safetensors files, got the file "
                          f"{model_dir}")
