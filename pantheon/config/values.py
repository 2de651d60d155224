"""``ConfigError`` and the value parsers every settings source shares (flag, variable, TOML file).

This module imports nothing from ``pantheon`` but the wire protocol (msgspec only; its die-id
parser) and the KV cache type names (``pantheon.core.kv_types``, plain Python): ``pantheon.core.curve`` and the admin API
import ``ConfigError`` from here without pulling in the rest of the configuration (and without
the old ``config`` -> ``curve`` -> ``config`` import cycle). Every parser takes ``what``, the
name of the source the value came from (``--port``, ``PANTHEON_PORT``, ``--config FILE: port``),
and puts it in the message of the ``ConfigError`` it raises.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pantheon.core.errors import ConfigError  # its home: the core raises it too
from pantheon.core.kv_types import KV_TYPES, KvCacheTypes
from pantheon.core.protocol import normalize_die

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "ki": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "mi": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "gi": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
    "ti": 1 << 40,
}


def parse_size(value: str | int, what: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5G"`` or a plain byte count -> bytes."""
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{what}: {value!r} is not a size (try 2GiB, 512MiB or bytes)")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ConfigError(f"{what}: a size must be positive, got {value!r}")
    return n


def format_size(n: int) -> str:
    """The inverse of ``parse_size`` for the help text: ``8 << 20`` -> ``"8MiB"``."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def parse_dies(value: str, what: str = "--dies") -> tuple[str, ...]:
    """``"0,1"`` -> ``("cuda:0", "cuda:1")``; ``"cpu:0"`` stays; duplicates are refused."""
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            part = normalize_die(part)  # the one die-id parser, shared with the workers
        except ValueError:
            raise ConfigError(f"{what}: {part!r} is not a die (use N, cuda:N or cpu:N)") from None
        if part in out:
            raise ConfigError(f"{what}: die {part} listed twice")
        out.append(part)
    if not out:
        raise ConfigError(f"{what}: empty die list")
    return tuple(out)


def parse_int(raw: Any, what: str) -> int:
    # a TOML true is an int to Python; refuse it rather than read it as 1
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    try:
        if isinstance(raw, bool):
            raise ValueError
        return int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{what}={raw!r}: expected an integer") from None


def parse_float(raw: Any, what: str) -> float:
    try:
        if isinstance(raw, bool):
            raise ValueError
        return float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}={raw!r}: expected a number") from None


def parse_bool(raw: Any, what: str) -> bool:
    if isinstance(raw, bool):
        return raw
    s = str(raw).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}={raw!r}: expected 1 or 0")


def parse_switch(raw: Any, what: str) -> bool:
    """A variable that is on when set to 1/true/yes and off otherwise; never an error."""
    if isinstance(raw, bool):
        return raw
    return str(raw).strip() in ("1", "true", "yes")


def parse_str(raw: Any, what: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"{what}: expected a string")
    return raw


def parse_list(raw: Any, what: str, sep: str | None) -> tuple[str, ...]:
    """A list of strings: a list as given, or a string split on ``sep`` (None: one item).
    Flags and the file give one item per string; variables pack several with ``sep``."""
    if isinstance(raw, str):
        items = raw.split(sep) if sep else [raw]
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        raise ConfigError(f"{what}: expected a list of strings")
    return tuple(str(x).strip() for x in items if str(x).strip())


def parse_thresholds(raw: str) -> tuple[float, float, float]:
    """``"0.8,0.9,0.95"`` -> a rising triple of fractions in (0, 1]; raises ValueError."""
    parts = [p.strip() for p in str(raw).split(",") if p.strip()]
    if len(parts) != 3:
        raise ValueError(f"{raw!r}: give three comma-separated fractions, e.g. 0.85,0.92,0.97")
    vals = tuple(float(p) for p in parts)
    if not all(0 < v <= 1 for v in vals) or not vals[0] <= vals[1] <= vals[2]:
        raise ValueError(f"{raw!r}: the fractions must rise and lie in (0, 1]")
    return vals  # type: ignore[return-value]


# ---------------------------------------------------------------- durations

FOREVER = math.inf

_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


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
    for m in _DURATION_PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if not text or pos != len(text):
        raise KeepAliveError(
            f'keep_alive {value!r} is not a duration (a number of seconds, or such as "5m", "1h30m", "-1")'
        )
    return FOREVER if sign < 0 else total


def parse_kv_types(raw: object, what: str) -> KvCacheTypes:
    """A model's KV cache types: one type name for K and V (``q8_0``), or ``K/V`` apart
    (``q8_0/q4_0``, as ``KvCacheTypes`` prints itself); names from ``KV_TYPES``."""
    if not isinstance(raw, str) or not raw.strip():
        raise ConfigError(f"{what} {raw!r}: a KV cache type ({', '.join(KV_TYPES)}), or K/V as q8_0/q4_0")
    parts = [p.strip().lower() for p in raw.split("/")]
    if len(parts) > 2 or any(p not in KV_TYPES for p in parts):
        raise ConfigError(
            f"{what} {raw!r}: use {', '.join(KV_TYPES[:-1])} or {KV_TYPES[-1]}, or K/V apart as q8_0/q4_0"
        )
    return KvCacheTypes(parts[0], parts[-1])
