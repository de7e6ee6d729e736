"""The OpenAI HTTP API's request and response objects for /v1/completions and /v1/chat/completions (no web
framework here: app.py routes, this module parses and formats).

Requests are parsed field by field (RequestError names the field, as OpenAI's error object does in "param"; the
message quotes it, with the element of an array: 'stop[1]', 'prompt[2]'), then checked by ft_jax.api.make_request with
the server's context, the one place every generation request is checked; its messages name its arguments, so they are
re-phrased here with the request's field quoted ('temperature' must be ...). Two checks are made here first, for
messages that name what make_request cannot: a prompt's token id outside the vocabulary (its position in the array)
and a non-finite number (Python's json reads NaN, Infinity and 1e999; shown as JSON spells them).
Supported: prompt (a text, a list of one text, token ids or a list of one id list) / messages (roles system, developer
(rendered as system), user, assistant; content a text or a list of {"type": "text", "text"} parts), max_tokens (chat
also max_completion_tokens), temperature, top_p, top_k and ignore_eos (extensions, as llama-server and vLLM have them),
seed, stop (a text or a list of texts), stream, stream_options.include_usage, n = 1. Fields that would change the output
in a way this server does not do (n > 1, logprobs, echo, best_of, suffix, penalties, logit_bias, tools, a response
format other than text, audio, ...) are refused with 400 when given a value other than their default; fields that change
nothing here (user, metadata, store, service_tier, parallel_tool_calls, ...) are accepted and unused. A field that is in
neither the endpoint's OpenAI request body nor the extensions is refused with 400 as OpenAI refuses it ("Unrecognized
request argument supplied: max_token (did you mean 'max_tokens'?)"), so a misspelt field never falls back to its default
unnoticed; so is a text (prompt, message content, stop) with an unpaired UTF-16 surrogate, which JSON's \\uXXXX escapes
can spell but no tokenizer can encode. Reference: the OpenAI API reference for the legacy completions and the chat
completions endpoints. """

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import secrets
import time
import uuid
from typing import Any

from ft_jax.chat import ChatTemplate, ChatTemplateError
from ft_jax.engine.sampling import Sampling

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; vLLM and llama-server more); each is checked every step
MAX_STOP_CHARS = 256  # characters per stop string
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default for both endpoints
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Fields refused unless absent or at the value that changes nothing, compared with their JSON type (a number is not a
# boolean: /v1/completions' "logprobs": 0 asks for the sampled token's log-probability, chat's "logprobs": false not).
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
               "function_call": (None, "none"), "modalities": (None, ["text"]), "audio": (None,),
               "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,)}
# The request bodies' fields in the OpenAI API reference, and the extensions top_k and ignore_eos; any other is refused.
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                  "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "ignore_eos"}
COMPLETIONS_FIELDS = frozenset(_COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of"})
CHAT_FIELDS = frozenset(_COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "metadata", "store", "service_tier", "safety_identifier",
    "prompt_cache_key", "modalities", "audio", "prediction", "reasoning_effort", "verbosity", "web_search_options"})
STREAM_OPTIONS_FIELDS = frozenset({"include_usage", "include_obfuscation"})
# The accepted fields that change nothing here, with the JSON type OpenAI's API gives them (a wrong one is refused).
UNUSED_FIELD_TYPES = {"user": ((str,), "a string"), "metadata": ((dict,), "an object"),
                      "store": ((bool,), "true or false"), "parallel_tool_calls": ((bool,), "true or false"),
                      "service_tier": ((str,), "a string"), "safety_identifier": ((str,), "a string"),
                      "prompt_cache_key": ((str,), "a string")}
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # an unpaired UTF-16 surrogate (a pair is one character)


class RequestError(ValueError):
    """A request the server refuses: an OpenAI error object with HTTP status ``status``.

    Attributes: message, param (the request field, or None), status (400 unless said), type, code.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}} as the OpenAI API returns errors."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """A checked request: what the batcher decodes and how the answer is sent.

    Attributes:
        chat: /v1/chat/completions (else /v1/completions). prompt_ids: the prompt's token ids (after the chat
        template). max_tokens: tokens to generate (>= 1). sampling: Sampling. seed: in [0, 2^32) (a random one when
        the request gave none). stop: stop strings. stream: send server-sent events. include_usage: a last event with
        the usage (stream_options.include_usage). model: the name the answer reports. ignore_eos: generate
        max_tokens tokens even past an EOS id (benchmarks).
    """

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str
    ignore_eos: bool = False


def _escaped(text: str) -> str:
    """``text`` with each unpaired UTF-16 surrogate spelt as JSON escapes it (\\udc00): an error message holding one
    could not be encoded as UTF-8."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _shown(value, limit: int = 200) -> str:
    """A request value as the client wrote it (JSON, not Python's repr), cut to ``limit`` characters."""
    text = _escaped(json.dumps(value, ensure_ascii=False, default=str))
    return text if len(text) <= limit else text[:limit] + "..."


