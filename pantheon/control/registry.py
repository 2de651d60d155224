"""The model registry: the instance table, refcounts, routing, and each model's slot queue.

An ``Instance`` is one loaded copy of a model on one die (or a die list: layers split); several
instances may share a name (replicas; ``/v1/models`` shows the name once). States: ``loading``
(the name is taken, nothing routes to it), ``ready``, ``draining`` (no new requests; unload waits
for the in-flight ones), ``failed`` (its worker died). At most ``MAX_INSTANCES`` (16) rows.

Routing follows the spec:

- a name the server knows (a ready model's, a loading, draining or failed instance's, or one
  the catalog knows: ``known``) is served by that model or gets its error (503 while it is not
  ready), never by another. Otherwise, the spec's shortcut: when the server has exactly one
  model (one name among its instances, whatever their state, and its catalog; however many
  replicas) it takes every request whatever ``model`` says (but a name with a control character,
  which no model has: ``pantheon.core.names``); with more, an exact
  name is needed (none: the first resident one); an unknown name is 404 ``model_not_found``;
  no model at all is 503;
- among replicas the least busy wins (in flight; between equals the one that waited longest for
  a request, so that sequential traffic alternates), except that a ``session_id`` goes back to
  the replica that served it last (its prefix cache is warm there) unless that replica is
  saturated: the spec's missing cross-replica affinity.

Acquiring a slot (``acquire_slot``), per model name, behind the overflow queue and the admission
backpressure of the original server (its spec calls them D1 and D3):

- fast path: a replica has a free slot, nobody queues ahead, and pressure is below CRITICAL;
- else the request waits in the model's FIFO (depth ``queue_depth``, 32 by default) for at most
  ``queue_timeout_s`` (30 s): a freed slot of any replica goes to the head of the queue. The
  timeout's clock stops while ``paused(name)`` says the model has no live worker (the
  supervisor's ``stalled``: every replica's worker silent, or the model restarting after a
  death): a request queued behind a frozen worker waits for its death and restart, as one
  queued behind a killed worker does, rather than timing out when the worker is declared dead;
- queue full: 429 ``Retry-After: 5`` (503 at CRITICAL); waited too long: 429 ``Retry-After: 2``;
  shutting down: 503. A client that goes away while queued leaves the queue (its task is
  cancelled). Single-user instances (one slot) keep the spec's immediate 429 ``server_busy``.

Plain asyncio state on the router's one event loop: no locks; it never talks to workers.

Why one module of ~400 lines: the instance table, routing and the per-model slot queues
change together (every grant, release, failure and publish re-runs the same dispatch), and
splitting them would put one invariant in two files.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pantheon import errors
from pantheon.core.description import ModelDescription
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.names import has_control
from pantheon.core.protocol import Loaded, LoadModel
from pantheon.core.sizing import Estimate
from pantheon.errors import ApiError
from pantheon.models.assets import ModelAssets

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
CRITICAL = 3
MAX_INSTANCES = 16  # the spec's MR_MAX_MODELS
MAX_SESSIONS = 16384  # session -> replica affinity entries kept (least recently used dropped)
PAUSE_CHECK_S = 0.5  # a queued request asks ``paused`` this often while it waits


@dataclass
class Slots:
    """An instance's router-side slots: ``active`` of ``slots`` are held by requests."""

    slots: int
    active: int = 0

    @property
    def free(self) -> bool:
        return self.active < self.slots


