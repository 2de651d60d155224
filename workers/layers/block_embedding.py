"""A GGUF token table (or untied LM head) held as the file's blocks: each lookup unpacks only the
rows it asks for.

A step reads a few rows of the token table, yet a table unpacked to the activations' dtype is
the largest tensor of a small model: Qwen3.5-0.8B's 248k x 1024 table is 1 GB in fp32 (the
``int4`` path's dtype), half of the model's resident bytes, where its Q6_K blocks are 208 MB.
llama.cpp reads the rows of its quantized table the same way (``ggml_get_rows``). The rows come
out with the values the unpacked table holds (``gguf_blocks.dequantize``: the same unpacking,
then the cast to the model's dtype), so a model answers the same either way.

The loader chooses it (``loader.load_model``'s ``embed_blocks``) on a CPU path that lays the LM
head out on its own (every path but ``dense``, whose tied head is the table itself); a tied
head's int8 rows are then made from the blocks in one native pass (``int8_rows``,
``cpu_paths.head_linear``). An untied head stored quantized is held in one too, only until that
layout (it is never looked up): its fp32 copy never exists.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.gguf_blocks import block_layout, dequantize
from workers.kernels import dequant
from workers.quant import int8_rows_of


class BlockEmbedding(nn.Module):
    """``forward(ids [N]) -> [N, dim]`` in ``dtype``, from ``blocks`` [num, dim / block, block
    bytes] uint8 (the file's bytes, filled by the loader) of GGUF block type ``type_name``."""

    blocks: torch.Tensor

    def __init__(self, num: int, dim: int, type_name: str, dtype: torch.dtype, device: torch.device):
        super().__init__()
        block, nbytes = block_layout(type_name)
        if dim % block:
            raise ValueError(f"a {type_name} table's rows are whole blocks of {block}, not {dim} values")
        self.register_buffer(
            "blocks", torch.empty(num, dim // block, nbytes, dtype=torch.uint8, device=device)
        )
        self.num_embeddings, self.embedding_dim = num, dim
        self.type_name, self.dtype = type_name, dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [N] -> [N, dim]
        op = torch.ops.pantheon.block_rows if torch.compiler.is_compiling() else _rows
        return (
            op(self.blocks, ids.reshape(-1), self.type_name)
            .to(self.dtype)
            .view(*ids.shape, self.embedding_dim)
        )

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` as the unpacked table holds them: [stop - start, dim] in ``dtype``."""
        part = self.blocks[start:stop]
        return dequantize(part.reshape(-1), self.type_name, (part.shape[0], self.embedding_dim)).to(
            self.dtype
        )

    def int8_rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``quant.int8_rows`` of the table as ``dtype`` holds it (a tied head's int8 rows), made
        from the blocks without the dense table: in one native pass where the dequantization
        kernel is built, else a run of rows at a time (``quant.int8_rows_of``)."""
        if dequant.takes(self.type_name) and dtype in (torch.float32, torch.bfloat16):
            q, scale = dequant.int8_rows_blocks(
                self.blocks, self.type_name, self.embedding_dim, bf16=dtype == torch.bfloat16
            )
            return q, scale.to(dtype)
        return int8_rows_of(
            lambda a, b: self.rows(a, b).to(dtype),
            self.num_embeddings,
            self.embedding_dim,
            dtype,
            self.device,
        )

    def table(self) -> torch.Tensor:
        """The whole table unpacked, [num, dim] in ``dtype`` (a layout that needs it dense: a
        transient copy the size the table would have had)."""
        return self.rows(0, self.num_embeddings)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} blocks -> {self.dtype}"


def _rows(blocks: torch.Tensor, ids: torch.Tensor, type_name: str) -> torch.Tensor:
    """The rows ``ids`` [N] of ``blocks`` [V, B, bytes], unpacked: [N, B * block] float32."""
    picked = blocks.index_select(0, ids)  # [N, B, bytes], contiguous
    block, _ = block_layout(type_name)
    return dequantize(picked.reshape(-1), type_name, (ids.shape[0], blocks.shape[1] * block))


@torch.library.custom_op("pantheon::block_rows", mutates_args=())
def _block_rows_custom(blocks: torch.Tensor, ids: torch.Tensor, type_name: str) -> torch.Tensor:
    return _rows(blocks, ids, type_name)


@_block_rows_custom.register_fake
def _(blocks: torch.Tensor, ids: torch.Tensor, type_name: str) -> torch.Tensor:
    block, _ = block_layout(type_name)
    return blocks.new_empty(ids.shape[0], blocks.shape[1] * block, dtype=torch.float32)
