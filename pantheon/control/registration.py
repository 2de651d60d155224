"""Router registration: tell a router registry which models this server serves, and how busy it is.

Fully off unless ``PANTHEON_REGISTRY_URL`` (``--registry-url``) is set: then nothing is created and
nothing is sent. When set, ``Registration`` polls the model registry a few times a second and, for
each served model name (replicas of one name in this process are one registry instance, as in the
spec), sends::

    POST {url}/register    {"model_id", "instance_id", "endpoint", "capacity", "node_id",
                            "transport", "max_model_len"}
    POST {url}/heartbeat   {"model_id", "instance_id", "node_id", "transport", "capacity",
                            "busy", "queued"}          every PANTHEON_REGISTRY_HEARTBEAT seconds
    POST {url}/deregister  {"model_id", "instance_id", "node_id"}

- ``instance_id`` is ``host:port:model``; ``endpoint`` is ``http://host:port`` (``host``: the
  ``--advertise-host``, else the bind address); ``capacity`` is the model's slot count (1 in
  single-user mode), summed over its replicas; ``busy`` the slots in use, ``queued`` the requests
  waiting for one.
- A model is registered when it becomes ready (at startup, or by an admin load or a recovery), and
  deregistered when it is unloaded or its last replica fails; every model is deregistered at
  shutdown, before the server drains.
- The registry answers any 2xx. A 404 to a heartbeat means it forgot us: we register again.
- A registry that is down or slow never slows serving: each call has a short timeout (2 s), runs on
  its own task, and after a failure that target waits (backoff doubling from 1 s up to 60 s) before
  the next try; failures are logged once per outage, with the recovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx

log = logging.getLogger("pantheon.control.registration")

TICK_S = 0.25
TIMEOUT = httpx.Timeout(2.0, connect=1.0)
BACKOFF_MAX_S = 60.0
SHUTDOWN_TIMEOUT_S = 2.0


class Registration:
    def __init__(
        self,
        *,
        url: str,
        registry: Any,
        host: str,
        port: int,
        node_id: str = "node0",
        transport: str = "local",
        heartbeat_s: float = 5.0,
        slots: int = 8,
    ):
        self.url = url.rstrip("/")
        self.registry = registry
        self.host, self.port = host, port
        self.endpoint = f"http://{_url_host(host)}:{port}"
        self.node_id, self.transport = node_id, transport
        self.heartbeat_s = heartbeat_s
        self.slots = slots
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self._registered: dict[str, dict] = {}  # model -> what was registered
        self._pending: dict[str, asyncio.Task] = {}  # model -> register/deregister in flight
        self._next_beat = 0.0
        self._backoff_until = 0.0
        self._backoff = 0.0
        self._down = False

    def instance_id(self, model: str) -> str:
        return f"{self.host}:{self.port}:{model}"

    # ------------------------------------------------------------ life cycle

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=TIMEOUT)
        self._task = asyncio.create_task(self._run(), name="registration")
        log.info("registering with %s as node %s (%s)", self.url, self.node_id, self.transport)

    async def stop(self) -> None:
        """Deregister every model (bounded: a dead registry costs at most a couple of seconds)."""
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        for t in self._pending.values():
            t.cancel()
        models = list(self._registered)
        self._registered.clear()
        if models:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(
                        *(self._post("deregister", self._ident(m)) for m in models), return_exceptions=True
                    ),
                    SHUTDOWN_TIMEOUT_S,
                )
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------ the loop

    def _models(self) -> dict[str, dict]:
        """Served names -> capacity, load and context, over their ready replicas."""
        out: dict[str, dict] = {}
        queues = self.registry.queues() if hasattr(self.registry, "queues") else {}
        for inst in self.registry.instances():
            if inst.state != "ready":
                continue
            info = inst.info()
            gate = getattr(inst, "gate", None)
            m = out.setdefault(
                inst.name, {"capacity": 0, "busy": 0, "queued": 0, "max_model_len": inst.max_model_len}
            )
            m["capacity"] += getattr(gate, "slots", None) or self.slots
            m["busy"] += int(info.get("running", 0))
            m["queued"] = len(queues[inst.name]) if inst.name in queues else 0
        return out

    def _ident(self, model: str) -> dict:
        return {"model_id": model, "instance_id": self.instance_id(model), "node_id": self.node_id}

    async def _run(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:
                log.exception("registration tick failed")
            await asyncio.sleep(TICK_S)

    def _tick(self) -> None:
        now = time.monotonic()
        if now < self._backoff_until:
            return
        models = self._models()
        for name, m in models.items():
            if name not in self._registered and name not in self._pending:
                self._spawn(name, self._register(name, m))
        for name in list(self._registered):
            if name not in models and name not in self._pending:
                self._spawn(name, self._deregister(name))
        if now >= self._next_beat:
            self._next_beat = now + self.heartbeat_s
            for name, m in models.items():
                if name in self._registered and name not in self._pending:
                    self._spawn(name, self._heartbeat(name, m))

    def _spawn(self, name: str, coro) -> None:
        task = asyncio.create_task(coro, name=f"registration-{name}")
        self._pending[name] = task
        task.add_done_callback(
            lambda t, n=name: self._pending.pop(n, None) if self._pending.get(n) is t else None
        )

    async def _register(self, name: str, m: dict) -> None:
        body = {
            **self._ident(name),
            "endpoint": self.endpoint,
            "capacity": m["capacity"],
            "transport": self.transport,
            "max_model_len": m["max_model_len"],
        }
        if await self._post("register", body) is not None:
            self._registered[name] = body
            log.info("registered %s as %s", name, body["instance_id"])

    async def _deregister(self, name: str) -> None:
        if await self._post("deregister", self._ident(name)) is not None:
            self._registered.pop(name, None)
            log.info("deregistered %s", name)

    async def _heartbeat(self, name: str, m: dict) -> None:
        body = {
            **self._ident(name),
            "transport": self.transport,
            "capacity": m["capacity"],
            "busy": m["busy"],
            "queued": m["queued"],
        }
        status = await self._post("heartbeat", body)
        if status == 404:  # the registry forgot us (it restarted): register again
            self._registered.pop(name, None)

    async def _post(self, what: str, body: dict) -> int | None:
        """POST; the status (2xx or 404), or None after a failure (which starts a backoff)."""
        if self._client is None:  # stopped
            return None
        try:
            r = await self._client.post(f"{self.url}/{what}", json=body)
            if r.status_code == 404 and what == "heartbeat":
                return 404
            r.raise_for_status()
        except (httpx.HTTPError, OSError) as e:
            self._backoff = min(BACKOFF_MAX_S, max(1.0, self._backoff * 2))
            self._backoff_until = time.monotonic() + self._backoff
            if not self._down:
                log.warning(
                    "router registry %s: %s failed (%s); retrying with backoff",
                    self.url,
                    what,
                    type(e).__name__ if not str(e) else e,
                )
            self._down = True
            return None
        if self._down:
            log.info("router registry %s reachable again", self.url)
        self._down, self._backoff = False, 0.0
        return r.status_code


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def advertised_host(bind_host: str, advertise: str | None) -> str:
    """The host put in the registered endpoint: the operator's choice, else the bind address
    (a wildcard bind becomes this machine's name)."""
    if advertise:
        return advertise
    if bind_host in ("0.0.0.0", "::", ""):
        import socket

        return socket.gethostname()
    return bind_host


def from_config(cfg: Any, registry: Any, host: str, port: int) -> Registration | None:
    """A started-later ``Registration`` when ``PANTHEON_REGISTRY_URL`` is set; else None."""
    ops = cfg.ops
    if not ops.registry_url:
        return None
    return Registration(
        url=ops.registry_url,
        registry=registry,
        host=advertised_host(host, ops.advertise_host),
        port=port,
        node_id=ops.node_id,
        transport=ops.registry_transport,
        heartbeat_s=ops.registry_heartbeat_s,
        slots=cfg.slots,
    )
