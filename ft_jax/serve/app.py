"""The FastAPI application of `ft-jax serve`: the OpenAI routes, /health, /metrics and the JSON views.

Routes:
  POST /v1/completions, /v1/chat/completions   OpenAI API (protocol.py); "stream": true answers with server-sent
                                               events ("data: {...}" per piece of text, "data: [DONE]" at the end)
  GET  /v1/models, /v1/models/{id}             the one model served (404 model_not_found for another id)
  GET  /health  (and HEAD)                     200 {"status": "ok"} when ready; 503 while loading or compiling
  GET  /metrics                                Prometheus text (metrics.py)
  GET  /cache                                  the expert cache: policy, slots, per-layer hits, misses, fills
  GET  /rows                                   the batch rows: free / prefill / decode, waiting requests

With an API key every route but /health needs ``Authorization: Bearer KEY`` (401 otherwise). Errors are OpenAI error
objects: {"error": {"message", "type", "param", "code"}}. A client that disconnects (streaming or not) cancels its
request, which frees its row at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ft_jax.serve.batcher import ClosedError, QueueFullError, Ticket
from ft_jax.serve.metrics import Metrics, cache_view
from ft_jax.serve.protocol import Answer, RequestError, error_body, parse_request

VIEW_TIMEOUT_S = 30.0  # a JSON view waits this long for the batcher thread (busy compiling: 503)
METRICS_VIEW_TIMEOUT_S = 1.0  # /metrics waits this long, then reports the last view read


class ServerState:
    """What the routes read: the status and, once loaded, the model, the batcher and the chat template.

    Attributes:
        status: "loading", "compiling", "ready", "failed" (detail says why) or "stopping".
        model_name: the id the answers and /v1/models report. api_key: None or the Bearer key. ctx_size: tokens per
        row. model, batcher, template (ChatTemplate, or the message a chat request gets): set by ready().
        metrics: Metrics.
    """

    def __init__(self, *, model_name: str, api_key: str | None, ctx_size: int, max_batch: int):
        self.status, self.detail = "loading", ""
        self.model_name, self.api_key, self.ctx_size = model_name, api_key, ctx_size
        self.model = self.batcher = self.template = None
        self._last_view: dict | None = None  # the expert cache view last read (a busy batcher's /metrics)
        self.created = int(time.time())
        self.metrics = Metrics(self._cache_view_for_metrics, lambda: self.batcher.queue_depth() if self.batcher else 0,
                               lambda: self.batcher.busy_rows() if self.batcher else 0, max_batch)

    def ready(self, model, batcher, template) -> None:
        self.model, self.batcher, self.template = model, batcher, template
        self.status = "ready"

    def cache_view(self, timeout: float = VIEW_TIMEOUT_S) -> dict:
        """The expert cache view (metrics.cache_view), read on the batcher thread. Raises TimeoutError."""
        batch = self.batcher.batch
        self._last_view = self.batcher.call(lambda: cache_view(batch.engine, *batch.read_cache_stats()), timeout)
        return self._last_view

    def _cache_view_for_metrics(self) -> dict | None:
        """The view for a /metrics scrape: the last one read when the batcher thread is busy (compiling) for longer
        than METRICS_VIEW_TIMEOUT_S, so a scrape answers within Prometheus' timeout (10 s by default)."""
        if self.status != "ready":
            return None
        try:
            return self.cache_view(METRICS_VIEW_TIMEOUT_S)
        except TimeoutError:
            return self._last_view


def _error(status: int, message: str, type: str, state: ServerState, headers: dict | None = None,
           param: str | None = None, code: str | None = None) -> JSONResponse:
    state.metrics.on_rejected(status)
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _not_ready(state: ServerState) -> JSONResponse:
    what = f"failed to load: {state.detail}" if state.status == "failed" else f"{state.status}, not ready yet"
    return _error(503, f"the server is {what}", "server_unavailable", state, headers={"Retry-After": "5"})


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


async def _stream(ticket: Ticket, answer: Answer):
    """The server-sent events of one request; leaving early (the client went) cancels it."""
    try:
        if answer.params.chat:
            yield _sse(answer.chunk("", first=True))
        while True:
            event = await ticket.events.get()
            if event.kind == "text":
                yield _sse(answer.chunk(event.text))
                continue
            if event.kind == "done":
                yield _sse(answer.chunk(None if answer.params.chat else "", event.finish_reason))
                if answer.params.include_usage:
                    yield _sse(answer.usage_chunk(event.completion_tokens))
            else:
                yield _sse(error_body(event.message, "server_error"))
            yield "data: [DONE]\n\n"
            return
    finally:
        ticket.cancel()  # no effect once finished


