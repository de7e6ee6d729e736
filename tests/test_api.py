"""The one-call API (ft_jax.load / Model.generate): defaults shared with the CLI, stop strings, chat templates,
documentation examples run as written, recovery after a failed step, concurrent calls."""

import doctest
import importlib
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ft_jax
from ft_jax import api, units
from ft_jax.defaults import default_policy
from ft_jax.chat import ChatTemplateError, load_chat_template
from ft_jax.engine.engine import Engine
from ft_jax.engine.sampling import Sampling
from ft_jax.tokenizer import HFTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(os.path.dirname(__file__), "fixtures", "chat")


@pytest.fixture(scope="module")
def bundled():
    return ft_jax.load(policy="fixed-cap:1")


def test_public_names_and_defaults_match_the_cli():
    for name in ft_jax.__all__:
        assert getattr(ft_jax, name) is not None, name
    assert set(ft_jax.__all__) <= set(dir(ft_jax))  # the names imported on first use are listed too
    from ft_jax import cli

    args = cli.build_parser().parse_args(["generate"])
    assert args.temperature == api.DEFAULT_TEMPERATURE == 0.8
    assert args.policy is None and args.dtype is None  # the API's defaults: the backend's policy, the checkpoint's dtype
    assert default_policy("cpu") == "host-all" and default_policy("gpu") == api.DEFAULT_POLICY == "auto"
    assert units.model_dtype("auto", "float32") == "float32" and units.model_dtype("auto", "bfloat16") == "bfloat16"
    assert [units.parse_dtype(t) for t in ("bf16", "BFloat16", "f32", "float32")] == ["bfloat16", "bfloat16",
                                                                                   "float32", "float32"]
    assert api.num_slots_for(None, 32, 10) == 16 and api.num_slots_for(0.25, 32, 10) == 8
    assert api.num_slots_for(5, 32, 10) == 5 and api.num_slots_for("45", 32, 10) == 4
    assert api.num_slots_for(np.int64(5), 32, 10) == 5 and type(api.num_slots_for(np.int64(40), 32, 10)) is int
    assert api.num_slots_for(np.float32(0.25), 32, 10) == 8
    for wrong in (True, [4], {"slots": 4}):  # a type error, not a value error
        with pytest.raises(TypeError, match=rf"^cache must be slots \(int\), a fraction \(float\) or bytes "
                                            rf"\('8GiB'\), got {re.escape(repr(wrong))}$"):
            api.num_slots_for(wrong, 32, 10)
    with pytest.raises(ValueError, match="smaller than one expert slot"):
        api.num_slots_for("9", 32, 10)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        api.num_slots_for(1.5, 32, 10)


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "ft_jax", *args], capture_output=True, text=True, timeout=timeout)


def test_version_and_flag_errors_name_the_flag():
    proc = _run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"ft-jax {ft_jax.__version__}"
    for flag, value, words in (("--top-p", "0", "expected a number in (0, 1]"), ("--top-k", "-3", "expected an integer >= 0"),
                               ("--dtype", "fp8", "expected auto, bf16, bfloat16, f32 or float32"),
                               ("--policy", "bogus", "argument --policy: unknown policy 'bogus'")):
        proc = _run("generate", flag, value)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0] and flag in lines[0], proc.stderr
    help_text = _run("generate", "--help").stdout
    assert "examples:" in help_text and "Supported architectures: MixtralForCausalLM" in help_text


