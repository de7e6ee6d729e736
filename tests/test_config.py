"""config.json parsing: the four fixtures, both key styles, layer selection and clear errors."""

import json
import math
import os

import numpy as np
import pytest

from ft_jax.config import SUPPORTED_ARCHITECTURES, ConfigError, RopeScaling, config_from_dict, load_config
from ft_jax.models.layers import rope_frequencies

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")


def _raw(family):
    with open(os.path.join(FIXTURES, family, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("family,arch", [("mixtral", "MixtralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                         ("qwen3_moe", "Qwen3MoeForCausalLM"), ("olmoe", "OlmoeForCausalLM")])
def test_fixture_configs(family, arch):
    cfg = load_config(os.path.join(FIXTURES, family))
    info = json.load(open(os.path.join(FIXTURES, family, "reference", "info.json")))
    assert cfg.family == family and cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (256, 64, 4)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.num_experts, cfg.top_k) == (8, 2)
    assert list(cfg.moe_layers) == info["moe_layers"]
    assert cfg.num_moe_layers == len(info["moe_layers"])
    assert cfg.dtype == "float32" and cfg.hidden_act == "silu" and cfg.activation == "silu"
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and cfg.max_position_embeddings == 128
    assert not cfg.tie_word_embeddings
    expected = {  # (I, dense I, shared I, norm_topk_prob, qkv_bias, qk_norm, rope_theta, eps)
        "mixtral": (128, 0, 0, True, False, "none", 1e6, 1e-5),
        "qwen2_moe": (32, 128, 64, False, True, "none", 1e4, 1e-6),
        "qwen3_moe": (32, 128, 0, True, False, "per_head", 1e4, 1e-6),
        "olmoe": (32, 0, 0, False, False, "full", 1e4, 1e-5),
    }[family]
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.shared_expert_intermediate_size,
            cfg.norm_topk_prob, cfg.qkv_bias, cfg.qk_norm, cfg.rope_theta, cfg.rms_norm_eps) == expected
    assert cfg.moe_layer_index(cfg.moe_layers[-1]) == cfg.num_moe_layers - 1
    if family == "qwen3_moe":
        assert cfg.moe_layer_index(2) is None and cfg.moe_layer_index(3) == 2


def test_hub_key_style_equals_transformers5_style():
    """Hub configs: rope_theta (+ rope_scaling null), torch_dtype, num_experts instead of num_local_experts,
    head_dim absent."""
    new = _raw("mixtral")
    hub = dict(new)
    del hub["rope_parameters"], hub["dtype"], hub["num_local_experts"], hub["head_dim"]
    hub.update(rope_theta=1e6, rope_scaling=None, torch_dtype="bfloat16", num_experts=8)
    a, b = config_from_dict(new), config_from_dict(hub)
    assert b.dtype == "bfloat16" and a.dtype == "float32"
    assert a == config_from_dict({**hub, "torch_dtype": "float32"})
    q3 = _raw("qwen3_moe")
    q3_hub = {k: v for k, v in q3.items() if k not in ("rope_parameters", "num_local_experts")}
    q3_hub.update(rope_theta=10000.0, num_experts=8, rope_scaling={"rope_type": "default"})
    assert config_from_dict(q3_hub) == config_from_dict(q3)


def test_qwen_sparse_step_and_mlp_only_layers():
    raw = _raw("qwen2_moe")
    raw.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg = config_from_dict(raw)
    # MoE iff layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
    assert cfg.moe_layers == (1, 5)
    assert [cfg.moe_layer_index(l) for l in range(6)] == [None, 0, None, None, None, 1]


def test_mixtral_sliding_window_and_eos_list():
    raw = _raw("mixtral")
    raw.update(sliding_window=4096, eos_token_id=[2, 7])
    cfg = config_from_dict(raw)
    assert cfg.sliding_window == 4096 and cfg.eos_token_ids == (2, 7) and cfg.eos_token_id == 2
    assert config_from_dict({**raw, "eos_token_id": None}).eos_token_id is None


def test_unsupported_architecture_names_supported_ones(tmp_path):
    raw = _raw("mixtral")
    raw["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    msg = str(e.value)
    assert "LlamaForCausalLM" in msg and str(tmp_path) in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


@pytest.mark.parametrize("family,field", [("mixtral", "hidden_size"), ("qwen2_moe", "moe_intermediate_size"),
                                          ("qwen2_moe", "shared_expert_intermediate_size"),
                                          ("olmoe", "num_experts"), ("qwen3_moe", "num_experts_per_tok"),
                                          ("mixtral", "rope_theta")])
def test_missing_field_is_named(tmp_path, family, field):
    raw = _raw(family)
    raw.pop(field, None)
    if field == "num_experts":
        raw.pop("num_local_experts", None)
    if field == "rope_theta":
        raw.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=field):
        load_config(tmp_path)


def test_wrong_type_and_bad_json(tmp_path):
    raw = _raw("olmoe")
    raw["hidden_size"] = "64"
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_dict(raw)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("change", [
    {"rope_parameters": {"rope_theta": 1e6, "rope_type": "dynamic", "factor": 4.0}},
    {"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.5}},
    {"hidden_act": "relu"},
])
def test_unimplemented_features_raise(change):
    raw = {**_raw("mixtral"), **change}
    with pytest.raises(NotImplementedError):
        config_from_dict(raw)


@pytest.mark.parametrize("change,names", [
    # issue 18: a Hub rope_scaling beside transformers 5's rope_parameters was ignored (decoded with default RoPE)
    ({"rope_scaling": {"type": "dynamic", "factor": 4.0}},
     ["rope_scaling {'type': 'dynamic', 'factor': 4.0} (type 'dynamic')", "rope_parameters {", "(type 'default')"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["(type 'linear')", "(type 'default')"]),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0},
      "rope_scaling": {"type": "yarn", "factor": 8.0}},
     ["rope_scaling.factor=8.0 disagrees with rope_parameters.factor=4.0"]),
    ({"rope_theta": 1e4}, ["rope_theta=10000.0 disagrees with rope_parameters.rope_theta=1000000.0"]),
])
def test_rope_keys_that_disagree_are_refused(tmp_path, change, names):
    """rope_scaling beside rope_parameters with another type (or value), and rope_theta beside
    rope_parameters.rope_theta, are refused with one line naming the file and both keys with their values."""
    msg = _load_error(tmp_path, {**_raw("mixtral"), **change})
    assert msg.startswith(f"{tmp_path / 'config.json'}: ")
    for name in names:
        assert name in msg, msg
    # keys that agree are accepted: the same type (and values) in both, or rope_theta equal to the dict's
    same = {**_raw("mixtral"), "rope_scaling": {"type": "default"}, "rope_theta": 1e6}
    assert config_from_dict(same) == config_from_dict(_raw("mixtral"))


def test_qwen_sliding_window_not_implemented():
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        config_from_dict({**_raw("qwen3_moe"), "use_sliding_window": True})


def _load_error(tmp_path, raw) -> str:
    """Write raw as <tmp_path>/config.json, load it, return the ConfigError message (checked to be one line)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: "), msg
    return msg


@pytest.mark.parametrize("family,change,expected", [
    ("mixtral", {"num_hidden_layers": -1}, "num_hidden_layers must be >= 1, got -1"),
    ("qwen3_moe", {"num_hidden_layers": 0}, "num_hidden_layers must be >= 1, got 0"),
    ("mixtral", {"hidden_size": 0}, "hidden_size must be >= 1, got 0"),
    ("olmoe", {"num_attention_heads": 0}, "num_attention_heads must be >= 1, got 0"),
    ("mixtral", {"num_key_value_heads": 0}, "num_key_value_heads must be >= 1, got 0"),
    ("mixtral", {"num_key_value_heads": 3}, "num_key_value_heads must divide num_attention_heads=4, got 3"),
    ("mixtral", {"head_dim": -16}, "head_dim must be >= 1, got -16"),
    ("mixtral", {"head_dim": None, "hidden_size": 2},
     "head_dim is absent, so it is hidden_size // num_attention_heads, which needs hidden_size >= "
     "num_attention_heads=4, got hidden_size=2"),
    ("qwen2_moe", {"vocab_size": 0}, "vocab_size must be >= 1, got 0"),
    ("mixtral", {"intermediate_size": 0}, "intermediate_size must be >= 1, got 0"),
    ("olmoe", {"intermediate_size": -32}, "intermediate_size must be >= 1, got -32"),
    ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size must be >= 1, got 0"),
    ("qwen3_moe", {"intermediate_size": 0},  # layer 2 is dense (mlp_only_layers=[2])
     "intermediate_size (width of the dense layers) must be >= 1, got 0"),
    ("qwen2_moe", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size must be >= 0, got -1"),
    ("mixtral", {"max_position_embeddings": 0}, "max_position_embeddings must be >= 1, got 0"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts must be >= 1, got 0"),
    ("olmoe", {"num_experts": -8}, "num_experts must be >= 1, got -8"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok must be in [1, num_local_experts=8], got 9"),
    ("olmoe", {"num_experts_per_tok": 0}, "num_experts_per_tok must be in [1, num_experts=8], got 0"),
    ("mixtral", {"sliding_window": 0}, "sliding_window must be >= 1, got 0"),
    ("mixtral", {"rms_norm_eps": 0}, "rms_norm_eps must be > 0, got 0.0"),
    ("mixtral", {"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}}, "rope_theta must be > 0, got -1.0"),
    ("olmoe", {"clip_qkv": 0}, "clip_qkv must be > 0 (or null), got 0.0"),
    ("mixtral", {"bos_token_id": -1}, "bos_token_id must be >= 0, got -1"),
    ("mixtral", {"eos_token_id": [2, "x"]}, "eos_token_id must be a non-negative integer or a list of them, "
                                           "got [2, 'x']"),
    ("qwen2_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1, got 0"),
    ("qwen2_moe", {"mlp_only_layers": [1, 4]},
     "mlp_only_layers entries must be layer indices in [0, num_hidden_layers=4), got [4]"),
    ("qwen3_moe", {"mlp_only_layers": [0, 1, 2, 3]},
     "no MoE layer: every one of the num_hidden_layers=4 layers is dense (decoder_sparse_step=1, "
     "mlp_only_layers=[0, 1, 2, 3]); expected at least one MoE layer"),
    ("qwen2_moe", {"decoder_sparse_step": 5},
     "no MoE layer: every one of the num_hidden_layers=4 layers is dense (decoder_sparse_step=5, "
     "mlp_only_layers=[]); expected at least one MoE layer"),
])
def test_out_of_range_value_names_file_and_field(tmp_path, family, change, expected):
    """A bad value is a one-line ConfigError "<path>/config.json: <field> ..., got <value>" naming the key the
    file used (num_local_experts vs num_experts), not an internal message from the host bank or the router."""
    raw = {**_raw(family), **change}
    msg = _load_error(tmp_path, raw)
    assert msg == f"{tmp_path / 'config.json'}: {expected}"


# --- bad inputs and EOS ids (issue 11) -------------------------------------------------------------------------
def _folder(tmp_path, raw=None, generation=None):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw if raw is not None else _raw("mixtral")))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


@pytest.mark.parametrize("config_eos,generation,expected", [
    ([2, 148], None, (2, 148)),
    (2, {"eos_token_id": [2, 148]}, (2, 148)),  # generation_config.json takes precedence
    ([2, 148], {"eos_token_id": 7}, (7,)),
    ([2, 148], {"bos_token_id": 1}, (2, 148)),  # a generation config without the key keeps config.json's
    (2, {"eos_token_id": None}, ()),  # an explicit null: no EOS
])
def test_every_eos_id_is_kept_and_generation_config_wins(tmp_path, config_eos, generation, expected):
    d = _folder(tmp_path, {**_raw("mixtral"), "eos_token_id": config_eos}, generation)
    cfg = load_config(d)
    assert cfg.eos_token_ids == expected
    assert cfg.eos_token_id == (expected[0] if expected else None)


def test_generation_config_ids_are_validated_and_name_the_file(tmp_path):
    d = _folder(tmp_path, generation={"eos_token_id": [2, -5]})
    with pytest.raises(ConfigError) as e:
        load_config(d)
    assert str(e.value) == (f"{d / 'generation_config.json'}: eos_token_id must be a non-negative integer or a list "
                            "of them, got [2, -5]")
    (d / "generation_config.json").write_bytes(b'{"eos_token_id": 2, "x": "\xfe"}')
    with pytest.raises(ConfigError, match=r"generation_config.json: not UTF-8 text \(byte 0xfe at offset 26\)"):
        load_config(d)


def test_config_not_utf8_names_file_byte_and_offset(tmp_path):
    d = _folder(tmp_path)
    (d / "config.json").write_bytes(b'{"architectures": ["Mixtral\xe9"]}')
    with pytest.raises(ConfigError) as e:
        load_config(d)
    assert str(e.value) == (f"{d / 'config.json'}: not UTF-8 text (byte 0xe9 at offset 27); config.json must be "
                            "UTF-8 JSON")


def test_unsupported_activation_names_the_file(tmp_path):
    d = _folder(tmp_path, {**_raw("mixtral"), "hidden_act": "relu"})
    with pytest.raises(NotImplementedError) as e:
        load_config(d)
    assert str(e.value) == (f"{d / 'config.json'}: hidden_act 'relu' is not implemented (supported: "
                            "gelu_pytorch_tanh, silu, swish)")


@pytest.mark.parametrize("value", ["MixtralForCausalLM", [], [3], {"0": "MixtralForCausalLM"}])
def test_architectures_of_the_wrong_type_is_not_called_missing(tmp_path, value):
    msg = _load_error(tmp_path, {**_raw("mixtral"), "architectures": value})
    assert msg == (f"{tmp_path / 'config.json'}: field 'architectures' should be a non-empty list of class names "
                   f"such as [\"MixtralForCausalLM\"], got {value!r}")


def test_symlink_loops_and_dangling_links_name_the_cause(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    os.symlink(b, a)
    os.symlink(a, b)
    with pytest.raises(ConfigError) as e:
        load_config(a)
    assert str(e.value) == f"{a}: cannot open the model folder: symbolic link loop (too many levels of symbolic links)"
    d = _folder(tmp_path)
    os.remove(d / "config.json")
    os.symlink(d / "config.json", d / "config.json")
    with pytest.raises(ConfigError) as e:
        load_config(d)
    assert str(e.value) == (f"{d / 'config.json'}: cannot read config.json: symbolic link loop (too many levels of "
                            "symbolic links)")
    os.remove(d / "config.json")
    os.symlink("/nonexistent/config.json", d / "config.json")
    with pytest.raises(ConfigError) as e:
        load_config(d)
    assert str(e.value) == (f"{d / 'config.json'}: cannot read config.json: the file is a symbolic link to "
                            "'/nonexistent/config.json', which does not exist")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(ConfigError, match="dangling is a symbolic link to .*nowhere.*, which does not exist"):
        load_config(tmp_path / "dangling")
    for empty in ("", "  "):  # os.stat("") fails with an empty name in the message (a fresh-user trial)
        with pytest.raises(ConfigError, match="^the model path is empty: give a folder"):
            load_config(empty)


def test_config_that_is_a_fifo_or_a_folder(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    os.mkfifo(d / "config.json")
    with pytest.raises(ConfigError) as e:
        load_config(d)
    assert str(e.value) == (f"{d / 'config.json'}: is a FIFO (named pipe), not a regular file; expected "
                            "config.json")
    os.remove(d / "config.json")
    (d / "config.json").mkdir()
    with pytest.raises(ConfigError, match="is a folder, not a regular file"):
        load_config(d)


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod does not deny root reads")
def test_unreadable_folder_and_file_say_permission_denied(tmp_path):
    d = _folder(tmp_path)
    os.chmod(d / "config.json", 0)
    try:
        with pytest.raises(ConfigError) as e:
            load_config(d)
        assert str(e.value) == f"{d / 'config.json'}: cannot read config.json: permission denied"
    finally:
        os.chmod(d / "config.json", 0o644)
    os.chmod(d, 0)
    try:
        with pytest.raises(ConfigError) as e:
            load_config(d)
        assert str(e.value) == f"{d / 'config.json'}: cannot read config.json: permission denied"
    finally:
        os.chmod(d, 0o755)


def test_yarn_rope_parameters_and_frequencies():
    """YaRN from gpt-oss's rope_parameters; the frequencies keep the fast dimensions, divide the slow ones by the
    factor, ramp linearly between (Peng et al. 2023, eq. 17-18), and scale cos/sin by 0.1 ln(s) + 1."""
    raw = {**_raw("mixtral"), "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                   "original_max_position_embeddings": 4096}}
    cfg = config_from_dict(raw)
    assert cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False)
    D = 64
    inv, scale = rope_frequencies(D, 150000.0, cfg.rope_scaling)
    base = 150000.0 ** (-np.arange(0, D, 2) / D)
    # the ramp bounds: dimension d turns L * base^(-2d/D) / (2 pi) times over the original context L
    low = D * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(150000.0))
    high = D * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(150000.0))
    d = np.arange(D // 2)
    np.testing.assert_allclose(inv[d <= low], base[d <= low])  # extrapolated: unchanged
    np.testing.assert_allclose(inv[d >= high], base[d >= high] / 32)  # interpolated: divided by the factor
    mid = (d > low) & (d < high)
    w = (d[mid] - low) / (high - low)
    np.testing.assert_allclose(inv[mid], base[mid] / 32 * w + base[mid] * (1 - w))
    assert scale == pytest.approx(0.1 * math.log(32) + 1)
    # DeepSeek's mscale pair sets the attention factor; without yarn: the default frequencies, scale 1
    ds = RopeScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    assert rope_frequencies(D, 1e4, ds)[1] == pytest.approx(1.0)
    inv0, one = rope_frequencies(D, 1e4)
    np.testing.assert_allclose(inv0, 1e4 ** (-np.arange(0, D, 2) / D))
    assert one == 1.0


# --- DeepSeek-V2 / V3 (issue 10) ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,expected", [
    # (family, layers, moe_layers, q_lora, kv_lora, nope, rope, v, E, k, shared, scoring, method, groups, norm,
    #  scale, interleave, bias, yarn)
    ("deepseek_v3", ("deepseek_v3", 4, (1, 2, 3), 32, 16, 16, 8, 16, 8, 2, 1, "sigmoid", "noaux_tc", (4, 2), True,
                     2.5, True, False, False)),
    ("deepseek_v2", ("deepseek_v2", 3, (1, 2), None, 16, 16, 8, 12, 8, 3, 2, "softmax", "greedy", (1, 1), False,
                     1.0, True, False, False)),
    ("deepseek_v2_group", ("deepseek_v2", 3, (0, 1, 2), 24, 16, 16, 8, 16, 8, 3, 1, "softmax",
                           "group_limited_greedy", (4, 2), True, 1.5, True, True, True)),
    ("deepseek_v3_nonorm", ("deepseek_v3", 4, (2, 3), 32, 16, 16, 8, 16, 8, 3, 2, "sigmoid", "noaux_tc", (2, 1),
                            False, 2.0, False, False, False)),
    ("deepseek_v3_yarn", ("deepseek_v3", 3, (1, 2), 32, 16, 16, 16, 16, 8, 4, 1, "sigmoid", "noaux_tc", (4, 3),
                          True, 2.5, True, False, True)),
])
def test_deepseek_fixture_configs(name, expected):
    cfg = load_config(os.path.join(FIXTURES, name))
    info = json.load(open(os.path.join(FIXTURES, name, "reference", "info.json")))
    got = (cfg.family, cfg.num_layers, cfg.moe_layers, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
           cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.num_experts, cfg.top_k, cfg.n_shared_experts, cfg.scoring_func,
           cfg.topk_method, (cfg.n_group, cfg.topk_group), cfg.norm_topk_prob, cfg.routed_scaling_factor,
           cfg.rope_interleave, cfg.qkv_bias, cfg.rope_scaling is not None)
    assert got == expected
    assert list(cfg.moe_layers) == info["moe_layers"]
    # MLA: every head's key comes from the shared latent; the RoPE width is qk_rope_head_dim
    assert cfg.num_kv_heads == cfg.num_heads and cfg.head_dim == cfg.qk_rope_head_dim


def test_deepseek_hub_key_style_equals_transformers5_style():
    """deepseek_v3_yarn's config.json is in the Hub style (rope_theta + rope_scaling{type: yarn}, torch_dtype,
    scoring_func, topk_method, moe_layer_freq, no head_dim): the transformers-5 spelling gives the same config."""
    hub = _raw("deepseek_v3_yarn")
    new = {k: v for k, v in hub.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype", "scoring_func",
                                                      "topk_method", "moe_layer_freq")}
    scaling = {k: v for k, v in hub["rope_scaling"].items() if k != "type"}
    new.update(rope_parameters={"rope_type": "yarn", "rope_theta": hub["rope_theta"], **scaling}, dtype="float32",
               head_dim=hub["qk_rope_head_dim"])
    a, b = config_from_dict(hub), config_from_dict(new)
    assert a == b
    assert a.rope_scaling == RopeScaling(factor=8.0, original_max_position_embeddings=16, mscale=1.0,
                                         mscale_all_dim=1.0)


def test_deepseek_defaults_and_layer_selection():
    """Absent routing fields take transformers' DeepseekV2Config / DeepseekV3Config defaults; layer l is MoE iff
    l >= first_k_dense_replace (transformers does not read moe_layer_freq)."""
    v2 = {k: v for k, v in _raw("deepseek_v2").items()
          if k not in ("topk_method", "norm_topk_prob", "routed_scaling_factor", "n_shared_experts", "scoring_func",
                       "first_k_dense_replace", "n_group", "topk_group")}
    cfg = config_from_dict(v2)
    assert (cfg.topk_method, cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.n_shared_experts,
            cfg.moe_layers) == ("greedy", False, 1.0, 2, (0, 1, 2))
    v3 = {k: v for k, v in _raw("deepseek_v3").items()
          if k not in ("norm_topk_prob", "routed_scaling_factor", "n_shared_experts", "rope_interleave", "n_group",
                       "topk_group", "first_k_dense_replace")}
    v3.update(n_routed_experts=16, num_hidden_layers=5)
    cfg = config_from_dict(v3)
    assert (cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.n_shared_experts,
            cfg.rope_interleave, cfg.moe_layers) == (8, 4, True, 2.5, 1, True, (3, 4))
    raw = _raw("deepseek_v3")
    assert config_from_dict({**raw, "moe_layer_freq": 2}).moe_layers == config_from_dict(raw).moe_layers == (1, 2, 3)
    assert config_from_dict({**raw, "n_shared_experts": None}).n_shared_experts == 0
    assert config_from_dict({**raw, "first_k_dense_replace": 0, "intermediate_size": None}).moe_layers == (0, 1, 2, 3)


@pytest.mark.parametrize("family,change,expected", [
    ("deepseek_v3", {"kv_lora_rank": 0}, "kv_lora_rank must be >= 1, got 0"),
    ("deepseek_v3", {"q_lora_rank": 0}, "q_lora_rank must be >= 1, got 0"),
    ("deepseek_v3", {"qk_nope_head_dim": -1}, "qk_nope_head_dim must be >= 1, got -1"),
    ("deepseek_v3", {"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even (RoPE rotates pairs of dimensions), "
                                            "got 7"),
    ("deepseek_v3", {"v_head_dim": 0}, "v_head_dim must be >= 1, got 0"),
    ("deepseek_v3", {"n_routed_experts": 0}, "n_routed_experts must be >= 1, got 0"),
    ("deepseek_v3", {"n_routed_experts": None}, "required field 'n_routed_experts' is missing"),
    ("deepseek_v3", {"num_experts_per_tok": 9}, "num_experts_per_tok must be in [1, n_routed_experts=8], got 9"),
    ("deepseek_v3", {"n_shared_experts": -1}, "n_shared_experts must be >= 0, got -1"),
    ("deepseek_v3", {"moe_intermediate_size": 0}, "moe_intermediate_size must be >= 1, got 0"),
    ("deepseek_v3", {"first_k_dense_replace": 4},
     "first_k_dense_replace must be in [0, num_hidden_layers - 1 = 3] (at least one MoE layer), got 4"),
    ("deepseek_v3", {"first_k_dense_replace": -1},
     "first_k_dense_replace must be in [0, num_hidden_layers - 1 = 3] (at least one MoE layer), got -1"),
    ("deepseek_v3", {"intermediate_size": None}, "required field 'intermediate_size' is missing"),
    ("deepseek_v3", {"moe_layer_freq": 0}, "moe_layer_freq must be >= 1, got 0"),
    ("deepseek_v3", {"n_group": 3}, "n_group must divide n_routed_experts=8, got 3"),
    ("deepseek_v3", {"n_group": 0}, "n_group must be >= 1, got 0"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group must be in [1, n_group=4], got 5"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 2},
     "n_group must leave >= 2 experts per group (a group's score is the sum of its top-2 expert scores), got "
     "n_group=8 for n_routed_experts=8"),
    ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3},
     "num_experts_per_tok must be <= topk_group * n_routed_experts / n_group = 2 (the experts of the groups a token "
     "may use), got 3"),
    ("deepseek_v3", {"routed_scaling_factor": 0}, "routed_scaling_factor must be > 0, got 0.0"),
    ("deepseek_v3", {"routed_scaling_factor": "2.5"}, "field 'routed_scaling_factor' should be float, got '2.5'"),
    ("deepseek_v3", {"norm_topk_prob": 1}, "field 'norm_topk_prob' should be bool, got 1"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method must be 'noaux_tc' for DeepseekV3ForCausalLM, got "
                                               "'greedy'"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method must be 'greedy' or 'group_limited_greedy' for "
                                                 "DeepseekV2ForCausalLM, got 'noaux_tc'"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": None},
     "required field 'n_group' is missing"),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4}, "required field 'topk_group' is missing"),
])
def test_deepseek_bad_values_name_file_and_field(tmp_path, family, change, expected):
    raw = {**_raw(family), **change}
    assert _load_error(tmp_path, raw) == f"{tmp_path / 'config.json'}: {expected}"


def test_deepseek_q_lora_rank_must_be_present_and_unimplemented_fields_raise(tmp_path):
    raw = {k: v for k, v in _raw("deepseek_v3").items() if k != "q_lora_rank"}
    assert _load_error(tmp_path, raw).endswith("required field 'q_lora_rank' is missing (null means a plain q_proj)")
    for family, change, field in (("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
                                  ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
                                  ("deepseek_v2", {"mlp_bias": True}, "mlp_bias")):
        with pytest.raises(NotImplementedError, match=field):
            config_from_dict({**_raw(family), **change}, source="x/config.json")
def test_gpt_oss_configs():
    """The shared gpt_oss fixture (transformers 5 key style) and gpt_oss_mxfp4 (Hub style: rope_theta + rope_scaling,
    torch_dtype, quantization_config mxfp4)."""
    cfg = load_config(os.path.join(FIXTURES, "gpt_oss"))
    assert cfg.family == "gpt_oss" and cfg.architecture == "GptOssForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 4, 2, 16)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.moe_layers) == (8, 2, 32, (0, 1, 2, 3))
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == 8
    assert [cfg.attention_window(l) for l in range(4)] == [8, None, 8, None]
    assert cfg.qkv_bias and cfg.o_bias and cfg.attention_sinks and cfg.router_bias and cfg.expert_bias
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.activation) == (1.702, 7.0, "swiglu_oai")
    assert cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False)
    hub = load_config(os.path.join(FIXTURES, "gpt_oss_mxfp4"))
    assert (hub.num_layers, hub.top_k, hub.sliding_window) == (3, 3, 5)
    assert [hub.attention_window(l) for l in range(3)] == [5, 5, None]
    assert hub.rope_theta == 150000.0 and hub.rope_scaling == cfg.rope_scaling and hub.dtype == "float32"


def test_gpt_oss_defaults_are_transformers_gpt_oss_config():
    """Absent fields take GptOssConfig's defaults: layer_types alternate from sliding, YaRN (factor 32, 4096,
    truncate false) with rope_theta 150000, attention_bias true, swiglu 1.702 / 7.0."""
    raw = {k: v for k, v in _raw("gpt_oss").items()
           if k not in ("layer_types", "rope_parameters", "attention_bias", "swiglu_alpha", "swiglu_limit")}
    cfg = config_from_dict({**raw, "num_hidden_layers": 3})
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == RopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                           beta_slow=1.0, truncate=False)
    assert cfg.qkv_bias and cfg.o_bias and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    no_window = config_from_dict({**raw, "sliding_window": None})
    assert [no_window.attention_window(l) for l in range(4)] == [None] * 4


@pytest.mark.parametrize("change,error,expected", [
    ({"layer_types": ["sliding_attention"] * 3}, ConfigError, "layer_types must list one of sliding_attention, "
     "full_attention for each of the num_hidden_layers=4 layers"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]}, ConfigError,
     "'chunked_attention'"),
    ({"swiglu_limit": 0}, ConfigError, "swiglu_limit must be > 0, got 0"),
    ({"sliding_window": 0}, ConfigError, "sliding_window must be >= 1, got 0"),
    ({"quantization_config": {"quant_method": "gptq"}}, ConfigError, "quant_method 'gptq' is not implemented"),
])
def test_gpt_oss_bad_fields_name_the_field(change, error, expected):
    with pytest.raises(error, match="config.json: .*" + expected.replace("(", r"\(").replace("[", r"\[")):
        config_from_dict({**_raw("gpt_oss"), **change})


def test_yarn_frequencies_equal_transformers():
    """rope_frequencies against transformers' _compute_yarn_parameters (tests/fixtures/rope_yarn_reference.json,
    written by scripts/make_gpt_oss_references.py): gpt-oss-20b's rope (truncate off and on), the tiny fixture's,
    DeepSeek's mscale pair, an mscale ratio, an explicit attention_factor, and original_max_position_embeddings
    absent (the config's max_position_embeddings), at the top level (it wins) and in the rope dict."""
    with open(os.path.join(os.path.dirname(__file__), "fixtures", "rope_yarn_reference.json")) as f:
        ref = json.load(f)
    for name, case in ref["cases"].items():
        raw = {**_raw("gpt_oss"), **case["config"]}
        raw["num_local_experts"], raw["num_experts_per_tok"] = 8, 2
        raw["layer_types"] = ["sliding_attention", "full_attention"] * (raw["num_hidden_layers"] // 2)
        cfg = config_from_dict(raw)
        inv, scale = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # transformers computes in float32: within a few float32 ulps
        np.testing.assert_allclose(inv, case["inv_freq"], rtol=3e-7, atol=0, err_msg=name)
        assert scale == pytest.approx(case["attention_factor"], rel=1e-12), name


def test_special_ids_outside_the_vocabulary_are_refused(tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny", "mixtral"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 999999}))
    with pytest.raises(ConfigError, match=r"special token id 999999 .* outside the vocabulary"):
        load_config(str(folder))
