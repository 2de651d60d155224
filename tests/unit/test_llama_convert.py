"""What llama.cpp's own ``convert_hf_to_gguf.py`` writes, checked against the source safetensors.

The converter is the one vendored in the llama-cpp-python sdist that ``bench/peer.py`` pins
(``helpers.llama_convert``; downloaded from PyPI on first use, ~77 MB, then cached). Every
converting test converts small random-weight folders (each conversion is a subprocess of ~5 s:
torch and transformers imports), hence ``slow``; the whole module takes about a minute on 2 cores.

- Qwen3.5 (``qwen35``): a tiny ``Qwen3_5ForCausalLM`` (3 linear-attention layers, then 1 full
  attention layer; 2 key heads and 4 value heads in linear attention, so the converter's V-head
  reordering shows) with every parameter random, norms included. The tables below are the layout a
  GGUF loader for qwen35 must undo: tensor names and shapes (``LINEAR`` / ``FULL`` / ``TOP``), the
  value transformations (``_forward``: the converter's, checked numerically; ``hf_from_gguf``: the
  inverse a loader applies, checked to give back the safetensors values), the metadata keys
  (``QWEN35_META``).
- ``Qwen3_5ForConditionalGeneration`` (the Hub's layout: ``model.language_model.*``, ``mtp.*``,
  ``model.visual.*``): the same text tensors; ``mtp.*`` become layer ``N`` (``blk.4.nextn.*``)
  unless ``--no-mtp``; the vision tower goes only into a separate ``--mmproj`` file.
- The ``tiny`` (qwen3) and ``tiny-llama`` presets: the names (``PRESET_TOP`` / ``PRESET_LAYER``),
  the values (unchanged but llama's q/k row permutation), the engine's GGUF name table agreeing,
  and the file's tokenizer (``tokenizer.ggml.pre`` "qwen2") encoding as the folder's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from makemodel import tokenizer_train as tt
from pantheon.core.gguf import GGUFFile, read_gguf

from helpers.llama_convert import ConvertError, convert, pre_tokenizer_name

# ---------------------------------------------------------------- the tiny Qwen3.5

H, FF, VOCAB = 64, 128, 4032
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
NK, NV, DK, DV, KERNEL = 2, 4, 16, 16, 4  # linear attention: key heads, value heads, their dims, conv
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
TEXT_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=H,
    intermediate_size=FF,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    linear_num_key_heads=NK,
    linear_num_value_heads=NV,
    linear_key_head_dim=DK,
    linear_value_head_dim=DV,
    linear_conv_kernel_dim=KERNEL,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    # head_dim 16 * 0.25 = 4 rotary dims = 2 frequencies, split [1, 1, 0] over (t, h, w)
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000000.0,
        partial_rotary_factor=0.25,
        mrope_section=[1, 1, 0],
        mrope_interleaved=True,
    ),
    tie_word_embeddings=False,
    bos_token_id=tt.TOKEN_IDS[tt.BOS_TOKEN],
    eos_token_id=tt.TOKEN_IDS[tt.EOS_TOKEN],
    pad_token_id=tt.TOKEN_IDS[tt.PAD_TOKEN],
)
VISION_CONFIG = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=H,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    in_channels=3,
)
CONV_DIM = 2 * NK * DK + NV * DV

# GGUF name (per layer) -> (HF name under model.layers.N., torch shape in the GGUF)
COMMON = {
    "attn_norm.weight": ("input_layernorm.weight", (H,)),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", (H,)),
    "ffn_gate.weight": ("mlp.gate_proj.weight", (FF, H)),
    "ffn_up.weight": ("mlp.up_proj.weight", (FF, H)),
    "ffn_down.weight": ("mlp.down_proj.weight", (H, FF)),
}
LINEAR = {
    **COMMON,
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", (CONV_DIM, H)),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", (NV * DV, H)),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", (NV, H)),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", (NV, H)),
    "ssm_a": ("linear_attn.A_log", (NV,)),
    "ssm_dt.bias": ("linear_attn.dt_bias", (NV,)),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", (CONV_DIM, KERNEL)),
    "ssm_norm.weight": ("linear_attn.norm.weight", (DV,)),
    "ssm_out.weight": ("linear_attn.out_proj.weight", (H, NV * DV)),
}
FULL = {
    **COMMON,
    "attn_q.weight": ("self_attn.q_proj.weight", (2 * HEADS * HEAD_DIM, H)),  # query and gate
    "attn_k.weight": ("self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, H)),
    "attn_v.weight": ("self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, H)),
    "attn_output.weight": ("self_attn.o_proj.weight", (H, HEADS * HEAD_DIM)),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", (HEAD_DIM,)),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", (HEAD_DIM,)),
}
TOP = {
    "token_embd.weight": ("model.embed_tokens.weight", (VOCAB, H)),
    "output_norm.weight": ("model.norm.weight", (H,)),
    "output.weight": ("lm_head.weight", (VOCAB, H)),
}
# MTP (Hub checkpoints): mtp.* -> block N = num_hidden_layers, a full-attention layer plus these
NEXTN = {
    "nextn.eh_proj.weight": ("mtp.fc.weight", (H, 2 * H)),
    "nextn.enorm.weight": ("mtp.pre_fc_norm_embedding.weight", (H,)),
    "nextn.hnorm.weight": ("mtp.pre_fc_norm_hidden.weight", (H,)),
    "nextn.shared_head_norm.weight": ("mtp.norm.weight", (H,)),
}

QWEN35_META = {
    "general.architecture": "qwen35",
    "general.type": "model",
    "general.file_type": 0,  # ALL_F32
    "general.quantization_version": 2,
    "qwen35.block_count": 4,  # num_hidden_layers (+ mtp_num_hidden_layers unless --no-mtp)
    "qwen35.context_length": 4096,  # max_position_embeddings
    "qwen35.embedding_length": H,  # hidden_size
    "qwen35.feed_forward_length": FF,  # intermediate_size
    "qwen35.attention.head_count": HEADS,  # num_attention_heads
    "qwen35.attention.head_count_kv": KV_HEADS,  # num_key_value_heads
    "qwen35.attention.key_length": HEAD_DIM,  # head_dim
    "qwen35.attention.value_length": HEAD_DIM,  # head_dim
    "qwen35.attention.layer_norm_rms_epsilon": 1e-6,  # rms_norm_eps (float32)
    "qwen35.rope.freq_base": 10000000.0,  # rope_parameters.rope_theta
    "qwen35.rope.dimension_count": 4,  # int(head_dim * partial_rotary_factor)
    "qwen35.rope.dimension_sections": [1, 1, 0, 0],  # mrope_section padded to 4 ([11,11,10,0] if absent)
    "qwen35.ssm.conv_kernel": KERNEL,  # linear_conv_kernel_dim
    "qwen35.ssm.state_size": DK,  # linear_key_head_dim
    "qwen35.ssm.group_count": NK,  # linear_num_key_heads
    "qwen35.ssm.time_step_rank": NV,  # linear_num_value_heads
    "qwen35.ssm.inner_size": NV * DV,  # linear_value_head_dim * linear_num_value_heads
    "qwen35.attention.recurrent_layers": [True, True, True, False],  # layer_types == linear_attention
    "qwen35.full_attention_interval": 4,  # full_attention_interval, default 4 (not from layer_types)
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "qwen2",  # named by helpers.llama_convert (unknown hash)
    "tokenizer.ggml.bos_token_id": tt.TOKEN_IDS[tt.BOS_TOKEN],
    "tokenizer.ggml.eos_token_id": tt.TOKEN_IDS[tt.EOS_TOKEN],
    "tokenizer.ggml.padding_token_id": tt.TOKEN_IDS[tt.PAD_TOKEN],
    "tokenizer.ggml.add_bos_token": False,
    "tokenizer.ggml.add_eos_token": False,
}
# also present, values not pinned: general.name, general.size_label, tokenizer.ggml.tokens /
# token_type / merges, tokenizer.chat_template
QWEN35_OTHER_KEYS = {
    "general.name",
    "general.size_label",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.chat_template",
}


def expected_tensors(n_layers: int = 4, mtp: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name in a Qwen3_5ForCausalLM folder, GGUF torch shape)."""
    out = dict(TOP)
    for i, kind in enumerate(LAYER_TYPES[:n_layers]):
        table = LINEAR if kind == "linear_attention" else FULL
        out |= {f"blk.{i}.{g}": (f"model.layers.{i}.{h}", s) for g, (h, s) in table.items()}
    if mtp:
        n = len(LAYER_TYPES)
        out |= {f"blk.{n}.{g}": (f"mtp.layers.0.{h}", s) for g, (h, s) in FULL.items()}
        out |= {f"blk.{n}.{g}": (h, s) for g, (h, s) in NEXTN.items()}
    return out


