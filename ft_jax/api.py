"""The one-call Python API: ``ft_jax.load`` a model folder, then ``generate`` text from it; the one place where
generation requests are checked (make_request / check_request, used by Model.generate and, before loading, the CLI).

    >>> import ft_jax
    >>> model = ft_jax.load(cache=0.25)                      # the bundled tiny Shakespeare MoE
    >>> out = model.generate("ROMEO:", max_new_tokens=40, seed=1, stop=["\\n\\n"])
    >>> out.finish_reasons[0] in ("stop", "length"), isinstance(out.text, str)
    (True, True)

Defaults as ``ft-jax generate``: the checkpoint's dtype, the auto policy (costs from the stored bandwidth profile of
this machine, or a quick one) with half of all experts as device slots on an accelerator, host-all with one slot on a
CPU-only backend (defaults.default_policy), temperature 0.8 (docs/DESIGN.md, "Engine, API and CLI").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import warnings
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import platformdirs

from ft_jax.cache_dirs import folder_problem
from ft_jax.chat import load_chat_template
from ft_jax import checkpoint as checkpoint_lib
from ft_jax.checked_weights import CheckedWeights
from ft_jax import kernels
from ft_jax.config import load_config
from ft_jax.config.quantization import expert_format
from ft_jax.engine import step_cache
from ft_jax.engine.engine import Engine
from ft_jax.engine.sampling import Sampling
from ft_jax.memory import budget_slots, check_host_memory, planned_expert_bytes
from ft_jax.offload.expert_parallel import ExpertPartition
from ft_jax.offload.policy import Policy, PolicyKind, parse_policy
from ft_jax.offload.prefill_split import prefill_min_tokens_for
from ft_jax.offload.profile import check_store_path, cost_model_for, resolve_policy
from ft_jax.tokenizer import TokenizerNotFoundError, load_tokenizer
from ft_jax import units
from ft_jax.units import model_dtype

from ft_jax.defaults import (BANK_MEMORY, BUNDLED_MODEL, DEFAULT_CACHE_FRACTION, DEFAULT_NEW_TOKENS,  # noqa: F401
                             DEFAULT_POLICY, DEFAULT_TEMPERATURE, WEIGHT_CHECK, bundled_model_path, default_policy)
from ft_jax.offload.policy import PolicyKind


def unused_tensors_note(unused: Sequence[str], names: Iterable[str]) -> str:
    """The note for the checkpoint tensors the model does not read (LoadedCheckpoint.unused_tensors, non-empty) among
    all of its tensors ``names``: their count, then a decoder layer none of whose tensors is read as one
    "model.layers.N.* (count)" entry, in layer order, then the other names; at most 6 entries and how many tensors
    the rest hold. E.g. "31 of the checkpoint's tensors are not read by the model its config.json describes:
    model.layers.3.* (31)"."""
    unread = set(unused)
    per_layer: dict[int, list[str]] = {}
    for name in names:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            per_layer.setdefault(int(m.group(1)), []).append(name)
    whole = sorted(i for i, layer in per_layer.items() if unread.issuperset(layer))
    grouped = {n for i in whole for n in per_layer[i]}
    entries = [(f"model.layers.{i}.* ({len(per_layer[i])})", len(per_layer[i])) for i in whole]
    entries += [(n, 1) for n in sorted(unread - grouped)]
    shown, rest = entries[:6], sum(n for _, n in entries[6:])
    more = f" and {units.count(rest, 'more tensor')}" if rest else ""
    verb = "is" if len(unread) == 1 else "are"
    return (f"{len(unread)} of the checkpoint's tensors {verb} not read by the model its config.json describes: "
            f"{', '.join(e for e, _ in shown)}{more}")


def num_slots_for(cache, num_experts: int, expert_bytes: int) -> int:
    """Device expert slots for a cache budget.

    Args:
        cache: None (DEFAULT_CACHE_FRACTION of all experts), an int or numpy integer (that many slots; not a bool),
            a float or numpy float in (0, 1] (that fraction of all experts), or a byte count as a string ("8GiB":
            slots = bytes / expert_bytes).
        num_experts: all routed experts, L_moe * E. expert_bytes: bytes of one expert as stored (gate, up and down
            weights in their format, their scales and biases: ExpertBanks.expert_bytes).
    Returns:
        slots in [1, num_experts].
    Raises:
        ValueError: a budget below one slot, a fraction outside (0, 1], or a string that is no byte count.
        TypeError: cache of another type (a bool, a list, ...), named.
    """
    if cache is None:
        cache = DEFAULT_CACHE_FRACTION
    if isinstance(cache, bool):
        raise TypeError(f"cache must be slots (int), a fraction (float) or bytes ('8GiB'), got {cache!r}")
    if isinstance(cache, (int, np.integer)):
        if cache < 1:
            raise ValueError(f"the cache must hold at least one expert slot, got {cache} slots")
        return min(int(cache), num_experts)
    if isinstance(cache, (float, np.floating)):
        cache = float(cache)
        if not 0.0 < cache <= 1.0:
            raise ValueError(f"a cache fraction must be in (0, 1], got {cache}")
        return max(1, min(num_experts, round(cache * num_experts)))
    if isinstance(cache, str):
        return min(budget_slots(cache, expert_bytes), num_experts)
    raise TypeError(f"cache must be slots (int), a fraction (float) or bytes ('8GiB'), got {cache!r}")


