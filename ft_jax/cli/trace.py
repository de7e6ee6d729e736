"""`ft-jax trace`: replay a routing trace for lists of policies and cache sizes and print the modelled ms per token.

Also the arguments and inputs `ft-jax plan` shares (add_model_arguments, load_inputs). The work is done in
ft_jax.tools (trace_io, replay, report) and priced by ft_jax.offload.cost_model.
"""

from __future__ import annotations

import argparse
import json
import sys

from ft_jax.cli import arg_types
from ft_jax.cli.usage import HelpFormatter, check_output_file
from ft_jax.config import load_config
from ft_jax.config.quantization import expert_format
from ft_jax.defaults import bundled_model_path
from ft_jax.memory import planned_expert_bytes
from ft_jax.offload.cost_model import ASSUMED_DEVICE_GBPS, PRESETS, CostModel
from ft_jax.offload.profile import cost_model_for, dtype_name
from ft_jax.tools.multi_device import check_devices, evaluate_devices, experts_per_device
from ft_jax.tools.replay import evaluate
from ft_jax.tools.report import format_table, plot, report
from ft_jax.tools.trace_io import Trace, read_trace


BANDWIDTH_HELP = ("'stored' (default: this machine's profile from `ft-jax profile`, at the expert size or the "
                  "closest one stored), BP,BH[,BPc,BHc] in GB/s, or a preset: " +
                  "; ".join(f"{name}: BP {p['bp']:g}, BH {p['bh']:g}" +
                            (f", BPc {p['bp_contended']:g}, BHc {p['bh_contended']:g}" if p["bp_contended"] else "")
                            + f" GB/s ({p['source']})" for name, p in PRESETS.items()))

COST_MODEL_HELP = """cost model, per MoE layer with F fetched, H host-computed and D = hits + F device experts of S_e bytes:
  fill F*S_e bytes and host GEMV H*S_e bytes start together and share host memory at the contended pair
  (BPc, BHc; without a measured pair BPc = BP, BHc = max(0, BH - BP)); when one ends the other goes on at its
  solo bandwidth (BP or BH); each path that runs adds its fixed cost (--fill-fixed-ms, --host-fixed-ms);
  the device computes its D experts after the fill: --device-fixed-ms + D*S_e/BD (BD = --device-bandwidth);
  layer = max(fill end + device, host end); a token = the sum over its MoE layers (attention not counted).
  Each sequence starts from a cold cache (a trace has no prompt), unless --carry-cache.
N devices (--devices, expert parallelism): each device owns E/N experts of every layer, replays its share of the
  trace through its own cache of the given slots and is priced as above on its own link (BP, BPc); the devices of
  one of --host-sockets sockets share its BH, BHc (their host experts pooled); a layer ends with its slowest device
  plus --allreduce-ms (the psum of the partial outputs), e.g. Mixtral-8x7B on 1, 2 and 4 GPUs of 24 GiB each:
    ft-jax trace TRACE --expert-bytes 352321536 --bandwidth sapphire-rapids --devices 1,2,4 --cache-slots 73
    ft-jax plan TRACE --expert-bytes 352321536 --bandwidth xeon-6526y --device-memory 24GiB --devices 2"""


