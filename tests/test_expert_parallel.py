"""Expert parallelism (ft_jax/offload/expert_parallel.py): N CPU devices in one process and two processes on localhost
decode the tokens of one device; the sharded step has one psum per MoE layer and gathers nothing; each process's banks
hold its share of the experts; bad meshes and unreachable coordinators are clear errors; trace / plan model N devices.

The N-device cases run in one subprocess (jax_num_cpu_devices must be set before JAX starts: importing ft_jax starts
it), the two-process case as two `ft-jax generate` processes."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from ft_jax import launch, testing
from ft_jax.checkpoint import load_checkpoint
from ft_jax.offload.cost_model import CostModel
from ft_jax.offload.expert_parallel import ExpertPartition, expert_mesh
from ft_jax.offload.policy import parse_policy
from ft_jax.tools import multi_device
from ft_jax.tools.replay import evaluate
from ft_jax.tools.trace_io import Trace, TraceSequence

HERE = os.path.dirname(__file__)
FIXTURES = os.path.join(HERE, "fixtures", "hf_tiny")

# Every family and every policy at least once (slots per device): greedy against the transformers fixtures'
# continuations (which one device decodes: tests/test_model.py); top-4 routing (Qwen3, random weights), where a token's
# routes really are summed in another order over several devices, seeded sampling against one device.
CASES = [
    {"name": "mixtral", "policy": "fetch-all", "devices": 4, "slots": 2, "hlo": True},
    {"name": "qwen2_moe", "policy": "auto", "devices": 2, "slots": 2},
    {"name": "olmoe", "policy": "resident", "devices": 2, "slots": 1},
    {"name": "deepseek_v2", "policy": "qstar:0.5", "devices": 4, "slots": 1},
    {"name": "deepseek_v3", "policy": "host-all", "devices": 4, "slots": 1},
    {"name": "gpt_oss", "policy": "fixed-cap:1", "devices": 2, "slots": 2},
    {"name": "qwen3_top4", "policy": "qstar:0.5", "devices": 2, "slots": 3, "reference": "one device", "sampled": True},
]


def _info(name):
    return json.load(open(os.path.join(FIXTURES, name, "reference", "info.json")))


def _cases():
    """CASES with their prompts and token counts filled in (the fixtures' prompt and 8 of its 16 greedy tokens)."""
    out = []
    for case in CASES:
        case = {"reference": "transformers", "sampled": False, **case}
        if case["reference"] == "transformers":
            case.update(prompts=[_info(case["name"])["prompt_ids"]], new_tokens=8)
        else:
            case.update(prompts=[[1, 17, 42, 5], [9, 8]], new_tokens=6)
        out.append(case)
    return out


def _write_cases(folder):
    """The checkpoints of CASES (links to the fixtures; Qwen3 with top-4 written at random) and a Mixtral one for
    the idle-shard check."""
    for case in CASES:
        dst = os.path.join(folder, case["name"])
        if case["name"] == "qwen3_top4":
            testing.write_random_checkpoint(dst, testing.tiny_config("Qwen3MoeForCausalLM", num_experts_per_tok=4))
        else:
            os.makedirs(dst)
            for f in ("config.json", "model.safetensors"):
                os.symlink(os.path.join(FIXTURES, case["name"], f), os.path.join(dst, f))
    testing.write_random_checkpoint(os.path.join(folder, "idle"), testing.tiny_config("MixtralForCausalLM"))


@pytest.fixture(scope="module")
def devices_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("expert_parallel")
    _write_cases(folder)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_expert_parallel_devices.py"), str(folder),
                           json.dumps(_cases())], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", _cases(), ids=[f"{c['name']}-{c['policy']}-{c['devices']}dev" for c in CASES])
def test_tokens_equal_one_device(devices_report, case):
    entry = next(e for e in devices_report["cases"] if e["name"] == case["name"])
    if case["reference"] == "transformers":
        assert entry["many"] == [_info(case["name"])["greedy_continuation"][:case["new_tokens"]]]
    else:
        assert entry["many"] == entry["one"]
        assert entry["active_many"] == pytest.approx(entry["active_one"])
    assert all(len(t) == case["new_tokens"] for t in entry["many"])
    # The devices split the routes: each active (token, expert) pair is counted on exactly one device.
    assert sum(entry["active_devices"]) == pytest.approx(entry["active_many"])
    assert entry["decode_compiles"] == 1