def test_a_model_path_under_the_home_folder_and_a_path_of_the_wrong_type(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # os.path.expanduser reads $HOME
    os.symlink(ft_jax.bundled_model_path(), tmp_path / "tiny")
    model = ft_jax.load("~/tiny", policy="host-all")
    assert model.path == str(tmp_path / "tiny")
    with pytest.raises(TypeError, match="path: expected a model folder \\(str or os.PathLike\\), got int"):
        ft_jax.load(123)


def test_stop_strings_cut_the_text_and_end_the_row(bundled):
    free = bundled.generate("KING:", max_new_tokens=60, temperature=0)
    text = free.text
    stop = text[20:23]  # three characters of the greedy text, first seen at index 20 or earlier
    first = text.find(stop)
    streamed = []
    out = bundled.generate("KING:", max_new_tokens=60, temperature=0, stop=[stop, "never-there"],
                           on_text=lambda row, t: streamed.append(t))
    assert out.text == text[:first] and out.finish_reasons == ["stop"]
    assert "".join(streamed) == out.text  # nothing of the stop string was ever streamed
    # the tokens end with the one that completed the stop string (byte tokens: one character each here)
    assert out.token_ids[0] == free.token_ids[0][:first + len(stop)]
    assert free.finish_reasons == ["length"]


def test_the_end_of_sequence_token_ends_the_row_and_adds_no_text(bundled, tmp_path):
    """The id that ends a row (generation_config.json's eos_token_id) is the last of its token ids, but its text
    (here a byte: one character) is not part of the answer, streamed or not."""
    free = bundled.generate("KING:", max_new_tokens=40, temperature=0)
    k = 12
    eos = free.token_ids[0][k]
    first = free.token_ids[0].index(eos)  # the row ends at the first occurrence
    model_dir = tmp_path / "model"
    shutil.copytree(ft_jax.bundled_model_path(), model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    streamed = []
    out = ft_jax.load(str(model_dir), policy="fixed-cap:1").generate(
        "KING:", max_new_tokens=40, temperature=0, on_text=lambda row, t: streamed.append(t))
    assert out.token_ids[0] == free.token_ids[0][:first + 1] and out.finish_reasons == ["eos"]
    assert out.text == free.text[:first] == "".join(streamed)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=123), "prompts must be a text, a list of token ids (or a 1-D / 2-D integer numpy array) or a list "
                        "of texts / id lists, got int"),
    (dict(prompts=np.array([1.5, 2.0])), "prompts must be a text, a list of token ids (or a 1-D / 2-D integer numpy "
                                         "array) or a list of texts / id lists, got ndarray of float64, shape (2,)"),
    (dict(prompts=[1.5, 2]), "each prompt must be a text or a list (or 1-D integer numpy array) of integer token ids, "
                             "got 1.5"),
    (dict(prompts=[True, 2]), "each prompt must be a text or a list (or 1-D integer numpy array) of integer token ids, "
                              "got [True, 2]"),
    (dict(prompts=[1, 2], max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5"),
    (dict(prompts=[1, 2], max_new_tokens="10"), "max_new_tokens must be an integer, got '10'"),
    (dict(prompts=[1, 2], temperature="hot"), "temperature must be a number, got 'hot'"),
    (dict(prompts=[1, 2], top_p=True), "top_p must be a number, got True"),
    (dict(prompts=[1, 2], top_k=1.5), "top_k must be an integer, got 1.5"),
    (dict(prompts=[1, 2], top_k=True), "top_k must be an integer, got True"),
    (dict(prompts=[1, 2], seed="a"), "seed must be an integer, got 'a'"),
    (dict(prompts=[1, 2], seed=False), "seed must be an integer, got False"),
    (dict(prompts=[1, 2], stop=5), "stop must be a string or a list of strings, got int 5"),
    (dict(prompts=[1, 2], stop={"x"}), "stop must be a string or a list of strings, got set {'x'}"),
    (dict(prompts=[1, 2], stop=(s for s in "x")), "stop must be a string or a list of strings, got generator "),
    (dict(prompts=[1, 2], chat="yes"), "chat must be True or False, got 'yes'"),
    (dict(prompts=[1, 2], stop=["x", 5]), "stop strings must be strings, got ('x', 5)"),
    (dict(prompts=[1, 2], on_text=5), "on_text must be callable with (row, text), got 5"),
])
def test_wrong_argument_types_name_the_argument(bundled, kwargs, message):
    with pytest.raises(TypeError) as e:
        bundled.generate(kwargs.pop("prompts"), **kwargs)
    assert str(e.value).startswith(message) if message.endswith("generator ") else str(e.value) == message


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
    (dict(temperature=10**400), "temperature must be a finite number >= 0, got inf"),
    (dict(temperature=2**1023), "temperature 8.98847e+307 is outside [1e-10, 1e+10] (0 = greedy): logits / "
                                "temperature would overflow or underflow float32"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_k=-1), "top_k must be an integer in [0, 2^31), got -1"),
    (dict(seed=-1), "seed must be an integer in [0, 2^32), got -1"),
    (dict(seed=2**32), "seed must be an integer in [0, 2^32), got 4294967296"),
    (dict(stop=["x", ""]), "stop strings must be non-empty strings, got ('x', '')"),
    (dict(stop=["x", "y\udc80"]), "stop string 1 is not valid Unicode text: '\\udc80' at character 1 is a lone "
                                  "surrogate, which UTF-8 cannot encode"),
])
def test_argument_values_out_of_range_are_value_errors(bundled, kwargs, message):
    """Wrong types are TypeError (above), wrong values of the right type ValueError, for every argument."""
    with pytest.raises(ValueError) as e:
        bundled.generate([1, 2], **kwargs)
    assert type(e.value) is ValueError and str(e.value) == message


