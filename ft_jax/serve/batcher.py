"""The continuous batcher: one thread that owns a DecodeBatch (ft_jax/engine/batch.py) and serves every request.

HTTP handlers (asyncio) submit a request and get a Ticket: its events (text, done, error) arrive on an asyncio queue,
put there from the batcher thread with call_soon_threadsafe. The thread loops:

  1. run the calls other threads asked for (statistics, the rows view) and drop cancelled requests (a waiting one
     leaves the queue; a decoding one frees its row);
  2. if no prefill is running and rows are free: start one for the waiting requests, in order, as many as there are
     free rows (prompts of one chunk together; a longer prompt alone; with no row decoding, once no request has
     arrived for GATHER_S, at most GATHER_MAX_S, so that requests sent at the same time share one prefill);
  3. run one chunk of the running prefill; after its last chunk the rows join the batch (their first token is sent);
  4. one decode step over the decoding rows (DecodeBatch's row bucket), every row's token sent (stop strings held
     back by api.StopWatch);
  5. sleep until a request or a call arrives when there is nothing to do.

So a new request waits for at most one decode step and one prefill chunk of others before its own prefill starts,
and a long prompt delays the decoding rows by one chunk per step. A row ends at an EOS id, at a stop string, after
max_tokens tokens, when its client goes (cancel) or when its logits are not finite (that request alone fails). More
waiting requests than max_queue: submit raises QueueFullError (HTTP 429). docs/DESIGN.md sec. 16.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
import time
import traceback
from typing import Callable

from ft_jax import units
from ft_jax.api import StopWatch
from ft_jax.engine.batch import DecodeBatch
from ft_jax.engine.sampling import Sampling
from ft_jax.serve.protocol import GenerationParams


# When no row is decoding, a prefill group closes once no request has arrived for GATHER_S seconds (or the waiting
# requests fill the free rows), and at the latest GATHER_MAX_S after the batcher began to wait: clients that start
# together (or that were answered at the same step) then share one prefill instead of a lone one and a group. Their
# requests arrive up to ~20 ms apart on a loaded 2-core VM (docs/DESIGN.md sec. 16).
GATHER_S = 0.025
GATHER_MAX_S = 0.1


def gather_wait(waiting: int, free: int, since_arrival: float, since_start: float) -> float:
    """Seconds an idle batcher still waits before prefilling the ``waiting`` requests into ``free`` rows; 0: start
    now. since_arrival: seconds since the latest request arrived; since_start: since the batcher began to wait.
    Starts at once when nothing waits, when the waiting fill the free rows, after GATHER_S without an arrival, or
    GATHER_MAX_S after the wait began."""
    if waiting == 0 or waiting >= free:
        return 0.0
    return max(0.0, min(GATHER_S - since_arrival, GATHER_MAX_S - since_start))


class QueueFullError(RuntimeError):
    """The waiting queue is full: the client should retry after ``retry_after`` seconds."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"the server is busy: {units.count(waiting, 'request')} {'is' if waiting == 1 else 'are'} "
                         f"already waiting for a row (--max-queue); retry in {retry_after} s")
        self.retry_after = retry_after


