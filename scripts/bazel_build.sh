#!/usr/bin/env bash
# Builds the XLA FFI handlers (xla_ffi/, without the nanobind module) with Bazel into build/bazel/libft_jax_ffi.so.
#
# Uses Debian's bazel-bootstrap (Bazel 4.2.3) fully offline: WORKSPACE maps rules_cc/rules_java to local stubs and
# reads jaxlib's FFI headers through `python -c "import jax.ffi; print(jax.ffi.include_dir())"`.
# Installs bazel-bootstrap with apt-get when its bazel-4 is missing (needs root or sudo).
#
# Environment:
#   PYTHON                    interpreter with jax installed (default: python3)
#   FT_JAX_BAZEL              Bazel 4.x binary to use (default: bazel-4 from bazel-bootstrap, installed if missing)
#   FT_JAX_BAZEL_ROOT         Bazel --output_user_root; the output base is its base/ (default: <repo>/build/bazel-root,
#                             git-ignored and listed in .bazelignore)
#   FT_JAX_BAZEL_OUT          where the library is copied (default: <repo>/build/bazel/libft_jax_ffi.so)
#   FT_JAX_BAZEL_KEEP_SERVER  1 = leave the Bazel server running for fast rebuilds (default: shut it down)
# Exit status: non-zero when installing, building or copying fails.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
start=$SECONDS

# The real interpreter path (not a pyenv/venv shim), so the repository rule runs exactly this Python.
python="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')" \
  || { echo "bazel_build.sh: cannot run ${PYTHON:-python3}" >&2; exit 1; }
jaxlib_version="$("$python" -c 'import jaxlib; print(jaxlib.__version__)')" \
  || { echo "bazel_build.sh: jaxlib is not importable with $python (pip install jax first)" >&2; exit 1; }

bazel="${FT_JAX_BAZEL:-}"
if [[ -z "$bazel" ]]; then
  if ! command -v bazel-4 >/dev/null; then
    echo "bazel_build.sh: bazel-4 not found, installing Debian's bazel-bootstrap" >&2
    sudo=""
    if [[ $(id -u) -ne 0 ]]; then
      command -v sudo >/dev/null || { echo "bazel_build.sh: not root and no sudo: install bazel-bootstrap first" >&2; exit 1; }
      sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap >/dev/null
  fi
  # bazel-4 is bazel-bootstrap's real binary; calling it directly skips the version-dispatch wrapper /usr/bin/bazel
  # (and any bazelisk on PATH, which would try to download a release).
  bazel="$(command -v bazel-4)"
fi

root="${FT_JAX_BAZEL_ROOT:-$repo/build/bazel-root}"
out="${FT_JAX_BAZEL_OUT:-$repo/build/bazel/libft_jax_ffi.so}"
mkdir -p "$root" "$(dirname "$out")"
# A fixed --output_base (instead of Bazel's <root>/<md5 of the workspace path>) lets us find bazel-bin without a
# second `bazel info` call.
startup=(--output_user_root="$root" --output_base="$root/base")
# The jax_ffi repository rule re-copies the headers whenever the interpreter or the jaxlib version changes.
repo_env=(--repo_env=FT_JAX_PYTHON="$python" --repo_env=FT_JAX_JAXLIB_VERSION="$jaxlib_version")
target=//:libft_jax_ffi.so

cleanup() {
  if [[ "${FT_JAX_BAZEL_KEEP_SERVER:-0}" != 1 ]]; then
    "$bazel" "${startup[@]}" shutdown >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

"$bazel" "${startup[@]}" build "${repo_env[@]}" "$target"
# bazel-out/<cpu>-opt/bin (k8-opt on x86-64, aarch64-opt on ARM): .bazelrc sets --compilation_mode=opt.
built=("$root"/base/execroot/ft_jax/bazel-out/*-opt/bin/libft_jax_ffi.so)
if [[ ${#built[@]} -ne 1 || ! -f "${built[0]}" ]]; then
  echo "bazel_build.sh: expected one libft_jax_ffi.so under $root/base/execroot/ft_jax/bazel-out/*-opt/bin," \
       "found: ${built[*]}" >&2
  exit 1
fi
install -m 0755 "${built[0]}" "$out"
echo "bazel_build.sh: $out (jaxlib $jaxlib_version, $((SECONDS - start)) s)"
