"""`ft-jax profile`: its flags, run (measure BP / BH with the production FFI handlers and store the profile) and the
report with its plain-words recommendation."""

from __future__ import annotations

import argparse
import dataclasses
import fractions
import json
import os
import sys
import warnings

from ft_jax import defaults, units, weight_formats
from ft_jax.cli import arg_types
from ft_jax.cli.usage import HelpFormatter, UsageError, check_output_file
from ft_jax.config import load_config
from ft_jax.config.quantization import expert_format
from ft_jax.offload import profile as bandwidth
from ft_jax.offload.policy import fetch_count_np
from ft_jax.units import model_dtype

EXAMPLES = """examples:
  ft-jax profile                                   # the bundled model's expert size (full profile, ~10 s)
  ft-jax profile --quick --no-save                 # a few seconds, print only
  ft-jax profile --model ~/models/Mixtral-8x7B-v0.1
  ft-jax profile --hidden-size 4096 --intermediate-size 14336 --dtype bf16 --json

The profile is stored in the user cache directory (see --profile) and `ft-jax generate --policy qstar` uses it."""


def add_arguments(sub) -> None:
    """The `profile` subparser on the subparsers object ``sub``."""
    prof = sub.add_parser(
        "profile", help="measure slot-fill (BP) and host GEMV (BH) bandwidths for q*", epilog=EXAMPLES,
        formatter_class=HelpFormatter,
        description="Measure BP (slot fill), BH (host expert GEMV) and the pair while both run, with the production "
        "FFI handlers at a model's expert size; print the q* fetch fraction and store the profile for generate.")
    prof.add_argument("--model", type=arg_types.model_folder, metavar="PATH",
                      help="model folder whose config.json gives H, I and the dtype (default: the bundled model)")
    prof.add_argument("--hidden-size", type=arg_types.positive_int, metavar="H",
                      help="expert hidden size (instead of --model)")
    prof.add_argument("--intermediate-size", type=arg_types.positive_int, metavar="I",
                      help="expert intermediate size (with --hidden-size)")
    prof.add_argument("--dtype", type=arg_types.model_dtype,
                      help="auto, bf16/bfloat16 or f32/float32 (default and auto: as generate would load the model; "
                           "bfloat16 with --hidden-size)")
    prof.add_argument("--quantize", type=arg_types.quantize, default=None, metavar="TYPE",
                      help="measure q8_0 or q4_0 experts (the bytes generate --quantize TYPE reads; default: the "
                           "model's format: float, or an FP8 / MXFP4 checkpoint's own)")
    prof.add_argument("--quick", action="store_true", help="quick profile (a few seconds)")
    prof.add_argument("--repeats", type=arg_types.positive_int,
                      help="timed windows per bandwidth (default 7, 3 with --quick)")
    prof.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    prof.add_argument("--profile", metavar="PATH", help="profile store (default: profiles.json in the user cache "
                                                        "directory, e.g. ~/.cache/ft_jax, created if need be; a "
                                                        "path given here must be in a folder that exists)")
    prof.add_argument("--no-save", action="store_true", help="do not store the profile")
    prof.add_argument("--verbose", action="store_true", help="show tracebacks")


