"""Worker recovery: a worker that dies is restarted with backoff and its models are reloaded.

``Supervisor.worker_dead`` is the pool's ``on_worker_dead``. It first lets the lifecycle do what a
death means (``Models.worker_dead``: the die's instances become ``failed`` with the reason, their
bookings are returned; requests running on them end with a clean 503 ``worker_died`` error), then
starts a recovery task for the die:

1. wait ``restart_backoff * 2**k`` seconds (at most 30; ``k`` counts the die's deaths in the
   last ``RESTART_WINDOW_S``, ten minutes);
2. start the die's worker again (``Models.ensure_worker``); a worker that does not come up counts
   as another death;
3. reload every failed instance of that die in place, with the ``LoadModel`` it was loaded with:
   the same row and instance id (``loading`` while it uploads), its bookings taken again, then
   published; its ``restarts`` goes up by one, its ``error`` is cleared (it is ``ready``) and
   ``last_error`` / ``last_error_at`` keep the failure, so ``GET /admin/models`` shows both.

A die whose worker died more than ``--worker-restarts`` times within the window stays failed:
no more restarts, its instances stay ``failed``, a ``worker_failed`` event says why. (Counting
in a window, not "in a row": a death count reset by a clock that never ran let the limit
never trip.)

Requests and recovery: while an instance recovers and no ready replica serves its name, requests
for that name (queued ones, which the registry fails with ``model_not_ready`` when the last ready
replica goes, and new ones, which would otherwise be routed elsewhere by the single-model
shortcut) wait for it until the recovery ends (the model is back, or given up on; at most
``RECOVERY_WAIT_MAX_S``): ``await_recovery`` wraps the chat route's placement (fit the context,
acquire a slot). With another ready replica, the registry sends them there.

A frozen worker (SIGSTOP, a wedged host) is declared dead only when its heartbeat has been silent
for ``--worker-dead-after`` (30 s), the default queue timeout too. So that the requests queued
behind it wait for that death and the restart (as they do after a kill -9, noticed at once)
rather than time out with 429 ``queue_timeout`` just as it is declared, ``stalled(name)`` is the
registry's ``paused``: the queue timeout's clock of a model stands still while every ready
replica's worker has been silent for more than ``SUSPECT_S``, and while it restarts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pantheon import errors
from pantheon.control.dies import booked_of
from pantheon.core.protocol import die_host
from pantheon.errors import ApiError

log = logging.getLogger("pantheon.control.supervisor")

BACKOFF_MAX_S = 30.0
RESTART_WINDOW_S = 600.0  # --worker-restarts counts the deaths within this many seconds
SUSPECT_S = 2.0  # a worker silent this long (its beats come every 0.5 s) is not live
RECOVERY_WAIT_MAX_S = 600.0  # a request waits at most this long for its model's recovery


class Supervisor:
    def __init__(
        self,
        models: Any,
        registry: Any,
        pool: Any,
        *,
        max_restarts: int = 10,
        backoff_s: float = 0.5,
        metrics: Any = None,
        feed: Any = None,
        failed_dies: set[str] | None = None,
    ):
        self.models, self.registry, self.pool = models, registry, pool
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.metrics, self.feed = metrics, feed
        self.deaths: dict[str, int] = {}  # die -> its deaths within the window
        self._death_times: dict[str, collections.deque[float]] = {}
        # given up on: more deaths than --worker-restarts (a set the loads and the views share)
        self.failed_dies: set[str] = failed_dies if failed_dies is not None else set()
        self._given_up: dict[str, str] = {}  # die -> why it stays failed (what its requests are told)
        self._recovering: dict[str, Any] = {}  # instance id -> Instance, until it is back
        self._tasks: dict[str, asyncio.Task] = {}
        self._changed = asyncio.Event()  # set whenever a recovery ends (back or given up)
        self.closing = False
        if hasattr(registry, "paused"):  # the queue timeout stands still while a model is stalled
            registry.paused = self.stalled

    # ------------------------------------------------------------ deaths

    def worker_dead(self, die: str, reason: str) -> None:
        """The pool's ``on_worker_dead``: fail the die's instances, schedule the recovery."""
        before = {i.instance_id for i in self.registry.instances() if i.state == "failed"}
        self.models.worker_dead(die, reason)
        if self.metrics is not None:
            self.metrics.worker_died(die)
        failed = [
            i
            for i in self.registry.instances()
            if i.state == "failed"
            and i.die == die
            and (i.instance_id not in before or i.instance_id in self._recovering)
        ]
        if self.closing or self.max_restarts <= 0:
            return
        # a worker on another host is not ours to restart: it joins again by itself (after a
        # reboot, a network fault), and however often that happens we wait for it
        if self._count_death(die) > self.max_restarts and not die_host(die):
            self._give_up(die)
            return
        for inst in failed:
            self._recovering[inst.instance_id] = inst
        if die not in self._tasks or self._tasks[die].done():
            self._tasks[die] = asyncio.get_running_loop().create_task(
                self._recover(die), name=f"recover-{die}"
            )

    def _count_death(self, die: str) -> int:
        """Note a death of ``die``'s worker now; its deaths within the window."""
        now = time.monotonic()
        times = self._death_times.setdefault(die, collections.deque())
        times.append(now)
        while times and now - times[0] > RESTART_WINDOW_S:
            times.popleft()
        self.deaths[die] = len(times)
        return len(times)

    def _give_up(self, die: str) -> None:
        n = self.deaths.get(die, 0)
        log.error(
            "the worker of %s died %d times in %.0f min (--worker-restarts %d): the die stays failed",
            die,
            n,
            RESTART_WINDOW_S / 60,
            self.max_restarts,
        )
        self.failed_dies.add(die)
        why = f"the worker of {die} died {n} times in {RESTART_WINDOW_S / 60:.0f} min: no more restarts"
        self._event("worker_failed", why)
        self._given_up[die] = f"{why} (--worker-restarts {self.max_restarts})"
        for inst in self.registry.instances():  # what their requests are told from now on
            if inst.die == die and inst.state == "failed":
                inst.failed(self._given_up[die])
        for iid, inst in list(self._recovering.items()):
            if inst.die == die:
                del self._recovering[iid]
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------ recovery

    async def _recover(self, die: str) -> None:
        while not self.closing:
            n = self.deaths.get(die, 1)
            delay = min(BACKOFF_MAX_S, self.backoff_s * (2 ** (n - 1)))
            if die_host(die):
                delay = min(delay, self.backoff_s)  # we only wait for it: no reason to wait long
                log.warning("waiting for the remote worker of %s to join again", die)
            else:
                log.warning(
                    "restarting the worker of %s in %.1f s (death %d of at most %d)",
                    die,
                    delay,
                    n,
                    self.max_restarts,
                )
            await asyncio.sleep(delay)
            try:
                await self.models.ensure_worker(die)
            except Exception as e:  # noqa: BLE001 - a worker that does not start is a death
                if die_host(die):  # not joined again yet: wait on, counting nothing
                    log.warning("the remote worker of %s has not joined again yet", die)
                    continue
                log.error("the worker of %s did not restart: %s", die, e)
                if self.metrics is not None:
                    self.metrics.worker_died(die)
                if self._count_death(die) > self.max_restarts:
                    self._give_up(die)
                    return
                continue
            self._event(
                "worker_restarted",
                f"the worker of {die} joined again"
                if die_host(die)
                else f"the worker of {die} was restarted (attempt {n})",
            )
            todo = [i for i in self._recovering.values() if i.die == die]
            for inst in todo:
                await self._reload(inst)
            if not any(i.die == die for i in self._recovering.values()):
                return
            # a reload failed: a new death of the worker was counted by worker_dead; a load
            # that failed on a live worker counts here
            if any(d.die == die and d.alive for d in self.pool.dies()):
                self._count_death(die)
            if self.deaths.get(die, 0) > self.max_restarts and not die_host(die):
                self._give_up(die)
                return

    async def _reload(self, inst: Any) -> None:
        if inst not in self.registry.instances() or inst.state != "failed":
            self._recovering.pop(inst.instance_id, None)  # unloaded meanwhile
            self._wake()
            return
        msg, loaded = inst.load_msg, inst.loaded
        if msg is None:
            self._recovering.pop(inst.instance_id, None)
            self._wake()
            return
        dies = getattr(self.models, "dies", None)
        if dies is not None and inst.estimate is not None and loaded is not None:
            dies.book(inst.instance_id, booked_of(inst.estimate, inst.dies, loaded))
        inst.state, inst.load_progress = "loading", 0.0

        def progress(p) -> None:
            inst.load_progress = p.done / p.total if p.total else None

        upload = getattr(self.models, "_upload", None) or contextlib.nullcontext()
        try:
            async with upload:  # one upload at a time, as for admin loads
                new = await self.pool.load(inst.die, msg, progress)
        except Exception as e:  # noqa: BLE001 - reported on the instance, retried by _recover
            # a death during the reload may have been the one the die was given up on: then
            # that is what its requests are told (the reload's own error is logged below)
            given_up = self._given_up.get(inst.die) if inst.die in self.failed_dies else None
            inst.failed(given_up or f"reload after a worker death failed: {e}")
            if dies is not None:
                dies.release(inst.instance_id)
            log.error("reloading %s failed: %s", inst.instance_id, e)
            return
        if inst not in self.registry.instances():  # unloaded while it loaded
            with contextlib.suppress(Exception):
                await self.pool.unload(inst.die, inst.instance_id)
            self._recovering.pop(inst.instance_id, None)
            self._wake()
            return
        if dies is not None and inst.estimate is not None:
            dies.book(inst.instance_id, booked_of(inst.estimate, inst.dies, new))
        inst.restarts += 1
        self.registry.publish(inst, assets=inst.assets, loaded=new, max_model_len=new.max_model_len)
        self._recovering.pop(inst.instance_id, None)
        self._event(
            "loaded",
            f"{inst.instance_id} reloaded on {','.join(inst.dies)} after its "
            f"worker died (restart {inst.restarts})",
            inst,
        )
        log.info("%s is back on %s (restart %d)", inst.instance_id, inst.die, inst.restarts)
        self._wake()

    def _event(self, kind: str, message: str, inst: Any = None) -> None:
        if self.feed is None:
            return
        with contextlib.suppress(Exception):
            self.feed.event(
                kind, message, model=getattr(inst, "name", None), instance=getattr(inst, "instance_id", None)
            )

    # ------------------------------------------------------------ requests

    def recovering(self, name: str | None) -> bool:
        """Would a request naming ``name`` be served by an instance now recovering (and by no
        ready replica)?"""
        if not self._recovering:
            return False
        ready = self.registry.ready()
        if not ready:
            return True
        if name and any(i.name == name for i in self._recovering.values()):
            return not any(i.name == name for i in ready)
        return False

    def _silent_s(self, die: str) -> float:
        """Seconds since anything came from ``die``'s ready worker; 0 when it is not ready or
        the pool does not say."""
        workers = getattr(self.pool, "_workers", None)
        w = workers.get(die) if isinstance(workers, dict) else None
        last = getattr(w, "last_seen", 0.0)
        if w is None or getattr(w, "state", "") != "ready" or not isinstance(last, (int, float)) or not last:
            return 0.0
        return max(0.0, time.monotonic() - last)

    def _restarting(self, name: str | None) -> bool:
        """Is a recovery of ``name`` under way that this router drives (a local worker being
        restarted), rather than a wait for a remote worker that an operator must bring back?"""
        return any(
            (name is None or i.name == name) and not any(die_host(d) for d in i.dies)
            for i in self._recovering.values()
        )

    def stalled(self, name: str) -> bool:
        """Does model ``name`` lack a live worker for now: every ready replica's worker silent
        for more than ``SUSPECT_S`` (frozen, about to be declared dead), or no ready replica and
        one recovering? The registry's ``paused``: its queue timeout stands still meanwhile."""
        if self.closing:
            return False
        insts = [i for i in self.registry.instances() if i.name == name]
        ready = [i for i in insts if i.state == "ready"]
        if ready:
            return all(self._silent_s(i.die) > SUSPECT_S for i in ready)
        return self._restarting(name)  # a remote worker gone: the queue's clock runs

    async def await_recovery(
        self, place: Callable[[], Awaitable[Any]], name: str | None, timeout_s: float
    ) -> Any:
        """``await place()``, but while the model it names is recovering, wait for it first
        (and again when a queued request is failed by the death): until a restart this router
        drives ends (at most ``timeout_s + RECOVERY_WAIT_MAX_S`` in all), or for the queue
        timeout while it waits for a remote worker to join again (nobody here can restart it:
        a 503 then, as before). The queue timeout (``timeout_s``) is the registry's, and its
        clock stands still while the model is ``stalled``."""
        start = time.monotonic()
        while True:
            while self.recovering(name):
                limit = timeout_s + RECOVERY_WAIT_MAX_S if self._restarting(name) else timeout_s
                left = start + limit - time.monotonic()
                if left <= 0:
                    raise errors.model_recovering(name, limit)
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, 1.0))
            try:
                return await place()
            except ApiError as e:
                limit = timeout_s + RECOVERY_WAIT_MAX_S if self._restarting(name) else timeout_s
                # its last replica died while it queued (no replica ready, or every one failed,
                # which routing calls model_failed): while a restart is under way, wait for it
                if (
                    e.code in ("model_not_ready", "model_failed")
                    and self.recovering(name)
                    and time.monotonic() < start + limit
                ):
                    continue
                raise

    async def close(self) -> None:
        self.closing = True
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._recovering.clear()
        self._wake()
