"""What an engine is built from: one model on its dies, sized by the router.

``EngineSpec`` is both the engine's argument (``workers.engine.Engine``) and, with the instance id
the router gave it, the load message (``pantheon.core.protocol.LoadModel`` is an ``EngineSpec``),
so a field is named once and its default is said once: here. The router's settings table
(``pantheon/config/table.py``) takes its defaults for the same knobs from the constants below.

Torch-free (the router imports it): a ``msgspec.Struct`` like the other wire types.
"""

from __future__ import annotations

import msgspec

from pantheon.core.kv_types import KvCacheTypes

SLOTS = 8  # sequences one engine runs at once (batch slots)
PREFILL_CHUNK = 512  # the most prompt tokens one step prefills (workers/step_budget.py: a ceiling)
STEP_TARGET_S = 0.5  # seconds a step should take: prefill is sized to it (a CPU stream's wait)
KV_BUDGET_BYTES = 256 << 20  # the paged K/V pool's bytes (the router sizes it per load)
BLOCK_SIZE = 16  # tokens per K/V block


class EngineSpec(msgspec.Struct, kw_only=True):
    """One engine: the model at ``path`` on ``devices`` and everything its construction decides
    by (``workers/engine_build.py`` reads it in named steps). The router sends the fields above
    ``block_size``; the rest are the in-process knobs of tests and benches (a worker keeps their
    defaults: environment switches such as ``PANTHEON_CPU_PATH`` decide there)."""

    path: str
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    devices: list[str] = []  # e.g. ["cuda:0"] or ["cuda:0", "cuda:1"] (layers split), ["cpu"]; []: cpu
    kv_budget_bytes: int = KV_BUDGET_BYTES
    num_slots: int = SLOTS
    prefill_chunk: int = PREFILL_CHUNK
    step_target_s: float = STEP_TARGET_S
    max_model_len: int | None = None  # None: the model's own context limit
    quantize: bool = False  # int8 weights (the CPU paths' int8, or workers/quant.py elsewhere)
    # a hybrid model's prefix-cache state checkpoints (router-sized); None: two per slot
    # (pantheon.core.sizing.state_checkpoints); 0: no prefix cache for such a model
    state_checkpoints: int | None = None
    # the K and the V cache's types (pantheon.core.kv_types: auto | q8_0 | q4_0 | fp8_e4m3); the
    # router sized kv_budget_bytes with them, the worker lays its pool out in them
    kv_cache_k: str = "auto"
    kv_cache_v: str = "auto"
    speculative: int = 0  # drafts per step for requests that do not say (--speculative); 0: off
    # a draft model's path on the worker's host (workers/draft.py: same tokenizer, proposes the
    # drafts instead of prompt lookup), or "mtp" (the model's own head: workers/mtp.py); its
    # weights and KV pool are in the load's booking and kv_budget_bytes (the pool has the
    # model's block count: the budget is shared by block size)
    draft: str | None = None
    block_size: int = BLOCK_SIZE
    cpu_path: str | None = None  # a CPU die's path (workers/cpu_paths.py); None: PANTHEON_CPU_PATH or timed
    compile_decode: bool | None = None  # None: PANTHEON_COMPILE decides (workers/compiled.py)
    cuda_graphs: bool | None = None  # None: on a CUDA die unless PANTHEON_CUDA_GRAPHS=0
    prefix_cache: bool = True

    @property
    def kv_types(self) -> KvCacheTypes:
        """The K/V pool's storage types (raises ValueError for a name kv_types does not know)."""
        return KvCacheTypes(self.kv_cache_k, self.kv_cache_v)