def budget_note(given: str, fits: int, experts: int) -> str:
    """The note of a byte budget that holds more than all ``experts`` (of a device) and is cut to them: ``given``
    names the budget as it was given ("cache='8GiB'" in Model.note, "--device-memory 8GiB" in the CLI's note)."""
    return f"{given} holds {fits} experts, more than the {experts} experts; using {experts}"


def enable_compile_cache(path: str) -> str | None:
    """Turn on JAX's persistent compilation cache in ``path`` for every executable (even ones that compile in under a
    second), and ft_jax's cache of whole prefill and decode steps in its ft_jax_steps/ (ft_jax.engine.step_cache:
    loaded without tracing or lowering); call before the first compilation of the process. Returns None, or a
    one-line note when the folder cannot be created or written: the caches then stay off (and JAX never warns about
    failed cache writes)."""
    problem = folder_problem(path)
    if problem is not None:
        return f"the compilation cache is off: {path} cannot be created or written ({problem})"
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    step_cache.enable(os.path.join(path, step_cache.FOLDER))


def default_compile_cache_dir() -> str:
    """compile/ in the user cache directory ($XDG_CACHE_HOME/ft_jax or ~/.cache/ft_jax)."""
    return os.path.join(platformdirs.user_cache_dir("ft_jax", appauthor=False), "compile")


