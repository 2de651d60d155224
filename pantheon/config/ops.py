"""Operations settings: security, limits, logs, registration, shutdown, recovery, the spec's knobs,
and the optional TOML config file. ``config.build_config`` calls ``build_ops``; ``server_cli`` calls
``add_arguments``, ``document`` and ``merge_config_file``.

Precedence, for every setting: command-line flag > environment variable > config file > default.
``PANTHEON_*`` names come first among the variables; the original spec's names (``QWEN35_*``,
``BS_*``, ``PN_*``) are honoured as aliases. Every value is checked once, here; a bad one is a
``ConfigError`` naming the flag, variable or file key to fix.

The config file (``--config FILE``, TOML) takes the flags' long names as keys (``queue_depth`` or
``queue-depth``), lists for repeatable flags, and ``[[models]]`` tables for the models to load at
start (used only when no ``--model`` flag is given)::

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

import argparse
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

# ConfigError lives in config.py, which imports this module lazily (no import cycle at load).


def _config_error(msg: str) -> Exception:
    from pantheon.config.settings import ConfigError

    return ConfigError(msg)


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request ceilings (the body size limit is ``ServeConfig.max_body_bytes``)."""

    max_messages: int = 1024
    max_n: int = 16
    max_tokens: int | None = None  # None: only the model's context bounds max_tokens
    max_stop: int = 4  # at most 4: the OpenAI API's own ceiling
    max_stop_len: int = 256  # characters per stop string


class OpsConfig(msgspec.Struct, frozen=True, kw_only=True):
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    models_dirs: tuple[str, ...] = ()
    limits: Limits = Limits()
    log_format: str = "text"  # text | json
    drain_timeout_s: float = 30.0
    registry_url: str | None = None
    registry_heartbeat_s: float = 5.0
    node_id: str = "node0"
    registry_transport: str = "local"
    advertise_host: str | None = None
    worker_restarts: int = 10  # restarts per die before giving up (0: never restart)
    restart_backoff_s: float = 0.5  # first restart delay; doubles, at most 30 s
    step_timeout_s: float = 300.0  # a worker turn (a step) running longer is a hung worker
    step_target_s: float = 0.5  # the engines size prefill so that one step takes about this
    worker_listen: str | None = None  # tcp://host:port for remote workers (needs CURVE keys)
    curve_dir: str | None = None
    # the spec's engine knobs
    driver_sample: bool = True
    prefill_batch: bool = True
    step_stats: bool = False
    kv_q4: bool = True
    async_poll_us: int | None = None  # None: the worker's own 50 ms
    cpu_path: str = "auto"  # CPU dies' linear-layer path (workers/cpu_paths.py)
    compile: bool = False  # torch.compile the decode step at load (workers/compiled.py)


@dataclass(frozen=True)
class Opt:
    """One setting: its argparse dest / file key, flag, variables, parser and help."""

    key: str
    flag: str | None
    env: tuple[str, ...]
    kind: str  # str | int | float | bool | list | keys (comma-separated list)
    help: str
    metavar: str | None = None