def test_numpy_integers_are_integers(bundled):
    out = bundled.generate([1, 2], max_new_tokens=np.int32(2), top_k=np.int64(2), seed=np.uint32(7))
    assert out.token_ids == bundled.generate([1, 2], max_new_tokens=2, top_k=2, seed=7).token_ids


def test_numpy_floats_sample_as_python_floats(bundled):
    """A float16 temperature / top_p samples as the same Python float (no float16 overflow on the way)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = bundled.generate([1, 2], max_new_tokens=3, temperature=np.float16(0.5), top_p=np.float32(0.875), seed=3)
    assert out.token_ids == bundled.generate([1, 2], max_new_tokens=3, temperature=0.5, top_p=0.875, seed=3).token_ids


def test_text_with_a_lone_surrogate_is_refused_by_name(bundled):
    """Text UTF-8 cannot encode (a lone surrogate, as surrogateescape leaves in undecodable bytes) is a ValueError
    naming the prompt and the character, not the tokenizer's UnicodeEncodeError."""
    with pytest.raises(ValueError) as e:
        bundled.generate("A\udc00", max_new_tokens=1)
    assert str(e.value) == ("the prompt text is not valid Unicode text: '\\udc00' at character 1 is a lone "
                            "surrogate, which UTF-8 cannot encode")
    with pytest.raises(ValueError, match="^prompt 1 is not valid Unicode text"):
        bundled.generate(["ok", "\ud800x"], max_new_tokens=1)


def test_a_byte_budget_above_every_expert_is_said_in_model_note():
    """cache="8GiB" on the bundled model (32 experts) is cut to 32 slots, said in Model.note in the CLI's words
    (api.budget_note), beside the profile's note; a budget that fits, and host-all (no slot used), say nothing."""
    fits = 8 * 2**30 // 393216
    m = ft_jax.load(policy="fetch-all", cache="8GiB")
    assert m.engine.num_slots == 32
    assert m.note == f"cache='8GiB' holds {fits} experts, more than the 32 experts; using 32"
    assert m.note == api.budget_note("cache='8GiB'", fits, 32)
    stored = ft_jax.load(policy="qstar", cache="8GiB", measure=False).note.splitlines()
    assert len(stored) == 2 and stored[1] == m.note
    assert ft_jax.load(policy="fetch-all", cache="1MiB").note is None
    assert ft_jax.load(policy="host-all", cache="8GiB").note is None
    # A slot count above every expert is cut the same way, and said too (it was silent: a fresh-user trial).
    many = ft_jax.load(policy="fetch-all", cache=10**9)
    assert many.engine.num_slots == 32 and many.note == "cache=1000000000 is more than the 32 experts; using 32"
    assert ft_jax.load(policy="fetch-all", cache=32).note is None


def test_an_explicit_profile_path_needs_its_folder(tmp_path):
    """profile= in a folder that does not exist is refused before loading, as --profile is (it was created); the
    default store's folder is still created."""
    missing = tmp_path / "no" / "p.json"
    with pytest.raises(ValueError) as e:
        ft_jax.load(policy="qstar", profile=str(missing))
    assert str(e.value) == f"profile= / --profile: {missing}: folder {tmp_path / 'no'} does not exist or is not writable"
    assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match=rf"^profile= / --profile: {re.escape(str(tmp_path))}: is a directory"):
        ft_jax.load(policy="qstar", profile=tmp_path)
    assert ft_jax.load(policy="qstar:0.5", profile=tmp_path / "p.json").policy.frac == 0.5


def test_batch_of_text_prompts_each_equal_alone(bundled):
    both = bundled.generate(["ROMEO:", "JULIET:"], max_new_tokens=12, temperature=0)
    assert both.texts[1] == bundled.generate("JULIET:", max_new_tokens=12, temperature=0).text
    ids = bundled.tokenizer.encode("ROMEO:")
    one = bundled.generate(ids, max_new_tokens=12, temperature=0)
    assert one.token_ids == both.token_ids[:1]
    # one prompt: .text is its text; a list of prompts: .texts, and .text says so
    assert one.text == both.texts[0] and isinstance(one.text, str)
    with pytest.raises(ValueError, match=r"a list of 2 prompts: use \.texts"):
        both.text
    assert bundled.generate(["ROMEO:"], max_new_tokens=2).texts[0] == bundled.generate("ROMEO:", max_new_tokens=2).text


