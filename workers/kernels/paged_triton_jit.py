"""The Triton kernels of ``paged_triton`` (flash-decoding over the paged KV pool). This module
imports triton at its top: only ``paged_triton`` imports it, inside its functions, once a CUDA
step (or a test under ``TRITON_INTERPRET=1``) has asked for the kernel. Nothing on the CPU
engine's path imports it.

Decode, two kernels per call:

- ``partials``: one program per (decode row, KV head, partition of ``PART`` positions). It reads
  its positions' K and V rows where they lie in the pool (through the row's block table) in
  tiles of ``BLOCK_N`` positions, for all ``G`` query heads of its KV head at once (each K/V
  tile is read once per group), with an online softmax in fp32; it writes the partition's
  normalized output and its log-sum-exp (base 2). A program whose partition starts at or past
  its row's length does nothing.
- ``merge``: one program per (decode row, query head): the row's partitions (only the ones its
  length reaches) combined by their log-sum-exps, the head's sink (if any) added to the
  denominator, the result rounded once to the output's dtype.

Prefill, one kernel (``prefill``): one program per (KV head, query tile); a tile is ``BLOCK_M``
consecutive queries of one chunk (the host's table of tiles says which chunk, where its rows
start, its length and first position p0), folded with the group's ``G`` query heads into
``ROWS`` rows (row r: query r // G, head r % G), so each K/V tile read from the pool serves the
whole group in one ``tl.dot``. Its key tiles of ``BLOCK_N`` positions go from 0 to its last
position: the ones wholly before its first position unmasked, the diagonal ones masked
(key <= the row's position); nothing past it is read.

The scores are kept in base 2 (``exp2``, the hardware's instruction): scores and sinks are
multiplied by log2(e) once, which changes no probability.

Parameter annotations: Triton reads them itself (``tl.constexpr`` marks a compile-time
argument; other annotations would change how it specializes), so the pointer and integer
arguments carry none; their shapes are in the comments.
"""

import triton  # pyright: ignore[reportMissingImports]  (an optional dependency: CUDA hosts only)
import triton.language as tl  # pyright: ignore[reportMissingImports]

