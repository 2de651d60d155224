"""Our engine against transformers in fp32 on a prompt longer than a sliding window: the shared
part of the sliding-window reference tests (tests/unit/test_sliding_reference.py, test_gemma4.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.engine import Engine

# 40 tokens: past a 16-token window, so that both the prefill's band mask and the decode rows'
# cut gathers are past it
PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88] * 2


def hf_logits(path: Path | str, prompt: list[int] = PROMPT) -> torch.Tensor:
    """transformers' logits of every position of ``prompt``, in fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def prompt_logits_match(path: Path | str, prompt: list[int] = PROMPT, tol: float = 1e-4) -> torch.Tensor:
    """Assert our fp32 logits of every position of ``prompt`` are within ``tol`` of
    transformers'; return transformers'."""
    ours = Engine(str(path), dtype="float32").prompt_logits(prompt)  # [T, V]
    ref = hf_logits(path, prompt)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < tol
    return ref
