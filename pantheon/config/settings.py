"""The serve configuration: one typed, frozen object built once from flags and environment.

``build_config(args, env)`` is the only constructor the server uses. Flags beat environment
variables; ``PANTHEON_*`` names come first among the variables, then the original spec's names
(``QWEN35_BATCH_SLOTS``, ``BS_QUEUE_DEPTH``, ``QWEN35_BS_PREFILL_CHUNK``) as aliases with their
documented effect. Every value is checked here, once; a bad one is a ``ConfigError`` whose message
names the flag or variable to fix.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from pantheon.config.ops import OpsConfig, build_ops

DEFAULT_SLOTS = 8
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_QUEUE_TIMEOUT_S = 30.0
DEFAULT_PREFILL_CHUNK = 512  # a ceiling: the step budget takes fewer on a slow die
DEFAULT_ADMIT_CTX = 8192  # the spec's MR_ADMIT_CTX_GUESS: context a load is admitted for
DEFAULT_MAX_BODY = 8 << 20


class ConfigError(ValueError):
    """A flag or environment variable has a value the server cannot run with."""


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    name: str
    dies: tuple[str, ...] = ()  # empty: the server places it


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    models: tuple[ModelSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = DEFAULT_SLOTS  # per instance; 1 means single-user mode
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    cpu_dies: int = 0
    cpu_die_budget: int | None = None  # None: from the machine's RAM (dies.default_cpu_budget)
    kv_budget: int | None = None  # KV cache bytes per instance (None: admit_ctx tokens' worth)
    admit_ctx: int = DEFAULT_ADMIT_CTX  # context guess (tokens) a load is admitted and sized for
    die_reserve: int | None = None  # bytes kept free per die (None: 1 GiB on CUDA, 0 on CPU)
    pressure_thresholds: tuple[float, float, float] = (0.85, 0.92, 0.97)
    test_hooks: bool = False  # PANTHEON_TEST_HOOKS=1: the admin test seams (forced pressure)
    max_model_len: int | None = None
    dtype: str = "auto"
    max_body_bytes: int = DEFAULT_MAX_BODY
    hello_timeout_s: float = 60.0
    worker_threads: int | None = None  # torch threads per worker (None: the worker decides)
    heartbeat_s: float = 1.0
    log_level: str = "info"
    fingerprint: str = ""
    ops: OpsConfig = OpsConfig()  # auth, limits, logs, registration, shutdown, recovery

    @property
    def single_user(self) -> bool:
        return self.slots <= 1


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
          "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
          "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40}


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


def parse_dies(value: str, what: str = "--dies") -> tuple[str, ...]:
    """``"0,1"`` -> ``("cuda:0", "cuda:1")``; ``"cpu:0"`` stays; duplicates are refused."""
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        if part.isdigit():
            part = f"cuda:{int(part)}"
        elif not re.fullmatch(r"(cuda|cpu):\d+", part):
            raise ConfigError(f"{what}: {part!r} is not a die (use N, cuda:N or cpu:N)")
        if part in out:
            raise ConfigError(f"{what}: die {part} listed twice")
        out.append(part)
    if not out:
        raise ConfigError(f"{what}: empty die list")
    return tuple(out)


def _env_int(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            return name, int(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    return None


def _flag_or_env_int(args: Mapping, env: Mapping[str, str], key: str, names: tuple[str, ...]) -> int | None:
    """The flag's value if given, else the first set variable of ``names`` (flags beat env)."""
    value = args.get(key)
    if value is None:
        got = _env_int(env, names)
        value = got[1] if got else None
    return value


def _env_float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number") from None


def _slots_from_env(env: Mapping[str, str]) -> int | None:
    got = _env_int(env, ("PANTHEON_BATCH_SLOTS",))
    if got is not None:
        name, n = got
        if n < 0:
            raise ConfigError(f"{name}={n}: must be >= 0 (0 means single-user)")
        return max(n, 1)
    got = _env_int(env, ("QWEN35_BATCH_SLOTS",))
    if got is not None:  # the spec's switch: 1 turns on batched decode (8 slots), 0 is single-user
        name, n = got
        if n < 0:
            raise ConfigError(f"{name}={n}: must be 0 or 1")
        return DEFAULT_SLOTS if n else 1
    return None


