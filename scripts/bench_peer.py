#!/usr/bin/env python3
"""Decode tokens/s and weight bandwidth of ft_jax against llama.cpp on the same synthetic Mixtral-shaped bf16 model.

    python3 scripts/bench_peer.py --json-out /tmp/bench_peer.json             # 3 rounds, 32 new tokens each
    python3 scripts/bench_peer.py --quick                                    # 2 rounds, 12 tokens: a few minutes
    python3 scripts/bench_peer.py --programs llama.cpp,host-all --rounds 5   # a subset, more rounds
    python3 scripts/bench_peer.py --layers 4 --quick --json                  # another shape (flags of the model)
    python3 scripts/bench_peer.py --quant bf16,q8_0,q4_0 --programs llama.cpp,host-all   # quantized weights
    python3 scripts/bench_peer.py --prefill 512,2048,8192 --max-positions 16384 --json-out /tmp/prefill.json
                                                                             # prefill tokens/s (issue 20)

What runs (all on the CPU, side by side in one run):
  llama.cpp     ``llama-bench -m MODEL.gguf -p 0 -d P -n N -t T -r 1 -o json`` (text generation of N tokens after a
                context of P tokens, its own warm-up run first), built from the source vendored in the
                llama-cpp-python sdist (scripts/llama_cpp_build.py; cached under --cache-dir, built once)
  resident, host-all, qstar
                ``ft-jax generate --model DIR --prompt-ids IDS --max-new-tokens N --temperature 0 --json --policy P
                --cache-fraction F`` as a user runs it (one fresh process per run); its stats JSON's
                decode_tokens_per_s (compile excluded). qstar reads its bandwidth profile from
                --cache-dir/ft_jax_profiles.json (--profile): on the first run ft-jax measures its quick profile
                and saves it there, as a user's first run does in the user cache directory
  numpy         read baseline: np.add.reduce over a --numpy-gib GiB float32 array (far above the last-level cache),
                on 1 thread and on T threads (each thread sums a 1/T slice; numpy releases the GIL), as
                scripts/bench_ffi.py does; the median of --numpy-repeats passes per round after one untimed pass

Prefill (--prefill P1,P2,..): prompt processing instead of decoding, every prompt length in every round, each run's
programs in the rotated order: llama.cpp ``llama-bench -p P -n 0`` (its avg_ts: prompt tokens/s of one timed run
after its own warm-up) against ``ft-jax generate --prompt-ids (P fixed random ids) --max-new-tokens 1`` (its stats'
prefill_tokens_per_s: prompt tokens over the wall time from the first prefill chunk to the first token, compilation
excluded; --prefill-chunk passes ft-jax's chunk size). Reported per length and program: tokens/s median [min-max],
the ratio to llama.cpp (medians; per round), and ft_jax's own rate at each length over its rate at the shortest
(the issue's "rate at 2048 >= 0.9x rate at 512"). A length needs --max-positions above it (ft-jax refuses a prompt
that fills the context); the bench model's default is 4096.

Quantized weights (--quant, default bf16 only): for each type Q in the list every program runs on weights of that
type, and each ft_jax program's ratio is to llama.cpp of the same type:
  bf16          llama.cpp: the bf16 GGUF; ft_jax: the bf16 checkpoint
  q8_0, q4_0    llama.cpp: ``llama-quantize --pure model-bf16.gguf model-Q.gguf Q8_0|Q4_0`` (every 2-D weight in the
                type, embeddings and lm_head included; the router ffn_gate_inp and the norms stay f32); ft_jax: the bf16
                checkpoint loaded with ``ft-jax generate --quantize q8_0|q4_0`` (its projections, lm_head and experts
                in the type; router, norms and embeddings as stored)
  mxfp4_moe     llama.cpp only: ``llama-quantize model-bf16.gguf model-mxfp4_moe.gguf MXFP4_MOE`` (llama.cpp's
                mixture: the expert tensors MXFP4, every other 2-D weight Q8_0); ft_jax has no MXFP4 quantizer (it
                runs MXFP4 checkpoints as stored: --family gpt_oss)
  mxfp4         --family gpt_oss only (its default and only type): the gpt-oss checkpoint as stored, MXFP4
                experts and bf16 rest, on both sides: llama.cpp the GGUF of scripts/gpt_oss_to_gguf.py (lossless
                repack), ft_jax the safetensors (e.g. --preset gpt-oss-20b: 13.8 GB of safetensors + 13.9 GB GGUF)
Program labels: the bare name for bf16 ("llama.cpp", "host-all"), "name:Q" for the others ("llama.cpp:q8_0").
Weight bytes read per token are computed for each side from what it stores: ft_jax from the config and
ft_jax.weight_formats.WeightFormat.nbytes (synthetic_checkpoint.weight_bytes_per_token); llama.cpp from the
GGUF's tensor sizes (every tensor once, the expert tensors *_exps x top_k / E, token_embd one row).
The quantized GGUFs are written once next to the bf16 one and kept.

Model: scripts/synthetic_checkpoint.py (random bf16 weights; defaults hidden 2048, intermediate 5632, 8 layers,
8 experts top-2, 16/4 heads of 128, vocab 32000) and its GGUF from scripts/mixtral_to_gguf.py (the same weights),
both written once and cached under --cache-dir/models/. --family gpt_oss (--preset gpt-oss-20b for the released
shape): a gpt-oss checkpoint with MXFP4 experts and its GGUF from scripts/gpt_oss_to_gguf.py.

Method: --rounds rounds; in each, every program runs once, in an order rotated by one position per round (no
program always runs first). Before each llama-bench run the GGUF is read once so that it is in the page cache
(llama.cpp memory-maps it; ft_jax reads its checkpoint into host memory before it starts timing).
Reported per program: tokens/s median [min-max] over the rounds; weight GB/s = weight bytes read per decoded token
(that side's own count, above; ft_jax's stats' count is recorded next to it) x tokens/s / 1e9; the ratio of its
median tokens/s to llama.cpp's on the same weight type, the range of the same-round ratios and the ratio of the
best rounds; its median GB/s over the median T-thread numpy read (and best over best). Also the load average
before and after, at each round start and at each run's start; the CPU other processes used during each run, in
cores (CpuMeter: whole run, load and compile included; a warning when above 0.25 core) and the same figures over
only the runs below that ("quiet"); thread counts; versions; every run's record. A program whose run fails is
reported with its error and left out of the later rounds (exit status 1). The table goes to stderr; JSON to
--json-out and/or stdout (--json). A benchmark, not a test: nothing is asserted.

Needs: cmake and a C++ compiler (llama.cpp build, once), the gguf package (``pip install gguf``, or the ``bench``
extra of ft_jax) and ft_jax installed in this interpreter's environment. Disk: about 10 GB under --cache-dir for
the default model (safetensors + GGUF) and the llama.cpp build.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_build  # noqa: E402
import synthetic_checkpoint  # noqa: E402
from ft_jax import weight_formats  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FT_JAX_POLICIES = ("resident", "host-all", "qstar")
# Fields of llama-bench's JSON record kept per run (the rest is constant or about GPUs).
LLAMA_BENCH_FIELDS = ("build_commit", "cpu_info", "backends", "model_type", "model_size", "model_n_params",
                      "n_threads", "poll", "flash_attn", "repack", "load_mode", "type_k", "type_v", "n_prompt",
                      "n_gen", "n_depth", "avg_ts", "samples_ts")
ALL_PROGRAMS = ("llama.cpp",) + FT_JAX_POLICIES + ("numpy",)
QUANT_CHOICES = ("bf16", "q8_0", "q4_0", "mxfp4_moe", "mxfp4")
# --quant -> (llama-quantize type, --pure) for the llama.cpp GGUF (bf16: the converted file itself).
LLAMA_QUANTIZE = {"q8_0": ("Q8_0", True), "q4_0": ("Q4_0", True), "mxfp4_moe": ("MXFP4_MOE", False)}
# --quant -> ft-jax generate --quantize value (None: the checkpoint as stored); absent: ft_jax has no such variant.
FT_JAX_QUANTIZE = {"bf16": None, "q8_0": "q8_0", "q4_0": "q4_0", "mxfp4": None}
QUIET_CORES = 0.25  # a run is "quiet" when other processes used at most this many cores meanwhile
MARKER = "ft_jax_bench_peer.json"  # written into a model folder once it is complete
GiB = 1 << 30


def _log(msg: str) -> None:
    print(f"[bench_peer] {msg}", file=sys.stderr, flush=True)


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class CpuMeter:
    """CPU time the rest of the machine used while a measurement ran, in cores (CPU-seconds per second).

    From /proc/stat (busy = user + nice + system + irq + softirq + steal jiffies of all CPUs) minus this process's
    and its waited-for children's CPU time (os.times()). A value well above 0 means other processes competed for
    the cores during the measurement. ``None`` where /proc/stat is missing."""

    def __init__(self):
        self.start = self._snapshot()
        self.t0 = time.perf_counter()

    @staticmethod
    def _snapshot():
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        return busy, t.user + t.system + t.children_user + t.children_system

    def stop(self) -> dict:
        """{"other_cores", "own_cores"} averaged over the time since construction (None without /proc/stat)."""
        end, wall = self._snapshot(), time.perf_counter() - self.t0
        if self.start is None or end is None:
            return {"other_cores": None, "own_cores": None}
        busy, own = end[0] - self.start[0], end[1] - self.start[1]
        return {"other_cores": round(max(0.0, busy - own) / wall, 2), "own_cores": round(own / wall, 2)}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick: 2)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens decoded per run, llama.cpp and ft_jax alike (default 32; --quick: 12)")
    p.add_argument("--prompt-len", type=int, default=8,
                   help="prompt tokens before decoding (ft_jax: a fixed random prompt; llama.cpp: -d depth) "
                        "(default %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer rounds and tokens (2 x 12), for a run of minutes")
    p.add_argument("--prefill", default=None, metavar="P1,P2,..",
                   help="measure prefill tokens/s at these prompt lengths instead of decoding (module docstring)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="with --prefill: ft-jax's --prefill-chunk (default: ft-jax's default)")
    p.add_argument("--programs", default=",".join(ALL_PROGRAMS),
                   help=f"comma-separated subset of {','.join(ALL_PROGRAMS)} (default: all)")
    p.add_argument("--quant", default=None,
                   help=f"comma-separated weight types from {','.join(QUANT_CHOICES)}: each program runs on each "
                        "(see the module docstring; default bf16, for --family gpt_oss mxfp4)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads for llama.cpp (-t), ft_jax's host kernels (FT_JAX_NUM_THREADS) and the numpy "
                        "multi-thread read (default: all %(default)s cores)")
    p.add_argument("--cache-fraction", type=float, default=0.5,
                   help="ft_jax --cache-fraction for host-all and qstar (default %(default)s)")
    p.add_argument("--bank-memory", choices=("map", "copy"), default="map",
                   help="ft-jax generate --bank-memory: the expert banks map the file's pages (default, as generate) "
                        "or are copied onto huge pages (as ft-jax serve)")
    p.add_argument("--numpy-gib", type=float, default=1.0, help="numpy read array size in GiB (default 1, >= 1)")
    p.add_argument("--numpy-repeats", type=int, default=5, help="numpy read passes per round (default 5)")
    p.add_argument("--cache-dir", type=Path, default=llama_cpp_build.DEFAULT_CACHE_DIR,
                   help="llama.cpp sdist/build and the model folders (default %(default)s)")
    p.add_argument("--llama-cpp-python-version", default=None,
                   help="llama-cpp-python sdist whose vendored llama.cpp is built (default: newest cached, else "
                        "PyPI's latest)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per program run (default 1800)")
    p.add_argument("--json-out", type=Path, default=None, help="write the JSON result to this file")
    p.add_argument("--json", action="store_true", help="print the JSON result to stdout")
    g = p.add_argument_group("model (scripts/synthetic_checkpoint.py)")
    synthetic_checkpoint.add_model_arguments(g)
    return p


def ensure_models(cache_dir: Path, config: dict, seed: int) -> tuple[Path, Path, dict]:
    """(HF folder, GGUF path, creation record) of the synthetic model for ``config`` and ``seed``, written into
    cache_dir/models/<name>/ unless a complete copy (marker file with the same config) is already there.
    Mixtral: model-bf16.gguf (scripts/mixtral_to_gguf.py); gpt-oss: model-mxfp4.gguf (scripts/gpt_oss_to_gguf.py,
    the MXFP4 experts as stored)."""
    import gpt_oss_to_gguf
    import mixtral_to_gguf

    family = config["model_type"]
    key = hashlib.sha256(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()[:10]
    name = f"{family}_h{config['hidden_size']}_i{config['intermediate_size']}_l{config['num_hidden_layers']}_{key}"
    folder = cache_dir / "models" / name
    gguf_path = folder / ("model-mxfp4.gguf" if family == "gpt_oss" else "model-bf16.gguf")
    marker = folder / MARKER
    if marker.is_file():
        record = json.loads(marker.read_text())
        if record.get("config") == config and gguf_path.is_file():
            return folder, gguf_path, {**record, "cached": True}
    _log(f"writing the synthetic checkpoint to {folder}")
    hf = synthetic_checkpoint.write_checkpoint(folder, config, seed=seed, progress=True)
    _log(f"writing the GGUF {gguf_path}")
    gg = (gpt_oss_to_gguf if family == "gpt_oss" else mixtral_to_gguf).write_gguf(folder, gguf_path, progress=True)
    record = {"config": config, "seed": seed, "safetensors": hf, "gguf": gg}
    marker.write_text(json.dumps(record, indent=1))
    return folder, gguf_path, {**record, "cached": False}


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    """n fixed pseudo-random token ids in [3, vocab) (past <unk>, <s>, </s>)."""
    rng = np.random.default_rng(seed + 1)
    return [int(t) for t in rng.integers(3, vocab, n)]


def warm_page_cache(path: Path, chunk: int = 64 << 20) -> float:
    """Read ``path`` once (into the page cache) and return the seconds it took."""
    t0 = time.perf_counter()
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def variant_label(program: str, quant: str) -> str:
    """The program label of ``program`` on weights of type ``quant``: the bare name for bf16, else name:quant."""
    return program if quant == "bf16" else f"{program}:{quant}"


def ensure_quantized_gguf(quantize_bin: str, bf16_gguf: Path, quant: str, threads: int) -> tuple[Path, dict]:
    """(path, record) of the GGUF of type ``quant`` (LLAMA_QUANTIZE) made by llama.cpp's own llama-quantize from
    ``bf16_gguf``, written next to it as model-<quant>.gguf once (cached while that file exists; llama-quantize
    writes to a .partial name that is renamed when it succeeds).
    record: {"command", "seconds" (0 when cached), "bytes"}. Raises RuntimeError (llama-quantize failed) with the
    tail of its output."""
    qtype, pure = LLAMA_QUANTIZE[quant]
    out = bf16_gguf.with_name(f"model-{quant}.gguf")
    cmd = [quantize_bin, *(["--pure"] if pure else []), str(bf16_gguf), str(out), qtype, str(threads)]
    if out.is_file():
        return out, {"command": cmd, "seconds": 0.0, "bytes": out.stat().st_size, "cached": True}
    tmp = out.with_name(out.name + ".partial")
    _log(f"llama-quantize to {qtype}: {out}")
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd[:-3], str(tmp), *cmd[-2:]], capture_output=True, text=True)
    if proc.returncode or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-800:]}")
    tmp.replace(out)
    return out, {"command": cmd, "seconds": round(time.perf_counter() - t0, 1), "bytes": out.stat().st_size,
                 "cached": False}


def gguf_weight_bytes_per_token(path: Path, top_k: int, num_experts: int) -> dict:
    """Weight bytes llama.cpp reads per decoded token from the GGUF at ``path``, from its tensor sizes (n_bytes of
    each tensor as stored: quantized blocks with their scales): every tensor once, except the expert tensors
    (names with "_exps", [E, ...], weights and biases) of which top_k / E, and token_embd of which one row.
    Returns {"experts", "embedding_row", "other", "total", "by_type": {GGML type name: bytes per token}} in bytes.
    Raises ValueError naming the file and tensor when an expert tensor's last GGUF dimension is not num_experts."""
    import gguf  # optional dependency (the bench extra); imported here so that --help needs only numpy

    parts = {"experts": 0, "embedding_row": 0, "other": 0}
    by_type: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        n = int(t.n_bytes)
        if "_exps" in t.name:
            key, n = "experts", n * top_k // num_experts
            if int(t.shape[-1]) != num_experts:  # GGUF dims are reversed: the expert axis is the last
                raise ValueError(f"{path}: tensor {t.name} has shape {list(t.shape)}, expected {num_experts} experts "
                                 "in its last GGUF dimension")
        elif t.name == "token_embd.weight":
            key, n = "embedding_row", n // int(t.shape[-1])
        else:
            key = "other"
        parts[key] += n
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + n
    parts["total"] = sum(parts.values())
    return {**parts, "by_type": by_type}


