"""Which models are resident: load on first request, keep-alive, least-recently-used eviction.

- ``ensure(name)``: a request names a model; when the catalog (``pantheon.control.catalog``)
  knows the name or alias and no instance of it is ready, load it (one load however many
  requests wait for it: they share its task) and return the entry's name once it is ready. A
  load the admin API started is waited for the same way. The request then queues for a slot
  as any other, so its time to first token includes the load;
- ``keep(name, keep_alive)``: a request for ``name`` ended; its instances stay loaded for
  ``keep_alive`` seconds of idleness (None: the entry's ``keep_alive``, else ``--keep-alive``
  for a model loaded on demand and forever for one named at start or loaded by the admin API;
  ``FOREVER``; 0: unload as soon as it is idle). A pinned entry stays whatever a request says;
- ``tick()`` (the app's ticker, 4 times a second) unloads the idle instances whose time is up;
- ``make_room(for_name)`` (``Models`` asks it when a load, on demand or by the admin API,
  finds ``--models-max`` instances or no die with room): unload the least recently used idle
  instance loaded on demand (no request in flight or queued, not pinned, not of the model
  being loaded); False when none can go, and ``holders()`` says what holds the room. Models
  named at start or loaded by the admin API are never evicted: an operator put them there.

Every load, unload and eviction it causes is an event with its reason (``Feed.event``).

``parse_keep_alive`` (``pantheon.config.values``, re-exported here) reads the one duration
format every route and setting takes (Ollama's: a number of seconds, or a Go duration such as
``"5m"``, ``"1h30m"``, ``"250ms"``; negative: forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pantheon import errors
from pantheon.config.values import FOREVER, KeepAliveError, parse_keep_alive
from pantheon.control.registry import DRAINING, FAILED, LOADING, READY

if TYPE_CHECKING:
    from pantheon.control.catalog import Catalog, CatalogEntry
    from pantheon.control.feed import Feed
    from pantheon.control.lifecycle import Models
    from pantheon.control.registry import Instance, Registry

log = logging.getLogger("pantheon.control.residency")

__all__ = ["FOREVER", "KeepAliveError", "Residency", "parse_keep_alive"]

UNLOAD_WAIT_STEP_S = 0.05
UNLOAD_WAIT_STEPS = 600  # 30 s: the longest an unload of an idle instance should take


@dataclass
class _Kept:
    """An instance's idle clock: it may be unloaded once idle past ``until`` (monotonic)."""

    until: float = FOREVER
    used: float = field(default_factory=time.monotonic)  # when it last ended a request
    on_demand: bool = False  # loaded by ensure(): --keep-alive applies by default


