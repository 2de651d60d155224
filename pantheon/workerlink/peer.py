"""What the pool knows of one die's worker, and how that worker's messages change it.

A ``WorkerPeer`` holds the worker's state (starting | ready | dead), its process, the request
streams and load/unload waiters it owes answers to, and its latest ``Beat`` and ``Stats``.
``handle`` applies one message from it; ``fail`` ends everything that waits on it. Deciding
*that* a worker is dead, and counting deaths, is the pool's job (pool.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from pantheon.core import protocol as p
from pantheon.core.token_times import router_times
from pantheon.workerlink.errors import LoadFailedError, RequestRejectedError, WorkerDied
from pantheon.workerlink.link import Link
from pantheon.workerlink.process import WorkerProcess
from pantheon.workerlink.remote import RemoteProcess
from pantheon.workerlink.streams import RequestStream

log = logging.getLogger("pantheon.workerlink.pool")  # one logger for the whole link, as before


@dataclass(eq=False)
class WorkerPeer:
    """The pool's state for one die's worker."""

    die: str
    process: WorkerProcess | RemoteProcess  # RemoteProcess: a worker on another host
    link: Link
    state: str = "starting"  # starting | ready | dead
    hello: p.Hello | None = None
    hello_fut: asyncio.Future | None = None
    error: str | None = None  # why it is dead, once it is
    last_seen: float = 0.0  # monotonic time of its latest message of any kind
    beat: p.Beat | None = None
    last_stats: p.Stats | None = None
    streams: dict[str, RequestStream] = field(default_factory=dict)
    loads: dict[str, tuple[asyncio.Future, Callable | None]] = field(default_factory=dict)
    unloads: dict[str, list[asyncio.Future]] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)  # its output forwarder, its exit watcher
    ping_seq: itertools.count = field(default_factory=itertools.count)

    def send(self, msg: msgspec.Struct) -> None:
        """Send ``msg`` to the worker; dropped unless it is ready."""
        if self.state != "ready":  # nothing goes to a worker before its Hello, or after its death
            return
        self.link.send(self.die, msg)

    def ping(self) -> None:
        self.send(p.Ping(seq=next(self.ping_seq), sent_at=time.time()))

    def fail(self, reason: str) -> None:
        """It is dead: end its streams and fail its waiters with ``WorkerDied``, kill its process."""
        for stream in self.streams.values():
            stream.end_with(WorkerDied(self.die, reason))
        self.streams.clear()
        futs: list[asyncio.Future | None] = [f for f, _ in self.loads.values()]
        futs += [f for fs in self.unloads.values() for f in fs]
        futs.append(self.hello_fut)
        for fut in futs:
            if fut is not None and not fut.done():
                fut.set_exception(WorkerDied(self.die, reason))
        self.loads.clear()
        self.unloads.clear()
        self.process.kill()  # a silent worker may be wedged (inside a CUDA call): it must let go of the die

    def handle(self, msg: p.WorkerMsg) -> None:
        """Apply one message from the worker (all but ``Hello``, which the pool checks)."""
        if isinstance(msg, p.StepOutput):
            router_times.stamp("r", len(msg.tokens))
            for tok in msg.tokens:
                stream = self.streams.get(tok.request_id)
                if stream is None:
                    continue  # aborted here while the worker was still producing it
                if tok.finish is not None:
                    del self.streams[tok.request_id]
                    stream.end_with(tok)
                else:
                    stream.push(tok)
        elif isinstance(msg, p.Beat):
            self.beat = msg
        elif isinstance(msg, p.Stats):
            self.last_stats = msg
        elif isinstance(msg, p.Pong):
            pass  # last_seen is all a Pong is for
        elif self.state != "ready":
            log.warning("dropped %s from %s before its Hello", type(msg).__name__, self.die)
        elif isinstance(msg, p.EmbedOut):
            stream = self.streams.pop(msg.request_id, None)
            if stream is not None:
                stream.end_with(msg)
        elif isinstance(msg, p.Rejected):
            stream = self.streams.pop(msg.request_id, None)
            if stream is not None:
                stream.end_with(RequestRejectedError(msg.kind, msg.reason))
        elif isinstance(msg, p.LoadProgress):
            _, progress = self.loads.get(msg.instance, (None, None))
            if progress is not None:
                try:
                    progress(msg)
                except Exception:
                    log.exception("load progress callback failed")
        elif isinstance(msg, p.Loaded):
            fut, _ = self.loads.pop(msg.instance, (None, None))
            if fut is None or fut.done():
                log.warning("%s loaded on %s but nobody waits for it: unloading it", msg.instance, self.die)
                self.send(p.UnloadModel(instance=msg.instance))
            else:
                fut.set_result(msg)
        elif isinstance(msg, p.LoadFailed):
            fut, _ = self.loads.pop(msg.instance, (None, None))
            if fut is not None and not fut.done():
                fut.set_exception(LoadFailedError(msg.kind, msg.reason))
        elif isinstance(msg, p.Unloaded):
            for rid, stream in list(self.streams.items()):
                if stream.instance == msg.instance:
                    del self.streams[rid]
                    reason = f"instance {msg.instance!r} was unloaded while the request ran"
                    stream.end_with(RequestRejectedError("no_instance", reason))
            for fut in self.unloads.pop(msg.instance, []):
                if not fut.done():
                    fut.set_result(None)
