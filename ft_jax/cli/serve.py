"""`ft-jax serve`: an OpenAI-compatible HTTP server (ft_jax/serve/) over one loaded model, with continuous batching.

The port is opened first (/health answers 503 while the model loads and the decode step compiles), then the model is
loaded on a thread of its own (a failure ends the command with status 1). SIGTERM or Ctrl-C: no new request is taken
(503), the running ones finish (up to --shutdown-timeout seconds, then they are cancelled) and the command exits with
status 0; a second signal exits at once, and so does the first one while the model is still loading or compiling
(130 / 143, ft_jax/interrupts.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import socket
import sys
import threading

from ft_jax import defaults, interrupts, units
from ft_jax.cli import arg_types
from ft_jax.cli.generate import _cache, _device_memory_note, add_load_arguments
from ft_jax.cli.usage import HelpFormatter, UsageError

DEFAULT_CTX = 4096  # tokens per row when the model's context is longer (--ctx-size)
DEFAULT_MAX_BATCH = 8
SHUTDOWN_MARGIN_S = 5.0  # uvicorn's own limit past --shutdown-timeout (the batcher cancels at the timeout)
MAX_BATCH = 256  # rows of the decode step; more is refused (each row is a KV cache of --ctx-size tokens)
EXAMPLES = """examples:
  ft-jax serve                                        # the bundled tiny model on http://127.0.0.1:8000
  ft-jax serve --model ~/models/Mixtral-8x7B-Instruct-v0.1 --cache-fraction 0.25 --max-batch 8 --ctx-size 8192
  ft-jax serve --host 0.0.0.0 --port 8080 --api-key "$KEY"     # reachable from other machines: set a key

  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0}'
  curl http://127.0.0.1:8000/metrics; curl http://127.0.0.1:8000/cache; curl http://127.0.0.1:8000/rows

