"""``pantheon make-model``: presets write folders that transformers loads as-is."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import makemodel
from makemodel import tokenizer_train as tt
from makemodel.cli import cli
from makemodel.families import qwen3_5
from makemodel.writer import numel

from helpers.paths import REPO_ROOT

TINY = ["tiny", "tiny-llama", "tiny-qwen2"]
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Ça va? Größe, señor, Zażółć gęślą jaźń.",
    "Καλημέρα κόσμε. Доброе утро!",
    "中文。今天天气很好。日本語のテキスト。한국어",
    "Emoji 🎉🦜 👨‍👩‍👧‍👦 and symbols ∑ ≤ ½ €",
    'def f(x):\n    return {"a": [1, 2.5, null]}  # 12345\n\n\ttab',
]


def _files_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.fixture(scope="module")
def raw_tokenizer(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def _load(hf, folder: Path):
    model, info = hf.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    return model.eval()


def _logits(model, ids=(3992, 100, 200, 300, 3993, 198)):
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits.float()


# ------------------------------------------------------------------------------------- import


def test_import_does_not_pull_in_torch():
    code = "import sys, makemodel; print(sorted({'torch', 'tokenizers', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_loads_and_runs(hf, model_factory, preset):
    import torch

    folder = model_factory(preset)
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    model = _load(hf, folder)
    config = makemodel.PRESETS[preset]
    assert type(model).__name__ == config["architectures"][0]
    assert model.dtype == torch.bfloat16
    logits = _logits(model)
    assert logits.shape == (1, 6, config["vocab_size"])
    assert torch.isfinite(logits).all()
    # Not degenerate: real spread across the vocabulary, different rows per position.
    real = logits[0, :, : tt.VOCAB_SIZE]
    assert real.std() > 0.05
    assert not torch.allclose(real[0], real[1])
    # Padding rows past the tokenizer are zero, so their logits are exactly 0.
    assert (logits[0, :, tt.VOCAB_SIZE :] == 0).all()


@pytest.mark.parametrize("preset", TINY)
def test_tensor_names_and_norm_jitter(model_factory, preset):
    from safetensors import safe_open

    with safe_open(model_factory(preset) / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        norm = f.get_tensor("model.layers.0.input_layernorm.weight").float()
    assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys
    assert ("lm_head.weight" in keys) == (preset == "tiny-llama")
    assert ("model.layers.1.self_attn.q_norm.weight" in keys) == (preset == "tiny")
    assert ("model.layers.1.self_attn.k_proj.bias" in keys) == (preset == "tiny-qwen2")
    assert "model.layers.1.self_attn.o_proj.bias" not in keys
    # Norm weights are 1 + 0.1 * N(0, 1) on the tiny presets.
    assert 0.9 < norm.mean() < 1.1 and 0.03 < norm.std() < 0.3


def test_large_preset_norms_are_ones(tmp_path):
    from safetensors import safe_open

    # The qwen3-0.6b preset shrunk through overrides: norms are plain ones there.
    out = makemodel.make_model(
        "qwen3-0.6b",
        tmp_path,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        head_dim=8,
        vocab_size=4096,
    )
    with safe_open(out / "model.safetensors", "pt") as f:
        assert (f.get_tensor("model.layers.0.self_attn.q_norm.weight") == 1).all()
        assert (f.get_tensor("model.norm.weight") == 1).all()
        assert f.get_tensor("model.embed_tokens.weight").shape == (4096, 32)


def test_same_seed_same_bytes(tmp_path, tiny_model):
    again = makemodel.make_model("tiny", tmp_path / "again")
    assert _files_digest(again) == _files_digest(tiny_model)
    other = makemodel.make_model("tiny", tmp_path / "other", seed=1)
    digests = _files_digest(other)
    assert digests["model.safetensors"] != _files_digest(tiny_model)["model.safetensors"]
    assert digests["tokenizer.json"] == _files_digest(tiny_model)["tokenizer.json"]


def test_same_bytes_in_a_fresh_process(tmp_path, tiny_model):
    # A new process retrains the tokenizer and redraws the weights, with one thread.
    code = f"from makemodel import make_model; make_model('tiny', {str(tmp_path)!r})"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)
    assert _files_digest(tmp_path) == _files_digest(tiny_model)


def test_config_overrides(hf, model_factory):
    folder = model_factory("tiny", num_hidden_layers=3, tie_word_embeddings=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["tie_word_embeddings"] is False
    model = _load(hf, folder)
    assert len(model.model.layers) == 3
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    # The preset itself is unchanged.
    assert makemodel.PRESETS["tiny"]["num_hidden_layers"] == 2


@pytest.mark.parametrize(
    "preset,rope_scaling",
    [
        ("tiny", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
        ("tiny", {"rope_type": "linear", "factor": 2.0}),
        (
            "tiny-llama",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        ),
    ],
)
def test_rope_scaling_override_loads(hf, model_factory, preset, rope_scaling):
    import torch

    folder = model_factory(preset, rope_scaling=rope_scaling)
    assert json.loads((folder / "config.json").read_text())["rope_scaling"] == rope_scaling
    model = _load(hf, folder)
    rope = model.config.rope_parameters
    assert rope["rope_type"] == rope_scaling["rope_type"] and rope["factor"] == rope_scaling["factor"]
    assert torch.isfinite(_logits(model)).all()


def test_dtype_float32(hf, model_factory):
    import torch
    from safetensors import safe_open

    folder = model_factory("tiny-qwen2", dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert _load(hf, folder).dtype == torch.float32


def test_sharded_folder_loads(hf, model_factory):
    import torch

    folder = model_factory("tiny-llama", shard_bytes=200_000)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (folder / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all(p.stat().st_size < 200_000 + 400_000 for p in shards)  # one big tensor may exceed
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    specs = makemodel.tensor_specs(makemodel.PRESETS["tiny-llama"])
    assert set(index["weight_map"]) == {name for name, _, _ in specs}
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert index["metadata"]["total_size"] == sum(2 * numel(s) for _, s, _ in specs)
    # Same seed: the sharded model computes exactly what the single-file one does.
    assert torch.equal(_logits(_load(hf, folder)), _logits(_load(hf, model_factory("tiny-llama"))))


def test_generation_config(hf, tiny_model):
    gen = hf.GenerationConfig.from_pretrained(tiny_model, local_files_only=True)
    ids = tt.TOKEN_IDS
    assert gen.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen.bos_token_id == gen.pad_token_id == ids["<|endoftext|>"]
    assert gen.do_sample is True


def test_qwen3_06b_config_shapes():
    c = makemodel.PRESETS["qwen3-0.6b"]
    assert c["architectures"] == ["Qwen3ForCausalLM"] and c["model_type"] == "qwen3"
    assert (
        c["hidden_size"],
        c["num_hidden_layers"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        c["intermediate_size"],
        c["vocab_size"],
    ) == (1024, 28, 16, 8, 128, 3072, 151936)
    assert c["tie_word_embeddings"] is True and c["rope_theta"] == 1000000
    assert c["rms_norm_eps"] == 1e-6 and c["max_position_embeddings"] == 40960
    assert c["torch_dtype"] == "bfloat16" and c["hidden_act"] == "silu"
    specs = makemodel.tensor_specs(c)
    assert sum(numel(shape) for _, shape, _ in specs) == 596_049_920  # Qwen3-0.6B's count


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        makemodel.make_model("nope", tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        makemodel.make_model("tiny", tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="vocab_size"):
        makemodel.make_model("tiny", tmp_path, vocab_size=1000)
    with pytest.raises(ValueError, match="vocab_size 4004 < tokenizer size 4007"):  # Harmony's markers
        makemodel.build_config("tiny-gpt-oss", vocab_size=4004)
    with pytest.raises(ValueError, match="model_type 'nope'"):
        makemodel.build_config("tiny", model_type="nope")
    with pytest.raises(ValueError, match="mxfp4"):
        makemodel.make_model("tiny", tmp_path / "no-mxfp4", mxfp4=True)
    with pytest.raises(ValueError, match="gemma_tokenizer"):
        makemodel.make_model("tiny", tmp_path / "no-gemma", gemma_tokenizer=True)
    assert not (tmp_path / "no-mxfp4").exists() and not (tmp_path / "no-gemma").exists()


def test_the_families_mirror_the_engines_and_own_their_presets():
    """One make-model family per architecture family the engine serves (same names as
    pantheon/core/archs), and each preset's config is written by the family that lists it."""
    from pantheon.core.archs import FAMILIES as ENGINE_FAMILIES

    assert sorted(f.name for f in makemodel.FAMILIES) == sorted(f.name for f in ENGINE_FAMILIES)
    for family in makemodel.FAMILIES:
        for name, config in family.presets.items():
            assert makemodel.family_of(config) is family, name
        assert family.jittered <= family.presets.keys() and family.pooling.keys() <= family.presets.keys()
    assert len(makemodel.PRESETS) == sum(len(f.presets) for f in makemodel.FAMILIES)


