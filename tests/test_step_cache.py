"""The cache of compiled steps (ft_jax.engine.step_cache): a step is loaded without tracing only where everything its
trace reads is the same, and the loaded step gives the tokens the traced one gives (the transformers references)."""

import dataclasses
import enum
import json
import os
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ft_jax.checkpoint import load_checkpoint
from ft_jax.engine import step_cache
from ft_jax.engine.engine import Engine
from ft_jax.engine.sampling import Sampling
from ft_jax.engine.step_cache import Uncacheable, describe
from ft_jax.offload.cost_model import auto_costs
from ft_jax.offload.policy import Policy

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


@pytest.fixture
def cache_folder(tmp_path):
    """The step cache on in tmp_path for the test, off again afterwards."""
    step_cache.enable(tmp_path / "steps")
    yield tmp_path / "steps"
    step_cache.enable(None)


def _info(family):
    with open(os.path.join(FIXTURES, family, "reference", "info.json")) as f:
        return json.load(f)


class _Kind(enum.Enum):
    A = 1
    B = 2


class _Pair(NamedTuple):
    a: int
    b: float


@dataclasses.dataclass(frozen=True)
class _Config:
    size: int
    scale: float
    names: tuple


def test_describe_tells_apart_what_a_trace_would():
    pairs = [(1, 1.0), (1, True), (0.1, 0.10000000000000002), ("a", b"a"), ((1, 2), [1, 2]), ((1, 2.0), _Pair(1, 2.0)),
             (_Kind.A, _Kind.B), (np.dtype(np.float32), np.dtype(jnp.bfloat16)), (np.int32(1), np.int64(1)),
             (_Config(1, 0.5, ("x",)), _Config(1, 0.5, ("y",))), (np.arange(4), np.arange(4) * 2),
             (np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64)), ({"a": 1}, {"a": 2}), (None, 0)]
    for x, y in pairs:
        assert describe(x) != describe(y), (x, y)
    assert describe({"b": 2, "a": 1}) == describe({"a": 1, "b": 2})  # a mapping's order is not part of it
    assert describe(_Config(1, 0.5, ("x",))) == describe(_Config(1, 0.5, ("x",)))


@pytest.mark.parametrize("value", [object(), np.zeros(1 << 18), [1, {"deep": object()}]],
                         ids=["object", "large array", "nested"])
def test_describe_refuses_what_it_cannot_see(value):
    with pytest.raises(Uncacheable):
        describe(value)


def test_describe_refuses_a_function_with_a_closure():
    captured = 3
    assert describe(os.path.join) == "function:posixpath.join" != describe(os.path.split)
    with pytest.raises(Uncacheable, match="closure"):
        describe(lambda: captured)


def test_a_step_key_is_none_for_an_unknown_closure():
    assert step_cache.step_key("decode", {"greedy": True}, (np.zeros(3, np.int32),), (object(),), {}) is None
    key = step_cache.step_key("decode", {"greedy": True}, (np.zeros(3, np.int32),), ((1, 2),), {})
    assert key is not None and key != step_cache.step_key("decode", {"greedy": False},
                                                         (np.zeros(3, np.int32),), ((1, 2),), {})
    assert key != step_cache.step_key("decode", {"greedy": True}, (np.zeros(4, np.int32),), ((1, 2),), {})
    assert key != step_cache.step_key("decode", {"greedy": True}, (np.zeros(3, np.int64),), ((1, 2),), {})
    assert key != step_cache.step_key("prefill", {"greedy": True}, (np.zeros(3, np.int32),), ((1, 2),), {})


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss_mxfp4",
                                    "qwen3_moe_fp8"])
def test_a_second_engine_loads_both_steps_and_decodes_the_reference(cache_folder, family):
    info = _info(family)
    ckpt = load_checkpoint(os.path.join(FIXTURES, family), dtype=jnp.float32)
    n = len(info["greedy_continuation"])
    first = Engine(ckpt, policy=Policy("qstar", frac=0.5), num_slots=3).generate([info["prompt_ids"]],
                                                                                   max_new_tokens=n)
    assert first.stats["xla_compiles"] == 2 and first.stats["cache_hits"] == 0
    assert len(list(cache_folder.glob("*.bin"))) == 2
    again = Engine(ckpt, policy=Policy("qstar", frac=0.5), num_slots=3).generate([info["prompt_ids"]],
                                                                                   max_new_tokens=n)
    assert again.stats["xla_compiles"] == 0 and again.stats["cache_hits"] == 2
    assert first.tokens[0] == again.tokens[0] == info["greedy_continuation"]


