"""The ZeroMQ side of the worker link: the one ROUTER socket every worker talks to, and the
rules that say when a worker's silence means it is dead.

One ``zmq.ROUTER`` socket, bound on ``ipc://`` inside a private runtime directory (mode 0700),
carries every worker's traffic; a worker's DEALER identity is its die id, and its heart (the
thread that sends ``Beat``) speaks from ``<die>/hb``. ``Link`` owns the socket and the directory;
``WorkerPool`` (pool.py) runs the reader and the heartbeat on top of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import cast

import msgspec
import zmq
import zmq.asyncio

from pantheon.core import protocol as p
from pantheon.workerlink.errors import PoolError

log = logging.getLogger("pantheon.workerlink.pool")  # one logger for the whole link, as before

_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin
_YIELD_EVERY = 64  # receives between two forced yields of the reader (see Link.receive)
HEARTBEAT_SUFFIX = "/hb"


class Link:
    """The bound ROUTER socket. ``open`` binds it; ``receive`` and ``send`` talk to the workers by
    die id; ``close`` unbinds it and removes the runtime directory."""

    remote = False  # remote.RemoteLink: the TCP socket of workers on other hosts

    def __init__(self, runtime_parent: str | None = None):
        self._runtime_parent = runtime_parent
        self.runtime_dir: str | None = None
        self.endpoint: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._received = 0

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def open(self) -> str:
        """Bind in a fresh private directory; the endpoint (``ipc://...``). Raises ``PoolError``."""
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
        return self.endpoint

    def send(self, die: str, msg: msgspec.Struct) -> None:
        """Queue ``msg`` for ``die``'s worker (never blocks: SNDHWM is 0). A failed send is logged."""
        assert self._sock is not None, "bind() first"
        fut = self._sock.send_multipart([die.encode(), p.encode(msg)])
        cast("asyncio.Future", fut).add_done_callback(_log_send_error)  # zmq.asyncio: a Future

    async def receive(self) -> tuple[str, bytes]:
        """The next well-formed message: ``(die of the sender, its bytes)``, heart or main socket
        alike. Socket errors and malformed frames are logged and skipped: the reader must never stop."""
        while True:
            self._received += 1
            if self._received % _YIELD_EVERY == 0:
                # A recv that finds a message ready completes without yielding; under a burst,
                # let the request streams' consumers run now and then.
                await asyncio.sleep(0)
            assert self._sock is not None, "bind() first"
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
            return ident.decode(errors="replace").removesuffix(HEARTBEAT_SUFFIX), data

    def close(self) -> None:
        """Close the socket and remove the runtime directory. Idempotent."""
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


def _log_send_error(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("sending to a worker failed: %s", fut.exception())


# ---------------------------------------------------------------- liveness


def verdict(
    *,
    silent_s: float,
    beat: p.Beat | None,
    pid: int | None,
    dead_after: float,
    step_timeout: float,
    remote: bool = False,
) -> str | None:
    """Why a ready worker is dead by now, or None while it is alive.

    ``silent_s``: since anything came from it, ``Beat`` included. Its heart beats from a thread
    of its own whatever the model computes, so silence means the whole process is frozen; a long
    step is not silence, and is judged by how long the beats say it has run (``beat.turn_s``).
    """
    if silent_s > dead_after:
        why = (
            f"pid {pid} is frozen or wedged"
            if not remote
            else f"its host, its link or pid {pid} there is gone"
        )
        return f"it sent nothing, not even a heartbeat, for {silent_s:.1f} s ({why})"
    if beat is not None and beat.turn_s > step_timeout:
        return (
            f"its step has run {beat.turn_s:.0f} s without finishing (the step timeout is "
            f"{step_timeout:g} s; pid {pid}, after {beat.steps} steps)"
        )
    return None
