"""Our logits against transformers' on the same random-weight folders, in fp32.

For each architecture: the logits of the last prompt position and of 16 decode steps
must equal transformers' within 1e-4; RoPE scaling types are checked the same way.
"""

from __future__ import annotations

import pytest
import torch

from pantheon.core.protocol import SamplingParams
from workers.engine import Engine

transformers = pytest.importorskip("transformers")

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88]


def engine_logits(path, prompt, n_tokens, **kw) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy-decode ``n_tokens`` with our engine; return the tokens and each step's logits row."""
    eng = Engine(str(path), dtype="float32", **kw)
    rows: list[torch.Tensor] = []
    eng.on_logits = lambda seqs, logits: rows.append(logits[0].clone())
    eng.submit("r", prompt, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True))
    tokens = []
    while eng.has_work():
        tokens += [o.token for o in eng.step()]
    return tokens, rows


def hf_generate(path, prompt: list[int], n_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy ``generate`` with its KV cache: tokens and raw logits per step."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=n_tokens, min_new_tokens=n_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), generation_config=gen, output_logits=True, return_dict_in_generate=True
        )
    return out.sequences[0, len(prompt) :].tolist(), [row[0].float() for row in out.logits]


def assert_matches(path, prompt=PROMPT, n_tokens=17, **kw):
    """Prefill's last position plus ``n_tokens - 1`` decode steps agree within 1e-4."""
    tokens, rows = engine_logits(path, prompt, n_tokens, **kw)
    ref_tokens, ref_rows = hf_generate(path, prompt, n_tokens)
    assert len(rows) == len(ref_rows) == n_tokens
    for i, (row, want) in enumerate(zip(rows, ref_rows)):
        err = (row - want).abs().max().item()
        assert err < 1e-4, f"step {i}: max |diff| {err:.2e}"
    assert tokens == ref_tokens


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny", "tiny-qwen3.5-text", "tiny-qwen3.5"])
def test_logits_match_transformers(model_factory, preset):
    """Every prefill position, then 16 decode steps, for Llama, Qwen2 (biases), Qwen3 (q/k norms),
    Qwen3.5 (Gated DeltaNet + gated attention with partial RoPE), as a text checkpoint and in the
    Hub's multimodal layout (vision tower and MTP head skipped)."""
    path = model_factory(preset, dtype="float32")
    ours = Engine(str(path), dtype="float32").prompt_logits(PROMPT)  # [T, V]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4
    assert_matches(path)


def test_llama_with_attention_bias(model_factory):
    """Llama with ``attention_bias``: biases on q, k, v and o."""
    assert_matches(model_factory("tiny-llama", dtype="float32", attention_bias=True))


def test_chunked_prefill_matches_transformers(model_factory):
    """A prompt split into 7-token chunks gives the same logits as one pass."""
    assert_matches(model_factory("tiny-llama", dtype="float32"), prefill_chunk=7, block_size=4)


@pytest.mark.parametrize("chunk", [1, 7, 64, 512])
def test_qwen35_chunked_prefill_matches_transformers(model_factory, chunk):
    """Qwen3.5's recurrent layers continue each prefill chunk from the slot's state: chunks of 1,
    7, 64 and the whole prompt (70 tokens, past the DeltaNet's own 64-token chunks) all give
    transformers' logits, and so do the 16 decode steps after."""
    prompt = [(7 * i + 3) % 4000 for i in range(70)]
    assert_matches(model_factory("tiny-qwen3.5-text", dtype="float32"), prompt=prompt, prefill_chunk=chunk)


def test_qwen35_untied_head_and_attention_bias(model_factory):
    """An untied LM head, and biases on the gated attention's projections."""
    assert_matches(
        model_factory("tiny-qwen3.5-text", dtype="float32", tie_word_embeddings=False, attention_bias=True)
    )


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaling_matches_transformers(model_factory, scaling):
    """Each rope_scaling type; max_position_embeddings is small so that scaling takes effect."""
    path = model_factory(
        "tiny-llama", dtype="float32", max_position_embeddings=32, rope_scaling=scaling, rope_theta=10000.0
    )
    # Dynamic NTK: 20 prompt tokens + 17 generated pass 32, so its base grows mid-decode (its
    # max_model_len is factor * 32). The others stay inside the 32 positions the config allows.
    assert_matches(path, prompt=PROMPT if scaling["rope_type"] == "dynamic" else PROMPT[:10])


def test_old_style_rope_config(model_factory, tmp_path):
    """``rope_scaling`` with ``type`` (the pre-5 style) reads the same as ``rope_type``."""
    path = model_factory(
        "tiny-llama",
        dtype="float32",
        max_position_embeddings=32,
        rope_scaling={"type": "linear", "factor": 2.0},
        rope_theta=10000.0,
    )
    assert_matches(path, prompt=PROMPT[:10])


def test_untied_and_missing_lm_head(model_factory, tmp_path):
    """tiny-llama has its own lm_head; tiny (Qwen3) ties it to the embeddings."""
    assert_matches(model_factory("tiny-llama", dtype="float32", tie_word_embeddings=False))
    assert_matches(model_factory("tiny", dtype="float32", tie_word_embeddings=True))


def test_bf16_close_to_transformers(model_factory):
    """bf16 weights: the same greedy tokens as transformers in bf16 for the first steps."""
    path = model_factory("tiny-llama")
    eng = Engine(str(path), dtype="bfloat16")
    eng.submit("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    ours = []
    while eng.has_work():
        ours += [o.token for o in eng.step()]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)[0, len(PROMPT) :]
    assert ours[:2] == ref.tolist()[:2]
