"""The model runner: turns a ``StepPlan`` into tensors, runs the model, returns logits.

It owns the cache tensors (``workers/cache.py``: each attention layer's paged K and V, each
recurrent layer's state pool and each sliding-window layer's rings, on that layer's device) and
knows nothing of requests beyond their tokens, positions, block tables and slots. It builds one backend-neutral ``StepBatch`` per step
(and device) from which each layer kind takes what it needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from pantheon.core.engine_spec import SLOTS
from pantheon.core.kv_types import KvCacheTypes
from workers.block_manager import BlockManager
from workers.cache import LayerCache, kv_block_bytes, make_caches
from workers.kernels import paged
from workers.layers import decode_layer
from workers.layers.attention import PrefillChunk, StepBatch, VerifyRun, block_rows
from workers.layers.rotary import Rotary, qk_tables
from workers.layers.sliding import window_view
from workers.model_config import ModelConfig
from workers.models.base import DecoderLM
from workers.scheduler import Sequence, StepPlan

if TYPE_CHECKING:  # workers.compiled imports this module's neighbours; imported when compiling
    from workers.compile_cache import CompileCache
    from workers.compiled import CompiledDecode
    from workers.cuda_graphs import DecodeGraphs

__all__ = ["ModelRunner", "kv_block_bytes"]


# Contexts past this many positions decode on the eager step with the paged kernel rather than
# the compiled graph's gather (``ModelRunner.compiled_max_context``); not tuned: a conservative
# cut where the gather's copy is still small (1024 positions x SmolLM2's 3 KV heads x 64, bf16:
# 0.8 MB per layer for K and V).
COMPILED_MAX_CONTEXT = 1024


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        cfg: ModelConfig,
        blocks: BlockManager,
        dtype: torch.dtype,
        num_slots: int = SLOTS,
        checkpoints: int = 0,
        kv_types: KvCacheTypes = KvCacheTypes(),
    ):
        self.model, self.cfg, self.blocks, self.dtype = model, cfg, blocks, dtype
        self.devices = list(dict.fromkeys(model.layer_devices))
        self.main = model.embed_device
        rows = blocks.num_blocks * blocks.block_size
        self.caches: list[LayerCache] = make_caches(
            cfg, model.layer_devices, rows, num_slots, dtype, checkpoints, kv_types
        )
        self.kv_types = kv_types
        if self.main.type == "cpu":  # build (or find) the paged decode kernel now, not in the first step
            paged.available()
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # the state slot of prompt logits computed outside the scheduler
        self.rotary = Rotary(cfg, self.main)
        # Sliding-window layers: their windows, and their own RoPE when it differs (Gemma 3)
        self.windows = cfg.windows
        local = cfg.sliding_rope
        self.sliding_rotary = (
            None if local is None else Rotary(dataclasses.replace(cfg, rope=local), self.main)
        )
        # Decode steps run each layer as one native call (every layer takes it:
        # workers/layers/decode_layer.py), faster than the compiled graph, which they skip
        self.native = (
            self.main.type == "cpu"
            and decode_layer.kv_types_ok(kv_types.k, kv_types.v)
            and decode_layer.why_not(model.layers) is None
        )
        # ... and all of them in one call a step where they share one CPU
        model.fused_layers = (
            decode_layer.Layers.build(model.layers) if self.native and len(self.devices) == 1 else None
        )
        # the decode step compiled in the background (workers/compiled.py), once started
        self.compiled: CompiledDecode | None = None
        # pure decode steps replayed as CUDA graphs (workers/cuda_graphs.py), once captured
        self.graphs: DecodeGraphs | None = None
        # the last eager step's final hidden states [N, hidden] (decode rows, then each prefill
        # chunk's): what the engine pools embeddings from
        self.last_hidden: torch.Tensor | None = None

    def capture_graphs(self, max_context: int, capture: bool | None = None) -> DecodeGraphs | str:
        """Capture the pure decode step as CUDA graphs (``workers/cuda_graphs.py``): the
        ``DecodeGraphs``, or why not (the runner stays eager). ``capture`` False: the same
        static-buffer step run eagerly (a CPU die, for tests); default: on CUDA only."""
        from workers import cuda_graphs
        from workers.compiled import _why

        why = cuda_graphs.why_not(self.devices, self.rotary.dynamic)
        if why is not None:
            return why
        if capture is None:
            capture = self.main.type == "cuda"
        local = self.sliding_rotary
        try:
            self.graphs = cuda_graphs.DecodeGraphs(
                self.model,
                self.caches,
                lambda pos: self._tables(*self.rotary.cos_sin(pos)),
                self.blocks,
                self.num_slots,
                max_context,
                capture,
                tuple(self.windows),
                None if local is None else lambda pos: self._tables(*local.cos_sin(pos)),
            )
        except Exception as e:  # noqa: BLE001 - a step that cannot be captured stays eager
            return f"capture failed: {_why(e)}"
        return self.graphs

    def compile_decode(
        self, cache: CompileCache | None = None, key: str | None = None, background: bool = True
    ) -> CompiledDecode | str:
        """Start compiling the pure decode step (see workers/compiled.py) on one KV block set
        aside until the build ends: the ``CompiledDecode``, or why not (the runner stays eager)."""
        from workers.compiled import CompiledDecode

        if len(self.devices) > 1:
            return "layers split across devices"
        if self.windows:
            return "not built yet for models with sliding-window layers"
        if any(c.state_nbytes for c in self.caches):
            return "not built yet for models with recurrent layers"
        if self.main.type != "cpu":
            return "built for CPU dies only"
        table: list[int] = []
        if not self.blocks.ensure(table, 1):
            return "no free KV block to build on"
        bs = self.blocks.block_size
        c = CompiledDecode(self.model, self.caches, cache, key)

        def tables(pos):
            cos, sin = self.rotary.cos_sin(pos)
            return self._tables(cos, sin)

        self.compiled = c
        rows = [table[0] * bs + i for i in range(min(bs, 3))]
        c.start(tables, self.blocks.num_blocks * bs, rows, lambda: self.blocks.free(table), background)
        return c

    def compiled_max_context(self) -> int:
        """The longest context a step may have and still run the compiled graph. The graph reads
        each row's K/V through the gather (a full-width copy of every context, each step, each
        layer), while the eager step's paged kernel (workers/kernels) reads the pool where it
        lies: past ``COMPILED_MAX_CONTEXT`` positions the eager step serves when the kernel is
        here (a step near the graph's speed, and the copy grows with the context: at depth 8192
        the kernel decodes SmolLM2 ~1.8x faster than the torch gather, bench/decode_depth.py)."""
        return COMPILED_MAX_CONTEXT if paged.available() else 1 << 62

    @property
    def kv_bytes(self) -> int:
        return sum(c.kv_nbytes for c in self.caches)

    @property
    def state_bytes(self) -> int:
        return sum(c.state_nbytes for c in self.caches)

    @torch.inference_mode()
    def save_state(self, slot: int, checkpoint: int) -> None:
        """Copy every recurrent layer's state of ``slot`` into prefix-cache ``checkpoint``."""
        for c in self.caches:
            c.save_state(slot, checkpoint)

    @torch.inference_mode()
    def load_state(self, slot: int, checkpoint: int) -> None:
        """Restore ``slot``'s recurrent states from prefix-cache ``checkpoint``."""
        for c in self.caches:
            c.load_state(slot, checkpoint)

    @torch.inference_mode()
    def keep_verified(self, slot: int, run: int, row: int) -> None:
        """After a verify: ``slot``'s recurrent states become those after row ``row`` of the
        step's verify run ``run`` (its index in ``plan.verify``)."""
        for c in self.caches:
            c.copy_verified(run, row, False, slot)

    @torch.inference_mode()
    def save_verified(self, run: int, row: int, checkpoint: int) -> None:
        """Copy the recurrent states after row ``row`` of verify run ``run`` into prefix-cache
        ``checkpoint`` (a block boundary the accepted rows passed)."""
        for c in self.caches:
            c.copy_verified(run, row, True, checkpoint)

    def _tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return qk_tables(
            cos, sin, cfg.num_heads, cfg.num_kv_heads, self.dtype, cfg.head_dim, cfg.attention_scale
        )

    def _rows(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.blocks.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _block_tab(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """The blocks holding positions 0..length-1 of each table: [B, nb] int64 on the CPU
        (padding: block 0, masked by the caller); ``block_rows`` gives their cache rows."""
        nb = -(-length // self.blocks.block_size)
        return torch.tensor([t[:nb] + [0] * (nb - len(t[:nb])) for t in tables], dtype=torch.long)

    @torch.inference_mode()
    def run(
        self, plan: StepPlan, all_rows: bool = False, prompt_rows: Mapping[Sequence, int] | None = None
    ) -> torch.Tensor:
        """Compute the plan's tokens; return fp32 logits [len(plan.sampled()), vocab].

        ``all_rows``: logits of every computed token instead (prompt logits), [N, vocab].
        ``prompt_rows``: prefilling sequences -> how many of their chunk's first rows to keep
        (prompt logprobs, ``workers/prompt_logprobs.py``); those rows follow the sampled ones,
        in the plan's prefill order.
        Last come every verify row (``plan.verify``, in its order): in the step's input they are
        decode rows, after the plain ones (``last_hidden`` too).
        A pure decode step replays a captured graph when one covers it (``capture_graphs``).
        """
        if self.graphs is not None and plan.decode and not (plan.prefill or plan.verify or all_rows):
            logits = self.graphs(plan.decode, lambda: self._run(plan))
            if logits is not None:
                self.last_hidden = None  # (a graph keeps its hidden states to itself)
                return logits
        return self._run(plan, all_rows, prompt_rows)

    def _run(
        self, plan: StepPlan, all_rows: bool = False, prompt_rows: Mapping[Sequence, int] | None = None
    ) -> torch.Tensor:
        """``run`` eagerly."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # Decode rows: the newest token of each decoding sequence.
        for s in plan.decode:
            p = s.num_computed
            ids.append(s.tokens[p])
            positions.append(p)
            slots.append(self._rows(s.block_table, p, p + 1)[0])
        n_plain = len(ids)
        # Verify rows (speculation): the pending token and each draft of a verifying sequence are
        # decode rows too, row i seeing the positions up to its own (the step writes every row's
        # K/V before any row attends). Decode rows, not a prefill chunk: the same kernels as a
        # one-token step, so a greedy verify picks exactly the tokens plain decoding would.
        dec_rows = [(s, s.num_computed + 1) for s in plan.decode]  # (sequence, its context length)
        runs: list[VerifyRun] = []
        for s in plan.verify:
            p0, n = s.num_computed, 1 + len(s.draft)
            assert s.slot is not None  # a verifying sequence decodes: it holds a slot
            runs.append(VerifyRun(len(ids), n, s.slot))
            ids += [s.tokens[p0], *s.draft]
            positions += range(p0, p0 + n)
            slots += self._rows(s.block_table, p0, p0 + n)
            dec_rows += [(s, p0 + i + 1) for i in range(n)]
        n_decode = len(ids)
        # start, end, first pos, last pos, table, state slot
        chunks: list[tuple[int, int, int, int, list[int], int]] = []
        for s, n in plan.prefill:
            p0 = s.num_computed
            start = len(ids)
            ids += s.tokens[p0 : p0 + n]
            positions += range(p0, p0 + n)
            slots += self._rows(s.block_table, p0, p0 + n)
            chunks.append(
                (start, len(ids), p0, p0 + n, s.block_table, self.scratch_slot if s.slot is None else s.slot)
            )

        dev = self.main
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        cos, sin = self._cos_sin(pos_t, plan, n_decode, chunks)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)

        dec_gather = dec_bias = dec_slots = slot_run = dec_blocks = dec_lens = None
        if n_decode:
            slot_ids = [s.slot for s, _n in dec_rows]
            dec_slots = torch.tensor(slot_ids, dtype=torch.long, device=dev)
            first = slot_ids[0]
            if n_plain and first is not None and slot_ids[:n_plain] == list(range(first, first + n_plain)):
                slot_run = first  # recurrent layers update the plain rows' states in place
            lens = [n for _s, n in dec_rows]
            t = max(lens)
            dec_tables = [s.block_table for s, _n in dec_rows]
            dec_blocks = self._block_tab(dec_tables, t)  # [B, nb]: attention reads whole blocks
            dec_gather = block_rows(dec_blocks, self.blocks.block_size)[:, :t].to(dev)  # [B, T]
            dec_blocks = dec_blocks.to(dev)
            dec_lens = torch.tensor(lens, dtype=torch.long, device=dev)  # the paged kernel's bound
            if min(lens) < t:  # some rows are padded: mask their tail
                pad = torch.arange(t, device=dev)[None, :] >= dec_lens[:, None]
                dec_bias = torch.zeros(pad.shape, dtype=torch.float32, device=dev)
                dec_bias = dec_bias.masked_fill_(pad, float("-inf"))[:, None, None, :]  # [B, 1, 1, T]
        pre = []
        for start, end, p0, p1, table, state_slot in chunks:
            blocks = self._block_tab([table], p1)  # [1, nb]: the CUDA prefill kernel reads the pool by these
            gather = block_rows(blocks, self.blocks.block_size)[0, :p1].to(dev)  # [T]
            # No mask: causal after p0 cached positions (paged_attention builds one if it needs it)
            pre.append(PrefillChunk(start, end, gather, None, state_slot, fresh=p0 == 0, blocks=blocks[0]))

        base = StepBatch(
            cos, sin, slot_t, n_decode, dec_gather, dec_bias, pre, dec_slots, slot_run,
            positions=pos_t,  # for layers that build their own rotary tables (Gemma 4's full ones)
            decode_blocks=dec_blocks,
            block_size=self.blocks.block_size,
            decode_lens=dec_lens,
            verify=runs,
        )  # fmt: skip
        if self.windows:  # the sliding layers' views of it, by window: the step's batch with them
            rot = None
            if self.sliding_rotary is not None:
                rot = self._tables(*self.sliding_rotary.cos_sin(pos_t))
            dec = [
                (s.slot if s.slot is not None else self.scratch_slot, s.num_computed + 1) for s in plan.decode
            ]
            spans = [(slot, p0, p1) for _s, _e, p0, p1, _t, slot in chunks]
            views = {w: window_view(base, w, dec, spans, rot) for w in self.windows}
            base = dataclasses.replace(base, windows=views)
        batches = {d: base if d == dev else base.to(d) for d in self.devices}
        if (
            self.compiled is not None
            and not pre
            and not all_rows
            and not plan.verify
            and not self.native  # (not compiled then; kept for a runner compiled by hand)
            and (base.decode_gather is None or base.decode_gather.shape[1] <= self.compiled_max_context())
        ):  # every row is a sampled decode row, none of them deep where the kernel is faster
            logits = self.compiled(
                input_ids, base, lambda: self.model.logits(self.model(input_ids, batches, self.caches))
            )
            if logits is not None:
                return logits
        hidden = self.model(input_ids, batches, self.caches)  # [N, hidden]
        self.last_hidden = hidden

        if all_rows:
            return self.model.logits(hidden)
        # Only the last row of each sampled sequence needs logits.
        rows = list(range(n_plain))
        for (_start, end, _p0, p1, _t, _slot), (s, _n) in zip(chunks, plan.prefill):
            if p1 == len(s.tokens) and s.embed is None:  # an embedding is pooled, not sampled
                rows.append(end - 1)
        for (start, _end, _p0, _p1, _t, _slot), (s, _n) in zip(chunks, plan.prefill):
            rows += range(start, start + (prompt_rows or {}).get(s, 0))
        rows += range(n_plain, n_decode)  # every verify row
        if len(rows) == hidden.shape[0] and rows == list(range(len(rows))):
            return self.model.logits(hidden)  # every row samples (a decode step): no gather
        return self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])

    def _cos_sin(self, pos_t, plan: StepPlan, n_decode: int, chunks):
        """The step's rotary tables for q and k: [N, H + KV, D] each (see ``rope.qk_tables``)."""
        if not self.rotary.dynamic:
            cos, sin = self.rotary.cos_sin(pos_t)
        else:
            # Dynamic NTK: the frequencies depend on each sequence's length, so go per sequence.
            parts = [self.rotary.cos_sin(pos_t[i : i + 1], int(pos_t[i]) + 1) for i in range(n_decode)]
            parts += [self.rotary.cos_sin(pos_t[a:b], p1) for a, b, _p0, p1, _t, _s in chunks]
            cos, sin = torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
        return self._tables(cos, sin)
