"""Qwen3.5 GGUF files written by llama.cpp's own converter load as the model of their source folder.

The random-weight ``tiny-qwen3.5-text`` (``Qwen3_5ForCausalLM``) and ``tiny-qwen3.5`` (the Hub's
``Qwen3_5ForConditionalGeneration``: vision tower, ``mtp.*``) folders are converted by the real
``convert_hf_to_gguf.py`` (``helpers.llama_convert``): f32 with the multi-token-prediction block (the
converter's default: it becomes block 4, ``nextn_predict_layers`` 1), f32 with ``--no-mtp``, and
q8_0. Both presets hold the same text model (same seeds), with 2 key and 4 value heads in linear
attention, so the converter's value-head re-tiling shows, and every norm jittered. What
``tests/unit/test_llama_convert.py`` pins about the converter's output is what the engine undoes here
(``pantheon.core.archs.qwen3_5.gguf_config``, ``workers.models.qwen3_5.gguf_name`` /
``from_gguf``), checked three ways: the description, every tensor, and the logits.

Each conversion is a subprocess of ~5 s (torch and transformers imports) made once per module
(``files``); the module takes about 40 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pantheon.core.archs.qwen3_5 import FULL, LINEAR, gguf_config
from pantheon.core.gguf import GGUFError, GGUFFile, GGUFTensor, read_gguf
from workers.errors import LoadError
from workers.gguf_weights import iter_tensors
from workers.model_config import load_config
from workers.models.qwen3_5 import checkpoint_name

from helpers.engines import Engines, assert_same_logits, greedy
from helpers.llama_convert import convert

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88]
DECODE_STEPS = 8
F32_TOL = 1e-5
# Q8_0 keeps 32 weights as int8 times one fp16 scale d = absmax / 127: a weight is off by at most
# d / 2 (rounding) plus 127 d 2^-11 (the scale's fp16 rounding), 0.0045 of its block's absmax,
# so of its row's absmax.
Q8_0_WEIGHT_TOL = 1 / 200
# The logits of the tiny model (std ~0.16, max ~1.4) move by ~0.006 under Q8_0 (4 layers and the
# head); 0.05 leaves 8x that. The f32 files are the strict test of the layout (any one
# transformation left undone moves a logit by more than 1e-3).
Q8_0_LOGIT_TOL = 0.05

# (folder preset, converter outtype, with the MTP block)
TEXT_F32 = ("tiny-qwen3.5-text", "f32", True)
MTP_F32 = ("tiny-qwen3.5", "f32", True)
NO_MTP_F32 = ("tiny-qwen3.5", "f32", False)
MTP_Q8_0 = ("tiny-qwen3.5", "q8_0", True)
FILES = [TEXT_F32, MTP_F32, NO_MTP_F32, MTP_Q8_0]
F32_FILES = [TEXT_F32, MTP_F32, NO_MTP_F32]


def _id(case) -> str:
    preset, outtype, mtp = case
    return f"{'text' if preset.endswith('-text') else 'hub'}-{outtype}{'' if mtp else '-no-mtp'}"


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    """``get(case) -> (folder, gguf path)``, each converted once for the module."""
    out = tmp_path_factory.mktemp("qwen35-gguf")
    done: dict[tuple, tuple[Path, Path]] = {}

    def get(case) -> tuple[Path, Path]:
        if case not in done:
            preset, outtype, mtp = case
            folder = model_factory(preset, dtype="float32")
            path = convert(folder, out / f"{_id(case)}.gguf", outtype, () if mtp else ("--no-mtp",))
            done[case] = folder, path
        return done[case]

    return get


engine = Engines()
_close_engines = engine.fixture()


# ---------------------------------------------------------------- the metadata (no converter)

BASE_META = {
    "general.architecture": "qwen35",
    "qwen35.block_count": 5,
    "qwen35.nextn_predict_layers": 1,
    "qwen35.ssm.conv_kernel": 4,
    "qwen35.ssm.state_size": 16,
    "qwen35.ssm.group_count": 2,
    "qwen35.ssm.time_step_rank": 4,
    "qwen35.ssm.inner_size": 64,
    "qwen35.attention.recurrent_layers": [True, True, True, False, False],
    "qwen35.full_attention_interval": 4,
}


def _config(tensors=(), **changes) -> dict:
    """``gguf_config`` on BASE_META with ``changes`` (dots as __; None removes a key) and a file
    holding (only) the named 1-D ``tensors``."""
    meta = dict(BASE_META)
    for k, v in changes.items():
        key = "qwen35." + k.replace("__", ".")
        if v is None:
            meta.pop(key, None)
        else:
            meta[key] = v
    raw: dict = {}
    held = {n: GGUFTensor(n, 0, "F32", (64,), 0, 256) for n in tensors}
    gguf_config(GGUFFile(path=Path("/m/q.gguf"), version=3, meta=meta, tensors=held), raw)
    return raw


def test_gguf_config_reads_the_qwen35_keys():
    assert _config() == {
        "attention_bias": False,
        "num_hidden_layers": 4,  # block_count less the MTP block
        "layer_types": [LINEAR, LINEAR, LINEAR, FULL],  # recurrent_layers without the MTP block
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,  # inner_size / time_step_rank
        "mtp_num_hidden_layers": 1,  # in the file, not loaded: the description lists it as skipped
    }
    # --no-mtp: no nextn key, block_count the text model's
    raw = _config(block_count=4, nextn_predict_layers=None, attention__recurrent_layers=[True, False] * 2)
    assert raw["num_hidden_layers"] == 4 and raw["layer_types"] == [LINEAR, FULL] * 2
    assert raw["mtp_num_hidden_layers"] == 0
    # no recurrent_layers: every full_attention_interval-th layer (default 4), as llama.cpp reads it
    assert (
        _config(attention__recurrent_layers=None, full_attention_interval=2)["layer_types"]
        == [
            LINEAR,
            FULL,
        ]
        * 2
    )
    both = dict(attention__recurrent_layers=None, full_attention_interval=None)
    assert _config(**both)["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL]
    # q/k/v biases: looked for in the first full-attention block (the base looks in block 0)
    assert _config(tensors=["blk.3.attn_q.bias"])["attention_bias"] is True
    # a list of only the text model's layers is taken as well
    assert _config(attention__recurrent_layers=[True, True, False, False])["layer_types"] == [
        LINEAR,
        LINEAR,
        FULL,
        FULL,
    ]


@pytest.mark.parametrize(
    "changes, field, message",
    [
        (dict(nextn_predict_layers=5), "nextn_predict_layers", "an integer from 0 to 4"),
        (dict(nextn_predict_layers=-1), "nextn_predict_layers", "got -1"),
        (dict(nextn_predict_layers="1"), "nextn_predict_layers", "got '1'"),
        (dict(block_count=0), "block_count", "a positive integer"),
        (dict(attention__recurrent_layers=[True] * 3), "attention.recurrent_layers", "5 booleans"),
        (dict(attention__recurrent_layers=[1, 1, 1, 0, 0]), "attention.recurrent_layers", "5 booleans"),
        (dict(attention__recurrent_layers=[True] * 5), "attention.recurrent_layers", "multi-token"),
        (dict(attention__recurrent_layers=None, full_attention_interval=0), "full_attention_interval", ""),
        (dict(ssm__group_count=None), "ssm.group_count", "missing"),
        (dict(ssm__state_size=0), "ssm.state_size", "a positive integer"),
        (dict(ssm__conv_kernel=True), "ssm.conv_kernel", "a positive integer"),
        (dict(ssm__time_step_rank=None), "ssm.time_step_rank", "missing"),
        (dict(ssm__inner_size=62), "ssm.inner_size", "not a multiple of 'qwen35.ssm.time_step_rank'"),
    ],
)
def test_gguf_config_names_the_bad_field(changes, field, message):
    with pytest.raises(GGUFError) as e:
        _config(**changes)
    assert e.value.kind == "invalid"
    assert f"'qwen35.{field}'" in e.value.reason and message in e.value.reason
    assert "/m/q.gguf" in e.value.reason


# ---------------------------------------------------------------- converted files


@pytest.mark.slow
@pytest.mark.parametrize("case", FILES, ids=_id)
def test_description_matches_the_folder(files, case):
    folder, path = files(case)
    g = read_gguf(path)
    _, outtype, mtp = case
    assert g.meta["qwen35.block_count"] == (5 if mtp else 4)
    assert g.meta.get("qwen35.nextn_predict_layers") == (1 if mtp else None)
    assert ("blk.4.nextn.eh_proj.weight" in g.tensors) == mtp
    assert g.tensors["blk.0.attn_qkv.weight"].type_name == outtype.upper()
    want, got = load_config(folder), load_config(path)
    for field in (
        "layer_types",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "conv_kernel",
        "rotary_dim",
        "num_layers",
        "vocab_size",
        "tie_word_embeddings",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "attention_bias",
        "rope",
        "layers",  # per layer: its kind, linear shapes and cache (KV or recurrent state)
        "recurrent_layers",
        "max_position_embeddings",
        "bos_token_id",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)  # stored as float32
    assert got.rotary_dim == 4 and got.layer_types == (LINEAR, LINEAR, LINEAR, FULL)


@pytest.mark.slow
@pytest.mark.parametrize("case", FILES, ids=_id)
def test_every_tensor_matches_the_folder(files, case):
    """Each tensor the engine takes from the file, named and laid out back as the checkpoint has it
    (``gguf_name`` / ``from_gguf``), equals the folder's: to float32 rounding for f32 (norms come
    back from 1 + w, A_log from -exp(A_log)), to Q8_0's bound for q8_0 (which catches any row or
    column order left undone: the weights themselves are ~0.02). MTP tensors are named but not
    loaded; nothing the text model has is missing."""
    folder, path = files(case)
    hf = {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if (name := checkpoint_name(name)) is not None:
            hf[name] = w.float()
    g = read_gguf(path)
    cfg = load_config(path)
    seen = set()
    for _file, label, name, w in iter_tensors(g, cfg, set(hf)):
        want = hf[name]
        assert w.shape == want.shape, label
        w = w.float()
        if case[1] == "f32":
            torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-6, msg=label)
        else:
            bound = want.abs().amax(dim=-1, keepdim=True) * Q8_0_WEIGHT_TOL + 1e-7
            err = (w - want).abs()
            assert (err <= bound).all(), (label, (err / bound).max().item())
        seen.add(name)
    assert seen == set(hf)


@pytest.mark.slow
@pytest.mark.parametrize("case", F32_FILES, ids=_id)
def test_f32_file_gives_the_folders_logits(files, case):
    folder, path = files(case)
    # decode steps too (the recurrent state step and the paged cache, not the prefill path)
    assert_same_logits(engine(path), engine(folder), PROMPT, 4032, DECODE_STEPS, F32_TOL)


@pytest.mark.slow
def test_q8_0_file_stays_close_to_the_folder(files):
    folder, path = files(MTP_Q8_0)
    want = engine(folder).prompt_logits(PROMPT)
    got = engine(path).prompt_logits(PROMPT)
    assert got.shape == want.shape
    assert 0 < (got - want).abs().max().item() < Q8_0_LOGIT_TOL
    # Greedy decoding: each token the file's model picks is, by the folder's model in the same
    # context, within 2 Q8_0_LOGIT_TOL of the best (equal tokens unless two logits nearly tie).
    tokens, _ = greedy(engine(path), PROMPT, DECODE_STEPS)
    assert len(tokens) == DECODE_STEPS
    ref = engine(folder).prompt_logits(PROMPT + tokens)[len(PROMPT) - 1 : -1]
    picked = ref[torch.arange(DECODE_STEPS), torch.tensor(tokens)]
    assert (ref.max(dim=-1).values - picked).max().item() <= 2 * Q8_0_LOGIT_TOL


@pytest.mark.slow
def test_a_bad_qwen35_key_is_a_load_error(files):
    """Through the worker's config path: the GGUFError is a LoadError naming the file and field."""
    _, path = files(NO_MTP_F32)
    g = read_gguf(path)
    bad = dataclasses.replace(g, meta={**g.meta, "qwen35.ssm.inner_size": 63})
    from workers.model_config import gguf_config as worker_gguf_config

    with pytest.raises(LoadError) as e:
        worker_gguf_config(bad)
    assert e.value.kind == "invalid"
    assert "'qwen35.ssm.inner_size'" in e.value.reason and str(path) in e.value.reason


