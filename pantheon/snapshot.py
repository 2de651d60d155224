"""The router's live snapshot: what ``GET /admin/state`` returns and ``/admin/events`` streams.

One ``Snapshot`` per refresh holds everything the dashboard shows. The router builds it; the
TUI decodes it with ``decode_snapshot`` (this module imports only msgspec, so the TUI may use
it without pulling in the router). Byte counts are ints, times are seconds (floats),
``pressure`` is 0 (normal) .. 3 (critical).
"""

from __future__ import annotations

import msgspec

SNAPSHOT_VERSION = 1


class SlotState(msgspec.Struct, kw_only=True):
    state: str  # idle | prefill | decode
    request_id: str | None = None
    prompt_tokens: int = 0
    prefilled: int = 0  # prompt tokens in the cache so far (prefill progress)
    generated: int = 0  # tokens decoded so far
    session_id: str | None = None  # a warm session's id (its blocks are resident)


class InstanceState(msgspec.Struct, kw_only=True):
    id: str  # unique instance id
    name: str  # served model name (replicas share it)
    path: str
    dies: list[str]
    state: str  # loading | ready | draining | failed
    error: str | None = None  # why it failed, while it is failed
    last_error: str | None = None  # the latest failure, kept after it is ready again
    last_error_at: float | None = None  # unix time of it
    load_progress: float | None = None  # 0..1 while loading
    weights_bytes: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0  # recurrent layers' state pools (hybrid models; 0 for others)
    quantized: bool = False
    kv_cache_dtype: str = "auto"  # its KV cache's types ("q8_0", or "K/V" when they differ)
    max_model_len: int = 0
    slots: list[SlotState] = []
    in_flight: int = 0
    queued: int = 0
    restarts: int = 0
    cache_hit_rate: float | None = None  # prefix cache, blocks reused / looked up
    kv_blocks_used: int = 0  # KV blocks requests hold (not those kept only for the prefix cache)
    kv_blocks_total: int = 0
    prefill_budget: int = 0  # prompt tokens the engine's next step may prefill
    # speculation since load (the worker's InstanceStats.spec_*): the draft model's path ("mtp":
    # the model's own multi-token-prediction head; "": drafts from prompt lookup), sequence-steps
    # that verified a draft, draft tokens verified, of them accepted, and tokens those steps emitted
    draft: str = ""
    spec_verify_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_emitted: int = 0


class DieState(msgspec.Struct, kw_only=True):
    id: str  # cpu:0 | cuda:N
    device_name: str
    total_bytes: int
    budget_bytes: int  # total minus the reserve
    weights_bytes: int = 0  # booked by instances' weights
    kv_bytes: int = 0  # booked by KV caches
    state_bytes: int = 0  # booked by recurrent layers' state pools (hybrid models)
    free_bytes: int = 0  # budget minus what is booked
    pressure: int = 0
    alive: bool = True
    error: str | None = None
    instances: list[str] = []  # instance ids with memory on this die
    isa: str = ""  # CPU dies: torch's vector ISA there (avx512 | avx2 | ...)
    cpu_path: str = ""  # CPU dies: the linear-layer path(s) its instances run (workers/cpu_paths.py)
    restarts: int = 0  # times its worker was started again after dying
    last_death: str | None = None  # why its worker last died (kept after the restart)
    host: str | None = None  # a remote die's machine (its worker joined over TCP); None when local


class QueueState(msgspec.Struct, kw_only=True):
    model: str
    depth: int
    max_depth: int
    oldest_wait_s: float = 0.0


class Throughput(msgspec.Struct, kw_only=True):
    tokens_per_s: float = 0.0  # generated tokens over the last few seconds
    requests_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None


class Counters(msgspec.Struct, kw_only=True):
    requests: int = 0
    tokens: int = 0
    rejected_429: int = 0
    rejected_503: int = 0
    loads: int = 0
    unloads: int = 0
    load_failures: int = 0


class Event(msgspec.Struct, kw_only=True):
    ts: float  # unix time
    kind: str  # load | loaded | load_failed | unload | unloaded | worker_dead | reject_429 | reject_503 | ...
    message: str
    model: str | None = None
    instance: str | None = None


class CatalogModel(msgspec.Struct, kw_only=True):
    """One entry of the router's model catalog (``pantheon.control.catalog``), loaded or not."""

    name: str
    status: str  # loaded | loading | unloaded | failed (as /v1/models' status.value)
    reason: str | None = None  # why it failed (failed only)
    aliases: list[str] = []
    path: str = ""  # on the router's host (the snapshot is admin-only)
    dies: list[str] = []  # configured dies; empty: placed automatically
    quantize: bool = False  # configured int8 weight-only quantization
    pinned: bool = False  # never unloaded by keep-alive or eviction
    preload: bool = False  # loaded at start
    keep_alive_s: float | None = None  # configured keep-alive; None: the server's; negative: forever
    expires_in_s: float | None = None  # loaded: seconds until it is unloaded if left idle; None: never


class Snapshot(msgspec.Struct, kw_only=True):
    version: int = SNAPSHOT_VERSION
    ts: float  # unix time the snapshot was taken
    started_at: float  # router start, unix time
    pressure: int = 0  # the worst of host and dies
    host_total_bytes: int = 0
    host_available_bytes: int = 0
    dies: list[DieState] = []
    instances: list[InstanceState] = []
    queues: list[QueueState] = []
    throughput: Throughput = msgspec.field(default_factory=Throughput)
    counters: Counters = msgspec.field(default_factory=Counters)
    events: list[Event] = []  # the most recent, oldest first
    catalog: list[CatalogModel] = []  # every model the router can serve (empty from older routers)


_decoder = msgspec.json.Decoder(Snapshot)


def decode_snapshot(data: bytes | str) -> Snapshot:
    """Parse the JSON of ``GET /admin/state`` (unknown fields are ignored: newer routers)."""
    return _decoder.decode(data)


def encode(obj: msgspec.Struct) -> bytes:
    return msgspec.json.encode(obj)