def recommendation(profile) -> str:
    """Plain advice from the bandwidth pair the fetch fraction uses (the contended one when present), e.g. "the host
    path is 3.1x faster than the fill (while both run): compute about 3 of every 4 misses on the CPU (fetch the other
    1 into device slots)". Within a factor 1.1 the two are "about as fast"; the CPU share 1 - fraction is rounded to
    a fraction with denominator <= 8. On a CPU device (the profile's key platform "cpu") a slot is a copy in the same
    host memory read by the same cores, so the advice is the CPU default host-all whatever the pair says."""
    contended = profile.bp_contended is not None
    bp, bh = (profile.bp_contended, profile.bh_contended) if contended else (profile.bp, profile.bh)
    which = "while both run" if contended else "measured alone"
    if max(bp, bh) / min(bp, bh) < 1.1:
        speed = f"the host path is about as fast as the fill ({which})"
    elif bh > bp:
        speed = f"the host path is {bh / bp:.1f}x faster than the fill ({which})"
    else:
        speed = f"the fill is {bp / bh:.1f}x faster than the host path ({which})"
    if profile.key.get("platform") == "cpu":
        return (f"{speed}: keep the CPU default, host-all (compute every expert on the CPU): on a CPU device a slot is "
                "a copy in the same host memory, read by the same cores, so slots do not speed up decode")
    host = 1.0 - profile.fraction()
    share = fractions.Fraction(host).limit_denominator(8)
    if share == 0 or host < 1 / 16:
        return f"{speed}: fetch every miss into device slots (like fetch-all)"
    if share == 1 or host > 15 / 16:
        return f"{speed}: compute every miss on the CPU (like host-all)"
    num, den = share.numerator, share.denominator
    return (f"{speed}: compute about {num} of every {den} misses on the CPU "
            f"(fetch the other {den - num} into device slots)")


def report(profile, q_star: dict[int, int], saved: str, fresh_why: str = "") -> str:
    """The profile as the printed report: bandwidths with their spread, q*, the recommendation, where it was saved;
    fresh_why: why fresh banks were timed although --model was given ("" for none)."""
    k, d = profile.key, profile.details
    rows = [("BP  slot fill", "bp"), ("BH  host expert GEMV", "bh"),
            ("BPc slot fill, contended", "bp_contended"), ("BHc host GEMV, contended", "bh_contended")]
    lines = [
        f"ft_jax bandwidth profile ({'quick' if profile.quick else 'full'}, median of {profile.repeats} repeats "
        f"[min, max], {d['seconds']:.1f} s; GB/s = 1e9 bytes/s, MiB = 2^20 bytes)",
        f"  machine  {bandwidth.describe_machine(k)}",
        f"  expert   H={profile.hidden_size} I={profile.intermediate_size} {k['dtype']}: "
        f"{units.format_bytes(k['expert_bytes'])}; working set {d['working_set_bytes'] / 2**20:.0f} MiB "
        f"(last-level cache {d['llc_bytes'] / 2**20:.0f} MiB)",
        "  banks    " + ("the model's own expert banks, as generate loads them" if d.get("banks") == "model" else
                         "fresh host banks of this expert size" + (f" ({fresh_why})" if fresh_why else "")),
        *(f"  {label:<26}{getattr(profile, name):8.2f} GB/s  [{profile.spreads[name][0]:.2f}, "
          f"{profile.spreads[name][1]:.2f}]" for label, name in rows),
        f"  fetch fraction q*/m = {profile.fraction():.3f} (BPc / (BPc + BHc))",
        *([] if not profile.call_ms else [
            "  per call in a compiled step (the cost model's fixed ms per layer): fill {fill:.3f}, host_experts "
            "{host:.3f}, slot_experts {slot:.3f} ms, with one route {slot_route:.3f} ms".format(**profile.call_ms)]),
        "  q* for m = 1..8:  " + "  ".join(f"m={m}:{q}" for m, q in q_star.items()),
        f"  recommendation: {recommendation(profile)}",
    ]
    if d["load_average_1m"] > k["cpu_count"]:
        lines.append(f"  note: load average {d['load_average_1m']:.1f} on {k['cpu_count']} cores while measuring: "
                     "other processes competed for the CPU, so these figures may be low and noisy")
    return "\n".join(lines + [f"  {saved}"])


