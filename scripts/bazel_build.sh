#!/usr/bin/env bash
# Builds the XLA FFI handlers (xla_ffi/, without the nanobind module) with Bazel into build/bazel/libft_jax_ffi.so.
#
# Uses Debian's bazel-bootstrap (Bazel 4.2.3) fully offline: WORKSPACE maps rules_cc/rules_java to local stubs and
# reads jaxlib's FFI headers through `python -c "import jax.ffi; print(jax.ffi.include_dir())"`.
# Installs bazel-bootstrap with apt-get when no Bazel is found (needs root or sudo).
#
# Environment:
#   PYTHON                    interpreter with jax installed (default: python3)
#   FT_JAX_BAZEL              Bazel binary to use (default: bazel-4 from bazel-bootstrap, else bazel)
#   FT_JAX_BAZEL_ROOT         Bazel --output_user_root (default: <repo>/build/bazel-root, git-ignored)
#   FT_JAX_BAZEL_OUT          where the library is copied (default: <repo>/build/bazel/libft_jax_ffi.so)
#   FT_JAX_BAZEL_KEEP_SERVER  1 = leave the Bazel server running for fast rebuilds (default: shut it down)
# Exit status: non-zero when installing, building or copying fails.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
start=$SECONDS

python="$(command -v "${PYTHON:-python3}")" || { echo "bazel_build.sh: ${PYTHON:-python3} not found" >&2; exit 1; }
jaxlib_version="$("$python" -c 'import jaxlib; print(jaxlib.__version__)')" \
  || { echo "bazel_build.sh: jaxlib is not importable with $python (pip install jax first)" >&2; exit 1; }

bazel="${FT_JAX_BAZEL:-}"
if [[ -z "$bazel" ]]; then
  if ! command -v bazel-4 >/dev/null && ! command -v bazel >/dev/null; then
    echo "bazel_build.sh: no Bazel found, installing Debian's bazel-bootstrap" >&2
    sudo=""
    if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq bazel-bootstrap >/dev/null
  fi
  # bazel-4 is bazel-bootstrap's real binary; calling it directly skips the version-dispatch wrapper (and any
  # bazelisk on PATH, which would try to download a release).
  bazel="$(command -v bazel-4 || command -v bazel)"
fi

root="${FT_JAX_BAZEL_ROOT:-$repo/build/bazel-root}"
out="${FT_JAX_BAZEL_OUT:-$repo/build/bazel/libft_jax_ffi.so}"
mkdir -p "$root" "$(dirname "$out")"
startup=(--output_user_root="$root")
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
bin="$("$bazel" "${startup[@]}" info "${repo_env[@]}" bazel-bin 2>/dev/null)"
install -m 0755 "$bin/libft_jax_ffi.so" "$out"
echo "bazel_build.sh: $out (jaxlib $jaxlib_version, $((SECONDS - start)) s)"