# The settings this module parses (OpsConfig and Limits fields).
OPTS: tuple[Opt, ...] = (
    Opt("api_key", "--api-key", ("PANTHEON_API_KEY",), "keys",
        "an API key that /v1/* accepts as 'Authorization: Bearer KEY' (repeatable; the variable "
        "takes several, comma-separated). Unset: /v1/* is open", "KEY"),
    Opt("admin_key", "--admin-key", ("PANTHEON_ADMIN_KEY",), "str",
        "the key /admin/* requires. Unset: the admin API answers only on loopback", "KEY"),
    Opt("models_dir", "--models-dir", ("PANTHEON_MODELS_DIR",), "list",
        "admin loads may only name folders under these roots, links resolved (repeatable; the "
        "variable is ':'-separated). Unset: any folder", "DIR"),
    Opt("max_messages", "--max-messages", ("PANTHEON_MAX_MESSAGES",), "int",
        "most messages in one chat request (default 1024)", "N"),
    Opt("max_n", "--max-n", ("PANTHEON_MAX_N",), "int",
        "largest 'n' (choices per request; default 16, at most 128)", "N"),
    Opt("max_tokens_limit", "--max-tokens-limit", ("PANTHEON_MAX_TOKENS",), "int",
        "largest 'max_tokens' a request may ask for (default: the model's context)", "N"),
    Opt("max_stop", "--max-stop", ("PANTHEON_MAX_STOP",), "int",
        "most stop strings per request (default 4, at most 4)", "N"),
    Opt("max_stop_len", "--max-stop-len", ("PANTHEON_MAX_STOP_LEN",), "int",
        "longest stop string, in characters (default 256)", "N"),
    Opt("log_format", "--log-format", ("PANTHEON_LOG_FORMAT",), "str",
        "text (default) or json: one JSON object per log line", "FMT"),
    Opt("drain_timeout", "--drain-timeout", ("PANTHEON_DRAIN_TIMEOUT",), "float",
        "on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they are ended "
        "(default 30)", "S"),
    Opt("registry_url", "--registry-url", ("PANTHEON_REGISTRY_URL",), "str",
        "register with this router registry (POST URL/register, /heartbeat, /deregister). "
        "Unset: nothing is sent", "URL"),
    Opt("registry_heartbeat", "--registry-heartbeat", ("PANTHEON_REGISTRY_HEARTBEAT",), "float",
        "seconds between registry heartbeats (default 5)", "S"),
    Opt("node_id", "--node-id", ("PANTHEON_NODE_ID",), "str",
        "node identifier sent on registration (default node0)", "ID"),
    Opt("registry_transport", "--registry-transport", ("PANTHEON_REGISTRY_TRANSPORT",), "str",
        "transport hint sent on registration (default local)", "NAME"),
    Opt("advertise_host", "--advertise-host", ("PANTHEON_ADVERTISE_HOST",), "str",
        "host name put in the registered endpoint (default: the bind address)", "HOST"),
    Opt("worker_restarts", "--worker-restarts", ("PANTHEON_WORKER_RESTARTS",), "int",
        "times a dead worker is restarted (its models reloaded) before its die stays failed "
        "(default 10; 0 never restarts)", "N"),
    Opt("restart_backoff", "--restart-backoff", ("PANTHEON_RESTART_BACKOFF",), "float",
        "seconds before the first restart of a dead worker; doubles each time, at most 30 "
        "(default 0.5)", "S"),
    Opt("step_timeout", "--step-timeout", ("PANTHEON_STEP_TIMEOUT",), "float",
        "seconds one worker step may run before the worker counts as hung and is restarted; "
        "its heartbeat thread reports progress meanwhile (default 300)", "S"),
    Opt("step_target", "--step-target", ("PANTHEON_STEP_TARGET",), "float",
        "seconds one engine step should take: each step prefills as many prompt tokens as fit, "
        "measured as it runs, so streams keep flowing past long prompts (default 0.5)", "S"),
    Opt("worker_listen", "--worker-listen", ("PANTHEON_WORKER_LISTEN",), "str",
        "tcp://HOST:PORT for workers on other hosts; refused without CURVE keys in --curve-dir",
        "URL"),
    Opt("curve_dir", "--curve-dir", ("PANTHEON_CURVE_DIR",), "str",
        "folder with the router's CURVE keypair (server.key, server.key_secret); "
        "'pantheon serve --curve-keygen DIR' writes one", "DIR"),
    Opt("driver_sample", None, ("PANTHEON_DRIVER_SAMPLE", "QWEN35_BS_DRIVER_SAMPLE"), "bool",
        "1 (default): sampling runs inside the worker; 0 (legacy owner-side lockstep sampling) "
        "is accepted with a warning: this design always samples in the worker"),
    Opt("prefill_batch", None, ("PANTHEON_PREFILL_BATCH", "QWEN35_BS_PREFILL_BATCH"), "bool",
        "0 disables batched chunk prefill: prompts are prefilled token by token (chunk 1)"),
    Opt("step_stats", "--step-stats", ("PANTHEON_STEP_STATS", "QWEN35_BS_STATS"), "bool",
        "workers log every engine step's timing to stderr"),
    Opt("kv_q4", None, ("PANTHEON_KV_Q4", "QWEN35_KV_Q4"), "bool",
        "Q4 KV quantization in admission math; the Python engine keeps KV at full width, so "
        "admission always counts full-width KV (the effect of 0)"),
    Opt("cpu_path", "--cpu-path", ("PANTHEON_CPU_PATH",), "str",
        "how CPU dies run the linear layers: auto (default: the fastest of those that work on this "
        "CPU, timed on each model's shapes at load) or one of bf16-packed, bf16, fp32-packed, fp32 "
        "(int8 is what quantize=true loads use); a forced path that fails on this CPU fails loads",
        "PATH"),
    Opt("compile", "--compile", ("PANTHEON_COMPILE",), "bool",
        "compile each model's decode step with torch.compile at load (inductor; needs a C++ "
        "compiler): ~20-45%% faster decode on CPU for ~40-120 s more load time; a failed compile "
        "stays eager"),
    Opt("async_poll_us", None, ("PANTHEON_ASYNC_POLL_US", "PN_ASYNC_POLL_US"), "int",
        "longest sleep, in microseconds, of a worker's loop between polls while it waits on a "
        "load (at least 1000: zmq polls in milliseconds; unset: 50000)"),
)

