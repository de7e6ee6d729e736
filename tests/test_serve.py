"""`ft-jax serve` with real clients: the official openai package and httpx against a server on a free port.

One server (the bundled tiny model with a chat template added, 8 rows of 256 tokens, an API key) runs in this
process for the module, so the tests can read its rows and swap its weights; the SIGTERM test starts `ft-jax serve`
as a subprocess. References are Model.generate of the same model, each prompt alone.
"""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import jax
import jax.numpy as jnp
import openai
import pytest
import uvicorn

import ft_jax
from ft_jax.api import load_tokenizer_or_none, make_request
from ft_jax.chat import ChatTemplate, load_chat_template
from ft_jax.config import load_config
from ft_jax.serve.app import ServerState, create_app
from ft_jax.serve.batcher import GATHER_MAX_S, GATHER_S, Batcher, gather_wait
from ft_jax.serve.protocol import RequestError, parse_request

KEY = "test-key"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
ROWS, CTX = 8, 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The bundled model's files (linked) plus a tokenizer_config.json with a chat template."""
    folder = tmp_path_factory.mktemp("tiny_chat")
    bundled = ft_jax.bundled_model_path()
    for name in os.listdir(bundled):
        os.symlink(os.path.join(bundled, name), folder / name)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return str(folder)


@pytest.fixture(scope="module")
def server(model_dir):
    model = ft_jax.load(model_dir, policy="fetch-all", cache=0.5)
    state = ServerState(model_name="tiny", api_key=KEY, ctx_size=CTX, max_batch=ROWS)
    batcher = Batcher(model, max_batch=ROWS, ctx_size=CTX, max_queue=16, metrics=state.metrics)
    batcher.warm_up()
    batcher.start()
    state.ready(model, batcher, load_chat_template(model_dir))
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, loop="asyncio",
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)

    class Server:
        url = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {KEY}"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

    Server.model, Server.state, Server.batcher = model, state, batcher
    yield Server
    uv.should_exit = True
    thread.join(30)
    batcher.stop()


def _rows(server) -> dict:
    return httpx.get(server.url + "/rows", headers=server.headers).json()


def _wait_rows(server, predicate, timeout=30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        rows = _rows(server)
        if predicate(rows) or time.time() > deadline:
            return rows
        time.sleep(0.05)


def test_completions_and_chat_equal_generate_streamed_or_not(server):
    client, model = server.client, server.model
    ref = model.generate("ROMEO:", max_new_tokens=24, temperature=0)
    out = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=24, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 24, 30)
    assert out.model == "tiny" and out.object == "text_completion"
    events = list(client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(e.choices[0].text for e in events if e.choices) == ref.text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 24

    # stop strings: cut where they start, finish_reason "stop", as Model.generate
    ref = model.generate("ROMEO:", max_new_tokens=40, temperature=0, stop=["e"])
    out = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=40, temperature=0, stop="e")
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak."}]
    prompt = load_chat_template(model.path).render(messages)
    ref = model.generate(model.tokenizer.encode(prompt, add_special_tokens=False), max_new_tokens=20, temperature=0)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion" and out.usage.prompt_tokens == len(ref.prompt_ids[0])
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match='the model "other" does not exist: this server serves "tiny"'):
        client.models.retrieve("other")


def test_eight_concurrent_clients_each_equal_their_solo_run(server):
    prompts = ["ROMEO:", "JULIET: O", "KING HENRY:\nWhat", "A", "First Citizen:\n", "Nurse:", "MERCUTIO: Nay",
               "To be, or not"]
    requests = [dict(prompt=p, max_tokens=8 + 5 * i, temperature=0 if i % 2 else 0.9, seed=100 + i, top_p=0.95)
                for i, p in enumerate(prompts)]

    def ask(kwargs):
        return server.client.completions.create(model="tiny", **kwargs).choices[0].text

    solo = [ask(r) for r in requests]
    barrier = threading.Barrier(len(requests))

    def together(kwargs):
        barrier.wait()
        return ask(kwargs)

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        assert list(pool.map(together, requests)) == solo
    assert _wait_rows(server, lambda r: r["busy"] == 0)["busy"] == 0


@pytest.mark.parametrize("waiting, free, since_arrival, since_start, expected", [
    (0, 8, 0.0, 0.0, 0.0),                                  # nothing waits
    (8, 8, 0.0, 0.0, 0.0),                                  # the waiting fill the free rows
    (9, 8, 0.0, 0.0, 0.0),
    (1, 8, 0.0, 0.0, GATHER_S),                             # one just arrived: a quiet GATHER_S first
    (2, 8, 0.010, 0.020, GATHER_S - 0.010),                 # the latest arrived 10 ms ago
    (3, 8, GATHER_S, 0.050, 0.0),                           # quiet for GATHER_S: start
    (3, 8, 0.0, GATHER_MAX_S - 0.005, 0.005),               # still arriving: capped by GATHER_MAX_S
    (3, 8, 0.0, GATHER_MAX_S, 0.0),
])
def test_an_idle_batcher_gathers_until_arrivals_pause(waiting, free, since_arrival, since_start, expected):
    assert gather_wait(waiting, free, since_arrival, since_start) == pytest.approx(expected, abs=1e-12)


