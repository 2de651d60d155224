"""The worker process: one per die, driven by the router over one ZeroMQ DEALER socket.

``pantheon worker --die cpu:0 --endpoint ipc:///run/pantheon/router.sock`` (or
``python -m workers.worker ...``) connects to the router's ROUTER socket with the die id as its
identity, says ``Hello``, then runs one loop:

1. drain the inbox without blocking and handle every message (load, unload, submit, abort, ping,
   shutdown);
2. run one ``engine.step()`` for every loaded instance that has work and send its tokens as one
   ``StepOutput``;
3. send ``Stats`` every 250 ms while busy and every second when idle;
4. with nothing to do, block on the socket until a message comes or the next Stats is due.

The heartbeat does not depend on that loop: a thread of its own (``Heart``) sends ``Beat``
every ``BEAT_INTERVAL_S`` on a second DEALER socket (identity ``<die>/hb``), carrying the loop's
turn counter and how long the current turn has run. Torch releases the GIL inside its kernels,
so beats keep coming through a step of any length; the router declares the worker dead only
when the beats stop (the process is frozen or gone) or one turn outlives the step timeout.

Loading runs in a background thread, one model at a time, so a model that takes minutes to read
never stalls heartbeats, pongs or the other instances' decoding; the main loop forwards the
loader's progress as ``LoadProgress``.

The worker exits by itself when the router is gone: when spawned with ``--parent-pid`` (as the
pool spawns every worker), when its parent process is no longer its parent (the heart checks
that too, so a worker stuck in a step does not outlive its router); and, when
``--router-timeout`` is above 0 (a worker started by hand), after that many seconds without a
message from the router. The pool passes 0: a router whose event loop was busy for a while
(a huge request body, a slow tokenizer) must not lose its workers for it.

Test seam: with ``PANTHEON_TEST_STEP_HOOK=FILE`` in its environment, the worker looks for FILE
before each step; when it is there, the worker deletes it and sleeps inside that step for the
seconds FILE holds, or forever if it holds ``hang``.

A worker on another host (``pantheon worker --router tcp://ROUTER:PORT --die cuda:0
--curve-dir DIR``; see ``pantheon.workerlink.remote``) is the same loop with three differences:
its die id carries its name (``cuda:0@NAME``); its sockets are CURVE clients that trust only the
router key in ``DIR/server.key`` (a router that refuses our key ends us with
``EXIT_REFUSED``, saying so); and silence from the router never ends it: after
``--router-timeout`` seconds without a message (the router pings every second) it drops its
models and says ``Hello`` again, with backoff, so a restarted router finds it and nothing is
ever loaded twice.

Memory (``workers/native_memory.py``): ``cli`` caps oneDNN's shape caches before torch is
imported (uncapped, they grew the worker's RSS by gigabytes over a soak of varied prompts), and
the loop hands the freed heap back (``malloc_trim``) when it goes idle after work and after an
unload. ``PANTHEON_DEBUG_MEMORY=SECONDS`` logs RSS, Python's own allocations and the per-request
tables every SECONDS.

This module never imports quart, textual or tokenizers: prompts arrive as token ids.
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec
import zmq

from pantheon.core import protocol as p
from pantheon.core.description import shape_digest
from workers.devices import Die, engine_device, open_die
from workers.errors import LoadError, RequestRejected
from workers.native_memory import DebugReport, Trimmer, cap_caches, request_tables

if TYPE_CHECKING:  # the engine imports torch: the worker imports it on first use (_engine_class)
    from workers.engine import Engine

log = logging.getLogger("pantheon.worker")

# The exit codes (and what the router says they mean) are in pantheon.core.protocol: EXIT_*.

BUSY_STATS_S = 0.25
IDLE_STATS_S = 1.0
LOADING_POLL_S = 0.05  # how often the main loop looks at the loader thread's progress
REJOIN_MAX_S = 30.0  # a remote worker's longest wait between two Hellos to a silent router
PROGRESS_EVERY_S = 0.1  # LoadProgress at most this often (it is called per tensor)


def _knobs() -> tuple[float, bool]:
    """The spec's engine knobs, resolved by the router into our environment: the loop's longest
    sleep between polls while a load runs (PANTHEON_ASYNC_POLL_US, alias PN_ASYNC_POLL_US; zmq polls in whole milliseconds),
    and per-step timing logs (PANTHEON_STEP_STATS, alias QWEN35_BS_STATS)."""
    poll = LOADING_POLL_S
    raw = os.environ.get("PANTHEON_ASYNC_POLL_US", "")
    if raw.isdigit():
        poll = max(0.001, int(raw) / 1e6)
    return poll, os.environ.get("PANTHEON_STEP_STATS", "") == "1"


@dataclass(frozen=True)
class Remote:
    """How a worker on another host reaches its router: CURVE keys (Z85), or None for plain
    TCP on loopback (``--insecure``)."""

    public: bytes | None = None
    secret: bytes | None = None
    server_public: bytes | None = None

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the router (when we have keys), reconnecting with backoff."""
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # a router that is gone: try ever less often
        if self.secret is not None:
            sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
            sock.curve_serverkey = self.server_public


