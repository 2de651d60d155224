"""Gemma 3 GGUF files written by llama.cpp's own converter load as the model of their source folder.

The random-weight ``tiny-gemma3`` folder (every norm jittered) is converted by the real
``convert_hf_to_gguf.py`` (``helpers.llama_convert``) to f32 and q8_0. What the converter does that
the engine undoes or re-reads (``pantheon.core.archs.gemma3.gguf_config``,
``workers.models.gemma3.gguf_name`` / ``from_gguf``): norms stored as 1 + w; the window kept
(``attention.sliding_window``) but not the pattern (llama.cpp's default period 6) nor
``query_pre_attn_scalar`` (the head dim); the local RoPE base as ``rope.freq_base_swa``; the
embedding cut to the tokenizer's 4002 ids. Checked three ways: the description, every tensor, the
logits (a 40-token prompt: past the 16-token window).

Each conversion is a subprocess of ~5 s, once per module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pantheon.core.archs.gemma3 import FULL, SLIDING, gguf_config
from pantheon.core.gguf import GGUFFile, read_gguf
from workers.gguf_weights import iter_tensors
from workers.model_config import load_config
from workers.models.gemma3 import checkpoint_name

from helpers.engines import Engines, assert_same_logits
from helpers.llama_convert import convert

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88] * 2
DECODE_STEPS = 8
VOCAB = 4002  # the tokenizer's ids: the converter drops the embedding's padding rows
F32_TOL = 1e-5
Q8_0_WEIGHT_TOL = 1 / 200  # see tests/e2e/test_qwen35_gguf.py
Q8_0_LOGIT_TOL = 0.05


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    """``get(outtype) -> (folder, gguf path)``, each converted once for the module."""
    out = tmp_path_factory.mktemp("gemma3-gguf")
    folder = model_factory("tiny-gemma3", dtype="float32")
    done: dict[str, Path] = {}

    def get(outtype: str) -> tuple[Path, Path]:
        if outtype not in done:
            done[outtype] = convert(folder, out / f"{outtype}.gguf", outtype)
        return folder, done[outtype]

    return get


engine = Engines()
_close_engines = engine.fixture()


def _config(**meta) -> dict:
    raw = {"num_hidden_layers": 7, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}
    full = {"general.architecture": "gemma3"}
    full.update({f"gemma3.{k.replace('__', '.')}": v for k, v in meta.items()})
    gguf_config(GGUFFile(path=Path("/m/g.gguf"), version=3, meta=full, tensors={}), raw)
    return raw


def test_gguf_config_reads_the_gemma3_keys():
    raw = _config(attention__sliding_window=512)
    assert raw["layer_types"] == [SLIDING] * 5 + [FULL, SLIDING]  # llama.cpp's default period 6
    assert raw["sliding_window"] == 512 and raw["rope_local_base_freq"] == 10000.0
    assert raw["query_pre_attn_scalar"] == 16 and raw["final_logit_softcapping"] is None
    raw = _config(
        attention__sliding_window=512,
        attention__sliding_window_pattern=[True, False] * 3 + [True],
        rope__freq_base_swa=20000.0,
        final_logit_softcapping=30.0,
    )
    assert raw["layer_types"] == [SLIDING, FULL] * 3 + [SLIDING]
    assert raw["rope_local_base_freq"] == 20000.0 and raw["final_logit_softcapping"] == 30.0
    assert _config(attention__sliding_window=512, attention__sliding_window_pattern=2)["layer_types"] == [
        SLIDING,
        FULL,
    ] * 3 + [SLIDING]
    assert _config()["layer_types"] == [FULL] * 7  # no window: every layer global


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_description_matches_the_folder(files, outtype):
    folder, path = files(outtype)
    g = read_gguf(path)
    assert g.arch == "gemma3" and g.meta["gemma3.attention.sliding_window"] == 16
    want, got = load_config(folder), load_config(path)
    for field in (
        "layer_types",
        "layers",  # per layer: linear shapes and cache (window or not)
        "sliding_window",
        "rope",
        "local_rope",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "num_layers",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert got.vocab_size == VOCAB and got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_every_tensor_matches_the_folder(files, outtype):
    folder, path = files(outtype)
    hf = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if (name := checkpoint_name(name)) is not None:
            hf[name] = w.float()
    hf["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"][:VOCAB]
    g = read_gguf(path)
    seen = set()
    for _file, label, name, w in iter_tensors(g, load_config(path), set(hf)):
        want, w = hf[name], w.float()
        assert w.shape == want.shape, label
        if outtype == "f32" or w.ndim == 1:  # norms stay f32 in a q8_0 file
            torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-6, msg=label)
        else:
            bound = want.abs().amax(dim=-1, keepdim=True) * Q8_0_WEIGHT_TOL + 1e-7
            assert ((w - want).abs() <= bound).all(), label
        seen.add(name)
    assert seen == set(hf)


@pytest.mark.slow
def test_f32_file_gives_the_folders_logits(files):
    folder, path = files("f32")
    assert_same_logits(engine(path), engine(folder), PROMPT, VOCAB, DECODE_STEPS, F32_TOL)


@pytest.mark.slow
def test_q8_0_file_stays_close_to_the_folder(files):
    folder, path = files("q8_0")
    want = engine(folder).prompt_logits(PROMPT)[:, :VOCAB]
    got = engine(path).prompt_logits(PROMPT)
    assert 0 < (got - want).abs().max().item() < Q8_0_LOGIT_TOL
