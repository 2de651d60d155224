"""Which models are resident: load on first request, keep-alive, least-recently-used eviction.

- ``preload(workers)``: the start-up's loads (the entries with ``preload``), begun once the
  dies' workers are up, one after another; each is the model's load from the first moment,
  so a request for it waits for it and ``/v1/models`` says ``loading`` meanwhile;
- ``ensure(name)``: a request names a model; when the catalog (``pantheon.control.catalog``)
  knows the name or alias and no instance of it is ready, load it (one load however many
  requests wait for it: they share its task) and return the entry's name once it is ready. A
  load under way (the start-up's, the admin API's) is waited for the same way, up to
  ``--load-timeout`` (then a 503 with Retry-After; the load goes on); a load that fails gives
  each waiting request its error. At most ``--queue-depth`` plus the model's slots requests
  wait for one model's load (what its queue and slots would take; past it 429). The request
  then queues for a slot as any other, so its time to first token includes the load;
- ``wanting(name)``: a request is on its way to a slot of ``name`` (waiting for its load,
  preparing, queueing): the model's instances are not idle meanwhile, so no load evicts
  them under it;
- ``keep(name, keep_alive)``: a request for ``name`` ended; its instances stay loaded for
  ``keep_alive`` seconds of idleness (None: the entry's ``keep_alive``, else ``--keep-alive``
  for a model loaded on demand and forever for one named at start or loaded by the admin API;
  ``FOREVER``; 0: unload as soon as it is idle). A pinned entry stays whatever a request says;
- ``tick()`` (the app's ticker, 4 times a second) unloads the idle instances whose time is up;
- ``make_room(turn)`` (``Models`` asks it when the load at the head of the room queue,
  on demand or by the admin API, finds ``--models-max`` instances or no die with room;
  ``pantheon.control.room``): unload the least recently used idle instance loaded on demand
  (no request in flight, queued or on its way, not pinned, not of the model being loaded);
  when none is idle but one will be (busy, loading, unloading), wait for a change (a request
  ended, the ticker) and let the load try again; False when nothing will ever free, and
  ``holders()`` says what holds the room. Models named at start or loaded by the admin API
  are never evicted: an operator put them there.

Every load, unload and eviction it causes is an event with its reason (``Feed.event``).

``parse_keep_alive`` (``pantheon.config.values``, re-exported here) reads the one duration
format every route and setting takes (Ollama's: a number of seconds, or a Go duration such as
``"5m"``, ``"1h30m"``, ``"250ms"``; negative: forever).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pantheon import errors
from pantheon.config.values import FOREVER, KeepAliveError, parse_keep_alive
from pantheon.control.registry import DRAINING, FAILED, LOADING, READY
from pantheon.control.room import Holder, Turn, victim, will_free

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
        load_timeout_s: float = 300.0,
    ):
        self.catalog, self.models, self.registry, self.feed = catalog, models, registry, feed
        self.keep_alive_s = keep_alive_s
        self.models_max = models_max
        self.load_timeout_s = load_timeout_s
        # pantheon serve sets it once the start-up's loads are done: with models to load on
        # demand, the server is ready then even with none loaded (/health)
        self.started = False
        self._loads: dict[str, asyncio.Task[Instance]] = {}  # entry name -> its load (ours)
        self._preloads: set[str] = set()  # the names in _loads that are the start-up's loads
        self._waiting: collections.Counter[str] = collections.Counter()  # requests per load
        self._wanted: collections.Counter[str] = collections.Counter()  # requests on their way
        self._kept: dict[str, _Kept] = {}  # instance id -> its idle clock
        self._failed: dict[str, str] = {}  # entry name -> why its last on-demand load failed
        self._unloading: set[str] = set()  # instance ids an unload of ours is ending
        self._tasks: set[asyncio.Task] = set()
        registry.known = catalog.known
        registry.catalog_names = lambda: (e.name for e in catalog.entries())
        models.make_room = self.make_room
        models.holders = self.holders
        models.models_max = models_max

    # ------------------------------------------------------------ start-up

    def preload(self, workers: Awaitable[object]) -> list[asyncio.Task[Instance]]:
        """The start-up's loads, in the catalog's order: each begins once ``workers`` (the
        start of the dies' workers) and the loads before it are done, and is its model's load
        from now on (``ensure`` waits for it, ``status`` says ``loading``)."""
        up = asyncio.ensure_future(workers)
        tasks: list[asyncio.Task[Instance]] = []
        for entry in self.catalog.entries():
            if not entry.preload:
                continue
            task = asyncio.create_task(self._preload(entry, up, list(tasks)), name=f"preload-{entry.name}")
            self._loads[entry.name] = task
            self._preloads.add(entry.name)
            task.add_done_callback(lambda t, n=entry.name: self._load_done(n, t))
            tasks.append(task)
        return tasks

    async def _preload(
        self, entry: CatalogEntry, up: asyncio.Future[object], before: list[asyncio.Task[Instance]]
    ) -> Instance:
        await asyncio.shield(up)
        for t in before:  # one after another, as configured: the same order of ids and uploads
            with contextlib.suppress(Exception):
                await asyncio.shield(t)
        return await self._load_entry(entry)

    # ------------------------------------------------------------ requests

    @contextlib.contextmanager
    def wanting(self, model: str | None) -> Iterator[None]:
        """A request for ``model`` is on its way to a slot (its model's load, its preparation,
        its queue): the model's instances are not idle until it holds a slot or gives up."""
        name = self.catalog.canonical(model) or ""
        self._wanted[name] += 1
        try:
            yield
        finally:
            self._wanted[name] -= 1
            if self._wanted[name] <= 0:
                del self._wanted[name]
            self.models.room.poke()  # it may be idle now

    async def ensure(self, name: str | None) -> str | None:
        """Return once a model named ``name`` (a catalog name or alias) has a ready instance,
        loading it if the catalog knows it; raises the load's ``ApiError`` (or 503 past
        ``--load-timeout``, 429 past the requests one load may hold). Returns the name to
        route by (an alias resolved). A name the catalog does not know is left to the
        registry's routing (its 404, or the single-model shortcut)."""
        entry = self.catalog.lookup(name)
        if entry is None:
            if name and not self.registry.instances() and not self._loads and self.catalog.entries():
                # models to load on demand and none loaded: a name none of them has is a 404,
                # not the registry's "no model is loaded yet; retry" (which it would never be)
                raise errors.model_not_found(name)
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
        if self._waiting[entry.name] >= self.registry.queue_depth + (entry.slots or self.registry.slots):
            raise errors.queue_full()  # more than its queue and slots will take once loaded
        if task is None:
            task = asyncio.create_task(self._load(entry), name=f"on-demand-{entry.name}")
            self._loads[entry.name] = task
            task.add_done_callback(lambda t, n=entry.name: self._load_done(n, t))
        self._waiting[entry.name] += 1
        try:
            # shielded: a client that goes away does not stop a load others may wait for
            await asyncio.wait_for(asyncio.shield(task), self.load_timeout_s)
        except TimeoutError:
            raise errors.load_timeout(entry.name, self.load_timeout_s) from None
        finally:
            self._waiting[entry.name] -= 1
            if self._waiting[entry.name] <= 0:
                del self._waiting[entry.name]
        return entry.name

    async def _load(self, entry: CatalogEntry) -> Instance:
        # an idle unload of the same model may be ending: let it finish rather than meet its 409
        for _ in range(UNLOAD_WAIT_STEPS):
            if not any(i.name == entry.name and i.state == DRAINING for i in self.registry.instances()):
                break
            await asyncio.sleep(UNLOAD_WAIT_STEP_S)
        self.feed.event("load_on_demand", f"a request named {entry.name}: loading it", model=entry.name)
        inst = await self._load_entry(entry)
        self._kept[inst.instance_id] = _Kept(self._until(entry, None, on_demand=True), on_demand=True)
        self._failed.pop(entry.name, None)
        return inst

    async def _load_entry(self, entry: CatalogEntry) -> Instance:
        return await self.models.load(
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

    def _load_done(self, name: str, task: asyncio.Task) -> None:
        if self._loads.get(name) is task:
            del self._loads[name]
            self._preloads.discard(name)
        if task.cancelled():
            return
        e = task.exception()
        # a model that cannot be loaded is failed; one that found no room (507, or none freed
        # in time: 429, 503) or met another load or unload of its name (409) is not: the next
        # request tries again
        if e is not None and getattr(e, "status", 500) not in (507, 409, 429, 503):
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
        self.models.room.poke()  # a load waiting for room may evict it now

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
            and not self._wanted[inst.name]
            and inst.instance_id not in self._unloading
        )

    def _pinned(self, inst: Instance) -> bool:
        entry = self.catalog.get(inst.name)
        return entry is not None and entry.pin

    def _on_demand(self, inst: Instance) -> bool:
        """Loaded (or loading) on demand: not named at start nor loaded by the admin API."""
        kept = self._kept.get(inst.instance_id)
        if kept is not None:
            return kept.on_demand
        return inst.state == LOADING and inst.name in self._loads and inst.name not in self._preloads

    def _stays(self, inst: Instance) -> bool:
        """Never evicted: pinned, or named at start or loaded by the admin API (an operator
        put it there); only the models loaded on demand come and go on their own."""
        return self._pinned(inst) or not self._on_demand(inst)

    def _holder(self, inst: Instance) -> Holder:
        kept = self._kept.get(inst.instance_id)
        return Holder(
            instance_id=inst.instance_id,
            name=inst.name,
            evictable=inst.state in (LOADING, READY) and not self._stays(inst),
            idle=self._idle(inst),
            used=kept.used if kept is not None else 0.0,
            leaving=inst.state == DRAINING or inst.instance_id in self._unloading,
        )

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
        self.models.room.poke()  # what a load waits for may have changed without a request

    async def make_room(self, turn: Turn) -> bool:
        """For the load at the head of the room queue: unload the least recently used idle
        instance it may evict, or wait until something changes; True: try again, False:
        nothing will ever free (``holders`` says what holds the room)."""
        insts = {i.instance_id: i for i in self.registry.instances()}
        holders = [self._holder(i) for i in insts.values()]
        lru = victim(turn.name, holders)
        if lru is not None:
            idle = time.monotonic() - lru.used
            await self._unload(
                insts[lru.instance_id],
                f"evicted to make room for {turn.name} (least recently used, idle {idle:.0f} s)",
                "evicted",
            )
            return True
        if not will_free(turn.name, holders):
            return False
        await self.models.room.wait_change(turn)
        return True

    def holders(self, for_name: str) -> str:
        """What holds the room a load of ``for_name`` needs: each other instance and why it
        cannot go (yet)."""
        why = []
        for i in self.registry.instances():
            if i.name == for_name:
                continue
            h = self._holder(i)
            if self._pinned(i):
                reason = "pinned"
            elif h.leaving:
                reason = "unloading"
            elif i.state == FAILED:
                reason = "failed"
            elif self._stays(i):
                reason = "named at start or loaded by the admin API"
            elif i.state != READY:
                reason = i.state
            elif not h.idle:
                queued = len(self.registry.queue(i.name)) + self._wanted[i.name]
                reason = f"busy: {i.refs} in flight, {queued} queued"
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
            self.models.room.poke()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in list(self._tasks) + list(self._loads.values()):
            t.cancel()
        await asyncio.gather(*self._tasks, *self._loads.values(), return_exceptions=True)
