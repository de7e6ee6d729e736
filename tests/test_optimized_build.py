"""The optimized XLA:CPU build users run (tests/conftest.py runs the rest of the suite at LLVM -O0 for speed):
greedy `ft-jax generate` at the default optimization level gives the transformers greedy continuation (issue 18
item 7). Two fixtures with different attention paths: qwen3_moe (GQA, a dense layer) and deepseek_v3 (MLA)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
PROMPT = [1, 17, 42, 99, 123, 7, 250, 3, 64, 128, 5, 200]  # the references' prompt (fixtures/hf_tiny/README.md)


@pytest.mark.parametrize("fixture,policy", [("qwen3_moe", "auto"), ("deepseek_v3", "fetch-all")])
def test_default_optimization_level_matches_transformers(fixture, policy, tmp_path):
    folder = os.path.join(FIXTURES, fixture)
    want = json.load(open(os.path.join(folder, "reference", "info.json")))["greedy_continuation"]
    env = dict(os.environ, PYTHONPATH=REPO, XDG_CACHE_HOME=str(tmp_path))
    env.pop("XLA_FLAGS", None)  # XLA's defaults: the build users run
    r = subprocess.run([sys.executable, "-m", "ft_jax", "generate", "--model", folder, "--prompt-ids",
                        ",".join(map(str, PROMPT)), "--temperature", "0", "--max-new-tokens", str(len(want)),
                        "--policy", policy, "--no-measure", "--cache-slots", "5", "--json", "--no-compile-cache"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_ids"] == [want]
