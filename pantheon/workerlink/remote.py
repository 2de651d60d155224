"""Workers on other hosts: the router's TCP socket for them, and the stand-in for the process
the router does not have.

``pantheon serve --worker-listen tcp://0.0.0.0:PORT --curve-dir DIR`` binds a second ROUTER
socket (``RemoteLink``), a CURVE server whose ZAP handler admits the worker keys in
``DIR/authorized`` (``curve.Authorizer``). A worker started by hand on another machine
(``pantheon worker --router tcp://ROUTER:PORT --die cuda:0 --curve-dir DIR``) connects to it
with the die id ``cuda:0@NAME`` (``NAME``: ``--name``, by default its host name) as its identity
and says ``Hello``; the pool then treats it as any other die's worker (``WorkerPool._on_join``),
except that it cannot spawn, kill or restart it:

- it is dead when its beats stop for ``dead_after`` seconds (a cable pulled, a host gone, a
  ``kill -9``) or a step outlives the step timeout, as a local worker is; its requests fail;
- it comes back by saying ``Hello`` again: a worker that hears nothing from the router (no
  ``Ping``) for ``--router-timeout`` seconds drops its models and says ``Hello`` again, with
  backoff, until a router answers. So after a router restart, or after the router gave it up,
  it re-registers with nothing loaded, and the router offers it its models again
  (``control.supervisor``): nothing is ever loaded twice;
- closing the router sends it nothing: it waits for the next router.
"""

from __future__ import annotations

import collections
import logging

import zmq
import zmq.asyncio

from pantheon.core.curve import Authorizer, load_server_keys
from pantheon.workerlink.errors import PoolError
from pantheon.workerlink.link import Link

log = logging.getLogger("pantheon.workerlink.pool")


class RemoteLink(Link):
    """The ROUTER socket remote workers connect to: TCP, CURVE unless ``curve_dir`` is None
    (plain TCP, allowed by ``curve.check_listen`` on loopback only)."""

    remote = True

    def __init__(self, endpoint: str, curve_dir: str | None):
        super().__init__()
        self._want = endpoint
        self.curve_dir = curve_dir
        self.authorizer: Authorizer | None = None
        self._auth = None

    def open(self) -> str:
        """Bind; the endpoint bound (a port 0 is resolved). Raises ``PoolError``."""
        self._ctx = zmq.asyncio.Context()
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.ROUTER_HANDOVER, 1)):
            sock.setsockopt(opt, value)
        if self.curve_dir is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            public, secret = load_server_keys(self.curve_dir)
            self.authorizer = Authorizer(self.curve_dir)
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=self.authorizer)
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        try:
            sock.bind(self._want)
        except zmq.ZMQError as e:
            self.close()
            raise PoolError(f"--worker-listen {self._want}: cannot bind: {e}") from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(
            "listening for remote workers on %s (%s)",
            self.endpoint,
            "CURVE" if self.curve_dir else "plain TCP, loopback",
        )
        return self.endpoint

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        super().close()
        self._sock = None


class RemoteProcess:
    """What the pool knows of a remote worker's process: its pid (from Hello), nothing to spawn,
    kill or reap. Quacks like ``process.WorkerProcess`` where the pool uses one."""

    proc = None
    running = False
    output_task = None

    def __init__(self, die: str, pid: int | None):
        self.die, self.pid = die, pid
        self.output: collections.deque[str] = collections.deque()

    def kill(self) -> None:
        """Nothing to kill on another host; a worker declared dead re-registers by itself."""

    async def wait(self) -> int:
        return 0

    async def settle(self) -> None:
        return None

    def status_line(self) -> str:
        return f"pid {self.pid} on another host"
