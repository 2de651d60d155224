"""Sliding-window models against transformers in fp32, with prompts longer than the window.

``tiny-gemma3`` (five sliding layers with a 16-token window, one global), Mistral on the Llama
module (an 8-token window on every layer) and Qwen2 with its window on the second layer: the logits of every prompt position and of 16 decode
steps within 1e-4 of transformers', a prompt of 40 tokens so that both the prefill's band mask
and the decode rows' cut gathers are past the window; chunked prefill (chunks smaller and larger
than the window, small blocks) equals one pass; the window really changes the answer (the same
weights without it give other logits past the window); and the Hub's multimodal layout
(``Gemma3ForConditionalGeneration``) serves the same text model.
"""

from __future__ import annotations

import pytest
import torch
from unit.test_engine_reference import assert_matches

from workers.engine import Engine

from helpers.window_reference import PROMPT, prompt_logits_match

transformers = pytest.importorskip("transformers")

MISTRAL = dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
# Gemma 3's options the preset leaves at their defaults: a scalar other than the head dim, a final
# soft cap, linear RoPE scaling on the global layers, and a period of 3 (two global layers).
GEMMA3_OPTIONS = dict(
    query_pre_attn_scalar=24,
    final_logit_softcapping=0.5,
    rope_scaling={"rope_type": "linear", "factor": 4.0},
    sliding_window_pattern=3,
)
CASES = {
    "gemma3": ("tiny-gemma3", {}),
    "gemma3-options": ("tiny-gemma3", GEMMA3_OPTIONS),
    "mistral": ("tiny-llama", MISTRAL),
    # Qwen2's window from max_window_layers on: layer 0 full (paged), layer 1 sliding (a ring)
    "qwen2-window": ("tiny-qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_past_the_window(model_factory, case):
    preset, overrides = CASES[case]
    path = model_factory(preset, dtype="float32", **overrides)
    prompt_logits_match(path)
    assert_matches(path, prompt=PROMPT)


@pytest.mark.parametrize("case", ["gemma3", "mistral"])
@pytest.mark.parametrize("chunk", [5, 23])
def test_chunked_prefill_matches_transformers(model_factory, case, chunk):
    preset, overrides = CASES[case]
    path = model_factory(preset, dtype="float32", **overrides)
    assert_matches(path, prompt=PROMPT, prefill_chunk=chunk, block_size=4)


def test_the_window_changes_the_logits_past_it(model_factory):
    """The same weights with a window longer than the prompt: equal up to the window, not after."""
    windowed = Engine(str(model_factory("tiny-gemma3", dtype="float32")), dtype="float32")
    wide = Engine(str(model_factory("tiny-gemma3", dtype="float32", sliding_window=64)), dtype="float32")
    a, b = windowed.prompt_logits(PROMPT), wide.prompt_logits(PROMPT)
    assert (a[:16] - b[:16]).abs().max().item() < 1e-5
    assert (a[16:] - b[16:]).abs().amax(dim=-1).min().item() > 1e-3


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_the_multimodal_layout_serves_its_text_model(model_factory, tmp_path, prefix):
    """A Gemma3ForConditionalGeneration folder (the text config nested, the text weights under
    transformers 5's or the Hub's original prefix, a vision tower and projector beside them) gives
    the text folder's logits; the vision weights are left out and said so."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from workers.model_config import load_config

    text = model_factory("tiny-gemma3", dtype="float32")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / f, tmp_path / f)
    cfg = json.loads((text / "config.json").read_text())
    inner = {
        k: v for k, v in cfg.items() if k not in ("architectures", "eos_token_id", "dtype", "torch_dtype")
    }
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Gemma3ForConditionalGeneration"],
                "model_type": "gemma3",
                "eos_token_id": cfg["eos_token_id"],
                "torch_dtype": "float32",
                "text_config": inner,
                "vision_config": {"hidden_size": 32, "model_type": "siglip_vision_model"},
            }
        )
    )
    weights = {
        prefix + k.removeprefix("model."): v for k, v in load_file(str(text / "model.safetensors")).items()
    }
    weights["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(32, 3, 14, 14)
    weights["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(32, 64)
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert load_config(tmp_path).skipped == ("the vision tower and its projector",)
    want = Engine(str(text), dtype="float32").prompt_logits(PROMPT)
    got = Engine(str(tmp_path), dtype="float32").prompt_logits(PROMPT)
    assert torch.equal(got, want)
