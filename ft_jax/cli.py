"""The `ft-jax` command line: `generate` (the main job) and `profile` (bandwidth profile for the q* policy).

    ft-jax generate --prompt "ROMEO:"                  # the bundled tiny Shakespeare MoE
    ft-jax generate --model ~/models/Mixtral-8x7B --prompt "def fib(n):" --cache-fraction 0.25
    ft-jax profile --model ~/models/Mixtral-8x7B

Errors in what the user gave (paths, configs, prompts, budgets) print one line and exit with status 2; --verbose
adds the traceback.
"""

from __future__ import annotations

import argparse
import fractions
import importlib.resources
import json
import os
import math
import re
import sys
import traceback
import warnings
from typing import Sequence

BUNDLED_MODEL = "tiny_shakespeare"
POLICY_HELP = ("qstar (split misses by the measured bandwidths: default; qstar:FRAC fixes the fetch fraction), fetch-all (classic LRU offload: every miss "
               "is copied into a slot), host-all (every miss computed on the CPU; the cache never changes), "
               "fixed-cap:K (fetch at most K misses per layer), resident (every expert on the device)")
DEFAULT_CACHE_FRACTION = 0.5
DEFAULT_NEW_TOKENS = 200


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (`PROG: error: ...`, exit status 2) instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def bundled_model_path() -> str:
    """Folder of the small Mixtral-architecture model shipped in the package (ft_jax/bundled/tiny_shakespeare)."""
    return str(importlib.resources.files("ft_jax") / "bundled" / BUNDLED_MODEL)


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """Parse a byte count with an optional unit: "512MiB", "2GB", "1.5g", "4096".

    KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB (and K/M/G) powers of 1024.
    Raises:
        argparse.ArgumentTypeError: not a number with a known unit.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (examples: 4096, 512MiB, 2GB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in re.split(r"[,\s]+", text.strip()) if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"--temperature must be a finite number >= 0, got {text!r}")
    return value


SEED_MAX = 2**32 - 1  # jax.random.key keeps 32 bits of a seed without jax_enable_x64: larger seeds would collide
POLICY_CAP_MAX = 2**31 - 1  # the fetch budget is an int32 in the decode step


def _seed(text: str) -> int:
    """--seed: an integer in [0, 2^32 - 1]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {SEED_MAX}], got {text!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {SEED_MAX}] (32 bits), got {text}")
    return value


def _policy_name(text: str) -> str:
    """--policy: checked with parse_policy (and a fixed-cap K <= 2^31 - 1) while parsing; returns the text."""
    from ft_jax.offload.policy import parse_policy

    try:
        policy = parse_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if policy.cap is not None and policy.cap > POLICY_CAP_MAX:
        raise argparse.ArgumentTypeError(f"the cap in {text!r} must be at most {POLICY_CAP_MAX} (a count of "
                                         "misses per layer)")
    return text


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"--cache-fraction must be in (0, 1], got {text}")
    return value


def _dtype(text: str) -> str:
    """--dtype: bf16/bfloat16 -> "bfloat16", f32/float32 -> "float32" (any case)."""
    from ft_jax.tools.bandwidth import dtype_name

    try:
        return dtype_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bf16, bfloat16, f32 or float32, got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _default_dtype(cfg) -> str:
    """Expert and weight dtype when --dtype is not given: float32 for float32 checkpoints, else bfloat16."""
    return "float32" if str(cfg.dtype) == "float32" else "bfloat16"


PROFILE_EXAMPLES = """examples:
  ft-jax profile                                   # the bundled model's expert size (full profile, ~10 s)
  ft-jax profile --quick --no-save                 # a few seconds, print only
  ft-jax profile --model ~/models/Mixtral-8x7B-v0.1
  ft-jax profile --hidden-size 4096 --intermediate-size 14336 --dtype bf16 --json

The profile is stored in the user cache directory (see --profile) and `ft-jax generate --policy qstar` uses it."""


