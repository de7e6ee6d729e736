"""The `ft-jax` command line: `generate` (the main job) and `profile` (bandwidth profile for the q* policy).

    ft-jax generate --prompt "ROMEO:"                  # the bundled tiny Shakespeare MoE
    ft-jax generate --model ~/models/Mixtral-8x7B --prompt "def fib(n):" --cache-fraction 0.25
    ft-jax profile --model ~/models/Mixtral-8x7B

`generate` is built on the Python API (ft_jax.load / Model.generate, ft_jax/api.py): same defaults, same behaviour.

Errors in what the user gave (paths, configs, prompts, budgets) print one line and exit with status 2; --verbose
adds the traceback.
"""

from __future__ import annotations

import argparse
import fractions
import json
import os
import sys
import traceback
import warnings
from typing import Sequence

from ft_jax.cli import arg_types

POLICY_HELP = ("auto (default: per layer, the number of misses to fetch that minimises the modelled layer time minus "
               "the observed reuse of fetched experts; docs/policies.md), qstar (split misses by the measured "
               "bandwidths; qstar:FRAC fixes the fetch fraction), fetch-all (classic LRU offload: every miss is copied "
               "into a slot), host-all (every miss computed on the CPU; the cache never changes), fixed-cap:K (fetch "
               "at most K misses per layer), resident (every expert on the device)")
GENERATE_EXAMPLES = """examples:
  ft-jax generate --prompt "ROMEO:"                          # the bundled tiny Shakespeare MoE
  ft-jax generate --prompt "KING:" --temperature 0 --max-new-tokens 50 --stop "\\n\\n"
  ft-jax generate --model ~/models/Mixtral-8x7B-Instruct-v0.1 --chat --prompt "Write a haiku" --cache-fraction 0.25
  ft-jax generate --model ~/models/Qwen3-30B-A3B --device-memory 8GiB --policy host-all --json
  ft-jax generate --model DIR --prompt-ids 1,17,42 --temperature 0     # no tokenizer needed

Supported architectures: {architectures}. Compiled steps are kept in JAX's persistent compilation cache under the
user cache directory (see --no-compile-cache); the qstar policy uses the bandwidth profile stored there (see
`ft-jax profile`)."""


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (`PROG: error: ...`, exit status 2) instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


PROFILE_EXAMPLES = """examples:
  ft-jax profile                                   # the bundled model's expert size (full profile, ~10 s)
  ft-jax profile --quick --no-save                 # a few seconds, print only
  ft-jax profile --model ~/models/Mixtral-8x7B-v0.1
  ft-jax profile --hidden-size 4096 --intermediate-size 14336 --dtype bf16 --json

The profile is stored in the user cache directory (see --profile) and `ft-jax generate --policy qstar` uses it."""


