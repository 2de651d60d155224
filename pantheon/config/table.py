"""The settings table: every setting of ``pantheon serve`` declared once.

A row (``Setting``) names the setting and gives its kind, default, unit, help, variables and
TOML key; everything else is derived from the rows:

- the command-line flags and ``--help`` (``pantheon.config.cli``),
- the variables read and the precedence between the sources (``pantheon.config.resolve``),
- the TOML file's keys (``pantheon.config.file``),
- the defaults of ``ServeConfig``, ``OpsConfig`` and ``Limits`` (``DEFAULTS``),
- the checks, each naming the source of a bad value (``Setting.check``).

Adding a setting is adding a row (and, for a new config field, the field on its struct, whose
default is read from here); ``tests/unit/test_settings_table.py`` checks every row end to end.

Why ~730 lines: it is the table, one row per setting (63 rows) and their checks, nothing
else; the formatter gives each row's fields lines of their own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pantheon.config.values import ConfigError, KeepAliveError, parse_keep_alive
from pantheon.core.engine_spec import PREFILL_CHUNK, SLOTS, STEP_TARGET_S

AUTO = "auto"  # a flag / TOML key derived from the row's name

# kinds: int | float | str | bool | switch (a variable on when 1/true/yes) | size (bytes, "2GiB")
# | size0 (a size that may be 0) | list (os.pathsep in a variable) | keys (comma in a variable)
# | thresholds (F,F,F) | model (--model/--name/--dies) | meta (flags that are not settings)


@dataclass(frozen=True)
class Setting:
    """One setting. ``flag``/``toml`` are ``AUTO`` (from ``name``), a name, or None (none).

    ``field`` is where the value goes: ``NAME`` on ``ServeConfig``, ``ops.NAME`` on
    ``OpsConfig``, ``limits.NAME`` on ``Limits``; None for rows that are not config fields.
    ``empty`` says what an empty string means: ``value`` (it is the value, and is checked),
    ``unset`` (the default, without looking at lower sources) or ``next`` (not given: the next
    source is looked at). ``env_value(name, value, what)`` adapts a variable's value (the spec's
    aliases with their own meaning); ``check(value, what)`` validates and normalises a value from
    any source and raises ``ConfigError`` naming ``what``.
    """

    name: str
    kind: str
    default: Any
    help: str
    env: tuple[str, ...] = ()
    flag: str | None = AUTO
    toml: str | None = AUTO
    toml_aliases: tuple[str, ...] = ()
    unit: str = ""
    metavar: str | None = None
    field: str | None = AUTO
    default_doc: str | None = None  # the help's words for a default that is not a plain value
    empty: str = "value"
    check: Callable[[Any, str], Any] | None = None
    env_value: Callable[[str, Any, str], Any] | None = None

    def __post_init__(self) -> None:
        if self.flag == AUTO:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))
        if self.toml == AUTO:
            object.__setattr__(self, "toml", self.name)
        if self.field == AUTO:
            object.__setattr__(self, "field", self.name)


# ---------------------------------------------------------------- checks


def _num(x: float) -> str:
    """A bound as the messages print it: 1000000, not 1e+06; 0.05 stays."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def at_least(lo: float, note: str = "") -> Callable[[Any, str], Any]:
    def check(v: Any, what: str) -> Any:
        if v < lo:
            raise ConfigError(f"{what} {v}: must be >= {_num(lo)}{note}")
        return v

    return check


def between(lo: float, hi: float, note: str = "", sep: str = " ") -> Callable[[Any, str], Any]:
    def check(v: Any, what: str) -> Any:
        if not lo <= v <= hi:
            raise ConfigError(f"{what}{sep}{v}: must be between {_num(lo)} and {_num(hi)}{note}")
        return v

    return check


def above(lo: float, note: str) -> Callable[[Any, str], Any]:
    def check(v: Any, what: str) -> Any:
        if v <= lo:
            raise ConfigError(f"{what} {v}: must be > {_num(lo)}{note}")
        return v

    return check