def test_the_end_of_sequence_token_ends_the_request_and_adds_no_text(server):
    """A request ends at an end-of-sequence id (finish_reason "stop", the id counted in usage), and that token's text
    is not in the answer, streamed or not; with ignore_eos it is text as any other. The bundled model has no EOS id,
    so the test gives the batcher one: a byte the greedy continuation produces."""
    free = server.model.generate("KING:", max_new_tokens=40, temperature=0)
    ids = free.token_ids[0]
    eos = ids[12]
    first = ids.index(eos)
    before = server.batcher.eos
    server.batcher.eos = frozenset({eos})
    try:
        out = server.client.completions.create(model="tiny", prompt="KING:", max_tokens=40, temperature=0)
        stream = server.client.completions.create(model="tiny", prompt="KING:", max_tokens=40, temperature=0,
                                                  stream=True)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        ignored = server.client.completions.create(model="tiny", prompt="KING:", max_tokens=40, temperature=0,
                                                   extra_body={"ignore_eos": True})
    finally:
        server.batcher.eos = before
    assert out.choices[0].text == streamed == free.text[:first] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == first + 1
    assert ignored.choices[0].text == free.text and ignored.choices[0].finish_reason == "length"


def test_a_huge_prompt_does_not_stall_the_other_requests(server):
    """A 30 MB prompt is parsed and tokenised off the event loop: /health answers while it is, then the prompt gets
    its 400 (over the context)."""
    big = {}

    def post():
        t0 = time.perf_counter()
        big["r"] = httpx.post(server.url + "/v1/completions", json={"prompt": "ab " * 10_000_000, "max_tokens": 1},
                              headers=server.headers, timeout=120)
        big["s"] = time.perf_counter() - t0

    thread = threading.Thread(target=post)
    thread.start()
    latencies = []
    while thread.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=120).status_code == 200
        if thread.is_alive():  # answered while the big request was still in the server
            latencies.append(time.perf_counter() - t0)
        time.sleep(0.02)
    thread.join()
    assert big["r"].status_code == 400 and big["r"].json()["error"]["code"] == "context_length_exceeded"
    assert len(latencies) >= 3 and max(latencies) < big["s"] / 3, (latencies, big["s"])


def test_a_client_that_disconnects_mid_stream_frees_its_row(server):
    """The batcher thread is held once the request decodes in its row (so it cannot finish first, however fast the
    model: the hold is offered at every step boundary from before the request is sent), the client disconnects;
    released, the batcher frees the row and counts the request cancelled."""
    batcher = server.batcher
    before = _rows(server)["finished"].get("cancelled", 0)
    entered, gate, stop = threading.Event(), threading.Event(), threading.Event()

    def hold():  # on the batcher thread, between two steps
        if not batcher.rows:  # not decoding yet (queued, prefilling) or not sent yet
            return False
        entered.set()
        gate.wait(60)
        return True

    def hold_when_decoding():
        while not stop.is_set() and not batcher.call(hold, 60):
            time.sleep(0.001)

    body = {"prompt": "ROMEO:", "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    holder = threading.Thread(target=hold_when_decoding)
    holder.start()
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as response:
            assert next(response.iter_lines()).startswith("data: ")
            assert entered.wait(30)
            assert batcher.busy_rows() == 1
            (row,) = batcher.rows.values()
        deadline = time.time() + 30
        while not row.ticket.cancelled and time.time() < deadline:  # the server noticed the disconnect
            time.sleep(0.01)
        assert row.ticket.cancelled
    finally:
        stop.set()
        gate.set()
        holder.join(60)
    rows = _wait_rows(server, lambda r: r["busy"] == 0)
    assert rows["busy"] == 0 and rows["free"] == ROWS and rows["finished"]["cancelled"] == before + 1
    assert all(r["state"] == "free" and r["position"] == -1 for r in rows["rows"])


def test_a_non_streamed_client_that_gives_up_is_cancelled(server):
    """The batcher thread held, a request without "stream" waits in the queue and its client gives up (read timeout):
    the server notices (a plain ASGI auth middleware keeps Request.is_disconnected working) and cancels it; released,
    the batcher drops it without decoding."""
    batcher, gate = server.batcher, threading.Event()
    before = _rows(server)["finished"]
    holder = threading.Thread(target=batcher.call, args=(gate.wait, 60))
    holder.start()
    body = {"prompt": "ROMEO:", "max_tokens": 200, "temperature": 0}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=1.0)
        (ticket,) = batcher.waiting
        deadline = time.time() + 30
        while not ticket.cancelled and time.time() < deadline:
            time.sleep(0.01)
        assert ticket.cancelled
    finally:
        gate.set()
        holder.join()
    after = _wait_rows(server, lambda r: r["finished"].get("cancelled", 0) > before.get("cancelled", 0))["finished"]
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)  # never decoded