class Heart(threading.Thread):
    """Sends ``Beat`` every ``interval`` seconds from its own socket, whatever the main loop does.

    Reads the worker's ``turns`` / ``turn_began`` / ``steps`` (plain attributes the main loop
    writes; a stale read only makes one beat a turn late). Exits the process when the parent
    is gone, since the main loop may be the thing that is stuck."""

    def __init__(self, worker: Worker, interval: float = p.BEAT_INTERVAL_S):
        super().__init__(name="heart", daemon=True)
        self.worker, self.interval = worker, interval
        self.stopped = threading.Event()

    def beat(self) -> p.Beat:
        w = self.worker
        began = w.turn_began
        return p.Beat(turns=w.turns, turn_s=time.monotonic() - began if began else 0.0, steps=w.steps)

    def run(self) -> None:
        w = self.worker
        sock = w.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{w.die.id}/hb".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if w.remote is not None:
            w.remote.secure(sock)
        sock.connect(w.endpoint)
        try:
            while True:
                sock.send(p.encode(self.beat()))
                if self.stopped.wait(self.interval):
                    return
                if w.parent_pid is not None and os.getppid() != w.parent_pid:
                    log.error("parent process %d is gone: exiting", w.parent_pid)
                    logging.shutdown()
                    os._exit(p.EXIT_PARENT_GONE)
        finally:
            sock.close(0)


def _step_hook() -> None:
    """The test seam described in the module docstring (a no-op unless the env names a file)."""
    path = os.environ.get("PANTHEON_TEST_STEP_HOOK")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        what = f.read().strip()
    os.unlink(path)
    log.warning("test step hook: %s inside this step", what)
    if what == "hang":
        threading.Event().wait()
    time.sleep(float(what))


def _engine_class() -> type[Engine]:
    """Import the engine on first use (and once before Hello, see ``Worker.run``)."""
    from workers.engine import Engine

    return Engine


def _instance_stats(name: str, engine: Engine) -> p.InstanceStats:
    """The engine's stats of one instance, with its state pools' bytes (``Engine.state_bytes``;
    the engine's own stats leave them out)."""
    es = engine.stats(name)
    state = int(getattr(engine, "state_bytes", 0) or 0)
    return msgspec.structs.replace(es, state_bytes=state) if state and not es.state_bytes else es


@dataclass
class _Instance:
    engine: Engine
    booked_bytes: int


@dataclass
class _LoadJob:
    msg: p.LoadModel
    cancelled: bool = False
    session: int = 0  # the worker's session it was asked in (a remote worker's Hello count)


