"""The devices and processes of a run, set up before JAX starts its backend (which ``import ft_jax`` does).

`ft-jax generate --devices N` (N devices in this process; on a machine without accelerators N CPU devices through
jax_num_cpu_devices) and `--coordinator HOST:PORT --num-processes P --process-id I` (one process per host or per GPU,
jax.distributed with CPU collectives over gloo) must be in place before JAX creates its backend, and importing
ft_jax creates it (ft_jax/kernels/__init__.py registers the FFI targets on the CPU client). So ft_jax/__init__.py
calls ``setup_for_command_line()`` before anything else, as it installs the signal handlers: when this process is
`ft-jax generate`, those flags are read from sys.argv ahead of the full parser (which parses them again and reports
malformed values) and applied. A Python program does the same itself, before it imports ft_jax:

    import jax
    jax.config.update("jax_num_cpu_devices", 4)                        # 4 CPU devices in this process
    jax.config.update("jax_cpu_collectives_implementation", "gloo")    # several processes: CPU collectives
    jax.distributed.initialize("host0:5000", num_processes=2, process_id=0)
    import ft_jax

This module imports only the standard library at import time (it runs before jax is imported).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import threading
import time

from ft_jax import interrupts

DEFAULT_INIT_TIMEOUT_S = 120
INIT_ABORT_MARGIN_S = 10  # XLA's own initialization timeout is this much past --init-timeout: the watchdog's goes first


def add_arguments(parser) -> None:
    """The device and process flags of `ft-jax generate` (the full parser; parse_early reads the same flags)."""
    group = parser.add_argument_group(
        "devices and processes", "expert parallelism (README, \"Several devices and processes\")")
    group.add_argument("--devices", type=_positive, default=None, metavar="N",
                       help="devices of this process on the 'expert' mesh axis (each MoE layer's experts split over "
                            "them, each with its own slots); on a machine without accelerators N CPU devices "
                            "(default: one device, no mesh)")
    group.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="several processes (one per host or per GPU): the address of process 0, which listens "
                            "there; needs --num-processes and --process-id")
    group.add_argument("--num-processes", type=_positive, default=None, metavar="P",
                       help="processes of the run (with --coordinator)")
    group.add_argument("--process-id", type=_non_negative, default=None, metavar="I",
                       help="this process's index in [0, P) (with --coordinator); process 0 prints the text and the "
                            "statistics (with --json every process prints its object)")
    group.add_argument("--init-timeout", type=_positive, default=DEFAULT_INIT_TIMEOUT_S, metavar="SECONDS",
                       help=f"how long to wait for the coordinator and the other processes (default "
                            f"{DEFAULT_INIT_TIMEOUT_S})")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def check_flags(devices: int | None, coordinator: str | None, num_processes: int | None,
                process_id: int | None) -> str | None:
    """The problem with a combination of the device and process flags (one line), or None."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        return "--coordinator, --num-processes and --process-id go together (one process of several)"
    if coordinator is not None:
        host, sep, port = coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"--coordinator {coordinator!r}: expected HOST:PORT (e.g. 10.0.0.1:5000 or localhost:5000)"
        if process_id >= num_processes:
            return f"--process-id {process_id} is not in [0, {num_processes}) (--num-processes {num_processes})"
    return None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once a TCP connection to ``address`` (HOST:PORT) succeeds; retries until ``timeout_s``.

    Raises:
        ConnectionError: naming the address and the timeout (jax.distributed would abort the process instead).
    """
    host, port = _split(address)
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise ConnectionError(f"cannot reach the coordinator at {address} within {timeout_s:g} s ({last}): start "
                                  f"process 0 (--process-id 0) there first, or check the address, port and firewall")
        time.sleep(0.2)


def check_port_free(address: str) -> None:
    """Process 0 listens on the coordinator's port: ConnectionError naming it when the port is taken. With
    SO_REUSEADDR, as the coordinator's own server binds it: the previous run's connections in TIME_WAIT (about 60 s
    after it) leave the port free for the next one (a fresh-user trial was refused the port on a second run)."""
    _, port = _split(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise ConnectionError(f"process 0 cannot listen on the coordinator port {port} of {address} ({e}): "
                                  f"choose another --coordinator port") from None


def setup(devices: int | None = None, coordinator: str | None = None, num_processes: int | None = None,
          process_id: int | None = None, timeout_s: float = DEFAULT_INIT_TIMEOUT_S) -> None:
    """Configure JAX for the run; call before JAX starts its backend (before ``import ft_jax``).

    devices: sets jax_num_cpu_devices (the CPU backend's device count; an accelerator backend keeps its own).
    coordinator / num_processes / process_id: CPU collectives over gloo, then jax.distributed.initialize with
    ``timeout_s``; a process other than 0 first waits (up to timeout_s) until the coordinator accepts connections.
    Gloo prints its connection lines to the C library's stdout: file descriptor 1 is pointed at stderr and
    sys.stdout gets the original stdout, so that what ft-jax prints (the text, --json) stays clean.

    Raises:
        ValueError: a combination of flags that cannot work (check_flags).
        ConnectionError: the coordinator cannot be reached within timeout_s, or process 0 cannot listen on its port
            (naming the address).
    When not every process joins within timeout_s, the process writes one line and exits with status 2 (a watchdog
    thread: XLA's coordination client would abort it).
    """
    problem = check_flags(devices, coordinator, num_processes, process_id)
    if problem:
        raise ValueError(problem)
    import jax  # the backend does not start until a device is asked for

    if devices is not None:
        jax.config.update("jax_num_cpu_devices", devices)
    if coordinator is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if process_id == 0:
        check_port_free(coordinator)
    else:
        wait_for_coordinator(coordinator, timeout_s)
    print(f"ft-jax: process {process_id} of {num_processes}: coordinator {coordinator}, waiting up to "
          f"{timeout_s:g} s for every process", file=sys.stderr, flush=True)
    _c_stdout_to_stderr()
    # When the others never join, XLA's coordination client aborts the process at its timeout (SIGABRT and a C++
    # fatal log); a watchdog ends it first, with one line and status 2, the same way as the unreachable coordinator.
    joined = threading.Event()

    def not_joined() -> None:
        if not joined.is_set():
            os.write(2, (f"ft-jax generate: error: process {process_id} of {num_processes}: not every process joined "
                         f"the coordinator {coordinator} within {timeout_s:g} s (--init-timeout): start the others "
                         f"with the same --coordinator and --num-processes, each with its own --process-id in "
                         f"[0, {num_processes})\n").encode())
            os._exit(2)

    watchdog = threading.Timer(timeout_s, not_joined)
    watchdog.daemon = True
    watchdog.start()
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=int(math.ceil(timeout_s)) + INIT_ABORT_MARGIN_S)
    joined.set()
    watchdog.cancel()
    interrupts.reclaim()  # its preemption notifier took SIGTERM


def check_same_run(fields: dict[str, object]) -> None:
    """Every process of a multi-process run must decode the same request from the same model: a difference ran other
    collectives on each side (a hang) or decoded other prompts in one batch (wrong tokens with exit 0; both found by a
    fresh-user trial). Each process gathers every process's digest of each field (one all-gather, before loading) and
    raises ValueError naming the fields that differ (every process raises the same).

    fields: {the flags that set it: a JSON-serializable value}, in the same order on every process."""
    import hashlib
    import json

    import numpy as np
    from jax.experimental import multihost_utils

    digests = np.array([int.from_bytes(hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).digest()[:8],
                                       "little", signed=True) for v in fields.values()], np.int64)
    every = np.asarray(multihost_utils.process_allgather(digests))  # i64[P, F]
    differ = [name for j, name in enumerate(fields) if len(set(every[:, j].tolist())) > 1]
    if differ:
        raise ValueError(f"the processes were given different runs: {', '.join(differ)} differ between them (every "
                         "process of a run decodes the same request from the same model: give each the same flags "
                         "but --process-id and --policy)")


def _c_stdout_to_stderr() -> None:
    """File descriptor 1 (what C++ libraries print to) becomes stderr; sys.stdout keeps writing to the original
    stdout through a descriptor of its own."""
    sys.stdout.flush()
    out = sys.stdout
    keep = os.dup(out.fileno())
    os.dup2(sys.stderr.fileno(), out.fileno())
    sys.stdout = open(keep, "w", buffering=1 if out.line_buffering else -1, encoding=out.encoding, errors=out.errors)


def parse_early(argv: list[str]):
    """The device and process flags of a `generate` command line (argparse Namespace), or None when the command is
    another one, asks for --help, or gives a malformed value (the full parser reports it)."""
    if not argv or argv[0] != "generate" or any(a in ("-h", "--help") for a in argv):
        return None
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_arguments(parser)
    try:
        args, _ = parser.parse_known_args(argv[1:])
    except argparse.ArgumentError:
        return None
    return args


def setup_for_command_line() -> None:
    """setup() from the flags of `ft-jax generate` (or `python -m ft_jax generate`) when this process is that
    command and gives any of them; a failure prints "ft-jax generate: error: ..." and exits with status 2."""
    if not interrupts.is_command_line():
        return
    args = parse_early(sys.argv[1:])
    if args is None or (args.devices is None and args.coordinator is None and args.num_processes is None
                        and args.process_id is None):
        return
    if check_flags(args.devices, args.coordinator, args.num_processes, args.process_id):
        return  # the full parser's check reports it
    try:
        setup(args.devices, args.coordinator, args.num_processes, args.process_id, args.init_timeout)
    except (ValueError, ConnectionError) as e:
        print(f"ft-jax generate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
