"""The model registry: which instances exist, their state, refcounts, and request routing;
and ``ModelAssets``, what the router itself reads of a model folder (tokenizer, template, eos).

An ``Instance`` is one loaded copy of a model on one die (or a die list); several instances may
share a name (replicas). States: ``loading`` (the name is taken, nothing routes to it), ``ready``,
``draining`` (no new requests; unload waits for in-flight ones). Routing follows the spec:

- exactly one resident model (one name, however many replicas) takes every request, whatever
  ``model`` says;
- with more, an exact name is needed (a missing name takes the first resident one); an unknown
  name is 404 ``model_not_found``; a name that is only loading, or no model at all, is 503;
- among replicas of one name, the least busy (fewest in-flight requests) wins, except that a
  ``session_id`` goes back to the replica that served it last while that one has a free slot
  (the spec's missing cross-replica session affinity, added).

Each instance has a ``SlotGate``: in single-user mode a second request gets 429 ``server_busy`` at
once; in batched mode requests beyond the slots wait in a FIFO of bounded depth (429 with
``Retry-After: 5`` when full) for at most the queue timeout (429 with ``Retry-After: 2``).

The registry is plain asyncio state (one event loop, no locks needed); it never talks to workers.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pantheon.chat.template import ChatTemplate
from pantheon.openai_api import ApiError, model_not_found, no_model_loaded, server_busy

LOADING, READY, DRAINING = "loading", "ready", "draining"
MAX_SESSIONS = 16384  # session -> replica affinity entries kept (least recently used dropped)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the ByteLevel pre-tokenizer's alphabet."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(v: Any) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


class ModelAssets:
    """What the router needs of a model folder: tokenizer, chat template, eos ids."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tokenizer = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        self.template = ChatTemplate.from_model_dir(self.path)
        src = (self.template.source or "") + (self.template.tool_use_source or "")
        self.reasoning = "<think>" in src or (self.template.is_fallback and self.template.reasoning)
        self.tool_call_markup = "<tool_call>" in src or self.template.is_fallback
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos += _ids(_read_json(self.path / name).get("eos_token_id"))
        if self.template.eos_token:
            tid = self.tokenizer.token_to_id(self.template.eos_token)
            if tid is not None:
                eos.append(tid)
        self.eos_ids = list(dict.fromkeys(eos))
        tj = _read_json(self.path / "tokenizer.json")
        self._byte_level = "ByteLevel" in json.dumps(tj.get("decoder") or {})
        self._bd = _byte_decoder() if self._byte_level else {}
        self._added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self._pieces: dict[int, tuple[str, bytes]] = {}

    def add_eos(self, ids: list[int]) -> None:
        self.eos_ids = list(dict.fromkeys(self.eos_ids + list(ids)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """A token's own text and bytes, for logprobs (``bytes:\\x..`` when not valid UTF-8)."""
        got = self._pieces.get(token_id)
        if got is not None:
            return got
        if token_id in self._added:
            raw = self._added[token_id].encode()
        else:
            tok = self.tokenizer.id_to_token(token_id) or ""
            if self._byte_level and all(c in self._bd for c in tok):
                raw = bytes(self._bd[c] for c in tok)
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                raw = bytes([int(tok[3:5], 16)])
            else:
                raw = tok.replace("\u2581", " ").encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        self._pieces[token_id] = (text, raw)
        return text, raw


class SlotGate:
    """Admission to one instance: ``slots`` running at once, then a bounded FIFO with a timeout."""

    def __init__(self, slots: int, queue_depth: int, timeout_s: float, single_user: bool):
        self.slots = max(1, slots)
        self.queue_depth = 0 if single_user else queue_depth
        self.timeout_s = timeout_s
        self.single_user = single_user
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        if self.active < self.slots and not self.waiting:
            self.active += 1
            return
        if self.single_user:
            raise server_busy()
        if self.waiting >= self.queue_depth:
            raise ApiError(429, "all slots are busy and the queue is full; retry shortly",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "5"})
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed to us as we gave up: pass it on
            else:
                fut.cancel()
            if isinstance(e, TimeoutError):
                raise ApiError(429, f"no slot became free within {self.timeout_s:g} s; retry",
                               type="rate_limit_error", code="queue_timeout",
                               headers={"Retry-After": "2"}) from None
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over; active stays the same
                return
        self.active = max(0, self.active - 1)


@dataclass(eq=False)
class Instance:
    name: str
    instance_id: str
    path: str
    dies: tuple[str, ...]
    gate: SlotGate
    state: str = LOADING
    refs: int = 0
    max_model_len: int | None = None
    assets: Any = None  # the router-side tokenizer/template bundle (ModelAssets)
    loaded: Any = None  # the worker's protocol.Loaded
    created: int = field(default_factory=lambda: int(time.time()))
    _drained: asyncio.Event | None = None

    @property
    def die(self) -> str:
        return self.dies[0]

    def info(self) -> dict:
        return {"name": self.name, "instance": self.instance_id, "path": self.path,
                "dies": list(self.dies), "state": self.state, "in_flight": self.refs,
                "running": self.gate.active, "waiting": self.gate.waiting,
                "max_model_len": self.max_model_len}


class Registry:
    def __init__(self, *, slots: int = 8, queue_depth: int = 32, queue_timeout_s: float = 30.0,
                 single_user: bool | None = None):
        self.slots = slots
        self.queue_depth = queue_depth
        self.queue_timeout_s = queue_timeout_s
        self.single_user = slots <= 1 if single_user is None else single_user
        self._instances: list[Instance] = []
        self._ids = itertools.count(1)
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()

    # ------------------------------------------------------------ table

    def reserve(self, name: str, path: str, dies: tuple[str, ...]) -> Instance:
        """Take a table entry in ``loading`` state; ``discard`` it if the load fails."""
        iid = f"{name}#{next(self._ids)}"
        inst = Instance(name=name, instance_id=iid, path=path, dies=tuple(dies),
                        gate=SlotGate(self.slots, self.queue_depth, self.queue_timeout_s,
                                      self.single_user))
        self._instances.append(inst)
        return inst

    def publish(self, inst: Instance, *, assets: Any = None, loaded: Any = None,
                max_model_len: int | None = None) -> None:
        inst.assets = assets
        inst.loaded = loaded
        inst.max_model_len = max_model_len
        inst.state = READY

    def discard(self, inst: Instance) -> None:
        if inst in self._instances:
            self._instances.remove(inst)

    def instances(self) -> list[Instance]:
        return list(self._instances)

    def ready(self) -> list[Instance]:
        return [i for i in self._instances if i.state == READY]

    def find(self, name_or_id: str) -> list[Instance]:
        """Instances named ``name_or_id``, or the one whose instance id it is."""
        by_id = [i for i in self._instances if i.instance_id == name_or_id]
        return by_id or [i for i in self._instances if i.name == name_or_id]

    def names(self) -> list[str]:
        """Resident (ready) model names, each once, in load order."""
        return list(dict.fromkeys(i.name for i in self.ready()))

    @property
    def has_ready(self) -> bool:
        return any(i.state == READY for i in self._instances)

    # ------------------------------------------------------------ routing

    def route(self, name: str | None, session_id: str | None = None) -> Instance:
        """Pick an instance for a request naming ``name``; raises ``ApiError``. No refcount.

        A ``session_id`` seen before goes back to the replica that served it (its prefix cache
        is warm there) while that replica has a free slot; otherwise the least busy replica."""
        ready = self.ready()
        if not ready:
            raise no_model_loaded()
        names = list(dict.fromkeys(i.name for i in ready))
        if len(names) == 1 or not name:
            target = names[0]
        elif name in names:
            target = name
        elif any(i.name == name for i in self._instances if i.state == LOADING):
            raise ApiError(503, f"model '{name}' is still loading; retry shortly",
                           type="server_error", code="model_not_ready",
                           headers={"Retry-After": "1"})
        else:
            raise model_not_found(name)
        candidates = [i for i in ready if i.name == target]
        if session_id is not None and len(candidates) > 1:
            sticky = self._sessions.get(session_id)
            for i in candidates:
                if i.instance_id == sticky and i.gate.active < i.gate.slots:
                    return i
        # least busy; ties go to the earliest loaded
        return min(candidates, key=lambda i: (i.refs, i.gate.waiting))

    def acquire(self, name: str | None, session_id: str | None = None) -> Instance:
        inst = self.route(name, session_id)
        inst.refs += 1
        return inst

    def _remember(self, session_id: str | None, inst: Instance) -> None:
        if session_id is None:
            return
        self._sessions[session_id] = inst.instance_id
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def release(self, inst: Instance) -> None:
        inst.refs = max(0, inst.refs - 1)
        if inst.refs == 0 and inst._drained is not None:
            inst._drained.set()

    async def admit(self, name: str | None, session_id: str | None = None) -> Instance:
        """Route, take a reference and a slot (may wait in the queue); pair with ``leave``."""
        inst = self.acquire(name, session_id)
        if self.single_user and inst.gate.active >= inst.gate.slots:
            # single-user: another replica of the name may be free
            free = [i for i in self.ready() if i.name == inst.name
                    and i.gate.active < i.gate.slots]
            if free:
                self.release(inst)
                inst = free[0]
                inst.refs += 1
        try:
            await inst.gate.acquire()
        except BaseException:
            self.release(inst)
            raise
        self._remember(session_id, inst)
        return inst

    def leave(self, inst: Instance) -> None:
        inst.gate.release()
        self.release(inst)

    # ------------------------------------------------------------ unload

    async def drain(self, inst: Instance, timeout_s: float | None = None) -> bool:
        """Stop routing to ``inst`` and wait for its in-flight requests; True if they drained."""
        inst.state = DRAINING
        if inst.refs == 0:
            return True
        inst._drained = asyncio.Event()
        try:
            await asyncio.wait_for(inst._drained.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