def add_model_arguments(p) -> None:
    """--model / --expert-bytes / --num-layers / --num-experts / --dtype and the cost-model flags (trace and plan)."""
    p.add_argument("--model", type=arg_types.model_folder, metavar="DIR",
                   help="Hugging Face model folder: expert bytes, MoE layers and experts from its config.json "
                        "(instead of the three flags below)")
    p.add_argument("--expert-bytes", type=arg_types.positive_int, metavar="B",
                   help="S_e, bytes of one expert (gate + up + down), e.g. 352321536 for Mixtral-8x7B in bf16")
    p.add_argument("--num-layers", type=arg_types.positive_int, metavar="L", help="MoE layers (default: from the trace)")
    p.add_argument("--num-experts", type=arg_types.positive_int, metavar="E", help="experts per layer (default: the trace)")
    p.add_argument("--dtype", default=None, help="bf16/bfloat16 or f32/float32: the stored profile to look up "
                                                 "(default: the model's, else bfloat16)")
    p.add_argument("--quantize", type=arg_types.quantize, default=None, metavar="TYPE",
                   help="with --model: price experts quantized while loading (generate --quantize TYPE: q8_0 or "
                        "q4_0) at their stored size; an FP8 / MXFP4 checkpoint is priced in its own format")
    p.add_argument("--bandwidth", default="stored", metavar="SPEC", help=BANDWIDTH_HELP)
    p.add_argument("--profile", metavar="PATH", help="bandwidth profile store (default: the user cache directory)")
    p.add_argument("--device-bandwidth", type=arg_types.bandwidth_gbps, metavar="GBPS",
                   help=f"BD, GB/s at which the device computes experts in its slots (default: a stored CPU profile's "
                        f"slot-expert rate, or its BH when it has none: the slot experts run the host GEMV kernel; "
                        f"else an assumed {ASSUMED_DEVICE_GBPS:g})")
    for path in ("fill", "host", "device"):
        p.add_argument(f"--{path}-fixed-ms", type=arg_types.non_negative, default=None, metavar="MS",
                       help=f"fixed cost of the {path} path per layer in which it runs (default: the stored profile's "
                            "measured per-call cost with --bandwidth stored, else 0" +
                            ("; DESIGN.md sec. 5 cites FreeToken PR #39 for 0.08 ms on its CPU path)" if path == "host"
                             else ")"))
    p.add_argument("--host-sockets", type=arg_types.positive_int, default=1, metavar="K",
                   help="with --devices: the devices spread over K sockets (or hosts), each with the profile's host "
                        "GEMV bandwidth shared by its devices (default 1: one host CPU for all; K = N: one each, as "
                        "with one process per host)")
    p.add_argument("--allreduce-ms", type=arg_types.non_negative, default=0.0, metavar="MS",
                   help="with --devices N > 1: time of the psum of one MoE layer's partial outputs (default 0)")
    p.add_argument("--carry-cache", action="store_true", help="keep the cache across sequences (default: cold)")
    p.add_argument("--batch", action="store_true",
                   help="the sequences are the rows of one batch decoded together (a trace recorded by "
                        "`ft-jax generate` with several prompts): token t of every row is one decode step")
    p.add_argument("--verbose", action="store_true", help="show tracebacks")


def load_inputs(args) -> tuple[Trace, CostModel]:
    """(Trace, CostModel) from the shared trace/plan arguments. Raises ValueError / OSError (one-line messages)."""
    L, E, eb, dtype = args.num_layers, args.num_experts, args.expert_bytes, args.dtype
    fmt = None  # the float format of dtype
    if args.quantize and not args.model:
        raise ValueError("--quantize needs --model (the expert shape to quantize); with --expert-bytes give the "
                         "quantized size itself")
    if args.model:
        cfg = load_config(args.model)
        dtype = dtype or ("float32" if str(cfg.dtype) == "float32" else "bfloat16")
        fmt = expert_format(cfg, dtype_name(dtype), args.quantize)
        fmt = fmt if fmt.quantized else None
        try:
            model_eb = planned_expert_bytes(cfg, dtype_name(dtype), fmt)
        except ValueError as e:  # rows that do not fit the format's blocks
            flag = f"--quantize {args.quantize}: " if args.quantize else ""
            raise ValueError(f"{flag}the experts of {args.model} (H={cfg.hidden_size}, I={cfg.moe_intermediate_size}"
                             f"): {e}") from None
        if eb is not None and eb != model_eb:
            raise ValueError(f"--expert-bytes {eb} disagrees with --model ({model_eb} bytes per "
                             f"{fmt.name if fmt else dtype} expert as stored)")
        eb = model_eb
        for name, given, value in (("--num-layers", L, cfg.num_moe_layers), ("--num-experts", E, cfg.num_experts)):
            if given is not None and given != value:
                raise ValueError(f"{name} {given} disagrees with --model ({value})")
        L, E = cfg.num_moe_layers, cfg.num_experts
    if eb is None:
        raise ValueError(f"give --model DIR or --expert-bytes B (bytes of one expert) to price the replay (a trace "
                         f"of the bundled model: --model {bundled_model_path()})")
    dtype = dtype_name(dtype or "bfloat16")
    trace = read_trace(args.trace, L, E)
    shape = (cfg.hidden_size, cfg.moe_intermediate_size) if args.model else None  # the stored profile's key
    model = cost_model_for(args.bandwidth, eb, dtype=dtype, profile_path=args.profile,
                           device_bandwidth=args.device_bandwidth, fill_fixed_ms=args.fill_fixed_ms,
                           host_fixed_ms=args.host_fixed_ms, device_fixed_ms=args.device_fixed_ms, fmt=fmt,
                           shape=shape)
    return trace, model