def test_a_full_queue_answers_429_with_retry_after(server):
    """The batcher thread held (a call that waits): 8 requests wait for the 8 free rows, with max_queue 0 a ninth is
    refused; with max_queue 1 a ninth waits and a tenth is refused ("1 request is"); released, the 9 complete."""
    gate, batcher = threading.Event(), server.batcher
    holder = threading.Thread(target=batcher.call, args=(gate.wait, 60))
    holder.start()
    batcher.max_queue = 0
    body = {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}

    def post():
        return httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=60)

    try:
        with concurrent.futures.ThreadPoolExecutor(ROWS + 1) as pool:
            waiting = [pool.submit(post) for _ in range(ROWS)]
            while batcher.queue_depth() < ROWS:
                time.sleep(0.01)
            r = post()
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert r.json()["error"]["message"].startswith("the server is busy: 0 requests are already waiting")
            batcher.max_queue = 1
            waiting.append(pool.submit(post))
            while batcher.queue_depth() < ROWS + 1:
                time.sleep(0.01)
            r = post()
            assert r.status_code == 429, r.text
            assert r.json()["error"]["message"].startswith("the server is busy: 1 request is already waiting for a row")
            gate.set()
            assert [w.result().status_code for w in waiting] == [200] * (ROWS + 1)
    finally:
        gate.set()
        batcher.max_queue = 16
        holder.join()


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x", "temperature": "hot"}, "temperature", "'temperature' must be a number >= 0"),
    ({"prompt": "x", "temperature": -1}, "temperature", "'temperature' must be a finite number >= 0, got -1"),
    ({"prompt": "x", "top_p": 0}, "top_p", "'top_p' must be in (0, 1], got 0"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ({"prompt": "x", "seed": -3}, "seed", "'seed' must be an integer in [0, 2^32), got -3"),
    ({"prompt": "x", "n": 2}, "n", "'n' must be 1"),
    ({"prompt": "x", "logprobs": 3}, "logprobs", "'logprobs' is not supported"),
    # 0 asks for the sampled token's log-probability: not the harmless false / null
    ({"prompt": "x", "logprobs": 0}, "logprobs", "'logprobs' is not supported by this server (got 0)"),
    ({"prompt": "x", "presence_penalty": False}, "presence_penalty", "'presence_penalty' is not supported"),
    ({"prompt": "x", "stop": [1]}, "stop", "'stop[0]' must be a string, got a number: 1"),
    ({"prompt": ["a", "b"]}, "prompt", "holds 2 prompts"),
    ({"prompt": [1, 300]}, "prompt", "'prompt[1]' must be a token id in the vocabulary [0, 256), got 300"),
    ({"prompt": "x" * 200, "max_tokens": 100}, "prompt",
     "prompt of 200 tokens + 100 new tokens exceeds the server's context of 256 tokens (--ctx-size)"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed with 'stream'"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", "'stop' may hold at most 16 strings of at most 256 characters"),
    ({"prompt": "x", "stop": "a" * 257}, "stop", "got 1 (longest 257)"),
    ({"prompt": ""}, "prompt", "'prompt' is empty"),
    ({"prompt": [[[1]]]}, "prompt", "'prompt[0][0]' must be a token id (an integer), got an array: [1]"),
    ({"prompt": "x", "model": 4}, "model", "'model' must be a string, got a number: 4"),
    # values are shown as the client wrote them (JSON), not as Python reprs
    ({"prompt": "x", "stop": [""]}, "stop", """'stop' strings must be non-empty, got [""]"""),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "'max_tokens' must be an integer >= 1, got a boolean: true"),
    ({"prompt": "x", "echo": True}, "echo", "'echo' is not supported by this server (got true)"),
])
def test_malformed_requests_get_400_naming_the_field(server, body, param, message):
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    if param == "prompt" and "context" in message:
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body, chat, param, message", [
    # a list where a string is expected, a dict where a number or an array is: JSON's type names, JSON's values
    ({"prompt": "x", "model": ["tiny"]}, False, "model", """'model' must be a string, got an array: ["tiny"]"""),
    ({"prompt": "x", "temperature": {"value": 0.5}}, False, "temperature",
     """'temperature' must be a number >= 0, got an object: {"value": 0.5}"""),
    ({"prompt": "x", "stop": {"a": 1}}, False, "stop",
     """'stop' must be a string or an array of strings, got an object: {"a": 1}"""),
    ({"prompt": {"text": "x"}}, False, "prompt",
     """'prompt' must be a non-empty string or an array of token ids, got an object: {"text": "x"}"""),
    ({"prompt": "x", "stream": True, "stream_options": [True]}, False, "stream_options",
     "'stream_options' must be an object, got an array: [true]"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, False,
     "stream_options.include_usage", """'stream_options.include_usage' must be true or false, got a string: "yes\""""),
    # an array of the right type with an element of the wrong one: the element named, with its JSON type
    ({"prompt": "x", "stop": [1]}, False, "stop", "'stop[0]' must be a string, got a number: 1"),
    ({"prompt": "x", "stop": ["a", None]}, False, "stop", "'stop[1]' must be a string, got null"),
    ({"prompt": "x", "stop": ["a", ["b"]]}, False, "stop", """'stop[1]' must be a string, got an array: ["b"]"""),
    ({"prompt": [1, 2, "x"]}, False, "prompt", """'prompt[2]' must be a token id (an integer), got a string: "x\""""),
    ({"prompt": [1, True]}, False, "prompt", "'prompt[1]' must be a token id (an integer), got a boolean: true"),
    ({"prompt": [1, 2.5]}, False, "prompt", "'prompt[1]' must be a token id (an integer), got a number: 2.5"),
    ({"prompt": [[1, "x"]]}, False, "prompt",  # a batch of one prompt
     """'prompt[0][1]' must be a token id (an integer), got a string: "x\""""),
    ({"prompt": [[[1]]]}, False, "prompt", "'prompt[0][0]' must be a token id (an integer), got an array: [1]"),
    ({"prompt": ["a", 1]}, False, "prompt", "'prompt[1]' must be a string or an array of token ids, got a number: 1"),
    ({"prompt": ["a", "b"]}, False, "prompt", "'prompt' holds 2 prompts; this server takes one prompt per request"),
    ({"prompt": []}, False, "prompt", "'prompt' is empty: give a non-empty string or an array of token ids"),
    ({"prompt": [""]}, False, "prompt", "'prompt[0]' is empty: give a non-empty string or an array of token ids"),
    ({"prompt": 7}, False, "prompt",  # a wrong type at the top level: the whole value
     "'prompt' must be a non-empty string or an array of token ids, got a number: 7"),
    ({"prompt": "x", "max_tokens": 1e9}, False, "max_tokens",  # an integer-valued float is still "a number"
     "'max_tokens' must be an integer >= 1, got a number: 1000000000.0"),
    ({"prompt": "x", "top_k": "3"}, False, "top_k", """'top_k' must be an integer >= 0, got a string: "3\""""),
    ({"messages": {"role": "user", "content": "hi"}}, True, "messages",
     "'messages' must be a non-empty array of {role, content} objects, got an object: "
     """{"role": "user", "content": "hi"}"""),
    ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, True, "messages[0].content",
     """'messages[0].content' must be a string or an array of text parts, got an object: {"text": "hi"}"""),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, True, "messages[0].role",
     """'messages[0].role' must be one of system, developer, user, assistant, got an array: ["user"]"""),
    (["x"], False, None, """the request body must be a JSON object, got an array: ["x"]"""),
    # fields accepted and unused must still have their OpenAI type
    ({"prompt": "x", "user": 5}, False, "user", "'user' must be a string, got a number: 5"),
    ({"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": 0}, True, "parallel_tool_calls",
     "'parallel_tool_calls' must be true or false, got a number: 0"),
    ({"messages": [{"role": "user", "content": "hi"}], "metadata": 5}, True, "metadata",
     "'metadata' must be an object, got a number: 5"),
    ({"prompt": "x", "n": 1.0}, False, "n", "'n' must be 1 (one choice per request), got 1.0"),
])
def test_type_errors_use_json_type_names(body, chat, param, message):
    # Checked before the prompt is tokenized: no model or server needed.
    with pytest.raises(RequestError) as e:
        parse_request(body, chat=chat, model=None, template="no chat template", context=CTX, model_name="tiny")
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)
    assert not re.search(r"\b(list|dict|str|int|float|bool|NoneType|True|False|None)\b", message), message