# Settings parsed by config.py: their variables, for the help text and the config file's layer.
CORE_ENV: dict[str, tuple[str, ...]] = {
    "host": ("PANTHEON_HOST",),
    "port": ("PANTHEON_PORT",),
    "slots": ("PANTHEON_BATCH_SLOTS", "QWEN35_BATCH_SLOTS"),
    "queue_depth": ("PANTHEON_QUEUE_DEPTH", "BS_QUEUE_DEPTH"),
    "queue_timeout": ("PANTHEON_QUEUE_TIMEOUT",),
    "prefill_chunk": ("PANTHEON_PREFILL_CHUNK", "QWEN35_BS_PREFILL_CHUNK"),
    "cpu_dies": ("PANTHEON_CPU_DIES",),
    "cpu_die_budget": ("PANTHEON_CPU_DIE_BUDGET",),
    "kv_budget": ("PANTHEON_KV_BUDGET",),
    "max_model_len": ("PANTHEON_MAX_MODEL_LEN",),
    "dtype": ("PANTHEON_DTYPE",),
    "max_body": ("PANTHEON_MAX_BODY",),
    "hello_timeout": ("PANTHEON_HELLO_TIMEOUT",),
    "worker_threads": ("PANTHEON_WORKER_THREADS",),
    "log_level": ("PANTHEON_LOG_LEVEL",),
}

REFUSED_ENV = ("PANTHEON_GPU_FULL_LOGITS", "QWEN35_GPU_FULL_LOGITS")

_BY_KEY = {o.key: o for o in OPTS}


def env_names(key: str) -> tuple[str, ...]:
    """The variables that set ``key`` (an argparse dest), PANTHEON_* first."""
    if key in _BY_KEY:
        return _BY_KEY[key].env
    return CORE_ENV.get(key, ())


# ---------------------------------------------------------------- parsing values


def _bool(raw: Any, what: str) -> bool:
    if isinstance(raw, bool):
        return raw
    s = str(raw).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise _config_error(f"{what}={raw!r}: expected 1 or 0")


def _convert(opt: Opt, raw: Any, what: str, from_env: bool) -> Any:
    try:
        if opt.kind == "int":
            if isinstance(raw, bool):
                raise ValueError
            return int(str(raw).strip()) if not isinstance(raw, int) else raw
        if opt.kind == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
    except ValueError:
        word = "an integer" if opt.kind == "int" else "a number"
        raise _config_error(f"{what}={raw!r}: expected {word}") from None
    if opt.kind == "bool":
        return _bool(raw, what)
    if opt.kind in ("list", "keys"):
        if isinstance(raw, str):
            sep = "," if opt.kind == "keys" else os.pathsep
            items = raw.split(sep) if from_env else [raw]
        elif isinstance(raw, (list, tuple)):
            items = list(raw)
        else:
            raise _config_error(f"{what}: expected a list of strings")
        out = tuple(str(x).strip() for x in items if str(x).strip())
        return out
    if not isinstance(raw, str):
        raise _config_error(f"{what}: expected a string")
    return raw


def _get(key: str, args: Mapping[str, Any], env: Mapping[str, str]) -> tuple[Any, str] | None:
    """(value, what) from the flag, else the first variable set; None when neither is."""
    opt = _BY_KEY[key]
    if args.get(key) is not None:
        what = opt.flag or key
        return _convert(opt, args[key], what, from_env=False), what
    for name in opt.env:
        raw = env.get(name)
        if raw is not None and raw.strip() != "":
            return _convert(opt, raw, name, from_env=True), name
    return None


