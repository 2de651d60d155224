"""Gemma 4's text model against transformers in fp32, past the sliding window.

``tiny-gemma4`` switches every text feature on at once (global layers with their own head dim,
K as V, proportional RoPE, per-layer embeddings, the last two layers sharing the KV of layers 3
and 2 with a double-wide MLP); the cases below also take the 31B's shape (no sharing, no per-layer
embeddings), the E-series' (own V projections), and the 26B-A4B's routed experts. For each: the
logits of every position of a 40-token prompt (past the 16-token window) and of 16 greedy decode
steps within 1e-4 of transformers'; chunked prefill equals transformers; eight prompts batched
equal each alone; the KV-shared layers allocate and book nothing (description, sizing and the
worker's pools agree); transformers 5.25's own config spelling (``per_layer_config``) and the
multimodal layout (``Gemma4ForConditionalGeneration``) give the same model.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from unit.test_engine_reference import assert_matches

from makemodel import tokenizer_train as tt
from makemodel.families import gemma4
from pantheon.core.description import AttentionCache, SharedKV, read_description
from pantheon.core.protocol import SamplingParams
from pantheon.core.sizing import estimate
from workers import cpu_paths
from workers.cache import KVCache, SharedCache, StateCache
from workers.engine import Engine

from helpers.window_reference import PROMPT, prompt_logits_match

transformers = pytest.importorskip("transformers")

CASES = {
    "all": ("tiny-gemma4", {}),
    # Gemma 4 31B's kind: K as V on the global layers, no KV sharing, no per-layer embeddings
    "31b": (
        "tiny-gemma4",
        dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, use_double_wide_mlp=False),
    ),
    # the E-series' kind: own V projections everywhere (the global KV heads are then the config's)
    "e-series": ("tiny-gemma4", dict(attention_k_eq_v=False, num_global_key_value_heads=None)),
    "moe": ("tiny-gemma4-moe", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_past_the_window(model_factory, case):
    preset, overrides = CASES[case]
    path = model_factory(preset, dtype="float32", **overrides)
    ref = prompt_logits_match(path)
    assert ref[:, : tt.VOCAB_SIZE].std().item() > 1e-2  # logits that tell tokens apart
    assert_matches(path, prompt=PROMPT)


@pytest.mark.parametrize("case", ["all", "moe"])
@pytest.mark.parametrize("chunk", [5, 23])
def test_chunked_prefill_matches_transformers(model_factory, case, chunk):
    """Chunks shorter and longer than the window, 4-token blocks: a sliding owner's ring gets a
    chunk's K/V only after its readers (layer 4) attended to the history it overwrites."""
    preset, overrides = CASES[case]
    assert_matches(
        model_factory(preset, dtype="float32", **overrides), prompt=PROMPT, prefill_chunk=chunk, block_size=4
    )


PROMPTS = [
    [5, 17, 300, 41],
    [900, 2, 2, 2, 2, 8, 31, 77, 12, 1000, 44],
    list(range(100, 160)),
    [3, 1, 4, 1, 5, 9, 2, 6],
    list(range(1500, 1530)),
]


