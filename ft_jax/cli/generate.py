"""`ft-jax generate`: its flags, run (built on ft_jax.api: make_request before loading, load, Model.run_request) and
the statistics table."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ft_jax import defaults, interrupts, launch, units
from ft_jax.cli import arg_types
from ft_jax.cli.usage import HelpFormatter, UsageError, check_output_file, escaped_text
from ft_jax.config import SUPPORTED_ARCHITECTURES, load_config
from ft_jax.defaults import BANK_MEMORY, DEFAULT_PREFILL_CHUNK, WEIGHT_CHECK
from ft_jax.offload.policy import PolicyKind
from ft_jax.tools.trace_io import routing_records, write_trace

POLICY_HELP = ("auto (follows whichever of host-all, fetch-all, fixed-cap:1, qstar and a reuse rule, each replayed "
               "on its own copy of the cache, scored least in the last 128 steps; docs/policies.md; the default with "
               "an accelerator), qstar (split misses by the measured "
               "bandwidths; qstar:FRAC fixes the fetch fraction), fetch-all (classic LRU offload: every miss is copied "
               "into a slot), host-all (every miss computed on the CPU; the cache never changes), fixed-cap:K (fetch "
               "at most K misses per layer), resident (every expert on the device). Default: auto with an accelerator, host-all "
               "on a CPU-only machine (slots there would be copies of the host banks in the same memory)")
EXAMPLES = """examples:
  ft-jax generate --prompt "ROMEO:"                          # the bundled tiny Shakespeare MoE
  ft-jax generate --prompt "KING:" --temperature 0 --max-new-tokens 50 --stop "\\n\\n"
  ft-jax generate --model ~/models/Mixtral-8x7B-Instruct-v0.1 --chat --prompt "Write a haiku" --cache-fraction 0.25
  ft-jax generate --model ~/models/Qwen3-30B-A3B --device-memory 8GiB --policy host-all --json
  ft-jax generate --model DIR --prompt-ids 1,17,42 --temperature 0     # no tokenizer needed
  ft-jax generate --model DIR --devices 4 --prompt "Hi"       # experts split over 4 devices (CPU-only: 4 CPU devices)
  # two processes (here on one machine), each holding half of the experts; process 0 prints:
  ft-jax generate --model DIR --coordinator localhost:5000 --num-processes 2 --process-id 1 &
  ft-jax generate --model DIR --coordinator localhost:5000 --num-processes 2 --process-id 0