def build_ops(args: Mapping[str, Any], env: Mapping[str, str]) -> OpsConfig:
    """The operations settings from flags (``args``, argparse dests) over variables."""
    for name in REFUSED_ENV:
        if env.get(name, "") != "":
            raise _config_error(
                f"{name} is set: this debug knob copies the full vocabulary's logits off the "
                "device every step and is refused at serve startup; unset it")
    kw: dict[str, Any] = {}
    lim: dict[str, Any] = {}

    def val(key: str):
        return _get(key, args, env)

    if (got := val("api_key")) is not None:
        kw["api_keys"] = tuple(dict.fromkeys(got[0]))
    if (got := val("admin_key")) is not None and got[0]:
        kw["admin_key"] = got[0]
    if (got := val("models_dir")) is not None:
        roots = []
        for d in got[0]:
            if not os.path.isdir(d):
                raise _config_error(f"{got[1]}: {d!r} is not a folder")
            roots.append(os.path.realpath(d))
        kw["models_dirs"] = tuple(dict.fromkeys(roots))
    for key, field, lo, hi in (("max_messages", "max_messages", 1, None),
                               ("max_n", "max_n", 1, 128),
                               ("max_tokens_limit", "max_tokens", 1, None),
                               ("max_stop", "max_stop", 0, 4),
                               ("max_stop_len", "max_stop_len", 1, None)):
        if (got := val(key)) is not None:
            n, what = got
            if n < lo or hi is not None and n > hi:
                rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
                raise _config_error(f"{what} {n}: must be {rng}")
            lim[field] = n
    if lim:
        kw["limits"] = Limits(**lim)
    if (got := val("log_format")) is not None:
        if got[0] not in ("text", "json"):
            raise _config_error(f"{got[1]} {got[0]!r}: use text or json")
        kw["log_format"] = got[0]
    for key, field, lo in (("drain_timeout", "drain_timeout_s", 0.0),
                           ("registry_heartbeat", "registry_heartbeat_s", 0.05),
                           ("restart_backoff", "restart_backoff_s", 0.0),
                           ("step_timeout", "step_timeout_s", 1.0),
                           ("step_target", "step_target_s", 0.01)):
        if (got := val(key)) is not None:
            if got[0] < lo:
                raise _config_error(f"{got[1]} {got[0]}: must be >= {lo:g} seconds")
            kw[field] = float(got[0])
    if (got := val("registry_url")) is not None and got[0]:
        if not got[0].startswith(("http://", "https://")):
            raise _config_error(f"{got[1]} {got[0]!r}: must be an http:// or https:// URL")
        kw["registry_url"] = got[0].rstrip("/")
    for key in ("node_id", "registry_transport", "advertise_host", "curve_dir"):
        if (got := val(key)) is not None and got[0]:
            kw[key] = got[0]
    if (got := val("worker_restarts")) is not None:
        if got[0] < 0:
            raise _config_error(f"{got[1]} {got[0]}: must be >= 0")
        kw["worker_restarts"] = got[0]
    if (got := val("worker_listen")) is not None and got[0]:
        kw["worker_listen"] = got[0]
    for key in ("driver_sample", "prefill_batch", "step_stats", "kv_q4", "compile"):
        if (got := val(key)) is not None:
            kw[key] = got[0]
    if (got := val("cpu_path")) is not None:
        from pantheon.models.sizing import CPU_PATHS

        if got[0] != "auto" and got[0] not in CPU_PATHS:
            raise _config_error(f"{got[1]} {got[0]!r}: use auto or one of {', '.join(CPU_PATHS)}")
        kw["cpu_path"] = got[0]
    if (got := val("async_poll_us")) is not None:
        if not 1 <= got[0] <= 1_000_000:
            raise _config_error(f"{got[1]}={got[0]}: must be between 1 and 1000000 µs")
        kw["async_poll_us"] = got[0]
    ops = OpsConfig(**kw)
    if ops.worker_listen is not None:
        from pantheon.workerlink.curve import check_listen

        check_listen(ops.worker_listen, ops.curve_dir)  # raises ConfigError
    return ops


def worker_env(ops: OpsConfig) -> dict[str, str]:
    """Variables the workers get for the spec's engine knobs (they read nothing else)."""
    out = {}
    if ops.async_poll_us is not None:
        out["PANTHEON_ASYNC_POLL_US"] = str(ops.async_poll_us)
    if ops.step_stats:
        out["PANTHEON_STEP_STATS"] = "1"
    if ops.cpu_path != "auto":
        out["PANTHEON_CPU_PATH"] = ops.cpu_path
    if ops.compile:
        out["PANTHEON_COMPILE"] = "1"
    return out


