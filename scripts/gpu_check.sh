#!/usr/bin/env bash
# The GPU check of issue 13, as one command on a machine with one GPU and jax with CUDA (no network needed):
#   1. install: pip install -e . with the interpreter's own build tools (scikit-build-core, nanobind, cmake, nvcc),
#      then check that ft_jax registered its CUDA handlers (ft_jax.CUDA_ENABLED)
#   2. tests: tests/test_gpu.py (CUDA slot fill bit-exact vs the CPU handler, GPU host_experts = CPU, the host node
#      once per command-buffer replay, greedy identical with command buffers on/off and on the CPU) and
#      tests/test_gpu_path.py
#   3. scripts/bench_gpu.py: slot_fill GB/s vs cudaMemcpy pinned H2D GB/s, host_experts GB/s, whether the decode step
#      runs inside command buffers and replays, decode tokens/s of a synthetic Mixtral-shaped bf16 model for
#      resident, fetch-all, host-all, qstar and auto at a 25% cache, side by side
# Designed to finish in under 8 minutes on an H200 machine (16 cores); each step has its own timeout, and a failed
# step does not stop the later ones. Exit status: 0 if every step passed.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]      (default: $OUT when set, else /tmp/ft_jax_gpu_check)
# Environment: PYTHON (default python3), GPU_CHECK_LAYERS (synthetic model layers, default 2).
# With the device tool:  run(command="bash scripts/gpu_check.sh", timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/ft_jax_gpu_check}}"
python="${PYTHON:-python3}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$SECONDS
status=0
step() { echo; echo "== [$((SECONDS - start)) s] $*"; }

# Nothing is installed on a machine without a GPU (this script is not for the CPU dev machines).
if ! "$python" -c "import jax; jax.devices('cuda')" >/dev/null 2>&1; then
  echo "gpu_check: $python's jax has no CUDA backend (no GPU, or jax without CUDA): nothing done"
  exit 1
fi

step "install ($("$python" --version 2>&1), $(command -v nvcc >/dev/null && nvcc --version | tail -1 || echo 'no nvcc'))"
if ! timeout 120 "$python" -m pip install -q --no-build-isolation --no-deps -e . >"$out/install.log" 2>&1; then
  tail -30 "$out/install.log"
  echo "gpu_check: the install failed (log: $out/install.log)"
  exit 1
fi
"$python" - <<'EOF' || { echo "gpu_check: ft_jax has no CUDA handlers registered"; exit 1; }
import jax, ft_jax
from ft_jax import _ffi
print(f"jax {jax.__version__}, devices {jax.devices()}, cuda_built {_ffi.cuda_built()}, "
      f"CUDA_ENABLED {ft_jax.CUDA_ENABLED}")
raise SystemExit(0 if ft_jax.CUDA_ENABLED else 1)
EOF

step "tests"
timeout 170 "$python" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_gpu_path.py 2>&1 \
  | tee "$out/pytest.log" | tail -25
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "bench"
timeout 240 "$python" scripts/bench_gpu.py --out "$out" --layers "${GPU_CHECK_LAYERS:-2}" 2>&1 \
  | grep -v "^\s*$" | tee "$out/bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "done, status $status (logs and bench_gpu.json in $out)"
exit $status