def build_config(args: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> ServeConfig:
    """Merge flags (``args``: None means not given) over environment over defaults; validate."""
    args = {k: v for k, v in (args or {}).items() if v is not None}
    env = os.environ if env is None else env
    if env.get("QWEN35_GPU_FULL_LOGITS", "") != "":
        raise ConfigError(
            "QWEN35_GPU_FULL_LOGITS is set: this debug knob copies the full vocabulary's logits "
            "off the device every step and is refused at serve startup; unset it")
    kw: dict[str, Any] = {}

    slots = args.get("slots")
    if slots is None:
        slots = _slots_from_env(env)
    if slots is not None:
        if slots < 1:
            raise ConfigError(f"--slots {slots}: must be >= 1 (1 is single-user mode)")
        kw["slots"] = int(slots)

    q = _flag_or_env_int(args, env, "queue_depth", ("PANTHEON_QUEUE_DEPTH", "BS_QUEUE_DEPTH"))
    if q is not None:
        if q < 0:
            raise ConfigError(f"queue depth {q}: must be >= 0")
        kw["queue_depth"] = int(q)

    t = args.get("queue_timeout")
    if t is None:
        t = _env_float(env, "PANTHEON_QUEUE_TIMEOUT")
    if t is not None:
        if t <= 0:
            raise ConfigError(f"queue timeout {t}: must be > 0 seconds")
        kw["queue_timeout_s"] = float(t)

    chunk = _flag_or_env_int(args, env, "prefill_chunk", ("PANTHEON_PREFILL_CHUNK", "QWEN35_BS_PREFILL_CHUNK"))
    if chunk is not None:
        if chunk < 1:
            raise ConfigError(f"prefill chunk {chunk}: must be >= 1 token")
        kw["prefill_chunk"] = int(chunk)

    cpu_dies = _flag_or_env_int(args, env, "cpu_dies", ("PANTHEON_CPU_DIES",))
    if cpu_dies is not None:
        if not 0 <= cpu_dies <= 64:
            raise ConfigError(f"--cpu-dies {cpu_dies}: must be between 0 and 64")
        kw["cpu_dies"] = int(cpu_dies)

    for key, field_, flag, var in (
            ("cpu_die_budget", "cpu_die_budget", "--cpu-die-budget", "PANTHEON_CPU_DIE_BUDGET"),
            ("kv_budget", "kv_budget", "--kv-budget", "PANTHEON_KV_BUDGET"),
            ("die_reserve", "die_reserve", "--die-reserve", "PANTHEON_DIE_RESERVE"),
            ("max_body", "max_body_bytes", "--max-body", "PANTHEON_MAX_BODY")):
        raw = args.get(key)
        what = flag
        if raw is None and env.get(var):
            raw, what = env[var], var
        if raw is not None:
            zero = field_ == "die_reserve" and str(raw).strip() in ("0", "0B", "0b")
            kw[field_] = 0 if zero else parse_size(raw, what)  # a reserve may be nothing

    port = _flag_or_env_int(args, env, "port", ("PANTHEON_PORT",))
    if port is not None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"--port {port}: must be between 0 and 65535")
        kw["port"] = int(port)
    host = args.get("host") or env.get("PANTHEON_HOST")
    if host:
        kw["host"] = host

    mml = _flag_or_env_int(args, env, "max_model_len", ("PANTHEON_MAX_MODEL_LEN",))
    if mml is not None:
        if mml < 16:
            raise ConfigError(f"--max-model-len {mml}: must be >= 16")
        kw["max_model_len"] = int(mml)
    dtype = args.get("dtype") or env.get("PANTHEON_DTYPE")
    if dtype:
        if dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"--dtype {dtype}: use auto, bfloat16, float16 or float32")
        kw["dtype"] = dtype
    ht = args.get("hello_timeout")
    if ht is None:
        ht = _env_float(env, "PANTHEON_HELLO_TIMEOUT")
    if ht is not None:
        if ht <= 0:
            raise ConfigError(f"hello timeout {ht}: must be > 0 seconds")
        kw["hello_timeout_s"] = float(ht)
    wt = _flag_or_env_int(args, env, "worker_threads", ("PANTHEON_WORKER_THREADS",))
    if wt is not None:
        if wt < 1:
            raise ConfigError(f"worker threads {wt}: must be >= 1")
        kw["worker_threads"] = int(wt)
    level = args.get("log_level") or env.get("PANTHEON_LOG_LEVEL")
    if level:
        kw["log_level"] = level.lower()

    _capacity(args, env, kw)
    models = _models(args.get("models") or (), kw.get("cpu_dies", 0))
    if models:
        kw["models"] = models
    kw["ops"] = ops = build_ops(args, env)
    if not ops.prefill_batch and "prefill_chunk" not in kw:  # QWEN35_BS_PREFILL_BATCH=0
        kw["prefill_chunk"] = 1
    cfg = ServeConfig(**kw)
    key = repr((cfg.slots, cfg.prefill_chunk, cfg.dtype, [(m.path, m.name) for m in models]))
    fp = "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]
    return msgspec.structs.replace(cfg, fingerprint=fp)


def _capacity(args: Mapping[str, Any], env: Mapping[str, str], kw: dict[str, Any]) -> None:
    """The registry's knobs: admission context guess, pressure thresholds, test hooks."""
    ctx = _flag_or_env_int(args, env, "admit_ctx", ("PANTHEON_ADMIT_CTX",))
    if ctx is not None:
        if ctx < 16:
            raise ConfigError(f"admit context {ctx}: must be >= 16 tokens")
        kw["admit_ctx"] = int(ctx)
    raw, what = args.get("pressure_thresholds"), "--pressure-thresholds"
    if raw is None and env.get("PANTHEON_PRESSURE_THRESHOLDS"):
        raw, what = env["PANTHEON_PRESSURE_THRESHOLDS"], "PANTHEON_PRESSURE_THRESHOLDS"
    if raw is not None:
        from pantheon.control.pressure import parse_thresholds

        try:
            kw["pressure_thresholds"] = parse_thresholds(raw)
        except ValueError as e:
            raise ConfigError(f"{what} {e}") from None
    kw["test_hooks"] = env.get("PANTHEON_TEST_HOOKS", "").strip() in ("1", "true", "yes")


def _models(raw: Any, cpu_dies: int) -> tuple[ModelSpec, ...]:
    out: list[ModelSpec] = []
    for item in raw:
        if isinstance(item, ModelSpec):
            spec = item
        else:
            path = str(item["path"])
            name = item.get("name") or _default_name(path)
            dies = item.get("dies")
            spec = ModelSpec(path=path, name=name,
                             dies=parse_dies(dies) if isinstance(dies, str) else tuple(dies or ()))
        for die in spec.dies:
            if die.startswith("cpu:") and int(die[4:]) >= cpu_dies:
                raise ConfigError(
                    f"model {spec.name}: die {die} does not exist (--cpu-dies {cpu_dies})")
        out.append(spec)
    return tuple(out)


def _default_name(path: str) -> str:
    from pantheon.models.gguf import served_name  # a folder's name; a .gguf file's stem, lower-cased

    return served_name(path)