# ---------------------------------------------------------------- flags, help, config file


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of ``OPTS`` (the env-only knobs get none), ``--config``, ``--curve-keygen``."""
    ap.add_argument("--config", metavar="FILE",
                    help="a TOML file with any of these settings (keys: the long flag names) and "
                         "[[models]] tables; flags and variables beat it")
    ap.add_argument("--curve-keygen", metavar="DIR",
                    help="write a CURVE keypair for --worker-listen into DIR and exit")
    for o in OPTS:
        if o.flag is None:
            continue
        if o.kind == "bool":
            ap.add_argument(o.flag, dest=o.key, action="store_const", const=True, default=None,
                            help=o.help)
        elif o.kind in ("list", "keys"):
            ap.add_argument(o.flag, dest=o.key, action="append", metavar=o.metavar, help=o.help)
        else:
            ap.add_argument(o.flag, dest=o.key, metavar=o.metavar, help=o.help,
                            type={"int": int, "float": float}.get(o.kind, str))


def document(ap: argparse.ArgumentParser) -> None:
    """Add each flag's variables to its help, and the variables-only knobs to the epilog."""
    import textwrap

    for action in ap._actions:  # argparse keeps no public list of its actions
        names = env_names(action.dest)
        if names and "env:" not in (action.help or ""):
            action.help = (action.help + " " if action.help else "") + f"[env: {', '.join(names)}]"

    def para(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text, 78, initial_indent=indent, subsequent_indent=indent)

    lines = ["environment variables without a flag (the spec's engine knobs):"]
    for o in OPTS:
        if o.flag is None:
            lines.append(f"  {' / '.join(o.env)}")
            lines += para(o.help, "      ")
    lines.append(f"  {' / '.join(REFUSED_ENV)}")
    lines += para("refused at startup (a debug knob that copies the full logits every step)",
                  "      ")
    lines += [""] + para("precedence: flag > environment variable > --config file > default. "
                         "Spec names (QWEN35_*, BS_*, PN_*) are aliases of the PANTHEON_* ones.",
                         "")
    lines += para("SIGTERM/SIGINT: stop admitting (503), let requests finish up to "
                  "--drain-timeout, then exit 0; a second signal exits at once.", "")
    ap.epilog = "\n".join(lines)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter


def _is_set(env: Mapping[str, str], names: tuple[str, ...]) -> bool:
    return any((env.get(n) or "").strip() != "" for n in names)


def load_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:
        raise _config_error(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise _config_error(f"--config {path}: not valid TOML: {e}") from None


def merge_config_file(args: dict[str, Any], env: Mapping[str, str],
                      parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``args`` (flags given, None dropped) filled in from ``args['config']``'s file: a file value
    is used only where neither the flag nor any of its variables is set."""
    path = args.get("config")
    if not path:
        return args
    data = load_config_file(path)
    dests = {a.dest for a in parser._actions} - {"help", "config", "curve_keygen", "models"}
    out = dict(args)
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key == "models":
            if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
                raise _config_error(f"--config {path}: 'models' must be [[models]] tables")
            models = []
            for m in value:
                if not isinstance(m.get("path"), str):
                    raise _config_error(f"--config {path}: every [[models]] needs a path")
                extra = set(m) - {"path", "name", "dies"}
                if extra:
                    raise _config_error(f"--config {path}: [[models]] has unknown keys "
                                        f"{sorted(extra)} (path, name, dies)")
                dies = m.get("dies")
                if isinstance(dies, list):
                    dies = ",".join(str(d) for d in dies)
                models.append({k: v for k, v in (("path", m["path"]), ("name", m.get("name")),
                                                 ("dies", dies)) if v is not None})
            if not out.get("models"):
                out["models"] = models
            continue
        key = {"api_keys": "api_key", "models_dirs": "models_dir",
               "max_tokens": "max_tokens_limit"}.get(key, key)
        if key not in dests and key not in _BY_KEY:
            raise _config_error(f"--config {path}: unknown key {raw_key!r}")
        if out.get(key) is not None or _is_set(env, env_names(key)):
            continue
        if key in _BY_KEY and _BY_KEY[key].kind in ("list", "keys") and isinstance(value, str):
            value = [value]
        out[key] = value
    return out
