"""One engine step for every loaded instance with work, and what it sends.

Each step's tokens go to the router as one ``StepOutput``; a request that finished leaves
``Instances.owner``, and so does one whose grammar matcher failed in the step: it ends with
``Rejected(invalid)``, not a ``stop`` (the token the matcher failed on broke the grammar, so it
is never sent). Embeddings whose prompt the step finished go out as they are.

The counters here are what the heart and the ``Stats`` report: ``steps`` since start, and the
window of steps and milliseconds since the last ``Stats``.

Test seam: with ``PANTHEON_TEST_STEP_HOOK=FILE`` in its environment, the worker looks for FILE
before each step; when it is there, the worker deletes it and sleeps inside that step for the
seconds FILE holds, or forever if it holds ``hang``; ``raise`` makes the next step of that
instance that samples raise inside the engine (as a bug reached by a request would), which
fails that step's requests (``workers/step_guard.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from pantheon.core import protocol as p
from pantheon.core.token_times import TokenTimes
from workers.errors import StepFailed
from workers.instances import Instances

if TYPE_CHECKING:  # the engine imports torch
    from workers.engine import Engine

log = logging.getLogger("pantheon.worker")


def step_hook(engine: Engine) -> None:
    """The test seam described in the module docstring (a no-op unless the env names a file)."""
    path = os.environ.get("PANTHEON_TEST_STEP_HOOK")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        what = f.read().strip()
    os.unlink(path)
    log.warning("test step hook: %s inside this step", what)
    if what == "raise":

        def raise_once(seqs: object, logits: object) -> None:
            engine.on_logits = None
            raise RuntimeError("test step hook: raised inside this step")

        engine.on_logits = raise_once
        return
    if what == "hang":
        threading.Event().wait()
    time.sleep(float(what))


def grammar_failures(engine: Engine) -> dict[str, str]:
    """The requests of ``engine`` whose grammar matcher failed in its last step (each is
    ended there: ``Constraint.advance``), and why. They end with ``Rejected``, not ``stop``."""
    grammars = getattr(engine, "grammars", None)
    if grammars is None:
        return {}
    failed = grammars.take_failures()
    for rid in failed:
        engine.abort(rid)  # already finished by the engine: a no-op then
    return failed


class Stepper:
    """Steps ``instances``; ``send`` takes what each step produced. ``step_stats`` prints one
    timing line per step to stderr (``PANTHEON_STEP_STATS=1``)."""

    def __init__(
        self, instances: Instances, send: Callable[[msgspec.Struct], None], *, step_stats: bool = False
    ):
        self.instances, self.send, self.step_stats = instances, send, step_stats
        self.steps = 0
        self.window_steps = 0
        self.window_ms = 0.0
        self.times = TokenTimes("worker")  # bench/http_path.py's stamps (off unless its env var is set)

    def take_window(self) -> float:
        """The mean step time (ms) since the last call, and start a new window."""
        avg = self.window_ms / self.window_steps if self.window_steps else 0.0
        self.window_steps, self.window_ms = 0, 0.0
        return avg

    def step_all(self) -> bool:
        """One engine step for every instance with work; True if any had work."""
        busy = False
        owner = self.instances.owner
        for name, inst in list(self.instances.loaded.items()):
            if not inst.engine.has_work():
                continue
            busy = True
            t0 = time.monotonic()
            step_hook(inst.engine)
            try:
                tokens = inst.engine.step()
            except StepFailed as e:  # the step's requests were ended; the engine goes on
                tokens = e.outs
                self._fail(name, e)
            t1 = time.monotonic()
            ms = (t1 - t0) * 1000.0
            self.steps += 1
            self.window_steps += 1
            self.window_ms += ms
            if self.step_stats:
                print(
                    f"step {self.steps} {name} {ms:.2f} ms {len(tokens)} tokens", file=sys.stderr, flush=True
                )
            failed = grammar_failures(inst.engine)
            if failed:  # the token a failed matcher ended its request on broke the grammar
                tokens = [t for t in tokens if t.request_id not in failed]
            if tokens:  # a prefill chunk that completes no prompt yields nothing to send
                self.times.stamp("s", t0, t1, len(tokens))  # stamped before the send
                self.send(p.StepOutput(instance=name, tokens=tokens, step_ms=ms))
                for t in tokens:
                    if t.finish is not None:
                        owner.pop(t.request_id, None)
            for out in inst.engine.take_embedded():  # embeddings whose prompt this step finished
                self.send(out)
                owner.pop(out.request_id, None)
            for rid, error in failed.items():
                if owner.pop(rid, None) is not None:
                    reason = f"the output constraint could not be enforced: {error}"
                    self.send(p.Rejected(request_id=rid, kind="invalid", reason=reason))
        return busy

    def _fail(self, name: str, e: StepFailed) -> None:
        """Answer each request of a step that raised with ``Rejected(internal)`` (logged with
        the traceback; the client gets a 500 with its request id)."""
        log.error(
            "a step of %s raised; its %d request(s) fail: %s",
            name,
            len(e.request_ids),
            ", ".join(e.request_ids),
            exc_info=e.cause,
        )
        owner = self.instances.owner
        for rid in e.request_ids:
            if owner.pop(rid, None) is not None:
                reason = f"the step running this request failed ({type(e.cause).__name__})"
                self.send(p.Rejected(request_id=rid, kind="internal", reason=reason))
