"""Attention over the paged KV cache, and the step's batch description its layers read.

One forward call of a model takes a flat batch of N tokens: first one token for each decoding
sequence, then the tokens of the prefill chunks. Linear layers see all N rows at once (the weights
are read once per step, which is what decode speed on a CPU is bound by); attention runs once for
the decode rows together and once per prefill chunk. The runner builds one ``StepBatch`` per
device; each layer kind takes what it needs from it (attention: rotary tables, cache rows and
gathers; a recurrent layer: the slot of each row and where each prefill chunk starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workers.kernels import paged, paged_triton
from workers.kernels.kv_quant import KvRows, read_blocks, read_rows, write_rows


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the flat batch."""

    start: int  # first row of the chunk in the flat batch
    end: int  # one past its last row
    gather: torch.Tensor  # [T] int64: cache rows of positions 0..T-1 of this sequence
    # [1, 1, C, T] bool (True = attend). None: plain causal over the gather's last C positions
    # after its first T - C (a paged chunk; ``paged_attention`` builds the mask only if it needs it)
    mask: torch.Tensor | None
    slot: int = 0  # the sequence's slot: where a recurrent layer keeps its state
    fresh: bool = True  # the chunk starts the sequence: recurrent states start from zero
    windowed: bool = False  # a sliding window's view: ``gather`` is the ring's history, ``mask`` bands it
    # [nb] int64 on the CPU: the sequence's block ids (position p in pool row ``blocks[p //
    # block_size] * block_size + p % block_size``), for the CUDA prefill kernel, which reads the
    # pool where it lies; None (a view, a hand-built batch): the gather's rows are read
    blocks: torch.Tensor | None = None


@dataclass(frozen=True)
class VerifyRun:
    """A verifying sequence's decode rows (speculation, ``workers/speculation.py``): its pending
    token, then its drafts, ``n`` consecutive rows from ``start``, all on one state slot. A
    recurrent layer runs them one after another and keeps the state after each row, for the
    engine to keep the one after the last accepted row (``ModelRunner.keep_verified``)."""

    start: int  # its first row in the flat batch
    n: int  # 1 + drafts
    slot: int


@dataclass
class StepBatch:
    """Where each token's K/V goes and what each query attends to, on one device.

    The rotary tables cover q and k heads together (``[N, H + KV, D]``) and already hold the
    softmax scale on the q heads, so each layer rotates q and k in one pass and never scales
    its scores. ``rot_sin`` is signed for the swapped-halves form (``layers.rotary.rotate``).
    """

    rot_cos: torch.Tensor  # [N, H + KV, D]
    rot_sin: torch.Tensor  # [N, H + KV, D]: -sin on the first half of D, +sin on the second
    slot_mapping: torch.Tensor  # [N] int64: cache row that receives each token's K/V
    n_decode: int  # rows [0, n_decode) are one decode token per sequence
    decode_gather: torch.Tensor | None  # [B, T] int64 cache rows (padding points at row 0)
    decode_bias: torch.Tensor | None  # [B, 1, 1, T] fp32, -inf on padding; None when no row pads
    prefills: list[PrefillChunk]
    decode_slots: torch.Tensor | None = None  # [B] int64: each decode row's slot (recurrent layers)
    decode_slot_run: int | None = None  # when the decode slots are first, first + 1, ...: first
    # Sliding-window layers' views of this step, by window, in their rings' rows
    # (workers/layers/sliding.py: each query reads at most the window; the masks band it); the
    # rotary tables are the sliding layers' (Gemma 3's local base). Built by the runner.
    windows: dict[int, StepBatch] = field(default_factory=dict)
    positions: torch.Tensor | None = None  # [N] int64: each row's position (layers with their own RoPE)
    # The decode rows' block tables, [B, ceil(T / block_size)] int64 (padding: block 0), for
    # attention that reads the paged pool by whole blocks (``decode_attention``). None: read
    # ``decode_gather``'s rows (a ring's view, the compiled step).
    decode_blocks: torch.Tensor | None = None
    block_size: int = 0
    # [B] int64: each decode row's context length (its positions 0 .. len - 1, its own token
    # included). With ``decode_blocks``, what the paged decode kernel (``workers/kernels``)
    # reads instead of the gather and bias; None where the kernel must not run (the compiled
    # step, a ring's view).
    decode_lens: torch.Tensor | None = None
    # The verifying sequences' rows, the last decode rows (after the plain ones), in order.
    # ``decode_slots`` covers them too; ``decode_slot_run`` only the plain rows before them.
    verify: list[VerifyRun] = field(default_factory=list)
    # The prefill kernel's tiles of this step's chunks (``paged_triton.prefill_tiles``), by query
    # positions per tile: built by the first layer that runs the kernel, reused by the others
    # (one small H2D copy a step). Never carried by ``to``: each device's batch builds its own.
    prefill_tiles: dict[int, paged_triton.PrefillTiles] = field(default_factory=dict)

    @property
    def n_plain(self) -> int:
        """Decode rows of one token per sequence, before the verify rows."""
        return self.n_decode - sum(v.n for v in self.verify)

    def to(self, dev: torch.device) -> StepBatch:
        """The same batch description on another device (layers split across dies)."""

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(dev, non_blocking=True)

        return StepBatch(
            self.rot_cos.to(dev, non_blocking=True),
            self.rot_sin.to(dev, non_blocking=True),
            self.slot_mapping.to(dev, non_blocking=True),
            self.n_decode,
            mv(self.decode_gather),
            mv(self.decode_bias),
            [
                PrefillChunk(
                    c.start, c.end, c.gather.to(dev), mv(c.mask), c.slot, c.fresh, c.windowed, c.blocks
                )
                for c in self.prefills
            ],
            mv(self.decode_slots),
            self.decode_slot_run,
            {w: v.to(dev) for w, v in self.windows.items()},
            mv(self.positions),
            mv(self.decode_blocks),
            self.block_size,
            mv(self.decode_lens),
            self.verify,
        )


