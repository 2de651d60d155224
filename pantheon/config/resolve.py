"""Each row of the settings table resolved to one value, and where it came from.

Precedence, for every setting: command-line flag > environment variable > config file >
the table's default. Among a row's variables the first set one wins (``PANTHEON_*`` names
first, then the original spec's names as aliases); a variable set to an empty string counts as
unset. A value is parsed by its row's kind and checked by its row's check; a bad one is a
``ConfigError`` naming its source: the flag (``--port``), the variable (``PANTHEON_PORT``) or
the file's key (``--config FILE: port``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pantheon.config import values as v
from pantheon.config.table import REFUSED_ENV, SETTINGS, Setting
from pantheon.config.values import ConfigError

# The key of ``args`` that ``merge_config_file`` fills: {row name: (file value, "--config F: key")}
FILE_VALUES = "_from_file"


@dataclass
class Resolved:
    """``values``: every config row's value (the default where no source set it);
    ``sources``: the rows a source set, and which (``--port``, ``PANTHEON_PORT``, ...)."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)


def convert(row: Setting, raw: Any, what: str, from_env: bool) -> Any:
    """``raw`` (a flag's, variable's or file's value) parsed by the row's kind."""
    kind = row.kind
    if kind == "int":
        return v.parse_int(raw, what)
    if kind == "float":
        return v.parse_float(raw, what)
    if kind == "bool":
        return v.parse_bool(raw, what)
    if kind == "switch":
        return v.parse_switch(raw, what)
    if kind in ("size", "size0"):
        if kind == "size0" and str(raw).strip() in ("0", "0B", "0b"):
            return 0  # a reserve may be nothing
        return v.parse_size(raw, what)
    if kind in ("list", "keys"):
        # a variable packs several items; a flag or file string is one item
        sep = ("," if kind == "keys" else os.pathsep) if from_env else None
        return v.parse_list(raw, what, sep)
    if kind == "thresholds":
        try:
            return v.parse_thresholds(raw)
        except ValueError as e:
            raise ConfigError(f"{what} {e}") from None
    return v.parse_str(raw, what)


def _candidates(
    row: Setting, args: Mapping[str, Any], env: Mapping[str, str], file: Mapping[str, tuple[Any, str]]
):
    """(raw value, what, from_env, variable name) of each source that sets the row, in
    precedence order."""
    if args.get(row.name) is not None:
        yield args[row.name], row.flag or row.name, False, None
    for name in row.env:
        raw = env.get(name)
        if raw is not None and raw.strip() != "":
            yield raw, name, True, name
    if row.name in file:
        raw, what = file[row.name]
        yield raw, what, False, None


def resolve_row(
    row: Setting, args: Mapping[str, Any], env: Mapping[str, str], file: Mapping[str, tuple[Any, str]]
) -> tuple[Any, str | None]:
    """The row's checked value and its source (None: the default)."""
    for raw, what, from_env, var in _candidates(row, args, env, file):
        if row.empty == "next" and raw == "":
            continue  # an empty value here means "not given": look at the next source
        if row.empty == "unset" and raw == "":
            return row.default, None  # an explicit empty value: the default, lower sources unread
        value = convert(row, raw, what, from_env)
        if var is not None and row.env_value is not None:
            value = row.env_value(var, value, what)
        if row.check is not None:
            value = row.check(value, what)
        return value, what
    return row.default, None


def refuse_env(env: Mapping[str, str]) -> None:
    """Startup refusals that no setting covers (a variable whose mere presence is an error)."""
    for name in REFUSED_ENV:
        if env.get(name, "") != "":
            raise ConfigError(
                f"{name} is set: this debug knob copies the full vocabulary's logits off the "
                "device every step and is refused at serve startup; unset it"
            )


def resolve(args: Mapping[str, Any], env: Mapping[str, str]) -> Resolved:
    """Every config row of the table resolved from ``args`` (argparse dests; None is not given,
    and ``args[FILE_VALUES]`` holds the config file's values) and ``env``."""
    file = args.get(FILE_VALUES) or {}
    out = Resolved()
    for row in SETTINGS:
        if row.field is None:
            continue  # --model/--name/--dies, --config, --curve-keygen: not config fields
        value, what = resolve_row(row, args, env, file)
        out.values[row.name] = value
        if what is not None:
            out.sources[row.name] = what
    return out