def _expert_shape(args: argparse.Namespace) -> tuple[int, int, str, object]:
    """(H, I, dtype, weight format or None for the float one) from --hidden-size / --intermediate-size / --dtype /
    --quantize or the model's config.json (an FP8 / MXFP4 checkpoint: its format)."""
    if (args.hidden_size is None) != (args.intermediate_size is None):
        raise UsageError("give both --hidden-size and --intermediate-size (or --model)")
    if args.hidden_size is not None:
        if args.model:
            raise UsageError("give either --model PATH or --hidden-size and --intermediate-size, not both")
        H, I, dtype = args.hidden_size, args.intermediate_size, args.dtype or "bfloat16"
        fmt = weight_formats.by_name(args.quantize) if args.quantize else None
    else:
        cfg = load_config(args.model or defaults.bundled_model_path())
        H, I, dtype = cfg.hidden_size, cfg.moe_intermediate_size, model_dtype(args.dtype or "auto", cfg.dtype)
        fmt = expert_format(cfg, dtype, args.quantize)
    fmt = fmt if fmt is not None and fmt.quantized else None
    if fmt is not None:
        try:
            weight_formats.expert_rows(fmt, H, I)
        except ValueError as e:  # a size that does not fit the format's blocks
            raise UsageError(f"{fmt.name} experts of H={H}, I={I}: {e}") from None
    return H, I, dtype, fmt


def _model_banks(args: argparse.Namespace, H: int, I: int, dtype, fmt):
    """With --model or the bundled default (not --hidden-size): (the banks of the model's first k experts of every MoE
    layer, ""), loaded as
    generate loads them (the checkpoint's pages mapped where the file allows), k the fewest whose L * k rows hold
    the profile's rotation (Bench.rotation_rows), so BH is timed on the memory the engine reads; (None, why) when the
    model has too few experts for it (small experts rotate through fresh banks instead) or the folder has no
    weights; (None, "") with --hidden-size."""
    if args.hidden_size is not None:
        return None, ""
    model = args.model or defaults.bundled_model_path()
    cfg = load_config(model)
    mode = bandwidth.MODES["quick" if args.quick else "full"]
    llc = bandwidth.last_level_cache_bytes()
    _, rows = bandwidth.Bench.rotation_rows(bandwidth.expert_nbytes(H, I, dtype, fmt), mode["call_bytes"], llc)
    k = -(-2 * rows // cfg.num_moe_layers)
    if k > cfg.num_experts:
        return None, (f"the model's {cfg.num_moe_layers * cfg.num_experts} experts are too few to rotate past twice "
                      f"the {llc / 2**20:.0f} MiB last-level cache: {2 * rows} needed")
    from ft_jax import checkpoint  # the model code: imported when used, so that --help stays fast

    if not any(os.path.exists(os.path.join(model, f)) for f in (checkpoint.SINGLE_FILE, checkpoint.INDEX_FILE)):
        return None, f"{model} holds no {checkpoint.SINGLE_FILE} or {checkpoint.INDEX_FILE}"
    return checkpoint.load_banks(model, dtype, args.quantize, range(k)), ""


def run(args: argparse.Namespace) -> int:
    """`ft-jax profile`: returns the exit status (0 measured, and saved unless --no-save; 1 measured and printed
    but not saved). Bad arguments, --model or --profile raise UsageError / ConfigError / OSError before measuring."""
    H, I, dtype, fmt = _expert_shape(args)
    if not args.no_save:
        check_output_file("--profile", args.profile)  # as generate: only the default store's folder is created
        bandwidth.read_profiles(args.profile)  # NotAStoreError before measuring, not after
    banks, fresh_why = _model_banks(args, H, I, dtype, fmt)
    try:
        profile = bandwidth.measure_profile(H, I, dtype, quick=args.quick, repeats=args.repeats,
                                            progress=not args.json, fmt=fmt, model_banks=banks)
    finally:
        if banks is not None:
            banks.release()
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
        print(json.dumps({"profile": dataclasses.asdict(profile), "fraction": profile.fraction(), "q_star": q_star,
                          "recommendation": recommendation(profile),
                          "saved_to": str(saved_to) if saved_to else None}))
    else:
        print(report(profile, q_star, saved, fresh_why))
    return status