def _unicode(text: str, where: str, param: str) -> str:
    """``text`` if it is valid Unicode; else (an unpaired UTF-16 surrogate, which JSON's escapes can spell) a
    RequestError with ``param``, naming ``where`` and the surrogate's position."""
    bad = _SURROGATE.search(text)
    if bad:
        raise RequestError(f"'{where}' contains an unpaired UTF-16 surrogate ({_escaped(bad.group())}) at character "
                           f"{bad.start()}; send valid Unicode", param)
    return text


def _known_fields(body: dict, chat: bool) -> None:
    """Refuses the first field of ``body`` (or of its stream_options) that the endpoint's request body does not have,
    as OpenAI does: RequestError "Unrecognized request argument supplied: NAME" with param NAME, saying when it is a
    field of the other endpoint and suggesting a close known name."""
    known, other, other_path = ((CHAT_FIELDS, COMPLETIONS_FIELDS, "/v1/completions") if chat else
                                (COMPLETIONS_FIELDS, CHAT_FIELDS, "/v1/chat/completions"))
    fields = [(name, name, known) for name in body]
    if isinstance(body.get("stream_options"), dict):
        fields += [(f"stream_options.{name}", name, STREAM_OPTIONS_FIELDS) for name in body["stream_options"]]
    for where, name, allowed in fields:
        if name not in allowed:
            hints = [f"a field of {other_path}"] if allowed is known and name in other else []
            # cutoff 0.8: typos (max_token, temprature, top-p), not other servers' fields (repetition_penalty)
            hints += [f"did you mean '{m}'?" for m in difflib.get_close_matches(name, sorted(allowed), 1, 0.8)]
            where = _escaped(where if len(where) <= 100 else where[:100] + "...")  # a name is echoed twice
            shown = where
            if not name:  # the message ended in ": " (or "stream_options.")
                where = where.rstrip(".")
                shown = "'' (an empty name" + (" in stream_options)" if where else ")")
            raise RequestError(f"Unrecognized request argument supplied: {shown}"
                               + (f" ({'; '.join(hints)})" if hints else ""), where)


def _json_type(value) -> str:
    """JSON's name for the type of a parsed request value, with its article: "an array", "an object", "a string",
    "a number" (an integer-valued one too: 1e9 arrives as a float), "a boolean" or "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def _got(value) -> str:
    """A value of the wrong type, named as JSON names it and shown as the client wrote it: 'an array: [1]'."""
    return "null" if value is None else f"{_json_type(value)}: {_shown(value)}"


def _field(body: dict, name: str, kinds: tuple[type, ...], what: str, default=None, where: str | None = None):
    """body[name] if it is one of ``kinds`` (a boolean only if bool is one), ``default`` if absent or null; else a
    RequestError naming ``where`` (the field's full name, e.g. "stream_options.include_usage"; default ``name``)."""
    where = where or name
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(f"'{where}' must be {what}, got {_got(value)}", where)
    return value


def _number(body: dict, name: str, what: str, default: float):
    """A real-valued field (temperature, top_p) as _field, and finite: Python's json reads NaN, Infinity, -Infinity
    and 1e999 (as inf); an integer beyond a double's range is refused the same way (as a double it is infinite)."""
    value = _field(body, name, (int, float), what, default)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise RequestError(f"'{name}' must be a finite number, got {_shown(value)}", name)
    # as written (make_request's messages show it), but an integer past 2^53 as a double (numpy refuses big ints)
    return value if isinstance(value, float) or abs(value) < 2**53 else number


def _prompt(body: dict) -> tuple[str | list[int], str]:
    """The completions prompt, a text or token ids (one prompt, also as a batch of one), and where it is in the
    request: "prompt", or "prompt[0]" for a batch of one (messages name an element as 'prompt[0][2]')."""
    prompt, where = body.get("prompt"), "prompt"
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch of prompts
        if len(prompt) > 1:
            bad = next((i for i, p in enumerate(prompt) if not isinstance(p, (str, list))), None)
            if bad is not None:
                raise RequestError(f"'prompt[{bad}]' must be a string or an array of token ids, got "
                                   f"{_got(prompt[bad])}", "prompt")
            raise RequestError(f"'prompt' holds {len(prompt)} prompts; this server takes one prompt per request",
                               "prompt")
        prompt, where = prompt[0], "prompt[0]"
    if prompt == "" or prompt == []:
        raise RequestError(f"'{where}' is empty: give a non-empty string or an array of token ids", "prompt")
    if isinstance(prompt, str):
        return _unicode(prompt, where, "prompt"), where
    if not isinstance(prompt, list):
        raise RequestError(f"'{where}' must be a non-empty string or an array of token ids, got {_got(prompt)}",
                           "prompt")
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"'{where}[{i}]' must be a token id (an integer), got {_got(t)}", "prompt")
    return prompt, where


