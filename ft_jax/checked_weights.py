"""Which bytes of which checkpoint file versions are known to hold no NaN/Inf weight, so that the loader's NaN/Inf
check (ft_jax.checkpoint, every float tensor read) runs once per file version instead of once per launch.

A launch of an unchanged checkpoint then maps its experts without reading them all: on the 4.4 GB bench model the
check was 0.25-0.3 s of a 2.1 s ``ft-jax generate`` (docs/DESIGN.md sec. 20.30). The check itself is unchanged: every
byte range the record does not cover is checked as it is read, and a NaN/Inf found is reported as before.

A file version is (device, inode, size, modification and status-change times in ns: os.stat), the identity git's
index and make rely on. Writing to a file with write() changes its times, replacing it changes its inode or times,
so a changed file is checked again. As git does for "racily clean" files, a file whose times are less than SETTLE_NS
before the record is written is not recorded: a second write in the same clock tick would leave its times as they
were. Not seen: writes through a shared writable memory mapping of the file after the first write to a page (Linux
updates the times at that first write and again only when the page is written back; on tmpfs never): after such a
change, load with weight_check="always" (--weight-check always).

Store: JSON at ``platformdirs.user_cache_path("ft_jax") / "checked_weights.json"`` (Linux: $XDG_CACHE_HOME/ft_jax,
else ~/.cache/ft_jax), {"schema_version": 1, "files": {absolute path: {"version": [dev, ino, size, mtime_ns,
ctime_ns], "ranges": [[start, stop], ...] (byte offsets in the file, sorted, disjoint), "used_ns": last use}}}, at
most MAX_FILES files (the least recently used go first). The record only saves time: one it cannot read counts as
empty, and one it cannot write is left as it was (the next launch checks again).
"""

from __future__ import annotations

import bisect
import json
import os
import threading
import time
from pathlib import Path

import platformdirs

from ft_jax.cache_dirs import replace_file

SCHEMA_VERSION = 1
MAX_FILES = 256
SETTLE_NS = 2_000_000_000  # a file's times must be this much older than the record (the kernel's clock is coarse)

FileVersion = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def default_record_path() -> Path:
    """``platformdirs.user_cache_path("ft_jax") / "checked_weights.json"`` (Linux: $XDG_CACHE_HOME or ~/.cache)."""
    return platformdirs.user_cache_path("ft_jax") / "checked_weights.json"


def file_version(st: os.stat_result) -> FileVersion:
    """The identity of a file's contents as os.stat / os.fstat give it."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class CheckedWeights:
    """The record of one load: ranges read from disk (``path``) plus those the load checks, written back by save().

    Thread-safe (load_checkpoint checks in two threads). Byte ranges are [start, stop) offsets in the file.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        """path: the record file (default: default_record_path()). A missing, unreadable or damaged file is an empty
        record."""
        self.path = Path(path) if path is not None else default_record_path()
        self._files = _read(self.path)  # absolute path -> {"version", "ranges", "used_ns"}
        self._versions: dict[str, FileVersion] = {}  # the files this load read, as they were when opened
        self._added = False
        self._lock = threading.Lock()

    def opened(self, file: str, version: FileVersion) -> None:
        """Note the version of ``file`` as the load opened it: covers() and add() refer to it."""
        with self._lock:
            self._versions[os.path.abspath(file)] = version

    def covers(self, file: str, start: int, stop: int) -> bool:
        """Whether bytes [start, stop) of the opened version of ``file`` were checked by an earlier load."""
        file = os.path.abspath(file)
        with self._lock:
            entry = self._files.get(file)
            if entry is None or tuple(entry["version"]) != self._versions.get(file):
                return False
            ranges = entry["ranges"]
            i = bisect.bisect_right(ranges, [start, float("inf")]) - 1
            return i >= 0 and ranges[i][0] <= start and stop <= ranges[i][1]

    def add(self, file: str, start: int, stop: int) -> None:
        """Record bytes [start, stop) of the opened version of ``file`` as checked (no NaN/Inf)."""
        file = os.path.abspath(file)
        with self._lock:
            version = self._versions[file]
            entry = self._files.get(file)
            if entry is None or tuple(entry["version"]) != version:
                entry = self._files[file] = {"version": list(version), "ranges": []}
            entry["ranges"] = _merged(entry["ranges"] + [[start, stop]])
            self._added = True

    def save(self) -> None:
        """Write the record (atomically: a temporary file renamed over it), merged with what other processes wrote
        meanwhile. Only files still at their opened version, settled (times SETTLE_NS old), are recorded. An OSError
        is ignored: the record only saves time."""
        with self._lock:
            if not self._added:
                return
            now = time.time_ns()
            try:
                files = _read(self.path)
                for file, version in self._versions.items():
                    entry = self._files.get(file)
                    if entry is None or tuple(entry["version"]) != version:
                        continue
                    if file_version(os.stat(file)) != version or now - max(version[3], version[4]) < SETTLE_NS:
                        continue
                    ranges = entry["ranges"]
                    if file in files and tuple(files[file]["version"]) == version:
                        ranges = _merged(files[file]["ranges"] + ranges)
                    files[file] = {"version": list(version), "ranges": ranges, "used_ns": now}
                kept = dict(sorted(files.items(), key=lambda kv: kv[1].get("used_ns", 0))[-MAX_FILES:])
                self.path.parent.mkdir(parents=True, exist_ok=True)
                replace_file(self.path, lambda f: json.dump({"schema_version": SCHEMA_VERSION, "files": kept}, f))
            except OSError:
                pass


def _read(path: Path) -> dict:
    """The "files" of the record at ``path``; {} when it is missing, not a regular file (a FIFO would block the
    read), unreadable or not a record of this schema (any value that does not parse: a float of 1e999 where an int
    belongs, nesting too deep for the JSON parser, ...)."""
    try:
        if not path.is_file():
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
        files = data["files"] if data.get("schema_version") == SCHEMA_VERSION else {}
        return {file: {"version": [int(v) for v in e["version"]], "ranges": _merged(e["ranges"]),
                       "used_ns": int(e.get("used_ns", 0))}
                for file, e in files.items() if len(e["version"]) == 5}
    except Exception:  # noqa: BLE001 - a record that does not parse is an empty one (it only saves time)
        return {}


def _merged(ranges: list) -> list[list[int]]:
    """[start, stop) ranges sorted, with overlapping and touching ones joined."""
    out: list[list[int]] = []
    for start, stop in sorted([int(a), int(b)] for a, b in ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return out