@pytest.fixture(scope="module")
def offline_model():
    """What parse_request uses of a Model (path, config, tokenizer, request = ft_jax.api.make_request) for the
    bundled model (vocabulary [0, 256)), without its weights: the real checks and messages of make_request."""
    path = ft_jax.bundled_model_path()
    model = types.SimpleNamespace(path=path, config=load_config(path), tokenizer=load_tokenizer_or_none(path))
    model.request = lambda prompts, **kw: make_request(model.path, model.config, model.tokenizer, prompts, **kw)
    return model


@pytest.mark.parametrize("text, chat, param, message", [
    # token ids outside the vocabulary: checked before make_request, naming the position (no batch index)
    ('{"prompt": [70, 999999]}', False, "prompt",
     "'prompt[1]' must be a token id in the vocabulary [0, 256), got 999999"),
    ('{"prompt": [[70, -1]]}', False, "prompt", "'prompt[0][1]' must be a token id in the vocabulary [0, 256), got -1"),
    # make_request's and Sampling's messages re-phrased: the field quoted as in the server's own messages
    ('{"prompt": "x", "temperature": -1}', False, "temperature", "'temperature' must be a finite number >= 0, got -1"),
    ('{"prompt": "x", "temperature": -0.5}', True, "temperature",
     "'temperature' must be a finite number >= 0, got -0.5"),
    ('{"prompt": "x", "temperature": 1e-20}', False, "temperature",
     "'temperature' of 1e-20 is outside [1e-10, 1e+10] (0 = greedy): logits / temperature would overflow or "
     "underflow float32"),
    ('{"prompt": "x", "temperature": 100000000000000000000}', False, "temperature",  # past int64: as a double
     "'temperature' of 1e+20 is outside [1e-10, 1e+10] (0 = greedy): logits / temperature would overflow or "
     "underflow float32"),
    ('{"prompt": "x", "top_p": 0}', False, "top_p", "'top_p' must be in (0, 1], got 0"),
    ('{"prompt": "x", "top_p": 1.5}', False, "top_p", "'top_p' must be in (0, 1], got 1.5"),
    ('{"prompt": "x", "top_k": -1}', False, "top_k", "'top_k' must be an integer in [0, 2^31), got -1"),
    ('{"prompt": "x", "seed": -3}', False, "seed", "'seed' must be an integer in [0, 2^32), got -3"),
    ('{"prompt": "x", "seed": 4294967296}', False, "seed", "'seed' must be an integer in [0, 2^32), got 4294967296"),
    # non-finite numbers (NaN, Infinity, -Infinity are not JSON, but Python's parser reads them; 1e999 overflows):
    # refused naming the field, shown as JSON spells them
    ('{"prompt": "x", "temperature": Infinity}', False, "temperature",
     "'temperature' must be a finite number, got Infinity"),
    ('{"prompt": "x", "temperature": 1e999}', False, "temperature",
     "'temperature' must be a finite number, got Infinity"),
    ('{"prompt": "x", "temperature": NaN}', True, "temperature", "'temperature' must be a finite number, got NaN"),
    ('{"prompt": "x", "top_p": -Infinity}', False, "top_p", "'top_p' must be a finite number, got -Infinity"),
    ('{"prompt": "x", "top_p": -1e999}', False, "top_p", "'top_p' must be a finite number, got -Infinity"),
    ('{"prompt": "x", "temperature": 1' + "0" * 400 + '}', False, "temperature",  # an integer past a double
     "'temperature' must be a finite number, got 1" + "0" * 199 + "..."),
    ('{"prompt": "x", "max_tokens": Infinity}', False, "max_tokens",
     "'max_tokens' must be an integer >= 1, got a number: Infinity"),
    ('{"prompt": "x", "top_k": NaN}', False, "top_k", "'top_k' must be an integer >= 0, got a number: NaN"),
    ('{"prompt": "x", "seed": 1e999}', False, "seed", "'seed' must be an integer in [0, 2^32), got a number: Infinity"),
    ('{"prompt": "x", "seed": 1e10}', False, "seed",  # an integer-valued float: json.dumps's spelling
     "'seed' must be an integer in [0, 2^32), got a number: 10000000000.0"),
    ('{"prompt": "x", "n": NaN}', False, "n", "'n' must be 1 (one choice per request), got NaN"),
    ('{"prompt": "x", "presence_penalty": Infinity}', False, "presence_penalty",
     "'presence_penalty' is not supported by this server (got Infinity)"),
    ('{"prompt": [70, -Infinity]}', False, "prompt",
     "'prompt[1]' must be a token id (an integer), got a number: -Infinity"),
    ('{"prompt": "x", "stop": ["a", NaN]}', False, "stop", "'stop[1]' must be a string, got a number: NaN"),
])
def test_value_errors_name_the_field(offline_model, text, chat, param, message):
    body = json.loads(text)  # as the server parses the request body
    if chat:
        body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
    with pytest.raises(RequestError) as e:
        parse_request(body, chat=chat, model=offline_model, template=ChatTemplate("test", CHAT_TEMPLATE),
                      context=CTX, model_name="tiny")
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)
    assert not re.search(r"\b(inf|nan|list|dict|tuple|NoneType|True|False|None|prompt \d)\b", message), message