def _messages(body: dict) -> list[dict]:
    """The chat messages as [{"role", "content": text}] (text parts joined; the "developer" role as "system": the
    OpenAI API's name for system instructions, which checkpoints' chat templates do not know)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array of {role, content} objects, got "
                           f"{_got(messages)}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object with 'role' and 'content', got {_got(m)}", where)
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got "
                               f"{_shown(role) if isinstance(role, str) else _got(role)}",
                               f"{where}.role")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise RequestError(f"'{where}.content': only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                   "supported", f"{where}.content")
            content = "".join(_unicode(t, f"{where}.content[{j}].text", f"{where}.content")
                              for j, t in enumerate(texts))
        if not isinstance(content, str):
            raise RequestError(f"'{where}.content' must be a string or an array of text parts, got {_got(content)}",
                               f"{where}.content")
        _unicode(content, f"{where}.content", f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _unsupported(body: dict) -> None:
    for name, harmless in UNSUPPORTED.items():
        value = body.get(name)
        if not any(_json_type(value) == _json_type(h) and value == h for h in harmless):
            raise RequestError(f"'{name}' is not supported by this server (got {_shown(body[name])})", name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise RequestError("'response_format' other than {\"type\": \"text\"} is not supported, got "
                           f"{_shown(fmt) if isinstance(fmt, dict) else _got(fmt)}",
                           "response_format")
    for name, (kinds, what) in UNUSED_FIELD_TYPES.items():  # accepted and unused, but of their OpenAI type
        _field(body, name, kinds, what)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise RequestError("'n' must be 1 (one choice per request), got "
                           f"{_shown(n) if _json_type(n) == 'a number' else _got(n)}", "n")


# make_request's messages name its arguments; the request field each one comes from.
_ARGUMENT_FIELDS = (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                    ("top_k", "top_k"), ("seed", "seed"), ("stop", "stop"))


def _rephrased(message: str, chat: bool, default_field: str, limit: str) -> tuple[str, str]:
    """A make_request / Sampling message for the client, and the request field it is about: the argument that starts
    it quoted as that field ("temperature must be a finite number >= 0, got -1" -> "'temperature' must be ...";
    "temperature 1e+20 is outside ..." -> "'temperature' of 1e+20 is outside ..."), check_request's batch index
    dropped ("prompt 0: token id ..." -> "'prompt': token id ..."). ``limit``: the max_tokens field used."""
    for arg, field in _ARGUMENT_FIELDS:
        field = limit if field == "max_tokens" else field
        if message.startswith(arg + " "):
            rest = message[len(arg):]
            if re.match(r" \S+ is outside ", rest):
                rest = " of" + rest
            return f"'{field}'{rest}", field
    field = next((limit if f == "max_tokens" else f for arg, f in _ARGUMENT_FIELDS if arg in message), default_field)
    return re.sub(r"^prompt 0\b", "the prompt" if chat else "'prompt'", message), field


def parse_request(body: Any, *, chat: bool, model, template: ChatTemplate | str, context: int,
                  model_name: str) -> GenerationParams:
    """A checked GenerationParams from a request body (the parsed JSON).

    Args:
        body: the JSON body. chat: /v1/chat/completions. model: the ft_jax.api.Model (Model.request, tokenizer).
        template: the model's chat template, or why it has none (the message a chat request gets).
        context: tokens per row of the server (--ctx-size): prompt + max_tokens must fit. model_name: reported back.
    Raises:
        RequestError: 400 naming the field: a field unknown to the endpoint, a wrong type or value, an unsupported
            field, a text with an unpaired surrogate, a prompt over the context (code "context_length_exceeded"),
            chat without a chat template, more than MAX_STOP stop strings; 404
            (code "model_not_found") for a 'model' other than model_name.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_got(body)}")
    _known_fields(body, chat)
    _unsupported(body)
    stream = _field(body, "stream", (bool,), "true or false", False)
    options = _field(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = _field(options, "include_usage", (bool,), "true or false", False,
                           where="stream_options.include_usage")
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, limit, (int,), "an integer >= 1")
    if max_tokens is None and not chat:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"'{limit}' must be an integer >= 1, got {_shown(max_tokens)}", limit)
    temperature = _number(body, "temperature", "a number >= 0", DEFAULT_TEMPERATURE)
    top_p = _number(body, "top_p", "a number in (0, 1]", 1.0)
    top_k = _field(body, "top_k", (int,), "an integer >= 0", 0)
    ignore_eos = _field(body, "ignore_eos", (bool,), "true or false", False)
    seed = _field(body, "seed", (int,), "an integer in [0, 2^32)")
    stop = _field(body, "stop", (str, list), "a string or an array of strings", ())
    for i, s in enumerate(stop if isinstance(stop, list) else ()):
        if not isinstance(s, str):
            raise RequestError(f"'stop[{i}]' must be a string, got {_got(s)}", "stop")
    stops = [stop] if isinstance(stop, str) else stop
    for i, s in enumerate(stops):
        _unicode(s, f"stop[{i}]" if isinstance(stop, list) else "stop", "stop")
    if any(s == "" for s in stops):
        raise RequestError(f"'stop' strings must be non-empty, got {_shown(stop)}", "stop")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"'stop' may hold at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each, "
                           f"got {len(stops)} (longest {max(map(len, stops))})", "stop")
    requested = body.get("model")
    if requested is not None and not isinstance(requested, str):
        raise RequestError(f"'model' must be a string, got {_got(requested)}", "model")
    if requested is not None and requested != model_name:
        raise RequestError(f"the model {_shown(requested)} does not exist: this server serves {_shown(model_name)} "
                           "(GET /v1/models)", "model", status=404, code="model_not_found")
    if chat:
        messages = _messages(body)
        if isinstance(template, str):
            raise RequestError(template, "messages")
        try:
            text = template.render(messages)
        except ChatTemplateError as e:
            raise RequestError(str(e), "messages") from None
        prompt = model.tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt, at = _prompt(body)
        vocab = model.config.vocab_size
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None) if isinstance(prompt, list) else None
        if bad is not None:
            raise RequestError(f"'{at}[{bad}]' must be a token id in the vocabulary [0, {vocab}), got "
                               f"{_shown(prompt[bad])}", "prompt")
    where = "messages" if chat else "prompt"
    try:
        request = model.request(prompt, max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=secrets.randbits(32) if seed is None else seed, stop=stop,
                                context=(context, f"the server's context of {context} tokens (--ctx-size)"))
    except (TypeError, ValueError) as e:
        message = str(e)
        if "context" in message:
            raise RequestError(message, where, code="context_length_exceeded") from None
        message, field = _rephrased(message, chat, where, limit)
        raise RequestError(message, field) from None
    return GenerationParams(chat=chat, prompt_ids=request.prompt_ids[0], max_tokens=request.max_new_tokens,
                            sampling=request.sampling, seed=request.seed, stop=request.stop, stream=stream,
                            include_usage=include_usage, model=model_name, ignore_eos=ignore_eos)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Answer:
    """The response objects of one request (ids and the creation time fixed at construction)."""

    def __init__(self, params: GenerationParams):
        self.params = params
        self.id = ("chatcmpl-" if params.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if params.chat else "text_completion"

    def _head(self, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.params.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.params.model}

    def full(self, text: str, finish_reason: str, completion_tokens: int) -> dict:
        """The non-streamed answer."""
        if self.params.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(False), "choices": [choice],
                "usage": usage(len(self.params.prompt_ids), completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        """One streamed event: new text (None: none), or the end with its finish reason."""
        if self.params.chat:
            delta = {"role": "assistant", "content": text or ""} if first else (
                {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        """The last event with stream_options.include_usage: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(len(self.params.prompt_ids), completion_tokens)}