def test_one_process_holds_every_expert(devices_report):
    entry = next(e for e in devices_report["cases"] if e["name"] == "mixtral")
    cfg = json.load(open(os.path.join(FIXTURES, "mixtral", "config.json")))
    L, E, H, I = cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    assert entry["host_bank_bytes"] == L * E * 3 * H * I * 4  # f32 gate, up and down of every expert


def test_sharded_step_has_one_psum_and_no_gather(devices_report):
    hlo = next(e for e in devices_report["cases"] if "hlo" in e)["hlo"]
    # One all-reduce in the whole step: the psum inside the scanned MoE layer's body, i.e. one per MoE layer.
    assert hlo["all-reduce"] == 1
    assert hlo["all-gather"] == hlo["all-to-all"] == hlo["collective-permute"] == hlo["reduce-scatter"] == 0
    assert hlo["pools_present"] and hlo["pool_copies"] == 0  # each device's slot pools updated in place


def test_each_device_its_own_policy(devices_report):
    idle = devices_report["idle_shard"]
    assert idle["own_policies_equal"]  # the same output as one device's host GEMV, bit for bit (top-2)
    assert idle["own_policies_fetched"] == [3, 0] and idle["own_policies_host"] == [0, 3]


def test_a_shard_without_routes_runs_no_host_gemv(devices_report):
    idle = devices_report["idle_shard"]
    # NaN in every bank row of device 1's experts: never read. The output is the host GEMV of one device, bit for bit
    # (each token's 2 routes sum in either order to the same float).
    assert idle["finite"] and idle["equal"]
    assert idle["device_stats"][1] == [0, 0, 0, 0, 0, 1]  # active, hits, misses, fetched, host (and 1 call)
    assert idle["device_stats"][0][4] == 4  # device 0 computed its 4 routed experts on the host
    assert not idle["poisoned_shard0_finite"]  # the same NaN where the routes go is seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_decode_the_one_device_tokens_with_half_the_banks_each(tmp_path):
    path = os.path.join(FIXTURES, "qwen2_moe")
    prompt = _info("qwen2_moe")["prompt_ids"]
    address = f"localhost:{_free_port()}"
    flags = ["--model", path, "--prompt-ids", ",".join(map(str, prompt)), "--temperature", "0", "--max-new-tokens",
             "6", "--policy", "qstar:0.5", "--cache-slots", "2", "--json", "--no-compile-cache",
             "--coordinator", address, "--num-processes", "2", "--init-timeout", "60"]
    procs = [subprocess.Popen([sys.executable, "-m", "ft_jax", "generate", *flags, "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (1, 0)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    objs = [json.loads(out) for out, _ in outs]  # stdout holds the JSON object only (gloo's lines go to stderr)
    cfg = json.load(open(os.path.join(path, "config.json")))
    L, E, H, I = (cfg["num_hidden_layers"], cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"])
    for obj in objs:  # one device decodes the transformers continuation (tests/test_model.py)
        assert obj["generated_ids"] == [_info("qwen2_moe")["greedy_continuation"][:6]]
        assert obj["stats"]["devices"] == 2 and obj["settings"]["num_processes"] == 2
        assert obj["stats"]["host_bank_bytes"] == L * (E // 2) * 3 * H * I * 4  # f32 gate, up, down of its 4 experts
    assert sorted(o["settings"]["process_id"] for o in objs) == [0, 1]


def test_processes_given_different_runs_stop_with_one_line_and_the_port_is_free_again():
    """Processes of one run given different requests hung (other collectives) or decoded other prompts in one batch
    (wrong tokens with exit 0); now every process exits 2 naming the flags that differ. The same coordinator port is
    then taken again at once (the previous run's sockets in TIME_WAIT refused it for ~60 s). Both found by a
    fresh-user trial."""
    address = f"localhost:{_free_port()}"
    base = ["--model", os.path.join(FIXTURES, "mixtral"), "--temperature", "0", "--no-compile-cache",
            "--coordinator", address, "--num-processes", "2", "--init-timeout", "60"]
    own = [["--prompt-ids", "1,17,42", "--max-new-tokens", "4"], ["--prompt-ids", "1,17,43", "--max-new-tokens", "6"]]
    for _ in range(2):  # the second pair on the same port right after the first
        procs = [subprocess.Popen([sys.executable, "-m", "ft_jax", "generate", *base, *own[i], "--process-id", str(i)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (1, 0)]
        for p, (out, err) in zip(procs, [p.communicate(timeout=300) for p in procs]):
            assert p.returncode == 2 and out == "", err[-3000:]
            assert err.splitlines()[-1] == (
                "ft-jax generate: error: the processes were given different runs: --prompt / --prompt-ids / --chat, "
                "--max-new-tokens differ between them (every process of a run decodes the same request from the same "
                "model: give each the same flags but --process-id and --policy)"), err[-3000:]


def test_sigterm_ends_a_process_of_a_multi_process_run(tmp_path):
    """jax.distributed.initialize's preemption notifier took SIGTERM: the run logged "SIGTERM caught" and went on to
    exit 0 (a fresh-user trial). The command line's handler is put back after it: exit 143 with the one line."""
    import shutil
    import signal
    import time

    model = tmp_path / "long"
    shutil.copytree(os.path.join(FIXTURES, "mixtral"), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096  # a decode long enough to be signalled in
    (model / "config.json").write_text(json.dumps(cfg))
    address = f"localhost:{_free_port()}"
    flags = ["--model", str(model), "--prompt-ids", "1,17,42", "--temperature", "0", "--max-new-tokens", "4000",
             "--coordinator", address, "--num-processes", "2", "--init-timeout", "60"]
    procs = [subprocess.Popen([sys.executable, "-m", "ft_jax", "generate", *flags, "--process-id", str(i)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        seen = ""
        deadline = time.monotonic() + 240
        while "building the decode step" not in seen and time.monotonic() < deadline:
            seen += procs[0].stderr.readline()
        assert "building the decode step" in seen, seen[-3000:]
        time.sleep(2)  # decoding (4000 tokens take far longer)
        procs[0].send_signal(signal.SIGTERM)
        err = procs[0].stderr.read()
        assert procs[0].wait(timeout=60) == 143, err[-3000:]
        assert err.strip().splitlines()[-1] == "ft-jax generate: terminated (SIGTERM)", err[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_process_whose_peers_never_join_exits_with_one_line():
    """Process 0 of 2 alone: after --init-timeout a clean error and status 2 (XLA's coordination client would abort
    the process with SIGABRT and a C++ fatal log at its own timeout)."""
    address = f"localhost:{_free_port()}"
    proc = subprocess.run([sys.executable, "-m", "ft_jax", "generate", "--prompt", "R", "--max-new-tokens", "2",
                           "--coordinator", address, "--num-processes", "2", "--process-id", "0", "--init-timeout",
                           "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"ft-jax generate: error: process 0 of 2: not every process joined the coordinator {address} within 2 s "
        "(--init-timeout): start the others with the same --coordinator and --num-processes, each with its own "
        "--process-id in [0, 2)")
    assert "Check failure" not in proc.stderr and proc.stdout == ""


# --- in-process: the loader's share, errors, the N-device model ------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "gpt_oss_mxfp4", "qwen3_moe_fp8", "fused", "fused_q8_0"])
def test_loader_reads_a_range_of_experts_into_the_rows_of_the_whole_bank(tmp_path, family):
    if family.startswith("fused"):
        path = testing.write_random_checkpoint(tmp_path / "m", testing.tiny_config("MixtralForCausalLM"))
    else:
        path = os.path.join(FIXTURES, family)
    quantize = "q8_0" if family.endswith("q8_0") else None
    whole = load_checkpoint(path, quantize=quantize).banks
    part = load_checkpoint(path, quantize=quantize, experts=range(2, 6)).banks
    E = whole.num_rows // part.num_rows * 4
    assert part.names == whole.names and part.num_rows == whole.num_rows // 2
    for name in whole.names:
        rows = np.asarray(getattr(whole, name).numpy()).reshape(-1, E, *getattr(whole, name).row_shape)[:, 2:6]
        got = np.asarray(getattr(part, name).numpy()).reshape(rows.shape)
        assert np.array_equal(got.view(np.uint8), rows.view(np.uint8)), name


def test_loader_refuses_a_bad_range():
    with pytest.raises(ValueError, match="range of step 1 within the 8 experts"):
        load_checkpoint(os.path.join(FIXTURES, "mixtral"), experts=range(4, 9))


def test_experts_not_divisible_by_the_axis():
    with pytest.raises(ValueError, match=r"8 experts of each MoE layer cannot be split evenly over the 3 devices.*"
                                         r"\(1, 2, 4, 8\)"):
        ExpertPartition(8, 3)


def test_a_mesh_that_misses_a_process(monkeypatch):
    mesh = expert_mesh(1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"mesh does not match the processes: processes \[1\] of the 2"):
        ExpertPartition.from_mesh(mesh, 8)


def test_more_devices_than_jax_has():
    with pytest.raises(ValueError, match="asked for 64 devices but JAX has"):
        expert_mesh(64)


def test_unreachable_coordinator_names_the_address():
    port = _free_port()  # nothing listens there
    with pytest.raises(ConnectionError, match=rf"cannot reach the coordinator at localhost:{port} within 0.5 s"):
        launch.wait_for_coordinator(f"localhost:{port}", 0.5)


def test_process_flags_go_together():
    assert "go together" in launch.check_flags(None, "localhost:5000", 2, None)
    assert "not in [0, 2)" in launch.check_flags(None, "localhost:5000", 2, 2)
    assert "HOST:PORT" in launch.check_flags(None, "localhost", 2, 0)
    assert launch.check_flags(4, None, None, None) is None
    args = launch.parse_early(["generate", "--devices", "4", "--prompt", "x"])
    assert args.devices == 4 and args.coordinator is None
    assert launch.parse_early(["generate", "--devices", "four"]) is None  # the full parser reports it
    assert launch.parse_early(["trace", "--devices", "4"]) is None


def _trace(active) -> Trace:
    active = np.asarray(active, bool)  # [T, L, E]
    return Trace([TraceSequence("t/0", np.arange(len(active)), active, 0)], active.shape[1], active.shape[2],
                 int(active.sum(-1).max()), ["hand"])


def test_multi_device_model_of_one_device_is_the_replay():
    rng = np.random.default_rng(0)
    active = np.zeros((12, 3, 4), bool)
    for t in range(12):
        for layer in range(3):
            active[t, layer, rng.choice(4, 2, replace=False)] = True
    trace, model = _trace(active), CostModel(expert_bytes=1000, bp=1.0, bh=2.0, device_bandwidth=10.0)
    policies = [parse_policy("qstar:0.5")]
    one = evaluate(trace, policies, [3], model)
    same = multi_device.evaluate_devices(trace, policies, [3], model, 1)
    assert [r["ms_per_token"] for r in same] == pytest.approx([r["ms_per_token"] for r in one])
    # 2 devices own 3 * 2 experts each: 6, 9 and 12 slots all cap to 6, replayed once (one row, not three)
    capped = multi_device.evaluate_devices(trace, policies, [2, 6, 9, 12], model, 2)
    assert [r["cache_slots"] for r in capped] == [2, 6]


def test_multi_device_host_experts_pool_per_socket_and_layers_wait_for_the_slowest():
    """Hand-worked: host-all, 1 layer, E = 4 over 2 devices, 1000-byte experts at BH = 1 GB/s: 1e-3 ms of host
    GEMV per expert. Token 0 routes to experts 0 and 1 (both on device 0), token 1 to 0 and 2 (one per device)."""
    trace = _trace([[[1, 1, 0, 0]], [[1, 0, 1, 0]]])
    model = CostModel(expert_bytes=1000, bp=1.0, bh=1.0, device_bandwidth=10.0)
    policy = [parse_policy("host-all")]
    shared = multi_device.evaluate_devices(trace, policy, [1], model, 2, host_sockets=1)[0]
    own = multi_device.evaluate_devices(trace, policy, [1], model, 2, host_sockets=2, allreduce_ms=0.5)[0]
    # One socket: both tokens do 2 host experts on the one CPU: 2e-3 ms each.
    assert shared["ms_per_token"] == pytest.approx(2e-3)
    # A socket per device: token 0 = 2 experts on device 0 (2e-3), token 1 = 1 each in parallel (1e-3); + psum.
    assert own["ms_per_token"] == pytest.approx((2e-3 + 1e-3) / 2 + 0.5)
    assert [d["host_per_token"] for d in own["per_device"]] == [1.5, 0.5]
    assert shared["cache_slots"] == 1 and shared["cache_fraction"] == 0.5  # of the 2 experts a device owns
    with pytest.raises(ValueError, match="cannot be split evenly over 3 devices"):
        multi_device.shard_trace(trace, 3)