# ---------------------------------------------------------------------------------- tokenizer


def test_tokenizer_sizes(raw_tokenizer):
    assert raw_tokenizer.get_vocab_size() == tt.VOCAB_SIZE == 4000
    for preset in TINY:
        assert makemodel.PRESETS[preset]["vocab_size"] == -(-tt.VOCAB_SIZE // 64) * 64 == 4032


def test_training_is_deterministic():
    # Two uncached trainings (each with fresh Rust hash seeds) give the same tokenizer.json.
    assert tt.train_tokenizer().to_str() == tt.train_tokenizer().to_str()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_hf_parity(hf, tiny_model, raw_tokenizer, text):
    tok = hf.AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    ids = raw_tokenizer.encode(text).ids
    assert raw_tokenizer.decode(ids) == text
    assert tok(text).input_ids == ids  # no BOS is added; same pipeline as tokenizer.json
    assert tok.decode(ids) == text


def test_multibyte_characters_split_across_tokens(raw_tokenizer):
    # Detokenizer tests rely on this: these characters take several tokens, and a token on its
    # own is an incomplete UTF-8 sequence.
    vocab = {i: s for s, i in raw_tokenizer.get_vocab().items()}
    from tokenizers.decoders import ByteLevel

    for char in ["🦜", "文"]:
        ids = raw_tokenizer.encode(char).ids
        assert len(ids) > 1, (char, ids)
        first = ByteLevel().decode([vocab[ids[0]]])
        assert "\ufffd" in first or first != char[: len(first)], (char, first)


def test_special_tokens_are_single_ids(hf, tiny_model, raw_tokenizer):
    text = "".join(f"a{t}b" for t, _ in tt.ADDED_TOKENS)
    ids = raw_tokenizer.encode(text).ids
    for token, _ in tt.ADDED_TOKENS:
        assert raw_tokenizer.encode(token).ids == [tt.TOKEN_IDS[token]]
        assert tt.TOKEN_IDS[token] in ids
    tok = hf.AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tt.TOKEN_IDS["<|im_end|>"]
    # As in Qwen3: ChatML markers are special (skipped), think/tool tags are not.
    decoded = tok.decode(
        raw_tokenizer.encode("<|im_start|>hi<think>x</think><|im_end|>").ids, skip_special_tokens=True
    )
    assert decoded == "hi<think>x</think>"


def test_tokenizer_config_fields(tiny_model):
    cfg = json.loads((tiny_model / "tokenizer_config.json").read_text())
    for key in ("chat_template", "bos_token", "eos_token", "pad_token", "model_max_length"):
        assert cfg[key], key
    assert cfg["model_max_length"] == 4096
    decoder = cfg["added_tokens_decoder"]
    assert {v["content"]: v["special"] for v in decoder.values()} == dict(tt.ADDED_TOKENS)
    assert {int(k): v["content"] for k, v in decoder.items()} == {i: t for t, i in tt.TOKEN_IDS.items()}


# ------------------------------------------------------------------------------ chat template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Use the tool.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Bern"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "12 °C"},
    {"role": "tool", "tool_call_id": "c2", "content": "10 °C"},
]


