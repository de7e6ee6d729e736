"""scripts/synthetic_checkpoint.py and scripts/mixtral_to_gguf.py (the bench_peer model writers) on a tiny model.

The checkpoint is read back with the safetensors package (independently of ft_jax's reader) and loaded with
ft_jax.checkpoint.load_checkpoint; the GGUF q/k permute is checked against Hugging Face's rotate_half RoPE and
ggml's adjacent-pair RoPE written out in numpy; the GGUF file (only when the gguf package is installed) is read back
with gguf.GGUFReader and compared with the safetensors tensors.
"""

import json
import math
import subprocess

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from ft_jax import weight_formats
from ft_jax.checkpoint import load_checkpoint
from ft_jax.config import load_config

from script_modules import load_script
TINY = dict(hidden=64, intermediate=96, layers=2, experts=4, top_k=2, heads=4, kv_heads=2, head_dim=16, vocab=300,
            max_positions=128)



@pytest.fixture(scope="module")
def sc():
    return load_script("synthetic_checkpoint")


@pytest.fixture(scope="module")
def mg():
    return load_script("mixtral_to_gguf")


@pytest.fixture(scope="module")
def tiny(sc, tmp_path_factory):
    """(folder, config) of a tiny checkpoint split into shards of at most 40 kB."""
    folder = tmp_path_factory.mktemp("tiny_mixtral")
    config = sc.mixtral_config(**TINY)
    sc.write_checkpoint(folder, config, seed=3, max_shard_bytes=40_000)
    return folder, config


def _read_all(folder):
    """{name: bf16 array} of every tensor in the folder's shards, via the safetensors package."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), framework="np") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    assert set(out) == set(index["weight_map"])
    return out


def test_checkpoint_has_hub_names_shapes_and_loads_with_ft_jax(sc, tiny):
    folder, config = tiny
    tensors = _read_all(folder)
    H, I, V, E, D = 64, 96, 300, 4, 16
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    assert tensors["model.embed_tokens.weight"].shape == (V, H)
    assert tensors["lm_head.weight"].shape == (V, H)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4 * D, H)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * D, H)
    assert tensors["model.layers.1.self_attn.o_proj.weight"].shape == (H, 4 * D)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].shape == (E, H)
    assert tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (I, H)
    assert tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (H, I)
    assert len(tensors) == 1 + 2 * (2 + 4 + 1 + 3 * E) + 2
    assert all(t.dtype == ml_dtypes.bfloat16 for t in tensors.values())
    np.testing.assert_array_equal(tensors["model.layers.0.post_attention_layernorm.weight"].astype(np.float32), 1.0)
    w = np.concatenate([t.astype(np.float32).ravel() for n, t in tensors.items() if "norm" not in n])
    assert abs(w.std() - 0.02) < 0.001 and abs(w.mean()) < 0.001

    cfg = load_config(folder)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_layers, cfg.num_experts, cfg.top_k) == (H, I, 2, E, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.dtype) == (4, 2, D, V, "bfloat16")
    ckpt = load_checkpoint(folder, dtype=jnp.bfloat16)
    gate_up, down = ckpt.banks.gate_up.numpy(), ckpt.banks.down.numpy()
    assert gate_up.shape == (2 * E, 2 * I, H) and down.shape == (2 * E, H, I)
    p = "model.layers.1.block_sparse_moe.experts.2"  # flat id 1 * E + 2
    np.testing.assert_array_equal(gate_up[E + 2],
                                  np.concatenate([tensors[f"{p}.w1.weight"], tensors[f"{p}.w3.weight"]]))
    np.testing.assert_array_equal(down[E + 2], tensors[f"{p}.w2.weight"])
    ckpt.banks.gate_up.release()
    ckpt.banks.down.release()


def test_weight_bytes_per_token_counts_the_tensors_one_token_reads(sc, tiny):
    _, config = tiny
    E, k, H = config["num_local_experts"], config["num_experts_per_tok"], config["hidden_size"]
    specs = sc.tensor_specs(config)
    nbytes = {name: 2 * math.prod(shape) for name, shape, _ in specs}
    experts = sum(n for name, n in nbytes.items() if ".experts." in name)
    dense = sum(n for name, n in nbytes.items() if ".experts." not in name and name != "model.embed_tokens.weight")
    expected = dense + experts * k // E + 2 * H  # every dense weight, top_k of E experts, one embedding row
    assert sc.weight_bytes_per_token(config)["total"] == expected


def test_llama_permute_rows_by_hand(mg):
    rows = mg.llama_permute(np.arange(16).reshape(16, 1), 2)[:, 0]  # 2 heads of D = 8
    np.testing.assert_array_equal(rows, [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15])


def _rope_hf(x, pos, theta):
    """transformers' Llama/Mixtral RoPE: x [T, n, D]; pairs (i, i + D/2) rotated by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, D, 2) / D)  # [T, D/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + rot * sin