def _run(eng: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        eng.submit(rid, p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            out.setdefault(o.request_id, []).append(o.token)
    return out


def test_batched_and_chunked_equal_alone(model_factory):
    path = str(model_factory("tiny-gemma4", dtype="float32"))
    eng = Engine(path, dtype="float32", kv_budget_bytes=4 << 20)
    alone = {}
    for i, p in enumerate(PROMPTS):
        alone.update(_run(eng, {f"p{i}": p}))
    assert _run(eng, {f"p{i}": p for i, p in enumerate(PROMPTS)}) == alone
    chunked = Engine(path, dtype="float32", prefill_chunk=5, block_size=4, kv_budget_bytes=4 << 20)
    assert _run(chunked, {f"p{i}": p for i, p in enumerate(PROMPTS)}) == alone
    assert len({tuple(v) for v in alone.values()}) > 1


def test_shared_kv_layers_allocate_and_book_nothing(model_factory):
    path = model_factory("tiny-gemma4", dtype="float32")
    desc = read_description(path)
    assert [s.cache for s in desc.layers[4:]] == [SharedKV(3), SharedKV(2)]
    assert desc.layers[2].cache == AttentionCache(1, 32, None)  # the global layer: its own shape
    est = estimate(desc, dtype="float32", cpu_path="fp32")
    assert est.kv_layer_bytes == (0, 0, 2 * 1 * 32 * 4, 0, 0, 0)  # only the global owner is paged
    assert est.state_layer_bytes == (16 * 2 * 2 * 16 * 4,) * 2 + (0,) + (16 * 2 * 2 * 16 * 4,) + (0, 0)
    eng = Engine(str(path), dtype="float32", kv_budget_bytes=1 << 20)
    caches = eng.runner.caches
    assert isinstance(caches[4], SharedCache) and caches[4].source is caches[3]
    assert isinstance(caches[5], SharedCache) and caches[5].source is caches[2]
    assert isinstance(caches[2], KVCache) and isinstance(caches[3], StateCache)
    rows = eng.blocks.num_blocks * eng.blocks.block_size
    assert eng.runner.kv_bytes == rows * est.kv_per_token  # the worker's pool is what sizing says
    ring = caches[0]
    assert isinstance(ring, StateCache)
    states = ring.tensors["k"].shape[0] + ring.checkpoints["k"].shape[0]  # slots, scratch, checkpoints
    assert eng.runner.state_bytes == states * est.state_per_slot
    # without sharing the last two layers would each keep their own cache
    unshared = estimate(
        read_description(model_factory("tiny-gemma4", dtype="float32", num_kv_shared_layers=0)),
        dtype="float32",
        cpu_path="fp32",
    )
    assert unshared.kv_per_token == 2 * est.kv_per_token
    assert unshared.state_per_slot == 4 * est.state_per_slot // 3


def test_transformers_config_spelling_and_multimodal_layout(model_factory, tmp_path):
    """transformers 5.25's saved config (``per_layer_config`` instead of ``global_head_dim``) and a
    Gemma4ForConditionalGeneration folder (text under ``model.language_model.``) serve the same
    model as the preset's folder."""
    from safetensors.torch import load_file, save_file

    text = model_factory("tiny-gemma4", dtype="float32")
    want = Engine(str(text), dtype="float32").prompt_logits(PROMPT)
    cfg = json.loads((text / "config.json").read_text())
    hf = transformers.AutoConfig.from_pretrained(str(text)).to_dict()
    assert "per_layer_config" in hf and "global_head_dim" not in hf
    inner = {k: v for k, v in hf.items() if k not in ("architectures", "dtype", "torch_dtype")}
    mm = tmp_path / "mm"
    mm.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / f, mm / f)
    (mm / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Gemma4ForConditionalGeneration"],
                "model_type": "gemma4",
                "eos_token_id": cfg["eos_token_id"],
                "torch_dtype": "float32",
                "text_config": inner,
                "vision_config": None,
                "audio_config": None,
            }
        )
    )
    weights = {
        "model.language_model." + k.removeprefix("model."): v
        for k, v in load_file(str(text / "model.safetensors")).items()
    }
    weights["model.vision_tower.patch_embedder.input_proj.weight"] = torch.zeros(8, 8)
    save_file(weights, str(mm / "model.safetensors"))
    import dataclasses

    assert dataclasses.replace(read_description(mm), skipped=()) == read_description(text)
    assert read_description(mm).skipped == ("the vision and audio towers and their embedders",)
    got = Engine(str(mm), dtype="float32").prompt_logits(PROMPT)
    assert (got - want).abs().max().item() < 1e-5  # (the CPU path is chosen by timing: packed or not)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(str(mm), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ref(input_ids=torch.tensor([PROMPT])).logits[0] - got).abs().max().item() < 1e-4