def test_numpy_ids_are_prompts_like_lists(bundled):
    """A 1-D integer array is one prompt, a 2-D one a prompt per row, a list of arrays a batch: the tokens of the same
    ids as lists."""
    ids = bundled.tokenizer.encode("ROMEO:")
    want = bundled.generate(ids, max_new_tokens=6, temperature=0).token_ids
    assert bundled.generate(np.array(ids, np.int32), max_new_tokens=6, temperature=0).token_ids == want
    rows = np.array([ids, ids[::-1]], np.int64)
    both = bundled.generate(rows, max_new_tokens=6, temperature=0).token_ids
    assert both == bundled.generate([ids, ids[::-1]], max_new_tokens=6, temperature=0).token_ids and both[0] == want[0]
    assert bundled.generate(list(rows), max_new_tokens=6, temperature=0).token_ids == both


def test_a_prompt_too_long_for_the_context_counts_its_tokens(bundled):
    context = bundled.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"^prompt of 1 token \+ {context} new tokens exceeds the model's context"):
        bundled.generate([5], max_new_tokens=context)
    with pytest.raises(ValueError, match=rf"^prompt of {context} tokens \+ 1 new token exceeds the model's context"):
        bundled.generate([5] * context, max_new_tokens=1)
    # in a batch the message says which prompt is too long
    with pytest.raises(ValueError, match=rf"^prompt 1 \(of 3\) of {context} tokens \+ 1 new token exceeds"):
        bundled.generate([[5], [5] * context, [6]], max_new_tokens=1)


def test_a_load_argument_of_the_wrong_type_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"^cache= / --cache-slots, --cache-fraction, --device-memory: cache must be "
                                        r"slots \(int\), a fraction \(float\) or bytes \('8GiB'\), got True$"):
        ft_jax.load(cache=True, measure=False)


@pytest.mark.parametrize("kwargs, start", [
    (dict(cache=-1), "cache= / --cache-slots, --cache-fraction, --device-memory: the cache must hold at least one "
                     "expert slot"),
    (dict(cache="lots"), "cache= / --cache-slots, --cache-fraction, --device-memory: not a byte count: 'lots'"),
    (dict(cache=1.5), "cache= / --cache-slots, --cache-fraction, --device-memory: a cache fraction must be in (0, 1]"),
    (dict(cache="100", policy="fetch-all"), "cache= / --cache-slots, --cache-fraction, --device-memory: a device "
                                            "budget of 100 (100 bytes) is smaller than one expert slot (393216 bytes"),
    (dict(dtype="f16"), "dtype= / --dtype: dtype must be one of"),
    (dict(policy="bogus"), "policy= / --policy: unknown policy 'bogus'"),
    (dict(quantize="q5_0"), "quantize= / --quantize: quantize must be one of q8_0, q4_0"),
    (dict(bank_memory="anon"), "bank_memory= / --bank-memory: expected one of map, copy, got 'anon'"),
])
def test_a_bad_load_argument_names_the_argument_and_the_flag(kwargs, start):
    with pytest.raises(ValueError) as e:
        ft_jax.load(**kwargs, measure=False)
    assert str(e.value).startswith(start) and str(e.value).count(" / ") == 1  # one prefix, not repeated
    name = start.partition("=")[0]
    assert api.argument_message(e.value, name) == str(e.value)[len(start.partition(": ")[0]) + 2:]  # for the CLI
    assert api.argument_message(e.value, "profile" if name != "profile" else "cache") is None


def test_measure_must_be_a_bool():
    """measure="no" was taken as true (a fresh-user trial); numpy's bool is a bool."""
    with pytest.raises(TypeError, match=r"^measure: expected True or False, got 'no'"):
        ft_jax.load(measure="no")
    assert ft_jax.load(measure=np.False_, policy="host-all").engine is not None


def test_bank_memory_must_be_a_str_of_any_case():
    with pytest.raises(TypeError, match=r"^bank_memory= / --bank-memory: expected one of map, copy \(a str\), got None"):
        ft_jax.load(bank_memory=None, measure=False)
    assert ft_jax.load(bank_memory="COPY", measure=False).generate("ab", max_new_tokens=2, temperature=0).token_ids