def _rope_ggml(x, pos, theta):
    """ggml_rope mode 0 (LLaMA in llama.cpp): x [T, n, D]; adjacent pairs (2i, 2i+1) rotated by pos * theta^(-2i/D)."""
    D = x.shape[-1]
    ang = (pos[:, None] * theta ** (-np.arange(0, D, 2) / D))[:, None]  # [T, 1, D/2]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def test_permuted_qk_give_hf_attention_scores_under_ggml_rope(mg):
    rng = np.random.default_rng(0)
    NH, KVH, D, H, T, theta = 4, 2, 8, 12, 5, 1e4
    wq, wk = rng.standard_normal((NH * D, H)), rng.standard_normal((KVH * D, H))
    x, pos = rng.standard_normal((T, H)), np.arange(T, dtype=np.float64)

    def scores(wq, wk, rope):
        q = rope((x @ wq.T).reshape(T, NH, D), pos, theta)
        k = rope((x @ wk.T).reshape(T, KVH, D), pos, theta)
        k = np.repeat(k, NH // KVH, axis=1)  # GQA: query head h uses KV head h // (NH / KVH)
        return np.einsum("tnd,snd->nts", q, k)

    hf = scores(wq, wk, _rope_hf)
    gg = scores(mg.llama_permute(wq, NH, NH), mg.llama_permute(wk, NH, KVH), _rope_ggml)
    np.testing.assert_allclose(gg, hf, rtol=1e-10, atol=1e-10)
    wrong = scores(mg.llama_permute(wq, NH, NH), mg.llama_permute(wk, NH, NH), _rope_ggml)  # k permuted per NH
    assert not np.allclose(wrong, hf)


def test_gguf_holds_the_checkpoint_tensors_as_llama_cpp_expects(mg, tiny, tmp_path):
    gguf = pytest.importorskip("gguf")
    folder, config = tiny
    out = tmp_path / "tiny.gguf"
    mg.write_gguf(folder, out)
    reader = gguf.GGUFReader(out)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert (fields["llama.expert_count"], fields["llama.expert_used_count"], fields["llama.block_count"]) == (4, 2, 2)
    assert (fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]) == (4, 2)
    assert fields["llama.feed_forward_length"] == 96 and fields["llama.rope.freq_base"] == 1e6
    assert len(fields["tokenizer.ggml.tokens"]) == 300 and fields["tokenizer.ggml.model"] == "llama"

    st = _read_all(folder)
    got = {t.name: t for t in reader.tensors}
    assert len(got) == 1 + 2 * 10 + 2

    def bf16(name, shape):
        t = got[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.BF16, name
        return np.asarray(t.data).view(ml_dtypes.bfloat16).reshape(shape)

    def f32(name):
        t = got[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        return np.asarray(t.data)

    p = "model.layers.1"
    np.testing.assert_array_equal(bf16("blk.1.attn_q.weight", (64, 64)),
                                  mg.llama_permute(st[f"{p}.self_attn.q_proj.weight"], 4, 4))
    np.testing.assert_array_equal(bf16("blk.1.attn_k.weight", (32, 64)),
                                  mg.llama_permute(st[f"{p}.self_attn.k_proj.weight"], 4, 2))
    np.testing.assert_array_equal(bf16("blk.1.attn_v.weight", (32, 64)), st[f"{p}.self_attn.v_proj.weight"])
    np.testing.assert_array_equal(bf16("blk.1.attn_output.weight", (64, 64)), st[f"{p}.self_attn.o_proj.weight"])
    for gname, w, shape in (("ffn_gate_exps", "w1", (4, 96, 64)), ("ffn_up_exps", "w3", (4, 96, 64)),
                            ("ffn_down_exps", "w2", (4, 64, 96))):
        merged = bf16(f"blk.1.{gname}.weight", shape)
        for e in range(4):
            np.testing.assert_array_equal(merged[e], st[f"{p}.block_sparse_moe.experts.{e}.{w}.weight"])
    np.testing.assert_array_equal(f32("blk.1.ffn_gate_inp.weight").reshape(4, 64),
                                  st[f"{p}.block_sparse_moe.gate.weight"].astype(np.float32))
    np.testing.assert_array_equal(f32("blk.1.attn_norm.weight"), st[f"{p}.input_layernorm.weight"].astype(np.float32))
    np.testing.assert_array_equal(f32("output_norm.weight"), st["model.norm.weight"].astype(np.float32))
    np.testing.assert_array_equal(bf16("output.weight", (300, 64)), st["lm_head.weight"])
    np.testing.assert_array_equal(bf16("token_embd.weight", (300, 64)), st["model.embed_tokens.weight"])


def _bench_peer():
    return load_script("bench_peer")


@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_0"])
def test_weight_bytes_per_token_of_a_quantized_load(sc, tiny, fmt_name):
    gguf = pytest.importorskip("gguf")
    _, config = tiny
    E, k, H = config["num_local_experts"], config["num_experts_per_tok"], config["hidden_size"]
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt_name.upper()]]  # (32, 34) / (32, 18)
    total = 2 * H  # one bf16 embedding row
    for name, shape, _ in sc.tensor_specs(config):
        n = math.prod(shape)
        quantized = len(shape) == 2 and name not in ("model.embed_tokens.weight",) and ".gate." not in name
        nbytes = n // block * block_bytes if quantized else 2 * n  # router, norms as stored (bf16)
        if name != "model.embed_tokens.weight":
            total += nbytes * k // E if ".experts." in name else nbytes
    assert sc.weight_bytes_per_token(config, weight_formats.by_name(fmt_name))["total"] == total


