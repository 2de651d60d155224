"""KV cache element types: what one cached K or V row costs in bytes, by type name.

The names and block layouts are llama.cpp's (``-ctk`` / ``-ctv``), so a user moving from
llama.cpp or Ollama (``OLLAMA_KV_CACHE_TYPE``) finds the same words and the same ratios:

- ``auto``: the model's compute dtype (bf16 / fp16 / fp32), today's cache;
- ``q8_0``: blocks of 32 values, each an int8, with one fp16 scale per block (34 bytes per 32
  values: ~1.9x the tokens of bf16 in the same bytes);
- ``q4_0``: blocks of 32 values, each 4 bits (two per byte), with one fp16 scale per block
  (18 bytes per 32 values: ~3.6x);
- ``fp8_e4m3``: one byte per value, no scale (CUDA dies only: the worker refuses it elsewhere).

K and V may differ (K is the more sensitive of the two: its errors pass through the softmax's
exponential). Torch-free: the router sizes and admits with these figures, the worker lays its
tensors out to match them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_TYPES = ("auto", "q8_0", "q4_0", "fp8_e4m3")
QBLOCK = 32  # values per quantization block (q8_0, q4_0)
_BLOCK_BYTES = {"q8_0": QBLOCK + 2, "q4_0": QBLOCK // 2 + 2}  # the values, then an fp16 scale


def row_bytes(kind: str, width: int, dtype_bytes: int) -> int:
    """Bytes of ``width`` cached values (one head's K or V of one token in one layer) stored as
    ``kind``; ``dtype_bytes``: the model's compute dtype's size (what ``auto`` stores).

    A quantized type needs ``width`` to be a multiple of ``QBLOCK`` (``check_width``)."""
    if kind == "auto":
        return width * dtype_bytes
    if kind == "fp8_e4m3":
        return width
    if kind in _BLOCK_BYTES:
        return width // QBLOCK * _BLOCK_BYTES[kind]
    raise ValueError(f"unknown KV cache type {kind!r} (one of {', '.join(KV_TYPES)})")


def width_problem(kind: str, width: int) -> str | None:
    """Why a row of ``width`` values cannot be stored as ``kind``, or None when it can."""
    if kind in _BLOCK_BYTES and width % QBLOCK:
        return (
            f"{kind} stores blocks of {QBLOCK} values; a head of {width} values is not a whole number of them"
        )
    return None


@dataclass(frozen=True)
class KvCacheTypes:
    """The K and the V cache's types (``--kv-cache-dtype``, or ``-k`` / ``-v`` apart)."""

    k: str = "auto"
    v: str = "auto"

    def __post_init__(self) -> None:
        for kind in (self.k, self.v):
            if kind not in KV_TYPES:
                raise ValueError(f"unknown KV cache type {kind!r} (one of {', '.join(KV_TYPES)})")

    @property
    def quantized(self) -> bool:
        return (self.k, self.v) != ("auto", "auto")

    def token_bytes(self, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """One token's K and V in one attention layer."""
        # quantization blocks run along each head's values, never across heads
        return kv_heads * (
            row_bytes(self.k, head_dim, dtype_bytes) + row_bytes(self.v, head_dim, dtype_bytes)
        )

    def __str__(self) -> str:
        return self.k if self.k == self.v else f"{self.k}/{self.v}"
