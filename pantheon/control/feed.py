"""The router's live feed: recent events, counters and throughput, and the ``Snapshot`` built from
them for ``GET /admin/state`` and ``GET /admin/events`` (schema: ``pantheon.snapshot``).

- Events (load, loaded, load_failed, unload, unloaded, worker_dead, reject_429, reject_503) go
  into a ring of the last ``RING`` and to every subscriber's queue (the SSE streams). Rejections
  can come by the thousand in a second: each is counted, but at most one event per kind and model
  per second is made (its message says how many it stands for).
- Throughput: generated tokens and finished requests per second over a sliding window of
  ``WINDOW_S`` seconds; time to first token p50/p99 over the last ``TTFT_KEPT`` requests.
- The catalog (``catalog_models``): every model the server can serve with its status as
  ``/v1/models`` gives it, and a loaded one's keep-alive expiry (``pantheon.control.residency``).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import TYPE_CHECKING, Any

import msgspec

from pantheon import snapshot as st
from pantheon.control.live import DieFacts, InstanceFacts, Projection
from pantheon.control.registry import READY

if TYPE_CHECKING:
    from pantheon.control.catalog import CatalogEntry
    from pantheon.control.residency import Residency

RING = 200
WINDOW_S = 5.0
TTFT_KEPT = 512
_REJECT_EVERY_S = 1.0
_SUBSCRIBER_BACKLOG = 1000  # events a slow SSE client may fall behind before it loses some


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


class Feed:
    def __init__(self) -> None:
        self.started_at = time.time()
        self.events: collections.deque[st.Event] = collections.deque(maxlen=RING)
        self.counters = st.Counters()
        self._subs: set[asyncio.Queue] = set()
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._done: collections.deque[float] = collections.deque()
        self._ttft: collections.deque[float] = collections.deque(maxlen=TTFT_KEPT)
        self._rejects: dict[tuple[str, str | None], list] = {}  # -> [last event at, unsent]

    # ------------------------------------------------------------ events

    def event(
        self, kind: str, message: str, *, model: str | None = None, instance: str | None = None
    ) -> st.Event:
        ev = st.Event(ts=time.time(), kind=kind, message=message, model=model, instance=instance)
        self.events.append(ev)
        for q in list(self._subs):
            if q.qsize() < _SUBSCRIBER_BACKLOG:
                q.put_nowait(ev)
        if kind == "loaded":
            self.counters.loads += 1
        elif kind == "load_failed":
            self.counters.load_failures += 1
        elif kind == "unloaded":
            self.counters.unloads += 1
        return ev

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._subs.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subs.discard(q)

    def close(self) -> None:
        """The server stops: every subscriber gets ``None`` (its stream ends)."""
        for q in list(self._subs):
            q.put_nowait(None)

    def reject(self, status: int, model: str | None, code: str | None, message: str) -> None:
        """A request was refused with 429 or 503."""
        if status == 429:
            self.counters.rejected_429 += 1
        elif status == 503:
            self.counters.rejected_503 += 1
        else:
            return
        kind = f"reject_{status}"
        now = time.monotonic()
        slot = self._rejects.setdefault((kind, model), [0.0, 0])
        slot[1] += 1
        if now - slot[0] < _REJECT_EVERY_S:
            return  # counted; the next event says how many it stands for
        n, slot[0], slot[1] = slot[1], now, 0
        text = f"{status} {code or ''}: {message}".strip()
        if n > 1:
            text += f" (and {n - 1} more since the last)"
        self.event(kind, text, model=model)

    # ------------------------------------------------------------ throughput

    def tokens(self, n: int) -> None:
        if n > 0:
            self.counters.tokens += n
            self._tokens.append((time.monotonic(), n))

    def request_done(self, ttft_s: float | None) -> None:
        self.counters.requests += 1
        self._done.append(time.monotonic())
        if ttft_s is not None:
            self._ttft.append(ttft_s)

    def throughput(self) -> st.Throughput:
        now = time.monotonic()
        cut = now - WINDOW_S
        while self._tokens and self._tokens[0][0] < cut:
            self._tokens.popleft()
        while self._done and self._done[0] < cut:
            self._done.popleft()
        span = min(WINDOW_S, max(1e-3, time.time() - self.started_at))
        ttft = list(self._ttft)
        return st.Throughput(
            tokens_per_s=sum(n for _, n in self._tokens) / span,
            requests_per_s=len(self._done) / span,
            ttft_p50_s=_pct(ttft, 0.50),
            ttft_p99_s=_pct(ttft, 0.99),
        )


# ---------------------------------------------------------------- the snapshot


def instance_state(f: InstanceFacts) -> st.InstanceState:
    inst, es = f.inst, f.engine
    slots = [
        st.SlotState(
            state=s.state,
            request_id=s.request_id,
            prompt_tokens=s.prompt_tokens,
            prefilled=s.prefilled,
            generated=s.generated,
            session_id=s.session_id,
        )
        for s in (es.slots if es is not None else [])
    ]
    return st.InstanceState(
        id=inst.instance_id,
        name=inst.name,
        path=inst.path,
        dies=list(inst.dies),
        state=inst.state,
        error=inst.error,
        last_error=inst.last_error,
        last_error_at=inst.last_error_at,
        load_progress=inst.load_progress,
        weights_bytes=f.weights_bytes,
        kv_bytes=f.kv_bytes,
        state_bytes=f.state_bytes,
        quantized=bool(inst.quantize),
        kv_cache_dtype=str(inst.kv_types),
        max_model_len=int(inst.max_model_len or 0),
        slots=slots,
        in_flight=inst.refs,
        queued=f.queued,
        restarts=int(inst.restarts or 0),
        cache_hit_rate=f.hit_rate,
        kv_blocks_used=int(es.kv_blocks_used) if es is not None else 0,
        kv_blocks_total=int(es.kv_blocks_total) if es is not None else 0,
        prefill_budget=int(es.prefill_budget) if es is not None else 0,
        draft=es.spec_draft if es is not None else "",
        spec_verify_steps=int(es.spec_verify_steps) if es is not None else 0,
        spec_drafted=int(es.spec_drafted) if es is not None else 0,
        spec_accepted=int(es.spec_accepted) if es is not None else 0,
        spec_emitted=int(es.spec_emitted) if es is not None else 0,
    )


def die_state(f: DieFacts) -> st.DieState:
    d, w = f.die, f.worker
    return st.DieState(
        id=d.id,
        device_name=d.device_name or (w.device_name if w is not None else ""),
        total_bytes=d.total_bytes,
        budget_bytes=d.budget_bytes,
        weights_bytes=d.weights_bytes,
        kv_bytes=d.kv_bytes,
        state_bytes=d.state_bytes,
        free_bytes=max(0, d.budget_bytes - d.used_bytes),
        pressure=f.pressure,
        # a CPU die without a worker yet is usable (its worker starts on the first load)
        alive=w.alive if w is not None else d.kind == "cpu",
        error=w.error if w is not None and not w.alive else None,
        instances=f.hosted,
        isa=w.cpu_isa if w is not None else "",
        cpu_path=f.cpu_path,
        restarts=int(w.restarts) if w is not None else 0,
        last_death=w.last_death if w is not None else None,
        host=f.host,
    )


def _keep_alive(entry: CatalogEntry) -> float | None:
    """The entry's keep-alive on the wire: JSON has no infinity, so forever is -1 (Ollama's)."""
    if entry.keep_alive is None:
        return None
    return -1.0 if math.isinf(entry.keep_alive) else float(entry.keep_alive)


def catalog_models(residency: Residency, live: Projection, now: float) -> list[st.CatalogModel]:
    """Every catalog entry with its status (``Residency.status``, as ``/v1/models``) and, when
    loaded, the seconds until it is unloaded if left idle: its last ready instance's expiry
    (None: one of them stays for ever, or it is pinned)."""
    residency.catalog.refresh()  # a model copied into a --models-dir folder shows at once
    out = []
    for e in residency.catalog.entries():
        status = residency.status(e.name)
        ready = [f.inst for f in live.instances if f.inst.name == e.name and f.inst.state == READY]
        whens = [w for w in (residency.expires_at(i) for i in ready) if w is not None]
        # the model stays loaded while any of its instances does
        expires = max(0.0, max(whens) - now) if whens and len(whens) == len(ready) else None
        out.append(
            st.CatalogModel(
                name=e.name,
                status=status["value"],
                reason=status.get("reason"),
                aliases=list(e.aliases),
                path=e.path,
                dies=list(e.dies),
                quantize=e.quantize,
                pinned=e.pin,
                preload=e.preload,
                keep_alive_s=_keep_alive(e),
                expires_in_s=expires,
            )
        )
    return out


def snapshot(
    live: Projection, feed: Feed, pressure: Any, queue_depth: int, residency: Residency
) -> st.Snapshot:
    """The whole ``Snapshot``: one ``project`` of the live state, with the feed's figures and
    the residency's catalog."""
    now = time.time()
    total, avail = pressure.host_memory()
    die_list = [die_state(f) for f in live.dies]
    names = list(dict.fromkeys(f.inst.name for f in live.instances))
    queues = live.queues
    qs = [
        st.QueueState(
            model=n,
            depth=len(queues[n]) if n in queues else 0,
            max_depth=queue_depth,
            oldest_wait_s=queues[n].oldest_wait_s() if n in queues else 0.0,
        )
        for n in names
    ]
    level = max([pressure.host_level(), *(d.pressure for d in die_list)])
    return st.Snapshot(
        ts=now,
        started_at=feed.started_at,
        pressure=level,
        host_total_bytes=total,
        host_available_bytes=avail,
        dies=die_list,
        instances=[instance_state(f) for f in live.instances],
        queues=qs,
        throughput=feed.throughput(),
        counters=msgspec.structs.replace(feed.counters),
        events=list(feed.events),
        catalog=catalog_models(residency, live, now),
    )