def build_parser() -> argparse.ArgumentParser:
    """The `ft-jax` argument parser with its `generate` and `profile` subcommands."""
    from ft_jax.config import SUPPORTED_ARCHITECTURES  # standard library only: cheap before the heavy imports
    parser = _Parser(
        prog="ft-jax", description="Mixture-of-Experts decoding in JAX with the experts in host memory: a device "
        "slot cache plus host expert GEMVs, split by the bandwidth-balanced q* policy.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text (default model: the bundled tiny Shakespeare MoE)",
                         description="Generate text from a Hugging Face MoE checkpoint folder (config.json + "
                         "safetensors) or the bundled model, streaming tokens, then print offload statistics.")
    gen.add_argument("--model", metavar="PATH", help="Hugging Face model folder (default: the bundled model); "
                     f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text; repeat for several prompts decoded together as one batch "
                          "(default: a single newline)")
    src.add_argument("--prompt-ids", action="append", type=_prompt_ids, metavar="IDS",
                     help="prompt as comma-separated token ids (no tokenizer needed); repeatable")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help=f"tokens to generate per prompt (default {DEFAULT_NEW_TOKENS}, or what the model's context "
                          "leaves after the prompt)")
    gen.add_argument("--temperature", type=_temperature, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    gen.add_argument("--seed", type=_seed, default=0,
                     help=f"sampling seed, an integer in [0, {SEED_MAX}] (32 bits; default 0)")
    gen.add_argument("--dtype", type=_dtype, default=None,
                     help="bf16/bfloat16 or f32/float32: dtype of the dense weights, the activations and the expert "
                          "host banks (default: float32 for float32 checkpoints, else bfloat16)")
    budget = gen.add_mutually_exclusive_group()
    budget.add_argument("--cache-slots", type=int, metavar="S", help="device expert slots shared by all layers")
    budget.add_argument("--cache-fraction", type=_fraction, metavar="F",
                        help=f"slots as a fraction of all experts (default {DEFAULT_CACHE_FRACTION})")
    budget.add_argument("--device-memory", type=parse_bytes, metavar="BYTES",
                        help="device memory for expert slots, e.g. 8GiB (slots = BYTES / bytes per expert)")
    gen.add_argument("--policy", type=_policy_name, default="qstar", metavar="POLICY", help=POLICY_HELP)
    gen.add_argument("--profile", metavar="PATH",
                     help="bandwidth profile file for qstar (default: the user cache directory; see `ft-jax profile`)")
    gen.add_argument("--no-measure", action="store_true",
                     help="qstar without a stored profile: do not run a quick profile, fall back to fixed-cap:1")
    gen.add_argument("--json", action="store_true", help="print one JSON object (ids, text, statistics) instead")
    gen.add_argument("--no-compile-cache", action="store_true",
                     help="do not use JAX's persistent compilation cache (default: compiled steps are kept in "
                          "compile/ under the user cache directory, e.g. ~/.cache/ft_jax, so the next run with the "
                          "same model and shapes loads them instead of compiling)")
    gen.add_argument("--verbose", action="store_true", help="show tracebacks")

    prof = sub.add_parser(
        "profile", help="measure slot-fill (BP) and host GEMV (BH) bandwidths for q*", epilog=PROFILE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure BP (slot fill), BH (host expert GEMV) and the pair while both run, with the production "
        "FFI handlers at a model's expert size; print the q* fetch fraction and store the profile for generate.")
    prof.add_argument("--model", metavar="PATH", help="model folder whose config.json gives H, I and the dtype "
                                                      "(default: the bundled model)")
    prof.add_argument("--hidden-size", type=_positive_int, metavar="H", help="expert hidden size (instead of --model)")
    prof.add_argument("--intermediate-size", type=_positive_int, metavar="I",
                      help="expert intermediate size (with --hidden-size)")
    prof.add_argument("--dtype", type=_dtype, help="bf16/bfloat16 or f32/float32 (default: as generate would load "
                                                   "the model; bfloat16 with --hidden-size)")
    prof.add_argument("--quick", action="store_true", help="quick profile (a few seconds)")
    prof.add_argument("--repeats", type=_positive_int, help="timed windows per bandwidth (default 7, 3 with --quick)")
    prof.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    prof.add_argument("--profile", metavar="PATH", help="profile store (default: profiles.json in the user cache "
                                                        "directory, e.g. ~/.cache/ft_jax)")
    prof.add_argument("--no-save", action="store_true", help="do not store the profile")
    prof.add_argument("--verbose", action="store_true", help="show tracebacks")
    return parser


def _model_config(args: argparse.Namespace):
    """(folder, MoEConfig) for args.model (or the bundled model). Raises ConfigError (bad path or config.json)."""
    from ft_jax.config import load_config

    path = args.model or bundled_model_path()
    return path, load_config(path)


def _num_slots(args: argparse.Namespace, checkpoint) -> int:
    cfg = checkpoint.config
    total = checkpoint.gate_up_bank.num_rows
    expert_bytes = sum(bank.row_bytes for bank in checkpoint.expert_banks.values())  # weights (+ biases)
    if args.cache_slots is not None:
        slots = args.cache_slots
        if slots < 1:
            raise UsageError(f"--cache-slots must be >= 1, got {slots}")
    elif args.device_memory is not None:
        slots = args.device_memory // expert_bytes
        if slots < 1:
            raise UsageError(f"--device-memory {args.device_memory} bytes is smaller than one expert slot "
                             f"({expert_bytes} bytes: gate/up/down of one expert of {cfg.architecture})")
    else:
        fraction = args.cache_fraction if args.cache_fraction is not None else DEFAULT_CACHE_FRACTION
        slots = max(1, round(fraction * total))
    return min(slots, total)


def _policy(args: argparse.Namespace, checkpoint):
    """The decode Policy; for qstar, its fraction from the stored (or a quick) bandwidth profile."""
    from ft_jax.offload.policy import Policy, parse_policy
    from ft_jax.tools import bandwidth

    try:
        policy = parse_policy(args.policy)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if policy.kind != "qstar" or policy.frac is not None:
        return policy, None
    cfg, bank = checkpoint.config, checkpoint.gate_up_bank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the message is printed below
        profile, message = bandwidth.get_or_measure_profile(
            cfg.hidden_size, cfg.moe_intermediate_size, bank.dtype, allow_measure=not args.no_measure,
            path=args.profile, progress=not args.json)
    if profile is None:
        return Policy("fixed-cap", cap=1), message
    return policy.with_frac(profile.fraction()), message


def _slots_row(stats: dict) -> str:
    size = f"{stats['num_slots']} x {stats['expert_bytes'] / 2**20:.2f} MiB"
    if stats["policy"] == "host-all":
        return "none used (host-all computes every miss on the CPU from the host banks)"
    if stats["policy"] == "resident":
        return f"{size} (resident: every expert on the device; the cache budget does not apply)"
    return size


def compile_cache_dir() -> str:
    """compile/ in the user cache directory (``$XDG_CACHE_HOME/ft_jax`` or ``~/.cache/ft_jax``): where the CLI keeps
    JAX's persistent compilation cache."""
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("ft_jax", appauthor=False), "compile")