class Residency:
    """Load on first request, keep-alive and eviction (see the module doc)."""

    def __init__(
        self,
        catalog: Catalog,
        models: Models,
        registry: Registry,
        feed: Feed,
        *,
        keep_alive_s: float = 300.0,
        models_max: int = 0,
    ):
        self.catalog, self.models, self.registry, self.feed = catalog, models, registry, feed
        self.keep_alive_s = keep_alive_s
        self.models_max = models_max
        self._loads: dict[str, asyncio.Task[Instance]] = {}
        self._kept: dict[str, _Kept] = {}  # instance id -> its idle clock
        self._failed: dict[str, str] = {}  # entry name -> why its last on-demand load failed
        self._unloading: set[str] = set()  # instance ids an unload of ours is ending
        self._tasks: set[asyncio.Task] = set()
        registry.known = catalog.known
        registry.catalog_names = lambda: (e.name for e in catalog.entries())
        models.make_room = self.make_room
        models.holders = self.holders
        models.models_max = models_max

    # ------------------------------------------------------------ requests

    async def ensure(self, name: str | None) -> str | None:
        """Return once a model named ``name`` (a catalog name or alias) has a ready instance,
        loading it if the catalog knows it; raises the load's ``ApiError``. Returns the name
        to route by (an alias resolved). A name the catalog does not know is left to the
        registry's routing (its 404, or the single-model shortcut)."""
        entry = self.catalog.lookup(name)
        if entry is None:
            return name
        if any(i.name == entry.name for i in self.registry.ready()):
            return entry.name
        task = self._loads.get(entry.name) or self.models.pending(entry.name)
        if task is None and any(
            i.name == entry.name and i.state not in (READY, DRAINING) for i in self.registry.instances()
        ):
            # failed (its worker died): the supervisor restarts it or keeps it failed, and the
            # registry answers meanwhile (503); a load here would go round the restart limit
            return entry.name
        if task is None and entry.error is not None:
            raise errors.model_unavailable(entry.name, entry.error)
        if task is None:
            task = asyncio.create_task(self._load(entry), name=f"on-demand-{entry.name}")
            self._loads[entry.name] = task
            task.add_done_callback(lambda t, n=entry.name: self._load_done(n, t))
        # shielded: a client that goes away does not stop a load others may wait for
        await asyncio.shield(task)
        return entry.name

    async def _load(self, entry: CatalogEntry) -> Instance:
        # an idle unload of the same model may be ending: let it finish rather than meet its 409
        for _ in range(UNLOAD_WAIT_STEPS):
            if not any(i.name == entry.name and i.state == DRAINING for i in self.registry.instances()):
                break
            await asyncio.sleep(UNLOAD_WAIT_STEP_S)
        self.feed.event("load_on_demand", f"a request named {entry.name}: loading it", model=entry.name)
        inst = await self.models.load(
            entry.path,
            entry.name,
            entry.dies,
            entry.quantize,
            slots=entry.slots,
            max_context=entry.max_context,
            params=dict(entry.params),
            embeddings=entry.embeddings,
            kv_cache_dtype=entry.kv_cache_dtype,
            draft=entry.draft,
        )
        self._kept[inst.instance_id] = _Kept(self._until(entry, None, on_demand=True), on_demand=True)
        self._failed.pop(entry.name, None)
        return inst

    def _load_done(self, name: str, task: asyncio.Task) -> None:
        self._loads.pop(name, None)
        if task.cancelled():
            return
        e = task.exception()
        # a model that cannot be loaded is failed; one that found no room (507) or met another
        # load or unload of its name (409) is not: the next request tries again
        if e is not None and getattr(e, "status", 500) not in (507, 409):
            self._failed[name] = getattr(e, "message", None) or str(e)

    def loading(self, name: str) -> bool:
        return name in self._loads or self.models.pending(name) is not None

    def status(self, name: str) -> dict[str, str]:
        """``{"value": loaded | loading | unloaded | failed[, "reason"]}`` of a model name, as
        ``/v1/models`` lists it (llama.cpp's router mode's values, and ``failed`` with why)."""
        insts = [i for i in self.registry.instances() if i.name == name]
        if any(i.state == READY for i in insts):
            return {"value": "loaded"}
        if self.loading(name) or any(i.state == LOADING for i in insts):
            return {"value": "loading"}
        entry = self.catalog.get(name)
        why = (entry.error if entry is not None else None) or self._failed.get(name)
        why = why or next((i.error for i in insts if i.state == FAILED and i.error), None)
        if why:
            return {"value": "failed", "reason": why}
        return {"value": "unloaded"}

    def expires_at(self, inst: Instance) -> float | None:
        """The unix time ``inst`` is unloaded if it stays idle; None: never."""
        kept = self._kept.get(inst.instance_id)
        if kept is None or kept.until == FOREVER or self._pinned(inst):
            return None
        return time.time() + max(0.0, kept.until - time.monotonic())

    def keep(self, name: str, keep_alive: float | None) -> None:
        """A request for ``name`` ended: restart its instances' idle clocks (see the module
        doc for what ``keep_alive`` None means)."""
        entry = self.catalog.get(name)
        now = time.monotonic()
        for inst in self.registry.ready():
            if inst.name != name:
                continue
            kept = self._kept.setdefault(inst.instance_id, _Kept())
            kept.used = now
            kept.until = self._until(entry, keep_alive, on_demand=kept.on_demand, now=now)

    def _until(
        self,
        entry: CatalogEntry | None,
        keep_alive: float | None,
        *,
        on_demand: bool,
        now: float | None = None,
    ) -> float:
        if entry is not None and entry.pin:
            return FOREVER
        if keep_alive is None:
            keep_alive = entry.keep_alive if entry is not None else None
        if keep_alive is None:
            keep_alive = self.keep_alive_s if on_demand else FOREVER
        return (time.monotonic() if now is None else now) + keep_alive

    # ------------------------------------------------------------ unloading

    def _idle(self, inst: Instance) -> bool:
        return (
            inst.state == READY
            and inst.refs == 0
            and inst.gate.active == 0
            and not len(self.registry.queue(inst.name))
            and inst.instance_id not in self._unloading
        )

    def _pinned(self, inst: Instance) -> bool:
        entry = self.catalog.get(inst.name)
        return entry is not None and entry.pin

    def _stays(self, inst: Instance) -> bool:
        """Never evicted: pinned, or named at start or loaded by the admin API (an operator
        put it there); only the models loaded on demand come and go on their own."""
        kept = self._kept.get(inst.instance_id)
        return self._pinned(inst) or kept is None or not kept.on_demand

    def tick(self) -> None:
        """Unload the idle instances whose keep-alive ran out."""
        now = time.monotonic()
        for inst in self.registry.instances():
            kept = self._kept.get(inst.instance_id)
            if kept is None or kept.until > now or not self._idle(inst) or self._pinned(inst):
                continue
            idle = now - kept.used
            self._spawn(self._unload(inst, f"idle for {idle:.0f} s: its keep-alive ran out", "expired"))
        for iid in set(self._kept) - {i.instance_id for i in self.registry.instances()}:
            del self._kept[iid]  # unloaded meanwhile (the admin API, a failure)

    async def make_room(self, for_name: str) -> bool:
        """Unload the least recently used idle instance to make room for ``for_name``; False
        when none can go."""
        victims = [
            i
            for i in self.registry.instances()
            if i.name != for_name and self._idle(i) and not self._stays(i)
        ]
        if not victims:
            return False
        lru = min(victims, key=lambda i: self._kept.get(i.instance_id, _Kept(used=0.0)).used)
        idle = time.monotonic() - self._kept.get(lru.instance_id, _Kept(used=time.monotonic())).used
        await self._unload(
            lru, f"evicted to make room for {for_name} (least recently used, idle {idle:.0f} s)", "evicted"
        )
        return True

    def holders(self, for_name: str) -> str:
        """What holds the room a load of ``for_name`` needs: each other instance and why it
        cannot go."""
        why = []
        for i in self.registry.instances():
            if i.name == for_name:
                continue
            if self._pinned(i):
                reason = "pinned"
            elif self._stays(i):
                reason = "named at start or loaded by the admin API"
            elif i.state != READY:
                reason = i.state
            elif i.refs or i.gate.active or len(self.registry.queue(i.name)):
                reason = f"busy: {i.refs} in flight, {len(self.registry.queue(i.name))} queued"
            else:
                reason = "idle"
            why.append(f"{i.instance_id} ({reason})")
        return ", ".join(why) or "nothing"

    async def _unload(self, inst: Instance, reason: str, kind: str) -> None:
        self._unloading.add(inst.instance_id)
        try:
            self.feed.event(kind, f"{inst.instance_id}: {reason}", model=inst.name, instance=inst.instance_id)
            log.info("unloading %s: %s", inst.instance_id, reason)
            with contextlib.suppress(errors.ApiError):  # gone meanwhile (an admin unload)
                await self.models.unload(inst.instance_id)
        finally:
            self._unloading.discard(inst.instance_id)
            self._kept.pop(inst.instance_id, None)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in list(self._tasks) + list(self._loads.values()):
            t.cancel()
        await asyncio.gather(*self._tasks, *self._loads.values(), return_exceptions=True)
