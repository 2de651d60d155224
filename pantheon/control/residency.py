"""Which models are resident: load on first request, keep-alive, least-recently-used eviction.

(Interface first; the behaviour lands with issue 24's catalog.)

- ``ensure(name)``: a request names a model; when the catalog knows it and no instance of it is
  loaded, load it (one load however many requests wait for it) and return once it is ready;
- ``keep(name, keep_alive)``: a request for ``name`` ended; its instances stay loaded for
  ``keep_alive`` seconds of idleness (None: the entry's or ``--keep-alive``; ``FOREVER``: until
  unloaded by hand; 0: unload as soon as it is idle);
- eviction: a load that needs room (``--models-max``, a die's memory) unloads idle, unpinned
  instances, least recently used first.

``parse_keep_alive`` reads the one duration format every route takes (Ollama's: a number of
seconds, or a Go duration such as ``"5m"``, ``"1h30m"``, ``"250ms"``; negative: forever).
"""

from __future__ import annotations

import math
import re

FOREVER = math.inf

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class KeepAliveError(ValueError):
    """A keep-alive value that is neither a number nor a duration; its message says why."""


def parse_keep_alive(value: object) -> float | None:
    """Seconds to stay loaded when idle: ``FOREVER`` for a negative value, None for None.

    Numbers are seconds (Ollama's JSON number); strings are a bare number of seconds or a Go
    duration (``"5m"``, ``"-1m"``, ``"1h30m"``). Raises ``KeepAliveError``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise KeepAliveError(
            f'keep_alive must be a duration such as "5m" or a number of seconds, not {value!r}'
        )
    if isinstance(value, (int, float)):
        if math.isnan(value):
            raise KeepAliveError("keep_alive must not be NaN")
        return FOREVER if value < 0 else float(value)
    if not isinstance(value, str):
        raise KeepAliveError(
            f'keep_alive must be a duration such as "5m" or a number of seconds, not {value!r}'
        )
    text = value.strip()
    try:
        n = float(text)
    except ValueError:
        pass
    else:
        return parse_keep_alive(n)
    sign = 1.0
    if text[:1] in "+-" and text:
        sign = -1.0 if text[0] == "-" else 1.0
        text = text[1:]
    pos, total = 0, 0.0
    for m in _PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not text or pos != len(text):
        raise KeepAliveError(
            f'keep_alive {value!r} is not a duration (a number of seconds, or such as "5m", "1h30m", "-1")'
        )
    return FOREVER if sign < 0 else total


class Residency:
    """Load on first request, keep-alive and eviction (see the module doc)."""

    async def ensure(self, name: str | None) -> None:
        """Return once a model named ``name`` (a catalog name or alias) has a ready instance,
        loading it if the catalog knows it; raises the load's ``ApiError``. A name the catalog
        does not know is left to the registry's routing (its 404 or single-model shortcut)."""

    def keep(self, name: str, keep_alive: float | None) -> None:
        """A request for ``name`` ended: keep its idle instances for ``keep_alive`` seconds
        (None: the default; ``FOREVER``; 0: unload once idle)."""
