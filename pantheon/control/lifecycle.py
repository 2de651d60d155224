"""Loading and unloading instances at runtime, against the dies' budgets.

A load runs the spec's four phases, and whatever fails leaves nothing behind (the row is removed,
the bookings returned, the name free again):

1. reserve: a table row in ``loading`` state; the name is taken but nothing routes to it;
2. place and book: the router sizes the model from its ``config.json`` or GGUF metadata
   (``sizing``: its weights, the state pools of its recurrent layers if it has any (a state
   per slot, a scratch one and the prefix cache's checkpoints: a fixed size, whatever the
   context), and a KV pool of its full context when the die's free memory less those times
   ``--kv-fraction`` holds it, else what that holds but never less than ``--admit-ctx``
   tokens, 8192; ``--kv-budget`` fixes it instead), picks the die(s)
   (``dies.DieManager.place``) and books that there, in one synchronous step. The pool is
   the per-request limit: ``/v1/models`` advertises ``min(max_model_len, pool tokens)``;
3. upload: the worker of the first die loads the weights; one upload at a time (``_upload``
   lock) while every other model keeps serving; the worker's real weight, KV and state figures
   replace the estimate;
4. publish: the instance takes requests (queued ones first).

Phases 1 and 2 run in the load's turn (``pantheon.control.room``: loads place first come first
served); one that finds no room evicts an idle model loaded on demand, or waits for one to be
idle (up to the queue timeout: 429), through ``make_room``.

Errors before the upload come back at once (404 no such folder, 400 bad request or unsupported
architecture, 409 a load or unload of that name in progress or a duplicate replica, 507 no room
that anything could free, or a full table; 429 no room freed in time); a worker's failure comes from phase 3 (507 out of memory, 404/400 what the
worker found wrong with the folder, 500 anything else). With ``wait: false`` the admin call
returns after phase 2 and ``GET /admin/models`` shows the progress, then the instance or the
failure.

Unload marks the instance draining, waits for its in-flight requests up to a deadline (30 s, or
``drain_timeout``), then ends the rest with a clean error (a streamed response gets an error event
and ``[DONE]``), frees the worker's memory and the bookings. By name it unloads every replica (in
parallel), by instance id just that one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

from pantheon import errors
from pantheon.config.settings import ServeConfig
from pantheon.control.dies import DieManager, booked_of
from pantheon.control.feed import Feed
from pantheon.control.load_sizing import LoadSizing
from pantheon.control.registry import DRAINING, FAILED, LOADING, READY, Instance, Registry
from pantheon.control.room import RoomQueue, Turn
from pantheon.core.description import MTP, ModelDescription, mtp_description, shape_digest
from pantheon.core.gguf import GGUFError, find_gguf, served_name
from pantheon.core.kv_types import KvCacheTypes
from pantheon.core.protocol import Loaded, LoadModel, die_host, die_kind
from pantheon.core.sizing import SizingError, estimate, read_shape, state_checkpoints
from pantheon.errors import ApiError
from pantheon.models import generation_defaults
from pantheon.models.assets import ModelAssets
from pantheon.workerlink.pool import DieInfo, LoadFailedError, PoolError, WorkerPool

log = logging.getLogger("pantheon.control.lifecycle")

DEFAULT_DRAIN_S = 30.0
_END_GRACE_S = 2.0  # after ending the requests past the deadline, how long their ends may take
FAILURES_KEPT = 16
FAILURE_SHOWN_S = 600.0  # a failed load stays visible in GET /admin/models this long


def _read_model(path: str) -> ModelDescription:
    """The description of the model at ``path`` (a folder with a ``config.json``, a ``.gguf``
    file or a folder with one); a path that is none of those is a 404, one that does not read
    a 400."""
    try:
        gguf_file = find_gguf(path)
    except GGUFError as e:  # a folder with several .gguf files
        raise errors.unreadable_model(e.kind, e.reason) from None
    if gguf_file is None and (
        not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json"))
    ):
        why = (
            "it is a file but not a .gguf file"
            if os.path.isfile(path)
            else "it needs a config.json or a .gguf file"
            if os.path.isdir(path)
            else "nothing there; give a folder with a config.json, a .gguf file or a folder with one"
        )
        raise errors.no_model_folder(path, why)
    try:
        return read_shape(path)
    except SizingError as e:
        raise errors.unreadable_model(e.kind, e.reason) from None


def _read_draft(path: str, shape: ModelDescription) -> ModelDescription:
    """A draft's description: a model to read (400 naming ``draft`` otherwise) of paged
    attention layers only, or the model's own multi-token-prediction head (``"mtp"``), for a
    model that can verify drafts."""
    if not shape.can_speculate:
        raise errors.invalid_param(
            "draft",
            "'draft': this model cannot speculate (sliding-window layers, or dynamic RoPE)",
        )
    if path == MTP:
        head = mtp_description(shape)
        if head is None:
            raise errors.invalid_param(
                "draft", "'draft': \"mtp\": this model has no multi-token-prediction head (mtp.*)"
            )
        return head
    try:
        d = _read_model(path)
    except ApiError as e:
        raise errors.invalid_param("draft", f"'draft': {e.message}") from None
    if not d.rewindable:
        raise errors.invalid_param(
            "draft",
            "'draft': a draft model must have full-attention layers only (no recurrent or sliding ones)",
        )
    return d


class Endable(Protocol):
    """A generation in flight, as an unload past its drain deadline sees it."""

    inst: Instance

    def end(self, err: ApiError) -> None: ...


class Models:
    """Loads, unloads, cache resets and worker deaths (see the module doc)."""

    def __init__(
        self,
        config: ServeConfig,
        pool: WorkerPool,
        registry: Registry,
        dies: DieManager,
        feed: Feed,
        live: Collection[Endable],
        failed_dies: Collection[str] = (),
    ):
        self.config, self.pool, self.registry = config, pool, registry
        self.dies, self.feed, self.live = dies, feed, live
        self.failures: collections.deque[dict] = collections.deque(maxlen=FAILURES_KEPT)
        self._upload = asyncio.Lock()
        # one model's tokenizer and template read at a time: the read renders the template under
        # a wall-clock bound (pantheon.chat.template), which reads side by side in threads (a
        # burst's loads) would share the GIL against, and fail on a busy host
        self._reading = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._pending: dict[str, asyncio.Task] = {}  # model name -> its load's phases 3-4
        self._starting: dict[str, asyncio.Task[DieInfo]] = {}  # die -> its worker's start
        # Eviction (pantheon.control.residency sets these): at most ``models_max`` instances
        # (0: no count limit); loads place in turn (``room``, FIFO); the head of the line asks
        # ``make_room(turn)``, which evicts an idle instance or waits for a change and says
        # whether to try again (False: nothing will ever free); ``holders(name)`` says what
        # holds the room
        self.models_max = 0
        self.holders: Callable[[str], str] = lambda name: ""
        self.room = RoomQueue(config.queue_depth, config.queue_timeout_s, lambda name: self.holders(name))
        self.make_room: Callable[[Turn], Awaitable[bool]] | None = None
        # dies the supervisor gave up on (more deaths than --worker-restarts): nothing is
        # placed there, or a load would start their worker again round the restart limit
        self.failed_dies = failed_dies

    # ------------------------------------------------------------ workers

    async def ensure_worker(self, die: str) -> None:
        """Start ``die``'s worker unless it runs; its Hello sizes a CUDA die. A start already
        under way (the start-up's, a load's, a restart's) is waited for, not begun again:
        every caller gets its outcome."""
        known = {d.die: d for d in self.pool.dies()}
        if die in known and known[die].alive:
            return
        task = self._starting.get(die)
        if task is None:
            task = asyncio.create_task(self._start_worker(die), name=f"start-{die}")
            self._starting[die] = task
            self._tasks.add(task)
            task.add_done_callback(lambda t: self._started(die, t))
        # shielded: a caller that goes away does not stop a start others wait for
        await asyncio.shield(task)

    async def _start_worker(self, die: str) -> DieInfo:
        # a remote die is not spawned: start_worker waits for its worker to join
        budget = self.dies.cpu_budget if die_kind(die) == "cpu" and not die_host(die) else None
        info = await self.pool.start_worker(die, budget_bytes=budget)
        self.dies.on_worker(die, info.total_bytes, info.free_bytes, info.device_name)
        return info

    def _started(self, die: str, task: asyncio.Task[DieInfo]) -> None:
        self._tasks.discard(task)
        if self._starting.get(die) is task:
            del self._starting[die]
        if not task.cancelled():
            task.exception()  # retrieved: each waiter got it

    def sync_dies(self) -> None:
        """Copy the workers' latest memory figures into the die manager (a few times a second)."""
        for d in self.pool.dies():
            if d.alive:
                self.dies.on_worker(d.die, d.total_bytes, d.free_bytes, d.device_name)

    def worker_joined(self, die: str) -> None:
        """A worker on another host joined (the pool's ``on_worker_joined``): its die exists now."""
        for d in self.pool.dies():
            if d.die == die:
                self.dies.on_worker(die, d.total_bytes, d.free_bytes, d.device_name)
                where = f" on {d.hostname}" if d.hostname else ""
                self.feed.event("worker_joined", f"a worker joined as {die}{where} ({d.device_name})")

    def worker_dead(self, die: str, reason: str) -> None:
        """A worker died: its instances fail (their memory went with the process)."""
        self.feed.event("worker_dead", f"the worker of {die} died: {reason}")
        for inst in self.registry.instances():
            if die == inst.die and inst.state in (READY, DRAINING):
                log.error("instance %s is failed: its worker on %s died", inst.instance_id, die)
                self.registry.fail(inst, f"its worker on {die} died: {reason}")
                self.dies.release(inst.instance_id)

    # ------------------------------------------------------------ load

    def _check_new(self, name: str, dies: tuple[str, ...]) -> None:
        for inst in self.registry.instances():
            if inst.name != name:
                continue
            if inst.state == LOADING:
                raise errors.load_in_progress(name, inst.instance_id)
            if inst.state == DRAINING:
                raise errors.unload_in_progress(name, inst.instance_id)
            if dies and inst.dies == dies and inst.state == READY:
                raise errors.duplicate_replica(inst.instance_id, name, dies)

    async def start_load(
        self,
        path: str,
        name: str | None = None,
        dies: tuple[str, ...] = (),
        quantize: bool = False,
        *,
        slots: int | None = None,
        max_context: int | None = None,
        background: bool = False,
        worker_path: str | None = None,
        params: dict[str, float | int] | None = None,
        embeddings: bool = False,
        kv_cache_dtype: KvCacheTypes | None = None,
        draft: str | None = None,
    ) -> tuple[Instance, asyncio.Task]:
        """Phases 1 and 2 (raise ``ApiError`` at once); phase 3 and 4 run in the returned task,
        which ends with the instance published or raises the load's ``ApiError``.

        ``background``: nobody waits for the outcome (``wait: false``), so a failure is kept
        for ``GET /admin/models`` to show; a waiting caller gets the error itself.
        ``worker_path``: where the worker finds the weights when its host keeps them elsewhere
        (a remote die); the router reads ``path``. ``params``: the catalog entry's sampling
        defaults (``Instance.params``, over the model's own: ``generation_defaults``); a
        value no request could hold is a 400 naming it. ``kv_cache_dtype``: the KV cache's
        types (None: ``--kv-cache-dtype``); sizing and admission count their real bytes.
        ``draft``: a draft model for speculation (``workers/draft.py``), booked with the
        instance; the worker refuses one whose tokenizer differs (400)."""
        name = name or served_name(path)
        try:
            params = generation_defaults.check_params(params)
        except ValueError as e:
            raise errors.invalid_param("params", f"'params': {e}") from None
        shape = _read_model(path)
        kv_types = kv_cache_dtype or self.config.kv_types
        why = shape.kv_types_problem(kv_types)
        if why:
            raise errors.kv_cache_dtype_refused(str(kv_types), why)
        draft_shape = _read_draft(draft, shape) if draft is not None else None
        dies = tuple(self.dies.check(d) for d in dies)
        self._check_new(name, dies)
        try:
            async with self._reading:
                assets = await asyncio.to_thread(ModelAssets, path)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer or template
            raise errors.unreadable_assets(e) from None
        self._check_new(name, dies)  # again: another load may have started meanwhile
        for die in dies:
            if die_kind(die) == "cuda" or die_host(die):  # its worker's Hello tells the die's size
                await self._start(die)
        sizing = self._sizing(shape, quantize, slots, max_context, kv_types)
        sizing.draft, sizing.draft_is_head = draft_shape, draft == MTP
        inst = await self._reserve_and_place(name, path, dies, sizing, worker_path)
        inst.quantize, inst.max_model_len, inst.load_progress = quantize, sizing.mml, 0.0
        inst.kv_types = kv_types
        inst.params = params
        inst.embeddings = embeddings
        inst.estimate, inst.shape = sizing.estimate(inst.die), shape
        inst.load_msg = self._load_message(inst, worker_path or os.path.abspath(path), sizing)
        if draft is not None:  # the worker's host reads the draft at the router's path
            inst.load_msg.draft = draft if draft == MTP else os.path.abspath(draft)
        self.feed.event(
            "load",
            f"loading {path} as {inst.instance_id} on {','.join(inst.dies)}",
            model=name,
            instance=inst.instance_id,
        )
        task = asyncio.create_task(
            self._finish_load(inst, assets, background), name=f"load-{inst.instance_id}"
        )
        self._tasks.add(task)
        self._pending[name] = task
        task.add_done_callback(self._load_done)
        return inst, task

    def _sizing(
        self,
        shape: ModelDescription,
        quantize: bool,
        slots: int | None,
        max_context: int | None,
        kv_types: KvCacheTypes,
    ) -> LoadSizing:
        """How this load is sized: its context, its slots, what the workers' CPU paths allow."""
        cfg = self.config
        limit = shape.context_limit
        mml = min(max_context or cfg.max_model_len or limit, limit)
        n_slots = slots or cfg.slots
        return LoadSizing(
            shape=shape,
            config=cfg,
            dies=self.dies,
            quantize=quantize,
            mml=mml,
            floor=min(cfg.admit_ctx, mml),
            n_slots=n_slots,
            checkpoints=state_checkpoints(n_slots, cfg.state_checkpoints),
            cpu_works={d.die: d.cpu_paths for d in self.pool.dies() if d.cpu_paths},
            kv_types=kv_types,
        )

    async def _reserve_and_place(
        self, name: str, path: str, dies: tuple[str, ...], sizing: LoadSizing, worker_path: str | None
    ) -> Instance:
        """Phases 1 and 2, in the load's turn (``room``: first come first served): reserve the
        name, place the instance and book its bytes; with no room, evict an idle model or wait
        for one (``make_room``) and try again, else say what holds it."""
        async with self.room.turn(name) as turn:
            return await self._place_in_turn(turn, name, path, dies, sizing, worker_path)

    async def _place_in_turn(
        self,
        turn: Turn,
        name: str,
        path: str,
        dies: tuple[str, ...],
        sizing: LoadSizing,
        worker_path: str | None,
    ) -> Instance:
        while True:
            await self._room_by_count(turn)
            self._check_new(name, dies)  # a wait or an eviction: another load may have started
            # phase 1: the name is taken (507 when the table is full)
            inst = self.registry.reserve(name, path, dies, slots=sizing.n_slots)
            try:
                # phase 2: place and book, synchronously: no other load can take the same bytes
                inst.dies = self.dies.place(sizing.need, dies, self._candidates())
                local = [d for d in inst.dies if not die_host(d)]
                if worker_path and local:  # the router's own workers read the router's own files
                    raise errors.invalid_param(
                        "worker_path",
                        f"'worker_path' applies to dies on other hosts only; this load is placed on "
                        f"{', '.join(local)}: leave it out (or name remote dies in 'dies')",
                    )
                self.dies.book(inst.instance_id, sizing.need(inst.dies))
                return inst
            except ApiError as e:
                self.registry.discard(inst)
                if e.status != 507 or e.code == "table_full":
                    raise
                # no die has room: unload an idle model (or wait for one) and try again, else
                # say what holds it
                if self.make_room is None or not await self.make_room(turn):
                    raise self._no_room(e, name) from None
                sizing.clear()  # the free memory changed: size again
            except BaseException:
                self.registry.discard(inst)
                raise

    def _candidates(self) -> list[str]:
        """The dies a load may be placed on: known, not given up on, and a live worker's (a
        local CPU die's worker starts with the load)."""
        alive = {d.die for d in self.pool.dies() if d.alive}
        failed = set(self.failed_dies)
        return [
            d.id
            for d in self.dies.dies()
            if d.known and d.id not in failed and ((d.kind == "cpu" and not d.remote) or d.id in alive)
        ]

    def _load_message(self, inst: Instance, worker_path: str, sizing: LoadSizing) -> LoadModel:
        """What the worker is asked: ``worker_path`` is the model as the worker's host has it."""
        cfg = self.config
        return LoadModel(
            instance=inst.instance_id,
            path=worker_path,
            dtype=cfg.dtype,
            devices=list(inst.dies),
            kv_budget_bytes=sizing.kv_bytes(inst.dies),
            num_slots=inst.gate.slots,
            prefill_chunk=cfg.prefill_chunk,
            step_target_s=cfg.ops.step_target_s,
            max_model_len=sizing.mml,
            quantize=sizing.quantize,
            state_checkpoints=sizing.checkpoints,
            kv_cache_k=sizing.kv_types.k,
            kv_cache_v=sizing.kv_types.v,
            speculative=cfg.speculative,
        )

    async def _room_by_count(self, turn: Turn) -> None:
        """Below ``models_max`` instances (loading or loaded), evicting idle ones (or waiting
        for one to be idle) if need be."""
        while self.models_max and len(self.registry.instances()) >= self.models_max:
            if self.make_room is None or not await self.make_room(turn):
                raise errors.models_max_reached(self.models_max, self.holders(turn.name))

    def _no_room(self, e: ApiError, name: str) -> ApiError:
        held = self.holders(name) if self.make_room is not None else ""
        if not held:
            return e
        return errors.insufficient_memory(f"{e.message}; held by {held}, none of which can be evicted")

    def pending(self, name: str) -> asyncio.Task | None:
        """The task of a load of ``name`` in progress (phases 3-4), if any."""
        return self._pending.get(name)

    def _load_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        for name, t in list(self._pending.items()):
            if t is task:
                del self._pending[name]
        if not task.cancelled():
            task.exception()  # retrieved: a wait:false failure is reported in /admin/models

    async def _start(self, die: str) -> None:
        try:
            await self.ensure_worker(die)
        except PoolError as e:
            raise errors.worker_start_failed(e) from None

    async def load(
        self, path: str, name: str | None = None, dies: tuple[str, ...] = (), quantize: bool = False, **kw
    ) -> Instance:
        """Load and wait until the instance is ready; raises ``ApiError``."""
        _, task = await self.start_load(path, name, dies, quantize, **kw)
        # shielded: a client that goes away does not stop the load (it shows in /admin/models)
        return await asyncio.shield(task)

    async def _finish_load(self, inst: Instance, assets: ModelAssets, background: bool) -> Instance:
        msg = inst.load_msg
        assert msg is not None  # set when the load was placed

        def progress(p) -> None:
            inst.load_progress = p.done / p.total if p.total else None

        try:
            async with self._upload:  # phase 3: one upload at a time
                await self._start(inst.die)
                loaded = await self.pool.load(inst.die, msg, progress)
                if msg.path != os.path.abspath(inst.path):  # a worker_path: the same model?
                    await self._check_same_model(inst, loaded)
        except BaseException as e:
            err = self._load_error(e)
            self.registry.discard(inst)
            self.dies.release(inst.instance_id)
            if background:
                self.failures.append(
                    {
                        "name": inst.name,
                        "instance": inst.instance_id,
                        "path": inst.path,
                        "dies": list(inst.dies),
                        "state": FAILED,
                        "error": err.message,
                        "status": err.status,
                        "code": err.code,
                        "failed_at": time.time(),
                    }
                )
            self.feed.event(
                "load_failed",
                f"{inst.instance_id}: {err.message}",
                model=inst.name,
                instance=inst.instance_id,
            )
            log.warning("load of %s failed: %s", inst.instance_id, err.message)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise err from None
        # phase 4: book the real figures, publish
        assert inst.shape is not None and inst.estimate is not None  # sized when it was placed
        if loaded.cpu_path:  # the path is known now: size with it, not the upper bound
            inst.cpu_path = loaded.cpu_path
            inst.estimate = estimate(
                inst.shape, quantize=inst.quantize, cpu_path=loaded.cpu_path, kv_types=inst.kv_types
            )
        self.dies.book(inst.instance_id, booked_of(inst.estimate, inst.dies, loaded))
        if inst.estimate.kv_per_token:  # the KV pool alone: the state pools hold no tokens
            inst.kv_pool_tokens = loaded.kv_bytes // inst.estimate.kv_per_token
        assets.add_eos(loaded.eos_token_ids)
        self.registry.publish(inst, assets=assets, loaded=loaded, max_model_len=loaded.max_model_len)
        self.feed.event(
            "loaded",
            f"{inst.instance_id} is ready on {','.join(inst.dies)} "
            f"(weights {loaded.weight_bytes} B, KV {loaded.kv_bytes} B"
            + (f", state {loaded.state_bytes} B)" if loaded.state_bytes else ")"),
            model=inst.name,
            instance=inst.instance_id,
        )
        log.info(
            "loaded %s as %s on %s (max_model_len %d)",
            inst.name,
            inst.instance_id,
            ",".join(inst.dies),
            loaded.max_model_len,
        )
        return inst

    async def _check_same_model(self, inst: Instance, loaded: Loaded) -> None:
        """A ``worker_path`` must hold the model ``path`` describes (the router's tokenizer,
        template and sizes are ``path``'s): the worker's report is compared with the router's
        description, its vocabulary and its ``shape_digest`` (architecture, vocabulary, every
        layer's kind, shapes and cache); a mismatch is unloaded and refused (400). A fine-tune
        of the same shape is not told apart (that would need the weights)."""
        shape = inst.shape
        want = getattr(shape, "vocab_size", None)
        why = ""
        if want is not None and loaded.vocab_size != want:
            why = (
                f"the worker's model has a vocabulary of {loaded.vocab_size} tokens, 'path' describes {want}"
            )
        elif isinstance(shape, ModelDescription) and loaded.shape_digest:
            if loaded.shape_digest != shape_digest(shape):
                why = (
                    "the worker's model has other layers (architecture, sizes or layer kinds) "
                    f"than 'path' describes ({shape.arch}, {shape.num_layers} layers of {shape.hidden_size})"
                )
        if not why:
            return
        with contextlib.suppress(PoolError, KeyError):
            await self.pool.unload(inst.die, inst.instance_id)
        raise errors.invalid_param("worker_path", f"'worker_path' holds another model than 'path': {why}")

    @staticmethod
    def _load_error(e: BaseException) -> ApiError:
        if isinstance(e, ApiError):
            return e
        if isinstance(e, LoadFailedError):
            return errors.load_failed(e.kind, e.reason)
        if isinstance(e, PoolError):
            return errors.load_worker_died(e)
        if isinstance(e, asyncio.CancelledError):
            return errors.load_cancelled()
        log.exception("load failed", exc_info=e)
        return errors.load_internal_error(e)

    def recent_failures(self) -> list[dict]:
        cut = time.time() - FAILURE_SHOWN_S
        return [f for f in self.failures if f["failed_at"] >= cut]

    # ------------------------------------------------------------ unload

    async def unload(self, target: str, drain_timeout: float | None = None) -> list[dict]:
        """Unload every replica named ``target``, or the instance whose id it is."""
        insts = self.registry.find(target)
        if not insts:
            raise errors.no_such_instance(target)
        todo = [i for i in insts if i.state in (READY, FAILED)]
        if not todo:
            raise errors.unload_conflict(target)
        timeout = DEFAULT_DRAIN_S if drain_timeout is None else drain_timeout
        return list(await asyncio.gather(*(self._unload_one(i, timeout) for i in todo)))

    async def _unload_one(self, inst: Instance, timeout: float) -> dict:
        t0 = time.monotonic()
        self.feed.event(
            "unload",
            f"unloading {inst.instance_id} (drain up to {timeout:g} s, {inst.refs} in flight)",
            model=inst.name,
            instance=inst.instance_id,
        )
        drained = await self.registry.drain(inst, timeout)
        ended = 0
        if not drained:  # past the deadline: end the rest with a clean error
            for gen in list(self.live):
                if gen.inst is inst:
                    gen.end(errors.model_unloaded(inst.name))
                    ended += 1
            await self.registry.drain(inst, _END_GRACE_S)
        self.registry.discard(inst)
        self.dies.release(inst.instance_id)
        with contextlib.suppress(PoolError, KeyError):
            await self.pool.unload(inst.die, inst.instance_id)
        took = time.monotonic() - t0
        self.feed.event(
            "unloaded",
            f"{inst.instance_id} unloaded after {took:.1f} s"
            + (f" ({ended} request(s) ended at the deadline)" if ended else ""),
            model=inst.name,
            instance=inst.instance_id,
        )
        return {
            "instance": inst.instance_id,
            "name": inst.name,
            "drained": drained,
            "ended": ended,
            "seconds": round(took, 3),
        }

    # ------------------------------------------------------------ the prefix cache

    def reset_cache(self, name: str | None = None) -> list[str]:
        """Forget the cached prefixes of ``name``'s instances (all models when None)."""
        if name is None:
            insts = self.registry.ready()
        else:
            insts = [i for i in self.registry.find(name) if i.state == READY]
            if not insts:
                raise errors.no_ready_instance(name)
        for inst in insts:
            with contextlib.suppress(PoolError, KeyError):
                self.pool.reset_cache(inst.die, inst.instance_id)
        return [i.instance_id for i in insts]

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
