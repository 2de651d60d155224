"""The ``qwen3_5_moe`` family (Qwen3.6-35B-A3B): Qwen3.5's hybrid layers with a mixture of experts
and a shared expert in every layer, against transformers' ``Qwen3_5MoeForConditionalGeneration``
in fp32 (the Hub's layout: fused experts, vision tower and MTP head skipped), with chunked
prefill, and its sizing (per-expert names: tests/unit/test_qwen3_moe.py)."""

from __future__ import annotations

import pytest
import torch
from test_engine_reference import PROMPT, assert_matches

from makemodel import build_config
from pantheon.core.description import read_description
from pantheon.core.sizing import estimate, shape_from_config
from workers.engine import Engine

transformers = pytest.importorskip("transformers")


def test_logits_match_transformers(model_factory):
    """tiny-qwen3.5-moe: 3 DeltaNet layers and 1 gated attention layer, each with 8 experts (top 2)
    and a shared expert: every prompt position, then 16 decode steps."""
    path = model_factory("tiny-qwen3.5-moe", dtype="float32")
    desc = read_description(path)
    assert all(s.experts is not None for s in desc.layers)
    assert "the vision tower (model.visual.*)" in desc.skipped
    ours = Engine(str(path), dtype="float32").prompt_logits(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4
    assert_matches(path)


@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_matches_transformers(model_factory, chunk):
    prompt = [(7 * i + 3) % 4000 for i in range(70)]
    assert_matches(model_factory("tiny-qwen3.5-moe", dtype="float32"), prompt=prompt, prefill_chunk=chunk)


def test_sizing_counts_every_expert_and_the_shared_one():
    desc = shape_from_config(build_config("qwen3.6-35b-a3b-text"), "qwen3.6-35b-a3b")
    # Qwen3.6-35B-A3B: 35B parameters in all (text model), about 3B read per token
    assert 34e9 < desc.total_params < 36e9
    assert 2.5e9 < desc.active_params < 4e9
    e = desc.layers[0].experts
    assert e is not None and (e.count, e.top_k, e.intermediate) == (256, 8, 512)
    est = estimate(desc, cpu_path="bf16")
    assert est.weights == 2 * desc.total_params and est.active_params == desc.active_params