def test_another_policy_slot_count_or_sampling_is_another_step(cache_folder):
    info = _info("mixtral")
    ckpt = load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.float32)
    prompt, n = [info["prompt_ids"]], len(info["greedy_continuation"])
    Engine(ckpt, policy=Policy("qstar", frac=0.5), num_slots=3).generate(prompt, max_new_tokens=n)
    for policy, slots, sampling in [(Policy("qstar", frac=0.25), 3, Sampling()), (Policy("host-all"), 3, Sampling()),
                                    (Policy("qstar", frac=0.5), 4, Sampling()),
                                    (Policy("qstar", frac=0.5), 3, Sampling(0.7))]:
        before = set(cache_folder.glob("*.bin"))
        result = Engine(ckpt, policy=policy, num_slots=slots).generate(prompt, max_new_tokens=n, sampling=sampling)
        # The decode step is another one each time; the prefill (fetch-all whatever the decode policy) may be shared
        stats = result.stats
        assert stats["xla_compiles"] >= 1 and stats["xla_compiles"] + stats["cache_hits"] == 2, (policy, slots)
        assert len(set(cache_folder.glob("*.bin")) - before) == stats["xla_compiles"]
        if sampling.greedy:
            assert result.tokens[0] == info["greedy_continuation"]


def test_a_damaged_entry_is_compiled_again(cache_folder):
    info = _info("olmoe")
    ckpt = load_checkpoint(os.path.join(FIXTURES, "olmoe"), dtype=jnp.float32)
    prompt, n = [info["prompt_ids"]], len(info["greedy_continuation"])
    Engine(ckpt, policy=Policy("fetch-all"), num_slots=4).generate(prompt, max_new_tokens=n)
    for i, entry in enumerate(sorted(cache_folder.glob("*.bin"))):
        entry.write_bytes(b"" if i == 0 else entry.read_bytes()[:1000])  # empty, and cut short
    result = Engine(ckpt, policy=Policy("fetch-all"), num_slots=4).generate(prompt, max_new_tokens=n)
    assert result.stats["cache_hits"] + result.stats["xla_compiles"] == 2  # JAX's own cache may hold them
    assert result.tokens[0] == info["greedy_continuation"]
    assert not list(cache_folder.glob("*.bin"))  # removed, not stored: compiled as without this cache
    again = Engine(ckpt, policy=Policy("fetch-all"), num_slots=4).generate(prompt, max_new_tokens=n)
    assert again.stats["xla_compiles"] == 2 and len(list(cache_folder.glob("*.bin"))) == 2
    last = Engine(ckpt, policy=Policy("fetch-all"), num_slots=4).generate(prompt, max_new_tokens=n)
    assert last.stats["cache_hits"] == 2 and last.tokens[0] == info["greedy_continuation"]


def test_other_banks_are_another_step(cache_folder):
    """A second load of the same checkpoint has banks of other ids: its steps are compiled, not the first's reused."""
    info = _info("qwen3_moe")
    prompt, n = [info["prompt_ids"]], len(info["greedy_continuation"])
    for _ in range(2):
        ckpt = load_checkpoint(os.path.join(FIXTURES, "qwen3_moe"), dtype=jnp.float32)
        result = Engine(ckpt, policy=Policy("qstar", frac=0.5), num_slots=3).generate(prompt, max_new_tokens=n)
        assert result.stats["cache_hits"] == 0 and result.tokens[0] == info["greedy_continuation"]


def _generate(tmp_path, *flags):
    info = _info("mixtral")
    cmd = [sys.executable, "-m", "ft_jax", "generate", "--model", os.path.join(FIXTURES, "mixtral"), "--prompt-ids",
           ",".join(map(str, info["prompt_ids"])), "--max-new-tokens", str(len(info["greedy_continuation"])),
           "--temperature", "0", "--json", *flags]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), info


