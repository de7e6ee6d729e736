"""The CUDA path on a GPU (skipped without one, with the reason): the CUDA slot fill bit-exact against the CPU handler
(mapped banks and the bounce-buffer fallback), its error count, GPU host_experts equal to the CPU handler, the host
node running once per command-buffer replay, and greedy decoding identical with command buffers on and off and equal
to the CPU backend on the fixtures.

Cases that need their own XLA_FLAGS (set before JAX starts) run in a subprocess: ``python tests/test_gpu.py CASE``
prints one JSON line.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf_tiny")
GREEDY_FAMILIES = ("mixtral", "gpt_oss", "deepseek_v3")  # plain, biased swiglu_oai experts, MLA
BF16 = np.dtype(ml_dtypes.bfloat16)
# Command buffers for fusions and custom calls, even for short sequences (the test functions are small).
CMD_BUFFERS_ON = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
CMD_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="


def _skip_reason() -> str | None:
    from ft_jax import _ffi

    if not _ffi.cuda_built():
        return "ft_jax._ffi was built without the CUDA handlers (CMake found no nvcc)"
    try:
        jax.devices("cuda")
    except RuntimeError as e:
        return f"no GPU: jax has no CUDA backend here ({str(e).splitlines()[0]})"
    return None


if __name__ != "__main__":
    _REASON = _skip_reason()
    pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _devices():
    return jax.devices("cpu")[0], jax.devices("cuda")[0]


def _run_case(case: str, xla_flags: str, **env) -> dict:
    """Runs `python tests/test_gpu.py case` with these XLA_FLAGS; returns its JSON line."""
    full_env = dict(os.environ, XLA_FLAGS=xla_flags, PYTHONPATH=REPO, **env)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), case], env=full_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"case {case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------- slot fill
def _fill_inputs(seed: int):
    """Banks of three kinds (f32 [R, 6, 40], bf16 [R, 24, 8], bf16 vectors [R, 10]: 20-byte rows, no 16-byte
    vectors), slot pools of S = 5, and fills with padding on either side."""
    from ft_jax.kernels.host_bank import HostBank

    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal((9, 6, 40)).astype(np.float32),
            rng.standard_normal((9, 24, 8)).astype(np.float32).astype(BF16),
            rng.standard_normal((9, 10)).astype(np.float32).astype(BF16)]
    banks = tuple(HostBank.from_numpy(r) for r in rows)
    pools = [rng.standard_normal((5, *r.shape[1:])).astype(np.float32).astype(r.dtype) for r in rows]
    fills = []
    for _ in range(4):
        flat = rng.integers(0, 9, 4).astype(np.int32)
        slots = rng.permutation(5)[:4].astype(np.int32)
        flat[0], slots[1] = -1, -1
        fills.append((flat, slots))
    return banks, pools, fills


def _fill_on(device, banks, pools, fills):
    """Pools after every fill in turn, on `device`; the error count of each call."""
    from ft_jax.kernels import ffi_ops

    fill = jax.jit(lambda p, f, s: ffi_ops.slot_fill_with_errors(p, f, s, banks), donate_argnums=0)
    state = tuple(jax.device_put(p, device) for p in pools)
    errors = []
    for flat, slots in fills:
        state, err = fill(state, jax.device_put(flat, device), jax.device_put(slots, device))
        errors.append(int(err))
    return [np.asarray(p) for p in state], errors


def test_cuda_slot_fill_bit_exact_against_cpu():
    cpu, gpu = _devices()
    banks, pools, fills = _fill_inputs(0)
    want, cpu_errors = _fill_on(cpu, banks, pools, fills)
    got, gpu_errors = _fill_on(gpu, banks, pools, fills)
    assert cpu_errors == gpu_errors == [0] * len(fills)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def test_cuda_slot_fill_counts_and_skips_out_of_range_ids():
    from ft_jax.kernels import ffi_ops

    _, gpu = _devices()
    banks, pools, _ = _fill_inputs(1)
    flat = np.array([2, 9, 4, 1], np.int32)  # 9 >= 9 rows
    slots = np.array([0, 1, 7, 3], np.int32)  # 7 >= 5 slots
    fill = jax.jit(lambda p, f, s: ffi_ops.slot_fill_with_errors(p, f, s, banks))
    out, errors = fill(tuple(jax.device_put(p, gpu) for p in pools), flat, slots)
    assert int(errors) == 2
    for p, o, bank in zip(pools, out, banks):
        want = p.copy()
        want[0], want[3] = bank.numpy()[2], bank.numpy()[1]  # the valid entries only
        np.testing.assert_array_equal(np.asarray(o).view(np.uint8), want.view(np.uint8))


def test_cuda_slot_fill_bounce_fallback_bit_exact():
    """FT_JAX_NO_HOST_REGISTER=1: the banks are not mapped, rows go through pinned bounce buffers (host nodes)."""
    got = _run_case("bounce", CMD_BUFFERS_ON, FT_JAX_NO_HOST_REGISTER="1")
    assert got["equal"] and got["errors"] == [0, 0, 0, 0]
    assert got["bounce_fills"] >= 4  # at least one round per call


# -------------------------------------------------------------------------------------------------------- host experts
@pytest.mark.parametrize("dtype,x_dtype,bias", [(np.float32, np.float32, False), (BF16, BF16, True),
                                                (BF16, np.float32, False)])
def test_gpu_host_experts_equal_the_cpu_handler(dtype, x_dtype, bias):
    """Same kernel, same inputs, fixed summation order: the GPU path (staging, worker pool) is bit-identical."""
    from ft_jax.kernels import ffi_ops
    from ft_jax.kernels.host_bank import HostBank

    cpu, gpu = _devices()
    rng = np.random.default_rng(2)
    E, H, inter, T, k = 6, 64, 96, 3, 2
    gu = HostBank.from_numpy((rng.standard_normal((E, 2 * inter, H)) * 0.1).astype(np.float32).astype(dtype))
    dn = HostBank.from_numpy((rng.standard_normal((E, H, inter)) * 0.1).astype(np.float32).astype(dtype))
    biases = {}
    if bias:
        biases = dict(gate_up_bias=HostBank.from_numpy(rng.standard_normal((E, 2 * inter)).astype(np.float32)),
                      down_bias=HostBank.from_numpy(rng.standard_normal((E, H)).astype(np.float32)))
    activation = "swiglu_oai" if bias else "silu"
    f = jax.jit(lambda x, i, w: ffi_ops.host_experts(x, i, w, gu, dn, activation, **biases))
    for _ in range(3):
        x = rng.standard_normal((T, H)).astype(np.float32).astype(x_dtype)
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
        ids[1, 0] = -1
        w = rng.random((T, k)).astype(np.float32)
        want = np.asarray(f(*(jax.device_put(a, cpu) for a in (x, ids, w))))
        got = np.asarray(f(*(jax.device_put(a, gpu) for a in (x, ids, w))))
        assert np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "mxfp4", "fp8_24x40"])
def test_gpu_pallas_slot_experts_quantized_pools_match_float64(name):
    """The Pallas device experts compiled with Triton on the GPU, pools in a block format dequantized per tile: the
    float64 reference on the numpy dequantize's values, as the interpreter tests of tests/test_gpu_path.py (f32 dots,
    f32 accumulation: 2e-5 of the output scale)."""
    from test_gpu_path import QUANTIZED, _case, _quantized_pools, _reference

    from ft_jax.kernels import device_experts

    _, gpu = _devices()
    fmt = QUANTIZED[name]
    rng = np.random.default_rng(10)
    S, H, inter = 4, 256, 80 if fmt.name == "fp8" else 96
    gu_data, gu_scales, dn_data, dn_scales, gu, dn = _quantized_pools(rng, fmt, S, H, inter)
    x, ids, w, _, _, _ = _case(rng, 3, 2, S, H, inter, np.float32, BF16, False)
    f = jax.jit(lambda *a: device_experts.slot_experts(*a[:5], "silu", gate_up_scale_slots=a[5],
                                                       down_scale_slots=a[6], weight_format=fmt))
    got = np.asarray(f(*(jax.device_put(a, gpu) for a in (x, ids, w, gu_data, dn_data, gu_scales, dn_scales))))
    want = _reference(x, ids, w, gu, dn, "silu")
    assert np.abs(want).max() > 0.05
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_gpu_host_experts_counts_a_bad_route_and_pairs_two_calls():
    """A flat id past the banks: the GPU host node zeroes y and the wait's error count is 1 (host_route_errors counts
    it too); two host_experts calls in one step each find their own submit's channel (pair ids)."""
    from ft_jax import _ffi
    from ft_jax.kernels import ffi_ops
    from ft_jax.kernels.host_bank import HostBank

    cpu, gpu = _devices()
    rng = np.random.default_rng(4)
    E, H, inter = 4, 64, 32
    gu = HostBank.from_numpy((rng.standard_normal((E, 2 * inter, H)) * 0.1).astype(np.float32))
    dn = HostBank.from_numpy((rng.standard_normal((E, H, inter)) * 0.1).astype(np.float32))
    f = jax.jit(lambda x, i, w: ffi_ops.host_experts_with_errors(x, i, w, gu, dn))
    x = rng.standard_normal((2, H)).astype(np.float32)
    w = rng.random((2, 2)).astype(np.float32)
    good, bad = np.array([[0, 1], [2, 3]], np.int32), np.array([[0, 1], [2, E]], np.int32)
    before = _ffi.cuda_counters()["host_route_errors"]
    y, errors = f(*(jax.device_put(a, gpu) for a in (x, bad, w)))
    assert int(errors) == 1 and np.all(np.asarray(y) == 0)
    assert _ffi.cuda_counters()["host_route_errors"] == before + 1
    y, errors = f(*(jax.device_put(a, gpu) for a in (x, good, w)))
    assert int(errors) == 0
    np.testing.assert_array_equal(np.asarray(y), np.asarray(f(*(jax.device_put(a, cpu) for a in (x, good, w)))[0]))

    two = jax.jit(lambda x, i, w: (ffi_ops.host_experts(x, i, w, gu, dn),
                                   ffi_ops.host_experts(x * 2, i[:, ::-1], w, gu, dn)))
    got = [np.asarray(a) for a in two(*(jax.device_put(a, gpu) for a in (x, good, w)))]
    want = [np.asarray(a) for a in two(*(jax.device_put(a, cpu) for a in (x, good, w)))]
    for g, wnt in zip(got, want):
        np.testing.assert_array_equal(g, wnt)