def test_valid_numbers_pass_as_written(offline_model):
    body = json.loads('{"prompt": [[70, 255]], "temperature": 1e-5, "top_p": 1, "top_k": 3, "seed": 4294967295, '
                      '"max_tokens": 2, "stop": ["a"]}')
    params = parse_request(body, chat=False, model=offline_model, template="no chat template", context=CTX,
                           model_name="tiny")
    assert params.prompt_ids == [70, 255] and params.max_tokens == 2 and params.seed == 2**32 - 1
    assert (params.sampling.temperature, params.sampling.top_p, params.sampling.top_k) == (1e-5, 1, 3)
    assert params.stop == ("a",)


def _parse(body, chat, model):
    return parse_request(body, chat=chat, model=model, template=ChatTemplate("test", CHAT_TEMPLATE), context=CTX,
                         model_name="tiny")


def test_the_developer_role_is_rendered_as_system(offline_model):
    def ids(role):
        return _parse({"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]}, True,
                      offline_model).prompt_ids

    assert ids("developer") == ids("system") == offline_model.tokenizer.encode("<system>Be brief.\n<user>Hi\n<assistant>")


@pytest.mark.parametrize("text, chat, param, message", [
    # a field of neither OpenAI request body nor the extensions: refused as OpenAI refuses it, a close name suggested
    ('{"prompt": "R", "max_tokens": 3, "foo": 1}', False, "foo", "Unrecognized request argument supplied: foo"),
    ('{"prompt": "R", "max_token": 3}', False, "max_token",
     "Unrecognized request argument supplied: max_token (did you mean 'max_tokens'?)"),
    ('{"prompt": "R", "temprature": 0}', True, "temprature",
     "Unrecognized request argument supplied: temprature (did you mean 'temperature'?)"),
    ('{"prompt": "R", "top-p": 0.5}', False, "top-p", "Unrecognized request argument supplied: top-p (did you mean "
     "'top_p'?)"),
    ('{"prompt": "R", "repetition_penalty": 1.1}', False, "repetition_penalty",  # no far-fetched suggestion
     "Unrecognized request argument supplied: repetition_penalty"),
    # a field of the other endpoint: said so
    ('{"prompt": "R", "max_completion_tokens": 3}', False, "max_completion_tokens",
     "Unrecognized request argument supplied: max_completion_tokens (a field of /v1/chat/completions)"),
    ('{"prompt": "R", "messages": []}', False, "messages",
     "Unrecognized request argument supplied: messages (a field of /v1/chat/completions)"),
    ('{"messages": [{"role": "user", "content": "R"}], "prompt": "R"}', True, "prompt",
     "Unrecognized request argument supplied: prompt (a field of /v1/completions)"),
    ('{"prompt": "R", "echo": false}', True, "echo",
     "Unrecognized request argument supplied: echo (a field of /v1/completions)"),
    # inside stream_options; a name that is not valid Unicode shown as JSON escapes it
    ('{"prompt": "R", "stream": true, "stream_options": {"include_usuage": true}}', False,
     "stream_options.include_usuage",
     "Unrecognized request argument supplied: stream_options.include_usuage (did you mean 'include_usage'?)"),
    ('{"prompt": "R", "\\udc00": 1}', False, "\\udc00", "Unrecognized request argument supplied: \\udc00"),
    # an empty name is said to be one (the message ended in ": " before)
    ('{"prompt": "R", "": 1}', False, "", "Unrecognized request argument supplied: '' (an empty name)"),
    ('{"prompt": "R", "stream": true, "stream_options": {"": 1}}', False, "stream_options",
     "Unrecognized request argument supplied: '' (an empty name in stream_options)"),
    # a very long name is cut (it is echoed twice: message and param)
    pytest.param('{"prompt": "R", "%s": 1}' % ("k" * 5000), False, "k" * 100 + "...",
                 "Unrecognized request argument supplied: " + "k" * 100 + "...", id="a-5000-character-name"),
])
def test_unknown_fields_are_refused_naming_them(offline_model, text, chat, param, message):
    body = json.loads(text)
    if chat and "messages" not in body:
        body = {"messages": [{"role": "user", "content": body.pop("prompt")}], **body}
    with pytest.raises(RequestError) as e:
        _parse(body, chat, offline_model)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


def test_openai_fields_that_change_nothing_are_accepted(offline_model):
    both = {"model": "tiny", "max_tokens": 2, "user": "u1", "n": 1, "seed": 1, "temperature": 0, "top_p": 1,
            "top_k": 0, "ignore_eos": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "stop": None, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    params = _parse({"prompt": "R", **both, "logprobs": None, "echo": False, "best_of": 1, "suffix": ""}, False,
                    offline_model)
    assert (params.max_tokens, params.include_usage) == (2, True)
    chat = {"messages": [{"role": "user", "content": "R"}], **both, "max_completion_tokens": 3, "logprobs": False,
            "top_logprobs": 0, "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
            "modalities": ["text"], "safety_identifier": "s", "prompt_cache_key": "p", "audio": None}
    assert _parse(chat, True, offline_model).max_tokens == 3


@pytest.mark.parametrize("text, chat, param, where, at, surrogate", [
    ('{"prompt": "\\u0000\\udc00"}', False, "prompt", "prompt", 1, "\\udc00"),
    ('{"prompt": ["ab\\ud800"]}', False, "prompt", "prompt[0]", 2, "\\ud800"),
    ('{"prompt": "R", "stop": "\\udfff"}', False, "stop", "stop", 0, "\\udfff"),
    ('{"prompt": "R", "stop": ["a", "b\\ud83d"]}', False, "stop", "stop[1]", 1, "\\ud83d"),
    ('{"messages": [{"role": "user", "content": "hi \\udc00"}]}', True, "messages[0].content",
     "messages[0].content", 3, "\\udc00"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, '
     '{"type": "text", "text": "\\ude00"}]}]}', True, "messages[0].content", "messages[0].content[1].text", 0, "\\ude00"),
])
def test_unpaired_surrogates_are_refused_naming_field_and_position(offline_model, text, chat, param, where, at,
                                                                   surrogate):
    with pytest.raises(RequestError) as e:
        _parse(json.loads(text), chat, offline_model)
    assert (e.value.status, e.value.param, e.value.message) == (
        400, param, f"'{where}' contains an unpaired UTF-16 surrogate ({surrogate}) at character {at}; send valid "
                    "Unicode")
    # a surrogate pair is one character, valid: encoded as UTF-8
    assert _parse(json.loads('{"prompt": "\\ud83d\\ude00"}'), False, offline_model).prompt_ids == [240, 159, 152, 128]


def test_unknown_fields_and_surrogates_over_http(server):
    post = lambda body: httpx.post(server.url + "/v1/completions", headers={**server.headers,  # noqa: E731
                                   "Content-Type": "application/json"}, content=body)
    r = post(b'{"prompt": "R", "max_tokens": 3, "foo": 1}')
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "Unrecognized request argument supplied: foo", "type": "invalid_request_error", "param": "foo",
        "code": None}
    with pytest.raises(openai.BadRequestError, match=r"max_token \(did you mean 'max_tokens'\?\)"):
        server.client.completions.create(model="tiny", prompt="R", extra_body={"max_token": 3})
    r = post(b'{"prompt": "\\u0000\\udc00"}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["message"] == ("'prompt' contains an unpaired UTF-16 surrogate (\\udc00) at character 1; "
                                            "send valid Unicode")
    r = post(b'{"prompt": "R", "model": "\\udc00"}')  # echoed as JSON escapes it (a lone surrogate is not UTF-8)
    assert r.status_code == 404 and r.json()["error"]["message"].startswith('the model "\\udc00" does not exist')


def test_chat_field_errors_and_bodies_that_are_not_json(server):
    post = lambda path, **kw: httpx.post(server.url + path, headers=server.headers, **kw)  # noqa: E731
    r = post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post("/v1/completions", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x"}',
                   headers={**server.headers, "Content-Type": "text/plain"})
    assert r.status_code == 415 and "'text/plain'" in r.json()["error"]["message"]
    r = post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    error = r.json()["error"]
    assert r.status_code == 404 and error["code"] == "model_not_found" and error["message"].startswith('the model "gpt-4" does not exist: this server serves "tiny"')


def test_unknown_routes_and_methods_get_openai_error_objects(server):
    r = httpx.get(server.url + "/v1/embeddings", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route /v1/embeddings"
    r = httpx.get(server.url + "/v1/completions", headers=server.headers)
    assert r.status_code == 405 and r.json()["error"]["message"] == "GET is not allowed on /v1/completions"


def test_listen_refuses_a_taken_port_and_a_bad_host_before_loading():
    from ft_jax.cli.serve import _listen
    from ft_jax.cli.usage import UsageError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"cannot listen on http://127.0.0.1:{port}: .*pick another with --port"):
            _listen("127.0.0.1", port)
    with pytest.raises(UsageError, match="--host is empty"):
        _listen("", port)
    with pytest.raises(UsageError, match="--host '999.1.1.1' is not an address of this machine"):
        _listen("999.1.1.1", port)


def test_api_key_is_required_except_for_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.head(server.url + "/health").status_code == 200  # load balancers that probe with HEAD (was 405)
    for path in ("/v1/models", "/metrics", "/rows"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=1)


def test_non_finite_logits_fail_only_that_request(server):
    engine, tilde = server.model.engine, ord("~")
    good = engine.params
    bad = jax.tree_util.tree_map(lambda x: x, good)
    bad["embed_tokens"] = bad["embed_tokens"].replace(good["embed_tokens"][...].at[tilde].set(jnp.nan))
    ref = server.client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=30, temperature=0)
    with engine._lock:
        engine.params = bad
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            fine = pool.submit(server.client.completions.create, model="tiny", prompt="ROMEO:", max_tokens=30,
                               temperature=0)
            broken = pool.submit(httpx.post, server.url + "/v1/completions", headers=server.headers,
                                 json={"prompt": "~ROMEO", "max_tokens": 30})
            assert fine.result().choices[0].text == ref.choices[0].text
            r = broken.result()
    finally:
        with engine._lock:
            engine.params = good
    assert r.status_code == 500 and "non-finite" in r.json()["error"]["message"]
    assert _wait_rows(server, lambda r: r["busy"] == 0)["busy"] == 0


