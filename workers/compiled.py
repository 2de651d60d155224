"""Decode steps compiled with ``torch.compile`` (inductor's C++ backend on CPUs), opt-in.

At 135M parameters a decode step is mostly the overhead of ~4,800 small eager ops, not the
weights' bytes: inductor fuses the norms, rotary, residuals and softmax into a few C++ loops
and runs the whole step without Python. Measured on SmolLM2-135M (2-core AMD EPYC Zen 5, int8
path): 10.4 against 13.0 ms per step at batch 1, 19 against 33.5 at batch 8
(``bench/decode.py --compile``). The price is the compile: ~115 s cold on 2 cores, ~40 s with
inductor's on-disk cache warm, paid inside the load (the worker's loader thread), so it is
off unless ``PANTHEON_COMPILE=1`` (``--compile``).

Only pure decode steps run compiled (every sampled sequence one token, no prefill chunk): the
steady state. Steps with prefill chunks, prompt logits and other devices stay eager. Two graphs
are built at load: batch 1 (torch specialises size 1) and batch >= 2 with the batch and the
context length dynamic; a batch >= 2 always carries a padding bias (zeros when no row pads), so
no third variant appears. Any failure to compile (no C++ compiler, an op inductor cannot lower)
leaves the engine eager and says why.
"""

from __future__ import annotations

import logging
import os

import torch

from workers.cache import LayerCache
from workers.layers.attention import StepBatch
from workers.models.base import DecoderLM

log = logging.getLogger("pantheon.worker")


def wanted() -> bool:
    return os.environ.get("PANTHEON_COMPILE", "") in ("1", "true", "on", "yes")


class CompiledDecode:
    """``fn(input_ids, batch) -> fp32 logits [B, vocab]`` for pure decode batches."""

    def __init__(self, model: DecoderLM, caches: list[LayerCache]):
        self.model, self.caches = model, caches
        self.device = model.embed_tokens.weight.device
        self.error: str | None = None
        self.ready = False

        def step(ids, rot_cos, rot_sin, slots, gather, bias):
            b = StepBatch(rot_cos, rot_sin, slots, ids.shape[0], gather, bias, [])
            return model.logits(model(ids, {self.device: b}, caches))

        self._fn = torch.compile(step, dynamic=True)
        self.fallbacks = 0  # calls that would have recompiled and ran eager instead

    def warm_up(self, make_tables, free_rows: int) -> bool:
        """Compile both graphs now, on dummy rows of the (still empty) KV pool. ``make_tables``
        maps positions [B] to the step's rotary tables. True when compiled."""
        # Without duck sizing a context length that happens to equal another size (a stride,
        # the batch) is not fused with it into a guard that the next step breaks.
        from torch.fx.experimental import _config as fx_config

        fx_config.use_duck_shape = False
        try:
            with torch.inference_mode():
                for bsz, t in ((1, 19), (3, 23)):
                    pos = torch.full((bsz,), t - 1, device=self.device)
                    cos, sin = make_tables(pos)
                    # fresh tensors with standard strides, as the runner builds them
                    gather = torch.arange(bsz * t, device=self.device).view(bsz, t) % free_rows
                    slots = torch.tensor(gather[:, -1].tolist(), device=self.device)
                    self._call(
                        torch.zeros(bsz, dtype=torch.long, device=self.device),
                        StepBatch(cos, sin, slots, bsz, gather, None, []),
                    )
        except Exception as e:  # noqa: BLE001 - any compile failure means: stay eager
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            log.warning("torch.compile of the decode step failed, staying eager: %s", self.error)
            return False
        self.ready = True
        return True

    def _call(self, input_ids: torch.Tensor, b: StepBatch) -> torch.Tensor:
        assert b.decode_gather is not None  # a decode batch has its gather
        bias = b.decode_bias
        if input_ids.shape[0] > 1 and bias is None:  # one graph for every batch >= 2
            bias = torch.zeros(
                b.decode_gather.shape[0],
                1,
                1,
                b.decode_gather.shape[1],
                dtype=torch.float32,
                device=self.device,
            )
        # Standard strides: the runner's gather is a slice whose row stride changes with the
        # context (and .contiguous() keeps it when there is one row, which is "contiguous")
        g = b.decode_gather
        if g.stride(0) != g.shape[1]:
            g = g.flatten().clone().view(g.shape)
        return self._fn(input_ids, b.rot_cos, b.rot_sin, b.slot_mapping, g, bias)

    def __call__(self, input_ids: torch.Tensor, b: StepBatch) -> torch.Tensor | None:
        """The step's logits, or None when these inputs would need a new graph: compiling
        takes seconds to minutes, which a serving worker must never spend inside a step, so
        the caller runs that step eager instead."""
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._call(input_ids, b)
        except Exception as e:  # noqa: BLE001 - a recompile refused (or any compiled failure)
            self.fallbacks += 1
            if self.fallbacks in (1, 10, 100, 1000):
                log.warning(
                    "compiled decode step refused these inputs (%d so far), ran eager: %s",
                    self.fallbacks,
                    str(e).splitlines()[0][:200] if str(e) else e,
                )
            return None
