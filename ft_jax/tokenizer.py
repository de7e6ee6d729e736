"""Tokenizers for ft_jax model folders: Hugging Face ``tokenizer.json``, or byte level for the bundled model.

``load_tokenizer(model_dir)`` picks, in this order:

1. ``tokenizer.json`` in the folder -> :class:`HFTokenizer` (the ``tokenizers`` library,
   ``tokenizers.Tokenizer.from_file``).
2. ``config.json`` with ``"vocab_size": 256`` and the marker ``"ft_jax_tokenizer": "bytes"`` (written by
   ``scripts/train_tiny_moe.py`` for the bundled model) -> :class:`ByteTokenizer`: token id = UTF-8 byte value
   (0..255), no BOS, no EOS.
3. Otherwise :class:`TokenizerNotFoundError`, telling the user to pass token ids (``--prompt-ids``).

BOS/EOS ids come from ``config.json`` (``bos_token_id``, ``eos_token_id``), overridden by ``generation_config.json``
when it sets them (the Hugging Face ``generate`` convention): :func:`ft_jax.config.read_special_ids`, the same rule
as ``MoEConfig.eos_token_ids``. ``eos_token_id`` may be an int or a list of ints; every listed id is an EOS id
(``Tokenizer.eos_token_ids``).

Streaming: generated ids arrive one at a time and one character may span several tokens (a multi-byte UTF-8
character split over byte tokens, or byte-fallback tokens). :meth:`Tokenizer.stream_decoder` returns a
:class:`StreamDecoder` whose ``push(ids)`` returns only the text that is complete so far and buffers the rest.
"""

from __future__ import annotations

import codecs
import os
import stat
from dataclasses import dataclass
from typing import Iterable, Protocol

from tokenizers import Tokenizer as _Tok
from tokenizers.decoders import DecodeStream

from ft_jax.config import (ConfigError, check_regular_file, file_present, os_error_cause, read_json_file,
                           read_special_ids)

BYTE_TOKENIZER_MARKER_KEY = "ft_jax_tokenizer"
BYTE_TOKENIZER_MARKER_VALUE = "bytes"
BYTE_VOCAB_SIZE = 256


class TokenizerNotFoundError(FileNotFoundError):
    """The model folder has neither ``tokenizer.json`` nor the byte-level marker in ``config.json``."""


class StreamDecoder(Protocol):
    """Incremental detokenizer for one generated sequence."""

    def push(self, ids: int | Iterable[int]) -> str:
        """Add token ids; return the newly completed text ("" while a character is still incomplete)."""
        ...

    def flush(self) -> str:
        """End of stream: return any buffered remainder (incomplete UTF-8 becomes U+FFFD)."""
        ...


@dataclass(frozen=True)
class SpecialIds:
    """BOS/EOS token ids of a model folder. ``bos_token_id`` None = no BOS; ``eos_token_ids`` empty = no EOS."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


class Tokenizer:
    """Common interface: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``stream_decoder()``.

    Attributes:
        bos_token_id: int or None (None: the model has no BOS token; nothing is prepended).
        eos_token_ids: tuple of ints that end generation (empty: generation stops only at the token limit).
        vocab_size: number of token ids the tokenizer can produce.
    """

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    @property
    def eos_token_id(self) -> int | None:
        """First EOS id, or None when the model has no EOS token."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def stream_decoder(self) -> StreamDecoder:
        raise NotImplementedError


class _ByteStreamDecoder:
    """UTF-8 incremental decoder over byte ids; invalid sequences become U+FFFD (``errors="replace"``)."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self._dec.decode(_ids_to_bytes(ids))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def _ids_to_bytes(ids: list[int]) -> bytes:
    bad = [i for i in ids if not 0 <= int(i) < BYTE_VOCAB_SIZE]
    if bad:
        raise ValueError(f"byte-level tokenizer: token ids must be in [0, 255], got {bad[:5]}")
    return bytes(int(i) for i in ids)


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer: ``encode`` = UTF-8 bytes of the text, token id = byte value (vocab 256).

    No special tokens: ``add_special_tokens`` is accepted for interface compatibility and adds nothing.
    ``decode`` replaces invalid UTF-8 with U+FFFD. Raises ValueError for ids outside [0, 255].
    """

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, bos_token_id: int | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return _ids_to_bytes(list(ids)).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()