class ClosedError(RuntimeError):
    """The server is shutting down (or its batcher failed to start) and takes no new request."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What a Ticket receives. kind: "text" (text), "done" (finish_reason "stop" | "length", completion_tokens) or
    "error" (message; the request failed)."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    message: str = ""


class Ticket:
    """One submitted request: its parameters, its events (an asyncio.Queue of Event on the submitting loop) and
    cancel(). Attributes: params, events, submitted (time.perf_counter at submit), cancelled."""

    def __init__(self, params: GenerationParams, loop: asyncio.AbstractEventLoop):
        self.params, self.loop = params, loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.cancelled = False
        self.finished = False
        self._wake: Callable[[], None] = lambda: None

    def cancel(self) -> None:
        """Give the request up (the client went): its row is freed at the next step boundary. Thread-safe; no
        effect once it has finished."""
        if not self.finished:
            self.cancelled = True
            self._wake()

    def emit(self, event: Event) -> None:
        """Deliver an event from the batcher thread (dropped when the client's loop is closed)."""
        if event.kind != "text":
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass


class _Row:
    """A decoding request: its ticket, its text (StopWatch), tokens generated, time of its last token."""

    def __init__(self, ticket: Ticket, watch: StopWatch):
        self.ticket, self.watch = ticket, watch
        self.generated = 0
        self.last = time.perf_counter()


class Batcher:
    """The continuous batcher (module docstring).

    Args:
        model: ft_jax.api.Model (engine, tokenizer, config). max_batch: B rows. ctx_size: KV entries per row.
        max_queue: requests that may wait beyond the free rows; one more gets QueueFullError (attribute; may be
            changed while running).
        metrics: the server's Metrics (ft_jax/serve/metrics.py), or None.
    """

    def __init__(self, model, *, max_batch: int, ctx_size: int, max_queue: int, metrics=None):
        self.model, self.metrics, self.max_queue = model, metrics, max_queue
        self.batch = DecodeBatch(model.engine, max_batch, ctx_size)
        self.eos = frozenset(model.config.eos_token_ids) | frozenset(getattr(model.tokenizer, "eos_token_ids", ()))
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.rows: dict[int, _Row] = {}  # decoding rows
        self.job = None  # the running PrefillJob
        self.job_tickets: list[Ticket] = []
        self.counts = collections.Counter()  # finished requests by reason: stop, length, cancelled, error
        self._lock = threading.Lock()  # guards waiting and the closed flag
        self._wake = threading.Event()
        self._calls: collections.deque = collections.deque()
        self._closed = False
        self._stop = False
        self._last_arrival = 0.0  # time.perf_counter of the latest submit
        self._thread = threading.Thread(target=self._run, name="ft_jax-batcher", daemon=True)
        self.step_seconds = 0.0  # the last decode step's wall time

    # ---- other threads -------------------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Compile the decode step and the one-row prefill of short prompts (before start; /health waits)."""
        self.batch.compile_decode()
        job = self.batch.start_prefill([0], [[0]], [Sampling(0.0)], [0])
        while not job.done:
            job.run_chunk()
        self.batch.release(0)
        self.batch.zero_cache_stats()  # /metrics and /cache count requests' routes, not the warm-up's

    def start(self) -> None:
        self._thread.start()

    def submit(self, params: GenerationParams, loop: asyncio.AbstractEventLoop) -> Ticket:
        """Queue a checked request; returns its Ticket. Raises QueueFullError (max_queue requests already wait) or
        ClosedError (shutting down)."""
        ticket = Ticket(params, loop)
        ticket._wake = self._wake.set
        with self._lock:
            if self._closed:
                raise ClosedError("the server is shutting down and takes no new request")
            free = len(self.batch.free_rows())
            if len(self.waiting) >= self.max_queue + free:
                raise QueueFullError(len(self.waiting) - free, self.retry_after())
            self.waiting.append(ticket)
            self._last_arrival = ticket.submitted
        if self.metrics is not None:
            self.metrics.on_submit(params)
        self._wake.set()
        return ticket

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: about one request's decode time, at least 1."""
        return max(1, round(self.step_seconds * 16))

    def call(self, fn: Callable, timeout: float = 30.0):
        """fn() run on the batcher thread between two steps; its result (or its exception). Raises TimeoutError
        when the thread does not get to it within timeout seconds (e.g. a compile)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.append((fn, future))
        self._wake.set()
        return future.result(timeout=timeout)

    def queue_depth(self) -> int:
        return len(self.waiting)

    def busy_rows(self) -> int:
        return int(self.batch.busy.sum())

    def rows_view(self) -> dict:
        """{"max_batch", "ctx_size", "busy", "free", "waiting", "prefilling", "finished": {reason: count},
        "rows": [{"row", "state": free | prefill | decode, "position", "generated"}]} (call on the batcher thread)."""
        batch = self.batch
        rows = []
        for r in range(batch.batch_size):
            state = "decode" if r in self.rows else ("prefill" if batch.busy[r] else "free")
            rows.append({"row": r, "state": state, "position": int(batch.positions[r]),
                         "generated": self.rows[r].generated if r in self.rows else 0})
        busy = int(batch.busy.sum())
        return {"max_batch": batch.batch_size, "ctx_size": batch.kv_len, "busy": busy,
                "free": batch.batch_size - busy, "waiting": len(self.waiting), "prefilling": len(self.job_tickets),
                "finished": dict(self.counts), "rows": rows}

    def close(self) -> None:
        """Take no new request (ClosedError); the queued and running ones go on."""
        with self._lock:
            self._closed = True

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything left (each gets an error event) and end the thread (joined up to timeout seconds)."""
        self.close()
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the batcher thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()
            self._serve_calls()
            self._drop_cancelled()
            if self.job is None:
                self._start_prefill()
            worked = False
            if self.job is not None:
                worked = True
                if self._guard(self.job.run_chunk) and self.job.done:
                    self._joined()
            if self.rows:
                worked = True
                t0 = time.perf_counter()
                tokens = self._guard(self.batch.decode)
                if tokens is not None:
                    self.step_seconds = time.perf_counter() - t0
                    self._deliver(tokens)
            if not worked:
                self._wake.wait(timeout=1.0)
        self._fail_all("the server is shutting down: the request was cancelled")
        self._serve_calls()

    def _serve_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

    def _guard(self, step: Callable):
        """step() or, if it raises, every running request failed with the error, the batch reset and None."""
        try:
            result = step()
            return True if result is None else result
        except Exception as e:  # an FFI or runtime error: the batch state may be gone
            traceback.print_exc()
            self._fail_all(f"the decode step failed: {type(e).__name__}: {e}")
            self.batch.reset()
            return None

    def _drop_cancelled(self) -> None:
        with self._lock:
            kept = [t for t in self.waiting if not t.cancelled]
            for t in self.waiting:
                if t.cancelled:
                    self._end(t, "cancelled")
            self.waiting = collections.deque(kept)
        for r, row in list(self.rows.items()):
            if row.ticket.cancelled:
                self._free(r)
                self._end(row.ticket, "cancelled", completion_tokens=row.generated)

    def _start_prefill(self) -> None:
        free = self.batch.free_rows()
        start = time.perf_counter()
        while not self.rows and not self._stop:  # idle: requests sent together arrive apart; prefill them as one group
            now = time.perf_counter()
            wait = gather_wait(len(self.waiting), len(free), now - self._last_arrival, now - start)
            if wait <= 0:
                break
            time.sleep(wait)
        chunk = self.model.engine.prefill_chunk
        group: list[Ticket] = []
        with self._lock:
            while self.waiting and len(group) < len(free):
                long = len(self.waiting[0].params.prompt_ids) > chunk
                if long and group:
                    break  # a prompt of several chunks is prefilled alone
                group.append(self.waiting.popleft())
                if long:
                    break
        if not group:
            return
        p = [t.params for t in group]
        self.job = self.batch.start_prefill(free[:len(group)], [x.prompt_ids for x in p], [x.sampling for x in p],
                                            [x.seed for x in p])
        self.job_tickets = group

    def _joined(self) -> None:
        job, tickets = self.job, self.job_tickets
        self.job, self.job_tickets = None, []
        now = time.perf_counter()
        for row, ticket, token in zip(job.rows, tickets, job.first_tokens.tolist()):
            if ticket.cancelled:
                self.batch.release(row)
                self._end(ticket, "cancelled")
                continue
            eos = frozenset() if ticket.params.ignore_eos else self.eos  # ignore_eos: an EOS token is text as any other
            self.rows[row] = _Row(ticket, StopWatch(self.model.tokenizer, ticket.params.stop, eos))
            if self.metrics is not None:
                self.metrics.on_first_token(now - ticket.submitted)
            self._push(row, token, now)

    def _deliver(self, tokens) -> None:
        now = time.perf_counter()
        for r in list(self.rows):
            self._push(r, int(tokens[r]), now)

    def _push(self, r: int, token: int, now: float) -> None:
        row = self.rows[r]
        ticket = row.ticket
        if token < 0:
            self._free(r)
            self._end(ticket, "error", completion_tokens=row.generated,
                      message="the model produced non-finite (NaN or infinite) logits for this request: nothing was "
                              "decoded from them")
            return
        if row.generated and self.metrics is not None:
            self.metrics.on_token(now - row.last)
        row.generated += 1
        row.last = now
        piece = row.watch.push(token)
        if piece:
            ticket.emit(Event("text", text=piece))
        eos = token in self.eos and not ticket.params.ignore_eos
        reason = ("stop" if eos or row.watch.cut is not None else
                  "length" if row.generated >= ticket.params.max_tokens else None)
        if reason is None:
            return
        rest = row.watch.finish()
        if rest:
            ticket.emit(Event("text", text=rest))
        self._free(r)
        self._end(ticket, reason, completion_tokens=row.generated)

    def _free(self, r: int) -> None:
        del self.rows[r]
        self.batch.release(r)

    def _end(self, ticket: Ticket, reason: str, completion_tokens: int = 0, message: str = "") -> None:
        """Send the request's last event (done, or an error for cancelled / error) and count it."""
        self.counts[reason] += 1
        if reason in ("stop", "length"):
            ticket.emit(Event("done", finish_reason=reason, completion_tokens=completion_tokens))
        else:
            ticket.emit(Event("error", message=message or "the request was cancelled"))
        if self.metrics is not None:
            self.metrics.on_end(reason, completion_tokens)

    def _fail_all(self, message: str) -> None:
        """Every running, prefilling and (when stopping) waiting request ends with an error event."""
        for r, row in list(self.rows.items()):
            self._free(r)
            self._end(row.ticket, "error", completion_tokens=row.generated, message=message)
        for ticket in self.job_tickets:
            self._end(ticket, "error", message=message)
        if self.job is not None:
            for r in self.job.rows:
                self.batch.release(r)
        self.job, self.job_tickets = None, []
        if self._stop:
            with self._lock:
                waiting, self.waiting = list(self.waiting), collections.deque()
            for ticket in waiting:
                self._end(ticket, "error", message=message)