def test_weight_bytes_per_token_of_gpt_oss_counts_mxfp4_experts_as_stored(sc):
    config = sc.gpt_oss_config(**{k: v for k, v in sc.GPT_OSS_TINY.items()})
    E, k, H = config["num_local_experts"], config["num_experts_per_tok"], config["hidden_size"]
    total = 2 * H  # one bf16 embedding row
    for name, shape, kind in sc.gpt_oss_tensor_specs(config):
        nbytes = math.prod(shape) * (1 if kind.startswith("mxfp4") else 2)
        if name != "model.embed_tokens.weight":
            total += nbytes * k // E if ".experts." in name else nbytes
    assert sc.weight_bytes_per_token(config)["total"] == total
    with pytest.raises(ValueError, match="as stored"):
        sc.weight_bytes_per_token(config, weight_formats.Q8_0)


def test_gguf_bytes_per_token_of_the_bf16_gguf(sc, mg, tiny, tmp_path):
    pytest.importorskip("gguf")
    folder, config = tiny
    out = tmp_path / "tiny.gguf"
    mg.write_gguf(folder, out)
    L, E, H = config["num_hidden_layers"], config["num_local_experts"], config["hidden_size"]
    got = _bench_peer().gguf_weight_bytes_per_token(out, config["num_experts_per_tok"], E)
    ours = sc.weight_bytes_per_token(config)
    # the GGUF has the router and the norms in f32 (twice their bf16 bytes), the rest bf16 as in the checkpoint
    assert got["total"] == ours["total"] + ours["router"] + ours["norms"]
    assert got["experts"] == ours["experts"] and got["embedding_row"] == 2 * H
    assert got["by_type"]["F32"] == 4 * (L * E * H + (2 * L + 1) * H)


