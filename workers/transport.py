"""The worker's side of the wire: its DEALER socket to the router, a remote worker's CURVE
handshakes, and the heartbeat thread.

``Link`` owns the ZeroMQ context and the main socket (identity: the die id; SNDHWM 0, so a send
never blocks). A worker on another host (``Remote``) makes it a CURVE client that trusts only
the router's key, and watches its handshakes: a router that refuses our key ends the worker
with ``EXIT_REFUSED``, saying so.

``Heart`` sends ``Beat`` every ``BEAT_INTERVAL_S`` on a second DEALER socket (identity
``<die>/hb``), whatever the main loop does: torch releases the GIL inside its kernels, so beats
keep coming through a step of any length, and the router declares the worker dead only when the
beats stop or one turn outlives the step timeout. It also exits the process when the parent is
gone, since the main loop may be the thing that is stuck.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from pantheon.core import protocol as p

log = logging.getLogger("pantheon.worker")


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


class Link:
    """The main socket to the router at ``endpoint``, named ``identity`` (the die id).

    ``refused`` turns True when the router refused our CURVE key (the worker then exits)."""

    def __init__(self, identity: str, endpoint: str, remote: Remote | None = None):
        self.identity, self.endpoint, self.remote = identity, endpoint, remote
        self.refused = False
        self.ctx: zmq.Context  # both made by connect(), before anything else runs
        self.sock: zmq.Socket
        self.monitor: zmq.Socket | None = None

    def connect(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.monitor = None
        if self.remote is not None:
            self.remote.secure(self.sock)
            self.monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            )
        self.sock.connect(self.endpoint)

    def send(self, msg: msgspec.Struct) -> None:
        # SNDHWM is 0 (unbounded), so a DEALER send never blocks.
        self.sock.send(p.encode(msg))

    def recv(self) -> bytes | None:
        """The next message already waiting, or None."""
        try:
            return self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def wait(self, seconds: float) -> None:
        """Block until a message comes or ``seconds`` pass (zmq polls in whole milliseconds)."""
        self.sock.poll(max(0, int(seconds * 1000)) + 1)

    def handshakes(self, wait_s: float = 0.0) -> bool | None:
        """A remote worker's CURVE handshakes since the last call: True when one succeeded,
        None when none ended (or there is no monitor); False (and ``refused``) when the router
        refused our key."""
        from zmq.utils.monitor import recv_monitor_message

        if self.monitor is None:
            return None
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
                self.refused = True
                return False
            else:
                log.error(
                    "the CURVE handshake with %s failed: is %s the router, and its server.key the "
                    "one in our --curve-dir?",
                    self.endpoint,
                    self.endpoint,
                )
        return ok

    def await_router(self) -> None:
        """A remote worker, before its first Hello: wait until the CURVE handshake succeeds
        (the router may not run yet); return with ``refused`` set if it refuses us."""
        if self.monitor is None or self.remote is None or self.remote.secret is None:
            return
        log.info("connecting to the router at %s", self.endpoint)
        waited = 0.0
        while not self.refused:
            if self.handshakes(1.0):
                return
            waited += 1.0
            if waited in (10.0, 60.0) or waited % 300 == 0:
                log.warning("no router at %s after %.0f s: still trying", self.endpoint, waited)

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()


class Heart(threading.Thread):
    """Sends ``beat()`` every ``interval`` seconds from its own socket, whatever the main loop does.

    ``beat`` reads the main loop's turn counters (plain attributes it writes; a stale read only
    makes one beat a turn late). Exits the process when ``parent_pid`` is no longer our parent."""

    def __init__(
        self,
        link: Link,
        beat: Callable[[], p.Beat],
        parent_pid: int | None,
        interval: float = p.BEAT_INTERVAL_S,
    ):
        super().__init__(name="heart", daemon=True)
        self.link, self.beat, self.parent_pid, self.interval = link, beat, parent_pid, interval
        self.stopped = threading.Event()

    def run(self) -> None:
        link = self.link
        sock = link.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{link.identity}/hb".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if link.remote is not None:
            link.remote.secure(sock)
        sock.connect(link.endpoint)
        try:
            while True:
                sock.send(p.encode(self.beat()))
                if self.stopped.wait(self.interval):
                    return
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    log.error("parent process %d is gone: exiting", self.parent_pid)
                    logging.shutdown()
                    os._exit(p.EXIT_PARENT_GONE)
        finally:
            sock.close(0)
