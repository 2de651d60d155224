"""JSON text as it grows, for streaming a call's arguments (OpenAI's ``arguments`` fragments).

A model writes a call's arguments as JSON in its own spacing (``{"a":1}``); the arguments
Pantheon answers are that JSON as ``json.dumps(value, ensure_ascii=False)`` spells it
(``{"a": 1}``). :func:`json_so_far` reads a JSON value from the start of a text that may be
cut anywhere and gives that spelling of what is certain so far: the text it gives for a longer
text always starts with the one it gave for a shorter one (a number, a literal, an escape or a
surrogate pair waits until it is whole), so a stream of it is the difference from the last, and
for a whole value it is exactly ``json.dumps(json.loads(text), ensure_ascii=False)`` (but for
an object's repeated key, which is kept as written). What it reads is what Python's ``json``
reads (``NaN``, ``Infinity``; no control characters in strings).
"""

from __future__ import annotations

import json
import re

__all__ = ["json_so_far", "skip_ws"]

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')  # string characters that need no decoding
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class _Cut(Exception):
    """The text ends before the value does."""


class _Bad(Exception):
    """The text is not JSON from here."""


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character (JSON's) at or after ``i``."""
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def json_so_far(text: str, pos: int = 0) -> tuple[str, int | None]:
    """The JSON value at ``pos`` (after whitespace) as ``json.dumps`` spells it, so far, and the
    index after it when it is whole (None when ``text`` ends inside it or it is not JSON; what is
    given is then what was certain before that point)."""
    out: list[str] = []
    try:
        end = _value(text, skip_ws(text, pos), out)
    except (_Cut, _Bad):
        return "".join(out), None
    return "".join(out), end


def _at(text: str, i: int) -> str:
    if i >= len(text):
        raise _Cut
    return text[i]


def _value(text: str, i: int, out: list[str]) -> int:
    c = _at(text, i)
    if c == "{":
        return _container(text, i, out, "}", key=True)
    if c == "[":
        return _container(text, i, out, "]", key=False)
    if c == '"':
        return _string(text, i, out)
    rest = text[i : i + len("-Infinity")]
    for lit in _LITERALS:
        if rest.startswith(lit):
            out.append(json.dumps(json.loads(lit)))
            return i + len(lit)
        if lit.startswith(rest):
            raise _Cut  # a literal (or a number) being written
    run = _NUMBER_CHARS.match(text, i)
    assert run is not None  # (matches the empty string)
    if run.end() >= len(text):
        raise _Cut  # the number may go on
    if not _NUMBER.fullmatch(run.group()):
        raise _Bad
    try:
        number = json.loads(run.group())
    except ValueError:  # (an integer longer than Python converts)
        raise _Bad from None
    out.append(json.dumps(number))
    return run.end()


def _container(text: str, i: int, out: list[str], close: str, *, key: bool) -> int:
    """An object (``key``) or array from its opening bracket."""
    out.append(text[i])
    i = skip_ws(text, i + 1)
    if _at(text, i) == close:
        out.append(close)
        return i + 1
    while True:
        if key:
            if _at(text, i) != '"':
                raise _Bad
            i = skip_ws(text, _string(text, i, out))
            if _at(text, i) != ":":
                raise _Bad
            out.append(": ")
            i = skip_ws(text, i + 1)
        i = skip_ws(text, _value(text, i, out))
        c = _at(text, i)
        if c == close:
            out.append(close)
            return i + 1
        if c != ",":
            raise _Bad
        out.append(", ")
        i = skip_ws(text, i + 1)


def _hex4(text: str, i: int) -> int:
    digits = text[i : i + 4]
    if len(digits) < 4 and all(d in "0123456789abcdefABCDEF" for d in digits):
        raise _Cut
    if len(digits) < 4 or not all(d in "0123456789abcdefABCDEF" for d in digits):
        raise _Bad
    return int(digits, 16)


def _string(text: str, i: int, out: list[str]) -> int:
    """A string from its quote; its characters go out as they are read (escapes once whole)."""
    out.append('"')
    i += 1
    while True:
        plain = _PLAIN.match(text, i)
        assert plain is not None
        if plain.group():
            out.append(json.dumps(plain.group(), ensure_ascii=False)[1:-1])
        i = plain.end()
        c = _at(text, i)
        if c == '"':
            out.append('"')
            return i + 1
        if c != "\\":
            raise _Bad  # a control character (Python's json is strict)
        e = _at(text, i + 1)
        if e in _ESCAPES:
            ch, i = _ESCAPES[e], i + 2
        elif e == "u":
            code = _hex4(text, i + 2)
            i += 6
            # a high surrogate and an escaped low one are one character (as ``json`` reads them)
            if 0xD800 <= code <= 0xDBFF:
                follow = text[i : i + 2]
                if follow == "\\u":
                    low = _hex4(text, i + 2)
                    if 0xDC00 <= low <= 0xDFFF:
                        code, i = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), i + 6
                elif "\\u".startswith(follow):
                    raise _Cut
            ch = chr(code)
        else:
            raise _Bad
        out.append(json.dumps(ch, ensure_ascii=False)[1:-1])