def build_parser() -> argparse.ArgumentParser:
    """The `ft-jax` argument parser with its `generate` and `profile` subcommands."""
    from ft_jax import __version__, api
    from ft_jax.config import SUPPORTED_ARCHITECTURES

    parser = _Parser(
        prog="ft-jax", description="Mixture-of-Experts decoding in JAX with the experts in host memory: a device "
        "slot cache plus host expert GEMVs, split by the bandwidth-balanced q* policy.")
    parser.add_argument("--version", action="version", version=f"ft-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text (default model: the bundled tiny Shakespeare MoE)",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=GENERATE_EXAMPLES.format(architectures=", ".join(SUPPORTED_ARCHITECTURES)),
                         description="Generate text from a Hugging Face MoE checkpoint folder (config.json + "
                         "safetensors) or the bundled model, streaming tokens, then print offload statistics.")
    gen.add_argument("--model", metavar="PATH", help="Hugging Face model folder (default: the bundled model)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text; repeat for several prompts decoded together as one batch "
                          "(default: a single newline)")
    src.add_argument("--prompt-ids", action="append", type=arg_types.token_ids, metavar="IDS",
                     help="prompt as comma-separated token ids (no tokenizer needed); repeatable")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help=f"tokens to generate per prompt (default {api.DEFAULT_NEW_TOKENS}, or what the model's "
                          "context leaves after the prompt)")
    gen.add_argument("--temperature", type=arg_types.non_negative, default=api.DEFAULT_TEMPERATURE,
                     help=f"0 = greedy (default {api.DEFAULT_TEMPERATURE})")
    gen.add_argument("--top-k", type=arg_types.top_k, default=0, help="sample from the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=arg_types.fraction, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    gen.add_argument("--stop", action="append", metavar="TEXT",
                     help="stop a sequence once its text contains TEXT (cut off there); repeatable")
    gen.add_argument("--chat", action="store_true",
                     help="render each --prompt as a user message with the checkpoint's chat template "
                          "(tokenizer_config.json or chat_template.jinja)")
    gen.add_argument("--seed", type=arg_types.seed, default=0,
                     help=f"sampling seed, an integer in [0, {arg_types.SEED_MAX}] (32 bits; default 0)")
    gen.add_argument("--dtype", type=arg_types.dtype, default=None,
                     help="bf16/bfloat16 or f32/float32: dtype of the dense weights, the activations and the expert "
                          "host banks (default: float32 for float32 checkpoints, else bfloat16)")
    budget = gen.add_mutually_exclusive_group()
    budget.add_argument("--cache-slots", type=int, metavar="S", help="device expert slots shared by all layers")
    budget.add_argument("--cache-fraction", type=arg_types.fraction, metavar="F",
                        help=f"slots as a fraction of all experts (default {api.DEFAULT_CACHE_FRACTION})")
    budget.add_argument("--device-memory", type=arg_types.byte_text, metavar="BYTES",
                        help="device memory for expert slots, e.g. 8GiB (slots = BYTES / bytes per expert)")
    gen.add_argument("--policy", type=arg_types.policy, default=api.DEFAULT_POLICY, metavar="POLICY", help=POLICY_HELP)
    gen.add_argument("--profile", metavar="PATH", help="bandwidth profile file for auto and qstar (default: the user "
                                                       "cache directory; see `ft-jax profile`)")
    gen.add_argument("--no-measure", action="store_true",
                     help="auto or qstar without a stored profile: do not run a quick profile, fall back to fixed-cap:1")
    gen.add_argument("--record-trace", metavar="FILE",
                     help="write the routing of every decode step to FILE as a routing trace (JSON lines, or .npz "
                          "by name) for `ft-jax trace` / `ft-jax plan`")
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
    prof.add_argument("--hidden-size", type=arg_types.positive_int, metavar="H", help="expert hidden size (instead of --model)")
    prof.add_argument("--intermediate-size", type=arg_types.positive_int, metavar="I",
                      help="expert intermediate size (with --hidden-size)")
    prof.add_argument("--dtype", type=arg_types.dtype, help="bf16/bfloat16 or f32/float32 (default: as generate would load "
                                                   "the model; bfloat16 with --hidden-size)")
    prof.add_argument("--quick", action="store_true", help="quick profile (a few seconds)")
    prof.add_argument("--repeats", type=arg_types.positive_int, help="timed windows per bandwidth (default 7, 3 with --quick)")
    prof.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    prof.add_argument("--profile", metavar="PATH", help="profile store (default: profiles.json in the user cache "
                                                        "directory, e.g. ~/.cache/ft_jax)")
    prof.add_argument("--no-save", action="store_true", help="do not store the profile")
    prof.add_argument("--verbose", action="store_true", help="show tracebacks")

    from ft_jax.cli import plan, trace

    trace.add_trace_arguments(sub)
    plan.add_plan_arguments(sub)
    return parser


