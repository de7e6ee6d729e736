"""Ctrl-C (SIGINT) and SIGTERM for the `ft-jax` command line: exit 130 / 143 with one line, at any moment.

No exception is ever raised asynchronously into running code. The Python-level handlers only record the signal;
``signal.set_wakeup_fd`` makes the C-level handler (run in whichever thread the kernel picked) write the signal
number to a pipe, and a watcher thread blocked on that pipe ends the process with ``os._exit(128 + signum)`` after
writing one line to stderr -- at once, even while the main thread sits in an XLA compile that runs no Python.
``os._exit`` skips interpreter finalization, so no Python state is torn down under XLA's threads.

Why not KeyboardInterrupt: raised wherever the main thread next runs bytecode, it lands inside callbacks that C++
calls during a compile (jax's monitoring listeners, jaxlib's ``_xla_gc_callback``), where it is swallowed ("Exception
ignored in: _xla_gc_callback") or unwinds through the compiler; when it does reach main, the interpreter finalizes
while XLA threads still run and the process dies with SIGSEGV (see docs/DESIGN.md sec. 14).

Writes that must not be cut in half (JAX's persistent-cache entries, which it writes in place; the bandwidth
profile store) run inside ``deferred_exit()``: the watcher waits for them to finish before exiting.

SIGBUS (a mapped checkpoint that shrank under the running model) gets one line too (``report_bus_errors``), written
by a C-level handler before the process ends by the signal.

Only the command line installs these (``install``, ``report_bus_errors``): a library must not take over a program's
signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state = {"label": "ft-jax", "installed": False}
_busy = threading.Condition()
_writers = [0]  # threads inside deferred_exit()


def _record(signum, frame) -> None:
    """Python-level handler: nothing to do, the watcher thread acts (the handler must exist for the wakeup fd)."""


def _watch(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 1)
        except InterruptedError:
            continue
        if not data:
            return
        signum = data[0]
        if signum not in _SIGNALS:
            continue
        graceful = _state.pop("graceful", None)
        if graceful is None:
            exit_now(signum)
        try:
            graceful(signum)
        except Exception as e:  # a failing callback must not leave the process without a way out
            os.write(2, f"\n{_state['label']}: the shutdown failed to start ({e}); exiting\n".encode())
            os._exit(128 + signum)


def exit_now(signum: int) -> None:
    """Wait for deferred_exit() blocks to finish, write "ft-jax CMD: interrupted" to stderr, exit 128 + signum."""
    with _busy:
        _busy.wait_for(lambda: _writers[0] == 0)
        name = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
        # "\n" first: a progress line ("building the prefill step ... ") may be waiting for its end.
        os.write(2, f"\n{_state['label']}: {name}\n".encode())
        os._exit(128 + signum)


def install(label: str = "ft-jax") -> bool:
    """Handle SIGINT and SIGTERM as described above; ``label`` starts the line printed (set_label changes it).

    Call from the main thread. A signal already ignored (nohup, a background job) stays ignored. Returns whether
    it was installed (False off the main thread or if already installed)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    handled = [s for s in _SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    for s in handled:
        signal.signal(s, _record)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), name="ft_jax-signals", daemon=True).start()
    _state.update(label=label, installed=True, handled=handled)
    return True


def reclaim() -> None:
    """Put the installed handlers back after C++ code replaced them behind Python's back:
    jax.distributed.initialize's preemption notifier takes SIGTERM (a multi-process run logged "SIGTERM caught" and
    went on to exit 0). A no-op when install() did not run."""
    for s in _state.get("handled", ()):
        signal.signal(s, _record)


def on_first_signal(callback) -> None:
    """Graceful mode (``ft-jax serve``): the next SIGINT or SIGTERM calls callback(signum) on the watcher thread
    instead of exiting, and the command exits by itself once it has shut down; a signal after that one exits at
    once, as without this."""
    _state["graceful"] = callback


def set_label(label: str) -> None:
    """The start of the interrupt line, e.g. "ft-jax generate"."""
    _state["label"] = label


@contextlib.contextmanager
def deferred_exit():
    """A block a signal does not cut: an exit requested meanwhile happens when the block ends."""
    with _busy:
        _writers[0] += 1
    try:
        yield
    finally:
        with _busy:
            _writers[0] -= 1
            _busy.notify_all()


def protect_compile_cache_writes() -> None:
    """Run JAX's persistent-cache writes (jax._src.compilation_cache.put_executable_and_time, which writes the
    entry file in place) inside deferred_exit(), so an interrupt never leaves a truncated entry. No-op when that
    private function is absent (another JAX version): exits then happen at any moment, as before."""
    try:
        from jax._src import compilation_cache
    except ImportError:
        return
    put = getattr(compilation_cache, "put_executable_and_time", None)
    if put is None or getattr(put, "_ft_jax_deferred", False):
        return

    def guarded(*args, **kwargs):
        with deferred_exit():
            return put(*args, **kwargs)

    guarded._ft_jax_deferred = True
    compilation_cache.put_executable_and_time = guarded


def report_bus_errors() -> None:
    """Make SIGBUS write one line before the process ends by it: a checkpoint file that shrank or was replaced while
    the model maps its pages (generate's default --bank-memory map) faults in a kernel thread, where no Python handler
    runs, so the line is written by a C-level handler (``_ffi.install_bus_error_message``). After set_label."""
    from ft_jax import _ffi

    _ffi.install_bus_error_message(
        f"\n{_state['label']}: bus error: a memory-mapped file (most likely the checkpoint, whose pages the expert "
        "banks map) shrank or was replaced while in use; leave the files alone while a model runs, or load with "
        "--bank-memory copy to keep no mapping\n")


#: The subcommands of `ft-jax` (ft_jax.cli.RUN), for the line of a signal that comes before the parser runs.
COMMANDS = ("generate", "serve", "profile", "trace", "plan")


def is_command_line() -> bool:
    """Whether this process is the `ft-jax` command (`ft-jax ...` or `python -m ft_jax ...`), not a program that
    imports ft_jax."""
    argv = getattr(sys, "orig_argv", sys.argv)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    as_module = any(a == "-m" and b in ("ft_jax", "ft_jax.__main__") for a, b in zip(argv, argv[1:]))
    return script in ("ft-jax", "ft_jax") or as_module


def install_for_command_line() -> None:
    """install() when this process is the `ft-jax` command (is_command_line), from the package's first import line,
    so that a signal during the imports (about a second of jax) is handled too; the line names the subcommand
    (`ft-jax generate: interrupted`) from then on when sys.argv[1] is one of COMMANDS."""
    if not is_command_line():
        return
    command = sys.argv[1] if len(sys.argv) > 1 else None
    if install(f"ft-jax {command}" if command in COMMANDS else "ft-jax"):
        protect_compile_cache_writes()