def test_host_node_runs_once_per_command_buffer_replay():
    got = _run_case("counters", CMD_BUFFERS_ON)
    n = got["calls"]
    assert got["host_submits"] == n and got["host_waits"] == n, got
    assert got["submit_records"] < n, f"the handler body ran on every call: no command buffer replay ({got})"
    assert got["equal_to_cpu"], got


# ------------------------------------------------------------------------------------------------------------- greedy
def test_greedy_identical_with_command_buffers_on_and_off_and_on_the_cpu():
    on = _run_case("greedy", CMD_BUFFERS_ON)
    off = _run_case("greedy", CMD_BUFFERS_OFF)
    cpu = _run_case("greedy", "", JAX_PLATFORMS="cpu")
    assert on["platform"] == off["platform"] == "gpu" and cpu["platform"] == "cpu"
    for family in GREEDY_FAMILIES:
        assert on["tokens"][family] == off["tokens"][family] == cpu["tokens"][family], family
        if family in on["reference"]:
            assert on["tokens"][family] == on["reference"][family], family


# -------------------------------------------------------------------------------------------- subprocess cases (main)
def _case_bounce() -> dict:
    from ft_jax import _ffi

    cpu, gpu = _devices()
    banks, pools, fills = _fill_inputs(0)
    before = _ffi.cuda_counters()["bounce_fills"]
    want, _ = _fill_on(cpu, banks, pools, fills)
    got, errors = _fill_on(gpu, banks, pools, fills)
    equal = all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want))
    return dict(equal=equal, errors=errors, bounce_fills=_ffi.cuda_counters()["bounce_fills"] - before)


