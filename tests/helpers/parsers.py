"""Run a chat output parser (the emitter, Harmony's, Gemma 4's) over text pieces, as the unit
tests of each do: ``run`` feeds the pieces and joins the deltas, with each tool call's id checked
(``call_`` and 24 letters or digits) and blanked to ``"ID"`` so results compare."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from pantheon.chat.emitter import Delta, OutputScanner, join_deltas

CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


def run_parser(
    make: Callable[..., OutputScanner], chunks: Iterable[str], **kw: Any
) -> tuple[dict, OutputScanner, list[Delta]]:
    """Feed ``chunks`` to ``make(**kw)``; return (joined result with ids checked and blanked,
    the parser, every delta)."""
    p = make(**kw)
    deltas: list[Delta] = []
    for c in chunks:
        deltas += p.feed(c)
    deltas += p.finish()
    out = join_deltas(deltas)
    for call in out["tool_calls"]:
        assert CALL_ID.fullmatch(call["id"])
        call["id"] = "ID"
    return out, p, deltas