class _HFStreamDecoder:
    """Wraps ``tokenizers.decoders.DecodeStream`` (which buffers ids until they decode to complete text)."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=False)
        self._pending: list[int] = []

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        out = []
        for i in ids:
            self._pending.append(int(i))
            chunk = self._stream.step(self._tok, int(i))
            if chunk is not None:
                out.append(chunk)
                self._pending.clear()
        return "".join(out)

    def flush(self) -> str:
        # Ids that never completed a character (e.g. a truncated byte-fallback sequence): decode them as they are.
        rest = self._tok.decode(self._pending, skip_special_tokens=False) if self._pending else ""
        self._pending.clear()
        return rest


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` loaded with ``tokenizers.Tokenizer.from_file``.

    ``encode(text, add_special_tokens=True)`` applies the file's post-processor (which may add BOS);
    ``decode`` keeps special tokens (``skip_special_tokens=False``) so that ids round-trip.
    """

    def __init__(self, path: str, bos_token_id: int | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        try:
            self._tok = _Tok.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception for malformed files
            raise ValueError(f"{path}: cannot load tokenizer.json: {e}") from e
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def stream_decoder(self) -> StreamDecoder:
        return _HFStreamDecoder(self._tok)


def load_special_ids(model_dir: str) -> SpecialIds:
    """BOS id and every EOS id of a model folder (config.json, overridden key by key by generation_config.json).

    Raises ConfigError (a ValueError) for an unreadable / non-UTF-8 / invalid JSON file or a malformed id field
    (not an int / a list of ints / null); the message names the file.
    """
    bos, eos = read_special_ids(model_dir)
    return SpecialIds(bos, eos)


def load_tokenizer(model_dir: str) -> Tokenizer:
    """Load the tokenizer of a model folder (see the module docstring for the order of choices).

    Args:
        model_dir: path of a Hugging Face model folder (config.json, optionally tokenizer.json).
    Returns:
        HFTokenizer or ByteTokenizer with ``bos_token_id`` / ``eos_token_ids`` from the folder's configs.
    Raises:
        FileNotFoundError: ``model_dir`` does not exist or is not a folder.
        TokenizerNotFoundError: no tokenizer.json and no byte-level marker (message suggests ``--prompt-ids``).
        ValueError (ConfigError for the JSON files): ``model_dir`` or a file in it cannot be accessed (the cause
            is named: permission denied, symbolic link loop, not a regular file), malformed tokenizer.json /
            config.json / generation_config.json, a byte marker with a vocab_size other than 256, or a marker
            key with another value than "bytes" (ConfigError).
    """
    try:
        mode = os.stat(model_dir).st_mode
    except FileNotFoundError:
        if os.path.islink(model_dir):
            raise FileNotFoundError(f"model folder {model_dir!r} is a symbolic link to "
                                    f"{os.readlink(model_dir)!r}, which does not exist") from None
        raise FileNotFoundError(f"model folder {model_dir!r} does not exist") from None
    except OSError as e:
        raise ValueError(f"{model_dir}: cannot open the model folder: {os_error_cause(e)}") from None
    if not stat.S_ISDIR(mode):
        raise FileNotFoundError(f"model folder {model_dir!r} is not a folder")
    special = load_special_ids(model_dir)
    tok_path = os.path.join(model_dir, "tokenizer.json")
    if file_present(tok_path, "tokenizer.json"):
        check_regular_file(tok_path, "tokenizer.json")
        return HFTokenizer(tok_path, special.bos_token_id, special.eos_token_ids)
    cfg_path = os.path.join(model_dir, "config.json")
    cfg = read_json_file(cfg_path, "config.json") if file_present(cfg_path, "config.json") else {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    marker = cfg.get(BYTE_TOKENIZER_MARKER_KEY)
    if marker == BYTE_TOKENIZER_MARKER_VALUE:
        if cfg.get("vocab_size") != BYTE_VOCAB_SIZE:
            raise ConfigError(
                f"{cfg_path}: {BYTE_TOKENIZER_MARKER_KEY}={BYTE_TOKENIZER_MARKER_VALUE!r} needs vocab_size "
                f"{BYTE_VOCAB_SIZE}, got {cfg.get('vocab_size')!r}"
            )
        return ByteTokenizer(special.bos_token_id, special.eos_token_ids)
    if marker is not None:
        raise ConfigError(f"{cfg_path}: {BYTE_TOKENIZER_MARKER_KEY}={marker!r}: the only tokenizer it names is "
                          f"{BYTE_TOKENIZER_MARKER_VALUE!r} (byte-level, vocab_size {BYTE_VOCAB_SIZE}); correct the "
                          "value or remove the key")
    raise TokenizerNotFoundError(
        f"{model_dir}: no tokenizer.json (and config.json has no "
        f'"{BYTE_TOKENIZER_MARKER_KEY}": "{BYTE_TOKENIZER_MARKER_VALUE}" marker); '
        "pass token ids with --prompt-ids instead of --prompt"
    )