def add_trace_arguments(sub) -> None:
    """Register `ft-jax trace` on the CLI's subparsers."""
    policies = arg_types.policy_list("--policy")

    p = sub.add_parser("trace", help="replay a routing trace: hit rate, fetched/host experts and modelled ms per "
                                     "token for each policy and cache size",
                       formatter_class=HelpFormatter, epilog=COST_MODEL_HELP,
                       description="Replay routing traces (JSON lines or .npz, see docs/policies.md) through the "
                       "decode step's own cache plan for every policy and cache size, and model the MoE time per "
                       "token under a bandwidth profile.")
    p.add_argument("trace", nargs="+", metavar="TRACE", help="routing trace file(s)")
    p.add_argument("--policy", type=policies, default=policies(DEFAULT_POLICIES), metavar="LIST",
                   help=f"comma-separated policies (default {DEFAULT_POLICIES})")
    p.add_argument("--devices", type=arg_types.comma_list(arg_types.positive_int, "--devices"), default=[1],
                   metavar="LIST", help="comma-separated device counts to model (expert parallelism, see below; "
                                        "default 1); cache sizes are per device")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--cache-slots", type=arg_types.comma_list(arg_types.positive_int, "--cache-slots"), metavar="LIST",
                      help="comma-separated cache sizes in slots (shared by all MoE layers; of each device)")
    size.add_argument("--cache-fraction", type=arg_types.comma_list(arg_types.fraction, "--cache-fraction"), metavar="LIST",
                      help=f"comma-separated cache sizes as fractions of the L*E experts (with --devices N: of the "
                           f"L*E/N each device owns; default {DEFAULT_FRACTIONS})")
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="also plot ms per token against the cache size (matplotlib: "
                                                      "pip install 'ft-jax[plot]')")


DEFAULT_POLICIES = "fetch-all,host-all,qstar,fixed-cap:1,auto"
DEFAULT_FRACTIONS = "0.1,0.25,0.5"


def slot_counts(args, trace: Trace, devices: int = 1) -> list[int]:
    """Cache sizes in slots (of each of ``devices`` devices) from --cache-slots or --cache-fraction (round(f * L*E /
    devices): of the experts a device owns, as generate --devices reads it; at least 1), each once (two fractions
    that round to one count give one row). Raises ValueError."""
    total = trace.num_layers * trace.num_experts
    if args.cache_slots is not None:
        bad = [s for s in args.cache_slots if not 1 <= s <= total]
        if bad:
            raise ValueError(f"--cache-slots must be in [1, L*E = {total}], got {bad}")
        return list(dict.fromkeys(args.cache_slots))
    fractions = args.cache_fraction or [float(f) for f in DEFAULT_FRACTIONS.split(",")]
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad:
        raise ValueError(f"--cache-fraction must be in (0, 1], got {bad}")
    return list(dict.fromkeys(max(1, round(f * total / devices)) for f in fractions))



def run_trace(args) -> int:
    """`ft-jax trace`: returns the exit status; bad input raises ValueError / OSError / ImportError."""
    trace, model = load_inputs(args)
    sizes = slot_counts(args, trace)
    if args.plot:
        check_output_file("--plot", args.plot)
        try:  # lazy: matplotlib is optional; fail before the replay, not after
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError("--plot needs matplotlib: pip install 'ft-jax[plot]' (or pip install matplotlib)") \
                from None

    def progress(done, total):
        if not args.json and sys.stderr.isatty():
            sys.stderr.write(f"\r\033[Kft-jax trace: replayed {done} of {total}")
            sys.stderr.flush()

    for n in args.devices:  # every count checked before any replay or note
        check_devices(trace, n)
    results = []
    for n in dict.fromkeys(args.devices):  # a device count given twice: its rows once
        if n == 1:
            results += evaluate(trace, args.policy, sizes, model, carry_cache=args.carry_cache, batch=args.batch,
                                progress=progress)
        else:
            counts = slot_counts(args, trace, n)
            own = experts_per_device(trace, n)
            over = [s for s in counts if s > own]
            if over:  # evaluate_devices caps them: say so, since the row shows another count than the one given
                print(f"ft-jax trace: --devices {n}: a device owns {own} experts; cache sizes {over} are replayed as "
                      f"{own} slots", file=sys.stderr)
            results += evaluate_devices(trace, args.policy, counts, model, n,
                                        host_sockets=min(args.host_sockets, n),
                                        allreduce_ms=args.allreduce_ms, carry_cache=args.carry_cache,
                                        batch=args.batch, progress=progress)
    if not args.json and sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    rep = report(trace, model, results, args.carry_cache, args.batch)
    if args.plot:
        plot(rep, args.plot)
    print(json.dumps(rep, indent=1) if args.json else format_table(rep))
    return 0

