"""The router's side of the router <-> worker link: spawn, talk to and supervise one worker per die.

``WorkerPool`` is the facade the rest of the router uses. Its parts live next to it:

* ``link.py``: the one ROUTER socket every worker talks to, and the liveness verdict;
* ``peer.py``: the pool's state for one worker, and how its messages change it;
* ``process.py``: a worker's process (argv, environment, output, exit codes);
* ``streams.py``: the per-request token streams ``submit`` returns;
* ``errors.py``: the errors raised here (re-exported by this module).

Three kinds of asyncio task run here, all on the router's event loop:

* one reader that receives every worker message and fans it out: tokens to the per-request queue
  of their ``RequestStream`` (unbounded, so a slow HTTP client never holds the reader up), load and
  unload replies to the futures waiting for them, ``Stats`` into the die's snapshot;
* one heartbeat that pings every worker each ``heartbeat_interval`` and judges it by its
  ``Beat`` (sent by a thread of the worker's own, every 0.5 s, whatever the model computes): a
  worker is dead when its beats stop for ``dead_after`` seconds (the whole process is frozen)
  or one turn of its loop, a step, has run longer than ``step_timeout`` (it hangs). A long step
  is not silence: the beats say how long it has run (``link.verdict``);
* per worker, one task that forwards its stdout/stderr to ours (keeping the last lines for error
  messages) and one that waits for the process to exit, so a crash is noticed at once.

A dead worker fails everything that waits on it with ``WorkerDied``; the pool itself stays up and
the die can be started again with ``start_worker``. This package never imports torch.

With ``remote_listen`` the pool also binds a TCP socket for workers on other hosts
(``remote.py``): one reader per socket, and a worker that joins there by saying ``Hello`` as
``cpu:N@NAME`` / ``cuda:N@NAME`` becomes a die like the others (``_on_join``).

Why ~430 lines: it is the facade's public methods (start, load, unload, submit, abort,
reset, dies) and the reader and heartbeat tasks that serve them; everything else is split out
already (``link``, ``peer``, ``process``, ``streams``, ``errors``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from pantheon.core import protocol as p
from pantheon.workerlink.errors import (
    LoadFailedError,
    PoolError,
    RequestRejectedError,
    WorkerDied,
    WorkerStartError,
)
from pantheon.workerlink.link import Link, verdict
from pantheon.workerlink.peer import WorkerPeer
from pantheon.workerlink.process import WorkerProcess, describe_exit, reap, worker_argv
from pantheon.workerlink.remote import RemoteLink, RemoteProcess
from pantheon.workerlink.streams import RequestStream

__all__ = [
    "DieInfo",
    "LoadFailedError",
    "PoolError",
    "RequestRejectedError",
    "RequestStream",
    "WorkerDied",
    "WorkerPool",
    "WorkerStartError",
]

log = logging.getLogger("pantheon.workerlink.pool")

_SHUTDOWN_GRACE_S = 3.0


@dataclass(frozen=True)
class DieInfo:
    """A snapshot of one die and its worker."""

    die: str
    device_name: str
    total_bytes: int
    free_bytes: int
    pid: int | None
    alive: bool
    last_stats: p.Stats | None
    error: str | None  # why the worker is dead, when it is
    cpu_isa: str = ""  # CPU dies: from Hello (see protocol.Hello)
    cpu_paths: dict[str, str] = field(default_factory=dict)
    attention: str = ""  # CPU dies: the decode-attention kernel's state (protocol.Hello)
    linear: str = ""  # CPU dies: the quantized linear kernel's state (protocol.Hello)
    deaths: int = 0  # times this die's worker died since the pool started
    restarts: int = 0  # times it was started again after a death
    last_death: str | None = None  # the reason of the latest death (kept after a restart)
    last_death_at: float | None = None  # unix time of it
    beat: p.Beat | None = None  # the latest heartbeat
    host: str = ""  # a remote worker's name (the die id's "@NAME"); "" for one we spawned
    hostname: str = ""  # the machine it runs on, as it said in Hello


class WorkerPool:
    """Spawns and supervises one worker process per die, over one zmq ROUTER socket (asyncio).

    ``worker_command`` is the argv prefix that starts a worker (default
    ``[sys.executable, "-m", "workers.worker"]``); the pool appends ``--die``, ``--endpoint``,
    ``--parent-pid`` and, when set, ``--budget-bytes``, ``--threads``, ``--router-timeout``.
    """

    def __init__(
        self,
        *,
        runtime_dir: str | None = None,
        hello_timeout: float = 60.0,
        heartbeat_interval: float = 1.0,
        dead_after: float = 30.0,
        step_timeout: float = 300.0,
        worker_threads: int | None = None,
        on_worker_dead: Callable[[str, str], None] | None = None,
        worker_command: list[str] | None = None,
        remote_listen: str | None = None,
        curve_dir: str | None = None,
    ):
        self.hello_timeout = hello_timeout
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self.step_timeout = step_timeout
        self._deaths: collections.Counter[str] = collections.Counter()
        self._starts: collections.Counter[str] = collections.Counter()
        self._last_death: dict[str, tuple[str, float]] = {}
        self.worker_threads = worker_threads
        self.on_worker_dead = on_worker_dead
        self.worker_command = list(worker_command or [sys.executable, "-m", "workers.worker"])
        # 0: our workers leave when our pid is gone (--parent-pid), never for our silence, which
        # a busy event loop can cause without anything being wrong
        self.worker_router_timeout = 0.0
        self._link = Link(runtime_dir)
        # workers on other hosts: tcp://, CURVE with curve_dir (checked by curve.check_listen)
        self._remote = RemoteLink(remote_listen, curve_dir) if remote_listen else None
        self.on_worker_joined: Callable[[str], None] | None = None
        self._joined = asyncio.Event()  # set (and replaced) whenever a remote worker joins
        self._workers: dict[str, WorkerPeer] = {}
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    @property
    def runtime_dir(self) -> str | None:
        """The private directory (mode 0700) that holds the socket; None before ``start``."""
        return self._link.runtime_dir

    @property
    def endpoint(self) -> str | None:
        """The ``ipc://`` endpoint the workers connect to; None before ``start``."""
        return self._link.endpoint

    @property
    def remote_endpoint(self) -> str | None:
        """The ``tcp://`` endpoint remote workers connect to; None without ``remote_listen``."""
        return self._remote.endpoint if self._remote is not None else None

    async def __aenter__(self) -> WorkerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Bind the ROUTER socket in a fresh private directory and start the reader and heartbeat."""
        self._link.open()
        self._tasks = [
            asyncio.create_task(self._read_loop(self._link), name="workerpool-reader"),
            asyncio.create_task(self._heartbeat_loop(), name="workerpool-heartbeat"),
        ]
        if self._remote is not None:
            try:
                self._remote.open()
            except PoolError:
                await self.close()
                raise
            self._tasks.append(asyncio.create_task(self._read_loop(self._remote), name="workerpool-remote"))

    async def start_worker(self, die: str, *, budget_bytes: int | None = None) -> DieInfo:
        """Spawn the worker for ``die`` and wait for its Hello (up to ``hello_timeout``).

        A die whose worker died may be started again. Raises ``WorkerStartError`` with what to
        check, ``ValueError`` for a bad die id or one whose worker is not dead.

        A die on another host (``cpu:0@NAME``) is not spawned: this waits for its worker to join.
        """
        if not self._link.is_open or self._closing:
            raise PoolError("the worker pool is not running (call start() first)")
        die = p.normalize_die(die)  # ValueError: bad die ...
        if p.die_host(die):
            return await self.wait_joined(die, self.hello_timeout)
        old = self._workers.get(die)
        if old is not None and old.state != "dead":
            raise ValueError(f"a worker for {die} is already {old.state}")
        if old is not None and old.process.proc is not None:
            await old.process.wait()  # it was killed when declared dead; let it release the die

        assert self.endpoint is not None  # bound by start()
        argv = worker_argv(
            self.worker_command,
            die,
            endpoint=self.endpoint,
            router_timeout=self.worker_router_timeout,
            budget_bytes=budget_bytes,
            threads=self.worker_threads,
        )
        hello_fut = asyncio.get_running_loop().create_future()
        proc = WorkerProcess(die, argv)
        w = WorkerPeer(die=die, process=proc, link=self._link, hello_fut=hello_fut)
        self._workers[die] = w
        self._starts[die] += 1
        try:
            await proc.spawn()
        except OSError as e:
            w.state, w.error = "dead", f"could not spawn: {e}"
            raise WorkerStartError(proc.start_help(f"could not be spawned ({e})", self.endpoint)) from e
        exit_watch = asyncio.create_task(self._watch_exit(w, proc), name=f"worker-exit-{die}")
        w.tasks = [t for t in (proc.output_task, exit_watch) if t is not None]
        try:
            await asyncio.wait_for(hello_fut, self.hello_timeout)
        except TimeoutError:
            what = f"it sent no Hello within {self.hello_timeout:g} s"
            if proc.running:
                what += f" (pid {proc.pid} was still running; it has been killed)"
            self._declare_dead(w, what)
            await proc.settle()
            raise WorkerStartError(proc.start_help(what, self.endpoint)) from None
        except PoolError as e:
            await proc.settle()
            raise WorkerStartError(proc.start_help(getattr(e, "reason", str(e)), self.endpoint)) from None
        except asyncio.CancelledError:
            self._declare_dead(w, "start cancelled")
            raise
        return self._info(w)

    async def wait_joined(self, die: str, timeout: float | None) -> DieInfo:
        """Wait until the remote worker of ``die`` has joined (said Hello); ``WorkerStartError``
        after ``timeout`` seconds (None: no limit)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            w = self._workers.get(die)
            if w is not None and w.state == "ready":
                return self._info(w)
            if self._remote is None:
                raise WorkerStartError(
                    f"{die} is the die of a worker on another host, and this router takes none "
                    "(start it with --worker-listen tcp://HOST:PORT)"
                )
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise WorkerStartError(
                    f"no worker joined as {die} within {timeout:g} s (start it on its host with "
                    f"'pantheon worker --router {self.remote_endpoint} --die {die.partition('@')[0]} "
                    f"--name {p.die_host(die)} ...')"
                )
            joined = self._joined
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(joined.wait(), left)

    async def close(self) -> None:
        """Shut every worker down (Shutdown, ~3 s grace, then SIGKILL) and remove the runtime dir.
        Remote workers are told nothing: they wait for the next router."""
        if self._closing:
            return
        self._closing = True
        for w in self._workers.values():
            if w.state == "ready" and not w.link.remote:
                w.send(p.Shutdown())
        await reap(
            [w.process for w in self._workers.values() if isinstance(w.process, WorkerProcess)],
            _SHUTDOWN_GRACE_S,
        )
        for w in self._workers.values():
            self._declare_dead(w, "the worker pool was closed")
        tasks = self._tasks + [t for w in self._workers.values() for t in w.tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._link.close()
        if self._remote is not None:
            self._remote.close()

    # ------------------------------------------------------------------ requests and models

    async def load(
        self, die: str, msg: p.LoadModel, progress: Callable[[p.LoadProgress], None] | None = None
    ) -> p.Loaded:
        """Load a model on ``die``'s worker. Raises ``LoadFailedError(kind, reason)`` or ``WorkerDied``.

        ``progress`` is called with each ``LoadProgress`` (a few times a second at most).
        """
        w = self._ready(die)
        if msg.instance in w.loads:
            raise ValueError(f"instance {msg.instance!r} is already being loaded on {die}")
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, progress)
        w.loads[msg.instance] = entry
        w.send(msg)
        try:
            return await fut
        finally:
            # When the caller gave up (cancelled), a later Loaded finds no waiter and is unloaded.
            if w.loads.get(msg.instance) is entry:
                del w.loads[msg.instance]

    async def unload(self, die: str, instance: str) -> None:
        """Unload an instance and wait until the worker has freed its memory. Raises ``WorkerDied``.

        Requests still running on it end with ``RequestRejectedError("no_instance", ...)``.
        """
        w = self._ready(die)
        fut = asyncio.get_running_loop().create_future()
        w.unloads.setdefault(instance, []).append(fut)
        w.send(p.UnloadModel(instance=instance))
        await fut

    def submit(self, die: str, msg: p.Submit | p.EmbedRequest) -> RequestStream:
        """Send a request (a generation, or an embedding: its stream's ``result()``) to ``die``'s
        worker; raises ``WorkerDied`` at once if that worker is dead."""
        w = self._ready(die)
        if msg.request_id in w.streams:
            raise ValueError(f"request id {msg.request_id!r} is already running on {die}")
        stream = RequestStream(die, msg.request_id, msg.instance, on_abort=self._stream_aborted)
        w.streams[msg.request_id] = stream
        w.send(msg)
        return stream

    def abort(self, die: str, request_ids: list[str]) -> None:
        """Abort requests; their streams end (without a finish token). Unknown ids are ignored."""
        w = self._workers.get(die)
        if w is None:
            return
        for rid in request_ids:
            stream = w.streams.pop(rid, None)
            if stream is not None:
                stream.end_here()
        self._send_abort(die, request_ids)

    def dies(self) -> list[DieInfo]:
        return [self._info(w) for w in self._workers.values()]

    def stats(self, die: str) -> p.Stats | None:
        w = self._workers.get(die)
        return w.last_stats if w is not None else None

    def reset_cache(self, die: str, instance: str | None = None) -> None:
        """Tell ``die``'s worker to forget the cached prefixes of ``instance`` (all when None).
        Raises ``WorkerDied`` if that worker is dead."""
        self._ready(die).send(p.ResetCache(instance=instance))

    # ------------------------------------------------------------------ internals

    def _ready(self, die: str) -> WorkerPeer:
        w = self._workers.get(die)
        if w is None:
            raise KeyError(f"no worker was started for die {die!r}")
        if w.state != "ready":
            raise WorkerDied(die, w.error or f"the worker is still {w.state}")
        return w

    def _info(self, w: WorkerPeer) -> DieInfo:
        h, s = w.hello, w.last_stats
        return DieInfo(
            die=w.die,
            device_name=h.device_name if h else "",
            total_bytes=s.total_bytes if s else (h.total_bytes if h else 0),
            free_bytes=s.free_bytes if s else (h.free_bytes if h else 0),
            pid=h.pid if h else w.process.pid,
            alive=w.state == "ready",
            last_stats=s,
            error=w.error,
            cpu_isa=h.cpu_isa if h else "",
            cpu_paths=dict(h.cpu_paths) if h else {},
            attention=h.attention if h else "",
            linear=h.linear if h else "",
            deaths=self._deaths[w.die],
            restarts=max(0, self._starts[w.die] - 1),
            last_death=self._last_death.get(w.die, (None, None))[0],
            last_death_at=self._last_death.get(w.die, (None, None))[1],
            beat=w.beat,
            host=p.die_host(w.die),
            hostname=h.hostname if h else "",
        )

    def _send_abort(self, die: str, request_ids: list[str]) -> None:
        w = self._workers.get(die)
        if w is not None and request_ids:
            w.send(p.Abort(request_ids=list(request_ids)))

    def _stream_aborted(self, stream: RequestStream) -> None:
        """``RequestStream.abort``'s part here: forget the stream, tell its worker."""
        w = self._workers.get(stream.die)
        if w is not None and w.streams.get(stream.request_id) is stream:
            del w.streams[stream.request_id]
        self._send_abort(stream.die, [stream.request_id])

    def _declare_dead(self, w: WorkerPeer, reason: str) -> None:
        """Fail everything that waits on ``w``, kill its process, tell ``on_worker_dead``."""
        if w.state == "dead":
            return
        was_ready = w.state == "ready"
        w.state, w.error = "dead", reason
        if not self._closing:  # a worker that dies while it starts counts too
            self._deaths[w.die] += 1
            self._last_death[w.die] = (reason, time.time())
        if was_ready and not self._closing:
            log.error("worker for %s is dead: %s", w.die, reason)
        w.fail(reason)
        if was_ready and not self._closing and self.on_worker_dead is not None:
            try:
                self.on_worker_dead(w.die, reason)
            except Exception:
                log.exception("on_worker_dead(%r) failed", w.die)

    async def _watch_exit(self, w: WorkerPeer, proc: WorkerProcess) -> None:
        rc = await proc.wait()
        if w.state == "dead":
            return
        await proc.output_done()  # let the last lines (a traceback) arrive
        # A worker that never said Hello gets its whole output in start_worker's message instead.
        tail = ""
        if w.state == "ready" and proc.output:
            tail = "; last output: " + " | ".join(list(proc.output)[-5:])
        self._declare_dead(w, f"the worker process (pid {proc.pid}) {describe_exit(rc)}{tail}")

    async def _read_loop(self, link: Link) -> None:
        """The task that receives from one link; it must never stop on a bad message."""
        while True:
            die, data = await link.receive()
            try:
                msg = p.decode_worker_msg(data)
            except msgspec.DecodeError as e:  # a kind outside its Literal fails here too
                log.error("dropped a message from %s that does not decode: %s", die, e)
                continue
            w = self._workers.get(die)
            if w is not None and w.link is not link:
                continue  # a die id of the other link's (a remote name never is a local one)
            if link.remote and isinstance(msg, p.Hello):
                w = self._remote_peer(die, msg, w)  # a worker joins (or joins again) by Hello
            if w is None or w.state == "dead":
                continue  # an unknown peer, or late words of a worker already declared dead
            w.last_seen = time.monotonic()
            try:
                if isinstance(msg, p.Hello):
                    self._on_hello(w, msg)
                else:
                    w.handle(msg)
            except Exception:
                log.exception("handling %s from %s failed", type(msg).__name__, w.die)

    def _remote_peer(self, die: str, msg: p.Hello, w: WorkerPeer | None) -> WorkerPeer | None:
        """A ``Hello`` on the remote link from ``die`` (unknown, dead or ready): a fresh peer
        that ``_on_hello`` will make ready, or None for a die id a remote worker may not have."""
        try:
            ok = p.die_host(die) != "" and p.normalize_die(die) == die
        except ValueError:
            ok = False
        if not ok:
            log.error(
                "refused a remote worker that calls itself %r: a remote die is cpu:N@NAME or cuda:N@NAME",
                die,
            )
            return None
        if w is not None and w.state != "dead":
            # it said Hello again: it restarted, or it heard no Ping from us for its
            # --router-timeout and dropped its models; what ran there is gone
            self._declare_dead(w, "it registered again (it restarted, or lost touch with the router)")
        self._starts[die] += 1
        assert self._remote is not None  # only its reader calls this
        fut = asyncio.get_running_loop().create_future()
        peer = WorkerPeer(die=die, process=RemoteProcess(die, msg.pid), link=self._remote, hello_fut=fut)
        self._workers[die] = peer
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() or self._on_join(die))
        return peer

    def _on_join(self, die: str) -> None:
        w = self._workers[die]
        log.info(
            "remote worker %s joined from %s (%s, pid %s)",
            die,
            w.hello.hostname if w.hello else "?",
            w.hello.device_name if w.hello else "?",
            w.process.pid,
        )
        self._joined.set()
        self._joined = asyncio.Event()
        if self.on_worker_joined is not None:
            try:
                self.on_worker_joined(die)
            except Exception:
                log.exception("on_worker_joined(%r) failed", die)

    def _on_hello(self, w: WorkerPeer, msg: p.Hello) -> None:
        if w.state != "starting":
            log.warning("ignored a second Hello from %s", w.die)
            return
        if msg.version != p.PROTOCOL_VERSION or msg.die != w.die:
            self._declare_dead(
                w,
                f"its Hello (die {msg.die!r}, protocol {msg.version}) does not match "
                f"(die {w.die!r}, protocol {p.PROTOCOL_VERSION}): is it the same pantheon version?",
            )
            return
        w.hello, w.state = msg, "ready"
        w.ping()  # starts its silence clock fresh
        if w.hello_fut is not None and not w.hello_fut.done():
            w.hello_fut.set_result(msg)

    async def _heartbeat_loop(self) -> None:
        """Ping every ready worker; declare dead one whose ``link.verdict`` says so."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            # If our own loop was stalled, the workers' messages still wait in the socket, unread:
            # judge no one this round. (Not zmq.EVENTS: reading it can eat the reader's wake-up.)
            stalled = now - last > self.heartbeat_interval + self.dead_after / 2
            last = now
            for w in [w for w in self._workers.values() if w.state == "ready"]:
                try:
                    why = (
                        None
                        if stalled
                        else verdict(
                            silent_s=now - w.last_seen,
                            beat=w.beat,
                            pid=w.hello.pid if w.hello is not None else None,
                            dead_after=self.dead_after,
                            step_timeout=self.step_timeout,
                            remote=w.link.remote,
                        )
                    )
                    if why is not None:
                        self._declare_dead(w, why)
                    else:
                        w.ping()
                except Exception:  # the heartbeat must go on for the other workers
                    log.exception("heartbeat for %s failed", w.die)