Supported architectures: {architectures}. Compiled steps are kept in the compilation cache under the user cache
directory and loaded without tracing by the next run of the same configuration (see --no-compile-cache); the weights'
NaN/Inf check runs once per version of a checkpoint file (see --weight-check); the qstar policy uses the bandwidth
profile stored there (see `ft-jax profile`)."""


def add_arguments(sub) -> None:
    """The `generate` subparser on the subparsers object ``sub``."""
    gen = sub.add_parser("generate", help="generate text (default model: the bundled tiny Shakespeare MoE)",
                         formatter_class=HelpFormatter,
                         epilog=EXAMPLES.format(architectures=", ".join(SUPPORTED_ARCHITECTURES)),
                         description="Generate text from a Hugging Face MoE checkpoint folder (config.json + "
                         "safetensors) or the bundled model, streaming tokens, then print offload statistics.")
    gen.add_argument("--model", type=arg_types.model_folder, metavar="PATH",
                     help="Hugging Face model folder (default: the bundled model)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="prompt text; repeat for several prompts decoded together as one batch "
                          "(default: a single newline)")
    src.add_argument("--prompt-ids", action="append", type=arg_types.token_ids, metavar="IDS",
                     help="prompt as comma-separated token ids (no tokenizer needed); repeatable")
    gen.add_argument("--max-new-tokens", type=arg_types.positive_int, default=None,
                     help=f"tokens to generate per prompt (default {defaults.DEFAULT_NEW_TOKENS}, or what the model's "
                          "context leaves after the prompt)")
    gen.add_argument("--temperature", type=arg_types.non_negative, default=defaults.DEFAULT_TEMPERATURE,
                     help=f"0 = greedy (default {defaults.DEFAULT_TEMPERATURE})")
    gen.add_argument("--top-k", type=arg_types.top_k, default=0, help="sample from the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=arg_types.fraction, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    gen.add_argument("--stop", action="append", metavar="TEXT", type=escaped_text,
                     help="stop a sequence once its text contains TEXT (cut off there); repeatable; escapes \\n, "
                          "\\r, \\t, \\\\, \\', \\\" and \\xHH are processed as llama.cpp does; any other "
                          "backslash is refused (\\\\ for a backslash)")
    gen.add_argument("--chat", action="store_true",
                     help="render each --prompt as a user message with the checkpoint's chat template "
                          "(tokenizer_config.json or chat_template.jinja)")
    gen.add_argument("--seed", type=arg_types.seed, default=0,
                     help=f"sampling seed, an integer in [0, {arg_types.SEED_MAX}] (32 bits; default 0)")
    add_load_arguments(gen, bank_memory="map")
    gen.add_argument("--record-trace", metavar="FILE",
                     help="write the routing of every decode step to FILE as a routing trace (JSON lines, or .npz "
                          "by name) for `ft-jax trace` / `ft-jax plan`")
    gen.add_argument("--json", action="store_true", help="print one JSON object (ids, text, statistics) instead")
    launch.add_arguments(gen)
    gen.add_argument("--verbose", action="store_true", help="show tracebacks")


def add_load_arguments(parser, bank_memory: str) -> None:
    """The flags that load a model, shared by `generate` and `serve`: dtype, quantize, the cache budget, policy,
    profile, bank memory (default ``bank_memory``: "map" for generate, "copy" for serve), prefill chunk, compilation
    cache."""
    parser.add_argument("--dtype", type=arg_types.model_dtype, default=None,
                        help="auto, bf16/bfloat16 or f32/float32: dtype of the dense weights, the activations and the "
                             "expert host banks (default auto: float32 for float32 checkpoints, else bfloat16)")
    parser.add_argument("--quantize", type=arg_types.quantize, default=None, metavar="TYPE",
                        help=arg_types.QUANTIZE_HELP)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--cache-slots", type=arg_types.positive_int, metavar="S",
                        help="device expert slots shared by all layers (per device under generate's expert "
                             "parallelism: --devices or several processes)")
    budget.add_argument("--cache-fraction", type=arg_types.fraction, metavar="F",
                        help=f"slots as a fraction of all experts (default {defaults.DEFAULT_CACHE_FRACTION}; one slot "
                             "under host-all)")
    budget.add_argument("--device-memory", type=arg_types.byte_text, metavar="BYTES",
                        help="device memory for expert slots, e.g. 8GiB (slots = BYTES / bytes per expert as stored: "
                             "a quantized expert's data and scales)")
    parser.add_argument("--policy", type=arg_types.policy, default=None, metavar="POLICY",
                        help=POLICY_HELP)
    parser.add_argument("--profile", metavar="PATH", help="bandwidth profile file for auto and qstar (default: the "
                                                          "user cache directory; see `ft-jax profile`)")
    parser.add_argument("--no-measure", action="store_true",
                        help="auto or qstar without a stored profile: do not run a quick profile, fall back to "
                             "fixed-cap:1")
    parser.add_argument("--bank-memory", choices=BANK_MEMORY, default=bank_memory,
                        help="map: the expert host banks map the checkpoint file's page-cache pages where the "
                             "offsets allow (no copy, fast start); copy: every tensor is copied, the experts onto the "
                             "banks' own huge pages (a longer load and the file's bytes in memory twice while it is "
                             "cached; decode reads both at the same speed; the file may change while the model runs). "
                             "Quantized experts (--quantize, FP8, "
                             "MXFP4) are built in the banks' memory either way. Default: "
                             f"{bank_memory} (generate maps, serve copies)")
    parser.add_argument("--weight-check", choices=WEIGHT_CHECK, default="once",
                        help="once (default): check every float weight for NaN/Inf the first time a version of its "
                             "file is loaded, and record the checked bytes in the user cache directory "
                             "(checked_weights.json, by device, inode, size and times: a file that changes is checked "
                             "again; one written less than 2 s before a load is not recorded); always: at every load "
                             "(after a change through a writable memory mapping, which can leave the times as they "
                             "were)")
    parser.add_argument("--prefill-chunk", type=arg_types.positive_int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                        help=f"prompt tokens per prefill call (default {DEFAULT_PREFILL_CHUNK}): a longer prompt is "
                             "prefilled in chunks appended to the KV cache, bounding its memory, with one compiled "
                             "step for every prompt length")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not use the compilation cache (default: compiled steps are kept in compile/ under "
                             "the user cache directory, e.g. ~/.cache/ft_jax: JAX's persistent cache, and whole steps "
                             "in compile/ft_jax_steps/, so the next run with the same model, flags and shapes loads "
                             "them instead of tracing and compiling)")


def flag_conflicts(args: argparse.Namespace) -> str | None:
    """A combination of flags that cannot mean anything (reported by the parser), or None."""
    if args.chat and args.prompt_ids is not None:
        return "--chat renders text prompts with the chat template: it cannot be used with --prompt-ids"
    return launch.check_flags(args.devices, args.coordinator, args.num_processes, args.process_id)


def _request(args: argparse.Namespace, api, path: str, cfg, tokenizer):
    """The checked request (api.make_request) from the flags, before any loading; UsageError naming the problem."""
    prompts = args.prompt_ids if args.prompt_ids is not None else (args.prompt or ["Hello" if args.chat else "\n"])
    try:
        return api.make_request(path, cfg, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                stop=args.stop or (), chat=args.chat)
    except ValueError as e:
        flag = next((f for word, f in (("temperature", "--temperature"), ("stop string", "--stop")) if word in str(e)),
                    None)
        raise UsageError(f"{flag}: {e}" if flag else str(e)) from None


def _budget_flags(args: argparse.Namespace) -> dict:
    """{flag: value} of the three cache budget flags (mutually exclusive: at most one is not None)."""
    return {"--cache-slots": args.cache_slots, "--cache-fraction": args.cache_fraction,
            "--device-memory": args.device_memory}


def _budget_flag(args: argparse.Namespace) -> str:
    """The cache budget flag given (the three when none is), to name in an error."""
    given = [flag for flag, value in _budget_flags(args).items() if value is not None]
    return given[0] if given else " / ".join(_budget_flags(args))


def _cache(args: argparse.Namespace, cfg, note, devices: int = 1) -> int | float | str | None:
    """The cache budget of the flags for api.load (of each of the ``devices`` devices, which own 1/devices of the
    experts); a --cache-slots above the number of experts is said in a note, and so is a budget that host-all or
    resident does not use (None: api.load's default for them)."""
    experts = cfg.num_moe_layers * cfg.num_experts // devices
    given = [f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
             for flag, value in _budget_flags(args).items() if value is not None]
    import jax

    # auto fills few slots or none on a CPU device: its cost model runs the paths serially there and a hit costs a host
    # GEMV, so only the calls' fixed costs can make a fill pay (with --devices N a shard's lone miss can: DESIGN secs.
    # 19.5, 19.6, 20.29)
    on_cpu = jax.default_backend() == "cpu"
    if given and _host_all(args):
        policies = "fetch-all or qstar" if on_cpu else "auto, qstar or fetch-all"
        note(f"note: {given[0]} is not used: host-all computes every expert on the CPU and never fills a slot (give "
             f"--policy {policies} to use slots)")
        return None  # api.load's one slot
    if given and _resident(args):
        note(f"note: {given[0]} is not used: resident holds every expert of the device in its slots")
        return None
    if on_cpu and args.policy is not None and args.policy.kind is PolicyKind.AUTO:
        note("note: --policy auto on a CPU device fills few slots or none: a slot there is a copy in the same memory, "
             "read by the same cores, so a fill pays only through the calls' fixed costs in its cost model (--policy "
             "qstar or fetch-all fill them)")
    if args.cache_slots is not None and args.cache_slots > experts:
        note(f"note: --cache-slots {args.cache_slots} is more than the {experts} experts; using {experts}")
    if args.cache_fraction is not None and round(args.cache_fraction * experts) < 1:
        note(f"note: --cache-fraction {args.cache_fraction:g} of the {experts} experts is less than one slot; "
             "using 1")
    return args.cache_slots if args.cache_slots is not None else (
        args.cache_fraction if args.cache_fraction is not None else args.device_memory)


def _host_all(args: argparse.Namespace) -> bool:
    """Whether the run's policy is host-all: given, or the default of a CPU-only JAX backend."""
    if args.policy is not None:
        return args.policy.kind is PolicyKind.HOST_ALL
    import jax

    return defaults.default_policy(jax.default_backend()) == defaults.CPU_POLICY


def _resident(args: argparse.Namespace) -> bool:
    """Whether --policy resident was given (the default policy never is)."""
    return args.policy is not None and args.policy.kind is PolicyKind.RESIDENT


def _device_memory_note(args: argparse.Namespace, cfg, expert_bytes: int, note, devices: int = 1) -> None:
    """A --device-memory that holds more than every expert (of a device) is clamped to all of them: said in a
    note (api.budget_note, as Model.note says it of cache=)."""
    from ft_jax import api

    experts = cfg.num_moe_layers * cfg.num_experts // devices
    if args.device_memory is None or _resident(args) or _host_all(args):
        return
    fits = units.parse_bytes(args.device_memory) // expert_bytes
    if fits > experts:
        note(f"note: {api.budget_note(f'--device-memory {args.device_memory}', fits, experts)}")


def _mesh(args: argparse.Namespace):
    """The expert mesh of --devices / --coordinator (None without them); UsageError when JAX was not set up for them
    (ft_jax.launch: they act only on the command line, before JAX starts) or a process has no device."""
    if args.devices is None and args.coordinator is None:
        return None
    import jax

    from ft_jax.offload.expert_parallel import expert_mesh

    if args.coordinator is not None and jax.process_count() != args.num_processes:
        raise UsageError(f"--coordinator: this process is not part of a {args.num_processes}-process run (JAX has "
                         f"{jax.process_count()} process); the flags take effect only on the `ft-jax` command line, "
                         "which sets JAX up before it starts")
    if args.coordinator is not None:
        return expert_mesh()  # every device of every process
    try:
        return expert_mesh(args.devices)
    except ValueError as e:
        raise UsageError(f"--devices {args.devices}: {e}; the flag sets the CPU device count only on the `ft-jax` "
                         "command line, which sets JAX up before it starts") from None


def run(args: argparse.Namespace) -> int:
    """`ft-jax generate`: returns the exit status. Everything that can be checked without the weights is checked
    first (api.make_request, --record-trace): errors come before any loading."""
    from ft_jax import api  # the model code (flax, checkpoint): imported on use, so `ft-jax --help` stays fast
    from ft_jax.tokenizer import load_tokenizer

    mesh = _mesh(args)
    devices = 1 if mesh is None else mesh.size
    primary = mesh is None or _process_index() == 0  # prints the text, the statistics and the trace
    who = "ft-jax" if args.coordinator is None else f"ft-jax (process {_process_index()})"
    path = args.model or defaults.bundled_model_path()
    cfg = load_config(path)
    tokenizer = load_tokenizer(path) if args.prompt_ids is None else api.load_tokenizer_or_none(path)
    request = _request(args, api, path, cfg, tokenizer)
    check_output_file("--record-trace", args.record_trace)
    check_output_file("--profile", args.profile)
    if args.coordinator is not None:
        try:
            launch.check_same_run(_run_fields(args, path, request))
        except ValueError as e:
            raise UsageError(str(e)) from None

    notes: list[str] = []  # --json: in the object instead of on stderr

    def note(text: str) -> None:
        if args.json:
            notes.append(text)
        else:
            print(f"{who}: {text}", file=sys.stderr)

    def on_compile(text: str, finished: bool) -> None:
        if not args.json:
            print(text if finished else f"{who}: {text}", end="\n" if finished else "", file=sys.stderr, flush=True)

    cache = _cache(args, cfg, note, devices)
    if not args.no_compile_cache:
        off = api.enable_compile_cache(api.default_compile_cache_dir())
        if off:
            note(off)
    try:
        model = api.load(path, dtype=args.dtype or "auto", policy=args.policy, cache=cache, profile=args.profile,
                         measure=not args.no_measure, on_message=note, on_compile=on_compile, quantize=args.quantize,
                         mesh=mesh, bank_memory=args.bank_memory, weight_check=args.weight_check)
    except ValueError as e:
        message = api.argument_message(e, "cache")  # the message without load()'s "cache= / <every flag>: "
        if message is None:
            raise
        raise UsageError(f"{_budget_flag(args)}: {message}") from None
    _device_memory_note(args, cfg, model.engine.expert_bytes, note, devices)
    model.engine.prefill_chunk = args.prefill_chunk
    if not args.json and primary:
        model.engine.on_prefill = PrefillProgress(sys.stderr)
    streaming = not args.json and len(request.prompt_ids) == 1 and primary
    echoed = []

    def echo_prompt() -> None:
        if not echoed and tokenizer is not None:  # the prompt echo comes after the compile notes
            sys.stdout.write(tokenizer.decode(request.prompt_ids[0]))
            echoed.append(True)

    def on_text(row: int, text: str) -> None:
        echo_prompt()
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        out = model.run_request(request, on_text=on_text if streaming else None,
                                record_routing=args.record_trace is not None)
    except BaseException:  # an error (or Ctrl-C) after streamed text: its message starts on a line of its own
        if echoed:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    if streaming:
        echo_prompt()  # no text came (a stop string at the first token): the prompt is still shown
    if not primary and not args.json:
        return 0
    if args.record_trace is not None and primary:
        with interrupts.deferred_exit():  # never a half-written trace
            write_trace(args.record_trace, routing_records(*out.routing,
                                                           dataset=os.path.basename(os.path.normpath(path))))
    _print_result(args, path, model, request, out, streaming, tokenizer, notes)
    return 0


def _run_fields(args: argparse.Namespace, path: str, request) -> dict[str, object]:
    """What every process of a multi-process run must share (launch.check_same_run), by the flags that set it: the
    model (its config.json and weight files' sizes), the request and the settings that change the steps' shapes or
    their number."""
    files = sorted((f, os.path.getsize(os.path.join(path, f))) for f in os.listdir(path) if f.endswith(".safetensors"))
    with open(os.path.join(path, "config.json"), "rb") as f:
        config = f.read().hex()
    s = request.sampling
    return {"--model": [config, files], "--prompt / --prompt-ids / --chat": request.prompt_ids,
            "--max-new-tokens": request.max_new_tokens,
            "--temperature / --top-k / --top-p": [s.temperature, s.top_k, s.top_p], "--seed": request.seed,
            "--stop": list(request.stop), "--dtype": args.dtype, "--quantize": args.quantize,
            "--prefill-chunk": args.prefill_chunk, "--record-trace": args.record_trace is not None}


def _process_index() -> int:
    import jax

    return jax.process_index()


class PrefillProgress:
    """Engine.on_prefill for the CLI: "ft-jax: prefill 1024/4096 tokens, 85.3 tokens/s" on ``stream`` once the
    prefill has run a second, rewritten in place (carriage return) after every chunk on a terminal, else one line
    per second or so and one at the end."""

    def __init__(self, stream):
        self.stream, self.shown = stream, None  # shown: seconds of the last line printed (None: none yet)

    def __call__(self, done: int, total: int, seconds: float) -> None:
        finished = done >= total
        if seconds < 1.0 and not (finished and self.shown is not None):
            return
        tty = self.stream.isatty()
        if not tty and not finished and self.shown is not None and seconds - self.shown < 1.0:
            return
        line = f"ft-jax: prefill {done}/{total} tokens, {done / seconds:.1f} tokens/s"
        self.stream.write(("\r" + line + ("\n" if finished else "")) if tty else line + "\n")
        self.stream.flush()
        self.shown = None if finished else seconds


def _print_result(args, path: str, model, request, out, streamed: bool, tokenizer, notes: list[str]) -> None:
    """The api.Request and its api.Generation as the JSON object (--json), or the end of the stream / the batch's
    texts and the statistics table."""
    if args.json:
        settings = {"max_new_tokens": request.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                    "top_p": args.top_p, "seed": args.seed, "dtype": model.dtype, "policy": str(model.policy),
                    "stop": list(request.stop), "chat": bool(args.chat), "quantize": args.quantize,
                    "bank_memory": args.bank_memory,
                    "weight_format": out.stats["weight_format"], "devices": out.stats["devices"],
                    "num_processes": args.num_processes or 1, "process_id": args.process_id or 0}
        print(json.dumps({"model": path, "prompt_ids": request.prompt_ids, "generated_ids": out.token_ids,
                          "text": out.texts, "finish_reasons": out.finish_reasons, "settings": settings,
                          "profile_message": model.note, "notes": notes, "stats": out.stats}))
        return
    if streamed and tokenizer is None:
        print(" ".join(str(t) for t in out.token_ids[0]), end="")
    if len(request.prompt_ids) > 1:
        for i, (p, t) in enumerate(zip(request.prompt_ids, out.token_ids)):
            shown = tokenizer.decode(p) + out.texts[i] if tokenizer is not None else f"{p} -> {t}"
            print(f"--- [{i}] ---\n{shown}")
    print(file=sys.stdout)
    print(stats_table(out.stats), file=sys.stderr)


def _slots_row(stats: dict) -> str:
    size = f"{stats['num_slots']} x {units.format_bytes(stats['expert_bytes'])}"
    if stats["devices"] > 1:
        size += f" on each of {stats['devices']} devices (each MoE layer's experts split over them)"
    if stats["policy"] == PolicyKind.HOST_ALL:
        return "none used (host-all computes every miss on the CPU from the host banks)"
    if stats["policy"] == PolicyKind.RESIDENT:
        return f"{size} (resident: every expert on the device; the cache budget does not apply)"
    return size


def _policy_text(policy: str) -> str:
    """The policy as the table shows it: a qstar fraction to 3 decimals, as the bandwidth profile's note gives it
    ("fetch fraction 0.404"; the exact one is in --json)."""
    name, _, frac = policy.partition(":")
    return f"qstar:{round(float(frac), 3):g}" if name == PolicyKind.QSTAR and frac else policy


def stats_table(stats: dict) -> str:
    """The statistics of Engine.generate as the aligned table printed after the text."""
    def num(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    def mib(v):
        return "-" if v is None else f"{v / 2**20:.2f} MiB"

    built = stats["prefill_compiles"] + stats["decode_compiles"]
    rows = [
        ("policy", _policy_text(stats["policy"])),
        ("expert slots", _slots_row(stats)),
        ("time to first token", f"{stats['ttft_s'] * 1e3:.1f} ms (compilation included)"),
        ("prefill", f"{units.count(stats['prompt_tokens'], 'token')}, "
                    f"{num(stats['prefill_tokens_per_s'], '{:.1f}')} tokens/s (compilation excluded)"),
        ("decode", f"{units.count(stats['decode_tokens'], 'token')} after the first, "
                   f"{units.count(stats['decode_steps'], 'step')}, "
                   f"{num(stats['decode_tokens_per_s'], '{:.1f}')} tokens/s (compilation excluded)"),
        ("compile time", f"{stats['compile_s']:.2f} s ({units.count(built, 'step')} built: "
                         f"{stats['xla_compiles']} compiled by XLA, {stats['cache_hits']} loaded from the "
                         "compilation cache)"),
        ("hit rate", num(None if stats["hit_rate"] is None else 100 * stats["hit_rate"], "{:.1f} %")),
        ("experts per step", f"active {num(stats['active_per_step'])}, hits {num(stats['hits_per_step'])}, "
                             f"fetched {num(stats['fetched_per_step'])}, "
                             f"host-computed {num(stats['host_per_step'])} (summed over MoE layers)"),
        ("bytes per step", f"H2D slot fills {mib(stats['h2d_bytes_per_step'])}, "
                           f"host GEMV reads {mib(stats['host_bytes_per_step'])}"),
        ("weights", f"{stats['weight_format']} experts of {units.format_bytes(stats['expert_bytes'])} in the host "
                    "banks; "
                    f"{mib(stats['weight_bytes_per_token'])} read per token (dense "
                    f"{stats['dense_weight_bytes'] / 2**20:.2f} MiB per step + the active experts)"),
    ]
    for d, dev in enumerate(stats.get("per_device", ())):
        rate = num(None if dev["hit_rate"] is None else 100 * dev["hit_rate"], "{:.1f} %")
        rows.append((f"device {d}", f"hit rate {rate}, active {num(dev['active_per_step'])}, hits "
                                    f"{num(dev['hits_per_step'])}, fetched {num(dev['fetched_per_step'])}, "
                                    f"host-computed {num(dev['host_per_step'])} per step"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
