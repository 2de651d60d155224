"""The worker process: one per die, driven by the router over one ZeroMQ DEALER socket.

``pantheon worker --die cpu:0 --endpoint ipc:///run/pantheon/router.sock`` (or
``python -m workers.worker ...``) connects to the router's ROUTER socket with the die id as its
identity, says ``Hello``, then runs one loop:

1. drain the inbox without blocking and handle every message (load, unload, submit, abort, ping,
   shutdown), waiting briefly for the rest of an embedding batch (``EmbedRequest.more``);
2. run one ``engine.step()`` for every loaded instance that has work and send its tokens as one
   ``StepOutput``;
3. send ``Stats`` every 250 ms while busy and every second when idle;
4. with nothing to do, block on the socket until a message comes or the next Stats is due.

``Worker`` is that loop and the composition of its parts, one module each:

- ``transport.py``: the socket (``Link``), a remote worker's CURVE handshakes, and the ``Heart``
  thread whose ``Beat`` keeps coming through a step of any length;
- ``instances.py``: the loaded engines, which instance runs each request, registering and
  closing engines;
- ``load_queue.py``: loads, one at a time on a background thread, with their progress;
- ``stepping.py``: one step for every instance with work, and what it sends;
- ``stats.py``: ``Hello`` and ``Stats``.

The worker exits by itself when the router is gone: when spawned with ``--parent-pid`` (as the
pool spawns every worker), when its parent process is no longer its parent (the heart checks
that too, so a worker stuck in a step does not outlive its router); and, when
``--router-timeout`` is above 0 (a worker started by hand), after that many seconds without a
message from the router. The pool passes 0: a router whose event loop was busy for a while
(a huge request body, a slow tokenizer) must not lose its workers for it.

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
import logging
import os
import signal
import socket
import sys
import time

import msgspec

from pantheon.core import protocol as p
from workers import stats
from workers.devices import Die, open_die
from workers.instances import Instances
from workers.load_queue import LoadQueue
from workers.native_memory import DebugReport, Trimmer, cap_caches
from workers.stepping import Stepper
from workers.transport import Heart, Link, Remote

log = logging.getLogger("pantheon.worker")

# The exit codes (and what the router says they mean) are in pantheon.core.protocol: EXIT_*.

LOADING_POLL_S = 0.05  # how often the main loop looks at the loader thread's progress
MORE_WAIT_S = 0.05  # the longest wait for the rest of an embedding batch (EmbedRequest.more)
REJOIN_MAX_S = 30.0  # a remote worker's longest wait between two Hellos to a silent router


def _knobs() -> tuple[float, bool]:
    """The spec's engine knobs, resolved by the router into our environment: the loop's longest
    sleep between polls while a load runs (PANTHEON_ASYNC_POLL_US, alias PN_ASYNC_POLL_US; zmq polls in whole milliseconds),
    and per-step timing logs (PANTHEON_STEP_STATS, alias QWEN35_BS_STATS)."""
    poll = LOADING_POLL_S
    raw = os.environ.get("PANTHEON_ASYNC_POLL_US", "")
    if raw.isdigit():
        poll = max(0.001, int(raw) / 1e6)
    return poll, os.environ.get("PANTHEON_STEP_STATS", "") == "1"


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
        self.router_timeout = router_timeout
        self.parent_pid = parent_pid
        self.loading_poll_s, step_stats = _knobs()
        self.trimmer = Trimmer()
        self.debug_memory = DebugReport.from_env()
        self.link = Link(die.id, endpoint, remote)
        self.instances = Instances(die, self.send, self.trimmer)
        self.loads = LoadQueue(die, self.instances, self.send)
        self.stepper = Stepper(self.instances, self.send, step_stats=step_stats)
        self.heart = Heart(self.link, self.beat, parent_pid)
        self.turns = 0  # main-loop turns; with turn_began, what the heart reports
        self.turn_began: float | None = None  # monotonic start of the running turn; None: idle
        self.exit_code: int | None = None

    def send(self, msg: msgspec.Struct) -> None:
        self.link.send(msg)

    def beat(self) -> p.Beat:
        """The heart's report (read from its thread: a stale read makes one beat a turn late)."""
        began = self.turn_began
        return p.Beat(
            turns=self.turns, turn_s=time.monotonic() - began if began else 0.0, steps=self.stepper.steps
        )

    def request_tables(self) -> dict[str, int]:
        """The size of every table kept per request: all 0 once every request has ended."""
        return self.instances.request_tables()

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        # Import the engine (and torch) before Hello: the router's silence clock starts at
        # Hello, and a cold torch import can take seconds on a busy machine.
        self.loads.import_engine()
        self.link.connect()
        self.link.await_router()
        if self.link.refused:
            self.link.close()
            return p.EXIT_REFUSED
        self.send(stats.hello(self.die, self.loads.engine_import_error))
        log.info("worker for %s (%s) connected to %s", self.die.id, self.die.device_name, self.link.endpoint)
        self.heart.start()
        try:
            self._loop()
        finally:
            self.heart.stopped.set()
            self.heart.join(2.0)
            self.link.close()
        assert self.exit_code is not None
        return self.exit_code

    def _loop(self) -> None:
        last_router = time.monotonic()
        next_stats = 0.0  # send Stats at once, so the router has them right after Hello
        while self.exit_code is None:
            self.turns += 1
            self.turn_began = time.monotonic()
            if self.drain():
                last_router = time.monotonic()
                self.rejoin_after = self.router_timeout
            self.loads.finish(self.session)
            busy = self.stepper.step_all()
            now = time.monotonic()
            if busy:
                self.trimmer.worked(now)
            if self.debug_memory is not None and self.debug_memory.due(now):
                self.debug_memory.report(self.request_tables(), self.trimmer)
            loading = self.loads.loading is not None
            if now >= next_stats:
                self.send(stats.stats(self.die, self.instances, self.stepper))
                next_stats = now + (stats.BUSY_STATS_S if busy or loading else stats.IDLE_STATS_S)
            if self.remote is None:
                self._check_alive(now - last_router)
            else:
                if self.link.handshakes() is False:  # the router dropped our key: that ends us
                    self.exit_code = p.EXIT_REFUSED
                if self.router_timeout > 0 and now - last_router > self.rejoin_after:
                    self._rejoin(now - last_router)
                    last_router = time.monotonic()
            if not busy and self.exit_code is None:
                self.trimmer.idle(now)  # give the heap the steps freed back, now that none run
                wait = next_stats - time.monotonic()
                if loading:
                    wait = min(wait, self.loading_poll_s)
                self.turn_began = None  # waiting for work is not a turn that hangs
                self.link.wait(wait)

    def _check_alive(self, router_silent_s: float) -> None:
        # router_timeout 0: silence alone never ends us (the pool's workers follow the router's
        # pid instead: a router busy for a few seconds is not a router that is gone)
        if self.router_timeout > 0 and router_silent_s > self.router_timeout:
            log.error("no message from the router for %.1f s: exiting", router_silent_s)
            self.exit_code = p.EXIT_ROUTER_SILENT
        elif self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.error("parent process %d is gone: exiting", self.parent_pid)
            self.exit_code = p.EXIT_PARENT_GONE

    def _rejoin(self, silent_s: float) -> None:
        """A remote worker whose router went silent: drop everything (a router that restarted
        knows none of it, one that declared us dead has given it up) and say Hello again."""
        log.warning(
            "no word from the router for %.0f s: dropping %d model(s) and saying Hello again",
            silent_s,
            len(self.instances) + self.loads.pending(),
        )
        self.session += 1
        self.loads.drop_all()
        self.instances.drop_all()
        self.send(stats.hello(self.die, self.loads.engine_import_error))
        self.rejoin_after = min(REJOIN_MAX_S, self.rejoin_after * 2)

    def drain(self) -> bool:
        """Handle every message already waiting; True if there was at least one."""
        got = False
        more = False  # the last message was an embedding input with more of its batch to come
        while self.exit_code is None:
            data = self.link.recv()
            if data is None:
                if not more:
                    break
                more = False  # the router sends a batch back to back: it is on its way
                self.link.wait(MORE_WAIT_S)
                continue
            got = True
            try:
                msg = p.decode_router_msg(data)
            except msgspec.DecodeError as e:
                log.error("dropped a message that does not decode: %s", e)
                continue
            more = isinstance(msg, p.EmbedRequest) and msg.more
            self.handle(msg)
        return got

    def handle(self, msg: p.RouterMsg) -> None:
        if isinstance(msg, p.Submit):
            self.instances.submit(msg)
        elif isinstance(msg, p.EmbedRequest):
            self.instances.embed(msg)
        elif isinstance(msg, p.Abort):
            self.instances.abort(msg.request_ids)
        elif isinstance(msg, p.Ping):
            self.send(p.Pong(seq=msg.seq, sent_at=msg.sent_at))
        elif isinstance(msg, p.ResetCache):
            self.instances.reset_cache(msg.instance)
        elif isinstance(msg, p.LoadModel):
            self.loads.add(msg, self.session)
        elif isinstance(msg, p.UnloadModel):
            self._unload(msg.instance)
        elif isinstance(msg, p.Shutdown):
            log.info("shutdown requested")
            self.exit_code = p.EXIT_OK

    def _unload(self, name: str) -> None:
        if self.loads.cancel(name):
            return  # it is loading: Unloaded follows when the loader thread is done
        self.instances.unload(name)
        self.send(p.Unloaded(instance=name))  # also for an unknown name: unload is idempotent


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
    if worker.loads.loading is not None:
        # A daemon loader thread inside torch can make interpreter shutdown hang: leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(cli())