def test_chat_template_plain(hf, tiny_model):
    tok = hf.AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "old thoughts are dropped"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == text + "<think>\n\n</think>\n\n"
    # Content given as a list of text parts.
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"
    # Tokenized: the markers are single ids (transformers 5 returns a BatchEncoding here).
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tt.TOKEN_IDS["<|im_start|>"] and ids.count(tt.TOKEN_IDS["<|im_end|>"]) == 3


def test_chat_template_tools(hf, tiny_model):
    tok = hf.AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert (
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n12 °C\n</tool_response>\n<tool_response>\n"
        "10 °C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_renders_with_plain_jinja(hf, tiny_model):
    # The router renders with jinja2 directly; with an HF-style tojson it must match transformers.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    ours = env.from_string(tt.CHAT_TEMPLATE).render(
        messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True
    )
    tok = hf.AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assert ours == tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


# ------------------------------------------------------------------------------------ Qwen3.5

QWEN35_TINY = ["tiny-qwen3.5", "tiny-qwen3.5-text"]
QWEN35_SPECIAL = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"]
QWEN35_IDS = (3992, 100, 200, 300, 3998, 3999, 3993, 198, 4000, 4003, 4001)  # text, tags, vision


def _pick(d: dict, *keys: str) -> tuple:
    return tuple(d[k] for k in keys)