def ft_jax_has_quantize() -> bool:
    """Whether this ft_jax's ``ft-jax generate`` has the --quantize flag (issue 19)."""
    proc = subprocess.run(ft_jax_command() + ["generate", "--help"], capture_output=True, text=True)
    return "--quantize" in proc.stdout


def run_llama_bench(bench: str, gguf_path: Path, new_tokens: int, depth: int, threads: int,
                    timeout: float) -> dict:
    """One llama-bench text-generation run. llama.cpp memory-maps the GGUF and its warm-up decodes one token, so
    the experts that token did not route to would be read from disk during the timed run if the file were not in
    the page cache: the file is read once first (as it is after any earlier run), which takes "page_cache_s".
    A run killed by a signal at depth > 0 is run again at depth 0 (llama.cpp 0.3.36's llama-bench crashes with
    SIGSEGV on q8_0 / q4_0 files with -d > 0 on CPUs with AMX, where its CPU repack takes the AMX buffers; the
    prompt's few tokens of context cost nothing measurable in a decode step); "depth" says which ran.
    Returns {"tokens_per_s", "wall_s", "page_cache_s", "depth", "command", "result": LLAMA_BENCH_FIELDS of its JSON
    record}.
    Raises RuntimeError (non-zero exit, no JSON) with the tail of its stderr."""
    page_cache_s = warm_page_cache(gguf_path)
    cmd = [bench, "-m", str(gguf_path), "-p", "0", "-n", str(new_tokens), "-d", str(depth), "-t", str(threads),
           "-r", "1", "-o", "json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode < 0 and depth > 0:
        print(f"[bench_peer]   llama-bench died of signal {-proc.returncode} at depth {depth}; again at depth 0",
              flush=True)
        depth, cmd[cmd.index("-d") + 1] = 0, "0"
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    try:
        records = json.loads(proc.stdout)
        rec = next(r for r in records if r.get("n_gen") == new_tokens)
    except (json.JSONDecodeError, StopIteration) as e:
        raise RuntimeError(f"llama-bench printed no text-generation JSON record ({e}): {proc.stdout[-400:]}")
    return {"tokens_per_s": float(rec["avg_ts"]), "wall_s": round(wall, 2), "page_cache_s": round(page_cache_s, 2),
            "depth": depth, "command": cmd, "result": {k: rec[k] for k in LLAMA_BENCH_FIELDS if k in rec}}


def run_llama_bench_prefill(bench: str, gguf_path: Path, prompt_len: int, threads: int, timeout: float) -> dict:
    """One llama-bench prompt-processing run (``-p P -n 0``, its own warm-up first, the GGUF read once into the page
    cache before). Returns {"tokens_per_s" (its avg_ts), "wall_s", "page_cache_s", "command", "result"}.
    Raises RuntimeError (non-zero exit, no JSON record for n_prompt = P) with the tail of its output."""
    page_cache_s = warm_page_cache(gguf_path)
    cmd = [bench, "-m", str(gguf_path), "-p", str(prompt_len), "-n", "0", "-t", str(threads), "-r", "1", "-o",
           "json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    try:
        rec = next(r for r in json.loads(proc.stdout) if r.get("n_prompt") == prompt_len and r.get("n_gen") == 0)
    except (json.JSONDecodeError, StopIteration) as e:
        raise RuntimeError(f"llama-bench printed no prompt-processing JSON record ({e}): {proc.stdout[-400:]}")
    return {"tokens_per_s": float(rec["avg_ts"]), "wall_s": round(wall, 2), "page_cache_s": round(page_cache_s, 2),
            "depth": depth, "command": cmd, "result": {k: rec[k] for k in LLAMA_BENCH_FIELDS if k in rec}}


def ft_jax_command() -> list[str]:
    """The ``ft-jax`` console script next to this interpreter, else ``python -m ft_jax``."""
    exe = Path(sys.executable).parent / "ft-jax"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "ft_jax"]


def run_ft_jax(model_dir: Path, policy: str, prompt: list[int], new_tokens: int, cache_fraction: float,
               threads: int, profile: Path, timeout: float, quantize: str | None = None,
               prefill_chunk: int | None = None, bank_memory: str = "map") -> dict:
    """One ``ft-jax generate --json`` run. ``profile``: the --profile file of qstar (if it holds no profile for
    this expert shape, ft-jax runs its quick profile and saves it there, as it does in the user cache directory).
    ``quantize``: the --quantize value (q8_0 / q4_0), None for the checkpoint as stored. ``prefill_chunk``: its
    --prefill-chunk (None: its default). ``bank_memory``: its --bank-memory (map, generate's default, or copy).
    Returns {"tokens_per_s" (decode, compile excluded), "prefill_tokens_per_s", "wall_s", "command", "stats": its
    stats without the per-layer counts, "profile_message"}. Raises RuntimeError (non-zero exit, no JSON)."""
    cmd = ft_jax_command() + ["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt)),
                              "--max-new-tokens", str(new_tokens), "--temperature", "0", "--json", "--policy", policy]
    if policy != "resident":
        cmd += ["--cache-fraction", str(cache_fraction)]
    if policy == "qstar":
        cmd += ["--profile", str(profile)]
    if quantize is not None:
        cmd += ["--quantize", quantize]
    if prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(prefill_chunk)]
    if bank_memory != "map":
        cmd += ["--bank-memory", bank_memory]
    env = {**os.environ, "FT_JAX_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"ft-jax generate --policy {policy} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"ft-jax generate --policy {policy} printed no JSON: {proc.stdout[-400:]}")
    out = json.loads(lines[-1])
    stats = {k: v for k, v in out["stats"].items() if k != "per_layer"}
    decode = stats["decode_tokens_per_s"]  # None when only the first token was generated (--prefill)
    return {"tokens_per_s": None if decode is None else float(decode),
            "prefill_tokens_per_s": float(stats["prefill_tokens_per_s"]), "wall_s": round(wall, 2), "command": cmd,
            "stats": stats, "profile_message": out.get("profile_message")}