@dataclasses.dataclass
class Generation:
    """What Model.generate returns.

    Attributes:
        texts: generated text per prompt (stop strings cut off), or None when the model folder has no tokenizer.
        token_ids: generated ids per prompt (ending with the EOS id or the token that completed a stop string).
        prompt_ids: the token ids each prompt was encoded to (after the chat template, with chat=True).
        finish_reasons: per prompt, "eos", "stop" (a stop string) or "length" (max_new_tokens).
        stats: Engine.generate's statistics (decode tokens/s, hit rate, compile counts, ...).
        routing: with record_routing, (topk ids i32[steps, L_moe, B, k], weights f32[...]) of every decode step.
        single: generate was given one prompt (a text or one id list), not a list of prompts.
    """

    texts: list[str] | None
    token_ids: list[list[int]]
    prompt_ids: list[list[int]]
    finish_reasons: list[str]
    stats: dict
    routing: tuple | None = None
    single: bool = True

    @property
    def text(self) -> str | None:
        """The generated text of the one prompt (None without a tokenizer).

        Raises:
            ValueError: generate was given a list of prompts: their texts are ``texts``.
        """
        if not self.single:
            n = len(self.token_ids)
            raise ValueError(f"text is the text of a single prompt; this generation had a list of "
                             f"{units.count(n, 'prompt')}: use .texts (one text per prompt)")
        return None if self.texts is None else self.texts[0]


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked generation request (make_request): what Model.run_request decodes.

    Attributes:
        prompt_ids: B lists of token ids (non-empty, in the vocabulary, fitting the context with max_new_tokens).
        max_new_tokens: tokens to generate per prompt (>= 1). sampling: the Sampling rule. seed: in [0, 2^32).
        stop: stop strings (non-empty; only with a tokenizer). single: one prompt was given, not a list.
    """

    prompt_ids: list[list[int]]
    max_new_tokens: int
    sampling: Sampling
    seed: int = 0
    stop: tuple[str, ...] = ()
    single: bool = True


def check_request(config, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  context: tuple[int, str] | None = None) -> None:
    """Validate token-id prompts against a model config before any work is done.

    Args:
        config: ft_jax.config.MoEConfig (vocab_size, max_position_embeddings).
        prompts: B lists of token ids.
        max_new_tokens: tokens to generate per prompt.
        context: (tokens, the phrase naming them) when the context is smaller than the model's, e.g. (2048, "the
            server's context of 2048 tokens (--ctx-size)"); default: max_position_embeddings, "the model's context
            of N tokens (max_position_embeddings)".
    Raises:
        ValueError: no prompt, an empty prompt, an id outside [0, vocab), max_new_tokens < 1, or a prompt plus the
            new tokens longer than the context; the message names the prompt and values.
    """
    if not prompts:
        raise ValueError("no prompt given")
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {config.vocab_size})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest, (size, what) = max(len(p) for p in prompts), _context(config, context)
    if longest + max_new_tokens > size:
        raise ValueError(f"{_which_prompt(prompts, longest)} of {_tokens(longest)} + "
                         f"{_tokens(max_new_tokens, 'new ')} exceeds {what}")


def _which_prompt(prompts: Sequence[Sequence[int]], length: int) -> str:
    """'prompt' alone, else 'prompt 2 (of 3)': the first prompt of ``length`` tokens, for an error message."""
    if len(prompts) == 1:
        return "prompt"
    i = next(i for i, p in enumerate(prompts) if len(p) == length)
    return f"prompt {i} (of {len(prompts)})"


def _tokens(n: int, kind: str = "") -> str:
    """'1 token', '2 new tokens': a count for an error message."""
    return units.count(n, f"{kind}token")


def _context(config, context: tuple[int, str] | None) -> tuple[int, str]:
    size = config.max_position_embeddings
    return context or (size, f"the model's context of {size} tokens (max_position_embeddings)")


def default_new_tokens(config, prompts: Sequence[Sequence[int]], context: tuple[int, str] | None = None) -> int:
    """max_new_tokens when none is given: DEFAULT_NEW_TOKENS, or what the context (check_request) leaves after the
    longest prompt. Raises ValueError if the longest prompt already fills the context (no room for one new token)."""
    longest, (size, what) = max(len(p) for p in prompts), _context(config, context)
    if longest >= size:
        raise ValueError(f"{_which_prompt(prompts, longest)} of {_tokens(longest)} fills {what}: no room for a new "
                         "token")
    return min(DEFAULT_NEW_TOKENS, size - longest)


def encode_prompt(path: str, tokenizer, prompt, *, chat: bool = False) -> list[int]:
    """Token ids of one prompt: ids are kept as they are; text is encoded by the tokenizer, after the chat template of
    the model folder ``path`` with chat=True. Raises ValueError without a tokenizer for text, or for a non-empty text
    that encodes to no token (a tokenizer without an unknown token or byte fallback drops what it cannot encode);
    ChatTemplateError without a chat template."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer (no tokenizer.json): pass token ids instead of text")
    if chat:
        template = load_chat_template(path)
        ids = tokenizer.encode(template.render([{"role": "user", "content": prompt}]), add_special_tokens=False)
    else:
        ids = tokenizer.encode(prompt)
    if not ids and prompt:
        raise ValueError(f"the prompt text ({units.count(len(prompt), 'character')}) encodes to no tokens: the model's "
                         "tokenizer has no token for it; give other text or token ids")
    return ids


def _prompt_rows(prompts) -> tuple[list, bool]:
    """(the prompts as a list, whether one prompt was given); TypeError / ValueError naming a bad one."""
    def token_ids(p) -> bool:
        return isinstance(p, (list, tuple)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p)

    def as_lists(p):  # an integer array of ids (numpy or JAX; 1-D: one prompt, 2-D: one per row) as lists of ints
        if not isinstance(p, (str, list, tuple, np.ndarray)) and hasattr(p, "__array__"):
            p = np.asarray(p)  # a jax.Array (or another array type with __array__) is read to the host once
        if isinstance(p, np.ndarray) and p.ndim in (1, 2) and np.issubdtype(p.dtype, np.integer):
            return p.tolist()
        return p

    prompts = as_lists(prompts)
    if isinstance(prompts, (list, tuple)):
        prompts = [as_lists(p) for p in prompts]
    if not isinstance(prompts, (str, list, tuple)):
        raise TypeError(f"prompts must be a text, a list of token ids (or a 1-D / 2-D integer numpy array) or a list "
                        f"of texts / id lists, got {type(prompts).__name__}"
                        + (f" of {prompts.dtype}, shape {prompts.shape}" if isinstance(prompts, np.ndarray) else ""))
    if isinstance(prompts, str) and not prompts:
        raise ValueError("the prompt text is empty: give at least one character (or token ids)")
    if not len(prompts):
        raise ValueError("prompts is empty: give a text, a list of token ids, or a list of texts / id lists")
    one = isinstance(prompts, str) or isinstance(prompts[0], (int, np.integer))
    rows = [prompts] if one else list(prompts)
    bad = [p for p in rows if not (isinstance(p, str) or token_ids(p))]
    if bad:
        raise TypeError(f"each prompt must be a text or a list (or 1-D integer numpy array) of integer token ids, "
                        f"got {bad[0]!r}")
    for i, p in enumerate(rows):
        if isinstance(p, str):
            _check_utf8(p, "the prompt text" if one else f"prompt {i}")
    return rows, one


