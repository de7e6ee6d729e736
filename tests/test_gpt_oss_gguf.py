"""scripts/synthetic_checkpoint.py --family gpt_oss (MXFP4 experts as the Hub stores them) and
scripts/gpt_oss_to_gguf.py (their GGUF for llama.cpp) on the tiny default gpt-oss shape.

The checkpoint is read back with the safetensors package and loaded with transformers (which dequantizes the
MXFP4 experts itself: an independent reading of the layout); the GGUF is read back with gguf.GGUFReader and its
MXFP4 tensors dequantized with gguf.quants (the Python port of ggml's dequantize_row_mxfp4) and compared with
ft_jax.weight_formats.dequantize of the safetensors blocks. When llama.cpp's llama-bench is built
(scripts/llama_cpp_build.py, cached under ~/.cache/ft_jax/bench_peer) it must load the file and decode with it.
"""

import argparse
import json
import subprocess

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from ft_jax import weight_formats
from ft_jax.config import load_config

from script_modules import load_script


@pytest.fixture(scope="module")
def sc():
    return load_script("synthetic_checkpoint")


@pytest.fixture(scope="module")
def og():
    return load_script("gpt_oss_to_gguf")


@pytest.fixture(scope="module")
def tiny(sc, tmp_path_factory):
    """(folder, config, {name: array}) of the tiny gpt-oss checkpoint (the --family gpt_oss defaults)."""
    folder = tmp_path_factory.mktemp("tiny_gpt_oss")
    p = argparse.ArgumentParser()
    sc.add_model_arguments(p)
    config = sc.config_from_args(p.parse_args(["--family", "gpt_oss"]))
    sc.write_checkpoint(folder, config, seed=5)
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return folder, config, tensors


@pytest.fixture(scope="module")
def tiny_gguf(og, tiny, tmp_path_factory):
    pytest.importorskip("gguf")
    out = tmp_path_factory.mktemp("tiny_gpt_oss_gguf") / "model-mxfp4.gguf"
    og.write_gguf(tiny[0], out)
    return out


def test_config_has_the_hub_gpt_oss_keys(sc, tiny):
    folder, config, _ = tiny
    on_disk = json.loads((folder / "config.json").read_text())
    assert on_disk == config
    assert on_disk["architectures"] == ["GptOssForCausalLM"]
    assert on_disk["quantization_config"]["quant_method"] == "mxfp4"
    assert on_disk["layer_types"] == ["sliding_attention", "full_attention"]
    assert on_disk["rope_scaling"]["rope_type"] == "yarn" and on_disk["attention_bias"] is True
    cfg = load_config(folder)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers, cfg.num_experts, cfg.top_k) == (64, 64, 2, 4, 2)
    assert cfg.attention_sinks and cfg.router_bias and cfg.expert_bias and cfg.layer_types[0] == "sliding_attention"


