"""The instances a worker has loaded, and which instance runs each request.

``Instances`` keeps the engines by instance name with the bytes each booked on the die, and
``owner`` (request id -> instance) while a request runs. It takes the router's requests to an
engine (submit, embed, abort, reset the cache), answers a request it cannot take with
``Rejected``, registers a freshly built engine (booking its memory on a CPU die, whose budget is
enforced here the way a real die runs out of memory) with ``Loaded``, and closes engines so that
their memory is really free when the worker says so.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec

from pantheon.core import protocol as p
from pantheon.core.description import shape_digest
from workers.devices import Die
from workers.errors import RequestRejected
from workers.native_memory import Trimmer, request_tables

if TYPE_CHECKING:  # the engine imports torch: the worker imports it on first use
    from workers.engine import Engine

log = logging.getLogger("pantheon.worker")


@dataclass
class Instance:
    engine: Engine
    booked_bytes: int


class Instances:
    """The loaded engines of one die; ``send`` answers the router."""

    def __init__(self, die: Die, send: Callable[[msgspec.Struct], None], trimmer: Trimmer):
        self.die, self.send, self.trimmer = die, send, trimmer
        self.loaded: dict[str, Instance] = {}
        self.owner: dict[str, str] = {}  # request id -> instance, while the request runs

    def __len__(self) -> int:
        return len(self.loaded)

    def __contains__(self, name: str) -> bool:
        return name in self.loaded

    # ------------------------------------------------------------------ requests

    def submit(self, msg: p.Submit) -> None:
        inst = self._target(msg.instance, msg.request_id)
        if inst is None:
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
        except Exception as e:  # noqa: BLE001  # one request's bug ends that request, not the worker
            self._internal(inst, msg.request_id, e)
        else:
            self.owner[msg.request_id] = msg.instance
            grammars = getattr(inst.engine, "grammars", None)
            if msg.params.grammar is not None and grammars is not None:
                grammars.label(msg.request_id)  # its matcher's failure ends this request

    def embed(self, msg: p.EmbedRequest) -> None:
        inst = self._target(msg.instance, msg.request_id)
        if inst is None:
            return
        try:
            inst.engine.submit_embed(msg.request_id, msg.prompt, msg.pooling, msg.normalize)
        except RequestRejected as e:
            self.send(p.Rejected(request_id=msg.request_id, kind=cast(p.RejectKind, e.kind), reason=e.reason))
        except Exception as e:  # noqa: BLE001
            self._internal(inst, msg.request_id, e)
        else:
            self.owner[msg.request_id] = msg.instance

    def _internal(self, inst: Instance, request_id: str, e: Exception) -> None:
        """A submission that raised: whatever it left in the engine is dropped (a submission
        touches only its own request's tables) and the request is answered ``Rejected(internal)``."""
        log.error("request %s could not be queued", request_id, exc_info=e)
        inst.engine.abort(request_id)
        reason = f"the worker could not queue this request ({type(e).__name__})"
        self.send(p.Rejected(request_id=request_id, kind="internal", reason=reason))

    def _target(self, name: str, request_id: str) -> Instance | None:
        """The instance a request names, or None after answering ``Rejected``."""
        inst = self.loaded.get(name)
        if inst is None:
            reason = f"instance {name!r} is not loaded on {self.die.id}"
            self.send(p.Rejected(request_id=request_id, kind="no_instance", reason=reason))
        return inst

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            inst = self.loaded.get(self.owner.pop(rid, ""))
            if inst is not None:
                inst.engine.abort(rid)

    def reset_cache(self, instance: str | None) -> None:
        for name, inst in self.loaded.items():
            if instance in (None, name):
                inst.engine.reset_cache()

    def request_tables(self) -> dict[str, int]:
        """The size of every table kept per request, ours and each engine's: all 0 once every
        request has ended (``native_memory.request_tables``)."""
        return request_tables(self.owner, {name: inst.engine for name, inst in self.loaded.items()})

    # ------------------------------------------------------------------ load / unload

    def register(self, name: str, engine: Engine) -> None:
        state = int(getattr(engine, "state_bytes", 0) or 0)  # the recurrent layers' state pools
        need = int(engine.weight_bytes) + int(engine.kv_bytes) + state
        free, total = self.die.memory()
        if self.die.kind == "cpu" and need > free:
            # A virtual die enforces its budget the way a real one would run out of memory.
            self.close_engine(engine)
            states = f" + recurrent state {state}" if state else ""
            reason = (
                f"{name} needs {need} bytes (weights {engine.weight_bytes} + KV cache {engine.kv_bytes}"
                f"{states}) but {self.die.id} has {free} of its {total}-byte budget free"
            )
            self.send(p.LoadFailed(instance=name, kind="out_of_memory", reason=reason))
            return
        if self.die.kind == "cpu":
            self.die.book(need)
        self.loaded[name] = Instance(engine, need if self.die.kind == "cpu" else 0)
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
        _log_loaded(name, engine, need, self.die.id, state)

    def unload(self, name: str) -> None:
        """Close ``name``'s engine and end its requests (nothing when it is not loaded)."""
        inst = self.loaded.pop(name, None)
        if inst is None:
            return
        for rid in [r for r, i in self.owner.items() if i == name]:
            del self.owner[rid]
        self.close_engine(inst.engine)
        self.die.release(inst.booked_bytes)
        log.info("unloaded %s", name)

    def drop_all(self) -> None:
        """Close every engine and forget every request (a remote worker's rejoin)."""
        for name in list(self.loaded):
            inst = self.loaded.pop(name)
            self.close_engine(inst.engine)
            self.die.release(inst.booked_bytes)
        self.owner.clear()

    def close_engine(self, engine: Engine) -> None:
        try:
            engine.close()
        except Exception:
            log.exception("engine.close() failed")
        del engine
        gc.collect()  # drop the tensors now, so the memory is really free when we say so
        self.die.empty_cache()
        self.trimmer.trim()  # and give the heap back to the system (a CPU die's weights and KV)


def _log_loaded(name: str, engine: Engine, need: int, die_id: str, state: int) -> None:
    """What the log says of a new instance: its booking, and how its CPU path and compile went."""
    log.info(
        "loaded %s (%d bytes booked on %s%s%s)",
        name,
        need,
        die_id,
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