def enable_compile_cache(path: str) -> None:
    """Turn on JAX's persistent compilation cache in ``path`` for every executable (even ones that compile in under a
    second), before the first compilation of the process. Raises OSError if the folder cannot be created."""
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _stats_table(stats: dict) -> str:
    def num(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    def mib(v):
        return "-" if v is None else f"{v / 2**20:.2f} MiB"

    rows = [
        ("policy", stats["policy"]),
        ("expert slots", _slots_row(stats)),
        ("time to first token", f"{stats['ttft_s'] * 1e3:.1f} ms (compilation included)"),
        ("prefill", f"{stats['prompt_tokens']} tokens, {num(stats['prefill_tokens_per_s'], '{:.1f}')} tokens/s"
                    " (compilation excluded)"),
        ("decode", f"{stats['decode_tokens']} tokens after the first, {stats['decode_steps']} steps, "
                   f"{num(stats['decode_tokens_per_s'], '{:.1f}')} tokens/s (compilation excluded)"),
        ("compile time", f"{stats['compile_s']:.2f} s ({stats['prefill_compiles'] + stats['decode_compiles']} steps "
                         f"built: {stats['xla_compiles']} compiled by XLA, {stats['cache_hits']} loaded from the "
                         "compilation cache)"),
        ("hit rate", num(None if stats["hit_rate"] is None else 100 * stats["hit_rate"], "{:.1f} %")),
        ("experts per step", f"active {num(stats['active_per_step'])}, hits {num(stats['hits_per_step'])}, "
                             f"fetched {num(stats['fetched_per_step'])}, "
                             f"host-computed {num(stats['host_per_step'])} (summed over MoE layers)"),
        ("bytes per step", f"H2D slot fills {mib(stats['h2d_bytes_per_step'])}, "
                           f"host GEMV reads {mib(stats['host_bytes_per_step'])}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run_generate(args: argparse.Namespace) -> int:
    """`ft-jax generate`: returns the exit status."""
    import jax.numpy as jnp

    from ft_jax.checkpoint import load_checkpoint
    from ft_jax.generate import Engine, Sampling, check_request
    from ft_jax.tokenizer import TokenizerNotFoundError, load_tokenizer

    # Everything that can be checked without the weights is checked first: errors come before any loading.
    path, cfg = _model_config(args)
    tokenizer = None
    try:
        tokenizer = load_tokenizer(path)
    except TokenizerNotFoundError:
        if args.prompt_ids is None:
            raise
    if args.prompt_ids is not None:
        prompts = args.prompt_ids
    else:
        texts = args.prompt or ["\n"]
        prompts = [tokenizer.encode(t) for t in texts]
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        room = cfg.max_position_embeddings - max(len(p) for p in prompts)
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room) if room > 0 else DEFAULT_NEW_TOKENS
    try:
        check_request(cfg, prompts, max_new_tokens)
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        raise UsageError(str(e)) from None

    if not args.no_compile_cache:
        enable_compile_cache(compile_cache_dir())
    dtype = args.dtype or _default_dtype(cfg)
    checkpoint = load_checkpoint(path, dtype=jnp.dtype(dtype))
    num_slots = _num_slots(args, checkpoint)
    policy, message = _policy(args, checkpoint)
    if message and not args.json:
        print(f"ft-jax: {message}", file=sys.stderr)

    def on_compile(text: str, finished: bool) -> None:
        if not args.json:
            print(text if finished else f"ft-jax: {text}", end="\n" if finished else "", file=sys.stderr, flush=True)

    engine = Engine(checkpoint, policy=policy, num_slots=num_slots, on_compile=on_compile)
    eos = set(cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer is not None and
                                    tokenizer.eos_token_id is not None else set())

    streaming = not args.json and len(prompts) == 1
    stream = tokenizer.stream_decoder() if streaming and tokenizer is not None else None

    def on_tokens(step: int, new: list[int | None]) -> None:
        if not streaming:
            return
        if step == 0 and tokenizer is not None:  # the prompt echo comes after the compile notes
            sys.stdout.write(tokenizer.decode(prompts[0]))
        if new[0] is not None:
            sys.stdout.write(stream.push(new[0]) if stream is not None else f" {new[0]}")
        sys.stdout.flush()

    result = engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=args.seed,
                             eos_token_ids=eos, on_tokens=on_tokens)
    texts = [tokenizer.decode(t) for t in result.tokens] if tokenizer is not None else None
    if args.json:
        settings = {"max_new_tokens": max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                    "top_p": args.top_p, "seed": args.seed, "dtype": dtype, "policy": str(policy)}
        print(json.dumps({"model": path, "prompt_ids": prompts, "generated_ids": result.tokens, "text": texts,
                          "settings": settings, "profile_message": message, "stats": result.stats}))
        return 0
    if stream is not None:
        sys.stdout.write(stream.flush())
    if len(prompts) > 1:
        for i, (p, t) in enumerate(zip(prompts, result.tokens)):
            shown = tokenizer.decode(p) + tokenizer.decode(t) if tokenizer is not None else f"{p} -> {t}"
            print(f"--- [{i}] ---\n{shown}")
    print(file=sys.stdout)
    print(_stats_table(result.stats), file=sys.stderr)
    return 0


def recommendation(profile) -> str:
    """Plain advice from the bandwidth pair the fetch fraction uses (the contended one when present), e.g. "the host
    path is 3.1x faster than the fill (while both run): compute about 3 of every 4 misses on the CPU (fetch the other
    1 into device slots)". Within a factor 1.1 the two are "about as fast"; the CPU share 1 - fraction is rounded to
    a fraction with denominator <= 8."""
    contended = profile.bp_contended is not None
    bp, bh = (profile.bp_contended, profile.bh_contended) if contended else (profile.bp, profile.bh)
    which = "while both run" if contended else "measured alone"
    if max(bp, bh) / min(bp, bh) < 1.1:
        speed = f"the host path is about as fast as the fill ({which})"
    elif bh > bp:
        speed = f"the host path is {bh / bp:.1f}x faster than the fill ({which})"
    else:
        speed = f"the fill is {bp / bh:.1f}x faster than the host path ({which})"
    host = 1.0 - profile.fraction()
    share = fractions.Fraction(host).limit_denominator(8)
    if share == 0 or host < 1 / 16:
        return f"{speed}: fetch every miss into device slots (like fetch-all)"
    if share == 1 or host > 15 / 16:
        return f"{speed}: compute every miss on the CPU (like host-all)"
    num, den = share.numerator, share.denominator
    return (f"{speed}: compute about {num} of every {den} misses on the CPU "
            f"(fetch the other {den - num} into device slots)")


def _profile_report(profile, q_star: dict[int, int], saved: str) -> str:
    from ft_jax.tools.bandwidth import describe_machine

    k, d = profile.key, profile.details
    rows = [("BP  slot fill", "bp"), ("BH  host expert GEMV", "bh"),
            ("BPc slot fill, contended", "bp_contended"), ("BHc host GEMV, contended", "bh_contended")]
    lines = [
        f"ft_jax bandwidth profile ({'quick' if profile.quick else 'full'}, median of {profile.repeats} repeats "
        f"[min, max], {d['seconds']:.1f} s; GB/s = 1e9 bytes/s, MiB = 2^20 bytes)",
        f"  machine  {describe_machine(k)}",
        f"  expert   H={profile.hidden_size} I={profile.intermediate_size} {k['dtype']}: "
        f"{k['expert_bytes'] / 2**20:.2f} MiB; working set {d['working_set_bytes'] / 2**20:.0f} MiB "
        f"(last-level cache {d['llc_bytes'] / 2**20:.0f} MiB)",
        *(f"  {label:<26}{getattr(profile, name):8.2f} GB/s  [{profile.spreads[name][0]:.2f}, "
          f"{profile.spreads[name][1]:.2f}]" for label, name in rows),
        f"  fetch fraction q*/m = {profile.fraction():.3f} (BPc / (BPc + BHc))",
        "  q* for m = 1..8:  " + "  ".join(f"m={m}:{q}" for m, q in q_star.items()),
        f"  recommendation: {recommendation(profile)}",
    ]
    if d["load_average_1m"] > k["cpu_count"]:
        lines.append(f"  note: load average {d['load_average_1m']:.1f} on {k['cpu_count']} cores while measuring: "
                     "other processes competed for the CPU, so these figures may be low and noisy")
    return "\n".join(lines + [f"  {saved}"])


def run_profile(args: argparse.Namespace) -> int:
    """`ft-jax profile`: returns the exit status (0 measured, and saved unless --no-save; 1 measured and printed
    but not saved). Bad arguments, --model or --profile raise UsageError / ConfigError / OSError before measuring."""
    from dataclasses import asdict

    from ft_jax.offload.policy import fetch_count_np
    from ft_jax.tools import bandwidth

    if (args.hidden_size is None) != (args.intermediate_size is None):
        raise UsageError("give both --hidden-size and --intermediate-size (or --model)")
    if args.hidden_size is not None:
        if args.model:
            raise UsageError("give either --model PATH or --hidden-size and --intermediate-size, not both")
        H, I, dtype = args.hidden_size, args.intermediate_size, args.dtype or "bfloat16"
    else:
        _, cfg = _model_config(args)
        H, I, dtype = cfg.hidden_size, cfg.moe_intermediate_size, args.dtype or _default_dtype(cfg)
    if not args.no_save:
        bandwidth.read_profiles(args.profile)  # NotAStoreError before measuring, not after
    profile = bandwidth.measure_profile(H, I, dtype, quick=args.quick, repeats=args.repeats, progress=not args.json)
    saved_to, saved, status = None, "not saved", 0
    if not args.no_save:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a damaged store moved aside is part of the message
                saved_to, note = bandwidth.save_profile(profile, args.profile)
            saved = f"saved to {saved_to}{note}"
        except OSError as e:
            print(f"ft-jax profile: error: could not save the profile: {e}", file=sys.stderr)
            status = 1
    q_star = {m: fetch_count_np(m, profile.fraction()) for m in range(1, 9)}
    if args.json:
        print(json.dumps({"profile": asdict(profile), "fraction": profile.fraction(), "q_star": q_star,
                          "recommendation": recommendation(profile),
                          "saved_to": str(saved_to) if saved_to else None}))
    else:
        print(_profile_report(profile, q_star, saved))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ft-jax` console script (and `python -m ft_jax`)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # before the heavy imports: argument errors come at once
    if args.command is None:
        parser.print_help()
        return 2
    # Problems with what the user gave; config.ConfigError is a ValueError, TokenizerNotFoundError an OSError.
    user_errors: tuple[type[BaseException], ...] = (UsageError, NotImplementedError, ValueError, OSError)
    if args.command == "generate":
        from ft_jax.checkpoint import CheckpointError

        user_errors += (CheckpointError,)
    try:
        return run_profile(args) if args.command == "profile" else run_generate(args)
    except user_errors as e:
        if args.verbose:
            traceback.print_exc()
        print(f"ft-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nft-jax {args.command}: interrupted", file=sys.stderr)
        return 130