def test_no_prompt_is_a_value_error_naming_the_prompts(bundled):
    for empty in ([], ()):
        with pytest.raises(ValueError, match="^prompts is empty: give a text, a list of token ids"):
            bundled.generate(empty)
    with pytest.raises(ValueError, match="^the prompt text is empty"):
        bundled.generate("")


def test_a_text_that_encodes_to_no_tokens_is_named_not_called_empty(tmp_path):
    """A tokenizer without an unknown token or byte fallback drops what it cannot encode: a non-empty text of such
    characters is refused as that, not as "prompt 0 is empty" (a new user's report)."""
    from tokenizers import Tokenizer as HFTok, models
    HFTok(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert api.encode_prompt(str(tmp_path), tokenizer, "ab") == [0, 1]
    with pytest.raises(ValueError, match=r"^the prompt text \(5 characters\) encodes to no tokens: the model's "
                                         r"tokenizer has no token for it; give other text or token ids$"):
        api.encode_prompt(str(tmp_path), tokenizer, "hello")


def test_a_top_p_below_float32_keeps_the_most_likely_token(bundled):
    """top_p = 1e-300 passes the (0, 1] check but is 0 in the float32 sampling step: the most likely token is kept, so
    the text is the greedy one (it was 8 NUL characters: every token masked, id 0 drawn; a new user's report)."""
    greedy = bundled.generate("ROMEO:", max_new_tokens=8, temperature=0).token_ids
    for top_p in (1e-300, 1e-40):
        assert bundled.generate("ROMEO:", max_new_tokens=8, temperature=1.0, top_p=top_p, seed=3).token_ids == greedy


def test_a_jax_array_of_token_ids_is_a_prompt(bundled):
    ids = [3, 17, 42, 5]
    want = bundled.generate(ids, max_new_tokens=4, temperature=0).token_ids
    assert bundled.generate(jnp.asarray(ids, jnp.int32), max_new_tokens=4, temperature=0).token_ids == want
    batch = bundled.generate(jnp.asarray([ids, ids], jnp.int32), max_new_tokens=4, temperature=0)
    assert batch.token_ids == want * 2
    with pytest.raises(ValueError, match="^text is the text of a single prompt; this generation had a list of 2 "
                                         "prompts: use .texts"):
        batch.text


def test_chat_templates_from_real_checkpoints():
    mixtral = load_chat_template(os.path.join(CHAT, "mixtral_instruct"))
    assert mixtral.render([{"role": "user", "content": "Hello"}]) == "<s>[INST] Hello [/INST]"
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey!"},
             {"role": "user", "content": "Bye"}]
    assert mixtral.render(turns) == "<s>[INST] Hi [/INST]Hey!</s>[INST] Bye [/INST]"
    with pytest.raises(ChatTemplateError, match=r"mixtral_instruct/tokenizer_config.json: chat template: "
                                                r"Conversation roles must alternate"):
        mixtral.render(turns[:1] * 2)
    qwen = load_chat_template(os.path.join(CHAT, "qwen2_instruct"))
    assert qwen.render([{"role": "user", "content": "2+2?"}]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_chat_template(api.bundled_model_path())


def test_cli_chat_renders_the_template(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(api.bundled_model_path(), model)
    shutil.copy(os.path.join(CHAT, "qwen2_instruct", "tokenizer_config.json"), model)
    proc = _run("generate", "--model", str(model), "--chat", "--prompt", "KING:", "--max-new-tokens", "3",
                "--policy", "host-all", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    expected = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nKING:<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert doc["prompt_ids"] == [list(expected.encode())] and doc["settings"]["chat"] is True


def _doc_modules():
    for info in pkgutil.walk_packages(ft_jax.__path__, "ft_jax."):
        if not info.name.endswith(("__main__", "._ffi")):
            yield importlib.import_module(info.name)


def test_readme_and_docstring_examples_run_as_written():
    """Every ```python block of the README and every >>> example in a docstring of the package runs."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    tried = 0
    for module in [ft_jax, *_doc_modules()]:
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, module.__name__
        tried += result.attempted
    assert tried > 0


def test_engine_recovers_after_a_failed_step(bundled):
    """A step that fails after its donated expert state was consumed: generate raises, the Engine rebuilds its state
    (a cold cache), and the next call works and equals a fresh Engine's."""
    engine = Engine(bundled.checkpoint, policy=bundled.policy, num_slots=8)
    engine.generate([[1, 2, 3]], max_new_tokens=4)
    key = next(k for k in engine._executables if k[0] == "decode")
    real = engine._executables[key]

    def failing(*args):
        real(*args)  # consumes the donated KV cache and expert state
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: host_experts: injected failure")

    engine._executables[key] = failing
    with pytest.raises(jax.errors.JaxRuntimeError, match="injected"):
        engine.generate([[1, 2, 3]], max_new_tokens=4)
    engine._executables[key] = real
    again = engine.generate([[1, 2, 3]], max_new_tokens=6, sampling=Sampling(0.0))
    fresh = Engine(bundled.checkpoint, policy=bundled.policy, num_slots=8).generate([[1, 2, 3]], max_new_tokens=6)
    assert again.tokens == fresh.tokens


def test_two_generate_calls_at_once_are_serialised_with_their_own_statistics(bundled):
    engine = Engine(bundled.checkpoint, policy=bundled.policy, num_slots=8)
    prompts = ([5, 6, 7], [9, 10])
    alone = [engine.generate([p], max_new_tokens=20).tokens for p in prompts]
    results = [None, None]

    def run(i):
        results[i] = engine.generate([prompts[i]], max_new_tokens=20)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.tokens for r in results] == alone
    for r in results:
        assert r.stats["decode_compiles"] == 0 and r.stats["compile_s"] == 0.0
        assert r.stats["decode_steps"] == 19 and r.stats["decode_tokens_per_s"] > 0


def test_the_errors_of_an_unusable_folder_are_public_names(tmp_path):
    """A user catches load's errors by the package's names: a truncated tensor file, a config.json that is not JSON."""
    d = tmp_path / "model"
    shutil.copytree(ft_jax.bundled_model_path(), d)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ft_jax.CheckpointError, match="model.safetensors"):
        ft_jax.load(d, policy="host-all")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ft_jax.ConfigError, match="config.json"):
        ft_jax.load(d, policy="host-all")


