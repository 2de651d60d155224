"""Operations settings: security, limits, logs, registration, shutdown, recovery and the spec's
engine knobs, as the ``OpsConfig`` (and its ``Limits``) that ``ServeConfig.ops`` holds.

The settings themselves (flags, variables, TOML keys, defaults, help, checks) are rows of the
one table in ``pantheon.config.table``; this module only gives them their typed home. The
defaults below are read from that table, so each lives in one place.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pantheon.config.file import load_config_file, merge_config_file  # noqa: F401 - re-exported
from pantheon.config.table import SETTINGS
from pantheon.config.table import field_default as _d


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request ceilings (the body size limit is ``ServeConfig.max_body_bytes``)."""

    max_messages: int = _d("limits.max_messages")
    max_n: int = _d("limits.max_n")
    max_tokens: int | None = _d("limits.max_tokens")  # None: only the model's context bounds it
    max_stop: int = _d("limits.max_stop")  # at most 4: the OpenAI API's own ceiling
    max_stop_len: int = _d("limits.max_stop_len")  # characters per stop string


class OpsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The operations half of the serve configuration (``ServeConfig.ops``)."""

    api_keys: tuple[str, ...] = _d("ops.api_keys")
    admin_key: str | None = _d("ops.admin_key")
    models_dirs: tuple[str, ...] = _d("ops.models_dirs")
    limits: Limits = Limits()
    log_format: str = _d("ops.log_format")  # text | json
    drain_timeout_s: float = _d("ops.drain_timeout_s")
    registry_url: str | None = _d("ops.registry_url")
    registry_heartbeat_s: float = _d("ops.registry_heartbeat_s")
    node_id: str = _d("ops.node_id")
    registry_transport: str = _d("ops.registry_transport")
    advertise_host: str | None = _d("ops.advertise_host")
    worker_restarts: int = _d("ops.worker_restarts")  # per die before giving up (0: never)
    restart_backoff_s: float = _d("ops.restart_backoff_s")  # first delay; doubles, at most 30 s
    step_timeout_s: float = _d("ops.step_timeout_s")  # a step running longer: a hung worker
    step_target_s: float = _d("ops.step_target_s")  # the engines size prefill to about this
    worker_listen: str | None = _d("ops.worker_listen")  # tcp://host:port (needs CURVE keys)
    curve_dir: str | None = _d("ops.curve_dir")
    worker_insecure: bool = _d("ops.worker_insecure")  # plain TCP for --worker-listen (loopback only)
    worker_dead_after_s: float = _d("ops.worker_dead_after_s")  # a silent worker is dead after this
    # the spec's engine knobs
    driver_sample: bool = _d("ops.driver_sample")
    prefill_batch: bool = _d("ops.prefill_batch")
    step_stats: bool = _d("ops.step_stats")
    tool_auto: str = _d("ops.tool_auto")  # "lazy" | "decide" (pantheon/chat/answer_form.py)
    kv_q4: bool = _d("ops.kv_q4")
    async_poll_us: int | None = _d("ops.async_poll_us")  # None: the worker's own 50 ms
    cpu_path: str = _d("ops.cpu_path")  # CPU dies' linear-layer path (workers/cpu_paths.py)
    compile: bool = _d("ops.compile")  # torch.compile the decode step (workers/compiled.py)
    compile_cache_dir: str | None = _d("ops.compile_cache_dir")  # workers/compile_cache.py
    compile_cache_max_mb: int = _d("ops.compile_cache_max_mb")


def build_ops(values: dict[str, Any]) -> OpsConfig:
    """The ``OpsConfig`` of resolved row values (``resolve.Resolved.values``)."""
    ops: dict[str, Any] = {}
    lim: dict[str, Any] = {}
    for row in SETTINGS:
        if row.field and row.field.startswith("ops."):
            ops[row.field[4:]] = values[row.name]
        elif row.field and row.field.startswith("limits."):
            lim[row.field[7:]] = values[row.name]
    return OpsConfig(limits=Limits(**lim), **ops)


def worker_env(ops: OpsConfig) -> dict[str, str]:
    """Variables the workers get for the spec's engine knobs (they read nothing else)."""
    out = {}
    if ops.async_poll_us is not None:
        out["PANTHEON_ASYNC_POLL_US"] = str(ops.async_poll_us)
    if ops.step_stats:
        out["PANTHEON_STEP_STATS"] = "1"
    if ops.cpu_path != "auto":
        out["PANTHEON_CPU_PATH"] = ops.cpu_path
    out["PANTHEON_COMPILE"] = "1" if ops.compile else "0"  # on by default in the workers too
    if ops.compile_cache_dir:
        out["PANTHEON_COMPILE_CACHE_DIR"] = ops.compile_cache_dir
    out["PANTHEON_COMPILE_CACHE_MAX_MB"] = str(ops.compile_cache_max_mb)
    return out
