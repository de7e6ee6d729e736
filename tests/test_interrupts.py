"""Ctrl-C / SIGTERM at any moment of `ft-jax generate` exit 130 / 143 with one line (issue 18, ft_jax/interrupts.py).

Before the fix, a SIGINT while XLA compiled raised KeyboardInterrupt in the main thread while the compile went on in
a worker thread; the interpreter then finalized, destroyed the PjRtClient, and the worker crashed (SIGSEGV), or the
interrupt was swallowed by _xla_gc_callback and the run went on (docs/DESIGN.md sec. 14).
"""

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = ["-m", "ft_jax", "generate", "--no-compile-cache", "--no-measure", "--temperature", "0",
            "--max-new-tokens", "250"]


@contextlib.contextmanager
def _sigint_not_ignored():
    """A background job may have SIGINT ignored (and children inherit SIG_IGN); a terminal has not. Caught handlers
    are reset to the default at exec, so the child starts as from a terminal (no preexec_fn: JAX warns on fork)."""
    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before is signal.SIG_IGN:
            signal.signal(signal.SIGINT, before)


def _wait_for(proc, stream, text: bytes, seen: bytearray, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while text not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.05)
        if ready:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                return False
            seen += chunk
    return text in seen


def _wait_handled(pid: int, timeout: float = 60.0) -> bool:
    """Wait until process ``pid`` catches SIGTERM (SigCgt in /proc/PID/status): ft_jax.interrupts is installed.
    A signal before that (the interpreter's own start-up, site-packages .pth files) gets Python's defaults."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        except (OSError, StopIteration):
            return False
        if caught & (1 << (signal.SIGTERM - 1)):
            return True
        time.sleep(0.005)
    return False


def interrupt_run(tmp_path, phase: str, sig=signal.SIGINT, rng=random):
    """Start `python -m ft_jax generate`, send ``sig`` during ``phase`` (startup: during the imports; compile: while
    XLA compiles the prefill step; decode: once the decode step is built), return (returncode, stderr text)."""
    env = dict(os.environ, PYTHONPATH=REPO, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)
    with _sigint_not_ignored():
        proc = subprocess.Popen([sys.executable, *GENERATE], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
    seen = bytearray()
    if phase == "startup":  # once ft_jax's first import line has run, while jax and the model are imported
        assert _wait_handled(proc.pid), "the handlers were never installed"
        time.sleep(rng.uniform(0.0, 0.8))
    elif phase == "compile":
        assert _wait_for(proc, proc.stderr, b"building the prefill", seen), bytes(seen)
        time.sleep(rng.uniform(0.0, 0.5))
    else:
        streamed = bytearray()  # the first streamed text: decoding has started
        assert _wait_for(proc, proc.stdout, b"\n", streamed), bytes(seen)
        time.sleep(rng.uniform(0.0, 0.05))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, (bytes(seen) + err).decode(errors="replace"), tmp_path


def check_clean_exit(rc, err, folder, sig):
    assert rc == 128 + sig, f"exit {rc}:\n{err}"
    assert "Traceback" not in err and "Exception ignored" not in err and "Fatal Python error" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    want = "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert lines[-1] == f"ft-jax generate: {want}", err  # the subcommand named from the first import line on
    assert sum(want in line for line in lines) == 1, err
    assert all(line.startswith("ft-jax") for line in lines), err  # progress notes and the one line, nothing else
    assert not [f for f in os.listdir(folder) if f.startswith("core")]


@pytest.mark.parametrize("phase,sig,tries", [("startup", signal.SIGINT, 4), ("compile", signal.SIGINT, 5),
                                             ("decode", signal.SIGINT, 2), ("startup", signal.SIGTERM, 1),
                                             ("compile", signal.SIGTERM, 1)])
def test_signal_exits_cleanly(tmp_path, phase, sig, tries):
    rng = random.Random(f"{phase}{sig}")
    for i in range(tries):
        folder = tmp_path / str(i)
        folder.mkdir()
        rc, err, _ = interrupt_run(folder, phase, sig, rng)
        check_clean_exit(rc, err, folder, sig)


def test_deferred_exit_waits_for_the_write(tmp_path):
    """A signal inside deferred_exit() exits when the block ends: the file is complete, the rest never runs."""
    out = tmp_path / "entry"
    code = f"""
import os, signal, time
from ft_jax import interrupts
assert interrupts.install("ft-jax test")
with interrupts.deferred_exit():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)
    with open({str(out)!r}, "w") as f:
        f.write("complete")
time.sleep(10)
print("not reached")
"""
    t0 = time.monotonic()
    with _sigint_not_ignored():
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert r.returncode == 130 and r.stderr.strip() == "ft-jax test: interrupted", r.stderr
    assert out.read_text() == "complete" and "not reached" not in r.stdout
    assert time.monotonic() - t0 < 8


def test_command_line_guards_jax_cache_writes():
    """`python -m ft_jax` installs the handlers at import and wraps JAX's persistent-cache write; a plain import of
    the library changes neither."""
    probe = ("import signal, ft_jax; from jax._src import compilation_cache as c; "
             "print(getattr(c.put_executable_and_time, '_ft_jax_deferred', False), "
             "signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)")
    env = dict(os.environ, PYTHONPATH=REPO)
    lib = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert lib.stdout.split() == ["False", "False"], lib.stderr
    cli = subprocess.run([sys.executable, "-c", "import sys; sys.orig_argv[1:] = ['-m', 'ft_jax']; " + probe],
                         capture_output=True, text=True, env=env, timeout=60)
    assert cli.stdout.split() == ["True", "True"], cli.stderr


def test_commands_are_the_subcommands():
    """The subcommands the signal line names before the parser runs are the command line's own."""
    from ft_jax import cli, interrupts

    assert sorted(interrupts.COMMANDS) == sorted(cli.RUN)