def only(value: Any, why: str) -> Callable[[Any, str], Any]:
    """A knob of the spec that this server accepts with one value only: any other is refused at
    start, saying why (rather than parsed and silently ignored)."""

    def check(v: Any, what: str) -> Any:
        if v != value:
            raise ConfigError(f"{what} {v}: {why}")
        return v

    return check


def one_of(*choices: str, quote: bool = True) -> Callable[[Any, str], Any]:
    words = ", ".join(choices[:-1]) + f" or {choices[-1]}" if len(choices) > 1 else "".join(choices)

    def check(v: Any, what: str) -> Any:
        if v not in choices:
            raise ConfigError(f"{what} {repr(v) if quote else v}: use {words}")
        return v

    return check


def _slots_env(name: str, n: int, what: str) -> int:
    if name == "QWEN35_BATCH_SLOTS":  # the spec's switch: 1 turns on batched decode (8 slots)
        if n < 0:
            raise ConfigError(f"{name}={n}: must be 0 or 1")
        return DEFAULTS["slots"] if n else 1
    if n < 0:
        raise ConfigError(f"{name}={n}: must be >= 0 (0 means single-user)")
    return max(n, 1)


def _unique(v: tuple[str, ...], what: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v))


def _folders(v: tuple[str, ...], what: str) -> tuple[str, ...]:
    roots = []
    for d in v:
        if not os.path.isdir(d):
            raise ConfigError(f"{what}: {d!r} is not a folder")
        roots.append(os.path.realpath(d))  # links resolved: the admin API compares real paths
    return tuple(dict.fromkeys(roots))


def _duration(v: Any, what: str) -> float:
    """A keep-alive: seconds, or a duration such as "5m" (Ollama's format); negative: forever."""
    try:
        seconds = parse_keep_alive(v)
    except KeepAliveError as e:
        raise ConfigError(f"{what} {v!r}: {e}") from None
    assert seconds is not None
    return seconds


def _origins(v: tuple[str, ...], what: str) -> tuple[str, ...]:
    out = []
    for item in v:
        for o in str(item).split(","):
            o = o.strip().rstrip("/")
            if not o:
                continue
            if o != "*" and (
                not o.startswith(("http://", "https://"))
                or not o.split("://", 1)[1]
                or "/" in o.split("://", 1)[1]
            ):
                raise ConfigError(f"{what}: {o!r} is not '*' or an origin such as https://host:port")
            out.append(o.lower())
    return tuple(dict.fromkeys(out))


def _http_url(v: str, what: str) -> str:
    if not v.startswith(("http://", "https://")):
        raise ConfigError(f"{what} {v!r}: must be an http:// or https:// URL")
    return v.rstrip("/")


def _cpu_path(v: str, what: str) -> str:
    from pantheon.core.sizing import CPU_PATHS  # torch-free; lazy: only when the flag is used

    if v != "auto" and v not in CPU_PATHS:
        raise ConfigError(f"{what} {v!r}: use auto or one of {', '.join(CPU_PATHS)}")
    return v


TOOL_AUTO = (
    "lazy",
    "decide",
)  # tool_choice "auto" on a template that takes no tools (pantheon.chat.answer_form)


def _tool_auto(v: str, what: str) -> str:
    if v not in TOOL_AUTO:
        raise ConfigError(f"{what} {v!r}: use one of {', '.join(TOOL_AUTO)}")
    return v


def _kv_type(v: str, what: str) -> str:
    from pantheon.core.kv_types import KV_TYPES  # torch-free

    v = v.strip().lower()
    if v not in KV_TYPES:
        raise ConfigError(f"{what} {v!r}: use {', '.join(KV_TYPES[:-1])} or {KV_TYPES[-1]}")
    return v


# Ollama's KV cache variable: its f16 is the full-width cache (our auto); q8_0 and q4_0 are ours
OLLAMA_KV_TYPES = {"f16": "auto", "q8_0": "q8_0", "q4_0": "q4_0"}


