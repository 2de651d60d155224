"""The router's side of the router <-> worker link: spawn, talk to and supervise one worker per die.

One ``zmq.ROUTER`` socket, bound on ``ipc://`` inside a private runtime directory (mode 0700), carries
every worker's traffic; a worker's DEALER identity is its die id. Three kinds of asyncio task run
here, all on the router's event loop:

* one reader that receives every worker message and fans it out: tokens to the per-request queue
  of their ``RequestStream`` (unbounded, so a slow HTTP client never holds the reader up), load and
  unload replies to the futures waiting for them, ``Stats`` into the die's snapshot;
* one heartbeat that pings every worker each ``heartbeat_interval`` and judges it by its
  ``Beat`` (sent by a thread of the worker's own, every 0.5 s, whatever the model computes): a
  worker is dead when its beats stop for ``dead_after`` seconds (the whole process is frozen)
  or one turn of its loop, a step, has run longer than ``step_timeout`` (it hangs). A long step
  is not silence: the beats say how long it has run;
* per worker, one task that forwards its stdout/stderr to ours (keeping the last lines for error
  messages) and one that waits for the process to exit, so a crash is noticed at once.

A dead worker fails everything that waits on it with ``WorkerDied``; the pool itself stays up and
the die can be started again with ``start_worker``. This module never imports torch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import re
import shlex
import shutil
import signal
import site
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from pantheon import protocol as p

log = logging.getLogger("pantheon.workerlink.pool")

_DIE_RE = re.compile(r"^(cpu|cuda):\d+$")
_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin
_OUTPUT_LINES = 40  # the last lines of a worker's output kept for error messages
_SHUTDOWN_GRACE_S = 3.0
# What the worker's own exit codes mean (see workers.worker.EXIT_*).
_EXIT_MEANING = {
    2: "bad arguments or a die this machine does not have",
    3: "it heard nothing from the router for too long",
    4: "its parent process went away",
}


class PoolError(Exception):
    """Base class of the errors this module raises."""


class WorkerStartError(PoolError):
    """A worker did not come up (did not spawn, exited, or sent no Hello in time)."""


class WorkerDied(PoolError):
    """The worker that owned a request, a load or an unload died (or was declared dead)."""

    def __init__(self, die: str, reason: str):
        super().__init__(f"worker for {die} died: {reason}")
        self.die = die
        self.reason = reason


class LoadFailedError(PoolError):
    """The worker could not load a model. ``kind``: not_found | unsupported | invalid | out_of_memory
    | internal | cancelled."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class RequestRejectedError(PoolError):
    """The worker would not run a request. ``kind``: context_length | no_instance | invalid | duplicate."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


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
    deaths: int = 0  # times this die's worker died since the pool started
    restarts: int = 0  # times it was started again after a death
    last_death: str | None = None  # the reason of the latest death (kept after a restart)
    last_death_at: float | None = None  # unix time of it
    beat: p.Beat | None = None  # the latest heartbeat


_END = object()  # queued into a RequestStream to end it without a finish token (abort)


class RequestStream:
    """Async iterator over ``TokenOut`` for one request; ends after the TokenOut whose finish is set.

    Raises ``RequestRejectedError(kind, reason)`` if the worker rejected the request and
    ``WorkerDied`` if its worker died. Made by ``WorkerPool.submit``.
    """

    def __init__(self, pool: WorkerPool, die: str, request_id: str, instance: str):
        self.die = die
        self.request_id = request_id
        self.instance = instance
        self._pool = pool
        self._items: collections.deque = collections.deque()  # TokenOut | PoolError | _END
        self._ready = asyncio.Event()
        self._open = True  # the worker may still send for it (registered with the pool)
        self._done = False  # the consumer has seen the end

    # ---- fed by the pool's reader

    def _put(self, item) -> None:
        self._items.append(item)
        self._ready.set()

    def _close(self, item) -> None:
        """The last item this stream gets: a finish token, an error or _END."""
        self._open = False
        self._put(item)

    # ---- read by the consumer

    def __aiter__(self) -> RequestStream:
        return self

    async def _wait(self) -> None:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()

    def _take_end(self, item) -> None:
        """Consume an item that ends the stream: raise it if it is an error."""
        self._done = True
        if isinstance(item, BaseException):
            raise item

    async def __anext__(self) -> p.TokenOut:
        if self._done:
            raise StopAsyncIteration
        await self._wait()
        item = self._items.popleft()
        if isinstance(item, p.TokenOut):
            self._done = item.finish is not None
            return item
        self._take_end(item)
        raise StopAsyncIteration

    async def next_batch(self) -> list[p.TokenOut]:
        """Wait for at least one token, then return every token that has arrived.

        Returns ``[]`` once the stream has ended; raises like ``__anext__``. An error that
        arrived behind some tokens is raised on the next call, after those tokens.
        """
        if self._done:
            return []
        await self._wait()
        out: list[p.TokenOut] = []
        while self._items and not self._done:
            item = self._items[0]
            if isinstance(item, p.TokenOut):
                self._items.popleft()
                out.append(item)
                self._done = item.finish is not None
            elif out:
                break
            else:
                self._items.popleft()
                self._take_end(item)
        return out

    def abort(self) -> None:
        """Stop the request. Idempotent; sends ``Abort`` unless the request already ended."""
        if not self._open:
            return
        self._pool._forget_stream(self)
        self._end_here()
        self._pool._send_abort(self.die, [self.request_id])

    def _end_here(self) -> None:
        """End the stream on this side: drop what has not been read, then stop."""
        self._items.clear()
        self._close(_END)


@dataclass(eq=False)
class _Worker:
    """The pool's state for one die's worker process."""

    die: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    state: str = "starting"  # starting | ready | dead
    hello: p.Hello | None = None
    hello_fut: asyncio.Future | None = None
    error: str | None = None
    last_seen: float = 0.0
    beat: p.Beat | None = None
    last_stats: p.Stats | None = None
    output: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_OUTPUT_LINES))
    streams: dict[str, RequestStream] = field(default_factory=dict)
    loads: dict[str, tuple[asyncio.Future, Callable | None]] = field(default_factory=dict)
    unloads: dict[str, list[asyncio.Future]] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)
    ping_seq: itertools.count = field(default_factory=itertools.count)

    @property
    def ident(self) -> bytes:
        return self.die.encode()


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    meaning = _EXIT_MEANING.get(rc)
    return f"exited with code {rc}" + (f" ({meaning})" if meaning else "")


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
        # A worker leaves when the router is silent this long; pings come every heartbeat_interval.
        self.worker_router_timeout = max(10.0, 10 * heartbeat_interval)
        self._runtime_parent = runtime_dir
        self.runtime_dir: str | None = None
        self.endpoint: str | None = None
        self._workers: dict[str, _Worker] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    async def __aenter__(self) -> WorkerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Bind the ROUTER socket in a fresh private directory and start the reader and heartbeat."""
        # mkdtemp makes it mode 0700: only our user can reach the socket inside.
        self.runtime_dir = tempfile.mkdtemp(prefix="pantheon-", dir=self._runtime_parent)
        path = os.path.join(self.runtime_dir, "router.sock")
        if len(path) > _MAX_IPC_PATH:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            raise PoolError(f"socket path {path!r} is too long for ipc://; pass a shorter runtime_dir")
        self.endpoint = f"ipc://{path}"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop a message to a slow worker
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its die id back
        self._sock.bind(self.endpoint)
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="workerpool-reader"),
            asyncio.create_task(self._heartbeat_loop(), name="workerpool-heartbeat"),
        ]

    async def start_worker(self, die: str, *, budget_bytes: int | None = None) -> DieInfo:
        """Spawn the worker for ``die`` and wait for its Hello (up to ``hello_timeout``).

        A die whose worker died may be started again. Raises ``WorkerStartError`` with what to check.
        """
        if self._sock is None or self._closing:
            raise PoolError("the worker pool is not running (call start() first)")
        if die.isdigit():
            die = f"cuda:{die}"
        if not _DIE_RE.match(die):
            raise ValueError(f"bad die {die!r}: expected cpu:N or cuda:N")
        old = self._workers.get(die)
        if old is not None and old.state != "dead":
            raise ValueError(f"a worker for {die} is already {old.state}")
        if old is not None and old.proc is not None:
            await old.proc.wait()  # it was killed when declared dead; let it release the die

        argv = [*self.worker_command, "--die", die, "--endpoint", self.endpoint, "--parent-pid", str(os.getpid())]
        argv += ["--router-timeout", str(self.worker_router_timeout)]
        if budget_bytes is not None:
            argv += ["--budget-bytes", str(int(budget_bytes))]
        if self.worker_threads:
            argv += ["--threads", str(self.worker_threads)]
        w = _Worker(die=die, argv=argv, hello_fut=asyncio.get_running_loop().create_future())
        self._workers[die] = w
        self._starts[die] += 1
        try:
            w.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=self._worker_env(),
                limit=1 << 20,
            )
        except OSError as e:
            w.state, w.error = "dead", f"could not spawn: {e}"
            raise WorkerStartError(self._start_help(w, f"could not be spawned ({e})")) from e
        w.tasks = [
            asyncio.create_task(self._forward_output(w), name=f"worker-output-{die}"),
            asyncio.create_task(self._watch_exit(w), name=f"worker-exit-{die}"),
        ]
        try:
            await asyncio.wait_for(w.hello_fut, self.hello_timeout)
        except TimeoutError:
            what = f"it sent no Hello within {self.hello_timeout:g} s"
            if w.proc.returncode is None:
                what += f" (pid {w.proc.pid} was still running; it has been killed)"
            self._declare_dead(w, what)
            await self._settle(w)
            raise WorkerStartError(self._start_help(w, what)) from None
        except PoolError as e:
            await self._settle(w)
            raise WorkerStartError(self._start_help(w, getattr(e, "reason", str(e)))) from None
        except asyncio.CancelledError:
            self._declare_dead(w, "start cancelled")
            raise
        return self._info(w)

    async def close(self) -> None:
        """Shut every worker down (Shutdown, ~3 s grace, then SIGKILL) and remove the runtime dir."""
        if self._closing:
            return
        self._closing = True
        for w in self._workers.values():
            if w.state == "ready":
                self._send(w, p.Shutdown())
        procs = [w.proc for w in self._workers.values() if w.proc is not None and w.proc.returncode is None]
        if procs:
            _, pending = await asyncio.wait([asyncio.create_task(pr.wait()) for pr in procs], timeout=_SHUTDOWN_GRACE_S)
            for pr in procs:
                if pr.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        pr.kill()
            if pending:
                await asyncio.wait(pending)
        for w in self._workers.values():
            self._declare_dead(w, "the worker pool was closed")
        tasks = self._tasks + [t for w in self._workers.values() for t in w.tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    # ------------------------------------------------------------------ requests and models

    async def load(self, die: str, msg: p.LoadModel, progress: Callable[[p.LoadProgress], None] | None = None) -> p.Loaded:
        """Load a model on ``die``'s worker. Raises ``LoadFailedError(kind, reason)`` or ``WorkerDied``.

        ``progress`` is called with each ``LoadProgress`` (a few times a second at most).
        """
        w = self._ready(die)
        if msg.instance in w.loads:
            raise ValueError(f"instance {msg.instance!r} is already being loaded on {die}")
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, progress)
        w.loads[msg.instance] = entry
        self._send(w, msg)
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
        self._send(w, p.UnloadModel(instance=instance))
        await fut

    def submit(self, die: str, msg: p.Submit) -> RequestStream:
        """Send a request to ``die``'s worker; raises ``WorkerDied`` at once if that worker is dead."""
        w = self._ready(die)
        if msg.request_id in w.streams:
            raise ValueError(f"request id {msg.request_id!r} is already running on {die}")
        stream = RequestStream(self, die, msg.request_id, msg.instance)
        w.streams[msg.request_id] = stream
        self._send(w, msg)
        return stream

    def abort(self, die: str, request_ids: list[str]) -> None:
        """Abort requests; their streams end (without a finish token). Unknown ids are ignored."""
        w = self._workers.get(die)
        if w is None:
            return
        for rid in request_ids:
            stream = w.streams.pop(rid, None)
            if stream is not None:
                stream._end_here()
        self._send_abort(die, request_ids)

    def dies(self) -> list[DieInfo]:
        return [self._info(w) for w in self._workers.values()]

    def stats(self, die: str) -> p.Stats | None:
        w = self._workers.get(die)
        return w.last_stats if w is not None else None

    def reset_cache(self, die: str, instance: str | None = None) -> None:
        """Tell ``die``'s worker to forget the cached prefixes of ``instance`` (all when None).
        Raises ``WorkerDied`` if that worker is dead."""
        self._send(self._ready(die), p.ResetCache(instance=instance))

    # ------------------------------------------------------------------ internals

    def _ready(self, die: str) -> _Worker:
        w = self._workers.get(die)
        if w is None:
            raise KeyError(f"no worker was started for die {die!r}")
        if w.state != "ready":
            raise WorkerDied(die, w.error or f"the worker is still {w.state}")
        return w

    def _info(self, w: _Worker) -> DieInfo:
        h, s = w.hello, w.last_stats
        return DieInfo(
            die=w.die,
            device_name=h.device_name if h else "",
            total_bytes=s.total_bytes if s else (h.total_bytes if h else 0),
            free_bytes=s.free_bytes if s else (h.free_bytes if h else 0),
            pid=h.pid if h else (w.proc.pid if w.proc else None),
            alive=w.state == "ready",
            last_stats=s,
            error=w.error,
            cpu_isa=h.cpu_isa if h else "",
            cpu_paths=dict(h.cpu_paths) if h else {},
            deaths=self._deaths[w.die],
            restarts=max(0, self._starts[w.die] - 1),
            last_death=self._last_death.get(w.die, (None, None))[0],
            last_death_at=self._last_death.get(w.die, (None, None))[1],
            beat=w.beat,
        )

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"  # the worker's log lines reach us (and the operator) as they happen
        # The worker must import the same pantheon/workers as we run, from a source checkout too.
        # (Not for an installed copy: site-packages ahead of the standard library could shadow it.)
        root = str(Path(__file__).resolve().parents[2])
        installed = {os.path.realpath(d) for d in (*site.getsitepackages(), site.getusersitepackages())}
        if os.path.realpath(root) not in installed:
            env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH", "")) if x)
        return env

    def _start_help(self, w: _Worker, what: str) -> str:
        """The operator's message for a worker that did not come up."""
        rc = w.proc.returncode if w.proc is not None else None
        if w.proc is None:
            proc_line = "never started"
        elif rc is None:
            proc_line = f"pid {w.proc.pid}, still running"
        else:
            proc_line = f"pid {w.proc.pid}, {_describe_exit(rc)}"
        lines = [
            f"the worker for {w.die} did not start: {what}",
            f"  command:  {shlex.join(w.argv)}",
            f"  python:   {w.argv[0]}",
            f"  endpoint: {self.endpoint}",
            f"  process:  {proc_line}",
        ]
        if w.output:
            lines.append("  last output:")
            lines += [f"    {line}" for line in w.output]
        else:
            lines.append("  last output: (none)")
        lines.append(
            "Check that this python can run `-m workers.worker` (pantheon and torch importable), that the "
            "worker can reach the endpoint, and that the die exists on this machine."
        )
        return "\n".join(lines)

    def _send(self, w: _Worker, msg: msgspec.Struct) -> None:
        if w.state != "ready":  # nothing goes to a worker before its Hello, or after its death
            return
        fut = self._sock.send_multipart([w.ident, p.encode(msg)])
        fut.add_done_callback(_log_send_error)

    def _send_abort(self, die: str, request_ids: list[str]) -> None:
        w = self._workers.get(die)
        if w is not None and request_ids:
            self._send(w, p.Abort(request_ids=list(request_ids)))

    def _forget_stream(self, stream: RequestStream) -> None:
        w = self._workers.get(stream.die)
        if w is not None and w.streams.get(stream.request_id) is stream:
            del w.streams[stream.request_id]

    async def _settle(self, w: _Worker) -> None:
        """Wait until a failed worker's process has exited and its last output is in."""
        if w.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                if w.proc.returncode is None:
                    w.proc.kill()
            await w.proc.wait()
        if w.tasks:
            await asyncio.wait(w.tasks[:1], timeout=1.0)  # the output forwarder reaches EOF

    def _declare_dead(self, w: _Worker, reason: str) -> None:
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
        for stream in w.streams.values():
            stream._close(WorkerDied(w.die, reason))
        w.streams.clear()
        futs = [f for f, _ in w.loads.values()] + [f for fs in w.unloads.values() for f in fs]
        futs.append(w.hello_fut)
        for fut in futs:
            if fut is not None and not fut.done():
                fut.set_exception(WorkerDied(w.die, reason))
        w.loads.clear()
        w.unloads.clear()
        if w.proc is not None and w.proc.returncode is None:
            # A silent worker may be wedged (inside a CUDA call, say): it must let go of the die.
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
        if was_ready and not self._closing and self.on_worker_dead is not None:
            try:
                self.on_worker_dead(w.die, reason)
            except Exception:
                log.exception("on_worker_dead(%r) failed", w.die)

    async def _forward_output(self, w: _Worker) -> None:
        """Copy the worker's stdout/stderr lines to ours and keep the last ones for errors."""
        assert w.proc is not None and w.proc.stdout is not None
        while True:
            try:
                line = await w.proc.stdout.readline()
            except ValueError:  # a line over the limit: keep going with what follows
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            w.output.append(text)
            print(f"[worker {w.die}] {text}", file=sys.stderr, flush=True)

    async def _watch_exit(self, w: _Worker) -> None:
        rc = await w.proc.wait()
        if w.state == "dead":
            return
        await asyncio.wait(w.tasks[:1], timeout=1.0)  # let the last lines (a traceback) arrive
        # A worker that never said Hello gets its whole output in start_worker's message instead.
        tail = ""
        if w.state == "ready" and w.output:
            tail = "; last output: " + " | ".join(list(w.output)[-5:])
        self._declare_dead(w, f"the worker process (pid {w.proc.pid}) {_describe_exit(rc)}{tail}")

    async def _read_loop(self) -> None:
        """The one task that receives from the ROUTER socket; it must never stop on a bad message."""
        for n in itertools.count(1):
            if n % 64 == 0:
                # A recv that finds a message ready completes without yielding; under a burst,
                # let the request streams' consumers run now and then.
                await asyncio.sleep(0)
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as e:
                log.error("receiving from the workers failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            if len(frames) != 2:
                log.warning("dropped a message with %d frames", len(frames))
                continue
            ident, data = frames
            # A worker's heart speaks from "<die>/hb": the same worker, another socket.
            w = self._workers.get(ident.decode(errors="replace").removesuffix("/hb"))
            if w is None or w.state == "dead":
                continue  # an unknown peer, or late words of a worker already declared dead
            try:
                msg = p.decode_worker_msg(data)
            except msgspec.DecodeError as e:
                log.error("dropped a message from %s that does not decode: %s", w.die, e)
                continue
            w.last_seen = time.monotonic()
            try:
                self._dispatch(w, msg)
            except Exception:
                log.exception("handling %s from %s failed", type(msg).__name__, w.die)

    def _dispatch(self, w: _Worker, msg: p.WorkerMsg) -> None:
        if isinstance(msg, p.StepOutput):
            for tok in msg.tokens:
                stream = w.streams.get(tok.request_id)
                if stream is None:
                    continue  # aborted here while the worker was still producing it
                if tok.finish is not None:
                    del w.streams[tok.request_id]
                    stream._close(tok)
                else:
                    stream._put(tok)
        elif isinstance(msg, p.Beat):
            w.beat = msg
        elif isinstance(msg, p.Stats):
            w.last_stats = msg
        elif isinstance(msg, p.Pong):
            pass  # last_seen is all a Pong is for
        elif isinstance(msg, p.Hello):
            self._on_hello(w, msg)
        elif w.state != "ready":
            log.warning("dropped %s from %s before its Hello", type(msg).__name__, w.die)
        elif isinstance(msg, p.Rejected):
            stream = w.streams.pop(msg.request_id, None)
            if stream is not None:
                stream._close(RequestRejectedError(msg.kind, msg.reason))
        elif isinstance(msg, p.LoadProgress):
            _, progress = w.loads.get(msg.instance, (None, None))
            if progress is not None:
                try:
                    progress(msg)
                except Exception:
                    log.exception("load progress callback failed")
        elif isinstance(msg, p.Loaded):
            fut, _ = w.loads.pop(msg.instance, (None, None))
            if fut is None or fut.done():
                log.warning("%s loaded on %s but nobody waits for it: unloading it", msg.instance, w.die)
                self._send(w, p.UnloadModel(instance=msg.instance))
            else:
                fut.set_result(msg)
        elif isinstance(msg, p.LoadFailed):
            fut, _ = w.loads.pop(msg.instance, (None, None))
            if fut is not None and not fut.done():
                fut.set_exception(LoadFailedError(msg.kind, msg.reason))
        elif isinstance(msg, p.Unloaded):
            for rid, stream in list(w.streams.items()):
                if stream.instance == msg.instance:
                    del w.streams[rid]
                    reason = f"instance {msg.instance!r} was unloaded while the request ran"
                    stream._close(RequestRejectedError("no_instance", reason))
            for fut in w.unloads.pop(msg.instance, []):
                if not fut.done():
                    fut.set_result(None)

    def _on_hello(self, w: _Worker, msg: p.Hello) -> None:
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
        self._send(w, p.Ping(seq=next(w.ping_seq), sent_at=time.time()))  # starts its silence clock fresh
        if not w.hello_fut.done():
            w.hello_fut.set_result(msg)

    def _verdict(self, w: _Worker, now: float) -> str | None:
        """Why ``w`` is dead by now, or None while it is alive (see the module docstring)."""
        silent = now - w.last_seen
        if silent > self.dead_after:
            return (f"it sent nothing, not even a heartbeat, for {silent:.1f} s "
                    f"(pid {w.hello.pid} is frozen or wedged)")
        b = w.beat
        if b is not None and b.turn_s > self.step_timeout:
            return (f"its step has run {b.turn_s:.0f} s without finishing (the step timeout is "
                    f"{self.step_timeout:g} s; pid {w.hello.pid}, after {b.steps} steps)")
        return None

    async def _heartbeat_loop(self) -> None:
        """Ping every ready worker; declare dead one whose ``_verdict`` says so."""
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
                    why = None if stalled else self._verdict(w, now)
                    if why is not None:
                        self._declare_dead(w, why)
                    else:
                        self._send(w, p.Ping(seq=next(w.ping_seq), sent_at=time.time()))
                except Exception:  # the heartbeat must go on for the other workers
                    log.exception("heartbeat for %s failed", w.die)


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("sending to a worker failed: %s", fut.exception())
