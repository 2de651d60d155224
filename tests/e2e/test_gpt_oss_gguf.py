"""gpt-oss GGUF files written by llama.cpp's own converter load as the model of their source folder.

``tiny-gpt-oss`` is converted by the real ``convert_hf_to_gguf.py`` (``helpers.llama_convert``) to
f32, once from the plain folder (the converter splits the interleaved gate/up into
``ffn_gate_exps`` / ``ffn_up_exps`` and transposes every expert stack to rows) and once from the
MXFP4 folder (``make_model(mxfp4=True)``: the converter keeps the experts MXFP4, repacked into
ggml's blocks, which ``workers/gguf_weights.py`` dequantizes). What the file does not say and
``pantheon.core.archs.gpt_oss.gguf_config`` supplies: the layer pattern (llama.cpp's: sliding
from the first layer, every other one), the SwiGLU's constants, YaRN's ``truncate: false``.
Checked as the description and the logits (a 40-token prompt past the 16-token window, then
greedy decode steps) against the folder's.

Each conversion is a subprocess of a few seconds, once per module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pantheon.core.archs.gpt_oss import FULL, SLIDING, gguf_config
from pantheon.core.description import read_description
from pantheon.core.gguf import GGUFFile, read_gguf
from pantheon.core.protocol import SamplingParams
from workers.engine import Engine

from helpers.llama_convert import convert

PROMPT = [7, 300, 12, 99, 5, 1000, 42, 17, 256, 3, 77, 1500, 8, 64, 900, 11, 23, 400, 6, 88] * 2


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    """``get(mxfp4) -> (folder, gguf path)``, each converted once for the module."""
    out = tmp_path_factory.mktemp("gpt-oss-gguf")
    done: dict[bool, tuple[Path, Path]] = {}

    def get(mxfp4: bool) -> tuple[Path, Path]:
        if mxfp4 not in done:
            folder = model_factory("tiny-gpt-oss", dtype="float32", **({"mxfp4": True} if mxfp4 else {}))
            done[mxfp4] = folder, convert(folder, out / f"{'mxfp4' if mxfp4 else 'plain'}.gguf", "f32")
        return done[mxfp4]

    return get


def _greedy(path: Path, n: int = 8) -> tuple[list[int], torch.Tensor]:
    eng = Engine(str(path), dtype="float32")
    rows: list[torch.Tensor] = []
    eng.on_logits = lambda _seqs, logits: rows.append(logits[0].clone())
    eng.submit("g", PROMPT, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while eng.has_work():
        out += [o.token for o in eng.step()]
    prompt = eng.prompt_logits(PROMPT)
    eng.close()
    return out, torch.cat((prompt, torch.stack(rows)))


def test_gguf_config_reads_the_gpt_oss_keys():
    raw = {"num_hidden_layers": 5, "rope_scaling": {"rope_type": "yarn", "factor": 32.0}}
    meta = {
        "general.architecture": "gpt-oss",
        "gpt-oss.expert_count": 32,
        "gpt-oss.expert_used_count": 4,
        "gpt-oss.expert_feed_forward_length": 2880,
        "gpt-oss.attention.sliding_window": 128,
    }
    gguf_config(GGUFFile(path=Path("/m/g.gguf"), version=3, meta=meta, tensors={}), raw)
    assert raw["layer_types"] == [SLIDING, FULL, SLIDING, FULL, SLIDING] and raw["sliding_window"] == 128
    assert (raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"]) == (32, 4, 2880)
    assert raw["rope_scaling"]["truncate"] is False and raw["swiglu_limit"] == 7.0


@pytest.mark.slow
@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
def test_the_file_is_the_folders_model(files, mxfp4):
    folder, path = files(mxfp4)
    g = read_gguf(path)
    assert g.arch == "gpt-oss"
    experts = {t.type_name for n, t in g.tensors.items() if "_exps.weight" in n}
    assert experts == ({"MXFP4"} if mxfp4 else {"F32"})
    a, b = read_description(path), read_description(folder)
    assert a.layers == b.layers and a.layer_types == b.layer_types and a.rope == b.rope
    assert (a.swiglu_alpha, a.swiglu_limit, a.num_experts_per_tok) == (b.swiglu_alpha, b.swiglu_limit, 4)
    tokens, logits = _greedy(path)
    want_tokens, want = _greedy(folder)
    assert tokens == want_tokens
    assert (logits - want).abs().max().item() < 1e-5
