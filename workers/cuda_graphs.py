"""Pure decode steps replayed as CUDA graphs, at captured batch sizes (issue 30 §2).

A small model's eager decode step on a GPU is a few thousand kernel launches, each ~5 us of
host time against a few us of device time: the step is bound by the launches, not the weights.
A CUDA graph records one step's kernels once and replays them with one launch, so the step
costs what the device does.

A graph replays the same kernels on the same addresses, so every input of a step lives in
static buffers that each step overwrites: the tokens, their positions, the cache rows their K/V
go to, each row's context length and its block table. They are views of ONE int64 buffer on the
device, filled from its pinned host twin by one copy per step (``_inputs``); the rotary tables
and everything else are computed inside the graph. The sampled ids are the step's only host
sync (the sampler's ``tolist``, outside the graph).

- Batch sizes: 1, 2, 4, 8, then every 8 up to the slots (``graph_sizes``); a step of n rows
  replays the smallest graph of at least n, the extra rows padding: token 0 at position 0, its
  K/V written to a block set aside for them (``scratch``), attending to that row alone. Their
  logits are never read.
- Context: the block tables are ``max_context`` positions wide. Attention reads the paged pool
  in place (``workers/kernels/paged_triton.py``), bounded by each row's length, so a wide table
  costs nothing but its copy. Without that kernel (no Triton, a quantized KV cache) the graph
  gathers the table's every row into a dense copy with a -inf bias past each row's length, so
  the width is cut to ``GATHER_CONTEXT`` there, and longer contexts step eagerly.
- Checked: the first replay of each size runs the eager step too (second, so its K/V writes are
  the ones kept) and compares the logits (``compiled.check_logits``); a mismatch, or a capture
  that fails (a layer that syncs with the host, say), leaves the engine eager, with ``state``
  saying why (``/admin/dies``' compile state).
- Recurrent layers (Qwen3.5's Gated DeltaNet) read and write their rows' states through the
  static slot of each row (``decode_slots``; padding rows: the scratch slot, ``scratch_slot``),
  gathered and scattered back: never the in-place run of consecutive slots, which the eager
  step takes when the slots happen to be consecutive.
- Sliding-window layers (Gemma 3 / 4, gpt-oss) read their rings through a view built in the
  graph from the same slots and lengths (``sliding.decode_window_view``: the whole window, -inf
  past each row's end), with their own rotary tables where they differ (``sliding``).
- Not for: layers split across devices, dynamic RoPE (tables per sequence length), draft models.

On a CPU die (tests) the same static buffers and padding run eagerly instead of being captured
(``capture=False``): everything but the capture itself is what a GPU runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from workers.cache import LayerCache
from workers.compiled import check_logits
from workers.layers.attention import StepBatch, block_rows
from workers.layers.sliding import decode_window_view
from workers.models.base import DecoderLM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # (what CUDAGraph.pool() returns: an id pair)

    from workers.block_manager import BlockManager
    from workers.scheduler import Sequence

log = logging.getLogger("pantheon.worker")

# Without the in-place attention kernel each step gathers every table position of every row:
# the graphs' context is cut to this (COMPILED_MAX_CONTEXT's reasoning, workers/runner.py)
GATHER_CONTEXT = 1024
# With it, the tables' width (positions); longer contexts step eagerly. Wide tables cost a
# bigger copy a step (64 rows x 512 blocks x 8 bytes: 256 KiB at 8192) and more empty programs.
KERNEL_CONTEXT = 8192

CAPTURED, FAILED, OFF = "graphs", "failed", "off"


def graph_sizes(num_slots: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8, up to the first that holds
    ``num_slots`` rows (a decoding sequence holds a slot: no step has more rows)."""
    sizes: list[int] = []
    for n in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        sizes.append(n)
        if n >= num_slots:
            return sizes
    raise AssertionError("unreachable")


def why_not(devices: list[torch.device], dynamic_rope: bool) -> str | None:
    """Why a model's decode step cannot be replayed as graphs, or None."""
    if len(devices) > 1:
        return "layers split across devices"
    if dynamic_rope:
        return "dynamic RoPE: its tables depend on each sequence's length"
    return None


