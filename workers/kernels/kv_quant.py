"""Quantized KV cache rows: llama.cpp's ``q8_0`` and ``q4_0`` block layouts, and ``fp8_e4m3``.

A cached K or V row of one head (``D`` values) is stored in blocks of ``QBLOCK`` (32) values
along ``D``, each block with one fp16 scale ``d`` (``pantheon/core/kv_types.py`` has the byte
counts the router books; these tensors take exactly those bytes):

- ``q8_0``: ``d = amax / 127``, each value ``round(x / d)`` as an int8: data ``[rows, KV, D]`` int8;
- ``q4_0``: ``d = m / -8`` with ``m`` the block's value of largest magnitude (its sign kept),
  each value ``min(15, trunc(x / d + 8.5))`` as a nibble, read back as ``(n - 8) * d``; two
  nibbles a byte, value i of a block in byte i's low nibble and value i + 16 in its high one
  (llama.cpp's ``block_q4_0``): data ``[rows, KV, D / 2]`` uint8;
- ``fp8_e4m3``: one ``float8_e4m3fn`` per value (kept as uint8 bytes), no scale (CUDA dies: ``workers/cache.py``
  refuses it elsewhere).

Values are rounded against the scale as stored (fp16), which keeps each value within half a
step of what is read back (llama.cpp rounds against the fp32 scale, then stores it rounded).

Pure torch and vectorized (one pass over the rows, no Python loop over blocks), so the same
code runs on CPUs and CUDA dies. Writing a token quantizes its rows straight into the cache
(``QuantRows.write``: no full-width copy is kept); attention gathers the rows (or whole blocks
of the paged pool) it reads and dequantizes them to the compute dtype a bounded group at a time
(``workers/layers/attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pantheon.core.kv_types import QBLOCK

QUANT_KINDS = ("q8_0", "q4_0", "fp8_e4m3")


def quantize(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] (any float dtype) as ``kind``: (data, scales [..., D / 32] fp16).
    fp8 has no scales: an empty tensor stands for them."""
    if kind == "fp8_e4m3":
        # kept as its bytes: index_copy_ / index_select know uint8 on every device
        return x.to(torch.float8_e4m3fn).view(torch.uint8), x.new_empty(0, dtype=torch.float16)
    *lead, d = x.shape
    xb = x.float().reshape(*lead, d // QBLOCK, QBLOCK)  # [..., nb, 32]
    if kind == "q8_0":
        amax = xb.abs().amax(dim=-1, keepdim=True)
        scale = (amax / 127.0).half().float()  # the stored scale: values rounded against it
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(xb * inv).clamp_(-127, 127).to(torch.int8)
        return q.reshape(*lead, d), scale.squeeze(-1).to(torch.float16)
    if kind == "q4_0":
        idx = xb.abs().argmax(dim=-1, keepdim=True)
        m = torch.gather(xb, -1, idx)  # the block's value of largest magnitude, signed
        scale = (m / -8.0).half().float()
        inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
        # trunc of a value >= 0.5 - tiny: floor, as llama.cpp's (int8_t) cast of a positive value
        q = torch.floor(xb * inv + 8.5).clamp_(0, 15).to(torch.uint8)  # [..., nb, 32]
        packed = q[..., : QBLOCK // 2] | (q[..., QBLOCK // 2 :] << 4)  # [..., nb, 16]
        return packed.reshape(*lead, d // 2), scale.squeeze(-1).to(torch.float16)
    raise ValueError(f"not a quantized KV cache type: {kind!r}")


def dequantize(kind: str, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``quantize``'s inverse: data [..., D or D / 2], scales [..., D / 32] -> [..., D] in ``dtype``."""
    if kind == "fp8_e4m3":
        return data.view(torch.float8_e4m3fn).to(dtype)
    *lead, w = data.shape
    nb = scales.shape[-1]
    s = scales.float().unsqueeze(-1)  # [..., nb, 1]
    # in place after the one fp32 copy: each fresh temporary of a group's size costs page faults
    # (several times the arithmetic, measured on a CPU)
    if kind == "q8_0":
        return data.view(*lead, nb, QBLOCK).float().mul_(s).to(dtype).view(*lead, w)
    if kind == "q4_0":
        p = data.view(*lead, nb, QBLOCK // 2)
        q = torch.cat((p & 0x0F, p >> 4), dim=-1)  # [..., nb, 32]
        return q.float().sub_(8.0).mul_(s).to(dtype).view(*lead, 2 * w)
    raise ValueError(f"not a quantized KV cache type: {kind!r}")


@dataclass
class QuantRows:
    """One layer's quantized K (or V) rows: ``data`` [rows, KV, D or D / 2] and ``scales``
    [rows, KV, D / 32] fp16 (empty for fp8); ``dim`` is D. Quacks like the full-width
    ``[rows, KV, D]`` tensor where attention needs it (``shape``, ``device``, ``read``/``write``)."""

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    dim: int

    @staticmethod
    def empty(kind: str, rows: int, kv_heads: int, dim: int, device: torch.device) -> QuantRows:
        if kind == "fp8_e4m3":
            data = torch.zeros((rows, kv_heads, dim), dtype=torch.uint8, device=device)  # fp8 bytes
            return QuantRows(kind, data, torch.empty(0, dtype=torch.float16, device=device), dim)
        width = dim if kind == "q8_0" else dim // 2
        dt = torch.int8 if kind == "q8_0" else torch.uint8
        data = torch.zeros((rows, kv_heads, width), dtype=dt, device=device)
        scales = torch.zeros((rows, kv_heads, dim // QBLOCK), dtype=torch.float16, device=device)
        return QuantRows(kind, data, scales, dim)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.data.shape[1], self.dim)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x`` [n, KV, D] into cache rows ``rows`` [n]."""
        data, scales = quantize(self.kind, x)
        self.data.index_copy_(0, rows, data)
        if self.scales.numel():
            self.scales.index_copy_(0, rows, scales)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows ``rows`` [n] dequantized: [n, KV, D] in ``dtype``."""
        sc = self.scales.index_select(0, rows) if self.scales.numel() else self.scales
        return dequantize(self.kind, self.data.index_select(0, rows), sc, dtype)

    def read_blocks(self, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Whole blocks of the paged pool (``block_size`` rows each) dequantized:
        blocks [n] -> [n * block_size, KV, D] in ``dtype``."""
        rows, kv = self.data.shape[0], self.data.shape[1]
        data = self.data.view(rows // block_size, -1).index_select(0, blocks)
        data = data.view(-1, kv, self.data.shape[2])
        sc = self.scales
        if sc.numel():
            sc = sc.view(rows // block_size, -1).index_select(0, blocks).view(-1, kv, sc.shape[2])
        return dequantize(self.kind, data, sc, dtype)


KvRows = torch.Tensor | QuantRows  # a layer's K (or V) cache: full width, or quantized


def write_rows(cache: KvRows, rows: torch.Tensor, x: torch.Tensor) -> None:
    """Store ``x`` [n, KV, D] into cache rows ``rows`` [n]: copied, or quantized in place."""
    if isinstance(cache, QuantRows):
        cache.write(rows, x)
    else:
        cache.index_copy_(0, rows, x)


def read_rows(cache: KvRows, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``rows`` [n] at full width: [n, KV, D] in ``dtype`` (a full-width cache's own
    dtype is kept: it is the compute dtype)."""
    if isinstance(cache, QuantRows):
        return cache.read(rows, dtype)
    return cache.index_select(0, rows)


def read_blocks(cache: KvRows, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks ``blocks`` [n] of a paged pool at full width: [n * block_size, KV, D]."""
    if isinstance(cache, QuantRows):
        return cache.read_blocks(blocks, block_size, dtype)
    rows, kv, d = cache.shape
    return cache.view(rows // block_size, -1).index_select(0, blocks).view(-1, kv, d)
