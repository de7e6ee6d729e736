#!/usr/bin/env python3
"""Build llama.cpp (CPU only) from the source vendored in the llama-cpp-python sdist, cached for later runs.

    python3 scripts/llama_cpp_build.py        # llama-bench, llama-quantize, llama-results under ~/.cache/ft_jax/bench_peer
    python3 scripts/llama_cpp_build.py --targets llama-bench,llama-quantize,llama-perplexity
    python3 scripts/llama_cpp_build.py --cache-dir /tmp/lc --llama-cpp-python-version 0.3.36

Steps (each skipped when its output is already in the cache directory):
  1. ``pip download --no-deps --no-binary llama-cpp-python llama-cpp-python[==VERSION] -d CACHE/sdist`` (the sdist;
     its build requirements, which pip installs to read its metadata, may be wheels)
  2. unpack it to CACHE/llama_cpp_python-VERSION/ (llama.cpp is its vendor/llama.cpp)
  3. ``cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON`` with everything but the CPU backend and the
     tools off (no CUDA/Metal, no OpenSSL, no tests/examples; the server without its web UI, so nothing is
     downloaded), then ``cmake --build --target T`` for each requested target (--targets; default llama-bench and
     llama-quantize, which bench_peer.py runs, and llama-results, which writes a prompt's logits to a GGUF file for
     tests/test_gpt_oss_gguf.py; scripts/bench_serve.py asks for llama-server) into
     CACHE/build-VERSION/; CACHE/build-VERSION/ft_jax_build_info.json records the built binaries after each
     target. A later call asking for a target not yet built builds only that one (the object files are reused);
     a build folder configured with other flags (an older version of this script) is configured again first.
     On the 2-core dev VM (loaded by other jobs) the first build of both took about 11 minutes.

The sdist has no .git, so the llama.cpp commit is taken from the sdist's CHANGELOG.md ("update llama.cpp to
ggml-org/llama.cpp@<commit>" under the version's heading) and passed to cmake as LLAMA_BUILD_COMMIT, which is what
llama-bench reports as build_commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/ft_jax/bench_peer").expanduser()
BUILD_INFO = "ft_jax_build_info.json"
# CPU-only Release build of the tools' libraries (llama-server without its web UI: nothing is downloaded).
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_RPC=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON",
]
_SDIST_RE = re.compile(r"llama_cpp_python-(\d[0-9A-Za-z.+-]*)\.tar\.gz$")


class BuildError(RuntimeError):
    """The llama.cpp download or build failed; the message names the step and the log file."""


def _log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def _version_key(version: str):
    from packaging.version import Version

    return Version(version)


def find_or_download_sdist(cache_dir: Path, version: str | None) -> tuple[Path, str]:
    """(path of the llama-cpp-python sdist tarball, its version): a cached one, else ``pip download``.

    With ``version`` None the newest cached sdist is used, or PyPI's latest when none is cached.
    Raises BuildError when pip fails or downloads no sdist."""
    sdist_dir = cache_dir / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    cached = {m.group(1): p for p in sdist_dir.iterdir() if (m := _SDIST_RE.search(p.name))}
    if version is not None and version in cached:
        return cached[version], version
    if version is None and cached:
        best = max(cached, key=_version_key)
        return cached[best], best
    spec = "llama-cpp-python" + (f"=={version}" if version else "")
    _log(f"pip download --no-deps --no-binary llama-cpp-python {spec}")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                           spec,
                           "-d", str(sdist_dir)], capture_output=True, text=True)
    if proc.returncode:
        raise BuildError(f"pip download {spec} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    cached = {m.group(1): p for p in sdist_dir.iterdir() if (m := _SDIST_RE.search(p.name))}
    if version is not None and version not in cached:
        raise BuildError(f"pip download {spec} left no llama_cpp_python-{version}.tar.gz in {sdist_dir}")
    best = version or max(cached, key=_version_key)
    return cached[best], best


def llama_cpp_commit(sdist_root: Path, version: str) -> str:
    """The llama.cpp commit vendored in llama-cpp-python ``version``, from its CHANGELOG.md, or "unknown"."""
    path = sdist_root / "CHANGELOG.md"
    if not path.is_file():
        return "unknown"
    text = path.read_text(encoding="utf-8", errors="replace")
    m = re.search(rf"^## \[{re.escape(version)}\](.*?)(?=^## \[|\Z)", text, re.M | re.S)
    hit = re.search(r"llama\.cpp@([0-9a-f]{7,40})", m.group(1)) if m else None
    return hit.group(1) if hit else "unknown"


def _run_logged(cmd: list[str], log_path: Path, step: str) -> None:
    _log(f"{step}: {' '.join(cmd)} (log: {log_path})")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = log_path.read_text(errors="replace")[-1500:]
        raise BuildError(f"{step} failed (exit {proc.returncode}); log {log_path}:\n{tail}")


DEFAULT_TARGETS = ("llama-bench", "llama-quantize", "llama-results")


def cached_binary(target: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> str | None:
    """Path of an already built llama.cpp ``target`` under cache_dir (the newest llama-cpp-python version's build
    that has it, from its build record), or None; never downloads or builds."""
    found = []
    for info_path in Path(cache_dir).expanduser().glob(f"build-*/{BUILD_INFO}"):
        info = json.loads(info_path.read_text())
        path = info.get("binaries", {}).get(target)
        if path and Path(path).is_file():
            found.append((_version_key(info["llama_cpp_python_version"]), path))
    return max(found)[1] if found else None


def ensure_llama_cpp(cache_dir: Path = DEFAULT_CACHE_DIR, version: str | None = None, jobs: int | None = None,
                     targets: tuple[str, ...] = DEFAULT_TARGETS) -> dict:
    """Build (or find in the cache) the llama.cpp ``targets`` (cmake target names = binary names under bin/).

    Returns the build record: {"binaries": {target: path}, "llama_bench": path of llama-bench (when built),
    "llama_cpp_python_version", "llama_cpp_commit", "cmake_flags", "build_s", "source_dir", "build_dir"}
    (build_s: seconds this call spent building, 0 when every target was cached; "build_s_by_target" keeps the
    seconds each target took when it was built). Raises BuildError (download, configure or compile failure; names
    the log file)."""
    cache_dir = Path(cache_dir).expanduser()
    tarball, version = find_or_download_sdist(cache_dir, version)
    build_dir = cache_dir / f"build-{version}"
    info_path = build_dir / BUILD_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    binaries = {t: p for t, p in info.get("binaries", {}).items() if Path(p).is_file()}
    missing = [t for t in targets if t not in binaries]
    if not missing:
        return {**info, "binaries": binaries, "build_s": 0.0}
    root = cache_dir / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        _log(f"unpacking {tarball}")
        with tarfile.open(tarball) as tar:
            tar.extractall(cache_dir, filter="data")
    src = root / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        raise BuildError(f"{tarball}: no vendor/llama.cpp/CMakeLists.txt after unpacking to {root}")
    commit = llama_cpp_commit(root, version)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = CMAKE_FLAGS + [f"-DLLAMA_BUILD_COMMIT={commit}", "-DLLAMA_BUILD_NUMBER=0"]
    build_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if not (build_dir / "CMakeCache.txt").is_file() or info.get("cmake_flags", flags) != flags:
        _run_logged(["cmake", "-S", str(src), "-B", str(build_dir), *generator, *flags],
                    build_dir / "configure.log", "cmake configure")
    info = {"binaries": binaries, "llama_cpp_python_version": version, "llama_cpp_commit": commit,
            "cmake_flags": flags, "build_s_by_target": dict(info.get("build_s_by_target", {})),
            "source_dir": str(src), "build_dir": str(build_dir)}
    for target in missing:
        t0 = time.perf_counter()
        _run_logged(["cmake", "--build", str(build_dir), "--target", target, "-j", str(jobs or os.cpu_count())],
                    build_dir / f"build-{target}.log", f"cmake build {target}")
        binary = build_dir / "bin" / target
        if not binary.is_file():
            raise BuildError(f"cmake build finished but {binary} does not exist "
                             f"(log {build_dir / f'build-{target}.log'})")
        binaries[target] = str(binary)
        info["build_s_by_target"][target] = round(time.perf_counter() - t0, 1)
        if "llama-bench" in binaries:
            info["llama_bench"] = binaries["llama-bench"]
        info_path.write_text(json.dumps(info, indent=1))  # after each target: a later failure keeps the built ones
        _log(f"built {binary} in {info['build_s_by_target'][target]:.0f} s")
    return {**info, "build_s": round(time.perf_counter() - t_start, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR,
                   help="where the sdist, the source and the build live (default %(default)s)")
    p.add_argument("--llama-cpp-python-version", default=None,
                   help="sdist version to build (default: the newest cached one, else PyPI's latest)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                   help="comma-separated cmake targets to build (default %(default)s; llama-cli is not one with these "
                        "flags: it is part of the app, which LLAMA_BUILD_APP=OFF leaves out)")
    args = p.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    if not targets:
        p.error("--targets: give at least one cmake target")
    try:
        info = ensure_llama_cpp(args.cache_dir, args.llama_cpp_python_version, args.jobs, targets)
    except BuildError as e:
        print(f"llama_cpp_build: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