def safe_open_names(path) -> list[str]:
    """The tensor names of a safetensors file, read by the safetensors package."""
    from safetensors import safe_open
    with safe_open(str(path), "np") as f:
        return list(f.keys())


def test_tensors_the_config_leaves_unread_are_noted(tmp_path):
    """config.json with one decoder layer fewer than the checkpoint holds: the load says which tensors go unread
    (every tensor of the last layer; with half of the experts in the banks, the other half count as read); the
    bundled model as shipped reads every tensor."""
    d = tmp_path / "model"
    shutil.copytree(ft_jax.bundled_model_path(), d)
    cfg = json.loads((d / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = layers - 1
    (d / "config.json").write_text(json.dumps(cfg))
    last = sorted(n for n in safe_open_names(d / "model.safetensors") if n.startswith(f"model.layers.{layers - 1}."))
    expected = (f"{len(last)} of the checkpoint's tensors are not read by the model its config.json describes: "
                f"model.layers.{layers - 1}.* ({len(last)})")
    messages = []
    model = ft_jax.load(d, policy="host-all", on_message=messages.append)
    assert model.checkpoint.unused_tensors == tuple(last) and last
    assert model.note == expected and messages == [expected]
    half = ft_jax.load_checkpoint(d, experts=range(model.config.num_experts // 2))  # another process holds the rest
    assert half.unused_tensors == tuple(last)
    assert ft_jax.load(policy="host-all").checkpoint.unused_tensors == ()


def test_the_unread_note_orders_layers_by_number_and_names_single_tensors():
    """Whole layers first in numeric order (10 after 9), a layer with some tensors read listed by name, at most 6
    entries and the count of the tensors the rest hold."""
    names = [f"model.layers.{i}.w{j}" for i in range(12) for j in range(3)] + ["lm_head.weight"]
    unread = [f"model.layers.{i}.w{j}" for i in (2, 9, 10, 11) for j in range(3)] + ["model.layers.0.w2"]
    unread += [f"model.layers.{i}.w{j}" for i in (3, 4, 5) for j in range(3)]
    note = api.unused_tensors_note(sorted(unread), names)
    assert note == ("22 of the checkpoint's tensors are not read by the model its config.json describes: "
                    "model.layers.2.* (3), model.layers.3.* (3), model.layers.4.* (3), model.layers.5.* (3), "
                    "model.layers.9.* (3), model.layers.10.* (3) and 4 more tensors")
    assert api.unused_tensors_note(["lm_head.weight"], names) == (
        "1 of the checkpoint's tensors is not read by the model its config.json describes: lm_head.weight")
