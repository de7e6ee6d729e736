"""What every subcommand shares besides argument types: UsageError, the one-line argparse parser, escapes."""

from __future__ import annotations

import argparse
import re
import textwrap

from ft_jax.cache_dirs import output_file_problem

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
_HEX = set("0123456789abcdefABCDEF")
ESCAPES_HELP = "\\n, \\r, \\t, \\\\, \\', \\\" and \\xHH; \\\\ for a backslash"


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit status 2."""


# argparse's message for a flag whose value is missing or starts with "-" (read as another flag: --prompt "-5 degrees",
# --device-memory -1GiB); the flag is its last option string.
_VALUE_MISSING = re.compile(r"argument (?:\S+/)?(-\S+): expected one argument$")


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (`PROG: error: ...`, exit status 2) instead of usage + error. A flag
    without its value also says how to give a value that starts with "-" (FLAG=VALUE)."""

    def error(self, message):
        missing = _VALUE_MISSING.match(message)
        if missing:
            message += f" (a value that starts with '-' goes after '=': {missing.group(1)}=VALUE)"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def check_output_file(flag: str, file: str | None) -> None:
    """A file flag is checked before any work (cache_dirs.output_file_problem): generate's --record-trace (written
    after the whole generation) and --profile (an explicit bandwidth profile store, as ft_jax.load checks profile=),
    trace's --plot (written after the replay). Its folder is never created.

    Raises:
        UsageError: "FLAG FILE: the problem" (no file name, a directory, a folder that does not exist or is not
            writable, "-": these flags write files, never standard output, which carries the generated text or the
            report).
    """
    if file == "-":
        raise UsageError(f"{flag} -: writes a file, not standard output (which carries the command's own output); "
                         f"give a file name such as ./{flag.lstrip('-').replace('-', '_')}.out")
    problem = None if file is None else output_file_problem(file)
    if problem:
        raise UsageError(f"{flag} {file}: {problem}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs keep their lines: an indented line (an example command, a table, a formula) is left
    as written, so that it can be copied; a paragraph of prose with a line wider than the terminal is refilled at
    spaces. Option help is wrapped at spaces too, never inside a word, a path or a hyphenated value (host-all,
    fixed-cap:1)."""

    def _fill_text(self, text, width, indent):
        out: list[str] = []
        prose: list[str] = []  # the lines of the paragraph being read

        def flush() -> None:
            if any(len(indent) + len(line) > width for line in prose):  # refilled as one paragraph
                out.append(textwrap.fill(" ".join(prose), width, initial_indent=indent, subsequent_indent=indent,
                                         break_on_hyphens=False, break_long_words=False))
            else:
                out.extend(indent + line for line in prose)
            prose.clear()

        for line in text.splitlines():
            if line.strip() and not line[:1].isspace():
                prose.append(line)
                continue
            flush()
            out.append(indent + line)
        flush()
        return "\n".join(out)

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def process_escapes(text: str) -> str:
    r"""Backslash escapes as llama.cpp's command line processes them (common.cpp, string_process_escapes): \n, \r,
    \t, \', \", \\ and \xHH (two hex digits: the byte 0xHH, so \xc3\xa9 is the UTF-8 of é). E.g. the two characters
    `\n` typed in a shell become a newline. Where llama.cpp keeps any other backslash as it is (a typo then never
    matches), this raises ValueError naming the escape: an unknown one (\q), \x without two hex digits, a backslash at
    the end, \x bytes that are not UTF-8."""
    out, i = bytearray(), 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out += c.encode("utf-8", "surrogatepass")
            i += 1
            continue
        if i + 1 == len(text):
            raise ValueError("a backslash at the end escapes nothing")
        nxt, hexits = text[i + 1], text[i + 2:i + 4]
        if nxt in _ESCAPES:
            out += _ESCAPES[nxt].encode()
            i += 2
        elif nxt == "x" and len(hexits) == 2 and set(hexits) <= _HEX:
            out.append(int(hexits, 16))
            i += 4
        elif nxt == "x":
            raise ValueError(f"malformed escape \\x{hexits}: \\xHH takes two hex digits")
        else:
            raise ValueError(f"unknown escape \\{nxt}")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the \\xHH bytes are not UTF-8 (byte {e.start}: {out[e.start]:#04x})") from None


def escaped_text(text: str) -> str:
    """argparse type: the text with llama.cpp's escapes processed (process_escapes); a malformed or unknown escape
    (named with the text) and an empty result are refused."""
    try:
        value = process_escapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"'{text}': {e} (escapes: {ESCAPES_HELP})") from None
    if not value:
        raise argparse.ArgumentTypeError(f"expected a non-empty text, got {text!r}")
    return value