async def _collect(ticket: Ticket, request: Request):
    """The text and last event of a non-streamed request, or None when the client went (then it is cancelled)."""
    texts = []
    try:
        while True:
            get = asyncio.ensure_future(ticket.events.get())
            while not (await asyncio.wait({get}, timeout=0.5))[0]:
                if await request.is_disconnected():
                    get.cancel()
                    return None
            event = get.result()
            if event.kind == "text":
                texts.append(event.text)
                continue
            return "".join(texts), event
    finally:
        ticket.cancel()


class BearerAuth:
    """ASGI middleware: with an API key, every route but /health needs ``Authorization: Bearer KEY`` (the scheme in
    any case, RFC 7235 sec. 2.1); otherwise 401 with ``WWW-Authenticate: Bearer``. A plain ASGI middleware, not
    Starlette's BaseHTTPMiddleware, which hides a client's disconnect from Request.is_disconnected (starlette
    discussion #2094), so a non-streamed request whose client went would decode on."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        key = self.state.api_key
        if scope["type"] != "http" or key is None or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode()):
            return await self.app(scope, receive, send)
        response = _error(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                          "authentication_error", self.state, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a ServerState (module docstring for the routes)."""
    app = FastAPI(title="ft-jax serve", docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(BearerAuth, state=state)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method: OpenAI form
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"no route {request.url.path}" if exc.status_code == 404 else
                   f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405 else
                   str(exc.detail))
        return _error(exc.status_code, message, kind, state, headers=getattr(exc, "headers", None))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: the load balancers that probe with it
    def health():
        if state.status == "ready":
            return {"status": "ok"}
        body = {"status": state.status, **({"detail": state.detail} if state.detail else {})}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    def model_object() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "ft_jax"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")
    def model(model_id: str):
        if model_id != state.model_name:
            return _error(404, f"the model {json.dumps(model_id)} does not exist: this server serves "
                               f"{json.dumps(state.model_name)}",
                          "invalid_request_error", state, param="model", code="model_not_found")
        return model_object()

    @app.get("/metrics")
    def metrics():
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/cache")
    def cache():
        if state.status != "ready":
            return _not_ready(state)
        try:
            return state.cache_view()
        except TimeoutError:
            return _error(503, "the batcher is busy (compiling); try again", "server_unavailable", state)

    @app.get("/rows")
    def rows():
        if state.status != "ready":
            return _not_ready(state)
        try:
            return state.batcher.call(state.batcher.rows_view, VIEW_TIMEOUT_S)
        except TimeoutError:
            return _error(503, "the batcher is busy (compiling); try again", "server_unavailable", state)

    async def generate(request: Request, chat: bool):
        if state.status != "ready":
            return _not_ready(state)
        kind = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            return _error(415, f"the request body must be JSON (Content-Type: application/json), got Content-Type "
                               f"{kind!r}", "invalid_request_error", state)
        raw = await request.body()
        # The JSON and the tokenizer run in a worker thread: a huge prompt must not stall /health and the streams.
        try:
            body = await asyncio.to_thread(json.loads, raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            return _error(400, f"the request body is not valid JSON: {why}", "invalid_request_error", state)
        try:
            params = await asyncio.to_thread(parse_request, body, chat=chat, model=state.model,
                                             template=state.template, context=state.ctx_size,
                                             model_name=state.model_name)
            ticket = state.batcher.submit(params, asyncio.get_running_loop())
        except RequestError as e:
            return _error(e.status, e.message, e.type, state, param=e.param, code=e.code)
        except QueueFullError as e:
            return _error(429, str(e), "rate_limit_error", state, headers={"Retry-After": str(e.retry_after)})
        except ClosedError as e:
            return _error(503, str(e), "server_unavailable", state)
        answer = Answer(params)
        if params.stream:
            return StreamingResponse(_stream(ticket, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await _collect(ticket, request)
        if result is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        text, event = result
        if event.kind == "error":
            return JSONResponse(error_body(event.message, "server_error"), status_code=500)
        return answer.full(text, event.finish_reason, event.completion_tokens)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app