def test_the_command_line_loads_its_steps_on_the_second_run(tmp_path):
    first, info = _generate(tmp_path, "--policy", "qstar:0.5")
    second, _ = _generate(tmp_path, "--policy", "qstar:0.5")
    assert first["stats"]["xla_compiles"] == 2
    assert second["stats"]["xla_compiles"] == 0 and second["stats"]["cache_hits"] == 2
    assert first["generated_ids"][0] == second["generated_ids"][0] == info["greedy_continuation"]
    steps = tmp_path / "cache" / "ft_jax" / "compile" / step_cache.FOLDER
    assert len(list(steps.glob("*.bin"))) == 2
    off, _ = _generate(tmp_path, "--policy", "qstar:0.5", "--no-compile-cache")
    assert off["stats"]["cache_hits"] == 0 and off["generated_ids"][0] == info["greedy_continuation"]


def test_bf16_host_weights_steps_are_loaded_and_decode_alike(cache_folder):
    """bf16 on a CPU with the AVX-512 BF16 dot: the dense weights are HostWeights, whose bank ids are static data of
    the parameters' tree (the key's treedef); elsewhere arrays."""
    info = _info("mixtral")
    ckpt = load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.bfloat16)
    prompt = [info["prompt_ids"], info["prompt_ids"][:5]]
    first = Engine(ckpt, policy=Policy("host-all"), num_slots=1).generate(prompt, max_new_tokens=12)
    again = Engine(ckpt, policy=Policy("host-all"), num_slots=1).generate(prompt, max_new_tokens=12)
    assert first.stats["xla_compiles"] == 2 and again.stats["cache_hits"] == 2
    assert first.tokens == again.tokens


def test_the_least_recently_used_entries_go(tmp_path, monkeypatch):
    monkeypatch.setattr(step_cache, "MAX_ENTRIES", 3)
    cache = step_cache.StepCache(tmp_path)
    ckpt = load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.float32)
    engine = Engine(ckpt, policy=Policy("host-all"), num_slots=1)
    engine._step_cache = cache
    engine.generate([[1, 2, 3]], max_new_tokens=3)  # the prefill and the decode step
    first = sorted(tmp_path.glob("*.bin"), key=lambda p: p.stat().st_mtime_ns)
    os.utime(first[0], ns=(1, 1))
    os.utime(first[1], ns=(2, 2))
    loaded, found = cache.load(first[0].stem)  # used now: the newest
    assert loaded is not None and found
    engine.generate([[1, 2, 3]], max_new_tokens=3, sampling=Sampling(0.5))  # two more steps
    kept = {p.name for p in tmp_path.glob("*.bin")}
    assert len(kept) == 3 and first[0].name in kept and first[1].name not in kept


@pytest.mark.parametrize("policy", ["auto", Policy("fetch-all"), Policy("host-all"), Policy("resident"),
                                    Policy("fixed-cap", cap=1)], ids=str)
def test_every_policy_is_cached_and_decodes_the_reference(cache_folder, policy):
    info = _info("mixtral")
    ckpt = load_checkpoint(os.path.join(FIXTURES, "mixtral"), dtype=jnp.float32)
    if policy == "auto":
        policy = Policy("auto", costs=auto_costs(ckpt.banks.gate_up.row_bytes + ckpt.banks.down.row_bytes, 10.0, 10.0))
    prompt, n = [info["prompt_ids"]], len(info["greedy_continuation"])
    for hits in (0, 2):
        result = Engine(ckpt, policy=policy, num_slots=5).generate(prompt, max_new_tokens=n)
        assert result.stats["cache_hits"] == hits and result.tokens[0] == info["greedy_continuation"]


class _Opaque:
    """A pytree node whose static data prints with its address (as a plain object's repr does)."""


jax.tree_util.register_pytree_node(_Opaque, lambda o: ((), object()), lambda aux, children: _Opaque())


def test_a_key_with_an_address_in_it_is_none():
    """Such a key would differ at every launch: the step is compiled as without the cache, not at every launch."""
    assert step_cache.step_key("decode", {}, (_Opaque(), np.zeros(2, np.int32)), (), {}) is None