def test_20b_preset_has_the_released_shape(sc):
    p = argparse.ArgumentParser()
    sc.add_model_arguments(p)
    c = sc.config_from_args(p.parse_args(["--preset", "gpt-oss-20b"]))
    assert (c["num_hidden_layers"], c["num_local_experts"], c["num_experts_per_tok"], c["hidden_size"],
            c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
            c["vocab_size"], c["sliding_window"]) == (24, 32, 4, 2880, 2880, 64, 8, 64, 201088, 128)
    assert c["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    # openai/gpt-oss-20b's safetensors hold 13.76 GB (20.9 B parameters, the experts at 4.25 bits)
    specs = sc.gpt_oss_tensor_specs(c)
    total = sum(int(np.prod(shape)) * (1 if kind.startswith("mxfp4") else 2) for _, shape, kind in specs)
    assert 13.7e9 < total < 13.8e9
    with pytest.raises(ValueError, match="mixtral model|gpt_oss model"):
        sc.config_from_args(p.parse_args(["--preset", "gpt-oss-20b", "--family", "mixtral"]))
    with pytest.raises(ValueError, match="multiple of 32"):
        sc.config_from_args(p.parse_args(["--family", "gpt_oss", "--hidden", "80"]))
    with pytest.raises(ValueError, match="--sliding-window"):
        sc.config_from_args(p.parse_args(["--sliding-window", "16"]))


def test_checkpoint_tensors_as_the_hub_stores_them(sc, tiny):
    _, config, t = tiny
    E, H, I, NH = 4, 64, 64, 4
    p = "model.layers.1"
    assert t[f"{p}.mlp.experts.gate_up_proj_blocks"].shape == (E, 2 * I, H // 32, 16)
    assert t[f"{p}.mlp.experts.gate_up_proj_scales"].shape == (E, 2 * I, H // 32)
    assert t[f"{p}.mlp.experts.down_proj_blocks"].shape == (E, H, I // 32, 16)
    assert t[f"{p}.mlp.experts.down_proj_scales"].shape == (E, H, I // 32)
    assert t[f"{p}.mlp.experts.gate_up_proj_bias"].shape == (E, 2 * I)
    assert t[f"{p}.self_attn.sinks"].shape == (NH,) and t[f"{p}.self_attn.o_proj.bias"].shape == (H,)
    assert t[f"{p}.mlp.router.weight"].shape == (E, H) and t[f"{p}.mlp.router.bias"].shape == (E,)
    assert all(a.dtype == np.uint8 for n, a in t.items() if n.endswith(("_blocks", "_scales")))
    assert all(a.dtype == ml_dtypes.bfloat16 for n, a in t.items() if not n.endswith(("_blocks", "_scales")))
    # every FP4 code occurs; the scales are s0 - 1 .. s0 + 1 around 2^(s0 - 127) * RMS(FP4) ~ std
    codes = np.concatenate([t[f"{p}.mlp.experts.down_proj_blocks"] & 15, t[f"{p}.mlp.experts.down_proj_blocks"] >> 4])
    assert set(np.unique(codes)) == set(range(16))
    s0 = 127 + round(np.log2(0.02 / np.sqrt(np.mean(weight_formats.FP4_E2M1.astype(np.float64) ** 2))))
    assert set(np.unique(t[f"{p}.mlp.experts.gate_up_proj_scales"])) == {s0 - 1, s0, s0 + 1}
    w = weight_formats.dequantize(t[f"{p}.mlp.experts.down_proj_blocks"].reshape(E, H, -1),
                                  t[f"{p}.mlp.experts.down_proj_scales"], weight_formats.MXFP4, dtype=np.float64)
    assert 0.01 < w.std() < 0.04


def test_transformers_reads_the_mxfp4_experts_as_the_blocks_say(tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder, _, t = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    experts = model.model.layers[1].mlp.experts
    p = "model.layers.1.mlp.experts"
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = t[f"{p}.{proj}_blocks"], t[f"{p}.{proj}_scales"]
        ours = weight_formats.dequantize(blocks.reshape(*blocks.shape[:2], -1), scales, weight_formats.MXFP4)
        theirs = getattr(experts, proj).detach().float().numpy()  # GptOssExperts: [E, in, out]
        np.testing.assert_array_equal(theirs, ours.transpose(0, 2, 1))
    np.testing.assert_array_equal(experts.gate_up_proj_bias.detach().float().numpy(),
                                  t[f"{p}.gate_up_proj_bias"].astype(np.float32))
    np.testing.assert_array_equal(model.model.layers[1].self_attn.sinks.detach().float().numpy(),
                                  t["model.layers.1.self_attn.sinks"].astype(np.float32))


def test_repack_puts_element_j_and_j_plus_16_in_byte_j(og):
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (3, 2, 32), dtype=np.uint8)  # u8[rows, G, 32]: element i's FP4 code
    hf = codes[..., 0::2] | (codes[..., 1::2] << 4)  # Hugging Face: byte j = element 2j | element 2j + 1 << 4
    scales = rng.integers(100, 140, (3, 2), dtype=np.uint8)
    raw = og.repack_mxfp4(hf, scales).reshape(3, 2, 17)
    np.testing.assert_array_equal(raw[..., 0], scales)  # block_mxfp4.e
    np.testing.assert_array_equal(raw[..., 1:] & 15, codes[..., :16])  # block_mxfp4.qs[j] low nibble: element j
    np.testing.assert_array_equal(raw[..., 1:] >> 4, codes[..., 16:])  # high nibble: element j + 16
    with pytest.raises(ValueError, match="blocks"):
        og.repack_mxfp4(hf[..., :8], scales)


def test_gguf_holds_the_experts_losslessly_and_the_rest_as_stored(tiny, tiny_gguf):
    import gguf

    _, config, t = tiny
    reader = gguf.GGUFReader(tiny_gguf)
    got = {x.name: x for x in reader.tensors}
    E, H, I = 4, 64, 64
    assert len(got) == 1 + 2 * 19 + 2  # a layer: 2 norms, q/k/v/o weight + bias, sinks, router + bias, 3 exps + bias
    for l in range(2):
        p, b = f"model.layers.{l}.mlp.experts", f"blk.{l}"
        for gname, proj, rows in (("ffn_gate_exps", "gate_up_proj", slice(0, None, 2)),
                                  ("ffn_up_exps", "gate_up_proj", slice(1, None, 2)),
                                  ("ffn_down_exps", "down_proj", slice(None))):
            x = got[f"{b}.{gname}.weight"]
            assert x.tensor_type == gguf.GGMLQuantizationType.MXFP4
            blocks, scales = t[f"{p}.{proj}_blocks"][:, rows], t[f"{p}.{proj}_scales"][:, rows]
            expected = weight_formats.dequantize(blocks.reshape(*blocks.shape[:2], -1), scales, weight_formats.MXFP4)
            values = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
            assert values.shape == expected.shape == ((E, I, H) if gname != "ffn_down_exps" else (E, H, I))
            np.testing.assert_array_equal(values, expected)
        bias = t[f"{p}.gate_up_proj_bias"].astype(np.float32)
        np.testing.assert_array_equal(np.asarray(got[f"{b}.ffn_gate_exps.bias"].data), bias[:, 0::2])
        np.testing.assert_array_equal(np.asarray(got[f"{b}.ffn_up_exps.bias"].data), bias[:, 1::2])
        np.testing.assert_array_equal(np.asarray(got[f"{b}.ffn_down_exps.bias"].data),
                                      t[f"{p}.down_proj_bias"].astype(np.float32))
        s = f"model.layers.{l}.self_attn"
        np.testing.assert_array_equal(np.asarray(got[f"{b}.attn_sinks.weight"].data),
                                      t[f"{s}.sinks"].astype(np.float32))
        q = got[f"{b}.attn_q.weight"]
        assert q.tensor_type == gguf.GGMLQuantizationType.BF16  # no q/k permute: gpt-oss's RoPE is NeoX-style
        np.testing.assert_array_equal(np.asarray(q.data).view(ml_dtypes.bfloat16).reshape(64, 64),
                                      t[f"{s}.q_proj.weight"])
        np.testing.assert_array_equal(np.asarray(got[f"{b}.attn_output.bias"].data),
                                      t[f"{s}.o_proj.bias"].astype(np.float32))
        router = got[f"{b}.ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(router.data).reshape(E, H),
                                      t[f"model.layers.{l}.mlp.router.weight"].astype(np.float32))
        np.testing.assert_array_equal(np.asarray(got[f"{b}.post_attention_norm.weight"].data), 1.0)
    np.testing.assert_array_equal(np.asarray(got["output.weight"].data).view(ml_dtypes.bfloat16).reshape(300, 64),
                                  t["lm_head.weight"])

    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "gpt-oss"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    want = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 64, "expert_feed_forward_length": 64,
            "expert_count": 4, "expert_used_count": 2, "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.key_length": 16, "attention.value_length": 16, "attention.sliding_window": 8,
            "context_length": 131072, "rope.freq_base": 150000.0, "rope.scaling.type": "yarn",
            "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096,
            "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}
    assert {k: fields[f"gpt-oss.{k}"] for k in want} == want
    assert len(fields["tokenizer.ggml.tokens"]) == 300


def test_gguf_writer_rejects_a_checkpoint_without_mxfp4(og, tiny, tmp_path):
    _, config, _ = tiny
    with pytest.raises(ValueError, match="quant_method must be 'mxfp4'"):
        og.gguf_tensor_plan({**config, "quantization_config": None})
    with pytest.raises(ValueError, match="GptOssForCausalLM"):
        og.gguf_tensor_plan({**config, "architectures": ["MixtralForCausalLM"]})


def test_llama_cpp_logits_match_transformers(tiny, tiny_gguf, tmp_path):
    """llama.cpp's logits of a 41-token prompt (past the sliding window of 8: both attention kinds) equal
    transformers' on the same checkpoint within llama.cpp's arithmetic (bf16 weights times activations rounded to
    bf16, MXFP4 experts times q8_0 activations): about 0.8 % of the largest logit, against 98 % with the gate
    and up experts swapped in the GGUF."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import gguf

    results = load_script("llama_cpp_build").cached_binary("llama-results")
    if results is None:
        pytest.skip("llama-results is not built (python3 scripts/llama_cpp_build.py)")
    out = tmp_path / "results.gguf"
    proc = subprocess.run([results, "-m", str(tiny_gguf), "--output", str(out), "-p", "hello world, this is a test",
                           "-t", "1", "-c", "64"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {x.name: x for x in gguf.GGUFReader(out).tensors}
    tokens = np.asarray(got["tokens"].data).astype(np.int64)
    assert len(tokens) == 41 and tokens[0] == 1  # <s>, then the prompt's bytes as the byte tokens 3 + byte
    logits = np.asarray(got["logits"].data).reshape(len(tokens), 300)  # results.cpp writes [token][vocab]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor(tokens)[None]).logits[0].numpy()
    assert np.abs(logits - ref).max() <= 0.03 * np.abs(ref).max()
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_llama_cpp_loads_and_decodes_the_gguf(tiny_gguf):
    bench = load_script("llama_cpp_build").cached_binary("llama-bench")
    if bench is None:
        pytest.skip("llama-bench is not built (python3 scripts/llama_cpp_build.py)")
    proc = subprocess.run([bench, "-m", str(tiny_gguf), "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-o", "json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = [r for r in json.loads(proc.stdout) if r["n_gen"] == 4]
    assert "gpt-oss" in record["model_type"] and "MXFP4" in record["model_type"]
    import gguf

    assert record["model_size"] == sum(int(x.n_bytes) for x in gguf.GGUFReader(tiny_gguf).tensors)
    assert record["avg_ts"] > 0