def _check_utf8(text: str, what: str) -> None:
    """ValueError naming ``what`` and the position when ``text`` cannot be encoded as UTF-8 (a lone surrogate, e.g.
    from a file read with errors="surrogateescape"): the tokenizers take UTF-8 only."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: {text[e.start:e.end]!r} at character {e.start} is a "
                         f"lone surrogate, which UTF-8 cannot encode") from None


def _check_types(max_new_tokens, temperature, top_k, top_p, seed, stop) -> tuple[str, ...]:
    """The argument types of a request: TypeError naming an argument of the wrong type (a bool is no number here),
    ValueError naming one out of range (a seed outside [0, 2^32), an empty stop string; the other ranges are
    check_request's and Sampling's). Returns the stop strings."""
    def integer(value) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("seed", seed)):
        if not integer(value) and not (name == "max_new_tokens" and value is None):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2^32), got {seed!r}")
    if not isinstance(stop, (str, list, tuple)):  # a set or dict has no order, a generator would be used up
        raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__} {stop!r}")
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not isinstance(s, str) for s in stop):
        raise TypeError(f"stop strings must be strings, got {stop!r}")
    if any(not s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    for i, s in enumerate(stop):
        _check_utf8(s, f"stop string {i}")
    return stop


def _as_float(value):
    """A checked number for Sampling: a numpy float as a Python float (a float16 would overflow in the sampling
    arithmetic); an int of 2^63 or more as a float (+-inf past the largest), which Sampling refuses by name
    (numpy's isfinite takes no such int); anything else as given (its messages then show the value as the caller
    wrote it: -1, not -1.0)."""
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, (int, np.integer)) and abs(int(value)) >= 2**63:  # beyond numpy's integer checks
        try:
            return float(value)
        except OverflowError:  # past the largest float
            return math.inf if value > 0 else -math.inf
    return value


def make_request(path: str, config, tokenizer, prompts, *, max_new_tokens: int | None = None,
                 temperature: float = DEFAULT_TEMPERATURE, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop: Sequence[str] = (), chat: bool = False, context: tuple[int, str] | None = None) -> Request:
    """Every check of a generation request, in one place: needs only the config and the tokenizer, so the CLI calls
    it before loading the weights, and Model.generate and the server (ft_jax.serve) call it too. Arguments as
    Model.generate; path: the model folder (for the chat template and messages); context: see check_request.
    Returns a Request. Raises TypeError / ValueError naming the argument (see Model.generate), ChatTemplateError for
    chat without a chat template."""
    rows, single = _prompt_rows(prompts)
    stop = _check_types(max_new_tokens, temperature, top_k, top_p, seed, stop)
    if not isinstance(chat, (bool, np.bool_)):
        raise TypeError(f"chat must be True or False, got {chat!r}")
    if stop and tokenizer is None:
        raise ValueError(f"{path} has no tokenizer (no tokenizer.json): stop strings need one")
    ids = [encode_prompt(path, tokenizer, p, chat=chat) for p in rows]
    if max_new_tokens is None:
        max_new_tokens = default_new_tokens(config, ids, context) if all(ids) else DEFAULT_NEW_TOKENS
    check_request(config, ids, int(max_new_tokens), context)
    sampling = Sampling(temperature=_as_float(temperature), top_k=int(top_k), top_p=_as_float(top_p))
    return Request(prompt_ids=ids, max_new_tokens=int(max_new_tokens), sampling=sampling, seed=int(seed), stop=stop,
                   single=single)


class StopWatch:
    """Incremental text of one row and stop-string detection; releases only text that cannot start a stop string.

    push(token) -> the new text that can be released; finish() -> the rest (the decoder flushed, cut at a stop
    string); text: all text so far; cut: where the first stop string starts, once found (None before). A token of
    ``eos`` (the ids that end the row) adds no text: the end-of-sequence token's text (``</s>``, ``<|im_end|>``) is
    not part of the answer, as with transformers' ``skip_special_tokens`` and the OpenAI API."""

    def __init__(self, tokenizer, stop: tuple[str, ...], eos: frozenset[int]):
        self.decoder = tokenizer.stream_decoder()
        self.stop, self.eos = stop, eos
        self.text = ""  # all completed text so far
        self.released = 0  # characters handed to on_text
        self.cut: int | None = None  # where the first stop string starts, once found

    def push(self, token: int) -> str:
        if token not in self.eos:
            self.text += self.decoder.push(token)
        return self._release()

    def finish(self) -> str:
        if self.cut is None:
            self.text += self.decoder.flush()
            self._find()
        end = len(self.text) if self.cut is None else self.cut
        out, self.released = self.text[self.released:end], end
        return out

    def _find(self) -> None:
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.cut = min(hits)

    def _release(self) -> str:
        if self.cut is not None:
            return ""
        self._find()
        if self.cut is not None:
            end = self.cut
        else:  # hold back a suffix that could still become a stop string
            hold = max((n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
            end = len(self.text) - hold
        out, self.released = self.text[self.released:end], max(self.released, end)
        return out


class Model:
    """A loaded model ready to generate (ft_jax.load). Attributes: path, config (MoEConfig), tokenizer (or None),
    checkpoint (LoadedCheckpoint), engine (ft_jax.engine.engine.Engine), policy, dtype, note (what load noted, one
    line each: the bandwidth-profile message or the CPU-only default's, and a byte budget cut to every expert
    (budget_note: "cache='8GiB' holds 21845 experts, more than the 32 experts; using 32"); or None)."""

    def __init__(self, path, config, tokenizer, checkpoint, engine, dtype: str, note: str | None):
        self.path, self.config, self.tokenizer, self.checkpoint, self.engine = path, config, tokenizer, checkpoint, engine
        self.policy, self.dtype, self.note = engine.policy, dtype, note

    def encode(self, prompt, *, chat: bool = False) -> list[int]:
        """Token ids of one prompt (encode_prompt with this model's folder and tokenizer)."""
        return encode_prompt(self.path, self.tokenizer, prompt, chat=chat)

    def request(self, prompts, **kwargs) -> Request:
        """make_request for this model: the checked Request of Model.generate's arguments (but on_text and
        record_routing)."""
        return make_request(self.path, self.config, self.tokenizer, prompts, **kwargs)

    def generate(self, prompts, *, max_new_tokens: int | None = None, temperature: float = DEFAULT_TEMPERATURE,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop: Sequence[str] = (), chat: bool = False,
                 on_text: Callable[[int, str], None] | None = None, record_routing: bool = False) -> Generation:
        """Generate from one prompt or a batch.

        Args:
            prompts: a text or a list of token ids (one prompt: Generation.text is its text), or a list of texts / id
                lists (decoded together as one batch: Generation.texts, one per prompt). Integer numpy arrays of ids
                are taken too: 1-D for one prompt, 2-D for one prompt per row.
            max_new_tokens: per prompt (default DEFAULT_NEW_TOKENS, or what the model's context leaves).
            temperature, top_k, top_p: sampling (ft_jax.engine.sampling.Sampling; temperature 0 = greedy).
            seed: sampling seed, an integer in [0, 2^32).
            stop: stop strings: a row ends once its text contains one; the text is cut where it starts.
            chat: render each text prompt with the checkpoint's chat template (tokenizer_config.json) first.
            on_text: called with (row, new text) as text is generated (only text that cannot start a stop string).
            record_routing: also return the routing of every decode step (Generation.routing).
        Returns:
            Generation.
        Raises:
            TypeError: prompts, max_new_tokens, temperature, top_k, top_p, seed, stop (a string, list or tuple),
                chat (a bool) or on_text of the wrong type (naming it; a bool is no number here).
            ValueError: no prompt, an empty / out-of-vocabulary / too long prompt, text (prompt or stop string) with a
                lone surrogate, max_new_tokens < 1, a sampling value or seed out of range, an empty stop string, text
                without a tokenizer, stop strings without a tokenizer, chat without a chat template.
            ft_jax.engine.sampling.NonFiniteLogitsError: the model produced NaN or infinite logits.
        """
        request = self.request(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, stop=stop, chat=chat)
        return self.run_request(request, on_text=on_text, record_routing=record_routing)

    def run_request(self, request: Request, *, on_text: Callable[[int, str], None] | None = None,
                    record_routing: bool = False) -> Generation:
        """Decode a checked Request (make_request / Model.request); on_text and record_routing as Model.generate."""
        if on_text is not None and not callable(on_text):
            raise TypeError(f"on_text must be callable with (row, text), got {on_text!r}")
        ids = request.prompt_ids
        eos = frozenset(self.config.eos_token_ids) | frozenset(getattr(self.tokenizer, "eos_token_ids", ()))
        watches = [StopWatch(self.tokenizer, request.stop, eos) for _ in ids] if self.tokenizer is not None else None
        stopped = [False] * len(ids)

        def on_tokens(step: int, new: list[int | None]) -> list[bool]:
            for row, token in enumerate(new):
                if token is None or watches is None:
                    continue
                piece = watches[row].push(token)
                if piece and on_text is not None:
                    on_text(row, piece)
                stopped[row] = watches[row].cut is not None
            return stopped

        result = self.engine.generate(ids, max_new_tokens=request.max_new_tokens, sampling=request.sampling,
                                      seed=request.seed, eos_token_ids=eos, on_tokens=on_tokens,
                                      record_routing=record_routing)
        texts = None
        if watches is not None:
            for row, w in enumerate(watches):
                rest = w.finish()
                if rest and on_text is not None:
                    on_text(row, rest)
            texts = [w.text[:w.cut] if w.cut is not None else w.text for w in watches]
        reasons = ["stop" if stopped[r] else "eos" if t and t[-1] in eos else "length"
                   for r, t in enumerate(result.tokens)]
        return Generation(texts=texts, token_ids=result.tokens, prompt_ids=ids, finish_reasons=reasons,
                          stats=result.stats, routing=result.routing, single=request.single)


# The CLI flags that set each argument of load() that _argument checks, named in its messages.
LOAD_FLAGS = {"policy": "--policy", "dtype": "--dtype", "quantize": "--quantize",
              "cache": "--cache-slots, --cache-fraction, --device-memory", "profile": "--profile",
              "bank_memory": "--bank-memory", "weight_check": "--weight-check"}


def _prefix(name: str) -> str:
    return f"{name}= / {LOAD_FLAGS[name]}: "


@contextlib.contextmanager
def _argument(name: str):
    """A plain ValueError / TypeError raised while checking load()'s argument ``name`` again, its message prefixed
    with the argument and the CLI flag(s) that set it (LOAD_FLAGS: "cache= / --cache-slots, --device-memory: ...")."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if type(e) not in (ValueError, TypeError):
            raise
        message = str(e)
        if message.startswith(f"{name}: "):  # the check named the argument already
            message = message[len(name) + 2:]
        raise type(e)(_prefix(name) + message) from None


def argument_message(error: BaseException, name: str) -> str | None:
    """The message of an error load() raised about its argument ``name`` without the "name= / flags: " prefix (for
    the CLI, which names the one flag given); None for any other error."""
    message = str(error)
    if type(error) in (ValueError, TypeError) and message.startswith(_prefix(name)):
        return message[len(_prefix(name)):]
    return None


def load(path: str | os.PathLike | None = None, *, dtype: str = "auto", policy=None, cache=None,
         profile: str | None = None, measure: bool = True, on_message: Callable[[str], None] | None = None,
         on_compile: Callable[[str, bool], None] | None = None, quantize: str | None = None, mesh=None,
         bank_memory: str = "map", weight_check: str = "once") -> Model:
    """Load a Hugging Face MoE model folder (or the bundled model) for generation, as ``ft-jax generate`` does.

    Args:
        path: model folder (config.json + safetensors; a leading ~ is the home folder); None: the bundled tiny
            Shakespeare model.
        dtype: "auto" (the checkpoint's: float32 for float32 checkpoints, else bfloat16), bf16/bfloat16, f32/float32:
            the dense weights, the activations and the expert host banks.
        policy: "auto", "qstar", "qstar:FRAC", "fetch-all", "host-all", "fixed-cap:K", "resident", or a Policy
            (docs/policies.md); None: defaults.default_policy of the JAX backend ("auto" with an accelerator,
            "host-all" on a CPU-only one, said through on_message).
        cache: device expert slots: None (half of all experts; one slot under host-all, which never fills them),
            slots (int), a fraction (float), or bytes ("8GiB"); slots or bytes for more than every expert are cut to
            them, said in Model.note; with a mesh, of each device (fractions of the experts a device owns).
        profile: bandwidth profile store (default: the user cache directory, created if need be; a path given here
            must be in a folder that exists). measure: run a quick profile when none is stored (else qstar falls
            back to fixed-cap:1).
        on_message: called with one-line notes (which bandwidth profile qstar uses). on_compile: see Engine.
        quantize: None, "q8_0" or "q4_0" (any case, as --quantize): quantize a float checkpoint while loading
            (ft_jax.checkpoint.load_checkpoint: the expert banks and the dense 2-D projections but routers and
            embeddings). FP8 and MXFP4 checkpoints are used as stored without it. A byte budget in ``cache`` counts
            experts at their stored size.
        mesh: None (one device), or a jax.sharding.Mesh with an ``expert`` axis (ft_jax.expert_mesh()): expert
            parallelism (ft_jax.offload.expert_parallel): each MoE layer's experts split over the axis's devices,
            each with its own slots and cache; this process loads only the experts its devices own. For N CPU
            devices set ``jax.config.update("jax_num_cpu_devices", N)``, and for several processes call
            ``jax.distributed.initialize(...)``, before importing ft_jax (README, "Several devices").
        bank_memory: "map" (default): the expert host banks map the checkpoint file's page-cache pages where the
            offsets allow (no copy: fast to load, the banks share the page cache); "copy" (any case): every tensor
            is copied, the experts onto the banks' own 2 MiB huge pages (the load faults in fresh memory; the
            experts then read faster, and the process keeps no mapping of the file: docs/DESIGN.md sec. 20.22).
            Quantized banks (--quantize, FP8, MXFP4) are built in the banks' memory either way. ``ft-jax serve``
            copies, ``ft-jax generate`` maps (--bank-memory).
        weight_check: "once" (default): every float weight read is checked for NaN/Inf the first time a version of
            its file is loaded, and the checked byte ranges are recorded in the user cache directory
            (ft_jax.checked_weights: a file that changes is checked again, except through a writable memory mapping,
            which can leave its times as they were); "always": checked at every load, nothing recorded
            (--weight-check).
    Returns:
        Model.
    Raises:
        ConfigError, CheckpointError, NotImplementedError: the folder cannot be used (the message names the file);
            quantize given for an FP8 / MXFP4 checkpoint, or for one with a tensor whose rows do not fit the blocks
            (the message names the file and the tensor).
        ValueError: a bad dtype, policy, quantize, bank_memory, weight_check or cache budget; a profile path that is a
            folder or in a folder that does not exist; a mesh whose expert axis does not divide the experts or that
            does not match the processes (ExpertPartition.from_mesh).
        TypeError: path neither a str nor an os.PathLike; quantize neither a str nor None; bank_memory or
            weight_check not a str; measure not a bool; cache of another type than those above (a bool, a list, ...).
        ft_jax.memory.InsufficientMemoryError: the banks, slots and dense weights need more host memory than is
            available (checked from the headers before anything is allocated).
    """
    if path is None:
        path = bundled_model_path()
    elif isinstance(path, (str, os.PathLike)):
        path = os.path.expanduser(os.fspath(path))
    else:
        raise TypeError(f"path: expected a model folder (str or os.PathLike), got {type(path).__name__}")
    problem = kernels.environment_problem()
    if problem:  # the CLI refuses it; the library says it once
        warnings.warn(f"ft_jax: the kernels ignore a malformed setting: {problem}", stacklevel=2)
    cfg = load_config(path)
    defaulted = policy is None
    if defaulted:
        policy = default_policy(jax.default_backend())
    if not isinstance(policy, Policy):
        with _argument("policy"):
            policy = parse_policy(policy)  # errors before any loading
    if cache is None and policy.kind is PolicyKind.HOST_ALL:
        cache = 1  # host-all never fills a slot
    if profile is not None:  # an explicit store: its folder is never created (the default store's is)
        with _argument("profile"):
            check_store_path(profile)
    with _argument("dtype"):
        dtype = model_dtype(dtype, cfg.dtype)
    if not isinstance(measure, (bool, np.bool_)):
        raise TypeError(f"measure: expected True or False, got {measure!r}")
    if not isinstance(bank_memory, str):
        raise TypeError(f"{_prefix('bank_memory')}expected one of {', '.join(BANK_MEMORY)} (a str), got "
                        f"{bank_memory!r}")
    if bank_memory.lower() not in BANK_MEMORY:
        raise ValueError(f"{_prefix('bank_memory')}expected one of {', '.join(BANK_MEMORY)}, got {bank_memory!r}")
    bank_memory = bank_memory.lower()
    if not isinstance(weight_check, str) or weight_check.lower() not in WEIGHT_CHECK:
        error = ValueError if isinstance(weight_check, str) else TypeError
        raise error(f"{_prefix('weight_check')}expected one of {', '.join(WEIGHT_CHECK)}, got {weight_check!r}")
    with _argument("quantize"):
        fmt = expert_format(cfg, jnp.dtype(dtype), quantize)  # errors before any loading
    partition = None if mesh is None else ExpertPartition.from_mesh(mesh, cfg.num_experts)  # errors before loading
    per_device = cfg.num_experts if partition is None else partition.experts_per_shard
    local_devices = 1 if partition is None else partition.local_shards
    # The cache budget's form and range, and the host memory, before loading (the bytes per expert from the config,
    # at the stored size of the experts' weight format).
    with checkpoint_lib.SafetensorsCheckpoint(path) as headers:  # headers only: checked before anything is allocated
        tensor_names = tuple(headers.tensors)
        if quantize is not None:  # rows that do not fit the blocks, named before any size is computed from them
            checkpoint_lib.check_quantize_fits(headers.tensors, fmt)
        # The expert tensors' names and shapes against the config, before any size is computed from it (a config of
        # 10^12 experts is a missing tensor, not a memory error)
        checkpoint_lib.expert_tensor_plan(cfg, headers, fmt, None if partition is None else partition.process_experts)
        with _argument("cache"):
            planned_slots = num_slots_for(cache, cfg.num_moe_layers * per_device,
                                          planned_expert_bytes(cfg, jnp.dtype(dtype), fmt))
        tokenizer = load_tokenizer_or_none(path)
        slots_held = 0 if policy.kind is PolicyKind.HOST_ALL else planned_slots * local_devices  # no slot is used
        check_host_memory(cfg, headers.tensors, jnp.dtype(dtype), slots_held,
                          slots_in_host=jax.default_backend() == "cpu", fmt=fmt,
                          experts_held=None if partition is None else len(partition.process_experts))
    checkpoint = checkpoint_lib.load_checkpoint(path, dtype=jnp.dtype(dtype), quantize=quantize,
                                                experts=None if partition is None else partition.process_experts,
                                                map_pages=bank_memory == "map",
                                                checked=CheckedWeights() if weight_check.lower() == "once" else None)
    banks = checkpoint.banks
    experts = cfg.num_moe_layers * per_device
    slots = num_slots_for(cache, experts, banks.expert_bytes)
    policy, note = resolve_policy(policy, banks, cfg.hidden_size, cfg.moe_intermediate_size, profile=profile,
                                  measure=measure)
    if defaulted and policy.kind is PolicyKind.HOST_ALL:
        note = ("no accelerator: every expert is computed on the CPU from the host banks (policy host-all; slots "
                "would be copies in the same memory, read by the same cores; --policy fetch-all or qstar fills them "
                "anyway)")
    if note and on_message is not None:
        on_message(note)
    notes = [note] if note else []
    if checkpoint.unused_tensors:
        unused = unused_tensors_note(checkpoint.unused_tensors, tensor_names)
        notes.append(unused)
        if on_message is not None:
            on_message(unused)
    fits = budget_slots(cache, banks.expert_bytes) if isinstance(cache, str) else 0
    if fits > experts and policy.kind not in (PolicyKind.HOST_ALL, PolicyKind.RESIDENT):  # they use no budget
        notes.append(budget_note(f"cache={cache!r}", fits, experts))  # the CLI says it with its flag
    elif (isinstance(cache, (int, np.integer)) and not isinstance(cache, bool) and cache > experts
          and policy.kind not in (PolicyKind.HOST_ALL, PolicyKind.RESIDENT)):
        notes.append(f"cache={int(cache)} is more than the {experts} experts; using {experts}")  # as the CLI says it
    engine = Engine(checkpoint, policy=policy, num_slots=slots, on_compile=on_compile,
                    prefill_fetch_min_tokens=_prefill_split(policy, banks, cfg, profile), mesh=mesh)
    return Model(path, checkpoint.config, tokenizer, checkpoint, engine, dtype, "\n".join(notes) or None)


def _prefill_split(policy, banks, cfg, profile) -> int | None:
    """The Engine's prefill_fetch_min_tokens of a bound qstar / auto policy on a GPU (offload.prefill_split, from the
    stored bandwidth profile resolve_policy used); None (the Engine's default) on a CPU device, for other policies,
    or when the stored profile cannot be read."""
    if policy.kind not in (PolicyKind.QSTAR, PolicyKind.AUTO) or jax.default_backend() == "cpu":
        return None
    fmt = banks.format if banks.quantized else None
    try:
        model = cost_model_for("stored", banks.expert_bytes, dtype="bfloat16" if fmt else banks.gate_up.dtype,
                               profile_path=profile, fmt=fmt, shape=(cfg.hidden_size, cfg.moe_intermediate_size))
    except ValueError:
        return None
    return prefill_min_tokens_for(policy, model, banks, cfg.hidden_size, cfg.moe_intermediate_size)


def load_tokenizer_or_none(path: str):
    """The model folder's tokenizer (ft_jax.tokenizer.load_tokenizer), or None when the folder has none."""
    try:
        return load_tokenizer(path)
    except TokenizerNotFoundError:
        return None
