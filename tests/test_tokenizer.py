"""Tests for ft_jax.tokenizer: byte level, tokenizer.json via the tokenizers library, missing tokenizer; bundle."""

import json
import os

import pytest

from ft_jax.config import ConfigError

from ft_jax.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SpecialIds,
    TokenizerNotFoundError,
    load_special_ids,
    load_tokenizer,
)

HERE = os.path.dirname(os.path.abspath(__file__))
MIXTRAL_FIXTURE = os.path.join(HERE, "fixtures", "hf_tiny", "mixtral")
BUNDLED = os.path.join(os.path.dirname(HERE), "ft_jax", "bundled", "tiny_shakespeare")


def _write_byte_model(path, **extra):
    cfg = {"architectures": ["MixtralForCausalLM"], "vocab_size": 256, "ft_jax_tokenizer": "bytes",
           "bos_token_id": None, "eos_token_id": None, **extra}
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_byte_roundtrip_multibyte(tmp_path):
    tok = load_tokenizer(_write_byte_model(tmp_path))
    assert isinstance(tok, ByteTokenizer)
    assert tok.bos_token_id is None and tok.eos_token_ids == () and tok.eos_token_id is None
    text = "ROMEO:\nhé → 世界 🎭"
    ids = tok.encode(text)
    # Hand-worked: é = C3 A9, → = E2 86 92, 🎭 = F0 9F 8E AD.
    assert ids[:7] == [82, 79, 77, 69, 79, 58, 10]
    assert ids[8:10] == [0xC3, 0xA9]
    assert ids[-4:] == [0xF0, 0x9F, 0x8E, 0xAD]
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_stream_buffers_split_characters(tmp_path):
    tok = load_tokenizer(_write_byte_model(tmp_path))
    text = "a€b🎭"  # € = E2 82 AC (3 bytes), 🎭 = 4 bytes
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    # One token at a time: text appears only when a character is complete.
    assert pieces == ["a", "", "", "€", "b", "", "", "", "🎭"]
    assert dec.flush() == ""
    # A character left incomplete at the end of the stream becomes U+FFFD on flush, never an exception.
    dec = tok.stream_decoder()
    assert dec.push([0x41, 0xE2, 0x82]) == "A"
    assert dec.flush() == "\ufffd"


def test_byte_rejects_out_of_range_ids(tmp_path):
    tok = load_tokenizer(_write_byte_model(tmp_path))
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        tok.decode([65, 256])


def test_byte_marker_with_wrong_vocab(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300, "ft_jax_tokenizer": "bytes"}))
    with pytest.raises(ConfigError, match="vocab_size 256, got 300"):
        load_tokenizer(str(tmp_path))


def test_a_marker_of_another_value_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256, "ft_jax_tokenizer": "nope"}))
    with pytest.raises(ConfigError, match="config.json: ft_jax_tokenizer='nope': the only tokenizer it names is "
                                          "'bytes'"):
        load_tokenizer(str(tmp_path))


def _build_wordlevel_tokenizer_json(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "to": 3, "be": 4, "or": 5, "not": 6, ",": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces, no space before punctuation
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))


def test_hf_tokenizer_json_roundtrip(tmp_path):
    _build_wordlevel_tokenizer_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8, "bos_token_id": 1, "eos_token_id": 9}))
    # generation_config.json overrides config.json (Hugging Face generate convention); eos may be a list.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2, 7) and tok.eos_token_id == 2
    assert tok.vocab_size == 8
    ids = tok.encode("to be, or not to be")
    assert ids == [1, 3, 4, 7, 5, 6, 3, 4]
    assert tok.encode("to be", add_special_tokens=False) == [3, 4]
    assert tok.decode(ids[1:]) == "to be, or not to be"
    dec = tok.stream_decoder()
    streamed = "".join(dec.push(i) for i in ids[1:]) + dec.flush()
    assert streamed == "to be, or not to be"


