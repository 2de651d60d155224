"""The serve configuration: one typed, frozen object built once from flags, environment and
the TOML config file.

``build_config(args, env)`` is the only constructor the server uses. Every setting is a row of
the table in ``pantheon.config.table`` (its flag, variables, TOML key, default, help, check);
``pantheon.config.resolve`` applies the precedence (flag > variable > config file > default;
``PANTHEON_*`` names first among the variables, then the original spec's names
``QWEN35_BATCH_SLOTS``, ``BS_QUEUE_DEPTH``, ``QWEN35_BS_PREFILL_CHUNK``, ... as aliases with their
documented effect). Every value is checked once; a bad one is a ``ConfigError`` whose message
names the flag, variable or file key to fix.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from pantheon.config.ops import OpsConfig, build_ops
from pantheon.config.resolve import refuse_env, resolve
from pantheon.config.table import SETTINGS
from pantheon.config.table import field_default as _d
from pantheon.config.values import ConfigError, parse_dies, parse_kv_types, parse_size
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.names import control_problem, escaped
from pantheon.models import generation_defaults

__all__ = ["ConfigError", "ModelSpec", "ServeConfig", "build_config", "parse_dies", "parse_size"]


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A configured model (``--model``, or a ``[[models]]`` table): its folder or file, served
    name, dies (empty: placed), and what the catalog keeps of it (``pantheon.control.catalog``):
    loaded at start unless ``preload`` is false, its aliases, idle keep-alive (None: forever
    for a preloaded one), pin, generation defaults and the admin load's options."""

    path: str
    name: str
    dies: tuple[str, ...] = ()  # empty: the server places it
    aliases: tuple[str, ...] = ()
    preload: bool = True
    keep_alive: float | None = None
    pin: bool = False
    params: dict[str, float | int] = {}
    quantize: bool = False
    slots: int | None = None
    max_context: int | None = None
    embeddings: bool = False  # serve /v1/embeddings from it (mean pooling) when it is no embedding model
    # its KV cache's types ("q8_0", or "q8_0/q4_0" for K/V apart); None: the server's
    kv_cache_dtype: KvCacheTypes | None = None
    draft: str | None = None  # a draft model's path for speculative decoding (workers/draft.py)


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``pantheon serve`` runs with; the defaults are the settings table's."""

    models: tuple[ModelSpec, ...] = ()
    host: str = _d("host")
    port: int = _d("port")
    slots: int = _d("slots")  # per instance; 1 means single-user mode
    queue_depth: int = _d("queue_depth")
    queue_timeout_s: float = _d("queue_timeout_s")
    prefill_chunk: int = _d("prefill_chunk")  # a ceiling: the step budget takes fewer
    cpu_dies: int = _d("cpu_dies")
    cpu_die_budget: int | None = _d("cpu_die_budget")  # None: dies.default_cpu_budget
    kv_budget: int | None = _d("kv_budget")  # KV bytes per instance (None: sized from the die)
    state_checkpoints: int | None = _d("state_checkpoints")  # None: two per slot
    kv_fraction: float = _d("kv_fraction")  # of a die's free memory one KV pool may take
    admit_ctx: int = _d("admit_ctx")  # the least context (tokens) a load is admitted with
    die_reserve: int | None = _d("die_reserve")  # bytes kept free (None: 1 GiB CUDA, 0 CPU)
    pressure_thresholds: tuple[float, float, float] = _d("pressure_thresholds")
    test_hooks: bool = _d("test_hooks")  # the admin test seams (forced pressure)
    max_model_len: int | None = _d("max_model_len")
    dtype: str = _d("dtype")
    kv_cache_dtype: str = _d("kv_cache_dtype")  # K and V (QWEN35_KV_Q4=1 is q4_0)
    kv_cache_dtype_k: str | None = _d("kv_cache_dtype_k")  # None: kv_cache_dtype
    kv_cache_dtype_v: str | None = _d("kv_cache_dtype_v")
    max_body_bytes: int = _d("max_body_bytes")
    max_body_in_flight_bytes: int | None = _d("max_body_in_flight_bytes")  # None: 4 x max_body_bytes
    hello_timeout_s: float = _d("hello_timeout_s")
    worker_threads: int | None = _d("worker_threads")  # torch threads (None: worker decides)
    heartbeat_s: float = 1.0  # not a setting: the workers' heartbeat interval
    log_level: str = _d("log_level")
    cors_origins: tuple[str, ...] = _d("cors_origins")  # the OpenAI routes' CORS origins
    keep_alive_s: float = _d("keep_alive_s")  # idle seconds before an on-demand model unloads
    load_timeout_s: float = _d("load_timeout_s")  # how long a request waits for its model's load
    models_max: int = _d("models_max")  # loaded instances at most (0: memory alone decides)
    speculative: int = _d("speculative")  # prompt-lookup drafts per step by default (0: off)
    fingerprint: str = ""  # computed by build_config
    ops: OpsConfig = OpsConfig()  # auth, limits, logs, registration, shutdown, recovery

    @property
    def body_in_flight_limit(self) -> int:
        """The router-wide bound on request-body bytes held at once (``--max-body-in-flight``)."""
        return self.max_body_in_flight_bytes or 4 * self.max_body_bytes

    @property
    def single_user(self) -> bool:
        return self.slots <= 1

    @property
    def kv_types(self) -> KvCacheTypes:
        """The KV cache types a load gets unless its model says otherwise."""
        return KvCacheTypes(
            self.kv_cache_dtype_k or self.kv_cache_dtype, self.kv_cache_dtype_v or self.kv_cache_dtype
        )