def test_the_mtp_head_reads_as_from_its_folder(files):
    """The converter's block 4 (the head's layer) and ``nextn.*`` tensors are the folder's
    ``mtp.*`` (norms back from 1 + w): the same head weights, the same drafts; a file without
    the block (``--no-mtp``) has no head to draft with."""
    from workers.engine import Engine

    from helpers.decode_rows import drain
    from helpers.decode_rows import greedy as params

    folder, path = files(MTP_F32)
    ours = [Engine(str(p), dtype="float32", kv_budget_bytes=4 << 20, draft="mtp") for p in (folder, path)]
    try:
        a, b = (e.draft.model.own() for e in ours)
        for ma, mb in zip(a, b):
            sa, sb = ma.state_dict(), mb.state_dict()
            assert sa.keys() == sb.keys()
            for k in sa:
                torch.testing.assert_close(sb[k], sa[k], rtol=0, atol=1e-6, msg=k)
        answers = []
        for e in ours:
            e.submit("m", PROMPT, params(3, n=16))
            answers.append(drain(e)["m"])
        assert answers[0] == answers[1] and ours[1].spec.drafted > 0
    finally:
        for e in ours:
            e.close()
    with pytest.raises(LoadError, match="no multi-token-prediction head"):
        Engine(str(files(NO_MTP_F32)[1]), dtype="float32", kv_budget_bytes=4 << 20, draft="mtp")


@pytest.mark.slow
def test_a_load_imports_neither_dynamo_nor_sympy(files):
    """A GGUF load on a CPU path runs no meta-device op of torch's Python references (asking a
    family whether it transforms a tensor, allocating the parameters): their first call imports
    ``torch._dynamo`` (1.4 s) or sympy (0.7 s), which a Qwen3.5 load paid, and the engine needs
    neither without compiling. A fresh interpreter, as a worker's load."""
    import subprocess
    import sys

    _folder, path = files(MTP_Q8_0)
    code = (
        "import sys\n"
        "from workers.engine import Engine\n"
        f"Engine({str(path)!r}, cpu_path='int8', num_slots=1, kv_budget_bytes=1 << 22, compile_decode=False)\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
