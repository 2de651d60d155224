"""The ``tiny-gemma3`` make-model preset: Gemma 3's text checkpoint layout, our tokenizer with
Gemma's turn markers, and Gemma 3's turn format in its chat template (rendered by transformers)."""

from __future__ import annotations

import json

import pytest

from makemodel import tokenizer_train as tt
from makemodel.families import gemma3

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(model_factory):
    return model_factory("tiny-gemma3")


def test_the_folder_is_a_gemma3_causal_lm(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    hf = transformers.AutoConfig.from_pretrained(str(folder))
    assert hf.sliding_window == 16 and hf.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [gemma3.TOKEN_IDS["<end_of_turn>"], tt.TOKEN_IDS["<|endoftext|>"]]


def test_the_template_writes_gemma3_turns(folder):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [4000, 4001]
    assert tok.eos_token == "<end_of_turn>"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|endoftext|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWeather?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(4000) == 4 and ids.count(4001) == 3  # the markers are single tokens