def test_hf_bytelevel_bpe_stream_split_utf8(tmp_path):
    """A byte-level BPE whose vocabulary has no merges: one multi-byte character spans several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path))
    text = "né 🎭!"
    ids = loaded.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert loaded.decode(ids) == text
    dec = loaded.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    assert "\ufffd" not in "".join(pieces)
    # The 4 byte tokens of 🎭 yield text only on the last one.
    assert pieces[4:8] == ["", "", "", "🎭"]  # bytes: n, é (2), space, then 🎭 (4)


def test_missing_tokenizer_error_suggests_prompt_ids():
    # The Hugging Face fixture has vocab 256 but no tokenizer.json and no byte marker.
    with pytest.raises(TokenizerNotFoundError, match="--prompt-ids") as e:
        load_tokenizer(MIXTRAL_FIXTURE)
    assert "tokenizer.json" in str(e.value)


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def test_bundled_model_is_byte_level():
    tok = load_tokenizer(BUNDLED)
    assert isinstance(tok, ByteTokenizer)
    assert tok.bos_token_id is None and tok.eos_token_ids == ()
    assert tok.decode(tok.encode("KING HENRY:\n")) == "KING HENRY:\n"


@pytest.mark.skipif(not os.path.isfile(os.path.join(BUNDLED, "model.safetensors")), reason="bundled model not trained")
def test_bundled_model_files():
    """The bundled checkpoint is a Hub-named MixtralForCausalLM of at most 16 MB whose tensors match config.json."""
    from safetensors import safe_open

    cfg = json.load(open(os.path.join(BUNDLED, "config.json")))
    path = os.path.join(BUNDLED, "model.safetensors")
    assert os.path.getsize(path) <= 16 * 2**20
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["ft_jax_tokenizer"] == "bytes"
    H, I, E, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], cfg["num_hidden_layers"]
    D = cfg["head_dim"]
    expected = {"model.embed_tokens.weight": (256, H), "lm_head.weight": (256, H), "model.norm.weight": (H,)}
    for n in range(L):
        p = f"model.layers.{n}."
        expected.update({
            p + "self_attn.q_proj.weight": (cfg["num_attention_heads"] * D, H),
            p + "self_attn.k_proj.weight": (cfg["num_key_value_heads"] * D, H),
            p + "self_attn.v_proj.weight": (cfg["num_key_value_heads"] * D, H),
            p + "self_attn.o_proj.weight": (H, cfg["num_attention_heads"] * D),
            p + "block_sparse_moe.gate.weight": (E, H),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        })
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            expected.update({q + "w1.weight": (I, H), q + "w3.weight": (I, H), q + "w2.weight": (H, I)})
    with safe_open(path, framework="numpy") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert got == expected


@pytest.mark.parametrize("config_eos,generation,expected", [
    ([2, 148], None, (2, 148)),
    (2, {"eos_token_id": [2, 148]}, (2, 148)),
    ([2, 148], {"eos_token_id": 7}, (7,)),
])
def test_tokenizer_and_config_give_the_same_eos_ids(tmp_path, config_eos, generation, expected):
    """Every listed EOS id, generation_config.json first: the tokenizer and MoEConfig agree (one rule)."""
    from ft_jax.config import load_config

    cfg = json.load(open(os.path.join(MIXTRAL_FIXTURE, "config.json")))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": config_eos,
                                                      "ft_jax_tokenizer": "bytes"}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    tok = load_tokenizer(str(tmp_path))
    assert tok.eos_token_ids == expected == load_config(tmp_path).eos_token_ids
    assert load_special_ids(str(tmp_path)) == SpecialIds(1, expected)


def test_bad_special_id_files_name_the_file(tmp_path):
    _write_byte_model(tmp_path)
    gen = tmp_path / "generation_config.json"
    gen.write_bytes(b'{"eos_token_id": 2\xff}')
    with pytest.raises(ValueError, match=rf"^{gen}: not UTF-8 text \(byte 0xff at offset 18\)"):
        load_tokenizer(str(tmp_path))
    gen.write_text('{"eos_token_id": [2, true]}')
    with pytest.raises(ValueError, match=rf"^{gen}: eos_token_id must be a non-negative integer"):
        load_tokenizer(str(tmp_path))
    gen.unlink()
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.json: is a FIFO"):
        load_tokenizer(str(tmp_path))


def test_model_folder_that_is_a_symlink_loop(tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ValueError, match="cannot open the model folder: symbolic link loop"):
        load_tokenizer(str(tmp_path / "a"))