def _slots_row(stats: dict) -> str:
    size = f"{stats['num_slots']} x {stats['expert_bytes'] / 2**20:.2f} MiB"
    if stats["policy"] == "host-all":
        return "none used (host-all computes every miss on the CPU from the host banks)"
    if stats["policy"] == "resident":
        return f"{size} (resident: every expert on the device; the cache budget does not apply)"
    return size


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
    """`ft-jax generate`: returns the exit status. Built on ft_jax.load / Model.generate (the Python API)."""
    from ft_jax import api
    from ft_jax.config import load_config
    from ft_jax.engine.engine import Sampling, check_request
    from ft_jax.tokenizer import TokenizerNotFoundError, load_tokenizer

    # Everything that can be checked without the weights is checked first: errors come before any loading.
    path = args.model or api.bundled_model_path()
    cfg = load_config(path)
    try:
        tokenizer = load_tokenizer(path)
    except TokenizerNotFoundError:
        if args.prompt_ids is None:
            raise
        tokenizer = None
    if args.stop and tokenizer is None:
        raise UsageError(f"--stop needs a tokenizer, and {path} has none (no tokenizer.json)")
    if args.prompt_ids is not None:
        prompts = args.prompt_ids
    elif args.chat:
        from ft_jax.chat import load_chat_template

        template = load_chat_template(path)
        prompts = [tokenizer.encode(template.render([{"role": "user", "content": t}]), add_special_tokens=False)
                   for t in (args.prompt or ["Hello"])]
    else:
        prompts = [tokenizer.encode(t) for t in (args.prompt or ["\n"])]
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        room = cfg.max_position_embeddings - max(len(p) for p in prompts)
        max_new_tokens = min(api.DEFAULT_NEW_TOKENS, room) if room > 0 else api.DEFAULT_NEW_TOKENS
    try:
        check_request(cfg, prompts, max_new_tokens)
        Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.record_trace is not None:  # checked before loading: the trace is written after the whole generation
        folder = os.path.dirname(os.path.abspath(args.record_trace))
        if os.path.isdir(args.record_trace):
            raise UsageError(f"--record-trace {args.record_trace}: is a directory, expected a file name")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"--record-trace {args.record_trace}: folder {folder} does not exist or is not writable")
    cache = args.cache_slots if args.cache_slots is not None else (
        args.cache_fraction if args.cache_fraction is not None else args.device_memory)

    def note(text: str) -> None:
        if not args.json:
            print(f"ft-jax: {text}", file=sys.stderr)

    def on_compile(text: str, finished: bool) -> None:
        if not args.json:
            print(text if finished else f"ft-jax: {text}", end="\n" if finished else "", file=sys.stderr, flush=True)

    if not args.no_compile_cache:
        api.enable_compile_cache(api.default_compile_cache_dir())
    try:
        model = api.load(path, dtype=args.dtype or "auto", policy=args.policy, cache=cache, profile=args.profile,
                         measure=not args.no_measure, on_message=note, on_compile=on_compile)
    except ValueError as e:
        if "slot" in str(e) or "cache" in str(e):
            raise UsageError(f"--cache-slots / --cache-fraction / --device-memory: {e}") from None
        raise

    streaming = not args.json and len(prompts) == 1
    echoed = []

    def on_text(row: int, text: str) -> None:
        if not echoed and tokenizer is not None:  # the prompt echo comes after the compile notes
            sys.stdout.write(tokenizer.decode(prompts[0]))
            echoed.append(True)
        sys.stdout.write(text)
        sys.stdout.flush()

    out = model.generate(prompts, max_new_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed, stop=args.stop or (),
                         on_text=on_text if streaming else None, record_routing=args.record_trace is not None)
    if args.record_trace is not None:
        from ft_jax.tools.trace_io import routing_records, write_trace

        write_trace(args.record_trace, routing_records(*out.routing, dataset=os.path.basename(os.path.normpath(path))))
    if args.json:
        settings = {"max_new_tokens": max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                    "top_p": args.top_p, "seed": args.seed, "dtype": model.dtype, "policy": str(model.policy),
                    "stop": args.stop or [], "chat": bool(args.chat)}
        print(json.dumps({"model": path, "prompt_ids": prompts, "generated_ids": out.token_ids, "text": out.texts,
                          "finish_reasons": out.finish_reasons, "settings": settings, "profile_message": model.note,
                          "stats": out.stats}))
        return 0
    if streaming and tokenizer is None:
        print(" ".join(str(t) for t in out.token_ids[0]), end="")
    if len(prompts) > 1:
        for i, (p, t) in enumerate(zip(prompts, out.token_ids)):
            shown = tokenizer.decode(p) + out.texts[i] if tokenizer is not None else f"{p} -> {t}"
            print(f"--- [{i}] ---\n{shown}")
    print(file=sys.stdout)
    print(_stats_table(out.stats), file=sys.stderr)
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
    from ft_jax.offload.profile import describe_machine

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
    from ft_jax.offload import profile as bandwidth

    if (args.hidden_size is None) != (args.intermediate_size is None):
        raise UsageError("give both --hidden-size and --intermediate-size (or --model)")
    if args.hidden_size is not None:
        if args.model:
            raise UsageError("give either --model PATH or --hidden-size and --intermediate-size, not both")
        H, I, dtype = args.hidden_size, args.intermediate_size, args.dtype or "bfloat16"
    else:
        from ft_jax import api
        from ft_jax.config import load_config
        from ft_jax.units import model_dtype

        cfg = load_config(args.model or api.bundled_model_path())
        H, I, dtype = cfg.hidden_size, cfg.moe_intermediate_size, model_dtype(args.dtype or "auto", cfg.dtype)
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
    if args.command in ("trace", "plan"):
        user_errors += (ImportError,)  # --plot without matplotlib
    try:
        if args.command in ("trace", "plan"):
            from ft_jax.cli import plan, trace

            return trace.run_trace(args) if args.command == "trace" else plan.run_plan(args)
        return run_profile(args) if args.command == "profile" else run_generate(args)
    except user_errors as e:
        if args.verbose:
            traceback.print_exc()
        print(f"ft-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nft-jax {args.command}: interrupted", file=sys.stderr)
        return 130
