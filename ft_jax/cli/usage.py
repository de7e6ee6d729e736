"""What every subcommand shares besides argument types: UsageError, the one-line argparse parser, escapes."""

from __future__ import annotations

import argparse

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
_HEX = set("0123456789abcdefABCDEF")


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (`PROG: error: ...`, exit status 2) instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def process_escapes(text: str) -> str:
    r"""Backslash escapes as llama.cpp's command line processes them (common.cpp, string_process_escapes): \n, \r,
    \t, \', \", \\ and \xHH (two hex digits: the character U+00HH); any other backslash, and a trailing one, stays
    as it is. E.g. the two characters `\n` typed in a shell become a newline."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c != "\\" or i + 1 == len(text):
            out.append(c)
            i += 1
            continue
        nxt, hexits = text[i + 1], text[i + 2:i + 4]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif nxt == "x" and len(hexits) == 2 and set(hexits) <= _HEX:
            out.append(chr(int(hexits, 16)))
            i += 4
        else:
            out.append(c + nxt)
            i += 2
    return "".join(out)


def escaped_text(text: str) -> str:
    """argparse type: the text with llama.cpp's escapes processed (process_escapes); an empty result is refused."""
    value = process_escapes(text)
    if not value:
        raise argparse.ArgumentTypeError(f"expected a non-empty text, got {text!r}")
    return value
