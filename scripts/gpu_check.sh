#!/usr/bin/env bash
# The GPU check of issue 24, as one command on a machine with one GPU and jax with CUDA (no network needed):
#   1. build: the extension with the CUDA handlers (cmake -DFT_JAX_CUDA=ON into build/gpu_check, the module copied
#      into ft_jax/ and run from the checkout with PYTHONPATH; pip install -e . when cmake is missing), then check
#      that ft_jax registered its CUDA handlers (ft_jax.CUDA_ENABLED)
#   2. tests: tests/test_gpu.py (CUDA slot fill bit-exact vs the CPU handler, GPU host_experts = CPU and its error
#      count, the host node once per command-buffer replay, greedy identical with command buffers on/off and on the
#      CPU) and tests/test_gpu_path.py; a skipped test of tests/test_gpu.py counts as a failure here
#   3. scripts/bench_gpu.py: slot_fill GB/s vs cudaMemcpy pinned H2D GB/s, host_experts GB/s, whether the decode step
#      runs inside command buffers and replays, decode tokens/s of a synthetic Mixtral-shaped bf16 model for
#      resident, fetch-all, host-all, qstar and auto at a 25% cache, side by side (bench_gpu.json)
# Designed to finish in under 8 minutes on an H200 machine (16 cores); each step has its own timeout, and a failed
# test or bench step does not stop the later ones. Prints a short JSON summary last (also gpu_check.json in OUT_DIR).
# Exit status: 0 only if every step passed.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]      (default: $OUT when set, else /tmp/ft_jax_gpu_check)
# Environment: PYTHON (default python3), GPU_CHECK_LAYERS (synthetic model layers, default 2).
# With the device tool:  run(command="bash scripts/gpu_check.sh", timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/ft_jax_gpu_check}}"
python="${PYTHON:-python3}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
build=1 cuda_enabled=1 tests=1 bench=1
step() { echo; echo "== [$((SECONDS - start)) s] $*"; }

summary() {  # the JSON summary from the step statuses, pytest's junit XML and bench_gpu.json
  "$python" - "$out" "$build" "$cuda_enabled" "$tests" "$bench" <<'EOF'
import json, os, statistics, sys
import xml.etree.ElementTree as ET
out, *codes = sys.argv[1:]
steps = dict(zip(("build", "cuda_enabled", "tests", "bench"), map(int, codes)))
s = dict(steps=steps, status=int(any(steps.values())))
try:
    import jax
    s["jax"], s["device"] = jax.__version__, jax.devices()[0].device_kind
except Exception as e:  # noqa: BLE001 -- a summary even when jax is broken
    s["jax"] = f"unavailable: {e}"
xml = os.path.join(out, "pytest.xml")
if os.path.exists(xml):
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    s["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = os.path.join(out, "bench_gpu.json")
if os.path.exists(bench):
    with open(bench) as f:
        b = json.load(f)
    med = {k: statistics.median(v) for k, v in b["decode"]["tokens_per_s"].items()}
    best_plain = max(med["fetch-all"], med["host-all"])
    c = b["decode"]["qstar_counters"]
    s["bench"] = dict(
        fill_over_memcpy=round(statistics.median(b["fill_host"]["fill_gbps"])
                               / statistics.median(b["fill_host"]["memcpy_gbps"]), 3),
        tokens_per_s={k: round(v, 2) for k, v in med.items()},
        qstar_over_max_plain=round(med["qstar"] / best_plain, 3),
        auto_over_max_plain=round(med["auto"] / best_plain, 3),
        greedy_identical=b["decode"]["greedy_identical"],
        command_buffer_replays=c["host_submits"] > c["submit_records"])
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(s, f, indent=1)
print(json.dumps(s))
EOF
}
finish() { step "done"; summary; exit $((build || cuda_enabled || tests || bench)); }

# Nothing is built on a machine without a GPU (this script is not for the CPU dev machines).
if ! "$python" -c "import jax; jax.devices('cuda')" >/dev/null 2>&1; then
  echo "gpu_check: $python's jax has no CUDA backend (no GPU, or jax without CUDA): nothing done"
  finish
fi

step "build ($("$python" --version 2>&1), $(command -v nvcc >/dev/null && nvcc --version | tail -1 || echo 'no nvcc'))"
if command -v cmake >/dev/null; then
  { timeout 300 cmake -S . -B build/gpu_check -DCMAKE_BUILD_TYPE=Release -DFT_JAX_CUDA=ON \
      -DPython_EXECUTABLE="$(command -v "$python")" \
    && timeout 300 cmake --build build/gpu_check -j "$(nproc)" \
    && cp build/gpu_check/_ffi*.so ft_jax/; } >"$out/build.log" 2>&1 && build=0
else
  timeout 300 "$python" -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 && build=0
fi
if ((build)); then
  tail -30 "$out/build.log"
  echo "gpu_check: the build failed (log: $out/build.log)"
  finish
fi
"$python" - <<'EOF' && cuda_enabled=0
import jax, ft_jax
from ft_jax import _ffi
print(f"jax {jax.__version__}, devices {jax.devices()}, cuda_built {_ffi.cuda_built()}, "
      f"CUDA_ENABLED {ft_jax.CUDA_ENABLED}")
raise SystemExit(0 if ft_jax.CUDA_ENABLED else 1)
EOF
if ((cuda_enabled)); then
  echo "gpu_check: ft_jax has no CUDA handlers registered"
  finish
fi

step "tests"
timeout 200 "$python" -m pytest -q -rs -p no:cacheprovider --junitxml="$out/pytest.xml" tests/test_gpu.py \
  tests/test_gpu_path.py 2>&1 | tee "$out/pytest.log" | tail -25
if [[ ${PIPESTATUS[0]} -eq 0 ]] && ! grep -q "^SKIPPED .*tests/test_gpu.py" "$out/pytest.log"; then
  tests=0
else
  echo "gpu_check: tests failed, or a test of tests/test_gpu.py was skipped (log: $out/pytest.log)"
fi

step "bench"
timeout 240 "$python" scripts/bench_gpu.py --out "$out" --layers "${GPU_CHECK_LAYERS:-2}" 2>&1 \
  | grep -v "^\s*$" | tee "$out/bench.log"
[[ ${PIPESTATUS[0]} -eq 0 && -f "$out/bench_gpu.json" ]] && bench=0

finish