AttnBatch = StepBatch  # the name the attention code grew up with


def block_rows(tab: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool rows of block tables: [B, nb] block ids -> [B, nb * block_size] int64, the rows of
    positions 0 .. nb * block_size - 1 in order (block j's position i in row ``tab[b, j] *
    block_size + i``), on ``tab``'s device. Tensor ops: B * nb ids in, never B * T Python ints."""
    rows = tab[:, :, None] * block_size + torch.arange(block_size, device=tab.device)  # [B, nb, bs]
    return rows.view(tab.shape[0], -1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: StepBatch,
    k_cache: KvRows,
    v_cache: KvRows,
) -> torch.Tensor:
    """Write the step's K/V into the cache, then attend. q: [N, H, D] (pre-scaled), k, v:
    [N, KV, D]; k_cache, v_cache: [rows, KV, D] (or their quantized rows: written quantized,
    read back dequantized to q's dtype) -> [N, H, D]."""
    write_rows(k_cache, b.slot_mapping, k)
    write_rows(v_cache, b.slot_mapping, v)
    if not b.prefills:  # the pure decode step: no copy into a shared output
        return decode_attention(q, b, k_cache, v_cache)
    out = torch.empty_like(q)  # [N, H, D]
    if b.n_decode:
        out[: b.n_decode] = decode_attention(q[: b.n_decode], b, k_cache, v_cache)
    if prefill_kernel(q, b, k_cache, v_cache, out):
        return out
    for c in b.prefills:
        qp = q[c.start : c.end]  # [C, H, D]
        hist = c.gather.shape[0] - (c.end - c.start)  # positions before the chunk
        if c.mask is None and _PAGES_OK.get(q.device.type, False):
            o = _prefill_by_pages(qp, c.gather, k_cache, v_cache)
        else:
            if hist and c.mask is None:  # built once per step, then every layer's call reuses it
                c.mask = offset_causal_mask(hist, c.end - c.start, q.device)
            kk = read_rows(k_cache, c.gather, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KV, T, D]
            vv = read_rows(v_cache, c.gather, q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qp.transpose(0, 1).unsqueeze(0),  # [1, H, C, D]
                kk,
                vv,
                attn_mask=c.mask,
                is_causal=c.mask is None,
                enable_gqa=True,
                scale=1.0,
            )[0].transpose(0, 1)
        out[c.start : c.end] = o
    return out


def prefill_kernel(
    q: torch.Tensor,
    b: StepBatch,
    k_cache: KvRows,
    v_cache: KvRows,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> bool:
    """All the step's prefill chunks through the Triton paged kernel (``paged_triton.paged_prefill``:
    each chunk's queries against its K/V where they lie in the pool, no gather) into their rows of
    ``out``, if it takes them: a CUDA step (or CPU tensors under ``TRITON_INTERPRET=1``, the
    tests), plain paged chunks (their block ids known, no mask, no window's view), a cache the
    kernel reads (``paged_triton.reads``). False (nothing done) otherwise: the caller's path.
    ``sinks`` [H]: gpt-oss's (``workers/layers/sinks.py``)."""
    if q.device.type != "cuda" and not paged_triton.interpreting():  # (the CPU engine stops here)
        return False
    if not b.block_size or any(c.blocks is None or c.mask is not None or c.windowed for c in b.prefills):
        return False
    if not paged_triton.available() or not paged_triton.reads(q, k_cache, v_cache):
        return False
    kv = k_cache.shape[1]
    block_m = paged_triton.prefill_config(q.shape[1] // kv, q.shape[2], q.dtype).block_m
    spans = [
        paged_triton.PrefillSpan(c.start, c.end, c.gather.shape[0] - (c.end - c.start), c.blocks)
        for c in b.prefills
        if c.blocks is not None  # (all of them)
    ]
    tiles = b.prefill_tiles.get(block_m)
    if tiles is None:  # the step's first layer: cut once, reused by the others
        tiles = b.prefill_tiles[block_m] = paged_triton.prefill_tiles(spans, block_m, q.device)
    paged_triton.paged_prefill(q, k_cache, v_cache, spans, b.block_size, sinks, out=out, tiles=tiles)
    return True


def offset_causal_mask(hist: int, n: int, device: torch.device) -> torch.Tensor:
    """[1, 1, n, hist + n] bool: query row i (position hist + i) sees keys 0..hist + i."""
    q_pos = torch.arange(hist, hist + n, device=device)[:, None]
    return (torch.arange(hist + n, device=device)[None, :] <= q_pos)[None, None]


# Devices where prefill attention goes by pages (``_prefill_by_pages``): the CPU, whose fused
# SDPA kernel returns the log-sum-exp the merge needs. Elsewhere the one masked call serves.
_PAGES_OK = {"cpu": hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")}
PAGE = 128  # positions of a page: a query's keys split at the last multiple of this before it


def _prefill_by_pages(
    q: torch.Tensor, gather: torch.Tensor, k_cache: KvRows, v_cache: KvRows
) -> torch.Tensor:
    """Causal attention of a prefill chunk, the last C of the T positions in ``gather`` (their
    K/V already in the cache). q: [C, H, D] (pre-scaled); gather: [T] cache rows -> [C, H, D].

    A query at position p in page j (``PAGE`` positions from j * PAGE) attends in two parts,
    merged by their log-sum-exp: the full pages before its own (keys 0 .. j * PAGE - 1, no
    mask) and its own page (keys j * PAGE .. p, the kernel's causal case). The chunk's rows are
    taken page by page.

    Against the one masked call over the whole gather: no [C, T] mask (which SDPA turns into a
    float bias the fused kernel reads block by block: a fifth of the call at 8k positions on
    SmolLM2), and the history part folds each group's query heads into the query rows (the
    kernel sees KV heads and G * n queries), so the history's K/V are never repeated.

    A row's arithmetic depends on its position only, never on where its chunk starts or ends:
    its own page's call always has the same shape (the page's keys, zero past the written
    ones), the history's the same keys (its query rows padded so that the kernel's last block
    of them is never 1-3 rows, ``_pad_rows``), and the merge runs on whole vectors
    (``_sigmoid_exact``). A quantized cache's rows are dequantized a page at a time into a
    scratch that holds the chunk's own pages only; its history is read ``HISTORY`` rows at a
    time (``_history_by_chunks``), so no full-width copy of the context is made. So a prefix-cached prompt gets bit for bit the hidden states, and the
    greedy answer, of the uncached one, however either was chunked. The one masked call does
    not: its sums depend on how many keys and queries the call has (SmolLM2's bf16 logits of a
    prompt computed in two chunks differed from one chunk's by up to 0.9), nor does a split at
    the chunk's start (greedy answers to random prompts differed cached and uncached in 4 of 6).

    Each part runs in the model's dtype, as the one call did (the parts' outputs rounded to it,
    their log-sum-exps fp32), and the merge in fp32: a row of the first page gets the kernel's
    causal result in the model's dtype, unmerged. (With both parts in fp32 the default model's greedy answer to
    tests/e2e/test_default_model.py's question changed, on the int4 path, from Paris to another;
    the CPU kernel is no faster in either dtype.)
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    c, h, d = q.shape
    t = gather.shape[0]
    p0 = t - c
    kv = k_cache.shape[1]
    g = h // kv
    padded = -(-t // PAGE) * PAGE
    quantized = not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor))
    # The scratch K/V: every position for a full-width cache (the history's call reads it whole);
    # for a quantized one only the chunk's own pages (from ``first``), the history being read
    # ``HISTORY`` rows at a time (``_history_by_chunks``): no full-width copy of the context.
    first = p0 // PAGE * PAGE if quantized else 0
    kf = q.new_empty(padded - first, kv, d)  # [T - first, KV, D] then zeros
    vf = q.new_empty(padded - first, kv, d)
    for cache, dst in ((k_cache, kf), (v_cache, vf)):
        if isinstance(cache, torch.Tensor):
            torch.index_select(cache, 0, gather[first:], out=dst[: t - first])
        else:  # dequantized a page at a time
            for a in range(first, t, PAGE):
                dst[a - first : min(t, a + PAGE) - first] = read_rows(cache, gather[a : a + PAGE], q.dtype)
    kf[t - first :] = 0
    vf[t - first :] = 0
    pages = _pages(p0, t)
    hist = _history_by_chunks(q, p0, pages, gather, k_cache, v_cache) if quantized else {}
    qf = q
    out = torch.empty_like(q)
    for pos, start, end in pages:
        n = end - pos
        qs = qf[pos - p0 : end - p0]  # [n, H, D]: positions pos .. end - 1
        # Its own page, causal, always as one [PAGE x PAGE] call: the chunk's queries at their
        # rows in the page (the others zero; the kernel's causal case aligns query row i with
        # key i) against the page's keys (zero past the written ones), grouped heads repeated.
        own = slice(start - first, start - first + PAGE)
        kp = kf[own].repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)  # [1, H, PAGE, D]
        vp = vf[own].repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        qp = qf.new_zeros(1, h, PAGE, d)
        qp[0, :, pos - start : end - start] = qs.transpose(0, 1)
        o, lse = flash(qp, kp, vp, 0.0, True, scale=1.0)
        o, lse = o[:, :, pos - start : end - start], lse[:, :, pos - start : end - start]
        o, lse = o.reshape(h, n, d), lse.reshape(h, n)
        if start:  # the full pages before: [1, KV, G * n, D] queries (group-major), no mask
            if quantized:
                oh, lh = hist[start]  # fp32 [H, n, D], [H, n]
            else:
                kh = kf[:start].transpose(0, 1).unsqueeze(0)  # [1, KV, start, D]
                vh = vf[:start].transpose(0, 1).unsqueeze(0)
                oh, lh = _unmasked(_grouped(qs, kv), kh, vh, n, h)
            # (oh e^lh + o e^lse) / (e^lh + e^lse) = o + (oh - o) * sigmoid(lh - lse), in fp32
            o = o.float()
            o = o + (oh - o) * _sigmoid_exact((lh - lse).view(h, n, 1))
        out[pos - p0 : end - p0] = o.transpose(0, 1)  # (a merged row rounded to q's dtype here)
    return out


def _pages(p0: int, t: int) -> list[tuple[int, int, int]]:
    """A chunk of positions p0 .. t - 1 by ``PAGE``: (its first position in the page, the
    page's first position, one past its last position in the page) for each page."""
    out = []
    pos = p0
    while pos < t:
        start = pos // PAGE * PAGE
        end = min(t, start + PAGE)
        out.append((pos, start, end))
        pos = end
    return out


def _grouped(qs: torch.Tensor, kv: int) -> torch.Tensor:
    """A page's queries [n, H, D] as the unmasked history call takes them: [1, KV, G * n, D],
    group-major, padded by ``_pad_rows``: the kernel sees KV heads and G * n queries, so the
    history's K/V are never repeated per query head."""
    n, h, d = qs.shape
    g = h // kv
    return _pad_rows(qs.view(n, kv, g, d).permute(1, 2, 0, 3).reshape(1, kv, g * n, d))


def _unmasked(
    qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, n: int, h: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused CPU kernel, no mask, on ``_grouped`` queries of ``n`` positions and ``h`` heads
    against [1, KV, T, D] keys and values: (out fp32 [H, n, D], log-sum-exp [H, n])."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    rows = h // qh.shape[1] * n  # G * n: the padding rows dropped
    o, lse = flash(qh, kh, vh, 0.0, False, scale=1.0)
    return o[:, :, :rows].reshape(h, n, qh.shape[3]).float(), lse[:, :, :rows].reshape(h, n)


# Rows of a quantized cache's history dequantized at once in prefill (a multiple of ``PAGE``):
# the bound on the full-width scratch of a long prompt's history.
HISTORY = 2048


def _history_by_chunks(
    q: torch.Tensor,
    p0: int,
    pages: list[tuple[int, int, int]],
    gather: torch.Tensor,
    k_cache: KvRows,
    v_cache: KvRows,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The history part of ``_prefill_by_pages`` over a quantized cache: for each of the chunk's
    ``pages`` (``_pages``: q's rows start at position ``p0``) that starts at ``start`` > 0, the
    attention of its queries over positions 0 .. start - 1 as (out fp32 [H, n, D], log-sum-exp
    [H, n]), keyed by ``start``.

    The history is dequantized ``HISTORY`` rows at a time (once per step and layer, whichever
    pages read it); each page's calls over its chunks of it merge in fp32 by their log-sum-exps,
    in order. A row's chunks are cut at multiples of ``HISTORY`` and at its page's start, so its
    arithmetic depends on its position only, as the full-width path's (cached == uncached)."""
    kv = k_cache.shape[1]
    queries = {  # start -> (n, the page's grouped queries)
        start: (end - pos, _grouped(q[pos - p0 : end - p0], kv)) for pos, start, end in pages if start
    }
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    last = max(queries, default=0)
    for a in range(0, last, HISTORY):
        b = min(a + HISTORY, last)
        kh = read_rows(k_cache, gather[a:b], q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KV, b - a, D]
        vh = read_rows(v_cache, gather[a:b], q.dtype).transpose(0, 1).unsqueeze(0)
        for start, (n, qh) in queries.items():
            if start <= a:
                continue
            m = min(b, start) - a  # this page's history in the chunk
            o2, l2 = _unmasked(qh, kh[:, :, :m], vh[:, :, :m], n, q.shape[1])
            if start not in acc:
                acc[start] = (o2, l2)
                continue
            o1, l1 = acc[start]
            w = _sigmoid_exact((l2 - l1).unsqueeze(-1))  # the second part's share
            acc[start] = (o1 + (o2 - o1) * w, _logaddexp_exact(l1, l2))
    return acc


def _whole_vectors(fn, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` elementwise with every element through the vectorized kernel: an elementwise
    loop does its last few elements with the scalar ``exp`` / ``log``, whose result can differ
    from the vector one in the last bit, so an element's value would depend on where it sits in
    the tensor (on the chunk's length). The inputs are padded to whole vectors first."""
    flat = [x.reshape(-1) for x in xs]
    pad = -flat[0].shape[0] % 64
    return fn(*(F.pad(f, (0, pad)) for f in flat))[: flat[0].shape[0]].view(xs[0].shape)


def _sigmoid_exact(x: torch.Tensor) -> torch.Tensor:
    return _whole_vectors(torch.sigmoid, x)


def _logaddexp_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _whole_vectors(torch.logaddexp, a, b)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended along dim -2 so that the fused CPU kernel's last block of
    query rows holds at least 4 (it takes them in blocks of 32, 64 or 256, by their count): a
    block of 1-3 rows goes through another GEMM path whose sums differ in the last bit, and a
    row's result would depend on how many rows its call had. A zero query row attends evenly
    and is dropped."""
    m = x.shape[-2]
    e = 0
    while 0 < (m + e) % _q_block(m + e) < 4:
        e += 1
    if not e:
        return x
    return torch.cat((x, x.new_zeros(*x.shape[:-2], e, x.shape[-1])), dim=-2)


def _q_block(m: int) -> int:
    """The fused CPU kernel's query block for ``m`` query rows (aten FlashAttentionKernel.cpp)."""
    return 256 if m >= 768 else 64 if m >= 192 else 32


# Cache rows a decode step reads at once over its whole batch (each sequence's share rounded
# to whole blocks, at least one): the group's K/V (dequantized, for a quantized cache) is the
# only full-width copy a decode step makes. Each group costs ~a dozen eager ops per layer, which
# a small model's step feels: on SmolLM2-135M (2-core Zen 4, loaded by other work) groups of
# 2048 rows made batch 8 at depth 2048 decode at 81 tok/s against the gather's 226 (its 8
# sequences then shared one prompt's blocks: hot in cache, the gather's best case), while a
# layer call alone, 8 distinct contexts of 8192 positions, took ~20-30 ms in groups against
# 62 ms for the gather (3 KV heads x 64, bf16, one thread). So groups start past 8192 rows:
# batch 1 gathers at once to 8192 positions, batch 8 reads 1024 positions a sequence at a time.
DECODE_ROWS = 8192


def decode_attention(
    q: torch.Tensor,
    b: StepBatch,
    k_cache: KvRows,
    v_cache: KvRows,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One (pre-scaled) query per sequence against its cached keys. q: [B, H, D] -> [B, H, D].

    Plain matmuls rather than SDPA: with one query row the fused CPU kernel's setup costs
    more than the arithmetic. Grouped heads share their K/V without copying them.
    ``sinks`` [H]: learned attention sinks (gpt-oss, ``workers/layers/sinks.py``), one more
    logit per head in the softmax, with no value.

    With the step's block tables (``b.decode_blocks``: the paged pool) the cache is read by
    whole blocks, ``DECODE_ROWS`` rows over the batch at a time, in two passes: the
    scores of each group (then one softmax over the whole row: the scores are [B, H, T], a
    ``D``-th of the keys' size), then each group's values weighted by its probabilities,
    summed in fp32. So no step copies (or dequantizes) a sequence's whole context at full
    width, only one group; a batch whose contexts fit one group gathers its rows at once, as
    before (the same copy, with fewer ops: depth 0 pays nothing for the groups).
    Without them (a sliding ring's view, the compiled step) the rows of ``b.decode_gather`` are
    gathered at once (a ring holds at most its window).

    On the CPU, with the rows' lengths (``b.decode_lens``) and a cache the native kernel reads
    (fp32 / bf16 / fp16 pools, q8_0 / q4_0 rows), the kernel does it all instead
    (``workers/kernels/paged_decode.c``): each row against its own positions, read from the
    pool where they lie, in fp32, the output rounded once to q's dtype; no gather, no bias.
    On a CUDA die the same holds with Triton (``workers/kernels/paged_triton.py``: split-KV
    flash-decoding) for plain fp32 / bf16 / fp16 pools of q's dtype, when triton imports;
    quantized rows keep the torch path there.
    """
    tab = b.decode_blocks  # [B, nb]
    if (
        b.decode_lens is not None
        and tab is not None
        and q.device.type == "cuda"
        and paged_triton.available()  # (imports triton at the first CUDA step that gets here)
        and paged_triton.reads(q, k_cache, v_cache)
    ):
        return paged_triton.paged_decode(q, k_cache, v_cache, tab, b.decode_lens, b.block_size, sinks)
    if (
        b.decode_lens is not None
        and tab is not None
        and paged.reads(q, k_cache, v_cache)  # (a CUDA die's step stops here: nothing is built)
        and paged.available()
    ):
        return paged.paged_decode(q, k_cache, v_cache, tab, b.decode_lens, b.block_size, sinks)
    assert b.decode_gather is not None  # a batch with decode rows has its gather
    if tab is None:  # (the compiled step's graph never reaches the size arithmetic below)
        return _decode_by_rows(q, b, k_cache, v_cache, sinks)
    bsz, h, d = q.shape
    bs = b.block_size
    per = max(1, DECODE_ROWS // (bsz * bs))  # blocks per sequence per group
    if tab.shape[1] <= per:  # one group: the rows' gather is that group's copy
        return _decode_by_rows(q, b, k_cache, v_cache, sinks)
    kv = k_cache.shape[1]
    g = h // kv
    t = b.decode_gather.shape[1]
    nb = tab.shape[1]
    qg = q.reshape(bsz, kv, g, d)  # [B, KV, G, D]
    parts = []
    for j in range(0, nb, per):
        blk = tab[:, j : j + per]
        n = blk.shape[1] * bs
        kb = read_blocks(k_cache, blk.reshape(-1), bs, q.dtype).view(bsz, n, kv, d).transpose(1, 2)
        parts.append(torch.matmul(qg, kb.transpose(2, 3)))  # [B, KV, G, n]
    scores = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))[..., :t]  # [B, KV, G, T]
    probs = _softmax(scores, b, sinks, kv, g).to(q.dtype)
    if nb * bs > t:  # the last block's rows past the longest sequence weigh nothing
        probs = F.pad(probs, (0, nb * bs - t))
    out: torch.Tensor | None = None
    for j in range(0, nb, per):
        blk = tab[:, j : j + per]
        n = blk.shape[1] * bs
        vb = read_blocks(v_cache, blk.reshape(-1), bs, q.dtype).view(bsz, n, kv, d).transpose(1, 2)
        o = torch.matmul(probs[..., j * bs : j * bs + n], vb)  # [B, KV, G, D]
        out = o.float() if out is None else out.add_(o)
    assert out is not None
    return out.to(q.dtype).view(bsz, h, d)


def _softmax(scores: torch.Tensor, b: StepBatch, sinks: torch.Tensor | None, kv: int, g: int) -> torch.Tensor:
    """fp32 probabilities of ``scores`` [B, KV, G, T] under the step's padding bias and the
    heads' sinks (whose share goes nowhere)."""
    if b.decode_bias is not None:
        scores = scores + b.decode_bias  # fp32 from here; bias: [B, 1, 1, T]
    if sinks is not None:
        sink = sinks.float().view(1, kv, g, 1).expand(scores.shape[0], -1, -1, 1)
        scores = torch.cat((scores.float(), sink), dim=-1)  # [B, KV, G, T + 1]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return probs[..., :-1] if sinks is not None else probs


def _decode_by_rows(
    q: torch.Tensor,
    b: StepBatch,
    k_cache: KvRows,
    v_cache: KvRows,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``decode_attention`` over ``b.decode_gather``'s rows, gathered at once."""
    assert b.decode_gather is not None
    bsz, h, d = q.shape
    kv = k_cache.shape[1]
    flat = b.decode_gather.reshape(-1)  # index_select: several times faster than k_cache[gather]
    t = b.decode_gather.shape[1]
    k = read_rows(k_cache, flat, q.dtype).view(bsz, t, kv, d).transpose(1, 2)  # [B, KV, T, D]
    v = read_rows(v_cache, flat, q.dtype).view(bsz, t, kv, d).transpose(1, 2)
    qg = q.reshape(bsz, kv, h // kv, d)  # [B, KV, G, D]
    scores = torch.matmul(qg, k.transpose(2, 3))  # [B, KV, G, T]
    probs = _softmax(scores, b, sinks, kv, h // kv).to(q.dtype)
    return torch.matmul(probs, v).view(bsz, h, d)  # [B, KV, G, D]