@dataclass(eq=False)
class Instance:
    name: str
    instance_id: str
    path: str
    dies: tuple[str, ...]
    gate: Slots
    state: str = LOADING
    refs: int = 0  # in flight: taken by acquire_slot()/acquire(), ended by leave()/release()
    served: int = 0  # requests granted a slot since load
    last_grant: int = 0  # when it last got a request (a sequence number): ties go to the oldest
    max_model_len: int | None = None
    quantize: bool = False
    kv_types: KvCacheTypes = field(default_factory=KvCacheTypes)  # its KV cache's K and V types
    embeddings: bool = False  # its load asked for /v1/embeddings (a chat model: mean pooling)
    assets: ModelAssets | None = None  # the router-side tokenizer/template bundle
    loaded: Loaded | None = None  # what the worker said when it finished loading
    estimate: Estimate | None = None  # for admission and bookings
    shape: ModelDescription | None = None  # the description the estimate came from
    cpu_path: str = ""  # the CPU path its worker chose (workers/cpu_paths.py); "" on CUDA
    kv_pool_tokens: int | None = None  # tokens the worker's KV pool holds
    error: str | None = None  # why it failed: only while it is failed
    last_error: str | None = None  # the latest failure, kept after it is ready again
    last_error_at: float | None = None  # unix time of that failure
    load_progress: float | None = None  # 0..1 while loading
    load_msg: LoadModel | None = None  # what it was loaded with (a restart reuses it)
    restarts: int = 0  # times it was reloaded after its worker died
    # the catalog entry's generation defaults (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_tokens): a request's unset fields come from these first
    params: dict[str, float | int] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    _drained: asyncio.Event | None = None

    @property
    def model_assets(self) -> ModelAssets:
        """Its tokenizer and template: an instance a request was routed to is published, so
        they are there (``assets`` is None only while it loads)."""
        if self.assets is None:
            raise RuntimeError(f"{self.instance_id} has no assets: it is not loaded")
        return self.assets

    def failed(self, reason: str) -> None:
        """It failed (its worker died, a reload failed): ``error`` until it is ready again,
        ``last_error`` and its time after that too."""
        self.state, self.load_progress = FAILED, None
        self.error = self.last_error = reason
        self.last_error_at = time.time()

    @property
    def die(self) -> str:
        """The die whose worker hosts the instance (the first of its dies)."""
        return self.dies[0]

    @property
    def single_user(self) -> bool:
        return self.gate.slots <= 1

    @property
    def busy(self) -> int:
        return self.gate.active

    def info(self) -> dict:
        return {
            "name": self.name,
            "instance": self.instance_id,
            "path": self.path,
            "dies": list(self.dies),
            "state": self.state,
            "error": self.error,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "in_flight": self.refs,
            "running": self.gate.active,
            "slots": self.gate.slots,
            "served": self.served,
            "max_model_len": self.max_model_len,
            "quantize": self.quantize,
            "kv_cache_dtype": str(self.kv_types),  # "q8_0", or "K/V" when they differ
            # its draft model for speculation (workers/draft.py; a restart reloads it too)
            "draft": self.load_msg.draft if self.load_msg is not None else None,
            "load_progress": self.load_progress,
            "restarts": self.restarts,
            "cpu_path": self.cpu_path or None,
        }


@dataclass(eq=False)
class _Waiter:
    fut: asyncio.Future
    session_id: str | None
    since: float = field(default_factory=time.monotonic)


class ModelQueue:
    """One model name's FIFO of requests waiting for a slot on any of its replicas."""

    def __init__(self, depth: int):
        self.depth = depth
        self.waiters: collections.deque[_Waiter] = collections.deque()

    def live(self) -> list[_Waiter]:
        return [w for w in self.waiters if not w.fut.done()]

    def __len__(self) -> int:
        return sum(1 for w in self.waiters if not w.fut.done())

    def oldest_wait_s(self) -> float:
        live = self.live()
        return time.monotonic() - live[0].since if live else 0.0


