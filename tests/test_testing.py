"""ft_jax.testing: the random checkpoints it writes have the layout transformers writes (checked against the
transformers-written fixtures, tensor by tensor), load and decode in every family, and assert_policies_agree
reports a disagreement by policy, cache size and position."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import ft_jax
from ft_jax import testing
from ft_jax.engine.engine import Engine

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
FAMILY_FIXTURE = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe",
                  "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                  "GptOssForCausalLM": "gpt_oss"}


def _header(path):
    """{tensor name: (dtype, shape)} from a .safetensors header (the format's 8-byte length + JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}


def _per_expert_form(header, num_experts):
    """The fused expert tensors (transformers 5's mlp.experts.gate_up_proj [E, 2I, H] / down_proj [E, H, I]) as
    the per-expert gate/up/down names and shapes older transformers write, so both layouts compare."""
    out = {}
    for name, (dtype, shape) in header.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and len(shape) == 3:
            for e in range(num_experts):
                out[f"{prefix}.{e}.gate_proj.weight"] = (dtype, (shape[1] // 2, shape[2]))
                out[f"{prefix}.{e}.up_proj.weight"] = (dtype, (shape[1] // 2, shape[2]))
        elif leaf == "down_proj" and len(shape) == 3:
            for e in range(num_experts):
                out[f"{prefix}.{e}.down_proj.weight"] = (dtype, shape[1:])
        else:
            out[name] = (dtype, shape)
    return out


def _mixtral_names(header):
    """Mixtral's per-expert names (block_sparse_moe.experts.e.w1/w3/w2) as the mlp.experts.e.gate/up/down ones."""
    renames = {".block_sparse_moe.gate.": ".mlp.gate.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
               ".w2.": ".down_proj.", ".block_sparse_moe.experts.": ".mlp.experts."}
    out = {}
    for name, value in header.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        out[name] = value
    return out


@pytest.mark.parametrize("architecture", sorted(FAMILY_FIXTURE))
def test_written_layout_matches_the_transformers_fixture(tmp_path, architecture):
    """Written from the fixture's own config.json, every tensor has the name, shape and dtype transformers gave it."""
    fixture = os.path.join(FIXTURES, FAMILY_FIXTURE[architecture])
    config = json.load(open(os.path.join(fixture, "config.json")))
    config.pop("quantization_config", None)
    testing.write_random_checkpoint(tmp_path, config)
    expected = _header(os.path.join(fixture, "model.safetensors"))
    written = _header(tmp_path / "model.safetensors")
    num_experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts")
    if architecture != "GptOssForCausalLM":  # its fixture holds the fused form too
        written = _per_expert_form(written, num_experts)
    if architecture == "MixtralForCausalLM":
        expected, written = _mixtral_names(expected), _mixtral_names(written)
    assert set(written) == set(expected), (sorted(set(written) ^ set(expected)))
    for name, value in expected.items():
        assert written[name] == value, name


@pytest.mark.parametrize("architecture", sorted(FAMILY_FIXTURE))
def test_every_family_writes_loads_and_decodes_alike_under_every_policy(tmp_path, architecture):
    path = testing.write_random_checkpoint(tmp_path, testing.tiny_config(architecture), seed=1)
    tokens = testing.assert_policies_agree(path, [1, 5, 9, 13], policies=("resident", "host-all", "fixed-cap:1"),
                                           cache_slots=(1,), max_new_tokens=4)
    assert len(tokens) == 4 and all(0 <= t < 256 for t in tokens)
    model = ft_jax.load(path, policy="host-all")
    assert model.config.architecture == architecture


def test_weights_follow_seed_std_and_dtype(tmp_path):
    from safetensors.numpy import load_file

    a = load_file(testing.write_random_checkpoint(tmp_path / "a", seed=3, std=0.02) + "/model.safetensors")
    b = load_file(testing.write_random_checkpoint(tmp_path / "b", seed=3, std=0.02) + "/model.safetensors")
    c = load_file(testing.write_random_checkpoint(tmp_path / "c", seed=4, std=0.02, dtype="bfloat16")
                  + "/model.safetensors")
    w = a["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(w, b["model.layers.0.self_attn.q_proj.weight"])
    assert w.dtype == np.float32 and 0.015 < w.std() < 0.025 and abs(w.mean()) < 0.005
    norm = a["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean() - 1.0) < 0.01
    assert c["model.layers.0.self_attn.q_proj.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert json.load(open(tmp_path / "c" / "config.json"))["torch_dtype"] == "bfloat16"
    assert not np.array_equal(c["model.layers.0.self_attn.q_proj.weight"].astype(np.float32), w)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*supported: MixtralForCausalLM"):
        testing.tiny_config("LlamaForCausalLM")


def test_a_disagreement_names_policy_cache_size_and_position(tmp_path, monkeypatch):
    path = testing.write_random_checkpoint(tmp_path, testing.tiny_config("Qwen3MoeForCausalLM"))
    real = Engine.generate

    def host_all_off_by_one_at_token_2(self, prompts, **kw):
        out = real(self, prompts, **kw)
        if self.policy.kind == "host-all":
            out.tokens[0][2] = (out.tokens[0][2] + 1) % 256
        return out

    monkeypatch.setattr(Engine, "generate", host_all_off_by_one_at_token_2)
    with pytest.raises(AssertionError, match=r"host-all with 1 slots decodes .* but resident with 16 slots .*"
                                             r"differ first at new token 2"):
        testing.assert_policies_agree(path, [1, 2, 3], policies=("resident", "host-all"), max_new_tokens=4)