class NumpyRead:
    """Read bandwidth of np.add.reduce over one float32 array of ``nbytes`` (filled, so its pages are committed),
    on 1 thread and on ``threads`` threads (each reducing a contiguous 1/threads slice)."""

    def __init__(self, nbytes: int, threads: int):
        self.buf = np.ones(nbytes // 4, np.float32)  # f32[n]
        self.threads = threads
        self.parts = np.array_split(self.buf, threads)
        self.pool = ThreadPoolExecutor(threads)

    def gbps(self, threads: int, repeats: int) -> list[float]:
        """GB/s (1e9 bytes/s) of ``repeats`` passes over the array on 1 or self.threads threads, after one untimed
        pass (the first pass after other work runs at about half speed here)."""
        rates = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            if threads == 1:
                np.add.reduce(self.buf, axis=None)
            else:
                list(self.pool.map(lambda a: np.add.reduce(a, axis=None), self.parts))
            if i:
                rates.append(self.buf.nbytes / (time.perf_counter() - t0) / 1e9)
        return rates

    def close(self) -> None:
        self.pool.shutdown()
        del self.buf, self.parts


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(samples: dict[str, list[float]], numpy_rates: dict[str, list[float]], bytes_per_token: dict[str, int],
              threads: int, reference: dict[str, str], per_round: bool = True) -> dict:
    """Per-program figures from the per-round tokens/s (``samples``, by program label) and the per-round numpy
    GB/s medians (``numpy_rates``, keys "1" and str(threads)); programs with no sample are left out.

    bytes_per_token: weight bytes one token reads, by label (each side's own count). reference: the llama.cpp
    label each label's ratios divide by (llama.cpp of the same weight type).
    Ratios: of medians over the rounds; "best" ones divide the maxima (steadier when other processes share the
    cores and the memory bus, as in scripts/bench_ffi.py); per-round ones (only with ``per_round``: the lists
    are aligned by round) divide values of the same round."""
    np_all, np_one = numpy_rates.get(str(threads)), numpy_rates.get("1")
    out = {}
    for name, tps in samples.items():
        if not tps:
            continue
        llama = samples.get(reference[name])
        gbps = [t * bytes_per_token[name] / 1e9 for t in tps]
        row = {"tokens_per_s": _spread(tps), "tokens_per_s_per_round": tps, "weight_gbps": _spread(gbps),
               "weight_bytes_per_token": bytes_per_token[name], "reference": reference[name]}
        if llama:
            row["ratio_to_llama_cpp"] = statistics.median(tps) / statistics.median(llama)
            row["ratio_to_llama_cpp_best"] = max(tps) / max(llama)
            if per_round:
                row["ratio_to_llama_cpp_per_round"] = _spread([a / b for a, b in zip(tps, llama)])
        if np_all:
            row["gbps_over_numpy_read"] = statistics.median(gbps) / statistics.median(np_all)
            row["gbps_over_numpy_read_best"] = max(gbps) / max(np_all)
        if np_one:
            row["gbps_over_numpy_read_1_thread"] = statistics.median(gbps) / statistics.median(np_one)
        out[name] = row
    return out


def quiet_summary(runs: dict[str, list[dict]], bytes_per_token: dict[str, int], threads: int,
                  reference: dict[str, str]) -> dict:
    """summarize() over only the runs during which other processes used at most QUIET_CORES cores (CpuMeter):
    on a shared machine the runs that had the cores to themselves, whatever round they fell in."""
    def quiet(r):
        return r.get("other_cores") is not None and r["other_cores"] <= QUIET_CORES

    samples = {p: [r["tokens_per_s"] for r in rs if quiet(r)] for p, rs in runs.items() if p != "numpy"}
    numpy_rates = {k: [statistics.median(r[f"gbps_{k}_thread" + ("s" if k != "1" else "")])
                       for r in runs.get("numpy", []) if quiet(r)] for k in ("1", str(threads))}
    return {"max_other_cores": QUIET_CORES,
            "runs": {p: len(v) for p, v in samples.items()} | {"numpy": len(numpy_rates["1"])},
            "programs": summarize(samples, numpy_rates, bytes_per_token, threads, reference, per_round=False),
            "numpy_read_gbps": {k: _spread(v) for k, v in numpy_rates.items() if v}}


def program_title(label: str) -> str:
    """Table title of a program label ("llama.cpp:q8_0" -> "llama.cpp (q8_0 GGUF)", "qstar" -> "ft_jax qstar")."""
    program, _, quant = label.partition(":")
    quant = quant or "bf16"
    if program == "llama.cpp":
        return f"llama.cpp ({quant} GGUF)"
    if FT_JAX_QUANTIZE.get(quant) is None:
        return f"ft_jax {program}" + ("" if quant == "bf16" else f" ({quant} as stored)")
    return f"ft_jax {program} --quantize {quant}"


def format_table(result: dict) -> str:
    """The human-readable table (stderr) of a bench_peer result."""
    s, progs, threads = result["settings"], result["programs"], result["settings"]["threads"]
    load = result["load_average"]
    lines = [f"bench_peer: {s['rounds']} rounds x {s['new_tokens']} decoded tokens, {threads} threads; load average "
             f"(1/5/15 min) before {load['before']}, after {load['after']}",
             "weight bytes read per token (GB): " + ", ".join(
                 f"{name} {b / 1e9:.3f}" for name, b in result["weight_bytes_per_token"].items())
             + "".join(f"; {name} by its own stats {b / 1e9:.3f}"
                       for name, b in result.get("weight_bytes_per_token_reported_by_ft_jax", {}).items()),
             f"{'program':<30} {'tokens/s':>8} {'[min-max]':<15} {'GB/s':>6} {'[min-max]':<13} "
             f"{'x llama.cpp':>11} {'[per round]':<13} {'best':>5} {'GB/s / numpy ' + str(threads) + 't':>15} "
             f"{'best':>5}"]
    labels = {label: program_title(label) for label in progs}
    for name, row in progs.items():
        t, g = row["tokens_per_s"], row["weight_gbps"]
        ratio = f"{row['ratio_to_llama_cpp']:.2f}" if "ratio_to_llama_cpp" in row else "-"
        per = row.get("ratio_to_llama_cpp_per_round")
        per = f"[{per['min']:.2f}-{per['max']:.2f}]" if per else ""
        best = f"{row['ratio_to_llama_cpp_best']:.2f}" if "ratio_to_llama_cpp_best" in row else "-"
        npr = f"{row['gbps_over_numpy_read']:.2f}" if "gbps_over_numpy_read" in row else "-"
        npb = f"{row['gbps_over_numpy_read_best']:.2f}" if "gbps_over_numpy_read_best" in row else "-"
        lines.append(f"{labels.get(name, name):<30} {t['median']:8.2f} {'[%.2f-%.2f]' % (t['min'], t['max']):<15} "
                     f"{g['median']:6.2f} {'[%.2f-%.2f]' % (g['min'], g['max']):<13} {ratio:>11} {per:<13} "
                     f"{best:>5} {npr:>15} {npb:>5}")
    for key, rates in result.get("numpy_read_gbps", {}).items():
        sp = rates["round_medians"]
        label = f"numpy read, {key} thread" + ("s" if key != "1" else "")
        lines.append(f"{label:<30} {'':>8} {'':<15} {sp['median']:6.2f} {'[%.2f-%.2f]' % (sp['min'], sp['max']):<13}")
    other = {name: [r["other_cores"] for r in runs if r.get("other_cores") is not None]
             for name, runs in result["runs"].items()}
    worst = max((max(v) for v in other.values() if v), default=None)
    if worst is not None:
        lines.append("CPU used by other processes during the runs (cores, max per program): "
                     + ", ".join(f"{name} {max(v):.2f}" for name, v in other.items() if v))
        if worst > 0.25:
            lines.append(f"WARNING: other processes used up to {worst:.2f} of the {result['machine']['cores']} cores "
                         "during some runs: the figures are not steady (llama.cpp's spinning thread barriers suffer "
                         "most when cores are shared); rerun on a quiet machine to compare")
    q = result.get("quiet")
    if q and q["programs"]:
        lines.append(f"quiet runs only (other processes <= {q['max_other_cores']} core meanwhile), any round:")
        for name, row in q["programs"].items():
            t, g = row["tokens_per_s"], row["weight_gbps"]
            ratio = f"{row['ratio_to_llama_cpp']:.2f}" if "ratio_to_llama_cpp" in row else "-"
            npr = f"{row['gbps_over_numpy_read']:.2f}" if "gbps_over_numpy_read" in row else "-"
            spread = "[%.2f-%.2f]" % (t["min"], t["max"])
            lines.append(f"  {labels.get(name, name):<28} {t['median']:8.2f} {spread:<15} {g['median']:6.2f} "
                         f"{'(%d runs)' % q['runs'][name]:<13} {ratio:>11} {'':<13} {'':>5} {npr:>15}")
        for key, sp in q["numpy_read_gbps"].items():
            label = f"numpy read, {key} thread" + ("s" if key != "1" else "")
            lines.append(f"  {label:<28} {'':>8} {'':<15} {sp['median']:6.2f} {'(%d runs)' % q['runs']['numpy']:<13}")
    lines.append("x llama.cpp: ratio of median tokens/s to llama.cpp on the same weight type (per round: same-round "
                 f"ratios); GB/s / numpy: median weight GB/s over the median {threads}-thread numpy read; best: ratio "
                 "of the maxima")
    return "\n".join(line.rstrip() for line in lines)


def parse_prefill_lengths(text: str, max_positions: int) -> list[int]:
    """The --prefill prompt lengths: distinct positive integers below max_positions (ft-jax also needs the position of
    the one generated token). Raises ValueError naming the flag and the bad item."""
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prefill {text!r}: give comma-separated prompt lengths, e.g. 512,2048,8192") from None
    if not lengths or len(set(lengths)) != len(lengths) or min(lengths) < 1:
        raise ValueError(f"--prefill {text!r}: give distinct prompt lengths >= 1")
    if max(lengths) >= max_positions:
        raise ValueError(f"--prefill {text!r}: a prompt of {max(lengths)} tokens needs --max-positions above it "
                         f"(the model has {max_positions})")
    return lengths


def summarize_prefill(samples: dict[int, dict[str, list[float]]], reference: dict[str, str]) -> dict:
    """Per prompt length and program: tokens/s spread, ratio to llama.cpp of the same weight type (medians; per
    round over aligned rounds) and, for ft_jax programs, the median over its median at the shortest length."""
    out = {}
    shortest = min(samples)
    for P, progs in samples.items():
        rows = {}
        for name, tps in progs.items():
            if not tps:
                continue
            row = {"tokens_per_s": _spread(tps), "tokens_per_s_per_round": tps}
            llama = progs.get(reference[name])
            if llama and name != reference[name]:
                row["ratio_to_llama_cpp"] = statistics.median(tps) / statistics.median(llama)
                if len(llama) == len(tps):
                    row["ratio_to_llama_cpp_per_round"] = _spread([a / b for a, b in zip(tps, llama)])
            base = samples[shortest].get(name)
            if base and P != shortest:
                row[f"rate_over_rate_at_{shortest}"] = statistics.median(tps) / statistics.median(base)
            rows[name] = row
        out[str(P)] = rows
    return out


def format_prefill_table(result: dict) -> str:
    """The human-readable table (stderr) of a --prefill result."""
    s, load = result["settings"], result["load_average"]
    lines = [f"bench_peer --prefill: {s['rounds']} rounds, {s['threads']} threads, prompt lengths "
             f"{s['prefill']}; load average before {load['before']}, after {load['after']}",
             f"{'prompt':>7} {'program':<30} {'tokens/s':>9} {'[min-max]':<17} {'x llama.cpp':>11} "
             f"{'[per round]':<13} {'x own rate at shortest':>22}"]
    for P, rows in result["prefill"].items():
        for name, row in rows.items():
            t = row["tokens_per_s"]
            ratio = f"{row['ratio_to_llama_cpp']:.2f}" if "ratio_to_llama_cpp" in row else "-"
            per = row.get("ratio_to_llama_cpp_per_round")
            per = f"[{per['min']:.2f}-{per['max']:.2f}]" if per else ""
            own = next((f"{v:.2f}" for k, v in row.items() if k.startswith("rate_over_rate_at_")), "-")
            lines.append(f"{P:>7} {program_title(name):<30} {t['median']:9.2f} "
                         f"{'[%.2f-%.2f]' % (t['min'], t['max']):<17} {ratio:>11} {per:<13} {own:>22}")
    other = [r["other_cores"] for runs in result["runs"].values() for r in runs if r.get("other_cores") is not None]
    if other and max(other) > QUIET_CORES:
        lines.append(f"WARNING: other processes used up to {max(other):.2f} of the {result['machine']['cores']} "
                     "cores during some runs: the figures are not steady")
    return "\n".join(line.rstrip() for line in lines)


def run_prefill(args, config: dict, variants: list, build: dict | None, ggufs: dict, model_dir: Path,
                model_record: dict, reference: dict, load_start: list) -> int:
    """The --prefill benchmark (module docstring): every length in every round, programs rotated per round."""
    lengths = parse_prefill_lengths(args.prefill, config["max_position_embeddings"])
    rounds = args.rounds or (2 if args.quick else 3)
    labels = [label for label, prog, _ in variants if prog != "numpy"]
    by_label = {label: (prog, quant) for label, prog, quant in variants}
    samples = {P: {label: [] for label in labels} for P in lengths}
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    commands: dict[str, list[str]] = {}
    failed: dict[str, str] = {}
    load_before, t_start = _loadavg(), time.perf_counter()
    for r in range(rounds):
        order = [label for label in labels[r % len(labels):] + labels[:r % len(labels)]]
        for P in lengths:
            prompt = prompt_ids(config["vocab_size"], P, args.seed)
            for label in order:
                if label in failed:
                    continue
                prog, quant = by_label[label]
                _log(f"round {r + 1}/{rounds}: prefill {P} tokens, {label}")
                load_at_start, meter = _loadavg(), CpuMeter()
                try:
                    if prog == "llama.cpp":
                        run = run_llama_bench_prefill(build["llama_bench"], ggufs[quant], P, args.threads,
                                                      args.timeout)
                    else:
                        run = run_ft_jax(model_dir, prog, prompt, 1, args.cache_fraction, args.threads,
                                         args.cache_dir.expanduser() / "ft_jax_profiles.json", args.timeout,
                                         FT_JAX_QUANTIZE[quant], args.prefill_chunk, args.bank_memory)
                        run["tokens_per_s"] = run.pop("prefill_tokens_per_s")
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    failed[label] = str(e)
                    _log(f"  FAILED, left out of the later runs: {e}")
                    continue
                run.update(meter.stop(), load_average_at_start=load_at_start, prompt_len=P, round=r)
                samples[P][label].append(run["tokens_per_s"])
                commands[f"{label}@{P}"] = run.pop("command")
                runs[label].append(run)
                _log(f"  {run['tokens_per_s']:.2f} prompt tokens/s (wall {run['wall_s']:.1f} s, other processes "
                     f"used {run['other_cores']} cores meanwhile, load average {load_at_start})")
    result = {
        "settings": {"rounds": rounds, "prefill": lengths, "prefill_chunk": args.prefill_chunk,
                     "threads": args.threads, "cache_fraction": args.cache_fraction,
                     "bank_memory": args.bank_memory, "programs": labels, "seed": args.seed},
        "model": {"config": config, "dir": str(model_dir), "gguf": {q: str(p) for q, p in ggufs.items()},
                  "created": {k: v for k, v in model_record.items() if k != "config"}},
        "load_average": {"at_start": load_start, "before": load_before, "after": _loadavg()},
        "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        "machine": _machine(), "versions": _versions(build), "llama_cpp_build": build,
        "prefill": summarize_prefill(samples, reference),
        "commands": commands, "failed": failed, "runs": runs,
    }
    return _report(args, result, format_prefill_table(result), failed)


def _report(args, result: dict, table: str, failed: dict) -> int:
    """The table and the failed programs on stderr, the JSON to --json-out / stdout; exit status 1 if any failed."""
    print(table, file=sys.stderr)
    for label, error in failed.items():
        print(f"bench_peer: {label} FAILED: {error}", file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
        _log(f"wrote {args.json_out}")
    if args.json:
        print(text)
    return 1 if failed else 0


def _versions(build: dict | None) -> dict:
    import jax
    import jaxlib

    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    try:
        from ft_jax import _ffi
        isa = _ffi.kernel_isa()
    except ImportError:
        isa = None
    return {"python": platform.python_version(), "numpy": np.__version__, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "ml_dtypes": ver("ml_dtypes"), "gguf": ver("gguf"),
            "ft_jax_git_commit": git.stdout.strip() or None, "ft_jax_tree_dirty": bool(dirty.stdout.strip()),
            "ft_jax_kernel_isa": isa,
            "llama_cpp_python_sdist": build and build["llama_cpp_python_version"],
            "llama_cpp_commit": build and build["llama_cpp_commit"]}


def _machine() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "memory_bytes": mem,
            "platform": platform.platform()}


def plan_variants(programs: list[str], quants: list[str]) -> tuple[list[tuple[str, str, str]], list[str]]:
    """([(label, program, quant)] of every program on every weight type it has, numpy once at the end of the
    list), and the skipped "program:quant" pairs (ft_jax has no mxfp4_moe)."""
    variants, skipped = [], []
    for quant in quants:
        for prog in programs:
            if prog == "numpy":
                continue
            if prog in FT_JAX_POLICIES and quant not in FT_JAX_QUANTIZE:
                skipped.append(f"{prog}:{quant}")
                continue
            variants.append((variant_label(prog, quant), prog, quant))
    if "numpy" in programs:
        variants.append(("numpy", "numpy", "bf16"))
    return variants, skipped


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    new_tokens = args.new_tokens or (12 if args.quick else 32)
    programs = [p.strip() for p in args.programs.split(",") if p.strip()]
    bad = [p for p in programs if p not in ALL_PROGRAMS]
    if bad or not programs:
        print(f"bench_peer: error: --programs {args.programs!r}: unknown {bad}; choose from {ALL_PROGRAMS}",
              file=sys.stderr)
        return 2
    try:
        config = synthetic_checkpoint.config_from_args(args)
    except ValueError as e:
        print(f"bench_peer: error: {e}", file=sys.stderr)
        return 2
    gpt_oss = config["model_type"] == "gpt_oss"
    quants = [q.strip() for q in (args.quant or ("mxfp4" if gpt_oss else "bf16")).split(",") if q.strip()]
    allowed = ("mxfp4",) if gpt_oss else tuple(q for q in QUANT_CHOICES if q != "mxfp4")
    bad = [q for q in quants if q not in allowed]
    if bad or not quants or len(set(quants)) != len(quants):
        print(f"bench_peer: error: --quant {args.quant!r}: give distinct types from {allowed} for a "
              f"{config['model_type']} model" + (f" (not {bad})" if bad else ""), file=sys.stderr)
        return 2
    if args.numpy_gib < 1:
        print(f"bench_peer: error: --numpy-gib must be >= 1 (far above the last-level cache), got {args.numpy_gib}",
              file=sys.stderr)
        return 2
    if args.prompt_len + new_tokens > config["max_position_embeddings"]:
        print(f"bench_peer: error: --prompt-len {args.prompt_len} + --new-tokens {new_tokens} exceeds "
              f"--max-positions {config['max_position_embeddings']}", file=sys.stderr)
        return 2
    if args.prefill:
        try:
            parse_prefill_lengths(args.prefill, config["max_position_embeddings"])
        except ValueError as e:
            print(f"bench_peer: error: {e}", file=sys.stderr)
            return 2
        programs = [p for p in programs if p != "numpy"]
    variants, skipped = plan_variants(programs, quants)
    for pair in skipped:
        _log(f"skipping {pair}: ft_jax has no such quantizer (it runs MXFP4 checkpoints as stored)")
    if not variants:
        print("bench_peer: error: nothing to run for these --programs and --quant", file=sys.stderr)
        return 2
    if any(FT_JAX_QUANTIZE.get(q) for _, p, q in variants if p in FT_JAX_POLICIES) and not ft_jax_has_quantize():
        print("bench_peer: error: this ft_jax's `ft-jax generate` has no --quantize flag; run the quantized types "
              "with --programs llama.cpp (or only --quant bf16 for ft_jax)", file=sys.stderr)
        return 2
    cache_dir = args.cache_dir.expanduser()
    load_start = _loadavg()

    build = None
    if "llama.cpp" in programs:
        targets = ("llama-bench", "llama-quantize") if set(quants) & set(LLAMA_QUANTIZE) else ("llama-bench",)
        try:
            build = llama_cpp_build.ensure_llama_cpp(cache_dir, args.llama_cpp_python_version, targets=targets)
        except llama_cpp_build.BuildError as e:
            print(f"bench_peer: error: {e}", file=sys.stderr)
            return 1
    model_dir, gguf_path, model_record = ensure_models(cache_dir, config, args.seed)
    ggufs, quantized_records = {"mxfp4" if gpt_oss else "bf16": gguf_path}, {}
    if "llama.cpp" in programs:
        for quant in quants:
            if quant not in ggufs:
                try:
                    ggufs[quant], quantized_records[quant] = ensure_quantized_gguf(
                        build["binaries"]["llama-quantize"], gguf_path, quant, args.threads)
                except RuntimeError as e:
                    print(f"bench_peer: error: {e}", file=sys.stderr)
                    return 1
    bytes_per_token, bytes_detail, reference = {}, {}, {}
    for label, prog, quant in variants:
        if prog == "numpy":
            continue
        if prog == "llama.cpp":
            detail = gguf_weight_bytes_per_token(ggufs[quant], config["num_experts_per_tok"],
                                                 config["num_local_experts"])
        else:
            fmt = weight_formats.by_name(FT_JAX_QUANTIZE[quant] or "bf16")
            detail = synthetic_checkpoint.weight_bytes_per_token(config, fmt)
        bytes_per_token[label], bytes_detail[label] = detail["total"], detail
        reference[label] = variant_label("llama.cpp", quant)
    if args.prefill:
        return run_prefill(args, config, variants, build, ggufs, model_dir, model_record, reference, load_start)
    prompt = prompt_ids(config["vocab_size"], args.prompt_len, args.seed)
    numpy_read = NumpyRead(int(args.numpy_gib * GiB), args.threads) if "numpy" in programs else None

    labels = [label for label, _, _ in variants]
    by_label = {label: (prog, quant) for label, prog, quant in variants}
    samples: dict[str, list[float]] = {label: [] for label in labels if label != "numpy"}
    numpy_rates: dict[str, list[float]] = {"1": [], str(args.threads): []} if numpy_read else {}
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    commands: dict[str, list[str]] = {}
    failed: dict[str, str] = {}  # label -> the error of its failed run (it is left out of the later rounds)
    round_log = []
    load_before = _loadavg()
    t_start = time.perf_counter()
    for r in range(rounds):
        order = [label for label in labels[r % len(labels):] + labels[:r % len(labels)] if label not in failed]
        round_log.append({"round": r, "order": order, "load_average_at_start": _loadavg()})
        for label in order:
            prog, quant = by_label[label]
            _log(f"round {r + 1}/{rounds}: {label}")
            load_at_start = _loadavg()
            meter = CpuMeter()
            if prog == "numpy":
                one = numpy_read.gbps(1, args.numpy_repeats)
                many = numpy_read.gbps(args.threads, args.numpy_repeats)
                numpy_rates["1"].append(statistics.median(one))
                numpy_rates[str(args.threads)].append(statistics.median(many))
                runs["numpy"].append({"gbps_1_thread": one, f"gbps_{args.threads}_threads": many, **meter.stop(),
                                      "load_average_at_start": load_at_start})
                _log(f"  numpy read {statistics.median(one):.2f} GB/s (1 thread), "
                     f"{statistics.median(many):.2f} GB/s ({args.threads} threads)")
                continue
            try:
                if prog == "llama.cpp":
                    run = run_llama_bench(build["llama_bench"], ggufs[quant], new_tokens, args.prompt_len,
                                          args.threads, args.timeout)
                else:
                    run = run_ft_jax(model_dir, prog, prompt, new_tokens, args.cache_fraction, args.threads,
                                     cache_dir / "ft_jax_profiles.json", args.timeout, FT_JAX_QUANTIZE[quant],
                                     bank_memory=args.bank_memory)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                failed[label] = str(e)
                _log(f"  FAILED, left out of the later rounds: {e}")
                continue
            run.update(meter.stop())
            run["load_average_at_start"] = load_at_start
            samples[label].append(run["tokens_per_s"])
            commands[label] = run.pop("command")  # the same in every round
            runs[label].append(run)
            _log(f"  {run['tokens_per_s']:.2f} tokens/s (wall {run['wall_s']:.1f} s, other processes used "
                 f"{run['other_cores']} cores meanwhile, load average {load_at_start})")
    load_after = _loadavg()
    if numpy_read:
        numpy_read.close()
    # ft_jax's own count (its stats' weight_bytes_per_token, newer ft_jax only), next to bench_peer's
    reported = {label: statistics.median(vals) for label, rs in runs.items()
                if (vals := [r["stats"]["weight_bytes_per_token"] for r in rs
                             if (r.get("stats") or {}).get("weight_bytes_per_token") is not None])}

    result = {
        "settings": {"rounds": rounds, "new_tokens": new_tokens, "prompt_len": args.prompt_len, "prompt_ids": prompt,
                     "threads": args.threads, "cache_fraction": args.cache_fraction, "quick": args.quick,
                     "bank_memory": args.bank_memory,
                     "programs": programs, "quant": quants, "skipped": skipped,
                     "numpy_read_bytes": int(args.numpy_gib * GiB), "numpy_repeats": args.numpy_repeats,
                     "seed": args.seed},
        "model": {"config": config, "dir": str(model_dir), "gguf": {q: str(p) for q, p in ggufs.items()},
                  "created": {k: v for k, v in model_record.items() if k != "config"},
                  "quantized_ggufs": quantized_records},
        "weight_bytes_per_token": bytes_per_token,
        "weight_bytes_per_token_detail": bytes_detail,
        "weight_bytes_per_token_reported_by_ft_jax": reported,
        "threads": {"llama.cpp": f"llama-bench -t {args.threads}",
                    "ft_jax": f"FT_JAX_NUM_THREADS={args.threads} (host kernels); XLA:CPU its default",
                    "numpy": f"1 and {args.threads}"},
        "load_average": {"at_start": load_start, "before": load_before, "after": load_after},
        "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        "machine": _machine(),
        "versions": _versions(build),
        "llama_cpp_build": build,
        "programs": summarize(samples, numpy_rates, bytes_per_token, args.threads, reference),
        "quiet": quiet_summary(runs, bytes_per_token, args.threads, reference),
        "numpy_read_gbps": {k: {"round_medians": _spread(v), "per_round": v} for k, v in numpy_rates.items() if v},
        "commands": commands,
        "failed": failed,
        "rounds": round_log,
        "runs": runs,
    }
    return _report(args, result, format_table(result), failed)


if __name__ == "__main__":
    sys.exit(main())