# ---------------------------------------------------------------- the converter's transformations


def v_tiled(n: int, group: int) -> np.ndarray:
    """The converter's V-head reordering as an index: file row ``i`` is HF row ``perm[i]``. HF keeps
    value heads grouped by key head ([k0: v0 v1][k1: v0 v1]); the file tiles them ([v0: k0 k1]
    [v1: k0 k1]) for ggml's broadcast. ``group`` is the rows per head (1 for per-head scalars)."""
    assert n == NV * group
    return np.arange(n).reshape(NK, NV // NK, group).transpose(1, 0, 2).reshape(-1)


def _norm_plus_one(gguf: str) -> bool:
    """RMSNorm weights stored as 1 + w (Qwen3.5's zero-centred norms); the gated linear-attention
    norm (ssm_norm) multiplies by w itself and is stored as is."""
    return gguf.endswith("norm.weight") and not gguf.endswith("ssm_norm.weight")


def _forward(gguf: str, w: np.ndarray) -> np.ndarray:
    """The converter's transformation of HF tensor ``w`` into GGUF tensor ``gguf`` (f32)."""
    tail = gguf.split(".", 2)[-1] if gguf.startswith("blk.") else gguf
    if _norm_plus_one(gguf):
        return w + np.float32(1)
    if tail == "ssm_a":
        return -np.exp(w)[v_tiled(NV, 1)]
    if tail in ("ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight"):
        return w[v_tiled(NV, 1)]
    if tail == "attn_gate.weight":
        return w[v_tiled(NV * DV, DV)]
    if tail == "attn_qkv.weight":  # q and k rows as they are, the v rows tiled
        return np.concatenate([w[: 2 * NK * DK], w[2 * NK * DK :][v_tiled(NV * DV, DV)]])
    if tail == "ssm_conv1d.weight":  # [C, 1, K] -> [C, K], v channels tiled
        w = w[:, 0, :]
        return np.concatenate([w[: 2 * NK * DK], w[2 * NK * DK :][v_tiled(NV * DV, DV)]])
    if tail == "ssm_out.weight":  # the input columns tiled
        return w[:, v_tiled(NV * DV, DV)]
    return w


def hf_from_gguf(gguf: str, w: np.ndarray) -> np.ndarray:
    """The inverse a loader applies: GGUF tensor -> the HF parameter's values and shape."""
    tail = gguf.split(".", 2)[-1] if gguf.startswith("blk.") else gguf
    if _norm_plus_one(gguf):
        return w - np.float32(1)
    if tail == "ssm_a":  # A_log = log(-ssm_a)
        return np.log(-w[np.argsort(v_tiled(NV, 1))])
    if tail in ("ssm_dt.bias", "ssm_alpha.weight", "ssm_beta.weight"):
        return w[np.argsort(v_tiled(NV, 1))]
    if tail == "attn_gate.weight":
        return w[np.argsort(v_tiled(NV * DV, DV))]
    if tail in ("attn_qkv.weight", "ssm_conv1d.weight"):
        w = np.concatenate([w[: 2 * NK * DK], w[2 * NK * DK :][np.argsort(v_tiled(NV * DV, DV))]])
        return w[:, None, :] if tail == "ssm_conv1d.weight" else w
    if tail == "ssm_out.weight":
        return w[:, np.argsort(v_tiled(NV * DV, DV))]
    return w


# ---------------------------------------------------------------- files


def _randomize(model, seed: int) -> None:
    """Every parameter random (norms and A_log too, so that no transformation hides)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim == 1 else 0.02))


def _mtp_tensors(seed: int) -> dict[str, np.ndarray]:
    """The ``mtp.*`` tensors of a Hub Qwen3.5 checkpoint (transformers has no module for them)."""
    rng = np.random.default_rng(seed)
    shapes = {h: s for h, s in NEXTN.values()}
    shapes |= {f"mtp.layers.0.{h}": s for h, s in FULL.values()}
    return {
        k: (rng.standard_normal(s) * (0.5 if len(s) == 1 else 0.02)).astype(np.float32)
        for k, s in shapes.items()
    }


def write_qwen35(out: Path, *, conditional: bool = False, seed: int = 0) -> Path:
    """A tiny random-weight Qwen3.5 folder (float32 safetensors, our trained tokenizer).
    ``conditional``: the Hub layout (``Qwen3_5ForConditionalGeneration`` with a one-block vision
    tower, ``mtp.*`` tensors and a preprocessor_config.json)."""
    import transformers
    from safetensors.numpy import load_file, save_file

    transformers.logging.set_verbosity_error()
    out.mkdir(parents=True, exist_ok=True)
    if conditional:
        ids = {
            k: tt.BPE_VOCAB_SIZE + 4 + i
            for i, k in enumerate(("image", "video", "vision_start", "vision_end"))
        }
        cfg = transformers.Qwen3_5Config(
            text_config=dict(TEXT_CONFIG, mtp_num_hidden_layers=1),
            vision_config=VISION_CONFIG,
            tie_word_embeddings=False,
            **{f"{k}_token_id": v for k, v in ids.items()},
        )
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT_CONFIG))
    model = model.float()
    _randomize(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    tt.write_tokenizer(out, model_max_length=TEXT_CONFIG["max_position_embeddings"])
    if conditional:
        weights = load_file(out / "model.safetensors") | _mtp_tensors(seed + 1)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        (out / "preprocessor_config.json").write_text(
            json.dumps(
                {
                    "image_mean": [0.5] * 3,
                    "image_std": [0.5] * 3,
                    "patch_size": 16,
                    "temporal_patch_size": 2,
                    "merge_size": 2,
                }
            )
        )
    return out


def hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The folder's tensors as float32 numpy arrays (bf16 ones exactly widened)."""
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}


