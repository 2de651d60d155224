"""The model runner: turns a ``StepPlan`` into tensors, runs the model, returns logits.

It owns the KV cache tensors (one K and one V tensor per layer, on that layer's device,
shaped [num_blocks * block_size, KV heads, head_dim]) and knows nothing of requests beyond
their tokens, positions and block tables.
"""

from __future__ import annotations

import torch

from workers.block_manager import BlockManager
from workers.model import AttnBatch, CausalLM, PrefillChunk
from workers.model_config import ModelConfig
from workers.rope import Rotary, qk_tables
from workers.scheduler import StepPlan


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers (K and V)."""
    return block_size * cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, blocks: BlockManager, dtype: torch.dtype):
        self.model, self.cfg, self.blocks, self.dtype = model, cfg, blocks, dtype
        self.devices = list(dict.fromkeys(model.layer_devices))
        self.main = model.embed_tokens.weight.device
        rows = blocks.num_blocks * blocks.block_size
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(rows, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev),
                torch.zeros(rows, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev),
            )
            for dev in model.layer_devices
        ]
        self.rotary = Rotary(cfg, self.main)
        self.compiled = None  # a workers.compiled.CompiledDecode for pure decode steps, opt-in

    def compile_decode(self) -> str | None:
        """Compile the pure decode step (see workers/compiled.py); None when it worked, else
        why not (the runner stays eager)."""
        from workers.compiled import CompiledDecode

        if len(self.devices) > 1:
            return "layers split across devices"
        c = CompiledDecode(self.model, self.kv)

        def tables(pos):
            cos, sin = self.rotary.cos_sin(pos)
            return qk_tables(cos, sin, self.cfg.num_heads, self.cfg.num_kv_heads, self.dtype)

        if c.warm_up(tables, self.blocks.num_blocks * self.blocks.block_size):
            self.compiled = c
        return c.error

    @property
    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv)

    def _rows(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.blocks.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _gather(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """Cache rows of positions 0..length-1 for each table: [B, length] int64.

        Built from the block tables with tensor ops (B * blocks Python ints, not B * length):
        this runs every step for every decoding sequence. Positions past a table's end point
        into block 0 and must be masked by the caller.
        """
        bs = self.blocks.block_size
        nb = -(-length // bs)
        tab = torch.tensor([t[:nb] + [0] * (nb - len(t[:nb])) for t in tables], dtype=torch.long)
        rows = tab[:, :, None] * bs + torch.arange(bs)  # [B, nb, bs]
        return rows.view(len(tables), nb * bs)[:, :length].to(self.main)

    @torch.inference_mode()
    def run(self, plan: StepPlan, all_rows: bool = False) -> torch.Tensor:
        """Compute the plan's tokens; return fp32 logits [len(plan.sampled()), vocab].

        ``all_rows``: logits of every computed token instead (prompt logits), [N, vocab].
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # Decode rows: the newest token of each decoding sequence.
        for s in plan.decode:
            p = s.num_computed
            ids.append(s.tokens[p])
            positions.append(p)
            slots.append(self._rows(s.block_table, p, p + 1)[0])
        n_decode = len(ids)
        chunks: list[tuple[int, int, int, int, list[int]]] = []  # start, end, first pos, last pos, table
        for s, n in plan.prefill:
            p0 = s.num_computed
            start = len(ids)
            ids += s.tokens[p0 : p0 + n]
            positions += range(p0, p0 + n)
            slots += self._rows(s.block_table, p0, p0 + n)
            chunks.append((start, len(ids), p0, p0 + n, s.block_table))

        dev = self.main
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        cos, sin = self._cos_sin(pos_t, plan, n_decode, chunks)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)

        dec_gather = dec_bias = None
        if n_decode:
            lens = [s.num_computed + 1 for s in plan.decode]
            t = max(lens)
            dec_gather = self._gather([s.block_table for s in plan.decode], t)  # [B, T]
            if min(lens) < t:  # some rows are padded: mask their tail
                pad = torch.arange(t, device=dev)[None, :] >= torch.tensor(lens, device=dev)[:, None]
                dec_bias = torch.zeros(pad.shape, dtype=torch.float32, device=dev)
                dec_bias = dec_bias.masked_fill_(pad, float("-inf"))[:, None, None, :]  # [B, 1, 1, T]
        pre = []
        for start, end, p0, p1, table in chunks:
            gather = self._gather([table], p1)[0]  # [T]
            mask = None
            if p0:
                # Query row i sits at position p0 + i and sees keys 0..p0 + i.
                q_pos = torch.arange(p0, p1, device=dev)[:, None]
                mask = (torch.arange(p1, device=dev)[None, :] <= q_pos)[None, None]  # [1, 1, C, T]
            pre.append(PrefillChunk(start, end, gather, mask))

        base = AttnBatch(cos, sin, slot_t, n_decode, dec_gather, dec_bias, pre)
        if self.compiled is not None and not pre and not all_rows:
            logits = self.compiled(input_ids, base)  # every row is a sampled decode row
            if logits is not None:
                return logits
        batches = {d: base if d == dev else _to(base, d) for d in self.devices}
        hidden = self.model(input_ids, batches, self.kv)  # [N, hidden]

        if all_rows:
            return self.model.logits(hidden)
        # Only the last row of each sampled sequence needs logits.
        rows = list(range(n_decode))
        for (_start, end, _p0, p1, _t), (s, _n) in zip(chunks, plan.prefill):
            if p1 == len(s.tokens):
                rows.append(end - 1)
        return self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])

    def _cos_sin(self, pos_t, plan: StepPlan, n_decode: int, chunks):
        """The step's rotary tables for q and k: [N, H + KV, D] each (see ``rope.qk_tables``)."""
        if not self.rotary.dynamic:
            cos, sin = self.rotary.cos_sin(pos_t)
        else:
            # Dynamic NTK: the frequencies depend on each sequence's length, so go per sequence.
            parts = [self.rotary.cos_sin(pos_t[i : i + 1], int(pos_t[i]) + 1) for i in range(n_decode)]
            parts += [self.rotary.cos_sin(pos_t[a:b], p1) for a, b, _p0, p1, _t in chunks]
            cos, sin = torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
        return qk_tables(cos, sin, self.cfg.num_heads, self.cfg.num_kv_heads, self.dtype)


def _to(b: AttnBatch, dev: torch.device) -> AttnBatch:
    """The same batch description on another device (layers split across dies)."""

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev, non_blocking=True)

    def mv(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else to(t)

    return AttnBatch(
        to(b.rot_cos),
        to(b.rot_sin),
        to(b.slot_mapping),
        b.n_decode,
        mv(b.decode_gather),
        mv(b.decode_bias),
        [PrefillChunk(c.start, c.end, to(c.gather), mv(c.mask)) for c in b.prefills],
    )