def _case_counters(calls: int = 20) -> dict:
    """host_experts inside a jit with a few device ops around it, called `calls` times with new inputs."""
    from ft_jax import _ffi
    from ft_jax.kernels import ffi_ops
    from ft_jax.kernels.host_bank import HostBank

    cpu, gpu = _devices()
    rng = np.random.default_rng(3)
    E, H, inter = 8, 64, 32
    gu = HostBank.from_numpy((rng.standard_normal((E, 2 * inter, H)) * 0.1).astype(np.float32))
    dn = HostBank.from_numpy((rng.standard_normal((E, H, inter)) * 0.1).astype(np.float32))

    def step(x, ids, w):
        y = ffi_ops.host_experts(jnp.tanh(x) * 2.0, ids, w * 0.5, gu, dn)
        return jnp.sin(y) + jnp.cos(y) * 3.0

    f = jax.jit(step)
    inputs = [(rng.standard_normal((2, H)).astype(np.float32),
               rng.integers(0, E, (2, 2)).astype(np.int32), rng.random((2, 2)).astype(np.float32))
              for _ in range(calls)]
    jax.block_until_ready(f(*(jax.device_put(a, gpu) for a in inputs[0])))  # compile, first record
    before = _ffi.cuda_counters()
    outs = [f(*(jax.device_put(a, gpu) for a in args)) for args in inputs]
    outs = [np.asarray(o) for o in outs]
    after = _ffi.cuda_counters()
    equal = all(np.allclose(o, np.asarray(f(*(jax.device_put(a, cpu) for a in args))), rtol=1e-6, atol=1e-6)
                for o, args in zip(outs, inputs))
    delta = {key: after[key] - before[key] for key in after}
    return dict(calls=calls, equal_to_cpu=bool(equal), **delta)


def _case_greedy(new_tokens: int = 12) -> dict:
    """Greedy continuation of each fixture's prompt, qstar 0.5 with a quarter of the experts as slots (fills and
    host GEMVs in every step)."""
    from ft_jax.checkpoint import load_checkpoint
    from ft_jax.engine.engine import Engine
    from ft_jax.offload.policy import Policy

    tokens, reference = {}, {}
    for family in GREEDY_FAMILIES:
        path = os.path.join(FIXTURES, family)
        info = json.load(open(os.path.join(path, "reference", "info.json")))
        ckpt = load_checkpoint(path, dtype=jnp.float32)
        slots = max(1, ckpt.banks.gate_up.num_rows // 4)
        engine = Engine(ckpt, policy=Policy("qstar", frac=0.5), num_slots=slots)
        result = engine.generate([info["prompt_ids"]], max_new_tokens=new_tokens)
        tokens[family] = result.tokens[0]
        ref = info.get("greedy_continuation")
        if ref is not None:
            reference[family] = ref[:new_tokens]
    return dict(platform=jax.devices()[0].platform, tokens=tokens, reference=reference)


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    cases = {"bounce": _case_bounce, "counters": _case_counters, "greedy": _case_greedy}
    print(json.dumps(cases[sys.argv[1]]()))