class Worker:
    """One die's worker. ``run()`` returns the process exit code."""

    def __init__(
        self,
        die: Die,
        endpoint: str,
        *,
        router_timeout: float = 10.0,
        parent_pid: int | None = None,
        remote: Remote | None = None,
    ):
        self.die = die
        self.remote = remote
        self.session = 0  # Hellos said since start, less one: a remote worker's rejoins
        self.rejoin_after = router_timeout  # a remote worker: silence before the next Hello
        self.endpoint = endpoint
        self.router_timeout = router_timeout
        self.parent_pid = parent_pid
        self.instances: dict[str, _Instance] = {}
        self.owner: dict[str, str] = {}  # request id -> instance, while the request runs
        self.load_queue: collections.deque[_LoadJob] = collections.deque()
        self.loading: _LoadJob | None = None  # the job the loader thread is running
        self.load_results: queue.Queue[tuple[_LoadJob, Engine | p.LoadFailed]] = queue.Queue()
        self.load_progress: tuple[int, int] | None = None  # written by the loader thread
        self.sent_progress: tuple[int, int] | None = None
        self.last_progress_at = 0.0
        self.engine_import_error: str | None = None
        self.steps = 0
        self.turns = 0  # main-loop turns; with turn_began, what the heart reports
        self.turn_began: float | None = None  # monotonic start of the running turn; None: idle
        self.heart: Heart | None = None
        self.window_steps = 0
        self.window_ms = 0.0
        self.exit_code: int | None = None
        self.ctx: zmq.Context  # both made by _connect(), before anything else runs
        self.sock: zmq.Socket
        self.loading_poll_s, self.step_stats = _knobs()
        self.trimmer = Trimmer()
        self.debug_memory = DebugReport.from_env()

    # ------------------------------------------------------------------ plumbing

    def send(self, msg: msgspec.Struct) -> None:
        # SNDHWM is 0 (unbounded), so a DEALER send never blocks.
        self.sock.send(p.encode(msg))

    def _connect(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.die.id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.monitor: zmq.Socket | None = None
        if self.remote is not None:
            self.remote.secure(self.sock)
            self.monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            )
        self.sock.connect(self.endpoint)

    def _handshakes(self, wait_s: float = 0.0) -> bool | None:
        """A remote worker's CURVE handshakes since the last call: True when one succeeded,
        None when none ended; a refusal by the router ends the worker (``EXIT_REFUSED``)."""
        from zmq.utils.monitor import recv_monitor_message

        assert self.monitor is not None
        ok = None
        while self.monitor.poll(int(wait_s * 1000)):
            wait_s = 0
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                ok = True
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                log.error(
                    "the router at %s refused our CURVE key: put this worker's public key (%s) in "
                    "the router's --curve-dir authorized/ folder",
                    self.endpoint,
                    (self.remote.public or b"").decode() if self.remote else "",
                )
                self.exit_code = p.EXIT_REFUSED
                return False
            else:
                log.error(
                    "the CURVE handshake with %s failed: is %s the router, and its server.key the "
                    "one in our --curve-dir?",
                    self.endpoint,
                    self.endpoint,
                )
        return ok

    def _await_router(self) -> None:
        """A remote worker, before its first Hello: wait until the CURVE handshake succeeds
        (the router may not run yet); return with ``exit_code`` set if it refuses us."""
        if self.monitor is None or self.remote is None or self.remote.secret is None:
            return
        log.info("connecting to the router at %s", self.endpoint)
        waited = 0.0
        while self.exit_code is None:
            if self._handshakes(1.0):
                return
            waited += 1.0
            if waited in (10.0, 60.0) or waited % 300 == 0:
                log.warning("no router at %s after %.0f s: still trying", self.endpoint, waited)

    def _rejoin(self, silent_s: float) -> None:
        """A remote worker whose router went silent: drop everything (a router that restarted
        knows none of it, one that declared us dead has given it up) and say Hello again."""
        log.warning(
            "no word from the router for %.0f s: dropping %d model(s) and saying Hello again",
            silent_s,
            len(self.instances) + len(self.load_queue) + (self.loading is not None),
        )
        self.session += 1
        self.load_queue.clear()
        if self.loading is not None:
            self.loading.cancelled = True  # its engine is closed when the loader thread ends
        for name in list(self.instances):
            inst = self.instances.pop(name)
            self._close_engine(inst.engine)
            self.die.release(inst.booked_bytes)
        self.owner.clear()
        self.send(self._hello())
        self.rejoin_after = min(REJOIN_MAX_S, self.rejoin_after * 2)

    def _hello(self) -> p.Hello:
        free, total = self.die.memory()
        isa, paths = "", {}
        if self.die.kind == "cpu" and not self.engine_import_error:
            from workers import cpu_paths

            isa = cpu_paths.isa()
            paths = {name: why or "" for name, why in cpu_paths.probe_all().items()}
            log.info(
                "%s: isa %s; CPU paths that work: %s",
                self.die.id,
                isa,
                ", ".join(n for n, why in paths.items() if not why) or "none",
            )
            for name, why in paths.items():
                if why:
                    log.info("%s: CPU path %s is not used here: %s", self.die.id, name, why)
        return p.Hello(
            die=self.die.id,
            device_name=self.die.device_name,
            total_bytes=total,
            free_bytes=free,
            pid=os.getpid(),
            cpu_isa=isa,
            cpu_paths=paths,
            hostname=socket.gethostname(),
        )

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        # Import the engine (and torch) before Hello: the router's silence clock starts at
        # Hello, and a cold torch import can take seconds on a busy machine.
        try:
            _engine_class()
        except Exception:
            self.engine_import_error = traceback.format_exc(limit=3).strip()
            log.error("workers.engine failed to import:\n%s", self.engine_import_error)
        self._connect()
        self._await_router()
        if self.exit_code is not None:
            self._close()
            return self.exit_code
        self.send(self._hello())
        log.info("worker for %s (%s) connected to %s", self.die.id, self.die.device_name, self.endpoint)
        self.heart = Heart(self)
        self.heart.start()
        last_router = time.monotonic()
        next_stats = 0.0  # send Stats at once, so the router has them right after Hello
        try:
            while self.exit_code is None:
                self.turns += 1
                self.turn_began = time.monotonic()
                if self._drain():
                    last_router = time.monotonic()
                    self.rejoin_after = self.router_timeout
                self._finish_loads()
                busy = self._step_all()
                now = time.monotonic()
                if busy:
                    self.trimmer.worked(now)
                if self.debug_memory is not None and self.debug_memory.due(now):
                    self.debug_memory.report(self.request_tables(), self.trimmer)
                loading = self.loading is not None
                if now >= next_stats:
                    self.send(self._stats())
                    next_stats = now + (BUSY_STATS_S if busy or loading else IDLE_STATS_S)
                if self.remote is None:
                    self._check_alive(now - last_router)
                else:
                    if self.monitor is not None:
                        self._handshakes()  # a refusal (the router dropped our key) ends us
                    if self.router_timeout > 0 and now - last_router > self.rejoin_after:
                        self._rejoin(now - last_router)
                        last_router = time.monotonic()
                if not busy and self.exit_code is None:
                    self.trimmer.idle(now)  # give the heap the steps freed back, now that none run
                    wait = next_stats - time.monotonic()
                    if loading:
                        wait = min(wait, self.loading_poll_s)
                    self.turn_began = None  # waiting for work is not a turn that hangs
                    self.sock.poll(max(0, int(wait * 1000)) + 1)
        finally:
            self.heart.stopped.set()
            self.heart.join(2.0)
            self._close()
        return self.exit_code

    def request_tables(self) -> dict[str, int]:
        """The size of every table kept per request, ours and each engine's: all 0 once every
        request has ended (``native_memory.request_tables``)."""
        return request_tables(self.owner, {name: inst.engine for name, inst in self.instances.items()})

    def _close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()

    def _check_alive(self, router_silent_s: float) -> None:
        # router_timeout 0: silence alone never ends us (the pool's workers follow the router's
        # pid instead: a router busy for a few seconds is not a router that is gone)
        if self.router_timeout > 0 and router_silent_s > self.router_timeout:
            log.error("no message from the router for %.1f s: exiting", router_silent_s)
            self.exit_code = p.EXIT_ROUTER_SILENT
        elif self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.error("parent process %d is gone: exiting", self.parent_pid)
            self.exit_code = p.EXIT_PARENT_GONE

    def _drain(self) -> bool:
        """Handle every message already waiting; True if there was at least one."""
        got = False
        while self.exit_code is None:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = True
            try:
                msg = p.decode_router_msg(data)
            except msgspec.DecodeError as e:
                log.error("dropped a message that does not decode: %s", e)
                continue
            self._handle(msg)
        return got

    def _handle(self, msg: p.RouterMsg) -> None:
        if isinstance(msg, p.Submit):
            self._submit(msg)
        elif isinstance(msg, p.EmbedRequest):
            self._embed(msg)
        elif isinstance(msg, p.Abort):
            for rid in msg.request_ids:
                inst = self.instances.get(self.owner.pop(rid, ""))
                if inst is not None:
                    inst.engine.abort(rid)
        elif isinstance(msg, p.Ping):
            self.send(p.Pong(seq=msg.seq, sent_at=msg.sent_at))
        elif isinstance(msg, p.ResetCache):
            for name, inst in self.instances.items():
                if msg.instance in (None, name):
                    inst.engine.reset_cache()
        elif isinstance(msg, p.LoadModel):
            self._queue_load(msg)
        elif isinstance(msg, p.UnloadModel):
            self._unload(msg.instance)
        elif isinstance(msg, p.Shutdown):
            log.info("shutdown requested")
            self.exit_code = p.EXIT_OK

    def _step_all(self) -> bool:
        """One engine step for every instance with work; True if any had work."""
        busy = False
        for name, inst in list(self.instances.items()):
            if not inst.engine.has_work():
                continue
            busy = True
            t0 = time.perf_counter()
            _step_hook()
            tokens = inst.engine.step()
            ms = (time.perf_counter() - t0) * 1000.0
            self.steps += 1
            self.window_steps += 1
            self.window_ms += ms
            if self.step_stats:
                print(
                    f"step {self.steps} {name} {ms:.2f} ms {len(tokens)} tokens", file=sys.stderr, flush=True
                )
            failed = self._grammar_failures(inst.engine)
            if failed:  # the token a failed matcher ended its request on broke the grammar
                tokens = [t for t in tokens if t.request_id not in failed]
            if tokens:  # a prefill chunk that completes no prompt yields nothing to send
                self.send(p.StepOutput(instance=name, tokens=tokens, step_ms=ms))
                for t in tokens:
                    if t.finish is not None:
                        self.owner.pop(t.request_id, None)
            for out in inst.engine.take_embedded():  # embeddings whose prompt this step finished
                self.send(out)
                self.owner.pop(out.request_id, None)
            for rid, error in failed.items():
                if self.owner.pop(rid, None) is not None:
                    reason = f"the output constraint could not be enforced: {error}"
                    self.send(p.Rejected(request_id=rid, kind="invalid", reason=reason))
        return busy

    @staticmethod
    def _grammar_failures(engine: Engine) -> dict[str, str]:
        """The requests of ``engine`` whose grammar matcher failed in its last step (each is
        ended there: ``Constraint.advance``), and why. They end with ``Rejected``, not ``stop``."""
        grammars = getattr(engine, "grammars", None)
        if grammars is None:
            return {}
        failed = grammars.take_failures()
        for rid in failed:
            engine.abort(rid)  # already finished by the engine: a no-op then
        return failed

    def _stats(self) -> p.Stats:
        """``steps`` counts every step since start; ``step_ms_avg`` covers those since the last Stats."""
        free, total = self.die.memory()
        avg = self.window_ms / self.window_steps if self.window_steps else 0.0
        self.window_steps, self.window_ms = 0, 0.0
        return p.Stats(
            free_bytes=free,
            total_bytes=total,
            instances=[_instance_stats(name, inst.engine) for name, inst in self.instances.items()],
            steps=self.steps,
            step_ms_avg=avg,
        )

    # ------------------------------------------------------------------ requests

    def _submit(self, msg: p.Submit) -> None:
        inst = self.instances.get(msg.instance)
        if inst is None:
            reason = f"instance {msg.instance!r} is not loaded on {self.die.id}"
            self.send(p.Rejected(request_id=msg.request_id, kind="no_instance", reason=reason))
            return
        try:
            inst.engine.submit(
                msg.request_id,
                msg.prompt,
                msg.params,
                session_id=msg.session_id,
                cache_salt=msg.cache_salt,
                use_cache=msg.use_cache,
                prompt_logprobs=msg.prompt_logprobs,
            )
        except RequestRejected as e:
            self.send(p.Rejected(request_id=msg.request_id, kind=cast(p.RejectKind, e.kind), reason=e.reason))
        else:
            self.owner[msg.request_id] = msg.instance
            grammars = getattr(inst.engine, "grammars", None)
            if msg.params.grammar is not None and grammars is not None:
                grammars.label(msg.request_id)  # its matcher's failure ends this request

    def _embed(self, msg: p.EmbedRequest) -> None:
        inst = self.instances.get(msg.instance)
        if inst is None:
            reason = f"instance {msg.instance!r} is not loaded on {self.die.id}"
            self.send(p.Rejected(request_id=msg.request_id, kind="no_instance", reason=reason))
            return
        try:
            inst.engine.submit_embed(msg.request_id, msg.prompt, msg.pooling, msg.normalize)
        except RequestRejected as e:
            self.send(p.Rejected(request_id=msg.request_id, kind=cast(p.RejectKind, e.kind), reason=e.reason))
        else:
            self.owner[msg.request_id] = msg.instance

    # ------------------------------------------------------------------ load / unload

    def _queue_load(self, msg: p.LoadModel) -> None:
        busy = {j.msg.instance for j in self.load_queue}
        if self.loading is not None:
            busy.add(self.loading.msg.instance)
        busy -= {j.msg.instance for j in (self.loading,) if j is not None and j.session != self.session}
        if msg.instance in self.instances or msg.instance in busy:
            reason = f"instance {msg.instance!r} is already loaded or loading on {self.die.id}"
            self.send(p.LoadFailed(instance=msg.instance, kind="invalid", reason=reason))
            return
        self.load_queue.append(_LoadJob(msg, session=self.session))
        self._start_next_load()

    def _start_next_load(self) -> None:
        if self.loading is not None or not self.load_queue:
            return
        job = self.loading = self.load_queue.popleft()
        self.load_progress = self.sent_progress = None
        log.info("loading %s from %s", job.msg.instance, job.msg.path)
        threading.Thread(target=self._load_thread, args=(job,), name="loader", daemon=True).start()

    def _load_thread(self, job: _LoadJob) -> None:
        """Build the engine; hand the engine or a LoadFailed back to the main loop."""
        msg = job.msg
        t0 = time.monotonic()
        try:
            if self.engine_import_error:
                raise RuntimeError(f"workers.engine failed to import: {self.engine_import_error}")
            try:
                devices = [engine_device(d) for d in msg.devices] or [self.die.torch_device]
                result: Engine | p.LoadFailed = _engine_class()(
                    msg.path,
                    devices=devices,
                    dtype=msg.dtype,
                    num_slots=msg.num_slots,
                    kv_budget_bytes=msg.kv_budget_bytes,
                    prefill_chunk=msg.prefill_chunk,
                    step_target_s=msg.step_target_s,
                    max_model_len=msg.max_model_len,
                    quantize=msg.quantize,
                    state_checkpoint_count=msg.state_checkpoints,
                    progress=self._on_progress,
                )
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
        self.load_results.put((job, result))

    def _on_progress(self, done: int, total: int) -> None:
        # Called in the loader thread for every tensor: only record it; the main loop sends.
        self.load_progress = (done, total)

    def _finish_loads(self) -> None:
        """Forward load progress, and turn finished loads into Loaded / LoadFailed."""
        try:
            job, result = self.load_results.get_nowait()
        except queue.Empty:
            self._send_progress(force=False)
            return
        self._send_progress(force=True)  # the router sees the final count before Loaded
        self.loading = None
        self.trimmer.dirty = True  # the load's staging buffers are garbage now: trim when idle
        name = job.msg.instance
        if job.session != self.session:  # asked by a router we have since left: say nothing
            if not isinstance(result, p.LoadFailed):
                self._close_engine(result)
        elif isinstance(result, p.LoadFailed):
            self.send(result)
        elif job.cancelled:
            self._close_engine(result)
            self.send(p.LoadFailed(instance=name, kind="cancelled", reason="unloaded while loading"))
            self.send(p.Unloaded(instance=name))
        else:
            self._register(name, result)
        self._start_next_load()

    def _send_progress(self, *, force: bool) -> None:
        job, prog = self.loading, self.load_progress
        if job is None or prog is None or prog == self.sent_progress:
            return
        now = time.monotonic()
        if force or now - self.last_progress_at >= PROGRESS_EVERY_S:
            self.send(p.LoadProgress(instance=job.msg.instance, done=prog[0], total=prog[1]))
            self.sent_progress, self.last_progress_at = prog, now

    def _register(self, name: str, engine: Engine) -> None:
        state = int(getattr(engine, "state_bytes", 0) or 0)  # the recurrent layers' state pools
        need = int(engine.weight_bytes) + int(engine.kv_bytes) + state
        free, total = self.die.memory()
        if self.die.kind == "cpu" and need > free:
            # A virtual die enforces its budget the way a real one would run out of memory.
            self._close_engine(engine)
            states = f" + recurrent state {state}" if state else ""
            reason = (
                f"{name} needs {need} bytes (weights {engine.weight_bytes} + KV cache {engine.kv_bytes}"
                f"{states}) but {self.die.id} has {free} of its {total}-byte budget free"
            )
            self.send(p.LoadFailed(instance=name, kind="out_of_memory", reason=reason))
            return
        if self.die.kind == "cpu":
            self.die.book(need)
        self.instances[name] = _Instance(engine, need if self.die.kind == "cpu" else 0)
        self.send(
            p.Loaded(
                instance=name,
                weight_bytes=int(engine.weight_bytes),
                kv_bytes=int(engine.kv_bytes),
                max_model_len=int(engine.max_model_len),
                num_slots=int(engine.num_slots),
                vocab_size=int(engine.vocab_size),
                eos_token_ids=[int(t) for t in engine.eos_token_ids],
                cpu_path=engine.cpu_path or "",
                state_bytes=state,
                shape_digest=shape_digest(engine.cfg),
            )
        )
        log.info(
            "loaded %s (%d bytes booked on %s%s%s)",
            name,
            need,
            self.die.id,
            f", recurrent state {state}" if state else "",
            f", CPU path {engine.cpu_path}" if engine.cpu_path else "",
        )
        skipped = tuple(getattr(getattr(engine, "cfg", None), "skipped", ()) or ())
        if skipped:  # what of the checkpoint the engine does not run, said once
            log.info("%s: left out of the checkpoint: %s", name, "; ".join(skipped))
        log.info("%s: decode step compile: %s", name, engine.compiler.state)  # workers/compiled.py
        if engine.cpu_timings:  # what the choice was made on: ms of one step's linears
            log.info(
                "%s: CPU paths timed on its shapes (ms per step at 1 / 8 rows): %s",
                name,
                ", ".join(f"{n} {a * 1e3:.2f} / {b * 1e3:.2f}" for n, (a, b) in engine.cpu_timings.items()),
            )
        if engine.cpu_note:
            log.info("%s: CPU path choice: %s", name, engine.cpu_note)

    def _unload(self, name: str) -> None:
        if self.loading is not None and self.loading.msg.instance == name:
            self.loading.cancelled = True  # Unloaded follows when the loader thread is done
            return
        for job in list(self.load_queue):
            if job.msg.instance == name:
                self.load_queue.remove(job)
                self.send(p.LoadFailed(instance=name, kind="cancelled", reason="unloaded before loading"))
        inst = self.instances.pop(name, None)
        if inst is not None:
            for rid in [r for r, i in self.owner.items() if i == name]:
                del self.owner[rid]
            self._close_engine(inst.engine)
            self.die.release(inst.booked_bytes)
            log.info("unloaded %s", name)
        self.send(p.Unloaded(instance=name))  # also for an unknown name: unload is idempotent

    def _close_engine(self, engine: Engine) -> None:
        try:
            engine.close()
        except Exception:
            log.exception("engine.close() failed")
        del engine
        gc.collect()  # drop the tensors now, so the memory is really free when we say so
        self.die.empty_cache()
        self.trimmer.trim()  # and give the heap back to the system (a CPU die's weights and KV)


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pantheon worker",
        description="Run one worker process for one die: spawned by 'pantheon serve' (--endpoint), "
        "or started by hand on another host to join a router (--router).",
    )
    ap.add_argument("--die", required=True, help="cpu:N or cuda:N")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", help="the router's local socket, ipc:///path (the router passes it)")
    where.add_argument(
        "--router",
        metavar="tcp://HOST:PORT",
        help="join the router listening there for remote workers (its --worker-listen)",
    )
    ap.add_argument(
        "--name",
        default=None,
        help="with --router: this worker's name; the router knows its die as DIE@NAME (default: the host name)",
    )
    ap.add_argument(
        "--curve-dir",
        default=None,
        help="with --router: the folder with our keypair (KEY.key_secret) and the router's public key "
        "(server.key), from 'pantheon keys new DIR'",
    )
    ap.add_argument("--key", default="worker", help="with --curve-dir: our keypair's name (default: worker)")
    ap.add_argument(
        "--insecure",
        action="store_true",
        help="with --router: plain TCP without CURVE (a loopback router started with --worker-insecure)",
    )
    ap.add_argument(
        "--budget-bytes", type=int, default=None, help="memory budget of a cpu die (default: all RAM)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument(
        "--router-timeout",
        type=float,
        default=10.0,
        help="exit when the router has sent nothing for this many seconds (it pings every "
        "second); 0: never for silence alone (with --parent-pid, the router's pid decides). "
        "With --router: drop the models and say Hello again instead, with backoff",
    )
    ap.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is no longer our parent; also ignore SIGINT (the parent shuts us down)",
    )
    return ap


