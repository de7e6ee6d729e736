"""`ft-jax generate` end to end: transformers' greedy continuation under every policy, the bundled model, errors."""

import argparse
import json
import re
import os
import shutil
import subprocess
import sys

import jax
import pytest

from ft_jax import _ffi, api, cli, units
from ft_jax import weight_formats as wf
from ft_jax.engine.sampling import NonFiniteLogitsError

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "deepseek_v2", "gpt_oss",
            "gpt_oss_mxfp4"]
# "qstar" with --no-measure and no stored profile falls back to fixed-cap:1; "qstar:0.4" fixes the fraction.
POLICIES = ["resident", "fetch-all", "host-all", "qstar:0.4", "qstar", "fixed-cap:1"]


def _generate_json(capsys, *args):
    status = cli.main(["generate", *args, "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ids_equal_transformers_under_the_policies(family, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    info = json.load(open(os.path.join(FIXTURES, family, "reference", "info.json")))
    prompt = ",".join(map(str, info["prompt_ids"]))
    shift = 2 * FAMILIES.index(family)  # two policies per family, rotated: every policy runs on several families
    for policy in (POLICIES[shift % len(POLICIES)], POLICIES[(shift + 1) % len(POLICIES)]):
        out = _generate_json(capsys, "--model", os.path.join(FIXTURES, family), "--prompt-ids", prompt,
                             "--temperature", "0", "--max-new-tokens", "16", "--policy", policy,
                             "--cache-slots", "3", "--no-measure")
        assert out["generated_ids"] == [info["greedy_continuation"]], (family, policy)
        assert out["stats"]["decode_compiles"] == 1, (family, policy)
        assert out["text"] is None  # the fixtures have no tokenizer


def test_bundled_model_generates_text(capsys):
    out = _generate_json(capsys, "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "1",
                         "--policy", "fixed-cap:2")
    text = out["text"][0]
    assert len(out["generated_ids"][0]) == 40
    assert isinstance(text, str) and len(text) > 0
    stats = out["stats"]
    assert stats["decode_compiles"] == 1
    assert 0.0 <= stats["hit_rate"] <= 1.0


def test_streaming_output_and_table(capsys):
    status = cli.main(["generate", "--prompt", "KING:", "--max-new-tokens", "20", "--policy", "host-all",
                       "--temperature", "0"])
    out, err = capsys.readouterr()
    assert status == 0
    assert out.startswith("KING:")
    for label in ("time to first token", "decode", "hit rate", "compile time", "bytes per step"):
        assert label in err


def test_prompt_shown_when_the_first_token_hits_the_stop_string(capsys):
    """The bundled model's greedy first token after "ROMEO:" is a newline: a --stop of it ends the row with no text,
    and the streamed output is still the prompt (then the end-of-output newline)."""
    status = cli.main(["generate", "--prompt", "ROMEO:", "--stop", "\n", "--temperature", "0",
                       "--max-new-tokens", "20", "--policy", "host-all"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out.startswith("ROMEO:"), repr(out)


@pytest.mark.parametrize("error", [ValueError("the row failed"), NonFiniteLogitsError("the row failed")],
                         ids=["ValueError", "NonFiniteLogitsError"])
def test_an_error_after_streamed_text_starts_on_its_own_line(capsys, monkeypatch, error):
    """A failure after some text was streamed (a ValueError; the NonFiniteLogitsError, a FloatingPointError, that
    non-finite logits raise mid-run: a new user's checkpoint with E8M0 scales of 250 got a traceback) ends the streamed
    line first and is one error line, exit status 2."""
    def fail(self, request, *, on_text=None, record_routing=False):
        on_text(0, " once")
        raise error

    monkeypatch.setattr(api.Model, "run_request", fail)
    status = cli.main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "2", "--policy", "host-all"])
    out, err = capsys.readouterr()
    assert status == 2 and out.endswith("ROMEO: once\n"), repr(out)
    assert err.splitlines()[-1] == "ft-jax generate: error: the row failed"
    assert "Traceback" not in err


def _error(capsys, *args):
    status = cli.main(["generate", *args])
    out, err = capsys.readouterr()
    lines = [l for l in err.strip().splitlines() if l]
    assert status == 2
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_error_missing_path(capsys, tmp_path):
    assert "does not exist" in _error(capsys, "--model", str(tmp_path / "nope"), "--prompt-ids", "1")


def test_error_max_new_tokens_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own error (the flag's type)
        cli.main(["generate", "--prompt-ids", "1", "--max-new-tokens", "0"])
    assert exit_info.value.code == 2
    assert "argument --max-new-tokens: expected an integer >= 1, got '0'" in capsys.readouterr().err


def test_error_folder_without_config(capsys, tmp_path):
    assert "no config.json" in _error(capsys, "--model", str(tmp_path), "--prompt-ids", "1")


def test_error_unsupported_architecture(capsys, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, "mixtral"), model)
    cfg = json.load(open(model / "config.json"))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(model / "config.json", "w"))
    line = _error(capsys, "--model", str(model), "--prompt-ids", "1")
    assert "LlamaForCausalLM" in line and "MixtralForCausalLM" in line


def test_error_prompt_longer_than_context(capsys):
    ids = ",".join(["5"] * 200)  # fixture context: 128 tokens
    line = _error(capsys, "--model", os.path.join(FIXTURES, "olmoe"), "--prompt-ids", ids, "--policy", "host-all")
    assert "context" in line


def test_error_device_budget_below_one_slot(capsys):
    line = _error(capsys, "--model", os.path.join(FIXTURES, "olmoe"), "--prompt-ids", "1", "--device-memory", "1KiB",
                  "--policy", "fetch-all")
    cfg = json.load(open(os.path.join(FIXTURES, "olmoe", "config.json")))
    expert_bytes = 3 * cfg["hidden_size"] * cfg["intermediate_size"] * 4  # float32 gate, up and down weights
    assert "smaller than one expert slot" in line and f"({expert_bytes} bytes:" in line
    # the flag given, once (not "--cache-slots / ...: cache= / --cache-slots, ...: ")
    assert line == ("ft-jax generate: error: --device-memory: a device budget of 1KiB (1024 bytes) is smaller than "
                    f"one expert slot ({expert_bytes} bytes: gate, up and down weights of one expert as stored)")


def test_plan_refuses_a_device_budget_below_one_slot_as_generate_does(capsys, tmp_path):
    """`ft-jax plan --device-memory 0` (or 1) replayed host-all alone with one slot on a CPU device and exited 0; it
    is refused with generate's message (memory.budget_slots), also with a stored CPU profile."""
    from ft_jax.offload import profile as bandwidth
    from ft_jax.tools.trace_io import write_trace

    model = api.bundled_model_path()
    trace = tmp_path / "t.jsonl"
    write_trace(str(trace), [{"dataset": "t", "problem_id": 0, "layer": layer, "token_idx": t, "experts": [t % 8, 7],
                              "gating_probs": [0.5, 0.5]} for layer in range(4) for t in range(6)])
    store = tmp_path / "profiles.json"
    bandwidth.save_profile(bandwidth.Profile(
        key=bandwidth.machine_key("float32", 393216), bp=16.0, bh=22.0, bp_contended=14.0, bh_contended=16.0,
        spreads={}, repeats=1, quick=True, measured_at="2026-01-01T00:00:00+00:00", hidden_size=1, intermediate_size=1),
        store)
    for budget, nbytes in (("0", "0 bytes"), ("1", "1 byte"), ("393215", "393215 bytes")):
        for bandwidth_flags in (["--profile", str(store)], ["--bandwidth", "10,20"]):
            assert cli.main(["plan", str(trace), "--model", model, "--device-memory", budget, *bandwidth_flags]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err == (f"ft-jax plan: error: --device-memory: a device budget of {budget} ({nbytes}) "
                                         "is smaller than one expert slot (393216 bytes: gate, up and down weights of "
                                         "one expert as stored)\n"), err
    assert cli.main(["plan", str(trace), "--model", model, "--device-memory", "384KiB", "--profile", str(store)]) == 0
    assert capsys.readouterr().out.startswith("recommendation: ")


def test_an_explicit_profile_path_needs_its_folder(capsys, monkeypatch, tmp_path):
    """--profile in a folder that does not exist is refused before loading, as --record-trace is (it was created)."""
    def no_loading(*a, **k):
        raise AssertionError("the checkpoint must not be loaded for a bad --profile")

    monkeypatch.setattr("ft_jax.checkpoint.load_checkpoint", no_loading)
    missing = tmp_path / "no" / "p.json"
    line = _error(capsys, "--policy", "qstar", "--profile", str(missing))
    assert line == f"ft-jax generate: error: --profile {missing}: folder {tmp_path / 'no'} does not exist or is not writable"
    assert not (tmp_path / "no").exists()
    line = _error(capsys, "--policy", "qstar", "--profile", str(tmp_path))
    assert line == f"ft-jax generate: error: --profile {tmp_path}: is a directory, expected a file name"


def test_a_file_flag_refuses_standard_output(capsys, monkeypatch, tmp_path):
    """--record-trace - and --profile - wrote a file named "-" in the working folder (found by a fresh-user trial):
    "-" is refused with one line before loading, the working folder left as it was."""
    monkeypatch.chdir(tmp_path)
    for flag in ("--record-trace", "--profile"):
        line = _error(capsys, "--policy", "qstar", flag, "-")
        assert line.startswith(f"ft-jax generate: error: {flag} -: writes a file, not standard output"), line
    assert list(tmp_path.iterdir()) == []


def test_error_unknown_policy(capsys):
    with pytest.raises(SystemExit) as exit_info:  # rejected by the argument parser, before any loading
        cli.main(["generate", "--model", os.path.join(FIXTURES, "olmoe"), "--prompt-ids", "1", "--policy", "magic"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "magic" in err, err


def test_value_starting_with_a_dash_says_how_to_give_it(capsys):
    """argparse reads "-1GiB" as a flag; the one line says to join the value with "=" (which then reaches the
    byte-count check), and says so for a flag given last without its value too."""
    for args, flag in ((["--device-memory", "-1GiB"], "--device-memory"), (["--prompt-ids"], "--prompt-ids")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["generate", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"argument {flag}: expected one argument (a value that starts with '-' goes after '=': {flag}=VALUE)" \
            in err, err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--device-memory=-1GiB"])
    assert "argument --device-memory: not a byte count: '-1GiB'" in capsys.readouterr().err


def test_format_bytes_picks_the_unit_that_keeps_digits():
    assert units.format_bytes(100) == "100 B"
    assert units.format_bytes(1536) == "1.50 KiB"
    assert units.format_bytes(352321536) == "336.00 MiB"  # a Mixtral-8x7B bf16 expert
    assert units.format_bytes(3 * 2**30) == "3.00 GiB"
    assert units.parse_bytes(units.format_bytes(5 * 2**40).replace(" ", "")) == 5 * 2**40


def test_parse_bytes():
    assert units.parse_bytes("4096") == 4096
    assert units.parse_bytes("2GB") == 2 * 10**9
    assert units.parse_bytes("512MiB") == 512 * 2**20
    assert units.parse_bytes("1.5g") == int(1.5 * 2**30)
    with pytest.raises(Exception, match="byte count"):
        units.parse_bytes("lots")
    assert units.parse_bytes("2.0") == 2 and units.parse_bytes("1.5KB") == 1500
    with pytest.raises(ValueError) as e:  # was 1 byte
        units.parse_bytes("1.5")
    assert str(e.value) == ("not a whole number of bytes: '1.5' (a fraction needs a unit larger than a byte, "
                            "e.g. 1.5GiB)")
    with pytest.raises(ValueError, match="not a whole number of bytes: '0.5b'"):
        units.parse_bytes("0.5b")
    assert units.parse_bytes("1" * 400 + "GiB") == int("1" * 400) * 2**30  # exact, no float overflow (was OverflowError)
    assert units.parse_bytes("3.3KiB") == 3379  # 3379.2 bytes, whole bytes down


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "ft_jax", "generate", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--model", "--prompt-ids", "--cache-fraction", "--device-memory", "--policy", "--json"):
        assert flag in out
    text = " ".join(out.split())  # argparse wraps the description
    for arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                 "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"):
        assert arch in text



@pytest.mark.parametrize("command", ["generate", "serve", "profile", "trace", "plan"])
@pytest.mark.parametrize("columns", [60, 80, 250])
def test_help_wraps_prose_and_keeps_commands(monkeypatch, command, columns):
    """A subcommand's --help at any terminal width: the description, the prose lines of the epilog and the option
    help fit the width (a word longer than it aside), no word, path or hyphenated value is split; the indented lines
    of the epilog (example commands, formulas) appear exactly as written."""
    monkeypatch.setenv("COLUMNS", str(columns))
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = sub.format_help()
    lines = text.splitlines()
    indented = [line.rstrip() for line in (sub.epilog or "").splitlines() if line[:1].isspace()]
    assert indented and all(line in lines for line in indented)
    words = set(" ".join(line for line in (sub.epilog or "").splitlines() if not line[:1].isspace()).split())
    words |= set((sub.description or "").split())
    for action in sub._actions:
        words |= set(str(action.help or "").split())
    for line in lines[lines.index("") + 1:]:  # after the usage block (argparse keeps a [a | b] group whole)
        if line.rstrip() in indented:
            continue
        assert len(line) <= columns or " " not in line.strip(), line
    assert " ".join(sub.description.split()) in " ".join(text.split())  # wrapped, not cut
    text_words = set(text.split())
    assert {w for w in words if "%" not in w} <= text_words | {"-h,", "--help"}  # every word whole


def test_argument_errors_are_one_line(capsys):
    for args in (["--device-memory", "garbage"], ["--temperature", "inf"], ["--prompt-ids", "a,b"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["generate", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert len(err.strip().splitlines()) == 1 and "error" in err, err


def test_request_errors_come_before_loading(capsys, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the checkpoint must not be loaded for a bad request")

    monkeypatch.setattr("ft_jax.checkpoint.load_checkpoint", no_loading)
    assert "outside the vocabulary" in _error(capsys, "--prompt-ids", "1,2,300")
    assert "empty" in _error(capsys, "--prompt", "")


def test_default_new_tokens_fit_the_context(capsys):
    cfg = json.load(open(os.path.join(api.bundled_model_path(), "config.json")))
    prompt = "x" * (cfg["max_position_embeddings"] - 10)
    out = _generate_json(capsys, "--prompt", prompt, "--policy", "host-all", "--temperature", "0")
    assert out["settings"]["max_new_tokens"] == 10
    assert len(out["generated_ids"][0]) == 10


def test_single_token_has_no_decode_statistics(capsys):
    """(Default flags: on this CPU-only backend, host-all with one slot, and a note saying why.)"""
    out = _generate_json(capsys, "--prompt", "A", "--max-new-tokens", "1")
    stats = out["stats"]
    assert stats["decode_steps"] == 0 and stats["decode_tokens"] == 0
    assert stats["decode_tokens_per_s"] is None and stats["hit_rate"] is None
    assert out["settings"]["policy"] == "host-all" and stats["num_slots"] == 1
    assert any(n.startswith("no accelerator: every expert is computed on the CPU") for n in out["notes"])


def test_a_second_identical_process_compiles_nothing(tmp_path):
    """JAX's persistent compilation cache is on by default under the user cache directory: a second identical
    `ft-jax generate` process loads both steps from it; with --no-compile-cache it compiles them again."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    argv = [sys.executable, "-m", "ft_jax", "generate", "--model", os.path.join(FIXTURES, "olmoe"), "--prompt-ids",
            "1,2,3", "--max-new-tokens", "5", "--policy", "fetch-all", "--cache-slots", "4", "--json"]

    def stats(*extra):
        proc = subprocess.run(argv + list(extra), env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        s = json.loads(proc.stdout)["stats"]
        return s["prefill_compiles"] + s["decode_compiles"], s["xla_compiles"], s["cache_hits"]

    assert stats() == (2, 2, 0)
    assert (tmp_path / "ft_jax" / "compile").is_dir()
    assert stats() == (2, 0, 2)
    assert stats("--no-compile-cache") == (2, 2, 0)


def test_compile_notes_come_before_the_stream(tmp_path):
    """One 'building ...' line per step on stderr, with its time and how it was built (compiled, or loaded from the
    compilation cache by a second process: never called compiling then), all before the first streamed token."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for how in ("compiled", "loaded from the compilation cache"):
        proc = subprocess.run([sys.executable, "-m", "ft_jax", "generate", "--prompt", "KING:", "--max-new-tokens",
                               "8", "--policy", "host-all", "--temperature", "0"], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        notes = [l for l in proc.stderr.splitlines() if "building the" in l]
        assert len(notes) == 2 and all(re.search(r"^ft-jax: building the (prefill|decode) step \(batch 1, .*\) "
                                                 rf"\.\.\. {how} in \d+\.\d s$", l) for l in notes), proc.stderr
        assert "compiling" not in proc.stderr
        assert proc.stdout.startswith("KING:")
        assert "expert slots         none used (host-all" in proc.stderr


def test_statistics_table_counts_and_labels(capsys):
    """The table says '1 token' and '1 step' (not '1 tokens'), the qstar fraction rounded as the bandwidth profile's
    note rounds it (--json keeps it exact), and labels the weights per token of a batch as the step's over its
    rows."""
    from ft_jax.cli.generate import stats_table

    stats = _generate_json(capsys, "--prompt-ids", "5", "--max-new-tokens", "2", "--policy", "qstar:0.403632",
                           "--temperature", "0", "--cache-slots", "4")["stats"]
    assert stats["policy"] == "qstar:0.403632" and stats["batch_size"] == 1

    def rows(table):
        return dict(re.fullmatch(r"  (.+?) {2,}(.*)", line).groups() for line in table.splitlines())

    one = rows(stats_table(stats))
    assert one["policy"] == "qstar:0.404"
    assert one["expert slots"] == "4 x 384.00 KiB"  # in the unit of its size (it printed "4 x 0.38 MiB")
    assert one["prefill"].startswith("1 token, ") and one["decode"].startswith("1 token after the first, 1 step, ")
    assert re.fullmatch(r"f32 experts of 384\.00 KiB in the host banks; \d+\.\d\d MiB read per token \(dense "
                        r"0\.90 MiB per step \+ the active experts\)", one["weights"]), one["weights"]
    two = rows(stats_table({**stats, "batch_size": 2, "prompt_tokens": 2, "decode_tokens": 2, "decode_steps": 1,
                            "weight_bytes_per_token": 3 * 2**20}))
    assert two["prefill"].startswith("2 tokens, ") and two["decode"].startswith("2 tokens after the first, 1 step, ")
    assert two["weights"] == ("f32 experts of 384.00 KiB in the host banks; 3.00 MiB read per token (dense 0.90 MiB "
                              "per step + the active experts)"), two["weights"]
    assert rows(stats_table({**stats, "policy": "qstar:0.4"}))["policy"] == "qstar:0.4"


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["profile"], ["trace", "t.jsonl"], ["plan", "t.jsonl"]])
def test_an_empty_model_folder_is_refused_not_the_bundled_model(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args([*command, "--model", ""])
    assert exit_info.value.code == 2
    assert "argument --model: the model folder is empty: give a path, or leave --model out for the bundled model" \
        in capsys.readouterr().err


def test_stop_escapes_follow_llama_cpp(capsys):
    """--stop processes escapes as llama.cpp's string_process_escapes: \\n \\r \\t \\' \\" \\\\ \\xHH; any other
    backslash (which llama.cpp keeps) is refused, naming the stop string and the escape."""
    from ft_jax.cli.usage import process_escapes

    cases = {r"\n\n": "\n\n", r"a\tb\r": "a\tb\r", r"\\n": "\\n", r"\'\"": "'\"", r"\x41\\": "A\\",
             "plain": "plain", r"caf\xc3\xa9 é": "café é"}  # \xHH is a byte, as in llama.cpp: \xc3\xa9 is é
    assert {k: process_escapes(k) for k in cases} == cases
    args = cli.build_parser().parse_args(["generate", "--stop", r"\n\n", "--stop", "x"])
    assert args.stop == ["\n\n", "x"]
    known = r"(escapes: \n, \r, \t, \\, \', \" and \xHH; \\ for a backslash) (see --help)"
    for text, problem in ((r"\x", r"malformed escape \x: \xHH takes two hex digits"),
                          (r"a\x4", r"malformed escape \x4: \xHH takes two hex digits"),
                          (r"\xg1", r"malformed escape \xg1: \xHH takes two hex digits"),
                          (r"\q", r"unknown escape \q"), (r"ab\n\d", r"unknown escape \d"),
                          ("end\\", "a backslash at the end escapes nothing"),
                          (r"\xe9", r"the \xHH bytes are not UTF-8 (byte 0: 0xe9)")):
        with pytest.raises(SystemExit) as exit_info:
            cli.build_parser().parse_args(["generate", "--stop", "x", "--stop", text])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"ft-jax generate: error: argument --stop: '{text}': {problem} {known}\n"


def test_quantize_budgets_and_errors(capsys, tmp_path):
    """--quantize: --device-memory counts experts at the stored q4_0 size (data + f16 scales), an MXFP4 checkpoint
    refuses it (used as stored), and the parser refuses other types."""
    cfg = json.load(open(os.path.join(FIXTURES, "olmoe", "config.json")))
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    line = _error(capsys, "--model", os.path.join(FIXTURES, "olmoe"), "--prompt-ids", "1", "--device-memory", "1KiB",
                  "--quantize", "q4_0", "--policy", "qstar")
    assert f"({wf.Q4_0.nbytes(2 * I, H) + wf.Q4_0.nbytes(H, I)} bytes:" in line
    line = _error(capsys, "--model", os.path.join(FIXTURES, "gpt_oss_mxfp4"), "--prompt-ids", "1", "--quantize",
                  "q8_0")
    assert "(--quantize q8_0): this GptOssForCausalLM checkpoint is already quantized (mxfp4" in line
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--prompt-ids", "1", "--quantize", "q5_k"])
    assert exit_info.value.code == 2 and "expected q8_0 or q4_0, got 'q5_k'" in capsys.readouterr().err


def test_profile_measures_quantized_experts(capsys, tmp_path):
    """`ft-jax profile --quantize q4_0`: the profile is keyed by the format the banks hold (q4_0x16, the rows
    interleaved, at the CPU's AVX-512 level) and the stored bytes per expert."""
    status = cli.main(["profile", "--hidden-size", "256", "--intermediate-size", "128", "--quantize", "q4_0",
                       "--quick", "--repeats", "1", "--no-save", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert status == 0
    key = out["profile"]["key"]
    x16 = jax.default_backend() == "cpu" and _ffi.kernel_isa() == "avx512bf16"  # weight_formats.storage_format
    assert key["dtype"] == ("q4_0x16" if x16 else "q4_0")
    assert key["expert_bytes"] == wf.Q4_0.nbytes(256, 256) + wf.Q4_0.nbytes(256, 128)
    assert cli.main(["profile", "--hidden-size", "48", "--intermediate-size", "128", "--quantize", "q8_0",
                     "--no-save"]) == 2
    assert "rows of 48 elements do not fit q8_0's blocks of 32" in capsys.readouterr().err


def test_generate_with_the_experts_copied_onto_huge_pages(capsys):
    """`--bank-memory copy` (serve's default) decodes the same greedy tokens as the mapped banks and says so in the
    settings; an unknown value is a usage error naming the choices."""
    args = ["--prompt-ids", "1,2,3", "--temperature", "0", "--max-new-tokens", "6", "--no-measure"]
    mapped = _generate_json(capsys, *args)
    copied = _generate_json(capsys, *args, "--bank-memory", "copy")
    assert mapped["settings"]["bank_memory"] == "map" and copied["settings"]["bank_memory"] == "copy"
    assert copied["generated_ids"] == mapped["generated_ids"]
    with pytest.raises(SystemExit):
        cli.main(["generate", "--bank-memory", "anon"])
    assert "invalid choice: 'anon' (choose from 'map', 'copy')" in capsys.readouterr().err


def test_generate_quantized_while_loading(capsys):
    """`ft-jax generate --quantize q4_0`: the statistics name the format, count experts at the stored size and the
    weight bytes per token from it; one decode compile; the table's "weights" row says it."""
    cfg = json.load(open(os.path.join(FIXTURES, "qwen3_moe", "config.json")))
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    out = _generate_json(capsys, "--model", os.path.join(FIXTURES, "qwen3_moe"), "--prompt-ids", "1,2,3",
                         "--temperature", "0", "--max-new-tokens", "4", "--quantize", "q4_0", "--cache-slots", "4",
                         "--no-measure", "--policy", "fetch-all")
    stats = out["stats"]
    assert out["settings"]["quantize"] == "q4_0" and stats["weight_format"] == "q4_0"
    assert stats["expert_bytes"] == wf.Q4_0.nbytes(2 * I, H) + wf.Q4_0.nbytes(H, I)
    assert stats["decode_compiles"] == 1
    assert stats["weight_bytes_per_token"] == pytest.approx(
        stats["dense_weight_bytes"] + stats["active_per_step"] * stats["expert_bytes"])
    status = cli.main(["generate", "--model", os.path.join(FIXTURES, "qwen3_moe"), "--prompt-ids", "1,2",
                       "--max-new-tokens", "3", "--quantize", "q8_0", "--policy", "host-all"])
    err = capsys.readouterr().err
    assert status == 0 and re.search(r"weights\s+q8_0 experts of [\d.]+ [KM]iB in the host banks; [\d.]+ MiB read "
                                     r"per token", err)
