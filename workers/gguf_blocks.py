"""GGUF block formats unpacked to float32: in one native pass (``workers/kernels/dequant.c``), or
where it does not build with torch ops over many blocks at once (no loop per block; the same
values). ``workers/gguf_weights.py`` reads a file's tensors through it; a token table held as
its blocks (``workers/layers/block_embedding.py``) unpacks its looked-up rows through it.

Block layouts (ggml's, all little-endian, ``d``/``m``/``dmin`` are fp16):

- Q8_0 (32): d, 32 x int8;                      x = d * q
- Q4_0 (32): d, 16 bytes of nibbles;            x = d * (q - 8), low nibbles are x[0:16]
- Q4_1 (32): d, m, 16 bytes of nibbles;         x = d * q + m
- Q5_0/Q5_1 (32): as Q4_0/Q4_1 plus 32 high bits (a uint32, bit i for x[i]); Q5_0 subtracts 16
- Q2_K (256): 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit values, d, dmin
- Q3_K (256): 32 bytes of high bits, 64 bytes of 2-bit values, 12 bytes of 16 6-bit scales, d
- Q4_K (256): d, dmin, 12 bytes of 8 6-bit scales and 8 6-bit mins, 128 bytes of nibbles
- Q5_K (256): as Q4_K plus 32 bytes of high bits (bit s of byte l for sub-block s)
- Q6_K (256): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d
- MXFP4 (32): e (an e8m0 exponent byte), 16 bytes of e2m1 nibbles; x = 2 * fp4(q) * 2 ** (e - 128)
  (ggml's doubled levels times half the scale), low nibbles are x[0:16] (gpt-oss's experts)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pantheon.core.gguf import TENSOR_TYPES
from workers.kernels import dequant as dequant_kernel

# ---------------------------------------------------------------- dequantization
#
# Each block function fills ``out`` ([n_blocks, block] float32) from ``b`` ([n_blocks, block
# bytes] uint8, the file's bytes) with torch ops over all its blocks at once, in the same
# arithmetic as ggml's reference code.

_SHIFT_4 = torch.tensor([0, 4], dtype=torch.uint8)
_SHIFT_2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_SHIFT_1 = torch.arange(8, dtype=torch.uint8)


def _halves(b: torch.Tensor, at: int, count: int = 1) -> torch.Tensor:
    """``count`` consecutive fp16 values at byte ``at`` of every block, as float32 [n, count]."""
    return b[:, at : at + 2 * count].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k] uint8: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor, shifts: int) -> torch.Tensor:
    """[n, k] bytes -> [n, shifts, k]: bit s of every byte at [:, s, :]."""
    return (qh.unsqueeze(1) >> _SHIFT_1[:shifts].view(1, shifts, 1)) & 1


def _q8_0(b, out):
    torch.mul(b[:, 2:].view(torch.int8), _halves(b, 0), out=out)


def _q4_0(b, out):
    torch.mul(_nibbles(b[:, 2:]).float() - 8, _halves(b, 0), out=out)


def _q4_1(b, out):
    dm = _halves(b, 0, 2)
    torch.addcmul(dm[:, 1:2], dm[:, 0:1], _nibbles(b[:, 4:]).float(), out=out)


def _q5(b, at_qh: int):
    """Q5_0/Q5_1's 5-bit values [n, 32]: nibbles, plus bit i of the little-endian uint32 for x[i]."""
    n = b.shape[0]
    low = _nibbles(b[:, at_qh + 4 : at_qh + 20])
    high = _bits(b[:, at_qh : at_qh + 4], 8).transpose(1, 2).reshape(n, 32)  # bit 8 j + s: byte j
    return low | (high << 4)


def _q5_0(b, out):
    torch.mul(_q5(b, 2).float() - 16, _halves(b, 0), out=out)


def _q5_1(b, out):
    dm = _halves(b, 0, 2)
    torch.addcmul(dm[:, 1:2], dm[:, 0:1], _q5(b, 4).float(), out=out)


def _shift2(qs: torch.Tensor) -> torch.Tensor:
    """[n, 64] bytes of 2-bit values -> [n, 256]: per 32-byte half, shifts 0, 2, 4, 6."""
    return ((qs.reshape(-1, 2, 1, 32) >> _SHIFT_2.view(1, 1, 4, 1)) & 3).reshape(qs.shape[0], 256)


def _q2_k(b, out):
    n = b.shape[0]
    sc = b[:, 0:16]
    dm = _halves(b, 80, 2)
    dl = (dm[:, 0:1] * (sc & 0x0F)).view(n, 16, 1)
    ml = (dm[:, 1:2] * (sc >> 4)).view(n, 16, 1)
    q = _shift2(b[:, 16:80]).view(n, 16, 16)
    torch.sub(dl * q, ml, out=out.view(n, 16, 16))


def _q3_k(b, out):
    n = b.shape[0]
    hmask, qs, raw = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    low = _nibbles(raw[:, 0:8])  # scale i: low bits in byte i % 8, high bits in byte 8 + i % 4
    high = ((raw[:, 8:12].unsqueeze(1) >> _SHIFT_2.view(1, 4, 1)) & 3).reshape(n, 16)  # byte i % 4
    scales = (low | (high << 4)).to(torch.int8) - 32
    q = _shift2(qs).view(n, 8, 32).to(torch.int8) - ((_bits(hmask, 8).to(torch.int8) ^ 1) << 2)
    d = (_halves(b, 108) * scales).view(n, 16, 1)
    torch.mul(d, q.view(n, 16, 16), out=out.view(n, 16, 16))


