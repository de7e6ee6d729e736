"""scripts/bench_compile.py refuses arguments it cannot measure with one usage line (exit 2), before any work."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_compile.py")


@pytest.mark.parametrize("argv, message", [
    (["--layers", "4", "0"], "--layers must be >= 1, got 0"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--devices", "3"], "--devices: each must divide the 8 experts, got [3]"),
    (["--cache-fraction", "1.5"], "--cache-fraction must be in (0, 1], got 1.5"),
    (["--top-k", "9"], "--top-k 9 is more than the 8 experts"),
    (["--policies", "qstar", "bogus"], "--policies: policy: unknown policy 'bogus'"),
])
def test_bad_arguments_are_one_usage_line(argv, message):
    """A process of its own: the script sets jax_num_cpu_devices, which only a process whose JAX has not started
    may do."""
    out = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"bench_compile.py: error: {message}" in out.stderr
    assert "Traceback" not in out.stderr
