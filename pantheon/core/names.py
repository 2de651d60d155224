"""Which characters a model name may hold: no control characters.

A name is written into the text log, the dashboard and every listing; a newline or NUL in one
(``--name``, a ``[[models]]`` table's name or alias, an admin load's ``name`` or the file or
folder name it defaults to, a file under ``--models-dir``) would forge log lines or garble
them. Control characters are Unicode's ``Cc`` (C0, DEL, C1) and the line and paragraph
separators (``Zl``, ``Zp``), which log viewers also break lines at. Each place a name enters
refuses one (a 400, a startup error, a catalog entry left out); a request's ``model`` holding
one is a name no model has (404), never the single-model shortcut's.
"""

from __future__ import annotations

import unicodedata

_CONTROL = frozenset({"Cc", "Zl", "Zp"})


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character (see the module's docstring)."""
    return any(unicodedata.category(c) in _CONTROL for c in text)


def escaped(text: str) -> str:
    """``text`` with each control character written as its ``\\uXXXX`` escape: one line."""
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) in _CONTROL else c for c in text)


def shown(text: str) -> str:
    """``text`` quoted and escaped, fit for a message or a log line."""
    return f'"{escaped(text)}"'


def control_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model name, or None."""
    if has_control(name):
        return f"the model name {shown(name)} has a control character (newline, NUL, ...)"
    return None