def _scale_min_k4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins [n, 8]."""
    d, m, md = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_quant(b, out, q):
    """Q4_K/Q5_K: x = d * scale * q - dmin * min, per sub-block of 32; ``q`` [n, 8, 32]."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dm = _halves(b, 0, 2)
    d = (dm[:, 0:1] * sc).view(n, 8, 1)
    m = (dm[:, 1:2] * mn).view(n, 8, 1)
    torch.sub(d * q, m, out=out.view(n, 8, 32))


def _q4_k(b, out):
    n = b.shape[0]
    # per 32-byte chunk c: its low nibbles are sub-block 2c, its high ones sub-block 2c + 1
    q = _nibbles(b[:, 16:144].reshape(n * 4, 32)).view(n, 8, 32)
    _k_quant(b, out, q)


def _q5_k(b, out):
    n = b.shape[0]
    qs = b[:, 48:176].reshape(n, 4, 1, 32) >> _SHIFT_4.view(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32) | (_bits(b[:, 16:48], 8) << 4)
    _k_quant(b, out, q)


def _q6_k(b, out):
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64) >> _SHIFT_4.view(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 8, 32)
    q = (ql | (_shift2(b[:, 128:192]).view(n, 8, 32) << 4)).to(torch.int8) - 32
    d = (_halves(b, 208) * b[:, 192:208].view(torch.int8)).view(n, 16, 1)
    torch.mul(d, q.view(n, 16, 16), out=out.view(n, 16, 16))


# ggml's kvalues_mxfp4: the e2m1 levels doubled (its scales are halved to match)
_MXFP4_LEVELS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _mxfp4(b, out):
    exp = b[:, :1].to(torch.int32) - 128  # [n, 1]
    out[:] = torch.ldexp(_MXFP4_LEVELS[_nibbles(b[:, 1:]).long()], exp)


# Blocks are unpacked a chunk of values at a time: a chunk's temporaries stay in the CPU's cache,
# and every op stays under torch's parallel grain (32768 values), so none waits for threads that a
# busy machine (other models' workers) may not schedule soon. The chunks are few: one per 16k
# values, ~8000 for a 135M-parameter model.
CHUNK_VALUES = 1 << 14

BLOCKS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "MXFP4": _mxfp4,
}
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
LAYOUT = {name: (block, nbytes) for name, block, nbytes in TENSOR_TYPES.values()}
assert set(BLOCKS) | set(FLOATS) == set(LAYOUT)


def block_layout(type_name: str) -> tuple[int, int]:
    """(values a block, bytes a block) of a GGUF tensor type (1 value for the float types)."""
    return LAYOUT[type_name]


def dequantize(
    raw: torch.Tensor, type_name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A tensor's bytes (uint8, as in the file) -> ``shape`` in ``dtype``. Float types are views
    of ``raw`` when ``dtype`` is theirs; quantized ones are computed in float32 (then cast: the
    loader leaves that to its copy into the parameter)."""
    if type_name in FLOATS:
        return raw.view(FLOATS[type_name]).view(shape).to(dtype)
    block, nbytes = LAYOUT[type_name]
    blocks = raw.view(-1, nbytes)
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32)
    _unpack(blocks, type_name, out)
    return out.view(shape).to(dtype)


def _unpack(blocks: torch.Tensor, type_name: str, out: torch.Tensor) -> None:
    """Fill ``out`` ([n, block] float32, contiguous) from ``blocks`` ([n, block bytes] uint8) of
    quantized type ``type_name``: in one native pass where the kernel takes them, else with the
    torch ops a run of blocks at a time (the same values)."""
    if dequant_kernel.takes(type_name) and blocks.is_contiguous():
        dequant_kernel.blocks(blocks, type_name, out)
        return
    fill, step = BLOCKS[type_name], max(1, CHUNK_VALUES // out.shape[1])
    for i in range(0, blocks.shape[0], step):
        fill(blocks[i : i + step], out[i : i + step])


@dataclass(frozen=True)
class Unpacked:
    """A GGUF tensor's blocks, unpacked where the loader puts them: ``into(dst)`` writes the
    values straight into a float32 parameter (no float copy of the tensor in between: a fresh
    tensor's pages, then a copy out of it, were half of a Qwen3.5-0.8B load's memory traffic);
    ``tensor()`` unpacks them into a new tensor, as ``dequantize`` does."""

    raw: torch.Tensor  # the file's bytes, uint8
    type_name: str
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        return dequantize(self.raw, self.type_name, self.shape)

    def into(self, dst: torch.Tensor) -> bool:
        """Unpack into ``dst`` (of ``shape``) when it takes the values as they are: contiguous
        float32 on the CPU. False (nothing written) otherwise."""
        if not (
            dst.dtype == torch.float32
            and dst.device.type == "cpu"
            and dst.is_contiguous()
            and tuple(dst.shape) == self.shape
        ):
            return False
        block, nbytes = LAYOUT[self.type_name]
        _unpack(self.raw.view(-1, nbytes), self.type_name, dst.view(-1, block))
        return True
