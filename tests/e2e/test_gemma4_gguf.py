"""Gemma 4 GGUF files written by llama.cpp's own converter load as the model of their source folder.

The random-weight ``tiny-gemma4`` and ``tiny-gemma4-moe`` folders (every text feature of the family
at once: global layers with their own head dim and KV heads, K as V, proportional RoPE, per-layer
embeddings, two KV-shared layers with a double-wide MLP; the 26B-A4B's routed experts in the MoE
one), written with Gemma's kind of tokenizer (``make_model(gemma_tokenizer=True)``: the converter
reads a Gemma 4 vocabulary only as a byte-fallback BPE), are converted by the real
``convert_hf_to_gguf.py`` (``helpers.llama_convert``) to f32, and the MoE one to q8_0 too.

What the converter does that the engine re-reads (``pantheon.core.archs.gemma4.gguf_config``,
``workers.models.gemma4.gguf_name``): per-layer arrays for the KV heads and FFN widths, the two
head dims as ``key_length`` / ``key_length_swa``, the full layers' proportional RoPE as the
tensor ``rope_freqs.weight`` (1e30 for the frequencies that do not rotate), K as V as the absence
of ``attn_v``, the embedding cut to the tokenizer's 4005 ids (the per-layer table is not cut), and
its ``gemma4`` tokenizer model (``pantheon.core.gguf_tokenizer.tokenizer_json``). Checked four ways: the
description, every tensor, the logits (a 40-token prompt: past the 16-token window, then greedy
decode), and a served q8_0 file through the ``openai`` client (``/v1/models``, ``/admin/dies``).

The three conversions (~5 s each on an idle host, subprocesses) run at once, once per module.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from pantheon.core.archs.gemma4 import FULL, SLIDING, gguf_config
from pantheon.core.gguf import GGUFError, GGUFFile, read_gguf
from pantheon.core.gguf_tokenizer import tokenizer_json
from pantheon.core.sizing import estimate, read_shape
from pantheon.models.assets import ModelAssets
from workers.gguf_weights import iter_tensors
from workers.model_config import load_config
from workers.models.gemma4 import checkpoint_name

from helpers.engines import Engines, assert_same_logits
from helpers.llama_convert import convert
from helpers.serve import Server

pytestmark = pytest.mark.timeout(300)

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88] * 2
DECODE_STEPS = 8
VOCAB = 4005  # the tokenizer's ids: the converter drops the embedding's padding rows (4032)
F32_TOL = 1e-5
Q8_0_WEIGHT_TOL = 1 / 200  # see tests/e2e/test_qwen35_gguf.py
Q8_0_LOGIT_TOL = 0.6  # see test_q8_0_file_stays_close_to_the_folder
PRESETS = {"dense": "tiny-gemma4", "moe": "tiny-gemma4-moe"}
FILES = [("dense", "f32"), ("moe", "f32"), ("moe", "q8_0")]


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """``(kind, outtype) -> (folder, gguf path)``, the three converted at once."""
    out = tmp_path_factory.mktemp("gemma4-gguf")
    folders = {k: model_factory(p, dtype="float32", gemma_tokenizer=True) for k, p in PRESETS.items()}
    with ThreadPoolExecutor(len(FILES)) as ex:
        paths = list(ex.map(lambda f: convert(folders[f[0]], out / f"{f[0]}-{f[1]}.gguf", f[1]), FILES))
    return {f: (folders[f[0]], p) for f, p in zip(FILES, paths)}


engine = Engines()
_close_engines = engine.fixture()


# ---------------------------------------------------------------- the metadata alone


def _config(tensors: tuple[str, ...] = (), **meta) -> dict:
    """``gguf_config`` over a six-layer file's metadata (``__`` for ``.`` in the keys)."""
    raw = {"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 1e6}
    raw["vocab_size"] = 4005
    full = {"general.architecture": "gemma4"}
    base = dict(
        attention__sliding_window_pattern=[True, True, False, True, True, False],
        attention__sliding_window=16,
        attention__key_length=32,
        attention__key_length_swa=16,
        attention__head_count_kv=[2, 2, 1, 2, 2, 1],
        feed_forward_length=[128, 128, 128, 128, 256, 256],
        attention__shared_kv_layers=2,
    )
    full.update({f"gemma4.{k.replace('__', '.')}": v for k, v in {**base, **meta}.items()})
    infos = {n: None for n in tensors}
    gguf_config(GGUFFile(path=Path("/m/g.gguf"), version=3, meta=full, tensors=infos), raw)  # pyright: ignore[reportArgumentType]
    return raw


def test_gguf_config_reads_the_gemma4_keys():
    raw = _config()
    assert raw["layer_types"] == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]
    assert (raw["head_dim"], raw["global_head_dim"], raw["num_key_value_heads"]) == (16, 32, 2)
    assert raw["per_layer_config"]["2"] == {"head_dim": 32, "num_key_value_heads": 1}
    assert raw["per_layer_config"]["0"] == {"head_dim": 16, "num_key_value_heads": 2}
    assert raw["intermediate_size"] == 128 and raw["use_double_wide_mlp"] is True
    assert raw["num_kv_shared_layers"] == 2 and raw["attention_k_eq_v"] is True  # no blk.2.attn_v
    assert raw["attention_k_eq_v"] is True and raw["enable_moe_block"] is False
    assert raw["hidden_size_per_layer_input"] is None  # no per-layer embeddings written
    assert raw["rope_parameters"][FULL] == {
        "rope_type": "proportional",
        "partial_rotary_factor": 1.0,  # no rope_freqs.weight: every frequency rotates
        "rope_theta": 1e6,
    }
    assert _config(("blk.2.attn_v.weight",))["attention_k_eq_v"] is False
    moe = _config(expert_count=8, expert_used_count=2, expert_feed_forward_length=32)
    assert (moe["num_experts"], moe["top_k_experts"], moe["moe_intermediate_size"]) == (8, 2, 32)
    assert _config(feed_forward_length=128, attention__shared_kv_layers=0)["use_double_wide_mlp"] is False
    with pytest.raises(GGUFError, match="feed_forward_length"):
        _config(feed_forward_length=[128, 256, 128, 128, 256, 256])
    with pytest.raises(GGUFError, match="sliding_window_pattern"):
        _config(attention__sliding_window_pattern=4)


