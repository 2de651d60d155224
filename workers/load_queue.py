"""The worker's loads: a queue of ``LoadModel`` run one at a time on a background thread.

A model that takes minutes to read never stalls heartbeats, pongs or the other instances'
decoding: the loader thread builds the ``Engine`` and hands it (or a ``LoadFailed``) back
through a queue; the main loop calls ``finish()`` every turn, which forwards the loader's
progress as ``LoadProgress`` (at most every ``PROGRESS_EVERY_S``, the final count always before
``Loaded``) and registers the engine with ``Instances``.

An unload of a model still loading cancels its job (``LoadFailed(cancelled)`` then
``Unloaded`` once the thread is done); one of a queued model drops it. A remote worker that
rejoins its router (``session`` counts its Hellos) drops the whole queue, and a load asked in an
earlier session ends silently.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec

from pantheon.core import protocol as p
from workers.devices import Die, engine_device
from workers.errors import LoadError
from workers.instances import Instances

if TYPE_CHECKING:  # the engine imports torch: the worker imports it on first use (engine_class)
    from workers.engine import Engine

log = logging.getLogger("pantheon.worker")

PROGRESS_EVERY_S = 0.1  # LoadProgress at most this often (it is called per tensor)


def engine_class() -> type[Engine]:
    """Import the engine on first use (and once before Hello, see ``LoadQueue.import_engine``)."""
    from workers.engine import Engine

    return Engine


@dataclass
class LoadJob:
    msg: p.LoadModel
    cancelled: bool = False
    session: int = 0  # the worker's session it was asked in (a remote worker's Hello count)


class LoadQueue:
    """Loads for ``die``, registered into ``instances``; ``send`` answers the router."""

    def __init__(self, die: Die, instances: Instances, send: Callable[[msgspec.Struct], None]):
        self.die, self.instances, self.send = die, instances, send
        self.queue: collections.deque[LoadJob] = collections.deque()
        self.loading: LoadJob | None = None  # the job the loader thread is running
        self.results: queue.Queue[tuple[LoadJob, Engine | p.LoadFailed]] = queue.Queue()
        self.progress: tuple[int, int] | None = None  # written by the loader thread
        self.sent_progress: tuple[int, int] | None = None
        self.last_progress_at = 0.0
        self.engine_import_error: str | None = None

    def import_engine(self) -> None:
        """Import the engine (and torch) now; a failure is kept and fails every load."""
        try:
            engine_class()
        except Exception:
            self.engine_import_error = traceback.format_exc(limit=3).strip()
            log.error("workers.engine failed to import:\n%s", self.engine_import_error)

    def pending(self) -> int:
        """Loads queued or running."""
        return len(self.queue) + (self.loading is not None)

    def add(self, msg: p.LoadModel, session: int) -> None:
        busy = {j.msg.instance for j in self.queue}
        if self.loading is not None:
            busy.add(self.loading.msg.instance)
        busy -= {j.msg.instance for j in (self.loading,) if j is not None and j.session != session}
        if msg.instance in self.instances or msg.instance in busy:
            reason = f"instance {msg.instance!r} is already loaded or loading on {self.die.id}"
            self.send(p.LoadFailed(instance=msg.instance, kind="invalid", reason=reason))
            return
        self.queue.append(LoadJob(msg, session=session))
        self._start_next()

    def cancel(self, name: str) -> bool:
        """Unloading ``name``: True when its load is running (``Unloaded`` follows when the
        thread ends); else drop it from the queue, if there, and return False."""
        if self.loading is not None and self.loading.msg.instance == name:
            self.loading.cancelled = True
            return True
        for job in list(self.queue):
            if job.msg.instance == name:
                self.queue.remove(job)
                self.send(p.LoadFailed(instance=name, kind="cancelled", reason="unloaded before loading"))
        return False

    def drop_all(self) -> None:
        """Forget the queue and cancel the running load (a remote worker's rejoin)."""
        self.queue.clear()
        if self.loading is not None:
            self.loading.cancelled = True  # its engine is closed when the loader thread ends

    def _start_next(self) -> None:
        if self.loading is not None or not self.queue:
            return
        job = self.loading = self.queue.popleft()
        self.progress = self.sent_progress = None
        log.info("loading %s from %s", job.msg.instance, job.msg.path)
        threading.Thread(target=self._load_thread, args=(job,), name="loader", daemon=True).start()

    def _load_thread(self, job: LoadJob) -> None:
        """Build the engine; hand the engine or a LoadFailed back to the main loop."""
        msg = job.msg
        t0 = time.monotonic()
        try:
            if self.engine_import_error:
                raise RuntimeError(f"workers.engine failed to import: {self.engine_import_error}")
            try:
                # the load message is the engine's spec, its dies named as torch names them
                devices = [engine_device(d) for d in msg.devices] or [self.die.torch_device]
                spec = msgspec.structs.replace(msg, devices=devices)
                result: Engine | p.LoadFailed = engine_class()(spec, progress=self._on_progress)
            except LoadError as e:
                result = p.LoadFailed(
                    instance=msg.instance, kind=cast(p.LoadFailKind, e.kind), reason=e.reason
                )
        except MemoryError as e:
            result = p.LoadFailed(
                instance=msg.instance, kind="out_of_memory", reason=str(e) or "out of memory"
            )
        except Exception as e:
            # torch.cuda.OutOfMemoryError is a RuntimeError; name it so the router can place elsewhere
            kind = "out_of_memory" if type(e).__name__ == "OutOfMemoryError" else "internal"
            log.error("loading %s failed:\n%s", msg.instance, traceback.format_exc())
            result = p.LoadFailed(instance=msg.instance, kind=kind, reason=f"{type(e).__name__}: {e}")
        log.info("load of %s ended after %.2f s", msg.instance, time.monotonic() - t0)
        self.results.put((job, result))

    def _on_progress(self, done: int, total: int) -> None:
        # Called in the loader thread for every tensor: only record it; the main loop sends.
        self.progress = (done, total)

    def finish(self, session: int) -> None:
        """Forward load progress, and turn a finished load into Loaded / LoadFailed."""
        try:
            job, result = self.results.get_nowait()
        except queue.Empty:
            self._send_progress(force=False)
            return
        self._send_progress(force=True)  # the router sees the final count before Loaded
        self.loading = None
        self.instances.trimmer.dirty = True  # the load's staging buffers are garbage now: trim when idle
        name = job.msg.instance
        if job.session != session:  # asked by a router we have since left: say nothing
            if not isinstance(result, p.LoadFailed):
                self.instances.close_engine(result)
        elif isinstance(result, p.LoadFailed):
            self.send(result)
        elif job.cancelled:
            self.instances.close_engine(result)
            self.send(p.LoadFailed(instance=name, kind="cancelled", reason="unloaded while loading"))
            self.send(p.Unloaded(instance=name))
        else:
            self.instances.register(name, result)
        self._start_next()

    def _send_progress(self, *, force: bool) -> None:
        job, prog = self.loading, self.progress
        if job is None or prog is None or prog == self.sent_progress:
            return
        now = time.monotonic()
        if force or now - self.last_progress_at >= PROGRESS_EVERY_S:
            self.send(p.LoadProgress(instance=job.msg.instance, done=prog[0], total=prog[1]))
            self.sent_progress, self.last_progress_at = prog, now