def build_config(args: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> ServeConfig:
    """Merge flags (``args``: argparse dests, None means not given; ``merge_config_file``
    adds the config file's values) over environment (``env``, default ``os.environ``) over
    config file over defaults; validate. Raises ``ConfigError`` naming the bad value's source."""
    args = {k: v for k, v in (args or {}).items() if v is not None}
    env = os.environ if env is None else env
    refuse_env(env)
    got = resolve(args, env)
    kw: dict[str, Any] = {
        row.field: got.values[row.name] for row in SETTINGS if row.field and "." not in row.field
    }
    ops = build_ops(got.values)
    if not ops.prefill_batch and "prefill_chunk" not in got.sources:  # QWEN35_BS_PREFILL_BATCH=0
        kw["prefill_chunk"] = 1
    if "kv_q4" in got.sources and "kv_cache_dtype" not in got.sources:  # the spec's QWEN35_KV_Q4
        kw["kv_cache_dtype"] = "q4_0" if ops.kv_q4 else "auto"
    models = _models(args.get("models") or (), kw["cpu_dies"])
    cfg = ServeConfig(models=models, ops=ops, **kw)
    key = repr((cfg.slots, cfg.prefill_chunk, cfg.dtype, [(m.path, m.name) for m in models]))
    if cfg.kv_types.quantized or any(m.kv_cache_dtype for m in models):  # outputs differ
        key += repr((str(cfg.kv_types), [str(m.kv_cache_dtype) for m in models]))
    fp = "fp_" + hashlib.sha256(key.encode()).hexdigest()[:10]
    return msgspec.structs.replace(cfg, fingerprint=fp)


def _models(raw: Any, cpu_dies: int) -> tuple[ModelSpec, ...]:
    out: list[ModelSpec] = []
    for item in raw:
        if isinstance(item, ModelSpec):
            spec = item
        else:
            _check_names(item)
            path = str(item["path"])
            name = item.get("name") or _default_name(path)
            dies = item.get("dies")
            extra = {k: item[k] for k in _SPEC_EXTRAS if item.get(k) is not None}
            if isinstance(extra.get("kv_cache_dtype"), str):
                extra["kv_cache_dtype"] = parse_kv_types(
                    extra["kv_cache_dtype"], f"model {name}: kv_cache_dtype"
                )
            try:
                params = generation_defaults.check_params(item.get("params"))
            except ValueError as e:
                raise ConfigError(f"model {name}: params: {e}") from None
            spec = ModelSpec(
                path=path,
                name=name,
                dies=parse_dies(dies) if isinstance(dies, str) else tuple(dies or ()),
                **{**extra, "params": params},
            )
        for die in spec.dies:
            if die.startswith("cpu:") and "@" not in die and int(die[4:]) >= cpu_dies:
                raise ConfigError(f"model {spec.name}: die {die} does not exist (--cpu-dies {cpu_dies})")
        out.append(spec)
    return tuple(out)


_SPEC_EXTRAS = (
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


def _check_names(item: dict[str, Any]) -> None:
    """A ``--model`` / ``[[models]]`` entry's name (given, or the one its path gives) and
    aliases hold no control characters (``pantheon.core.names``)."""
    names = [item.get("name") or _default_name(str(item["path"]))]
    aliases = item.get("aliases")
    names += [a for a in aliases if isinstance(a, str)] if isinstance(aliases, (list, tuple)) else []
    for name in names:
        if isinstance(name, str) and (why := control_problem(name)):
            raise ConfigError(f"model {escaped(str(item['path']))}: {why}")


def _default_name(path: str) -> str:
    from pantheon.core.gguf import served_name  # a folder's name; a .gguf file's stem, lower-cased

    return served_name(path)