def test_metrics_and_the_expert_cache_view(server):
    server.client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['ft_jax_requests_total{endpoint="completions"}'] >= 1
    assert values["ft_jax_time_to_first_token_seconds_count"] >= 1
    assert values["ft_jax_time_per_output_token_seconds_count"] >= 3
    assert values["ft_jax_max_batch"] == ROWS and values["ft_jax_queue_depth"] == 0
    cache = httpx.get(server.url + "/cache", headers=server.headers).json()
    assert cache["policy"] == "fetch-all" and cache["num_slots"] == 16 and len(cache["layers"]) == 4
    for layer in cache["layers"]:
        assert layer["hits"] + layer["misses"] == layer["active"] and layer["fetched"] <= layer["misses"]
    totals = cache["totals"]
    assert totals["active"] == sum(l["active"] for l in cache["layers"]) > 0
    assert values["ft_jax_expert_cache_hits_total"] == pytest.approx(totals["hits"], rel=0.5)
    assert totals["fill_bytes"] == totals["fetched"] * cache["expert_bytes"]
    # A batcher thread busy for longer (compiling a new bucket, here a sleep) does not hold a scrape past Prometheus'
    # timeout: /metrics answers with the expert counters last read (those of /cache above: nothing ran since).
    busy = threading.Thread(target=server.batcher.call, args=(lambda: time.sleep(4), 10))
    busy.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    waited = time.perf_counter() - t0
    busy.join()
    assert waited < 3 and f"ft_jax_expert_cache_active_total {float(totals['active'])}" in text, (waited, text)


