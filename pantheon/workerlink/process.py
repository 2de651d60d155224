"""One worker process, seen from the router: its command line and environment, spawning it,
forwarding its output, killing and reaping it, and what its exit code means.

Nothing here knows of sockets or messages: ``link.py`` carries those, and ``pool.py`` decides
when a worker is dead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shlex
import signal
import site
import sys
from pathlib import Path

from pantheon.core import protocol as p

OUTPUT_LINES = 40  # the last lines of a worker's output kept for error messages
_READ_LIMIT = 1 << 20  # the longest output line read whole (a longer one is skipped)


def worker_argv(
    command: list[str],
    die: str,
    *,
    endpoint: str,
    router_timeout: float,
    budget_bytes: int | None = None,
    threads: int | None = None,
) -> list[str]:
    """The full argv of ``die``'s worker: ``command`` (the prefix that starts one) and the flags
    ``workers/worker.py`` reads. ``--parent-pid`` is ours, so a worker outlives no router."""
    argv = [*command, "--die", die, "--endpoint", endpoint, "--parent-pid", str(os.getpid())]
    argv += ["--router-timeout", str(router_timeout)]
    if budget_bytes is not None:
        argv += ["--budget-bytes", str(int(budget_bytes))]
    if threads:
        argv += ["--threads", str(threads)]
    return argv


def worker_env() -> dict[str, str]:
    """Our environment, for a worker: unbuffered, and able to import this very checkout.

    OpenMP's wait policy stays libgomp's default (threads spin a while between parallel regions):
    ``OMP_WAIT_POLICY=PASSIVE`` halved one stream's decode on a quiet 2-core host (45 against 86
    tok/s, SmolLM2 int4, ``bench/http_path.py``), though it helped a host loaded by other jobs
    (load ~9: 17 against 2 tok/s, where spinners preempted by other processes stall each region).
    An operator on such a shared host can set it in the worker's environment.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # the worker's log lines reach us (and the operator) as they happen
    # The worker must import the same pantheon/workers as we run, from a source checkout too.
    # (Not for an installed copy: site-packages ahead of the standard library could shadow it.)
    # This file is <root>/pantheon/workerlink/process.py, so the root is two folders up.
    root = str(Path(__file__).resolve().parents[2])
    installed = {os.path.realpath(d) for d in (*site.getsitepackages(), site.getusersitepackages())}
    if os.path.realpath(root) not in installed:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH", "")) if x)
    return env


def describe_exit(rc: int) -> str:
    """A process's return code in words: ``"killed by signal SIGKILL"``, ``"exited with code 4
    (its parent process went away)"`` (the meanings are ``protocol.EXIT_MEANINGS``)."""
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    meaning = p.EXIT_MEANINGS.get(rc)
    return f"exited with code {rc}" + (f" ({meaning})" if meaning else "")


class WorkerProcess:
    """The process of one die's worker: spawned once by ``spawn``, watched with ``wait``.

    ``output`` keeps its last ``OUTPUT_LINES`` lines (stdout and stderr together) for error
    messages; every line is also copied to our stderr as ``[worker <die>] ...``.
    """

    def __init__(self, die: str, argv: list[str]):
        self.die = die
        self.argv = argv
        self.proc: asyncio.subprocess.Process | None = None  # None until spawned
        self.output: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES)
        self.output_task: asyncio.Task | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def spawn(self) -> None:
        """Start the process and the task that forwards its output. Raises ``OSError``."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=worker_env(),
            limit=_READ_LIMIT,
        )
        self.output_task = asyncio.create_task(self._forward_output(), name=f"worker-output-{self.die}")

    async def wait(self) -> int:
        """Wait until the process has exited; its return code."""
        assert self.proc is not None
        return await self.proc.wait()

    def kill(self) -> None:
        """SIGKILL it if it still runs. A wedged worker (inside a CUDA call, say) must let go of its die."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def output_done(self, timeout: float = 1.0) -> None:
        """Give the output forwarder up to ``timeout`` s to reach EOF (the last lines, a traceback)."""
        if self.output_task is not None:
            await asyncio.wait([self.output_task], timeout=timeout)

    async def settle(self) -> None:
        """Kill it if needed, wait until it has exited and its last output is in."""
        if self.proc is not None:
            self.kill()
            await self.proc.wait()
        await self.output_done()

    def status_line(self) -> str:
        """``never started`` | ``pid N, still running`` | ``pid N, exited with code ...``."""
        if self.proc is None:
            return "never started"
        rc = self.proc.returncode
        if rc is None:
            return f"pid {self.proc.pid}, still running"
        return f"pid {self.proc.pid}, {describe_exit(rc)}"

    def start_help(self, what: str, endpoint: str | None) -> str:
        """The operator's message for a worker that did not come up: ``what`` went wrong, the
        command, the process, its last output and what to check."""
        lines = [
            f"the worker for {self.die} did not start: {what}",
            f"  command:  {shlex.join(self.argv)}",
            f"  python:   {self.argv[0]}",
            f"  endpoint: {endpoint}",
            f"  process:  {self.status_line()}",
        ]
        if self.output:
            lines.append("  last output:")
            lines += [f"    {line}" for line in self.output]
        else:
            lines.append("  last output: (none)")
        lines.append(
            "Check that this python can run `-m workers.worker` (pantheon and torch importable), that the "
            "worker can reach the endpoint, and that the die exists on this machine."
        )
        return "\n".join(lines)

    async def _forward_output(self) -> None:
        """Copy the worker's stdout/stderr lines to ours and keep the last ones for errors."""
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            try:
                line = await self.proc.stdout.readline()
            except ValueError:  # a line over the limit: keep going with what follows
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            self.output.append(text)
            print(f"[worker {self.die}] {text}", file=sys.stderr, flush=True)


async def reap(processes: list[WorkerProcess], grace: float) -> None:
    """Wait up to ``grace`` seconds for ``processes`` to exit (they were told to), then SIGKILL
    the rest and wait for those too."""
    procs = [w.proc for w in processes if w.proc is not None and w.proc.returncode is None]
    if not procs:
        return
    _, pending = await asyncio.wait([asyncio.create_task(pr.wait()) for pr in procs], timeout=grace)
    for pr in procs:
        if pr.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                pr.kill()
    if pending:
        await asyncio.wait(pending)