Routes: /v1/completions, /v1/chat/completions (stream, stop, max_tokens, temperature, top_p, top_k, seed), /v1/models,
/health, /metrics (Prometheus), /cache (the expert cache), /rows (the batch rows). Needs the serve extra:
pip install 'ft-jax[serve]'."""


def add_arguments(sub) -> None:
    """The `serve` subparser on the subparsers object ``sub``."""
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (continuous batching)",
                       formatter_class=HelpFormatter, epilog=EXAMPLES,
                       description="Serve a Hugging Face MoE checkpoint folder (or the bundled model) over the OpenAI "
                       "completions and chat completions API, decoding up to --max-batch requests together.")
    p.add_argument("--model", type=arg_types.model_folder, metavar="PATH",
                   help="Hugging Face model folder (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=arg_types.port, default=8000, help="TCP port (default 8000)")
    p.add_argument("--max-batch", type=arg_types.positive_int, default=DEFAULT_MAX_BATCH, metavar="B",
                   help=f"requests decoded together: the rows of the decode step (default {DEFAULT_MAX_BATCH})")
    p.add_argument("--ctx-size", type=arg_types.positive_int, default=None, metavar="N",
                   help=f"tokens per row, prompt + generated (default: the model's context, at most {DEFAULT_CTX}); "
                        "the KV cache holds max-batch x N tokens")
    p.add_argument("--max-queue", type=arg_types.non_negative_int, default=64, metavar="N",
                   help="requests that may wait for a row (default 64); one more is answered 429 with Retry-After")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("FT_JAX_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $FT_JAX_API_KEY, "
                        "else none)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id the answers and /v1/models report (default: the model folder's name)")
    p.add_argument("--shutdown-timeout", type=arg_types.positive, default=30.0, metavar="SECONDS",
                   help="after SIGTERM / Ctrl-C, how long running requests may go on before they are cancelled "
                        "(default 30)")
    add_load_arguments(p, bank_memory="copy")
    p.add_argument("--verbose", action="store_true", help="show tracebacks and uvicorn's access log")


def _context(args, cfg) -> int:
    context = cfg.max_position_embeddings
    if args.ctx_size is None:
        return min(context, DEFAULT_CTX)
    if args.ctx_size > context:
        raise UsageError(f"--ctx-size {args.ctx_size} is more than the model's context of {context} tokens "
                         "(max_position_embeddings)")
    return args.ctx_size


def _load(args, path: str, cfg, state, note, on_failure) -> None:
    """Load the model, build and warm the batcher, mark the state ready; or mark it failed, say why and call
    on_failure()."""
    from ft_jax import api
    from ft_jax.chat import ChatTemplateError, load_chat_template
    from ft_jax.serve.batcher import Batcher

    def on_compile(text: str, finished: bool) -> None:  # also later, for a new prompt bucket (status stays ready)
        if state.status == "loading":
            state.status = "compiling"
        print(text if finished else f"ft-jax serve: {text}", end="\n" if finished else "", file=sys.stderr,
              flush=True)

    try:
        model = api.load(path, dtype=args.dtype or "auto", policy=args.policy, cache=_cache(args, cfg, note),
                         profile=args.profile, measure=not args.no_measure, on_message=note, on_compile=on_compile,
                         quantize=args.quantize, bank_memory=args.bank_memory,
                         weight_check=args.weight_check)
        _device_memory_note(args, cfg, model.engine.expert_bytes, note)
        model.engine.prefill_chunk = args.prefill_chunk
        try:
            template = load_chat_template(path)
        except ChatTemplateError as e:  # the message without the server's folder path
            template = f"{str(e).replace(path, repr(state.model_name))} (this model serves /v1/completions only)"
        batcher = Batcher(model, max_batch=args.max_batch, ctx_size=state.ctx_size, max_queue=args.max_queue,
                          metrics=state.metrics)
        batcher.warm_up()
        batcher.start()
    except Exception as e:  # reported by /health and on stderr; the server keeps answering 503
        state.status, state.detail = "failed", f"{type(e).__name__}: {e}"
        print(f"ft-jax serve: error: loading failed: {state.detail}", file=sys.stderr, flush=True)
        on_failure()
        return
    state.ready(model, batcher, template)
    banks = "mapped from the file" if args.bank_memory == "map" else "copied onto huge pages"
    print(f"ft-jax serve: ready: {state.model_name} on {_url(args.host, args.port)} (policy {model.policy}, "
          f"{units.count(args.max_batch, 'row')} of {state.ctx_size} tokens, expert banks {banks})", file=sys.stderr,
          flush=True)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, opened before anything is loaded so a taken port or a bad address is one
    clear error (uvicorn would report it only after the model has loaded, and exit with XLA's threads running).
    Raises UsageError naming the address."""
    if not host.strip():
        raise UsageError("--host is empty: give an address such as 127.0.0.1 (this machine) or 0.0.0.0 (every "
                         "interface)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (another server is on that port: pick another with --port)" if e.errno == 98 else ""
        raise UsageError(f"cannot listen on {_url(host, port)}: {e.strerror}{hint}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    """`ft-jax serve`: returns the exit status (0 after a SIGTERM / Ctrl-C shutdown)."""
    try:
        import uvicorn

        from ft_jax.serve.app import ServerState, create_app
    except ImportError as e:
        raise UsageError(f"ft-jax serve needs the serve extra (fastapi, uvicorn, prometheus-client): "
                         f"pip install 'ft-jax[serve]' ({e})") from None
    from ft_jax import api
    from ft_jax.config import load_config
    from ft_jax.tokenizer import TokenizerNotFoundError, load_tokenizer

    if args.api_key == "":
        raise UsageError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if args.max_batch > MAX_BATCH:
        raise UsageError(f"--max-batch {args.max_batch} is more than {MAX_BATCH} rows")
    path = args.model or defaults.bundled_model_path()
    cfg = load_config(path)
    try:
        load_tokenizer(path)
    except TokenizerNotFoundError:
        raise UsageError(f"{path} has no tokenizer.json: ft-jax serve answers with text, so it needs the model's "
                         "tokenizer (copy tokenizer.json from the model's Hub repository into the folder)") from None
    ctx = _context(args, cfg)
    if not args.no_compile_cache:
        off = api.enable_compile_cache(api.default_compile_cache_dir())
        if off:
            print(f"ft-jax serve: note: {off}", file=sys.stderr)
    name = args.model_name or os.path.basename(os.path.normpath(path))
    state = ServerState(model_name=name, api_key=args.api_key, ctx_size=ctx, max_batch=args.max_batch)
    notes = lambda text: print(f"ft-jax serve: {text}", file=sys.stderr, flush=True)  # noqa: E731
    # loop="asyncio": uvloop would take the signal wakeup fd that interrupts.py's watcher thread reads.
    sock = _listen(args.host, args.port)
    if args.api_key is None and not ipaddress.ip_address(sock.getsockname()[0]).is_loopback:
        notes(f"no --api-key: anyone who can reach {_url(args.host, args.port)} can use this server")
    # timeout_graceful_shutdown: a margin past --shutdown-timeout, when the batcher ends what is left with an error
    # event (so every stream closes with [DONE], never cut mid-body by uvicorn's own cancel).
    config = uvicorn.Config(create_app(state), loop="asyncio", access_log=args.verbose,
                            log_level="info" if args.verbose else "warning",
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S)

    class Server(uvicorn.Server):
        """No signal handlers of its own: interrupts.py's watcher thread asks it to stop (should_exit); uvicorn's
        would re-raise the signal after the shutdown, which ends the process with 143 instead of 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    server = Server(config)

    def shut_down(signum: int) -> None:
        if state.status in ("loading", "compiling"):  # nothing served yet: stop as every command does (130 / 143)
            interrupts.exit_now(signum)
        print(f"\nft-jax serve: shutting down: no new requests; the running ones finish within "
              f"{args.shutdown_timeout:g} s", file=sys.stderr, flush=True)
        state.status = "stopping"
        if state.batcher is not None:
            state.batcher.close()
            timer = threading.Timer(args.shutdown_timeout, state.batcher.stop)  # what is left ends with an error
            timer.daemon = True
            timer.start()
        server.should_exit = True

    def stop_server() -> None:
        server.should_exit = True

    interrupts.on_first_signal(shut_down)
    loader = threading.Thread(target=_load, args=(args, path, cfg, state, notes, stop_server), name="ft_jax-load",
                              daemon=True)
    loader.start()
    server.run(sockets=[sock])
    if state.batcher is not None:
        state.batcher.stop()
    if loader.is_alive():  # still loading or compiling: XLA threads must not see the interpreter finalize
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 1 if state.status == "failed" or not server.started else 0