class DecodeGraphs:
    """``graphs(seqs, eager) -> fp32 logits [len(seqs), vocab]`` for a pure decode step, or
    None when no graph covers it (too many rows, too long a context, not captured): run eager
    then. Built by ``ModelRunner.capture_graphs``."""

    def __init__(
        self,
        model: DecoderLM,
        caches: list[LayerCache],
        tables: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        blocks: BlockManager,
        num_slots: int,
        max_context: int,
        capture: bool,
        windows: tuple[int, ...] = (),
        sliding: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        """``num_slots``: the engine's; its state slot ``num_slots`` is scratch (the padding rows'
        recurrent states and rings). ``tables``: positions -> the rotary tables; ``windows``: the
        model's sliding windows, ``sliding`` their own rotary tables where they differ."""
        self.model, self.caches, self.tables = model, caches, tables
        self.windows, self.sliding = windows, sliding
        self.device = model.embed_device
        self.block_size = bs = blocks.block_size
        self.blocks = blocks
        self.sizes = graph_sizes(num_slots)
        self.kernel = _kernel_reads(model, caches)  # attention reads the pool in place
        self.max_context = min(max_context, KERNEL_CONTEXT if self.kernel else GATHER_CONTEXT)
        self.width = -(-self.max_context // bs)  # table columns
        self.state = OFF
        self.seconds = 0.0  # the capture's
        self.cache_note = ""
        self.fallbacks = 0  # decode steps no graph covered (eager instead)
        self.replays = 0
        self.checked: set[int] = set()
        # The padding rows' block, held for the graphs' life
        self.scratch: list[int] = []
        if not blocks.ensure(self.scratch, 1):
            raise RuntimeError("no free KV block for the padding rows")
        big = self.sizes[-1]
        # [ids | positions | cache rows | lens | state slots | tables (big x width)]: one copy
        self.scratch_slot = num_slots
        n = 5 * big + big * self.width
        pin = self.device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.static = torch.zeros(n, dtype=torch.long, device=self.device)
        self.ids, self.pos, self.rows, self.lens, self.slots = (
            self.static[i * big : (i + 1) * big] for i in range(5)
        )
        self.table = self.static[5 * big :].view(big, self.width)  # [big, width]
        self._pad_all()
        self.run: dict[int, Callable[[], torch.Tensor]] = {}
        self._pool: _POOL_HANDLE | None = None  # the graphs' shared memory pool, once one is captured
        t0 = time.monotonic()
        try:
            with torch.inference_mode():
                for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
                    self.run[size] = self._capture(size) if capture else self._eager(size)
        except BaseException:
            self.close()  # a capture that fails gives its padding block back
            raise
        self.seconds = time.monotonic() - t0
        self.state = f"{CAPTURED}: batch {','.join(map(str, self.sizes))} to {self.max_context} positions" + (
            "" if self.kernel else " (attention by gather)"
        )

    # ------------------------------------------------------------ the step inside the graph

    def _forward(self, n: int) -> torch.Tensor:
        """The decode step of the first ``n`` static rows: fp32 logits [n, vocab]."""
        pos = self.pos[:n]
        cos, sin = self.tables(pos)  # [n, H + KV, D] each
        tab, lens = self.table[:n], self.lens[:n]  # [n, width], [n]
        gather = bias = None
        if not self.kernel:  # every table position's rows, -inf past each row's length
            gather = block_rows(tab, self.block_size)  # [n, T]
            t = torch.arange(gather.shape[1], device=self.device)
            bias = torch.zeros(gather.shape, dtype=torch.float32, device=self.device)
            bias = bias.masked_fill_(t[None, :] >= lens[:, None], float("-inf"))[:, None, None, :]
        b = StepBatch(
            cos, sin, self.rows[:n], n, gather, bias, [],
            decode_slots=self.slots[:n],  # (never ``decode_slot_run``: a value, not a shape)
            positions=pos,
            decode_blocks=tab,
            block_size=self.block_size,
            decode_lens=lens,
        )  # fmt: skip
        if self.windows:  # the sliding layers' views of it, by window: the step's batch with them
            rot = None if self.sliding is None else self.sliding(pos)
            views = {w: decode_window_view(b, w, self.slots[:n], lens, rot) for w in self.windows}
            b = dataclasses.replace(b, windows=views)
        ids = self.ids[:n]
        return self.model.logits(self.model(ids, {self.device: b}, self.caches))

    def _eager(self, n: int) -> Callable[[], torch.Tensor]:
        return lambda: self._forward(n)

    def _capture(self, n: int) -> Callable[[], torch.Tensor]:
        """Record the step of ``n`` rows; its replay. Warmed up on a side stream first (what
        capture requires; Triton compiles its kernels there), on the padding rows' block."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(n)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker loads on a thread of its own while its main loop steps the
        # other models on this device; "global" would refuse their allocations during capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(n)
        self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    # ------------------------------------------------------------ serving

    def _pad_all(self) -> None:
        """Every static row a padding row (token 0, position 0, the scratch block)."""
        bs = self.block_size
        big = self.sizes[-1]
        h = self.host_np
        h[: 5 * big] = 0
        h[2 * big : 3 * big] = self.scratch[0] * bs  # cache rows
        h[3 * big : 4 * big] = 1  # lens
        h[4 * big : 5 * big] = self.scratch_slot
        h[5 * big :] = self.scratch[0]
        self.static.copy_(self.host)

    def covers(self, seqs: list[Sequence]) -> int | None:
        """The graph size for this step's rows, or None."""
        n = len(seqs)
        if n > self.sizes[-1] or not self.run or self.state.startswith(FAILED):
            return None
        if any(s.num_computed + 1 > self.max_context for s in seqs):
            return None
        return next(size for size in self.sizes if size >= n)

    def _inputs(self, seqs: list[Sequence], size: int) -> None:
        """The step's rows into the static buffers: one host-to-device copy of the rows used."""
        bs, big, w = self.block_size, self.sizes[-1], self.width
        h = self.host_np
        for i, s in enumerate(seqs):
            p = s.num_computed
            h[i] = s.tokens[p]
            h[big + i] = p
            h[2 * big + i] = s.block_table[p // bs] * bs + p % bs
            h[3 * big + i] = p + 1
            h[4 * big + i] = self.scratch_slot if s.slot is None else s.slot
            nb = p // bs + 1
            h[5 * big + i * w : 5 * big + i * w + nb] = s.block_table[:nb]
        for i in range(len(seqs), size):  # padding rows: this step's size may be past the last's
            h[i], h[big + i], h[2 * big + i], h[3 * big + i] = 0, 0, self.scratch[0] * bs, 1
            h[4 * big + i] = self.scratch_slot
            h[5 * big + i * w] = self.scratch[0]
        # ids .. slots (small), then the tables' first ``size`` rows: contiguous, row-major
        end = 5 * big + size * w
        self.static[:end].copy_(self.host[:end], non_blocking=True)

    def __call__(self, seqs: list[Sequence], eager: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """The step's logits [len(seqs), vocab], or None (run eager). A size not checked yet
        runs the step both ways and returns the eager logits."""
        size = self.covers(seqs)
        if size is None:
            self.fallbacks += 1
            return None
        self._inputs(seqs, size)
        if size in self.checked:
            self.replays += 1
            return self.run[size]()[: len(seqs)]
        # The check: both ways from the same states. K/V writes are the same rows either way, but
        # a recurrent state advances once per run: its rows' states are put back before the eager
        # step (which goes second, so that its writes are the ones kept)
        slots = self.slots[: len(seqs)]
        states = [(t, t[slots].clone()) for c in self.caches for t in c.slot_states().values()]
        got = self.run[size]()[: len(seqs)].clone()  # (the eager step may reuse the pool's memory)
        self.replays += 1
        for t, before in states:
            t.index_copy_(0, slots, before)
        want = eager()
        why = check_logits(got, want)
        if why is not None:
            self.state = f"{FAILED}: batch {size} against the eager step: {why}"
            self.run.clear()
            log.warning("decode graphs left eager: %s", self.state)
        else:
            self.checked.add(size)
        return want

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        """The engine is gone: drop the graphs (their pool goes with them) and the scratch block."""
        self.run.clear()
        if self.scratch:
            self.blocks.free(self.scratch)
            self.scratch = []


def _kernel_reads(model: DecoderLM, caches: list[LayerCache]) -> bool:
    """Whether every attention layer's decode reads its pool in place on this device (the
    Triton kernel on CUDA, the C kernel on a CPU die), so the graph needs no gather."""
    dev = model.embed_device
    kv = [p for c in caches if (p := c.pool) is not None]
    if not kv:
        return True
    dtype = model.embed_dtype
    for c in kv:
        heads = c.k.shape[1] * 1  # one query head per KV head: reads() looks at dtypes and shapes
        q = torch.empty(1, heads, c.k.shape[2], dtype=dtype, device=dev)
        if dev.type == "cuda":
            try:
                from workers.kernels import paged_triton
            except ImportError:
                return False
            if not (paged_triton.available() and paged_triton.reads(q, c.k, c.v)):
                return False
        else:
            from workers.kernels import paged

            if not (paged.available() and paged.reads(q, c.k, c.v)):
                return False
    return True
