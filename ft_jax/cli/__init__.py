"""The `ft-jax` command line: main and the parser, assembled from one module per subcommand (generate, profile,
trace, plan, serve; docs/DESIGN.md sec. 11, "Engine, API and CLI").

    ft-jax generate --prompt "ROMEO:"                  # the bundled tiny Shakespeare MoE
    ft-jax serve --port 8000                           # the OpenAI HTTP API (the serve extra)
    ft-jax profile --model ~/models/Mixtral-8x7B
    ft-jax trace --help; ft-jax plan --help

Errors in what the user gave print one line and exit with status 2 (--verbose adds the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Sequence

from ft_jax import __version__, interrupts, kernels
from ft_jax.cli import generate, plan, profile, serve, trace
from ft_jax.cli.usage import Parser, UsageError


def build_parser() -> argparse.ArgumentParser:
    """The `ft-jax` argument parser with its generate, serve, profile, trace and plan subcommands."""
    parser = Parser(
        prog="ft-jax", description="Mixture-of-Experts decoding in JAX with the experts in host memory: a device "
        "slot cache plus host expert GEMVs, split by the bandwidth-balanced q* policy.")
    parser.add_argument("--version", action="version", version=f"ft-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    generate.add_arguments(sub)
    serve.add_arguments(sub)
    profile.add_arguments(sub)
    trace.add_trace_arguments(sub)
    plan.add_plan_arguments(sub)
    return parser


RUN = {"generate": generate.run, "serve": serve.run, "profile": profile.run, "trace": trace.run_trace, "plan": plan.run_plan}


def _quiet_broken_pipe() -> int:
    """stdout was closed by its reader (`| head`): no message, and none from the interpreter's final flush either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, as a shell reports a writer whose pipe closed


def _skip_ipython() -> None:
    """Make `import IPython` fail in this process unless IPython is already loaded: flax imports it (~0.3 s, a sixth
    of the imports before any work) only to ask whether it runs inside IPython, which a command never does (flax then
    takes its ImportError as "no")."""
    sys.modules.setdefault("IPython", None)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `ft-jax` console script (and `python -m ft_jax`)."""
    _skip_ipython()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if sys.stdout is None:  # started with stdout closed (`>&-`): nowhere to write the result
        print(f"ft-jax {args.command}: error: stdout is closed; redirect it to a file or /dev/null", file=sys.stderr)
        return 2
    problem = kernels.environment_problem()
    if problem:
        print(f"ft-jax {args.command}: error: {problem}", file=sys.stderr)
        return 2
    conflict = generate.flag_conflicts(args) if args.command == "generate" else None
    if conflict:
        print(f"ft-jax {args.command}: error: {conflict} (see --help)", file=sys.stderr)
        return 2
    # Problems with what the user gave; config.ConfigError is a ValueError, TokenizerNotFoundError an OSError.
    interrupts.set_label(f"ft-jax {args.command}")  # the Ctrl-C line (ft_jax/interrupts.py)
    interrupts.report_bus_errors()  # a checkpoint truncated under the mapped banks: one line, not a bare bus error
    user_errors: tuple[type[BaseException], ...] = (UsageError, NotImplementedError, ValueError, OSError,
                                                     MemoryError)  # ft_jax.memory.InsufficientMemoryError
    if args.command in ("generate", "serve", "profile"):  # profile --model reads the model's expert banks
        from ft_jax.checkpoint import CheckpointError  # the model code: not loaded for --help or another command

        user_errors += (CheckpointError,)
    if args.command == "generate":  # NaN / inf logits (a FloatingPointError): the checkpoint's numbers, not a crash
        from ft_jax.engine.sampling import NonFiniteLogitsError

        user_errors += (NonFiniteLogitsError,)
    if args.command in ("trace", "plan"):
        user_errors += (ImportError,)  # --plot without matplotlib
    try:
        return RUN[args.command](args)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except user_errors as e:
        if args.verbose:
            traceback.print_exc()
        print(f"ft-jax {args.command}: error: {str(e) or type(e).__name__}", file=sys.stderr)  # MemoryError() is empty
        return 2
    except KeyboardInterrupt:
        print(f"\nft-jax {args.command}: interrupted", file=sys.stderr)
        return 130


def console_main() -> None:
    """The process entry of `ft-jax` and `python -m ft_jax`: main, then the output flushed and the process ended at
    once with main's status (os._exit). The interpreter's own teardown (the JAX runtime, every module and cached
    executable, the host banks one by one) took 1.1-1.5 s of a 5 GB model's launch-to-exit time (docs/DESIGN.md
    section 15.9); nothing is left to do by then: files are closed and the compilation cache is written as steps are
    compiled. ``main`` itself returns (tests call it in-process)."""
    status = main()
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # started with it closed
                stream.flush()
    except BrokenPipeError:
        status = _quiet_broken_pipe()
    os._exit(status)