# ---------------------------------------------------------------- the converted files


@pytest.mark.slow
@pytest.mark.parametrize("which", FILES, ids=["-".join(f) for f in FILES])
def test_description_matches_the_folder(files, which):
    folder, path = files[which]
    g = read_gguf(path)
    assert g.arch == "gemma4" and "rope_freqs.weight" in g.tensors
    want, got = load_config(folder), load_config(path)
    for field in (
        "attn",  # per layer: kind, head dim, KV heads, K as V, KV sharing, MLP width
        "layers",  # per layer: linear shapes, cache (window, shared) and experts
        "sliding_window",
        "rope",
        "global_rope",  # proportional: partial_rotary_factor 0.25 from rope_freqs.weight
        "final_logit_softcapping",
        "ple_dim",
        "ple_vocab",
        "moe_experts",
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "max_position_embeddings",
        "bos_token_id",
        "extra_params",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert got.vocab_size == VOCAB and got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    # the router's sizing: the same layers, caches and rings; the embedding 27 rows shorter
    a, b = estimate(read_shape(path), cpu_path="fp32"), estimate(read_shape(folder), cpu_path="fp32")
    assert (a.layer_bytes, a.kv_layer_bytes, a.state_layer_bytes) == (
        b.layer_bytes,
        b.kv_layer_bytes,
        b.state_layer_bytes,
    )
    assert b.total_params - a.total_params == (4032 - VOCAB) * want.hidden_size
    assert b.active_params - a.active_params == (4032 - VOCAB) * want.hidden_size
    if which[0] == "moe":
        assert a.active_params < a.total_params


@pytest.mark.slow
@pytest.mark.parametrize("which", FILES, ids=["-".join(f) for f in FILES])
def test_every_tensor_matches_the_folder(files, which):
    folder, path = files[which]
    hf = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if (name := checkpoint_name(name)) is not None:
            hf[name] = w.float()
    hf["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"][:VOCAB]
    seen = set()
    for _file, label, name, w in iter_tensors(read_gguf(path), load_config(path), set(hf)):
        want, w = hf[name], w.float()
        assert w.shape == want.shape, label
        if which[1] == "f32" or "F32" in label:  # norms, scales and the router stay f32
            torch.testing.assert_close(w, want, rtol=0, atol=0, msg=label)
        elif "F16" in label:  # rows too short for q8_0's blocks of 32
            torch.testing.assert_close(w, want, rtol=1e-3, atol=1e-5, msg=label)
        else:
            bound = want.abs().amax(dim=-1, keepdim=True) * Q8_0_WEIGHT_TOL + 1e-7
            assert ((w - want).abs() <= bound).all(), label
        seen.add(name)
    assert seen == set(hf)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_f32_file_gives_the_folders_logits(files, kind):
    folder, path = files[(kind, "f32")]
    assert_same_logits(engine(path), engine(folder), PROMPT, VOCAB, DECODE_STEPS, F32_TOL)


@pytest.mark.slow
def test_q8_0_file_stays_close_to_the_folder(files):
    """Close as its weights' rounding allows: this tiny model is sensitive (normed q and k with
    unscaled scores; the routing), so a bf16 copy of the folder itself is already this far off
    in places (max |diff| ~0.17, worst row cosine ~0.96, on logits of ~0.6 at most), and q8_0
    about twice that."""
    folder, path = files[("moe", "q8_0")]
    want = engine(folder).prompt_logits(PROMPT)[:, :VOCAB]
    got = engine(path).prompt_logits(PROMPT)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=1)
    assert 0 < (got - want).abs().max().item() < Q8_0_LOGIT_TOL
    assert cos.mean().item() > 0.98 and cos.min().item() > 0.8