def test_the_template_writes_gemma4_turns(model_factory):
    folder = model_factory("tiny-gemma4")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.convert_tokens_to_ids(gemma4.MARKERS) == [4000, 4001, 4002, 4003, 4004]
    assert tok.eos_token == "<turn|>"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == gemma4.TOKEN_IDS["<turn|>"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|endoftext|><|turn>system\nBe brief.<turn|>\n"
        "<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello.<turn|>\n"
        "<|turn>user\nWeather?<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>"
    )
    thinking = tok.apply_chat_template(
        messages[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert (
        thinking == "<|endoftext|><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(4000) == 5 and ids.count(4001) == 4  # the markers are single tokens


@pytest.mark.parametrize("preset", ["tiny-gemma4", "tiny-gemma4-moe"])
def test_sizing_counts_every_parameter(model_factory, preset):
    """The description counts exactly the checkpoint's parameters (per-layer embeddings, KV-shared
    layers without K/V projections, double-wide MLPs, every expert), and the worker holds what
    sizing says on the fp32 path."""
    from safetensors import safe_open

    path = model_factory(preset, dtype="float32")
    desc = read_description(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        numel = sum(_n(f.get_slice(k).get_shape()) for k in f.keys())
    assert desc.total_params == numel
    ex = desc.moe_experts
    unread = 0 if ex is None else desc.num_layers * (ex.count - ex.top_k) * ex.per_expert
    assert desc.active_params == numel - unread
    est = estimate(desc, dtype="float32", cpu_path="fp32")
    eng = Engine(str(path), dtype="float32", kv_budget_bytes=1 << 20, cpu_path="fp32")
    assert eng.weight_bytes == est.weights == 4 * numel


def _n(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


@pytest.fixture(scope="module")
def moe_bf16_reference(model_factory):
    """tiny-gemma4-moe's fp32 logits, and how far transformers' own bf16 run is from them (far:
    a tiny random model whose every layer output is normed to full scale, and whose routing
    flips under rounding)."""
    path = model_factory("tiny-gemma4-moe", dtype="float32")
    prompt = PROMPT[:24]

    def hf(dt: torch.dtype) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).eval()
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].float()

    ref = hf(torch.float32)
    return path, prompt, ref, float((hf(torch.bfloat16) - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", [n for n in cpu_paths.PATHS if cpu_paths.probe(n) is None])
def test_every_working_cpu_path_stays_near_fp32(moe_bf16_reference, name):
    """The paths lay out the fused attention (q only, q+k, q+k+v), the per-layer-embedding
    projections, the router and the experts: fp32 ones give transformers' fp32 logits, bf16 ones
    stay as near them as transformers' own bf16 run, the lossy ones within a few times that."""
    path, prompt, ref, hf_bf16 = moe_bf16_reference
    lossy = cpu_paths.PATHS[name].lossy
    got = Engine(str(path), kv_budget_bytes=1 << 20, cpu_path=name, quantize=lossy).prompt_logits(prompt)
    err = float((got - ref).abs().max() / ref.abs().max())
    if cpu_paths.PATHS[name].dtype == torch.float32 and not lossy:
        assert err < 1e-4
    else:
        # int4's 16 levels a group of 32 cost this model's random weights the most (about 3x)
        assert err < {"int8": 2.0, "int4": 3.0}.get(name, 1.25) * hf_bf16, (err, hf_bf16)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # transformers' defaults: per-layer embeddings (P = 256 over 262,144 ids), no sharing
        dict(num_kv_shared_layers=12, use_double_wide_mlp=True, hidden_size_per_layer_input=0),
        dict(
            attention_k_eq_v=True,
            num_global_key_value_heads=2,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=128,
            top_k_experts=8,
            moe_intermediate_size=704,
        ),
    ],
)
def test_real_sized_configs_count_what_transformers_builds(overrides):
    """Full-size configs (built on the meta device: nothing allocated): the description's
    parameters are the checkpoint tensors transformers' Gemma4ForConditionalGeneration has for
    its language model, through the Hub's multimodal config with only what differs from the
    defaults written (as Google's configs are)."""
    from pantheon.core.description import describe

    text = transformers.Gemma4TextConfig(**overrides)
    cfg = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=None, audio_config=None)
    with torch.device("meta"):
        model = transformers.Gemma4ForConditionalGeneration(cfg)
    state = model.state_dict()
    want = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")  # tied
    hub = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": overrides,
    }
    desc = describe(hub, {}, "config.json")
    assert desc.total_params == want
    shared = overrides.get("num_kv_shared_layers", 0)
    assert sum(isinstance(s.cache, SharedKV) for s in desc.layers) == shared
    assert desc.layers[5].cache == AttentionCache(overrides.get("num_global_key_value_heads") or 4, 512, None)
