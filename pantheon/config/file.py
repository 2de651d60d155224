"""The optional TOML config file (``pantheon serve --config FILE``).

Its keys are the settings table's TOML keys, which are the flags' long names (``queue_depth``,
or ``queue-depth``), also for the variables-only knobs (``driver_sample = false``); lists for
repeatable flags; and ``[[models]]`` tables for the models to load at start (used only when no
``--model`` flag is given). A file value is used only where neither the flag nor any of the
setting's variables is set (``pantheon.config.resolve`` applies that precedence)::

    port = 8000
    cpu_dies = 1
    api_key = ["sk-one", "sk-two"]
    models_dir = ["/srv/models"]
    drain_timeout = 20

    [[models]]
    path = "/srv/models/qwen3-0.6b"
    name = "qwen"
    dies = "cpu:0"
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

from pantheon.config.resolve import FILE_VALUES
from pantheon.config.table import toml_keys
from pantheon.config.values import ConfigError


def load_config_file(path: str) -> dict[str, Any]:
    """The parsed TOML file; ConfigError (naming ``--config``) when unreadable or invalid."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None


def _models(path: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ConfigError(f"--config {path}: 'models' must be [[models]] tables")
    models = []
    for m in value:
        if not isinstance(m.get("path"), str):
            raise ConfigError(f"--config {path}: every [[models]] needs a path")
        extra = set(m) - {"path", "name", "dies"}
        if extra:
            raise ConfigError(
                f"--config {path}: [[models]] has unknown keys {sorted(extra)} (path, name, dies)"
            )
        dies = m.get("dies")
        if isinstance(dies, list):
            dies = ",".join(str(d) for d in dies)
        models.append(
            {k: v for k, v in (("path", m["path"]), ("name", m.get("name")), ("dies", dies)) if v is not None}
        )
    return models


def merge_config_file(
    args: dict[str, Any], env: Mapping[str, str] | None = None, parser: Any = None
) -> dict[str, Any]:
    """``args`` (flags given, None dropped) with ``args['config']``'s file added: its
    ``[[models]]`` as ``models`` when no ``--model`` was given, its settings under
    ``FILE_VALUES`` for ``build_config``, which ranks them below flags and variables.

    ``env`` and ``parser`` are accepted for the callers that pass them; the keys and the
    precedence come from the settings table."""
    path = args.get("config")
    if not path:
        return args
    data = load_config_file(path)
    keys = toml_keys()
    out = dict(args)
    found: dict[str, tuple[Any, str]] = dict(out.get(FILE_VALUES) or {})
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key == "models":
            models = _models(path, value)
            if not out.get("models"):
                out["models"] = models
            continue
        row = keys.get(key)
        if row is None:
            raise ConfigError(f"--config {path}: unknown key {raw_key!r}")
        found[row.name] = (value, f"--config {path}: {raw_key}")
    out[FILE_VALUES] = found
    return out