def _kv_type_env(name: str, v: str, what: str) -> str:
    if name != "OLLAMA_KV_CACHE_TYPE":
        return v
    got = OLLAMA_KV_TYPES.get(v.strip().lower())
    if got is None:
        raise ConfigError(f"{what} {v!r}: use f16 (the full-width cache, auto), q8_0 or q4_0")
    return got


def _lower(v: str, what: str) -> str:
    return v.lower()


def _seconds(lo: float) -> Callable[[Any, str], Any]:
    return at_least(lo, " seconds")


# ---------------------------------------------------------------- the table

SETTINGS: tuple[Setting, ...] = (
    # the models to load at start; the file has [[models]] tables instead
    Setting(
        "model",
        "model",
        None,
        "a model folder or .gguf file (repeatable)",
        toml=None,
        field=None,
        metavar="PATH",
    ),
    Setting(
        "name",
        "model",
        None,
        "the served name of the preceding --model",
        toml=None,
        field=None,
        metavar="NAME",
        default_doc="its folder name",
    ),
    Setting(
        "dies",
        "model",
        None,
        "dies for the preceding --model: 0,1 (cuda) or cpu:0",
        toml=None,
        field=None,
        metavar="LIST",
        default_doc="placed by the server",
    ),
    # the server
    Setting("host", "str", "127.0.0.1", "bind address", ("PANTHEON_HOST",), empty="next"),
    Setting("port", "int", 8000, "port; 0 picks one", ("PANTHEON_PORT",), check=between(0, 65535)),
    Setting(
        "slots",
        "int",
        SLOTS,
        "batch slots per model; 1 is single-user mode",
        ("PANTHEON_BATCH_SLOTS", "QWEN35_BATCH_SLOTS"),
        check=at_least(1, " (1 is single-user mode)"),
        env_value=_slots_env,
    ),
    Setting(
        "queue_depth",
        "int",
        32,
        "requests that may wait for a slot",
        ("PANTHEON_QUEUE_DEPTH", "BS_QUEUE_DEPTH"),
        check=at_least(0),
    ),
    Setting(
        "queue_timeout",
        "float",
        30.0,
        "seconds a request waits for a slot",
        ("PANTHEON_QUEUE_TIMEOUT",),
        unit="s",
        field="queue_timeout_s",
        check=above(0, " seconds"),
    ),
    # a ceiling: the step budget takes fewer on a slow die
    Setting(
        "prefill_chunk",
        "int",
        PREFILL_CHUNK,
        "most prompt tokens one step prefills; steps take fewer where they would outgrow --step-target",
        ("PANTHEON_PREFILL_CHUNK", "QWEN35_BS_PREFILL_CHUNK"),
        unit="tokens",
        check=at_least(1, " token"),
    ),
    Setting("cpu_dies", "int", 0, "virtual CPU dies to create", ("PANTHEON_CPU_DIES",), check=between(0, 64)),
    Setting(
        "cpu_die_budget",
        "size",
        None,
        'memory budget of each CPU die (bytes or "2GiB")',
        ("PANTHEON_CPU_DIE_BUDGET",),
        metavar="BYTES",
        default_doc="the machine's RAM less an eighth (at least 2 GiB), shared by the CPU dies",
    ),
    Setting(
        "kv_budget",
        "size",
        None,
        "KV cache bytes per loaded model, fixed",
        ("PANTHEON_KV_BUDGET",),
        metavar="BYTES",
        default_doc="sized from the die's free memory (--kv-fraction), between --admit-ctx "
        "tokens and the model's full context",
    ),
    Setting(
        "state_checkpoints",
        "int",
        None,
        "recurrent-state checkpoints a hybrid model's prefix cache keeps (Qwen3.5; 0: no prefix "
        "cache for such models)",
        ("PANTHEON_STATE_CHECKPOINTS",),
        check=at_least(0),
        default_doc="two per slot",
    ),
    Setting(
        "kv_fraction",
        "float",
        0.9,
        "share of a die's free memory (after the model's weights) one load's KV cache may take "
        "when the model's full context needs that much",
        ("PANTHEON_KV_FRACTION",),
        metavar="F",
        check=between(0.05, 1.0),
    ),
    # the spec's MR_ADMIT_CTX_GUESS
    Setting(
        "admit_ctx",
        "int",
        8192,
        "the least context (tokens of KV cache) a load is admitted with: a die that cannot "
        "hold that much refuses the load (507); with room, a load gets its full context",
        ("PANTHEON_ADMIT_CTX",),
        unit="tokens",
        metavar="TOKENS",
        check=at_least(16, " tokens"),
    ),
    Setting(
        "die_reserve",
        "size0",
        None,
        "memory kept free on each die",
        ("PANTHEON_DIE_RESERVE",),
        metavar="BYTES",
        default_doc="1GiB on CUDA dies, 0 on CPU",
    ),
    Setting(
        "pressure_thresholds",
        "thresholds",
        (0.85, 0.92, 0.97),
        "fractions of memory in use for pressure levels 1, 2, 3",
        ("PANTHEON_PRESSURE_THRESHOLDS",),
        metavar="F,F,F",
    ),
    Setting(
        "max_model_len",
        "int",
        None,
        "longest context (tokens) a model is served with",
        ("PANTHEON_MAX_MODEL_LEN",),
        default_doc="the model's own",
        check=at_least(16),
    ),
    Setting(
        "dtype",
        "str",
        "auto",
        "weights' dtype: auto | bfloat16 | float16 | float32",
        ("PANTHEON_DTYPE",),
        empty="next",
        check=one_of("auto", "bfloat16", "float16", "float32", quote=False),
    ),
    Setting(
        "max_body",
        "size",
        8 << 20,
        "largest request body accepted",
        ("PANTHEON_MAX_BODY",),
        metavar="BYTES",
        field="max_body_bytes",
    ),
    Setting(
        "max_body_in_flight",
        "size",
        None,
        "request-body bytes the router holds at once, all requests together; past it a request "
        "gets 503 bodies_in_flight before its body is read (one body alone always passes)",
        ("PANTHEON_MAX_BODY_IN_FLIGHT",),
        metavar="BYTES",
        field="max_body_in_flight_bytes",
        default_doc="4 x --max-body",
        check=at_least(1),
    ),
    Setting(
        "hello_timeout",
        "float",
        60.0,
        "seconds a worker may take to say Hello",
        ("PANTHEON_HELLO_TIMEOUT",),
        unit="s",
        field="hello_timeout_s",
        check=above(0, " seconds"),
    ),
    Setting(
        "worker_threads",
        "int",
        None,
        "torch threads in each worker",
        ("PANTHEON_WORKER_THREADS",),
        default_doc="the worker decides",
        check=at_least(1),
    ),
    Setting(
        "log_level",
        "str",
        "info",
        "log level: debug, info, warning or error",
        ("PANTHEON_LOG_LEVEL",),
        empty="next",
        check=_lower,
    ),
    Setting(
        "test_hooks",
        "switch",
        False,
        "1: the admin test seams (forced pressure levels) are on",
        ("PANTHEON_TEST_HOOKS",),
        flag=None,
        toml=None,
    ),
    # flags that are not settings
    Setting(
        "config",
        "meta",
        None,
        "a TOML file with any of these settings (keys: the long flag "
        "names) and [[models]] tables; flags and variables beat it",
        toml=None,
        field=None,
        metavar="FILE",
    ),
    Setting(
        "curve_keygen",
        "meta",
        None,
        "write CURVE keypairs into DIR and exit (as 'pantheon keys new DIR'); they are for "
        "workers on other hosts (--worker-listen)",
        toml=None,
        field=None,
        metavar="DIR",
    ),
    # security, limits, logs, registration, shutdown, recovery
    Setting(
        "api_key",
        "keys",
        (),
        "an API key that /v1/* accepts as 'Authorization: Bearer KEY' "
        "(repeatable; the variable takes several, comma-separated). Unset: /v1/* is open",
        ("PANTHEON_API_KEY",),
        metavar="KEY",
        toml_aliases=("api_keys",),
        field="ops.api_keys",
        check=_unique,
    ),
    Setting(
        "admin_key",
        "str",
        None,
        "the key /admin/* requires. Unset: the admin API answers only on loopback",
        ("PANTHEON_ADMIN_KEY",),
        metavar="KEY",
        field="ops.admin_key",
        empty="unset",
    ),
    Setting(
        "cors_origins",
        "keys",
        ("*",),
        "the browser origins (scheme://host[:port]) the OpenAI routes answer with CORS headers; "
        "'*' is any origin. The admin API sends no CORS headers and refuses every other origin "
        "than its own, unless listed here by name ('*' does not count). Comma-separated or "
        "repeatable",
        ("PANTHEON_CORS_ORIGINS",),
        metavar="ORIGINS",
        default_doc="* (any origin)",
        check=_origins,
    ),
    Setting(
        "models_dir",
        "list",
        (),
        "the model catalog's folders: every model in them (a folder with a config.json, a .gguf "
        "file, a folder holding one; and one level further down) is served on first request; "
        "admin loads may only name folders under these roots, "
        "links resolved (repeatable; the variable is ':'-separated). Unset: any folder",
        ("PANTHEON_MODELS_DIR",),
        metavar="DIR",
        toml_aliases=("models_dirs",),
        field="ops.models_dirs",
        check=_folders,
    ),
    Setting(
        "keep_alive",
        "str",
        300.0,
        "how long a model loaded on demand stays loaded when idle: seconds or a duration "
        "('5m', '1h'); negative: forever, 0: unload once idle (a request's keep_alive overrides it)",
        ("PANTHEON_KEEP_ALIVE",),
        metavar="DURATION",
        default_doc="5m",
        check=_duration,
        field="keep_alive_s",
    ),
    Setting(
        "load_timeout",
        "float",
        300.0,
        "seconds a request waits for its model to load (its turn for room, its worker, its "
        "weights); past it a 503 with Retry-After, and the load goes on",
        ("PANTHEON_LOAD_TIMEOUT",),
        unit="s",
        field="load_timeout_s",
        check=above(0, " seconds"),
    ),
    Setting(
        "models_max",
        "int",
        0,
        "at most this many model instances loaded at once; a load beyond it unloads the least "
        "recently used idle one (0: no count limit, memory alone decides)",
        ("PANTHEON_MODELS_MAX",),
        metavar="N",
        check=at_least(0),
    ),
    Setting(
        "speculative",
        "int",
        0,
        "speculative decoding by default: draft tokens per step, copied from the request's own "
        "context (prompt lookup) or, for a model loaded with a draft model (draft = PATH, or "
        'draft = "mtp": its own multi-token-prediction head), proposed by it; verified in one pass (exact: greedy output is unchanged); 0: off. A '
        "request's 'speculative' extension overrides it",
        ("PANTHEON_SPECULATIVE",),
        metavar="N",
        check=between(0, 16),
    ),
    Setting(
        "max_messages",
        "int",
        1024,
        "most messages in one chat request",
        ("PANTHEON_MAX_MESSAGES",),
        metavar="N",
        field="limits.max_messages",
        check=at_least(1),
    ),
    Setting(
        "max_n",
        "int",
        16,
        "largest 'n' (choices per request)",
        ("PANTHEON_MAX_N",),
        metavar="N",
        field="limits.max_n",
        check=between(1, 128),
    ),
    Setting(
        "max_tokens_limit",
        "int",
        None,
        "largest 'max_tokens' a request may ask for",
        ("PANTHEON_MAX_TOKENS",),
        metavar="N",
        toml_aliases=("max_tokens",),
        field="limits.max_tokens",
        default_doc="the model's context",
        check=at_least(1),
    ),
    # at most 4: the OpenAI API's own ceiling
    Setting(
        "max_stop",
        "int",
        4,
        "most stop strings per request (at most 4)",
        ("PANTHEON_MAX_STOP",),
        metavar="N",
        field="limits.max_stop",
        check=between(0, 4),
    ),
    Setting(
        "max_stop_len",
        "int",
        256,
        "longest stop string",
        ("PANTHEON_MAX_STOP_LEN",),
        unit="characters",
        metavar="N",
        field="limits.max_stop_len",
        check=at_least(1),
    ),
    Setting(
        "log_format",
        "str",
        "text",
        "text or json: one JSON object per log line",
        ("PANTHEON_LOG_FORMAT",),
        metavar="FMT",
        field="ops.log_format",
        check=one_of("text", "json"),
    ),
    Setting(
        "drain_timeout",
        "float",
        30.0,
        "on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they are ended",
        ("PANTHEON_DRAIN_TIMEOUT",),
        unit="s",
        metavar="S",
        field="ops.drain_timeout_s",
        check=_seconds(0.0),
    ),
    Setting(
        "registry_url",
        "str",
        None,
        "register with this router registry (POST URL/register, "
        "/heartbeat, /deregister). Unset: nothing is sent",
        ("PANTHEON_REGISTRY_URL",),
        metavar="URL",
        field="ops.registry_url",
        empty="unset",
        check=_http_url,
    ),
    Setting(
        "registry_heartbeat",
        "float",
        5.0,
        "seconds between registry heartbeats",
        ("PANTHEON_REGISTRY_HEARTBEAT",),
        unit="s",
        metavar="S",
        field="ops.registry_heartbeat_s",
        check=_seconds(0.05),
    ),
    Setting(
        "node_id",
        "str",
        "node0",
        "node identifier sent on registration",
        ("PANTHEON_NODE_ID",),
        metavar="ID",
        field="ops.node_id",
        empty="unset",
    ),
    Setting(
        "registry_transport",
        "str",
        "local",
        "transport hint sent on registration",
        ("PANTHEON_REGISTRY_TRANSPORT",),
        metavar="NAME",
        field="ops.registry_transport",
        empty="unset",
    ),
    Setting(
        "advertise_host",
        "str",
        None,
        "host name put in the registered endpoint",
        ("PANTHEON_ADVERTISE_HOST",),
        metavar="HOST",
        field="ops.advertise_host",
        default_doc="the bind address",
        empty="unset",
    ),
    Setting(
        "worker_restarts",
        "int",
        10,
        "times a dead worker is restarted (its models "
        "reloaded) before its die stays failed; 0 never restarts",
        ("PANTHEON_WORKER_RESTARTS",),
        metavar="N",
        field="ops.worker_restarts",
        check=at_least(0),
    ),
    Setting(
        "restart_backoff",
        "float",
        0.5,
        "seconds before the first restart of a dead worker; doubles each time, at most 30",
        ("PANTHEON_RESTART_BACKOFF",),
        unit="s",
        metavar="S",
        field="ops.restart_backoff_s",
        check=_seconds(0.0),
    ),
    # a worker turn (a step) running longer is a hung worker
    Setting(
        "step_timeout",
        "float",
        300.0,
        "seconds one worker step may run before the worker "
        "counts as hung and is restarted; its heartbeat thread reports progress meanwhile",
        ("PANTHEON_STEP_TIMEOUT",),
        unit="s",
        metavar="S",
        field="ops.step_timeout_s",
        check=_seconds(1.0),
    ),
    Setting(
        "step_target",
        "float",
        STEP_TARGET_S,
        "seconds one engine step should take: each step "
        "prefills as many prompt tokens as fit, measured as it runs, so streams keep flowing "
        "past long prompts",
        ("PANTHEON_STEP_TARGET",),
        unit="s",
        metavar="S",
        field="ops.step_target_s",
        check=_seconds(0.01),
    ),
    Setting(
        "worker_listen",
        "str",
        None,
        "also take workers on other hosts, on tcp://HOST:PORT "
        "('pantheon worker --router tcp://ROUTER:PORT --die cuda:0 --curve-dir DIR' joins as "
        "cuda:0@NAME); needs --curve-dir, or --worker-insecure on loopback; local workers need no flag",
        ("PANTHEON_WORKER_LISTEN",),
        metavar="URL",
        field="ops.worker_listen",
        empty="unset",
    ),
    Setting(
        "curve_dir",
        "str",
        None,
        "folder with the router's CURVE keypair (server.key, "
        "server.key_secret) and authorized/ (the public keys of the workers it accepts) for "
        "--worker-listen; 'pantheon keys new DIR' writes one",
        ("PANTHEON_CURVE_DIR",),
        metavar="DIR",
        field="ops.curve_dir",
        empty="unset",
    ),
    Setting(
        "worker_insecure",
        "bool",
        False,
        "--worker-listen on plain TCP, without CURVE: "
        "refused unless its address is loopback (tests, one host)",
        ("PANTHEON_WORKER_INSECURE",),
        field="ops.worker_insecure",
    ),
    Setting(
        "worker_dead_after",
        "float",
        30.0,
        "seconds without a word from a worker (its heartbeat "
        "included) before it counts as dead: a frozen process, or a remote host or link that is gone",
        ("PANTHEON_WORKER_DEAD_AFTER",),
        unit="s",
        metavar="S",
        field="ops.worker_dead_after_s",
        check=_seconds(1.0),
    ),
    # the spec's engine knobs
    Setting(
        "driver_sample",
        "bool",
        True,
        "1: sampling runs inside the worker, the only way "
        "this server samples; 0 (the spec's owner-side lockstep sampling) is not built and "
        "is refused",
        ("PANTHEON_DRIVER_SAMPLE", "QWEN35_BS_DRIVER_SAMPLE"),
        flag=None,
        field="ops.driver_sample",
        check=only(
            True,
            "owner-side lockstep sampling is not built: this server always "
            "samples inside the worker (unset it, or set 1)",
        ),
    ),
    Setting(
        "prefill_batch",
        "bool",
        True,
        "0 disables batched chunk prefill: prompts are prefilled token by token (chunk 1)",
        ("PANTHEON_PREFILL_BATCH", "QWEN35_BS_PREFILL_BATCH"),
        flag=None,
        field="ops.prefill_batch",
    ),
    Setting(
        "step_stats",
        "bool",
        False,
        "workers log every engine step's timing to stderr",
        ("PANTHEON_STEP_STATS", "QWEN35_BS_STATS"),
        field="ops.step_stats",
    ),
    # tool_choice "auto" where the chat template takes no tools (pantheon/chat/answer_form.py)
    Setting(
        "tool_auto",
        "str",
        "lazy",
        'tool_choice "auto" on a model whose chat template takes no tools: lazy (the model '
        "answers in prose, or opens a JSON call that the grammar then holds to the tools, as "
        "llama.cpp's lazy tool grammars) or decide (every answer is a JSON call or reply: a small "
        "model that is not trained on tools then calls them, and sometimes where none is needed)",
        ("PANTHEON_TOOL_AUTO",),
        metavar="MODE",
        field="ops.tool_auto",
        check=_tool_auto,
    ),
    # the KV cache's element types (pantheon/core/kv_types.py: llama.cpp's names and layouts)
    Setting(
        "kv_cache_dtype",
        "str",
        "auto",
        "the KV cache's type, K and V: auto (the compute dtype), q8_0 (~1.9x the tokens of "
        "bf16 in the same bytes), q4_0 (~3.6x) or fp8_e4m3 (CUDA dies only); a [[models]] "
        "table or an admin load's kv_cache_dtype beats it for that model; Ollama's "
        "OLLAMA_KV_CACHE_TYPE is read too (f16, q8_0 or q4_0; its f16 is auto)",
        ("PANTHEON_KV_CACHE_DTYPE", "OLLAMA_KV_CACHE_TYPE"),
        metavar="TYPE",
        empty="next",
        check=_kv_type,
        env_value=_kv_type_env,
    ),
    Setting(
        "kv_cache_dtype_k",
        "str",
        None,
        "the K cache's type alone (K is the more sensitive of the two)",
        ("PANTHEON_KV_CACHE_DTYPE_K",),
        metavar="TYPE",
        default_doc="--kv-cache-dtype",
        empty="unset",
        check=_kv_type,
    ),
    Setting(
        "kv_cache_dtype_v",
        "str",
        None,
        "the V cache's type alone",
        ("PANTHEON_KV_CACHE_DTYPE_V",),
        metavar="TYPE",
        default_doc="--kv-cache-dtype",
        empty="unset",
        check=_kv_type,
    ),
    # the spec's switch: 1 is --kv-cache-dtype q4_0, 0 is auto; a --kv-cache-dtype given beats it
    Setting(
        "kv_q4",
        "bool",
        False,
        "1: the Q4 KV cache, q4_0 for K and V (as --kv-cache-dtype q4_0, which beats it when "
        "given); 0: auto (full width)",
        ("PANTHEON_KV_Q4", "QWEN35_KV_Q4"),
        flag=None,
        field="ops.kv_q4",
    ),
    # CPU dies' linear-layer path (workers/cpu_paths.py)
    Setting(
        "cpu_path",
        "str",
        "auto",
        "how CPU dies run the linear layers: auto (the fastest of "
        "those that work on this CPU, timed on each model's shapes at load) or one of "
        "bf16-packed, bf16, fp32-packed, fp32, int8 (what quantize=true loads use), int4 (a "
        "4-bit file's groups as they are); a forced path that fails on this CPU fails loads",
        ("PANTHEON_CPU_PATH",),
        metavar="PATH",
        field="ops.cpu_path",
        check=_cpu_path,
    ),
    # torch.compile the decode step, in the background after the load (workers/compiled.py)
    Setting(
        "compile",
        "bool",
        True,
        "compile each model's decode step with torch.compile "
        "(inductor; where a C++ compiler is found) in the background while the model serves "
        "eager, and switch to it once checked against the eager step: ~20-45% faster decode "
        "on CPU; the first load of a model compiles for ~1-2 min on 2 cores (at the lowest "
        "priority), later loads take it from the compile cache; 0 turns it off",
        ("PANTHEON_COMPILE",),
        field="ops.compile",
    ),
    Setting(
        "compile_cache_dir",
        "str",
        None,
        "folder of the compiled decode steps kept between loads (one folder per model, CPU "
        "path, KV layout, torch version and ISA)",
        ("PANTHEON_COMPILE_CACHE_DIR",),
        metavar="DIR",
        field="ops.compile_cache_dir",
        default_doc="~/.cache/pantheon/compile",
        empty="unset",
    ),
    Setting(
        "compile_cache_max_mb",
        "int",
        1024,
        "the compile cache's bound in MB: the least recently used models' entries go first; 0 keeps none",
        ("PANTHEON_COMPILE_CACHE_MAX_MB",),
        metavar="MB",
        field="ops.compile_cache_max_mb",
        check=at_least(0),
    ),
    Setting(
        "async_poll_us",
        "int",
        None,
        "longest sleep, in microseconds, of a worker's loop "
        "between polls while it waits on a load (at least 1000: zmq polls in milliseconds)",
        ("PANTHEON_ASYNC_POLL_US", "PN_ASYNC_POLL_US"),
        flag=None,
        unit="µs",
        field="ops.async_poll_us",
        default_doc="50000, the worker's own 50 ms",
        check=between(1, 1_000_000, " µs", sep="="),
    ),
)

# Variables refused at startup: a debug knob that copies the full logits every step.
REFUSED_ENV = ("PANTHEON_GPU_FULL_LOGITS", "QWEN35_GPU_FULL_LOGITS")

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}


def field_default(field: str) -> Any:
    """The table's default for a config field (``"port"``, ``"ops.node_id"``, ...)."""
    for s in SETTINGS:
        if s.field == field:
            return s.default
    raise KeyError(field)


def env_names(name: str) -> tuple[str, ...]:
    """The variables that set ``name`` (a row's name / argparse dest), PANTHEON_* first."""
    row = BY_NAME.get(name)
    return row.env if row else ()


def toml_keys() -> dict[str, Setting]:
    """Every key the TOML file accepts (snake_case; the file may also spell them kebab-case)."""
    out: dict[str, Setting] = {}
    for s in SETTINGS:
        if s.toml is not None:
            out[s.toml] = s
            out.update((alias, s) for alias in s.toml_aliases)
    return out