def _name(args: argparse.Namespace) -> str:
    return args.name or socket.gethostname().split(".")[0]


def _remote(args: argparse.Namespace) -> Remote:
    """``--router`` and its keys -> ``Remote``; ValueError says what is wrong."""
    from pantheon.core.curve import check_listen, load_worker_keys

    if args.parent_pid is not None:
        raise ValueError(
            "--router and --parent-pid: a worker that joins a router by hand has no parent to follow"
        )
    try:
        check_listen(args.router, args.curve_dir, args.insecure)  # the same rules as the router's
        if args.insecure:
            return Remote()
        public, secret, server = load_worker_keys(args.curve_dir, args.key)
    except Exception as e:  # ConfigError: the message says what to fix
        raise ValueError(
            str(e).replace("--worker-listen", "--router").replace("--worker-insecure", "--insecure")
        ) from None
    return Remote(public=public, secret=secret, server_public=server)


def cli(argv: list[str] | None = None) -> int:
    """Entry point of ``pantheon worker``; returns the exit code."""
    cap_caches()  # before torch is imported, let alone runs a oneDNN op (the hello's path probe)
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {args.die}{'@' + _name(args) if args.router else ''} %(levelname)s %(message)s",
    )
    if args.parent_pid is not None:
        # Ctrl-C in the router's terminal reaches the whole process group; the router then
        # shuts its workers down in order, so the worker must not die first on its own.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    remote, endpoint = None, args.endpoint
    if args.router is not None:
        try:
            remote = _remote(args)
        except ValueError as e:
            log.error("%s", e)
            return p.EXIT_BAD_ARGS
        endpoint = args.router
    try:
        die = open_die(args.die, budget_bytes=args.budget_bytes, name=_name(args) if remote else "")
    except ValueError as e:
        log.error("%s", e)
        return p.EXIT_BAD_ARGS
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    worker = Worker(
        die, endpoint, router_timeout=args.router_timeout, parent_pid=args.parent_pid, remote=remote
    )
    code = worker.run()
    if worker.loading is not None:
        # A daemon loader thread inside torch can make interpreter shutdown hang: leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(cli())
