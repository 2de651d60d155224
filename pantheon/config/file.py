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
    aliases = ["qwen3", "default"]
    pin = true                  # never unloaded by keep-alive or eviction
    kv_cache_dtype = "q8_0"     # its KV cache in 8-bit blocks: ~1.9x the context of bf16
    params = { temperature = 0.6, top_k = 20 }   # a request's unset sampling fields

    [[models]]
    path = "/srv/models/big.gguf"
    preload = false             # in the catalog, loaded on first request
    keep_alive = "10m"          # idle time before it is unloaded again

A ``[[models]]`` table takes ``path`` (required), ``name``, ``dies``, ``aliases``, ``preload``
(default true), ``keep_alive`` (seconds or a duration such as "5m"; negative: forever), ``pin``,
``params`` (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``max_tokens``) and the admin load's options ``quantize``, ``slots``, ``max_context``,
``embeddings`` (a chat model also serves ``/v1/embeddings``, mean pooling) and
``kv_cache_dtype`` (``"q8_0"``, or K and V apart as ``"q8_0/q4_0"``; over ``--kv-cache-dtype``)
and ``draft`` (a draft model's path for speculative decoding: same tokenizer, smaller; or
``"mtp"``: the model's own multi-token-prediction head, Qwen3.5's ``mtp.*``).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

from pantheon.config.resolve import FILE_VALUES
from pantheon.config.table import toml_keys
from pantheon.config.values import ConfigError, KeepAliveError, parse_keep_alive, parse_kv_types


def load_config_file(path: str) -> dict[str, Any]:
    """The parsed TOML file; ConfigError (naming ``--config``) when unreadable or invalid."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML: {e}") from None


MODEL_KEYS = (
    "path",
    "name",
    "dies",
    "aliases",
    "preload",
    "keep_alive",
    "pin",
    "params",
    "quantize",
    "slots",
    "max_context",
    "embeddings",
    "kv_cache_dtype",
    "draft",
)
PARAM_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def _model_table(where: str, m: dict[str, Any]) -> dict[str, Any]:
    """One ``[[models]]`` table, checked, as ``build_config`` takes it."""
    if not isinstance(m.get("path"), str):
        raise ConfigError(f"{where} needs a path")
    extra = set(m) - set(MODEL_KEYS)
    if extra:
        raise ConfigError(f"{where} has unknown keys {sorted(extra)} ({', '.join(MODEL_KEYS)})")
    out: dict[str, Any] = {"path": m["path"]}
    if m.get("name") is not None:
        if not isinstance(m["name"], str) or not m["name"]:
            raise ConfigError(f"{where}: 'name' must be a non-empty string")
        out["name"] = m["name"]
    dies = m.get("dies")
    if dies is not None:
        out["dies"] = ",".join(str(d) for d in dies) if isinstance(dies, list) else dies
    aliases = m.get("aliases", [])
    if isinstance(aliases, str):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ConfigError(f"{where}: 'aliases' must be a list of names")
    if aliases:
        out["aliases"] = tuple(aliases)
    for key in ("preload", "pin", "quantize", "embeddings"):
        if key in m:
            if not isinstance(m[key], bool):
                raise ConfigError(f"{where}: {key!r} must be true or false")
            out[key] = m[key]
    for key in ("slots", "max_context"):
        if key in m:
            if not isinstance(m[key], int) or isinstance(m[key], bool) or m[key] < 1:
                raise ConfigError(f"{where}: {key!r} must be a positive integer")
            out[key] = m[key]
    if "draft" in m:
        if not isinstance(m["draft"], str) or not m["draft"]:
            raise ConfigError(f"{where}: 'draft' must be a model path (a folder or a .gguf file) or \"mtp\"")
        out["draft"] = m["draft"]
    if "kv_cache_dtype" in m:
        out["kv_cache_dtype"] = parse_kv_types(m["kv_cache_dtype"], f"{where}: kv_cache_dtype")
    if "keep_alive" in m:
        try:
            out["keep_alive"] = parse_keep_alive(m["keep_alive"])
        except KeepAliveError as e:
            raise ConfigError(f"{where}: {e}") from None
    if "params" in m:
        params = m["params"]
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: 'params' must be a table ({', '.join(PARAM_KEYS)})")
        for k, v in params.items():
            if k not in PARAM_KEYS:
                raise ConfigError(f"{where}: params has an unknown key {k!r} ({', '.join(PARAM_KEYS)})")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{where}: params.{k} must be a number >= 0")
        out["params"] = dict(params)
    return out


def _models(path: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ConfigError(f"--config {path}: 'models' must be [[models]] tables")
    return [_model_table(f"--config {path}: [[models]] #{i + 1}", m) for i, m in enumerate(value)]


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