def test_llama_quantize_pure_q8_0_gives_ft_jax_quantizer_bytes(sc, mg, tiny, tmp_path):
    gguf = pytest.importorskip("gguf")
    bp = _bench_peer()
    quantize = bp.llama_cpp_build.cached_binary("llama-quantize")
    if quantize is None:
        pytest.skip("llama-quantize is not built (python3 scripts/llama_cpp_build.py)")
    folder, config = tiny
    bf16 = tmp_path / "model-bf16.gguf"
    mg.write_gguf(folder, bf16)
    path, record = bp.ensure_quantized_gguf(quantize, bf16, "q8_0", 1)
    assert path == tmp_path / "model-q8_0.gguf" and "--pure" in record["command"]
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    types = {t.tensor_type.name for name, t in tensors.items() if len(t.shape) >= 2 and "ffn_gate_inp" not in name}
    assert types == {"Q8_0"}  # --pure: every 2-D weight, token_embd and output included
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type.name == "F32"
    st = _read_all(folder)
    w = st["model.layers.1.self_attn.v_proj.weight"]  # not permuted by the converter
    data, scales = weight_formats.quantize(w, weight_formats.Q8_0)
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_v.weight"].data).reshape(-1),
                                  weight_formats.gguf_blocks(data, scales, weight_formats.Q8_0).reshape(-1))
    got = bp.gguf_weight_bytes_per_token(path, config["num_experts_per_tok"], config["num_local_experts"])
    ours = sc.weight_bytes_per_token(config, weight_formats.Q8_0)
    H = config["hidden_size"]
    # llama.cpp: router and norms f32 (ft_jax bf16), its embedding row q8_0 (ft_jax bf16); the rest the same bytes
    assert got["total"] == ours["total"] + ours["router"] + ours["norms"] + weight_formats.Q8_0.nbytes(1, H) - 2 * H


@pytest.mark.parametrize("quant", ["bf16", "q8_0"])
def test_llama_cpp_logits_of_the_gguf_match_transformers(mg, tiny, tmp_path, quant):
    """llama.cpp's logits of a 41-token prompt on the bf16 GGUF (and llama-quantize --pure Q8_0 of it) equal
    transformers' on the checkpoint within llama.cpp's arithmetic (activations rounded to bf16 / q8_0)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    bp = _bench_peer()
    results = bp.llama_cpp_build.cached_binary("llama-results")
    quantize = bp.llama_cpp_build.cached_binary("llama-quantize")
    if results is None or quantize is None:
        pytest.skip("llama-results / llama-quantize are not built (python3 scripts/llama_cpp_build.py)")
    folder, config = tiny
    path = tmp_path / "model-bf16.gguf"
    mg.write_gguf(folder, path)
    if quant != "bf16":
        path, _ = bp.ensure_quantized_gguf(quantize, path, quant, 1)
    out = tmp_path / "results.gguf"
    proc = subprocess.run([results, "-m", str(path), "--output", str(out), "-p", "hello world, this is a test",
                           "-t", "1", "-c", "64"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = {x.name: x for x in gguf.GGUFReader(out).tensors}
    tokens = np.asarray(got["tokens"].data).astype(np.int64)
    V = config["vocab_size"]
    logits = np.asarray(got["logits"].data).reshape(len(tokens), V)  # results.cpp writes [token][vocab]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor(tokens)[None]).logits[0].numpy()
    err = np.abs(logits - ref).max() / np.abs(ref).max()
    assert err <= (0.01 if quant == "bf16" else 0.04), err  # measured 0.24 % and 1.4 % of the largest logit
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