def test_the_warm_up_is_not_counted_in_the_expert_cache():
    model = ft_jax.load(policy="fetch-all", cache=0.5)
    batcher = Batcher(model, max_batch=2, ctx_size=64, max_queue=1)
    batcher.warm_up()  # a decode compile and a one-token prefill, whose routes reach the counters
    stats, _ = batcher.batch.read_cache_stats()
    assert not stats.any(), stats


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_thousand_short_requests_keep_memory_flat(server):
    body = {"prompt": "ROMEO:", "max_tokens": 2, "temperature": 0.5}

    def run(n):
        with httpx.Client(headers=server.headers, timeout=60) as http:
            for _ in range(n):
                assert http.post(server.url + "/v1/completions", json=body).status_code == 200

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(run, [13] * 8))  # 104 to warm up (every executable built, allocator pools grown)
        before = _rss_bytes()
        list(pool.map(run, [112] * 8))  # then 896: 1000 in all
    after = _rss_bytes()
    assert after <= before * 1.05, (before, after)
    assert _rows(server)["busy"] == 0


def test_ctrl_c_while_compiling_exits_130_at_once(tmp_path):
    """Before the server is ready a Ctrl-C ends it as any command: one line, exit 130, no further compile. (On every
    interface without an API key it says so.)"""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ft_jax", "serve", "--port", str(port), "--max-batch", "8",
                             "--ctx-size", "64", "--policy", "host-all", "--no-compile-cache", "--host", "0.0.0.0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health").json()
            except httpx.TransportError:
                health = {}
            if health.get("status") == "compiling":
                break
            time.sleep(0.05)
        assert health.get("status") == "compiling", (health, proc.poll())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert stderr.endswith("\nft-jax serve: interrupted\n") and "ready" not in stderr, stderr
    assert f"no --api-key: anyone who can reach http://0.0.0.0:{port} can use this server" in stderr


def test_sigterm_finishes_the_running_request_and_exits_0(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ft_jax", "serve", "--port", str(port), "--max-batch", "1",
                             "--ctx-size", "64", "--policy", "host-all"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        seen = set()
        while True:
            try:
                status = httpx.get(url + "/health").status_code
            except httpx.TransportError:
                status = None
            seen.add(status)
            if status == 200 or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert 503 in seen and status == 200, (seen, proc.poll())  # 503 while loading and compiling
        body = {"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    ready = "(policy host-all, 1 row of 64 tokens, expert banks copied onto huge pages)"  # serve's default: copy
    assert "shutting down" in stderr and ready in stderr and "no --api-key" not in stderr, stderr