class Registry:
    """The instance table, routing and the per-model queues (see the module doc).

    ``pressure(dies) -> level`` is asked at every gate decision (default: always 0)."""

    def __init__(
        self,
        *,
        slots: int = 8,
        queue_depth: int = 32,
        queue_timeout_s: float = 30.0,
        single_user: bool | None = None,
        pressure: Callable[[tuple[str, ...]], int] | None = None,
    ):
        self.slots = 1 if single_user else slots
        self.queue_depth = queue_depth
        self.queue_timeout_s = queue_timeout_s
        self.pressure = pressure or (lambda dies: 0)
        # model name -> its queue's timeout clock stands still (no live worker); set by the
        # supervisor (Supervisor.stalled)
        self.paused: Callable[[str], bool] = lambda name: False
        # model name -> the catalog knows it (Residency sets it): such a name is never
        # answered by another model
        self.known: Callable[[str], bool] = lambda name: False
        # the catalog's model names, loaded or not (Residency sets it): the single-model
        # shortcut is for a server with one model only
        self.catalog_names: Callable[[], Iterable[str]] = lambda: ()
        self.closing = False
        self._instances: list[Instance] = []
        self._ids = itertools.count(1)
        self._grants = itertools.count(1)
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._queues: dict[str, ModelQueue] = {}

    # ------------------------------------------------------------ table

    def reserve(
        self, name: str, path: str, dies: tuple[str, ...] = (), *, slots: int | None = None
    ) -> Instance:
        """Phase 1 of a load: take a table row in ``loading`` state (not routable). Pair with
        ``publish`` or ``discard``. Raises 507 when the table is full."""
        if len(self._instances) >= MAX_INSTANCES:
            raise errors.table_full(MAX_INSTANCES)
        iid = f"{name}#{next(self._ids)}"
        inst = Instance(
            name=name, instance_id=iid, path=path, dies=tuple(dies), gate=Slots(max(1, slots or self.slots))
        )
        self._instances.append(inst)
        return inst

    def publish(
        self,
        inst: Instance,
        *,
        assets: ModelAssets | None = None,
        loaded: Loaded | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """Phase 4 of a load: the instance takes requests."""
        inst.assets = assets
        inst.loaded = loaded
        inst.max_model_len = max_model_len
        inst.state, inst.load_progress, inst.error = READY, None, None
        self._dispatch(inst.name)

    def discard(self, inst: Instance) -> None:
        """Remove a row (failed load, unload). Requests queued for a name with no replica left
        fail; those for a name with others move on to them."""
        if inst in self._instances:
            self._instances.remove(inst)
        self._dispatch(inst.name)

    def fail(self, inst: Instance, reason: str) -> None:
        """Its worker died: nothing routes to it any more (the row stays, shown as failed)."""
        inst.failed(reason)
        self._dispatch(inst.name)

    def instances(self) -> list[Instance]:
        return list(self._instances)

    def ready(self) -> list[Instance]:
        return [i for i in self._instances if i.state == READY]

    def find(self, name_or_id: str) -> list[Instance]:
        """The instance whose id ``name_or_id`` is, or every instance of that name."""
        by_id = [i for i in self._instances if i.instance_id == name_or_id]
        return by_id or [i for i in self._instances if i.name == name_or_id]

    def names(self) -> list[str]:
        """Resident (ready) model names, each once, in load order."""
        return list(dict.fromkeys(i.name for i in self.ready()))

    @property
    def has_ready(self) -> bool:
        return any(i.state == READY for i in self._instances)

    # ------------------------------------------------------------ routing

    def candidates(self, name: str | None) -> tuple[str, list[Instance]]:
        """The model a request naming ``name`` goes to, and its ready replicas."""
        ready = self.ready()
        if not ready:
            raise self._failed_for_good(name) or errors.no_model_loaded()
        names = list(dict.fromkeys(i.name for i in ready))
        if name in names:
            target = name
        elif name and (self.known(name) or any(i.name == name for i in self._instances)):
            # a name the server knows: never another model
            raise self._failed_for_good(name) or errors.model_loading(name)
        elif not name or (self._one_model() and not has_control(name)):
            target = names[0]
        else:
            raise errors.model_not_found(name)
        return target, [i for i in ready if i.name == target]

    def _one_model(self) -> bool:
        """Whether the server has one model: one name among its instances (loading, failed or
        draining ones too) and its catalog. With another one still loading, an unknown name is
        a 404, not an answer from whichever model is ready first."""
        return len({i.name for i in self._instances} | set(self.catalog_names())) == 1

    def _failed_for_good(self, name: str | None) -> ApiError | None:
        """``model_failed`` (no Retry-After) when every instance of ``name`` (else every one) is
        failed: routing runs after a recovery under way was waited for
        (``supervisor.await_recovery``), so a failed instance here is one given up on."""
        insts = [i for i in self._instances if i.name == name] or list(self._instances)
        if not insts or any(i.state != FAILED for i in insts):
            return None
        return errors.model_failed(insts[0].name, insts[0].error)

    def _pick(self, cands: list[Instance], session_id: str | None, free_only: bool) -> Instance | None:
        pool = [i for i in cands if i.gate.free] if free_only else cands
        if not pool:
            return None
        if session_id is not None and len(cands) > 1:
            sticky = self._sessions.get(session_id)
            for i in pool:
                if i.instance_id == sticky and i.gate.free:
                    return i
        # least busy; then the one that waited longest for a request (sequential traffic
        # alternates, whatever each replica served before); then load order
        return min(pool, key=lambda i: (i.refs, i.last_grant))

    def route(self, name: str | None, session_id: str | None = None) -> Instance:
        """The instance a request naming ``name`` would take now; raises ``ApiError``."""
        _, cands = self.candidates(name)
        inst = self._pick(cands, session_id, free_only=False)
        assert inst is not None  # candidates() is never empty, and any replica will do
        return inst

    def acquire(self, name: str | None, session_id: str | None = None) -> Instance:
        """Route and take a reference (no slot); pair with ``release``."""
        inst = self.route(name, session_id)
        inst.refs += 1
        return inst

    def release(self, inst: Instance) -> None:
        inst.refs = max(0, inst.refs - 1)
        self._maybe_drained(inst)

    def _maybe_drained(self, inst: Instance) -> None:
        if inst.refs == 0 and inst.gate.active == 0 and inst._drained is not None:
            inst._drained.set()

    def _remember(self, session_id: str | None, inst: Instance) -> None:
        if session_id is None:
            return
        self._sessions[session_id] = inst.instance_id
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def _grant(self, inst: Instance, session_id: str | None) -> Instance:
        inst.gate.active += 1
        inst.refs += 1
        inst.served += 1
        inst.last_grant = next(self._grants)
        self._remember(session_id, inst)
        return inst

    # ------------------------------------------------------------ the gate

    def queue(self, name: str) -> ModelQueue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = ModelQueue(self.queue_depth)
        return q

    def queues(self) -> dict[str, ModelQueue]:
        return dict(self._queues)

    def _level(self, cands: list[Instance]) -> int:
        return self.pressure(tuple(dict.fromkeys(d for i in cands for d in i.dies)))

    async def acquire_slot(self, name: str | None, session_id: str | None = None) -> Instance:
        """Route and take a slot, waiting in the model's queue if need be; pair with ``leave``.
        Raises ``ApiError`` (404, 429, 503)."""
        if self.closing:
            raise errors.shutting_down()
        target, cands = self.candidates(name)
        q = self.queue(target)
        level = self._level(cands)
        if not len(q) and level < CRITICAL:
            inst = self._pick(cands, session_id, free_only=True)
            if inst is not None:
                return self._grant(inst, session_id)
        if all(i.single_user for i in cands):
            if level >= CRITICAL:
                raise errors.memory_pressure()
            raise errors.server_busy()  # the spec's single-user trylock: no queue
        if len(q) >= q.depth:
            raise errors.memory_pressure() if level >= CRITICAL else errors.queue_full()
        w = _Waiter(asyncio.get_running_loop().create_future(), session_id)
        q.waiters.append(w)
        try:
            return await self._wait(w, target)
        except BaseException as e:
            if w.fut.done() and not w.fut.cancelled() and w.fut.exception() is None:
                if isinstance(e, TimeoutError):
                    return w.fut.result()  # granted just as the wait ran out: use it
                self.leave(w.fut.result())  # granted as the client went away: pass it on
            elif not w.fut.done():
                w.fut.cancel()
            if w in q.waiters:
                q.waiters.remove(w)
            if isinstance(e, TimeoutError):
                raise errors.queue_timeout(self.queue_timeout_s) from None
            raise

    async def _wait(self, w: _Waiter, name: str) -> Instance:
        """Wait for ``w``'s grant; TimeoutError once it waited ``queue_timeout_s`` while its
        model was not ``paused``: asked every ``PAUSE_CHECK_S``, a slice of the wait that
        begins or ends paused does not count."""
        counted, last, was = 0.0, time.monotonic(), self._paused(name)
        while True:
            left = self.queue_timeout_s - counted
            if left <= 0:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(w.fut), min(left, PAUSE_CHECK_S))
            except TimeoutError:
                now, paused = time.monotonic(), self._paused(name)
                if not (was or paused):
                    counted += now - last
                last, was = now, paused

    def _paused(self, name: str) -> bool:
        try:
            return bool(self.paused(name))
        except Exception:  # noqa: BLE001 - a broken hook must not break the queue: the clock runs
            return False

    def leave(self, inst: Instance) -> None:
        """Give back the slot and the reference ``acquire_slot`` took."""
        inst.gate.active = max(0, inst.gate.active - 1)
        inst.refs = max(0, inst.refs - 1)
        self._dispatch(inst.name)
        self._maybe_drained(inst)

    def _dispatch(self, name: str) -> None:
        """Hand free slots of ``name``'s replicas to the head of its queue, in order."""
        q = self._queues.get(name)
        if q is None:
            return
        while q.waiters:
            head = q.waiters[0]
            if head.fut.done():
                q.waiters.popleft()
                continue
            cands = [i for i in self.ready() if i.name == name]
            if self.closing or not cands:
                err = errors.shutting_down() if self.closing else errors.model_gone(name)
                for w in q.live():
                    w.fut.set_exception(err)
                q.waiters.clear()
                return
            if self._level(cands) >= CRITICAL:
                return
            inst = self._pick(cands, head.session_id, free_only=True)
            if inst is None:
                return
            q.waiters.popleft()
            head.fut.set_result(self._grant(inst, head.session_id))

    def poke(self) -> None:
        """Re-run every queue (pressure may have dropped); called a few times a second."""
        for name in list(self._queues):
            self._dispatch(name)

    def shut_down(self) -> None:
        """Stop granting slots: new requests and queued ones get 503 ``shutting_down``."""
        self.closing = True
        self.poke()

    # ------------------------------------------------------------ unload

    async def drain(self, inst: Instance, timeout_s: float | None = None) -> bool:
        """Stop routing to ``inst`` and wait for its in-flight requests; True if they drained."""
        inst.state = DRAINING
        self._dispatch(inst.name)  # its queued requests move to other replicas, or fail
        if inst.refs == 0 and inst.gate.active == 0:
            return True
        inst._drained = asyncio.Event()
        try:
            await asyncio.wait_for(inst._drained.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
