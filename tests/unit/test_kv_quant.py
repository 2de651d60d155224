"""Quantized KV cache rows (workers/kernels/kv_quant.py): llama.cpp's q8_0 / q4_0 layouts, round
trips within each type's bound, attention over a quantized cache against its dequantized copy,
the bytes a quantized cache takes, and what an engine refuses."""

from __future__ import annotations

import pytest
import torch

from pantheon.core.kv_types import KvCacheTypes, row_bytes
from workers.cache import kv_block_bytes, make_caches
from workers.engine import Engine, LoadError
from workers.kernels.kv_quant import QuantRows, dequantize, quantize
from workers.layers import attention as A
from workers.model_config import load_config

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_round_trip_within_the_types_bound(kind):
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]  # magnitudes 1e-3 .. 1e2
    x[7, 1, :32] = 0  # an all-zero block: scale 0, values 0
    data, scales = quantize(kind, x)
    y = dequantize(kind, data, scales, torch.float32)
    amax = x.view(50, 3, 2, 32).abs().amax(-1, keepdim=True)
    err = (y - x).view(50, 3, 2, 32).abs()
    # q8_0: half a step of amax / 127; q4_0: half a step of amax / 8, except the values of the
    # sign opposite to the largest one that reach 8 steps (clamped to 7): one step
    bound = amax / 254 if kind == "q8_0" else amax / 8
    assert bool((err <= bound * 1.01 + 1e-12).all()), float((err - bound).max())
    assert bool((y[7, 1, :32] == 0).all())
    mean_rel = (err.sum() / x.abs().sum()).item()
    assert mean_rel < (0.01 if kind == "q8_0" else 0.12)


def test_q4_0_is_llama_cpps_block_layout():
    """Value i of a block in byte i's low nibble, value i + 16 in its high one; d = m / -8 with m
    the value of largest magnitude (which comes back exactly); n = min(15, trunc(x / d + 8.5))."""
    x = torch.linspace(-1.0, 0.5, 32).view(1, 1, 32)  # m = -1: d = 0.125
    data, scales = quantize("q4_0", x)
    assert data.shape == (1, 1, 16) and data.dtype == torch.uint8
    assert scales.item() == 0.125
    n = torch.clamp(torch.floor(x[0, 0] / 0.125 + 8.5), max=15).to(torch.uint8)
    assert data[0, 0].tolist() == (n[:16] | (n[16:] << 4)).tolist()
    assert dequantize("q4_0", data, scales, torch.float32)[0, 0, 0].item() == -1.0


def test_q8_0_layout():
    x = torch.linspace(-2.0, 1.0, 32).view(1, 1, 32)
    data, scales = quantize("q8_0", x)
    assert data.dtype == torch.int8 and data.shape == (1, 1, 32)
    assert scales.dtype == torch.float16 and abs(scales.item() - 2 / 127) < 1e-5
    assert data[0, 0, 0].item() == -127


def test_fp8_rows_round_trip():
    x = torch.randn(4, 2, 32)
    rows = QuantRows.empty("fp8_e4m3", 8, 2, 32, CPU)
    rows.write(torch.tensor([1, 3, 5, 7]), x)
    y = rows.read(torch.tensor([1, 3, 5, 7]), torch.float32)
    assert bool(((y - x).abs() <= x.abs() / 16 + 2**-9).all())  # 3 mantissa bits


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "fp8_e4m3"])
def test_rows_take_exactly_the_booked_bytes(kind):
    rows = QuantRows.empty(kind, 64, 3, 64, CPU)
    assert rows.nbytes == 64 * 3 * row_bytes(kind, 64, 2)
    assert rows.shape == (64, 3, 64)


def _dequantized(c: QuantRows) -> torch.Tensor:
    return c.read(torch.arange(c.shape[0]), torch.float32)