@pytest.mark.slow
def test_the_files_tokenizer_is_the_folders(files):
    """llama.cpp's ``gemma4`` tokenizer model read back: the folder's ids for any text (spaces as
    U+2581, newline runs split, bytes outside the vocabulary as <0xHH>), BOS added as the file says."""
    from tokenizers import Tokenizer

    folder, path = files[("dense", "f32")]
    ours = Tokenizer.from_str(tokenizer_json(read_gguf(path)))
    src = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert ours.get_vocab_size() == src.get_vocab_size() == VOCAB
    for text in [
        "Hello world, the café\n\nnaïve 🦙 <|turn>user\nHi<turn|>",
        "  indented\n\tcode()  ",
        "Привет мир 123",
        '<tool_call>{"a": 1}</tool_call>',
    ]:
        a, b = ours.encode(text, add_special_tokens=False).ids, src.encode(text, add_special_tokens=False).ids
        assert a == b, text
        assert ours.decode(a, skip_special_tokens=False) == src.decode(b, skip_special_tokens=False) == text
        assert ours.encode(text).ids == src.encode(text).ids == [3991, *a]  # BOS: <|endoftext|>
        assert ours.decode(a) == src.decode(b)  # the special tokens skipped alike
    # the turn markers special, as in the folder; the channel markers plain (the converter keeps
    # them visible for llama.cpp's chat parser)
    # a token's own text and bytes (logprobs): U+2581 as a space, raw UTF-8, <0xHH> as its byte
    assets = ModelAssets(path)
    for piece, raw in (("\u2581the\u2581", b" the "), ("af\u00e9", "afé".encode()), ("<0xF0>", b"\xf0")):
        tid = ours.token_to_id(piece)
        assert tid is not None and assets.piece(tid)[1] == raw, piece
    special = {
        t["content"] for t in json.loads(tokenizer_json(read_gguf(path)))["added_tokens"] if t["special"]
    }
    assert {"<|turn>", "<turn|>", "<|think|>", "<|im_start|>", "<|im_end|>"} <= special
    assert not {"<|channel>", "<channel|>", "<tool_call>"} & special


def split_gate_up(src: Path, dst: Path) -> Path:
    """``src`` rewritten with each ``ffn_gate_up_exps`` as two stacks, ``ffn_gate_exps`` and
    ``ffn_up_exps`` (the other layout llama.cpp's gemma4 loader takes), everything else as is."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_array(name, f.contents())
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for t in r.tensors:
        data = np.array(t.data)
        if t.name.endswith("ffn_gate_up_exps.weight"):  # [E, 2I, H] in torch order: gate, then up
            half = data.shape[1] // 2
            w.add_tensor(t.name.replace("gate_up", "gate"), np.ascontiguousarray(data[:, :half]))
            w.add_tensor(t.name.replace("gate_up", "up"), np.ascontiguousarray(data[:, half:]))
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.slow
def test_separate_gate_and_up_stacks_are_the_fused_one(files, tmp_path):
    _folder, path = files[("moe", "f32")]
    split = split_gate_up(path, tmp_path / "split.gguf")
    assert "blk.0.ffn_gate_exps.weight" in read_gguf(split).tensors
    got, want = engine(split).prompt_logits(PROMPT), engine(path).prompt_logits(PROMPT)
    assert (got - want).abs().max().item() < F32_TOL  # the same weights


# ---------------------------------------------------------------- served


@pytest.mark.slow
def test_a_served_q8_0_file_is_described_and_answers(files, tmp_path):
    _folder, path = files[("moe", "q8_0")]
    s = Server(["--model", str(path), "--dies", "cpu:0", "--cpu-dies", "1"], tmp_path / "serve.log")
    name = "moe"  # the file's stem without its quantization tag
    try:
        s.wait_ready((name,))
        (m,) = s.client().models.list().data
        assert m.id == name and (m.model_extra or {})["max_model_len"] == 4096
        d = {x["die"]: x for x in httpx.get(s.url + "/admin/dies", timeout=10).json()["data"]}["cpu:0"]
        inst = d["instances"][0]
        booked = d["bookings"][inst["instance"]]
        est = estimate(read_shape(path), cpu_path=inst.get("cpu_path") or "fp32")
        assert (
            est.kv_per_token > 0 and inst["kv_pool_tokens"] == booked["kv_bytes"] // est.kv_per_token >= 4096
        )
        assert booked["state_bytes"] > 0 and booked["state_bytes"] % est.state_per_slot == 0
        assert inst["params"] == {"total": est.total_params, "active": est.active_params}
        assert est.active_params < est.total_params  # two of eight experts a token
        r = s.client().chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None and r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 4
    finally:
        s.stop()