def gguf_tensors(g: GGUFFile) -> dict[str, np.ndarray]:
    """The file's tensors (all F32 here) as numpy arrays in torch shape order."""
    data = np.memmap(g.path, dtype=np.uint8, mode="r")
    out = {}
    for t in g.tensors.values():
        assert t.type_name == "F32", (t.name, t.type_name)
        out[t.name] = data[t.offset : t.offset + t.nbytes].view(np.float32).reshape(t.shape)
    return out


def _check_values(g: GGUFFile, hf: dict[str, np.ndarray], names: dict[str, tuple[str, tuple]]) -> None:
    got = gguf_tensors(g)
    for name, (hf_name, _) in names.items():
        w = hf[hf_name]
        np.testing.assert_allclose(got[name], _forward(name, w), rtol=1e-6, atol=0, err_msg=name)
        back = hf_from_gguf(name, got[name])
        assert back.shape == w.shape, name
        np.testing.assert_allclose(back, w, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------- tests


def test_pre_tokenizer_name(model_factory, tmp_path):
    """Our trained tokenizer splits with Qwen2's regex: llama.cpp's "qwen2"."""
    assert pre_tokenizer_name(model_factory("tiny")) == "qwen2"
    assert pre_tokenizer_name(tmp_path) is None  # no tokenizer.json


@pytest.mark.slow
def test_convert_error_has_the_converter_output(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(ConvertError, match="NoSuchForCausalLM"):
        convert(tmp_path, tmp_path / "out.gguf")


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """(HF folder, converted GGUF) for the tiny Qwen3_5ForCausalLM (``--no-mtp``: it has none)."""
    folder = write_qwen35(tmp_path_factory.mktemp("qwen35"))
    return folder, read_gguf(convert(folder, folder.parent / "qwen35.gguf", "f32", ["--no-mtp"]))


@pytest.mark.slow
def test_qwen35_tensor_names_and_shapes(qwen35):
    folder, g = qwen35
    want = expected_tensors()
    assert {n: t.shape for n, t in g.tensors.items()} == {n: s for n, (_, s) in want.items()}
    assert {h for h, _ in want.values()} == set(hf_tensors(folder))  # every HF tensor is used once


@pytest.mark.slow
def test_qwen35_transformations(qwen35):
    folder, g = qwen35
    hf = hf_tensors(folder)
    _check_values(g, hf, expected_tensors())
    got = gguf_tensors(g)
    # the facts, spelled out on layer 0 (linear attention) and layer 3 (full attention)
    a_log = hf["model.layers.0.linear_attn.A_log"]
    np.testing.assert_allclose(got["blk.0.ssm_a"], -np.exp(a_log[[0, 2, 1, 3]]), rtol=1e-6)
    np.testing.assert_array_equal(
        got["blk.0.ssm_dt.bias"], hf["model.layers.0.linear_attn.dt_bias"][[0, 2, 1, 3]]
    )
    np.testing.assert_array_equal(
        got["blk.0.attn_norm.weight"], hf["model.layers.0.input_layernorm.weight"] + np.float32(1)
    )
    np.testing.assert_array_equal(got["blk.0.ssm_norm.weight"], hf["model.layers.0.linear_attn.norm.weight"])
    np.testing.assert_array_equal(got["blk.3.attn_q.weight"], hf["model.layers.3.self_attn.q_proj.weight"])
    z = hf["model.layers.0.linear_attn.in_proj_z.weight"].reshape(NK, NV // NK, DV, H)  # [k][v] heads
    np.testing.assert_array_equal(got["blk.0.attn_gate.weight"], z.transpose(1, 0, 2, 3).reshape(NV * DV, H))


@pytest.mark.slow
def test_qwen35_metadata(qwen35):
    _, g = qwen35
    meta = dict(g.meta)
    for key, want in QWEN35_META.items():
        assert key in meta, key
        if isinstance(want, float):
            assert meta[key] == pytest.approx(want, rel=1e-6), key
        else:
            assert meta[key] == want, (key, meta[key])
    # nothing else: no rope scaling keys, no nextn_predict_layers, no ssm_*_rank beyond these
    assert set(meta) - set(QWEN35_META) - QWEN35_OTHER_KEYS <= {
        k for k in meta if k.startswith(("general.sampling.", "GGUF.", "general.alignment"))
    }, sorted(set(meta) - set(QWEN35_META) - QWEN35_OTHER_KEYS)
    assert len(meta["tokenizer.ggml.tokens"]) == VOCAB


@pytest.mark.slow
def test_qwen35_conditional_generation(tmp_path):
    """The Hub layout: language_model.* are the same tensors; mtp.* become block 4 unless
    --no-mtp; the vision tower is left out (only --mmproj writes it, as a separate clip file)."""
    folder = write_qwen35(tmp_path / "hf", conditional=True, seed=3)
    hf = {k.replace("model.language_model.", "model."): v for k, v in hf_tensors(folder).items()}

    g = read_gguf(convert(folder, tmp_path / "with-mtp.gguf"))
    want = expected_tensors(mtp=True)
    assert {n: t.shape for n, t in g.tensors.items()} == {n: s for n, (_, s) in want.items()}
    _check_values(g, hf, want)
    assert g.meta["qwen35.block_count"] == 5
    assert g.meta["qwen35.nextn_predict_layers"] == 1
    assert g.meta["qwen35.attention.recurrent_layers"] == [True, True, True, False, False]

    g = read_gguf(convert(folder, tmp_path / "no-mtp.gguf", extra_args=["--no-mtp"]))
    assert {n: t.shape for n, t in g.tensors.items()} == {n: s for n, (_, s) in expected_tensors().items()}
    assert g.meta["qwen35.block_count"] == 4 and "qwen35.nextn_predict_layers" not in g.meta

    g = read_gguf(convert(folder, tmp_path / "mmproj.gguf", extra_args=["--mmproj"]))
    assert g.meta["general.architecture"] == "clip" and g.meta["general.type"] == "mmproj"
    assert g.meta["clip.projector_type"] == "qwen3vl_merger"
    assert g.tensors and all(n.startswith(("v.", "mm.")) for n in g.tensors), list(g.tensors)
    vis = hf_tensors(folder)
    got = gguf_tensors(g)
    patch = vis["model.visual.patch_embed.proj.weight"]  # Conv3d [C, 3, t=2, p, p] -> two Conv2d
    np.testing.assert_array_equal(got["v.patch_embd.weight"], patch[:, :, 0])
    np.testing.assert_array_equal(got["v.patch_embd.weight.1"], patch[:, :, 1])
    np.testing.assert_array_equal(got["mm.0.weight"], vis["model.visual.merger.linear_fc1.weight"])
    np.testing.assert_array_equal(
        got["v.blk.0.attn_qkv.weight"], vis["model.visual.blocks.0.attn.qkv.weight"]
    )


# qwen3 / llama GGUF names (per layer) -> HF names, as the converter writes them for our presets
PRESET_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when tie_word_embeddings (tiny)
}
PRESET_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",  # qwen35 calls it post_attention_norm
    "attn_q.weight": "self_attn.q_proj.weight",  # llama: rows permuted per head
    "attn_k.weight": "self_attn.k_proj.weight",  # llama: rows permuted per head
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3 only
    "attn_k_norm.weight": "self_attn.k_norm.weight",  # qwen3 only
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: per head, rotate-half rows to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _engine_gguf_name():
    """The engine's GGUF -> HF name function (``workers.models.llama.gguf_name``, formerly
    ``workers.gguf_weights.hf_name``); None when neither is there."""
    try:
        from workers.models.llama import gguf_name

        return gguf_name
    except ImportError:
        pass
    try:
        from workers.gguf_weights import hf_name  # pyright: ignore[reportAttributeAccessIssue]

        return hf_name
    except ImportError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_preset_names(preset, model_factory, tmp_path):
    """Our presets through the real converter: the names above, the values unchanged but for
    llama's q/k row permutation, and the engine's GGUF name table agreeing."""
    folder = model_factory(preset)
    cfg = json.loads((folder / "config.json").read_text())
    g = read_gguf(convert(folder, tmp_path / f"{preset}.gguf"))
    assert g.arch == {"tiny": "qwen3", "tiny-llama": "llama"}[preset]
    assert g.meta["tokenizer.ggml.pre"] == "qwen2"
    # the file's tokenizer, as Pantheon rebuilds it, encodes as the folder's
    from tokenizers import Tokenizer

    from pantheon.core.gguf_tokenizer import tokenizer_json

    text = "Hello, world! 12345 <|im_start|>user\nÇa va?<|im_end|>\n  tabs\tand  spaces"
    want = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert Tokenizer.from_str(tokenizer_json(g)).encode(text).ids == want
    hf = hf_tensors(folder)
    got = gguf_tensors(g)
    names = {k: v for k, v in PRESET_TOP.items() if v in hf}
    for i in range(cfg["num_hidden_layers"]):
        names |= {f"blk.{i}.{k}": f"model.layers.{i}.{v}" for k, v in PRESET_LAYER.items()}
    names = {k: v for k, v in names.items() if v in hf}
    assert set(got) == set(names)
    for name, target in names.items():
        w = hf[target]
        if g.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _llama_permute(
                w, cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            )
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    engine = _engine_gguf_name()
    if engine is None:
        pytest.skip("no GGUF name table in workers/ to compare with")
    assert {n: engine(n) for n in got} == names