def _load_qwen35_vlm(hf, folder: Path, **kwargs):
    model, info = hf.Qwen3_5ForConditionalGeneration.from_pretrained(
        folder, local_files_only=True, output_loading_info=True, **kwargs
    )
    # transformers skips the checkpoint's mtp.* tensors (_keys_to_ignore_on_load_unexpected).
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")], info
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _meta_model(hf, config: dict, folder: Path):
    """The transformers model for ``config`` (loaded from a config.json) on the meta device."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    loaded = hf.AutoConfig.from_pretrained(folder, local_files_only=True)
    cls = getattr(hf, config["architectures"][0])
    with torch.device("meta"):
        return cls(loaded)


def test_qwen35_tiny_config_layout():
    c = makemodel.build_config("tiny-qwen3.5")
    assert c["architectures"] == ["Qwen3_5ForConditionalGeneration"] and c["model_type"] == "qwen3_5"
    t, v = c["text_config"], c["vision_config"]
    assert t["model_type"] == "qwen3_5_text" and v["model_type"] == "qwen3_5_vision"
    assert t["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert _pick(t, "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim") == (64, 4, 2, 16)
    assert _pick(t, "linear_num_key_heads", "linear_num_value_heads") == (2, 4)
    assert _pick(t, "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim") == (16, 16, 4)
    assert t["intermediate_size"] == 128 and t["vocab_size"] == 4032
    assert t["rope_parameters"] == {
        "mrope_interleaved": True,
        "mrope_section": [1, 1, 0],  # rotary dim 16 * 0.25 = 4: two frequencies
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    }
    assert c["tie_word_embeddings"] is t["tie_word_embeddings"] is True
    assert v["out_hidden_size"] == t["hidden_size"]
    ids = qwen3_5.TOKEN_IDS
    assert _pick(c, "vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id") == (
        _pick(ids, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    )
    assert c["dtype"] == c["torch_dtype"] == t["dtype"] == "bfloat16"
    # The text-only preset is the same text model, flat.
    flat = makemodel.build_config("tiny-qwen3.5-text")
    assert flat["architectures"] == ["Qwen3_5ForCausalLM"]
    assert {k: flat[k] for k in t if k != "dtype"} == {k: v for k, v in t.items() if k != "dtype"}


def test_qwen35_08b_config_and_specs(hf, tmp_path):
    c = makemodel.build_config("qwen3.5-0.8b")
    t, v = c["text_config"], c["vision_config"]
    assert c["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    # Qwen/Qwen3.5-0.8B's config.json.
    assert (
        t["hidden_size"],
        t["num_hidden_layers"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        t["head_dim"],
        t["intermediate_size"],
        t["vocab_size"],
        t["max_position_embeddings"],
    ) == (1024, 24, 8, 2, 256, 3584, 248320, 262144)
    assert _pick(t, "linear_num_key_heads", "linear_num_value_heads") == (16, 16)
    assert _pick(t, "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim") == (128, 128, 4)
    assert t["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 6
    assert t["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert t["rope_parameters"]["rope_theta"] == 10000000 and t["partial_rotary_factor"] == 0.25
    assert c["tie_word_embeddings"] is t["tie_word_embeddings"] is True
    assert _pick(v, "depth", "hidden_size", "num_heads", "intermediate_size") == (12, 768, 12, 3072)
    assert _pick(v, "num_position_embeddings", "out_hidden_size", "patch_size") == (2304, 1024, 16)

    specs = makemodel.tensor_specs(c)
    shapes = {name: shape for name, shape, _ in specs}
    assert len(shapes) == len(specs)
    assert "lm_head.weight" not in shapes  # tied
    assert shapes["model.language_model.embed_tokens.weight"] == (248320, 1024)
    assert shapes["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == (6144, 1024)
    assert shapes["model.language_model.layers.0.linear_attn.conv1d.weight"] == (6144, 1, 4)
    assert shapes["model.language_model.layers.3.self_attn.q_proj.weight"] == (4096, 1024)  # query + gate
    assert shapes["model.visual.merger.linear_fc2.weight"] == (1024, 3072)
    assert shapes["mtp.fc.weight"] == (1024, 2048)
    params = sum(numel(s) for s in shapes.values())
    mtp = sum(numel(s) for n, s in shapes.items() if n.startswith("mtp."))
    assert (params, mtp) == (873_438_784, 20_452_864)  # 852_985_920 in transformers + MTP

    # Exactly transformers' parameters (built on the meta device from the config, no weights),
    # plus the MTP layer, which transformers does not model.
    model = _meta_model(hf, c, tmp_path)
    assert type(model.config.text_config).__name__ == "Qwen3_5TextConfig"
    expected = {k: tuple(p.shape) for k, p in model.state_dict().items() if k != "lm_head.weight"}
    assert {n: s for n, s in shapes.items() if not n.startswith("mtp.")} == expected


@pytest.mark.parametrize("preset", QWEN35_TINY)
def test_qwen35_tiny_specs_match_transformers(hf, tmp_path, preset):
    c = makemodel.build_config(preset)
    specs = {n: s for n, s, _ in makemodel.tensor_specs(c) if not n.startswith("mtp.")}
    expected = {
        k: tuple(p.shape)
        for k, p in _meta_model(hf, c, tmp_path).state_dict().items()
        if k != "lm_head.weight"
    }
    assert specs == expected


def test_qwen35_vlm_loads_and_runs(hf, model_factory):
    import torch
    from safetensors import safe_open

    folder = model_factory("tiny-qwen3.5")
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in keys if k.startswith("model.")} == {
        "model.language_model",
        "model.visual",
    }
    assert "lm_head.weight" not in keys  # tied, as Qwen3.5-0.8B
    assert {
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.down_proj.weight",
    } <= keys

    model = _load_qwen35_vlm(hf, folder)
    assert model.dtype == torch.bfloat16
    vocab = qwen3_5.VOCAB_SIZE
    logits = _logits(model, QWEN35_IDS)
    assert logits.shape == (1, len(QWEN35_IDS), 4032) and torch.isfinite(logits).all()
    real = logits[0, :, :vocab]
    assert real.std() > 0.05 and not torch.allclose(real[0], real[1])
    assert (logits[0, :, vocab:] == 0).all()  # padding rows past the tokenizer
    # fp32 gives the same numbers up to bf16 rounding.
    logits32 = _logits(_load_qwen35_vlm(hf, folder, dtype=torch.float32), QWEN35_IDS)
    assert torch.isfinite(logits32).all() and (logits32 - logits).abs().max() < 0.05

    # AutoModelForCausalLM takes the text model out of the VLM checkpoint (Qwen3_5ForCausalLM,
    # model.language_model.* -> model.*, model.visual.* and mtp.* skipped): same logits.
    text = _load(hf, folder)
    assert type(text).__name__ == "Qwen3_5ForCausalLM"
    assert torch.equal(_logits(text, QWEN35_IDS), logits)


def test_qwen35_vlm_image_forward(hf, model_factory):
    import torch

    model = _load_qwen35_vlm(hf, model_factory("tiny-qwen3.5"), dtype=torch.float32)
    ids = qwen3_5.TOKEN_IDS
    # A 32 x 32 image: 2 x 2 patches of 16, merged 2 x 2 into one <|image_pad|> token.
    input_ids = torch.tensor(
        [[3992, 100, ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"], 200]]
    )
    pixels = torch.randn(4, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_image = model(
            input_ids=input_ids,
            pixel_values=pixels,
            image_grid_thw=torch.tensor([[1, 2, 2]]),
            mm_token_type_ids=(input_ids == ids["<|image_pad|>"]).int(),
        ).logits
        model.model.rope_deltas = None
        without = model(input_ids=input_ids).logits
    assert torch.isfinite(with_image).all()
    change = (with_image - without).abs().amax(-1)[0]
    assert (change[:3] == 0).all() and (change[3:] > 0).all()  # from the image token on


def test_qwen35_text_checkpoint_is_the_same_text_model(hf, model_factory):
    import torch
    from safetensors import safe_open

    folder = model_factory("tiny-qwen3.5-text")
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {k.split(".")[0] for k in keys} == {"model", "mtp"}
    assert "model.embed_tokens.weight" in keys and not any(k.startswith("model.visual") for k in keys)
    model = _load(hf, folder)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and model.dtype == torch.bfloat16
    # Text tensors are seeded under their text-only names: the VLM's text model, bit for bit.
    vlm = _load_qwen35_vlm(hf, model_factory("tiny-qwen3.5"))
    assert torch.equal(_logits(model, QWEN35_IDS), _logits(vlm, QWEN35_IDS))


def test_qwen35_init_rules(model_factory):
    from safetensors import safe_open

    with safe_open(model_factory("tiny-qwen3.5") / "model.safetensors", "pt") as f:
        get = lambda name: f.get_tensor(name).float()  # noqa: E731
        lm = "model.language_model.layers."
        a_log = get(lm + "0.linear_attn.A_log")
        assert (a_log.exp() > 0.0099).all() and (a_log.exp() < 16.1).all() and a_log.std() > 0.1
        dt_bias = get(lm + "0.linear_attn.dt_bias")
        assert (dt_bias - 1).abs().max() < 0.5  # ones, with the tiny presets' jitter
        conv = get(lm + "0.linear_attn.conv1d.weight")
        assert 0.01 < conv.std() < 0.03
        # Zero-centred RMSNorms (x * (1 + w)): near 0, jittered by 0.1 on tiny presets.
        for name in (lm + "0.input_layernorm.weight", lm + "3.self_attn.q_norm.weight", "mtp.norm.weight"):
            w = get(name)
            assert w.mean().abs() < 0.1 and 0.03 < w.std() < 0.3, name
        # The DeltaNet's gated norm and the vision LayerNorms multiply plainly: near 1.
        for name in (lm + "0.linear_attn.norm.weight", "model.visual.blocks.0.norm1.weight"):
            assert (get(name).mean() - 1).abs() < 0.1, name


def test_qwen35_08b_shrunk_exact_init(hf, model_factory):
    import torch
    from safetensors import safe_open

    # The qwen3.5-0.8b preset shrunk through overrides: no jitter, so the init rules show exactly.
    # layer_types, the mrope split and the vision tower's output size follow the new shapes.
    folder = model_factory(
        "qwen3.5-0.8b",
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        vocab_size=4096,
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 16,
        },
    )
    config = json.loads((folder / "config.json").read_text())
    t = config["text_config"]
    assert t["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert t["rope_parameters"]["mrope_section"] == [2, 1, 1]
    assert config["vision_config"]["out_hidden_size"] == 64 and config["vision_config"]["depth"] == 1
    with safe_open(folder / "model.safetensors", "pt") as f:
        get = lambda name: f.get_tensor(name)  # noqa: E731
        lm = "model.language_model."
        for name in (
            lm + "norm.weight",
            lm + "layers.3.self_attn.k_norm.weight",
            "mtp.pre_fc_norm_hidden.weight",
        ):
            assert (get(name) == 0).all(), name
        for name in (lm + "layers.0.linear_attn.dt_bias", lm + "layers.0.linear_attn.norm.weight"):
            assert (get(name) == 1).all(), name
        assert (get("model.visual.blocks.0.norm2.weight") == 1).all()
        assert (get("model.visual.blocks.0.norm2.bias") == 0).all()
        assert get(lm + "embed_tokens.weight").shape == (4096, 64)
    model = _load_qwen35_vlm(hf, folder)
    assert len(model.model.language_model.layers) == 4
    assert torch.isfinite(_logits(model, QWEN35_IDS)).all()


def test_qwen35_overrides_untie_and_deepen(hf, model_factory):
    import torch
    from safetensors import safe_open

    folder = model_factory("tiny-qwen3.5", tie_word_embeddings=False, num_hidden_layers=8)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is config["text_config"]["tie_word_embeddings"] is False
    assert config["text_config"]["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (4032, 64)
    model = _load_qwen35_vlm(hf, folder)
    assert model.lm_head.weight.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr()
    assert torch.isfinite(_logits(model, QWEN35_IDS)).all()
    assert makemodel.PRESETS["tiny-qwen3.5"]["text_config"]["num_hidden_layers"] == 4


@pytest.mark.parametrize("preset", QWEN35_TINY)
def test_qwen35_special_tokens_are_single_ids(hf, model_factory, raw_tokenizer, preset):
    from tokenizers import Tokenizer

    folder = model_factory(preset)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok = hf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = qwen3_5.TOKEN_IDS
    assert raw.get_vocab_size() == qwen3_5.VOCAB_SIZE == 4005
    for token in QWEN35_SPECIAL + qwen3_5.VISION_TOKENS:
        assert raw.encode(token).ids == [ids[token]], token
        assert tok(f"a{token}b").input_ids == raw.encode(f"a{token}b").ids
        assert ids[token] in tok(f"a{token}b").input_ids
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # Text encodes as with the other presets' tokenizer; transformers agrees (Qwen3_5Tokenizer for
    # the VLM folder, Qwen2Tokenizer for the text one).
    for text in TEXTS:
        assert raw.encode(text).ids == raw_tokenizer.encode(text).ids
        assert tok(text).input_ids == raw.encode(text).ids and tok.decode(raw.encode(text).ids) == text
    decoder = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {int(k): v["content"] for k, v in decoder.items()} == {i: t for t, i in ids.items()}
    assert all(decoder[str(ids[t])]["special"] for t in qwen3_5.VISION_TOKENS)


def test_qwen35_same_seed_same_bytes(tmp_path, model_factory):
    reference = _files_digest(model_factory("tiny-qwen3.5"))
    assert _files_digest(makemodel.make_model("tiny-qwen3.5", tmp_path / "again")) == reference
    other = _files_digest(makemodel.make_model("tiny-qwen3.5", tmp_path / "other", seed=1))
    assert other["model.safetensors"] != reference["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in reference.items() if k != "model.safetensors"
    }
    # A new process retrains the tokenizer and redraws the weights.
    code = f"from makemodel import make_model; make_model('tiny-qwen3.5', {str(tmp_path / 'fresh')!r})"
    subprocess.run(
        [sys.executable, "-c", code], check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO_ROOT
    )
    assert _files_digest(tmp_path / "fresh") == reference


def test_qwen35_chat_template_thinking_and_images(hf, model_factory):
    tok = hf.AutoTokenizer.from_pretrained(model_factory("tiny-qwen3.5"), local_files_only=True)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nA cat."},
        {"role": "user", "content": "Sure?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
        "<|im_start|>assistant\nA cat.<|im_end|>\n"  # reasoning of earlier turns is dropped
        "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n<think>\n"  # thinking by default
    )
    no_think = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think == text + "\n</think>\n\n"
    answered = messages + [{"role": "assistant", "content": "Yes.", "reasoning_content": "\nLooked again.\n"}]
    assert tok.apply_chat_template(answered, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nLooked again.\n</think>\n\nYes.<|im_end|>\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    special = qwen3_5.TOKEN_IDS
    assert ids[0] == special["<|im_start|>"] and ids[-2:] == [special["<think>"], 198]
    assert ids.count(special["<|image_pad|>"]) == 1


def test_qwen35_chat_template_tools(hf, model_factory):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok = hf.AutoTokenizer.from_pretrained(model_factory("tiny-qwen3.5"), local_files_only=True)
    conversation = json.loads(json.dumps(CONVERSATION))
    conversation[2]["tool_calls"][0]["function"]["arguments"] = {
        "city": "Zürich",
        "days": 2,
        "units": {"t": "C"},
    }
    text = tok.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nvalue\n</parameter>\n" in text
    assert "\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Zürich?<|im_end|>\n" in text
    assert (
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
        '<parameter=days>\n2\n</parameter>\n<parameter=units>\n{"t": "C"}\n</parameter>\n</function>\n</tool_call>\n'
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
    ) in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n12 °C\n</tool_response>\n<tool_response>\n"
        "10 °C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    # Plain jinja2 (with an HF-style tojson) renders it as transformers does.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    ours = env.from_string(qwen3_5.CHAT_TEMPLATE).render(
        messages=conversation, tools=TOOLS, add_generation_prompt=True
    )
    assert ours == text


# ---------------------------------------------------------------------------------------- CLI


def test_cli_list(capsys):
    assert cli(["--list"]) == 0
    out = capsys.readouterr().out
    for name in makemodel.PRESETS:
        assert name in out


def test_cli_writes_tiny(tmp_path, tiny_model, capsys):
    assert cli(["--preset", "tiny", "--out", str(tmp_path / "m")]) == 0
    assert _files_digest(tmp_path / "m") == _files_digest(tiny_model)
    assert (
        cli(
            [
                "--preset",
                "tiny",
                "--out",
                str(tmp_path / "f"),
                "--seed",
                "3",
                "--dtype",
                "float16",
                "--set",
                "num_hidden_layers=1",
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "f" / "config.json").read_text())
    assert config["torch_dtype"] == "float16" and config["num_hidden_layers"] == 1
    assert cli(["--preset", "tiny"]) == 2


def test_pantheon_entry_point(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pantheon", "make-model", "--list"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    )
    assert "qwen3-0.6b" in out.stdout