@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0")])
def test_attention_over_a_quantized_cache_is_attention_over_its_dequantized_copy(kinds):
    """A decode row and a prefill chunk after history, through ``paged_attention`` (which writes
    the step's K/V quantized): the same outputs as over the dequantized cache, fp32."""
    torch.manual_seed(1)
    h, kv, d, bs = 4, 2, 64, 16
    rows = 16 * bs
    kq, vq = (QuantRows.empty(k, rows, kv, d, CPU) for k in kinds)
    hist = 150  # sequence 0: positions 0..149 in blocks 2..11, then a chunk of 40 more
    table = list(range(2, 2 + 13))
    all_rows = torch.tensor([table[p // bs] * bs + p % bs for p in range(190)])
    kq.write(all_rows[:hist], torch.randn(hist, kv, d))
    vq.write(all_rows[:hist], torch.randn(hist, kv, d))
    # one decode row (sequence 1: 30 positions in blocks 0, 1; its new token at 29) + the chunk
    dec_rows = torch.arange(30)
    kq.write(dec_rows[:29], torch.randn(29, kv, d))
    vq.write(dec_rows[:29], torch.randn(29, kv, d))
    n = 1 + 40
    q, k, v = torch.randn(n, h, d), torch.randn(n, kv, d), torch.randn(n, kv, d)
    slots = torch.cat((dec_rows[29:30], all_rows[hist:190]))
    chunk = A.PrefillChunk(1, n, all_rows[:190], None)
    b = A.StepBatch(
        torch.zeros(1), torch.zeros(1), slots, 1, dec_rows[None], None, [chunk],
        decode_blocks=torch.tensor([[0, 1]]), block_size=bs,
    )  # fmt: skip
    got = A.paged_attention(q, k, v, b, kq, vq)
    kd, vd = _dequantized(kq), _dequantized(vq)  # now holding the step's rows too
    b.decode_blocks = None  # the reference: the rows path over full-width tensors
    chunk.mask = None
    want = torch.empty_like(q)
    want[:1] = A.decode_attention(q[:1], b, kd, vd)
    c = chunk
    want[1:] = torch.nn.functional.scaled_dot_product_attention(
        q[1:].transpose(0, 1)[None],
        kd[c.gather].transpose(0, 1)[None],
        vd[c.gather].transpose(0, 1)[None],
        attn_mask=A.offset_causal_mask(hist, 40, CPU),
        enable_gqa=True,
        scale=1.0,
    )[0].transpose(0, 1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_cache_bytes_and_block_bytes(model_factory):
    path = model_factory("tiny", dtype="float32", head_dim=32)
    desc = load_config(str(path))
    auto = kv_block_bytes(desc, 16, torch.bfloat16)
    q8 = kv_block_bytes(desc, 16, torch.bfloat16, KvCacheTypes("q8_0", "q8_0"))
    q4 = kv_block_bytes(desc, 16, torch.bfloat16, KvCacheTypes("q4_0", "q4_0"))
    assert auto / q8 == pytest.approx(64 / 34) and auto / q4 == pytest.approx(64 / 18)
    caches = make_caches(desc, [CPU] * 2, 64, 2, torch.bfloat16, kv_types=KvCacheTypes("q8_0", "q4_0"))
    mixed = kv_block_bytes(desc, 16, torch.bfloat16, KvCacheTypes("q8_0", "q4_0"))
    assert sum(c.kv_nbytes for c in caches) == mixed * 64 // 16


def test_engine_refusals(model_factory):
    narrow = model_factory("tiny", dtype="float32")  # head_dim 16
    with pytest.raises(LoadError, match="blocks of 32 values"):
        Engine(str(narrow), dtype="float32", kv_budget_bytes=1 << 20, kv_cache_k="q8_0")
    wide = model_factory("tiny", dtype="float32", head_dim=32)
    with pytest.raises(LoadError, match="fp8_e4m3 needs CUDA"):
        Engine(str(wide), dtype="float32", kv_budget_bytes=1 << 20, kv_cache_v="fp8_e4m3")