# a constexpr: a compiled kernel may read no other global (the interpreter does not mind:
# tests/unit/test_paged_triton.py compiles each kernel for sm_90 too, where it would)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def partials(
    Q,  # [B, H, D] (pre-scaled), rows of stride_qb, heads of stride_qh, D contiguous
    K,  # [rows, KV, D] pool, contiguous
    V,  # [rows, KV, D] pool, contiguous
    TAB,  # [B, nb] int32 / int64 block table, rows of stride_tb
    LENS,  # [B] int32 / int64: row b reads positions < LENS[b]
    O_PART,  # [B, H, P, D] fp32: each partition's output, normalized by its own sum
    LSE_PART,  # [B, H, P] fp32: each partition's log2-sum-exp2 of its scores (base 2)
    stride_qb,
    stride_qh,
    stride_kr,  # K's row stride (KV * D)
    stride_kh,  # K's head stride (D)
    stride_vr,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_op,
    stride_lb,
    stride_lh,
    part,  # positions per partition (a multiple of BLOCK_N; a runtime value: no recompile per batch size)
    G: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # G rounded up to a power of two, at least 16 (tl.dot's smallest M)
    D: tl.constexpr,  # head width, a power of two 16..256
    BS: tl.constexpr,  # the pool's block size (positions per block)
    BLOCK_N: tl.constexpr,  # positions per tile
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for fp32 pools (no TF32 rounding)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(LENS + b).to(tl.int32)
    start = p * part
    # A partition past the row's length contributes nothing: the merge reads only the
    # partitions below cdiv(len, part), so nothing is written (no scratch to clear).
    if start < seq_len:
        end = tl.minimum(start + part, seq_len)
        offs_g = tl.arange(0, G_PAD)  # [G_PAD]: the group's query heads, padded with zero rows
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_g = offs_g < G
        heads = kvh * G + offs_g  # [G_PAD]
        q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)  # [G_PAD, D]: pad rows score 0
        m = tl.full([G_PAD], float("-inf"), tl.float32)  # running max (base 2)
        s_sum = tl.zeros([G_PAD], tl.float32)  # running sum of exp2(score - m)
        acc = tl.zeros([G_PAD, D], tl.float32)  # running sum of exp2(score - m) * v
        tab_row = TAB + b.to(tl.int64) * stride_tb
        k_head = K + kvh.to(tl.int64) * stride_kh
        v_head = V + kvh.to(tl.int64) * stride_vh
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n  # [BLOCK_N]; pos[0] < end always: each tile has a real position
            mask_n = pos < end
            blk = tl.load(tab_row + pos // BS, mask=mask_n, other=0).to(tl.int64)
            rows = blk * BS + pos % BS  # [BLOCK_N] pool rows (int64: pools may pass 2^31 elements)
            k = tl.load(k_head + rows[:, None] * stride_kr + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * LOG2E  # [G_PAD, BLOCK_N] fp32
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: each tile has a real position
            alpha = tl.exp2(m - m_new)  # 0 on the first tile (m = -inf)
            w = tl.exp2(s - m_new[:, None])  # [G_PAD, BLOCK_N]
            s_sum = s_sum * alpha + tl.sum(w, 1)
            v = tl.load(v_head + rows[:, None] * stride_vr + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            # The weights in V's dtype (bf16 / fp16 tensor-core inputs, as the torch path rounds
            # its probabilities to q's dtype); fp32 pools stay fp32 ("ieee").
            acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        o = acc / s_sum[:, None]  # [G_PAD, D]; s_sum >= 1 on every row (its max's own term)
        o_ptrs = (
            O_PART + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + p * stride_op + offs_d[None, :]
        )
        tl.store(o_ptrs, o, mask=mask_g[:, None])
        lse_ptrs = LSE_PART + b.to(tl.int64) * stride_lb + heads * stride_lh + p  # [G_PAD]
        tl.store(lse_ptrs, m + tl.log2(s_sum), mask=mask_g)


@triton.jit
def merge(
    O_PART,  # [B, H, P, D] fp32 (``partials``)
    LSE_PART,  # [B, H, P] fp32, base 2
    LENS,  # [B]
    SINKS,  # [H] (any float dtype) or a dummy pointer when not HAS_SINKS
    OUT,  # [B, H, D] in q's dtype, rows of stride_outb, heads of stride_outh
    stride_ob,
    stride_oh,
    stride_op,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    part,  # positions per partition, as ``partials`` had it
    D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(LENS + b).to(tl.int32)
    n_parts = tl.cdiv(seq_len, part)  # >= 1 (lens >= 1): only the partitions that were written
    offs_d = tl.arange(0, D)
    o_base = O_PART + b.to(tl.int64) * stride_ob + h * stride_oh
    l_base = LSE_PART + b.to(tl.int64) * stride_lb + h * stride_lh
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([D], tl.float32)
    for i in range(0, n_parts):
        lse = tl.load(l_base + i)
        o = tl.load(o_base + i * stride_op + offs_d)  # [D]
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)  # 0 on the first partition
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + o * w
        total = total * alpha + w
        m = m_new
    if HAS_SINKS:  # one more logit in the denominator, with no value
        sink = tl.load(SINKS + h).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha
        total = total * alpha + tl.exp2(sink - m_new)
    out = acc / total
    tl.store(OUT + b.to(tl.int64) * stride_outb + h * stride_outh + offs_d, out.to(OUT.dtype.element_ty))


# --- prefill: flash-attention forward over the paged pool ----------------------------------------


@triton.jit
def _prefill_tile(
    acc,  # [ROWS, D] fp32
    m_i,  # [ROWS] fp32 running max (base 2)
    l_i,  # [ROWS] fp32 running sum
    q,  # [ROWS, D]
    k_head,  # K + kvh * stride_kh
    v_head,
    tab_row,  # the chunk's block table row
    n0,  # the tile's first key position
    hi,  # one past the query tile's last position (the keys' bound in a causal tile)
    pos,  # [ROWS] int32: each query row's position
    stride_kr,
    stride_vr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,  # a diagonal tile: keys past a row's position (or past ``hi``) masked
    PRECISION: tl.constexpr,
):
    """One tile of ``BLOCK_N`` keys folded into a query tile's online softmax."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    keys = n0 + offs_n  # [BLOCK_N]
    live = keys < hi  # (every key of a full tile: its loads go unmasked)
    if CAUSAL:
        blk = tl.load(tab_row + keys // BS, mask=live, other=0).to(tl.int64)
    else:
        blk = tl.load(tab_row + keys // BS).to(tl.int64)
    rows = blk * BS + keys % BS  # [BLOCK_N] pool rows (int64)
    if CAUSAL:
        k = tl.load(k_head + rows[:, None] * stride_kr + offs_d[None, :], mask=live[:, None], other=0.0)
    else:
        k = tl.load(k_head + rows[:, None] * stride_kr + offs_d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * LOG2E  # [ROWS, BLOCK_N] fp32
    if CAUSAL:
        # A key past ``hi`` is past every row's position: one comparison masks both.
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
    # Finite: a row sees key 0 in the first tile it meets (a full tile, or the first causal one
    # when there is none), so m_i is finite from then on even where a causal tile hides all.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
    w = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(w, 1)
    if CAUSAL:
        v = tl.load(v_head + rows[:, None] * stride_vr + offs_d[None, :], mask=live[:, None], other=0.0)
    else:
        v = tl.load(v_head + rows[:, None] * stride_vr + offs_d[None, :])
    acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def prefill(
    Q,  # [N, H, D] (pre-scaled): the step's flat batch, rows of stride_qn, heads of stride_qh
    K,  # [rows, KV, D] pool, contiguous
    V,  # [rows, KV, D] pool, contiguous
    TAB,  # [chunks, nb] int32: each chunk's block table row, rows of stride_tc
    TILES,  # [tiles, 5] int32, contiguous: (chunk's first row in the batch, the tile's first query
    # in its chunk, the chunk's length C, its first position p0, its index in TAB)
    SINKS,  # [H] (any float dtype) or a dummy pointer when not HAS_SINKS
    OUT,  # [N, H, D] in q's dtype: rows of stride_on, heads of stride_oh
    stride_qn,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_tc,
    stride_on,
    stride_oh,
    G: tl.constexpr,  # query heads per KV head
    ROWS: tl.constexpr,  # rows of a query tile: BLOCK_M positions x G heads (padded), a power of two
    BLOCK_M: tl.constexpr,  # query positions per tile (ROWS // G)
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # key positions per tile
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    kvh = tl.program_id(0)
    meta = TILES + tl.program_id(1) * 5
    row0 = tl.load(meta).to(tl.int64)
    q_first = tl.load(meta + 1).to(tl.int32)
    n_q = tl.load(meta + 2).to(tl.int32)
    p0 = tl.load(meta + 3).to(tl.int32)
    chunk = tl.load(meta + 4).to(tl.int64)
    q_end = tl.minimum(q_first + BLOCK_M, n_q)  # one past the tile's last query
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    # Row r: query q_first + r // G, head kvh * G + r % G (a position's G heads are adjacent in
    # q and out, G * D contiguous values). Rows past the tile (r >= BLOCK_M * G, or a query past
    # the chunk) repeat its last query: finite like it, never stored.
    qi = q_first + offs_r // G
    keep = (offs_r < BLOCK_M * G) & (qi < q_end)
    qi = tl.minimum(qi, q_end - 1)
    heads = kvh * G + offs_r % G
    pos = p0 + qi  # [ROWS] each row's position: it sees keys 0 .. pos
    q_rows = row0 + qi.to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :])
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    tab_row = TAB + chunk * stride_tc
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    lo = p0 + q_first  # the tile's first position
    hi = p0 + q_end  # one past its last
    # Key tiles wholly at or before the tile's first position: no mask. Then the diagonal ones,
    # masked, up to its last position; nothing past it is read.
    full = (lo + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, k_head, v_head, tab_row, n0, hi, pos, stride_kr, stride_vr,
            BS, BLOCK_N, D, False, PRECISION,
        )  # fmt: skip
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, k_head, v_head, tab_row, n0, hi, pos, stride_kr, stride_vr,
            BS, BLOCK_N, D, True, PRECISION,
        )  # fmt: skip
    if HAS_SINKS:  # one more logit in the denominator, with no value
        sink = tl.load(SINKS + heads).to(tl.float32) * LOG2E  # [ROWS]
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    o = acc / l_i[:, None]
    o_ptrs = OUT + q_rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=keep[:, None])
